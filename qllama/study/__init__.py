"""Studies as data: a declaration of files, arithmetics, prompts, a reference, measures,
perturbations and findings, whose cells run anywhere and are cached by content.

- :mod:`~qllama.study.declaration`: :class:`Study` and its parts; :func:`load_study` (TOML)
- :mod:`~qllama.study.cells`: the cells of a study, their ids and content keys
- :mod:`~qllama.study.measures`: the registry of measures (``register``)
- :mod:`~qllama.study.results`: what each measure returns, stored and read back
- :mod:`~qllama.study.executors`: local, process and Dask executors
- :mod:`~qllama.study.runner`: :func:`run` (what ``qllama study run`` does)
- :mod:`~qllama.study.collect`: the cached cells' results, by prompt and draw
- :mod:`~qllama.study.findings`: the findings, checked on every prompt and draw
- :mod:`~qllama.study.report` and :mod:`~qllama.study.plots`: the report and its plots

See docs/studies.md; experiments/seed.toml is the worked example.
"""

from __future__ import annotations

from qllama.study.declaration import (
    Compare,
    Draw,
    FindingSpec,
    MeasureSpec,
    Prompt,
    ReferenceSpec,
    Setting,
    Study,
    StudyError,
    Variant,
    load_study,
)
from qllama.study.findings import Check, View
from qllama.study.measures import register
from qllama.study.runner import Options, run

__all__ = [
    "Check",
    "Compare",
    "Draw",
    "FindingSpec",
    "MeasureSpec",
    "Options",
    "Prompt",
    "ReferenceSpec",
    "Setting",
    "Study",
    "StudyError",
    "Variant",
    "View",
    "load_study",
    "register",
    "run",
]
