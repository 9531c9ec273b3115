"""The observer: every named point, on every backend, seen as the forward pass computes it; the
recorder and its traces; transformers' values at the same points."""

from __future__ import annotations

import importlib.util

import numpy as np
import pytest
from bounds import forward_bound

import qllama
from qllama.array_api import to_numpy
from qllama.errors import QllamaError
from qllama.runtime.model import rms_norm
from qllama.runtime.observe import Recorder, Trace, record, resolve_positions

# (backend, options): every arithmetic the forward pass runs under
SETUPS = {
    "numpy-cpu": ("numpy", {}),
    "numpy-cpu-oracle": ("numpy", {"kernels": "numpy"}),
    "numpy-f32": ("numpy", {"activations": "f32"}),
    "numpy-dequantize-all": ("numpy", {"dequantize_all": True}),
    "torch": ("torch", {}),
    "jax": ("jax", {}),
    "array_api_strict": ("array_api_strict", {}),
}
IDS = [1, 40, 77, 200, 5, 260, 99, 3]


def load(path, setup: str, **kw):
    backend, options = SETUPS[setup]
    if importlib.util.find_spec(backend) is None:
        pytest.skip(f"{backend} is not installed")
    return qllama.load(path, backend=backend, **options, **kw)


def expected_names(n_layer: int) -> list[str]:
    names = ["embedding"]
    for i in range(n_layer):
        names += [f"blk.{i}.{p}" for p in ("q", "k", "v", "attn_out", "ffn_out", "out")]
    return names


class Log:
    """An observer keeping everything it is shown, in order, as numpy copies."""

    def __init__(self) -> None:
        self.seen: list[tuple[str, np.ndarray]] = []

    def __call__(self, name, value) -> None:
        self.seen.append((name, np.array(to_numpy(value))))


@pytest.mark.parametrize("setup", SETUPS)
def test_every_point_is_observed_in_order_and_changes_nothing(tiny_variants, setup):
    m = load(tiny_variants["Q8_0"], setup)
    plain = to_numpy(m.forward(IDS, all_logits=True))
    log = Log()
    observed = to_numpy(m.forward(IDS, all_logits=True, observer=log))
    np.testing.assert_array_equal(observed, plain)  # observing changes no bit
    c = m.config
    assert [n for n, _ in log.seen] == expected_names(c.n_layer)
    shapes = dict(log.seen)
    assert shapes["embedding"].shape == (len(IDS), c.n_embd)
    assert shapes["blk.0.q"].shape == (len(IDS), c.n_head * c.head_dim)
    kv = (len(IDS), c.n_head_kv * c.head_dim)
    assert shapes["blk.0.k"].shape == shapes["blk.0.v"].shape == kv
    for p in ("attn_out", "ffn_out", "out"):
        assert shapes[f"blk.1.{p}"].shape == (len(IDS), c.n_embd)


def test_points_are_the_residual_stream(tiny_variants):
    """Each block's output is its input plus the attention and MLP outputs, in the forward
    pass's order; and the last output, normed and projected, is the logits (bit for bit)."""
    m = load(tiny_variants["Q8_0"], "numpy-cpu")
    log = Log()
    logits = m.forward(IDS, all_logits=True, observer=log)
    v = dict(log.seen)
    prev = v["embedding"]
    for i in range(m.config.n_layer):
        b = f"blk.{i}."
        np.testing.assert_array_equal((prev + v[b + "attn_out"]) + v[b + "ffn_out"], v[b + "out"])
        prev = v[b + "out"]
    w = m.weights
    again = m.backend.matmul(rms_norm(prev, w.output_norm, m.config.eps, xp=np), w.output)
    np.testing.assert_array_equal(again, logits)


def test_decoding_steps_are_observed_too(tiny_variants):
    m = load(tiny_variants["Q8_0"], "numpy-dequantize-all")
    m.forward(IDS[:5])
    log = Log()
    m.forward(IDS[5:6], pos=5, observer=log)
    assert all(value.shape[0] == 1 for _, value in log.seen)


def test_recorder_keeps_the_chosen_points_and_positions(tiny_variants):
    m = load(tiny_variants["Q8_0"], "numpy-cpu")
    full = record(m, IDS, qkv=True)
    assert full.positions == list(range(len(IDS)))
    assert full["blk.0.q"].shape == (len(IDS), m.config.n_head * m.config.head_dim)
    some = record(m, IDS, positions=[-1, 2])
    assert some.positions == [len(IDS) - 1, 2]
    assert "blk.0.q" not in some.values and "blk.1.out" in some.values
    for name in some:
        np.testing.assert_array_equal(some[name], full[name][[len(IDS) - 1, 2]])
    np.testing.assert_array_equal(full["logits"], to_numpy(m.forward(IDS, all_logits=True)))


def test_recorder_filters_names():
    rec = Recorder([0])
    assert rec.wants("embedding") and rec.wants("blk.3.out") and not rec.wants("blk.3.q")
    assert Recorder([0], qkv=True).wants("blk.3.q")


def test_trace_round_trip(tiny_variants, tmp_path):
    t = record(load(tiny_variants["F32"], "numpy-dequantize-all"), IDS, positions=[0, 3])
    t.meta = {"source": "test"}
    t.save(tmp_path / "t.npz")
    back = Trace.load(tmp_path / "t.npz")
    assert (back.tokens, back.positions, back.meta) == (t.tokens, t.positions, t.meta)
    assert list(back) == list(t)
    for name in t:
        np.testing.assert_array_equal(back[name], t[name])


def test_trace_load_refuses_other_files(tmp_path):
    (tmp_path / "x.npz").write_bytes(b"not a zip")
    with pytest.raises(QllamaError, match="cannot read trace"):
        Trace.load(tmp_path / "x.npz")


@pytest.mark.parametrize(
    ("positions", "message"),
    [([8], "position 8 is outside the 8 tokens"), ([-9], "outside"), ([1, -7], "repeat")],
)
def test_bad_positions(positions, message):
    with pytest.raises(QllamaError, match=message):
        resolve_positions(positions, 8)


# --- transformers at the same points --------------------------------------------------------


def test_transformers_values_align_with_qllamas_by_name(tiny_variants):
    """The F32 file in qllama and in transformers: every point, Q/K/V included (Q and K
    permuted back into the file's row order), agrees to float32 rounding; a point taken from
    the wrong place, or Q/K left in transformers' order, would be off by O(1)."""
    if importlib.util.find_spec("transformers") is None:
        pytest.skip("transformers is not installed")
    from qllama.measure.reference import transformers_trace

    path = tiny_variants["F32"]
    ref = transformers_trace(path, IDS, qkv=True)
    m = load(path, "numpy-dequantize-all")
    ours = record(m, IDS, qkv=True)
    assert set(ours) == set(ref)
    c = m.config
    # relative bound of a float32 forward pass (tests/bounds.py), the widest reduction n_ff
    bound = forward_bound(c.n_layer, c.n_ff, 1.0)
    for name in ours:
        err = np.linalg.norm(ours[name] - ref[name]) / np.linalg.norm(ref[name])
        assert err < bound, f"{name}: relative error {err:.2e} > {bound:.2e}"
    # in transformers' own order, Q is not the same vector
    hf_q = ref["blk.0.q"].reshape(len(IDS), c.n_head, c.head_dim // 2, 2).swapaxes(2, 3)
    hf_q = hf_q.reshape(len(IDS), -1)
    assert np.linalg.norm(hf_q - ours["blk.0.q"]) > 0.1 * np.linalg.norm(ours["blk.0.q"])
