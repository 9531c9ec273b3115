"""``qllama serve``: models served over an OpenAI-compatible HTTP API."""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence

from qllama.cli.common import Subparsers, add_backend_args, announce, backend_options
from qllama.errors import QllamaError


def add_parser(sub: Subparsers) -> None:
    """The subcommand and its arguments."""
    s = sub.add_parser("serve", help="serve models over an OpenAI-compatible HTTP API")
    s.add_argument("file", nargs="+", help="GGUF files, as FILE or NAME=FILE (the API's model)")
    add_backend_args(s)
    s.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1)")
    s.add_argument("--port", type=int, default=8000, help="port (0: any free one; printed)")
    s.add_argument("--api-key", help="every request needs Authorization: Bearer KEY")
    s.add_argument("--api-key-file", help="read the key from this file")
    s.add_argument("--max-sequences", type=int, default=8, help="sequences decoded together")
    s.add_argument("--max-queue", type=int, default=64, help="sequences waiting (more: 429)")
    s.add_argument("--max-tokens", type=int, default=4096, help="largest max_tokens allowed")
    s.add_argument("--ctx", type=int, help="context length (default: each model's)")
    s.add_argument(
        "--model-dir",
        action="append",
        default=[],
        help="folder /v1/models/load may read (repeatable; default: the FILEs' folders)",
    )
    s.add_argument("--no-prefix-cache", action="store_true", help="never reuse a cached prefix")
    s.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    s.set_defaults(run=run)


def named_files(specs: Sequence[str]) -> dict[str, str]:
    """``NAME=FILE`` or ``FILE`` (named by its stem) -> {name: file}; names are unique."""
    from pathlib import Path

    out: dict[str, str] = {}
    for spec in specs:
        name, sep, path = spec.partition("=")
        if not sep or not name or os.path.exists(spec):
            name, path = Path(spec).stem, spec
        if name in out:
            raise QllamaError(f"two models are named {name!r}; name them with NAME=FILE")
        out[name] = path
    return out


def run(args: argparse.Namespace) -> int:
    """Bind, load the models, serve until stopped."""
    import logging
    from pathlib import Path

    try:
        from qllama import serve
    except ImportError as e:
        raise QllamaError(
            f"qllama serve needs its extra: pip install 'qllama[serve]' ({e})"
        ) from None

    key = args.api_key
    if args.api_key_file:
        key = Path(args.api_key_file).read_text().strip()
    if args.host not in ("127.0.0.1", "localhost", "::1") and not key:
        print(
            f"qllama serve: warning: listening on {args.host} without --api-key: anyone who "
            "can reach it can use it",
            file=sys.stderr,
        )
    limits = serve.Limits(
        max_sequences=args.max_sequences,
        max_queue=args.max_queue,
        max_tokens=args.max_tokens,
        prefix_caches=0 if args.no_prefix_cache else None,
    )
    options = backend_options(args)
    if args.ctx:
        options["n_ctx"] = args.ctx
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(name)s %(message)s")
    sock = serve.bind(args.host, args.port)
    try:
        dirs = [Path(d) for d in args.model_dir] or None
        registry = serve.open_models(named_files(args.file), allowed_dirs=dirs, **options)
        app = serve.create_app(registry, limits=limits, api_key=key, load_defaults=options)
        host, port = sock.getsockname()[:2]
        names = ", ".join(registry.names())
        for entry in registry.entries():
            if entry.model is not None:
                announce(entry.model.backend, f"qllama serve: {entry.name}")
        print(f"qllama serve: {names} on http://{host}:{port}", file=sys.stderr, flush=True)
        serve.serve_forever(app, sock, log_level=args.log_level)
    finally:
        sock.close()
    return 0
