"""Tiny random transformers models of the families with experts, converted by llama.cpp's
``convert_hf_to_gguf.py`` as the dense ones are (:mod:`conformance`): 4 experts, top-2, three
layers, every layer a mixture.

Kept apart from :data:`conformance.MODELS` so that the peers suite (which runs llama.cpp on
every model there) and the dense models' cache keys stay as they were. The Qwen and OLMoE
converters read a BPE ``tokenizer.json`` only: those models take llama.cpp's GPT-2
vocabulary, as olmo2's does.
"""

from __future__ import annotations

from pathlib import Path

import conformance
from conformance import _BASE, Built, Spec

_EXPERTS = {"num_experts_per_tok": 2}
_GPT2 = {"vocab_size": 50257}
_GRANITE = {
    "embedding_multiplier": 2.0,
    "residual_multiplier": 0.5,
    "attention_multiplier": 0.2,
    "logits_scaling": 2.0,  # logits of a few units, not flat
}

MOE_MODELS: dict[str, Spec] = {
    s.name: s
    for s in (
        Spec(
            "qwen3moe",  # head_dim 32 != 64 / 4; the top-k weights normalised
            "Qwen3MoeConfig",
            "qwen3moe",
            {
                **_BASE,
                **_EXPERTS,
                **_GPT2,
                "head_dim": 32,
                "num_experts": 4,
                "moe_intermediate_size": 32,
                "norm_topk_prob": True,
                "use_sliding_window": False,
            },
            "Qwen-Qwen3-0.6B.jinja",
            vocab="gpt-2",
        ),
        Spec(
            "qwen2moe",  # q/k/v biases, a gated shared expert, the weights not normalised
            "Qwen2MoeConfig",
            "qwen2moe",
            {
                **_BASE,
                **_EXPERTS,
                **_GPT2,
                "num_experts": 4,
                "moe_intermediate_size": 32,
                "shared_expert_intermediate_size": 64,
                "norm_topk_prob": False,
                "use_sliding_window": False,
            },
            "Qwen-Qwen2.5-7B-Instruct.jinja",
            vocab="gpt-2",
        ),
        Spec(
            "mixtral",  # the converter writes a llama file with llama.expert_count
            "MixtralConfig",
            "llama",
            {**_BASE, **_EXPERTS, "num_local_experts": 4, "sliding_window": None},
            "mistralai-Mistral-Nemo-Instruct-2407.jinja",
        ),
        Spec(
            # q/k norms over the whole projection; the converter writes an RMSNorm epsilon of
            # 1e-5 whatever the config says, so the model has that one
            "olmoe",
            "OlmoeConfig",
            "olmoe",
            {
                **_BASE,
                **_EXPERTS,
                **_GPT2,
                "rms_norm_eps": 1e-5,
                "num_key_value_heads": 4,
                "num_experts": 4,
                "norm_topk_prob": False,
            },
            vocab="gpt-2",
        ),
        Spec(
            "granitemoe",
            "GraniteMoeConfig",
            "granitemoe",
            {**_BASE, **_EXPERTS, **_GRANITE, "num_local_experts": 4},
            "ibm-granite-granite-3.3-2B-Instruct.jinja",
        ),
        Spec(
            "granitemoeshared",  # the converter writes granitemoe with an ungated shared expert
            "GraniteMoeSharedConfig",
            "granitemoe",
            {
                **_BASE,
                **_EXPERTS,
                **_GRANITE,
                "num_local_experts": 4,
                "shared_intermediate_size": 64,
            },
            "ibm-granite-granite-3.3-2B-Instruct.jinja",
        ),
        Spec(
            # attention sinks, even layers sliding (window 8), biased router and experts,
            # the clamped SwiGLU; no YaRN (qllama refuses it), so the default rotation
            "gpt-oss",
            "GptOssConfig",
            "gpt-oss",
            {
                **_BASE,
                **_EXPERTS,
                **_GPT2,
                "intermediate_size": 32,
                "head_dim": 16,
                "num_local_experts": 4,
                "sliding_window": 8,
                "rope_parameters": {"rope_type": "default", "rope_theta": 150000.0},
            },
            vocab="gpt-2",
        ),
    )
}


def build(name: str) -> Built:
    """The model ``name`` of :data:`MOE_MODELS`, built and converted once (cached by content,
    this module's code part of the key)."""
    return conformance.build(name, MOE_MODELS, Path(__file__))
