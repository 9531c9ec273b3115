"""The KV cache: rows written in place (numpy, torch) hold what take-and-where writes (jax,
array-api-strict), each layer its own, across growth of the capacity."""

from __future__ import annotations

import math

import numpy as np
import pytest
from bounds import U32, gamma

from qllama import quants
from qllama.array_api import namespace, to_numpy
from qllama.errors import BackendError
from qllama.quants.iq4_nl import quantize_row_ref
from qllama.runtime import flash_attention, hadamard, kv_types
from qllama.runtime.kv_cache import CAPACITY_STEP, KVCache

NAMESPACES = ["numpy", "torch", "array_api_strict"]


def filled(xp_name: str, writes: list[tuple[int, int]]) -> KVCache:
    """A 2-layer cache after ``writes`` (pos, rows) of seeded random keys and values."""
    xp = namespace(xp_name)
    cache = KVCache(2, 2, 4, xp, head_dim_v=3)
    rng = np.random.default_rng(0)
    for pos, n in writes:
        cache.reserve(pos + n)
        k = rng.standard_normal((n, 2, 4)).astype(np.float32)
        v = rng.standard_normal((n, 2, 3)).astype(np.float32)
        cache.update(0, pos, xp.asarray(k), xp.asarray(v))
        cache.length = pos + n
    return cache


@pytest.mark.parametrize("xp_name", NAMESPACES)
def test_writes_agree_across_namespaces(xp_name):
    pytest.importorskip(xp_name)
    # a prefill, decode steps, a rewrite of earlier positions, then growth past the capacity
    writes = [(0, 37), (37, 1), (38, 1), (20, 5), (39, CAPACITY_STEP)]
    want, got = filled("numpy", writes), filled(xp_name, writes)
    assert got.capacity == want.capacity == 2 * CAPACITY_STEP
    for layer in range(2):
        np.testing.assert_array_equal(to_numpy(got.k[layer]), to_numpy(want.k[layer]))
        np.testing.assert_array_equal(to_numpy(got.v[layer]), to_numpy(want.v[layer]))
    # layer 1 was never written: its rows are its own, still zero
    assert not np.any(to_numpy(got.k[1])) and not np.any(to_numpy(got.v[1]))
    assert np.any(to_numpy(got.k[0]))


@pytest.mark.parametrize("xp_name", NAMESPACES)
def test_a_fork_shares_until_one_writes(xp_name):
    """Beam search forks caches: a write to either leaves the other as it was."""
    pytest.importorskip(xp_name)
    xp = namespace(xp_name)
    cache = filled(xp_name, [(0, 10)])
    before = to_numpy(cache.k[0]).copy()
    fork = cache.fork()
    new = xp.asarray(np.ones((1, 2, 4), np.float32))
    fork.update(0, 10, new, xp.asarray(np.ones((1, 2, 3), np.float32)))
    np.testing.assert_array_equal(to_numpy(cache.k[0]), before)  # the original is untouched
    cache.update(0, 10, 2 * new, xp.asarray(np.zeros((1, 2, 3), np.float32)))
    assert float(to_numpy(fork.k[0])[0, 10, 0]) == 1.0  # and the fork keeps its own write
    assert float(to_numpy(cache.k[0])[0, 10, 0]) == 2.0


# --- llama.cpp's cache types (qllama.runtime.kv_types, kv_attention, hadamard, flash_attention) --


BLOCK_TYPES = ["q8_0", "q4_0", "q4_1", "iq4_nl", "q5_0", "q5_1"]


@pytest.mark.parametrize(
    ("spec", "k", "v", "flash", "legacy"),
    [
        ("f32", "f32", "f32", False, True),
        ("f16", "f16", "f16", False, True),
        ("f16-flash", "f16", "f16", True, True),
        ("bf16", "bf16", "bf16", False, False),
        ("q8_0/f16", "q8_0", "f16", False, False),
        ("q8_0/q4_0,fa", "q8_0", "q4_0", True, False),
        ("f16,fa", "f16", "f16", True, False),
        ("f16,fa=4", "f16", "f16", True, False),
    ],
)
def test_kv_specs_parse(spec, k, v, flash, legacy):
    s = kv_types.parse(spec)
    assert (s.type_k, s.type_v, s.flash, s.legacy) == (k, v, flash, legacy)
    assert kv_types.parse(s.name) == s  # the name reads back


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ("f8", "unknown cache type 'f8'"),
        ("q8_0/q4_k,fa", "unknown cache type 'q4_k'"),
        ("q8_0/", "must be one of"),
        ("a/b/c", "must be one of"),
        ("q4_0", "quantized V cache requires flash_attn"),
        ("f16/iq4_nl", "quantized V cache requires flash_attn"),
        ("f16,fa=0", "needs a thread count"),
        ("f16,fa=x", "needs a thread count"),
    ],
)
def test_kv_specs_refused(spec, message):
    with pytest.raises(BackendError, match=message):
        kv_types.parse(spec)


def test_block_must_divide_the_head():
    with pytest.raises(BackendError, match="blocks of 32 do not divide the head size 48"):
        kv_types.check_geometry(kv_types.parse("q8_0/f16"), 48, 48)
    kv_types.check_geometry(kv_types.parse("f16/bf16"), 48, 48)  # float types: any size


@pytest.mark.parametrize(
    ("spec", "hd", "k_rot", "v_rot"),
    [("q8_0/q4_0,fa", 64, 64, 64), ("q8_0/q4_0,fa", 128, 128, 64), ("q4_0,fa", 192, 64, 64),
     ("q4_0,fa", 96, 0, 0), ("f16/q8_0,fa", 128, 0, 64), ("bf16", 128, 0, 0)],
)  # fmt: skip
def test_rotation_sizes(spec, hd, k_rot, v_rot):
    s = kv_types.parse(spec)
    assert (kv_types.rotation_size(s, "k", hd), kv_types.rotation_size(s, "v", hd)) == (
        k_rot,
        v_rot,
    )


@pytest.mark.parametrize("n", [64, 128, 256])
def test_fwht_is_the_scalar_loop_and_the_hadamard_product(n):
    rng = np.random.default_rng(n)
    x = (rng.standard_normal((3, 2 * n)) * rng.uniform(0.1, 10, (3, 1))).astype(np.float32)
    y = hadamard.fwht(x, n)
    for row in range(3):  # bit for bit the butterflies of ggml's scalar loop
        for c in range(2):
            chunk = slice(c * n, (c + 1) * n)
            assert np.array_equal(
                y[row, chunk].view(np.uint32), hadamard.fwht_loop(x[row, chunk], n).view(np.uint32)
            )
    # the dense product within the float32 error of log2(n) stages of sums (+ the scaling)
    h = hadamard.dense(n)
    blocks = x.reshape(-1, n).astype(np.float64)
    exact = blocks @ h.T
    bound = gamma(int(math.log2(n)) + 2) * (
        np.abs(blocks).sum(axis=1, keepdims=True) / math.sqrt(n)
    )
    assert np.all(np.abs(y.reshape(-1, n) - exact) <= bound)
    # orthonormal and symmetric: the transform twice is the identity, within the same bound
    twice = hadamard.fwht(y, n).astype(np.float64)
    assert np.allclose(twice, x, rtol=0, atol=2 * float(bound.max()) + U32 * float(np.abs(x).max()))


def _typed_cache(spec: str, hd: int = 64, rounding: str = "simd") -> KVCache:
    return KVCache(1, 2, hd, namespace("numpy"), precision=spec, rounding=rounding)


@pytest.mark.parametrize("t", ["f32", "f16", "bf16", *BLOCK_TYPES])
@pytest.mark.parametrize("rounding", ["ref", "simd"])
def test_stored_values_are_the_types_from_float(t, rounding):
    """What llama.cpp's set_rows writes: each (token, head) row rotated (block types), then
    the type's from_float (Q8_0: the arch quantizer's ties; IQ4_NL: quantize_row_iq4_nl_ref)."""
    spec = f"{t}/{t},fa" if t in BLOCK_TYPES else f"{t}/{t}"
    cache = _typed_cache(spec, rounding=rounding)
    rng = np.random.default_rng(7)
    k, v = (rng.standard_normal((5, 2, 64)).astype(np.float32) for _ in range(2))
    cache.reserve(8)
    ks, vs = cache.update(0, 2, k, v)
    rows = lambda a: a.reshape(10, 64)  # noqa: E731  (token, head) rows
    for stored, x in ((ks, k), (vs, v)):
        got = stored[:, 2:7].transpose(1, 0, 2).reshape(10, 64)
        if t in BLOCK_TYPES:
            x = hadamard.fwht(x, 64)
            g = kv_types.CACHE_TYPES[t]
            if t == "iq4_nl":
                raw = quantize_row_ref(rows(x).reshape(-1, 32)).reshape(10, -1)
            else:
                r = rounding if rounding in quants.get(g).roundings else "ref"
                raw = quants.quantize(rows(x), g, rounding=r)
            want = quants.dequantize(raw, g, (10, 64))
            if stored is ks:
                assert np.array_equal(
                    cache.k_raw[0][:, 2:7].transpose(1, 0, 2).reshape(10, -1), raw
                )
        elif t == "f32":
            want = rows(x)
        else:
            want = quants.dequantize(quants.quantize(rows(x), t.upper()), t.upper(), (10, 64))
        assert np.array_equal(got, want)
        assert not np.any(stored[:, :2]) and not np.any(stored[:, 7:])  # only these cells


def test_typed_caches_are_numpy_only():
    pytest.importorskip("torch")
    with pytest.raises(BackendError, match="numpy backend"):
        KVCache(1, 2, 64, namespace("torch"), precision="q8_0/q8_0,fa")


def test_typed_fork_copies_the_key_bytes():
    cache = _typed_cache("q8_0/q8_0,fa")
    rng = np.random.default_rng(1)
    cache.reserve(4)
    cache.update(0, 0, *(rng.standard_normal((4, 2, 64)).astype(np.float32) for _ in range(2)))
    before = cache.k_raw[0].copy()
    fork = cache.fork()
    fork.update(0, 1, *(np.ones((1, 2, 64), np.float32) for _ in range(2)))
    assert np.array_equal(cache.k_raw[0], before)
    assert not np.array_equal(fork.k_raw[0], before)


# --- the one_chunk kernel: compiled against the plain statement, bit for bit --------------------


def _bits(a: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(a, dtype=np.float32).view(np.uint32)


def test_fma_oracle_rounds_once():
    """fma's single rounding where a float64 sum would round twice: (1+2^-12)^2 is
    1 + 2^-11 + 2^-24, halfway between two floats; a tiny c decides the side."""
    a = np.full(3, 1 + 2.0**-12, np.float32)
    c = np.array([0.0, 2.0**-60, -(2.0**-60)], np.float32)
    got = flash_attention.fma(a, a, c)
    want = np.array([1 + 2.0**-11, 1 + 2.0**-11 + 2.0**-23, 1 + 2.0**-11], np.float32)
    assert np.array_equal(_bits(got), _bits(want))
    pytest.importorskip("numba")
    import numba

    from qllama.backends.numpy.kernels.flash import fma32

    @numba.njit
    def compiled(x, y, z):
        out = np.empty_like(x)
        for i in range(x.size):
            out[i] = fma32(x[i], y[i], z[i])
        return out

    rng = np.random.default_rng(0)
    x, y = (rng.standard_normal(20000).astype(np.float32) for _ in range(2))
    z = (rng.standard_normal(20000) * 10.0 ** rng.integers(-9, 2, 20000)).astype(np.float32)
    x, y, z = (np.concatenate([p, q]) for p, q in ((x, a), (y, a), (z, c)))
    assert np.array_equal(_bits(compiled(x, y, z)), _bits(flash_attention.fma(x, y, z)))


def test_round_f16_is_numpys_half():
    pytest.importorskip("numba")
    import numba

    from qllama.backends.numpy.kernels.flash import round_f16

    @numba.njit
    def compiled(x):
        out = np.empty_like(x)
        for i in range(x.size):
            out[i] = round_f16(x[i])
        return out

    rng = np.random.default_rng(0)
    x = np.concatenate(
        [
            rng.standard_normal(20000).astype(np.float32) * np.float32(s)
            for s in (1e-8, 1e-5, 1, 7e4)
        ]
        + [
            np.array(
                [65504, 65519.996, 65520, -65520, 2**-14, 2**-25, 3 * 2**-26, np.inf], np.float32
            )
        ]
    )
    with np.errstate(over="ignore"):
        want = x.astype(np.float16).astype(np.float32)
    assert np.array_equal(_bits(compiled(x)), _bits(want))


@pytest.mark.parametrize("f16_acc", [True, False])
@pytest.mark.parametrize("fused_sum", [True, False])
@pytest.mark.parametrize("softcap", [0.0, 20.0])
def test_one_chunk_compiled_is_the_oracle(f16_acc, fused_sum, softcap):
    pytest.importorskip("numba")
    rng = np.random.default_rng(int(f16_acc) + 2 * int(fused_sum) + int(softcap))
    G, R, S, DV, t = 2, 6, 300, 64, 3
    scores = (rng.standard_normal((G, R, S)) * 6).astype(np.float32)
    mask = np.zeros((t, S), np.float32)
    mask[:, 200:] = -np.inf  # cells not yet written
    mask[1, 17:90] = -np.inf  # a window
    mask[2, :] = -np.inf  # a row that sees nothing: S = 0, output 0
    v = rng.standard_normal((G, S, DV)).astype(np.float32)
    if f16_acc:
        v = v.astype(np.float16).astype(np.float32)
    scale = float(np.float32(0.125 / softcap)) if softcap else 0.125
    want = flash_attention.one_chunk_oracle(
        scores, mask, v, scale, softcap, f16_acc=f16_acc, fused_sum=fused_sum
    )
    got = flash_attention.one_chunk(
        scores, mask, v, scale, softcap, f16_acc=f16_acc, fused_sum=fused_sum
    )
    assert np.array_equal(_bits(got), _bits(want))
    # a chunk of the cells (split-KV's): accumulator, maximum and sum, the same bits
    part = dict(f16_acc=f16_acc, fused_sum=fused_sum, cells=(40, 170))
    for a, b in zip(
        flash_attention.chunk(scores, mask, v, scale, softcap, **part),
        flash_attention.chunk_oracle(scores, mask, v, scale, softcap, **part),
        strict=True,
    ):
        assert np.array_equal(_bits(a), _bits(b))
    assert not np.any(want[:, 2::3])  # the blind row
    # and it is attention: within float32 rounding of a float64 softmax product (f32 acc)
    if not f16_acc:
        s = scores.astype(np.float64) * scale
        s = softcap * np.tanh(s) if softcap else s
        s = s + np.tile(mask, (1, R // t, 1)).reshape(1, R, S)
        with np.errstate(invalid="ignore"):
            p = np.exp(s - s.max(axis=-1, keepdims=True))
            p = np.nan_to_num(p / p.sum(axis=-1, keepdims=True))
        exact = p @ v.astype(np.float64)
        assert np.abs(want - exact).max() <= gamma(2 * S) * np.abs(v).max() * 4


@pytest.mark.parametrize("threads", [1, 3, 4])
def test_split_kv_compiled_is_the_oracle(threads):
    """Split-KV decode: the compiled chunks folded as llama.cpp folds them equal the oracle's;
    one thread is one_chunk itself; more threads differ from it only by rounding."""
    pytest.importorskip("numba")
    rng = np.random.default_rng(threads)
    G, R, S, DV = 2, 3, 512, 64
    scores = (rng.standard_normal((G, R, S)) * 6).astype(np.float32)
    mask = np.zeros((1, S), np.float32)
    mask[:, 300:] = -np.inf  # the last chunks see nothing (skipped)
    v = rng.standard_normal((G, S, DV)).astype(np.float16).astype(np.float32)
    got = flash_attention.split(scores, mask, v, 0.125, threads=threads)
    want = flash_attention.split(scores, mask, v, 0.125, threads=threads, compiled=False)
    assert np.array_equal(_bits(got), _bits(want))
    single = flash_attention.one_chunk(scores, mask, v, 0.125, f16_acc=True)
    if threads == 1:
        assert np.array_equal(_bits(got), _bits(single))
    else:  # two f16 accumulators, each within (cells + 2) half-ulps of the values' scale
        assert np.abs(got - single).max() <= 2 * (S + 2) * 2.0**-11 * np.abs(v).max()
