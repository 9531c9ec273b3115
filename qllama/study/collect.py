"""Collecting a study's results: every cell's measures read back from the cache into their
dataclasses, by prompt and draw, with each prompt's reference, the forks across settings and
the compared pairs (:class:`Collected`), what the findings check and the report shows.

:func:`to_json` is ``results.json`` without its findings; :func:`from_json` reads one back
(the findings can be checked again on a committed run, whose arrays it does not hold).
"""

from __future__ import annotations

import datetime
import platform
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from qllama.measure.compare import fork
from qllama.measure.metrics import kl_stats, top_k
from qllama.study import measures
from qllama.study.cache import CellResult
from qllama.study.results import Measures, encode

CONTEXT = 12  # tokens of text shown around a fork


@dataclass(frozen=True)
class CellRecord:
    """One cell: where and how it ran, as stored (``info``: its id, key, engine, backend,
    environment, seconds...), and its measures' results."""

    info: dict[str, Any]
    measures: Measures


@dataclass(frozen=True)
class ReferenceInfo:
    """One prompt's reference, as the report and the findings read it."""

    meta: dict[str, Any]  # how it was computed (engine, file, versions, key)
    text: str  # its new tokens' text
    eos: bool  # whether it ended by end of turn, not by the prompt's max_new_tokens
    length: int  # its new tokens
    prompt_tokens: int
    margin: tuple[float, ...]  # each step's top-1 minus top-2 logit


@dataclass(frozen=True)
class PromptResults:
    """One prompt's cells (base draw), its draws' cells, and what is read across them."""

    cells: dict[str, CellRecord]  # by label, "variant-setting"
    draws: dict[str, dict[str, CellRecord]]  # draw -> the cells it reruns, by label
    prompt: dict[str, Any]  # text, messages, chat, max_new_tokens
    reference: ReferenceInfo
    # "file: a vs b" -> fork, and where it forks the reference's and each setting's top-3
    # and the text around it
    cross: dict[str, Any]
    # "a vs b" -> two cells' teacher-forced logits against each other
    compare: dict[str, Any]


@dataclass(frozen=True)
class Collected:
    """A study's results: what the report shows and the findings check."""

    study: dict[str, Any]  # the declaration, as results.json describes it
    generated: dict[str, Any]  # date, machine, Python
    prompts: dict[str, PromptResults]
    tokenizer: Any = None  # the model's, for the report's tokens (None: read from JSON)


def measure_options(study: Mapping[str, Any], measure: str) -> dict[str, Any] | None:
    """The options of the study's first ``measure`` (None: the study has none)."""
    spec = next((m for m in study.get("measure_specs", []) if m["name"] == measure), None)
    return None if spec is None else dict(spec["options"])


# --- from the cache -------------------------------------------------------------------------------


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


def _margin(step_logits: np.ndarray) -> tuple[float, ...]:
    top2 = np.sort(step_logits, axis=-1)[:, -2:]
    return tuple((top2[:, 1] - top2[:, 0]).astype(float).tolist())


def read_cell(result: CellResult) -> CellRecord:
    """A cached cell with each measure read back into its result."""
    info = {k: v for k, v in result.numbers.items() if k != "measures"}
    read = {}
    for name, numbers in result.numbers["measures"].items():
        prefix = name + "."
        arrays = {k[len(prefix) :]: v for k, v in result.arrays.items() if k.startswith(prefix)}
        read[name] = measures.read(name, numbers, arrays)
    return CellRecord(info, Measures(read))


def collect(plan: Any, results: Mapping[str, CellResult]) -> Collected:
    """Every cell of ``plan`` (a :class:`qllama.study.runner.Plan`) from ``results`` (cell id
    -> its cached result), by prompt and draw, with the cross-setting forks and the compared
    pairs."""
    from qllama.runtime.tokenizer import Tokenizer

    study = plan.study
    tok = Tokenizer.from_gguf(next(iter(plan.variants.values())).path)
    cells: dict[str, dict[str, CellRecord]] = {}
    draws: dict[str, dict[str, dict[str, CellRecord]]] = {}
    for task in plan.tasks.values():
        c = task.cell
        record = read_cell(results[c.id])
        base, drawn = cells.setdefault(c.prompt, {}), draws.setdefault(c.prompt, {})
        where = base if not c.draw else drawn.setdefault(c.draw, {})
        where[c.label] = record
    prompts = {}
    for p in study.prompts:
        ref = plan.reference(p.name)
        cont = ref.continuation
        ours, drawn = cells[p.name], draws[p.name]
        prompts[p.name] = PromptResults(
            cells=ours,
            draws=drawn,
            prompt={
                "text": p.text,
                "messages": [dict(m) for m in p.messages],
                "chat": p.chat,
                "max_new_tokens": p.max_new_tokens,
            },
            reference=ReferenceInfo(
                meta=ref.meta,
                text=tok.decode(cont),
                eos=bool(cont and cont[-1] in tok.stop_ids),
                length=len(cont),
                prompt_tokens=ref.n_prompt,
                margin=_margin(ref.step_logits),
            ),
            cross=_cross(study, ours, ref, tok),
            compare=_compare(study, ours, drawn, p.name, ref),
        )
    return Collected(
        study=_study_info(plan),
        generated={
            "date": datetime.date.today().isoformat(),
            "machine": platform.machine(),
            "python": platform.python_version(),
        },
        prompts=prompts,
        tokenizer=tok,
    )


def _top3(cell: CellRecord | None, at: int) -> list[tuple[int, float]] | None:
    """The cell's top-3 tokens and logits at teacher-forcing step ``at`` (None: not kept)."""
    if cell is None or "teacher_forcing" not in cell.measures:
        return None
    tf = cell.measures.teacher_forcing
    if tf.top_ids is None or tf.top_logits is None:
        return None
    ids, logits = tf.top_ids[at, :3].tolist(), tf.top_logits[at, :3].tolist()
    return list(zip(ids, logits, strict=True))


def _cross(study: Any, cells: Mapping[str, CellRecord], ref: Any, tok: Any) -> dict[str, Any]:
    """First differing generated token between two settings (base draw), with the top-3 of
    the reference and of each setting at that step."""
    out: dict[str, Any] = {}
    for v in study.variants:
        for a, b in study.cross:
            ca, cb = cells.get(f"{v.name}-{a}"), cells.get(f"{v.name}-{b}")
            if ca is None or "free_generation" not in ca.measures:
                continue
            ta = ca.measures.free_generation.tokens
            if b == "reference":
                tb = ref.continuation
            elif cb is not None:
                tb = cb.measures.free_generation.tokens
            else:
                continue
            at = fork(ta, tb)
            e: dict[str, Any] = {"fork": at}
            if at is not None and at < len(ref.step_logits):
                e["reference_top3"] = top_k(ref.step_logits[at], 3)
                e["top3"] = {}
                for s in study.settings:
                    top = _top3(cells.get(f"{v.name}-{s.name}"), at)
                    if top is not None:
                        e["top3"][s.name] = top
                e["context"] = {
                    "prefix": tok.decode(ta[max(0, at - CONTEXT) : at]),
                    a: tok.decode(ta[at : at + CONTEXT]),
                    b: tok.decode(tb[at : at + CONTEXT]),
                }
            out[f"{v.name}: {a} vs {b}"] = e
    return out


def _logits(cell: CellRecord | None) -> np.ndarray | None:
    if cell is None or "teacher_forcing" not in cell.measures:
        return None
    return cell.measures.teacher_forcing.logits


def _compare(
    study: Any,
    cells: Mapping[str, CellRecord],
    draws: Mapping[str, Mapping[str, CellRecord]],
    prompt: str,
    ref: Any,
) -> dict[str, Any]:
    """The compared pairs: the two cells' teacher-forced logits against each other."""
    out: dict[str, Any] = {}
    for c in study.compare:
        if c.prompts and prompt not in c.prompts:
            continue
        sides = []
        for side in (c.a, c.b):
            label, _, draw = side.partition("~")
            sides.append(_logits((draws.get(draw, {}) if draw else cells).get(label)))
        a, b = sides
        if a is None or b is None:
            continue
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


# --- results.json ---------------------------------------------------------------------------------


def _cell_json(cell: CellRecord) -> dict[str, Any]:
    measured = {name: encode(r, name)[0] for name, r in cell.measures.items()}
    return {**cell.info, "measures": measured}


def to_json(data: Collected) -> dict[str, Any]:
    """Every number of ``data`` as JSON (no arrays): ``results.json`` but its findings."""
    prompts = {}
    for name, p in data.prompts.items():
        r = p.reference
        prompts[name] = {
            "cells": {k: _cell_json(c) for k, c in p.cells.items()},
            "draws": {d: {k: _cell_json(c) for k, c in cs.items()} for d, cs in p.draws.items()},
            "prompt": p.prompt,
            "reference": {
                "meta": r.meta,
                "text": r.text,
                "eos": r.eos,
                "length": r.length,
                "prompt_tokens": r.prompt_tokens,
                "margin": list(r.margin),
            },
            "cross": p.cross,
            "compare": p.compare,
        }
    return {"study": data.study, "generated": data.generated, "prompts": prompts}


def _cell_from_json(doc: Mapping[str, Any]) -> CellRecord:
    info = {k: v for k, v in doc.items() if k != "measures"}
    read = {name: measures.read(name, n, {}) for name, n in doc["measures"].items()}
    return CellRecord(info, Measures(read))


def from_json(doc: Mapping[str, Any]) -> Collected:
    """A ``results.json`` document read back (its findings left out; no arrays, no
    tokenizer). Each measure is read by its registered name, so a measure of a study's own
    must be importable here."""
    prompts = {}
    for name, p in doc["prompts"].items():
        r = p["reference"]
        prompts[name] = PromptResults(
            cells={k: _cell_from_json(c) for k, c in p["cells"].items()},
            draws={
                d: {k: _cell_from_json(c) for k, c in cs.items()} for d, cs in p["draws"].items()
            },
            prompt=dict(p["prompt"]),
            reference=ReferenceInfo(
                meta=dict(r["meta"]),
                text=r["text"],
                eos=r["eos"],
                length=r["length"],
                prompt_tokens=r["prompt_tokens"],
                margin=tuple(r["margin"]),
            ),
            cross=dict(p["cross"]),
            compare=dict(p["compare"]),
        )
    return Collected(dict(doc["study"]), dict(doc["generated"]), prompts)
