"""Does the forward pass's observer hook cost anything when no observer is given?

    python benchmarks/observer_overhead.py [--file F.gguf] [--kernels numba|numpy]
        [--steps 24] [--rounds 5]

Decodes ``--steps`` tokens one at a time on the numpy backend (SmolLM2 Q8_0 by default: the
study's chat prompt, prefilled, then greedy steps with the KV cache) and prints the median
milliseconds per step, ``--rounds`` times. Where the qllama it imports has the observer
(``forward(..., observer=)``), rounds alternate between no observer and a no-op observer, so
both see the same machine. To compare with code that has no hook, run the script again with
``PYTHONPATH`` pointing at that checkout: it prints which qllama it measured. The last line is
one JSON record.
"""

from __future__ import annotations

import argparse
import inspect
import json
import statistics
import time
from typing import Any

import numpy as np
from common import MESSAGES, MODEL


def decode_ms(model: Any, prompt: list[int], steps: int, **forward: Any) -> float:
    """Median milliseconds of one decoding step (greedy, after prefilling ``prompt``)."""
    logits = model.forward(prompt, pos=0, **forward)
    token, times = int(np.argmax(logits)), []
    for s in range(steps):
        t = time.perf_counter()
        logits = model.forward([token], pos=len(prompt) + s, **forward)
        times.append(time.perf_counter() - t)
        token = int(np.argmax(logits))
    return 1000 * statistics.median(times)


def alternate(
    model: Any, prompt: list[int], steps: int, rounds: int, *, report: bool = False
) -> dict[str, list[float]]:
    """ms/step of each round, no observer and a no-op one taking turns (where the forward
    pass has the hook), after a warm-up: kernels loaded, caches sized."""
    variants: dict[str, dict[str, Any]] = {"none": {}}
    if "observer" in inspect.signature(model.forward).parameters:
        variants["no-op observer"] = {"observer": lambda name, value: None}
    decode_ms(model, prompt, 2)
    ms: dict[str, list[float]] = {k: [] for k in variants}
    for r in range(rounds):
        for label, forward in variants.items():
            ms[label].append(decode_ms(model, prompt, steps, **forward))
            if report:
                print(f"round {r}: {label:<15} {ms[label][-1]:8.2f} ms/step", flush=True)
    return ms


def main() -> None:
    import qllama
    from qllama.model_files import variant

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--file", help="a GGUF (default: SmolLM2 Q8_0, built by qllama)")
    p.add_argument("--kernels", choices=["numba", "numpy"], default="numba")
    p.add_argument("--steps", type=int, default=24)
    p.add_argument("--rounds", type=int, default=5)
    args = p.parse_args()
    path = args.file or variant(MODEL, "Q8_0")
    model = qllama.load(path, backend="numpy", kernels=args.kernels)
    prompt = model.apply_chat_template(MESSAGES)
    ms = alternate(model, prompt, args.steps, args.rounds, report=True)
    record = {
        "qllama": str(qllama.__file__),
        "has_observer": "no-op observer" in ms,
        "kernels": args.kernels,
        "steps": args.steps,
        "median_ms_per_step": {k: statistics.median(v) for k, v in ms.items()},
        "rounds": ms,
    }
    print(json.dumps(record))


if __name__ == "__main__":
    main()
