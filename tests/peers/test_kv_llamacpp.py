"""qllama's KV cache types against llama.cpp's (issue 32): the same file, the same
``type_k`` / ``type_v``, flash attention on and off, every position's logits.

llama.cpp computes with the cache as qllama does (its from_float per type, the Hadamard
rotation of quantized caches, the K type's vec_dot, one_chunk's online softmax); what differs
is the float order of everything upstream (BLAS against ggml's sums), an ulp here and there.
A value within an ulp of a rounding boundary of the cache's type then rounds the other way on
one side: one step of that type, at most one per stage and in quadrature, relative to the
logits' scale (the model of ``tests/bounds.py``'s ``q8_flip_bound``). The measured agreement is
in docs/kv_cache.md: the quantized caches agree far inside this bound.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
from bounds import forward_bound

from qllama import load
from qllama.runtime import kv_types
from qllama.study.engines import LlamaCppModel
from qllama.synthetic import TinyConfig, write_tiny_llama

pytestmark = pytest.mark.peers

# each type's largest rounding step relative to its block's (or the value's) magnitude
STEP = {
    "f32": 2.0**-24,
    "f16": 2.0**-11,
    "bf16": 2.0**-8,
    "q8_0": 1 / 127,
    "q4_0": 1 / 8,
    "q4_1": 1 / 15,
    "iq4_nl": 1 / 8,
    "q5_0": 1 / 16,
    "q5_1": 1 / 31,
}
SPECS = [
    "f32", "f16", "bf16", "q8_0/f16", "q4_0/f32",
    "f16,fa", "bf16,fa", "q8_0,fa", "q4_0,fa", "q4_1,fa", "iq4_nl,fa", "q5_0,fa", "q5_1,fa",
    "q8_0/q4_0,fa", "f16/q8_0,fa",
]  # fmt: skip
N_LAYER = 2


@pytest.fixture(scope="module")
def f32_file(tmp_path_factory):
    """Heads of 64 (the rotation applies), GQA 2:1, float weights: only the cache rounds."""
    path = tmp_path_factory.mktemp("kv") / "tiny.gguf"
    write_tiny_llama(
        path, TinyConfig(n_layer=N_LAYER, n_embd=128, n_ff=256, n_head=2, n_head_kv=1, n_ctx=512)
    )
    return path


@pytest.mark.parametrize("spec", SPECS)
def test_logits_agree_with_llama_cpp(f32_file, spec):
    s = kv_types.parse(spec)
    ours_model = load(f32_file, kv_precision=spec, activation_rounding="simd")
    ids = ours_model.tokenizer.encode("the tide is low at noon and high at night, " * 3)[:60]
    peer = LlamaCppModel(
        f32_file,
        threads=1,
        n_ctx=256,
        type_k=int(kv_types.CACHE_TYPES[s.type_k]),
        type_v=int(kv_types.CACHE_TYPES[s.type_v]),
        flash_attn=s.flash,
    )
    theirs = peer.forward(ids, 0, all_logits=True)
    ours = np.asarray(ours_model.forward(ids, all_logits=True))
    scale = float(np.abs(ours).max())
    # Q is converted to the K type's vec_dot_type: Q8_0 for the block types
    q_type = "q8_0" if s.quantized("k") else s.type_k
    step = max(STEP[s.type_k], STEP[s.type_v], STEP[q_type])
    bound = 2 * step * math.sqrt(4 * N_LAYER) * scale + forward_bound(N_LAYER, 256, scale)
    assert np.abs(ours - theirs).max() <= bound
