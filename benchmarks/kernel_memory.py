"""What the CPU arithmetic's compiled kernels cost in memory: numba's JIT against the same
kernels compiled ahead of time (issue 17, item 5).

The JIT keeps LLVM in the process: importing numba maps llvmlite's library, and the first kernel,
even one loaded from numba's disk cache, initialises LLVM's code generator. An ahead-of-time build
(``numba.pycc``, here; a compiled extension would be the same) is a small shared object that needs
neither at run time. This script compiles the serial Q4_K and Q8_0 drivers of
``backends/numpy/kernels/gemm.py`` (many tokens) and ``backends/numpy/kernels/gemv.py`` (decode)
both ways and measures, each in a fresh process:

* resident memory (``VmRSS``) after numpy and the weights, after importing the kernels, and
  after their first calls;
* that both give the same bits;
* their speed, best of several calls, both in one process (the ratio is what counts).

    python benchmarks/kernel_memory.py [--out FILE.md] [--rows 4096 --k 2048 --tokens 64]

It is not part of ``nox -s bench``'s report: ``pycc`` is deprecated in numba and compiles
only serial code (no ``prange``), so this measures the alternative; it does not ship it.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import textwrap

FORMATS = ("Q4_K", "Q8_0")

BUILD = """
from numba.pycc import CC
from qllama.backends.numpy.kernels.gemm import gemm_kquant, gemm_legacy
from qllama.backends.numpy.kernels.gemv import gemv_kquant, gemv_legacy
from qllama.backends.numpy.kernels.simd import Q4_K, Q8_0

cc = CC("kernels_aot")
cc.output_dir = {out!r}
cc.target_cpu = "host"
SIG = ("void(uint8[::1], int64[::1], int64[::1], float32[:, ::1], boolean, int64, "
       "float32[::1], int64[::1])")

"""

# one exported function per kernel: pycc compiles module-level functions only
EXPORT = """
@cc.export("{kind}_{fmt}", SIG)
def {kind}_{fmt}(buf, offs, rows, x, simd, threads, out, outs_at):
    {driver}(buf, offs, rows, x, simd, threads, out, outs_at, {fmt})
"""
DRIVERS = {
    ("gemm", "Q4_K"): "gemm_kquant",
    ("gemv", "Q4_K"): "gemv_kquant",
    ("gemm", "Q8_0"): "gemm_legacy",
    ("gemv", "Q8_0"): "gemv_legacy",
}

# what both kinds of process start with: the data, and a way to each kind of kernels,
# ``kernels[kind, fmt]`` for kind gemm or gemv
PRELUDE = """
import json, sys, time, numpy as np

folder = sys.argv[1]
data = {f: (np.load(f"{folder}/w-{f}.npy"), np.load(f"{folder}/rows-{f}.npy")) for f in FORMATS}
x = np.load(f"{folder}/x.npy")
zero = np.array([0], np.int64)
CALLS = [(k, f, xs) for f in FORMATS for k, xs in (("gemm", x), ("gemv", x[:1]))]
# each call's output, allocated once, outside the timed calls
OUT = {(k, f): np.zeros(xs.shape[0] * int(data[f][1][0]), np.float32) for k, f, xs in CALLS}


def aot_kernels():
    sys.path.insert(0, folder)
    import kernels_aot as m
    return {(k, f): getattr(m, f"{k}_{f}") for k, f, _ in CALLS}


def jit_kernels():
    from qllama.backends.numpy.kernels import gemm, gemv
    from qllama.ggml_types import GGMLType
    family = {"gemm": gemm.KERNELS, "gemv": gemv.KERNELS}
    return {(k, f): family[k][int(GGMLType[f])][1] for k, f, _ in CALLS}


def call(kernels, k, f, xs):
    w, rows = data[f]
    kernels[k, f](w, zero, rows, xs, True, 1, OUT[k, f], zero)
    return OUT[k, f]
"""

# one process: RSS along the way, then the outputs for the bit comparison
MEASURE = """
def rss():
    with open("/proc/self/status") as f:
        return int(dict(line.split(":", 1) for line in f)["VmRSS"].split()[0]) / 1024


how = sys.argv[2]
marks = {"numpy and the weights": rss()}
kernels = aot_kernels() if how == "aot" else jit_kernels()
marks["the kernels imported"] = rss()
outs = [call(kernels, k, f, xs) for k, f, xs in CALLS]
marks["after the first calls"] = rss()
np.save(f"{folder}/out-{how}.npy", np.concatenate(outs))
print(json.dumps(marks))
"""

# one process with both: the best time of each call
SPEED = """
repeats, best = int(sys.argv[2]), {}
ways = {"aot": aot_kernels(), "jit": jit_kernels()}
for _ in range(repeats):
    for k, f, xs in CALLS:
        for how, kernels in ways.items():
            s = time.perf_counter()
            call(kernels, k, f, xs)
            key = f"{k} {f} {how}"
            best[key] = min(best.get(key, 1e9), time.perf_counter() - s)
print(json.dumps(best))
"""


def _python(code: str, *args: str, prelude: bool = True) -> str:
    """Run ``code`` in a fresh interpreter (after :data:`PRELUDE`, with ``prelude``); its
    last line of output."""
    head = f"FORMATS = {FORMATS!r}\n" + (textwrap.dedent(PRELUDE) if prelude else "")
    done = subprocess.run(
        [sys.executable, "-c", head + textwrap.dedent(code), *args],
        capture_output=True,
        text=True,
        check=False,
    )
    if done.returncode:
        raise SystemExit(f"a measuring process failed:\n{done.stderr[-2000:]}")
    return done.stdout.strip().splitlines()[-1] if done.stdout.strip() else ""


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", help="write the tables here (markdown); default: print them")
    p.add_argument("--rows", type=int, default=4096)
    p.add_argument("--k", type=int, default=2048)
    p.add_argument("--tokens", type=int, default=64)
    p.add_argument("--repeats", type=int, default=10)
    args = p.parse_args(argv)

    import numpy as np

    from qllama import quants

    with tempfile.TemporaryDirectory(prefix="qllama-aot-") as folder:
        print("compiling ahead of time ...", flush=True)
        exports = "".join(EXPORT.format(kind=k, fmt=f, driver=d) for (k, f), d in DRIVERS.items())
        _python(BUILD.format(out=folder) + exports + "\ncc.compile()\n", prelude=False)
        rng = np.random.default_rng(0)
        for f in FORMATS:
            w = rng.standard_normal((args.rows, args.k)).astype(np.float32)
            np.save(f"{folder}/w-{f}.npy", quants.quantize(w, f).reshape(-1))
            np.save(f"{folder}/rows-{f}.npy", np.array([args.rows], np.int64))
        np.save(f"{folder}/x.npy", rng.standard_normal((args.tokens, args.k)).astype(np.float32))
        print("memory: a fresh process each way (the JIT's disk cache warmed first) ...")
        _python(MEASURE, folder, "jit")
        marks = {how: json.loads(_python(MEASURE, folder, how)) for how in ("jit", "aot")}
        a, b = (np.load(f"{folder}/out-{how}.npy") for how in ("jit", "aot"))
        same = bool(np.array_equal(a.view(np.uint32), b.view(np.uint32)))
        print("speed: both in one process ...", flush=True)
        best = json.loads(_python(SPEED, folder, str(args.repeats)))

    lines = [
        "# Kernel memory: numba's JIT against ahead-of-time compiled kernels",
        "",
        f"`python benchmarks/kernel_memory.py`: the serial Q4_K and Q8_0 gemm and gemv drivers, "
        f"{args.rows} x {args.k} weights, {args.tokens} tokens (gemm) and 1 (gemv). Resident "
        "memory (MB) in a fresh process each way:",
        "",
        "| | " + " | ".join(marks["jit"]) + " | the kernels' own |",
        "|---|" + "--:|" * (len(marks["jit"]) + 1),
    ]
    for how, label in (("jit", "numba JIT (disk cache warm)"), ("aot", "ahead of time (pycc)")):
        m = list(marks[how].values())
        lines.append(
            f"| {label} | " + " | ".join(f"{v:.0f}" for v in m) + f" | {m[-1] - m[0]:.0f} |"
        )
    lines += [
        "",
        f"Same bits from both: {'yes' if same else '**no**'}.",
        "",
        "Best call time (ms), both in one process:",
        "",
        "| kernel | JIT | ahead of time | AOT / JIT |",
        "|---|--:|--:|--:|",
    ]
    for f in FORMATS:
        for k in ("gemm", "gemv"):
            j, o = best[f"{k} {f} jit"], best[f"{k} {f} aot"]
            lines.append(f"| {k} {f} | {j * 1e3:.2f} | {o * 1e3:.2f} | {o / j:.2f} |")
    text = "\n".join(lines) + "\n"
    if args.out:
        from qllama.atomic import atomic_write

        with atomic_write(args.out, "w") as fh:
            fh.write(text)
        print(f"wrote {args.out}")
    else:
        print(text)
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
