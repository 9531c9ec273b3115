"""Text to token ids and back from a GGUF vocabulary, id for id as llama.cpp does it.

Two kinds of vocabulary (``tokenizer.ggml.model``):

- ``gpt2``, byte-level BPE. llama.cpp splits the text with the regexes of the file's
  pre-tokenizer (``tokenizer.ggml.pre``), one after the other. It maps bytes to GPT-2's
  printable stand-ins and applies the file's merges by rank.
- ``llama``, SentencePiece-style. A space becomes ``▁``. When ``add_space_prefix`` is set, a
  space goes before the text and after each special token. Pieces merge by score, and a
  character outside the vocabulary falls back to its ``<0xXX>`` byte tokens.

The merging runs in the Rust ``tokenizers`` library: a BPE model with no normalizer and no
added tokens. For ``llama`` its merges come from the scores, as transformers' GGUF converter
builds them. Everything around the merging follows src/llama-vocab.cpp. Special tokens
(CONTROL, USER_DEFINED, UNKNOWN) are cut out of the text first, longest first. BOS is added
only when the file asks for it. ``decode`` puts the pieces together as llama.cpp's
``token_to_piece`` renders them.
"""

from __future__ import annotations

import array
import codecs
import itertools
import operator
import os
import re
import warnings
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
from tokenizers import Regex, models, pre_tokenizers
from tokenizers import Tokenizer as _RustTokenizer

from qllama.array_api import to_numpy
from qllama.errors import InvalidTokenError, TokenizerError
from qllama.ggml_types import ValueType
from qllama.gguf.reader import GGUFFile, GGUFValue, read_gguf

DEFAULT_MAX_CHARS = 10_000_000
# Merges are derived from scores by trying every split of every token: quadratic in a token's
# length, so longer tokens (none in real vocabularies) are left to the byte fallback.
MAX_MERGE_TOKEN_CHARS = 1024


# llama.cpp's token attributes: bit flags that it derives from the types, then amends by name
_UNKNOWN, _UNUSED, _NORMAL, _CONTROL, _USER_DEFINED, _BYTE = 1, 2, 4, 8, 16, 32
_TYPE_ATTR = {0: 0, 1: _NORMAL, 2: _UNKNOWN, 3: _CONTROL, 4: _USER_DEFINED, 5: _UNUSED, 6: _BYTE}
_SPECIAL = _UNKNOWN | _CONTROL  # rendered only when special tokens are wanted
_PARSED = _UNKNOWN | _CONTROL | _USER_DEFINED  # recognised whole in input text
_LSTRIP, _RSTRIP = 128, 256  # a parsed token eats the whitespace before / after it
_C_SPACE = " \t\n\v\f\r"  # C's isspace, what llama.cpp strips

# Token texts llama.cpp treats as end of turn / generation even without a key saying so
# (src/llama-vocab.cpp, "auto-detect special tokens by text"); all of them become CONTROL.
EOT_NAMES = (
    "<|eot_id|>", "<|im_end|>", "<|end|>", "<end_of_turn>", "<|endoftext|>", "<|end_of_text|>",
    "<EOT>", "_<EOT>", "[EOT]", "<｜end▁of▁sentence｜>", "<end_of_utterance>",
)  # fmt: skip
_FIM_NAMES = (  # prefix, suffix, middle: made CONTROL, but they do not end generation
    "<|fim_prefix|>", "<fim-prefix>", "<fim_prefix>", "<｜fim▁begin｜>", "<PRE>", "▁<PRE>",
    "<|code_prefix|>", "<|prefix|>", "<|fim_suffix|>", "<fim-suffix>", "<fim_suffix>",
    "<｜fim▁hole｜>", "<SUF>", "▁<SUF>", "<|code_suffix|>", "<|suffix|>", "<|fim_middle|>",
    "<fim-middle>", "<fim_middle>", "<｜fim▁end｜>", "<MID>", "▁<MID>", "<|code_middle|>",
    "<|middle|>",
)  # fmt: skip
_FIM_END_NAMES = (  # pad, repo, file separator: these end generation
    "<|fim_pad|>", "<fim-pad>", "<fim_pad>", "<PAD>", "[PAD]", "<|fim_repo|>", "<|repo_name|>",
    "<fim-repo>", "<REPO>", "<reponame>", "<|file_sep|>",
)  # fmt: skip
EOG_NAMES = (
    "<|eot_id|>", "<|im_end|>", "<|end|>", "<|return|>", "<|call|>", "<|flush|>", "<|calls|>",
    "<end_of_turn>", "<|endoftext|>", "</s>", "<|eom_id|>", "<EOT>", "_<EOT>", "[EOT]", "[EOS]",
    "<|end_of_text|>", "<end_of_utterance>", "<eos>", "<turn|>", "<|tool_response>",
    "<｜end▁of▁sentence｜>", "[e~[",
    *_FIM_END_NAMES,
)  # fmt: skip
_CONTROL_NAMES = frozenset((*EOT_NAMES, "<|eom_id|>", *_FIM_NAMES, *EOG_NAMES))


# --- pre-tokenizers (src/llama-vocab.cpp, llm_tokenizer_bpe) ---------------------------------

_CONTRACTIONS = "(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])"
# llama.cpp spells this one without its final |\s+ but its own code for it matches \s+ too
GPT2_REGEX = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"
LLAMA3_REGEX = (
    _CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)
QWEN2_REGEX = (
    _CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)
QWEN35_REGEX = (
    _CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_PUNCT_REGEX = r"[\p{P}\$\+<=>\^~\|]+"
_FALCON_PUNCT_REGEX = r"[\p{P}\$\+<=>\^~\|`]+"  # the default's, and the backtick


@dataclass(frozen=True)
class PreTokenizer:
    """One of llama.cpp's BPE pre-tokenizers: regexes applied in turn, each one isolating its
    matches inside the pieces the ones before it left."""

    regexes: tuple[str, ...]
    ignore_merges: bool = False  # a word that is already a token is not merged
    add_bos: bool = False  # llama.cpp's default when tokenizer.ggml.add_bos_token is absent


def _group(names: str, pre: PreTokenizer) -> dict[str, PreTokenizer]:
    return dict.fromkeys(names.split(), pre)


# The names llama.cpp maps to each regex set. Names it knows whose regexes are outside this
# table (deepseek, tekken, gpt-4o, bloom, ...) are refused rather than approximated.
PRE_TOKENIZERS: dict[str, PreTokenizer] = {
    **_group("default", PreTokenizer((_PUNCT_REGEX, GPT2_REGEX, r"\p{N}+", "[0-9][0-9][0-9]"))),
    **_group(
        "gpt-2 phi-2 mpt olmo jais trillion granite-docling exaone4 gigachat a.x-4.0 mellum "
        "jina-es jina-de jina-v2-es jina-v2-de modern-bert",
        PreTokenizer((GPT2_REGEX,)),
    ),
    **_group(
        "starcoder refact command-r smollm codeshell exaone minerva-7b mellum2",
        PreTokenizer((r"\p{N}", GPT2_REGEX)),
    ),
    **_group(
        "llama3 llama-v3 llama-bpe falcon3 falcon-h1 pixtral midm-2.0 lfm2 jina-v5-nano",
        PreTokenizer((LLAMA3_REGEX,), ignore_merges=True, add_bos=True),
    ),
    **_group("dbrx smaug-bpe", PreTokenizer((LLAMA3_REGEX,))),
    **_group(
        "qwen2 deepseek-r1-qwen kormo f2llmv2 megrez stablelm2 hunyuan solar-open",
        PreTokenizer((QWEN2_REGEX,)),
    ),
    **_group("qwen35", PreTokenizer((QWEN35_REGEX,))),
    **_group("falcon", PreTokenizer((_FALCON_PUNCT_REGEX, GPT2_REGEX, "[0-9][0-9][0-9]"))),
}


# --- reading and validating the vocabulary ---------------------------------------------------

_INT_TYPES = frozenset(
    {
        ValueType.UINT8, ValueType.INT8, ValueType.UINT16, ValueType.INT16, ValueType.UINT32,
        ValueType.INT32, ValueType.UINT64, ValueType.INT64,
    }
)  # fmt: skip
_BYTE_TOKEN = re.compile(r"<0x([0-9A-Fa-f]{2})>")


def _describe(v: GGUFValue) -> str:
    if v.type == ValueType.ARRAY and v.elem_type is not None:
        return f"array of {v.elem_type.name.lower()}"
    return v.type.name.lower()


def _array(kv: Mapping[str, GGUFValue], key: str, elem: frozenset[ValueType], n: int | None) -> Any:
    """The array at ``key`` (None if absent), checked for element type and length ``n``."""
    v = kv.get(key)
    if v is None:
        return None
    if v.type != ValueType.ARRAY or v.elem_type not in elem:
        want = " or ".join(sorted(f"array of {t.name.lower()}" for t in elem))
        raise TokenizerError(f"{key} has type {_describe(v)}, expected {want}")
    if n is not None and len(v.value) != n:
        raise TokenizerError(f"{key} has {len(v.value)} entries but the vocabulary has {n} tokens")
    return v.value


def _flag(kv: Mapping[str, GGUFValue], key: str, default: bool) -> bool:
    v = kv.get(key)
    if v is None:
        return default
    if v.type != ValueType.BOOL:
        raise TokenizerError(f"{key} has type {_describe(v)}, expected bool")
    return bool(v.value)


def _token_id(
    kv: Mapping[str, GGUFValue], key: str, default: int | None, n_vocab: int
) -> int | None:
    v = kv.get(key)
    if v is None:
        if default is not None and not 0 <= default < n_vocab:
            raise TokenizerError(
                f"{key} is absent and its default id {default} is outside [0, {n_vocab})"
            )
        return default
    if v.type not in _INT_TYPES:
        raise TokenizerError(f"{key} has type {_describe(v)}, expected an integer")
    if not 0 <= int(v.value) < n_vocab:
        raise TokenizerError(f"{key} = {int(v.value)} is outside [0, {n_vocab})")
    return int(v.value)


def _string(kv: Mapping[str, GGUFValue], key: str) -> str | None:
    v = kv.get(key)
    if v is None:
        return None
    if v.type != ValueType.STRING:
        raise TokenizerError(f"{key} has type {_describe(v)}, expected string")
    return str(v.value)


def _parse_merges(raw: list[str], vocab: Mapping[str, int]) -> np.ndarray:
    """``"a b"`` strings to the ids of their two tokens (n, 2), split at the first space after
    the first character as llama.cpp does; a repeated pair keeps its first (best) rank."""
    key = "tokenizer.ggml.merges"
    pairs: dict[tuple[int, int], None] = {}
    for i, m in enumerate(raw):
        cut = m.find(" ", 1)
        if cut < 0:
            raise TokenizerError(f"{key}[{i}] = {m!r} has no space between its two parts")
        left, right = m[:cut], m[cut + 1 :]
        for part in (left, right, left + right):
            if part not in vocab:
                raise TokenizerError(f"{key}[{i}] = {m!r}: {part!r} is not a token")
        pairs.setdefault((vocab[left], vocab[right]), None)
    return _id_pairs(pairs)


def _merges_from_scores(vocab: Mapping[str, int], scores: np.ndarray) -> np.ndarray:
    """SentencePiece merges: every split of a token into two tokens, best score first.

    llama.cpp merges the adjacent pair whose concatenation is the highest-scoring token; a BPE
    whose merge ranks follow the scores of the merged tokens picks the same pair.
    """
    ranked = sorted(vocab.items(), key=lambda item: (-float(scores[item[1]]), item[1]))
    merges = []
    for text, _ in ranked:
        if len(text) > MAX_MERGE_TOKEN_CHARS:
            continue
        for k in range(1, len(text)):
            if text[:k] in vocab and text[k:] in vocab:
                merges.append((vocab[text[:k]], vocab[text[k:]]))
    return _id_pairs(merges)


def _id_pairs(pairs: Iterable[tuple[int, int]]) -> np.ndarray:
    """Merges as the ids of their two tokens, (n, 2) int32: a 49,152-token vocabulary's held
    as tuples of strings took 8 MB for the life of the tokenizer, as ids 0.4 MB."""
    return np.array(list(pairs), dtype=np.int32).reshape(-1, 2)  # (n, 2)


@dataclass(frozen=True)
class Vocabulary:
    """A validated ``tokenizer.ggml.*`` vocabulary, with llama.cpp's defaults filled in."""

    kind: str  # "gpt2" or "llama"
    pre: str | None  # pre-tokenizer name (gpt2 only)
    tokens: tuple[str, ...]
    attrs: tuple[int, ...]  # llama.cpp attribute bits per token
    scores: np.ndarray | None
    merges: np.ndarray  # (n, 2) token ids by rank; gpt2: the file's; llama: from the scores
    bos_id: int | None
    eos_id: int | None
    unk_id: int | None
    pad_id: int | None
    eot_id: int | None
    stop_ids: frozenset[int]
    add_bos: bool
    add_eos: bool
    add_space_prefix: bool

    @classmethod
    def from_metadata(cls, kv: Mapping[str, GGUFValue]) -> Vocabulary:
        """Read and check every tokenizer key; a bad one is a TokenizerError naming it."""
        kind = _string(kv, "tokenizer.ggml.model")
        if kind is None:
            raise TokenizerError("tokenizer.ggml.model is missing: the file has no vocabulary")
        if kind not in ("gpt2", "llama"):
            raise TokenizerError(
                f"tokenizer.ggml.model = {kind!r} is not supported (supported: 'gpt2', 'llama')"
            )
        raw = kv.get("tokenizer.ggml.tokens")
        if raw is None:
            raise TokenizerError("tokenizer.ggml.tokens is missing")
        if raw.type != ValueType.ARRAY or raw.elem_type != ValueType.STRING:
            raise TokenizerError(
                f"tokenizer.ggml.tokens has type {_describe(raw)}, expected array of string"
            )
        if len(raw.value) == 0:
            raise TokenizerError("tokenizer.ggml.tokens is empty")
        # llama.cpp reads each token as a C string (cut at the first NUL) and renames empty
        # ones so that each text stays unique to its id
        cut = [t.partition("\0")[0] for t in raw.value]
        tokens = tuple(t if t else f"[EMPTY_{i}]" for i, t in enumerate(cut))
        n = len(tokens)

        score_types = frozenset({ValueType.FLOAT32, ValueType.INT32})
        raw_scores = _array(kv, "tokenizer.ggml.scores", score_types, n)
        scores = None if raw_scores is None else np.asarray(raw_scores, dtype=np.float64)
        if scores is not None:
            bad = np.flatnonzero(~np.isfinite(scores))
            if bad.size:
                i = int(bad[0])
                raise TokenizerError(f"tokenizer.ggml.scores[{i}] = {scores[i]} is not finite")
        types = _array(kv, "tokenizer.ggml.token_type", frozenset({ValueType.INT32}), n)
        attrs = [_NORMAL] * n if types is None else [_TYPE_ATTR.get(int(t), 0) for t in types]

        for i, t in enumerate(tokens):
            if attrs[i] & _BYTE and not _BYTE_TOKEN.fullmatch(t):
                raise TokenizerError(
                    f"tokenizer.ggml.tokens[{i}] = {t!r} has type BYTE but is not <0xHH>"
                )

        vocab = {t: i for i, t in enumerate(tokens)}  # a repeated text: the last id wins
        pre: str | None = None
        if kind == "gpt2":
            pre = _string(kv, "tokenizer.ggml.pre")
            if pre is None:
                warnings.warn(
                    "tokenizer.ggml.pre is missing: using llama.cpp's 'default' pre-tokenizer, "
                    "which may split text differently from the model's training",
                    stacklevel=3,
                )
                pre = "default"
            elif pre not in PRE_TOKENIZERS:
                raise TokenizerError(
                    f"tokenizer.ggml.pre = {pre!r} is not a supported pre-tokenizer "
                    f"(supported: {', '.join(sorted(PRE_TOKENIZERS))})"
                )
            raw_merges = _array(kv, "tokenizer.ggml.merges", frozenset({ValueType.STRING}), None)
            if raw_merges is None:
                raise TokenizerError(
                    "tokenizer.ggml.merges is missing: 'gpt2' vocabularies need it"
                )
            merges = _parse_merges(raw_merges, vocab)
            defaults = {"bos": 11, "eos": 11, "unk": None}  # llama.cpp's, from GPT-2
            add_bos_default = PRE_TOKENIZERS[pre].add_bos
        else:
            if scores is None:
                raise TokenizerError(
                    "tokenizer.ggml.scores is missing: 'llama' vocabularies need it"
                )
            merges = _merges_from_scores(vocab, scores)
            defaults = {"bos": 1, "eos": 2, "unk": 0}
            add_bos_default = True

        def tid(name: str, default: int | None = None) -> int | None:
            return _token_id(kv, f"tokenizer.ggml.{name}_token_id", default, n)

        bos, eos = tid("bos", defaults["bos"]), tid("eos", defaults["eos"])
        unk, pad = tid("unknown", defaults["unk"]), tid("padding")
        eot, eom = tid("eot"), tid("eom")
        keyed_ends = [tid(x) for x in ("fim_pad", "fim_rep", "fim_sep")]

        # llama.cpp's detection by text: the named tokens become CONTROL, some end generation
        for i, t in enumerate(tokens):
            if t in _CONTROL_NAMES:
                attrs[i] |= _CONTROL
        _strip_by_name(_string(kv, "general.name"), tokens, attrs)
        if eot is None:
            eot = next((vocab[t] for t in EOT_NAMES if t in vocab), None)
        stop = {i for i in (eos, eot, eom, *keyed_ends) if i is not None}
        stop.update(vocab[t] for t in EOG_NAMES if t in vocab)

        return cls(
            kind=kind,
            pre=pre,
            tokens=tokens,
            attrs=tuple(attrs),
            scores=scores,
            merges=merges,
            bos_id=bos,
            eos_id=eos,
            unk_id=unk,
            pad_id=pad,
            eot_id=eot,
            stop_ids=frozenset(stop),
            add_bos=_flag(kv, "tokenizer.ggml.add_bos_token", add_bos_default),
            add_eos=_flag(kv, "tokenizer.ggml.add_eos_token", False),
            add_space_prefix=_flag(kv, "tokenizer.ggml.add_space_prefix", kind == "llama"),
        )


def _strip_by_name(name: str | None, tokens: tuple[str, ...], attrs: list[int]) -> None:
    """llama.cpp's token attributes "by model name" (src/llama-vocab.cpp): a model whose
    ``general.name`` contains phi-3 or phi3 (any case) has every parsed token eat the
    whitespace after it, as Phi-3's own tokenizer (rstrip) does, except <unk>, <s> and
    <|endoftext|>; </s> too. (Its <mask> rules are for BERT-style vocabularies qllama does not
    run.) So "<|user|>\nHi" is <|user|> then "Hi", without the newline."""
    lowered = (name or "").lower()
    if "phi-3" not in lowered and "phi3" not in lowered:
        return
    for i, t in enumerate(tokens):
        if attrs[i] & _PARSED or t == "</s>":
            attrs[i] |= _RSTRIP
        if t in ("<unk>", "<s>", "<|endoftext|>"):
            attrs[i] &= ~_RSTRIP


# --- pieces: what each token renders as ------------------------------------------------------


def _gpt2_byte_decoder() -> dict[str, int]:
    """GPT-2's printable stand-in character -> the byte it stands for."""
    printable = [*range(0x21, 0x7F), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    table, extra = {}, 0
    for b in range(256):
        if b in printable:
            table[chr(b)] = b
        else:
            table[chr(256 + extra)] = b
            extra += 1
    return table


_BYTE_DECODER = _gpt2_byte_decoder()


def _gpt2_piece(text: str) -> bytes:
    out = bytearray()
    for ch in text:
        b = _BYTE_DECODER.get(ch)
        if b is None:  # not a byte stand-in: llama.cpp writes this marker (llama_decode_text)
            out += f"[UNK_BYTE_0x{ch.encode().hex()}{text}]".encode()
        else:
            out.append(b)
    return bytes(out)


def _piece(v: Vocabulary, i: int) -> bytes:
    """llama.cpp's ``token_to_piece(id, special=True)``."""
    attr, text = v.attrs[i], v.tokens[i]
    if attr & (_SPECIAL | _USER_DEFINED):
        return text.encode()
    if attr & _NORMAL:
        return _gpt2_piece(text) if v.kind == "gpt2" else text.replace("▁", " ").encode()
    if attr & _BYTE:
        return bytes([int(text[3:5], 16)])
    return b""  # UNUSED, UNDEFINED


# --- the tokenizer ---------------------------------------------------------------------------

_SURROGATES = re.compile("[\ud800-\udfff]")


def _has_surrogates(text: str) -> bool:
    """Whether ``text`` holds a lone surrogate (which cannot become UTF-8)."""
    return not text.isascii() and _SURROGATES.search(text) is not None


def _build_rust(v: Vocabulary) -> _RustTokenizer:
    vocab = {t: i for i, t in enumerate(v.tokens)}
    merges = [(v.tokens[a], v.tokens[b]) for a, b in v.merges.tolist()]
    if v.kind == "gpt2":
        assert v.pre is not None
        pre = PRE_TOKENIZERS[v.pre]
        model = models.BPE(vocab=vocab, merges=merges, ignore_merges=pre.ignore_merges)
        rust = _RustTokenizer(model)
        steps: list[Any] = [
            pre_tokenizers.Split(Regex(r), behavior="isolated") for r in pre.regexes
        ]
        steps.append(pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False))
        rust.pre_tokenizer = pre_tokenizers.Sequence(steps)
        return rust
    # llama: the whole fragment is one word; llama.cpp falls back to <0xXX> byte tokens
    unk = v.tokens[v.unk_id] if v.unk_id is not None else None
    model = models.BPE(vocab=vocab, merges=merges, byte_fallback=True, unk_token=unk)
    return _RustTokenizer(model)


class Tokenizer:
    """Encode and decode with a GGUF file's vocabulary, as llama.cpp does.

    Build one with :meth:`from_gguf`. ``max_chars`` caps the length of the text ``encode``
    accepts (checked before any work is done).
    """

    def __init__(self, vocab: Vocabulary, *, max_chars: int = DEFAULT_MAX_CHARS) -> None:
        self.vocab = vocab
        self.max_chars = max_chars
        try:
            self._rust = _build_rust(vocab)
        except Exception as e:  # the checks above should leave nothing for tokenizers to refuse
            raise TokenizerError(f"tokenizers refused the vocabulary: {e}") from None
        # every token's piece in one string of bytes, token i's from _starts[i] to _starts[i+1]:
        # 49,152 bytes objects took 2.3 MB
        pieces = [_piece(vocab, i) for i in range(len(vocab.tokens))]
        self._piece_bytes = b"".join(pieces)
        self._starts = array.array("q", itertools.accumulate(map(len, pieces), initial=0))
        self._skipped = frozenset(i for i, a in enumerate(vocab.attrs) if a & _SPECIAL)
        # llama.cpp cuts special tokens out of the text longest first (bytes), then by id
        parsed = [(t, i) for i, t in enumerate(vocab.tokens) if vocab.attrs[i] & _PARSED]
        parsed.sort(key=lambda ti: (-len(ti[0].encode()), ti[1]))
        self._parsed = tuple(parsed)
        self._user_defined = tuple((t, i) for t, i in parsed if vocab.attrs[i] & _USER_DEFINED)
        self._lstrip = frozenset(i for i, a in enumerate(vocab.attrs) if a & _LSTRIP)
        self._rstrip = frozenset(i for i, a in enumerate(vocab.attrs) if a & _RSTRIP)
        self._strip_space = vocab.kind == "llama" and vocab.add_space_prefix

    @classmethod
    def from_gguf(cls, source: GGUFFile | str | os.PathLike[str], **options: Any) -> Tokenizer:
        """The tokenizer of a GGUF file (an open :class:`GGUFFile` or a path)."""
        f = source if isinstance(source, GGUFFile) else read_gguf(source)
        return cls.from_metadata(f.kv, **options)

    @classmethod
    def from_metadata(cls, kv: Mapping[str, GGUFValue], **options: Any) -> Tokenizer:
        """The tokenizer described by GGUF metadata values (``GGUFFile.kv``)."""
        return cls(Vocabulary.from_metadata(kv), **options)

    # -- facts about the vocabulary ------------------------------------------------------------

    @property
    def n_vocab(self) -> int:
        return len(self.vocab.tokens)

    @property
    def kind(self) -> str:
        return self.vocab.kind

    @property
    def bos_id(self) -> int | None:
        return self.vocab.bos_id

    @property
    def eos_id(self) -> int | None:
        return self.vocab.eos_id

    @property
    def eot_id(self) -> int | None:
        """End of turn (``<|im_end|>``, ``<|eot_id|>``...): the key, else the first such name."""
        return self.vocab.eot_id

    @property
    def unk_id(self) -> int | None:
        return self.vocab.unk_id

    @property
    def pad_id(self) -> int | None:
        return self.vocab.pad_id

    @property
    def stop_ids(self) -> frozenset[int]:
        """Ids that end generation: EOS, end of turn and the rest of llama.cpp's EOG set."""
        return self.vocab.stop_ids

    @property
    def add_bos(self) -> bool:
        return self.vocab.add_bos

    @property
    def tokens(self) -> tuple[str, ...]:
        """The vocabulary's token texts, as stored in the file."""
        return self.vocab.tokens

    def token_id(self, text: str) -> int | None:
        """The id of the token whose stored text is ``text``, or None."""
        if not isinstance(text, str):
            raise TypeError(f"text must be str, not {type(text).__name__}")
        if _has_surrogates(text):
            return None  # no token's text has a lone surrogate (they cannot become UTF-8)
        return self._rust.token_to_id(text)  # the BPE's own map: text -> its last id

    def is_special(self, token_id: int) -> bool:
        """True for CONTROL and UNKNOWN tokens (the ones ``skip_special`` leaves out)."""
        return self._check_ids([token_id])[0] in self._skipped

    def __repr__(self) -> str:
        pre = f", pre={self.vocab.pre!r}" if self.vocab.pre else ""
        return f"Tokenizer({self.kind!r}{pre}, n_vocab={self.n_vocab})"

    # -- encoding ------------------------------------------------------------------------------

    def _clean(self, text: str | bytes) -> str:
        if not isinstance(text, str | bytes):
            raise TypeError(f"text must be str or bytes, not {type(text).__name__}")
        if len(text) > self.max_chars:
            raise TokenizerError(
                f"text of {len(text)} characters is over the tokenizer's limit of "
                f"{self.max_chars} (Tokenizer.max_chars)"
            )
        if isinstance(text, bytes):
            return text.decode("utf-8", "replace")  # llama.cpp also replaces bad bytes
        if _has_surrogates(text):
            return _SURROGATES.sub("\ufffd", text)  # lone surrogates cannot become UTF-8
        return text

    def _partition(self, text: str, special: bool) -> list[str | int]:
        """Cut the special tokens out of ``text``: llama.cpp's tokenizer_st_partition (a token
        with LSTRIP / RSTRIP also takes the whitespace before / after it in its fragment)."""
        parts: list[str | int] = [text]
        for tok, tid in self._parsed if special else self._user_defined:
            if tok not in text:
                continue
            lstrip, rstrip = tid in self._lstrip, tid in self._rstrip
            out: list[str | int] = []
            for p in parts:
                if isinstance(p, int) or tok not in p:
                    out.append(p)
                    continue
                pieces = p.split(tok)
                for j, piece in enumerate(pieces):
                    if j:
                        out.append(tid)
                        piece = piece.lstrip(_C_SPACE) if rstrip else piece
                    if lstrip and j < len(pieces) - 1:
                        piece = piece.rstrip(_C_SPACE)
                    if piece:
                        out.append(piece)
            parts = out
        return parts

    def encode(
        self,
        text: str | bytes,
        *,
        add_bos: bool | None = None,
        add_eos: bool | None = None,
        special: bool = True,
    ) -> list[int]:
        """Token ids of ``text``.

        ``special`` recognises CONTROL and UNKNOWN tokens written in the text (USER_DEFINED
        ones always are). BOS and EOS are added when the file asks for them
        (``tokenizer.ggml.add_bos_token``/``add_eos_token``) unless ``add_bos``/``add_eos``
        say otherwise. Invalid UTF-8 and lone surrogates become U+FFFD.
        """
        text = self._clean(text)
        v = self.vocab
        out: list[int] = []
        if v.add_bos if add_bos is None else add_bos:
            if v.bos_id is None:
                raise TokenizerError("BOS was asked for but the vocabulary has no BOS token")
            out.append(v.bos_id)
        prev_special = True  # llama vocabularies prefix a space at the start, after specials
        for part in self._partition(text, special) if text else []:
            if isinstance(part, int):
                out.append(part)
                prev_special = True
                continue
            if v.kind == "llama":
                prefix = " " if v.add_space_prefix and prev_special else ""
                part = (prefix + part).replace(" ", "▁")
            out.extend(self._rust.encode(part, add_special_tokens=False).ids)
            prev_special = False
        if v.add_eos if add_eos is None else add_eos:
            if v.eos_id is None:
                raise TokenizerError("EOS was asked for but the vocabulary has no EOS token")
            out.append(v.eos_id)
        return out

    # -- decoding ------------------------------------------------------------------------------

    def _check_ids(self, ids: Iterable[Any]) -> list[int]:
        if isinstance(ids, np.ndarray) and ids.ndim != 1:
            raise InvalidTokenError(f"token ids must be 1-D, got an array of shape {ids.shape}")
        out = []
        for k, t in enumerate(ids):
            try:
                out.append(operator.index(t))
            except TypeError:
                raise InvalidTokenError(f"token[{k}]={t!r} is not an integer") from None
        if out and (min(out) < 0 or max(out) >= self.n_vocab):
            k, t = next((k, t) for k, t in enumerate(out) if not 0 <= t < self.n_vocab)
            raise InvalidTokenError(f"token[{k}]={t} out of range [0,{self.n_vocab})")
        return out

    def token_bytes(self, token_id: int, *, special: bool = True) -> bytes:
        """The bytes token ``token_id`` renders as (maybe part of a UTF-8 character)."""
        (i,) = self._check_ids([token_id])
        return b"" if not special and i in self._skipped else self._piece(i)

    def token_to_piece(self, token_id: int, *, special: bool = True) -> str:
        """The text of one token; a partial UTF-8 character shows as U+FFFD."""
        return self.token_bytes(token_id, special=special).decode("utf-8", "replace")

    def _piece(self, i: int) -> bytes:
        return self._piece_bytes[self._starts[i] : self._starts[i + 1]]

    def decode(self, ids: Iterable[Any], *, skip_special: bool = False) -> str:
        """The text of ``ids``: each token's piece, as llama.cpp renders it with special=True.

        ``skip_special`` leaves out CONTROL and UNKNOWN tokens. For a ``llama`` vocabulary the
        space that ``add_space_prefix`` put before the text is taken off again.
        """
        checked = self._check_ids(ids)
        if skip_special:
            checked = [i for i in checked if i not in self._skipped]
        data = b"".join([self._piece(i) for i in checked])
        if self._strip_space and data[:1] == b" ":
            data = data[1:]
        return data.decode("utf-8", "replace")

    def decoder(self, *, skip_special: bool = False) -> IncrementalDecoder:
        """A decoder for streaming: feed ids one at a time, get text once it is whole."""
        return IncrementalDecoder(self, skip_special=skip_special)


class IncrementalDecoder:
    """Streams text from token ids, holding back an incomplete UTF-8 character.

    What :meth:`feed` returns, joined, followed by :meth:`flush`, is exactly
    ``tokenizer.decode(ids)``.
    """

    def __init__(self, tokenizer: Tokenizer, *, skip_special: bool = False) -> None:
        self.tokenizer = tokenizer
        self.skip_special = skip_special
        self.reset()

    def reset(self) -> None:
        """Start a new text."""
        self._utf8 = codecs.getincrementaldecoder("utf-8")("replace")
        self._started = False

    def feed(self, token_id: int) -> str:
        """The text that ``token_id`` completes ("" while a character is still partial)."""
        data = self.tokenizer.token_bytes(token_id, special=not self.skip_special)
        if not self._started and data:
            self._started = True
            if self.tokenizer._strip_space and data[:1] == b" ":
                data = data[1:]
        return str(self._utf8.decode(data))

    def flush(self) -> str:
        """Whatever is held back, a partial character as U+FFFD; then start a new text."""
        rest = str(self._utf8.decode(b"", final=True))
        self.reset()
        return rest


def token_list(ids: Sequence[int] | Any) -> list[int]:
    """Token ids as a list of ints: a 1-D sequence or array of integers, nothing else (a float
    such as 1.5 is refused, not truncated to 1)."""
    seq = ids
    if not isinstance(ids, list | tuple):
        arr = to_numpy(ids)
        if arr.ndim != 1:
            raise InvalidTokenError(f"token ids must be 1-D, got shape {tuple(arr.shape)}")
        seq = arr.tolist()
    out = []
    for j, t in enumerate(seq):
        try:
            out.append(operator.index(t))
        except TypeError:
            raise InvalidTokenError(f"token[{j}] = {t!r} is not an integer") from None
    return out
