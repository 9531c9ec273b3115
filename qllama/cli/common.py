"""What several subcommands share: backend options, the chat prompt, JSON output."""

from __future__ import annotations

import argparse
import importlib.util
import json
import sys
from typing import Any, TypeAlias

from qllama.errors import QllamaError

# argparse names no public type for what add_subparsers returns
Subparsers: TypeAlias = "argparse._SubParsersAction[argparse.ArgumentParser]"


def kv_spec(value: str) -> str:
    """``--kv``'s value, checked (:mod:`qllama.runtime.kv_types`)."""
    from qllama.errors import BackendError
    from qllama.runtime.kv_types import parse

    try:
        parse(value)
    except BackendError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    return value


KV_HELP = (
    "KV cache: f32 (default), f16, f16-flash, or llama.cpp's -ctk/-ctv as K/V, ',fa' for flash "
    "attention, ',fa=N' with llama.cpp's N threads (e.g. q8_0/q4_0,fa; types f32 f16 bf16 q8_0 "
    "q4_0 q4_1 iq4_nl q5_0 q5_1; numpy)"
)


def add_backend_args(s: argparse.ArgumentParser, *, kv: bool = True) -> None:
    """``--backend``, ``--device``, ``--dequantize-all``, ``--activations`` and (unless the
    command declares its own) ``--kv``."""
    s.add_argument("--backend", help="numpy | torch | jax | array_api_strict (default: numpy)")
    s.add_argument("--device", help="cpu | cuda | mps (default: the backend's)")
    s.add_argument(
        "--dequantize-all", action="store_true", help="widen every weight to f32 at load"
    )
    s.add_argument(
        "--activations", choices=["q8", "f32"], help="numpy: CPU (q8) or GPU (f32) arithmetic"
    )
    if kv:
        s.add_argument("--kv", type=kv_spec, help=KV_HELP)


def backend_options(args: argparse.Namespace) -> dict[str, Any]:
    """The :func:`qllama.load` options that :func:`add_backend_args` parsed (those set)."""
    options: dict[str, Any] = {"backend": args.backend, "device": args.device}
    if args.dequantize_all:
        options["dequantize_all"] = True
    if args.activations:
        options["activations"] = args.activations
    if getattr(args, "kv", None):
        options["kv_precision"] = args.kv
    return options


def announce(backend: Any, what: str = "") -> None:
    """The first line of a command that computes: qllama's version, what it runs on (backend,
    device, arithmetic, kernels, threads), on stderr."""
    from qllama.backends.base import describe
    from qllama.version import __version__

    lead = f"{what}: " if what else ""
    print(f"{lead}qllama {__version__}, {describe(backend)}", file=sys.stderr, flush=True)


def require_module(module: str, extra: str, why: str) -> None:
    """Refuse, before any work, an option whose optional package is not installed."""
    if importlib.util.find_spec(module) is None:
        raise QllamaError(f"{why} needs {module}: pip install 'qllama[{extra}]'")


def add_chat_arg(s: argparse.ArgumentParser) -> None:
    """``--chat``: the prompt as a user turn of the file's chat template."""
    s.add_argument("--chat", action="store_true", help="wrap the prompt in the chat template")


def chat_ids(model: Any, prompt: str) -> list[int]:
    """``prompt`` as the one user turn of the model's chat template, as token ids."""
    return model.apply_chat_template([{"role": "user", "content": prompt}])


def prompt_ids(path: str, prompt: str, chat: bool) -> tuple[list[int], list[int]]:
    """The prompt's ids with the file's tokenizer (and chat template), and its stop ids."""
    from qllama.runtime.loader import load

    model = load(path, check_weights=False)
    ids = chat_ids(model, prompt) if chat else model.tokenizer.encode(prompt)
    stops = sorted(model.tokenizer.stop_ids)
    model.source.close()
    return list(ids), stops


def add_json_arg(s: argparse.ArgumentParser) -> None:
    """``--json PATH``: every number of the run, written to a file."""
    s.add_argument("--json", help="write every number here")


def write_json(path: str, doc: dict[str, Any]) -> None:
    """Write ``doc`` to ``path`` (whole or not at all) and say so."""
    from qllama.atomic import atomic_write

    with atomic_write(path, "w") as f:
        json.dump(doc, f, indent=1)
    print(f"wrote {path}")


__all__ = [
    "KV_HELP",
    "Subparsers",
    "add_backend_args",
    "add_chat_arg",
    "add_json_arg",
    "announce",
    "backend_options",
    "chat_ids",
    "kv_spec",
    "prompt_ids",
    "require_module",
    "write_json",
]
