"""qllama models through transformers: ``generate``, pipelines and lm-evaluation-harness, with
the GGUF weights as the file stores them and the arithmetic of qllama's backend.

- :class:`QllamaForCausalLM`: a ``PreTrainedModel`` + ``GenerationMixin`` over a loaded
  qllama model (``QllamaForCausalLM.from_gguf(path, backend=..., dequantize_all=...)``);
- :class:`QllamaCache`: the transformers ``Cache`` carrying qllama's KV caches, one per row;
- :class:`QllamaTokenizer`: a transformers tokenizer that is qllama's (llama.cpp's ids, the
  file's chat template, special tokens and BOS/EOS rules);
- :class:`QllamaConfig`: registered with ``AutoConfig`` and ``AutoModelForCausalLM`` as model
  type ``"qllama"`` when this package is imported.

Needs the ``hf`` extra (torch and a transformers release in :data:`TRANSFORMERS_RANGE`; the
cache API moves between 5.x releases, so others are refused at import). docs/transformers.md
has the guide.
"""

from __future__ import annotations

import re

import transformers

TRANSFORMERS_RANGE = ("5.0.0", "5.24.0")  # tested at both ends (nox -s hf)


def _version(text: str) -> tuple[int, ...]:
    return tuple(int(x) for x in re.findall(r"\d+", text)[:3])


def check_transformers_version(version: str) -> None:
    """Refuse a transformers outside :data:`TRANSFORMERS_RANGE` (raises ImportError)."""
    low, high = TRANSFORMERS_RANGE
    if not _version(low) <= _version(version) <= _version(high):
        raise ImportError(
            f"qllama.hf supports transformers {low} to {high} (its cache API changes between "
            f"releases); transformers {version} is installed: pip install 'qllama[hf]'"
        )


check_transformers_version(transformers.__version__)

from transformers import AutoConfig, AutoModelForCausalLM  # noqa: E402

from qllama.hf.cache import QllamaCache  # noqa: E402
from qllama.hf.config import MODEL_TYPE, QllamaConfig  # noqa: E402
from qllama.hf.model import QllamaForCausalLM  # noqa: E402
from qllama.hf.tokenizer import QllamaTokenizer  # noqa: E402

AutoConfig.register(MODEL_TYPE, QllamaConfig, exist_ok=True)
AutoModelForCausalLM.register(QllamaConfig, QllamaForCausalLM, exist_ok=True)

__all__ = [
    "TRANSFORMERS_RANGE",
    "QllamaCache",
    "QllamaConfig",
    "QllamaForCausalLM",
    "QllamaTokenizer",
]
