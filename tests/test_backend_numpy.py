"""The numpy backend: ggml's CPU arithmetic (q8 activations), the GPU one on numpy (f32) and
dequantize-all, against the dot products ggml itself computed (tests/data)."""

from __future__ import annotations

import hashlib
import subprocess
import sys
import warnings

import numpy as np
import pytest
from bounds import gamma, reorder_bound
from hypothesis import given, settings
from hypothesis import strategies as st

from qllama import quants
from qllama.backends import get_backend
from qllama.backends.base import QuantTensor
from qllama.backends.numpy import dispatch
from qllama.backends.numpy.dispatch import NumpyBackend
from qllama.errors import BackendError, TensorShapeError, UnsupportedTensorTypeError
from qllama.ggml_types import GGMLType

# one test process compiles a type's kernels for this file and test_cpu_kernels.py
# (split by type in conftest.py)
pytestmark = pytest.mark.xdist_group("kernels")

F32 = np.float32
QUANT_TYPES = ["Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K"]
WEIGHT_TYPES = [*QUANT_TYPES, "F16", "BF16"]  # the types with ggml vec_dot results in the npz

# sha256[:16] of the (14 activations, 11 weight rows) float32 results of ggml's generic C
# vec_dot (ggml-cpu/quants.c, recompiled with -march=x86-64 -ffp-contract=off, i.e. exactly as
# written, no FMA) on the npz's weight bytes and CPU-quantized activation bytes. The numpy
# path reproduces it bit for bit; ggml's SIMD kernels (vec_dot_cpu) only to float32 rounding.
GENERIC_C_DIGESTS = {
    "Q4_0": "813f3010d41fa48c",
    "Q4_1": "0ea57e5e5ea65b8f",
    "Q5_0": "848cadb8b15de0f3",
    "Q5_1": "8386783da22af37a",
    "Q8_0": "365bb6b35d25087e",
    "Q2_K": "5c22448847290ffa",
    "Q3_K": "d9c4b9498b8005d1",
    "Q4_K": "3ea92310c3ada45c",
    "Q5_K": "a0e09bed43fc4b87",
    "Q6_K": "c724fcce6b382063",
}


def tensor(raw: np.ndarray, qtype: str, shape: tuple[int, int]) -> QuantTensor:
    return QuantTensor("w", GGMLType[qtype], shape, np.ascontiguousarray(raw).reshape(-1))


def npz_weight(ggml_vectors: dict[str, np.ndarray], qtype: str) -> QuantTensor:
    if qtype == "F32":
        raw = quants.quantize(ggml_vectors["weights_f32"], "F32")
    else:
        raw = ggml_vectors[f"w/{qtype}/bytes"]
    return tensor(raw, qtype, (raw.shape[0], 512))


def bits(x: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(x, dtype=F32).view(np.uint32)


@pytest.fixture(params=["numpy", "numba"])
def kernels(request: pytest.FixtureRequest) -> str:
    """The plain numpy path (the oracle) and the compiled kernels, where numba is installed."""
    if request.param == "numba" and not dispatch.kernels_available():
        pytest.skip("numba is not installed")
    return request.param


@pytest.mark.parametrize("qtype", [*WEIGHT_TYPES, "F32"])
@pytest.mark.parametrize("rounding", ["ref", "simd"])
def test_q8_matmul_matches_ggmls_cpu_vec_dot(qtype, rounding, ggml_vectors, kernels):
    acts = ggml_vectors["acts_f32"]
    w = npz_weight(ggml_vectors, qtype)
    backend = NumpyBackend(activation_rounding=rounding, kernels=kernels)
    got = backend.matmul(acts, backend.prepare(w))
    assert got.shape == (14, 11) and got.dtype == F32
    if qtype == "F32":  # a plain float32 dot product; ggml's is one as well
        want = acts.astype(np.float64) @ ggml_vectors["weights_f32"].T.astype(np.float64)
    else:
        want = ggml_vectors[f"w/{qtype}/vec_dot_cpu"].T
    # ggml's SIMD kernels add the same exact block terms in another order, and an F32 row is a
    # float32 dot product either way: the two differ by float32 rounding of a sum over at most
    # 512 terms, within reorder_bound (Higham's gamma_512, twice). For the integer types the
    # float sum runs over 16 block terms only (gamma_16), which leaves room for the terms being
    # products of quantized activations, a rounding step (1/254 of the block max) off x.
    dense = quants.dequantize(w.data, qtype, w.shape)
    assert np.all(np.abs(got - want) <= reorder_bound(acts, dense))


@pytest.mark.parametrize("qtype", QUANT_TYPES)
def test_q8_matmul_is_ggmls_generic_c_bit_for_bit(qtype, ggml_vectors, kernels):
    w = npz_weight(ggml_vectors, qtype)
    backend = NumpyBackend(kernels=kernels)
    got = backend.matmul(ggml_vectors["acts_f32"], backend.prepare(w))
    assert hashlib.sha256(got.tobytes()).hexdigest()[:16] == GENERIC_C_DIGESTS[qtype]


@pytest.mark.parametrize("qtype", WEIGHT_TYPES)
def test_activation_quantization_is_really_there(qtype, ggml_vectors):
    acts = ggml_vectors["acts_f32"]
    w = npz_weight(ggml_vectors, qtype)
    q8_backend = NumpyBackend(kernels="numpy")
    q8 = q8_backend.matmul(acts, q8_backend.prepare(w))
    f32_backend = NumpyBackend(activations="f32")
    f32 = f32_backend.matmul(acts, f32_backend.prepare(w))
    dense_backend = NumpyBackend(dequantize_all=True)
    dense = dense_backend.matmul(acts, dense_backend.prepare(w))
    assert not np.array_equal(q8, f32)
    # f32 activations are the GPU arithmetic: the dequantize-all product of the same float32
    # values, in another blocking, so within reorder_bound
    bound = reorder_bound(acts, quants.dequantize(w.data, qtype, w.shape))
    assert np.all(np.abs(f32 - dense) <= bound)


def test_ref_and_simd_rounding_differ_on_a_tie():
    w = tensor(quants.quantize(np.ones((1, 32), F32), "Q8_0"), "Q8_0", (1, 32))  # all q = 127
    x = np.zeros((1, 32), F32)
    x[0, :3] = [127.0, 0.5, 2.5]  # d = 1: the .5s are exact ties
    dw = F32(np.float16(F32(1) / F32(127)))  # the weight's stored scale
    ref = NumpyBackend(activation_rounding="ref", kernels="numpy")
    simd = NumpyBackend(activation_rounding="simd", kernels="numpy")
    # ref rounds ties away (1, 3), AVX2 to even (0, 2); sumf = sumi * (d_w * d_x), d_x = 1
    assert ref.matmul(x, ref.prepare(w))[0, 0] == F32(127 * (127 + 1 + 3)) * dw
    assert simd.matmul(x, simd.prepare(w))[0, 0] == F32(127 * (127 + 0 + 2)) * dw


@pytest.mark.parametrize("qtype", [*WEIGHT_TYPES, "F32"])
@pytest.mark.parametrize("activations", ["q8", "f32"])
def test_chunking_does_not_change_results(qtype, activations, ggml_vectors):
    acts = ggml_vectors["acts_f32"]
    w = npz_weight(ggml_vectors, qtype)
    whole = NumpyBackend(activations=activations, kernels="numpy")
    tiny = NumpyBackend(activations=activations, work_bytes=1, kernels="numpy")  # a row a chunk
    got = tiny.matmul(acts, tiny.prepare(w))
    want = whole.matmul(acts, whole.prepare(w))
    if activations == "q8" and qtype in QUANT_TYPES:  # exact integer sums, fixed float order
        np.testing.assert_array_equal(bits(got), bits(want))
    else:  # a float32 BLAS product: its summation order depends on the shapes and the machine
        bound = reorder_bound(acts, quants.dequantize(w.data, qtype, w.shape))
        assert np.all(np.abs(got - want) <= bound)


@pytest.mark.parametrize("qtype", [*WEIGHT_TYPES, "F32", "Q8_1", "Q8_K"])
@pytest.mark.parametrize("dequantize_all", [False, True])
def test_embedding_is_the_dequantized_rows(qtype, dequantize_all, ggml_vectors):
    raw = quants.quantize(ggml_vectors["weights_f32"], qtype)
    w = tensor(raw, qtype, (11, 512))
    backend = NumpyBackend(dequantize_all=dequantize_all, activations="f32")
    ids = np.array([3, 0, 3, 10])
    got = backend.embedding(ids, backend.prepare(w))
    np.testing.assert_array_equal(bits(got), bits(quants.dequantize(raw, qtype, (11, 512))[ids]))


def test_weights_stay_the_files_bytes(ggml_vectors):
    w = npz_weight(ggml_vectors, "Q4_K")
    prepared = NumpyBackend().prepare(w)
    assert np.shares_memory(prepared.tensor.data, w.data)
    assert NumpyBackend(dequantize_all=True).prepare(w).w.shape == (11, 512)


@pytest.mark.parametrize("qtype", QUANT_TYPES)
def test_integer_form_is_the_format(qtype):
    """d * scales * q + m - dmin * mins rebuilds the dequantized values, within the bound."""
    cls = quants.get(qtype)
    rng = np.random.default_rng(5)
    raw = rng.integers(0, 256, (64, cls.type_size), dtype=np.uint8)
    fields = cls.unpack(raw)
    for k in ("d", "m", "dmin"):  # finite scales, to compare values
        if k in fields:
            fields[k] = rng.uniform(-1, 1, fields[k].shape).astype(F32)
    form = cls.integer_form(fields)
    q = form.q.astype(np.int64)
    if form.scales is not None:
        q = q * np.repeat(form.scales.astype(np.int64), form.sub_size, axis=1)
    assert np.abs(q).max() <= form.bound
    terms = [form.d.astype(np.float64) * q]
    if form.m is not None:
        terms.append(np.broadcast_to(form.m, q.shape))
    if form.mins is not None:
        assert form.dmin is not None
        terms.append(-form.dmin * np.repeat(form.mins.astype(np.float64), form.sub_size, axis=1))
    # dequantize_fields evaluates d * scale * q - dmin * min in float32 in a fixed order: at
    # most four roundings of exact fields, so within gamma(4) of the terms' magnitude
    err = np.abs(sum(terms) - cls.dequantize_fields(fields, xp=np))
    assert np.all(err <= gamma(4) * sum(np.abs(t) for t in terms))


def test_options_and_devices_are_checked():
    with pytest.raises(BackendError, match="no device 'cuda'"):
        NumpyBackend(device="cuda")
    with pytest.raises(BackendError, match="activations must be one of"):
        NumpyBackend(activations="int4")
    with pytest.raises(BackendError, match="activation_rounding must be one of"):
        NumpyBackend(activation_rounding="nearest")  # type: ignore[arg-type]
    with pytest.raises(BackendError, match="no options"):
        NumpyBackend(lanes=4)
    assert NumpyBackend(device="cpu").device == "cpu"
    backend = get_backend("numpy", device="cpu", dequantize_all=False, activations="f32")
    assert isinstance(backend, NumpyBackend) and backend.activations == "f32"


def test_a_backend_says_what_computes(monkeypatch):
    from qllama.backends.base import arithmetic, describe

    cpu = NumpyBackend(kernels="numpy")
    assert describe(cpu).startswith("numpy, cpu arithmetic (activations quantized")
    assert describe(cpu).endswith("the numpy oracle, 1 thread)") and arithmetic(cpu) == "cpu"
    gpu = NumpyBackend(activations="f32", kernels="numpy")
    assert "gpu arithmetic (f32 activations" in describe(gpu) and arithmetic(gpu) == "gpu"
    dq = NumpyBackend(dequantize_all=True, kernels="numpy")
    assert "dequantize-all arithmetic" in describe(dq) and arithmetic(dq) == "dequantize-all"


def test_the_oracle_fallback_is_said_once(monkeypatch):
    from qllama.backends.numpy import dispatch

    monkeypatch.setattr(dispatch, "kernels_available", lambda: False)
    dispatch._say_oracle_fallback.cache_clear()
    with pytest.warns(RuntimeWarning, match="numba is not installed.*pip install numba"):
        assert NumpyBackend().kernels == "numpy"
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        NumpyBackend()  # said once per process
        NumpyBackend(kernels="numpy")  # asked for: nothing to say
    dispatch._say_oracle_fallback.cache_clear()


def test_activation_formats_are_no_q8_weights(ggml_vectors):
    w = tensor(quants.quantize(ggml_vectors["weights_f32"], "Q8_K"), "Q8_K", (11, 512))
    assert not NumpyBackend().supports(GGMLType.Q8_K)
    with pytest.raises(UnsupportedTensorTypeError, match="does not support Q8_K"):
        NumpyBackend().prepare(w)
    assert NumpyBackend(activations="f32").supports(GGMLType.Q8_K)


@pytest.mark.parametrize("qtype", ["Q4_1", "Q4_K", "F16"])
@pytest.mark.parametrize("mode", [{}, {"activations": "f32"}, {"dequantize_all": True}])
def test_no_tokens(qtype, mode, ggml_vectors):
    backend = NumpyBackend(**mode)
    w = backend.prepare(npz_weight(ggml_vectors, qtype))
    assert backend.matmul(np.zeros((0, 512), F32), w).shape == (0, 11)
    assert backend.embedding(np.zeros(0, np.int64), w).shape == (0, 512)


def test_activation_shape_is_checked(ggml_vectors):
    backend = NumpyBackend()
    w = backend.prepare(npz_weight(ggml_vectors, "Q8_0"))
    with pytest.raises(TensorShapeError, match=r"needs activations \(T, 512\)"):
        backend.matmul(np.zeros((2, 256), F32), w)


@settings(max_examples=60, deadline=None)
@given(
    n_kv=st.integers(1, 4),
    rows=st.integers(1, 2 * dispatch.KEYS_FIRST_ROWS),
    head=st.sampled_from([32, 64, 80, 96, 128, 256]),
    keys=st.integers(1, 700),
    seed=st.integers(0, 2**32 - 1),
)
def test_attention_scores_are_q_times_k_transposed_bit_for_bit(n_kv, rows, head, keys, seed):
    """Whichever way the backend computes the scores (keys first for a decode step's few
    rows, where this BLAS allows it), they are the bits of ``q @ k^T``, in C order (the
    softmax's row sums then run as they always did)."""
    rng = np.random.default_rng(seed)
    q = rng.standard_normal((n_kv, rows, head)).astype(F32)
    k = (4 * rng.standard_normal((n_kv, keys, head))).astype(F32)
    got = NumpyBackend().attention_scores(q, k)
    want = np.matmul(q, k.transpose(0, 2, 1))
    assert got.flags.c_contiguous and got.shape == (n_kv, rows, keys)
    np.testing.assert_array_equal(got.view(np.uint32), want.view(np.uint32))


@pytest.mark.parametrize("exact", [True, False])
@pytest.mark.parametrize("rows", [3, dispatch.KEYS_FIRST_ROWS + 1])
def test_keys_first_only_for_few_rows_and_where_exact(exact, rows, monkeypatch):
    """The keys go first for at most KEYS_FIRST_ROWS query rows, and only where the probe
    found both orders give the same bits."""
    firsts = []
    matmul = np.matmul

    def spy(a, b):
        firsts.append(a.shape[1])
        return matmul(a, b)

    monkeypatch.setattr(dispatch, "keys_first_exact", lambda: exact)
    monkeypatch.setattr(dispatch.np, "matmul", spy)
    q, k = np.ones((2, rows, 64), F32), np.ones((2, 300, 64), F32)
    NumpyBackend().attention_scores(q, k)
    assert firsts == [300 if exact and rows <= dispatch.KEYS_FIRST_ROWS else rows]


HEAP = """
import resource
import sys

import numpy as np

if sys.argv[1] == "backend":
    from qllama.backends.numpy.dispatch import NumpyBackend

    NumpyBackend(kernels="numpy")


def faults_of_a_pass() -> int:
    # four 8 MB temporaries alive at once, written, then freed, as in a forward pass
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    temporaries = [np.ones(2 << 20, np.float32) for _ in range(4)]
    del temporaries
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before


faults_of_a_pass()
print(faults_of_a_pass())
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's malloc")
def test_the_backend_keeps_a_forward_passs_large_temporaries_for_reuse():
    """In processes of their own: a second pass's 32 MB of temporaries fault in their pages
    anew (glibc gave the first pass's back), unless a numpy backend was made first
    (backends/numpy/heap.py)."""
    pages = 32 << 8  # 32 MB of 4 KB pages

    def faults(setup: str) -> int:
        run = subprocess.run([sys.executable, "-c", HEAP, setup], capture_output=True, text=True)
        assert run.returncode == 0, run.stderr[-2000:]
        return int(run.stdout)

    from qllama.backends.numpy.heap import keep_large_buffers

    if not keep_large_buffers():
        pytest.skip("not glibc's malloc")
    if faults("none") < pages // 8:  # given back and faulted in again, but in huge pages
        pytest.skip("transparent huge pages: too few faults to tell reuse from fresh pages")
    assert faults("backend") < pages // 16  # the same heap blocks again
