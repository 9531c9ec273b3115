"""Rounding-error bounds: the tolerances of every test that compares floating-point results
computed in different orders (BLAS against a kernel, chunked against whole, numpy against torch
against jax, batched against stepwise).

Such results differ by rounding alone, and how much depends on the machine (which BLAS kernel,
how many threads, AVX2 or AVX-512), so a tolerance tuned on one machine until green fails on
another. Each tolerance here is a bound, named where it is defined:

* ``reorder_bound``: a float32 dot product of length n, in any order and with any blocking, is
  within gamma(n) * sum|a_i b_i| of the exact value, gamma(n) = n u / (1 - n u), u = 2^-24
  (Higham, *Accuracy and Stability of Numerical Algorithms*, 2nd ed., eq. 3.5 and Lemma 3.1).
  Two evaluations are within twice that of each other. This bound is rigorous.
* ``forward_bound``: a whole forward pass is a chain of such reductions. Its rounding errors
  are modelled as independent and mean-zero, as in Higham and Mary's probabilistic analysis
  ("A new approach to probabilistic rounding error analysis", SIAM J. Sci. Comput. 41(5), 2019,
  Thm. 3.1: a sum of n terms is within lambda sqrt(n) u sum|terms| of exact with probability at
  least 1 - 2 exp(-lambda^2 / 2) per term). Each stage is normalised (RMSNorm before every block
  and before the output), so relative errors pass on without growing, and independent stages add
  in quadrature: ``2 lambda sqrt(stages * n) u * scale``. lambda = 8 makes a false failure less
  likely than 1e-12 per reduction. This is a model, not a proof: it is the bound a port author
  would derive, and it leaves room for a real bug to show (a wrong rotation, a missing norm or a
  stale cache entry moves logits by O(1) of their scale, not by 1e-5).
* ``half_bound``: values stored in float16 (a half KV cache; Q and the softmax rounded for the
  attention products) are each within u16 = 2^-11 of their float32 value, so each such product
  is within u16 sum|terms| of the float32 one: four roundings per block, in quadrature.
* ``q8_flip_bound``: under the CPU arithmetic an activation is rounded to an integer of a Q8
  block. A rounding difference of a few ulps can move one such integer by one step d =
  amax / 127 of its block, so two orders may differ by up to one step per element; relative to
  the block's scale that is 1 / 127 per stage, in quadrature over stages. Loose, but a bound:
  tests that need more replay the same chunks and compare bit for bit.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

U32 = 2.0**-24  # unit roundoff of float32 (round to nearest)
U16 = 2.0**-11  # unit roundoff of float16
LAMBDA = 8.0  # Higham-Mary confidence: P(a reduction exceeds its bound) < 2 exp(-32)
Q8_STEP = 1.0 / 127.0  # one step of a Q8 activation, relative to its block's max |x|


def gamma(n: int, u: float = U32) -> float:
    """Higham's gamma_n: the relative bound of a sum of n terms, in any order."""
    if n * u >= 1:
        raise ValueError(f"gamma({n}) is unbounded in this precision")
    return n * u / (1 - n * u)


def reorder_bound(a: Any, b: Any) -> np.ndarray:
    """How far two float32 evaluations of ``a @ b.T`` may differ: 2 gamma(K) |a| @ |b|.T.

    ``a`` is (T, K), ``b`` (N, K); the result (T, N) is in float64.
    """
    a64, b64 = np.abs(np.asarray(a, np.float64)), np.abs(np.asarray(b, np.float64))
    return 2 * gamma(a64.shape[-1]) * (a64 @ b64.T)


def stages(n_layer: int) -> int:
    """Sequential reductions from the embedding to the logits: per block the attention norm,
    the Q/K/V products, the scores, the softmax sum, probabilities times V, the attention output,
    the MLP norm, gate/up and down (9); then the output norm and the output product."""
    return 9 * n_layer + 2


def forward_bound(n_layer: int, width: int, scale: float) -> float:
    """How far two float32 forward passes may differ (the probabilistic model above).

    ``width`` is the longest reduction (n_embd, n_ff, or the context attended over), ``scale``
    the size of the compared values (max |logit| of one of the runs).
    """
    return 2 * LAMBDA * math.sqrt(stages(n_layer) * width) * U32 * scale


def q8_flip_bound(n_layer: int, scale: float) -> float:
    """How far two CPU-arithmetic forward passes may differ when their float parts are summed
    in different orders: one Q8 step per stage, in quadrature, relative to ``scale``."""
    return 2 * Q8_STEP * math.sqrt(stages(n_layer)) * scale


def half_bound(n_layer: int, scale: float) -> float:
    """How far a forward pass with float16 K, V, Q and softmax may be from the float32 one."""
    return 2 * LAMBDA * math.sqrt(4 * n_layer) * U16 * scale


def agreeing_steps(margins: Any, bound: float) -> int:
    """How many leading greedy steps two runs must agree on: those before the first step whose
    top-1 minus top-2 margin is within ``bound`` (a near tie that rounding may break either
    way; after it, the two runs may follow different paths)."""
    close = np.flatnonzero(np.asarray(margins) <= bound)
    return int(close[0]) if close.size else len(margins)
