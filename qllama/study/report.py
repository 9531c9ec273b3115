"""The report: ``results.md`` (a section per prompt, a summary across prompts), and writing it
with ``results.json`` (every number: :func:`qllama.study.collect.to_json` and the findings) and
``plots/`` (:mod:`qllama.study.plots`), from the collected cells alone (``--report-only``).

Sections follow the study's measures: each measure the report knows has a table (``SECTIONS``);
one it does not know (a measure added later) gets a generic table of its scalar numbers. Cells
that the study's draws rerun are shown with their band, ``value [min, max]`` over the draws,
and each prompt lists every draw of them, so a reader sees which numbers are statistics that
reproduce within their band and which are single draws.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from qllama.atomic import atomic_write
from qllama.study import corpus_report, drift_report
from qllama.study.collect import Collected, measure_options, to_json
from qllama.study.declaration import toml_inline
from qllama.study.plots import plots
from qllama.study.results import Measures, encode


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


Getter = Callable[[Measures], Any]


class PromptView:
    """One prompt's cells, with their draws, for the tables."""

    def __init__(self, data: Collected, prompt: str) -> None:
        self.name = prompt
        self.p = data.prompts[prompt]
        self.study = data.study

    @property
    def labels(self) -> list[str]:
        return list(self.p.cells)

    def measures(self, label: str) -> Measures:
        """The base draw's measures of cell ``label``."""
        return self.p.cells[label].measures

    def draws_of(self, label: str) -> dict[str, Measures]:
        """Cell ``label``'s measures in each draw that reruns it."""
        return {d: cells[label].measures for d, cells in self.p.draws.items() if label in cells}

    def value(self, label: str, get: Getter, show: Callable[[Any], str] = _g) -> str:
        """The base draw's value, and its band over the draws where the cell has them."""
        base = get(self.measures(label))
        others = [get(m) for m in self.draws_of(label).values()]
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
                    pv.value(f"{v}-{s}", lambda m: m.last_position.max_abs)
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
        tf = pv.measures(label).teacher_forcing
        flips = ", ".join(f"{f.step} ({f.ref_margin:.3f})" for f in tf.flips) or "none"
        rows.append(
            [
                label,
                pv.value(label, lambda m: m.teacher_forcing.step0_max_abs),
                pv.value(label, lambda m: m.teacher_forcing.median_max_abs),
                pv.value(label, lambda m: m.teacher_forcing.max_max_abs),
                f"{tf.argmax_agree}/{tf.steps}",
                _never(tf.first_flip),
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
        m = pv.measures(label)
        kl = m.teacher_forcing.kl
        row = [
            label,
            pv.value(label, lambda m: m.teacher_forcing.kl.mean_kld, lambda x: f"{x:.2e}"),
            f"{kl.kld['99%']:.2e}",
            f"{100 * kl.same_top:.1f}%",
            pv.value(label, lambda m: 100 * m.teacher_forcing.kl.rms_dp, lambda x: f"{x:.3f}%"),
        ]
        if "teacher_forcing_batched" in m:
            b = m.teacher_forcing_batched
            row += [_g(b.median_max_abs), f"{b.argmax_agree}/{b.steps}"]
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
        fg = pv.measures(label).free_generation
        ctx = fg.context
        rows.append(
            [
                label,
                _never(fg.fork),
                fg.length,
                "yes" if fg.eos else "no",
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
        def numbers(label: str) -> dict[str, Any]:
            m = pv.measures(label)
            return encode(m[name], name)[0] if name in m else {}

        keys: list[str] = []
        for label in pv.labels:
            for k, v in numbers(label).items():
                if isinstance(v, int | float | str | type(None)) and k not in keys:
                    keys.append(k)
        rows = [[label, *(numbers(label).get(k, "") for k in keys)] for label in pv.labels]
        return [f"### {name}\n", *_table(["cell", *keys], rows)]

    return section


def section_layer_trace(pv: PromptView) -> list[str]:
    reference = (measure_options(pv.study, "layer_trace") or {}).get("reference", "transformers")
    traces = drift_report.prompt_traces(pv.study, pv.p)
    return drift_report.section_layer_trace(traces, pv.name, _table, reference)


def section_routing(pv: PromptView) -> list[str]:
    """A mixture's experts against the F32 variant's, and the error with them forced
    (:mod:`qllama.measure.routing`), a row per cell."""
    cells = [(label, pv.measures(label)) for label in pv.labels]
    reports = [(label, m.routing) for label, m in cells if "routing" in m]
    if not reports:
        return []

    def percent(x: float | None) -> str:
        return "–" if x is None else f"{100 * x:.2f}%"

    rows = [
        [
            label,
            percent(r.routing.changed),
            percent(r.routing.top1_changed),
            percent(r.routing.positions_changed),
            f"{r.routing.set_agreement:.4f}",
            _g(r.routing.mean_weight_error),
            "–" if r.routing.median_margin_changed is None else _g(r.routing.median_margin_changed),
            _g(r.free.mean_kld),
            _g(r.forced.mean_kld),
            percent(r.explained),
        ]
        for label, r in reports
    ]
    r = reports[0][1]
    header = ["cell", "pairs rerouted", "top-1 changed", "positions with a change"]
    header += ["set agreement", "router-weight error", "reference margin at changes"]
    header += ["mean KLD", "experts forced", "explained"]
    return [
        "### Routing\n",
        f"Each cell's experts at every (layer, token) pair against the F32 variant's run by qllama "
        f"({r.tokens} tokens x {r.layers} layers, top {r.k} of {r.n_expert}); the mean KL "
        "divergence over every position as the cell routes and with the F32 variant's experts "
        "forced, and the share of it that follows the routing changes (qllama.measure.routing).\n",
        *_table(header, rows),
        f"![routing per layer](plots/{pv.name}-routing.png)\n",
    ]


SECTIONS: dict[str, Callable[[PromptView], list[str]]] = {
    "last_position": section_last_position,
    "teacher_forcing": section_teacher_forcing,
    "teacher_forcing_batched": lambda pv: [],  # a column of teacher forcing's KL table
    "free_generation": section_free_generation,
    "attribution": lambda pv: drift_report.section_attribution(pv.p.cells, _table),
    "layer_trace": section_layer_trace,
    "corpus": lambda pv: [],  # its own section, before the prompts (corpus_report)
    "routing": section_routing,
}


def section_cross(pv: PromptView, tok: Any) -> list[str]:
    if not pv.p.cross:
        return []
    settings = list(pv.study["settings"])

    def top3(top: list[Any]) -> str:
        return "<br>".join(f"{_md(tok.decode([t]))} {v:.2f}" for t, v in top)

    rows = []
    for name, e in pv.p.cross.items():
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
    if not pv.p.compare:
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
        for name, c in pv.p.compare.items()
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
        for draw, m in [("base", pv.measures(label)), *pv.draws_of(label).items()]:
            tf = m.teacher_forcing
            rows.append(
                [
                    label,
                    draw,
                    _g(m.last_position.max_abs) if "last_position" in m else "",
                    _g(tf.median_max_abs),
                    f"{tf.kl.mean_kld:.2e}",
                    f"{tf.argmax_agree}/{tf.steps}",
                    _never(tf.first_flip),
                    ", ".join(str(f.step) for f in tf.flips) or "none",
                    _never(m.free_generation.fork) if "free_generation" in m else "",
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


def summary(data: Collected, outcomes: Sequence[Any]) -> list[str]:
    prompts = list(data.prompts)
    out = ["## Summary across prompts\n"]
    rows = []
    for p in prompts:
        r = data.prompts[p].reference
        rows.append([p, r.prompt_tokens, r.length, "yes" if r.eos else "no (capped)"])
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
    if "teacher_forcing" in data.study["measures"]:
        labels = list(dict.fromkeys(k for p in prompts for k in data.prompts[p].cells))
        rows = []
        for label in labels:
            row: list[Any] = [label]
            for p in prompts:
                pv = PromptView(data, p)
                row.append(
                    pv.value(label, lambda m: m.teacher_forcing.median_max_abs)
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
    out += drift_report.summary_attribution(data.prompts, _table)
    corpus = measure_options(data.study, "corpus") or {}
    out += corpus_report.section(data.prompts, corpus, _table)
    return out


def tables(data: Collected, outcomes: Sequence[Any]) -> str:
    """``results.md``."""
    study, gen = data.study, data.generated
    first = next(iter(data.prompts.values())).reference.meta
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
            + (f" with `{toml_inline(x['options'])}`" if x["options"] else "")
            + (f": {x['about']}" if x["about"] else "")
            for n, x in study["settings"].items()
        )
        + ".\n",
    ]
    if study["draws"]:
        out.append(
            "**Draws** (deliberate perturbations of float order; every cell they rerun is "
            "reported with its band): "
            + "; ".join(
                f"**{n}**: "
                + (d["about"] or toml_inline({**d["env"], **d["reference_env"], **d["options"]}))
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
    for p in data.prompts:
        pv = PromptView(data, p)
        text = pv.p.prompt["text"] or json.dumps(pv.p.prompt["messages"], ensure_ascii=False)
        r = pv.p.reference
        out += [
            f"## Prompt `{p}`\n",
            f"{'Chat' if pv.p.prompt['chat'] else 'Raw'} prompt {text!r}: "
            f"{r.prompt_tokens} tokens; the reference gave {r.length} new tokens "
            f"({'ended by end of turn' if r.eos else 'capped'}).\n",
        ]
        for m in study["measures"]:
            out += SECTIONS.get(m, _generic(m))(pv)
        out += section_cross(pv, data.tokenizer)
        out += section_compare(pv)
        out += section_draws(pv)
        out += section_findings(pv, outcomes)
        out += ["#### The reference's answer\n", "```\n" + r.text + "\n```\n"]
    return "\n".join(out)


def document(data: Collected, outcomes: Sequence[Any]) -> dict[str, Any]:
    """``results.json``: every number of ``data`` and the findings' checks."""
    doc = to_json(data)
    doc["findings"] = [o.to_dict() for o in outcomes]
    return doc


def write(data: Collected, outcomes: Sequence[Any], docs: Path) -> None:
    """``docs/results.md``, ``docs/results.json`` and ``docs/plots/``."""
    plots(data, docs / "plots")
    with atomic_write(docs / "results.md", "w") as f:
        f.write(tables(data, outcomes))
    with atomic_write(docs / "results.json", "w") as f:
        json.dump(document(data, outcomes), f, indent=1, default=float)
