"""Every GGML type against the bytes and values ggml itself produced (tests/data)."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from qllama import quants
from qllama.array_api import to_numpy
from qllama.errors import TensorShapeError, UnsupportedTensorTypeError

WEIGHT_TYPES = [
    "F16",
    "BF16",
    "Q4_0",
    "Q4_1",
    "Q5_0",
    "Q5_1",
    "Q8_0",
    "Q2_K",
    "Q3_K",
    "Q4_K",
    "Q5_K",
    "Q6_K",
]
ACT_TYPES = ["Q8_0", "Q8_1", "Q8_K"]


def bits(x: np.ndarray) -> np.ndarray:
    """Compare floats bit for bit (tells -0.0 from 0.0, matches NaN payloads)."""
    return np.ascontiguousarray(x, dtype=np.float32).view(np.uint32)


@pytest.mark.parametrize("qtype", WEIGHT_TYPES)
def test_quantize_is_bit_exact_with_ggml(qtype, ggml_vectors):
    got = quants.quantize(ggml_vectors["weights_f32"], qtype)
    want = ggml_vectors[f"w/{qtype}/bytes"]
    assert got.shape == want.shape
    bad = np.flatnonzero((got != want).any(axis=1))
    assert bad.size == 0, f"{qtype}: rows {bad.tolist()} differ from ggml"


@pytest.mark.parametrize("qtype", [t for t in WEIGHT_TYPES if t not in ("F16", "BF16")])
def test_dequantize_is_bit_exact_with_ggml(qtype, ggml_vectors):
    raw = ggml_vectors[f"w/{qtype}/bytes"]
    got = quants.dequantize(raw, qtype, (raw.shape[0], 512))
    np.testing.assert_array_equal(bits(got), bits(ggml_vectors[f"w/{qtype}/dequant"]))


@pytest.mark.parametrize("qtype", ["F16", "BF16"])
def test_half_types_widen_exactly(qtype, ggml_vectors):
    raw = ggml_vectors[f"w/{qtype}/bytes"]
    got = quants.dequantize(raw, qtype, (raw.shape[0], 512))
    if qtype == "F16":
        want = raw.view("<f2").astype(np.float32)
    else:
        want = (raw.view("<u2").astype(np.uint32) << 16).view(np.float32)
    np.testing.assert_array_equal(bits(got), bits(want))


@pytest.mark.parametrize("qtype", ACT_TYPES)
@pytest.mark.parametrize("rounding", ["ref", "simd"])
def test_activation_quantization_is_bit_exact_with_ggml(qtype, rounding, ggml_vectors):
    got = quants.quantize(ggml_vectors["acts_f32"], qtype, rounding=rounding)
    want = ggml_vectors[f"act/{qtype}/{'ref' if rounding == 'ref' else 'cpu'}"]
    np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("qtype", WEIGHT_TYPES)
def test_vec_dot_type_is_ggmls(qtype, ggml_vectors):
    assert quants.get(qtype).vec_dot_type == str(ggml_vectors[f"w/{qtype}/vec_dot_type"])


@pytest.mark.parametrize("qtype", [*WEIGHT_TYPES, "Q8_1", "Q8_K", "F32"])
def test_dequantize_is_identical_in_every_namespace(qtype, xp, ggml_vectors):
    raw = quants.quantize(ggml_vectors["weights_f32"], qtype)
    want = quants.dequantize(raw, qtype, (11, 512))
    got = quants.dequantize(raw, qtype, (11, 512), xp=xp)
    assert got.dtype == xp.float32
    np.testing.assert_array_equal(bits(to_numpy(got)), bits(want))


# ggml's tests/test-quantize-fns.cpp budgets, in its own error metric: sqrt(sum of squared
# differences) / n over n = 4096 values of its vector 0.1 + 2 cos(i + offset). (Not a true
# RMSE: that would be sqrt(sum / n); the budgets only mean something in ggml's metric.)
BUDGETS = {"Q2_K": 0.0075, "Q3_K": 0.0040}


@settings(max_examples=25, deadline=None)
@given(offset=st.floats(0, 100), qtype=st.sampled_from([*WEIGHT_TYPES, "Q8_1", "Q8_K"]))
def test_roundtrip_error_within_ggml_budget(offset, qtype):
    x = (0.1 + 2 * np.cos(np.arange(4096, dtype=np.float64) + offset)).astype(np.float32)
    y = quants.dequantize(quants.quantize(x, qtype), qtype, x.shape)
    err = float(np.sqrt(np.sum((y.astype(np.float64) - x) ** 2)) / x.size)
    assert err < BUDGETS.get(qtype, 0.002), f"{qtype}: ggml error {err}"


@settings(max_examples=40, deadline=None)
@given(qtype=st.sampled_from([*WEIGHT_TYPES, "Q8_1", "Q8_K"]), seed=st.integers(0, 2**32 - 1))
def test_random_bytes_dequantize_without_error(qtype, seed):
    cls = quants.get(qtype)
    rng = np.random.default_rng(seed)
    raw = rng.integers(
        0, 256, size=(3, 2 * cls.type_size * (256 // cls.block_size)), dtype=np.uint8
    )
    with np.errstate(all="ignore"):
        y = quants.dequantize(raw, qtype, (3, 512))
    assert y.shape == (3, 512) and y.dtype == np.float32


def test_zero_rows_quantize_to_zero(ggml_vectors):
    for qtype in [*WEIGHT_TYPES, "Q8_1", "Q8_K"]:
        raw = quants.quantize(np.zeros((2, 512), np.float32), qtype)
        assert not quants.dequantize(raw, qtype, (2, 512)).any(), qtype


@pytest.mark.parametrize("qtype", [*WEIGHT_TYPES, "Q8_1", "Q8_K", "F32"])
def test_no_rows(qtype):
    cls = quants.get(qtype)
    raw = quants.quantize(np.zeros((0, 512), np.float32), qtype)
    assert raw.shape == (0, 512 // cls.block_size * cls.type_size)
    assert quants.dequantize(raw, qtype, (0, 512)).shape == (0, 512)


def test_shape_and_type_errors():
    with pytest.raises(TensorShapeError, match="multiple of the Q4_K block size 256"):
        quants.quantize(np.zeros((2, 100), np.float32), "Q4_K")
    with pytest.raises(TensorShapeError, match="needs 34 bytes, got 33"):
        quants.dequantize(np.zeros(33, np.uint8), "Q8_0", (32,))
    with pytest.raises(UnsupportedTensorTypeError, match="F64 is valid but"):
        quants.get("F64")
    with pytest.raises(UnsupportedTensorTypeError, match="unknown GGML type 999"):
        quants.get(999)
    with pytest.raises(ValueError, match="rounding"):
        quants.quantize(np.zeros(256, np.float32), "Q4_K", rounding="simd")
