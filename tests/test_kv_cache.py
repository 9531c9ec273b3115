"""The KV cache: rows written in place (numpy, torch) hold what take-and-where writes (jax,
array-api-strict), each layer its own, across growth of the capacity."""

from __future__ import annotations

import numpy as np
import pytest

from qllama.array_api import namespace, to_numpy
from qllama.runtime.kv_cache import CAPACITY_STEP, KVCache

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


@pytest.mark.parametrize("xp_name", NAMESPACES)
def test_a_fork_shares_until_one_writes(xp_name):
    """Beam search forks caches: a write to either leaves the other as it was."""
    pytest.importorskip(xp_name)
    xp = namespace(xp_name)
    cache = filled(xp_name, [(0, 10)])
    before = to_numpy(cache.k[0]).copy()
    fork = cache.fork()
    new = xp.asarray(np.ones((1, 2, 4), np.float32))
    fork.update(0, 10, new, xp.asarray(np.ones((1, 2, 3), np.float32)))
    np.testing.assert_array_equal(to_numpy(cache.k[0]), before)  # the original is untouched
    cache.update(0, 10, 2 * new, xp.asarray(np.zeros((1, 2, 3), np.float32)))
    assert float(to_numpy(fork.k[0])[0, 10, 0]) == 1.0  # and the fork keeps its own write
    assert float(to_numpy(cache.k[0])[0, 10, 0]) == 2.0
