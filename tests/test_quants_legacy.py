"""Edge cases of the float and legacy 32-block types that the ggml vectors do not reach.

Expected values follow ggml's C code (ggml-quants.c, ggml-impl.h, ggml-cpu/arch/x86/quants.c);
the ones that depend on how x86 casts NaN or overflowing floats to int were checked against
the library itself.
"""

from __future__ import annotations

import hashlib

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from qllama import quants
from qllama.array_api import to_numpy

LEGACY = ["Q4_0", "Q4_1", "Q5_0", "Q5_1"]
# (type, lowest and highest integer level relative to the block scale) of the symmetric types
SYMMETRIC = [("Q4_0", -8, 7), ("Q5_0", -16, 15)]
F16_NAN = 0x7E00


def bits(x: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(x, dtype=np.float32).view(np.uint32)


def f32(*values: float) -> np.ndarray:
    return np.array(values, dtype=np.float32)


def half_bits(raw: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(raw).view("<u2")


# --- Q4_0 / Q5_0: truncation of x*id + 8.5 (16.5) rounds exact halves up -------------------


@pytest.mark.parametrize(("qtype", "lo", "hi"), SYMMETRIC)
def test_symmetric_types_round_exact_halves_up(qtype, lo, hi):
    # max = lo (negative) gives d = 1 and id = 1, so x*id is exact and every .5 is a tie
    ties = f32(0.5, -0.5, 1.5, -1.5, 2.5, -2.5, 6.5, -6.5)
    x = np.concatenate([f32(lo), ties, np.zeros(23, np.float32)])
    y = quants.dequantize(quants.quantize(x, qtype), qtype, x.shape)
    np.testing.assert_array_equal(y[1:9], np.floor(ties + 0.5))
    assert y[0] == lo


@settings(max_examples=60, deadline=None)
@given(
    case=st.sampled_from(SYMMETRIC),
    exp=st.integers(-12, 8),
    halves=st.lists(st.integers(-40, 40), min_size=31, max_size=31),
)
def test_symmetric_types_round_half_up_on_any_power_of_two_scale(case, exp, halves):
    qtype, lo, hi = case
    d = 2.0**exp
    # the extreme element maps to lo; the others are multiples of d/2 within its magnitude
    x = np.array([lo * d] + [min(max(h / 2, lo), -lo) * d for h in halves], np.float32)
    y = quants.dequantize(quants.quantize(x, qtype), qtype, x.shape)
    want = np.clip(np.floor(x / d + 0.5), lo, hi) * d
    np.testing.assert_array_equal(y, want.astype(np.float32))


@pytest.mark.parametrize(("qtype", "lo", "hi"), SYMMETRIC)
def test_symmetric_scale_takes_the_sign_of_the_first_extreme(qtype, lo, hi):
    x = np.zeros(32, np.float32)
    x[[3, 20]] = f32(2.0, -2.0)  # same |x|: the first (positive) one wins
    d = quants.unpack(quants.quantize(x, qtype), qtype, x.shape)["d"]
    assert d[0, 0] == 2.0 / lo  # negative
    y = quants.dequantize(quants.quantize(x, qtype), qtype, x.shape)
    assert y[3] == 2.0 and y[20] == -2.0 * hi / -lo  # -2 clamps to the top level


# --- Q4_1 / Q5_1 ------------------------------------------------------------------------------


@settings(max_examples=60, deadline=None)
@given(
    case=st.sampled_from([("Q4_1", 15), ("Q5_1", 31)]),
    exp=st.integers(-10, 4),
    base=st.integers(-64, 64),
    levels=st.lists(st.integers(0, 31), min_size=30, max_size=30),
)
def test_offset_types_reproduce_values_on_their_grid(case, exp, base, levels):
    qtype, top = case
    d = 2.0**exp
    m = base * 2.0**-4
    ks = [0, top] + [min(k, top) for k in levels]  # block min and max on the grid
    x = np.array([k * d + m for k in ks], np.float32)
    y = quants.dequantize(quants.quantize(x, qtype), qtype, x.shape)
    np.testing.assert_array_equal(y, x)


@pytest.mark.parametrize("qtype", ["Q4_1", "Q5_1"])
def test_offset_types_keep_the_sign_of_the_first_zero_minimum(qtype):
    x = np.ones(32, np.float32)
    x[[4, 9]] = f32(-0.0, 0.0)
    m = quants.quantize(x, qtype)[0, 2:4]
    assert half_bits(m)[0] == 0x8000  # -0.0 came first; 0.0 < -0.0 is false
    x[[4, 9]] = f32(0.0, -0.0)
    assert half_bits(quants.quantize(x, qtype)[0, 2:4])[0] == 0x0000


# --- every legacy type ------------------------------------------------------------------------


@pytest.mark.parametrize("qtype", [*LEGACY, "F16", "BF16", "F32"])
@pytest.mark.parametrize("value", [0.375, -3.0, 1024.0, -0.0078125])
def test_constant_rows_come_back_exactly(qtype, value):
    x = np.full((2, 64), value, np.float32)
    y = quants.dequantize(quants.quantize(x, qtype), qtype, x.shape)
    np.testing.assert_array_equal(y, x)


def test_constant_row_in_q8_1_is_all_extremes():
    x = np.full(64, -0.3, np.float32)
    fields = quants.unpack(quants.quantize(x, "Q8_1"), "Q8_1", x.shape)
    assert (fields["qs"] == -127).all()


@pytest.mark.parametrize("qtype", ["Q4_0", "Q5_0"])
@pytest.mark.parametrize("zero", [0.0, -0.0])
def test_zero_blocks_store_negative_zero_scale(qtype, zero):
    # the scan starts from max = +0.0, so d = +0.0 / -8 = -0.0 whatever the zeros' signs
    raw = quants.quantize(np.full(32, zero, np.float32), qtype)
    assert half_bits(raw[0, :2])[0] == 0x8000
    # id = 0, so every level is the middle one (8 or 16)
    fields = quants.unpack(raw, qtype, (32,))
    assert (fields["qs"] == (0x88 if qtype == "Q4_0" else 0x00)).all()
    assert (fields.get("qh", np.full((1, 4), 0xFF)) == 0xFF).all()
    assert not quants.dequantize(raw, qtype, (32,)).any()


@pytest.mark.parametrize("qtype", LEGACY)
def test_nan_elements_are_skipped_by_the_scale_and_stored_as_zero(qtype):
    rng = np.random.default_rng(0)
    x = rng.normal(size=32).astype(np.float32)
    with_nan = x.copy()
    with_nan[5] = np.nan
    clean = quants.quantize(x, qtype)
    dirty = quants.quantize(with_nan, qtype)
    scale_bytes = 4 if qtype.endswith("_1") else 2
    np.testing.assert_array_equal(dirty[0, :scale_bytes], clean[0, :scale_bytes])
    # x86 casts NaN to int as 0x80000000, whose low byte (the stored level) is 0
    fields = quants.unpack(dirty, qtype, (32,))
    level = fields["qs"][0, 5] & 0x0F
    assert level == 0
    if "qh" in fields:
        assert not fields["qh"][0, 0] & (1 << 5)


@pytest.mark.parametrize("qtype", ["Q4_0", "Q5_0"])
def test_scale_whose_reciprocal_overflows_gives_zero_levels(qtype):
    # d = 1e-39 / -8 is subnormal and 1/d overflows: x*id is +-inf, cast to int it is
    # 0x80000000 on x86, so every level is 0 (checked against ggml's own build)
    x = np.full(32, 1e-39, np.float32)
    raw = quants.quantize(x, qtype)
    assert half_bits(raw[0, :2])[0] == 0x8000  # -1.25e-40 rounds to -0 in fp16
    assert not raw[0, 2:].any()


@pytest.mark.parametrize("qtype", ["Q5_0", "Q5_1"])
@pytest.mark.parametrize("element", range(32))
def test_fifth_bit_of_element_e_is_bit_e_of_qh(qtype, element):
    cls = quants.get(qtype)
    block = np.zeros((1, cls.type_size), np.uint8)
    block[0, :2] = np.array([1.0], "<f2").view(np.uint8)  # d = 1, m = 0
    qh = 2 if qtype == "Q5_0" else 4
    block[0, qh : qh + 4] = np.array([1 << element], "<u4").view(np.uint8)
    y = quants.dequantize(block, qtype, (32,))
    offset = -16 if qtype == "Q5_0" else 0
    want = np.full(32, offset, np.float32)
    want[element] += 16
    np.testing.assert_array_equal(y, want)


@pytest.mark.parametrize("qtype", LEGACY)
def test_low_nibbles_are_the_first_half(qtype):
    cls = quants.get(qtype)
    block = np.zeros((1, cls.type_size), np.uint8)
    block[0, :2] = np.array([1.0], "<f2").view(np.uint8)
    block[0, -16:] = np.arange(16, dtype=np.uint8) | (np.arange(15, -1, -1, dtype=np.uint8) << 4)
    fields = quants.unpack(block, qtype, (32,))
    y = quants.dequantize(block, qtype, (32,))
    offset = {"Q4_0": -8, "Q5_0": -16}.get(qtype, 0)
    want = np.concatenate([np.arange(16), np.arange(15, -1, -1)]) + offset
    np.testing.assert_array_equal(y, want.astype(np.float32))
    assert set(fields) >= {"d", "qs"} and fields["qs"].dtype == np.uint8


@pytest.mark.parametrize("qtype", ["Q4_1", "Q5_1"])
def test_nan_scale_and_min_give_the_same_nan_in_every_namespace(qtype, xp):
    # ggml (x86 addss) keeps the NaN of q*d; libraries differ unless we pick it explicitly
    cls = quants.get(qtype)
    block = np.zeros((1, cls.type_size), np.uint8)
    block[0, :4] = np.array([0x7E01, 0xFE77], "<u2").view(np.uint8)  # two distinct NaNs
    block[0, -16:] = 0x5A
    want = quants.dequantize(block, qtype, (32,))
    got = to_numpy(quants.dequantize(block, qtype, (32,), xp=xp))
    np.testing.assert_array_equal(bits(got), bits(want))
    d = np.array([0x7E01], "<u2").view("<f2").astype(np.float32)
    np.testing.assert_array_equal(bits(got), bits(np.full(32, np.float32(5) * d[0])))


# --- Q8_1 -------------------------------------------------------------------------------------


def test_q8_1_ties_round_away_in_ref_and_to_even_in_simd():
    # amax = 127 gives d = 1 and id = 1 (ref: 1/d, simd: 127/amax), so every .5 is a tie
    x = np.zeros(32, np.float32)
    x[:6] = f32(127.0, 0.5, 1.5, 2.5, -0.5, -2.5)
    ref = quants.unpack(quants.quantize(x, "Q8_1"), "Q8_1", x.shape)
    simd = quants.unpack(quants.quantize(x, "Q8_1", rounding="simd"), "Q8_1", x.shape)
    assert ref["qs"][0, :6].tolist() == [127, 1, 2, 3, -1, -3]
    assert simd["qs"][0, :6].tolist() == [127, 0, 2, 2, 0, -2]
    assert ref["s"][0, 0] == 129.0 and simd["s"][0, 0] == 129.0


@settings(max_examples=40, deadline=None)
@given(
    seed=st.integers(0, 2**32 - 1),
    scale=st.floats(1e-3, 1e3),
    rounding=st.sampled_from(["ref", "simd"]),
)
def test_q8_1_s_is_fp16_of_f32_d_times_sum(seed, scale, rounding):
    x = (np.random.default_rng(seed).normal(size=(4, 32)) * scale).astype(np.float32)
    f = quants.unpack(quants.quantize(x, "Q8_1", rounding=rounding), "Q8_1", x.shape)
    d32 = np.max(np.abs(x), axis=1, keepdims=True) / np.float32(127)  # f32, not the stored d
    total = f["qs"].astype(np.int32).sum(axis=1, keepdims=True).astype(np.float32)
    np.testing.assert_array_equal(f["s"], (d32 * total).astype(np.float16).astype(np.float32))
    np.testing.assert_array_equal(f["d"], d32.astype(np.float16).astype(np.float32))


@pytest.mark.parametrize("rounding", ["ref", "simd"])
def test_q8_1_s_uses_the_f32_scale_not_the_stored_one(rounding):
    # every q is 127, sum 4064; d = 0.51/127 is not an fp16, and the two products round apart
    x = np.full(32, 0.51, np.float32)
    s = quants.unpack(quants.quantize(x, "Q8_1", rounding=rounding), "Q8_1", x.shape)["s"]
    d32 = np.float32(0.51) / np.float32(127)
    total = np.float32(4064)
    assert s[0, 0] == np.float16(d32 * total)
    assert s[0, 0] != np.float16(np.float32(np.float16(d32)) * total)  # candle's s


def test_q8_1_trailing_nan():
    x = np.linspace(-1, 1, 32, dtype=np.float32)
    x[-1] = np.nan
    ref = quants.quantize(x, "Q8_1")
    # ref: MAX(amax, NaN) is NaN, so d and s are ggml's quiet NaN and (int8_t) of every
    # NaN level is the low byte of 0x80000000
    assert half_bits(ref[0, :2])[0] == F16_NAN and half_bits(ref[0, 2:4])[0] == F16_NAN
    assert not ref[0, 4:].any()
    # simd: maxps returns its second operand on NaN, so the lane tree drops this NaN; the
    # NaN element alone converts to 0x80000000 and packs (saturating) to -128
    simd = quants.unpack(quants.quantize(x, "Q8_1", rounding="simd"), "Q8_1", x.shape)
    assert simd["d"][0, 0] == np.float16(np.float32(1) / np.float32(127))
    assert simd["qs"][0, 0] == -127 and simd["qs"][0, 31] == -128


# --- Q8_0 / Q8_1 on NaN, inf, tiny and huge blocks --------------------------------------------


def _extreme_blocks() -> dict[str, np.ndarray]:
    base = np.linspace(-1, 1, 32, dtype=np.float32)

    def with_values(**at: float) -> np.ndarray:
        x = base.copy()
        for i, v in at.items():
            x[int(i[1:])] = v
        return x

    payload_nans = np.array([0x7FC12345, 0x7F800001, 0xFFE00000], np.uint32).view(np.float32)
    x_payload = base.copy()
    x_payload[[2, 17, 30]] = payload_nans
    return {
        "nan_middle": with_values(i10=np.nan),
        "nan_last": with_values(i31=np.nan),
        "nan_first": with_values(i0=np.nan),
        "inf": with_values(i3=np.inf),
        "both_infs": with_values(i3=np.inf, i20=-np.inf),
        "inf_and_nan": with_values(i5=np.nan, i6=np.inf),
        "payload_nans": x_payload,
        "subnormal": base * np.float32(1e-39),
        "tiny_normal": base * np.float32(1e-37),
        "huge": base * np.float32(3e38),
    }


EXTREME_BLOCKS = _extreme_blocks()

# sha256[:16] of the bytes ggml wrote for each block: quantize_row_q8_*_ref ("ref") and the
# AVX2 from_float ("simd"), through ctypes on llama-cpp-python 0.3.36's libggml.
EXTREME_DIGESTS = {
    ("Q8_0", "ref", "nan_middle"): "beaa851c9298e3ab",
    ("Q8_0", "ref", "nan_last"): "a78a933248cf2512",
    ("Q8_0", "ref", "nan_first"): "ee18de5c8245a1ae",
    ("Q8_0", "ref", "inf"): "380ac601ddd28d1a",
    ("Q8_0", "ref", "both_infs"): "380ac601ddd28d1a",
    ("Q8_0", "ref", "inf_and_nan"): "380ac601ddd28d1a",
    ("Q8_0", "ref", "payload_nans"): "1c1271bc6d21e083",
    ("Q8_0", "ref", "subnormal"): "eb142b0cae0baa72",
    ("Q8_0", "ref", "tiny_normal"): "eb142b0cae0baa72",
    ("Q8_0", "ref", "huge"): "13947092dd15066d",
    ("Q8_0", "simd", "nan_middle"): "3d6180fa331b561e",
    ("Q8_0", "simd", "nan_last"): "59777bfa5228b6bc",
    ("Q8_0", "simd", "nan_first"): "9874ff38728d75ac",
    ("Q8_0", "simd", "inf"): "8a86df0063de8514",
    ("Q8_0", "simd", "both_infs"): "c35991bc07275a09",
    ("Q8_0", "simd", "inf_and_nan"): "c8ce6451e84746a3",
    ("Q8_0", "simd", "payload_nans"): "b01e04f6c388a8be",
    ("Q8_0", "simd", "subnormal"): "86033d5c469e3af3",
    ("Q8_0", "simd", "tiny_normal"): "86033d5c469e3af3",
    ("Q8_0", "simd", "huge"): "13947092dd15066d",
    ("Q8_1", "ref", "nan_middle"): "f212de32d4da3fee",
    ("Q8_1", "ref", "nan_last"): "6c9864937081dd32",
    ("Q8_1", "ref", "nan_first"): "4b1d2cdfe8ccffea",
    ("Q8_1", "ref", "inf"): "b57f0418740ea667",
    ("Q8_1", "ref", "both_infs"): "b57f0418740ea667",
    ("Q8_1", "ref", "inf_and_nan"): "b57f0418740ea667",
    ("Q8_1", "ref", "payload_nans"): "aef5e3ef4eccb9ae",
    ("Q8_1", "ref", "subnormal"): "6db65fd59fd356f6",
    ("Q8_1", "ref", "tiny_normal"): "6db65fd59fd356f6",
    ("Q8_1", "ref", "huge"): "fba33616327143b2",
    ("Q8_1", "simd", "nan_middle"): "7fcf4ff4d1dc34e3",
    ("Q8_1", "simd", "nan_last"): "9f5afe2d5035a835",
    ("Q8_1", "simd", "nan_first"): "3cd547ad379b1008",
    ("Q8_1", "simd", "inf"): "39501aa5c67f42c3",
    ("Q8_1", "simd", "both_infs"): "c41156bd1a73e2d7",
    ("Q8_1", "simd", "inf_and_nan"): "49cff25551227a81",
    ("Q8_1", "simd", "payload_nans"): "8e8546069c18f0e3",
    ("Q8_1", "simd", "subnormal"): "ceab12def24f3d10",
    ("Q8_1", "simd", "tiny_normal"): "ceab12def24f3d10",
    ("Q8_1", "simd", "huge"): "fba33616327143b2",
}


@pytest.mark.parametrize(("qtype", "rounding", "name"), sorted(EXTREME_DIGESTS))
def test_q8_blocks_with_nan_inf_tiny_and_huge_values_give_ggmls_bytes(qtype, rounding, name):
    with np.errstate(all="ignore"):
        raw = quants.quantize(EXTREME_BLOCKS[name], qtype, rounding=rounding)
    assert hashlib.sha256(raw.tobytes()).hexdigest()[:16] == EXTREME_DIGESTS[qtype, rounding, name]


# --- F16 / BF16 ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("value", "want"),
    [
        (0x3F808000, 0x3F80),  # tie, even stays
        (0x3F818000, 0x3F82),  # tie, odd rounds up
        (0xBF818000, 0xBF82),  # negative tie
        (0x3F808001, 0x3F81),  # just above a tie
        (0x7F7FFFFF, 0x7F80),  # largest float rounds to inf
        (0x7F800000, 0x7F80),  # inf
        (0xFF800000, 0xFF80),  # -inf
        (0x00008000, 0x0000),  # subnormal tie to even zero
        (0x7FC00000, 0x7FC0),  # quiet NaN
        (0x7F800001, 0x7FC0),  # signalling NaN: truncated, then forced quiet
        (0xFF812345, 0xFFC1),  # sign and top payload kept
        (0x7FFFFFFF, 0x7FFF),  # no rounding carry into the sign
    ],
)
def test_bf16_rounding_matches_ggml_compute_fp32_to_bf16(value, want):
    x = np.array([value], np.uint32).view(np.float32)
    assert half_bits(quants.quantize(x, "BF16"))[0, 0] == want


@pytest.mark.parametrize(
    ("value", "want"),
    [
        (65504.0, 0x7BFF),
        (65519.0, 0x7BFF),  # below the midpoint to 65536
        (65520.0, 0x7C00),  # the tie rounds to even: inf
        (-np.inf, 0xFC00),
        (1 + 2.0**-11, 0x3C00),  # tie to even
        (1 + 3 * 2.0**-11, 0x3C02),
        (2.0**-25, 0x0000),  # half the smallest subnormal: tie to even zero
        (3 * 2.0**-26, 0x0001),
    ],
)
def test_f16_rounding_matches_ggml(value, want):
    assert half_bits(quants.quantize(np.array([value], np.float32), "F16"))[0, 0] == want


@pytest.mark.parametrize(
    ("value", "want"),
    [(0x7FC00000, F16_NAN), (0xFFC12345, 0x8000 | F16_NAN), (0x7F800001, F16_NAN)],
)
def test_f16_nans_become_ggmls_quiet_nan(value, want):
    # numpy's cast would keep the top payload bits (0xFE09 for the second)
    x = np.array([value], np.uint32).view(np.float32)
    assert half_bits(quants.quantize(x, "F16"))[0, 0] == want


def test_f16_widening_quiets_signalling_nans_as_ggml_does():
    raw = np.array([0x7C01, 0xFD55, 0x7E00, 0x7C00], "<u2").view(np.uint8)
    y = bits(quants.dequantize(raw, "F16", (4,)))
    assert [hex(v) for v in y] == ["0x7fc02000", "0xffeaa000", "0x7fc00000", "0x7f800000"]


@pytest.mark.parametrize("qtype", ["F16", "BF16", "F32"])
def test_float_types_are_one_value_per_block(qtype):
    cls = quants.get(qtype)
    x = np.arange(-3, 4, dtype=np.float32).reshape(1, 7) / 4
    raw = quants.quantize(x, qtype)
    assert cls.block_size == 1 and raw.shape == (1, 7 * cls.type_size)
    assert quants.unpack(raw, qtype, x.shape)["x"].shape == (7, 1)
    np.testing.assert_array_equal(quants.dequantize(raw, qtype, x.shape), x)


def test_f32_keeps_every_bit():
    u = np.array([0x7F800001, 0xFFC12345, 0x80000000, 0x00000001], np.uint32)
    raw = quants.quantize(u.view(np.float32), "F32")
    np.testing.assert_array_equal(bits(quants.dequantize(raw, "F32", (4,))), u)


@pytest.mark.parametrize("qtype", ["F32", "F16", "BF16", *LEGACY])
def test_only_q8_1_offers_simd_rounding(qtype):
    assert quants.get(qtype).roundings == ("ref",)
    with pytest.raises(ValueError, match="rounding"):
        quants.quantize(np.zeros(32, np.float32), qtype, rounding="simd")
    assert quants.get("Q8_1").roundings == ("ref", "simd")
