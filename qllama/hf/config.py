"""``QllamaConfig``: what transformers reads of a qllama model, and where the model came from.

transformers and the tools built on it read a handful of fields from ``model.config``: the
vocabulary and widths, ``max_position_embeddings`` (lm-eval's context length), the special
token ids generate stops and pads with. The rest of the configuration stays qllama's own
(:class:`qllama.runtime.config.ModelConfig`, read from the file); this one also records the GGUF
path and the load options, so that ``AutoModelForCausalLM.from_config(config)`` loads the
same file with the same arithmetic.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any

from transformers import PretrainedConfig

if TYPE_CHECKING:
    from qllama.runtime.model import Model

MODEL_TYPE = "qllama"


class QllamaConfig(PretrainedConfig):
    """The transformers configuration of a GGUF file loaded by qllama.

    ``gguf_path`` and ``load_options`` (the keywords of :func:`qllama.load`: ``backend``,
    ``dequantize_all``, ``activations``...) say how to build the model again.
    """

    model_type = MODEL_TYPE

    def __init__(
        self,
        gguf_path: str | None = None,
        load_options: dict[str, Any] | None = None,
        architecture: str = "",
        vocab_size: int = 0,
        hidden_size: int = 0,
        num_hidden_layers: int = 0,
        num_attention_heads: int = 0,
        num_key_value_heads: int = 0,
        intermediate_size: int = 0,
        max_position_embeddings: int = 0,
        **kwargs: Any,
    ) -> None:
        self.gguf_path = gguf_path
        self.load_options = dict(load_options or {})
        self.architecture = architecture
        self.vocab_size = vocab_size
        self.hidden_size = hidden_size
        self.num_hidden_layers = num_hidden_layers
        self.num_attention_heads = num_attention_heads
        self.num_key_value_heads = num_key_value_heads
        self.intermediate_size = intermediate_size
        self.max_position_embeddings = max_position_embeddings
        # qllama has no tied parameters to tie: the output matrix is the file's tensor
        kwargs["tie_word_embeddings"] = False
        self.use_cache = kwargs.pop("use_cache", True)
        super().__init__(**kwargs)

    @classmethod
    def from_llm(
        cls,
        llm: Model,
        gguf_path: str | os.PathLike[str] | None = None,
        load_options: dict[str, Any] | None = None,
    ) -> QllamaConfig:
        """The configuration of a loaded qllama model.

        ``eos_token_id`` lists every id that ends generation in llama.cpp (EOS, end of turn and
        the rest of its EOG set), so ``generate`` stops where qllama's own loop stops.
        """
        c, tok = llm.config, llm.tokenizer
        stops = sorted(tok.stop_ids)
        pad = tok.pad_id if tok.pad_id is not None else (stops[0] if stops else None)
        return cls(
            gguf_path=None if gguf_path is None else os.fspath(gguf_path),
            load_options=load_options,
            architecture=c.arch,
            vocab_size=c.n_vocab,
            hidden_size=c.n_embd,
            num_hidden_layers=c.n_layer,
            num_attention_heads=c.n_head,
            num_key_value_heads=c.n_head_kv,
            intermediate_size=c.n_ff,
            max_position_embeddings=llm.n_ctx,
            bos_token_id=tok.bos_id,
            eos_token_id=stops if len(stops) != 1 else stops[0],
            pad_token_id=pad,
        )
