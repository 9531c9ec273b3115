"""``qllama inspect``: a GGUF file's metadata and tensors, as text or JSON."""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Any

import numpy as np

from qllama.cli.common import Subparsers


def add_parser(sub: Subparsers) -> None:
    """The subcommand and its arguments."""
    s = sub.add_parser("inspect", help="show a GGUF file's metadata and tensors")
    s.add_argument("file")
    s.add_argument("--json", action="store_true", help="machine-readable output")
    s.set_defaults(run=run)


def _short(value: Any, limit: int = 60) -> str:
    """A one-line preview of a metadata value."""
    if isinstance(value, list | np.ndarray):
        items = list(value[:4])
        text = ", ".join(repr(v if not isinstance(v, np.generic) else v.item()) for v in items)
        more = ", ..." if len(value) > 4 else ""
        return f"[{text}{more}]"
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _enum_name(key: str, value: Any) -> str | None:
    """The name of an enum key's value (``general.file_type`` 15 is ``Q4_K_M``), if it is one."""
    from qllama.ggml_types import file_type_name

    if key != "general.file_type" or not isinstance(value, int | np.integer):
        return None
    return file_type_name(value)


def _json_value(value: Any) -> Any:
    if isinstance(value, np.ndarray):
        return value.tolist()
    return value


def _type_label(v: Any) -> str:
    if v.elem_type is not None:
        return f"{v.elem_type.name.lower()}[{len(v.value)}]"
    return v.type.name.lower()


def run(args: argparse.Namespace) -> int:
    """Print the file's header, metadata, tensors and bytes by type (or all of it as JSON)."""
    from qllama.gguf.reader import read_gguf

    f = read_gguf(args.file)
    by_type: dict[str, list[int]] = {}
    for t in f:
        entry = by_type.setdefault(t.ggml_type.name, [0, 0, 0])
        entry[0] += 1
        entry[1] += t.n_elements
        entry[2] += t.nbytes
    if args.json:
        doc = {
            "path": str(f.path),
            "version": f.version,
            "alignment": f.alignment,
            "data_offset": f.data_offset,
            "metadata": {
                k: {
                    "type": v.type.name,
                    "elem_type": v.elem_type.name if v.elem_type else None,
                    "value": _json_value(v.value),
                    **({"name": name} if (name := _enum_name(k, v.value)) else {}),
                }
                for k, v in f.kv.items()
            },
            "tensors": [
                {
                    "name": t.name,
                    "type": t.ggml_type.name,
                    "ne": list(t.ne),
                    "shape": list(t.shape),
                    "offset": t.offset,
                    "bytes": t.nbytes,
                }
                for t in f
            ],
            "summary": {
                k: {"tensors": n, "elements": e, "bytes": b} for k, (n, e, b) in by_type.items()
            },
        }
        json.dump(doc, sys.stdout, indent=1)
        print()
        return 0

    size = os.path.getsize(f.path) if f.path else 0
    print(
        f"{f.path}: GGUF v{f.version}, {size:,} bytes, alignment {f.alignment}, "
        f"{len(f.kv)} metadata keys, {len(f)} tensors, data at offset {f.data_offset}"
    )
    print("\nmetadata:")
    width = max((len(k) for k in f.kv), default=0)
    for k, v in f.kv.items():
        name = _enum_name(k, v.value)
        shown = f"{_short(v.value)} ({name})" if name else _short(v.value)
        print(f"  {k:<{width}}  {_type_label(v):<14} {shown}")
    print("\ntensors (shape in numpy order, rows last; ne is its reverse):")
    print(f"  {'name':<32} {'type':<6} {'shape':<16} {'bytes':>12}")
    for t in f:
        shape = "x".join(str(d) for d in t.shape) or "scalar"
        print(f"  {t.name:<32} {t.ggml_type.name:<6} {shape:<16} {t.nbytes:>12,}")
    total = sum(b for _, _, b in by_type.values())
    print(f"\nby type:\n  {'type':<6} {'tensors':>7} {'elements':>13} {'bytes':>13} {'share':>6}")
    for k, (n, e, b) in sorted(by_type.items(), key=lambda kv: -kv[1][2]):
        print(f"  {k:<6} {n:>7} {e:>13,} {b:>13,} {100 * b / max(total, 1):>5.1f}%")
    return 0
