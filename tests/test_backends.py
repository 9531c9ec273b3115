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
