"""``qllama recipe``: each tensor group's type chosen at a bits-per-weight budget."""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING

from qllama.cli.common import Subparsers, require_module

if TYPE_CHECKING:
    from qllama.ggml_types import GGMLType
    from qllama.recipe.recipe import Recipe


def add_parser(sub: Subparsers) -> None:
    """The subcommand and its arguments."""
    s = sub.add_parser(
        "recipe",
        help="the file of least measured KL divergence at a bits-per-weight budget, as "
        "llama-quantize --tensor-type overrides",
    )
    s.add_argument("model", help="the F32 GGUF (or a name qllama fetch knows)")
    s.add_argument(
        "--target-bpw", type=float, required=True, help="the budget: bits per weight, at most"
    )
    s.add_argument("-o", "--out", required=True, help="the recipe's GGUF (and OUT.* beside it)")
    s.add_argument("--imatrix", help="an importance matrix file, for every candidate type")
    s.add_argument("--bands", type=int, default=3, help="layer bands: a group is a kind x a band")
    s.add_argument(
        "--types", help="comma-separated candidate types (default: Q2_K ... Q8_0, see the docs)"
    )
    s.add_argument("--corpus", default="botchan", help="the packaged corpus")
    s.add_argument("--ctx", type=int, default=512, help="the windows' length")
    s.add_argument(
        "--chunks",
        type=int,
        default=16,
        help="the held-out windows (the corpus's first; the comparison scores them)",
    )
    s.add_argument(
        "--calibration-chunks",
        type=int,
        default=2,
        help="the windows after the held-out ones that the sensitivities are measured on",
    )
    s.add_argument(
        "--compare",
        action="store_true",
        help="measure the recipe on the held-out windows beside the stock mixtures",
    )
    s.add_argument(
        "--stock",
        default="Q3_K_M,Q4_K_S,Q4_K_M,IQ4_XS,Q5_K_M",
        help="the stock mixtures compared with",
    )
    s.add_argument(
        "--setting",
        action="append",
        choices=["dequantize-all", "cpu"],
        help="the comparison's arithmetic (repeatable; default dequantize-all, the "
        "sensitivities' own)",
    )
    s.add_argument("--threads", type=int, help="threads of the forward passes")
    s.add_argument("--executor", choices=["local", "process", "dask"], default="process")
    s.add_argument("--workers", type=int, help="processes or local Dask workers (default: cores)")
    s.add_argument("--results", default="results", help="the comparison's cache of cells")
    s.add_argument("--report", default="recipe", help="where recipe.md, .json and .png go")
    s.add_argument("--no-plot", action="store_true", help="the table and JSON only")
    s.add_argument("--cache", help="qllama's cache folder (default: the user cache)")
    s.set_defaults(run=run, check=check)


def check(args: argparse.Namespace) -> None:
    """Before any work: numbers in range, the matrix file there, the packages needed."""
    import math
    import os

    from qllama.errors import QllamaError

    if not (math.isfinite(args.target_bpw) and args.target_bpw > 0):
        raise QllamaError(f"--target-bpw must be a positive number, not {args.target_bpw}")
    for name in ("bands", "ctx", "chunks", "calibration_chunks"):
        if getattr(args, name) < 1:
            raise QllamaError(f"--{name.replace('_', '-')} must be at least 1")
    if args.imatrix and not os.path.isfile(args.imatrix):
        raise QllamaError(f"no importance matrix file {args.imatrix}")
    if args.types:
        _types(args.types)
    if args.compare and not args.no_plot:
        require_module("matplotlib", "plot", "the comparison's plot (--no-plot: none)")
    if args.executor == "dask":
        require_module("distributed", "dask", "--executor dask")


def _types(text: str) -> list[GGMLType]:
    from qllama.gguf.quantizer import ggml_type_named

    return [ggml_type_named(t.strip(), "--types") for t in text.split(",") if t.strip()]


def _say(text: str) -> None:
    print(text, file=sys.stderr, flush=True)


def run(args: argparse.Namespace) -> int:
    """Measure (or read) the sensitivities, choose, write the file; then, with --compare,
    measure it beside the stock mixtures on the held-out windows."""
    from qllama.measure import sensitivity
    from qllama.recipe import recipe as recipes
    from qllama.study.declaration import Variant
    from qllama.study.variants import build

    t0 = time.perf_counter()
    f32 = build(args.model, Variant("F32"), cache=args.cache).path
    calibration = sensitivity.Calibration(
        corpus=f"corpus:{args.corpus}",
        n_ctx=args.ctx,
        skip=args.chunks,
        n_windows=args.calibration_chunks,
    )

    def progress(done: int, total: int, what: str) -> None:
        _say(f"recipe: sensitivity {done}/{total}: {what} ({time.perf_counter() - t0:.0f} s)")

    sens = sensitivity.measure(
        f32,
        bands=args.bands,
        types=_types(args.types) if args.types else None,
        imatrix=args.imatrix,
        calibration=calibration,
        cache=args.cache,
        threads=args.threads,
        progress=progress,
    )
    recipe = recipes.choose(sens, args.target_bpw)
    _say(
        f"recipe: {recipe.bpw:.4f} bits per weight (target {args.target_bpw:g}; reachable "
        f"{recipe.reachable_bpw[0]:.4f} to {recipe.reachable_bpw[1]:.4f}), predicted mean KLD "
        f"{recipe.predicted_kld:.3e} on {sens.windows['positions']} calibration positions"
    )
    written = recipes.write(recipe, args.out, imatrix=args.imatrix)
    measured, unc = sensitivity.whole(args.out, sens, threads=args.threads)
    print(
        f"wrote {written['gguf']} ({recipe.bpw:.4f} bpw), {written['tensor_types'].name} "
        f"(llama-quantize --tensor-type-file), {written['json'].name}"
    )
    print(
        f"calibration windows: predicted mean KLD {recipe.predicted_kld:.3e} (sum of the "
        f"groups'), measured whole {measured:.3e} ± {unc:.1e}"
    )
    for g in recipe.groups:
        print(f"  {g.name:<28} {recipe.types[g.name].name}")
    print("llama-quantize makes the same file with:\n  " + recipe.command(args.out, args.imatrix))
    if not args.compare:
        return 0
    return _compare(args, f32, recipe, written["gguf"], measured)


def _compare(
    args: argparse.Namespace, f32: str, recipe: Recipe, file: Path, measured: float
) -> int:
    """The recipe's ``file`` (as written, whole-file mean KLD ``measured`` on the
    calibration windows) beside the stock mixtures on the held-out windows (a ladder
    study)."""
    from qllama.recipe import compare
    from qllama.study import Options
    from qllama.study import ladder as ladders
    from qllama.study.runner import build_variants, execute

    settings = args.setting or ["dequantize-all"]
    study, rungs = compare.study(
        f32,
        [recipe],
        imatrix=args.imatrix,
        stock=args.stock.split(","),
        corpus=args.corpus,
        chunks=args.chunks,
        n_ctx=args.ctx,
        settings=settings,
        threads=args.threads or 1,
        files={compare.recipe_name(recipe): file},
    )
    options = Options(
        results=Path(args.results), executor=args.executor, workers=args.workers, cache=args.cache
    )
    status, data = execute(study, options)
    if data is None:
        return status
    paths = {name: v.path for name, v in build_variants(study, cache=args.cache).items()}
    table = ladders.rows(study, rungs, data, paths)
    calibration = {compare.recipe_name(recipe): measured}
    rows = [v for s in settings for v in compare.versus(table, [recipe], s, calibration)]
    about = (
        f"Held out: the first {args.chunks} windows of {args.ctx} tokens of `{args.corpus}` "
        f"(the second half of each scored); the sensitivities were measured on the "
        f"{args.calibration_chunks} windows after them. Settings: {', '.join(settings)}. "
        "Noise: the two standard errors in quadrature (plus the draws' spread under cpu); "
        "a gain beyond twice that is marked."
    )
    plot = not args.no_plot
    compare.write(args.report, table, rows, [recipe], settings, about=about, with_plot=plot)
    print("\n".join(compare.format_versus(rows)))
    print(f"wrote {args.report}/recipe.md, recipe.json" + ("" if args.no_plot else ", recipe.png"))
    return 0
