"""Corpus perplexity: llama-perplexity's windows, scoring and statistics, on tiny models."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest
from bounds import forward_bound
from hypothesis import given, settings
from hypothesis import strategies as st

from qllama.errors import QllamaError
from qllama.measure import kld_base, metrics, perplexity
from qllama.runtime.loader import load
from qllama.synthetic import TinyConfig, write_tiny_llama

TEXT = (
    "It was a bright cold day in April, and the clocks were striking thirteen. The hallway "
    "smelt of boiled cabbage and old rag mats. At one end of it a coloured poster, too large "
    "for indoor display, had been tacked to the wall. "
) * 12


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("ppl") / "tiny.gguf"
    write_tiny_llama(path, TinyConfig(n_ctx=128))
    return path


# --- windows ------------------------------------------------------------------------------------


def test_windows_follow_llama_perplexity():
    ids = np.arange(1000) % 50
    w = perplexity.windows(ids, 64, bos=7)
    assert (w.n_chunk, w.n_ctx, w.first, w.n_scored) == (15, 64, 32, 31)  # 1000 // 64 windows
    assert np.array_equal(w.tokens[2], ids[128:192])  # as the text gave them
    assert w.evaluated(2)[0] == 7 and np.array_equal(w.evaluated(2)[1:], ids[129:192])
    assert np.array_equal(w.targets(2), ids[128 + 33 : 192])  # positions 32..62 predict 33..63
    assert perplexity.windows(ids, 64, n_chunks=4).n_chunk == 4
    assert perplexity.windows(ids, 64).evaluated(0)[0] == ids[0]  # no BOS: untouched


@pytest.mark.parametrize(
    ("n", "n_ctx", "chunks", "match"),
    [
        (127, 64, None, "at least 128 tokens"),
        (500, 2, None, "at least 4"),
        (500, 64, 0, "at least 1"),
    ],
)
def test_windows_refuse_what_llama_perplexity_refuses(n, n_ctx, chunks, match):
    with pytest.raises(perplexity.CorpusError, match=match):
        perplexity.windows(np.zeros(n, int), n_ctx, n_chunks=chunks)


# --- scoring ------------------------------------------------------------------------------------


def test_scorer_equals_one_forward_pass_over_the_window(tiny: Path):
    """The context half into the cache, then the scored half: the same logits as one pass over
    the window (float32 products in other shapes: the forward-pass bound)."""
    model = load(tiny, dequantize_all=True)
    w = perplexity.windows(perplexity.tokenize(model.tokenizer, TEXT), 64, n_chunks=2)
    whole = np.asarray(model.forward(w.evaluated(1)[:-1], 0, all_logits=True))[w.first :]
    split = perplexity.qllama_scorer(model)(w.evaluated(1), w.first)
    assert split.shape == (w.n_scored, model.config.n_vocab)
    c = model.config
    bound = forward_bound(c.n_layer, max(c.n_ff, 64), float(np.abs(whole).max()))
    assert np.abs(split - whole).max() <= bound


def test_run_scores_the_second_half_and_prints_llama_lines():
    rng = np.random.default_rng(0)
    vocab, n_ctx = 40, 16
    table = rng.standard_normal((n_ctx, vocab)).astype(np.float32)
    seen = []

    def scorer(tokens: np.ndarray, first: int) -> np.ndarray:
        seen.append((tokens.copy(), first))
        return table[first : n_ctx - 1] + tokens[first : n_ctx - 1, None] * 0.01

    w = perplexity.windows(rng.integers(0, vocab, 100), n_ctx, bos=3)
    scores = perplexity.run(scorer, w)
    assert len(seen) == 6 and all(t[0] == 3 and f == 8 for t, f in seen)
    expect = np.concatenate(
        [metrics.nll(scorer(w.evaluated(i), 8), w.targets(i)) for i in range(6)]
    )
    assert np.array_equal(scores.all_nll(), expect) and scores.count == 6 * 7
    ppl, unc = scores.ppl()
    sd = math.sqrt(np.mean(expect**2) - np.mean(expect) ** 2)
    assert ppl == pytest.approx(math.exp(expect.mean()), rel=1e-12)
    assert unc == pytest.approx(ppl * sd / math.sqrt(expect.size - 1), rel=1e-9)
    assert perplexity.ppl_final(scores) == f"Final estimate: PPL = {ppl:.4f} +/- {unc:.5f}"
    assert perplexity.ppl_running(scores) == f"[6]{ppl:.4f},"


@pytest.mark.parametrize("fmt", kld_base.FORMATS)
def test_a_model_against_its_own_base(tiny: Path, tmp_path: Path, fmt: str):
    """Save a base, score the same model against it: KLD at the format's floor, same top 100%,
    the base's PPL equal to the run's."""
    model = load(tiny, dequantize_all=True)
    w = perplexity.windows(perplexity.tokenize(model.tokenizer, TEXT), 32, n_chunks=8)
    path = tmp_path / "base"
    with kld_base.BaseWriter(
        path, fmt, n_ctx=w.n_ctx, n_vocab=model.config.n_vocab, tokens=w.tokens
    ) as save:
        first = perplexity.run(perplexity.qllama_scorer(model), w, save=save)
    base = kld_base.BaseFile.open(path)
    again = perplexity.measure(model, base)
    assert again["tokens"] == first.count == 8 * 15 and again["windows"] == 8
    assert again["same_top"] == 1.0
    # llama's format rounds each log-prob by at most half a step (16 / 65535 nats), so KL,
    # a p-weighted sum of those errors, and ln PPL(base) move by at most that; its float32
    # terms add about ulp(|log p| + |logit|) ~ 1e-6. f32 keeps the logits: the same run again
    # gives the same bits.
    half_step = 0.5 * kld_base.FLOOR / 65535
    floor = half_step * 1.01 + 1e-5 if fmt == "llama" else 1e-12
    assert abs(again["mean_kld"]) <= floor and abs(again["kld"]["max"]) <= floor
    ppl_base = again["ppl_ref"]
    rel = half_step * 1.01 + 1e-5 if fmt == "llama" else 1e-12
    assert ppl_base == pytest.approx(first.ppl()[0], rel=rel)


def test_measure_refuses_a_base_of_another_vocabulary(tmp_path: Path, tiny: Path):
    path = tmp_path / "b"
    with kld_base.BaseWriter(
        path, "f32", n_ctx=8, n_vocab=5, tokens=np.zeros(16, np.int32)
    ) as save:
        save.write(np.zeros((3, 5), np.float32))
        save.write(np.zeros((3, 5), np.float32))
    with pytest.raises(kld_base.BaseFileError, match="vocabulary of 5"):
        perplexity.measure(load(tiny), path)


def test_statistics_need_a_hundred_positions():
    v = metrics.TokenValues(*(np.zeros(99) for _ in range(5)))
    scores = perplexity.Scores(16, nll=[v.nll_test], values=[v])
    with pytest.raises(perplexity.CorpusError, match="no statistics below 100"):
        scores.kl()
    assert isinstance(QllamaError("x"), ValueError)


# --- statistics ---------------------------------------------------------------------------------


@settings(max_examples=25, deadline=None)
@given(seed=st.integers(0, 10_000), n=st.integers(12, 300))
def test_summary_follows_llama_perplexity_formulas(seed: int, n: int):
    """The ± of a ratio with the covariance (llama.cpp) equals the ± of the differences."""
    rng = np.random.default_rng(seed)
    a = rng.gamma(2.0, 1.0, n)
    b = a + rng.normal(0, 0.1, n)
    v = metrics.TokenValues(
        kld=rng.gamma(1.0, 0.01, n), dp=rng.normal(0, 0.01, n), same=rng.random(n) < 0.9,
        nll_test=a, nll_ref=b,
    )  # fmt: skip
    s = metrics.summarize(v)
    assert s.ln_ppl_ratio_unc == pytest.approx(metrics.uncertainty(a - b), rel=1e-6, abs=1e-12)
    assert s.ppl_ratio == pytest.approx(s.ppl_test / s.ppl_ref, rel=1e-12)
    # cov / (unc_a unc_b), each over n - 1, is Pearson's r
    assert s.ln_ppl_cor == pytest.approx(np.corrcoef(a, b)[0, 1], rel=1e-6)
    assert s.kld["median"] == pytest.approx(float(np.median(v.kld)), rel=1e-12)


def test_statistics_print_llama_perplexity_lines():
    rng = np.random.default_rng(1)
    a = rng.standard_normal((200, 10))
    text = metrics.format_kl_stats(
        metrics.kl_stats(a, a + 0.1 * rng.standard_normal(a.shape), np.zeros(200, int))
    )
    labels = [line.split(":")[0] for line in text.splitlines() if ":" in line]
    assert labels[:6] == [
        "Mean PPL(Q)                   ",
        "Mean PPL(base)                ",
        "Cor(ln(PPL(Q)), ln(PPL(base)))",
        "Mean ln(PPL(Q)/PPL(base))     ",
        "Mean PPL(Q)/PPL(base)         ",
        "Mean PPL(Q)-PPL(base)         ",
    ]
    kld = [x for x in labels if x.endswith("KLD")]
    assert kld == [
        "Mean    KLD", "Maximum KLD", "99.9%   KLD", "99.0%   KLD", "95.0%   KLD",
        "90.0%   KLD", "Median  KLD", "10.0%   KLD", " 5.0%   KLD", " 1.0%   KLD",
        " 0.1%   KLD", "Minimum KLD",
    ]  # fmt: skip
    dp = [x for x in labels if "Δp" in x]
    assert dp[:3] == ["Mean    Δp", "Maximum Δp", "99.9%   Δp"] and "Median  Δp" in dp
    assert dp[-2:] == ["Minimum Δp", "RMS Δp    "] and labels[-1] == "Same top p"


def test_transformers_scorer_gives_the_same_logits(tiny: Path):
    """The f32 reference as a scorer: transformers on the same file and window (float32 in
    another order: the forward-pass bound)."""
    pytest.importorskip("transformers")
    from qllama.measure.reference import load_transformers

    model = load(tiny, dequantize_all=True)
    w = perplexity.windows(perplexity.tokenize(model.tokenizer, TEXT), 64, n_chunks=2)
    ours = perplexity.qllama_scorer(model)(w.evaluated(1), w.first)
    theirs = perplexity.transformers_scorer(load_transformers(tiny))(w.evaluated(1), w.first)
    assert theirs.shape == ours.shape and theirs.dtype == np.float32
    c = model.config
    bound = forward_bound(c.n_layer, max(c.n_ff, 64), float(np.abs(ours).max()))
    assert np.abs(theirs - ours).max() <= bound


@pytest.mark.parametrize(
    ("precision", "stored_half", "operands_half"),
    [("f32", False, False), ("f16", True, True), ("f16-flash", True, False)],
)
def test_kv_precisions_round_what_llama_cpp_rounds(precision, stored_half, operands_half):
    """f16: llama.cpp without flash attention (K, V, Q and P in half); f16-flash: its tiled
    CPU flash attention (K and V stored in half, Q and P float32)."""
    from qllama.array_api import namespace
    from qllama.runtime.kv_cache import KVCache

    xp = namespace("numpy")
    rng = np.random.default_rng(3)
    k, v = (rng.standard_normal((5, 2, 8)).astype(np.float32) for _ in range(2))
    cache = KVCache(1, 2, 8, xp, precision=precision)
    cache.reserve(5)
    ks, vs = cache.update(0, 0, k, v)
    half = lambda a: a.astype(np.float16).astype(np.float32)  # noqa: E731
    ks, vs = ks[:, :5].transpose(1, 0, 2), vs[:, :5].transpose(1, 0, 2)  # (positions, heads, hd)
    assert np.array_equal(ks, half(k) if stored_half else k)
    assert np.array_equal(vs, half(v) if stored_half else v)
    assert np.array_equal(cache.operand(k), half(k) if operands_half else k)
