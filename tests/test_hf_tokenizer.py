"""qllama.hf.QllamaTokenizer: transformers' tokenizer interface, qllama's (llama.cpp's) ids.

transformers' own tokenizer from a GGUF (``gguf_file=``) converts the vocabulary into its
pipeline and misses llama.cpp's ids on several vocabularies; that known difference is
recorded here as a strict xfail, so a transformers release that fixes it is noticed.
"""

from __future__ import annotations

from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from test_architectures import SEPARATOR, vocab_folder  # noqa: E402, F401  (a fixture)

import qllama  # noqa: E402
from qllama.errors import ChatTemplateError, QllamaError, UnsupportedOptionError  # noqa: E402
from qllama.hf import QllamaTokenizer  # noqa: E402
from qllama.runtime.chat_template import ChatTemplate  # noqa: E402
from qllama.runtime.tokenizer import Tokenizer  # noqa: E402
from qllama.synthetic import TinyConfig, write_tiny  # noqa: E402

MESSAGES = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Hello the world"},
]


@pytest.fixture(scope="module", params=["gpt2", "llama"])
def tiny(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("tok") / f"{request.param}.gguf"
    write_tiny(path, TinyConfig(n_layer=1, vocab=request.param))
    return path


@pytest.fixture(scope="module")
def pair(tiny: Path) -> tuple[QllamaTokenizer, qllama.runtime.model.Model]:
    llm = qllama.load(tiny)
    return QllamaTokenizer.from_llm(llm), llm


def test_llama_cpp_tokenizer_vectors(vocab_folder: Path) -> None:  # noqa: F811
    """llama.cpp's test-tokenizer-0 vectors through the transformers interface
    (add_special_tokens=False, split_special_tokens=True: add_special and parse_special
    false, as the test runs them): every vocabulary qllama reads passes every text."""
    passed = []
    for vocab in sorted(vocab_folder.glob("ggml-vocab-*.gguf")):
        inp, out = Path(f"{vocab}.inp"), Path(f"{vocab}.out")
        if not (inp.exists() and out.exists()):
            continue
        try:
            tok = QllamaTokenizer.from_gguf(vocab)
        except QllamaError:
            continue  # refused at load (a pre-tokenizer qllama does not have), never approximated
        texts = inp.read_text(encoding="utf-8").split(SEPARATOR)
        expected = out.read_text(encoding="utf-8").split("\n")
        for text, ids in zip(texts, expected, strict=False):
            want = [int(t) for t in ids.split()]
            got = tok(text, add_special_tokens=False, split_special_tokens=True)["input_ids"]
            assert got == want, f"{vocab.name}: {text!r}"
        passed.append(vocab.name.removeprefix("ggml-vocab-").removesuffix(".gguf"))
    for name in (
        "llama-spm",
        "llama-bpe",
        "qwen2",
        "phi-3",
        "gpt-2",
        "falcon",
        "starcoder",
        "refact",
    ):
        assert name in passed, passed


@pytest.mark.model
@pytest.mark.xfail(
    strict=True, reason="transformers' GGUF tokenizer splits smollm's digits as GPT-2"
)
def test_transformers_gguf_tokenizer_gives_llama_cpps_ids(smollm2_path: Path) -> None:
    """SmolLM2's pre-tokenizer ``smollm`` isolates each digit: llama.cpp (and qllama) encode
    "  42" as [256, 36, 34]; transformers' converter falls back to GPT-2's regex, [216, 216,
    36, 34]."""
    pytest.importorskip("gguf")
    theirs = transformers.AutoTokenizer.from_pretrained(
        smollm2_path.parent, gguf_file=smollm2_path.name
    )
    ours = QllamaTokenizer.from_gguf(smollm2_path)
    text = "  42"
    assert ours(text, add_special_tokens=False)["input_ids"] == [256, 36, 34]
    assert theirs(text, add_special_tokens=False)["input_ids"] == [256, 36, 34]


def test_encode_is_qllamas(pair: tuple[QllamaTokenizer, qllama.runtime.model.Model]) -> None:
    """add_special_tokens adds BOS/EOS as the file says, exactly qllama's encode; special
    tokens in text are recognised unless split_special_tokens."""
    tok, llm = pair
    q = llm.tokenizer
    text = "Hello the world<|im_end|> at the"
    assert tok(text)["input_ids"] == q.encode(text)
    assert tok(text, add_special_tokens=False)["input_ids"] == q.encode(text, add_bos=False)
    assert (tok(text)["input_ids"][0] == q.bos_id) == q.add_bos
    end = q.token_id("<|im_end|>")
    assert end in tok(text)["input_ids"]
    assert end not in tok(text, split_special_tokens=True)["input_ids"]
    assert tok.encode(text) == q.encode(text)
    assert tok.tokenize(text) == [q.tokens[i] for i in q.encode(text, add_bos=False)]
    batch = tok([text, "at"], padding=True, return_tensors="pt")
    assert batch["input_ids"].shape[0] == 2 and batch["attention_mask"][1, 0] == 0  # left


def test_decode_is_qllamas(pair: tuple[QllamaTokenizer, qllama.runtime.model.Model]) -> None:
    tok, llm = pair
    q = llm.tokenizer
    ids = q.encode("Hello<|im_start|> the world, 世界")
    assert tok.decode(ids) == q.decode(ids)
    assert tok.decode(ids, skip_special_tokens=True) == q.decode(ids, skip_special=True)
    assert tok.batch_decode([ids, ids[:2]]) == [q.decode(ids), q.decode(ids[:2])]
    assert tok.decode(torch.tensor(ids)) == q.decode(ids)


def test_vocabulary_and_special_tokens(
    pair: tuple[QllamaTokenizer, qllama.runtime.model.Model],
) -> None:
    tok, llm = pair
    q = llm.tokenizer
    assert len(tok) == tok.vocab_size == q.n_vocab
    assert tok.bos_token_id == q.bos_id and tok.eos_token_id == q.eos_id
    assert tok.pad_token_id == (q.pad_id if q.pad_id is not None else q.eos_id)
    assert tok.convert_tokens_to_ids(tok.convert_ids_to_tokens([5, 6, 7])) == [5, 6, 7]
    assert tok.model_max_length == llm.n_ctx
    assert tok.padding_side == "left"


def test_chat_template_is_the_files_in_qllamas_sandbox(
    pair: tuple[QllamaTokenizer, qllama.runtime.model.Model],
) -> None:
    tok, llm = pair
    assert tok.chat_template == llm.chat_template.source
    ids = tok.apply_chat_template(MESSAGES, add_generation_prompt=True)["input_ids"]
    assert ids == llm.apply_chat_template(MESSAGES)
    text = tok.apply_chat_template(MESSAGES, add_generation_prompt=True, tokenize=False)
    assert text == llm.chat_template.render(MESSAGES)
    assert tok.apply_chat_template(MESSAGES, return_dict=False) == llm.apply_chat_template(
        MESSAGES, add_generation_prompt=False
    )
    batch = tok.apply_chat_template([MESSAGES, MESSAGES[1:]], padding=True, return_tensors="pt")
    assert batch["input_ids"].shape[0] == 2
    # a template that would run forever meets qllama's step budget, not transformers' jinja
    loop = "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}"
    with pytest.raises(ChatTemplateError, match="budget"):
        tok.apply_chat_template(MESSAGES, chat_template=loop)


def test_continue_final_message(pair: tuple[QllamaTokenizer, qllama.runtime.model.Model]) -> None:
    tok, _ = pair
    chat = [*MESSAGES, {"role": "assistant", "content": "The world is"}]
    text = tok.apply_chat_template(chat, continue_final_message=True, tokenize=False)
    assert text.endswith("The world is")
    assert text == tok.apply_chat_template(chat, tokenize=False)[: len(text)]
    with pytest.raises(ChatTemplateError, match="exclude"):
        tok.apply_chat_template(chat, continue_final_message=True, add_generation_prompt=True)


def test_refusals(pair: tuple[QllamaTokenizer, qllama.runtime.model.Model], tmp_path: Path) -> None:
    tok, llm = pair
    with pytest.raises(UnsupportedOptionError, match="no transformers files"):
        tok.save_pretrained(tmp_path)
    with pytest.raises(UnsupportedOptionError, match="return_assistant_tokens_mask"):
        tok.apply_chat_template(MESSAGES, return_assistant_tokens_mask=True)
    bare = QllamaTokenizer(llm.tokenizer)
    with pytest.raises(ChatTemplateError, match="no chat template"):
        bare.apply_chat_template(MESSAGES)


def test_from_gguf_reads_no_weights(tiny: Path) -> None:
    tok = QllamaTokenizer.from_gguf(tiny)
    with qllama.read_gguf(tiny) as f:
        q = Tokenizer.from_gguf(f)
        template = ChatTemplate(f.get("tokenizer.chat_template"), q)
    assert tok("Hello the world")["input_ids"] == q.encode("Hello the world")
    assert tok.apply_chat_template(MESSAGES, tokenize=False) == template.render(
        MESSAGES, add_generation_prompt=False
    )
