"""numpy's pairwise float32 sum as a shape: where it splits a run, and so which leading part of
a run has the whole run's sum when the rest is zeros.

``add.reduce`` along a contiguous axis sums a run of at most :data:`PAIRWISE_BLOCK` numbers in
8 interleaved accumulators, and splits a longer run at ``n/2`` less its remainder mod 8, adding
its halves' sums (numpy's ``pairwise_sum``; restated for the compiled softmax in
:mod:`qllama.backends.numpy.kernels.glue`).
"""

from __future__ import annotations

PAIRWISE_BLOCK = 128  # numpy's PW_BLOCKSIZE


def split(n: int) -> int:
    """Where numpy's pairwise sum splits a run of ``n`` > :data:`PAIRWISE_BLOCK` numbers: the
    length of its first half."""
    half = n // 2
    return half - half % 8


def zero_tail_span(used: int, n: int, unit: int = 32) -> int:
    """The shortest leading part of a run of ``n`` numbers (a multiple of 8) whose pairwise
    sum is the whole run's, bit for bit, when the numbers from ``used`` on are zeros; whole
    ``unit``s (a multiple of 8) where it ends inside a block.

    Each split whose second half holds only zeros adds ``+0`` to its first half's sum: the
    first half alone has the same bits, but where that sum is -0 (never for non-negative
    numbers, as a softmax's exponentials). Inside a block, zeros past the last accumulator
    step leave all 8 accumulators as they were."""
    while n > PAIRWISE_BLOCK:
        half = split(n)
        if used > half:
            return n
        n = half
    return min(n, max(unit, -(-used // unit) * unit))
