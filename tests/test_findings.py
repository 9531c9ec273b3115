"""The study's assertions (experiments/findings.py) on the committed run, and on runs where a
finding breaks: each broken finding must fail, naming its cell and bound."""

from __future__ import annotations

import copy
import importlib.util
import json
import sys
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).parent.parent
RESULTS = ROOT / "docs" / "results.json"


def _experiments() -> Any:
    """The experiments package from the checkout, without putting the checkout on sys.path
    (the tests run against the installed qllama, which a path entry would shadow)."""
    if "experiments" not in sys.modules:
        spec = importlib.util.spec_from_file_location(
            "experiments",
            ROOT / "experiments" / "__init__.py",
            submodule_search_locations=[str(ROOT / "experiments")],
        )
        assert spec and spec.loader
        module = importlib.util.module_from_spec(spec)
        sys.modules["experiments"] = module
        spec.loader.exec_module(module)
    from experiments import findings

    return findings


@pytest.fixture
def findings() -> Any:
    return _experiments()


@pytest.fixture
def run() -> dict[str, Any]:
    if not RESULTS.exists():
        pytest.skip("no docs/results.json (run nox -s experiments)")
    return json.loads(RESULTS.read_text())


def failed(findings: Any, data: dict[str, Any]) -> list[Any]:
    return [c for c in findings.check(data) if not c.ok]


def test_the_committed_run_passes(findings, run):
    checks = findings.check(run)
    assert len(checks) > 40 and not [c.line() for c in checks if not c.ok]
    # and the report says so: results.md's findings are the ones checked here
    assert [c["ok"] for c in run["findings"]] == [True] * len(run["findings"])


def test_unquantized_activations_fail_the_cpu_finding(findings, run):
    data = copy.deepcopy(run)
    gpu = data["cells"]["Q8_0-gpu"]["teacher_forcing"]["median_max_abs"]
    data["cells"]["Q8_0-cpu"]["teacher_forcing"]["median_max_abs"] = gpu
    (bad,) = failed(findings, data)
    assert bad.cell == "Q8_0-cpu / Q8_0-gpu" and bad.value == "1.000"
    assert bad.bound == f">= {findings.CPU_EXTRA}"
    assert "median per-step max|Δ| ratio = 1.000" in bad.line()


def test_a_q4_no_worse_than_q8_fails(findings, run):
    data = copy.deepcopy(run)
    q8 = data["cells"]["Q8_0-jax"]["last_position_max_abs"]
    data["cells"]["Q4_K_M-jax"]["last_position_max_abs"] = q8
    cells = {c.cell for c in failed(findings, data)}
    assert "Q4_K_M-jax / Q8_0-jax" in cells


def test_a_fork_away_from_the_first_flip_fails(findings, run):
    data = copy.deepcopy(run)
    data["cells"]["Q8_0-gpu"]["free_generation"]["fork"] = 31
    (bad,) = failed(findings, data)
    assert (bad.cell, bad.value) == ("Q8_0-gpu", "31 / 30")


def test_a_wide_margin_flip_of_q8_fails(findings, run):
    data = copy.deepcopy(run)
    flips = data["cells"]["Q8_0-cpu"]["teacher_forcing"]["flips"]
    flips[0]["ref_margin"] = 2.0
    assert any(
        c.cell == "Q8_0-cpu" and c.finding == "Q8_0 flips only nearly tied steps"
        for c in failed(findings, data)
    )


def test_a_run_without_flips_is_a_result_not_a_crash(findings, run):
    """A short answer may never flip or fork: every finding still evaluates."""
    data = copy.deepcopy(run)
    for c in data["cells"].values():
        c["teacher_forcing"]["flips"] = []
        c["teacher_forcing"]["first_flip"] = None
        c["free_generation"]["fork"] = None
    checks = findings.check(data)
    assert {c.finding for c in checks} >= {"Q4_K_M flips include larger margins"}
    forks = [c for c in checks if c.finding.startswith("free generation forks")]
    assert forks and all(c.ok and c.value == "never / never" for c in forks)
