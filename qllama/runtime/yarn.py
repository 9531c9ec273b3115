"""YaRN's scalars as llama.cpp and ggml compute them, in float32 with ``logf``.

Three places make them: ``llama_context``'s constructor (the attention factor it hands every
``ggml_rope_ext``, with the magnitude that ggml will multiply in cancelled beforehand),
``ggml_rope_yarn_corr_dims`` (the pairs between which the angle goes from extrapolated to
interpolated) and ggml's ``rope_yarn`` (the ramp between them, the magnitude). The angles
themselves are :func:`qllama.runtime.model.rope_tables`'.

Where transformers differs, this is ggml's: the correction dims are always truncated
(floored and ceiled; transformers leaves them fractional where the config says
``truncate: false``, as gpt-oss's does), the ramp's width is at least 0.001 (transformers adds
0.001 only where the two dims are equal), and a file's ``yarn_attn_factor`` is not read (the
magnitude is always ``1 + 0.1 ln(factor)``, times ``rope.scaling.attn_factor``).
"""

from __future__ import annotations

import math

import numpy as np

from qllama.array_api import Array, Namespace

f32 = np.float32


def _mscale(scale: np.float32, mul: np.float32) -> np.float32:
    """llama_context's get_mscale: 1 up to a factor of 1, else 0.1 mul ln(scale) + 1."""
    return f32(1.0) if scale <= 1 else f32(f32(0.1) * mul) * np.log(scale) + f32(1.0)


def context_attn_factor(freq_scale: float, log_mul: float, rope_attn_factor: float) -> float:
    """The attn_factor llama.cpp passes to every RoPE of a YaRN model (``yarn_attn_factor``):
    get_mscale(factor) (over get_mscale(factor, log_mul) where the family reads a log
    multiplier), times the reciprocal of the ``1 + 0.1 ln(factor)`` that ggml multiplies in
    again, times ``rope.scaling.attn_factor``."""
    factor = f32(1.0) / f32(freq_scale)
    attn = _mscale(factor, f32(1.0))
    if log_mul != 0.0:
        attn = attn / _mscale(factor, f32(log_mul))
    attn = attn * (f32(1.0) / (f32(1.0) + f32(0.1) * np.log(factor)))
    return float(attn * f32(rope_attn_factor))


def rope_mscale(attn_factor: float, freq_scale: float) -> float:
    """rope_yarn's magnitude, where ext_factor is not 0: attn_factor times
    ``1 + 0.1 ln(1 / freq_scale)``."""
    grow = f32(1.0) + f32(0.1) * np.log(f32(1.0) / f32(freq_scale))
    return float(f32(attn_factor) * grow)


def _corr_dim(n_dims: int, n_ctx_orig: int, n_rot: float, base: float) -> np.float32:
    # the dimension at which a pair turns n_rot times over n_ctx_orig positions
    turns = f32(f32(n_rot) * f32(2.0)) * f32(math.pi)
    return f32(n_dims) * np.log(f32(n_ctx_orig) / turns) / (f32(2.0) * np.log(f32(base)))


def corr_dims(
    n_dims: int, n_ctx_orig: int, base: float, beta_fast: float, beta_slow: float
) -> tuple[float, float]:
    """ggml_rope_yarn_corr_dims: the first and last pair of the ramp, floored and ceiled,
    within [0, n_dims - 1]."""
    start = math.floor(_corr_dim(n_dims, n_ctx_orig, beta_fast, base))
    end = math.ceil(_corr_dim(n_dims, n_ctx_orig, beta_slow, base))
    return float(max(0, start)), float(min(n_dims - 1, end))


def ramp(low: float, high: float, n_pairs: int, *, xp: Namespace) -> Array:
    """rope_yarn_ramp of each pair i (n_pairs,): 1 up to ``low``, 0 from ``high``, linear
    between (the share of the extrapolated angle, before ext_factor)."""
    i = xp.arange(n_pairs, dtype=xp.float32)
    y = (i - low) / max(0.001, high - low)
    return 1.0 - xp.clip(y, 0.0, 1.0)
