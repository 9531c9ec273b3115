"""``weights_from=``: a GGUF file with chosen tensors taken from other files.

``qllama.load(q4_path, weights_from={"blk.*.ffn_down.weight": f32_path})`` runs the Q4_K_M
model with the F32 file's ``ffn_down`` weights, so the weight error of one tensor class can be
isolated (or, the other way round, the F32 model with one class quantized). Patterns are
:mod:`fnmatch` patterns over the base file's tensor names (``*`` also matches dots), the first
match wins, and each must match at least one tensor. A taken tensor must exist in its donor
with the same shape; its type may differ (that is the point), and is checked like any other.

:class:`TensorOverlay` is a :class:`~qllama.gguf.reader.GGUFFile`: the base file's metadata,
with the donors' tensor infos and bytes for the names they supply. Closing it closes them all.
"""

from __future__ import annotations

import fnmatch
import os
from collections.abc import Mapping, Sequence
from pathlib import Path

import numpy as np

from qllama.errors import ModelConfigError, QllamaError, TensorShapeError
from qllama.gguf.reader import GGUFFile, TensorInfo, read_gguf

Donor = str | os.PathLike[str] | GGUFFile


class TensorOverlay(GGUFFile):
    """The base file, with some tensors' infos and bytes from other files."""

    def __init__(
        self, base: GGUFFile, donors: Mapping[str, GGUFFile], owned: Sequence[GGUFFile] = ()
    ) -> None:
        # a view of the base: its parsed metadata, layout and map, not a re-parse
        self.__dict__.update(base.__dict__)
        self.base = base
        self.donors = dict(donors)  # tensor name -> the file it comes from
        self.owned = list(owned)  # donor files opened for this overlay, closed with it
        self.tensors = {
            name: (self.donors[name].tensors[name] if name in self.donors else t)
            for name, t in base.tensors.items()
        }

    @property
    def sources(self) -> dict[str, str]:
        """Each taken tensor's name -> the path of its file."""
        return {name: str(f.path) for name, f in self.donors.items()}

    def tensor(self, name: str) -> TensorInfo:
        return self.donors[name].tensor(name) if name in self.donors else self.base.tensor(name)

    def tensor_data(self, name: str) -> np.ndarray:
        source = self.donors.get(name, self.base)
        return source.tensor_data(name)

    def read_tensor(self, name: str, start: int, out: np.ndarray) -> None:
        self.donors.get(name, self.base).read_tensor(name, start, out)

    def close(self) -> None:
        for f in (self.base, *self.owned):
            f.close()

    def __repr__(self) -> str:
        return f"TensorOverlay({self.base!r}, {len(self.donors)} tensors from other files)"


def overlay(base: GGUFFile, weights_from: Mapping[str, Donor]) -> TensorOverlay:
    """``base`` with the tensors matching each pattern of ``weights_from`` from its file."""
    opened: dict[str, GGUFFile] = {}
    try:
        files = {pattern: _open(donor, opened) for pattern, donor in weights_from.items()}
        donors: dict[str, GGUFFile] = {}
        used: set[str] = set()
        for name, t in base.tensors.items():
            pattern = next((p for p in files if fnmatch.fnmatchcase(name, p)), None)
            if pattern is None:
                continue
            used.add(pattern)
            donor = files[pattern]
            theirs = donor.tensors.get(name)
            where = donor.path or "the donor file"
            if theirs is None:
                raise ModelConfigError(f"weights_from: {where} has no tensor '{name}'")
            if theirs.shape != t.shape:
                raise TensorShapeError(
                    f"weights_from: tensor '{name}' has shape {list(theirs.shape)} in {where}, "
                    f"{list(t.shape)} in the model file"
                )
            donors[name] = donor
        unused = [p for p in files if p not in used]
        if unused:
            raise QllamaError(
                f"weights_from pattern(s) {', '.join(repr(p) for p in unused)} match no tensor "
                "of the model file (or only ones an earlier pattern took)"
            )
        return TensorOverlay(base, donors, list(opened.values()))
    except BaseException:
        for f in opened.values():
            f.close()
        raise


def _open(donor: Donor, opened: dict[str, GGUFFile]) -> GGUFFile:
    """A donor file, each path opened once (files passed in stay the caller's)."""
    if isinstance(donor, GGUFFile):
        return donor
    key = str(Path(donor).resolve())
    if key not in opened:
        opened[key] = read_gguf(donor)
    return opened[key]
