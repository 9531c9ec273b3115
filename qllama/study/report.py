"""The report: ``results.md`` (a section per prompt, a summary across prompts), ``results.json``
(every number) and ``plots/``, built from the cached cells alone (``--report-only``).

Sections follow the study's measures: each measure the report knows has a table (``SECTIONS``);
one it does not know (a measure added later) gets a generic table of its scalar numbers. Cells
that the study's draws rerun are shown with their band, ``value [min, max]`` over the draws,
and each prompt lists every draw of them, so a reader sees which numbers are statistics that
reproduce within their band and which are single draws.
"""

from __future__ import annotations

import datetime
import json
import platform
import re
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from qllama.atomic import atomic_write
from qllama.measure.compare import fork
from qllama.measure.metrics import kl_stats, top_k
from qllama.study import corpus_report, drift_report
from qllama.study.cache import CellResult

# --- collect -----------------------------------------------------------------------------------


def _study_info(plan: Any) -> dict[str, Any]:
    s = plan.study
    return {
        "name": s.name,
        "title": s.title,
        "model": s.model,
        "threads": s.threads,
        "skipped_prompts": list(s.skipped_prompts),
        "variants": {
            v.name: {"type": v.type, "sha256": plan.variants[v.name].sha256} for v in s.variants
        },
        "settings": {
            x.name: {
                "engine": x.engine,
                "backend": x.backend,
                "options": dict(x.options),
                "about": x.about,
            }
            for x in s.settings
        },
        "draws": {
            d.name: {
                "settings": list(d.settings),
                "variants": list(d.variants),
                "env": dict(d.env),
                "reference_env": dict(d.reference_env),
                "engine": d.engine,
                "options": dict(d.options),
                "about": d.about,
            }
            for d in s.draws
            if not d.optional
        },
        "measures": list(dict.fromkeys(m.name for m in s.measures)),
        "measure_specs": [
            {"name": m.name, "options": dict(m.options), "cells": list(m.cells)} for m in s.measures
        ],
        "cross": [list(p) for p in s.cross],
        "compare": [{"a": c.a, "b": c.b, "prompts": list(c.prompts)} for c in s.compare],
    }


def _margin(step_logits: np.ndarray) -> list[float]:
    top2 = np.sort(step_logits, axis=-1)[:, -2:]
    return (top2[:, 1] - top2[:, 0]).astype(float).tolist()


def collect(plan: Any, results: Mapping[str, CellResult]) -> dict[str, Any]:
    """Every cell's numbers by prompt and draw, the cross-setting forks and the compared
    pairs, as one JSON-able dict (arrays and the tokenizer under ``_`` keys)."""
    from qllama.runtime.tokenizer import Tokenizer

    study = plan.study
    tok = Tokenizer.from_gguf(next(iter(plan.variants.values())).path)
    prompts: dict[str, Any] = {}
    arrays: dict[tuple[str, str, str], dict[str, np.ndarray]] = {}
    for task in plan.tasks.values():
        c, r = task.cell, results[task.cell.id]
        entry = prompts.setdefault(c.prompt, {"cells": {}, "draws": {}})
        where = entry["cells"] if not c.draw else entry["draws"].setdefault(c.draw, {})
        where[c.label] = r.numbers
        arrays[(c.prompt, c.draw, c.label)] = r.arrays
    for p in study.prompts:
        ref = plan.reference(p.name)
        cont = ref.continuation
        entry = prompts[p.name]
        entry["prompt"] = {
            "text": p.text,
            "messages": [dict(m) for m in p.messages],
            "chat": p.chat,
            "max_new_tokens": p.max_new_tokens,
        }
        entry["reference"] = {
            "meta": ref.meta,
            "text": tok.decode(cont),
            "eos": bool(cont and cont[-1] in tok.stop_ids),
            "length": len(cont),
            "prompt_tokens": ref.n_prompt,
            "margin": _margin(ref.step_logits),
        }
        entry["cross"] = _cross(study, entry, arrays, p.name, ref, tok)
        entry["compare"] = _compare(study, arrays, p.name, ref)
    return {
        "study": _study_info(plan),
        "generated": {
            "date": datetime.date.today().isoformat(),
            "machine": platform.machine(),
            "python": platform.python_version(),
        },
        "prompts": prompts,
        "_arrays": arrays,
        "_tokenizer": tok,
    }


def _cross(
    study: Any, entry: dict[str, Any], arrays: Any, prompt: str, ref: Any, tok: Any
) -> dict[str, Any]:
    """First differing generated token between two settings (base draw), with the top-3 of
    the reference and of each setting at that step."""
    cells = entry["cells"]
    out: dict[str, Any] = {}
    for v in study.variants:
        for a, b in study.cross:
            ca, cb = cells.get(f"{v.name}-{a}"), cells.get(f"{v.name}-{b}")
            if (
                ca is None
                or (cb is None and b != "reference")
                or "free_generation" not in ca["measures"]
            ):
                continue
            ta = ca["measures"]["free_generation"]["tokens"]
            tb = (
                ref.continuation
                if b == "reference"
                else cb["measures"]["free_generation"]["tokens"]
            )
            at = fork(ta, tb)
            e: dict[str, Any] = {"fork": at}
            if at is not None and at < len(ref.step_logits):
                e["reference_top3"] = top_k(ref.step_logits[at], 3)
                e["top3"] = {}
                for s in study.settings:
                    arr = arrays.get((prompt, "", f"{v.name}-{s.name}"), {})
                    if "teacher_forcing.top_ids" in arr:
                        ids, lg = arr["teacher_forcing.top_ids"], arr["teacher_forcing.top_logits"]
                        e["top3"][s.name] = list(
                            zip(ids[at, :3].tolist(), lg[at, :3].tolist(), strict=True)
                        )
                e["context"] = {
                    "prefix": tok.decode(ta[max(0, at - 12) : at]),
                    a: tok.decode(ta[at : at + 12]),
                    b: tok.decode(tb[at : at + 12]),
                }
            out[f"{v.name}: {a} vs {b}"] = e
    return out


def _compare(study: Any, arrays: Any, prompt: str, ref: Any) -> dict[str, Any]:
    """The compared pairs: the two cells' teacher-forced logits against each other."""
    out: dict[str, Any] = {}
    for c in study.compare:
        if c.prompts and prompt not in c.prompts:
            continue
        sides = []
        for side in (c.a, c.b):
            label, _, draw = side.partition("~")
            sides.append(arrays.get((prompt, draw, label), {}).get("teacher_forcing.logits"))
        if sides[0] is None or sides[1] is None:
            continue
        a, b = sides
        d = np.abs(a - b).max(axis=-1)
        kl = kl_stats(b, a, np.asarray(ref.continuation))
        out[f"{c.a} vs {c.b}"] = {
            "step0_max_abs": float(d[0]),
            "median_max_abs": float(np.median(d)),
            "max_max_abs": float(d.max()),
            "argmax_agree": int((a.argmax(-1) == b.argmax(-1)).sum()),
            "steps": int(d.size),
            "mean_kld": kl.mean_kld,
        }
    return out


# --- markdown ----------------------------------------------------------------------------------


def _g(x: float | None) -> str:
    if x is None:
        return "never"
    return f"{x:.3g}" if abs(x) >= 1e-3 or x == 0 else f"{x:.2e}"


def _row(*cells: Any) -> str:
    """A markdown table row; a ``|`` inside a cell (``max|Δ|``) is escaped, once."""
    return "| " + " | ".join(re.sub(r"(?<!\\)\|", r"\\|", str(c)) for c in cells) + " |"


def _table(header: Sequence[str], rows: Sequence[Sequence[Any]]) -> list[str]:
    return [_row(*header), _row(*["---"] * len(header)), *(_row(*r) for r in rows), ""]


def _md(text: str) -> str:
    """Text safe inside a markdown table cell (whose ``|`` :func:`_row` escapes)."""
    return "`" + text.replace("\n", "⏎").replace("`", "'") + "`" if text else ""


def _never(x: int | None) -> str:
    return "never" if x is None else str(x)


Getter = Callable[[dict[str, Any]], Any]


class PromptView:
    """One prompt's cells, with their draws, for the tables."""

    def __init__(self, data: dict[str, Any], prompt: str) -> None:
        self.name = prompt
        self.p = data["prompts"][prompt]
        self.study = data["study"]

    @property
    def labels(self) -> list[str]:
        return list(self.p["cells"])

    def draws_of(self, label: str) -> dict[str, dict[str, Any]]:
        return {d: cells[label] for d, cells in self.p["draws"].items() if label in cells}

    def value(self, label: str, get: Getter, show: Callable[[Any], str] = _g) -> str:
        """The base draw's value, and its band over the draws where the cell has them."""
        base = get(self.p["cells"][label]["measures"])
        others = [get(c["measures"]) for c in self.draws_of(label).values()]
        text = show(base)
        nums = [
            x for x in [base, *others] if isinstance(x, int | float) and not isinstance(x, bool)
        ]
        if others and len(nums) == len(others) + 1 and show(min(nums)) != show(max(nums)):
            text += f" [{show(min(nums))}, {show(max(nums))}]"
        return text


def _has(pv: PromptView, measure: str) -> bool:
    return measure in pv.study["measures"]


def section_last_position(pv: PromptView) -> list[str]:
    variants = [v for v in pv.study["variants"] if any(k.startswith(v + "-") for k in pv.labels)]
    settings = [s for s in pv.study["settings"] if any(k.endswith("-" + s) for k in pv.labels)]
    rows = []
    for v in variants:
        rows.append(
            [
                v,
                *(
                    pv.value(f"{v}-{s}", lambda m: m["last_position"]["max_abs"])
                    if f"{v}-{s}" in pv.labels
                    else ""
                    for s in settings
                ),
            ]
        )
    return [
        "### Last position\n",
        "max |Δlogit| against the reference at the prompt's last position (the logits that pick "
        "the first new token); `[min, max]`: the band over the draws.\n",
        *_table(["file", *settings], rows),
    ]


def section_teacher_forcing(pv: PromptView) -> list[str]:
    rows = []
    for label in pv.labels:
        tf = pv.p["cells"][label]["measures"]["teacher_forcing"]
        flips = ", ".join(f"{f['step']} ({f['ref_margin']:.3f})" for f in tf["flips"]) or "none"
        rows.append(
            [
                label,
                pv.value(label, lambda m: m["teacher_forcing"]["step0_max_abs"]),
                pv.value(label, lambda m: m["teacher_forcing"]["median_max_abs"]),
                pv.value(label, lambda m: m["teacher_forcing"]["max_max_abs"]),
                f"{tf['argmax_agree']}/{tf['steps']}",
                _never(tf["first_flip"]),
                flips,
            ]
        )
    out = [
        "### Teacher forcing\n",
        "Prefill the prompt, then feed the reference tokens one at a time, so a flip never "
        "propagates. Step s predicts the reference's token s. Margin: the reference's top-1 "
        "minus top-2 logit at that step.\n",
        *_table(
            [
                "cell",
                "step 0 max|Δ|",
                "median",
                "max",
                "argmax agree",
                "first differing step",
                "differing steps (reference margin)",
            ],
            rows,
        ),
    ]
    rows = []
    for label in pv.labels:
        m = pv.p["cells"][label]["measures"]
        kl = m["teacher_forcing"]["kl"]
        row = [
            label,
            pv.value(label, lambda m: m["teacher_forcing"]["kl"]["mean_kld"], lambda x: f"{x:.2e}"),
            f"{kl['kld']['99%']:.2e}",
            f"{100 * kl['same_top']:.1f}%",
            pv.value(
                label, lambda m: 100 * m["teacher_forcing"]["kl"]["rms_dp"], lambda x: f"{x:.3f}%"
            ),
        ]
        if "teacher_forcing_batched" in m:
            b = m["teacher_forcing_batched"]
            row += [_g(b["median_max_abs"]), f"{b['argmax_agree']}/{b['steps']}"]
        rows.append(row)
    header = ["cell", "mean KLD", "99% KLD", "same top", "RMS Δp"]
    if _has(pv, "teacher_forcing_batched"):
        header += ["batched: median max|Δ|", "batched: argmax agree"]
    out += [
        "KL-divergence statistics over the teacher-forcing steps (llama-perplexity's "
        "definitions)"
        + (
            ", and the batched pass (every position in one forward pass)"
            if _has(pv, "teacher_forcing_batched")
            else ""
        )
        + ":\n",
        *_table(header, rows),
        f"![per-step max |Δlogit|](plots/{pv.name}-max_abs.png)\n",
        f"![reference margin and flipped steps](plots/{pv.name}-margins.png)\n",
    ]
    return out


def section_free_generation(pv: PromptView) -> list[str]:
    rows = []
    for label in pv.labels:
        fg = pv.p["cells"][label]["measures"]["free_generation"]
        ctx = fg["context"] or {}
        rows.append(
            [
                label,
                _never(fg["fork"]),
                fg["length"],
                "yes" if fg["eos"] else "no",
                _md(ctx.get("prefix", "")),
                _md(ctx.get("reference", "")),
                _md(ctx.get("own", "")),
            ]
        )
    return [
        "### Free generation\n",
        "Each setting decodes greedily on its own, capped at the reference length + the "
        "measure's `extra`. Fork: the first generated token that differs from the reference's.\n",
        *_table(
            [
                "cell",
                "fork",
                "length",
                "EOS",
                "common prefix …",
                "reference continues",
                "own continues",
            ],
            rows,
        ),
    ]


def _generic(name: str) -> Callable[[PromptView], list[str]]:
    """A table of a measure's scalar numbers, for a measure without a section of its own."""

    def section(pv: PromptView) -> list[str]:
        keys: list[str] = []
        for label in pv.labels:
            for k, v in pv.p["cells"][label]["measures"].get(name, {}).items():
                if isinstance(v, int | float | str | type(None)) and k not in keys:
                    keys.append(k)
        rows = [
            [label, *(pv.p["cells"][label]["measures"].get(name, {}).get(k, "") for k in keys)]
            for label in pv.labels
        ]
        return [f"### {name}\n", *_table(["cell", *keys], rows)]

    return section


def _options(study: Mapping[str, Any], measure: str) -> dict[str, Any] | None:
    """The options of the study's first ``measure`` (None: the study has none)."""
    spec = next((m for m in study.get("measure_specs", []) if m["name"] == measure), None)
    return None if spec is None else dict(spec["options"])


def _traces(study: Mapping[str, Any], entry: Mapping[str, Any]) -> dict[str, Any]:
    """The layer traces of one prompt's cells, each beside its F32 control."""
    options = _options(study, "layer_trace")
    if options is None:
        return {}
    ref = entry["reference"]
    return drift_report.traces(
        entry["cells"],
        list(study["variants"]),
        list(study["settings"]),
        options.get("f32") or next(iter(study["variants"])),
        ref["prompt_tokens"] + ref["length"],
    )


def section_layer_trace(pv: PromptView) -> list[str]:
    reference = (_options(pv.study, "layer_trace") or {}).get("reference", "transformers")
    return drift_report.section_layer_trace(_traces(pv.study, pv.p), pv.name, _table, reference)


SECTIONS: dict[str, Callable[[PromptView], list[str]]] = {
    "last_position": section_last_position,
    "teacher_forcing": section_teacher_forcing,
    "teacher_forcing_batched": lambda pv: [],  # a column of teacher forcing's KL table
    "free_generation": section_free_generation,
    "attribution": lambda pv: drift_report.section_attribution(pv.p["cells"], _table),
    "layer_trace": section_layer_trace,
    "corpus": lambda pv: [],  # its own section, before the prompts (corpus_report)
}


def section_cross(pv: PromptView, tok: Any) -> list[str]:
    if not pv.p["cross"]:
        return []
    settings = list(pv.study["settings"])

    def top3(top: list[Any]) -> str:
        return "<br>".join(f"{_md(tok.decode([t]))} {v:.2f}" for t, v in top)

    rows = []
    for name, e in pv.p["cross"].items():
        if e["fork"] is None:
            rows.append([name, "never", "", *("" for _ in settings)])
        else:
            tops = e.get("top3", {})
            rows.append(
                [
                    name,
                    e["fork"],
                    top3(e.get("reference_top3", [])),
                    *(top3(tops.get(s, [])) for s in settings),
                ]
            )
    return [
        "### Cross-setting\n",
        "First differing generated token between two settings (base draw), and at that step "
        "the reference's top-3 logits with each setting's top-3 (teacher forcing there sees "
        "the same prefix).\n",
        *_table(["file: pair", "fork", "reference top-3", *settings], rows),
    ]


def section_compare(pv: PromptView) -> list[str]:
    if not pv.p["compare"]:
        return []
    rows = [
        [
            name,
            _g(c["step0_max_abs"]),
            _g(c["median_max_abs"]),
            _g(c["max_max_abs"]),
            f"{c['argmax_agree']}/{c['steps']}",
            f"{c['mean_kld']:.2e}",
        ]
        for name, c in pv.p["compare"].items()
    ]
    return [
        "### Cells against each other\n",
        "Two cells' teacher-forced logits compared with each other instead of the reference "
        "(a against b; KLD with b as the base).\n",
        *_table(["pair", "step 0 max|Δ|", "median", "max", "argmax agree", "mean KLD"], rows),
    ]


def section_draws(pv: PromptView) -> list[str]:
    """Every draw of every cell that has draws: statistics against single draws."""
    drawn = [label for label in pv.labels if pv.draws_of(label)]
    if not drawn or "teacher_forcing" not in pv.study["measures"]:
        return []
    rows = []
    for label in drawn:
        for draw, c in [("base", pv.p["cells"][label]), *pv.draws_of(label).items()]:
            m = c["measures"]
            tf = m["teacher_forcing"]
            rows.append(
                [
                    label,
                    draw,
                    _g(m["last_position"]["max_abs"]) if "last_position" in m else "",
                    _g(tf["median_max_abs"]),
                    f"{tf['kl']['mean_kld']:.2e}",
                    f"{tf['argmax_agree']}/{tf['steps']}",
                    _never(tf["first_flip"]),
                    ", ".join(str(f["step"]) for f in tf["flips"]) or "none",
                    _never(m["free_generation"]["fork"]) if "free_generation" in m else "",
                ]
            )
    return [
        "### Draws\n",
        "Each cell the draws rerun, in every draw: the median per-step max|Δ| and the mean "
        "KLD are statistics over all steps and stay within a narrow band; the last position, "
        "the flipped steps and the fork are single draws of the activation roundings and move "
        "from draw to draw.\n",
        *_table(
            [
                "cell",
                "draw",
                "last position",
                "median max|Δ|",
                "mean KLD",
                "argmax agree",
                "first flip",
                "flipped steps",
                "fork",
            ],
            rows,
        ),
    ]


def section_findings(pv: PromptView, outcomes: Sequence[Any]) -> list[str]:
    rows = []
    for o in outcomes:
        for c in o.checks.get(pv.name, []):
            mark = {True: "✔", False: "✘", None: "–"}[c.ok]
            where = f" (fails in {', '.join(c.failing)})" if c.failing else ""
            rows.append(
                [
                    mark,
                    o.name + ("" if o.asserted else " (not asserted)"),
                    c.cell,
                    c.metric,
                    c.text() + where,
                    c.bound,
                ]
            )
    if not rows:
        return []
    return [
        "### Findings on this prompt\n",
        "`[min, max]`: the value's band over the draws; a check holds when it holds in every "
        "draw. –: nothing to test here.\n",
        *_table(["", "finding", "cell", "metric", "value", "bound"], rows),
    ]


def summary(data: dict[str, Any], outcomes: Sequence[Any]) -> list[str]:
    prompts = list(data["prompts"])
    out = ["## Summary across prompts\n"]
    rows = []
    for p in prompts:
        r = data["prompts"][p]["reference"]
        rows.append([p, r["prompt_tokens"], r["length"], "yes" if r["eos"] else "no (capped)"])
    out += _table(["prompt", "prompt tokens", "reference tokens", "ended by end of turn"], rows)
    if outcomes:
        mark = {"holds": "✔", "fails": "✘", "n/a": "–"}
        rows = [
            [
                o.name + ("" if o.asserted else " (not asserted)"),
                *(mark[o.status(p)] for p in prompts),
            ]
            for o in outcomes
        ]
        out += [
            "Findings on each prompt (✔ holds in every draw, ✘ fails, – nothing to test):\n",
            *_table(["finding", *prompts], rows),
        ]
    if "teacher_forcing" in data["study"]["measures"]:
        labels = list(dict.fromkeys(k for p in prompts for k in data["prompts"][p]["cells"]))
        rows = []
        for label in labels:
            row: list[Any] = [label]
            for p in prompts:
                pv = PromptView(data, p)
                row.append(
                    pv.value(label, lambda m: m["teacher_forcing"]["median_max_abs"])
                    if label in pv.labels
                    else ""
                )
            rows.append(row)
        out += [
            "Median per-step max |Δlogit| of teacher forcing, each prompt (`[min, max]`: "
            "the band over the draws):\n",
            *_table(["cell", *prompts], rows),
            "![median per-step max |Δlogit| by prompt](plots/summary.png)\n",
        ]
    out += drift_report.summary_attribution(data["prompts"], _table)
    corpus = _options(data["study"], "corpus") or {}
    out += corpus_report.section(data["prompts"], corpus, _table)
    return out


def tables(data: dict[str, Any], outcomes: Sequence[Any]) -> str:
    study, gen = data["study"], data["generated"]
    first = next(iter(data["prompts"].values()))["reference"]["meta"]
    v = first.get("versions", {})
    out = [
        "# Results\n",
        f"Study **{study['name']}**" + (f": {study['title']}" if study["title"] else "") + ". "
        f"Generated by `qllama study run` on {gen['date']} ({gen['machine']}, Python "
        f"{gen['python']}); every number is in [results.json](results.json).\n",
        f"**Reference**: {first.get('settings', '')}"
        + (
            f" (transformers {v.get('transformers')}, torch {v.get('torch')})"
            if first.get("kind") == "transformers"
            else ""
        )
        + f", reading {first.get('file', '')} (sha256 `{first.get('file_sha256', '')[:16]}…`).\n",
        "**Files**: "
        + "; ".join(f"{n} (sha256 `{x['sha256'][:16]}…`)" for n, x in study["variants"].items())
        + ".\n",
        "**Settings**: "
        + "; ".join(
            f"**{n}** = `{x['backend'] if x['engine'] == 'qllama' else x['engine']}`"
            f"{': ' + x['about'] if x['about'] else ''}"
            for n, x in study["settings"].items()
        )
        + ".\n",
    ]
    if study["draws"]:
        out.append(
            "**Draws** (deliberate perturbations of float order; every cell they rerun is "
            "reported with its band): "
            + "; ".join(
                f"**{n}**: {d['about'] or d['env'] or d['reference_env']}"
                for n, d in study["draws"].items()
            )
            + ".\n"
        )
    skipped = study["skipped_prompts"]
    if skipped:
        out.append(
            "**Not run here** (`qllama study run --prompt`): the prompts "
            + ", ".join(f"`{n}`" for n in skipped)
            + "; this report and its findings cover the prompts below only.\n"
        )
    out += summary(data, outcomes)
    for p in data["prompts"]:
        pv = PromptView(data, p)
        text = pv.p["prompt"]["text"] or json.dumps(pv.p["prompt"]["messages"], ensure_ascii=False)
        r = pv.p["reference"]
        out += [
            f"## Prompt `{p}`\n",
            f"{'Chat' if pv.p['prompt']['chat'] else 'Raw'} prompt {text!r}: "
            f"{r['prompt_tokens']} tokens; the reference gave {r['length']} new tokens "
            f"({'ended by end of turn' if r['eos'] else 'capped'}).\n",
        ]
        for m in study["measures"]:
            out += SECTIONS.get(m, _generic(m))(pv)
        out += section_cross(pv, data["_tokenizer"])
        out += section_compare(pv)
        out += section_draws(pv)
        out += section_findings(pv, outcomes)
        out += ["#### The reference's answer\n", "```\n" + r["text"] + "\n```\n"]
    return "\n".join(out)


# --- plots and files -----------------------------------------------------------------------------


def plots(data: dict[str, Any], folder: Path) -> None:
    for p, entry in data["prompts"].items():
        reports = _traces(data["study"], entry)
        if reports:
            folder.mkdir(parents=True, exist_ok=True)
            drift_report.plot_traces(reports, p, folder)
    if "teacher_forcing" not in data["study"]["measures"]:
        return
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    folder.mkdir(parents=True, exist_ok=True)
    arrays, variants = data["_arrays"], list(data["study"]["variants"])
    settings = list(data["study"]["settings"])
    for p, entry in data["prompts"].items():
        fig, axes = plt.subplots(
            len(variants), 1, figsize=(9, 2.4 * len(variants)), sharex=True, squeeze=False
        )
        for ax, v in zip(axes[:, 0], variants, strict=True):
            for s in settings:
                arr = arrays.get((p, "", f"{v}-{s}"), {})
                if "teacher_forcing.max_abs" in arr:
                    ax.plot(arr["teacher_forcing.max_abs"], label=s, lw=0.8)
            ax.set_yscale("log")
            ax.set_ylabel("max |Δlogit|")
            ax.set_title(f"{p}, {v}: teacher forcing, per step", fontsize=9)
            ax.legend(fontsize=7)
        axes[-1, 0].set_xlabel("step")
        _save(fig, folder / f"{p}-max_abs.png")

        margin = np.asarray(entry["reference"]["margin"])
        fig, ax = plt.subplots(figsize=(9, 3.2))
        ax.plot(margin, color="0.6", lw=0.8, label="reference margin (top-1 − top-2)")
        markers = "osx+^v<>"
        for i, v in enumerate(variants):
            for j, s in enumerate(settings):
                c = entry["cells"].get(f"{v}-{s}")
                flips = [f["step"] for f in c["measures"]["teacher_forcing"]["flips"]] if c else []
                if flips:
                    ax.scatter(
                        flips,
                        margin[flips],
                        marker=markers[j % len(markers)],
                        color=f"C{i}",
                        label=f"{v} {s} flips",
                        s=24,
                        facecolors="none" if markers[j % len(markers)] in "os" else None,
                    )
        ax.set_yscale("symlog", linthresh=0.1)
        ax.set_xlabel("step")
        ax.set_ylabel("logit")
        ax.set_title(f"{p}: reference margin per step; flipped steps marked", fontsize=9)
        ax.legend(fontsize=6, ncol=3)
        _save(fig, folder / f"{p}-margins.png")
    _summary_plot(data, folder, plt)


def _summary_plot(data: dict[str, Any], folder: Path, plt: Any) -> None:
    prompts = list(data["prompts"])
    labels = list(dict.fromkeys(k for p in prompts for k in data["prompts"][p]["cells"]))
    fig, ax = plt.subplots(figsize=(9, 3.6))
    for i, label in enumerate(labels):
        xs, ys, lo, hi = [], [], [], []
        for j, p in enumerate(prompts):
            entry = data["prompts"][p]
            if label not in entry["cells"]:
                continue
            get = lambda c: c["measures"]["teacher_forcing"]["median_max_abs"]  # noqa: E731
            vals = [get(entry["cells"][label])] + [
                get(d[label]) for d in entry["draws"].values() if label in d
            ]
            xs.append(j + (i - len(labels) / 2) * 0.03)
            ys.append(vals[0])
            lo.append(vals[0] - min(vals))
            hi.append(max(vals) - vals[0])
        ax.errorbar(xs, ys, yerr=[lo, hi], fmt="o", ms=3, lw=0.8, label=label, capsize=2)
    ax.set_xticks(range(len(prompts)), prompts, fontsize=7)
    ax.set_yscale("log")
    ax.set_ylabel("median per-step max |Δlogit|")
    ax.set_title("Teacher forcing by prompt (bars: the band over the draws)", fontsize=9)
    ax.legend(fontsize=6, ncol=4)
    _save(fig, folder / "summary.png")


def _save(fig: Any, path: Path) -> None:
    import matplotlib.pyplot as plt

    with atomic_write(path) as f:
        fig.savefig(f, format="png", dpi=80, bbox_inches="tight")
    plt.close(fig)


def to_json(data: dict[str, Any], outcomes: Sequence[Any]) -> dict[str, Any]:
    doc = {k: v for k, v in data.items() if not k.startswith("_")}
    doc["findings"] = [o.to_dict() for o in outcomes]
    return doc


def write(data: dict[str, Any], outcomes: Sequence[Any], docs: Path) -> None:
    """``docs/results.md``, ``docs/results.json`` and ``docs/plots/``."""
    plots(data, docs / "plots")
    with atomic_write(docs / "results.md", "w") as f:
        f.write(tables(data, outcomes))
    with atomic_write(docs / "results.json", "w") as f:
        json.dump(to_json(data, outcomes), f, indent=1, default=float)
