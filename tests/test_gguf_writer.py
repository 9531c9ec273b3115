"""Write then read gives the same metadata and bytes; a failed write leaves nothing behind."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from qllama import quants
from qllama.ggml_types import ValueType
from qllama.gguf.reader import GGUFValue, read_gguf
from qllama.gguf.writer import GGUFWriter

SCALARS = {
    ValueType.UINT8: st.integers(0, 2**8 - 1),
    ValueType.INT8: st.integers(-(2**7), 2**7 - 1),
    ValueType.UINT16: st.integers(0, 2**16 - 1),
    ValueType.INT16: st.integers(-(2**15), 2**15 - 1),
    ValueType.UINT32: st.integers(0, 2**32 - 1),
    ValueType.INT32: st.integers(-(2**31), 2**31 - 1),
    ValueType.UINT64: st.integers(0, 2**64 - 1),
    ValueType.INT64: st.integers(-(2**63), 2**63 - 1),
    ValueType.FLOAT32: st.floats(width=32, allow_nan=False),
    ValueType.FLOAT64: st.floats(allow_nan=False),
    ValueType.BOOL: st.booleans(),
    ValueType.STRING: st.text(max_size=20),
}
DTYPES = {
    ValueType.UINT8: np.uint8,
    ValueType.INT8: np.int8,
    ValueType.UINT16: np.uint16,
    ValueType.INT16: np.int16,
    ValueType.UINT32: np.uint32,
    ValueType.INT32: np.int32,
    ValueType.UINT64: np.uint64,
    ValueType.INT64: np.int64,
    ValueType.FLOAT32: np.float32,
    ValueType.FLOAT64: np.float64,
    ValueType.BOOL: np.bool_,
}


@st.composite
def values(draw) -> GGUFValue:
    vtype = draw(st.sampled_from([*SCALARS, ValueType.ARRAY]))
    if vtype != ValueType.ARRAY:
        return GGUFValue(vtype, draw(SCALARS[vtype]))
    elem = draw(st.sampled_from(list(SCALARS)))
    items = draw(st.lists(SCALARS[elem], max_size=8))
    if elem == ValueType.STRING:
        return GGUFValue(vtype, items, elem)
    return GGUFValue(vtype, np.array(items, dtype=DTYPES[elem]), elem)


@settings(
    max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(
    kv=st.dictionaries(st.text(min_size=1, max_size=12), values(), max_size=8),
    alignment=st.sampled_from([1, 8, 32, 64]),
)
def test_metadata_roundtrip(tmp_path, kv, alignment):
    w = GGUFWriter(alignment=alignment)
    for k, v in kv.items():
        if k != "general.alignment":
            w.add(k, v)
    w.add_tensor("t", np.arange(5, dtype=np.float32), "F32")
    w.write(tmp_path / "m.gguf")
    f = read_gguf(tmp_path / "m.gguf")
    assert f.kv == w.kv
    assert f.alignment == alignment
    np.testing.assert_array_equal(f.tensor_data("t").view("<f4"), np.arange(5))


def test_every_tensor_type_roundtrips(tmp_path):
    rng = np.random.default_rng(0)
    w = GGUFWriter()
    stored = {}
    for name in quants.supported():
        x = rng.standard_normal((3, 512), dtype=np.float32)
        needs = quants.get(name).imatrix_use == "required"
        stored[name] = quants.quantize(x, name, imatrix=np.ones(512, np.float32) if needs else None)
        w.add_tensor(f"w.{name}", stored[name], name, (3, 512))
    w.add_tensor("zero", np.zeros((0, 4), np.float32), "F32")
    w.write(tmp_path / "all.gguf")
    f = read_gguf(tmp_path / "all.gguf")
    for name, raw in stored.items():
        t = f.tensor(f"w.{name}")
        assert t.ggml_type.name == name and t.shape == (3, 512) and t.ne == (512, 3)
        np.testing.assert_array_equal(f.tensor_data(t.name), raw.ravel())
    assert f.tensor("zero").shape == (0, 4)


def test_plain_values_get_natural_types(tmp_path):
    w = GGUFWriter()
    w.add("b", True)
    w.add("i", 7)
    w.add("big", 2**40)
    w.add("f", 0.5)
    w.add("s", "héllo")
    w.add("ss", ["a", "b"])
    w.add("arr", np.array([1, 2], np.int16))
    w.write(tmp_path / "v.gguf")
    kv = read_gguf(tmp_path / "v.gguf").kv
    assert [kv[k].type.name for k in ("b", "i", "big", "f", "s")] == [
        "BOOL",
        "INT32",
        "INT64",
        "FLOAT32",
        "STRING",
    ]
    assert kv["ss"].elem_type == ValueType.STRING and kv["arr"].elem_type == ValueType.INT16


def test_gguf_py_reads_what_we_write(tmp_path):
    gguf = pytest.importorskip("gguf")
    w = GGUFWriter()
    w.add("general.architecture", "llama")
    w.add("n", GGUFValue(ValueType.UINT32, 30))
    w.add_tensor("x", np.arange(64, dtype=np.float32).reshape(2, 32), "F32")
    w.add_tensor("q", quants.quantize(np.ones((2, 32)), "Q8_0"), "Q8_0", (2, 32))
    w.write(tmp_path / "g.gguf")
    r = gguf.GGUFReader(tmp_path / "g.gguf")
    assert r.fields["n"].contents() == 30
    assert r.fields["general.architecture"].contents() == "llama"
    assert [t.name for t in r.tensors] == ["x", "q"]
    np.testing.assert_array_equal(r.tensors[0].data, np.arange(64, dtype=np.float32).reshape(2, 32))


def test_failed_write_leaves_no_file(tmp_path):
    out = tmp_path / "out.gguf"
    out.write_bytes(b"old")

    def boom() -> np.ndarray:
        raise RuntimeError("interrupted")

    w = GGUFWriter()
    w.add_tensor("a", np.zeros(8, np.float32), "F32")
    w.add_tensor("b", boom, "F32", (8,))
    with pytest.raises(RuntimeError, match="interrupted"):
        w.write(out)
    assert out.read_bytes() == b"old"
    assert [p.name for p in tmp_path.iterdir()] == ["out.gguf"]


def test_wrong_sized_data_is_refused(tmp_path):
    w = GGUFWriter()
    w.add_tensor("a", np.zeros(10, np.uint8), "Q8_0", (32,))
    with pytest.raises(
        ValueError, match=r"tensor 'a' \(Q8_0 \[32\]\) needs 34 bytes, its data has 10"
    ):
        w.write(tmp_path / "x.gguf")
    with pytest.raises(ValueError, match="not a multiple of the Q4_K block size 256"):
        w.add_tensor("b", np.zeros(10, np.uint8), "Q4_K", (100,))
