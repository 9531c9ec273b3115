"""``qllama imatrix``: an importance matrix over a corpus, as llama-imatrix computes it."""

from __future__ import annotations

import argparse
import sys

from qllama.cli.common import Subparsers, add_backend_args, announce, backend_options


def add_parser(sub: Subparsers) -> None:
    """The subcommand and its arguments."""
    s = sub.add_parser(
        "imatrix", help="compute an importance matrix over a corpus, as llama-imatrix does"
    )
    s.add_argument("model")
    s.add_argument("--text", "-f", required=True, help="the corpus, a UTF-8 text file")
    s.add_argument("-o", "--output", default="imatrix.gguf", help="default: imatrix.gguf")
    s.add_argument("--ctx", "-c", type=int, default=512, help="tokens a chunk (default 512)")
    s.add_argument("--chunks", type=int, help="at most this many chunks (default: all)")
    s.add_argument(
        "--chunk", type=int, default=0, help="start from chunk N, as llama-imatrix (default 0)"
    )
    s.add_argument(
        "--output-format", choices=["gguf", "dat"], help="default: gguf (dat for a .dat name)"
    )
    s.add_argument(
        "--process-output", action="store_true", help="collect output.weight's activations too"
    )
    s.add_argument("-q", "--quiet", action="store_true", help="no per-chunk progress")
    add_backend_args(s)
    s.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    """Collect the activations chunk by chunk, write the matrix, say what was written."""
    from qllama.backends import get_backend
    from qllama.gguf.imatrix import write_imatrix
    from qllama.measure.importance import from_corpus

    with open(args.text, encoding="utf-8", errors="replace") as fh:
        text = fh.read()

    def progress(i: int, n: int) -> None:
        if not args.quiet:
            print(f"[chunk {i + 1}/{n}]", file=sys.stderr, flush=True)

    options = backend_options(args)
    name = options.pop("backend")
    backend = get_backend(name, **options)
    announce(backend)
    m = from_corpus(
        args.model,
        text,
        backend=backend,
        n_ctx=args.ctx,
        n_chunks=args.chunks,
        skip_chunks=args.chunk,
        process_output=args.process_output,
        dataset=args.text,
        progress=progress,
    )
    write_imatrix(args.output, m, fmt=args.output_format)
    print(
        f"wrote {args.output}: {len(m.entries)} entries, {m.chunk_count} chunks of "
        f"{m.chunk_size} tokens"
    )
    return 0
