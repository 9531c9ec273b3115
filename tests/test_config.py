"""ModelConfig.from_gguf: every key read with a fallback takes llama.cpp's fallback.

The table "Keys a file may lack" in docs/architectures.md says, per family and optional key,
what the config holds when the key is absent and where llama.cpp sets that fallback. Each
row is checked here: the family's tiny file is written with every optional key set to a
value other than its fallback, then again without the row's key, and the config read from
the second must hold what the row says (in terms of the file's other keys).
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest

from qllama.ggml_types import ValueType
from qllama.gguf.reader import GGUFFile, GGUFValue, read_gguf
from qllama.gguf.writer import rewrite
from qllama.runtime.architectures import ARCHITECTURES, Rope
from qllama.runtime.config import ModelConfig
from qllama.synthetic import TinyConfig, write_tiny

DOC = Path(__file__).resolve().parents[1] / "docs" / "architectures.md"
SECTION = "## Keys a file may lack"

u32 = lambda v: GGUFValue(ValueType.UINT32, v)  # noqa: E731
f32 = lambda v: GGUFValue(ValueType.FLOAT32, v)  # noqa: E731

# every optional key of the family at a value that is not its fallback
EVERY = {"rope.scaling.type": "linear", "rope.scaling.factor": f32(4.0)}
FAMILY: dict[str, dict[str, Any]] = {
    "gemma2": {
        "attention.sliding_window_pattern": u32(3),
        "rope.freq_base_swa": f32(20000.0),
        "attn_logit_softcapping": f32(20.0),
        "final_logit_softcapping": f32(15.0),
    },
    "gemma3": {
        "attention.sliding_window_pattern": u32(4),
        "rope.freq_base_swa": f32(20000.0),
        "final_logit_softcapping": f32(15.0),
    },
    "olmo2": {"attention.sliding_window_pattern": u32(3), "rope.freq_base_swa": f32(20000.0)},
    "granite": {
        "attention.scale": f32(0.3),
        "embedding_scale": f32(2.0),
        "residual_scale": f32(0.5),
        "rope.scaling.finetuned": GGUFValue(ValueType.BOOL, False),
    },
}
FAMILY["granitemoe"] = FAMILY["granite"]
# the families with experts: 4 of them, top-2; the widths away from their fallbacks
# (feed_forward_length 128 / 2 for the expert, 128 for qwen2moe's shared one)
EXPERTS = {"n_expert": 4, "n_expert_used": 2, "n_ff_exp": 32, "n_ff_shexp": 96}
# for one row, a base value that tells the key's presence apart: "none" (no scaling) where
# the fallback is "linear" (and "linear" for every other row, so that the factor counts)
FOR_ROW = {"rope.scaling.type": {"rope.scaling.type": "none"}}
# a file without the key length has no rotary count either (its fallback is the key length)
ALSO_LACKS = {"attention.key_length": ["rope.dimension_count"]}
SLIDING = ("gemma2", "gemma3", "olmo2", "phi3")
# Rows where the key's value in these files is its fallback anyway (nothing else would load:
# head_dim must be n_embd / n_head where llama.cpp sizes Q as n_embd; only phi3 rotates part
# of a head; the vocabulary's size is the token count), or where llama.cpp reads the key and
# then computes without it: the row is checked, but cannot tell the key's presence apart.
SAME_EITHER_WAY = {
    *(
        (name, key)
        for name, a in ARCHITECTURES.items()
        if a.q_width_is_embd
        for key in ("attention.key_length", "attention.value_length")
    ),
    *((name, "rope.dimension_count") for name, a in ARCHITECTURES.items() if not a.partial_rotary),
    *((a, "vocab_size") for a in ARCHITECTURES),
    ("olmo2", "rope.freq_base_swa"),
    ("phi3", "attention.sliding_window"),
}


def rows() -> list[tuple[str, str, str, str]]:
    """(family, key, config expression, value expression) of each row of the doc's table,
    with "every" spelled out."""
    text = DOC.read_text(encoding="utf-8")
    assert SECTION in text, f"docs/architectures.md has no section {SECTION!r}"
    lines = text.split(SECTION, 1)[1].split("\n## ", 1)[0].splitlines()
    out = []
    for line in lines:
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) != 4 or not cells[1].startswith("`"):
            continue  # prose, the header, its rule
        family, key, holds = cells[0], cells[1].strip("`"), cells[2]
        field, value = re.match(r"`([^`=]+)=([^`]+)`", holds).groups()  # type: ignore[union-attr]
        for arch in sorted(ARCHITECTURES) if family == "every" else [family]:
            out.append((arch, key, field.strip(), value.strip()))
    return out


ROWS = rows()


def base_config(arch: str, key: str) -> TinyConfig:
    """The family's tiny model with every optional key set away from its fallback."""
    a = ARCHITECTURES[arch]
    extra = {**EVERY, **FAMILY.get(arch, {}), **FOR_ROW.get(key, {})}
    return TinyConfig(
        arch=arch,
        n_layer=6,  # enough for every sliding pattern's period
        rope_base=500000.0,
        head_dim=16 if a.q_width_is_embd else 32,  # 64 / 4 = 16: the key written either way
        n_rot=8 if a.partial_rotary else 0,
        sliding_window=8 if arch in SLIDING else 0,
        tied=arch not in ("olmo2", "olmoe", "qwen2moe", "gpt-oss"),
        extra_keys=tuple(extra.items()),
        **(EXPERTS if a.experts is not None and not a.experts.optional else {}),
    )


def value_of(expression: str, f: GGUFFile, arch: str) -> Any:
    """A row's value expression, its key names replaced by the file's values."""

    def key(m: re.Match[str]) -> str:
        name = m.group(0)
        if name == "len":
            return name
        for k in (f"{arch}.{name}", name):
            if k in f.kv:
                return repr(f.kv[k].value)
        raise AssertionError(f"{expression!r}: the file has no key {name!r}")

    names = re.sub(r"\b[a-z][a-z_]*(?:\.[a-z_]+)*\b", key, expression)
    return eval(names, {"len": len, "Rope": Rope})


def field_of(expression: str, c: ModelConfig) -> Any:
    return eval(f"c.{expression}", {"c": c})


def test_the_table_covers_every_family() -> None:
    assert {arch for arch, *_ in ROWS} == set(ARCHITECTURES)
    assert ("gemma3", "rope.freq_base_swa") in {(a, k) for a, k, *_ in ROWS}


@pytest.mark.parametrize(
    ("arch", "key", "field", "value"), ROWS, ids=[f"{a}-{k}" for a, k, *_ in ROWS]
)
def test_an_absent_key_takes_llama_cpps_fallback(
    arch: str, key: str, field: str, value: str, tmp_path: Path
) -> None:
    full, lacking = tmp_path / "full.gguf", tmp_path / "lacking.gguf"
    write_tiny(full, base_config(arch, key))
    f = read_gguf(full)
    assert f"{arch}.{key}" in f.kv, f"the base file of {arch} should set {key}"
    rewrite(full, lacking, drop=[f"{arch}.{k}" for k in [key, *ALSO_LACKS.get(key, [])]])
    assert f"{arch}.{key}" not in read_gguf(lacking).kv
    want = value_of(value, f, arch)
    got = field_of(field, ModelConfig.from_gguf(read_gguf(lacking)))
    assert got == want, f"{arch} without {key}: {field} is {got}, llama.cpp's fallback {want}"
    present = field_of(field, ModelConfig.from_gguf(f))
    if (arch, key) not in SAME_EITHER_WAY:  # the file's own value is read when it is there
        assert present != want, f"{arch}: {key} set, yet {field} is the fallback {want}"
