"""Running a study: plan the cells, compute what is not cached, report, check the findings.

    plan = Plan.make(study, results)        # variants built, references found or computed
    run(study, results=..., executor=...)   # the whole thing; the exit status of the CLI

Every result is written by the driver as it arrives (atomically, named by its content key),
so an interrupted sweep resumes where it stopped and a changed setting reruns only its cells.
"""

from __future__ import annotations

import importlib.util
import io
import json
import os
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from qllama.measure.compare import Reference
from qllama.study import collect
from qllama.study.cache import CellCache, CellResult
from qllama.study.cells import Cell, arithmetic, content_key, measure_specs, product, select
from qllama.study.declaration import Draw, Study, StudyError
from qllama.study.executors import Job, Local
from qllama.study.executors import executor as make_executor
from qllama.study.measures import variants_named
from qllama.study.references import (
    ReferenceStore,
    ReferenceTask,
    prompt_ids,
    request_key,
    stale,
    task_fields,
)
from qllama.study.variants import VariantFile, build
from qllama.study.worker import CellTask, run_cell, run_reference

BASE = ""  # the base draw's name


def _say(text: str) -> None:
    print(text, file=sys.stderr, flush=True)


class _Lines:
    """Progress as lines, where tqdm is not installed."""

    def __init__(self, total: int, initial: int, desc: str) -> None:
        self.n, self.total, self.desc, self.t0, self.postfix = initial, total, desc, time.time(), ""

    def set_postfix_str(self, text: str, refresh: bool = True) -> None:
        self.postfix = text

    def update(self, n: int) -> None:
        self.n += n
        _say(f"{self.desc}: {self.n}/{self.total} ({self.postfix}), {time.time() - self.t0:.0f} s")

    def write(self, text: str) -> None:
        _say(text)

    def close(self) -> None:
        pass


def _progress(total: int, initial: int, desc: str) -> Any:
    """A bar of ``desc`` done out of ``total``, with elapsed and remaining time."""
    try:
        from tqdm import tqdm
    except ImportError:
        return _Lines(total, initial, desc)
    return tqdm(total=total, initial=initial, desc=desc, unit="", file=sys.stderr, smoothing=0)


@dataclass
class Plan:
    """A study made concrete: its files, references and cells, each with its key."""

    study: Study
    results: Path
    variants: dict[str, VariantFile]
    references: dict[tuple[str, str], Reference] = field(default_factory=dict)
    reference_paths: dict[tuple[str, str], Path] = field(default_factory=dict)
    tasks: dict[str, CellTask] = field(default_factory=dict)

    def reference(self, prompt: str, draw: str = BASE) -> Reference:
        """The reference a cell of ``prompt`` in ``draw`` is compared with."""
        return self.references.get((prompt, draw), self.references[(prompt, BASE)])

    @property
    def source(self) -> str:
        return str(self.study.model_source())


def _reference_draws(study: Study) -> list[Draw]:
    return [d for d in study.draws if d.reference_env and not d.optional]


def build_variants(
    study: Study, *, cache: str | os.PathLike[str] | None = None
) -> dict[str, VariantFile]:
    """Every variant's file (built once, then cached in qllama's cache folder ``cache``,
    default the user cache) and its sha256."""
    out = {}
    for v in study.variants:
        _say(f"variant {v.name}: building or finding it in the cache ...")
        out[v.name] = build(study.model_source(), v, cache=cache)
    return out


def _reference_variant(study: Study, variants: dict[str, VariantFile]) -> VariantFile:
    ref = study.reference
    return variants[ref.variant] if ref.kind != "saved" else next(iter(variants.values()))


def plan_references(
    plan: Plan, execute: Callable[[list[Job]], Any], *, compute: bool = True
) -> None:
    """Find every reference in the cache, computing (``compute``) those that are missing:
    first each prompt's own, then the draws' recomputations of the same tokens."""
    study, store = plan.study, ReferenceStore(plan.results)
    variant = _reference_variant(study, plan.variants)
    ids = {p.name: prompt_ids(p, variant.path) for p in study.prompts}
    rounds: list[list[tuple[str, Draw | None]]] = [
        [(p.name, None) for p in study.prompts],
        [(p.name, d) for d in _reference_draws(study) for p in study.prompts],
    ]
    for round_ in rounds:
        jobs, slots = [], {}
        for prompt_name, draw in round_:
            prompt = study.prompt(prompt_name)
            base = plan.references.get((prompt_name, BASE)) if draw else None
            env = dict(draw.reference_env) if draw else {}
            fields_ = task_fields(
                study.reference,
                prompt,
                variant,
                *ids[prompt_name],
                env,
                base.meta["key"] if base else None,
            )
            request = request_key(fields_)
            slot = (prompt_name, draw.name if draw else BASE)
            cached = store.load(request)
            if cached is not None and not stale(cached):
                plan.references[slot] = cached
                plan.reference_paths[slot] = store.path(request)
                continue
            if not compute:
                raise StudyError(f"the reference of prompt {prompt_name!r} is not cached")
            task = ReferenceTask(
                request,
                prompt,
                study.reference,
                variant,
                plan.source,
                tuple(ids[prompt_name][0]),
                tuple(ids[prompt_name][1]),
                env,
                str(plan.reference_paths[(prompt_name, BASE)]) if base else None,
                base.meta["key"] if base else None,
            )
            label = f"reference {prompt_name}" + (f"~{draw.name}" if draw else "")
            jobs.append(Job(run_reference, (task, str(study.folder)), f"ref-{request}", label))
            slots[f"ref-{request}"] = slot
        if not jobs:
            continue
        if (
            study.reference.kind == "transformers"
            and importlib.util.find_spec("transformers") is None
        ):
            raise StudyError(
                f"{len(jobs)} reference(s) are not cached and transformers is not installed: "
                "run `nox -s reference` (or pip install 'qllama[reference]')"
            )
        bar = _progress(len(jobs), 0, "references")
        try:
            for outcome in execute(jobs):
                job = outcome.job
                if outcome.error is not None:
                    raise StudyError(f"{job.label} failed: {outcome.error}")
                with np.load(io.BytesIO(outcome.result)) as z:
                    ref = Reference(
                        [int(t) for t in z["tokens"]],
                        int(z["n_prompt"]),
                        z["logits"],
                        json.loads(str(z["meta"])),
                    )
                path = store.save(ref)
                slot = slots[job.key]
                plan.references[slot] = ref
                plan.reference_paths[slot] = path
                bar.write(
                    f"{job.label}: {len(ref.continuation)} new tokens, key {ref.meta['key'][:16]}"
                )
                bar.update(1)
        finally:
            bar.close()


def _memory_mb(variant: VariantFile, options: dict[str, Any], ref: Reference) -> int:
    """What a cell holds at once: the file (four times over when widened to f32), the
    reference's logits and the cell's own, and the interpreter with its libraries."""
    file_mb = Path(variant.path).stat().st_size / 2**20
    widened = 4 if options.get("dequantize_all") else 1
    return int(2 * widened * file_mb + 2 * ref.logits.nbytes / 2**20 + 768)


def plan_cells(plan: Plan, chosen: Sequence[Cell]) -> None:
    """A task, with its content key, for every chosen cell."""
    study = plan.study
    for cell in chosen:
        draw = study.draw(cell.draw) if cell.draw else None
        how = arithmetic(study.setting(cell.setting), draw)
        measures = measure_specs(study, cell)
        ref = plan.reference(cell.prompt, cell.draw)
        variant = plan.variants[cell.variant]
        files = {}
        for spec in measures:
            for name in variants_named(spec):
                if name not in plan.variants:
                    raise StudyError(f"measure {spec.name!r} names {name!r}, not a variant")
                files[name] = plan.variants[name]
        key = content_key(
            file_sha256=variant.sha256,
            reference_key=ref.meta["key"],
            how=how,
            measures=measures,
            threads=study.threads,
            files={n: f.sha256 for n, f in files.items()},
        )
        path = (
            plan.reference_paths.get((cell.prompt, cell.draw))
            or plan.reference_paths[(cell.prompt, BASE)]
        )
        plan.tasks[cell.id] = CellTask(
            cell,
            key,
            how,
            variant,
            plan.source,
            measures,
            study.threads,
            str(path),
            ref.meta["key"],
            _memory_mb(variant, dict(how.options), ref),
            files=files,
        )


def run_cells(plan: Plan, execute: Any, *, force: bool = False, slots: int = 1) -> list[str]:
    """Run every planned cell that is not cached; returns the ids of the cells that failed."""
    cache = CellCache(plan.results)
    todo = [t for t in plan.tasks.values() if force or not cache.has(t.key)]
    # longest first (the longest prompts): the last cells to finish are short ones
    todo.sort(key=lambda t: -plan.study.prompt(t.cell.prompt).max_new_tokens)
    done = len(plan.tasks) - len(todo)
    failed: list[str] = []
    if not todo:
        _say(f"cells: all {len(plan.tasks)} cached")
        return failed
    jobs = [
        Job(
            run_cell,
            (t,),
            f"cell-{t.key}",
            t.cell.id,
            t.memory_mb,
            (f"reference-data-{t.reference_key}", _reader(t.reference_path)),
        )
        for t in todo
    ]
    bar = _progress(len(plan.tasks), done, "cells")
    left = len(todo)
    bar.set_postfix_str(f"running {min(slots, left)}, left {left}, cached {done}")
    try:
        for outcome in execute(jobs):
            left -= 1
            if outcome.error is not None:
                failed.append(outcome.job.label)
                bar.write(f"cell {outcome.job.label} failed: {outcome.error}")
            else:
                result: CellResult = outcome.result
                cache.save(result)
            bar.set_postfix_str(f"running {min(slots, left)}, left {left}, cached {done}", False)
            bar.update(1)
    finally:
        bar.close()
    return failed


def _reader(path: str) -> Callable[[], bytes]:
    return lambda: Path(path).read_bytes()


@dataclass
class Options:
    """How to run a study (the CLI's flags)."""

    results: Path = Path("results")
    docs: Path | None = None
    executor: str = "process"
    workers: int | None = None
    scheduler: str | None = None
    patterns: tuple[str, ...] = ()
    force: bool = False
    report_only: bool = False
    references_only: bool = False
    cache: str | None = None  # qllama's cache folder for the variants' files (None: the user's)


def execute(study: Study, options: Options) -> tuple[int, collect.Collected | None]:
    """Build the files, compute the references and the cells not cached; then the cells'
    results, collected (None, with the exit status, where a cell failed or has no result)."""
    from qllama.study.declaration import toml_inline
    from qllama.version import __version__

    t0 = time.perf_counter()
    all_cells = product(study)
    chosen = select(all_cells, options.patterns)
    settings = "; ".join(
        f"{s.name} = {s.backend if s.engine == 'qllama' else s.engine}"
        + (f" with {toml_inline(s.options)}" if s.options else "")
        for s in study.settings
    )
    _say(
        f"qllama {__version__}, study {study.name}: {len(chosen)} cells, {study.threads} "
        f"thread(s) each, executor {options.executor}; settings: {settings}"
    )
    pool = (
        Local()
        if options.report_only
        else make_executor(options.executor, workers=options.workers, scheduler=options.scheduler)
    )
    try:
        plan = Plan(study, options.results, build_variants(study, cache=options.cache))
        plan_references(plan, pool.run, compute=not options.report_only)
        if options.references_only:
            return 0, None
        plan_cells(plan, all_cells)
        chosen_ids = {c.id for c in chosen}
        subset = Plan(
            plan.study,
            plan.results,
            plan.variants,
            plan.references,
            plan.reference_paths,
            {k: t for k, t in plan.tasks.items() if k in chosen_ids},
        )
        failed = (
            []
            if options.report_only
            else run_cells(subset, pool.run, force=options.force, slots=pool.slots)
        )
    finally:
        pool.close()
    _say(f"cells done in {time.perf_counter() - t0:.0f} s")
    cache = CellCache(options.results)
    results = {cid: cache.load(t.key) for cid, t in plan.tasks.items()}
    missing = [cid for cid, r in results.items() if r is None]
    if failed:
        _say(f"{len(failed)} cell(s) failed: {', '.join(failed)}")
        return 1, None
    if missing:
        _say(f"{len(missing)} cell(s) have no result yet (e.g. {missing[0]}); the report waits")
        return (0 if options.patterns else 1), None
    done = {cid: r for cid, r in results.items() if r is not None}
    return 0, collect.collect(plan, done)


def run(study: Study, options: Options) -> int:
    """The whole study; 0 when every asserted finding holds, 1 when one fails or a cell
    failed, and the report (``options.docs``) written when every cell has a result."""
    from qllama.study import findings, report

    status, data = execute(study, options)
    if data is None:
        return status
    outcomes = findings.evaluate(study, data)
    if options.docs is not None:
        report.write(data, outcomes, options.docs)
        _say(f"report: {options.docs / 'results.md'}")
    for line in findings.summary_lines(outcomes):
        print(line)
    return 1 if any(o.failed for o in outcomes if o.asserted) else 0


__all__ = ["Options", "Plan", "execute", "run"]
