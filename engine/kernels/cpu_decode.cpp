// Fused decode step of a Qwen2-style decoder for x86 CPUs, written against the vector
// vocabulary of isa.h: AVX-512 with the bf16 dot product ("native"), AVX-512 without it or
// AVX2 ("emulated": bf16 widened to fp32 in registers).
//
// Why: a decode step with a handful of rows is memory-bound, and in eager PyTorch a third of
// its time went to ~1,100 small ops (norms, rotary, cache gathers) and Python between the
// weight reads. Here the whole step -- every layer, the final norm and the lm_head -- is one
// call: weights stream through a bf16 dot-product kernel, the small ops run in
// between on data that is still in cache, and the only synchronisation is one parallel region
// per matmul or attention phase.
//
// Weight-only int8 (--quantization int8 with bf16 activations): the decoder matrices and the
// lm_head come as int8 with per-output-channel fp32 scales and run the panel GEMV below,
// widened to fp32 in registers; a step then streams half the bytes.
//
// Numerics follow the eager path (bf16 activations rounded where it rounds them, fp32
// accumulation, int8 scales applied to the fp32 sums), so both paths agree to bf16 rounding,
// not bit for bit.

#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <ATen/core/dispatch/Dispatcher.h>

#include "isa.h"
#include "chunk_attention.h"
#ifdef VS_BF16_DOT
#include "amx_gemv.h"
#ifndef VS_I16_DOT  // int8 tiles take the int16 activations of the panels' VNNI path
#error "the native-bf16 build is compiled with AVX512-VNNI (isa/avx512.h)"
#endif
#endif

#include <sys/mman.h>

#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <algorithm>
#include <cstring>
#include <memory>
#include <unordered_map>
#include <vector>

namespace {

using bf16 = at::BFloat16;

inline float f32(bf16 v) { return static_cast<float>(v); }

using vs::vf;

// The step's elementwise work (epilogues, SiLU, residual adds) 16 lanes at a time: scalar, with
// a bf16 conversion per operand, it was ~15 % of a batch-16 step. The roundings are the eager
// path's, vector for vector; vs::exp stands in for std::exp (~2 ulp). Tails go by count
// (``left`` lanes of 16).
using vs::round_bf16;  // fp32 -> nearest bf16 -> fp32: what f32(bf16(x)) does

// bf16(silu(g) * u) for gate and up already rounded to bf16, each op's result rounded as eager
// bf16 does
inline vf silu_mul_rounded(vf g, vf u) {
  const vf e = vs::exp(vs::sub(vs::zero(), g));
  return vs::mul(round_bf16(vs::div(g, vs::add(vs::set1(1.f), e))), u);
}

// dst[i] = bf16(silu(bf16(gate[i])) * bf16(up[i])), each op's result rounded as eager bf16 does
inline void silu_mul_row(const float* gate, const float* up, bf16* dst, int64_t n) {
  for (int64_t i = 0; i < n; i += 16) {
    const int64_t k = n - i;
    const vf y = silu_mul_rounded(round_bf16(vs::load(gate + i, k)), round_bf16(vs::load(up + i, k)));
    vs::store_bf16(dst + i, y, k);
  }
}

// the same from bf16 gate and up (oneDNN's GEMM output): a scalar loop with std::exp here was
// 7 % of a 48-row prompt step on a 2-core AVX512-BF16 Xeon
inline void silu_mul_row_bf16(const bf16* gate, const bf16* up, bf16* dst, int64_t n) {
  for (int64_t i = 0; i < n; i += 16) {
    const int64_t k = n - i;
    vs::store_bf16(dst + i, silu_mul_rounded(vs::load_bf16(gate + i, k), vs::load_bf16(up + i, k)), k);
  }
}

// out[i] = sum of the 16 lanes of v[i] (attention scores for 16 keys at once): the traits'
// transpose-and-add tree, ~3 instructions per vector against ~10 for a reduce of each
using vs::hsum16;

// The activations of a GEMV as the dot-product kernel reads them. With the dot product, the bf16
// rows as they are. Emulated, each row is widened once per matrix to fp32, 16 even then 16 odd
// elements per 32: a weight vector then costs two FMAs per row, not two FMAs plus four integer
// ops to widen the same activations again for every weight row.
struct Activations {
  Activations(int rows, const bf16* x_in, int64_t K_in, int64_t prefetch_bytes = 0)
      : M(rows), K(K_in), x(x_in), prefetch(prefetch_bytes) {
#ifndef VS_BF16_DOT
    wide.resize(static_cast<size_t>(M) * K);
    const int64_t k_vec = K / 32 * 32;
    for (int m = 0; m < M; ++m)
      for (int64_t k = 0; k < k_vec; k += 32) {
        vf even, odd;
        vs::widen_pairs(vs::load_pairs(x + m * K + k), even, odd);
        vs::store(wide.data() + m * K + k, even);
        vs::store(wide.data() + m * K + k + 16, odd);
      }
#endif
  }
  int M;
  int64_t K;
  const bf16* x;
  // bytes ahead the native build's GEMV asks for each weight row (0: the hardware prefetcher
  // alone): the decoder's, from the platform plan (engine/platform.py says where it pays)
  int64_t prefetch;
#ifndef VS_BF16_DOT
  std::vector<float> wide;
#endif
};

// acc[m][n - n0] = dot(x[m, :], w[n, :]) for n in [n0, n1): every weight row is read once and
// used for all M rows. One dot-product chain is latency-bound, so U slices of K are accumulated
// independently (with M >= 4 the rows themselves are enough chains). Software prefetch always in
// the emulated build (below); in the native one where the plan asks for it (xs.prefetch):
// on an Intel Xeon it kept memory busy, on an EPYC the hardware stream prefetcher did better.
template <int M, int U>
void dot_rows(const Activations& xs, const bf16* w, int64_t n0, int64_t n1, float* acc,
              int64_t ld_acc) {
#ifdef VS_BF16_DOT
  const int64_t ahead = xs.prefetch;
#endif
  constexpr int64_t step = 32 * U;
  const int64_t K = xs.K;
  const bf16* x = xs.x;
  const int64_t k_vec = K / step * step;
  for (int64_t n = n0; n < n1; ++n) {
    const bf16* wr = w + n * K;
    vf a[M][U];
    for (int m = 0; m < M; ++m)
      for (int u = 0; u < U; ++u) a[m][u] = vs::zero();
    for (int64_t k = 0; k < k_vec; k += step) {
      for (int u = 0; u < U; ++u) {
#ifndef VS_BF16_DOT
        // the emulated build runs on Intel cores before Cooper Lake; there asking for the
        // weights 4 KiB ahead beat the hardware prefetcher (batch-1 decode 102 -> 125 tok/s on
        // an Ice Lake; 2 KiB: 115, 8 KiB: 93). On the EPYC (native build) it had lost.
        __builtin_prefetch(reinterpret_cast<const char*>(wr + k + 32 * u) + 4096);
#else
        if (ahead) __builtin_prefetch(reinterpret_cast<const char*>(wr + k + 32 * u) + ahead);
#endif
        const vs::vpair wv = vs::load_pairs(wr + k + 32 * u);
#ifdef VS_BF16_DOT
        for (int m = 0; m < M; ++m) {
          const vs::vpair xv = vs::load_pairs(x + m * K + k + 32 * u);
          a[m][u] = vs::dot_pairs(a[m][u], wv, xv);
        }
#else
        vf w_even, w_odd;
        vs::widen_pairs(wv, w_even, w_odd);
        for (int m = 0; m < M; ++m) {
          const float* xw = xs.wide.data() + m * K + k + 32 * u;
          a[m][u] = vs::fmadd(w_even, vs::load(xw), a[m][u]);
          a[m][u] = vs::fmadd(w_odd, vs::load(xw + 16), a[m][u]);
        }
#endif
      }
    }
    for (int m = 0; m < M; ++m) {
      vf s = a[m][0];
      for (int u = 1; u < U; ++u) s = vs::add(s, a[m][u]);
      float total = vs::reduce_add(s);
      for (int64_t k = k_vec; k < K; ++k) total += f32(wr[k]) * f32(x[m * K + k]);
      acc[m * ld_acc + (n - n0)] = total;
    }
  }
}

#ifndef VS_BF16_DOT
// Emulated, 4+ rows: register blocks of 4 weight rows x MR activation rows. Row by row (above),
// every FMA loaded its activation vector and 16 rows of widened activations overflow L1: at 16
// rows that ran at a quarter of the FMA peak. Here each activation load feeds 4 weight rows,
// each widened weight vector feeds MR rows, and a weight row group (8 KiB at K = 1024) stays
// in L1 while the activation rows pass over it, so weights still come from memory once.
template <int MR>
void dot_block(const Activations& xs, const bf16* const* wr, const bf16* next, int m0,
               float (*out)[4]) {
  const int64_t K = xs.K, k_vec = K / 32 * 32;
  vf a[MR][4];
  for (int i = 0; i < MR; ++i)
    for (int j = 0; j < 4; ++j) a[i][j] = vs::zero();
  for (int64_t k = 0; k < k_vec; k += 32) {
    if (next != nullptr)  // the next group's rows, one line of each per line consumed here
      for (int j = 0; j < 4; ++j) __builtin_prefetch(reinterpret_cast<const char*>(next + j * K + k));
    vf w_even[4], w_odd[4];
    for (int j = 0; j < 4; ++j) vs::widen_pairs(vs::load_pairs(wr[j] + k), w_even[j], w_odd[j]);
    for (int i = 0; i < MR; ++i) {
      const float* xw = xs.wide.data() + (m0 + i) * K + k;
      const vf x_even = vs::load(xw), x_odd = vs::load(xw + 16);
      for (int j = 0; j < 4; ++j)
        a[i][j] = vs::fmadd(w_odd[j], x_odd, vs::fmadd(w_even[j], x_even, a[i][j]));
    }
  }
  // the MR x 4 sums in one transpose-and-add tree rather than one reduction each
  vf v[16];
  for (int i = 0; i < 4; ++i)
    for (int j = 0; j < 4; ++j) v[i * 4 + j] = i < MR ? a[i][j] : vs::zero();
  alignas(64) float sums[16];
  vs::store(sums, hsum16(v));
  for (int i = 0; i < MR; ++i)
    for (int j = 0; j < 4; ++j) {
      float total = sums[i * 4 + j];
      for (int64_t k = k_vec; k < K; ++k) total += f32(wr[j][k]) * f32(xs.x[(m0 + i) * K + k]);
      out[i][j] = total;
    }
}

void dot_rows_blocked(const Activations& xs, const bf16* w, int64_t n0, int64_t n1, float* acc,
                      int64_t ld_acc);
#endif

// Most rows the dot-product kernel takes (past that, oneDNN's packed GEMM or the eager path)
constexpr int kMaxGemvRows = 16;

void dot_rows_any(const Activations& xs, const bf16* w, int64_t n0, int64_t n1, float* acc,
                  int64_t ld_acc) {
#ifndef VS_BF16_DOT
  if (xs.M >= 4) return dot_rows_blocked(xs, w, n0, n1, acc, ld_acc);
#endif
  switch (xs.M) {
    case 1: return dot_rows<1, 4>(xs, w, n0, n1, acc, ld_acc);
    case 2: return dot_rows<2, 2>(xs, w, n0, n1, acc, ld_acc);
    case 3: return dot_rows<3, 1>(xs, w, n0, n1, acc, ld_acc);
    case 4: return dot_rows<4, 1>(xs, w, n0, n1, acc, ld_acc);
    case 5: return dot_rows<5, 1>(xs, w, n0, n1, acc, ld_acc);
    case 6: return dot_rows<6, 1>(xs, w, n0, n1, acc, ld_acc);
    case 7: return dot_rows<7, 1>(xs, w, n0, n1, acc, ld_acc);
    case 8: return dot_rows<8, 1>(xs, w, n0, n1, acc, ld_acc);
    case 9: return dot_rows<9, 1>(xs, w, n0, n1, acc, ld_acc);
    case 10: return dot_rows<10, 1>(xs, w, n0, n1, acc, ld_acc);
    case 11: return dot_rows<11, 1>(xs, w, n0, n1, acc, ld_acc);
    case 12: return dot_rows<12, 1>(xs, w, n0, n1, acc, ld_acc);
    case 13: return dot_rows<13, 1>(xs, w, n0, n1, acc, ld_acc);
    case 14: return dot_rows<14, 1>(xs, w, n0, n1, acc, ld_acc);
    case 15: return dot_rows<15, 1>(xs, w, n0, n1, acc, ld_acc);
    case 16: return dot_rows<16, 1>(xs, w, n0, n1, acc, ld_acc);
    default:
      TORCH_CHECK(false, "the dot-product kernel takes 1..", kMaxGemvRows, " rows, got ", xs.M);
  }
}

#ifndef VS_BF16_DOT
// activation rows per dot_block: its MR x 4 accumulators fill half the register file
constexpr int kBlockRows = vs::kVecRegs >= 32 ? 4 : 2;

void dot_rows_blocked(const Activations& xs, const bf16* w, int64_t n0, int64_t n1, float* acc,
                      int64_t ld_acc) {
  const int64_t K = xs.K;
  for (int64_t n = n0; n < n1; n += 4) {
    // a last group of 1..3 weight rows repeats its last row
    const int rows = static_cast<int>(std::min<int64_t>(4, n1 - n));
    const bf16* wr[4];
    for (int j = 0; j < 4; ++j) wr[j] = w + (n + std::min(j, rows - 1)) * K;
    // weights stream from memory in 4-row groups too short for the hardware prefetcher to
    // ramp up on: the first activation block of each group fetches the next group's rows
    // (8.2 GB/s without this at 16 rows)
    const bf16* next = n + 8 <= n1 ? w + (n + 4) * K : nullptr;
    for (int m0 = 0; m0 < xs.M; m0 += kBlockRows) {
      float out[4][4];
      const int mr = std::min(kBlockRows, xs.M - m0);
      const bf16* pf = m0 == 0 ? next : nullptr;
      switch (mr) {
        case 1: dot_block<1>(xs, wr, pf, m0, out); break;
        case 2: dot_block<2>(xs, wr, pf, m0, out); break;
        case 3: dot_block<3>(xs, wr, pf, m0, out); break;
        default: dot_block<4>(xs, wr, pf, m0, out); break;
      }
      for (int i = 0; i < mr; ++i)
        for (int j = 0; j < rows; ++j) acc[(m0 + i) * ld_acc + (n + j - n0)] = out[i][j];
    }
  }
}
#endif

// Output-feature panels: the decode GEMV's layout for int8 weights (every build, every row
// count) and for bf16 weights at decode batches (>= kPanelRows rows; the native build up to
// its GEMV's row limit, oneDNN's packed GEMM past it).
// Why: the row-major kernel above reduces every output in a 16-lane accumulator and widens
// each weight vector once per 4 activation rows, and at 8-16 rows its widened activations
// (16 x K fp32) overflow L1: 169 GFLOP/s at 16 rows, 46 % of the FMA peak. In a panel the
// weights of 32 output features are laid out k by k (bf16: k pair by k pair), which makes the
// product an outer product: one load, widened once, feeds an FMA per 16 features and
// activation row, each activation is a broadcast scalar and no horizontal sum is left (223
// against 169 GFLOP/s at 16 rows on an Ice Lake; a batch-16 engine decode step at 1,200
// tokens of context 40.1 -> 37.9 ms). The native build's bf16 pair dot product takes a panel's
// k pair as it is (panel_block_dot): the row-major dot product reduced each of its R x 16-lane
// accumulators across lanes per output and ran out of independent chains at a few rows (Zen 4,
// the bench decoder's matrices, benchmarks/gemv.py: 4 rows 7.7-9.3 against 5.2-6.4 ms, 8 rows
// 9.7-12.2 against 5.7-7.0, 16 rows 20-21 against 9.5-10.7). Below kPanelRows rows the
// row-major bf16 kernel streams as fast or faster and keeps them; int8 has no row-major kernel
// here (one layout, one kernel to tune).
struct Panels {
  // bf16: [P, K / 2, 64]: panel p, k pair i holds features 32p .. 32p + 15 as pairs
  // (w[f][2i], w[f][2i + 1]), then features 32p + 16 .. 32p + 31.
  // int8: [P, Kp / g, 32, g]: panel p, group i holds w[32p + f][g i .. g i + g - 1] for f < 32
  // (g = ``group``: 1 where activations are widened, the integer dot product's group else; K
  // padded with zeros to Kp, a multiple of g). Missing features (past N) are zeros.
  at::Tensor data;
  at::Tensor scales;  // int8: fp32 [N], the per-output-channel scales
  // int8 with offset activations (vs::U8Dot): int32 [P, chunks, 32], the offset's share of
  // each feature's products per 256 k (kZero times the weights' sum there), taken off in int32
  at::Tensor offsets;
  int64_t N = 0, K = 0;
  bool int8 = false;
  int bits = 0;        // int8: the bits its activations are rounded to (0: widened to fp32)
  int64_t group = 1;  // int8: k per group (see data)
  bool defined() const { return data.defined(); }
};

constexpr int64_t kPanel = 32;
constexpr bool kWideRegs = vs::kVecRegs >= 32;
// fewest rows that take bf16 panels: on an Ice Lake at 6 rows they were 4 % slower; on a Zen 3
// (AVX2, 6-row blocks) from 4 rows they are faster (4 rows: 10.6 against 14.6 ms a decoder
// pass), at 2-3 rows the same. Session 33 (Zen 3): the GEMV alone (benchmarks/gemv.py --rows 1 2
// 3 --lm-head, three runs) read panels 7-11 % faster at 1 row and 4-8 % at 2, but engine decode
// steps with both builds in turns (the bf16 side of benchmarks/int8.py, three pairs) read 1 row
// the same and 2 rows 6-16 % slower with panels from 1 row: 4 stays. Native build (Zen 4, the
// same GEMV benchmark): 1 row 5.5 against 5.4 ms row-major, 2 rows 5.3 against 5.6, so panels
// from 2 rows; 1-row steps keep the row-major kernel and its tuned weight prefetch, unless the
// plan lets that copy go (FusedDecoder::drop_row_major: panels from 1 row, a second set of
// sums for the lone row; Zen 4, engine decode steps at batch 1 in turns, 2-4 % slower)
#ifdef VS_BF16_DOT
constexpr int kPanelRows = 2;
#else
constexpr int kPanelRows = kWideRegs ? 8 : 4;
#endif

// Register blocks of the panel kernels: R activation rows x V halves (16 features each) of a
// panel. AVX-512 takes both halves of up to 8 rows (16 of 32 registers accumulate). AVX2 has
// 16 ymm registers, half a logical vector each: there both halves of even 2 bf16 rows spilled
// three accumulators on every k, so blocks of more rows take one half of the panel (up to 6
// rows: 12 accumulators, the widened weights and a broadcast -- bf16 widens the even and the
// odd elements of its pairs in turn, see panel_block; with both live it took 4 rows, and a
// 16-row decoder pass ran at 73 GFLOP/s against 87-100 now) and the last 1-2 rows both
// halves. Each block widens the weights it reads once: the widening runs on other ports than the FMAs. FMA latency times
// the two FMA ports asks for 8 independent accumulators: 8 int8 rows go as 6 + 2 (12 and 8
// chains), not 4 + 4 (8 and 8, the bare minimum: 5 % slower at 8 rows, 10 % at 7).
constexpr int kFullRowsI8 = kWideRegs ? 8 : 2, kHalfRowsI8 = 6;
// int8 panels with an integer dot product (VS_INT_DOT): int16 ones (AVX-512) in blocks of up to
// 4 rows, the panel's 8 KiB then read from L1 by the second block (2-core Zen 5, one process in
// turns: 8 rows of a 4096 x 768 matrix 90 us as 2 x 4 against 112 as one block of 8 and 97 as
// 4 + 4 of 6-row limit; 16 rows 186 against 226; 2-row blocks 1.5x slower). On AVX2 a half panel
// of 4 rows (8 accumulators, 2 weight registers, the broadcast, its magnitude and the
// products) or both halves of 1-2 rows: 8 rows as 4 x 4 half blocks 22 us, as 2 x 4 whole
// ones 22 us (one Zen 3 core, weights in L2).
// AVX-512's unsigned int8 product (vs::U8Dot) takes up to 8 rows in one block (16
// accumulators): as 2 x 4 the first block waited on memory while the second ran from L1, and
// 8 rows of a 64 MiB matrix took 2.5-2.8 ms against 1.7-2.0 at 4 rows; in one block 1.96 (Zen 4).
constexpr int kFullRowsQ = kWideRegs ? 4 : 2, kHalfRowsQ = 4;
constexpr int kFullRowsQ8 = kWideRegs ? 8 : kFullRowsQ;
// the native build's bf16 dot product keeps up to 12 rows' accumulators (24 of 32 registers,
// the two weight vectors and a broadcast) in one block: 12 rows as one block 6.4 ms a bench
// decoder pass against 8.7 as 6 + 6 (Zen 4, runs minutes apart, the one block's in the slower
// minute: 4 rows 6.4 against 5.2 ms); more rows go in balanced blocks (16: 8 + 8)
#ifdef VS_BF16_DOT
constexpr int kFullRowsBf16 = 12, kHalfRowsBf16 = 6;
#else
constexpr int kFullRowsBf16 = kWideRegs ? 8 : 1, kHalfRowsBf16 = 6;
#endif

// One row block of a panel pass: rows [m0, m0 + rows), halves [h0, h0 + V)
struct PanelBlock {
  int m0, rows, h0, V;
};

// The blocks for M rows (see above): both halves for up to ``full_rows`` rows, else blocks of
// up to ``half_rows`` rows half by half, and the last ``full_rows`` or fewer both halves
inline std::vector<PanelBlock> panel_blocks(int M, int full_rows, int half_rows) {
  std::vector<PanelBlock> out;
  if (kWideRegs) {  // balanced: 12 rows are 6 + 6, not 8 + 4
    const int n = (M + full_rows - 1) / full_rows;
    for (int b = 0, m0 = 0; b < n; ++b) {
      const int rows = (M - m0) / (n - b);
      out.push_back({m0, rows, 0, 2});
      m0 += rows;
    }
    return out;
  }
  int m0 = 0;
  while (M - m0 > full_rows) {
    const int rows = std::min(half_rows, M - m0);
    out.push_back({m0, rows, 0, 1});
    out.push_back({m0, rows, 1, 1});
    m0 += rows;
  }
  if (m0 < M) out.push_back({m0, M - m0, 0, 2});
  return out;
}

// The integer dot products of this build (isa.h), by the bits activations are rounded to
#ifdef VS_INT_DOT
#ifdef VS_I16_DOT
using Int8Dot = vs::U8Dot;
using Int16Dot = vs::I16Dot;
#else
using Int8Dot = vs::S8Dot;
#endif
#endif

// The bits int8 panels round activations to on this machine: 16 where the AMX-INT8 tiles take
// over from 5 rows (they read the panels' int16 activations and give their result bit for
// bit), 8 with the other integer dot products, 0 (widened to fp32) without one
int panel_activation_bits() {
#if defined(VS_I16_DOT) && defined(VS_BF16_DOT)
  static const int bits = amx::amx_int8_usable() ? 16 : 8;
  return bits;
#elif defined(VS_INT_DOT)
  return 8;
#else
  return 0;
#endif
}

// Most rows a step rounds to int16 against panels laid out for int8 activations (VNNI without
// AMX: vs::I16QuadDot): few rows stream weights whatever the product, so they keep 15 bits.
// Bench decode steps at batch 1, int8 against bf16 (benchmarks/int8.py, four runs each in
// turns, Zen 4): 1.85-2.22x with int16 up to 4 rows, 1.62-1.94x with int8 at every row count;
// greedy agreement with bf16 93.2 % against 90.6 %.
constexpr int kI16QuadRows = 4;

// rows up to which int8 panels laid out for 8-bit activations take int16 ones in this build
int panel_i16_rows() {
#ifdef VS_I16_DOT
  return kI16QuadRows;
#else
  return 0;
#endif
}

// every value panel_activation_bits could take in this build (tests run them all)
std::vector<int> supported_activation_bits() {
#ifdef VS_I16_DOT
  return {0, 8, 16};
#elif defined(VS_INT_DOT)
  return {0, 8};
#else
  return {0};
#endif
}

// k per int8 panel group for activations of ``bits``: 1 where weights are widened to fp32
int64_t panel_group(int bits) {
#ifdef VS_INT_DOT
  if (bits == 8) return Int8Dot::kGroup;
#endif
#ifdef VS_I16_DOT
  if (bits == 16) return Int16Dot::kGroup;
#endif
  TORCH_CHECK(bits == 0, "int8 activations of ", bits,
              " bits: not one this build takes (int8_activation_bits_supported)");
  return 1;
}

inline int64_t i8_panel_k(int64_t K, int64_t group) { return (K + group - 1) / group * group; }

// w rows [row0, row0 + rows) as int8 panels of ``group`` k, written to ``dst``
void pack_panels_i8(const at::Tensor& w, int64_t row0, int64_t rows, int64_t group, int8_t* dst) {
  const int64_t K = w.size(1), Kp = i8_panel_k(K, group), P = (rows + kPanel - 1) / kPanel;
  const int8_t* src = w.data_ptr<int8_t>() + row0 * K;
  at::parallel_for(0, P, 1, [&](int64_t p0, int64_t p1) {
    for (int64_t p = p0; p < p1; ++p) {
      int8_t* panel = dst + p * Kp * kPanel;
      std::memset(panel, 0, Kp * kPanel);
      for (int64_t f = 0; f < kPanel && p * kPanel + f < rows; ++f) {
        const int8_t* row = src + (p * kPanel + f) * K;
        for (int64_t k = 0; k < K; ++k)
          panel[(k / group * kPanel + f) * group + k % group] = row[k];
      }
    }
  });
}

// kI8ChunkK k per int8 panel pass and per activation scale (see panel_block_i8q)
constexpr int64_t kI8ChunkK = 256;

// The offset activations' share of the int8 panels' sums (Panels::offsets): for w rows [row0,
// row0 + rows), int32 [P, chunks, 32] with ``zero`` times each row's sum over each kI8ChunkK k
at::Tensor panel_offsets(const at::Tensor& w, int64_t row0, int64_t rows, int zero) {
  const int64_t K = w.size(1), P = (rows + kPanel - 1) / kPanel;
  const int64_t chunks = (K + kI8ChunkK - 1) / kI8ChunkK;
  at::Tensor out = at::zeros({P, chunks, kPanel}, w.options().dtype(at::kInt));
  int32_t* o = out.data_ptr<int32_t>();
  const int8_t* src = w.data_ptr<int8_t>() + row0 * K;
  at::parallel_for(0, rows, kPanel, [&](int64_t n0, int64_t n1) {
    for (int64_t n = n0; n < n1; ++n)
      for (int64_t c = 0; c < chunks; ++c) {
        int32_t sum = 0;
        for (int64_t k = c * kI8ChunkK; k < std::min(K, (c + 1) * kI8ChunkK); ++k)
          sum += src[n * K + k];
        o[(n / kPanel * chunks + c) * kPanel + n % kPanel] = zero * sum;
      }
  });
  return out;
}

// bytes of the int8 panels of ``rows`` rows of K for activations of ``bits``
int64_t int8_panel_bytes(int64_t rows, int64_t K, int bits) {
  return (rows + kPanel - 1) / kPanel * i8_panel_k(K, panel_group(bits)) * kPanel;
}

// ``out`` = w rows [row0, row0 + rows) (int8 [N, K], ``scales`` [N]) as panels for activations
// of ``bits``, packed into ``data`` (int8_panel_bytes of them)
void pack_int8_panels(const at::Tensor& w, const at::Tensor& scales, int64_t row0, int64_t rows,
                      int bits, const at::Tensor& data, Panels& out) {
  const int64_t group = panel_group(bits);
  TORCH_CHECK(data.nbytes() == static_cast<size_t>(int8_panel_bytes(rows, w.size(1), bits)));
  pack_panels_i8(w, row0, rows, group, static_cast<int8_t*>(data.data_ptr()));
  out.data = data;
  out.scales = scales.narrow(0, row0, rows).contiguous();
  out.int8 = true;
  out.bits = bits;
  out.group = group;
  out.N = rows;
  out.K = w.size(1);
#ifdef VS_INT_DOT
  if (bits == 8 && Int8Dot::kZero != 0) out.offsets = panel_offsets(w, row0, rows, Int8Dot::kZero);
#endif
}

// acc[r][16 h .. 16 h + 15] += x[r] . w[f] over features of halves [h0, h0 + V) of an int8
// panel and its k [k0, k1), for R activation rows (fp32, row stride K); ``first`` starts the
// sums at zero. S accumulator sets take alternate k: at 1-2 rows, R x V chains alone would
// leave the FMA units waiting on their latency. Each 16 weights are widened once (load_i8)
// and feed R FMAs: the widening is the per-weight work int8 adds, so it is kept out of the
// row loop.
template <int R, int V, int S>
__attribute__((noinline)) void panel_block_i8(const float* x, int64_t K, const int8_t* panel,
                                              int h0, int64_t k0, int64_t k1, bool first,
                                              bool prefetch, float (*acc_io)[kPanel]) {
  vf acc[S][R][V];
  for (int s = 0; s < S; ++s)
    for (int r = 0; r < R; ++r)
      for (int v = 0; v < V; ++v)
        acc[s][r][v] = s == 0 && !first ? vs::load(acc_io[r] + 16 * (h0 + v)) : vs::zero();
  auto step = [&](int s, int64_t k) {
    const int8_t* wp = panel + k * kPanel;
    vf w[V];
    for (int v = 0; v < V; ++v) w[v] = vs::load_i8(wp + 16 * (h0 + v));
    for (int r = 0; r < R; ++r) {
      const vf xb = vs::set1(x[r * K + k]);
      for (int v = 0; v < V; ++v) acc[s][r][v] = vs::fmadd(w[v], xb, acc[s][r][v]);
    }
  };
  // two k per iteration: one 64-byte line of the panel, one prefetch (8 KiB ahead, as the
  // bf16 panels) and half the loop overhead -- at 4 rows a k is only 8 FMAs, and the front
  // end, not the FMA units, had become the limit
  constexpr int kUnroll = S > 2 ? S : 2;
  int64_t k = k0;
  for (; k + kUnroll <= k1; k += kUnroll) {
    if (prefetch) __builtin_prefetch(panel + k * kPanel + 8192);
    for (int u = 0; u < kUnroll; ++u) step(u % S, k + u);
  }
  for (; k < k1; ++k) step(0, k);
  for (int s = 1; s < S; ++s)
    for (int r = 0; r < R; ++r)
      for (int v = 0; v < V; ++v) acc[0][r][v] = vs::add(acc[0][r][v], acc[s][r][v]);
  for (int r = 0; r < R; ++r)
    for (int v = 0; v < V; ++v) vs::store(acc_io[r] + 16 * (h0 + v), acc[0][r][v]);
}

#ifdef VS_INT_DOT
// panel_block_i8 with an integer dot product D (isa.h), over k groups [i0, i1) (one 256-k
// chunk at most: 256 k of int16 x int8 products sum in int32 without overflow, 256 * 32767 *
// 128 < 2^31, int8 x int8 ones with room to spare): activations are quantized (D::act_t, row
// stride ld_bytes) with one scale per row for this chunk (scale[r * scale_stride]); offset
// activations' share (``offsets``: 32 features, this chunk) leaves the int32 sums, which then
// leave the registers once, scaled, into the fp32 ``acc_io``. At 8 rows the fp32 path's FMAs
// were the limit (int8 decode steps barely faster than bf16 ones on a Zen 5, 1.33x on a Zen 3),
// at 1 row the widening.
template <typename D, int R, int V, int S>
__attribute__((noinline)) void panel_block_i8q(const uint8_t* xq, int64_t ld_bytes,
                                               const int8_t* panel, int h0, int64_t i0,
                                               int64_t i1, const float* scale,
                                               int64_t scale_stride, const int32_t* offsets,
                                               bool first, bool prefetch,
                                               float (*acc_io)[kPanel]) {
  constexpr int64_t G = D::kGroup;
  using act_t = typename D::act_t;
  vs::vi acc[S][R][V];
  for (int s = 0; s < S; ++s)
    for (int r = 0; r < R; ++r)
      for (int v = 0; v < V; ++v) acc[s][r][v] = vs::izero();
  auto step = [&](int s, int64_t i) {
    const int8_t* wp = panel + i * G * kPanel;
    typename D::vw w[V];
    for (int v = 0; v < V; ++v) w[v] = D::load_group(wp + 16 * G * (h0 + v));
    for (int r = 0; r < R; ++r) {
      const act_t* x = reinterpret_cast<const act_t*>(xq + r * ld_bytes);
      const typename D::vx xb = D::broadcast(x + G * D::kSpread * i);
      for (int v = 0; v < V; ++v) acc[s][r][v] = D::dot(acc[s][r][v], w[v], xb);
    }
  };
  int64_t i = i0;
  for (; i + S <= i1; i += S) {
    for (int u = 0; u < S; ++u) {
      // the group's 64 (pairs) or 128 bytes (quads) of the panel prefetched 8 KiB ahead, as
      // the other panels
      const int8_t* ahead = panel + (i + u) * G * kPanel + 8192;
      if (prefetch) {
        __builtin_prefetch(ahead);
        if (G * kPanel > 64) __builtin_prefetch(ahead + 64);
      }
      step(u, i + u);
    }
  }
  for (; i < i1; ++i) step(0, i);
  for (int s = 1; s < S; ++s)
    for (int r = 0; r < R; ++r)
      for (int v = 0; v < V; ++v) acc[0][r][v] = vs::iadd(acc[0][r][v], acc[s][r][v]);
  if constexpr (D::kZero != 0) {
    for (int v = 0; v < V; ++v) {
      const vs::vi share = vs::iload(offsets + 16 * (h0 + v));
      for (int r = 0; r < R; ++r) acc[0][r][v] = vs::isub(acc[0][r][v], share);
    }
  }
  for (int r = 0; r < R; ++r) {
    const vf sc = vs::set1(scale[r * scale_stride]);
    for (int v = 0; v < V; ++v) {
      float* out = acc_io[r] + 16 * (h0 + v);
      vs::store(out, vs::fmadd(vs::to_float(acc[0][r][v]), sc, first ? vs::zero() : vs::load(out)));
    }
  }
}
#endif

// w rows [row0, row0 + rows) as bf16 panels, written to ``dst``
void pack_panels(const at::Tensor& w, int64_t row0, int64_t rows, uint16_t* dst) {
  const int64_t K = w.size(1), P = (rows + kPanel - 1) / kPanel;
  const uint16_t* src = reinterpret_cast<const uint16_t*>(w.data_ptr<bf16>()) + row0 * K;
  at::parallel_for(0, P, 1, [&](int64_t p0, int64_t p1) {
    for (int64_t p = p0; p < p1; ++p) {
      uint16_t* panel = dst + p * (K / 2) * 2 * kPanel;
      std::memset(panel, 0, (K / 2) * 2 * kPanel * sizeof(uint16_t));
      for (int64_t f = 0; f < kPanel && p * kPanel + f < rows; ++f) {
        const uint16_t* row = src + (p * kPanel + f) * K;
        uint16_t* lane = panel + (f / 16) * 32 + (f % 16) * 2;
        for (int64_t i = 0; i < K / 2; ++i) {
          lane[i * 2 * kPanel] = row[2 * i];
          lane[i * 2 * kPanel + 1] = row[2 * i + 1];
        }
      }
    }
  });
}

// A panel block's R x V sums in registers: zeros on a panel's first pass, else the sums so far
template <int R, int V>
inline void load_panel_sums(vf (&acc)[R][V], float (*acc_io)[kPanel], int h0, bool first) {
  for (int r = 0; r < R; ++r)
    for (int v = 0; v < V; ++v)
      acc[r][v] = first ? vs::zero() : vs::load(acc_io[r] + 16 * (h0 + v));
}

template <int R, int V>
inline void store_panel_sums(const vf (&acc)[R][V], float (*acc_io)[kPanel], int h0) {
  for (int r = 0; r < R; ++r)
    for (int v = 0; v < V; ++v) vs::store(acc_io[r] + 16 * (h0 + v), acc[r][v]);
}

// both lines of a bf16 panel's k pair at ``wp``, 8 KiB ahead (4 KiB: 2 % slower at 16 rows,
// 16 KiB: no better; emulated build, Ice Lake)
inline void prefetch_pair_ahead(const uint16_t* wp) {
  __builtin_prefetch(reinterpret_cast<const char*>(wp) + 8192);
  __builtin_prefetch(reinterpret_cast<const char*>(wp) + 8192 + 64);
}

#ifndef VS_BF16_DOT
// The same for a bf16 panel over k pairs [i0, i1). Each accumulator takes the even product of
// a pair, then the odd one, with only one of the two widened weight sets live at a time: on
// AVX2 (16 ymm registers) a block of 6 rows then fits (12 accumulators, 2 widened, a
// broadcast), 12 independent FMA chains, where 4 rows with both sets live left 8 chains of two
// dependent FMAs per pair: latency-bound (see kHalfRowsBf16). The sums per
// accumulator are the same sequence of FMAs either way.
template <int R, int V>
__attribute__((noinline)) void panel_block(const float* x, int64_t K, const uint16_t* panel,
                                           int h0, int64_t i0, int64_t i1, bool first,
                                           bool prefetch, float (*acc_io)[kPanel]) {
  vf acc[R][V];
  load_panel_sums(acc, acc_io, h0, first);
  for (int64_t i = i0; i < i1; ++i) {
    const uint16_t* wp = panel + i * 2 * kPanel;
    if (prefetch) prefetch_pair_ahead(wp);
    {
      vf e[V];
      for (int v = 0; v < V; ++v) e[v] = vs::widen_even(wp + 32 * (h0 + v));
      for (int r = 0; r < R; ++r) {
        const vf xe = vs::set1(x[r * K + 2 * i]);
        for (int v = 0; v < V; ++v) acc[r][v] = vs::fmadd(e[v], xe, acc[r][v]);
      }
    }
    vf o[V];
    for (int v = 0; v < V; ++v) o[v] = vs::widen_odd(wp + 32 * (h0 + v));
    for (int r = 0; r < R; ++r) {
      const vf xo = vs::set1(x[r * K + 2 * i + 1]);
      for (int v = 0; v < V; ++v) acc[r][v] = vs::fmadd(o[v], xo, acc[r][v]);
    }
  }
  store_panel_sums(acc, acc_io, h0);
}
#else
// A bf16 panel over k pairs [i0, i1) with the bf16 pair dot product: a panel's k pair holds
// 16 features' (even, odd) weights per half, exactly the operand the instruction takes, and
// each activation row's pair is one broadcast. x: bf16 rows of stride K.
template <int R, int V>
__attribute__((noinline)) void panel_block_dot(const bf16* x, int64_t K, const uint16_t* panel,
                                               int h0, int64_t i0, int64_t i1, bool first,
                                               bool prefetch, float (*acc_io)[kPanel]) {
  // one row: a second set of sums takes every other k pair, so that V chains do not wait on
  // the dot product's latency alone
  constexpr int S = R == 1 ? 2 : 1;
  vf acc[R][V], more[R][V];
  load_panel_sums(acc, acc_io, h0, first);
  load_panel_sums(more, acc_io, h0, /*first=*/true);  // zeros
  auto step = [&](int64_t i, vf (&sums)[R][V]) {
    const uint16_t* wp = panel + i * 2 * kPanel;
    if (prefetch) prefetch_pair_ahead(wp);
    vs::vpair w[V];
    for (int v = 0; v < V; ++v) w[v] = vs::load_pairs(wp + 32 * (h0 + v));
    for (int r = 0; r < R; ++r) {
      const vs::vpair xb = vs::broadcast_pair(x + r * K + 2 * i);
      for (int v = 0; v < V; ++v) sums[r][v] = vs::dot_pairs(sums[r][v], w[v], xb);
    }
  };
  int64_t i = i0;
  if constexpr (S > 1) {
    for (; i + 1 < i1; i += 2) {
      step(i, acc);
      step(i + 1, more);
    }
  }
  for (; i < i1; ++i) step(i, acc);
  if constexpr (S > 1)
    for (int r = 0; r < R; ++r)
      for (int v = 0; v < V; ++v) acc[r][v] = vs::add(acc[r][v], more[r][v]);
  store_panel_sums(acc, acc_io, h0);
}
#endif

// k (int8) or k pairs (bf16) per pass of all row blocks over a panel: 8 KiB of weights, read
// from memory by the first block and from L1 by the others (block by block over the whole
// panel, the first block alone streamed the weights, faster than memory could deliver them)
constexpr int64_t kPanelChunkBytes = 8192;
static_assert(kI8ChunkK == kPanelChunkBytes / kPanel, "one activation scale per int8 panel pass");

// A panel kernel for R rows, V halves: a function pointer per (R, V), so that the blocks of a
// call are planned once and the kernels keep their accumulators in registers
template <typename W>
using PanelKernel = void (*)(const float*, int64_t, const W*, int, int64_t, int64_t, bool, bool,
                             float (*)[kPanel]);

template <int V, int S>
PanelKernel<int8_t> i8_kernel(int R) {
  switch (R) {
    case 1: return &panel_block_i8<1, V, S>;
    case 2: return &panel_block_i8<2, V, S>;
    case 3: return &panel_block_i8<3, V, S>;
    case 4: return &panel_block_i8<4, V, S>;
    case 5: return &panel_block_i8<5, V, S>;
    case 6: return &panel_block_i8<6, V, S>;
    case 7: return &panel_block_i8<7, V, S>;
    default: return &panel_block_i8<8, V, S>;
  }
}

// the int8 kernel for a block: at 1-2 rows, enough accumulator sets for 8 FMA chains
PanelKernel<int8_t> i8_kernel_for(int R, int V) {
  if (V == 1) return i8_kernel<1, 1>(R);
  if (R == 1) return kWideRegs ? i8_kernel<2, 4>(1) : i8_kernel<2, 2>(1);
  if (R == 2 && kWideRegs) return i8_kernel<2, 2>(2);
  return i8_kernel<2, 1>(R);
}

#ifdef VS_INT_DOT
using PanelKernelQ = void (*)(const uint8_t*, int64_t, const int8_t*, int, int64_t, int64_t,
                              const float*, int64_t, const int32_t*, bool, bool,
                              float (*)[kPanel]);

// AVX-512: blocks of 1..8 rows and both halves of a panel, at 1-2 rows more accumulator sets
// (int16: 4 at 1 row, for 8 independent vpdpwssd chains; unsigned int8: 2 -- the bench
// decoder's GEMV at 1 row against int16's, Zen 4: 4 % slower with 2 sets, 6-7 % with 1, 16 %
// with 4; from 2 rows the same or faster). AVX2: 1..4 rows of a half, or 1-2 rows of both
// halves; one set (the chain through each accumulator is a 1-cycle add)
static_assert(kFullRowsQ <= 4 && kFullRowsQ8 <= 8 && kHalfRowsQ == 4, "the kernels below");
template <typename D>
PanelKernelQ q_kernel_for(int R, int V) {
  if (kWideRegs || V == 2) {
    switch (R) {
      case 1:
        if (!kWideRegs) return &panel_block_i8q<D, 1, 2, 1>;
        return D::kBits == 8 ? &panel_block_i8q<D, 1, 2, 2> : &panel_block_i8q<D, 1, 2, 4>;
      case 2: return kWideRegs ? &panel_block_i8q<D, 2, 2, 2> : &panel_block_i8q<D, 2, 2, 1>;
      case 3: return &panel_block_i8q<D, 3, 2, 1>;
      case 4: return &panel_block_i8q<D, 4, 2, 1>;
      case 5: return &panel_block_i8q<D, 5, 2, 1>;
      case 6: return &panel_block_i8q<D, 6, 2, 1>;
      case 7: return &panel_block_i8q<D, 7, 2, 1>;
      default: return &panel_block_i8q<D, 8, 2, 1>;
    }
  }
  switch (R) {
    case 1: return &panel_block_i8q<D, 1, 1, 1>;
    case 2: return &panel_block_i8q<D, 2, 1, 1>;
    case 3: return &panel_block_i8q<D, 3, 1, 1>;
    default: return &panel_block_i8q<D, 4, 1, 1>;
  }
}

PanelKernelQ q_kernel_for_bits(int bits, int64_t group, int R, int V) {
#ifdef VS_I16_DOT
  if (bits == 16 && group == Int16Dot::kGroup) return q_kernel_for<Int16Dot>(R, V);
  if (bits == 16) return q_kernel_for<vs::I16QuadDot>(R, V);
#endif
  TORCH_CHECK(bits == 8, "no integer dot product for ", bits, "-bit activations");
  return q_kernel_for<Int8Dot>(R, V);
}
#endif

// The bf16 panel kernel of this build: activations widened to fp32 (emulated builds) or the
// rows as given, bf16 (the native build's pair dot product)
#ifdef VS_BF16_DOT
using Bf16PanelAct = bf16;
template <int R, int V>
constexpr auto kBf16PanelBlock = &panel_block_dot<R, V>;
#else
using Bf16PanelAct = float;
template <int R, int V>
constexpr auto kBf16PanelBlock = &panel_block<R, V>;
#endif
using Bf16PanelKernel = void (*)(const Bf16PanelAct*, int64_t, const uint16_t*, int, int64_t,
                                 int64_t, bool, bool, float (*)[kPanel]);
// the most rows panel_blocks puts in one bf16 block: only these kernels are instantiated
constexpr int kMaxBf16BlockRows = std::max(kFullRowsBf16, kHalfRowsBf16);

// the kernel for a block of ``rows`` rows (1 <= rows <= kMaxBf16BlockRows), V halves
template <int V, int R = 1>
Bf16PanelKernel bf16_kernel(int rows) {
  if constexpr (R == kMaxBf16BlockRows) {
    return kBf16PanelBlock<R, V>;
  } else {
    return rows <= R ? kBf16PanelBlock<R, V> : bf16_kernel<V, R + 1>(rows);
  }
}

// A step's activation rows as the panel kernels read them: widened to fp32, or, for int8
// panels in builds with an integer dot product D, rounded to D::act_t with one fp32 scale per
// row and kI8ChunkK k (that stretch's largest |x| / D::kMax). int16 (AVX-512 VNNI on AMX
// CPUs) keeps 15 bits against the stretch's largest, where bf16 itself keeps 8 against the
// value: the int8 weights' own rounding (1/254 of a channel's largest) stays what separates
// int8 from bf16 output. int8 (AVX2, AVX-512 VNNI elsewhere) keeps 7 bits and a sign against
// the stretch's largest (outliers split off, see quantize_rows), as coarse as the weights: the
// price of products that cost half the wider paths' (isa/); its greedy agreement and logit
// error against bf16 are measured by benchmarks/int8.py and bounded by tests/engine/test_int8.py.
struct PanelInput {
  int M = 0;
  int64_t K = 0;
  std::vector<float> xf;  // [M, K]: fp32 kernels
  // [M, ld_bytes]: integer dot product, K padded to Kp (a multiple of the group, x = 0) in its
  // activation layout (Kp * D::kSpread values of D::act_t a row)
  std::vector<uint8_t> xq;
  int64_t ld_bytes = 0;
  int bits = 0;  // the integer dot product's (Panels::bits), 0 for fp32
  std::vector<float> xs;  // [M, chunks]: the scale of each row's stretch of kI8ChunkK k
  int64_t Kp = 0, chunks = 0;
  // int8 activations: values split off their stretch's rounding (see quantize_rows), row by
  // row (outliers[outlier_start[m] .. outlier_start[m + 1]]), added in fp32 by panel_rows
  struct Outlier {
    int64_t k;
    float value;
  };
  std::vector<Outlier> outliers;
  std::vector<size_t> outlier_start;
  const bf16* xb = nullptr;  // bf16 panels with the bf16 dot product: the rows as given
  bool quantized() const { return bits != 0; }
};

std::vector<float> widen_rows(int M, const bf16* x, int64_t K) {
  std::vector<float> xf(static_cast<size_t>(M) * K);
  for (int64_t i = 0; i < M * K; i += 16) {
    const int64_t k = M * K - i;
    vs::store(xf.data() + i, vs::load_bf16(x + i, k), k);
  }
  return xf;
}

#ifdef VS_INT_DOT
// Outliers of int8 activations: a value past kOutlierRms times its stretch's root mean square
// would set the stretch's rounding step for all 256 values, and 7 bits against a massive
// activation (LLM residual streams carry a few dimensions hundreds of times the rest, and
// their norms pass them on) leave the others a handful of levels. Such values are taken out
// of the int8 rounding and added in fp32 (LLM.int8()'s decomposition, per value). A Gaussian
// stretch never has one (6 sigma: ~2e-9 a value). Several outliers lift the stretch's root
// mean square with them, so the limit is narrowed to that of the values within it, a few
// passes at most. int16 activations need none.
constexpr float kOutlierRms = 6.f;

// What the outlier passes read of a stretch's magnitudes within ``limit``: their sum of
// squares, largest and count
struct Inliers {
  float sumsq, max;
  int64_t count;
};

inline Inliers inliers(const float* mag, int64_t n, float limit) {
  vf sumsq = vs::zero(), largest = vs::zero();
  int64_t above = 0;
  for (int64_t k = 0; k < n; k += 16) {
    const vf a = vs::load(mag + k, n - k);  // past n: zeros, never above a limit >= 0
    above += vs::count_gt(a, limit);
    const vf kept = vs::zero_unless_le(a, limit);
    sumsq = vs::fmadd(kept, kept, sumsq);
    largest = vs::max(largest, kept);
  }
  return {vs::reduce_add(sumsq), vs::reduce_max(largest), n - above};
}

// Fills in.xq / in.xs / in.outliers (see PanelInput) for M rows of x [M, K], for D
template <typename D>
void quantize_rows(int M, const bf16* x, int64_t K, PanelInput& in) {
  constexpr bool kSplitOutliers = D::kBits == 8;
  using act_t = typename D::act_t;
  in.M = M;
  in.K = K;
  in.bits = D::kBits;
  in.Kp = i8_panel_k(K, D::kGroup);
  in.chunks = (K + kI8ChunkK - 1) / kI8ChunkK;
  const int64_t ld = in.Kp * D::kSpread;  // in act_t
  in.ld_bytes = ld * sizeof(act_t);
  in.xq.resize(static_cast<size_t>(M) * in.ld_bytes);
  {
    act_t* all = reinterpret_cast<act_t*>(in.xq.data());
    std::fill(all, all + M * ld, static_cast<act_t>(D::kZero));
  }
  in.xs.resize(static_cast<size_t>(M) * in.chunks);
  in.outliers.clear();
  in.outlier_start.assign(M + 1, 0);
  // the stretch's magnitudes, widened once: the outlier passes read them again
  alignas(64) float mag[kI8ChunkK];
  for (int m = 0; m < M; ++m) {
    const bf16* row = x + m * K;
    in.outlier_start[m] = in.outliers.size();
    for (int64_t c = 0; c < in.chunks; ++c) {
      const int64_t k0 = c * kI8ChunkK, k1 = std::min(K, k0 + kI8ChunkK), n = k1 - k0;
      vf amax = vs::zero(), sumsq = vs::zero();
      for (int64_t k = k0; k < k1; k += 16) {
        const vf v = vs::load_bf16(row + k, k1 - k);
        const vf a = vs::max(v, vs::sub(vs::zero(), v));
        amax = vs::max(amax, a);
        if constexpr (kSplitOutliers) {  // int16 needs none
          sumsq = vs::fmadd(v, v, sumsq);
          vs::store(mag + (k - k0), a, k1 - k);
        }
      }
      float a = vs::reduce_max(amax);
      const size_t split_from = in.outliers.size();
      if constexpr (kSplitOutliers) {
        float limit = kOutlierRms * std::sqrt(vs::reduce_add(sumsq) / n);
        if (a > limit) {
          // a few passes narrow the limit to 6x the root mean square of the values within it
          // (a few outliers in a short stretch lift the first one); then the outliers leave
          // and the rest's largest sets the rounding. Heavy-tailed activations (the MLP's
          // down projection reads SiLU(gate) x up) take this path in a good share of their
          // stretches: it is vectorized, the outliers themselves picked out lane by lane.
          Inliers in_limit = inliers(mag, n, limit);
          for (int pass = 0; pass < 4; ++pass) {
            const float narrower =
                kOutlierRms * std::sqrt(in_limit.sumsq / std::max<int64_t>(in_limit.count, 1));
            if (in_limit.max <= narrower) break;
            limit = narrower;
            in_limit = inliers(mag, n, limit);
          }
          a = in_limit.max;
          for (int64_t k = 0; k < n; k += 16) {
            if (!vs::any_gt(vs::load(mag + k, n - k), limit)) continue;
            for (int64_t j = k; j < std::min(n, k + 16); ++j)
              if (mag[j] > limit) in.outliers.push_back({k0 + j, f32(row[k0 + j])});
          }
        }
      }
      const bool nonzero = a > 0.f;  // NaN compares false: zeros, then a NaN scale
      in.xs[m * in.chunks + c] = nonzero ? a / D::kMax : (a == 0.f ? 0.f : a);
      const vf inv = vs::set1(nonzero ? D::kMax / a : 0.f);
      act_t* q = reinterpret_cast<act_t*>(in.xq.data() + m * in.ld_bytes);
      for (int64_t k = k0; k < k1; k += 16)
        D::store(q + k * D::kSpread, vs::mul(vs::load_bf16(row + k, k1 - k), inv), k1 - k);
      for (size_t o = split_from; o < in.outliers.size(); ++o) D::clear(q, in.outliers[o].k);
    }
  }
  in.outlier_start[M] = in.outliers.size();
}
#endif

PanelInput panel_input(int M, const bf16* x, const Panels& w) {
  PanelInput in;
  in.M = M;
  in.K = w.K;
#ifdef VS_I16_DOT
  if (w.int8 && w.bits == 8 && M <= kI16QuadRows) {
    quantize_rows<vs::I16QuadDot>(M, x, w.K, in);
    return in;
  }
#endif
#ifdef VS_INT_DOT
  if (w.int8 && w.bits == 8) {
    quantize_rows<Int8Dot>(M, x, w.K, in);
    return in;
  }
#endif
#ifdef VS_I16_DOT
  if (w.int8 && w.bits == 16) {
    quantize_rows<Int16Dot>(M, x, w.K, in);
    return in;
  }
#endif
#ifdef VS_BF16_DOT
  if (!w.int8) {
    in.xb = x;
    return in;
  }
#endif
  in.xf = widen_rows(M, x, w.K);
  return in;
}

// the bf16 panel kernels' activation rows in ``in`` (see panel_input)
inline const Bf16PanelAct* bf16_panel_rows(const PanelInput& in) {
#ifdef VS_BF16_DOT
  return in.xb;
#else
  return in.xf.data();
#endif
}

// acc[m][n - n0] for the features of panels [p0, p1) (n0 = 32 p0), all rows of ``in``;
// int8 panels apply their scales here, so every epilogue sees the product itself
void panel_rows(const PanelInput& in, const Panels& w, int64_t p0, int64_t p1, float* acc,
                int64_t ld_acc) {
  const int M = in.M;
  const int64_t K = w.K;
  const bool qdot = in.quantized();
  thread_local std::vector<float> sums;
  sums.resize(static_cast<size_t>(M) * kPanel);
  float(*rows_acc)[kPanel] = reinterpret_cast<float(*)[kPanel]>(sums.data());
  const std::vector<PanelBlock> blocks =
      !w.int8 ? panel_blocks(M, kFullRowsBf16, kHalfRowsBf16)
      : qdot  ? panel_blocks(M, in.bits == 8 ? kFullRowsQ8 : kFullRowsQ, kHalfRowsQ)
              : panel_blocks(M, kFullRowsI8, kHalfRowsI8);
  struct Planned {
    PanelBlock b;
    PanelKernel<int8_t> i8;
    Bf16PanelKernel b16;
#ifdef VS_INT_DOT
    PanelKernelQ i8q;
#endif
  };
  std::vector<Planned> plan;
  for (const PanelBlock& b : blocks) {
    Planned p{};
    p.b = b;
    if (w.int8) {
#ifdef VS_INT_DOT
      if (qdot) p.i8q = q_kernel_for_bits(in.bits, w.group, b.rows, b.V);
#endif
      if (!qdot) p.i8 = i8_kernel_for(b.rows, b.V);
    } else {
      p.b16 = b.V == 2 ? bf16_kernel<2>(b.rows) : bf16_kernel<1>(b.rows);
    }
    plan.push_back(p);
  }
  // per pass: k (int8, 32 bytes each), k groups (int8 for an integer dot product, 32 bytes a
  // k; bf16 pairs, 128 bytes each)
  TORCH_CHECK(!qdot || (w.int8 && in.Kp == i8_panel_k(K, w.group)),
              "activations rounded for other panels");
  const int64_t steps = qdot ? in.Kp / w.group : w.int8 ? K : K / 2;
  const int64_t chunk =
      kPanelChunkBytes / (qdot ? w.group * kPanel : w.int8 ? kPanel : 4 * kPanel);
  const int64_t panel_k = w.int8 ? i8_panel_k(K, w.group) : K;
  const float* scales = w.int8 ? w.scales.data_ptr<float>() : nullptr;
  const int32_t* offsets = w.offsets.defined() ? w.offsets.data_ptr<int32_t>() : nullptr;
  for (int64_t p = p0; p < p1; ++p) {
    for (int64_t i0 = 0; i0 < steps; i0 += chunk) {
      const int64_t i1 = std::min(steps, i0 + chunk);
      for (size_t j = 0; j < plan.size(); ++j) {
        const PanelBlock& b = plan[j].b;
        const bool first = i0 == 0, prefetch = j == 0;
        if (w.int8) {
          const int8_t* panel = static_cast<const int8_t*>(w.data.data_ptr()) + p * panel_k * kPanel;
#ifdef VS_INT_DOT
          if (qdot) {
            const int32_t* share =
                offsets ? offsets + (p * in.chunks + i0 / chunk) * kPanel : nullptr;
            plan[j].i8q(in.xq.data() + b.m0 * in.ld_bytes, in.ld_bytes, panel, b.h0, i0, i1,
                        in.xs.data() + b.m0 * in.chunks + i0 / chunk, in.chunks, share, first,
                        prefetch, rows_acc + b.m0);
            continue;
          }
#endif
          plan[j].i8(in.xf.data() + b.m0 * K, K, panel, b.h0, i0, i1, first, prefetch,
                     rows_acc + b.m0);
        } else {
          const uint16_t* panel =
              static_cast<const uint16_t*>(w.data.data_ptr()) + p * (K / 2) * 2 * kPanel;
          plan[j].b16(bf16_panel_rows(in) + b.m0 * K, K, panel, b.h0, i0, i1, first, prefetch,
                      rows_acc + b.m0);
        }
      }
    }
    const int64_t features = std::min<int64_t>(kPanel, w.N - p * kPanel);
    if (qdot && !in.outliers.empty()) {  // the values quantize_rows split off, in fp32
      const int8_t* panel = static_cast<const int8_t*>(w.data.data_ptr()) + p * panel_k * kPanel;
      const int64_t G = w.group;
      for (int m = 0; m < M; ++m)
        for (size_t o = in.outlier_start[m]; o < in.outlier_start[m + 1]; ++o) {
          const auto [k, value] = in.outliers[o];
          const int8_t* column = panel + k / G * G * kPanel + k % G;  // w[32 p + f][k] at f * G
          for (int64_t f = 0; f < features; ++f) rows_acc[m][f] += value * column[f * G];
        }
    }
    for (int m = 0; m < M; ++m) {
      float* dst = acc + m * ld_acc + (p - p0) * kPanel;
      if (scales == nullptr) {
        std::memcpy(dst, rows_acc[m], features * sizeof(float));
      } else {
        for (int64_t f = 0; f < features; f += 16)
          vs::store(dst + f,
                    vs::mul(vs::load(rows_acc[m] + f, features - f),
                            vs::load(scales + p * kPanel + f, features - f)),
                    features - f);
      }
    }
  }
}

// Runs ``epilogue(n0, n1, acc)`` over the panels in parallel, as matvec does over rows
template <typename Epilogue>
void matvec_panels(int M, const bf16* x, const Panels& w, Epilogue epilogue) {
  const PanelInput in = panel_input(M, x, w);
  at::parallel_for(0, (w.N + kPanel - 1) / kPanel, 1, [&](int64_t p0, int64_t p1) {
    const int64_t n0 = p0 * kPanel, n1 = std::min(w.N, p1 * kPanel);
    thread_local std::vector<float> acc;  // reused: a fresh MiB per call churned malloc
    acc.resize(static_cast<size_t>(M) * (n1 - n0));
    panel_rows(in, w, p0, p1, acc.data(), n1 - n0);
    epilogue(n0, n1, acc.data());
  });
}

// One 2 MiB-aligned block, asked to be backed by huge pages (see copy_to_huge_pages)
std::shared_ptr<void> huge_page_arena(size_t bytes) {
  constexpr size_t kHuge = size_t(2) << 20;
  bytes = std::max<size_t>((bytes + kHuge - 1) / kHuge * kHuge, kHuge);
  void* raw = nullptr;
  TORCH_CHECK(posix_memalign(&raw, kHuge, bytes) == 0, "out of memory for ", bytes, " bytes");
  madvise(raw, bytes, MADV_HUGEPAGE);  // advice only: regular pages still work
  return std::shared_ptr<void>(raw, std::free);
}

// Copies ``tensors`` into one 2 MiB-aligned arena the kernel asks to be backed by huge pages.
// Weight streaming is the whole cost of a decode step, and on 4 KiB pages the hardware
// prefetcher stops at every page boundary and the TLB misses every few rows: the same GEMV
// measured 27 GB/s on regular pages and 37-41 GB/s here.
std::vector<at::Tensor> copy_to_huge_pages(const std::vector<at::Tensor>& tensors) {
  constexpr size_t kAlign = 64;
  std::vector<size_t> offsets;
  size_t total = 0;
  for (const auto& t : tensors) {
    offsets.push_back(total);
    total += (t.numel() * t.element_size() + kAlign - 1) / kAlign * kAlign;
  }
  std::shared_ptr<void> arena = huge_page_arena(total);
  void* raw = arena.get();
  std::vector<at::Tensor> out;
  for (size_t i = 0; i < tensors.size(); ++i) {
    const at::Tensor src = tensors[i].contiguous().cpu();
    char* dst = static_cast<char*>(raw) + offsets[i];
    std::memcpy(dst, src.data_ptr(), src.numel() * src.element_size());
    out.push_back(at::from_blob(dst, src.sizes(), [arena](void*) {}, src.options()));
  }
  return out;
}

// grain: rows of a weight per task; small enough that both cores get work on every matrix
constexpr int64_t kGrain = 32;

// Runs ``body(n0, n1, acc)`` over [0, N) in parallel; ``acc`` holds [M, n1 - n0] dot products.
template <typename Epilogue>
void matvec(int M, const bf16* x, const at::Tensor& w, int64_t N, Epilogue epilogue,
            int64_t prefetch_bytes = 0) {
  const int64_t K = w.size(1);
  const bf16* wp = w.data_ptr<bf16>();
  const Activations xs(M, x, K, prefetch_bytes);
  at::parallel_for(0, N, kGrain, [&](int64_t n0, int64_t n1) {
    thread_local std::vector<float> acc;  // reused: a fresh MiB per call churned malloc
    acc.resize(static_cast<size_t>(M) * (n1 - n0));
    dot_rows_any(xs, wp, n0, n1, acc.data(), n1 - n0);
    epilogue(n0, n1, acc.data());
  });
}

// Fewest rows an int8 matrix runs on AMX tiles rather than its panels: a tile product costs
// two TDPs per KiB of weights at any row count (amx_gemv.h) where the panels' dot product costs
// grow with the rows. The bench decoder's matrices and lm_head, 2-core AMX Xeon, ms a pass,
// panels / tiles in turns (two runs): 1 row 6.5 / 7.2 and 7.0 / 7.7; 4 rows 7.2 / 9.0 and
// 7.5 / 8.7; 5 rows 9.1 / 9.1 and 9.8 / 8.9; 8 rows 10.7 / 9.4 and 11.4 / 10.2; 16 rows 18.3 /
// 13.8 and 18.5 / 14.7.
constexpr int kI8TileRows = 5;

// A matrix packed as AMX tiles (amx_gemv.h): the native build's GEMV on AMX CPUs. bf16, or
// int8 with its per-output-channel scales (AMX-INT8 tiles fed int16 activations).
struct TiledWeights {
  at::Tensor data;    // bf16 [N / 16, K / 32, 16, 32]; int8 [N / 16, K / 64, 16, 64]
  at::Tensor scales;  // int8: fp32 [N]
  int64_t N = 0, K = 0;
  bool int8 = false;
  bool defined() const { return data.defined(); }
};

#ifdef VS_BF16_DOT
// ``scales``: an int8 matrix's (undefined for bf16). Undefined tiles where the shape does not
// tile (or int8 without AMX-INT8): that matrix keeps its other GEMV.
TiledWeights tile_weights(const at::Tensor& w, const at::Tensor& scales = at::Tensor()) {
  TiledWeights out;
  const at::Tensor src = w.contiguous();
  const int64_t N = src.size(0), K = src.size(1);
  if (src.scalar_type() == at::kChar) {
    if (!amx::amx_int8_usable() || !amx::tileable_i8(N, K)) return out;
    out.data = at::empty({N / amx::kTileRows, K / amx::kTileKI8, amx::kTileRows, amx::kTileKI8},
                         src.options());
    amx::pack_weights_i8(src.data_ptr<int8_t>(), N, K, out.data.data_ptr<int8_t>());
    out.scales = scales.contiguous();
    out.int8 = true;
  } else {
    if (src.scalar_type() != at::kBFloat16 || !amx::tileable(N, K)) return out;
    out.data = at::empty({N / amx::kTileRows, K / amx::kTileK, amx::kTileRows, amx::kTileK},
                         src.options());
    amx::pack_weights(src.data_ptr<bf16>(), N, K, out.data.data_ptr<bf16>());
  }
  out.N = N, out.K = K;
  out.data = copy_to_huge_pages({out.data})[0];
  return out;
}

// A step's activation rows as the tiles read them, packed once per matrix input: bf16 pairs,
// or for int8 tiles the panels' int16 quantisation split into high and low bytes
struct TileInput {
  int M = 0;
  std::vector<bf16> b;       // bf16 B tiles
  std::vector<int8_t> hi;    // int8: the high bytes' B tiles
  std::vector<uint8_t> lo;   // int8: the low bytes'
  std::vector<float> lanes;  // int8: each row's scale per 256 k, as amx::scale_lanes lays out
};

TileInput tile_input(int M, const bf16* x, const TiledWeights& w) {
  TileInput in;
  in.M = M;
  if (!w.int8) {
    in.b = amx::pack_activations(M, x, w.K);
    return in;
  }
  PanelInput q;
  quantize_rows<Int16Dot>(M, x, w.K, q);  // the panels' own on AMX CPUs (panel_activation_bits)
  static_assert(kI8ChunkK == amx::kTileKI8 * amx::kChunkBlocksI8, "one scale per 256 k");
  in.hi.resize(static_cast<size_t>(M) * w.K);
  in.lo.resize(static_cast<size_t>(M) * w.K);
  static_assert(Int16Dot::kSpread == 1, "the tiles read the int16 activations as they are");
  amx::pack_activations_i8(M, reinterpret_cast<const int16_t*>(q.xq.data()),
                           q.ld_bytes / static_cast<int64_t>(sizeof(int16_t)), w.K, in.hi.data(),
                           in.lo.data());
  std::vector<float> scale(static_cast<size_t>(M) * q.chunks);
  for (int m = 0; m < M; ++m)
    for (int64_t c = 0; c < q.chunks; ++c) scale[c * M + m] = q.xs[m * q.chunks + c];
  in.lanes = amx::scale_lanes(M, scale.data(), q.chunks);
  return in;
}

// The inputs of M rows in balanced groups of at most the tiles' 16 (a tile product's B holds
// 16 activation rows): int8 tiles take any number of rows, group by group, each group one
// more read of the matrix (32 rows in two passes ran faster than the int8 panels' one)
std::vector<TileInput> tile_inputs(int M, const bf16* x, const TiledWeights& w) {
  std::vector<TileInput> out;
  const int groups = (M + amx::kMaxRows - 1) / amx::kMaxRows;
  for (int g = 0, m0 = 0; g < groups; ++g) {
    const int rows = (M - m0) / (groups - g);
    out.push_back(tile_input(rows, x + m0 * w.K, w));
    m0 += rows;
  }
  return out;
}

// acc[m * ld_acc + (n - n0)] for weight rows [n0, n1) (multiples of 16), int8 scales applied
void tile_rows(const std::vector<TileInput>& ins, const TiledWeights& w, int64_t n0, int64_t n1,
               float* acc, int64_t ld_acc) {
  for (const TileInput& in : ins) {
    if (w.int8)
      amx::dot_rows_i8(in.M, in.hi.data(), in.lo.data(), in.lanes.data(),
                       w.data.data_ptr<int8_t>(), w.scales.data_ptr<float>(), w.K, n0, n1, acc,
                       ld_acc);
    else
      amx::dot_rows(in.M, in.b.data(), w.data.data_ptr<bf16>(), w.K, n0, n1, acc, ld_acc);
    acc += in.M * ld_acc;
  }
}

// As matvec, on AMX tiles: tasks are whole 16-row tiles
template <typename Epilogue>
void matvec_tiles(int M, const bf16* x, const TiledWeights& w, Epilogue epilogue) {
  const std::vector<TileInput> ins = tile_inputs(M, x, w);
  at::parallel_for(0, w.N / amx::kTileRows, 1, [&](int64_t t0, int64_t t1) {
    const int64_t n0 = t0 * amx::kTileRows, n1 = t1 * amx::kTileRows;
    thread_local std::vector<float> acc;
    acc.resize(static_cast<size_t>(M) * (n1 - n0));
    tile_rows(ins, w, n0, n1, acc.data(), n1 - n0);
    epilogue(n0, n1, acc.data());
  });
}
#endif

// out = weight * bf16(x * rsqrt(mean(x^2) + eps)), both products rounded as eager bf16 does
void rms_norm(const bf16* x, const bf16* weight, bf16* out, int64_t H, float eps) {
  vf ss = vs::zero();
  for (int64_t i = 0; i < H; i += 16) {
    const vf v = vs::load_bf16(x + i, H - i);
    ss = vs::fmadd(v, v, ss);
  }
  const vf r = vs::set1(1.0f / std::sqrt(vs::reduce_add(ss) / H + eps));
  for (int64_t i = 0; i < H; i += 16) {
    const int64_t k = H - i;
    const vf y = round_bf16(vs::mul(vs::load_bf16(x + i, k), r));
    vs::store_bf16(out + i, vs::mul(vs::load_bf16(weight + i, k), y), k);
  }
}

// Split-K decode attention ("flash-decoding") over the paged cache: a task is one row's keys
// [i0, i1) for all heads, so each cache slot (all KV heads, contiguous) is read whole, once,
// and a single long context still spreads over every core. Each task leaves per-head partial
// softmax results (max, sum, unnormalised output) that are merged afterwards.
// q: M rows of H heads x D (row stride q_stride); out: [M, H, D]; caches: [slots, KVH, D].
// The query as key_scores reads it: bf16 pairs with the dot product (one vector per 32 elements);
// emulated, widened once per row to fp32 (its even and odd elements: two vectors)
#ifdef VS_BF16_DOT
constexpr int64_t kQWords = 1;
#else
constexpr int64_t kQWords = 2;
#endif

// part[h * 16 + t] = 16 partial sums of q_h . k_t for the 16 keys of a tile, for query heads
// g0 .. g0 + G - 1 (G <= 8) of every KV head (heads_per_kv of them per KV head; q: kQWords
// vectors per 32 elements, nc per head). Key by key, every KV head's slice in turn: the reads
// walk each cache row front to back (KV head by KV head over the tile read 14 GB/s).
template <int G>
void key_scores_fixed(const bf16* const* keys, const bf16* const* next, int64_t kv_heads,
                      int64_t D, int64_t heads_per_kv, int64_t g0, int64_t nc, int64_t last,
                      const vf* qs, vf* part) {
  const int64_t row_bytes = kv_heads * D * 2;
  for (int t = 0; t < 16; ++t) {
    if (next != nullptr)  // the next tile's key t, one line per line read here
      for (int64_t b = 0; b < row_bytes; b += 64)
        __builtin_prefetch(reinterpret_cast<const char*>(next[t]) + b);
    for (int64_t kvh = 0; kvh < kv_heads; ++kvh) {
      const int64_t h0 = kvh * heads_per_kv + g0;
      const vf* q = qs + h0 * nc * kQWords;
      vf acc[G];
      for (int g = 0; g < G; ++g) acc[g] = vs::zero();
      for (int64_t c = 0; c < nc; ++c) {
        const vs::vpair kv = vs::load_pairs(keys[t] + kvh * D + 32 * c, c == nc - 1 ? last : 32);
#ifdef VS_BF16_DOT
        for (int g = 0; g < G; ++g)
          acc[g] = vs::dot_pairs(acc[g], kv, vs::vf_as_pairs(q[g * nc + c]));
#else
        vf k_even, k_odd;
        vs::widen_pairs(kv, k_even, k_odd);
        for (int g = 0; g < G; ++g) {
          const vf* qg = q + (g * nc + c) * 2;
          acc[g] = vs::fmadd(k_odd, qg[1], vs::fmadd(k_even, qg[0], acc[g]));
        }
#endif
      }
      for (int g = 0; g < G; ++g) part[(h0 + g) * 16 + t] = acc[g];
    }
  }
}

// query heads per pass of key_scores: their accumulators plus a key's two halves in registers
constexpr int64_t kHeadsPerPass = vs::kVecRegs >= 32 ? 8 : 4;

void key_scores(int64_t G, const bf16* const* keys, const bf16* const* next, int64_t kv_heads,
                int64_t D, int64_t heads_per_kv, int64_t g0, int64_t nc, int64_t last,
                const vf* qs, vf* part) {
#define VS_KEY_SCORES(GG) \
  key_scores_fixed<GG>(keys, next, kv_heads, D, heads_per_kv, g0, nc, last, qs, part)
  switch (G) {
    case 1: return VS_KEY_SCORES(1);
    case 2: return VS_KEY_SCORES(2);
    case 3: return VS_KEY_SCORES(3);
    case 4: return VS_KEY_SCORES(4);
    case 5: return VS_KEY_SCORES(5);
    case 6: return VS_KEY_SCORES(6);
    case 7: return VS_KEY_SCORES(7);
    default: return VS_KEY_SCORES(8);
  }
#undef VS_KEY_SCORES
}

// out[g][:] = sum_j probs[g][j] * v_j over the n slots, for the G query heads sharing one KV
// head (probs[g] is a row of length ld). Templated on the accumulator count so they stay in
// registers (head size <= 128: ND <= 8 slices of 16).
template <int G, int ND>
void weigh_values_fixed(const float* probs, int64_t ld, const bf16* v0, int64_t kv_size,
                        const int64_t* slots, int64_t n, int64_t visible, float* out) {
  vf acc[G][ND];
  for (int g = 0; g < G; ++g)
    for (int d = 0; d < ND; ++d) acc[g][d] = vs::load(out + (g * ND + d) * 16);
  // two cores' demand misses alone read ~14 GB/s, and the hardware prefetcher stops at every
  // 4 KiB page and cache block: the rows 32 keys ahead (up to ``visible``) are asked for
  // (8 keys ahead: 1.24 ms a layer at batch 16 and 1,400 keys; 32: 1.14)
  constexpr int64_t kAhead = 32;
  for (int64_t j = 0; j < n; ++j) {
    const bf16* v = v0 + slots[j] * kv_size;
    if (j + kAhead < visible) {
      const char* next = reinterpret_cast<const char*>(v0 + slots[j + kAhead] * kv_size);
      for (int d = 0; d < ND; d += 2) __builtin_prefetch(next + d * 32);
    }
    vf p[G];
    for (int g = 0; g < G; ++g) p[g] = vs::set1(probs[g * ld + j]);
    for (int d = 0; d < ND; ++d) {
      const vf vv = vs::load_bf16(v + 16 * d);
      for (int g = 0; g < G; ++g) acc[g][d] = vs::fmadd(p[g], vv, acc[g][d]);
    }
  }
  for (int g = 0; g < G; ++g)
    for (int d = 0; d < ND; ++d) vs::store(out + (g * ND + d) * 16, acc[g][d]);
}

template <int ND>
void weigh_values_nd(int64_t g, const float* probs, int64_t ld, const bf16* v0, int64_t kv_size,
                     const int64_t* slots, int64_t n, int64_t visible, float* out) {
  switch (g) {
    case 1: return weigh_values_fixed<1, ND>(probs, ld, v0, kv_size, slots, n, visible, out);
    case 2: return weigh_values_fixed<2, ND>(probs, ld, v0, kv_size, slots, n, visible, out);
    case 3: return weigh_values_fixed<3, ND>(probs, ld, v0, kv_size, slots, n, visible, out);
    case 4: return weigh_values_fixed<4, ND>(probs, ld, v0, kv_size, slots, n, visible, out);
    case 5: return weigh_values_fixed<5, ND>(probs, ld, v0, kv_size, slots, n, visible, out);
    case 6: return weigh_values_fixed<6, ND>(probs, ld, v0, kv_size, slots, n, visible, out);
    case 7: return weigh_values_fixed<7, ND>(probs, ld, v0, kv_size, slots, n, visible, out);
    default: return weigh_values_fixed<8, ND>(probs, ld, v0, kv_size, slots, n, visible, out);
  }
}

void weigh_values(int64_t G, int64_t nd, const float* probs, int64_t ld, const bf16* v0,
                  int64_t kv_size, const int64_t* slots, int64_t n, int64_t visible, float* out) {
  // accumulators per pass over the slots: three quarters of the register file (24 of 32
  // AVX-512 registers)
  constexpr int64_t kBudget = vs::kVecRegs * 3 / 4;
  const int64_t per_pass = std::max<int64_t>(1, std::min<int64_t>({G, kBudget / nd, 8}));
  for (int64_t g0 = 0; g0 < G; g0 += per_pass) {
    const int64_t g = std::min(per_pass, G - g0);
    const float* pg = probs + g0 * ld;
    float* og = out + g0 * nd * 16;
    switch (nd) {
      case 1: weigh_values_nd<1>(g, pg, ld, v0, kv_size, slots, n, visible, og); break;
      case 2: weigh_values_nd<2>(g, pg, ld, v0, kv_size, slots, n, visible, og); break;
      case 3: weigh_values_nd<3>(g, pg, ld, v0, kv_size, slots, n, visible, og); break;
      case 4: weigh_values_nd<4>(g, pg, ld, v0, kv_size, slots, n, visible, og); break;
      case 5: weigh_values_nd<5>(g, pg, ld, v0, kv_size, slots, n, visible, og); break;
      case 6: weigh_values_nd<6>(g, pg, ld, v0, kv_size, slots, n, visible, og); break;
      case 7: weigh_values_nd<7>(g, pg, ld, v0, kv_size, slots, n, visible, og); break;
      default: weigh_values_nd<8>(g, pg, ld, v0, kv_size, slots, n, visible, og); break;
    }
  }
}

void paged_decode_attention(int M, const bf16* q, int64_t q_stride, bf16* out, int64_t H,
                            int64_t KVH, int64_t D, const bf16* kc, const bf16* vc,
                            const int64_t* tab, const int64_t* len, int64_t max_blocks,
                            int64_t block_size, float scale) {
    const int64_t G = H / KVH, kv_size = KVH * D, nd = D / 16, nc = (D + 31) / 32;
    const int64_t last = D % 32 ? D % 32 : 32;  // elements in a head's last 32-element chunk

    // splits per row: enough tasks for every thread, none shorter than kMinSplit keys
    constexpr int64_t kMinSplit = 128;
    const int64_t threads = at::get_num_threads();
    std::vector<int64_t> first_task(M + 1, 0), splits(M);
    for (int m = 0; m < M; ++m) {
      const int64_t want = (2 * threads + M - 1) / M;
      splits[m] = std::max<int64_t>(1, std::min(want, len[m] / kMinSplit));
      first_task[m + 1] = first_task[m] + splits[m];
    }
    const int64_t tasks = first_task[M];
    std::vector<float> part_max(tasks * H), part_sum(tasks * H), part_out(tasks * H * D);

    at::parallel_for(0, tasks, 1, [&](int64_t t0, int64_t t1) {
      std::vector<float> scores;
      std::vector<int64_t> slots;
      std::vector<vf> qs(H * nc * kQWords), part(H * 16);
      for (int64_t task = t0; task < t1; ++task) {
        const int64_t m = std::upper_bound(first_task.begin(), first_task.end(), task) -
                          first_task.begin() - 1;
        const int64_t split = task - first_task[m], ctx = len[m];
        const int64_t i0 = ctx * split / splits[m], i1 = ctx * (split + 1) / splits[m];
        const int64_t n = i1 - i0, padded = (n + 15) / 16 * 16;
        const bf16* row = q + m * q_stride;
        for (int64_t h = 0; h < H; ++h)
          for (int64_t c = 0; c < nc; ++c) {
            const vs::vpair pairs = vs::load_pairs(row + h * D + 32 * c, c == nc - 1 ? last : 32);
#ifdef VS_BF16_DOT
            qs[h * nc + c] = vs::pairs_as_vf(pairs);
#else
            vs::widen_pairs(pairs, qs[(h * nc + c) * 2], qs[(h * nc + c) * 2 + 1]);
#endif
          }
        slots.resize(n);  // walk the block table once, no division per key
        for (int64_t i = i0, b = i0 / block_size, off = i0 % block_size; i < i1; ++i) {
          slots[i - i0] = tab[m * max_blocks + b] * block_size + off;
          if (++off == block_size) off = 0, ++b;
        }
        // scores[h][j]: 16 keys at a time. Each key's slice for a KV head is loaded (and,
        // emulated, widened) once for the query heads that share it; hsum16 then reduces a
        // head's 16 keys together
        scores.resize(H * padded);
        for (int64_t j0 = 0; j0 < n; j0 += 16) {
          const int64_t cnt = std::min<int64_t>(16, n - j0);
          const bf16* keys[16];
          for (int64_t t = 0; t < 16; ++t)  // a short last tile repeats its last key
            keys[t] = kc + slots[j0 + std::min(t, cnt - 1)] * kv_size;
          const bf16* next[16];
          const bool has_next = j0 + 16 < n;  // the next tile's keys, asked for while these run
          for (int64_t t = 0; t < 16 && has_next; ++t)
            next[t] = kc + slots[std::min(j0 + 16 + t, n - 1)] * kv_size;
          for (int64_t g0 = 0; g0 < G; g0 += kHeadsPerPass)
            key_scores(std::min<int64_t>(kHeadsPerPass, G - g0), keys, has_next && g0 == 0 ? next : nullptr,
                       KVH, D, G, g0, nc, last, qs.data(), part.data());
          for (int64_t h = 0; h < H; ++h) {
            float* dst = scores.data() + h * padded + j0;
            vs::store(dst, vs::mul(hsum16(part.data() + h * 16), vs::set1(scale)));
            for (int64_t t = cnt; t < 16; ++t) dst[t] = -INFINITY;
          }
        }
        // softmax numerators (kept in scores) and this split's max and sum per head
        for (int64_t h = 0; h < H; ++h) {
          float* sc = scores.data() + h * padded;
          vf mx = vs::set1(-INFINITY);
          for (int64_t j = 0; j < padded; j += 16) mx = vs::max(mx, vs::load(sc + j));
          const float top = vs::reduce_max(mx);
          vf sum = vs::zero();
          for (int64_t j = 0; j < padded; j += 16) {
            const vf e = vs::exp(vs::sub(vs::load(sc + j), vs::set1(top)));
            vs::store(sc + j, e);
            sum = vs::add(sum, e);
          }
          part_max[task * H + h] = top;
          part_sum[task * H + h] = vs::reduce_add(sum);
        }
        // weighted values, one KV head's group of query heads at a time: its G x nd
        // accumulators stay in registers (all heads' would not: every FMA was a load and a
        // store, and a batch-16 step at 1,200 keys spent 1.5 ms per layer here). Tiles of 64
        // keys, every KV head per tile: each pass reads a few contiguous KiB of the cache
        // rather than 128 bytes of every row over the whole context (14 GB/s from memory)
        float* acc_out = part_out.data() + task * H * D;
        std::fill(acc_out, acc_out + H * D, 0.f);
        constexpr int64_t kValueTile = 64;
        for (int64_t j0 = 0; j0 < n; j0 += kValueTile)
          for (int64_t kvh = 0; kvh < KVH; ++kvh)
            weigh_values(G, nd, scores.data() + kvh * G * padded + j0, padded, vc + kvh * D,
                         kv_size, slots.data() + j0, std::min(kValueTile, n - j0), n - j0,
                         acc_out + kvh * G * D);
      }
    });

    // merge the splits of each (row, head) by their maxima
    for (int m = 0; m < M; ++m)
      for (int64_t h = 0; h < H; ++h) {
        float top = -INFINITY;
        for (int64_t t = first_task[m]; t < first_task[m + 1]; ++t)
          top = std::max(top, part_max[t * H + h]);
        float total = 0.f;
        std::vector<float> acc(D, 0.f);
        for (int64_t t = first_task[m]; t < first_task[m + 1]; ++t) {
          const float w = std::exp(part_max[t * H + h] - top);
          total += w * part_sum[t * H + h];
          const float* po = part_out.data() + (t * H + h) * D;
          for (int64_t d = 0; d < D; ++d) acc[d] += w * po[d];
        }
        bf16* dst = out + m * H * D + h * D;
        for (int64_t d = 0; d < D; ++d) dst[d] = bf16(acc[d] / total);
      }
  }

// Rows of a fused step as the attention takes them: a run of at least kChunkRows rows with
// one block table and consecutive context lengths is a prompt chunk (its rows are tokens
// len - n .. len - 1 of one sequence) and attends as a block through the flash kernel; the
// other rows (decodes, single prompt rows) one by one through paged_decode_attention. The
// block pays off from 2 rows: 4 chat decodes + k camera prompt rows at 800 keys, the step's
// time over the decodes' alone, with the block from 8 rows / from 2 (2-core AMX Xeon, two
// builds in turns, twice each): k = 2 +3.1-3.3 / +2.7-3.2 ms, k = 4 +5.1-5.6 / +3.1-3.3,
// k = 8 +4.6-5.0 / +4.1-4.6. Beside chat a camera prompt gets a few rows a step, so most of
// its chunks are this small.
struct AttentionSegment {
  int m0, rows;
  bool chunk;
};
constexpr int kChunkRows = 2;

std::vector<AttentionSegment> attention_segments(int M, const int64_t* tab, int64_t max_blocks,
                                                 const int64_t* len) {
  std::vector<AttentionSegment> out;
  auto same_chunk = [&](int a, int b) {
    return len[b] == len[a] + 1 &&
           std::memcmp(tab + a * max_blocks, tab + b * max_blocks, max_blocks * sizeof(int64_t)) == 0;
  };
  for (int m = 0; m < M;) {
    int end = m + 1;
    while (end < M && same_chunk(end - 1, end)) ++end;
    const bool chunk = end - m >= kChunkRows;
    if (!chunk && !out.empty() && !out.back().chunk) out.back().rows += end - m;  // merge rows
    else out.push_back({m, end - m, chunk});
    m = end;
  }
  return out;
}

// q [rows, H, D] and the caches [slots, KVH, D] as the attention kernels take them
void check_attention_inputs(const at::Tensor& q, const at::Tensor& k_cache,
                            const at::Tensor& v_cache) {
  TORCH_CHECK(q.dim() == 3 && q.scalar_type() == at::kBFloat16, "q: bf16 [rows, H, D]");
  TORCH_CHECK(k_cache.dim() == 3 && k_cache.scalar_type() == at::kBFloat16 &&
                  k_cache.is_contiguous() && v_cache.is_contiguous() &&
                  k_cache.sizes() == v_cache.sizes(),
              "caches: contiguous bf16 [slots, KVH, D]");
  const int64_t H = q.size(1), D = q.size(2), KVH = k_cache.size(1);
  TORCH_CHECK(k_cache.size(2) == D && KVH > 0 && H % KVH == 0 && D % 16 == 0 && D <= 128,
              "head shapes");
}

// The same for a decode batch of a mixed step (the eager forward's decode rows): q [M, H, D],
// caches [slots, KVH, D], block_tables [M, max_blocks], context_lens [M] (incl. the new token,
// already written). Returns [M, H, D] bf16.
at::Tensor decode_attention(const at::Tensor& q_in, const at::Tensor& k_cache,
                            const at::Tensor& v_cache, const at::Tensor& block_tables,
                            const at::Tensor& context_lens, int64_t block_size, double scale) {
  check_attention_inputs(q_in, k_cache, v_cache);
  const at::Tensor q = q_in.contiguous();
  const at::Tensor tables = block_tables.to(at::kLong).contiguous();
  const at::Tensor lens = context_lens.to(at::kLong).contiguous();
  const int M = static_cast<int>(q.size(0));
  const int64_t H = q.size(1), D = q.size(2), KVH = k_cache.size(1);
  TORCH_CHECK(tables.size(0) == M && lens.size(0) == M, "one table and length per row");
  const int64_t* len = lens.data_ptr<int64_t>();
  for (int m = 0; m < M; ++m)
    TORCH_CHECK(len[m] >= 1 && (len[m] - 1) / block_size < tables.size(1), "context length");
  at::Tensor out = at::empty_like(q);
  if (M == 0) return out;
  paged_decode_attention(M, q.data_ptr<bf16>(), H * D, out.data_ptr<bf16>(), H, KVH, D,
                         k_cache.data_ptr<bf16>(), v_cache.data_ptr<bf16>(),
                         tables.data_ptr<int64_t>(), len, tables.size(1), block_size,
                         static_cast<float>(scale));
  return out;
}

// oneDNN's matmul on a weight PyTorch prepacked (torch.ops.mkldnn._reorder_linear_weight), the
// kernel the eager path uses: past a few rows a step is compute-bound and oneDNN's blocked
// GEMM (AMX where the CPU has it) beats a row-wise dot product. Called through the dispatcher,
// boxed, so no Python sits between it and the rest of the step.
at::Tensor onednn_linear(const at::Tensor& x, const at::Tensor& packed) {
  static const c10::OperatorHandle op =
      c10::Dispatcher::singleton().findSchemaOrThrow("mkldnn::_linear_pointwise", "");
  torch::jit::Stack stack;
  stack.emplace_back(x);
  stack.emplace_back(packed);
  stack.emplace_back(c10::IValue());  // bias: added by the epilogue, as on the GEMV path
  stack.emplace_back(std::string("none"));
  stack.emplace_back(c10::List<std::optional<at::Scalar>>());
  stack.emplace_back(c10::IValue());
  op.callBoxed(&stack);
  return stack[0].toTensor();
}

struct LayerWeights {
  at::Tensor ln1, qkv_w, qkv_b, o_w, ln2, gate_up_w, down_w, k_cache, v_cache;
  at::Tensor qkv_p, o_p, gate_up_p, down_p;  // oneDNN-packed copies, or undefined
  at::Tensor qkv_s, o_s, gate_up_s, down_s;  // int8 weights: per-output-channel scales
  Panels qkv_n, o_n, gate_n, up_n, down_n;    // the GEMV's panels (int8; bf16 emulated)
  TiledWeights qkv_t, o_t, gate_up_t, down_t;  // AMX tiles (set_amx_gemv), or undefined
};

// a decoder matrix: bf16, or int8 with fp32 scales [N]
void check_matrix(const at::Tensor& w, const at::Tensor& scales, const char* what) {
  TORCH_CHECK(w.dim() == 2 && w.is_contiguous(), what, ": a contiguous 2-d weight");
  if (w.scalar_type() == at::kChar) {
    TORCH_CHECK(scales.defined() && scales.scalar_type() == at::kFloat && scales.dim() == 1 &&
                    scales.size(0) == w.size(0) && scales.is_contiguous(),
                what, ": int8 weights need contiguous fp32 scales, one per output channel");
  } else {
    TORCH_CHECK(w.scalar_type() == at::kBFloat16, what, ": weights must be bf16 or int8");
  }
}

class FusedDecoder {
 public:
  // layers: per layer [ln1, qkv_w, qkv_b, o_w, ln2, gate_up_w, down_w, k_cache, v_cache] and,
  // optionally, oneDNN-packed [qkv, o, gate_up, down] (then lm_head_packed too): steps of more
  // than gemv_max_rows rows use those; without them the decoder takes at most kMaxGemvRows.
  // Weight-only int8: any of qkv_w, o_w, gate_up_w, down_w and lm_head may be int8 [N, K]
  // (not packed), with ``scales`` holding per layer [qkv, o, gate_up, down] and then the
  // lm_head's fp32 per-output-channel scales (an empty tensor where a matrix is bf16). int8
  // matrices always run the panel GEMV (built here), for any number of rows.
  FusedDecoder(std::vector<std::vector<at::Tensor>> layers, at::Tensor final_norm,
               at::Tensor lm_head, std::optional<at::Tensor> lm_head_packed, int64_t num_heads,
               int64_t num_kv_heads, int64_t head_dim, double eps, int64_t gemv_max_rows,
               std::optional<std::vector<at::Tensor>> scales, int64_t weight_prefetch)
      : final_norm_(final_norm.contiguous()),
        lm_head_(lm_head.contiguous()),
        lm_head_p_(lm_head_packed.value_or(at::Tensor())),
        gemv_max_rows_(std::min<int64_t>(gemv_max_rows, kMaxGemvRows)),
        num_heads_(num_heads),
        num_kv_heads_(num_kv_heads),
        head_dim_(head_dim),
        eps_(static_cast<float>(eps)) {
    set_weight_prefetch(weight_prefetch);
    TORCH_CHECK(num_heads % num_kv_heads == 0, "heads must be a multiple of KV heads");
    TORCH_CHECK(head_dim % 16 == 0 && head_dim <= 128, "head_dim must be 16..128, step 16");
    const std::vector<at::Tensor> sc = scales.value_or(std::vector<at::Tensor>());
    TORCH_CHECK(sc.empty() || sc.size() == 4 * layers.size() + 1,
                "scales: 4 per layer and the lm_head's, or none");
    auto scale = [&](size_t i) { return sc.empty() ? at::Tensor() : sc[i]; };
    // weights are expected on huge pages already (copy_to_huge_pages); caches are the
    // engine's own tensors, written in place
    for (size_t l = 0; l < layers.size(); ++l) {
      const auto& t = layers[l];
      TORCH_CHECK(t.size() == 9 || t.size() == 13, "each layer needs 9 or 13 tensors");
      for (size_t i : {0, 2, 4, 7, 8})
        TORCH_CHECK(t[i].scalar_type() == at::kBFloat16 && t[i].is_contiguous(),
                    "fused decode needs contiguous bf16 norms, bias and caches");
      LayerWeights w{t[0], t[1], t[2], t[3], t[4], t[5], t[6], t[7], t[8]};
      w.qkv_s = scale(4 * l), w.o_s = scale(4 * l + 1);
      w.gate_up_s = scale(4 * l + 2), w.down_s = scale(4 * l + 3);
      check_matrix(w.qkv_w, w.qkv_s, "qkv");
      check_matrix(w.o_w, w.o_s, "o_proj");
      check_matrix(w.gate_up_w, w.gate_up_s, "gate_up");
      check_matrix(w.down_w, w.down_s, "down");
      if (t.size() == 13) w.qkv_p = t[9], w.o_p = t[10], w.gate_up_p = t[11], w.down_p = t[12];
      layers_.push_back(w);
    }
    lm_head_s_ = scale(4 * layers.size());
    check_matrix(lm_head_, lm_head_s_, "lm_head");
    packed_ = lm_head_p_.defined();
    int8_ = lm_head_.scalar_type() == at::kChar;
    for (auto& w : layers_) {
      TORCH_CHECK(w.qkv_p.defined() == packed_, "packed weights: all or none");
      const bool i8 = w.qkv_w.scalar_type() == at::kChar;
      TORCH_CHECK(i8 == int8_ && w.o_w.scalar_type() == w.qkv_w.scalar_type() &&
                      w.gate_up_w.scalar_type() == w.qkv_w.scalar_type() &&
                      w.down_w.scalar_type() == w.qkv_w.scalar_type(),
                  "int8 weights: every decoder matrix and the lm_head, or none");
    }
    TORCH_CHECK(!(int8_ && packed_), "int8 weights are not oneDNN-packed");
    TORCH_CHECK(!layers_.empty(), "no layers");
    hidden_ = lm_head_.size(1);
    vocab_ = lm_head_.size(0);
    qkv_size_ = (num_heads + 2 * num_kv_heads) * head_dim;
    intermediate_ = layers_[0].down_w.size(1);
    TORCH_CHECK(layers_[0].qkv_w.size(0) == qkv_size_, "qkv weight shape");
    const bool bf16_panels = hidden_ % 2 == 0 && intermediate_ % 2 == 0 && qkv_size_ % 2 == 0;
    if (int8_ || bf16_panels) build_panels();
    panels_ = int8_ || bf16_panels;
  }

  // How far ahead this decoder's row-major GEMV (native build) asks for weights; its own, so
  // two engines in one process (a benchmark timing two plans in turns) keep theirs
  void set_weight_prefetch(int64_t bytes) {
    TORCH_CHECK(bytes >= 0 && bytes <= (int64_t(1) << 20), "weight prefetch distance ", bytes);
    weight_prefetch_ = bytes;
  }
  int64_t weight_prefetch() const { return weight_prefetch_; }

  // The GEMV's rows on AMX tiles (amx_gemv.h) instead of the dot product (bf16) or, from
  // kI8TileRows rows, the panels (int8): the platform plan asks for it on AMX CPUs. Returns
  // whether it is on: never on a CPU or OS without AMX or in builds without the bf16 dot
  // product. The tiles are one more copy of the decoder weights, made on the first enable: the
  // row-major ones stay (the eager path reads them), and so do int8 panels (fewer rows).
  bool set_amx_gemv(bool enable) {
#ifdef VS_BF16_DOT
    // the tiles are laid out from the row-major weights: none once those are gone
    amx_gemv_ = enable && (int8_ || row_major_) &&
                (int8_ ? amx::amx_int8_usable() : amx::amx_usable());
    if (amx_gemv_ && !tiled_) {
      for (auto& L : layers_) {
        L.qkv_t = tile_weights(L.qkv_w, L.qkv_s), L.o_t = tile_weights(L.o_w, L.o_s);
        // gate and up are tiled apart only where a tile holds no row of both
        if (intermediate_ % amx::kTileRows == 0)
          L.gate_up_t = tile_weights(L.gate_up_w, L.gate_up_s);
        L.down_t = tile_weights(L.down_w, L.down_s);
      }
      lm_head_t_ = tile_weights(lm_head_, lm_head_s_);
      tiled_ = true;
      if (!int8_ && packed_) {
        // bf16 tiles take every row count the panels would (oneDNN the rest): their copy goes
        for (auto& L : layers_) L.qkv_n = L.o_n = L.gate_n = L.up_n = L.down_n = Panels();
        lm_head_n_ = Panels();
        panels_ = false;
      }
    }
#else
    amx_gemv_ = false;
#endif
    return amx_gemv_;
  }
  bool amx_gemv() const { return amx_gemv_; }

  // Lets the row-major bf16 matrices go; the panels take every row count up to the GEMV's
  // limit, 1-row steps included. The native build otherwise holds the decoder's weights three
  // times: row-major (the 1-row dot-product GEMV), panels (2 rows up) and oneDNN's packing
  // (steps past the GEMV's rows); on a 2B-class decoder the row-major copy is 3 GB. The
  // platform plan asks for it where the row-major kernel has no tuned weight prefetch (Zen 4:
  // 1-row steps 2-4 % slower on panels, see kPanelRows). Only where every matrix has bf16
  // panels and oneDNN's packing, and not on AMX tiles (laid out from the row-major copy).
  // The caller drops its own references too: the copy is freed when the last one goes.
  // Returns whether the copy is gone.
  bool drop_row_major() {
    if (!row_major_) return true;
    if (int8_ || !panels_ || !packed_ || tiled_) return false;
    for (auto& L : layers_) L.qkv_w = L.o_w = L.gate_up_w = L.down_w = at::Tensor();
    lm_head_ = at::Tensor();
    panel_min_rows_ = 1;
    row_major_ = false;
    return true;
  }
  bool row_major() const { return row_major_; }

  // Prompt chunks' attention on AMX tiles (amx_attention.h) instead of the dot product: the
  // platform plan asks for it on AMX CPUs. Returns whether it is on (never without AMX).
  bool set_amx_attention(bool enable) {
    amx_attention_ = enable && amx_attention_usable();
    return amx_attention_;
  }
  bool amx_attention() const { return amx_attention_; }

  // Most rows one forward takes: the row-major dot-product kernel holds at most kMaxGemvRows;
  // panels and oneDNN's packed GEMM take any number
  int64_t max_rows() const { return packed_ || panels_ ? kAnyRows : kMaxGemvRows; }
  // prompts whose packed keys and values are kept between steps (tests read it)
  int64_t kept_contexts() const { return static_cast<int64_t>(contexts_.size()); }
  // a prompt's prefill ended or will start over: its kept packing goes
  void forget_context(int64_t key) { contexts_.erase(key); }
  static constexpr int64_t kAnyRows = int64_t(1) << 20;

  // hidden: [B, H] input embeddings; cos, sin: [B, D]; block_tables: [B, max_blocks];
  // context_lens: [B] tokens in each request's context including the new one.
  // Returns fp32 logits [B, vocab].
  // ``logit_rows``: the rows whose logits are wanted (a step's prompt rows other than a
  // chunk's last sample nothing), in the order returned; none: every row. At 16 prompt rows
  // the lm_head over all of them was a third of the step.
  // ``context_keys`` ([B] int64, optional): per row, a key (> 0) naming its prompt across the
  // steps that prefill it (0: none). A chunk with a key keeps its layers' packed keys and
  // values for the next chunk of the same key (see PackedKeys) until forget_context(key). A key
  // must name one sequence whose computed tokens keep their values: a caller starts a new key
  // when it recomputes them.
  at::Tensor forward(const at::Tensor& embeds, const at::Tensor& cos, const at::Tensor& sin,
                     const at::Tensor& block_tables, const at::Tensor& context_lens,
                     int64_t block_size, std::optional<at::Tensor> logit_rows,
                     std::optional<at::Tensor> context_keys) {
    const int M = static_cast<int>(embeds.size(0));
    TORCH_CHECK(M >= 1 && M <= max_rows(), "this build's weights take 1..", max_rows(),
                " rows");
    const int64_t H = hidden_, D = head_dim_, I = intermediate_;
    const int64_t q_size = num_heads_ * D;
    at::Tensor x_t = embeds.to(at::kBFloat16).contiguous().clone();
    at::Tensor cos_t = cos.to(at::kBFloat16).contiguous();
    at::Tensor sin_t = sin.to(at::kBFloat16).contiguous();
    at::Tensor tables = block_tables.to(at::kLong).contiguous();
    at::Tensor lens = context_lens.to(at::kLong).contiguous();
    auto opts = embeds.options().dtype(at::kBFloat16);
    at::Tensor h_t = at::empty({M, H}, opts);
    at::Tensor qkv_t = at::empty({M, qkv_size_}, opts);
    at::Tensor attn_t = at::empty({M, q_size}, opts);
    bf16* x = x_t.data_ptr<bf16>();
    bf16* h = h_t.data_ptr<bf16>();
    bf16* qkv = qkv_t.data_ptr<bf16>();
    bf16* attn = attn_t.data_ptr<bf16>();
    const int64_t* tab = tables.data_ptr<int64_t>();
    const int64_t* len = lens.data_ptr<int64_t>();
    const int64_t max_blocks = tables.size(1);
    for (int m = 0; m < M; ++m)
      TORCH_CHECK(len[m] >= 1 && (len[m] - 1) / block_size < max_blocks, "context length");

    std::vector<int64_t> new_slot(M);
    for (int m = 0; m < M; ++m) {
      const int64_t pos = len[m] - 1;
      new_slot[m] = tab[m * max_blocks + pos / block_size] * block_size + pos % block_size;
    }
    // the attention's segments, and each chunk's context as cache slots (every layer's)
    const std::vector<AttentionSegment> segments = attention_segments(M, tab, max_blocks, len);
    std::vector<std::vector<int64_t>> chunk_slots(segments.size());
    at::Tensor keys_t;
    const int64_t* keys = nullptr;
    if (context_keys.has_value()) {
      keys_t = context_keys->to(at::kLong).contiguous();
      TORCH_CHECK(keys_t.dim() == 1 && keys_t.size(0) == M, "context_keys: one per row");
      keys = keys_t.data_ptr<int64_t>();
    }
    std::vector<ChunkContext*> chunk_kept(segments.size(), nullptr);
    std::vector<int64_t> chunk_reuse(segments.size(), 0);
    for (size_t s = 0; s < segments.size(); ++s) {
      if (!segments[s].chunk) continue;
      const int64_t last = segments[s].m0 + segments[s].rows - 1, m = len[last];
      chunk_slots[s].resize(m);
      for (int64_t j = 0; j < m; ++j)
        chunk_slots[s][j] = tab[last * max_blocks + j / block_size] * block_size + j % block_size;
      chunk_kept[s] = chunk_context(keys, last, chunk_slots[s], segments[s].rows, &chunk_reuse[s]);
    }

    auto norm_rows = [&](const bf16* weight) {
      at::parallel_for(0, M, 4, [&](int64_t m0, int64_t m1) {
        for (int64_t m = m0; m < m1; ++m) rms_norm(x + m * H, weight, h + m * H, H, eps_);
      });
    };
    auto add_to_residual = [&](int64_t n0, int64_t n1, const float* acc) {
      for (int m = 0; m < M; ++m)
        for (int64_t n = n0; n < n1; n += 16) {
          const int64_t k = n1 - n;
          const vf y = round_bf16(vs::load(acc + m * (n1 - n0) + n - n0, k));
          vs::store_bf16(x + m * H + n, vs::add(vs::load_bf16(x + m * H + n, k), y), k);
        }
    };
    at::Tensor act_t = at::empty({M, I}, opts);
    bf16* act = act_t.data_ptr<bf16>();

    for (size_t li = 0; li < layers_.size(); ++li) {
      const LayerWeights& L = layers_[li];
      norm_rows(L.ln1.data_ptr<bf16>());
      const bf16* bias = L.qkv_b.data_ptr<bf16>();
      linear(M, h_t, L.qkv_w, L.qkv_p, L.qkv_n, L.qkv_t, qkv_size_, [&](int64_t n0, int64_t n1, const float* acc) {
        for (int m = 0; m < M; ++m)
          for (int64_t n = n0; n < n1; n += 16) {
            const int64_t k = n1 - n;
            const vf y = vs::load(acc + m * (n1 - n0) + n - n0, k);
            vs::store_bf16(qkv + m * qkv_size_ + n, vs::add(y, vs::load_bf16(bias + n, k)), k);
          }
      });
      rotary_and_store(M, qkv, cos_t.data_ptr<bf16>(), sin_t.data_ptr<bf16>(), L, new_slot);
      const float scale = 1.0f / std::sqrt(float(head_dim_));
      for (size_t s = 0; s < segments.size(); ++s) {
        const AttentionSegment& g = segments[s];
        if (g.chunk) {
          attend_cached_chunk(qkv + g.m0 * qkv_size_, qkv_size_, attn + g.m0 * q_size, q_size,
                              g.rows, num_heads_, L.k_cache.data_ptr<bf16>(),
                              L.v_cache.data_ptr<bf16>(), num_kv_heads_, head_dim_,
                              chunk_slots[s].data(), int64_t(chunk_slots[s].size()), scale,
                              chunk_kept[s] ? &chunk_kept[s]->layers[li] : nullptr, chunk_reuse[s],
                              amx_attention_);
        } else {
          paged_decode_attention(g.rows, qkv + g.m0 * qkv_size_, qkv_size_, attn + g.m0 * q_size,
                                 num_heads_, num_kv_heads_, head_dim_, L.k_cache.data_ptr<bf16>(),
                                 L.v_cache.data_ptr<bf16>(), tab + g.m0 * max_blocks, len + g.m0,
                                 max_blocks, block_size, scale);
        }
      }
      linear(M, attn_t, L.o_w, L.o_p, L.o_n, L.o_t, H, add_to_residual);
      norm_rows(L.ln2.data_ptr<bf16>());
      if (use_panels(M, L.gate_n) && !use_tiles(M, L.gate_up_t)) {
        const PanelInput hin = panel_input(M, h, L.gate_n);
        at::parallel_for(0, (I + kPanel - 1) / kPanel, 1, [&](int64_t p0, int64_t p1) {
          const int64_t n0 = p0 * kPanel, n = std::min(I, p1 * kPanel) - n0;
          thread_local std::vector<float> g, u;
          g.resize(static_cast<size_t>(M) * n);
          u.resize(static_cast<size_t>(M) * n);
          panel_rows(hin, L.gate_n, p0, p1, g.data(), n);
          panel_rows(hin, L.up_n, p0, p1, u.data(), n);
          for (int m = 0; m < M; ++m) silu_mul_row(&g[m * n], &u[m * n], act + m * I + n0, n);
        });
#ifdef VS_BF16_DOT
      } else if (use_tiles(M, L.gate_up_t) && I % amx::kTileRows == 0) {
        // as below, 16-row tiles of gate and of up per task
        const std::vector<TileInput> hin = tile_inputs(M, h, L.gate_up_t);
        at::parallel_for(0, I / amx::kTileRows, 1, [&](int64_t t0, int64_t t1) {
          const int64_t n0 = t0 * amx::kTileRows, n1 = t1 * amx::kTileRows, n = n1 - n0;
          thread_local std::vector<float> g, u;
          g.resize(static_cast<size_t>(M) * n);
          u.resize(static_cast<size_t>(M) * n);
          tile_rows(hin, L.gate_up_t, n0, n1, g.data(), n);
          tile_rows(hin, L.gate_up_t, I + n0, I + n1, u.data(), n);
          for (int m = 0; m < M; ++m) silu_mul_row(&g[m * n], &u[m * n], act + m * I + n0, n);
        });
#endif
      } else if (M <= gemv_max_rows_ || !packed_) {
        // gate rows [0, I) and up rows [I, 2I) of the same range in one task, so the
        // activation is applied as soon as both halves are there
        const bf16* gu = L.gate_up_w.data_ptr<bf16>();
        const Activations hs(M, h, H, weight_prefetch_);
        at::parallel_for(0, I, kGrain, [&](int64_t n0, int64_t n1) {
          const int64_t n = n1 - n0;
          thread_local std::vector<float> g, u;
          g.resize(static_cast<size_t>(M) * n);
          u.resize(static_cast<size_t>(M) * n);
          dot_rows_any(hs, gu, n0, n1, g.data(), n);
          dot_rows_any(hs, gu, I + n0, I + n1, u.data(), n);
          for (int m = 0; m < M; ++m) silu_mul_row(&g[m * n], &u[m * n], act + m * I + n0, n);
        });
      } else {
        const at::Tensor gu = onednn_linear(h_t, L.gate_up_p);
        const bf16* g = gu.data_ptr<bf16>();
        constexpr int64_t kSpan = 512;  // features per task: 16-lane vectors, whole ones
        const int64_t spans = (I + kSpan - 1) / kSpan;
        at::parallel_for(0, M * spans, 1, [&](int64_t t0, int64_t t1) {
          for (int64_t t = t0; t < t1; ++t) {
            const int64_t m = t / spans, j = t % spans * kSpan, n = std::min(kSpan, I - j);
            silu_mul_row_bf16(g + m * 2 * I + j, g + m * 2 * I + I + j, act + m * I + j, n);
          }
        });
      }
      linear(M, act_t, L.down_w, L.down_p, L.down_n, L.down_t, H, add_to_residual);
    }

    evict_contexts();
    norm_rows(final_norm_.data_ptr<bf16>());
    const int64_t V = vocab_;
    at::Tensor head_in = h_t;
    if (logit_rows.has_value()) {
      const at::Tensor rows = logit_rows->to(at::kLong).contiguous();
      TORCH_CHECK(rows.dim() == 1, "logit_rows: 1-D row indices");
      const int64_t* r = rows.data_ptr<int64_t>();
      for (int64_t i = 0; i < rows.numel(); ++i)
        TORCH_CHECK(r[i] >= 0 && r[i] < M, "logit_rows: row ", r[i], " of ", M);
      head_in = h_t.index_select(0, rows).contiguous();
    }
    const int R = static_cast<int>(head_in.size(0));
    at::Tensor logits = at::empty({R, V}, embeds.options().dtype(at::kFloat));
    if (R == 0) return logits;
    float* out = logits.data_ptr<float>();
    linear(R, head_in, lm_head_, lm_head_p_, lm_head_n_, lm_head_t_, V, [&](int64_t n0, int64_t n1, const float* acc) {
      for (int m = 0; m < R; ++m)
        for (int64_t n = n0; n < n1; n += 16) {
          const int64_t k = n1 - n;
          const vf y = vs::load(acc + m * (n1 - n0) + n - n0, k);
          vs::store(out + m * V + n, round_bf16(y), k);
        }
    });
    return logits;
  }

 private:
  // Every matrix's panels in one huge-page arena: int8 matrices' always (their only GEMV),
  // bf16 ones' too (~ the bf16 weights' size again; the native build drops them where AMX
  // tiles take their rows, set_amx_gemv)
  void build_panels() {
    struct Spec {
      Panels* out;
      const at::Tensor* w;
      const at::Tensor* scales;
      int64_t row0, rows;
    };
    std::vector<Spec> specs;
    for (LayerWeights& L : layers_) {
      specs.push_back({&L.qkv_n, &L.qkv_w, &L.qkv_s, 0, L.qkv_w.size(0)});
      specs.push_back({&L.o_n, &L.o_w, &L.o_s, 0, L.o_w.size(0)});
      specs.push_back({&L.gate_n, &L.gate_up_w, &L.gate_up_s, 0, intermediate_});
      specs.push_back({&L.up_n, &L.gate_up_w, &L.gate_up_s, intermediate_, intermediate_});
      specs.push_back({&L.down_n, &L.down_w, &L.down_s, 0, L.down_w.size(0)});
    }
    specs.push_back({&lm_head_n_, &lm_head_, &lm_head_s_, 0, lm_head_.size(0)});
    const int bits = panel_activation_bits();
    auto bytes = [bits](const Spec& s) -> size_t {  // 64-byte multiples: every panel stays aligned
      const int64_t P = (s.rows + kPanel - 1) / kPanel, K = s.w->size(1);
      if (s.w->scalar_type() == at::kChar) return int8_panel_bytes(s.rows, K, bits);
      return P * (K / 2) * 2 * kPanel * sizeof(uint16_t);
    };
    size_t total = 0;
    for (const Spec& s : specs) total += bytes(s);
    std::shared_ptr<void> arena = huge_page_arena(total);
    char* dst = static_cast<char*>(arena.get());
    for (const Spec& s : specs) {
      const int64_t K = s.w->size(1), P = (s.rows + kPanel - 1) / kPanel;
      if (s.w->scalar_type() == at::kChar) {
        const at::Tensor data = at::from_blob(dst, {static_cast<int64_t>(bytes(s))},
                                              [arena](void*) {}, s.w->options());
        pack_int8_panels(*s.w, *s.scales, s.row0, s.rows, bits, data, *s.out);
      } else {
        pack_panels(*s.w, s.row0, s.rows, reinterpret_cast<uint16_t*>(dst));
        s.out->data = at::from_blob(dst, {P, K / 2, 2 * kPanel}, [arena](void*) {},
                                    s.w->options());
      }
      s.out->N = s.rows;
      s.out->K = K;
      dst += bytes(s);
    }
    // the offset activations' shares (Panels::offsets) are read beside the panels: huge pages too
    std::vector<Panels*> with_offsets;
    std::vector<at::Tensor> offsets;
    for (const Spec& s : specs)
      if (s.out->offsets.defined()) {
        with_offsets.push_back(s.out);
        offsets.push_back(s.out->offsets);
      }
    if (offsets.empty()) return;
    offsets = copy_to_huge_pages(offsets);
    for (size_t i = 0; i < offsets.size(); ++i) with_offsets[i]->offsets = offsets[i];
  }

  // int8 matrices always run their panels; bf16 ones from kPanelRows rows where built
  bool use_panels(int M, const Panels& panels) const {
    if (!panels.defined()) return false;
    if (panels.int8) return true;
    return M >= panel_min_rows_ && (M <= gemv_max_rows_ || !packed_);
  }

  // Matrices run on AMX tiles where set_amx_gemv built them: int8 ones from kI8TileRows rows
  // (16 at a time), bf16 ones the row-major GEMV's rows (gemv_max_rows, all of them without
  // oneDNN's packing), up to the tiles' 16
  bool use_tiles(int M, const TiledWeights& tiles) const {
#ifdef VS_BF16_DOT
    if (!amx_gemv_ || !tiles.defined()) return false;
    if (tiles.int8) return M >= kI8TileRows;
    return M <= amx::kMaxRows && (M <= gemv_max_rows_ || !packed_);
#else
    (void)M, (void)tiles;
    return false;
#endif
  }

  // y = x[:, :K] @ w.T, handed to ``epilogue(n0, n1, acc)`` ([M, n1 - n0] fp32) per column
  // range: the dot-product kernel for a few rows, oneDNN's packed GEMM past that
  template <typename Epilogue>
  void linear(int M, const at::Tensor& x, const at::Tensor& w, const at::Tensor& packed,
              const Panels& panels, const TiledWeights& tiles, int64_t N,
              Epilogue epilogue) const {
    const int64_t K = x.size(1);
    TORCH_CHECK(K == (w.defined() ? w.size(1) : panels.K) && x.is_contiguous(),
                "linear input shape");
    if (use_panels(M, panels) && !use_tiles(M, tiles)) {
      matvec_panels(M, x.data_ptr<bf16>(), panels, epilogue);
      return;
    }
#ifdef VS_BF16_DOT
    if (use_tiles(M, tiles)) {
      matvec_tiles(M, x.data_ptr<bf16>(), tiles, epilogue);
      return;
    }
#else
    (void)tiles;
#endif
    TORCH_CHECK(!w.defined() || w.scalar_type() == at::kBFloat16,
                "int8 weights without their panels");
    if (M <= gemv_max_rows_ || !packed.defined()) {
      TORCH_CHECK(w.defined(), "the row-major weights were dropped (drop_row_major)");
      matvec(M, x.data_ptr<bf16>(), w, N, epilogue, weight_prefetch_);
      return;
    }
    const at::Tensor y = onednn_linear(x, packed);
    const bf16* yp = y.data_ptr<bf16>();
    at::parallel_for(0, N, 256, [&](int64_t n0, int64_t n1) {
      thread_local std::vector<float> acc;  // reused: a fresh buffer per task churned malloc
      acc.resize(static_cast<size_t>(M) * (n1 - n0));
      for (int m = 0; m < M; ++m)
        for (int64_t n = n0; n < n1; n += 16)
          vs::store(&acc[m * (n1 - n0) + n - n0], vs::load_bf16(yp + m * N + n, n1 - n), n1 - n);
      epilogue(n0, n1, acc.data());
    });
  }

  // rotate-half RoPE on q and k (cos/sin already carry the M-RoPE band selection), then the
  // new k and v go to their cache slots
  void rotary_and_store(int M, bf16* qkv, const bf16* cos, const bf16* sin, const LayerWeights& L,
                        const std::vector<int64_t>& slot) const {
    const int64_t D = head_dim_, half = D / 2, kv_size = num_kv_heads_ * D;
    bf16* kc = L.k_cache.data_ptr<bf16>();
    bf16* vc = L.v_cache.data_ptr<bf16>();
    at::parallel_for(0, M, 4, [&](int64_t m0, int64_t m1) {
    std::vector<bf16> tmp(D);
    for (int64_t m = m0; m < m1; ++m) {
      bf16* row = qkv + m * qkv_size_;
      const bf16* c = cos + m * D;
      const bf16* s = sin + m * D;
      for (int64_t head = 0; head < num_heads_ + num_kv_heads_; ++head) {
        bf16* v = row + head * D;
        for (int64_t d = 0; d < D; ++d) {
          const float rot = d < half ? -f32(v[d + half]) : f32(v[d - half]);
          tmp[d] = bf16(f32(bf16(f32(v[d]) * f32(c[d]))) + f32(bf16(rot * f32(s[d]))));
        }
        std::memcpy(v, tmp.data(), D * sizeof(bf16));
      }
      const bf16* k = row + num_heads_ * D;
      std::memcpy(kc + slot[m] * kv_size, k, kv_size * sizeof(bf16));
      std::memcpy(vc + slot[m] * kv_size, k + kv_size, kv_size * sizeof(bf16));
    }
    });
  }

  std::vector<LayerWeights> layers_;
  at::Tensor final_norm_, lm_head_, lm_head_p_, lm_head_s_;
  Panels lm_head_n_;
  int64_t gemv_max_rows_;
  bool amx_gemv_ = false, tiled_ = false, amx_attention_ = false;
  TiledWeights lm_head_t_;
  int64_t weight_prefetch_ = 0;
  bool packed_ = false;
  bool int8_ = false;  // int8 decoder matrices and lm_head (panels only)
  bool panels_ = false;  // every matrix also as panels: steps of any row count
  bool row_major_ = true;  // the bf16 matrices' row-major copy is held (drop_row_major)
  int panel_min_rows_ = kPanelRows;  // fewest rows that take the bf16 panels
  int64_t vocab_ = 0;
  int64_t num_heads_, num_kv_heads_, head_dim_, hidden_ = 0, qkv_size_ = 0, intermediate_ = 0;
  float eps_;

  // Prompts being prefilled chunk by chunk: every layer's packed keys and values and the cache
  // slots they were packed from, by the caller's key (see forward's ``context_keys``)
  struct ChunkContext {
    std::vector<PackedKeys> layers;
    std::vector<int64_t> slots;
    uint64_t last_use = 0;
  };
  // a handful of prompts at most are mid-prefill at once; past that the least recently used
  // goes (an abandoned prompt's buffers must not stay forever), and none takes more than
  // kMaxContextBytes (a longer prompt packs per step, as without a key)
  static constexpr size_t kMaxContexts = 4;
  static constexpr int64_t kMaxContextBytes = int64_t(512) << 20;
  std::unordered_map<int64_t, ChunkContext> contexts_;
  uint64_t steps_ = 0;

  // The kept context of the chunk segment ending at row ``last`` (nullptr: pack per step),
  // and how many of its tokens' packing still holds: those before the chunk whose slots did not
  // move since they were packed
  ChunkContext* chunk_context(const int64_t* keys, int64_t last, const std::vector<int64_t>& slots,
                              int64_t chunk_rows, int64_t* reuse) {
    *reuse = 0;
    if (keys == nullptr || keys[last] <= 0) return nullptr;
    const int64_t key = keys[last];
    const int64_t m = static_cast<int64_t>(slots.size());
    const int64_t bytes = int64_t(layers_.size()) * packed_keys_bytes(2 * m, num_kv_heads_, head_dim_);
    if (bytes > kMaxContextBytes) {
      contexts_.erase(key);
      return nullptr;
    }
    ChunkContext& ctx = contexts_[key];
    if (ctx.layers.size() != layers_.size()) ctx.layers.assign(layers_.size(), PackedKeys{});
    int64_t valid = std::min<int64_t>(m - chunk_rows, int64_t(ctx.slots.size()));
    for (const PackedKeys& p : ctx.layers) valid = std::min(valid, p.valid);
    int64_t same = 0;
    while (same < valid && ctx.slots[same] == slots[same]) ++same;
    *reuse = same;
    ctx.slots = slots;
    ctx.last_use = ++steps_;
    return &ctx;
  }

  // After a forward: past kMaxContexts the least recently used context goes
  void evict_contexts() {
    while (contexts_.size() > kMaxContexts) {
      auto oldest = contexts_.begin();
      for (auto it = contexts_.begin(); it != contexts_.end(); ++it)
        if (it->second.last_use < oldest->second.last_use) oldest = it;
      contexts_.erase(oldest);
    }
  }
};

// The test entry points' epilogue: each [M, n1 - n0] block of sums into y [M, N], bf16
auto bf16_rows(bf16* y, int M, int64_t N) {
  return [=](int64_t n0, int64_t n1, const float* acc) {
    for (int m = 0; m < M; ++m)
      for (int64_t n = n0; n < n1; ++n) y[m * N + n] = bf16(acc[m * (n1 - n0) + n - n0]);
  };
}

// y = x @ w.T in bf16 for 1..16 rows: exposed alone for tests and the GEMV benchmark
at::Tensor small_matmul(const at::Tensor& x, const at::Tensor& w) {
  TORCH_CHECK(x.scalar_type() == at::kBFloat16 && w.scalar_type() == at::kBFloat16, "bf16 only");
  at::Tensor xc = x.contiguous(), wc = w.contiguous();
  const int M = static_cast<int>(xc.size(0));
  const int64_t N = wc.size(0);
  TORCH_CHECK(xc.size(1) == wc.size(1), "shape mismatch");
  at::Tensor y = at::empty({M, N}, xc.options());
  bf16* yp = y.data_ptr<bf16>();
  matvec(M, xc.data_ptr<bf16>(), wc, N, bf16_rows(yp, M, N));
  return y;
}

// w [N, K] bf16 as AMX tiles [N / 16, K / 32, 16, 32] (N a multiple of 16, K of 32), and
// y = x @ w.T for 1..16 rows from such tiles: the AMX GEMV alone, for tests and benchmarks
at::Tensor tile_matrix(const at::Tensor& w) {
#ifdef VS_BF16_DOT
  TORCH_CHECK(w.dim() == 2 && w.scalar_type() == at::kBFloat16, "w: bf16 [N, K]");
  TORCH_CHECK(amx::tileable(w.size(0), w.size(1)), "N must be a multiple of 16 and K of 32");
  return tile_weights(w).data;
#else
  TORCH_CHECK(false, "AMX tiles are the native-bf16 build's");
  return w;
#endif
}

at::Tensor tiled_matmul(const at::Tensor& x, const at::Tensor& tiles) {
#ifdef VS_BF16_DOT
  TORCH_CHECK(amx::amx_usable(), "this CPU or OS runs no AMX");
  TORCH_CHECK(tiles.dim() == 4 && tiles.size(2) == amx::kTileRows && tiles.size(3) == amx::kTileK,
              "tiles: from tile_matrix");
  const at::Tensor xc = x.contiguous();
  const int M = static_cast<int>(xc.size(0));
  TORCH_CHECK(M >= 1 && M <= amx::kMaxRows, "1..16 rows");
  TiledWeights w;
  w.data = tiles.contiguous();
  w.N = tiles.size(0) * amx::kTileRows, w.K = tiles.size(1) * amx::kTileK;
  TORCH_CHECK(xc.dim() == 2 && xc.size(1) == w.K && xc.scalar_type() == at::kBFloat16, "x shape");
  at::Tensor y = at::empty({M, w.N}, xc.options());
  bf16* yp = y.data_ptr<bf16>();
  const int64_t N = w.N;
  matvec_tiles(M, xc.data_ptr<bf16>(), w, bf16_rows(yp, M, N));
  return y;
#else
  TORCH_CHECK(false, "AMX tiles are the native-bf16 build's");
  return x;
#endif
}

// y = x @ w.T through the decode GEMV's bf16 panels (packs w on every call): for tests
at::Tensor panel_matmul(const at::Tensor& x, const at::Tensor& w) {
  TORCH_CHECK(x.scalar_type() == at::kBFloat16 && w.scalar_type() == at::kBFloat16, "bf16 only");
  at::Tensor xc = x.contiguous(), wc = w.contiguous();
  const int M = static_cast<int>(xc.size(0));
  const int64_t N = wc.size(0), K = wc.size(1);
  TORCH_CHECK(xc.size(1) == K && K % 2 == 0, "shape mismatch or odd K");
  Panels panels;
  panels.data = at::empty({(N + kPanel - 1) / kPanel, K / 2, 2 * kPanel}, wc.options());
  panels.N = N;
  panels.K = K;
  pack_panels(wc, 0, N, reinterpret_cast<uint16_t*>(panels.data.data_ptr<bf16>()));
  at::Tensor y = at::empty({M, N}, xc.options());
  bf16* yp = y.data_ptr<bf16>();
  matvec_panels(M, xc.data_ptr<bf16>(), panels, bf16_rows(yp, M, N));
  return y;
}

// One weight packed once into the decode GEMV's panels: int8 [N, K] with fp32 scales [N], or
// bf16. forward(x bf16 [M, K]) -> fp32 [M, N], unrounded: for
// tests (the kernel against x @ (q * s).T) and the GEMV benchmark, which must not time packing.
class PanelGemv {
 public:
  PanelGemv(const at::Tensor& w_in, std::optional<at::Tensor> scales,
            std::optional<int> activation_bits) {
    const at::Tensor w = w_in.contiguous();
    TORCH_CHECK(w.dim() == 2, "w: [N, K]");
    const int64_t N = w.size(0), K = w.size(1), P = (N + kPanel - 1) / kPanel;
    panels_.N = N;
    panels_.K = K;
    if (w.scalar_type() == at::kChar) {
      TORCH_CHECK(scales.has_value(), "int8 weights need their scales");
      const at::Tensor s = scales->to(at::kFloat).contiguous();
      check_matrix(w, s, "w");
      const int bits = activation_bits.value_or(panel_activation_bits());
      const std::vector<int> known = supported_activation_bits();
      TORCH_CHECK(std::find(known.begin(), known.end(), bits) != known.end(),
                  "activation_bits ", bits,
                  ": not one this build rounds activations to (int8_activation_bits_supported)");
      pack_int8_panels(w, s, 0, N, bits, at::empty({int8_panel_bytes(N, K, bits)}, w.options()),
                       panels_);
    } else {
      TORCH_CHECK(!activation_bits.has_value(), "activation_bits: int8 weights only");
      TORCH_CHECK(w.scalar_type() == at::kBFloat16 && K % 2 == 0, "w: int8, or bf16 with even K");
      panels_.data = at::empty({P, K / 2, 2 * kPanel}, w.options());
      pack_panels(w, 0, N, reinterpret_cast<uint16_t*>(panels_.data.data_ptr<bf16>()));
    }
  }

  at::Tensor forward(const at::Tensor& x_in) const {
    const at::Tensor x = x_in.to(at::kBFloat16).contiguous();
    TORCH_CHECK(x.dim() == 2 && x.size(1) == panels_.K && x.size(0) >= 1, "x: [M >= 1, K]");
    const int M = static_cast<int>(x.size(0));
    const int64_t N = panels_.N;
    at::Tensor y = at::empty({M, N}, x.options().dtype(at::kFloat));
    float* yp = y.data_ptr<float>();
    matvec_panels(M, x.data_ptr<bf16>(), panels_, [&](int64_t n0, int64_t n1, const float* acc) {
      for (int m = 0; m < M; ++m)
        std::memcpy(yp + m * N + n0, acc + m * (n1 - n0), (n1 - n0) * sizeof(float));
    });
    return y;
  }

 private:
  Panels panels_;
};

// One weight packed once as AMX tiles: bf16 [N, K], or int8 with fp32 scales [N] on AMX-INT8.
// forward(x bf16 [M, K]) -> fp32 [M, N], any M (int8; bf16 1..16): for tests (int8 tiles give
// the int8 panels' result bit for bit) and benchmarks.
class TileGemv {
 public:
  TileGemv(const at::Tensor& w_in, std::optional<at::Tensor> scales) {
#ifdef VS_BF16_DOT
    const at::Tensor w = w_in.contiguous();
    TORCH_CHECK(w.dim() == 2, "w: [N, K]");
    at::Tensor s;
    if (w.scalar_type() == at::kChar) {
      TORCH_CHECK(scales.has_value(), "int8 weights need their scales");
      s = scales->to(at::kFloat).contiguous();
      check_matrix(w, s, "w");
      TORCH_CHECK(amx::amx_int8_usable(), "this CPU or OS runs no AMX-INT8");
      TORCH_CHECK(amx::tileable_i8(w.size(0), w.size(1)), "N must be a multiple of 16 and K of 64");
    } else {
      TORCH_CHECK(amx::amx_usable(), "this CPU or OS runs no AMX");
      TORCH_CHECK(amx::tileable(w.size(0), w.size(1)), "N must be a multiple of 16 and K of 32");
    }
    tiles_ = tile_weights(w, s);
    TORCH_CHECK(tiles_.defined(), "w: bf16 or int8");
#else
    (void)w_in, (void)scales;
    TORCH_CHECK(false, "AMX tiles are the native-bf16 build's");
#endif
  }

  at::Tensor forward(const at::Tensor& x_in) const {
    const at::Tensor x = x_in.to(at::kBFloat16).contiguous();
    TORCH_CHECK(x.dim() == 2 && x.size(1) == tiles_.K && x.size(0) >= 1, "x: [M >= 1, K]");
    const int M = static_cast<int>(x.size(0));
    TORCH_CHECK(tiles_.int8 || M <= 16, "bf16 tiles take 1..16 rows");
    const int64_t N = tiles_.N;
    at::Tensor y = at::empty({M, N}, x.options().dtype(at::kFloat));
#ifdef VS_BF16_DOT
    float* yp = y.data_ptr<float>();
    matvec_tiles(M, x.data_ptr<bf16>(), tiles_, [&](int64_t n0, int64_t n1, const float* acc) {
      for (int m = 0; m < M; ++m)
        std::memcpy(yp + m * N + n0, acc + m * (n1 - n0), (n1 - n0) * sizeof(float));
    });
#endif
    return y;
  }

 private:
  TiledWeights tiles_;
};

}  // namespace

// One prompt chunk's attention as the fused step runs it (queries: the last n of the
// context_len tokens whose slots block_table [max_blocks] gives): exposed for tests
at::Tensor chunk_attention(const at::Tensor& q_in, const at::Tensor& k_cache,
                           const at::Tensor& v_cache, const at::Tensor& block_table,
                           int64_t context_len, int64_t block_size, double scale, bool amx) {
  check_attention_inputs(q_in, k_cache, v_cache);
  const at::Tensor q = q_in.contiguous();
  const at::Tensor table = block_table.to(at::kLong).contiguous();
  const int64_t n = q.size(0), H = q.size(1), D = q.size(2), KVH = k_cache.size(1);
  TORCH_CHECK(context_len >= n && (context_len - 1) / block_size < table.numel(), "context length");
  std::vector<int64_t> slots(context_len);
  const int64_t* tab = table.data_ptr<int64_t>();
  for (int64_t j = 0; j < context_len; ++j)
    slots[j] = tab[j / block_size] * block_size + j % block_size;
  at::Tensor out = at::empty_like(q);
  attend_cached_chunk(q.data_ptr<at::BFloat16>(), H * D, out.data_ptr<at::BFloat16>(), H * D, n, H,
                      k_cache.data_ptr<at::BFloat16>(), v_cache.data_ptr<at::BFloat16>(), KVH, D,
                      slots.data(), context_len, static_cast<float>(scale), nullptr, 0, amx);
  return out;
}

// cpu_attention.cpp
at::Tensor flash_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                           double scale, bool causal, bool amx);
std::vector<at::Tensor> pack_kv(const at::Tensor& k, const at::Tensor& v);
at::Tensor attend_packed(const at::Tensor& q, const std::vector<at::Tensor>& packed, double scale,
                         bool causal, bool amx);

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  // which traits header this build was written against, and whether it multiplies bf16 pairs
  // natively (no GEMV panels then): tests and logs read these
  m.attr("isa") = vs::kIsaName;
#ifdef VS_BF16_DOT
  m.attr("bf16_dot") = true;
#else
  m.attr("bf16_dot") = false;
#endif
  // the bits int8 panels round activations to on this machine (one scale per row and 256 k:
  // panel_input): 16 (AVX-512 VNNI with AMX-INT8), 8 (AVX2, AVX-512 VNNI elsewhere), 0 where
  // they are widened to fp32; and every value PanelGemv(activation_bits=) takes in this build
  m.attr("int8_activation_bits") = panel_activation_bits();
  m.attr("int8_activation_bits_supported") = supported_activation_bits();
  // int8 panels laid out for 8-bit activations round steps of up to this many rows to int16
  // (VNNI builds: vs::I16QuadDot), 0 where they do not
  m.attr("int8_i16_rows") = panel_i16_rows();
  pybind11::class_<FusedDecoder>(m, "FusedDecoder")
      .def(pybind11::init<std::vector<std::vector<at::Tensor>>, at::Tensor, at::Tensor,
                          std::optional<at::Tensor>, int64_t, int64_t, int64_t, double, int64_t,
                          std::optional<std::vector<at::Tensor>>, int64_t>(),
           pybind11::arg("layers"), pybind11::arg("final_norm"), pybind11::arg("lm_head"),
           pybind11::arg("lm_head_packed"), pybind11::arg("num_heads"),
           pybind11::arg("num_kv_heads"), pybind11::arg("head_dim"), pybind11::arg("eps"),
           pybind11::arg("gemv_max_rows"), pybind11::arg("scales") = pybind11::none(),
           pybind11::arg("weight_prefetch") = 0)
      .def("forward", &FusedDecoder::forward, pybind11::arg("embeds"), pybind11::arg("cos"),
           pybind11::arg("sin"), pybind11::arg("block_tables"), pybind11::arg("context_lens"),
           pybind11::arg("block_size"), pybind11::arg("logit_rows") = pybind11::none(),
           pybind11::arg("context_keys") = pybind11::none(),
           pybind11::call_guard<pybind11::gil_scoped_release>())
      .def("max_rows", &FusedDecoder::max_rows)
      .def("set_weight_prefetch", &FusedDecoder::set_weight_prefetch, pybind11::arg("bytes"))
      .def("set_amx_gemv", &FusedDecoder::set_amx_gemv, pybind11::arg("enable"))
      .def_property_readonly("amx_gemv", &FusedDecoder::amx_gemv)
      .def("drop_row_major", &FusedDecoder::drop_row_major)
      .def_property_readonly("row_major", &FusedDecoder::row_major)
      .def("set_amx_attention", &FusedDecoder::set_amx_attention, pybind11::arg("enable"))
      .def_property_readonly("amx_attention", &FusedDecoder::amx_attention)
      .def("weight_prefetch", &FusedDecoder::weight_prefetch)
      .def("kept_contexts", &FusedDecoder::kept_contexts)
      .def("forget_context", &FusedDecoder::forget_context);
  pybind11::class_<PanelGemv>(m, "PanelGemv")
      .def(pybind11::init<const at::Tensor&, std::optional<at::Tensor>, std::optional<int>>(),
           pybind11::arg("w"), pybind11::arg("scales") = pybind11::none(),
           pybind11::arg("activation_bits") = pybind11::none())
      .def("forward", &PanelGemv::forward, pybind11::call_guard<pybind11::gil_scoped_release>());
  pybind11::class_<TileGemv>(m, "TileGemv")
      .def(pybind11::init<const at::Tensor&, std::optional<at::Tensor>>(), pybind11::arg("w"),
           pybind11::arg("scales") = pybind11::none())
      .def("forward", &TileGemv::forward, pybind11::call_guard<pybind11::gil_scoped_release>());
  m.def("small_matmul", &small_matmul);
  m.def("tile_matrix", &tile_matrix);
  m.def("tiled_matmul", &tiled_matmul);
  // whether this build and machine can run the AMX GEMV and attention (the OS granted the
  // tile state)
#ifdef VS_BF16_DOT
  m.def("amx_usable", &amx::amx_usable);
#else
  m.def("amx_usable", [] { return false; });
#endif
#ifdef VS_BF16_DOT
  m.def("amx_int8_usable", &amx::amx_int8_usable);
#else
  m.def("amx_int8_usable", [] { return false; });
#endif
  m.def("panel_matmul", &panel_matmul, pybind11::call_guard<pybind11::gil_scoped_release>());
  m.def("decode_attention", &decode_attention,
        pybind11::call_guard<pybind11::gil_scoped_release>());
  m.def("chunk_attention", &chunk_attention, pybind11::arg("q"), pybind11::arg("k_cache"),
        pybind11::arg("v_cache"), pybind11::arg("block_table"), pybind11::arg("context_len"),
        pybind11::arg("block_size"), pybind11::arg("scale"), pybind11::arg("amx") = false,
        pybind11::call_guard<pybind11::gil_scoped_release>());
  m.def("copy_to_huge_pages", &copy_to_huge_pages);
  m.def("flash_attention", &flash_attention, pybind11::arg("q"), pybind11::arg("k"),
        pybind11::arg("v"), pybind11::arg("scale"), pybind11::arg("causal"),
        pybind11::arg("amx") = false, pybind11::call_guard<pybind11::gil_scoped_release>());
  m.def("pack_kv", &pack_kv, pybind11::call_guard<pybind11::gil_scoped_release>());
  m.def("attend_packed", &attend_packed, pybind11::arg("q"), pybind11::arg("packed"),
        pybind11::arg("scale"), pybind11::arg("causal"), pybind11::arg("amx") = false,
        pybind11::call_guard<pybind11::gil_scoped_release>());
}
