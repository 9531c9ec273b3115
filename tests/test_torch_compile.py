"""The torch backend's compiled decode step (``compile=True``): the same model as the eager
one, compiled once, refused where it has no meaning; and the fixed KV cache it runs on.

The compiled step runs on the best device here: on a CPU inductor's C++ kernels (the default
mode), on CUDA a CUDA graph, which must then be recorded, not skipped (docs/gpu.md; run there
with ``benchmarks/gpu_check.py``).
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from bounds import agreeing_steps, forward_bound
from test_architectures import FAMILIES

import qllama
from qllama.array_api import namespace, to_numpy
from qllama.errors import BackendError
from qllama.runtime.kv_cache import KVCache
from qllama.runtime.loader import check_options
from qllama.synthetic import write_tiny

torch = pytest.importorskip("torch")
from torch._dynamo.utils import counters  # noqa: E402

from qllama.backends.torch import devices, tensors  # noqa: E402

DEVICE = devices()[0]  # the compiled step's tests: CUDA graphs where there is CUDA

PROMPT = [1, 40, 77, 200, 5]
NEW = 12  # decode steps: past gemma2's window of 4
# a dense family whose weights are unpacked from nibbles in the compiled graph, and a
# sliding-window one (with gemma2's soft-caps and its norms after each sublayer)
COMPILED = {
    "llama": dataclasses.replace(FAMILIES["llama"], weight_type="Q4_0"),
    "gemma2": dataclasses.replace(FAMILIES["gemma2"], weight_type="Q8_0"),
}


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("compile") / "llama.gguf"
    write_tiny(path, FAMILIES["llama"])
    return path


def bound(m: Any, logits: np.ndarray, positions: int) -> float:
    """How far two float32 evaluations of these logits may differ (tests/bounds.py): inductor
    fuses the elementwise ops and may reorder the reductions (norms, softmax sums), so the
    compiled step rounds otherwise than the eager one, and by rounding alone."""
    c = m.config
    return forward_bound(c.n_layer, max(c.n_embd, c.n_ff, positions), float(np.abs(logits).max()))


# --- the option -----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("backend", "options", "message"),
    [
        ("numpy", {"compile": True}, "compile"),
        ("torch", {"compile": "yes"}, "compile must be true or false"),
        ("torch", {"compile": 1}, "compile must be true or false"),
        ("torch", {"compiled": True}, "takes no options .'compiled'.; its one option is compile"),
    ],
)
def test_bad_compile_options_are_refused(
    tiny: Path, backend: str, options: dict[str, Any], message: str
) -> None:
    with pytest.raises(BackendError, match=message):
        qllama.load(tiny, backend=backend, device="cpu", **options)
    with pytest.raises(BackendError, match=message):  # and before any file is read
        check_options(backend, {"device": "cpu", **options})


def test_without_the_option_nothing_is_compiled(tiny: Path) -> None:
    m = qllama.load(tiny, backend="torch", device="cpu")
    assert m.compiled_step is None and not m.cache.fixed
    assert "compiled" not in m.backend.describe()
    m = qllama.load(tiny, backend="torch", device="cpu", compile=False)
    assert m.compiled_step is None


def test_the_option_fixes_the_cache_at_the_context(tiny: Path) -> None:
    """Nothing is compiled at load (torch.compile traces at the first call), but the cache
    is already fixed at the context's length, the RoPE tables as long."""
    m = qllama.load(tiny, backend="torch", device="cpu", compile=True, n_ctx=200)
    assert m.compiled_step is not None and m.cache.fixed and m.cache.length == 0
    assert m.cache.capacity == 256 and tuple(m.cache.k[0].shape) == (2, 256, 24)
    assert m._rope_positions == 256
    assert "decode step compiled (default)" in m.backend.describe()


# --- the fixed cache ------------------------------------------------------------------------


@pytest.mark.parametrize("xp_name", ["numpy", "torch"])
def test_a_fixed_cache_keeps_its_arrays(xp_name: str) -> None:
    xp = namespace(xp_name)
    cache = KVCache(2, 2, 4, xp)
    cache.fix(10)
    k0, v0 = cache.k[0], cache.v[0]
    cache.update(0, 0, xp.ones((3, 2, 4)), xp.ones((3, 2, 4)))
    cache.reset(0)  # a new sequence: the same arrays (what was written stays, masked)
    cache.reserve(200)
    assert cache.k[0] is k0 and cache.v[0] is v0 and cache.capacity == 256
    assert cache.length == 0 and float(xp.sum(cache.k[0])) == 24.0


@pytest.mark.parametrize("xp_name", ["numpy", "torch"])
def test_positions_as_an_array_write_the_same_rows(xp_name: str) -> None:
    """What a compiled step does (its position an array) is what a slice at pos does."""
    xp = namespace(xp_name)
    rng = np.random.default_rng(0)
    k, v = (xp.asarray(rng.standard_normal((3, 2, 4)).astype(np.float32)) for _ in range(2))
    by_int, by_array = KVCache(1, 2, 4, xp), KVCache(1, 2, 4, xp)
    for c in (by_int, by_array):
        c.reserve(10)
    by_int.update(0, 5, k, v)
    by_array.update(0, xp.asarray([5, 6, 7]), k, v)
    assert np.array_equal(to_numpy(by_int.k[0]), to_numpy(by_array.k[0]))
    assert np.array_equal(to_numpy(by_int.v[0]), to_numpy(by_array.v[0]))
    assert float(xp.sum(xp.abs(by_int.k[0][:, 5:8, :]))) > 0


def test_positions_as_an_array_need_in_place_writes() -> None:
    strict = pytest.importorskip("array_api_strict")
    cache = KVCache(1, 2, 4, strict)
    cache.reserve(4)
    x = strict.ones((1, 2, 4))
    with pytest.raises(BackendError, match="pos must be an int"):
        cache.update(0, strict.asarray([1]), x, x)


# --- the compiled step ----------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.parametrize("family", COMPILED)
def test_compiled_decode_is_the_eager_model(tmp_path: Path, family: str) -> None:
    """Teacher-forced along the eager greedy path, every compiled step's logits are the eager
    ones within float32 rounding; greedy decoding picks the same tokens up to the first near
    tie; the step is traced into one graph, once: later steps and a second sequence (on the
    same fixed cache, what the first left behind masked) compile nothing more."""
    path = tmp_path / f"{family}.gguf"
    write_tiny(path, COMPILED[family])
    eager = qllama.load(path, backend="torch", device=DEVICE)
    compiled = qllama.load(path, backend="torch", device=DEVICE, compile=True)
    want = eager.generate(PROMPT, max_new_tokens=NEW).ids

    graphs, breaks = counters["stats"]["unique_graphs"], sum(counters["graph_break"].values())
    skips = counters["inductor"]["cudagraph_skips"]
    got = compiled.generate(PROMPT, max_new_tokens=NEW).ids
    assert counters["stats"]["unique_graphs"] - graphs == 1  # the step, once
    assert sum(counters["graph_break"].values()) == breaks  # in one piece
    assert counters["inductor"]["cudagraph_skips"] == skips  # on CUDA, a CUDA graph

    # teacher forcing along the eager path: both models see the same tokens
    e, c = eager.forward(PROMPT), compiled.forward(PROMPT)  # prefill: eager in both
    margins, tols = [], []
    for pos, token in enumerate(want[:-1], start=len(PROMPT)):
        e = to_numpy(eager.forward([token], pos=pos))
        c = to_numpy(compiled.forward([token], pos=pos))
        tols.append(bound(eager, e, pos + 1))
        np.testing.assert_allclose(c, e, rtol=0, atol=tols[-1], err_msg=f"position {pos}")
        top = np.sort(e)[-2:]
        margins.append(float(top[1] - top[0]))
    # a step's top two may swap only if their margin is within the two logits' error
    agree = agreeing_steps(margins, 2 * max(tols))
    assert got[: agree + 1] == want[: agree + 1]
    assert counters["stats"]["unique_graphs"] - graphs == 1  # no recompile in all of that


@pytest.mark.slow
def test_compiled_step_is_bypassed_where_it_cannot_serve(tmp_path: Path) -> None:
    """An observer, the trace of non-finite values, or all the logits of several tokens run
    the eager pass; with the compiled step in between, a sequence stays one sequence."""
    path = tmp_path / "llama.gguf"
    write_tiny(path, FAMILIES["llama"])
    eager = qllama.load(path, backend="torch", device=DEVICE)
    compiled = qllama.load(path, backend="torch", device=DEVICE, compile=True)
    seen: list[str] = []
    want = to_numpy(eager.forward([*PROMPT, 9, 10], all_logits=True))  # (7, vocab)
    compiled.forward(PROMPT)
    step = to_numpy(compiled.forward([9], pos=5, all_logits=True))  # compiled: (1, vocab)
    observed = to_numpy(compiled.forward([10], pos=6, observer=lambda n, x: seen.append(n)))
    assert seen and "embedding" in seen
    tol = bound(eager, want, 7)
    np.testing.assert_allclose(step[0], want[5], rtol=0, atol=tol)
    np.testing.assert_allclose(observed, want[6], rtol=0, atol=tol)
    assert compiled.cache.length == 7
    # what CUDA graphs need: the arrays the step reads in place are marked static
    static = tensors(compiled._persistent())
    assert {id(compiled.cache.k[0]), id(compiled.weights.output_norm)} <= {id(t) for t in static}
    assert all(getattr(t, "_dynamo_static_input_type", None) == "unguarded" for t in static)
