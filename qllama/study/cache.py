"""The cell cache: ``<results>/cells/<key>.json`` (numbers) and ``<key>.npz`` (arrays).

Files are named by the cell's content key, so a result can only be found by a cell that
would compute the same numbers. Both files are written atomically, arrays first: the JSON is
the commit, and a cell killed half-way leaves nothing a reader would take for a result.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from qllama.atomic import atomic_write


@dataclass
class CellResult:
    """What a cell measured, as stored: ``numbers`` (cell id, key, ..., and ``measures``, each
    measure's numbers by name) and its arrays, named ``measure.field``. Each measure's result
    is read back by :func:`qllama.study.measures.read` (:mod:`qllama.study.results`)."""

    numbers: dict[str, Any]
    arrays: dict[str, np.ndarray] = field(default_factory=dict)

    @property
    def key(self) -> str:
        return str(self.numbers["key"])


class CellCache:
    """Finished cells under ``folder/cells``."""

    def __init__(self, folder: str | Path) -> None:
        self.folder = Path(folder) / "cells"

    def _paths(self, key: str) -> tuple[Path, Path]:
        return self.folder / f"{key}.json", self.folder / f"{key}.npz"

    def has(self, key: str) -> bool:
        js, npz = self._paths(key)
        return js.is_file() and npz.is_file()

    def load(self, key: str) -> CellResult | None:
        """The cell of ``key``, or None if it has not finished."""
        js, npz = self._paths(key)
        try:
            numbers = json.loads(js.read_text())
            with np.load(npz) as z:
                arrays = {k: z[k] for k in z.files}
        except (OSError, ValueError):
            return None
        return CellResult(numbers, arrays) if numbers.get("key") == key else None

    def save(self, result: CellResult) -> None:
        js, npz = self._paths(result.key)
        with atomic_write(npz) as f:
            savez: Any = np.savez  # its stubs type the keyword arrays as its own flags
            savez(f, **result.arrays)
        with atomic_write(js, "w") as f:
            json.dump(result.numbers, f, indent=1)
