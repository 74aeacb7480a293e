// AVX-512 traits (F/BW/VL/DQ + FMA): the vector vocabulary of isa.h on one 512-bit register.
//
// With -mavx512bf16 (Cooper Lake, Sapphire Rapids, Zen 4 and later) it also offers the bf16
// pair dot product (VS_BF16_DOT); without it (Skylake-X, Ice Lake) kernels widen bf16 to fp32
// where they load it and use fp32 FMAs, exactly as on AVX2.
#pragma once

#include <immintrin.h>

#include <cstdint>
#include <cstring>

namespace vs {

constexpr const char* kIsaName = "avx512";
// logical vectors (16 fp32) that fit in the register file: kernels size register blocks by it
constexpr int kVecRegs = 32;

using vf = __m512;     // 16 fp32
using vh = __m256i;    // 16 bf16 (raw bits)
using vpair = __m512i; // 32 bf16 in memory order: 16 (even, odd) pairs

inline __mmask16 lanes(int64_t n) {
  return n >= 16 ? __mmask16(0xFFFF) : n <= 0 ? __mmask16(0) : __mmask16((1u << n) - 1);
}

inline vf zero() { return _mm512_setzero_ps(); }
inline vf set1(float x) { return _mm512_set1_ps(x); }
inline vf load(const float* p) { return _mm512_loadu_ps(p); }
inline vf load(const float* p, int64_t n) { return _mm512_maskz_loadu_ps(lanes(n), p); }
inline void store(float* p, vf v) { _mm512_storeu_ps(p, v); }
inline void store(float* p, vf v, int64_t n) { _mm512_mask_storeu_ps(p, lanes(n), v); }

inline vf add(vf a, vf b) { return _mm512_add_ps(a, b); }
inline vf sub(vf a, vf b) { return _mm512_sub_ps(a, b); }
inline vf mul(vf a, vf b) { return _mm512_mul_ps(a, b); }
inline vf div(vf a, vf b) { return _mm512_div_ps(a, b); }
inline vf max(vf a, vf b) { return _mm512_max_ps(a, b); }
inline vf fmadd(vf a, vf b, vf c) { return _mm512_fmadd_ps(a, b, c); }    // a * b + c
inline vf fmsub(vf a, vf b, vf c) { return _mm512_fmsub_ps(a, b, c); }    // a * b - c
inline vf fnmadd(vf a, vf b, vf c) { return _mm512_fnmadd_ps(a, b, c); }  // c - a * b
inline float reduce_add(vf v) { return _mm512_reduce_add_ps(v); }
inline float reduce_max(vf v) { return _mm512_reduce_max_ps(v); }
inline vf round_nearest(vf x) {
  return _mm512_roundscale_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
}
// p * 2^n for integral n (overflow gives inf, underflow 0)
inline vf scale_pow2(vf p, vf n) { return _mm512_scalef_ps(p, n); }
// any lane of v above x
inline bool any_gt(vf v, float x) { return _mm512_cmp_ps_mask(v, set1(x), _CMP_GT_OQ) != 0; }
// how many lanes of v are above x
inline int count_gt(vf v, float x) { return __builtin_popcount(_mm512_cmp_ps_mask(v, set1(x), _CMP_GT_OQ)); }
// v with the lanes not at most x (above it, or NaN) set to 0
inline vf zero_unless_le(vf v, float x) { return _mm512_maskz_mov_ps(_mm512_cmp_ps_mask(v, set1(x), _CMP_LE_OQ), v); }
// lanes [0, n) of v, ``fill`` in the others
inline vf keep_first(vf v, int64_t n, float fill) { return _mm512_mask_mov_ps(set1(fill), lanes(n), v); }

// bf16 <-> fp32. A bf16 is the top half of an fp32: widening is a shift.
inline vf widen(vh raw) { return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(raw), 16)); }
inline vf load_bf16(const void* p) { return widen(_mm256_loadu_si256(static_cast<const __m256i*>(p))); }
inline vf load_bf16(const void* p, int64_t n) { return widen(_mm256_maskz_loadu_epi16(lanes(n), p)); }
// int8 -> fp32 (weight-only int8 matrices): sign-extend 16 bytes to 32 bits, convert
inline vf load_i8(const int8_t* p) {
  return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
}
inline vf load_i8(const int8_t* p, int64_t n) {
  return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_maskz_loadu_epi8(lanes(n), p)));
}
// 16 fp32 -> 16 bf16, round to nearest even (vcvtneps2bf16); inputs are finite
inline vh to_bf16(vf x) {
#ifdef __AVX512BF16__
  return (__m256i)_mm512_cvtneps_pbh(x);
#else
  const __m512i bits = _mm512_castps_si512(x);
  const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
  const __m512i rounded = _mm512_add_epi32(bits, _mm512_add_epi32(odd, _mm512_set1_epi32(0x7FFF)));
  return _mm512_cvtepi32_epi16(_mm512_srli_epi32(rounded, 16));
#endif
}
inline void store_bf16(void* p, vf v) { _mm256_storeu_si256(static_cast<__m256i*>(p), to_bf16(v)); }
inline void store_bf16(void* p, vf v, int64_t n) { _mm256_mask_storeu_epi16(p, lanes(n), to_bf16(v)); }
// fp32 -> nearest bf16 -> fp32
inline vf round_bf16(vf x) { return widen(to_bf16(x)); }

// 32 bf16 (a multiple of 2: ``n`` of them, the rest zeros)
inline vpair load_pairs(const void* p) { return _mm512_loadu_si512(p); }
inline vpair load_pairs(const void* p, int64_t n) {
  const __mmask32 k = n >= 32 ? ~__mmask32(0) : (__mmask32(1) << n) - 1;
  return _mm512_maskz_loadu_epi16(k, p);
}
// the even and odd elements of 16 pairs as two vectors of 16 fp32
inline void widen_pairs(vpair v, vf& even, vf& odd) {
  even = _mm512_castsi512_ps(_mm512_slli_epi32(v, 16));
  odd = _mm512_castsi512_ps(_mm512_and_si512(v, _mm512_set1_epi32(static_cast<int>(0xFFFF0000u))));
}

// one half of widen_pairs straight from memory
inline vf widen_even(const void* p) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_loadu_si512(p), 16));
}
inline vf widen_odd(const void* p) {
  return _mm512_castsi512_ps(
      _mm512_and_si512(_mm512_loadu_si512(p), _mm512_set1_epi32(static_cast<int>(0xFFFF0000u))));
}

// out[i] = sum of the 16 lanes of v[i]: a transpose-and-add tree, ~3 instructions per vector
// against ~10 for a reduce of each
inline vf hsum16(const vf* v) {
  __m512 w[8], x[4], z[2];
  for (int k = 0; k < 8; ++k)  // per 128-bit lane: [a0+a2, b0+b2, a1+a3, b1+b3]
    w[k] = _mm512_add_ps(_mm512_unpacklo_ps(v[2 * k], v[2 * k + 1]),
                         _mm512_unpackhi_ps(v[2 * k], v[2 * k + 1]));
  for (int k = 0; k < 4; ++k) {  // per 128-bit lane: that lane's sums of 4 vectors
    const __m512d a = _mm512_castps_pd(w[2 * k]), b = _mm512_castps_pd(w[2 * k + 1]);
    x[k] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(a, b)),
                         _mm512_castpd_ps(_mm512_unpackhi_pd(a, b)));
  }
  for (int k = 0; k < 2; ++k)  // add 128-bit lanes pairwise
    z[k] = _mm512_add_ps(_mm512_shuffle_f32x4(x[2 * k], x[2 * k + 1], 0x88),
                         _mm512_shuffle_f32x4(x[2 * k], x[2 * k + 1], 0xDD));
  return _mm512_add_ps(_mm512_shuffle_f32x4(z[0], z[1], 0x88),
                       _mm512_shuffle_f32x4(z[0], z[1], 0xDD));
}

#ifdef __AVX512BF16__
// The bf16 pair dot product: acc[i] += a[2i] * b[2i] + a[2i+1] * b[2i+1] (vdpbf16ps). Kernels
// with VS_BF16_DOT keep bf16 pairs as they are instead of widening them.
#define VS_BF16_DOT 1
inline vf dot_pairs(vf acc, vpair a, vpair b) { return _mm512_dpbf16_ps(acc, (__m512bh)a, (__m512bh)b); }
// two adjacent bf16 values in every 32-bit lane, broadcast straight from memory (a load-port
// operation, unlike a broadcast from a general register)
inline vpair broadcast_pair(const void* p) {
  return _mm512_castps_si512(_mm512_broadcastss_ps(_mm_load_ss(static_cast<const float*>(p))));
}
// pairs kept in an fp32 vector's storage (and back)
inline vf pairs_as_vf(vpair v) { return _mm512_castsi512_ps(v); }
inline vpair vf_as_pairs(vf v) { return _mm512_castps_si512(v); }
#endif

#ifdef __AVX512VNNI__
// Integer dot products for the int8 panels (VS_INT_DOT; isa.h lists the vocabulary). Every
// AVX512-BF16 CPU has VNNI (Cooper Lake, Sapphire Rapids and later, Zen 4 and later); the
// native build is compiled with it. Two products, chosen per machine (panel_activation_bits in
// cpu_decode.cpp): int16 activations where the AMX-INT8 tiles take over from 5 rows (they split
// the same int16 values into bytes, so tiles and panels agree bit for bit), unsigned int8 ones
// elsewhere: at 8 rows vpdpwssd's 32 products per instruction and the weights' sign extension
// made the GEMV compute-bound on a Zen 4 (6.1 ms a bench decoder pass against 3.6 at 4 rows).
#define VS_INT_DOT 1
#define VS_I16_DOT 1  // the AMX-INT8 tiles split these int16 activations into bytes
using vi = __m512i;   // 16 int32 lanes
inline vi izero() { return _mm512_setzero_si512(); }
inline vi iadd(vi a, vi b) { return _mm512_add_epi32(a, b); }
inline vi isub(vi a, vi b) { return _mm512_sub_epi32(a, b); }
inline vi iload(const int32_t* p) { return _mm512_loadu_si512(p); }
inline vf to_float(vi v) { return _mm512_cvtepi32_ps(v); }
// the 4 bytes at p in every 32-bit lane, broadcast straight from memory
inline __m512i broadcast_u32(const void* p) {
  int32_t word;
  std::memcpy(&word, p, sizeof(word));
  return _mm512_set1_epi32(word);
}

// int16 pairs (vpdpwssd): acc[i] += a[2i] * b[2i] + a[2i+1] * b[2i+1] in int32; per 32 weights
// of a row a sign extension and one instruction
struct I16Dot {
  static constexpr int kBits = 16;
  static constexpr int64_t kGroup = 2;  // k of a feature side by side in the panel
  using act_t = int16_t;
  static constexpr float kMax = 32767.f;
  static constexpr int kZero = 0;        // the stored value of x = 0
  static constexpr int64_t kSpread = 1;  // activation elements per k
  using vw = __m512i;                    // 16 features x 2 k, sign-extended to int16
  using vx = __m512i;                    // one activation pair in every 32-bit lane
  // 32 int8 (16 pairs of adjacent k) sign-extended to int16
  static vw load_group(const int8_t* p) {
    return _mm512_cvtepi8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  }
  static vx broadcast(const int16_t* p) { return broadcast_u32(p); }  // two adjacent k
  static vi dot(vi acc, vw w, vx x) { return _mm512_dpwssd_epi32(acc, w, x); }
  // round(x) saturated to int16, lanes [0, n) stored
  static void store(int16_t* p, vf x, int64_t n) {
    _mm256_mask_storeu_epi16(p, lanes(n), _mm512_cvtsepi32_epi16(_mm512_cvtps_epi32(x)));
  }
  static void clear(int16_t* row, int64_t k) { row[k] = 0; }
};

// unsigned int8 quads (vpdpbusd): acc[i] += sum of 4 products of unsigned by signed bytes, in
// int32 with no intermediate saturation, so activations go in offset by 128 (x in [-127, 127]
// stored as x + 128) against the signed weights as they are, and the offset's share, 128 times
// each feature's weight sum over the stretch, is taken off once per 256 k (Panels::offsets).
// 64 products a row per instruction, no widening: the same instruction count per weight as
// AVX2's int8 path has per 32.
struct U8Dot {
  static constexpr int kBits = 8;
  static constexpr int64_t kGroup = 4;
  using act_t = uint8_t;
  static constexpr float kMax = 127.f;
  static constexpr int kZero = 128;
  static constexpr int64_t kSpread = 1;
  using vw = __m512i;  // 16 features x 4 k of int8, feature by feature
  using vx = __m512i;  // one activation quad in every 32-bit lane
  static vw load_group(const int8_t* p) { return _mm512_loadu_si512(p); }
  static vx broadcast(const uint8_t* p) { return broadcast_u32(p); }  // four adjacent k
  // in place, as inline assembly: through the intrinsic (which returns a new value) GCC 12
  // kept the 8-row block's 16 accumulators in a second register set and copied every one at
  // every k group (32 register moves and two stack stores per 16 dot products); in place the
  // int8 GEMV ran 2-3 % faster at 8 rows (Zen 4, python -m benchmarks.gemv, in turns)
  static vi dot(vi acc, vw w, vx x) {
    asm("vpdpbusd %2, %1, %0" : "+v"(acc) : "v"(x), "v"(w));  // acc += x (unsigned) . w
    return acc;
  }
  // round(x) clamped to [-127, 127] plus 128, lanes [0, n) stored
  static void store(uint8_t* p, vf x, int64_t n) {
    __m512i q = _mm512_cvtps_epi32(x);
    q = _mm512_min_epi32(_mm512_max_epi32(q, _mm512_set1_epi32(-127)), _mm512_set1_epi32(127));
    q = _mm512_add_epi32(q, _mm512_set1_epi32(kZero));
    _mm_mask_storeu_epi8(p, lanes(n), _mm512_cvtepi32_epi8(q));
  }
  static void clear(uint8_t* row, int64_t k) { row[k] = kZero; }
};

// int16 activations against U8Dot's panels (groups of 4 k): each 64 bytes of a half give two
// sets of 16 features x 2 k -- the even and the odd 16-bit words (vpmovdw), sign-extended --
// and one vpdpwssd each, so the sums land feature by feature as I16Dot's. Few-row steps take
// it: there the step streams weights, and int8 activations' products bought nothing but a
// slower 1-row step (see panel_input in cpu_decode.cpp).
struct I16QuadDot : I16Dot {  // I16Dot's activations (bits, rounding, store, clear)
  static constexpr int64_t kGroup = 4;
  struct vw {  // 16 features x (k0, k1) and x (k2, k3), sign-extended to int16
    __m512i lo, hi;
  };
  struct vx {  // the activation pairs (k0, k1) and (k2, k3) in every 32-bit lane
    __m512i lo, hi;
  };
  static vw load_group(const int8_t* p) {
    const __m512i v = _mm512_loadu_si512(p);
    return {_mm512_cvtepi8_epi16(_mm512_cvtepi32_epi16(v)),
            _mm512_cvtepi8_epi16(_mm512_cvtepi32_epi16(_mm512_srli_epi32(v, 16)))};
  }
  static vx broadcast(const int16_t* p) { return {broadcast_u32(p), broadcast_u32(p + 2)}; }
  static vi dot(vi acc, vw w, vx x) {
    return _mm512_dpwssd_epi32(_mm512_dpwssd_epi32(acc, w.lo, x.lo), w.hi, x.hi);
  }
};
#endif

}  // namespace vs
