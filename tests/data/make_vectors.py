"""Ground truth for the GGML types of issue 11 and for importance-matrix quantization, made by
ggml itself: writes ``tests/data/ggml_vectors_new_types.npz``.

Every number in the file comes from the ggml that llama-cpp-python builds (``import
llama_cpp``: its libggml-base and libggml-cpu), called through ctypes:

* ``ggml_quantize_chunk(type, rows, ..., imatrix)``: what llama-quantize writes, with and
  without an importance matrix (it runs ``ggml_quantize_init`` itself);
* ``ggml_get_type_traits(type)``: ``to_float`` (dequantize) and ``from_float_ref`` (after
  ``ggml_quantize_init``, which the IQ3/IQ2_S references need);
* ``ggml_get_type_traits_cpu(type)``: the CPU's ``from_float``, ``vec_dot_type`` and
  ``vec_dot`` (its SIMD kernels, as llama.cpp runs them);
* the same ``vec_dot`` functions as written in C (``ggml-cpu/quants.c``), compiled here for a
  plain x86-64 without FMA contraction (``-DGGML_CPU_GENERIC -march=x86-64
  -ffp-contract=off``) from llama.cpp's source (``tools/llama_cpp_build.py source``) into a
  temporary library: the bit-exact target of qllama's CPU arithmetic. Nothing built is kept.

Run it from the repository root (``nox -s peers`` does, and checks that the committed file is
reproduced)::

    python tests/data/make_vectors.py [--out PATH] [--source LLAMA_CPP_DIR]

The layout of the file is in ``tests/data/README.md``. The inputs are made from a fixed seed
and from exact constructions (powers of two, ties), so the file is the same on every x86-64
machine with this ggml.
"""

from __future__ import annotations

import argparse
import ctypes
import importlib.util
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np

F32 = np.float32
ROW = 512  # two 256-element super-blocks; a multiple of every block size
HERE = Path(__file__).resolve().parent
ROOT = HERE.parent.parent
OUT = HERE / "ggml_vectors_new_types.npz"

# ggml_type ids (ggml/include/ggml.h)
TYPES = {
    "Q4_0": 2,
    "Q4_1": 3,
    "Q5_0": 6,
    "Q5_1": 7,
    "Q8_0": 8,
    "Q8_1": 9,
    "Q2_K": 10,
    "Q3_K": 11,
    "Q4_K": 12,
    "Q5_K": 13,
    "Q6_K": 14,
    "Q8_K": 15,
    "IQ2_XXS": 16,
    "IQ2_XS": 17,
    "IQ3_XXS": 18,
    "IQ1_S": 19,
    "IQ4_NL": 20,
    "IQ3_S": 21,
    "IQ2_S": 22,
    "IQ4_XS": 23,
    "IQ1_M": 29,
    "TQ1_0": 34,
    "TQ2_0": 35,
    "MXFP4": 39,
    "NVFP4": 40,
    "Q1_0": 41,
    "Q2_0": 42,
}
NAMES = {v: k for k, v in TYPES.items()}
# the types qllama lacked before issue 11: everything about them is recorded
NEW_TYPES = [
    "IQ4_NL",
    "IQ4_XS",
    "TQ1_0",
    "TQ2_0",
    "MXFP4",
    "NVFP4",
    "Q1_0",
    "Q2_0",
    "IQ3_XXS",
    "IQ3_S",
    "IQ2_XXS",
    "IQ2_XS",
    "IQ2_S",
    "IQ1_S",
    "IQ1_M",
]
# the types qllama had: only what an importance matrix changes is recorded (the rest is in
# ggml_vectors.npz)
OLD_TYPES = ["Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K"]


# --- inputs ------------------------------------------------------------------------------------


def weight_rows() -> tuple[np.ndarray, list[str]]:
    """The weight rows and what each is for."""
    rng = np.random.default_rng(20251101)
    rows: list[tuple[str, np.ndarray]] = []

    def add(name: str, x: np.ndarray) -> None:
        rows.append((name, np.asarray(x, dtype=F32).reshape(ROW)))

    add("normal(0, 0.02)", rng.normal(0, 0.02, ROW))
    add("normal(0, 1)", rng.normal(0, 1, ROW))
    add("t(3)", rng.standard_t(3, ROW))
    add("zeros", np.zeros(ROW))
    add("constant 0.125 (ties everywhere: IQ1's qsort order)", np.full(ROW, 0.125))
    add("tiny (|x| < 1e-6)", rng.normal(0, 1e-7, ROW))
    add("uniform(-3, 3)", rng.uniform(-3, 3, ROW))
    out = rng.normal(0, 0.05, ROW)
    out[[3, 100, 300, 511]] = [4.0, -6.0, 8.0, -3.0]
    add("outliers", out)
    add("all positive", np.abs(rng.normal(0, 1, ROW)) + 0.01)
    add("all negative", -np.abs(rng.normal(0, 1, ROW)) - 0.01)
    sparse = rng.normal(0, 1, ROW)
    sparse[::7] = 0
    add("every 7th zero", sparse)
    # one zero 32-block inside a non-zero super-block, and an all-zero super-block
    # (IQ4_XS stores its scale as -0.0 there)
    mixed = rng.normal(0, 1, ROW)
    mixed[64:96] = 0
    mixed[256:] = 0
    add("zero 32-block; zero super-block", mixed)
    # each 32-block's largest |x| exactly a power of two, or the float just below one
    # (MXFP4's floor(log2f(amax)) rounds up there), or just above
    pw = rng.uniform(-0.4, 0.4, ROW).astype(F32)
    for b in range(ROW // 32):
        top = F32(2.0 ** (b - 8))
        top = [top, np.nextafter(top, F32(0)), np.nextafter(top, F32(np.inf))][b % 3]
        pw[32 * b : 32 * b + 32] *= F32(2.0 ** (b - 8))
        pw[32 * b + (b * 5) % 32] = top if b % 2 else -top
    add("amax at and around powers of two", pw)
    # NVFP4: 16-blocks whose amax/6 lands on UE4M3's edges: subnormal, the top code, and
    # values >= 256 (-> 0x7E)
    nv = rng.uniform(-1, 1, ROW).astype(F32)
    tops = [1e-3, 6 * 2.0**-9, 6 * 7 * 2.0**-9, 6 * 0.5, 6 * 240, 6 * 247.9, 6 * 248, 6 * 300]
    tops += [6 * 448, 6 * 2.0**-10, 5.0, 6.0, 7.0, 1e-4, 6 * 2.0**-6, 6 * 15 * 2.0**-7]
    for s in range(ROW // 16):
        t = F32(tops[s % len(tops)])
        nv[16 * s : 16 * s + 16] *= t
        nv[16 * s + s % 16] = t if s % 2 else -t
    add("NVFP4 scale edges", nv)
    # IQ4: a block with max 127 puts id*x exactly on the midpoints between kvalues
    # (best_index_int8 sends ties up); TQ/Q2_0: x/amax exactly +-0.5 and just below it
    kv = np.array([-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113])
    mids = (kv[:-1] + kv[1:]) / 2
    ties = np.resize(np.concatenate([[127.0], mids, -mids[::-1], [-127.0]]), ROW).astype(F32)
    half = F32(0.5)
    below = np.nextafter(half, F32(0))
    ties[256:] = np.resize([1.0, half, -half, below, -below, 0.0, 0.25, -0.75], 256)
    add("IQ4 midpoint ties; +-0.5 ties", ties)
    signs = rng.normal(0, 1, ROW).astype(F32)
    signs[::5] = F32(-0.0)
    signs[1::5] = F32(0.0)
    add("signed zeros (Q1_0 stores -0.0 as +)", signs)
    add("large (fp16 scales overflow)", rng.normal(0, 1, ROW) * 1e5)
    add("normal(0, 0.02) again", rng.normal(0, 0.02, ROW))
    names = [n for n, _ in rows]
    return np.stack([x for _, x in rows]), names


def imatrix_rows() -> tuple[np.ndarray, list[str]]:
    """Per-column importances, as llama-quantize hands them to ggml (means of x**2)."""
    rng = np.random.default_rng(20251102)
    rows = [
        ("exp(N(0, 1))", np.exp(rng.normal(0, 1, ROW))),
        ("ones", np.ones(ROW)),
        (
            "exp(N(0, 1)), every 5th column 0",
            np.where(np.arange(ROW) % 5 == 0, 0, 1) * np.exp(rng.normal(0, 1, ROW)),
        ),
        ("exp(N(0, 3))", np.exp(rng.normal(0, 3, ROW))),
    ]
    return np.stack([np.asarray(x, F32) for _, x in rows]), [n for n, _ in rows]


def activation_rows() -> np.ndarray:
    """Activation rows for the dot products (the CPU quantizes them to ``vec_dot_type``)."""
    rng = np.random.default_rng(20251103)
    acts = [
        rng.normal(0, 1, ROW),
        rng.normal(0, 3, ROW),
        rng.standard_t(3, ROW),
        rng.uniform(-1, 1, ROW),
        np.zeros(ROW),
        np.full(ROW, -0.5),
        rng.normal(0, 1e-3, ROW),
        np.abs(rng.normal(0, 1, ROW)),
    ]
    spikes = rng.normal(0, 0.1, ROW)
    spikes[[0, 31, 255, 256]] = [30.0, -50.0, 20.0, -10.0]
    acts.append(spikes)
    return np.stack([np.asarray(a, F32) for a in acts])


# --- ggml through ctypes -----------------------------------------------------------------------


class TypeTraits(ctypes.Structure):
    _fields_ = [
        ("type_name", ctypes.c_char_p),
        ("blck_size", ctypes.c_int64),
        ("blck_size_interleave", ctypes.c_int64),
        ("type_size", ctypes.c_size_t),
        ("is_quantized", ctypes.c_bool),
        ("to_float", ctypes.c_void_p),
        ("from_float_ref", ctypes.c_void_p),
    ]


class TypeTraitsCPU(ctypes.Structure):
    _fields_ = [
        ("from_float", ctypes.c_void_p),
        ("vec_dot", ctypes.c_void_p),
        ("vec_dot_type", ctypes.c_int),
        ("nrows", ctypes.c_int64),
    ]


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


def _ptr(a: np.ndarray) -> ctypes.c_void_p:
    return ctypes.c_void_p(a.ctypes.data)


class GGML:
    """libggml-base and libggml-cpu of the installed llama-cpp-python."""

    def __init__(self) -> None:
        spec = importlib.util.find_spec("llama_cpp")
        if spec is None or spec.origin is None:
            raise SystemExit("llama-cpp-python is not installed (nox -s peers builds it)")
        self.lib_dir = Path(spec.origin).parent / "lib"
        mode = ctypes.RTLD_GLOBAL
        self.base = ctypes.CDLL(str(self.lib_dir / "libggml-base.so"), mode=mode)
        self.cpu = ctypes.CDLL(str(self.lib_dir / "libggml-cpu.so"), mode=mode)
        self.cpu.ggml_cpu_init()
        b = self.base
        b.ggml_quantize_chunk.restype = ctypes.c_size_t
        b.ggml_quantize_chunk.argtypes = [
            ctypes.c_int,
            ctypes.c_void_p,
            ctypes.c_void_p,
            ctypes.c_int64,
            ctypes.c_int64,
            ctypes.c_int64,
            ctypes.c_void_p,
        ]
        b.ggml_quantize_requires_imatrix.restype = ctypes.c_bool
        b.ggml_quantize_requires_imatrix.argtypes = [ctypes.c_int]
        b.ggml_quantize_init.argtypes = [ctypes.c_int]
        b.ggml_get_type_traits.restype = ctypes.POINTER(TypeTraits)
        b.ggml_get_type_traits.argtypes = [ctypes.c_int]
        self.cpu.ggml_get_type_traits_cpu.restype = ctypes.POINTER(TypeTraitsCPU)
        self.cpu.ggml_get_type_traits_cpu.argtypes = [ctypes.c_int]

    def traits(self, t: str) -> TypeTraits:
        return self.base.ggml_get_type_traits(TYPES[t]).contents

    def traits_cpu(self, t: str) -> TypeTraitsCPU:
        return self.cpu.ggml_get_type_traits_cpu(TYPES[t]).contents

    def row_bytes(self, t: str, n: int = ROW) -> int:
        tr = self.traits(t)
        return n // tr.blck_size * tr.type_size

    def requires_imatrix(self, t: str) -> bool:
        return bool(self.base.ggml_quantize_requires_imatrix(TYPES[t]))

    def quantize_chunk(self, t: str, x: np.ndarray, imatrix: np.ndarray | None) -> np.ndarray:
        x = np.ascontiguousarray(x, dtype=F32)
        out = np.zeros((x.shape[0], self.row_bytes(t, x.shape[1])), np.uint8)
        qw = None if imatrix is None else _ptr(np.ascontiguousarray(imatrix, dtype=F32))
        n = self.base.ggml_quantize_chunk(
            TYPES[t], _ptr(x), _ptr(out), 0, x.shape[0], x.shape[1], qw
        )
        assert n == out.size
        return out

    def to_float(self, t: str, raw: np.ndarray) -> np.ndarray:
        fn = TO_FLOAT(self.traits(t).to_float)
        out = np.empty((raw.shape[0], ROW), F32)
        for i in range(raw.shape[0]):
            row = np.ascontiguousarray(raw[i])
            fn(_ptr(row), _ptr(out[i]), ROW)
        return out

    def from_float(self, fn_addr: int, t: str, x: np.ndarray) -> np.ndarray:
        fn = FROM_FLOAT(fn_addr)
        out = np.zeros((x.shape[0], self.row_bytes(t)), np.uint8)
        for i in range(x.shape[0]):
            row = np.ascontiguousarray(x[i], dtype=F32)
            fn(_ptr(row), _ptr(out[i]), ROW)
        return out

    def vec_dot(self, fn_addr: int, w: np.ndarray, a: np.ndarray) -> np.ndarray:
        """(weight rows, activation rows) float32 of ``vec_dot(w_i, a_j)``."""
        fn = VEC_DOT(fn_addr)
        out = np.empty((w.shape[0], a.shape[0]), F32)
        s = np.zeros(1, F32)
        for i in range(w.shape[0]):
            wi = np.ascontiguousarray(w[i])
            for j in range(a.shape[0]):
                aj = np.ascontiguousarray(a[j])
                fn(ROW, _ptr(s), 0, _ptr(wi), 0, _ptr(aj), 0, 1)
                out[i, j] = s[0]
        return out


def generic_vec_dots(ggml: GGML, source: Path, tmp: Path) -> ctypes.CDLL:
    """ggml-cpu/quants.c compiled as written: every ``vec_dot`` is the ``_generic`` C loop,
    float32 without FMA contraction. Linked against the installed libraries (fp16 tables)."""
    lib = tmp / "libggml_generic_vec_dot.so"
    cpu_src = source / "ggml" / "src" / "ggml-cpu"
    cmd = ["cc", "-O2", "-march=x86-64", "-ffp-contract=off", "-fPIC", "-shared"]
    cmd += [
        "-DGGML_CPU_GENERIC",
        f"-I{source / 'ggml' / 'include'}",
        f"-I{source / 'ggml' / 'src'}",
    ]
    cmd += [f"-I{cpu_src}", str(cpu_src / "quants.c"), "-o", str(lib), f"-L{ggml.lib_dir}"]
    cmd += ["-l:libggml-cpu.so", "-l:libggml-base.so", f"-Wl,-rpath,{ggml.lib_dir}"]
    subprocess.run(cmd, check=True)
    return ctypes.CDLL(str(lib))


def _generic_name(t: str, dot_type: str) -> str:
    """C's spelling: ``ggml_vec_dot_q4_K_q8_K``, ``ggml_vec_dot_iq4_nl_q8_0``."""

    def c(name: str) -> str:
        low = name.lower()
        return low[:-2] + "_K" if low.endswith("_k") else low

    return f"ggml_vec_dot_{c(t)}_{c(dot_type)}"


def _defined(t: str, raw: np.ndarray, x: np.ndarray) -> np.ndarray:
    """``raw`` with the bytes ggml leaves undefined set to 0: quantize_row_iq4_nl_ref (IQ4_NL's
    from_float, ntry = -1) writes an all-zero block's nibbles from an uninitialised stack
    buffer (its scale is 0, so the values are 0 whatever they are)."""
    if t != "IQ4_NL":
        return raw
    blocks = raw.reshape(-1, 18).copy()
    zero = np.abs(x.reshape(-1, 32)).max(axis=1) < 1e-15
    blocks[zero, 2:] = 0
    return blocks.reshape(raw.shape)


def llama_cpp_source() -> Path:
    """vendor/llama.cpp of the llama-cpp-python sdist (unpacked once, cached)."""
    script = ROOT / "tools" / "llama_cpp_build.py"
    spec = importlib.util.spec_from_file_location("_llama_cpp_build", script)
    assert spec is not None and spec.loader is not None
    build = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(build)
    return Path(build.source())


# --- the file ---------------------------------------------------------------------------------


def make(source: Path) -> dict[str, np.ndarray]:
    ggml = GGML()
    weights, weight_names = weight_rows()
    imatrix, imatrix_names = imatrix_rows()
    acts = activation_rows()
    out: dict[str, np.ndarray] = {
        "weights_f32": weights,
        "weight_names": np.array(weight_names),
        "imatrix_f32": imatrix,
        "imatrix_names": np.array(imatrix_names),
        "acts_f32": acts,
    }
    rng = np.random.default_rng(20251104)
    with tempfile.TemporaryDirectory() as tmp:
        generic = generic_vec_dots(ggml, source, Path(tmp))
        act_bytes: dict[str, np.ndarray] = {}
        for act in ("Q8_0", "Q8_K"):
            act_bytes[act] = ggml.from_float(ggml.traits_cpu(act).from_float, act, acts)
            out[f"act/{act}/cpu"] = act_bytes[act]
        for t in OLD_TYPES + NEW_TYPES:
            with_imatrix = np.stack([ggml.quantize_chunk(t, weights, qw) for qw in imatrix])
            out[f"w/{t}/bytes_imatrix"] = with_imatrix
            if t in OLD_TYPES:
                continue
            print(f"{t}: ", end="", file=sys.stderr, flush=True)
            plain = None
            if not ggml.requires_imatrix(t):
                plain = ggml.quantize_chunk(t, weights, None)
                out[f"w/{t}/bytes"] = plain
                out[f"w/{t}/dequant"] = ggml.to_float(t, plain)
            out[f"w/{t}/dequant_imatrix"] = np.stack([ggml.to_float(t, b) for b in with_imatrix])
            # arbitrary bytes: every code, and NaN / inf / subnormal scales
            noise = rng.integers(0, 256, size=(8, ggml.row_bytes(t)), dtype=np.uint8)
            out[f"w/{t}/random_bytes"] = noise
            out[f"w/{t}/random_dequant"] = ggml.to_float(t, noise)
            ref = ggml.traits(t).from_float_ref
            if ref:
                ggml.base.ggml_quantize_init(TYPES[t])  # the IQ3 / IQ2_S references need it
                out[f"w/{t}/from_float_ref"] = _defined(
                    t, ggml.from_float(ref, t, weights), weights
                )
            cpu = ggml.traits_cpu(t)
            if cpu.from_float:
                raw = ggml.from_float(cpu.from_float, t, weights)
                out[f"w/{t}/from_float_cpu"] = _defined(t, raw, weights)
            dot_type = NAMES[cpu.vec_dot_type]
            out[f"w/{t}/vec_dot_type"] = np.array(dot_type)
            wbytes = plain if plain is not None else with_imatrix[0]
            out[f"w/{t}/vec_dot_cpu"] = ggml.vec_dot(cpu.vec_dot, wbytes, act_bytes[dot_type])
            fn = ctypes.cast(getattr(generic, _generic_name(t, dot_type)), ctypes.c_void_p).value
            assert fn is not None
            out[f"w/{t}/vec_dot_generic"] = ggml.vec_dot(fn, wbytes, act_bytes[dot_type])
            print("done", file=sys.stderr)
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=OUT)
    parser.add_argument("--source", type=Path, default=None, help="llama.cpp's source tree")
    parser.add_argument(
        "--check", action="store_true", help="compare with the file at --out instead of writing"
    )
    args = parser.parse_args(argv)
    source = args.source or llama_cpp_source()
    data = make(source)
    if args.check:
        with np.load(args.out) as z:
            old = {k: z[k] for k in z.files}
        differ = sorted(
            k
            for k in set(old) | set(data)
            if k not in old or k not in data or not _same(old[k], data[k])
        )
        if differ:
            print("differs from " + str(args.out) + ": " + ", ".join(differ), file=sys.stderr)
            return 1
        print(f"{args.out}: reproduced ({len(data)} arrays)")
        return 0
    tmp = args.out.with_suffix(".tmp.npz")
    np.savez_compressed(tmp, **data)
    tmp.replace(args.out)
    print(f"wrote {args.out} ({len(data)} arrays)")
    return 0


def _same(a: np.ndarray, b: np.ndarray) -> bool:
    """Equal bytes (NaN payloads and signed zeros included)."""
    if a.dtype.kind in "US" or b.dtype.kind in "US":
        return a.shape == b.shape and bool((a == b).all())
    return a.dtype == b.dtype and a.shape == b.shape and a.tobytes() == b.tobytes()


if __name__ == "__main__":
    raise SystemExit(main())
