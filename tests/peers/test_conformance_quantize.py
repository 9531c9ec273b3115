"""qllama's quantizer against llama.cpp's (llama_model_quantize) on every conformance model
and every file type: the same type per tensor and the same bytes, whole file.

The models exercise the rules that look at the architecture: grouped-query attention (the
GQA ratio of the attn_v rules), phi3's fused attn_qkv (counted with attn_v) and fused ffn_up,
tied outputs (token_embd takes the output's type), rope_freqs (1-D, kept F32), and rows that
are not a multiple of 256 (the K-quant fallbacks).
"""

from __future__ import annotations

import ctypes
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import conformance as C

from qllama.file_quantizer import FILE_TYPES, quantize_file

llama_cpp = pytest.importorskip("llama_cpp")
pytestmark = pytest.mark.peers


def llama_quantize(src: Path, dst: Path, ftype: int) -> None:
    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = ftype
    params.nthread = 2
    status = llama_cpp.llama_model_quantize(
        str(src).encode(), str(dst).encode(), ctypes.byref(params)
    )
    if status != 0:
        raise RuntimeError(f"llama_model_quantize failed for file type {ftype}")


@pytest.mark.parametrize("label", [label for label in FILE_TYPES if label != "F32"])
@pytest.mark.parametrize("arch", list(C.MODELS))
def test_same_file_as_llama_quantize(arch: str, label: str, tmp_path: Path) -> None:
    src = C.build(arch).gguf
    ours, theirs = tmp_path / "qllama.gguf", tmp_path / "llama.gguf"
    quantize_file(src, ours, label)
    llama_quantize(src, theirs, FILE_TYPES[label].value)
    assert ours.read_bytes() == theirs.read_bytes(), f"{arch} {label}"
