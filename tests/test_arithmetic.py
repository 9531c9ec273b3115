"""Arithmetic per tensor (``arithmetic=``) and tensors from other files (``weights_from=``)."""

from __future__ import annotations

import importlib.util

import numpy as np
import pytest
from bounds import forward_bound

import qllama
from qllama.array_api import to_numpy
from qllama.backends.base import arithmetic, describe
from qllama.errors import (
    BackendError,
    GGUFOpenError,
    ModelConfigError,
    QllamaError,
    TensorShapeError,
)
from qllama.ggml_types import GGMLType
from qllama.runtime.arithmetic import ROUTES, SETTINGS, PolicyBackend, resolve
from qllama.runtime.model import rms_norm
from qllama.runtime.observe import record
from qllama.synthetic import TinyConfig, write_tiny_llama

IDS = [1, 40, 77, 200, 5, 260, 99, 3]
NAMES = [
    "token_embd.weight",
    "blk.0.attn_q.weight",
    "blk.0.ffn_down.weight",
    "blk.1.ffn_down.weight",
]


def logits(model) -> np.ndarray:
    return to_numpy(model.forward(IDS, all_logits=True))


def need(module: str) -> None:
    if importlib.util.find_spec(module) is None:
        pytest.skip(f"{module} is not installed")


# --- the policy -------------------------------------------------------------------------------


def test_first_matching_pattern_wins():
    routes = resolve({"blk.*.ffn_down.weight": "q8", "blk.0.*": "dequantized", "*": "f32"}, NAMES)
    assert routes == {
        "token_embd.weight": "f32",
        "blk.0.attn_q.weight": "dequantized",
        "blk.0.ffn_down.weight": "q8",
        "blk.1.ffn_down.weight": "q8",
    }
    assert resolve("f32", NAMES) == dict.fromkeys(NAMES, "f32")


@pytest.mark.parametrize(
    ("policy", "message"),
    [
        ({"blk.*": "q8"}, "no pattern for tensor 'token_embd.weight'; add a '\\*' entry last"),
        ({"*": "q8", "blk.*": "f32"}, "'blk.\\*' match no 2-D weight"),
        ({"blk.9.*": "q8", "*": "f32"}, "'blk.9.\\*' match no 2-D weight"),
        ({"*": "int4"}, "arithmetic 'int4' \\(for '\\*'\\) is not one of q8, f32, dequantized"),
        ({}, "policy is empty"),
    ],
)
def test_bad_policies(policy, message):
    with pytest.raises(BackendError, match=message):
        resolve(policy, NAMES)


@pytest.mark.parametrize(
    ("policy", "options"),
    [
        ("q8", {}),
        ({"*": "f32"}, {"activations": "f32"}),
        ({"*": "dequantized"}, {"dequantize_all": True}),
    ],
)
def test_one_arithmetic_everywhere_is_the_plain_backend(tiny_variants, policy, options):
    path = tiny_variants["Q8_0"]
    routed = qllama.load(path, arithmetic=policy)
    assert not isinstance(routed.backend, PolicyBackend)
    np.testing.assert_array_equal(logits(routed), logits(qllama.load(path, **options)))


def test_each_tensor_is_computed_in_its_own_arithmetic(tiny_variants):
    """Q8 activations for block 1 only: block 0's values are the f32 model's bit for bit,
    block 1's differ from them, and its products are the CPU model's bit for bit."""
    path = tiny_variants["Q8_0"]
    mixed = qllama.load(path, arithmetic={"blk.1.*": "q8", "*": "f32"})
    assert isinstance(mixed.backend, PolicyBackend)
    assert mixed.backend.routes["blk.1.ffn_up.weight"] == "q8"
    assert mixed.backend.routes["blk.0.ffn_up.weight"] == "f32"
    assert mixed.weights.layers[1].attn_q.arithmetic == "q8"
    said = describe(mixed.backend)  # what computes the run, as its first line says
    assert said.startswith("per-tensor arithmetic (f32 for 8 tensors, q8 for 7 tensors); f32: ")
    assert "; q8: numpy, cpu arithmetic" in said
    assert arithmetic(mixed.backend) == "per-tensor"
    ours = record(mixed, IDS)
    f32 = record(qllama.load(path, activations="f32"), IDS)
    for p in ("attn_out", "ffn_out", "out"):
        np.testing.assert_array_equal(ours[f"blk.0.{p}"], f32[f"blk.0.{p}"])
        assert not np.array_equal(ours[f"blk.1.{p}"], f32[f"blk.1.{p}"])
    # block 1 under the CPU arithmetic, fed block 0's f32 output: the CPU model's products
    cpu = qllama.load(path)
    x = ours["blk.0.out"]
    layer = cpu.weights.layers[1]
    h = rms_norm(x, layer.attn_norm, cpu.config.eps, xp=np)
    np.testing.assert_array_equal(
        mixed.backend.matmul(h, mixed.weights.layers[1].attn_q), cpu.backend.matmul(h, layer.attn_q)
    )


def test_the_model_runs_as_before_under_a_policy(tiny_variants):
    """Generation, the KV cache, the embedding lookup: everything goes through the policy."""
    path = tiny_variants["Q8_0"]
    m = qllama.load(path, arithmetic={"token_embd.weight": "dequantized", "*": "q8"})
    assert (
        m.generate(IDS[:4], max_new_tokens=6).ids
        == qllama.load(path).generate(IDS[:4], max_new_tokens=6).ids
    )


@pytest.mark.parametrize("backend", ["torch", "jax", "array_api_strict"])
def test_float_backends_declare_q8_unsupported(tiny_variants, backend):
    need(backend)
    assert "q8" not in ROUTES[backend]
    with pytest.raises(BackendError, match=f"backend {backend} has no 'q8' arithmetic: it"):
        qllama.load(tiny_variants["Q8_0"], backend=backend, arithmetic={"*": "q8"})


@pytest.mark.parametrize("backend", ["torch", "jax"])
def test_float_backends_mix_f32_and_dequantized(tiny_variants, backend):
    """Dequantized at load or inside the matmul: the same float32 weights, the same products
    up to the order of the sums (jax compiles dequantize-and-multiply into one kernel)."""
    need(backend)
    path = tiny_variants["Q8_0"]
    mixed = qllama.load(path, backend=backend, arithmetic={"blk.0.*": "dequantized", "*": "f32"})
    assert isinstance(mixed.backend, PolicyBackend)
    plain = logits(qllama.load(path, backend=backend))
    c = mixed.config
    bound = forward_bound(c.n_layer, c.n_ff, float(np.abs(plain).max()))  # tests/bounds.py
    np.testing.assert_allclose(logits(mixed), plain, rtol=0, atol=bound)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"activations": "f32"}, "arithmetic= decides activations per tensor"),
        ({"dequantize_all": True}, "decides dequantize_all per tensor"),
        ({"backend": "mine"}, "backend mine declares no per-tensor arithmetics"),
    ],
)
def test_options_a_policy_decides_are_refused(tiny_variants, kwargs, message):
    with pytest.raises(BackendError, match=message):
        qllama.load(tiny_variants["Q8_0"], arithmetic={"blk.0.*": "q8", "*": "f32"}, **kwargs)


def test_a_backend_instance_cannot_take_a_policy(tiny_variants):
    from qllama.backends import get_backend

    with pytest.raises(BackendError, match="give a backend name"):
        qllama.load(tiny_variants["Q8_0"], backend=get_backend("numpy"), arithmetic="q8")


def test_the_environment_does_not_override_a_policy(tiny_variants, monkeypatch):
    monkeypatch.setenv("QLLAMA_DEQUANTIZE_ALL", "1")
    path = tiny_variants["Q8_0"]
    cpu = qllama.load(path, arithmetic="q8")
    assert not cpu.backend.dequantize_all
    np.testing.assert_array_equal(logits(cpu), logits(qllama.load(path, dequantize_all=False)))


def test_the_settings_name_declared_routes():
    for s in SETTINGS.values():
        assert s.arithmetic in ROUTES[s.backend]


# --- weights from other files ---------------------------------------------------------------


def test_every_tensor_from_the_f32_file_is_the_f32_model(tiny_variants):
    both = qllama.load(tiny_variants["Q8_0"], weights_from={"*": tiny_variants["F32"]})
    np.testing.assert_array_equal(logits(both), logits(qllama.load(tiny_variants["F32"])))


def test_one_class_from_another_file(tiny_variants):
    m = qllama.load(
        tiny_variants["Q8_0"], weights_from={"blk.*.ffn_down.weight": tiny_variants["F32"]}
    )
    types = {name: t.ggml_type for name, t in m.source.tensors.items()}
    assert types["blk.0.ffn_down.weight"] == types["blk.1.ffn_down.weight"] == GGMLType.F32
    assert types["blk.0.ffn_up.weight"] == GGMLType.Q8_0
    assert set(m.source.sources) == {"blk.0.ffn_down.weight", "blk.1.ffn_down.weight"}
    # the taken weights are the F32 file's values, the others the Q8_0 file's
    f32 = qllama.load(tiny_variants["F32"], dequantize_all=True)
    q8 = qllama.load(tiny_variants["Q8_0"], dequantize_all=True)
    again = qllama.load(
        tiny_variants["Q8_0"],
        weights_from={"blk.*.ffn_down.weight": tiny_variants["F32"]},
        dequantize_all=True,
    )
    layer, want_down, want_up = again.weights.layers[0], f32.weights.layers[0], q8.weights.layers[0]
    np.testing.assert_array_equal(layer.ffn_down.w, want_down.ffn_down.w)
    np.testing.assert_array_equal(layer.ffn_up.w, want_up.ffn_up.w)


def test_weights_from_and_arithmetic_together(tiny_variants):
    m = qllama.load(
        tiny_variants["F32"],
        weights_from={"blk.0.*": tiny_variants["Q8_0"]},
        arithmetic={"blk.0.*": "q8", "*": "f32"},
    )
    assert m.weights.layers[0].attn_q.arithmetic == "q8"
    assert m.source.tensors["blk.0.attn_q.weight"].ggml_type == GGMLType.Q8_0
    assert np.isfinite(logits(m)).all()


def test_weights_from_errors(tiny_variants, tmp_path, open_files):
    other = tmp_path / "wide.gguf"
    write_tiny_llama(other, TinyConfig(n_embd=128, n_ff=512, n_head=8, n_head_kv=2))
    shallow = tmp_path / "shallow.gguf"
    write_tiny_llama(shallow, TinyConfig(n_layer=1, n_embd=256, n_ff=512, n_head=8, n_head_kv=2))
    base = tiny_variants["Q8_0"]
    cases = [
        ({"blk.0.ffn_up.weight": other}, TensorShapeError, "has shape \\[512, 128\\] in"),
        ({"blk.1.*": shallow}, ModelConfigError, "has no tensor 'blk.1.attn_norm.weight'"),
        ({"blk.7.*": tiny_variants["F32"]}, QllamaError, "'blk.7.\\*' match no tensor"),
        ({"*": tmp_path / "missing.gguf"}, GGUFOpenError, "cannot open"),
    ]
    before = open_files(base), open_files(other), open_files(shallow)
    for weights_from, error, message in cases:
        with pytest.raises(error, match=message):
            qllama.load(base, weights_from=weights_from)
    assert (open_files(base), open_files(other), open_files(shallow)) == before


def test_an_untied_file_takes_its_output_too(tiny_variants):
    m = qllama.load(
        tiny_variants["untied-Q8_0"], weights_from={"output.weight": tiny_variants["untied-F32"]}
    )
    assert m.source.tensors["output.weight"].ggml_type == GGMLType.F32
    assert m.source.tensors["token_embd.weight"].ggml_type == GGMLType.Q8_0
