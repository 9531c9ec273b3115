"""Recipes at a budget (qllama/measure/sensitivity.py, qllama/recipe/, ``qllama recipe``): the
groups and their candidate types, anchored patterns, and the command end to end on a tiny
model: the budget kept, the file remade from its overrides, an unreachable budget refused."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from qllama.cli import main
from qllama.errors import QllamaError
from qllama.ggml_types import GGMLType
from qllama.gguf.quantizer import Overrides, quantize_file
from qllama.gguf.reader import read_gguf
from qllama.measure import corpus
from qllama.measure.sensitivity import Group, candidates, groups
from qllama.recipe.recipe import check_patterns, pattern
from qllama.synthetic import TinyConfig, write_tiny_llama

T = GGMLType
# byte-level tokens: 4 held-out windows of 64, then 2 calibration windows
TEXT = " ".join(f"line {i}: the tide is {'low' if i % 4 else 'high'} at noon." for i in range(120))


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    path = tmp_path_factory.mktemp("recipe") / "tiny.gguf"
    write_tiny_llama(path, TinyConfig(n_layer=4, n_embd=256, n_ff=512, n_head=8, n_head_kv=2))
    return path


def test_groups_are_kinds_in_bands_and_the_tensors_outside_blocks(tiny):
    with read_gguf(tiny) as f:
        gs = {g.name: g for g in groups(f, bands=2)}
        assert gs["ffn_down.weight@0-1"].tensors == (
            "blk.0.ffn_down.weight",
            "blk.1.ffn_down.weight",
        )
        assert gs["attn_q.weight@2-3"].layers == (2, 3)
        assert gs["token_embd.weight"].tensors == ("token_embd.weight",)  # tied: the output too
        every = [n for g in gs.values() for n in g.tensors]
        assert len(every) == len(set(every)) == 1 + 4 * 7  # norms are not quantized
        check_patterns(list(gs.values()), list(f.tensors))
        one = {g.name for g in groups(f, bands=1)}
        assert "attn_v.weight@0-3" in one and len(one) == 8


def test_candidates_divide_the_rows_and_need_no_matrix_unless_given(tiny, tmp_path):
    with read_gguf(tiny) as f:
        g = groups(f)[1]
    assert T.Q4_K in candidates(g) and T.IQ2_XS not in candidates(g)
    assert T.IQ2_XS in candidates(g, imatrix=True)
    narrow = tmp_path / "narrow.gguf"
    write_tiny_llama(narrow, TinyConfig())  # rows of 64: no 256-block type
    with read_gguf(narrow) as f:
        ts = candidates(groups(f)[1])
    assert ts and all(t.block.block_size == 32 for t in ts)
    # smallest first
    assert [g.nbytes(t) for t in candidates(g)] == sorted(g.nbytes(t) for t in candidates(g))


def test_patterns_are_anchored_against_substring_matches():
    g = Group(
        "attn_q.weight@1-2",
        "attn_q.weight",
        (1, 2),
        ("blk.1.attn_q.weight", "blk.2.attn_q.weight"),
        (256, 256),
        (1, 1),
    )
    names = [f"blk.{i}.attn_q.weight" for i in (1, 2, 11, 12, 21)] + ["blk.1.attn_q_a.weight"]
    p = re.compile(pattern(g))
    assert [n for n in names if p.search(n)] == ["blk.1.attn_q.weight", "blk.2.attn_q.weight"]
    check_patterns([g], names)
    # a group whose tensors the file does not have: refused, not silently empty
    absent = Group("attn_k.weight@3-3", "attn_k.weight", (3,), ("blk.3.attn_k.weight",), (1,), (1,))
    with pytest.raises(QllamaError, match="the pattern of attn_k.weight@3-3 matches"):
        check_patterns([absent], names)


def _argv(tiny, out, target, *extra):
    return [
        "recipe",
        str(tiny),
        "--target-bpw",
        str(target),
        "-o",
        str(out),
        "--types",
        "Q4_0,Q4_K,Q8_0",
        "--bands",
        "2",
        "--chunks",
        "4",
        "--calibration-chunks",
        "2",
        "--ctx",
        "64",
        *extra,
    ]


def test_the_command_end_to_end(tiny, tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("QLLAMA_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(corpus, "text", lambda name, **kw: TEXT)
    out = tmp_path / "recipe.gguf"
    # a budget no assignment reaches: the error names the reachable range, nothing is written
    assert main(_argv(tiny, out, 30)) == 1
    err = capsys.readouterr().err
    m = re.search(r"from ([\d.]+) \(the smallest\) to ([\d.]+) \(the largest\)", err)
    assert m, err
    low, high = float(m.group(1)), float(m.group(2))
    assert 4 < low < high < 9 and not out.exists()
    target = round((low + high) / 2, 3)
    assert (
        main(
            _argv(
                tiny,
                out,
                target,
                "--compare",
                "--stock",
                "Q4_0,Q8_0",
                "--executor",
                "local",
                "--no-plot",
                "--results",
                str(tmp_path / "results"),
                "--report",
                str(tmp_path / "report"),
            )
        )
        == 0
    )
    doc = json.loads((tmp_path / "recipe.gguf.recipe.json").read_text())
    assert low <= doc["bpw"] <= target and doc["bytes"] * 8 / doc["bpw"] > 0
    with read_gguf(out) as f:
        nbytes = sum(t.nbytes for t in f.tensors.values())
        elements = sum(t.n_elements for t in f.tensors.values())
        assert 8 * nbytes / elements == pytest.approx(doc["bpw"], rel=1e-12)
        written = {n: t.ggml_type.name for n, t in f.tensors.items()}
    for g in doc["groups"]:
        assert g["type"] in ("Q4_0", "Q4_K", "Q8_0")
    # the --tensor-type-file and the file type remake the same bytes (what llama-quantize is
    # given; tests/peers checks llama-quantize itself)
    lines = (tmp_path / "recipe.gguf.tensor-types.txt").read_text().split()
    again = tmp_path / "again.gguf"
    quantize_file(doc["file"], again, doc["file_type"], overrides=Overrides.parse(lines))
    assert again.read_bytes() == out.read_bytes()
    assert set(written.values()) <= {"Q4_0", "Q4_K", "Q8_0", "F32"}
    report = json.loads((tmp_path / "report" / "recipe.json").read_text())
    (v,) = report["versus"]
    assert v["recipe"] == f"recipe-{target:g}" and v["stock"] in ("Q4_0", "Q8_0")
    assert v["recipe_kld"] > 0 and v["noise"] > 0
    assert "recipe-" in (tmp_path / "report" / "recipe.md").read_text()
    # a second run measures nothing again: every cell is in the cache
    capsys.readouterr()
    assert main(_argv(tiny, tmp_path / "second.gguf", target)) == 0
    assert "sensitivity 0/" not in capsys.readouterr().err
    assert (tmp_path / "second.gguf").read_bytes() == out.read_bytes()


def test_the_comparison_measures_the_file_written_not_a_second_quantization(
    tiny, tmp_path, monkeypatch
):
    """``--compare`` measures the recipe's file where the recipe wrote it: the recipe's
    overrides are quantized once, and the report is the one of a comparison that has the
    study machinery build the recipe's variant again."""
    from qllama import model_files
    from qllama.gguf import quantizer
    from qllama.recipe import compare

    monkeypatch.setenv("QLLAMA_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(corpus, "text", lambda name, **kw: TEXT)
    made = []
    quantize = quantizer.quantize_file

    def counted(src, dst, ftype, **kw):
        if kw.get("overrides") is not None:  # not a stock mixture
            made.append(Path(dst))
        return quantize(src, dst, ftype, **kw)

    monkeypatch.setattr(quantizer, "quantize_file", counted)
    monkeypatch.setattr(model_files, "quantize_file", counted)  # the study's variants

    def run(name: str) -> int:
        report = ["--report", str(tmp_path / name), "--results", str(tmp_path / "results")]
        compared = ["--compare", "--stock", "Q4_0", "--executor", "local", "--no-plot"]
        return main(_argv(tiny, tmp_path / f"{name}.gguf", 6, *compared, *report))

    assert main(_argv(tiny, tmp_path / "first.gguf", 6)) == 0  # the sensitivities, cached
    made.clear()  # (their donor files have overrides too)
    assert run("once") == 0
    assert made == [tmp_path / "once.gguf"]
    made.clear()
    study = compare.study  # as before: the recipe's variant without its file
    monkeypatch.setattr(compare, "study", lambda *a, files=None, **kw: study(*a, **kw))
    assert run("twice") == 0
    assert made[0] == tmp_path / "twice.gguf" and len(made) == 2
    assert made[1].read_bytes() == made[0].read_bytes()  # the same file, so the same cells
    for name in ("recipe.json", "recipe.md"):
        assert (tmp_path / "once" / name).read_text() == (tmp_path / "twice" / name).read_text()


def test_the_comparison_builds_in_the_cache_given(tiny, tmp_path, monkeypatch):
    """``--cache`` holds every file a comparison builds, the stock mixtures' included, and
    the user cache none."""
    monkeypatch.setenv("QLLAMA_CACHE", str(tmp_path / "user"))
    monkeypatch.setattr(corpus, "text", lambda name, **kw: TEXT)
    given = tmp_path / "given"
    flags = ["--cache", str(given), "--compare", "--stock", "Q4_0", "--executor", "local"]
    flags += ["--no-plot", "--report", str(tmp_path / "report")]
    flags += ["--results", str(tmp_path / "results")]
    assert main(_argv(tiny, tmp_path / "r.gguf", 6, *flags)) == 0
    built = [p.name for p in (given / "study-variants").rglob("*.gguf")]
    assert any("Q4_0" in name for name in built), built
    assert not list((tmp_path / "user").rglob("*.gguf"))


def test_bad_arguments_are_refused_before_any_work(tiny, tmp_path, capsys):
    bad = [
        (["--target-bpw", "-1"], "--target-bpw must be a positive number"),
        (["--imatrix", str(tmp_path / "none")], "no importance matrix file"),
        (["--types", "Q4_0,Q9_9"], "'Q9_9' is not a GGML type"),
        (["--bands", "0"], "--bands must be at least 1"),
    ]
    for extra, message in bad:
        with pytest.raises(SystemExit) as e:
            main([*_argv(tiny, tmp_path / "x.gguf", 5), *extra])
        assert e.value.code == 2 and message in capsys.readouterr().err
    assert not (tmp_path / "x.gguf").exists()
