"""transformers' ``generate`` on a qllama model against qllama's own decode loop, per token.

    python benchmarks/hf_generate.py [--file Q4_K_M] [--threads 2] [--repeats 3]
                                     [--out docs/transformers_bench.md] [--quick]

(``nox -s bench`` runs it after benchmarks/bench.py.) On SmolLM2's file, for each arithmetic,
two kinds of process run the same greedy decode of the study's chat prompt, interleaved
(qllama, transformers, qllama, ...) so that both see the same machine load:

- **qllama**: ``qllama.runtime.generation.generate_ids``, qllama's own loop;
- **generate**: the model loaded by the drop-in ``qllama.hf.AutoModelForCausalLM
  .from_pretrained`` and decoded by its ``generate`` (transformers' loop: its logits
  processors, stopping criteria and cache bookkeeping around the same ``Model.forward`` calls).

Then benchmarks/hf_load.py's section (``--no-load`` skips it): load time and peak RSS of the
drop-in against transformers' own ``gguf_file=`` and llama-cpp-python on the Q4_K_M and Q8_0
files.

Per token is the time between consecutive new tokens after the first (the prefill is not
in it), the median over the runs. Both kinds import torch, transformers and qllama.hf before
loading, so their peak RSS (VmHWM) differs by what each keeps while it generates, not by
library code. Wall-clock numbers depend on the machine's load: the report records it.
"""

from __future__ import annotations

import argparse
import datetime
import itertools
import json
import os
import statistics
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

# label, load options, new tokens (the torch backend decodes quantized files at ~2 tok/s on a CPU)
SETTINGS: list[tuple[str, dict[str, Any], int]] = [
    ("numpy cpu (numba kernels)", {"backend": "numpy", "kernels": "numba"}, 64),
    ("numpy dequantize-all", {"backend": "numpy", "dequantize_all": True}, 64),
    ("torch (gpu arithmetic, cpu)", {"backend": "torch"}, 12),
]
KINDS = ("qllama", "generate")
TARGET_TIME, TARGET_RSS = 1.10, 1.20  # generate within 10% per token, peak RSS within 20%


# --- one process: one run ---------------------------------------------------------------------


def worker(job: dict[str, Any]) -> dict[str, Any]:
    """Load, then decode ``job["tokens"]`` greedy tokens; the time of each new token."""
    pin_cpus(job["threads"])
    import torch
    import transformers

    import qllama
    from qllama.hf import AutoModelForCausalLM
    from qllama.runtime.generation import Sampler, generate_ids

    torch.set_num_threads(job["threads"])
    options = dict(job["options"])
    if options.get("kernels") == "numba":
        import numba

        numba.set_num_threads(job["threads"])
        options["threads"] = job["threads"]
    imported = memory_mb()["rss_mb"]
    n = job["tokens"]
    stamps: list[float] = []
    if job["kind"] == "qllama":
        llm = qllama.load(job["file"], **options)
        prompt = llm.apply_chat_template(MESSAGES)
        new = []
        for token in generate_ids(llm, prompt, max_new_tokens=n, sampler=Sampler()):
            stamps.append(time.perf_counter())  # no stop ids: exactly n tokens
            new.append(token)
    else:
        # the drop-in takes n_threads (llama-cpp-python's name) for the numpy backend's threads
        if "threads" in options:
            options["n_threads"] = options.pop("threads")
        model = AutoModelForCausalLM.from_pretrained(job["file"], **options)
        prompt = model.llm.apply_chat_template(MESSAGES)
        model.generation_config.eos_token_id = None  # n tokens, as the loop above

        class Clock(transformers.LogitsProcessor):
            def __call__(self, input_ids: Any, scores: Any) -> Any:
                stamps.append(time.perf_counter())  # once per new token, after its forward
                return scores

        out = model.generate(
            torch.tensor([prompt]),
            max_new_tokens=n,
            do_sample=False,
            pad_token_id=0,
            logits_processor=transformers.LogitsProcessorList([Clock()]),
        )
        new = out[0, len(prompt) :].tolist()
    steps = [b - a for a, b in itertools.pairwise(stamps)]
    return {
        "ms_per_token": 1e3 * statistics.mean(steps),
        "tokens": new,
        "import_rss_mb": imported,
        **memory_mb(),
    }


# --- the report -------------------------------------------------------------------------------


def ratio(a: float | None, b: float | None) -> float | None:
    return None if a is None or not b else a / b


def report(results: dict[str, dict[str, list[dict[str, Any]]]], info: dict[str, Any]) -> str:
    out = [
        "# transformers generate against qllama's own loop",
        "",
        "Written by `benchmarks/hf_generate.py` (`nox -s bench`); do not edit by hand.",
        "",
        f"{info['date']}. {info['file']} ({info['file_mb']:.0f} MB), the study's chat prompt, "
        f"greedy, {info['threads']} threads, {info['repeats']} runs of each kind, interleaved. "
        f"Load average (1 min) before / after: {info['load_before']} / {info['load_after']}. "
        f"transformers {info['transformers']}, torch {info['torch']}.",
        "",
        "| arithmetic | tokens | qllama ms/token | generate ms/token | qllama tok/s "
        "| generate tok/s | generate / qllama (time) | qllama peak RSS MB "
        "| generate peak RSS MB | generate / qllama | same tokens |",
        "|---|--:|--:|--:|--:|--:|--:|--:|--:|--:|---|",
    ]
    verdicts = []
    for label, kinds in results.items():
        ok = {k: [r for r in runs if "error" not in r] for k, runs in kinds.items()}

        q_ms, g_ms = (
            median_of(ok["qllama"], "ms_per_token"),
            median_of(ok["generate"], "ms_per_token"),
        )
        q_rss, g_rss = (
            median_of(ok["qllama"], "peak_rss_mb"),
            median_of(ok["generate"], "peak_rss_mb"),
        )
        t, m = ratio(g_ms, q_ms), ratio(g_rss, q_rss)
        same = "-"
        if ok["qllama"] and ok["generate"]:
            same = "yes" if ok["qllama"][0]["tokens"] == ok["generate"][0]["tokens"] else "**no**"
        n = len((ok["qllama"] or ok["generate"] or [{"tokens": []}])[0]["tokens"])
        rates = f"{fmt(ratio(1e3, q_ms), '{:.1f}')} | {fmt(ratio(1e3, g_ms), '{:.1f}')}"
        times = f"{fmt(q_ms, '{:.2f}')} | {fmt(g_ms, '{:.2f}')} | {rates} | {fmt(t, '{:.3f}x')}"
        out.append(
            f"| {label} | {n} | {times} "
            f"| {fmt(q_rss, '{:.0f}')} | {fmt(g_rss, '{:.0f}')} | {fmt(m, '{:.3f}x')} | {same} |"
        )
        errors = [f"{k}: {r['error']}" for k, runs in kinds.items() for r in runs if "error" in r]
        verdicts.append(
            f"- {label}: generate per token <= {TARGET_TIME:.2f}x qllama: "
            f"{'**met**' if t is not None and t <= TARGET_TIME else '**missed**'}; peak RSS <= "
            f"{TARGET_RSS:.2f}x: {'**met**' if m is not None and m <= TARGET_RSS else '**missed**'}"
            + (f" (failed runs: {'; '.join(errors)})" if errors else "")
        )
    out += ["", "## Targets", "", *verdicts, ""]
    out += [
        "Per token: the mean time between consecutive new tokens of one run (the prefill is "
        "not in it), the median over runs. generate's includes transformers' work per step "
        "(logits processors, stopping criteria, the cache's bookkeeping, the logits' copy into "
        "a torch tensor). Peak RSS: the process's VmHWM, after importing torch, transformers and "
        "qllama.hf in both kinds (the libraries alone: "
        f"{fmt(info.get('import_rss_mb'), '{:.0f}')} MB).",
        "",
    ]
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--file", default="Q4_K_M", help="the SmolLM2 variant (F32, Q8_0, Q4_K_M)")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--only", help="the arithmetics whose label contains this")
    p.add_argument(
        "--quick", action="store_true", help="1 run of each kind, a quarter of the tokens"
    )
    p.add_argument("--out", default=str(HERE.parent / "docs" / "transformers_bench.md"))
    p.add_argument("--no-load", action="store_true", help="skip hf_load.py's section")
    p.add_argument("--load-files", default="Q4_K_M,Q8_0", help="hf_load.py's files")
    p.add_argument("--timeout", type=float, default=900)
    p.add_argument("--worker", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.worker:
        print("RESULT " + json.dumps(worker(json.loads(args.worker))), flush=True)
        return 0
    import torch
    import transformers

    from qllama.atomic import atomic_write
    from qllama.model_files import variant

    path = str(variant(MODEL, args.file))
    repeats = 1 if args.quick else args.repeats
    started = datetime.datetime.now(datetime.timezone.utc)
    info: dict[str, Any] = {
        "date": started.strftime("%Y-%m-%d %H:%M UTC"),
        "file": f"SmolLM2-135M-Instruct {args.file}",
        "file_mb": os.path.getsize(path) / 1e6,
        "threads": args.threads,
        "repeats": repeats,
        "load_before": f"{os.getloadavg()[0]:.2f}" if hasattr(os, "getloadavg") else "-",
        "transformers": transformers.__version__,
        "torch": torch.__version__,
    }
    results: dict[str, dict[str, list[dict[str, Any]]]] = {}
    for label, options, tokens in SETTINGS:
        if args.only and args.only.lower() not in label.lower():
            continue
        n = max(4, tokens // 4) if args.quick else tokens
        results[label] = {k: [] for k in KINDS}
        for i in range(repeats):
            for kind in KINDS:
                job = {"kind": kind, "file": path, "options": options, "tokens": n}
                got = worker_result({**job, "threads": args.threads}, args.timeout, __file__)
                results[label][kind].append(got)
                shown = got.get("error") or f"{got['ms_per_token']:.2f} ms/token"
                print(f"{label} / {kind} run {i + 1}: {shown}", flush=True)
                info.setdefault("import_rss_mb", got.get("import_rss_mb"))
    info["load_after"] = f"{os.getloadavg()[0]:.2f}" if hasattr(os, "getloadavg") else "-"
    text = report(results, info)
    if not args.no_load:
        import hf_load

        files = args.load_files.split(",")
        text += "\n" + hf_load.run_section(files, args.threads, repeats, args.timeout)
    with atomic_write(args.out, "w") as f:
        f.write(text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
