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


# Rows of float64 work at a time in :func:`nll`: a few MB, in cache, not a 100 MB array a window
NLL_BLOCK_BYTES = 4 << 20


def nll(logits: np.ndarray, targets: np.ndarray) -> np.ndarray:
    """Negative log-likelihood of each row's target: ``-log_softmax(logits)[i, targets[i]]``
    bit for bit, without the whole float64 log-softmax (only each row's sum of exponentials,
    a block of rows at a time)."""
    z = np.asarray(logits, dtype=np.float32)
    n, n_vocab = z.shape
    targets = np.asarray(targets, dtype=np.int64)
    top = z.max(axis=-1).astype(np.float64)  # (n,): the float64 row maxima, exactly
    sums = np.empty(n, dtype=np.float64)
    step = max(1, NLL_BLOCK_BYTES // (8 * n_vocab))
    for a in range(0, n, step):
        d = z[a : a + step].astype(np.float64)  # (rows, vocab)
        d -= top[a : a + step, None]
        np.exp(d, out=d)
        sums[a : a + step] = d.sum(axis=-1)
    # -(z - log(sum)), as written in log_softmax: the same bits, the sign of a zero included
    return -((z[np.arange(n), targets].astype(np.float64) - top) - np.log(sums))


def margin(logits: np.ndarray) -> np.ndarray:
    """Top-1 minus top-2 logit per row: how close the argmax was to flipping."""
    top2 = np.partition(np.asarray(logits, dtype=np.float64), -2, axis=-1)[..., -2:]
    return top2[..., 1] - top2[..., 0]


def top_k(logits: np.ndarray, k: int = 3) -> list[tuple[int, float]]:
    """The ``k`` largest logits of one row as ``(token, logit)``, largest first."""
    row = np.asarray(logits, dtype=np.float64)
    idx = np.argsort(-row, kind="stable")[:k]
    return [(int(i), float(row[i])) for i in idx]


# llama.cpp computes no standard error of a mean of this many values or fewer (it prints 0)
MIN_UNCERTAINTY = 10
UNCERTAINTY_NOTE = (
    f"± 0 below {MIN_UNCERTAINTY + 1} values: the uncertainty is not computed there "
    "(as llama-perplexity)"
)


def uncertainty(x: np.ndarray) -> float:
    """llama.cpp's standard error of a mean: 0 for ten values or fewer."""
    n = x.size
    if n <= MIN_UNCERTAINTY:
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
class TokenValues:
    """The per-token values llama-perplexity's statistics are made of, one entry per scored
    position (float64): KL(ref || test), Δp = p_test(token) - p_ref(token), whether both
    argmaxes agree, and both negative log-likelihoods of the token."""

    kld: np.ndarray
    dp: np.ndarray
    same: np.ndarray  # bool
    nll_test: np.ndarray
    nll_ref: np.ndarray

    @classmethod
    def concat(cls, parts: list[TokenValues]) -> TokenValues:
        """One set of values from several (e.g. one per window), in order."""
        names = ("kld", "dp", "same", "nll_test", "nll_ref")
        return cls(*(np.concatenate([getattr(p, n) for p in parts]) for n in names))

    def __len__(self) -> int:
        return int(self.kld.size)


def token_values(
    ref_logprobs: np.ndarray, test_logits: np.ndarray, tokens: np.ndarray
) -> TokenValues:
    """Per-token values of ``test`` against exact reference log-probabilities (float64, the
    whole vocabulary: no -16 cut, nothing stored lossily). Row ``i`` predicts ``tokens[i]``."""
    ref_lp = np.asarray(ref_logprobs, dtype=np.float64)
    test_lp = log_softmax(test_logits)
    tokens = np.asarray(tokens, dtype=np.int64)
    rows = np.arange(tokens.size)
    ref_p = np.exp(ref_lp)
    return TokenValues(
        kld=np.sum(ref_p * (ref_lp - test_lp), axis=-1),
        dp=np.exp(test_lp[rows, tokens]) - ref_p[rows, tokens],
        same=np.argmax(test_logits, axis=-1) == np.argmax(ref_lp, axis=-1),
        nll_test=-test_lp[rows, tokens],
        nll_ref=-ref_lp[rows, tokens],
    )


def covariance(a: np.ndarray, b: np.ndarray) -> float:
    """llama.cpp's covariance of two means: ``(E[ab] - E[a]E[b]) / (n - 1)``, 0 below ten."""
    n = a.size
    if n < MIN_UNCERTAINTY:
        return 0.0
    return float((np.mean(a * b) - np.mean(a) * np.mean(b)) / (n - 1))


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
    ppl_test_unc: float = 0.0
    ppl_ref_unc: float = 0.0
    ln_ppl_cor: float = 0.0  # correlation of the two ln(PPL) estimates
    ppl_ratio: float = 1.0
    ppl_ratio_unc: float = 0.0
    ppl_diff: float = 0.0
    ppl_diff_unc: float = 0.0

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def _spread(x: np.ndarray, fractions: tuple[float, ...]) -> dict[str, float]:
    out = {"max": float(x.max())}
    out |= {("median" if f == 50 else f"{f:g}%"): percentile(x, f) for f in fractions}
    out["min"] = float(x.min())
    return out


def summarize(v: TokenValues) -> KLStats:
    """The statistics of per-token values, as ``llama-perplexity --kl-divergence`` computes
    them (``tools/perplexity/perplexity.cpp``, ``kl_divergence``)."""
    n = len(v)
    a, b = v.nll_test, v.nll_ref
    ua, ub, cov = uncertainty(a), uncertainty(b), covariance(a, b)
    ppl_test, ppl_ref = float(np.exp(a.mean())), float(np.exp(b.mean()))
    ln_ratio = float(a.mean() - b.mean())
    ln_ratio_unc = float(np.sqrt(max(ua * ua + ub * ub - 2 * cov, 0.0)))
    ppl_diff_var = (ppl_test * ua) ** 2 + (ppl_ref * ub) ** 2 - 2 * ppl_test * ppl_ref * cov
    rms = float(np.sqrt(np.mean(v.dp * v.dp)))
    p_same = float(v.same.mean())
    return KLStats(
        n=n,
        mean_kld=float(v.kld.mean()),
        mean_kld_unc=uncertainty(v.kld),
        kld=_spread(v.kld, KLD_PERCENTILES),
        mean_dp=float(v.dp.mean()),
        mean_dp_unc=uncertainty(v.dp),
        dp=_spread(v.dp, DP_PERCENTILES),
        rms_dp=rms,
        rms_dp_unc=0.5 / rms * uncertainty(v.dp * v.dp) if rms > 0 else 0.0,
        same_top=p_same,
        same_top_unc=float(np.sqrt(p_same * (1 - p_same) / (n - 1))) if n > 1 else 0.0,
        ppl_test=ppl_test,
        ppl_ref=ppl_ref,
        ln_ppl_ratio=ln_ratio,
        ln_ppl_ratio_unc=ln_ratio_unc,
        ppl_test_unc=ppl_test * ua,
        ppl_ref_unc=ppl_ref * ub,
        ln_ppl_cor=cov / (ua * ub) if ua > 0 and ub > 0 else 0.0,
        ppl_ratio=float(np.exp(ln_ratio)),
        ppl_ratio_unc=float(np.exp(ln_ratio)) * ln_ratio_unc,
        ppl_diff=ppl_test - ppl_ref,
        ppl_diff_unc=float(np.sqrt(max(ppl_diff_var, 0.0))),
    )


def rounding_spread(
    a: np.ndarray, b: np.ndarray, *, draws: int = 200, seed: int = 0
) -> dict[str, float]:
    """How far each KL divergence line (``mean``, ``max``, the percentiles, ``min``) moves
    when the arithmetic rounds otherwise: the yardstick for comparing two tools' lines.

    ``a`` and ``b`` are per-position values (e.g. :attr:`TokenValues.kld`) of two runs of one
    model on the same positions whose arithmetics differ only in rounding (llama.cpp with and
    without flash attention; qllama's ``kv_precision="f16-flash"`` and ``"f16"``). Under the
    CPU arithmetic such a difference flips some Q8 activation integers and moves a position's
    value by as much as quantization does, so a line differs between the two by what the
    rounding does to the few positions it rests on. Returned, for each line, is the root mean
    square of ``line(b*) - line(a*)`` over ``draws`` resamples of the positions with
    replacement (the same positions for both: a paired bootstrap), which holds both the
    difference and how much it depends on which positions happen to lie near the line.
    The maximum and the minimum rest on one position each: no resampling bounds them
    (docs/perplexity.md measures this against llama.cpp's own two attention paths)."""
    a, b = np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64)
    if a.shape != b.shape or a.ndim != 1 or a.size == 0:
        raise ValueError(f"per-position values of one shape needed: {a.shape} and {b.shape}")
    rng = np.random.default_rng(seed)

    def lines(x: np.ndarray) -> dict[str, float]:
        return {"mean": float(x.mean()), **_spread(x, KLD_PERCENTILES)}

    moved = []
    for _ in range(draws):
        at = rng.integers(0, a.size, a.size)
        la, lb = lines(a[at]), lines(b[at])
        moved.append({k: lb[k] - la[k] for k in la})
    return {k: float(np.sqrt(np.mean([m[k] ** 2 for m in moved]))) for k in moved[0]}


def kl_stats(ref_logits: np.ndarray, test_logits: np.ndarray, tokens: np.ndarray) -> KLStats:
    """Compare ``test`` with ``ref`` at positions whose next tokens are ``tokens``.

    ``ref_logits`` and ``test_logits`` are ``(n, vocab)``; row ``i`` predicts ``tokens[i]``.
    """
    return summarize(token_values(log_softmax(ref_logits), test_logits, tokens))


def _percent_label(f: float) -> str:
    """llama-perplexity's label of a percentile: ``99.9%``, `` 5.0%``."""
    return f"{f:4.1f}%"


def plus_minus(value: float, unc: float, n: int, fmt: str = ".3e") -> str:
    """``value ± unc``, or ``value (± not computed: n values)`` where llama.cpp's rule
    computes no uncertainty, so that a 0 is never read as a measured one."""
    if n <= MIN_UNCERTAINTY:
        return f"{value:{fmt}} (± not computed: {n} values)"
    return f"{value:{fmt}} ± {unc:.1e}"


def format_kl_stats(s: KLStats) -> str:
    """The statistics as llama-perplexity prints them, line for line (and, below 11
    positions, a line saying that its ± 0 are not measured)."""
    lines = [] if s.n > MIN_UNCERTAINTY else [f"{s.n} positions: {UNCERTAINTY_NOTE}", ""]
    lines += [
        "====== Perplexity statistics ======",
        f"Mean PPL(Q)                   : {s.ppl_test:10.6f} ± {s.ppl_test_unc:10.6f}",
        f"Mean PPL(base)                : {s.ppl_ref:10.6f} ± {s.ppl_ref_unc:10.6f}",
        f"Cor(ln(PPL(Q)), ln(PPL(base))): {100 * s.ln_ppl_cor:6.2f}%",
        f"Mean ln(PPL(Q)/PPL(base))     : {s.ln_ppl_ratio:10.6f} ± {s.ln_ppl_ratio_unc:10.6f}",
        f"Mean PPL(Q)/PPL(base)         : {s.ppl_ratio:10.6f} ± {s.ppl_ratio_unc:10.6f}",
        f"Mean PPL(Q)-PPL(base)         : {s.ppl_diff:10.6f} ± {s.ppl_diff_unc:10.6f}",
        "",
        "====== KL divergence statistics ======",
        f"Mean    KLD: {s.mean_kld:10.6f} ± {s.mean_kld_unc:10.6f}",
        f"Maximum KLD: {s.kld['max']:10.6f}",
    ]
    for f in KLD_PERCENTILES:
        label = "Median " if f == 50 else _percent_label(f) + "  "
        lines.append(f"{label} KLD: {s.kld['median' if f == 50 else f'{f:g}%']:10.6f}")
    lines += [
        f"Minimum KLD: {s.kld['min']:10.6f}",
        "",
        "====== Token probability statistics ======",
        f"Mean    Δp: {100 * s.mean_dp:6.3f} ± {100 * s.mean_dp_unc:5.3f} %",
        f"Maximum Δp: {100 * s.dp['max']:6.3f}%",
    ]
    for f in DP_PERCENTILES:
        label = "Median " if f == 50 else _percent_label(f) + "  "
        lines.append(f"{label} Δp: {100 * s.dp['median' if f == 50 else f'{f:g}%']:6.3f}%")
    lines += [
        f"Minimum Δp: {100 * s.dp['min']:6.3f}%",
        f"RMS Δp    : {100 * s.rms_dp:6.3f} ± {100 * s.rms_dp_unc:5.3f} %",
        f"Same top p: {100 * s.same_top:6.3f} ± {100 * s.same_top_unc:5.3f} %",
    ]
    return "\n".join(lines)
