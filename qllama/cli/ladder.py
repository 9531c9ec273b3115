"""``qllama ladder``: every file type of one F32 model, measured, sorted by size."""

from __future__ import annotations

import argparse
import sys

from qllama.cli.common import Subparsers, kv_spec, require_module


def add_parser(sub: Subparsers) -> None:
    """The subcommand and its arguments."""
    s = sub.add_parser(
        "ladder", help="every file type of an F32 model, measured and sorted by bits per weight"
    )
    s.add_argument("model", nargs="?", help="the F32 GGUF (or a name qllama fetch knows)")
    s.add_argument(
        "--types", help="comma-separated file types (default: every one qllama's quantizer makes)"
    )
    s.add_argument(
        "--imatrix-corpus",
        default="corpus:botchan",
        help="each type again with an importance matrix from this text ('none': no matrix)",
    )
    s.add_argument("--imatrix-chunks", type=int, default=16, help="its windows of 512 tokens")
    s.add_argument("--corpus", default="botchan", help="the packaged corpus measured")
    s.add_argument("--chunks", type=int, default=16, help="the corpus's windows")
    s.add_argument("--ctx", type=int, default=512, help="the corpus's window length")
    s.add_argument(
        "--draw",
        action="append",
        help="the CPU arithmetic's noise band: avx2, sse (repeatable; default both; 'none')",
    )
    s.add_argument(
        "--reference",
        choices=["qllama", "transformers"],
        default="qllama",
        help="who computes the F32 file's logits: qllama's dequantize-all, or transformers",
    )
    s.add_argument(
        "--control",
        choices=["dither", "gaussian"],
        help="measure a control of the model instead: its weights off their grid "
        "(qllama.study.controls; written once under RESULTS/controls)",
    )
    s.add_argument(
        "--kv",
        action="append",
        type=kv_spec,
        help="also the CPU arithmetic with this llama.cpp KV cache (K/V[,fa], e.g. q8_0/q4_0,fa;"
        " repeatable): a column group each",
    )
    s.add_argument("--threads", type=int, default=1, help="every cell's threads")
    s.add_argument("--executor", choices=["local", "process", "dask"], default="process")
    s.add_argument("--workers", type=int, help="processes or local Dask workers (default: cores)")
    s.add_argument("--scheduler", metavar="ADDRESS", help="a Dask scheduler")
    s.add_argument("--results", default="results", help="the cache of references and cells")
    s.add_argument("--out", default="ladder", help="where ladder.md, .json and .png go")
    s.add_argument("--no-plot", action="store_true", help="the table and JSON only")
    s.add_argument(
        "--write-study", metavar="TOML", help="write the ladder's declaration here and stop"
    )
    s.add_argument("--study", metavar="TOML", help="run a ladder declaration (an edited one)")
    s.set_defaults(run=run, check=check)


def check(args: argparse.Namespace) -> None:
    """Before any work: a model or a declaration, and the packages the run needs."""
    from qllama.errors import QllamaError

    if (args.model is None) == (args.study is None):
        raise QllamaError("give the F32 model, or --study with a ladder declaration")
    if args.control and args.study:
        raise QllamaError("--control makes a ladder of its own: give the model, not --study")
    if not args.no_plot and not args.write_study:
        require_module("matplotlib", "plot", "the ladder's plot (--no-plot: none)")
    if args.reference == "transformers":
        require_module("transformers", "reference", "--reference transformers")
    if args.executor == "dask":
        require_module("distributed", "dask", "--executor dask")


def run(args: argparse.Namespace) -> int:
    """Declare the ladder (or read it), run its cells, write its table, JSON and plot."""
    from pathlib import Path

    from qllama.study import Options, load_study
    from qllama.study import ladder as ladders
    from qllama.study.declaration import to_toml
    from qllama.study.runner import build_variants, execute
    from qllama.study.variants import build

    if args.study:
        study = load_study(args.study)
        ladders.check_ladder(study)
        f32 = build(study.model_source(), study.variant("F32")).path
        made = [v.type for v in study.variants if v.name != "F32"]
        ladder = ladders.rungs(f32, list(dict.fromkeys(made)), imatrix=True)
    else:
        f32 = build(args.model, ladders.Variant("F32")).path
        model = args.model
        if args.control:
            from qllama.study.controls import control_file

            f32 = str(control_file(f32, args.control, Path(args.results) / "controls"))
            model = f32
        draws = [d for d in (args.draw or ["avx2", "sse"]) if d != "none"]
        corpus = None if args.imatrix_corpus == "none" else args.imatrix_corpus
        types = args.types.split(",") if args.types else None
        study, ladder = ladders.ladder_study(
            model,
            types=types,
            imatrix_corpus=corpus,
            imatrix_chunks=args.imatrix_chunks,
            corpus=args.corpus,
            chunks=args.chunks,
            n_ctx=args.ctx,
            draws=draws,
            reference=args.reference,
            threads=args.threads,
            f32_path=f32,
            kv=args.kv or (),
        )
    for r in ladder:
        if r.reason:
            print(f"ladder: {r.type} skipped: {r.reason}", file=sys.stderr)
    if args.write_study:
        from qllama.atomic import atomic_write

        with atomic_write(args.write_study, "w") as f:
            f.write(to_toml(study))
        print(
            f"wrote {args.write_study}: {len(study.variants)} files, {len(study.settings)} settings"
        )
        return 0
    options = Options(
        results=Path(args.results),
        executor=args.executor,
        workers=args.workers,
        scheduler=args.scheduler,
    )
    status, data = execute(study, options)
    if data is None:
        return status
    paths = {name: v.path for name, v in build_variants(study).items()}
    table = ladders.write(study, ladder, data, paths, Path(args.out), with_plot=not args.no_plot)
    print("\n".join(ladders.format_table(table, [s.name for s in study.settings])))
    print(f"wrote {args.out}/ladder.md, ladder.json" + ("" if args.no_plot else ", ladder.png"))
    return 0
