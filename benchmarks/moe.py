"""The bench's mixture of experts (issue 29): qllama's CPU arithmetic against llama.cpp on a
~1B-parameter MoE with a few hundred million active.

``nox -s bench`` runs it after bench.py (a full run); by itself::

    python benchmarks/moe.py [--threads 2] [--rounds 3] [--out docs/bench-moe.md] [--llama-bin BIN]

The shape: a qwen3moe of 16 layers, 1024 wide, 16 heads / 4 KV heads, 16 experts of width
1280, 4 used per token (1.05B parameters in the layers, 0.29B active), the synthetic gpt2
vocabulary, in Q8_0 and Q4_K, written once into ``<cache>/bench/`` by qllama's own writer, one
layer drawn and replicated (:func:`scale.write_replicated`: speed does not depend on the
values; each layer is its own copy in the file).

Per file, each side in a process of its own with ``--threads`` threads: decode tok/s (a
16-token prompt, then steps; median of runs) and teacher forcing tok/s (256 tokens, every
position's logits). llama.cpp runs through ``tools/llama_speed.c``, built here against the
peers' llama.cpp (``tools/llama_cpp_build.py tools``). qllama's decode process also records
which experts its routers chose, so that its peak RSS is held to what the run touched: the
shared weights (attention, norms, routers, embedding, output) and the selected experts' slabs,
plus the KV cache, plus 150 MB; experts never selected stay unread in the file's map.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import scale
from common import fmt, memory_mb, pin_cpus, run_worker, thread_env

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
SECTION = "moe"
TYPES = ("Q8_0", "Q4_K")
PROMPT = 16  # decode starts after this many tokens
TF_TOKENS = 256
SLACK_MB = 150  # issue 29's allowance over touched weights + KV cache
N_CTX = 1024  # context length written into the files and used by both sides


@dataclass(frozen=True)
class MoeShape:
    """The MoE's shape; the files differ only in the weight type."""

    n_layer: int = 16
    n_embd: int = 1024
    n_head: int = 16
    n_head_kv: int = 4
    n_expert: int = 16
    n_expert_used: int = 4
    n_ff_exp: int = 1280

    @property
    def head_dim(self) -> int:
        return self.n_embd // self.n_head


SHAPE = MoeShape()


def tiny_config(shape: MoeShape, weight_type: str, n_layer: int) -> Any:
    """The :class:`qllama.synthetic.TinyConfig` of ``shape`` with ``n_layer`` layers."""
    s = shape
    return scale.bench_config(
        weight_type,
        n_layer,
        N_CTX,
        arch="qwen3moe",
        n_embd=s.n_embd,
        n_ff=s.n_ff_exp,  # feed_forward_length (qwen3moe's experts have their own)
        n_head=s.n_head,
        n_head_kv=s.n_head_kv,
        head_dim=s.head_dim,
        n_expert=s.n_expert,
        n_expert_used=s.n_expert_used,
        n_ff_exp=s.n_ff_exp,
    )


def moe_file(shape: MoeShape, weight_type: str, n_layer: int) -> tuple[Path, dict[str, Any]]:
    """The cached synthetic MoE file (written on first use) and how it was made."""
    s = shape
    name = (
        f"qwen3moe-{n_layer}x{s.n_embd}-h{s.n_head}-kv{s.n_head_kv}-e{s.n_expert}"
        f"x{s.n_ff_exp}-top{s.n_expert_used}-{weight_type}.gguf"
    )
    return scale.cached_file(name, tiny_config(shape, weight_type, n_layer))


def parameters(shape: MoeShape, n_layer: int) -> tuple[float, float]:
    """Billions of parameters of the layers' 2-D and 3-D weights, all and active (the experts
    a token uses); the embedding and output (the synthetic vocabulary's few hundred rows) and
    the norms left out."""
    s = shape
    attention = s.n_embd * s.head_dim * (2 * s.n_head + 2 * s.n_head_kv)  # q, o; k, v
    router = s.n_embd * s.n_expert
    expert = 3 * s.n_embd * s.n_ff_exp  # up, gate, down
    total = n_layer * (attention + router + s.n_expert * expert)
    active = n_layer * (attention + router + s.n_expert_used * expert)
    return total / 1e9, active / 1e9


def kv_mb(shape: MoeShape, n_layer: int, positions: int) -> float:
    """qllama's f32 KV cache of ``positions`` positions, MB."""
    return 2 * n_layer * positions * shape.n_head_kv * shape.head_dim * 4 / 1e6


# --- workers (a process each: ``moe.py --worker JOB``) -------------------------------------------


def touched_mb(path: str, chosen: dict[int, set[int]]) -> dict[str, float]:
    """MB of the weights a run read: every tensor but the experts' (the shared weights), and
    of each 3-D expert tensor the slabs of the experts ``chosen[layer]``."""
    from qllama.gguf.reader import read_gguf

    shared = experts = 0
    with read_gguf(path) as f:
        for t in f:
            if "_exps." not in t.name:
                shared += t.nbytes
                continue
            n_expert = t.shape[0]
            experts += t.nbytes // n_expert * len(chosen.get(int(t.name.split(".")[1]), ()))
    return {"shared_mb": shared / 1e6, "experts_mb": experts / 1e6}


def mapped_mb(path: str) -> float | None:
    """MB of ``path``'s map resident in this process (its mappings' Rss in smaps), or None
    where /proc/self/smaps cannot be read."""
    real, total, inside = os.path.realpath(path), 0, False
    try:
        with open("/proc/self/smaps") as f:
            for line in f:
                head = line.split()
                if head and "-" in head[0] and len(head) >= 5:  # a mapping's first line
                    inside = len(head) >= 6 and head[-1] == real
                elif inside and head and head[0] == "Rss:":
                    total += int(head[1])
    except OSError:
        return None
    return total / 1024


def run_qllama(job: dict) -> dict[str, Any]:
    """qllama's CPU arithmetic (numba kernels): decode runs (wall and CPU seconds), then the
    experts its routers chose for that token sequence and the peak RSS, then teacher
    forcing runs (every position's logits) and the peak RSS at the end."""
    import numba
    import numpy as np

    import qllama
    from qllama.array_api import to_numpy

    numba.set_num_threads(job["threads"])
    t = time.perf_counter()
    model = qllama.load(
        job["file"], backend="numpy", kernels="numba", threads=job["threads"], n_ctx=N_CTX
    )
    load_s = time.perf_counter() - t
    load_mapped = mapped_mb(job["file"])  # the shared weights only, if experts stay unread
    ids, n_prompt, steps, warm = job["ids"], job["prompt"], job["steps"], job["warmup"]
    decode_ids = ids[: n_prompt + warm + steps]
    k = model.config.n_expert_used
    chosen: dict[int, set[int]] = {}

    def router(name: str, logits: Any) -> None:
        if name.endswith(".router"):  # "blk.{i}.router": (T, n_expert) logits
            top = np.argsort(-np.asarray(to_numpy(logits)), axis=-1)[:, :k]
            chosen.setdefault(int(name.split(".")[1]), set()).update(top.reshape(-1).tolist())

    def decode(observer: Any = None) -> tuple[float, float]:
        to_numpy(model.forward(decode_ids[:n_prompt], 0, observer=observer))
        wall = cpu = 0.0
        for i in range(n_prompt, len(decode_ids)):
            if i == n_prompt + warm:
                wall, cpu = time.perf_counter(), time.process_time()
            to_numpy(model.forward([decode_ids[i]], i, observer=observer))
        return time.perf_counter() - wall, time.process_time() - cpu

    decode_runs = [decode() for _ in range(job["repeats"])]
    decode(router)  # the same tokens again: the experts they chose (reads nothing new)
    decode_peak, decode_map = memory_mb()["peak_rss_mb"], mapped_mb(job["file"])
    decode_touched = touched_mb(job["file"], chosen)
    decode_experts = sum(map(len, chosen.values()))  # (layer, expert) pairs chosen

    def tf() -> tuple[float, float]:
        wall, cpu = time.perf_counter(), time.process_time()
        to_numpy(model.forward(ids, 0, all_logits=True))
        return time.perf_counter() - wall, time.process_time() - cpu

    tf()  # untimed: its buffers, the experts decoding left unread
    tf_runs = [tf() for _ in range(job["repeats"])]
    chosen.clear()
    to_numpy(model.forward(ids, 0, observer=router))
    return {
        "load_s": load_s,
        "load_mapped_mb": load_mapped,
        "decode_s": [w for w, _ in decode_runs],
        "decode_cpu_s": [c for _, c in decode_runs],
        "tf_s": [w for w, _ in tf_runs],
        "tf_cpu_s": [c for _, c in tf_runs],
        "decode_peak_rss_mb": decode_peak,
        "decode_mapped_mb": decode_map,
        "decode_touched": decode_touched,
        "decode_experts": decode_experts,
        "tf_experts": sum(map(len, chosen.values())),
        "tf_touched": touched_mb(job["file"], chosen),
        "tf_mapped_mb": mapped_mb(job["file"]),
        **memory_mb(),
    }


WORKERS = {"qllama": run_qllama}


def worker_main(job_json: str) -> None:
    """``moe.py --worker JOB``: one measurement in this process, one RESULT line."""
    job = json.loads(job_json)
    job["cpus"] = pin_cpus(job["threads"])
    print("RESULT " + json.dumps(WORKERS[job["kind"]](job)), flush=True)


# --- llama.cpp: tools/llama_speed.c against the peers' build --------------------------------------


def _tool(command: str) -> str:
    """The last line ``tools/llama_cpp_build.py COMMAND`` prints (a folder; built once)."""
    script = ROOT / "tools" / "llama_cpp_build.py"
    out = subprocess.run(
        [sys.executable, str(script), command], stdout=subprocess.PIPE, text=True, check=True
    )
    return out.stdout.strip().splitlines()[-1]


def llama_speed(bin_dir: str | None) -> tuple[Path, str]:
    """``tools/llama_speed.c`` compiled against llama.cpp's libraries in ``bin_dir`` (the
    peers' build by default; compiled once per source and folder, cached) and that folder."""
    import hashlib

    from qllama import defaults
    from qllama.atomic import exclusive

    bin_dir = bin_dir or _tool("tools")
    source = ROOT / "tools" / "llama_speed.c"
    key = hashlib.sha256(source.read_bytes() + bin_dir.encode()).hexdigest()[:12]
    exe = defaults.cache_dir() / "bench" / f"llama_speed-{key}"
    with exclusive(exe.with_name(exe.name + ".lock")):
        if not exe.exists():
            llama = Path(_tool("source"))
            tmp = exe.with_name(f".{exe.name}.{os.getpid()}")
            cmd = ["cc", "-O2", "-o", str(tmp), str(source)]
            cmd += [f"-I{llama / 'include'}", f"-I{llama / 'ggml' / 'include'}", f"-L{bin_dir}"]
            cmd += ["-lllama", "-lggml", "-lggml-base", f"-Wl,-rpath-link,{bin_dir}"]
            subprocess.run(cmd, check=True)
            tmp.replace(exe)  # atomically: a half-written binary is never run
    return exe, bin_dir


def run_llama(exe: Path, bin_dir: str, job: dict, timeout: float) -> dict[str, Any]:
    """llama_speed on ``job``'s file, pinned to ``job["threads"]`` CPUs: its JSON, or
    ``{"error": why}``. Its libraries' folder goes on the loader's path (the build's RUNPATH
    names the temporary folder it was built in)."""
    import tempfile

    with tempfile.NamedTemporaryFile("w", suffix=".txt") as ids:
        ids.write(" ".join(map(str, job["ids"])))
        ids.flush()
        cpus = sorted(os.sched_getaffinity(0))[: job["threads"]]
        cmd = [str(exe), job["file"], ids.name, str(job["threads"]), str(job["prompt"])]
        cmd += [str(job["steps"]), str(job["warmup"]), str(job["repeats"])]
        env = {**thread_env(job["threads"]), "LD_LIBRARY_PATH": bin_dir}
        try:
            run = subprocess.run(
                cmd,
                env=env,
                capture_output=True,
                text=True,
                timeout=timeout,
                preexec_fn=lambda: os.sched_setaffinity(0, cpus),
                check=False,
            )
        except subprocess.TimeoutExpired:
            return {"error": f"timed out after {timeout:.0f} s"}
    lines = [ln for ln in run.stdout.splitlines() if ln.startswith("{")]
    if run.returncode or not lines:
        tail = (run.stderr or "").strip().splitlines()
        return {"error": (tail[-1] if tail else f"exit status {run.returncode}")[:300]}
    return json.loads(lines[-1])


# --- the run --------------------------------------------------------------------------------------


def rates(result: dict[str, Any] | None, steps: int, tokens: int) -> dict[str, float | None]:
    """Median tok/s of a side's runs: decode and teacher forcing, wall and CPU time."""
    out: dict[str, float | None] = {}
    for key, n in (
        ("decode_s", steps),
        ("decode_cpu_s", steps),
        ("tf_s", tokens),
        ("tf_cpu_s", tokens),
    ):
        runs = (result or {}).get(key) or []
        out[key.replace("_s", "_tok_s")] = n / statistics.median(runs) if runs else None
    return out


def measure(args: argparse.Namespace) -> dict[str, Any]:
    """Both sides on each file, ``args.rounds`` rounds each, the sides alternating (a busy
    machine's load then weighs on both alike); what :func:`markdown` reads."""
    load_before = os.getloadavg()
    layers = args.layers or SHAPE.n_layer
    exe, bin_dir = llama_speed(args.llama_bin)
    ids = scale.token_ids(TF_TOKENS)
    job = {"threads": args.threads, "ids": ids, "prompt": PROMPT, "steps": args.steps}
    job |= {"warmup": 2, "repeats": args.repeats}
    files: dict[str, Any] = {}
    for ft in TYPES:
        path, made = moe_file(SHAPE, ft, layers)
        files[ft] = {"path": str(path), "mb": os.path.getsize(path) / 1e6, "made": made}
        # compile or load the kernels before timing: a short run whose result is not kept
        run_worker(
            {**job, "kind": "qllama", "file": str(path), "repeats": 1, "steps": 1},
            sys.executable,
            args.threads,
            args.timeout,
            HERE / "moe.py",
        )
        rounds: list[dict[str, Any]] = []
        for r in range(args.rounds):
            print(f"moe {ft} round {r + 1}/{args.rounds}: qllama ...", end=" ", flush=True)
            q = run_worker(
                {**job, "kind": "qllama", "file": str(path)},
                sys.executable,
                args.threads,
                args.timeout,
                HERE / "moe.py",
            )
            print("llama.cpp ...", end=" ", flush=True)
            lc = run_llama(exe, bin_dir, {**job, "file": str(path)}, args.timeout)
            print(
                "done"
                + (f" (qllama: {q.error})" if q.error else "")
                + (f" (llama.cpp: {lc['error']})" if "error" in lc else ""),
                flush=True,
            )
            rounds.append({"qllama": q.result or {"error": q.error}, "llama": lc})
        files[ft]["rounds"] = rounds
    return {
        "files": files,
        "layers": layers,
        "shape": vars(SHAPE),
        "threads": args.threads,
        "steps": args.steps,
        "repeats": args.repeats,
        "rounds": args.rounds,
        "tf_tokens": TF_TOKENS,
        "kv_mb": kv_mb(SHAPE, layers, N_CTX),
        "load_before": load_before,
    }


# --- the report -----------------------------------------------------------------------------------

MIB = 1.048576  # MB per MiB: VmHWM and smaps count KiB


def _median(xs: list[float | None]) -> float | None:
    vals = [x for x in xs if x is not None]
    return statistics.median(vals) if vals else None


def summary(s: dict[str, Any], ft: str) -> dict[str, Any]:
    """One file's medians over rounds: each side's rates, the ratios of each round (the
    sides of one round ran under the same load), the memory numbers."""
    f = s["files"][ft]
    per = []
    for r in f["rounds"]:
        q = rates(r["qllama"], s["steps"], s["tf_tokens"])
        lc = rates(r["llama"], s["steps"], s["tf_tokens"])
        per.append((q, lc, {k: scale.ratio(q[k], lc[k]) for k in q}))
    keys = ("decode_tok_s", "decode_cpu_tok_s", "tf_tok_s", "tf_cpu_tok_s")
    out: dict[str, Any] = {
        "q": {k: _median([p[0][k] for p in per]) for k in keys},
        "l": {k: _median([p[1][k] for p in per]) for k in keys},
        "ratio": {k: _median([p[2][k] for p in per]) for k in keys},
    }
    qs = [r["qllama"] for r in f["rounds"] if "error" not in r["qllama"]]
    ls = [r["llama"] for r in f["rounds"] if "error" not in r["llama"]]
    if qs:
        q = qs[-1]
        touched = q["decode_touched"]["shared_mb"] + q["decode_touched"]["experts_mb"]
        out["mem"] = {
            "load_mapped_mb": q["load_mapped_mb"] and q["load_mapped_mb"] * MIB,
            "decode_peak_mb": max(x["decode_peak_rss_mb"] for x in qs) * MIB,
            "peak_mb": max(x["peak_rss_mb"] for x in qs) * MIB,
            "decode_mapped_mb": q["decode_mapped_mb"] and q["decode_mapped_mb"] * MIB,
            "touched_mb": touched,
            "shared_mb": q["decode_touched"]["shared_mb"],
            "decode_experts": q["decode_experts"],
            "tf_touched_mb": q["tf_touched"]["shared_mb"] + q["tf_touched"]["experts_mb"],
            "tf_experts": q["tf_experts"],
            "limit_mb": touched + s["kv_mb"] + SLACK_MB,
        }
    if ls:
        out["mem_llama"] = {
            "decode_peak_mb": max(x["decode_peak_rss_mb"] for x in ls) * MIB,
            "peak_mb": max(x["peak_rss_mb"] for x in ls) * MIB,
        }
    return out


def markdown(s: dict[str, Any]) -> list[str]:
    """docs/bench-moe.md."""
    sh, n = s["shape"], s["threads"]
    n_exp = s["layers"] * sh["n_expert"]
    total, active = parameters(MoeShape(**sh), s["layers"])
    out = [
        "# Bench: a mixture of experts (issue 29)",
        "",
        f"Written by `python benchmarks/moe.py` on {s['date']}; machine: {s['machine']}.",
        "",
        f"qllama's CPU arithmetic (numpy backend, numba kernels, {n} threads; the experts' "
        "products in one compiled `mul_mat_id` a call, `backends/numpy/kernels/experts.py`) "
        f"against llama.cpp ({n} threads, `tools/llama_speed.c` linked against the peers' "
        "build) on a synthetic qwen3moe written by qllama's own writer: "
        f"{s['layers']} layers, {sh['n_embd']} wide, {sh['n_head']} heads / {sh['n_head_kv']} "
        f"KV heads, {sh['n_expert']} experts of width {sh['n_ff_exp']}, {sh['n_expert_used']} "
        f"used a token ({total:.2f}B parameters in the layers, {active:.2f}B active), the "
        "synthetic gpt2 vocabulary; one "
        "layer drawn and written for every layer (each its own copy in the file). Each side "
        "in a process of its own, pinned to the same CPUs; per round one qllama process, then "
        f"one llama.cpp process; {s['rounds']} rounds. Decode: {s['steps']} timed steps after "
        f"a {PROMPT}-token prompt and 2 untimed steps; teacher forcing: {s['tf_tokens']} "
        "tokens in one batch with every position's logits, after an untimed run; medians of "
        f"{s['repeats']} runs a process, then of the rounds. Ratios: qllama / llama.cpp in "
        "each round, median over rounds. **CPU** rates count the process's CPU time (all its "
        "threads): llama.cpp's threads spin-wait between operations, which a loaded machine "
        "makes costly in both wall and CPU time.",
        "",
        f"Load average (1, 5, 15 min) before: {', '.join(f'{x:.1f}' for x in s['load_before'])}; "
        f"after: {', '.join(f'{x:.1f}' for x in s['load_after'])}.",
        "",
    ]
    if s.get("note"):
        out += [s["note"], ""]
    out += [
        "| file | MB | decode tok/s qllama / llama.cpp | ratio | decode CPU tok/s | ratio "
        "| TF tok/s qllama / llama.cpp | ratio | TF CPU tok/s | ratio |",
        "|---|--:|--:|--:|--:|--:|--:|--:|--:|--:|",
    ]
    sums = {ft: summary(s, ft) for ft in s["files"]}
    for ft, m in sums.items():
        q, lc, x = m["q"], m["l"], m["ratio"]
        cells = []
        for k in ("decode_tok_s", "decode_cpu_tok_s", "tf_tok_s", "tf_cpu_tok_s"):
            cells += [f"{fmt(q[k])} / {fmt(lc[k])}", fmt(x[k], "{:.2f}x")]
        out.append(f"| {ft} | {s['files'][ft]['mb']:.0f} | " + " | ".join(cells) + " |")
    out += [
        "",
        "Memory (MB). **mapped at load**: the file's pages resident in qllama's process after "
        "`qllama.load` (the shared weights; experts are mapped as they are selected). "
        "**touched**: the shared weights plus the slabs of every (layer, expert) the decode "
        f"run's routers chose (of {n_exp}). Target: qllama's peak RSS while decoding <= "
        f"touched + KV cache ({s['kv_mb']:.0f} MB, f32, n_ctx {N_CTX}) + {SLACK_MB} MB.",
        "",
        "| file | mapped at load | experts chosen in decode | touched | peak RSS decoding "
        "| limit | target | peak RSS after TF (all experts) | llama.cpp peak RSS decode / end |",
        "|---|--:|--:|--:|--:|--:|---|--:|--:|",
    ]
    for ft, m in sums.items():
        mm, ml = m.get("mem"), m.get("mem_llama") or {}
        if mm is None:
            out.append(f"| {ft} | - | - | - | - | - | not measured | - | - |")
            continue
        ok = "**met**" if mm["decode_peak_mb"] <= mm["limit_mb"] else "**missed**"
        out.append(
            f"| {ft} | {fmt(mm['load_mapped_mb'], '{:.0f}')} | {mm['decode_experts']} "
            f"| {mm['touched_mb']:.0f} | {mm['decode_peak_mb']:.0f} | {mm['limit_mb']:.0f} "
            f"| {ok} | {mm['peak_mb']:.0f} "
            f"| {fmt(ml.get('decode_peak_mb'), '{:.0f}')} / {fmt(ml.get('peak_mb'), '{:.0f}')} |"
        )
    out += ["", "Targets (issue 29): decode >= 0.8x and teacher forcing >= 1x llama.cpp:", ""]
    for ft, m in sums.items():
        for what, key, goal in (
            ("decode", "decode_tok_s", 0.8),
            ("teacher forcing", "tf_tok_s", 1.0),
        ):
            wall, cpu = m["ratio"][key], m["ratio"][key.replace("_tok", "_cpu_tok")]
            ok = "not measured" if wall is None else ("**met**" if wall >= goal else "**missed**")
            out.append(
                f"- {ft} {what} >= {goal:g}x: {fmt(wall, '{:.2f}x')} wall ({ok}), "
                f"{fmt(cpu, '{:.2f}x')} CPU time"
            )
    return [*out, ""]


def machine() -> str:
    """The CPU model and the count of CPUs, in words."""
    import platform

    model = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            model = next(ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name"))
    except (OSError, StopIteration):
        pass
    return f"{model}, {os.cpu_count()} CPUs"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default=str(ROOT / "docs" / "bench-moe.md"))
    p.add_argument("--json", help="also write the raw results here")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--steps", type=int, default=32, help="timed decode steps")
    p.add_argument("--repeats", type=int, default=3, help="runs of each measure a process")
    p.add_argument("--rounds", type=int, default=3, help="processes a side, alternating")
    p.add_argument("--timeout", type=float, default=1800, help="seconds a process")
    p.add_argument("--llama-bin", help="llama.cpp's libraries (default: the peers' build)")
    p.add_argument("--note", help="a line for the report (the machine's state)")
    p.add_argument("--layers", type=int, help=argparse.SUPPRESS)  # shrink, for checks
    p.add_argument("--worker", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.worker:
        worker_main(args.worker)
        return 0
    import datetime

    from qllama.atomic import atomic_write

    started = datetime.datetime.now(datetime.timezone.utc)
    s = measure(args)
    s |= {"date": started.strftime("%Y-%m-%d %H:%M UTC"), "machine": machine()}
    s |= {"load_after": os.getloadavg(), "note": args.note}
    if args.json:
        with atomic_write(args.json, "w") as f:
            json.dump(s, f, indent=1)
    with atomic_write(args.out, "w") as f:
        f.write("\n".join(markdown(s)))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
