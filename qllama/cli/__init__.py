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
from typing import Any

from qllama.cli import (
    attribute,
    compare,
    fetch,
    generate,
    imatrix,
    inspect,
    ladder,
    moefy,
    perplexity,
    quantize,
    recipe,
    serve,
    study,
    trace,
)
from qllama.errors import QllamaError
from qllama.version import __version__

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
    ladder,
    recipe,
    moefy,
    generate,
    perplexity,
    serve,
)


def _no_default(value: object) -> bool:
    # identity, not ==: a default of 0 is a default worth showing, False (a flag) is not
    return value is None or value is False or value is argparse.SUPPRESS


class DefaultsFormatter(argparse.HelpFormatter):
    """Each option's help ends with its default, where it has one its help does not state."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        text = action.help or ""
        default = action.default
        if _no_default(default) or "default" in text or not action.option_strings:
            return text
        return f"{text} (default: %(default)s)" if text else "default: %(default)s"


class SubcommandParser(argparse.ArgumentParser):
    """A subcommand's parser: its help shows defaults, and it remembers itself in its
    namespace so that an argument it does not know is reported with its usage, not the
    top level's."""

    def __init__(self, *args: object, **kwargs: object) -> None:
        kwargs.setdefault("formatter_class", DefaultsFormatter)
        super().__init__(*args, **kwargs)  # type: ignore[arg-type]
        self.set_defaults(parser=self)

    def add_argument(self, *args: Any, **kwargs: Any) -> argparse.Action:
        # argparse formats no help at all for an option without one: give it its default
        if kwargs.get("help") is None and not _no_default(kwargs.get("default")):
            kwargs["help"] = "default: %(default)s"
        return super().add_argument(*args, **kwargs)


def build_parser() -> argparse.ArgumentParser:
    """The ``qllama`` parser: each subcommand's arguments, and its ``run`` as ``args.run``."""
    p = argparse.ArgumentParser(prog="qllama", description="Quantized GGUF inference, measured.")
    p.add_argument("--version", action="version", version=f"qllama {__version__}")
    sub = p.add_subparsers(
        dest="command", required=True, metavar="COMMAND", parser_class=SubcommandParser
    )
    for command in COMMANDS:
        command.add_parser(sub)
    return p


def parse(argv: Sequence[str] | None = None) -> argparse.Namespace:
    """``argv`` parsed; an unknown argument is the subcommand's error, shown with its usage."""
    args, unknown = build_parser().parse_known_args(argv)
    if unknown:
        args.parser.error(f"unrecognized arguments: {' '.join(unknown)}")
    check = getattr(args, "check", None)
    if check is not None:  # what the run will need (an optional package...), before any work
        try:
            check(args)
        except QllamaError as e:
            args.parser.error(str(e))
    return args


def main(argv: Sequence[str] | None = None) -> int:
    """Parse ``argv`` (default: the process's), run the subcommand, return its exit status."""
    args = parse(argv)
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


__all__ = [
    "COMMANDS",
    "EXIT_ERROR",
    "EXIT_INTERRUPTED",
    "DefaultsFormatter",
    "SubcommandParser",
    "build_parser",
    "main",
    "parse",
]
