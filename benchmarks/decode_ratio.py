"""Decode speed of the CPU arithmetic (numba kernels) against llama.cpp on the same files.

    python benchmarks/decode_ratio.py [--types IQ4_XS Q4_K_M] [--threads 2] [--steps 32]

A short check between full ``nox -s bench`` runs: for each SmolLM2 file type (built from the
F32 file by qllama's quantizer, cached), qllama's ``numpy`` backend with the compiled
kernels and llama.cpp (llama-cpp-python) each decode the study's prompt step by step in a
process of their own, pinned to ``--threads`` CPUs (benchmarks/workers.py, as bench.py runs
them); the median tokens/s and their ratio are printed, with the machine's load average
(a busy machine slows both, but not always alike).
"""

from __future__ import annotations

import argparse
import os
import sys

from bench import MESSAGES, MODEL, run_worker


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--types", nargs="+", default=["IQ4_XS", "Q4_K_M"])
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--steps", type=int, default=32, help="timed decode steps")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--timeout", type=float, default=3600)
    args = p.parse_args(argv)

    from qllama.model_files import variant

    f32 = str(variant(MODEL, "F32"))
    ids_job = {"kind": "ids", "file": f32, "messages": MESSAGES, "new_tokens": args.steps + 8}
    got = run_worker({**ids_job, "threads": args.threads}, sys.executable, args.threads, 1800)
    if got.result is None:
        print(f"cannot make the token ids: {got.error}", file=sys.stderr)
        return 1
    common = {
        "ids": got.result["ids"],
        "prompt_len": got.result["prompt_len"],
        "threads": args.threads,
        "repeats": args.repeats,
        "decode_steps": args.steps,
        "warmup_steps": 4,
    }
    print(f"load average before: {os.getloadavg()[0]:.2f}")
    for ft in args.types:
        path = str(variant(MODEL, ft))
        run_worker(
            {"kind": "warm", "file": path, "threads": args.threads},
            sys.executable,
            args.threads,
            1800,
        )
        ours = run_worker(
            {
                **common,
                "kind": "qllama",
                "backend": "numpy",
                "options": {"kernels": "numba"},
                "file": path,
            },
            sys.executable,
            args.threads,
            args.timeout,
        )
        theirs = run_worker(
            {**common, "kind": "llama_cpp", "file": path, "logits_all": False},
            sys.executable,
            args.threads,
            args.timeout,
        )
        if ours.result is None or theirs.result is None:
            print(f"{ft}: qllama {ours.error or 'ok'}; llama.cpp {theirs.error or 'ok'}")
            continue
        a, b = ours.result["decode_tok_s"], theirs.result["decode_tok_s"]
        print(
            f"{ft}: qllama numba kernels {a:.1f} tok/s, llama.cpp {b:.1f} tok/s: {a / b:.2f}x "
            f"(runs {[round(r, 1) for r in ours.result['decode_runs']]} / "
            f"{[round(r, 1) for r in theirs.result['decode_runs']]})"
        )
    print(f"load average after: {os.getloadavg()[0]:.2f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
