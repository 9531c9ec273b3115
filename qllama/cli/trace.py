"""``qllama trace``: each layer's error against transformers on the F32 file, per setting; with
``--routing``, a mixture's experts against the F32 file's (qllama.measure.routing)."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
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
    s.add_argument(
        "--engine",
        choices=["transformers", "qllama"],
        default="transformers",
        help="who runs the reference file: transformers f32, or qllama's numpy dequantize-all "
        "(for files transformers does not read, such as a llama with experts)",
    )
    s.add_argument(
        "--routing",
        action="store_true",
        help="a mixture of experts: each setting's selected experts against qllama's F32 run "
        "of the reference file, per token and layer, and the error with its experts forced",
    )
    s.add_argument(
        "--plot",
        help="write the error-against-layer plot here (PNG); with --routing, the routing's "
        "beside it (NAME-routing.png)",
    )
    add_json_arg(s)
    s.set_defaults(run=run, check=check)


def check(args: argparse.Namespace) -> None:
    """Before any work: the reference (a float GGUF), the settings, the plot's matplotlib
    and the torch a setting needs."""
    from qllama.measure.reference import check_reference_file
    from qllama.runtime.arithmetic import setting

    if args.engine == "transformers":
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


def _qllama_reference(args: argparse.Namespace, prompt: list[int]) -> tuple[Any, Any, list[int]]:
    """qllama's numpy dequantize-all run of the reference file: the model, its trace of the
    prompt and its greedy continuation (router logits included for ``--routing``), the
    tokens."""
    from qllama.measure.compare import reference_from_model
    from qllama.measure.trace import positions_from_text
    from qllama.runtime.loader import load
    from qllama.runtime.observe import record

    model = load(args.reference, backend="numpy", dequantize_all=True)
    tokens = prompt
    if args.max_new_tokens > 0:
        tokens = reference_from_model(model, prompt, max_new_tokens=args.max_new_tokens).tokens
    positions = positions_from_text(args.positions, len(tokens), len(prompt))
    return model, record(model, tokens, positions=positions, qkv=args.qkv), tokens


def _routing(
    args: argparse.Namespace, reference: Any, tokens: list[int], settings: Sequence[str]
) -> dict[str, Any]:
    """Each setting's routing report against qllama's F32 run of the reference file."""
    from qllama.measure.routing import routing_report
    from qllama.runtime.arithmetic import setting
    from qllama.runtime.loader import load
    from qllama.runtime.observe import record

    ref_trace = record(reference, tokens, router=True)
    out = {}
    for name in settings:
        print(f"  routing: {name} ...", file=sys.stderr, flush=True)
        s = setting(name)
        model = load(args.file, backend=s.backend, arithmetic=s.arithmetic, **_kv(args))
        out[name] = routing_report(model, reference, tokens, ref_trace=ref_trace)
        model.source.close()
    return out


def _kv(args: argparse.Namespace) -> dict[str, Any]:
    return {"kv_precision": args.kv} if args.kv else {}


def run(args: argparse.Namespace) -> int:
    """Trace the reference once, then each setting against it; print the table (and each
    setting's routing)."""
    from qllama.errors import QllamaError
    from qllama.measure.reference import transformers_trace
    from qllama.measure.trace import layer_trace, positions_from_text
    from qllama.runtime.arithmetic import setting
    from qllama.version import __version__

    settings = args.setting or DEFAULT_SETTINGS
    each = "; ".join(f"{n} ({setting(n).backend}: {setting(n).about})" for n in settings)
    print(f"qllama {__version__}, settings: {each}", file=sys.stderr, flush=True)
    prompt, stops = prompt_ids(args.file, args.prompt, args.chat)
    print(f"reference: {args.engine} on {args.reference} ...", file=sys.stderr, flush=True)
    qref: Any = None  # qllama's run of the reference file, where one is needed
    if args.engine == "qllama":
        qref, ref, tokens = _qllama_reference(args, prompt)
    else:
        hf, tokens = _transformers_tokens(args.reference, prompt, stops, args.max_new_tokens)
        positions = positions_from_text(args.positions, len(tokens), len(prompt))
        ref = transformers_trace(
            args.reference, tokens, positions=positions, qkv=args.qkv, model=hf
        )
    if args.routing and qref is None:
        from qllama.runtime.loader import load

        qref = load(args.reference, backend="numpy", dequantize_all=True)
    if args.routing and not qref.config.n_expert:
        raise QllamaError(f"--routing: {args.reference} is not a mixture of experts")
    report = layer_trace(
        args.file,
        args.reference,
        tokens,
        settings=settings,
        qkv=args.qkv,
        band_factor=args.band_factor,
        reference=ref,
        progress=lambda what: print(f"  {what} ...", file=sys.stderr, flush=True),
        **_kv(args),
    )
    routing = _routing(args, qref, tokens, settings) if args.routing else {}
    print(
        f"{args.file} against {args.engine} on {args.reference}: {len(tokens)} tokens "
        f"({len(prompt)} prompt), {len(ref.positions)} positions compared\n"
    )
    print(report.format())
    for name, r in routing.items():
        print(f"\n{name}: {r.format()}")
    if args.json:  # first: a plot that fails loses no number
        doc = {"tokens": tokens, "engine": args.engine, **report.to_dict()}
        if routing:
            doc["routing"] = {name: r.to_dict() for name, r in routing.items()}
        write_json(args.json, doc)
    if args.plot:
        report.plot(args.plot, prompt=args.prompt)
        print(f"wrote {args.plot}")
    if args.plot and routing:
        from pathlib import Path

        from qllama.measure.routing import plot_routing

        where = Path(args.plot)
        where = where.with_name(f"{where.stem}-routing{where.suffix}")
        plot_routing(
            routing,
            where,
            f"{Path(args.file).name}: experts against {Path(args.reference).name}'s, per layer",
        )
        print(f"wrote {where}")
    return 0
