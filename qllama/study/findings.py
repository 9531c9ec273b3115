"""Findings: named predicates over one prompt's results, checked on every prompt and draw.

A finding is a function ``check(view) -> list[Check]`` that the study's author attaches to the
declaration (``[[finding]] check = "package.module:function"``). ``view`` is one prompt's
cells in one draw: :meth:`View.cell` gives a cell's measures, each measure's result a
dataclass (:mod:`qllama.study.results`: ``view.cell("Q8_0", "cpu").teacher_forcing.flips``),
and ``view.reference`` the reference's length, end and per-step margins. The function is run
on the base draw and on every perturbation (a cell a draw reruns replaces the base cell in that
draw's view); a check holds when it holds in every draw, so a bound is asserted against the
band, not one draw.

A check that has nothing to test (no flip to measure a margin of, a setting absent on this
prompt) says so with ``ok=None``: it is shown as n/a, neither a pass nor a failure. An
asserted finding fails the study if one of its checks fails on any prompt in any draw; a
finding that is not asserted is reported with the prompts where it fails.
"""

from __future__ import annotations

import hashlib
import importlib
import importlib.util
import math
import sys
from collections.abc import Callable, Iterable, Mapping
from dataclasses import asdict, dataclass, field
from pathlib import Path
from types import ModuleType
from typing import Any

from qllama.study.collect import Collected, ReferenceInfo
from qllama.study.declaration import FindingSpec, Study, StudyError
from qllama.study.results import Measures


@dataclass
class Check:
    """One tested claim: on ``cell``, ``metric`` is ``value``, against ``bound``."""

    cell: str
    metric: str
    value: Any  # a number, None ("never"), or a short text
    bound: str
    ok: bool | None  # None: nothing to test here
    shown: str = ""  # how the value prints; default: the value, 4 significant digits

    def text(self) -> str:
        return self.shown or fmt(self.value)


def fmt(x: Any) -> str:
    if x is None:
        return "never"
    if isinstance(x, bool):
        return str(x)
    if isinstance(x, int):
        return str(x)
    if isinstance(x, float):
        return f"{x:.4g}"
    return str(x)


class View:
    """One prompt's results in one draw, as a finding reads them."""

    def __init__(self, data: Collected, prompt: str, draw: str = "") -> None:
        self.prompt = prompt
        self.draw = draw
        p = data.prompts[prompt]
        self._cells = dict(p.cells)
        if draw:
            self._cells |= p.draws.get(draw, {})
        self.settings: list[str] = [
            s for s in data.study["settings"] if any(k.endswith("-" + s) for k in self._cells)
        ]
        self.variants: list[str] = [
            v for v in data.study["variants"] if any(k.startswith(v + "-") for k in self._cells)
        ]
        # length, eos, margin, ...: the base draw's (a draw's recomputed reference has the
        # same tokens)
        self.reference: ReferenceInfo = p.reference

    def cell(self, variant: str, setting: str) -> Measures | None:
        """The measures of cell ``variant-setting`` (None when it is not part of this prompt)."""
        c = self._cells.get(f"{variant}-{setting}")
        return None if c is None else c.measures


@dataclass
class Combined:
    """A check across draws: the base draw's value, the band, the draws where it fails."""

    cell: str
    metric: str
    bound: str
    value: Any
    shown: str
    ok: bool | None
    band: tuple[float, float] | None = None
    draws: dict[str, str] = field(default_factory=dict)  # draw -> value shown
    failing: list[str] = field(default_factory=list)  # draws where it fails

    def text(self) -> str:
        if self.band is None or fmt(self.band[0]) == fmt(self.band[1]):
            return self.shown
        return f"{self.shown} [{fmt(self.band[0])}, {fmt(self.band[1])}]"


@dataclass
class Outcome:
    """One finding on every prompt."""

    name: str
    asserted: bool
    about: str
    checks: dict[str, list[Combined]]  # prompt -> checks

    def status(self, prompt: str) -> str:
        """holds, fails or n/a (nothing to test) on ``prompt``."""
        cs = self.checks.get(prompt, [])
        if any(c.ok is False for c in cs):
            return "fails"
        return "holds" if any(c.ok for c in cs) else "n/a"

    @property
    def failed(self) -> bool:
        return any(self.status(p) == "fails" for p in self.checks)

    def prompts(self, status: str) -> list[str]:
        return [p for p in self.checks if self.status(p) == status]

    def to_dict(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "asserted": self.asserted,
            "about": self.about,
            "status": {p: self.status(p) for p in self.checks},
            "checks": {p: [asdict(c) for c in cs] for p, cs in self.checks.items()},
        }


def _module_from_file(path: Path) -> ModuleType:
    """A Python file as a module (once per file), named after its resolved path."""
    name = "qllama_study_findings_" + hashlib.sha256(str(path.resolve()).encode()).hexdigest()[:12]
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, path)
        if spec is None or spec.loader is None:
            raise ImportError(f"cannot load {path}")
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        try:
            spec.loader.exec_module(module)
        except BaseException:
            del sys.modules[name]
            raise
    return sys.modules[name]


def resolve(spec: FindingSpec, folder: Path = Path(".")) -> Callable[[View], Iterable[Check]]:
    """The finding's function: a callable, ``"file.py:function"`` (relative to the
    declaration's ``folder``) or ``"package.module:function"``."""
    if callable(spec.check):
        return spec.check
    where, sep, attr = spec.check.partition(":")
    if not sep:
        raise StudyError(
            f"finding {spec.name!r}: check must be 'module:function' or 'file.py:function'"
        )
    try:
        if where.endswith(".py"):
            path = Path(where)
            module = _module_from_file(path if path.is_absolute() else folder / path)
        else:
            module = importlib.import_module(where)
        fn: Callable[[View], Iterable[Check]] = getattr(module, attr)
    except (ImportError, AttributeError, OSError) as e:
        raise StudyError(f"finding {spec.name!r}: cannot load {spec.check!r}: {e}") from None
    return fn


def _number(x: Any) -> float | None:
    if isinstance(x, bool) or not isinstance(x, int | float):
        return None
    return float(x) if math.isfinite(x) else None


def combine(per_draw: Mapping[str, list[Check]]) -> list[Combined]:
    """The checks of every draw, matched by cell and metric (base draw first)."""
    out: dict[tuple[str, str], Combined] = {}
    values: dict[tuple[str, str], list[Any]] = {}
    for draw, checks in per_draw.items():
        for c in checks:
            k = (c.cell, c.metric)
            if k not in out:
                out[k] = Combined(c.cell, c.metric, c.bound, c.value, c.text(), c.ok)
                values[k] = []
            comb = out[k]
            values[k].append(c.value)
            if draw:
                comb.draws[draw] = c.text()
            if c.ok is False:
                comb.ok = False
                comb.failing.append(draw or "base")
            elif c.ok and comb.ok is None:
                comb.ok = True
    for k, comb in out.items():
        nums = [n for n in (_number(v) for v in values[k]) if n is not None]
        if len(nums) > 1 and len(nums) == len(values[k]):
            comb.band = (min(nums), max(nums))
    return list(out.values())


def evaluate(study: Study, data: Collected) -> list[Outcome]:
    """Every finding of ``study`` on every prompt, across the draws that ran."""
    outcomes = []
    for spec in study.findings:
        fn = resolve(spec, study.folder)
        checks = {}
        for prompt, results in data.prompts.items():
            draws = ["", *results.draws]
            per_draw = {d: list(fn(View(data, prompt, d))) for d in draws}
            checks[prompt] = combine(per_draw)
        outcomes.append(Outcome(spec.name, spec.asserted, spec.about, checks))
    return outcomes


def summary_lines(outcomes: Iterable[Outcome]) -> list[str]:
    """One line per finding (PASS, FAIL, N/A where it had nothing to test on any prompt, or
    SEEN for one that is not asserted), and one per failing check of an asserted finding."""
    lines = []
    for o in outcomes:
        n = len(o.checks)
        holds, fails, na = o.prompts("holds"), o.prompts("fails"), o.prompts("n/a")
        tag = ("FAIL" if fails else "PASS" if holds else "N/A") if o.asserted else "SEEN"
        text = f"{tag} {o.name}: holds on {len(holds)}/{n} prompts"
        if fails:
            text += f"; fails on {', '.join(fails)}"
        if na:
            text += f"; nothing to test on {', '.join(na)}"
        lines.append(text)
        if o.asserted:
            for p in fails:
                for c in o.checks[p]:
                    if c.ok is False:
                        lines.append(
                            f"    {p} [{c.cell}] {c.metric} = {c.text()} (bound: {c.bound}; "
                            f"fails in: {', '.join(c.failing)})"
                        )
    return lines
