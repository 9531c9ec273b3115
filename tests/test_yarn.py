"""YaRN RoPE scaling (qllama.runtime.yarn, ``rope_tables(yarn=...)``) and rope.scaling.attn_factor.

- the scalars against hand computations of ggml's formulas: the correction dims of the real
  gpt-oss files, the attention factor llama_context hands ggml;
- the cos/sin tables against a port of ggml's ``ggml_rope_cache_init``/``rope_yarn``, one
  position and one pair at a time;
- tiny random transformers models rotating with YaRN, converted by llama.cpp's converter
  (tests/conformance/yarn.py): qllama's F32 logits against transformers', every backend;
- which YaRN keys are read (what is refused: tests/test_architectures.py's REFUSED).
"""

from __future__ import annotations

import dataclasses
import importlib.util
import math
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from test_architectures import FAMILIES, IDS
from test_moe import check_against_transformers

import qllama
from qllama.array_api import namespace, to_numpy
from qllama.ggml_types import ValueType
from qllama.gguf.reader import GGUFValue
from qllama.runtime.architectures import Yarn
from qllama.runtime.model import rope_tables
from qllama.runtime.yarn import context_attn_factor, corr_dims, rope_mscale
from qllama.synthetic import write_tiny

f32 = lambda v: GGUFValue(ValueType.FLOAT32, v)  # noqa: E731
u32 = lambda v: GGUFValue(ValueType.UINT32, v)  # noqa: E731
NAMESPACES = ["numpy", "torch", "jax", "array_api_strict"]


def test_the_correction_dims_of_gpt_oss() -> None:
    """gpt-oss-20b: 64 rotated dims, original context 4096, base 150000, betas 32 and 1:
    64 ln(4096 / (32 2 pi)) / (2 ln 150000) = 8.09 (floored: 8) and
    64 ln(4096 / (2 pi)) / (2 ln 150000) = 17.40 (ceiled: 18)."""
    low = 64 * math.log(4096 / (32 * 2 * math.pi)) / (2 * math.log(150000))
    high = 64 * math.log(4096 / (2 * math.pi)) / (2 * math.log(150000))
    assert (round(low, 2), round(high, 2)) == (8.09, 17.40)
    assert corr_dims(64, 4096, 150000.0, 32.0, 1.0) == (8.0, 18.0)
    # the start at least 0 (a short original context puts it below), the end at most
    # n_dims - 1; nothing orders them (a ramp of width 0.001 then: every pair extrapolated)
    assert corr_dims(16, 64, 10000.0, 32.0, 1.0) == (0.0, 3.0)
    assert corr_dims(8, 1 << 24, 10.0, 32.0, 1.0) == (19.0, 7.0)


def test_the_magnitude_is_one_plus_a_tenth_of_ln_factor() -> None:
    """llama_context divides its get_mscale by 1 + 0.1 ln(factor) and rope_yarn multiplies it
    back: the magnitude is 1 + 0.1 ln(32) for gpt-oss, times rope.scaling.attn_factor."""
    scale = 1.0 / 32.0
    assert rope_mscale(context_attn_factor(scale, 0.0, 1.0), scale) == pytest.approx(
        1 + 0.1 * math.log(32), rel=1e-6
    )
    got = rope_mscale(context_attn_factor(scale, 0.0, 0.5), scale)
    assert got == pytest.approx(0.5 * (1 + 0.1 * math.log(32)), rel=1e-6)
    # mistral3's log multiplier m: get_mscale(f) / get_mscale(f, m), the ggml factor cancelled
    got = context_attn_factor(scale, 2.0, 1.0)
    want = 1 / (0.2 * math.log(32) + 1)
    assert got == pytest.approx(want, rel=1e-6)
    assert context_attn_factor(1.0, 0.0, 1.0) == 1.0  # no scaling: no magnitude


def ggml_rope_cache(p: int, n_dims: int, base: float, scale: float, attn: float, y: Yarn) -> Any:
    """ggml_rope_cache_init with rope_yarn (ext_factor 1) for position ``p``, one pair at a
    time, in float64: (cos, sin) of shape (n_dims / 2,)."""
    low, high = corr_dims(n_dims, y.n_ctx_orig, base, y.beta_fast, y.beta_slow)
    theta_scale = base ** (-2.0 / n_dims)
    theta = float(p)
    cos, sin = [], []
    for i0 in range(0, n_dims, 2):
        extrap = theta
        interp = scale * extrap
        ramp = 1 - min(1.0, max(0.0, (i0 // 2 - low) / max(0.001, high - low)))
        angle = interp * (1 - ramp) + extrap * ramp
        mscale = attn * (1.0 + 0.1 * math.log(1.0 / scale))
        cos.append(math.cos(angle) * mscale)
        sin.append(math.sin(angle) * mscale)
        theta *= theta_scale
    return np.array(cos), np.array(sin)


@pytest.mark.parametrize("ns", NAMESPACES)
@pytest.mark.parametrize(
    ("n_dims", "base", "factor", "orig"), [(64, 150000.0, 32.0, 4096), (16, 10000.0, 4.0, 64)]
)
def test_the_tables_are_ggmls(ns: str, n_dims: int, base: float, factor: float, orig: int) -> None:
    """Every position below 64, every pair: within float32 rounding of the angle (p x
    inv_freq, a few ulp of 64 radians)."""
    if importlib.util.find_spec(ns) is None:
        pytest.skip(f"{ns} is not installed")
    xp = namespace(ns)
    scale, y = 1.0 / factor, Yarn(orig)
    attn = context_attn_factor(scale, 0.0, 1.0)
    cos, sin = rope_tables(64, n_dims, base, xp=xp, scale=scale, attn_factor=attn, yarn=y)
    cos, sin = to_numpy(cos), to_numpy(sin)
    for p in range(64):
        want_cos, want_sin = ggml_rope_cache(p, n_dims, base, scale, attn, y)
        np.testing.assert_allclose(cos[p], want_cos, rtol=0, atol=3e-5)
        np.testing.assert_allclose(sin[p], want_sin, rtol=0, atol=3e-5)


def test_attn_factor_scales_cos_and_sin() -> None:
    """rope.scaling.attn_factor without YaRN: ggml multiplies cos and sin by it."""
    xp = namespace("numpy")
    cos, sin = rope_tables(8, 16, 10000.0, xp=xp)
    cos2, sin2 = rope_tables(8, 16, 10000.0, xp=xp, attn_factor=0.75)
    np.testing.assert_array_equal(cos2, cos * np.float32(0.75))
    np.testing.assert_array_equal(sin2, sin * np.float32(0.75))


# --- converted models against transformers -----------------------------------------------------

SPEC = 2e-5  # qllama F32 against transformers, relative to max |logit|


@pytest.mark.parametrize("name", ["gpt-oss-yarn", "qwen3moe-yarn", "mixtral-yarn"])
def test_transformers_yarn_on_the_original_safetensors(name: str) -> None:
    """A tiny random transformers model rotating with YaRN, converted by llama.cpp's converter
    (built once, then cached): qllama's F32 logits against transformers', every backend."""
    pytest.importorskip("transformers")
    from conformance.sources import Unreachable
    from conformance.yarn import build

    try:
        built = build(name)
    except Unreachable as e:
        pytest.skip(str(e))
    m = qllama.load(built.gguf, backend="numpy", activations="f32")
    assert all(k.rope is not None and k.rope.yarn is not None for k in m.kinds)
    check_against_transformers(built, SPEC)


# --- keys ------------------------------------------------------------------------------------


def _with_keys(tmp_path: Path, name: str, **keys: Any) -> Path:
    cfg = FAMILIES[name]
    path = tmp_path / f"{name}.gguf"
    write_tiny(path, dataclasses.replace(cfg, extra_keys=cfg.extra_keys + tuple(keys.items())))
    return path


YARN = {
    "rope.scaling.type": "yarn",
    "rope.scaling.factor": f32(4.0),
    "rope.scaling.original_context_length": u32(8),
}


def test_gpt_oss_with_yarn_runs(tmp_path: Path) -> None:
    """Real gpt-oss files rotate with YaRN: every layer, the sliding ones with their window."""
    m = qllama.load(_with_keys(tmp_path, "gpt-oss", **YARN), backend="numpy")
    assert {k.rope.yarn for k in m.kinds if k.rope} == {Yarn(8, 32.0, 1.0)}
    assert {k.window for k in m.kinds} == {0, 4}
    out = to_numpy(m.forward(IDS, all_logits=True))
    write_tiny(tmp_path / "plain.gguf", FAMILIES["gpt-oss"])
    plain = qllama.load(tmp_path / "plain.gguf", backend="numpy")
    assert np.isfinite(out).all()
    assert np.abs(out - to_numpy(plain.forward(IDS, all_logits=True))).max() > 1e-3


def test_the_original_context_defaults_to_the_context(tmp_path: Path) -> None:
    keys = {k: v for k, v in YARN.items() if k != "rope.scaling.original_context_length"}
    m = qllama.load(_with_keys(tmp_path, "qwen3", **keys), backend="numpy")
    assert m.config.layer(0).rope.yarn == Yarn(m.config.n_ctx)


def test_mistral3_reads_the_betas(tmp_path: Path) -> None:
    betas = {"rope.scaling.yarn_beta_fast": f32(8.0), "rope.scaling.yarn_beta_slow": f32(2.0)}
    keys = {**YARN, **betas}
    m = qllama.load(_with_keys(tmp_path, "mistral3", **keys), backend="numpy")
    assert m.config.layer(0).rope.yarn == Yarn(8, 8.0, 2.0)


def test_the_magnitude_the_converter_writes_is_accepted(tmp_path: Path) -> None:
    """transformers' attention_factor for factor 4 is 1 + 0.1 ln 4: what llama.cpp computes."""
    keys = {**YARN, "rope.scaling.yarn_attn_factor": f32(1 + 0.1 * math.log(4))}
    qllama.load(_with_keys(tmp_path, "llama", **keys), backend="numpy")
