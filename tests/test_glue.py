"""The numpy backend's compiled glue (backends/numpy/glue.py) against the model's array-API
forms: the same bits op by op, on random and SmolLM2-shaped inputs, and whole forward passes
with and without it."""

from __future__ import annotations

import functools
import importlib.util

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import qllama
from qllama.backends.base import GLUE_OPS, glue
from qllama.backends.numpy.dispatch import NumpyBackend
from qllama.runtime import model as forms
from qllama.runtime.scores import masked_softmax
from qllama.synthetic import TinyConfig, write_tiny_llama

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("numba") is None, reason="the glue kernels need numba"
)

F32 = np.float32
# SmolLM2-135M: 576 wide, 9 query and 3 KV heads of 64, an MLP of 1536; and odd sizes
WIDTHS = [1, 5, 8, 127, 128, 129, 576, 1000, 1536, 4097]


def simd_exp() -> bool:
    """Whether this numpy computes float32 exp with its x86 AVX2+FMA or AVX-512 kernel (the
    one the glue's exp restates)."""
    from numpy._core._multiarray_umath import __cpu_features__ as have

    return bool(have.get("AVX512F") or (have.get("AVX2") and have.get("FMA3")))


needs_simd_exp = pytest.mark.skipif(
    not simd_exp(), reason="numpy's float32 exp here is libm's, not its x86 SIMD kernel"
)


@pytest.fixture(scope="module")
def ops():
    from qllama.backends.numpy import glue as numpy_glue

    return numpy_glue


def same_bits(a: np.ndarray, b: np.ndarray) -> None:
    assert a.dtype == b.dtype and a.shape == b.shape
    np.testing.assert_array_equal(a.view(np.uint32), b.view(np.uint32))


@needs_simd_exp
def test_glue_exact_here(ops):
    assert ops.glue_exact()


@settings(max_examples=80, deadline=None)
@given(
    n=st.integers(0, 5000), off=st.integers(0, 40), square=st.booleans(), seed=st.integers(0, 99)
)
def test_the_pairwise_sum_is_numpys(n, off, square, seed):
    """The kernels' pairwise sum (the softmax's and the norm's) is numpy's float32 sum of the
    run (or of its squares), bit for bit, for runs of any length and offset."""
    from qllama.backends.numpy.kernels import glue as kernels

    a = np.random.default_rng(seed).standard_normal(off + n).astype(F32)
    run = a[off:]
    want = np.sum(run * run) if square else np.sum(run)
    same_bits(np.asarray(kernels.pairwise_sum(a, off, n, square), F32), np.asarray(want, F32))


def test_the_exactness_check_walks_its_arguments_in_chunks(ops):
    """The chunks are every 997th float32 of [-104, 89] by bits, in order, as one array would
    be, none over the chunk's size."""
    chunks = list(ops._exp_arguments(chunk=1000))
    whole = np.concatenate(
        [
            np.arange(0xC2D00000, 0x80000000, -997, dtype=np.int64),
            np.arange(0, 0x42B20000, 997, dtype=np.int64),
        ]
    )
    assert max(c.size for c in chunks) == 1000
    np.testing.assert_array_equal(np.concatenate(chunks).view(np.uint32), whole)


@needs_simd_exp
def test_exp_is_numpys(ops):
    from qllama.backends.numpy.kernels import glue as kernels

    rng = np.random.default_rng(0)
    x = np.concatenate(
        [
            rng.uniform(-110, 95, 200_000).astype(F32),
            (rng.standard_normal(10_000) * 1e-3).astype(F32),
            np.array([np.nan, np.inf, -np.inf, 0.0, -0.0, 88.72283935546875, -103.972084], F32),
            np.arange(-90, -86, 1e-4, dtype=F32),  # subnormal results
        ]
    )
    with np.errstate(over="ignore", under="ignore"):
        want = np.exp(x)
    got = kernels.exp_all(x)
    np.testing.assert_array_equal(np.isnan(got), np.isnan(want))
    same_bits(np.where(np.isnan(got), 0, got), np.where(np.isnan(want), 0, want))


@pytest.mark.parametrize("width", WIDTHS)
@pytest.mark.parametrize("rows", [1, 37])
def test_rms_norm(ops, rows, width):
    rng = np.random.default_rng(width + rows)
    x = (rng.standard_normal((rows, width)) * rng.uniform(0.01, 30)).astype(F32)
    w = rng.standard_normal(width).astype(F32)
    same_bits(ops.rms_norm(x, w, 1e-5), forms.rms_norm(x, w, 1e-5, xp=np))


def test_rms_norm_per_head(ops):
    """qk-norm shapes: (T, heads, head_dim)."""
    rng = np.random.default_rng(1)
    x = rng.standard_normal((5, 9, 64)).astype(F32)
    w = rng.standard_normal(64).astype(F32)
    same_bits(ops.rms_norm(x, w, 1e-6), forms.rms_norm(x, w, 1e-6, xp=np))


@pytest.mark.parametrize("layout", ["rope", "rope_halves"])
@pytest.mark.parametrize("shape", [(1, 9, 64), (1, 3, 64), (37, 9, 64), (4, 2, 32), (3, 1, 2)])
def test_rope(ops, shape, layout):
    rng = np.random.default_rng(shape[0])
    T, _, D = shape
    x = rng.standard_normal(shape).astype(F32)
    cos, sin = forms.rope_tables(T + 40, D, 10000.0, xp=np)
    cos, sin = cos[40:], sin[40:]  # (T, D/2) at positions 40 ...
    op, form = getattr(ops, layout), getattr(forms, layout)
    same_bits(op(x, cos, sin), form(x, cos, sin, xp=np))
    part = x[..., : D // 2 * 2]  # a strided view (partial rotary)
    same_bits(op(part, cos, sin), form(part, cos, sin, xp=np))


@needs_simd_exp
@pytest.mark.parametrize("shape", [(1, 1536), (37, 1536), (3, 7)])
def test_swiglu(ops, shape):
    rng = np.random.default_rng(shape[0])
    gate = (rng.standard_normal(shape) * 20).astype(F32)  # past +-88: exp's inf and 0
    up = rng.standard_normal(shape).astype(F32)
    with np.errstate(over="ignore"):
        want = forms.silu(gate, xp=np) * up
    same_bits(ops.swiglu(gate, up), want)


@pytest.mark.parametrize(("T", "k", "n"), [(1, 4, 1024), (7, 8, 64), (3, 1, 5), (2, 2, 129)])
def test_slot_sum(ops, T, k, n):
    """Each slot times its weight, the slots added in order: the model's form, bit for bit
    (a float32 sum in another order differs on these rows)."""
    rng = np.random.default_rng(T * k + n)
    y = (rng.standard_normal((T, k, n)) * 10).astype(F32)
    w = rng.random((T, k)).astype(F32)
    same_bits(ops.slot_sum(y, w), forms.slot_sum(y, w, xp=np))
    if k > 2:
        assert not np.array_equal(ops.slot_sum(y, w), (y * w[:, :, None])[:, ::-1].sum(axis=1))


@needs_simd_exp
@pytest.mark.parametrize(
    ("t", "S", "pos"), [(1, 256, 40), (1, 256, 255), (37, 256, 0), (5, 512, 300)]
)
def test_masked_softmax(ops, t, S, pos):
    rng = np.random.default_rng(t + S)
    scores = (rng.standard_normal((3, 3, t, S)) * 40).astype(F32)  # some terms below NEGLIGIBLE
    where = np.arange(pos, pos + t)[:, None]  # (t, 1) positions of the queries
    mask = np.where(np.arange(S)[None, :] > where, -np.inf, 0).astype(F32)  # (t, S) causal
    same_bits(ops.masked_softmax(scores, 0.125, mask), masked_softmax(scores, 0.125, mask, xp=np))


def test_hook():
    """glue() asks the backend's class; other backends offer none, the oracle's kernels only
    the router's ops of the CPU arithmetic (tests/test_ggml_router.py)."""

    class Plain:
        pass

    assert glue(Plain(), "rms_norm") is None
    router_ops = {"soft_max", "sum_rows"}
    oracle = NumpyBackend(kernels="numpy")
    assert {op for op in GLUE_OPS if glue(oracle, op) is not None} == router_ops
    if simd_exp():
        compiled = NumpyBackend(kernels="numba")
        assert all(glue(compiled, op) is not None for op in GLUE_OPS)


def without_glue(m) -> None:
    """The model's array-API forms, as on a backend without glue."""

    class Plain:
        pass

    m._glue(Plain())


def same_forward(path, ids, **options) -> None:
    """Prefill, decode steps and teacher forcing: the same logits with and without glue."""
    a = qllama.load(path, backend="numpy", kernels="numba", **options)
    b = qllama.load(path, backend="numpy", kernels="numba", **options)
    without_glue(b)
    assert not isinstance(a.rms_norm, functools.partial)  # the backend's own
    assert isinstance(b.rms_norm, functools.partial)
    n = len(ids) // 2
    same_bits(a.forward(ids[:n], 0, all_logits=True), b.forward(ids[:n], 0, all_logits=True))
    for i in range(n, len(ids)):
        same_bits(a.forward([ids[i]], i), b.forward([ids[i]], i))
    same_bits(a.forward(ids, 0, all_logits=True), b.forward(ids, 0, all_logits=True))


@needs_simd_exp
@pytest.mark.parametrize(
    ("arch", "kv"), [("llama", "f32"), ("llama", "f16"), ("qwen2", "f32"), ("gemma2", "f32")]
)
def test_forward_identical_tiny(tmp_path, arch, kv):
    """llama (every op), f16 KV operands, qwen2 (RoPE in halves: array-API), gemma2 (soft-capped
    scores: array-API softmax, GELU)."""
    path = tmp_path / f"{arch}.gguf"
    write_tiny_llama(path, TinyConfig(n_embd=128, n_ff=256, arch=arch, weight_type="Q8_0"))
    ids = [1, 40, 77, 200, 5, 260, 99, 3, 17, 120, 64, 2]
    same_forward(path, ids, kv_precision=kv)


@needs_simd_exp
def test_forward_identical_smollm2(smollm2_path):
    rng = np.random.default_rng(0)
    same_forward(smollm2_path, [int(t) for t in rng.integers(0, 49152, 48)])
