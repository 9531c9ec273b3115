"""``qllama attribute``: the error split by tensor class, layer or tensor, one group's cause
switched on at a time."""

from __future__ import annotations

import argparse
import sys
from typing import Any

from qllama.cli.common import (
    Subparsers,
    add_chat_arg,
    add_json_arg,
    prompt_ids,
    require_module,
    write_json,
)
from qllama.errors import QllamaError


def add_parser(sub: Subparsers) -> None:
    """The subcommand and its arguments."""
    s = sub.add_parser("attribute", help="attribute the error to tensor classes, layers, tensors")
    s.add_argument("file")
    s.add_argument(
        "--reference", required=True, help="the F32 GGUF (transformers runs it), or a .npz"
    )
    s.add_argument(
        "--by",
        choices=["class", "layer", "tensor", "expert"],
        default="class",
        help="expert: each expert of each layer of a mixture (--kind weights)",
    )
    s.add_argument(
        "--kind",
        choices=["weights", "activations"],
        default="weights",
        help="the file's weights, or q8 activations, for one group at a time (default weights)",
    )
    s.add_argument("--prompt", help="the prompt (with a GGUF reference)")
    add_chat_arg(s)
    s.add_argument("--max-new-tokens", type=int, default=128, help="reference length")
    s.add_argument("--f32", help="the F32 file for --kind weights (default: a GGUF reference)")
    s.add_argument(
        "--arithmetic",
        choices=["f32", "dequantized", "q8"],
        default="f32",
        help="where the cause is off (default f32)",
    )
    s.add_argument("--backend", help="numpy (default) | torch | jax")
    s.add_argument("--plot", help="write a bar chart of the ranked groups here (PNG)")
    s.add_argument("--top", type=int, default=30, help="the plot's bars: the largest groups")
    add_json_arg(s)
    s.set_defaults(run=run, check=check)


def check(args: argparse.Namespace) -> None:
    """Before any work: the reference and the F32 file exist and are what they claim, a GGUF
    reference has its prompt, and the plot has matplotlib."""
    from pathlib import Path

    from qllama.measure.reference import check_reference_file

    if args.reference.endswith(".npz"):
        if not Path(args.reference).is_file():
            raise QllamaError(f"the reference {args.reference} does not exist")
        if args.kind == "weights" and args.f32 is None:
            raise QllamaError("--kind weights with an .npz reference needs --f32 (the F32 file)")
    else:
        if args.prompt is None:
            raise QllamaError("a GGUF reference needs --prompt (an .npz reference has its tokens)")
        require_module("transformers", "reference", "a GGUF reference (transformers runs it)")
        check_reference_file(args.reference)
    if args.f32 is not None:
        check_reference_file(args.f32)
    if args.plot:
        require_module("matplotlib", "plot", "--plot")


def _progress_bar(desc: str) -> Any:
    """A (done, total, label) callback drawing a tqdm bar on stderr."""
    from tqdm import tqdm

    bar: list[Any] = []

    def progress(done: int, total: int, label: str) -> None:
        if not bar:
            bar.append(tqdm(total=total, desc=desc, unit="pass", file=sys.stderr))
        bar[0].n = done
        bar[0].set_postfix_str(label, refresh=True)
        if done >= total:
            bar[0].close()

    return progress


def run(args: argparse.Namespace) -> int:
    """The reference (an .npz, or transformers on a GGUF), then one pass per group; printed."""
    from qllama.measure.attribution import attribute
    from qllama.measure.compare import Reference
    from qllama.version import __version__

    print(
        f"qllama {__version__}, {args.backend or 'numpy'}: {args.kind} for one {args.by} at a "
        f"time, the rest {args.arithmetic} arithmetic",
        file=sys.stderr,
        flush=True,
    )

    if args.reference.endswith(".npz"):
        ref = Reference.load(args.reference)
        f32 = args.f32
    else:
        prompt, stops = prompt_ids(args.file, args.prompt, args.chat)
        from qllama.measure.reference import transformers_reference

        print(f"reference: transformers on {args.reference} ...", file=sys.stderr, flush=True)
        ref = transformers_reference(
            args.reference, prompt, max_new_tokens=args.max_new_tokens, stop_ids=stops
        )
        f32 = args.f32 or args.reference
    result = attribute(
        args.file,
        ref,
        kind=args.kind,
        by=args.by,
        f32_path=f32,
        arithmetic=args.arithmetic,
        backend=args.backend or "numpy",
        progress=_progress_bar(f"attribute by {args.by}"),
    )
    print(result.format())
    if args.json:  # first: a plot that fails loses no number
        write_json(args.json, result.to_dict())
    if args.plot:
        result.plot(args.plot, top=args.top)
        print(f"wrote {args.plot}")
    return 0
