"""lm-evaluation-harness on a qllama model: HFLM(pretrained=QllamaForCausalLM, tokenizer=...).

Tasks are read from a local dataset file (tests/data/lm_eval_tiny.jsonl), so nothing is
downloaded. lm-eval tokenizes (its own context/continuation split) and batches; the scores
must be qllama's: each loglikelihood equals log-softmax sums of ``Model.forward`` over the same
tokens, in one pass as lm-eval runs them (batch size 1: the same chunk, so the same logits).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")
pytest.importorskip("lm_eval")

from bounds import forward_bound, gamma  # noqa: E402

from qllama.array_api import to_numpy  # noqa: E402
from qllama.hf import QllamaForCausalLM, QllamaTokenizer  # noqa: E402
from qllama.runtime.generation import Sampler, generate_ids  # noqa: E402
from qllama.synthetic import TinyConfig, write_tiny  # noqa: E402

DATA = Path(__file__).parent / "data" / "lm_eval_tiny.jsonl"
TASKS = {
    "qllama_tiny_choice": """
output_type: multiple_choice
doc_to_text: "{{question}}"
doc_to_target: "{{answer}}"
doc_to_choice: "{{choices}}"
metric_list:
  - metric: acc
    aggregation: mean
    higher_is_better: true
""",
    "qllama_tiny_rolling": """
output_type: loglikelihood_rolling
doc_to_text: ""
doc_to_target: "{{text}}"
metric_list:
  - metric: word_perplexity
""",
    "qllama_tiny_until": """
output_type: generate_until
doc_to_text: "{{question}}"
doc_to_target: "{{choices[answer]}}"
generation_kwargs:
  until: ["at"]
  max_gen_toks: 8
  do_sample: false
metric_list:
  - metric: exact_match
    aggregation: mean
    higher_is_better: true
""",
}


@pytest.fixture(scope="module")
def tasks(tmp_path_factory: pytest.TempPathFactory) -> Any:
    """The three tasks as YAML files (lm-eval wants the data file's path written in them)."""
    from lm_eval.tasks import TaskManager

    folder = tmp_path_factory.mktemp("tasks")
    for name, body in TASKS.items():
        head = (
            f"task: {name}\ndataset_path: json\ndataset_kwargs:\n  data_files:\n"
            f"    test: {DATA}\ntest_split: test\n"
        )
        (folder / f"{name}.yaml").write_text(head + body)
    return TaskManager(include_path=str(folder))


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("lm") / "tiny.gguf"
    write_tiny(path, TinyConfig(n_layer=2, weight_type="Q8_0", scale=0.3))
    return path


def evaluate(model: QllamaForCausalLM, tasks: Any, batch_size: int) -> tuple[Any, dict]:
    import lm_eval
    from lm_eval.models.huggingface import HFLM

    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")  # the json builder needs no hub
    lm = HFLM(
        pretrained=model,
        tokenizer=QllamaTokenizer.from_llm(model),
        backend="causal",
        batch_size=batch_size,
    )
    out = lm_eval.simple_evaluate(model=lm, tasks=list(TASKS), task_manager=tasks, log_samples=True)
    return lm, out


def scored(
    m: QllamaForCausalLM, context: list[int], continuation: list[int]
) -> tuple[float, bool, float]:
    """qllama's log-likelihood of ``continuation`` after ``context`` (float64 log-softmax of
    one pass), whether it is the greedy continuation, and how far lm-eval's float32 sum may be
    from it: a log-softmax of V terms within gamma(V) (1 + max |logit|) each, a sum of n terms
    within gamma(n) of its magnitude."""
    ids = context + continuation
    logits = to_numpy(m.llm.forward(ids[:-1], 0, all_logits=True)).astype(np.float64)
    rows = logits[len(context) - 1 :]
    lse = np.log(np.exp(rows - rows.max(-1, keepdims=True)).sum(-1)) + rows.max(-1)
    lp = rows[np.arange(len(continuation)), continuation] - lse
    greedy = bool((rows.argmax(-1) == continuation).all())
    n, v = len(continuation), rows.shape[-1]
    bound = 2 * (n * gamma(v) * (1 + np.abs(rows).max()) + gamma(n) * np.abs(lp).sum())
    return float(lp.sum()), greedy, float(bound)


def test_loglikelihoods_are_qllamas(tiny: Path, tasks: Any) -> None:
    m = QllamaForCausalLM.from_gguf(tiny)  # the CPU arithmetic
    lm, out = evaluate(m, tasks, batch_size=1)
    docs = out["samples"]["qllama_tiny_choice"]
    assert len(docs) == 3
    for doc in docs:
        for args, resp in zip(doc["arguments"], doc["resps"], strict=True):
            context, continuation = args[0], args[1]
            ctx, cont = lm._encode_pair(context, continuation)
            want, greedy, bound = scored(m, ctx, cont)
            got, got_greedy = resp[0]
            assert abs(got - want) <= bound and got_greedy == greedy
    # rolling: the whole text after lm-eval's prefix token, one window (short texts)
    assert len(out["samples"]["qllama_tiny_rolling"]) == 3
    for doc in out["samples"]["qllama_tiny_rolling"]:
        tokens = lm.tok_encode(doc["arguments"][0][0])
        want, _, bound = scored(m, [lm.prefix_token_id], tokens)
        assert abs(doc["resps"][0][0] - want) <= bound
    assert 0 <= out["results"]["qllama_tiny_choice"]["acc,none"] <= 1


def test_generate_until_is_qllamas_greedy_text(tiny: Path, tasks: Any) -> None:
    m = QllamaForCausalLM.from_gguf(tiny)
    lm, out = evaluate(m, tasks, batch_size=1)
    tok = lm.tokenizer
    assert len(out["samples"]["qllama_tiny_until"]) == 3
    for doc in out["samples"]["qllama_tiny_until"]:
        context, kwargs = doc["arguments"][0]
        ids = lm.tok_encode(context)
        new = list(
            generate_ids(m.llm, ids, max_new_tokens=kwargs["max_gen_toks"], sampler=Sampler())
        )
        text = tok.decode(new, skip_special_tokens=True)
        for stop in [*kwargs["until"], tok.decode([lm.eot_token_id])]:
            text = text.split(stop)[0]
        assert doc["resps"][0][0] == text


def test_batches_agree_with_single_requests(tiny: Path, tasks: Any) -> None:
    """batch_size 2: lm-eval pads on the right without a mask, so the padding runs as tokens
    after the real ones (causal: it cannot change them) and the chunks are longer. In float32
    arithmetic that changes rounding only: within the forward bound per logit, twice that per
    log-softmax, summed over the continuation."""
    m = QllamaForCausalLM.from_gguf(tiny, activations="f32")
    lm, one = evaluate(m, tasks, batch_size=1)
    _, two = evaluate(m, tasks, batch_size=2)
    c = m.llm.config
    pairs = zip(
        one["samples"]["qllama_tiny_choice"], two["samples"]["qllama_tiny_choice"], strict=True
    )
    cases = [
        (ra[0][0], rb[0][0], *lm._encode_pair(args[0], args[1]))
        for a, b in pairs
        for ra, rb, args in zip(a["resps"], b["resps"], a["arguments"], strict=True)
    ]
    width = max(c.n_embd, c.n_ff, *(len(ctx) + len(cont) for _, _, ctx, cont in cases))
    for got_one, got_two, ctx, cont in cases:
        ids = ctx + cont
        scale = float(np.abs(to_numpy(m.llm.forward(ids[:-1], 0, all_logits=True))).max())
        tol = 2 * len(cont) * forward_bound(c.n_layer, width, scale)
        assert abs(got_one - got_two) <= tol
