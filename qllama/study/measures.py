"""The measures a cell runs: registered functions of (model, reference, options) -> numbers.

A measure returns a dict of JSON values (numbers, strings, lists, dicts, None); numpy arrays
in it are kept beside the JSON (an ``.npz``), for plots and tables that need every step. A
study names its measures (``measures = ["teacher_forcing", ...]``); a name is one registered
here or an import path ``"package.module:function"`` (a function registered with
:func:`register` when its module is imported, or a plain function of the same signature).

    @register("my_measure", defaults={"k": 3}, about="what it measures")
    def my_measure(model, reference, options): ...

Measures that need the whole forward pass at every layer (a trace, an attribution) or a
corpus (perplexity) are added the same way; the cell's key includes each measure's name and
options, so adding one reruns only what it touches.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from qllama.compare import Reference, free_generation, teacher_forcing
from qllama.study.declaration import MeasureSpec, StudyError

MeasureFn = Callable[[Any, Reference, Mapping[str, Any]], dict[str, Any]]

TOP = 5  # per-step top-k kept for the cross-setting tables


@dataclass(frozen=True)
class Measure:
    """A registered measure: its function, its default options, one line about it."""

    name: str
    run: MeasureFn
    defaults: Mapping[str, Any] = field(default_factory=dict)
    about: str = ""

    def options(self, given: Mapping[str, Any]) -> dict[str, Any]:
        """The defaults overridden by ``given``; an unknown option is refused."""
        unknown = set(given) - set(self.defaults)
        if unknown:
            raise StudyError(
                f"measure {self.name!r} has no options {sorted(unknown)} "
                f"(it takes {sorted(self.defaults) or 'none'})"
            )
        return {**self.defaults, **given}


REGISTRY: dict[str, Measure] = {}


def register(
    name: str, *, defaults: Mapping[str, Any] | None = None, about: str = ""
) -> Callable[[MeasureFn], MeasureFn]:
    """Register ``fn`` as the measure ``name``."""

    def add(fn: MeasureFn) -> MeasureFn:
        if name in REGISTRY and REGISTRY[name].run is not fn:
            raise StudyError(f"a measure named {name!r} is registered already")
        REGISTRY[name] = Measure(name, fn, dict(defaults or {}), about)
        return fn

    return add


def get(name: str) -> Measure:
    """The measure ``name``: registered, or imported from ``"module:function"``."""
    if name in REGISTRY:
        return REGISTRY[name]
    module, sep, attr = name.partition(":")
    if not sep:
        raise StudyError(f"unknown measure {name!r}; registered: {', '.join(sorted(REGISTRY))}")
    try:
        fn = getattr(importlib.import_module(module), attr)
    except (ImportError, AttributeError) as e:
        raise StudyError(f"cannot import the measure {name!r}: {e}") from None
    for m in REGISTRY.values():  # importing the module registered it under its own name
        if m.run is fn:
            return m
    return Measure(name, fn)


def _plain(value: Any, where: str) -> Any:
    """``value`` as JSON data (numpy scalars become Python numbers)."""
    if isinstance(value, np.generic):
        return value.item()
    if value is None or isinstance(value, bool | int | float | str):
        return value
    if isinstance(value, Mapping):
        return {str(k): _plain(v, f"{where}.{k}") for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_plain(v, where) for v in value]
    raise StudyError(f"measure value {where} is a {type(value).__name__}, not JSON data")


def run(spec: MeasureSpec, model: Any, ref: Reference) -> tuple[dict[str, Any], dict[str, Any]]:
    """Run one measure: its numbers (JSON) and its arrays."""
    m = get(spec.name)
    out = m.run(model, ref, m.options(spec.options))
    if not isinstance(out, Mapping):
        raise StudyError(f"measure {spec.name!r} returned a {type(out).__name__}, not a dict")
    numbers = {k: v for k, v in out.items() if not isinstance(v, np.ndarray)}
    arrays = {k: v for k, v in out.items() if isinstance(v, np.ndarray)}
    return _plain(numbers, spec.name), arrays


# --- the seed study's measures -----------------------------------------------------------------


def _top(logits: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
    idx = np.argsort(-logits, axis=-1, kind="stable")[:, :k]
    return idx, np.take_along_axis(logits, idx, axis=-1)


@register("last_position", about="max |Δlogit| at the prompt's last position")
def last_position(model: Any, ref: Reference, options: Mapping[str, Any]) -> dict[str, Any]:
    from qllama.array_api import to_numpy

    logits = np.asarray(to_numpy(model.forward(ref.tokens[: ref.n_prompt], pos=0)), np.float32)
    return {"max_abs": float(np.abs(logits - ref.step_logits[0]).max())}


@register(
    "teacher_forcing",
    defaults={"top": TOP, "logits": False},
    about="the reference tokens fed one at a time: per-step max |Δ|, argmax, flips, KL",
)
def teacher_forcing_steps(model: Any, ref: Reference, options: Mapping[str, Any]) -> dict[str, Any]:
    tf = teacher_forcing(model, ref, mode="steps")
    top_ids, top_logits = _top(tf.logits, int(options["top"]))
    out: dict[str, Any] = {
        **tf.summary(),
        "max_abs": tf.max_abs,
        "argmax": tf.argmax,
        "top_ids": top_ids,
        "top_logits": top_logits,
    }
    if options["logits"]:  # every step's logits, for comparing two cells (study.compare)
        out["logits"] = tf.logits
    return out


@register("teacher_forcing_batched", about="the same in one forward pass over every position")
def teacher_forcing_batched(
    model: Any, ref: Reference, options: Mapping[str, Any]
) -> dict[str, Any]:
    tf = teacher_forcing(model, ref, mode="batched")
    return {**tf.summary(), "max_abs": tf.max_abs, "argmax": tf.argmax}


@register(
    "free_generation",
    defaults={"extra": 20},
    about="greedy decoding on its own, capped at the reference length + extra: the fork",
)
def free_generation_measure(
    model: Any, ref: Reference, options: Mapping[str, Any]
) -> dict[str, Any]:
    return free_generation(model, ref, extra=int(options["extra"])).summary()
