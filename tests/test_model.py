"""The model on every backend: shapes, the KV cache, agreement, errors (a tiny synthetic file)."""

from __future__ import annotations

import importlib.util

import numpy as np
import pytest

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
    np.testing.assert_allclose(to_numpy(every)[-1], to_numpy(last), rtol=0, atol=1e-5)


@pytest.mark.parametrize("setup", SETUPS)
def test_cache_step_by_step_equals_one_pass(tiny, setup):
    m = load(tiny, setup)
    whole = to_numpy(m.forward(IDS, all_logits=True))
    steps = [to_numpy(m.forward(IDS[:3], pos=0, all_logits=True))]
    steps += [to_numpy(m.forward([t], pos=i + 3, all_logits=True)) for i, t in enumerate(IDS[3:])]
    np.testing.assert_allclose(np.concatenate(steps), whole, rtol=0, atol=1e-4)
    # rewinding: positions >= pos are forgotten and rewritten
    m.forward(IDS, pos=0)
    again = to_numpy(m.forward(IDS[5:], pos=5, all_logits=True))
    np.testing.assert_allclose(again, whole[5:], rtol=0, atol=1e-4)


def test_every_namespace_computes_the_same_model(tiny):
    ref = to_numpy(load(tiny, "numpy-dequantize-all").forward(IDS, all_logits=True))
    for setup in ("numpy-f32", "torch", "torch-dequantize-all", "jax", "array_api_strict"):
        got = to_numpy(load(tiny, setup).forward(IDS, all_logits=True))
        np.testing.assert_allclose(got, ref, rtol=0, atol=2e-5, err_msg=setup)


def test_cpu_arithmetic_quantizes_activations(tiny):
    gpu = to_numpy(load(tiny, "numpy-f32").forward(IDS, all_logits=True))
    cpu = to_numpy(load(tiny, "numpy-cpu").forward(IDS, all_logits=True))
    simd = to_numpy(
        load(tiny, "numpy-cpu", activation_rounding="simd").forward(IDS, all_logits=True)
    )
    assert np.abs(cpu - gpu).max() > 1e-4  # Q8 activations really are there
    assert np.abs(cpu - gpu).max() < 0.1 * np.abs(gpu).max()  # and they are a small perturbation
    assert simd.shape == cpu.shape


def test_half_kv_cache_is_a_small_perturbation(tiny):
    f32 = to_numpy(load(tiny, "torch").forward(IDS, all_logits=True))
    f16 = to_numpy(load(tiny, "torch", kv_precision="f16").forward(IDS, all_logits=True))
    d = np.abs(f16 - f32).max()
    assert 0 < d < 1e-2


def test_half_kv_cache_needs_float16(tiny):
    with pytest.raises(BackendError, match="needs a namespace with float16"):
        load(tiny, "array_api_strict", kv_precision="f16")


# Greedy tokens of the tiny model after IDS[:4]. Its random weights leave the logits nearly
# tied, so the CPU arithmetic's quantized activations pick a different path from the start.
GOLDEN_F32_ACTIVATIONS = [173, 61, 25, 64, 212, 143, 150, 261, 227, 78, 244, 217]
GOLDEN_CPU = [247, 47, 142, 58, 267, 195, 22, 248, 68, 8, 151, 4]


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
    """llama2.c's test: a fixed tiny model greedy-decodes fixed tokens, on every backend."""
    assert load(tiny, setup).generate(IDS[:4], max_new_tokens=12).ids == golden


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
