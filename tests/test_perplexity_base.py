"""Base files: llama.cpp's uint16 format and qllama's float32 logits, streamed and checked."""

from __future__ import annotations

import struct
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from qllama.measure import kld_base, metrics

N_CTX, VOCAB, CHUNKS = 16, 301, 3


def logits_of(seed: int, spread: float = 4.0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    return (rng.standard_normal((CHUNKS, kld_base.scored(N_CTX), VOCAB)) * spread).astype(
        np.float32
    )


def write(path: Path, fmt: str, logits: np.ndarray, tokens: np.ndarray) -> None:
    with kld_base.BaseWriter(path, fmt, n_ctx=N_CTX, n_vocab=VOCAB, tokens=tokens) as w:
        for chunk in logits:
            w.write(chunk)


@pytest.fixture
def tokens() -> np.ndarray:
    return np.random.default_rng(9).integers(0, VOCAB, (CHUNKS, N_CTX)).astype(np.int32)


def test_llama_layout_byte_for_byte(tmp_path: Path, tokens: np.ndarray):
    """The header, the tokens, then nv = 2*((n_vocab+1)/2) + 4 uint16 per scored position,
    the first four holding float32 scale and min_log_prob (tools/perplexity/perplexity.cpp)."""
    z = logits_of(0)
    write(tmp_path / "b", "llama", z, tokens)
    raw = (tmp_path / "b").read_bytes()
    assert raw[:8] == b"_logits_"
    assert struct.unpack("<Iii", raw[8:20]) == (N_CTX, VOCAB, CHUNKS)
    assert np.array_equal(np.frombuffer(raw[20 : 20 + 4 * tokens.size], "<i4"), tokens.ravel())
    nv = 2 * ((VOCAB + 1) // 2) + 4
    rows = np.frombuffer(raw[20 + 4 * tokens.size :], "<u2").reshape(-1, nv)
    assert rows.shape[0] == CHUNKS * kld_base.scored(N_CTX)
    row, x = rows[0], z[0, 0]
    scale, min_lp = np.frombuffer(row[:4].tobytes(), "<f4")
    hi, lo = x.max(), max(x.min(), x.max() - 16)
    assert scale == np.float32((hi - lo) / np.float32(65535))
    lse = np.log(np.exp((x - hi).astype(np.float64)).sum())
    assert min_lp == pytest.approx(lo - hi - lse, abs=1e-5)
    assert row[4 + int(np.argmax(x))] == 65535 and row[4 + int(np.argmin(x))] == 0


@settings(max_examples=30, deadline=None)
@given(seed=st.integers(0, 10_000), spread=st.floats(0.01, 20.0))
def test_llama_rows_decode_within_half_a_step(seed: int, spread: float):
    """Every log-prob down to the clamp (the smallest, floored at max - 16) comes back within
    half a step of the exact value (plus float32 rounding of the values); the rest, clamped,
    at or below -16."""
    z = logits_of(seed, spread)[0]
    back = kld_base.decode_llama(kld_base.encode_llama(z), VOCAB)
    exact = metrics.log_softmax(z)
    hi = z.max(axis=1, keepdims=True)
    kept = z >= np.maximum(z.min(axis=1, keepdims=True), hi - 16)
    step = (hi - np.maximum(z.min(axis=1, keepdims=True), hi - 16)) / 65535
    ulp = 4 * np.spacing(np.float32(np.abs(exact).max() + np.abs(z).max()))
    err = np.abs(back - exact)
    assert np.all(err[kept] <= np.broadcast_to(step / 2, err.shape)[kept] + ulp)
    assert np.all(back[~kept] <= -16 + ulp)


def test_llama_kld_of_a_base_against_itself_is_its_floor(tmp_path: Path, tokens: np.ndarray):
    z = logits_of(1)
    write(tmp_path / "b", "llama", z, tokens)
    base = kld_base.BaseFile.open(tmp_path / "b")
    v = metrics.TokenValues.concat(
        [base.token_values(i, z[i], tokens[i, N_CTX // 2 + 1 :]) for i in range(CHUNKS)]
    )
    # half a step per log-prob, p-weighted, and the float32 terms (about 1e-6)
    assert np.abs(v.kld).max() <= 0.5 * 16 / 65535 * 1.01 + 1e-5
    assert v.same.all()


@settings(max_examples=20, deadline=None)
@given(seed=st.integers(0, 10_000), noise=st.floats(0.01, 1.0))
def test_llama_values_match_the_exact_ones_within_the_storage_error(seed: int, noise: float):
    """llama.cpp's KL from uint16 rows against the exact float64 KL: they differ by the
    rounding of each kept log-prob (half a step, times 1 + |log p_base - log p_test|) and by
    the log-probs it skips (at or below -16: their exact terms)."""
    rng = np.random.default_rng(seed)
    z = logits_of(seed)[0]
    q = (z + noise * rng.standard_normal(z.shape)).astype(np.float32)
    t = rng.integers(0, VOCAB, z.shape[0])
    got = kld_base.llama_token_values(kld_base.encode_llama(z), q, t)
    exact = metrics.token_values(metrics.log_softmax(z), q, t)
    lb, lq = metrics.log_softmax(z), metrics.log_softmax(q)
    hi = z.max(axis=1, keepdims=True)
    skipped = z <= np.maximum(z.min(axis=1, keepdims=True), hi - 16)
    half_step = 0.5 * 16 / 65535
    bound = (
        half_step * 1.01 * (1 + np.abs(lb - lq).max(axis=1))
        + np.sum(np.where(skipped, np.exp(lb) * np.abs(lb - lq), 0), axis=1)
        + 1e-5  # float32 evaluation of the terms
    )
    assert np.all(np.abs(got.kld - exact.kld) <= bound)
    assert np.all(np.abs(got.nll_test - exact.nll_test) <= 1e-4)  # float32 against float64


def test_f32_keeps_the_logits(tmp_path: Path, tokens: np.ndarray):
    z = logits_of(2)
    write(tmp_path / "b", "f32", z, tokens)
    base = kld_base.BaseFile.open(tmp_path / "b")
    assert base.header.fmt == "f32" and base.offset % 8 == 0
    assert np.array_equal(base.rows(1), z[1]) and np.array_equal(base.tokens, tokens)
    v = base.token_values(1, z[1], tokens[1, N_CTX // 2 + 1 :])
    assert np.all(v.kld == 0) and np.all(v.nll_test == v.nll_ref)


def test_f32_header_records_where_the_base_came_from(tmp_path: Path, tokens: np.ndarray):
    meta = {"model": "x.gguf", "setting": {"engine": "transformers f32 eager"}}
    with kld_base.BaseWriter(
        tmp_path / "b", "f32", n_ctx=N_CTX, n_vocab=VOCAB, tokens=tokens, meta=meta
    ) as w:
        for chunk in logits_of(3):
            w.write(chunk)
    assert kld_base.BaseFile.open(tmp_path / "b").header.meta == meta


@pytest.mark.parametrize("fmt", kld_base.FORMATS)
def test_an_interrupted_base_leaves_nothing(tmp_path: Path, tokens: np.ndarray, fmt: str):
    z = logits_of(4)
    with pytest.raises(KeyboardInterrupt):
        with kld_base.BaseWriter(
            tmp_path / "b", fmt, n_ctx=N_CTX, n_vocab=VOCAB, tokens=tokens
        ) as w:
            w.write(z[0])
            raise KeyboardInterrupt
    with pytest.raises(kld_base.BaseFileError, match="1 of 3 windows written"):
        with kld_base.BaseWriter(
            tmp_path / "b", fmt, n_ctx=N_CTX, n_vocab=VOCAB, tokens=tokens
        ) as w:
            w.write(z[0])
    assert list(tmp_path.iterdir()) == []


def test_writer_refuses_wrong_shapes(tmp_path: Path, tokens: np.ndarray):
    with pytest.raises(kld_base.BaseFileError, match="format must be one of"):
        kld_base.BaseWriter(tmp_path / "b", "f16", n_ctx=N_CTX, n_vocab=VOCAB, tokens=tokens)
    with pytest.raises(kld_base.BaseFileError, match="not whole windows"):
        kld_base.BaseWriter(tmp_path / "b", "f32", n_ctx=N_CTX, n_vocab=VOCAB, tokens=tokens[:, :5])
    with pytest.raises(kld_base.BaseFileError, match="logits must be"):
        with kld_base.BaseWriter(
            tmp_path / "b", "f32", n_ctx=N_CTX, n_vocab=VOCAB, tokens=tokens
        ) as w:
            w.write(np.zeros((2, VOCAB), np.float32))
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("fmt", kld_base.FORMATS)
@pytest.mark.parametrize("cut", [3, 40, -1])
def test_truncated_or_padded_files_are_refused(
    tmp_path: Path, tokens: np.ndarray, fmt: str, cut: int
):
    write(tmp_path / "b", fmt, logits_of(5), tokens)
    raw = (tmp_path / "b").read_bytes()
    (tmp_path / "c").write_bytes(raw[:cut] if cut > 0 else raw + b"\0")
    with pytest.raises(kld_base.BaseFileError):
        kld_base.BaseFile.open(tmp_path / "c")


def test_other_files_are_refused(tmp_path: Path):
    (tmp_path / "gguf").write_bytes(b"GGUF" + bytes(60))
    with pytest.raises(kld_base.BaseFileError, match="does not look like a base file"):
        kld_base.BaseFile.open(tmp_path / "gguf")
    with pytest.raises(kld_base.BaseFileError, match="cannot read"):
        kld_base.BaseFile.open(tmp_path / "missing")
    bad = b"_qlbase_" + struct.pack("<I", 7) + b"{nope}!"
    (tmp_path / "json").write_bytes(bad)
    with pytest.raises(kld_base.BaseFileError, match="unreadable header"):
        kld_base.BaseFile.open(tmp_path / "json")


def test_token_ids_outside_the_vocabulary_are_refused(tmp_path: Path, tokens: np.ndarray):
    write(tmp_path / "b", "llama", logits_of(6), tokens)
    raw = bytearray((tmp_path / "b").read_bytes())
    raw[20:24] = struct.pack("<i", VOCAB)
    (tmp_path / "c").write_bytes(bytes(raw))
    with pytest.raises(kld_base.BaseFileError, match="outside"):
        kld_base.BaseFile.open(tmp_path / "c")


def test_head_reads_the_first_windows(tmp_path: Path, tokens: np.ndarray):
    z = logits_of(7)
    write(tmp_path / "b", "f32", z, tokens)
    head = kld_base.BaseFile.open(tmp_path / "b").head(2)
    assert head.header.n_chunk == 2 and head.tokens.shape == (2, N_CTX)
    assert np.array_equal(head.rows(1), z[1])
    with pytest.raises(kld_base.BaseFileError):
        head.rows(2)
