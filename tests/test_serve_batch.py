"""``Model.forward_batch``: several sequences at different positions in one pass, each in its
own KV cache, against each sequence run alone with ``forward`` (every architecture).

What the batch may change, and what these tests hold it to:

- the CPU arithmetic on quantized weights: nothing. Each activation row is quantized by
  itself and its integer products are exact, the norms and element-wise steps are per row, and
  attention runs per sequence on the same shapes as alone. So the logits are equal bit for bit.
- float products (the GPU arithmetic, dequantize-all, F32 weights): the library's matmul may
  sum a row's products in another order when the batch has another number of rows, so the
  logits agree within the float32 reordering bound of a forward pass (tests/bounds.py).
"""

from __future__ import annotations

import dataclasses
import importlib.util
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from bounds import forward_bound
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from test_architectures import FAMILIES

import qllama
from qllama.array_api import to_numpy
from qllama.errors import InvalidTokenError, SequenceError
from qllama.runtime.model import SequenceStep
from qllama.synthetic import TinyConfig, write_tiny

IDS = [1, 40, 77, 200, 5, 260, 99, 3, 17, 150, 61, 222, 8, 130, 45, 250]
# (backend, options) of each arithmetic; the CPU one is the bit-exact case
CPU = ("numpy", {})
FLOAT_SETUPS = {
    "numpy-f32": ("numpy", {"activations": "f32"}),
    "numpy-dequantize-all": ("numpy", {"dequantize_all": True}),
    "torch": ("torch", {}),
    "jax": ("jax", {}),
    "array_api_strict": ("array_api_strict", {}),
}


def load(path: Path, setup: tuple[str, dict[str, Any]], **kw: Any) -> Any:
    backend, options = setup
    if importlib.util.find_spec(backend) is None:
        pytest.skip(f"{backend} is not installed")
    return qllama.load(path, backend=backend, **options, **kw)


# Three sequences in one pass: a fresh prompt, a decode step after 7 cached tokens, and a
# chunk of 6 with every position's logits after 4 cached ones (history, new ids, all_logits).
PLAN = [([], IDS[:5], False), (IDS[2:9], [IDS[9]], False), (IDS[6:10], IDS[10:16], True)]


def alone(m: Any, history: list[int], new: list[int], every: bool) -> np.ndarray:
    """The sequence by itself on the model's own cache: history, then the new ids."""
    if history:
        m.forward(history, pos=0)
    return to_numpy(m.forward(new, pos=len(history), all_logits=every))


def batched(m: Any, plan: list[tuple[list[int], list[int], bool]]) -> list[np.ndarray]:
    """Each history in its own cache (a one-sequence batch), then all new ids in one pass."""
    caches = [m.new_cache() for _ in plan]
    for cache, (history, _, _) in zip(caches, plan, strict=True):
        if history:
            m.forward_batch([SequenceStep(cache, history)])
    steps = [
        SequenceStep(cache, new, len(history), every)
        for cache, (history, new, every) in zip(caches, plan, strict=True)
    ]
    return [to_numpy(x) for x in m.forward_batch(steps)]


@pytest.fixture(scope="module", params=FAMILIES)
def family_q8(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Each architecture's tiny file with Q8_0 weights (the CPU arithmetic's integer path)."""
    path = tmp_path_factory.mktemp("batch") / f"{request.param}-q8.gguf"
    write_tiny(path, dataclasses.replace(FAMILIES[request.param], weight_type="Q8_0"))
    return path


@pytest.fixture(scope="module", params=FAMILIES)
def family_f32(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("batch") / f"{request.param}-f32.gguf"
    write_tiny(path, FAMILIES[request.param])
    return path


def test_cpu_arithmetic_batch_is_bit_exact(family_q8: Path) -> None:
    check_exact(load(family_q8, CPU))


def test_cpu_oracle_batch_is_bit_exact(tmp_path: Path) -> None:
    """The numpy oracle of the CPU arithmetic (the compiled kernels' reference) as well."""
    path = tmp_path / "llama-q8.gguf"
    write_tiny(path, dataclasses.replace(FAMILIES["llama"], weight_type="Q8_0"))
    check_exact(load(path, ("numpy", {"kernels": "numpy"})))


def check_exact(m: Any) -> None:
    got = batched(m, PLAN)
    for j, (history, new, every) in enumerate(PLAN):
        want = alone(m, history, new, every)
        assert got[j].shape == want.shape
        np.testing.assert_array_equal(got[j].view(np.uint32), want.view(np.uint32), f"seq {j}")


def test_float_batch_within_the_reordering_bound(family_f32: Path) -> None:
    m = load(family_f32, FLOAT_SETUPS["numpy-f32"])
    check_float(m, m.config)


@pytest.mark.parametrize("setup", [s for s in FLOAT_SETUPS if s != "numpy-f32"])
def test_float_batch_on_every_namespace(tmp_path: Path, setup: str) -> None:
    path = tmp_path / "llama.gguf"
    write_tiny(path, FAMILIES["llama"])
    m = load(path, FLOAT_SETUPS[setup])
    check_float(m, m.config)


def check_float(m: Any, c: Any) -> None:
    got = batched(m, PLAN)
    for j, (history, new, every) in enumerate(PLAN):
        want = alone(m, history, new, every)
        width = max(c.n_embd, c.n_ff, len(IDS))
        bound = forward_bound(c.n_layer, width, float(np.abs(want).max()))
        np.testing.assert_allclose(got[j], want, rtol=0, atol=bound, err_msg=f"seq {j}")


@pytest.fixture(scope="module")
def llama_q8(tmp_path_factory: pytest.TempPathFactory) -> Any:
    path = tmp_path_factory.mktemp("batch") / "llama-q8.gguf"
    write_tiny(path, TinyConfig(n_layer=2, n_embd=64, n_ff=128, weight_type="Q8_0", n_ctx=64))
    return load(path, CPU)


plans = st.lists(
    st.tuples(
        st.lists(st.integers(0, 268), max_size=12),  # history
        st.lists(st.integers(0, 268), min_size=1, max_size=9),  # new ids
        st.booleans(),
    ),
    min_size=1,
    max_size=5,
)


@settings(
    max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(plan=plans)
def test_any_batch_equals_each_sequence_alone(llama_q8: Any, plan: list[Any]) -> None:
    """Any mix of prompts, decode steps and chunks: the CPU arithmetic's bits do not move."""
    got = batched(llama_q8, plan)
    for j, (history, new, every) in enumerate(plan):
        want = alone(llama_q8, history, new, every)
        np.testing.assert_array_equal(got[j].view(np.uint32), want.view(np.uint32))


def test_one_sequence_batch_is_forward(llama_q8: Any) -> None:
    cache = llama_q8.new_cache()
    (got,) = llama_q8.forward_batch([SequenceStep(cache, IDS[:9], all_logits=True)])
    want = to_numpy(llama_q8.forward(IDS[:9], all_logits=True))
    np.testing.assert_array_equal(to_numpy(got).view(np.uint32), want.view(np.uint32))
    assert cache.length == 9 and llama_q8.forward_batch([]) == []


def test_bad_batches_touch_no_cache(llama_q8: Any) -> None:
    a, b = llama_q8.new_cache(), llama_q8.new_cache()
    llama_q8.forward_batch([SequenceStep(a, IDS[:5]), SequenceStep(b, IDS[:3])])
    with pytest.raises(SequenceError, match="share a KV cache"):
        llama_q8.forward_batch([SequenceStep(a, [1], 5), SequenceStep(a, [2], 5)])
    with pytest.raises(InvalidTokenError, match="outside"):
        llama_q8.forward_batch([SequenceStep(a, [1], 5), SequenceStep(b, [10**6], 3)])
    with pytest.raises(SequenceError, match="past the cached sequence of 3"):
        llama_q8.forward_batch([SequenceStep(a, [1], 5), SequenceStep(b, [1], 4)])
    assert (a.length, b.length) == (5, 3)  # every step is checked before any cache moves
