"""Where the drift enters, as study measures: ``attribution`` and ``layer_trace`` limited to
some cells, a measure that reads another variant's file, the cells' keys, and the report's
sections and plots (qllama/study/drift_report.py)."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest
from study_support import write_study

from qllama.measure.attribution import CLASSES
from qllama.study import Options, StudyError, load_study, run
from qllama.study.cells import measure_specs, product
from qllama.study.declaration import MeasureSpec
from qllama.study.runner import Plan, build_variants, plan_cells, plan_references

DRIFT = (
    '"teacher_forcing_batched", '
    '{name = "attribution", options = {kind = "activations"}, cells = ["*/Q8_0-cpu"]}, '
    '{name = "attribution", options = {kind = "weights", f32 = "F32"}, '
    'cells = ["*/Q8_0-dequantize-all"]}, '
    '{name = "layer_trace", options = {f32 = "F32", reference = "qllama"}, cells = ["raw/*"]}'
)


@pytest.fixture(scope="module")
def drift_run(tmp_path_factory):
    mp = pytest.MonkeyPatch()
    mp.setenv("QLLAMA_CACHE", str(tmp_path_factory.mktemp("qllama-cache")))
    folder = tmp_path_factory.mktemp("drift")
    study = load_study(write_study(folder, measures=DRIFT))
    code = run(study, Options(results=folder / "results", docs=folder / "docs", executor="local"))
    yield folder, study, code
    mp.undo()


def cells_of(folder) -> dict[str, dict]:
    docs = json.loads((folder / "docs" / "results.json").read_text())
    return {(p, k): c for p, e in docs["prompts"].items() for k, c in e["cells"].items()}


def test_a_measure_runs_only_in_its_cells(drift_run):
    folder, _, code = drift_run
    assert code == 0
    cells = cells_of(folder)
    for (prompt, label), c in cells.items():
        m = c["measures"]
        assert "teacher_forcing_batched" in m
        assert ("attribution" in m) == (label in ("Q8_0-cpu", "Q8_0-dequantize-all"))
        assert ("layer_trace" in m) == (prompt == "raw")
    acts = cells[("raw", "Q8_0-cpu")]["measures"]["attribution"]
    weights = cells[("raw", "Q8_0-dequantize-all")]["measures"]["attribution"]
    assert acts["kind"] == "activations" and weights["kind"] == "weights"
    assert "file" not in acts  # no path of this machine in the results
    # the whole: every group on at once is the cell's own arithmetic (the same file, the same
    # backend), so its KL is the cell's batched teacher forcing's, bit for bit
    tf = cells[("raw", "Q8_0-cpu")]["measures"]["teacher_forcing_batched"]
    assert acts["whole"]["mean_kld"] == tf["kl"]["mean_kld"]
    assert acts["whole"]["mean_kld"] > acts["baseline"]["mean_kld"]
    groups = {p["group"] for p in acts["parts"]}
    assert groups <= set(CLASSES) and len(groups) >= 7


def test_the_layer_trace_reads_the_f32_variant_and_its_control_is_exact(drift_run):
    folder, _, _ = drift_run
    cells = cells_of(folder)
    # the F32 file under dequantize-all is what the qllama reference computes: exactly 0
    f32 = cells[("raw", "F32-dequantize-all")]["measures"]["layer_trace"]["errors"]
    assert all(e["rel_l2"] == 0.0 for e in f32.values())
    q8 = cells[("raw", "Q8_0-cpu")]["measures"]["layer_trace"]
    assert q8["residual"][0] == "embedding" and q8["residual"][-1] == "logits"
    assert q8["errors"]["logits"]["rel_l2"] > 0


def test_the_report_has_the_sections_and_plots(drift_run):
    folder, _, _ = drift_run
    md = (folder / "docs" / "results.md").read_text()
    assert "### Attribution: Q8_0-cpu" in md and "### Attribution: Q8_0-dequantize-all" in md
    assert "### Attribution of Q8_0-cpu, every prompt" in md
    assert "### Layer trace" in md and "leaves the F32 band" in md
    assert (folder / "docs" / "plots" / "raw-layers-Q8_0.png").stat().st_size > 0
    assert not (folder / "docs" / "plots" / "chat-layers-Q8_0.png").exists()


def test_a_file_measure_keys_the_other_file(drift_run, tmp_path):
    """The weights attribution reads the F32 file: its hash is in the cell's key; a cell
    whose measures read no other file keeps the key it would have without the others."""
    folder, study, _ = drift_run
    plain = replace(study, measures=study.measures[:1])  # batched teacher forcing alone

    def tasks(s):
        plan = Plan(s, folder / "results", build_variants(s))
        plan_references(plan, lambda jobs: [], compute=False)
        plan_cells(plan, product(s))
        return plan.tasks

    ours, theirs = tasks(study), tasks(plain)
    assert set(ours["chat/Q8_0-dequantize-all"].files) == {"F32"}
    assert set(ours["raw/Q8_0-cpu"].files) == {"F32"}  # the layer trace's
    assert not ours["chat/Q8_0-cpu"].files
    assert ours["chat/F32-cpu"].key == theirs["chat/F32-cpu"].key
    assert ours["chat/Q8_0-cpu"].key != theirs["chat/Q8_0-cpu"].key  # it gained a measure
    chat_f32 = next(c for c in product(study) if c.id == "chat/F32-cpu")
    assert [m.name for m in measure_specs(study, chat_f32)] == ["teacher_forcing_batched"]


@pytest.mark.parametrize(
    ("measures", "message"),
    [
        ('{name = "teacher_forcing", cells = ["nope/*"]}', "matches no cell"),
        (
            '"teacher_forcing", {name = "teacher_forcing", cells = ["raw/*"]}',
            "declared twice for the cell raw/F32-cpu",
        ),
    ],
)
def test_bad_measure_cells_are_refused(tmp_path, measures, message):
    with pytest.raises(StudyError, match=message):
        load_study(write_study(tmp_path, measures=measures))


def test_a_file_option_must_name_a_variant(tmp_path):
    measures = '{name = "layer_trace", options = {f32 = "F16"}, cells = ["raw/*"]}'
    study = load_study(write_study(tmp_path, measures=measures))
    with pytest.raises(StudyError, match="names 'F16', not a variant"):
        run(study, Options(results=tmp_path / "results", executor="local"))


@pytest.mark.parametrize("measure", ["layer_trace", "corpus"])
def test_a_transformers_measure_without_transformers_says_what_to_install(monkeypatch, measure):
    import importlib.util

    from qllama.study import measures

    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util,
        "find_spec",
        lambda name, *a: None if name == "transformers" else real(name, *a),
    )
    m = measures.get(measure)
    options = m.options({"f32": "unused.gguf"})
    with pytest.raises(StudyError, match=r"pip install 'qllama\[reference\]'"):
        measures.run(MeasureSpec(measure, options), None, None, {"unused.gguf": "unused.gguf"})


def test_a_measure_may_be_limited_to_an_optional_draws_cells(tmp_path):
    """Patterns are checked against every draw's cells: an optional draw's are valid, and the
    measure runs there once the draw is switched on."""
    from qllama.study.declaration import with_draws

    optional = (
        '[[draw]]\nname = "opt"\nsettings = ["cpu"]\nenv = {OPENBLAS_CORETYPE = "Haswell"}\n'
        "optional = true\n"
    )
    measures = '"teacher_forcing_batched", {name = "last_position", cells = ["*/Q8_0-cpu~opt"]}'
    study = load_study(write_study(tmp_path, measures=measures, extra=optional))
    assert not any(c.draw == "opt" for c in product(study))
    drawn = with_draws(study, ["opt"])
    cell = next(c for c in product(drawn) if c.id == "raw/Q8_0-cpu~opt")
    assert [m.name for m in measure_specs(drawn, cell)] == [
        "teacher_forcing_batched",
        "last_position",
    ]


def test_the_summary_tables_attributions_of_different_kinds_apart():
    """One cell attributed by class on one prompt and by expert on another: two tables, each
    with its own groups (one table would look for a class among the experts)."""
    from types import SimpleNamespace

    from qllama.study.drift_report import summary_attribution
    from qllama.study.results import Attribution, Excess, Measures, Part, Scores

    def attribution(by: str, groups: list[str]) -> Attribution:
        s = Scores(0.1, 1.0, 2.0, 1.0)
        parts = tuple(Part(g, (g,), 0.1, 1.0, 2.0, 1.0, 0.05, 0.5) for g in groups)
        e = Excess(0.1, 1.0)
        return Attribution("weights", by, "f32", 4, s, s, e, e, parts)

    def prompt(a: Attribution) -> SimpleNamespace:
        cell = SimpleNamespace(info={}, measures=Measures({"attribution": a}))
        return SimpleNamespace(cells={"Q4_K_M-dequantize-all": cell})

    prompts = {
        "a": prompt(attribution("class", ["attn_q", "ffn_up_exps"])),
        "b": prompt(attribution("expert", ["blk.0.expert0", "blk.0.expert1"])),
    }
    tables: list[list[list[str]]] = []

    def table(header: list[str], rows: list[list[str]]) -> list[str]:
        tables.append(rows)
        return []

    summary_attribution(prompts, table)
    assert [[r[0] for r in t[:2]] for t in tables] == [
        ["attn_q", "ffn_up_exps"],
        ["blk.0.expert0", "blk.0.expert1"],
    ]
