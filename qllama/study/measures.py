"""The measures a cell runs: registered functions of (model, reference, options) -> result.

A measure returns a frozen dataclass, its result, whose fields say what each number is (those
of the measures here are in :mod:`qllama.study.results`, which stores and reads them): the
function's return annotation names it, so a cached cell is read back into it. Its numpy
array fields are kept beside the JSON (an ``.npz``), for plots and tables that need every
step. A measure may also return a dict of JSON values and arrays, read back as a dict. A
study names its measures (``measures = ["teacher_forcing", ...]``); a name is one registered
here or an import path ``"package.module:function"`` (a function registered with
:func:`register` when its module is imported, or a plain function of the same signature).

    @dataclass(frozen=True)
    class Mine:
        mean: float  # what it is

    @register("my_measure", defaults={"k": 3}, about="what it measures")
    def my_measure(model, reference, options) -> Mine: ...

Measures that need the whole forward pass at every layer (``layer_trace``), many passes
(``attribution``) or a corpus (``corpus``) are registered the same way, and a study limits
them to some cells (``cells`` patterns on a measure). A cell's key includes the name and
options of each measure that runs in it, so adding one reruns only the cells it is added to.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import importlib
import importlib.util
import json
import typing
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from qllama.measure.compare import Reference, free_generation, teacher_forcing
from qllama.measure.routing import RoutingReport
from qllama.study import results
from qllama.study.declaration import MeasureSpec, StudyError
from qllama.study.results import (
    Attribution,
    Corpus,
    Flip,
    FreeGeneration,
    LastPosition,
    LayerTrace,
    TeacherForcing,
)

MeasureFn = Callable[[Any, Reference, Mapping[str, Any]], Any]

TOP = 5  # per-step top-k kept for the cross-setting tables


@dataclass(frozen=True)
class Measure:
    """A registered measure: its function, its default options, one line about it, and the
    dataclass of its result (None: it returns a dict)."""

    name: str
    run: MeasureFn
    defaults: Mapping[str, Any] = field(default_factory=dict)
    about: str = ""
    # options whose value names one of the study's variants: the measure is given its path
    files: tuple[str, ...] = ()
    result: type | None = None

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
    name: str,
    *,
    defaults: Mapping[str, Any] | None = None,
    about: str = "",
    files: tuple[str, ...] = (),
) -> Callable[[MeasureFn], MeasureFn]:
    """Register ``fn`` as the measure ``name``. ``files`` are options that name a variant of
    the study (``f32 = "F32"``): the cell's key includes that file's hash, and ``fn`` gets
    the file's path in the option."""

    def add(fn: MeasureFn) -> MeasureFn:
        if name in REGISTRY and REGISTRY[name].run is not fn:
            raise StudyError(f"a measure named {name!r} is registered already")
        REGISTRY[name] = Measure(
            name, fn, dict(defaults or {}), about, tuple(files), result_type(fn)
        )
        return fn

    return add


def result_type(fn: MeasureFn) -> type | None:
    """The dataclass ``fn``'s return annotation names (None: it returns a dict, or says not)."""
    try:
        hint = typing.get_type_hints(fn).get("return")
    except Exception:  # an annotation that does not resolve (a name imported in the function)
        return None
    return hint if isinstance(hint, type) and dataclasses.is_dataclass(hint) else None


def variants_named(spec: MeasureSpec) -> list[str]:
    """The variants the measure's file options name (see :func:`register`)."""
    m = get(spec.name)
    options = m.options(spec.options)
    names = []
    for opt in m.files:
        if options[opt] is None:  # the option is not used here
            continue
        if not isinstance(options[opt], str):
            raise StudyError(f"measure {spec.name!r}: option {opt} must name a variant")
        names.append(options[opt])
    return names


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
    return Measure(name, fn, result=result_type(fn))


def run(
    spec: MeasureSpec, model: Any, ref: Reference, files: Mapping[str, str] | None = None
) -> Any:
    """Run one measure: its result (:func:`qllama.study.results.encode` stores it). ``files``
    maps the study's variant names to their paths (those the measure's file options name)."""
    m = get(spec.name)
    options = m.options(spec.options)
    for opt in m.files:
        if options[opt] is not None:
            options[opt] = (files or {})[options[opt]]
    out = m.run(model, ref, options)
    want = m.result or Mapping
    if not isinstance(out, want):
        raise StudyError(
            f"measure {spec.name!r} returned a {type(out).__name__}, not a {want.__name__}"
            + ("" if m.result else " (or annotate its return type with its dataclass)")
        )
    return out


def read(name: str, numbers: Mapping[str, Any], arrays: Mapping[str, np.ndarray]) -> Any:
    """The result of measure ``name`` read back from a cell (the numbers it stored under the
    name, and its arrays): its dataclass, or a dict for a measure that returns one."""
    cls = get(name).result
    if cls is None:
        return {**numbers, **arrays}
    return results.decode(cls, numbers, arrays, where=name)


# --- the seed study's measures -----------------------------------------------------------------


def _top(logits: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
    idx = np.argsort(-logits, axis=-1, kind="stable")[:, :k]
    return idx, np.take_along_axis(logits, idx, axis=-1)


@register("last_position", about="max |Δlogit| at the prompt's last position")
def last_position(model: Any, ref: Reference, options: Mapping[str, Any]) -> LastPosition:
    from qllama.array_api import to_numpy

    logits = np.asarray(to_numpy(model.forward(ref.tokens[: ref.n_prompt], pos=0)), np.float32)
    return LastPosition(max_abs=float(np.abs(logits - ref.step_logits[0]).max()))


def _teacher_forcing(tf: Any, **arrays: Any) -> TeacherForcing:
    """The result of a :class:`qllama.measure.compare.TeacherForcing`: its summary's numbers
    and arrays."""
    s = tf.summary()
    flips = tuple(Flip(**f) for f in s.pop("flips"))
    del s["kl"]  # the statistics themselves, not their dict
    return TeacherForcing(
        **s, flips=flips, kl=tf.kl, max_abs=tf.max_abs, argmax=tf.argmax, **arrays
    )


@register(
    "teacher_forcing",
    defaults={"top": TOP, "logits": False},
    about="the reference tokens fed one at a time: per-step max |Δ|, argmax, flips, KL",
)
def teacher_forcing_steps(model: Any, ref: Reference, options: Mapping[str, Any]) -> TeacherForcing:
    tf = teacher_forcing(model, ref, mode="steps")
    top_ids, top_logits = _top(tf.logits, int(options["top"]))
    arrays = {"top_ids": top_ids, "top_logits": top_logits}
    if options["logits"]:  # every step's logits, for comparing two cells (study.compare)
        arrays["logits"] = tf.logits
    return _teacher_forcing(tf, **arrays)


@register("teacher_forcing_batched", about="the same in one forward pass over every position")
def teacher_forcing_batched(
    model: Any, ref: Reference, options: Mapping[str, Any]
) -> TeacherForcing:
    return _teacher_forcing(teacher_forcing(model, ref, mode="batched"))


@register(
    "free_generation",
    defaults={"extra": 20},
    about="greedy decoding on its own, capped at the reference length + extra: the fork",
)
def free_generation_measure(
    model: Any, ref: Reference, options: Mapping[str, Any]
) -> FreeGeneration:
    s = free_generation(model, ref, extra=int(options["extra"])).summary()
    return FreeGeneration(**{**s, "tokens": tuple(s["tokens"])})


# --- where the drift enters (qllama.measure.trace, qllama.measure.attribution) -------------


def _source_path(model: Any, measure: str) -> str:
    source = getattr(model, "source", None)
    if source is None or getattr(source, "path", None) is None:
        raise StudyError(f"measure {measure!r} needs a cell computed by qllama from a file")
    return str(source.path)


@register(
    "attribution",
    defaults={"kind": "activations", "by": "class", "arithmetic": "f32", "f32": None},
    files=("f32",),
    about="the cell's error split by tensor group: one group's cause switched on at a time",
)
def attribution_measure(model: Any, ref: Reference, options: Mapping[str, Any]) -> Attribution:
    """:func:`qllama.measure.attribution.attribute` on the cell's file and backend: ``kind``
    ``activations`` (the CPU arithmetic's activation rounding, one group at a time, the rest
    on ``arithmetic``) or ``weights`` (the file's weights, one group at a time, in the F32
    variant ``f32``)."""
    from qllama.measure.attribution import attribute

    out = attribute(
        _source_path(model, "attribution"),
        ref,
        kind=str(options["kind"]),
        by=str(options["by"]),
        f32_path=options["f32"],
        arithmetic=str(options["arithmetic"]),
        backend=model.backend.name,
    ).to_dict()
    del out["file"]  # a path of this machine's cache; the cell names its file by hash
    return results.decode(Attribution, out, where="attribution")


# who runs the F32 variant for a layer trace or a corpus base
REFERENCE_ENGINES = ("transformers", "qllama")
ENGINES = {"transformers": "transformers f32 eager", "qllama": "qllama numpy dequantize-all"}


def _reference_engine(measure: str, reference: str) -> None:
    """Refuse an unknown engine, or transformers where it is not installed, by name."""
    if reference not in REFERENCE_ENGINES:
        raise StudyError(f"{measure}: reference must be one of {', '.join(REFERENCE_ENGINES)}")
    if reference == "transformers" and importlib.util.find_spec("transformers") is None:
        raise StudyError(
            f"measure {measure!r} runs transformers on the F32 variant, and transformers is not "
            "installed here: pip install 'qllama[reference]' (nox -s experiments installs it)"
        )


@functools.lru_cache(maxsize=1)  # the cells of one prompt share it
def _reference_trace(
    path: str, tokens: tuple[int, ...], qkv: bool, kind: str, *, router: bool = False
) -> Any:
    """The F32 variant's trace of ``tokens``, by transformers or by qllama's dequantize-all
    (which alone records a mixture's router logits, ``router``)."""
    from qllama.measure.reference import transformers_trace
    from qllama.runtime.observe import record

    if kind == "transformers":
        return transformers_trace(path, tokens, qkv=qkv)
    from qllama.runtime.loader import load

    model = load(path, dequantize_all=True)
    try:
        return record(model, tokens, qkv=qkv, router=router)
    finally:
        model.source.close()


@register(
    "layer_trace",
    defaults={"f32": None, "qkv": False, "reference": "transformers"},
    files=("f32",),
    about="every layer's values against transformers' on the F32 variant, every position",
)
def layer_trace_measure(model: Any, ref: Reference, options: Mapping[str, Any]) -> LayerTrace:
    """The cell's residual stream, attention and MLP outputs (and Q/K/V with ``qkv``) at every
    position of the reference's tokens against the F32 variant ``f32`` run by ``reference``
    (transformers, or qllama's dequantize-all for a study whose reference is qllama's): the
    per-point errors of :func:`qllama.measure.trace.compare`. The report puts each cell beside the
    F32 variant's cell of the same setting, its control."""
    from qllama.measure.trace import compare
    from qllama.runtime.observe import record, residual_names

    if options["f32"] is None:
        raise StudyError("measure 'layer_trace' needs f32 = the F32 variant's name")
    _reference_engine("layer_trace", str(options["reference"]))
    tokens = tuple(int(t) for t in ref.tokens)
    reference = _reference_trace(
        str(options["f32"]), tokens, bool(options["qkv"]), str(options["reference"])
    )
    errors = compare(record(model, tokens, qkv=bool(options["qkv"])), reference)
    return LayerTrace(tuple(residual_names(model.config.n_layer)), errors)


@register(
    "routing",
    defaults={"f32": None},
    files=("f32",),
    about="a mixture's experts against the F32 variant's, per token and layer, and the logit "
    "error with the F32 variant's experts forced",
)
def routing_measure(model: Any, ref: Reference, options: Mapping[str, Any]) -> RoutingReport:
    """:func:`qllama.measure.routing.routing_report` of the cell's model over the reference's
    tokens (prompt and continuation) against the F32 variant ``f32`` run by qllama's
    dequantize-all (its router logits are not in a transformers reference): set, top-1 and
    ordered agreement of the selected experts, the router-weight error, and the KL divergence
    and max |Δlogit| with and without the F32 variant's experts forced."""
    from qllama.measure.routing import routing_report

    if options["f32"] is None:
        raise StudyError("measure 'routing' needs f32 = the F32 variant's name")
    if not model.config.n_expert:
        raise StudyError("measure 'routing' needs a mixture of experts (the model has none)")
    tokens = tuple(int(t) for t in ref.tokens)
    reference = _reference_trace(str(options["f32"]), tokens, False, "qllama", router=True)
    return routing_report(model, None, tokens, ref_trace=reference)


# --- a corpus, as llama-perplexity measures it (qllama.measure.perplexity) ----------------


def corpus_base(
    f32_path: str, corpus: str, n_ctx: int, chunks: int, fmt: str, reference: str
) -> Any:
    """The base of ``corpus`` on the F32 file (a :class:`~qllama.measure.kld_base.BaseFile`), run by
    ``reference`` (transformers f32, or qllama's dequantize-all): made once and kept in the
    cache (``corpus-bases/``), the first process to need it making it while the others
    wait. Its name is the hash of what it is made from, so a cell that finds it reads
    neither the whole F32 file nor the tokenized corpus again."""
    from qllama import defaults
    from qllama.atomic import exclusive
    from qllama.measure import corpus as corpora
    from qllama.measure import kld_base, perplexity
    from qllama.model_files import file_sha256

    _reference_engine("corpus", reference)  # before anything is read
    origin = corpora.from_spec(f"corpus:{corpus}")[1]
    meta = {
        "model_sha256": file_sha256(f32_path),
        "setting": {"engine": ENGINES[reference]},
        "text": origin,
    }
    key = hashlib.sha256(json.dumps([meta, n_ctx, chunks, fmt], sort_keys=True).encode())
    name = f"{corpus}-{n_ctx}x{chunks}-{fmt}-{key.hexdigest()[:16]}.base"
    path = defaults.cache_dir() / "corpus-bases" / name
    with exclusive(path.with_suffix(".lock")):
        if not path.exists():

            def enough(wins: perplexity.Windows, setting: Mapping[str, Any]) -> None:
                # llama-perplexity takes fewer windows; a cell's key promises this many
                if wins.n_chunk < chunks:
                    raise StudyError(
                        f"corpus {corpus!r} has {wins.n_chunk} windows of {n_ctx}, not {chunks}"
                    )

            perplexity.evaluate(
                f32_path,
                text=f"corpus:{corpus}",
                n_ctx=n_ctx,
                n_chunks=chunks,
                engine=reference,
                options={"dequantize_all": True},  # the qllama engine's; transformers' is f32
                save_base=path,
                base_format=fmt,
                save_meta=meta,
                on_start=enough,
            )
    return kld_base.BaseFile.open(path)


@register(
    "corpus",
    defaults={
        "corpus": "botchan",
        "n_ctx": 512,
        "chunks": 16,
        "base_format": "f32",
        "f32": None,
        "reference": "transformers",
    },
    files=("f32",),
    about="perplexity and KL divergence over a corpus against transformers f32, as "
    "llama-perplexity computes them",
)
def corpus_measure(model: Any, ref: Reference, options: Mapping[str, Any]) -> Corpus:
    """:func:`qllama.measure.perplexity.measure` of the cell's model over ``chunks`` windows of
    ``n_ctx`` tokens of ``corpus`` (:mod:`qllama.measure.corpus`), against transformers f32 on
    the F32 variant ``f32`` (the base, :func:`corpus_base`). The prompt of the cell is not
    used."""
    from qllama.measure import perplexity

    if options["f32"] is None:
        raise StudyError("measure 'corpus' needs f32 = the F32 variant's name")
    base = corpus_base(
        str(options["f32"]),
        str(options["corpus"]),
        int(options["n_ctx"]),
        int(options["chunks"]),
        str(options["base_format"]),
        str(options["reference"]),
    )
    numbers = perplexity.measure(model, base, n_chunks=int(options["chunks"]))
    return results.decode(Corpus, numbers, where="corpus")
