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
    s.add_argument(
        "--tensor-type",
        action="append",
        metavar="NAME=TYPE",
        help="as llama-quantize: tensors whose name has the pattern NAME get TYPE (repeatable; "
        "the first match wins)",
    )
    s.add_argument("--token-embedding-type", metavar="TYPE", help="token_embd's type")
    s.add_argument("--output-tensor-type", metavar="TYPE", help="output.weight's type")
    s.add_argument("--pure", action="store_true", help="no mixture: the file type's type")
    s.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    """Quantize, each tensor on stderr as it goes, and say what was written."""
    from qllama.ggml_types import file_type_name
    from qllama.gguf.quantizer import Overrides, file_type, plan_with_fallbacks, quantize_file
    from qllama.gguf.reader import read_gguf
    from qllama.version import __version__

    overrides = Overrides.parse(
        args.tensor_type or (),
        token_embedding_type=args.token_embedding_type,
        output_tensor_type=args.output_tensor_type,
        pure=args.pure,
    )
    with read_gguf(args.input) as f:  # read once: planned here, then quantized
        _, fallbacks = plan_with_fallbacks(
            f, args.type, imatrix=args.imatrix is not None, overrides=overrides
        )
        source = file_type_name(
            f.kv["general.file_type"].value if "general.file_type" in f.kv else None
        )
        print(
            f"qllama {__version__}: {args.input} ({source}) to {file_type(args.type).label} "
            "by llama-quantize's rules, "
            f"{'with' if args.imatrix else 'without'} an importance matrix",
            file=sys.stderr,
            flush=True,
        )

        def fallback_note(t: Any) -> str:
            chosen, written = fallbacks[t.name]
            return (
                f"rows of {t.ne[0]} are not a multiple of {chosen.name}'s "
                f"{chosen.block.block_size}: fallback {written.name}"
            )

        def progress(i: int, n: int, t: Any, new: Any) -> None:
            if not args.quiet:
                note = f"  ({fallback_note(t)})" if t.name in fallbacks else ""
                line = f"[{i + 1:>4}/{n}] {t.name:<32} {t.ggml_type.name:>5} -> {new.name:<5}"
                print((line + note).rstrip(), file=sys.stderr, flush=True)
            elif t.name in fallbacks:  # quiet: the fallbacks still, one line each
                print(f"{t.name}: {fallback_note(t)}", file=sys.stderr, flush=True)

        result = quantize_file(
            f,
            args.output,
            args.type,
            imatrix=args.imatrix,
            progress=progress,
            overrides=overrides,
        )
    counts = ", ".join(f"{n} {k}" for k, n in sorted(result.counts.items(), key=lambda kv: -kv[1]))
    print(
        f"wrote {result.path}: {result.file_type.label}, {counts}; "
        f"tensor data {result.bytes_in / 2**20:.1f} MiB -> {result.bytes_out / 2**20:.1f} MiB"
    )
    if fallbacks:
        print(
            f"{len(fallbacks)} of {len(result.types)} tensors fell back to another type "
            "(their rows do not divide into the chosen type's blocks), as llama-quantize does",
            file=sys.stderr,
        )
    if result.without_imatrix:
        print(
            f"{len(result.without_imatrix)} tensor(s) had no importance matrix entry and were "
            f"quantized without one: {', '.join(result.without_imatrix[:5])}"
            + (", ..." if len(result.without_imatrix) > 5 else ""),
            file=sys.stderr,
        )
    return 0
