"""The chat templates of each family render and tokenize as llama.cpp does.

Three renderers of the same template (tests/conformance/chats.py, the real templates of
llama.cpp's models/templates):

- qllama (jinja2 in a sandbox), which equals transformers' ``render_jinja_template``, the
  Jinja reference the hubs use (the default tests check that);
- llama.cpp's Jinja engine (common/jinja, what ``llama-server --jinja`` and ``llama-cli`` run),
  through llama-server's ``/apply-template`` on the family's conformance model. It equals
  qllama, up to the one thing it does on purpose: when the vocabulary adds BOS itself, it
  drops the template's leading BOS text (and a trailing EOS when it adds EOS), since its
  tokenizer adds that token; the token ids are then the same. Where the template refuses a
  system message (Gemma's raise_exception), llama.cpp merges the system text into the first
  user turn instead; qllama follows the template and raises ChatTemplateError, as transformers
  does;
- llama.cpp's C engine (``llama_chat_apply_template``), which recognises a family by
  substrings of the template and writes a fixed format. Where it disagrees with the Jinja
  template (:data:`C_ENGINE_AGREES`), qllama follows the template.

The ids: qllama's tokenizer against llama.cpp's on each rendered prompt, on the conformance
model's tiny vocabulary (the chat tokens CONTROL) and on the family's real vocabulary where
llama.cpp ships it (ggml-vocab-llama-bpe, -qwen2, -phi-3).
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import conformance as C
from conformance.chats import CONVERSATIONS, FAMILIES, KWARGS, template_path
from conformance.runners import LlamaServer, c_template, llama_cpp_tokens
from conformance.sources import llama_cpp_source

import qllama
from qllama.errors import ChatTemplateError
from qllama.runtime.chat_template import ChatTemplate
from qllama.runtime.tokenizer import Tokenizer

pytest.importorskip("llama_cpp")
pytestmark = pytest.mark.peers

# Whether llama.cpp's C engine writes what the Jinja template writes (both as llama.cpp
# tokenizes them: no BOS text when the vocabulary adds BOS). Where not, why:
C_ENGINE_AGREES: dict[tuple[str, str], bool] = {
    # Llama 3.x: the template's system turn ("Cutting Knowledge Date: December 2023\nToday
    # Date: ...") is missing from the C engine's
    **{(f, c): False for f in ("llama3.1", "llama3.2") for c in CONVERSATIONS},
    # Qwen2.5: the template's default system prompt ("You are Qwen, created by Alibaba Cloud.
    # You are a helpful assistant.") is missing without a system message
    ("qwen2.5", "user"): False,
    ("qwen2.5", "system"): True,
    ("qwen2.5", "closed"): False,
    # Qwen3: the template gives the last assistant turn an empty <think>\n\n</think>\n\n block
    ("qwen3", "user"): True,
    ("qwen3", "system"): True,
    ("qwen3", "closed"): False,
    ("gemma2", "user"): True,
    ("gemma2", "closed"): True,  # ("gemma2", "system"): the template refuses it
    # Phi-3.5: the template ends a conversation without a generation prompt with eos_token
    ("phi3.5", "user"): True,
    ("phi3.5", "system"): True,
    ("phi3.5", "closed"): False,
    # Mistral Nemo: the template puts the system text into the last user turn, the C engine
    # (its "v3-tekken" format) into the first
    ("mistral-nemo", "user"): True,
    ("mistral-nemo", "system"): False,
    ("mistral-nemo", "closed"): True,
}
CASES = [(f, c) for f in FAMILIES for c in CONVERSATIONS]
IDS = [f"{f}-{c}" for f, c in CASES]


@pytest.fixture(scope="module")
def models() -> Path:
    return llama_cpp_source() / "models"


def as_llama_cpp_prompt(text: str, tok: Tokenizer) -> str:
    """A rendered prompt as llama.cpp's chat code hands it to its tokenizer: without the
    leading BOS text when the vocabulary adds BOS, without a trailing EOS when it adds EOS."""
    bos = tok.tokens[tok.bos_id] if tok.bos_id is not None else ""
    eos = tok.tokens[tok.eos_id] if tok.eos_id is not None else ""
    if tok.add_bos and bos and text.startswith(bos):
        text = text[len(bos) :]
    if tok.vocab.add_eos and eos and text.endswith(eos):
        text = text[: -len(eos)]
    return text


class Conformance:
    """A family's conformance model: its tokenizer, the template, llama-server on it."""

    def __init__(self, family: str, models: Path, llama_bin: Path) -> None:
        self.built = C.build(FAMILIES[family].model)
        f = qllama.read_gguf(self.built.gguf)
        self.tok = Tokenizer.from_gguf(f)
        f.close()
        self.path = template_path(models, family)
        self.chat = ChatTemplate(self.path.read_text(), self.tok)
        self.server = LlamaServer(llama_bin, self.built.gguf, template=self.path)

    def render(self, messages: list[dict[str, str]], generation: bool) -> str:
        return self.chat.render(messages, add_generation_prompt=generation, **KWARGS)


@pytest.fixture(scope="module")
def started(models: Path, llama_bin: Path) -> Iterator[Callable[[str], Conformance]]:
    """A family's server, started the first time a test asks for it; all closed at the end."""
    running: dict[str, Conformance] = {}

    def get(family: str) -> Conformance:
        if family not in running:
            running[family] = Conformance(family, models, llama_bin)
        return running[family]

    yield get
    for c in running.values():
        c.server.close()


@pytest.mark.parametrize(("family", "conversation"), CASES, ids=IDS)
def test_llama_cpp_jinja_engine(
    started: Callable[[str], Conformance], family: str, conversation: str
) -> None:
    """llama.cpp's Jinja engine renders what qllama renders, and the ids llama.cpp would run
    are qllama's: its BOS where the template wrote one, plus one where the template wrote none
    but the vocabulary adds BOS (qllama, as transformers, adds nothing to a chat prompt)."""
    c = started(family)
    messages, generation = CONVERSATIONS[conversation]
    theirs = c.server.apply_template(messages, add_generation_prompt=generation, **KWARGS)
    if family == "gemma2" and conversation == "system":
        with pytest.raises(ChatTemplateError, match="System role not supported"):
            c.render(messages, generation)
        # llama.cpp instead joins the system text to the first user message with a newline
        merged = [
            {"role": "user", "content": messages[0]["content"] + "\n" + messages[1]["content"]},
            *messages[2:],
        ]
        assert theirs == as_llama_cpp_prompt(c.render(merged, generation), c.tok)
        return
    ours = c.render(messages, generation)
    assert as_llama_cpp_prompt(ours, c.tok) == theirs
    our_ids = c.chat.encode(messages, add_generation_prompt=generation, **KWARGS)
    bos = c.tok.bos_id
    extra = [bos] if c.tok.add_bos and bos is not None and our_ids[:1] != [bos] else []
    assert c.server.tokenize(theirs) == extra + our_ids


@pytest.mark.parametrize(("family", "conversation"), CASES, ids=IDS)
def test_llama_cpp_c_engine(models: Path, family: str, conversation: str) -> None:
    """Where llama.cpp's C engine writes what the template writes, and where it does not
    (qllama follows the template)."""
    messages, generation = CONVERSATIONS[conversation]
    source = template_path(models, family).read_text()
    built = C.build(FAMILIES[family].model)
    f = qllama.read_gguf(built.gguf)
    tok = Tokenizer.from_gguf(f)
    f.close()
    theirs = c_template(source, messages, add_generation_prompt=generation)
    try:
        ours = ChatTemplate(source, tok).render(
            messages, add_generation_prompt=generation, **KWARGS
        )
    except ChatTemplateError:
        assert (family, conversation) == ("gemma2", "system")  # the template refuses it
        # the C engine trims the system text and puts it before the first user message
        assert theirs.startswith("<start_of_turn>user\nBe brief.\n\nHello, world \n  ok?")
        return
    assert (as_llama_cpp_prompt(ours, tok) == theirs) == C_ENGINE_AGREES[family, conversation]


REAL = [(f, c) for f, c in CASES if FAMILIES[f].vocab is not None]


@pytest.mark.parametrize(("family", "conversation"), REAL, ids=[f"{f}-{c}" for f, c in REAL])
def test_real_vocabulary_ids(models: Path, family: str, conversation: str) -> None:
    """The family's real tokenizer (llama.cpp's vocabulary file): qllama's ids of the rendered
    prompt are llama.cpp's (special tokens parsed, nothing added: the BOS is in the text)."""
    vocab = models / f"ggml-vocab-{FAMILIES[family].vocab}.gguf"
    f = qllama.read_gguf(vocab)
    tok = Tokenizer.from_gguf(f)
    f.close()
    messages, generation = CONVERSATIONS[conversation]
    chat = ChatTemplate(template_path(models, family).read_text(), tok)
    text = chat.render(messages, add_generation_prompt=generation, **KWARGS)
    ours = chat.encode(messages, add_generation_prompt=generation, **KWARGS)
    assert ours == llama_cpp_tokens(vocab, text)
