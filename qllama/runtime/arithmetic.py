"""Arithmetic per tensor: a policy maps GGUF tensor-name patterns to how each matmul is computed.

``qllama.load(path, arithmetic={"blk.*.ffn_down.weight": "q8", "*": "f32"})`` computes the
``ffn_down`` products as the CPU does and every other one with float activations. The first
pattern that matches a tensor's name wins (:mod:`fnmatch` patterns: ``*`` also matches dots),
every 2-D weight must be matched, and every pattern must match one (a typo is an error, not
a silent no-op). A plain string (``arithmetic="f32"``) is the policy ``{"*": ...}``.

===============  ===================================================================
arithmetic       what a matmul with the tensor computes
===============  ===================================================================
``q8``           activations quantized per row to the weight's ``vec_dot_type``, integer
                 block dot products (the CPU arithmetic, llama.cpp's)
``f32``          float32 activations times the weight dequantized inside the matmul (the
                 GPU arithmetic)
``dequantized``  float32 activations times float32 weights widened once, at load
===============  ===================================================================

The backend protocol does not change: each arithmetic is one ordinary backend built with the
options of :data:`ROUTES`, and :class:`PolicyBackend` hands each tensor at ``prepare`` to the
one its policy names; ``matmul`` and ``embedding`` go where the weight went. The model never
learns of it. Which backend offers which arithmetic is declared here:

================  ======  ======  ===========
backend           q8      f32     dequantized
================  ======  ======  ===========
numpy             yes     yes     yes
torch             no      yes     yes
jax               no      yes     yes
array_api_strict  no      yes     yes
================  ======  ======  ===========

(:data:`UNSUPPORTED` says why.) A policy naming one arithmetic only gives that plain backend.
"""

from __future__ import annotations

import fnmatch
from collections import Counter
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any, ClassVar

from qllama import defaults
from qllama.backends import get_backend
from qllama.backends.base import (
    Backend,
    QuantTensor,
    attention_bytes,
    attention_scores,
    describe,
)
from qllama.errors import BackendError
from qllama.ggml_types import GGMLType

ARITHMETICS = ("q8", "f32", "dequantized")

# backend -> arithmetic -> the backend options that compute it
ROUTES: dict[str, dict[str, dict[str, Any]]] = {
    "numpy": {
        "q8": {"activations": "q8"},
        "f32": {"activations": "f32"},
        "dequantized": {"dequantize_all": True},
    },
    **{
        name: {"f32": {}, "dequantized": {"dequantize_all": True}}
        for name in ("torch", "jax", "array_api_strict")
    },
}
_FLOAT_ONLY = (
    "it computes float32 activations only; the CPU arithmetic (activations quantized to Q8, "
    "integer block sums) is the numpy backend's"
)
UNSUPPORTED: dict[tuple[str, str], str] = {
    (name, "q8"): _FLOAT_ONLY for name in ("torch", "jax", "array_api_strict")
}

# options a policy decides per tensor; giving them as well would be ambiguous
_POLICY_OPTIONS = ("activations", "dequantize_all")

Policy = Mapping[str, str] | str


def as_policy(policy: Policy) -> dict[str, str]:
    """The policy as an ordered pattern -> arithmetic dict, every arithmetic checked."""
    rules = {"*": policy} if isinstance(policy, str) else dict(policy)
    if not rules:
        raise BackendError("the arithmetic policy is empty; give at least {'*': ...}")
    for pattern, arithmetic in rules.items():
        if arithmetic not in ARITHMETICS:
            raise BackendError(
                f"arithmetic {arithmetic!r} (for {pattern!r}) is not one of "
                f"{', '.join(ARITHMETICS)}"
            )
    return rules


def resolve(policy: Policy, names: Iterable[str]) -> dict[str, str]:
    """Each tensor name -> its arithmetic: the first matching pattern wins."""
    rules = as_policy(policy)
    routes: dict[str, str] = {}
    used: set[str] = set()
    for name in names:
        pattern = next((p for p in rules if fnmatch.fnmatchcase(name, p)), None)
        if pattern is None:
            raise BackendError(
                f"the arithmetic policy has no pattern for tensor '{name}'; add a '*' entry last"
            )
        routes[name] = rules[pattern]
        used.add(pattern)
    unused = [p for p in rules if p not in used]
    if unused:
        raise BackendError(
            f"arithmetic pattern(s) {', '.join(repr(p) for p in unused)} match no 2-D weight "
            "of the file (or only ones an earlier pattern took)"
        )
    return routes


def backend_options(backend: str, arithmetic: str) -> dict[str, Any]:
    """The options that make ``backend`` compute ``arithmetic`` (a declared table)."""
    routes = ROUTES.get(backend)
    if routes is None:
        raise BackendError(
            f"backend {backend} declares no per-tensor arithmetics (known: {', '.join(ROUTES)})"
        )
    if arithmetic not in routes:
        why = UNSUPPORTED.get((backend, arithmetic), "not declared")
        raise BackendError(f"backend {backend} has no {arithmetic!r} arithmetic: {why}")
    return dict(routes[arithmetic])


@dataclass(frozen=True)
class Routed:
    """A weight prepared by the backend of its arithmetic."""

    backend: Backend
    weight: Any
    arithmetic: str


class PolicyBackend:
    """Several backends of one namespace; each tensor goes to the one its policy names."""

    name: ClassVar[str] = "policy"

    def __init__(self, backends: Mapping[str, Backend], routes: Mapping[str, str]) -> None:
        first = next(iter(backends.values()))
        self.backends = dict(backends)
        self.routes = dict(routes)  # tensor name -> arithmetic
        self.xp = first.xp
        self.device = first.device
        self.dequantize_all = False
        # what is not a weight's product (the attention) is computed as the backend computes
        # it alone: its block size and its scores (an orientation chosen by the CPU's BLAS)
        self._first = first
        self.attention_bytes = attention_bytes(first)

    def attention_scores(self, q: Any, k: Any) -> Any:
        return attention_scores(self._first, q, k)

    def describe(self) -> str:
        """The policy as counts of tensors per arithmetic, then each backend's line."""
        counts = Counter(self.routes.values())
        split = ", ".join(f"{a} for {n} tensors" for a, n in counts.most_common())
        each = "; ".join(f"{a}: {describe(b)}" for a, b in self.backends.items())
        return f"per-tensor arithmetic ({split}); {each}"

    def supports(self, ggml_type: GGMLType) -> bool:
        return any(b.supports(ggml_type) for b in self.backends.values())

    def prepare(self, tensor: QuantTensor) -> Routed:
        arithmetic = self.routes.get(tensor.name)
        if arithmetic is None:
            raise BackendError(f"the arithmetic policy names no arithmetic for '{tensor.name}'")
        backend = self.backends[arithmetic]
        return Routed(backend, backend.prepare(tensor), arithmetic)

    def matmul(self, x: Any, w: Routed) -> Any:
        return w.backend.matmul(x, w.weight)

    def embedding(self, ids: Any, w: Routed) -> Any:
        return w.backend.embedding(ids, w.weight)

    def asarray(self, x: Any) -> Any:
        return self._first.asarray(x)


def policy_backend(
    backend: str | Backend | None,
    policy: Policy,
    names: Iterable[str],
    *,
    device: str | None = None,
    dequantize_all: bool | None = None,
    **options: Any,
) -> Backend:
    """The backend computing ``policy`` for the 2-D weights ``names``.

    ``backend`` is a name (default ``$QLLAMA_BACKEND``, else numpy); the policy decides the
    activations and dequantize-all per tensor, so those options (and ``QLLAMA_DEQUANTIZE_ALL``)
    are not taken with it. Other options (``kernels``, ``activation_rounding``...) go to every
    backend built.
    """
    if not isinstance(backend, str | None):
        raise BackendError("arithmetic= builds its own backends: give a backend name, not one")
    clash = [o for o in _POLICY_OPTIONS if options.get(o) is not None]
    if dequantize_all:
        clash.append("dequantize_all")
    if clash:
        raise BackendError(
            f"arithmetic= decides {' and '.join(clash)} per tensor; drop {', '.join(clash)} "
            "(use 'dequantized' or 'f32' in the policy)"
        )
    name = defaults.backend(backend)
    routes = resolve(policy, names)
    built: dict[str, Backend] = {}
    for arithmetic in dict.fromkeys(routes.values()):
        route = backend_options(name, arithmetic)
        dequantize = bool(route.pop("dequantize_all", False))
        built[arithmetic] = get_backend(
            name, device=device, dequantize_all=dequantize, **options, **route
        )
    if len(built) == 1:  # one arithmetic everywhere: the plain backend, nothing routed
        return next(iter(built.values()))
    return PolicyBackend(built, routes)


@dataclass(frozen=True)
class Setting:
    """A whole-model arithmetic on a backend: the policy ``{"*": arithmetic}``."""

    name: str
    backend: str
    arithmetic: str
    about: str


SETTINGS = {
    s.name: s
    for s in (
        Setting("cpu", "numpy", "q8", "activations quantized to Q8 (llama.cpp CPU)"),
        Setting("gpu", "torch", "f32", "f32 activations, weights dequantized in each matmul"),
        Setting("dequantize-all", "numpy", "dequantized", "f32 weights widened at load"),
        Setting("f32", "numpy", "f32", "the GPU arithmetic on numpy"),
    )
}


def setting(name: str) -> Setting:
    """A named setting, or a clear error listing them."""
    if name not in SETTINGS:
        raise BackendError(f"unknown setting {name!r}; known: {', '.join(SETTINGS)}")
    return SETTINGS[name]
