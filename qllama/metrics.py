"""Numbers that say how far one set of logits is from another.

Everything here is plain numpy on logits already computed: per-step differences, argmax and
margins, top-k, and the KL-divergence statistics llama.cpp's ``llama-perplexity
--kl-divergence`` prints, with its definitions (``tools/perplexity/perplexity.cpp``):
uncertainty ``sqrt((E[x^2] - E[x]^2) / (n - 1))`` (0 for ``n <= 10``), percentiles by linear
interpolation at ``f * (n - 1)`` of the sorted values. Unlike llama.cpp, the base log-probs
are not stored as uint16 nor cut at -16: they are exact float64, so the figures differ from
llama.cpp's in the last digits.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

import numpy as np

KLD_PERCENTILES = (99.9, 99.0, 95.0, 90.0, 50.0, 10.0, 5.0, 1.0, 0.1)
DP_PERCENTILES = (99.9, 99.0, 95.0, 90.0, 75.0, 50.0, 25.0, 10.0, 5.0, 1.0, 0.1)


def log_softmax(logits: np.ndarray) -> np.ndarray:
    """Row-wise log-softmax in float64."""
    z = np.asarray(logits, dtype=np.float64)
    z = z - z.max(axis=-1, keepdims=True)
    return z - np.log(np.exp(z).sum(axis=-1, keepdims=True))


def margin(logits: np.ndarray) -> np.ndarray:
    """Top-1 minus top-2 logit per row: how close the argmax was to flipping."""
    top2 = np.partition(np.asarray(logits, dtype=np.float64), -2, axis=-1)[..., -2:]
    return top2[..., 1] - top2[..., 0]


def top_k(logits: np.ndarray, k: int = 3) -> list[tuple[int, float]]:
    """The ``k`` largest logits of one row as ``(token, logit)``, largest first."""
    row = np.asarray(logits, dtype=np.float64)
    idx = np.argsort(-row, kind="stable")[:k]
    return [(int(i), float(row[i])) for i in idx]


def uncertainty(x: np.ndarray) -> float:
    """llama.cpp's standard error of a mean: 0 for ten values or fewer."""
    n = x.size
    if n <= 10:
        return 0.0
    return float(np.sqrt(max(np.mean(x * x) - np.mean(x) ** 2, 0.0) / (n - 1)))


def percentile(x: np.ndarray, f: float) -> float:
    """Linear interpolation at index ``f/100 * (n - 1)`` of the sorted values."""
    s = np.sort(x)
    pos = f / 100 * (s.size - 1)
    lo = int(np.floor(pos))
    hi = min(lo + 1, s.size - 1)
    return float(s[lo] + (s[hi] - s[lo]) * (pos - lo))


@dataclass
class KLStats:
    """llama-perplexity's KL divergence, token probability and perplexity statistics."""

    n: int
    mean_kld: float
    mean_kld_unc: float
    kld: dict[str, float]  # "max", "99.9%" ... "median" ... "min"
    mean_dp: float  # mean of p_test(token) - p_ref(token), as a fraction (llama.cpp prints %)
    mean_dp_unc: float
    dp: dict[str, float]
    rms_dp: float
    rms_dp_unc: float
    same_top: float  # fraction of positions where both argmaxes agree
    same_top_unc: float
    ppl_test: float
    ppl_ref: float
    ln_ppl_ratio: float  # mean of ln(PPL(test) / PPL(ref))
    ln_ppl_ratio_unc: float

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def kl_stats(ref_logits: np.ndarray, test_logits: np.ndarray, tokens: np.ndarray) -> KLStats:
    """Compare ``test`` with ``ref`` at positions whose next tokens are ``tokens``.

    ``ref_logits`` and ``test_logits`` are ``(n, vocab)``; row ``i`` predicts ``tokens[i]``.
    """
    ref_lp, test_lp = log_softmax(ref_logits), log_softmax(test_logits)
    tokens = np.asarray(tokens, dtype=np.int64)
    rows = np.arange(tokens.size)
    ref_p = np.exp(ref_lp)
    kld = np.sum(ref_p * (ref_lp - test_lp), axis=-1)
    dp = np.exp(test_lp[rows, tokens]) - ref_p[rows, tokens]
    same = (np.argmax(test_logits, axis=-1) == np.argmax(ref_logits, axis=-1)).astype(np.float64)
    nll_test, nll_ref = -test_lp[rows, tokens], -ref_lp[rows, tokens]
    rms = float(np.sqrt(np.mean(dp * dp)))
    p_same = float(same.mean())

    def spread(x: np.ndarray, fractions: tuple[float, ...]) -> dict[str, float]:
        out = {"max": float(x.max())}
        out |= {("median" if f == 50 else f"{f:g}%"): percentile(x, f) for f in fractions}
        out["min"] = float(x.min())
        return out

    return KLStats(
        n=int(tokens.size),
        mean_kld=float(kld.mean()),
        mean_kld_unc=uncertainty(kld),
        kld=spread(kld, KLD_PERCENTILES),
        mean_dp=float(dp.mean()),
        mean_dp_unc=uncertainty(dp),
        dp=spread(dp, DP_PERCENTILES),
        rms_dp=rms,
        rms_dp_unc=0.5 / rms * uncertainty(dp * dp) if rms > 0 else 0.0,
        same_top=p_same,
        same_top_unc=float(np.sqrt(p_same * (1 - p_same) / (tokens.size - 1)))
        if tokens.size > 1
        else 0.0,
        ppl_test=float(np.exp(nll_test.mean())),
        ppl_ref=float(np.exp(nll_ref.mean())),
        ln_ppl_ratio=float((nll_test - nll_ref).mean()),
        ln_ppl_ratio_unc=uncertainty(nll_test - nll_ref),
    )


def format_kl_stats(s: KLStats) -> str:
    """The statistics in llama-perplexity's layout."""
    lines = [
        "====== Perplexity statistics ======",
        f"Mean PPL(Q)                   : {s.ppl_test:10.6f}",
        f"Mean PPL(base)                : {s.ppl_ref:10.6f}",
        f"Mean ln(PPL(Q)/PPL(base))     : {s.ln_ppl_ratio:10.6f} ± {s.ln_ppl_ratio_unc:10.6f}",
        "",
        "====== KL divergence statistics ======",
        f"Mean    KLD: {s.mean_kld:10.6f} ± {s.mean_kld_unc:10.6f}",
    ]
    names = {"max": "Maximum", "median": "Median", "min": "Minimum"}
    lines += [f"{names.get(k, k):>7} KLD: {v:10.6f}" for k, v in s.kld.items()]
    lines += [
        "",
        "====== Token probability statistics ======",
        f"Mean    Δp: {100 * s.mean_dp:6.3f} ± {100 * s.mean_dp_unc:5.3f} %",
    ]
    lines += [f"{names.get(k, k):>7}  Δp: {100 * v:6.3f}%" for k, v in s.dp.items()]
    lines += [
        f"RMS Δp    : {100 * s.rms_dp:6.3f} ± {100 * s.rms_dp_unc:5.3f} %",
        f"Same top p: {100 * s.same_top:6.3f} ± {100 * s.same_top_unc:5.3f} %",
    ]
    return "\n".join(lines)
