"""``qllama serve`` driven by real clients (the ``openai`` package, httpx) on loopback.

Every server here binds 127.0.0.1 on an ephemeral port and stops with its fixture or test;
requests are few and bounded in time. The model is a tiny Q8_0 llama under the CPU arithmetic,
so the engine's batches leave a sequence's numbers bit for bit as one ``forward`` computes them
(tests/test_serve_batch.py): a served greedy answer equals ``generate`` in-process, and a
served prompt score equals the log-softmax of one pass, exactly, where no cached prefix was
reused. A reused prefix changes how the prompt is chunked, so those scores are held to the
CPU arithmetic's rounding bound instead.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import json
import logging
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

httpx = pytest.importorskip("httpx")
openai = pytest.importorskip("openai")
pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")

from bounds import q8_flip_bound  # noqa: E402
from test_architectures import FAMILIES  # noqa: E402

import qllama  # noqa: E402
from qllama.array_api import to_numpy  # noqa: E402
from qllama.measure.metrics import log_softmax  # noqa: E402
from qllama.model_files import sha256_file  # noqa: E402
from qllama.serve import Limits, ServerThread, create_app, open_models  # noqa: E402
from qllama.synthetic import TinyConfig, write_tiny  # noqa: E402

TINY = TinyConfig(n_layer=2, n_embd=64, n_ff=128, weight_type="Q8_0", n_ctx=256, scale=0.5)
TIMEOUT = 60  # seconds any one client call may take


@pytest.fixture(scope="module")
def files(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    folder = tmp_path_factory.mktemp("serve")
    out = {"a": folder / "tiny-a.gguf", "b": folder / "tiny-b.gguf"}
    write_tiny(out["a"], TINY, seed=0)
    write_tiny(out["b"], TINY, seed=1)  # other weights: another sha256, other answers
    return out


@pytest.fixture(scope="module")
def ref(files: dict[str, Path]) -> Any:
    """Model a, in-process, for what the server must return."""
    return qllama.load(files["a"], backend="numpy")


def start(files: dict[str, Path], **options: Any) -> ServerThread:
    registry = open_models({"tiny": files["a"]}, backend="numpy")
    limits = options.pop("limits", Limits())
    return ServerThread(create_app(registry, limits=limits, **options)).start()


@pytest.fixture(scope="module")
def server(files: dict[str, Path]) -> Iterator[ServerThread]:
    s = start(files, api_key="sekrit")
    yield s
    s.stop()


@pytest.fixture(scope="module")
def fresh(files: dict[str, Path]) -> Iterator[ServerThread]:
    """No prefix cache: every prompt runs whole, in one chunk."""
    s = start(files, limits=Limits(prefix_caches=0))
    yield s
    s.stop()


def client(s: ServerThread, key: str = "sekrit") -> Any:
    return openai.OpenAI(base_url=s.url + "/v1", api_key=key, timeout=TIMEOUT, max_retries=0)


def health(s: ServerThread, key: str = "sekrit") -> dict[str, Any]:
    r = httpx.get(s.url + "/health", headers={"Authorization": f"Bearer {key}"}, timeout=TIMEOUT)
    return dict(r.json())


def wait_idle(s: ServerThread, key: str = "sekrit", seconds: float = 30) -> dict[str, Any]:
    """Health once nothing is active or queued (a bounded wait)."""
    deadline = time.monotonic() + seconds
    while True:
        h = health(s, key)
        if (h["active"], h["queued"]) == (0, 0) or time.monotonic() > deadline:
            return h
        time.sleep(0.05)


def scores(model: Any, ids: list[int]) -> np.ndarray:
    """log p(ids[i] | ids[:i]) for i >= 1, from one forward pass in-process."""
    lp = log_softmax(to_numpy(model.forward(ids, all_logits=True)))
    return lp[np.arange(len(ids) - 1), ids[1:]]


PROMPT = [5, 40, 77, 200, 61, 130, 8]


# --- what every answer says ------------------------------------------------------------------


def test_models_name_the_file_and_arithmetic(server: ServerThread, files: dict[str, Path]) -> None:
    c = client(server)
    (m,) = c.models.list().data
    assert (m.id, m.owned_by) == ("tiny", "qllama")
    info = m.qllama
    assert info["sha256"] == sha256_file(files["a"]) and info["file"] == files["a"].name
    assert (info["backend"], info["arithmetic"], info["n_ctx"]) == ("numpy", "cpu", 256)
    r = c.completions.create(model="tiny", prompt=PROMPT, max_tokens=2, temperature=0)
    assert r.qllama["sha256"] == info["sha256"]  # type: ignore[attr-defined]
    assert r.system_fingerprint == f"qllama-numpy-cpu-{info['sha256'][:16]}"


# --- completions -----------------------------------------------------------------------------


def test_greedy_completion_is_generate(server: ServerThread, ref: Any) -> None:
    r = client(server).completions.create(
        model="tiny", prompt="Hello world", max_tokens=12, temperature=0
    )
    want = ref.generate("Hello world", max_new_tokens=12)
    assert r.choices[0].text == want.text
    assert r.choices[0].finish_reason == ("length" if want.finish_reason == "length" else "stop")
    assert r.usage.prompt_tokens == len(want.prompt_ids)


def test_echo_scores_the_prompt_exactly(fresh: ServerThread, ref: Any) -> None:
    """lm-eval's request: echo, logprobs 1, max_tokens 1, token ids: one entry per prompt
    token (the first null) plus the generated one, equal to one pass in-process."""
    r = client(fresh).completions.create(
        model="tiny", prompt=[PROMPT], max_tokens=1, logprobs=1, echo=True, temperature=0
    )
    lp = r.choices[0].logprobs
    assert len(lp.token_logprobs) == len(PROMPT) + 1 and lp.token_logprobs[0] is None
    assert lp.top_logprobs[0] is None and lp.text_offset[0] == 0
    np.testing.assert_array_equal(lp.token_logprobs[1:-1], scores(ref, PROMPT))
    greedy = ref.generate(PROMPT, max_new_tokens=1).ids[0]
    assert lp.tokens[-1] == ref.tokenizer.token_to_piece(greedy)
    assert lp.token_logprobs[-1] == max(lp.top_logprobs[-1].values())  # lm-eval's is_greedy
    assert r.choices[0].text == ref.tokenizer.decode([*PROMPT, greedy])


def test_max_tokens_0_with_echo_is_the_prompt_only(fresh: ServerThread, ref: Any) -> None:
    r = client(fresh).completions.create(
        model="tiny", prompt=PROMPT, max_tokens=0, logprobs=3, echo=True
    )
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == len(PROMPT) and r.usage.completion_tokens == 0
    # keyed by text: tokens that render alike (bytes of one character) share a key
    assert all(1 <= len(top) <= 4 for top in lp.top_logprobs[1:])
    np.testing.assert_array_equal(lp.token_logprobs[1:], scores(ref, PROMPT))


def test_shared_context_reuses_the_cached_prefix(server: ServerThread, ref: Any) -> None:
    """Two answer choices after one context: the second runs only what differs (and the
    context's last token), its scores within the rounding bound of one pass."""
    context = [9, 33, 120, 250, 14, 77, 61, 3, 190, 222, 45, 18]
    c = client(server)
    first, second = [*context, 100, 101], [*context, 150]
    c.completions.create(model="tiny", prompt=[first], max_tokens=1, logprobs=1, echo=True)
    before = wait_idle(server)["tokens"]
    r = c.completions.create(model="tiny", prompt=[second], max_tokens=1, logprobs=1, echo=True)
    after = wait_idle(server)["tokens"]
    assert after - before == 2  # the context's last token and the choice, not 13
    got = np.asarray(r.choices[0].logprobs.token_logprobs[1:-1])
    want = scores(ref, second)
    logits = to_numpy(ref.forward(second, all_logits=True))
    # |Δ log p| <= 2 max |Δ logit| (log-softmax is 2-Lipschitz in the max norm)
    bound = 2 * q8_flip_bound(ref.config.n_layer, float(np.abs(logits).max()))
    np.testing.assert_allclose(got, want, rtol=0, atol=bound)
    np.testing.assert_array_equal(got[: len(context) - 2], scores(ref, first)[: len(context) - 2])


def test_streaming_gives_the_same_text(server: ServerThread) -> None:
    c = client(server)
    whole = c.completions.create(model="tiny", prompt="The cat", max_tokens=20, temperature=0)
    chunks = list(
        c.completions.create(
            model="tiny",
            prompt="The cat",
            max_tokens=20,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    text = "".join(ch.choices[0].text for ch in chunks if ch.choices)
    assert text == whole.choices[0].text
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 20
    assert [ch.choices[0].finish_reason for ch in chunks if ch.choices][-1] == "length"


def test_several_prompts_and_choices(server: ServerThread, ref: Any) -> None:
    c = client(server)
    args = dict(model="tiny", prompt=[[1, 2, 3], [4, 5]], max_tokens=6, n=2, seed=11)
    r = c.completions.create(temperature=1.0, **args)
    assert [ch.index for ch in r.choices] == [0, 1, 2, 3]
    again = c.completions.create(temperature=1.0, **args)
    assert [ch.text for ch in r.choices] == [ch.text for ch in again.choices]  # by seed
    greedy = c.completions.create(temperature=0, **args)
    want = ref.generate([4, 5], max_new_tokens=6).text
    assert greedy.choices[2].text == greedy.choices[3].text == want


def test_stop_string_cuts_and_frees(server: ServerThread, ref: Any) -> None:
    full = ref.generate("Hello", max_new_tokens=30, temperature=1.0, seed=3).text
    stop = full[4:6]
    assert len(full) > 6 and stop
    r = client(server).completions.create(
        model="tiny", prompt="Hello", max_tokens=30, temperature=1.0, seed=3, stop=[stop]
    )
    assert r.choices[0].text == full[: full.index(stop)]
    assert r.choices[0].finish_reason == "stop"
    assert wait_idle(server)["active"] == 0


# --- chat ------------------------------------------------------------------------------------

MESSAGES = [{"role": "user", "content": "What is a cache?"}]


def test_chat_is_the_template_then_generate(server: ServerThread, ref: Any) -> None:
    c = client(server)
    r = c.chat.completions.create(
        model="tiny", messages=MESSAGES, max_tokens=10, temperature=0, logprobs=True, top_logprobs=2
    )
    want = ref.generate(ref.apply_chat_template(MESSAGES), max_new_tokens=10)
    msg = r.choices[0].message
    assert (msg.role, msg.content) == ("assistant", want.text)
    content = r.choices[0].logprobs.content
    assert len(content) == len([t for t in want.ids if t not in ref.tokenizer.stop_ids])
    assert all(len(e.top_logprobs) == 2 for e in content)
    chunks = list(
        c.chat.completions.create(
            model="tiny", messages=MESSAGES, max_tokens=10, temperature=0, stream=True
        )
    )
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(ch.choices[0].delta.content or "" for ch in chunks) == want.text
    assert chunks[-1].choices[0].finish_reason == r.choices[0].finish_reason


# --- the tokenizer endpoints (lm-eval's remote tokenizer) ------------------------------------


def test_tokenize_round_trip(server: ServerThread, ref: Any) -> None:
    auth = {"Authorization": "Bearer sekrit"}
    text = "Grüße, 世界! 🙂 <|im_end|>"
    r = httpx.post(
        server.url + "/tokenize",
        json={"prompt": text, "add_special_tokens": False},
        headers=auth,
        timeout=TIMEOUT,
    )
    ids = r.json()["tokens"]
    assert ids == ref.tokenizer.encode(text, add_bos=False, add_eos=False)
    back = httpx.post(server.url + "/detokenize", json={"tokens": ids}, headers=auth)
    assert back.json()["prompt"] == text
    info = httpx.get(server.url + "/tokenizer_info", headers=auth).json()
    assert info["eos_token"] == ref.tokenizer.tokens[ref.tokenizer.eos_id]
    assert info["chat_template"] == ref.chat_template.source and info["model_max_length"] == 256


# --- refusals --------------------------------------------------------------------------------

BAD = [
    ("POST", "/v1/completions", "{not json", 400),
    ("POST", "/v1/completions", "[1, 2]", 400),
    ("POST", "/v1/completions", '"text"', 400),
    ("POST", "/v1/completions", "{}", 400),
    ("POST", "/v1/completions", '{"prompt": true}', 400),
    ("POST", "/v1/completions", '{"prompt": [1, true]}', 400),
    ("POST", "/v1/completions", '{"prompt": [1.5]}', 400),
    ("POST", "/v1/completions", '{"prompt": []}', 400),
    ("POST", "/v1/completions", '{"prompt": [[]]}', 400),
    ("POST", "/v1/completions", '{"prompt": ""}', 400),
    ("POST", "/v1/completions", '{"prompt": [-1]}', 400),
    ("POST", "/v1/completions", '{"prompt": [269]}', 400),
    ("POST", "/v1/completions", '{"prompt": "x", "max_tokens": -1}', 400),
    ("POST", "/v1/completions", '{"prompt": "x", "max_tokens": 100000}', 400),
    ("POST", "/v1/completions", '{"prompt": "x", "max_tokens": 256}', 400),
    ("POST", "/v1/completions", '{"prompt": "x", "max_tokens": 0}', 400),
    ("POST", "/v1/completions", '{"prompt": "x", "max_tokens": "5"}', 400),
    ("POST", "/v1/completions", '{"prompt": "x", "temperature": NaN}', 400),
    ("POST", "/v1/completions", '{"prompt": "x", "temperature": -1}', 400),
    ("POST", "/v1/completions", '{"prompt": "x", "top_p": 0}', 400),
    ("POST", "/v1/completions", '{"prompt": "x", "logprobs": 21}', 400),
    ("POST", "/v1/completions", '{"prompt": "x", "n": 100}', 400),
    ("POST", "/v1/completions", '{"prompt": "x", "stop": [""]}', 400),
    ("POST", "/v1/completions", '{"prompt": "x", "presence_penalty": 1}', 400),
    ("POST", "/v1/completions", '{"prompt": "x", "model": "nope"}', 404),
    ("POST", "/v1/completions", json.dumps({"prompt": [1] * 300}), 400),
    ("POST", "/v1/chat/completions", '{"messages": []}', 400),
    ("POST", "/v1/chat/completions", '{"messages": [{"role": "wizard", "content": "x"}]}', 400),
    ("POST", "/v1/chat/completions", '{"messages": [{"role": "user"}], "tools": [{}]}', 400),
    ("POST", "/detokenize", '{"tokens": [1, 99999]}', 400),
    ("POST", "/tokenize", '{"prompt": 5}', 400),
    ("GET", "/v1/completions", None, 405),
    ("GET", "/v2/nothing", None, 404),
    ("POST", "/v1/models/load", '{"model": "x", "path": "../../../etc/passwd"}', 400),
    ("POST", "/v1/models/load", '{"model": "x", "path": "/etc/passwd"}', 400),
    ("POST", "/v1/models/load", '{"model": "a b", "path": "tiny-b.gguf"}', 400),
    ("POST", "/v1/models/unload", '{"model": "nope"}', 404),
]


@pytest.mark.parametrize(("method", "path", "body", "status"), BAD)
def test_bad_requests_get_json_errors(
    server: ServerThread, method: str, path: str, body: str | None, status: int
) -> None:
    headers = {"Authorization": "Bearer sekrit", "Content-Type": "application/json"}
    r = httpx.request(method, server.url + path, content=body, headers=headers, timeout=TIMEOUT)
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert isinstance(error["message"], str) and error["message"] and "Traceback" not in r.text


def test_oversized_bodies_get_413(files: dict[str, Path]) -> None:
    with start(files, limits=Limits(max_body_bytes=1000)) as s:
        big = json.dumps({"prompt": "x" * 2000})
        r = httpx.post(s.url + "/v1/completions", content=big, timeout=TIMEOUT)
        assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large"

        def chunked() -> Iterator[bytes]:  # no content-length: counted as it comes
            for _ in range(20):
                yield b" " * 100

        r = httpx.post(s.url + "/v1/completions", content=chunked(), timeout=TIMEOUT)
        assert r.status_code == 413
        assert httpx.get(s.url + "/health").status_code == 200


def test_api_key(server: ServerThread, fresh: ServerThread) -> None:
    for key in ("wrong", "sekri", "sekrit2"):
        with pytest.raises(openai.AuthenticationError):
            client(server, key).models.list()
    r = httpx.get(server.url + "/health")
    assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error"
    # without a key the server is open, but its admin endpoints are off
    assert httpx.get(fresh.url + "/health").status_code == 200
    r = httpx.post(fresh.url + "/v1/models/unload", json={"model": "tiny"})
    assert r.status_code == 403


def test_full_queue_answers_429(files: dict[str, Path]) -> None:
    with start(files, limits=Limits(max_sequences=1, max_queue=2)) as s:
        engine = s.app.state.engine
        c = client(s)
        with concurrent.futures.ThreadPoolExecutor(2) as pool:
            with engine.step_lock:  # the engine is paused: two requests fill the queue
                waiting = [
                    pool.submit(c.completions.create, model="tiny", prompt="hi", max_tokens=2)
                    for _ in range(2)
                ]
                deadline = time.monotonic() + TIMEOUT
                while health(s)["queued"] < 2 and time.monotonic() < deadline:
                    time.sleep(0.02)
                with pytest.raises(openai.RateLimitError):
                    c.completions.create(model="tiny", prompt="hi", max_tokens=2)
            assert all(len(f.result(TIMEOUT).choices) == 1 for f in waiting)


def test_disconnect_stops_the_sequence(server: ServerThread) -> None:
    body = {"model": "tiny", "prompt": "x", "max_tokens": 200, "stream": True, "temperature": 0}
    headers = {"Authorization": "Bearer sekrit"}
    with httpx.stream(
        "POST", server.url + "/v1/completions", json=body, headers=headers, timeout=TIMEOUT
    ) as r:
        first = next(r.iter_lines())
        assert first.startswith("data: ")
    h = wait_idle(server)
    assert (h["active"], h["queued"]) == (0, 0)


def together(s: ServerThread, model: str, prompts: list[list[int]], n: int) -> list[str]:
    """Greedy completions of ``prompts``, all admitted in one step (the engine held until
    every request is queued), so that the engine decodes them in the same batches."""
    c = client(s)
    with concurrent.futures.ThreadPoolExecutor(len(prompts)) as pool:
        with s.app.state.engine.step_lock:
            futures = [
                pool.submit(
                    c.completions.create, model=model, prompt=p, max_tokens=n, temperature=0
                )
                for p in prompts
            ]
            deadline = time.monotonic() + TIMEOUT
            while health(s)["queued"] < len(prompts) and time.monotonic() < deadline:
                time.sleep(0.02)
        return [f.result(TIMEOUT).choices[0].text for f in futures]


def test_concurrent_requests_are_decoded_together(server: ServerThread, ref: Any) -> None:
    """Six requests admitted in one step (the engine held meanwhile): fewer passes than
    tokens, and each answer still what the model gives it alone."""
    prompts = [[3 + i, 50 + 7 * i, 90] for i in range(6)]
    before = health(server)
    answers = together(server, "tiny", prompts, 8)
    after = health(server)
    assert answers == [ref.generate(p, max_new_tokens=8).text for p in prompts]
    assert after["steps"] - before["steps"] < after["tokens"] - before["tokens"]


# --- several models, hot swap ----------------------------------------------------------------


def test_hot_swap_keeps_running_requests(server: ServerThread, files: dict[str, Path]) -> None:
    """A stream admitted on file a runs on a after tiny is replaced by file b; new requests
    get b; a's weights go when that stream ends; unload, and load back."""
    engine = server.app.state.engine
    auth = {"Authorization": "Bearer sekrit"}
    sha = {k: sha256_file(p) for k, p in files.items()}
    ref_a = qllama.load(files["a"], backend="numpy").generate("swap", max_new_tokens=40)
    body = {"model": "tiny", "prompt": "swap", "max_tokens": 40, "temperature": 0, "stream": True}
    chunks: list[dict[str, Any]] = []

    def read() -> None:
        with httpx.stream(
            "POST", server.url + "/v1/completions", json=body, headers=auth, timeout=TIMEOUT
        ) as r:
            for line in r.iter_lines():
                if line.startswith("data: {"):
                    chunks.append(json.loads(line[len("data: ") :]))

    reader = threading.Thread(target=read)
    with engine.step_lock:  # the engine is paused: the stream is queued on a, not yet run
        reader.start()
        deadline = time.monotonic() + TIMEOUT
        while health(server)["queued"] < 1 and time.monotonic() < deadline:
            time.sleep(0.02)
        load = {"model": "tiny", "path": files["b"].name}
        swapped = httpx.post(
            server.url + "/v1/models/load", json=load, headers=auth, timeout=TIMEOUT
        ).json()
        assert swapped["replaced"]["sha256"] == sha["a"]
        assert health(server)["retired_models_held"] == 1  # the queued stream holds a
    reader.join(TIMEOUT)
    assert chunks and {ch["qllama"]["sha256"] for ch in chunks} == {sha["a"]}
    assert "".join(ch["choices"][0]["text"] for ch in chunks) == ref_a.text
    assert wait_idle(server)["retired_models_held"] == 0
    r = client(server).completions.create(model="tiny", prompt="swap", max_tokens=2)
    assert r.qllama["sha256"] == sha["b"]  # type: ignore[attr-defined]
    gone = httpx.post(server.url + "/v1/models/unload", json={"model": "tiny"}, headers=auth)
    assert gone.status_code == 200
    with pytest.raises(openai.NotFoundError):
        client(server).completions.create(model="tiny", prompt="x", max_tokens=1)
    back = {"model": "tiny", "path": files["a"].name}
    r2 = httpx.post(server.url + "/v1/models/load", json=back, headers=auth, timeout=TIMEOUT)
    assert r2.json()["loaded"]["qllama"]["sha256"] == sha["a"]


# --- the log and a bounded mixed load --------------------------------------------------------


def test_log_lines_cannot_be_forged(server: ServerThread, caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.INFO, logger="qllama.serve.access"):
        httpx.get(server.url + "/v1/models%0D%0A127.0.0.1 GET /admin 200?x=%0Ay")
        deadline = time.monotonic() + TIMEOUT  # the line is written once the response is sent
        while not any("admin" in r.getMessage() for r in caplog.records):
            assert time.monotonic() < deadline
            time.sleep(0.02)
    lines = [r.getMessage() for r in caplog.records if r.name == "qllama.serve.access"]
    assert lines and all("\r" not in line and "\n" not in line for line in lines)
    assert any("\\r\\n" in line for line in lines)


def test_mixed_load_is_served_whole(files: dict[str, Path]) -> None:
    """4 clients x 6 requests (streams, scores, chats, aborted streams, bad bodies): no 5xx,
    every answer complete, nothing left running. benchmarks/serve_load.py is the full one."""
    with start(files, limits=Limits(max_sequences=3)) as s:
        c = client(s)

        def one(i: int) -> str:
            kind = i % 6
            if kind == 0:
                chunks = list(
                    c.completions.create(
                        model="tiny", prompt=f"q{i}", max_tokens=8, stream=True, temperature=0
                    )
                )
                return "stream" if chunks[-1].choices[0].finish_reason else "broken"
            if kind == 1:
                r = c.completions.create(
                    model="tiny", prompt=[[1, 2, 3, i]], max_tokens=1, logprobs=1, echo=True
                )
                return "score" if len(r.choices[0].logprobs.tokens) == 5 else "broken"
            if kind == 2:
                r = c.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=5)
                return "chat" if r.choices[0].finish_reason else "broken"
            if kind == 3:
                with httpx.stream(
                    "POST",
                    s.url + "/v1/completions",
                    json={"prompt": "x", "max_tokens": 100, "stream": True},
                    timeout=TIMEOUT,
                ) as r:
                    next(r.iter_lines())
                return "aborted"
            if kind == 4:
                r = httpx.post(s.url + "/v1/completions", content=b"{oops", timeout=TIMEOUT)
                return "refused" if r.status_code == 400 else f"status {r.status_code}"
            r = httpx.post(s.url + "/v1/completions", json={"prompt": [1] * 400}, timeout=TIMEOUT)
            return "refused" if r.status_code == 400 else f"status {r.status_code}"

        with concurrent.futures.ThreadPoolExecutor(4) as pool:
            got = list(pool.map(one, range(24), timeout=5 * TIMEOUT))
        assert sorted(set(got)) == ["aborted", "chat", "refused", "score", "stream"]
        h = wait_idle(s)
        assert (h["active"], h["queued"], h["retired_models_held"]) == (0, 0, 0)
        assert h["idle_caches"] <= 3


def test_engine_thread_stops_with_the_server(files: dict[str, Path]) -> None:
    s = start(files)
    engine = s.app.state.engine
    client(s).completions.create(model="tiny", prompt="x", max_tokens=2)
    s.stop()
    assert not engine._thread.is_alive()
    assert not any(t.name == "qllama-engine" and t is engine._thread for t in threading.enumerate())


def test_chunks_do_not_depend_on_the_traffic(files: dict[str, Path], ref: Any) -> None:
    """A 20-token prompt in chunks of 8 (0-7, 8-15, 16-19), next to four other requests
    admitted in the same step: its scores are those of the same three chunks in-process,
    bit for bit."""
    ids = [7, 90, 13, 200, 45, 61, 3, 250, 18, 77, 140, 9, 33, 120, 66, 5, 190, 222, 41, 8]
    rows = [to_numpy(ref.forward(ids[:8], pos=0, all_logits=True))]
    rows += [to_numpy(ref.forward(ids[a : a + 8], pos=a, all_logits=True)) for a in (8, 16)]
    lp = log_softmax(np.concatenate(rows))
    want = lp[np.arange(len(ids) - 1), ids[1:]]
    # 16 tokens a step: the five prompts cannot all run their chunks at once
    limits = Limits(prefix_caches=0, prefill_chunk=8, batch_tokens=16)
    with start(files, limits=limits) as s:
        engine, c = s.app.state.engine, client(s)
        with concurrent.futures.ThreadPoolExecutor(5) as pool:
            with engine.step_lock:
                others = [
                    pool.submit(c.completions.create, model="tiny", prompt=[[i] * 11], max_tokens=9)
                    for i in range(1, 5)
                ]
                mine = pool.submit(
                    c.completions.create,
                    model="tiny",
                    prompt=[ids],
                    max_tokens=1,
                    logprobs=1,
                    echo=True,
                )
                deadline = time.monotonic() + TIMEOUT
                while health(s)["queued"] < 5 and time.monotonic() < deadline:
                    time.sleep(0.02)
            got = mine.result(TIMEOUT).choices[0].logprobs.token_logprobs[1:-1]
            assert all(f.result(TIMEOUT).choices[0].finish_reason for f in others)
    np.testing.assert_array_equal(got, want)


def test_nan_logits_are_a_json_500_and_the_server_goes_on(tmp_path: Path) -> None:
    from test_runtime_faults import _with_nan_weight

    clean = tmp_path / "f32.gguf"
    write_tiny(clean, TinyConfig(n_ctx=64))
    bad = _with_nan_weight(clean, tmp_path / "nan.gguf", "blk.0.attn_v.weight")
    registry = open_models({"nan": bad}, backend="numpy", check_weights=False)
    with ServerThread(create_app(registry)) as s:
        body = {"prompt": "hi", "max_tokens": 3}
        r = httpx.post(s.url + "/v1/completions", json=body, timeout=TIMEOUT)
        assert r.status_code == 500 and r.json()["error"]["code"] == "non_finite_logits"
        with httpx.stream(
            "POST", s.url + "/v1/completions", json={**body, "stream": True}, timeout=TIMEOUT
        ) as r:
            frames = [x for x in r.iter_lines() if x.startswith("data: ")]
        assert json.loads(frames[-2][len("data: ") :])["error"]["code"] == "non_finite_logits"
        assert frames[-1] == "data: [DONE]"
        h = wait_idle(s)
        assert (h["status"], h["active"], h["idle_caches"]) == ("ok", 0, 0)  # caches dropped


def test_the_load_schema_takes_llama_cpps_cache_types():
    from pydantic import ValidationError

    from qllama.serve.schemas import LoadRequest

    assert (
        LoadRequest(model="m", path="p", kv_precision="q8_0/q4_0,fa").kv_precision == "q8_0/q4_0,fa"
    )
    with pytest.raises(ValidationError, match="quantized V cache requires flash_attn"):
        LoadRequest(model="m", path="p", kv_precision="q4_0")


@pytest.mark.parametrize("name", ["qwen3moe", "gpt-oss"])
def test_a_mixture_of_experts_is_served_as_generate(tmp_path: Path, name: str) -> None:
    """A MoE file (Q8_0, the CPU arithmetic) served unchanged: four requests admitted in one
    step, whose tokens the engine's batches send to the experts together, each answer what
    ``generate`` gives its prompt alone."""
    path = tmp_path / f"{name}.gguf"
    write_tiny(path, dataclasses.replace(FAMILIES[name], weight_type="Q8_0"))
    ref = qllama.load(path, backend="numpy")
    s = ServerThread(create_app(open_models({"moe": path}, backend="numpy"))).start()
    try:
        prompts = [[3 + i, 50 + 7 * i, 90] for i in range(4)]
        answers = together(s, "moe", prompts, 6)
        assert answers == [ref.generate(p, max_new_tokens=6).text for p in prompts]
        assert health(s)["steps"] < health(s)["tokens"]
    finally:
        s.stop()
