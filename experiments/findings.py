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
