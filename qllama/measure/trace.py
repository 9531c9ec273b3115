"""Where the drift enters: the error of every layer's values against the f32 reference.

:func:`layer_trace` runs a file under each setting (an arithmetic on a backend,
:data:`qllama.runtime.arithmetic.SETTINGS`) with a :class:`~qllama.runtime.observe.Recorder`, and
compares each named value (:mod:`qllama.runtime.observe`) with transformers' at the same point
(:func:`qllama.measure.reference.transformers_trace`): relative L2 error ``|a - r| / |r|``, cosine
similarity and max ``|a - r|``, each over the chosen positions at once (the values of all positions
flattened).

The **F32 control** is the reference's own F32 file run through the same setting: its error is
what the implementation alone contributes (float32 sums in another order). A setting *leaves
the control's band* at the first point of the residual stream (embedding, each block's output,
the logits) whose relative L2 error is more than ``band_factor`` times the control's there. The
band has a floor of one float32 rounding (2^-24), since the control is exact where both sides
compute the same thing (an F32 embedding lookup). Everything is returned as plain numbers
(:meth:`TraceReport.to_dict`), so a study can ask for it as a measure.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np

from qllama.errors import QllamaError
from qllama.runtime.arithmetic import SETTINGS, setting
from qllama.runtime.observe import (
    BLOCK_POINTS,
    LOGITS,
    QKV_POINTS,
    Trace,
    block_name,
    record,
    residual_names,
    resolve_positions,
    split_name,
)

DEFAULT_SETTINGS = ("cpu", "gpu", "dequantize-all")
BAND_FACTOR = 10.0  # rounding errors of two float32 orders differ by a small factor, not 10x
BAND_FLOOR = 2.0**-24  # one float32 rounding, relative
MARKERS = ("o", "s", "^", "D", "v", "x")  # one per setting in a plot
Progress = Callable[[str], Any]  # a message per step


@dataclass(frozen=True)
class PointErrors:
    """How far a value ``(positions, width)`` is from the reference's, over all positions."""

    rel_l2: float  # |a - r| / |r| (Frobenius)
    cos: float  # <a, r> / (|a| |r|)
    max_abs: float  # max |a - r|
    # the median over positions of each one's |a - r| / |r|: one position with a huge norm
    # (an attention sink's massive activation) can dominate the three above
    median_rel_l2: float

    @classmethod
    def of(cls, a: np.ndarray, r: np.ndarray) -> PointErrors:
        a64, r64 = np.asarray(a, np.float64), np.asarray(r, np.float64)
        a64, r64 = a64.reshape(a64.shape[0], -1), r64.reshape(r64.shape[0], -1)  # (P, width)
        d = a64 - r64
        nr, na, nd = (float(np.linalg.norm(x)) for x in (r64, a64, d))
        per_d, per_r = np.linalg.norm(d, axis=1), np.linalg.norm(r64, axis=1)
        per = np.divide(per_d, per_r, out=per_d.copy(), where=per_r > 0)
        return cls(
            rel_l2=nd / nr if nr > 0 else nd,
            cos=float(np.vdot(a64, r64)) / (na * nr) if na > 0 and nr > 0 else float(na == nr),
            max_abs=float(np.abs(d).max()) if d.size else 0.0,
            median_rel_l2=float(np.median(per)) if per.size else 0.0,
        )


def compare(ours: Trace, ref: Trace) -> dict[str, PointErrors]:
    """Errors of every value the two traces share, by name."""
    if ours.tokens != ref.tokens or ours.positions != ref.positions:
        raise QllamaError("the traces are of different tokens or positions")
    out = {}
    for name in ours:
        if name in ref.values:
            if ours[name].shape != ref[name].shape:
                raise QllamaError(
                    f"'{name}' has shape {ours[name].shape} here, "
                    f"{ref[name].shape} in the reference"
                )
            out[name] = PointErrors.of(ours[name], ref[name])
    return out


@dataclass
class SettingTrace:
    """One setting's errors at every point, and its F32 control's."""

    setting: str
    errors: dict[str, PointErrors]
    control: dict[str, PointErrors]
    residual: list[str]  # the residual stream's points, embedding to logits
    band_factor: float = BAND_FACTOR

    def band_edge(self, name: str) -> float:
        """The largest relative L2 error at ``name`` still inside the control's band."""
        return self.band_factor * max(self.control[name].rel_l2, BAND_FLOOR)

    def outside(self, name: str) -> bool:
        return self.errors[name].rel_l2 > self.band_edge(name)

    @property
    def leaves_band(self) -> str | None:
        """The first residual point outside the F32 control's band (None: never)."""
        return next((n for n in self.residual if self.outside(n)), None)

    def curve(self, point: str = "out", *, control: bool = False) -> list[float]:
        """Relative L2 error along the layers: the residual stream for ``"out"``, else the
        blocks' ``point`` values."""
        source = self.control if control else self.errors
        names = self.residual if point == "out" else _block_names(self.residual, point)
        return [source[n].rel_l2 for n in names]

    def to_dict(self) -> dict[str, Any]:
        s = SETTINGS.get(self.setting)
        return {
            "setting": self.setting,
            "backend": s.backend if s else None,
            "arithmetic": s.arithmetic if s else None,
            "leaves_band": self.leaves_band,
            "residual": self.residual,
            "band_factor": self.band_factor,
            "band_edge": {n: self.band_edge(n) for n in self.residual},
            "errors": {n: asdict(e) for n, e in self.errors.items()},
            "control": {n: asdict(e) for n, e in self.control.items()},
        }


def _block_names(residual: list[str], point: str) -> list[str]:
    n_layer = len(residual) - 2
    return [block_name(i, point) for i in range(n_layer)]


@dataclass
class TraceReport:
    """Every setting's layer trace of one file against the reference."""

    file: str
    reference: str
    n_tokens: int
    positions: list[int]
    settings: dict[str, SettingTrace] = field(default_factory=dict)
    qkv: bool = False

    def to_dict(self) -> dict[str, Any]:
        return {
            "file": self.file,
            "reference": self.reference,
            "n_tokens": self.n_tokens,
            "positions": self.positions,
            "settings": {k: v.to_dict() for k, v in self.settings.items()},
        }

    def format(self) -> str:
        """Per setting, a row per layer: the residual's errors, the control's, the blocks'."""
        extra = [*BLOCK_POINTS[:2], *(QKV_POINTS if self.qkv else ())]
        lines = []
        for st in self.settings.values():
            where = st.leaves_band or "nowhere"
            lines += [
                f"{st.setting}: leaves the F32 control's band ({st.band_factor:g}x its error) "
                f"at {where}",
                f"  {'layer':<10} {'rel L2':>9} {'1-cos':>9} {'max|Δ|':>9} {'med pos':>9} "
                f"{'control':>9}  " + " ".join(f"{p + ' L2':>11}" for p in extra),
            ]
            for n in st.residual:
                e, c = st.errors[n], st.control[n]
                i = split_name(n)[0]
                mark = "*" if st.outside(n) else " "
                blocks = [None if i is None else st.errors.get(block_name(i, p)) for p in extra]
                label = n if i is None else str(i)
                text = (
                    f"  {label:<10} {e.rel_l2:>9.3g}{mark}{1 - e.cos:>9.2e} "
                    f"{e.max_abs:>9.3g} {e.median_rel_l2:>9.3g} {c.rel_l2:>9.2e}  "
                    + " ".join(f"{b.rel_l2:>11.3g}" if b else f"{'':>11}" for b in blocks)
                )
                lines.append(text.rstrip())
            lines.append("")
        lines.append(
            "rel L2 = |Δ| / |reference| over all positions (* outside the F32 control's band); "
            "med pos: the median over positions of each one's rel L2; control: the reference's "
            "F32 file under the same setting, rel L2"
        )
        return "\n".join(lines)

    def plot(self, path: str | os.PathLike[str], prompt: str = "") -> None:
        """Relative L2 error of the residual stream against layer, one line per setting, the
        F32 controls dashed (a PNG, written atomically). Curves that coincide (the GPU
        arithmetic and dequantize-all often do) keep distinct markers, larger under smaller,
        and say whose they equal in the legend. ``prompt`` goes under the title."""
        from qllama.measure.figures import pyplot, save

        fig, ax = pyplot().subplots(figsize=(10, 4.5))
        drawn: list[tuple[str, np.ndarray]] = []  # (label, curve) already on the axes
        for k, st in enumerate(self.settings.values()):
            color, marker = f"C{k}", MARKERS[k % len(MARKERS)]
            x = np.arange(len(st.residual))
            size = max(3.0, 9.0 - 2.0 * k)  # later settings smaller: one drawn over another shows
            # exact values (0) sit on the floor of one float32 rounding: a log axis has no 0
            for label, curve, style in (
                (st.setting, np.maximum(st.curve(), BAND_FLOOR), {"lw": 1.2}),
                (
                    f"{st.setting}: F32 control",
                    np.maximum(st.curve(control=True), BAND_FLOOR),
                    {"ls": "--", "lw": 0.8},
                ),
            ):
                same = next((n for n, c in drawn if np.array_equal(c, curve)), None)
                shown = f"{label} (= {same})" if same else label
                ax.plot(
                    x, curve, color=color, marker=marker, ms=size, mfc="none", label=shown, **style
                )
                drawn.append((label, curve))
        first = next(iter(self.settings.values()))
        labels = ["emb", *(str(i) for i in range(len(first.residual) - 2)), "logits"]
        ax.set_xticks(np.arange(len(labels)), labels, fontsize=7)
        ax.set_yscale("log")
        ax.set_xlabel("residual stream after layer")
        ax.set_ylabel("relative L2 error vs reference (floor 2^-24)")
        title = (
            f"{os.path.basename(self.file)} against transformers on "
            f"{os.path.basename(self.reference)}: {self.n_tokens} tokens, "
            f"{len(self.positions)} positions compared"
        )
        if prompt:
            short = prompt if len(prompt) <= 80 else prompt[:77] + "..."
            title += f"\nprompt: {short!r}"
        ax.set_title(title, fontsize=9)
        ax.legend(fontsize=7, ncol=2)
        ax.grid(True, which="both", alpha=0.3)
        fig.tight_layout()
        save(fig, path, dpi=120)


def positions_from_text(text: str, n_tokens: int, n_prompt: int) -> list[int] | None:
    """``all`` (None), ``last``, ``prompt``, ``new`` (the continuation), or a comma list of
    positions and ``a:b`` ranges (Python's slice rules; negatives count from the end)."""
    words = {
        "all": None,
        "last": [n_tokens - 1],
        "prompt": list(range(n_prompt)),
        "new": list(range(n_prompt, n_tokens)),
    }
    if text in words:
        picked = words[text]
        if picked == []:
            raise QllamaError(f"--positions {text}: there are no such positions")
        return picked
    out: list[int] = []
    try:
        for part in text.split(","):
            if ":" in part:
                a, b = part.split(":")
                out += range(n_tokens)[slice(int(a) if a else None, int(b) if b else None)]
            else:
                out.append(int(part))
    except ValueError:
        raise QllamaError(
            f"--positions {text!r}: use all, last, prompt, new, or numbers and a:b ranges"
        ) from None
    if not out:
        raise QllamaError(f"--positions {text!r} selects no position")
    return out


def trace_setting(
    path: str | os.PathLike[str],
    control_path: str | os.PathLike[str],
    ref: Trace,
    name: str,
    *,
    qkv: bool = False,
    band_factor: float = BAND_FACTOR,
    **load_options: Any,
) -> SettingTrace:
    """One setting: the file and its F32 control, each recorded and compared with ``ref``."""
    from qllama.runtime.loader import load

    s = setting(name)
    errors = {}
    for which, p in (("file", path), ("control", control_path)):
        model = load(p, backend=s.backend, arithmetic=s.arithmetic, **load_options)
        ours = record(model, ref.tokens, positions=ref.positions, qkv=qkv)
        errors[which] = compare(ours, ref)
        n_layer = model.config.n_layer
    residual = residual_names(n_layer)
    missing = [n for n in residual if n not in errors["file"] or n not in errors["control"]]
    if missing:
        raise QllamaError(f"the reference trace lacks {', '.join(missing[:3])}")
    return SettingTrace(name, errors["file"], errors["control"], residual, band_factor)


def layer_trace(
    path: str | os.PathLike[str],
    reference_path: str | os.PathLike[str],
    tokens: Sequence[int],
    *,
    settings: Sequence[str] = DEFAULT_SETTINGS,
    positions: Sequence[int] | None = None,
    qkv: bool = False,
    band_factor: float = BAND_FACTOR,
    reference: Trace | None = None,
    progress: Progress | None = None,
    **load_options: Any,
) -> TraceReport:
    """The layer trace of ``path`` under each setting against the reference.

    ``reference_path`` is the F32 GGUF: transformers runs it for the reference values (unless
    a recorded ``reference`` trace of the same tokens and positions is given) and qllama runs
    it as the F32 control. ``positions`` default to all.
    """
    for name in settings:
        setting(name)  # an unknown name fails before any work
    if reference is None:
        from qllama.measure.reference import transformers_trace

        if progress is not None:
            progress("reference: transformers")
        reference = transformers_trace(reference_path, tokens, positions=positions, qkv=qkv)
    if reference.tokens != list(tokens):
        raise QllamaError("the reference trace is of other tokens")
    if positions is not None and resolve_positions(positions, len(tokens)) != reference.positions:
        raise QllamaError("the reference trace is of other positions")
    if qkv and not any(n.endswith(".q") for n in reference):
        raise QllamaError("the reference trace was recorded without Q/K/V")
    if LOGITS not in reference.values:
        raise QllamaError("the reference trace has no logits")
    report = TraceReport(str(path), str(reference_path), len(tokens), reference.positions, qkv=qkv)
    for name in settings:
        if progress is not None:
            progress(f"setting {name}")
        report.settings[name] = trace_setting(
            path, reference_path, reference, name, qkv=qkv, band_factor=band_factor, **load_options
        )
    return report
