"""``qllama quantize``: a GGUF file quantized to a file type, as llama-quantize does."""

from __future__ import annotations

import argparse
import sys
from typing import Any

from qllama.cli.common import Subparsers


def add_parser(sub: Subparsers) -> None:
    """The subcommand and its arguments."""
    from qllama.gguf.quantizer import FILE_TYPES

    s = sub.add_parser("quantize", help="quantize a GGUF file as llama-quantize does")
    s.add_argument("input")
    s.add_argument("output")
    s.add_argument("type", metavar="TYPE", help="file type: " + ", ".join(FILE_TYPES))
    s.add_argument("-q", "--quiet", action="store_true", help="no per-tensor progress")
    s.add_argument(
        "--imatrix", help="an importance matrix (GGUF or legacy .dat), as llama-quantize's"
    )
    s.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    """Quantize, each tensor on stderr as it goes, and say what was written."""
    from qllama.gguf.quantizer import quantize_file

    def progress(i: int, n: int, t: Any, new: Any) -> None:
        if not args.quiet:
            print(
                f"[{i + 1:>4}/{n}] {t.name:<32} {t.ggml_type.name:>5} -> {new.name:<5}",
                file=sys.stderr,
                flush=True,
            )

    result = quantize_file(
        args.input, args.output, args.type, imatrix=args.imatrix, progress=progress
    )
    counts = ", ".join(f"{n} {k}" for k, n in sorted(result.counts.items(), key=lambda kv: -kv[1]))
    print(
        f"wrote {result.path}: {result.file_type.label}, {counts}; "
        f"tensor data {result.bytes_in / 2**20:.1f} MiB -> {result.bytes_out / 2**20:.1f} MiB"
    )
    if result.without_imatrix:
        print(
            f"{len(result.without_imatrix)} tensor(s) had no importance matrix entry and were "
            f"quantized without one: {', '.join(result.without_imatrix[:5])}"
            + (", ..." if len(result.without_imatrix) > 5 else ""),
            file=sys.stderr,
        )
    return 0
