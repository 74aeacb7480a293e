// One prompt chunk's attention to its sequence's paged keys and values (cpu_attention.cpp),
// as the fused step (cpu_decode.cpp) calls it.
#pragma once

#include <torch/extension.h>

#include <cstdint>

// A sequence's keys and values of one layer in the flash kernel's packed layout, kept between
// the fused steps that prefill its prompt chunk by chunk, so that a step packs only the tokens
// it adds. Why: every 16-row step repacked (and, emulated, widened to fp32) the whole context,
// 0.27 ms a layer at 1,200 tokens, 6 % of a frame's prompt steps on a 2-core AVX2 EPYC, plus
// the page faults of a fresh 2.6 MB buffer per layer and step.
struct PackedKeys {
  at::Tensor keys, values;  // int32 words; room for ``capacity`` tokens per KV head
  int64_t capacity = 0;     // a multiple of the kernel's 64-key tile
  int64_t valid = 0;        // tokens [0, valid) hold their final packing (a multiple of 16)
};

// Causal attention of n query rows (tokens m - n .. m - 1 of a sequence) to that sequence's
// keys and values in the paged cache (caches [slots, Hk, D], token j at slots[j]). With
// ``keep``, the packing of tokens [0, reuse) is taken from it (the caller vouches that their
// slots and values are those it was packed from) and the rest is packed into it. ``amx``: the
// products on AMX tiles (amx_attention.h) where the build and the machine have them.
void attend_cached_chunk(const at::BFloat16* q, int64_t q_stride, at::BFloat16* out,
                         int64_t out_stride, int64_t n, int64_t Hq, const at::BFloat16* kc,
                         const at::BFloat16* vc, int64_t Hk, int64_t D, const int64_t* slots,
                         int64_t m, float scale, PackedKeys* keep = nullptr, int64_t reuse = 0,
                         bool amx = false);

// Whether this build and machine run the flash kernel on AMX tiles (the OS granted the state)
bool amx_attention_usable();

// Bytes one layer's PackedKeys holds for ``tokens`` tokens of Hk heads of size D
int64_t packed_keys_bytes(int64_t tokens, int64_t Hk, int64_t D);
