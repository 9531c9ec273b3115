"""The seed study's findings (experiments/seed.toml), as predicates over one prompt's cells.

Each function takes a :class:`qllama.study.View` (one prompt, one draw) and returns checks;
the study runs it on every prompt and every draw, and a check holds only if it holds in all
of them, so each bound below is asserted against the CPU arithmetic's band, not one draw.
Every bound comes from our measured runs (docs/results.md), with the reasoning beside it. A
check that has nothing to test on a prompt (no flip, no fork) returns ``ok=None``: a short
answer is a valid outcome, neither a crash nor a pass.

Findings the study does not assert (``assert = false`` in seed.toml) held on the original
prompt and fail on others: they are reported with the prompts where they fail.
"""

from __future__ import annotations

from collections.abc import Iterator

from qllama.compare import fork
from qllama.study import Check, View

QUANTIZED = ("Q8_0", "Q4_K_M")


def _margins(view: View, variant: str, setting: str) -> list[float] | None:
    c = view.cell(variant, setting)
    return None if c is None else [f["ref_margin"] for f in c["teacher_forcing"]["flips"]]


def _median(view: View, variant: str, setting: str) -> float:
    c = view.cell(variant, setting)
    assert c is not None
    return float(c["teacher_forcing"]["median_max_abs"])


# --- 1. the F32 control ------------------------------------------------------------------------
# What is left at F32 is summation order (BLAS, softmax, RMSNorm), ulp-level: measured 4.0e-5
# (numpy, torch) and 5.3e-5 (jax) at the last position, 7e-5 to 1.05e-4 at the worst step, on
# every prompt and draw. 1e-3 is an order of magnitude above that and nearly three below
# Q8_0's error, so a real implementation error (a RoPE or attention slip moves logits by 1 or
# more) cannot hide under it.
F32_BOUND = 1e-3


def f32_control(view: View) -> Iterator[Check]:
    for s in view.settings:
        c = view.cell("F32", s)
        if c is None:
            continue
        for metric, v in (
            ("last-position max|Δ|", c["last_position"]["max_abs"]),
            ("max|Δ| over all steps", c["teacher_forcing"]["max_max_abs"]),
        ):
            yield Check(f"F32-{s}", metric, v, f"< {F32_BOUND:g}", v < F32_BOUND)


# --- 2. Q4_K_M error is several times Q8_0's ---------------------------------------------------
# On the median per-step max|Δ|, a statistic (the last position is one draw of the roundings).
# Measured on the seven prompts, every draw: 5.35 to 6.55 (gpu, dequantize-all, jax) and
# 2.58 to 4.67 (cpu, whose Q8_0 error is larger). [2, 8] keeps "several times"; a ratio near 1
# (Q4_K_M no worse than Q8_0) or an order of magnitude (a broken K-quant) fails.
RATIO = (2.0, 8.0)


def q4_vs_q8(view: View) -> Iterator[Check]:
    for s in view.settings:
        if view.cell("Q8_0", s) is None or view.cell("Q4_K_M", s) is None:
            continue
        r = _median(view, "Q4_K_M", s) / _median(view, "Q8_0", s)
        yield Check(
            f"Q4_K_M-{s} / Q8_0-{s}",
            "median per-step max|Δ| ratio",
            r,
            f"in [{RATIO[0]:g}, {RATIO[1]:g}]",
            RATIO[0] <= r <= RATIO[1],
        )


# --- 3. where the CPU arithmetic's error shows -------------------------------------------------
# Q8_0: activation quantization adds error on top of the weight error.
# Measured 1.41 to 1.85 (median per-step max|Δ|, cpu over gpu) on every prompt and draw. 1.2 is
# still an effect no summation order could make (those are 1e-4), and fails if the activations
# stopped being quantized (ratio 1.00).
CPU_EXTRA = 1.2


def cpu_adds_error(view: View) -> Iterator[Check]:
    r = _median(view, "Q8_0", "cpu") / _median(view, "Q8_0", "gpu")
    yield Check(
        "Q8_0-cpu / Q8_0-gpu", "median per-step max|Δ| ratio", r, f">= {CPU_EXTRA}", r >= CPU_EXTRA
    )


# GPU and dequantize-all compute the same products (weights dequantized either way) and differ
# by float32 summation order only: measured relative difference at most 2.9e-5 (fact, Q8_0).
# 1e-3 is far above that and far below the 40% or more the activation quantization makes.
SAME = 1e-3


def gpu_is_dequantize_all(view: View) -> Iterator[Check]:
    for v in QUANTIZED:
        gpu, da = _median(view, v, "gpu"), _median(view, v, "dequantize-all")
        rel = abs(da - gpu) / gpu
        yield Check(
            f"{v}-dequantize-all / {v}-gpu",
            "relative difference of median per-step max|Δ|",
            rel,
            f"<= {SAME:g}",
            rel <= SAME,
        )


# Q4_K_M: the weight error swamps the activation error. The original claim, "all three within
# a few percent" at the last position, held on the original prompt (3.6%) only: the last
# position is one draw of the CPU's roundings: measured 0.5% to 18% over the prompts and
# draws, it fails on list, fact, explain and raw. It is reported, not asserted; the asserted
# form compares the CPU arithmetic's excess for the two files, on the median.
FEW_PERCENT = 0.10


def q4_within_few_percent(view: View) -> Iterator[Check]:
    b = view.cell("Q4_K_M", "gpu")
    assert b is not None
    for s in ("cpu", "dequantize-all"):
        a = view.cell("Q4_K_M", s)
        assert a is not None
        x, y = a["last_position"]["max_abs"], b["last_position"]["max_abs"]
        r = abs(x - y) / y
        yield Check(
            f"Q4_K_M-{s} / Q4_K_M-gpu",
            "relative difference of last-position max|Δ|",
            r,
            f"<= {FEW_PERCENT:g}",
            r <= FEW_PERCENT,
        )


# The CPU arithmetic's excess over the GPU's, on the median: Q4_K_M -0.11 to +0.11, Q8_0 +0.44
# to +0.85 on every prompt and draw. Asserted as an ordering, not a percentage.
def q4_swamps_activations(view: View) -> Iterator[Check]:
    q8 = _median(view, "Q8_0", "cpu") / _median(view, "Q8_0", "gpu")
    q4 = _median(view, "Q4_K_M", "cpu") / _median(view, "Q4_K_M", "gpu")
    yield Check(
        "Q4_K_M vs Q8_0 (cpu / gpu)",
        "CPU excess of the median: Q4_K_M vs Q8_0",
        q4 - 1,
        "< Q8_0's",
        q4 - 1 < q8 - 1,
        shown=f"{q4 - 1:+.3f} vs {q8 - 1:+.3f}",
    )


# --- 4. which steps flip under teacher forcing --------------------------------------------------
# Q8_0 flips only where the reference is nearly tied: the largest flip margin measured on
# any prompt and draw is 0.21 (cpu-cache, a CPU draw), against top logits of 18-28. 0.35 is
# above it; Q4_K_M, whose error is four to six times larger, flips steps with margins up to 1.57.
NEAR_TIE = 0.35


def q8_flips_near_ties(view: View) -> Iterator[Check]:
    for s in view.settings:
        m = _margins(view, "Q8_0", s)
        if m is None:
            continue
        top = max(m, default=0.0)
        yield Check(
            f"Q8_0-{s}",
            "largest reference margin of a flip",
            top if m else "no flips",
            f"<= {NEAR_TIE}",
            (top <= NEAR_TIE) if m else None,
        )


def q4_flips_more(view: View) -> Iterator[Check]:
    """Q4_K_M flips more steps than Q8_0, including larger margins (nothing to test when
    neither flips)."""
    for s in view.settings:
        m8, m4 = _margins(view, "Q8_0", s), _margins(view, "Q4_K_M", s)
        if m8 is None or m4 is None:
            continue
        yield Check(
            f"Q4_K_M-{s} vs Q8_0-{s}",
            "flipped steps",
            f"{len(m4)} vs {len(m8)}",
            "Q4_K_M >= Q8_0",
            (len(m4) >= len(m8)) if (m4 or m8) else None,
        )
        top4, top8 = max(m4, default=0.0), max(m8, default=0.0)
        yield Check(
            f"Q4_K_M-{s} vs Q8_0-{s}",
            "largest reference margin of a flip",
            f"{top4:.4g} vs {top8:.4g}" if (m4 or m8) else "no flips",
            "Q4_K_M > Q8_0",
            (top4 > top8) if (m4 or m8) else None,
        )


def gpu_flips_as_dequantize_all(view: View) -> Iterator[Check]:
    for v in QUANTIZED:
        g = [f["step"] for f in view.cell(v, "gpu")["teacher_forcing"]["flips"]]  # type: ignore[index]
        d = [f["step"] for f in view.cell(v, "dequantize-all")["teacher_forcing"]["flips"]]  # type: ignore[index]
        yield Check(
            f"{v}-gpu / {v}-dequantize-all",
            "flipped steps",
            f"{g} / {d}",
            "equal",
            (g == d) if (g or d) else None,
        )


# --- 5. free generation forks where teacher forcing first flips ----------------------------------
# Exact: same prefix, same prefill-then-decode path, same logits. No tolerance. Never flipping
# and never forking agree, but there is nothing to test.


def fork_at_first_flip(view: View) -> Iterator[Check]:
    for v in view.variants:
        for s in view.settings:
            c = view.cell(v, s)
            if c is None:
                continue
            f, t = c["free_generation"]["fork"], c["teacher_forcing"]["first_flip"]
            yield Check(
                f"{v}-{s}",
                "fork / first flip",
                f"{_fmt(f)} / {_fmt(t)}",
                "equal",
                (f == t) if (f is not None or t is not None) else None,
            )


def _fmt(x: int | None) -> str:
    return "never" if x is None else str(x)


# --- 6. tokens across settings --------------------------------------------------------------------
# GPU and dequantize-all compute the same products, so their greedy choices part only where
# float32 order breaks a near-tie. Exact token identity.


def gpu_tokens_as_dequantize_all(view: View) -> Iterator[Check]:
    for v in QUANTIZED:
        a = view.cell(v, "gpu")["free_generation"]["tokens"]  # type: ignore[index]
        b = view.cell(v, "dequantize-all")["free_generation"]["tokens"]  # type: ignore[index]
        at = fork(a, b)
        yield Check(
            f"{v}-gpu / {v}-dequantize-all",
            "first differing token",
            at,
            "never",
            at is None and len(a) == len(b),
        )


# The CPU arithmetic differs from them in its tokens: its free generation leaves theirs, unless
# it never flips. Not asserted: on five of the seven prompts the CPU
# flips under teacher forcing but its free generation equals the GPU's (both leave the
# reference at the same step for the same token, or not at all).


def cpu_tokens_differ(view: View) -> Iterator[Check]:
    for v in QUANTIZED:
        cpu, gpu = view.cell(v, "cpu"), view.cell(v, "gpu")
        assert cpu is not None and gpu is not None
        at = fork(cpu["free_generation"]["tokens"], gpu["free_generation"]["tokens"])
        flips = bool(cpu["teacher_forcing"]["flips"])
        yield Check(
            f"{v}-cpu / {v}-gpu",
            "first differing token",
            at,
            "a fork",
            (at is not None) if flips else None,
        )
