"""The ``qllama`` command line: the parser, built from one module per subcommand, and
:func:`main`.

Every subcommand is a thin layer over the library (``add_parser`` declares its arguments,
``run`` calls the library and prints); errors end the process with one readable line on
stderr and a non-zero status, never a traceback.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from qllama.cli import (
    attribute,
    compare,
    fetch,
    generate,
    imatrix,
    inspect,
    perplexity,
    quantize,
    serve,
    study,
    trace,
)
from qllama.errors import QllamaError

EXIT_ERROR = 1
EXIT_INTERRUPTED = 130

# in the order --help lists them
COMMANDS = (
    inspect,
    quantize,
    imatrix,
    fetch,
    compare,
    trace,
    attribute,
    study,
    generate,
    perplexity,
    serve,
)


def build_parser() -> argparse.ArgumentParser:
    """The ``qllama`` parser: each subcommand's arguments, and its ``run`` as ``args.run``."""
    p = argparse.ArgumentParser(prog="qllama", description="Quantized GGUF inference, measured.")
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for command in COMMANDS:
        command.add_parser(sub)
    return p


def main(argv: Sequence[str] | None = None) -> int:
    """Parse ``argv`` (default: the process's), run the subcommand, return its exit status."""
    args = build_parser().parse_args(argv)
    try:
        return int(args.run(args))
    except QllamaError as e:
        print(f"qllama {args.command}: error: {e}", file=sys.stderr)
        return EXIT_ERROR
    except BrokenPipeError:  # output piped into head and friends
        return 0
    except OSError as e:
        where = f": {e.filename}" if e.filename else ""
        print(f"qllama {args.command}: error: {e.strerror or e}{where}", file=sys.stderr)
        return EXIT_ERROR
    except KeyboardInterrupt:
        print(f"qllama {args.command}: interrupted", file=sys.stderr)
        return EXIT_INTERRUPTED


__all__ = ["COMMANDS", "EXIT_ERROR", "EXIT_INTERRUPTED", "build_parser", "main"]
