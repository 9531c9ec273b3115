"""A mixture of experts made from a dense model (qllama.study.moefy): what each way of making
one must compute, checked where the answer is known (every expert used, no noise: the dense
model), and what it refuses."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import qllama
from qllama.array_api import to_numpy
from qllama.errors import QllamaError
from qllama.study.moefy import MoEfication, balanced_kmeans, moefy
from qllama.synthetic import TinyConfig, write_tiny

IDS = [1, 40, 77, 200, 5, 260, 99, 3, 17, 150]


@pytest.fixture(scope="module")
def dense(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("moefy") / "dense.gguf"
    write_tiny(path, TinyConfig(n_ff=128, scale=0.3), seed=1)
    return path


def logits(path: Path) -> np.ndarray:
    model = qllama.load(path, backend="numpy")
    return np.asarray(to_numpy(model.forward(IDS, all_logits=True)))


@pytest.mark.parametrize(
    "spec",
    [
        MoEfication(n_expert=4, k=4, router_scale=0.0),  # 1/4 each, times 4: exact weights
        MoEfication(n_expert=4, k=4, shared=64, router_scale=0.0),
        MoEfication(n_expert=4, k=2, mode="upcycle", noise=0.0),  # copies: any 2 are the FFN
    ],
    ids=["split", "split-shared", "upcycle"],
)
def test_a_mixture_that_loses_nothing_is_the_dense_model(
    dense: Path, tmp_path: Path, spec: MoEfication
) -> None:
    out = tmp_path / "moe.gguf"
    moefy(dense, out, spec)
    model = qllama.load(out)
    assert (model.config.n_expert, model.config.n_expert_used) == (spec.n_expert, spec.k)
    np.testing.assert_allclose(logits(out), logits(dense), atol=2e-5, rtol=0)


def test_a_real_split_routes_and_changes_the_model(dense: Path, tmp_path: Path) -> None:
    out = tmp_path / "moe.gguf"
    moefy(dense, out, MoEfication(n_expert=4, k=2))
    assert qllama.load(out).config.n_ff_exp == 32
    assert np.abs(logits(out) - logits(dense)).max() > 1e-3


def test_noisy_copies_stay_near_the_dense_model(dense: Path, tmp_path: Path) -> None:
    """Upcycled with 5% noise: no longer the dense model, but nearer it than a split."""
    near, split = tmp_path / "near.gguf", tmp_path / "split.gguf"
    moefy(dense, near, MoEfication(n_expert=4, k=2, mode="upcycle", noise=0.05))
    moefy(dense, split, MoEfication(n_expert=4, k=2))
    d_near = np.abs(logits(near) - logits(dense)).max()
    assert 1e-4 < d_near < np.abs(logits(split) - logits(dense)).max()


@settings(max_examples=25, deadline=None)
@given(
    n_clusters=st.sampled_from([1, 2, 4, 8]),
    per=st.integers(1, 6),
    seed=st.integers(0, 2**16),
)
def test_balanced_kmeans_makes_clusters_of_equal_size(n_clusters: int, per: int, seed: int) -> None:
    x = np.random.default_rng(seed).standard_normal((n_clusters * per, 5))
    label = balanced_kmeans(x, n_clusters, iterations=5, seed=seed)
    assert np.bincount(label, minlength=n_clusters).tolist() == [per] * n_clusters


def test_balanced_kmeans_keeps_separated_groups_together() -> None:
    """Two tight groups of directions far apart: each cluster is one group."""
    rng = np.random.default_rng(0)
    a = np.array([1.0, 0, 0]) + 0.01 * rng.standard_normal((6, 3))
    b = np.array([0, 0, 1.0]) + 0.01 * rng.standard_normal((6, 3))
    label = balanced_kmeans(np.concatenate([a, b]), 2, iterations=10, seed=3)
    assert len(set(label[:6])) == 1 and len(set(label[6:])) == 1 and label[0] != label[6]


def test_what_cannot_be_split_is_refused(dense: Path, tmp_path: Path) -> None:
    with pytest.raises(QllamaError, match="equal"):
        moefy(dense, tmp_path / "x.gguf", MoEfication(n_expert=3))
    with pytest.raises(QllamaError, match="k in"):
        moefy(dense, tmp_path / "x.gguf", MoEfication(n_expert=4, k=5))
    with pytest.raises(QllamaError, match="mode"):
        moefy(dense, tmp_path / "x.gguf", MoEfication(mode="prune"))
    moe = tmp_path / "moe.gguf"
    moefy(dense, moe, MoEfication(n_expert=4, k=2))
    with pytest.raises(QllamaError, match="mixture already"):
        moefy(moe, tmp_path / "x.gguf")
    q8 = tmp_path / "q8.gguf"
    write_tiny(q8, TinyConfig(n_ff=128, weight_type="Q8_0"))
    with pytest.raises(QllamaError, match="F32"):
        moefy(q8, tmp_path / "x.gguf")
    qwen = tmp_path / "qwen.gguf"
    write_tiny(qwen, TinyConfig(arch="qwen3", n_ff=128))
    with pytest.raises(QllamaError, match="llama"):
        moefy(qwen, tmp_path / "x.gguf")
    assert not (tmp_path / "x.gguf").exists()


def test_the_command_line_writes_the_mixture(dense: Path, tmp_path: Path, capsys) -> None:
    from qllama.cli import main

    out = tmp_path / "moe.gguf"
    args = ["moefy", str(dense), str(out), "--mode", "upcycle", "--experts", "2", "--k", "1"]
    assert main(args) == 0
    assert "wrote" in capsys.readouterr().out
    c = qllama.load(out).config
    assert (c.n_expert, c.n_expert_used, c.n_ff_exp) == (2, 1, 128)
    assert main(["moefy", str(dense), str(tmp_path / "x.gguf"), "--experts", "3"]) != 0
    assert "equal" in capsys.readouterr().err


def test_the_moe_study_declares_known_measures_and_findings() -> None:
    """experiments/moe.toml: every measure and option registered, every finding found."""
    from qllama.study import load_study, measures
    from qllama.study.findings import resolve

    root = Path(__file__).resolve().parents[1]
    study = load_study(root / "experiments" / "moe.toml")
    for spec in study.measures:
        measures.get(spec.name).options(spec.options)
    assert {"routing", "attribution"} <= {m.name for m in study.measures}
    assert all(callable(resolve(f, study.folder)) for f in study.findings)
    assert str(study.model_source()).endswith("smollm2-moe.F32.gguf")
