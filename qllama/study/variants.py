"""The files of a study: each variant built once from the model source, and named by its hash.

A known model (``qllama fetch``) goes through :func:`qllama.model_files.variant`; a GGUF path
is quantized the same way (F32 first, every other type from it) into the cache, under the
source's hash. qllama's quantizer is deterministic, so a worker that builds a variant itself
writes the same bytes as the driver did: :func:`resolve` checks the sha256 either way.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

from qllama import defaults
from qllama.model_files import MODELS, file_sha256
from qllama.study.declaration import StudyError, Variant
from qllama.version import __version__


@dataclass(frozen=True)
class VariantFile:
    """A built variant: where it is on the machine that built it, and its content hash."""

    variant: Variant
    path: str
    sha256: str


def _all_f32(path: Path) -> bool:
    """Whether every tensor of the file is F32 (its F32 variant is the file itself)."""
    from qllama.ggml_types import GGMLType
    from qllama.gguf.reader import read_gguf

    with read_gguf(path) as f:
        return all(t.ggml_type == GGMLType.F32 for t in f.tensors.values())


def _from_path(source: Path, label: str, cache: str | os.PathLike[str] | None) -> Path:
    """``source`` as file type ``label``: F32 dequantized from it, the rest from that F32. An
    F32 source is its own F32 variant: used in place, not copied into the cache."""
    from qllama.model_files import quantized_once

    if label == "F32" and _all_f32(source):
        return source
    origin = source if label == "F32" else _from_path(source, "F32", cache)
    folder = defaults.cache_dir(cache) / "study-variants" / file_sha256(source)[:16]
    path = folder / f"{source.stem}.{label}.gguf"
    return quantized_once(
        origin, path, label, {"source_sha256": file_sha256(origin), "qllama": __version__}
    )


def build(
    source: str | Path, variant: Variant, *, cache: str | os.PathLike[str] | None = None
) -> VariantFile:
    """Build (or find in the cache) the file of ``variant`` from the model ``source``; a
    variant that names its ``file`` is that file."""
    from qllama.gguf.quantizer import file_type
    from qllama.model_files import fetch
    from qllama.model_files import variant as named_variant

    if variant.file is not None:
        path = Path(variant.file)
        if not path.is_file():
            raise StudyError(f"variant {variant.name!r}: no file {path} on this machine")
        return VariantFile(variant, str(path), file_sha256(path))
    if variant.imatrix or variant.imatrix_corpus or variant.tensor_types:
        return _quantized_from_f32(source, variant, cache)
    if variant.type == "source":
        path = fetch(str(source), cache=cache) if source in MODELS else Path(source)
    else:
        label = file_type(variant.type).label
        if isinstance(source, str) and source in MODELS:
            path = named_variant(source, label, cache=cache)
        else:
            path = _from_path(Path(source), label, cache)
    if not Path(path).is_file():
        raise StudyError(f"the model file {path} does not exist")
    return VariantFile(variant, str(path), file_sha256(path))


def _quantized_from_f32(
    source: str | Path, variant: Variant, cache: str | os.PathLike[str] | None
) -> VariantFile:
    """``variant`` quantized from the F32 file with its importance matrix and/or its
    ``--tensor-type`` overrides, as llama-quantize ``--imatrix`` and ``--tensor-type`` do:
    the matrix file it names, or one computed from its corpus as llama-imatrix computes it
    (the CPU arithmetic on the F32 file, windows of 512), kept in the cache."""
    import hashlib

    from qllama.gguf.quantizer import Overrides, file_type
    from qllama.model_files import quantized_once

    if variant.type in ("source", "F32"):
        what = "tensor types need" if variant.tensor_types else "an importance matrix needs"
        raise StudyError(f"variant {variant.name!r}: {what} a quantized type")
    f32 = Path(build(source, Variant("F32"), cache=cache).path)
    folder = defaults.cache_dir(cache) / "study-variants" / file_sha256(f32)[:16]
    matrix: Path | None = None
    if variant.imatrix:
        matrix = Path(variant.imatrix)
        if not matrix.is_file():
            raise StudyError(f"variant {variant.name!r}: no imatrix file {matrix}")
    elif variant.imatrix_corpus:
        matrix = _computed_imatrix(f32, variant, folder)
    label = file_type(variant.type).label
    stamp: dict[str, object] = {"source_sha256": file_sha256(f32), "qllama": __version__}
    name = f"{f32.stem.removesuffix('.F32')}.{label}"
    overrides = None
    if variant.tensor_types:
        overrides = Overrides.parse(list(variant.tensor_types))
        digest = hashlib.sha256(json.dumps(overrides.as_arguments()).encode()).hexdigest()
        name += f"-overrides-{digest[:12]}"
        stamp["overrides_sha256"] = digest
    if matrix is not None:
        digest = file_sha256(matrix)
        name += f"-imatrix-{digest[:12]}"
        stamp["imatrix_sha256"] = digest
    path = folder / f"{name}.gguf"
    # llama-quantize records the matrix's path as given (quantize.imatrix.file); the file's
    # name alone keeps the variant's bytes, and so its hash, the same on every machine
    quantized_once(
        f32,
        path,
        label,
        stamp,
        imatrix=matrix,
        imatrix_name=matrix.name if matrix is not None else None,
        overrides=overrides,
    )
    return VariantFile(variant, str(path), file_sha256(path))


def _computed_imatrix(f32: Path, variant: Variant, folder: Path) -> Path:
    """The importance matrix of ``variant.imatrix_corpus`` on ``f32`` (cached by content)."""
    import hashlib

    from qllama.atomic import exclusive
    from qllama.gguf.imatrix import write_imatrix
    from qllama.measure.corpus import from_spec
    from qllama.measure.importance import from_corpus

    assert variant.imatrix_corpus is not None
    text, origin = from_spec(variant.imatrix_corpus)
    what = [file_sha256(f32), origin["sha256"], variant.imatrix_chunks, __version__]
    if variant.imatrix_skip_chunks:  # (a key without a skip is the one it always was)
        what.append(variant.imatrix_skip_chunks)
    key = hashlib.sha256(json.dumps(what).encode()).hexdigest()[:16]
    path = folder / f"imatrix-{key}.gguf"
    with exclusive(path.with_suffix(".lock")):
        if not path.is_file():
            m = from_corpus(
                f32,
                text,
                n_chunks=variant.imatrix_chunks,
                skip_chunks=variant.imatrix_skip_chunks,
                dataset=origin.get("corpus") or origin.get("file"),
            )
            write_imatrix(path, m)
    return path


def resolve(
    expected: VariantFile, source: str | Path, *, cache: str | os.PathLike[str] | None = None
) -> Path:
    """The variant's file on this machine: the driver's path when it is here with the same
    hash (a shared folder), else built here from the declaration; refused if the hash differs."""
    path = Path(expected.path)
    if path.is_file() and file_sha256(path) == expected.sha256:
        return path
    built = build(source, expected.variant, cache=cache)
    if built.sha256 != expected.sha256:
        raise StudyError(
            f"variant {expected.variant.name!r} built here has sha256 {built.sha256[:16]}…, the "
            f"driver's has {expected.sha256[:16]}… (another qllama version or source file?)"
        )
    return Path(built.path)
