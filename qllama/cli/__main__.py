"""``python -m qllama.cli``: the ``qllama`` command from a checkout, without installing it."""

from __future__ import annotations

import sys

from qllama.cli import main

sys.exit(main())
