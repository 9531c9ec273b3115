"""qllama's quantizer against llama.cpp's own, whole file, byte for byte.

Both quantize the same F32 SmolLM2 file; every file type must give the same bytes: the same
metadata in the same order, the same type per tensor, the same tensor bytes. Without an
importance matrix llama.cpp runs through llama-cpp-python (``llama_model_quantize``); with one
through the ``llama-quantize`` tool (``--llama-bin``), which also reads the imatrix file
itself and records it in the metadata. Where llama.cpp refuses a file type (an IQ1/IQ2 type
without an imatrix, Q1_0's 128-blocks on 576-wide rows), qllama must refuse it too.
"""

from __future__ import annotations

import pytest
from quantize_pair import llama_quantize, llama_quantize_tool, ours_or_refusal, random_imatrix

from qllama.gguf.quantizer import FILE_TYPES
from qllama.gguf.reader import read_gguf
from qllama.model_files import variant

llama_cpp = pytest.importorskip("llama_cpp")
pytestmark = [pytest.mark.peers, pytest.mark.model]

LABELS = [label for label in FILE_TYPES if label != "F32"]


@pytest.fixture(scope="module")
def f32_file():
    return variant("smollm2-135m-instruct", "F32")


@pytest.fixture(scope="module")
def imatrix_files(f32_file, tmp_path_factory):
    """A random importance matrix for SmolLM2's weights, in both formats."""
    return random_imatrix(f32_file, tmp_path_factory.mktemp("imatrix"))


def assert_same_file(ours, theirs, label: str) -> None:
    a, b = read_gguf(ours), read_gguf(theirs)
    assert list(a.kv) == list(b.kv)
    assert a.kv == b.kv
    assert [(t.name, t.ggml_type) for t in a] == [(t.name, t.ggml_type) for t in b]
    for t in a:
        assert (a.tensor_data(t.name) == b.tensor_data(t.name)).all(), f"{label}: {t.name} differs"
    assert ours.read_bytes() == theirs.read_bytes()


@pytest.mark.parametrize("label", LABELS)
def test_same_file_as_llama_quantize(f32_file, tmp_path, label):
    ours, theirs = tmp_path / "qllama.gguf", tmp_path / "llama.gguf"
    wrote = ours_or_refusal(f32_file, ours, label)
    assert llama_quantize(f32_file, theirs, FILE_TYPES[label].value) == wrote
    if wrote:
        assert_same_file(ours, theirs, label)


@pytest.mark.parametrize("label", LABELS)
def test_same_file_as_llama_quantize_with_an_imatrix(
    f32_file, imatrix_files, llama_tool, tmp_path, label
):
    ours, theirs = tmp_path / "qllama.gguf", tmp_path / "llama.gguf"
    imatrix = imatrix_files[0]
    wrote = ours_or_refusal(f32_file, ours, label, imatrix)
    assert llama_quantize_tool(llama_tool, f32_file, theirs, label, imatrix) == wrote
    if wrote:
        assert_same_file(ours, theirs, label)


@pytest.mark.parametrize("label", ["Q4_K_M", "IQ4_XS"])
def test_legacy_imatrix_files_quantize_the_same(
    f32_file, imatrix_files, llama_tool, tmp_path, label
):
    ours, theirs = tmp_path / "qllama.gguf", tmp_path / "llama.gguf"
    dat = imatrix_files[1]
    assert ours_or_refusal(f32_file, ours, label, dat)
    assert llama_quantize_tool(llama_tool, f32_file, theirs, label, dat)
    assert_same_file(ours, theirs, label)


# llama-quantize's choices over its mixture: --tensor-type (its counters skip a named tensor),
# the tables' types, --pure
OVERRIDES = [
    ([r"blk\.0\.attn_v=q4_k", "ffn_up=q5_k", r"blk\.1[0-9]\.ffn_down=q8_0"], {}),
    ([], {"token_embedding_type": "q4_0", "output_tensor_type": "q6_k"}),
    (["attn_q=iq4_nl"], {"pure": True}),
]


@pytest.mark.parametrize(("tensor_types", "options"), OVERRIDES)
def test_same_file_as_llama_quantize_with_overrides(
    f32_file, llama_tool, tmp_path, tensor_types, options
):
    from qllama.gguf.quantizer import Overrides, quantize_file

    overrides = Overrides.parse(tensor_types, **options)
    ours, theirs = tmp_path / "qllama.gguf", tmp_path / "llama.gguf"
    quantize_file(f32_file, ours, "Q4_K_M", overrides=overrides)
    run = llama_tool(
        "llama-quantize",
        *overrides.as_arguments(),
        str(f32_file),
        str(theirs),
        "Q4_K_M",
        "2",
        timeout=3600,
    )
    assert run.returncode == 0, run.stderr
    assert_same_file(ours, theirs, "Q4_K_M")


@pytest.mark.parametrize("target", [4.6, 5.4])
def test_a_recipe_is_the_same_file_from_llama_quantize(f32_file, llama_tool, tmp_path, target):
    """A recipe's overrides (qllama recipe: anchored patterns for every quantized tensor, as a
    --tensor-type-file) give llama-quantize the file qllama writes. The cells' costs here are
    made up (a recipe's search and output, not its measurement, are what is compared)."""
    from qllama.measure.sensitivity import Cell, Sensitivities, candidates, groups
    from qllama.recipe import recipe as recipes

    with read_gguf(f32_file) as f:
        gs = groups(f, bands=3)
        changed = {n for g in gs for n in g.tensors}
        fixed = sum(t.nbytes for n, t in f.tensors.items() if n not in changed)
        n_elements = sum(t.n_elements for t in f.tensors.values())
    cells = {
        g.name: {
            t.name: Cell(
                g.name,
                t.name,
                g.nbytes(t),
                (k + 1) * 2.0 ** -(8 * g.nbytes(t) / sum(g.n_elements)),
                0.0,
                1.0,
            )
            for t in candidates(g)
        }
        for k, g in enumerate(gs)
    }
    sens = Sensitivities(str(f32_file), gs, cells, fixed, n_elements)
    recipe = recipes.choose(sens, target)
    ours, theirs = tmp_path / "qllama.gguf", tmp_path / "llama.gguf"
    written = recipes.write(recipe, ours)
    assert len({t.name for t in recipe.types.values()}) > 1  # a mixture, not one type
    run = llama_tool(
        "llama-quantize",
        "--tensor-type-file",
        str(written["tensor_types"]),
        str(f32_file),
        str(theirs),
        recipe.file_type.label,
        "2",
        timeout=3600,
    )
    assert run.returncode == 0, run.stderr
    assert_same_file(ours, theirs, recipe.file_type.label)
