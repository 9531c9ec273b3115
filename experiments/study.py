"""What the study is: the model, the prompt, the files, the settings. One place; the
reference, the matrix and the report read it from here."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

MODEL = "smollm2-135m-instruct"
MESSAGES = [{"role": "user", "content": "Explain how a CPU cache works."}]
MAX_NEW_TOKENS = 300  # the reference decodes to <|im_end|> or this many tokens
EXTRA_TOKENS = 20  # free generation may run this far past the reference's length

# file types: the F32 control isolates implementation error from quantization error
FILES = ("F32", "Q8_0", "Q4_K_M")


@dataclass(frozen=True)
class Setting:
    """An arithmetic: how a backend computes the quantized matmuls."""

    name: str
    backend: str
    options: dict[str, Any] = field(default_factory=dict)
    about: str = ""


SETTINGS = {
    s.name: s
    for s in (
        Setting("cpu", "numpy", {}, "activations quantized to Q8 (llama.cpp / candle CPU)"),
        Setting("gpu", "torch", {}, "f32 activations, weights dequantized in each matmul"),
        Setting("dequantize-all", "numpy", {"dequantize_all": True}, "f32 weights at load"),
        Setting("jax", "jax", {}, "the GPU arithmetic under XLA (an extra column)"),
    )
}
