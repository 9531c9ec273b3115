"""A study as data: the model, its variants, the arithmetics, the prompts, the reference, the
measures, the perturbations that give the noise band, and the findings.

A :class:`Study` is read from a TOML file (:func:`load_study`) or built from these dataclasses
in Python; both give the same objects, checked the same way. Nothing here runs a model: the
cells are the product of the declaration (:mod:`qllama.study.cells`), and running them is the
executors' job. docs/studies.md describes every field; experiments/seed.toml is the worked
example.
"""

from __future__ import annotations

import fnmatch
import json
import re
import sys
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, fields, replace
from pathlib import Path
from typing import Any

from qllama.errors import QllamaError

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - Python 3.10
    import tomli as tomllib


class StudyError(QllamaError):
    """A study declaration is malformed, or a cell of it cannot be run as declared."""


ENGINES = ("qllama", "llama.cpp")  # who computes a cell: qllama on a backend, or a peer
REFERENCE_KINDS = ("transformers", "qllama", "saved")


@dataclass(frozen=True)
class Variant:
    """One file of the study, built from the model source by qllama's own quantizer.

    ``type`` is a file type (``F32``, ``Q8_0``, ``Q4_K_M``...; ``F32`` is the source
    dequantized, every other type is quantized from that F32 file, as llama-quantize would) or
    ``source`` (the source file as it is). ``imatrix`` names an importance-matrix file (GGUF or
    legacy ``.dat``; a relative path is the declaration folder's) and ``imatrix_corpus`` a text
    to compute one from (``corpus:botchan`` or a file), at most ``imatrix_chunks`` windows of
    it after the first ``imatrix_skip_chunks`` (llama-imatrix ``--chunk``: calibrate on a part
    of a corpus that a corpus measure does not score): the type is then quantized with it as
    llama-quantize ``--imatrix`` does, and the matrix's hash is part of the file's name.
    ``tensor_types`` are llama-quantize ``--tensor-type`` overrides (``NAME=TYPE``, as
    :meth:`qllama.gguf.quantizer.Overrides.parse` reads them), a recipe's per-tensor choices
    over the type's mixture; their hash is part of the file's name too. ``file`` names a file
    already made that way (a recipe's, which ``qllama recipe`` wrote; a relative path is the
    declaration folder's): it is measured as it is, not built again.
    """

    type: str
    name: str = ""
    imatrix: str | None = None
    imatrix_corpus: str | None = None
    imatrix_chunks: int | None = None  # of imatrix_corpus, 512 tokens each (default: all)
    imatrix_skip_chunks: int = 0  # of imatrix_corpus, skipped first
    tensor_types: tuple[str, ...] = ()
    file: str | None = None

    def __post_init__(self) -> None:
        if not self.name:
            object.__setattr__(self, "name", self.type)


@dataclass(frozen=True)
class Setting:
    """An arithmetic: which engine computes the cell, on which backend, with which options.

    ``prompts`` limits the setting to those prompts (an expensive extra column on the main
    prompt only) and ``variants`` to those variants; empty means every one. ``memory_mb`` is
    what a Dask task of it declares (default: estimated from the file's size).
    """

    name: str
    backend: str = "numpy"
    options: Mapping[str, Any] = field(default_factory=dict)
    engine: str = "qllama"
    about: str = ""
    prompts: tuple[str, ...] = ()
    variants: tuple[str, ...] = ()
    memory_mb: int | None = None


@dataclass(frozen=True)
class Prompt:
    """A prompt: a chat turn (``chat = true``: the file's template around ``text``, or
    ``messages`` as they are) or raw text; the reference decodes at most ``max_new_tokens``."""

    name: str
    text: str = ""
    messages: tuple[Mapping[str, str], ...] = ()
    chat: bool = True
    max_new_tokens: int = 300


@dataclass(frozen=True)
class ReferenceSpec:
    """What the cells are compared with.

    ``transformers``: transformers f32 (eager, CPU) reading ``variant`` (the F32 file), greedy to
    the end of turn or ``max_new_tokens``, then the logits of every position. ``qllama``: the same
    from qllama itself on ``variant`` with ``backend`` and ``options`` (default: numpy, every weight
    dequantized to f32). ``saved``: ``paths`` maps prompt names to ``.npz`` files written by
    :meth:`qllama.measure.compare.Reference.save`. ``threads`` (None: the library's default) is part
    of the reference's provenance.
    """

    kind: str = "transformers"
    variant: str = "F32"
    backend: str = "numpy"
    options: Mapping[str, Any] = field(default_factory=lambda: {"dequantize_all": True})
    paths: Mapping[str, str] = field(default_factory=dict)
    threads: int | None = None


@dataclass(frozen=True)
class Draw:
    """A deliberate perturbation of summation order: one more draw of the cells it applies to.

    The CPU arithmetic rounds every activation to 8 bits, so a float32 difference of one ulp
    before the rounding (another BLAS kernel, another reduction order) can move an integer by
    one step, and the logits by a few tenths. Each draw reruns the cells of ``settings`` (and
    ``variants``; empty: all) with ``env`` set in a fresh process before anything is imported
    (``OPENBLAS_CORETYPE`` picks the kernels of another CPU), with the reference's logits
    recomputed under ``reference_env``, on another ``engine`` (llama.cpp: one more faithful
    CPU arithmetic), or with extra backend ``options``. The spread over the draws is the
    band each number of those cells is reported with; the findings must hold in every draw.
    ``optional`` draws run only when asked for (``--draw NAME``).
    """

    name: str
    settings: tuple[str, ...]
    variants: tuple[str, ...] = ()
    env: Mapping[str, str] = field(default_factory=dict)
    reference_env: Mapping[str, str] = field(default_factory=dict)
    engine: str | None = None
    options: Mapping[str, Any] = field(default_factory=dict)
    optional: bool = False
    about: str = ""


@dataclass(frozen=True)
class FindingSpec:
    """A named predicate over one prompt's results (``check``: a callable, or its import path
    ``"package.module:function"``). An asserted finding must hold on every prompt and in every
    draw; one that is not asserted is reported with the prompts where it fails."""

    name: str
    check: str | Callable[..., Any]
    asserted: bool = True
    about: str = ""


@dataclass(frozen=True)
class MeasureSpec:
    """A registered measure (:mod:`qllama.study.measures`) and its options. ``cells`` limits
    it to the cells whose id matches one of its patterns (``"*/Q8_0-cpu"``: the base draw of
    that cell on every prompt); empty means every cell."""

    name: str
    options: Mapping[str, Any] = field(default_factory=dict)
    cells: tuple[str, ...] = ()

    def applies(self, cell_id: str) -> bool:
        """Whether the measure runs in the cell ``cell_id``."""
        return not self.cells or any(fnmatch.fnmatchcase(cell_id, p) for p in self.cells)


@dataclass(frozen=True)
class Compare:
    """Two cells (``variant-setting``, optionally ``~draw``) whose teacher-forced logits are
    compared with each other in the report: the activation rounding alone is ``Q8_0-cpu``
    against ``Q8_0-dequantize-all``. Both cells keep every step's logits (4 bytes times the
    vocabulary per step), so ``prompts`` (empty: all) can limit the pair to a few prompts."""

    a: str
    b: str
    prompts: tuple[str, ...] = ()


@dataclass(frozen=True)
class Study:
    """A whole study. ``model`` is a name ``qllama fetch`` knows or a GGUF path (relative
    paths are relative to the declaration's folder); ``threads`` is every cell's thread count
    (BLAS, torch, numba), part of each cell's key since a thread count can change float order."""

    name: str
    model: str
    variants: tuple[Variant, ...]
    settings: tuple[Setting, ...]
    prompts: tuple[Prompt, ...]
    measures: tuple[MeasureSpec, ...]
    reference: ReferenceSpec = field(default_factory=ReferenceSpec)
    draws: tuple[Draw, ...] = ()
    findings: tuple[FindingSpec, ...] = ()
    cross: tuple[tuple[str, str], ...] = ()
    compare: tuple[Compare, ...] = ()
    threads: int = 1
    title: str = ""
    folder: Path = Path(".")
    # prompts of the declaration that this run leaves out (``with_prompts``); the rest of the
    # declaration may still name them
    skipped_prompts: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        check(self)

    def variant(self, name: str) -> Variant:
        return _by_name(self.variants, name, "variant")

    def setting(self, name: str) -> Setting:
        return _by_name(self.settings, name, "setting")

    def prompt(self, name: str) -> Prompt:
        return _by_name(self.prompts, name, "prompt")

    def draw(self, name: str) -> Draw:
        return _by_name(self.draws, name, "draw")

    def model_source(self) -> str | Path:
        """The model as a known name, or the path of a GGUF file."""
        from qllama.model_files import MODELS

        if self.model in MODELS:
            return self.model
        path = Path(self.model)
        return path if path.is_absolute() else self.folder / path


def _by_name(items: Sequence[Any], name: str, what: str) -> Any:
    for item in items:
        if item.name == name:
            return item
    known = ", ".join(i.name for i in items) or "none"
    raise StudyError(f"no {what} named {name!r} (declared: {known})")


# --- checks ------------------------------------------------------------------------------------


def _unique(items: Sequence[Any], what: str) -> None:
    """Names are unique; those that make up cell ids hold no ``/``, ``~`` or space."""
    seen: set[str] = set()
    for item in items:
        in_ids = what != "finding"
        if not item.name or (in_ids and any(c in item.name for c in "/~ ")):
            raise StudyError(f"{what} name {item.name!r} must be non-empty, without '/', '~', ' '")
        if item.name in seen:
            raise StudyError(f"two {what}s are named {item.name!r}")
        seen.add(item.name)


def check(study: Study) -> None:
    """Refuse a declaration that cannot be run, naming the field."""
    for what, items in (
        ("variant", study.variants),
        ("setting", study.settings),
        ("prompt", study.prompts),
        ("draw", study.draws),
        ("finding", study.findings),
    ):
        if what in ("variant", "setting", "prompt") and not items:
            raise StudyError(f"the study declares no {what}")
        _unique(items, what)
    if not study.measures:
        raise StudyError("the study declares no measure")
    _types(study)
    if study.threads < 1:
        raise StudyError(f"threads must be at least 1, not {study.threads}")
    prompts = {p.name for p in study.prompts}
    declared = prompts | set(study.skipped_prompts)  # the names the declaration may use
    settings = {s.name for s in study.settings}
    variants = {v.name for v in study.variants}
    for p in study.prompts:
        if bool(p.text) == bool(p.messages):
            raise StudyError(f"prompt {p.name!r}: give either text or messages")
        if p.messages and not p.chat:
            raise StudyError(f"prompt {p.name!r}: messages need chat = true")
        if p.max_new_tokens < 1:
            raise StudyError(f"prompt {p.name!r}: max_new_tokens must be at least 1")
    for s in study.settings:
        if s.engine not in ENGINES:
            raise StudyError(f"setting {s.name!r}: engine must be one of {ENGINES}")
        _known(s.prompts, declared, f"setting {s.name!r}", "prompt")
        _known(s.variants, variants, f"setting {s.name!r}", "variant")
        _options(s.engine, s.backend, s.options, f"setting {s.name!r}")
    for v in study.variants:
        _file_type(v)
    ref = study.reference
    if ref.kind not in REFERENCE_KINDS:
        raise StudyError(f"reference kind must be one of {REFERENCE_KINDS}, not {ref.kind!r}")
    if ref.kind == "saved":
        _known(tuple(ref.paths), declared, "reference paths", "prompt")
        missing = prompts - set(ref.paths)
        if missing:
            raise StudyError(f"a saved reference needs a path for every prompt: {sorted(missing)}")
    elif ref.variant not in variants:
        raise StudyError(f"reference variant {ref.variant!r} is not a declared variant")
    for d in study.draws:
        if not d.settings:
            raise StudyError(f"draw {d.name!r} applies to no setting")
        _known(d.settings, settings, f"draw {d.name!r}", "setting")
        _known(d.variants, variants, f"draw {d.name!r}", "variant")
        if d.engine is not None and d.engine not in ENGINES:
            raise StudyError(f"draw {d.name!r}: engine must be one of {ENGINES}")
        if d.reference_env and ref.kind == "saved":
            raise StudyError(f"draw {d.name!r}: a saved reference cannot be recomputed")
        for s in study.settings:
            if d.options and s.name in d.settings:
                engine = d.engine or s.engine
                where = f"draw {d.name!r} (on setting {s.name!r})"
                _options(engine, s.backend, {**s.options, **d.options}, where)
    if ref.kind == "qllama":
        _options("qllama", ref.backend, ref.options, "reference")
    for a, b in study.cross:
        _known((a,), settings, "cross pair", "setting")
        if b != "reference":
            _known((b,), settings, "cross pair", "setting")
    draws = {d.name for d in study.draws}
    for c in study.compare:
        _known(c.prompts, declared, "compare pair", "prompt")
        for side in (c.a, c.b):
            label, _, draw = side.partition("~")
            if not any(label == f"{v}-{s}" for v in variants for s in settings):
                raise StudyError(f"compare names {side!r}, not a declared variant-setting")
            _known((draw,) if draw else (), draws, f"compare {side!r}", "draw")
    _measure_cells(study)
    for v in study.variants:
        if v.imatrix and v.imatrix_corpus:
            raise StudyError(f"variant {v.name!r}: give an imatrix or a corpus, not both")
        if v.imatrix_chunks is not None and (not v.imatrix_corpus or v.imatrix_chunks < 1):
            raise StudyError(f"variant {v.name!r}: imatrix_chunks is a positive count of a corpus")
        if v.imatrix_skip_chunks and (not v.imatrix_corpus or v.imatrix_skip_chunks < 0):
            raise StudyError(f"variant {v.name!r}: imatrix_skip_chunks is a count of a corpus")
        if v.tensor_types:
            _tensor_types(v)


def _options(engine: str, backend: str, options: Mapping[str, Any], where: str) -> None:
    """A qllama setting's backend and options, checked as ``qllama.load`` would check them
    (a llama.cpp setting's go to llama-cpp-python, which checks them where it runs)."""
    if engine != "qllama":
        return
    from qllama.errors import BackendError
    from qllama.runtime.loader import check_options

    try:
        check_options(backend, options)
    except BackendError as e:
        raise StudyError(f"{where}: {e}") from None


def _file_type(v: Variant) -> None:
    from qllama.gguf.quantizer import FILE_TYPES

    if v.type != "source" and v.type.upper() not in FILE_TYPES:
        raise StudyError(
            f"variant {v.name!r}: type {v.type!r} is not a file type qllama's quantizer makes "
            f"(nor 'source'); known: {', '.join(FILE_TYPES)}"
        )


def _tensor_types(v: Variant) -> None:
    from qllama.errors import QllamaError
    from qllama.gguf.quantizer import Overrides

    if v.type in ("source", "F32"):
        raise StudyError(f"variant {v.name!r}: tensor_types need a quantized type")
    try:
        Overrides.parse(list(v.tensor_types))
    except QllamaError as e:
        raise StudyError(f"variant {v.name!r}: {e}") from None


def _measure_cells(study: Study) -> None:
    """Each measure's ``cells`` patterns match a cell (of any draw, optional ones included:
    they are switched on by name at run time); one cell has each measure name once."""
    cells = product(study, optional=True)
    seen: set[tuple[str, str]] = set()
    for m in study.measures:
        for pattern in m.cells:
            head = pattern.partition("/")[0]
            if any(fnmatch.fnmatchcase(p, head) for p in study.skipped_prompts):
                continue  # it may name cells of a prompt this run leaves out
            if not any(fnmatch.fnmatchcase(c.id, pattern) for c in cells):
                raise StudyError(
                    f"measure {m.name!r}: cells {pattern!r} matches no cell "
                    f"(cells look like {cells[0].id})"
                )
        for c in (c for c in cells if m.applies(c.id)):
            if (c.id, m.name) in seen:
                raise StudyError(f"measure {m.name!r} is declared twice for the cell {c.id}")
            seen.add((c.id, m.name))


# --- the grid of cells -----------------------------------------------------------------------


@dataclass(frozen=True)
class Cell:
    """One cell of a study (names only; :func:`plan` in the runner attaches files and keys)."""

    prompt: str
    variant: str
    setting: str
    draw: str = ""  # "" is the base draw

    @property
    def label(self) -> str:
        """``variant-setting``: the cell within its prompt and draw."""
        return f"{self.variant}-{self.setting}"

    @property
    def id(self) -> str:
        return f"{self.prompt}/{self.label}" + (f"~{self.draw}" if self.draw else "")


def _within(limit: tuple[str, ...], name: str) -> bool:
    """Whether a declaration's ``prompts`` or ``variants`` (empty: every one) admit ``name``."""
    return not limit or name in limit


def applies(draw: Draw, variant: str, setting: str) -> bool:
    """Whether ``draw`` reruns the cells of ``variant`` and ``setting``."""
    return setting in draw.settings and _within(draw.variants, variant)


def product(study: Study, *, optional: bool = False) -> list[Cell]:
    """Every cell, prompt by prompt: the base draw, then each draw that is switched on (and
    with ``optional``, the cells of the optional draws too)."""
    out = []
    draws = [d for d in study.draws if optional or not d.optional]
    for p in study.prompts:
        for v in study.variants:
            for s in study.settings:
                if not (_within(s.prompts, p.name) and _within(s.variants, v.name)):
                    continue
                out.append(Cell(p.name, v.name, s.name))
                out += [
                    Cell(p.name, v.name, s.name, d.name)
                    for d in draws
                    if applies(d, v.name, s.name)
                ]
    return out


def _types(study: Study) -> None:
    """The scalar fields have their types (TOML gives any type anywhere)."""
    wanted: list[tuple[str, Any, type | tuple[type, ...]]] = [("threads", study.threads, int)]
    for p in study.prompts:
        wanted += [
            (f"prompt {p.name!r}: text", p.text, str),
            (f"prompt {p.name!r}: chat", p.chat, bool),
            (f"prompt {p.name!r}: max_new_tokens", p.max_new_tokens, int),
        ]
    for s in study.settings:
        wanted += [(f"setting {s.name!r}: options", s.options, Mapping)]
    for d in study.draws:
        wanted += [(f"draw {d.name!r}: env", d.env, Mapping)]
        wanted += [
            (f"draw {d.name!r}: {k}", v, str) for k, v in {**d.env, **d.reference_env}.items()
        ]
    for where, value, kind in wanted:
        if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
            raise StudyError(f"{where} must be {getattr(kind, '__name__', kind)}, not {value!r}")


def _known(names: Sequence[str], known: set[str], where: str, what: str) -> None:
    for n in names:
        if n not in known:
            raise StudyError(f"{where} names the {what} {n!r}, which the study does not declare")


# --- TOML --------------------------------------------------------------------------------------

_TOP = {
    "name",
    "title",
    "model",
    "threads",
    "measures",
    "variant",
    "setting",
    "prompt",
    "reference",
    "draw",
    "finding",
    "cross",
    "compare",
}


def _strict(cls: type, table: Mapping[str, Any], where: str, **renames: str) -> dict[str, Any]:
    """``table`` as keyword arguments of ``cls``, refusing keys it does not have."""
    names = {f.name for f in fields(cls)} - {"folder"}
    out: dict[str, Any] = {}
    for key, value in table.items():
        attr = renames.get(key, key)
        if attr not in names:
            raise StudyError(f"{where}: unknown key {key!r} (known: {', '.join(sorted(names))})")
        out[attr] = tuple(value) if isinstance(value, list) and attr != "messages" else value
    return out


def _table(value: Any, where: str) -> Mapping[str, Any]:
    if not isinstance(value, Mapping):
        raise StudyError(f"{where} must be a table")
    return value


def _items(doc: Mapping[str, Any], key: str) -> list[Mapping[str, Any]]:
    value = doc.get(key, [])
    if not isinstance(value, list):
        raise StudyError(f"[[{key}]] must be an array of tables")
    return [_table(v, f"[[{key}]] #{i + 1}") for i, v in enumerate(value)]


def _measures(value: Any) -> tuple[MeasureSpec, ...]:
    """``measures = ["a", "b"]`` or ``[[measures]] name = "a" options = {...}``."""
    if not isinstance(value, list):
        raise StudyError("measures must be a list of names or of tables")
    out = []
    for i, m in enumerate(value):
        if isinstance(m, str):
            out.append(MeasureSpec(m))
        else:
            out.append(MeasureSpec(**_strict(MeasureSpec, _table(m, f"measures #{i + 1}"), "")))
    return tuple(out)


def from_dict(doc: Mapping[str, Any], folder: Path = Path(".")) -> Study:
    """A study from the parsed TOML document (see docs/studies.md for the keys)."""
    for key in doc:
        if key not in _TOP:
            raise StudyError(f"unknown top-level key {key!r} (known: {', '.join(sorted(_TOP))})")
    for key in ("name", "model"):
        if not isinstance(doc.get(key), str):
            raise StudyError(f'the study needs {key} = "..."')
    prompts = []
    for i, t in enumerate(_items(doc, "prompt")):
        kw = _strict(Prompt, t, f"[[prompt]] #{i + 1}")
        kw["messages"] = tuple(dict(m) for m in kw.get("messages", ()))
        prompts.append(Prompt(**kw))
    findings = [
        FindingSpec(**_strict(FindingSpec, t, f"[[finding]] #{i + 1}", **{"assert": "asserted"}))
        for i, t in enumerate(_items(doc, "finding"))
    ]
    cross = []
    for i, t in enumerate(_items(doc, "cross")):
        pair = t.get("pair")
        if not (isinstance(pair, list) and len(pair) == 2) or set(t) != {"pair"}:
            raise StudyError(f'[[cross]] #{i + 1} must be pair = ["a", "b"]')
        cross.append((str(pair[0]), str(pair[1])))
    return Study(
        name=doc["name"],
        title=str(doc.get("title", "")),
        model=doc["model"],
        threads=doc.get("threads", 1),
        measures=_measures(doc.get("measures", [])),
        variants=tuple(
            _variant(_strict(Variant, t, f"[[variant]] #{i + 1}"), folder)
            for i, t in enumerate(_items(doc, "variant"))
        ),
        settings=tuple(
            Setting(**_strict(Setting, t, f"[[setting]] #{i + 1}"))
            for i, t in enumerate(_items(doc, "setting"))
        ),
        prompts=tuple(prompts),
        reference=ReferenceSpec(
            **_strict(ReferenceSpec, _table(doc.get("reference", {}), "[reference]"), "[reference]")
        ),
        draws=tuple(
            Draw(**_strict(Draw, t, f"[[draw]] #{i + 1}"))
            for i, t in enumerate(_items(doc, "draw"))
        ),
        findings=tuple(findings),
        cross=tuple(cross),
        compare=tuple(
            Compare(**_strict(Compare, t, f"[[compare]] #{i + 1}"))
            for i, t in enumerate(_items(doc, "compare"))
        ),
        folder=folder,
    )


def _variant(kw: dict[str, Any], folder: Path) -> Variant:
    """A variant, its imatrix file, corpus file or own file relative to the declaration's
    folder."""
    for key in ("imatrix", "file"):
        if kw.get(key) and not Path(kw[key]).is_absolute():
            kw[key] = str(folder / kw[key])
    corpus = kw.get("imatrix_corpus")
    if corpus and not corpus.startswith("corpus:") and not Path(corpus).is_absolute():
        kw["imatrix_corpus"] = str(folder / corpus)
    if "tensor_types" in kw:
        kw["tensor_types"] = tuple(kw["tensor_types"])  # a TOML array: the frozen field's tuple
    return Variant(**kw)


def toml_value(v: Any) -> str:
    """One TOML value: a string (JSON's escapes are TOML's), number, boolean, array or inline
    table."""
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, Mapping):
        return "{ " + toml_inline(v) + " }" if v else "{}"
    if isinstance(v, list | tuple):
        return "[" + ", ".join(toml_value(x) for x in v) + "]"
    if isinstance(v, str | int | float):
        return json.dumps(v)
    raise StudyError(f"{v!r} has no TOML form")


def toml_inline(options: Mapping[str, Any]) -> str:
    """Options as a declaration writes them: ``activations = "f32", dequantize_all = true``."""
    return ", ".join(f"{k} = {toml_value(v)}" for k, v in options.items())


# the TOML keys of the declaration's tables, where they differ from the fields' names
_TOML_KEYS = {"asserted": "assert"}


def _toml_fields(item: Any) -> list[str]:
    """``key = value`` lines of a declaration's dataclass: the fields that differ from their
    defaults."""
    lines = []
    for f in fields(item):
        value = getattr(item, f.name)
        default = f.default_factory() if callable(f.default_factory) else f.default
        if (
            f.name == "folder"
            or value == default
            or (f.name == "name" and value == getattr(item, "type", None))
        ):
            continue
        if callable(value):
            raise StudyError(f"{type(item).__name__} {f.name}: a callable has no TOML form")
        lines.append(f"{_TOML_KEYS.get(f.name, f.name)} = {toml_value(value)}")
    return lines


def to_toml(study: Study) -> str:
    """The declaration as TOML that :func:`load_study` reads back into the same study (its
    findings' checks given as import paths)."""
    out = [f"name = {toml_value(study.name)}", f"model = {toml_value(study.model)}"]
    if study.title:
        out.append(f"title = {toml_value(study.title)}")
    out.append(f"threads = {study.threads}")
    specs = [
        m.name
        if not m.options and not m.cells
        else {
            "name": m.name,
            **{k: v for k, v in (("options", dict(m.options)), ("cells", list(m.cells))) if v},
        }
        for m in study.measures
    ]
    out.append("measures = [\n" + "".join(f"    {toml_value(m)},\n" for m in specs) + "]")
    reference = _toml_fields(study.reference)
    if reference:
        out += ["", "[reference]", *reference]
    for table, items in (
        ("variant", study.variants),
        ("setting", study.settings),
        ("prompt", study.prompts),
        ("draw", study.draws),
        ("finding", study.findings),
        ("compare", study.compare),
    ):
        for item in items:
            out += ["", f"[[{table}]]", *_toml_fields(item)]
    for a, b in study.cross:
        out += ["", "[[cross]]", f"pair = {toml_value([a, b])}"]
    return "\n".join(out) + "\n"


# how check() and from_dict() name a place: "setting 'cpu': ..." or "[[setting]] #2: ..."
_NAMED = re.compile(r"^(variant|setting|prompt|draw|finding|compare) '([^']*)'")
_NUMBERED = re.compile(r"^\[\[(\w+)\]\] #(\d+)")


def toml_line(text: str, message: str) -> int | None:
    """The line of the study's TOML that an error ``message`` is about: in the table the
    message names, the line of the last key it names (a key of an inline table too), else the
    table's header (None: no table found)."""
    lines = text.splitlines()
    place = _NAMED.match(message) or _NUMBERED.match(message)
    if place is None:  # a top-level key: the line that sets the key it quotes
        for word in re.findall(r"'(\w+)'", message):
            j = next((j for j, line in enumerate(lines) if re.match(rf"{word}\s*=", line)), None)
            if j is not None:
                return j + 1
        return None
    header = f"[[{place.group(1)}]]"
    starts = [i for i, line in enumerate(lines) if line.strip() == header]
    ends = [*starts[1:], len(lines)]
    blocks = [
        range(a, next((j for j in range(a + 1, b) if lines[j].lstrip().startswith("[")), b))
        for a, b in zip(starts, ends, strict=True)
    ]
    if place.re is _NUMBERED:
        k = int(place.group(2)) - 1
        block = blocks[k] if 0 <= k < len(blocks) else None
    else:
        name = re.compile(rf"^\s*(name|type)\s*=\s*[\"']{re.escape(place.group(2))}[\"']")
        block = next((b for b in blocks if any(name.match(lines[j]) for j in b)), None)
    if block is None:
        return None
    # the key an error is about is the last one it names before the alternatives it lists
    rest = re.split(r"known:|available:|one of|it takes", message[place.end() :])[0]
    for word in reversed(re.findall(r"\w+", rest)):
        key = re.compile(rf"(^|[\s{{,]){re.escape(word)}\s*=")
        for j in block:
            if key.search(lines[j]):
                return j + 1
    return block.start + 1


def load_study(path: str | Path) -> Study:
    """Read a study from a TOML file, every key checked (an error names the file and the
    line it is about)."""
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
        doc = tomllib.loads(text)
    except OSError as e:
        raise StudyError(f"cannot read the study {path}: {e.strerror or e}") from None
    except tomllib.TOMLDecodeError as e:
        raise StudyError(f"{path} is not valid TOML: {e}") from None
    except TypeError as e:  # a value of the wrong type for its field
        raise StudyError(f"{path}: {e}") from None
    try:
        return from_dict(doc, folder=path.parent)
    except TypeError as e:
        raise StudyError(f"{path}: {e}") from None
    except StudyError as e:
        line = toml_line(text, str(e))
        raise StudyError(f"{path}{f':{line}' if line else ''}: {e}") from None


def with_prompts(study: Study, names: Sequence[str]) -> Study:
    """The study on the prompts ``names`` only (none: all of them): their references, cells
    and findings; the other prompts are recorded as left out (``skipped_prompts``)."""
    if not names:
        return study
    for n in names:
        study.prompt(n)
    kept = tuple(p for p in study.prompts if p.name in names)
    left = tuple(p.name for p in study.prompts if p.name not in names)
    return replace(study, prompts=kept, skipped_prompts=study.skipped_prompts + left)


def with_draws(study: Study, names: Sequence[str]) -> Study:
    """The study with the optional draws ``names`` switched on (the others stay off)."""
    for n in names:
        study.draw(n)
    draws = tuple(replace(d, optional=False) if d.name in names else d for d in study.draws)
    return replace(study, draws=draws)
