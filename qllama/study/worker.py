"""A worker's side of a study: compute one cell (or one reference) from its task.

:func:`run_cell` and :func:`run_reference` are what every executor calls, in this process, in a
pool process or on a Dask worker. They touch no cache: they return the result and the driver
writes it (atomically), so a worker killed half-way leaves nothing behind. A task with an
environment (a draw's ``OPENBLAS_CORETYPE``...) runs in a fresh child process started with it,
since those variables are read when the libraries load:

    python -m qllama.study.worker < task.pickle > result.pickle
"""

from __future__ import annotations

import io
import os
import pickle
import platform
import subprocess
import sys
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from qllama.measure.compare import Reference
from qllama.study.cache import CellResult
from qllama.study.cells import Arithmetic, Cell
from qllama.study.declaration import MeasureSpec, StudyError
from qllama.study.references import ReferenceTask, compute, content_key
from qllama.study.variants import VariantFile

_REFERENCES: dict[str, Reference] = {}  # the last references this process read, by key


@dataclass(frozen=True)
class CellTask:
    """Everything a worker needs to compute one cell."""

    cell: Cell
    key: str
    how: Arithmetic
    variant: VariantFile
    source: str
    measures: tuple[MeasureSpec, ...]
    threads: int
    reference_path: str
    reference_key: str
    memory_mb: int = 2048
    meta: Mapping[str, Any] = field(default_factory=dict)
    files: Mapping[str, VariantFile] = field(default_factory=dict)  # the measures' other files


def limit_threads(n: int) -> None:
    """Every thread pool this cell may use (BLAS, OpenMP, numba, torch) at ``n`` threads, so
    that cells running side by side do not oversubscribe the cores."""
    import importlib.util

    try:
        from threadpoolctl import threadpool_limits

        threadpool_limits(limits=n)
    except ImportError:
        pass
    if importlib.util.find_spec("numba") is not None:
        import numba

        numba.set_num_threads(min(n, numba.config.NUMBA_NUM_THREADS))  # type: ignore[attr-defined]
    if "torch" in sys.modules:
        sys.modules["torch"].set_num_threads(n)


def environment() -> dict[str, Any]:
    """What decides float order here: the CPU, the BLAS kernels and thread counts, numpy's SIMD."""
    out: dict[str, Any] = {"machine": platform.machine(), "python": platform.python_version()}
    try:
        from threadpoolctl import threadpool_info

        out["threadpools"] = [
            {k: p.get(k) for k in ("internal_api", "architecture", "num_threads", "version")}
            for p in threadpool_info()
        ]
    except ImportError:
        pass
    try:
        from numpy._core._multiarray_umath import __cpu_dispatch__, __cpu_features__

        out["numpy_simd"] = [f for f in __cpu_dispatch__ if __cpu_features__.get(f)]
    except ImportError:
        pass
    if "torch" in sys.modules:
        torch = sys.modules["torch"]
        out["torch"] = {
            "capability": torch.backends.cpu.get_cpu_capability(),
            "threads": torch.get_num_threads(),
        }
    return out


def _reference(path: str, key: str, data: bytes | None) -> Reference:
    """The cell's reference, read from the shared path or from bytes the driver sent, and
    checked against its content key."""
    if key in _REFERENCES:
        return _REFERENCES[key]
    if data is not None:
        with np.load(io.BytesIO(data)) as z:
            ref = Reference(
                [int(t) for t in z["tokens"]], int(z["n_prompt"]), z["logits"], {"key": key}
            )
    elif Path(path).is_file():
        ref = Reference.load(path)
    else:
        raise StudyError(
            f"the reference {path} is not on this worker (share results/, or use dask)"
        )
    if content_key(ref) != key:
        raise StudyError(f"the reference {path} is not the one the driver planned with")
    _REFERENCES.clear()
    _REFERENCES[key] = ref
    return ref


def run_cell(task: CellTask, reference: bytes | None = None) -> CellResult:
    """Compute one cell: load its file on its arithmetic, run its measures."""
    if task.how.env and not _isolated():
        result: CellResult = isolated(run_cell, task, reference, env=task.how.env)
        return result
    from qllama.study import engines, measures, results
    from qllama.study.variants import resolve

    t0 = time.perf_counter()
    ref = _reference(task.reference_path, task.reference_key, reference)
    path = resolve(task.variant, task.source)
    limit_threads(task.threads)
    model = engines.open_model(
        task.how.engine, path, task.how.backend, task.how.options, task.threads
    )
    limit_threads(task.threads)  # the backend may have loaded a library of its own
    files = {name: str(resolve(f, task.source)) for name, f in task.files.items()}
    numbers: dict[str, Any] = {}
    arrays: dict[str, np.ndarray] = {}
    for spec in task.measures:
        nums, arrs = results.encode(measures.run(spec, model, ref, files), spec.name)
        numbers[spec.name] = nums
        arrays |= {f"{spec.name}.{k}": v for k, v in arrs.items()}
    c = task.cell
    return CellResult(
        {
            "cell": c.id,
            "prompt": c.prompt,
            "variant": c.variant,
            "setting": c.setting,
            "draw": c.draw,
            "key": task.key,
            "engine": task.how.engine,
            "backend": task.how.backend,
            "options": dict(task.how.options),
            "env": dict(task.how.env),
            "threads": task.threads,
            "device": str(model.backend.device),
            "file_sha256": task.variant.sha256,
            "reference": task.reference_key,
            "seconds": round(time.perf_counter() - t0, 1),
            "environment": environment(),
            "measures": numbers,
            **dict(task.meta),
        },
        arrays,
    )


def run_reference(task: ReferenceTask, folder: str = ".", shipped: None = None) -> bytes:
    """Compute one reference; returns it as ``.npz`` bytes (the driver writes the file).
    ``folder`` is the declaration's (a saved reference's path is relative to it)."""
    if task.env and not _isolated():
        data: bytes = isolated(run_reference, task, folder, None, env=task.env)
        return data
    import json

    ref = compute(task, Path(folder))
    buf = io.BytesIO()
    np.savez(
        buf,
        tokens=np.asarray(ref.tokens, np.int64),
        n_prompt=ref.n_prompt,
        logits=ref.logits,
        meta=json.dumps(ref.meta),
    )
    return buf.getvalue()


# --- a fresh child process for a task with an environment ------------------------------------

_CHILD_FLAG = "--qllama-study-child"


def _isolated() -> bool:
    """Whether this process is a task's own child (its environment is set already)."""
    return _CHILD_FLAG in sys.argv


def isolated(fn: Any, *args: Any, env: Mapping[str, str]) -> Any:
    """``fn(*args)`` in a new Python process whose environment has ``env`` added."""
    from qllama import defaults

    payload = pickle.dumps((fn, args))
    run = subprocess.run(
        [sys.executable, "-m", "qllama.study.worker", _CHILD_FLAG],
        input=payload,
        capture_output=True,
        env=defaults.child_environment(dict(env)),
        check=False,
    )
    if run.returncode != 0:
        lines = run.stderr.decode(errors="replace").strip().splitlines()
        raise StudyError(
            f"the child process for {fn.__name__} with {dict(env)} exited with "
            f"{run.returncode}: {lines[-1] if lines else 'no message'}"
        )
    kind, value = pickle.loads(run.stdout)
    if kind == "error":
        raise StudyError(value)
    return value


def watch_parent() -> None:
    """Exit when the parent dies (a killed driver or worker must not leave its children
    running): a thread that polls the parent's pid."""
    parent = os.getppid()

    def watch() -> None:
        while True:
            time.sleep(1.0)
            if os.getppid() != parent:
                os._exit(3)

    threading.Thread(target=watch, daemon=True).start()


def _child_main() -> int:
    watch_parent()
    fn, args = pickle.loads(sys.stdin.buffer.read())
    try:
        out = ("ok", fn(*args))
    except Exception as e:  # the parent raises it again, with the message
        out = ("error", f"{type(e).__name__}: {e}")
    sys.stdout.buffer.write(pickle.dumps(out))
    sys.stdout.buffer.flush()
    return 0


if __name__ == "__main__":
    sys.exit(_child_main())
