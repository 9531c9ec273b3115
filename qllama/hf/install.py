"""The opt-in for code whose imports cannot change: transformers' own names, patched.

After :func:`install`, exactly these load a GGUF file through qllama (as the drop-in names of
:mod:`qllama.hf.auto` do) and pass every other call to transformers unchanged:

- ``transformers.AutoModelForCausalLM.from_pretrained``;
- ``transformers.AutoTokenizer.from_pretrained``;
- ``transformers.pipeline`` (and ``transformers.pipelines.pipeline``, the same function).

Nothing else is touched: ``AutoModel``, ``LlamaForCausalLM.from_pretrained`` and the other
classes still read only transformers' formats. A script that did ``from transformers import
pipeline`` before :func:`install` keeps the function it imported; ``python -m qllama.hf
script.py`` (:mod:`qllama.hf.__main__`) installs first, then runs the script. :func:`uninstall`
puts back what was there.
"""

from __future__ import annotations

import threading
from typing import Any

import transformers
import transformers.pipelines

from qllama.hf import auto

_MISSING = object()
# (owner, attribute) -> what install replaced (_MISSING: the owner had no own attribute)
_replaced: dict[tuple[Any, str], Any] = {}
_lock = threading.Lock()


def _model_from_pretrained(
    cls: type, pretrained_model_name_or_path: Any, *args: Any, **kwargs: Any
) -> Any:
    return auto.model_from_pretrained(cls, pretrained_model_name_or_path, *args, **kwargs)


def _tokenizer_from_pretrained(
    cls: type, pretrained_model_name_or_path: Any, *args: Any, **kwargs: Any
) -> Any:
    return auto.tokenizer_from_pretrained(cls, pretrained_model_name_or_path, *args, **kwargs)


def _patches() -> dict[tuple[Any, str], Any]:
    return {
        (transformers.AutoModelForCausalLM, "from_pretrained"): classmethod(_model_from_pretrained),
        (transformers.AutoTokenizer, "from_pretrained"): classmethod(_tokenizer_from_pretrained),
        (transformers, "pipeline"): auto.pipeline,
        (transformers.pipelines, "pipeline"): auto.pipeline,
    }


def installed() -> bool:
    """Whether transformers' names are patched now."""
    return bool(_replaced)


def install() -> None:
    """Patch transformers' ``AutoModelForCausalLM.from_pretrained``,
    ``AutoTokenizer.from_pretrained`` and ``pipeline`` to load GGUF files through qllama.
    Calling it again changes nothing."""
    with _lock:
        if _replaced:
            return
        for (owner, name), patch in _patches().items():
            _replaced[owner, name] = vars(owner).get(name, _MISSING)
            setattr(owner, name, patch)


def uninstall() -> None:
    """Put back what :func:`install` replaced (nothing happens if it was not installed)."""
    with _lock:
        for (owner, name), before in _replaced.items():
            if before is _MISSING:
                delattr(owner, name)
            else:
                setattr(owner, name, before)
        _replaced.clear()
