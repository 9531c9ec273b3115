"""``python -m qllama``: the ``qllama`` command."""

from __future__ import annotations

import sys

from qllama.cli import main

sys.exit(main())
