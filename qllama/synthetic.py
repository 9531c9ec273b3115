"""Tiny random GGUF files of every architecture, written by qllama itself, for fast tests.

The files have every piece a real one has (hyperparameters, a vocabulary with special tokens,
a chat template, tied or separate output) at a size that loads in milliseconds. The vocabulary
is byte-level BPE with merges (``gpt2``, as SmolLM2's) or SentencePiece-style with scores and
``<0xXX>`` byte tokens (``llama``, as Llama 2's). Weights are random normal, seeded, so tests
are reproducible.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

import numpy as np

from qllama import quants
from qllama.ggml_types import GGMLType, ValueType
from qllama.gguf.reader import GGUFValue
from qllama.gguf.writer import GGUFWriter
from qllama.runtime.architectures import ExpertWidth, SharedExpert, architecture
from qllama.runtime.config import ModelConfig

CHAT_TEMPLATE = (
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\nYou are a helpful AI assistant.<|im_end|>\n' }}{% endif %}"
    "{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
MERGES = ["Ġ t", "Ġ a", "i n", "h e", "r e", "o n", "Ġt he", "e r", "Ġ s", "a t"]


@dataclass(frozen=True)
class TinyConfig:
    """Shape of a synthetic model. Defaults: a llama, 2 layers, 64 wide, GQA 4:2, tied output.

    ``arch`` is any of :data:`qllama.runtime.architectures.ARCHITECTURES`; the tensors written are
    the ones its declaration lists (the optional ones as asked: ``biases``, ``rope_freqs``,
    ``fused_qkv``), so a tiny file of each family has exactly what a converted one has.
    """

    n_layer: int = 2
    n_embd: int = 64
    n_ff: int = 128
    n_head: int = 4
    n_head_kv: int = 2
    n_ctx: int = 256
    rope_base: float = 10000.0
    eps: float = 1e-5
    tied: bool = True
    weight_type: str = "F32"  # type of the 2-D weights
    scale: float = 0.1  # std of the random weights
    vocab: str = "gpt2"  # "gpt2" (byte-level BPE) or "llama" (SentencePiece-style)
    arch: str = "llama"
    head_dim: int = 0  # attention.key_length (0: n_embd / n_head, and no key written)
    n_rot: int = 0  # rope.dimension_count (0: head_dim)
    sliding_window: int = 0  # attention.sliding_window (0: not written)
    biases: bool = False  # the optional biases of the architecture
    rope_freqs: bool = False  # a rope_freqs.weight (Llama 3.1 style), where the family has one
    fused_qkv: bool = False  # attn_qkv instead of attn_q/k/v (phi3 always)
    extra_keys: tuple[tuple[str, Any], ...] = ()  # more {arch}.* keys, e.g. softcaps
    # a mixture of experts (the families with experts; llama: Mixtral); 0 experts: dense
    n_expert: int = 0  # expert_count
    n_expert_used: int = 2  # expert_used_count (written with expert_count)
    n_ff_exp: int = 0  # expert_feed_forward_length (0: not written; the family's default)
    n_ff_shexp: int = 0  # expert_shared_feed_forward_length (0: not written)


def byte_tokens() -> list[str]:
    """GPT-2's printable stand-ins for the 256 byte values, in byte order."""
    printable = [
        *range(ord("!"), ord("~") + 1),
        *range(ord("¡"), ord("¬") + 1),
        *range(ord("®"), ord("ÿ") + 1),
    ]
    table, extra = {}, 0
    for b in range(256):
        if b in printable:
            table[b] = chr(b)
        else:
            table[b] = chr(256 + extra)
            extra += 1
    return [table[b] for b in range(256)]


def vocabulary() -> tuple[list[str], list[int], list[str]]:
    """Tokens, token types and merges of the synthetic byte-level BPE."""
    tokens = list(SPECIAL_TOKENS) + byte_tokens()
    for merge in MERGES:
        tokens.append(merge.replace(" ", ""))
    types = [3] * len(SPECIAL_TOKENS) + [1] * (
        len(tokens) - len(SPECIAL_TOKENS)
    )  # 3 control, 1 normal
    return tokens, types, list(MERGES)


# SentencePiece-style pieces, best first; each joins two other tokens (a piece or a character)
LLAMA_PIECES = [
    "▁t", "he", "▁a", "in", "er", "▁the", "on", "re", "at", "▁s", "en", "▁w", "or", "is", "an",
    "▁c", "ou", "it", "es", "▁h", "ing", "ed", "▁o", "▁th", "ar", "▁b", "▁f", "▁to", "▁in",
    "▁is", "▁m", "▁p", "▁wor", "ld", "▁world", "▁H", "▁He", "ll", "llo", "▁Hello", "o,", "▁1",
    "▁12", "▁世", "▁世界",
]  # fmt: skip
LLAMA_CHARS = [
    *"▁abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789.,!?'\"-:;()[]{}<>/|=+*#\n",
    *"世界é",
]
LLAMA_SPECIALS = [("<unk>", 2), ("<s>", 3), ("</s>", 3), ("<|im_start|>", 3), ("<|im_end|>", 3)]
LLAMA_USER_DEFINED = ["<tool>"]


def llama_vocabulary() -> tuple[list[str], list[float], list[int]]:
    """Tokens, scores and token types of the synthetic SentencePiece-style vocabulary.

    Layout as in Llama 2: ``<unk>`` (0), ``<s>`` (1), ``</s>`` (2), then the 256 byte tokens
    ``<0x00>``..``<0xFF>``, chat and user-defined tokens, single characters and merged pieces.
    Scores fall with rank; special and byte tokens score 0.
    """
    tokens = [t for t, _ in LLAMA_SPECIALS[:3]] + [f"<0x{b:02X}>" for b in range(256)]
    types = [k for _, k in LLAMA_SPECIALS[:3]] + [6] * 256  # 6 byte
    tokens += [t for t, _ in LLAMA_SPECIALS[3:]] + LLAMA_USER_DEFINED
    types += [k for _, k in LLAMA_SPECIALS[3:]] + [4] * len(LLAMA_USER_DEFINED)  # 4 user-defined
    scores = [0.0] * len(tokens)
    for rank, piece in enumerate(LLAMA_PIECES + LLAMA_CHARS):
        tokens.append(piece)
        types.append(1)
        scores.append(-float(rank))
    return tokens, scores, types


def _vocabulary_metadata(kind: str) -> dict[str, Any]:
    """The ``tokenizer.*`` keys of a synthetic vocabulary of kind ``gpt2`` or ``llama``."""
    u32 = lambda v: GGUFValue(ValueType.UINT32, v)  # noqa: E731
    if kind == "gpt2":
        tokens, types, merges = vocabulary()
        return {
            "tokenizer.ggml.model": "gpt2",
            "tokenizer.ggml.pre": "smollm",
            "tokenizer.ggml.tokens": tokens,
            "tokenizer.ggml.token_type": np.array(types, np.int32),
            "tokenizer.ggml.merges": merges,
            "tokenizer.ggml.bos_token_id": u32(1),
            "tokenizer.ggml.eos_token_id": u32(2),
            "tokenizer.ggml.unknown_token_id": u32(0),
            "tokenizer.ggml.padding_token_id": u32(2),
            "tokenizer.ggml.add_bos_token": False,
            "tokenizer.chat_template": CHAT_TEMPLATE,
        }
    if kind == "llama":
        tokens, scores, types = llama_vocabulary()
        return {
            "tokenizer.ggml.model": "llama",
            "tokenizer.ggml.tokens": tokens,
            "tokenizer.ggml.scores": np.array(scores, np.float32),
            "tokenizer.ggml.token_type": np.array(types, np.int32),
            "tokenizer.ggml.bos_token_id": u32(1),
            "tokenizer.ggml.eos_token_id": u32(2),
            "tokenizer.ggml.unknown_token_id": u32(0),
            "tokenizer.ggml.add_bos_token": True,
            "tokenizer.ggml.add_space_prefix": True,
            "tokenizer.chat_template": CHAT_TEMPLATE,
        }
    raise ValueError(f"unknown synthetic vocabulary {kind!r} (known: 'gpt2', 'llama')")


def expert_widths(cfg: TinyConfig) -> tuple[int, int, int, int]:
    """n_expert, n_expert_used, n_ff_exp and n_ff_shexp as qllama reads them back (the
    family's defaults where ``cfg`` writes no key; zeros for a dense model)."""
    e = architecture(cfg.arch).experts
    if e is None or not cfg.n_expert:
        return 0, 0, 0, 0
    width = (
        cfg.n_ff if e.width == ExpertWidth.FFN else cfg.n_ff_exp or cfg.n_ff // cfg.n_expert_used
    )
    shared = cfg.n_ff_shexp or (cfg.n_ff if e.shared == SharedExpert.GATED else 0)
    return cfg.n_expert, cfg.n_expert_used, width, shared


# the router is float32 in every converted file: the converter forces it, llama-quantize
# never quantizes it (moe_kv_recipes.md 1.2)
F32_WEIGHTS = ("ffn_gate_inp.weight",)


def model_config(cfg: TinyConfig, n_vocab: int) -> ModelConfig:
    """The config qllama reads back from the file (enough of it for the tensor shapes)."""
    n_expert, used, width, shared = expert_widths(cfg)
    return ModelConfig(
        n_vocab=n_vocab,
        n_embd=cfg.n_embd,
        n_layer=cfg.n_layer,
        n_head=cfg.n_head,
        n_head_kv=cfg.n_head_kv,
        n_ff=cfg.n_ff,
        n_ctx=cfg.n_ctx,
        rope_base=cfg.rope_base,
        eps=cfg.eps,
        arch=cfg.arch,
        key_length=cfg.head_dim,
        value_length=cfg.head_dim,
        n_rot=cfg.n_rot,
        n_expert=n_expert,
        n_expert_used=used,
        n_ff_exp=width,
        n_ff_shexp=shared,
    )


def tensor_shapes(cfg: TinyConfig, n_vocab: int) -> dict[str, tuple[int, ...]]:
    """Every tensor of the model, numpy order (rows last), in GGUF naming: the required
    tensors of the architecture and the optional ones ``cfg`` asks for."""
    a = architecture(cfg.arch)
    c = model_config(cfg, n_vocab)
    fused = cfg.fused_qkv if a.fused_qkv is None else a.fused_qkv
    # output.bias (qwen2 allows one) is left out: no converter writes it
    wanted = {
        "output.weight": not cfg.tied,
        "rope_freqs.weight": cfg.rope_freqs,
        "output.bias": False,
    }
    shapes = {}
    for t in a.tensors(c, fused_qkv=fused):
        keep = wanted.get(t.name, cfg.biases and t.name.endswith(".bias"))
        if t.required or keep:
            shapes[t.name] = t.shape(c)
    return shapes


def write_tiny(
    path: str | os.PathLike[str], cfg: TinyConfig = TinyConfig(), *, seed: int = 0
) -> None:
    """Write a random tiny GGUF of ``cfg.arch`` to ``path``."""
    rng = np.random.default_rng(seed)
    vocab_meta = _vocabulary_metadata(cfg.vocab)
    n_vocab = len(vocab_meta["tokenizer.ggml.tokens"])
    w = GGUFWriter()
    u32 = lambda v: GGUFValue(ValueType.UINT32, v)  # noqa: E731
    f32 = lambda v: GGUFValue(ValueType.FLOAT32, v)  # noqa: E731
    a = cfg.arch
    head_dim = cfg.head_dim or cfg.n_embd // cfg.n_head
    meta: dict[str, Any] = {
        "general.architecture": a,
        "general.name": f"qllama tiny synthetic {a}",
        f"{a}.block_count": u32(cfg.n_layer),
        f"{a}.context_length": u32(cfg.n_ctx),
        f"{a}.embedding_length": u32(cfg.n_embd),
        f"{a}.feed_forward_length": u32(cfg.n_ff),
        f"{a}.attention.head_count": u32(cfg.n_head),
        f"{a}.attention.head_count_kv": u32(cfg.n_head_kv),
        f"{a}.rope.freq_base": f32(cfg.rope_base),
        f"{a}.attention.layer_norm_rms_epsilon": f32(cfg.eps),
        f"{a}.rope.dimension_count": u32(cfg.n_rot or head_dim),
        f"{a}.vocab_size": u32(n_vocab),
    }
    if cfg.head_dim:
        meta[f"{a}.attention.key_length"] = u32(cfg.head_dim)
        meta[f"{a}.attention.value_length"] = u32(cfg.head_dim)
    if cfg.sliding_window:
        meta[f"{a}.attention.sliding_window"] = u32(cfg.sliding_window)
    if architecture(a).scales_logits_and_residuals:
        meta[f"{a}.logit_scale"] = f32(2.0)
    if cfg.n_expert:
        meta[f"{a}.expert_count"] = u32(cfg.n_expert)
        meta[f"{a}.expert_used_count"] = u32(cfg.n_expert_used)
    if cfg.n_ff_exp:
        meta[f"{a}.expert_feed_forward_length"] = u32(cfg.n_ff_exp)
    if cfg.n_ff_shexp:
        meta[f"{a}.expert_shared_feed_forward_length"] = u32(cfg.n_ff_shexp)
    meta |= {f"{a}.{k}": v for k, v in cfg.extra_keys}
    for k, v in {**meta, **vocab_meta}.items():
        w.add(k, v)
    for name, shape in tensor_shapes(cfg, n_vocab).items():
        if len(shape) == 1 or name.endswith(".bias"):  # float vectors (and experts' biases)
            w.add_tensor(name, _vector(name, shape, rng, cfg.scale), GGMLType.F32)
            continue
        x = (cfg.scale * rng.standard_normal(shape)).astype(np.float32)
        kind = "F32" if name.endswith(F32_WEIGHTS) else cfg.weight_type
        # the types ggml writes only with an importance matrix (IQ2_XXS, IQ2_XS, IQ1_S) get
        # a flat one: every column alike, as the random weights are
        flat = (
            np.ones(shape[-1], np.float32) if quants.get(kind).imatrix_use == "required" else None
        )
        w.add_tensor(name, quants.quantize(x, kind, imatrix=flat), kind, shape)
    w.write(path)


def _vector(
    name: str, shape: tuple[int, ...], rng: np.random.Generator, scale: float
) -> np.ndarray:
    """A 1-D tensor: norms near 1 (as trained models have them), biases near 0, RoPE
    factors between 1 and 8 (as Llama 3.1's), a shared expert's gate vector as a weight."""
    if name == "rope_freqs.weight":
        return np.linspace(1.0, 8.0, shape[0], dtype=np.float32)
    if name.endswith("ffn_gate_inp_shexp.weight"):
        return (scale * rng.standard_normal(shape)).astype(np.float32)
    if name.endswith(".bias"):
        return (0.1 * rng.standard_normal(shape)).astype(np.float32)
    return (1 + 0.1 * rng.standard_normal(shape)).astype(np.float32)


def write_tiny_llama(
    path: str | os.PathLike[str], cfg: TinyConfig = TinyConfig(), *, seed: int = 0
) -> None:
    """Write a random tiny GGUF (a llama unless ``cfg.arch`` says otherwise) to ``path``."""
    write_tiny(path, cfg, seed=seed)
