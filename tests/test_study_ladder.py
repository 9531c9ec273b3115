"""The quant ladder (qllama/study/ladder.py, ``qllama ladder``): which types a model takes,
the ladder as a study (and as TOML), its table with the Pareto front, its files."""

from __future__ import annotations

import dataclasses
import json

import pytest

from qllama.cli import main
from qllama.errors import QllamaError
from qllama.measure import corpus
from qllama.study import StudyError, load_study
from qllama.study.declaration import to_toml
from qllama.study.ladder import (
    Cell,
    Row,
    check_ladder,
    format_table,
    ladder_study,
    ladder_types,
    mark_front,
    rungs,
)
from qllama.synthetic import TinyConfig, write_tiny_llama

# for the tiny model's byte-level vocabulary: 4 windows of 64 tokens, and after them 2
# imatrix windows of 512
TEXT = " ".join(f"line {i}: the tide is {'low' if i % 4 else 'high'} at noon." for i in range(120))


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    path = tmp_path_factory.mktemp("ladder") / "tiny.gguf"
    write_tiny_llama(path, TinyConfig(n_embd=256, n_ff=512, n_head=8, n_head_kv=2, n_ctx=1024))
    return path


@pytest.fixture(scope="module")
def narrow(tmp_path_factory):
    """Rows of 64: no K-quant block fits; some types fall back, some cannot be made."""
    path = tmp_path_factory.mktemp("ladder") / "narrow.gguf"
    write_tiny_llama(path, TinyConfig())
    return path


def test_the_rungs_say_what_each_type_needs(tiny, narrow):
    by_type = {r.type: r for r in rungs(tiny, ["Q8_0", "IQ2_XXS", "TQ1_0"], imatrix=False)}
    assert by_type["Q8_0"].imatrix == (False,) and by_type["Q8_0"].settings == (
        "cpu",
        "dequantize-all",
    )
    assert by_type["IQ2_XXS"].reason == "needs an importance matrix (none asked for)"
    with_matrix = {r.type: r for r in rungs(tiny, ["Q8_0", "IQ2_XXS"], imatrix=True)}
    assert with_matrix["Q8_0"].imatrix == (False,)  # Q8_0 ignores a matrix: one file
    assert with_matrix["IQ2_XXS"].imatrix == (True,)  # only with one
    assert rungs(tiny, ["Q4_0"], imatrix=True)[0].imatrix == (False, True)
    # rows of 64: a type without a fallback is skipped with llama-quantize's reason
    skipped = [r for r in rungs(narrow, ladder_types(), imatrix=True) if r.reason]
    assert skipped and all(r.reason.startswith(("not made: ", "no setting")) for r in skipped)
    assert any("do not divide into" in r.reason for r in skipped)
    with pytest.raises(QllamaError, match="unknown file type 'Q4_KM'"):
        rungs(tiny, ["Q4_KM"], imatrix=False)


def test_the_ladder_is_a_study_and_its_toml(tiny, tmp_path):
    study, _ = ladder_study(
        str(tiny), types=["Q8_0", "IQ2_XXS"], chunks=4, n_ctx=64, draws=("avx2",)
    )
    names = [v.name for v in study.variants]
    assert names == ["F32", "Q8_0", "IQ2_XXS-imatrix"]
    imatrix = study.variant("IQ2_XXS-imatrix")
    assert imatrix.imatrix_corpus == "corpus:botchan" and imatrix.imatrix_skip_chunks == 4
    assert [d.name for d in study.draws] == ["avx2"]
    (path := tmp_path / "ladder.toml").write_text(to_toml(study))
    again = load_study(path)
    assert dataclasses.replace(study, folder=again.folder) == again
    # --study takes a ladder's declaration only: one without the table's measures is refused
    check_ladder(study)
    bare = dataclasses.replace(study, measures=study.measures[:1])
    with pytest.raises(StudyError, match="a ladder needs the measures corpus, free_generation"):
        check_ladder(bare)
    with pytest.raises(Exception, match="unknown draw"):
        ladder_study(str(tiny), types=["Q8_0"], draws=("avx9",))


def _cell(kld: float) -> Cell:
    return Cell(kld, kld / 10, 2 * kld, 3 * kld, 4 * kld, 0.9, 0.01, 1.01, 0.001, 2.0, None)


def test_the_front_is_the_files_no_smaller_one_beats():
    table = [
        Row("a", "a", False, 4.5, 1.0, {"cpu": _cell(1e-2)}),
        Row("b", "b", False, 5.0, 1.0, {"cpu": _cell(2e-2)}),  # larger and worse: off
        Row("c", "c", False, 6.5, 1.0, {"cpu": _cell(1e-3)}),
        Row("c2", "c", True, 6.5, 1.0, {"cpu": _cell(5e-4)}),  # as large and better: c is off
        Row("d", "d", False, reason="needs an importance matrix (none asked for)"),
        Row("e", "e", False, 7.0, 1.0, missing={"cpu": "no kernel here for its types"}),
    ]
    mark_front(table, ["cpu"])
    text = "\n".join(format_table(table, ["cpu"]))
    assert [r.front["cpu"] for r in table] == [True, False, False, True, False, False]
    assert "| e | 7.000 | 1.0 | not computed: no kernel here for its types |" in text
    assert "| d | skipped: needs an importance matrix" in text
    assert text.count("**\\***") == 2 and "never" in text


def test_a_small_ladder_end_to_end(tiny, tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("QLLAMA_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(corpus, "text", lambda name, **kw: TEXT)  # local executor: this process
    out = tmp_path / "out"
    argv = [
        "ladder",
        str(tiny),
        "--types",
        "Q8_0,Q4_0,IQ2_XXS",
        "--imatrix-chunks",
        "2",
        "--chunks",
        "4",
        "--ctx",
        "64",
        "--draw",
        "none",
        "--executor",
        "local",
        "--results",
        str(tmp_path / "results"),
        "--out",
        str(out),
    ]
    assert main(argv) == 0
    doc = json.loads((out / "ladder.json").read_text())
    rows = {r["name"]: r for r in doc["rows"]}
    assert set(rows) == {"Q8_0", "Q4_0", "Q4_0-imatrix", "IQ2_XXS-imatrix"}
    bpw = [r["bpw"] for r in doc["rows"]]
    assert bpw == sorted(bpw) and 8 < rows["Q8_0"]["bpw"] < 9
    for r in rows.values():
        for setting in ("cpu", "dequantize-all"):
            c = r["cells"][setting]
            assert c["mean_kld"] > 0 and 0 <= c["same_top"] <= 1 and c["flips_per_100"] >= 0
    # the smallest file is on the front; Q8_0 is the closest to the F32 file of all
    assert doc["rows"][0]["front"]["cpu"]
    assert min(rows.values(), key=lambda r: r["cells"]["cpu"]["mean_kld"])["type"] == "Q8_0"
    md = (out / "ladder.md").read_text()
    assert "IQ2_XXS-imatrix" in md and (out / "ladder.png").read_bytes()[:4] == b"\x89PNG"
    # a second run finds every cell in the cache
    capsys.readouterr()
    assert main(argv) == 0
    assert "cells: all" in capsys.readouterr().err


def test_kv_caches_cross_the_types(tiny, tmp_path, monkeypatch):
    """--kv adds the CPU arithmetic with a llama.cpp KV cache: a setting per cache, computing
    the files the CPU setting computes, named in the table's columns."""
    study, _ = ladder_study(
        str(tiny), types=["Q8_0"], imatrix_corpus=None, draws=(), kv=["q8_0/q4_0,fa", "bf16"]
    )
    by_name = {s.name: s for s in study.settings}
    assert list(by_name) == ["cpu", "dequantize-all", "cpu-kv-q8_0-q4_0-fa", "cpu-kv-bf16"]
    assert by_name["cpu-kv-q8_0-q4_0-fa"].options == {"kv_precision": "q8_0/q4_0,fa"}
    assert by_name["cpu-kv-bf16"].variants == by_name["cpu"].variants == ("F32", "Q8_0")
    (path := tmp_path / "ladder.toml").write_text(to_toml(study))
    assert load_study(path).settings == study.settings
    with pytest.raises(Exception, match="quantized V cache requires flash_attn"):
        ladder_study(str(tiny), types=["Q8_0"], imatrix_corpus=None, kv=["q4_0"])
    # end to end: the table has the cache's columns, with numbers
    monkeypatch.setenv("QLLAMA_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(corpus, "text", lambda name, **kw: TEXT)
    out = tmp_path / "out"
    argv = ["ladder", str(tiny), "--types", "Q8_0", "--imatrix-corpus", "none", "--chunks", "4",
            "--ctx", "64", "--draw", "none", "--executor", "local", "--kv", "q8_0/q4_0,fa",
            "--results", str(tmp_path / "results"), "--out", str(out), "--no-plot"]  # fmt: skip
    assert main(argv) == 0
    doc = json.loads((out / "ladder.json").read_text())
    cells = doc["rows"][0]["cells"]
    assert cells["cpu-kv-q8_0-q4_0-fa"]["mean_kld"] > 0
    assert cells["cpu-kv-q8_0-q4_0-fa"]["mean_kld"] != cells["cpu"]["mean_kld"]
    assert "cpu-kv-q8_0-q4_0-fa: mean KLD" in (out / "ladder.md").read_text()
