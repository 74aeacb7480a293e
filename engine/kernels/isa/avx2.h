// AVX2 + FMA + F16C traits (Haswell and later, Zen 1-3, the Atom-class N100/N305): the vector
// vocabulary of isa.h with each logical 16-lane vector held in two 256-bit registers.
//
// Why two registers rather than 8-lane vectors: the kernels' packed layouts (flash attention's
// keys in 16-key groups, the GEMV's 32-feature panels) and their hsum16 trees stay the same on
// every ISA, so a kernel is written once and a layout bug shows on every machine. Register
// blocks are sized by kVecRegs (8 logical vectors here against 32 with AVX-512). What AVX-512
// does with mask registers (tails) is done with vmaskmov and blends; scalef with two exponent
// multiplies; the 16-lane transpose in hsum16 with hadd trees. There is no bf16 arithmetic:
// bf16 is widened to fp32 in registers (a shift, or a mask for the odd elements of pairs).
#pragma once

#include <immintrin.h>

#include <cstdint>
#include <cstring>

namespace vs {

constexpr const char* kIsaName = "avx2";
constexpr int kVecRegs = 8;

struct vf {
  __m256 lo, hi;
};
using vh = __m256i;  // 16 bf16 (raw bits)
struct vpair {       // 32 bf16 in memory order: 16 (even, odd) pairs
  __m256i lo, hi;
};

// all-ones in 32-bit lanes [0, n) of 8
inline __m256i lanes8(int64_t n) {
  const int c = n <= 0 ? 0 : n >= 8 ? 8 : static_cast<int>(n);
  return _mm256_cmpgt_epi32(_mm256_set1_epi32(c), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
}

inline vf zero() { return {_mm256_setzero_ps(), _mm256_setzero_ps()}; }
inline vf set1(float x) { return {_mm256_set1_ps(x), _mm256_set1_ps(x)}; }
inline vf load(const float* p) { return {_mm256_loadu_ps(p), _mm256_loadu_ps(p + 8)}; }
inline vf load(const float* p, int64_t n) {
  if (n >= 16) return load(p);
  return {_mm256_maskload_ps(p, lanes8(n)), _mm256_maskload_ps(p + 8, lanes8(n - 8))};
}
inline void store(float* p, vf v) {
  _mm256_storeu_ps(p, v.lo);
  _mm256_storeu_ps(p + 8, v.hi);
}
inline void store(float* p, vf v, int64_t n) {
  if (n >= 16) return store(p, v);
  _mm256_maskstore_ps(p, lanes8(n), v.lo);
  _mm256_maskstore_ps(p + 8, lanes8(n - 8), v.hi);
}

inline vf add(vf a, vf b) { return {_mm256_add_ps(a.lo, b.lo), _mm256_add_ps(a.hi, b.hi)}; }
inline vf sub(vf a, vf b) { return {_mm256_sub_ps(a.lo, b.lo), _mm256_sub_ps(a.hi, b.hi)}; }
inline vf mul(vf a, vf b) { return {_mm256_mul_ps(a.lo, b.lo), _mm256_mul_ps(a.hi, b.hi)}; }
inline vf div(vf a, vf b) { return {_mm256_div_ps(a.lo, b.lo), _mm256_div_ps(a.hi, b.hi)}; }
inline vf max(vf a, vf b) { return {_mm256_max_ps(a.lo, b.lo), _mm256_max_ps(a.hi, b.hi)}; }
inline vf fmadd(vf a, vf b, vf c) {
  return {_mm256_fmadd_ps(a.lo, b.lo, c.lo), _mm256_fmadd_ps(a.hi, b.hi, c.hi)};
}
inline vf fmsub(vf a, vf b, vf c) {
  return {_mm256_fmsub_ps(a.lo, b.lo, c.lo), _mm256_fmsub_ps(a.hi, b.hi, c.hi)};
}
inline vf fnmadd(vf a, vf b, vf c) {
  return {_mm256_fnmadd_ps(a.lo, b.lo, c.lo), _mm256_fnmadd_ps(a.hi, b.hi, c.hi)};
}
inline float reduce_add(vf v) {
  const __m256 s = _mm256_add_ps(v.lo, v.hi);
  __m128 x = _mm_add_ps(_mm256_castps256_ps128(s), _mm256_extractf128_ps(s, 1));
  x = _mm_add_ps(x, _mm_movehl_ps(x, x));
  x = _mm_add_ss(x, _mm_movehdup_ps(x));
  return _mm_cvtss_f32(x);
}
inline float reduce_max(vf v) {
  const __m256 s = _mm256_max_ps(v.lo, v.hi);
  __m128 x = _mm_max_ps(_mm256_castps256_ps128(s), _mm256_extractf128_ps(s, 1));
  x = _mm_max_ps(x, _mm_movehl_ps(x, x));
  x = _mm_max_ss(x, _mm_movehdup_ps(x));
  return _mm_cvtss_f32(x);
}
inline vf round_nearest(vf x) {
  constexpr int kMode = _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC;
  return {_mm256_round_ps(x.lo, kMode), _mm256_round_ps(x.hi, kMode)};
}
// p * 2^n for integral n, as vscalefps does it: n is split in two halves, each a normal
// power of two, so the whole range [-252, 254] scales without building a denormal or an
// out-of-range exponent (beyond it the result is 0 or inf anyway)
inline __m256 scale_pow2_8(__m256 p, __m256 n) {
  n = _mm256_min_ps(_mm256_max_ps(n, _mm256_set1_ps(-252.f)), _mm256_set1_ps(254.f));
  const __m256i i = _mm256_cvtps_epi32(n), a = _mm256_srai_epi32(i, 1), b = _mm256_sub_epi32(i, a);
  const __m256i bias = _mm256_set1_epi32(127);
  const __m256 pa = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(a, bias), 23));
  const __m256 pb = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(b, bias), 23));
  return _mm256_mul_ps(_mm256_mul_ps(p, pa), pb);
}
inline vf scale_pow2(vf p, vf n) { return {scale_pow2_8(p.lo, n.lo), scale_pow2_8(p.hi, n.hi)}; }
inline bool any_gt(vf v, float x) {
  const __m256 t = _mm256_set1_ps(x);
  return _mm256_movemask_ps(_mm256_or_ps(_mm256_cmp_ps(v.lo, t, _CMP_GT_OQ),
                                         _mm256_cmp_ps(v.hi, t, _CMP_GT_OQ))) != 0;
}
inline int count_gt(vf v, float x) {
  const __m256 t = _mm256_set1_ps(x);
  return __builtin_popcount(_mm256_movemask_ps(_mm256_cmp_ps(v.lo, t, _CMP_GT_OQ))) +
         __builtin_popcount(_mm256_movemask_ps(_mm256_cmp_ps(v.hi, t, _CMP_GT_OQ)));
}
inline vf zero_unless_le(vf v, float x) {
  const __m256 t = _mm256_set1_ps(x);
  return {_mm256_and_ps(v.lo, _mm256_cmp_ps(v.lo, t, _CMP_LE_OQ)),
          _mm256_and_ps(v.hi, _mm256_cmp_ps(v.hi, t, _CMP_LE_OQ))};
}
inline vf keep_first(vf v, int64_t n, float fill) {
  const __m256 f = _mm256_set1_ps(fill);
  return {_mm256_blendv_ps(f, v.lo, _mm256_castsi256_ps(lanes8(n))),
          _mm256_blendv_ps(f, v.hi, _mm256_castsi256_ps(lanes8(n - 8)))};
}

// bf16 <-> fp32: a bf16 is the top half of an fp32, widening is a zero-extend and a shift
inline vf widen(vh raw) {
  const __m256i lo = _mm256_cvtepu16_epi32(_mm256_castsi256_si128(raw));
  const __m256i hi = _mm256_cvtepu16_epi32(_mm256_extracti128_si256(raw, 1));
  return {_mm256_castsi256_ps(_mm256_slli_epi32(lo, 16)),
          _mm256_castsi256_ps(_mm256_slli_epi32(hi, 16))};
}
inline vf load_bf16(const void* p) { return widen(_mm256_loadu_si256(static_cast<const __m256i*>(p))); }
inline vf load_bf16(const void* p, int64_t n) {
  if (n >= 16) return load_bf16(p);
  alignas(32) uint16_t buf[16] = {};
  if (n > 0) std::memcpy(buf, p, n * sizeof(uint16_t));
  return load_bf16(buf);
}
// int8 -> fp32 (weight-only int8 matrices): sign-extend to 32 bits, convert. The 8-byte loads
// fold into vpmovsxbd's memory operand, so 16 weights cost 4 uops, none of them an FMA
inline vf load_i8(const int8_t* p) {
  const __m256i lo = _mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
  const __m256i hi = _mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p + 8)));
  return {_mm256_cvtepi32_ps(lo), _mm256_cvtepi32_ps(hi)};
}
inline vf load_i8(const int8_t* p, int64_t n) {
  if (n >= 16) return load_i8(p);
  alignas(16) int8_t buf[16] = {};
  if (n > 0) std::memcpy(buf, p, n);
  return load_i8(buf);
}
// round to nearest even, in place in the fp32 bits (inputs are finite)
inline __m256i round_bits(__m256 x) {
  const __m256i bits = _mm256_castps_si256(x);
  const __m256i odd = _mm256_and_si256(_mm256_srli_epi32(bits, 16), _mm256_set1_epi32(1));
  return _mm256_add_epi32(bits, _mm256_add_epi32(odd, _mm256_set1_epi32(0x7FFF)));
}
inline vh to_bf16(vf x) {
  const __m256i lo = _mm256_srli_epi32(round_bits(x.lo), 16);
  const __m256i hi = _mm256_srli_epi32(round_bits(x.hi), 16);
  // packus interleaves 128-bit halves: [lo0-3, hi0-3, lo4-7, hi4-7] -> [lo, hi]
  return _mm256_permute4x64_epi64(_mm256_packus_epi32(lo, hi), 0xD8);
}
inline void store_bf16(void* p, vf v) { _mm256_storeu_si256(static_cast<__m256i*>(p), to_bf16(v)); }
inline void store_bf16(void* p, vf v, int64_t n) {
  if (n >= 16) return store_bf16(p, v);
  alignas(32) uint16_t buf[16];
  _mm256_store_si256(reinterpret_cast<__m256i*>(buf), to_bf16(v));
  if (n > 0) std::memcpy(p, buf, n * sizeof(uint16_t));
}
inline vf round_bf16(vf x) {
  const __m256i top = _mm256_set1_epi32(static_cast<int>(0xFFFF0000u));
  return {_mm256_castsi256_ps(_mm256_and_si256(round_bits(x.lo), top)),
          _mm256_castsi256_ps(_mm256_and_si256(round_bits(x.hi), top))};
}

inline vpair load_pairs(const void* p) {
  const __m256i* q = static_cast<const __m256i*>(p);
  return {_mm256_loadu_si256(q), _mm256_loadu_si256(q + 1)};
}
// n bf16 (even), the rest zeros: whole pairs are 32-bit words, so vpmaskmovd does it
inline vpair load_pairs(const void* p, int64_t n) {
  if (n >= 32) return load_pairs(p);
  const int* w = static_cast<const int*>(p);
  return {_mm256_maskload_epi32(w, lanes8(n / 2)), _mm256_maskload_epi32(w + 8, lanes8(n / 2 - 8))};
}
inline void widen_pairs(vpair v, vf& even, vf& odd) {
  const __m256i top = _mm256_set1_epi32(static_cast<int>(0xFFFF0000u));
  even = {_mm256_castsi256_ps(_mm256_slli_epi32(v.lo, 16)),
          _mm256_castsi256_ps(_mm256_slli_epi32(v.hi, 16))};
  odd = {_mm256_castsi256_ps(_mm256_and_si256(v.lo, top)),
         _mm256_castsi256_ps(_mm256_and_si256(v.hi, top))};
}

// one half of widen_pairs straight from memory (the load folds into the shift or the and), so a
// kernel can keep one widened set live instead of two
inline vf widen_even(const void* p) {
  const __m256i* q = static_cast<const __m256i*>(p);
  return {_mm256_castsi256_ps(_mm256_slli_epi32(_mm256_loadu_si256(q), 16)),
          _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_loadu_si256(q + 1), 16))};
}
// The odd half clears the low 16 bits with two shifts, not an and: the mask constant would hold
// a register for the whole loop, and in the GEMV's 6-row panel block (12 accumulators, 2 widened
// vectors, a broadcast) that sixteenth register spilled an accumulator to the stack every k
// pair: the block ran at 60 GFLOP/s a core against 84-87 with the shifts (L1-resident,
// a Zen 3 EPYC), and the shifts issue on ports the FMAs leave free.
inline vf widen_odd(const void* p) {
  const __m256i* q = static_cast<const __m256i*>(p);
  const auto clear_low = [](__m256i w) { return _mm256_slli_epi32(_mm256_srli_epi32(w, 16), 16); };
  return {_mm256_castsi256_ps(clear_low(_mm256_loadu_si256(q))),
          _mm256_castsi256_ps(clear_low(_mm256_loadu_si256(q + 1)))};
}

// out[i] = sum of the 8 lanes of v[i], i < 8: two hadd levels, then the 128-bit halves
inline __m256 hsum8(const __m256* v) {
  const __m256 s01 = _mm256_hadd_ps(v[0], v[1]), s23 = _mm256_hadd_ps(v[2], v[3]);
  const __m256 s45 = _mm256_hadd_ps(v[4], v[5]), s67 = _mm256_hadd_ps(v[6], v[7]);
  const __m256 a = _mm256_hadd_ps(s01, s23), b = _mm256_hadd_ps(s45, s67);
  return _mm256_add_ps(_mm256_permute2f128_ps(a, b, 0x20), _mm256_permute2f128_ps(a, b, 0x31));
}
inline vf hsum16(const vf* v) {
  __m256 t[16];
  for (int i = 0; i < 16; ++i) t[i] = _mm256_add_ps(v[i].lo, v[i].hi);
  return {hsum8(t), hsum8(t + 8)};
}

// The int8 quad dot product: int8 panels take int8 activations (a scale per row and 256 k, see
// panel_input in cpu_decode.cpp), four adjacent k of a feature side by side in the panel. AVX2
// has no int8 multiply-accumulate into int32 (AVX-VNNI's vpdpbusd is Alder Lake and later); its
// vpmaddubsw multiplies unsigned by signed bytes into saturating int16 pairs, so the activation
// goes in as |x| and its sign moves onto the weight (vpsignb): with both in [-127, 127] a pair
// sums to at most 2 * 127 * 127 < 32767 and nothing saturates (the weight quantiser clamps to
// -127: a -128 weight would not negate). vpmaddwd against ones then sums the pairs into int32.
// Four ALU uops per 32 products a row, spread over all four vector ports, where widening to
// fp32 takes four FMAs on the two FMA ports: 8 rows of a 256 x 768 matrix (one core, weights in
// L2, Zen 3) 22 us against 34. Tried and not kept: 7-bit activations offset by 64 (unsigned,
// against the signed weights as they are: no vpsignb, the offset's share taken off per
// feature) -- 16 us there, 1.15-1.19x streamed from memory, but a bench decode step at 8 rows
// only 1.58-1.59x bf16's against 1.51-1.56x, for a mean logit error of 5.0 % against 3.6 %.
#define VS_INT_DOT 1
struct vi {  // 16 int32 lanes
  __m256i lo, hi;
};
inline vi izero() { return {_mm256_setzero_si256(), _mm256_setzero_si256()}; }
inline vi iadd(vi a, vi b) { return {_mm256_add_epi32(a.lo, b.lo), _mm256_add_epi32(a.hi, b.hi)}; }
inline vi isub(vi a, vi b) { return {_mm256_sub_epi32(a.lo, b.lo), _mm256_sub_epi32(a.hi, b.hi)}; }
inline vi iload(const int32_t* p) {
  const __m256i* q = reinterpret_cast<const __m256i*>(p);
  return {_mm256_loadu_si256(q), _mm256_loadu_si256(q + 1)};
}
inline vf to_float(vi v) { return {_mm256_cvtepi32_ps(v.lo), _mm256_cvtepi32_ps(v.hi)}; }

struct S8Dot {
  static constexpr int kBits = 8;
  static constexpr int64_t kGroup = 4;  // k per int8 group of a feature in the panel
  using act_t = int8_t;
  static constexpr float kMax = 127.f;
  static constexpr int kZero = 0;  // the stored value of x = 0
  struct vw {  // 16 features x 4 k of int8, feature by feature
    __m256i lo, hi;
  };
  struct vx {  // one activation quad in every 32-bit lane: as signed, and its magnitude
    __m256i s, a;
  };
  // activations are laid out group by group as the 4 signed values, then their 4 magnitudes:
  // taking |x| in registers instead, per row and quad, cost ~4 % of the block's time at 8 rows
  static constexpr int64_t kSpread = 2;  // activation elements per k
  static vw load_group(const int8_t* p) {
    const __m256i* q = reinterpret_cast<const __m256i*>(p);
    return {_mm256_loadu_si256(q), _mm256_loadu_si256(q + 1)};
  }
  static vx broadcast(const int8_t* p) {
    int32_t quad, magnitude;
    std::memcpy(&quad, p, sizeof(quad));
    std::memcpy(&magnitude, p + 4, sizeof(magnitude));
    return {_mm256_set1_epi32(quad), _mm256_set1_epi32(magnitude)};
  }
  static __m256i dot_quads(__m256i acc, __m256i w, vx x) {
    const __m256i pairs = _mm256_maddubs_epi16(x.a, _mm256_sign_epi8(w, x.s));
    const __m256i quads = _mm256_madd_epi16(pairs, _mm256_set1_epi16(1));
    // the sum in place, as inline assembly: through _mm256_add_epi32 GCC 12 copied a 4-row
    // block's accumulators to a second register set and three of them to the stack at every
    // k group; in place the int8 GEMV ran 2-3 % faster at 4 and 8 rows (AVX2 build on a Zen 4,
    // python -m benchmarks.gemv, in turns)
    asm("vpaddd %1, %0, %0" : "+x"(acc) : "x"(quads));
    return acc;
  }
  static vi dot(vi acc, vw w, vx x) { return {dot_quads(acc.lo, w.lo, x), dot_quads(acc.hi, w.hi, x)}; }
  // activation k of a row in the layout above set to zero (its value and its magnitude)
  static void clear(int8_t* row, int64_t k) {
    row[k / 4 * 8 + k % 4] = 0;
    row[k / 4 * 8 + 4 + k % 4] = 0;
  }
  // round(x) clamped to [-127, 127] (inputs within it but for rounding) for 16 k from a group
  // boundary, written in the activation layout above (32 bytes at p); lanes past n must be
  // zero (they are stored, as zeros, up to the end of their group)
  static void store(int8_t* p, vf x, int64_t n) {
    const __m256i lo = _mm256_cvtps_epi32(x.lo), hi = _mm256_cvtps_epi32(x.hi);
    // packs interleave 128-bit halves: [lo0-3, hi0-3, lo4-7, hi4-7] -> words, then bytes
    const __m256i w = _mm256_permute4x64_epi64(_mm256_packs_epi32(lo, hi), 0xD8);
    __m128i b = _mm_packs_epi16(_mm256_castsi256_si128(w), _mm256_extracti128_si256(w, 1));
    b = _mm_max_epi8(b, _mm_set1_epi8(-127));
    const __m128i a = _mm_abs_epi8(b);
    const __m256i out = _mm256_set_m128i(_mm_unpackhi_epi32(b, a), _mm_unpacklo_epi32(b, a));
    if (n >= 16) return _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), out);
    alignas(32) int8_t buf[32];
    _mm256_store_si256(reinterpret_cast<__m256i*>(buf), out);
    if (n > 0) std::memcpy(p, buf, (n + 3) / 4 * 8);
  }
};

}  // namespace vs
