"""A study as data: the TOML and Python forms, the checks on a declaration, the cells and
their content keys."""

from __future__ import annotations

import re
from dataclasses import replace
from pathlib import Path

import pytest

from qllama.gguf.imatrix import DEFAULT_CTX
from qllama.study import (
    Draw,
    FindingSpec,
    MeasureSpec,
    Prompt,
    ReferenceSpec,
    Setting,
    Study,
    StudyError,
    Variant,
    load_study,
    measures,
)
from qllama.study.cells import Arithmetic, Cell, content_key, product, select
from qllama.study.declaration import from_dict, with_draws, with_prompts

ROOT = Path(__file__).parent.parent

TOML = """
name = "small"
model = "smollm2-135m-instruct"
measures = ["teacher_forcing", {name = "free_generation", options = {extra = 5}}]

[reference]
kind = "qllama"

[[variant]]
type = "F32"
[[variant]]
type = "Q8_0"

[[setting]]
name = "cpu"
[[setting]]
name = "gpu"
backend = "torch"
prompts = ["a"]
[[setting]]
name = "jax"
backend = "jax"
variants = ["Q8_0"]

[[prompt]]
name = "a"
text = "Hi"
[[prompt]]
name = "b"
chat = false
text = "The sky is"
max_new_tokens = 8

[[draw]]
name = "haswell"
settings = ["cpu"]
env = {OPENBLAS_CORETYPE = "Haswell"}
[[draw]]
name = "peer"
settings = ["cpu"]
variants = ["Q8_0"]
engine = "llama.cpp"
optional = true

[[finding]]
name = "f"
check = "findings.py:f"
assert = false
"""


def python_form() -> Study:
    return Study(
        name="small",
        model="smollm2-135m-instruct",
        measures=(MeasureSpec("teacher_forcing"), MeasureSpec("free_generation", {"extra": 5})),
        reference=ReferenceSpec(kind="qllama"),
        variants=(Variant("F32"), Variant("Q8_0")),
        settings=(
            Setting("cpu"),
            Setting("gpu", backend="torch", prompts=("a",)),
            Setting("jax", backend="jax", variants=("Q8_0",)),
        ),
        prompts=(
            Prompt("a", text="Hi"),
            Prompt("b", text="The sky is", chat=False, max_new_tokens=8),
        ),
        draws=(
            Draw("haswell", ("cpu",), env={"OPENBLAS_CORETYPE": "Haswell"}),
            Draw("peer", ("cpu",), variants=("Q8_0",), engine="llama.cpp", optional=True),
        ),
        findings=(FindingSpec("f", "findings.py:f", asserted=False),),
    )


def test_toml_and_python_give_the_same_study(tmp_path):
    path = tmp_path / "s.toml"
    path.write_text(TOML)
    assert replace(load_study(path), folder=Path(".")) == python_form()
    assert load_study(path).folder == tmp_path


def test_the_seed_declaration_loads():
    study = load_study(ROOT / "experiments" / "seed.toml")
    assert [v.name for v in study.variants] == [
        "F32",
        "Q8_0",
        "Q4_K_M",
        "Q4_K_M-imatrix",
        "IQ4_XS-imatrix",
    ]
    # the importance matrices calibrate on text the corpus measure does not score: they skip
    # at least the tokens of its windows
    spec = next(m for m in study.measures if m.name == "corpus")
    corpus = measures.get("corpus").options(spec.options)
    for v in study.variants[3:]:
        assert v.imatrix_corpus == f"corpus:{corpus['corpus']}"
        assert v.imatrix_skip_chunks * DEFAULT_CTX >= corpus["chunks"] * corpus["n_ctx"]
    assert len(study.prompts) >= 6 and study.prompt("cpu-cache").max_new_tokens == 300
    assert {p.chat for p in study.prompts} == {True, False}  # chat and raw prompts


def test_cells_are_the_product_with_filters_and_draws():
    study = python_form()
    ids = [c.id for c in product(study)]
    assert ids == [
        "a/F32-cpu",
        "a/F32-cpu~haswell",
        "a/F32-gpu",
        "a/Q8_0-cpu",
        "a/Q8_0-cpu~haswell",
        "a/Q8_0-gpu",
        "a/Q8_0-jax",
        "b/F32-cpu",
        "b/F32-cpu~haswell",
        "b/Q8_0-cpu",
        "b/Q8_0-cpu~haswell",
        "b/Q8_0-jax",
    ]
    # the optional draw runs only when asked for, and only on its variants
    on = [c.id for c in product(with_draws(study, ["peer"]))]
    assert [c for c in on if c.endswith("~peer")] == ["a/Q8_0-cpu~peer", "b/Q8_0-cpu~peer"]
    assert [c.id for c in select(product(study), ["b/*~*"])] == [
        "b/F32-cpu~haswell",
        "b/Q8_0-cpu~haswell",
    ]
    with pytest.raises(StudyError, match="no cell matches"):
        select(product(study), ["nothing*"])
    with pytest.raises(StudyError, match="no draw named 'nope'"):
        with_draws(study, ["nope"])


def test_a_run_on_some_prompts_keeps_the_declarations_other_names():
    """``--prompt``: the seed study on its raw completion alone still loads, though its jax
    setting, compare pairs and corpus measure name prompts it leaves out."""
    study = load_study(ROOT / "experiments" / "seed.toml")
    one = with_prompts(study, ["raw"])
    assert [p.name for p in one.prompts] == ["raw"]
    assert set(one.skipped_prompts) == {p.name for p in study.prompts} - {"raw"}
    assert {c.prompt for c in product(one)} == {"raw"}
    assert [c.id for c in product(one)] == [c.id for c in product(study) if c.prompt == "raw"]
    assert with_prompts(study, []) is study
    with pytest.raises(StudyError, match="no prompt named 'nope'"):
        with_prompts(study, ["nope"])
    # a pattern whose prompt part is a glob over the prompts left out
    globbed = tuple(
        replace(m, cells=("cpu-*/*-cpu",)) if m.name == "layer_trace" else m for m in study.measures
    )
    assert product(with_prompts(replace(study, measures=globbed), ["raw"])) == product(one)


def test_the_content_key_follows_the_numbers_not_the_names():
    how = Arithmetic("qllama", "numpy", {"dequantize_all": True})
    base = dict(
        file_sha256="ab" * 32,
        reference_key="cd" * 16,
        how=how,
        measures=(MeasureSpec("teacher_forcing", {"top": 5}),),
        threads=1,
    )
    key = content_key(**base)
    assert content_key(**base) == key
    changes = [
        {"file_sha256": "ef" * 32},
        {"reference_key": "00" * 16},
        {"how": replace(how, options={})},
        {"how": replace(how, env={"OPENBLAS_CORETYPE": "Haswell"})},
        {"how": replace(how, engine="llama.cpp")},
        {"measures": (MeasureSpec("teacher_forcing", {"top": 3}),)},
        {"threads": 2},
    ]
    keys = {content_key(**(base | c)) for c in changes}
    assert len(keys) == len(changes) and key not in keys
    assert Cell("a", "Q8_0", "cpu", "haswell").id == "a/Q8_0-cpu~haswell"


BAD = [
    ({"color": 1}, "unknown top-level key 'color'"),
    ({"variant": [{"type": "F32", "bits": 4}]}, r"\[\[variant\]\] #1: unknown key 'bits'"),
    ({"variant": [{"type": "F32"}, {"type": "F32"}]}, "two variants are named 'F32'"),
    ({"setting": [{"name": "a/b"}]}, "must be non-empty, without"),
    ({"prompt": [{"name": "p"}]}, "give either text or messages"),
    ({"prompt": [{"name": "p", "text": "x", "max_new_tokens": 0}]}, "at least 1"),
    ({"reference": {"kind": "oracle"}}, "reference kind must be one of"),
    ({"reference": {"variant": "Q2_K"}}, "reference variant 'Q2_K' is not a declared"),
    ({"draw": [{"name": "d", "settings": ["gpu"]}]}, "names the setting 'gpu'"),
    ({"draw": [{"name": "d", "settings": []}]}, "applies to no setting"),
    ({"setting": [{"name": "s", "engine": "vllm"}]}, "engine must be one of"),
    ({"cross": [{"pair": ["cpu"]}]}, "must be pair"),
    ({"measures": []}, "declares no measure"),
    ({"threads": 0}, "threads must be at least 1"),
    ({"variant": [{"type": "F32", "imatrix": "a", "imatrix_corpus": "b"}]}, "not both"),
    ({"variant": [{"type": "F32", "imatrix_skip_chunks": 2}]}, "imatrix_skip_chunks is a count"),
    ({"setting": [{"name": "cpu", "variants": ["Q8_0"]}]}, "names the variant 'Q8_0'"),
    ({"threads": "two"}, "threads must be int"),
    ({"prompt": [{"name": "p", "text": "x", "max_new_tokens": "9"}]}, "max_new_tokens must be int"),
    ({"draw": [{"name": "d", "settings": ["cpu"], "env": {"A": 1}}]}, "draw 'd': A must be str"),
    # what a setting computes with, checked at read time as qllama.load checks it
    ({"setting": [{"name": "cpu", "backend": "nump"}]}, "setting 'cpu': unknown backend 'nump'"),
    (
        {"setting": [{"name": "cpu", "options": {"activations": "q9"}}]},
        "setting 'cpu': backend numpy: activations must be one of",
    ),
    ({"setting": [{"name": "cpu", "options": {"kernel": "numba"}}]}, r"no options \['kernel'\]"),
    ({"setting": [{"name": "cpu", "options": {"device": "tpu"}}]}, "device 'tpu' is none of"),
    ({"setting": [{"name": "cpu", "options": {"kv_precision": "f8"}}]}, "KV cache precision must"),
    ({"setting": [{"name": "cpu", "options": {"arithmetic": "q7"}}]}, "arithmetic 'q7'"),
    (
        {"draw": [{"name": "d", "settings": ["cpu"], "options": {"activation_rounding": "x"}}]},
        "draw 'd' \\(on setting 'cpu'\\): backend numpy: activation_rounding must be",
    ),
    ({"reference": {"kind": "qllama", "backend": "jaxx"}}, "reference: unknown backend 'jaxx'"),
    ({"variant": [{"type": "Q8_O"}]}, "variant 'Q8_O': type 'Q8_O' is not a file type"),
]


@pytest.mark.parametrize(("change", "message"), BAD, ids=[m for _, m in BAD])
def test_a_bad_declaration_is_refused_naming_the_field(change, message):
    doc = {
        "name": "s",
        "model": "m.gguf",
        "measures": ["teacher_forcing"],
        "variant": [{"type": "F32"}],
        "setting": [{"name": "cpu"}],
        "prompt": [{"name": "p", "text": "x"}],
    }
    with pytest.raises(StudyError, match=message):
        from_dict(doc | change)


STUDY_WITH_A_TYPO = """\
name = "s"
model = "m.gguf"
measures = ["teacher_forcing"]

[[variant]]
type = "F32"

[[setting]]
name = "cpu"

[[setting]]
name = "gpu"
backend = "numpy"
options = { activations = "f32", work_bytes = 1 }

[[prompt]]
name = "p"
text = "x"
"""


@pytest.mark.parametrize(
    ("old", "new", "line", "message"),
    [
        ('backend = "numpy"', 'backend = "nump"', 13, "setting 'gpu': unknown backend 'nump'"),
        ("work_bytes = 1", "work_bytes = 0", 14, "setting 'gpu': .*work_bytes must be positive"),
        ('type = "F32"', 'type = "F23"', 6, "variant 'F23': type 'F23' is not a file type"),
        ('name = "p"', 'name = "p"\nbits = 4', 18, r"\[\[prompt\]\] #1: unknown key 'bits'"),
    ],
)
def test_a_declarations_error_names_its_line(tmp_path, old, new, line, message):
    path = tmp_path / "s.toml"
    path.write_text(STUDY_WITH_A_TYPO)
    assert load_study(path).setting("gpu").options["work_bytes"] == 1  # as it should be
    path.write_text(STUDY_WITH_A_TYPO.replace(old, new))
    with pytest.raises(StudyError, match=f"^{re.escape(str(path))}:{line}: {message}"):
        load_study(path)


def test_a_file_that_is_not_a_study_is_refused(tmp_path):
    with pytest.raises(StudyError, match="cannot read the study"):
        load_study(tmp_path / "missing.toml")
    (tmp_path / "bad.toml").write_text("name = [")
    with pytest.raises(StudyError, match="not valid TOML"):
        load_study(tmp_path / "bad.toml")
    (tmp_path / "nameless.toml").write_text("model = 'm.gguf'")
    with pytest.raises(StudyError, match='needs name = "..."'):
        load_study(tmp_path / "nameless.toml")
