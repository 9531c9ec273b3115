"""The matrix: every (file, setting) cell, run independently and cached.

A cell loads one quantized file on one arithmetic and measures it against the reference:
the last position, teacher forcing step by step (and in one batched pass), and free
generation. Its result is ``results/cells/<cell>.json`` (numbers) and ``.npz`` (per-step
arrays), keyed by everything it depends on (reference, file hash, setting, qllama version),
so a finished cell is never run twice and cells can be spread over machines sharing
``results/``.
"""

from __future__ import annotations

import hashlib
import json
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from experiments import study
from qllama import __version__, load
from qllama.atomic import atomic_write
from qllama.compare import Reference, free_generation, teacher_forcing
from qllama.model_files import sha256_file, variant

TOP = 5  # per-step top-k kept for the cross-setting tables


@dataclass(frozen=True)
class Cell:
    file: str  # file type: F32, Q8_0, Q4_K_M
    setting: str  # a key of study.SETTINGS

    @property
    def id(self) -> str:
        return f"{self.file}-{self.setting}"

    @classmethod
    def parse(cls, text: str) -> Cell:
        for file in study.FILES:
            if text.startswith(file + "-") and text[len(file) + 1 :] in study.SETTINGS:
                return cls(file, text[len(file) + 1 :])
        raise ValueError(f"unknown cell {text!r}; cells look like Q8_0-cpu")


CELLS = [Cell(f, s) for f in study.FILES for s in study.SETTINGS]


def cell_key(cell: Cell, ref: Reference, file_sha: str) -> str:
    s = study.SETTINGS[cell.setting]
    meta = {
        "reference": ref.meta.get("key"),
        "file_sha256": file_sha,
        "backend": s.backend,
        "options": s.options,
        "qllama": __version__,
    }
    return hashlib.sha256(json.dumps(meta, sort_keys=True).encode()).hexdigest()[:16]


def _paths(results: Path, cell: Cell) -> tuple[Path, Path]:
    base = results / "cells" / cell.id
    return base.with_suffix(".json"), base.with_suffix(".npz")


def load_cell(results: Path, cell: Cell) -> tuple[dict[str, Any], dict[str, np.ndarray]] | None:
    """A finished cell's numbers and arrays, or None."""
    js, npz = _paths(results, cell)
    if not (js.exists() and npz.exists()):
        return None
    with np.load(npz) as z:
        return json.loads(js.read_text()), {k: z[k] for k in z.files}


def _top(logits: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    idx = np.argsort(-logits, axis=-1, kind="stable")[:, :TOP]
    return idx, np.take_along_axis(logits, idx, axis=-1)


def run_cell(cell: Cell, ref: Reference, results: Path, *, force: bool = False) -> dict[str, Any]:
    """Run (or reuse) one cell; returns its numbers."""
    path = variant(study.MODEL, cell.file)
    key = cell_key(cell, ref, sha256_file(path))
    done = load_cell(results, cell)
    if done is not None and done[0].get("key") == key and not force:
        print(f"[{cell.id}] cached")
        return done[0]
    s = study.SETTINGS[cell.setting]
    t0 = time.perf_counter()
    model = load(path, backend=s.backend, **s.options)
    n = len(ref.continuation)

    def progress(step: int, total: int) -> None:
        if step % 50 == 0:
            print(
                f"[{cell.id}] teacher forcing {step}/{total} ({time.perf_counter() - t0:.0f} s)",
                flush=True,
            )

    steps = teacher_forcing(model, ref, mode="steps", progress=progress)
    batched = teacher_forcing(model, ref, mode="batched")
    print(f"[{cell.id}] free generation ...", flush=True)
    free = free_generation(model, ref, extra=study.EXTRA_TOKENS)
    top_ids, top_logits = _top(steps.logits)
    result = {
        "cell": cell.id,
        "file": cell.file,
        "setting": cell.setting,
        "backend": s.backend,
        "options": s.options,
        "device": str(model.backend.device),
        "key": key,
        "seconds": round(time.perf_counter() - t0, 1),
        "last_position_max_abs": float(steps.max_abs[0]),
        "teacher_forcing": steps.summary(),
        "teacher_forcing_batched": batched.summary(),
        "free_generation": free.summary(),
        "steps": n,
    }
    js, npz = _paths(results, cell)
    with atomic_write(npz) as f:
        np.savez(
            f,
            max_abs=steps.max_abs,
            argmax=steps.argmax,
            batched_max_abs=batched.max_abs,
            batched_argmax=batched.argmax,
            top_ids=top_ids,
            top_logits=top_logits,
        )
    with atomic_write(js, "w") as f:
        json.dump(result, f, indent=1)
    print(
        f"[{cell.id}] done in {result['seconds']} s: "
        f"last position {result['last_position_max_abs']:.3g}, "
        f"argmax {steps.summary()['argmax_agree']}/{n}, fork {free.fork}",
        flush=True,
    )
    return result
