"""The GGUF tokenizer: pinned ids, round trips, streaming, validation, and transformers.

Ids pinned here were checked against llama.cpp (llama-cpp-python 0.3.36). The full
comparison with llama.cpp is tests/peers/test_llamacpp_tokenizer.py.
"""

from __future__ import annotations

import unicodedata
import warnings
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st
from tokenizer_corpus import CORPUS, STUDY_PROMPT, long_text, random_texts

from qllama.errors import InvalidTokenError, QllamaError, TokenizerError
from qllama.ggml_types import ValueType
from qllama.gguf.reader import GGUFValue, read_gguf
from qllama.runtime.tokenizer import PRE_TOKENIZERS, Tokenizer
from qllama.synthetic import TinyConfig, write_tiny_llama

SETTINGS = settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@pytest.fixture(scope="session")
def tiny_files(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    d = tmp_path_factory.mktemp("tiny")
    paths = {}
    for kind in ("gpt2", "llama"):
        paths[kind] = d / f"tiny-{kind}.gguf"
        write_tiny_llama(paths[kind], TinyConfig(vocab=kind))
    return paths


@pytest.fixture(scope="session")
def gpt2(tiny_files: dict[str, Path]) -> Tokenizer:
    return Tokenizer.from_gguf(tiny_files["gpt2"])


@pytest.fixture(scope="session")
def spm(tiny_files: dict[str, Path]) -> Tokenizer:
    return Tokenizer.from_gguf(tiny_files["llama"])


@pytest.fixture(scope="session")
def smollm2(smollm2_path: Path) -> Tokenizer:
    return Tokenizer.from_gguf(smollm2_path)


def specials_of(tok: Tokenizer) -> list[str]:
    return [t for i, t in enumerate(tok.tokens) if tok.vocab.attrs[i] & (1 | 8 | 16)]


# --- pinned ids (from llama.cpp on the same files) ------------------------------------------

PINNED = {
    "gpt2": [
        (
            "Hello, the world 12 世界 éa <tool> ∑ <|im_start|>x",
            [75, 104, 111, 111, 114, 47, 265, 35, 122, 114, 117, 111, 103, 35, 52, 53, 35, 231,
             187, 153, 234, 152, 143, 35, 198, 172, 100, 35, 63, 119, 114, 114, 111, 65, 35, 229,
             139, 148, 35, 1, 123],
        ),
        ("the cat sat on the mat", [119, 262, 35, 102, 268, 267, 268, 35, 264, 265, 35, 112, 268]),
        (" hello  world\n\ttab",
         [35, 262, 111, 111, 114, 35, 35, 122, 114, 117, 111, 103, 13, 12, 119, 100, 101]),
        ("<|im_start|>user\nHi<|im_end|>\n", [1, 120, 118, 266, 13, 75, 108, 2, 13]),
    ],
    "llama": [
        (
            "Hello, the world 12 世界 éa <tool> ∑ <|im_start|>x",
            [1, 301, 371, 267, 296, 304, 306, 307, 396, 308, 307, 261, 307, 307, 229, 139, 148,
             307, 259, 307, 331],
        ),
        ("the cat sat on the mat", [1, 267, 277, 270, 271, 270, 307, 268, 267, 292, 270]),
        (" hello  world\n\ttab", [1, 307, 307, 263, 300, 307, 296, 393, 12, 327, 308, 309]),
        ("<|im_start|>user\nHi<|im_end|>\n",
         [1, 259, 307, 328, 326, 266, 393, 341, 316, 260, 307, 393]),
    ],
}  # fmt: skip


@pytest.mark.parametrize(
    ("kind", "text", "ids"), [(k, t, i) for k, cases in PINNED.items() for t, i in cases]
)
def test_pinned_ids(request: pytest.FixtureRequest, kind: str, text: str, ids: list[int]) -> None:
    tok = request.getfixturevalue("gpt2" if kind == "gpt2" else "spm")
    assert tok.encode(text) == ids  # with the file's add_bos_token (False for gpt2, True llama)


def test_vocabulary_facts(gpt2: Tokenizer, spm: Tokenizer) -> None:
    assert (gpt2.kind, gpt2.vocab.pre, gpt2.n_vocab) == ("gpt2", "smollm", 269)
    assert (gpt2.bos_id, gpt2.eos_id, gpt2.unk_id, gpt2.pad_id) == (1, 2, 0, 2)
    assert not gpt2.add_bos
    assert gpt2.eot_id == gpt2.token_id("<|im_end|>") == 2
    assert gpt2.stop_ids == {0, 2}  # <|endoftext|> and <|im_end|>, as llama.cpp's EOG set
    assert (spm.kind, spm.n_vocab, spm.bos_id, spm.eos_id, spm.unk_id) == ("llama", 397, 1, 2, 0)
    assert spm.add_bos and spm.vocab.add_space_prefix
    assert spm.stop_ids == {2, spm.token_id("<|im_end|>")}
    assert spm.token_id("no such token") is None
    assert "n_vocab=269" in repr(gpt2)


@pytest.mark.parametrize("kind", ["gpt2", "spm"])
def test_token_id_is_the_last_id_of_a_text(request: pytest.FixtureRequest, kind: str) -> None:
    tok = request.getfixturevalue(kind)
    assert all(tok.tokens[tok.token_id(t)] == t for t in tok.tokens)
    assert tok.token_id("\ud800") is None  # a lone surrogate is no token's text
    with pytest.raises(TypeError, match="text must be str, not int"):
        tok.token_id(5)  # type: ignore[arg-type]


def test_merges_are_held_as_the_ids_of_the_files_pairs(
    gpt2: Tokenizer, kvs: dict[str, dict[str, GGUFValue]]
) -> None:
    """Each merge as the ids of its two tokens, in the file's order; a repeated pair keeps
    its first rank."""
    raw = list(kvs["gpt2"]["tokenizer.ggml.merges"].value)
    merges = gpt2.vocab.merges
    assert merges.dtype == np.int32 and merges.shape == (len(raw), 2)
    assert [f"{gpt2.tokens[a]} {gpt2.tokens[b]}" for a, b in merges.tolist()] == raw
    kv = dict(kvs["gpt2"]) | {
        "tokenizer.ggml.merges": GGUFValue(ValueType.ARRAY, [*raw, raw[0]], ValueType.STRING)
    }
    assert np.array_equal(Tokenizer.from_metadata(kv).vocab.merges, merges)


# --- special tokens, BOS, decoding ----------------------------------------------------------


@pytest.mark.parametrize("kind", ["gpt2", "llama"])
def test_special_tokens_recognised_whole(request: pytest.FixtureRequest, kind: str) -> None:
    tok = request.getfixturevalue("gpt2" if kind == "gpt2" else "spm")
    start, end = tok.token_id("<|im_start|>"), tok.token_id("<|im_end|>")
    ids = tok.encode("<|im_start|><|im_end|>", add_bos=False)
    assert ids == [start, end]
    plain = tok.encode("<|im_start|>", add_bos=False, special=False)
    assert start not in plain and len(plain) > 1


def test_user_defined_tokens_always_recognised(spm: Tokenizer) -> None:
    tool = spm.token_id("<tool>")
    assert tool in spm.encode("a<tool>b", special=False)  # as llama.cpp: parse_special=false
    assert spm.decode([tool], skip_special=True) == "<tool>"  # and always rendered


@pytest.mark.parametrize(
    ("kind", "add_bos", "first"),
    [("gpt2", None, None), ("gpt2", True, 1), ("gpt2", False, None),
     ("llama", None, 1), ("llama", True, 1), ("llama", False, None)],
)  # fmt: skip
def test_add_bos(
    request: pytest.FixtureRequest, kind: str, add_bos: bool | None, first: int | None
) -> None:
    tok = request.getfixturevalue("gpt2" if kind == "gpt2" else "spm")
    ids = tok.encode("the", add_bos=add_bos)
    assert (ids[0] == tok.bos_id) == (first is not None)
    assert tok.encode("", add_bos=add_bos) == ([first] if first is not None else [])


def test_add_eos(gpt2: Tokenizer) -> None:
    assert gpt2.encode("the", add_eos=True)[-1] == gpt2.eos_id


def test_decode_special_tokens(gpt2: Tokenizer, spm: Tokenizer) -> None:
    ids = gpt2.encode("<|im_start|>user\nHi<|im_end|>")
    assert gpt2.decode(ids) == "<|im_start|>user\nHi<|im_end|>"
    assert gpt2.decode(ids, skip_special=True) == "user\nHi"
    assert gpt2.is_special(1) and not gpt2.is_special(100)
    # SentencePiece: the prefix space is taken off the first piece, as sentencepiece does
    assert spm.decode(spm.encode("Hello world", add_bos=False)) == "Hello world"
    assert spm.decode(spm.encode("Hello world"), skip_special=True) == "Hello world"
    assert spm.decode(spm.encode("Hi")) == "<s> Hi"  # llama.cpp's rendering with special=True


def test_token_to_piece(gpt2: Tokenizer, spm: Tokenizer) -> None:
    assert gpt2.token_to_piece(gpt2.token_id("Ġthe")) == " the"
    assert gpt2.token_to_piece(1) == "<|im_start|>"
    assert gpt2.token_to_piece(1, special=False) == ""
    assert spm.token_to_piece(spm.token_id("▁world")) == " world"
    assert spm.token_bytes(spm.token_id("<0xE4>")) == b"\xe4"
    assert spm.token_to_piece(spm.token_id("<0xE4>")) == "\ufffd"  # a partial character


@pytest.mark.parametrize("bad", [-1, 269, 2**31, 10**20])
def test_decode_rejects_ids_out_of_range(gpt2: Tokenizer, bad: int) -> None:
    with pytest.raises(InvalidTokenError, match=rf"token\[1\]={bad} out of range \[0,269\)"):
        gpt2.decode([5, bad])
    with pytest.raises(InvalidTokenError):
        gpt2.decoder().feed(bad)
    with pytest.raises(InvalidTokenError):
        gpt2.token_to_piece(bad)


@pytest.mark.parametrize("bad", [[1.5], ["3"], [None], np.zeros((2, 2), np.int32)])
def test_decode_rejects_non_integers(gpt2: Tokenizer, bad: object) -> None:
    with pytest.raises(InvalidTokenError):
        gpt2.decode(bad)  # type: ignore[arg-type]


def test_decode_accepts_numpy_ids(gpt2: Tokenizer) -> None:
    ids = gpt2.encode("the cat")
    assert gpt2.decode(np.array(ids, np.int64)) == gpt2.decode([np.int32(i) for i in ids])


# --- bad input text -------------------------------------------------------------------------


@pytest.mark.parametrize("kind", ["gpt2", "llama"])
@pytest.mark.parametrize(
    "text", [b"ok \xff\xfe bad", b"\xe4\xb8", b"\xed\xa0\x80", "lone \ud800 surrogate", "\udfff"]
)
def test_invalid_text_is_replaced(
    request: pytest.FixtureRequest, kind: str, text: str | bytes
) -> None:
    tok = request.getfixturevalue("gpt2" if kind == "gpt2" else "spm")
    out = tok.decode(tok.encode(text, add_bos=False))
    assert "\ufffd" in out
    assert out.replace("\ufffd", "") == (
        text.decode("utf-8", "ignore")
        if isinstance(text, bytes)
        else text.encode("utf-8", "ignore").decode()
    )


def test_text_length_cap_comes_first(gpt2: Tokenizer) -> None:
    small = Tokenizer(gpt2.vocab, max_chars=100)
    assert len(small.encode("a" * 100)) == 100
    with pytest.raises(TokenizerError, match="101 characters is over the tokenizer's limit of 100"):
        small.encode("a" * 101)
    with pytest.raises(TokenizerError, match="limit"):
        small.encode(b"a" * 101)
    huge = "a" * (gpt2.max_chars + 1)  # the default cap (10M): refused without tokenizing
    with pytest.raises(TokenizerError):
        gpt2.encode(huge)
    with pytest.raises(TypeError):
        gpt2.encode(["not", "text"])  # type: ignore[arg-type]


# --- properties -----------------------------------------------------------------------------


@pytest.mark.parametrize("kind", ["gpt2", "llama"])
@SETTINGS
@given(text=st.text(max_size=300))
def test_decode_inverts_encode(request: pytest.FixtureRequest, kind: str, text: str) -> None:
    tok = request.getfixturevalue("gpt2" if kind == "gpt2" else "spm")
    assume(not any(s in text for s in specials_of(tok)))
    assume(kind == "gpt2" or "▁" not in text)  # SentencePiece's space stand-in is a space
    assert tok.decode(tok.encode(text, add_bos=False)) == text


def test_sentencepiece_space_stand_in_decodes_as_space(spm: Tokenizer) -> None:
    assert spm.decode(spm.encode("a▁b", add_bos=False)) == "a b"  # as llama.cpp, sentencepiece


@pytest.mark.parametrize("kind", ["gpt2", "llama"])
@pytest.mark.parametrize("skip_special", [False, True])
@SETTINGS
@given(data=st.data())
def test_streaming_equals_decode(
    request: pytest.FixtureRequest, kind: str, skip_special: bool, data: st.DataObject
) -> None:
    tok = request.getfixturevalue("gpt2" if kind == "gpt2" else "spm")
    ids = data.draw(st.lists(st.integers(0, tok.n_vocab - 1), max_size=60))
    dec = tok.decoder(skip_special=skip_special)
    pieces = [dec.feed(i) for i in ids]
    assert "".join(pieces) + dec.flush() == tok.decode(ids, skip_special=skip_special)


def test_streaming_holds_back_partial_characters(gpt2: Tokenizer, spm: Tokenizer) -> None:
    for tok in (gpt2, spm):
        ids = tok.encode("世", add_bos=False)  # three byte tokens
        dec = tok.decoder()
        assert [dec.feed(i) for i in ids] == ["", "", "世"] or tok is spm
        assert dec.flush() == ""
    dec = gpt2.decoder()
    assert dec.feed(gpt2.encode("世")[0]) == ""
    assert dec.flush() == "\ufffd"  # an unfinished character at the end
    assert dec.feed(gpt2.token_id("a")) == "a"  # and a new text starts clean


# --- validation of the metadata -------------------------------------------------------------


@pytest.fixture(scope="session")
def kvs(tiny_files: dict[str, Path]) -> dict[str, dict[str, GGUFValue]]:
    return {kind: dict(read_gguf(p).kv) for kind, p in tiny_files.items()}


def arr(values: object, elem: ValueType) -> GGUFValue:
    if elem == ValueType.STRING:
        return GGUFValue(ValueType.ARRAY, list(values), elem)  # type: ignore[call-overload]
    dtype = {ValueType.INT32: np.int32, ValueType.UINT8: np.uint8, ValueType.FLOAT32: np.float32}
    return GGUFValue(ValueType.ARRAY, np.asarray(values, dtype[elem]), elem)


def u32(v: int) -> GGUFValue:
    return GGUFValue(ValueType.UINT32, v)


def _tokens_with(kv: dict[str, GGUFValue], i: int, text: str, kind: int) -> dict[str, GGUFValue]:
    tokens = list(kv["tokenizer.ggml.tokens"].value)
    types = np.array(kv["tokenizer.ggml.token_type"].value)
    tokens[i], types[i] = text, kind
    return {
        "tokenizer.ggml.tokens": arr(tokens, ValueType.STRING),
        "tokenizer.ggml.token_type": arr(types, ValueType.INT32),
    }


def text(v: str) -> GGUFValue:
    return GGUFValue(ValueType.STRING, v)


I32, U8, F32, STR = ValueType.INT32, ValueType.UINT8, ValueType.FLOAT32, ValueType.STRING
DELETE = None
# (test id, vocabulary, key after "tokenizer.ggml.", new value, message); a str value is a
# malformed BYTE token put at index 10
BAD_METADATA = [
    ("model-missing", "gpt2", "model", DELETE, "tokenizer.ggml.model is missing"),
    ("model-unknown", "gpt2", "model", text("bert"), "'bert' is not supported"),
    ("model-not-string", "gpt2", "model", u32(1), "model has type uint32"),
    ("tokens-missing", "gpt2", "tokens", DELETE, "tokens is missing"),
    ("tokens-empty", "gpt2", "tokens", arr([], STR), "tokens is empty"),
    ("tokens-not-strings", "gpt2", "tokens", arr([1, 2], I32), "type array of int32"),
    ("tokens-scalar", "gpt2", "tokens", text("a"), "tokens has type string"),
    ("types-short", "gpt2", "token_type", arr([1] * 10, I32), "10 entries but the vocabulary has"),
    ("types-u8", "gpt2", "token_type", arr([1] * 269, U8), "token_type has type array of uint8"),
    ("types-f32", "gpt2", "token_type", arr([1] * 269, F32), "expected array of int32"),
    ("scores-long", "llama", "scores", arr([0] * 398, F32), "scores has 398 entries"),
    ("scores-u8", "llama", "scores", arr([0] * 397, U8), "scores has type array of uint8"),
    ("scores-nan", "llama", "scores", arr([0] * 300 + [np.nan] * 97, F32), r"\[300\] = nan is"),
    ("scores-missing", "llama", "scores", DELETE, "scores is missing"),
    ("merges-missing", "gpt2", "merges", DELETE, "merges is missing"),
    ("merges-no-space", "gpt2", "merges", arr(["Ġ t", "ab"], STR), r"\[1\] = 'ab' has no space"),
    ("merges-leading-space", "gpt2", "merges", arr([" t"], STR), r"\[0\] = ' t' has no space"),
    ("merges-not-token", "gpt2", "merges", arr(["Ġ t", "x y"], STR), r"'x y': 'xy' is not a token"),
    ("merges-wrong-type", "gpt2", "merges", arr([1], I32), "merges has type array of int32"),
    ("pre-unknown", "gpt2", "pre", text("klingon"), "'klingon' is not a supported"),
    ("bos-out-of-range", "gpt2", "bos_token_id", u32(269), r"= 269 is outside \[0, 269\)"),
    ("eos-out-of-range", "gpt2", "eos_token_id", u32(2**32 - 1), "= 4294967295 is outside"),
    ("unk-out-of-range", "llama", "unknown_token_id", u32(397), r"= 397 is outside \[0, 397\)"),
    ("pad-out-of-range", "gpt2", "padding_token_id", u32(1000), "padding_token_id = 1000"),
    ("eot-out-of-range", "gpt2", "eot_token_id", u32(269), "eot_token_id = 269"),
    ("bos-negative", "gpt2", "bos_token_id", GGUFValue(I32, -1), "bos_token_id = -1"),
    ("bos-wrong-type", "gpt2", "bos_token_id", text("1"), "bos_token_id has type string"),
    ("add-bos-wrong-type", "gpt2", "add_bos_token", GGUFValue(U8, 1), "type uint8, expected bool"),
    ("byte-token-negative", "llama", "tokens", "<0x-1>", r"tokens\[10\] = '<0x-1>' has type BYTE"),
    ("byte-token-not-hex", "llama", "tokens", "<0xZZ>", r"tokens\[10\] = '<0xZZ>' has type BYTE"),
    ("byte-token-too-big", "llama", "tokens", "<0x100>", r"tokens\[10\] = '<0x100>' has type BYTE"),
]  # fmt: skip


@pytest.mark.parametrize(
    ("kind", "key", "value", "message"),
    [c[1:] for c in BAD_METADATA],
    ids=[c[0] for c in BAD_METADATA],
)
def test_bad_metadata_is_a_tokenizer_error(
    kvs: dict[str, dict[str, GGUFValue]], kind: str, key: str, value: object, message: str
) -> None:
    kv = dict(kvs[kind])
    if isinstance(value, str):
        kv |= _tokens_with(kv, 10, value, 6)  # 6: BYTE
    elif value is None:
        del kv[f"tokenizer.ggml.{key}"]
    else:
        assert isinstance(value, GGUFValue)
        kv[f"tokenizer.ggml.{key}"] = value
    with pytest.raises(TokenizerError, match=message):
        Tokenizer.from_metadata(kv)


def test_default_special_ids_are_checked_too(kvs: dict[str, dict[str, GGUFValue]]) -> None:
    """Without a bos key a gpt2 vocabulary gets llama.cpp's default 11: past a 5-token vocab."""
    kv = {
        "tokenizer.ggml.model": GGUFValue(ValueType.STRING, "gpt2"),
        "tokenizer.ggml.pre": GGUFValue(ValueType.STRING, "gpt-2"),
        "tokenizer.ggml.tokens": arr(list("abcde"), ValueType.STRING),
        "tokenizer.ggml.merges": arr([], ValueType.STRING),
    }
    with pytest.raises(TokenizerError, match=r"bos_token_id is absent and its default id 11"):
        Tokenizer.from_metadata(kv)
    kv |= {"tokenizer.ggml.bos_token_id": u32(0), "tokenizer.ggml.eos_token_id": u32(1)}
    assert Tokenizer.from_metadata(kv).encode("abc") == [0, 1, 2]


def test_missing_pre_tokenizer_warns_and_uses_default(kvs: dict[str, dict[str, GGUFValue]]) -> None:
    kv = dict(kvs["gpt2"])
    del kv["tokenizer.ggml.pre"]
    with pytest.warns(UserWarning, match="tokenizer.ggml.pre is missing"):
        tok = Tokenizer.from_metadata(kv)
    assert tok.vocab.pre == "default"


def test_every_error_is_a_qllama_error(kvs: dict[str, dict[str, GGUFValue]]) -> None:
    assert issubclass(TokenizerError, QllamaError) and issubclass(InvalidTokenError, ValueError)


def test_empty_and_nul_tokens_as_llama_cpp(kvs: dict[str, dict[str, GGUFValue]]) -> None:
    """llama.cpp reads tokens as C strings and renames empty ones: the same here."""
    kv = dict(kvs["gpt2"]) | _tokens_with(kvs["gpt2"], 200, "", 1)
    assert Tokenizer.from_metadata(kv).tokens[200] == "[EMPTY_200]"
    kv = dict(kvs["gpt2"]) | _tokens_with(kvs["gpt2"], 200, "ab\x00cd", 1)
    assert Tokenizer.from_metadata(kv).tokens[200] == "ab"


@pytest.mark.parametrize("name", sorted(PRE_TOKENIZERS))
def test_every_pre_tokenizer_builds(kvs: dict[str, dict[str, GGUFValue]], name: str) -> None:
    kv = dict(kvs["gpt2"]) | {"tokenizer.ggml.pre": GGUFValue(ValueType.STRING, name)}
    tok = Tokenizer.from_metadata(kv)
    text = "Hello world 12345, it's\n\n  done!"
    assert tok.decode(tok.encode(text, add_bos=False)) == text


# --- the real file: SmolLM2 -----------------------------------------------------------------


def has_number(text: str) -> bool:
    return any(unicodedata.category(c).startswith("N") for c in text)


@pytest.mark.model
def test_smollm2_facts(smollm2: Tokenizer) -> None:
    assert (smollm2.kind, smollm2.vocab.pre, smollm2.n_vocab) == ("gpt2", "smollm", 49152)
    assert (smollm2.bos_id, smollm2.eos_id, smollm2.unk_id, smollm2.pad_id) == (1, 2, 0, 2)
    assert not smollm2.add_bos
    assert smollm2.eot_id == 2
    assert smollm2.stop_ids == {0, 2, 4}  # llama.cpp's EOG: endoftext, im_end, <reponame>


@pytest.mark.model
def test_smollm2_splits_every_digit(smollm2: Tokenizer) -> None:
    """llama.cpp's smollm pre-tokenizer isolates each \\p{N} character (pitfall 16)."""
    digit = {d: smollm2.encode(d) for d in "0123456789"}
    assert all(len(v) == 1 for v in digit.values())
    assert smollm2.encode("1234567890") == [digit[d][0] for d in "1234567890"]
    assert (
        smollm2.encode("x=1,000")
        == smollm2.encode("x=") + digit["1"] + smollm2.encode(",") + digit["0"] * 3
    )
    for s in ["٣٤٥", "①②", "½", "²"]:  # other numbers split one per character too
        assert smollm2.encode(s) == [i for c in s for i in smollm2.encode(c)]


@pytest.mark.model
def test_smollm2_study_prompt(smollm2: Tokenizer) -> None:
    ids = smollm2.encode(STUDY_PROMPT)
    assert len(ids) == 37
    assert ids[:3] == [1, 9690, 198] and ids[-4:] == [1, 520, 9531, 198]
    assert smollm2.decode(ids) == STUDY_PROMPT


def missing_bytes(tok: Tokenizer) -> set[int]:
    """Bytes a byte-level vocabulary has no token for (SmolLM2: 0x04, 0xF1, 0xFF...)."""
    from qllama.runtime.tokenizer import _BYTE_DECODER

    return {b for ch, b in _BYTE_DECODER.items() if tok.token_id(ch) is None}


@pytest.mark.model
@SETTINGS
@given(text=st.text(max_size=300))
def test_smollm2_decode_inverts_encode(smollm2: Tokenizer, text: str) -> None:
    assume(not any(s in text for s in specials_of(smollm2)))
    assume(not missing_bytes(smollm2) & set(text.encode()))
    assert smollm2.decode(smollm2.encode(text)) == text


@pytest.mark.model
def test_smollm2_drops_bytes_it_has_no_token_for(smollm2: Tokenizer) -> None:
    """As llama.cpp: a byte without a token is skipped (U+40000 starts with 0xF1)."""
    assert {0x04, 0xF1, 0xFF} <= missing_bytes(smollm2)
    assert smollm2.encode("a\U00040000b") == smollm2.encode("a") + [218] * 3 + smollm2.encode("b")


@pytest.mark.model
@SETTINGS
@given(ids=st.lists(st.integers(0, 49151), max_size=60))
def test_smollm2_streaming_equals_decode(smollm2: Tokenizer, ids: list[int]) -> None:
    dec = smollm2.decoder()
    assert "".join(dec.feed(i) for i in ids) + dec.flush() == smollm2.decode(ids)


@pytest.mark.model
def test_smollm2_roundtrips_10k_chars(smollm2: Tokenizer) -> None:
    text = long_text(10_000)
    assert smollm2.decode(smollm2.encode(text)) == text  # (about 5 ms here: a bench's business)


@pytest.fixture(scope="session")
def hf_smollm2(smollm2_path: Path):  # type: ignore[no-untyped-def]
    transformers = pytest.importorskip("transformers")
    pytest.importorskip("gguf")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return transformers.AutoTokenizer.from_pretrained(
            str(smollm2_path.parent), gguf_file=smollm2_path.name
        )


@pytest.mark.model
def test_smollm2_equals_transformers_without_numbers(smollm2: Tokenizer, hf_smollm2) -> None:  # type: ignore[no-untyped-def]
    """transformers' GGUF tokenizer is an oracle for text without numbers: it does not split
    digits for smollm (pitfall 16), so numbers are checked against llama.cpp's rule above."""
    texts = [(n, t) for n, t in CORPUS if not has_number(t)]
    no_numbers = ("".join(c for c in t if not has_number(c)) for t in random_texts(1500))
    texts += [(f"random-{i}", t) for i, t in enumerate(no_numbers)]
    bad = [
        (name, text, ours, theirs)
        for name, text in texts
        if (ours := smollm2.encode(text))
        != (theirs := hf_smollm2.encode(text, add_special_tokens=False))
    ]
    assert not bad, f"{len(bad)} of {len(texts)} differ; first: {bad[0]}"


@pytest.mark.model
@pytest.mark.slow
def test_smollm2_ten_million_characters(smollm2: Tokenizer) -> None:
    """The largest text the default cap accepts encodes without trouble (~5 s, ~400 MB)."""
    text = long_text(smollm2.max_chars)
    ids = smollm2.encode(text)
    assert len(ids) > 4_000_000
    assert smollm2.decode(ids) == text
