"""The models a server holds, by name, and their hot swap.

A request takes a reference to the :class:`LoadedModel` its ``model`` names when it starts
and runs on it to the end. Loading a file under a name already in use replaces the entry for
new requests only; the old entry is retired, and its weights (the file's map, the backend's
arrays) go when its last reference is released. Unloading retires without a replacement.

``load`` only reads files inside the allowed folders (by default the folders of the files
the server started with), so an admin request cannot make the server open any path it likes.
"""

from __future__ import annotations

import os
import threading
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from qllama.backends.base import arithmetic
from qllama.ggml_types import FileType
from qllama.model_files import sha256_file
from qllama.runtime.loader import load
from qllama.runtime.model import Model
from qllama.serve.errors import APIError, not_found


@dataclass(frozen=True)
class ModelInfo:
    """What every response says about the model that computed it."""

    name: str
    file: str  # the file's name (never the server's folders)
    sha256: str
    architecture: str
    file_type: str | None  # general.file_type, as llama-quantize names it
    backend: str
    device: str
    arithmetic: str
    n_ctx: int
    loaded: int  # unix time

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @property
    def fingerprint(self) -> str:
        """OpenAI's ``system_fingerprint``: backend, arithmetic and the file's hash."""
        return f"qllama-{self.backend}-{self.arithmetic}-{self.sha256[:16]}"


class LoadedModel:
    """One loaded file, shared by the requests running on it (counted references)."""

    def __init__(self, model: Model, info: ModelInfo) -> None:
        self.model: Model | None = model
        self.info = info
        self._refs = 0
        self._lock = threading.Lock()
        self.retired = False

    @property
    def name(self) -> str:
        return self.info.name

    @property
    def closed(self) -> bool:
        return self.model is None

    def acquire(self) -> LoadedModel:
        with self._lock:
            if self.model is None:
                raise APIError(503, f"model {self.name!r} was just unloaded; retry")
            self._refs += 1
            return self

    def release(self) -> None:
        with self._lock:
            self._refs -= 1
            last = self._refs == 0 and self.retired
        if last:
            self._close()

    def retire(self) -> None:
        """No new requests; close now if none is running, else when the last one ends."""
        with self._lock:
            self.retired = True
            idle = self._refs == 0
        if idle:
            self._close()

    def _close(self) -> None:
        with self._lock:
            model, self.model = self.model, None
        if model is not None and model.source is not None:
            model.source.close()  # the map goes once the last array view of it is collected


def describe(name: str, path: Path, model: Model, sha256: str) -> ModelInfo:
    raw = model.source.get("general.file_type") if model.source is not None else None
    try:
        file_type = FileType(int(raw)).label if raw is not None else None
    except (TypeError, ValueError):
        file_type = None
    be = model.backend
    return ModelInfo(
        name=name,
        file=path.name,
        sha256=sha256,
        architecture=model.config.arch,
        file_type=file_type,
        backend=be.name,
        device=str(be.device),
        arithmetic=arithmetic(be),
        n_ctx=model.n_ctx,
        loaded=int(time.time()),
    )


def load_model(name: str, path: str | os.PathLike[str], **options: Any) -> LoadedModel:
    """Load a file for serving (blocking: reads, checks and hashes the whole file)."""
    p = Path(path)
    model = load(p, **options)
    try:
        return LoadedModel(model, describe(name, p, model, sha256_file(p)))
    except BaseException:
        model.source.close()
        raise


class ModelRegistry:
    """Name -> the entry new requests get; the first model added is the default."""

    def __init__(self, allowed_dirs: list[Path] | None = None) -> None:
        self._entries: dict[str, LoadedModel] = {}
        self._retired: list[LoadedModel] = []
        self._lock = threading.Lock()
        self.allowed_dirs = [d.resolve() for d in allowed_dirs or []]

    def names(self) -> list[str]:
        with self._lock:
            return list(self._entries)

    def entries(self) -> list[LoadedModel]:
        with self._lock:
            return list(self._entries.values())

    def put(self, entry: LoadedModel) -> LoadedModel | None:
        """Make ``entry`` the one its name gives; retire and return the one it replaces."""
        with self._lock:
            old = self._entries.get(entry.name)
            self._entries[entry.name] = entry
            if old is not None:
                self._retired.append(old)
        if old is not None:
            old.retire()
        return old

    def remove(self, name: str) -> LoadedModel:
        with self._lock:
            entry = self._entries.pop(name, None)
            if entry is None:
                known = list(self._entries)
            else:
                self._retired.append(entry)
        if entry is None:
            raise not_found("model", name, known)
        entry.retire()
        return entry

    def acquire(self, name: str | None) -> LoadedModel:
        """A reference to the model ``name`` names (None: the default, the first one)."""
        with self._lock:
            if name is None:
                entry = next(iter(self._entries.values()), None)
                if entry is None:
                    raise APIError(404, "no model is loaded", code="model_not_found")
            else:
                entry = self._entries.get(name)
                if entry is None:
                    raise not_found("model", name, list(self._entries))
            return entry.acquire()

    def retired_alive(self) -> int:
        """Retired entries whose weights are still held by running requests."""
        with self._lock:
            self._retired = [e for e in self._retired if not e.closed]
            return len(self._retired)

    def resolve(self, path: str) -> Path:
        """``path`` (absolute, or relative to the first allowed folder) if it is a file inside
        an allowed folder, links resolved; else a 400 that does not say what exists."""
        if not self.allowed_dirs:
            raise APIError(403, "this server loads no files on request (no allowed folder)")
        if "\0" in path:
            raise APIError(400, "the path has a NUL character", param="path")
        p = Path(path)
        full = (p if p.is_absolute() else self.allowed_dirs[0] / p).resolve()
        if not any(full.is_relative_to(d) for d in self.allowed_dirs):
            raise APIError(
                400, "the path is outside the folders this server loads from", param="path"
            )
        if not full.is_file():
            raise APIError(404, "no such model file", code="model_file_not_found", param="path")
        return full

    def close(self) -> None:
        with self._lock:
            entries = list(self._entries.values())
            self._entries.clear()
        for e in entries:
            e.retire()
