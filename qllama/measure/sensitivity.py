"""How much each group of tensors adds to the KL divergence at each type it could take.

A recipe (:mod:`qllama.recipe`) chooses a type per group of tensors; it needs, for every group
``g`` and every candidate type ``t``, the KL divergence of the F32 model with only ``g``'s
tensors quantized to ``t`` (the rest F32, float32 arithmetic), measured against the F32 model
itself on calibration windows of a corpus. Its first-order model of a whole assignment is the
sum of those cells (:mod:`qllama.recipe.search`); the recipe's file is then measured whole, on
other windows, to check it.

The design keeps the cost to one forward pass over the calibration windows per (group, type):

* **Groups** (:func:`groups`) are a tensor kind (``attn_q.weight``, ``ffn_down.weight``...,
  the tensor's name without its ``blk.N.``) across a band of consecutive layers (``bands``
  equal bands), and each tensor outside the blocks (``token_embd.weight``, ``output.weight``)
  alone. SmolLM2 (30 layers, 7 kinds, tied output) with 3 bands has 22 groups, where one
  group per tensor would have 211.
* **Candidate types** (:func:`candidates`) are :data:`CANDIDATES` (with an importance matrix
  :data:`IMATRIX_CANDIDATES` too) restricted to those whose block divides every row of the
  group (a type that would fall back is the fallback type, already a candidate) and that
  llama-quantize writes without an importance matrix where none is given.
* **Donors**: one file per candidate type, the F32 file with every tensor that can take the
  type quantized to it by qllama's quantizer (llama-quantize's bytes), loaded into the F32
  model for one group at a time with ``weights_from`` (as :mod:`qllama.measure.attribution`
  does).
* **Cells** are cached one JSON file per (group, type), written atomically under a key of
  everything they depend on (the F32 file's and the matrix's hashes, the windows, qllama's
  version): an interrupted measurement resumes with every finished cell.

The reference's logits on the calibration windows are a base file in qllama's ``f32`` format
(:mod:`qllama.measure.kld_base`), so every cell's KL is exact float64 over the whole
vocabulary, with llama-perplexity's statistics and standard error.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from qllama.errors import QllamaError
from qllama.ggml_types import GGMLType

T = GGMLType

# the types a recipe chooses among, smallest first (imatrix-free ones)
CANDIDATES: tuple[GGMLType, ...] = (
    T.Q2_K,
    T.Q3_K,
    T.IQ4_XS,
    T.Q4_0,
    T.IQ4_NL,
    T.Q4_K,
    T.Q4_1,
    T.Q5_0,
    T.Q5_K,
    T.Q5_1,
    T.Q6_K,
    T.Q8_0,
)
# more with an importance matrix: the types llama-quantize writes only with one
IMATRIX_CANDIDATES: tuple[GGMLType, ...] = (T.IQ2_XS, T.IQ3_XXS)

Progress = Callable[[int, int, str], Any]  # (done, total, what runs next)

_BLOCK = re.compile(r"blk\.(\d+)\.(.+)")


@dataclass(frozen=True)
class Group:
    """Tensors that a recipe gives one type: a kind across a band of layers, or one tensor."""

    name: str  # "ffn_down.weight@0-9", "token_embd.weight"
    kind: str  # the name without "blk.N."
    layers: tuple[int, ...]  # () outside the blocks
    tensors: tuple[str, ...]
    row_lengths: tuple[int, ...]  # ne[0] of each tensor
    n_elements: tuple[int, ...]

    def nbytes(self, t: GGMLType) -> int:
        """The group's bytes at type ``t``, as llama-quantize counts them."""
        return sum(t.nbytes(n) for n in self.n_elements)

    def admits(self, t: GGMLType) -> bool:
        """Whether every row divides into ``t``'s blocks (no fallback)."""
        return all(r % t.block.block_size == 0 for r in self.row_lengths)


def quantized_tensors(f: Any) -> list[str]:
    """The tensors llama-quantize quantizes, in its visiting order."""
    from qllama.gguf.quantizer import allows_quantization, visit_order

    arch = f.architecture
    return [n for n in visit_order(list(f.tensors)) if allows_quantization(f.tensors[n], arch)]


def groups(f: Any, bands: int = 3) -> list[Group]:
    """The file's quantized tensors as recipe groups: each kind in ``bands`` equal bands of
    layers, each tensor outside the blocks alone."""
    from qllama.gguf.quantizer import ModelShape

    if bands < 1:
        raise QllamaError(f"the layers need at least one band, not {bands}")
    n_layer = ModelShape.from_gguf(f).n_layer
    bands = min(bands, max(1, n_layer))
    members: dict[tuple[str, int], list[str]] = {}
    for name in quantized_tensors(f):
        m = _BLOCK.fullmatch(name)
        key = (m.group(2), int(m.group(1)) * bands // n_layer) if m else (name, -1)
        members.setdefault(key, []).append(name)
    out = []
    for (kind, band), names in members.items():
        found = [_BLOCK.fullmatch(n) for n in names]
        layers = tuple(sorted(int(m.group(1)) for m in found if m)) if band >= 0 else ()
        label = f"{kind}@{layers[0]}-{layers[-1]}" if layers else kind
        ts = [f.tensors[n] for n in names]
        out.append(
            Group(
                label,
                kind,
                layers,
                tuple(names),
                tuple(t.ne[0] for t in ts),
                tuple(t.n_elements for t in ts),
            )
        )
    return out


def candidates(
    group: Group, types: Sequence[GGMLType] | None = None, *, imatrix: bool = False
) -> list[GGMLType]:
    """The types ``group`` may take: ``types`` (default :data:`CANDIDATES`, with
    :data:`IMATRIX_CANDIDATES` when an importance matrix is given) whose blocks divide its
    rows, without those llama-quantize refuses to write without an importance matrix."""
    from qllama.gguf.quantizer import REQUIRES_IMATRIX

    pool = list(types) if types is not None else [*CANDIDATES, *IMATRIX_CANDIDATES]
    out = [t for t in pool if group.admits(t) and (imatrix or t not in REQUIRES_IMATRIX)]
    return sorted(dict.fromkeys(out), key=lambda t: (group.nbytes(t), t.name))


@dataclass(frozen=True)
class Cell:
    """One group at one type: the KL divergence it adds alone, on the calibration windows."""

    group: str
    type: str
    nbytes: int
    mean_kld: float
    mean_kld_unc: float
    same_top: float


@dataclass
class Sensitivities:
    """Every (group, type) cell of one F32 file, and what they were measured on."""

    file: str
    groups: list[Group]
    cells: dict[str, dict[str, Cell]]  # group -> type -> cell
    fixed_bytes: int  # the tensors no recipe changes (norms...)
    n_elements: int  # every tensor's elements (the bits-per-weight denominator)
    windows: dict[str, Any] = field(default_factory=dict)  # the calibration windows
    base: str = ""  # the F32 model's logits on them (a base file)

    def to_dict(self) -> dict[str, Any]:
        return {
            "file": self.file,
            "windows": self.windows,
            "fixed_bytes": self.fixed_bytes,
            "n_elements": self.n_elements,
            "groups": [asdict(g) for g in self.groups],
            "cells": {g: {t: asdict(c) for t, c in ts.items()} for g, ts in self.cells.items()},
        }


@dataclass(frozen=True)
class Calibration:
    """Where the sensitivities are measured: ``n_windows`` windows of ``n_ctx`` tokens of
    ``corpus``, after its first ``skip`` windows (those a held-out measure scores)."""

    corpus: str = "corpus:botchan"
    n_ctx: int = 512
    skip: int = 16
    n_windows: int = 2


def _threads(threads: int | None) -> dict[str, Any]:
    return {} if threads is None else {"threads": threads}


def _key(*parts: Any) -> str:
    return hashlib.sha256(json.dumps(parts, sort_keys=True).encode()).hexdigest()[:16]


def _calibration_base(
    f32: Path, cal: Calibration, folder: Path, *, threads: int | None
) -> tuple[Any, Any]:
    """The F32 model's logits on the calibration windows (a base file, cached), and the
    windows."""
    from qllama.atomic import exclusive
    from qllama.measure import perplexity as P
    from qllama.measure.corpus import from_spec
    from qllama.measure.kld_base import BaseFile, BaseWriter
    from qllama.runtime.loader import load
    from qllama.runtime.tokenizer import Tokenizer

    body, origin = from_spec(cal.corpus)
    tokenizer = Tokenizer.from_gguf(f32)
    ids = P.tokenize(tokenizer, body)
    bos = tokenizer.bos_id if tokenizer.add_bos else None
    every = P.windows(ids, cal.n_ctx, bos=bos)
    if every.n_chunk < cal.skip + cal.n_windows:
        raise QllamaError(
            f"{cal.corpus} has {every.n_chunk} windows of {cal.n_ctx} tokens: too few for "
            f"{cal.n_windows} calibration windows after the {cal.skip} held out"
        )
    wins = P.Windows(every.tokens[cal.skip : cal.skip + cal.n_windows], bos)  # (n, n_ctx)
    path = folder / "calibration.base"
    with exclusive(folder / "calibration.lock"):
        if not path.is_file():
            model = load(f32, arithmetic="f32", n_ctx=cal.n_ctx, **_threads(threads))
            meta = {"model": f32.name, "setting": "f32", "text": origin, "skip": cal.skip}
            with BaseWriter(
                path,
                "f32",
                n_ctx=cal.n_ctx,
                n_vocab=tokenizer.n_vocab,
                tokens=wins.tokens,
                meta=meta,
            ) as save:
                P.run(P.qllama_scorer(model), wins, save=save)
            model.source.close()
    return BaseFile.open(path), wins


def _donor(
    f32: Path,
    t: GGMLType,
    names: Sequence[str],
    folder: Path,
    imatrix: Path | None,
) -> Path:
    """The F32 file with ``names`` quantized to ``t`` (the rest Q8_0, never read), cached."""
    from qllama.atomic import exclusive
    from qllama.gguf.quantizer import Overrides, quantize_file

    pattern = "^(" + "|".join(re.escape(n) for n in names) + ")$"
    path = folder / f"donor-{t.name}-{_key(pattern)[:8]}.gguf"
    with exclusive(path.with_suffix(".lock")):
        if not path.is_file():
            overrides = Overrides(((pattern, t),))
            quantize_file(f32, path, "Q8_0", imatrix=imatrix, overrides=overrides)
    return path


def measure(
    f32_path: str | os.PathLike[str],
    *,
    bands: int = 3,
    types: Sequence[GGMLType] | None = None,
    imatrix: str | os.PathLike[str] | None = None,
    calibration: Calibration = Calibration(),
    cache: str | os.PathLike[str] | None = None,
    threads: int | None = None,
    progress: Progress | None = None,
) -> Sensitivities:
    """Every group's sensitivity at every candidate type (module docstring), each cell read
    from the cache or measured and cached at once."""
    from qllama import defaults
    from qllama.atomic import atomic_write
    from qllama.gguf.reader import read_gguf
    from qllama.measure import perplexity as P
    from qllama.measure.metrics import summarize
    from qllama.model_files import file_sha256
    from qllama.runtime.loader import load
    from qllama.version import __version__

    f32 = Path(f32_path)
    with read_gguf(f32) as f:
        if any(t.ggml_type != T.F32 for t in f.tensors.values() if len(t.ne) >= 2):
            raise QllamaError(f"{f32.name}: a recipe starts from an F32 file (every weight F32)")
        gs = groups(f, bands)
        n_elements = sum(t.n_elements for t in f.tensors.values())
        changed = {n for g in gs for n in g.tensors}
        fixed = sum(t.nbytes for n, t in f.tensors.items() if n not in changed)
    matrix = Path(imatrix) if imatrix is not None else None
    if matrix is not None and not matrix.is_file():
        raise QllamaError(f"no importance matrix file {matrix}")
    options = {g.name: candidates(g, types, imatrix=matrix is not None) for g in gs}
    empty = [g.name for g, ts in zip(gs, options.values(), strict=True) if not ts]
    if empty:
        raise QllamaError(f"no candidate type divides the rows of {', '.join(empty)}")
    key = _key(
        file_sha256(f32),
        file_sha256(matrix) if matrix is not None else None,
        asdict(calibration),
        __version__,
    )
    folder = defaults.cache_dir(cache) / "recipe-sensitivity" / key
    folder.mkdir(parents=True, exist_ok=True)
    base, wins = _calibration_base(f32, calibration, folder, threads=threads)
    plan = [(g, t) for g in gs for t in options[g.name]]
    cells: dict[str, dict[str, Cell]] = {g.name: {} for g in gs}
    for done, (g, t) in enumerate(plan):
        path = folder / "cells" / f"{g.name}.{t.name}.json"
        if path.is_file():
            cells[g.name][t.name] = Cell(**json.loads(path.read_text()))
            continue
        if progress is not None:
            progress(done, len(plan), f"{g.name} at {t.name}")
        takers = [n for h in gs if t in options[h.name] for n in h.tensors]
        donor = _donor(f32, t, takers, folder, matrix)
        model = load(
            f32,
            arithmetic="f32",
            n_ctx=calibration.n_ctx,
            check_weights=False,
            weights_from=dict.fromkeys(g.tensors, donor),
            **_threads(threads),
        )
        scores = P.run(P.qllama_scorer(model), wins, base=base)
        model.source.close()
        kl = summarize(scores.token_values())
        cell = Cell(g.name, t.name, g.nbytes(t), kl.mean_kld, kl.mean_kld_unc, kl.same_top)
        with atomic_write(path, "w") as out:
            json.dump(asdict(cell), out)
        cells[g.name][t.name] = cell
    if progress is not None:
        progress(len(plan), len(plan), "done")
    return Sensitivities(
        file=str(f32),
        groups=gs,
        cells=cells,
        fixed_bytes=fixed,
        n_elements=n_elements,
        windows={**asdict(calibration), "positions": int(wins.n_chunk * wins.n_scored)},
        base=str(base.path),
    )


def whole(
    path: str | os.PathLike[str], sens: Sensitivities, *, threads: int | None = None
) -> tuple[float, float]:
    """A whole file's mean KL divergence and its standard error on the calibration windows,
    under the cells' arithmetic: what the sum of the cells predicts, measured."""
    from qllama.measure import perplexity as P
    from qllama.measure.kld_base import BaseFile
    from qllama.measure.metrics import summarize
    from qllama.runtime.loader import load

    base = BaseFile.open(sens.base)
    model = load(path, arithmetic="f32", n_ctx=base.header.n_ctx, **_threads(threads))
    wins = P.windows_of_base(base, model.tokenizer)
    scores = P.run(P.qllama_scorer(model), wins, base=base)
    model.source.close()
    kl = summarize(scores.token_values())
    return kl.mean_kld, kl.mean_kld_unc


__all__ = [
    "CANDIDATES",
    "IMATRIX_CANDIDATES",
    "Calibration",
    "Cell",
    "Group",
    "Sensitivities",
    "candidates",
    "groups",
    "measure",
    "quantized_tensors",
    "whole",
]
