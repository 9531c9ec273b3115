"""Teacher forcing, free generation and forks, on a tiny model against itself in f32."""

from __future__ import annotations

import numpy as np
import pytest
from bounds import forward_bound, q8_flip_bound

import qllama
from qllama.errors import QllamaError
from qllama.measure import compare
from qllama.synthetic import TinyConfig, write_tiny_llama


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    path = tmp_path_factory.mktemp("cmp") / "tiny.gguf"
    write_tiny_llama(path, TinyConfig(weight_type="Q8_0", scale=0.5))
    ref_model = qllama.load(path, backend="numpy", dequantize_all=True)
    ref = compare.reference_from_model(ref_model, [1, 30, 40], max_new_tokens=24)
    return ref, ref_model, qllama.load(path, backend="numpy")  # the CPU arithmetic


def bound(model, logits, *, q8: bool = False) -> float:
    """What summing in another order may change (tests/bounds.py)."""
    c, scale = model.config, float(np.abs(logits).max())
    if q8:
        return q8_flip_bound(c.n_layer, scale)
    return forward_bound(c.n_layer, max(c.n_embd, c.n_ff, c.n_ctx), scale)


def test_a_model_against_its_own_reference_agrees(models):
    ref, ref_model, _ = models
    tf = compare.teacher_forcing(ref_model, ref, mode="batched")
    tol = bound(ref_model, ref.logits)  # one pass over one token fewer: another BLAS blocking
    assert tf.max_abs.max() <= tol
    assert all(tf.ref_margin[s] <= tol for s in tf.flipped)  # flips only at ties
    free = compare.free_generation(ref_model, ref)
    assert free.fork is None or tf.ref_margin[free.fork] <= tol


def test_steps_and_batched_agree(models):
    ref, _, cpu = models
    steps = compare.teacher_forcing(cpu, ref, mode="steps")
    batched = compare.teacher_forcing(cpu, ref, mode="batched")
    assert steps.max_abs.shape == (len(ref.continuation),)
    # the CPU arithmetic: another chunking may flip Q8 roundings (bounds.q8_flip_bound)
    tol = bound(cpu, batched.logits, q8=True)
    np.testing.assert_allclose(steps.logits, batched.logits, rtol=0, atol=tol)


def test_free_generation_forks_at_the_first_flip(models):
    ref, _, cpu = models
    tf = compare.teacher_forcing(cpu, ref, mode="steps")
    free = compare.free_generation(cpu, ref)
    assert free.fork == tf.first_flip
    if free.fork is not None:
        assert set(free.context) == {"prefix", "reference", "own"}


def test_summary_lists_flips_with_margins(models):
    ref, _, cpu = models
    s = compare.teacher_forcing(cpu, ref).summary()
    assert s["argmax_agree"] + len(s["flips"]) == s["steps"] == len(ref.continuation)
    for f in s["flips"]:
        assert f["ref_margin"] >= 0 and f["token"] != f["ref_token"]


def test_fork():
    assert compare.fork([1, 2, 3], [1, 2, 4]) == 2
    assert compare.fork([1, 2], [1, 2, 3]) is None  # a prefix is not a fork
    assert compare.fork([], []) is None


def test_reference_roundtrip(models, tmp_path):
    ref = models[0]
    ref.meta = {"note": "x"}
    ref.save(str(tmp_path / "r.npz"))
    back = compare.Reference.load(str(tmp_path / "r.npz"))
    assert (
        back.tokens == ref.tokens and back.n_prompt == ref.n_prompt and back.meta == {"note": "x"}
    )
    np.testing.assert_array_equal(back.logits, ref.logits)
    with pytest.raises(QllamaError, match="cannot read reference"):
        compare.Reference.load(str(tmp_path / "missing.npz"))
    with pytest.raises(QllamaError, match="mode must be 'steps' or 'batched'"):
        compare.teacher_forcing(models[1], ref, mode="fast")
