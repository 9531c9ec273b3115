"""The command line: output, and one-line errors with a non-zero status."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from qllama.cli import main
from qllama.gguf.reader import read_gguf
from qllama.synthetic import TinyConfig, write_tiny_llama


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
    assert run.stderr.strip().startswith(message) and len(run.stderr.strip().splitlines()) == 1
    assert "Traceback" not in run.stderr


def test_malformed_file(tmp_path, capsys):
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"GGUF" + bytes(30))
    assert main(["inspect", str(bad)]) == 1
    assert "GGUF version 0 unsupported" in capsys.readouterr().err
