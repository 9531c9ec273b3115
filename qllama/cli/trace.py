"""``qllama trace``: each layer's error against transformers on the F32 file, per setting."""

from __future__ import annotations

import argparse
import sys
from typing import Any

from qllama.cli.common import (
    KV_HELP,
    Subparsers,
    add_chat_arg,
    add_json_arg,
    kv_spec,
    prompt_ids,
    require_module,
    write_json,
)

DEFAULT_SETTINGS = ("cpu", "gpu", "dequantize-all")


def add_parser(sub: Subparsers) -> None:
    """The subcommand and its arguments."""
    s = sub.add_parser("trace", help="per-layer error against transformers, per setting")
    s.add_argument("file")
    s.add_argument("--reference", required=True, help="the F32 GGUF (transformers reads it)")
    s.add_argument("--prompt", required=True)
    add_chat_arg(s)
    s.add_argument(
        "--max-new-tokens", type=int, default=0, help="append the reference's greedy tokens"
    )
    s.add_argument(
        "--positions",
        default="all",
        help="all (default), last, prompt, new, or positions and a:b ranges (0,5,-1 or 10:20)",
    )
    s.add_argument(
        "--setting",
        action="append",
        help="cpu | gpu | dequantize-all | f32 (repeatable; default: "
        + ", ".join(DEFAULT_SETTINGS)
        + ")",
    )
    s.add_argument("--qkv", action="store_true", help="also compare Q, K and V")
    s.add_argument("--kv", type=kv_spec, help=KV_HELP + "; every setting computes with it")
    s.add_argument(
        "--band-factor", type=float, default=10.0, help="the F32 control's band (x its error)"
    )
    s.add_argument("--plot", help="write the error-against-layer plot here (PNG)")
    add_json_arg(s)
    s.set_defaults(run=run, check=check)


def check(args: argparse.Namespace) -> None:
    """Before any work: the reference (a float GGUF), the settings, the plot's matplotlib
    and the torch a setting needs."""
    from qllama.measure.reference import check_reference_file
    from qllama.runtime.arithmetic import setting

    require_module("transformers", "reference", "the reference (transformers on --reference)")
    check_reference_file(args.reference)
    for name in args.setting or DEFAULT_SETTINGS:
        if setting(name).backend == "torch":
            require_module("torch", "torch", f"the {name} setting")
    if args.plot:
        require_module("matplotlib", "plot", "--plot")


def _transformers_tokens(
    ref_path: str, prompt: list[int], stops: list[int], new_tokens: int
) -> tuple[Any, list[int]]:
    """transformers on the reference file, and the prompt with its greedy continuation."""
    from qllama.measure.reference import load_transformers, transformers_reference

    hf = load_transformers(ref_path)
    if new_tokens <= 0:
        return hf, prompt
    ref = transformers_reference(
        ref_path, prompt, max_new_tokens=new_tokens, stop_ids=stops, model=hf
    )
    return hf, ref.tokens


def run(args: argparse.Namespace) -> int:
    """Trace the reference once, then each setting against it; print the table."""
    from qllama.measure.reference import transformers_trace
    from qllama.measure.trace import layer_trace, positions_from_text
    from qllama.runtime.arithmetic import setting
    from qllama.version import __version__

    settings = args.setting or DEFAULT_SETTINGS
    each = "; ".join(f"{n} ({setting(n).backend}: {setting(n).about})" for n in settings)
    print(f"qllama {__version__}, settings: {each}", file=sys.stderr, flush=True)
    prompt, stops = prompt_ids(args.file, args.prompt, args.chat)
    print(f"reference: transformers on {args.reference} ...", file=sys.stderr, flush=True)
    hf, tokens = _transformers_tokens(args.reference, prompt, stops, args.max_new_tokens)
    positions = positions_from_text(args.positions, len(tokens), len(prompt))
    ref = transformers_trace(args.reference, tokens, positions=positions, qkv=args.qkv, model=hf)
    report = layer_trace(
        args.file,
        args.reference,
        tokens,
        settings=settings,
        qkv=args.qkv,
        band_factor=args.band_factor,
        reference=ref,
        progress=lambda what: print(f"  {what} ...", file=sys.stderr, flush=True),
        **({"kv_precision": args.kv} if args.kv else {}),
    )
    print(
        f"{args.file} against transformers on {args.reference}: {len(tokens)} tokens "
        f"({len(prompt)} prompt), {len(ref.positions)} positions compared\n"
    )
    print(report.format())
    if args.json:  # first: a plot that fails loses no number
        write_json(args.json, {"tokens": tokens, **report.to_dict()})
    if args.plot:
        report.plot(args.plot, prompt=args.prompt)
        print(f"wrote {args.plot}")
    return 0
