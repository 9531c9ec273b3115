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

from qllama.measure.compare import fork
from qllama.measure.trace import BAND_FACTOR as BAND
from qllama.study import Check, View
from qllama.study.results import Attribution, LayerTrace, Measures

QUANTIZED = ("Q8_0", "Q4_K_M")
# quantized with an importance matrix (section 10); the findings about float order hold for
# every quantized file
IMATRIX = ("Q4_K_M-imatrix", "IQ4_XS-imatrix")


def _quantized(view: View) -> list[str]:
    """The quantized files of this prompt's cells, with an importance matrix or without."""
    return [v for v in QUANTIZED + IMATRIX if v in view.variants]


def _cell(view: View, variant: str, setting: str) -> Measures:
    """A cell the finding needs on every prompt (the study runs it everywhere)."""
    c = view.cell(variant, setting)
    assert c is not None, f"{variant}-{setting} is not on {view.prompt}"
    return c


def _margins(view: View, variant: str, setting: str) -> list[float] | None:
    c = view.cell(variant, setting)
    return None if c is None else [f.ref_margin for f in c.teacher_forcing.flips]


def _median(view: View, variant: str, setting: str) -> float:
    return float(_cell(view, variant, setting).teacher_forcing.median_max_abs)


# --- 1. the F32 control ------------------------------------------------------------------------
# What is left at F32 is summation order (BLAS, softmax, RMSNorm), ulp-level: measured 2.9e-5
# to 6.3e-5 at the last position, 4.7e-5 to 1.2e-4 at the worst step, on every prompt, setting
# and draw. 1e-3 is an order of magnitude above that and nearly three below
# Q8_0's error, so a real implementation error (a RoPE or attention slip moves logits by 1 or
# more) cannot hide under it.
F32_BOUND = 1e-3


def f32_control(view: View) -> Iterator[Check]:
    for s in view.settings:
        c = view.cell("F32", s)
        if c is None:
            continue
        for metric, v in (
            ("last-position max|Δ|", c.last_position.max_abs),
            ("max|Δ| over all steps", c.teacher_forcing.max_max_abs),
        ):
            yield Check(f"F32-{s}", metric, v, f"< {F32_BOUND:g}", v < F32_BOUND)


# --- 2. Q4_K_M error is several times Q8_0's ---------------------------------------------------
# On the median per-step max|Δ|, a statistic (the last position is one draw of the roundings).
# Measured on the seven prompts, every draw: 5.35 to 6.55 (gpu, dequantize-all, jax) and
# 2.63 to 4.67 (cpu, whose Q8_0 error is larger). [2, 8] keeps "several times"; a ratio near 1
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
# Measured 1.42 to 1.85 (median per-step max|Δ|, cpu over gpu) on every prompt and draw. 1.2 is
# still an effect no summation order could make (those are 1e-4), and fails if the activations
# stopped being quantized (ratio 1.00).
CPU_EXTRA = 1.2


def cpu_adds_error(view: View) -> Iterator[Check]:
    r = _median(view, "Q8_0", "cpu") / _median(view, "Q8_0", "gpu")
    yield Check(
        "Q8_0-cpu / Q8_0-gpu", "median per-step max|Δ| ratio", r, f">= {CPU_EXTRA}", r >= CPU_EXTRA
    )


# GPU and dequantize-all compute the same products (weights dequantized either way) and differ
# by float32 summation order only: measured relative difference at most 2.7e-5 (fact, Q8_0).
# 1e-3 is far above that and far below the 40% or more the activation quantization makes.
SAME = 1e-3


def gpu_is_dequantize_all(view: View) -> Iterator[Check]:
    for v in _quantized(view):
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
# position is one draw of the CPU's roundings: measured 0.2% to 18% over the prompts and
# draws, it fails on list, poem, fact, explain and raw. It is reported, not asserted; the asserted
# form compares the CPU arithmetic's excess for the two files, on the median.
FEW_PERCENT = 0.10


def q4_within_few_percent(view: View) -> Iterator[Check]:
    y = _cell(view, "Q4_K_M", "gpu").last_position.max_abs
    for s in ("cpu", "dequantize-all"):
        x = _cell(view, "Q4_K_M", s).last_position.max_abs
        r = abs(x - y) / y
        yield Check(
            f"Q4_K_M-{s} / Q4_K_M-gpu",
            "relative difference of last-position max|Δ|",
            r,
            f"<= {FEW_PERCENT:g}",
            r <= FEW_PERCENT,
        )


# The CPU arithmetic's excess over the GPU's, on the median: Q4_K_M -0.09 to +0.13, Q8_0 +0.42
# to +0.85 on every prompt and draw. Asserted as an ordering, not a percentage.
def q4_swamps_activations(view: View) -> Iterator[Check]:
    q8, q4 = _excess(view, "Q8_0"), _excess(view, "Q4_K_M")
    yield Check(
        "Q4_K_M vs Q8_0 (cpu / gpu)",
        "CPU excess of the median: Q4_K_M vs Q8_0",
        q4,
        "< Q8_0's",
        q4 < q8,
        shown=f"{q4:+.3f} vs {q8:+.3f}",
    )


def _excess(view: View, variant: str) -> float:
    """The CPU arithmetic's excess over the GPU's on the median per-step max|Δ|."""
    return _median(view, variant, "cpu") / _median(view, variant, "gpu") - 1


# --- 4. which steps flip under teacher forcing --------------------------------------------------
# Q8_0 flips only where the reference is nearly tied, on the scale of its own error: a flip
# needs two logits' errors to differ by more than the reference's margin, so a step whose margin
# exceeds the typical step's largest logit error (the median per-step max|Δ|, 0.44-1.32 for
# Q8_0) flips only under an error spike. Measured: the largest flip margin is 0.008 to 0.47 of
# the median on every prompt and draw (0.36 against 0.77 on cpu-cache, a CPU draw). The bound
# is not an absolute margin: one more draw of the activation roundings can flip a step near any
# margin the error reaches (0.21 absolute before the attention products changed shape, 0.36 after).
NEAR_TIE = 1.0


def q8_flips_near_ties(view: View) -> Iterator[Check]:
    for s in view.settings:
        m = _margins(view, "Q8_0", s)
        if m is None:
            continue
        top, median = max(m, default=0.0), _median(view, "Q8_0", s)
        yield Check(
            f"Q8_0-{s}",
            "largest reference margin of a flip / median per-step max|Δ|",
            top / median if m else "no flips",
            f"<= {NEAR_TIE:g}",
            (top / median <= NEAR_TIE) if m else None,
            shown=f"{top:.3g} / {median:.3g} = {top / median:.3g}" if m else "",
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
    for v in _quantized(view):
        g = [f.step for f in _cell(view, v, "gpu").teacher_forcing.flips]
        d = [f.step for f in _cell(view, v, "dequantize-all").teacher_forcing.flips]
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
            f, t = c.free_generation.fork, c.teacher_forcing.first_flip
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
    for v in _quantized(view):
        a = _cell(view, v, "gpu").free_generation.tokens
        b = _cell(view, v, "dequantize-all").free_generation.tokens
        at = fork(a, b)
        yield Check(
            f"{v}-gpu / {v}-dequantize-all",
            "first differing token",
            at,
            "never",
            at is None and len(a) == len(b),
        )


# The CPU arithmetic differs from them in its tokens: its free generation leaves theirs, unless
# it never flips. Not asserted: on three of the seven prompts the CPU
# flips under teacher forcing but its free generation equals the GPU's (both leave the
# reference at the same step for the same token, or not at all).


def cpu_tokens_differ(view: View) -> Iterator[Check]:
    for v in QUANTIZED:
        cpu, gpu = _cell(view, v, "cpu"), _cell(view, v, "gpu")
        at = fork(cpu.free_generation.tokens, gpu.free_generation.tokens)
        flips = bool(cpu.teacher_forcing.flips)
        yield Check(
            f"{v}-cpu / {v}-gpu",
            "first differing token",
            at,
            "a fork",
            (at is not None) if flips else None,
        )


# --- 7. where the drift enters: attribution by tensor class ----------------------------------
# The `attribution` cells on every prompt: Q8_0-cpu in every draw (activations rounded to Q8
# for one class at a time, the rest f32), so these checks hold against the CPU arithmetic's
# band, and Q4_K_M-dequantize-all (one class's weights in the F32 file at a time; float order
# only). A class's share is its excess mean KLD over the whole's excess.


def _attribution(view: View, variant: str, setting: str) -> Attribution | None:
    c = view.cell(variant, setting)
    return None if c is None or "attribution" not in c else c.attribution


def _shares(a: Attribution) -> dict[str, float]:
    whole = a.whole_excess.mean_kld
    return {p.group: p.excess_mean_kld / whole for p in a.parts}


# No class carries half of the error: there is no one tensor whose rounding to change. A half
# is the line between "one cause" and "spread"; a mis-grouped attribution (every tensor in one
# class) gives 100%. Q4_K_M's weights: largest share on any prompt 32.5% (attn_v on code),
# float order only, so the same on every machine: asserted. Q8_0's activation rounding: 38.5%
# in the base draw (ffn_down on code), but up to 51.1% in a draw (attn_v on fact, whose 8
# steps make each class's excess a few large differences): reported, not asserted.
ONE_CLASS = 0.5


def _spread(view: View, variant: str, setting: str) -> Iterator[Check]:
    a = _attribution(view, variant, setting)
    if a is not None:
        group, share = max(_shares(a).items(), key=lambda kv: kv[1])
        yield Check(
            f"{variant}-{setting}",
            "largest share of a class",
            share,
            f"< {ONE_CLASS:g}",
            share < ONE_CLASS,
            shown=f"{share:.3f} ({group})",
        )


def weight_error_is_spread(view: View) -> Iterator[Check]:
    return _spread(view, "Q4_K_M", "dequantize-all")


def activation_error_is_spread(view: View) -> Iterator[Check]:
    return _spread(view, "Q8_0", "cpu")


# The weight errors of the classes add up: KL is quadratic in a small perturbation of the
# logits, and perturbations from different tensors are nearly uncorrelated, so the cross terms
# average out. Measured sum of the parts over the whole: 0.81 (explain) to 1.27 (code).
# [3/4, 4/3] says "adds up to within a quarter"; a cross term as large as the parts would put
# it at 1/2 or 2.
ADDS_UP = (0.75, 4 / 3)


def _parts_over_whole(a: Attribution) -> float:
    return a.sum_of_parts.mean_kld / a.whole_excess.mean_kld


def _adds_up(view: View, variant: str, setting: str) -> Iterator[Check]:
    a = _attribution(view, variant, setting)
    if a is not None:
        r = _parts_over_whole(a)
        yield Check(
            f"{variant}-{setting}",
            "sum of the parts / whole (mean KLD)",
            r,
            f"in [{ADDS_UP[0]:g}, {ADDS_UP[1]:.3g}]",
            ADDS_UP[0] <= r <= ADDS_UP[1],
        )


def weight_errors_add_up(view: View) -> Iterator[Check]:
    return _adds_up(view, "Q4_K_M", "dequantize-all")


# The same for the activation rounding. Not asserted: measured 0.19 (fact, 8 steps: the
# excess there is a few large per-step differences, not a sum of small ones) to 1.57 (code),
# over the draws.
def activation_errors_add_up(view: View) -> Iterator[Check]:
    return _adds_up(view, "Q8_0", "cpu")


# SmolLM2's tied embedding is Q8_0 in the source, so re-quantizing its F32 values to Q8_0
# gives the same blocks: the output class carries no weight error at all (exactly 0), and the
# embedding lookup of either file equals the F32 file's (the layer trace, below).
def tied_embedding_is_exact(view: View) -> Iterator[Check]:
    a = _attribution(view, "Q4_K_M", "dequantize-all")
    if a is not None:
        x = next(p for p in a.parts if p.group == "output").excess_mean_kld
        yield Check("Q4_K_M-dequantize-all", "output's excess mean KLD", x, "== 0", x == 0.0)


# --- 8. where the drift enters: the layer trace ------------------------------------------------
# `layer_trace` on the original prompt, every file and arithmetic, at all positions; the F32
# file under the same setting is the control.


def _trace(view: View, variant: str, setting: str) -> LayerTrace | None:
    c = view.cell(variant, setting)
    return None if c is None or "layer_trace" not in c else c.layer_trace


# The error enters in block 0, not at the embedding (the embedding is exact: see above), and
# for every quantized file and arithmetic: the first residual point outside the F32 band.
def error_enters_in_block_0(view: View) -> Iterator[Check]:
    for v in _quantized(view):
        for s in view.settings:
            t, control = _trace(view, v, s), _trace(view, "F32", s)
            if t is None or control is None:
                continue
            first = None
            for name in t.residual:
                edge = BAND * max(control.errors[name].rel_l2, 2.0**-24)
                if t.errors[name].rel_l2 > edge:
                    first = name
                    break
            yield Check(
                f"{v}-{s}", "leaves the F32 band at", first, "blk.0.out", first == "blk.0.out"
            )


# The CPU arithmetic's residual error is above the GPU's after every block: the activation
# rounding adds at each block, not at one. Measured cpu/gpu relative L2 after each block:
# Q8_0 1.25 to 2.13, asserted as an ordering at every point. Q4_K_M 1.03 to 1.14: its 5-bit
# weights dominate (as above), and 3% is within what another machine's draw of the roundings
# could move, while the layer trace runs in the base draw only: reported, not asserted.
def _cpu_over_gpu(view: View, variant: str) -> Iterator[Check]:
    cpu, gpu = _trace(view, variant, "cpu"), _trace(view, variant, "gpu")
    if cpu is not None and gpu is not None:
        ratios = [cpu.errors[n].rel_l2 / gpu.errors[n].rel_l2 for n in cpu.residual[1:]]
        r = min(ratios)
        yield Check(
            f"{variant}-cpu / {variant}-gpu",
            "smallest ratio of rel L2 over the layers",
            r,
            "> 1",
            r > 1.0,
        )


def cpu_above_gpu_at_every_layer(view: View) -> Iterator[Check]:
    return _cpu_over_gpu(view, "Q8_0")


def q4_cpu_above_gpu_at_every_layer(view: View) -> Iterator[Check]:
    return _cpu_over_gpu(view, "Q4_K_M")


# --- 9. the same findings over a corpus ---------------------------------------------------------
# The `corpus` cells: 4,080 scored positions of Botchan against transformers f32, where the
# prompts above have 8 to 300 steps each. KL divergence is quadratic in a small logit error,
# so the bounds above on max|Δ| ratios become their squares on mean KLD.


def _kld(view: View, variant: str, setting: str) -> float | None:
    c = view.cell(variant, setting)
    return None if c is None or "corpus" not in c else float(c.corpus.kl.mean_kld)


# F32: summation order only; measured mean KLD 7e-12 to 1.4e-11. (1e-3)^2, the square of the
# control's bound above, is five orders above it.
def f32_control_on_the_corpus(view: View) -> Iterator[Check]:
    for s in view.settings:
        k = _kld(view, "F32", s)
        if k is not None:
            bound = F32_BOUND**2
            yield Check(f"F32-{s}", "corpus mean KLD", k, f"< {bound:g}", k < bound)


# Q4_K_M over Q8_0: measured 12.2 (cpu) and 38.4 (gpu, dequantize-all): the square of the
# median max|Δ| ratios above (2.6-4.7 cpu, 5.4-6.6 elsewhere), inside [2, 8] squared.
def q4_vs_q8_on_the_corpus(view: View) -> Iterator[Check]:
    for s in view.settings:
        q8, q4 = _kld(view, "Q8_0", s), _kld(view, "Q4_K_M", s)
        if q8 is not None and q4 is not None:
            r, (lo, hi) = q4 / q8, (RATIO[0] ** 2, RATIO[1] ** 2)
            yield Check(
                f"Q4_K_M-{s} / Q8_0-{s}",
                "corpus mean KLD ratio",
                r,
                f"in [{lo:g}, {hi:g}]",
                lo <= r <= hi,
            )


# Q8_0: the CPU arithmetic's activation rounding triples the KL divergence (measured 3.44);
# at least CPU_EXTRA squared. Q4_K_M's weight error swamps it there (1.10): smaller than Q8_0's.
def cpu_adds_error_on_the_corpus(view: View) -> Iterator[Check]:
    ratios = {}
    for v in QUANTIZED:
        cpu, gpu = _kld(view, v, "cpu"), _kld(view, v, "gpu")
        if cpu is not None and gpu is not None:
            ratios[v] = cpu / gpu
    if "Q8_0" in ratios:
        r, bound = ratios["Q8_0"], CPU_EXTRA**2
        yield Check(
            "Q8_0-cpu / Q8_0-gpu", "corpus mean KLD ratio", r, f">= {bound:.3g}", r >= bound
        )
    if len(ratios) == 2:
        q8, q4 = ratios["Q8_0"], ratios["Q4_K_M"]
        yield Check(
            "Q4_K_M vs Q8_0 (cpu / gpu)",
            "corpus mean KLD: CPU excess",
            q4 - 1,
            "< Q8_0's",
            q4 < q8,
            shown=f"{q4 - 1:+.3f} vs {q8 - 1:+.3f}",
        )


# GPU and dequantize-all: float32 order only; measured relative difference of the mean KLD
# at most 1.3e-6 (Q8_0). Twice SAME: a relative change e of the logit error
# changes KL by about 2e.
def gpu_is_dequantize_all_on_the_corpus(view: View) -> Iterator[Check]:
    for v in _quantized(view):
        gpu, da = _kld(view, v, "gpu"), _kld(view, v, "dequantize-all")
        if gpu is not None and da is not None:
            rel = abs(da - gpu) / gpu
            yield Check(
                f"{v}-dequantize-all / {v}-gpu",
                "relative difference of corpus mean KLD",
                rel,
                f"<= {2 * SAME:g}",
                rel <= 2 * SAME,
            )


# --- 10. the importance matrix ------------------------------------------------------------------
# Q4_K_M and IQ4_XS quantized with an importance matrix computed over Botchan (16 chunks of
# 512 tokens after the corpus measure's 16 windows): does it change which part of the
# arithmetic causes the drift, and by how much? Orderings, not tolerances: each compares two
# files under the same arithmetic, whose difference is the matrix alone.


def imatrix_lowers_q4_error(view: View) -> Iterator[Check]:
    for s in view.settings:
        if view.cell("Q4_K_M", s) is None or view.cell("Q4_K_M-imatrix", s) is None:
            continue
        r = _median(view, "Q4_K_M-imatrix", s) / _median(view, "Q4_K_M", s)
        yield Check(
            f"Q4_K_M-imatrix-{s} / Q4_K_M-{s}", "median per-step max|Δ| ratio", r, "< 1", r < 1
        )


def _versus(a: str, b: str, xa: float, xb: float, metric: str, *, above: bool) -> Check:
    """``a``'s CPU excess against ``b``'s: above it (or below it, with ``above=False``)."""
    return Check(
        f"{a} vs {b} (cpu / gpu)",
        metric,
        xa,
        f"{'>' if above else '<'} {b}'s",
        xa > xb if above else xa < xb,
        shown=f"{xa:+.3f} vs {xb:+.3f}",
    )


# With an importance matrix the weights still dominate: the CPU arithmetic's excess is
# smaller than it is on Q8_0, as for Q4_K_M without one (q4_swamps_activations).
def imatrix_keeps_weights_dominant(view: View) -> Iterator[Check]:
    q8 = _excess(view, "Q8_0")
    for v in IMATRIX:
        if view.cell(v, "cpu") is not None:
            yield _versus(v, "Q8_0", _excess(view, v), q8, "CPU excess of the median", above=False)


# By how much: the activation rounding's share of the error grows as the weight error
# shrinks. The CPU excess with the matrix against without it, on the median.
def imatrix_raises_cpu_share(view: View) -> Iterator[Check]:
    if view.cell("Q4_K_M-imatrix", "cpu") is not None:
        a, b = _excess(view, "Q4_K_M-imatrix"), _excess(view, "Q4_K_M")
        yield _versus("Q4_K_M-imatrix", "Q4_K_M", a, b, "CPU excess of the median", above=True)


def imatrix_weight_error_is_spread(view: View) -> Iterator[Check]:
    return _spread(view, "Q4_K_M-imatrix", "dequantize-all")


def imatrix_weight_errors_add_up(view: View) -> Iterator[Check]:
    return _adds_up(view, "Q4_K_M-imatrix", "dequantize-all")


# Which classes the matrix helps: each class's excess mean KLD with it against without it.
def imatrix_lowers_every_class(view: View) -> Iterator[Check]:
    a = _attribution(view, "Q4_K_M-imatrix", "dequantize-all")
    b = _attribution(view, "Q4_K_M", "dequantize-all")
    if a is None or b is None:
        return
    without = {p.group: p.excess_mean_kld for p in b.parts}
    for p in a.parts:
        x, y = p.excess_mean_kld, without[p.group]
        if y == 0.0:  # the output class: the same Q8_0 blocks either way
            continue
        yield Check(
            f"Q4_K_M-imatrix-dequantize-all: {p.group}",
            "excess mean KLD with / without the matrix",
            x / y,
            "< 1",
            x < y,
        )


# Over the corpus: the matrix lowers the KL divergence on every arithmetic, and the CPU
# arithmetic's excess stays below Q8_0's.
def imatrix_lowers_kld_on_the_corpus(view: View) -> Iterator[Check]:
    for s in view.settings:
        a, b = _kld(view, "Q4_K_M-imatrix", s), _kld(view, "Q4_K_M", s)
        if a is not None and b is not None:
            yield Check(
                f"Q4_K_M-imatrix-{s} / Q4_K_M-{s}", "corpus mean KLD ratio", a / b, "< 1", a < b
            )


def _corpus_excess(view: View, variants: tuple[str, ...]) -> dict[str, float]:
    """The CPU arithmetic's excess over the GPU's of corpus mean KLD, where both ran."""
    out = {}
    for v in variants:
        cpu, gpu = _kld(view, v, "cpu"), _kld(view, v, "gpu")
        if cpu is not None and gpu is not None:
            out[v] = cpu / gpu - 1
    return out


def imatrix_keeps_weights_dominant_on_the_corpus(view: View) -> Iterator[Check]:
    x = _corpus_excess(view, ("Q8_0", *IMATRIX))
    for v in IMATRIX:
        if "Q8_0" in x and v in x:
            yield _versus(v, "Q8_0", x[v], x["Q8_0"], "corpus mean KLD: CPU excess", above=False)


# The CPU arithmetic's share over the corpus: its excess of mean KLD with the matrix against
# without it. One measurement of the base draw (the corpus cells have no CPU band): reported.
def imatrix_raises_cpu_share_on_the_corpus(view: View) -> Iterator[Check]:
    x = _corpus_excess(view, ("Q4_K_M", "Q4_K_M-imatrix"))
    if len(x) == 2:
        a, b = x["Q4_K_M-imatrix"], x["Q4_K_M"]
        yield _versus("Q4_K_M-imatrix", "Q4_K_M", a, b, "corpus mean KLD: CPU excess", above=True)
