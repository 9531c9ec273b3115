"""qllama.runtime.routing: libstdc++'s std::sort, as ggml's argsort runs it, on ties.

The port is compared with the C++ library itself (a three-line program compiled here; skipped
where no C++ compiler is installed) on rows full of ties, of the lengths real routers have.
"""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import numpy as np
import pytest

from qllama.runtime.routing import THRESHOLD, break_ties, stdsort_desc

PROGRAM = r"""
#include <algorithm>
#include <cstdio>
#include <vector>
int main() {
    int n;
    while (scanf("%d", &n) == 1) {
        std::vector<float> d(n);
        for (auto & x : d) scanf("%f", &x);
        std::vector<int> idx(n);
        for (int i = 0; i < n; i++) idx[i] = i;
        std::sort(idx.begin(), idx.end(), [&d](int a, int b) { return d[a] > d[b]; });
        for (int i = 0; i < n; i++) printf("%d ", idx[i]);
        printf("\n");
    }
}
"""


@pytest.fixture(scope="module")
def std_sort(tmp_path_factory: pytest.TempPathFactory) -> Path:
    cxx = shutil.which("g++")
    if cxx is None:
        pytest.skip("no g++ to build libstdc++'s std::sort with")
    folder = tmp_path_factory.mktemp("stdsort")
    (folder / "s.cpp").write_text(PROGRAM)
    subprocess.run([cxx, "-O2", "-o", str(folder / "s"), str(folder / "s.cpp")], check=True)
    return folder / "s"


def tie_rows(seed: int, count: int) -> list[np.ndarray]:
    """Rows with many equal values: a few levels, all equal, sorted runs, organ pipes."""
    rng = np.random.default_rng(seed)
    rows = []
    for _ in range(count):
        n = int(rng.choice([17, 20, 32, 60, 64, 128, 256]))
        levels = int(rng.choice([1, 2, 3, 20]))
        v = rng.integers(0, levels, n).astype(np.float32)
        if rng.integers(3) == 0:
            v = np.sort(v)[:: 1 if rng.integers(2) else -1].copy()
        rows.append(v)
    for n in (64, 128, 512):
        half = np.arange(n // 2, dtype=np.float32)
        rows += [np.concatenate([half, half[::-1]]), np.concatenate([half[::-1], half])]
    return rows


def test_the_port_is_libstdcxx(std_sort: Path) -> None:
    rows = tie_rows(0, 800)
    text = "".join(f"{len(v)} " + " ".join(repr(float(x)) for x in v) + "\n" for v in rows)
    out = subprocess.run([str(std_sort)], input=text, capture_output=True, text=True, check=True)
    lines = out.stdout.splitlines()
    assert len(lines) == len(rows)
    for line, v in zip(lines, rows, strict=True):
        assert stdsort_desc(v) == [int(i) for i in line.split()], v.tolist()


def test_short_rows_and_untied_rows_keep_index_order() -> None:
    """Up to 16 values the insertion sort keeps equal values in index order; without ties in
    the top k nothing is re-ranked."""
    v = np.array([0.5, 0.5, 0.25, 0.5] * 4, np.float32)  # 16
    assert stdsort_desc(v) == sorted(range(16), key=lambda i: (-v[i], i))
    distinct = np.random.default_rng(1).permutation(40).astype(np.float32)[None, :]
    top = np.argsort(-distinct, axis=-1, kind="stable")[:, :4]
    assert break_ties(distinct, top) is None
    assert break_ties(v[None, :], top[:, :4]) is None  # 16 experts: index order is ggml's


def test_break_ties_re_ranks_only_tied_rows() -> None:
    rng = np.random.default_rng(2)
    values = rng.permutation(64 * 3).astype(np.float32).reshape(3, 64)
    values[1] = 1.0  # all equal: std::sort's order, not the index order
    k = 4
    top = np.argsort(-values, axis=-1, kind="stable")[:, :k]
    got = break_ties(values, top)
    assert got is not None and THRESHOLD < 64
    np.testing.assert_array_equal(got[[0, 2]], top[[0, 2]])
    assert got[1].tolist() == stdsort_desc(values[1])[:k] != list(range(k))
