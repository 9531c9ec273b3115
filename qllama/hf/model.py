"""``QllamaForCausalLM``: a qllama model inside transformers' ``generate``, pipelines and lm-eval.

The weights stay as the GGUF file stores them and the arithmetic is the backend's (the CPU
arithmetic on numpy, the GPU one on torch, or dequantize-all); transformers sees a
``PreTrainedModel`` whose forward pass is qllama's. What it holds as torch parameters is one
float32 anchor, which transformers reads ``device`` and ``dtype`` from.

A batch runs row by row: each row's real tokens (the positions its attention mask marks) run
through ``Model.forward`` at qllama positions ``0, 1, ...`` with that row's own KV cache (a
:class:`~qllama.hf.cache.QllamaCache` carries them between calls). Padding is never computed;
its logits are 0. Everything qllama cannot do faithfully is refused with an
:class:`~qllama.errors.UnsupportedOptionError` naming it: ``inputs_embeds``, attention
weights, 4-D masks and masks with holes, caches other than transformers' default dynamic one,
a transformers cache that already holds keys, saving, and casting.

Numerics: under the CPU arithmetic, activations are quantized per row of each forward call,
so the logits of a position depend on how many tokens that call carried (one pass over a
prompt against one token at a time differ by up to 0.63 logits on SmolLM2); everything else
in transformers' loop (logits processors, sampling) is transformers'. See docs/transformers.md.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable, Sequence
from typing import Any

import array_api_compat
import numpy as np
import torch
from torch import nn
from transformers import GenerationMixin, PreTrainedModel
from transformers.cache_utils import Cache
from transformers.modeling_outputs import CausalLMOutputWithPast

from qllama.array_api import to_numpy
from qllama.errors import QllamaError, UnsupportedOptionError
from qllama.hf.cache import QllamaCache, Row
from qllama.hf.config import QllamaConfig
from qllama.runtime.model import Model, rms_norm

# generate's cache choices that end in an empty DynamicCache, which the first forward call
# replaces by a QllamaCache; every other one builds tensors qllama cannot use
CACHE_IMPLEMENTATIONS = (None, "dynamic", "offloaded")
# keywords transformers passes that carry nothing qllama needs
IGNORED_KWARGS = frozenset({"cache_position", "return_dict"})
# the output's cache field: "cache" from transformers 5.24, "past_key_values" before
CACHE_FIELD = (
    "cache" if "cache" in CausalLMOutputWithPast.__dataclass_fields__ else "past_key_values"
)


def _torch(x: Any) -> torch.Tensor:
    """A backend array as a float32 torch tensor: the same tensor for torch arrays (no copy
    off the device), else a copy through numpy."""
    if array_api_compat.is_torch_array(x):
        return x.to(torch.float32)
    return torch.from_numpy(np.array(to_numpy(x), dtype=np.float32))


class QllamaForCausalLM(PreTrainedModel, GenerationMixin):
    """A qllama model (any architecture qllama computes) as a transformers causal LM.

    Build one with :meth:`from_gguf` (a path and :func:`qllama.load`'s options) or
    :meth:`from_llm` (a loaded model). ``model.llm`` is the qllama model itself.
    """

    config_class = QllamaConfig
    base_model_prefix = "qllama"
    main_input_name = "input_ids"
    # what each from_pretrained keyword did, in words (qllama.hf.loading.plan)
    load_notes: tuple[str, ...] = ()

    def __init__(self, config: QllamaConfig, llm: Model | None = None) -> None:
        super().__init__(config)
        if llm is None:
            if not config.gguf_path:
                raise QllamaError(
                    "a QllamaConfig without gguf_path cannot build a model; use "
                    "QllamaForCausalLM.from_gguf(path) or from_llm(model)"
                )
            import qllama

            llm = qllama.load(config.gguf_path, **config.load_options)
        self.llm = llm
        # the one parameter: transformers takes device and dtype from the first parameter
        device = llm.backend.device if array_api_compat.is_torch_namespace(llm.xp) else "cpu"
        self.anchor = nn.Parameter(torch.zeros(1, device=device), requires_grad=False)
        self._lock = threading.Lock()  # one forward at a time: rows take turns in llm.cache
        self.post_init()

    # -- building ---------------------------------------------------------------------------

    @classmethod
    def from_gguf(
        cls,
        path: str | os.PathLike[str],
        backend: Any = None,
        dequantize_all: bool | None = None,
        **load_options: Any,
    ) -> QllamaForCausalLM:
        """Load ``path`` with :func:`qllama.load` (``backend``, ``dequantize_all`` and every
        other keyword of it, e.g. ``device``, ``activations="f32"``, ``n_ctx``)."""
        import qllama

        options = dict(load_options)
        if backend is not None:
            options["backend"] = backend
        if dequantize_all is not None:
            options["dequantize_all"] = dequantize_all
        llm = qllama.load(path, **options)
        reusable = isinstance(options.get("backend"), str | None)  # a Backend object is not
        return cls.from_llm(llm, load_options=options if reusable else None)

    @classmethod
    def from_llm(
        cls, llm: Model, *, load_options: dict[str, Any] | None = None
    ) -> QllamaForCausalLM:
        """Wrap a model :func:`qllama.load` returned (its weights and backend are shared)."""
        path = getattr(llm.source, "path", None)
        return cls(QllamaConfig.from_llm(llm, path, load_options), llm)

    @classmethod
    def from_pretrained(cls, path: Any, *args: Any, gguf_file: str | None = None, **options: Any):  # type: ignore[override]
        """A GGUF file (``path``, or ``gguf_file`` inside the folder or Hub repository
        ``path``), with the keywords of :func:`qllama.hf.AutoModelForCausalLM.from_pretrained`
        (transformers', llama-cpp-python's and qllama's; :mod:`qllama.hf.loading`). There are
        no transformers checkpoints of this model to load."""
        from qllama.hf.loading import gguf_target, load_model

        if args:
            raise UnsupportedOptionError("QllamaForCausalLM.from_pretrained takes keywords only")
        target = gguf_target(path, gguf_file)
        if target is None:
            raise UnsupportedOptionError(
                f"{os.fspath(path)!r} is not a GGUF file: QllamaForCausalLM loads GGUF files only "
                "(a .gguf path, or a folder with gguf_file=)"
            )
        model: QllamaForCausalLM = load_model(target, options, cls)
        return model

    # -- refusals: what would silently do the wrong thing ------------------------------------

    def save_pretrained(self, *args: Any, **kwargs: Any) -> None:
        raise UnsupportedOptionError(
            "QllamaForCausalLM holds no transformers weights to save: the model is its GGUF "
            f"file ({self.config.gguf_path})"
        )

    def push_to_hub(self, *args: Any, **kwargs: Any) -> Any:  # type: ignore[override]
        self.save_pretrained()

    def _apply(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> QllamaForCausalLM:
        # .to(), .half(), .cuda(), .cpu(), .float() and the rest all come through here: the
        # weights are the backend's, so only a no-op (same dtype, same device) is allowed
        moved = fn(self.anchor.data)
        if moved.dtype != self.anchor.dtype or moved.device != self.anchor.device:
            raise UnsupportedOptionError(
                f"QllamaForCausalLM cannot move to {moved.device} / {moved.dtype}: its weights are "
                f"the GGUF file's, computed by qllama's {self.llm.backend.name} backend on "
                f"{self.anchor.device} in float32; load it again with the backend and device "
                "wanted (from_gguf(path, backend=..., device=...))"
            )
        return self

    def init_continuous_batching(self, *args: Any, **kwargs: Any) -> Any:
        raise UnsupportedOptionError(
            "continuous batching (paged attention) needs transformers' own attention kernels; "
            "QllamaForCausalLM runs qllama's forward pass (use generate)"
        )

    def generate_batch(self, *args: Any, **kwargs: Any) -> Any:
        self.init_continuous_batching()

    def generate(
        self, inputs: Any = None, generation_config: Any = None, *args: Any, **kwargs: Any
    ) -> Any:
        """transformers' ``generate`` (every decoding strategy it has), after refusing the
        options that would build tensors qllama cannot use."""
        config = generation_config or self.generation_config
        implementation = kwargs.get("cache_implementation", config.cache_implementation)
        if implementation not in CACHE_IMPLEMENTATIONS:
            raise UnsupportedOptionError(
                f"cache_implementation={implementation!r}: QllamaForCausalLM keeps qllama's own "
                f"KV cache; use one of {CACHE_IMPLEMENTATIONS} (all end in a QllamaCache)"
            )
        if kwargs.get("inputs_embeds") is not None:
            self._refuse_embeds()
        return super().generate(inputs, generation_config, *args, **kwargs)

    @staticmethod
    def _refuse_embeds() -> None:
        raise UnsupportedOptionError(
            "inputs_embeds: qllama looks up its own (possibly quantized) embedding rows; "
            "pass input_ids"
        )

    # -- the forward pass -------------------------------------------------------------------

    def forward(
        self,
        input_ids: torch.LongTensor | None = None,
        attention_mask: torch.Tensor | None = None,
        cache: Cache | None = None,
        inputs_embeds: torch.Tensor | None = None,
        labels: torch.LongTensor | None = None,
        use_cache: bool | None = None,
        output_attentions: bool | None = None,
        output_hidden_states: bool | int | Sequence[int] | None = None,
        logits_to_keep: int = 0,
        past_key_values: Cache | None = None,
        position_ids: torch.LongTensor | None = None,
        return_dict: bool | None = None,
        **kwargs: Any,
    ) -> Any:
        """Logits (batch, positions, vocab) of qllama's forward pass, transformers-style.

        ``cache`` (or its former name ``past_key_values``) continues the sequences of a
        :class:`QllamaCache`; ``logits_to_keep`` > 0 keeps the last positions only (generate
        asks for 1); ``labels`` gives transformers' shifted cross-entropy; ``output_hidden_states``
        (a flag, an index or indices) gives the embeddings, every block's output and, last,
        the final norm's output.
        """
        unknown = sorted(set(kwargs) - IGNORED_KWARGS)
        if unknown:
            raise UnsupportedOptionError(f"QllamaForCausalLM.forward does not take {unknown}")
        if inputs_embeds is not None:
            self._refuse_embeds()
        if output_attentions:
            raise UnsupportedOptionError(
                "output_attentions: qllama's attention does not keep its weights"
            )
        if input_ids is None:
            raise UnsupportedOptionError("QllamaForCausalLM.forward needs input_ids")
        if cache is not None and past_key_values is not None and cache is not past_key_values:
            raise UnsupportedOptionError("cache and past_key_values name the same argument")
        if isinstance(logits_to_keep, bool) or not isinstance(logits_to_keep, int):
            raise UnsupportedOptionError(
                f"logits_to_keep must be an int (a count of last positions), not {logits_to_keep!r}"
            )
        if labels is not None and logits_to_keep:
            raise UnsupportedOptionError(
                "labels need the logits of every position (logits_to_keep=0)"
            )
        ids = torch.as_tensor(input_ids)
        if ids.ndim != 2:
            raise UnsupportedOptionError(
                f"input_ids must be (batch, positions), not of shape {tuple(ids.shape)}"
            )
        use_cache = self.config.use_cache if use_cache is None else use_cache
        with self._lock:
            qcache = self._cache_for(cache if cache is not None else past_key_values, ids.shape[0])
            mask = self._masks(attention_mask, position_ids, qcache, ids.shape)
            logits, hidden = self._run(
                qcache, ids.tolist(), mask, logits_to_keep, output_hidden_states
            )
        loss = None
        if labels is not None:
            loss = self.loss_function(
                logits=logits, labels=labels, vocab_size=self.config.vocab_size
            )
        fields: dict[str, Any] = {"loss": loss, "logits": logits, "hidden_states": hidden}
        fields[CACHE_FIELD] = qcache if use_cache else None
        out = CausalLMOutputWithPast(**fields)
        use_dict = self.config.return_dict if return_dict is None else return_dict
        return out if use_dict else out.to_tuple()

    def _cache_for(self, given: Any, batch: int) -> QllamaCache:
        """The cache to continue: ``given`` if it is one of this model's, a new one for an
        empty transformers cache (what generate passes first) or none."""
        if isinstance(given, QllamaCache):
            if given.owner is not self:
                raise UnsupportedOptionError("this QllamaCache belongs to another model")
            if len(given.rows) != batch:
                raise UnsupportedOptionError(
                    f"the cache holds {len(given.rows)} sequences, input_ids has {batch} rows"
                )
            return given
        if given is not None and not (isinstance(given, Cache) and given.get_seq_length() == 0):
            raise UnsupportedOptionError(
                f"a {type(given).__name__} holding keys and values cannot continue a qllama model "
                "(its tensors are not qllama's); pass the QllamaCache this model returned"
            )
        rows = [Row(self.llm.new_cache()) for _ in range(batch)]
        return QllamaCache(self, rows)

    def _masks(
        self, attention_mask: Any, position_ids: Any, qcache: QllamaCache, shape: Sequence[int]
    ) -> list[list[int]]:
        """Each row's mask of the new positions (1: a real token), after checking the whole
        mask: 2-D, of 0s and 1s, covering the cached positions then the new ones, and with
        each row's real tokens one contiguous run (left or right padding, no holes)."""
        batch, new = shape
        past = qcache.get_seq_length()
        if attention_mask is None:
            masks = [[1] * new for _ in range(batch)]
        else:
            m = torch.as_tensor(attention_mask)
            if m.ndim != 2:
                raise UnsupportedOptionError(
                    f"the attention mask must be 2-D (batch, positions), not of shape "
                    f"{tuple(m.shape)}: qllama builds its own causal masks"
                )
            full = m.tolist()
            if tuple(m.shape) != (batch, past + new):
                raise UnsupportedOptionError(
                    f"the attention mask has shape {tuple(m.shape)}; expected ({batch}, "
                    f"{past + new}): the {past} cached positions, then the {new} new ones"
                )
            if any(v not in (0, 1) for r in full for v in r):
                raise UnsupportedOptionError("the attention mask must hold only 0s and 1s")
            for row, r in zip(qcache.rows, full, strict=True):
                if r[:past] != row.mask:
                    raise UnsupportedOptionError(
                        "the attention mask's cached positions differ from the ones the cache ran"
                    )
            masks = [r[past:] for r in full]
        for row, new_mask in zip(qcache.rows, masks, strict=True):
            seen = row.mask + new_mask
            first = seen.index(1) if 1 in seen else len(seen)
            run = seen[first:]
            if 0 in run and 1 in run[run.index(0) :]:
                raise UnsupportedOptionError(
                    "a row of the attention mask has a hole (padding between real tokens): "
                    "qllama runs one contiguous sequence per row"
                )
        if position_ids is not None:
            self._check_positions(position_ids, qcache, masks)
        return masks

    @staticmethod
    def _check_positions(position_ids: Any, qcache: QllamaCache, masks: list[list[int]]) -> None:
        """Position ids must be the ones qllama uses: real tokens counted from 0 (what
        generate derives from the mask); other ones (packed sequences) are refused."""
        pos = torch.as_tensor(position_ids).tolist()
        for row, new_mask, p in zip(qcache.rows, masks, pos, strict=True):
            n = len(row.tokens)
            for m, q in zip(new_mask, p, strict=True):
                if m and q != n:
                    raise UnsupportedOptionError(
                        f"position_ids {p} differ from the positions qllama runs (real tokens "
                        "counted from 0)"
                    )
                n += m

    def _run(
        self,
        qcache: QllamaCache,
        ids: list[list[int]],
        masks: list[list[int]],
        keep: int,
        output_hidden_states: Any,
    ) -> tuple[torch.Tensor, tuple[torch.Tensor | None, ...] | None]:
        """Run each row's new real tokens with its own KV cache; logits (B, kept, vocab)."""
        llm, (batch, new) = self.llm, (len(ids), len(ids[0]))
        kept = new if keep == 0 else min(keep, new)
        logits = torch.zeros(batch, kept, self.config.vocab_size, device=self.anchor.device)
        wanted = self._hidden_wanted(output_hidden_states)
        device = self.anchor.device
        hidden = {
            j: torch.zeros(batch, new, self.config.hidden_size, device=device) for j in wanted or ()
        }
        own = llm.cache
        try:
            for b, (row, row_ids, new_mask) in enumerate(zip(qcache.rows, ids, masks, strict=True)):
                real = [j for j in range(new) if new_mask[j]]
                if real:
                    last_only = keep == 1
                    if last_only and real[-1] != new - 1:
                        raise UnsupportedOptionError(
                            "the last position of a row is padding (right padding) but only the "
                            "last logits were asked for: pad on the left to generate"
                        )
                    seen: dict[str, Any] = {}
                    llm.cache = row.kv
                    out = llm.forward(
                        [row_ids[j] for j in real],
                        pos=len(row.tokens),
                        all_logits=not last_only,
                        observer=seen.__setitem__ if hidden else None,
                    )
                    row.kv = llm.cache
                    row.tokens += [row_ids[j] for j in real]
                    if last_only:
                        logits[b, -1] = _torch(out)
                    else:
                        at = torch.tensor(real) - (new - kept)
                        use = at >= 0
                        logits[b, at[use]] = _torch(out)[use]
                    for j in hidden:
                        hidden[j][b, real] = self._hidden(seen, j)
                row.mask += new_mask
        finally:
            llm.cache = own
        if wanted is None:
            return logits, None
        n_states = self.config.num_hidden_layers + 1
        return logits, tuple(hidden.get(j) for j in range(n_states))

    def _hidden_wanted(self, selection: Any) -> list[int] | None:
        """Which of the L+1 hidden states to keep: all for True, the indices given (negative
        ones from the end, out of range ones dropped, as transformers does); None when none
        are asked for."""
        if selection is None:
            selection = self.config.output_hidden_states
        n = self.config.num_hidden_layers + 1
        if selection is True:
            return list(range(n))
        if selection is False or selection is None:
            return None
        picks = [selection] if isinstance(selection, int) else list(selection)
        return sorted({i % n for i in picks if -n <= i < n})

    def _hidden(self, seen: dict[str, Any], j: int) -> torch.Tensor:
        """Hidden state ``j`` in transformers' convention: 0 the embeddings, i the output of
        block i - 1, and the last one after the final norm (what the output matrix sees)."""
        L, llm = self.config.num_hidden_layers, self.llm
        if j == 0:
            return _torch(seen["embedding"])
        x = seen[f"blk.{j - 1}.out"]
        if j == L:
            x = rms_norm(x, llm.weights.output_norm, llm.config.eps, xp=llm.xp)
        return _torch(x)
