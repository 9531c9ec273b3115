"""``qllama study``: a study declared in a TOML file run (or its cells listed)."""

from __future__ import annotations

import argparse

from qllama.cli.common import Subparsers, require_module


def add_parser(sub: Subparsers) -> None:
    """The subcommand and its arguments."""
    s = sub.add_parser("study", help="run a study declared in a TOML file (docs/studies.md)")
    s.add_argument("action", choices=["run", "cells"], help="run it, or list its cells")
    s.add_argument("study", help="the study's TOML file")
    s.add_argument(
        "--cells", action="append", metavar="PATTERN", help="only cells matching (repeatable)"
    )
    s.add_argument("--executor", choices=["local", "process", "dask"], default="process")
    s.add_argument("--workers", type=int, help="processes or local Dask workers (default: cores)")
    s.add_argument(
        "--scheduler", metavar="ADDRESS", help="a Dask scheduler (default: a local cluster)"
    )
    s.add_argument("--results", default="results", help="the cache of references and cells")
    s.add_argument("--docs", help="where results.md, results.json and plots/ go")
    s.add_argument("--draw", action="append", metavar="NAME", help="switch on an optional draw")
    s.add_argument(
        "--prompt",
        action="append",
        metavar="NAME",
        help="only this prompt's references, cells and findings (repeatable)",
    )
    s.add_argument("--threads", type=int, help="every cell's threads (default: the study's)")
    s.add_argument("--force", action="store_true", help="rerun cells even if cached")
    s.add_argument("--report-only", action="store_true", help="rebuild the report from the cache")
    s.add_argument("--references-only", action="store_true", help="only compute the references")
    s.set_defaults(run=run, check=check)


def check(args: argparse.Namespace) -> None:
    """Before any work: the executor's package."""
    if args.action == "run" and args.executor == "dask":
        require_module("distributed", "dask", "--executor dask")


def run(args: argparse.Namespace) -> int:
    """Run the study (its exit status), or print the ids of its cells."""
    from pathlib import Path

    from qllama.study import Options, load_study
    from qllama.study import run as run_study
    from qllama.study.cells import product, select
    from qllama.study.declaration import with_draws, with_prompts

    study = with_prompts(with_draws(load_study(args.study), args.draw or []), args.prompt or [])
    if args.threads is not None:
        from dataclasses import replace

        study = replace(study, threads=args.threads)
    if args.action == "cells":
        for cell in select(product(study), args.cells or []):
            print(cell.id)
        return 0
    options = Options(
        results=Path(args.results),
        docs=Path(args.docs) if args.docs else None,
        executor=args.executor,
        workers=args.workers,
        scheduler=args.scheduler,
        patterns=tuple(args.cells or ()),
        force=args.force,
        report_only=args.report_only,
        references_only=args.references_only,
    )
    return run_study(study, options)
