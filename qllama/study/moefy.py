"""A mixture of experts made from a dense model, for studying routing under quantization where
no trained mixture can be downloaded (``qllama moefy``, docs/moe.md).

``split`` (MoEfication, Zhang et al. 2022): each layer's SwiGLU FFN ``down(silu(gate x) * up
x)`` is a sum over its ``n_ff`` neurons, so splitting the neurons into groups splits it exactly
into a sum of smaller FFNs, the experts. :func:`split_layer` groups them by **balanced
k-means** on the directions of their gate rows (neurons whose gates point alike fire together):
every expert gets ``(n_ff - shared) / n_expert`` neurons, as a GGUF expert tensor needs, after
the ``shared`` most important ones that every expert holds. The **router** row of an expert is
the mean of its group's gate rows, so its logit is the mean pre-activation of its gates, times
``router_scale``; the model keeps the top ``k`` experts of each token. Llama's mixture
(Mixtral, ``llama.expert_count``) normalises the k selected weights to sum 1, where the dense
FFN weighs every neuron 1: each expert's own neurons' ``down`` columns are multiplied by ``k``
(the shared ones are not: their k copies' weights add up to 1). With ``k = n_expert`` and
``router_scale = 0`` the mixture is the dense model, to float rounding (every weight exactly
1/k, a power of two for 4 or 8). A small model may not survive losing neurons: SmolLM2-135M
does not (docs/moe.md).

``upcycle`` (sparse upcycling, Komatsuzaki et al. 2022): every expert a copy of the whole FFN,
each weight times ``1 + noise * N(0, 1)``, routed by the router a split would have
(:func:`upcycle_layer`); the k weights add up to 1, so the mixture is the dense model up to
the copies' noise, and keeps its language.

The file is a ``llama`` GGUF with ``expert_count`` and ``expert_used_count``, its
``feed_forward_length`` the expert's width, every other tensor and key as in the source;
:func:`moefy` writes it atomically from an F32 file, deterministically (seeded).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from qllama.errors import QllamaError
from qllama.ggml_types import GGMLType, ValueType
from qllama.gguf.reader import GGUFValue, read_gguf
from qllama.gguf.writer import GGUFWriter, copy_metadata

_DENSE_FFN = ("ffn_gate", "ffn_up", "ffn_down")


@dataclass(frozen=True)
class MoEfication:
    """How a dense model becomes a mixture: experts, how many a token uses, split or upcycled
    (and what each way takes), the router's scale, the k-means iterations and the seed."""

    n_expert: int = 8
    k: int = 2
    mode: str = "split"  # "split" the neurons, or "upcycle": every expert a perturbed copy
    shared: int = 0  # split: neurons every expert holds (the most important), the rest split
    noise: float = 0.05  # upcycle: each copy's weights times 1 + noise * N(0, 1)
    router_scale: float = 1.0
    iterations: int = 25
    seed: int = 0


def balanced_kmeans(x: np.ndarray, n_clusters: int, *, iterations: int, seed: int) -> np.ndarray:
    """Clusters of equal size of the rows of ``x`` (n, d), n a multiple of ``n_clusters``, by
    cosine similarity: each round assigns the (row, centroid) pairs from the most similar down,
    a row once and a centroid up to n / n_clusters rows, then moves each centroid to its rows'
    mean direction. Returns the cluster of each row (n,)."""
    n = x.shape[0]
    if n % n_clusters:
        raise QllamaError(f"{n} neurons do not split into {n_clusters} equal experts")
    size = n // n_clusters
    unit = x / np.maximum(np.linalg.norm(x, axis=1, keepdims=True), 1e-12)  # (n, d)
    rng = np.random.default_rng(seed)
    centroids = unit[rng.choice(n, n_clusters, replace=False)]  # (n_clusters, d)
    label = np.full(n, -1)
    for _ in range(iterations):
        sim = unit @ centroids.T  # (n, n_clusters)
        order = np.argsort(-sim, axis=None, kind="stable")  # every pair, most similar first
        label = np.full(n, -1)
        room = np.full(n_clusters, size)
        for flat in order:
            row, c = divmod(int(flat), n_clusters)
            if label[row] < 0 and room[c] > 0:
                label[row] = c
                room[c] -= 1
        mean = np.stack([unit[label == c].mean(axis=0) for c in range(n_clusters)])
        new = mean / np.maximum(np.linalg.norm(mean, axis=1, keepdims=True), 1e-12)
        if np.array_equal(new, centroids):
            break
        centroids = new
    return label


def importance(gate: np.ndarray, up: np.ndarray, down: np.ndarray) -> np.ndarray:
    """A neuron's weight-only importance (n_ff,): the product of its gate row's, up row's and
    down column's norms, how large its contribution can be for an input of a given norm."""
    return np.linalg.norm(gate, axis=1) * np.linalg.norm(up, axis=1) * np.linalg.norm(down, axis=0)


def split_layer(
    gate: np.ndarray, up: np.ndarray, down: np.ndarray, spec: MoEfication
) -> dict[str, np.ndarray]:
    """One layer's dense FFN (gate, up (n_ff, n_embd); down (n_embd, n_ff)) as experts: the
    router (n_expert, n_embd), gate and up exps (n_expert, width, n_embd) and down exps
    (n_expert, n_embd, width), width = shared + (n_ff - shared) / n_expert. Every expert
    holds the ``shared`` most important neurons (:func:`importance`), their down column as it
    is (the k normalised weights add up to 1), then its own group, whose down columns are
    times k (1/k each where the dense FFN weighs a neuron 1); neurons in their dense order."""
    n_ff = gate.shape[0]
    ranked = np.argsort(-importance(gate, up, down), kind="stable")
    shared, rest = np.sort(ranked[: spec.shared]), np.sort(ranked[spec.shared :])
    label = balanced_kmeans(gate[rest], spec.n_expert, iterations=spec.iterations, seed=spec.seed)
    groups = [rest[label == e] for e in range(spec.n_expert)]  # ascending neurons
    scale = np.concatenate(
        [np.ones(shared.size, np.float32), np.full((n_ff - shared.size) // spec.n_expert, spec.k)]
    ).astype(np.float32)  # (width,)
    cols = [np.concatenate([shared, g]) for g in groups]  # each expert's neurons
    router = np.stack([gate[g].mean(axis=0) for g in groups]) * spec.router_scale
    return {
        "ffn_gate_inp": router.astype(np.float32),
        "ffn_gate_exps": np.stack([gate[c] for c in cols]).astype(np.float32),
        "ffn_up_exps": np.stack([up[c] for c in cols]).astype(np.float32),
        "ffn_down_exps": np.stack([down[:, c] * scale for c in cols]).astype(np.float32),
    }


def upcycle_layer(
    gate: np.ndarray, up: np.ndarray, down: np.ndarray, spec: MoEfication, rng: np.random.Generator
) -> dict[str, np.ndarray]:
    """One layer's dense FFN as ``n_expert`` copies of itself, each weight of each copy times
    ``1 + noise * N(0, 1)`` (sparse upcycling with perturbed copies), routed as a split would
    be: the router row of expert e is the mean gate row of the e-th balanced k-means cluster
    of the neurons. The k normalised weights add up to 1, so the mixture is the dense FFN up
    to the copies' noise."""
    label = balanced_kmeans(gate, spec.n_expert, iterations=spec.iterations, seed=spec.seed)
    router = np.stack([gate[label == e].mean(axis=0) for e in range(spec.n_expert)])

    def copies(w: np.ndarray) -> np.ndarray:
        shape = (spec.n_expert, *w.shape)
        noise = rng.standard_normal(shape, dtype=np.float32)
        return (w[None] * (1 + np.float32(spec.noise) * noise)).astype(np.float32)

    return {
        "ffn_gate_inp": (router * spec.router_scale).astype(np.float32),
        "ffn_gate_exps": copies(gate),
        "ffn_up_exps": copies(up),
        "ffn_down_exps": copies(down),
    }


MODES = ("split", "upcycle")


def moefy(
    src: str | os.PathLike[str], dst: str | os.PathLike[str], spec: MoEfication = MoEfication()
) -> None:
    """Write ``dst``: the dense F32 llama ``src`` with every FFN split into ``spec.n_expert``
    experts, ``spec.k`` of them per token (the module's docstring). Atomic."""
    with read_gguf(src) as f:
        arch = f.get("general.architecture")
        if arch != "llama":
            raise QllamaError(f"{src}: MoEfication writes a llama mixture, not from {arch!r}")
        if f.get("llama.expert_count"):
            raise QllamaError(f"{src} is a mixture already")
        if spec.mode not in MODES:
            raise QllamaError(f"MoEfication mode {spec.mode!r}: use one of {', '.join(MODES)}")
        n_ff = int(f.get("llama.feed_forward_length"))
        split = n_ff - spec.shared
        if split <= 0 or split % spec.n_expert or not 1 <= spec.k <= spec.n_expert:
            raise QllamaError(
                f"{n_ff} neurons, {spec.shared} shared, the rest into {spec.n_expert} experts, "
                f"{spec.k} per token: the experts must be equal and k in [1, n_expert]"
            )
        w = GGUFWriter(alignment=f.alignment)
        copy_metadata(f, w, skip=("llama.feed_forward_length", "general.name"))
        u32 = lambda v: GGUFValue(ValueType.UINT32, v)  # noqa: E731
        w.add("general.name", f"{f.get('general.name') or Path(src).stem} MoEfied")
        width = n_ff if spec.mode == "upcycle" else spec.shared + split // spec.n_expert
        w.add("llama.feed_forward_length", u32(width))
        rng = np.random.default_rng(spec.seed)
        w.add("llama.expert_count", u32(spec.n_expert))
        w.add("llama.expert_used_count", u32(spec.k))

        def data(name: str) -> np.ndarray:
            t = f.tensor(name)
            if t.ggml_type != GGMLType.F32:
                raise QllamaError(f"{name} is {t.ggml_type.name}: MoEfication reads an F32 file")
            return f.tensor_data(name).view(np.float32).reshape(t.shape)

        for t in f:
            parts = t.name.split(".")
            if t.name.startswith("blk.") and parts[2] in _DENSE_FFN:
                if parts[2] != "ffn_gate":
                    continue  # written with the layer's gate
                i = parts[1]
                dense = (
                    data(t.name),
                    data(f"blk.{i}.ffn_up.weight"),
                    data(f"blk.{i}.ffn_down.weight"),
                )
                experts = (
                    upcycle_layer(*dense, spec, rng)
                    if spec.mode == "upcycle"
                    else split_layer(*dense, spec)
                )
                for kind, x in experts.items():
                    w.add_tensor(f"blk.{i}.{kind}.weight", x, GGMLType.F32)
                continue
            w.add_tensor(t.name, np.ascontiguousarray(data(t.name)), GGMLType.F32, t.shape)
        w.write(dst)


__all__ = ["MoEfication", "balanced_kmeans", "importance", "moefy", "split_layer"]
