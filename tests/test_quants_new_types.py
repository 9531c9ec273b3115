"""IQ4_NL, IQ4_XS, TQ1_0, TQ2_0, MXFP4, NVFP4, Q1_0, Q2_0, and quantization with an importance
matrix (these and Q4_0 .. Q6_K), against what ggml itself computed
(tests/data/ggml_vectors_new_types.npz, written by tests/data/make_vectors.py)."""

from __future__ import annotations

import ctypes
import ctypes.util
from pathlib import Path

import numpy as np
import pytest
from bounds import reorder_bound
from hypothesis import given, settings
from hypothesis import strategies as st

from qllama import quants
from qllama.array_api import to_numpy
from qllama.backends.base import QuantTensor
from qllama.backends.numpy import dispatch
from qllama.backends.numpy.dispatch import NumpyBackend
from qllama.errors import ImatrixError
from qllama.ggml_types import GGMLType
from qllama.quants import fp4, iq4_nl, iq4_search, iq_grids

F32 = np.float32
NEW = ["IQ4_NL", "IQ4_XS", "TQ1_0", "TQ2_0", "MXFP4", "NVFP4", "Q1_0", "Q2_0"]
OLD = ["Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K"]
N_IMATRIX = 4


VECTORS = Path(__file__).parent / "data" / "ggml_vectors_new_types.npz"


@pytest.fixture(scope="module")
def v() -> dict[str, np.ndarray]:
    with np.load(VECTORS) as z:
        return {k: z[k] for k in z.files}


def bits(x: np.ndarray) -> np.ndarray:
    """Floats bit for bit (-0.0 and NaN payloads included)."""
    return np.ascontiguousarray(x, dtype=F32).view(np.uint32)


def assert_rows_equal(
    got: np.ndarray, want: np.ndarray, v: dict[str, np.ndarray], what: str
) -> None:
    bad = np.flatnonzero((got != want).any(axis=1))
    assert bad.size == 0, f"{what}: rows {[str(v['weight_names'][i]) for i in bad]} differ"


# --- quantize -----------------------------------------------------------------------------------


@pytest.fixture(params=["numpy", "numba"])
def search(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """IQ4_NL's and IQ4_XS's scale search in numpy (the oracle) and compiled, where numba
    is installed."""
    if request.param == "numba" and not dispatch.kernels_available():
        pytest.skip("numba is not installed")
    monkeypatch.setattr(iq_grids, "USE_COMPILED", request.param == "numba")
    return request.param


@pytest.mark.parametrize("qtype", NEW)
def test_quantize_is_ggml_quantize_chunk(qtype, v, search):
    got = quants.quantize(v["weights_f32"], qtype)
    assert_rows_equal(got, v[f"w/{qtype}/bytes"], v, qtype)


@pytest.mark.parametrize("k", range(N_IMATRIX))
@pytest.mark.parametrize("qtype", NEW + OLD)
def test_quantize_with_an_imatrix_is_ggml_quantize_chunk(qtype, k, v, search):
    got = quants.quantize(v["weights_f32"], qtype, imatrix=v["imatrix_f32"][k])
    assert_rows_equal(got, v[f"w/{qtype}/bytes_imatrix"][k], v, f"{qtype}, {v['imatrix_names'][k]}")


@pytest.mark.parametrize("qtype", NEW)
def test_cpu_from_float_is_ggmls(qtype, v):
    """The CPU's own quantizer of each type: ggml_quantize_chunk's, except IQ4_NL's."""
    w = v["weights_f32"]
    got = (
        iq4_nl.quantize_row_ref(w.reshape(-1, 32)).reshape(w.shape[0], -1)
        if qtype == "IQ4_NL"
        else quants.quantize(w, qtype)
    )
    assert_rows_equal(got, v[f"w/{qtype}/from_float_cpu"], v, qtype)
    assert_rows_equal(got, v[f"w/{qtype}/from_float_ref"], v, qtype)


def test_iq4_nl_row_ref_differs_from_the_chunk_quantizer(v):
    ref = iq4_nl.quantize_row_ref(v["weights_f32"].reshape(-1, 32))
    chunk = quants.quantize(v["weights_f32"].reshape(-1, 32), "IQ4_NL")
    assert (ref != chunk).any(axis=1).sum() > 100  # no trial scales: most blocks differ


def test_iq4_xs_zero_super_block_stores_minus_zero(v):
    raw = quants.quantize(np.zeros((1, 256), F32), "IQ4_XS")
    assert raw[0, :2].tolist() == [0x00, 0x80]
    # every block scale l + 32 = 32 = 0b10_0000: top bits 2 in scales_h, low nibbles 0
    assert raw[0, 2:8].tolist() == [0xAA, 0xAA, 0, 0, 0, 0]
    assert (raw[0, 8:] == 0x88).all()  # level 8 (= 1) under a zero scale


def test_imatrix_is_ignored_where_ggml_ignores_it(v):
    w = v["weights_f32"]
    for qtype in ("TQ1_0", "TQ2_0", "MXFP4", "NVFP4", "Q1_0", "Q2_0", "Q8_0"):
        assert quants.get(qtype).imatrix_use == "ignored"
        np.testing.assert_array_equal(
            quants.quantize(w, qtype, imatrix=v["imatrix_f32"][0]), quants.quantize(w, qtype)
        )


def test_imatrix_is_checked():
    x = np.ones((2, 256), F32)
    with pytest.raises(ImatrixError, match="IQ4_XS rows need \\(256,\\)"):
        quants.quantize(x, "IQ4_XS", imatrix=np.ones(255, F32))
    with pytest.raises(ImatrixError, match="NaN or infinite"):
        quants.quantize(x, "IQ4_XS", imatrix=np.full(256, np.nan, F32))
    with pytest.raises(ImatrixError, match="negative"):
        quants.quantize(x, "IQ4_XS", imatrix=np.full(256, -1, F32))
    with pytest.raises(ImatrixError, match="cannot quantize Q8_K with an importance matrix"):
        quants.quantize(x, "Q8_K", imatrix=np.ones(256, F32))


def test_types_that_require_an_imatrix_refuse_to_go_without(monkeypatch):
    # IQ2_XXS, IQ2_XS and IQ1_S are such types (their classes come with the grid types)
    monkeypatch.setattr(quants.get("IQ4_XS"), "imatrix_use", "required")
    with pytest.raises(ImatrixError, match="IQ4_XS needs an importance matrix"):
        quants.quantize(np.ones((1, 256), F32), "IQ4_XS")


@settings(max_examples=30, deadline=None)
@given(qtype=st.sampled_from(NEW + OLD), seed=st.integers(0, 2**32 - 1), rows=st.integers(1, 5))
def test_quantize_is_row_independent(qtype, seed, rows):
    """Row r's bytes depend on row r (and the imatrix) only: quantizing row by row or in one
    go, with or without an importance matrix, gives the same bytes."""
    rng = np.random.default_rng(seed)
    x = rng.standard_t(4, size=(rows, 512)).astype(F32)
    qw = np.exp(rng.normal(size=512)).astype(F32)
    for imatrix in (None, qw):
        whole = quants.quantize(x, qtype, imatrix=imatrix)
        each = np.concatenate([quants.quantize(r[None], qtype, imatrix=imatrix) for r in x])
        np.testing.assert_array_equal(whole, each)


# The largest error of one element after a round trip, in units of its block's largest |x|
# (amax): half the widest gap between neighbouring levels, scaled as each format scales,
# plus the fp16 rounding of the scale (2**-11 relative). Derivations:
#   IQ4_NL/IQ4_XS: levels -127..113 (gap 24 at most, 113..127 beyond the top level 14) in
#     units of amax/127, the best scale being within the trial grid: <= 24/2/113 of amax;
#     IQ4_XS's 6-bit block scale adds up to 1/64 relative. A loose common bound: 0.2.
#   MXFP4/NVFP4: E2M1 steps are 1/2, 1, 2 at 2..4, 4..6 (doubled: 4..12): half of 2 in 12,
#     and a scale up to 2x too large (e8m0 floor, log2f rounding): 0.25.
#     NVFP4 only while amax / 6 is a normal UE4M3 number (2**-6 .. 448): it has no tensor
#     scale, so larger blocks clip and smaller ones get a coarse subnormal scale.
#   TQ1_0/TQ2_0/Q2_0: trits of amax, 0.5. Q1_0: signs times the mean |x|: up to 1 + 1.
ROUNDTRIP = {"IQ4_NL": 0.2, "IQ4_XS": 0.2, "MXFP4": 0.25, "NVFP4": 0.25}
ROUNDTRIP.update({"TQ1_0": 0.5, "TQ2_0": 0.5, "Q2_0": 0.5, "Q1_0": 2.0})
SCALES = {"NVFP4": (0.1, 100.0)}  # normal(0, scale): every 16-block's amax/6 in range


@settings(max_examples=30, deadline=None)
@given(
    case=st.sampled_from(NEW).flatmap(
        lambda t: st.tuples(st.just(t), st.floats(*SCALES.get(t, (1e-3, 1e3))))
    ),
    seed=st.integers(0, 2**32 - 1),
)
def test_roundtrip_error_is_bounded(case, seed):
    qtype, scale = case
    cls = quants.get(qtype)
    x = (np.random.default_rng(seed).normal(size=(4, 512)) * scale).astype(F32)
    y = quants.dequantize(quants.quantize(x, qtype), qtype, x.shape)
    blocks = np.abs(x).reshape(-1, cls.block_size).max(axis=1, keepdims=True)
    err = np.abs(y - x).reshape(-1, cls.block_size)
    assert (err <= ROUNDTRIP[qtype] * blocks * (1 + 2**-10)).all()


# --- dequantize ---------------------------------------------------------------------------------


@pytest.mark.parametrize("qtype", NEW)
@pytest.mark.parametrize("source", ["bytes", "random_bytes"])
def test_dequantize_is_ggml_to_float(qtype, source, v):
    raw = v[f"w/{qtype}/{source}"]
    with np.errstate(all="ignore"):  # random scales: inf * 0 and NaN, as in ggml
        got = quants.dequantize(raw, qtype, (raw.shape[0], 512))
    want = v[f"w/{qtype}/{'dequant' if source == 'bytes' else 'random_dequant'}"]
    np.testing.assert_array_equal(bits(got), bits(want))


@pytest.mark.parametrize("qtype", NEW)
def test_dequantize_is_identical_in_every_namespace(qtype, xp, v):
    raw = v[f"w/{qtype}/bytes"]
    # not the row whose fp16 scales overflow: namespaces need not agree on NaN payloads
    raw = raw[np.isfinite(v[f"w/{qtype}/dequant"]).all(axis=1)]
    want = quants.dequantize(raw, qtype, (raw.shape[0], 512))
    got = quants.dequantize(raw, qtype, (raw.shape[0], 512), xp=xp)
    assert got.dtype == xp.float32
    np.testing.assert_array_equal(bits(to_numpy(got)), bits(want))


# --- the CPU arithmetic -------------------------------------------------------------------------


def weight(v: dict[str, np.ndarray], qtype: str) -> QuantTensor:
    raw = v[f"w/{qtype}/bytes"]
    return QuantTensor(
        "w", GGMLType[qtype], (raw.shape[0], 512), np.ascontiguousarray(raw).reshape(-1)
    )


@pytest.mark.parametrize("qtype", NEW)
def test_vec_dot_type_is_ggmls(qtype, v):
    assert quants.get(qtype).vec_dot_type == str(v[f"w/{qtype}/vec_dot_type"])


@pytest.mark.parametrize("kernels", ["numpy", "numba"])
@pytest.mark.parametrize("qtype", NEW)
def test_cpu_matmul_is_ggmls_generic_c_bit_for_bit(qtype, kernels, v):
    """ggml's CPU quantizes the activations with its AVX2 ``from_float`` (``"simd"`` here:
    the vectors' activation bytes), then its ``vec_dot``; the generic C, compiled as
    written, is what the oracle and the compiled kernels reproduce."""
    if kernels == "numba":
        pytest.importorskip("numba")
    backend = NumpyBackend(kernels=kernels, activation_rounding="simd")
    with np.errstate(all="ignore"):  # the fp16-overflow row makes inf and NaN, as in ggml
        got = backend.matmul(v["acts_f32"], backend.prepare(weight(v, qtype)))
    np.testing.assert_array_equal(bits(got), bits(v[f"w/{qtype}/vec_dot_generic"].T))


@pytest.mark.parametrize("qtype", NEW)
def test_cpu_matmul_is_ggmls_simd_kernel_up_to_the_order_of_sums(qtype, v):
    backend = NumpyBackend(kernels="numpy", activation_rounding="simd")
    acts, w = v["acts_f32"], weight(v, qtype)
    with np.errstate(all="ignore"):  # the fp16-overflow row: compared with NaNs above
        dense = quants.dequantize(w.data, qtype, w.shape)
        got = backend.matmul(acts, backend.prepare(w))
    finite = np.isfinite(dense).all(axis=1)
    got = got[:, finite]
    want = v[f"w/{qtype}/vec_dot_cpu"].T[:, finite]
    # the same exact block sums, added in another order (and with FMAs): a reordering of a
    # dot product of the dequantized operands (tests/bounds.py)
    act_type = quants.get(qtype).vec_dot_type
    a = quants.dequantize(quants.quantize(acts, act_type, rounding="simd"), act_type, acts.shape)
    b = dense[finite]
    assert (np.abs(got.astype(np.float64) - want) <= reorder_bound(a, b)).all()


# --- pieces with traps of their own -------------------------------------------------------------


def _libm_log2f():
    fn = ctypes.CDLL(ctypes.util.find_library("m")).log2f
    fn.restype, fn.argtypes = ctypes.c_float, [ctypes.c_float]
    return fn


@settings(max_examples=200, deadline=None)
@given(exponent=st.integers(-149, 127), steps=st.integers(-3, 3))
def test_floor_log2f_is_the_c_librarys(exponent, steps):
    """Just below a power of two log2f rounds up to the next integer: MXFP4's scale byte is
    then one larger than the exponent of amax."""
    a = F32(2.0**exponent)
    for _ in range(abs(steps)):
        a = np.nextafter(a, F32(np.inf) if steps > 0 else F32(0))
    if not 0 < a < np.inf:
        return
    want = np.floor(F32(_libm_log2f()(float(a))))
    assert fp4.floor_log2f(np.array([a], F32))[0] == want


def test_log2f_rounding_moves_the_mxfp4_scale():
    below = np.nextafter(F32(2.0**64), F32(0))  # log2f gives exactly 64
    assert fp4.e8m0_exponent(np.array([below]))[0] == 64 - 2 + 127


def test_ue4m3_codes_and_values():
    x = np.array(
        [0, -1, np.nan, 2.0**-10, 2.0**-9, 7 * 2.0**-9, 1.0, 1.0625, 247.9, 248, 300, 1e30], F32
    )
    codes = fp4.ue4m3_code(x).tolist()
    assert codes[:3] == [0, 0, 0]
    assert codes[3] == 1 and codes[4] == 1 and codes[5] == 7  # subnormals: round half up
    assert codes[6] == 7 << 3 and codes[7] == (7 << 3) | 1  # 1.0625 rounds up to 1.125
    assert codes[8] == 0x77 and codes[9:] == [0x7E, 0x7E, 0x7E]
    assert fp4.UE4M3_HALF[0x7E] == 224 and fp4.UE4M3_HALF[0x7F] == 0


def test_iq4_best_index_sends_midpoint_ties_up():
    levels = iq4_search.KVALUES.astype(F32)
    mids = (levels[:-1] + levels[1:]) / 2
    np.testing.assert_array_equal(iq4_search.best_index(mids), np.arange(1, 16))
    np.testing.assert_array_equal(iq4_search.best_index(levels), np.arange(16))
    assert iq4_search.best_index(np.array([np.nan, -np.inf, np.inf], F32)).tolist() == [15, 0, 15]
