"""``qllama moefy``: a mixture of experts made from a dense llama (qllama.study.moefy)."""

from __future__ import annotations

import argparse

from qllama.cli.common import Subparsers


def add_parser(sub: Subparsers) -> None:
    """The subcommand and its arguments."""
    from qllama.study.moefy import MODES, MoEfication

    d = MoEfication()
    s = sub.add_parser("moefy", help="make a mixture of experts from a dense llama (F32)")
    s.add_argument("source", help="an F32 llama GGUF, or a model name qllama fetch knows")
    s.add_argument("output")
    s.add_argument("--experts", type=int, default=d.n_expert, help="experts per layer")
    s.add_argument("--k", type=int, default=d.k, help="experts per token")
    s.add_argument(
        "--mode",
        choices=MODES,
        default=d.mode,
        help="split the neurons among the experts, or upcycle: each expert a perturbed copy",
    )
    s.add_argument("--shared", type=int, default=d.shared, help="split: neurons every expert has")
    s.add_argument("--noise", type=float, default=d.noise, help="upcycle: relative weight noise")
    s.add_argument("--router-scale", type=float, default=d.router_scale)
    s.add_argument("--seed", type=int, default=d.seed)
    s.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    """Write the mixture and say what it is."""
    from pathlib import Path

    from qllama.model_files import MODELS, variant
    from qllama.study.moefy import MoEfication, moefy

    source = variant(args.source, "F32") if args.source in MODELS else Path(args.source)
    spec = MoEfication(
        n_expert=args.experts,
        k=args.k,
        mode=args.mode,
        shared=args.shared,
        noise=args.noise,
        router_scale=args.router_scale,
        seed=args.seed,
    )
    moefy(source, args.output, spec)
    print(f"wrote {args.output}: {source.name} as {spec}")
    return 0
