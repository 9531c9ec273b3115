"""A study of a tiny mixture of experts with the routing measure, end to end: the cells cache
its report, the markdown has its table and plot, a finding reads it."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from qllama.study import Options, load_study, run
from qllama.synthetic import TinyConfig, write_tiny

TOML = """
name = "tiny-moe"
model = "moe.gguf"
threads = 1
measures = ["teacher_forcing_batched", { name = "routing", options = { f32 = "F32" } }]

[reference]
kind = "qllama"
options = { dequantize_all = true }

[[variant]]
type = "F32"
[[variant]]
type = "Q4_0"

[[setting]]
name = "dequantize-all"
backend = "numpy"
options = { dequantize_all = true }

[[prompt]]
name = "raw"
chat = false
text = "the world is"
max_new_tokens = 6

[[finding]]
name = "the F32 file routes as the reference"
check = "findings.py:f32_routes"
"""

FINDINGS = """
from qllama.study import Check


def f32_routes(view):
    r = view.cell("F32", "dequantize-all").routing
    yield Check("F32-dequantize-all", "pairs rerouted", r.routing.changed, "0",
                r.routing.changed == 0.0)
"""


@pytest.fixture(autouse=True)
def _cache(tmp_path, monkeypatch):
    monkeypatch.setenv("QLLAMA_CACHE", str(tmp_path / "cache"))  # the variants it builds


def test_a_mixture_study_reports_its_routing(tmp_path: Path) -> None:
    moe = dict(arch="qwen3moe", head_dim=32, n_expert=4, n_ff_exp=32, n_layer=2, scale=0.3)
    write_tiny(tmp_path / "moe.gguf", TinyConfig(**moe), seed=4)
    (tmp_path / "study.toml").write_text(TOML)
    (tmp_path / "findings.py").write_text(FINDINGS)
    study = load_study(tmp_path / "study.toml")
    docs = tmp_path / "docs"
    options = Options(results=tmp_path / "results", docs=docs, executor="local")
    assert run(study, options) == 0
    cells = {
        json.loads(p.read_text())["cell"]: json.loads(p.read_text())
        for p in (tmp_path / "results" / "cells").glob("*.json")
    }
    q4 = cells["raw/Q4_0-dequantize-all"]["measures"]["routing"]
    assert q4["layers"] == 2 and q4["k"] == 2 and q4["free"]["mean_kld"] > 0
    md = (docs / "results.md").read_text()
    assert "### Routing" in md and "| Q4_0-dequantize-all |" in md
    assert (docs / "plots" / "raw-routing.png").stat().st_size > 1000
    assert "the F32 file routes as the reference" in md
