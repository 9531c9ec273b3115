"""The ``qllama`` command line.

Every subcommand is a thin layer over the library; errors end the process with one readable
line on stderr and a non-zero status, never a traceback.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Sequence
from typing import Any

import numpy as np

from qllama.errors import QllamaError

EXIT_ERROR = 1
EXIT_INTERRUPTED = 130


# --- inspect ----------------------------------------------------------------------------------


def _short(value: Any, limit: int = 60) -> str:
    """A one-line preview of a metadata value."""
    if isinstance(value, list | np.ndarray):
        items = list(value[:4])
        text = ", ".join(repr(v if not isinstance(v, np.generic) else v.item()) for v in items)
        more = ", ..." if len(value) > 4 else ""
        return f"[{text}{more}]"
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _json_value(value: Any) -> Any:
    if isinstance(value, np.ndarray):
        return value.tolist()
    return value


def _type_label(v: Any) -> str:
    if v.elem_type is not None:
        return f"{v.elem_type.name.lower()}[{len(v.value)}]"
    return v.type.name.lower()


def cmd_inspect(args: argparse.Namespace) -> int:
    from qllama.gguf_reader import read_gguf

    f = read_gguf(args.file)
    by_type: dict[str, list[int]] = {}
    for t in f:
        entry = by_type.setdefault(t.ggml_type.name, [0, 0, 0])
        entry[0] += 1
        entry[1] += t.n_elements
        entry[2] += t.nbytes
    if args.json:
        doc = {
            "path": str(f.path),
            "version": f.version,
            "alignment": f.alignment,
            "data_offset": f.data_offset,
            "metadata": {
                k: {
                    "type": v.type.name,
                    "elem_type": v.elem_type.name if v.elem_type else None,
                    "value": _json_value(v.value),
                }
                for k, v in f.kv.items()
            },
            "tensors": [
                {
                    "name": t.name,
                    "type": t.ggml_type.name,
                    "ne": list(t.ne),
                    "shape": list(t.shape),
                    "offset": t.offset,
                    "bytes": t.nbytes,
                }
                for t in f
            ],
            "summary": {
                k: {"tensors": n, "elements": e, "bytes": b} for k, (n, e, b) in by_type.items()
            },
        }
        json.dump(doc, sys.stdout, indent=1)
        print()
        return 0

    size = os.path.getsize(f.path) if f.path else 0
    print(
        f"{f.path}: GGUF v{f.version}, {size:,} bytes, alignment {f.alignment}, "
        f"{len(f.kv)} metadata keys, {len(f)} tensors, data at offset {f.data_offset}"
    )
    print("\nmetadata:")
    width = max((len(k) for k in f.kv), default=0)
    for k, v in f.kv.items():
        print(f"  {k:<{width}}  {_type_label(v):<14} {_short(v.value)}")
    print("\ntensors (shape in numpy order, rows last; ne is its reverse):")
    print(f"  {'name':<32} {'type':<6} {'shape':<16} {'bytes':>12}")
    for t in f:
        shape = "x".join(str(d) for d in t.shape) or "scalar"
        print(f"  {t.name:<32} {t.ggml_type.name:<6} {shape:<16} {t.nbytes:>12,}")
    total = sum(b for _, _, b in by_type.values())
    print(f"\nby type:\n  {'type':<6} {'tensors':>7} {'elements':>13} {'bytes':>13} {'share':>6}")
    for k, (n, e, b) in sorted(by_type.items(), key=lambda kv: -kv[1][2]):
        print(f"  {k:<6} {n:>7} {e:>13,} {b:>13,} {100 * b / max(total, 1):>5.1f}%")
    return 0


# --- quantize ---------------------------------------------------------------------------------


def cmd_quantize(args: argparse.Namespace) -> int:
    from qllama.file_quantizer import quantize_file

    def progress(i: int, n: int, t: Any, new: Any) -> None:
        if not args.quiet:
            print(
                f"[{i + 1:>4}/{n}] {t.name:<32} {t.ggml_type.name:>5} -> {new.name:<5}",
                file=sys.stderr,
                flush=True,
            )

    result = quantize_file(args.input, args.output, args.type, progress=progress)
    counts = ", ".join(f"{n} {k}" for k, n in sorted(result.counts.items(), key=lambda kv: -kv[1]))
    print(
        f"wrote {result.path}: {result.file_type.label}, {counts}; "
        f"tensor data {result.bytes_in / 2**20:.1f} MiB -> {result.bytes_out / 2**20:.1f} MiB"
    )
    return 0


# --- fetch ------------------------------------------------------------------------------------


def cmd_fetch(args: argparse.Namespace) -> int:
    from qllama.model_files import fetch

    print(fetch(args.name, cache=args.cache))
    return 0


# --- generate ---------------------------------------------------------------------------------


def cmd_generate(args: argparse.Namespace) -> int:
    from qllama.loader import load

    model = load(args.file, n_ctx=args.ctx, **_backend_options(args))
    if args.chat:
        prompt: str | list[int] = model.apply_chat_template(
            [{"role": "user", "content": args.prompt}]
        )
    else:
        prompt = args.prompt
    for piece in model.stream(
        prompt,
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
    return 0


# --- compare ----------------------------------------------------------------------------------


def _backend_options(args: argparse.Namespace) -> dict[str, Any]:
    options: dict[str, Any] = {"backend": args.backend, "device": args.device}
    if args.dequantize_all:
        options["dequantize_all"] = True
    if args.activations:
        options["activations"] = args.activations
    return options


def _never(x: int | None) -> str:
    return "none" if x is None else str(x)


def _yes(flag: bool) -> str:
    return "yes" if flag else "no"


def cmd_compare(args: argparse.Namespace) -> int:
    from qllama import compare, metrics
    from qllama.atomic import atomic_write
    from qllama.loader import load

    model = load(args.model, **_backend_options(args))
    prompt = (
        model.apply_chat_template([{"role": "user", "content": args.prompt}])
        if args.chat
        else model.tokenizer.encode(args.prompt)
    )
    source = args.reference or f"{args.model} (dequantize-all, numpy)"
    if args.reference and args.reference.endswith(".npz"):
        ref = compare.Reference.load(args.reference)
        if ref.tokens[: ref.n_prompt] != list(prompt):
            raise QllamaError(f"{args.reference} was made for another prompt")
    else:
        ref_model = load(args.reference or args.model, backend="numpy", dequantize_all=True)
        ref = compare.reference_from_model(ref_model, prompt, max_new_tokens=args.max_new_tokens)
    cont = ref.continuation
    eos = bool(cont) and cont[-1] in model.tokenizer.stop_ids
    print(f"reference: {source}; prompt {ref.n_prompt} tokens, {len(cont)} new (EOS: {_yes(eos)})")
    tf = compare.teacher_forcing(model, ref, mode=args.mode)
    s = tf.summary()
    print(f"last position: max|Δlogit| = {s['step0_max_abs']:.4g}")
    print(
        f"teacher forcing ({args.mode}): step 0 max|Δ| {s['step0_max_abs']:.4g}, median "
        f"{s['median_max_abs']:.4g}, max {s['max_max_abs']:.4g}; argmax {s['argmax_agree']}/"
        f"{s['steps']}; first differing step {_never(s['first_flip'])}"
    )
    if s["flips"]:
        flips = ", ".join(f"{f['step']} ({f['ref_margin']:.3f})" for f in s["flips"])
        print(f"  differing steps (reference margin): {flips}")
    kl = tf.kl
    print(
        f"  KL: mean {kl.mean_kld:.3e} ± {kl.mean_kld_unc:.1e}, same top {100 * kl.same_top:.1f}%, "
        f"RMS Δp {100 * kl.rms_dp:.3f}%"
    )
    free = compare.free_generation(model, ref)
    at = free.fork
    print(
        f"free generation: {'fork at token ' + str(at) if at is not None else 'no fork'} "
        f"(length {len(free.tokens)}, EOS {'yes' if free.eos else 'no'})"
    )
    if at is not None:
        c = free.context
        print(f"  ...{c['prefix']!r} | reference: {c['reference']!r} | own: {c['own']!r}")
        show = lambda top: ", ".join(f"{model.tokenizer.decode([t])!r} {v:.3f}" for t, v in top)  # noqa: E731
        if at < len(cont):
            print(
                f"  top-3 at the fork: reference [{show(metrics.top_k(ref.step_logits[at]))}]; "
                f"own [{show(metrics.top_k(tf.logits[at]))}]"
            )
    if args.verbose:
        print(metrics.format_kl_stats(kl))
    if args.json:
        doc = {
            "model": args.model,
            "reference": source,
            "prompt_ids": list(prompt),
            "teacher_forcing": s,
            "free_generation": free.summary(),
        }
        with atomic_write(args.json, "w") as f:
            json.dump(doc, f, indent=1)
        print(f"wrote {args.json}")
    return 0


# --- study ----------------------------------------------------------------------------------


def cmd_study(args: argparse.Namespace) -> int:
    from pathlib import Path

    from qllama.study import Options, load_study, run
    from qllama.study.cells import product, select
    from qllama.study.declaration import with_draws

    study = with_draws(load_study(args.study), args.draw or [])
    if args.threads is not None:
        from dataclasses import replace

        study = replace(study, threads=args.threads)
    if args.action == "cells":
        for cell in select(product(study), args.cells or []):
            print(cell.id)
        return 0
    options = Options(
        results=Path(args.results),
        docs=Path(args.docs) if args.docs else None,
        executor=args.executor,
        workers=args.workers,
        scheduler=args.scheduler,
        patterns=tuple(args.cells or ()),
        force=args.force,
        report_only=args.report_only,
        references_only=args.references_only,
    )
    return run(study, options)


# --- entry point ------------------------------------------------------------------------------


def _add_backend_args(s: argparse.ArgumentParser) -> None:
    s.add_argument("--backend", help="numpy | torch | jax | array_api_strict (default: numpy)")
    s.add_argument("--device", help="cpu | cuda | mps (default: the backend's)")
    s.add_argument(
        "--dequantize-all", action="store_true", help="widen every weight to f32 at load"
    )
    s.add_argument(
        "--activations", choices=["q8", "f32"], help="numpy: CPU (q8) or GPU (f32) arithmetic"
    )


def build_parser() -> argparse.ArgumentParser:
    from qllama.file_quantizer import FILE_TYPES
    from qllama.model_files import MODELS

    p = argparse.ArgumentParser(prog="qllama", description="Quantized GGUF inference, measured.")
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")

    s = sub.add_parser("inspect", help="show a GGUF file's metadata and tensors")
    s.add_argument("file")
    s.add_argument("--json", action="store_true", help="machine-readable output")
    s.set_defaults(run=cmd_inspect)

    s = sub.add_parser("quantize", help="quantize a GGUF file as llama-quantize does")
    s.add_argument("input")
    s.add_argument("output")
    s.add_argument("type", metavar="TYPE", help="file type: " + ", ".join(FILE_TYPES))
    s.add_argument("-q", "--quiet", action="store_true", help="no per-tensor progress")
    s.set_defaults(run=cmd_quantize)

    s = sub.add_parser("fetch", help="download a known model file into the cache")
    s.add_argument("name", help="one of: " + ", ".join(MODELS))
    s.add_argument("--cache", help="cache folder (default $QLLAMA_CACHE or the user cache)")
    s.set_defaults(run=cmd_fetch)

    s = sub.add_parser("compare", help="compare a model with a reference, step by step")
    s.add_argument("model")
    s.add_argument(
        "--reference",
        help="a reference .npz, or a GGUF run in f32 (default: MODEL itself, dequantize-all)",
    )
    s.add_argument("--prompt", required=True)
    s.add_argument("--chat", action="store_true", help="wrap the prompt in the chat template")
    s.add_argument("--mode", choices=["steps", "batched"], default="steps", help="teacher forcing")
    s.add_argument(
        "--max-new-tokens", type=int, default=128, help="reference length (when generated)"
    )
    s.add_argument("--json", help="write every number here")
    s.add_argument(
        "-v", "--verbose", action="store_true", help="llama-perplexity's full KL statistics"
    )
    _add_backend_args(s)
    s.set_defaults(run=cmd_compare)

    s = sub.add_parser("study", help="run a study declared in a TOML file (docs/studies.md)")
    s.add_argument("action", choices=["run", "cells"], help="run it, or list its cells")
    s.add_argument("study", help="the study's TOML file")
    s.add_argument(
        "--cells", action="append", metavar="PATTERN", help="only cells matching (repeatable)"
    )
    s.add_argument("--executor", choices=["local", "process", "dask"], default="process")
    s.add_argument("--workers", type=int, help="processes or local Dask workers (default: cores)")
    s.add_argument(
        "--scheduler", metavar="ADDRESS", help="a Dask scheduler (default: a local cluster)"
    )
    s.add_argument("--results", default="results", help="the cache of references and cells")
    s.add_argument("--docs", help="where results.md, results.json and plots/ go")
    s.add_argument("--draw", action="append", metavar="NAME", help="switch on an optional draw")
    s.add_argument("--threads", type=int, help="every cell's threads (default: the study's)")
    s.add_argument("--force", action="store_true", help="rerun cells even if cached")
    s.add_argument("--report-only", action="store_true", help="rebuild the report from the cache")
    s.add_argument("--references-only", action="store_true", help="only compute the references")
    s.set_defaults(run=cmd_study)

    s = sub.add_parser("generate", help="generate text, streamed to stdout")
    s.add_argument("file")
    s.add_argument("--prompt", required=True, help="the prompt text")
    s.add_argument("--chat", action="store_true", help="wrap the prompt in the chat template")
    _add_backend_args(s)
    s.add_argument("--max-new-tokens", type=int, default=256)
    s.add_argument("--temperature", type=float, default=0.0, help="0 (default) is greedy")
    s.add_argument("--top-k", type=int, default=0)
    s.add_argument("--top-p", type=float, default=1.0)
    s.add_argument("--seed", type=int)
    s.add_argument("--stop", action="append", help="stop at this text (repeatable)")
    s.add_argument("--ctx", type=int, help="context length (default: the model's)")
    s.set_defaults(run=cmd_generate)
    return p


def main(argv: Sequence[str] | None = None) -> int:
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


if __name__ == "__main__":
    sys.exit(main())
