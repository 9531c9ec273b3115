"""Every architecture on tiny files written by qllama itself (fast; the comparisons with
transformers and llama.cpp on converted files are in tests/peers/test_conformance.py).

- each family's file loads and runs; step-by-step decoding equals one pass (the cache, the
  sliding windows, the per-layer RoPE at moving positions), on every backend;
- every namespace computes the same numbers;
- transformers, reading the same GGUF with ``gguf_file=``, is an independent f32 oracle
  (llama, qwen2, qwen3, gemma2, gemma3, phi3; the keys its reader drops set from the file);
- transformers' modeling code on the original safetensors, for phi3 and gemma3 files made by
  llama.cpp's converter (tests/conformance, cached);
- what qllama does not compute is refused with a ModelConfigError naming it;
- llama.cpp's own tokenizer tests (models/ggml-vocab-*.gguf with .inp/.out).
"""

from __future__ import annotations

import dataclasses
import importlib.util
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from bounds import forward_bound
from conformance import OLDER_CONVERTERS

import qllama
from qllama.array_api import to_numpy
from qllama.errors import ModelConfigError, QllamaError, TensorShapeError
from qllama.ggml_types import ValueType
from qllama.gguf.reader import GGUFValue
from qllama.runtime.architectures import ARCHITECTURES
from qllama.synthetic import TinyConfig, write_tiny

IDS = [1, 40, 77, 200, 5, 260, 99, 3, 17, 150, 61, 222, 8, 130, 45, 250]  # 16 > the windows
BASE = dict(n_layer=3, n_embd=64, n_ff=96, n_head=4, n_head_kv=2, scale=0.3, vocab="gpt2")

# one tiny file per architecture, with the family's features switched on
FAMILIES: dict[str, TinyConfig] = {
    "llama": TinyConfig(arch="llama", biases=True, rope_freqs=True, head_dim=24, **BASE),
    "llama-fused-qkv": TinyConfig(arch="llama", fused_qkv=True, tied=False, **BASE),
    "mistral3": TinyConfig(arch="mistral3", **BASE),
    "qwen2": TinyConfig(arch="qwen2", biases=True, **BASE),
    "qwen3": TinyConfig(arch="qwen3", head_dim=32, **BASE),
    "phi3": TinyConfig(arch="phi3", n_rot=12, **BASE),
    "gemma2": TinyConfig(arch="gemma2", head_dim=32, sliding_window=4, **BASE),
    "gemma3": TinyConfig(
        arch="gemma3",
        head_dim=32,
        sliding_window=4,
        extra_keys=(("rope.freq_base_swa", GGUFValue(ValueType.FLOAT32, 1000.0)),),
        **{**BASE, "n_layer": 6},
    ),
    "granite": TinyConfig(
        arch="granite",
        extra_keys=(
            ("embedding_scale", GGUFValue(ValueType.FLOAT32, 2.0)),
            ("residual_scale", GGUFValue(ValueType.FLOAT32, 0.5)),
            ("attention.scale", GGUFValue(ValueType.FLOAT32, 0.2)),
        ),
        **BASE,
    ),
    "olmo2": TinyConfig(arch="olmo2", tied=False, **BASE),
    "smollm3": TinyConfig(arch="smollm3", **{**BASE, "n_layer": 4}),
    # mixtures of experts: 3-D experts, a few of them, top-2 (tests/test_moe.py has the rest)
    "qwen3moe": TinyConfig(arch="qwen3moe", head_dim=32, n_expert=4, n_ff_exp=32, **BASE),
    "qwen2moe": TinyConfig(
        arch="qwen2moe", biases=True, tied=False, n_expert=4, n_ff_exp=32, n_ff_shexp=64, **BASE
    ),
    "mixtral": TinyConfig(arch="llama", n_expert=4, tied=False, **BASE),
    "olmoe": TinyConfig(arch="olmoe", tied=False, n_expert=4, **{**BASE, "n_head_kv": 4}),
    "granitemoe": TinyConfig(
        arch="granitemoe",
        n_expert=4,
        n_ff_shexp=32,
        extra_keys=(
            ("embedding_scale", GGUFValue(ValueType.FLOAT32, 2.0)),
            ("residual_scale", GGUFValue(ValueType.FLOAT32, 0.5)),
            ("attention.scale", GGUFValue(ValueType.FLOAT32, 0.2)),
        ),
        **BASE,
    ),
    "gpt-oss": TinyConfig(
        arch="gpt-oss",
        tied=False,
        biases=True,
        head_dim=16,
        sliding_window=4,
        n_expert=4,
        n_ff_exp=32,
        **BASE,
    ),
}
SETUPS = {
    "numpy-f32": ("numpy", {"activations": "f32"}),
    "torch": ("torch", {}),
    "jax": ("jax", {}),
    "array_api_strict": ("array_api_strict", {}),
}


def test_every_architecture_has_a_family() -> None:
    assert {c.arch for c in FAMILIES.values()} == set(ARCHITECTURES)


@pytest.fixture(scope="module", params=FAMILIES)
def family(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("arch") / f"{request.param}.gguf"
    write_tiny(path, FAMILIES[request.param])
    return path


def load(path: Path, setup: str, **kw: Any) -> Any:
    backend, options = SETUPS[setup]
    if importlib.util.find_spec(backend) is None:
        pytest.skip(f"{backend} is not installed")
    return qllama.load(path, backend=backend, **options, **kw)


def bound(m: Any, logits: np.ndarray) -> float:
    c = m.config
    return forward_bound(c.n_layer, max(c.n_embd, c.n_ff, len(IDS)), float(np.abs(logits).max()))


@pytest.mark.parametrize("setup", SETUPS)
def test_steps_equal_one_pass(family: Path, setup: str) -> None:
    """Prefill 3, then one token at a time past every window: the same logits as one pass."""
    m = load(family, setup)
    whole = to_numpy(m.forward(IDS, all_logits=True))
    assert np.isfinite(whole).all() and np.abs(whole).max() > 0.1
    steps = [to_numpy(m.forward(IDS[:3], all_logits=True))]
    steps += [to_numpy(m.forward([t], pos=i + 3, all_logits=True)) for i, t in enumerate(IDS[3:])]
    np.testing.assert_allclose(np.concatenate(steps), whole, rtol=0, atol=bound(m, whole))


def test_every_namespace_computes_the_same_model(family: Path) -> None:
    ref_model = load(family, "numpy-f32")
    ref = to_numpy(ref_model.forward(IDS, all_logits=True))
    for setup in ("torch", "jax", "array_api_strict"):
        got = to_numpy(load(family, setup).forward(IDS, all_logits=True))
        np.testing.assert_allclose(got, ref, rtol=0, atol=bound(ref_model, ref), err_msg=setup)


# --- transformers reading the same GGUF: an independent f32 oracle -------------------------

# transformers' GGUF reader drops every key it does not map (reference/architectures.md §5):
# where a family's file carries one, the test sets the field from the file's own value, so
# that transformers computes the model the file describes. Each entry: the file, and what the
# reader leaves at the config class's default.
ORACLE_FILES = {
    "llama-plain": TinyConfig(arch="llama", head_dim=24, tied=False, **BASE),
    "qwen2": FAMILIES["qwen2"],
    "qwen3": FAMILIES["qwen3"],  # attention.key_length: head_dim stays 128
    "gemma2": dataclasses.replace(FAMILIES["gemma2"], sliding_window=4096),
    # query_pre_attn_scalar (not in GGUF: llama.cpp uses head_dim), and the sliding layers'
    # rope.freq_base_swa (transformers keeps 10000)
    "gemma3": FAMILIES["gemma3"],
    "phi3": FAMILIES["phi3"],  # rope.dimension_count: transformers rotates the whole head
}


def transformers_config(tmp_path: Path, path: Path, cfg: TinyConfig) -> Any:
    """transformers' config of the file, with what its GGUF reader drops set from the file."""
    import transformers

    config = transformers.AutoConfig.from_pretrained(tmp_path, gguf_file=path.name)
    if cfg.arch.startswith("gemma"):
        config.query_pre_attn_scalar = cfg.head_dim
    if cfg.arch == "gemma3":
        f = qllama.read_gguf(path)
        config.rope_parameters["sliding_attention"]["rope_theta"] = f.get(
            "gemma3.rope.freq_base_swa"
        )
        f.close()
    if cfg.arch == "qwen3":
        config.head_dim = cfg.head_dim
    if cfg.arch == "phi3":
        config.rope_parameters["partial_rotary_factor"] = cfg.n_rot / (cfg.n_embd // cfg.n_head)
    return config


@pytest.mark.parametrize("name", ORACLE_FILES)
def test_transformers_reading_the_same_file(name: str, tmp_path: Path) -> None:
    pytest.importorskip("transformers")
    pytest.importorskip("gguf")
    import torch
    import transformers

    path = tmp_path / f"{name}.gguf"
    cfg = ORACLE_FILES[name]
    write_tiny(path, cfg)
    hf = transformers.AutoModelForCausalLM.from_pretrained(
        tmp_path,
        gguf_file=path.name,
        config=transformers_config(tmp_path, path, cfg),
        dtype=torch.float32,
    )
    with torch.no_grad():
        ref = hf(torch.tensor([IDS])).logits[0].numpy()
    m = qllama.load(path, backend="numpy", activations="f32")
    got = to_numpy(m.forward(IDS, all_logits=True))
    assert np.abs(ref).max() > 0.5  # not flat: a wrong rotation or norm would show
    np.testing.assert_allclose(got, ref, rtol=0, atol=bound(m, ref))


# --- transformers on the original safetensors: the conformance models ---------------------

SPEC = 1e-5  # the issue's spec for qllama F32 against transformers, relative to max |logit|
# phi3 and gemma3 files made by llama.cpp's converter from a tiny random transformers model
# (tests/conformance; built in 15-30 s once, then cached): transformers runs its own modeling
# code on the safetensors, so nothing depends on what its GGUF reader maps (partial rotary,
# gemma3's linear x8 on the global layers and local base 1e4, a window shorter than the 64
# tokens). tests/peers/test_conformance.py does this for every family, on every backend,
# with llama.cpp as the third party.
SAFETENSORS = ("phi3", "gemma3")


def conformance_model(name: str) -> Any:
    """A built conformance model; a skip only when the sdist cannot be downloaded."""
    pytest.importorskip("transformers")
    pytest.importorskip("sentencepiece")
    import conformance
    from conformance.sources import Unreachable

    try:
        return conformance.build(name)
    except Unreachable as e:
        pytest.skip(str(e))


@pytest.mark.parametrize(
    ("name", "older"),
    [(n, False) for n in SAFETENSORS] + [(n, True) for n in sorted(OLDER_CONVERTERS)],
    ids=lambda v: {True: "older-converter", False: "converter"}.get(v, v),
)
def test_transformers_on_the_original_safetensors(name: str, older: bool) -> None:
    """The converter's file, and (``older``) the same file without the keys that older
    converters did not write (conformance.OLDER_CONVERTERS): llama.cpp's fallbacks for them
    are the values transformers computes with."""
    from conformance import as_older_converter
    from conformance.runners import transformers_logits

    built = conformance_model(name)
    ref = transformers_logits(built, built.ids())
    path = as_older_converter(built) if older else built.gguf
    if older:
        assert not set(OLDER_CONVERTERS[name]) & set(qllama.read_gguf(path).kv)
    m = qllama.load(path, backend="numpy", activations="f32")
    got = to_numpy(m.forward(built.ids(), all_logits=True))
    assert np.abs(ref).max() > 1.0 and len(set(ref.argmax(axis=1).tolist())) > 4  # not flat
    assert got.shape == ref.shape
    assert float(np.abs(got - ref).max() / np.abs(ref).max()) <= SPEC


# --- refusals --------------------------------------------------------------------------------


def _write(tmp_path: Path, cfg: TinyConfig, **keys: Any) -> Path:
    path = tmp_path / "bad.gguf"
    extra = tuple(keys.items())
    write_tiny(path, dataclasses.replace(cfg, extra_keys=cfg.extra_keys + extra))
    return path


_F32 = lambda v: GGUFValue(ValueType.FLOAT32, v)  # noqa: E731
YARN = {"rope.scaling.type": "yarn", "rope.scaling.factor": _F32(4.0)}
REFUSED = [
    ("moe", "qwen2", {"expert_count": GGUFValue(ValueType.UINT32, 8)},
     "qwen2.expert_count is 8: qllama computes no mixture of experts for qwen2"),
    ("longrope", "phi3", {"rope.scaling.type": "longrope"}, "is 'longrope'"),
    ("temperature", "mistral3",
     {"attention.temperature_scale": GGUFValue(ValueType.FLOAT32, 0.1)},
     "mistral3.attention.temperature_scale is set"),
    ("partial-rope", "qwen3", {"rope.dimension_count": GGUFValue(ValueType.UINT32, 8)},
     "partial RoPE is not supported for qwen3"),
    ("q-width", "qwen2", {"attention.key_length": GGUFValue(ValueType.UINT32, 8)},
     "sizes the query projection as n_embd"),
    # YaRN keys llama.cpp does not read for the family, set otherwise than it computes
    ("yarn-beta", "qwen3", {**YARN, "rope.scaling.yarn_beta_fast": _F32(8.0)},
     "qwen3.rope.scaling.yarn_beta_fast is 8.0: llama.cpp computes qwen3's YaRN with 32.0"),
    ("yarn-ext-factor", "qwen2", {**YARN, "rope.scaling.yarn_ext_factor": _F32(0.5)},
     "qwen2.rope.scaling.yarn_ext_factor is 0.5"),
    ("yarn-log-mul", "olmo2", {**YARN, "rope.scaling.yarn_log_multiplier": _F32(0.1)},
     "olmo2.rope.scaling.yarn_log_multiplier is 0.1"),
    ("yarn-magnitude", "llama", {**YARN, "rope.scaling.yarn_attn_factor": _F32(1.5)},
     "llama.rope.scaling.yarn_attn_factor is 1.5: llama.cpp computes llama's YaRN magnitude"),
]  # fmt: skip


@pytest.mark.parametrize(
    ("arch", "keys", "message"), [c[1:] for c in REFUSED], ids=[c[0] for c in REFUSED]
)
def test_unsupported_features_are_refused(
    tmp_path: Path, arch: str, keys: dict[str, Any], message: str
) -> None:
    cfg = TinyConfig(arch=arch, **{**BASE, "n_layer": 1})
    with pytest.raises(ModelConfigError, match=message):
        qllama.load(_write(tmp_path, cfg, **keys))


def test_phi3_longrope_factors_are_refused(tmp_path: Path) -> None:
    from test_model_checks import rewrite

    src = tmp_path / "phi3.gguf"
    write_tiny(src, TinyConfig(arch="phi3", **BASE))
    factors = (np.ones(8, np.float32), "F32")
    p = rewrite(src, tmp_path / "bad.gguf", tensors={"rope_factors_long.weight": factors})
    with pytest.raises(ModelConfigError, match="not used by the phi3 model: 'rope_factors_long"):
        qllama.load(p)


def test_olmo2_needs_its_output_matrix(tmp_path: Path) -> None:
    from test_model_checks import DROP, rewrite

    src = tmp_path / "olmo2.gguf"
    write_tiny(src, FAMILIES["olmo2"])
    p = rewrite(src, tmp_path / "bad.gguf", tensors={"output.weight": DROP})
    with pytest.raises(ModelConfigError, match="missing tensor 'output.weight'"):
        qllama.load(p)


def test_gemma2_never_reads_an_output_matrix(tmp_path: Path) -> None:
    """llama.cpp's gemma2 always ties: an output.weight in the file would not be used."""
    from test_model_checks import rewrite

    src = tmp_path / "g.gguf"
    write_tiny(src, FAMILIES["gemma2"])
    out = (np.zeros((269, 64), np.float32), "F32")
    p = rewrite(src, tmp_path / "bad.gguf", tensors={"output.weight": out})
    with pytest.raises(ModelConfigError, match="not used by the gemma2 model: 'output.weight'"):
        qllama.load(p)


def test_qk_norm_granularity_is_checked(tmp_path: Path) -> None:
    """qwen3 normalises per head ({head_dim}), olmo2 the whole projection: a whole-width
    weight in a qwen3 file is a shape error, not a silently different norm."""
    from test_model_checks import rewrite

    src = tmp_path / "qwen3.gguf"
    write_tiny(src, FAMILIES["qwen3"])
    wide = (np.ones(4 * 32, np.float32), "F32")
    p = rewrite(src, tmp_path / "bad.gguf", tensors={"blk.0.attn_q_norm.weight": wide})
    with pytest.raises(TensorShapeError, match=r"'blk.0.attn_q_norm.weight' has shape \[128\]"):
        qllama.load(p)


# --- llama.cpp's own tokenizer tests (test-tokenizer-0's files) ------------------------------

SEPARATOR = "\n__ggml_vocab_test__\n"


@pytest.fixture(scope="module")
def vocab_folder() -> Path:
    """llama.cpp's models folder: the llama-cpp-python sdist, downloaded from PyPI and unpacked
    once into the qllama cache (tests/conformance/sources.py), read from there afterwards.
    Nothing of it is committed; a test run without a network skips, any other failure fails."""
    from conformance.sources import Unreachable, llama_cpp_source

    try:
        return llama_cpp_source() / "models"
    except Unreachable as e:
        pytest.skip(str(e))


def test_an_unreachable_registry_is_told_apart(tmp_path: Path) -> None:
    """The skip above is for a registry pip cannot reach, not for any failure: pip's own
    output for a refused connection, and for a version that does not exist, told apart."""
    from conformance.sources import PIP_BOUNDS, unreachable

    def pip(*args: str) -> str:
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--no-cache-dir"]
        env = {**os.environ, **PIP_BOUNDS, "PIP_DEFAULT_TIMEOUT": "5"}
        out = subprocess.run(
            [*cmd, "-d", str(tmp_path), *args], capture_output=True, text=True, env=env, timeout=120
        )
        assert out.returncode != 0
        return out.stdout + out.stderr

    refused = pip("--index-url", "https://127.0.0.1:9/simple", "llama-cpp-python==0.3.36")
    missing = pip("--no-index", "--find-links", str(tmp_path), "llama-cpp-python==0.3.36")
    assert unreachable(refused), refused
    assert not unreachable(missing), missing


def test_llama_cpp_tokenizer_vectors(vocab_folder: Path) -> None:
    """Every ggml-vocab-*.gguf with .inp/.out: qllama gives llama.cpp's ids for every text
    (add_special false, parse_special false, as test-tokenizer-0), or refuses the vocabulary
    with a QllamaError at load. At least the families qllama supports must pass."""
    from qllama.runtime.tokenizer import Tokenizer

    passed, refused = [], []
    for vocab in sorted(vocab_folder.glob("ggml-vocab-*.gguf")):
        inp, out = Path(f"{vocab}.inp"), Path(f"{vocab}.out")
        if not (inp.exists() and out.exists()):
            continue
        f = qllama.read_gguf(vocab)
        try:
            tok = Tokenizer.from_gguf(f)
        except QllamaError:
            refused.append(vocab.name)
            continue
        finally:
            f.close()
        texts = inp.read_text(encoding="utf-8").split(SEPARATOR)
        expected = out.read_text(encoding="utf-8").split("\n")
        for text, ids in zip(texts, expected, strict=False):
            want = [int(t) for t in ids.split()]
            got = tok.encode(text, add_bos=False, add_eos=False, special=False)
            assert got == want, f"{vocab.name}: {text!r}"
        passed.append(vocab.name)
    for name in ("llama-spm", "llama-bpe", "qwen2", "phi-3", "gpt-2"):
        assert f"ggml-vocab-{name}.gguf" in passed, (passed, refused)
