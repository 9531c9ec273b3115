"""Peer comparisons need llama-cpp-python (built by `nox -s peers`); without it they are not
collected at all."""

from __future__ import annotations

import importlib.util

collect_ignore_glob = [] if importlib.util.find_spec("llama_cpp") else ["test_*.py"]
