"""``qllama perplexity``: perplexity and KL divergence over a corpus, printed as
llama-perplexity prints them; the run itself is :func:`qllama.measure.perplexity.evaluate`."""

from __future__ import annotations

import argparse
import os
import sys
from typing import Any

from qllama.cli.common import (
    KV_HELP,
    Subparsers,
    add_backend_args,
    add_json_arg,
    backend_options,
    kv_spec,
    require_module,
    write_json,
)


def add_parser(sub: Subparsers) -> None:
    """The subcommand and its arguments."""
    s = sub.add_parser(
        "perplexity", help="perplexity and KL divergence over a corpus, as llama-perplexity"
    )
    s.add_argument("file")
    s.add_argument("--text", help="a UTF-8 text file, or corpus:NAME (e.g. corpus:botchan)")
    s.add_argument("--ctx", type=int, help="window length (default 512, or the base's)")
    s.add_argument("--chunks", type=int, help="at most this many windows (default: all)")
    s.add_argument("--save-base", metavar="BASE", help="write this run's logits as a base")
    s.add_argument(
        "--base-format",
        choices=["llama", "f32"],
        default="llama",
        help="llama: llama-perplexity's uint16 file (default); f32: the float32 logits",
    )
    s.add_argument(
        "--kl-divergence-base", metavar="BASE", help="compare with this base (either format)"
    )
    s.add_argument(
        "--transformers",
        action="store_true",
        help="score with the transformers f32 reference instead of qllama (an F32 file)",
    )
    s.add_argument(
        "--as-llama-cpp",
        action="store_true",
        help="the CPU arithmetic as llama.cpp's CPU backend computes it (see docs/perplexity.md)",
    )
    s.add_argument("--kv", type=kv_spec, help=KV_HELP)
    s.add_argument(
        "--threads", type=int, help="numpy backend: the compiled kernels' threads (numba's)"
    )
    add_json_arg(s)
    s.add_argument("-q", "--quiet", action="store_true", help="no progress bar")
    add_backend_args(s, kv=False)
    s.set_defaults(run=run, check=check)


def check(args: argparse.Namespace) -> None:
    """Before any work: the reference's transformers, and that it reads a float file."""
    if args.transformers:
        from qllama.measure.reference import check_reference_file

        require_module("transformers", "reference", "--transformers")
        check_reference_file(args.file)


def run(args: argparse.Namespace) -> int:
    """Run :func:`~qllama.measure.perplexity.evaluate` with a progress bar and the running
    lines on stderr, then print the estimate (and the KL statistics against a base)."""
    from tqdm import tqdm

    from qllama.measure import metrics, perplexity

    bars: list[Any] = []  # made once the windows are known: its total is their tokens
    running: list[str] = []
    compared = bool(args.kl_divergence_base)

    def on_start(wins: perplexity.Windows, setting: dict[str, Any]) -> None:
        from qllama.version import __version__

        options = ", ".join(
            f"{k} {v}" for k, v in setting.items() if k in ("kv_precision", "activation_rounding")
        )
        computes = setting.get("computes", setting["engine"])
        print(
            f"qllama {__version__}, {computes}{'; ' + options if options else ''}\n"
            f"{os.path.basename(args.file)}: {wins.n_chunk} windows of {wins.n_ctx} tokens, "
            f"{wins.n_chunk * wins.n_scored} scored",
            file=sys.stderr,
        )
        total = wins.n_chunk * wins.n_ctx
        bars.append(tqdm(total=total, unit="tok", disable=args.quiet, file=sys.stderr))

    def on_window(i: int, scores: perplexity.Scores) -> None:
        bar = bars[0]
        if not compared:
            running.append(perplexity.ppl_running(scores))
            bar.set_postfix_str(running[-1].split("]")[1].rstrip(","))
            return
        if i == 0:
            bar.write(perplexity.KL_TABLE_HEAD)
        bar.write(perplexity.kl_running(scores))

    try:
        result = perplexity.evaluate(
            args.file,
            text=args.text,
            n_ctx=args.ctx,
            n_chunks=args.chunks,
            base=args.kl_divergence_base or None,
            engine="transformers" if args.transformers else "qllama",
            options=backend_options(args),
            as_llama_cpp=args.as_llama_cpp,
            kv_precision=args.kv,
            threads=args.threads,
            save_base=args.save_base or None,
            base_format=args.base_format,
            on_start=on_start,
            progress=lambda n: bars[0].update(n),
            on_window=on_window,
        )
    finally:
        for bar in bars:
            bar.close()
    scores, wins = result.scores, result.windows
    if running:
        print("".join(running))
    print(perplexity.ppl_final(scores))
    if result.base is not None:
        if result.kl is not None:
            print()
            print(metrics.format_kl_stats(result.kl))
        else:
            print(
                f"{scores.count} scored positions: no statistics below {perplexity.MIN_STATISTICS}"
            )
    print(
        f"{wins.n_chunk * wins.n_ctx} tokens in {result.seconds:.1f} s: "
        f"{result.tokens_per_s:.1f} tokens/s",
        file=sys.stderr,
    )
    if args.save_base:
        print(f"wrote {args.save_base} ({args.base_format})", file=sys.stderr)
    if args.json:
        write_json(args.json, result.to_dict())
    return 0
