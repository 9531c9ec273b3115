"""``qllama fetch``: a known model file downloaded into the cache, its path printed."""

from __future__ import annotations

import argparse

from qllama.cli.common import Subparsers


def add_parser(sub: Subparsers) -> None:
    """The subcommand and its arguments."""
    from qllama.model_files import MODELS

    s = sub.add_parser("fetch", help="download a known model file into the cache")
    s.add_argument("name", help="one of: " + ", ".join(MODELS))
    s.add_argument("--cache", help="cache folder (default $QLLAMA_CACHE or the user cache)")
    s.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    """Fetch (or find cached) and print the file's path."""
    from qllama.model_files import fetch

    print(fetch(args.name, cache=args.cache))
    return 0
