"""Where a decoding process's resident memory goes: one GGUF file, qllama's CPU arithmetic
(numba kernels), a fresh process for each way it is run.

Each process imports qllama, loads the file, prefills a prompt and decodes, as
``benchmarks/bench.py`` and ``benchmarks/moe.py`` do, then reads ``/proc/self/smaps`` and
``/proc/self/status``:

* the peak RSS (``VmHWM``) at each stage: import, load, prefill, decode;
* the resident pages at the end by what holds them: the model file's map, llvmlite's library
  (LLVM's code), anonymous memory (Python's heap, numba's code, the KV cache, buffers), the
  other libraries;
* which heavy modules the process imported.

Two ways: qllama as it ships, and with LLVM's pages kept resident after each compile or load
(``qllama/jit.py`` gives them back by default), so that what that saves is measured in one
run. Linux only (``/proc``).

    python benchmarks/footprint.py FILE.gguf [FILE.gguf ...] [--out docs/footprint.md]
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from pathlib import Path
from typing import Any

from common import memory_mb, worker_result

PROMPT = 16  # tokens prefilled, as benchmarks/moe.py
STEPS = 64  # tokens decoded after them
N_CTX = 1024
HEAVY = ("jinja2", "tokenizers", "numpy.testing", "numpy.f2py", "numpy.ma", "scipy", "unittest")
WAYS = {"as shipped": False, "LLVM's pages kept": True}


def resident_by_holder(file: str) -> dict[str, float]:
    """This process's resident MB by what holds the pages, from ``/proc/self/smaps``."""
    from qllama.jit import mappings, read_smaps

    out = {"file": 0.0, "llvmlite": 0.0, "anonymous": 0.0, "other libraries": 0.0}
    for m in mappings(read_smaps()):
        if m.path == str(Path(file).resolve()):
            holder = "file"
        elif "libllvmlite" in m.path:
            holder = "llvmlite"
        elif not m.path or m.path.startswith("["):
            holder = "anonymous"
        else:
            holder = "other libraries"
        out[holder] += m.kb.get("Rss", 0) / 1024
    return out


def run_worker(job: dict[str, Any]) -> dict[str, Any]:
    """One file, one way, in this process."""
    stages: dict[str, float] = {}
    if job["keep_llvm_pages"]:
        from numba.core import event

        import qllama.jit as jit

        event.unregister("numba:compiler_lock", jit._COMPILER_PAGES)
    import numba

    import qllama
    from qllama.array_api import to_numpy

    stages["import"] = memory_mb()["peak_rss_mb"]
    numba.set_num_threads(job["threads"])
    model = qllama.load(job["file"], backend="numpy", kernels="numba", threads=job["threads"])
    stages["load"] = memory_mb()["peak_rss_mb"]
    ids = [(7 * i + 3) % model.config.n_vocab for i in range(PROMPT + STEPS)]
    to_numpy(model.forward(ids[:PROMPT], 0))
    stages["prefill"] = memory_mb()["peak_rss_mb"]
    for pos in range(PROMPT, PROMPT + STEPS):
        to_numpy(model.forward([ids[pos]], pos))
    stages["decode"] = memory_mb()["peak_rss_mb"]
    return {
        "peaks": stages,
        "rss_mb": memory_mb()["rss_mb"],
        "holders": resident_by_holder(job["file"]),
        "modules": [m for m in HEAVY if m in sys.modules],
    }


def markdown(results: dict[str, dict[str, Any]], files: list[str]) -> str:
    stamp = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    lines = [
        "# Footprint: where a decoding process's resident memory goes",
        "",
        f"Written by `python benchmarks/footprint.py` on {stamp}; "
        f"{platform.machine()}, Python {platform.python_version()}. qllama's CPU arithmetic "
        f"(numba kernels, disk cache warm), {PROMPT}-token prompt then {STEPS} decode steps, "
        "a fresh process each row. **As shipped**: `qllama/jit.py` gives LLVM's clean pages "
        "back after each compile or load; **LLVM's pages kept**: that listener removed first.",
        "",
        "| file | way | peak RSS after import / load / prefill / decode (MB) | RSS at the end "
        "| file's pages | llvmlite | anonymous | other libraries | heavy modules imported |",
        "|---|---|--:|--:|--:|--:|--:|--:|---|",
    ]
    for file in files:
        for way in WAYS:
            r = results[f"{file}|{way}"]
            if "error" in r:
                lines.append(f"| {Path(file).name} | {way} | {r['error']} | | | | | | |")
                continue
            p, h = r["peaks"], r["holders"]
            peaks = " / ".join(f"{p[s]:.0f}" for s in ("import", "load", "prefill", "decode"))
            lines.append(
                f"| {Path(file).name} | {way} | {peaks} | {r['rss_mb']:.0f} | {h['file']:.0f} "
                f"| {h['llvmlite']:.0f} | {h['anonymous']:.0f} | {h['other libraries']:.0f} "
                f"| {', '.join(r['modules']) or '-'} |"
            )
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("files", nargs="*", help="GGUF files")
    p.add_argument("--out", help="write the table here (markdown); default: print it")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--worker", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.worker:
        print("RESULT " + json.dumps(run_worker(json.loads(args.worker))))
        return 0
    if not sys.platform.startswith("linux"):
        p.error("the footprint is read from /proc: Linux only")
    if not args.files:
        p.error("name at least one GGUF file")
    results = {}
    for file in args.files:
        for way, keep in WAYS.items():
            job = {"file": str(Path(file).resolve()), "threads": args.threads}
            job["keep_llvm_pages"] = keep
            results[f"{file}|{way}"] = worker_result(job, 1800, __file__)
    text = markdown(results, args.files)
    if args.out:
        from qllama.atomic import atomic_write

        with atomic_write(args.out, "w") as f:
            f.write(text)
    else:
        print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
