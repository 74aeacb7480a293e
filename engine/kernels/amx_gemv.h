// The decode GEMV on AMX tiles (Sapphire Rapids and later Xeons): y[m, n] = dot(x[m, :], w[n, :])
// for 1..16 activation rows against bf16 weights, what the native build's dot-product GEMV
// computes, up to summation order.
//
// Why: on a 2-core AMX Xeon the AVX512-BF16 dot product is compute-bound from a few rows on --
// a bench decode step took 12.0 ms at batch 1 (78 % of the read bandwidth) and 21.1 at batch 8
// -- so every camera prompt row beside 4 chat decodes made the chat step longer. One tile
// product (TDPBF16PS) does 16 x 16 x 32 multiply-adds; with the weights as the A operand (16
// weight rows x 32 k) and the activations as B (32 k x M rows in the VNNI pair layout, packed
// once per call: M x K bf16), a matrix costs about what reading it costs at any row count up
// to 16. The weights are a second copy, packed tile by tile (pack_weights), so that each tile
// load reads 1 KiB in one piece: loaded from the row-major matrix (16 rows' lines in up to 6
// pages per load) a bench decoder pass ran 24-30 ms at 8 rows in some minutes and 12-15 in
// others on a 4 KiB-page VM.
//
// bf16 weights only: int8 ones widened to bf16 tile by tile (exact; half the bytes) ran slower
// than the int8 panels' int16 dot product at 1-8 rows (12.0 / 13.7 / 17.2 ms a bench decode
// step at batch 1 / 4 / 8 against 10.1 / 10.3 / 15.6, session 22): the widening costs more than
// the bytes it saves.
//
// Only the native-bf16 build includes this; the functions carry their own target attribute, so
// nothing else in the build may use AMX instructions and a CPU without AMX never runs them
// (FusedDecoder enables the path only after amx_usable()).
#pragma once

#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

#include <c10/util/BFloat16.h>

namespace amx {

using bf16 = c10::BFloat16;

constexpr int kTileRows = 16;  // weight rows per tile (A rows, C rows)
constexpr int kTileK = 32;     // k per tile product: 16 pairs of bf16
constexpr int kGroupTiles = 4;  // C tiles kept live: 64 weight rows per pass over k
constexpr int kMaxRows = 16;    // activation rows (B and C columns)
// bytes ahead each of the 4 tile streams asks for (the bench decoder's GEMVs alone at 1 and 4
// rows, 2-core AMX Xeon, two rounds each: none 14.0 / 14.5 ms; 2 KiB 10.8-14.6; 4 KiB
// 12.7-14.2: ahead helps, 2 and 4 KiB within the machine's noise of each other)
constexpr int64_t kAhead = 4096;

// Linux hands out the 8 KiB tile state only to processes that ask (arch_prctl); oneDNN asks
// too. True when the CPU has AMX-BF16 and the kernel granted it.
inline bool amx_usable() {
  static const bool ok = [] {
    if (!__builtin_cpu_supports("amx-bf16") || !__builtin_cpu_supports("amx-tile")) return false;
    constexpr long kArchReqXcompPerm = 0x1023, kXfeatureXtiledata = 18;
    return syscall(SYS_arch_prctl, kArchReqXcompPerm, kXfeatureXtiledata) == 0;
  }();
  return ok;
}

// The 64-byte tile configuration (palette 1): tiles 0-3 accumulate C (16 weight rows x M fp32),
// 4 holds B (16 k pairs x M pairs), 5-7 take A (16 weight rows x 32 bf16)
struct alignas(64) TileConfig {
  uint8_t palette = 1, start_row = 0, reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
  explicit TileConfig(int M) {
    for (int t = 0; t < 4; ++t) colsb[t] = static_cast<uint16_t>(4 * M), rows[t] = kTileRows;
    colsb[4] = static_cast<uint16_t>(4 * M), rows[4] = kTileK / 2;
    for (int t = 5; t < 8; ++t) colsb[t] = 2 * kTileK, rows[t] = kTileRows;
  }
};

// x [M, K] bf16 -> B tiles: block b holds pairs (x[m][32b + 2p], x[m][32b + 2p + 1]) at row p,
// column m. K must be a multiple of kTileK.
inline std::vector<bf16> pack_activations(int M, const bf16* x, int64_t K) {
  std::vector<bf16> out(static_cast<size_t>(K) * M);
  const uint32_t* src = reinterpret_cast<const uint32_t*>(x);  // a bf16 pair as one word
  uint32_t* dst = reinterpret_cast<uint32_t*>(out.data());
  const int64_t pairs = K / 2;
  for (int64_t p = 0; p < pairs; ++p)
    for (int m = 0; m < M; ++m) dst[p * M + m] = src[m * pairs + p];
  return out;
}

// The weights as tiles: [N / 16][K / 32][16 rows][32 k], each A tile 1 KiB in one piece
inline bool tileable(int64_t N, int64_t K) { return N % kTileRows == 0 && K % kTileK == 0; }

inline void pack_weights(const bf16* w, int64_t N, int64_t K, bf16* out) {
  const int64_t blocks = K / kTileK;
  for (int64_t t = 0; t < N / kTileRows; ++t)
    for (int64_t b = 0; b < blocks; ++b)
      for (int r = 0; r < kTileRows; ++r)
        std::memcpy(out + ((t * blocks + b) * kTileRows + r) * kTileK,
                    w + (t * kTileRows + r) * K + b * kTileK, kTileK * sizeof(bf16));
}

// ``Tiles`` C tiles of 16 weight rows from tile ``t0`` (tile-packed weights), over all of k
template <int Tiles>
__attribute__((target("amx-tile,amx-bf16"))) inline void group_pass(const bf16* w, int64_t K,
                                                                    int64_t t0,
                                                                    const bf16* b_tiles, int M,
                                                                    float* c_out) {
  constexpr int64_t a_stride = kTileK * sizeof(bf16), a_tile = kTileRows * kTileK;
  const int64_t blocks = K / kTileK, b_stride = 4 * M, b_block = int64_t(kTileK) * M;
  const bf16* a = w + t0 * blocks * a_tile;
  const int64_t next_tile = blocks * a_tile;  // the same k block of the next weight tile
  _tile_zero(0);
  if (Tiles > 1) _tile_zero(1);
  if (Tiles > 2) _tile_zero(2);
  if (Tiles > 3) _tile_zero(3);
  for (int64_t b = 0; b < blocks; ++b, a += a_tile) {
    for (int j = 0; j < Tiles; ++j)
      for (int l = 0; l < 16; ++l)
        __builtin_prefetch(reinterpret_cast<const char*>(a + j * next_tile) + kAhead + 64 * l);
    _tile_loadd(4, b_tiles + b * b_block, b_stride);
    _tile_loadd(5, a, a_stride);
    _tile_dpbf16ps(0, 5, 4);
    if (Tiles > 1) {
      _tile_loadd(6, a + next_tile, a_stride);
      _tile_dpbf16ps(1, 6, 4);
    }
    if (Tiles > 2) {
      _tile_loadd(7, a + 2 * next_tile, a_stride);
      _tile_dpbf16ps(2, 7, 4);
    }
    if (Tiles > 3) {
      _tile_loadd(5, a + 3 * next_tile, a_stride);
      _tile_dpbf16ps(3, 5, 4);
    }
  }
  const int64_t c_stride = 4 * M, c_tile = int64_t(kTileRows) * M;
  _tile_stored(0, c_out, c_stride);
  if (Tiles > 1) _tile_stored(1, c_out + c_tile, c_stride);
  if (Tiles > 2) _tile_stored(2, c_out + 2 * c_tile, c_stride);
  if (Tiles > 3) _tile_stored(3, c_out + 3 * c_tile, c_stride);
}

// acc[m * ld_acc + (n - n0)] = dot(x[m, :], w[n, :]) for n in [n0, n1), both multiples of 16,
// ``w`` tile-packed (pack_weights), ``b_tiles`` from pack_activations
__attribute__((target("amx-tile,amx-bf16"))) inline void dot_rows(int M, const bf16* b_tiles,
                                                                  const bf16* w, int64_t K,
                                                                  int64_t n0, int64_t n1,
                                                                  float* acc, int64_t ld_acc) {
  const TileConfig cfg(M);
  // every byte of cfg stored before ldtilecfg reads it: GCC does not see that it reads all 64
  // (amx_attention.h's config, built the same way, kept only its first 8 bytes and faulted)
  asm volatile("" : : "r"(&cfg) : "memory");
  _tile_loadconfig(&cfg);
  alignas(64) float c[kGroupTiles * kTileRows * kMaxRows];
  for (int64_t n = n0; n < n1; n += kGroupTiles * kTileRows) {
    const int tiles = static_cast<int>(std::min<int64_t>(kGroupTiles, (n1 - n) / kTileRows));
    const int64_t t0 = n / kTileRows;
    switch (tiles) {
      case 1: group_pass<1>(w, K, t0, b_tiles, M, c); break;
      case 2: group_pass<2>(w, K, t0, b_tiles, M, c); break;
      case 3: group_pass<3>(w, K, t0, b_tiles, M, c); break;
      default: group_pass<4>(w, K, t0, b_tiles, M, c); break;
    }
    // C is [weight row][activation row]; acc wants activation rows apart
    for (int64_t r = 0; r < tiles * kTileRows; ++r)
      for (int m = 0; m < M; ++m) acc[m * ld_acc + (n + r - n0)] = c[r * M + m];
  }
  _tile_release();  // back to the init state: a context switch then saves no tile data
}

}  // namespace amx
