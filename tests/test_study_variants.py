"""A study's files (qllama/study/variants.py): quantized with an importance matrix, given as a
file or computed from a corpus as llama-imatrix does, cached, and part of the cells' keys."""

from __future__ import annotations

import pytest

from qllama.gguf.imatrix import write_imatrix
from qllama.gguf.quantizer import quantize_file
from qllama.measure.importance import from_corpus
from qllama.model_files import sha256_file
from qllama.study import StudyError
from qllama.study.declaration import Variant, from_dict
from qllama.study.variants import build
from qllama.synthetic import TinyConfig, write_tiny_llama

# byte-level BPE: about a token a character; two windows of 512 need 1,024
TEXT = " ".join(f"Line {i}: the tide is {'low' if i % 4 else 'high'} at noon." for i in range(90))


@pytest.fixture
def folder(tmp_path, monkeypatch):
    monkeypatch.setenv("QLLAMA_CACHE", str(tmp_path / "cache"))
    write_tiny_llama(tmp_path / "tiny.gguf", TinyConfig(n_ctx=1024))
    (tmp_path / "calib.txt").write_text(TEXT)
    return tmp_path


def study_with(folder, **variant):
    doc = {
        "name": "t",
        "model": "tiny.gguf",
        "measures": ["last_position"],
        "reference": {"kind": "qllama"},
        "variant": [{"type": "F32"}, {"type": "Q4_0"}, {"name": "Q4_0-imatrix", **variant}],
        "setting": [{"name": "cpu"}],
        "prompt": [{"name": "p", "text": "hello"}],
    }
    return from_dict(doc, folder)


def test_a_variant_computed_from_a_corpus_is_llama_quantize_with_llama_imatrix(folder, monkeypatch):
    study = study_with(folder, type="Q4_0", imatrix_corpus="calib.txt", imatrix_chunks=2)
    v = study.variant("Q4_0-imatrix")
    assert v.imatrix_corpus == str(folder / "calib.txt")  # the declaration's folder
    got = build(study.model_source(), v)
    plain = build(study.model_source(), study.variant("Q4_0"))
    f32 = build(study.model_source(), study.variant("F32"))
    assert "imatrix" in got.path and got.sha256 != plain.sha256
    # the same steps by hand: the matrix of the F32 file over the text, then the quantizer,
    # run where the matrix is, given its file name (what the variant records, on any machine)
    (cached,) = (folder / "cache" / "study-variants").glob("*/imatrix-*.gguf")
    hand = folder / "hand" / cached.name
    hand.parent.mkdir()
    monkeypatch.chdir(hand.parent)
    write_imatrix(hand, from_corpus(f32.path, TEXT, n_chunks=2, dataset="calib.txt"))
    assert sha256_file(hand) == sha256_file(cached)
    quantize_file(f32.path, folder / "by-hand-q4.gguf", "Q4_0", imatrix=cached.name)
    assert sha256_file(folder / "by-hand-q4.gguf") == got.sha256
    # built once: a second build finds the matrix and the file in the cache
    before = cached.stat().st_mtime_ns
    assert build(study.model_source(), v) == got
    assert cached.stat().st_mtime_ns == before


def test_a_variant_with_an_imatrix_file(folder):
    f32 = build(folder / "tiny.gguf", Variant("F32"))
    write_imatrix(folder / "m.gguf", from_corpus(f32.path, TEXT, n_chunks=2))
    study = study_with(folder, type="Q4_0", imatrix="m.gguf")
    got = build(study.model_source(), study.variant("Q4_0-imatrix"))
    # llama-quantize run in the declaration's folder, given "m.gguf"
    quantize_file(
        f32.path, folder / "by-hand.gguf", "Q4_0", imatrix=folder / "m.gguf", imatrix_name="m.gguf"
    )
    assert got.sha256 == sha256_file(folder / "by-hand.gguf")


@pytest.mark.parametrize(
    ("variant", "message"),
    [
        ({"type": "Q4_0", "imatrix": "m.dat", "imatrix_corpus": "corpus:botchan"}, "not both"),
        ({"type": "Q4_0", "imatrix": "m.dat", "imatrix_chunks": 3}, "imatrix_chunks"),
        ({"type": "Q4_0", "imatrix_corpus": "calib.txt", "imatrix_chunks": 0}, "imatrix_chunks"),
    ],
)
def test_bad_imatrix_variants_are_refused(folder, variant, message):
    with pytest.raises(StudyError, match=message):
        study_with(folder, **variant)


def test_a_missing_imatrix_file_or_an_f32_variant_is_refused(folder):
    study = study_with(folder, type="Q4_0", imatrix="nowhere.gguf")
    with pytest.raises(StudyError, match="no imatrix file"):
        build(study.model_source(), study.variant("Q4_0-imatrix"))
    study = study_with(folder, type="F32", imatrix_corpus="calib.txt")
    with pytest.raises(StudyError, match="needs a quantized type"):
        build(study.model_source(), study.variant("Q4_0-imatrix"))


def test_an_f32_source_is_its_own_f32_variant(folder):
    # no second copy of an F32 model in the cache: the file itself is the F32 variant
    source = folder / "tiny.gguf"
    built = build(source, Variant("F32"))
    assert built.path == str(source) and built.sha256 == sha256_file(source)
    assert not list((folder / "cache").rglob("*.F32.gguf"))
    q8 = build(source, Variant("Q8_0"))  # quantized from it, into the cache
    assert str(folder / "cache") in q8.path


def test_a_variant_with_its_file_is_that_file(folder):
    # a file made already (a recipe's): measured as it is, nothing built into the cache
    made = folder / "made.gguf"
    quantize_file(folder / "tiny.gguf", made, "Q4_0")
    study = study_with(folder, type="Q4_0", file="made.gguf")
    v = study.variant("Q4_0-imatrix")
    assert v.file == str(made)  # relative to the declaration's folder
    got = build(study.model_source(), v)
    assert got.path == str(made) and got.sha256 == sha256_file(made)
    assert not list((folder / "cache").rglob("*.gguf"))
    made.unlink()
    with pytest.raises(StudyError, match="no file"):
        build(study.model_source(), v)


def test_a_variant_with_tensor_types_is_llama_quantize_with_those_overrides(folder):
    from qllama.gguf.quantizer import Overrides
    from qllama.gguf.reader import read_gguf
    from qllama.study.declaration import to_toml

    types = [r"^blk\.0\.attn_q\.weight$=q8_0", r"^blk\.1\.ffn_up\.weight$=q5_0"]
    study = study_with(folder, type="Q4_0", tensor_types=types)
    v = study.variant("Q4_0-imatrix")
    assert v.tensor_types == tuple(types)  # a TOML array, kept as the frozen field's tuple
    assert r'tensor_types = ["^blk\\.0' in to_toml(study)
    got = build(study.model_source(), v)
    assert "-overrides-" in got.path
    with read_gguf(got.path) as f:
        assert f.tensors["blk.0.attn_q.weight"].ggml_type.name == "Q8_0"
        assert f.tensors["blk.1.ffn_up.weight"].ggml_type.name == "Q5_0"
        assert f.tensors["blk.1.attn_q.weight"].ggml_type.name == "Q4_0"
    f32 = build(study.model_source(), study.variant("F32"))
    quantize_file(f32.path, folder / "hand.gguf", "Q4_0", overrides=Overrides.parse(types))
    assert sha256_file(folder / "hand.gguf") == got.sha256
    with pytest.raises(StudyError, match="is no pattern"):
        study_with(folder, type="Q4_0", tensor_types=["blk.(=q8_0"])
    with pytest.raises(StudyError, match="tensor_types need a quantized type"):
        study_with(folder, type="F32", tensor_types=types)
