"""qllama's per-tensor type rules against llama.cpp's own (llama_tensor_get_type), for every
file type on model shapes that take every branch: grouped-query attention or not, 4 and 8
experts, Falcon, a llama 70B, rows that divide into 256-blocks or only into 32.

llama.cpp computes them through its staging API (``src/llama-ext.h``:
``llama_quant_model_from_metadata``, ``llama_quant_compute_types``), which builds a mock model
from hyperparameters and tensors from names and shapes; no file is written. That API always
plans without an importance matrix: the rules that depend on one are compared through whole
files in test_llamacpp_quantize.py.
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass

import pytest

from qllama.errors import ModelConfigError
from qllama.ggml_types import GGMLType
from qllama.gguf.quantizer import FILE_TYPES, ModelShape, Role, TypeChooser, visit_order
from qllama.gguf.reader import TensorInfo

llama_cpp = pytest.importorskip("llama_cpp")
pytestmark = pytest.mark.peers

GGML_TYPE_COUNT = 43


class QuantModelDesc(ctypes.Structure):
    _fields_ = [
        ("architecture", ctypes.c_char_p),
        ("n_embd", ctypes.c_uint32),
        ("n_ff", ctypes.c_uint32),
        ("n_layer", ctypes.c_uint32),
        ("n_head", ctypes.c_uint32),
        ("n_head_kv", ctypes.c_uint32),
        ("n_expert", ctypes.c_uint32),
        ("n_embd_head_k", ctypes.c_uint32),
        ("n_embd_head_v", ctypes.c_uint32),
    ]


class GGMLInitParams(ctypes.Structure):
    _fields_ = [
        ("mem_size", ctypes.c_size_t),
        ("mem_buffer", ctypes.c_void_p),
        ("no_alloc", ctypes.c_bool),
    ]


@dataclass(frozen=True)
class Shape:
    arch: str
    n_layer: int
    n_embd: int
    n_ff: int
    n_head: int
    n_head_kv: int
    n_expert: int = 0
    tied: bool = False
    fused_qkv: bool = False


SHAPES = {
    "smollm2": Shape("llama", 30, 576, 1536, 9, 3, tied=True),
    "llama-gqa8": Shape("llama", 32, 4096, 14336, 32, 8),
    "mha-256": Shape("llama", 16, 2048, 5632, 32, 32),
    "70b": Shape("llama", 80, 8192, 28672, 64, 8),
    "falcon": Shape("falcon", 32, 4544, 18176, 71, 1, fused_qkv=True),
    "moe-8": Shape("llama", 32, 4096, 14336, 32, 8, n_expert=8),
    "moe-4": Shape("qwen2moe", 24, 2048, 1408, 16, 16, n_expert=4),
}


def tensors_of(s: Shape) -> list[tuple[str, tuple[int, ...]]]:
    """(name, ne) of a llama-style model of shape ``s``."""
    hd = s.n_embd // s.n_head
    out: list[tuple[str, tuple[int, ...]]] = [
        ("token_embd.weight", (s.n_embd, 32000)),
        ("output_norm.weight", (s.n_embd,)),
    ]
    if not s.tied:
        out.append(("output.weight", (s.n_embd, 32000)))
    for i in range(s.n_layer):
        p = f"blk.{i}."
        out += [(p + "attn_norm.weight", (s.n_embd,)), (p + "ffn_norm.weight", (s.n_embd,))]
        if s.fused_qkv:
            out.append((p + "attn_qkv.weight", (s.n_embd, (s.n_head + 2 * s.n_head_kv) * hd)))
        else:
            out += [
                (p + "attn_q.weight", (s.n_embd, s.n_head * hd)),
                (p + "attn_k.weight", (s.n_embd, s.n_head_kv * hd)),
                (p + "attn_v.weight", (s.n_embd, s.n_head_kv * hd)),
            ]
        out.append((p + "attn_output.weight", (s.n_head * hd, s.n_embd)))
        if s.n_expert:
            e = s.n_expert
            out += [
                (p + "ffn_gate_inp.weight", (s.n_embd, e)),
                (p + "ffn_gate_exps.weight", (s.n_embd, s.n_ff, e)),
                (p + "ffn_up_exps.weight", (s.n_embd, s.n_ff, e)),
                (p + "ffn_down_exps.weight", (s.n_ff, s.n_embd, e)),
            ]
        else:
            out += [
                (p + "ffn_gate.weight", (s.n_embd, s.n_ff)),
                (p + "ffn_up.weight", (s.n_embd, s.n_ff)),
                (p + "ffn_down.weight", (s.n_ff, s.n_embd)),
            ]
    return out


# llama-ext.h's staging API is C++: its symbols by their mangled names
SYMBOLS = {
    "init": "_Z16llama_quant_initPK11llama_modelPK27llama_model_quantize_params",
    "free": "_Z16llama_quant_freeP19quantize_state_impl",
    "model_from_metadata": "_Z31llama_quant_model_from_metadataPK22llama_quant_model_desc",
    "allows_quantization": (
        "_Z38llama_quant_tensor_allows_quantizationPK19quantize_state_implPK11ggml_tensor"
    ),
    "compute_types": (
        "_Z25llama_quant_compute_typesP19quantize_state_impl11llama_ftypePP11ggml_tensorP9ggml_typem"
    ),
}


class LlamaTypes:
    """llama_quant_compute_types through ctypes (the C++ symbols by their mangled names)."""

    def __init__(self) -> None:
        lib = llama_cpp.llama_cpp._lib
        base = ctypes.CDLL(str(llama_cpp.llama_cpp._base_path / "libggml-base.so"))
        sym = {name: getattr(lib, mangled) for name, mangled in SYMBOLS.items()}
        self.init, self.free = sym["init"], sym["free"]
        self.init.restype, self.init.argtypes = ctypes.c_void_p, [ctypes.c_void_p] * 2
        self.free.argtypes = [ctypes.c_void_p]
        self.model = sym["model_from_metadata"]
        self.model.restype = ctypes.c_void_p
        self.model.argtypes = [ctypes.POINTER(QuantModelDesc)]
        self.allows = sym["allows_quantization"]
        self.allows.restype, self.allows.argtypes = ctypes.c_bool, [ctypes.c_void_p] * 2
        self.compute = sym["compute_types"]
        self.compute.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_void_p]
        self.compute.argtypes += [ctypes.c_void_p, ctypes.c_size_t]
        self.model_free = lib.llama_model_free
        self.model_free.argtypes = [ctypes.c_void_p]
        base.ggml_init.restype, base.ggml_init.argtypes = ctypes.c_void_p, [GGMLInitParams]
        base.ggml_new_tensor.restype = ctypes.c_void_p
        base.ggml_new_tensor.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_int]
        base.ggml_new_tensor.argtypes += [ctypes.POINTER(ctypes.c_int64)]
        base.ggml_set_name.argtypes = [ctypes.c_void_p, ctypes.c_char_p]
        base.ggml_free.argtypes = [ctypes.c_void_p]
        self.base = base

    def types(self, s: Shape, ftype: int) -> dict[str, int]:
        """llama.cpp's type of every tensor of a model of shape ``s`` (F32 sources)."""
        desc = QuantModelDesc(
            s.arch.encode(), s.n_embd, s.n_ff, s.n_layer, s.n_head, s.n_head_kv, s.n_expert, 0, 0
        )
        model = self.model(ctypes.byref(desc))
        params = llama_cpp.llama_model_quantize_default_params()
        qs = self.init(model, ctypes.cast(ctypes.byref(params), ctypes.c_void_p))
        ctx = self.base.ggml_init(GGMLInitParams(1 << 24, None, True))
        try:
            names, ptrs = [], []
            for name, ne in tensors_of(s):
                arr = (ctypes.c_int64 * len(ne))(*ne)
                t = self.base.ggml_new_tensor(ctx, 0, len(ne), arr)
                self.base.ggml_set_name(t, name.encode())
                names.append(name)
                ptrs.append(t)
            quantized = [(n, p) for n, p in zip(names, ptrs, strict=True) if self.allows(qs, p)]
            order = visit_order([n for n, _ in quantized])
            by_name = dict(quantized)
            arr_t = (ctypes.c_void_p * len(order))(*[by_name[n] for n in order])
            out = (ctypes.c_int * len(order))()
            self.compute(qs, ftype, arr_t, out, len(order))
            return dict(zip(order, out, strict=True))
        finally:
            self.base.ggml_free(ctx)
            self.free(qs)
            self.model_free(model)


@pytest.fixture(scope="module")
def llama_types() -> LlamaTypes:
    return LlamaTypes()


def ours(s: Shape, ftype: str) -> dict[str, int]:
    tensors = tensors_of(s)
    infos = {n: TensorInfo(n, ne, GGMLType.F32, 0, 0) for n, ne in tensors}
    names = visit_order(list(infos))
    chooser = TypeChooser(
        ftype=FILE_TYPES[ftype],
        model=ModelShape(s.arch, s.n_layer, s.n_head, s.n_head_kv, s.n_expert),
        tied=s.tied,
        n_attention_wv=sum(Role.of(n).is_attn_v for n in names),
    )
    return {n: int(chooser.choose(infos[n])) for n in names if len(infos[n].ne) >= 2}


@pytest.mark.parametrize("shape", list(SHAPES))
@pytest.mark.parametrize("ftype", [f for f in FILE_TYPES if f not in ("F32", "F16", "BF16")])
def test_tensor_types_are_llama_cpps(llama_types, shape, ftype):
    s = SHAPES[shape]
    try:
        got = ours(s, ftype)
    except ModelConfigError as e:  # no fallback (Q1_0 on 576 columns): llama.cpp throws too
        assert "no fallback" in str(e)
        return
    want = llama_types.types(s, FILE_TYPES[ftype].value)
    quantized = {n: t for n, t in got.items() if n in want}
    assert set(want) <= set(got)
    diff = {
        n: (GGMLType(quantized[n]).name, GGMLType(want[n]).name)
        for n in want
        if quantized[n] != want[n]
    }
    assert not diff, f"{ftype} on {shape}: (qllama, llama.cpp) {dict(list(diff.items())[:8])}"
