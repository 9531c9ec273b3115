"""``QllamaTokenizer``: a transformers tokenizer that is qllama's, so its ids are llama.cpp's.

transformers can build a tokenizer from a GGUF too (``gguf_file=``), but it converts the
vocabulary into its own pipeline, which misses llama.cpp's ids on several vocabularies
(llama-spm's whitespace, falcon, SmolLM2's ``smollm`` digits split "  42" as [216, 216, 36,
34] where llama.cpp gives [256, 36, 34]; docs/transformers.md). This one converts nothing: text
goes through :class:`qllama.runtime.tokenizer.Tokenizer` (llama.cpp's special-token partition,
pre-tokenizers and merges), chat messages through the file's template in qllama's sandbox
(:mod:`qllama.runtime.chat_template`). transformers' side (padding, truncation, tensors, batches,
``decode``, the pipeline and streamer plumbing) is its own.

Conventions where the two libraries differ, chosen as llama.cpp does:

- ``add_special_tokens=True`` adds BOS and EOS as the file says (``tokenizer.ggml.add_bos_token``
  / ``add_eos_token``); ``False`` adds neither;
- special tokens written in the text are recognised (llama.cpp's ``parse_special``) unless
  ``split_special_tokens=True``; USER_DEFINED tokens always are;
- ``skip_special_tokens`` leaves out CONTROL and UNKNOWN tokens;
- padding is on the left (generation batches need it); ``padding_side="right"`` changes it.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from typing import Any

from transformers import PreTrainedTokenizer

from qllama.errors import ChatTemplateError, TokenizerError, UnsupportedOptionError
from qllama.runtime.chat_template import ChatTemplate
from qllama.runtime.tokenizer import Tokenizer

# transformers' standard clean-up of spaces before punctuation and contractions, applied
# only when asked (clean_up_tokenization_spaces=True); llama.cpp has no such step
CLEAN_UP = (
    (" .", "."), (" ?", "?"), (" !", "!"), (" ,", ","), (" ' ", "'"), (" n't", "n't"),
    (" 'm", "'m"), (" 's", "'s"), (" 've", "'ve"), (" 're", "'re"),
)  # fmt: skip


def _messages(chat: Any) -> list[dict[str, Any]]:
    """Messages as plain dicts without None values (transformers' normalisation)."""
    msgs = chat.messages if hasattr(chat, "messages") else chat
    out = []
    for m in msgs:
        if not isinstance(m, Mapping):
            raise ChatTemplateError(f"chat messages must be dicts, not {type(m).__name__}")
        out.append({k: v for k, v in m.items() if v is not None})
    return out


def _tool_schemas(tools: Sequence[Any] | None) -> list[Any] | None:
    """Tools as JSON schemas; functions converted as transformers converts them."""
    if tools is None:
        return None
    from transformers.utils import get_json_schema

    return [t if isinstance(t, Mapping) else get_json_schema(t) for t in tools if t is not None]


class QllamaTokenizer(PreTrainedTokenizer):
    """A transformers tokenizer backed by a :class:`qllama.runtime.tokenizer.Tokenizer`.

    Build one with :meth:`from_llm` (a loaded model, or a :class:`QllamaForCausalLM`) or
    :meth:`from_gguf` (a path).
    """

    vocab_files_names = {}  # noqa: RUF012  (transformers' attribute; nothing to load)
    model_input_names = ["input_ids", "attention_mask"]  # noqa: RUF012

    def __init__(
        self,
        tokenizer: Tokenizer,
        chat_template: ChatTemplate | str | None = None,
        **kwargs: Any,
    ) -> None:
        self.qllama = tokenizer
        self._vocab = {t: i for i, t in enumerate(tokenizer.tokens)}  # a repeated text: last id
        if isinstance(chat_template, ChatTemplate):
            chat_template = chat_template.source

        def text(token_id: int | None) -> str | None:
            return None if token_id is None else tokenizer.tokens[token_id]

        pad = tokenizer.pad_id if tokenizer.pad_id is not None else tokenizer.eos_id
        kwargs.setdefault("bos_token", text(tokenizer.bos_id))
        kwargs.setdefault("eos_token", text(tokenizer.eos_id))
        kwargs.setdefault("unk_token", text(tokenizer.unk_id))
        kwargs.setdefault("pad_token", text(pad))
        kwargs.setdefault("padding_side", "left")
        kwargs.setdefault("clean_up_tokenization_spaces", False)
        add = (tokenizer.vocab.add_bos, tokenizer.vocab.add_eos)
        patterns = {(True, True): "bos_eos", (True, False): "bos", (False, True): "eos"}
        kwargs["special_tokens_pattern"] = patterns.get(add, "none")
        super().__init__(chat_template=chat_template, **kwargs)

    @classmethod
    def from_llm(cls, model: Any, **kwargs: Any) -> QllamaTokenizer:
        """The tokenizer of a model :func:`qllama.load` returned, or of a QllamaForCausalLM."""
        llm = getattr(model, "llm", model)
        kwargs.setdefault("model_max_length", llm.n_ctx)
        return cls(llm.tokenizer, llm.chat_template, **kwargs)

    @classmethod
    def from_gguf(cls, path: str | os.PathLike[str], **kwargs: Any) -> QllamaTokenizer:
        """The tokenizer and chat template of a GGUF file (its weights are not read)."""
        from qllama.gguf.reader import read_gguf

        with read_gguf(path) as f:
            template = f.get("tokenizer.chat_template")
            context = f.get(f"{f.get('general.architecture')}.context_length")
            tok = Tokenizer.from_gguf(f)
        if isinstance(context, int):
            kwargs.setdefault("model_max_length", context)
        return cls(tok, template if isinstance(template, str) else None, **kwargs)

    # -- the vocabulary -----------------------------------------------------------------------

    @property
    def vocab_size(self) -> int:
        return self.qllama.n_vocab

    def __len__(self) -> int:
        return self.qllama.n_vocab

    def get_vocab(self) -> dict[str, int]:
        return dict(self._vocab)

    def _convert_token_to_id(self, token: str) -> int | None:
        found = self._vocab.get(token)
        return self.qllama.unk_id if found is None else found

    def _convert_id_to_token(self, index: int) -> str:
        return self.qllama.tokens[index]

    def convert_tokens_to_string(self, tokens: list[str]) -> str:
        return self.qllama.decode([self._convert_token_to_id(t) for t in tokens])

    # -- encoding: qllama's ids, transformers' packaging ------------------------------------------

    def _ids(self, text: str, kwargs: Mapping[str, Any]) -> list[int]:
        split = kwargs.get("split_special_tokens", self.split_special_tokens)
        return self.qllama.encode(text, add_bos=False, add_eos=False, special=not split)

    def tokenize(self, text: str, **kwargs: Any) -> list[str]:  # type: ignore[override]
        """Token texts of ``text`` (no BOS/EOS unless ``add_special_tokens=True``)."""
        ids = self._ids(text, kwargs)
        if kwargs.get("add_special_tokens"):
            ids = self.build_inputs_with_special_tokens(ids)
        return [self.qllama.tokens[i] for i in ids]

    def build_inputs_with_special_tokens(
        self, token_ids_0: list[int], token_ids_1: list[int] | None = None
    ) -> list[int]:
        """BOS and EOS as the file says (``tokenizer.ggml.add_bos_token`` /
        ``add_eos_token``): transformers 5's ``special_tokens_pattern`` rules, spelled out so
        that transformers 4.57 (which has no such pattern) adds the same ones."""
        bos = [self.bos_token_id] if self.qllama.vocab.add_bos else []
        eos = [self.eos_token_id] if self.qllama.vocab.add_eos else []
        if None in bos + eos:
            raise TokenizerError("the file asks for BOS/EOS tokens it does not define")
        if token_ids_1 is None:
            return bos + token_ids_0 + eos
        second = bos + token_ids_1 if bos and not eos else token_ids_1 + eos
        return bos + token_ids_0 + eos + second

    def get_special_tokens_mask(
        self,
        token_ids_0: list[int],
        token_ids_1: list[int] | None = None,
        already_has_special_tokens: bool = False,
    ) -> list[int]:
        """1 where :meth:`build_inputs_with_special_tokens` adds a token, 0 elsewhere."""
        if already_has_special_tokens:
            return super().get_special_tokens_mask(token_ids_0, token_ids_1, True)
        marked = self.build_inputs_with_special_tokens([-1] * len(token_ids_0), None)
        if token_ids_1 is not None:
            marked = self.build_inputs_with_special_tokens(
                [-1] * len(token_ids_0), [-1] * len(token_ids_1)
            )
        return [0 if i == -1 else 1 for i in marked]

    def _encode_plus(self, text: Any, text_pair: Any = None, **kwargs: Any) -> Any:  # type: ignore[override]
        # a string becomes qllama's ids here; transformers then treats them as pre-encoded
        # input (special tokens, truncation, padding, tensors; batches come back one by one).
        # An empty list would read as an empty batch: a text without tokens stays a text
        if kwargs.get("sanitize_control_tokens"):
            raise UnsupportedOptionError(
                "sanitize_control_tokens: special tokens in text are recognised as llama.cpp does; "
                "pass split_special_tokens=True to encode them as text"
            )
        if isinstance(text, str):
            text = self._ids(text, kwargs) or text
        if isinstance(text_pair, str):
            text_pair = self._ids(text_pair, kwargs) or text_pair
        kwargs.pop("split_special_tokens", None)
        return super()._encode_plus(text, text_pair, **kwargs)

    def _batch_encode_plus(self, batch_text_or_text_pairs: Any, *args: Any, **kwargs: Any) -> Any:
        # transformers 4.57's batch path (transformers 5 sends each text through
        # _encode_plus): it would map token texts back to ids, which loses the id of a text
        # the vocabulary repeats, and drop split_special_tokens; so texts become qllama's
        # ids here, each item a (first, second) pair as that path reads them
        if kwargs.get("is_split_into_words"):
            return super()._batch_encode_plus(batch_text_or_text_pairs, *args, **kwargs)  # type: ignore[misc]
        split = kwargs.get("split_special_tokens", self.split_special_tokens)

        def ids(text: Any) -> Any:
            if isinstance(text, str):
                return self._ids(text, {"split_special_tokens": split}) or text
            return text

        items = []
        for item in batch_text_or_text_pairs:
            pair = isinstance(item, list | tuple) and len(item) == 2
            pair = pair and not isinstance(item[0], int)
            items.append((ids(item[0]), ids(item[1])) if pair else (ids(item), None))
        return super()._batch_encode_plus(items, *args, **kwargs)  # type: ignore[misc]

    # -- decoding -------------------------------------------------------------------------------

    def _decode(
        self,
        token_ids: int | list[int],
        skip_special_tokens: bool = False,
        clean_up_tokenization_spaces: bool | None = None,
        **kwargs: Any,
    ) -> str:
        ids = [token_ids] if isinstance(token_ids, int) else list(token_ids)
        text = self.qllama.decode(ids, skip_special=skip_special_tokens)
        clean = self.clean_up_tokenization_spaces
        if clean_up_tokenization_spaces if clean_up_tokenization_spaces is not None else clean:
            for spaced, joined in CLEAN_UP:
                text = text.replace(spaced, joined)
        return text

    # -- chat -----------------------------------------------------------------------------------

    def apply_chat_template(  # type: ignore[override]
        self,
        conversation: Any,
        tools: Sequence[Any] | None = None,
        documents: Sequence[Mapping[str, str]] | None = None,
        chat_template: str | None = None,
        add_generation_prompt: bool = False,
        continue_final_message: bool = False,
        tokenize: bool = True,
        padding: Any = False,
        truncation: bool = False,
        max_length: int | None = None,
        return_tensors: Any = None,
        return_dict: bool = True,
        return_assistant_tokens_mask: bool = False,
        tokenizer_kwargs: dict[str, Any] | None = None,
        sanitize_control_tokens: bool = False,
        **kwargs: Any,
    ) -> Any:
        """transformers' ``apply_chat_template``, rendered by qllama's sandboxed template
        (:class:`qllama.runtime.chat_template.ChatTemplate`, with its step, size and time budget)
        and
        encoded by qllama. ``**kwargs`` are template variables."""
        if return_assistant_tokens_mask or sanitize_control_tokens:
            name = (
                "return_assistant_tokens_mask"
                if return_assistant_tokens_mask
                else "sanitize_control_tokens"
            )
            raise UnsupportedOptionError(f"apply_chat_template({name}=True) is not supported")
        if continue_final_message and add_generation_prompt:
            raise ChatTemplateError(
                "continue_final_message and add_generation_prompt exclude each other"
            )
        source = chat_template or self.chat_template
        if not isinstance(source, str):
            raise ChatTemplateError("the tokenizer has no chat template (tokenizer.chat_template)")
        template = ChatTemplate(source, self.qllama)
        batched = (
            isinstance(conversation, list | tuple)
            and bool(conversation)
            and (isinstance(conversation[0], list | tuple) or hasattr(conversation[0], "messages"))
        )
        variables = {**self.special_tokens_map, **kwargs}
        variables.update(tools=_tool_schemas(tools), documents=documents)
        texts = []
        for chat in conversation if batched else [conversation]:
            messages = _messages(chat)
            text = template.render(
                messages, add_generation_prompt=add_generation_prompt, **variables
            )
            texts.append(self._continue(text, messages) if continue_final_message else text)
        if not tokenize:
            return texts if batched else texts[0]
        # the rendered text through qllama's encoding, special tokens recognised (the
        # template writes them); transformers packs the ids (padding, tensors)
        out = self(
            texts if batched else texts[0],
            add_special_tokens=False,
            split_special_tokens=False,
            padding=padding,
            truncation=truncation,
            max_length=max_length,
            return_tensors=return_tensors,
            **(tokenizer_kwargs or {}),
        )
        return out if return_dict else out["input_ids"]

    @staticmethod
    def _continue(text: str, messages: list[dict[str, Any]]) -> str:
        """The rendered chat cut after the final message's content, so that the model goes on
        writing it (the template's end-of-turn markup after it is dropped)."""
        final = messages[-1].get("content") if messages else None
        if not isinstance(final, str):
            raise ChatTemplateError(
                "continue_final_message needs a final message with text content"
            )
        end = text.rfind(final.strip())
        if not final.strip() or end < 0:
            raise ChatTemplateError(
                "continue_final_message: the final message is not in the rendered chat"
            )
        return text[: end + len(final.strip())]

    # -- refusals -------------------------------------------------------------------------------

    def save_pretrained(self, *args: Any, **kwargs: Any) -> Any:
        raise UnsupportedOptionError(
            "QllamaTokenizer is the GGUF file's tokenizer; there are no transformers files to "
            "save (QllamaTokenizer.from_gguf(path) builds it again)"
        )

    def save_vocabulary(
        self, save_directory: str, filename_prefix: str | None = None
    ) -> tuple[str, ...]:
        self.save_pretrained()
        return ()
