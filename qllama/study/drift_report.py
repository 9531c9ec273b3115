"""The report's sections on where the drift enters: the ``attribution`` and ``layer_trace``
measures (:mod:`qllama.study.measures`), per prompt and across prompts, and the layer plots.

A cell's layer trace is read beside its F32 control, the cell of the F32 variant (the
measure's ``f32``) under the same setting, as ``qllama trace`` does: a setting leaves the
control's band at the first point of the residual stream whose relative L2 error is more than
:data:`qllama.measure.trace.BAND_FACTOR` times the control's there.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from qllama.measure.trace import SettingTrace, TraceReport
from qllama.study.collect import CellRecord, PromptResults, measure_options
from qllama.study.results import Attribution

Table = Callable[[Sequence[str], Sequence[Sequence[Any]]], list[str]]


def _g(x: float) -> str:
    return f"{x:.3g}"


def _share(x: float, whole: float) -> str:
    return f"{100 * x / whole:.1f}%" if whole > 0 else "–"


def _what(a: Attribution) -> str:
    if a.kind == "activations":
        return (
            f"activations rounded to Q8 for one {a.by} at a time, the rest on "
            f"{a.arithmetic} activations"
        )
    return f"the file's weights for one {a.by} at a time, the rest of the F32 file's"


def attribution_cells(cells: Mapping[str, CellRecord]) -> dict[str, Attribution]:
    """The cells of one prompt (by label) that hold an attribution, and theirs."""
    return {k: c.measures.attribution for k, c in cells.items() if "attribution" in c.measures}


def section_attribution(cells: Mapping[str, CellRecord], table: Table) -> list[str]:
    """One table per attributed cell: each group's excess over the baseline, ranked."""
    out = []
    for label, a in attribution_cells(cells).items():
        whole = a.whole_excess
        rows: list[list[Any]] = [
            [
                p.group,
                len(p.tensors),
                _g(p.excess_mean_kld),
                _share(p.excess_mean_kld, whole.mean_kld),
                _g(p.excess_median_max_abs),
            ]
            for p in a.parts
        ]
        parts = a.sum_of_parts
        rows += [
            [
                "**sum of the parts**",
                "",
                _g(parts.mean_kld),
                _share(parts.mean_kld, whole.mean_kld),
                _g(parts.median_max_abs),
            ],
            ["**whole** (all on)", "", _g(whole.mean_kld), "100%", _g(whole.median_max_abs)],
        ]
        b = a.baseline
        out += [
            f"### Attribution: {label}\n",
            f"{_what(a)}; {a.steps} teacher-forced steps. Excess = the variant's number "
            f"minus the baseline's (all off: mean KLD {_g(b.mean_kld)}, median max |Δlogit| "
            f"{_g(b.median_max_abs)}).\n",
            *table(
                ["group", "tensors", "excess mean KLD", "share", "excess median max |Δlogit|"],
                rows,
            ),
        ]
    return out


def summary_attribution(prompts: Mapping[str, PromptResults], table: Table) -> list[str]:
    """Each attributed cell's shares of the whole by group, prompt by prompt: a table per cell
    and kind of attribution (a cell may be attributed by class on one prompt, by expert on
    another: their groups are not the same)."""
    kinds = list(
        dict.fromkeys(
            (k, a.kind, a.by)
            for e in prompts.values()
            for k, a in attribution_cells(e.cells).items()
        )
    )
    out = []
    for label, kind, by in kinds:
        per = {
            p: a
            for p, e in prompts.items()
            if (a := attribution_cells(e.cells).get(label)) is not None
            and (a.kind, a.by) == (kind, by)
        }
        groups = list(dict.fromkeys(g.group for a in per.values() for g in a.parts))

        def share(a: Attribution, group: str) -> str:
            part = next(g for g in a.parts if g.group == group)
            return _share(part.excess_mean_kld, a.whole_excess.mean_kld)

        rows = [[g, *(share(a, g) for a in per.values())] for g in groups]
        rows.append(
            [
                "**sum of the parts**",
                *(_share(a.sum_of_parts.mean_kld, a.whole_excess.mean_kld) for a in per.values()),
            ]
        )
        rows.append(
            ["whole: excess mean KLD", *(_g(a.whole_excess.mean_kld) for a in per.values())]
        )
        first = next(iter(per.values()))
        out += [
            f"### Attribution of {label}, every prompt\n",
            f"{_what(first)}: each group's share of the whole's excess mean KLD.\n",
            *table(["group", *per], rows),
        ]
    return out


# --- the layer trace ---------------------------------------------------------------------------


def traces(
    cells: Mapping[str, CellRecord],
    variants: Sequence[str],
    settings: Sequence[str],
    control: str,
    n_tokens: int,
) -> dict[str, TraceReport]:
    """A :class:`TraceReport` per traced variant (not the control) of one prompt of
    ``n_tokens`` tokens (every position traced), a setting each where both the variant's
    cell and the control's hold a trace."""
    out: dict[str, TraceReport] = {}
    for v in variants:
        if v == control:
            continue
        for s in settings:
            ours, ctrl = cells.get(f"{v}-{s}"), cells.get(f"{control}-{s}")
            if ours is None or ctrl is None:
                continue
            if "layer_trace" not in ours.measures or "layer_trace" not in ctrl.measures:
                continue
            mo, mc = ours.measures.layer_trace, ctrl.measures.layer_trace
            positions = list(range(n_tokens))
            report = out.setdefault(v, TraceReport(v, control, n_tokens, positions))
            report.settings[s] = SettingTrace(
                s, dict(mo.errors), dict(mc.errors), list(mo.residual)
            )
    return out


def prompt_traces(study: Mapping[str, Any], entry: PromptResults) -> dict[str, TraceReport]:
    """The layer traces of one prompt's cells, each beside its F32 control (the measure's
    ``f32``, or the study's first variant)."""
    options = measure_options(study, "layer_trace")
    if options is None:
        return {}
    ref = entry.reference
    return traces(
        entry.cells,
        list(study["variants"]),
        list(study["settings"]),
        options.get("f32") or next(iter(study["variants"])),
        ref.prompt_tokens + ref.length,
    )


def _where(name: str | None) -> str:
    if name is None:
        return "nowhere"
    return name.replace("blk.", "after block ").replace(".out", "")


def section_layer_trace(
    reports: Mapping[str, TraceReport], prompt: str, table: Table, reference: str
) -> list[str]:
    """Where each setting leaves the F32 control's band, and the error at the logits, against
    the F32 file run by ``reference``."""
    if not reports:
        return []
    rows = []
    for v, r in reports.items():
        for s, st in r.settings.items():
            logits = st.residual[-1]
            mid = st.residual[len(st.residual) // 2]
            rows.append(
                [
                    v,
                    s,
                    _where(st.leaves_band),
                    _g(st.errors[st.residual[1]].rel_l2),
                    _g(st.errors[mid].rel_l2),
                    _g(st.errors[logits].rel_l2),
                    _g(st.control[logits].rel_l2),
                ]
            )
    first = next(iter(reports.values()))
    some = next(iter(first.settings.values()))
    mid = _where(some.residual[len(some.residual) // 2])
    plots = " ".join(f"![layer trace, {v}](plots/{prompt}-layers-{v}.png)" for v in reports)
    return [
        "### Layer trace\n",
        f"Relative L2 error of the residual stream at all {first.n_tokens} positions against "
        f"the F32 file run by {reference}, beside the F32 file under the same setting "
        f"(the control; its band is {some.band_factor:g}x its error, floor 2^-24).\n",
        *table(
            [
                "file",
                "setting",
                "leaves the F32 band",
                "rel L2 after block 0",
                f"rel L2 {mid}",
                "rel L2 logits",
                "control, logits",
            ],
            rows,
        ),
        plots + "\n",
    ]


def plot_traces(reports: Mapping[str, TraceReport], prompt: str, folder: Path) -> None:
    """``plots/{prompt}-layers-{variant}.png``: error against layer, a line per setting."""
    for v, r in reports.items():
        r.plot(folder / f"{prompt}-layers-{v}.png", prompt=prompt)
