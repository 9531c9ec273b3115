"""Attention over llama.cpp's typed KV caches (qllama.runtime.kv_attention) on the numpy
backend: the dense statement it computes, row independence of the one_chunk kernel, the tiled
kernel as ``f16-flash``, and the refusals."""

from __future__ import annotations

import math

import numpy as np
import pytest
from bounds import gamma

import qllama
from qllama import quants
from qllama.array_api import namespace
from qllama.errors import BackendError
from qllama.runtime import hadamard, kv_attention
from qllama.runtime.kv_cache import KVCache
from qllama.synthetic import TinyConfig, write_tiny_llama

pytest.importorskip("numba")


@pytest.fixture(scope="module")
def tiny64(tmp_path_factory: pytest.TempPathFactory) -> str:
    """A tiny llama with heads of 64 (the Hadamard rotation applies), GQA 4:2, Q8_0."""
    path = tmp_path_factory.mktemp("kv") / "tiny64.gguf"
    write_tiny_llama(
        path,
        TinyConfig(n_embd=256, n_ff=512, n_head=4, n_head_kv=2, n_ctx=1024, weight_type="Q8_0"),
    )
    return str(path)


@pytest.mark.parametrize("spec", ["q8_0/q8_0,fa", "q4_0/q4_1,fa", "q5_0/f32,fa", "q8_0/f16"])
def test_attend_is_the_dense_statement(spec):
    """Queries rotated and converted to Q8_0 as the K side says, scores against the stored
    keys, softmax, values, rotated back: attend computes that (float32 rounding apart)."""
    rng = np.random.default_rng(5)
    n_kv, n_rep, hd, T = 2, 2, 64, 7
    cache = KVCache(1, n_kv, hd, namespace("numpy"), precision=spec, rounding="simd")
    cache.reserve(T)
    k, v = (rng.standard_normal((T, n_kv, hd)).astype(np.float32) for _ in range(2))
    cache.update(0, 0, k, v)
    q = rng.standard_normal((T, n_kv * n_rep, hd)).astype(np.float32)
    mask = np.where(np.arange(cache.capacity)[None, :] > np.arange(T)[:, None], -np.inf, 0.0)
    mask = mask.astype(np.float32)  # (T, S) causal
    got = kv_attention.attend(cache, 0, q, mask, queries=T, cells=T, scale=0.125, softcap=0.0)
    rot_k, rot_v = cache.rotation
    qr = hadamard.fwht(q, rot_k).reshape(-1, hd)
    q8 = quants.dequantize(quants.quantize(qr, "Q8_0", rounding="simd"), "Q8_0", qr.shape)
    q8 = q8.reshape(T, n_kv, n_rep, hd).astype(np.float64)
    keys = cache.k[0][:, :T].astype(np.float64)  # (n_kv, T, hd) stored values
    vals = kv_attention.round_to(kv_attention.read_type(cache.spec, "v"), cache.v[0][:, :T])
    vals = vals.astype(np.float64)  # (n_kv, T, hd): F32 V is cast to f16 under flash attention
    s = np.einsum("tgrd,gcd->tgrc", q8, keys) * 0.125 + mask[:, None, None, :T]
    p = np.exp(s - s.max(axis=-1, keepdims=True))
    p /= p.sum(axis=-1, keepdims=True)
    out = np.einsum("tgrc,gcd->tgrd", p, vals).reshape(T, -1)
    if rot_v:
        out = out.reshape(-1, rot_v) @ hadamard.dense(rot_v).T
    out = out.reshape(T, -1)
    bound = gamma(4 * hd + 2 * T) * 16 * np.abs(vals).max()  # sums, exps, the rotations
    if kv_attention.read_type(cache.spec, "v") == "f16":  # f16 accumulator, or P in f16
        bound += (T + 2) * 2.0**-11 * np.abs(vals).max() * math.sqrt(hd)
    assert np.abs(got - out).max() <= bound


@pytest.mark.parametrize("spec", ["q8_0/q4_0,fa", "q4_1/f16,fa", "iq4_nl/bf16,fa", "q5_1/f32,fa"])
def test_decode_is_prefill_bit_for_bit(tiny64, spec):
    """one_chunk works row by row and block-format K scores are integer dot products: the
    CPU arithmetic's token-by-token decode gives the prefill's logits exactly."""
    ids = list(range(3, 23))
    m = qllama.load(tiny64, kv_precision=spec, activation_rounding="simd")
    prefill = np.asarray(m.forward(ids, all_logits=True))
    m.forward(ids[:4])
    steps = [np.asarray(m.forward([ids[j]], pos=j)) for j in range(4, len(ids))]
    assert np.array_equal(np.stack(steps), prefill[4:])


def test_tiled_batches_compute_f16_flash(tiny64):
    """A batch of 64 queries or more with an F16 (or F32, cast) cache runs the tiled kernel:
    the numbers of ``f16-flash``."""
    ids = list(range(3, 73))
    want = np.asarray(qllama.load(tiny64, kv_precision="f16-flash").forward(ids, all_logits=True))
    for spec in ("f16,fa", "f32,fa"):
        got = np.asarray(qllama.load(tiny64, kv_precision=spec).forward(ids, all_logits=True))
        assert np.array_equal(got, want)


def test_short_batches_run_one_chunk(tiny64):
    """Fewer than 64 queries: one_chunk (f16 Q, f16 accumulator), not the tiled arithmetic,
    and still close to the f32 cache (the f16 rounding of K, V, Q and the accumulator)."""
    ids = list(range(3, 23))
    f16 = np.asarray(qllama.load(tiny64, kv_precision="f16,fa").forward(ids, all_logits=True))
    tiled = np.asarray(qllama.load(tiny64, kv_precision="f16-flash").forward(ids, all_logits=True))
    f32 = np.asarray(qllama.load(tiny64).forward(ids, all_logits=True))
    assert not np.array_equal(f16, tiled)
    assert np.abs(f16 - f32).max() < 64 * 2.0**-11 * np.abs(f32).max()


def test_split_kv_decode_needs_a_thread_count(tiny64):
    """One query over 512 cells or more (past 256 positions) with an F16 cache runs
    llama.cpp's split-KV kernel, whose numbers depend on its thread count: refused without
    one, computed for the count ``,fa=N`` declares."""
    prompt = list(range(3, 200)) + list(range(3, 80))  # 274 positions: n_kv 512
    m = qllama.load(tiny64, kv_precision="f16,fa")
    m.forward(prompt)
    with pytest.raises(BackendError, match="split-KV"):
        m.forward([5], pos=len(prompt))
    steps = {}
    for n in (2, 3):
        m = qllama.load(tiny64, kv_precision=f"f16,fa={n}")
        m.forward(prompt)
        steps[n] = np.asarray(m.forward([5], pos=len(prompt)))
    assert np.isfinite(steps[2]).all() and not np.array_equal(steps[2], steps[3])
    assert np.abs(steps[2] - steps[3]).max() < 64 * 2.0**-11 * np.abs(steps[2]).max()
    q = qllama.load(tiny64, kv_precision="q8_0/q8_0,fa")  # block formats: one_chunk always
    q.forward(prompt)
    assert np.isfinite(np.asarray(q.forward([5], pos=len(prompt)))).all()


def test_load_refusals(tiny64, tmp_path):
    with pytest.raises(BackendError, match="quantized V cache requires flash_attn"):
        qllama.load(tiny64, kv_precision="q8_0")
    with pytest.raises(BackendError, match="unknown cache type"):
        qllama.load(tiny64, kv_precision="q8_0/q4_k,fa")
    narrow = tmp_path / "hd48.gguf"
    write_tiny_llama(narrow, TinyConfig(n_embd=96, n_ff=128, n_head=2, n_head_kv=2))
    with pytest.raises(BackendError, match="do not divide the head size 48"):
        qllama.load(narrow, kv_precision="q8_0/f16")
    assert math.isfinite(float(qllama.load(narrow, kv_precision="bf16").forward([1, 2])[0]))


def test_other_backends_refuse_typed_caches(tiny64):
    pytest.importorskip("torch")
    with pytest.raises(BackendError, match="numpy backend"):
        qllama.load(tiny64, backend="torch", kv_precision="q8_0/q8_0,fa")
