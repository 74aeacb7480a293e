// The flash kernel's two products on AMX tiles (cpu_attention.cpp, native-bf16 build): for 16
// query rows of one head, the scores against a 64-key tile (q.k^T) and the probabilities
// times that tile's values (p.v). The online softmax between them stays in AVX-512.
//
// Why: a camera frame's prompt is prefilled in chunks beside earlier chunks' keys, and on a
// 2-core AMX Xeon the AVX512-BF16 kernel ran such chunks at ~115 GFLOP/s: 128 rows against
// 1,200 keys (bench, 12 heads of 64) took 4.0 ms a layer, half of a 100 ms prompt step. One
// tile product (TDPBF16PS) does 16 x 16 x 32 multiply-adds.
//
// The operands are where the kernel already keeps them: pack_kv's keys ([16-key group][D/2
// pairs][16 keys] words) are B tiles as they lie, 1 KiB per 32 dimensions of a group; its
// values ([key pair][D] words) are B tiles read with a row stride of D words. Queries (16 rows
// x 32 dimensions) and probabilities (16 rows x 32 keys, bf16) are the A tiles.
//
// Functions carry their own target attribute, like amx_gemv.h: nothing else in the build
// uses AMX, and callers enable this only after amx::amx_usable().
#pragma once

#include <immintrin.h>

#include <cstdint>

#include "amx_gemv.h"

namespace amx {

constexpr int kAttnKeys = 64;  // keys per tile step: the flash kernel's kTile

// Every tile 16 rows x 64 bytes: tiles 0-3 accumulate C, 4 holds A (queries), 5 B (keys or
// values), 6 A (probabilities)
struct alignas(64) AttentionTileConfig {
  uint8_t palette = 1, start_row = 0, reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
  AttentionTileConfig() {
    for (int t = 0; t < 7; ++t) colsb[t] = 64, rows[t] = 16;
  }
};

__attribute__((target("amx-tile,amx-bf16"))) inline void attention_tiles_begin() {
  // static: built on the stack, GCC kept only the first 8 bytes' store (it does not see that
  // ldtilecfg reads all 64) and the CPU faulted on the rest
  static const AttentionTileConfig cfg;
  _tile_loadconfig(&cfg);
}

__attribute__((target("amx-tile,amx-bf16"))) inline void attention_tiles_end() {
  _tile_release();
}

// scores[r][16u + i] = q_r . k_(16u + i) for the 64 keys of pack_kv's groups from ``kgroups``
// (their first group's first word), ``q`` 16 rows of D bf16 apart by ``q_stride`` elements;
// ``dp_count`` = D / 2, D a multiple of 32. Unscaled, as qk_tile.
__attribute__((target("amx-tile,amx-bf16"))) inline void qk_tiles(const bf16* q, int64_t q_stride,
                                                                  const uint32_t* kgroups,
                                                                  int64_t dp_count,
                                                                  float (*scores)[kAttnKeys]) {
  const int64_t group_words = dp_count * 16;
  _tile_zero(0);
  _tile_zero(1);
  _tile_zero(2);
  _tile_zero(3);
  for (int64_t c = 0; c < dp_count / 16; ++c) {  // 32 dimensions: 16 pairs
    const uint32_t* k = kgroups + c * 16 * 16;
    _tile_loadd(4, q + 32 * c, q_stride * sizeof(bf16));
    _tile_loadd(5, k, 64);
    _tile_dpbf16ps(0, 4, 5);
    _tile_loadd(5, k + group_words, 64);
    _tile_dpbf16ps(1, 4, 5);
    _tile_loadd(5, k + 2 * group_words, 64);
    _tile_dpbf16ps(2, 4, 5);
    _tile_loadd(5, k + 3 * group_words, 64);
    _tile_dpbf16ps(3, 4, 5);
  }
  constexpr int64_t stride = kAttnKeys * sizeof(float);
  _tile_stored(0, scores[0], stride);
  _tile_stored(1, scores[0] + 16, stride);
  _tile_stored(2, scores[0] + 32, stride);
  _tile_stored(3, scores[0] + 48, stride);
}

// ``Tiles`` (1-4) C tiles of 16 dimensions from ``d0``: pv[r][d] = sum over the 64 keys of
// probs[r][j] * v[j][d], values as pack_kv's pairs from the tile's first pair ``v`` (D words a
// pair)
template <int Tiles>
__attribute__((target("amx-tile,amx-bf16"))) inline void pv_group(const uint16_t (*probs)[kAttnKeys],
                                                                  const uint32_t* v, int64_t D,
                                                                  int64_t d0, float* pv) {
  _tile_zero(0);
  if (Tiles > 1) _tile_zero(1);
  if (Tiles > 2) _tile_zero(2);
  if (Tiles > 3) _tile_zero(3);
  const int64_t v_stride = D * sizeof(uint32_t);
  for (int kc = 0; kc < 2; ++kc) {  // 32 keys: 16 pairs
    const uint32_t* vk = v + int64_t(16) * kc * D + d0;
    _tile_loadd(6, probs[0] + 32 * kc, kAttnKeys * sizeof(uint16_t));
    _tile_loadd(5, vk, v_stride);
    _tile_dpbf16ps(0, 6, 5);
    if (Tiles > 1) {
      _tile_loadd(5, vk + 16, v_stride);
      _tile_dpbf16ps(1, 6, 5);
    }
    if (Tiles > 2) {
      _tile_loadd(5, vk + 32, v_stride);
      _tile_dpbf16ps(2, 6, 5);
    }
    if (Tiles > 3) {
      _tile_loadd(5, vk + 48, v_stride);
      _tile_dpbf16ps(3, 6, 5);
    }
  }
  const int64_t pv_stride = D * sizeof(float);
  _tile_stored(0, pv + d0, pv_stride);
  if (Tiles > 1) _tile_stored(1, pv + d0 + 16, pv_stride);
  if (Tiles > 2) _tile_stored(2, pv + d0 + 32, pv_stride);
  if (Tiles > 3) _tile_stored(3, pv + d0 + 48, pv_stride);
}

// pv [16][D] fp32 = probs [16][64] (bf16 bits) x the tile's values, D a multiple of 32
__attribute__((target("amx-tile,amx-bf16"))) inline void pv_tiles(const uint16_t (*probs)[kAttnKeys],
                                                                  const uint32_t* v, int64_t D,
                                                                  float* pv) {
  int64_t d0 = 0;
  for (; d0 + 64 <= D; d0 += 64) pv_group<4>(probs, v, D, d0, pv);
  if (D - d0 == 32) pv_group<2>(probs, v, D, d0, pv);
}

}  // namespace amx
