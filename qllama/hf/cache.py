"""``QllamaCache``: a transformers ``Cache`` that carries qllama's own KV caches, one per row.

qllama's model owns its keys and values (:class:`qllama.runtime.kv_cache.KVCache`; ``forward(ids,
pos)`` keeps positions ``< pos``). transformers' ``generate`` instead threads a ``Cache``
object from one forward call to the next and edits it between calls: it asks for its length,
crops it (prompt-lookup and assisted decoding roll back rejected tokens), reorders it (beam
search) and repeats or selects its rows. This cache answers those calls by bookkeeping on
qllama's caches, one per batch row, without touching a key or a value:

- a row records the attention mask it has seen (transformers' padded view of the sequence)
  and the real tokens it ran; the real tokens sit at qllama positions ``0 .. n-1``;
- ``crop`` shortens the mask and the token list; the next forward call starts at the new
  length and overwrites what followed (qllama keeps positions ``< pos``);
- reordering and repeating rows share a row's arrays instead of copying them
  (:meth:`~qllama.runtime.kv_cache.KVCache.fork`): two rows hold the same arrays until one of them
  writes a layer, which copies that layer's arrays first.

Its length (``get_seq_length``) is the padded length transformers expects; every row has the
same one.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from transformers.cache_utils import Cache, CacheLayerMixin

from qllama.errors import UnsupportedOptionError
from qllama.runtime.kv_cache import KVCache


@dataclass
class Row:
    """One batch row: its qllama KV cache, the mask seen so far, and the real tokens run."""

    kv: KVCache
    mask: list[int] = field(default_factory=list)  # 1: a real token, 0: padding
    tokens: list[int] = field(default_factory=list)  # the real tokens, at positions 0..n-1

    def fork(self) -> Row:
        """A row that starts as this one and then goes its own way (arrays shared, see the
        module docstring)."""
        return Row(self.kv.fork(), list(self.mask), list(self.tokens))

    def crop(self, length: int) -> None:
        """Keep the first ``length`` positions of the padded sequence."""
        self.mask = self.mask[:length]
        self.tokens = self.tokens[: sum(self.mask)]
        self.kv.length = min(self.kv.length, len(self.tokens))


def _forks(rows: Sequence[Row], order: Sequence[int]) -> list[Row]:
    """Rows ``order`` of ``rows``; a row picked more than once is forked for every later pick."""
    picked: set[int] = set()
    out = []
    for i in order:
        out.append(rows[i].fork() if i in picked else rows[i])
        picked.add(i)
    return out


def _not_writable() -> UnsupportedOptionError:
    return UnsupportedOptionError(
        "a QllamaCache holds qllama's own keys and values; transformers' attention layers "
        "cannot write into it"
    )


class RowsLayer(CacheLayerMixin):
    """The cache's one layer: every row of the batch (qllama's caches hold all model layers).

    transformers' ``Cache`` applies ``crop``, ``reorder_cache`` and the batch edits to each of
    its layers; one layer makes each edit happen once.
    """

    is_compileable = False
    is_croppable = True
    is_sliding = False
    supports_early_init = False

    def __init__(self, rows: list[Row]) -> None:
        super().__init__()
        self.rows = rows
        self.is_initialized = True

    @property
    def batch_size(self) -> int:
        return len(self.rows)

    def get_seq_length(self, *args: Any) -> int:
        return len(self.rows[0].mask) if self.rows else 0

    def get_max_length(self) -> int:
        return -1  # grows with the sequence, up to the model's context

    get_max_cache_shape = get_max_length  # its name in earlier 5.x releases

    def get_mask_sizes(self, query: Any, *args: Any) -> tuple[int, int]:
        # transformers' attention masks are never built for this model; answered for
        # completeness: (kv_length, kv_offset) for a query of this many positions
        n = query if isinstance(query, int) else int(query.shape[-1])
        return self.get_seq_length() + n, 0

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        raise _not_writable()

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any, **kw: Any
    ) -> tuple[torch.Tensor, torch.Tensor]:
        raise _not_writable()

    def crop(self, n: int) -> None:
        """Remove ``-n`` positions (``n < 0``); ``0`` removes none; ``n > 0`` keeps ``n``
        (what transformers before 5.16 passed: an absolute length)."""
        length = self.get_seq_length()
        keep = length + n if n <= 0 else n
        if keep < length:
            for row in self.rows:
                row.crop(max(keep, 0))

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        self.rows = _forks(self.rows, [int(i) for i in beam_idx.tolist()])

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        self.rows = _forks(self.rows, [int(i) for i in torch.as_tensor(indices).tolist()])

    def batch_repeat_interleave(self, repeats: int) -> None:
        self.rows = _forks(self.rows, [i for i in range(len(self.rows)) for _ in range(repeats)])

    def reset(self) -> None:
        for row in self.rows:
            row.crop(0)

    def offload(self) -> None:
        """Nothing to move: the arrays live where qllama's backend keeps them."""

    def prefetch(self) -> None:
        """Nothing to move (see :meth:`offload`)."""


class QllamaCache(Cache):
    """The batch's qllama KV caches, as ``generate`` threads a ``Cache`` between calls.

    Built by :class:`~qllama.hf.model.QllamaForCausalLM` in its first forward call; pass it
    back (``cache=`` / ``past_key_values=``) to continue the same sequences. ``owner`` is the
    model it belongs to: its rows hold that model's keys and values.
    """

    def __init__(self, owner: Any, rows: list[Row]) -> None:
        super().__init__(layers=[RowsLayer(rows)])
        self.owner = owner

    @property
    def rows(self) -> list[Row]:
        layer: RowsLayer = self.layers[0]  # type: ignore[assignment]
        return layer.rows

    def __repr__(self) -> str:
        return f"QllamaCache(rows={len(self.rows)}, length={self.get_seq_length()})"
