"""The report's plots (``plots/``), drawn from the collected results: each prompt's per-step
max |Δlogit| and its reference margin with the flipped steps, the summary across prompts, the
layer traces (:mod:`qllama.study.drift_report`) and a mixture's routing per layer."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from qllama.measure.figures import pyplot, save
from qllama.measure.routing import RoutingReport, plot_routing
from qllama.study import drift_report
from qllama.study.collect import Collected, PromptResults
from qllama.study.results import TeacherForcing

MARKERS = "osx+^v<>"  # a setting's marker for its flipped steps


def _teacher_forcing(entry: PromptResults, label: str) -> TeacherForcing | None:
    """The base draw's teacher forcing of cell ``label`` (None: not on this prompt, or not
    measured there)."""
    c = entry.cells.get(label)
    if c is None or "teacher_forcing" not in c.measures:
        return None
    return c.measures.teacher_forcing


def routings(entry: PromptResults) -> dict[str, RoutingReport]:
    """The base draw's routing reports of one prompt's cells, by label (a mixture's study)."""
    return {k: c.measures.routing for k, c in entry.cells.items() if "routing" in c.measures}


def plots(data: Collected, folder: Path) -> None:
    """Every plot the report's markdown links, into ``folder``."""
    for p, entry in data.prompts.items():
        reports = drift_report.prompt_traces(data.study, entry)
        if reports:
            folder.mkdir(parents=True, exist_ok=True)
            drift_report.plot_traces(reports, p, folder)
        routed = routings(entry)
        if routed:
            folder.mkdir(parents=True, exist_ok=True)
            plot_routing(
                routed,
                folder / f"{p}-routing.png",
                f"{p}: each cell's experts against the F32 variant's, per layer",
            )
    if "teacher_forcing" not in data.study["measures"]:
        return
    plt = pyplot()
    folder.mkdir(parents=True, exist_ok=True)
    variants, settings = list(data.study["variants"]), list(data.study["settings"])
    for p, entry in data.prompts.items():
        fig, axes = plt.subplots(
            len(variants), 1, figsize=(9, 2.4 * len(variants)), sharex=True, squeeze=False
        )
        for ax, v in zip(axes[:, 0], variants, strict=True):
            for s in settings:
                tf = _teacher_forcing(entry, f"{v}-{s}")
                if tf is not None and tf.max_abs is not None:
                    ax.plot(tf.max_abs, label=s, lw=0.8)
            ax.set_yscale("log")
            ax.set_ylabel("max |Δlogit|")
            ax.set_title(f"{p}, {v}: teacher forcing, per step", fontsize=9)
            ax.legend(fontsize=7)
        axes[-1, 0].set_xlabel("step")
        _save(fig, folder / f"{p}-max_abs.png")
        _margins(entry, p, variants, settings, folder, plt)
    _summary_plot(data, folder, plt)


def _margins(
    entry: PromptResults,
    prompt: str,
    variants: list[str],
    settings: list[str],
    folder: Path,
    plt: Any,
) -> None:
    """The reference's margin per step, and each cell's flipped steps on it."""
    margin = np.asarray(entry.reference.margin)
    fig, ax = plt.subplots(figsize=(9, 3.2))
    ax.plot(margin, color="0.6", lw=0.8, label="reference margin (top-1 − top-2)")
    for i, v in enumerate(variants):
        for j, s in enumerate(settings):
            tf = _teacher_forcing(entry, f"{v}-{s}")
            flips = [f.step for f in tf.flips] if tf is not None else []
            if flips:
                marker = MARKERS[j % len(MARKERS)]
                ax.scatter(
                    flips,
                    margin[flips],
                    marker=marker,
                    color=f"C{i}",
                    label=f"{v} {s} flips",
                    s=24,
                    facecolors="none" if marker in "os" else None,
                )
    ax.set_yscale("symlog", linthresh=0.1)
    ax.set_xlabel("step")
    ax.set_ylabel("logit")
    ax.set_title(f"{prompt}: reference margin per step; flipped steps marked", fontsize=9)
    ax.legend(fontsize=6, ncol=3)
    _save(fig, folder / f"{prompt}-margins.png")


def _summary_plot(data: Collected, folder: Path, plt: Any) -> None:
    """Each cell's median per-step max |Δlogit| by prompt, with its band over the draws."""
    prompts = list(data.prompts)
    labels = list(dict.fromkeys(k for e in data.prompts.values() for k in e.cells))
    fig, ax = plt.subplots(figsize=(9, 3.6))
    for i, label in enumerate(labels):
        xs, ys, lo, hi = [], [], [], []
        for j, p in enumerate(prompts):
            entry = data.prompts[p]
            if label not in entry.cells:
                continue
            cells = [entry.cells[label], *(d[label] for d in entry.draws.values() if label in d)]
            vals = [c.measures.teacher_forcing.median_max_abs for c in cells]
            xs.append(j + (i - len(labels) / 2) * 0.03)
            ys.append(vals[0])
            lo.append(vals[0] - min(vals))
            hi.append(max(vals) - vals[0])
        ax.errorbar(xs, ys, yerr=[lo, hi], fmt="o", ms=3, lw=0.8, label=label, capsize=2)
    ax.set_xticks(range(len(prompts)), prompts, fontsize=7)
    ax.set_yscale("log")
    ax.set_ylabel("median per-step max |Δlogit|")
    draws = sorted({d for e in data.prompts.values() for d in e.draws})
    ax.set_title(summary_title(draws), fontsize=9)
    ax.legend(fontsize=6, ncol=4)
    _save(fig, folder / "summary.png")


def summary_title(draws: list[str]) -> str:
    """The summary plot's title: what its bars are, or that there are none."""
    if not draws:
        return "Teacher forcing by prompt (no draws: no bands)"
    return f"Teacher forcing by prompt (bars: the band over the draws {', '.join(draws)})"


def _save(fig: Any, path: Path) -> None:
    save(fig, path, dpi=80, bbox_inches="tight")
