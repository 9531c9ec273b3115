"""Where routing meets quantization (qllama.measure.routing): the selection as the model makes
it, the agreement of two routings, and the counterfactual run with a forced selection."""

from __future__ import annotations

import dataclasses
import importlib.util
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

import qllama
from qllama.array_api import to_numpy
from qllama.errors import QllamaError, SequenceError
from qllama.measure.routing import (
    ForcedRouting,
    Routing,
    agreement,
    kl_divergence,
    router_logits,
    routing_report,
)
from qllama.runtime.config import ModelConfig
from qllama.runtime.observe import LOGITS, record
from qllama.synthetic import TinyConfig, model_config, write_tiny

IDS = [1, 40, 77, 200, 5, 260, 99, 3, 17, 150, 61, 222, 8, 130, 45, 250]
TINY = dict(n_layer=3, n_embd=64, n_ff=96, n_head=4, n_head_kv=2, scale=0.3)
QWEN3MOE = TinyConfig(arch="qwen3moe", head_dim=32, n_expert=6, n_ff_exp=32, **TINY)
N_VOCAB = 269  # the synthetic gpt2 vocabulary


def config(n_expert: int = 6, k: int = 2) -> ModelConfig:
    """A qwen3moe's config as the loader reads it (which normalises the top-k weights)."""
    tiny = TinyConfig(arch="qwen3moe", n_expert=n_expert, n_expert_used=k, n_ff_exp=32)
    return dataclasses.replace(model_config(tiny, N_VOCAB), expert_weights_norm=True)


@pytest.fixture(scope="module")
def files(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """The same random mixture as F32 and as Q4_0 (the seed fixes the weights)."""
    folder = tmp_path_factory.mktemp("moe")
    out = {}
    for kind in ("F32", "Q4_0"):
        out[kind] = folder / f"{kind}.gguf"
        write_tiny(out[kind], TinyConfig(**{**QWEN3MOE.__dict__, "weight_type": kind}), seed=3)
    return out


def selections(model: qllama.Model, tokens: list[int]) -> tuple[np.ndarray, np.ndarray]:
    """The selection the forward pass made at every layer, and the logits."""
    seen: dict[str, np.ndarray] = {}

    def keep(name: str, value: object) -> None:
        if name.endswith(".experts"):
            seen[name] = np.asarray(to_numpy(value))

    logits = to_numpy(model.forward(tokens, all_logits=True, observer=keep))
    n = model.config.n_layer
    return np.stack([seen[f"blk.{i}.experts"] for i in range(n)]), np.asarray(logits)


# --- the selection, as the model makes it -----------------------------------------------------


def test_the_routing_of_recorded_logits_is_the_forward_pass_selection(
    files: dict[str, Path],
) -> None:
    model = qllama.load(files["Q4_0"], backend="numpy")
    trace = record(model, IDS, router=True)
    routing = Routing.of(router_logits(trace, model.config.n_layer), model.config)
    made, _ = selections(model, IDS)
    np.testing.assert_array_equal(routing.selected, made)
    assert routing.weights.shape == made.shape
    # qwen3moe normalises the top-k weights
    np.testing.assert_allclose(routing.weights.sum(axis=-1), 1.0, rtol=1e-6)


def test_past_sixteen_experts_ties_are_ranked_as_llama_cpp_ranks_them() -> None:
    """A row of 20 equal logits: libstdc++'s introsort order, not index order."""
    from qllama.runtime.routing import stdsort_desc

    logits = np.zeros((1, 2, 20), np.float32)
    routing = Routing.of(logits, config(n_expert=20, k=4))
    want = stdsort_desc(np.full(20, 0.05, np.float32))[:4]
    assert routing.selected[0, 0].tolist() == want
    assert want != [0, 1, 2, 3]


def test_routing_refuses_a_dense_model_and_bad_shapes() -> None:
    with pytest.raises(QllamaError, match="without experts"):
        Routing.of(np.zeros((1, 2, 4), np.float32), model_config(TinyConfig(), N_VOCAB))
    with pytest.raises(QllamaError, match="expected"):
        Routing.of(np.zeros((1, 2, 5), np.float32), config(n_expert=6))


# --- agreement ---------------------------------------------------------------------------------

logit_arrays = hnp.arrays(
    np.float32,
    st.tuples(st.integers(1, 3), st.integers(1, 6), st.just(6)),
    elements=st.floats(-8, 8, width=32),
)


@settings(max_examples=40, deadline=None)
@given(logits=logit_arrays, k=st.integers(1, 6))
def test_identical_logits_agree_fully(logits: np.ndarray, k: int) -> None:
    r = Routing.of(logits, config(k=k))
    a = agreement(r, r)
    np.testing.assert_array_equal(a.set_agreement, 1.0)
    np.testing.assert_array_equal(a.ordered, 1.0)
    assert a.top1.all()
    np.testing.assert_array_equal(a.weight_error, 0.0)
    s = a.summary()
    assert s.changed == s.top1_changed == s.reordered == s.positions_changed == 0.0
    assert s.median_margin_changed is None


@settings(max_examples=40, deadline=None)
@given(a=logit_arrays, data=st.data(), k=st.integers(1, 5))
def test_agreement_bounds_and_symmetry(a: np.ndarray, data: st.DataObject, k: int) -> None:
    b = data.draw(hnp.arrays(np.float32, a.shape, elements=st.floats(-8, 8, width=32)))
    ra, rb = Routing.of(a, config(k=k)), Routing.of(b, config(k=k))
    ab, ba = agreement(ra, rb), agreement(rb, ra)
    np.testing.assert_array_equal(ab.set_agreement, ba.set_agreement)
    np.testing.assert_allclose(ab.weight_error, ba.weight_error)
    np.testing.assert_array_equal(ab.ordered, ba.ordered)
    assert ((ab.set_agreement >= 0) & (ab.set_agreement <= 1)).all()
    # the same experts in the same order is the same top-1; a changed set is a changed order
    assert (ab.top1 | (ab.ordered < 1)).all()
    assert (ab.ordered[ab.changed] < 1).all()
    # both weight vectors sum to 1 (normalised): their L1 distance is at most 2
    assert (ab.weight_error <= 2 + 1e-6).all()


def test_agreement_by_hand() -> None:
    """Two tokens, four experts, top 2. Token 0: the same experts swapped; token 1: one of the
    two replaced."""
    ref = np.log(np.array([[[0.1, 0.5, 0.3, 0.1], [0.6, 0.3, 0.05, 0.05]]], np.float32))
    ours = np.log(np.array([[[0.1, 0.3, 0.5, 0.1], [0.6, 0.05, 0.3, 0.05]]], np.float32))
    c = config(n_expert=4, k=2)
    a = agreement(Routing.of(ref, c), Routing.of(ours, c))
    np.testing.assert_array_equal(a.set_agreement, [[1.0, 0.5]])
    np.testing.assert_array_equal(a.top1, [[False, True]])
    # token 0: depth 1 shares nothing, depth 2 both: (0 + 1) / 2; token 1: (1 + 1/2) / 2
    np.testing.assert_allclose(a.ordered, [[0.5, 0.75]])
    # weights normalised over the two: token 0 (5/8, 3/8) against (3/8, 5/8) on experts 1, 2;
    # token 1 expert 0 at 2/3 both, expert 1 at 1/3 against expert 2 at 1/3
    np.testing.assert_allclose(a.weight_error, [[0.5, 2 / 3]], rtol=1e-5)
    np.testing.assert_allclose(a.ref_margin, [[0.2, 0.25]], rtol=1e-5)
    s = a.summary()
    assert s.changed == 0.5 and s.top1_changed == 0.5 and s.positions_changed == 0.5
    assert s.reordered == 1.0  # token 0 keeps its experts in another order
    assert s.layer_changed == (0.5,)


# --- the counterfactual ------------------------------------------------------------------------


@pytest.mark.parametrize("backend", ["numpy", "torch", "jax"])
def test_forcing_a_model_s_own_routing_reproduces_it_exactly(
    files: dict[str, Path], backend: str
) -> None:
    """On every backend: the forced selection comes in as numpy integers, goes to the
    backend's namespace, and routes exactly as the model's own."""
    if importlib.util.find_spec(backend) is None:
        pytest.skip(f"{backend} is not installed")
    model = qllama.load(files["F32"], backend=backend)
    made, logits = selections(model, IDS)
    forced = to_numpy(model.forward(IDS, all_logits=True, observer=ForcedRouting(made)))
    np.testing.assert_array_equal(forced, logits)


def test_forcing_other_experts_changes_the_logits(files: dict[str, Path]) -> None:
    model = qllama.load(files["F32"], backend="numpy")
    made, logits = selections(model, IDS)
    other = (made + 1) % model.config.n_expert  # every token to other experts
    forced = to_numpy(model.forward(IDS, all_logits=True, observer=ForcedRouting(other)))
    assert np.abs(forced - logits).max() > 1e-3
    seen, _ = selections(model, IDS)  # the hook leaves the next run alone
    np.testing.assert_array_equal(seen, made)


def test_a_forced_selection_of_the_wrong_shape_or_range_is_refused(
    files: dict[str, Path],
) -> None:
    model = qllama.load(files["F32"], backend="numpy")
    made, _ = selections(model, IDS)
    with pytest.raises(SequenceError, match="shape"):
        model.forward(IDS, all_logits=True, observer=ForcedRouting(made[:, :, :1]))
    with pytest.raises(SequenceError, match="outside"):
        model.forward(IDS, all_logits=True, observer=ForcedRouting(made + 6))


def test_the_report_of_a_file_against_itself_is_all_zero(files: dict[str, Path]) -> None:
    model = qllama.load(files["F32"], backend="numpy")
    report = routing_report(model, model, IDS)
    assert report.routing.changed == 0.0
    assert report.free.mean_kld == 0.0 and report.forced.mean_kld == 0.0
    assert report.explained is None and report.changed is None
    assert report.unchanged is not None and report.unchanged.positions == len(IDS)


def test_the_report_of_a_quantized_mixture(files: dict[str, Path]) -> None:
    ref = qllama.load(files["F32"], backend="numpy")
    model = qllama.load(files["Q4_0"], backend="numpy", dequantize_all=True)
    report = routing_report(model, ref, IDS)
    r = report.routing
    assert 0 < r.changed < 1, "the tiny Q4_0 mixture should change some routing, not all"
    assert report.free.mean_kld > 0
    # the forced run is the quantized model with the reference's selection: recomputed here
    ref_trace = record(ref, IDS, router=True)
    selected = Routing.of(router_logits(ref_trace, 3), ref.config).selected
    forced = record(model, IDS, observer=ForcedRouting(selected))
    np.testing.assert_array_equal(
        report.kld_forced, kl_divergence(ref_trace[LOGITS], forced[LOGITS])
    )
    assert report.explained == pytest.approx(1 - report.forced.mean_kld / report.free.mean_kld)
    assert report.changed is not None and report.unchanged is not None
    assert report.changed.positions + report.unchanged.positions == len(IDS)
    assert report.changed.positions == round(r.positions_changed * len(IDS))
    # the routing changes come at the reference's near-ties
    assert r.median_margin_changed is not None and r.median_margin_changed < r.median_margin
    assert set(report.to_dict()) >= {"routing", "free", "forced", "explained"}
    assert "share of the mean KLD" in report.format()


# --- as a study measure --------------------------------------------------------------------------


def test_the_study_measure_stores_and_reads_back_its_report(files: dict[str, Path]) -> None:
    from qllama.measure.compare import reference_from_model
    from qllama.study import measures, results
    from qllama.study.declaration import MeasureSpec, StudyError

    ref_model = qllama.load(files["F32"], backend="numpy", dequantize_all=True)
    ref = reference_from_model(ref_model, IDS[:8], max_new_tokens=6)
    model = qllama.load(files["Q4_0"], backend="numpy")
    spec = MeasureSpec("routing", {"f32": "F32"})
    out = measures.run(spec, model, ref, files={"F32": str(files["F32"])})
    assert out.tokens == len(ref.tokens) and out.kld_free.shape == (len(ref.tokens),)
    # the same numbers as the report computed here, against the F32 file's own run
    direct = routing_report(model, ref_model, ref.tokens)
    assert out.to_dict() == direct.to_dict()
    numbers, arrays = results.encode(out, "routing")
    back = measures.read("routing", numbers, arrays)
    assert back.to_dict() == out.to_dict()
    np.testing.assert_array_equal(back.set_agreement, out.set_agreement)
    assert results.Measures({"routing": back}).routing is back
    with pytest.raises(StudyError, match="f32"):
        measures.run(MeasureSpec("routing"), model, ref)
    dense = tmp_dense(files["F32"].parent)
    with pytest.raises(StudyError, match="mixture"):
        measures.run(spec, qllama.load(dense), ref, files={"F32": str(files["F32"])})


def tmp_dense(folder: Path) -> Path:
    path = folder / "dense.gguf"
    if not path.exists():
        write_tiny(path, TinyConfig(**TINY))
    return path


def test_the_study_report_has_a_routing_table(files: dict[str, Path]) -> None:
    from types import SimpleNamespace

    from qllama.study.report import section_routing
    from qllama.study.results import Measures

    ref = qllama.load(files["F32"], backend="numpy")
    cells = {
        "F32-cpu": Measures({"routing": routing_report(ref, ref, IDS)}),
        "Q4_0-cpu": Measures({"routing": routing_report(qllama.load(files["Q4_0"]), ref, IDS)}),
        "dense-cpu": Measures({}),
    }
    pv = SimpleNamespace(name="p", labels=list(cells), measures=cells.__getitem__)
    lines = section_routing(pv)  # type: ignore[arg-type]
    assert lines[0] == "### Routing\n" and "16 tokens x 3 layers, top 2 of 6" in lines[1]
    rows = [line for line in lines if line.startswith("| F32") or line.startswith("| Q4_0")]
    assert len(rows) == 2 and "| 0.00% |" in rows[0] and rows[0].rstrip().endswith("| – |")
    assert lines[-1] == "![routing per layer](plots/p-routing.png)\n"
    dense = SimpleNamespace(name="p", labels=["dense-cpu"], measures=cells.__getitem__)
    assert section_routing(dense) == []  # type: ignore[arg-type]
