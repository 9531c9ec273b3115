"""Mutation fuzzing of qllama's GGUF loader: hostile bytes end in a QllamaError or a load.

Seeds are tiny valid files written by qllama itself (llama models from
:mod:`qllama.synthetic`, and a container holding every metadata type and many tensor types).
Each case takes a seed and applies one to three mutations drawn by Hypothesis:

- bit flips (anywhere, in the metadata or in the tensor data), and random bytes overwritten,
  inserted or deleted;
- a truncation at any byte or at a section boundary;
- a numeric field of the header, a metadata pair or a tensor info (counts, lengths, value and
  tensor types, dims, offsets, values) set to an edge value {0, 1, 2^31-1, 2^32-1, 2^63-1,
  2^63, 2^64-1}, one of them +-1, a neighbour of its value, or a random value;
- a metadata value replaced by another type or an extreme value (NaN, inf, 0, a huge count,
  a hostile chat template...), a key renamed, a pair added; these keep the data section
  aligned so that the model-level checks are reached;
- a metadata pair or tensor info duplicated, removed or swapped, with or without fixing the
  count in the header;
- NaN or infinity written into a block scale or a float weight.

Every case runs in a worker process under ``RLIMIT_AS`` with a per-case timeout, through
these targets in turn: ``GGUFFile.from_buffer``, ``read_gguf`` on a file, the tokenizer,
``qllama.load``, then a forward pass, two generated tokens and the chat template. Each target
must return or raise a :class:`~qllama.errors.QllamaError`. Anything else (another exception,
MemoryError, RecursionError, a crash, a timeout) is an *escape*: the run stops at the first,
Hypothesis shrinks it, and its bytes are saved for a regression test.

    python fuzz/gguf_mutations.py --cases 20000 --seconds 600 [--seed 0] [--memory-mib 1024]
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import math
import os
import pickle
import resource
import select
import signal
import struct
import subprocess
import sys
import tempfile
import time
import traceback
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

# --- edge values -----------------------------------------------------------------------------

EDGES = (0, 1, 2**31 - 1, 2**32 - 1, 2**63 - 1, 2**63, 2**64 - 1)
EDGE_VALUES = tuple(sorted({e + d for e in EDGES for d in (-1, 0, 1) if 0 <= e + d < 2**64}))
FLOAT_EDGES = (math.nan, math.inf, -math.inf, 0.0, -0.0, -1.0, 1e-45, 3.0e38, 1e-5, 1e4)

# value type id -> struct format (GGUF's enum gguf_type)
SCALAR_FORMATS = {
    0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<B", 10: "<Q", 11: "<q",
    12: "<d",
}  # fmt: skip
STRING, ARRAY = 8, 9

# --- where the fields of a file are ------------------------------------------------------------


@dataclass(frozen=True)
class Field:
    """A numeric field: its byte offset, struct format and role."""

    offset: int
    fmt: str  # "<I", "<q", "<f"...
    kind: str  # "header", "key_len", "value_type", "value", "str_len", "array_type"...

    @property
    def size(self) -> int:
        return struct.calcsize(self.fmt)


@dataclass(frozen=True)
class Span:
    """A metadata pair or tensor info: ``[start, end)`` and its key or name."""

    start: int
    end: int
    name: str


@dataclass(frozen=True)
class TensorSpot:
    """Where a tensor's data starts (absolute), its GGML type id and element count."""

    name: str
    type_code: int
    start: int
    n_elements: int


@dataclass
class Layout:
    """What :func:`walk` found before the bytes stopped making sense."""

    fields: list[Field] = field(default_factory=list)
    kvs: list[Span] = field(default_factory=list)
    infos: list[Span] = field(default_factory=list)
    tensors: list[TensorSpot] = field(default_factory=list)
    meta_end: int | None = None  # end of the tensor infos
    data_offset: int | None = None
    alignment: int = 32


class _Stop(Exception):
    pass


def walk(data: bytes, max_fields: int = 20000) -> Layout:
    """The fields and sections of ``data``, as far as it parses (any bytes are accepted)."""
    lay = Layout()
    pos = 0

    def take(fmt: str, kind: str | None) -> Any:
        nonlocal pos
        size = struct.calcsize(fmt)
        if pos + size > len(data) or len(lay.fields) >= max_fields:
            raise _Stop
        if kind is not None:
            lay.fields.append(Field(pos, fmt, kind))
        (v,) = struct.unpack_from(fmt, data, pos)
        pos += size
        return v

    def string(kind: str) -> bytes:
        nonlocal pos
        n = take("<Q", kind)
        if pos + n > len(data):
            raise _Stop
        pos += n
        return data[pos - n : pos]

    try:
        if data[:4] != b"GGUF":
            raise _Stop
        pos = 4
        take("<I", "header")
        n_tensors = take("<q", "header")
        n_kv = take("<q", "header")
        for _ in range(max(0, min(n_kv, len(data)))):
            start = pos
            key = string("key_len").decode("utf-8", "replace")
            vtype = take("<i", "value_type")
            if vtype == STRING:
                string("str_len")
            elif vtype == ARRAY:
                elem = take("<i", "array_type")
                count = take("<Q", "array_count")
                if elem == STRING:
                    for _ in range(min(count, len(data))):
                        string("elem_len")
                elif elem in SCALAR_FORMATS:
                    pos += count * struct.calcsize(SCALAR_FORMATS[elem])
                else:
                    raise _Stop
            elif vtype in SCALAR_FORMATS:
                value = take(SCALAR_FORMATS[vtype], "value")
                if key == "general.alignment" and vtype == 4 and value and not value & (value - 1):
                    lay.alignment = value
            else:
                raise _Stop
            lay.kvs.append(Span(start, pos, key))
        infos = []
        for _ in range(max(0, min(n_tensors, len(data)))):
            start = pos
            name = string("name_len").decode("utf-8", "replace")
            n_dims = take("<I", "n_dims")
            if n_dims > 8:
                raise _Stop
            ne = [take("<q", "dim") for _ in range(n_dims)]
            code = take("<i", "tensor_type")
            offset = take("<Q", "tensor_offset")
            lay.infos.append(Span(start, pos, name))
            infos.append((name, code, offset, math.prod(ne)))
        lay.meta_end = pos
        lay.data_offset = pos + (-pos % lay.alignment)
        for name, code, offset, n in infos:
            lay.tensors.append(TensorSpot(name, code, lay.data_offset + offset, n))
    except _Stop:
        pass
    return lay


# --- seeds: tiny valid files written by qllama ---------------------------------------------------


def _container_seed(path: Path) -> None:
    """Every metadata value type and array element type, and tensors of many GGML types."""
    import numpy as np

    from qllama import quants
    from qllama.ggml_types import ValueType
    from qllama.gguf.reader import GGUFValue
    from qllama.gguf.writer import GGUFWriter

    rng = np.random.default_rng(0)
    w = GGUFWriter(alignment=64)
    numeric = {
        ValueType.UINT8: np.uint8, ValueType.INT8: np.int8, ValueType.UINT16: np.uint16,
        ValueType.INT16: np.int16, ValueType.UINT32: np.uint32, ValueType.INT32: np.int32,
        ValueType.FLOAT32: np.float32, ValueType.UINT64: np.uint64, ValueType.INT64: np.int64,
        ValueType.FLOAT64: np.float64,
    }  # fmt: skip
    for vt, dtype in numeric.items():
        seven = 7.0 if vt in (ValueType.FLOAT32, ValueType.FLOAT64) else 7
        w.add(f"scalar.{vt.name.lower()}", GGUFValue(vt, seven))
        w.add(f"array.{vt.name.lower()}", np.arange(3, dtype=dtype))
    w.add("scalar.bool", True)
    w.add("array.bool", np.array([True, False]))
    w.add("scalar.string", "qllama")
    w.add("array.string", ["a", "bc", ""])
    w.add("general.architecture", "llama")
    for name, shape in [
        ("F32", (2, 32)), ("F16", (32,)), ("BF16", (1, 32)), ("Q4_0", (1, 32)),
        ("Q4_1", (1, 32)), ("Q5_0", (1, 32)), ("Q5_1", (1, 32)), ("Q8_0", (2, 32)),
        ("Q2_K", (1, 256)), ("Q3_K", (1, 256)), ("Q4_K", (1, 256)), ("Q5_K", (1, 256)),
        ("Q6_K", (1, 256)),
    ]:  # fmt: skip
        x = rng.standard_normal(shape).astype(np.float32)
        w.add_tensor(f"t.{name.lower()}", quants.quantize(x, name), name, shape)
    w.write(path)


def build_seeds() -> dict[str, bytes]:
    """The seed files, by name (a few tens of KB each)."""
    from dataclasses import replace

    from qllama.synthetic import TinyConfig, write_tiny_llama

    small = TinyConfig(n_layer=1, n_embd=32, n_ff=64, n_head=2, n_head_kv=1, n_ctx=64)
    configs = {
        "gpt2-q8_0": replace(small, weight_type="Q8_0"),
        "llama-q4_0-untied": replace(small, weight_type="Q4_0", tied=False, vocab="llama"),
        "gpt2-f16-2-layers": replace(small, n_layer=2, weight_type="F16"),
    }
    seeds = {}
    with tempfile.TemporaryDirectory(prefix="qllama-fuzz-seeds-") as d:
        for name, cfg in configs.items():
            p = Path(d) / f"{name}.gguf"
            write_tiny_llama(p, cfg, seed=1)
            seeds[name] = p.read_bytes()
        p = Path(d) / "container.gguf"
        _container_seed(p)
        seeds["container"] = p.read_bytes()
    return seeds


# --- mutations -------------------------------------------------------------------------------

HOSTILE_TEMPLATES = (
    "{{ ''.__class__.__mro__[1].__subclasses__() }}",
    "{{ cycler.__init__.__globals__.os.popen('id').read() }}",
    "{{ '{0.__class__}'|attr('format')('x') }}",
    "{% for i in range(10**9) %}{% endfor %}",
    "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}",
    "{{ 'a' * 10**10 }}",
    "{% macro m(n) %}{{ m(n + 1) }}{% endmacro %}{{ m(0) }}",
    "{{ raise_exception('x') }}",
    "{% for %}",
    "{{ messages[0]['content'] * 100000 }}",
)


def _pack_str(b: bytes) -> bytes:
    return struct.pack("<Q", len(b)) + b


def _value_pool() -> list[bytes]:
    """Encoded ``type + value`` of many types and extreme values."""
    pool = []
    for code, fmt in SCALAR_FORMATS.items():
        if code in (6, 12):
            pool += [struct.pack("<i", code) + struct.pack(fmt, v) for v in FLOAT_EDGES]
            continue
        bits = struct.calcsize(fmt) * 8
        lo, hi = (-(2 ** (bits - 1)), 2 ** (bits - 1) - 1) if fmt[1].islower() else (0, 2**bits - 1)
        if code == 7:
            lo, hi = 0, 2
        for v in (0, 1, 2, 3, -1, 32, 256, 513, 2**16, 2**24, 2**31 - 1, 2**32 - 1, 2**63 - 1):
            if lo <= v <= hi:
                pool.append(struct.pack("<i", code) + struct.pack(fmt, v))
    strings = [b"", b"llama", b"gpt2", b"mamba", b"llama\0x", b"\xff\xfe", b"smollm", b"klingon"]
    strings += [t.encode() for t in HOSTILE_TEMPLATES]
    pool += [struct.pack("<i", STRING) + _pack_str(s) for s in strings]
    for code, fmt in SCALAR_FORMATS.items():
        pool.append(struct.pack("<iiQ", ARRAY, code, 0))
        pool.append(struct.pack("<iiQ", ARRAY, code, 3) + struct.pack(f"<3{fmt[1]}", 1, 0, 1))
    pool.append(struct.pack("<iiQ", ARRAY, 0, 400) + b"\x01" * 400)
    pool.append(struct.pack("<iiQ", ARRAY, 6, 2) + struct.pack("<2f", math.nan, 1.0))
    for items in ([b"a", b"b"], [b""], [b"a b", b"ab"], [b"<0x-1>"], [b"\xff"]):
        pool.append(
            struct.pack("<iiQ", ARRAY, STRING, len(items)) + b"".join(map(_pack_str, items))
        )
    return pool


VALUE_POOL = _value_pool()
KEY_POOL = (
    "general.architecture", "general.alignment", "llama.block_count", "llama.context_length",
    "llama.embedding_length", "llama.feed_forward_length", "llama.attention.head_count",
    "llama.attention.head_count_kv", "llama.rope.freq_base", "llama.vocab_size",
    "llama.attention.layer_norm_rms_epsilon", "llama.rope.dimension_count",
    "tokenizer.ggml.model", "tokenizer.ggml.pre", "tokenizer.ggml.tokens",
    "tokenizer.ggml.scores", "tokenizer.ggml.token_type", "tokenizer.ggml.merges",
    "tokenizer.ggml.bos_token_id", "tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id",
    "tokenizer.ggml.unknown_token_id", "tokenizer.ggml.add_bos_token", "tokenizer.chat_template",
)  # fmt: skip
# f16 and f32 bit patterns that are not finite
F16_BAD = (b"\x00\x7c", b"\x00\xfc", b"\x00\x7e", b"\xff\x7f")
F32_BAD = (struct.pack("<f", math.inf), struct.pack("<f", -math.inf), struct.pack("<f", math.nan))
# GGML type id -> (block elements, block bytes, byte offsets of the f16 scales in a block)
SCALES = {
    0: (1, 4, ()), 1: (1, 2, (0,)), 2: (32, 18, (0,)), 3: (32, 20, (0, 2)), 6: (32, 22, (0,)),
    7: (32, 24, (0, 2)), 8: (32, 34, (0,)), 10: (256, 84, (80, 82)), 11: (256, 110, (108,)),
    12: (256, 144, (0, 2)), 13: (256, 176, (0, 2)), 14: (256, 210, (208,)),
}  # fmt: skip

Draw = Callable[[Any], Any]


def _position(draw: Draw, n: int) -> int:
    """A byte position in ``[0, n)``, uniform: Hypothesis's integers favour the ends, which
    would put most mutations in the magic."""
    from hypothesis import strategies as st

    return int(draw(st.randoms(use_true_random=False)).randrange(max(1, n)))


def _resize(data: bytes, lay: Layout, start: int, end: int, new: bytes, dkv: int, dt: int) -> bytes:
    """Replace ``data[start:end]`` in the metadata, fix the counts by ``dkv``/``dt``, and
    re-pad so that the data section still starts at an aligned offset."""
    if lay.meta_end is None or lay.data_offset is None or end > lay.meta_end:
        return data[:start] + new + data[end:]
    meta = bytearray(data[:start] + new + data[end : lay.meta_end])
    for at, d in ((8, dt), (16, dkv)):
        if d:
            (n,) = struct.unpack_from("<Q", meta, at)
            struct.pack_into("<Q", meta, at, (n + d) % 2**64)
    return bytes(meta) + b"\0" * (-len(meta) % lay.alignment) + data[lay.data_offset :]


def _op_bitflip(draw: Draw, data: bytes, lay: Layout) -> tuple[bytes, str]:
    from hypothesis import strategies as st

    buf = bytearray(data)
    # in the metadata, in the tensor data (weights go wrong, the file stays valid), anywhere
    where = draw(st.sampled_from(["meta", "data", "any"]))
    low, high = 0, len(buf)
    if where == "meta" and lay.meta_end:
        high = lay.meta_end
    elif where == "data" and lay.data_offset is not None and lay.data_offset < len(buf):
        low = lay.data_offset
    n = draw(st.integers(1, 8))
    flips = [(low + _position(draw, high - low), draw(st.integers(0, 7))) for _ in range(n)]
    for at, bit in flips:
        buf[at] ^= 1 << bit
    return bytes(buf), f"flip {flips}"


def _op_truncate(draw: Draw, data: bytes, lay: Layout) -> tuple[bytes, str]:
    from hypothesis import strategies as st

    marks = [f.offset for f in lay.fields] + [s.end for s in lay.kvs + lay.infos]
    marks += [t.start for t in lay.tensors]
    if marks and draw(st.booleans()):
        cut = draw(st.sampled_from(sorted(set(marks))))
    else:
        cut = _position(draw, len(data))
    return data[:cut], f"truncate at {cut}"


def _op_field(draw: Draw, data: bytes, lay: Layout) -> tuple[bytes, str]:
    from hypothesis import strategies as st

    if not lay.fields:
        return _op_bitflip(draw, data, lay)
    kinds = sorted({f.kind for f in lay.fields})
    kind = draw(st.sampled_from(kinds))  # a kind first, so long string arrays do not dominate
    f = draw(st.sampled_from([f for f in lay.fields if f.kind == kind]))
    if f.fmt[1] in "fd":
        value: Any = draw(st.sampled_from(FLOAT_EDGES))
        new = struct.pack(f.fmt, value)
    else:
        bits = f.size * 8
        (old,) = struct.unpack_from(f.fmt.upper(), data, f.offset)
        how = draw(st.sampled_from(["edge", "near", "random"]))
        if how == "edge":
            value = draw(st.sampled_from(EDGE_VALUES))
        elif how == "near":
            value = old + draw(st.sampled_from([-64, -8, -2, -1, 1, 2, 8, 64, old, -old // 2]))
        else:
            value = draw(st.integers(0, 2**bits - 1))
        new = struct.pack(f.fmt.upper(), value % 2**bits)
    out = data[: f.offset] + new + data[f.offset + f.size :]
    return out, f"{f.kind} at {f.offset} = {value!r}"


def _op_kv_value(draw: Draw, data: bytes, lay: Layout) -> tuple[bytes, str]:
    from hypothesis import strategies as st

    if not lay.kvs:
        return _op_field(draw, data, lay)
    kv = draw(st.sampled_from(lay.kvs))
    value = draw(st.sampled_from(VALUE_POOL))
    new = _pack_str(kv.name.encode()) + value
    return _resize(data, lay, kv.start, kv.end, new, 0, 0), f"value of {kv.name!r} = {value[:24]!r}"


def _op_kv_rename(draw: Draw, data: bytes, lay: Layout) -> tuple[bytes, str]:
    from hypothesis import strategies as st

    if not lay.kvs:
        return _op_field(draw, data, lay)
    kv = draw(st.sampled_from(lay.kvs))
    key_len = struct.unpack_from("<Q", data, kv.start)[0]
    names = [k.encode() for k in KEY_POOL] + [kv.name.encode() + b"x", kv.name.encode()[:-1]]
    names += [b"", b"\xff\xfe", b"k" * 70000]
    name = draw(st.sampled_from(names))
    rest = data[kv.start + 8 + key_len : kv.end]
    new = _pack_str(name) + rest
    return _resize(data, lay, kv.start, kv.end, new, 0, 0), f"rename {kv.name!r} to {name[:40]!r}"


def _op_kv_add(draw: Draw, data: bytes, lay: Layout) -> tuple[bytes, str]:
    from hypothesis import strategies as st

    at = draw(st.sampled_from([s.start for s in lay.kvs] + [s.end for s in lay.kvs] or [24]))
    key = draw(st.sampled_from(KEY_POOL))
    value = draw(st.sampled_from(VALUE_POOL))
    new = _pack_str(key.encode()) + value
    return _resize(data, lay, at, at, new, 1, 0), f"add {key!r} = {value[:24]!r} at {at}"


def _op_section(draw: Draw, data: bytes, lay: Layout) -> tuple[bytes, str]:
    from hypothesis import strategies as st

    which = draw(st.sampled_from(["kv", "tensor"]))
    spans = lay.kvs if which == "kv" else lay.infos
    if not spans:
        return _op_truncate(draw, data, lay)
    s = draw(st.sampled_from(spans))
    how = draw(st.sampled_from(["duplicate", "remove", "swap"]))
    fix = draw(st.booleans())
    d = (1 if how == "duplicate" else -1 if how == "remove" else 0) * fix
    dkv, dt = (d, 0) if which == "kv" else (0, d)
    if how == "duplicate":
        out = _resize(data, lay, s.end, s.end, data[s.start : s.end], dkv, dt)
    elif how == "remove":
        out = _resize(data, lay, s.start, s.end, b"", dkv, dt)
    else:
        t = draw(st.sampled_from(spans))
        if t.start == s.start:
            return data, "swap with itself"
        a, b = sorted([s, t], key=lambda x: x.start)
        swapped = data[b.start : b.end] + data[a.end : b.start] + data[a.start : a.end]
        out = data[: a.start] + swapped + data[b.end :]
    return out, f"{how} {which} {s.name!r} (fix count: {fix})"


def _op_bytes(draw: Draw, data: bytes, lay: Layout) -> tuple[bytes, str]:
    from hypothesis import strategies as st

    at = _position(draw, len(data))
    how = draw(st.sampled_from(["overwrite", "insert", "delete"]))
    n = draw(st.integers(1, 16))
    fill = draw(st.sampled_from([b"\0", b"\xff", None]))
    chunk = fill * n if fill is not None else draw(st.binary(min_size=n, max_size=n))
    if how == "overwrite":
        out = data[:at] + chunk + data[at + n :]
    elif how == "insert":
        out = data[:at] + chunk + data[at:]
    else:
        out = data[:at] + data[at + n :]
    return out, f"{how} {n} bytes at {at}"


def _op_nonfinite(draw: Draw, data: bytes, lay: Layout) -> tuple[bytes, str]:
    from hypothesis import strategies as st

    spots = [t for t in lay.tensors if t.type_code in SCALES and t.n_elements > 0]
    if not spots:
        return _op_bitflip(draw, data, lay)
    t = draw(st.sampled_from(spots))
    per_block, block_bytes, scales = SCALES[t.type_code]
    block = _position(draw, t.n_elements // per_block)
    at = t.start + block * block_bytes
    if t.type_code == 0:
        bad = draw(st.sampled_from(F32_BAD))
    else:
        bad = draw(st.sampled_from(F16_BAD))
        at += draw(st.sampled_from(scales or (0,)))
    if at + len(bad) > len(data):
        return data, "non-finite value past the end (no change)"
    return data[:at] + bad + data[
        at + len(bad) :
    ], f"non-finite {bad!r} in {t.name!r} block {block}"


Op = Callable[[Draw, bytes, Layout], tuple[bytes, str]]
OPS: dict[str, Op] = {
    "bitflip": _op_bitflip,
    "truncate": _op_truncate,
    "field": _op_field,
    "kv_value": _op_kv_value,
    "kv_rename": _op_kv_rename,
    "kv_add": _op_kv_add,
    "section": _op_section,
    "bytes": _op_bytes,
    "nonfinite": _op_nonfinite,
}
# drawn with these weights: the ones that keep the file well-formed reach the model checks
OP_WEIGHTS = {"kv_value": 4, "field": 4, "bitflip": 3, "nonfinite": 2, "truncate": 1,
              "kv_rename": 1, "kv_add": 1, "section": 2, "bytes": 1}  # fmt: skip
_OP_CHOICES = tuple(name for name, w in OP_WEIGHTS.items() for _ in range(w))


def mutate(draw: Draw, seed: bytes) -> tuple[bytes, list[str]]:
    """One to three mutations of ``seed``; each sees the layout the previous one left."""
    from hypothesis import strategies as st

    data, notes = seed, []
    for _ in range(draw(st.integers(1, 3))):
        if not data:
            break
        op = draw(st.sampled_from(_OP_CHOICES))
        data, note = OPS[op](draw, data, walk(data))
        notes.append(f"{op}: {note}")
    return data, notes


# --- the worker: runs cases under a memory limit -------------------------------------------------

STAGES = ("parse", "read", "tokenizer", "load", "forward", "generate", "chat")
_FAILED = object()


def _innermost(tb: Any) -> str:
    """file:line of the deepest frame inside qllama (or the deepest at all)."""
    frames = traceback.extract_tb(tb)
    ours = [f for f in frames if "qllama" in f.filename or "backends" in f.filename] or frames
    f = ours[-1] if ours else None
    return f"{Path(f.filename).name}:{f.lineno} in {f.name}" if f else "?"


def _open_fds() -> int:
    try:
        return len(os.listdir("/proc/self/fd"))
    except OSError:
        return 0


def _gguf_stages(data: bytes, scratch: Path, backend: Any) -> list[tuple[str, str]]:
    """Run every target on ``data``; a QllamaError ends the targets that depend on it."""
    import qllama
    from qllama.errors import QllamaError
    from qllama.gguf.reader import GGUFFile, read_gguf
    from qllama.runtime.tokenizer import Tokenizer

    out: list[tuple[str, str]] = []

    def step(name: str, fn: Callable[[], Any]) -> Any:
        try:
            value = fn()
        except QllamaError as e:
            out.append((name, type(e).__name__))
            return _FAILED
        out.append((name, "ok"))
        return value

    def tokenize(f: GGUFFile) -> None:
        tok = Tokenizer.from_gguf(f)
        ids = tok.encode("Hello, world! 世界 <|im_start|>x\n\ud800", add_bos=None)
        tok.decode(ids)
        every = range(tok.n_vocab)
        tok.decode(every, skip_special=True)
        dec = tok.decoder()
        "".join(dec.feed(i) for i in every) + dec.flush()

    step("parse", lambda: GGUFFile.from_buffer(data))
    scratch.write_bytes(data)  # the case's input, not an output: no atomic write needed
    f = step("read", lambda: read_gguf(scratch))
    if f is not _FAILED:
        try:
            step("tokenizer", lambda: tokenize(f))
        finally:
            f.close()
    model = step("load", lambda: qllama.load(scratch, backend=backend))
    if model is _FAILED:
        return out
    ids = (model.tokenizer.encode("Hi there", add_bos=None) or [0])[:2]
    step("forward", lambda: model.forward(ids, pos=0, all_logits=True))
    step("generate", lambda: model.generate(ids, max_new_tokens=2))
    if model.chat_template is not None:
        step("chat", lambda: model.apply_chat_template([{"role": "user", "content": "hi"}]))
    model.source.close()
    return out


def _selftest_stages(data: bytes) -> list[tuple[str, str]]:
    """Misbehaviours on demand, to prove the harness sees each kind of escape."""
    kind = data[:1]
    if kind == b"K":
        raise KeyError("planted")
    if kind == b"S":
        time.sleep(3600)
    if kind == b"X":
        os.kill(os.getpid(), signal.SIGSEGV)
    if kind == b"M":
        bytearray(8 << 30)  # past any sane RLIMIT_AS: MemoryError
    if kind == b"R":
        from qllama.errors import GGUFMagicError

        raise GGUFMagicError("planted")
    return [("selftest", "ok")]


def run_case(target: str, data: bytes, scratch: Path, backend: Any) -> dict[str, Any]:
    """One case in this process: the targets' outcomes, or the escape that ended them."""
    fds = _open_fds()
    result: dict[str, Any] = {"stages": [], "escape": None}
    try:
        if target == "selftest":
            result["stages"] = _selftest_stages(data)
        else:
            result["stages"] = _gguf_stages(data, scratch, backend)
    except BaseException as e:  # the contract: nothing but a QllamaError may get here
        from qllama.errors import QllamaError

        if isinstance(e, QllamaError):
            result["stages"] = [("selftest", type(e).__name__)]
        else:
            text = str(e).replace("\n", " ")[:300]
            result["escape"] = f"{type(e).__name__}: {text} (at {_innermost(e.__traceback__)})"
    gc.collect()
    result["fds_leaked"] = max(0, _open_fds() - fds)
    result["maxrss_kib"] = peak_rss_kib()
    result["baseline_kib"] = _BASELINE_KIB
    return result


_BASELINE_KIB = 0  # the worker's peak RSS once its imports are done


def peak_rss_kib() -> int:
    """This process's peak RSS since it started its program: Linux's VmHWM. (getrusage's
    ru_maxrss also keeps the pages of the process it was forked from, before the exec: a
    worker started by a large test process would report that process's size.)"""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1])
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss


def _send(stream: Any, obj: Any) -> None:
    payload = pickle.dumps(obj)
    stream.write(struct.pack("<Q", len(payload)) + payload)
    stream.flush()


def worker_main(memory_mib: int) -> None:
    """Serve cases from stdin until it closes (started by :class:`Worker`)."""
    import warnings

    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the parent decides when to stop
    warnings.simplefilter("ignore")  # a file may warn (missing pre-tokenizer...); not a finding
    from qllama.backends import get_backend

    global _BASELINE_KIB

    backend = get_backend("numpy")
    _BASELINE_KIB = peak_rss_kib()
    limit = memory_mib << 20
    resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
    stdin, stdout = sys.stdin.buffer, sys.stdout.buffer
    with tempfile.TemporaryDirectory(prefix="qllama-fuzz-") as d:
        scratch = Path(d) / "case.gguf"
        while head := stdin.read(8):
            (n,) = struct.unpack("<Q", head)
            target, data = pickle.loads(stdin.read(n))
            _send(stdout, run_case(target, data, scratch, backend))


class Worker:
    """A worker process; restarted after an escape, a crash or a timeout."""

    def __init__(self, memory_mib: int, timeout: float) -> None:
        self.memory_mib = memory_mib
        self.timeout = timeout
        self.starts = 0
        self.peak_rss_kib = 0
        self.proc: subprocess.Popen[bytes] | None = None

    def _start(self) -> subprocess.Popen[bytes]:
        # one thread per library: thread pools reserve address space the limit would count
        env = dict(os.environ, OPENBLAS_NUM_THREADS="1", OMP_NUM_THREADS="1")
        env |= {"RAYON_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
        self.starts += 1
        # run as a script: the repository root stays off sys.path, so qllama is the installed
        # package (its backends live in a folder of their own in the source tree)
        cmd = [sys.executable, str(Path(__file__).resolve()), "--worker"]
        return subprocess.Popen(
            [*cmd, "--memory-mib", str(self.memory_mib)],
            env=env,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
        )

    def _read(self, n: int, deadline: float) -> bytes:
        assert self.proc is not None and self.proc.stdout is not None
        fd, buf = self.proc.stdout.fileno(), b""
        while len(buf) < n:
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([fd], [], [], left)[0]:
                raise TimeoutError
            chunk = os.read(fd, n - len(buf))
            if not chunk:
                raise EOFError
            buf += chunk
        return buf

    def run(self, target: str, data: bytes) -> dict[str, Any]:
        fresh = self.proc is None or self.proc.poll() is not None
        if fresh:
            self.proc = self._start()
        assert self.proc is not None and self.proc.stdin is not None
        # the first case of a worker also pays for its imports
        deadline = time.monotonic() + self.timeout + (60 if fresh else 0)
        try:
            _send(self.proc.stdin, (target, data))
            (n,) = struct.unpack("<Q", self._read(8, deadline))
            result: dict[str, Any] = pickle.loads(self._read(n, deadline))
        except TimeoutError:
            self.stop()
            return {"stages": [], "escape": f"timeout: no answer within {self.timeout} s"}
        except (EOFError, BrokenPipeError):
            code = self.proc.wait()  # its peak RSS is what it reported with each case
            self.proc = None
            how = f"signal {-code}" if code < 0 else f"exit status {code}"
            return {"stages": [], "escape": f"crash: the worker died ({how})"}
        self.peak_rss_kib = max(self.peak_rss_kib, result.get("maxrss_kib", 0))
        if result["escape"]:
            self.stop()  # its state after an escape is not to be trusted
        return result

    def stop(self) -> None:
        if self.proc is not None:
            with contextlib.suppress(ProcessLookupError):
                self.proc.kill()
            self.proc.wait()
            self.proc = None


# --- the run ---------------------------------------------------------------------------------


@dataclass
class Escape:
    seed: str
    mutations: list[str]
    error: str
    data: bytes


@dataclass
class Stats:
    """The figures of a run."""

    cases: int = 0
    seconds: float = 0.0
    outcomes: Counter[str] = field(default_factory=Counter)  # first error of each case
    errors: Counter[str] = field(default_factory=Counter)  # every error class, every target
    by_stage: dict[str, Counter[str]] = field(default_factory=dict)
    escapes: list[Escape] = field(default_factory=list)
    disagreements: int = 0  # from_buffer and read_gguf ended differently
    fd_leaks: int = 0
    slowest: float = 0.0
    peak_rss_kib: int = 0
    worker_starts: int = 0
    biggest_rise: tuple[int, str] = (0, "")  # KiB the peak RSS rose in one case, and the case

    def record(self, result: dict[str, Any], elapsed: float) -> None:
        self.cases += 1
        self.slowest = max(self.slowest, elapsed)
        self.fd_leaks += bool(result.get("fds_leaked"))
        stages = result["stages"]
        for stage, outcome in stages:
            self.by_stage.setdefault(stage, Counter())[outcome] += 1
            if outcome != "ok":
                self.errors[outcome] += 1
        first = next((o for _, o in stages if o != "ok"), "loaded and ran" if stages else "-")
        if result["escape"]:
            first = "ESCAPE"
        self.outcomes[first] += 1
        got = dict(stages)
        if "parse" in got and "read" in got and got["parse"] != got["read"]:
            self.disagreements += 1

    def summary(self) -> dict[str, Any]:
        return {
            "cases": self.cases,
            "seconds": round(self.seconds, 1),
            "escapes": len(self.escapes),
            "distinct_error_classes": len(self.errors),
            "error_classes": dict(self.errors.most_common()),
            "outcomes": dict(self.outcomes.most_common()),
            "by_target": {s: dict(c.most_common()) for s, c in self.by_stage.items()},
            "parse_read_disagreements": self.disagreements,
            "fd_leaks": self.fd_leaks,
            "slowest_case_seconds": round(self.slowest, 3),
            "peak_rss_mib": round(self.peak_rss_kib / 1024, 1),
            "worker_starts": self.worker_starts,
            "biggest_rss_rise": {
                "mib": round(self.biggest_rise[0] / 1024, 1),
                "case": self.biggest_rise[1],
            },
            "escape_details": [
                {"seed": e.seed, "mutations": e.mutations, "error": e.error} for e in self.escapes
            ],
        }


class _Escaped(Exception):
    pass


def run(
    *,
    cases: int,
    seconds: float,
    seed: int = 0,
    memory_mib: int = 1024,
    timeout: float = 20.0,
    keep_going: bool = False,
    batch: int = 50,
    progress: Callable[[Stats], None] | None = None,
) -> Stats:
    """Fuzz until ``cases`` cases have run or ``seconds`` have passed (or an escape)."""
    from hypothesis import HealthCheck, Phase, given, settings
    from hypothesis import seed as hypothesis_seed
    from hypothesis import strategies as st

    seeds = build_seeds()
    names = sorted(seeds)
    stats = Stats()
    worker = Worker(memory_mib, timeout)
    start = time.monotonic()
    deadline = start + seconds
    last_report = start

    def one(d: st.DataObject) -> None:
        nonlocal last_report
        # no early return on the budget here: Hypothesis needs each run of a batch to draw
        # the same way; the budget is checked between batches, which are short
        name = d.draw(st.sampled_from(names))
        data, notes = mutate(d.draw, seeds[name])
        t0 = time.monotonic()
        peak = worker.peak_rss_kib
        result = worker.run("gguf", data)
        stats.record(result, time.monotonic() - t0)
        rise = result.get("maxrss_kib", 0) - max(peak, result.get("baseline_kib", 0))
        if rise > stats.biggest_rise[0]:
            stats.biggest_rise = (rise, f"{name}: {notes}")
        if progress is not None and time.monotonic() - last_report > 10:
            last_report = time.monotonic()
            progress(stats)
        if result["escape"]:
            stats.escapes.append(Escape(name, notes, result["escape"], data))
            if not keep_going:
                raise _Escaped(result["escape"])

    try:
        i = 0
        while stats.cases < cases and time.monotonic() < deadline and not stats.escapes:
            test = settings(
                max_examples=min(batch, cases - stats.cases),
                deadline=None,
                database=None,
                phases=[Phase.generate, Phase.shrink],
                suppress_health_check=list(HealthCheck),
                report_multiple_bugs=False,
                print_blob=False,
            )(given(st.data())(one))
            try:
                hypothesis_seed(seed * 100_003 + i)(test)()
            except _Escaped:
                # Hypothesis has shrunk it: the last escape recorded is the smallest
                stats.escapes[:] = stats.escapes[-1:]
                break
            i += 1
    finally:
        worker.stop()
        stats.seconds = time.monotonic() - start
        stats.peak_rss_kib = worker.peak_rss_kib
        stats.worker_starts = worker.starts
    return stats


def format_report(stats: Stats, *, seed: int, memory_mib: int, timeout: float) -> str:
    """The figures, for people."""
    s = stats.summary()
    rate = stats.cases / stats.seconds if stats.seconds else 0.0
    lines = [
        f"qllama GGUF fuzz: seed {seed}, {s['cases']} cases in {s['seconds']} s ({rate:.0f}/s), "
        f"RLIMIT_AS {memory_mib} MiB, {timeout:g} s per case",
        f"escapes: {s['escapes']}",
        *(f"  {e['error']}\n    seed {e['seed']}: {e['mutations']}" for e in s["escape_details"]),
        f"distinct error classes: {s['distinct_error_classes']}",
        *(f"  {name:28} {n:>7}" for name, n in s["error_classes"].items()),
        "outcome of each case (its first error; parse -> read -> tokenizer -> load -> forward):",
        *(f"  {name:28} {n:>7}" for name, n in s["outcomes"].items()),
        "by target: " + "; ".join(f"{t} {sum(c.values())}" for t, c in s["by_target"].items() if c),
        f"from_buffer/read_gguf disagreements: {s['parse_read_disagreements']}, "
        f"cases leaking a file descriptor: {s['fd_leaks']}",
        f"slowest case: {s['slowest_case_seconds']} s; peak RSS of a worker: "
        f"{s['peak_rss_mib']} MiB; worker starts: {s['worker_starts']}",
        f"largest rise of the peak in one case: {s['biggest_rss_rise']['mib']} MiB "
        f"({s['biggest_rss_rise']['case'][:200]})",
    ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python fuzz/gguf_mutations.py", description=__doc__.split("\n")[0]
    )
    p.add_argument("--cases", type=int, default=20000, help="stop after this many cases")
    p.add_argument("--seconds", type=float, default=600, help="stop after this long")
    p.add_argument("--seed", type=int, default=0, help="Hypothesis seed (runs reproduce)")
    p.add_argument("--memory-mib", type=int, default=1024, help="RLIMIT_AS of the worker")
    p.add_argument("--timeout", type=float, default=20.0, help="seconds allowed per case")
    p.add_argument("--keep-going", action="store_true", help="do not stop at an escape")
    p.add_argument("--out", type=Path, help="write the summary (JSON) and escaping inputs here")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.worker:
        worker_main(args.memory_mib)
        return 0

    def progress(st: Stats) -> None:
        print(f"  ... {st.cases} cases, {len(st.escapes)} escapes", file=sys.stderr, flush=True)

    stats = run(
        cases=args.cases,
        seconds=args.seconds,
        seed=args.seed,
        memory_mib=args.memory_mib,
        timeout=args.timeout,
        keep_going=args.keep_going,
        progress=progress,
    )
    print(format_report(stats, seed=args.seed, memory_mib=args.memory_mib, timeout=args.timeout))
    if args.out is not None:
        from qllama.atomic import atomic_write

        with atomic_write(args.out / "summary.json", "w") as f:
            json.dump(stats.summary(), f, indent=1)
        for i, e in enumerate(stats.escapes):
            with atomic_write(args.out / f"escape-{i}.gguf") as f:
                f.write(e.data)
    return 1 if stats.escapes else 0


if __name__ == "__main__":
    sys.exit(main())
