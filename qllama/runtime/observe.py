"""Named intermediate values of the forward pass, and a recorder for them.

``model.forward(ids, observer=f)`` calls ``f(name, value)`` at these points (``i`` is the
block; every value has one row per token of the call):

====================  ================================================================
``embedding``         the rows of ``token_embd``: the residual stream entering block 0
``blk.{i}.q``         ``x @ attn_q`` before RoPE, ``(T, n_head * head_dim)``, in the file's row
                      order (GGUF permutes Q's and K's rows for its RoPE convention)
``blk.{i}.k``         ``x @ attn_k`` before RoPE, ``(T, n_head_kv * head_dim)``, likewise
``blk.{i}.v``         ``x @ attn_v``, ``(T, n_head_kv * head_dim)``
``blk.{i}.attn_out``  the attention block's output (after ``attn_output``), before the residual
``blk.{i}.ffn_out``   the MLP's output (after ``ffn_down``), before the residual
``blk.{i}.router``    a mixture of experts' router logits ``(T, n_expert)`` (with its bias),
                      before the gating
``blk.{i}.experts``   the experts each token is routed to ``(T, k)``, the best first, after
                      the tie order; an observer that returns an array here (integers, the same
                      shape) routes the tokens to those experts instead, their weights gathered
                      from this run's own gated values (a counterfactual:
                      :mod:`qllama.measure.routing`); whatever it returns elsewhere is ignored
``blk.{i}.out``       the residual stream after block ``i``
====================  ================================================================

Without an observer the forward pass does no extra work. A :class:`Recorder` keeps the points
it is asked for (Q/K/V only on request: they are the bulk), at chosen positions, as float32
numpy arrays: a :class:`Trace`, which the reference runner also produces for transformers
(:func:`qllama.measure.reference.transformers_trace`), aligned by these names.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from qllama.array_api import to_numpy
from qllama.atomic import atomic_write
from qllama.errors import QllamaError

BLOCK_POINTS = ("attn_out", "ffn_out", "out")  # recorded by default
QKV_POINTS = ("q", "k", "v")  # on request
ROUTER_POINTS = ("router",)  # on request (a mixture's layers only)
LOGITS = "logits"  # not an observer point: the forward pass's result, kept beside them

_BLOCK_NAME = re.compile(r"blk\.(\d+)\.(\w+)")


def block_name(i: int, point: str) -> str:
    """The name of ``point`` in block ``i``: ``blk.{i}.{point}``."""
    return f"blk.{i}.{point}"


def split_name(name: str) -> tuple[int | None, str]:
    """``blk.3.out`` -> (3, "out"); ``embedding`` -> (None, "embedding")."""
    m = _BLOCK_NAME.fullmatch(name)
    return (int(m.group(1)), m.group(2)) if m else (None, name)


def residual_names(n_layer: int) -> list[str]:
    """The residual stream from the embedding to the logits, in order."""
    return ["embedding", *(block_name(i, "out") for i in range(n_layer)), LOGITS]


@dataclass
class Trace:
    """Values at named points for the tokens ``tokens``, kept at ``positions``.

    ``values[name]`` is ``(len(positions), width)`` float32.
    """

    tokens: list[int]
    positions: list[int]
    values: dict[str, np.ndarray] = field(default_factory=dict)
    meta: dict[str, Any] = field(default_factory=dict)

    def __iter__(self) -> Iterator[str]:
        return iter(self.values)

    def __getitem__(self, name: str) -> np.ndarray:
        return self.values[name]

    def save(self, path: str | os.PathLike[str]) -> None:
        arrays: dict[str, Any] = {
            "__tokens": np.asarray(self.tokens, np.int64),
            "__positions": np.asarray(self.positions, np.int64),
            "__meta": json.dumps(self.meta),
            **self.values,
        }
        with atomic_write(path) as f:
            np.savez(f, **arrays)

    @classmethod
    def load(cls, path: str | os.PathLike[str]) -> Trace:
        try:
            with np.load(path) as z:
                values = {k: z[k] for k in z.files if not k.startswith("__")}
                return cls(
                    [int(t) for t in z["__tokens"]],
                    [int(p) for p in z["__positions"]],
                    values,
                    json.loads(str(z["__meta"])),
                )
        except (OSError, KeyError, ValueError) as e:
            raise QllamaError(f"cannot read trace {path}: {e}") from None


def resolve_positions(positions: Sequence[int] | None, n_tokens: int) -> list[int]:
    """Positions as indices in ``[0, n_tokens)``: None is every position, negatives count
    from the end; out-of-range or repeated positions are refused."""
    if positions is None:
        return list(range(n_tokens))
    out = []
    for p in positions:
        q = p + n_tokens if p < 0 else p
        if not 0 <= q < n_tokens:
            raise QllamaError(f"position {p} is outside the {n_tokens} tokens")
        out.append(q)
    if len(set(out)) != len(out):
        raise QllamaError(f"positions repeat: {list(positions)}")
    return out


class Recorder:
    """An observer keeping chosen points at chosen positions (of one forward call at pos 0)."""

    def __init__(
        self, positions: Sequence[int], *, qkv: bool = False, router: bool = False
    ) -> None:
        self.rows = np.asarray(positions, dtype=np.int64)
        self.points = BLOCK_POINTS + (QKV_POINTS if qkv else ()) + (ROUTER_POINTS if router else ())
        self.values: dict[str, np.ndarray] = {}

    def wants(self, name: str) -> bool:
        layer, point = split_name(name)
        return point == "embedding" if layer is None else point in self.points

    def __call__(self, name: str, value: Any) -> None:
        if self.wants(name):
            self.keep(name, value)

    def keep(self, name: str, value: Any) -> None:
        """Rows ``positions`` of ``value`` as float32, one flattened row per token."""
        v = np.asarray(to_numpy(value), dtype=np.float32)
        self.values[name] = np.ascontiguousarray(v.reshape(v.shape[0], -1)[self.rows])


def record(
    model: Any,
    tokens: Sequence[int],
    *,
    positions: Sequence[int] | None = None,
    qkv: bool = False,
    router: bool = False,
    observer: Any = None,
) -> Trace:
    """One forward pass of ``tokens`` from position 0, observed: the named points (Q/K/V and
    the router logits on request) and the logits at ``positions`` (default: every position).
    ``observer``, if given, sees every point too, after the recorder (what it returns at
    ``blk.{i}.experts`` routes the tokens)."""
    tokens = list(tokens)
    rows = resolve_positions(positions, len(tokens))
    rec = Recorder(rows, qkv=qkv, router=router)

    def both(name: str, value: Any) -> Any:
        rec(name, value)
        return observer(name, value)

    watch = rec if observer is None else both
    logits = model.forward(tokens, pos=0, all_logits=True, observer=watch)
    rec.keep(LOGITS, logits)
    return Trace(tokens, rows, rec.values)
