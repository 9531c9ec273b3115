"""Every architecture on tiny files written by qllama itself (fast; the comparisons with
transformers and llama.cpp on converted files are in tests/peers/test_conformance.py).

- each family's file loads and runs; step-by-step decoding equals one pass (the cache, the
  sliding windows, the per-layer RoPE at moving positions), on every backend;
- every namespace computes the same numbers;
- transformers, reading the same GGUF with ``gguf_file=``, is an independent f32 oracle for
  the families it maps faithfully (llama, qwen2, qwen3, gemma2 and gemma3, the latter two with
  ``query_pre_attn_scalar`` set as llama.cpp derives it);
- what qllama does not compute is refused with a ModelConfigError naming it;
- llama.cpp's own tokenizer tests (models/ggml-vocab-*.gguf with .inp/.out).
"""

from __future__ import annotations

import dataclasses
import importlib.util
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from bounds import forward_bound

import qllama
from qllama.architectures import ARCHITECTURES
from qllama.array_api import to_numpy
from qllama.errors import ModelConfigError, QllamaError, TensorShapeError
from qllama.ggml_types import ValueType
from qllama.gguf_reader import GGUFValue
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

# transformers maps these families' keys faithfully from GGUF (reference/architectures.md §5);
# for gemma its query_pre_attn_scalar default (256) is replaced by head_dim, as llama.cpp does
ORACLE = {"llama-plain": "llama", "qwen2": "qwen2", "qwen3": "qwen3", "gemma2": "gemma2"}
ORACLE_FILES = {
    "llama-plain": TinyConfig(arch="llama", head_dim=24, tied=False, **BASE),
    "qwen2": FAMILIES["qwen2"],
    "qwen3": FAMILIES["qwen3"],
    "gemma2": dataclasses.replace(FAMILIES["gemma2"], sliding_window=4096),
}


@pytest.mark.parametrize("name", ORACLE)
def test_transformers_reading_the_same_file(name: str, tmp_path: Path) -> None:
    pytest.importorskip("transformers")
    pytest.importorskip("gguf")
    import torch
    import transformers

    path = tmp_path / f"{name}.gguf"
    cfg = ORACLE_FILES[name]
    write_tiny(path, cfg)
    config = transformers.AutoConfig.from_pretrained(tmp_path, gguf_file=path.name)
    if cfg.arch.startswith("gemma"):
        config.query_pre_attn_scalar = cfg.head_dim
    if cfg.arch == "qwen3":
        config.head_dim = cfg.head_dim  # transformers does not map qwen3's key_length
    hf = transformers.AutoModelForCausalLM.from_pretrained(
        tmp_path, gguf_file=path.name, config=config, dtype=torch.float32
    )
    with torch.no_grad():
        ref = hf(torch.tensor([IDS])).logits[0].numpy()
    m = qllama.load(path, backend="numpy", activations="f32")
    got = to_numpy(m.forward(IDS, all_logits=True))
    assert np.abs(ref).max() > 0.5  # not flat: a wrong rotation or norm would show
    np.testing.assert_allclose(got, ref, rtol=0, atol=bound(m, ref))


# --- refusals --------------------------------------------------------------------------------


def _write(tmp_path: Path, cfg: TinyConfig, **keys: Any) -> Path:
    path = tmp_path / "bad.gguf"
    extra = tuple(keys.items())
    write_tiny(path, dataclasses.replace(cfg, extra_keys=cfg.extra_keys + extra))
    return path


REFUSED = [
    ("moe", "llama", {"expert_count": GGUFValue(ValueType.UINT32, 8)}, "mixtures of experts"),
    ("yarn", "qwen2", {"rope.scaling.type": "yarn"}, "rope.scaling.type is 'yarn'"),
    ("longrope", "phi3", {"rope.scaling.type": "longrope"}, "is 'longrope'"),
    ("attn-factor", "phi3", {"rope.scaling.attn_factor": GGUFValue(ValueType.FLOAT32, 1.19)},
     "scaled RoPE magnitudes"),
    ("temperature", "mistral3",
     {"attention.temperature_scale": GGUFValue(ValueType.FLOAT32, 0.1)},
     "mistral3.attention.temperature_scale is set"),
    ("partial-rope", "qwen3", {"rope.dimension_count": GGUFValue(ValueType.UINT32, 8)},
     "partial RoPE is not supported for qwen3"),
    ("q-width", "qwen2", {"attention.key_length": GGUFValue(ValueType.UINT32, 8)},
     "sizes the query projection as n_embd"),
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


def _vocab_folder() -> Path:
    root = Path(__file__).resolve().parents[1]
    try:
        out = subprocess.run(
            [sys.executable, str(root / "tools" / "llama_cpp_build.py"), "source"],
            capture_output=True,
            text=True,
            check=True,
            timeout=600,
        )
    except (subprocess.SubprocessError, OSError):
        pytest.skip("llama.cpp's source (the llama-cpp-python sdist) is not available")
    return Path(out.stdout.strip().splitlines()[-1]) / "models"


@pytest.fixture(scope="module")
def vocab_folder() -> Path:
    return _vocab_folder()


def test_llama_cpp_tokenizer_vectors(vocab_folder: Path) -> None:
    """Every ggml-vocab-*.gguf with .inp/.out: qllama gives llama.cpp's ids for every text
    (add_special false, parse_special false, as test-tokenizer-0), or refuses the vocabulary
    with a QllamaError at load. At least the families qllama supports must pass."""
    from qllama.tokenizer import Tokenizer

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
