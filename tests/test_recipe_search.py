"""The recipe's search (qllama/recipe/search.py): the least summed cost within a byte budget,
exactly the brute force's, never over the budget."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from qllama.recipe.search import BudgetError, Option, brute_force, reachable, solve

option = st.builds(
    Option,
    label=st.sampled_from(["Q4_0", "Q5_0", "Q8_0"]),
    nbytes=st.integers(1, 60),
    cost=st.floats(0, 10, allow_nan=False),
)
groups = st.lists(st.lists(option, min_size=1, max_size=4), min_size=1, max_size=5)


@given(groups, st.integers(-5, 320))
@settings(max_examples=300, deadline=None)
def test_the_search_is_the_brute_force(options, budget):
    best = brute_force(options, budget)
    if best is None:
        with pytest.raises(BudgetError, match="over the budget"):
            solve(options, budget)
        return
    found = solve(options, budget)
    assert found.nbytes <= budget
    assert found.nbytes == sum(options[g][i].nbytes for g, i in enumerate(found.choice))
    assert found.cost == pytest.approx(sum(options[g][i].cost for g, i in enumerate(found.choice)))
    # the same least cost (sums in another order: a few ulps apart)
    assert found.cost == pytest.approx(best.cost, rel=1e-12, abs=1e-12)


@given(groups)
@settings(max_examples=100, deadline=None)
def test_the_budget_bounds(options):
    low, high = reachable(options)
    assert solve(options, low).nbytes == low  # only the smallest assignment fits
    assert solve(options, high).cost == pytest.approx(
        sum(min(o.cost for o in opts) for opts in options)
    )


def test_a_cheaper_larger_option_is_taken_when_it_fits():
    options = [
        [Option("Q4_0", 10, 1.0), Option("Q8_0", 20, 0.1)],
        [Option("Q4_0", 10, 2.0), Option("Q8_0", 20, 0.2)],
    ]
    # 30 bytes: one group can be Q8_0; the one whose upgrade saves more
    assert solve(options, 30).choice == (0, 1)
    assert solve(options, 40).choice == (1, 1)
    assert solve(options, 29).choice == (0, 0)
