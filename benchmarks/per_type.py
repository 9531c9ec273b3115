"""Decode speed per GGML type at a 1B shape: qllama's CPU arithmetic against llama.cpp.

    python benchmarks/per_type.py [--types IQ2_XXS MXFP4 ...] [--layers 16] [--threads 1]
        [--steps 8] [--out docs/bench-types.md] [--llama-python PYTHON]

Issue 33's table: for each weight type, a 1B-shaped synthetic llama whose 2-D weights are all
of that type (:mod:`scale`'s files: 2048 wide, n_ff 8192, 32 / 8 heads, untied output; one
layer drawn, quantized by :mod:`qllama.quants` and written for every layer, cached in
``<cache>/bench/``; the types ggml writes only with an importance matrix get a flat one). On
it, qllama (numpy backend, numba kernels) and llama.cpp (llama-cpp-python) each decode
``--steps`` tokens after a short prompt, each in a process of its own, one type after the
other, both sides in the same run. Reported per type: tokens per second of wall time and of
the process's CPU time, the weight bandwidth (bytes of the 2-D weights one step streams x
tok/s) and the ratio qllama / llama.cpp. On a shared machine read the CPU-time ratio (with
one thread it is what the work costs); the wall-clock one says how busy the machine was.

``--layers`` shrinks the files (every layer has the 1B shape; fewer of them), for a short
run. A type that qllama computes with its numpy oracle only (no compiled kernel: the table
says which) is skipped unless ``--with-oracle``: at 1B it takes minutes a token.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path
from typing import Any

from common import fmt, memory_mb, pin_cpus, run_worker
from scale import ratio, token_ids

HERE = Path(__file__).resolve().parent
# every type a file's 2-D weights can have that both sides compute, in the ladder's order
TYPES = (
    "Q8_0", "Q6_K", "Q5_K", "Q5_1", "Q5_0", "Q4_K", "Q4_1", "Q4_0", "IQ4_NL", "IQ4_XS",
    "MXFP4", "NVFP4", "Q3_K", "IQ3_S", "IQ3_XXS", "Q2_K", "IQ2_S", "IQ2_XS", "IQ2_XXS",
    "IQ1_M", "IQ1_S", "TQ2_0", "TQ1_0", "Q2_0", "Q1_0",
)  # fmt: skip
PROMPT = 8  # decode starts after this many tokens
WARMUP = 2  # untimed decode steps


# --- workers (a process each: ``per_type.py --worker JOB``) ---------------------------------------


def _decode(start: Any, step: Any, job: dict) -> dict[str, Any]:
    """Wall and CPU tokens/s of ``job["steps"]`` decode steps after a prompt and a warm-up,
    the medians of ``job["repeats"]`` runs."""
    ids = token_ids(PROMPT + WARMUP + job["steps"])
    walls, cpus = [], []
    for _ in range(job["repeats"]):
        start(ids[:PROMPT])
        for i in range(PROMPT, PROMPT + WARMUP):
            step(ids[i], i)
        w, c = time.perf_counter(), time.process_time()
        for i in range(PROMPT + WARMUP, len(ids)):
            step(ids[i], i)
        walls.append(job["steps"] / (time.perf_counter() - w))
        cpus.append(job["steps"] / (time.process_time() - c))
    return {
        "wall_tok_s": statistics.median(walls),
        "cpu_tok_s": statistics.median(cpus),
        **memory_mb(),
    }


def run_qllama(job: dict) -> dict[str, Any]:
    """qllama's CPU arithmetic (numba kernels), ``job["threads"]`` threads."""
    import numba

    import qllama
    from qllama.array_api import to_numpy

    numba.set_num_threads(job["threads"])
    model = qllama.load(job["file"], backend="numpy", kernels="numba", threads=job["threads"])

    def start(ids: list[int]) -> None:
        to_numpy(model.forward(ids, 0))

    def step(token: int, pos: int) -> None:
        to_numpy(model.forward([token], pos))

    return _decode(start, step, job)


def run_llama_cpp(job: dict) -> dict[str, Any]:
    """llama.cpp through llama-cpp-python, ``job["threads"]`` threads."""
    import llama_cpp

    llm = llama_cpp.Llama(
        model_path=job["file"],
        n_ctx=64,
        n_threads=job["threads"],
        n_threads_batch=job["threads"],
        verbose=False,
    )

    def start(ids: list[int]) -> None:
        llm.reset()
        llm.eval(ids)

    def step(token: int, pos: int) -> None:
        llm.eval([token])

    return _decode(start, step, job)


WORKERS = {"qllama": run_qllama, "llama_cpp": run_llama_cpp}


# --- the run -------------------------------------------------------------------------------


def computed_by_kernels(qtype: str) -> bool:
    """Whether qllama's numpy backend has a compiled kernel for ``qtype``."""
    from qllama.backends.numpy.dispatch import KERNEL_TYPES
    from qllama.ggml_types import GGMLType

    return GGMLType[qtype] in KERNEL_TYPES


def measure(args: argparse.Namespace) -> dict[str, Any]:
    """Every type's file and both sides' decode rates; what :func:`markdown` reads. The
    report is rewritten after each type, so that a stopped run keeps what it measured."""
    import scale

    shape = scale.SHAPES["1B"]
    layers = args.layers or shape.n_layer
    rows: dict[str, Any] = {}
    summary = {
        "rows": rows,
        "layers": layers,
        "shape": vars(shape),
        "threads": args.threads,
        "steps": args.steps,
        "repeats": args.repeats,
        "llama_note": args.llama_note,
        "cpu": platform.processor() or platform.machine(),
    }
    for qtype in args.types:
        summary["load"] = os.getloadavg() if hasattr(os, "getloadavg") else None
        report(args, summary)
        row: dict[str, Any] = {"kernels": computed_by_kernels(qtype)}
        rows[qtype] = row
        if not (row["kernels"] or args.with_oracle):
            print(f"{qtype}: no compiled kernel, skipped", flush=True)
            continue
        print(f"{qtype}: file ...", end=" ", flush=True)
        t = time.perf_counter()
        try:
            path, made = scale.synthetic_file(shape, qtype, layers)
        except Exception as e:  # a type the synthetic writer cannot write: say so, go on
            row["error"] = f"file: {type(e).__name__}: {e}"[:200]
            print(row["error"], flush=True)
            continue
        row |= {"file": str(path), "made": made, "mb": os.path.getsize(path) / 1e6}
        row["streamed_mb"] = scale.streamed_bytes(path) / 1e6
        print(f"{time.perf_counter() - t:.0f} s", flush=True)
        job = {"file": str(path), "steps": args.steps, "repeats": args.repeats}
        sides = [("qllama", sys.executable)]
        if not args.llama_note:
            sides.append(("llama_cpp", args.llama_python))
        for kind, python in sides:
            print(f"{qtype}: {kind} ...", end=" ", flush=True)
            out = run_worker(
                {**job, "kind": kind, "threads": args.threads},
                python,
                args.threads,
                args.timeout,
                script=Path(__file__).resolve(),
            )
            row[kind] = out.result
            if out.error:
                row[f"{kind}_error"] = out.error
            print(f"{out.seconds:.0f} s" + (f"  FAILED: {out.error}" if out.error else ""))
    summary["load"] = os.getloadavg() if hasattr(os, "getloadavg") else None
    report(args, summary)
    return summary


def report(args: argparse.Namespace, summary: dict[str, Any]) -> None:
    """Write the markdown report (and the JSON, with ``--json``)."""
    if args.json:
        Path(args.json).write_text(json.dumps(summary, indent=1))
    Path(args.out).write_text(markdown(summary))


# --- the report -------------------------------------------------------------------------------


def markdown(s: dict[str, Any]) -> str:
    """docs/bench-types.md."""
    sh = s["shape"]
    load = ", ".join(f"{x:.1f}" for x in s["load"]) if s.get("load") else "-"
    out = [
        "# Decode per weight type, 1B shape",
        "",
        "Written by `python benchmarks/per_type.py` (see its docstring). Each file: a synthetic "
        f"llama of the 1B shape ({sh['n_embd']} wide, n_ff {sh['n_ff']}, {sh['n_head']} / "
        f"{sh['n_head_kv']} heads, untied output) with **{s['layers']} layers**, every 2-D "
        "weight of the row's type. qllama: numpy backend, numba kernels; llama.cpp: "
        f"llama-cpp-python. {s['threads']} thread(s) each, {s['steps']} timed decode steps "
        f"after a {PROMPT}-token prompt and {WARMUP} warm-up steps, median of {s['repeats']} "
        "run(s), both sides in the same run, each in a process of its own. **GB/s**: bytes "
        "of the 2-D weights one step streams x tok/s (CPU time). The ratio is qllama / "
        "llama.cpp; on a busy machine the CPU-time one is the one to read. Load average at "
        f"the last type's start: {load}.",
        "",
    ]
    if s.get("llama_note"):
        out += [f"llama.cpp not measured: {s['llama_note']}.", ""]
    out += [
        "| type | streamed MB | qllama tok/s (CPU) | llama.cpp tok/s (CPU) | ratio (CPU) "
        "| GB/s qllama / llama.cpp | tok/s wall qllama / llama.cpp | ratio (wall) |",
        "|---|--:|--:|--:|--:|--:|--:|--:|",
    ]
    for qtype, r in s["rows"].items():
        if "file" not in r:
            why = r.get("error") or "no compiled kernel in qllama (the numpy oracle): not run"
            out.append(f"| {qtype} | | | | | | | {why} |")
            continue
        q, lc = r.get("qllama") or {}, r.get("llama_cpp") or {}
        gb = r["streamed_mb"] / 1e3
        qc, lcc = q.get("cpu_tok_s"), lc.get("cpu_tok_s")
        qw, lw = q.get("wall_tok_s"), lc.get("wall_tok_s")
        note = "; ".join(r[k] for k in ("qllama_error", "llama_cpp_error") if r.get(k))
        two = "{:.2f}"
        out.append(
            f"| {qtype} | {r['streamed_mb']:.0f} | {fmt(qc, two)} | {fmt(lcc, two)} "
            f"| **{fmt(ratio(qc, lcc), '{:.2f}x')}** "
            f"| {fmt(qc and gb * qc)} / {fmt(lcc and gb * lcc)} "
            f"| {fmt(qw, two)} / {fmt(lw, two)} | {fmt(ratio(qw, lw), '{:.2f}x')}"
            + (f" ({note})" if note else "")
            + " |"
        )
    return "\n".join([*out, ""])


def parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--types", nargs="+", default=list(TYPES))
    p.add_argument("--layers", type=int, help="layers of each file (default: the 1B shape's 16)")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--steps", type=int, default=8, help="timed decode steps")
    p.add_argument("--repeats", type=int, default=1)
    p.add_argument("--timeout", type=float, default=900, help="seconds per worker")
    p.add_argument("--with-oracle", action="store_true", help="also types without a kernel")
    p.add_argument("--out", default=str(HERE.parent / "docs" / "bench-types.md"))
    p.add_argument("--json", help="also write the raw results here")
    p.add_argument("--llama-python", default=sys.executable, help="python with llama-cpp-python")
    p.add_argument("--llama-note", help="why llama.cpp is not measured (skips it)")
    p.add_argument("--worker", help=argparse.SUPPRESS)
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    if args.worker:
        job = json.loads(args.worker)
        pin_cpus(job["threads"])
        print("RESULT " + json.dumps(WORKERS[job["kind"]](job)), flush=True)
        return 0
    unknown = sorted(set(args.types) - set(TYPES))
    if unknown:
        print(f"unknown types {unknown}; choose from {' '.join(TYPES)}", file=sys.stderr)
        return 2
    measure(args)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
