"""Random rows through ggml itself: qllama's quantizers (with and without an importance
matrix), dequantizers and CPU dot products against libggml's, bit for bit.

The committed vectors (tests/data/ggml_vectors_new_types.npz) pin a fixed set of rows; here
hypothesis draws new ones every run, from distributions that reach the quantizers' branches:
heavy tails, exact ties, zero and tiny blocks, values at powers of two, large magnitudes.
ggml is called through ctypes as tests/data/make_vectors.py does (its generic C dot products
compiled from llama.cpp's source into a temporary library).
"""

from __future__ import annotations

import ctypes
import importlib.util
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from qllama import quants
from qllama.backends.base import QuantTensor
from qllama.backends.numpy.dispatch import NumpyBackend
from qllama.ggml_types import GGMLType

pytest.importorskip("llama_cpp")
pytestmark = pytest.mark.peers

F32 = np.float32
ROW = 512
NEW = ["IQ4_NL", "IQ4_XS", "TQ1_0", "TQ2_0", "MXFP4", "NVFP4", "Q1_0", "Q2_0"]
OLD = ["Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K"]
SETTINGS = settings(
    max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)


def _make_vectors():
    path = Path(__file__).resolve().parents[1] / "data" / "make_vectors.py"
    spec = importlib.util.spec_from_file_location("make_vectors", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


mv = _make_vectors()


@pytest.fixture(scope="module")
def ggml():
    return mv.GGML()


@pytest.fixture(scope="module")
def generic(ggml, tmp_path_factory):
    return mv.generic_vec_dots(ggml, mv.llama_cpp_source(), tmp_path_factory.mktemp("generic"))


@st.composite
def rows(draw, n_rows: int = 3) -> np.ndarray:
    """Rows of 512 from one of several shapes of data, with planted edge cases."""
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    kind = draw(st.sampled_from(["normal", "t", "uniform", "ties", "pow2", "sparse", "wide"]))
    scale = F32(10.0 ** draw(st.integers(-6, 3)))
    if kind == "normal":
        x = rng.normal(size=(n_rows, ROW))
    elif kind == "t":
        x = rng.standard_t(2, size=(n_rows, ROW))
    elif kind == "uniform":
        x = rng.uniform(-1, 1, size=(n_rows, ROW))
    elif kind == "ties":  # small integers and halves: exact ties once scaled
        x = rng.integers(-16, 17, size=(n_rows, ROW)) / 2
    elif kind == "pow2":
        x = np.sign(rng.normal(size=(n_rows, ROW))) * 2.0 ** rng.integers(-8, 8, size=(n_rows, ROW))
    elif kind == "sparse":
        x = rng.normal(size=(n_rows, ROW)) * (rng.random((n_rows, ROW)) < 0.1)
    else:
        x = rng.normal(size=(n_rows, ROW)) * np.exp(rng.normal(0, 3, size=(n_rows, ROW)))
    x = (x * scale).astype(F32)
    if draw(st.booleans()):  # a zero 32-block, and the block after it tiny
        x[0, 64:96] = 0
        x[0, 96:128] *= F32(1e-12)
    return x


@st.composite
def importances(draw) -> np.ndarray:
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    qw = np.exp(rng.normal(0, draw(st.sampled_from([0.5, 1.0, 3.0])), size=ROW))
    if draw(st.booleans()):
        qw[rng.random(ROW) < 0.2] = 0
    return qw.astype(F32)


@SETTINGS
@given(x=rows(), qw=importances(), qtype=st.sampled_from(NEW + OLD))
def test_quantize_chunk(ggml, x, qw, qtype):
    if qtype in NEW:
        np.testing.assert_array_equal(
            quants.quantize(x, qtype), ggml.quantize_chunk(qtype, x, None)
        )
    got = quants.quantize(x, qtype, imatrix=qw)
    np.testing.assert_array_equal(got, ggml.quantize_chunk(qtype, x, qw))


@SETTINGS
@given(seed=st.integers(0, 2**32 - 1), qtype=st.sampled_from(NEW))
def test_to_float(ggml, seed, qtype):
    raw = np.random.default_rng(seed).integers(
        0, 256, size=(4, ggml.row_bytes(qtype)), dtype=np.uint8
    )
    with np.errstate(all="ignore"):
        got = quants.dequantize(raw, qtype, (4, ROW))
    want = ggml.to_float(qtype, raw)
    np.testing.assert_array_equal(got.view(np.uint32), want.view(np.uint32))


@SETTINGS
@given(w=rows(), a=rows(4), qtype=st.sampled_from(NEW))
def test_cpu_vec_dot(ggml, generic, w, a, qtype):
    """The oracle against ggml's generic C, on activations the CPU quantized itself."""
    raw = quants.quantize(w, qtype)
    dot_type = str(quants.get(qtype).vec_dot_type)
    acts = ggml.from_float(ggml.traits_cpu(dot_type).from_float, dot_type, a)
    fn = ctypes.cast(getattr(generic, mv._generic_name(qtype, dot_type)), ctypes.c_void_p).value
    want = ggml.vec_dot(fn, raw, acts).T
    tensor = QuantTensor("w", GGMLType[qtype], (raw.shape[0], ROW), raw.reshape(-1))
    backend = NumpyBackend(kernels="numpy", activation_rounding="simd")
    with np.errstate(all="ignore"):
        got = backend.matmul(a, backend.prepare(tensor))
    np.testing.assert_array_equal(got.view(np.uint32), want.view(np.uint32))
