"""Tiny random transformers models that rotate with YaRN, converted by llama.cpp's
``convert_hf_to_gguf.py`` (``rope.scaling.type = yarn``, ``factor``,
``original_context_length``): gpt-oss (as its real files are), a qwen3moe and a Mixtral (the
adjacent-pair layout), each one of :data:`conformance.moe.MOE_MODELS` with another RoPE.

The original context (64, a quarter of max_position_embeddings: factor 4) puts the ramp
between the correction dims across the first rotated pairs: some pairs extrapolated, some
between, the rest interpolated. transformers truncates the correction dims (``truncate``
true, its default), as ggml always does (gpt-oss's own config says false: qllama follows
ggml, docs/architectures.md). Kept apart from moe.py so that those models' cache keys stay
as they were.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import conformance
from conformance import Built, Spec, moe


def _yarn(theta: float, factor: float, original: int) -> dict[str, Any]:
    return {
        "rope_type": "yarn",
        "rope_theta": theta,
        "factor": factor,
        "original_max_position_embeddings": original,
        "truncate": True,
    }


def _with_rope(name: str, rope: dict[str, Any], **config: Any) -> Spec:
    spec = moe.MOE_MODELS[name]
    config = {**spec.config, **config, "rope_parameters": rope}
    return dataclasses.replace(spec, name=f"{name}-yarn", config=config)


YARN_MODELS: dict[str, Spec] = {
    s.name: s
    for s in (
        _with_rope("gpt-oss", _yarn(10000.0, 4.0, 64)),  # head_dim 16: a ramp over pairs 0-3
        _with_rope("qwen3moe", _yarn(10000.0, 4.0, 64)),  # head_dim 32
        # the llama graph: adjacent pairs; transformers' YaRN needs head_dim set (64 / 4)
        _with_rope("mixtral", _yarn(10000.0, 4.0, 64), head_dim=16),
    )
}


def build(name: str) -> Built:
    """The model ``name`` of :data:`YARN_MODELS`, built and converted once (cached by
    content, this module's code and moe.py's part of the key)."""
    return conformance.build(name, YARN_MODELS, Path(__file__), Path(moe.__file__))
