"""What one render of a chat template may spend: shared by the chat template's facade
(:mod:`qllama.runtime.chat_template`) and the jinja2 sandbox that spends it
(:mod:`qllama.runtime.template_sandbox`)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Limits:
    """What one render may spend. The defaults leave real chat templates far inside."""

    max_output: int = 1 << 20  # characters of rendered text
    max_value: int = 1 << 20  # weight (characters + items) of any one value built
    max_steps: int = 250_000  # iterations, calls, lookups, operators, items measured
    max_seconds: float = 2.0  # wall clock, checked at every step
    max_range: int = 100_000  # items of one range(), as jinja2's sandbox
    max_int_bits: int = 4096  # size of an integer built by * or **
    max_depth: int = 64  # nesting of lists and dicts
    max_template_chars: int = 1 << 20  # length of the template source


DEFAULT_LIMITS = Limits()
