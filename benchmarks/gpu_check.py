"""The torch backend on CUDA (or MPS): does it compute the same model, and how fast.

    python benchmarks/gpu_check.py --files DIR [--make] --out DIR [--types Q8_0 ...]

``--make`` writes SmolLM2-shaped synthetic files into DIR first (random weights, a byte-level
vocabulary; the real model is too large to carry to a lent GPU machine): an F32 file quantized
by qllama's file quantizer to Q8_0 and Q4_K_M, so they have llama.cpp's mix of types. On the
machine with the accelerator, for each file:

* agreement: teacher-forced logits of the GPU arithmetic and of dequantize-all on the device
  against numpy's dequantize-all on the CPU (max |delta|; the same float32 model, so only
  the summation order differs), of all positions in one pass and of decode steps one token at
  a time after a prefill, and greedy tokens of the device against numpy's;
* speed: load, teacher forcing, prefill and decode rates (``workers.run_qllama``) of the GPU
  arithmetic and of dequantize-all.

Each mode runs twice: eagerly, and with the torch backend's ``compile=True`` (the decode step
``torch.compile``d, replayed as a CUDA graph on CUDA). For the compiled runs it records the
first decode step's seconds (tracing and compiling), and from torch's counters how many graphs
were compiled, graph breaks, and CUDA graphs skipped (with why, in torch's log) and inputs a
graph copies in at each replay. Teacher forcing and prefill run eagerly either way (on the
fixed cache that compiling needs). On a CPU the compiled step is inductor's C++ kernels: its
numbers say that the option works, not what a GPU gains.

Prints a table and writes ``gpu_check.json`` to ``--out``.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).parent))
from common import memory_mb
from workers import run_qllama

import qllama
from qllama.array_api import to_numpy
from qllama.atomic import atomic_write
from qllama.gguf.quantizer import quantize_file
from qllama.synthetic import TinyConfig, write_tiny_llama

FILE_TYPES = ("Q8_0", "Q4_K_M")
# each mode's torch backend options, eager and compiled
MODES: dict[str, dict[str, Any]] = {
    "gpu": {},
    "gpu+compile": {"compile": True},
    "dequantize-all": {"dequantize_all": True},
    "dequantize-all+compile": {"dequantize_all": True, "compile": True},
}
PREFILL = 8  # the prompt before the decode steps and the greedy tokens
# SmolLM2-135M's shape (30 layers in the real model; fewer keep the files small enough to carry)
SMOLLM2 = {"n_embd": 576, "n_ff": 1536, "n_head": 9, "n_head_kv": 3, "n_ctx": 512}


def make_files(where: Path, layers: int) -> None:
    """A synthetic F32 SmolLM2-shaped model, quantized to each of FILE_TYPES."""
    where.mkdir(parents=True, exist_ok=True)
    f32 = where / "synthetic-f32.gguf"
    write_tiny_llama(f32, TinyConfig(n_layer=layers, scale=0.05, **SMOLLM2))
    for ftype in FILE_TYPES:
        quantize_file(f32, where / f"synthetic-{ftype.lower()}.gguf", ftype)
    f32.unlink()  # the quantized files are what travels


def compile_counters() -> dict[str, int]:
    """torch's running counts of what it compiled: graphs, graph breaks, CUDA graphs skipped
    (torch logs why), and inputs that a recorded CUDA graph copies in at each replay."""
    from torch._dynamo.utils import counters

    return {
        "graphs": counters["stats"]["unique_graphs"],
        "graph_breaks": sum(counters["graph_break"].values()),
        "cudagraph_skips": counters["inductor"]["cudagraph_skips"],
        "cudagraph_copied_inputs": counters["inductor"]["cudagraph_recorded_non_static_inputs"],
    }


def agreement(
    path: Path, ref_model: Any, device: str, ids: list[int], new_tokens: int
) -> dict[str, Any]:
    """The device's logits and greedy tokens against ``ref_model`` (numpy's dequantize-all
    of the same file): all positions in one pass, and ``new_tokens`` decode steps along
    ``ids`` after a prefill of PREFILL (the compiled step, where the mode compiles)."""
    ref = ref_model.forward(ids, 0, all_logits=True)
    ref_tokens = ref_model.generate(ids[:PREFILL], max_new_tokens=new_tokens).ids
    out: dict[str, Any] = {}
    for mode, options in MODES.items():
        before = compile_counters()
        m = qllama.load(path, backend="torch", device=device, **options)
        got = to_numpy(m.forward(ids, 0, all_logits=True))
        to_numpy(m.forward(ids[:PREFILL], 0))
        t = time.perf_counter()
        steps = [to_numpy(m.forward([ids[PREFILL]], PREFILL))]
        first_step_s = time.perf_counter() - t  # with the tracing and compiling
        rest = range(PREFILL + 1, PREFILL + new_tokens)
        steps += [to_numpy(m.forward([ids[p]], p)) for p in rest]
        want = ref[PREFILL : PREFILL + new_tokens]  # (new_tokens, vocab)
        tokens = m.generate(ids[:PREFILL], max_new_tokens=new_tokens).ids
        out[mode] = {
            "max_abs_delta": float(np.abs(got - ref).max()),
            "decode_max_abs_delta": float(np.abs(np.stack(steps) - want).max()),
            "max_abs_logit": float(np.abs(ref).max()),
            "greedy_agree": next(
                (i for i, (a, b) in enumerate(zip(tokens, ref_tokens, strict=False)) if a != b),
                min(len(tokens), len(ref_tokens)),
            ),
            "greedy_tokens": len(ref_tokens),
            "first_step_s": first_step_s,
        }
        if options.get("compile"):
            after = compile_counters()
            out[mode]["compiled"] = {k: after[k] - before[k] for k in after}
    return out


def speed(path: Path, device: str, ids: list[int], threads: int) -> dict[str, Any]:
    """Rates of the GPU arithmetic and dequantize-all on the device, eager and compiled (the
    compiling falls in the decode's warm-up steps, which are not timed)."""
    job = {"file": str(path), "ids": ids, "prompt_len": 32, "decode_steps": 64}
    job |= {"warmup_steps": 8, "repeats": 3, "threads": threads}
    return {
        f"torch-{mode}": run_qllama(job | {"backend": "torch", "device": device, "options": opts})
        for mode, opts in MODES.items()
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--files", type=Path, required=True, help="folder of the synthetic files")
    p.add_argument("--make", action="store_true", help="write the files first")
    p.add_argument("--layers", type=int, default=6, help="layers of the synthetic model")
    p.add_argument("--device", default=None, help="torch device (default: the best there is)")
    p.add_argument("--threads", type=int, default=2, help="torch's CPU threads")
    p.add_argument("--out", type=Path, default=None, help="folder for gpu_check.json")
    p.add_argument("--types", nargs="+", default=FILE_TYPES, help="which of the files to check")
    args = p.parse_args(argv)
    if args.make:
        make_files(args.files, args.layers)
    import torch

    from qllama.backends.torch import devices

    device = args.device or devices()[0]
    result: dict[str, Any] = {
        "device": device,
        "device_name": torch.cuda.get_device_name() if device.startswith("cuda") else device,
        "torch": torch.__version__,
        "threads": args.threads,
        "files": {},
    }
    rng = np.random.default_rng(0)
    for ftype in args.types:
        path = args.files / f"synthetic-{ftype.lower()}.gguf"
        ref_model = qllama.load(path, backend="numpy", dequantize_all=True)
        ids = [int(i) for i in rng.integers(1, ref_model.config.n_vocab, 128)]
        result["files"][ftype] = {
            "agreement": agreement(path, ref_model, device, ids, 32),
            "speed": speed(path, device, ids, args.threads),
        }
        for mode, a in result["files"][ftype]["agreement"].items():
            print(
                f"{ftype:7} {mode:22} max|d| {a['max_abs_delta']:.2e}, decode "
                f"{a['decode_max_abs_delta']:.2e} (|logit| {a['max_abs_logit']:.1f}), greedy "
                f"agrees for {a['greedy_agree']} / {a['greedy_tokens']}, first step "
                f"{a['first_step_s']:.2f} s {a.get('compiled', '')}"
            )
        for name, r in result["files"][ftype]["speed"].items():
            print(
                f"{ftype:7} {name:28} decode {r['decode_tok_s']:8.1f} tok/s  "
                f"teacher forcing {r['tf_tok_s']:8.1f} tok/s  load {r['load_s']:.2f} s"
            )
    result["host_peak_rss_mb"] = memory_mb()["peak_rss_mb"]
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        with atomic_write(args.out / "gpu_check.json", "w") as f:
            json.dump(result, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
