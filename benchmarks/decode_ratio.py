"""Decode speed of the CPU arithmetic (numba kernels) against llama.cpp on the same files.

    python benchmarks/decode_ratio.py [--types IQ4_XS Q4_K_M] [--threads 1] [--steps 32]

A short check between full ``nox -s bench`` runs. For each SmolLM2 file type (built from the
F32 file by qllama's quantizer, cached), qllama's ``numpy`` backend with the compiled kernels
and llama.cpp (llama-cpp-python) each prefill the study's prompt and decode step by step, in
a process of their own with ``--threads`` threads in every pool. Printed: tokens per second
of wall time and per second of the process's CPU time. On a busy machine the wall-clock
rates say little (other processes take the cores, and both sides spin-wait differently);
with one thread the CPU-time rate is what the work costs, so its ratio is the one to read
there.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

from common import MESSAGES, MODEL

HERE = Path(__file__).resolve().parent


def _env(threads: int) -> dict[str, str]:
    env = dict(os.environ)
    for var in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS", "NUMBA_NUM_THREADS"):
        env[var] = str(threads)
    return env


def worker(kind: str, path: str, ids: list[int], n_prompt: int, threads: int) -> dict[str, float]:
    """Decode ``ids[n_prompt:]`` one token at a time after a prefill; wall and CPU seconds."""
    if kind == "qllama":
        import qllama

        model = qllama.load(path, backend="numpy", kernels="numba", threads=threads)
        start = lambda: model.forward(ids[:n_prompt], 0)  # noqa: E731
        step = lambda tok, pos: model.forward([tok], pos)  # noqa: E731
    else:
        import llama_cpp

        llm = llama_cpp.Llama(
            model_path=path, n_ctx=512, n_threads=threads, n_threads_batch=threads, verbose=False
        )

        def start() -> None:
            llm.reset()
            llm.eval(ids[:n_prompt])

        step = lambda tok, pos: llm.eval([tok])  # noqa: E731
    walls, cpus = [], []
    for _ in range(3):
        start()
        for i in range(4):  # warm-up
            step(ids[n_prompt + i], n_prompt + i)
        w, c = time.perf_counter(), time.process_time()
        steps = range(4, len(ids) - n_prompt)
        for i in steps:
            step(ids[n_prompt + i], n_prompt + i)
        walls.append(len(steps) / (time.perf_counter() - w))
        cpus.append(len(steps) / (time.process_time() - c))
    return {"wall_tok_s": statistics.median(walls), "cpu_tok_s": statistics.median(cpus)}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--types", nargs="+", default=["IQ4_XS", "Q4_K_M"])
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--steps", type=int, default=32, help="timed decode steps")
    p.add_argument("--worker", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.worker:
        job = json.loads(args.worker)
        print("RESULT " + json.dumps(worker(**job)), flush=True)
        return 0

    from qllama.model_files import variant
    from qllama.runtime.loader import load

    f32 = load(variant(MODEL, "F32"), backend="numpy", dequantize_all=True)
    prompt = f32.apply_chat_template(MESSAGES)
    new = list(f32.generate(prompt, max_new_tokens=args.steps + 4).ids)
    while len(new) < args.steps + 4:  # an early end of turn: go on with any tokens
        new += prompt
    ids = [*prompt, *new[: args.steps + 4]]
    del f32
    print(f"load average before: {os.getloadavg()[0]:.2f}; {args.threads} thread(s)")
    for ft in args.types:
        path = str(variant(MODEL, ft))
        rates = {}
        for kind in ("qllama", "llama.cpp"):
            job = {
                "kind": kind,
                "path": path,
                "ids": ids,
                "n_prompt": len(prompt),
                "threads": args.threads,
            }
            run = subprocess.run(
                [sys.executable, str(Path(__file__)), "--worker", json.dumps(job)],
                capture_output=True,
                text=True,
                env=_env(args.threads),
                check=False,
            )
            lines = [ln for ln in run.stdout.splitlines() if ln.startswith("RESULT ")]
            if not lines:
                print(f"{ft} {kind}: failed: {run.stderr.strip().splitlines()[-1:]}")
                break
            rates[kind] = json.loads(lines[-1][7:])
        if len(rates) == 2:
            a, b = rates["qllama"], rates["llama.cpp"]
            print(
                f"{ft}: qllama {a['wall_tok_s']:.1f} tok/s wall, {a['cpu_tok_s']:.1f} per CPU-s; "
                f"llama.cpp {b['wall_tok_s']:.1f} wall, {b['cpu_tok_s']:.1f} per CPU-s; "
                f"ratio {a['wall_tok_s'] / b['wall_tok_s']:.2f}x wall, "
                f"{a['cpu_tok_s'] / b['cpu_tok_s']:.2f}x CPU time"
            )
    print(f"load average after: {os.getloadavg()[0]:.2f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
