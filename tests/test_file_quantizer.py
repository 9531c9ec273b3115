"""File quantization: llama.cpp's per-tensor type choice, metadata, and the written bytes."""

from __future__ import annotations

from collections import Counter

import numpy as np
import pytest

from qllama import quants
from qllama.errors import ModelConfigError, QllamaError, UnsupportedTensorTypeError
from qllama.ggml_types import GGMLType
from qllama.gguf.quantizer import (
    FILE_TYPES,
    Overrides,
    plan,
    quantize_file,
    use_more_bits,
    visit_order,
)
from qllama.gguf.reader import read_gguf
from qllama.gguf.writer import GGUFWriter
from qllama.synthetic import TinyConfig, write_tiny_llama

# SmolLM2-135M's divisibility pattern at a tiny size: 30 layers, rows of 64 (not a multiple
# of 256, like 576) and an FFN of 256 (a multiple, like 1536), tied embeddings.
SMOLLM_LIKE = TinyConfig(n_layer=30, n_embd=64, n_ff=256, n_head=4, n_head_kv=2)


@pytest.fixture(scope="module")
def smollm_like(tmp_path_factory):
    path = tmp_path_factory.mktemp("q") / "f32.gguf"
    write_tiny_llama(path, SMOLLM_LIKE)
    return read_gguf(path)


def test_use_more_bits_matches_llama_cpp_on_30_layers():
    assert [i for i in range(30) if use_more_bits(i, 30)] == [
        0,
        1,
        2,
        5,
        8,
        11,
        14,
        17,
        20,
        23,
        26,
        27,
        28,
        29,
    ]


def test_visit_order_is_layer_then_name():
    names = ["blk.10.a", "blk.2.b", "output_norm.weight", "blk.2.a", "token_embd.weight"]
    assert visit_order(names) == [
        "output_norm.weight",
        "token_embd.weight",
        "blk.2.a",
        "blk.2.b",
        "blk.10.a",
    ]


def test_q4_k_m_composition_is_smollm2s(smollm_like):
    types = plan(smollm_like, "Q4_K_M")
    # the composition of a llama.cpp Q4_K_M SmolLM2 file (docs/formats.md)
    assert Counter(t.name for t in types.values()) == {
        "Q5_0": 166,
        "F32": 61,
        "Q4_K": 16,
        "Q8_0": 15,
        "Q6_K": 14,
    }
    more = {0, 1, 2, 5, 8, 11, 14, 17, 20, 23, 26, 27, 28, 29}
    for i in range(30):
        assert types[f"blk.{i}.ffn_down.weight"].name == ("Q6_K" if i in more else "Q4_K")
        assert types[f"blk.{i}.attn_v.weight"].name == ("Q8_0" if i in more else "Q5_0")
    assert types["token_embd.weight"].name == "Q8_0"


def test_tensor_type_overrides_replace_the_mixture(smollm_like):
    """llama-quantize --tensor-type: the first pattern found in a name decides that tensor
    (the shape fallback still applies), and the mixture's counters skip it: blk.0's attn_v
    overridden, blk.1's is the mixture's first attn_v (i = 0: more bits), blk.2's its second."""
    stock = plan(smollm_like, "Q4_K_M")
    o = Overrides.parse([r"blk\.0\.attn_v=q4_k", "FFN_UP=Q5_K", "ffn_up=q8_0"])
    types = plan(smollm_like, "Q4_K_M", overrides=o)
    assert types["blk.0.attn_v.weight"] == GGMLType.Q5_0  # Q4_K, rows of 64: its fallback
    assert {types[f"blk.{i}.ffn_up.weight"] for i in range(30)} == {GGMLType.Q5_1}  # Q5_K's
    assert types["blk.1.attn_v.weight"] == stock["blk.0.attn_v.weight"] == GGMLType.Q8_0
    assert types["blk.3.attn_v.weight"] == stock["blk.2.attn_v.weight"]
    assert types["blk.0.ffn_down.weight"] == stock["blk.0.ffn_down.weight"]  # not named
    assert o.as_arguments() == [
        "--tensor-type",
        r"blk\.0\.attn_v=q4_k",
        "--tensor-type",
        "ffn_up=q5_k",
        "--tensor-type",
        "ffn_up=q8_0",
    ]


def test_the_tables_types_and_pure(smollm_like):
    o = Overrides.parse(token_embedding_type="q4_0", output_tensor_type="Q6_K")
    assert plan(smollm_like, "Q4_K_M", overrides=o)["token_embd.weight"] == GGMLType.Q4_0
    tied = Overrides.parse(output_tensor_type="q5_0")  # tied: token_embd is the output
    assert plan(smollm_like, "Q4_K_M", overrides=tied)["token_embd.weight"] == GGMLType.Q5_0
    pure = plan(smollm_like, "Q4_K_M", overrides=Overrides(pure=True))
    assert {t for n, t in pure.items() if n.endswith("ffn_down.weight")} == {GGMLType.Q4_K}
    # rows of 64 (token_embd too: --pure skips the output rule): Q4_K falls back to Q5_0
    assert Counter(pure.values())[GGMLType.Q5_0] == 181
    for bad, message in (
        (["attn_v"], "give NAME=TYPE"),
        (["attn_v=q9_9"], "'q9_9' is not a GGML type"),
        (["(attn=q8_0"], "is no pattern"),
    ):
        with pytest.raises(QllamaError, match=message):
            Overrides.parse(bad)


@pytest.mark.parametrize(
    ("ftype", "expected"),
    [
        ("Q8_0", {"Q8_0": 211, "F32": 61}),
        ("F16", {"F16": 211, "F32": 61}),
        ("Q6_K", {"Q8_0": 181, "Q6_K": 30, "F32": 61}),
        ("Q2_K", {"Q4_0": 180, "Q3_K": 30, "Q8_0": 1, "F32": 61}),
        (
            "Q3_K_M",
            {"Q4_0": 120, "Q5_0": 58, "Q4_K": 29, "Q5_1": 2, "Q5_K": 1, "Q8_0": 1, "F32": 61},
        ),
        ("Q5_K_M", {"Q5_1": 166, "Q6_K": 14, "Q5_K": 16, "Q8_0": 15, "F32": 61}),
    ],
)
def test_other_file_types(smollm_like, ftype, expected):
    assert Counter(t.name for t in plan(smollm_like, ftype).values()) == expected


def test_untied_output_gets_q6_k_when_it_can(tmp_path):
    path = tmp_path / "untied.gguf"
    write_tiny_llama(path, TinyConfig(n_embd=256, n_ff=256, n_head=4, tied=False))
    types = plan(read_gguf(path), "Q4_K_M")
    assert types["output.weight"].name == "Q6_K"
    assert types["token_embd.weight"].name == "Q4_K"  # untied: left at the default


@pytest.mark.parametrize("ftype", ["Q8_0", "Q4_K_M"])
def test_quantized_file_holds_the_quantizers_bytes(smollm_like, tmp_path, ftype):
    out = tmp_path / f"{ftype}.gguf"
    result = quantize_file(smollm_like, out, ftype)
    q = read_gguf(out)
    assert list(q.tensors) == visit_order(list(smollm_like.tensors))
    assert q.get("general.file_type") == FILE_TYPES[ftype].value
    assert list(q.kv)[-2:] == ["general.quantization_version", "general.file_type"]
    assert q.get("tokenizer.ggml.tokens") == smollm_like.get("tokenizer.ggml.tokens")
    for name, t in q.tensors.items():
        src = smollm_like.tensor(name)
        assert t.ggml_type == result.types[name] and t.shape == src.shape
        x = quants.dequantize(smollm_like.tensor_data(name), src.ggml_type, src.shape)
        np.testing.assert_array_equal(q.tensor_data(name), quants.quantize(x, t.ggml_type).ravel())


def test_requantizing_dequantizes_first_and_copies_same_types(smollm_like, tmp_path):
    q8 = tmp_path / "q8.gguf"
    quantize_file(smollm_like, q8, "Q8_0")
    again = tmp_path / "q8-again.gguf"
    quantize_file(q8, again, "Q8_0")
    assert again.read_bytes() == q8.read_bytes()  # every tensor already Q8_0 or F32: copied
    q4 = tmp_path / "q4.gguf"
    quantize_file(q8, q4, "Q4_0")
    f8, f4 = read_gguf(q8), read_gguf(q4)
    t = f8.tensor("blk.0.attn_q.weight")
    x = quants.dequantize(f8.tensor_data(t.name), "Q8_0", t.shape)
    np.testing.assert_array_equal(f4.tensor_data(t.name), quants.quantize(x, "Q4_0").ravel())


def test_bad_requests(smollm_like, tmp_path):
    with pytest.raises(ModelConfigError, match="unknown file type 'Q9_X'"):
        quantize_file(smollm_like, tmp_path / "x.gguf", "Q9_X")
    w = GGUFWriter()
    w.add("general.architecture", "llama")
    w.add_tensor("blk.0.attn_q.weight", np.zeros((2, 32), np.float32), "F32")
    w.write(tmp_path / "nolayers.gguf")
    with pytest.raises(ModelConfigError, match="key not found: llama.block_count"):
        quantize_file(tmp_path / "nolayers.gguf", tmp_path / "x.gguf", "Q8_0")
    w = GGUFWriter()
    w.add("general.architecture", "llama")
    w.add("llama.block_count", 1)
    w.add_tensor("blk.0.attn_q.weight", np.zeros((2, 2048), np.uint8), "F64", (2, 256))
    w.write(tmp_path / "iq.gguf")
    with pytest.raises(UnsupportedTensorTypeError, match="F64"):
        quantize_file(tmp_path / "iq.gguf", tmp_path / "x.gguf", "Q8_0")
    assert not (tmp_path / "x.gguf").exists()


# --- the issue-11 file types and importance matrices -----------------------------------------


@pytest.fixture(scope="module")
def smollm_imatrix(smollm_like, tmp_path_factory):
    """An importance matrix for every blk.* weight of the SmolLM2-like model (random, as a
    stand-in: the rules only look at its presence)."""
    from qllama.gguf.imatrix import Entry, ImportanceMatrix, write_imatrix

    rng = np.random.default_rng(0)
    entries = {
        t.name: Entry(np.exp(rng.normal(size=(1, t.ne[0]))).astype(np.float32) * 64, np.array([64]))
        for t in smollm_like
        if t.name.startswith("blk.") and len(t.ne) == 2
    }
    path = tmp_path_factory.mktemp("imatrix") / "im.gguf"
    write_imatrix(path, ImportanceMatrix(entries, ["corpus.txt"], 3, 512))
    return path


@pytest.mark.parametrize(
    ("ftype", "imatrix", "expected"),
    [
        # 64-wide rows fall back from IQ4_XS to IQ4_NL; ffn_down (rows of 256) keeps it, but
        # its first n/8 layers get Q5_K unless there is an importance matrix
        ("IQ4_XS", False, {"IQ4_NL": 180, "IQ4_XS": 27, "Q5_K": 3, "Q8_0": 1, "F32": 61}),
        ("IQ4_XS", True, {"IQ4_NL": 180, "IQ4_XS": 30, "Q8_0": 1, "F32": 61}),
        ("IQ4_NL", False, {"IQ4_NL": 207, "Q5_K": 3, "Q8_0": 1, "F32": 61}),
        # Q4_0 with an importance matrix guards the first n/8 ffn_down with Q4_1
        ("Q4_0", False, {"Q4_0": 210, "Q8_0": 1, "F32": 61}),
        ("Q4_0", True, {"Q4_0": 207, "Q4_1": 3, "Q8_0": 1, "F32": 61}),
        ("Q5_0", True, {"Q5_0": 207, "Q5_1": 3, "Q8_0": 1, "F32": 61}),
        ("TQ1_0", False, {"Q4_0": 180, "TQ1_0": 30, "Q8_0": 1, "F32": 61}),
        ("MXFP4_MOE", False, {"Q8_0": 211, "F32": 61}),  # no experts: everything Q8_0
    ],
)
def test_new_file_type_compositions(smollm_like, ftype, imatrix, expected):
    assert Counter(t.name for t in plan(smollm_like, ftype, imatrix=imatrix).values()) == expected


def test_quantizing_with_an_imatrix_uses_each_tensors_entry(smollm_like, smollm_imatrix, tmp_path):
    from qllama.gguf.imatrix import read_imatrix

    out = tmp_path / "iq4_xs.gguf"
    result = quantize_file(smollm_like, out, "IQ4_XS", imatrix=smollm_imatrix)
    assert result.without_imatrix == ["token_embd.weight"]  # quantized without, as llama.cpp
    q = read_gguf(out)
    assert list(q.kv)[-6:] == [
        "general.quantization_version",
        "general.file_type",
        "quantize.imatrix.file",
        "quantize.imatrix.dataset",
        "quantize.imatrix.entries_count",
        "quantize.imatrix.chunks_count",
    ]
    assert q.get("quantize.imatrix.file") == str(smollm_imatrix)
    assert q.get("quantize.imatrix.dataset") == "corpus.txt"
    assert q.get("quantize.imatrix.entries_count") == 210
    assert q.get("quantize.imatrix.chunks_count") == 3
    means = read_imatrix(smollm_imatrix).means()
    for name in ("blk.0.ffn_down.weight", "blk.7.attn_q.weight", "token_embd.weight"):
        t, src = q.tensor(name), smollm_like.tensor(name)
        x = quants.dequantize(smollm_like.tensor_data(name), src.ggml_type, src.shape)
        want = quants.quantize(x, t.ggml_type, imatrix=means.get(name))
        np.testing.assert_array_equal(q.tensor_data(name), want.ravel())


def test_low_bit_file_types_need_an_imatrix(smollm_like, smollm_imatrix, tmp_path):
    from qllama.errors import ImatrixError

    out = tmp_path / "x.gguf"
    # the first tensor that needs one: 64-wide ones fall back to IQ4_NL, the first 3 ffn_down
    # get IQ3_S
    with pytest.raises(ImatrixError, match="IQ2_M quantizes blk.3.ffn_down.weight to IQ2_S"):
        quantize_file(smollm_like, out, "IQ2_M")
    with pytest.raises(ImatrixError, match="Q2_K_S quantizes blk.3.ffn_down.weight to Q2_K"):
        quantize_file(smollm_like, out, "Q2_K_S")
    # with one, the grid types are named until their classes exist
    if "IQ2_S" not in quants.supported():
        with pytest.raises(UnsupportedTensorTypeError, match="IQ2_M, tensor .*IQ[23]_S"):
            quantize_file(smollm_like, out, "IQ2_M", imatrix=smollm_imatrix)
    assert not out.exists()


def test_file_types_llama_cpp_cannot_write(smollm_like, tmp_path):
    with pytest.raises(ModelConfigError, match="unknown file type 'NVFP4'"):
        quantize_file(smollm_like, tmp_path / "x.gguf", "NVFP4")
    # Q1_0's 128-blocks do not divide rows of 64 and have no fallback: llama.cpp throws too
    with pytest.raises(ModelConfigError, match="no fallback type for Q1_0"):
        quantize_file(smollm_like, tmp_path / "x.gguf", "Q1_0")
    assert FILE_TYPES["MXFP4_MOE"].value == 38 and plan(smollm_like, "q4_k")  # aliases


def test_experts_are_quantized_with_their_own_slice(tmp_path):
    from qllama.gguf.imatrix import Entry, ImportanceMatrix, write_imatrix

    rng = np.random.default_rng(1)
    w = GGUFWriter()
    w.add("general.architecture", "llama")
    w.add("llama.block_count", 1)
    w.add("llama.expert_count", 2)
    x = rng.normal(size=(2, 4, 256)).astype(np.float32)  # (experts, rows, row length)
    w.add_tensor("blk.0.ffn_up_exps.weight", x, "F32")
    w.write(tmp_path / "moe.gguf")
    qw = np.exp(rng.normal(size=(2, 256))).astype(np.float32)
    entry = Entry(qw * 8, np.array([8, 8]))
    write_imatrix(
        tmp_path / "im.gguf", ImportanceMatrix({"blk.0.ffn_up_exps.weight": entry}, [], 1, 8)
    )
    quantize_file(
        tmp_path / "moe.gguf", tmp_path / "q.gguf", "Q4_K_M", imatrix=tmp_path / "im.gguf"
    )
    got = read_gguf(tmp_path / "q.gguf").tensor_data("blk.0.ffn_up_exps.weight").reshape(2, -1)
    for e in range(2):
        np.testing.assert_array_equal(got[e], quants.quantize(x[e], "Q4_K", imatrix=qw[e]).ravel())


def test_a_vector_padded_with_ones_stays_a_vector(tmp_path):
    """The converter writes qwen2moe's ffn_gate_inp_shexp {n_embd} as [n_embd, 1]: llama.cpp
    drops the trailing 1 (ggml_n_dims), keeps it F32 as any vector, and writes it as
    [n_embd] (checked with llama-quantize on a converted Qwen2MoE file)."""
    w = GGUFWriter()
    w.add("general.architecture", "llama")
    w.add("llama.block_count", 1)
    gate = np.arange(64, dtype=np.float32).reshape(1, 64)  # numpy order of ne [64, 1]
    w.add_tensor("blk.0.ffn_gate_inp_shexp.weight", gate, "F32")
    w.add_tensor("blk.0.ffn_up.weight", np.ones((4, 64), np.float32), "F32")
    w.write(tmp_path / "m.gguf")
    quantize_file(tmp_path / "m.gguf", tmp_path / "q.gguf", "Q8_0")
    f = read_gguf(tmp_path / "q.gguf")
    t = f.tensors["blk.0.ffn_gate_inp_shexp.weight"]
    assert t.ggml_type == GGMLType.F32 and t.ne == (64,)
    np.testing.assert_array_equal(f.tensor_data(t.name).view("<f4"), gate.ravel())
    assert f.tensors["blk.0.ffn_up.weight"].ggml_type == GGMLType.Q8_0


def test_every_llama_quantize_name_parses():
    from qllama.gguf.quantizer import file_type

    assert file_type("F32").label == "F32" and file_type("f16").label == "F16"
    assert file_type("Q4_K").label == "Q4_K_M" and file_type("q3_k").label == "Q3_K_M"
    assert all(file_type(label).label == label for label in FILE_TYPES)
