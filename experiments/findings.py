"""The study's findings, checked in code.

Each finding of the original study (DESIGN.md, "The study it reproduces") is one function
below. Every bound comes from our own measured runs (the numbers are in docs/results.md) and
the comment beside it says why it sits where it does: far enough from what we measured to
survive another prompt or a different BLAS, close enough that the finding would fail if it
stopped being true. A failed check names the cell, the metric, the value and the bound.

A finding must hold for any prompt: a setting that never flips or never forks (a short
answer) is a valid outcome, and every check treats "never" as a value, not a crash.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any

from experiments import study
from qllama.compare import fork

QUANTIZED = ("Q8_0", "Q4_K_M")


@dataclass
class Check:
    finding: str
    cell: str
    metric: str
    value: Any
    bound: str
    ok: bool

    def line(self) -> str:
        return f"{self.finding} [{self.cell}] {self.metric} = {self.value} (bound: {self.bound})"

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def _fmt(x: float | None) -> str:
    return "never" if x is None else f"{x:.4g}"


# --- 1. the F32 control ------------------------------------------------------------------------
# Measured (docs/results.md): 4.0e-5 (numpy, torch) and 5.3e-5 (jax) at the last position,
# 7.2e-5 to 1.05e-4 at the worst of 300 steps. What is left at F32 is summation order (BLAS,
# softmax, RMSNorm), ulp-level; 1e-3 (the bound) is an order of magnitude above it
# and nearly three below Q8_0's 0.69, so a real implementation error (a RoPE or attention
# slip gives errors of 1 and more) cannot hide under it.
F32_BOUND = 1e-3


def f32_control(cells: dict[str, Any], data: dict[str, Any]) -> list[Check]:
    out = []
    for s in study.SETTINGS:
        c = cells[f"F32-{s}"]
        for metric, v in (
            ("last-position max|Δ|", c["last_position_max_abs"]),
            ("max|Δ| over all steps", c["teacher_forcing"]["max_max_abs"]),
        ):
            out.append(
                Check(
                    "F32 control differs from transformers by ~1e-4",
                    f"F32-{s}",
                    metric,
                    _fmt(v),
                    f"< {F32_BOUND:g}",
                    v < F32_BOUND,
                )
            )
    return out


# --- 2. Q4_K_M error is several times Q8_0's ---------------------------------------------------
# Measured last-position ratios: 4.23 (gpu, dequantize-all, jax) and 3.55 (cpu, whose Q8_0
# error is larger). [2.5, 8] keeps the finding ("several times") with room for another
# prompt to move it by a third either way; a ratio near 1 (Q4_K_M no worse than Q8_0) or
# an order of magnitude (a broken K-quant) fails.
RATIO = (2.5, 8.0)


def q4_vs_q8(cells: dict[str, Any], data: dict[str, Any]) -> list[Check]:
    out = []
    for s in study.SETTINGS:
        r = (
            cells[f"Q4_K_M-{s}"]["last_position_max_abs"]
            / cells[f"Q8_0-{s}"]["last_position_max_abs"]
        )
        out.append(
            Check(
                "Q4_K_M error is several times Q8_0 error",
                f"Q4_K_M-{s} / Q8_0-{s}",
                "last-position max|Δ| ratio",
                f"{r:.2f}",
                f"in [{RATIO[0]:g}, {RATIO[1]:g}]",
                RATIO[0] <= r <= RATIO[1],
            )
        )
    return out


# --- 3. where the CPU arithmetic's error shows ---------------------------------------------------
# Q8_0: activation quantization adds error on top of the weight error. Measured on the median
# per-step max|Δ| (robust to one step): 0.791 (cpu) against 0.546 (gpu), 1.45x. We ask for
# 1.2x: half the measured excess, still an effect no summation order could make (those are
# 1e-4), and it fails if the activations stopped being quantized (ratio 1.00).
CPU_EXTRA = 1.2
# GPU and dequantize-all compute the same products (weights dequantized either way) and differ
# by float32 summation order only: measured relative difference 3.7e-6. 1e-3 is far above
# that and far below the 45% the activation quantization makes.
SAME = 1e-3
# Q4_K_M: the weight error swamps the activation error, all three within "a few percent":
# measured 3.6% (cpu against gpu) and 0.0% (dequantize-all). 10% is "a few percent" with
# room for another prompt, and below Q8_0's 23% cpu excess at the last position.
FEW_PERCENT = 0.10


def arithmetic(cells: dict[str, Any], data: dict[str, Any]) -> list[Check]:
    out = []

    def med(cell: str) -> float:
        return float(cells[cell]["teacher_forcing"]["median_max_abs"])

    cpu, gpu, da = med("Q8_0-cpu"), med("Q8_0-gpu"), med("Q8_0-dequantize-all")
    out.append(
        Check(
            "Q8_0: the CPU arithmetic adds error (activation quantization)",
            "Q8_0-cpu / Q8_0-gpu",
            "median per-step max|Δ| ratio",
            f"{cpu / gpu:.3f}",
            f">= {CPU_EXTRA}",
            cpu / gpu >= CPU_EXTRA,
        )
    )
    rel = abs(da - gpu) / gpu
    out.append(
        Check(
            "Q8_0: GPU and dequantize-all are nearly identical",
            "Q8_0-dequantize-all / Q8_0-gpu",
            "relative difference of median per-step max|Δ|",
            f"{rel:.2e}",
            f"<= {SAME}",
            rel <= SAME,
        )
    )
    for s in ("cpu", "dequantize-all"):
        a = cells[f"Q4_K_M-{s}"]["last_position_max_abs"]
        b = cells["Q4_K_M-gpu"]["last_position_max_abs"]
        r = abs(a - b) / b
        out.append(
            Check(
                "Q4_K_M: all three arithmetics within a few percent",
                f"Q4_K_M-{s} / Q4_K_M-gpu",
                "relative difference of last-position max|Δ|",
                f"{r:.3f}",
                f"<= {FEW_PERCENT}",
                r <= FEW_PERCENT,
            )
        )
    return out


# --- 4. which steps flip under teacher forcing --------------------------------------------------
# Q8_0 flips only where the reference is nearly tied: measured flip margins 0.025 and 0.173
# (gpu, dequantize-all, jax), 0.044 to 0.110 (cpu), against top logits of 18-28. 0.35 is twice
# the largest; Q4_K_M, whose error is four times larger, flips steps up to 0.58.
NEAR_TIE = 0.35


def flips(cells: dict[str, Any], data: dict[str, Any]) -> list[Check]:
    out = []

    def margins(cell: str) -> list[float]:
        return [f["ref_margin"] for f in cells[cell]["teacher_forcing"]["flips"]]

    for s in study.SETTINGS:
        m8, m4 = margins(f"Q8_0-{s}"), margins(f"Q4_K_M-{s}")
        top8 = max(m8, default=0.0)
        out.append(
            Check(
                "Q8_0 flips only nearly tied steps",
                f"Q8_0-{s}",
                "largest reference margin of a flip",
                _fmt(top8) if m8 else "no flips",
                f"<= {NEAR_TIE}",
                top8 <= NEAR_TIE,
            )
        )
        out.append(
            Check(
                "Q4_K_M flips more steps than Q8_0",
                f"Q4_K_M-{s} vs Q8_0-{s}",
                "flipped steps",
                f"{len(m4)} vs {len(m8)}",
                "Q4_K_M >= Q8_0",
                len(m4) >= len(m8),
            )
        )
        top4 = max(m4, default=0.0)
        out.append(
            Check(
                "Q4_K_M flips include larger margins",
                f"Q4_K_M-{s} vs Q8_0-{s}",
                "largest reference margin of a flip",
                f"{_fmt(top4)} vs {_fmt(top8)}",
                "Q4_K_M > Q8_0 (or neither flips)",
                top4 > top8 or not (m4 or m8),
            )
        )
    for file in QUANTIZED:
        g = [f["step"] for f in cells[f"{file}-gpu"]["teacher_forcing"]["flips"]]
        d = [f["step"] for f in cells[f"{file}-dequantize-all"]["teacher_forcing"]["flips"]]
        out.append(
            Check(
                "GPU and dequantize-all flip the same steps",
                f"{file}-gpu / {file}-dequantize-all",
                "flipped steps",
                f"{g} / {d}",
                "equal",
                g == d,
            )
        )
    return out


# --- 5. free generation forks where teacher forcing first flips ----------------------------------
# Exact: same prefix, same prefill-then-decode path, same logits. No tolerance.


def fork_matches_first_flip(cells: dict[str, Any], data: dict[str, Any]) -> list[Check]:
    out = []
    for cid, c in cells.items():
        f, t = c["free_generation"]["fork"], c["teacher_forcing"]["first_flip"]
        out.append(
            Check(
                "free generation forks at the first teacher-forcing mismatch",
                cid,
                "fork / first flip",
                f"{_fmt(f)} / {_fmt(t)}",
                "equal",
                f == t,
            )
        )
    return out


# --- 6. tokens across settings --------------------------------------------------------------------
# Exact token identity: GPU and dequantize-all compute the same products, so their greedy
# choices only part where float32 order breaks a near-tie, which the study did not see.
# The CPU arithmetic differs from them (it quantizes activations): its free generation leaves
# theirs, unless it never flips under teacher forcing (a short answer), a valid outcome.


def tokens(cells: dict[str, Any], data: dict[str, Any]) -> list[Check]:
    out = []
    for file in QUANTIZED:
        gen = {s: cells[f"{file}-{s}"]["free_generation"]["tokens"] for s in study.SETTINGS}
        at = fork(gen["gpu"], gen["dequantize-all"])
        out.append(
            Check(
                "GPU and dequantize-all are token-identical",
                f"{file}-gpu / {file}-dequantize-all",
                "first differing token",
                _fmt(at),
                "never",
                at is None and len(gen["gpu"]) == len(gen["dequantize-all"]),
            )
        )
        at_cpu = fork(gen["cpu"], gen["gpu"])
        cpu_flips = bool(cells[f"{file}-cpu"]["teacher_forcing"]["flips"])
        out.append(
            Check(
                "the CPU arithmetic differs from GPU and dequantize-all",
                f"{file}-cpu / {file}-gpu",
                "first differing token",
                _fmt(at_cpu),
                "a fork (or CPU never flips)",
                at_cpu is not None or not cpu_flips,
            )
        )
    return out


FINDINGS: list[Callable[[dict[str, Any], dict[str, Any]], list[Check]]] = [
    f32_control,
    q4_vs_q8,
    arithmetic,
    flips,
    fork_matches_first_flip,
    tokens,
]


def check(data: dict[str, Any]) -> list[Check]:
    """Every finding, in order."""
    return [c for finding in FINDINGS for c in finding(data["cells"], data)]
