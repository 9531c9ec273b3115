"""qllama.hf: a qllama model inside transformers' generate and pipelines.

Comparisons between paths replay the same chunks and are bit-exact: under the CPU arithmetic
the logits of a position depend on how many tokens its forward call carried (activations are
quantized per call; pitfall P1 of shared/reference/transformers_adapter.md), so "generate
equals qllama's loop" means "runs the same calls". Where two paths really compute in
different orders (beam search with and without the cache, prompt lookup against greedy), the
tolerance comes from tests/bounds.py and the arithmetic is float32 (activations="f32").
"""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from bounds import forward_bound, gamma  # noqa: E402
from test_architectures import FAMILIES, IDS  # noqa: E402

import qllama  # noqa: E402
from qllama.array_api import to_numpy  # noqa: E402
from qllama.errors import UnsupportedOptionError  # noqa: E402
from qllama.hf import (  # noqa: E402
    QllamaCache,
    QllamaConfig,
    QllamaForCausalLM,
    QllamaTokenizer,
)
from qllama.hf.cache import RowsLayer  # noqa: E402
from qllama.hf.model import CACHE_FIELD  # noqa: E402
from qllama.runtime.generation import Sampler, generate_ids  # noqa: E402
from qllama.synthetic import TinyConfig, write_tiny  # noqa: E402

# a Q8_0 llama: the CPU arithmetic really quantizes activations (F32 weights would not)
TINY = TinyConfig(n_layer=2, n_embd=64, n_ff=128, weight_type="Q8_0", scale=0.3)
PROMPT = [75, 104, 111, 111, 114, 265, 35, 122, 114, 117, 111, 103]
SHORT = [268, 265, 40]
SETUPS = {
    "numpy-q8": {"backend": "numpy"},  # the CPU arithmetic
    "numpy-f32": {"backend": "numpy", "activations": "f32"},
    "dequantize-all": {"backend": "numpy", "dequantize_all": True},
    "torch": {"backend": "torch"},  # the GPU arithmetic, on the CPU
}
N_NEW = 10


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("hf") / "tiny-q8.gguf"
    write_tiny(path, TINY)
    return path


_models: dict[tuple[Path, str], QllamaForCausalLM] = {}


def model_for(path: Path, setup: str) -> QllamaForCausalLM:
    """One adapter per (file, setup), shared by the tests (its state lives in its caches)."""
    key = (path, setup)
    if key not in _models:
        _models[key] = QllamaForCausalLM.from_gguf(path, **SETUPS[setup])
    return _models[key]


@pytest.fixture(params=SETUPS)
def model(request: pytest.FixtureRequest, tiny: Path) -> QllamaForCausalLM:
    return model_for(tiny, request.param)


@pytest.fixture
def q8(tiny: Path) -> QllamaForCausalLM:
    return model_for(tiny, "numpy-q8")


@pytest.fixture
def f32(tiny: Path) -> QllamaForCausalLM:
    return model_for(tiny, "numpy-f32")


def raw_greedy(m: QllamaForCausalLM, prompt: list[int], n: int = N_NEW) -> list[int]:
    """qllama's own decode loop: prefill the prompt, then one token per step."""
    return list(generate_ids(m.llm, prompt, max_new_tokens=n, sampler=Sampler()))


def hf_greedy(m: QllamaForCausalLM, prompt: list[int], n: int = N_NEW, **kw: Any) -> list[int]:
    out = m.generate(torch.tensor([prompt]), max_new_tokens=n, do_sample=False, **kw)
    return out[0, len(prompt) :].tolist()


def np_logits(x: Any) -> np.ndarray:
    return to_numpy(x).astype(np.float32)


# --- the forward pass -------------------------------------------------------------------------


def test_logits_are_qllamas(model: QllamaForCausalLM) -> None:
    """model(ids).logits is Model.forward's, bit for bit; logits_to_keep=1 its last-only pass."""
    ids = torch.tensor([PROMPT])
    every = model(ids).logits[0].numpy()
    np.testing.assert_array_equal(every, np_logits(model.llm.forward(PROMPT, 0, all_logits=True)))
    last = model(ids, logits_to_keep=1).logits
    assert last.shape == (1, 1, model.config.vocab_size)
    np.testing.assert_array_equal(last[0, 0].numpy(), np_logits(model.llm.forward(PROMPT, 0)))


def test_greedy_generate_is_qllamas_decode_loop(model: QllamaForCausalLM) -> None:
    assert hf_greedy(model, PROMPT) == raw_greedy(model, PROMPT)


def test_generate_without_cache_runs_whole_passes(q8: QllamaForCausalLM) -> None:
    """use_cache=False: every step is one pass over the whole sequence (P1: under the CPU
    arithmetic that is not the cached loop's numbers, so the replay is of whole passes)."""
    got = hf_greedy(q8, PROMPT, use_cache=False)
    seq = list(PROMPT)
    stops = q8.llm.tokenizer.stop_ids
    for _ in range(N_NEW):
        seq.append(int(np.argmax(np_logits(q8.llm.forward(seq, 0)))))
        if seq[-1] in stops:
            break
    assert got == seq[len(PROMPT) :]


@pytest.mark.parametrize("name", FAMILIES)
def test_every_architecture(name: str, tmp_path: Path) -> None:
    """Each family's tiny file: logits, greedy generate and hidden states through the adapter."""
    path = tmp_path / f"{name}.gguf"
    write_tiny(path, FAMILIES[name])
    m = QllamaForCausalLM.from_gguf(path)
    ids = torch.tensor([IDS])
    out = m(ids, output_hidden_states=True)
    np.testing.assert_array_equal(
        out.logits[0].numpy(), np_logits(m.llm.forward(IDS, 0, all_logits=True))
    )
    c = m.llm.config
    assert len(out.hidden_states) == c.n_layer + 1
    for j, h in enumerate(out.hidden_states):
        assert h.shape == (1, len(IDS), c.n_embd) and torch.isfinite(h).all(), j
    assert hf_greedy(m, IDS[:5], 6) == raw_greedy(m, IDS[:5], 6)


# --- sampling, processors, outputs ------------------------------------------------------------


def test_seeded_sampling_is_reproducible(q8: QllamaForCausalLM) -> None:
    def sample(seed: int) -> list[int]:
        torch.manual_seed(seed)
        out = q8.generate(torch.tensor([PROMPT]), max_new_tokens=N_NEW, do_sample=True, top_k=50)
        return out[0].tolist()

    assert sample(3) == sample(3)


def test_logits_processors_see_qllamas_logits(q8: QllamaForCausalLM) -> None:
    """A processor that bans the greedy token makes generate pick the runner-up of qllama's
    logits; repetition_penalty's scores are qllama's logits penalised as transformers does."""
    raw = np_logits(q8.llm.forward(PROMPT, 0))
    best, second = np.argsort(-raw, kind="stable")[:2]

    class Ban(transformers.LogitsProcessor):
        def __call__(self, input_ids: Any, scores: Any) -> Any:
            scores[:, int(best)] = -float("inf")
            return scores

    got = hf_greedy(q8, PROMPT, 1, logits_processor=transformers.LogitsProcessorList([Ban()]))
    assert got == [int(second)]

    out = q8.generate(
        torch.tensor([PROMPT]), max_new_tokens=1, do_sample=False, repetition_penalty=1.5,
        return_dict_in_generate=True, output_scores=True,
    )  # fmt: skip
    want = torch.tensor(raw)
    seen = torch.tensor(sorted(set(PROMPT)))
    picked = want[seen]
    want[seen] = torch.where(picked < 0, picked * 1.5, picked / 1.5)
    np.testing.assert_array_equal(out.scores[0][0].numpy(), want.numpy())


def test_ngram_and_length_processors(q8: QllamaForCausalLM) -> None:
    got = hf_greedy(q8, PROMPT, 16, no_repeat_ngram_size=2)
    seq = PROMPT + got
    bigrams = [tuple(seq[i : i + 2]) for i in range(len(seq) - 1)]
    assert len(bigrams) == len(set(bigrams))
    stops = q8.llm.tokenizer.stop_ids
    got = hf_greedy(q8, PROMPT, 12, min_new_tokens=12)
    assert len(got) == 12 and not set(got[:-1]) & stops


def test_stopping_criteria(q8: QllamaForCausalLM) -> None:
    class AfterThree(transformers.StoppingCriteria):
        def __call__(self, input_ids: Any, scores: Any, **kw: Any) -> Any:
            return torch.full((input_ids.shape[0],), input_ids.shape[1] >= len(PROMPT) + 3)

    got = hf_greedy(
        q8, PROMPT, 8, stopping_criteria=transformers.StoppingCriteriaList([AfterThree()])
    )
    assert got == raw_greedy(q8, PROMPT, 8)[:3]


def test_returned_logits_are_the_loops(q8: QllamaForCausalLM) -> None:
    """output_logits: the prefill's last logits, then one step's logits per token, as qllama's
    own loop computes them."""
    out = q8.generate(
        torch.tensor([PROMPT]), max_new_tokens=4, min_new_tokens=4, do_sample=False,
        return_dict_in_generate=True, output_logits=True, output_scores=True,
    )  # fmt: skip
    new = out.sequences[0, len(PROMPT) :].tolist()
    llm = q8.llm
    want = [np_logits(llm.forward(PROMPT, 0))]
    want += [np_logits(llm.forward([t], len(PROMPT) + i)) for i, t in enumerate(new[:-1])]
    for got, w in zip(out.logits, want, strict=True):
        np.testing.assert_array_equal(got[0].numpy(), w)
    assert isinstance(getattr(out, CACHE_FIELD), QllamaCache)


# --- batches ------------------------------------------------------------------------------------


@pytest.mark.parametrize("setup", ["numpy-q8", "torch"])
def test_left_padded_batch_equals_each_prompt_alone(tiny: Path, setup: str) -> None:
    m = model_for(tiny, setup)
    tok = QllamaTokenizer.from_llm(m)
    enc = tok.pad({"input_ids": [PROMPT, SHORT]}, return_tensors="pt")
    assert enc["attention_mask"][1, 0] == 0  # left padding
    out = m.generate(**enc, max_new_tokens=6, min_new_tokens=6, do_sample=False)
    width = enc["input_ids"].shape[1]
    for row, prompt in zip(out, (PROMPT, SHORT), strict=True):
        assert row[width:].tolist() == hf_greedy(m, prompt, 6, min_new_tokens=6)


def test_right_padding_gives_every_real_position(q8: QllamaForCausalLM) -> None:
    """Right padding (lm-eval's model(ids) with a mask) is exact at the real positions; the
    padding's logits are 0; asking for the last logits only is refused."""
    ids = torch.tensor([PROMPT, SHORT + [2] * (len(PROMPT) - len(SHORT))])
    mask = torch.tensor([[1] * len(PROMPT), [1] * len(SHORT) + [0] * (len(PROMPT) - len(SHORT))])
    logits = q8(ids, attention_mask=mask).logits
    alone = np_logits(q8.llm.forward(SHORT, 0, all_logits=True))
    np.testing.assert_array_equal(logits[1, : len(SHORT)].numpy(), alone)
    assert not logits[1, len(SHORT) :].any()
    with pytest.raises(UnsupportedOptionError, match="right padding"):
        q8(ids, attention_mask=mask, logits_to_keep=1)


def test_beam_search_reorders_the_cache(
    f32: QllamaForCausalLM, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Beam search with the cache against beam search recomputing every step: the same beams
    (float32 arithmetic, so the two differ by rounding only), and reorder_cache was given
    beam indices that really moved rows."""
    moved = []
    plain = RowsLayer.reorder_cache

    def spy(self: RowsLayer, beam_idx: Any) -> None:
        moved.append(beam_idx.tolist() != list(range(len(beam_idx))))
        plain(self, beam_idx)

    monkeypatch.setattr(RowsLayer, "reorder_cache", spy)
    kw = dict(
        max_new_tokens=8,
        num_beams=4,
        do_sample=False,
        return_dict_in_generate=True,
        output_scores=True,
    )
    cached = f32.generate(torch.tensor([PROMPT]), **kw)
    assert any(moved)
    fresh = f32.generate(torch.tensor([PROMPT]), use_cache=False, **kw)
    # a sequence score is a sum of log-softmaxes of logits computed in two orders: within the
    # forward bound per logit, twice that per log-softmax, over the steps
    m = f32.llm.config
    scale = float(np.abs(np_logits(f32.llm.forward(PROMPT, 0))).max())
    tol = 2 * forward_bound(m.n_layer, max(m.n_embd, m.n_ff, len(PROMPT) + 8), scale) * 8
    a, b = cached.sequences_scores.item(), fresh.sequences_scores.item()
    assert abs(a - b) <= tol
    assert cached.sequences.tolist() == fresh.sequences.tolist() or abs(a - b) <= tol


def test_num_return_sequences(q8: QllamaForCausalLM) -> None:
    out = q8.generate(torch.tensor([PROMPT]), max_new_tokens=5, num_beams=3, num_return_sequences=2)
    top = q8.generate(torch.tensor([PROMPT]), max_new_tokens=5, num_beams=3)
    assert out.shape[0] == 2 and out[0].tolist() == top[0].tolist()


# --- decoding that edits the cache ------------------------------------------------------------


def recorded(
    m: QllamaForCausalLM, monkeypatch: pytest.MonkeyPatch
) -> list[tuple[list[int], int, bool]]:
    """Every Model.forward call the adapter makes: (ids, pos, all_logits)."""
    calls: list[tuple[list[int], int, bool]] = []
    plain = m.llm.forward

    def spy(ids: Any, pos: int = 0, **kw: Any) -> Any:
        calls.append((list(ids), pos, kw.get("all_logits", False)))
        return plain(ids, pos, **kw)

    monkeypatch.setattr(m.llm, "forward", spy)
    return calls


def replay(
    path: Path, setup: str, calls: list[tuple[list[int], int, bool]]
) -> dict[int, np.ndarray]:
    """The same calls on a freshly loaded model: the last logits computed at each position."""
    llm = qllama.load(path, **SETUPS[setup])
    at: dict[int, np.ndarray] = {}
    for ids, pos, every in calls:
        out = np_logits(llm.forward(ids, pos, all_logits=every))
        rows = out if every else out[None, :]
        first = pos + len(ids) - rows.shape[0]
        at.update({first + j: rows[j] for j in range(rows.shape[0])})
    return at


def test_prompt_lookup_follows_its_own_chunks(
    tiny: Path, q8: QllamaForCausalLM, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Prompt-lookup decoding verifies several tokens per call and crops the cache back after
    a rejection. Each token it keeps is the argmax of qllama's logits at the position before,
    as the same calls compute them on a fresh model (P1: not as greedy's calls do)."""
    removed = []
    plain_crop = RowsLayer.crop

    def crop(self: RowsLayer, n: int) -> None:
        before = self.get_seq_length()
        plain_crop(self, n)
        removed.append(before - self.get_seq_length())

    monkeypatch.setattr(RowsLayer, "crop", crop)
    calls = recorded(q8, monkeypatch)
    prompt = PROMPT + PROMPT[:6] + PROMPT[:6]  # repeats for the lookup to propose
    seq = q8.generate(
        torch.tensor([prompt]),
        max_new_tokens=12,
        min_new_tokens=12,
        do_sample=False,
        prompt_lookup_num_tokens=3,
    )[0].tolist()
    assert max(removed) > 0, "no candidate was rejected: the rollback was not exercised"
    proposed = [len(ids) - (len(prompt) if i == 0 else 1) for i, (ids, _, _) in enumerate(calls)]
    assert max(proposed) > 0, "no call verified candidate tokens"
    for ids, pos, _ in calls:
        assert seq[pos] == ids[0]  # every call starts at a kept position
    at = replay(tiny, "numpy-q8", calls)
    for p in range(len(prompt), len(seq)):
        assert seq[p] == int(np.argmax(at[p - 1])), p


def test_prompt_lookup_equals_greedy_in_float32(f32: QllamaForCausalLM) -> None:
    """In float32 arithmetic the chunks change rounding only: prompt lookup is greedy, up to
    the first near tie (a margin within the forward bound)."""
    prompt = PROMPT + PROMPT[:6] + PROMPT[:6]
    got = hf_greedy(f32, prompt, 12, min_new_tokens=12, prompt_lookup_num_tokens=3)
    want = hf_greedy(f32, prompt, 12, min_new_tokens=12)
    c = f32.llm.config
    seq = prompt + want
    logits = np_logits(f32.llm.forward(seq[:-1], 0, all_logits=True))[len(prompt) - 1 :]
    top2 = np.sort(logits, axis=-1)[:, -2:]
    bound = 2 * forward_bound(
        c.n_layer, max(c.n_embd, c.n_ff, len(seq)), float(np.abs(logits).max())
    )
    tie = np.flatnonzero(top2[:, 1] - top2[:, 0] <= bound)
    agree = int(tie[0]) if tie.size else len(want)
    assert got[:agree] == want[:agree]


def test_continuing_from_a_returned_cache(q8: QllamaForCausalLM) -> None:
    """generate(..., cache=returned) goes on where it stopped: the same calls as one run."""
    first = q8.generate(
        torch.tensor([PROMPT]),
        max_new_tokens=4,
        min_new_tokens=4,
        do_sample=False,
        return_dict_in_generate=True,
    )
    cache = getattr(first, CACHE_FIELD)
    assert isinstance(cache, QllamaCache) and cache.get_seq_length() == len(PROMPT) + 3
    more = q8.generate(
        first.sequences, max_new_tokens=4, min_new_tokens=4, do_sample=False, **{CACHE_FIELD: cache}
    )
    assert more[0, len(PROMPT) :].tolist() == hf_greedy(q8, PROMPT, 8, min_new_tokens=8)


def test_prefill_in_chunks(
    tiny: Path, q8: QllamaForCausalLM, monkeypatch: pytest.MonkeyPatch
) -> None:
    calls = recorded(q8, monkeypatch)
    # transformers 5.0 prepares a cache before the prefill (which chunking needs) only when
    # asked for one, for its own models too; later releases always do
    chunked = dict(prefill_chunk_size=5, cache_implementation="dynamic")
    got = hf_greedy(q8, PROMPT, 4, min_new_tokens=4, **chunked)
    # transformers 4.57 leaves the prompt's last token to the first decoding step
    last = 1 if transformers.__version__.startswith("4.") else 2
    assert [len(ids) for ids, _, _ in calls[:3]] == [5, 5, last]
    at = replay(tiny, "numpy-q8", calls)
    seq = PROMPT + got
    assert all(seq[p] == int(np.argmax(at[p - 1])) for p in range(len(PROMPT), len(seq)))


@pytest.mark.parametrize("keyword", ["cache", "past_key_values"])
def test_both_names_of_the_cache_argument(q8: QllamaForCausalLM, keyword: str) -> None:
    out = q8(torch.tensor([PROMPT[:-1]]))
    cache = getattr(out, CACHE_FIELD)
    step = q8(torch.tensor([PROMPT[-1:]]), **{keyword: cache}).logits[0, -1].numpy()
    llm = q8.llm
    llm.forward(PROMPT[:-1], 0, all_logits=True)
    np.testing.assert_array_equal(step, np_logits(llm.forward(PROMPT[-1:], len(PROMPT) - 1)))


# --- text: streamer and pipeline --------------------------------------------------------------


def test_streamer_text_is_the_decoded_greedy_text(q8: QllamaForCausalLM) -> None:
    tok = QllamaTokenizer.from_llm(q8)
    streamer = transformers.TextIteratorStreamer(tok, skip_prompt=True)
    job = threading.Thread(
        target=q8.generate,
        kwargs=dict(
            inputs=torch.tensor([PROMPT]), max_new_tokens=N_NEW, do_sample=False, streamer=streamer
        ),
    )
    job.start()
    text = "".join(streamer)
    job.join()
    assert text == tok.decode(raw_greedy(q8, PROMPT))


def test_pipeline_text_and_chat(q8: QllamaForCausalLM) -> None:
    tok = QllamaTokenizer.from_llm(q8)
    pipe = transformers.pipeline("text-generation", model=q8, tokenizer=tok)
    prompt_text = tok.decode(PROMPT)
    out = pipe(prompt_text, max_new_tokens=6, do_sample=False, return_full_text=False)
    new = raw_greedy(q8, tok.qllama.encode(prompt_text), 6)
    assert out[0]["generated_text"] == tok.decode(new, skip_special_tokens=True)

    messages = [{"role": "user", "content": "Hello the world"}]
    out = pipe(messages, max_new_tokens=6, do_sample=False)
    reply = out[0]["generated_text"][-1]
    new = raw_greedy(q8, q8.llm.apply_chat_template(messages), 6)
    assert reply == {"role": "assistant", "content": tok.decode(new, skip_special_tokens=True)}


# --- hidden states, loss, memory --------------------------------------------------------------


def test_hidden_states_are_transformers(tmp_path: Path) -> None:
    """transformers' own LlamaForCausalLM on the same F32 file: embeddings, every block's
    output and the final norm's, within the forward bound; selecting by index keeps those."""
    pytest.importorskip("gguf")
    from qllama.measure.reference import load_transformers

    path = tmp_path / "f32.gguf"
    write_tiny(path, dataclasses.replace(TINY, weight_type="F32", tied=False))
    hf = load_transformers(path)
    m = QllamaForCausalLM.from_gguf(path, activations="f32")
    ids = torch.tensor([PROMPT])
    with torch.no_grad():
        want = hf(ids, output_hidden_states=True)
    got = m(ids, output_hidden_states=True)
    c = m.llm.config
    assert len(got.hidden_states) == len(want.hidden_states) == c.n_layer + 1
    width = max(c.n_embd, c.n_ff, len(PROMPT))
    for j, (a, b) in enumerate(zip(got.hidden_states, want.hidden_states, strict=True)):
        tol = forward_bound(c.n_layer, width, float(b.abs().max()))
        np.testing.assert_allclose(
            a.numpy(), b.numpy(), rtol=0, atol=tol, err_msg=f"hidden state {j}"
        )
    tol = forward_bound(c.n_layer, width, float(want.logits.abs().max()))
    np.testing.assert_allclose(got.logits.numpy(), want.logits.numpy(), rtol=0, atol=tol)
    picked = m(ids, output_hidden_states=[0, -1]).hidden_states
    assert picked[1:-1] == (None,) * (c.n_layer - 1)
    np.testing.assert_array_equal(picked[-1].numpy(), got.hidden_states[-1].numpy())


def test_labels_give_the_shifted_cross_entropy(q8: QllamaForCausalLM) -> None:
    ids = torch.tensor([PROMPT])
    labels = ids.clone()
    labels[0, :3] = -100
    out = q8(ids, labels=labels)
    logits = out.logits[0, :-1].double()
    target = labels[0, 1:]
    keep = target != -100
    nll = torch.logsumexp(logits, -1) - logits.gather(1, target.clamp(min=0)[:, None])[:, 0]
    want = float(nll[keep].mean())
    # float32 against float64: a log-sum-exp of V terms and a mean of N, each within gamma
    n, v = int(keep.sum()), q8.config.vocab_size
    bound = 2 * (gamma(v) * (1 + float(logits.abs().max())) + gamma(n) * want)
    assert abs(float(out.loss) - want) <= bound


def test_no_float_copy_of_the_weights(model: QllamaForCausalLM) -> None:
    """transformers sees one float32 anchor: 4 bytes of parameters, nothing else to save."""
    held = sum(p.numel() * p.element_size() for p in model.parameters())
    held += sum(b.numel() * b.element_size() for b in model.buffers())
    assert held == 4
    assert list(model.state_dict()) == ["anchor"]
    assert model.device.type == "cpu" and model.dtype == torch.float32


# --- refusals ---------------------------------------------------------------------------------


def _full_dynamic_cache(m: QllamaForCausalLM) -> Any:
    cache = transformers.DynamicCache()
    k = torch.zeros(1, 2, 3, 16)
    cache.update(k, k, 0)
    return cache


REFUSED: dict[str, tuple[Callable[[QllamaForCausalLM], Any], str]] = {
    "inputs_embeds": (lambda m: m(inputs_embeds=torch.zeros(1, 3, 64)), "inputs_embeds"),
    "generate inputs_embeds": (
        lambda m: m.generate(inputs_embeds=torch.zeros(1, 3, 64), max_new_tokens=2),
        "inputs_embeds",
    ),
    "output_attentions": (lambda m: m(torch.tensor([PROMPT]), output_attentions=True), "attention"),
    "static cache": (
        lambda m: m.generate(
            torch.tensor([PROMPT]), max_new_tokens=2, cache_implementation="static"
        ),
        "cache_implementation='static'",
    ),
    "paged cache": (
        lambda m: m.generate(
            torch.tensor([PROMPT]), max_new_tokens=2, cache_implementation="paged"
        ),
        "cache_implementation='paged'",
    ),
    "continuous batching": (lambda m: m.generate_batch([PROMPT]), "continuous batching"),
    "full DynamicCache": (
        lambda m: m(torch.tensor([PROMPT]), past_key_values=_full_dynamic_cache(m)),
        "holding keys and values",
    ),
    "save_pretrained": (lambda m: m.save_pretrained("unused"), "no transformers weights"),
    "to float16": (lambda m: m.to(torch.float16), "cannot move"),
    "half": (lambda m: m.half(), "cannot move"),
    "to meta": (lambda m: m.to("meta"), "cannot move"),
    "4-D mask": (
        lambda m: m(torch.tensor([PROMPT]), attention_mask=torch.ones(1, 1, 12, 12)),
        "must be 2-D",
    ),
    "mask with a hole": (
        lambda m: m(torch.tensor([PROMPT[:4]]), attention_mask=torch.tensor([[1, 0, 1, 1]])),
        "hole",
    ),
    "mask of 2s": (
        lambda m: m(torch.tensor([PROMPT[:2]]), attention_mask=torch.tensor([[2, 1]])),
        "only 0s and 1s",
    ),
    "packed position_ids": (
        lambda m: m(torch.tensor([PROMPT[:4]]), position_ids=torch.tensor([[0, 1, 0, 1]])),
        "position_ids",
    ),
    "unknown keyword": (lambda m: m(torch.tensor([PROMPT]), token_type_ids=None), "token_type_ids"),
    "tensor logits_to_keep": (
        lambda m: m(torch.tensor([PROMPT]), logits_to_keep=torch.tensor([1])),
        "logits_to_keep",
    ),
}


@pytest.mark.parametrize("case", REFUSED)
def test_refused(q8: QllamaForCausalLM, case: str) -> None:
    call, message = REFUSED[case]
    with pytest.raises(UnsupportedOptionError, match=message):
        call(q8)
    assert q8.anchor.dtype == torch.float32 and q8.anchor.device.type == "cpu"


def test_a_cache_belongs_to_its_model(tiny: Path, q8: QllamaForCausalLM) -> None:
    other = QllamaForCausalLM.from_gguf(tiny)
    cache = getattr(other(torch.tensor([PROMPT])), CACHE_FIELD)
    with pytest.raises(UnsupportedOptionError, match="another model"):
        q8(torch.tensor([[5]]), cache=cache)
    with pytest.raises(UnsupportedOptionError, match="1 sequences"):
        other(torch.tensor([[5], [6]]), cache=cache)


def test_concurrent_generates_are_serialised(q8: QllamaForCausalLM) -> None:
    """Two threads generating with one model: forward calls take turns (a lock), each
    sequence keeps its own cache, so both get what they get alone."""
    prompts = [PROMPT, SHORT, PROMPT[3:], SHORT + PROMPT[:2]]
    alone = [raw_greedy(q8, p, 8) for p in prompts]
    got: dict[int, list[int]] = {}

    def run(i: int) -> None:
        got[i] = hf_greedy(q8, prompts[i], 8)

    jobs = [threading.Thread(target=run, args=(i,)) for i in range(len(prompts))]
    for j in jobs:
        j.start()
    for j in jobs:
        j.join()
    assert [got[i] for i in range(len(prompts))] == alone


# --- registration and versions ----------------------------------------------------------------


def test_auto_classes_build_it(tiny: Path) -> None:
    config = transformers.AutoConfig.for_model(
        "qllama", gguf_path=str(tiny), load_options={"activations": "f32"}
    )
    assert isinstance(config, QllamaConfig)
    m = transformers.AutoModelForCausalLM.from_config(config)
    assert isinstance(m, QllamaForCausalLM) and m.llm.backend.activations == "f32"
    again = QllamaForCausalLM.from_pretrained(tiny.parent, gguf_file=tiny.name)
    assert again.config.gguf_path == str(tiny)
    with pytest.raises(UnsupportedOptionError, match="not a GGUF file"):
        QllamaForCausalLM.from_pretrained(tiny.parent)


def test_config_has_what_transformers_reads(q8: QllamaForCausalLM) -> None:
    c, llm = q8.config, q8.llm
    assert (c.vocab_size, c.hidden_size, c.num_hidden_layers) == (llm.config.n_vocab, 64, 2)
    assert c.max_position_embeddings == llm.n_ctx
    stops = c.eos_token_id if isinstance(c.eos_token_id, list) else [c.eos_token_id]
    assert set(stops) == set(llm.tokenizer.stop_ids)


# --- the real model -----------------------------------------------------------------------------


@pytest.mark.model
@pytest.mark.parametrize(
    "setup",
    ["numpy-q8", pytest.param("torch", marks=pytest.mark.slow)],  # torch on a CPU: ~2 tok/s
)
def test_smollm2_q4_k_m(setup: str) -> None:
    """SmolLM2 Q4_K_M through generate and the pipeline's chat: qllama's own tokens."""
    from qllama.model_files import variant

    m = QllamaForCausalLM.from_gguf(variant("smollm2-135m-instruct", "Q4_K_M"), **SETUPS[setup])
    tok = QllamaTokenizer.from_llm(m)
    messages = [{"role": "user", "content": "Explain how a CPU cache works."}]
    prompt = m.llm.apply_chat_template(messages)
    assert hf_greedy(m, prompt, 12) == raw_greedy(m, prompt, 12)
    assert tok.apply_chat_template(messages, add_generation_prompt=True)["input_ids"] == prompt
    assert sum(p.numel() for p in m.parameters()) == 1
