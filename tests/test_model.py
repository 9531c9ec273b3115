"""The model on every backend: shapes, the KV cache, agreement, errors (a tiny synthetic file)."""

from __future__ import annotations

import importlib.util

import numpy as np
import pytest
from bounds import agreeing_steps, forward_bound, half_bound, q8_flip_bound

import qllama
from qllama.array_api import to_numpy
from qllama.errors import BackendError, ContextOverflowError, InvalidTokenError, SequenceError
from qllama.synthetic import TinyConfig, write_tiny_llama

# (backend, options): every arithmetic the model can run under
SETUPS = {
    "numpy-cpu": ("numpy", {}),
    "numpy-f32": ("numpy", {"activations": "f32"}),
    "numpy-dequantize-all": ("numpy", {"dequantize_all": True}),
    "torch": ("torch", {}),
    "torch-dequantize-all": ("torch", {"dequantize_all": True}),
    "jax": ("jax", {}),
    "array_api_strict": ("array_api_strict", {}),
}
IDS = [1, 40, 77, 200, 5, 260, 99, 3]
Q8_SETUPS = {"numpy-cpu"}  # the setups whose activations are rounded to Q8 blocks


def tolerance(m, logits, setup: str) -> float:
    """What two orders of summation may change in these logits (tests/bounds.py): float32
    rounding, or for the CPU arithmetic a Q8 rounding step that it may flip."""
    c, scale = m.config, float(np.abs(logits).max())
    if setup in Q8_SETUPS:
        return q8_flip_bound(c.n_layer, scale)
    return forward_bound(c.n_layer, max(c.n_embd, c.n_ff, len(IDS)), scale)


def load(path, setup: str, **kw):
    backend, options = SETUPS[setup]
    module = {"jax": "jax"}.get(backend, backend)
    if importlib.util.find_spec(module) is None:
        pytest.skip(f"{backend} is not installed")
    return qllama.load(path, backend=backend, **options, **kw)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """Q8_0 weights, 256 wide (so K-quant variants fit too), grouped-query attention."""
    path = tmp_path_factory.mktemp("model") / "tiny-q8.gguf"
    write_tiny_llama(
        path, TinyConfig(n_embd=256, n_ff=512, n_head=8, n_head_kv=2, weight_type="Q8_0")
    )
    return path


@pytest.mark.parametrize("setup", SETUPS)
def test_shapes_and_namespace(tiny, setup):
    m = load(tiny, setup)
    xp = m.backend.xp
    last = m.forward(IDS)
    every = m.forward(IDS, all_logits=True)
    assert last.shape == (m.config.n_vocab,) and every.shape == (len(IDS), m.config.n_vocab)
    assert last.dtype == xp.float32
    # the same pass but for the output product, here of one row, there of all: float32
    # reordering of that one product (bounds.forward_bound with no blocks); the Q8 products
    # of the CPU arithmetic are exact integer sums per row, so equal
    last, every = to_numpy(last), to_numpy(every)
    bound = forward_bound(0, m.config.n_embd, float(np.abs(last).max()))
    np.testing.assert_allclose(every[-1], last, rtol=0, atol=bound)


@pytest.mark.parametrize("setup", SETUPS)
def test_cache_step_by_step_equals_one_pass(tiny, setup):
    m = load(tiny, setup)
    whole = to_numpy(m.forward(IDS, all_logits=True))
    steps = [to_numpy(m.forward(IDS[:3], pos=0, all_logits=True))]
    steps += [to_numpy(m.forward([t], pos=i + 3, all_logits=True)) for i, t in enumerate(IDS[3:])]
    # one pass and token by token sum the attention products in different orders
    bound = tolerance(m, whole, setup)
    np.testing.assert_allclose(np.concatenate(steps), whole, rtol=0, atol=bound)
    # rewinding: positions >= pos are forgotten and rewritten
    m.forward(IDS, pos=0)
    again = to_numpy(m.forward(IDS[5:], pos=5, all_logits=True))
    np.testing.assert_allclose(again, whole[5:], rtol=0, atol=bound)


@pytest.mark.parametrize("setup", SETUPS)
@pytest.mark.parametrize("rows", [1, 3])
def test_attention_in_blocks_of_queries(tiny, setup, rows, monkeypatch):
    """Blocks of a few queries compute the attention of one block of all: rows are
    independent, so only BLAS's order within each product may change."""
    m = load(tiny, setup)
    whole = to_numpy(m.forward(IDS, all_logits=True))
    seen = []
    attend_rows = type(m)._attend_rows

    def spy(self, q, *args):
        seen.append(q.shape[0])
        return attend_rows(self, q, *args)

    monkeypatch.setattr(type(m), "_attend_rows", spy)
    m.attention_bytes = 4 * m.config.n_head * m.cache.capacity * rows  # `rows` queries' scores
    blocked = to_numpy(m.forward(IDS, all_logits=True))
    sizes = [rows] * (len(IDS) // rows) + ([len(IDS) % rows] if len(IDS) % rows else [])
    assert seen == sizes * m.config.n_layer
    np.testing.assert_allclose(blocked, whole, rtol=0, atol=tolerance(m, whole, setup))


@pytest.mark.parametrize("setup", SETUPS)
def test_same_chunks_give_the_same_bits(tiny, setup):
    """Replaying the same calls is exact on every setup, the CPU arithmetic included: only a
    different chunking may change the float order."""
    m = load(tiny, setup)
    first = [to_numpy(m.forward(IDS[:5], pos=0, all_logits=True)), to_numpy(m.forward(IDS[5:], 5))]
    again = [to_numpy(m.forward(IDS[:5], pos=0, all_logits=True)), to_numpy(m.forward(IDS[5:], 5))]
    for a, b in zip(first, again, strict=True):
        np.testing.assert_array_equal(a.view(np.uint32), b.view(np.uint32))


def test_every_namespace_computes_the_same_model(tiny):
    m = load(tiny, "numpy-dequantize-all")
    ref = to_numpy(m.forward(IDS, all_logits=True))
    bound = tolerance(m, ref, "numpy-dequantize-all")  # the same float32 values, other orders
    for setup in ("numpy-f32", "torch", "torch-dequantize-all", "jax", "array_api_strict"):
        got = to_numpy(load(tiny, setup).forward(IDS, all_logits=True))
        np.testing.assert_allclose(got, ref, rtol=0, atol=bound, err_msg=setup)


def test_cpu_arithmetic_quantizes_activations(tiny):
    m = load(tiny, "numpy-f32")
    gpu = to_numpy(m.forward(IDS, all_logits=True))
    cpu = to_numpy(load(tiny, "numpy-cpu").forward(IDS, all_logits=True))
    simd = to_numpy(
        load(tiny, "numpy-cpu", activation_rounding="simd").forward(IDS, all_logits=True)
    )
    d = np.abs(cpu - gpu).max()
    assert d > tolerance(m, gpu, "numpy-f32")  # Q8 activations really are there: not rounding
    assert d < tolerance(m, gpu, "numpy-cpu")  # and each moves a value by less than a Q8 step
    assert simd.shape == cpu.shape


def test_half_kv_cache_is_a_small_perturbation(tiny):
    m = load(tiny, "torch")
    f32 = to_numpy(m.forward(IDS, all_logits=True))
    f16 = to_numpy(load(tiny, "torch", kv_precision="f16").forward(IDS, all_logits=True))
    d = np.abs(f16 - f32).max()
    assert 0 < d < half_bound(m.config.n_layer, float(np.abs(f32).max()))


def test_half_kv_cache_needs_float16(tiny):
    with pytest.raises(BackendError, match="needs a namespace with float16"):
        load(tiny, "array_api_strict", kv_precision="f16")


# Greedy tokens of the tiny model after IDS[:4]. Its random weights leave the logits nearly
# tied, so the CPU arithmetic's quantized activations take a different path from step 3.
GOLDEN_F32_ACTIVATIONS = [254, 176, 10, 159, 26, 151, 150, 129, 125, 123, 42, 83]
GOLDEN_CPU = [254, 176, 10, 79, 60, 206, 183, 47, 86, 254, 169, 5]


@pytest.mark.parametrize(
    ("setup", "golden"),
    [
        ("numpy-dequantize-all", GOLDEN_F32_ACTIVATIONS),
        ("numpy-f32", GOLDEN_F32_ACTIVATIONS),
        ("torch", GOLDEN_F32_ACTIVATIONS),
        ("jax", GOLDEN_F32_ACTIVATIONS),
        ("numpy-cpu", GOLDEN_CPU),
    ],
)
def test_golden_greedy_tokens(tiny, setup, golden):
    """llama2.c's test: a fixed tiny model greedy-decodes fixed tokens, on every backend.

    Teacher-forced on the golden tokens, each one is the argmax of its step, or within the
    rounding tolerance of it (a near tie another machine's summation order may break the
    other way). Free generation then gives the golden tokens up to the first such tie.
    """
    m = load(tiny, setup)
    steps = to_numpy(m.forward(IDS[:4] + golden[:-1], all_logits=True))[3:]  # (12, vocab)
    bound = tolerance(m, steps, setup)
    top2 = np.sort(steps, axis=-1)[:, -2:]
    short = steps.max(axis=-1) - steps[np.arange(len(golden)), golden]
    assert np.all(short <= bound), f"golden tokens short of the argmax by {short.max():.3g}"
    n = agreeing_steps(top2[:, 1] - top2[:, 0], bound)
    assert m.generate(IDS[:4], max_new_tokens=12).ids[:n] == golden[:n]


@pytest.mark.parametrize(
    ("call", "error", "message"),
    [
        (lambda m: m.forward([]), InvalidTokenError, "no tokens to run"),
        (
            lambda m: m.forward([1, 10**6]),
            InvalidTokenError,
            r"token\[1\] = 1000000 is outside \[0, 269\)",
        ),
        (lambda m: m.forward([-1]), InvalidTokenError, "outside"),
        (
            lambda m: m.forward([1] * 17),
            ContextOverflowError,
            "17 tokens do not fit in the context of 16",
        ),
        (
            lambda m: m.forward([1], pos=5),
            SequenceError,
            "pos 5 is past the cached sequence of 0 tokens",
        ),
    ],
)
def test_bad_calls(tiny, call, error, message):
    m = load(tiny, "numpy-dequantize-all", n_ctx=16)
    with pytest.raises(error, match=message):
        call(m)


def test_context_overflow_carries_the_numbers(tiny):
    m = load(tiny, "numpy-dequantize-all", n_ctx=16)
    m.forward([1] * 10)
    with pytest.raises(ContextOverflowError) as e:
        m.forward([1] * 7, pos=10)
    assert (e.value.n_tokens, e.value.n_ctx) == (17, 16)
