"""Speed and memory of qllama's backends against transformers and llama.cpp: docs/bench.md.

    python benchmarks/bench.py [--out docs/bench.md] [--threads 2] [--quick] [--only TEXT]
                               [--no-scale] [--scale-3b]

(``nox -s bench`` runs it with every peer installed.) On the SmolLM2 F32, Q8_0 and Q4_K_M
files, with the same token ids everywhere (the study's chat prompt and 300 greedy tokens),
each configuration runs in a process of its own, pinned to ``--threads`` CPUs with every
thread pool sized to match, and reports load time, prefill and all-position teacher-forcing
throughput, step-by-step decoding throughput and its peak RSS. Medians of ``--repeats``
runs, after a warm-up run. Wall-clock numbers depend on what else the machine runs: the
report records the load average before and after. Then the section "At scale"
(benchmarks/scale.py): the CPU arithmetic against llama.cpp on 135M, 1B (and, with
``--scale-3b``, 3B) llamas, with GB/s beside the machine's copy bandwidth, a scaling table and
decode time against context length; ``--only scale`` runs it alone, ``--no-scale`` skips it.
``--isa avx2`` builds both sides for AVX2 on an AVX-512 host (benchmarks/isa.py).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import isa  # noqa: E402  (beside this file)
import report  # noqa: E402
import scale  # noqa: E402
import workers  # noqa: E402
from common import (  # noqa: E402
    CPU_ROWS,
    FILES,
    LLAMA_CPP,
    LLAMA_PERPLEXITY,
    MESSAGES,
    MODEL,
    NEW_TOKENS,
    OBSERVER,
    PPL_CORPUS,
    PPL_CTX,
    TRANSFORMERS,
    Config,
    Outcome,
    chosen,
    run_worker,
)

# label, backend, options, files (None: all), slow, environment
QLLAMA: list[tuple[str, str, dict[str, Any], tuple[str, ...] | None, bool, dict[str, str]]] = [
    ("numpy cpu (numba kernels)", "numpy", {"kernels": "numba"}, None, False, {}),
    # the kernels cap BLAS at one thread by default; here BLAS keeps its 2, whose idle
    # threads spin-wait on the cores numba's 2 need (the attention products go to BLAS)
    (
        "numpy cpu (numba kernels, 2 BLAS threads)",
        "numpy",
        {"kernels": "numba", "blas_threads": None},
        ("Q8_0", "Q4_K_M"),
        False,
        {},
    ),
    ("numpy cpu (numpy oracle)", "numpy", {"kernels": "numpy"}, ("Q8_0",), True, {}),
    ("numpy dequantize-all", "numpy", {"dequantize_all": True}, None, False, {}),
    ("numpy f32 activations", "numpy", {"activations": "f32"}, None, False, {}),
    ("torch (gpu arithmetic, cpu)", "torch", {}, None, False, {}),
    ("torch dequantize-all", "torch", {"dequantize_all": True}, None, False, {}),
    ("jax", "jax", {}, None, False, {}),
]
# corpus perplexity at n_ctx PPL_CTX (issue 14): label, load options; then llama-perplexity
# itself (the row LLAMA_PERPLEXITY)
PERPLEXITY: list[tuple[str, dict[str, Any]]] = [
    ("perplexity: numpy dequantize-all", {"dequantize_all": True}),
    # + qllama.measure.perplexity.LLAMA_CPP_CPU, added by the worker
    ("perplexity: numpy cpu as llama.cpp", {"kernels": "numba", "as_llama_cpp": True}),
]


def configs(paths: dict[str, str], only: str | None) -> list[Config]:
    rows = []
    for label, backend, options, files, slow, env in QLLAMA:
        for ft in files or FILES:
            job = {"kind": "qllama", "backend": backend, "options": options, "file": paths[ft]}
            job["profile"] = label in CPU_ROWS and ft != "F32"
            job["env"] = env
            rows.append(Config(label, ft, job, slow))
    rows.append(Config(TRANSFORMERS, "F32", {"kind": "transformers", "file": paths["F32"]}))
    for ft in FILES:
        for logits_all in (False, True):
            job = {"kind": "llama_cpp", "file": paths[ft], "logits_all": logits_all}
            rows.append(Config(LLAMA_CPP, ft, job))
    return [c for c in rows if chosen(only, c.name)]


def perplexity_configs(
    paths: dict[str, str], windows: int, llama_bin: str | None, only: str | None
) -> list[Config]:
    """qllama and llama-perplexity over the same corpus windows, per file."""
    rows = []
    for ft in FILES:
        common = {"file": paths[ft], "n_ctx": PPL_CTX, "windows": windows, "corpus": PPL_CORPUS}
        for label, options in PERPLEXITY:
            rows.append(Config(label, ft, {"kind": "perplexity", "options": options, **common}))
        if llama_bin:
            job = {"kind": "llama_perplexity", "llama_bin": llama_bin, **common}
            rows.append(Config(LLAMA_PERPLEXITY, ft, job))
    return [c for c in rows if chosen(only, c.name)]


# --- running ----------------------------------------------------------------------------------


def probe(python: str, module: str) -> str | None:
    """The version of ``module`` under ``python``, or None if it cannot be imported."""
    code = f"import {module}; print(getattr({module}, '__version__', '?'))"
    try:
        run = subprocess.run(
            [python, "-c", code], capture_output=True, text=True, timeout=120, check=False
        )
    except (OSError, subprocess.TimeoutExpired):
        return None
    return run.stdout.strip() if run.returncode == 0 else None


def run_serving(args: argparse.Namespace, file: str, llama_note: str | None) -> Any:
    """benchmarks/serve_load.py on the Q8_0 file (qllama serve, and llama-cpp-python's server
    unless llama.cpp is missing); its results, or None if it could not run."""
    import tempfile

    servers = "qllama" if llama_note else "qllama,llama-cpp-python"
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "serving.json"
        cmd = [sys.executable, str(HERE / "serve_load.py"), "--file", file, "--json", str(out)]
        cmd += ["--servers", servers, "--threads", str(args.threads)]
        cmd += ["--requests", str(args.serve_requests), "--llama-python", args.llama_python]
        print("serving load test ...", end=" ", flush=True)
        t = time.perf_counter()
        try:
            subprocess.run(cmd, timeout=4 * 3600, check=False, stdout=subprocess.DEVNULL)
        except subprocess.TimeoutExpired:
            print("timed out", flush=True)
            return None
        print(f"{time.perf_counter() - t:.0f} s", flush=True)
        return json.loads(out.read_text()) if out.exists() else None


# --- the environment --------------------------------------------------------------------------


def machine() -> dict[str, Any]:
    info: dict[str, Any] = {"platform": platform.platform(), "cpus": os.cpu_count()}
    try:
        text = Path("/proc/cpuinfo").read_text()
        names = [
            ln.split(":", 1)[1].strip() for ln in text.splitlines() if ln.startswith("model name")
        ]
        info["cpu"] = names[0] if names else platform.processor()
        flags = next((ln for ln in text.splitlines() if ln.startswith("flags")), "")
        info["simd"] = " ".join(
            f for f in ("avx2", "avx512f", "avx512_vnni", "amx_int8") if f" {f}" in flags
        )
        mem = Path("/proc/meminfo").read_text().splitlines()[0].split()[1]
        info["memory_gb"] = round(int(mem) / 2**20, 1)
    except (OSError, IndexError, ValueError):
        info["cpu"] = platform.processor() or platform.machine()
    return info


def _git(*args: str) -> str:
    """What a git command prints in this checkout ("" where it fails or git is missing)."""
    try:
        run = subprocess.run(["git", *args], cwd=HERE, capture_output=True, text=True)
    except OSError:
        return ""
    return run.stdout.strip()


def versions(python: str) -> dict[str, str]:
    import numpy

    import qllama

    out = {"python": platform.python_version(), "numpy": numpy.__version__}
    out["qllama"] = getattr(qllama, "__version__", "?")
    for module in ("numba", "torch", "transformers", "jax"):
        out[module] = probe(python, module) or "not installed"
    commit = _git("rev-parse", "--short", "HEAD")
    if commit:
        dirty = _git("status", "--porcelain", "--untracked-files=no")
        out["qllama"] += f" ({commit}{' + local changes' if dirty else ''})"
    return out


# --- main -------------------------------------------------------------------------------------


def parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default=str(HERE.parent / "docs" / "bench.md"))
    p.add_argument("--json", help="also write the raw results here")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--decode-steps", type=int, default=32)
    p.add_argument("--quick", action="store_true", help="1 repeat, 16 decode steps")
    p.add_argument("--only", help="run the configurations whose name contains this (A|B: either)")
    p.add_argument("--timeout", type=float, default=900, help="seconds per configuration")
    p.add_argument("--llama-python", default=sys.executable, help="python with llama-cpp-python")
    p.add_argument("--llama-note", help="why llama.cpp is missing (the nox session sets it)")
    p.add_argument("--llama-bin", help="llama.cpp's tools (llama-perplexity), for perplexity")
    p.add_argument(
        "--ppl-windows", type=int, default=16, help="corpus windows of 512 for perplexity"
    )
    p.add_argument("--serve-requests", type=int, default=50, help="per client, serve_load.py")
    p.add_argument("--no-serve", action="store_true", help="skip the serving load test")
    p.add_argument(
        "--isa",
        choices=isa.ISAS,
        help="build both sides for this instruction set (AVX2 on an AVX-512 host: isa.py)",
    )
    p.add_argument("--worker", help=argparse.SUPPRESS)
    scale.add_arguments(p)
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    if args.worker:
        workers.main(args.worker)
        return 0
    from qllama.model_files import variant

    if args.quick:
        args.repeats, args.decode_steps = 1, 16
    if args.isa:
        print(f"llama.cpp for {args.isa}: building or loading from the cache ...", flush=True)
        args.llama_bin = isa.llama_bin(args.isa)
        # every worker inherits it, scale.py's too
        os.environ.update(isa.environment(args.isa, args.llama_bin))
    started = datetime.datetime.now(datetime.timezone.utc)
    load_before = os.getloadavg() if hasattr(os, "getloadavg") else None
    paths = {ft: str(variant(MODEL, ft)) for ft in FILES}
    sizes = {ft: os.path.getsize(p) / 1e6 for ft, p in paths.items()}

    # `--only scale`: that section alone, without the token ids of the others
    smol = not (args.only is not None and scale.selected(args))
    ids: list[int] = []
    prompt_len, first_stop = 0, None
    if smol:
        print("token ids: prompt + greedy continuation ...", flush=True)
        ids_job = {
            "kind": "ids",
            "file": paths["F32"],
            "messages": MESSAGES,
            "new_tokens": NEW_TOKENS,
        }
        got = run_worker({**ids_job, "threads": args.threads}, sys.executable, args.threads, 1800)
        if got.result is None:
            print(f"cannot make the token ids: {got.error}", file=sys.stderr)
            return 1
        ids, prompt_len = got.result["ids"], got.result["prompt_len"]
        first_stop = got.result.get("first_stop")

    if smol and probe(sys.executable, "numba"):
        print("numba kernels: compiling or loading from the cache ...", flush=True)
        for ft in FILES:
            warm = run_worker(
                {"kind": "warm", "file": paths[ft], "threads": args.threads},
                sys.executable,
                args.threads,
                1800,
            )
            if warm.error:
                print(f"  {ft}: {warm.error}", file=sys.stderr)

    llama_version = probe(args.llama_python, "llama_cpp")
    llama_note = args.llama_note or (
        None if llama_version else f"llama-cpp-python is not importable by {args.llama_python}"
    )
    outcomes: dict[str, tuple[Config, Outcome]] = {}
    for c in configs(paths, args.only):
        if c.job["kind"] == "llama_cpp" and llama_note:
            continue
        job = {
            **c.job,
            "ids": ids,
            "prompt_len": prompt_len,
            "threads": args.threads,
            "repeats": 1 if c.slow else args.repeats,
            "decode_steps": 4 if c.slow else args.decode_steps,
            "warmup_steps": 1 if c.slow else 4,
        }
        python = args.llama_python if c.job["kind"] == "llama_cpp" else sys.executable
        key = c.name + (" (logits_all)" if c.job.get("logits_all") else "")
        print(f"{key} ...", end=" ", flush=True)
        out = run_worker(job, python, args.threads, args.timeout)
        print(f"{out.seconds:.0f} s" + (f"  FAILED: {out.error}" if out.error else ""), flush=True)
        outcomes[key] = (c, out)

    for c in perplexity_configs(paths, args.ppl_windows, args.llama_bin, args.only):
        job = {**c.job, "threads": args.threads}
        print(f"{c.name} ...", end=" ", flush=True)
        out = run_worker(job, sys.executable, args.threads, args.timeout)
        print(f"{out.seconds:.0f} s" + (f"  FAILED: {out.error}" if out.error else ""), flush=True)
        outcomes[c.name] = (c, out)

    observer = None
    if chosen(args.only, OBSERVER):
        print(f"{OBSERVER} ...", end=" ", flush=True)
        job = {
            "kind": "observer",
            "file": paths["Q8_0"],
            "ids": ids,
            "prompt_len": prompt_len,
            "threads": args.threads,
            "repeats": max(5, args.repeats),
            "decode_steps": args.decode_steps,
        }
        out = run_worker(job, sys.executable, args.threads, args.timeout)
        print(f"{out.seconds:.0f} s" + (f"  FAILED: {out.error}" if out.error else ""), flush=True)
        observer = out.result

    serving = None
    if not args.no_serve and chosen(args.only, "serving"):
        serving = run_serving(args, paths["Q8_0"], llama_note)

    at_scale = scale.run(args, llama_note) if scale.selected(args) else None

    info = {
        "scale": at_scale,
        "serving": serving,
        "observer": observer,
        "date": started.strftime("%Y-%m-%d %H:%M UTC"),
        "machine": machine(),
        "isa": args.isa,
        "load_before": load_before,
        "load_after": os.getloadavg() if hasattr(os, "getloadavg") else None,
        "versions": {**versions(sys.executable), "llama-cpp-python": llama_version or "-"},
        "threads": args.threads,
        "repeats": args.repeats,
        "decode_steps": args.decode_steps,
        "tokens": len(ids),
        "prompt_len": prompt_len,
        "first_stop": first_stop,
        "file_mb": sizes,
        "llama_note": llama_note,
        "ppl_windows": args.ppl_windows,
        "ppl_llama_bin": bool(args.llama_bin),
    }
    report.write_report(Path(args.out), info, outcomes)
    if args.json:
        from qllama.atomic import atomic_write

        raw = {k: {"result": o.result, "error": o.error} for k, (_, o) in outcomes.items()}
        with atomic_write(args.json, "w") as f:
            json.dump({"info": info, "results": raw}, f, indent=1)
    print(f"wrote {args.out}")
    if args.only is None:  # qllama.hf against generate's loop, and loading: transformers_bench.md
        hf = [sys.executable, str(HERE / "hf_generate.py"), "--threads", str(args.threads)]
        subprocess.run(hf + (["--quick"] if args.quick else []), check=False)
    return 0


if __name__ == "__main__":
    sys.exit(main())
