"""Build GGUF bytes field by field, including the malformed ones no writer would produce."""

from __future__ import annotations

import struct
from collections.abc import Sequence
from dataclasses import dataclass, field


def s(text: str | bytes) -> bytes:
    """A GGUF string: u64 length and the bytes."""
    b = text.encode() if isinstance(text, str) else text
    return struct.pack("<Q", len(b)) + b


def kv(key: str | bytes, vtype: int, payload: bytes) -> bytes:
    """One metadata pair; ``payload`` is the already-encoded value."""
    return s(key) + struct.pack("<i", vtype) + payload


def kv_u32(key: str, v: int) -> bytes:
    return kv(key, 4, struct.pack("<I", v))


def kv_str(key: str, v: str) -> bytes:
    return kv(key, 8, s(v))


def tensor_info(
    name: str | bytes, ne: Sequence[int], ggml_type: int, offset: int, n_dims: int | None = None
) -> bytes:
    n_dims = len(ne) if n_dims is None else n_dims
    dims = b"".join(struct.pack("<q", d) if d < 2**63 else struct.pack("<Q", d) for d in ne)
    return s(name) + struct.pack("<I", n_dims) + dims + struct.pack("<iQ", ggml_type, offset)


@dataclass
class Gguf:
    """A GGUF as parts; :meth:`bytes` joins them, padding the data section to ``alignment``."""

    kvs: list[bytes] = field(default_factory=list)
    infos: list[bytes] = field(default_factory=list)
    data: bytes = b""
    magic: bytes = b"GGUF"
    version: int = 3
    n_tensors: int | None = None
    n_kv: int | None = None
    alignment: int = 32

    def bytes(self) -> bytes:
        n_t = len(self.infos) if self.n_tensors is None else self.n_tensors
        n_kv = len(self.kvs) if self.n_kv is None else self.n_kv
        head = self.magic + struct.pack("<I", self.version)
        head += struct.pack("<Q", n_t % 2**64) + struct.pack("<Q", n_kv % 2**64)
        body = head + b"".join(self.kvs) + b"".join(self.infos)
        if self.infos:
            body += b"\0" * (-len(body) % self.alignment)
        return body + self.data


def valid_file() -> bytes:
    """A small valid file: three metadata pairs, a Q8_0 tensor then an F32 one.

    The last tensor ends the file exactly (no trailing padding), so every shorter prefix is
    missing data.
    """
    q8 = struct.pack("<e", 0.5) + bytes(range(32))
    f32 = struct.pack("<8f", *range(8))
    g = Gguf(
        kvs=[
            kv_str("general.architecture", "llama"),
            kv_u32("llama.block_count", 1),
            kv("tokenizer.ggml.tokens", 9, struct.pack("<iQ", 8, 2) + s("a") + s("b")),
        ],
        infos=[tensor_info("q", [32, 1], 8, 0), tensor_info("f", [8], 0, 64)],
        data=q8 + b"\0" * (64 - len(q8)) + f32,
    )
    return g.bytes()
