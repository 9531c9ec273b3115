"""``qllama compare``: a model against a reference, step by step (teacher forcing, then free
generation to the first fork)."""

from __future__ import annotations

import argparse

from qllama.cli.common import (
    Subparsers,
    add_backend_args,
    add_chat_arg,
    add_json_arg,
    announce,
    backend_options,
    chat_ids,
    write_json,
)
from qllama.errors import QllamaError


def add_parser(sub: Subparsers) -> None:
    """The subcommand and its arguments."""
    s = sub.add_parser("compare", help="compare a model with a reference, step by step")
    s.add_argument("model")
    s.add_argument(
        "--reference",
        help="a reference .npz, or a GGUF run in f32 (default: MODEL itself, dequantize-all)",
    )
    s.add_argument("--prompt", required=True)
    add_chat_arg(s)
    s.add_argument("--mode", choices=["steps", "batched"], default="steps", help="teacher forcing")
    s.add_argument(
        "--max-new-tokens", type=int, default=128, help="reference length (when generated)"
    )
    add_json_arg(s)
    s.add_argument(
        "-v", "--verbose", action="store_true", help="llama-perplexity's full KL statistics"
    )
    add_backend_args(s)
    s.set_defaults(run=run)


def _never(x: int | None) -> str:
    return "none" if x is None else str(x)


def _reference_label(reference: str | None, model: str) -> str:
    """What the reference is: an .npz, a float GGUF, or a quantized one run dequantize-all
    (then labelled so, never as an f32 model)."""
    from qllama.measure.reference import quantized_types

    path = reference or model
    if path.endswith(".npz"):
        return path
    quantized = sorted(quantized_types(path))
    kind = f"quantized ({', '.join(quantized)}), " if quantized else ""
    return f"{path} ({kind}dequantize-all on numpy)"


def run(args: argparse.Namespace) -> int:
    """Teacher forcing against the reference, then free generation to its fork, printed."""
    from qllama.measure import compare, metrics
    from qllama.runtime.loader import load

    model = load(args.model, **backend_options(args))
    announce(model.backend)
    prompt = chat_ids(model, args.prompt) if args.chat else model.tokenizer.encode(args.prompt)
    source = _reference_label(args.reference, args.model)
    if args.reference and args.reference.endswith(".npz"):
        ref = compare.Reference.load(args.reference)
        if ref.tokens[: ref.n_prompt] != list(prompt):
            raise QllamaError(f"{args.reference} was made for another prompt")
    else:
        ref_model = load(args.reference or args.model, backend="numpy", dequantize_all=True)
        ref = compare.reference_from_model(ref_model, prompt, max_new_tokens=args.max_new_tokens)
    cont = ref.continuation
    eos = bool(cont) and cont[-1] in model.tokenizer.stop_ids
    print(
        f"reference: {source}: the prompt ({ref.n_prompt} tokens) and its greedy continuation "
        f"({len(cont)} tokens{', ending at EOS' if eos else ''})"
    )
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
        f"  KL: mean {metrics.plus_minus(kl.mean_kld, kl.mean_kld_unc, kl.n)}, same top "
        f"{100 * kl.same_top:.1f}%, RMS Δp {100 * kl.rms_dp:.3f}%"
    )
    free = compare.free_generation(model, ref)
    at = free.fork
    fork = (
        "no fork: every new token is the reference's"
        if at is None
        else f"forks at new token {at} (counted from 0: the first that is not the reference's)"
    )
    ended = "at EOS" if free.eos else f"at its cap, the reference's length + {compare.FREE_EXTRA}"
    print(f"free generation: {fork}; {len(free.tokens)} new tokens, ended {ended}")
    if at is not None:
        c = free.context
        print(f"  ...{c['prefix']!r} | reference: {c['reference']!r} | own: {c['own']!r}")

        def show(top: list[tuple[int, float]]) -> str:
            return ", ".join(f"{model.tokenizer.decode([t])!r} {v:.3f}" for t, v in top)

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
        write_json(args.json, doc)
    return 0
