"""qllama perplexity: llama-perplexity's output, bases saved and compared, clean interrupts."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest
from test_architectures import FAMILIES

from qllama.cli import main
from qllama.measure import perplexity
from qllama.synthetic import TinyConfig, write_tiny, write_tiny_llama

TEXT = "Now is the winter of our discontent made glorious summer by this sun of York. " * 40


@pytest.fixture(scope="module")
def files(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    d = tmp_path_factory.mktemp("ppl_cli")
    write_tiny_llama(d / "f32.gguf", TinyConfig(n_ctx=128))
    write_tiny_llama(d / "q8.gguf", TinyConfig(n_ctx=128, weight_type="Q8_0"))
    (d / "text.txt").write_text(TEXT)
    return {"f32": d / "f32.gguf", "q8": d / "q8.gguf", "text": d / "text.txt"}


def run(*args: str | Path) -> int:
    return main(["perplexity", *map(str, args), "-q"])


def test_perplexity_prints_as_llama_perplexity(files, capsys, tmp_path: Path):
    out_json = tmp_path / "out.json"
    assert run(files["f32"], "--text", files["text"], "--ctx", 32, "--chunks", 4,
               "--json", out_json) == 0  # fmt: skip
    out = capsys.readouterr().out.splitlines()
    assert out[0].startswith("[1]") and out[0].endswith(",") and out[0].count("[") == 4
    assert out[1].startswith("Final estimate: PPL = ") and " +/- " in out[1]
    doc = json.loads(out_json.read_text())
    assert doc["windows"] == 4 and doc["scored"] == 4 * 15 and doc["n_ctx"] == 32
    assert f"{doc['ppl']:.4f}" in out[1] and doc["text"]["file"] == "text.txt"


@pytest.mark.parametrize("fmt", ["llama", "f32"])
def test_save_a_base_then_compare_with_it(files, capsys, tmp_path: Path, fmt: str):
    base = tmp_path / "base.bin"
    assert run(files["f32"], "--text", files["text"], "--ctx", 32, "--chunks", 8,
               "--save-base", base, "--base-format", fmt, "--dequantize-all") == 0  # fmt: skip
    capsys.readouterr()
    out_json = tmp_path / "kl.json"
    assert run(files["q8"], "--kl-divergence-base", base, "--as-llama-cpp",
               "--json", out_json) == 0  # fmt: skip
    out = capsys.readouterr().out
    assert out.startswith(perplexity.KL_TABLE_HEAD)
    sections = ("Perplexity", "KL divergence", "Token probability")
    for line in [f"====== {s} statistics ======" for s in sections] + ["Median  KLD:"]:
        assert line in out
    doc = json.loads(out_json.read_text())
    assert doc["kl"]["n"] == 8 * 15 and doc["base"]["format"] == fmt
    assert doc["setting"]["kv_precision"] == "f16-flash"
    if fmt == "f32":  # qllama's base records where it came from
        assert doc["base"]["model"] == "f32.gguf" and doc["base"]["setting"]["dequantize_all"]
    # the same windows through --text as well: checked against the base's tokens
    assert run(files["q8"], "--kl-divergence-base", base, "--text", files["text"]) == 0
    assert run(files["q8"], "--kl-divergence-base", base, "--chunks", 2) == 0
    assert "no statistics below 100" in capsys.readouterr().out


def test_refusals_are_one_line(files, capsys, tmp_path: Path):
    short = tmp_path / "short.txt"
    short.write_text("too short")
    assert run(files["f32"], "--text", short) == 1
    assert "you need at least 1024 tokens" in capsys.readouterr().err
    assert run(files["f32"]) == 1
    assert "give --text" in capsys.readouterr().err
    base = tmp_path / "b"
    assert run(files["f32"], "--text", files["text"], "--ctx", 32, "--save-base", base) == 0
    assert run(files["f32"], "--kl-divergence-base", base, "--ctx", 64) == 1
    assert "made with a context of 32" in capsys.readouterr().err
    other = tmp_path / "other.txt"
    other.write_text(TEXT.upper())
    assert run(files["f32"], "--kl-divergence-base", base, "--text", other) == 1
    assert "does not give the tokens" in capsys.readouterr().err
    assert run(files["f32"], "--kl-divergence-base", files["text"]) == 1
    assert "does not look like a base file" in capsys.readouterr().err


def test_an_interrupt_leaves_no_half_written_base(files, capsys, tmp_path: Path, monkeypatch):
    plain = perplexity.qllama_scorer

    def interrupted(model):
        score, calls = plain(model), []

        def once_then_interrupt(tokens, first):
            calls.append(1)
            if len(calls) > 1:
                raise KeyboardInterrupt
            return score(tokens, first)

        return once_then_interrupt

    monkeypatch.setattr(perplexity, "qllama_scorer", interrupted)
    out = tmp_path / "out"
    out.mkdir()
    args = ("--text", files["text"], "--ctx", 32, "--save-base", out / "b", "--json", out / "j")
    assert run(files["f32"], *args) == 130
    assert "interrupted" in capsys.readouterr().err
    assert list(out.iterdir()) == []


@pytest.mark.parametrize("name", ["qwen3moe", "gpt-oss"])
def test_a_mixture_of_experts_file(capsys, tmp_path: Path, name: str):
    """A MoE file runs unchanged: its perplexity, a base saved from its F32 file (qllama's
    f32 format), and its Q8_0 file (the CPU arithmetic) compared with that base; the F32 file
    against its own base differs by nothing."""
    cfg = replace(FAMILIES[name], n_ctx=128)
    f32, q8, text = tmp_path / "f32.gguf", tmp_path / "q8.gguf", tmp_path / "text.txt"
    write_tiny(f32, cfg)
    write_tiny(q8, replace(cfg, weight_type="Q8_0"))
    text.write_text(TEXT)
    base = tmp_path / "base.bin"
    assert run(f32, "--text", text, "--ctx", 32, "--chunks", 8, "--save-base", base,
               "--base-format", "f32", "--json", tmp_path / "f32.json") == 0  # fmt: skip
    ppl = json.loads((tmp_path / "f32.json").read_text())["ppl"]
    assert ppl > 1.0 and ppl == ppl and ppl != float("inf")
    for path, js in ((q8, "q8.json"), (f32, "same.json")):
        assert run(path, "--kl-divergence-base", base, "--json", tmp_path / js) == 0
    kl = {js: json.loads((tmp_path / js).read_text())["kl"] for js in ("q8.json", "same.json")}
    assert kl["q8.json"]["n"] == 8 * 15 and kl["q8.json"]["mean_kld"] > 0.0
    assert kl["same.json"]["mean_kld"] == 0.0 and kl["same.json"]["same_top"] == 1.0
    capsys.readouterr()
