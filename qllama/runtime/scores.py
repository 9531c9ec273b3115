"""What attention does to its scores: the soft cap (gemma) and the softmax, array-API code
shared by the model's attention and the typed KV caches' (:mod:`qllama.runtime.kv_attention`).
"""

from __future__ import annotations

from qllama.array_api import Array, Namespace

# exp(x - max) below 2**-110 counts as 0: the row's largest term is 1, so such a term is under
# 2**-110 of the row's sum, 80 binary orders below float32's resolution of the weighted sum it
# enters. Kept, it or its quotient can be subnormal, and a subnormal operand costs a microcode
# assist in the attention products (P V 60x slower on x86 BLAS, measured). The quotients of
# the terms kept stay normal for rows of up to 2**16 positions.
NEGLIGIBLE = -76.24869  # ln(2**-110)


def softmax(x: Array, *, xp: Namespace) -> Array:
    """Softmax over the last axis, max-subtracted; the terms below :data:`NEGLIGIBLE` are 0."""
    d = x - xp.max(x, axis=-1, keepdims=True)
    e = xp.exp(xp.where(d < NEGLIGIBLE, -xp.inf, d))
    return e / xp.sum(e, axis=-1, keepdims=True)


def masked_softmax(scores: Array, scale: float, mask: Array, *, xp: Namespace) -> Array:
    """:func:`softmax` of ``scores * scale + mask``: attention's probabilities from its raw
    scores (..., t, S) and additive mask (t, S)."""
    return softmax(scores * scale + mask, xp=xp)


def softcap(x: Array, cap: float, *, xp: Namespace) -> Array:
    """cap * tanh(x / cap): gemma's soft limit on scores and logits."""
    return cap * xp.tanh(x / cap)
