"""qllama's tokenizer against llama.cpp's own (llama-cpp-python), on the same files.

For each vocabulary (the synthetic gpt2 and llama ones, SmolLM2, SmolLM2's vocabulary under
every supported pre-tokenizer name, and a SentencePiece vocabulary made from SmolLM2's
pieces), the tests encode a corpus of code, numbers, scripts, whitespace and special tokens
plus seeded random texts, in every mode (special tokens parsed or not, BOS/EOS added or not).
The ids must be equal everywhere, every token's piece must be the same bytes, and the tokens
that end generation must be the same set.
"""

from __future__ import annotations

import ctypes
from pathlib import Path

import numpy as np
import pytest
from tokenizer_corpus import CORPUS, long_text, random_texts

from qllama.ggml_types import ValueType
from qllama.gguf.reader import GGUFValue, read_gguf
from qllama.gguf.writer import GGUFWriter
from qllama.runtime.tokenizer import PRE_TOKENIZERS, Tokenizer
from qllama.synthetic import TinyConfig, write_tiny_llama

llama_cpp = pytest.importorskip("llama_cpp")
pytestmark = pytest.mark.peers

N_RANDOM = 1000


class LlamaCppVocab:
    """llama.cpp's vocabulary of a GGUF file, loaded without weights."""

    def __init__(self, path: Path) -> None:
        self.model = llama_cpp.Llama(str(path), vocab_only=True, verbose=False)
        self.vocab = self.model._model.vocab
        self._buf = ctypes.create_string_buffer(1 << 16)

    def tokenize(self, text: str, *, add_special: bool, special: bool) -> list[int]:
        return list(self.model.tokenize(text.encode(), add_bos=add_special, special=special))

    def piece(self, token: int, *, special: bool) -> bytes:
        n = llama_cpp.llama_token_to_piece(self.vocab, token, self._buf, len(self._buf), 0, special)
        return self._buf.raw[:n]

    def is_eog(self, token: int) -> bool:
        return bool(llama_cpp.llama_vocab_is_eog(self.vocab, token))


def texts() -> list[tuple[str, str]]:
    rand = [(f"random-{i}", t) for i, t in enumerate(random_texts(N_RANDOM))]
    return [*CORPUS, *rand, ("long", long_text(20_000))]


def first_difference(a: list[int], b: list[int]) -> int:
    return next(
        (i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b))
    )


def encode_mismatches(ours: Tokenizer, theirs: LlamaCppVocab) -> tuple[int, list[str]]:
    """(comparisons, descriptions of the ones that differ) over texts x modes."""
    n, bad = 0, []
    for special in (True, False):
        for add_special in (True, False):
            # llama.cpp's add_special adds BOS/EOS as the file asks; ours does by default
            flag = None if add_special else False
            for name, text in texts():
                a = ours.encode(text, add_bos=flag, add_eos=flag, special=special)
                b = theirs.tokenize(text, add_special=add_special, special=special)
                n += 1
                if a != b:
                    k = first_difference(a, b)
                    bad.append(
                        f"{name} (special={special}, add_special={add_special}) at {k}: "
                        f"ours {a[k : k + 5]} llama.cpp {b[k : k + 5]}"
                    )
    return n, bad


def check_same_as_llama_cpp(path: Path) -> None:
    ours, theirs = Tokenizer.from_gguf(path), LlamaCppVocab(path)
    n, bad = encode_mismatches(ours, theirs)
    assert not bad, f"{len(bad)} of {n} encodings differ:\n" + "\n".join(bad[:10])
    for special in (True, False):
        diff = [
            i
            for i in range(ours.n_vocab)
            if ours.token_bytes(i, special=special) != theirs.piece(i, special=special)
        ]
        assert not diff, f"pieces differ (special={special}) for ids {diff[:10]}"
    eog = {i for i in range(ours.n_vocab) if theirs.is_eog(i)}
    assert ours.stop_ids == eog


# --- files ------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def files(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("llamacpp-tokenizer")


def rewrite(src: Path, dst: Path, changes: dict[str, GGUFValue | None]) -> Path:
    """``src``'s metadata (no tensors: llama.cpp's vocab_only needs none) with ``changes``."""
    w = GGUFWriter()
    for key, value in read_gguf(src).kv.items():
        if key in changes:
            continue
        w.add(key, value)
    for key, value in changes.items():
        if value is not None:
            w.add(key, value)
    w.write(dst)
    return dst


def spm_from_smollm2(src: Path, dst: Path) -> Path:
    """A SentencePiece vocabulary of real size: SmolLM2's pieces as text, ``▁`` for spaces,
    scores falling with rank, every character a token, ``<0xXX>`` byte tokens."""
    tok = Tokenizer.from_gguf(src)
    tokens = ["<unk>", "<s>", "</s>", *(f"<0x{b:02X}>" for b in range(256))]
    tokens += ["<|im_start|>", "<|im_end|>", "<tool>"]
    types = [2, 3, 3, *[6] * 256, 3, 3, 4]
    seen, pieces = set(tokens), []
    for i in range(tok.n_vocab):
        if tok.vocab.attrs[i] != 4:  # llama.cpp's attribute bit for NORMAL tokens, and no other
            continue
        try:
            text = tok.token_bytes(i).decode("utf-8").replace(" ", "▁")
        except UnicodeDecodeError:
            continue
        if text and text not in seen:
            seen.add(text)
            pieces.append(text)
    chars = sorted({c for p in pieces for c in p} - seen)
    n_fixed = len(tokens)
    tokens += chars + [p for p in pieces if len(p) > 1 or p not in chars]
    types += [1] * (len(tokens) - len(types))
    scores = np.zeros(len(tokens), np.float32)
    scores[n_fixed:] = -np.arange(len(tokens) - n_fixed, dtype=np.float32)
    tokenizer_keys = {k: None for k in read_gguf(src).kv if k.startswith("tokenizer.")}
    return rewrite(
        src,
        dst,
        tokenizer_keys
        | {
            "tokenizer.ggml.model": GGUFValue(ValueType.STRING, "llama"),
            "tokenizer.ggml.tokens": GGUFValue(ValueType.ARRAY, tokens, ValueType.STRING),
            "tokenizer.ggml.scores": GGUFValue(ValueType.ARRAY, scores, ValueType.FLOAT32),
            "tokenizer.ggml.token_type": GGUFValue(
                ValueType.ARRAY, np.array(types, np.int32), ValueType.INT32
            ),
            "tokenizer.ggml.bos_token_id": GGUFValue(ValueType.UINT32, 1),
            "tokenizer.ggml.eos_token_id": GGUFValue(ValueType.UINT32, 2),
            "tokenizer.ggml.unknown_token_id": GGUFValue(ValueType.UINT32, 0),
        },
    )


# --- the comparisons --------------------------------------------------------------------------


@pytest.mark.parametrize("vocab", ["gpt2", "llama"])
def test_synthetic_vocabularies(files: Path, vocab: str) -> None:
    path = files / f"tiny-{vocab}.gguf"
    write_tiny_llama(path, TinyConfig(vocab=vocab))
    check_same_as_llama_cpp(path)


@pytest.mark.model
def test_smollm2(smollm2_path: Path) -> None:
    check_same_as_llama_cpp(smollm2_path)


@pytest.mark.model
@pytest.mark.parametrize(
    "pre", ["default", "gpt-2", "starcoder", "llama-bpe", "dbrx", "qwen2", "qwen35", "falcon"]
)
def test_smollm2_vocabulary_under_each_pre_tokenizer(
    files: Path, smollm2_path: Path, pre: str
) -> None:
    assert pre in PRE_TOKENIZERS
    path = rewrite(
        smollm2_path,
        files / f"smollm2-{pre}.gguf",
        {
            "tokenizer.ggml.pre": GGUFValue(ValueType.STRING, pre),
            "tokenizer.ggml.add_bos_token": None,  # so the pre-tokenizer's own default applies
        },
    )
    check_same_as_llama_cpp(path)


@pytest.mark.model
def test_sentencepiece_vocabulary_of_real_size(files: Path, smollm2_path: Path) -> None:
    check_same_as_llama_cpp(spm_from_smollm2(smollm2_path, files / "spm.gguf"))
