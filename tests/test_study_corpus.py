"""The ``corpus`` measure in a study: llama-perplexity's numbers for the cells that ask for
it, against a base made once and cached, and the report's corpus section
(qllama/study/corpus_report.py)."""

from __future__ import annotations

import json

import numpy as np
import pytest
from study_support import write_study

import qllama
from qllama.measure import corpus, perplexity
from qllama.study import Options, load_study, run

CORPUS = (
    '"teacher_forcing", {name = "corpus", options = {n_ctx = 32, chunks = 8, f32 = "F32", '
    'reference = "qllama"}, cells = ["raw/*"]}'
)
# a text for the tiny model's byte-level vocabulary: 8 windows of 32 tokens need 256
TEXT = " ".join(f"line {i}: the sea is {'calm' if i % 3 else 'rough'} today." for i in range(60))


@pytest.fixture(scope="module")
def corpus_run(tmp_path_factory):
    mp = pytest.MonkeyPatch()
    cache = tmp_path_factory.mktemp("qllama-cache")
    mp.setenv("QLLAMA_CACHE", str(cache))
    mp.setattr(corpus, "text", lambda name, **kw: TEXT)  # the local executor: this process
    folder = tmp_path_factory.mktemp("corpus")
    study = load_study(write_study(folder, measures=CORPUS))
    code = run(study, Options(results=folder / "results", docs=folder / "docs", executor="local"))
    yield folder, cache, code
    mp.undo()


def test_the_cells_get_llama_perplexity_numbers_against_one_cached_base(corpus_run):
    folder, cache, code = corpus_run
    assert code == 0
    docs = json.loads((folder / "docs" / "results.json").read_text())
    cells = docs["prompts"]["raw"]["cells"]
    assert all("corpus" not in c["measures"] for c in docs["prompts"]["chat"]["cells"].values())
    bases = list((cache / "corpus-bases").glob("*.base"))
    assert len(bases) == 1  # six cells, one base
    f32 = cells["F32-dequantize-all"]["measures"]["corpus"]
    q8 = cells["Q8_0-cpu"]["measures"]["corpus"]
    assert (f32["windows"], f32["n_ctx"], f32["tokens"]) == (8, 32, 8 * 15)
    # the base is the F32 file under dequantize-all: against itself, exactly nothing
    assert f32["mean_kld"] == 0.0 and f32["same_top"] == 1.0
    assert q8["mean_kld"] > 0 and q8["ppl_ref"] == f32["ppl_ref"]


def test_the_numbers_are_those_of_qllama_perplexity(corpus_run):
    """The measure is qllama.measure.perplexity.measure against that base: the same run by hand."""
    folder, cache, _ = corpus_run
    docs = json.loads((folder / "docs" / "results.json").read_text())
    got = docs["prompts"]["raw"]["cells"]["Q8_0-cpu"]["measures"]["corpus"]
    (base,) = (cache / "corpus-bases").glob("*.base")
    (q8,) = (cache / "study-variants").glob("*/*Q8_0*.gguf")
    want = perplexity.measure(qllama.load(q8, backend="numpy", threads=1), base)
    assert got["ppl"] == pytest.approx(want["ppl"], rel=1e-12)
    np.testing.assert_allclose(got["mean_kld"], want["mean_kld"], rtol=1e-12)


def test_the_report_has_a_corpus_section(corpus_run):
    folder, _, _ = corpus_run
    md = (folder / "docs" / "results.md").read_text()
    head = md.split("## Prompt")[0]
    assert "## Corpus: perplexity and KL divergence" in head
    assert "| Q8_0-cpu |" in head and "8 windows of 32 tokens" in head
