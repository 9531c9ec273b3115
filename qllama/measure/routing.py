"""Where routing meets quantization: does a quantized mixture of experts pick the reference's
experts, and how much of its logit error follows from the experts it picks otherwise?

**Selection.** :meth:`Routing.of` turns router logits recorded at ``blk.{i}.router``
(:mod:`qllama.runtime.observe`) into what the model does with them, through the model's own
functions (:func:`~qllama.runtime.model.router_gate`, :func:`~qllama.runtime.model.select_experts`,
:func:`~qllama.runtime.model.expert_weights`): the gated values, each token's k experts best
first (in llama.cpp's tie order) and their weights. Given the run's backend (its router ops,
:func:`~qllama.backends.base.glue`'s ``soft_max`` and ``sum_rows``: under the CPU arithmetic
ggml's exps and double sums) this is the selection the forward pass made, bit for bit.

**Agreement**, per (layer, token) of two runs of the same tokens (:func:`agreement`):

- set agreement ``|A ∩ B| / k``: 1 where both select the same experts, in any order;
- top-1 agreement: the same best expert;
- ordered overlap: the mean over depths d = 1..k of ``|A[:d] ∩ B[:d]| / d`` (the average
  overlap of two rankings; 1 only for the same experts in the same order);
- the router-weight error: ``Σ_e |w_A(e) - w_B(e)|`` over the union of both selections (an
  expert not selected weighs 0), what the mixture's output is weighted by;
- the reference's margin: its k-th minus its (k+1)-th gated value, how near its selection was
  to another.

**The counterfactual** (:func:`routing_report`): the quantized model run again with every
mixture layer's selection forced to the reference's (an observer returning it at
``blk.{i}.experts``). The forced experts' weights are recomputed from the quantized run's own
gated values, not taken from the reference: the forced run then differs from the free one
only in *which* experts run, so the error it removes is the error of the routing changes,
while the router-weight error of the experts both runs select, a continuous error of the
quantized router's input like any other activation error, stays in both. The share of the
mean KL divergence that routing explains is ``1 - KLD(forced) / KLD(free)``. Per position,
the error at positions where some layer's selection changed against the others: a change
also reaches later positions through attention, so the split is by where a change happens,
not by where its error lands.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np

from qllama.array_api import namespace, to_numpy
from qllama.backends.base import glue, router_softmax, row_sum
from qllama.errors import QllamaError
from qllama.measure.metrics import log_softmax
from qllama.runtime.config import ModelConfig
from qllama.runtime.model import expert_weights, router_gate, select_experts
from qllama.runtime.observe import LOGITS, Trace, block_name, record, split_name

# the router's ops in the array API, where a backend has no glue op of its own
ROUTER_FORMS = {"soft_max": router_softmax, "sum_rows": row_sum}


def _on_numpy(backend: Any, op: str) -> Callable[[np.ndarray], np.ndarray]:
    """``backend``'s router op ``op`` (its glue op, else the array-API form on its namespace)
    taking and giving numpy rows."""
    own = glue(backend, op) or functools.partial(ROUTER_FORMS[op], xp=backend.xp)

    def run(x: np.ndarray) -> np.ndarray:
        return np.asarray(to_numpy(own(backend.asarray(x))), np.float32)

    return run


@dataclass(frozen=True)
class Routing:
    """What a mixture does with its router logits, at every layer and token."""

    gated: np.ndarray  # (L, T, n_expert) float32: the values experts are selected on
    selected: np.ndarray  # (L, T, k) int64: each token's experts, the best first
    weights: np.ndarray  # (L, T, k) float32: their weights, slot by slot

    @classmethod
    def of(cls, logits: np.ndarray, config: ModelConfig, backend: Any = None) -> Routing:
        """The routing of router logits ``(L, T, n_expert)`` as ``config``'s model routes on
        ``backend`` (the router's softmax and weight sum are the backend's; without one, the
        array-API forms)."""
        e = config.features.experts
        if e is None or config.n_expert == 0:
            raise QllamaError(f"a {config.arch} model without experts has no routing")
        logits = np.asarray(logits, np.float32)
        if logits.ndim != 3 or logits.shape[-1] != config.n_expert:
            raise QllamaError(
                f"router logits of shape {logits.shape}: expected (layers, tokens, "
                f"{config.n_expert})"
            )
        xp = namespace("numpy")
        ops = {op: None if backend is None else _on_numpy(backend, op) for op in ROUTER_FORMS}
        gated, selected, weights = [], [], []
        for layer in logits:  # (T, n_expert)
            g = router_gate(layer, e.gating, xp=xp, softmax=ops["soft_max"])
            s = select_experts(g, config.n_expert_used, xp=xp, asarray=np.asarray)
            w = expert_weights(
                g,
                s,
                e.gating,
                config.expert_weights_norm,
                config.expert_weights_scale,
                xp=xp,
                softmax=ops["soft_max"],
                sum_rows=ops["sum_rows"],
            )
            gated.append(g)
            selected.append(np.asarray(s, np.int64))
            weights.append(w)
        return cls(np.stack(gated), np.stack(selected), np.stack(weights))

    @property
    def k(self) -> int:
        return int(self.selected.shape[-1])

    def dense_weights(self) -> np.ndarray:
        """Every expert's weight (L, T, n_expert), 0 where it is not selected."""
        out = np.zeros(self.gated.shape, np.float64)
        np.put_along_axis(out, self.selected, self.weights.astype(np.float64), axis=-1)
        return out

    def margin(self) -> np.ndarray:
        """The k-th minus the (k+1)-th largest gated value (L, T): how far the selection is
        from another (inf where every expert is selected)."""
        k, n = self.k, self.gated.shape[-1]
        if k >= n:
            return np.full(self.gated.shape[:2], np.inf)
        ranked = -np.sort(-self.gated.astype(np.float64), axis=-1)  # (L, T, n) largest first
        return ranked[..., k - 1] - ranked[..., k]


def router_logits(trace: Trace, n_layer: int) -> np.ndarray:
    """The router logits a trace recorded (``Recorder(router=True)``): (L, positions, n)."""
    names = [block_name(i, "router") for i in range(n_layer)]
    missing = [n for n in names if n not in trace.values]
    if missing:
        raise QllamaError(f"the trace has no router logits ({missing[0]}): record with router=True")
    return np.stack([trace[n] for n in names])


@dataclass(frozen=True)
class Agreement:
    """Two routings of the same tokens compared, per (layer, token): (L, T) each."""

    set_agreement: np.ndarray  # |A ∩ B| / k
    top1: np.ndarray  # bool: the same best expert
    ordered: np.ndarray  # mean over depths d of |A[:d] ∩ B[:d]| / d
    weight_error: np.ndarray  # Σ |w_A - w_B| over the union of the selections
    ref_margin: np.ndarray  # the reference's k-th minus (k+1)-th gated value

    @property
    def changed(self) -> np.ndarray:
        """(L, T) bool: the selected set differs."""
        return self.set_agreement < 1.0

    @property
    def positions_changed(self) -> np.ndarray:
        """(T,) bool: some layer's selected set differs at the position."""
        return np.asarray(self.changed.any(axis=0))

    def summary(self) -> RoutingSummary:
        changed = self.changed
        margins = self.ref_margin[changed]
        return RoutingSummary(
            pairs=int(changed.size),
            changed=float(changed.mean()),
            top1_changed=float(1.0 - self.top1.mean()),
            reordered=float((self.ordered < 1.0).mean()),
            set_agreement=float(self.set_agreement.mean()),
            ordered_overlap=float(self.ordered.mean()),
            mean_weight_error=float(self.weight_error.mean()),
            max_weight_error=float(self.weight_error.max()),
            positions_changed=float(self.positions_changed.mean()),
            median_margin=float(np.median(self.ref_margin)),
            median_margin_changed=float(np.median(margins)) if margins.size else None,
            layer_changed=tuple(float(x) for x in changed.mean(axis=1)),
            layer_weight_error=tuple(float(x) for x in self.weight_error.mean(axis=1)),
        )


@dataclass(frozen=True)
class RoutingSummary:
    """The agreement of two routings in numbers, over all (layer, token) pairs and per layer."""

    pairs: int  # (layer, token) pairs compared
    changed: float  # fraction of the pairs whose selected set differs
    top1_changed: float  # fraction whose best expert differs
    reordered: float  # fraction whose experts or their order differ
    set_agreement: float  # mean |A ∩ B| / k
    ordered_overlap: float  # mean ordered overlap
    mean_weight_error: float  # mean Σ |w_A - w_B|
    max_weight_error: float
    positions_changed: float  # fraction of positions with a changed set in some layer
    median_margin: float  # the reference's median k-th minus (k+1)-th gated value
    median_margin_changed: float | None  # the same over the changed pairs (None: none)
    layer_changed: tuple[float, ...]  # per layer: the fraction of tokens whose set differs
    layer_weight_error: tuple[float, ...]  # per layer: the mean router-weight error


def agreement(ref: Routing, ours: Routing) -> Agreement:
    """``ours`` against ``ref``, per (layer, token) (the module's docstring defines each)."""
    if ref.selected.shape != ours.selected.shape or ref.gated.shape != ours.gated.shape:
        raise QllamaError(
            f"routings of different shapes: {ref.selected.shape} and {ours.selected.shape}"
        )
    a, b, k = ref.selected, ours.selected, ref.k
    # member[l, t, s, r]: our slot s holds the reference's slot r
    member = b[..., :, None] == a[..., None, :]  # (L, T, k, k)
    shared = member.any(axis=-1).sum(axis=-1)  # (L, T)
    depth = np.arange(1, k + 1)
    # |A[:d] ∩ B[:d]| for every depth d: pairs (s, r) with both slots below d
    upto = np.stack(
        [member[..., :d, :d].any(axis=-1).sum(axis=-1) for d in depth], axis=-1
    )  # (L, T, k)
    return Agreement(
        set_agreement=shared / k,
        top1=a[..., 0] == b[..., 0],
        ordered=(upto / depth).mean(axis=-1),
        weight_error=np.abs(ref.dense_weights() - ours.dense_weights()).sum(axis=-1),
        ref_margin=ref.margin(),
    )


# --- the counterfactual ----------------------------------------------------------------------


class ForcedRouting:
    """An observer that routes every mixture layer's tokens to the experts ``selected``
    ``(L, T, k)`` (another run's, of the same tokens from position 0)."""

    def __init__(self, selected: np.ndarray) -> None:
        self.selected = np.asarray(selected, np.int64)

    def __call__(self, name: str, value: Any) -> np.ndarray | None:
        layer, point = split_name(name)
        if point != "experts" or layer is None:
            return None
        return self.selected[layer]


@dataclass(frozen=True)
class LogitErrors:
    """One run's logits against the reference's, over a set of positions."""

    positions: int
    mean_kld: float  # mean KL(reference || run)
    median_max_abs: float  # median over the positions of max |Δlogit|
    max_max_abs: float

    @classmethod
    def of(cls, kld: np.ndarray, max_abs: np.ndarray) -> LogitErrors | None:
        """The errors of the positions given (None: there are none)."""
        if kld.size == 0:
            return None
        return cls(
            int(kld.size), float(kld.mean()), float(np.median(max_abs)), float(max_abs.max())
        )


def kl_divergence(ref_logits: np.ndarray, logits: np.ndarray) -> np.ndarray:
    """KL(ref || run) of each row (float64), over the whole vocabulary."""
    ref_lp, lp = log_softmax(ref_logits), log_softmax(logits)
    return np.sum(np.exp(ref_lp) * (ref_lp - lp), axis=-1)


REPORT_ARRAYS = ("set_agreement", "weight_error", "ref_margin", "kld_free", "kld_forced")


@dataclass(frozen=True)
class RoutingReport:
    """A quantized mixture's routing against the reference's, and the counterfactual."""

    tokens: int
    layers: int
    n_expert: int
    k: int
    routing: RoutingSummary
    free: LogitErrors  # the quantized model as it routes
    forced: LogitErrors  # with the reference's selection forced at every layer
    explained: float | None  # 1 - forced / free mean KLD (None: no error to explain)
    changed: LogitErrors | None  # the free run at positions with a routing change
    unchanged: LogitErrors | None  # and at the others
    # the arrays: per (layer, token) and per position
    set_agreement: np.ndarray | None = None  # (L, T)
    weight_error: np.ndarray | None = None  # (L, T)
    ref_margin: np.ndarray | None = None  # (L, T)
    kld_free: np.ndarray | None = None  # (T,)
    kld_forced: np.ndarray | None = None  # (T,)

    def to_dict(self) -> dict[str, Any]:
        """Everything but the arrays, as JSON data."""
        return {k: v for k, v in asdict(self).items() if k not in REPORT_ARRAYS}

    def format(self) -> str:
        """The routing agreement, the counterfactual, and a row per layer."""
        r = self.routing
        lines = [
            f"routing against the reference: {self.tokens} tokens x {self.layers} layers, "
            f"top {self.k} of {self.n_expert} experts",
            f"  selected set changed {100 * r.changed:.2f}% of (layer, token) pairs, top-1 "
            f"{100 * r.top1_changed:.2f}%, order or set {100 * r.reordered:.2f}%; "
            f"positions with a change {100 * r.positions_changed:.1f}%",
            f"  set agreement {r.set_agreement:.4f}, ordered overlap {r.ordered_overlap:.4f}, "
            f"router-weight error mean {r.mean_weight_error:.3g} max {r.max_weight_error:.3g}",
            f"  reference margin (k-th - (k+1)-th gated value): median {r.median_margin:.3g}, "
            + (
                f"at changes {r.median_margin_changed:.3g}"
                if r.median_margin_changed is not None
                else "no changes"
            ),
            f"  {'run':<28} {'positions':>9} {'mean KLD':>10} {'med max|Δ|':>10} "
            f"{'max max|Δ|':>10}",
        ]
        for label, e in (
            ("as it routes", self.free),
            ("reference's experts forced", self.forced),
            ("  positions with a change", self.changed),
            ("  positions without", self.unchanged),
        ):
            if e is not None:
                lines.append(
                    f"  {label:<28} {e.positions:>9} {e.mean_kld:>10.3e} "
                    f"{e.median_max_abs:>10.4f} {e.max_max_abs:>10.4f}"
                )
        share = "-" if self.explained is None else f"{100 * self.explained:.1f}%"
        lines.append(f"  share of the mean KLD that follows the routing changes: {share}")
        lines.append(f"  {'layer':<6} {'changed':>8} {'weight err':>10}")
        for i, (c, w) in enumerate(zip(r.layer_changed, r.layer_weight_error, strict=True)):
            lines.append(f"  {i:<6} {100 * c:>7.2f}% {w:>10.3g}")
        return "\n".join(lines)


def plot_routing(
    reports: dict[str, RoutingReport], path: str | os.PathLike[str], title: str
) -> None:
    """Per layer, the fraction of tokens rerouted (bars) and the mean router-weight error
    (lines, right axis), one colour per run (``reports``: label -> report): a PNG, written
    atomically."""
    from qllama.measure.figures import pyplot, save

    fig, ax = pyplot().subplots(figsize=(10, 4))
    right = ax.twinx()
    width = 0.8 / max(1, len(reports))
    for j, (label, r) in enumerate(reports.items()):
        x = np.arange(r.layers)
        ax.bar(
            x + j * width,
            100 * np.asarray(r.routing.layer_changed),
            width,
            color=f"C{j}",
            alpha=0.6,
            label=f"{label}: tokens rerouted",
        )
        right.plot(
            x + j * width,
            r.routing.layer_weight_error,
            color=f"C{j}",
            marker="o",
            ms=3,
            lw=1,
            label=f"{label}: router-weight error",
        )
    ax.set_xlabel("layer")
    ax.set_ylabel("tokens whose experts differ (%)")
    right.set_ylabel("mean router-weight error (L1)")
    lines = [h for a in (ax, right) for h in a.get_legend_handles_labels()[0]]
    ax.legend(lines, [h.get_label() for h in lines], fontsize=7)
    ax.set_title(title, fontsize=9)
    fig.tight_layout()
    save(fig, path, dpi=120)


def routing_report(
    model: Any, reference: Any, tokens: Sequence[int], *, ref_trace: Trace | None = None
) -> RoutingReport:
    """``model``'s routing of ``tokens`` against ``reference``'s (two qllama models of the same
    mixture, e.g. a quantized file and its F32 file), and the counterfactual run of ``model``
    with the reference's selection forced (the module's docstring). ``ref_trace``: the
    reference's recorded run of the same tokens with the router logits (``record(reference,
    tokens, router=True)``), if already made; ``reference`` is then not run (its backend, if
    given, still selects its experts: without it, the array-API router softmax does)."""
    config = model.config
    if config.n_expert == 0:
        raise QllamaError("routing needs a mixture of experts (the model has no experts)")
    tokens = list(tokens)
    if ref_trace is None:
        if reference is None:
            raise QllamaError("routing needs the reference model or its recorded trace")
        ref_trace = record(reference, tokens, router=True)
    if ref_trace.tokens != tokens or ref_trace.positions != list(range(len(tokens))):
        raise QllamaError("the reference trace is not of these tokens at every position")
    ours = record(model, tokens, router=True)
    n_layer = config.n_layer
    # each run's selection through its own backend's softmax; a reference given only as a
    # trace through the array-API form (the study's: qllama's dequantize-all)
    ref_backend = None if reference is None else reference.backend
    ref_routing = Routing.of(router_logits(ref_trace, n_layer), config, ref_backend)
    our_routing = Routing.of(router_logits(ours, n_layer), config, model.backend)
    agree = agreement(ref_routing, our_routing)
    forced = record(model, tokens, observer=ForcedRouting(ref_routing.selected))
    ref_logits = ref_trace[LOGITS]
    kld = {
        "free": kl_divergence(ref_logits, ours[LOGITS]),
        "forced": kl_divergence(ref_logits, forced[LOGITS]),
    }
    max_abs = {
        "free": np.abs(ours[LOGITS] - ref_logits).max(axis=-1),
        "forced": np.abs(forced[LOGITS] - ref_logits).max(axis=-1),
    }
    free = LogitErrors.of(kld["free"], max_abs["free"])
    forced_errors = LogitErrors.of(kld["forced"], max_abs["forced"])
    assert free is not None and forced_errors is not None  # at least one token
    hit = agree.positions_changed
    return RoutingReport(
        tokens=len(tokens),
        layers=n_layer,
        n_expert=config.n_expert,
        k=config.n_expert_used,
        routing=agree.summary(),
        free=free,
        forced=forced_errors,
        explained=1.0 - forced_errors.mean_kld / free.mean_kld if free.mean_kld > 0 else None,
        changed=LogitErrors.of(kld["free"][hit], max_abs["free"][hit]),
        unchanged=LogitErrors.of(kld["free"][~hit], max_abs["free"][~hit]),
        set_agreement=agree.set_agreement,
        weight_error=agree.weight_error,
        ref_margin=agree.ref_margin,
        kld_free=kld["free"],
        kld_forced=kld["forced"],
    )
