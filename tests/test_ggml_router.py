"""The router's ops in the CPU arithmetic (qllama.backends.numpy.router, and their compiled
form in qllama.backends.numpy.kernels.router) against ggml's own code, compiled here:
``ggml_v_expf`` (AVX2 and AVX-512) and ``ggml_vec_soft_max_f32``'s SIMD blocks (8 lanes with
AVX2, 16 with AVX-512F/DQ) and scalar loop, and ``ggml_vec_sum_f32`` (``sum_rows``), copied
from vendor/llama.cpp's ggml-cpu (vec.h, vec.cpp, ops.cpp), bit for bit.

Skipped where no C compiler is installed or the CPU lacks the build's instructions (AVX2 and
FMA; AVX-512F and AVX-512DQ).
"""

from __future__ import annotations

import ctypes
import dataclasses
import functools
import itertools
import shutil
import subprocess
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from test_architectures import FAMILIES, IDS

import qllama
from qllama.array_api import to_numpy
from qllama.backends.base import glue, router_softmax, row_sum
from qllama.backends.numpy import router
from qllama.errors import BackendError
from qllama.runtime.architectures import Gating
from qllama.runtime.model import MIN_WEIGHT_SUM, expert_weights, router_gate, select_experts
from qllama.runtime.routing import THRESHOLD
from qllama.synthetic import write_tiny

GGML = r"""
#include <immintrin.h>
#include <math.h>
typedef double ggml_float;

static inline __m256 ggml_v_expf(__m256 x) {
  const __m256 r = _mm256_set1_ps(0x1.8p23f);
  const __m256 z = _mm256_fmadd_ps(x, _mm256_set1_ps(0x1.715476p+0f), r);
  const __m256 n = _mm256_sub_ps(z, r);
  const __m256 b = _mm256_fnmadd_ps(n, _mm256_set1_ps(0x1.7f7d1cp-20f),
                                    _mm256_fnmadd_ps(n, _mm256_set1_ps(0x1.62e4p-1f), x));
  const __m256i e = _mm256_slli_epi32(_mm256_castps_si256(z), 23);
  const __m256 k = _mm256_castsi256_ps(
      _mm256_add_epi32(e, _mm256_castps_si256(_mm256_set1_ps(1))));
  const __m256i c = _mm256_castps_si256(
      _mm256_cmp_ps(_mm256_andnot_ps(_mm256_set1_ps(-0.f), n),
                    _mm256_set1_ps(126), _CMP_GT_OQ));
  const __m256 u = _mm256_mul_ps(b, b);
  const __m256 j = _mm256_fmadd_ps(
      _mm256_fmadd_ps(
          _mm256_fmadd_ps(_mm256_set1_ps(0x1.0e4020p-7f), b, _mm256_set1_ps(0x1.573e2ep-5f)), u,
          _mm256_fmadd_ps(_mm256_set1_ps(0x1.555e66p-3f), b, _mm256_set1_ps(0x1.fffdb6p-2f))),
      u, _mm256_mul_ps(_mm256_set1_ps(0x1.ffffecp-1f), b));
  if (!_mm256_movemask_ps(_mm256_castsi256_ps(c)))
    return _mm256_fmadd_ps(j, k, k);
  const __m256i g = _mm256_and_si256(
      _mm256_castps_si256(_mm256_cmp_ps(n, _mm256_setzero_ps(), _CMP_LE_OQ)),
      _mm256_set1_epi32(0x82000000u));
  const __m256 s1 =
      _mm256_castsi256_ps(_mm256_add_epi32(g, _mm256_set1_epi32(0x7f000000u)));
  const __m256 s2 = _mm256_castsi256_ps(_mm256_sub_epi32(e, g));
  const __m256i d = _mm256_castps_si256(
      _mm256_cmp_ps(_mm256_andnot_ps(_mm256_set1_ps(-0.f), n),
                    _mm256_set1_ps(192), _CMP_GT_OQ));
  return _mm256_or_ps(
      _mm256_and_ps(_mm256_castsi256_ps(d), _mm256_mul_ps(s1, s1)),
      _mm256_andnot_ps(
          _mm256_castsi256_ps(d),
          _mm256_or_ps(
              _mm256_and_ps(_mm256_castsi256_ps(c),
                            _mm256_mul_ps(_mm256_fmadd_ps(s2, j, s2), s1)),
              _mm256_andnot_ps(_mm256_castsi256_ps(c), _mm256_fmadd_ps(k, j, k)))));
}

void v_expf8(const float * x, float * y) { _mm256_storeu_ps(y, ggml_v_expf(_mm256_loadu_ps(x))); }

/* ggml_compute_forward_soft_max_f32 on one row (scale 1, no mask, no sinks), with
   ggml_vec_max_f32, ggml_vec_soft_max_f32 (its AVX2 blocks where simd) and ggml_vec_scale_f32 */
void soft_max_row(int n, const float * x, float * y, int simd) {
    float max = -INFINITY;
    for (int i = 0; i < n; ++i) max = max > x[i] ? max : x[i];
    int i = 0;
    ggml_float sum = 0;
    if (simd) {
        for (; i + 7 < n; i += 8) {
            __m256 val = ggml_v_expf(_mm256_sub_ps(_mm256_loadu_ps(x + i), _mm256_set1_ps(max)));
            _mm256_storeu_ps(y + i, val);
            __m128 val2 = _mm_add_ps(_mm256_extractf128_ps(val, 1), _mm256_castps256_ps128(val));
            val2 = _mm_add_ps(val2, _mm_movehl_ps(val2, val2));
            val2 = _mm_add_ss(val2, _mm_movehdup_ps(val2));
            sum += (ggml_float)_mm_cvtss_f32(val2);
        }
    }
    for (; i < n; ++i) {
        float val = expf(x[i] - max);
        sum += (ggml_float)val;
        y[i] = val;
    }
    sum = 1.0/sum;
    const float v = sum;
    for (int k = 0; k < n; ++k) y[k] *= v;
}
"""


GGML_AVX512 = r"""
#include <immintrin.h>
#include <math.h>
typedef double ggml_float;

static inline __m512 ggml_v_expf(__m512 x) {
  const __m512 r = _mm512_set1_ps(0x1.8p23f);
  const __m512 z = _mm512_fmadd_ps(x, _mm512_set1_ps(0x1.715476p+0f), r);
  const __m512 n = _mm512_sub_ps(z, r);
  const __m512 b =
      _mm512_fnmadd_ps(n, _mm512_set1_ps(0x1.7f7d1cp-20f),
                       _mm512_fnmadd_ps(n, _mm512_set1_ps(0x1.62e4p-1f), x));
  const __mmask16 d =
      _mm512_cmp_ps_mask(_mm512_abs_ps(n), _mm512_set1_ps(192), _CMP_GT_OQ);
  const __m512 u = _mm512_mul_ps(b, b);
  const __m512 j = _mm512_fmadd_ps(
      _mm512_fmadd_ps(_mm512_fmadd_ps(_mm512_set1_ps(0x1.0e4020p-7f), b,
                                      _mm512_set1_ps(0x1.573e2ep-5f)),
                      u,
                      _mm512_fmadd_ps(_mm512_set1_ps(0x1.555e66p-3f), b,
                                      _mm512_set1_ps(0x1.fffdb6p-2f))),
      u,
      _mm512_fmadd_ps(_mm512_set1_ps(0x1.ffffecp-1f), b, _mm512_set1_ps(1.0F)));
  const __m512 res = _mm512_scalef_ps(j, n);
  if (_mm512_kortestz(d, d))
    return res;
  const __m512 zero = _mm512_setzero_ps();
  const __m512 alt = _mm512_mask_blend_ps(
      _mm512_cmp_ps_mask(n, zero, _CMP_LE_OQ), _mm512_set1_ps(INFINITY), zero);
  return _mm512_mask_blend_ps(d, res, alt);
}

void v_expf16(const float * x, float * y) { _mm512_storeu_ps(y, ggml_v_expf(_mm512_loadu_ps(x))); }

/* ggml_compute_forward_soft_max_f32 on one row as soft_max_row, with ggml_vec_soft_max_f32's
   AVX-512 blocks (__AVX512F__ && __AVX512DQ__) */
void soft_max_row16(int n, const float * x, float * y) {
    float max = -INFINITY;
    for (int i = 0; i < n; ++i) max = max > x[i] ? max : x[i];
    int i = 0;
    ggml_float sum = 0;
    for (; i + 15 < n; i += 16) {
        __m512 val = ggml_v_expf(_mm512_sub_ps(_mm512_loadu_ps(x + i), _mm512_set1_ps(max)));
        _mm512_storeu_ps(y + i, val);
        sum += (ggml_float)_mm512_reduce_add_ps(val);
    }
    for (; i < n; ++i) {
        float val = expf(x[i] - max);
        sum += (ggml_float)val;
        y[i] = val;
    }
    sum = 1.0/sum;
    const float v = sum;
    for (int k = 0; k < n; ++k) y[k] *= v;
}
"""

GGML_SUM = r"""
typedef double ggml_float;

/* ggml_compute_forward_sum_rows_f32 over rows of n, with ggml_vec_sum_f32 (no Accelerate) */
void sum_rows(int rows, int n, const float * x, float * y) {
    for (int r = 0; r < rows; ++r) {
        ggml_float sum = 0.0;
        for (int i = 0; i < n; ++i) sum += (ggml_float)x[r * n + i];
        y[r] = (float)sum;
    }
}
"""

CPU_FLAGS = (
    set(Path("/proc/cpuinfo").read_text().split()) if Path("/proc/cpuinfo").exists() else set()
)


def build(
    factory: pytest.TempPathFactory, source: str, flags: list[str], needs: tuple[str, ...]
) -> ctypes.CDLL:
    """``source`` compiled with ``flags`` into a library loaded here; skipped without a C
    compiler or where the CPU lacks one of ``needs`` (names of /proc/cpuinfo's flags)."""
    cc = shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        pytest.skip("no C compiler to build ggml's code with")
    missing = [f for f in needs if f not in CPU_FLAGS]
    if missing:
        pytest.skip(f"ggml's code here needs a CPU with {', '.join(missing)}")
    folder = factory.mktemp("ggml_router")
    (folder / "s.c").write_text(source)
    lib = folder / "libs.so"
    cmd = [cc, "-O2", *flags, "-ffp-contract=off", "-shared", "-fPIC"]
    subprocess.run([*cmd, "-o", str(lib), str(folder / "s.c"), "-lm"], check=True)
    return ctypes.CDLL(str(lib))


@pytest.fixture(scope="module")
def ggml(tmp_path_factory: pytest.TempPathFactory) -> ctypes.CDLL:
    return build(tmp_path_factory, GGML, ["-mavx2", "-mfma"], ("avx2", "fma"))


@pytest.fixture(scope="module")
def ggml512(tmp_path_factory: pytest.TempPathFactory) -> ctypes.CDLL:
    flags = ["-mavx512f", "-mavx512dq"]
    return build(tmp_path_factory, GGML_AVX512, flags, ("avx512f", "avx512dq"))


@pytest.fixture(scope="module")
def ggml_sum(tmp_path_factory: pytest.TempPathFactory) -> ctypes.CDLL:
    return build(tmp_path_factory, GGML_SUM, [], ())


def _ptr(a: np.ndarray) -> ctypes.c_void_p:
    return a.ctypes.data_as(ctypes.c_void_p)


def rows(n: int, seed: int) -> np.ndarray:
    """Router-like rows of n logits: spread ones, near-ties (a few ulp apart), equal values,
    and rows spanning more than exp's range below the max (|n| > 126 and > 192 in v_expf,
    subnormal exps between)."""
    rng = np.random.default_rng(seed)
    out = [rng.normal(0, s, n) for s in (0.5, 3.0, 20.0)]
    tied = np.full(n, 1.25)
    tied[::3] = np.nextafter(np.float32(1.25), np.float32(2))
    out += [tied, np.zeros(n), np.linspace(0.0, -140.0, n), np.linspace(5.0, -95.0, n)]
    out += [np.linspace(0.0, -400.0, n), rng.uniform(-104.0, -87.0, n)]
    return np.array(out, np.float32)  # (9, n)


def exp_arguments(width: int) -> np.ndarray:
    """Arguments of exp, a multiple of ``width`` long: where ggml's SIMD exp rounds, where
    its result is subnormal, where it leaves float's range and its special lanes."""
    rng = np.random.default_rng(0)
    x = np.concatenate(
        [
            rng.uniform(-110, 0, 4000),
            rng.uniform(-200, 89, 4000),
            -rng.exponential(1, 4000),
            rng.uniform(-104, -87, 4000),  # subnormal results
        ]
    ).astype(np.float32)
    x = np.concatenate([x, np.float32([0.0, -0.0, -87.5, -126.9, -192.1, -1e-8, -1e30])])
    return x[: len(x) // width * width]


def _compiled(name: str) -> Callable[..., Any]:
    """The numpy backend's compiled form of router op ``name`` (skips without numba)."""
    pytest.importorskip("numba")
    from qllama.backends.numpy import glue as numpy_glue

    return {"soft_max": numpy_glue.router_soft_max, "sum_rows": numpy_glue.router_sum_rows}[name]


@functools.cache
def _lanes() -> Callable[[np.ndarray, int], np.ndarray]:
    """The compiled kernels' ggml_v_expf, lane by lane: ``lanes(x, width)`` (compiled once)."""
    import numba

    from qllama.backends.numpy.kernels.router import v_expf

    @numba.njit
    def lanes(x: np.ndarray, width: int) -> np.ndarray:
        out = np.empty_like(x)
        for i in range(x.shape[0]):
            out[i] = v_expf(x[i], width)
        return out

    return lanes


def _compiled_lanes(width: int) -> Callable[[np.ndarray], np.ndarray]:
    """The compiled kernels' ggml_v_expf of the ``width``-lane build (skips without numba)."""
    pytest.importorskip("numba")
    return lambda x: _lanes()(x, width)


# each router op as numpy code (qllama.backends.numpy.router) and compiled (its kernels)
IMPLS = ["numpy", "numba"]


def soft_max_of(impl: str) -> Callable[..., np.ndarray]:
    return router.soft_max if impl == "numpy" else _compiled("soft_max")


@pytest.mark.parametrize("impl", IMPLS)
def test_v_expf_avx2_is_ggmls(ggml: ctypes.CDLL, impl: str) -> None:
    x = exp_arguments(8)
    want = np.empty_like(x)
    for a in range(0, len(x), 8):
        ggml.v_expf8(_ptr(x[a:]), _ptr(want[a:]))
    got = router.v_expf_avx2(x) if impl == "numpy" else _compiled_lanes(8)(x)
    np.testing.assert_array_equal(got.view(np.int32), want.view(np.int32))


@pytest.mark.parametrize("impl", IMPLS)
def test_v_expf_avx512_is_ggmls(ggml512: ctypes.CDLL, impl: str) -> None:
    """Subnormal results (scalef rounds once, as ldexp), lanes past |n| > 192 and infinities."""
    x = np.concatenate([exp_arguments(16), np.float32([np.inf, -np.inf, 88.5, 89.0] * 4)])
    want = np.empty_like(x)
    for a in range(0, len(x), 16):
        ggml512.v_expf16(_ptr(x[a:]), _ptr(want[a:]))
    got = router.v_expf_avx512(x) if impl == "numpy" else _compiled_lanes(16)(x)
    assert (want[(want > 0) & (want < np.finfo(np.float32).tiny)]).size > 100  # subnormals
    np.testing.assert_array_equal(got.view(np.int32), want.view(np.int32))


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("simd", [True, False], ids=["avx2", "scalar"])
@pytest.mark.parametrize("n", [4, 8, 15, 32, 60, 128])
def test_soft_max_is_ggmls(ggml: ctypes.CDLL, n: int, simd: bool, impl: str) -> None:
    x = rows(n, n)
    want = np.empty_like(x)
    for r in range(x.shape[0]):
        ggml.soft_max_row(n, _ptr(x[r]), _ptr(want[r]), int(simd))
    got = soft_max_of(impl)(x, simd=simd, width=8)
    np.testing.assert_array_equal(got.view(np.int32), want.view(np.int32))


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("n", [4, 15, 16, 17, 32, 60, 128])
def test_soft_max_avx512_is_ggmls(ggml512: ctypes.CDLL, n: int, impl: str) -> None:
    x = rows(n, n)
    want = np.empty_like(x)
    for r in range(x.shape[0]):
        ggml512.soft_max_row16(n, _ptr(x[r]), _ptr(want[r]))
    soft_max = soft_max_of(impl)
    got = soft_max(x, simd=True, width=16)
    np.testing.assert_array_equal(got.view(np.int32), want.view(np.int32))
    if n >= 16:  # another build's blocks: not the same bits (the test data tells them apart)
        assert not np.array_equal(got, soft_max(x, simd=True, width=8))


@pytest.mark.parametrize("width", [8, 16])
@pytest.mark.parametrize("simd", [True, False], ids=["simd", "scalar"])
def test_the_compiled_soft_max_is_the_numpy_codes(simd: bool, width: int) -> None:
    """Both forms on rows of every length to 40 and on NaN and infinite logits (no C
    compiler or SIMD instructions needed): the same bits."""
    compiled = _compiled("soft_max")
    for n in range(1, 41):
        x = rows(n, 100 + n)
        x[0, n // 2] = np.nan
        x[1, n - 1] = np.inf
        x[2, 0] = -np.inf
        with np.errstate(invalid="ignore"):
            want = router.soft_max(x, simd=simd, width=width)
        np.testing.assert_array_equal(compiled(x, simd=simd, width=width), want)


# logits drawn with ties likely, and now and then NaN or infinite
LOGITS = st.one_of(
    st.sampled_from([0.5, -1.0, 2.0, 0.0, -0.0]),
    st.floats(-30, 30, width=32),
    st.sampled_from([np.nan, np.inf, -np.inf]),
)


@settings(max_examples=150, deadline=None)
@given(n=st.integers(1, 40), T=st.integers(1, 4), data=st.data())
def test_the_compiled_route_is_the_models_steps(n: int, T: int, data: st.DataObject) -> None:
    """The glue op "route" (a router's softmax, top k and weights in one compiled call) gives
    the bits of the model's steps with the compiled soft_max and sum_rows, for either gating,
    with and without the weights' norm, with any scale; where a row holds a NaN, or past 16
    experts its top k + 1 meet a tie, it declines (None) and the steps rank it."""
    pytest.importorskip("numba")
    from qllama.backends.numpy import glue as numpy_glue

    k = data.draw(st.integers(1, n))
    simd, width = data.draw(st.booleans()), data.draw(st.sampled_from([8, 16]))
    gating = data.draw(st.sampled_from([Gating.SOFTMAX, Gating.SOFTMAX_WEIGHT]))
    norm, scale = data.draw(st.booleans()), data.draw(st.sampled_from([0.0, 1.0, 2.5, 0.1]))
    x = np.array(data.draw(st.lists(LOGITS, min_size=T * n, max_size=T * n)), np.float32)
    x = x.reshape(T, n)
    soft_max = functools.partial(numpy_glue.router_soft_max, simd=simd, width=width)
    got = numpy_glue.router_route(
        x,
        k,
        gating == Gating.SOFTMAX,
        norm,
        scale,
        MIN_WEIGHT_SUM,
        THRESHOLD,
        simd=simd,
        width=width,
    )
    with np.errstate(invalid="ignore", over="ignore"):
        probs = router_gate(x, gating, xp=np, softmax=soft_max)
        ranked = -np.sort(-probs, axis=-1)[:, : k + 1]  # (T, k+1) the largest first
        if np.isnan(probs).any() or (n > THRESHOLD and (ranked[:, 1:] == ranked[:, :-1]).any()):
            assert got is None
            return
        selected = select_experts(probs, k, xp=np, asarray=np.asarray)
        weights = expert_weights(
            probs,
            selected,
            gating,
            norm,
            scale,
            xp=np,
            softmax=soft_max,
            sum_rows=numpy_glue.router_sum_rows,
        )
    assert got is not None
    np.testing.assert_array_equal(got[0], selected)
    np.testing.assert_array_equal(got[1].view(np.int32), weights.view(np.int32))


def weight_rows(k: int, seed: int) -> np.ndarray:
    """(256, k) float32 top-k weights as a router gives them: a softmax's probabilities, the
    largest first."""
    rng = np.random.default_rng(seed)
    p = router.soft_max(rng.normal(0, 2.0, (256, 4 * k)).astype(np.float32), simd=False)
    return np.ascontiguousarray(-np.sort(-p, axis=-1)[:, :k])


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("k", [1, 2, 3, 4, 6, 8, 16, 60])
def test_sum_rows_is_ggmls(ggml_sum: ctypes.CDLL, k: int, impl: str) -> None:
    """ggml's sum_rows adds in order in double; a float32 sum differs from it for k > 2 on
    some of these rows (asserted, so that this test tells them apart)."""
    x = weight_rows(k, k)
    want = np.empty(x.shape[0], np.float32)
    ggml_sum.sum_rows(x.shape[0], k, _ptr(x), _ptr(want))
    got = router.sum_rows(x) if impl == "numpy" else _compiled("sum_rows")(x)
    assert got.shape == (x.shape[0], 1)
    np.testing.assert_array_equal(got[:, 0].view(np.int32), want.view(np.int32))
    single = row_sum(x, xp=np)[:, 0]
    if k > 2:
        assert not np.array_equal(single, want)
    else:  # two floats' sum in double is exact, rounded once: float32's own sum
        np.testing.assert_array_equal(single, want)


def test_the_cpu_arithmetic_routes_with_them(tmp_path: Path) -> None:
    """The numpy backend offers ggml's router ops as glue in the CPU arithmetic, with or
    without its compiled kernels: the scalar softmax under activation_rounding "ref", the
    blocks of the simd_width build under "simd", and sum_rows; the model resolves them once.
    Its f32 arithmetic offers none (the model's array-API forms)."""
    path = tmp_path / "q.gguf"
    write_tiny(path, FAMILIES["qwen3moe"])
    logits: list[np.ndarray] = []
    m = qllama.load(path, backend="numpy")
    m.forward(IDS, observer=lambda n, v: logits.append(to_numpy(v)) if "router" in n else None)
    assert logits and logits[0].shape == (len(IDS), FAMILIES["qwen3moe"].n_expert)
    x = np.concatenate([logits[0], rows(logits[0].shape[1], 1)])  # and some ties
    kernels = ["numpy", "numba"] if "numba" in m.backend.describe() else ["numpy"]
    for rounding, width, kernel in itertools.product(("ref", "simd"), (8, 16), kernels):
        options = dict(activation_rounding=rounding, simd_width=width, kernels=kernel)
        q8 = qllama.load(path, backend="numpy", **options)
        want = router.soft_max(x, simd=rounding == "simd", width=width)
        np.testing.assert_array_equal(q8.gate_softmax(x), want)
        np.testing.assert_array_equal(glue(q8.backend, "soft_max")(x), want)
        assert q8.gate_sum is glue(q8.backend, "sum_rows")
        np.testing.assert_array_equal(q8.gate_sum(x), router.sum_rows(x))
    f32 = qllama.load(path, backend="numpy", activations="f32")
    assert glue(f32.backend, "soft_max") is None and glue(f32.backend, "sum_rows") is None
    np.testing.assert_array_equal(f32.gate_softmax(x), router_softmax(x, xp=np))
    np.testing.assert_array_equal(f32.gate_sum(x), row_sum(x, xp=np))


def test_a_wide_router_routes_as_the_avx512_build(ggml512: ctypes.CDLL, tmp_path: Path) -> None:
    """A qwen3moe of 32 experts (two 16-lane blocks a row) loaded with simd_width 16 gates its
    recorded router logits as ggml's AVX-512 code, and selects its experts on those values."""
    path = tmp_path / "wide.gguf"
    cfg = dataclasses.replace(FAMILIES["qwen3moe"], n_expert=32, n_expert_used=8)
    write_tiny(path, cfg)
    m = qllama.load(path, backend="numpy", activation_rounding="simd", simd_width=16)
    seen: dict[str, np.ndarray] = {}
    m.forward(IDS, observer=lambda n, v: seen.__setitem__(n, to_numpy(v)))
    for i in range(cfg.n_layer):
        x = np.ascontiguousarray(seen[f"blk.{i}.router"], np.float32)  # (T, 32)
        want = np.empty_like(x)
        for r in range(x.shape[0]):
            ggml512.soft_max_row16(x.shape[1], _ptr(x[r]), _ptr(want[r]))
        np.testing.assert_array_equal(m.gate_softmax(x).view(np.int32), want.view(np.int32))
        chosen = select_experts(want, 8, xp=np, asarray=np.asarray)
        np.testing.assert_array_equal(seen[f"blk.{i}.experts"], chosen)


@pytest.mark.parametrize("width", [0, 4, 12, 32, "16", "HOST", None])
def test_simd_width_is_a_build_width(width: object, tmp_path: Path) -> None:
    path = tmp_path / "q.gguf"
    write_tiny(path, FAMILIES["qwen3moe"])
    with pytest.raises(BackendError, match="simd_width must be one of"):
        qllama.load(path, backend="numpy", simd_width=width)


@pytest.mark.skipif(not CPU_FLAGS, reason="the CPU's flags from /proc/cpuinfo")
def test_simd_width_host_is_what_a_native_build_here_uses() -> None:
    """16 where the CPU has AVX-512F and AVX-512DQ (ggml's condition for its 16-lane
    blocks), else 8: read from /proc/cpuinfo, not from numpy as the backend does."""
    from qllama.backends.numpy.dispatch import NumpyBackend

    want = 16 if {"avx512f", "avx512dq"} <= CPU_FLAGS else 8
    assert NumpyBackend(kernels="numpy", simd_width="host").simd_width == want
