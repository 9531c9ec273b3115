"""What each measure returns, and the one place it is stored as and read back from.

Every measure of :mod:`qllama.study.measures` returns a frozen dataclass defined here (a
measure of a study's own may return one of its own, or a plain dict). :func:`encode` turns a
result into what the cell cache keeps: its numbers as JSON (the cell's ``.json``, under
``measures``) and its arrays (the cell's ``.npz``, as ``measure.field``); :func:`decode` reads
them back into the dataclass. The stored form is each dataclass's fields in order, nested
dataclasses as objects, tuples as lists; a field whose metadata has :data:`INLINE` is stored
as its own fields beside the others; an array field (``np.ndarray | None``) goes to the
``.npz``, and is None where the measure did not keep it and in a result read from
``results.json``, which holds no arrays. Nothing is converted on the way (no float is
rounded), so a result read back is stored again bit for bit.

:class:`Measures` holds one cell's results by measure name, with an attribute for each of the
measures of :mod:`qllama.study.measures` (``cell.teacher_forcing.median_max_abs``).
"""

from __future__ import annotations

import dataclasses
import types
import typing
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any, TypeVar

import numpy as np

from qllama.measure.metrics import KLStats
from qllama.measure.routing import RoutingReport
from qllama.measure.trace import PointErrors
from qllama.study.declaration import StudyError

R = TypeVar("R")
# a nested dataclass field with this in its metadata is stored as its own fields beside the
# outer one's (the corpus measure's KL statistics beside its perplexity, as llama-perplexity
# prints them): ``field(metadata={INLINE: True})``
INLINE = "qllama.study.inline"


# --- the seed study's measures ------------------------------------------------------------------


@dataclass(frozen=True)
class LastPosition:
    """``last_position``: the logits that pick the first new token, against the reference's."""

    max_abs: float  # max |Δlogit| over the vocabulary at the prompt's last position


@dataclass(frozen=True)
class Flip:
    """A teacher-forcing step whose argmax differs from the reference's."""

    step: int  # the step (0: the prompt's last position)
    ref_margin: float  # the reference's top-1 minus top-2 logit there
    ref_token: int  # the reference's argmax there
    token: int  # the cell's argmax there


@dataclass(frozen=True)
class TeacherForcing:
    """``teacher_forcing`` (``mode`` "steps": the prompt, then the reference's tokens one at a
    time) and ``teacher_forcing_batched`` ("batched": every position in one forward pass):
    step s predicts the reference's token s, so a flip never propagates."""

    mode: str  # "steps" or "batched"
    steps: int  # the reference's new tokens, one step each
    step0_max_abs: float  # max |Δlogit| at step 0 (the prompt's last position)
    median_max_abs: float  # median over the steps of the step's max |Δlogit|
    max_max_abs: float  # the largest step's max |Δlogit|
    argmax_agree: int  # steps whose argmax is the reference's
    first_flip: int | None  # the first step whose argmax differs (None: never)
    flips: tuple[Flip, ...]  # every such step
    kl: KLStats  # llama-perplexity's KL statistics over the steps, the reference as base
    # the arrays (the .npz): (steps,) each step's max |Δlogit| and the cell's argmax; (steps,
    # top) the cell's top tokens and their logits ("steps" only); (steps, vocab) every logit
    # (the option ``logits``, for the compared pairs)
    max_abs: np.ndarray | None = field(default=None, compare=False, repr=False)
    argmax: np.ndarray | None = field(default=None, compare=False, repr=False)
    top_ids: np.ndarray | None = field(default=None, compare=False, repr=False)
    top_logits: np.ndarray | None = field(default=None, compare=False, repr=False)
    logits: np.ndarray | None = field(default=None, compare=False, repr=False)


@dataclass(frozen=True)
class FreeGeneration:
    """``free_generation``: the cell decodes greedily on its own, capped at the reference's
    length + the option ``extra``, and where it leaves the reference."""

    length: int  # tokens generated (end of turn included)
    eos: bool  # whether it ended by end of turn, not by the cap
    fork: int | None  # the first generated token that differs from the reference's
    # the text around the fork: "prefix" (12 tokens before it), "reference" and "own" (the
    # 12 from it on each side); empty when it never forks
    context: dict[str, str]
    tokens: tuple[int, ...]  # the generated tokens


# --- where the drift enters ----------------------------------------------------------------------


@dataclass(frozen=True)
class Scores:
    """One variant of an attribution against the reference, over the teacher-forced steps
    (:class:`qllama.measure.attribution.Measure`)."""

    mean_kld: float
    median_max_abs: float  # median over the steps of max |Δlogit|
    max_max_abs: float
    same_top: float  # fraction of the steps whose argmax agrees


@dataclass(frozen=True)
class Excess:
    """Numbers above the attribution's baseline."""

    mean_kld: float
    median_max_abs: float


@dataclass(frozen=True)
class Part:
    """One group of tensors with its cause switched on alone: its scores and their excess."""

    group: str  # a tensor class (attn_q ... output), a layer or a tensor (option ``by``)
    tensors: tuple[str, ...]  # the group's tensors
    mean_kld: float
    median_max_abs: float
    max_max_abs: float
    same_top: float
    excess_mean_kld: float  # mean_kld minus the baseline's
    excess_median_max_abs: float


@dataclass(frozen=True)
class Attribution:
    """``attribution``: the cell's error split by group of tensors, one group's cause switched
    on at a time (:func:`qllama.measure.attribution.attribute`)."""

    kind: str  # "activations" (the activation rounding) or "weights" (the file's weights)
    by: str  # "class", "layer" or "tensor"
    arithmetic: str  # the arithmetic of what is not switched on
    steps: int  # teacher-forced steps
    baseline: Scores  # the cause switched off everywhere
    whole: Scores  # on everywhere: the cell's own arithmetic
    whole_excess: Excess  # the whole above the baseline
    sum_of_parts: Excess  # the parts' excesses added up
    parts: tuple[Part, ...]  # largest excess mean KLD first


@dataclass(frozen=True)
class LayerTrace:
    """``layer_trace``: every traced value of the cell at every position against the F32
    variant's run by the measure's ``reference`` (:func:`qllama.measure.trace.compare`)."""

    residual: tuple[str, ...]  # the residual stream's points, "embedding" to "logits"
    errors: dict[str, PointErrors]  # every traced point's errors, by name


@dataclass(frozen=True)
class Corpus:
    """``corpus``: llama-perplexity's numbers of the cell over windows of a corpus, against
    the base the F32 variant wrote (:func:`qllama.measure.perplexity.measure`)."""

    kl: KLStats = field(
        metadata={INLINE: True}
    )  # KL, Δp, same top and PPL(base) statistics, stored beside ppl
    ppl: float  # the cell's perplexity over the scored positions
    ppl_unc: float  # its standard error, llama-perplexity's
    tokens: int  # scored positions (the second half of each window)
    windows: int
    n_ctx: int  # tokens per window
    base_format: str  # how the base stores its logits: "f32" or "llama" (uint16 log-probs)


# --- storing and reading -------------------------------------------------------------------------


def _json(value: Any, where: str) -> Any:
    """``value`` as JSON data: a dataclass as its fields, a tuple as a list, numpy scalars as
    Python numbers (``.item()``: the same float)."""
    if isinstance(value, np.generic):
        return value.item()
    if value is None or isinstance(value, bool | int | float | str):
        return value
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return _fields(value, where, None)
    if isinstance(value, Mapping):
        return {str(k): _json(v, f"{where}.{k}") for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_json(v, where) for v in value]
    raise StudyError(f"measure value {where} is a {type(value).__name__}, not JSON data")


def _fields(result: Any, where: str, arrays: dict[str, np.ndarray] | None) -> dict[str, Any]:
    """A dataclass's fields as JSON, its arrays into ``arrays`` (only a measure's own fields
    may be arrays: ``arrays`` is None below it)."""
    out: dict[str, Any] = {}
    for f in dataclasses.fields(result):
        v = getattr(result, f.name)
        if isinstance(v, np.ndarray) or (v is None and _is_array(_hints(type(result))[f.name])):
            if arrays is None:
                raise StudyError(f"{where}.{f.name}: an array inside a nested value")
            if v is not None:
                arrays[f.name] = v
        elif f.metadata.get(INLINE):
            out |= _json(v, f"{where}.{f.name}")
        else:
            out[f.name] = _json(v, f"{where}.{f.name}")
    return out


def encode(result: Any, where: str = "result") -> tuple[dict[str, Any], dict[str, np.ndarray]]:
    """A measure's result as the cell cache stores it: its numbers (JSON) and its arrays. A
    dict (a measure that returns one) is stored as it is, its numpy arrays apart."""
    arrays: dict[str, np.ndarray] = {}
    if dataclasses.is_dataclass(result) and not isinstance(result, type):
        return _fields(result, where, arrays), arrays
    if isinstance(result, Mapping):
        numbers = {k: v for k, v in result.items() if not isinstance(v, np.ndarray)}
        arrays = {k: v for k, v in result.items() if isinstance(v, np.ndarray)}
        return _json(numbers, where), arrays
    raise StudyError(f"{where} is a {type(result).__name__}, not a dataclass or a dict")


_HINTS: dict[type, dict[str, Any]] = {}


def _hints(cls: type) -> dict[str, Any]:
    """``cls``'s field types, resolved (its module's names), once per class."""
    if cls not in _HINTS:
        _HINTS[cls] = typing.get_type_hints(cls)
    return _HINTS[cls]


def _is_array(hint: Any) -> bool:
    """Whether a field of type ``hint`` is an array (``np.ndarray``, or it ``| None``)."""
    options = typing.get_args(hint) if _is_union(hint) else (hint,)
    return any(h is np.ndarray or typing.get_origin(h) is np.ndarray for h in options)


def _is_union(hint: Any) -> bool:
    return typing.get_origin(hint) in (typing.Union, types.UnionType)


def _read(hint: Any, value: Any, where: str) -> Any:
    """A stored value back as ``hint`` says: dataclasses, tuples, dicts of them."""
    if value is None:
        return None
    if _is_union(hint):  # X | None: the value is not None here
        hint = next(a for a in typing.get_args(hint) if a is not type(None))
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if isinstance(hint, type) and dataclasses.is_dataclass(hint):
        return _dataclass(hint, value, {}, where)
    if origin is tuple:
        of = args[0] if args else Any
        return tuple(_read(of, v, where) for v in value)
    if origin is list:
        return [_read(args[0] if args else Any, v, where) for v in value]
    if origin in (dict, Mapping):
        of = args[1] if len(args) == 2 else Any
        return {k: _read(of, v, f"{where}.{k}") for k, v in value.items()}
    return value  # a number, a string, or JSON data the hint does not describe


def _dataclass(
    cls: type[R], numbers: Mapping[str, Any], arrays: Mapping[str, Any], where: str
) -> R:
    """``cls`` from its stored fields. A stored key it has no field for is refused (the
    dataclass no longer says what the measure stores); a field not stored takes its default
    (a cell stored before the field was added), and is refused where it has none."""
    hints, kwargs, used = _hints(cls), {}, set()
    for f in dataclasses.fields(cls):  # type: ignore[arg-type]
        if _is_array(hints[f.name]):
            kwargs[f.name] = arrays.get(f.name)
        elif f.metadata.get(INLINE):
            inner = {g.name for g in dataclasses.fields(hints[f.name])}
            kwargs[f.name] = _dataclass(
                hints[f.name], {k: v for k, v in numbers.items() if k in inner}, {}, where
            )
            used |= inner
        elif f.name in numbers:
            kwargs[f.name] = _read(hints[f.name], numbers[f.name], f"{where}.{f.name}")
            used.add(f.name)
        elif f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
            raise StudyError(f"{where}: no {f.name!r} stored for {cls.__name__}")
    unknown = set(numbers) - used
    if unknown:
        raise StudyError(f"{where}: {cls.__name__} has no fields {sorted(unknown)}")
    return cls(**kwargs)


def decode(
    cls: type[R],
    numbers: Mapping[str, Any],
    arrays: Mapping[str, np.ndarray] | None = None,
    where: str = "result",
) -> R:
    """A stored result read back into ``cls``, from its numbers and arrays (none: the arrays'
    fields are None)."""
    return _dataclass(cls, numbers, arrays or {}, where)


# --- one cell's results --------------------------------------------------------------------------


class Measures(Mapping[str, Any]):
    """One cell's results by measure name, each what its measure returns. The measures of
    this module are attributes; reading one the cell did not run raises AttributeError
    (``"corpus" in cell`` asks first)."""

    def __init__(self, results: Mapping[str, Any]) -> None:
        self._results = dict(results)

    def __getitem__(self, name: str) -> Any:
        return self._results[name]

    def __iter__(self) -> Iterator[str]:
        return iter(self._results)

    def __len__(self) -> int:
        return len(self._results)

    def __repr__(self) -> str:
        return f"Measures({', '.join(self._results)})"

    def _of(self, name: str, cls: type[R]) -> R:
        if name not in self._results:
            raise AttributeError(f"the cell has no {name!r} measure")
        result = self._results[name]
        if not isinstance(result, cls):
            raise StudyError(f"the cell's {name!r} is a {type(result).__name__}, not {cls}")
        return result

    @property
    def last_position(self) -> LastPosition:
        return self._of("last_position", LastPosition)

    @property
    def teacher_forcing(self) -> TeacherForcing:
        return self._of("teacher_forcing", TeacherForcing)

    @property
    def teacher_forcing_batched(self) -> TeacherForcing:
        return self._of("teacher_forcing_batched", TeacherForcing)

    @property
    def free_generation(self) -> FreeGeneration:
        return self._of("free_generation", FreeGeneration)

    @property
    def attribution(self) -> Attribution:
        return self._of("attribution", Attribution)

    @property
    def layer_trace(self) -> LayerTrace:
        return self._of("layer_trace", LayerTrace)

    @property
    def corpus(self) -> Corpus:
        return self._of("corpus", Corpus)

    @property
    def routing(self) -> RoutingReport:
        """``routing`` (:mod:`qllama.measure.routing`): a mixture's experts against the F32
        variant's, and the error with them forced."""
        return self._of("routing", RoutingReport)
