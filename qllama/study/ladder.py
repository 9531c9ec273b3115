"""The quant ladder: the file types qllama's quantizer makes from one F32 model, with and
without an importance matrix, each measured over a corpus (llama-perplexity's statistics)
and on prompts (argmax flips, first fork), under the CPU arithmetic (with its noise band over
draws of float order) and under dequantize-all.

A ladder is a study (:func:`ladder_study`): its files are built once, its cells cached by
content, resumable, and run on any executor (Dask included). ``qllama ladder`` runs one and
writes its table (sorted by bits per weight, the Pareto front marked), its plot and its JSON
(:func:`rows`, :func:`format_table`, :func:`plot`); ``--write-study`` writes the declaration as
TOML (:func:`qllama.study.declaration.to_toml`), a template to edit and run with ``--study``.

``kv`` crosses the types with llama.cpp's KV cache types: each cache spec (``"q8_0/q4_0,fa"``,
:mod:`qllama.runtime.kv_types`) adds a setting, the CPU arithmetic with that cache
(:func:`kv_setting`), whose columns the table names after it.

A type the model cannot take (a row length that divides into none of its blocks and has no
fallback), or one that an arithmetic cannot compute, is a row of the table with its reason,
never a silent substitute.
"""

from __future__ import annotations

import math
import os
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from qllama.study.declaration import (
    Draw,
    MeasureSpec,
    Prompt,
    ReferenceSpec,
    Setting,
    Study,
    StudyError,
    Variant,
)

# the CPU arithmetic's noise band: the cells again with another CPU's float kernels (as the
# seed study's draws, experiments/seed.toml)
DRAWS = {
    "avx2": Draw(
        "avx2",
        ("cpu",),
        env={
            "OPENBLAS_CORETYPE": "Haswell",
            "NPY_DISABLE_CPU_FEATURES": "X86_V4 AVX512_ICL AVX512_SPR",
        },
        about="an AVX2 CPU: OpenBLAS's Haswell kernels, numpy's AVX2 loops",
    ),
    "sse": Draw(
        "sse",
        ("cpu",),
        env={
            "OPENBLAS_CORETYPE": "Nehalem",
            "NPY_DISABLE_CPU_FEATURES": "X86_V3 X86_V4 AVX512_ICL AVX512_SPR",
        },
        about="a CPU without AVX: OpenBLAS's Nehalem kernels, numpy's SSE4 loops",
    ),
}
SETTINGS = (
    Setting("cpu", "numpy", about="activations quantized to Q8 (llama.cpp's CPU)"),
    Setting("dequantize-all", "numpy", {"dequantize_all": True}, about="f32 weights at load"),
)
KV_PREFIX = "cpu-kv-"  # the settings of --kv
PROMPTS = (
    Prompt("raw", "The three primary colors are", chat=False, max_new_tokens=64),
    Prompt("chat", "Explain how a CPU cache works.", max_new_tokens=64),
)


@dataclass(frozen=True)
class Rung:
    """One type's place on the ladder: built with and/or without an importance matrix, or
    skipped with the reason; ``settings`` the arithmetics that can compute it."""

    type: str
    imatrix: tuple[bool, ...]  # () where skipped
    settings: tuple[str, ...]
    reason: str = ""


def ladder_types() -> list[str]:
    """Every file type qllama's quantizer makes but F32 (the ladder's top, the reference)."""
    from qllama.gguf.quantizer import FILE_TYPES

    return [t for t in FILE_TYPES if t != "F32"]


def rungs(f32_path: str | os.PathLike[str], types: Sequence[str], *, imatrix: bool) -> list[Rung]:
    """For each type: whether the model's shapes take it (llama-quantize's plan and
    fallbacks), whether it needs an importance matrix, and which settings compute every
    tensor type it writes."""
    from qllama import quants
    from qllama.backends import get_backend
    from qllama.errors import QllamaError
    from qllama.gguf.quantizer import (
        allows_quantization,
        file_type,
        plan_with_fallbacks,
        requires_imatrix,
    )
    from qllama.gguf.reader import read_gguf

    backends = {s.name: get_backend(s.backend, **s.options) for s in SETTINGS}
    out = []
    with read_gguf(f32_path) as f:
        for label in types:
            ft = file_type(label)  # a name that is no file type is an error, not a row
            try:
                planned, _ = plan_with_fallbacks(f, ft, imatrix=imatrix)
            except QllamaError as e:
                out.append(Rung(label, (), (), f"not made: {e}"))
                continue
            needs = any(
                requires_imatrix(n, t, ft) and allows_quantization(f.tensors[n], f.architecture)
                for n, t in planned.items()
            )
            if needs and not imatrix:
                out.append(Rung(label, (), (), "needs an importance matrix (none asked for)"))
                continue
            kinds = set(planned.values())
            settings = tuple(n for n, b in backends.items() if all(b.supports(t) for t in kinds))
            if not settings:
                names = ", ".join(sorted(t.name for t in kinds))
                out.append(Rung(label, (), (), f"no setting computes its types ({names})"))
                continue
            # a matrix only where a quantized tensor's type reads one (Q8_0 ignores it)
            changed = {t for n, t in planned.items() if t != f.tensors[n].ggml_type}
            reads = any(quants.get(t).imatrix_use in ("optional", "required") for t in changed)
            with_imatrix = (True,) if needs else ((False, True) if imatrix and reads else (False,))
            out.append(Rung(ft.label, with_imatrix, settings))
    return out


def kv_setting(spec: str) -> Setting:
    """The CPU arithmetic with llama.cpp's KV cache ``spec`` (checked): a setting named
    ``cpu-kv-`` and the spec (``/`` and ``,`` as ``-``: a name that is also a folder)."""
    from qllama.runtime import kv_types

    s = kv_types.parse(spec)
    flags = ", flash attention" if s.flash else ""
    return Setting(
        KV_PREFIX + s.name.replace("/", "-").replace(",", "-"),
        "numpy",
        {"kv_precision": s.name},
        about=f"the CPU arithmetic, KV cache K {s.type_k} / V {s.type_v}{flags} (llama.cpp's)",
    )


def _base(setting: str) -> str:
    """The arithmetic a setting is: a KV cache setting is the CPU one."""
    return "cpu" if setting.startswith(KV_PREFIX) else setting


def variant_name(label: str, imatrix: bool) -> str:
    """A ladder file's name: its type, and ``-imatrix`` where it was made with a matrix."""
    return f"{label}-imatrix" if imatrix else label


def ladder_study(
    model: str,
    *,
    types: Sequence[str] | None = None,
    imatrix_corpus: str | None = "corpus:botchan",
    imatrix_chunks: int = 16,
    corpus: str = "botchan",
    chunks: int = 16,
    n_ctx: int = 512,
    prompts: Sequence[Prompt] = PROMPTS,
    draws: Sequence[str] = ("avx2", "sse"),
    reference: str = "qllama",
    threads: int = 1,
    f32_path: str | os.PathLike[str] | None = None,
    kv: Sequence[str] = (),
) -> tuple[Study, list[Rung]]:
    """The ladder of ``model`` (an F32 GGUF, or a name ``qllama fetch`` knows) as a study, and
    its rungs (the skipped types among them). ``f32_path`` is the F32 file the types are
    planned on (default: ``model`` itself). The importance matrix is computed from
    ``imatrix_corpus`` as llama-imatrix does, after the ``chunks`` windows the corpus measure
    scores (calibration text never scored); None: no importance matrix at all. ``kv``: KV
    cache specs, a CPU setting each (:func:`kv_setting`), computing what the CPU setting
    computes."""
    if reference not in ("qllama", "transformers"):
        raise StudyError(f"the reference is qllama or transformers, not {reference!r}")
    unknown = [d for d in draws if d not in DRAWS]
    if unknown:
        raise StudyError(f"unknown draw(s) {unknown}: known {', '.join(DRAWS)}")
    ladder = rungs(f32_path or model, list(types or ladder_types()), imatrix=bool(imatrix_corpus))
    variants = [Variant("F32")]
    computed: dict[str, list[str]] = {s.name: ["F32"] for s in SETTINGS}
    for r in ladder:
        for with_imatrix in r.imatrix:
            name = variant_name(r.type, with_imatrix)
            extra = (
                {
                    "imatrix_corpus": imatrix_corpus,
                    "imatrix_chunks": imatrix_chunks,
                    "imatrix_skip_chunks": chunks,
                }
                if with_imatrix
                else {}
            )
            variants.append(Variant(r.type, name, **extra))  # type: ignore[arg-type]
            for s in r.settings:
                computed[s].append(name)
    caches = [kv_setting(spec) for spec in dict.fromkeys(kv)]
    settings = tuple(
        Setting(s.name, s.backend, s.options, about=s.about, variants=tuple(computed[s.name]))
        for s in SETTINGS
    ) + tuple(
        Setting(c.name, c.backend, c.options, about=c.about, variants=tuple(computed["cpu"]))
        for c in caches
    )
    first = prompts[0].name
    measures = (
        MeasureSpec("teacher_forcing"),
        MeasureSpec("free_generation", {"extra": 20}),
        MeasureSpec(
            "corpus",
            {
                "f32": "F32",
                "corpus": corpus,
                "chunks": chunks,
                "n_ctx": n_ctx,
                "reference": reference,
            },
            cells=(f"{first}/*",),  # the corpus does not read the prompt: once per file
        ),
    )
    study = Study(
        name="ladder",
        title=f"The quant ladder of {os.path.basename(str(model))}",
        model=str(model),
        variants=tuple(variants),
        settings=settings,
        prompts=tuple(prompts),
        measures=measures,
        reference=ReferenceSpec(kind=reference, variant="F32"),
        draws=tuple(DRAWS[d] for d in draws),
        threads=threads,
    )
    return study, ladder


# what the ladder's table reads from every file's cells
LADDER_MEASURES = ("corpus", "teacher_forcing", "free_generation")


def check_ladder(study: Study) -> None:
    """Refuse a declaration the ladder's table cannot be made from: it needs the F32
    variant (the reference's file) and the measures the table reads."""
    names = {m.name for m in study.measures}
    missing = [m for m in LADDER_MEASURES if m not in names]
    if missing:
        raise StudyError(f"a ladder needs the measures {', '.join(missing)}; the study lacks them")
    study.variant("F32")


# --- the table ------------------------------------------------------------------------------


@dataclass
class Cell:
    """One file under one arithmetic: the corpus's statistics and the prompts'."""

    mean_kld: float
    mean_kld_unc: float
    kld_99: float
    kld_999: float
    kld_max: float
    same_top: float  # fraction
    rms_dp: float  # fraction
    ppl_ratio: float
    ppl_ratio_unc: float
    flips_per_100: float  # argmax flips per 100 teacher-forced steps, over the prompts
    first_fork: int | None  # the earliest new token where free generation forks (None: never)
    band: tuple[float, float] | None = None  # mean KLD's [min, max] over the draws


@dataclass
class Row:
    """One file of the ladder (or one skipped type, with ``reason``)."""

    name: str
    type: str
    imatrix: bool
    bpw: float = math.nan  # bits per weight: the tensors' bytes x 8 / their elements
    size_mb: float = math.nan
    cells: dict[str, Cell] = field(default_factory=dict)  # by setting
    front: dict[str, bool] = field(default_factory=dict)  # on the Pareto front, by setting
    reason: str = ""
    missing: dict[str, str] = field(default_factory=dict)  # a setting not run: why


def bits_per_weight(path: str | os.PathLike[str]) -> tuple[float, float]:
    """The file's bits per weight (every tensor's bytes against its elements, as llama.cpp's
    loader counts) and its tensor data in MB."""
    from qllama.gguf.reader import read_gguf

    with read_gguf(path) as f:
        nbytes = sum(t.nbytes for t in f.tensors.values())
        elements = sum(t.n_elements for t in f.tensors.values())
    return 8 * nbytes / elements, nbytes / 1e6


def _cell(label: str, data: Any) -> Cell | None:
    """The numbers of ``label`` (variant-setting) over the prompts, None where it did not run."""
    prompts = list(data.prompts.values())
    cells = [p.cells.get(label) for p in prompts]
    if any(c is None for c in cells):
        return None
    corpus = next(c.measures.corpus for c in cells if "corpus" in c.measures)
    kl = corpus.kl
    steps = sum(c.measures.teacher_forcing.steps for c in cells)
    flips = sum(
        c.measures.teacher_forcing.steps - c.measures.teacher_forcing.argmax_agree for c in cells
    )
    forks = [c.measures.free_generation.fork for c in cells]
    bands = [
        d[label].measures.corpus.kl.mean_kld
        for p in prompts
        for d in p.draws.values()
        if label in d and "corpus" in d[label].measures
    ]
    return Cell(
        mean_kld=kl.mean_kld,
        mean_kld_unc=kl.mean_kld_unc,
        kld_99=kl.kld["99%"],
        kld_999=kl.kld["99.9%"],
        kld_max=kl.kld["max"],
        same_top=kl.same_top,
        rms_dp=kl.rms_dp,
        ppl_ratio=kl.ppl_ratio,
        ppl_ratio_unc=kl.ppl_ratio_unc,
        flips_per_100=100 * flips / steps if steps else math.nan,
        first_fork=min((f for f in forks if f is not None), default=None),
        band=(min([kl.mean_kld, *bands]), max([kl.mean_kld, *bands])) if bands else None,
    )


def rows(study: Study, ladder: Sequence[Rung], data: Any, paths: Mapping[str, str]) -> list[Row]:
    """The ladder's rows from a study's collected results, sorted by bits per weight, the
    Pareto front (no smaller file with a lower mean KLD) marked per setting; the skipped
    types last."""
    computes = {r.type: r.settings for r in ladder}
    out = []
    for v in study.variants:
        if v.name == "F32":
            continue
        bpw, mb = bits_per_weight(paths[v.name])
        row = Row(v.name, v.type, bool(v.imatrix_corpus or v.imatrix), bpw, mb)
        for s in study.settings:
            cell = _cell(f"{v.name}-{s.name}", data)
            if cell is not None:
                row.cells[s.name] = cell
            elif _base(s.name) not in computes.get(v.type, (_base(s.name),)):
                row.missing[s.name] = "no kernel here for its types"
            else:
                row.missing[s.name] = "not declared for this file"
        out.append(row)
    out.sort(key=lambda r: (r.bpw, r.name))
    mark_front(out, [s.name for s in study.settings])
    out += [Row(r.type, r.type, False, reason=r.reason) for r in ladder if r.reason]
    return out


def mark_front(table: Sequence[Row], settings: Sequence[str]) -> None:
    """Mark, per setting, the rows on the Pareto front: no other file as small or smaller
    has a lower mean KLD."""
    for s in settings:
        done = [r for r in table if s in r.cells]
        for r in table:
            kld = r.cells[s].mean_kld if s in r.cells else None
            r.front[s] = kld is not None and not any(
                o is not r and o.bpw <= r.bpw and o.cells[s].mean_kld < kld for o in done
            )


def _kld(c: Cell | None) -> str:
    if c is None:
        return "-"
    band = f" [{c.band[0]:.2e}, {c.band[1]:.2e}]" if c.band else ""
    return f"{c.mean_kld:.3e} ± {c.mean_kld_unc:.1e}{band}"


def format_table(table: Sequence[Row], settings: Sequence[str]) -> list[str]:
    """A markdown table: a row per file, its numbers per setting; ``*`` marks the front."""
    head = ["file", "bpw", "MB"]
    for s in settings:
        head += [
            f"{s}: mean KLD ± [draws]",
            "99% KLD",
            "99.9% KLD",
            "max KLD",
            "same top",
            "RMS Δp",
            "PPL ratio",
            "flips /100",
            "first fork",
        ]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in table:
        if r.reason:
            lines.append(f"| {r.name} | skipped: {r.reason} |" + " |" * (len(head) - 2))
            continue
        cells = [
            r.name + (" (imatrix)" if r.imatrix and "imatrix" not in r.name else ""),
            f"{r.bpw:.3f}",
            f"{r.size_mb:.1f}",
        ]
        for s in settings:
            c = r.cells.get(s)
            if c is None:
                cells += [f"not computed: {r.missing.get(s, 'no result')}"] + ["-"] * 8
                continue
            fork = "never" if c.first_fork is None else str(c.first_fork)
            cells += [
                ("**\\*** " if r.front.get(s) else "") + _kld(c),
                f"{c.kld_99:.3e}",
                f"{c.kld_999:.3e}",
                f"{c.kld_max:.3e}",
                f"{100 * c.same_top:.2f}%",
                f"{100 * c.rms_dp:.3f}%",
                f"{c.ppl_ratio:.4f} ± {c.ppl_ratio_unc:.4f}",
                f"{c.flips_per_100:.1f}",
                fork,
            ]
        lines.append("| " + " | ".join(cells) + " |")
    return lines


def to_json(study: Study, table: Sequence[Row]) -> dict[str, Any]:
    """Every number of the ladder."""
    return {
        "model": study.model,
        "settings": [s.name for s in study.settings],
        "draws": [d.name for d in study.draws],
        "rows": [asdict(r) for r in table],
    }


def plot(table: Sequence[Row], settings: Sequence[str], path: str | os.PathLike[str]) -> None:
    """Bits per weight against mean KLD (log), the corpus's standard error as error bars,
    the draws' band as a thicker bar, each setting's Pareto front joined."""
    from qllama.measure.figures import pyplot, save

    fig, ax = pyplot().subplots(figsize=(9, 5))
    for k, s in enumerate(settings):
        done = [r for r in table if s in r.cells]
        if not done:
            continue
        color, marker = f"C{k}", "os^D"[k % 4]
        x = [r.bpw for r in done]
        y = [r.cells[s].mean_kld for r in done]
        err = [r.cells[s].mean_kld_unc for r in done]
        ax.errorbar(x, y, yerr=err, fmt=marker, color=color, ms=4, mfc="none", capsize=2, label=s)
        for r in done:
            band = r.cells[s].band
            if band:
                ax.plot([r.bpw, r.bpw], band, color=color, lw=3, alpha=0.4)
        front = [r for r in done if r.front.get(s)]
        ax.plot(
            [r.bpw for r in front],
            [r.cells[s].mean_kld for r in front],
            color=color,
            lw=1,
            label=f"{s}: Pareto front",
        )
        if k == 0:
            for r in done:
                ax.annotate(
                    r.name,
                    (r.bpw, r.cells[s].mean_kld),
                    fontsize=6,
                    xytext=(3, 3),
                    textcoords="offset points",
                )
    ax.set_yscale("log")
    ax.set_xlabel("bits per weight")
    ax.set_ylabel("mean KL divergence over the corpus (log)")
    ax.set_title(
        "The quant ladder: size against divergence (bars: standard error; shaded: draws)",
        fontsize=9,
    )
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=7)
    fig.tight_layout()
    save(fig, path, dpi=110)


def write(
    study: Study,
    ladder: Sequence[Rung],
    data: Any,
    paths: Mapping[str, str],
    folder: Path,
    *,
    with_plot: bool = True,
) -> list[Row]:
    """``ladder.md``, ``ladder.json`` (and ``ladder.png``) into ``folder``, each atomically;
    the JSON first, so a plot that fails loses no number."""
    import json

    from qllama.atomic import atomic_write

    table = rows(study, ladder, data, paths)
    settings = [s.name for s in study.settings]
    folder.mkdir(parents=True, exist_ok=True)
    with atomic_write(folder / "ladder.json", "w") as f:
        json.dump(to_json(study, table), f, indent=1)
    draws = ", ".join(d.name for d in study.draws) or "none"
    corpus = next(m.options for m in study.measures if m.name == "corpus")
    matrix = next((v for v in study.variants if v.imatrix_corpus), None)
    calibration = (
        f"; importance matrices from `{matrix.imatrix_corpus}`, {matrix.imatrix_chunks} "
        f"windows of 512 after the first {matrix.imatrix_skip_chunks} (never scored)"
        if matrix
        else ""
    )
    md = [
        f"# {study.title}\n",
        f"Corpus `{corpus['corpus']}`: {corpus['chunks']} windows of {corpus['n_ctx']} tokens, "
        f"the second half of each scored{calibration}. Prompts: "
        + ", ".join(f"`{p.name}` ({p.max_new_tokens} tokens)" for p in study.prompts)
        + f". {study.threads} thread(s) a cell.\n",
        f"Every file quantized by qllama from the F32 file as llama-quantize would; measured "
        f"over the corpus against the reference ({study.reference.kind} on the F32 file) as "
        f"llama-perplexity computes it, and on {len(study.prompts)} prompt(s). Sorted by bits "
        f"per weight; **\\*** marks the Pareto front of each setting (no file as small or smaller "
        f"has a lower mean KLD). ± is the corpus's standard error, [min, max] the band over the "
        f"draws of the CPU arithmetic ({draws}).\n",
        *format_table(table, settings),
        "",
    ]
    if with_plot:
        md.append("![bits per weight against mean KLD](ladder.png)\n")
    with atomic_write(folder / "ladder.md", "w") as f:
        f.write("\n".join(md))
    if with_plot:
        plot(table, settings, folder / "ladder.png")
    return table


__all__ = [
    "DRAWS",
    "LADDER_MEASURES",
    "PROMPTS",
    "SETTINGS",
    "Cell",
    "Row",
    "Rung",
    "bits_per_weight",
    "check_ladder",
    "format_table",
    "ladder_study",
    "ladder_types",
    "mark_front",
    "plot",
    "rows",
    "rungs",
    "to_json",
    "write",
]
