// AVX-512 helpers shared by the CPU kernels (cpu_decode.cpp, cpu_attention.cpp).
//
// With AVX512-BF16 (Cooper Lake, Sapphire Rapids, Zen 4 and later) the kernels multiply bf16
// pairs in one instruction (dot_bf16_pairs). On plain AVX-512 CPUs (Skylake-X, Ice Lake) the
// build omits -mavx512bf16 and the kernels widen each operand to fp32 once, where it is loaded
// (widen_pairs: a bf16 is the top half of an fp32, so a shift or a mask), then use fp32 FMAs.
#pragma once

#include <immintrin.h>

namespace vs_simd {

// the even and odd bf16 elements of 32 pairs as two vectors of 16 fp32
inline void widen_pairs(__m512i v, __m512& even, __m512& odd) {
  even = _mm512_castsi512_ps(_mm512_slli_epi32(v, 16));
  odd = _mm512_castsi512_ps(_mm512_and_si512(v, _mm512_set1_epi32(static_cast<int>(0xFFFF0000u))));
}

#ifdef __AVX512BF16__
// acc[i] += a[2i] * b[2i] + a[2i+1] * b[2i+1] over 32 bf16 pairs. Native builds only: the
// emulated paths widen each operand once, where it is loaded, instead of per product.
inline __m512 dot_bf16_pairs(__m512 acc, __m512i a, __m512i b) {
  return _mm512_dpbf16_ps(acc, (__m512bh)a, (__m512bh)b);
}
#endif

// 16 fp32 -> 16 bf16, round to nearest even (vcvtneps2bf16); inputs are finite
inline __m256i to_bf16(__m512 x) {
#ifdef __AVX512BF16__
  return (__m256i)_mm512_cvtneps_pbh(x);
#else
  const __m512i bits = _mm512_castps_si512(x);
  const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
  const __m512i rounded = _mm512_add_epi32(bits, _mm512_add_epi32(odd, _mm512_set1_epi32(0x7FFF)));
  return _mm512_cvtepi32_epi16(_mm512_srli_epi32(rounded, 16));
#endif
}

// exp for softmax inputs (<= 0 after the max is subtracted): Cody-Waite range reduction and a
// degree-6 polynomial, ~2 ulp; scalef applies the power of two
inline __m512 exp16(__m512 x) {
  x = _mm512_max_ps(x, _mm512_set1_ps(-87.3f));
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504089f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693145751953125f), x);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(1.428606765330187e-06f), r);
  __m512 p = _mm512_set1_ps(1.0f / 720);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 120));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 24));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 6));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(0.5f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
  return _mm512_scalef_ps(p, n);
}

// 2^t for softmax inputs in base-2 units (<= 8: flash attention exponentiates against a running
// max that may trail the true one by that much): range reduction to [-0.5, 0.5] and a degree-5
// polynomial, ~2e-6 relative, far below the bf16 rounding of what it feeds; two operations
// fewer per 16 scores than exp16 with the scale folded into the caller's FMA
inline __m512 exp2_16(__m512 t) {
  t = _mm512_max_ps(t, _mm512_set1_ps(-126.f));
  const __m512 n = _mm512_roundscale_ps(t, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m512 f = _mm512_sub_ps(t, n);
  __m512 p = _mm512_set1_ps(1.3333558146e-3f);
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(9.6181291076e-3f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(5.5504108665e-2f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(2.4022650696e-1f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(6.9314718056e-1f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.0f));
  return _mm512_scalef_ps(p, n);
}

}  // namespace vs_simd
