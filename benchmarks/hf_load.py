"""Loading a GGUF file the transformers way: qllama's drop-in, transformers' ``gguf_file=``
and llama-cpp-python, on the same files.

    python benchmarks/hf_load.py [--files Q4_K_M,Q8_0] [--threads 2] [--repeats 3]
                                 [--out FILE] [--quick]

(benchmarks/hf_generate.py runs it and appends its section to docs/transformers_bench.md.)
Each load runs in a fresh process, after the process has imported its libraries:

- **qllama.hf drop-in**: ``qllama.hf.AutoModelForCausalLM.from_pretrained(path)`` and
  ``AutoTokenizer.from_pretrained(path)`` (the weights as the file stores them);
- **transformers gguf_file=**: ``transformers.AutoModelForCausalLM.from_pretrained(folder,
  gguf_file=name)`` and its tokenizer (it dequantizes every weight, to float32 by default);
- **llama-cpp-python**: ``llama_cpp.Llama(model_path=path)`` (absent: the row says why).

Load time is the wall time of those calls; peak RSS is the process's VmHWM after loading and
after a short greedy generation (8 tokens of the study's chat prompt), beside its RSS after
the imports alone. The file size is the yardstick: "memory about the file's size".
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from common import (  # noqa: E402
    MESSAGES,
    MODEL,
    fmt,
    median_of,
    memory_mb,
    pin_cpus,
    worker_result,
)

KINDS = {
    "dropin": "qllama.hf drop-in (numpy cpu)",
    "transformers": "transformers gguf_file=",
    "llama_cpp": "llama-cpp-python",
}
FILES = ("Q4_K_M", "Q8_0")
GENERATE = 8  # greedy tokens after loading: the first forward passes' memory too


def _dropin(path: str, threads: int) -> tuple[Any, Any]:
    from qllama.hf import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(path, n_threads=threads)
    return model, AutoTokenizer.from_pretrained(path)


def _transformers(path: str, threads: int) -> tuple[Any, Any]:
    import transformers

    folder, name = os.path.split(path)
    model = transformers.AutoModelForCausalLM.from_pretrained(folder, gguf_file=name)
    return model, transformers.AutoTokenizer.from_pretrained(folder, gguf_file=name)


def _generate_hf(model: Any, tok: Any) -> int:
    import torch

    enc = tok.apply_chat_template(MESSAGES, add_generation_prompt=True, return_dict=True)
    ids = torch.tensor([enc["input_ids"]])
    with torch.no_grad():
        out = model.generate(ids, max_new_tokens=GENERATE, do_sample=False)
    return int(out.shape[1] - ids.shape[1])


def worker(job: dict[str, Any]) -> dict[str, Any]:
    """Import, load (timed), measure memory, generate a few tokens, measure again."""
    pin_cpus(job["threads"])
    kind, path, threads = job["kind"], job["file"], job["threads"]
    if kind == "llama_cpp":
        import llama_cpp

        imported = memory_mb()["rss_mb"]
        t = time.perf_counter()
        llm = llama_cpp.Llama(model_path=path, n_ctx=512, n_threads=threads, verbose=False)
        seconds = time.perf_counter() - t
        loaded = memory_mb()
        out = llm.create_chat_completion(MESSAGES, max_tokens=GENERATE, temperature=0.0)
        new = int(out["usage"]["completion_tokens"])
        version, params = f"llama-cpp-python {llama_cpp.__version__}", None
    else:
        import torch
        import transformers

        import qllama.hf  # noqa: F401  (its import cost is in both kinds' baseline)

        torch.set_num_threads(threads)
        imported = memory_mb()["rss_mb"]
        t = time.perf_counter()
        model, tok = (_dropin if kind == "dropin" else _transformers)(path, threads)
        seconds = time.perf_counter() - t
        loaded = memory_mb()
        new = _generate_hf(model, tok)
        from qllama.version import __version__ as qllama_version

        version = f"qllama {qllama_version}, " if kind == "dropin" else ""
        version += f"transformers {transformers.__version__}"
        params = sum(p.numel() * p.element_size() for p in model.parameters()) / 1e6
    return {
        "load_s": seconds,
        "import_rss_mb": imported,
        "loaded_peak_rss_mb": loaded["peak_rss_mb"],
        "generated": new,
        "version": version,
        "param_mb": params,
        **memory_mb(),
    }


def available(module: str) -> bool:
    """Whether this interpreter can import ``module`` (checked in a child: no import here)."""
    code = f"import importlib.util, sys; sys.exit(importlib.util.find_spec({module!r}) is None)"
    return subprocess.run([sys.executable, "-c", code], check=False).returncode == 0


def measure(
    files: list[str], threads: int, repeats: int, timeout: float
) -> tuple[dict[str, dict[str, list[dict[str, Any]]]], dict[str, str]]:
    """Every kind on every file, ``repeats`` times, interleaved; and why a kind was skipped."""
    from qllama.model_files import variant

    skipped: dict[str, str] = {}
    if not available("llama_cpp"):
        skipped["llama_cpp"] = (
            "llama-cpp-python is not installed in this environment (nox -s bench builds it)"
        )
    kinds = [k for k in KINDS if k not in skipped]
    results: dict[str, dict[str, list[dict[str, Any]]]] = {}
    for ft in files:
        path = str(variant(MODEL, ft))
        results[ft] = {k: [] for k in kinds}
        for i in range(repeats):
            for kind in kinds:
                got = worker_result(
                    {"kind": kind, "file": path, "threads": threads}, timeout, __file__
                )
                results[ft][kind].append(got)
                shown = got.get("error") or f"{got['load_s']:.2f} s, {got['peak_rss_mb']:.0f} MB"
                print(f"load {ft} / {KINDS[kind]} run {i + 1}: {shown}", flush=True)
    return results, skipped


# what each run reports, the medians the table shows
COLUMNS = ("load_s", "param_mb", "import_rss_mb", "loaded_peak_rss_mb", "peak_rss_mb")


def section(
    results: dict[str, dict[str, list[dict[str, Any]]]],
    skipped: dict[str, str],
    info: dict[str, Any],
) -> str:
    """The markdown section of the load measurements."""
    from qllama.model_files import variant

    out = [
        "## Loading: the drop-in against transformers' gguf_file= and llama-cpp-python",
        "",
        f"{info['date']}. SmolLM2-135M-Instruct, {info['threads']} threads, "
        f"{info['repeats']} run(s) of each kind, interleaved, each in a fresh process. "
        f"Load average (1 min) before / after: {info['load_before']} / {info['load_after']}.",
        "",
        "| file | file MB | loader | load s | parameters MB | RSS after imports MB "
        "| peak RSS loaded MB | peak RSS after 8 tokens MB | (peak - imports) / file |",
        "|---|--:|---|--:|--:|--:|--:|--:|--:|",
    ]
    failures = []
    for ft, kinds in results.items():
        size = os.path.getsize(variant(MODEL, ft)) / 1e6
        for kind, runs in kinds.items():
            ok = [r for r in runs if "error" not in r]
            failures += [f"{ft} / {KINDS[kind]}: {r['error']}" for r in runs if "error" in r]
            m = {k: median_of(ok, k) for k in COLUMNS}
            peak, base = m["peak_rss_mb"], m["import_rss_mb"]
            above = None if peak is None or base is None else (peak - base) / size
            out.append(
                f"| {ft} | {size:.0f} | {KINDS[kind]} | {fmt(m['load_s'], '{:.2f}')} "
                f"| {fmt(m['param_mb'], '{:.1f}')} | {fmt(base, '{:.0f}')} "
                f"| {fmt(m['loaded_peak_rss_mb'], '{:.0f}')} | {fmt(peak, '{:.0f}')} "
                f"| {fmt(above, '{:.1f}x')} |"
            )
    out.append("")
    for kind, why in skipped.items():
        out.append(f"- {KINDS[kind]}: not measured: {why}.")
    for f in failures:
        out.append(f"- failed run: {f}")
    out += [
        "",
        "Parameters MB: what the model holds as torch parameters (the drop-in: one float32 "
        "anchor; transformers: every weight dequantized). Peak RSS includes the libraries "
        "(RSS after imports: torch, transformers, qllama.hf); the last column is what loading "
        "and 8 tokens added, in file sizes (the file's pages mapped and read, the KV cache, the "
        "tokenizer, the compiled kernels' state). Versions: "
        f"{info['versions']}.",
        "",
    ]
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--files", default=",".join(FILES), help="SmolLM2 variants, comma-separated")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--quick", action="store_true", help="1 run of each kind")
    p.add_argument("--out", help="write the section to this file (default: print it)")
    p.add_argument("--timeout", type=float, default=900)
    p.add_argument("--worker", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.worker:
        print("RESULT " + json.dumps(worker(json.loads(args.worker))), flush=True)
        return 0
    text = run_section(args.files.split(","), args.threads, 1 if args.quick else args.repeats)
    if args.out:
        from qllama.atomic import atomic_write

        with atomic_write(args.out, "w") as f:
            f.write(text)
    print(text)
    return 0


def run_section(files: list[str], threads: int, repeats: int, timeout: float = 900) -> str:
    """Measure, then the markdown section (what hf_generate.py appends to its report)."""
    started = datetime.datetime.now(datetime.timezone.utc)
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else None
    results, skipped = measure(files, threads, repeats, timeout)
    versions = sorted(
        {v for kinds in results.values() for runs in kinds.values() for r in runs
         for v in r.get("version", "").split(", ") if v}
    )  # fmt: skip
    info = {
        "date": started.strftime("%Y-%m-%d %H:%M UTC"),
        "threads": threads,
        "repeats": repeats,
        "load_before": fmt(load, "{:.2f}"),
        "load_after": fmt(os.getloadavg()[0] if hasattr(os, "getloadavg") else None, "{:.2f}"),
        "versions": ", ".join(versions) or "-",
    }
    return section(results, skipped, info)


if __name__ == "__main__":
    sys.exit(main())
