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
from collections import Counter
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from qllama import quants
from qllama.errors import QllamaError
from qllama.ggml_types import GGMLType
from qllama.gguf.reader import read_gguf
from qllama.measure.compare import Reference
from qllama.runtime.observe import Trace


class ReferenceError(QllamaError):
    """The reference model is not the float32 model it must be."""


# what a reference may hold: a float model (transformers widens F16/BF16 to float32 exactly)
REFERENCE_TYPES = frozenset({GGMLType.F32, GGMLType.F16, GGMLType.BF16})


def quantized_types(path: str | os.PathLike[str]) -> Counter[str]:
    """The file's tensor types that are not a reference's (F32, F16, BF16), with counts."""
    with read_gguf(path) as f:
        return Counter(
            t.ggml_type.name for t in f.tensors.values() if t.ggml_type not in REFERENCE_TYPES
        )


def check_reference_file(path: str | os.PathLike[str]) -> None:
    """Refuse a reference that is missing, not GGUF, or holds quantized weights: a quantized
    file run in float32 is another quantized model, not the f32 control."""
    path = Path(path)
    if not path.is_file():
        raise ReferenceError(f"the reference {path} does not exist (or is not a file)")
    quantized = quantized_types(path)
    if quantized:
        found = ", ".join(f"{n} {k}" for k, n in quantized.most_common())
        raise ReferenceError(
            f"the reference {path} holds quantized tensors ({found}): a reference is an F32, "
            "F16 or BF16 file (qllama quantize FILE OUT F32 widens one, but the result is that "
            "quantized model, not the original)"
        )


def load_transformers(path: str | os.PathLike[str]) -> Any:
    """The GGUF file as a transformers model: float32, eager attention, CPU, checked."""
    check_reference_file(path)
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


def gguf_row_order(x: np.ndarray, n_head: int) -> np.ndarray:
    """Q or K outputs ``(T, n_head * head_dim)`` in Hugging Face's row order -> the file's.

    convert_hf_to_gguf permutes each head's rows ``(2, head_dim/2) -> (head_dim/2, 2)`` so
    that RoPE can rotate adjacent pairs; transformers undoes it at load. qllama's Q and K are
    in the file's order, so the reference's are permuted the same way to be compared.
    """
    T, width = x.shape
    half = width // n_head // 2
    return x.reshape(T, n_head, 2, half).swapaxes(2, 3).reshape(T, width)  # (T, width)


def qkv_row_order(path: str | os.PathLike[str], model: Any) -> dict[str, int | None]:
    """For Q, K and V: the head count to permute transformers' outputs with
    (:func:`gguf_row_order`), or None where the file keeps transformers' row order.

    The converter permutes Q and K for llama-style RoPE only, so this is read off the weights:
    layer 0's projections in transformers against the file's, equal as they are or permuted.
    """
    cfg = model.config
    attn = model.model.layers[0].self_attn
    heads = {"q": cfg.num_attention_heads, "k": cfg.num_key_value_heads, "v": None}
    order: dict[str, int | None] = {}
    with read_gguf(path) as f:
        for point, n_head in heads.items():
            proj = getattr(attn, f"{point}_proj", None)
            name = f"blk.0.attn_{point}.weight"
            if proj is None or name not in f.tensors:
                raise ReferenceError(
                    f"transformers' attention has no {point}_proj or the file no {name} "
                    "(fused Q/K/V): Q, K and V cannot be traced one by one"
                )
            t = f.tensors[name]
            ours = quants.dequantize(f.tensor_data(name), t.ggml_type, t.shape)
            theirs = proj.weight.detach().float().numpy()  # (width, n_embd)
            if np.array_equal(theirs, ours):
                order[point] = None
            elif n_head is not None and np.array_equal(gguf_row_order(theirs.T, n_head).T, ours):
                order[point] = n_head
            else:
                raise ReferenceError(
                    f"transformers' {point}_proj of layer 0 is not the file's {name} in either "
                    "row order"
                )
    return order


def transformers_trace(
    path: str | os.PathLike[str],
    tokens: Sequence[int],
    *,
    positions: Sequence[int] | None = None,
    qkv: bool = False,
    model: Any = None,
) -> Trace:
    """transformers' values at qllama's observer points (:mod:`qllama.runtime.observe`) and its
    logits, for one forward pass over ``tokens``, kept at ``positions`` (default: all).

    The residual stream comes from ``output_hidden_states`` (the embedding, then each block's
    output; transformers' last entry is after the final norm, so the last block's output comes
    from its hook instead); attention and MLP outputs and Q/K/V from forward hooks on the
    sub-modules, Q and K put in the file's row order (:func:`qkv_row_order`). Where a hook and
    ``hidden_states`` see the same value they must agree exactly, which checks that the hooks
    sit where the names say.
    """
    import torch

    from qllama.runtime.observe import LOGITS, Recorder, block_name, resolve_positions

    model = model if model is not None else load_transformers(path)
    rows = resolve_positions(positions, len(tokens))
    rec = Recorder(rows, qkv=qkv)
    heads = qkv_row_order(path, model) if qkv else {}
    layers = model.model.layers
    hooked: dict[str, Any] = {}

    def keep(name: str, n_head: int | None = None) -> Any:
        def hook(_module: Any, _args: Any, out: Any) -> None:
            value = (out[0] if isinstance(out, tuple) else out)[0].detach().float().numpy()
            if n_head is not None:
                value = gguf_row_order(value, n_head)
            hooked[name] = value

        return hook

    handles = []
    for i, layer in enumerate(layers):
        handles.append(layer.register_forward_hook(keep(block_name(i, "out"))))
        handles.append(layer.self_attn.register_forward_hook(keep(block_name(i, "attn_out"))))
        handles.append(layer.mlp.register_forward_hook(keep(block_name(i, "ffn_out"))))
        if qkv:
            for point, n_head in heads.items():
                proj = getattr(layer.self_attn, f"{point}_proj")
                handles.append(proj.register_forward_hook(keep(block_name(i, point), n_head)))
    try:
        with torch.no_grad():
            out = model(torch.tensor([list(tokens)]), output_hidden_states=True)
    finally:
        for h in handles:
            h.remove()
    states = [s[0].float().numpy() for s in out.hidden_states]
    if len(states) != len(layers) + 1:
        raise ReferenceError(
            f"transformers gave {len(states)} hidden states for {len(layers)} layers"
        )
    for i, state in enumerate(states[1:-1]):
        if not np.array_equal(state, hooked[block_name(i, "out")]):
            raise ReferenceError(f"the hook on layer {i} does not see its hidden state")
    rec("embedding", states[0])
    for name, value in hooked.items():
        rec(name, value)
    rec.keep(LOGITS, out.logits[0].float().numpy())
    return Trace(list(tokens), rows, rec.values, {"source": "transformers", "path": str(path)})
