// Fused bf16 attention for prefill-sized inputs (vision tower, prompt chunks), written against
// the vector vocabulary of isa.h (AVX-512 with or without its bf16 dot product, AVX2).
//
// Why: without AMX, PyTorch's CPU flash kernel runs bf16 at the fp32 rate, and the two-bmm
// alternative spends ~40 % of its time writing, softmaxing and re-reading the score matrix.
// Here scores live in registers: per 4 query rows and 64 keys, q.k^T and p.v are vdpbf16ps
// over keys and values repacked into bf16 pairs once per call, with an online softmax in fp32
// between them (probabilities rounded to bf16 for p.v, as GPU flash attention does).
// Builds without the bf16 dot product (AVX-512 without BF16, AVX2: "emulated") compute in fp32
// throughout, so they also take fp32 q/k/v: the vision tower runs in fp32 there (see
// engine.models.load_model).

#include <torch/extension.h>
#include <ATen/Parallel.h>
#include "isa.h"
#include "chunk_attention.h"
#ifdef VS_BF16_DOT
#include "amx_attention.h"
#endif

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

namespace {

using bf16 = at::BFloat16;

inline float f32(bf16 v) { return static_cast<float>(v); }

using vs::vf;

inline uint32_t pair(const bf16* a, const bf16* b) {
  uint16_t lo, hi;
  std::memcpy(&lo, a, 2);
  std::memcpy(&hi, b, 2);
  return uint32_t(lo) | (uint32_t(hi) << 16);
}

constexpr int kTile = 64;    // keys per online-softmax update
constexpr int kSub = kTile / 16;

// 32-bit words per packed pair of keys/values. With AVX512-BF16 a pair is two bf16 in one word.
// Emulated, pack_kv widens once to fp32 (two words: the even element's vector of 16, then the
// odd one's), so the tiles below do no integer work on keys or values: at 64 keys per tile
// that widening had cost as many instructions as the FMAs it fed.
// Likewise queries and probabilities: bf16 pairs broadcast into vdpbf16ps natively; fp32
// (queries widened once per row block, probabilities never rounded) broadcast from memory,
// a load-port operation, when emulated.
#ifdef VS_BF16_DOT
constexpr int64_t kWords = 1;
using QElem = bf16;
using Prob = uint16_t;
#else
constexpr int64_t kWords = 2;
using QElem = float;
using Prob = float;
#endif

struct Problem {
  const void* q;  // bf16, or fp32 when fp32_io (emulated builds only)
  void* out;      // q's dtype
  bool fp32_io;
  const uint32_t* kpk;
  const uint32_t* vpk;
  int64_t n, m, Hq, G, offset;
  int64_t m_pad;  // tokens a head has room for in kpk / vpk: >= m, a multiple of kTile
  float scale;
  bool causal;
};

// scores[r][:] = q_r . k_j for the 64 keys of a tile (unscaled): R x 4 accumulators in
// registers, one 64-byte key load feeding R vdpbf16ps. Out of line, with its own registers:
// inlined into the tile loop, GCC kept writing the accumulators back to the stack every step.
template <int R>
__attribute__((noinline)) void qk_tile(const QElem* const* qrow, const uint32_t* kt,
                                       int64_t dp_count, float (*scores)[kTile]) {
  vf s[R][kSub];
  for (int r = 0; r < R; ++r)
    for (int u = 0; u < kSub; ++u) s[r][u] = vs::zero();
  for (int64_t p = 0; p < dp_count; ++p) {
#ifdef VS_BF16_DOT
    vs::vpair qb[R];
    for (int r = 0; r < R; ++r) qb[r] = vs::broadcast_pair(qrow[r] + 2 * p);
    for (int u = 0; u < kSub; ++u) {
      const vs::vpair kv = vs::load_pairs(kt + (u * dp_count + p) * 16);
      for (int r = 0; r < R; ++r) s[r][u] = vs::dot_pairs(s[r][u], kv, qb[r]);
    }
#else
    vf q_even[R], q_odd[R];
    for (int r = 0; r < R; ++r) {
      q_even[r] = vs::set1(qrow[r][2 * p]);
      q_odd[r] = vs::set1(qrow[r][2 * p + 1]);
    }
    for (int u = 0; u < kSub; ++u) {
      const float* kw = reinterpret_cast<const float*>(kt) + (u * dp_count + p) * 32;
      const vf k_even = vs::load(kw), k_odd = vs::load(kw + 16);
      for (int r = 0; r < R; ++r)
        s[r][u] = vs::fmadd(k_odd, q_odd[r], vs::fmadd(k_even, q_even[r], s[r][u]));
    }
#endif
  }
  for (int r = 0; r < R; ++r)
    for (int u = 0; u < kSub; ++u) vs::store(scores[r] + 16 * u, s[r][u]);
}

// o[r] = o[r] * alpha[r] + p_r . V over the tile's key pairs (R x ND accumulators); without
// Rescale every alpha is 1, as it is once a row's running max has settled
template <int ND, int R, bool Rescale>
__attribute__((noinline)) void pv_tile(float* o, const float* alpha, const Prob (*probs)[kTile],
                                       const uint32_t* vt, int64_t pairs) {
  constexpr int64_t D = ND * 16;
  vf acc[R][ND];
  for (int r = 0; r < R; ++r)
    for (int d = 0; d < ND; ++d) {
      acc[r][d] = vs::load(o + r * D + 16 * d);
      if (Rescale) acc[r][d] = vs::mul(acc[r][d], vs::set1(alpha[r]));
    }
  for (int64_t i = 0; i < pairs; ++i) {
#ifdef VS_BF16_DOT
    vs::vpair pb[R];
    for (int r = 0; r < R; ++r) pb[r] = vs::broadcast_pair(probs[r] + 2 * i);
    for (int d = 0; d < ND; ++d) {
      const vs::vpair vv = vs::load_pairs(vt + i * D + 16 * d);
      for (int r = 0; r < R; ++r) acc[r][d] = vs::dot_pairs(acc[r][d], vv, pb[r]);
    }
#else
    vf p_even[R], p_odd[R];
    for (int r = 0; r < R; ++r) {
      p_even[r] = vs::set1(probs[r][2 * i]);
      p_odd[r] = vs::set1(probs[r][2 * i + 1]);
    }
    for (int d = 0; d < ND; ++d) {
      const float* vw = reinterpret_cast<const float*>(vt) + i * 2 * D + 16 * d;
      const vf v_even = vs::load(vw), v_odd = vs::load(vw + D);
      for (int r = 0; r < R; ++r)
        acc[r][d] = vs::fmadd(v_odd, p_odd[r], vs::fmadd(v_even, p_even[r], acc[r][d]));
    }
#endif
  }
  for (int r = 0; r < R; ++r)
    for (int d = 0; d < ND; ++d) vs::store(o + r * D + 16 * d, acc[r][d]);
}

// probabilities as pv_tile reads them: bf16 with the dot product, fp32 otherwise
inline void store_probs(uint16_t* p, vf e) { vs::store_bf16(p, e); }
inline void store_probs(float* p, vf e) { vs::store(p, e); }

// One query row's step of the online softmax over a 64-key tile: its raw scores ``sc``
// (overwritten where masked) become probabilities in ``probs`` against the row's running max
// (base 2) and sum; keys past ``limit`` are masked. Returns the factor the row's output so far
// must be scaled by (1 when the max did not move).
inline float softmax_tile_row(float* sc, int64_t j0, int64_t limit, float scale2, float& row_max,
                              float* row_sum, Prob* probs) {
  const vf vscale2 = vs::set1(scale2);
  // a whole visible tile against a running max: its scores are exponentiated against that max
  // as long as none exceeds it by more than 2^8 (fp32 and bf16 hold such probabilities and
  // their sums); only a tile that does pays for its own max
  if (j0 + kTile - 1 <= limit && row_max != -INFINITY) {
    const vf top = vs::set1(row_max);
    vf t[kSub];
    bool over = false;
    for (int u = 0; u < kSub; ++u) {
      t[u] = vs::fmsub(vs::load(sc + 16 * u), vscale2, top);
      over |= vs::any_gt(t[u], 8.f);
    }
    if (!over) {
      vf sum = vs::load(row_sum);
      for (int u = 0; u < kSub; ++u) {
        const vf e = vs::exp2(t[u]);
        sum = vs::add(sum, e);
        store_probs(probs + 16 * u, e);
      }
      vs::store(row_sum, sum);
      return 1.f;
    }
  }
  // the tile's max of raw scores (scale > 0 keeps their order); only a tile that crosses the
  // row's limit pays for masking
  vf mx = vs::set1(-INFINITY);
  if (j0 + kTile - 1 <= limit) {
    for (int u = 0; u < kSub; ++u) mx = vs::max(mx, vs::load(sc + 16 * u));
  } else {
    for (int u = 0; u < kSub; ++u) {  // keys j0 + 16u + i <= limit stay
      const vf x = vs::keep_first(vs::load(sc + 16 * u), limit - j0 - 16 * u + 1, -INFINITY);
      vs::store(sc + 16 * u, x);
      mx = vs::max(mx, x);
    }
  }
  const float new_max = std::max(row_max, vs::reduce_max(mx) * scale2);
  if (new_max == -INFINITY) {  // nothing visible to this row yet
    std::memset(probs, 0, kTile * sizeof(Prob));
    return 1.f;
  }
  // the running max rarely moves after the first tiles: no exp when it stays
  float alpha = 1.f;
  if (row_max == -INFINITY) alpha = 0.f;
  else if (new_max != row_max) alpha = std::exp2(row_max - new_max);
  row_max = new_max;
  const vf top = vs::set1(new_max);
  vf sum = vs::mul(vs::load(row_sum), vs::set1(alpha));
  for (int u = 0; u < kSub; ++u) {
    const vf e = vs::exp2(vs::fmsub(vs::load(sc + 16 * u), vscale2, top));
    sum = vs::add(sum, e);
    store_probs(probs + 16 * u, e);
  }
  vs::store(row_sum, sum);
  return alpha;
}

// Query rows per register block for head size 16 * ND: R x ND output accumulators must stay
// in registers. AVX-512: 4 rows for D <= 64, 2 beyond; AVX2 (a quarter of the logical
// vectors): 2 rows for D <= 32, 1 beyond.
constexpr int rows_per_block(int nd) {
  return vs::kVecRegs >= 32 ? (nd <= 4 ? 4 : 2) : (nd <= 2 ? 2 : 1);
}

// The blocked loop, compiled per head size (ND = D / 16) so the output accumulators stay in
// registers.
template <int ND, int R>
void attend(const Problem& P) {
  const int64_t n = P.n, m = P.m, Hq = P.Hq, D = ND * 16, G = P.G, offset = P.offset;
  const int64_t dp_count = D / 2, m_pad = P.m_pad;
  const bool causal = P.causal;
  const bf16* qp = static_cast<const bf16*>(P.q);
  const uint32_t* kpk = P.kpk;
  const uint32_t* vpk = P.vpk;
  // a task is one head's block of up to kBlock query rows; for every key tile (64 keys:
  // 16 KB of packed keys and values, 32 KB emulated) its sub-blocks of R rows run in turn, so
  // each tile comes from L2 once per block rather than once per R rows: 128 rows ran
  // vision-sized calls 10 % faster than 32 on an Ice Lake. Smaller blocks only where the
  // call has too few rows to give every thread two tasks.
  constexpr int64_t kBlock = 128;
  int64_t block = kBlock;
  const int64_t min_tasks = 2 * at::get_num_threads();
  while (block > 16 && Hq * ((n + block - 1) / block) < min_tasks) block /= 2;
  const int64_t row_blocks = (n + block - 1) / block;
  // softmax in base 2: exp(x * scale - max) = 2^(x * scale * log2(e) - max'), one FMA per score
  const float scale2 = P.scale * 1.4426950408889634f;
  at::parallel_for(0, Hq * row_blocks, 1, [&](int64_t t0, int64_t t1) {
    alignas(64) Prob probs[R][kTile];
    std::vector<float> o_mem(kBlock * D);
#ifndef VS_BF16_DOT
    std::vector<float> q_wide(kBlock * D);
#endif
    float row_max[kBlock];  // base-2 units
    alignas(64) float row_sum[kBlock][16];  // per lane: reduced once, at the end
    for (int64_t task = t0; task < t1; ++task) {
      const int64_t h = task / row_blocks, b0 = (task % row_blocks) * block;
      const int64_t block_rows = std::min<int64_t>(block, n - b0), hk = h / G;
      const uint32_t* kh = kpk + hk * (m_pad / 16) * dp_count * 16 * kWords;
      const uint32_t* vh = vpk + hk * (m_pad / 2) * D * kWords;
      std::fill(o_mem.begin(), o_mem.end(), 0.f);
      std::fill(row_max, row_max + kBlock, -INFINITY);
      std::memset(row_sum, 0, sizeof(row_sum));
#ifndef VS_BF16_DOT
      for (int64_t r = 0; r < block_rows; ++r) {
        const int64_t at = ((b0 + r) * Hq + h) * D;
        if (P.fp32_io)
          std::memcpy(&q_wide[r * D], static_cast<const float*>(P.q) + at, D * sizeof(float));
        else
          for (int64_t d = 0; d < D; ++d) q_wide[r * D + d] = f32(qp[at + d]);
      }
#endif
      const int64_t block_last = causal ? std::min(m - 1, offset + b0 + block_rows - 1) : m - 1;
      for (int64_t j0 = 0; j0 <= block_last; j0 += kTile) {
        const uint32_t* kt = kh + (j0 / 16) * dp_count * 16 * kWords;
        const uint32_t* vt = vh + (j0 / 2) * D * kWords;
        for (int64_t r0 = b0; r0 < b0 + block_rows; r0 += R) {
          const int64_t rows = std::min<int64_t>(R, b0 + block_rows - r0);
          const int64_t last_key = causal ? std::min(m - 1, offset + r0 + rows - 1) : m - 1;
          if (j0 > last_key) continue;  // causal: this tile is in every row's future
          const QElem* qrow[R];
          for (int r = 0; r < R; ++r) {
            const int64_t q_row = r0 + std::min<int64_t>(r, rows - 1);
#ifdef VS_BF16_DOT
            qrow[r] = qp + (q_row * Hq + h) * D;
#else
            qrow[r] = q_wide.data() + (q_row - b0) * D;
#endif
          }
          alignas(64) float sc[R][kTile];
          qk_tile<R>(qrow, kt, dp_count, sc);
          float alphas[R];
          bool rescale = false;
          for (int r = 0; r < R; ++r) {
            const int64_t row = r0 - b0 + r;
            // keys this row may see: all below m, with causal those <= its own position
            const int64_t limit = causal ? std::min(m - 1, offset + r0 + r) : m - 1;
            alphas[r] = softmax_tile_row(sc[r], j0, limit, scale2, row_max[row], row_sum[row],
                                         probs[r]);
            rescale |= alphas[r] != 1.f;
          }
          const int64_t pairs = (std::min<int64_t>(kTile, last_key + 1 - j0) + 1) / 2;
          float* o = o_mem.data() + (r0 - b0) * D;
          if (rescale) pv_tile<ND, R, true>(o, alphas, probs, vt, pairs);
          else pv_tile<ND, R, false>(o, alphas, probs, vt, pairs);
        }
      }
      for (int64_t r = 0; r < block_rows; ++r) {
        const int64_t at = ((b0 + r) * Hq + h) * D;
        const vf inv = vs::set1(1.0f / vs::reduce_add(vs::load(row_sum[r])));
        for (int d = 0; d < ND; ++d) {
          const vf y = vs::mul(vs::load(o_mem.data() + r * D + 16 * d), inv);
          if (P.fp32_io)
            vs::store(static_cast<float*>(P.out) + at + 16 * d, y);
          else
            vs::store_bf16(static_cast<bf16*>(P.out) + at + 16 * d, y);
        }
      }
    }
  });
}

#ifdef VS_BF16_DOT
// attend() with its two products on AMX tiles (amx_attention.h): a task is one head's 16
// query rows (padded with zero rows), the online softmax between the products as attend's.
// D a multiple of 32.
void attend_amx(const Problem& P, int64_t D) {
  const int64_t n = P.n, m = P.m, Hq = P.Hq, G = P.G, offset = P.offset;
  const int64_t dp_count = D / 2, m_pad = P.m_pad, row_blocks = (n + 15) / 16;
  const bf16* qp = static_cast<const bf16*>(P.q);
  const float scale2 = P.scale * 1.4426950408889634f;
  constexpr int64_t kRows = 16;
  at::parallel_for(0, Hq * row_blocks, 1, [&](int64_t t0, int64_t t1) {
    amx::attention_tiles_begin();
    std::vector<bf16> q_block(kRows * D);
    std::vector<float> o(kRows * D), pv(kRows * D);
    alignas(64) float sc[kRows][kTile];
    alignas(64) uint16_t probs[kRows][kTile];
    float row_max[kRows], alphas[kRows];
    alignas(64) float row_sum[kRows][16];
    for (int64_t task = t0; task < t1; ++task) {
      const int64_t h = task / row_blocks, b0 = (task % row_blocks) * kRows;
      const int64_t rows = std::min<int64_t>(kRows, n - b0), hk = h / G;
      const uint32_t* kh = P.kpk + hk * (m_pad / 16) * dp_count * 16;
      const uint32_t* vh = P.vpk + hk * (m_pad / 2) * D;
      for (int64_t r = 0; r < kRows; ++r) {
        bf16* dst = q_block.data() + r * D;
        if (r < rows) std::memcpy(dst, qp + ((b0 + r) * Hq + h) * D, D * sizeof(bf16));
        else std::memset(dst, 0, D * sizeof(bf16));
      }
      std::fill(o.begin(), o.end(), 0.f);
      std::fill(row_max, row_max + kRows, -INFINITY);
      std::memset(row_sum, 0, sizeof(row_sum));
      const int64_t block_last = P.causal ? std::min(m - 1, offset + b0 + rows - 1) : m - 1;
      for (int64_t j0 = 0; j0 <= block_last; j0 += kTile) {
        amx::qk_tiles(q_block.data(), D, kh + (j0 / 16) * dp_count * 16, dp_count, sc);
        bool rescale = false;
        for (int64_t r = 0; r < kRows; ++r) {
          // padding rows see what the block's last row sees; their output is dropped
          const int64_t q_row = b0 + std::min(r, rows - 1);
          const int64_t limit = P.causal ? std::min(m - 1, offset + q_row) : m - 1;
          alphas[r] = softmax_tile_row(sc[r], j0, limit, scale2, row_max[r], row_sum[r], probs[r]);
          rescale |= alphas[r] != 1.f;
        }
        amx::pv_tiles(probs, vh + (j0 / 2) * D, D, pv.data());
        for (int64_t r = 0; r < kRows; ++r) {
          float* orow = o.data() + r * D;
          const float* prow = pv.data() + r * D;
          if (rescale) {
            const vf a = vs::set1(alphas[r]);
            for (int64_t d = 0; d < D; d += 16)
              vs::store(orow + d, vs::fmadd(vs::load(orow + d), a, vs::load(prow + d)));
          } else {
            for (int64_t d = 0; d < D; d += 16)
              vs::store(orow + d, vs::add(vs::load(orow + d), vs::load(prow + d)));
          }
        }
      }
      for (int64_t r = 0; r < rows; ++r) {
        const vf inv = vs::set1(1.0f / vs::reduce_add(vs::load(row_sum[r])));
        bf16* out = static_cast<bf16*>(P.out) + ((b0 + r) * Hq + h) * D;
        for (int64_t d = 0; d < D; d += 16)
          vs::store_bf16(out + d, vs::mul(vs::load(o.data() + r * D + d), inv));
      }
    }
    amx::attention_tiles_end();
  });
}
#endif

#ifndef VS_BF16_DOT
// pack_kv's emulated layout for keys j0..j0+15 of head h: per dimension pair p, the 16 keys'
// even elements then their odd ones; values as rows, one per key (pv_tile reads v[2i, d..]
// and v[2i + 1, d..]). Keys past m are zeros.
template <typename T, typename KOf, typename VOf>
void widen_keys_values(KOf k_of, VOf v_of, int64_t j0, int64_t m, int64_t h, int64_t D,
                       uint32_t* kdst, uint32_t* vdst) {
  float* kf = reinterpret_cast<float*>(kdst);
  float* vf = reinterpret_cast<float*>(vdst);
  const int64_t dp_count = D / 2;
  for (int64_t lane = 0; lane < 16; ++lane) {
    const int64_t j = j0 + lane;
    if (j >= m) {
      for (int64_t p = 0; p < dp_count; ++p) kf[p * 32 + lane] = kf[p * 32 + 16 + lane] = 0.f;
      std::fill(vf + lane * D, vf + (lane + 1) * D, 0.f);
      continue;
    }
    const T* krow = k_of(j) + h * D;
    const T* vrow = v_of(j) + h * D;
    for (int64_t p = 0; p < dp_count; ++p) {
      kf[p * 32 + lane] = static_cast<float>(krow[2 * p]);
      kf[p * 32 + 16 + lane] = static_cast<float>(krow[2 * p + 1]);
    }
    for (int64_t d = 0; d < D; ++d) vf[lane * D + d] = static_cast<float>(vrow[d]);
  }
}
#endif

// attend() compiled for head size D (16 .. 128, step 16); with ``amx``, on AMX tiles where
// the machine grants them and D is a multiple of 32
void attend_any(const Problem& problem, int64_t D, bool amx = false) {
#ifdef VS_BF16_DOT
  if (amx && D % 32 == 0 && !problem.fp32_io && amx::amx_usable()) {
    attend_amx(problem, D);
    return;
  }
#else
  (void)amx;
#endif
  switch (D / 16) {
    case 1: attend<1, rows_per_block(1)>(problem); break;
    case 2: attend<2, rows_per_block(2)>(problem); break;
    case 3: attend<3, rows_per_block(3)>(problem); break;
    case 4: attend<4, rows_per_block(4)>(problem); break;
    case 5: attend<5, rows_per_block(5)>(problem); break;
    case 6: attend<6, rows_per_block(6)>(problem); break;
    case 7: attend<7, rows_per_block(7)>(problem); break;
    default: attend<8, rows_per_block(8)>(problem); break;
  }
}

}  // namespace

// Keys and values of m tokens repacked for the kernel (token j's [Hk, D] slices at k_of(j),
// v_of(j), of type T): keys as [Hk][stride/16][D/2][16 keys] pairs (k[j, 2p], k[j, 2p+1]),
// values as [Hk][stride/2][D] pairs (v[2i, d], v[2i+1, d]), so one 64-byte load feeds one
// vdpbf16ps; emulated, widened to fp32 once here (see widen_keys_values). Only the 16-key
// groups [g0, g1) are written (keys past m as zeros); ``stride`` is the tokens a head has room
// for. Packing costs about one pass over k and v; a caller attending many query blocks to the
// same keys packs once.
template <typename T, typename KOf, typename VOf>
void pack_groups(KOf k_of, VOf v_of, int64_t m, int64_t Hk, int64_t D, int64_t stride, int64_t g0,
                 int64_t g1, uint32_t* kpk, uint32_t* vpk) {
  const int64_t dp_count = D / 2, groups = g1 - g0;
  if (groups <= 0) return;
  at::parallel_for(0, Hk * groups, 16, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) {
      const int64_t h = t / groups, g = g0 + t % groups, j0 = g * 16;
      uint32_t* dst = kpk + (h * (stride / 16) + g) * dp_count * 16 * kWords;
      uint32_t* vdst = vpk + (h * (stride / 2) + j0 / 2) * D * kWords;
#ifdef VS_BF16_DOT
      const bf16 zero(0.f);
      for (int64_t lane = 0; lane < 16; ++lane) {
        const int64_t j = j0 + lane;
        const bf16* row = j < m ? k_of(j) + h * D : nullptr;
        for (int64_t p = 0; p < dp_count; ++p)
          dst[p * 16 + lane] = row ? pair(row + 2 * p, row + 2 * p + 1) : 0u;
      }
      for (int64_t i = 0; i < 8; ++i) {
        const int64_t j = j0 + 2 * i;
        const bf16* a = j < m ? v_of(j) + h * D : nullptr;
        const bf16* b = j + 1 < m ? v_of(j + 1) + h * D : nullptr;
        for (int64_t d = 0; d < D; ++d)
          vdst[i * D + d] = pair(a ? a + d : &zero, b ? b + d : &zero);
      }
#else
      widen_keys_values<T>(k_of, v_of, j0, m, h, D, dst, vdst);
#endif
    }
  });
}

template <typename T, typename KOf, typename VOf>
void pack_rows(KOf k_of, VOf v_of, int64_t m, int64_t Hk, int64_t D, int64_t m_pad, uint32_t* kpk,
               uint32_t* vpk) {
  pack_groups<T>(k_of, v_of, m, Hk, D, m_pad, 0, m_pad / 16, kpk, vpk);
}

// Room for ``capacity`` tokens in ``keep``, the packing of its first ``reuse`` tokens carried
// over head by head
void grow_packed_keys(PackedKeys& keep, int64_t capacity, int64_t reuse, int64_t Hk, int64_t D) {
  const int64_t group_words = D / 2 * 16 * kWords, pair_words = D * kWords;
  auto opts = at::TensorOptions().dtype(at::kInt);
  at::Tensor keys = at::empty({Hk * capacity / 16 * group_words}, opts);
  at::Tensor values = at::empty({Hk * capacity / 2 * pair_words}, opts);
  if (reuse > 0) {
    const int32_t* ok = keep.keys.data_ptr<int32_t>();
    const int32_t* ov = keep.values.data_ptr<int32_t>();
    for (int64_t h = 0; h < Hk; ++h) {
      std::memcpy(keys.data_ptr<int32_t>() + h * (capacity / 16) * group_words,
                  ok + h * (keep.capacity / 16) * group_words, reuse / 16 * group_words * 4);
      std::memcpy(values.data_ptr<int32_t>() + h * (capacity / 2) * pair_words,
                  ov + h * (keep.capacity / 2) * pair_words, reuse / 2 * pair_words * 4);
    }
  }
  keep.keys = keys;
  keep.values = values;
  keep.capacity = capacity;
  keep.valid = reuse;
}

// The packed keys and values of k, v [m, Hk, D]: the flash kernel's layout (see pack_rows).
// fp32 keys/values are taken as they are by the emulated build, rounded to bf16 by the native.
std::vector<at::Tensor> pack_kv(const at::Tensor& k_in, const at::Tensor& v_in) {
  TORCH_CHECK(k_in.dim() == 3 && v_in.sizes() == k_in.sizes(), "k, v: [tokens, heads, D]");
  const auto dtype = k_in.scalar_type();
  TORCH_CHECK(v_in.scalar_type() == dtype && (dtype == at::kBFloat16 || dtype == at::kFloat),
              "k, v: both bf16 or both fp32");
#ifdef VS_BF16_DOT
  const at::Tensor k = k_in.to(at::kBFloat16).contiguous(), v = v_in.to(at::kBFloat16).contiguous();
  const bool fp32_in = false;
#else
  const at::Tensor k = k_in.contiguous(), v = v_in.contiguous();
  const bool fp32_in = dtype == at::kFloat;
#endif
  const int64_t m = k.size(0), Hk = k.size(1), D = k.size(2);
  TORCH_CHECK(m > 0, "no keys");
  TORCH_CHECK(D % 16 == 0 && D <= 128, "head_dim must be 16..128, step 16");
  const int64_t m_pad = (m + kTile - 1) / kTile * kTile, dp_count = D / 2;
  auto opts = k.options().dtype(at::kInt);
  at::Tensor kpk_t = at::empty({Hk, m_pad / 16, dp_count, 16 * kWords}, opts);
  at::Tensor vpk_t = at::empty({Hk, m_pad / 2, D * kWords}, opts);
  uint32_t* kpk = reinterpret_cast<uint32_t*>(kpk_t.data_ptr<int32_t>());
  uint32_t* vpk = reinterpret_cast<uint32_t*>(vpk_t.data_ptr<int32_t>());
  const int64_t row = Hk * D;
#ifndef VS_BF16_DOT
  if (fp32_in) {
    const float* kp = k.data_ptr<float>();
    const float* vp = v.data_ptr<float>();
    pack_rows<float>([&](int64_t j) { return kp + j * row; }, [&](int64_t j) { return vp + j * row; },
                     m, Hk, D, m_pad, kpk, vpk);
    return {kpk_t, vpk_t, at::scalar_tensor(m, opts.dtype(at::kLong))};
  }
#endif
  (void)fp32_in;
  const bf16* kp = k.data_ptr<bf16>();
  const bf16* vp = v.data_ptr<bf16>();
  pack_rows<bf16>([&](int64_t j) { return kp + j * row; }, [&](int64_t j) { return vp + j * row; },
                  m, Hk, D, m_pad, kpk, vpk);
  return {kpk_t, vpk_t, at::scalar_tensor(m, opts.dtype(at::kLong))};
}

bool amx_attention_usable() {
#ifdef VS_BF16_DOT
  return amx::amx_usable();
#else
  return false;
#endif
}

// q: [n, Hq, D] against keys/values packed by pack_kv (m of them). Query i sits at position
// m - n + i: with ``causal`` it sees keys j <= m - n + i, otherwise all m. Returns
// [n, Hq, D] in q's dtype (bf16, or fp32: computed in fp32 emulated, in bf16 natively).
// ``amx``: the products on AMX tiles where this build and machine have them (amx_attention.h).
at::Tensor attend_packed(const at::Tensor& q_in, const std::vector<at::Tensor>& packed,
                         double scale, bool causal, bool amx) {
  const auto dtype = q_in.scalar_type();
  TORCH_CHECK(q_in.dim() == 3 && (dtype == at::kBFloat16 || dtype == at::kFloat),
              "q: [n, heads, D], bf16 or fp32");
  TORCH_CHECK(packed.size() == 3, "packed: the result of pack_kv");
#ifdef VS_BF16_DOT
  if (dtype == at::kFloat)
    return attend_packed(q_in.to(at::kBFloat16), packed, scale, causal, amx).to(at::kFloat);
#endif
  const at::Tensor q = q_in.contiguous();
  const at::Tensor &kpk = packed[0], &vpk = packed[1];
  const int64_t n = q.size(0), Hq = q.size(1), D = q.size(2), m = packed[2].item<int64_t>();
  const int64_t Hk = kpk.size(0), m_pad = kpk.size(1) * 16;
  TORCH_CHECK(kpk.size(2) * 2 == D && vpk.size(2) == D * kWords, "q and k head dims differ");
  TORCH_CHECK(Hq % Hk == 0, "query heads must be a multiple of KV heads");
  TORCH_CHECK(!causal || m >= n, "causal: the queries are the last n of the m keys");
  at::Tensor out = at::empty({n, Hq, D}, q.options());
  if (n == 0) return out;
  const Problem problem{q.data_ptr(),
                        out.data_ptr(),
                        dtype == at::kFloat,
                        reinterpret_cast<const uint32_t*>(kpk.data_ptr<int32_t>()),
                        reinterpret_cast<const uint32_t*>(vpk.data_ptr<int32_t>()),
                        n, m, Hq, Hq / Hk, m - n, m_pad, static_cast<float>(scale), causal};
  attend_any(problem, D, amx);
  return out;
}

int64_t packed_keys_bytes(int64_t tokens, int64_t Hk, int64_t D) {
  const int64_t cap = (tokens + kTile - 1) / kTile * kTile;
  return 2 * Hk * cap * D * kWords * 4;
}

// See chunk_attention.h. Why a block: the fused step's per-row decode attention reads a row's
// whole context once per row, so 16 rows of a chunk at 1,200 tokens of context spent 2.2 ms a
// layer there; packed once and attended as a block, 1.0 ms (pack 0.27, attend 0.76; AVX2, 12
// heads of 64, 4 KV heads), and with the packing kept between steps, ~0.8.
void attend_cached_chunk(const bf16* q, int64_t q_stride, bf16* out, int64_t out_stride, int64_t n,
                         int64_t Hq, const bf16* kc, const bf16* vc, int64_t Hk, int64_t D,
                         const int64_t* slots, int64_t m, float scale, PackedKeys* keep,
                         int64_t reuse, bool amx) {
  TORCH_CHECK(n >= 1 && m >= n && Hq % Hk == 0 && D % 16 == 0 && D <= 128, "chunk attention shapes");
  const int64_t m_pad = (m + kTile - 1) / kTile * kTile, dp_count = D / 2, row = Hk * D;
  auto opts = at::TensorOptions().dtype(at::kInt);
  at::Tensor kpk_t, vpk_t;
  int64_t stride = m_pad, first_group = 0;
  if (keep != nullptr) {
    // whole 16-key groups of tokens before this chunk, packed by an earlier step
    reuse = std::max<int64_t>(0, std::min({reuse, keep->valid, m - n})) / 16 * 16;
    if (keep->capacity < m_pad) {
      grow_packed_keys(*keep, std::max(m_pad, (keep->capacity * 2) / kTile * kTile), reuse, Hk, D);
    }
    kpk_t = keep->keys;
    vpk_t = keep->values;
    stride = keep->capacity;
    first_group = reuse / 16;
  } else {
    kpk_t = at::empty({Hk, m_pad / 16, dp_count, 16 * kWords}, opts);
    vpk_t = at::empty({Hk, m_pad / 2, D * kWords}, opts);
  }
  uint32_t* kpk = reinterpret_cast<uint32_t*>(kpk_t.data_ptr<int32_t>());
  uint32_t* vpk = reinterpret_cast<uint32_t*>(vpk_t.data_ptr<int32_t>());
  pack_groups<bf16>([&](int64_t j) { return kc + slots[j] * row; },
                    [&](int64_t j) { return vc + slots[j] * row; }, m, Hk, D, stride,
                    first_group, m_pad / 16, kpk, vpk);
  if (keep != nullptr) keep->valid = m / 16 * 16;  // every token up to m is final now
  const int64_t q_row = Hq * D;
  at::Tensor qc = at::empty({n, Hq, D}, opts.dtype(at::kBFloat16));
  at::Tensor oc = at::empty({n, Hq, D}, opts.dtype(at::kBFloat16));
  bf16* qd = qc.data_ptr<bf16>();
  for (int64_t r = 0; r < n; ++r) std::memcpy(qd + r * q_row, q + r * q_stride, q_row * sizeof(bf16));
  const Problem problem{qd, oc.data_ptr(), false, kpk, vpk, n, m, Hq, Hq / Hk, m - n, stride,
                        scale, true};
  attend_any(problem, D, amx);
  const bf16* od = oc.data_ptr<bf16>();
  for (int64_t r = 0; r < n; ++r)
    std::memcpy(out + r * out_stride, od + r * q_row, q_row * sizeof(bf16));
}

at::Tensor flash_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                           double scale, bool causal, bool amx) {
  TORCH_CHECK(q.dim() == 3 && k.dim() == 3 && q.size(2) == k.size(2), "q, k, v: [tokens, heads, D]");
  TORCH_CHECK(q.scalar_type() == k.scalar_type(), "q, k, v: all bf16, or all fp32");
  return attend_packed(q, pack_kv(k, v), scale, causal, amx);
}
