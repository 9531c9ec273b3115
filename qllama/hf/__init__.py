"""qllama models through transformers: ``generate``, pipelines and lm-evaluation-harness, with
the GGUF weights as the file stores them and the arithmetic of qllama's backend.

Drop-in names, with transformers' signatures (a GGUF file loads through qllama, anything
else is transformers' own; :mod:`qllama.hf.auto`):

- :class:`AutoModelForCausalLM`, :class:`AutoTokenizer`, :func:`pipeline`;
- :func:`install` / :func:`uninstall`: the same behaviour patched into transformers' own
  ``AutoModelForCausalLM.from_pretrained``, ``AutoTokenizer.from_pretrained`` and
  ``pipeline``, for code whose imports cannot change (``python -m qllama.hf script.py``);

and the classes under them:

- :class:`QllamaForCausalLM`: a ``PreTrainedModel`` + ``GenerationMixin`` over a loaded
  qllama model (``QllamaForCausalLM.from_gguf(path, backend=..., dequantize_all=...)``);
- :class:`QllamaCache`: the transformers ``Cache`` carrying qllama's KV caches, one per row;
- :class:`QllamaTokenizer`: a transformers tokenizer that is qllama's (llama.cpp's ids, the
  file's chat template, special tokens and BOS/EOS rules);
- :class:`QllamaConfig`: registered with ``AutoConfig`` and ``AutoModelForCausalLM`` as model
  type ``"qllama"`` when this package is imported.

Needs the ``hf`` extra (torch and transformers >= 4.57). Tested with the releases at both ends
of :data:`TRANSFORMERS_RANGE`; another one warns, and is refused only when an API the
adapter uses is missing (:mod:`qllama.hf.compat`). docs/transformers.md has the guide.
"""

from __future__ import annotations

import transformers

from qllama.hf.compat import (
    TRANSFORMERS_RANGE,
    UntestedTransformersWarning,
    check_transformers,
    check_transformers_version,
)

check_transformers(transformers.__version__)

from qllama.hf.auto import AutoModelForCausalLM, AutoTokenizer, pipeline  # noqa: E402
from qllama.hf.cache import QllamaCache  # noqa: E402
from qllama.hf.config import MODEL_TYPE, QllamaConfig  # noqa: E402
from qllama.hf.install import install, installed, uninstall  # noqa: E402
from qllama.hf.model import QllamaForCausalLM  # noqa: E402
from qllama.hf.tokenizer import QllamaTokenizer  # noqa: E402

transformers.AutoConfig.register(MODEL_TYPE, QllamaConfig, exist_ok=True)
transformers.AutoModelForCausalLM.register(QllamaConfig, QllamaForCausalLM, exist_ok=True)

__all__ = [
    "TRANSFORMERS_RANGE",
    "AutoModelForCausalLM",
    "AutoTokenizer",
    "QllamaCache",
    "QllamaConfig",
    "QllamaForCausalLM",
    "QllamaTokenizer",
    "UntestedTransformersWarning",
    "check_transformers_version",
    "install",
    "installed",
    "pipeline",
    "uninstall",
]
