"""The router's softmax in the CPU arithmetic (qllama.backends.numpy.softmax) against ggml's own
code, compiled here: ``ggml_v_expf`` (AVX2) and ``ggml_vec_soft_max_f32``'s AVX2 blocks and
scalar loop, copied from vendor/llama.cpp's ggml-cpu (vec.h, vec.cpp, ops.cpp), bit for bit.

Skipped where no C compiler is installed or the CPU lacks AVX2 and FMA.
"""

from __future__ import annotations

import ctypes
import shutil
import subprocess
from pathlib import Path

import numpy as np
import pytest
from test_architectures import FAMILIES, IDS

import qllama
from qllama.array_api import to_numpy
from qllama.backends.base import router_softmax, soft_max
from qllama.backends.numpy.softmax import soft_max as ggml_soft_max
from qllama.backends.numpy.softmax import v_expf
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


@pytest.fixture(scope="module")
def ggml(tmp_path_factory: pytest.TempPathFactory) -> ctypes.CDLL:
    cc = shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        pytest.skip("no C compiler to build ggml's softmax with")
    flags = Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").exists() else ""
    if " avx2" not in flags or " fma" not in flags:
        pytest.skip("ggml's AVX2 softmax needs a CPU with AVX2 and FMA")
    folder = tmp_path_factory.mktemp("ggml_softmax")
    (folder / "s.c").write_text(GGML)
    lib = folder / "libs.so"
    build = [cc, "-O2", "-mavx2", "-mfma", "-ffp-contract=off", "-shared", "-fPIC"]
    subprocess.run([*build, "-o", str(lib), str(folder / "s.c"), "-lm"], check=True)
    return ctypes.CDLL(str(lib))


def _ptr(a: np.ndarray) -> ctypes.c_void_p:
    return a.ctypes.data_as(ctypes.c_void_p)


def rows(n: int, seed: int) -> np.ndarray:
    """Router-like rows of n logits: spread ones, near-ties (a few ulp apart), equal values,
    and rows spanning more than exp's range below the max (|n| > 126 and > 192 in v_expf)."""
    rng = np.random.default_rng(seed)
    out = [rng.normal(0, s, n) for s in (0.5, 3.0, 20.0)]
    tied = np.full(n, 1.25)
    tied[::3] = np.nextafter(np.float32(1.25), np.float32(2))
    out += [tied, np.zeros(n), np.linspace(0.0, -140.0, n), np.linspace(5.0, -95.0, n)]
    return np.array(out, np.float32)  # (7, n)


def test_v_expf_is_ggmls(ggml: ctypes.CDLL) -> None:
    rng = np.random.default_rng(0)
    x = np.concatenate(
        [rng.uniform(-110, 0, 4000), rng.uniform(-200, 89, 4000), -rng.exponential(1, 4000)]
    ).astype(np.float32)
    x = np.concatenate([x, np.float32([0.0, -0.0, -87.5, -126.9, -192.1, -1e-8])])
    x = x[: len(x) // 8 * 8]
    want = np.empty_like(x)
    for a in range(0, len(x), 8):
        ggml.v_expf8(_ptr(x[a:]), _ptr(want[a:]))
    got = v_expf(x)
    np.testing.assert_array_equal(got.view(np.int32), want.view(np.int32))


@pytest.mark.parametrize("simd", [True, False], ids=["avx2", "scalar"])
@pytest.mark.parametrize("n", [4, 8, 15, 32, 60, 128])
def test_soft_max_is_ggmls(ggml: ctypes.CDLL, n: int, simd: bool) -> None:
    x = rows(n, n)
    want = np.empty_like(x)
    for r in range(x.shape[0]):
        ggml.soft_max_row(n, _ptr(x[r]), _ptr(want[r]), int(simd))
    got = ggml_soft_max(x, simd=simd)
    np.testing.assert_array_equal(got.view(np.int32), want.view(np.int32))


def test_the_cpu_arithmetic_routes_with_it(tmp_path: Path) -> None:
    """The numpy backend's CPU arithmetic computes the router's softmax as ggml's CPU (AVX2
    blocks under activation_rounding "simd", the scalar loop under "ref"); its f32 arithmetic
    keeps the array-API form."""
    path = tmp_path / "q.gguf"
    write_tiny(path, FAMILIES["qwen3moe"])
    logits: list[np.ndarray] = []
    m = qllama.load(path, backend="numpy")
    m.forward(IDS, observer=lambda n, v: logits.append(to_numpy(v)) if "router" in n else None)
    assert logits and logits[0].shape == (len(IDS), FAMILIES["qwen3moe"].n_expert)
    x = np.concatenate([logits[0], rows(logits[0].shape[1], 1)])  # and some ties
    for rounding in ("ref", "simd"):
        b = qllama.load(path, backend="numpy", activation_rounding=rounding).backend
        np.testing.assert_array_equal(soft_max(b, x), ggml_soft_max(x, simd=rounding == "simd"))
    f32 = qllama.load(path, backend="numpy", activations="f32").backend
    np.testing.assert_array_equal(soft_max(f32, x), router_softmax(x, xp=f32.xp))
