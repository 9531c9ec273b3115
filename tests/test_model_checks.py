"""Model-level checks through ``qllama.load`` (docs/security.md, section E; F at file level).

Every case starts from a tiny valid llama written by :mod:`qllama.synthetic` and rewrites one
thing with :class:`GGUFWriter`: a key dropped, retyped or set out of range, a tensor dropped,
renamed or reshaped, a NaN written into a block scale. Each must end in its specific error,
raised before anything is allocated from the bad value.
"""

from __future__ import annotations

import struct
import subprocess
import sys
import tracemalloc
import warnings
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import qllama
from qllama import quants
from qllama.errors import (
    GGUFFormatError,
    ModelConfigError,
    QllamaError,
    TensorShapeError,
    TokenizerError,
    WeightValueError,
)
from qllama.ggml_types import INTEGER_VALUE_TYPES, GGMLType, ValueType
from qllama.gguf.reader import GGUFValue, read_gguf
from qllama.gguf.writer import GGUFWriter
from qllama.synthetic import TinyConfig, write_tiny_llama

# 2 layers, 32 wide, 2 query heads of 16 sharing 1 kv head, separate output, Q8_0 weights
TINY = TinyConfig(
    n_layer=2, n_embd=32, n_ff=64, n_head=2, n_head_kv=1, tied=False, weight_type="Q8_0"
)
N_VOCAB = 269  # the synthetic byte-level vocabulary
DROP = object()


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("checks") / "tiny.gguf"
    write_tiny_llama(path, TINY)
    return path


def rewrite(
    src: Path,
    dst: Path,
    *,
    kv: Mapping[str, Any] = {},
    tensors: Mapping[str, Any] = {},
    rename: Mapping[str, str] = {},
    patch: Callable[[str, np.ndarray], np.ndarray] | None = None,
) -> Path:
    """``src`` with keys set (``DROP`` removes one), tensors replaced by ``(data, type,
    shape)`` or dropped, renamed, or their bytes changed by ``patch(name, bytes)``."""
    f = read_gguf(src)
    w = GGUFWriter()
    for key, v in f.kv.items():
        new = kv.get(key, v)
        if new is not DROP:
            w.add(key, new)
    for key, v in kv.items():
        if key not in f.kv and v is not DROP:
            w.add(key, v)
    for t in f:
        new = tensors.get(t.name)
        if new is DROP:
            continue
        name = rename.get(t.name, t.name)
        if new is not None:
            w.add_tensor(name, *new)
            continue
        raw = np.array(f.tensor_data(t.name))  # a writable copy
        if patch is not None:
            raw = patch(t.name, raw)
        w.add_tensor(name, raw, t.ggml_type, t.shape)
    for name, new in tensors.items():
        if name not in f.tensors and new is not DROP:
            w.add_tensor(name, *new)
    f.close()
    w.write(dst)
    return dst


def u32(v: int) -> GGUFValue:
    return GGUFValue(ValueType.UINT32, v)


def f32(v: float) -> GGUFValue:
    return GGUFValue(ValueType.FLOAT32, v)


def test_the_unmodified_file_loads_and_runs(tiny: Path) -> None:
    m = qllama.load(tiny)
    assert m.config.n_layer == 2 and m.config.n_vocab == N_VOCAB
    assert np.isfinite(np.asarray(m.forward([1, 2, 3]))).all()


# --- E29: architecture ------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("value", "message"),
    [
        (DROP, "general.architecture is missing or not a string"),
        (u32(1), "general.architecture is missing or not a string"),
        (GGUFValue(ValueType.ARRAY, ["llama"], ValueType.STRING), "missing or not a string"),
        ("mamba", "unsupported architecture 'mamba'; qllama runs gemma2, gemma3, gpt-oss, granite"),
        ("", "unsupported architecture ''"),
    ],
)
def test_E29_architecture(tiny: Path, tmp_path: Path, value: Any, message: str) -> None:
    p = rewrite(tiny, tmp_path / "bad.gguf", kv={"general.architecture": value})
    with pytest.raises(ModelConfigError, match=message):
        qllama.load(p)


# --- E30-E32: hyperparameters -----------------------------------------------------------------

REQUIRED = [
    "context_length",
    "embedding_length",
    "block_count",
    "feed_forward_length",
    "attention.head_count",
    "attention.layer_norm_rms_epsilon",
]


@pytest.mark.parametrize("key", REQUIRED)
def test_E30_required_key_missing(tiny: Path, tmp_path: Path, key: str) -> None:
    p = rewrite(tiny, tmp_path / "bad.gguf", kv={f"llama.{key}": DROP})
    with pytest.raises(ModelConfigError, match=f"key not found: llama.{key}$"):
        qllama.load(p)


@pytest.mark.parametrize("key", ["vocab_size", "rope.freq_base", "rope.dimension_count"])
def test_E30_optional_keys_fall_back(tiny: Path, tmp_path: Path, key: str) -> None:
    """Keys llama.cpp defaults: the vocabulary's length, 10000, the head size."""
    p = rewrite(tiny, tmp_path / "ok.gguf", kv={f"llama.{key}": DROP})
    m = qllama.load(p)
    assert m.config.n_vocab == N_VOCAB and m.config.head_dim == 16


def test_E30_head_count_kv_defaults_to_head_count(tiny: Path, tmp_path: Path) -> None:
    """Without head_count_kv, attention is not grouped: K must then have 2 heads, not 1."""
    p = rewrite(tiny, tmp_path / "bad.gguf", kv={"llama.attention.head_count_kv": DROP})
    with pytest.raises(
        TensorShapeError, match=r"'blk.0.attn_k.weight' has shape \[16, 32\], expected \[32, 32\]"
    ):
        qllama.load(p)


@pytest.mark.parametrize(
    ("value", "found"),
    [
        (GGUFValue(ValueType.STRING, "2"), "STRING"),
        (f32(2.0), "FLOAT32"),
        (GGUFValue(ValueType.FLOAT64, 2.0), "FLOAT64"),
        (GGUFValue(ValueType.BOOL, True), "BOOL"),
        (GGUFValue(ValueType.ARRAY, np.array([2], np.uint32), ValueType.UINT32), "ARRAY"),
    ],
)
def test_E31_key_of_the_wrong_type(tiny: Path, tmp_path: Path, value: Any, found: str) -> None:
    p = rewrite(tiny, tmp_path / "bad.gguf", kv={"llama.block_count": value})
    with pytest.raises(
        ModelConfigError, match=f"key llama.block_count has type {found}, expected an integer"
    ):
        qllama.load(p)


def test_E31_float_key_of_the_wrong_type(tiny: Path, tmp_path: Path) -> None:
    eps = "llama.attention.layer_norm_rms_epsilon"
    p = rewrite(tiny, tmp_path / "bad.gguf", kv={eps: u32(1)})
    with pytest.raises(ModelConfigError, match=f"key {eps} has type UINT32, expected a float"):
        qllama.load(p)
    p = rewrite(tiny, tmp_path / "ok.gguf", kv={eps: GGUFValue(ValueType.FLOAT64, 1e-5)})
    assert qllama.load(p).config.eps == 1e-5


@pytest.mark.parametrize("vtype", sorted(t.name for t in INTEGER_VALUE_TYPES))
def test_E31_every_integer_width_is_accepted(tiny: Path, tmp_path: Path, vtype: str) -> None:
    v = GGUFValue(ValueType[vtype], 2)
    p = rewrite(tiny, tmp_path / "ok.gguf", kv={"llama.block_count": v})
    assert qllama.load(p).config.n_layer == 2


OUT_OF_RANGE = [
    ("block-count-0", {"block_count": u32(0)}, r"block_count is 0, outside \[1, 512\]"),
    ("block-count-513", {"block_count": u32(513)}, r"block_count is 513, outside \[1, 512\]"),
    ("block-count-2^32-1", {"block_count": u32(2**32 - 1)}, "is 4294967295, outside"),
    ("block-count-negative", {"block_count": GGUFValue(ValueType.INT32, -1)}, "is -1, outside"),
    ("head-count-0", {"attention.head_count": u32(0)}, r"head_count is 0, outside \[1, 32\]"),
    ("head-count-kv-0", {"attention.head_count_kv": u32(0)}, r"head_count_kv is 0, outside"),
    ("embd-not-multiple", {"attention.head_count": u32(3)},
     "embedding_length 32 is not a multiple of head_count 3"),
    ("heads-not-multiple", {"attention.head_count": u32(4), "attention.head_count_kv": u32(3)},
     "head_count 4 is not a multiple of head_count_kv 3"),
    ("kv-heads-above-heads", {"attention.head_count_kv": u32(4)},
     r"head_count_kv is 4, outside \[1, 2\]"),
    ("odd-head-dim", {"attention.head_count": u32(32), "attention.head_count_kv": u32(32)},
     "head dimension 1 is odd"),
    ("context-0", {"context_length": u32(0)}, r"context_length is 0, outside \[1, 16777216\]"),
    ("context-absurd", {"context_length": GGUFValue(ValueType.UINT64, 2**40)}, "outside"),
    ("embedding-0", {"embedding_length": u32(0)}, r"embedding_length is 0, outside"),
    ("ffn-0", {"feed_forward_length": u32(0)}, r"feed_forward_length is 0, outside"),
    ("vocab-0", {"vocab_size": u32(0)}, r"vocab_size is 0, outside"),
    ("eps-0", {"attention.layer_norm_rms_epsilon": f32(0.0)}, "is 0.0, must be finite and > 0"),
    ("eps-negative", {"attention.layer_norm_rms_epsilon": f32(-1e-5)}, "must be finite and > 0"),
    ("eps-nan", {"attention.layer_norm_rms_epsilon": f32(float("nan"))}, "is nan, must be"),
    ("eps-inf", {"attention.layer_norm_rms_epsilon": f32(float("inf"))}, "is inf, must be"),
    ("rope-base-0", {"rope.freq_base": f32(0.0)}, "rope.freq_base is 0.0, must be finite"),
    ("rope-base-negative", {"rope.freq_base": f32(-10000.0)}, "must be finite and > 0"),
    ("rope-base-nan", {"rope.freq_base": f32(float("nan"))}, "rope.freq_base is nan"),
    ("partial-rope", {"rope.dimension_count": u32(8)}, "partial RoPE is not supported"),
]  # fmt: skip


@pytest.mark.parametrize(
    ("keys", "message"), [c[1:] for c in OUT_OF_RANGE], ids=[c[0] for c in OUT_OF_RANGE]
)
def test_E32_value_out_of_range(
    tiny: Path, tmp_path: Path, keys: dict[str, Any], message: str
) -> None:
    p = rewrite(tiny, tmp_path / "bad.gguf", kv={f"llama.{k}": v for k, v in keys.items()})
    with pytest.raises(ModelConfigError, match=message):
        qllama.load(p)


def _peak_of(fn: Callable[[], Any]) -> int:
    tracemalloc.start()
    try:
        fn()
    finally:
        peak = tracemalloc.get_traced_memory()[1]
        tracemalloc.stop()
    return peak


def test_E32_checks_come_before_allocations(tiny: Path, tmp_path: Path) -> None:
    """512 layers and a context of 2^24 are legal; the file, 2 layers and a few KB, decides
    what gets allocated, never the numbers alone."""
    p = rewrite(tiny, tmp_path / "many-layers.gguf", kv={"llama.block_count": u32(512)})

    def refused() -> None:
        with pytest.raises(ModelConfigError, match="missing tensor 'blk.2.attn_norm.weight'"):
            qllama.load(p)

    assert _peak_of(refused) < 8 << 20
    p = rewrite(tiny, tmp_path / "long-context.gguf", kv={"llama.context_length": u32(2**24)})

    def long_context() -> None:
        m = qllama.load(p)
        assert m.n_ctx == 2**24
        m.forward([1, 2, 3])  # RoPE tables grow with the cache, not to 2^24 positions at once

    assert _peak_of(long_context) < 64 << 20


# --- E33-E35: tensors -------------------------------------------------------------------------


@pytest.mark.parametrize(
    "name", ["blk.1.ffn_down.weight", "blk.0.attn_norm.weight", "token_embd.weight",
             "output_norm.weight"],
)  # fmt: skip
def test_E33_missing_tensor(tiny: Path, tmp_path: Path, name: str) -> None:
    p = rewrite(tiny, tmp_path / "bad.gguf", tensors={name: DROP})
    with pytest.raises(ModelConfigError, match=f"missing tensor '{name}'"):
        qllama.load(p)


def test_E33_renamed_tensor_is_missing_and_extra(tiny: Path, tmp_path: Path) -> None:
    p = rewrite(tiny, tmp_path / "bad.gguf", rename={"blk.0.attn_q.weight": "blk.0.attn_qq.weight"})
    with pytest.raises(ModelConfigError, match="missing tensor 'blk.0.attn_q.weight'"):
        qllama.load(p)


@pytest.mark.parametrize(
    "name", ["rope_factors_long.weight", "blk.0.ffn_gate_inp.weight", "blk.1.attn_q_norm.weight"]
)
def test_E33_unused_tensors_are_refused(tiny: Path, tmp_path: Path, name: str) -> None:
    """A tensor the llama model would not use (LongRoPE factors, an expert router, a norm of
    another family) means wrong numbers if ignored: refused, naming it."""
    p = rewrite(tiny, tmp_path / "extra.gguf", tensors={name: (np.ones(8, np.float32), "F32")})
    with pytest.raises(ModelConfigError, match=f"1 tensor.* not used by the llama model: '{name}'"):
        qllama.load(p)


def test_E33_rope_freqs_are_used(tiny: Path, tmp_path: Path) -> None:
    """Llama 3.1's rope_freqs.weight (head_dim / 2 factors) is part of the llama model."""
    factors = np.linspace(1, 8, 8, dtype=np.float32)
    p = rewrite(tiny, tmp_path / "rope.gguf", tensors={"rope_freqs.weight": (factors, "F32")})
    ids = [1, 2, 3, 4, 5, 6, 7, 8]
    m = qllama.load(p)
    assert m.config.rope_freqs
    plain = np.asarray(qllama.load(tiny).forward(ids))
    assert np.abs(np.asarray(m.forward(ids)) - plain).max() > 1e-4  # the angles changed
    bad = rewrite(tiny, tmp_path / "bad.gguf", tensors={"rope_freqs.weight": _f32((16,))})
    with pytest.raises(
        TensorShapeError, match=r"'rope_freqs.weight' has shape \[16\], expected \[8\]"
    ):
        qllama.load(bad)


def test_E33_missing_output_means_tied(tiny: Path, tmp_path: Path) -> None:
    p = rewrite(tiny, tmp_path / "tied.gguf", tensors={"output.weight": DROP})
    m = qllama.load(p)
    assert m.weights.output is m.weights.token_embd


def _f32(shape: tuple[int, ...]) -> tuple[np.ndarray, str]:
    return np.zeros(shape, np.float32), "F32"


WRONG_SHAPES = [
    ("attn-k-transposed", "blk.0.attn_k.weight", _f32((32, 16)), [32, 16], [16, 32]),
    ("attn-q-short", "blk.1.attn_q.weight", _f32((16, 32)), [16, 32], [32, 32]),
    ("ffn-up", "blk.0.ffn_up.weight", _f32((32, 32)), [32, 32], [64, 32]),
    ("ffn-down-transposed", "blk.1.ffn_down.weight", _f32((64, 32)), [64, 32], [32, 64]),
    ("token-embd-width", "token_embd.weight", _f32((N_VOCAB, 64)), [N_VOCAB, 64], [N_VOCAB, 32]),
    ("norm-2d", "blk.0.attn_norm.weight", _f32((2, 32)), [2, 32], [32]),
    ("norm-long", "output_norm.weight", _f32((64,)), [64], [32]),
    ("3-d", "blk.0.attn_v.weight", _f32((2, 16, 32)), [2, 16, 32], [16, 32]),
]  # fmt: skip


@pytest.mark.parametrize(
    ("name", "new", "got", "want"), [c[1:] for c in WRONG_SHAPES], ids=[c[0] for c in WRONG_SHAPES]
)
def test_E34_tensor_of_the_wrong_shape(
    tiny: Path, tmp_path: Path, name: str, new: Any, got: list[int], want: list[int]
) -> None:
    p = rewrite(tiny, tmp_path / "bad.gguf", tensors={name: new})
    with pytest.raises(
        TensorShapeError, match=rf"tensor '{name}' has shape \[{', '.join(map(str, got))}\], "
        rf"expected \[{', '.join(map(str, want))}\]"
    ):  # fmt: skip
        qllama.load(p)


def test_E34_a_shape_padded_with_ones_is_the_shape(tiny: Path, tmp_path: Path) -> None:
    """ggml pads every shape with 1s: llama.cpp loads ne [32, 1] as {32} and [32, 16, 1] as
    {32, 16} (the converter writes qwen2moe's shared-expert gate so); so does qllama, with the
    same numbers."""
    f = qllama.read_gguf(tiny)
    norm = f.tensor_data("blk.0.attn_norm.weight").view("<f4").reshape(1, 32)
    v = f.tensors["blk.0.attn_v.weight"]
    padded = {
        "blk.0.attn_norm.weight": (norm.copy(), "F32"),
        "blk.0.attn_v.weight": (f.tensor_data(v.name).copy(), v.ggml_type.name, (1, 16, 32)),
    }
    p = rewrite(tiny, tmp_path / "padded.gguf", tensors=padded)
    assert qllama.read_gguf(p).tensors["blk.0.attn_v.weight"].ne == (32, 16, 1)
    ids = [1, 2, 3, 4]
    want = np.asarray(qllama.load(tiny).forward(ids, all_logits=True))
    np.testing.assert_array_equal(np.asarray(qllama.load(p).forward(ids, all_logits=True)), want)


def test_E34_norm_of_a_quantized_type(tiny: Path, tmp_path: Path) -> None:
    q = quants.quantize(np.ones((1, 32), np.float32), "Q8_0")
    p = rewrite(tiny, tmp_path / "bad.gguf", tensors={"blk.1.ffn_norm.weight": (q, "Q8_0", (32,))})
    with pytest.raises(TensorShapeError, match="'blk.1.ffn_norm.weight' is Q8_0; norm weights"):
        qllama.load(p)


def _vocabulary_of(path: Path, extra: int) -> dict[str, Any]:
    """The file's tokens and token types with ``extra`` more (or fewer) entries."""
    f = read_gguf(path)
    tokens = list(f.get("tokenizer.ggml.tokens"))
    types = np.array(f.get("tokenizer.ggml.token_type"))
    f.close()
    if extra >= 0:
        tokens += [f"<extra_{i}>" for i in range(extra)]
        types = np.concatenate([types, np.ones(extra, np.int32)])
    else:
        tokens, types = tokens[:extra], types[:extra]
    return {"tokenizer.ggml.tokens": tokens, "tokenizer.ggml.token_type": types}


def test_E35_vocabulary_longer_than_the_embedding(tiny: Path, tmp_path: Path) -> None:
    p = rewrite(tiny, tmp_path / "bad.gguf", kv=_vocabulary_of(tiny, 1))
    with pytest.raises(
        TensorShapeError,
        match=f"the vocabulary has {N_VOCAB + 1} tokens but token_embd.weight has {N_VOCAB} rows",
    ):
        qllama.load(p)


def test_E35_embedding_rows_differ_from_the_vocabulary(tiny: Path, tmp_path: Path) -> None:
    """Without vocab_size the vocabulary sets n_vocab, and the embedding must match it."""
    kv = {**_vocabulary_of(tiny, 1), "llama.vocab_size": DROP}
    p = rewrite(tiny, tmp_path / "bad.gguf", kv=kv)
    with pytest.raises(
        TensorShapeError,
        match=rf"'token_embd.weight' has shape \[{N_VOCAB}, 32\], expected \[{N_VOCAB + 1}, 32\]",
    ):
        qllama.load(p)


def test_E35_the_32005_versus_32000_case(tiny: Path, tmp_path: Path) -> None:
    p = rewrite(tiny, tmp_path / "bad.gguf", kv={"llama.vocab_size": u32(N_VOCAB + 5)})
    with pytest.raises(TensorShapeError, match=rf"expected \[{N_VOCAB + 5}, 32\]"):
        qllama.load(p)


def test_E35_output_rows_differ_from_the_vocabulary(tiny: Path, tmp_path: Path) -> None:
    out = quants.quantize(np.zeros((N_VOCAB - 1, 32), np.float32), "Q8_0")
    p = rewrite(
        tiny, tmp_path / "bad.gguf", tensors={"output.weight": (out, "Q8_0", (N_VOCAB - 1, 32))}
    )
    with pytest.raises(
        TensorShapeError,
        match=rf"'output.weight' has shape \[{N_VOCAB - 1}, 32\], expected \[{N_VOCAB}, 32\]",
    ):
        qllama.load(p)


# --- E36: non-finite weights --------------------------------------------------------------------

NAN16, INF16, NEG_INF16 = b"\x00\x7e", b"\x00\x7c", b"\x00\xfc"
Q8_0_BLOCK = 34  # f16 scale, then 32 int8


def _set_bytes(target: str, at: int, value: bytes) -> Callable[[str, np.ndarray], np.ndarray]:
    def patch(name: str, raw: np.ndarray) -> np.ndarray:
        if name == target:
            raw[at : at + len(value)] = np.frombuffer(value, np.uint8)
        return raw

    return patch


NON_FINITE = [
    ("q8_0-scale-nan", "blk.0.attn_q.weight", 3 * Q8_0_BLOCK, NAN16, 3),
    ("q8_0-scale-inf", "token_embd.weight", 100 * Q8_0_BLOCK, INF16, 100),
    ("q8_0-scale-neg-inf", "output.weight", 0, NEG_INF16, 0),
    ("f32-norm-nan", "blk.1.ffn_norm.weight", 4 * 5, struct.pack("<f", float("nan")), 5),
    ("f32-norm-inf", "output_norm.weight", 4 * 31, struct.pack("<f", float("inf")), 31),
]  # fmt: skip


@pytest.mark.parametrize(
    ("name", "at", "value", "block"), [c[1:] for c in NON_FINITE], ids=[c[0] for c in NON_FINITE]
)
def test_E36_non_finite_scale_or_weight(
    tiny: Path, tmp_path: Path, name: str, at: int, value: bytes, block: int
) -> None:
    p = rewrite(tiny, tmp_path / "bad.gguf", patch=_set_bytes(name, at, value))
    with pytest.raises(
        WeightValueError, match=f"tensor '{name}' block {block} has a non-finite scale or value"
    ):
        qllama.load(p)
    qllama.load(p, check_weights=False)  # the check can be turned off: then it loads


def test_E36_non_finite_f16_embedding(tiny: Path, tmp_path: Path) -> None:
    embd = np.zeros((N_VOCAB, 32), np.float16)
    embd[7, 3] = np.inf
    p = rewrite(tiny, tmp_path / "bad.gguf", tensors={"token_embd.weight": (embd, "F16")})
    # a float type's "block" is one element: row 7, column 3
    with pytest.raises(WeightValueError, match="'token_embd.weight' block 227 "):
        qllama.load(p)


# --- F37-F39 at file level: the tokenizer is checked by load too ---------------------------------


@pytest.mark.parametrize(
    ("kv", "error", "message"),
    [
        ({"tokenizer.ggml.tokens": DROP}, TokenizerError, "tokenizer.ggml.tokens is missing"),
        ({"tokenizer.ggml.model": DROP}, TokenizerError, "the file has no vocabulary"),
        ({"tokenizer.ggml.bos_token_id": u32(N_VOCAB)}, TokenizerError, "bos_token_id = 269"),
        ({"tokenizer.ggml.token_type": np.ones(N_VOCAB, np.uint8)}, TokenizerError,
         "token_type has type array of uint8, expected array of int32"),
        ({"tokenizer.ggml.merges": ["Ġ t", "Ġt"]}, TokenizerError, r"merges\[1\] = 'Ġt' has no"),
    ],
)  # fmt: skip
def test_F37_F38_bad_vocabulary_through_load(
    tiny: Path, tmp_path: Path, kv: dict[str, Any], error: type[Exception], message: str
) -> None:
    p = rewrite(tiny, tmp_path / "bad.gguf", kv=kv)
    with pytest.raises(error, match=message):
        qllama.load(p)


def test_F39_invalid_utf8_in_a_token_string(tiny: Path, tmp_path: Path) -> None:
    data = bytearray(tiny.read_bytes())
    at = data.index(struct.pack("<Q", 2) + b"he")  # the token "he", before the merges
    data[at + 8] = 0xFF
    p = tmp_path / "bad.gguf"
    p.write_bytes(bytes(data))
    with pytest.raises(GGUFFormatError, match=r"element \d+ of key 'tokenizer.ggml.tokens'"):
        qllama.load(p)


# --- global contract: (e) all or nothing, (f) no assert ----------------------------------------


def test_refused_loads_leave_no_open_file(
    tiny: Path, tmp_path: Path, open_files: Callable[[Path], int]
) -> None:
    p = rewrite(tiny, tmp_path / "bad.gguf", tensors={"blk.1.ffn_down.weight": DROP})
    before = open_files(p)
    for _ in range(20):
        with pytest.raises(ModelConfigError):
            qllama.load(p)
    assert open_files(p) == before


def test_checks_survive_python_O(tiny: Path, tmp_path: Path) -> None:
    """``python -O`` strips asserts: no check may be one."""
    bad = {
        "config": rewrite(tiny, tmp_path / "c.gguf", kv={"llama.block_count": u32(0)}),
        "shape": rewrite(tiny, tmp_path / "s.gguf", tensors={"blk.0.ffn_up.weight": _f32((2, 32))}),
        "scale": rewrite(tiny, tmp_path / "w.gguf", patch=_set_bytes("output.weight", 0, NAN16)),
        "header": tmp_path / "h.gguf",
    }
    bad["header"].write_bytes(b"GGUF" + struct.pack("<IQQ", 3, 2**62, 0))
    code = (
        "import sys, qllama\n"
        "for p in sys.argv[1:]:\n"
        "    try:\n"
        "        qllama.load(p)\n"
        "    except qllama.QllamaError as e:\n"
        "        print(type(e).__name__)\n"
    )
    out = subprocess.run(
        [sys.executable, "-O", "-c", code, *map(str, bad.values())],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.split()
    assert out == ["ModelConfigError", "TensorShapeError", "WeightValueError", "GGUFSizeError"]


def test_every_model_error_is_a_qllama_error() -> None:
    for cls in (ModelConfigError, TensorShapeError, WeightValueError, TokenizerError):
        assert issubclass(cls, QllamaError) and issubclass(cls, ValueError)


def test_no_warning_for_a_clean_file(tiny: Path) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        qllama.load(tiny)


def test_f16_norms_are_fine(tiny: Path, tmp_path: Path) -> None:
    """Half-precision norms are allowed (only quantized ones are refused); they load as f32."""
    norm = np.ones(32, np.float16)
    p = rewrite(tiny, tmp_path / "f16.gguf", tensors={"output_norm.weight": (norm, GGMLType.F16)})
    m = qllama.load(p)
    assert np.asarray(m.weights.output_norm).dtype == np.float32
