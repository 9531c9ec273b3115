"""The reader against every malformed-container case of docs/security.md (sections A-D).

Each case names the checklist item it covers. Every failure must be one qllama error class
with a message that names the field, the offset, the value and the limit.
"""

from __future__ import annotations

import os
import struct
import tracemalloc

import numpy as np
import pytest
from gguf_bytes import Gguf, kv, kv_str, kv_u32, s, tensor_info, valid_file

from qllama import errors
from qllama.errors import (
    GGUFDuplicateError,
    GGUFFormatError,
    GGUFLayoutError,
    GGUFLimitError,
    GGUFMagicError,
    GGUFOpenError,
    GGUFTruncatedError,
    GGUFTypeError,
    GGUFVersionError,
    QllamaError,
    TensorShapeError,
)
from qllama.ggml_types import GGMLType
from qllama.gguf import reader as gr
from qllama.gguf.reader import GGUFFile, read_gguf

ARRAY, STRING, UINT8, BOOL, INT32 = 9, 8, 0, 7, 5


def parse(b: bytes) -> GGUFFile:
    return GGUFFile.from_buffer(b)


def one_tensor(ne, ggml_type=0, offset=0, data=None, **kw) -> bytes:
    n = int(np.prod(ne, dtype=object)) if ne else 1
    data = b"\0" * (4 * n) if data is None else data
    return Gguf(infos=[tensor_info("t", ne, ggml_type, offset)], data=data, **kw).bytes()


# --- A. container and header -----------------------------------------------------------------


def test_valid_file_parses():
    f = parse(valid_file())
    assert f.version == 3 and f.alignment == 32
    assert f.get("general.architecture") == "llama"
    assert f.get("tokenizer.ggml.tokens") == ["a", "b"]
    assert f.tensor("q").shape == (1, 32) and f.tensor("q").ggml_type.name == "Q8_0"
    np.testing.assert_array_equal(f.tensor_data("f").view("<f4"), np.arange(8))


@pytest.mark.parametrize("n", [0, 1, 4, 23])
def test_A1_short_file(tmp_path, n):
    p = tmp_path / "short.gguf"
    p.write_bytes(valid_file()[:n])
    with pytest.raises(GGUFTruncatedError, match=f"header needs 24 bytes, .* has {n}"):
        read_gguf(p)
    with pytest.raises(GGUFTruncatedError, match="header at offset 0 needs 24 bytes"):
        parse(valid_file()[:n])


def test_A2_every_prefix_is_truncated():
    full = valid_file()
    sections = set()
    for cut in range(len(full)):
        with pytest.raises(GGUFTruncatedError) as e:
            parse(full[:cut])
        sections.add(str(e.value).split(" at offset")[0].split(" spans")[0])
    parse(full)
    # the cuts land in every section of the file
    text = " | ".join(sorted(sections))
    for part in (
        "header",
        "array length of key",
        "name of tensor",
        "type of tensor",
        "data of tensor 'f'",
    ):
        assert part in text, part


@pytest.mark.parametrize("magic", [b"GGML", b"FUGG", b"\x00\x01\x02\x03"])
def test_A3_bad_magic(magic):
    with pytest.raises(GGUFMagicError, match="expected 'GGUF'") as e:
        parse(Gguf(magic=magic).bytes())
    assert magic.hex() in str(e.value)
    assert "\x00" not in str(e.value)


@pytest.mark.parametrize("version", [0, 1, 4, 99])
def test_A4_unsupported_version(version):
    with pytest.raises(GGUFVersionError, match=f"version {version} unsupported; supported 2..3"):
        parse(Gguf(version=version).bytes())


def test_A4_byte_swapped_version():
    with pytest.raises(GGUFVersionError, match="byte-swapped"):
        parse(Gguf(version=0x03000000).bytes())


@pytest.mark.parametrize("field", ["n_kv", "n_tensors"])
@pytest.mark.parametrize("value", [2**63, 2**64 - 1])
def test_A5_negative_counts(field, value):
    with pytest.raises(GGUFLimitError, match=r"count at offset (8|16) is -\d+, below 0"):
        parse(Gguf(**{field: value}).bytes())


@pytest.mark.parametrize("field", ["n_kv", "n_tensors"])
@pytest.mark.parametrize("value", [2**62, 2**32, 1000])
def test_A5_counts_larger_than_the_file(field, value):
    tracemalloc.start()
    with pytest.raises(GGUFLimitError, match="bytes after the header"):
        parse(Gguf(**{field: value}).bytes())
    _, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    assert peak < 1 << 20  # rejected before any per-entry work


def test_A6_empty_file_and_zero_dim_tensor_parse():
    f = parse(Gguf().bytes())
    assert len(f) == 0 and not f.kv
    f = parse(one_tensor([0, 4]))
    assert f.tensor("t").shape == (4, 0) and f.tensor_data("t").size == 0


def test_A7_embedded_at_an_offset():
    full = valid_file()
    f = parse(full)
    g = GGUFFile.from_buffer(b"junk123" + full, start=7)
    assert g.data_offset == f.data_offset + 7
    for name in f.tensors:
        assert g.tensor(name) == f.tensor(name)
        np.testing.assert_array_equal(g.tensor_data(name), f.tensor_data(name))


def test_A8_directory_fifo_missing_and_unreadable(tmp_path):
    with pytest.raises(GGUFOpenError, match="is a directory") as e:
        read_gguf(tmp_path)
    assert isinstance(e.value, OSError) and isinstance(e.value, QllamaError)
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    with pytest.raises(GGUFOpenError, match="not a regular file"):
        read_gguf(fifo)  # must not block on open
    with pytest.raises(GGUFOpenError, match="No such file"):
        read_gguf(tmp_path / "missing.gguf")
    locked = tmp_path / "locked.gguf"
    locked.write_bytes(valid_file())
    locked.chmod(0)
    if os.access(locked, os.R_OK):
        pytest.skip("running as root: permissions are not enforced")
    with pytest.raises(GGUFOpenError, match="Permission denied"):
        read_gguf(locked)


# --- B. metadata ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("length", "error", "message"),
    [
        (2**63, GGUFLimitError, "has length 9223372036854775808, over the limit"),
        (2**64 - 1, GGUFLimitError, "over the limit"),
        (1000, GGUFTruncatedError, "needs 1000 bytes but the file has"),
    ],
)
def test_B9_string_length(length, error, message):
    bad = s("k") + struct.pack("<iQ", STRING, length) + b"abc"
    tracemalloc.start()
    with pytest.raises(error, match=message):
        parse(Gguf(kvs=[bad]).bytes())
    assert tracemalloc.get_traced_memory()[1] < 1 << 20
    tracemalloc.stop()


def test_B10_string_over_the_cap_that_fits_in_the_file(monkeypatch):
    monkeypatch.setattr(gr, "MAX_STRING_BYTES", 16)
    with pytest.raises(
        GGUFLimitError, match="value of key 'k' at offset 37 has length 17, over the limit of 16"
    ):
        parse(Gguf(kvs=[kv_str("k", "x" * 17)]).bytes())
    parse(Gguf(kvs=[kv_str("k", "x" * 16)]).bytes())


def test_B11_huge_array_count_is_rejected_at_once():
    bad = s("k") + struct.pack("<iiQ", ARRAY, UINT8, 2**62) + b"\0" * 8
    tracemalloc.start()
    with pytest.raises(GGUFLimitError, match="has 4611686018427387904 elements, over the limit"):
        parse(Gguf(kvs=[bad]).bytes())
    assert tracemalloc.get_traced_memory()[1] < 1 << 20
    tracemalloc.stop()


@pytest.mark.parametrize(("elem", "size"), [(UINT8, 1), (12, 8), (STRING, 8)])
def test_B11_array_larger_than_the_file(elem, size):
    bad = s("k") + struct.pack("<iiQ", ARRAY, elem, 100) + b"\0" * (100 * size - 1)
    with pytest.raises(GGUFTruncatedError, match=f"declares 100 elements of at least {size} bytes"):
        parse(Gguf(kvs=[bad]).bytes())


def test_B11_empty_and_exact_arrays_parse():
    empty = kv("e", ARRAY, struct.pack("<iQ", UINT8, 0))
    exact = kv("x", ARRAY, struct.pack("<iQ", UINT8, 5) + b"\x01\x02\x03\x04\x05")
    f = parse(Gguf(kvs=[empty, exact]).bytes())
    assert f.get("e").size == 0
    assert f.get("x").tolist() == [1, 2, 3, 4, 5]


@pytest.mark.parametrize("depth", [2, 5000])
def test_B12_nested_arrays(depth):
    payload = struct.pack("<i", ARRAY) * depth + struct.pack("<iQ", UINT8, 0)
    with pytest.raises(
        GGUFTypeError,
        match=r"key 'k' at offset 37 is an array of arrays \(nested arrays unsupported\)",
    ):
        parse(Gguf(kvs=[s("k") + struct.pack("<i", ARRAY) + payload]).bytes())


@pytest.mark.parametrize("code", [13, 99, -1])
def test_B13_unknown_value_type(code):
    with pytest.raises(GGUFTypeError, match=f"key 'k' at offset 33 has unknown value type {code}"):
        parse(Gguf(kvs=[kv("k", code, b"\0" * 8)]).bytes())
    with pytest.raises(GGUFTypeError, match=f"array of key 'k' .* unknown value type {code}"):
        parse(Gguf(kvs=[kv("k", ARRAY, struct.pack("<iQ", code, 1) + b"\0" * 8)]).bytes())


@pytest.mark.parametrize(
    ("key", "message"),
    [
        (b"", "is empty"),
        (b"\xff\xfe", "not valid UTF-8"),
        (b"k" * 65536, "over the limit of 65535"),
    ],
)
def test_B14_bad_keys(key, message):
    with pytest.raises(GGUFFormatError, match=message):
        parse(Gguf(kvs=[kv(key, 4, b"\0" * 4)]).bytes())


def test_B14_bad_utf8_value():
    with pytest.raises(GGUFFormatError, match="value of key 'k' at offset 37 is not valid UTF-8"):
        parse(Gguf(kvs=[kv("k", STRING, s(b"ok\xc3"))]).bytes())


def test_B15_duplicate_key():
    with pytest.raises(GGUFDuplicateError, match="duplicate key 'a' at offsets 24 and 41"):
        parse(Gguf(kvs=[kv_u32("a", 1), kv_u32("a", 2)]).bytes())


def test_B16_bool_must_be_0_or_1():
    assert parse(Gguf(kvs=[kv("b", BOOL, b"\x01")]).bytes()).get("b") is True
    with pytest.raises(GGUFFormatError, match="is a bool of value 2, not 0 or 1"):
        parse(Gguf(kvs=[kv("b", BOOL, b"\x02")]).bytes())
    with pytest.raises(GGUFFormatError, match="element 1 of bool array 'b' .* is 7, not 0 or 1"):
        parse(Gguf(kvs=[kv("b", ARRAY, struct.pack("<iQ", BOOL, 2) + b"\x01\x07")]).bytes())


def test_B17_alignment_default_and_custom():
    assert parse(Gguf().bytes()).alignment == 32
    for a in (1, 64):
        g = Gguf(
            kvs=[kv_u32("general.alignment", a)], infos=[tensor_info("t", [8], 0, 0)], alignment=a
        )
        g.data = b"\0" * 32
        assert parse(g.bytes()).alignment == a


def test_B17_alignment_errors():
    with pytest.raises(
        GGUFTypeError, match="'general.alignment' must be of type UINT32, not INT32"
    ):
        parse(Gguf(kvs=[kv("general.alignment", INT32, struct.pack("<i", 32))]).bytes())
    for a in (0, 3, 24):
        with pytest.raises(GGUFLayoutError, match=f"alignment is {a}, not a power of two"):
            parse(Gguf(kvs=[kv_u32("general.alignment", a)]).bytes())
    with pytest.raises(GGUFLimitError, match="alignment is 1073741824, over the limit of 1048576"):
        parse(Gguf(kvs=[kv_u32("general.alignment", 2**30)]).bytes())


# --- C. tensor info ---------------------------------------------------------------------------


@pytest.mark.parametrize("n_dims", [5, 10**6, 2**32 - 1])
def test_C18_too_many_dims(n_dims):
    info = tensor_info("t", [1], 0, 0, n_dims=n_dims)
    with pytest.raises(
        GGUFLimitError, match=f"tensor 't' at offset 33 has n_dims {n_dims}, over the limit of 4"
    ):
        parse(Gguf(infos=[info], data=b"\0" * 64).bytes())


def test_C19_negative_dim():
    with pytest.raises(
        GGUFLayoutError, match="dimension 1 of tensor 't' at offset 45 is -1, below 0"
    ):
        parse(one_tensor([4, 2**64 - 1], data=b"\0" * 64))


@pytest.mark.parametrize(
    "ne", [[4194305, 4194305, 211106198978564], [2**32, 2**32], [4 * (2**31 - 1)] * 4]
)
def test_C20_element_count_overflow(ne):
    with pytest.raises(GGUFLimitError, match="elements, over the int64 limit"):
        parse(one_tensor(ne, data=b""))


def test_C21_byte_size_overflow_and_past_the_file():
    with pytest.raises(GGUFLimitError, match="bytes of data, over the int64 limit"):
        parse(one_tensor([2**62], data=b""))  # 2**62 elements fit, 2**64 bytes do not
    with pytest.raises(GGUFTruncatedError, match="data of tensor 't' spans bytes"):
        parse(one_tensor([2**40], data=b"\0" * 64))


# past the last type ggml defines, far past it, negative, and a code ggml retired
@pytest.mark.parametrize("code", [max(GGMLType) + 1, 999, -1, 4])
def test_C22_unknown_tensor_type(code):
    with pytest.raises(GGUFTypeError, match=f"tensor 't' at offset .* unknown GGML type {code}"):
        parse(one_tensor([32], ggml_type=code))


def test_C22_valid_but_unsupported_type_reads_then_refuses():
    from qllama import quants

    f = parse(one_tensor([256], ggml_type=28, data=b"\0" * 2048))  # F64
    t = f.tensor("t")
    assert t.ggml_type.name == "F64" and t.nbytes == 2048
    with pytest.raises(
        errors.UnsupportedTensorTypeError, match="F64 is valid but qllama does not support it"
    ):
        quants.dequantize(f.tensor_data("t"), t.ggml_type, t.shape)


@pytest.mark.parametrize(("code", "ne0", "block"), [(2, 33, 32), (12, 100, 256)])
def test_C23_row_not_a_multiple_of_the_block(code, ne0, block):
    with pytest.raises(
        TensorShapeError, match=f"rows of {ne0} elements, not a multiple of its block size {block}"
    ):
        parse(one_tensor([ne0], ggml_type=code))


def test_C24_tensor_names():
    two = [tensor_info("t", [8], 0, 0), tensor_info("t", [8], 0, 32)]
    with pytest.raises(GGUFDuplicateError, match="duplicate tensor name 't'"):
        parse(Gguf(infos=two, data=b"\0" * 64).bytes())
    with pytest.raises(GGUFFormatError, match="name of tensor 0 at offset 24 is empty"):
        parse(Gguf(infos=[tensor_info("", [8], 0, 0)], data=b"\0" * 32).bytes())
    with pytest.raises(GGUFLimitError, match="is 64 bytes, over the limit of 63"):
        parse(Gguf(infos=[tensor_info("n" * 64, [8], 0, 0)], data=b"\0" * 32).bytes())
    parse(Gguf(infos=[tensor_info("n" * 63, [8], 0, 0)], data=b"\0" * 32).bytes())


# --- D. data layout ---------------------------------------------------------------------------


def test_D25_misaligned_offset():
    with pytest.raises(
        GGUFLayoutError, match="tensor 't' has offset 4, not a multiple of the alignment 32"
    ):
        parse(one_tensor([8], offset=4, data=b"\0" * 64))


@pytest.mark.parametrize("offset", [2**20, 2**64 - 32])
def test_D26_offset_past_the_end(offset):
    with pytest.raises(GGUFLayoutError, match=f"tensor 't' has offset {offset}, expected 0"):
        parse(one_tensor([8], offset=offset))


@pytest.mark.parametrize("second", [0, 32, 96])
def test_D27_overlap_or_gap(second):
    infos = [tensor_info("a", [16], 0, 0), tensor_info("b", [8], 0, second)]
    with pytest.raises(GGUFLayoutError, match=f"tensor 'b' has offset {second}, expected 64"):
        parse(Gguf(infos=infos, data=b"\0" * 256).bytes())


def test_D28_data_one_byte_short():
    with pytest.raises(
        GGUFTruncatedError, match=r"data of tensor 'f' spans bytes \[\d+, \d+\) but the file ends"
    ):
        parse(valid_file()[:-1])


# --- global contract --------------------------------------------------------------------------


def test_failed_reads_leave_no_open_file(tmp_path, open_files):
    p = tmp_path / "bad.gguf"
    p.write_bytes(valid_file()[:-1])
    before = open_files(p)
    for _ in range(20):
        with pytest.raises(GGUFTruncatedError):
            read_gguf(p)
    assert open_files(p) == before


def test_views_are_read_only_and_zero_copy(tmp_path):
    p = tmp_path / "ok.gguf"
    p.write_bytes(valid_file())
    f = read_gguf(p)
    v = f.tensor_data("q")
    assert not v.flags.writeable and not v.flags.owndata
    with pytest.raises(ValueError):
        v[0] = 1
    f.close()  # views still alive: the map stays valid until they go
    assert v[2] == 0


def test_agrees_with_gguf_py_on_a_valid_file(tmp_path):
    gguf = pytest.importorskip("gguf")
    p = tmp_path / "ok.gguf"
    p.write_bytes(valid_file())
    ours, theirs = read_gguf(p), gguf.GGUFReader(p)
    assert [t.name for t in theirs.tensors] == list(ours.tensors)
    for t in theirs.tensors:
        assert tuple(int(d) for d in t.shape) == ours.tensor(t.name).ne
        np.testing.assert_array_equal(
            np.asarray(t.data).view(np.uint8).ravel(), ours.tensor_data(t.name)
        )
    assert theirs.fields["general.architecture"].contents() == ours.get("general.architecture")
