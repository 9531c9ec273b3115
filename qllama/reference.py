"""The f32 reference: transformers, eager attention, float32, on the CPU.

transformers reads a GGUF with ``gguf_file=`` and dequantizes every tensor to float32 at
load, undoing the Q/K permutation for its rotate_half RoPE. Newer versions can keep GGUF
weights packed and run quantized kernels instead; :func:`load_transformers` therefore checks
that every parameter is a plain float32 tensor and that the embedding equals the file's
values, so the reference really is the f32 model.

Needs the ``reference`` extra (torch, transformers, accelerate, gguf).
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from qllama import quants
from qllama.compare import Reference
from qllama.errors import QllamaError
from qllama.gguf_reader import read_gguf


class ReferenceError(QllamaError):
    """The reference model is not the float32 model it must be."""


def load_transformers(path: str | os.PathLike[str]) -> Any:
    """The GGUF file as a transformers model: float32, eager attention, CPU, checked."""
    import torch
    from transformers import AutoModelForCausalLM

    path = Path(path)
    model = AutoModelForCausalLM.from_pretrained(
        path.parent, gguf_file=path.name, dtype=torch.float32, attn_implementation="eager"
    )
    model.eval()
    for name, p in model.named_parameters():
        if p.dtype != torch.float32 or type(p.data) is not torch.Tensor:
            raise ReferenceError(
                f"transformers kept parameter {name} as {type(p.data).__name__} {p.dtype}, not a "
                "float32 tensor: this version runs GGUF weights packed; pin the reference versions"
            )
    f = read_gguf(path)
    t = f.tensor("token_embd.weight")
    ours = quants.dequantize(f.tensor_data(t.name), t.ggml_type, t.shape)
    embedding: Any = model.get_input_embeddings()
    theirs = embedding.weight.detach().numpy()
    if theirs.shape != ours.shape or not np.array_equal(theirs, ours):
        raise ReferenceError("transformers' token embedding differs from the file's float32 values")
    return model


def transformers_reference(
    path: str | os.PathLike[str],
    prompt_ids: Sequence[int],
    *,
    max_new_tokens: int = 300,
    stop_ids: Sequence[int] = (),
    model: Any = None,
) -> Reference:
    """Greedy tokens to a stop id or ``max_new_tokens``, then the logits of every position
    from one forward pass over the whole sequence."""
    import torch

    model = model if model is not None else load_transformers(path)
    ids = torch.tensor([list(prompt_ids)])
    with torch.no_grad():
        out = model.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=max_new_tokens,
            do_sample=False,
            eos_token_id=list(stop_ids) or None,
            pad_token_id=(list(stop_ids) or [0])[0],
        )
        tokens = [int(t) for t in out[0]]
        # generate() stops after the first stop id; nothing follows it
        logits = model(torch.tensor([tokens])).logits[0].float().numpy()
    return Reference(tokens, len(prompt_ids), logits, {})
