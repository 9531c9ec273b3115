"""``nox -s reference``: the transformers f32 reference of the study, cached with provenance.

The reference is transformers (eager attention, float32, CPU) reading qllama's F32 SmolLM2
file with ``gguf_file=``: the study's chat prompt, greedy to ``<|im_end|>`` or 300 new
tokens, and the logits of every position from one forward pass. It is written to
``results/reference.npz`` with everything it depends on (versions, file hash, prompt, ids,
settings) and reused while those match.

    python -m experiments.reference [--force] [--results DIR]
"""

from __future__ import annotations

import argparse
import hashlib
import json
import platform
import sys
from pathlib import Path
from typing import Any

from experiments import study
from qllama import __version__, load
from qllama.compare import Reference
from qllama.model_files import sha256_file, variant

RESULTS = Path("results")


def prompt_ids(f32_path: Path) -> tuple[list[int], list[int]]:
    """The study prompt's ids and the stop ids, from qllama's tokenizer (llama.cpp's ids)."""
    model = load(f32_path, check_weights=False)
    ids = model.apply_chat_template(study.MESSAGES)
    return ids, sorted(model.tokenizer.stop_ids)


def provenance(f32_path: Path, ids: list[int], stop_ids: list[int]) -> dict[str, Any]:
    """Everything the reference depends on."""
    import accelerate
    import gguf
    import numpy
    import torch
    import transformers

    return {
        "model": study.MODEL,
        "file": f32_path.name,
        "file_sha256": sha256_file(f32_path),
        "messages": study.MESSAGES,
        "prompt_ids": ids,
        "stop_ids": stop_ids,
        "max_new_tokens": study.MAX_NEW_TOKENS,
        "settings": "transformers AutoModelForCausalLM, gguf_file=, float32, eager, CPU, greedy",
        "versions": {
            "python": platform.python_version(),
            "numpy": numpy.__version__,
            "torch": torch.__version__,
            "transformers": transformers.__version__,
            "accelerate": accelerate.__version__,
            "gguf": getattr(gguf, "__version__", "unknown"),
            "qllama": __version__,
        },
    }


def key_of(meta: dict[str, Any]) -> str:
    return hashlib.sha256(json.dumps(meta, sort_keys=True).encode()).hexdigest()[:16]


def ensure(results: Path = RESULTS, *, force: bool = False) -> Reference:
    """The cached reference if its provenance matches, else a new one."""
    from qllama.reference import transformers_reference

    f32 = variant(study.MODEL, "F32")
    ids, stop_ids = prompt_ids(f32)
    meta = provenance(f32, ids, stop_ids)
    key = key_of(meta)
    path = results / "reference.npz"
    if path.exists() and not force:
        cached = Reference.load(str(path))
        if cached.meta.get("key") == key:
            print(f"reference: cached ({path}, key {key})")
            return cached
    print(f"reference: running transformers on {f32.name} ...", flush=True)
    ref = transformers_reference(f32, ids, max_new_tokens=study.MAX_NEW_TOKENS, stop_ids=stop_ids)
    ref.meta = {**meta, "key": key}
    results.mkdir(parents=True, exist_ok=True)
    ref.save(str(path))
    print(f"reference: {len(ref.continuation)} new tokens, logits {ref.logits.shape}, key {key}")
    return ref


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--force", action="store_true", help="recompute even if cached")
    p.add_argument("--results", type=Path, default=RESULTS)
    args = p.parse_args(argv)
    ensure(args.results, force=args.force)
    return 0


if __name__ == "__main__":
    sys.exit(main())
