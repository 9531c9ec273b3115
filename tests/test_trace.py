"""The layer trace: errors per point against a reference, the F32 control's band, the report,
and ``qllama trace``."""

from __future__ import annotations

import importlib.util
import json

import numpy as np
import pytest
from bounds import forward_bound

import qllama
from qllama.cli import main
from qllama.errors import BackendError, QllamaError
from qllama.measure.trace import (
    BAND_FLOOR,
    PointErrors,
    SettingTrace,
    TraceReport,
    layer_trace,
    positions_from_text,
)
from qllama.runtime.observe import record, residual_names

IDS = [1, 40, 77, 200, 5, 260, 99, 3]


@pytest.fixture(scope="module")
def reference(tiny_variants):
    """The F32 file's values in qllama's dequantize-all (a stand-in for transformers: the
    control under dequantize-all is then exact)."""
    return record(qllama.load(tiny_variants["F32"], dequantize_all=True), IDS, qkv=True)


def test_point_errors():
    r = np.array([[3.0, 4.0]])
    e = PointErrors.of(np.array([[3.0, 4.5]]), r)
    assert e.rel_l2 == pytest.approx(0.1) and e.max_abs == pytest.approx(0.5)
    assert e.cos == pytest.approx((9 + 18) / (5 * np.hypot(3, 4.5)))
    assert e.median_rel_l2 == pytest.approx(0.1)
    assert PointErrors.of(r, r) == PointErrors(0.0, 1.0, 0.0, 0.0)
    # one position with a huge norm dominates the whole, not the median over positions
    big = np.array([[300.0, 400.0], [1.0, 0.0], [0.0, 1.0]])
    e = PointErrors.of(big + np.array([[0.5, 0], [0.1, 0], [0, 0.1]]), big)
    assert e.rel_l2 < 0.01 and e.median_rel_l2 == pytest.approx(0.1)


def test_band_logic():
    names = residual_names(2)  # embedding, blk.0.out, blk.1.out, logits

    def errors(*rel_l2: float) -> dict[str, PointErrors]:
        return {n: PointErrors(e, 1, 0, e) for n, e in zip(names, rel_l2, strict=True)}

    control = errors(0, 1e-6, 2e-6, 2e-6)
    within = errors(5e-7, 9e-6, 1.9e-5, 1e-5)
    st = SettingTrace("cpu", within, control, names, band_factor=10)
    assert st.band_edge("embedding") == 10 * BAND_FLOOR  # the control is exact there
    assert st.leaves_band is None
    later = {**within, "blk.1.out": PointErrors(2.1e-5, 1, 0, 2.1e-5)}
    assert SettingTrace("cpu", later, control, names, band_factor=10).leaves_band == "blk.1.out"


def test_the_f32_file_never_leaves_its_own_band(tiny_variants, reference):
    path = tiny_variants["F32"]
    report = layer_trace(path, path, IDS, settings=["dequantize-all", "cpu"], reference=reference)
    for st in report.settings.values():
        assert st.leaves_band is None
    exact = report.settings["dequantize-all"]
    assert all(e.rel_l2 == 0 and e.max_abs == 0 for e in exact.errors.values())


def test_a_quantized_embedding_leaves_the_band_at_once(tiny_variants, reference):
    report = layer_trace(
        tiny_variants["Q8_0"], tiny_variants["F32"], IDS, settings=["cpu"], reference=reference
    )
    st = report.settings["cpu"]
    assert st.leaves_band == "embedding"
    assert st.errors["embedding"].rel_l2 > 0 and st.control["embedding"].rel_l2 == 0
    assert st.errors["logits"].rel_l2 > st.errors["embedding"].rel_l2  # it grows


def test_the_error_enters_where_the_quantized_tensors_start(tiny_variants, reference):
    """With the embedding taken from the F32 file, nothing differs before block 0's products."""
    report = layer_trace(
        tiny_variants["Q8_0"],
        tiny_variants["F32"],
        IDS,
        settings=["dequantize-all"],
        reference=reference,
        weights_from={"token_embd.weight": tiny_variants["F32"]},
    )
    st = report.settings["dequantize-all"]
    assert st.errors["embedding"].rel_l2 == 0
    assert st.leaves_band == "blk.0.out"


def test_report_outputs(tiny_variants, reference, tmp_path):
    report = layer_trace(
        tiny_variants["Q8_0"],
        tiny_variants["F32"],
        IDS,
        settings=["cpu", "f32"],
        reference=reference,
        qkv=True,
    )
    doc = json.loads(json.dumps(report.to_dict()))  # plain numbers only
    cpu = doc["settings"]["cpu"]
    assert cpu["leaves_band"] == "embedding" and cpu["arithmetic"] == "q8"
    assert set(cpu["errors"]["blk.1.q"]) == {"rel_l2", "cos", "max_abs", "median_rel_l2"}
    text = report.format()
    assert "cpu: leaves the F32 control's band (10x its error) at embedding" in text
    assert "q L2" in text and "logits" in text
    report.plot(tmp_path / "trace.png")
    assert (tmp_path / "trace.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_reference_mismatches_are_refused(tiny_variants, reference):
    path = tiny_variants["Q8_0"]
    with pytest.raises(BackendError, match="unknown setting 'cuda'"):
        layer_trace(path, tiny_variants["F32"], IDS, settings=["cuda"], reference=reference)
    no_qkv = record(qllama.load(tiny_variants["F32"]), IDS)
    with pytest.raises(QllamaError, match="without Q/K/V"):
        layer_trace(path, tiny_variants["F32"], IDS, qkv=True, reference=no_qkv)
    with pytest.raises(QllamaError, match="of other tokens"):
        layer_trace(path, tiny_variants["F32"], IDS[:-1], reference=reference)
    with pytest.raises(QllamaError, match="of other positions"):
        layer_trace(path, tiny_variants["F32"], IDS, positions=[0], reference=reference)


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("all", None),
        ("last", [9]),
        ("prompt", [0, 1, 2, 3]),
        ("new", [4, 5, 6, 7, 8, 9]),
        ("0,5,-1", [0, 5, -1]),
        ("2:4,8:", [2, 3, 8, 9]),
        ("-2:", [8, 9]),
    ],
)
def test_positions_from_text(text, expected):
    assert positions_from_text(text, 10, 4) == expected


@pytest.mark.parametrize("text", ["first", "1:x", "5:5", ""])
def test_bad_positions_text(text):
    with pytest.raises(QllamaError, match="--positions"):
        positions_from_text(text, 10, 4)


def test_no_new_positions_without_a_continuation():
    with pytest.raises(QllamaError, match="no such positions"):
        positions_from_text("new", 4, 4)


def test_trace_command(tiny_variants, tmp_path, capsys):
    if importlib.util.find_spec("transformers") is None:
        pytest.skip("transformers is not installed")
    argv = [
        "trace",
        str(tiny_variants["Q8_0"]),
        "--reference",
        str(tiny_variants["F32"]),
        "--prompt",
        "the cat sat on the mat",
        "--max-new-tokens",
        "3",
        "--positions",
        "new",
        "--setting",
        "cpu",
        "--setting",
        "dequantize-all",
        "--plot",
        str(tmp_path / "t.png"),
        "--json",
        str(tmp_path / "t.json"),
    ]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "3 positions compared" in out
    assert "cpu: leaves the F32 control's band" in out and "dequantize-all:" in out
    doc = json.loads((tmp_path / "t.json").read_text())
    n = len(doc["tokens"])
    assert doc["positions"] == [n - 3, n - 2, n - 1]
    # the control (qllama on the F32 file) agrees with transformers to float32 rounding
    control = doc["settings"]["dequantize-all"]["control"]
    c = qllama.load(tiny_variants["F32"]).config
    bound = forward_bound(c.n_layer, c.n_ff, 1.0)  # relative (tests/bounds.py)
    assert max(e["rel_l2"] for e in control.values()) < bound
    assert (tmp_path / "t.png").exists()


def _trace_argv(tiny_variants, tmp_path, reference):
    return [
        "trace",
        str(tiny_variants["Q8_0"]),
        "--reference",
        str(reference),
        "--prompt",
        "the cat sat on the mat",
        "--setting",
        "cpu",
        "--json",
        str(tmp_path / "t.json"),
    ]


@pytest.mark.parametrize(
    ("reference", "message"),
    [
        ("missing.gguf", "does not exist"),
        ("Q8_0", "holds quantized tensors (15 Q8_0)"),  # a quantized file is no f32 control
    ],
)
def test_trace_refuses_a_reference_before_any_work(
    tiny_variants, tmp_path, capsys, monkeypatch, reference, message
):
    if importlib.util.find_spec("transformers") is None:
        pytest.skip("transformers is not installed")
    path = tiny_variants.get(reference, tmp_path / reference)
    monkeypatch.setattr("qllama.cli.trace.prompt_ids", _no_work)
    with pytest.raises(SystemExit, match="2"):
        main(_trace_argv(tiny_variants, tmp_path, path))
    err = capsys.readouterr().err
    assert "usage: qllama trace" in err and message in err and "huggingface" not in err


def _no_work(*args, **kwargs):
    raise AssertionError("the command started its work before refusing its arguments")


def test_trace_plot_needs_matplotlib_before_any_work(tiny_variants, tmp_path, capsys, monkeypatch):
    if importlib.util.find_spec("transformers") is None:
        pytest.skip("transformers is not installed")
    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == "matplotlib" else real(name)
    )
    monkeypatch.setattr("qllama.cli.trace.prompt_ids", _no_work)
    argv = _trace_argv(tiny_variants, tmp_path, tiny_variants["F32"])
    with pytest.raises(SystemExit, match="2"):
        main([*argv, "--plot", str(tmp_path / "t.png")])
    assert "--plot needs matplotlib: pip install 'qllama[plot]'" in capsys.readouterr().err


def test_trace_writes_its_json_before_a_plot_fails(tiny_variants, tmp_path, capsys, monkeypatch):
    if importlib.util.find_spec("transformers") is None:
        pytest.skip("transformers is not installed")

    def broken(self, path, prompt=""):
        raise QllamaError("the plot failed")

    monkeypatch.setattr(TraceReport, "plot", broken)
    argv = _trace_argv(tiny_variants, tmp_path, tiny_variants["F32"])
    assert main([*argv, "--plot", str(tmp_path / "t.png")]) == 1
    assert json.loads((tmp_path / "t.json").read_text())["settings"]["cpu"]
    assert "the plot failed" in capsys.readouterr().err


def test_plot_keeps_coinciding_curves_visible(tiny_variants, reference, tmp_path, monkeypatch):
    # two settings with the same numbers (dequantize-all and the GPU arithmetic on numpy are
    # equal on an F32 file): the legend says so, and each line has its own marker
    report = layer_trace(
        tiny_variants["F32"],
        tiny_variants["F32"],
        IDS,
        settings=["dequantize-all", "f32"],
        reference=reference,
    )
    drawn = []
    import matplotlib.axes

    real = matplotlib.axes.Axes.plot

    def spy(self, *args, **kwargs):
        drawn.append((kwargs.get("label"), kwargs.get("marker")))
        return real(self, *args, **kwargs)

    monkeypatch.setattr(matplotlib.axes.Axes, "plot", spy)
    report.plot(tmp_path / "t.png", prompt="the cat")
    labels = [label for label, _ in drawn]
    assert labels[2] == "f32 (= dequantize-all)" and len({m for _, m in drawn}) == 2


def test_trace_routing_of_a_mixture_with_qllama_as_the_reference(tmp_path, capsys):
    """A mixture transformers would not read: qllama runs the F32 file for the reference, and
    --routing adds each setting's routing report, in the table and in the JSON."""
    from qllama.synthetic import TinyConfig, write_tiny

    moe = dict(arch="qwen3moe", head_dim=32, n_expert=4, n_ff_exp=32, n_layer=2, scale=0.3)
    f32, q4 = tmp_path / "F32.gguf", tmp_path / "Q4_0.gguf"
    write_tiny(f32, TinyConfig(**moe), seed=2)
    write_tiny(q4, TinyConfig(**moe, weight_type="Q4_0"), seed=2)
    argv = ["trace", str(q4), "--reference", str(f32), "--prompt", "the world"]
    argv += ["--engine", "qllama", "--routing", "--max-new-tokens", "6"]
    argv += ["--setting", "dequantize-all", "--json", str(tmp_path / "t.json")]
    plots = importlib.util.find_spec("matplotlib") is not None
    assert main([*argv, *(["--plot", str(tmp_path / "t.png")] if plots else [])]) == 0
    out = capsys.readouterr().out
    assert "against qllama" in out and "reference's experts forced" in out
    if plots:  # the routing's plot beside the trace's
        assert (tmp_path / "t-routing.png").stat().st_size > 1000
    doc = json.loads((tmp_path / "t.json").read_text())
    r = doc["routing"]["dequantize-all"]
    assert r["tokens"] == len(doc["tokens"]) and r["k"] == 2 and r["n_expert"] == 4
    assert r["free"]["mean_kld"] > 0 and len(r["routing"]["layer_changed"]) == 2
    assert doc["settings"]["dequantize-all"]["leaves_band"] is not None
    # a dense file has no routing to report
    dense = tmp_path / "dense.gguf"
    write_tiny(dense, TinyConfig(n_layer=2))
    argv[1], argv[3] = str(dense), str(dense)
    assert main(argv) == 1
    assert "not a mixture of experts" in capsys.readouterr().err
