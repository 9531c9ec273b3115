"""The command line: output, and one-line errors with a non-zero status."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from qllama.cli import main
from qllama.gguf.reader import read_gguf
from qllama.synthetic import TinyConfig, write_tiny_llama
from qllama.version import __version__


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    path = tmp_path_factory.mktemp("cli") / "tiny.gguf"
    write_tiny_llama(path, TinyConfig(n_embd=64, n_ff=256))
    return path


def test_inspect_text(tiny, capsys):
    assert main(["inspect", str(tiny)]) == 0
    out = capsys.readouterr().out
    assert "GGUF v3" in out and "llama.block_count" in out and "uint32" in out
    assert "blk.1.ffn_down.weight" in out and "64x256" in out
    assert "by type:" in out and "F32" in out


def test_inspect_json(tiny, capsys):
    assert main(["inspect", "--json", str(tiny)]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["metadata"]["llama.block_count"] == {"type": "UINT32", "elem_type": None, "value": 2}
    t = next(t for t in doc["tensors"] if t["name"] == "blk.0.ffn_down.weight")
    assert t["ne"] == [256, 64] and t["shape"] == [64, 256] and t["type"] == "F32"
    assert doc["summary"]["F32"]["tensors"] == len(doc["tensors"])


def test_quantize(tiny, tmp_path, capsys):
    out = tmp_path / "q.gguf"
    assert main(["quantize", "-q", str(tiny), str(out), "q4_k_m"]) == 0
    assert "wrote" in capsys.readouterr().out
    assert read_gguf(out).get("general.file_type") == 15


def test_imatrix_then_quantize_with_it(tiny, tmp_path, capsys):
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("the cat sat on the mat and then it ran away. " * 30)
    im = tmp_path / "im.gguf"
    assert (
        main(["imatrix", str(tiny), "--text", str(corpus), "-o", str(im), "--ctx", "32", "-q"]) == 0
    )
    assert "14 entries" in capsys.readouterr().out
    assert read_gguf(im).get("imatrix.datasets") == [str(corpus)]
    out = tmp_path / "q.gguf"
    assert main(["quantize", "-q", str(tiny), str(out), "IQ4_XS", "--imatrix", str(im)]) == 0
    f = read_gguf(out)
    assert (
        f.get("quantize.imatrix.file") == str(im) and f.get("quantize.imatrix.entries_count") == 14
    )
    dat = tmp_path / "im.dat"
    assert main(["imatrix", str(tiny), "-f", str(corpus), "-o", str(dat), "-c", "32", "-q"]) == 0
    # --chunk: the first chunks skipped, as llama-imatrix --chunk; fewer chunks are summed
    skipped = tmp_path / "skipped.gguf"
    args = ["imatrix", str(tiny), "-f", str(corpus), "-o", str(skipped), "-c", "32", "-q"]
    assert main([*args, "--chunk", "2"]) == 0
    assert (
        read_gguf(skipped).get("imatrix.chunk_count")
        == read_gguf(im).get("imatrix.chunk_count") - 2
    )
    assert main(["quantize", "-q", str(tiny), str(out), "Q4_K_M", "--imatrix", str(dat)]) == 0


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (
            ["quantize", "{tiny}", "{out}", "IQ2_XXS"],
            "qllama quantize: error: file type IQ2_XXS quantizes",
        ),
        (
            ["quantize", "{tiny}", "{out}", "Q4_0", "--imatrix", "{tiny}"],
            "qllama quantize: error: ",
        ),
        (
            ["imatrix", "{tiny}", "--text", "{short}", "-o", "{out}"],
            "qllama imatrix: error: the corpus has",
        ),
        (
            ["imatrix", "{tiny}", "--text", "{short}", "-o", "{out}", "--chunk", "3"],
            "qllama imatrix: error: the corpus has",
        ),
        (
            ["inspect", "/nonexistent/x.gguf"],
            "qllama inspect: error: cannot open /nonexistent/x.gguf: No such file or directory",
        ),
        (["quantize", "{tiny}", "{out}", "Q9"], "qllama quantize: error: unknown file type 'Q9'"),
        (["fetch", "nope"], "qllama fetch: error: unknown model 'nope'"),
        (
            ["generate", "{tiny}", "--prompt", "x", "--kv", "q8_0,fa"],
            "qllama generate: error: kv_precision 'q8_0,fa': the K cache's q8_0 blocks of 32 "
            "do not divide the head size 16",
        ),
    ],
)
def test_errors_are_one_line_without_traceback(tiny, tmp_path, argv, message):
    short = tmp_path / "short.txt"
    short.write_text("too short a corpus")
    argv = [a.format(tiny=tiny, out=tmp_path / "o.gguf", short=short) for a in argv]
    run = subprocess.run(
        [sys.executable, "-m", "qllama.cli", *argv], capture_output=True, text=True
    )
    assert run.returncode == 1
    # at most the run's first line (what computes it) before the one line of the error
    lines = run.stderr.strip().splitlines()
    assert lines[-1].startswith(message) and len(lines) <= 2
    assert all(line.startswith(f"qllama {__version__}") for line in lines[:-1])
    assert "Traceback" not in run.stderr


def test_malformed_file(tmp_path, capsys):
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"GGUF" + bytes(30))
    assert main(["inspect", str(bad)]) == 1
    assert "GGUF version 0 unsupported" in capsys.readouterr().err


def test_version_and_module_entry_point(capsys):
    with pytest.raises(SystemExit, match="0"):
        main(["--version"])
    assert capsys.readouterr().out.strip() == f"qllama {__version__}"
    run = subprocess.run(
        [sys.executable, "-m", "qllama", "--version"], capture_output=True, text=True
    )
    assert run.returncode == 0 and run.stdout.strip() == f"qllama {__version__}"


def test_help_shows_defaults(capsys):
    with pytest.raises(SystemExit, match="0"):
        main(["generate", "--help"])
    out = " ".join(capsys.readouterr().out.split())
    assert "--max-new-tokens MAX_NEW_TOKENS default: 256" in out
    assert "--top-k TOP_K default: 0" in out  # 0 is a default worth showing
    assert "--chat wrap the prompt in the chat template" in out  # a flag: no "default: False"


def test_an_unknown_option_is_the_subcommands_error(tiny, capsys):
    with pytest.raises(SystemExit, match="2"):
        main(["inspect", str(tiny), "--plot", "x.png"])
    err = capsys.readouterr().err
    assert err.startswith("usage: qllama inspect") and "unrecognized arguments: --plot x.png" in err


def test_inspect_names_the_file_type(tiny, tmp_path, capsys):
    out = tmp_path / "q.gguf"
    assert main(["quantize", "-q", str(tiny), str(out), "Q8_0"]) == 0
    capsys.readouterr()
    assert main(["inspect", str(out)]) == 0
    assert "general.file_type" in (
        line := next(x for x in capsys.readouterr().out.splitlines() if "general.file_type" in x)
    ) and line.rstrip().endswith("7 (Q8_0)")
    assert main(["inspect", "--json", str(out)]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["metadata"]["general.file_type"]["name"] == "Q8_0"


def test_quantize_says_each_fallback(tiny, tmp_path, capsys):
    # rows of 64 divide into no K-quant's 256: each such tensor falls back, and says so
    out = tmp_path / "q.gguf"
    assert main(["quantize", str(tiny), str(out), "Q5_K_M"]) == 0
    err = capsys.readouterr().err.splitlines()
    assert err[0].startswith(f"qllama {__version__}: ") and "to Q5_K_M" in err[0]
    noted = [line for line in err if "are not a multiple of" in line]
    fell = {name for name, (chosen, _) in _fallbacks(tiny, "Q5_K_M").items()}
    assert len(noted) == len(fell) > 0
    assert all("rows of 64 are not a multiple of Q" in line for line in noted)
    assert f"{len(fell)} of " in err[-1] and "fell back" in err[-1]
    # quiet: no progress, the fallbacks still, one line each
    assert main(["quantize", "-q", str(tiny), str(out), "Q5_K_M"]) == 0
    err = capsys.readouterr().err.splitlines()
    assert sum("fallback" in line for line in err) == len(fell)


def _fallbacks(path, ftype):
    from qllama.gguf.quantizer import plan_with_fallbacks

    with read_gguf(path) as f:
        return plan_with_fallbacks(f, ftype)[1]


def test_generate_says_what_computes_and_where_it_stopped(tiny, capsys):
    argv = ["generate", str(tiny), "--prompt", "the cat sat", "--max-new-tokens", "50"]
    assert main([*argv, "--ctx", "8"]) == 0
    err = capsys.readouterr().err.splitlines()
    assert err[0].startswith(f"qllama {__version__}, numpy, cpu arithmetic (activations")
    assert "threads" in err[0]
    assert "stopped at the end of the context (8 positions)" in err[-1]
    assert main([*argv, "--max-new-tokens", "2", "--dequantize-all"]) == 0
    err = capsys.readouterr().err.splitlines()
    assert "dequantize-all arithmetic" in err[0] and len(err) == 1  # no context note


def test_compare_explains_its_numbers(tiny, capsys):
    argv = ["compare", str(tiny), "--prompt", "the cat sat", "--max-new-tokens", "4"]
    assert main(argv) == 0
    out = capsys.readouterr().out
    # its own reference (the file dequantized), labelled for what it is
    assert "(dequantize-all on numpy): the prompt (" in out
    assert "and its greedy continuation (4 tokens" in out
    assert "(± not computed: 4 values)" in out and "± 0.0e+00" not in out
    assert "free generation: " in out and "new tokens, ended " in out


def test_every_loading_command_takes_llama_cpps_cache_types(tiny, capsys):
    """--kv: llama.cpp's -ctk/-ctv (and -fa) as one value, checked before any work."""
    argv = ["generate", str(tiny), "--prompt", "the cat sat", "--max-new-tokens", "3"]
    assert main([*argv, "--kv", "bf16/f16,fa"]) == 0
    capsys.readouterr()
    for command in (
        argv,
        ["compare", str(tiny), "--prompt", "x"],
        ["serve", "m=" + str(tiny)],
        ["perplexity", str(tiny)],
        ["imatrix", str(tiny), "-o", "x.dat"],
        ["trace", str(tiny), "--reference", str(tiny), "--prompt", "x"],
        ["ladder", str(tiny)],
    ):
        with pytest.raises(SystemExit):
            main([*command, "--kv", "q4_0"])
        assert "quantized V cache requires flash_attn" in capsys.readouterr().err
