"""Runtime faults (docs/security.md, section G): prompts, ids, context, non-finite numbers,
interrupted writes, missing backends, hostile text.

The models are tiny synthetic llamas; where a test needs the model to pick given tokens, its
``forward`` still runs (so every check on the way runs too) but the logits are scripted.
"""

from __future__ import annotations

import importlib.util
import math
import os
import signal
import subprocess
import sys
import tracemalloc
from collections.abc import Callable, Iterator, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import qllama
from qllama import backends
from qllama.atomic import atomic_write
from qllama.errors import (
    BackendError,
    ChatTemplateError,
    ContextOverflowError,
    InvalidTokenError,
    ModelConfigError,
    NonFiniteLogitsError,
    QllamaError,
    SequenceError,
    TokenizerError,
)
from qllama.gguf.quantizer import quantize_file
from qllama.gguf.reader import read_gguf
from qllama.gguf.writer import GGUFWriter
from qllama.runtime import generation
from qllama.runtime.generation import Generation, SamplingError
from qllama.runtime.model import Model
from qllama.synthetic import TinyConfig, write_tiny_llama

SMALL = TinyConfig(n_layer=2, n_embd=32, n_ff=64, n_head=2, n_head_kv=1, n_ctx=64)
N_VOCAB = 269  # the byte-level (gpt2) vocabulary; it adds no BOS
N_CTX = 8  # the context the tests load with


@pytest.fixture(scope="module")
def files(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    d = tmp_path_factory.mktemp("runtime")
    out = {"gpt2": d / "gpt2.gguf", "llama": d / "llama.gguf"}
    write_tiny_llama(out["gpt2"], SMALL)  # F32 weights
    write_tiny_llama(out["llama"], replace(SMALL, vocab="llama"))  # adds BOS
    return out


@pytest.fixture
def model(files: dict[str, Path]) -> Model:
    return qllama.load(files["gpt2"], n_ctx=N_CTX)


def script(model: Model, ids: Sequence[int], *, nan_at: int | None = None) -> list[int]:
    """Make greedy decoding pick ``ids`` in turn (NaN logits at call ``nan_at``); the real
    forward still runs on every call. Returns the list of calls' token counts."""
    real, calls = model.forward, []
    picks: Iterator[int] = iter(ids)

    def forward(tokens: Any, pos: int = 0, *, all_logits: bool = False) -> Any:
        real(tokens, pos, all_logits=all_logits)
        calls.append(len(tokens))
        logits = np.full(model.config.n_vocab, -30.0, np.float32)
        logits[next(picks, 0)] = 0.0
        if nan_at is not None and len(calls) - 1 == nan_at:
            logits[5] = np.nan  # one NaN: argmax alone would pick it
        return logits

    setattr(model, "forward", forward)  # noqa: B010 (an instance attribute shadows the method)
    return calls


# --- G42: empty prompt, max_new_tokens=0 ------------------------------------------------------


def test_G42_forward_of_nothing(model: Model) -> None:
    with pytest.raises(InvalidTokenError, match=r"no tokens to run \(empty prompt\)"):
        model.forward([])
    with pytest.raises(InvalidTokenError, match="empty prompt"):
        model.forward(np.zeros(0, np.int64))


@pytest.mark.parametrize("prompt", ["", [], b""])
def test_G42_empty_prompt_without_bos_is_an_error(model: Model, prompt: Any) -> None:
    assert not model.tokenizer.add_bos
    with pytest.raises(InvalidTokenError, match="empty prompt"):
        model.generate(prompt, max_new_tokens=3)


def test_G42_empty_prompt_with_bos_generates(files: dict[str, Path]) -> None:
    m = qllama.load(files["llama"], n_ctx=N_CTX)
    out = m.generate("", max_new_tokens=2)
    assert out.prompt_ids == [m.tokenizer.bos_id]
    assert 1 <= len(out.ids) <= 2


@pytest.mark.parametrize("prompt", ["the cat", [3, 4], ""])
def test_G42_zero_new_tokens_is_an_empty_result(model: Model, prompt: Any) -> None:
    calls = script(model, [])
    out = model.generate(prompt, max_new_tokens=0)
    assert (out.ids, out.text, out.finish_reason) == ([], "", "length")
    assert calls == []  # no forward pass at all


def test_G42_negative_new_tokens(model: Model) -> None:
    with pytest.raises(SamplingError, match="max_new_tokens must be >= 0, not -1"):
        model.generate("the", max_new_tokens=-1)


# --- G43: token ids out of range ---------------------------------------------------------------


@pytest.mark.parametrize("bad", [-1, N_VOCAB, 2**31, 10**20])
def test_G43_ids_out_of_range(model: Model, bad: int) -> None:
    with pytest.raises(InvalidTokenError, match=rf"token\[1\] = {bad} is outside \[0, {N_VOCAB}\)"):
        model.forward([5, bad])
    with pytest.raises(InvalidTokenError, match=rf"token\[1\] = {bad}"):
        model.forward(np.array([5, bad], dtype=object if bad > 2**62 else np.int64))
    with pytest.raises(InvalidTokenError):
        model.generate([5, bad], max_new_tokens=1)
    with pytest.raises(InvalidTokenError, match=rf"token\[1\]={bad} out of range \[0,{N_VOCAB}\)"):
        model.tokenizer.decode([5, bad])
    with pytest.raises(InvalidTokenError):
        model.tokenizer.decoder().feed(bad)
    assert model.forward([5, 6]).shape == (N_VOCAB,)  # and the model goes on


@pytest.mark.parametrize(
    "bad", [[1.5], ["3"], [None], [[1, 2]], np.array([1.5]), np.array([[1, 2]]), "ab"]
)
def test_G43_ids_that_are_not_integers(model: Model, bad: Any) -> None:
    """Refused, not truncated: forward([1.5]) must not run token 1."""
    with pytest.raises(InvalidTokenError, match="not an integer|1-D"):
        model.forward(bad)
    if not isinstance(bad, str):
        with pytest.raises(InvalidTokenError):
            model.generate(bad, max_new_tokens=1)


@pytest.mark.parametrize(
    ("pos", "message"), [(5, "past the cached"), (-1, "pos -1"), (0.5, "integer")]
)
def test_G43_positions(model: Model, pos: Any, message: str) -> None:
    with pytest.raises(SequenceError, match=message):
        model.forward([1], pos=pos)


# --- G44: the context ---------------------------------------------------------------------------


def test_G44_prompt_longer_than_the_context(model: Model) -> None:
    with pytest.raises(ContextOverflowError, match="9 tokens do not fit in the context of 8") as e:
        model.forward(list(range(9)))
    assert (e.value.n_tokens, e.value.n_ctx) == (9, N_CTX)


def test_G44_positions_reaching_the_end_of_the_context(model: Model) -> None:
    model.forward(list(range(1, 9)))  # exactly full
    with pytest.raises(ContextOverflowError) as e:
        model.forward([1], pos=8)
    assert (e.value.n_tokens, e.value.n_ctx) == (9, N_CTX)
    assert model.forward([1, 2], pos=0).shape == (N_VOCAB,)  # a new sequence still runs


def test_G44_generate_refuses_a_prompt_over_the_context(model: Model) -> None:
    calls = script(model, [])
    with pytest.raises(ContextOverflowError, match="the prompt has 9 tokens, more than") as e:
        model.generate(list(range(1, 10)), max_new_tokens=1)
    assert (e.value.n_tokens, e.value.n_ctx) == (9, N_CTX)
    assert calls == []  # refused before any work


@pytest.mark.parametrize(("n_prompt", "expected"), [(6, 3), (8, 1), (1, 8)])
def test_G44_generation_stops_at_the_end_of_the_context(
    model: Model, n_prompt: int, expected: int
) -> None:
    """n_ctx positions give n_ctx logits: n_ctx - n_prompt + 1 new tokens, then "length"."""
    out = model.generate(list(range(3, 3 + n_prompt)), max_new_tokens=50)
    assert len(out.ids) == expected and out.finish_reason == "length"


def test_G44_a_context_longer_than_the_models_warns(files: dict[str, Path]) -> None:
    with pytest.warns(UserWarning, match="n_ctx 1000 is longer than the 64 positions"):
        m = qllama.load(files["gpt2"], n_ctx=1000)
    assert m.forward(list(range(100))).shape == (N_VOCAB,)
    with pytest.raises(ModelConfigError, match="n_ctx must be at least 1, not 0"):
        qllama.load(files["gpt2"], n_ctx=0)


# --- G45: non-finite numbers -------------------------------------------------------------------


def _with_nan_weight(src: Path, dst: Path, tensor: str, scale: float = math.nan) -> Path:
    """``src`` with ``tensor`` (F32) multiplied by ``scale``, or one element set to NaN."""
    f = read_gguf(src)
    w = GGUFWriter()
    for k, v in f.kv.items():
        w.add(k, v)
    for t in f:
        data = np.array(f.tensor_data(t.name)).view(np.float32).reshape(t.shape)
        if t.name == tensor:
            if math.isnan(scale):
                data[3, 5] = np.nan
            else:
                data = data * np.float32(scale)
        w.add_tensor(t.name, data, t.ggml_type)
    f.close()
    w.write(dst)
    return dst


def test_G45_a_nan_weight_is_refused_at_load(files: dict[str, Path], tmp_path: Path) -> None:
    p = _with_nan_weight(files["gpt2"], tmp_path / "nan.gguf", "blk.1.ffn_down.weight")
    with pytest.raises(qllama.errors.WeightValueError, match="'blk.1.ffn_down.weight' block 197 "):
        qllama.load(p)


def test_G45_trace_names_the_first_non_finite_layer(files: dict[str, Path], tmp_path: Path) -> None:
    p = _with_nan_weight(files["gpt2"], tmp_path / "nan.gguf", "blk.1.ffn_down.weight")
    m = qllama.load(p, check_weights=False, trace_nonfinite=True)
    with pytest.raises(
        NonFiniteLogitsError, match="the output of layer 1 is NaN or infinite at position 0"
    ):
        m.forward([1, 2, 3])
    quiet = qllama.load(p, check_weights=False)  # without the trace: NaN logits come back
    assert np.isnan(np.asarray(quiet.forward([1, 2, 3]))).any()


def test_G45_generate_never_emits_a_token_from_nan_logits(
    files: dict[str, Path], tmp_path: Path
) -> None:
    p = _with_nan_weight(files["gpt2"], tmp_path / "nan.gguf", "blk.0.attn_v.weight")
    m = qllama.load(p, check_weights=False, n_ctx=N_CTX)
    seen: list[str] = []
    with pytest.raises(NonFiniteLogitsError, match=r"step 0 \(the logits of position 2\)"):
        m.generate([1, 2, 3], max_new_tokens=4, on_text=seen.append)
    result = Generation(prompt_ids=[])
    with pytest.raises(NonFiniteLogitsError, match="trace_nonfinite=True"):
        list(generation.stream(m, [1, 2, 3], result, max_new_tokens=4))
    assert seen == [] and result.ids == []


def test_G45_nan_logits_at_a_later_step(model: Model) -> None:
    script(model, [100, 101, 102, 103], nan_at=2)
    result = Generation(prompt_ids=[])
    with pytest.raises(NonFiniteLogitsError, match=r"step 2 \(the logits of position 4\)"):
        list(generation.stream(model, [1, 2, 3], result, max_new_tokens=5))
    assert result.ids == [100, 101]  # the tokens before; none from the NaN logits


@pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning")
@pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")
def test_G45_activation_over_the_f16_maximum(files: dict[str, Path], tmp_path: Path) -> None:
    """Keys past 65504 are infinite in an f16 KV cache (llama.cpp's default), not in f32."""
    p = _with_nan_weight(files["gpt2"], tmp_path / "big.gguf", "blk.0.attn_k.weight", 1e5)
    m = qllama.load(p, kv_precision="f16", trace_nonfinite=True)
    with pytest.raises(NonFiniteLogitsError, match="the output of layer 0"):
        m.forward([1, 2, 3])
    m32 = qllama.load(p, kv_precision="f32", trace_nonfinite=True)
    assert np.isfinite(np.asarray(m32.forward([1, 2, 3]))).all()


@pytest.mark.parametrize(
    ("option", "value", "message"),
    [
        ("temperature", math.nan, "temperature must be finite and >= 0, not nan"),
        ("temperature", math.inf, "temperature must be finite"),
        ("temperature", -1.0, "temperature must be finite and >= 0, not -1"),
        ("top_p", math.nan, r"top_p must be in \(0, 1\], not nan"),
        ("top_p", math.inf, "top_p must be in"),
        ("top_p", 0.0, "top_p must be in"),
        ("top_p", 1.5, "top_p must be in"),
        ("top_k", -1, "top_k must be an integer >= 0, not -1"),
        ("top_k", 1.5, "top_k must be an integer"),
    ],
)
def test_G45_non_finite_sampling_parameters(
    model: Model, option: str, value: float, message: str
) -> None:
    calls = script(model, [])
    with pytest.raises(SamplingError, match=message):
        model.generate("the", max_new_tokens=2, **{option: value})
    assert calls == [] and issubclass(SamplingError, QllamaError)


# --- G46: hostile text ------------------------------------------------------------------------


@pytest.mark.parametrize("prompt", [b"ok \xff\xfe bad", b"\xe4\xb8", "lone \ud800 surrogate"])
def test_G46_invalid_text_is_replaced(files: dict[str, Path], prompt: str | bytes) -> None:
    model = qllama.load(files["gpt2"])
    out = model.generate(prompt, max_new_tokens=1)
    assert out.prompt_ids == model.tokenizer.encode(prompt)  # bytes are text, not token ids
    assert model.tokenizer.decode(out.prompt_ids).count("\ufffd") >= 1


def test_G46_the_length_cap_comes_before_tokenizing(model: Model) -> None:
    huge = "a" * (model.tokenizer.max_chars + 1)  # 10^7 + 1 characters
    calls = script(model, [])
    tracemalloc.start()
    with pytest.raises(TokenizerError, match="over the tokenizer's limit of 10000000"):
        model.generate(huge, max_new_tokens=1)
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    assert peak < 1 << 20 and calls == []


def test_G46_a_long_prompt_overflows_the_context_before_any_forward(model: Model) -> None:
    calls = script(model, [])
    with pytest.raises(ContextOverflowError) as e:
        model.generate("the cat sat on the mat " * 200, max_new_tokens=1)
    assert e.value.n_tokens > N_CTX and calls == []


def test_G46_streaming_holds_back_partial_characters(files: dict[str, Path]) -> None:
    m = qllama.load(files["gpt2"])
    tok = m.tokenizer
    text_ids = tok.encode("世界é")  # one byte-level token per UTF-8 byte
    assert len(text_ids) == 8
    script(m, [*text_ids, tok.eos_id])
    pieces = list(m.stream([3], max_new_tokens=20))
    assert "".join(pieces) == "世界é" and all("\ufffd" not in p for p in pieces)
    script(m, text_ids[:2])  # stops in the middle of 世
    out = m.generate([3], max_new_tokens=2)
    assert out.text == "\ufffd" and out.finish_reason == "length"


# --- interrupted writes ------------------------------------------------------------------------


def _writer(fail_at: int | None, exc: BaseException) -> GGUFWriter:
    w = GGUFWriter()
    w.add("general.architecture", "llama")
    for i in range(4):

        def data(i: int = i) -> np.ndarray:
            if i == fail_at:
                raise exc
            return np.full((4, 32), i, np.float32)

        w.add_tensor(f"t{i}", data, "F32", (4, 32))
    return w


@pytest.mark.parametrize("exc", [RuntimeError("disk on fire"), KeyboardInterrupt()])
def test_interrupted_gguf_write_leaves_no_file(tmp_path: Path, exc: BaseException) -> None:
    out = tmp_path / "out.gguf"
    with pytest.raises(type(exc)):
        _writer(2, exc).write(out)
    assert os.listdir(tmp_path) == []
    _writer(None, exc).write(out)
    before = out.read_bytes()
    with pytest.raises(type(exc)):
        _writer(3, exc).write(out)  # over an existing file: it stays as it was
    assert out.read_bytes() == before and os.listdir(tmp_path) == ["out.gguf"]


def test_interrupted_quantization_leaves_no_file(files: dict[str, Path], tmp_path: Path) -> None:
    def stop(i: int, n: int, *_: Any) -> None:
        if i == 5:
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        quantize_file(files["gpt2"], tmp_path / "q8.gguf", "Q8_0", progress=stop)
    assert os.listdir(tmp_path) == []


def test_a_killed_writer_leaves_no_output(tmp_path: Path) -> None:
    """A process killed mid-write (no cleanup runs) leaves only a hidden .tmp file."""
    code = (
        "import os, signal, sys, numpy as np\n"
        "from qllama.gguf.writer import GGUFWriter\n"
        "w = GGUFWriter()\n"
        "w.add_tensor('a', np.zeros((4, 32), np.float32), 'F32')\n"
        "def die():\n"
        "    os.kill(os.getpid(), signal.SIGKILL)\n"
        "w.add_tensor('b', die, 'F32', (4, 32))\n"
        "w.write(sys.argv[1])\n"
    )
    run = subprocess.run([sys.executable, "-c", code, str(tmp_path / "out.gguf")], check=False)
    assert run.returncode == -signal.SIGKILL
    left = os.listdir(tmp_path)
    assert "out.gguf" not in left
    assert all(n.startswith(".out.gguf.") and n.endswith(".tmp") for n in left)


def test_atomic_write_of_other_outputs(tmp_path: Path) -> None:
    """Text and npz outputs (markers, references, fuzz reports) go through the same path."""
    with pytest.raises(TypeError), atomic_write(tmp_path / "ref.npz") as f:
        np.savez(f, ok=np.zeros(3))
        raise TypeError("half-way")
    with pytest.raises(ValueError), atomic_write(tmp_path / "marker.json", "w") as f:
        f.write('{"half": ')
        raise ValueError("half-way")
    assert os.listdir(tmp_path) == []


# --- missing backend or device -----------------------------------------------------------------


def test_unknown_backend(files: dict[str, Path], open_files: Callable[[Path], int]) -> None:
    with pytest.raises(BackendError, match="unknown backend 'cuda-magic'; available: numpy"):
        backends.get_backend("cuda-magic")
    before = open_files(files["gpt2"])  # earlier tests' models may still hold it
    with pytest.raises(BackendError, match="unknown backend"):
        qllama.load(files["gpt2"], backend="cuda-magic")
    assert open_files(files["gpt2"]) == before  # the refused load closed its file


def test_backend_from_the_environment(
    files: dict[str, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("QLLAMA_BACKEND", "nope")
    with pytest.raises(BackendError, match="unknown backend 'nope'"):
        qllama.load(files["gpt2"])
    monkeypatch.setenv("QLLAMA_DEVICE", "tpu")
    with pytest.raises(BackendError, match="backend numpy has no device 'tpu'"):
        qllama.load(files["gpt2"], backend="numpy")


@pytest.mark.parametrize("name", ["torch", "jax", "array_api_strict"])
def test_missing_optional_package(monkeypatch: pytest.MonkeyPatch, name: str) -> None:
    package = backends.BUILTIN[name][1]
    real = importlib.util.find_spec
    monkeypatch.setattr(
        backends.importlib.util,
        "find_spec",
        lambda n, *a: None if n == package else real(n, *a),
    )
    with pytest.raises(BackendError, match=f"backend {name} needs the package '{package}'"):
        backends.get_backend(name)


def test_missing_device() -> None:
    with pytest.raises(BackendError, match="backend numpy has no device 'cuda'"):
        backends.get_backend("numpy", device="cuda")
    with pytest.raises(BackendError, match="numpy"):
        backends.get_backend("numpy", activations="int3")


def test_missing_torch_device() -> None:
    torch = pytest.importorskip("torch")
    with pytest.raises(BackendError, match="backend torch has no device 'tpu'"):
        backends.get_backend("torch", device="tpu")
    if not torch.cuda.is_available():
        with pytest.raises(BackendError, match="device 'cuda' is not available here"):
            backends.get_backend("torch", device="cuda")
    with pytest.raises(BackendError, match="takes no options"):
        backends.get_backend("torch", activations="q8")


def test_bad_kv_precision(files: dict[str, Path]) -> None:
    with pytest.raises(BackendError, match="KV cache precision must be one of"):
        qllama.load(files["gpt2"], kv_precision="f8")


# --- the chat template of a hostile file -------------------------------------------------------


def test_hostile_chat_template_in_a_file(files: dict[str, Path], tmp_path: Path) -> None:
    """The template is code from the file: it loads, refuses to run, and the model goes on."""
    f = read_gguf(files["gpt2"])
    w = GGUFWriter()
    for k, v in f.kv.items():
        w.add(k, v)
    w.add("tokenizer.chat_template", "{{ cycler.__init__.__globals__.os.popen('id').read() }}")
    for t in f:
        w.add_tensor(t.name, np.array(f.tensor_data(t.name)), t.ggml_type, t.shape)
    f.close()
    w.write(tmp_path / "ssti.gguf")
    m = qllama.load(tmp_path / "ssti.gguf")
    with pytest.raises(ChatTemplateError, match="refused by the sandbox"):
        m.apply_chat_template([{"role": "user", "content": "hi"}])
    assert m.generate("the", max_new_tokens=1).ids
