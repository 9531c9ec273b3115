"""The measures' typed results (qllama/study/results.py): stored as before, read back into their
dataclasses and stored again bit for bit, a schema that no longer matches refused, and a
measure of a study's own returning a dataclass or a dict."""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from qllama.study import StudyError, register
from qllama.study import measures as registry
from qllama.study.collect import from_json, to_json
from qllama.study.declaration import MeasureSpec
from qllama.study.results import (
    Corpus,
    Flip,
    LastPosition,
    Measures,
    TeacherForcing,
    decode,
    encode,
)

RESULTS = Path(__file__).parent.parent / "docs" / "results.json"


def test_the_committed_results_read_back_and_store_again_byte_for_byte():
    """Every measure of every cell of the seed run reads into its dataclass, and writes the
    same JSON, key for key and digit for digit: the stored format is unchanged."""
    if not RESULTS.exists():
        pytest.skip("no docs/results.json (run nox -s experiments)")
    doc = json.loads(RESULTS.read_text())
    data = from_json(doc)
    del doc["findings"]
    assert json.dumps(to_json(data)) == json.dumps(doc)
    cell = data.prompts["raw"].cells["Q8_0-cpu"].measures
    assert isinstance(cell.teacher_forcing, TeacherForcing)
    assert all(isinstance(f, Flip) for f in cell.teacher_forcing.flips)
    assert isinstance(cell.corpus, Corpus) and cell.corpus.kl.mean_kld > 0
    assert cell.teacher_forcing.max_abs is None  # results.json holds no arrays


def test_arrays_go_apart_and_come_back():
    tf = TeacherForcing(
        mode="steps",
        steps=2,
        step0_max_abs=0.5,
        median_max_abs=0.25,
        max_max_abs=0.5,
        argmax_agree=1,
        first_flip=1,
        flips=(Flip(1, 0.125, 3, 4),),
        kl=decode(Corpus, _corpus_numbers()).kl,
        max_abs=np.array([0.5, 0.25], np.float32),
    )
    numbers, arrays = encode(tf)
    assert set(arrays) == {"max_abs"} and "max_abs" not in numbers
    assert numbers["flips"] == [{"step": 1, "ref_margin": 0.125, "ref_token": 3, "token": 4}]
    back = decode(TeacherForcing, json.loads(json.dumps(numbers)), arrays)
    assert back == tf and back.max_abs is arrays["max_abs"] and back.logits is None
    assert encode(back) == (numbers, arrays)


def _corpus_numbers() -> dict[str, Any]:
    kl = {
        "n": 4,
        "mean_kld": 0.1,
        "mean_kld_unc": 0.01,
        "kld": {"max": 0.3, "median": 0.1, "min": 0.0},
        "mean_dp": 0.0,
        "mean_dp_unc": 0.0,
        "dp": {"max": 0.1, "min": -0.1},
        "rms_dp": 0.05,
        "rms_dp_unc": 0.0,
        "same_top": 1.0,
        "same_top_unc": 0.0,
        "ppl_test": 2.0,
        "ppl_ref": 2.0,
        "ln_ppl_ratio": 0.0,
        "ln_ppl_ratio_unc": 0.0,
    }
    return {
        **kl,
        "ppl": 2.0,
        "ppl_unc": 0.1,
        "tokens": 4,
        "windows": 1,
        "n_ctx": 8,
        "base_format": "f32",
    }


def test_the_corpus_statistics_sit_beside_its_perplexity():
    """The KL statistics are stored inline, as llama-perplexity prints them; the fields the
    stored dict lacks (an older cell) take their defaults."""
    stored = _corpus_numbers()
    c = decode(Corpus, stored)
    assert c.kl.mean_kld == 0.1 and c.ppl == 2.0 and c.kl.ppl_ratio == 1.0
    numbers, _ = encode(c)
    assert "kl" not in numbers and numbers["mean_kld"] == 0.1 and numbers["ppl"] == 2.0


@pytest.mark.parametrize(
    ("numbers", "message"),
    [
        ({"max_abs": 1.0, "new": 2}, r"LastPosition has no fields \['new'\]"),
        ({}, "no 'max_abs' stored for LastPosition"),
    ],
)
def test_a_stored_result_that_does_not_match_its_dataclass_is_refused(numbers, message):
    with pytest.raises(StudyError, match=message):
        decode(LastPosition, numbers)


# --- a measure of one's own ---------------------------------------------------------------------


@dataclass(frozen=True)
class Mine:
    """The test's result: a number and an array."""

    mean: float
    steps: tuple[int, ...]
    per_step: np.ndarray | None = field(default=None, compare=False, repr=False)


@register("test_results_mine", about="tests: a dataclass result")
def mine(model: Any, ref: Any, options: Mapping[str, Any]) -> Mine:
    return Mine(0.5, (1, 2), np.arange(3.0))


@register("test_results_plain", about="tests: a dict result")
def plain(model: Any, ref: Any, options: Mapping[str, Any]) -> dict[str, Any]:
    return {"mean": 0.5, "per_step": np.arange(3.0)}


@register("test_results_wrong", about="tests: says Mine, returns a dict")
def wrong(model: Any, ref: Any, options: Mapping[str, Any]) -> Mine:
    return {"mean": 0.5}  # type: ignore[return-value]


def test_a_measure_of_ones_own_is_read_back_by_its_return_annotation():
    assert registry.get("test_results_mine").result is Mine
    assert registry.get("test_results_plain").result is None
    result = registry.run(MeasureSpec("test_results_mine"), None, None)
    numbers, arrays = encode(result)
    assert numbers == {"mean": 0.5, "steps": [1, 2]} and set(arrays) == {"per_step"}
    back = registry.read("test_results_mine", numbers, arrays)
    assert back == result and back.steps == (1, 2)

    numbers, arrays = encode(registry.run(MeasureSpec("test_results_plain"), None, None))
    assert numbers == {"mean": 0.5} and set(arrays) == {"per_step"}
    assert set(registry.read("test_results_plain", numbers, arrays)) == {"mean", "per_step"}


def test_a_measure_must_return_what_it_says():
    with pytest.raises(StudyError, match="returned a dict, not a Mine"):
        registry.run(MeasureSpec("test_results_wrong"), None, None)


def test_a_cell_without_a_measure_says_which():
    cell = Measures({"last_position": LastPosition(0.25)})
    assert cell.last_position.max_abs == 0.25 and "corpus" not in cell
    with pytest.raises(AttributeError, match="the cell has no 'corpus' measure"):
        _ = cell.corpus
