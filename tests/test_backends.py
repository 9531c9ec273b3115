"""The backend registry, the environment defaults, and clear errors."""

from __future__ import annotations

import importlib.util

import pytest

from qllama import backends, defaults
from qllama.errors import BackendError


def test_builtin_backends_are_listed():
    assert {"numpy", "torch", "jax", "array_api_strict"} <= set(backends.available())


def test_environment_gives_defaults_and_arguments_win(monkeypatch):
    monkeypatch.setenv("QLLAMA_BACKEND", "torch")
    monkeypatch.setenv("QLLAMA_DEQUANTIZE_ALL", "1")
    b = backends.get_backend()
    assert (b.name, b.dequantize_all) == ("torch", True)
    b = backends.get_backend("numpy", dequantize_all=False)
    assert (b.name, b.dequantize_all) == ("numpy", False)
    monkeypatch.setenv("QLLAMA_DEQUANTIZE_ALL", "0")
    assert defaults.dequantize_all() is False
    monkeypatch.delenv("QLLAMA_BACKEND")
    assert backends.get_backend().name == "numpy"


def test_unknown_backend():
    with pytest.raises(BackendError, match="unknown backend 'tensorflow'; available: numpy, torch"):
        backends.get_backend("tensorflow")


def test_missing_package_names_the_extra(monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == "jax" else real(name, *a)
    )
    with pytest.raises(
        BackendError,
        match=r"backend jax needs the package 'jax'; install it with pip install 'qllama\[jax\]'",
    ):
        backends.get_backend("jax")


@pytest.mark.parametrize(
    ("name", "device", "message"),
    [
        ("numpy", "cuda", "numpy"),
        ("torch", "tpu", "backend torch has no device 'tpu'"),
        ("array_api_strict", "cuda", "has no device 'cuda'"),
    ],
)
def test_unknown_device(name, device, message):
    with pytest.raises(BackendError, match=message):
        backends.get_backend(name, device=device)


def test_unavailable_torch_device():
    torch = pytest.importorskip("torch")
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    with pytest.raises(BackendError, match="device 'cuda' is not available here"):
        backends.get_backend("torch", device="cuda")


def test_unknown_option():
    with pytest.raises(BackendError, match="takes no options"):
        backends.get_backend("torch", fast=True)


@pytest.mark.parametrize("weight_type", ["Q8_0", "Q4_K", "Q5_K", "Q6_K", "IQ4_XS", "MXFP4"])
def test_torch_widening_once_or_in_each_matmul_gives_the_same_bits(tmp_path, weight_type):
    """The GPU arithmetic widens each weight to float32 for its matmul; widening it once at
    load (``dequantize_all``) multiplies the same float32 matrix by the same kernel, so every
    logit is the same bit for bit. The study relies on this to run its GPU column on the
    CPU without dequantizing every weight at every step (experiments/seed.toml)."""
    if importlib.util.find_spec("torch") is None:
        pytest.skip("torch is not installed")
    import numpy as np

    import qllama
    from qllama.array_api import to_numpy
    from qllama.synthetic import TinyConfig, write_tiny_llama

    path = tmp_path / "tiny.gguf"
    write_tiny_llama(path, TinyConfig(n_embd=256, n_ff=512, weight_type=weight_type))
    ids = [1, 40, 77, 200, 5, 260, 99, 3]

    def logits(dequantize_all: bool) -> np.ndarray:
        m = qllama.load(path, backend="torch", device="cpu", dequantize_all=dequantize_all)
        rows = [to_numpy(m.forward(ids[:5], pos=0, all_logits=True))]
        rows += [
            to_numpy(m.forward([t], pos=5 + i, all_logits=True)) for i, t in enumerate(ids[5:])
        ]
        return np.concatenate(rows)

    np.testing.assert_array_equal(logits(False), logits(True))
