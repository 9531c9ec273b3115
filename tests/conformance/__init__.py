"""Tiny random transformers models of every architecture, converted by llama.cpp's own
``convert_hf_to_gguf.py``: the files a port is proven on.

For each family (:data:`MODELS`) a small random model is built with transformers'
``from_config`` (a few layers; widths that exercise grouped-query attention and a head
dimension other than n_embd / n_head where the family allows it; a sliding window shorter than
the test sequences; RoPE scaling where the family has it), given random weights large enough
that the logits are far from flat, and saved with ``save_pretrained``. Its tokenizer is a tiny
SentencePiece model trained offline (:func:`tokenizer_model`), with the family's chat tokens
as user-defined symbols (special tokens of the saved tokenizer) and its chat template. The
converter (from the llama-cpp-python sdist: tests/conformance/sources.py) writes the F32 GGUF.

Everything is built once per content key (:func:`key`: the spec, the seed, this file, the
converter's version, the versions of the packages that write the files) into the qllama cache
(``conformance/<name>-<key>``), atomically; nothing is committed. A build takes 15 to 30 s;
a cached model is found in milliseconds.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass, field
from importlib import metadata
from pathlib import Path
from typing import Any

from conformance.sources import llama_cpp_source

ROOT = Path(__file__).resolve().parents[2]
SEED = 0
SEQ = 64  # tokens of every comparison: longer than the windows, long enough for RoPE to matter
N_VOCAB = 384

# The special tokens of the families' chat templates (Llama 3, ChatML, Gemma, Phi-3, Mistral).
# They are user-defined symbols of the SentencePiece model (ids 3, 4, ...: whole pieces, never
# split) and special tokens of the saved tokenizer (added_tokens_decoder), so the converter
# types them CONTROL, as in the families' real vocabularies, and both tokenizers parse them in
# a rendered prompt as one token each.
CHAT_TOKENS = [
    "<|begin_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>",
    "<|im_start|>", "<|im_end|>", "<start_of_turn>", "<end_of_turn>",
    "<|user|>", "<|assistant|>", "<|system|>", "<|end|>", "[INST]", "[/INST]",
]  # fmt: skip
FIRST_CHAT_TOKEN = 3  # after <unk> <s> </s>


@dataclass(frozen=True)
class Spec:
    """One conformance model: the transformers config class, its arguments, the GGUF
    architecture the converter must write, and the chat template of the family."""

    name: str
    config_class: str
    arch: str
    config: dict[str, Any]
    template: str | None = None  # llama.cpp's models/templates/<template>
    norm_offset: float = 1.0  # random norm weights are offset + N(0, 0.1): gemma stores w, not 1+w
    # "spm": the tiny SentencePiece model; a llama.cpp vocabulary name (models/ggml-vocab-*)
    # for converters that only read a BPE tokenizer.json (olmo2): transformers builds it
    vocab: str = "spm"
    notes: str = ""
    extra: dict[str, Any] = field(default_factory=dict)


_BASE = dict(
    vocab_size=N_VOCAB,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=256,
    rms_norm_eps=1e-6,
    tie_word_embeddings=False,
)

MODELS: dict[str, Spec] = {
    s.name: s
    for s in (
        Spec("llama", "LlamaConfig", "llama", {**_BASE}, "meta-llama-Llama-3.1-8B-Instruct.jinja"),
        Spec(
            # rows of 256 and 512: the K-quant file types hold K-quants (Q4_K, Q5_K, Q6_K...), whose
            # activations are quantized to Q8_K; the 64-wide models' rows fall back to Q5_0 / Q8_0
            "llama-kquant",
            "LlamaConfig",
            "llama",
            {**_BASE, "hidden_size": 256, "intermediate_size": 512},
            "meta-llama-Llama-3.1-8B-Instruct.jinja",
        ),
        Spec(
            "llama3-rope",  # Llama 3.1/3.2: the converter writes rope_freqs.weight
            "LlamaConfig",
            "llama",
            {
                **_BASE,
                "tie_word_embeddings": True,
                "rope_parameters": {
                    "rope_type": "llama3",
                    "rope_theta": 500000.0,
                    "factor": 8.0,
                    "low_freq_factor": 1.0,
                    "high_freq_factor": 4.0,
                    "original_max_position_embeddings": 32,
                },
            },
            "meta-llama-Llama-3.2-3B-Instruct.jinja",
        ),
        Spec(
            "mistral-nemo",  # head_dim 24 != 64 / 4 (Mistral Nemo's key_length)
            "MistralConfig",
            "llama",
            {**_BASE, "head_dim": 24, "sliding_window": None},
            "mistralai-Mistral-Nemo-Instruct-2407.jinja",
        ),
        Spec(
            "qwen2",
            "Qwen2Config",
            "qwen2",
            {**_BASE, "tie_word_embeddings": True, "use_sliding_window": False},
            "Qwen-Qwen2.5-7B-Instruct.jinja",
        ),
        Spec(
            "qwen3",  # head_dim 32 != 64 / 4, per-head q/k norms
            "Qwen3Config",
            "qwen3",
            {**_BASE, "head_dim": 32, "use_sliding_window": False},
            "Qwen-Qwen3-0.6B.jinja",
        ),
        Spec(
            "phi3",  # fused qkv and gate_up, partial rotary (12 of 16 dimensions)
            "Phi3Config",
            "phi3",
            {**_BASE, "partial_rotary_factor": 0.75, "sliding_window": None, "pad_token_id": 0},
            "microsoft-Phi-3.5-mini-instruct.jinja",
        ),
        Spec(
            "gemma2",  # window 8 on even layers, soft-caps, GeGLU, sandwich norms
            "Gemma2Config",
            "gemma2",
            {
                **_BASE,
                "num_hidden_layers": 4,
                "head_dim": 32,
                "query_pre_attn_scalar": 32,
                "sliding_window": 8,
                "tie_word_embeddings": True,
                "hidden_activation": "gelu_pytorch_tanh",
            },
            "google-gemma-2-2b-it.jinja",
            norm_offset=0.0,
        ),
        Spec(
            "gemma3",  # 5 of 6 layers slide (window 8, base 1e4), global base 1e6 with linear x8
            "Gemma3TextConfig",
            "gemma3",
            {
                **_BASE,
                "num_hidden_layers": 6,
                "head_dim": 32,
                "query_pre_attn_scalar": 32,
                "sliding_window": 8,
                "tie_word_embeddings": True,
                "hidden_activation": "gelu_pytorch_tanh",
                "rope_parameters": {
                    "full_attention": {
                        "rope_type": "linear",
                        "factor": 8.0,
                        "rope_theta": 1000000.0,
                    },
                    "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                },
            },
            "google-gemma-2-2b-it.jinja",
            norm_offset=0.0,
        ),
        Spec(
            "granite",
            "GraniteConfig",
            "granite",
            {
                **_BASE,
                "embedding_multiplier": 2.0,
                "residual_multiplier": 0.5,
                "attention_multiplier": 0.2,
                "logits_scaling": 4.0,
            },
            "ibm-granite-granite-3.3-2B-Instruct.jinja",
        ),
        Spec("olmo2", "Olmo2Config", "olmo2", {**_BASE, "vocab_size": 50257}, vocab="gpt-2"),
        Spec(
            "smollm3",  # layer 3 of 4 skips RoPE
            "SmolLM3Config",
            "smollm3",
            {**_BASE, "num_hidden_layers": 4, "tie_word_embeddings": True, "pad_token_id": 0},
            "HuggingFaceTB-SmolLM3-3B.jinja",
        ),
    )
}


def cache_root() -> Path:
    from qllama.defaults import cache_dir

    return cache_dir() / "conformance"


def llama_cpp_version() -> str:
    """The llama-cpp-python version whose converter writes the files (tools/llama_cpp_build.py)."""
    text = (ROOT / "tools" / "llama_cpp_build.py").read_text()
    match = re.search(r'^VERSION = "([^"]+)"', text, re.MULTILINE)
    assert match is not None, "tools/llama_cpp_build.py names no VERSION"
    return match.group(1)


BUILDERS = ("transformers", "torch", "sentencepiece", "safetensors")  # what writes the files


def key(spec: Spec, *builders: Path) -> str:
    """The content key of a built model: the spec, the seed, this builder's code (and that of
    ``builders``, modules declaring more models), the converter's version and the versions of
    the packages that write the files. The runners (tests/conformance/runners.py) are not part
    of it: changing them rebuilds nothing."""
    versions = {name: metadata.version(name) for name in BUILDERS}
    text = json.dumps([dataclasses.asdict(spec), SEED, llama_cpp_version(), versions])
    text += Path(__file__).read_text() + "".join(p.read_text() for p in builders)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def corpus() -> str:
    """Text to train the SentencePiece model on (English, code, digits, other scripts)."""
    words = (
        "the cache holds lines of memory near the core so that a load finds its data fast "
        "when a miss happens the line is fetched from the next level and an old line leaves "
        "def main(): return 42 print('hello, world') x = [1, 2, 3] # numbers 3.14159 2048 "
        "Привет мир 你好世界 こんにちは Ünïcødé ça va déjà vu"
    ).split()
    lines = [" ".join(words[i : i + 9]) for i in range(0, len(words), 3)]
    return "\n".join(lines * 20)


def tokenizer_model(folder: Path) -> Path:
    """A tiny SentencePiece BPE model (byte fallback, the chat tokens as user-defined
    symbols), trained offline: ``folder/tokenizer.model``."""
    import sentencepiece as spm

    text = folder / "corpus.txt"
    text.write_text(corpus(), encoding="utf-8")
    spm.SentencePieceTrainer.train(
        input=str(text),
        model_prefix=str(folder / "tokenizer"),
        model_type="bpe",
        vocab_size=N_VOCAB,
        byte_fallback=True,
        user_defined_symbols=CHAT_TOKENS,
        character_coverage=1.0,
        bos_id=1,
        eos_id=2,
        unk_id=0,
        pad_id=-1,
        minloglevel=2,
        num_threads=1,
    )
    text.unlink()
    (folder / "tokenizer.vocab").unlink()
    return folder / "tokenizer.model"


def randomize(model: Any, spec: Spec, seed: int) -> None:
    """Weights of a size that makes the logits far from flat: N(0, 1/sqrt(fan_in)) for
    matrices (x3 for the embedding), norms near 1 as stored by the family."""
    import torch

    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in sorted(model.named_parameters()):
            if p.ndim == 1:
                if "norm" in name:
                    p.copy_(spec.norm_offset + 0.1 * torch.randn(p.shape, generator=g))
                else:  # biases
                    p.copy_(0.1 * torch.randn(p.shape, generator=g))
            else:
                std = (3.0 if "embed" in name else 1.0) / p.shape[1] ** 0.5
                p.copy_(std * torch.randn(p.shape, generator=g))


def build_hf(spec: Spec, folder: Path) -> None:
    """The transformers model and its tokenizer, saved in ``folder``."""
    import torch
    import transformers

    torch.manual_seed(SEED)
    config = getattr(transformers, spec.config_class)(**spec.config, bos_token_id=1, eos_token_id=2)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    randomize(model, spec, SEED)
    model.save_pretrained(folder)
    if spec.vocab != "spm":
        vocab = llama_cpp_source() / "models"
        tok = transformers.AutoTokenizer.from_pretrained(
            vocab, gguf_file=f"ggml-vocab-{spec.vocab}.gguf"
        )
        tok.save_pretrained(folder)
        return
    tokenizer_model(folder)
    tok_config: dict[str, Any] = {
        "tokenizer_class": "LlamaTokenizer",  # phi3's converter reads it
        "bos_token": "<s>",
        "eos_token": "</s>",
        "unk_token": "<unk>",
        "add_bos_token": True,
        "add_eos_token": False,
        "model_max_length": spec.config["max_position_embeddings"],
        "added_tokens_decoder": {
            str(FIRST_CHAT_TOKEN + i): {
                "content": t,
                "special": True,
                "lstrip": False,
                "rstrip": False,
                "normalized": False,
                "single_word": False,
            }
            for i, t in enumerate(CHAT_TOKENS)
        },
    }
    if spec.template is not None:
        tok_config["chat_template"] = (
            llama_cpp_source() / "models" / "templates" / spec.template
        ).read_text()
    (folder / "tokenizer_config.json").write_text(json.dumps(tok_config, indent=1))


def convert(hf: Path, out: Path) -> None:
    """llama.cpp's converter, F32, with its own gguf-py first on the path."""
    src = llama_cpp_source()
    env = {**os.environ, "PYTHONPATH": str(src / "gguf-py"), "NO_LOCAL_GGUF": ""}
    script = str(src / "convert_hf_to_gguf.py")
    proc = subprocess.run(
        [sys.executable, script, str(hf), "--outfile", str(out), "--outtype", "f32"],
        capture_output=True,
        text=True,
        env=env,
    )
    if proc.returncode != 0:
        raise RuntimeError(f"convert_hf_to_gguf.py failed on {hf.name}:\n{proc.stderr[-4000:]}")


@dataclass(frozen=True)
class Built:
    spec: Spec
    hf: Path  # save_pretrained folder
    gguf: Path  # the converter's F32 file

    def ids(self, n: int = SEQ, seed: int = 1) -> list[int]:
        """A fixed random token sequence (BOS first), avoiding the chat tokens."""
        import numpy as np

        rng = np.random.default_rng(seed)
        first = FIRST_CHAT_TOKEN + len(CHAT_TOKENS) + 256  # past the chat tokens and the bytes
        return [1, *rng.integers(first, self.spec.config["vocab_size"], n - 1).tolist()]


# Keys that llama.cpp's converter writes today and that files converted earlier can lack: such
# a file runs in llama.cpp with the family's fallback (docs/architectures.md, "Keys a file may
# lack"), and so must it in qllama. Users download such files; these families' conformance
# models are also compared without them.
OLDER_CONVERTERS: dict[str, tuple[str, ...]] = {
    # gemma3 files converted before the converter wrote the key: llama-hparams.h's 10000
    "gemma3": ("gemma3.rope.freq_base_swa",),
    # the vocabulary's size: the tokenizer's token count (llama's load_arch_hparams)
    "llama": ("llama.vocab_size",),
}


def as_older_converter(built: Built) -> Path:
    """The converter's file without the keys of :data:`OLDER_CONVERTERS` (every tensor byte
    for byte the same), written once beside it."""
    from qllama.gguf.writer import rewrite

    out = built.gguf.with_name("model-f32-older.gguf")
    if not out.exists():
        rewrite(built.gguf, out, drop=OLDER_CONVERTERS[built.spec.name])
    return out


def build(name: str, models: dict[str, Spec] | None = None, *builders: Path) -> Built:
    """The model ``name`` of :data:`MODELS` (or of ``models``, declared in the modules
    ``builders``), built and converted once (cached by content)."""
    spec = (MODELS if models is None else models)[name]
    final = cache_root() / f"{name}-{key(spec, *builders)}"
    if not (final / "model-f32.gguf").exists():
        final.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(dir=final.parent, prefix=f".{name}-"))
        try:
            build_hf(spec, tmp / "hf")
            convert(tmp / "hf", tmp / "model-f32.gguf")
            try:
                tmp.rename(final)
            except OSError:  # a concurrent builder won
                shutil.rmtree(tmp, ignore_errors=True)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
    return Built(spec, final / "hf", final / "model-f32.gguf")
