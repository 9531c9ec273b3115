"""``qllama imatrix`` against ``llama-imatrix`` on the same model and corpus.

Both run SmolLM2's F32 file over the same chunks (llama.cpp with float32 KV cache and without
flash attention, so that both compute in float32 throughout) and sum the squares of the
activations entering every block matmul. The names, token counts, chunk count and metadata
must be equal; the sums may differ by the rounding of two float32 forward passes, bounded
below.
"""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest
from bounds import forward_bound, gamma

from qllama.gguf import imatrix
from qllama.gguf.reader import read_gguf
from qllama.measure import importance
from qllama.model_files import variant

pytest.importorskip("llama_cpp")
pytestmark = [pytest.mark.peers, pytest.mark.model]

N_CTX = 256
N_CHUNKS = 3
ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> Path:
    """The project's own documentation: plain English, markdown and code, fixed."""
    parts = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
    path = tmp_path_factory.mktemp("corpus") / "corpus.txt"
    path.write_text("\n\n".join(p.read_text(encoding="utf-8") for p in parts), encoding="utf-8")
    return path


@pytest.fixture(scope="module", params=[0, 2], ids=["from-the-start", "chunk-2"])
def both(request, llama_tool, corpus, tmp_path_factory):
    """Both tools' matrices, from the corpus's start and from its chunk 2 (``--chunk``)."""
    skip = request.param
    f32 = variant("smollm2-135m-instruct", "F32")
    out = tmp_path_factory.mktemp("imatrix") / "llama.imatrix.gguf"
    args = ["-m", str(f32), "-f", str(corpus), "-o", str(out)]
    args += ["-c", str(N_CTX), "-b", str(N_CTX), "--chunks", str(N_CHUNKS), "-t", "2"]
    args += ["-fa", "off", "-ctk", "f32", "-ctv", "f32", "--no-ppl", "--chunk", str(skip)]
    run = llama_tool("llama-imatrix", *args, timeout=1800)
    assert run.returncode == 0, run.stderr[-3000:]
    text = corpus.read_text(encoding="utf-8")
    ours = importance.from_corpus(
        f32,
        text,
        n_ctx=N_CTX,
        n_chunks=N_CHUNKS,
        skip_chunks=skip,
        dataset=str(corpus),
        kv_precision="f32",
    )
    return ours, imatrix.read_imatrix(out), f32


def test_same_entries_counts_and_metadata(both):
    ours, theirs, _ = both
    assert sorted(ours.entries) == sorted(theirs.entries)
    assert (ours.chunk_count, ours.chunk_size) == (theirs.chunk_count, theirs.chunk_size)
    assert ours.datasets == theirs.datasets
    for name, e in ours.entries.items():
        t = theirs.entries[name]
        assert e.counts.tolist() == t.counts.tolist() == [N_CTX * N_CHUNKS], name
        assert e.sums.shape == t.sums.shape, name


def test_sums_agree_within_float32_rounding(both):
    """Bound: an activation row x_t of the two passes differs by at most eta * |x_t|
    elementwise, eta = forward_bound(...) relative (tests/bounds.py: the probabilistic model
    of a forward pass, every stage of all 30 layers, the longest reduction n_ff). Then for
    column j, sum_t (x'_tj**2 - x_tj**2) <= 2 eta sum_t |x_t| |x_tj| + eta**2 sum_t |x_t|**2
    <= 2 eta sqrt(R S_j) + eta**2 R (Cauchy-Schwarz), S_j = sum_t x_tj**2 and R = sum_j S_j;
    and each float32 sum of N squares is within gamma(N) S_j of its exact value."""
    ours, theirs, f32 = both
    f = read_gguf(f32)
    n_layer = int(f.get("llama.block_count"))
    width = max(int(f.get("llama.feed_forward_length")), N_CTX)
    eta = forward_bound(n_layer, width, 1.0)
    n = N_CTX * N_CHUNKS
    for name, e in ours.entries.items():
        s = e.sums[0].astype(np.float64)
        t = theirs.entries[name].sums[0].astype(np.float64)
        r = s.sum()
        bound = 2 * eta * np.sqrt(r * s) + eta**2 * r + 2 * gamma(n) * np.maximum(s, t)
        worst = np.max(np.abs(s - t) - bound)
        assert worst <= 0, f"{name}: exceeds the bound by {worst:.3g} (R = {r:.3g})"
        assert math.isfinite(r) and r > 0
