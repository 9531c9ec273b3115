"""The recipes judged on held-out windows beside the stock mixtures, through the ladder.

The comparison is a ladder study (:mod:`qllama.study.ladder`): the stock mixtures
(:data:`STOCK`) and each recipe's file (a variant with the recipe's ``--tensor-type``
overrides: the file ``qllama recipe`` wrote where it is given, else built by the study
machinery like any file) measured by the ladder's corpus measure on its first ``chunks``
windows, which the calibration windows come after, so no recipe is judged on the text it was
chosen on. Cells are cached as every study's are: an interrupted
comparison resumes, and a stock mixture already measured by a ladder with the same settings is
not measured again.

Each recipe is set beside the stock mixture nearest in bits per weight; the difference of
their mean KLDs is given with its noise band, the two standard errors in quadrature (the same
windows score both, so this overstates the noise of the difference) and, where the setting
has draws, the spread of the draws added.
"""

from __future__ import annotations

import math
import os
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

from qllama.recipe.recipe import Recipe

STOCK = ("Q3_K_M", "Q4_K_S", "Q4_K_M", "IQ4_XS", "Q5_K_M")


def recipe_name(recipe: Recipe) -> str:
    """A recipe's variant name: ``recipe-4.5``."""
    return f"recipe-{recipe.target_bpw:g}"


def study(
    f32: str | os.PathLike[str],
    recipes: Sequence[Recipe],
    *,
    imatrix: str | os.PathLike[str] | None = None,
    stock: Sequence[str] = STOCK,
    corpus: str = "botchan",
    chunks: int = 16,
    n_ctx: int = 512,
    settings: Sequence[str] = ("dequantize-all",),
    threads: int = 1,
    files: Mapping[str, str | os.PathLike[str]] | None = None,
) -> tuple[Any, list[Any]]:
    """The ladder study of the stock mixtures and the recipes' files (with the importance
    matrix file ``imatrix`` for all of them, or none), and its rungs. ``files`` are the
    recipes' files already written, by :func:`recipe_name`: measured as they are, not
    quantized again."""
    from qllama.study.declaration import StudyError, Variant
    from qllama.study.ladder import SETTINGS, ladder_study

    unknown = [s for s in settings if s not in {x.name for x in SETTINGS}]
    if unknown:
        raise StudyError(
            f"unknown setting(s) {unknown}: known {', '.join(x.name for x in SETTINGS)}"
        )
    base, rungs = ladder_study(
        str(f32),
        types=list(stock),
        imatrix_corpus=None,
        corpus=corpus,
        chunks=chunks,
        n_ctx=n_ctx,
        draws=("avx2",) if "cpu" in settings else (),
        threads=threads,
        f32_path=f32,
    )
    matrix = os.fspath(imatrix) if imatrix is not None else None
    written = {name: os.path.abspath(path) for name, path in (files or {}).items()}
    suffix = "-imatrix" if matrix else ""
    variants = [Variant("F32")]
    variants += [Variant(r.type, r.type + suffix, imatrix=matrix) for r in rungs if not r.reason]
    variants += [
        Variant(
            r.file_type.label,
            recipe_name(r),
            imatrix=matrix,
            tensor_types=tuple(r.tensor_types()),
            file=written.get(recipe_name(r)),
        )
        for r in recipes
    ]
    chosen = tuple(replace(s, variants=()) for s in SETTINGS if s.name in settings)
    out = replace(
        base,
        name="recipe",
        title=f"Recipes at a budget against the stock mixtures of {os.path.basename(str(f32))}",
        variants=tuple(variants),
        settings=chosen,
        draws=base.draws,
    )
    return out, rungs


@dataclass
class Versus:
    """One recipe beside the stock mixture nearest in size, under one setting."""

    recipe: str
    stock: str
    setting: str
    recipe_bpw: float
    stock_bpw: float
    recipe_kld: float
    recipe_kld_unc: float
    stock_kld: float
    stock_kld_unc: float
    predicted_kld: float  # the sum of the cells (calibration windows)
    calibration_kld: float  # the recipe's file measured whole on the calibration windows
    noise: float  # the band of the difference

    @property
    def gain(self) -> float:
        """How much lower the recipe's mean KLD is than the stock mixture's."""
        return self.stock_kld - self.recipe_kld

    @property
    def beyond_noise(self) -> bool:
        """Lower by more than twice the noise band."""
        return self.gain > 2 * self.noise


def versus(
    table: Sequence[Any],
    recipes: Sequence[Recipe],
    setting: str,
    calibration: dict[str, float],
) -> list[Versus]:
    """Each recipe beside the stock file nearest in bits per weight (rows of the ladder)."""
    by_name = {r.name: r for r in table if not r.reason and setting in r.cells}
    names = {recipe_name(r) for r in recipes}
    stock = [r for n, r in by_name.items() if n not in names]
    out = []
    for rec in recipes:
        row = by_name.get(recipe_name(rec))
        if row is None or not stock:
            continue
        near = min(stock, key=lambda s: abs(s.bpw - row.bpw))
        a, b = row.cells[setting], near.cells[setting]
        spread = sum((c.band[1] - c.band[0]) for c in (a, b) if c.band)
        out.append(
            Versus(
                recipe=row.name,
                stock=near.name,
                setting=setting,
                recipe_bpw=row.bpw,
                stock_bpw=near.bpw,
                recipe_kld=a.mean_kld,
                recipe_kld_unc=a.mean_kld_unc,
                stock_kld=b.mean_kld,
                stock_kld_unc=b.mean_kld_unc,
                predicted_kld=rec.predicted_kld,
                calibration_kld=calibration.get(row.name, math.nan),
                noise=math.hypot(a.mean_kld_unc, b.mean_kld_unc) + spread,
            )
        )
    return out


def format_versus(rows: Sequence[Versus]) -> list[str]:
    """A markdown table of the recipes against the stock mixtures."""
    head = (
        "| recipe | bpw | held-out mean KLD | stock | bpw | held-out mean KLD | gain (noise) "
        "| predicted (calibration) | measured whole (calibration) |"
    )
    lines = [head, "|" + "---|" * 9]
    for v in rows:
        mark = " **beyond 2x noise**" if v.beyond_noise else ""
        lines.append(
            f"| {v.recipe} | {v.recipe_bpw:.3f} | {v.recipe_kld:.3e} ± {v.recipe_kld_unc:.1e} "
            f"| {v.stock} | {v.stock_bpw:.3f} | {v.stock_kld:.3e} ± {v.stock_kld_unc:.1e} "
            f"| {v.gain:+.3e} ({v.noise:.1e}){mark} | {v.predicted_kld:.3e} "
            f"| {v.calibration_kld:.3e} |"
        )
    return lines


def write(
    folder: str | os.PathLike[str],
    table: Sequence[Any],
    rows: Sequence[Versus],
    recipes: Sequence[Recipe],
    settings: Sequence[str],
    *,
    about: str,
    with_plot: bool = True,
) -> None:
    """``recipe.md``, ``recipe.json`` (and ``recipe.png``: the ladder's plot with the recipes
    among its points) into ``folder``, each atomically, the JSON first."""
    import json

    from qllama.atomic import atomic_write
    from qllama.study import ladder as ladders

    out = Path(folder)
    out.mkdir(parents=True, exist_ok=True)
    with atomic_write(out / "recipe.json", "w") as f:
        json.dump(
            {
                "recipes": [r.to_dict() for r in recipes],
                "versus": [
                    {**asdict(v), "gain": v.gain, "beyond_noise": v.beyond_noise} for v in rows
                ],
                "ladder": [asdict(r) for r in table],
            },
            f,
            indent=1,
        )
    md = [
        "# Recipes at a budget against the stock mixtures\n",
        about + "\n",
        *format_versus(rows),
        "",
        "Every file, sorted by bits per weight (the ladder's table):\n",
        *ladders.format_table(table, list(settings)),
        "",
    ]
    if with_plot:
        md.append("![bits per weight against mean KLD](recipe.png)\n")
    with atomic_write(out / "recipe.md", "w") as f:
        f.write("\n".join(md))
    if with_plot:
        ladders.plot(table, list(settings), out / "recipe.png")


__all__ = ["STOCK", "Versus", "format_versus", "recipe_name", "study", "versus", "write"]
