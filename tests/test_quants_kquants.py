"""Edge cases of Q2_K, Q4_K, Q5_K and Q8_K that the generic tests in test_quants.py miss."""

from __future__ import annotations

import hashlib

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from qllama import quants
from qllama.array_api import to_numpy
from qllama.quants import kquant_search
from qllama.quants.kquant_search import make_qkx2_quants, scale_min_k4
from qllama.quants.rounding import nearest_int

F32 = np.float32
K_TYPES = ["Q2_K", "Q4_K", "Q5_K", "Q8_K"]
WEIGHT_K = ["Q2_K", "Q4_K", "Q5_K"]


def bits(x: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(x, dtype=F32).view(np.uint32)


# ---------------------------------------------------------------------------------------------
# Pinned ggml bytes for crafted blocks. The inputs use only integer arithmetic and float32
# division by powers of two, so they are the same on every platform; the digests are sha256
# (first 16 hex digits) of what ggml_quantize_chunk (Q8_K: quantize_row_q8_K_ref) wrote for
# them, from llama-cpp-python 0.3.36's libggml-base on x86-64.

_I = np.arange(256)
_BASE = (((_I * 37) % 101) - 50).astype(F32) / F32(64)  # in [-0.78, 0.78], no pattern
_POS = (((_I * 37) % 101) + 1).astype(F32) / F32(64)


def _quiet_sub_block() -> np.ndarray:
    # elements 32..63 (Q4_K/Q5_K sub-block 1, Q2_K sub-blocks 2, 3) are 512x smaller: their
    # 6-bit / 4-bit scale rounds to 0 and ggml leaves the search's L there (stale bytes)
    x = _BASE.copy()
    x[32:64] /= F32(512)
    return x


def _q8k_ties() -> np.ndarray:
    # x * (-127 / max) lands on exact .5 for half the grid: nearest_int must round to even
    return ((_I % 255) - 127).astype(F32) / F32(2)


def _opposite_max() -> np.ndarray:
    x = _BASE.copy()
    x[10], x[20] = F32(1), F32(-1)  # same |x|: ggml keeps the first, so d < 0
    return x


CASES: dict[str, np.ndarray] = {
    "mixed": _BASE,
    "all_positive": _POS,
    "all_negative": -_POS,
    "positive_offset": F32(4) + _BASE / F32(16),
    "negative_offset": F32(-4) + _BASE / F32(16),
    "tiny_fp16_subnormal_d": _BASE * F32(2.0**-24),
    "tiny_d_rounds_to_zero": _BASE * F32(2.0**-60),
    "quiet_sub_block": _quiet_sub_block(),
    "constant": np.full(256, 0.125, F32),
    "constant_sub_blocks": np.repeat((np.arange(16) - 8).astype(F32) / F32(8), 16),
    "sparse": np.where(_I % 7 == 0, F32(0), _BASE),
    "q8k_ties": _q8k_ties(),
    "opposite_max": _opposite_max(),
    "large": _BASE * F32(2.0**20),
}

GGML_DIGESTS: dict[str, dict[str, str]] = {
    "all_negative": {
        "Q2_K": "d4e29eb25c1992ef",
        "Q4_K": "f0240ebc0d6016c6",
        "Q5_K": "3f6513f05f4b619c",
        "Q8_K": "d71fb70821932f87",
    },
    "all_positive": {
        "Q2_K": "0fed8bc7041be799",
        "Q4_K": "54a34553a466ae58",
        "Q5_K": "19fbde51024871af",
        "Q8_K": "2266f58784f9d76c",
    },
    "constant": {
        "Q2_K": "1645f83879ff8480",
        "Q4_K": "097ae4e15dae78c6",
        "Q5_K": "d1c8356f95b61c5f",
        "Q8_K": "df85d676e9f74e86",
    },
    "constant_sub_blocks": {
        "Q2_K": "f958685d7111f390",
        "Q4_K": "14e5a3866c89fe32",
        "Q5_K": "3deed65fdfee0dc2",
        "Q8_K": "b1bf2c81781632cd",
    },
    "large": {
        "Q2_K": "0865be0e49363186",
        "Q4_K": "dc2797896325613c",
        "Q5_K": "280ef4447b2eadf8",
        "Q8_K": "d210b910f73a5a01",
    },
    "mixed": {
        "Q2_K": "51b5fcfca3930c84",
        "Q4_K": "65631364f0f2dec2",
        "Q5_K": "98c96294d82a03da",
        "Q8_K": "3e88e4cc5a85fb5a",
    },
    "negative_offset": {
        "Q2_K": "f4ff263ecff460d6",
        "Q4_K": "e4810ea76bc36088",
        "Q5_K": "65bfcc88a4ba3f2c",
        "Q8_K": "ed625d088d1cff8a",
    },
    "opposite_max": {
        "Q2_K": "34766cee864de004",
        "Q4_K": "32c5dec2cd1cb86d",
        "Q5_K": "6158cb90829092a3",
        "Q8_K": "22a22f91d5f8783a",
    },
    "positive_offset": {
        "Q2_K": "ddcb086d9ac99900",
        "Q4_K": "0e83684151576b99",
        "Q5_K": "1c5b8c14637bc3ee",
        "Q8_K": "24cff1a48d601c5e",
    },
    "q8k_ties": {
        "Q2_K": "5d4f3d3f05c18eb7",
        "Q4_K": "04a94de1c0ee4eeb",
        "Q5_K": "49c12abf9d93e083",
        "Q8_K": "b58332ae2d117b99",
    },
    "quiet_sub_block": {
        "Q2_K": "50b110714be8759b",
        "Q4_K": "cc5b15cb0f0f929a",
        "Q5_K": "feb96d9326c6a840",
        "Q8_K": "1ff20147ae573dbe",
    },
    "sparse": {
        "Q2_K": "1141813c3bff1b6e",
        "Q4_K": "a7562a4e4f5426f0",
        "Q5_K": "7fc650228a279a47",
        "Q8_K": "112ead2770e89eb7",
    },
    "tiny_d_rounds_to_zero": {
        "Q2_K": "780fc65cd4767180",
        "Q4_K": "4b618f589e64c909",
        "Q5_K": "509dbda4494bf457",
        "Q8_K": "3ef696567936d403",
    },
    "tiny_fp16_subnormal_d": {
        "Q2_K": "e1d76b43558d1deb",
        "Q4_K": "c9f7517f1bda4ef9",
        "Q5_K": "0ee305f7dcb33218",
        "Q8_K": "61f1951ea9e80670",
    },
}


@pytest.mark.parametrize("qtype", K_TYPES)
@pytest.mark.parametrize("case", sorted(CASES))
def test_crafted_blocks_match_pinned_ggml_bytes(case, qtype):
    got = quants.quantize(CASES[case], qtype)
    digest = hashlib.sha256(got.tobytes()).hexdigest()[:16]
    assert digest == GGML_DIGESTS[case][qtype]


# ---------------------------------------------------------------------------------------------
# The search itself, against a scalar transcription of ggml's make_qkx2_quants.


def _make_qkx2_scalar(x, w, nmax, rmin, rdelta, nstep, use_mad):
    """One sub-block, element by element in float32 scalars, as the C loop runs."""
    x = [F32(v) for v in x]
    w = [F32(v) for v in w]
    n = len(x)
    mn = mx = x[0]
    sum_w = w[0]
    sum_x = sum_w * x[0]
    for i in range(1, n):
        mn = x[i] if x[i] < mn else mn
        mx = x[i] if x[i] > mx else mx
        sum_w += w[i]
        sum_x += w[i] * x[i]
    if mn > 0:
        mn = F32(0)
    if mx == mn:
        return [0] * n, F32(0), -mn

    def err(d):
        return abs(d) if use_mad else d * d

    def quant(iscale, mn):
        return [max(0, min(nmax, int(nearest_int(iscale * (v - mn))))) for v in x]

    iscale = F32(nmax) / (mx - mn)
    scale = F32(1) / iscale
    lq = quant(iscale, mn)
    best = F32(0)
    for i in range(n):
        best += w[i] * err(scale * F32(lq[i]) + mn - x[i])
    for step in range(nstep + 1):
        laux = quant((F32(rmin) + F32(rdelta) * F32(step) + F32(nmax)) / (mx - mn), mn)
        sum_l = sum_l2 = sum_xl = F32(0)
        for i in range(n):
            wl = w[i] * F32(laux[i])
            sum_l += wl
            sum_l2 += wl * F32(laux[i])
            sum_xl += wl * x[i]
        det = sum_w * sum_l2 - sum_l * sum_l
        if det > 0:
            this_scale = (sum_w * sum_xl - sum_x * sum_l) / det
            this_min = (sum_l2 * sum_x - sum_l * sum_xl) / det
            if this_min > 0:
                this_min = F32(0)
                this_scale = sum_xl / sum_l2
            cur = F32(0)
            for i in range(n):
                cur += w[i] * err(this_scale * F32(laux[i]) + this_min - x[i])
            if cur < best:
                lq, best, scale, mn = laux, cur, this_scale, this_min
    return lq, scale, -mn


_SEARCHES = {  # (n, nmax, rmin, nstep, use_mad) as Q2_K, Q4_K, Q5_K call it
    "Q2_K": (16, 3, -0.5, 15, True),
    "Q4_K": (32, 15, -1.0, 20, False),
    "Q5_K": (32, 31, -0.5, 15, False),
}

_values = st.one_of(
    st.floats(-4, 4, width=32),
    st.sampled_from([0.0, 0.25, -0.25, 1.0, -1.0]),  # repeats make exact ties in the search
)


@settings(max_examples=60, deadline=None)
@given(
    qtype=st.sampled_from(sorted(_SEARCHES)),
    data=hnp.arrays(F32, (3, 32), elements=_values),
    scale=st.sampled_from([1.0, 2.0**-20, 2.0**10]),
)
def test_vectorised_search_equals_scalar_transcription(qtype, data, scale):
    n, nmax, rmin, nstep, use_mad = _SEARCHES[qtype]
    x = (data[:, :n] * F32(scale)).astype(F32)
    w = np.abs(x) if use_mad else np.sqrt(np.mean(x * x, axis=1, keepdims=True)) + np.abs(x)
    w = w.astype(F32)
    params = dict(nmax=nmax, rmin=rmin, rdelta=0.1, nstep=nstep, use_mad=use_mad)
    lq, sc, mins = make_qkx2_quants(np.ascontiguousarray(x.T), np.ascontiguousarray(w.T), **params)
    for j in range(x.shape[0]):
        with np.errstate(all="ignore"):  # tiny ranges overflow 1 / (max - min), as in C
            want_l, want_scale, want_min = _make_qkx2_scalar(x[j], w[j], **params)
        assert lq[:, j].tolist() == want_l
        assert bits(sc[j]) == bits(want_scale) or (sc[j] == 0 and want_scale == 0)
        assert bits(mins[j]) == bits(want_min) or (mins[j] == 0 and want_min == 0)


# ---------------------------------------------------------------------------------------------
# Stale bytes, sub-block structure, chunking.


def _k4_q(raw: np.ndarray, qtype: str) -> tuple[np.ndarray, np.ndarray]:
    """(sc, q) of Q4_K / Q5_K blocks: 6-bit scales (n, 8) and values (n, 8, 32)."""
    f = quants.get(qtype).unpack(raw)
    sc, _ = scale_min_k4(f["scales"], xp=np)
    qs = f["qs"].reshape(-1, 4, 1, 32)
    q = np.concatenate([qs & 15, qs >> 4], axis=2).reshape(-1, 8, 32)
    if qtype == "Q5_K":
        q = q | (((f["qh"][:, None, :] >> np.arange(8)[:, None]) & 1) << 4)
    return sc, q


@pytest.mark.parametrize("qtype", ["Q4_K", "Q5_K"])
@settings(max_examples=20, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), quiet=st.integers(0, 7))
def test_zero_scale_sub_block_keeps_search_values(qtype, seed, quiet):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal(256).astype(F32)
    x[32 * quiet : 32 * quiet + 32] *= F32(1e-5)
    raw = quants.quantize(x, qtype)
    sc, q = _k4_q(raw, qtype)
    assert sc[0, quiet] == 0
    # ggml skips re-quantizing it, so its bytes are the search's L, not zeros
    _, nmax, rmin, nstep, use_mad = _SEARCHES[qtype]
    sub = x[32 * quiet : 32 * quiet + 32]
    w = (np.sqrt(np.cumsum(sub * sub, dtype=F32)[-1] / F32(32)) + np.abs(sub)).astype(F32)
    lq, _, _ = make_qkx2_quants(
        sub[:, None], w[:, None], nmax=nmax, rmin=rmin, rdelta=0.1, nstep=nstep, use_mad=use_mad
    )
    np.testing.assert_array_equal(q[0, quiet], lq[:, 0])
    assert q[0, quiet].any()
    # and the values it decodes to are the sub-block's (constant) min
    y = quants.dequantize(raw, qtype, (256,))
    assert np.unique(y[32 * quiet : 32 * quiet + 32]).size == 1


def test_q2_k_zero_scale_sub_block_keeps_search_values():
    x = CASES["quiet_sub_block"]
    raw = quants.quantize(x, "Q2_K")
    f = quants.get("Q2_K").unpack(raw)
    assert (f["scales"][0, 2:4] & 15 == 0).all()
    qs = f["qs"].reshape(2, 32)
    q = np.stack([(qs >> (2 * j)) & 3 for j in range(4)], axis=1).reshape(16, 16)
    assert q[2:4].any()


@pytest.mark.parametrize("qtype", K_TYPES)
def test_search_chunks_do_not_change_bytes(qtype, monkeypatch):
    rng = np.random.default_rng(7)
    x = (rng.standard_normal((37, 256)) * rng.uniform(0.01, 3, (37, 1))).astype(F32)
    whole = quants.quantize(x, qtype)
    monkeypatch.setattr(kquant_search, "_SEARCH_ELEMENTS", 3 * 256)  # 3 blocks per chunk
    np.testing.assert_array_equal(quants.quantize(x, qtype), whole)
    one_by_one = np.concatenate([quants.quantize(row, qtype) for row in x])
    np.testing.assert_array_equal(one_by_one, whole)


@pytest.mark.parametrize("qtype", WEIGHT_K)
@pytest.mark.parametrize("sign", [1, -1])
def test_one_signed_blocks(qtype, sign):
    rng = np.random.default_rng(3)
    x = (sign * rng.uniform(0.5, 1.5, (8, 256))).astype(F32)
    raw = quants.quantize(x, qtype)
    y = quants.dequantize(raw, qtype, x.shape)
    f = quants.unpack(raw, qtype, x.shape)
    if qtype == "Q2_K":
        mins = f["scales"] >> 4
    else:
        _, mins = scale_min_k4(f["scales"], xp=np)
    if sign < 0:
        # the lowest level is -dmin * m: all-negative sub-blocks need a real min, while the
        # search clamps a positive fitted min to 0 (ggml's `this_min > 0` branch)
        assert mins.all()
    nmax = {"Q2_K": 3, "Q4_K": 15, "Q5_K": 31}[qtype]
    assert np.abs(y - x).max() < F32(1.5) / nmax  # within one level step of [0, 1.5]


@pytest.mark.parametrize("qtype", K_TYPES)
@pytest.mark.parametrize("exp", [-149, -140, -126, -100, -60, -30])
def test_tiny_blocks_are_finite_and_small(qtype, exp):
    x = (_BASE * F32(2.0**exp)).astype(F32)
    with np.errstate(all="ignore"):  # ggml divides by these tiny numbers too
        y = quants.dequantize(quants.quantize(x, qtype), qtype, x.shape)
    assert np.isfinite(y).all()
    assert np.abs(y).max() <= 2 * np.abs(x).max() + 2.0**-24  # fp16 scales floor at 2**-24


# ---------------------------------------------------------------------------------------------
# Q8_K.


def _q8k(x: np.ndarray) -> dict[str, np.ndarray]:
    return quants.unpack(quants.quantize(x, "Q8_K"), "Q8_K", x.shape)


@pytest.mark.parametrize("first", [1.0, -1.0])
def test_q8_k_opposite_sign_ties_keep_the_first(first):
    x = np.zeros(256, F32)
    x[5], x[200] = F32(first * 0.75), F32(-first * 0.75)
    x[100] = F32(0.3)
    f = _q8k(x)
    assert f["qs"][0, 5] == -127 and f["qs"][0, 200] == 127
    assert np.sign(f["d"][0, 0]) == -first  # d has the opposite sign of the first max


@settings(max_examples=50, deadline=None)
@given(x=hnp.arrays(F32, 256, elements=st.floats(-100, 100, width=32)))
def test_q8_k_properties(x):
    f = _q8k(x)
    q = f["qs"][0].astype(np.int32)
    assert q.max() <= 127 and q.min() >= -127
    np.testing.assert_array_equal(f["bsums"][0], q.reshape(16, 16).sum(axis=1))
    amax = np.abs(x).max()
    with np.errstate(over="ignore", divide="ignore"):
        iscale = F32(127) / amax
    if amax == 0 or not np.isfinite(iscale):
        # Below 127/FLT_MAX (~3.7e-37) ggml's iscale = -127/max overflows to inf: it stores
        # d = +-0 and q = 0 (nearest_int(+-inf) is -2**22, whose low byte is 0), checked with
        # quantize_row_q8_K_ref.
        assert f["d"][0, 0] == 0 and not q.any()
        return
    i = int(np.argmax(np.abs(x)))  # first of the largest magnitudes
    assert q[i] == -127
    assert np.sign(f["d"][0, 0]) == -np.sign(x[i])
    np.testing.assert_allclose(f["d"][0, 0] * q, x, atol=abs(float(f["d"][0, 0])) * 0.5001)


def test_q8_k_rounds_half_to_even():
    x = CASES["q8k_ties"]  # max |x| is -63.5 at index 0 -> iscale = 2, products x*2 exact
    q = _q8k(x)["qs"][0].astype(np.int32)
    np.testing.assert_array_equal(q, np.rint(x * F32(2)).astype(np.int32))


def test_q8_k_simd_is_the_reference():
    x = CASES["q8k_ties"]
    np.testing.assert_array_equal(
        quants.quantize(x, "Q8_K", rounding="simd"), quants.quantize(x, "Q8_K")
    )


def _extreme_q8k() -> dict[str, np.ndarray]:
    base = np.cos(np.arange(256, dtype=np.float32)).astype(F32)
    nan_first = base.copy()
    nan_first[0] = np.nan
    inf = base.copy()
    inf[7] = -np.inf
    return {
        "smallest_subnormal": np.full(256, 1e-45, F32),
        "below_127_over_flt_max": base * F32(1e-37),
        "above_127_over_flt_max": base * F32(1e-36),
        "nan_first": nan_first,
        "inf": inf,
        "huge": base * F32(3e38),
    }


EXTREME_Q8K = _extreme_q8k()
# sha256[:16] of quantize_row_q8_K_ref's bytes (ggml's CPU from_float gives the same ones)
EXTREME_Q8K_DIGESTS = {
    "smallest_subnormal": "d57f0e190f6b34d4",
    "below_127_over_flt_max": "d57f0e190f6b34d4",
    "above_127_over_flt_max": "57f112226c39b1ac",
    "nan_first": "95329431f47a8ab8",
    "inf": "9d2e82e7d93b1f36",
    "huge": "3ed789764116590a",
}


@pytest.mark.parametrize("name", sorted(EXTREME_Q8K_DIGESTS))
def test_q8_k_blocks_with_nan_inf_tiny_and_huge_values_give_ggmls_bytes(name):
    with np.errstate(all="ignore"):
        raw = quants.quantize(EXTREME_Q8K[name], "Q8_K")
    assert hashlib.sha256(raw.tobytes()).hexdigest()[:16] == EXTREME_Q8K_DIGESTS[name]


def test_q8_k_zero_block_writes_zero_bsums():
    f = _q8k(np.zeros(512, F32))
    assert not f["d"].any() and not f["qs"].any() and not f["bsums"].any()


# ---------------------------------------------------------------------------------------------
# Helpers and layout.


def test_nearest_int_is_ggmls_magic_rounding():
    v = np.array([0.5, 1.5, 2.5, -0.5, -1.5, -2.5, 4194303.0, -4194303.0], F32)
    np.testing.assert_array_equal(nearest_int(v), [0, 2, 2, 0, -2, -2, 4194303, -4194303])
    with np.errstate(invalid="ignore"):
        # outside ggml's range the trick returns what the C build returns: inf -> -2**22,
        # which the callers' clamps turn into 0, rejecting a degenerate search step
        assert nearest_int(np.array([np.inf], F32))[0] == -(2**22)
        assert nearest_int(np.array([np.inf], F32) * F32(0))[0] in (0, -(2**22))


@pytest.mark.parametrize(
    ("qtype", "fields"),
    [
        ("Q2_K", {"scales": (16, np.uint8), "qs": (64, np.uint8), "d": (1, F32), "dmin": (1, F32)}),
        (
            "Q4_K",
            {"d": (1, F32), "dmin": (1, F32), "scales": (12, np.uint8), "qs": (128, np.uint8)},
        ),
        (
            "Q5_K",
            {
                "d": (1, F32),
                "dmin": (1, F32),
                "scales": (12, np.uint8),
                "qh": (32, np.uint8),
                "qs": (128, np.uint8),
            },
        ),
        ("Q8_K", {"d": (1, F32), "qs": (256, np.int8), "bsums": (16, np.int16)}),
    ],
)
def test_unpack_fields(qtype, fields):
    raw = quants.quantize(np.stack([_BASE, -_POS, _POS]), qtype)
    got = quants.unpack(raw, qtype, (3, 256))
    assert set(got) == set(fields)
    for name, (width, dtype) in fields.items():
        assert got[name].shape == (3, width) and got[name].dtype == dtype, name
    assert quants.get(qtype).vec_dot_type == "Q8_K"


@pytest.mark.parametrize("qtype", K_TYPES)
def test_random_bytes_dequantize_identically_in_every_namespace(qtype, xp):
    cls = quants.get(qtype)
    rng = np.random.default_rng(11)
    raw = rng.integers(0, 256, (64, cls.type_size), dtype=np.uint8)
    # keep the float scales finite: clear the top exponent bit (fp16 exponent 31 is inf / NaN)
    for byte in {"Q2_K": (81, 83), "Q4_K": (1, 3), "Q5_K": (1, 3)}.get(qtype, ()):
        raw[:, byte] &= 0xBF
    if qtype == "Q8_K":
        # an f32 d around 2**-7..2**-4: normal, since XLA on CPU flushes subnormals to zero
        raw[:, 3] = (raw[:, 3] & 0x80) | 0x3C
    want = quants.dequantize(raw, qtype, (64, 256))
    got = quants.dequantize(raw, qtype, (64, 256), xp=xp)
    np.testing.assert_array_equal(bits(to_numpy(got)), bits(want))
