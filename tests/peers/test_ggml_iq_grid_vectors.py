"""The committed IQ grid vectors are what ggml gives today: tools/ggml_iq_grid_vectors.py
rerun against the llama-cpp-python build and the vendored llama.cpp source, array by array."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("llama_cpp")
pytestmark = pytest.mark.peers

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.skipif(shutil.which("cc") is None, reason="no C compiler for ggml's generic C")
def test_vectors_are_reproduced_by_ggml(tmp_path):
    out = tmp_path / "vectors.npz"
    script = ROOT / "tools" / "ggml_iq_grid_vectors.py"
    subprocess.run([sys.executable, str(script), "--out", str(out)], check=True, timeout=1800)
    with np.load(ROOT / "tests" / "data" / "ggml_vectors_iq_grid.npz") as old, np.load(out) as new:
        assert sorted(old.files) == sorted(new.files)
        for key in old.files:
            a, b = old[key], new[key]
            assert a.dtype == b.dtype and a.shape == b.shape, key
            same = a.view(np.uint8) if a.dtype.kind == "f" else a
            assert np.array_equal(same, b.view(np.uint8) if b.dtype.kind == "f" else b), key
