"""The chat templates of the families and the conversations they are checked on.

The templates are the real ones that llama.cpp ships (``models/templates`` of the pinned tree,
as the model makers wrote them); the default tests (tests/test_chat_template.py) and the peer
tests (tests/peers/test_chat_templates.py) render the same conversations with them.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any


@dataclass(frozen=True)
class Family:
    """A family's chat template, the conformance model whose tiny vocabulary has its chat
    tokens, and the llama.cpp vocabulary file of the real tokenizer (None: not in the tree)."""

    template: str  # models/templates/<template>
    model: str  # a name of conformance.MODELS
    vocab: str | None  # models/ggml-vocab-<vocab>.gguf


FAMILIES: dict[str, Family] = {
    "llama3.1": Family("meta-llama-Llama-3.1-8B-Instruct.jinja", "llama", "llama-bpe"),
    "llama3.2": Family("meta-llama-Llama-3.2-3B-Instruct.jinja", "llama3-rope", "llama-bpe"),
    "qwen2.5": Family("Qwen-Qwen2.5-7B-Instruct.jinja", "qwen2", "qwen2"),  # ChatML
    "qwen3": Family("Qwen-Qwen3-0.6B.jinja", "qwen3", "qwen2"),
    "gemma2": Family("google-gemma-2-2b-it.jinja", "gemma2", None),  # no Gemma 2/3 vocabulary
    "phi3.5": Family("microsoft-Phi-3.5-mini-instruct.jinja", "phi3", "phi-3"),
    "mistral-nemo": Family("mistralai-Mistral-Nemo-Instruct-2407.jinja", "mistral-nemo", None),
}

# name -> (messages, add_generation_prompt): a first turn; every role with whitespace and
# non-ASCII text in the contents; a finished conversation (no generation prompt)
CONVERSATIONS: dict[str, tuple[list[dict[str, str]], bool]] = {
    "user": ([{"role": "user", "content": "Hi there"}], True),
    "system": (
        [
            {"role": "system", "content": "Be brief."},
            {"role": "user", "content": " Hello, world \n  ok?"},
            {"role": "assistant", "content": "Hi! 🎉 l'été"},
            {"role": "user", "content": "Bye\n\n"},
        ],
        True,
    ),
    "closed": (
        [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello."}],
        False,
    ),
}

# Llama 3.x write today's date into the system turn unless the caller gives one: fixed here so
# that the renderings do not change with the clock (3.1's own default is this date)
KWARGS: dict[str, Any] = {"date_string": "26 Jul 2024"}


def template_path(models: Path, family: str) -> Path:
    """The template file of ``family`` in llama.cpp's ``models`` folder."""
    return models / "templates" / FAMILIES[family].template
