"""qllama's quantizer against llama.cpp's own (llama_model_quantize), whole file, byte for byte.

Both quantize the same F32 SmolLM2 file; every file type must give the same bytes: the same
metadata in the same order, the same type per tensor, the same tensor bytes.
"""

from __future__ import annotations

import ctypes

import pytest

from qllama.file_quantizer import FILE_TYPES, quantize_file
from qllama.gguf_reader import read_gguf
from qllama.model_files import variant

llama_cpp = pytest.importorskip("llama_cpp")
pytestmark = pytest.mark.peers


def llama_quantize(src, dst, ftype: int) -> None:
    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = ftype
    params.nthread = 2
    src_b, dst_b = str(src).encode(), str(dst).encode()
    status = llama_cpp.llama_model_quantize(src_b, dst_b, ctypes.byref(params))
    if status != 0:
        raise RuntimeError(f"llama_model_quantize failed for file type {ftype}")


@pytest.fixture(scope="module")
def f32_file():
    return variant("smollm2-135m-instruct", "F32")


@pytest.mark.model
@pytest.mark.parametrize("label", [label for label in FILE_TYPES if label != "F32"])
def test_same_file_as_llama_quantize(f32_file, tmp_path, label):
    ours, theirs = tmp_path / "qllama.gguf", tmp_path / "llama.gguf"
    quantize_file(f32_file, ours, label)
    llama_quantize(f32_file, theirs, FILE_TYPES[label].value)
    a, b = read_gguf(ours), read_gguf(theirs)
    assert list(a.kv) == list(b.kv)
    assert a.kv == b.kv
    assert [(t.name, t.ggml_type) for t in a] == [(t.name, t.ggml_type) for t in b]
    for t in a:
        assert (a.tensor_data(t.name) == b.tensor_data(t.name)).all(), f"{label}: {t.name} differs"
    assert ours.read_bytes() == theirs.read_bytes()
