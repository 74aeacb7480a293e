// The vector vocabulary the CPU kernels are written against, one traits header per instruction
// set, chosen at compile time by the build's flags (engine/kernels/__init__.py builds one
// module per variant):
//
//   isa/avx512.h  AVX-512, with the bf16 pair dot product when built with -mavx512bf16
//   isa/avx2.h    AVX2 + FMA + F16C
//
// Every traits header defines, in namespace vs: the logical vector vf of 16 fp32 lanes (in as
// many registers as the ISA needs) and kVecRegs, how many of them the register file holds;
// loads/stores of fp32 and bf16 with a tail count; add/sub/mul/div/max, fmadd/fmsub/fnmadd;
// reduce_add/reduce_max and hsum16; round_nearest, scale_pow2, any_gt, count_gt,
// zero_unless_le, keep_first; bf16 rounding (to_bf16, round_bf16); int8 widening to fp32
// (load_i8, 16 bytes with a tail count); vpair (32 bf16 as 16 pairs) with load_pairs and
// widen_pairs (widen_even/widen_odd: one half, from memory). Optionally VS_BF16_DOT with
// dot_pairs/broadcast_pair, and VS_INT_DOT: the integer dot products the int8 panels take, as
// structs (AVX2: S8Dot, int8 quads through vpmaddubsw; AVX512-VNNI: I16Dot, int16 pairs through
// vpdpwssd, and U8Dot, int8 quads offset to unsigned through vpdpbusd), each with kBits, kGroup
// (k of a feature side by side in the panel), act_t, kMax, kZero (the stored value of x = 0),
// kSpread (act_t per k), vw/vx and load_group, broadcast, dot, store, clear; beside them the
// int32 vector vi (izero, iadd, isub, iload, to_float). Below, what is written once against
// that vocabulary (exp, exp2).
// A NEON traits file would hold vf in four float32x4_t and widen bf16 with vshll and int8
// with vmovl + vcvtq; nothing else here would change.
#pragma once

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__) && defined(__AVX512DQ__)
#include "isa/avx512.h"
#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#include "isa/avx2.h"
#else
#error "engine/kernels need AVX-512 (F/BW/VL/DQ) or AVX2+FMA+F16C: build flags missing"
#endif

namespace vs {

// exp for softmax inputs (<= 0 after the max is subtracted) and SiLU: Cody-Waite range
// reduction and a degree-6 polynomial, ~2 ulp; scale_pow2 applies the power of two
inline vf exp(vf x) {
  x = max(x, set1(-87.3f));
  const vf n = round_nearest(mul(x, set1(1.44269504089f)));
  vf r = fnmadd(n, set1(0.693145751953125f), x);
  r = fnmadd(n, set1(1.428606765330187e-06f), r);
  vf p = set1(1.0f / 720);
  p = fmadd(p, r, set1(1.0f / 120));
  p = fmadd(p, r, set1(1.0f / 24));
  p = fmadd(p, r, set1(1.0f / 6));
  p = fmadd(p, r, set1(0.5f));
  p = fmadd(p, r, set1(1.0f));
  p = fmadd(p, r, set1(1.0f));
  return scale_pow2(p, n);
}

// 2^t for softmax inputs in base-2 units (<= 8: flash attention exponentiates against a running
// max that may trail the true one by that much): range reduction to [-0.5, 0.5] and a degree-5
// polynomial, ~2e-6 relative, far below the bf16 rounding of what it feeds; two operations
// fewer per 16 scores than exp with the scale folded into the caller's FMA
inline vf exp2(vf t) {
  t = max(t, set1(-126.f));
  const vf n = round_nearest(t);
  const vf f = sub(t, n);
  vf p = set1(1.3333558146e-3f);
  p = fmadd(p, f, set1(9.6181291076e-3f));
  p = fmadd(p, f, set1(5.5504108665e-2f));
  p = fmadd(p, f, set1(2.4022650696e-1f));
  p = fmadd(p, f, set1(6.9314718056e-1f));
  p = fmadd(p, f, set1(1.0f));
  return scale_pow2(p, n);
}

}  // namespace vs
