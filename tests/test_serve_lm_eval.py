"""lm-evaluation-harness 0.4.13's ``local-completions`` scoring a multiple-choice task against
``qllama serve``: its per-request loglikelihoods equal qllama's in-process ones.

The task is a small local JSONL file (no download). lm-eval finds qllama's tokenizer at
``/tokenizer_info`` and ``/tokenize`` (no transformers tokenizer), sends token-id prompts in
batches of two, two at a time, and sums ``token_logprobs[ctxlen:-1]`` of the echoed prompt.

Without a prefix cache every prompt runs whole in one chunk, and under the CPU arithmetic on
Q8_0 weights the batch changes no bit (tests/test_serve_batch.py): the loglikelihoods are equal
to one forward pass in-process exactly. With the prefix cache the choices after a shared
context run in another chunking, within the CPU arithmetic's rounding bound.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

pytest.importorskip("fastapi")
lm_eval = pytest.importorskip("lm_eval")

from bounds import q8_flip_bound  # noqa: E402

import qllama  # noqa: E402
from qllama.array_api import to_numpy  # noqa: E402
from qllama.measure.metrics import log_softmax  # noqa: E402
from qllama.serve import Limits, ServerThread, create_app, open_models  # noqa: E402
from qllama.synthetic import TinyConfig, write_tiny  # noqa: E402

KEY = "lm-eval-key"
DOCS = [  # lm-eval puts its target delimiter, a space, before each choice
    {"question": "The sky is", "choices": ["blue", "green", "the sea"], "answer": 0},
    {"question": "Cats like to", "choices": ["sleep", "swim", "sing a song"], "answer": 0},
    {"question": "Two plus two is", "choices": ["four", "five", "4"], "answer": 0},
    {"question": "Hello, world", "choices": ["!", "again", "at last"], "answer": 1},
    {"question": "The cat sat on the", "choices": ["mat", "hat", "rat", "the"], "answer": 0},
    {"question": "In the beginning", "choices": ["there was", "is", "at"], "answer": 2},
]
TASK = """task: qllama_tiny_choice
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: multiple_choice
doc_to_text: "{{{{question}}}}"
doc_to_choice: choices
doc_to_target: answer
metric_list:
  - metric: acc
"""


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("lm_eval") / "tiny-q8.gguf"
    write_tiny(path, TinyConfig(n_embd=64, n_ff=128, weight_type="Q8_0", n_ctx=256, scale=0.5))
    return path


@pytest.fixture(scope="module")
def task_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("task")
    data = folder / "data.jsonl"
    data.write_text("".join(json.dumps(d) + "\n" for d in DOCS))
    (folder / "qllama_tiny_choice.yaml").write_text(TASK.format(data=data))
    return folder


# the prefix-cache run repeats the harness (~40 s here): behind the slow marker
@pytest.fixture(params=["fresh", pytest.param("prefix-cache", marks=pytest.mark.slow)])
def server(request: pytest.FixtureRequest, tiny: Path) -> Iterator[tuple[ServerThread, str]]:
    limits = Limits(prefix_caches=0) if request.param == "fresh" else Limits()
    registry = open_models({"tiny": tiny}, backend="numpy")
    with ServerThread(create_app(registry, limits=limits, api_key=KEY)) as s:
        yield s, request.param


def in_process(model: Any, context: str, continuation: str) -> tuple[float, bool, int, Any]:
    """lm-eval's split of the pair (trailing spaces move to the continuation, the whole is
    encoded and cut after the context's ids), scored by one forward pass."""
    spaces = len(context) - len(context.rstrip())
    if spaces:
        context, continuation = context[:-spaces], context[-spaces:] + continuation
    encode = lambda text: model.tokenizer.encode(text, add_bos=False, add_eos=False)  # noqa: E731
    whole, n_ctx = encode(context + continuation), len(encode(context))
    logits = to_numpy(model.forward(whole, all_logits=True))
    lp = log_softmax(logits)
    rows = np.arange(n_ctx - 1, len(whole) - 1)
    picked = lp[rows, np.asarray(whole[n_ctx:])]
    greedy = bool(np.all(np.argmax(lp[rows], axis=-1) == np.asarray(whole[n_ctx:])))
    return float(picked.sum()), greedy, len(whole) - n_ctx, logits


def test_local_completions_loglikelihoods(
    server: tuple[ServerThread, str],
    tiny: Path,
    task_dir: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    s, mode = server
    monkeypatch.setenv("OPENAI_API_KEY", KEY)  # lm-eval's API models send it as the bearer
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    from lm_eval import simple_evaluate
    from lm_eval.tasks import TaskManager

    out = simple_evaluate(
        model="local-completions",
        model_args={
            "model": "tiny",
            "base_url": f"{s.url}/v1/completions",
            "auth_token": KEY,
            "batch_size": 2,
            "num_concurrent": 2,
            "max_retries": 1,
            "timeout": 120,
        },
        tasks=["qllama_tiny_choice"],
        task_manager=TaskManager(include_path=str(task_dir)),
        log_samples=True,
    )
    assert out is not None
    samples = out["samples"]["qllama_tiny_choice"]
    assert len(samples) == len(DOCS)
    model = qllama.load(tiny, backend="numpy")
    n_requests, correct = 0, 0
    for sample in samples:
        doc = sample["doc"]
        served = [r[0] for r in sample["resps"]]  # one (loglikelihood, is_greedy) per choice
        pairs = sample["arguments"]  # (context, " " + choice): what lm-eval scored
        assert len(served) == len(pairs) == len(doc["choices"])
        ours = []
        for (context, continuation), (ll, greedy) in zip(pairs, served, strict=True):
            want, want_greedy, n_cont, logits = in_process(model, context, continuation)
            if mode == "fresh":
                assert (float(ll), bool(greedy)) == (want, want_greedy)
            else:  # |Δ log p| <= 2 max|Δ logit| per token, summed over the continuation
                bound = (
                    2 * n_cont * q8_flip_bound(model.config.n_layer, float(np.abs(logits).max()))
                )
                assert abs(float(ll) - want) <= bound
            ours.append(want)
            n_requests += 1
        correct += int(np.argmax(ours) == doc["answer"])
    assert n_requests == sum(len(d["choices"]) for d in DOCS)
    acc = out["results"]["qllama_tiny_choice"]["acc,none"]
    assert acc == pytest.approx(correct / len(DOCS))
