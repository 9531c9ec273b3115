"""The study's llama.cpp engine (llama-cpp-python on the same file) as a model the measures
run: its teacher forcing and free generation agree with each other exactly, and its CPU
arithmetic with qllama's within the bound of two activation roundings."""

from __future__ import annotations

import numpy as np
import pytest
from bounds import q8_flip_bound

from qllama import load
from qllama.gguf.quantizer import quantize_file
from qllama.measure.compare import Reference, free_generation, reference_from_model, teacher_forcing
from qllama.study.engines import LlamaCppModel
from qllama.synthetic import TinyConfig, write_tiny_llama

pytestmark = pytest.mark.peers


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    folder = tmp_path_factory.mktemp("tiny")
    write_tiny_llama(folder / "f32.gguf", TinyConfig(n_layer=2, n_embd=64))
    quantize_file(folder / "f32.gguf", folder / "q8.gguf", "Q8_0")
    return folder / "f32.gguf", folder / "q8.gguf"


@pytest.fixture(scope="module")
def reference(files) -> Reference:
    model = load(files[0], dequantize_all=True)
    return reference_from_model(model, model.tokenizer.encode("the world is"), max_new_tokens=12)


def test_free_generation_forks_where_teacher_forcing_first_flips(files, reference):
    peer = LlamaCppModel(files[1], threads=1, n_ctx=128, type_k=0, type_v=0)
    tf = teacher_forcing(peer, reference, mode="steps")
    free = free_generation(peer, reference, extra=4)
    assert free.fork == tf.first_flip  # the same prefill-then-decode calls, the same logits


def test_llama_cpp_and_qllama_compute_the_same_cpu_arithmetic(files, reference):
    peer = LlamaCppModel(files[1], threads=1, n_ctx=128, type_k=0, type_v=0)
    ours = load(files[1])  # the CPU arithmetic: activations rounded to Q8_0
    a = teacher_forcing(peer, reference, mode="steps").logits
    b = teacher_forcing(ours, reference, mode="steps").logits
    # each side rounds its activations to Q8_0 after float parts summed in its own order: at
    # most one Q8 step per stage apart (tests/bounds.py), relative to the logits' scale
    bound = q8_flip_bound(2, float(np.abs(b).max()))
    assert np.abs(a - b).max() <= bound
