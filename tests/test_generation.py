"""Decoding: greedy, sampling with a seed, stop conditions, streaming."""

from __future__ import annotations

import numpy as np
import pytest

import qllama
from qllama.array_api import to_numpy
from qllama.errors import ContextOverflowError, QllamaError
from qllama.runtime.generation import Sampler, SamplingError
from qllama.synthetic import TinyConfig, write_tiny_llama


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    path = tmp_path_factory.mktemp("gen") / "tiny.gguf"
    write_tiny_llama(path, TinyConfig(scale=0.5))
    return qllama.load(path, backend="numpy", dequantize_all=True)


def test_greedy_follows_the_argmax(model):
    prompt = [1, 30, 40]
    ids = model.generate(prompt, max_new_tokens=6).ids
    seq = list(prompt)
    for token in ids:
        assert token == int(np.argmax(to_numpy(model.forward(seq))))
        seq.append(token)


def test_sampling_is_reproducible_by_seed(model):
    run = lambda seed: model.generate([1, 30], max_new_tokens=20, temperature=1.0, seed=seed).ids  # noqa: E731
    assert run(7) == run(7)
    assert run(7) != run(8)


def test_top_k_1_and_tiny_top_p_are_greedy(model):
    greedy = model.generate([1, 30], max_new_tokens=8).ids
    assert model.generate([1, 30], max_new_tokens=8, temperature=0.8, top_k=1, seed=3).ids == greedy
    assert (
        model.generate([1, 30], max_new_tokens=8, temperature=0.8, top_p=1e-9, seed=3).ids == greedy
    )


def test_sampler_distribution():
    logits = np.log(np.array([0.5, 0.3, 0.2, 0.0 + 1e-12]))
    s = Sampler(temperature=1.0, seed=0)
    rng = s.rng()
    counts = np.bincount([s.pick(logits, rng) for _ in range(4000)], minlength=4)
    np.testing.assert_allclose(counts / 4000, [0.5, 0.3, 0.2, 0.0], atol=0.03)
    s = Sampler(temperature=1.0, top_p=0.6, seed=0)  # keeps the two tokens that reach 0.6
    rng = s.rng()
    assert set(s.pick(logits, rng) for _ in range(500)) == {0, 1}


def test_stream_pieces_make_the_text(model):
    out = qllama.runtime.generation.Generation(prompt_ids=[])
    pieces = list(
        qllama.runtime.generation.stream(
            model, [1, 30], out, max_new_tokens=25, temperature=1.0, seed=1
        )
    )
    assert "".join(pieces) == out.text
    assert out.text == model.tokenizer.decode(
        [t for t in out.ids if t not in model.tokenizer.stop_ids]
    )


def test_stop_string_cuts_the_text(model):
    full = model.generate([1, 30], max_new_tokens=30, temperature=1.0, seed=2)
    assert len(full.text) > 6
    stop = full.text[3:6]
    cut = model.generate([1, 30], max_new_tokens=30, temperature=1.0, seed=2, stop=[stop])
    assert cut.finish_reason == "stop" and cut.text == full.text[: full.text.index(stop)]


class Scripted:
    """A stand-in model whose greedy choices are scripted: tests generation's own logic."""

    def __init__(self, model, script):
        self.tokenizer, self.n_ctx, self.script, self.calls = model.tokenizer, 64, script, 0

    def forward(self, ids, pos=0):
        logits = np.zeros(self.tokenizer.n_vocab, np.float32)
        logits[self.script[min(self.calls, len(self.script) - 1)]] = 1.0
        self.calls += 1
        return logits


def test_finish_reasons(model):
    eos = model.tokenizer.eos_id
    a, b = model.tokenizer.encode("a"), model.tokenizer.encode("b")
    g = qllama.runtime.generation.generate(
        Scripted(model, [a[0], b[0], eos, a[0]]), [1], max_new_tokens=10
    )
    assert (g.ids, g.text, g.finish_reason) == ([a[0], b[0], eos], "ab", "eos")
    g = qllama.runtime.generation.generate(Scripted(model, [a[0]]), [1], max_new_tokens=3)
    assert (g.text, g.finish_reason) == ("aaa", "length")
    assert model.generate([1, 30], max_new_tokens=0).ids == []


def test_context_end_stops_generation(tmp_path):
    path = tmp_path / "tiny.gguf"
    write_tiny_llama(path)
    m = qllama.load(path, n_ctx=8, dequantize_all=True)
    g = m.generate([1, 2, 3, 4, 5], max_new_tokens=100)
    assert len(g.ids) <= 4 and g.finish_reason in ("length", "eos")
    with pytest.raises(
        ContextOverflowError, match="the prompt has 9 tokens, more than the context of 8"
    ):
        m.generate(list(range(9)), max_new_tokens=1)


@pytest.mark.parametrize(
    "kwargs",
    [
        {"temperature": -1},
        {"temperature": float("nan")},
        {"top_k": -2},
        {"top_p": 0},
        {"top_p": 1.5},
        {"top_p": float("nan")},
        {"max_new_tokens": -1},
    ],
)
def test_bad_sampling_parameters(model, kwargs):
    with pytest.raises(SamplingError):
        model.generate([1, 30], **{"max_new_tokens": 2, **kwargs})
    assert issubclass(SamplingError, QllamaError)
