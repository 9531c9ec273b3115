"""What the benchmark scripts share: the model, prompt and files they measure, the labels of
the rows the report looks up, and how one measurement runs in a process of its own.

The scripts of benchmarks/ import from here, and this module imports none of them, so that
their imports form no cycle: ``common`` at the bottom; ``workers``, ``scale``, ``report``,
``serve_load``, ``hf_generate``, ``gpu_check`` and ``isa`` above it; ``bench`` (the driver) on
top. It imports only the standard library: bench.py's worker processes import it before they
measure what importing qllama costs, and the llama.cpp worker runs without qllama.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent

MODEL = "smollm2-135m-instruct"
MESSAGES = [{"role": "user", "content": "Explain how a CPU cache works."}]
NEW_TOKENS = 300
FILES = ("F32", "Q8_0", "Q4_K_M")

# the labels of bench.py's rows that report.py looks up: the CPU arithmetic (profiled, held
# to the targets) and the peers
CPU_ROWS = ("numpy cpu (numba kernels)", "numpy cpu (numba kernels, 2 BLAS threads)")
LLAMA_CPP = "llama.cpp"
TRANSFORMERS = "transformers f32 eager"
OBSERVER = "observer overhead"  # bench.py's section of that name (and its --only text)
# corpus perplexity (issue 14): the context, the corpus, and llama-perplexity's own row
PPL_CTX = 512
PPL_CORPUS = "botchan"
LLAMA_PERPLEXITY = "perplexity: llama-perplexity"


@dataclass(frozen=True)
class Config:
    """One row of the table: who runs, in which mode, on which file."""

    label: str  # the setting, as the table names it
    file: str  # F32 | Q8_0 | Q4_K_M
    job: dict[str, Any]
    slow: bool = False  # a reference path: fewer repeats and decode steps

    @property
    def name(self) -> str:
        return f"{self.label} / {self.file}"


# --- running ----------------------------------------------------------------------------------


def thread_env(threads: int) -> dict[str, str]:
    """Every thread pool a worker may start, sized to ``threads``."""
    env = dict(os.environ)
    for var in (
        "OMP_NUM_THREADS",
        "OPENBLAS_NUM_THREADS",
        "MKL_NUM_THREADS",
        "VECLIB_MAXIMUM_THREADS",
        "NUMEXPR_NUM_THREADS",
        "NUMBA_NUM_THREADS",
    ):
        env[var] = str(threads)
    env.setdefault("TOKENIZERS_PARALLELISM", "false")
    env.setdefault("TRANSFORMERS_VERBOSITY", "error")
    env.setdefault("HF_HUB_OFFLINE", "1")
    return env


@dataclass
class Outcome:
    """What :func:`run_worker` got: the worker's result, or why there is none."""

    result: dict[str, Any] | None = None
    error: str | None = None
    seconds: float = 0.0
    extra: dict[str, Any] = field(default_factory=dict)


def run_worker(
    job: dict[str, Any],
    python: str,
    threads: int,
    timeout: float,
    script: Path = HERE / "bench.py",
) -> Outcome:
    """Run one job of ``script`` (``script --worker JOB``) in a fresh process; its last
    ``RESULT`` line is the outcome."""
    cmd = [python, str(script), "--worker", json.dumps(job)]
    t = time.perf_counter()
    try:
        run = subprocess.run(
            cmd,
            env={**thread_env(threads), **job.get("env", {})},
            capture_output=True,
            text=True,
            timeout=timeout,
            stdin=subprocess.DEVNULL,
            check=False,
        )
    except subprocess.TimeoutExpired:
        return Outcome(error=f"timed out after {timeout:.0f} s", seconds=timeout)
    seconds = time.perf_counter() - t
    lines = [ln for ln in run.stdout.splitlines() if ln.startswith("RESULT ")]
    if run.returncode != 0 or not lines:
        tail = [ln for ln in (run.stderr or run.stdout).strip().splitlines() if ln.strip()]
        reason = tail[-1] if tail else f"exit status {run.returncode}"
        return Outcome(error=reason[:300], seconds=seconds)
    return Outcome(result=json.loads(lines[-1][len("RESULT ") :]), seconds=seconds)


def worker_result(job: dict[str, Any], timeout: float, script: str) -> dict[str, Any]:
    """:func:`run_worker` of ``script`` with this interpreter and the job's threads, as the
    result's dict, or ``{"error": why}``."""
    out = run_worker(job, sys.executable, job["threads"], timeout, Path(script).resolve())
    return out.result if out.result is not None else {"error": out.error}


def chosen(only: str | None, name: str) -> bool:
    """Whether ``--only`` picks the configuration or section ``name``: no ``--only``, or one
    of its ``|``-separated parts is in the name (case ignored)."""
    return only is None or any(part.lower() in name.lower() for part in only.split("|") if part)


def fmt(x: float | None, spec: str = "{:.1f}") -> str:
    """``x`` by ``spec``, or ``-`` where there is no number."""
    return "-" if x is None else spec.format(x)


def median_of(runs: list[dict[str, Any]], key: str) -> float | None:
    """The median of ``key`` over the runs that have it, or None without any."""
    vals = [r[key] for r in runs if r.get(key) is not None]
    return statistics.median(vals) if vals else None


# --- inside a worker --------------------------------------------------------------------------


def memory_mb() -> dict[str, float]:
    """Resident set size now and its peak (VmHWM), in MB (Linux; else getrusage's peak)."""
    try:
        with open("/proc/self/status") as f:
            fields = dict(line.split(":", 1) for line in f if ":" in line)
        return {
            "rss_mb": int(fields["VmRSS"].split()[0]) / 1024,
            "peak_rss_mb": int(fields["VmHWM"].split()[0]) / 1024,
        }
    except (OSError, KeyError, ValueError):
        import resource

        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        peak_mb = peak / 2**20 if sys.platform == "darwin" else peak / 1024
        return {"rss_mb": peak_mb, "peak_rss_mb": peak_mb}


def pin_cpus(threads: int) -> list[int]:
    """Run on ``threads`` CPUs only (where the OS allows it), so that pools sized from the
    CPU count (XLA's, llama.cpp's repack workers) see the same number as the rest."""
    if not hasattr(os, "sched_setaffinity"):
        return []
    cpus = sorted(os.sched_getaffinity(0))[:threads]
    os.sched_setaffinity(0, cpus)
    return cpus
