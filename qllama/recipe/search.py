"""The smallest predicted KL divergence at a size budget: one type per group.

Each group has options (a type, its bytes, its cost: the KL divergence it adds alone); the
predicted KL of an assignment is the sum of its options' costs (a first-order, additive
model, checked by measuring the recipe's file whole). Choosing one option per group to
minimise the summed cost with the summed bytes at most a budget is a multiple-choice
knapsack; :func:`solve` solves it exactly by dynamic programming over the Pareto front of
(bytes, cost) of the groups so far: after each group only the partial assignments that no
other one beats in both bytes and cost are kept, so the front stays small (bounded by the
distinct byte sums) and the answer is the brute force's.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from qllama.errors import QllamaError


@dataclass(frozen=True)
class Option:
    """One choice for a group."""

    label: str  # the type's name
    nbytes: int
    cost: float


@dataclass(frozen=True)
class Solution:
    """The chosen option index per group, their bytes and their summed cost."""

    choice: tuple[int, ...]
    nbytes: int
    cost: float


class BudgetError(QllamaError):
    """No assignment fits the budget (or every one is far under it)."""


def reachable(options: Sequence[Sequence[Option]]) -> tuple[int, int]:
    """The smallest and the largest bytes an assignment can have."""
    return (
        sum(min(o.nbytes for o in opts) for opts in options),
        sum(max(o.nbytes for o in opts) for opts in options),
    )


def solve(options: Sequence[Sequence[Option]], budget: int) -> Solution:
    """The assignment of least summed cost whose bytes are at most ``budget`` (ties: the
    smaller file). Raises :class:`BudgetError` when even the smallest exceeds the budget."""
    if not options or any(not opts for opts in options):
        raise QllamaError("every group needs at least one option")
    low, _ = reachable(options)
    if low > budget:
        raise BudgetError(f"the smallest assignment is {low} bytes, over the budget of {budget}")
    # the groups after each one need at least their smallest options
    least = [min(o.nbytes for o in opts) for opts in options]
    after = np.cumsum([0, *least[::-1]])[::-1][1:]  # after[g]: sum of least[g + 1 :]
    # the front: bytes ascending, cost strictly descending; back[g][j] = (parent, option)
    nbytes = np.zeros(1, dtype=np.int64)
    cost = np.zeros(1, dtype=np.float64)
    back: list[tuple[np.ndarray, np.ndarray]] = []
    for g, opts in enumerate(options):
        ob = np.array([o.nbytes for o in opts], dtype=np.int64)
        oc = np.array([o.cost for o in opts], dtype=np.float64)
        b = (nbytes[:, None] + ob[None, :]).reshape(-1)  # (front * options,)
        c = (cost[:, None] + oc[None, :]).reshape(-1)
        parent = np.repeat(np.arange(nbytes.size), ob.size)
        which = np.tile(np.arange(ob.size), nbytes.size)
        keep = b <= budget - after[g]
        b, c, parent, which = b[keep], c[keep], parent[keep], which[keep]
        order = np.lexsort((c, b))  # bytes ascending, then cost ascending
        b, c, parent, which = b[order], c[order], parent[order], which[order]
        # the Pareto front: each kept entry's cost below every smaller entry's
        best_before = np.minimum.accumulate(np.concatenate(([np.inf], c[:-1])))
        front = c < best_before
        nbytes, cost = b[front], c[front]
        back.append((parent[front], which[front]))
    k = int(np.argmin(cost))  # the first minimum: the smallest file of least cost
    total_bytes, total_cost = int(nbytes[k]), float(cost[k])
    choice = []
    for parent, which in reversed(back):
        choice.append(int(which[k]))
        k = int(parent[k])
    return Solution(tuple(reversed(choice)), total_bytes, total_cost)


def brute_force(options: Sequence[Sequence[Option]], budget: int) -> Solution | None:
    """Every assignment tried (for small cases and tests): the least cost within the budget,
    ties to the smaller file; None if none fits."""
    import itertools

    best: Solution | None = None
    for choice in itertools.product(*(range(len(opts)) for opts in options)):
        b = sum(options[g][i].nbytes for g, i in enumerate(choice))
        c = sum(options[g][i].cost for g, i in enumerate(choice))
        if b <= budget and (best is None or (c, b) < (best.cost, best.nbytes)):
            best = Solution(tuple(choice), b, c)
    return best


__all__ = ["BudgetError", "Option", "Solution", "brute_force", "reachable", "solve"]
