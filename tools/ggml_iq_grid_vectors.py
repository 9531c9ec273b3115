"""Ground truth for the IQ grid types, made by ggml itself: ``tests/data/ggml_vectors_iq_grid.npz``.

For IQ2_XXS, IQ2_XS, IQ2_S, IQ3_XXS, IQ3_S, IQ1_S and IQ1_M this calls, through ctypes,
the ggml libraries that llama-cpp-python builds (``import llama_cpp``):

* ``ggml_quantize_chunk`` with an importance matrix (random, and all ones) and without one
  where ggml allows it: the bytes llama-quantize writes;
* the type's ``to_float`` (``ggml_get_type_traits``) on blocks holding every grid point and
  on random blocks (every bit pattern);
* the CPU ``from_float`` of ``Q8_K`` on activation rows and the CPU ``vec_dot``
  (``ggml_get_type_traits_cpu``): ggml's SIMD kernels, whose float sums run in their own
  order;
* the same dot products from ggml's generic C (``ggml-cpu/quants.c`` of the vendored
  llama.cpp source, compiled here for plain x86-64 with ``-ffp-contract=off``, i.e. as
  written, without FMA): bit for bit what qllama's CPU arithmetic computes.

Run ``python tools/ggml_iq_grid_vectors.py [--out FILE]`` with llama-cpp-python installed and
a C compiler on the path (``nox -s peers`` reruns it and compares with the committed file).
Nothing of ggml's is kept: the compiled helper lives in a temporary folder.
"""

from __future__ import annotations

import argparse
import ctypes
import importlib.util
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
OUT = ROOT / "tests" / "data" / "ggml_vectors_iq_grid.npz"

TYPES = {
    "IQ2_XXS": 16,
    "IQ2_XS": 17,
    "IQ3_XXS": 18,
    "IQ1_S": 19,
    "IQ3_S": 21,
    "IQ2_S": 22,
    "IQ1_M": 29,
}
TYPE_NAMES = {8: "Q8_0", 15: "Q8_K"}
Q8_K = 15
Q4_1 = 3
GENERIC = {
    "IQ2_XXS": "ggml_vec_dot_iq2_xxs_q8_K_generic",
    "IQ2_XS": "ggml_vec_dot_iq2_xs_q8_K_generic",
    "IQ2_S": "ggml_vec_dot_iq2_s_q8_K_generic",
    "IQ3_XXS": "ggml_vec_dot_iq3_xxs_q8_K_generic",
    "IQ3_S": "ggml_vec_dot_iq3_s_q8_K_generic",
    "IQ1_S": "ggml_vec_dot_iq1_s_q8_K_generic",
    "IQ1_M": "ggml_vec_dot_iq1_m_q8_K_generic",
}
# the byte of each type's block whose bit 6 is bit 14 of the fp16 d: clearing it keeps
# random scales finite (IQ1_M keeps its d in the top nibbles of its scales)
D_HIGH_BYTE = {"IQ1_M": 55}
N = 1024  # values per row: four super-blocks

TO_FLOAT = ctypes.CFUNCTYPE(None, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64)
FROM_FLOAT = ctypes.CFUNCTYPE(None, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64)
VEC_DOT = ctypes.CFUNCTYPE(
    None,
    ctypes.c_int,
    ctypes.c_void_p,
    ctypes.c_size_t,
    ctypes.c_void_p,
    ctypes.c_size_t,
    ctypes.c_void_p,
    ctypes.c_size_t,
    ctypes.c_int,
)


class TypeTraits(ctypes.Structure):
    _fields_ = [
        ("type_name", ctypes.c_char_p),
        ("blck_size", ctypes.c_int64),
        ("blck_size_interleave", ctypes.c_int64),
        ("type_size", ctypes.c_size_t),
        ("is_quantized", ctypes.c_bool),
        ("to_float", TO_FLOAT),
        ("from_float_ref", FROM_FLOAT),
    ]


class TypeTraitsCpu(ctypes.Structure):
    _fields_ = [
        ("from_float", FROM_FLOAT),
        ("vec_dot", VEC_DOT),
        ("vec_dot_type", ctypes.c_int),
        ("nrows", ctypes.c_int64),
    ]


def _ptr(a: np.ndarray) -> ctypes.c_void_p:
    return ctypes.c_void_p(a.ctypes.data)


def llama_cpp_source() -> Path:
    """The vendored llama.cpp of the sdist (unpacked once by tools/llama_cpp_build.py)."""
    spec = importlib.util.spec_from_file_location("_build", ROOT / "tools" / "llama_cpp_build.py")
    assert spec is not None and spec.loader is not None
    build = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(build)
    return Path(build.source())


class Ggml:
    """The ggml functions the vectors need, from llama-cpp-python's libraries."""

    def __init__(self, lib: Path, generic: Path) -> None:
        mode = getattr(os, "RTLD_GLOBAL", 0)
        self.base = ctypes.CDLL(str(lib / "libggml-base.so"), mode=mode)
        self.cpu = ctypes.CDLL(str(lib / "libggml-cpu.so"), mode=mode)
        self.generic = ctypes.CDLL(str(generic))
        self.cpu.ggml_cpu_init()
        self.base.ggml_get_type_traits.restype = ctypes.POINTER(TypeTraits)
        self.cpu.ggml_get_type_traits_cpu.restype = ctypes.POINTER(TypeTraitsCpu)
        self.base.ggml_quantize_chunk.restype = ctypes.c_size_t
        self.base.ggml_quantize_chunk.argtypes = [
            ctypes.c_int,
            ctypes.c_void_p,
            ctypes.c_void_p,
            ctypes.c_int64,
            ctypes.c_int64,
            ctypes.c_int64,
            ctypes.c_void_p,
        ]
        self.base.ggml_quantize_requires_imatrix.restype = ctypes.c_bool
        self.base.ggml_type_name.restype = ctypes.c_char_p

    def traits(self, t: int) -> TypeTraits:
        return self.base.ggml_get_type_traits(t).contents

    def traits_cpu(self, t: int) -> TypeTraitsCpu:
        return self.cpu.ggml_get_type_traits_cpu(t).contents

    def row_bytes(self, t: int, n: int) -> int:
        tr = self.traits(t)
        return n // tr.blck_size * tr.type_size

    def quantize(self, t: int, x: np.ndarray, imatrix: np.ndarray | None) -> np.ndarray:
        x = np.ascontiguousarray(x, dtype=np.float32)
        rows, n = x.shape
        out = np.zeros((rows, self.row_bytes(t, n)), dtype=np.uint8)
        qw = None if imatrix is None else _ptr(np.ascontiguousarray(imatrix, dtype=np.float32))
        self.base.ggml_quantize_chunk(t, _ptr(x), _ptr(out), 0, rows, n, qw)
        return out

    def to_float(self, t: int, raw: np.ndarray, n: int) -> np.ndarray:
        raw = np.ascontiguousarray(raw)
        out = np.empty((raw.shape[0], n), dtype=np.float32)
        f = self.traits(t).to_float
        for r in range(raw.shape[0]):
            f(_ptr(raw[r]), _ptr(out[r]), n)
        return out

    def from_float_cpu(self, t: int, x: np.ndarray) -> np.ndarray:
        x = np.ascontiguousarray(x, dtype=np.float32)
        out = np.zeros((x.shape[0], self.row_bytes(t, x.shape[1])), dtype=np.uint8)
        f = self.traits_cpu(t).from_float
        for r in range(x.shape[0]):
            f(_ptr(x[r]), _ptr(out[r]), x.shape[1])
        return out

    def vec_dots(self, dot, w: np.ndarray, a: np.ndarray, n: int) -> np.ndarray:
        """``dot`` of every weight row with every activation row: ``(w rows, a rows)``."""
        out = np.empty((w.shape[0], a.shape[0]), dtype=np.float32)
        s = np.zeros(1, dtype=np.float32)
        w, a = np.ascontiguousarray(w), np.ascontiguousarray(a)
        for i in range(w.shape[0]):
            for j in range(a.shape[0]):
                dot(n, _ptr(s), 0, _ptr(w[i]), 0, _ptr(a[j]), 0, 1)
                out[i, j] = s[0]
        return out


def compile_generic(src: Path, lib: Path, folder: Path) -> Path:
    """ggml-cpu/quants.c for plain x86-64, no FMA contraction: its ``*_generic`` dot products."""
    ggml = src / "ggml"
    out = folder / "ggml_generic_quants.so"
    cc = os.environ.get("CC", "cc")
    cmd = [cc, "-O2", "-march=x86-64", "-ffp-contract=off", "-fPIC", "-shared", "-std=gnu11"]
    cmd += [f"-I{ggml / 'include'}", f"-I{ggml / 'src'}", f"-I{ggml / 'src' / 'ggml-cpu'}"]
    cmd += [str(ggml / "src" / "ggml-cpu" / "quants.c"), "-o", str(out)]
    cmd += [f"-L{lib}", "-l:libggml-cpu.so", "-l:libggml-base.so", f"-Wl,-rpath,{lib}"]
    subprocess.run(cmd, check=True)
    return out


def weight_rows(rng: np.random.Generator, g: Ggml) -> np.ndarray:
    """16 rows of N values: the distributions, edge cases and ties the quantizers meet."""
    f32 = np.float32
    rows = np.zeros((16, N), dtype=f32)
    rows[0] = rng.normal(0, 0.02, N)
    rows[1] = rng.normal(0, 1, N)
    rows[2] = rng.standard_t(3, N)
    # rows[3]: all zeros
    rows[4] = 0.125
    # magnitudes spread around every group threshold (1e-15 ... 1e-7), one per 16 values
    rows[5] = rng.normal(0, 1, N) * np.repeat(10.0 ** rng.uniform(-17, -5, N // 16), 16)
    rows[6] = rng.uniform(-3, 3, N)
    rows[7] = rng.normal(0, 0.05, N)
    rows[7, rng.choice(N, 12, replace=False)] = rng.choice([4.0, -6.0, 8.0, -10.0], 12)
    rows[8] = np.abs(rng.normal(0, 1, N))
    rows[9] = -np.abs(rng.normal(0, 1, N))
    rows[10] = rng.normal(0, 1, N)
    rows[10, ::7] = 0
    # an all-zero 32-block and 16-block inside live super-blocks, and a zero super-block
    rows[11] = rng.normal(0, 1, N)
    rows[11, 32:64] = 0
    rows[11, 272:288] = 0
    rows[11, 512:768] = 0
    # ties, as in a model written from Q4_1 weights: ggml's own Q4_1 round trip
    tied = rng.normal(0, 0.05, (1, N)).astype(f32)
    rows[12] = g.to_float(Q4_1, g.quantize(Q4_1, tied, None), N)[0]
    rows[13] = rng.integers(-4, 5, N) * 0.5  # exact small levels
    rows[14] = rng.normal(0, 1000, N)
    rows[15, rng.choice(N, 40, replace=False)] = rng.normal(0, 1, 40)  # sparse
    return rows.astype(f32)


def activation_rows(rng: np.random.Generator) -> np.ndarray:
    f32 = np.float32
    rows = np.zeros((14, N), dtype=f32)
    rows[0] = rng.normal(0, 1, N)
    rows[1] = rng.normal(0, 0.01, N)
    rows[2] = rng.standard_t(3, N)
    # rows[3]: all zeros
    rows[4] = 1.0
    rows[5] = rng.uniform(-3, 3, N)
    rows[6] = rng.normal(0, 0.1, N)
    rows[6, rng.choice(N, 8, replace=False)] = 20.0
    rows[7] = np.abs(rng.normal(0, 1, N))
    rows[8] = -np.abs(rng.normal(0, 1, N))
    rows[9] = rng.normal(0, 1, N)
    rows[9, ::7] = 0
    rows[10] = rng.normal(0, 100, N)
    rows[11] = rng.normal(0, 1e-6, N)
    rows[12] = rng.normal(0, 3, N)
    rows[13] = rng.normal(0, 3, N)
    return rows.astype(f32)


def imatrices(rng: np.random.Generator) -> dict[str, np.ndarray]:
    """Per-column importance: log-normal with zeros (a whole 32-block and 16-block too), ones."""
    rand = np.exp(rng.normal(0, 1, N))
    rand[rng.random(N) < 0.05] = 0
    rand[128:160] = 0
    rand[400:416] = 0
    return {"rand": rand.astype(np.float32), "ones": np.ones(N, dtype=np.float32)}


def random_blocks(rng: np.random.Generator, g: Ggml, name: str, t: int) -> np.ndarray:
    """8 rows of random bytes whose fp16 scale is finite (bit 14 of d cleared)."""
    raw = rng.integers(0, 256, (8, g.row_bytes(t, N)), dtype=np.uint8)
    ts = g.traits(t).type_size
    blocks = raw.reshape(-1, ts)
    blocks[:, D_HIGH_BYTE.get(name, 1)] &= 0xBF
    return raw


# grid points, groups per super-block
GRID_SIZES = {
    "IQ2_XXS": (256, 32),
    "IQ2_XS": (512, 32),
    "IQ2_S": (1024, 32),
    "IQ3_XXS": (256, 64),
    "IQ3_S": (512, 64),
    "IQ1_S": (2048, 32),
    "IQ1_M": (2048, 32),
}


def every_grid_point(name: str, type_size: int) -> np.ndarray:
    """Rows of blocks whose groups are the grid's points in order: d = 1, scales and signs
    0, as each type lays its indices out (ggml-common.h). Their to_float is the grid."""
    n_grid, groups = GRID_SIZES[name]
    n_blocks = -(-n_grid // (4 * groups)) * 4  # whole rows of 4 super-blocks
    blocks = np.zeros((n_blocks, type_size), dtype=np.uint8)
    idx = np.arange(n_blocks * groups).reshape(n_blocks, groups) % n_grid
    lo, hi = (idx & 255).astype(np.uint8), idx >> 8
    if name != "IQ1_M":
        blocks[:, 1] = 0x3C  # fp16 1.0
    g = np.arange(groups)
    if name == "IQ2_XXS":
        blocks[:, 2:] = np.pad(lo.reshape(-1, 8, 4), ((0, 0), (0, 0), (0, 4))).reshape(-1, 64)
    elif name == "IQ2_XS":
        blocks[:, 2:66] = idx.astype("<u2").view(np.uint8)
    elif name in ("IQ3_XXS", "IQ3_S", "IQ2_S", "IQ1_S"):
        blocks[:, 2 : 2 + groups] = lo
    if name == "IQ2_S":
        np.bitwise_or.at(blocks, (slice(None), 66 + g // 4), (hi << 2 * (g % 4)).astype(np.uint8))
    if name == "IQ3_S":
        np.bitwise_or.at(blocks, (slice(None), 66 + g // 8), (hi << g % 8).astype(np.uint8))
    if name == "IQ1_S":
        qh = np.zeros((n_blocks, 8), dtype=np.int64)
        np.add.at(qh, (slice(None), g // 4), hi << 3 * (g % 4))
        blocks[:, 34:50] = qh.astype("<u2").view(np.uint8)
    if name == "IQ1_M":
        blocks[:, :32] = lo
        np.bitwise_or.at(blocks, (slice(None), 32 + g // 2), (hi << 4 * (g % 2)).astype(np.uint8))
        blocks[:, 53], blocks[:, 55] = 0xC0, 0x30  # d = 0x3C00 in the scales' top nibbles
    return blocks.reshape(-1, 4 * type_size)


def build(g: Ggml, seed: int = 20261201) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    weights = weight_rows(rng, g)
    acts = activation_rows(rng)
    qws = imatrices(rng)
    out: dict[str, np.ndarray] = {"weights_f32": weights, "acts_f32": acts}
    out.update({f"imatrix/{k}": v for k, v in qws.items()})
    act = g.from_float_cpu(Q8_K, acts)
    out["act/Q8_K/cpu"] = act
    # many rows of one distribution with random importances: every neighbour list gets use
    # (values that are exact halves, stored as such: half the bytes of float32)
    stress16 = (rng.normal(0, 1, (24, N)) * rng.uniform(0.01, 3, (24, 1))).astype(np.float16)
    stress = stress16.astype(np.float32)
    stress_qw = np.exp(rng.normal(0, 1.5, N)).astype(np.float32)
    out["stress_f16"], out["imatrix/stress"] = stress16, stress_qw
    for name, t in TYPES.items():
        assert g.traits_cpu(t).vec_dot_type == Q8_K
        out[f"w/{name}/vec_dot_type"] = np.array(TYPE_NAMES[g.traits_cpu(t).vec_dot_type])
        out[f"w/{name}/requires_imatrix"] = np.array(g.base.ggml_quantize_requires_imatrix(t))
        for label, qw in qws.items():
            out[f"w/{name}/{label}/bytes"] = g.quantize(t, weights, qw)
        if not g.base.ggml_quantize_requires_imatrix(t):
            out[f"w/{name}/none/bytes"] = g.quantize(t, weights, None)
            out[f"w/{name}/stress/none"] = g.quantize(t, stress, None)
        out[f"w/{name}/stress/bytes"] = g.quantize(t, stress, stress_qw)
        raw = out[f"w/{name}/rand/bytes"]
        out[f"w/{name}/vec_dot_cpu"] = g.vec_dots(g.traits_cpu(t).vec_dot, raw, act, N)
        generic = VEC_DOT((GENERIC[name], g.generic))
        out[f"w/{name}/vec_dot_generic"] = g.vec_dots(generic, raw, act, N)
        points = every_grid_point(name, g.traits(t).type_size)
        out[f"grid/{name}/bytes"] = points
        out[f"grid/{name}/dequant"] = g.to_float(t, points, N)
        noise = random_blocks(rng, g, name, t)
        out[f"random/{name}/bytes"] = noise
        out[f"random/{name}/dequant"] = g.to_float(t, noise, N)
        out[f"random/{name}/vec_dot_generic"] = g.vec_dots(generic, noise, act, N)
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=OUT)
    args = parser.parse_args(argv)
    import llama_cpp

    lib = Path(llama_cpp.__file__).parent / "lib"
    with tempfile.TemporaryDirectory() as tmp:
        g = Ggml(lib, compile_generic(llama_cpp_source(), lib, Path(tmp)))
        vectors = build(g)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    part = args.out.with_name(args.out.name + ".part")
    with open(part, "wb") as f:
        np.savez_compressed(f, **vectors)
    part.replace(args.out)
    print(args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
