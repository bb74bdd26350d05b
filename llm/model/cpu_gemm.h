// A float32 GEMM for AVX2 on weights packed in panels of 16 output columns (cpu_linear.cpp's panel_linear;
// llm/model/cpu_kernels.py documents when it runs instead of oneDNN).
//
// NOTE: a panel is 16 columns of the weight, K-major: (K, 16) floats, one 64-byte line per k. A tile of R <= 6 rows
// of x times one panel keeps its R x 16 sums in 12 ymm registers (named one by one: GCC spills an array of __m256
// to the stack on every k), and per k reads one line of the panel and broadcasts R values of x: 2R FMAs for 2 loads
// and R broadcasts. The rows of x are tiled over each panel in turn, so a panel comes from memory once and is reused
// from L1/L2 by the other tiles; the first tile prefetches the next panel a line per k, which hides most of its trip
// from memory behind this panel's FMAs. The register tile is the classic one of GotoBLAS/BLIS (6 x 16 for AVX2);
// the code is ours.
#pragma once
#include <cstdint>

#include "cpu_simd.h"

#ifdef HAVE_AVX2
#define GEMM_ACC(r) __m256 c##r##0 = z0, c##r##1 = z1;
#define GEMM_FMA(r)                                                  \
  if constexpr (R > r) {                                             \
    const __m256 a = _mm256_broadcast_ss(x + r * ldx + k);           \
    c##r##0 = _mm256_fmadd_ps(a, b0, c##r##0);                       \
    c##r##1 = _mm256_fmadd_ps(a, b1, c##r##1);                       \
  }
#define GEMM_STORE(r)                                                \
  if constexpr (R > r) {                                             \
    _mm256_storeu_ps(y + r * ldy, c##r##0);                          \
    _mm256_storeu_ps(y + r * ldy + 8, c##r##1);                      \
  }

// y[r, 0:16] = bias[0:16] + sum_k x[r, k] * panel[k, 0:16] for r < R; `next`: the panel to prefetch, or null.
template <int R>
static inline void gemm_tile(const float* x, int64_t ldx, const float* panel, int64_t K, float* y, int64_t ldy,
                             const float* bias, const float* next) {
  const __m256 z0 = bias ? _mm256_loadu_ps(bias) : _mm256_setzero_ps();
  const __m256 z1 = bias ? _mm256_loadu_ps(bias + 8) : _mm256_setzero_ps();
  GEMM_ACC(0) GEMM_ACC(1) GEMM_ACC(2) GEMM_ACC(3) GEMM_ACC(4) GEMM_ACC(5)
  for (int64_t k = 0; k < K; ++k) {
    if (next) _mm_prefetch(reinterpret_cast<const char*>(next + k * 16), _MM_HINT_T0);
    const __m256 b0 = _mm256_loadu_ps(panel + k * 16), b1 = _mm256_loadu_ps(panel + k * 16 + 8);
    GEMM_FMA(0) GEMM_FMA(1) GEMM_FMA(2) GEMM_FMA(3) GEMM_FMA(4) GEMM_FMA(5)
  }
  GEMM_STORE(0) GEMM_STORE(1) GEMM_STORE(2) GEMM_STORE(3) GEMM_STORE(4) GEMM_STORE(5)
}

// All T rows of x (T, K) times one panel into y[:, 0:16], in tiles of at most 6 rows as even as they come (32 rows:
// 6, 6, 5, 5, 5, 5, not five 6s and a 2 that reads the panel for 2 rows).
static inline void gemm_panel(const float* x, int64_t T, int64_t K, const float* panel, float* y, int64_t ldy,
                              const float* bias, const float* next) {
  const int64_t tiles = (T + 5) / 6;
  for (int64_t i = 0, t = 0; i < tiles; ++i) {
    const int64_t r = (T - t + (tiles - i) - 1) / (tiles - i);
    const float* nx = i == 0 ? next : nullptr;
    const float* xr = x + t * K;
    float* yr = y + t * ldy;
    switch (r) {
      case 6: gemm_tile<6>(xr, K, panel, K, yr, ldy, bias, nx); break;
      case 5: gemm_tile<5>(xr, K, panel, K, yr, ldy, bias, nx); break;
      case 4: gemm_tile<4>(xr, K, panel, K, yr, ldy, bias, nx); break;
      case 3: gemm_tile<3>(xr, K, panel, K, yr, ldy, bias, nx); break;
      case 2: gemm_tile<2>(xr, K, panel, K, yr, ldy, bias, nx); break;
      default: gemm_tile<1>(xr, K, panel, K, yr, ldy, bias, nx); break;
    }
    t += r;
  }
}

// Panels [p0, p1) of `panels` (P, K, 16) into y's columns from 0 (ldy apart): x (T, K) times them, plus bias.
static inline void gemm_panels(const float* x, int64_t T, int64_t K, const float* panels, int64_t p0, int64_t p1,
                               float* y, int64_t ldy, const float* bias) {
  for (int64_t p = p0; p < p1; ++p)
    gemm_panel(x, T, K, panels + p * K * 16, y + (p - p0) * 16, ldy, bias ? bias + p * 16 : nullptr,
               p + 1 < p1 ? panels + (p + 1) * K * 16 : nullptr);
}
#undef GEMM_ACC
#undef GEMM_FMA
#undef GEMM_STORE
#endif
