"""The IQ grid types (IQ3_XXS, IQ3_S, IQ2_XXS, IQ2_XS, IQ2_S, IQ1_S, IQ1_M) against what
ggml itself writes, reads and multiplies (tests/data/ggml_vectors_iq_grid.npz, made by
tools/ggml_iq_grid_vectors.py), and the properties their quantizers have by construction."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from bounds import reorder_bound
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from qllama import quants
from qllama.array_api import to_numpy
from qllama.backends.base import QuantTensor
from qllama.backends.numpy import dispatch
from qllama.backends.numpy.dispatch import KERNEL_IQ, NumpyBackend
from qllama.errors import ImatrixError, WeightValueError
from qllama.ggml_types import GGMLType
from qllama.quants import iq1_search, iq_grids, iq_search

F32 = np.float32
N = 1024  # the vectors' row length
TYPES = ["IQ2_XXS", "IQ2_XS", "IQ2_S", "IQ3_XXS", "IQ3_S", "IQ1_S", "IQ1_M"]
OPTIONAL = [t for t in TYPES if quants.get(t).imatrix_use == "optional"]
REQUIRED = [t for t in TYPES if quants.get(t).imatrix_use == "required"]
PLAIN_SIGNS = ["IQ2_S", "IQ3_S"]  # a sign bit per value, and scales that cannot go negative
# ggml's tests/test-quantize-fns.cpp budgets (its metric: sqrt(sum of squares) / n), the
# three grid types it has one for
BUDGETS = {"IQ2_S": 0.0075, "IQ3_S": 0.0040, "IQ3_XXS": 0.0050}


@pytest.fixture(scope="module")
def vectors() -> dict[str, np.ndarray]:
    with np.load(Path(__file__).parent / "data" / "ggml_vectors_iq_grid.npz") as z:
        return {k: z[k] for k in z.files}


def bits(x: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(x, dtype=F32).view(np.uint32)


def tensor(raw: np.ndarray, qtype: str) -> QuantTensor:
    data = np.ascontiguousarray(raw).reshape(-1)
    data.flags.writeable = False  # as the file's views are
    return QuantTensor("w", GGMLType[qtype], (raw.shape[0], N), data)


def imatrix_for(qtype: str, n: int) -> np.ndarray | None:
    """An all-ones importance matrix where the type needs one, else none."""
    return np.ones(n, F32) if qtype in REQUIRED else None


# --- what ggml says about each type --------------------------------------------------------------


@pytest.mark.parametrize("qtype", TYPES)
def test_vec_dot_type_and_imatrix_need_are_ggmls(qtype, vectors):
    cls = quants.get(qtype)
    assert cls.vec_dot_type == str(vectors[f"w/{qtype}/vec_dot_type"])
    assert (cls.imatrix_use == "required") == bool(vectors[f"w/{qtype}/requires_imatrix"])


# --- dequantize ----------------------------------------------------------------------------------


@pytest.mark.parametrize("qtype", TYPES)
@pytest.mark.parametrize("source", ["grid", "random"])
def test_dequantize_is_bit_exact_with_ggml(qtype, source, vectors):
    """``grid``: blocks holding every point of the type's grid (so the derived tables are
    ggml's, point for point); ``random``: random bytes, every field and bit pattern."""
    raw = vectors[f"{source}/{qtype}/bytes"]
    got = quants.dequantize(raw, qtype, (raw.shape[0], N))
    np.testing.assert_array_equal(bits(got), bits(vectors[f"{source}/{qtype}/dequant"]))


@pytest.mark.parametrize("qtype", TYPES)
def test_dequantize_is_identical_in_every_namespace(qtype, xp, vectors):
    raw = np.concatenate([vectors[f"random/{qtype}/bytes"], vectors[f"w/{qtype}/rand/bytes"]])
    want = quants.dequantize(raw, qtype, (raw.shape[0], N))
    got = quants.dequantize(raw, qtype, (raw.shape[0], N), xp=xp)
    assert got.dtype == xp.float32
    np.testing.assert_array_equal(bits(to_numpy(got)), bits(want))


def test_grid_tables_are_derived_consistently():
    """kmap inverts the point list; each neighbour list is sorted by distance, then index,
    holds only off-grid lookups' candidates, and ends at the nwant-th distinct distance."""
    for grid in (iq_grids.IQ2XXS, iq_grids.IQ2XS, iq_grids.IQ2S, iq_grids.IQ1S):
        u = grid.pack(grid.points)
        np.testing.assert_array_equal(grid.kmap[u], np.arange(len(grid.points)))
        assert np.count_nonzero(grid.kmap >= 0) == len(grid.points)
    for grid in (iq_grids.IQ3XXS, iq_grids.IQ3S, iq_grids.IQ2XS, iq_grids.IQ1S):
        rng = np.random.default_rng(len(grid.points))
        for _ in range(20):
            levels = rng.integers(0, grid.levels, grid.dims)
            u = int(grid.pack(levels))
            if grid.kmap[u] >= 0:
                continue
            listed = grid.neighbour_list(u)
            d2 = np.sum((grid.points.astype(int) - levels) ** 2, axis=1)
            assert np.all(np.diff(d2[listed]) >= 0)
            ties = np.diff(d2[listed]) == 0
            assert np.all(np.diff(listed)[ties] > 0)
            assert len(np.unique(d2[listed])) == grid.nwant
            assert np.all(d2[np.setdiff1d(np.arange(len(d2)), listed)] > d2[listed].max())


def test_sign_bytes_are_ggmls_expansion():
    """ksigns_iq2xs[i]: i with bit 7 the parity of its 7 bits (its first and last rows)."""
    head = [0, 129, 130, 3, 132, 5, 6, 135, 136, 9, 10, 139, 12, 141, 142, 15]
    tail = [240, 113, 114, 243, 116, 245, 246, 119, 120, 249, 250, 123, 252, 125, 126, 255]
    got = iq_grids.parity_signs(np.arange(128))
    assert got[:16].tolist() == head and got[-16:].tolist() == tail


# --- quantize -----------------------------------------------------------------------------------


@pytest.fixture(params=["numpy", "numba"])
def search(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """The neighbour search in numpy (the oracle) and compiled, where numba is installed."""
    if request.param == "numba" and not dispatch.kernels_available():
        pytest.skip("numba is not installed")
    monkeypatch.setattr(iq_grids, "USE_COMPILED", request.param == "numba")
    return request.param


@pytest.mark.parametrize("qtype", TYPES)
@pytest.mark.parametrize("imatrix", ["rand", "ones", "none"])
def test_quantize_is_bit_exact_with_ggml(qtype, imatrix, vectors, search):
    """``ggml_quantize_chunk`` on 16 rows of edge cases, with a random importance matrix
    (zeros in it, a zero 32- and 16-block of it), all ones, and none where ggml allows."""
    key = f"w/{qtype}/{imatrix}/bytes"
    if key not in vectors:
        assert qtype in REQUIRED and imatrix == "none"
        with pytest.raises(ImatrixError, match=f"{qtype} needs an importance matrix"):
            quants.quantize(vectors["weights_f32"], qtype)
        return
    qw = None if imatrix == "none" else vectors[f"imatrix/{imatrix}"]
    got = quants.quantize(vectors["weights_f32"], qtype, imatrix=qw)
    want = vectors[key]
    bad = np.flatnonzero((got != want).any(axis=1))
    assert got.shape == want.shape and bad.size == 0, f"{qtype}: rows {bad.tolist()} differ"


@pytest.mark.parametrize("qtype", TYPES)
def test_quantize_is_bit_exact_on_many_rows(qtype, vectors, search):
    """24 rows of normal values at random scales, a log-normal importance matrix: most of
    every neighbour table gets used."""
    x = vectors["stress_f16"].astype(F32)
    np.testing.assert_array_equal(
        quants.quantize(x, qtype, imatrix=vectors["imatrix/stress"]),
        vectors[f"w/{qtype}/stress/bytes"],
    )
    if qtype in OPTIONAL:
        np.testing.assert_array_equal(quants.quantize(x, qtype), vectors[f"w/{qtype}/stress/none"])


def test_iq3_s_packs_past_an_all_zero_block_as_ggml(vectors):
    """ggml's IQ3_S quantizer does not advance its qs/signs pointers past an all-zero
    32-block: row 11's first super-block has one (values 32..63), so its last qs and signs
    slots stay zero and the others move up one."""
    x = vectors["weights_f32"][11:12]
    raw = quants.quantize(x, "IQ3_S").reshape(4, 110)
    assert not raw[0, 2 + 56 : 2 + 64].any() and not raw[0, 74 + 28 : 74 + 32].any()
    np.testing.assert_array_equal(raw.reshape(1, -1), vectors["w/IQ3_S/none/bytes"][11:12])


@pytest.mark.parametrize("qtype", TYPES)
def test_internal_chunks_do_not_change_bytes(qtype, vectors, monkeypatch):
    """Tiny chunks everywhere (the quantize loop, the grid search, the IQ1 split) against the
    defaults: every super-block is quantized on its own, with its slice of the imatrix."""
    x = vectors["weights_f32"]
    qw = vectors["imatrix/rand"]
    want = vectors[f"w/{qtype}/rand/bytes"]
    monkeypatch.setattr(quants, "_CHUNK_ELEMENTS", 3 * 256)
    monkeypatch.setattr(iq_search, "_CHUNK_SUBBLOCKS", 5)
    monkeypatch.setattr(iq1_search, "_CHUNK", 7)
    np.testing.assert_array_equal(quants.quantize(x, qtype, imatrix=qw), want)


def test_imatrix_errors():
    x = np.ones((2, 512), F32)
    with pytest.raises(ImatrixError, match=r"has shape \(256,\); IQ3_S rows need \(512,\)"):
        quants.quantize(x, "IQ3_S", imatrix=np.ones(256, F32))
    with pytest.raises(ImatrixError, match="NaN or infinite"):
        quants.quantize(x, "IQ2_XS", imatrix=np.full(512, np.nan, F32))
    with pytest.raises(ImatrixError, match="negative"):
        quants.quantize(x, "IQ1_M", imatrix=-np.ones(512, F32))
    with pytest.raises(ImatrixError, match="cannot quantize Q8_K with an importance matrix"):
        quants.quantize(x, "Q8_K", imatrix=np.ones(512, F32))
    with pytest.raises(WeightValueError, match="IQ1_S cannot quantize NaN"):
        quants.quantize(np.where(np.arange(512) == 7, np.nan, x), "IQ1_S", imatrix=x[0])
    with pytest.raises(WeightValueError, match="too large"):
        quants.quantize(np.full((1, 256), 3e38, F32), "IQ3_XXS")
    # errors of 1e30 and more: every neighbour's overflows, where ggml asserts and aborts
    huge = (np.random.default_rng(0).standard_normal((2, 512)) * 1e15).astype(F32)
    with pytest.raises(WeightValueError, match="every neighbour's error overflows"):
        quants.quantize(huge, "IQ2_XS", imatrix=np.ones(512, F32))


@settings(max_examples=12, deadline=None)
@given(
    qtype=st.sampled_from(TYPES),
    blocks=hnp.arrays(F32, (3, 256), elements=st.floats(-4, 4, width=32)),
    qw=hnp.arrays(F32, 256, elements=st.floats(0, 8, width=32)),
    order=st.permutations([0, 1, 2]),
)
def test_super_blocks_quantize_independently(qtype, blocks, qw, order):
    """ggml quantizes each super-block on its own (its sigma2, its scales): any order of
    them, in one row or in rows of their own, gives the same blocks."""
    qws = np.tile(qw, 3)
    whole = quants.quantize(blocks.reshape(1, -1), qtype, imatrix=qws).reshape(3, -1)
    alone = quants.quantize(blocks, qtype, imatrix=qw)
    np.testing.assert_array_equal(whole, alone)
    shuffled = quants.quantize(blocks[order].reshape(1, -1), qtype, imatrix=qws)
    np.testing.assert_array_equal(shuffled.reshape(3, -1), alone[order])


@settings(max_examples=12, deadline=None)
@given(
    qtype=st.sampled_from(PLAIN_SIGNS),
    mags=hnp.arrays(F32, 512, elements=st.floats(0.0009765625, 10, width=32)),
    negative=hnp.arrays(bool, 512),
    with_imatrix=st.booleans(),
)
def test_plain_sign_types_keep_every_sign(qtype, mags, negative, with_imatrix):
    """IQ2_S and IQ3_S store a sign bit per value and fit |x| with positive scales (every
    term of their fits is >= 0), so each value dequantizes with its own sign (or to 0
    where d underflows); the magnitudes here keep every sub-block live."""
    x = np.where(negative, -mags, mags)
    qw = np.abs(np.cos(np.arange(512, dtype=F32))) + F32(0.1) if with_imatrix else None
    y = quants.dequantize(quants.quantize(x, qtype, imatrix=qw), qtype, x.shape)
    assert np.all(y * x >= 0)


@settings(max_examples=20, deadline=None)
@given(offset=st.floats(0, 100), qtype=st.sampled_from(sorted(BUDGETS)))
def test_roundtrip_error_within_ggml_budget(offset, qtype):
    """ggml's own vector 0.1 + 2 cos(i + offset), n = 4096, its error metric and budgets."""
    x = (0.1 + 2 * np.cos(np.arange(4096, dtype=np.float64) + offset)).astype(F32)
    y = quants.dequantize(quants.quantize(x, qtype), qtype, x.shape)
    err = float(np.sqrt(np.sum((y.astype(np.float64) - x) ** 2)) / x.size)
    assert err < BUDGETS[qtype], f"{qtype}: ggml error {err}"


@pytest.mark.parametrize("qtype", TYPES)
def test_quantize_is_deterministic_and_zero_rows_are_zero(qtype):
    rng = np.random.default_rng(1)
    x = rng.standard_normal((3, 512)).astype(F32)
    qw = imatrix_for(qtype, 512)
    first = quants.quantize(x, qtype, imatrix=qw)
    np.testing.assert_array_equal(first, quants.quantize(x.copy(), qtype, imatrix=qw))
    zero = quants.quantize(np.zeros((2, 512), F32), qtype, imatrix=qw)
    assert not zero.any()  # every type writes an all-zero super-block as zero bytes


# --- the CPU arithmetic -------------------------------------------------------------------------


def kernel_modes(qtype: str) -> list[str]:
    """The plain numpy path, and the compiled kernels where the type has one."""
    modes = ["numpy"]
    if GGMLType[qtype] in KERNEL_IQ and dispatch.kernels_available():
        modes.append("numba")
    return modes


@pytest.mark.parametrize(("qtype", "kernels"), [(t, k) for t in TYPES for k in kernel_modes(t)])
@pytest.mark.parametrize("source", ["w/{}/rand", "random/{}"])
def test_cpu_matmul_is_ggmls_generic_c_bit_for_bit(qtype, kernels, source, vectors):
    """ggml's generic C dot products (compiled as written, no FMA) of the quantizer's bytes
    and of random bytes with the CPU-quantized (Q8_K) activations."""
    prefix = source.format(qtype)
    backend = NumpyBackend(kernels=kernels)
    w = backend.prepare(tensor(vectors[f"{prefix}/bytes"], qtype))
    got = backend.matmul(vectors["acts_f32"], w)
    generic = (
        f"w/{qtype}/vec_dot_generic" if prefix.startswith("w/") else f"{prefix}/vec_dot_generic"
    )
    np.testing.assert_array_equal(bits(got), bits(vectors[generic].T))


@pytest.mark.parametrize("qtype", TYPES)
def test_cpu_matmul_matches_ggmls_simd_kernels(qtype, vectors):
    """ggml's own SIMD vec_dot adds the same exact block terms in another order (and with
    FMAs): both are float32 evaluations of one dot product of the Q8_K activations with the
    dequantized weights, so they differ by at most reorder_bound of those."""
    raw = vectors[f"w/{qtype}/rand/bytes"]
    backend = NumpyBackend(kernels="numpy")
    got = backend.matmul(vectors["acts_f32"], backend.prepare(tensor(raw, qtype)))
    want = vectors[f"w/{qtype}/vec_dot_cpu"].T
    acts = quants.dequantize(vectors["act/Q8_K/cpu"], "Q8_K", (14, N))
    dense = quants.dequantize(raw, qtype, (raw.shape[0], N))
    assert np.all(np.abs(got.astype(np.float64) - want) <= reorder_bound(acts, dense))


def test_activations_are_ggmls_q8_k(vectors):
    np.testing.assert_array_equal(
        quants.quantize(vectors["acts_f32"], "Q8_K"), vectors["act/Q8_K/cpu"]
    )


@pytest.mark.skipif(not dispatch.kernels_available(), reason="numba is not installed")
@pytest.mark.parametrize("qtype", [t for t in TYPES if GGMLType[t] in KERNEL_IQ])
@pytest.mark.parametrize("tokens", [1, 5, 33])
@pytest.mark.parametrize("threads", [1, 2])
def test_kernels_equal_the_oracle(qtype, tokens, threads, vectors, monkeypatch):
    """Random bytes (every index, sign and scale) against hard activations: zeros, ties,
    huge, infinite and NaN values; serial and parallel kernels, few and many tokens."""
    monkeypatch.setattr(dispatch, "SERIAL_MACS", 0 if threads == 2 else 2**62)
    raw = vectors[f"random/{qtype}/bytes"][:5]
    rng = np.random.default_rng(tokens)
    x = (rng.standard_normal((tokens, N)) * 3).astype(F32)
    x[0, :256] = 0
    if tokens > 1:
        x[1, :32] = np.arange(32, dtype=F32) - 15.5
        x[1, 300], x[1, 600] = np.inf, np.nan
    if tokens > 2:
        x[2, 256:512] *= F32(1e37)
    fast = NumpyBackend(kernels="numba", threads=threads)
    oracle = NumpyBackend(kernels="numpy")
    with np.errstate(all="ignore"):
        got = fast.matmul(x, fast.prepare(tensor(raw, qtype)))
        want = oracle.matmul(x, oracle.prepare(tensor(raw, qtype)))
    nan = np.isnan(want)  # NaNs compared by position: their payload is the hardware's
    np.testing.assert_array_equal(np.isnan(got), nan)
    np.testing.assert_array_equal(bits(np.where(nan, 0, got)), bits(np.where(nan, 0, want)))
