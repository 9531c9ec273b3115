"""The jinja2 sandbox that renders a chat template (:mod:`qllama.runtime.chat_template`).

A chat template is Jinja code from a stranger's file. It runs in jinja2's
``ImmutableSandboxedEnvironment`` (``trim_blocks``, ``lstrip_blocks``, loop controls, and
transformers' ``raise_exception``, ``strftime_now``, ``tojson``, ``dict`` and
``namespace``). The sandbox blocks escapes; on its own it does nothing against resource
exhaustion. So every render carries a budget that needs no thread or subprocess:

- steps: each loop iteration, call, filter, attribute or item lookup and intercepted
  operator spends one. The template's loops are rewritten to pass through a counting
  iterator, so an empty nested loop also runs out. The wall-clock deadline is checked at
  the same points.
- values: no string, list or dict the template builds may weigh more than ``max_value``
  (characters plus items). Operators and functions that multiply (``*``, ``**``, ``+``,
  ``%``, ``~``, ``center``, ``replace``, ``join``, ``format``, ``indent``, ``tojson``...)
  are refused *before* they allocate. Integer arguments are capped, and ``range`` is capped
  at ``max_range`` items.
- output: rendering streams through ``Template.generate()`` and stops at ``max_output``
  characters.

Any failure, whether a syntax error, a sandbox refusal, an undefined value, a recursion, an
exhausted budget or ``raise_exception``, becomes one :class:`~qllama.errors.ChatTemplateError`
that gives the reason. The process goes on.

Imported with the first render, not with :mod:`qllama`: jinja2 weighs 7 MB resident, and a
process that only computes never renders.
"""

from __future__ import annotations

import contextvars
import functools
import json
import re
import time
import types
from collections.abc import Callable, Iterator, Mapping, Sequence
from datetime import datetime
from typing import Any

import jinja2
import jinja2.ext
import jinja2.utils
import numpy as np
from jinja2 import nodes
from jinja2.exceptions import SecurityError, TemplateError, TemplateSyntaxError
from jinja2.sandbox import ImmutableSandboxedEnvironment
from jinja2.visitor import NodeTransformer

from qllama.errors import ChatTemplateError
from qllama.runtime.template_limits import DEFAULT_LIMITS, Limits

MIN_JINJA2 = (3, 1, 6)  # older sandboxes have known escapes (CVE-2024-56326, CVE-2025-27516)


def check_jinja2_version(version: str) -> None:
    """Refuse a jinja2 older than 3.1.6 (raises ImportError)."""
    found = tuple(int(x) for x in re.findall(r"\d+", version)[:3])
    if found < MIN_JINJA2:
        raise ImportError(
            "qllama.runtime.template_sandbox needs jinja2 >= 3.1.6 (sandbox escapes are fixed "
            f"there); "
            f"jinja2 {version} is installed: pip install -U 'jinja2>=3.1.6'"
        )


check_jinja2_version(jinja2.__version__)


class _Stop(BaseException):
    """A budget ran out. It is a BaseException so that no ``except Exception`` in jinja2 or in
    a filter can swallow it on the way up."""


class _TemplateRaised(TemplateError):
    """``raise_exception(message)`` from the template itself."""


# --- the per-render budget ---------------------------------------------------------------


class _Budget:
    """Steps, deadline and value weights for one render."""

    def __init__(self, limits: Limits) -> None:
        self.limits = limits
        self.steps = 0
        self.deadline = time.monotonic() + limits.max_seconds
        self._weights: dict[int, tuple[int, int, Any]] = {}  # id -> weight, depth, object

    def tick(self, n: int = 1) -> None:
        self.steps += n
        if self.steps > self.limits.max_steps:
            raise _Stop(f"the template ran past its step budget of {self.limits.max_steps}")
        if time.monotonic() > self.deadline:
            raise _Stop(f"the template ran past its time budget of {self.limits.max_seconds} s")

    def measure(self, v: Any, depth: int = 0) -> tuple[int, int]:
        """(weight, nesting depth) of ``v``: characters of strings plus one per item.

        Containers are remembered by identity (values are immutable inside the sandbox), so a
        structure that shares parts is measured once, and each new item costs a step.
        """
        if isinstance(v, str | bytes | bytearray):
            return len(v), 0
        if isinstance(v, range):
            return len(v), 1
        if isinstance(v, int):
            return v.bit_length() // 3 + 1, 0  # about its decimal digits
        if not isinstance(v, list | tuple | dict | set | frozenset):
            return 1, 0
        known = self._weights.get(id(v))
        if known is not None:
            return known[0], known[1]
        if depth > self.limits.max_depth:
            raise _Stop(f"a value is nested deeper than {self.limits.max_depth} levels")
        items: Any = list(v.items()) if isinstance(v, dict) else v
        self.tick(len(items))
        weight, inner = 1, 0
        for item in items:
            if isinstance(item, tuple) and isinstance(v, dict):
                wk, dk = self.measure(item[0], depth + 1)
                wv, dv = self.measure(item[1], depth + 1)
                w, d = wk + wv, max(dk, dv)
            else:
                w, d = self.measure(item, depth + 1)
            weight += w
            inner = max(inner, d)
            if weight > self.limits.max_value:
                break  # heavy enough to refuse; the rest need not be counted
        self._weights[id(v)] = (weight, inner + 1, v)  # keep v alive so its id stays unique
        return weight, inner + 1

    def weight(self, v: Any) -> int:
        return self.measure(v)[0]

    def check(self, v: Any, what: str) -> Any:
        """``v``, if it is not heavier than max_value."""
        w = self.weight(v)
        if w > self.limits.max_value:
            raise _Stop(f"{what} would weigh {w}, over the limit of {self.limits.max_value}")
        return v

    def bound(self, estimate: int, what: str) -> None:
        """Refuse an operation whose result could weigh ``estimate``."""
        if estimate > self.limits.max_value:
            raise _Stop(
                f"{what} could build a value of weight {estimate}, over the limit of "
                f"{self.limits.max_value}"
            )

    def check_int(self, n: Any, what: str) -> None:
        if isinstance(n, int) and not isinstance(n, bool) and abs(n) > self.limits.max_value:
            raise _Stop(f"{what} = {n} is over the limit of {self.limits.max_value}")


_BUDGET: contextvars.ContextVar[_Budget] = contextvars.ContextVar("qllama_template_budget")


def _budget() -> _Budget:
    """The render's budget. Outside a render (jinja2 folds constants while compiling), a
    fresh one with the default limits."""
    b = _BUDGET.get(None)
    return b if b is not None else _Budget(DEFAULT_LIMITS)


# --- what may multiply: bounds computed before the work --------------------------------------

_DIGITS = re.compile(r"\d+")
_NESTED_FIELD = re.compile(r"\{[^{}]*\{")  # a replacement field inside another


def _format_bound(b: _Budget, fmt: str, args: Any) -> int:
    """An upper bound on the length of ``fmt`` formatted with ``args`` (``%`` or ``{}``).

    Each field can take at most one whole argument, padded to at most the largest number
    written in the format, or passed as an argument where the format takes its width from
    one (``%*d``, ``{:{w}}``).
    """
    fields = fmt.count("%") + fmt.count("{")
    widths = [int(d) if len(d) < 10 else 10**10 for d in _DIGITS.findall(fmt)]
    if "*" in fmt or _NESTED_FIELD.search(fmt):
        widths += [abs(a) for a in _flat(args) if isinstance(a, int)]
    return len(fmt) + fields * (b.weight(args) + max(widths, default=0))


def _flat(args: Any) -> list[Any]:
    if isinstance(args, tuple | list):
        return list(args)
    if isinstance(args, dict):
        return list(args.values())
    return [args]


def _str_method_bound(b: _Budget, s: str | bytes, name: str, args: tuple, kwargs: dict) -> None:
    """Refuse the str/bytes methods that can build far more than they are given."""
    n = len(s)
    if name in ("center", "ljust", "rjust", "zfill") and args:
        b.check_int(args[0], f"{name} width")
    elif name == "expandtabs":
        size = args[0] if args else kwargs.get("tabsize", 8)
        if isinstance(size, int):
            tabs = s.count("\t") if isinstance(s, str) else s.count(b"\t")
            b.bound(n + tabs * size, "expandtabs")
    elif name == "replace" and len(args) >= 2:
        old, new = args[0], args[1]
        if isinstance(old, str | bytes) and isinstance(new, str | bytes):
            hits = n + 1 if not old else s.count(old)  # type: ignore[arg-type]  # a mismatch raises
            b.bound(n + hits * max(0, len(new) - len(old)), "replace")
    elif name == "join" and args:
        items = args[0]
        count = len(items) if hasattr(items, "__len__") else 0
        b.bound(b.weight(items) + n * count, "join")
    elif name == "translate" and args and isinstance(args[0], dict):
        longest = max((len(str(v)) for v in args[0].values()), default=1)
        b.bound(n * max(1, longest), "translate")
    elif name in ("format", "format_map"):
        b.bound(_format_bound(b, str(s), [*args, *kwargs.values()]), name)


def _check_call(b: _Budget, func: Any, args: tuple, kwargs: dict) -> tuple:
    """Bounds for a call from the template, before it runs; returns the arguments to use."""
    name = getattr(func, "__name__", "a call")
    if isinstance(func, types.BuiltinFunctionType | types.MethodWrapperType):
        # C code allocates out of sight (str.center, int.to_bytes...): cap its integers.
        # Template macros and our own helpers are watched from inside instead.
        for i, a in enumerate(args):
            b.check_int(a, f"argument {i} of {name}")
        for k, a in kwargs.items():
            b.check_int(a, f"argument {k!r} of {name}")
    owner = getattr(func, "__self__", None)
    if owner is None:  # jinja2 wraps str.format in a function that keeps the original
        owner = getattr(getattr(func, "__wrapped__", None), "__self__", None)
    if isinstance(owner, str | bytes):
        if name == "join" and args and not hasattr(args[0], "__len__"):
            args = (list(args[0]), *args[1:])  # count what it joins
        _str_method_bound(b, owner, name, args, kwargs)
    return args


def _binop_bound(b: _Budget, op: str, left: Any, right: Any) -> None:
    seq = str | bytes | list | tuple
    if op == "*":
        if isinstance(left, seq) and isinstance(right, int):
            b.bound(b.weight(left) * max(0, right), "repetition")
        elif isinstance(right, seq) and isinstance(left, int):
            b.bound(b.weight(right) * max(0, left), "repetition")
        elif isinstance(left, int) and isinstance(right, int):
            if abs(left).bit_length() + abs(right).bit_length() > b.limits.max_int_bits:
                raise _Stop(f"a product over {b.limits.max_int_bits} bits")
    elif op == "**":
        if isinstance(left, int) and isinstance(right, int) and abs(left) > 1 and right > 0:
            if right * abs(left).bit_length() > b.limits.max_int_bits:
                raise _Stop(f"a power over {b.limits.max_int_bits} bits")
    elif op == "+":
        if isinstance(left, seq) and isinstance(right, seq):
            b.bound(b.weight(left) + b.weight(right), "concatenation")
    elif op == "%" and isinstance(left, str | bytes):
        b.bound(_format_bound(b, str(left), right), "% formatting")


# --- the template's globals and filters --------------------------------------------------------


def _range(*args: int) -> range:
    b = _budget()
    b.tick()
    r = range(*args)
    if len(r) > b.limits.max_range:
        raise _Stop(f"range of {len(r)} items, over the limit of {b.limits.max_range}")
    return r


def _raise_exception(message: Any) -> None:
    raise _TemplateRaised(str(message))


def _strftime_now(fmt: str) -> str:
    _budget().bound(len(str(fmt)) * 32, "strftime_now")  # a directive expands to < 32 chars
    return datetime.now().strftime(fmt)


def _tojson(
    x: Any,
    ensure_ascii: bool = False,
    indent: int | str | None = None,
    separators: tuple[str, str] | None = None,
    sort_keys: bool = False,
) -> str:
    """transformers' ``tojson``: no HTML escaping, json.dumps's options."""
    b = _budget()
    weight, depth = b.measure(x)
    step = len(indent) if isinstance(indent, str) else int(indent or 0)
    sep = sum(len(s) for s in separators) if separators else 2
    b.bound(weight * (6 + sep + step * depth), "tojson")  # quotes, escapes, indentation
    return json.dumps(
        x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


class _TemplateDict:
    """``dict(...)`` and ``dict.fromkeys``, without exposing the dict type itself."""

    def __call__(self, *args: Any, **kwargs: Any) -> dict[Any, Any]:
        return dict(*args, **kwargs)

    def fromkeys(self, *args: Any, **kwargs: Any) -> dict[Any, Any]:
        return dict.fromkeys(*args, **kwargs)


class _TemplateNamespace(jinja2.utils.Namespace):
    """jinja2's namespace, refusing underscore names as transformers does."""

    def __init__(*args: Any, **kwargs: Any) -> None:
        self, rest = args[0], args[1:]  # jinja2's own signature: lets namespace(self=1) work
        attrs = dict(*rest, **kwargs)
        for name in attrs:
            _TemplateNamespace._check_name(name)
        jinja2.utils.Namespace.__init__(self, attrs)

    def __setitem__(self, name: str, value: Any) -> None:
        _TemplateNamespace._check_name(name)
        jinja2.utils.Namespace.__setitem__(self, name, value)

    @staticmethod
    def _check_name(name: Any) -> None:
        if isinstance(name, str) and name.startswith("_"):
            raise SecurityError(f"a namespace cannot hold underscore names such as {name!r}")


_SIZED_FILTERS = frozenset({"center", "indent", "wordwrap", "truncate", "batch", "slice", "tojson"})


def _filter_bound(b: _Budget, name: str, value: Any, args: tuple, kwargs: dict) -> None:
    """Bounds for the built-in filters that can multiply their input."""
    if name in _SIZED_FILTERS:  # the ones with a width or a count among their arguments
        for i, a in enumerate([*args, *kwargs.values()]):
            b.check_int(a, f"argument {i + 1} of filter {name!r}")
    if name == "indent":
        width = args[0] if args else kwargs.get("width", 4)
        pad = len(width) if isinstance(width, str) else int(width or 0)
        text = str(value) if isinstance(value, str) else ""
        b.bound(len(text) + (text.count("\n") + 1) * pad, "indent")
    elif name == "replace" and isinstance(value, str) and len(args) >= 2:
        _str_method_bound(b, value, "replace", (str(args[0]), str(args[1])), {})
    elif name == "join":
        sep = args[0] if args else kwargs.get("d", "")
        count = len(value) if hasattr(value, "__len__") else 0
        b.bound(b.weight(value) * 4 + len(str(sep)) * count, "join")
    elif name == "format" and isinstance(value, str):
        b.bound(_format_bound(b, value, [*args, *kwargs.values()]), "format")
    elif name == "wordwrap" and isinstance(value, str):
        width = args[0] if args else kwargs.get("width", 79)
        wrap = args[2] if len(args) > 2 else kwargs.get("wrapstring") or "\n"
        lines = len(value) // max(1, width if isinstance(width, int) else 1) + 1
        b.bound(len(value) + lines * len(str(wrap)), "wordwrap")
    elif name in ("batch", "slice") and args and isinstance(args[0], int):
        b.tick(max(0, args[0]))  # loops that many times inside


def _guard_filter(name: str, func: Callable[..., Any]) -> Callable[..., Any]:
    """Wrap a filter: a step, bounds on its arguments, a check of what it returns."""
    skip = 1 if getattr(func, "jinja_pass_arg", None) is not None else 0  # context/env first

    @functools.wraps(func)
    def guarded(*args: Any, **kwargs: Any) -> Any:
        b = _budget()
        b.tick()
        if name == "join" and len(args) > skip and not hasattr(args[skip], "__len__"):
            args = (*args[:skip], list(args[skip]), *args[skip + 1 :])  # count what it joins
        value, params = (args[skip], args[skip + 1 :]) if len(args) > skip else (None, ())
        _filter_bound(b, name, value, params, kwargs)
        return b.check(func(*args, **kwargs), f"filter {name!r}")

    return guarded


@jinja2.pass_context
def _counted(_context: Any, iterable: Any) -> Iterator[Any]:
    """What every ``{% for %}`` loops over: the same items, a step each."""
    b = _budget()
    for item in iterable:
        b.tick()
        yield item


@jinja2.pass_context
def _checked(_context: Any, value: Any) -> Any:
    """A list, tuple or dict literal, refused if it weighs too much."""
    b = _budget()
    b.tick()
    return b.check(value, "a literal")


@jinja2.pass_context
def _concat(_context: Any, parts: list[Any]) -> str:
    """The ``~`` operator, with a bound before the strings are built."""
    b = _budget()
    b.tick()
    b.bound(sum(b.weight(p) * (1 if isinstance(p, str) else 4) for p in parts), "'~'")
    return "".join(str(p) for p in parts)


_ITER, _LITERAL, _CONCAT = "qllama_counted", "qllama_checked", "qllama_concat"


class _Rewrite(NodeTransformer):
    """Route loops, literals and ``~`` through the budget."""

    def _wrap(self, node: nodes.Node, name: str) -> nodes.Filter:
        f = nodes.Filter(node, name, [], [], None, None, lineno=node.lineno)
        f.environment = node.environment
        return f

    def visit_For(self, node: nodes.For) -> nodes.Node:
        self.generic_visit(node)
        node.iter = self._wrap(node.iter, _ITER)
        return node

    def visit_List(self, node: nodes.List) -> nodes.Node:
        self.generic_visit(node)
        return self._wrap(node, _LITERAL)

    def visit_Dict(self, node: nodes.Dict) -> nodes.Node:
        self.generic_visit(node)
        return self._wrap(node, _LITERAL)

    def visit_Tuple(self, node: nodes.Tuple) -> nodes.Node:
        self.generic_visit(node)
        return node if node.ctx != "load" else self._wrap(node, _LITERAL)

    def visit_Concat(self, node: nodes.Concat) -> nodes.Node:
        self.generic_visit(node)
        parts = nodes.List(node.nodes, lineno=node.lineno)
        parts.environment = node.environment
        return self._wrap(parts, _CONCAT)


class _Environment(ImmutableSandboxedEnvironment):
    """jinja2's immutable sandbox with a budget at each hook."""

    intercepted_binops = frozenset({"*", "**", "+", "%"})

    def __init__(self) -> None:
        super().__init__(
            trim_blocks=True,
            lstrip_blocks=True,
            extensions=[jinja2.ext.loopcontrols],
            finalize=self._finalize,
        )
        self.filters["tojson"] = _tojson
        del self.filters["pprint"]  # its indentation multiplies nested input; no template needs it
        self.filters = {name: _guard_filter(name, f) for name, f in self.filters.items()}
        self.filters.update({_ITER: _counted, _LITERAL: _checked, _CONCAT: _concat})
        self.globals.clear()  # lipsum(n=10**9) and friends are not needed by chat templates
        self.globals.update(
            range=_range,
            dict=_TemplateDict(),
            namespace=_TemplateNamespace,
            cycler=jinja2.utils.Cycler,
            joiner=jinja2.utils.Joiner,
            raise_exception=_raise_exception,
            strftime_now=_strftime_now,
        )

    def _parse(self, source: str, name: str | None, filename: str | None) -> nodes.Template:
        tree = super()._parse(source, name, filename)
        out = _Rewrite().visit(tree)
        assert isinstance(out, nodes.Template)  # the root is never replaced
        return out

    @staticmethod
    def _finalize(value: Any) -> Any:
        b = _budget()
        b.tick()
        return b.check(value, "an output value")

    def call_binop(self, context: Any, operator: str, left: Any, right: Any) -> Any:
        b = _budget()
        b.tick()
        _binop_bound(b, operator, left, right)
        return b.check(super().call_binop(context, operator, left, right), f"'{operator}'")

    def call(__self, __context: Any, __obj: Any, *args: Any, **kwargs: Any) -> Any:
        b = _budget()
        b.tick()
        args = _check_call(b, __obj, args, kwargs)
        return b.check(super().call(__context, __obj, *args, **kwargs), "a call's result")

    def getattr(self, obj: Any, attribute: str) -> Any:
        _budget().tick()
        return super().getattr(obj, attribute)

    def getitem(self, obj: Any, argument: Any) -> Any:
        _budget().tick()
        return super().getitem(obj, argument)

    def unsafe_undefined(self, obj: Any, attribute: str) -> Any:
        # jinja2 returns an Undefined that only fails when used; an attempt is refused at once
        raise SecurityError(
            f"access to attribute {attribute!r} of {type(obj).__name__!r} object is unsafe"
        )


_ENV = _Environment()


@functools.lru_cache(maxsize=32)
def _compile(source: str) -> jinja2.Template:
    return _ENV.from_string(source)


# --- rendering ---------------------------------------------------------------------------------


def _plain(value: Any, depth: int = 0) -> Any:
    """A copy of the caller's data made of JSON types only: anything else becomes a
    ``"<TypeName>"`` placeholder, so the template cannot reach its methods."""
    if depth > 256:
        raise ChatTemplateError("the messages are nested deeper than 256 levels")
    if value is None or type(value) in (str, int, float, bool):
        return value
    if isinstance(value, str):
        return str.__str__(value)
    if isinstance(value, bool):
        return bool(value)
    if isinstance(value, int):
        return int.__int__(value)
    if isinstance(value, float):
        return float.__float__(value)
    if isinstance(value, Mapping):
        return {_plain(k, depth + 1): _plain(v, depth + 1) for k, v in value.items()}
    if isinstance(value, list | tuple):
        items = [_plain(v, depth + 1) for v in value]
        return items if isinstance(value, list) else tuple(items)
    if isinstance(value, np.generic):  # numpy scalars: np.bool_(False) must stay false
        return _plain(value.item(), depth + 1)
    return f"<{type(value).__name__}>"


def _reason(e: BaseException) -> str:
    if isinstance(e, _Stop):
        return str(e)
    if isinstance(e, _TemplateRaised):
        return f"the template raised an error: {e}"
    if isinstance(e, TemplateSyntaxError):
        return f"syntax error on line {e.lineno}: {e.message}"
    if isinstance(e, SecurityError):
        return f"refused by the sandbox: {e}"
    if isinstance(e, RecursionError):
        return "recursion too deep (a macro or loop that calls itself?)"
    if isinstance(e, MemoryError):
        return "out of memory"
    return f"{type(e).__name__}: {e}"


def render(
    template: str,
    messages: Sequence[Mapping[str, Any]],
    add_generation_prompt: bool,
    variables: Mapping[str, Any],
    limits: Limits,
) -> str:
    """Render ``template`` for ``messages`` with the caller's ``variables`` under ``limits``:
    the text, or one :class:`ChatTemplateError` with the reason."""
    budget = _Budget(limits)
    token = _BUDGET.set(budget)
    try:
        plain = _plain({**variables, "messages": list(messages)})
        plain["add_generation_prompt"] = bool(add_generation_prompt)
        compiled = _compile(template)
        out: list[str] = []
        n = 0
        for chunk in compiled.generate(plain):
            n += len(chunk)
            if n > limits.max_output:
                raise _Stop(f"the output ran past {limits.max_output} characters")
            out.append(chunk)
        return "".join(out)
    except ChatTemplateError:
        raise
    except (_Stop, Exception) as e:  # every failure of the template, one error
        raise ChatTemplateError(f"chat template failed: {_reason(e)}") from None
    finally:
        _BUDGET.reset(token)
