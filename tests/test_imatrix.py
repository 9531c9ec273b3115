"""Importance matrices: computing one as llama-imatrix does, both file formats, and refusing
malformed ones."""

from __future__ import annotations

import struct

import numpy as np
import pytest

from qllama.backends.numpy.dispatch import NumpyBackend
from qllama.errors import ImatrixError
from qllama.gguf import imatrix
from qllama.gguf.reader import read_gguf
from qllama.gguf.writer import GGUFWriter
from qllama.measure import importance
from qllama.runtime.loader import load
from qllama.runtime.model import rms_norm
from qllama.synthetic import TinyConfig, write_tiny_llama

F32 = np.float32
CTX = 32
TEXT = "the cat sat on the mat, and then the dog ran after it. " * 40


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    path = tmp_path_factory.mktemp("im") / "tiny.gguf"
    write_tiny_llama(path, TinyConfig(n_embd=64, n_ff=128, tied=False, n_ctx=128))
    return path


@pytest.fixture(scope="module")
def matrix(tiny):
    return importance.from_corpus(tiny, TEXT, n_ctx=CTX, dataset="corpus.txt")


def test_entries_are_the_block_matmuls(matrix):
    names = sorted(matrix.entries)
    parts = ["attn_k", "attn_output", "attn_q", "attn_v", "ffn_down", "ffn_gate", "ffn_up"]
    assert names == sorted(f"blk.{i}.{p}.weight" for i in range(2) for p in parts)
    assert matrix.chunk_size == CTX and matrix.datasets == ["corpus.txt"]
    n_chunks = matrix.chunk_count
    for name, e in matrix.entries.items():
        assert e.counts.tolist() == [n_chunks * CTX], name
        assert e.sums.shape == (1, 128 if "ffn_down" in name else 64)


def test_sums_are_the_squares_of_the_activations_in_token_order(tiny, matrix):
    """blk.0.attn_q's input is the first attention norm of the embeddings: its squares summed
    row by row in float32 over every chunk, exactly."""
    model = load(tiny, backend="numpy")
    tokens = importance.tokenize(model.tokenizer, TEXT)
    emb = model.source.tensor_data("token_embd.weight").view("<f4").reshape(-1, 64)
    norm = model.weights.layers[0].attn_norm
    acc = np.zeros(64, F32)
    for i in range(matrix.chunk_count):
        chunk = tokens[i * CTX : (i + 1) * CTX]
        if model.tokenizer.add_bos:
            chunk[0] = model.tokenizer.bos_id
        x = rms_norm(emb[chunk], norm, model.config.eps, xp=np)
        for row in x * x:
            acc += row
    np.testing.assert_array_equal(matrix.entries["blk.0.attn_q.weight"].sums[0], acc)
    np.testing.assert_array_equal(matrix.entries["blk.0.attn_k.weight"].sums[0], acc)


class _Recorder:
    """A stand-in model: records the chunks it is asked to run."""

    def __init__(self, add_bos: bool) -> None:
        class Tok:
            bos_id = 1

        self.tokenizer = Tok()
        self.tokenizer.add_bos = add_bos
        self.backend = importance.Collector(NumpyBackend(kernels="numpy"))
        self.chunks: list[list[int]] = []

    def forward(self, ids, pos, *, all_logits):
        assert pos == 0 and all_logits
        self.chunks.append(list(ids))


@pytest.mark.parametrize("add_bos", [False, True])
def test_chunks_start_over_with_bos_and_drop_the_tail(add_bos):
    model = _Recorder(add_bos)
    tokens = list(range(10, 10 + 3 * 20 + 7))
    importance.compute(model, tokens, n_ctx=20)
    assert len(model.chunks) == 3  # the 7 left over are not run
    for i, chunk in enumerate(model.chunks):
        want = tokens[i * 20 : (i + 1) * 20]
        if add_bos:
            want[0] = 1
        assert chunk == want
    model = _Recorder(add_bos)
    importance.compute(model, tokens, n_ctx=20, n_chunks=2)
    assert len(model.chunks) == 2


def test_skipped_chunks_are_not_run():
    # llama-imatrix --chunk N: the first N chunks' tokens are dropped before chunking
    model = _Recorder(False)
    tokens = list(range(5 * 20 + 3))
    importance.compute(model, tokens, n_ctx=20, skip_chunks=2)
    assert model.chunks == [tokens[40:60], tokens[60:80], tokens[80:100]]
    model = _Recorder(False)
    importance.compute(model, tokens, n_ctx=20, n_chunks=1, skip_chunks=3)
    assert model.chunks == [tokens[60:80]]
    # refused, as llama-imatrix does, unless more than two chunks' tokens are left
    with pytest.raises(ImatrixError, match="after skipping 4 chunks"):
        importance.compute(_Recorder(False), list(range(6 * 20)), n_ctx=20, skip_chunks=4)
    with pytest.raises(ImatrixError, match="skip_chunks must be 0 or more"):
        importance.compute(_Recorder(False), tokens, n_ctx=20, skip_chunks=-1)


def test_too_short_a_corpus_is_refused():
    with pytest.raises(ImatrixError, match="at least 2 \\* n_ctx = 40"):
        importance.compute(_Recorder(False), list(range(39)), n_ctx=20)


def test_short_batches_are_not_collected(tiny):
    # llama-imatrix ignores matmuls of fewer than 16 rows
    m = importance.from_corpus(tiny, TEXT, n_ctx=8, n_chunks=3)
    assert m.entries == {} and m.chunk_count == 0


def test_output_is_collected_when_asked(tiny):
    m = importance.from_corpus(tiny, TEXT, n_ctx=CTX, n_chunks=2, process_output=True)
    assert m.entries["output.weight"].counts.tolist() == [2 * CTX]


# --- files --------------------------------------------------------------------------------------


def test_gguf_layout_and_round_trip(matrix, tmp_path):
    path = tmp_path / "im.gguf"
    imatrix.write_imatrix(path, matrix)
    f = read_gguf(path)
    assert list(f.kv) == [
        "general.type",
        "imatrix.datasets",
        "imatrix.chunk_count",
        "imatrix.chunk_size",
    ]
    assert f.get("general.type") == "imatrix" and f.get("imatrix.chunk_size") == CTX
    names = [t.name for t in f]
    assert names[:2] == ["blk.0.attn_k.weight.in_sum2", "blk.0.attn_k.weight.counts"]
    assert f.tensor("blk.0.ffn_down.weight.in_sum2").ne == (128, 1)
    assert f.tensor("blk.0.ffn_down.weight.counts").ne == (1, 1)
    back = imatrix.read_imatrix(path)
    assert not back.legacy and back.chunk_count == matrix.chunk_count
    for name, e in matrix.entries.items():
        np.testing.assert_array_equal(back.entries[name].sums, e.sums)
        np.testing.assert_array_equal(back.entries[name].counts, e.counts)
    for name, v in back.means().items():
        e = matrix.entries[name]
        np.testing.assert_array_equal(v, (e.sums / F32(e.counts[0])).reshape(-1))


def test_legacy_layout_and_round_trip(matrix, tmp_path):
    path = tmp_path / "im.dat"
    imatrix.write_imatrix(path, matrix)
    raw = path.read_bytes()
    (n,) = struct.unpack_from("<i", raw, 0)
    assert n == len(matrix.entries)
    (size,) = struct.unpack_from("<i", raw, 4)
    assert raw[8 : 8 + size] == b"blk.0.attn_k.weight"
    ncall, nval = struct.unpack_from("<ii", raw, 8 + size)
    assert ncall == matrix.chunk_count and nval == 64  # counts / chunk size, rounded up
    assert raw.endswith(struct.pack("<ii", matrix.chunk_count, 10) + b"corpus.txt")
    back = imatrix.read_imatrix(path)
    assert (
        back.legacy and back.datasets == ["corpus.txt"] and back.chunk_count == matrix.chunk_count
    )
    gguf = matrix.means()
    for name, v in back.means().items():
        # (sum / count) * ncall / ncall: two float32 roundings more than sum / count, each
        # at most half an ulp, so at most 2 ulps apart (relative 2 * 2**-23)
        np.testing.assert_allclose(v, gguf[name], rtol=2 * 2.0**-23, atol=0)


def _write_gguf(path, kv=None, tensors=()):
    w = GGUFWriter()
    base = {"general.type": "imatrix", "imatrix.datasets": ["x"]}
    for k, v in {**base, **(kv or {})}.items():
        if v is not None:
            w.add(k, v)
    from qllama.ggml_types import ValueType
    from qllama.gguf.reader import GGUFValue

    if not kv or "imatrix.chunk_count" not in kv:
        w.add("imatrix.chunk_count", GGUFValue(ValueType.UINT32, 1))
    if not kv or "imatrix.chunk_size" not in kv:
        w.add("imatrix.chunk_size", GGUFValue(ValueType.UINT32, 512))
    for name, arr, gtype in tensors:
        w.add_tensor(name, arr, gtype)
    w.write(path)
    return path


GOOD = [
    ("blk.0.w.in_sum2", np.ones((1, 8), F32), "F32"),
    ("blk.0.w.counts", np.full((1, 1), 4, F32), "F32"),
]


@pytest.mark.parametrize(
    ("kv", "tensors", "message"),
    [
        ({"imatrix.chunk_size": None}, GOOD, "missing imatrix metadata imatrix.chunk_size"),
        ({"general.type": "model"}, GOOD, "general.type 'model'"),
        ({"imatrix.datasets": 3}, GOOD, "array of strings"),
        ({}, [], "no data"),
        ({}, GOOD[:1], "mismatched sums and counts"),
        ({}, [GOOD[0], ("blk.0.w.counts", np.ones((1, 1), np.float16), "F16")], "must be F32"),
        (
            {},
            [
                ("blk.0.w.in_sum2", np.ones((1, 7), F32), "F32"),
                ("blk.0.w.counts", np.ones((2, 1), F32), "F32"),
            ],
            "do not divide",
        ),
        (
            {},
            [("blk.0.w.in_sum2", np.full((1, 8), np.nan, F32), "F32"), GOOD[1]],
            "non-finite sums",
        ),
        ({}, [GOOD[0], ("blk.0.w.counts", np.full((1, 1), -1, F32), "F32")], "negative counts"),
        ({}, [*GOOD, ("token_embd.weight", np.ones((2, 2), F32), "F32")], "neither"),
    ],
)
def test_malformed_gguf_imatrices_are_refused(tmp_path, kv, tensors, message):
    path = _write_gguf(tmp_path / "bad.gguf", kv, tensors)
    with pytest.raises(ImatrixError, match=message):
        imatrix.read_imatrix(path)


def _legacy(*entries, trailer=b""):
    out = struct.pack("<i", len(entries))
    for name, ncall, values in entries:
        out += struct.pack("<i", len(name)) + name + struct.pack("<ii", ncall, len(values))
        out += np.asarray(values, "<f4").tobytes()
    return out + trailer


@pytest.mark.parametrize(
    ("data", "message"),
    [
        (b"", "truncated"),
        (struct.pack("<i", 0), "0 entries"),
        (_legacy((b"w", 1, [1.0, 2.0]))[:-3], "truncated"),
        (_legacy((b"w", 1, [np.nan])), "non-finite"),
        (_legacy((b"w", 1, [1.0]), (b"w", 1, [1.0])), "appears twice"),
        (_legacy((b"w", 1, [1.0]), trailer=struct.pack("<ii", 1, 1) + b"ab"), "after the end"),
        (_legacy((b"\xff", 1, [1.0])), "not UTF-8"),
        (struct.pack("<i", 2**30) + b"\0" * 32, "cannot fit"),
    ],
)
def test_malformed_legacy_imatrices_are_refused(tmp_path, data, message):
    path = tmp_path / "bad.dat"
    path.write_bytes(data)
    with pytest.raises(ImatrixError, match=message):
        imatrix.read_imatrix(path)


def test_legacy_values_are_divided_by_ncall(tmp_path):
    path = tmp_path / "im.dat"
    path.write_bytes(_legacy((b"a", 4, [2.0, 6.0]), (b"b", 0, [3.0]), trailer=struct.pack("<i", 7)))
    m = imatrix.read_imatrix(path)
    assert m.chunk_count == 7 and m.datasets == []
    means = m.means()
    assert means["a"].tolist() == [0.5, 1.5] and means["b"].tolist() == [3.0]


def test_a_slice_without_tokens_counts_as_ones(tmp_path):
    path = _write_gguf(
        tmp_path / "moe.gguf",
        tensors=[
            ("blk.0.ffn_up_exps.weight.in_sum2", np.array([[2.0, 4.0], [5.0, 5.0]], F32), "F32"),
            ("blk.0.ffn_up_exps.weight.counts", np.array([[2.0], [0.0]], F32), "F32"),
        ],
    )
    means = imatrix.read_imatrix(path).means()
    assert means["blk.0.ffn_up_exps.weight"].tolist() == [1.0, 2.0, 1.0, 1.0]


def test_entries_must_fit_the_model(matrix):
    shapes = {
        f"blk.{i}.{p}.weight": (64, 128 if p == "ffn_down" else 64)
        for i in range(2)
        for p in ["attn_k", "attn_output", "attn_q", "attn_v", "ffn_down", "ffn_gate", "ffn_up"]
    }
    assert set(matrix.for_tensors(shapes)) == set(shapes)
    with pytest.raises(ImatrixError, match="match no tensor of the model: blk.1"):
        matrix.for_tensors({k: v for k, v in shapes.items() if not k.startswith("blk.1.")})
    with pytest.raises(ImatrixError, match="'blk.0.attn_q.weight' has 64 values; .* needs 32"):
        matrix.for_tensors({**shapes, "blk.0.attn_q.weight": (64, 32)})
