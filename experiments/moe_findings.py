"""The MoE study's findings (experiments/moe.toml, docs/moe.md), as predicates over one
prompt's cells.

The model is SmolLM2-135M-Instruct upcycled into 4 experts per layer, 2 per token: each
expert a copy of the layer's FFN with 5% multiplicative noise on its weights, the router rows
the mean gate rows of balanced k-means clusters of the neurons (qllama.study.moefy). The
reference is qllama's own F32 run (numpy, every weight f32), which the routing measure
compares with too. Every bound comes from the measured runs (docs/moe.md), with the
reasoning beside it; a check with nothing to test on a prompt returns ``ok=None``.

Two arithmetics: dequantize-all (the reference's own, so a file's routing changes are its
weights') and the CPU arithmetic (activations quantized to Q8 before the products, the
router's softmax ggml's), where the F32 file's changes are the arithmetic's alone.
"""

from __future__ import annotations

from collections.abc import Iterator

from qllama.measure.routing import RoutingReport
from qllama.study import Check, View
from qllama.study.results import Attribution

SETTING = "dequantize-all"  # the reference's arithmetic, and the attributions'
SETTINGS = ("dequantize-all", "cpu")
QUANTIZED = ("Q8_0", "Q4_K_M")
EXPERT_CLASSES = ("ffn_gate_exps", "ffn_up_exps", "ffn_down_exps")


def _routing(view: View, variant: str, setting: str = SETTING) -> RoutingReport | None:
    c = view.cell(variant, setting)
    return None if c is None or "routing" not in c else c.routing


def _attribution(view: View, variant: str, by: str) -> Attribution | None:
    c = view.cell(variant, SETTING)
    if c is None or "attribution" not in c or c.attribution.by != by:
        return None
    return c.attribution


# The F32 variant runs the reference's file with the reference's arithmetic, in one forward pass
# over the same tokens: every router logit is the same float, so every selection is, and the
# logits are bit for bit the reference's (KL 0, max |Δ| 0). Anything else is a bug in the
# measure (two runs that are not the same computation), not a rounding.
def f32_routes_as_the_reference(view: View) -> Iterator[Check]:
    r = _routing(view, "F32")
    if r is not None:
        yield Check(
            f"F32-{SETTING}",
            "(layer, token) pairs routed otherwise",
            r.routing.changed,
            "0",
            r.routing.changed == 0.0,
        )
        yield Check(f"F32-{SETTING}", "mean KLD", r.free.mean_kld, "0", r.free.mean_kld == 0.0)


# ggml multiplies F32 weights by float32 activations (F32's vec_dot type is F32): the CPU
# arithmetic rounds activations to 8 bits only before products with quantized weights. So the
# F32 file under it differs from the reference in the order of float sums alone (mean KLD 8e-12
# measured), far below any router margin: no selection crosses (0 pairs on both prompts). Not
# asserted: another machine's BLAS sums in another order, and a pair that close to a tie is
# possible, though not seen.
def f32_cpu_routes_as_the_reference(view: View) -> Iterator[Check]:
    r = _routing(view, "F32", "cpu")
    if r is not None:
        changed = r.routing.changed
        yield Check("F32-cpu", "(layer, token) pairs routed otherwise", changed, "0", changed == 0)


# Under the CPU arithmetic a quantized file's router input carries the activations' 8-bit
# rounding besides the weights' error. For Q8_0 the two are of a size (8 bits, a scale per 32
# values, each), so more selections cross than under dequantize-all: measured 0.75% against
# 0.35% (cpu-cache) and 1.26% against 0.50% (raw). For Q4_K_M the weights' error dominates and
# the two settings are within 3% of each other (3.18% against 3.10%), so only Q8_0 is asserted.
def cpu_arithmetic_reroutes_q8_more(view: View) -> Iterator[Check]:
    cpu, deq = _routing(view, "Q8_0", "cpu"), _routing(view, "Q8_0", SETTING)
    if cpu is not None and deq is not None:
        yield Check(
            "Q8_0-cpu",
            "pairs routed otherwise, over dequantize-all's",
            cpu.routing.changed,
            f"> {deq.routing.changed:.4g}",
            cpu.routing.changed > deq.routing.changed,
        )


# Q4_K_M's weight error is several times Q8_0's, so its router inputs move more, and more
# selections cross: measured 3.1% of the (layer, token) pairs against 0.35% (cpu-cache).
# "More" is the claim; the factor depends on the prompt.
def q4_reroutes_more_than_q8(view: View) -> Iterator[Check]:
    for setting in SETTINGS:
        q8, q4 = _routing(view, "Q8_0", setting), _routing(view, "Q4_K_M", setting)
        if q8 is not None and q4 is not None:
            yield Check(
                f"Q4_K_M-{setting}",
                "pairs routed otherwise, over Q8_0's",
                q4.routing.changed,
                f"> {q8.routing.changed:.4g}",
                q4.routing.changed > q8.routing.changed,
            )


# A quantized router input flips a selection only where the reference's k-th and (k+1)-th
# gated values are close: the median reference margin at the changed pairs is far below the
# median over all pairs (measured: 1/100 of it for Q8_0, 1/11 for Q4_K_M, cpu-cache). A
# quarter leaves room for the prompt and says "near-ties", not "anywhere".
NEAR_TIE = 0.25


def reroutes_at_near_ties(view: View) -> Iterator[Check]:
    for setting in SETTINGS:
        for v in QUANTIZED:
            r = _routing(view, v, setting)
            if r is None:
                continue
            s = r.routing
            if s.median_margin_changed is None:
                yield Check(f"{v}-{setting}", "margin at changes / median margin", None, "", None)
                continue
            ratio = s.median_margin_changed / s.median_margin
            yield Check(
                f"{v}-{setting}",
                "margin at changes / median margin",
                ratio,
                f"< {NEAR_TIE:g}",
                ratio < NEAR_TIE,
            )


# With the F32 file's experts forced, the quantized files' mean KL divergence hardly moves:
# measured 1.3% (Q8_0) and 1.7% (Q4_K_M) of it follows the routing changes (cpu-cache). The
# experts are copies of one FFN with 5% noise, so another expert computes nearly the same; the
# error is the weights' own. A tenth is the bound: a routing that mattered (experts that
# differ, as a trained mixture's do) would explain a large share, and fail it.
SMALL_SHARE = 0.1


def routing_explains_little(view: View) -> Iterator[Check]:
    for setting in SETTINGS:
        for v in QUANTIZED:
            r = _routing(view, v, setting)
            if r is not None and r.explained is not None:
                yield Check(
                    f"{v}-{setting}",
                    "share of the mean KLD the routing explains",
                    r.explained,
                    f"|x| < {SMALL_SHARE:g}",
                    abs(r.explained) < SMALL_SHARE,
                )


# The router is F32 in every file (the converter writes it so, llama-quantize never quantizes
# it), so taking it from the Q4_K_M file changes nothing: exactly 0 excess KL divergence. A
# quantized file reroutes only because the router's input moved.
def router_carries_no_weight_error(view: View) -> Iterator[Check]:
    a = _attribution(view, "Q4_K_M", "class")
    if a is None:
        return
    router = next((p for p in a.parts if p.group == "ffn_gate_inp"), None)
    if router is not None:
        yield Check(
            f"Q4_K_M-{SETTING}",
            "the router's excess mean KLD",
            router.excess_mean_kld,
            "0",
            router.excess_mean_kld == 0.0,
        )


# Which experts carry Q4_K_M's expert weight error. Were the load even, each of the 120
# (layer, expert) pairs would carry about 1/120 of it (0.8%); measured on the chat prompt: the
# last layer's expert 3, which every token uses with a mean weight of 0.79, carries 18%, and
# layer 11's expert 0 (96% of the tokens) 8.5%, the median expert 0.18%. An expert's share
# follows its load, not its weights (all copies of one FFN, quantized alike). One prompt
# measured: not asserted (a bound of a tenth says "a few experts", not "spread").
CONCENTRATED = 0.1


def expert_error_concentrates(view: View) -> Iterator[Check]:
    a = _attribution(view, "Q4_K_M", "expert")
    if a is None:
        return
    top = a.parts[0]  # ranked, the largest excess first
    share = top.excess_mean_kld / a.whole_excess.mean_kld
    yield Check(
        f"Q4_K_M-{SETTING}",
        f"largest expert share ({top.group})",
        share,
        f"> {CONCENTRATED:g}",
        share > CONCENTRATED,
    )
