"""Write a file completely or not at all: to a temporary name beside it, then rename."""

from __future__ import annotations

import contextlib
import os
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import IO, Any


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


@contextlib.contextmanager
def atomic_write(
    path: str | os.PathLike[str], mode: str = "wb", **kwargs: Any
) -> Iterator[IO[Any]]:
    """Open a temporary file next to ``path``; on clean exit fsync it and rename it to ``path``.

    If the block raises (or the process dies), ``path`` is untouched and the temporary file is
    removed (or, after a crash, left under a ``.tmp`` name that no reader mistakes for output).
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        os.chmod(tmp, 0o666 & ~_umask())  # mkstemp makes 0600; give what open() would
        with os.fdopen(fd, mode, **kwargs) as f:
            yield f
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise


@contextlib.contextmanager
def exclusive(path: str | os.PathLike[str]) -> Iterator[None]:
    """Hold an exclusive lock on the file ``path`` (created if missing) for the block, so that
    processes making the same cached file wait for the first instead of each making it.
    Where the platform has no ``fcntl`` (Windows) the block runs unlocked: each process
    then makes the file itself, and :func:`atomic_write` keeps every copy whole."""
    try:
        import fcntl
    except ImportError:  # pragma: no cover - Windows
        yield
        return
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)
