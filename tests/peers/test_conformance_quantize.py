"""qllama's quantizer against llama.cpp's (llama_model_quantize) on every conformance model
and every file type: the same type per tensor and the same bytes, whole file, or the same
refusal (an importance matrix the type needs, rows no block of it divides).

The models exercise the rules that look at the architecture: grouped-query attention (the
GQA ratio of the attn_v rules), phi3's fused attn_qkv (counted with attn_v) and fused ffn_up,
tied outputs (token_embd takes the output's type), rope_freqs (1-D, kept F32), and rows that
are not a multiple of 256 (the K-quant fallbacks).
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import conformance as C
from quantize_pair import llama_quantize, llama_quantize_tool, ours_or_refusal, random_imatrix

from qllama.gguf.quantizer import FILE_TYPES

llama_cpp = pytest.importorskip("llama_cpp")
pytestmark = pytest.mark.peers


@pytest.mark.parametrize("label", [label for label in FILE_TYPES if label != "F32"])
@pytest.mark.parametrize("arch", list(C.MODELS))
def test_same_file_as_llama_quantize(arch: str, label: str, tmp_path: Path) -> None:
    src = C.build(arch).gguf
    ours, theirs = tmp_path / "qllama.gguf", tmp_path / "llama.gguf"
    wrote = ours_or_refusal(src, ours, label)
    assert llama_quantize(src, theirs, FILE_TYPES[label].value) == wrote, f"{arch} {label}"
    if wrote:
        assert ours.read_bytes() == theirs.read_bytes(), f"{arch} {label}"


@pytest.mark.parametrize("label", [label for label in FILE_TYPES if label != "F32"])
@pytest.mark.parametrize("arch", list(C.MODELS))
def test_same_file_as_llama_quantize_with_an_imatrix(
    arch: str, label: str, llama_tool, tmp_path: Path
) -> None:
    src = C.build(arch).gguf
    imatrix, _ = random_imatrix(src, tmp_path)
    ours, theirs = tmp_path / "qllama.gguf", tmp_path / "llama.gguf"
    wrote = ours_or_refusal(src, ours, label, imatrix)
    assert llama_quantize_tool(llama_tool, src, theirs, label, imatrix) == wrote, f"{arch} {label}"
    if wrote:
        assert ours.read_bytes() == theirs.read_bytes(), f"{arch} {label}"
