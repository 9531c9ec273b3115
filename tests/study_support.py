"""A tiny synthetic study for the study tests, and a measure that lets a test kill a worker
in the middle of a cell. Importable by pool and Dask workers (spawned with this sys.path)."""

from __future__ import annotations

import os
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from qllama.study import register

TOML = """
name = "tiny"
model = "tiny.gguf"
threads = 1
measures = [{measures}]

[reference]
kind = "qllama"

[[variant]]
type = "F32"
[[variant]]
type = "Q8_0"

[[setting]]
name = "cpu"
backend = "numpy"
[[setting]]
name = "dequantize-all"
backend = "numpy"
options = {{dequantize_all = true}}

[[prompt]]
name = "raw"
chat = false
text = "the world is"
max_new_tokens = 6
[[prompt]]
name = "chat"
text = "hello"
max_new_tokens = 4

[[cross]]
pair = ["cpu", "dequantize-all"]
[[compare]]
a = "Q8_0-cpu"
b = "Q8_0-dequantize-all"
{extra}
"""

MEASURES = '"last_position", "teacher_forcing", "teacher_forcing_batched", "free_generation"'


def write_study(
    folder: Path, *, measures: str = MEASURES, extra: str = "", family: Any = None
) -> Path:
    """A tiny random model (F32: a llama, or ``family``, a TinyConfig) and a study of it, in
    ``folder``; returns the TOML's path."""
    from qllama.synthetic import write_tiny, write_tiny_llama

    if not (folder / "tiny.gguf").exists():
        if family is None:
            write_tiny_llama(folder / "tiny.gguf")
        else:
            write_tiny(folder / "tiny.gguf", family)
    path = folder / "tiny.toml"
    path.write_text(TOML.format(measures=measures, extra=extra))
    return path


@register("hold_once", defaults={"folder": ""}, about="tests: wait to be killed, once")
def hold_once(model: Any, ref: Any, options: Mapping[str, Any]) -> dict[str, Any]:
    """The first cell to find ``folder/armed`` renames it ``held-<pid>`` (one cell wins) and
    waits, at most a minute, for the test to kill its process; every other run returns at
    once. The numbers are the same either way."""
    folder = Path(options["folder"])
    try:
        os.rename(folder / "armed", folder / f"held-{os.getpid()}")
    except OSError:
        return {"prompt_tokens": ref.n_prompt}
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        time.sleep(0.2)
    return {"prompt_tokens": ref.n_prompt}


def hold_pid(path: str, shipped: Any = None) -> None:
    """A job for the executor tests: write this process's pid to ``path``, then wait (at most
    a minute) to be killed or orphaned."""
    Path(path).write_text(str(os.getpid()))
    time.sleep(60)
