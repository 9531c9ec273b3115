"""qllama's quantizer against llama.cpp's own, whole file, byte for byte.

Both quantize the same F32 SmolLM2 file; every file type must give the same bytes: the same
metadata in the same order, the same type per tensor, the same tensor bytes. Without an
importance matrix llama.cpp runs through llama-cpp-python (``llama_model_quantize``); with one
through the ``llama-quantize`` tool (``--llama-bin``), which also reads the imatrix file
itself and records it in the metadata. Where llama.cpp refuses a file type (an IQ1/IQ2 type
without an imatrix, Q1_0's 128-blocks on 576-wide rows), qllama must refuse it too.
"""

from __future__ import annotations

import ctypes

import numpy as np
import pytest

from qllama.errors import ImatrixError, ModelConfigError, UnsupportedTensorTypeError
from qllama.file_quantizer import FILE_TYPES, quantize_file
from qllama.gguf_reader import read_gguf
from qllama.imatrix import Entry, ImportanceMatrix, write_imatrix
from qllama.model_files import variant

llama_cpp = pytest.importorskip("llama_cpp")
pytestmark = [pytest.mark.peers, pytest.mark.model]

LABELS = [label for label in FILE_TYPES if label != "F32"]


def llama_quantize(src, dst, ftype: int) -> bool:
    """llama_model_quantize through llama-cpp-python; False where llama.cpp refuses."""
    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = ftype
    params.nthread = 2
    src_b, dst_b = str(src).encode(), str(dst).encode()
    return llama_cpp.llama_model_quantize(src_b, dst_b, ctypes.byref(params)) == 0


def llama_quantize_tool(llama_tool, src, dst, label: str, imatrix) -> bool:
    run = llama_tool(
        "llama-quantize", "--imatrix", str(imatrix), str(src), str(dst), label, "2", timeout=3600
    )
    return run.returncode == 0


@pytest.fixture(scope="module")
def f32_file():
    return variant("smollm2-135m-instruct", "F32")


@pytest.fixture(scope="module")
def imatrix_files(f32_file, tmp_path_factory):
    """An importance matrix for every blk.* weight of SmolLM2, in both formats: random (the
    quantizers only read its values), written by qllama, read by both sides."""
    rng = np.random.default_rng(11)
    entries = {
        t.name: Entry(
            (np.exp(rng.normal(0, 1.5, size=(1, t.ne[0]))) * 1536).astype(np.float32),
            np.array([1536]),
        )
        for t in read_gguf(f32_file)
        if t.name.startswith("blk.") and len(t.ne) == 2
    }
    folder = tmp_path_factory.mktemp("imatrix")
    m = ImportanceMatrix(entries, ["corpus.txt"], 3, 512)
    write_imatrix(folder / "smollm2.imatrix.gguf", m)
    write_imatrix(folder / "smollm2.imatrix.dat", m)
    return folder / "smollm2.imatrix.gguf", folder / "smollm2.imatrix.dat"


def ours_or_refusal(src, dst, label: str, imatrix=None) -> bool:
    """qllama's quantizer: True if it wrote the file, False if it refused as llama.cpp does;
    skips where a type it needs has no class in this tree (the grid types)."""
    try:
        quantize_file(src, dst, label, imatrix=imatrix)
    except (ImatrixError, ModelConfigError):
        return False
    except UnsupportedTensorTypeError as e:
        pytest.skip(f"{label} needs a type qllama does not implement here: {e}")
    return True


def assert_same_file(ours, theirs, label: str) -> None:
    a, b = read_gguf(ours), read_gguf(theirs)
    assert list(a.kv) == list(b.kv)
    assert a.kv == b.kv
    assert [(t.name, t.ggml_type) for t in a] == [(t.name, t.ggml_type) for t in b]
    for t in a:
        assert (a.tensor_data(t.name) == b.tensor_data(t.name)).all(), f"{label}: {t.name} differs"
    assert ours.read_bytes() == theirs.read_bytes()


@pytest.mark.parametrize("label", LABELS)
def test_same_file_as_llama_quantize(f32_file, tmp_path, label):
    ours, theirs = tmp_path / "qllama.gguf", tmp_path / "llama.gguf"
    wrote = ours_or_refusal(f32_file, ours, label)
    assert llama_quantize(f32_file, theirs, FILE_TYPES[label].value) == wrote
    if wrote:
        assert_same_file(ours, theirs, label)


@pytest.mark.parametrize("label", LABELS)
def test_same_file_as_llama_quantize_with_an_imatrix(
    f32_file, imatrix_files, llama_tool, tmp_path, label
):
    ours, theirs = tmp_path / "qllama.gguf", tmp_path / "llama.gguf"
    imatrix = imatrix_files[0]
    wrote = ours_or_refusal(f32_file, ours, label, imatrix)
    assert llama_quantize_tool(llama_tool, f32_file, theirs, label, imatrix) == wrote
    if wrote:
        assert_same_file(ours, theirs, label)


@pytest.mark.parametrize("label", ["Q4_K_M", "IQ4_XS"])
def test_legacy_imatrix_files_quantize_the_same(
    f32_file, imatrix_files, llama_tool, tmp_path, label
):
    ours, theirs = tmp_path / "qllama.gguf", tmp_path / "llama.gguf"
    dat = imatrix_files[1]
    assert ours_or_refusal(f32_file, ours, label, dat)
    assert llama_quantize_tool(llama_tool, f32_file, theirs, label, dat)
    assert_same_file(ours, theirs, label)
