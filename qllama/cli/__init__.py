"""The ``qllama`` command line.

Every subcommand is a thin layer over the library; errors end the process with one readable
line on stderr and a non-zero status, never a traceback.
"""

from __future__ import annotations

import argparse
import contextlib
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
    from qllama.gguf.reader import read_gguf

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
    from qllama.gguf.quantizer import quantize_file

    def progress(i: int, n: int, t: Any, new: Any) -> None:
        if not args.quiet:
            print(
                f"[{i + 1:>4}/{n}] {t.name:<32} {t.ggml_type.name:>5} -> {new.name:<5}",
                file=sys.stderr,
                flush=True,
            )

    result = quantize_file(
        args.input, args.output, args.type, imatrix=args.imatrix, progress=progress
    )
    counts = ", ".join(f"{n} {k}" for k, n in sorted(result.counts.items(), key=lambda kv: -kv[1]))
    print(
        f"wrote {result.path}: {result.file_type.label}, {counts}; "
        f"tensor data {result.bytes_in / 2**20:.1f} MiB -> {result.bytes_out / 2**20:.1f} MiB"
    )
    if result.without_imatrix:
        print(
            f"{len(result.without_imatrix)} tensor(s) had no importance matrix entry and were "
            f"quantized without one: {', '.join(result.without_imatrix[:5])}"
            + (", ..." if len(result.without_imatrix) > 5 else ""),
            file=sys.stderr,
        )
    return 0


# --- imatrix ----------------------------------------------------------------------------------


def cmd_imatrix(args: argparse.Namespace) -> int:
    from qllama.gguf.imatrix import write_imatrix
    from qllama.measure.importance import from_corpus

    with open(args.text, encoding="utf-8", errors="replace") as fh:
        text = fh.read()

    def progress(i: int, n: int) -> None:
        if not args.quiet:
            print(f"[chunk {i + 1}/{n}]", file=sys.stderr, flush=True)

    options = _backend_options(args)
    name = options.pop("backend")
    m = from_corpus(
        args.model,
        text,
        backend=_backend(name, options),
        n_ctx=args.ctx,
        n_chunks=args.chunks,
        skip_chunks=args.chunk,
        process_output=args.process_output,
        dataset=args.text,
        progress=progress,
    )
    write_imatrix(args.output, m, fmt=args.output_format)
    print(
        f"wrote {args.output}: {len(m.entries)} entries, {m.chunk_count} chunks of "
        f"{m.chunk_size} tokens"
    )
    return 0


def _backend(name: str | None, options: dict[str, Any]) -> Any:
    from qllama.backends import get_backend

    return get_backend(name, **options)


# --- fetch ------------------------------------------------------------------------------------


def cmd_fetch(args: argparse.Namespace) -> int:
    from qllama.model_files import fetch

    print(fetch(args.name, cache=args.cache))
    return 0


# --- generate ---------------------------------------------------------------------------------


def cmd_generate(args: argparse.Namespace) -> int:
    from qllama.runtime.loader import load

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
    from qllama.measure import compare, metrics
    from qllama.runtime.loader import load

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
        _write_json(args.json, doc)
    return 0


# --- trace and attribute --------------------------------------------------------------------


def _prompt_ids(path: str, prompt: str, chat: bool) -> tuple[list[int], list[int]]:
    """The prompt's ids with the file's tokenizer (and chat template), and its stop ids."""
    from qllama.runtime.loader import load

    model = load(path, check_weights=False)
    if chat:
        ids = model.apply_chat_template([{"role": "user", "content": prompt}])
    else:
        ids = model.tokenizer.encode(prompt)
    stops = sorted(model.tokenizer.stop_ids)
    model.source.close()
    return list(ids), stops


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


def _write_json(path: str, doc: dict[str, Any]) -> None:
    from qllama.atomic import atomic_write

    with atomic_write(path, "w") as f:
        json.dump(doc, f, indent=1)
    print(f"wrote {path}")


def cmd_trace(args: argparse.Namespace) -> int:
    from qllama.measure.reference import transformers_trace
    from qllama.measure.trace import layer_trace, positions_from_text

    prompt, stops = _prompt_ids(args.file, args.prompt, args.chat)
    print(f"reference: transformers on {args.reference} ...", file=sys.stderr, flush=True)
    hf, tokens = _transformers_tokens(args.reference, prompt, stops, args.max_new_tokens)
    positions = positions_from_text(args.positions, len(tokens), len(prompt))
    ref = transformers_trace(args.reference, tokens, positions=positions, qkv=args.qkv, model=hf)
    report = layer_trace(
        args.file,
        args.reference,
        tokens,
        settings=args.setting or ("cpu", "gpu", "dequantize-all"),
        qkv=args.qkv,
        band_factor=args.band_factor,
        reference=ref,
        progress=lambda what: print(f"  {what} ...", file=sys.stderr, flush=True),
    )
    print(
        f"{args.file} against transformers on {args.reference}: {len(tokens)} tokens "
        f"({len(prompt)} prompt), {len(ref.positions)} positions compared\n"
    )
    print(report.format())
    if args.plot:
        report.plot(args.plot)
        print(f"wrote {args.plot}")
    if args.json:
        _write_json(args.json, {"tokens": tokens, **report.to_dict()})
    return 0


def cmd_attribute(args: argparse.Namespace) -> int:
    from qllama.measure.attribution import attribute
    from qllama.measure.compare import Reference

    if args.reference.endswith(".npz"):
        ref = Reference.load(args.reference)
        f32 = args.f32
    else:
        if args.prompt is None:
            raise QllamaError("a GGUF reference needs --prompt (an .npz reference has its tokens)")
        prompt, stops = _prompt_ids(args.file, args.prompt, args.chat)
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
    if args.json:
        _write_json(args.json, result.to_dict())
    return 0


# --- perplexity -------------------------------------------------------------------------------


def cmd_perplexity(args: argparse.Namespace) -> int:
    import time

    from qllama.measure import kld_base, metrics, perplexity
    from qllama.measure.corpus import from_spec as corpus_text
    from qllama.model_files import sha256_file
    from qllama.runtime.tokenizer import Tokenizer

    base = kld_base.BaseFile.open(args.kl_divergence_base) if args.kl_divergence_base else None
    if base is not None and args.ctx is not None and args.ctx != base.header.n_ctx:
        raise QllamaError(f"{base.path} was made with a context of {base.header.n_ctx}")
    n_ctx = base.header.n_ctx if base is not None else (args.ctx or 512)
    tokenizer = Tokenizer.from_gguf(args.file)
    if base is not None:
        wins = perplexity.windows_of_base(base, tokenizer)
        if args.chunks is not None:
            base = base.head(min(args.chunks, base.header.n_chunk))
            wins = perplexity.Windows(base.tokens, wins.bos)
        if args.text:
            ids = perplexity.tokenize(tokenizer, corpus_text(args.text)[0])
            given = perplexity.windows(ids, n_ctx, n_chunks=wins.n_chunk, bos=wins.bos)
            if not np.array_equal(given.tokens, wins.tokens):
                raise QllamaError(f"--text does not give the tokens {base.path} was made on")
        text_source = base.header.meta.get("text", {})
    else:
        if not args.text:
            raise QllamaError("give --text (a file, or corpus:NAME) or --kl-divergence-base")
        text, text_source = corpus_text(args.text)
        ids = perplexity.tokenize(tokenizer, text)
        bos = tokenizer.bos_id if tokenizer.add_bos else None
        wins = perplexity.windows(ids, n_ctx, n_chunks=args.chunks, bos=bos)

    if args.transformers:
        from qllama.measure.reference import load_transformers

        scorer = perplexity.transformers_scorer(load_transformers(args.file))
        setting: dict[str, Any] = {"engine": "transformers f32 eager"}
    else:
        from qllama.runtime.loader import load

        options = _backend_options(args)
        if args.as_llama_cpp:
            options.update(perplexity.LLAMA_CPP_CPU)
        if args.kv:
            options["kv_precision"] = args.kv
        if args.threads:
            options["threads"] = args.threads
        model = load(args.file, n_ctx=n_ctx, **options)
        scorer = perplexity.qllama_scorer(model)
        setting = {"engine": "qllama", **{k: v for k, v in options.items() if v is not None}}

    print(
        f"{os.path.basename(args.file)}: {wins.n_chunk} windows of {wins.n_ctx} tokens, "
        f"{wins.n_chunk * wins.n_scored} scored; {setting}",
        file=sys.stderr,
    )
    from tqdm import tqdm

    bar = tqdm(total=wins.n_chunk * wins.n_ctx, unit="tok", disable=args.quiet, file=sys.stderr)
    running: list[str] = []

    def on_window(i: int, scores: perplexity.Scores) -> None:
        if base is None:
            running.append(perplexity.ppl_running(scores))
            bar.set_postfix_str(running[-1].split("]")[1].rstrip(","))
            return
        if i == 0:
            bar.write(perplexity.KL_TABLE_HEAD)
        bar.write(perplexity.kl_running(scores))

    save = None
    if args.save_base:
        meta = {
            "model": os.path.basename(args.file),
            "model_sha256": sha256_file(args.file),
            "setting": setting,
            "text": text_source,
        }
        save = kld_base.BaseWriter(
            args.save_base,
            args.base_format,
            n_ctx=wins.n_ctx,
            n_vocab=tokenizer.n_vocab,
            tokens=wins.tokens,
            meta=meta,
        )
    started = time.perf_counter()
    try:
        with save if save is not None else contextlib.nullcontext():
            scores = perplexity.run(
                scorer, wins, base=base, save=save, progress=bar.update, on_window=on_window
            )
    finally:
        bar.close()
    seconds = time.perf_counter() - started
    if running:
        print("".join(running))
    ppl, unc = scores.ppl()
    print(perplexity.ppl_final(scores))
    doc: dict[str, Any] = {
        "model": args.file,
        "setting": setting,
        "text": text_source,
        "n_ctx": wins.n_ctx,
        "windows": wins.n_chunk,
        "scored": scores.count,
        "ppl": ppl,
        "ppl_unc": unc,
        "seconds": seconds,
        "tokens_per_s": wins.n_chunk * wins.n_ctx / seconds,
    }
    if base is not None:
        if scores.count >= perplexity.MIN_STATISTICS:
            kl = scores.kl()
            print()
            print(metrics.format_kl_stats(kl))
            doc["kl"] = kl.to_dict()
        else:
            print(
                f"{scores.count} scored positions: no statistics below {perplexity.MIN_STATISTICS}"
            )
        doc["base"] = {"path": str(base.path), "format": base.header.fmt, **base.header.meta}
    print(
        f"{wins.n_chunk * wins.n_ctx} tokens in {seconds:.1f} s: "
        f"{doc['tokens_per_s']:.1f} tokens/s",
        file=sys.stderr,
    )
    if args.save_base:
        print(f"wrote {args.save_base} ({args.base_format})", file=sys.stderr)
    if args.json:
        _write_json(args.json, doc)
    return 0


# --- serve ------------------------------------------------------------------------------------


def _named_files(specs: Sequence[str]) -> dict[str, str]:
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


def cmd_serve(args: argparse.Namespace) -> int:
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
    options = _backend_options(args)
    if args.ctx:
        options["n_ctx"] = args.ctx
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(name)s %(message)s")
    sock = serve.bind(args.host, args.port)
    try:
        dirs = [Path(d) for d in args.model_dir] or None
        registry = serve.open_models(_named_files(args.file), allowed_dirs=dirs, **options)
        app = serve.create_app(registry, limits=limits, api_key=key, load_defaults=options)
        host, port = sock.getsockname()[:2]
        names = ", ".join(registry.names())
        print(f"qllama serve: {names} on http://{host}:{port}", file=sys.stderr, flush=True)
        serve.serve_forever(app, sock, log_level=args.log_level)
    finally:
        sock.close()
    return 0


# --- study ----------------------------------------------------------------------------------


def cmd_study(args: argparse.Namespace) -> int:
    from pathlib import Path

    from qllama.study import Options, load_study, run
    from qllama.study.cells import product, select
    from qllama.study.declaration import with_draws, with_prompts

    study = with_prompts(with_draws(load_study(args.study), args.draw or []), args.prompt or [])
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
    from qllama.gguf.quantizer import FILE_TYPES
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
    s.add_argument(
        "--imatrix", help="an importance matrix (GGUF or legacy .dat), as llama-quantize's"
    )
    s.set_defaults(run=cmd_quantize)

    s = sub.add_parser(
        "imatrix", help="compute an importance matrix over a corpus, as llama-imatrix does"
    )
    s.add_argument("model")
    s.add_argument("--text", "-f", required=True, help="the corpus, a UTF-8 text file")
    s.add_argument("-o", "--output", default="imatrix.gguf", help="default: imatrix.gguf")
    s.add_argument("--ctx", "-c", type=int, default=512, help="tokens a chunk (default 512)")
    s.add_argument("--chunks", type=int, help="at most this many chunks (default: all)")
    s.add_argument(
        "--chunk", type=int, default=0, help="start from chunk N, as llama-imatrix (default 0)"
    )
    s.add_argument(
        "--output-format", choices=["gguf", "dat"], help="default: gguf (dat for a .dat name)"
    )
    s.add_argument(
        "--process-output", action="store_true", help="collect output.weight's activations too"
    )
    s.add_argument("-q", "--quiet", action="store_true", help="no per-chunk progress")
    _add_backend_args(s)
    s.set_defaults(run=cmd_imatrix)

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

    s = sub.add_parser("trace", help="per-layer error against transformers, per setting")
    s.add_argument("file")
    s.add_argument("--reference", required=True, help="the F32 GGUF (transformers reads it)")
    s.add_argument("--prompt", required=True)
    s.add_argument("--chat", action="store_true", help="wrap the prompt in the chat template")
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
        help="cpu | gpu | dequantize-all | f32 (repeatable; default cpu, gpu, dequantize-all)",
    )
    s.add_argument("--qkv", action="store_true", help="also compare Q, K and V")
    s.add_argument(
        "--band-factor", type=float, default=10.0, help="the F32 control's band (x its error)"
    )
    s.add_argument("--plot", help="write the error-against-layer plot here (PNG)")
    s.add_argument("--json", help="write every number here")
    s.set_defaults(run=cmd_trace)

    s = sub.add_parser("attribute", help="attribute the error to tensor classes, layers, tensors")
    s.add_argument("file")
    s.add_argument(
        "--reference", required=True, help="the F32 GGUF (transformers runs it), or a .npz"
    )
    s.add_argument("--by", choices=["class", "layer", "tensor"], default="class")
    s.add_argument(
        "--kind",
        choices=["weights", "activations"],
        default="weights",
        help="the file's weights, or q8 activations, for one group at a time (default weights)",
    )
    s.add_argument("--prompt", help="the prompt (with a GGUF reference)")
    s.add_argument("--chat", action="store_true", help="wrap the prompt in the chat template")
    s.add_argument("--max-new-tokens", type=int, default=128, help="reference length")
    s.add_argument("--f32", help="the F32 file for --kind weights (default: a GGUF reference)")
    s.add_argument(
        "--arithmetic",
        choices=["f32", "dequantized", "q8"],
        default="f32",
        help="where the cause is off (default f32)",
    )
    s.add_argument("--backend", help="numpy (default) | torch | jax")
    s.add_argument("--json", help="write every number here")
    s.set_defaults(run=cmd_attribute)

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
    s.add_argument(
        "--prompt",
        action="append",
        metavar="NAME",
        help="only this prompt's references, cells and findings (repeatable)",
    )
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
    s.add_argument("--kv", choices=["f32", "f16", "f16-flash"], help="KV cache precision")
    s.add_argument(
        "--threads", type=int, help="numpy backend: the compiled kernels' threads (numba's)"
    )
    s.add_argument("--json", help="write every number here")
    s.add_argument("-q", "--quiet", action="store_true", help="no progress bar")
    _add_backend_args(s)
    s.set_defaults(run=cmd_perplexity)

    s = sub.add_parser("serve", help="serve models over an OpenAI-compatible HTTP API")
    s.add_argument("file", nargs="+", help="GGUF files, as FILE or NAME=FILE (the API's model)")
    _add_backend_args(s)
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
    s.set_defaults(run=cmd_serve)
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
