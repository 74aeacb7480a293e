// Weight-only int8 linear for CPUs with AVX2 + FMA (every x86 CPU since 2013, AVX-512 ones
// included): y[m, n] = scale[n] * sum_k x[m, k] * w[n, k] (+ bias[n]).
//
// Why: a decode step is a handful of rows against every weight, so its time is the bytes it
// streams. int8 weights are a quarter of fp32's and half of bf16's; each byte is widened to
// fp32 in registers (vpmovsxbd + vcvtdq2ps) and fed to FMAs, so the product stays in fp32.
// Prefill-sized products (many rows) are compute-bound instead: for them the layer
// dequantizes the weight once per call (``dequantize``) and runs the fp32 GEMM.
//
// Layout: x [M, K] fp32 row-major; w [N, K] int8 row-major (one output channel per row, its
// scale in ``scales``); K a multiple of 8 is the fast path, a scalar tail handles the rest.
#include <immintrin.h>
#include <torch/extension.h>

#include <algorithm>
#include <cstdint>

namespace {

constexpr int64_t kMaxRows = 8;  // rows sharing one pass over the weights

inline float hsum(__m256 v) {
  __m128 lo = _mm256_castps256_ps128(v);
  __m128 hi = _mm256_extractf128_ps(v, 1);
  lo = _mm_add_ps(lo, hi);
  lo = _mm_hadd_ps(lo, lo);
  lo = _mm_hadd_ps(lo, lo);
  return _mm_cvtss_f32(lo);
}

inline __m256 widen8(const int8_t* p) {
  __m128i bytes = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(p));
  return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(bytes));
}

// Rows [m0, m0 + rows) of x against output channels [n0, n1).
template <int ROWS>
void gemv_block(const float* x, const int8_t* w, const float* scales, const float* bias,
                float* y, int64_t K, int64_t N, int64_t n0, int64_t n1) {
  const int64_t k8 = K & ~int64_t(7);
  for (int64_t n = n0; n < n1; ++n) {
    const int8_t* wn = w + n * K;
    __m256 acc[ROWS];
    for (int r = 0; r < ROWS; ++r) acc[r] = _mm256_setzero_ps();
    for (int64_t k = 0; k < k8; k += 8) {
      __m256 wv = widen8(wn + k);
      for (int r = 0; r < ROWS; ++r) {
        acc[r] = _mm256_fmadd_ps(wv, _mm256_loadu_ps(x + r * K + k), acc[r]);
      }
    }
    const float s = scales[n];
    const float b = bias ? bias[n] : 0.0f;
    for (int r = 0; r < ROWS; ++r) {
      float sum = hsum(acc[r]);
      for (int64_t k = k8; k < K; ++k) sum += x[r * K + k] * static_cast<float>(wn[k]);
      y[r * N + n] = sum * s + b;
    }
  }
}

void gemv_rows(int64_t rows, const float* x, const int8_t* w, const float* scales,
               const float* bias, float* y, int64_t K, int64_t N, int64_t n0, int64_t n1) {
  switch (rows) {
    case 1: gemv_block<1>(x, w, scales, bias, y, K, N, n0, n1); break;
    case 2: gemv_block<2>(x, w, scales, bias, y, K, N, n0, n1); break;
    case 3: gemv_block<3>(x, w, scales, bias, y, K, N, n0, n1); break;
    case 4: gemv_block<4>(x, w, scales, bias, y, K, N, n0, n1); break;
    case 5: gemv_block<5>(x, w, scales, bias, y, K, N, n0, n1); break;
    case 6: gemv_block<6>(x, w, scales, bias, y, K, N, n0, n1); break;
    case 7: gemv_block<7>(x, w, scales, bias, y, K, N, n0, n1); break;
    default: gemv_block<8>(x, w, scales, bias, y, K, N, n0, n1); break;
  }
}

void check_inputs(const torch::Tensor& w, const torch::Tensor& scales) {
  TORCH_CHECK(w.dim() == 2 && w.scalar_type() == torch::kInt8 && w.is_contiguous(),
              "w must be a contiguous [N, K] int8 tensor");
  TORCH_CHECK(scales.dim() == 1 && scales.size(0) == w.size(0) &&
                  scales.scalar_type() == torch::kFloat && scales.is_contiguous(),
              "scales must be a contiguous fp32 [N] tensor");
}

}  // namespace

// x [M, K] fp32 -> y [M, N] fp32. Output channels are split across threads; rows go in
// groups of up to kMaxRows so each weight byte is read once per group.
torch::Tensor int8_matmul(torch::Tensor x, torch::Tensor w, torch::Tensor scales,
                          c10::optional<torch::Tensor> bias) {
  check_inputs(w, scales);
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == torch::kFloat && x.size(1) == w.size(1),
              "x must be fp32 [M, K] with K = w.size(1)");
  x = x.contiguous();
  const int64_t M = x.size(0), K = x.size(1), N = w.size(0);
  auto y = torch::empty({M, N}, x.options());
  const float* bias_ptr = nullptr;
  torch::Tensor bias_f;
  if (bias.has_value() && bias->defined()) {
    bias_f = bias->to(torch::kFloat).contiguous();
    TORCH_CHECK(bias_f.numel() == N, "bias must have N elements");
    bias_ptr = bias_f.data_ptr<float>();
  }
  const float* xp = x.data_ptr<float>();
  const int8_t* wp = w.data_ptr<int8_t>();
  const float* sp = scales.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  constexpr int64_t kChunk = 16;  // output channels per scheduling unit
#pragma omp parallel for schedule(static)
  for (int64_t c = 0; c < (N + kChunk - 1) / kChunk; ++c) {
    const int64_t n0 = c * kChunk, n1 = std::min(N, n0 + kChunk);
    for (int64_t m = 0; m < M; m += kMaxRows) {
      const int64_t rows = std::min(kMaxRows, M - m);
      gemv_rows(rows, xp + m * K, wp, sp, bias_ptr, yp + m * N, K, N, n0, n1);
    }
  }
  return y;
}

// w [N, K] int8 -> out [N, K] fp32 (w * scales[:, None]), into a caller-owned buffer so a
// prefill-sized product reuses one allocation per layer shape.
void dequantize_into(torch::Tensor w, torch::Tensor scales, torch::Tensor out) {
  check_inputs(w, scales);
  TORCH_CHECK(out.scalar_type() == torch::kFloat && out.is_contiguous() &&
                  out.sizes() == w.sizes(),
              "out must be a contiguous fp32 tensor shaped like w");
  const int64_t N = w.size(0), K = w.size(1);
  const int64_t k8 = K & ~int64_t(7);
  const int8_t* wp = w.data_ptr<int8_t>();
  const float* sp = scales.data_ptr<float>();
  float* op = out.data_ptr<float>();
#pragma omp parallel for schedule(static)
  for (int64_t n = 0; n < N; ++n) {
    const __m256 s = _mm256_set1_ps(sp[n]);
    const int8_t* wn = wp + n * K;
    float* on = op + n * K;
    for (int64_t k = 0; k < k8; k += 8) _mm256_storeu_ps(on + k, _mm256_mul_ps(widen8(wn + k), s));
    for (int64_t k = k8; k < K; ++k) on[k] = static_cast<float>(wn[k]) * sp[n];
  }
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("int8_matmul", &int8_matmul, "x fp32 [M,K] @ (int8 w [N,K] * scales[N]).T (+ bias)");
  m.def("dequantize_into", &dequantize_into, "int8 w [N,K] * scales[N] -> fp32 out [N,K]");
}
