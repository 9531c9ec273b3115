"""Mixtures of experts (qllama.runtime.model's ``_moe``, ``backends.base.expert_matmul``).

- the routing pieces against hand computations: top-k and its tie order, the router softmax,
  the normalised and scaled weights, SOFTMAX_WEIGHT, the shared expert's silu(g)/g gate;
- the grouped products (``expert_matmul``) against each (token, slot) alone, on every backend:
  bit for bit in the CPU arithmetic, within the reordering bound in the float ones;
- a plain numpy oracle of build_moe_ffn, one token and one expert at a time, against the
  batched block, bit for bit in the CPU arithmetic, for every family with experts;
- every backend computes the same model (where no router decision is within rounding of a
  tie, checked first);
- what qllama does not compute of a mixture is refused, naming the key and its value.
"""

from __future__ import annotations

import dataclasses
import importlib.util
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from bounds import forward_bound, reorder_bound
from hypothesis import given, settings
from hypothesis import strategies as st
from test_architectures import BASE, FAMILIES, IDS

import qllama
from qllama.array_api import namespace, to_numpy
from qllama.backends import get_backend
from qllama.backends.base import QuantTensor, expert_matmul
from qllama.errors import BackendError, ModelConfigError, TensorShapeError, WeightValueError
from qllama.ggml_types import GGMLType, ValueType
from qllama.gguf.reader import GGUFValue
from qllama.quants.rounding import libm
from qllama.runtime.architectures import ExpertActivation, Gating, SharedExpert, architecture
from qllama.runtime.model import (
    MIN_WEIGHT_SUM,
    expert_weights,
    gather_rows,
    router_softmax,
    softmax_with_sink,
    swiglu_oai,
    top_k,
)
from qllama.runtime.routing import stdsort_desc
from qllama.synthetic import TinyConfig, write_tiny

MOE = [name for name, c in FAMILIES.items() if c.n_expert]
NAMESPACES = ["numpy", "torch", "jax", "array_api_strict"]
u32 = lambda v: GGUFValue(ValueType.UINT32, v)  # noqa: E731


def xp_of(name: str) -> Any:
    if importlib.util.find_spec(name) is None:
        pytest.skip(f"{name} is not installed")
    return namespace(name)


def test_the_families_with_experts_have_tiny_files() -> None:
    assert {FAMILIES[n].arch for n in MOE} == {
        "qwen3moe",
        "qwen2moe",
        "llama",
        "olmoe",
        "granitemoe",
        "gpt-oss",
    }


# --- routing against hand computations --------------------------------------------------------


@pytest.mark.parametrize("ns", NAMESPACES)
def test_top_k_is_best_first_and_ties_by_index(ns: str) -> None:
    """ggml's argsort_top_k: a descending sort; equal values keep ascending index order (the
    insertion sort libstdc++ runs on rows of up to 16)."""
    xp = xp_of(ns)
    x = xp.asarray(
        [[0.1, 0.3, 0.3, 0.2], [0.5, 0.5, 0.5, 0.5], [0.0, -1.0, 2.0, 2.0]], dtype=xp.float32
    )
    got = to_numpy(top_k(x, 3, xp=xp)).tolist()
    assert got == [[1, 2, 3], [0, 1, 2], [2, 3, 0]]


@pytest.mark.parametrize("ns", NAMESPACES)
def test_router_softmax_and_gather(ns: str) -> None:
    xp = xp_of(ns)
    logits = np.array([[1.0, 2.0, 0.5, -1.0]], np.float32)
    e = np.exp(logits - 2.0)
    want = e * np.float32(1.0 / e.sum())
    got = to_numpy(router_softmax(xp.asarray(logits), xp=xp))
    np.testing.assert_allclose(got, want, rtol=4 * 2.0**-24, atol=0)
    idx = xp.asarray(np.array([[1, 0]], np.int64 if ns != "jax" else np.int32))
    np.testing.assert_array_equal(
        to_numpy(gather_rows(xp.asarray(logits), idx, xp=xp)), [[2.0, 1.0]]
    )


@pytest.mark.parametrize("ns", NAMESPACES)
def test_expert_weights_norm_clamp_and_scale(ns: str) -> None:
    xp = xp_of(ns)
    probs = xp.asarray([[0.5, 0.25, 0.125, 0.125], [1e-6, 3e-6, 0.0, 0.0]], dtype=xp.float32)
    sel = top_k(probs, 2, xp=xp)

    def weights(norm: bool, scale: float, gating: Gating = Gating.SOFTMAX) -> np.ndarray:
        return to_numpy(expert_weights(probs, sel, gating, norm, scale, xp=xp))

    raw = weights(False, 0.0)
    np.testing.assert_array_equal(raw, np.array([[0.5, 0.25], [3e-6, 1e-6]], np.float32))
    assert weights(False, 1.0).tolist() == raw.tolist()  # 1 scales nothing
    normed = weights(True, 0.0)
    # f32 division by the sum; the second row's sum 4e-6 is clamped to 2^-14
    np.testing.assert_array_equal(normed[0], np.float32([0.5, 0.25]) / np.float32(0.75))
    np.testing.assert_array_equal(normed[1], np.float32([3e-6, 1e-6]) / np.float32(MIN_WEIGHT_SUM))
    np.testing.assert_array_equal(weights(True, 2.5), normed * np.float32(2.5))
    # gpt-oss's order: select on the raw values, then a softmax over the selected two
    soft = weights(False, 0.0, Gating.SOFTMAX_WEIGHT)
    e = np.exp(np.float32([0.0, -0.25]))
    np.testing.assert_allclose(soft[0], e / e.sum(), rtol=4 * 2.0**-24)


def test_the_shared_expert_gate_is_silu_over_g(tmp_path: Path) -> None:
    """qwen2moe: shared(x) * silu(g)/g, g = x . ffn_gate_inp_shexp, by hand."""
    path = tmp_path / "q.gguf"
    write_tiny(path, FAMILIES["qwen2moe"])
    m = qllama.load(path, backend="numpy", activations="f32")
    layer = m.weights.layers[0]
    x = np.random.default_rng(1).standard_normal((5, 64)).astype(np.float32)
    dense = lambda w: w.tensor.data.view("<f4").reshape(w.tensor.shape)  # noqa: E731
    silu = lambda v: v * (1 / (1 + np.exp(-v)))  # noqa: E731
    g = x @ layer.ffn_gate_inp_shexp[:, None]  # (5, 1)
    gate, up = x @ dense(layer.ffn_gate_shexp).T, x @ dense(layer.ffn_up_shexp).T
    sh = (silu(gate) * up) @ dense(layer.ffn_down_shexp).T
    want = sh * (silu(g) / g)
    got = m._shared_expert(x, layer, architecture("qwen2moe").experts)
    np.testing.assert_array_equal(got, want)  # the same products, the same formula
    # at g = 0 llama.cpp's spelling of sigmoid is 0/0: NaN, as there (a zero row has g = 0)
    with np.errstate(invalid="ignore"):
        zero = m._shared_expert(
            np.zeros((1, 64), np.float32), layer, architecture("qwen2moe").experts
        )
    assert np.isnan(zero).all()


# --- grouped products against each (token, slot) alone ---------------------------------------


def _experts(
    backend: Any, rng: np.random.Generator, kind: str, n: int, rows: int, k: int
) -> tuple[tuple[Any, ...], list[np.ndarray]]:
    """n random experts of ``kind`` (rows, k), prepared by ``backend``, and their values."""
    from qllama import quants

    prepared, values = [], []
    for _ in range(n):
        raw = quants.quantize((0.3 * rng.standard_normal((rows, k))).astype(np.float32), kind)
        t = QuantTensor("blk.0.ffn_up_exps.weight", GGMLType[kind], (rows, k), raw.reshape(-1))
        prepared.append(backend.prepare(t))
        values.append(quants.dequantize(raw, kind, (rows, k)))
    return tuple(prepared), values


SETUPS = {
    "cpu-q8_0": ("numpy", {}, "Q8_0"),
    "cpu-q4_0": ("numpy", {"kernels": "numpy"}, "Q4_0"),
    "cpu-f32": ("numpy", {}, "F32"),
    "numpy-f32": ("numpy", {"activations": "f32"}, "Q4_0"),
    "torch": ("torch", {}, "Q4_0"),
    "jax": ("jax", {}, "Q4_0"),
    "array_api_strict": ("array_api_strict", {}, "Q8_0"),
}


@pytest.mark.parametrize("setup", SETUPS)
@pytest.mark.parametrize("shared_input", [True, False], ids=["up", "down"])
def test_grouped_products_equal_each_pair_alone(setup: str, shared_input: bool) -> None:
    name, options, kind = SETUPS[setup]
    if importlib.util.find_spec(name) is None:
        pytest.skip(f"{name} is not installed")
    be = get_backend(name, **options)
    rng = np.random.default_rng(7)
    T, k, n, K, R = 9, 2, 5, 64, 48
    experts, values = _experts(be, rng, kind, n, R, K)
    selected = np.stack([rng.choice(n - 1, k, replace=False) for _ in range(T)])  # expert 4 idle
    x = rng.standard_normal((T, K) if shared_input else (T, k, K)).astype(np.float32)
    got = to_numpy(expert_matmul(be, be.asarray(x), experts, be.asarray(selected.astype(np.int32))))
    assert got.shape == (T, k, R)
    # the CPU arithmetic on a quantized type: each row quantized by itself, integer sums; a
    # float weight's product goes to BLAS, which may sum another number of rows otherwise
    # (as Model.forward_batch says of every float product)
    exact = name == "numpy" and not options.get("activations") and kind != "F32"
    for t in range(T):
        for s in range(k):
            row = x[t : t + 1] if shared_input else x[t, s][None, :]
            alone = to_numpy(be.matmul(be.asarray(row), experts[selected[t, s]]))[0]
            if exact:
                np.testing.assert_array_equal(got[t, s], alone)
            else:
                bound = reorder_bound(row, values[selected[t, s]])[0]  # (R,)
                assert (np.abs(got[t, s] - alone) <= bound).all(), (t, s)


def _slab_experts(
    backend: Any, rng: np.random.Generator, kind: str, n: int, rows: int, k: int
) -> tuple[Any, ...]:
    """n random experts of ``kind`` (rows, k), prepared by ``backend``, each a view of one
    buffer, as the slabs of a file's 3-D expert tensor are views of its map."""
    from qllama import quants

    raws = [
        quants.quantize((0.3 * rng.standard_normal((rows, k))).astype(np.float32), kind)
        for _ in range(n)
    ]
    buf = np.concatenate([r.reshape(-1) for r in raws])  # (n * slab,) the 3-D tensor's bytes
    slab = buf.size // n
    return tuple(
        backend.prepare(
            QuantTensor(
                "blk.0.ffn_up_exps.weight",
                GGMLType[kind],
                (rows, k),
                buf[e * slab : (e + 1) * slab],
            )
        )
        for e in range(n)
    )


@pytest.mark.parametrize("kind", ["Q8_0", "Q4_K", "MXFP4", "IQ4_XS", "Q5_0", "Q6_K"])
@pytest.mark.parametrize("T", [1, 9, 16, 40], ids=["decode", "batch", "mixed", "groups"])
@pytest.mark.parametrize("shared_input", [True, False], ids=["up", "down"])
def test_the_compiled_mul_mat_id_equals_the_grouped_matmuls(
    kind: str, T: int, shared_input: bool
) -> None:
    """The numpy backend's ``mul_mat_id`` (its one compiled call: each row quantized once, the
    selected experts' rows only; an expert many rows chose in the token tiles of ``matmul``)
    gives the bits of one ``matmul`` per expert and of each (token, slot) alone. "mixed"
    routes 16, 14, 8, 8 and 2 pairs to five experts: both ways in one call for every format
    (the tiles take 4 pairs or more for the 32-block formats, 8 for the K-quants)."""
    pytest.importorskip("numba")
    from qllama.backends.base import grouped_expert_matmul

    be = get_backend("numpy", kernels="numba", threads=2)
    rng = np.random.default_rng(11)
    k, n, K, R = 3, 6, 256, 44  # 44 rows: groups of four and a remainder
    experts = _slab_experts(be, rng, kind, n, R, K)
    _, slabs = be._slabs([experts])
    assert slabs is not None  # the compiled call, not the fallback
    selected = np.stack([rng.choice(n - 1, k, replace=False) for _ in range(T)]).astype(np.int32)
    if T == 16:
        t = np.arange(T)
        selected = np.stack([0 * t, 1 + t % 2, 3 + (t % 8 == 0)], axis=1).astype(np.int32)
        counts = np.bincount(selected.reshape(-1), minlength=n)
        assert (counts >= slabs.tile_rows).any() and (
            (counts > 0) & (counts < slabs.tile_rows)
        ).any()
    x = rng.standard_normal((T, K) if shared_input else (T, k, K)).astype(np.float32)
    got = expert_matmul(be, x, experts, selected)
    assert got.shape == (T, k, R)
    np.testing.assert_array_equal(got, grouped_expert_matmul(be, x, experts, selected))
    for t in range(T):
        for s in range(k):
            row = x[t : t + 1] if shared_input else x[t, s][None, :]
            np.testing.assert_array_equal(got[t, s], be.matmul(row, experts[selected[t, s]])[0])


@pytest.mark.parametrize("kind", ["Q8_0", "Q4_K", "IQ4_XS"])
@pytest.mark.parametrize("T", [1, 3, 16], ids=["decode", "few", "batch"])
def test_up_and_gate_in_one_call_equal_each_alone(kind: str, T: int) -> None:
    """``expert_matmuls``: two expert tensors of one input (up and gate, slabs of one buffer)
    in one compiled call, each token's row quantized once; in a batch the experts many pairs
    chose go to the token tiles, both tensors of an expert in one ``matmuls`` call, and the
    others of both tensors still to one call. The bits of ``expert_matmul`` on each, every
    way."""
    pytest.importorskip("numba")
    from qllama.backends.base import expert_matmuls

    be = get_backend("numpy", kernels="numba", threads=2)
    rng = np.random.default_rng(5)
    k, n, K, R = 2, 4, 256, 20
    # up and gate as a file's map holds them: each tensor a view of the map, each expert's
    # slab a view of its tensor
    both = _slab_experts(be, rng, kind, 2 * n, R, K)
    data = np.concatenate([e.tensor.data for e in both])  # the map: up's slabs, then gate's
    size = data.size // 2

    def tensor(i: int) -> tuple[Any, ...]:
        view = np.frombuffer(memoryview(data), np.uint8, size, i * size)  # as tensor_data
        slab = size // n
        return tuple(
            be.prepare(dataclasses.replace(both[e].tensor, data=view[e * slab : (e + 1) * slab]))
            for e in range(n)
        )

    up, gate = tensor(0), tensor(1)
    assert be._slabs([up, gate])[1] is not None  # one buffer: the map
    selected = np.stack([rng.choice(n, k, replace=False) for _ in range(T)]).astype(np.int32)
    if T == 16:  # expert 0 16 pairs and 2 14 (token tiles), expert 1 two (the compiled call)
        selected = np.stack([np.zeros(T), np.where(np.arange(T) < 2, 1, 2)], 1).astype(np.int32)
    x = rng.standard_normal((T, K)).astype(np.float32)
    calls, tiled = [], []
    real, real_tiles = be._mul_mat_id, be.matmuls
    be._mul_mat_id = lambda *a: calls.append(1) or real(*a)  # type: ignore[method-assign]
    be.matmuls = lambda x, ws: tiled.append(len(ws)) or real_tiles(x, ws)  # type: ignore[method-assign]
    got = expert_matmuls(be, x, [up, gate], selected)
    assert calls == [1]  # at most 3 pairs an expert, or expert 1's two: both tensors at once
    assert tiled == ([2, 2] if T == 16 else [])  # experts 0 and 2: up and gate together
    for y, experts in zip(got, (up, gate), strict=True):
        np.testing.assert_array_equal(y, expert_matmul(be, x, experts, selected))
    with pytest.raises(TensorShapeError, match="needs activations"):
        expert_matmuls(be, x[:, :128], [up, gate], selected)


@settings(max_examples=60, deadline=None)
@given(
    n=st.integers(1, 20),
    T=st.integers(1, 12),
    data=st.data(),
)
def test_a_grouping_is_what_each_product_of_a_layer_reads(n: int, T: int, data: Any) -> None:
    """The numpy backend's grouping of a selection: each expert's pairs, in order, with each
    pair's token, the counts, the most pairs an expert has and the experts chosen; the same
    selection again is the same grouping (up, gate and down share it)."""
    from qllama.backends.numpy.dispatch import Grouping

    k = data.draw(st.integers(1, n))
    rows = [data.draw(st.permutations(range(n)))[:k] for _ in range(T)]
    selected = np.array(rows, np.int32)  # (T, k)
    g = Grouping.of(selected, n)
    flat = selected.reshape(-1)
    for e in range(n):
        pairs = g.order[g.bounds[e] : g.bounds[e + 1]]
        assert (flat[pairs] == e).all() and (np.diff(pairs) > 0).all()  # in their order
    np.testing.assert_array_equal(g.by_token, g.order // k)
    np.testing.assert_array_equal(g.counts, np.bincount(flat, minlength=n))
    assert g.most == g.counts.max() and g.chosen == sorted(set(flat.tolist()))
    be = get_backend("numpy")
    first = be._grouped(selected, n)
    assert be._grouped(selected.copy(), n) is first
    other = selected[::-1].copy()
    assert (be._grouped(other, n) is first) == np.array_equal(other, selected)


def test_an_expert_id_out_of_range_is_refused() -> None:
    be = get_backend("numpy")
    experts = _slab_experts(be, np.random.default_rng(0), "Q8_0", 3, 8, 32)
    x = np.ones((2, 32), np.float32)
    with pytest.raises(BackendError, match=r"expert ids must lie in \[0, 3\)"):
        expert_matmul(be, x, experts, np.array([[0, 3], [1, 2]], np.int32))


def test_the_weights_are_checked_by_reads_not_through_the_map(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """load's check of the block scales reads every weight, 2-D or a 3-D expert tensor, from
    the file, a chunk of rows at a time (so that experts no token selects stay untouched in
    the map, and a dense weight until the model reads it): it finds a NaN scale in one
    expert's slab, naming the block as the whole tensor counts it. Only norms (1-D) go
    through the map."""
    from qllama.gguf.reader import read_gguf
    from qllama.runtime import loader

    path = tmp_path / "moe.gguf"
    write_tiny(path, dataclasses.replace(FAMILIES["qwen3moe"], weight_type="Q8_0"))
    name = "blk.0.ffn_down_exps.weight"
    with read_gguf(path) as f:
        t = f.tensor(name)
        n, rows, row_length = t.shape
        whole = np.empty(t.nbytes, np.uint8)
        f.read_tensor(name, 0, whole)
        np.testing.assert_array_equal(whole, f.tensor_data(name))  # the same bytes as the map
        blocks_per_row = row_length // 32
        block = (2 * rows + 1) * blocks_per_row + blocks_per_row - 1  # expert 2, row 1, last
        at = f.data_offset + t.offset + block * 34  # its f16 scale: a Q8_0 block's first bytes
    with open(path, "r+b") as fh:
        fh.seek(at)
        fh.write(b"\x00\x7e")  # f16 NaN
    monkeypatch.setattr(loader, "CHECK_CHUNK", 3 * (t.nbytes // (n * rows)))  # 3 rows a read
    with read_gguf(path) as f:
        viewed: list[str] = []
        mapped = f.tensor_data
        monkeypatch.setattr(f, "tensor_data", lambda n: viewed.append(n) or mapped(n))
        with pytest.raises(WeightValueError, match=f"'{name}' block {block} has a non-finite"):
            loader.check_finite(f, f.tensors)
        assert viewed and all(len(f.tensor(v).shape) == 1 for v in viewed)  # norms alone
    with pytest.raises(WeightValueError, match=f"'{name}' block {block} has a non-finite"):
        qllama.load(path, backend="numpy")
    qllama.load(path, backend="numpy", check_weights=False)


# --- the oracle: build_moe_ffn one token and one expert at a time -----------------------------


def oracle_moe(m: Any, x: np.ndarray, i: int) -> np.ndarray:
    """moe_kv_recipes.md 1.2 in plain numpy: each token alone, each expert's product of its one
    row alone (the backend's matmul of one row), the slots added in order."""
    c, e, layer, be = m.config, m.features.experts, m.weights.layers[i], m.backend
    logits = to_numpy(be.matmul(x, layer.ffn_gate_inp))  # the router, as the block computes it
    if layer.ffn_gate_inp_bias is not None:
        logits = logits + layer.ffn_gate_inp_bias

    expf = np.vectorize(libm("expf"), otypes=[np.float32])

    def softmax(v: np.ndarray) -> np.ndarray:
        # ggml's scalar loop (the rounding "ref"): libm's expf, summed in double in order,
        # times the float32 reciprocal of the sum
        ex = expf(v - v.max())
        total = 0.0
        for val in ex.tolist():
            total += val
        return ex * np.float32(1.0 / total)

    def bias(b: np.ndarray | None, j: int) -> Any:
        return 0 if b is None else b[j]

    out = np.empty_like(x)
    for t in range(x.shape[0]):
        softmax_first = e.gating == Gating.SOFTMAX
        probs = softmax(logits[t]) if softmax_first else logits[t]
        if c.n_expert > 16:  # libstdc++'s introsort (tests/test_routing.py checks the port)
            order = stdsort_desc(probs)[: c.n_expert_used]
        else:  # its insertion sort: equal values in index order
            order = sorted(range(c.n_expert), key=lambda j: (-probs[j], j))[: c.n_expert_used]
        w = probs[order] if softmax_first else softmax(probs[order])
        if c.expert_weights_norm:  # ggml's sum_rows: in order, in double, then float
            total = 0.0
            for val in w.tolist():
                total += val
            w = w / max(np.float32(total), np.float32(MIN_WEIGHT_SUM))
        acc = None
        for s, j in enumerate(order):
            row = x[t : t + 1]
            up = be.matmul(row, layer.ffn_up_exps[j]) + bias(layer.ffn_up_exps_bias, j)
            if layer.ffn_gate_exps is None:
                h = m.activation(up, xp=m.xp)
            else:
                gate = be.matmul(row, layer.ffn_gate_exps[j]) + bias(layer.ffn_gate_exps_bias, j)
                if e.activation == ExpertActivation.SWIGLU_OAI:  # by hand, as llama.cpp's loop
                    g, u = np.minimum(gate, np.float32(7)), np.clip(up, -7, 7)
                    h = g / (1 + np.exp(np.float32(1.702) * -g)) * (u + 1)
                else:
                    h = m.activation(gate, xp=m.xp) * up
            y = be.matmul(h, layer.ffn_down_exps[j]) + bias(layer.ffn_down_exps_bias, j)
            y = y[0] * w[s]
            acc = y if acc is None else acc + y
        out[t] = acc
    if layer.ffn_up_shexp is not None:
        out = out + m._shared_expert(x, layer, e)
    return out


@pytest.mark.parametrize("weight_type", ["Q8_0", "Q4_0", "MXFP4"])
@pytest.mark.parametrize("name", MOE)
def test_the_batched_block_equals_the_oracle_bit_for_bit(
    name: str, weight_type: str, tmp_path: Path
) -> None:
    path = tmp_path / f"{name}.gguf"
    write_tiny(path, dataclasses.replace(FAMILIES[name], weight_type=weight_type))
    m = qllama.load(path, backend="numpy")  # the CPU arithmetic
    x = np.random.default_rng(3).standard_normal((11, m.config.n_embd)).astype(np.float32)
    for i in range(m.config.n_layer):
        got = m._moe(x, m.weights.layers[i], i)
        np.testing.assert_array_equal(got, oracle_moe(m, x, i))


def test_the_top_k_weights_are_summed_as_ggml(tmp_path: Path) -> None:
    """qwen3moe's k = 8 weights normalised by ggml's sum_rows (in order, in double): the block
    equals the oracle bit for bit, on tokens where a float32 sum would weigh them otherwise."""
    path = tmp_path / "k8.gguf"
    cfg = dataclasses.replace(FAMILIES["qwen3moe"], n_expert=16, n_expert_used=8)
    write_tiny(path, dataclasses.replace(cfg, weight_type="Q8_0"))
    m = qllama.load(path, backend="numpy")  # the CPU arithmetic
    x = np.random.default_rng(6).standard_normal((32, m.config.n_embd)).astype(np.float32)
    single_differs = False
    for i, layer in enumerate(m.weights.layers):
        probs = m.gate_softmax(to_numpy(m.backend.matmul(x, layer.ffn_gate_inp)))
        selected = top_k(probs, 8, xp=np)
        ggml = expert_weights(
            probs, selected, Gating.SOFTMAX, True, 0.0, xp=np, sum_rows=m.gate_sum
        )
        single = expert_weights(probs, selected, Gating.SOFTMAX, True, 0.0, xp=np)
        single_differs |= not np.array_equal(ggml, single)
        np.testing.assert_array_equal(m._moe(x, layer, i), oracle_moe(m, x, i))
    assert single_differs, "no token whose float32 weight sum differs: the test cannot fail"


# --- every backend, the same model ------------------------------------------------------------

BACKENDS = {
    "numpy-f32": ("numpy", {"activations": "f32"}),
    "torch": ("torch", {}),
    "jax": ("jax", {}),
    "array_api_strict": ("array_api_strict", {}),
}


def routing_margin(m: Any, ids: list[int]) -> tuple[float, float]:
    """The smallest gap, over tokens and layers, between the k-th and the (k+1)-th router logit
    (a softmax keeps their order: a choice flips only across such a gap), and the largest
    router logit."""
    logits: list[np.ndarray] = []
    m.forward(
        ids,
        all_logits=True,
        observer=lambda n, v: logits.append(to_numpy(v)) if n.endswith(".router") else None,
    )
    k = m.config.n_expert_used
    gaps = [np.sort(lg, axis=-1)[:, ::-1] for lg in logits]
    return min(float((g[:, k - 1] - g[:, k]).min()) for g in gaps), max(
        float(np.abs(g).max()) for g in gaps
    )


@pytest.mark.parametrize("name", MOE)
def test_every_backend_computes_the_same_mixture(name: str, tmp_path: Path) -> None:
    """Two float32 runs differ by rounding (forward_bound); a router logit by that much at its
    scale. Where every top-k gap is wider than twice that, no backend can choose other experts,
    and the logits must agree within the forward bound."""
    path = tmp_path / f"{name}.gguf"
    write_tiny(path, FAMILIES[name])
    ref_model = qllama.load(path, backend="numpy", activations="f32")
    c = ref_model.config
    width = max(c.n_embd, c.n_ff, len(IDS))
    gap, scale = routing_margin(ref_model, IDS)
    assert gap > 2 * forward_bound(c.n_layer, width, scale), "a router decision is within rounding"
    ref = to_numpy(ref_model.forward(IDS, all_logits=True))
    bound = forward_bound(c.n_layer, width, float(np.abs(ref).max()))
    for setup, (backend, options) in BACKENDS.items():
        if importlib.util.find_spec(backend) is None:
            continue
        got = to_numpy(qllama.load(path, backend=backend, **options).forward(IDS, all_logits=True))
        np.testing.assert_allclose(got, ref, rtol=0, atol=bound, err_msg=setup)


def test_the_cpu_arithmetic_runs_every_family_in_q8(tmp_path: Path) -> None:
    """Each family's file in Q8_0 under the CPU arithmetic: finite logits, the block's own
    bits token by token (the batch changes no expert product)."""
    for name in MOE:
        path = tmp_path / f"{name}.gguf"
        write_tiny(path, dataclasses.replace(FAMILIES[name], weight_type="Q8_0"))
        m = qllama.load(path, backend="numpy")
        whole = to_numpy(m.forward(IDS, all_logits=True))
        assert np.isfinite(whole).all() and np.abs(whole).max() > 0.1, name


# --- refusals ---------------------------------------------------------------------------------


def _with_keys(tmp_path: Path, name: str, **keys: Any) -> Path:
    cfg = FAMILIES[name]
    path = tmp_path / "bad.gguf"
    write_tiny(path, dataclasses.replace(cfg, extra_keys=cfg.extra_keys + tuple(keys.items())))
    return path


REFUSED = [
    ("groups", "qwen3moe", {"expert_group_count": u32(2)}, "qwen3moe.expert_group_count is 2"),
    ("dense-leading", "qwen2moe", {"leading_dense_block_count": u32(1)},
     "qwen2moe.leading_dense_block_count is 1"),
    ("sparse-step", "olmoe", {"moe_every_n_layers": u32(2)}, "olmoe.moe_every_n_layers is 2"),
    ("sigmoid", "mixtral", {"expert_gating_func": u32(2)},
     "llama.expert_gating_func is 2: llama gates with softmax"),
    ("too-many-used", "qwen3moe", {"expert_used_count": u32(5)},
     r"qwen3moe.expert_used_count is 5, outside \[1, 4\]"),
    ("too-many-experts", "granitemoe", {"expert_count": u32(2000)},
     r"granitemoe.expert_count is 2000, outside \[0, 1024\]"),
    ("per-layer-k", "olmoe", {"expert_used_count": np.array([2, 2, 2], np.int32)},
     "olmoe.expert_used_count has type ARRAY"),
]  # fmt: skip


@pytest.mark.parametrize(
    ("name", "keys", "message"), [r[1:] for r in REFUSED], ids=[r[0] for r in REFUSED]
)
def test_what_is_not_computed_is_refused(
    tmp_path: Path, name: str, keys: dict, message: str
) -> None:
    with pytest.raises(ModelConfigError, match=message):
        qllama.load(_with_keys(tmp_path, name, **keys))


def test_a_moe_family_without_experts_is_refused(tmp_path: Path) -> None:
    from test_model_checks import DROP, rewrite

    src = tmp_path / "q.gguf"
    write_tiny(src, FAMILIES["qwen3moe"])
    p = rewrite(src, tmp_path / "bad.gguf", kv={"qwen3moe.expert_count": DROP})
    with pytest.raises(ModelConfigError, match="key not found: qwen3moe.expert_count"):
        qllama.load(p)


def test_a_missing_expert_tensor_is_refused(tmp_path: Path) -> None:
    from test_model_checks import DROP, rewrite

    src = tmp_path / "q.gguf"
    write_tiny(src, FAMILIES["qwen2moe"])
    p = rewrite(src, tmp_path / "bad.gguf", tensors={"blk.1.ffn_down_exps.weight": DROP})
    with pytest.raises(ModelConfigError, match="missing tensor 'blk.1.ffn_down_exps.weight'"):
        qllama.load(p)


@pytest.mark.parametrize(
    ("arch", "message"),
    [
        ("deepseek2", "multi-head latent attention"),
        ("qwen3next", "hybrid recurrent"),
    ],
)
def test_families_with_experts_qllama_lacks_are_refused_by_name(
    tmp_path: Path, arch: str, message: str
) -> None:
    from test_model_checks import rewrite

    src = tmp_path / "q.gguf"
    write_tiny(src, FAMILIES["qwen3moe"])
    p = rewrite(src, tmp_path / "bad.gguf", kv={"general.architecture": arch})
    with pytest.raises(
        ModelConfigError, match=f"architecture '{arch}' is not supported: {message}"
    ):
        qllama.load(p)


def test_the_declarations_gate_and_share_as_llama_cpp() -> None:
    """moe_kv_recipes.md 1.9-1.10: softmax (gpt-oss: over the selected logits); qwen3moe,
    Mixtral and granitemoe normalise the top-k weights, qwen2moe, olmoe and gpt-oss do not;
    qwen2moe's shared expert is gated, granitemoe's is not."""
    want = {
        "qwen3moe": (True, SharedExpert.NONE),
        "qwen2moe": (False, SharedExpert.GATED),
        "llama": (True, SharedExpert.NONE),
        "olmoe": (False, SharedExpert.NONE),
        "granitemoe": (True, SharedExpert.UNGATED),
        "gpt-oss": (False, SharedExpert.NONE),
    }
    for arch, (norm, shared) in want.items():
        e = architecture(arch).experts
        assert e is not None and (e.norm, e.shared) == (norm, shared), arch
        assert e.gating == (Gating.SOFTMAX_WEIGHT if arch == "gpt-oss" else Gating.SOFTMAX)


def test_a_dense_llama_stays_dense(tmp_path: Path) -> None:
    path = tmp_path / "l.gguf"
    write_tiny(path, TinyConfig(arch="llama", **BASE))
    m = qllama.load(path, backend="numpy", activations="f32")
    assert m.config.n_expert == 0 and m.weights.layers[0].ffn_gate_inp is None


# --- transformers on the original safetensors ---------------------------------------------------

SPEC = 1e-5  # qllama F32 against transformers, relative to max |logit| (as the dense families)


@pytest.mark.parametrize(
    "name",
    ["qwen3moe", "qwen2moe", "mixtral", "olmoe", "granitemoe", "granitemoeshared", "gpt-oss"],
)
def test_transformers_on_the_original_safetensors(name: str) -> None:
    """A tiny random transformers model of the family, converted by llama.cpp's converter
    (tests/conformance/moe.py; built once, then cached): qllama's F32 logits against
    transformers' own modeling code, every backend."""
    pytest.importorskip("transformers")
    pytest.importorskip("sentencepiece")
    from conformance.moe import build
    from conformance.sources import Unreachable

    try:
        built = build(name)
    except Unreachable as e:
        pytest.skip(str(e))
    check_against_transformers(built, SPEC)


def check_against_transformers(built: Any, spec: float) -> None:
    """qllama's F32 logits of a converted model against transformers' own modeling code on
    its safetensors, on every backend installed: within ``spec`` of max |logit|."""
    from conformance.runners import transformers_logits

    ids = built.ids()
    ref = transformers_logits(built, ids)
    assert np.abs(ref).max() > 1.0 and len(set(ref.argmax(axis=1).tolist())) > 4  # not flat
    for setup, (backend, options) in BACKENDS.items():
        if importlib.util.find_spec(backend) is None:
            continue
        got = to_numpy(
            qllama.load(built.gguf, backend=backend, **options).forward(ids, all_logits=True)
        )
        assert got.shape == ref.shape
        assert float(np.abs(got - ref).max() / np.abs(ref).max()) <= spec, setup


def test_a_typed_kv_cache_with_sinks_is_refused(tmp_path: Path) -> None:
    """llama.cpp's typed caches run its flash attention kernels, which qllama computes
    without attention sinks: a gpt-oss file with one is refused, not run without them."""
    path = tmp_path / "gpt-oss.gguf"
    write_tiny(path, FAMILIES["gpt-oss"])
    with pytest.raises(BackendError, match="not computed with attention sinks"):
        qllama.load(path, "numpy", kv_precision="bf16,fa")
    qllama.load(path, "numpy", kv_precision="f16")  # the legacy precisions compute sinks


@pytest.mark.parametrize("ns", NAMESPACES)
def test_swiglu_oai_by_hand(ns: str) -> None:
    """min on the gate only, a two-sided clip on up, and up + 1 (gpt-oss's SWIGLU_OAI)."""
    xp = xp_of(ns)
    gate = np.float32([-9.0, -1.0, 0.0, 2.0, 7.0, 9.0])
    up = np.float32([-9.0, 8.0, 1.0, -0.5, 7.0, 9.0])
    g, u = np.minimum(gate, 7), np.clip(up, -7, 7)
    want = g / (1 + np.exp(np.float32(1.702) * -g)) * (u + 1)
    got = to_numpy(swiglu_oai(xp.asarray(gate), xp.asarray(up), xp=xp))
    np.testing.assert_allclose(got, want, rtol=8 * 2.0**-24, atol=0)
    assert got[5] == got[4]  # (9, 9) clamps to (7, 7)


@pytest.mark.parametrize("ns", NAMESPACES)
def test_a_sink_joins_the_sum_only(ns: str) -> None:
    """exp(s_j - m) / (sum_j exp(s_j - m) + exp(sink - m)), m the max over scores and sink:
    the row sums to 1 - p(sink)."""
    xp = xp_of(ns)
    scores = np.float32([[1.0, 2.0, -np.inf], [0.0, 0.0, 0.0]])
    sink = np.float32([[3.0], [-1.0]])
    m = np.maximum(scores.max(axis=-1, keepdims=True), sink)
    e = np.exp(scores - m)
    want = e / (e.sum(axis=-1, keepdims=True) + np.exp(sink - m))
    got = to_numpy(softmax_with_sink(xp.asarray(scores), xp.asarray(sink), xp=xp))
    np.testing.assert_allclose(got, want, rtol=8 * 2.0**-24, atol=0)
    assert got[0, 2] == 0.0
    # the sink (3 over scores 1 and 2) keeps 1 / (1 + e^-1 + e^-2) of the first row's mass
    assert abs(float(got[0].sum()) - (1 - 1 / (1 + np.exp(-1) + np.exp(-2)))) < 1e-6


def test_an_arithmetic_policy_routes_every_expert_of_a_tensor(tmp_path: Path) -> None:
    """A pattern naming a 3-D expert tensor routes all its experts: the experts in the CPU
    arithmetic, the rest in f32, give the CPU arithmetic's expert products."""
    path = tmp_path / "q.gguf"
    write_tiny(path, dataclasses.replace(FAMILIES["qwen3moe"], weight_type="Q8_0"))
    policy = {"blk.*_exps.weight": "q8", "*": "f32"}
    mixed = qllama.load(path, backend="numpy", arithmetic=policy)
    cpu = qllama.load(path, backend="numpy")
    routed = mixed.weights.layers[0].ffn_up_exps
    assert len(routed) == 4 and {r.arithmetic for r in routed} == {"q8"}
    assert mixed.weights.layers[0].ffn_gate_inp.arithmetic == "f32"
    x = np.random.default_rng(5).standard_normal((6, 64)).astype(np.float32)
    sel = np.array([[0, 1], [2, 3], [1, 0], [3, 2], [0, 3], [2, 1]], np.int32)
    got = expert_matmul(mixed.backend, x, routed, sel)
    want = expert_matmul(cpu.backend, x, cpu.weights.layers[0].ffn_up_exps, sel)
    np.testing.assert_array_equal(got, want)


def test_the_imatrix_collects_each_expert_apart() -> None:
    """llama-imatrix on mul_mat_id (moe_kv_recipes.md 2.7): whatever the rows, each (slot,
    token) adds its row's squares to its expert's slice and 1 to its count, slots outer."""
    from qllama.measure.importance import Collector

    inner = get_backend("numpy")
    c = Collector(inner)
    rng = np.random.default_rng(2)
    raw, _ = _experts(inner, rng, "Q8_0", 3, 32, 64)
    experts = [c.prepare(w.tensor) for w in raw]
    x = rng.standard_normal((2, 64)).astype(np.float32)  # 2 rows: under 16, still collected
    sel = np.array([[2, 0], [2, 1]], np.int32)
    expert_matmul(c, x, experts, sel)
    want = np.zeros((3, 64), np.float32)
    for s in range(2):
        for t in range(2):
            want[sel[t, s]] += x[t] * x[t]
    np.testing.assert_array_equal(c.expert_sums["blk.0.ffn_up_exps.weight"], want)
    assert c.expert_counts["blk.0.ffn_up_exps.weight"].tolist() == [1, 1, 2]
    assert not c.sums  # nothing filed as a dense product


def test_tied_routers_rank_as_llama_cpp(tmp_path: Path) -> None:
    """20 experts whose router rows are all equal: every token's probabilities tie, and the
    block takes libstdc++'s order of them (not the index order), as the oracle does."""
    from test_model_checks import rewrite

    src = tmp_path / "q.gguf"
    cfg = dataclasses.replace(FAMILIES["qwen3moe"], n_expert=20, weight_type="Q8_0")
    write_tiny(src, cfg)
    row = np.random.default_rng(4).standard_normal((1, 64)).astype(np.float32)
    same = {f"blk.{i}.ffn_gate_inp.weight": (np.repeat(row, 20, axis=0), "F32") for i in range(3)}
    m = qllama.load(rewrite(src, tmp_path / "tied.gguf", tensors=same), backend="numpy")
    x = np.random.default_rng(3).standard_normal((5, 64)).astype(np.float32)
    assert stdsort_desc(np.full(20, 0.05, np.float32))[:2] != [0, 1]  # the orders differ here
    for i in range(m.config.n_layer):
        np.testing.assert_array_equal(m._moe(x, m.weights.layers[i], i), oracle_moe(m, x, i))
