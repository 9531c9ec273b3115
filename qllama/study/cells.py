"""Cells: the product of a study's declaration, each with a content key.

A cell is one prompt, one variant, one setting and one draw (the base draw, or a
perturbation). Its id reads ``prompt/variant-setting`` (``~draw`` for a perturbation), and
``--cells`` patterns match it (``fnmatch``: ``'cpu-cache/Q8_0-*'``). Its key is the sha256 of
everything its numbers depend on: the file's hash, the reference's content key, the engine,
backend and options, the measures and their options, the thread count, the draw's
environment, and qllama's version; names (of the prompt, the setting) are not in it, so
renaming reruns nothing and changing a setting reruns exactly its cells.
"""

from __future__ import annotations

import fnmatch
import hashlib
import json
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from qllama.study.declaration import (
    Cell,
    Draw,
    MeasureSpec,
    Setting,
    Study,
    StudyError,
    applies,
    product,
)
from qllama.study.measures import get as get_measure
from qllama.version import __version__

# Cell, applies and product are the declaration's grid (qllama.study.declaration), named here
# with what this module adds to it: the selection, the arithmetic and the keys
__all__ = [
    "Arithmetic",
    "Cell",
    "applies",
    "arithmetic",
    "compared",
    "content_key",
    "measure_specs",
    "product",
    "select",
]


def select(cells: Iterable[Cell], patterns: Sequence[str]) -> list[Cell]:
    """The cells whose id matches one of ``patterns`` (all of them when there are none)."""
    cells = list(cells)
    if not patterns:
        return cells
    chosen = [c for c in cells if any(fnmatch.fnmatchcase(c.id, p) for p in patterns)]
    if not chosen:
        raise StudyError(f"no cell matches {', '.join(patterns)} (cells look like {cells[0].id})")
    return chosen


@dataclass(frozen=True)
class Arithmetic:
    """How a cell computes: the setting with its draw's changes applied."""

    engine: str
    backend: str
    options: Mapping[str, Any] = field(default_factory=dict)
    env: Mapping[str, str] = field(default_factory=dict)


def arithmetic(setting: Setting, draw: Draw | None) -> Arithmetic:
    """The setting as the draw runs it (another engine, more options, an environment)."""
    if draw is None:
        return Arithmetic(setting.engine, setting.backend, dict(setting.options))
    return Arithmetic(
        draw.engine or setting.engine,
        setting.backend,
        {**setting.options, **draw.options},
        dict(draw.env),
    )


def compared(study: Study, cell: Cell) -> bool:
    """Whether a ``compare`` pair names ``cell`` (``variant-setting`` or ``...~draw``)."""
    name = cell.label + (f"~{cell.draw}" if cell.draw else "")
    return any(
        name in (c.a, c.b) and (not c.prompts or cell.prompt in c.prompts) for c in study.compare
    )


def measure_specs(study: Study, cell: Cell) -> tuple[MeasureSpec, ...]:
    """The study's measures that run in ``cell``, with their options resolved; teacher forcing
    keeps every step's logits in the cells a ``compare`` pair names (others keep only the
    per-step numbers)."""
    out = []
    for spec in study.measures:
        if not spec.applies(cell.id):
            continue
        m = get_measure(spec.name)
        options = m.options(spec.options)
        if "logits" in m.defaults and compared(study, cell):
            options["logits"] = True
        out.append(replace(spec, options=options))
    return tuple(out)


def content_key(
    *,
    file_sha256: str,
    reference_key: str,
    how: Arithmetic,
    measures: Sequence[MeasureSpec],
    threads: int,
    files: Mapping[str, str] | None = None,
) -> str:
    """The cell's key: the sha256 of what its numbers depend on (16 hex digits shown)."""

    meta = {
        "file_sha256": file_sha256,
        "reference": reference_key,
        "engine": how.engine,
        "backend": how.backend,
        "options": how.options,
        "env": how.env,
        "measures": [[m.name, m.options] for m in measures],
        "threads": threads,
        "qllama": __version__,
    }
    if files:  # the other variants' files the measures read, by name: their sha256
        meta["files"] = dict(files)
    return hashlib.sha256(json.dumps(meta, sort_keys=True).encode()).hexdigest()[:32]
