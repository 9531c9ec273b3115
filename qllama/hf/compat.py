"""Which transformers releases ``qllama.hf`` runs with: the tested range, and what it needs.

transformers moves the APIs the adapter implements between releases (the ``Cache`` layers, the
``cache`` / ``past_key_values`` argument, ``crop``'s meaning). A release outside
:data:`TRANSFORMERS_RANGE` (the oldest and newest tested by ``nox -s hf``) is not refused for
its number: importing ``qllama.hf`` warns, naming the range, and refuses only when one of the
APIs in :data:`REQUIRED` is missing, naming it.
"""

from __future__ import annotations

import importlib
import inspect
import re
import warnings
from collections.abc import Callable
from typing import Any

TRANSFORMERS_RANGE = ("4.57.6", "5.25.0")  # tested at both ends, and 5.0.0 (nox -s hf)


class UntestedTransformersWarning(UserWarning):
    """transformers is outside :data:`TRANSFORMERS_RANGE`: it may work, it was not tested."""


def _version(text: str) -> tuple[int, ...]:
    return tuple(int(x) for x in re.findall(r"\d+", text)[:3])


def check_transformers_version(version: str) -> bool:
    """Warn when ``version`` is outside :data:`TRANSFORMERS_RANGE`; True when inside."""
    low, high = TRANSFORMERS_RANGE
    if _version(low) <= _version(version) <= _version(high):
        return True
    warnings.warn(
        f"qllama.hf is tested with transformers {low} to {high}; transformers {version} is "
        "installed. It runs as long as the APIs qllama.hf uses are there (checked at import); "
        f"pip install 'transformers>={low},<={high}' for a tested one",
        UntestedTransformersWarning,
        stacklevel=3,
    )
    return False


def _has_parameter(name: str) -> Callable[[Any], bool]:
    return lambda obj: name in inspect.signature(obj).parameters


def _has_field(*names: str) -> Callable[[Any], bool]:
    return lambda obj: any(n in getattr(obj, "__dataclass_fields__", {}) for n in names)


# (module, attribute, test of the attribute or None, what the adapter does with it)
REQUIRED: tuple[tuple[str, str, Callable[[Any], bool] | None, str], ...] = (
    ("transformers", "PreTrainedModel", None, "the model's base class"),
    ("transformers", "GenerationMixin", None, "generate"),
    ("transformers", "PreTrainedTokenizer", None, "QllamaTokenizer's base class"),
    ("transformers.cache_utils", "Cache", None, "the cache generate threads between calls"),
    (
        "transformers.cache_utils",
        "CacheLayerMixin",
        None,
        "QllamaCache's layer (the layered Cache API, from transformers 4.56)",
    ),
    (
        "transformers.cache_utils",
        "Cache.__init__",
        _has_parameter("layers"),
        "Cache(layers=[...]), which QllamaCache is built with",
    ),
    (
        "transformers.modeling_outputs",
        "CausalLMOutputWithPast",
        _has_field("cache", "past_key_values"),
        "the forward pass's output, with a cache or past_key_values field",
    ),
)


def missing_apis() -> list[str]:
    """The entries of :data:`REQUIRED` this transformers lacks, each as a sentence."""
    out = []
    for module, attribute, test, why in REQUIRED:
        try:
            obj: Any = importlib.import_module(module)
            for part in attribute.split("."):
                obj = getattr(obj, part)
            ok = test is None or test(obj)
        except (ImportError, AttributeError, TypeError, ValueError):
            ok = False
        if not ok:
            what = "with the expected signature" if test is not None else ""
            out.append(f"{module}.{attribute} {what}".strip() + f" ({why})")
    return out


def check_transformers(version: str) -> None:
    """At import: warn outside the tested range, refuse (ImportError) a missing API."""
    check_transformers_version(version)
    missing = missing_apis()
    if missing:
        low, high = TRANSFORMERS_RANGE
        raise ImportError(
            f"qllama.hf cannot run with transformers {version}: it lacks "
            + "; ".join(missing)
            + f". Tested with transformers {low} to {high}: pip install 'qllama[hf]'"
        )
