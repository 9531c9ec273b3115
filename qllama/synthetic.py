"""Tiny random llama GGUF files, written by qllama itself, for fast tests and examples.

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
from qllama.gguf_reader import GGUFValue
from qllama.gguf_writer import GGUFWriter

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
    """Shape of a synthetic llama. Defaults: 2 layers, 64 wide, GQA 4:2, tied output."""

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


def tensor_shapes(cfg: TinyConfig, n_vocab: int) -> dict[str, tuple[int, ...]]:
    """Every tensor of the model, numpy order (rows last), in GGUF naming."""
    head_dim = cfg.n_embd // cfg.n_head
    shapes: dict[str, tuple[int, ...]] = {"token_embd.weight": (n_vocab, cfg.n_embd)}
    for i in range(cfg.n_layer):
        b = f"blk.{i}."
        shapes |= {
            b + "attn_norm.weight": (cfg.n_embd,),
            b + "attn_q.weight": (cfg.n_head * head_dim, cfg.n_embd),
            b + "attn_k.weight": (cfg.n_head_kv * head_dim, cfg.n_embd),
            b + "attn_v.weight": (cfg.n_head_kv * head_dim, cfg.n_embd),
            b + "attn_output.weight": (cfg.n_embd, cfg.n_head * head_dim),
            b + "ffn_norm.weight": (cfg.n_embd,),
            b + "ffn_gate.weight": (cfg.n_ff, cfg.n_embd),
            b + "ffn_up.weight": (cfg.n_ff, cfg.n_embd),
            b + "ffn_down.weight": (cfg.n_embd, cfg.n_ff),
        }
    shapes["output_norm.weight"] = (cfg.n_embd,)
    if not cfg.tied:
        shapes["output.weight"] = (n_vocab, cfg.n_embd)
    return shapes


def write_tiny_llama(
    path: str | os.PathLike[str], cfg: TinyConfig = TinyConfig(), *, seed: int = 0
) -> None:
    """Write a random tiny llama GGUF to ``path``."""
    rng = np.random.default_rng(seed)
    vocab_meta = _vocabulary_metadata(cfg.vocab)
    n_vocab = len(vocab_meta["tokenizer.ggml.tokens"])
    w = GGUFWriter()
    u32 = lambda v: GGUFValue(ValueType.UINT32, v)  # noqa: E731
    f32 = lambda v: GGUFValue(ValueType.FLOAT32, v)  # noqa: E731
    meta = {
        "general.architecture": "llama",
        "general.name": "qllama tiny synthetic llama",
        "llama.block_count": u32(cfg.n_layer),
        "llama.context_length": u32(cfg.n_ctx),
        "llama.embedding_length": u32(cfg.n_embd),
        "llama.feed_forward_length": u32(cfg.n_ff),
        "llama.attention.head_count": u32(cfg.n_head),
        "llama.attention.head_count_kv": u32(cfg.n_head_kv),
        "llama.rope.freq_base": f32(cfg.rope_base),
        "llama.attention.layer_norm_rms_epsilon": f32(cfg.eps),
        "llama.rope.dimension_count": u32(cfg.n_embd // cfg.n_head),
        "llama.vocab_size": u32(n_vocab),
        **vocab_meta,
    }
    for k, v in meta.items():
        w.add(k, v)
    for name, shape in tensor_shapes(cfg, n_vocab).items():
        if len(shape) == 1:  # norms: near 1, as trained models have them
            w.add_tensor(
                name, (1 + 0.1 * rng.standard_normal(shape)).astype(np.float32), GGMLType.F32
            )
            continue
        x = (cfg.scale * rng.standard_normal(shape)).astype(np.float32)
        w.add_tensor(name, quants.quantize(x, cfg.weight_type), cfg.weight_type, shape)
    w.write(path)
