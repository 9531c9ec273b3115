"""The KV cache: rows written in place (numpy, torch) hold what take-and-where writes (jax,
array-api-strict), each layer its own, across growth of the capacity."""

from __future__ import annotations

import numpy as np
import pytest

from qllama.array_api import namespace, to_numpy
from qllama.kv_cache import CAPACITY_STEP, KVCache

NAMESPACES = ["numpy", "torch", "array_api_strict"]


def filled(xp_name: str, writes: list[tuple[int, int]]) -> KVCache:
    """A 2-layer cache after ``writes`` (pos, rows) of seeded random keys and values."""
    xp = namespace(xp_name)
    cache = KVCache(2, 2, 4, xp, head_dim_v=3)
    rng = np.random.default_rng(0)
    for pos, n in writes:
        cache.reserve(pos + n)
        k = rng.standard_normal((n, 2, 4)).astype(np.float32)
        v = rng.standard_normal((n, 2, 3)).astype(np.float32)
        cache.update(0, pos, xp.asarray(k), xp.asarray(v))
        cache.length = pos + n
    return cache


@pytest.mark.parametrize("xp_name", NAMESPACES)
def test_writes_agree_across_namespaces(xp_name):
    pytest.importorskip(xp_name)
    # a prefill, decode steps, a rewrite of earlier positions, then growth past the capacity
    writes = [(0, 37), (37, 1), (38, 1), (20, 5), (39, CAPACITY_STEP)]
    want, got = filled("numpy", writes), filled(xp_name, writes)
    assert got.capacity == want.capacity == 2 * CAPACITY_STEP
    for layer in range(2):
        np.testing.assert_array_equal(to_numpy(got.k[layer]), to_numpy(want.k[layer]))
        np.testing.assert_array_equal(to_numpy(got.v[layer]), to_numpy(want.v[layer]))
    # layer 1 was never written: its rows are its own, still zero
    assert not np.any(to_numpy(got.k[1])) and not np.any(to_numpy(got.v[1]))
    assert np.any(to_numpy(got.k[0]))
