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
// int8 weights take the AMX-INT8 products at the end of this file (their int16 activations split
// into two bytes); widened to bf16 tile by tile they ran slower than the int8 panels at 1-8
// rows (session 22): the widening cost more than the bytes it saved.
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

// w [N, K] row-major -> [N / 16][K / TileK][16 rows][TileK]: bf16 (TileK 32) or int8 (64)
template <int TileK, typename T>
inline void pack_tiles(const T* w, int64_t N, int64_t K, T* out) {
  const int64_t blocks = K / TileK;
  for (int64_t t = 0; t < N / kTileRows; ++t)
    for (int64_t b = 0; b < blocks; ++b)
      for (int r = 0; r < kTileRows; ++r)
        std::memcpy(out + ((t * blocks + b) * kTileRows + r) * TileK,
                    w + (t * kTileRows + r) * K + b * TileK, TileK * sizeof(T));
}

inline void pack_weights(const bf16* w, int64_t N, int64_t K, bf16* out) {
  pack_tiles<kTileK>(w, N, K, out);
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

// ---- int8 weights (weight-only int8) on AMX-INT8 tiles ----
//
// Why: the int8 panels' int16 dot product (vpdpwssd) is compute-bound past a few rows on a
// 2-core AMX Xeon: a bench decode step at batch 8 took 12.6 ms against bf16's 14.6 on tiles
// (1.16x for half the bytes), at batch 1 7.0 against 12.4. One int8 tile product (TDPBSSD)
// does 16 x 16 x 64 multiply-adds at a cost that does not grow with the rows. It costs two per
// KiB of weights here (the split below), as many as bf16's per KiB, and the 2-core AMX VM
// ran them at 20-50 ns each on a matrix in cache (a /tmp driver; the manuals say 16 cycles):
// at 1-4 rows the panels stay faster (cpu_decode.cpp's kI8TileRows).
//
// The tiles multiply bytes, the activations are int16 (the panels' quantisation: one fp32
// scale per row and 256 k, 15 bits against that stretch's largest |x|). Each int16 is split
// exactly into a signed high byte and an unsigned low one, x = 256 h + l, and a stretch's sum
// is 256 (w . h) + (w . l): TDPBSSD for the high bytes, TDPBSUD (signed weights, unsigned
// activations) for the low ones. Both are exact int32 sums of what the panels' vpdpwssd sums,
// so the tiles give the panels' result bit for bit (the int32 fits: 256 k x 32767 x 128 < 2^31).

constexpr int kTileKI8 = 64;       // k per int8 tile product: 16 quads
constexpr int kChunkBlocksI8 = 4;  // tile products per activation scale: 256 k
constexpr int kGroupTilesI8 = 2;   // weight tiles per pass: 2 x (high, low) C tiles live

// As amx_usable, for the int8 tile products
inline bool amx_int8_usable() {
  return amx_usable() && __builtin_cpu_supports("amx-int8");
}

inline bool tileable_i8(int64_t N, int64_t K) { return N % kTileRows == 0 && K % kTileKI8 == 0; }

// The int8 weights as tiles: [N / 16][K / 64][16 rows][64 k], each A tile 1 KiB in one piece
inline void pack_weights_i8(const int8_t* w, int64_t N, int64_t K, int8_t* out) {
  pack_tiles<kTileKI8>(w, N, K, out);
}

// int16 activations xq [M, ld] (first K used, K a multiple of 64) -> the B tiles of their high
// and low bytes: block b holds (x[m][64b + 4q .. 4q + 3]) at row q, column m, four bytes each.
// A transpose of [M][K / 4] 4-byte quads, 64 k at a time: byte by byte it was half of a
// 16-row tile GEMV's time on a matrix in cache.
__attribute__((target("avx512f,avx512bw"))) inline void pack_activations_i8(
    int M, const int16_t* xq, int64_t ld, int64_t K, int8_t* hi, uint8_t* lo) {
  int32_t* hi32 = reinterpret_cast<int32_t*>(hi);
  int32_t* lo32 = reinterpret_cast<int32_t*>(lo);
  const __m512i idx = _mm512_mullo_epi32(
      _mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0), _mm512_set1_epi32(M));
  for (int m = 0; m < M; ++m)
    for (int64_t k = 0; k < K; k += 64) {
      const __m512i v0 = _mm512_loadu_si512(xq + m * ld + k);
      const __m512i v1 = _mm512_loadu_si512(xq + m * ld + k + 32);
      // arithmetic shift: the high byte is floor(x / 256), in [-128, 127]; truncation keeps it
      const __m512i h = _mm512_inserti64x4(
          _mm512_castsi256_si512(_mm512_cvtepi16_epi8(_mm512_srai_epi16(v0, 8))),
          _mm512_cvtepi16_epi8(_mm512_srai_epi16(v1, 8)), 1);
      const __m512i l = _mm512_inserti64x4(_mm512_castsi256_si512(_mm512_cvtepi16_epi8(v0)),
                                           _mm512_cvtepi16_epi8(v1), 1);
      const int64_t at = k / 4 * M + m;  // quad k / 4 of column m
      _mm512_i32scatter_epi32(hi32 + at, idx, h, 4);
      _mm512_i32scatter_epi32(lo32 + at, idx, l, 4);
    }
}

// tiles 0-3: C (weight tile j's high sums in 2j, low in 2j + 1: 16 weight rows x M int32),
// 4-5: B (high, low: 16 k quads x M quads), 6-7: A (16 weight rows x 64 k)
struct alignas(64) TileConfigI8 {
  uint8_t palette = 1, start_row = 0, reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
  explicit TileConfigI8(int M) {
    for (int t = 0; t < 6; ++t) colsb[t] = static_cast<uint16_t>(4 * M), rows[t] = kTileRows;
    for (int t = 6; t < 8; ++t) colsb[t] = kTileKI8, rows[t] = kTileRows;
  }
};

// The activation scales as the combine below reads them: C tiles are stored [16 weight rows][M]
// int32, i.e. 16 M values read 16 at a time, so vector i of stretch c holds the scale of
// column (16 i + e) % M in lane e: [chunks][M][16]
inline std::vector<float> scale_lanes(int M, const float* scale, int64_t chunks) {
  std::vector<float> out(static_cast<size_t>(chunks) * M * 16);
  for (int64_t c = 0; c < chunks; ++c)
    for (int i = 0; i < M; ++i)
      for (int e = 0; e < 16; ++e) out[(c * M + i) * 16 + e] = scale[c * M + (16 * i + e) % M];
  return out;
}

// ``Tiles`` weight tiles from tile ``t0`` over all of k: per 256-k stretch c, the int32 sums
// leave the tiles and acc[j][r][m] += float(256 hi + lo) * scale[c][m], in stretch order (the
// panels' order, so the result is theirs). acc is [Tiles][16][M], the C tiles' own layout, so
// the combine runs 16 values a vector whatever M is (M vectors a tile).
template <int Tiles>
__attribute__((target("amx-tile,amx-int8,avx512f"))) inline void group_pass_i8(
    const int8_t* w, int64_t K, int64_t t0, const int8_t* b_hi, const uint8_t* b_lo, int M,
    const float* lanes, int64_t chunks, float* acc) {
  constexpr int64_t a_tile = kTileRows * kTileKI8;
  const int64_t blocks = K / kTileKI8, b_stride = 4 * M, b_block = int64_t(kTileKI8) * M;
  const int8_t* a = w + t0 * blocks * a_tile;
  const int64_t next_tile = blocks * a_tile;
  alignas(64) int32_t c[2 * Tiles][kTileRows * kMaxRows];
  const int64_t c_stride = 4 * M, tile_values = int64_t(kTileRows) * M;
  for (int64_t ch = 0; ch < chunks; ++ch) {
    _tile_zero(0);
    _tile_zero(1);
    if (Tiles > 1) {
      _tile_zero(2);
      _tile_zero(3);
    }
    const int64_t b1 = std::min(blocks, (ch + 1) * kChunkBlocksI8);  // the last may be short
    for (int64_t b = ch * kChunkBlocksI8; b < b1; ++b, a += a_tile) {
      for (int j = 0; j < Tiles; ++j)
        for (int l = 0; l < 16; ++l)
          __builtin_prefetch(reinterpret_cast<const char*>(a + j * next_tile) + kAhead + 64 * l);
      _tile_loadd(4, b_hi + b * b_block, b_stride);
      _tile_loadd(5, b_lo + b * b_block, b_stride);
      _tile_loadd(6, a, kTileKI8);
      _tile_dpbssd(0, 6, 4);
      _tile_dpbsud(1, 6, 5);
      if (Tiles > 1) {
        _tile_loadd(7, a + next_tile, kTileKI8);
        _tile_dpbssd(2, 7, 4);
        _tile_dpbsud(3, 7, 5);
      }
    }
    _tile_stored(0, c[0], c_stride);
    _tile_stored(1, c[1], c_stride);
    if (Tiles > 1) {
      _tile_stored(2, c[2], c_stride);
      _tile_stored(3, c[3], c_stride);
    }
    const float* sc = lanes + ch * M * 16;
    for (int j = 0; j < Tiles; ++j)
      for (int64_t i = 0; i < M; ++i) {  // tile_values = 16 M: M whole vectors
        const __m512i hi = _mm512_load_si512(c[2 * j] + 16 * i);
        const __m512i lo = _mm512_load_si512(c[2 * j + 1] + 16 * i);
        const __m512 sum = _mm512_cvtepi32_ps(_mm512_add_epi32(_mm512_slli_epi32(hi, 8), lo));
        float* out = acc + j * tile_values + 16 * i;
        const __m512 prev = ch == 0 ? _mm512_setzero_ps() : _mm512_load_ps(out);
        _mm512_store_ps(out, _mm512_fmadd_ps(sum, _mm512_load_ps(sc + 16 * i), prev));
      }
  }
}

// acc[m * ld_acc + (n - n0)] = w_scales[n] * sum_c scale[c][m] (w[n, :] . xq[m, :]) over the
// 256-k stretches c, for n in [n0, n1) (multiples of 16); ``w`` from pack_weights_i8, the B
// tiles from pack_activations_i8, ``lanes`` from scale_lanes
__attribute__((target("amx-tile,amx-int8,avx512f"))) inline void dot_rows_i8(
    int M, const int8_t* b_hi, const uint8_t* b_lo, const float* lanes, const int8_t* w,
    const float* w_scales, int64_t K, int64_t n0, int64_t n1, float* acc, int64_t ld_acc) {
  const TileConfigI8 cfg(M);
  asm volatile("" : : "r"(&cfg) : "memory");  // every byte of cfg stored: see dot_rows
  _tile_loadconfig(&cfg);
  const int64_t chunks = (K / kTileKI8 + kChunkBlocksI8 - 1) / kChunkBlocksI8;
  alignas(64) float c[kGroupTilesI8 * kTileRows * kMaxRows];
  for (int64_t n = n0; n < n1; n += kGroupTilesI8 * kTileRows) {
    const int tiles = static_cast<int>(std::min<int64_t>(kGroupTilesI8, (n1 - n) / kTileRows));
    if (tiles == 1)
      group_pass_i8<1>(w, K, n / kTileRows, b_hi, b_lo, M, lanes, chunks, c);
    else
      group_pass_i8<2>(w, K, n / kTileRows, b_hi, b_lo, M, lanes, chunks, c);
    for (int64_t r = 0; r < tiles * kTileRows; ++r)
      for (int m = 0; m < M; ++m)
        acc[m * ld_acc + (n + r - n0)] = c[r * M + m] * w_scales[n + r];
  }
  _tile_release();
}

}  // namespace amx
