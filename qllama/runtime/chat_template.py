"""A GGUF's chat template (``tokenizer.chat_template``): render it, encode it.

The template is Jinja code from a stranger's file. It renders in jinja2's sandbox under a
budget of steps, sizes, output and time (:class:`Limits`; how, in
:mod:`qllama.runtime.template_sandbox`, which is imported with the first render). Any failure
becomes one :class:`~qllama.errors.ChatTemplateError` that gives the reason; the process goes
on.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import replace
from typing import TYPE_CHECKING, Any

from qllama.errors import ChatTemplateError
from qllama.runtime.template_limits import DEFAULT_LIMITS, Limits

if TYPE_CHECKING:
    from qllama.runtime.tokenizer import Tokenizer

__all__ = ["DEFAULT_LIMITS", "ChatTemplate", "Limits", "encode_chat", "render_chat"]


def render_chat(
    template: str,
    messages: Sequence[Mapping[str, Any]],
    *,
    add_generation_prompt: bool = True,
    limits: Limits = DEFAULT_LIMITS,
    **kwargs: Any,
) -> str:
    """Render a chat template for ``messages``. ``bos_token``, ``eos_token``, ``tools``
    and any other keyword go to the template as variables.

    Raises :class:`ChatTemplateError` (with the reason) for anything that goes wrong.
    """
    if not isinstance(template, str):
        kind = type(template).__name__
        raise ChatTemplateError(f"a chat template must be a string, not {kind}")
    if len(template) > limits.max_template_chars:
        raise ChatTemplateError(
            f"the chat template has {len(template)} characters, over the limit of "
            f"{limits.max_template_chars}"
        )
    from qllama.runtime import template_sandbox  # jinja2, loaded with the first render

    return template_sandbox.render(template, messages, add_generation_prompt, kwargs, limits)


def _special_text(tok: Tokenizer, token_id: int | None) -> str:
    return tok.tokens[token_id] if token_id is not None else ""


def encode_chat(
    tokenizer: Tokenizer,
    template: str,
    messages: Sequence[Mapping[str, Any]],
    *,
    add_generation_prompt: bool = True,
    add_bos: bool = False,
    limits: Limits = DEFAULT_LIMITS,
    **kwargs: Any,
) -> list[int]:
    """Render ``template`` and encode the text with special tokens recognised.

    ``bos_token`` and ``eos_token`` default to the tokenizer's. No BOS is added beyond what
    the template writes (``add_bos=False``, as transformers' ``apply_chat_template``).
    """
    kwargs.setdefault("bos_token", _special_text(tokenizer, tokenizer.bos_id))
    kwargs.setdefault("eos_token", _special_text(tokenizer, tokenizer.eos_id))
    text = render_chat(
        template, messages, add_generation_prompt=add_generation_prompt, limits=limits, **kwargs
    )
    return tokenizer.encode(text, add_bos=add_bos, add_eos=False, special=True)


class ChatTemplate:
    """A file's chat template, ready to render (and to encode, given its tokenizer)."""

    def __init__(
        self, source: str, tokenizer: Tokenizer | None = None, *, limits: Limits = DEFAULT_LIMITS
    ) -> None:
        self.source = source
        self.tokenizer = tokenizer
        self.limits = limits

    def with_limits(self, **changes: Any) -> ChatTemplate:
        """The same template under other limits (``max_seconds=5``...)."""
        return ChatTemplate(self.source, self.tokenizer, limits=replace(self.limits, **changes))

    def render(
        self,
        messages: Sequence[Mapping[str, Any]],
        *,
        add_generation_prompt: bool = True,
        **kwargs: Any,
    ) -> str:
        """The prompt text; ``bos_token``/``eos_token`` default to the tokenizer's."""
        if self.tokenizer is not None:
            kwargs.setdefault("bos_token", _special_text(self.tokenizer, self.tokenizer.bos_id))
            kwargs.setdefault("eos_token", _special_text(self.tokenizer, self.tokenizer.eos_id))
        return render_chat(
            self.source,
            messages,
            add_generation_prompt=add_generation_prompt,
            limits=self.limits,
            **kwargs,
        )

    def encode(
        self,
        messages: Sequence[Mapping[str, Any]],
        *,
        add_generation_prompt: bool = True,
        add_bos: bool = False,
        **kwargs: Any,
    ) -> list[int]:
        """The prompt's token ids (see :func:`encode_chat`)."""
        if self.tokenizer is None:
            raise ChatTemplateError("this chat template has no tokenizer to encode with")
        return encode_chat(
            self.tokenizer,
            self.source,
            messages,
            add_generation_prompt=add_generation_prompt,
            add_bos=add_bos,
            limits=self.limits,
            **kwargs,
        )
