"""The fuzz harness (fuzz/gguf_mutations.py): a fixed-seed slice of it, and proof that it
sees every kind of escape. The full run is ``nox -s fuzz``."""

from __future__ import annotations

import importlib.util
import struct
import sys
import tracemalloc
from pathlib import Path
from types import ModuleType

import pytest

from qllama.errors import GGUFTruncatedError, QllamaError
from qllama.gguf.reader import GGUFFile


def _harness() -> ModuleType:
    """fuzz/gguf_mutations.py, loaded by path: fuzz/ is a folder of the repository, not a
    package, and putting the repository root on sys.path would shadow the installed qllama."""
    path = Path(__file__).resolve().parents[1] / "fuzz" / "gguf_mutations.py"
    spec = importlib.util.spec_from_file_location("qllama_fuzz_gguf_mutations", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


fz = _harness()


@pytest.fixture(scope="module")
def seeds() -> dict[str, bytes]:
    return fz.build_seeds()


def test_the_seeds_are_valid_and_walked_completely(seeds: dict[str, bytes]) -> None:
    """The field map the mutations aim at is the file's real layout."""
    for name, data in seeds.items():
        f = GGUFFile.from_buffer(data)
        lay = fz.walk(data)
        assert [s.name for s in lay.kvs] == list(f.kv), name
        assert [s.name for s in lay.infos] == list(f.tensors), name
        assert (lay.data_offset, lay.alignment) == (f.data_offset, f.alignment), name
        assert [t.start for t in lay.tensors] == [f.data_offset + t.offset for t in f], name


def test_fixed_seed_slice() -> None:
    """80 mutated files through every target in a worker under RLIMIT_AS: no escape."""
    stats = fz.run(cases=80, seconds=120, seed=20260101, memory_mib=1024, timeout=20)
    assert [e.error for e in stats.escapes] == []
    assert stats.cases == 80
    assert len(stats.errors) >= 8  # the slice reaches many distinct checks
    assert stats.outcomes["loaded and ran"] > 0  # and some files still load and run
    assert stats.disagreements == 0 and stats.fd_leaks == 0
    assert stats.peak_rss_kib < 1024 * 1024


def test_every_header_and_info_field_at_every_edge(seeds: dict[str, bytes]) -> None:
    """Deterministic: each numeric field of the container seed (string lengths, counts,
    types, dims, offsets...) set to each edge value; parsing raises a QllamaError or
    succeeds, and never allocates much."""
    data = seeds["container"]
    fields = fz.walk(data).fields
    assert len(fields) > 100
    tracemalloc.start()
    for f in fields:
        for edge in fz.EDGE_VALUES:
            fmt = {"f": "<I", "d": "<Q"}.get(f.fmt[1], f.fmt.upper())  # floats as bit patterns
            value = struct.pack(fmt, edge % 2 ** (8 * f.size))
            mutated = data[: f.offset] + value + data[f.offset + f.size :]
            try:
                GGUFFile.from_buffer(mutated)
            except QllamaError:
                pass
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    assert peak < 16 << 20


def test_every_prefix_of_a_model_file(seeds: dict[str, bytes]) -> None:
    """A cut anywhere (every byte of the header and the first pairs, then every 7th to the
    data, every 97th in it) is a truncation; only cuts inside the final padding still parse."""
    data = seeds["gpt2-q8_0"]
    full = GGUFFile.from_buffer(data)
    last = max(full, key=lambda t: t.offset)
    end_of_data = full.data_offset + last.offset + last.nbytes
    start = full.data_offset
    cuts = [*range(1024), *range(1024, start, 7), *range(start, len(data), 97)]
    for cut in cuts:
        if cut >= end_of_data:
            GGUFFile.from_buffer(data[:cut])
            continue
        with pytest.raises(GGUFTruncatedError):
            GGUFFile.from_buffer(data[:cut])


@pytest.mark.parametrize(
    ("payload", "escape"),
    [
        (b"K", "KeyError: 'planted'"),
        (b"M", "MemoryError"),
        (b"X", "crash: the worker died (signal 11)"),
        (b"S", "timeout: no answer within 0.5 s"),
    ],
)
def test_the_harness_sees_each_kind_of_escape(payload: bytes, escape: str) -> None:
    worker = fz.Worker(memory_mib=512, timeout=0.5)
    try:
        assert worker.run("selftest", b"ok")["escape"] is None  # warm: imports done
        result = worker.run("selftest", payload)
        assert result["escape"] is not None and result["escape"].startswith(escape)
        planted = worker.run("selftest", b"R")  # a QllamaError is an outcome, not an escape
        assert planted["escape"] is None and planted["stages"] == [("selftest", "GGUFMagicError")]
    finally:
        worker.stop()
