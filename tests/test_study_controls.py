"""The ladder's control models (qllama/study/controls.py): a grid's step found per block,
weights dithered off it, Gaussian weights of a file's shape, written as a file."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from qllama import quants
from qllama.errors import QllamaError
from qllama.gguf.reader import read_gguf
from qllama.study.controls import control_file, dither, gaussian, grid_step, write_control
from qllama.synthetic import TinyConfig, write_tiny_llama


def on_q4_1_grid(rows: int, n: int, seed: int) -> np.ndarray:
    """Weights as SmolLM2's F32 file has them: a Q4_1 file's values, dequantized."""
    x = np.random.default_rng(seed).standard_normal((rows, n)).astype(np.float32)
    return quants.dequantize(quants.quantize(x, "Q4_1"), "Q4_1", (rows, n))


@settings(max_examples=20, deadline=None)
@given(st.integers(0, 2**31))
def test_the_step_of_a_q4_1_grid_is_its_scale(seed):
    """A Q4_1 block is min + k*d, k = 0..15, with both ends used: the smallest gap is d."""
    x = on_q4_1_grid(4, 128, seed)
    blocks = x.reshape(4, -1, 32)  # (rows, n/32, 32)
    d = (blocks.max(-1) - blocks.min(-1)) / 15
    np.testing.assert_allclose(grid_step(x), d, rtol=1e-5)


def test_equal_values_have_no_step():
    assert grid_step(np.ones((2, 64), np.float32)).tolist() == [[0, 0], [0, 0]]


def test_dither_moves_each_value_within_half_a_step_and_off_the_grid():
    x = on_q4_1_grid(8, 256, 1)
    y = dither(x, np.random.default_rng(0))
    step = np.repeat(grid_step(x), 32, axis=1)  # (rows, n)
    assert np.all(np.abs(y - x) <= step / 2 * (1 + 1e-6))
    # Q4_1 gave these values back exactly before; after the dither it no longer can
    again = quants.dequantize(quants.quantize(x, "Q4_1"), "Q4_1", x.shape)
    np.testing.assert_array_equal(again, x)
    redone = quants.dequantize(quants.quantize(y, "Q4_1"), "Q4_1", y.shape)
    assert np.mean(redone != y) > 0.9


def test_dither_leaves_off_grid_weights_almost_where_they_were():
    """A true F32 matrix: the step is the smallest gap between 32 floats, tiny."""
    x = np.random.default_rng(2).standard_normal((16, 256)).astype(np.float32)
    y = dither(x, np.random.default_rng(0))
    assert np.max(np.abs(y - x)) < 0.05 * np.std(x)


def test_gaussian_keeps_each_rows_scale():
    rng = np.random.default_rng(3)
    x = (
        rng.standard_normal((6, 4096)).astype(np.float32)
        * np.arange(1, 7, dtype=np.float32)[:, None]
    )
    y = gaussian(x, np.random.default_rng(0))
    # the standard deviation of 4096 normal draws is within 5% of sigma with near certainty
    # (its relative standard error is 1/sqrt(2*4096) = 1.1%)
    np.testing.assert_allclose(y.std(axis=1), x.std(axis=1), rtol=0.05)
    assert abs(np.corrcoef(x.ravel(), y.ravel())[0, 1]) < 0.02


@pytest.mark.parametrize("kind", ["dither", "gaussian"])
def test_a_control_file_keeps_the_metadata_and_vectors(tmp_path, kind):
    src = tmp_path / "tiny.gguf"
    write_tiny_llama(src, TinyConfig(n_embd=128, n_ff=256))
    path = control_file(src, kind, tmp_path / "controls")
    assert path == control_file(src, kind, tmp_path / "controls")  # written once
    with read_gguf(src) as a, read_gguf(path) as b:
        assert a.kv == b.kv
        assert list(a.tensors) == list(b.tensors)
        for t in a:
            same = np.array_equal(a.tensor_data(t.name), b.tensor_data(t.name))
            assert same == (len(t.shape) == 1), t.name


def test_a_control_is_made_from_an_f32_file_of_a_known_kind(tmp_path):
    q8 = tmp_path / "q8.gguf"
    write_tiny_llama(q8, TinyConfig(weight_type="Q8_0"))
    with pytest.raises(QllamaError, match="a control is made from an F32 file"):
        write_control(q8, tmp_path / "out.gguf", "dither")
    with pytest.raises(QllamaError, match="no control 'noise'"):
        write_control(q8, tmp_path / "out.gguf", "noise")
    assert not (tmp_path / "out.gguf").exists()


def test_a_ladder_of_a_control(tmp_path, monkeypatch, capsys):
    """``qllama ladder --control``: the control is written under the results and measured."""
    from qllama.cli import main
    from qllama.measure import corpus

    src = tmp_path / "tiny.gguf"
    write_tiny_llama(src, TinyConfig(n_embd=128, n_ff=256, n_ctx=512))
    monkeypatch.setenv("QLLAMA_CACHE", str(tmp_path / "cache"))
    text = " ".join(f"line {i}: the tide is {'low' if i % 4 else 'high'}." for i in range(160))
    monkeypatch.setattr(corpus, "text", lambda name, **kw: text)
    results, out = tmp_path / "results", tmp_path / "out"
    argv = ["ladder", str(src), "--control", "dither", "--types", "Q8_0", "--imatrix-corpus"]
    argv += ["none", "--chunks", "4", "--ctx", "64", "--draw", "none", "--executor", "local"]
    assert main([*argv, "--results", str(results), "--out", str(out), "--no-plot"]) == 0
    made = results / "controls" / "tiny.dither-0.gguf"
    assert made.exists() and "tiny.dither-0" in (out / "ladder.md").read_text()
    capsys.readouterr()
    with pytest.raises(SystemExit, match="2"):
        main(["ladder", "--study", "x.toml", "--control", "dither"])
    assert "--control makes a ladder of its own" in capsys.readouterr().err
