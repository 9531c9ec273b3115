"""The F32 control against transformers, and the arithmetics against each other, on SmolLM2.

These need the model file (fetched from PyPI) and transformers; they take a few minutes.
"""

from __future__ import annotations

import importlib.util

import numpy as np
import pytest
from bounds import agreeing_steps, forward_bound

import qllama
from qllama.array_api import to_numpy
from qllama.model_files import variant

# one test process computes the module's transformers reference (about 2 minutes)
pytestmark = [pytest.mark.model, pytest.mark.xdist_group("smollm2-reference")]
MESSAGES = [{"role": "user", "content": "Explain how a CPU cache works."}]
NEW_TOKENS = 300


def _installed(name: str) -> None:
    if importlib.util.find_spec(name) is None:
        pytest.skip(f"{name} is not installed")


# session scope: xdist runs the group's tests in one process, but not one after another, and
# a module-scoped fixture was computed again each time its module came back (2 x 3 minutes)
@pytest.fixture(scope="session")
def f32_reference():
    """transformers f32 eager on qllama's F32 file: 300 greedy tokens, every position's logits."""
    _installed("transformers")
    from qllama.measure.reference import transformers_reference

    path = variant("smollm2-135m-instruct", "F32")
    model = qllama.load(path, dequantize_all=True)
    prompt = model.apply_chat_template(MESSAGES)
    assert len(prompt) == 37
    return path, transformers_reference(path, prompt, max_new_tokens=NEW_TOKENS)


def greedy(model, prompt, n):
    return model.generate(prompt, max_new_tokens=n).ids


def tolerance(model, logits) -> float:
    """Two float32 runs of this model in different orders (bounds.forward_bound): qllama and
    transformers, or two backends, sum the same products in their own orders."""
    c = model.config
    return forward_bound(c.n_layer, max(c.n_embd, c.n_ff, len(logits)), float(np.abs(logits).max()))


def assert_same_greedy(got, want, logits, bound) -> None:
    """Greedy tokens agree up to the first step where the reference is within ``bound`` of a
    tie (``logits``: the reference's, one row per step)."""
    top2 = np.sort(logits, axis=-1)[:, -2:]
    n = agreeing_steps(top2[:, 1] - top2[:, 0], bound)
    assert got[:n] == want[:n], f"greedy tokens differ before step {n}, the first near tie"


# jax's column is the study's too (CI's part of it asserts the F32 control on jax): slow here
@pytest.mark.parametrize("backend", ["numpy", "torch", pytest.param("jax", marks=pytest.mark.slow)])
def test_f32_control_matches_transformers(f32_reference, backend):
    _installed(backend)
    path, ref = f32_reference
    model = qllama.load(path, backend=backend)
    logits = to_numpy(model.forward(ref.tokens, all_logits=True))
    worst = np.abs(logits - ref.logits).max(axis=-1)
    assert len(ref.tokens) == 37 + NEW_TOKENS
    bound = tolerance(model, ref.logits)
    assert worst.max() <= bound, (
        f"max |Δlogit| {worst.max():.2e} at position {int(worst.argmax())} (bound {bound:.2e})"
    )
    own = greedy(model, ref.tokens[: ref.n_prompt], NEW_TOKENS)
    assert_same_greedy(own, ref.continuation, ref.step_logits, bound)


# Q4_K_M's pair is the study's finding on every prompt CI runs: slow here (2 minutes)
@pytest.mark.parametrize("file_type", ["Q8_0", pytest.param("Q4_K_M", marks=pytest.mark.slow)])
def test_gpu_arithmetic_equals_dequantize_all(f32_reference, file_type):
    _installed("torch")
    ref = f32_reference[1]
    path = variant("smollm2-135m-instruct", file_type)
    gpu = qllama.load(path, backend="torch")
    dequantized = qllama.load(path, backend="numpy", dequantize_all=True)
    a = to_numpy(gpu.forward(ref.tokens, all_logits=True))
    b = to_numpy(dequantized.forward(ref.tokens, all_logits=True))
    bound = tolerance(gpu, b)  # the same float32 weights and activations, other orders
    assert np.abs(a - b).max() <= bound
    prompt = ref.tokens[: ref.n_prompt]
    own = greedy(dequantized, prompt, 48)
    steps = to_numpy(dequantized.forward(prompt + own[:-1], all_logits=True))[len(prompt) - 1 :]
    assert_same_greedy(greedy(gpu, prompt, 48), own, steps, bound)


def test_cpu_arithmetic_is_really_different_on_q8_0(f32_reference):
    ref = f32_reference[1]
    path = variant("smollm2-135m-instruct", "Q8_0")
    cpu = to_numpy(qllama.load(path, backend="numpy").forward(ref.tokens, all_logits=True))
    dequantized = qllama.load(path, backend="numpy", dequantize_all=True)
    f32_acts = to_numpy(dequantized.forward(ref.tokens, all_logits=True))
    # more than rounding: the Q8 activations are there
    assert np.abs(cpu - f32_acts).max() > tolerance(dequantized, f32_acts)
