"""Both quantizers on one file: llama.cpp's (through llama-cpp-python) and qllama's, each
either writing the file or refusing the file type."""

from __future__ import annotations

import ctypes
from pathlib import Path
from typing import Any

import numpy as np

from qllama.errors import ImatrixError, ModelConfigError
from qllama.gguf.imatrix import Entry, ImportanceMatrix, write_imatrix
from qllama.gguf.quantizer import quantize_file
from qllama.gguf.reader import read_gguf


def llama_quantize(src: Path, dst: Path, ftype: int) -> bool:
    """llama_model_quantize through llama-cpp-python; False where llama.cpp refuses."""
    import llama_cpp

    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = ftype
    params.nthread = 2
    src_b, dst_b = str(src).encode(), str(dst).encode()
    return llama_cpp.llama_model_quantize(src_b, dst_b, ctypes.byref(params)) == 0


def llama_quantize_tool(llama_tool: Any, src: Path, dst: Path, label: str, imatrix: Path) -> bool:
    """The llama-quantize tool with an importance matrix; False where it refuses."""
    run = llama_tool(
        "llama-quantize", "--imatrix", str(imatrix), str(src), str(dst), label, "2", timeout=3600
    )
    return run.returncode == 0


def random_imatrix(src: Path, folder: Path, seed: int = 11) -> tuple[Path, Path]:
    """An importance matrix for every 2-D blk.* weight of ``src``, in both formats (GGUF,
    legacy .dat): random, since the quantizers only read its values."""
    rng = np.random.default_rng(seed)
    entries = {
        t.name: Entry(
            (np.exp(rng.normal(0, 1.5, size=(1, t.ne[0]))) * 1536).astype(np.float32),
            np.array([1536]),
        )
        for t in read_gguf(src)
        if t.name.startswith("blk.") and len(t.ne) == 2
    }
    m = ImportanceMatrix(entries, ["corpus.txt"], 3, 512)
    write_imatrix(folder / "imatrix.gguf", m)
    write_imatrix(folder / "imatrix.dat", m)
    return folder / "imatrix.gguf", folder / "imatrix.dat"


def ours_or_refusal(src: Path, dst: Path, label: str, imatrix: Any = None) -> bool:
    """qllama's quantizer: True if it wrote the file, False if it refused the file type (an
    imatrix it needs, rows no block of the type divides), as llama.cpp refuses them."""
    try:
        quantize_file(src, dst, label, imatrix=imatrix)
    except (ImatrixError, ModelConfigError):
        return False
    return True
