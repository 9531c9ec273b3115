"""A recipe: one type per tensor group, chosen at a bits-per-weight budget, as llama-quantize
``--tensor-type`` overrides and as the file qllama's quantizer writes with them.

:func:`choose` turns measured sensitivities (:mod:`qllama.measure.sensitivity`) into the
assignment of least predicted KL divergence within the budget (:mod:`qllama.recipe.search`);
sizes are llama-quantize's: each tensor's bytes at its type, the unquantized tensors as they
are, over every tensor's elements. :func:`write` writes the GGUF (atomically), the overrides as
a ``--tensor-type-file`` and the recipe as JSON with the llama-quantize command that makes the
same file.

Every override pattern is anchored (``^...$``) and checked to match exactly its group's
tensors among the file's names, since llama-quantize takes the first pattern that
``regex_search`` finds anywhere in a name.
"""

from __future__ import annotations

import json
import math
import os
import re
import shlex
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from qllama.errors import QllamaError
from qllama.ggml_types import FileType, GGMLType
from qllama.measure.sensitivity import Group, Sensitivities
from qllama.recipe.search import Option, solve


@dataclass
class Recipe:
    """The chosen type of every group, its size and its predicted KL divergence."""

    file: str  # the F32 file
    target_bpw: float
    bpw: float
    nbytes: int  # every tensor's bytes in the recipe's file
    predicted_kld: float  # the sum of the chosen cells
    predicted_kld_unc: float  # their standard errors in quadrature
    groups: list[Group]
    types: dict[str, GGMLType]  # group -> type
    file_type: FileType
    reachable_bpw: tuple[float, float]

    def patterns(self) -> list[tuple[str, GGMLType]]:
        """Each group's anchored pattern and its type, in the groups' order."""
        return [(pattern(g), self.types[g.name]) for g in self.groups]

    def overrides(self) -> Any:
        """The :class:`~qllama.gguf.quantizer.Overrides` that make this recipe."""
        from qllama.gguf.quantizer import Overrides

        return Overrides(tuple(self.patterns()))

    def tensor_types(self) -> list[str]:
        """``NAME=TYPE`` per group, as ``--tensor-type`` and ``--tensor-type-file`` take them."""
        return [f"{p}={t.name.lower()}" for p, t in self.patterns()]

    def command(
        self, out: str | os.PathLike[str], imatrix: str | os.PathLike[str] | None = None
    ) -> str:
        """The llama-quantize command line that writes the same file."""
        args = ["llama-quantize"]
        if imatrix is not None:
            args += ["--imatrix", os.fspath(imatrix)]
        args += self.overrides().as_arguments()
        args += [self.file, os.fspath(out), self.file_type.label]
        return " ".join(shlex.quote(a) for a in args)

    def to_dict(self) -> dict[str, Any]:
        return {
            "file": self.file,
            "target_bpw": self.target_bpw,
            "bpw": self.bpw,
            "bytes": self.nbytes,
            "predicted_mean_kld": self.predicted_kld,
            "predicted_mean_kld_unc": self.predicted_kld_unc,
            "file_type": self.file_type.label,
            "reachable_bpw": list(self.reachable_bpw),
            "groups": [
                {
                    "group": g.name,
                    "type": self.types[g.name].name,
                    "tensors": len(g.tensors),
                    "bytes": g.nbytes(self.types[g.name]),
                }
                for g in self.groups
            ],
            "tensor_types": self.tensor_types(),
        }


def pattern(group: Group) -> str:
    """An anchored regular expression that matches exactly the group's tensor names:
    ``^blk\\.(0|1|2)\\.attn_q\\.weight$``, or ``^token_embd\\.weight$``."""
    if group.layers:
        layers = "|".join(str(i) for i in group.layers)
        return rf"^blk\.({layers})\.{re.escape(group.kind)}$"
    return "^" + "|".join(re.escape(n) for n in group.tensors) + "$"


def check_patterns(groups: Sequence[Group], names: Sequence[str]) -> None:
    """Refuse a pattern that ``re.search`` finds in a name outside its group, or not in one
    of its group's (llama-quantize lower-cases the pattern: so is the check)."""
    for g in groups:
        p = re.compile(pattern(g).lower())
        found = {n for n in names if p.search(n)}
        if found != set(g.tensors):
            odd = sorted(found ^ set(g.tensors))[:3]
            raise QllamaError(
                f"the pattern of {g.name} matches {sorted(found)[:3]} for its tensors "
                f"{list(g.tensors)[:3]}: these differ: {odd}"
            )


def bits(nbytes: int, n_elements: int) -> float:
    return 8 * nbytes / n_elements


def options(sens: Sensitivities) -> list[list[Option]]:
    """Each group's candidate types as search options (bytes, measured KL)."""
    return [
        [Option(c.type, c.nbytes, c.mean_kld) for c in sens.cells[g.name].values()]
        for g in sens.groups
    ]


def choose(sens: Sensitivities, target_bpw: float) -> Recipe:
    """The recipe of least predicted KL divergence at most ``target_bpw`` bits per weight; a
    target outside the reachable range is an error naming it."""
    opts = options(sens)
    low = sens.fixed_bytes + sum(min(o.nbytes for o in os_) for os_ in opts)
    high = sens.fixed_bytes + sum(max(o.nbytes for o in os_) for os_ in opts)
    span = (bits(low, sens.n_elements), bits(high, sens.n_elements))
    if not (math.isfinite(target_bpw) and span[0] <= target_bpw <= span[1] + 1e-9):
        raise QllamaError(
            f"--target-bpw {target_bpw:g}: no assignment of the candidate types reaches it; "
            f"{os.path.basename(sens.file)} can be made from {span[0]:.4f} (the smallest) to "
            f"{span[1]:.4f} (the largest) bits per weight"
        )
    budget = math.floor(target_bpw * sens.n_elements / 8) - sens.fixed_bytes
    found = solve(opts, budget)
    types = {
        g.name: GGMLType[opts[k][i].label]
        for k, (g, i) in enumerate(zip(sens.groups, found.choice, strict=True))
    }
    cells = [sens.cells[g.name][types[g.name].name] for g in sens.groups]
    nbytes = sens.fixed_bytes + found.nbytes
    return Recipe(
        file=sens.file,
        target_bpw=target_bpw,
        bpw=bits(nbytes, sens.n_elements),
        nbytes=nbytes,
        predicted_kld=found.cost,
        predicted_kld_unc=math.sqrt(sum(c.mean_kld_unc**2 for c in cells)),
        groups=list(sens.groups),
        types=types,
        file_type=file_type_for(sens.groups, types),
        reachable_bpw=span,
    )


def file_type_for(groups: Sequence[Group], types: dict[str, GGMLType]) -> FileType:
    """The file type llama-quantize is given: the one whose default type holds the most
    bytes of the recipe (every quantized tensor is overridden, so it only names the file)."""
    from qllama.gguf.quantizer import DEFAULT_TYPES

    weight: dict[GGMLType, int] = {}
    for g in groups:
        t = types[g.name]
        weight[t] = weight.get(t, 0) + g.nbytes(t)
    for t in sorted(weight, key=lambda t: -weight[t]):
        ft = next((ft for ft, d in DEFAULT_TYPES.items() if d == t), None)
        if ft is not None:
            return ft
    raise QllamaError("no file type has any of the recipe's types as its default")


def write(
    recipe: Recipe,
    out: str | os.PathLike[str],
    *,
    imatrix: str | os.PathLike[str] | None = None,
    progress: Any = None,
) -> dict[str, Path]:
    """The recipe's GGUF at ``out`` (qllama's quantizer with the recipe's overrides), its
    ``--tensor-type-file`` (``OUT.tensor-types.txt``) and its JSON (``OUT.recipe.json``, with
    the llama-quantize command), each written atomically, the JSON last."""
    from qllama.atomic import atomic_write
    from qllama.gguf.quantizer import quantize_file
    from qllama.gguf.reader import read_gguf

    out = Path(out)
    with read_gguf(recipe.file) as f:
        check_patterns(recipe.groups, list(f.tensors))
        result = quantize_file(
            f,
            out,
            recipe.file_type,
            imatrix=imatrix,
            overrides=recipe.overrides(),
            progress=progress,
        )
    wanted = {n: recipe.types[g.name] for g in recipe.groups for n in g.tensors}
    wrong = {n: t.name for n, t in result.types.items() if n in wanted and t != wanted[n]}
    if wrong or result.bytes_out != recipe.nbytes:  # bytes_out: every tensor, kept ones too
        raise QllamaError(
            f"the quantizer wrote {result.bytes_out} bytes for the recipe's {recipe.nbytes}; "
            f"types other than the recipe's: {wrong}"
        )
    types_file = out.with_name(out.name + ".tensor-types.txt")
    with atomic_write(types_file, "w") as t:
        t.write("\n".join(recipe.tensor_types()) + "\n")
    doc = {**recipe.to_dict(), "out": out.name, "command": recipe.command(out, imatrix)}
    doc["imatrix"] = os.fspath(imatrix) if imatrix is not None else None
    json_file = out.with_name(out.name + ".recipe.json")
    with atomic_write(json_file, "w") as j:
        json.dump(doc, j, indent=1)
    return {"gguf": out, "tensor_types": types_file, "json": json_file}


__all__ = [
    "Recipe",
    "bits",
    "check_patterns",
    "choose",
    "file_type_for",
    "options",
    "pattern",
    "write",
]
