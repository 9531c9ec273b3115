"""``qllama generate``: text generated from a prompt, streamed to stdout."""

from __future__ import annotations

import argparse
import sys

from qllama.cli.common import (
    Subparsers,
    add_backend_args,
    add_chat_arg,
    announce,
    backend_options,
    chat_ids,
)


def add_parser(sub: Subparsers) -> None:
    """The subcommand and its arguments."""
    s = sub.add_parser("generate", help="generate text, streamed to stdout")
    s.add_argument("file")
    s.add_argument("--prompt", required=True, help="the prompt text")
    add_chat_arg(s)
    add_backend_args(s)
    s.add_argument("--max-new-tokens", type=int, default=256)
    s.add_argument("--temperature", type=float, default=0.0, help="0 (default) is greedy")
    s.add_argument("--top-k", type=int, default=0)
    s.add_argument("--top-p", type=float, default=1.0)
    s.add_argument("--seed", type=int)
    s.add_argument("--stop", action="append", help="stop at this text (repeatable)")
    s.add_argument("--ctx", type=int, help="context length (default: the model's)")
    s.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    """Stream the continuation piece by piece as it is decoded."""
    from qllama.runtime.generation import Generation, stream
    from qllama.runtime.loader import load

    model = load(args.file, n_ctx=args.ctx, **backend_options(args))
    announce(model.backend)
    prompt: str | list[int] = chat_ids(model, args.prompt) if args.chat else args.prompt
    out = Generation(prompt_ids=[])
    for piece in stream(
        model,
        prompt,
        out,
        max_new_tokens=args.max_new_tokens,
        temperature=args.temperature,
        top_k=args.top_k,
        top_p=args.top_p,
        seed=args.seed,
        stop=args.stop or (),
    ):
        sys.stdout.write(piece)
        sys.stdout.flush()
    sys.stdout.write("\n")
    used = len(out.prompt_ids) + len(out.ids)
    if out.finish_reason == "length" and used >= model.n_ctx:
        print(
            f"stopped at the end of the context ({model.n_ctx} positions) after {len(out.ids)} "
            f"new tokens (the prompt has {len(out.prompt_ids)}), before --max-new-tokens; "
            "--ctx sets a longer context",
            file=sys.stderr,
        )
    return 0
