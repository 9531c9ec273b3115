"""The compiled CPU kernels (numba) against the numpy oracle: the same float32 bits.

ggml's generic C results are checked for both paths in test_backend_numpy.py. Here: every
integer weight type, both activation roundings, one token and many (the two loops of
the kernels), odd shapes, the parallel and the serial kernels, and activations with ties,
zeros, subnormals, overflow, infinities and NaNs. Skipped where numba is not installed.
"""

from __future__ import annotations

import os

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

pytest.importorskip("numba")

from qllama import quants
from qllama.backends.base import QuantTensor, matmuls
from qllama.backends.numpy import dispatch
from qllama.backends.numpy.dispatch import NumpyBackend
from qllama.backends.numpy.kernels import gemv
from qllama.errors import BackendError, TensorShapeError
from qllama.ggml_types import GGMLType

pytestmark = [
    # the oracle's float32 arithmetic overflows on the hard activations, as C does, and warns
    pytest.mark.filterwarnings("ignore::RuntimeWarning"),
    # one test process compiles a type's kernels for this file and test_backend_numpy.py
    # (split by type in conftest.py)
    pytest.mark.xdist_group("kernels"),
]

F32 = np.float32
LEGACY = ["Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0"]
KQUANTS = ["Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K"]
TABLES = ["IQ4_NL", "IQ4_XS", "MXFP4"]  # 4-bit codes indexing a table of levels
# one integer sum a 256-block: the IQ grids and the ternary formats (kernels/superblocks.py)
GRIDS = ["IQ2_XXS", "IQ2_XS", "IQ2_S", "IQ3_XXS", "IQ3_S", "IQ1_S", "IQ1_M", "TQ1_0", "TQ2_0"]
SUPER = [*KQUANTS, "IQ4_XS", *GRIDS]  # 256-element blocks
SMALL = ["NVFP4", "Q1_0", "Q2_0"]  # 16-blocks, or one d over runs of 32-blocks (128 values)


def row_length(qtype: str, blocks: int) -> int:
    """``blocks`` of the type's largest block: 256 (super-blocks), 128 (SMALL), 32."""
    return blocks * (256 if qtype in SUPER else 128 if qtype in SMALL else 32)


def bits(x: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(x, dtype=F32).view(np.uint32)


def weight(raw: np.ndarray, qtype: str, shape: tuple[int, int]) -> QuantTensor:
    data = np.ascontiguousarray(raw).reshape(-1)
    data.flags.writeable = False  # as the file's views are (one compiled specialization)
    return QuantTensor("w", GGMLType[qtype], shape, data)


def random_weight(qtype: str, rows: int, k: int, seed: int) -> QuantTensor:
    rng = np.random.default_rng(seed)
    w = rng.standard_normal((rows, k)).astype(F32) * rng.uniform(0.01, 2, (rows, 1)).astype(F32)
    # the grid types with an importance matrix (IQ2_XXS, IQ2_XS, IQ1_S cannot do without)
    imatrix = rng.uniform(0.1, 2, k).astype(F32) if qtype in GRIDS else None
    return weight(quants.quantize(w, qtype, imatrix=imatrix), qtype, (rows, k))


def hard_activations(tokens: int, k: int, seed: int) -> np.ndarray:
    """Rows that exercise every branch of the quantizers: ties, zeros, tiny and huge."""
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((tokens, k)).astype(F32) * 3
    x[0, :32] = 0  # an all-zero block
    if tokens > 1:
        x[1, :32] = np.arange(32, dtype=F32) - 15.5  # .5 steps: ties once scaled
        x[1, 32:64] = -0.0
    if tokens > 2:
        x[2, :32] = rng.standard_normal(32).astype(F32) * F32(1e-42)  # subnormal scales
    if tokens > 2 and k >= 64:
        with np.errstate(over="ignore"):  # x * (1/d) overflows
            x[2, 32:64] = rng.standard_normal(32).astype(F32) * F32(3e38)
    return x


def agree(got: np.ndarray, want: np.ndarray) -> None:
    """Bit for bit; NaNs only by position (their payload is the hardware's)."""
    nan = np.isnan(want)
    np.testing.assert_array_equal(np.isnan(got), nan)
    np.testing.assert_array_equal(bits(np.where(nan, 0, got)), bits(np.where(nan, 0, want)))


@pytest.fixture(params=["serial", "parallel"])
def parallelism(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """The serial and the parallel (2 threads) kernels, whatever the size of the matmul."""
    monkeypatch.setattr(dispatch, "SERIAL_MACS", 0 if request.param == "parallel" else 2**62)
    return request.param


def backends(rounding: str, parallelism: str) -> tuple[NumpyBackend, NumpyBackend]:
    threads = 2 if parallelism == "parallel" else 1
    fast = NumpyBackend(activation_rounding=rounding, kernels="numba", threads=threads)
    return fast, NumpyBackend(activation_rounding=rounding, kernels="numpy")


@pytest.mark.parametrize("qtype", LEGACY + KQUANTS + TABLES + GRIDS + SMALL)
@pytest.mark.parametrize("rounding", ["ref", "simd"])
@pytest.mark.parametrize("tokens", [1, 3, 16, 37])
def test_kernels_equal_the_oracle(qtype, rounding, tokens, parallelism):
    # 19 blocks of 32: every tail of the 16-block sums (SMALL: 5 blocks of 128)
    k = 768 if qtype in SUPER else 640 if qtype in SMALL else 608
    w = random_weight(qtype, 13, k, seed=tokens)
    x = hard_activations(tokens, k, seed=tokens)
    fast, oracle = backends(rounding, parallelism)
    agree(fast.matmul(x, fast.prepare(w)), oracle.matmul(x, oracle.prepare(w)))


@pytest.mark.parametrize("qtype", LEGACY + KQUANTS + TABLES + GRIDS + SMALL)
@pytest.mark.parametrize("shape", [(1, 1), (5, 2), (33, 3)])  # rows, blocks
def test_odd_shapes(qtype, shape, parallelism):
    rows, blocks = shape
    k = row_length(qtype, blocks)
    w = random_weight(qtype, rows, k, seed=rows)
    fast, oracle = backends("ref", parallelism)
    for tokens in (1, 17):
        x = hard_activations(tokens, k, seed=blocks)
        agree(fast.matmul(x, fast.prepare(w)), oracle.matmul(x, oracle.prepare(w)))


@pytest.mark.parametrize("qtype", LEGACY + KQUANTS + ["IQ2_XXS", "IQ1_M", "TQ1_0"])
@pytest.mark.parametrize("k", [768, 8192])
def test_many_tiles_and_passes(qtype, k, parallelism):
    """18 tiles of 16 tokens, the last of 5: more than one call of the K-quant tile kernel
    (16 tiles a call) and, at k = 8192, more than one pass over the rows (4 tiles a pass);
    5 rows, so the last pair has one row."""
    w = random_weight(qtype, 5, k, seed=k)
    x = hard_activations(16 * 17 + 5, k, seed=k)
    fast, oracle = backends("ref", parallelism)
    agree(fast.matmul(x, fast.prepare(w)), oracle.matmul(x, oracle.prepare(w)))


@pytest.mark.parametrize("qtype", LEGACY + KQUANTS + TABLES + GRIDS + SMALL)
def test_non_finite_activations(qtype, parallelism):
    k = 512
    w = random_weight(qtype, 9, k, seed=3)
    x = hard_activations(18, k, seed=4)
    x[3, 5] = np.inf
    x[4, 64:96] = -np.inf
    x[5, 31] = np.nan  # the last of a block: the running max ends on a NaN
    x[6, 0] = np.nan  # the first: a later element replaces it
    x[17, 300] = np.nan
    fast, oracle = backends("ref", parallelism)
    for rounding in ("ref", "simd"):
        fast.activation_rounding = oracle.activation_rounding = rounding
        for rows in (slice(0, 1), slice(0, 18)):
            agree(fast.matmul(x[rows], fast.prepare(w)), oracle.matmul(x[rows], oracle.prepare(w)))


# the IQ grid formats of the streaming kernels (kernels/grid.py)
STREAMING_GRIDS = ["IQ2_XXS", "IQ3_XXS", "IQ2_XS", "IQ2_S", "IQ3_S", "IQ1_S", "IQ1_M"]


@pytest.mark.parametrize("qtype", STREAMING_GRIDS)
@pytest.mark.parametrize("rows", [1, 7])
def test_grid_decode_shapes(qtype, rows, parallelism):
    """Every decode shape of the grid kernels, 1 to 8 tokens (the rows streamed once for
    them all), odd row counts, 3 super-blocks a row: the oracle's bits."""
    k = 768
    w = random_weight(qtype, rows, k, seed=rows)
    fast, oracle = backends("ref", parallelism)
    for tokens in range(1, 9):
        x = hard_activations(tokens, k, seed=tokens)
        agree(fast.matmul(x, fast.prepare(w)), oracle.matmul(x, oracle.prepare(w)))


def random_blocks(qtype: str, rows: int, k: int, seed: int) -> QuantTensor:
    """Random bytes in every field but the scale ``d`` (a finite fp16): every grid point,
    sign pattern, high index bit, delta and sub-block scale the format can store, where a
    quantizer's output holds only the ones it chose."""
    size = GGMLType[qtype].block.type_size
    rng = np.random.default_rng(seed)
    raw = rng.integers(0, 256, (rows * k // 256, size), dtype=np.uint8)
    d = np.frombuffer(np.float16(0.0123).tobytes(), np.uint8)
    if qtype == "IQ1_M":  # d is the top nibbles of its four scale words, the first lowest
        bits = int(np.float16(0.0123).view(np.uint16))
        for c in range(4):
            raw[:, 49 + 2 * c] = (raw[:, 49 + 2 * c] & 0x0F) | (((bits >> (4 * c)) & 15) << 4)
    else:
        raw[:, :2] = d
    return weight(raw, qtype, (rows, k))


@pytest.mark.parametrize("qtype", STREAMING_GRIDS)
@pytest.mark.parametrize("tokens", [1, 5])
def test_grid_kernels_on_every_bit_pattern(qtype, tokens, parallelism):
    k = 512
    w = random_blocks(qtype, 11, k, seed=tokens)
    x = hard_activations(tokens, k, seed=tokens)
    x[-1, :256] = -np.abs(x[-1, :256])  # codes of -128 against both signs of weights
    fast, oracle = backends("ref", parallelism)
    agree(fast.matmul(x, fast.prepare(w)), oracle.matmul(x, oracle.prepare(w)))


@pytest.mark.parametrize("tokens", [1, 3, 20])
def test_q8_0_codes_of_minus_128(tokens, parallelism):
    """-128 in a Q8_0 weight (llama.cpp's quantizer never writes it; a hand-made file can)
    and in activations (the code of a NaN, and of an infinite block's inf * 0) against
    negative partners: the exact integer products of ggml's generic C, on every host. On
    AVX2 without VNNI the decode loop cannot take a weight code of -128, and that weight
    goes to the oracle; any other weight stays on the kernels."""
    k = 256
    w = random_weight("Q8_0", 6, k, seed=tokens)
    raw = w.data.copy().reshape(6, -1, 34)  # (rows, blocks, bytes)
    raw[0, :, 2:10] = 0x80  # -128 against every sign of activation
    raw[3, 2, 2:34] = 0x80
    bad = weight(raw, "Q8_0", (6, k))
    x = hard_activations(tokens, k, seed=tokens)
    x[0, 64:96] = -np.abs(x[0, 64:96])  # negative activations meet the -128s
    x[0, 100] = np.inf  # an infinite block: its codes are 0, and -128 at the infinity
    x[0, 131] = np.nan  # a NaN in a finite block: -128 there (simd)
    fast, oracle = backends("simd", parallelism)
    for ws in (bad, w):
        agree(fast.matmul(x, fast.prepare(ws)), oracle.matmul(x, oracle.prepare(ws)))
    prepared = fast.prepare(w)
    assert prepared.kernels_exact  # a weight without -128 never leaves the kernels
    assert fast.prepare(bad).kernels_exact == (not gemv.Q8_SIGNED)


def one_file(qtypes: list[str], rows: list[int], k: int) -> list[QuantTensor]:
    """Weights whose bytes lie one after another in one buffer, as a file's tensors do."""
    raws = [random_weight(q, r, k, seed=r).data for q, r in zip(qtypes, rows, strict=True)]
    buf = np.concatenate([np.zeros(64, np.uint8), *raws])
    buf.flags.writeable = False
    ends = 64 + np.cumsum([r.size for r in raws])
    return [
        QuantTensor(f"w{i}", GGMLType[q], (r, k), buf[e - raw.size : e])
        for i, (q, r, raw, e) in enumerate(zip(qtypes, rows, raws, ends, strict=True))
    ]


@pytest.mark.parametrize(
    "qtype", ["Q4_0", "Q5_1", "Q8_0", "Q3_K", "Q4_K", "Q6_K", "IQ4_XS", "IQ2_XXS", "IQ1_M"]
)
@pytest.mark.parametrize("tokens", [1, 5, 20])
def test_matmuls_of_one_input_equal_one_matmul_each(qtype, tokens, parallelism):
    """Q, K and V (rows 24, 8, 8) in one streaming call: each the same bits as its own
    matmul and as the oracle's."""
    k = 512
    ws = one_file([qtype] * 3, [24, 8, 8], k)
    x = hard_activations(tokens, k, seed=tokens)
    fast, oracle = backends("ref", parallelism)
    prepared = [fast.prepare(w) for w in ws]
    assert fast._streams(prepared) is not None  # the fused call, not the fallback
    fused = matmuls(fast, x, prepared)
    for w, p, got in zip(ws, prepared, fused, strict=True):
        agree(got, fast.matmul(x, p))
        agree(got, oracle.matmul(x, oracle.prepare(w)))


# small types whose decoding runs in the streaming kernels (kernels/gemv.py, ternary.py, small.py)
DECODING = ["MXFP4", "TQ1_0", "TQ2_0", "NVFP4", "Q1_0", "Q2_0"]


@pytest.mark.parametrize("qtype", DECODING)
@pytest.mark.parametrize("tokens", range(1, 9))
def test_decoding_shapes_of_the_small_types(qtype, tokens, parallelism):
    """1 to 8 tokens (the decoding kernels) by two weights of odd row counts (7 and 5: a
    group of 4 rows and a remainder) in one buffer: one streaming call and one matmul each,
    the oracle's bits. 1792 values a row: 7 256-blocks, steps of 4, 2 and 1 block."""
    k = 1792
    ws = one_file([qtype] * 2, [7, 5], k)
    x = hard_activations(tokens, k, seed=tokens)
    fast, oracle = backends("ref", parallelism)
    prepared = [fast.prepare(w) for w in ws]
    assert fast._streams(prepared) is not None
    for w, p, got in zip(ws, prepared, matmuls(fast, x, prepared), strict=True):
        want = oracle.matmul(x, oracle.prepare(w))
        agree(got, want)
        agree(fast.matmul(x, p), want)


@pytest.mark.parametrize("qtype", DECODING)
@pytest.mark.parametrize("tokens", [1, 5])
def test_decoding_any_bytes_of_the_small_types(qtype, tokens):
    """Every byte value, not only those a quantizer writes (TQ1_0's trits of any byte, all
    the scale bytes, fp16 scales that are infinite or NaN): the oracle's bits."""
    rows, k = 7, 1792
    size = rows * k // quants.get(qtype).block_size * quants.get(qtype).type_size
    raw = np.random.default_rng(tokens).integers(0, 256, size, dtype=np.uint8)
    w = weight(raw, qtype, (rows, k))
    x = hard_activations(tokens, k, seed=tokens)
    fast, oracle = backends("ref", "serial")
    agree(fast.matmul(x, fast.prepare(w)), oracle.matmul(x, oracle.prepare(w)))


def test_a_files_layer_shares_one_call(tmp_path):
    """The tensors of a loaded file are views of its one map: Q, K, V go in one call."""
    import qllama
    from qllama.synthetic import TinyConfig, write_tiny

    path = tmp_path / "tiny.gguf"
    write_tiny(path, TinyConfig(weight_type="Q8_0"))
    model = qllama.load(path, backend="numpy", kernels="numba")
    layer = model.weights.layers[0]
    qkv, gate_up = [layer.attn_q, layer.attn_k, layer.attn_v], [layer.ffn_gate, layer.ffn_up]
    assert model.backend._streams(qkv) is not None
    assert model.backend._streams(gate_up) is not None


@pytest.mark.parametrize("qtype", ["IQ2_XXS", "IQ1_S"])
def test_a_model_of_a_type_that_needs_an_imatrix(qtype, tmp_path):
    """The synthetic writer gives the types ggml quantizes only with an importance matrix a
    flat one (benchmarks/per_type.py writes them so); the kernels' logits are the oracle's."""
    import qllama
    from qllama.array_api import to_numpy
    from qllama.synthetic import TinyConfig, write_tiny

    path = tmp_path / "tiny.gguf"
    write_tiny(path, TinyConfig(n_layer=1, n_embd=256, n_ff=512, weight_type=qtype))
    ids = [1, 40, 77, 200, 5]
    got = qllama.load(path, backend="numpy", kernels="numba").forward(ids, 0, all_logits=True)
    want = qllama.load(path, backend="numpy", kernels="numpy").forward(ids, 0, all_logits=True)
    agree(to_numpy(got), to_numpy(want))


def test_matmuls_that_cannot_share_a_call_are_made_one_by_one():
    """Two formats, or weights not in one buffer: one matmul each, the same numbers."""
    k = 512
    mixed = one_file(["Q8_0", "Q4_K", "IQ4_XS"], [8, 8, 8], k)
    apart = [random_weight("Q8_0", 8, k, seed=s) for s in (1, 2)]
    x = hard_activations(3, k, seed=1)
    fast, oracle = backends("ref", "parallel")
    for ws in (mixed, apart):
        prepared = [fast.prepare(w) for w in ws]
        assert fast._streams(prepared) is None
        for w, got in zip(ws, matmuls(fast, x, prepared), strict=True):
            agree(got, oracle.matmul(x, oracle.prepare(w)))
    with pytest.raises(TensorShapeError, match=r"needs activations \(T, 512\)"):
        matmuls(fast, x[:, :256], [fast.prepare(w) for w in one_file(["Q8_0"] * 2, [8, 8], k)])


@pytest.mark.parametrize("act", ["Q8_0", "Q8_1", "Q8_K"])
@pytest.mark.parametrize("rounding", ["ref", "simd"])
def test_activation_quantizers_equal_numpy(act, rounding):
    from qllama.backends.numpy.kernels import quantize

    x = hard_activations(20, 512, seed=9)
    x[3, 7], x[4, 31], x[5, 0], x[6, 40] = np.nan, np.nan, np.inf, -np.inf
    size = quants.get(act).type_size
    want = quants.get(act).unpack(quants.quantize(x, act, rounding=rounding).reshape(-1, size))
    if act == "Q8_K":
        qs, d, bsums = quantize.quantize_q8_k(x)
        np.testing.assert_array_equal(bsums.reshape(-1, 16), want["bsums"])
    else:
        qs, d, s = quantize.quantize_q8(x, rounding == "simd", act == "Q8_1")
        if act == "Q8_1":
            np.testing.assert_array_equal(bits(s.reshape(-1, 1)), bits(want["s"]))
    np.testing.assert_array_equal(qs.reshape(want["qs"].shape), want["qs"])
    np.testing.assert_array_equal(bits(d.reshape(-1, 1)), bits(want["d"]))


# a row's values: ordinary, tiny, huge, ties once scaled, and the special floats
SPECIAL = [0.0, -0.0, np.nan, np.inf, -np.inf, 1e-45, -1e-45, 3e38, -3e38, 0.5, -0.5, 2.5]


@st.composite
def activation_rows(draw: st.DrawFn) -> np.ndarray:
    """Two rows of 512 (two Q8_K super-blocks each): scaled normals with special values
    put at drawn places, and a run of 64 of one magnitude with random signs (zeros, NaN,
    or a block's largest |x| many times over, where ggml's first one decides) or none."""
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    scale = draw(st.sampled_from([1e-40, 1e-3, 1.0, 1e3, 1e35]))
    x = rng.standard_normal((2, 512)) * scale
    for _ in range(draw(st.integers(0, 6))):
        x.flat[draw(st.integers(0, x.size - 1))] = draw(st.sampled_from(SPECIAL))
    run = draw(st.sampled_from([None, 0.0, np.nan, np.inf, 3e38, 10 * scale]))
    if run is not None:
        start = draw(st.integers(0, x.size - 64))
        x.flat[start : start + 64] = run * rng.choice([-1, 1], 64)
    with np.errstate(over="ignore"):
        return x.astype(F32)


@settings(max_examples=60, deadline=None)
@given(x=activation_rows())
def test_activation_quantizers_equal_numpy_on_any_row(x):
    """The kernels' quantizers, and the decode loops' forms of their output (Q8_K's codes
    in LANE_ORDER with the sums of 16 and 32; Q8_0's block sums times the format's
    centre), against qllama's numpy quantizers, on rows with NaN, inf, ties and extremes."""
    from qllama.backends.numpy.kernels import quantize

    want = quants.get("Q8_K").unpack(quants.quantize(x, "Q8_K").reshape(-1, 292))
    xl, d, bs16, bs32 = gemv.q8k_activations(x)
    codes = want["qs"].reshape(-1, 64)  # (T*K/64, 64)
    np.testing.assert_array_equal(xl.reshape(-1, 64), codes[:, gemv.LANE_ORDER])
    np.testing.assert_array_equal(bits(d.reshape(-1, 1)), bits(want["d"]))
    np.testing.assert_array_equal(bs16, want["bsums"].reshape(-1))
    np.testing.assert_array_equal(bs32, want["bsums"].reshape(-1, 2).sum(axis=1))
    for rounding in ("ref", "simd"):
        for act in ("Q8_0", "Q8_1"):
            size = quants.get(act).type_size
            raw = quants.quantize(x, act, rounding=rounding).reshape(-1, size)
            want = quants.get(act).unpack(raw)
            qs, d, s = quantize.quantize_q8(x, rounding == "simd", act == "Q8_1")
            np.testing.assert_array_equal(qs.reshape(want["qs"].shape), want["qs"])
            np.testing.assert_array_equal(bits(d.reshape(-1, 1)), bits(want["d"]))
            if act == "Q8_1":
                np.testing.assert_array_equal(bits(s.reshape(-1, 1)), bits(want["s"]))
        qx, _, _, cx = gemv.q8_activations(x, rounding == "simd", False, 16)
        codes = qx.reshape(-1, 32).astype(np.int64)  # (T*K/32, 32)
        np.testing.assert_array_equal(cx.reshape(-1), 16 * codes.sum(axis=1))


@pytest.mark.parametrize("act", ["Q8_0", "Q8_1", "Q8_K"])
def test_activation_quantizers_equal_ggml(act, ggml_vectors):
    """Against ggml's own bytes: its reference (``ref``) and AVX2 (``cpu``) quantizers."""
    from qllama.backends.numpy.kernels import quantize

    x = ggml_vectors["acts_f32"]
    size = quants.get(act).type_size
    for source, simd in (("ref", False), ("cpu", True)):
        want = quants.get(act).unpack(ggml_vectors[f"act/{act}/{source}"].reshape(-1, size))
        if act == "Q8_K":
            qs, d, _ = quantize.quantize_q8_k(x)
        else:
            qs, d, _ = quantize.quantize_q8(x, simd, act == "Q8_1")
        np.testing.assert_array_equal(qs.reshape(want["qs"].shape), want["qs"])
        np.testing.assert_array_equal(bits(d.reshape(-1, 1)), bits(want["d"]))


def test_half_rounding_equals_ggmls():
    """The fp16 store of the activation scales: nearest even, overflow, subnormals, NaN."""
    from numba import njit

    from qllama.backends.numpy.kernels.quantize import _half
    from qllama.quants.rounding import fp16

    @njit
    def each(a, out):
        for i in range(a.size):
            out[i] = _half(a[i])

    rng = np.random.default_rng(0)
    x = np.concatenate(
        [
            rng.integers(0, 2**32, 200_000, dtype=np.uint64).astype(np.uint32).view(F32),
            # every fp16 rounding boundary's neighbours (ties included)
            (np.arange(0, 2**16, dtype=np.uint32) << 13).view(F32) * F32(1),
            ((np.arange(0, 2**16, dtype=np.uint32) << 13) + 4096).view(F32),
            ((np.arange(0, 2**16, dtype=np.uint32) << 13) + 4095).view(F32),
            np.array([65504, 65519.99, 65520, 6e-8, 3e-8, 2.98e-8, -0.0], dtype=F32),
        ]
    )
    got = np.empty_like(x)
    each(x, got)
    want = fp16(x)
    np.testing.assert_array_equal(bits(got), bits(want))
    # the integer path of hosts without fp16 conversions (F16C), on the same values
    from qllama.backends.numpy.kernels.quantize import _fp16_bits, _widen_fp16

    @njit
    def each_portable(a, out):
        for i in range(a.size):
            out[i] = _widen_fp16(_fp16_bits(a[i]))

    finite = x[~np.isnan(x)]
    got = np.empty_like(finite)
    each_portable(finite, got)
    np.testing.assert_array_equal(bits(got), bits(fp16(finite)))


@pytest.mark.parametrize("tokens", [1, 20])
def test_f32_weights_are_the_oracles_products(tokens, ggml_vectors):
    rng = np.random.default_rng(1)
    w = weight(quants.quantize(ggml_vectors["weights_f32"], "F32"), "F32", (11, 512))
    x = rng.standard_normal((tokens, 512)).astype(F32)
    fast, oracle = backends("ref", "serial")
    agree(fast.matmul(x, fast.prepare(w)), oracle.matmul(x, oracle.prepare(w)))


def test_options_are_checked():
    with pytest.raises(BackendError, match="kernels"):
        NumpyBackend(kernels="fortran")
    with pytest.raises(BackendError, match="threads"):
        NumpyBackend(threads=0)
    with pytest.raises(BackendError, match="blas_threads must be at least 1, not 0"):
        NumpyBackend(blas_threads=0)
    assert NumpyBackend().kernels == "numba"  # the default where numba is installed


BLAS_CHECK = """
import sys
import numpy as np
from threadpoolctl import threadpool_info
from qllama import quants
from qllama.backends.base import QuantTensor, matmuls
from qllama.backends.numpy.dispatch import NumpyBackend
from qllama.ggml_types import GGMLType

def blas():
    return sorted({p["num_threads"] for p in threadpool_info() if p["user_api"] == "blas"})

before = blas()
raw = quants.quantize(np.ones((4, 256), np.float32), "Q8_0").reshape(-1)
backend = NumpyBackend(kernels="numba", blas_threads=None if sys.argv[1] == "None" else 1)
w = backend.prepare(QuantTensor("w", GGMLType.Q8_0, (4, 256), raw))
backend.matmul(np.ones((2, 256), np.float32), w)
print(before, blas())
"""


@pytest.mark.parametrize("blas_threads", ["1", "None"])
def test_the_kernels_cap_blas_threads(blas_threads):
    """BLAS's spinning threads would take the kernels' cores: capped at the first kernel call
    (in a process of its own: the cap is process-wide)."""
    import subprocess
    import sys

    pytest.importorskip("threadpoolctl")
    env = {**os.environ, "OPENBLAS_NUM_THREADS": "2", "OMP_NUM_THREADS": "2"}
    run = subprocess.run(
        [sys.executable, "-c", BLAS_CHECK, blas_threads], env=env, capture_output=True, text=True
    )
    assert run.returncode == 0, run.stderr[-2000:]
    before, after = run.stdout.strip().split("] [")
    assert before == "[2" and after == ("1]" if blas_threads == "1" else "2]")


PORTABLE_CHECK = """
import sys

import numpy as np
from qllama import quants
from qllama.backends.numpy import dispatch
from qllama.backends.numpy.kernels import llvm_ir, simd
from qllama.backends.base import QuantTensor, matmuls
from qllama.backends.numpy.dispatch import NumpyBackend
from qllama.ggml_types import GGMLType

assert not simd.VNNI
assert llvm_ir.AVX2 == (sys.argv[1] == "avx2")
rng = np.random.default_rng(0)
for qtype in ("Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K",
              "IQ4_NL", "IQ4_XS", "MXFP4", "IQ2_XXS", "IQ2_XS", "IQ2_S", "IQ3_XXS", "IQ3_S",
              "IQ1_S", "IQ1_M", "TQ1_0", "TQ2_0", "NVFP4", "Q1_0", "Q2_0"):
    w = rng.standard_normal((8, 512)).astype(np.float32)
    imatrix = np.ones(512, np.float32) if qtype[:3] in ("IQ1", "IQ2", "IQ3") else None
    raw = quants.quantize(w, qtype, imatrix=imatrix).reshape(-1)
    raw.flags.writeable = False
    t = QuantTensor("w", GGMLType[qtype], (8, 512), raw)
    for tokens in (1, 20):
        x = rng.standard_normal((tokens, 512)).astype(np.float32)
        fast, oracle = NumpyBackend(kernels="numba", threads=1), NumpyBackend(kernels="numpy")
        got, want = fast.matmul(x, fast.prepare(t)), oracle.matmul(x, oracle.prepare(t))
        assert np.array_equal(got.view(np.uint32), want.view(np.uint32)), (qtype, tokens)
        if qtype in dispatch.STREAMING_TYPES:  # two weights of one buffer, one call
            two = QuantTensor("a", t.ggml_type, (4, 512), raw[: raw.size // 2])
            got = fast.matmuls(x, [fast.prepare(two), fast.prepare(t)])
            assert np.array_equal(got[1].view(np.uint32), want.view(np.uint32)), (qtype, tokens)
print("ok")
"""


# numba's targets without AVX512-VNNI: a generic x86-64 (the portable IR), and an AVX2 one
TARGETS = {
    "generic": {"NUMBA_CPU_NAME": "generic"},
    "avx2": {"NUMBA_CPU_NAME": "haswell", "NUMBA_CPU_FEATURES": "+avx,+avx2,+f16c,+fma,+ssse3"},
}


@pytest.mark.slow
@pytest.mark.parametrize("target", sorted(TARGETS))
def test_portable_code_equals_the_oracle(target):
    """The kernels compiled for a CPU without AVX512-VNNI, in a process of their own (numba
    compiles for one target per process)."""
    import subprocess
    import sys

    env = {**os.environ, **TARGETS[target]}
    run = subprocess.run(
        [sys.executable, "-c", PORTABLE_CHECK, target], env=env, capture_output=True, text=True
    )
    assert run.returncode == 0 and run.stdout.strip().endswith("ok"), run.stderr[-2000:]
