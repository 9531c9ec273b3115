"""matplotlib for the measures' plots: loaded for files only, saved whole or not at all."""

from __future__ import annotations

import os
from typing import Any

from qllama.errors import QllamaError


def pyplot() -> Any:
    """``matplotlib.pyplot`` on the Agg backend (no display where plots are written), or
    qllama's error naming the extra that installs it."""
    try:
        import matplotlib
    except ImportError:
        raise QllamaError("plotting needs matplotlib: pip install 'qllama[plot]'") from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def save(fig: Any, path: str | os.PathLike[str], *, dpi: int = 100, **options: Any) -> None:
    """Write ``fig`` as a PNG at ``path`` atomically, then release it."""
    from qllama.atomic import atomic_write

    with atomic_write(path) as f:
        fig.savefig(f, format="png", dpi=dpi, **options)
    pyplot().close(fig)
