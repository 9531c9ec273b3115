"""Which tensors' quantization, or activation rounding, is responsible for the drift.

:func:`attribute` switches one cause on for one group of tensors at a time, the rest off, and
measures each variant against the reference by teacher forcing (every position in one batched
pass): mean KL divergence and the median over steps of max |Δlogit|. A group's contribution is
its excess over the variant with the cause off everywhere; the sum of the parts is reported
beside the whole (the cause on everywhere), since causes need not add up.

=============  ===========================================  ===================================
kind           cause switched on for a group                everything else
=============  ===========================================  ===================================
``activations``  the CPU arithmetic (``q8``: activations      ``rest`` (``f32``: float
               quantized to the weight's ``vec_dot_type``)   activations); same weights, the file's
``weights``    the file's weights (taken into the F32 file  the F32 file's weights, under one
               with ``weights_from=``)                       ``arithmetic`` (``f32``)
=============  ===========================================  ===================================

Groups (``by``): the tensor ``class`` (attn_q, attn_k, attn_v, attn_output, ffn_gate, ffn_up,
ffn_down, output; a mixture's ffn_gate_exps, ffn_up_exps, ffn_down_exps), the ``layer``
(``blk.{i}``, and output), each ``tensor``, or, for the weights of a mixture, each ``expert``
of each layer (``blk.{i}.expert{e}``: its slices of ffn_gate_exps, ffn_up_exps and
ffn_down_exps; :func:`attribute_experts`), the whole then being every expert's slices taken
from the file and the rest F32. When the file
ties its output to ``token_embd.weight``, that tensor is the ``output`` group; its weights are
the embedding's too. An untied ``token_embd`` is its own group for ``weights`` and absent for
``activations`` (a row lookup has no activations to quantize).

Everything is returned as plain numbers (:meth:`Attribution.to_dict`), so a study can ask for it
as a measure.
"""

from __future__ import annotations

import dataclasses
import os
import re
import warnings
from collections.abc import Callable, Collection
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np

from qllama.errors import QllamaError
from qllama.measure.compare import Reference, teacher_forcing

KINDS = ("activations", "weights")
GROUPINGS = ("class", "layer", "tensor", "expert")
EXPERT_TENSORS = ("ffn_gate_exps", "ffn_up_exps", "ffn_down_exps")  # one 2-D slice per expert
CLASSES = (
    "attn_q",
    "attn_k",
    "attn_v",
    "attn_output",
    "ffn_gate",
    "ffn_up",
    "ffn_down",
    "output",
)
Progress = Callable[[int, int, str], Any]  # (done, total, what runs next)

_BLOCK_TENSOR = re.compile(r"blk\.(\d+)\.(\w+)\.weight")


@dataclass(frozen=True)
class Measure:
    """One variant against the reference, over the teacher-forcing steps."""

    mean_kld: float
    median_max_abs: float  # median over steps of max |Δlogit|
    max_max_abs: float
    same_top: float  # fraction of steps whose argmax agrees

    @classmethod
    def of(cls, model: Any, ref: Reference) -> Measure:
        tf = teacher_forcing(model, ref, mode="batched")
        return cls(
            mean_kld=tf.kl.mean_kld,
            median_max_abs=float(np.median(tf.max_abs)),
            max_max_abs=float(tf.max_abs.max()),
            same_top=tf.kl.same_top,
        )


@dataclass(frozen=True)
class Part:
    group: str
    tensors: list[str]
    measure: Measure


@dataclass
class Attribution:
    """The variants of one attribution and their excess over the baseline."""

    file: str
    kind: str
    by: str
    arithmetic: str  # the arithmetic of what is not switched on
    steps: int
    baseline: Measure  # the cause off everywhere
    whole: Measure  # the cause on everywhere
    parts: list[Part] = field(default_factory=list)

    def excess(self, m: Measure) -> tuple[float, float]:
        """(mean KLD, median max |Δlogit|) of ``m`` above the baseline."""
        b = self.baseline
        return m.mean_kld - b.mean_kld, m.median_max_abs - b.median_max_abs

    def sum_of_parts(self) -> tuple[float, float]:
        """The parts' excesses added up (mean KLD, median max |Δlogit|)."""
        excesses = [self.excess(p.measure) for p in self.parts]
        return sum(e[0] for e in excesses), sum(e[1] for e in excesses)

    def ranked(self) -> list[Part]:
        """The parts, largest excess mean KLD first."""
        return sorted(self.parts, key=lambda p: -self.excess(p.measure)[0])

    def to_dict(self) -> dict[str, Any]:
        whole = self.excess(self.whole)
        sums = self.sum_of_parts()
        return {
            "file": self.file,
            "kind": self.kind,
            "by": self.by,
            "arithmetic": self.arithmetic,
            "steps": self.steps,
            "baseline": asdict(self.baseline),
            "whole": asdict(self.whole),
            "whole_excess": {"mean_kld": whole[0], "median_max_abs": whole[1]},
            "sum_of_parts": {"mean_kld": sums[0], "median_max_abs": sums[1]},
            "parts": [
                {
                    "group": p.group,
                    "tensors": p.tensors,
                    **asdict(p.measure),
                    "excess_mean_kld": self.excess(p.measure)[0],
                    "excess_median_max_abs": self.excess(p.measure)[1],
                }
                for p in self.ranked()
            ],
        }

    def format(self) -> str:
        """The summary table, sorted by contribution, with the sum of the parts and the whole."""
        whole_kld = self.excess(self.whole)[0]
        cause = "q8 activations" if self.kind == "activations" else "the file's weights"
        rest = ("f32 weights, " if self.kind == "weights" else "") + f"{self.arithmetic} arithmetic"
        header = ("group", "tensors", "mean KLD", "excess", "share", "med max|Δ|", "excess")

        def share(kld: float) -> str:
            return f"{100 * kld / whole_kld:.1f}%" if whole_kld > 0 else "-"

        width = max([22, *(len(p.group) for p in self.parts)])

        def line(cells: tuple[str, ...]) -> str:
            return "  " + " ".join(
                f"{c:<{width}}" if k == 0 else f"{c:>10}" for k, c in enumerate(cells)
            )

        def row(label: str, n: int, m: Measure | None, kld: float, mabs: float) -> str:
            mean = f"{m.mean_kld:.3e}" if m else ""
            median = f"{m.median_max_abs:.4f}" if m else ""
            return line((label, str(n), mean, f"{kld:.3e}", share(kld), median, f"{mabs:.4f}"))

        lines = [
            f"{os.path.basename(self.file)}: {cause} for one {self.by} at a time, the rest "
            f"{rest}; {self.steps} teacher-forcing steps",
            line(header),
        ]
        lines += [
            row(p.group, len(p.tensors), p.measure, *self.excess(p.measure)) for p in self.ranked()
        ]
        sums = self.sum_of_parts()
        n_all = sum(len(p.tensors) for p in self.parts)
        b = self.baseline
        lines += [
            row("sum of the parts", n_all, None, *sums),
            row("whole (all on)", n_all, self.whole, *self.excess(self.whole)),
            f"  baseline (all off): mean KLD {b.mean_kld:.3e}, median max|Δ| "
            f"{b.median_max_abs:.4f}, same top {100 * b.same_top:.1f}%",
        ]
        return "\n".join(lines)

    def plot(self, path: str | os.PathLike[str], top: int = 30) -> None:
        """The ranked groups' excess mean KLD as horizontal bars (the ``top`` largest), the
        whole's excess and the sum of the parts as lines: a PNG, written atomically."""
        from qllama.measure.figures import pyplot, save

        plt = pyplot()
        parts = self.ranked()[:top]
        excess = [self.excess(p.measure)[0] for p in parts]
        fig, ax = plt.subplots(figsize=(8, 1.2 + 0.28 * len(parts)))
        y = list(range(len(parts)))
        ax.barh(y, excess, color=["C0" if e >= 0 else "C3" for e in excess])
        ax.set_yticks(y, [p.group for p in parts], fontsize=7)
        ax.invert_yaxis()  # the largest on top
        ax.axvline(self.excess(self.whole)[0], color="k", lw=1, label="whole (all on)")
        ax.axvline(self.sum_of_parts()[0], color="k", ls="--", lw=1, label="sum of the parts")
        ax.axvline(0, color="0.6", lw=0.6)
        n = len(self.parts)
        shown = f" (the {len(parts)} largest of {n})" if len(parts) < n else ""
        cause = "q8 activations" if self.kind == "activations" else "the file's weights"
        ax.set_title(
            f"{os.path.basename(self.file)}: {cause} for one {self.by} at a time, the rest "
            f"{self.arithmetic} arithmetic; {self.steps} steps{shown}",
            fontsize=8,
        )
        ax.set_xlabel("excess mean KL divergence over the baseline (all off)")
        ax.legend(fontsize=7)
        fig.tight_layout()
        save(fig, path)


def matmul_weights(path: str | os.PathLike[str]) -> tuple[list[str], bool]:
    """The file's weights of products the model uses (2-D, and a mixture's 3-D expert
    tensors), and whether its output is tied to the embedding."""
    from qllama.gguf.reader import read_gguf
    from qllama.runtime.config import ModelConfig
    from qllama.runtime.loader import check_tensors, is_weight

    with read_gguf(path) as f, warnings.catch_warnings():
        warnings.simplefilter("ignore")  # extra tensors: the load itself warns about them
        tensors = check_tensors(f, ModelConfig.from_gguf(f))
        names = [n for n, t in tensors.items() if is_weight(n, tuple(t.shape))]
    return names, "output.weight" not in names


def group_of(name: str, by: str, *, tied: bool) -> str | None:
    """The group of a 2-D weight: its class, its layer, or itself (None: not grouped)."""
    if by == "tensor":
        return name
    if name == "output.weight" or (name == "token_embd.weight" and tied):
        return "output"
    if name == "token_embd.weight":
        return "token_embd"
    m = _BLOCK_TENSOR.fullmatch(name)
    if m is None:
        return None
    return m.group(2) if by == "class" else f"blk.{m.group(1)}"


def groups(names: list[str], by: str, *, tied: bool, kind: str) -> dict[str, list[str]]:
    """Group name -> its tensors, in the file's order."""
    if by not in GROUPINGS:
        raise QllamaError(f"attribution by {by!r}: use one of {', '.join(GROUPINGS)}")
    out: dict[str, list[str]] = {}
    for name in names:
        if kind == "activations" and name == "token_embd.weight" and not tied:
            continue  # only looked up: no activations
        g = group_of(name, by, tied=tied)
        if g is not None:
            out.setdefault(g, []).append(name)
    return out


def attribute(
    path: str | os.PathLike[str],
    reference: Reference,
    *,
    kind: str = "weights",
    by: str = "class",
    f32_path: str | os.PathLike[str] | None = None,
    arithmetic: str = "f32",
    backend: str = "numpy",
    progress: Progress | None = None,
    **load_options: Any,
) -> Attribution:
    """Attribute ``path``'s error against ``reference`` to groups of tensors (module docstring).

    ``kind="weights"`` needs ``f32_path``, the F32 file the weights are swapped into.
    ``arithmetic`` is what runs where the cause is off (``activations``: the rest's
    arithmetic; ``weights``: every tensor's). Other options go to :func:`qllama.load`.
    """
    from qllama.runtime.loader import load

    if kind not in KINDS:
        raise QllamaError(f"attribution kind {kind!r}: use one of {', '.join(KINDS)}")
    if kind == "weights" and f32_path is None:
        raise QllamaError("attributing weight error needs the F32 file (f32_path)")
    if kind == "activations" and arithmetic == "q8":
        raise QllamaError("activations: the rest's arithmetic must differ from q8")
    if not reference.continuation:
        raise QllamaError("the reference has no continuation to teacher-force")
    if by == "expert":
        if kind != "weights" or f32_path is None:
            raise QllamaError("attribution by expert is of the weights: kind 'weights', f32_path")
        return attribute_experts(
            path,
            reference,
            f32_path=f32_path,
            arithmetic=arithmetic,
            backend=backend,
            progress=progress,
            **load_options,
        )
    names, tied = matmul_weights(path)
    parts = groups(names, by, tied=tied, kind=kind)

    def variant(on: list[str] | None, *, check: bool) -> dict[str, Any]:
        """load() arguments with the cause on for ``on`` (None: everywhere, []: nowhere)."""
        opts = {"backend": backend, "check_weights": check, **load_options}
        if kind == "activations":
            if on is None:
                policy: dict[str, str] = {"*": "q8"}
            else:
                policy = {**dict.fromkeys(on, "q8"), "*": arithmetic}
            return {"path": path, "arithmetic": policy, **opts}
        if on is None:
            return {"path": path, "arithmetic": arithmetic, **opts}
        donors = {n: path for n in on} or None
        return {"path": f32_path, "arithmetic": arithmetic, "weights_from": donors, **opts}

    # the two full loads check the weights of both files; the parts reuse those files
    plan = [("baseline", variant([], check=True)), ("whole", variant(None, check=True))]
    plan += [(f"group {g}", variant(ts, check=False)) for g, ts in parts.items()]
    measures: list[Measure] = []
    for done, (label, opts) in enumerate(plan):
        if progress is not None:
            progress(done, len(plan), label)
        model = load(opts.pop("path"), **opts)
        measures.append(Measure.of(model, reference))
        model.source.close()
    if progress is not None:
        progress(len(plan), len(plan), "done")
    return Attribution(
        file=str(path),
        kind=kind,
        by=by,
        arithmetic=arithmetic,
        steps=len(reference.continuation),
        baseline=measures[0],
        whole=measures[1],
        parts=[Part(g, ts, m) for (g, ts), m in zip(parts.items(), measures[2:], strict=True)],
    )


# --- by expert -------------------------------------------------------------------------------


def with_experts(base: Any, donor: Any, picks: Collection[tuple[int, int]]) -> Any:
    """A model of ``base``'s weights but for the experts ``picks`` ((layer, expert) pairs),
    whose gate, up and down slices are ``donor``'s (the same mixture, another file, loaded on
    the same backend). The weights are shared, not copied; the model has its own KV cache."""
    from qllama.runtime.model import Model

    layers = []
    for i, (b, d) in enumerate(zip(base.weights.layers, donor.weights.layers, strict=True)):
        chosen = {e for j, e in picks if j == i}
        swapped = {
            name: tuple(
                got if e in chosen else own
                for e, (own, got) in enumerate(zip(getattr(b, name), getattr(d, name), strict=True))
            )
            for name in EXPERT_TENSORS
            if chosen and getattr(b, name) is not None
        }
        layers.append(dataclasses.replace(b, **swapped) if swapped else b)
    return Model(
        base.config,
        dataclasses.replace(base.weights, layers=layers),
        base.backend,
        tokenizer=base.tokenizer,
        source=base.source,
        chat_template=base.chat_template,
    )


def attribute_experts(
    path: str | os.PathLike[str],
    reference: Reference,
    *,
    f32_path: str | os.PathLike[str],
    arithmetic: str = "f32",
    backend: str = "numpy",
    progress: Progress | None = None,
    **load_options: Any,
) -> Attribution:
    """Which experts' weights carry a mixture's weight error: the F32 file with one expert of
    one layer (its gate, up and down slices) taken from ``path`` at a time, all on
    ``arithmetic``, each teacher-forced against ``reference``. The baseline is the F32 file,
    the whole every expert taken from ``path`` (attention, norms, router and output F32)."""
    from qllama.runtime.loader import load

    opts = {"backend": backend, "arithmetic": arithmetic, **load_options}
    base, donor = load(f32_path, **opts), load(path, **opts)
    try:
        if base.config != donor.config or not base.config.n_expert:
            raise QllamaError(f"{path} and {f32_path} are not the same mixture of experts")
        c = base.config
        names = [n for n in EXPERT_TENSORS if getattr(base.weights.layers[0], n) is not None]
        pairs = [(i, e) for i in range(c.n_layer) for e in range(c.n_expert)]
        plan = [("baseline", []), ("whole", pairs)]
        plan += [(f"blk.{i}.expert{e}", [(i, e)]) for i, e in pairs]
        measures: list[Measure] = []
        for done, (label, picks) in enumerate(plan):
            if progress is not None:
                progress(done, len(plan), label)
            measures.append(Measure.of(with_experts(base, donor, picks), reference))
        if progress is not None:
            progress(len(plan), len(plan), "done")
    finally:
        base.source.close()
        donor.source.close()
    return Attribution(
        file=str(path),
        kind="weights",
        by="expert",
        arithmetic=arithmetic,
        steps=len(reference.continuation),
        baseline=measures[0],
        whole=measures[1],
        parts=[
            Part(f"blk.{i}.expert{e}", [f"blk.{i}.{n}.weight[{e}]" for n in names], m)
            for (i, e), m in zip(pairs, measures[2:], strict=True)
        ],
    )
