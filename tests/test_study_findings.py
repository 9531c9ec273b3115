"""The seed study's findings (experiments/findings.py) on the committed run, and on runs where
a finding breaks: each broken finding must fail, naming its prompt, cell and draw."""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

import pytest

from qllama.study import load_study
from qllama.study.collect import from_json
from qllama.study.findings import Outcome
from qllama.study.findings import evaluate as evaluate_data

ROOT = Path(__file__).parent.parent
RESULTS = ROOT / "docs" / "results.json"


@pytest.fixture(scope="module")
def study() -> Any:
    return load_study(ROOT / "experiments" / "seed.toml")


@pytest.fixture
def run() -> dict[str, Any]:
    if not RESULTS.exists():
        pytest.skip("no docs/results.json (run nox -s experiments)")
    return json.loads(RESULTS.read_text())


def evaluate(study: Any, doc: dict[str, Any]) -> list[Outcome]:
    """The findings on a results.json document (mutated as JSON, then read back)."""
    return evaluate_data(study, from_json(doc))


def outcome(outcomes: list[Outcome], name: str) -> Outcome:
    (o,) = [o for o in outcomes if o.name == name]
    return o


def failing(outcomes: list[Outcome]) -> set[str]:
    return {o.name for o in outcomes if o.asserted and o.failed}


def test_the_committed_run_passes_on_every_prompt(study, run):
    outcomes = evaluate(study, run)
    assert len(outcomes) == len(study.findings) and not failing(outcomes)
    assert len(run["prompts"]) >= 7
    # the report says what is checked here
    assert [o.to_dict()["status"] for o in outcomes] == [f["status"] for f in run["findings"]]
    # and every asserted finding was tested somewhere, not only n/a
    assert all(o.prompts("holds") for o in outcomes if o.asserted)


def test_unquantized_activations_fail_the_cpu_finding_in_that_draw(study, run):
    data = copy.deepcopy(run)
    p = data["prompts"]["poem"]
    gpu = p["cells"]["Q8_0-gpu"]["measures"]["teacher_forcing"]["median_max_abs"]
    p["draws"]["avx2"]["Q8_0-cpu"]["measures"]["teacher_forcing"]["median_max_abs"] = gpu
    o = outcome(
        evaluate(study, data), "Q8_0: the CPU arithmetic adds error (activation quantization)"
    )
    assert o.prompts("fails") == ["poem"]
    (c,) = o.checks["poem"]
    assert c.ok is False and c.failing == ["avx2"] and c.bound == ">= 1.2"


def test_a_q4_no_worse_than_q8_fails(study, run):
    data = copy.deepcopy(run)
    cells = data["prompts"]["code"]["cells"]
    q8 = cells["Q8_0-gpu"]["measures"]["teacher_forcing"]["median_max_abs"]
    cells["Q4_K_M-gpu"]["measures"]["teacher_forcing"]["median_max_abs"] = q8
    assert "Q4_K_M error is several times Q8_0 error" in failing(evaluate(study, data))


def test_a_fork_away_from_the_first_flip_fails(study, run):
    data = copy.deepcopy(run)
    c = data["prompts"]["cpu-cache"]["cells"]["Q8_0-gpu"]["measures"]
    c["free_generation"]["fork"] = c["teacher_forcing"]["first_flip"] + 1
    o = outcome(
        evaluate(study, data), "free generation forks at the first teacher-forcing mismatch"
    )
    assert o.prompts("fails") == ["cpu-cache"]


@pytest.mark.parametrize(("of_median", "fails"), [(0.9, False), (1.1, True), (3.0, True)])
def test_q8_flip_margins_are_measured_against_its_own_error(study, run, of_median, fails):
    """A flip is nearly tied within the setting's typical logit error (its median per-step
    max|Δ|), not within an absolute margin that one more draw of the roundings can cross."""
    data = copy.deepcopy(run)
    tf = data["prompts"]["cpu-cache"]["cells"]["Q8_0-cpu"]["measures"]["teacher_forcing"]
    tf["flips"][0]["ref_margin"] = of_median * tf["median_max_abs"]
    o = outcome(evaluate(study, data), "Q8_0 flips only nearly tied steps")
    assert o.prompts("fails") == (["cpu-cache"] if fails else [])


def test_a_run_without_flips_is_a_result_not_a_crash_nor_a_pass(study, run):
    """A short answer may never flip or fork: every finding still evaluates, and the ones
    about flips have nothing to test (n/a), rather than passing."""
    data = copy.deepcopy(run)
    for p in data["prompts"].values():
        for cells in [p["cells"], *p["draws"].values()]:
            for c in cells.values():
                c["measures"]["teacher_forcing"]["flips"] = []
                c["measures"]["teacher_forcing"]["first_flip"] = None
                c["measures"]["free_generation"]["fork"] = None
    outcomes = evaluate(study, data)
    for name in (
        "Q8_0 flips only nearly tied steps",
        "Q4_K_M flips more steps than Q8_0, including larger margins",
        "free generation forks at the first teacher-forcing mismatch",
    ):
        o = outcome(outcomes, name)
        assert o.prompts("n/a") == list(data["prompts"]) and not o.failed


# --- where the drift enters, and the corpus ------------------------------------------------------


def _attribution(data: dict[str, Any], prompt: str, label: str) -> dict[str, Any]:
    return data["prompts"][prompt]["cells"][label]["measures"]["attribution"]


def test_one_class_carrying_most_of_the_error_fails(study, run):
    data = copy.deepcopy(run)
    a = _attribution(data, "list", "Q4_K_M-dequantize-all")
    a["parts"][0]["excess_mean_kld"] = 0.9 * a["whole_excess"]["mean_kld"]
    o = outcome(
        evaluate(study, data),
        "Q4_K_M: no tensor class carries half of the weight error",
    )
    assert o.prompts("fails") == ["list"]


def test_parts_that_do_not_add_up_fail(study, run):
    data = copy.deepcopy(run)
    a = _attribution(data, "poem", "Q4_K_M-dequantize-all")
    a["sum_of_parts"]["mean_kld"] = 2 * a["whole_excess"]["mean_kld"]
    o = outcome(
        evaluate(study, data), "Q4_K_M: the weight errors of the tensor classes add up to the whole"
    )
    assert o.prompts("fails") == ["poem"]


def test_an_error_at_the_embedding_fails_the_layer_finding(study, run):
    """A quantized embedding (another model's file) puts the error at the embedding: the
    finding that it enters in block 0 must fail, and name the cell."""
    data = copy.deepcopy(run)
    cell = data["prompts"]["cpu-cache"]["cells"]["Q8_0-cpu"]["measures"]["layer_trace"]
    cell["errors"]["embedding"]["rel_l2"] = 1e-3
    o = outcome(
        evaluate(study, data),
        "the error enters in block 0, not at the embedding, in every quantized setting",
    )
    assert o.prompts("fails") == ["cpu-cache"]
    assert [c.cell for c in o.checks["cpu-cache"] if c.ok is False] == ["Q8_0-cpu"]


def test_unrounded_activations_fail_the_corpus_finding(study, run):
    data = copy.deepcopy(run)
    cells = data["prompts"]["raw"]["cells"]
    gpu = cells["Q8_0-gpu"]["measures"]["corpus"]["mean_kld"]
    cells["Q8_0-cpu"]["measures"]["corpus"]["mean_kld"] = gpu
    o = outcome(
        evaluate(study, data),
        "corpus: the CPU arithmetic adds KL divergence on Q8_0, less on Q4_K_M",
    )
    assert o.prompts("fails") == ["raw"]
