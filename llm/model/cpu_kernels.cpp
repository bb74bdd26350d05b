// The engine's CPU kernels (llm/model/cpu_kernels.py builds and documents them).
#include <ATen/core/Tensor.h>
#include <torch/csrc/utils/pybind.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <algorithm>
#include <cmath>
#include <cstring>
#include <type_traits>
#include <vector>

#include "cpu_share.h"
#include "cpu_simd.h"

void bind_attention(py::module& m);  // cpu_attention.cpp: paged decode attention
void bind_linear(py::module& m);     // cpu_linear.cpp: oneDNN linears in column chunks, shared

// Rounds a float through T, as a torch op producing a T tensor would.
template <typename T>
static inline float through(float x) { return static_cast<float>(static_cast<T>(x)); }

// x (T, D) += delta (if given), then out = weight * T(x * rsqrt(mean(x^2) + eps)): transformers' Qwen2RMSNorm
// (float32 inside, the normalised row rounded to T before the weight), with the residual add before it.
at::Tensor add_rms_norm(at::Tensor x, c10::optional<at::Tensor> delta, at::Tensor weight, double eps) {
  TORCH_CHECK(x.is_contiguous() && weight.is_contiguous() && x.dim() == 2);
  const int64_t T = x.size(0), D = x.size(1);
  auto out = at::empty_like(x);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "add_rms_norm", [&] {
    scalar_t* xp = x.data_ptr<scalar_t>();
    const scalar_t* dp = nullptr;
    if (delta.has_value()) {
      TORCH_CHECK(delta->is_contiguous() && delta->sizes() == x.sizes());
      dp = delta->data_ptr<scalar_t>();
    }
    const scalar_t* w = weight.data_ptr<scalar_t>();
    scalar_t* op = out.data_ptr<scalar_t>();
    at::parallel_for(0, T, 16, [&](int64_t begin, int64_t end) {
      std::vector<float> row(D);
      for (int64_t t = begin; t < end; ++t) {
        scalar_t* xr = xp + t * D;
        float ss = 0.f;
        for (int64_t d = 0; d < D; ++d) {
          float v = static_cast<float>(xr[d]);
          if (dp) { v = through<scalar_t>(v + static_cast<float>(dp[t * D + d])); xr[d] = static_cast<scalar_t>(v); }
          row[d] = v;
        }
        _Pragma("omp simd reduction(+ : ss)")  // (a #pragma cannot stand inside the dispatch macro)
        for (int64_t d = 0; d < D; ++d) ss += row[d] * row[d];
        const float r = 1.f / std::sqrt(ss / D + static_cast<float>(eps));
        for (int64_t d = 0; d < D; ++d)
          op[t * D + d] = static_cast<scalar_t>(static_cast<float>(w[d]) * through<scalar_t>(row[d] * r));
      }
    });
  });
  return out;
}

// Rotates the first n heads of qkv (T, H, hd), pairs (2i, 2i + 1) interleaved, by cis (T, n, hd/2, 2) float32
// [cos, sin], in place, in float32: (x0, x1) -> (x0 c - x1 s, x0 s + x1 c). With kv_cache (2 nkv, ..., hd) and slots
// (T,) int64, then writes each row's last 2 nkv heads (its keys, rotated, then its values) into the cache at its slot:
// RoPE and the KV write as one op, where index_copy_ alone cost ~40 us a layer on a Xeon at batch 1.
void rope_(at::Tensor qkv, at::Tensor cis, c10::optional<at::Tensor> kv_cache, c10::optional<at::Tensor> slots) {
  TORCH_CHECK(qkv.is_contiguous() && cis.is_contiguous() && cis.scalar_type() == at::kFloat);
  const int64_t T = qkv.size(0), H = qkv.size(1), hd = qkv.size(2), n = cis.size(1);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, qkv.scalar_type(), "rope_", [&] {
    scalar_t* x = qkv.data_ptr<scalar_t>();
    const float* c = cis.data_ptr<float>();
    at::parallel_for(0, T * n, 16, [&](int64_t begin, int64_t end) {
      for (int64_t k = begin; k < end; ++k) {
        const int64_t t = k / n, h = k % n;
        scalar_t* xr = x + (t * H + h) * hd;
        const float* cr = c + k * hd;
        for (int64_t i = 0; i < hd / 2; ++i) {
          const float x0 = static_cast<float>(xr[2 * i]), x1 = static_cast<float>(xr[2 * i + 1]);
          const float co = cr[2 * i], si = cr[2 * i + 1];
          xr[2 * i] = static_cast<scalar_t>(x0 * co - x1 * si);
          xr[2 * i + 1] = static_cast<scalar_t>(x0 * si + x1 * co);
        }
      }
    });
  });
  if (!kv_cache.has_value()) return;
  TORCH_CHECK(slots.has_value() && slots->scalar_type() == at::kLong && slots->is_contiguous() && slots->numel() == T);
  const int64_t two_nkv = kv_cache->size(0), first = H - two_nkv;  // the keys' first head in a row of qkv
  TORCH_CHECK(kv_cache->is_contiguous() && kv_cache->scalar_type() == qkv.scalar_type() && kv_cache->size(-1) == hd &&
              two_nkv == 2 * (H - n));
  const int64_t num_slots = kv_cache->numel() / (two_nkv * hd), es = qkv.element_size(), row = hd * es;
  const int64_t* s = slots->data_ptr<int64_t>();
  const char* src = static_cast<const char*>(qkv.data_ptr());
  char* dst = static_cast<char*>(kv_cache->data_ptr());
  for (int64_t t = 0; t < T; ++t) {
    TORCH_CHECK(s[t] >= 0 && s[t] < num_slots, "KV slot ", s[t], " outside the cache's ", num_slots);
    for (int64_t j = 0; j < two_nkv; ++j)
      std::memcpy(dst + (j * num_slots + s[t]) * row, src + ((t * H + first + j) * hd) * es, row);
  }
}

static inline float silu1(float x) { return x / (1.f + std::exp(-x)); }  // torch's formula, in float32

// silu[i] = SiLU(x[i]) in float32 for n values of x.
template <typename T>
static void silu_row(const T* in, float* silu, int64_t n) {
  int64_t i = 0;
#ifdef HAVE_AVX2
  if constexpr (std::is_same_v<T, float> || std::is_same_v<T, at::BFloat16>) {
    const __m256 zero = _mm256_setzero_ps(), one = _mm256_set1_ps(1.f);
    for (; i + 8 <= n; i += 8) {  // x sigmoid(x), from e = exp(-|x|): x / (1 + e) for x >= 0, x e / (1 + e) below
      const __m256 v = load8(in + i);
      const __m256 e = exp8(_mm256_sub_ps(zero, _mm256_andnot_ps(_mm256_set1_ps(-0.f), v)));
      const __m256 num = _mm256_blendv_ps(v, _mm256_mul_ps(v, e), _mm256_cmp_ps(v, zero, _CMP_LT_OQ));
      _mm256_storeu_ps(silu + i, _mm256_div_ps(num, _mm256_add_ps(one, e)));
      if (_mm256_movemask_ps(_mm256_cmp_ps(v, _mm256_set1_ps(-80.f), _CMP_LT_OQ)))  // exp8's floor: as torch, scalar
        for (int64_t j = i; j < i + 8; ++j)
          if (const float x = static_cast<float>(in[j]); x < -80.f) silu[j] = silu1(x);
    }
  }
#endif
  for (; i < n; ++i) silu[i] = silu1(static_cast<float>(in[i]));
}

// silu(gate) * up of gate_up (T, 2I) -> (T, I), rounded where F.silu(gate).mul_(up) rounds: the SiLU in float32,
// rounded to T, then the product. NOTE: ATen's two ops cost ~25 us each at one row; this is one pass.
at::Tensor silu_mul(at::Tensor gate_up) {
  TORCH_CHECK(gate_up.dim() == 2 && gate_up.is_contiguous() && gate_up.size(1) % 2 == 0);
  const int64_t T = gate_up.size(0), I = gate_up.size(1) / 2;
  auto out = at::empty({T, I}, gate_up.options());
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, gate_up.scalar_type(), "silu_mul", [&] {
    const scalar_t* g = gate_up.data_ptr<scalar_t>();
    scalar_t* o = out.data_ptr<scalar_t>();
    at::parallel_for(0, T, 16, [&](int64_t begin, int64_t end) {
      std::vector<float> silu(I);
      for (int64_t t = begin; t < end; ++t) {
        const scalar_t* gr = g + t * 2 * I;
        silu_row(gr, silu.data(), I);
        for (int64_t i = 0; i < I; ++i)
          o[t * I + i] = static_cast<scalar_t>(through<scalar_t>(silu[i]) * static_cast<float>(gr[I + i]));
      }
    });
  });
  return out;
}

// y = x w^T + bias for bfloat16 x (T, K), w (N, K), bias (N,) or none -> (T, N) bfloat16, accumulated in float32 and
// rounded once, as torch's bfloat16 linear is. NOTE: without AVX-512-BF16 ATen runs a bfloat16 GEMM in a scalar
// fallback; here each weight is widened to float32 in registers (a bfloat16 is a float32's high half) and fed to
// FMAs, tiles of NB weight rows x MB input rows, the input rows widened once into a float32 copy. AVX2 + FMA only.
#if defined(__AVX2__) && defined(__FMA__)
// out[m, j] = x[m] . w[j] + bias[j] for NB rows j of w and MB rows m of x; K a multiple of 8.
template <int NB, int MB, typename T>
static inline void tile(const float* x, const T* w, const T* bias, T* out, int64_t K, int64_t N) {
  __m256 acc[NB][MB];
  for (int j = 0; j < NB; ++j)
    for (int m = 0; m < MB; ++m) acc[j][m] = _mm256_setzero_ps();
  for (int64_t k = 0; k < K; k += 8) {
    __m256 wv[NB];
    for (int j = 0; j < NB; ++j) wv[j] = load8(w + j * K + k);
    for (int m = 0; m < MB; ++m) {
      const __m256 xv = _mm256_loadu_ps(x + m * K + k);
      for (int j = 0; j < NB; ++j) acc[j][m] = _mm256_fmadd_ps(wv[j], xv, acc[j][m]);
    }
  }
  for (int m = 0; m < MB; ++m)
    for (int j = 0; j < NB; ++j)
      out[m * N + j] = static_cast<T>(hsum(acc[j][m]) + (bias ? static_cast<float>(bias[j]) : 0.f));
}

// All the input rows against weight rows [j, j + NB).
template <int NB, typename T>
static void rows(const float* x, const T* w, const T* bias, T* out, int64_t T_, int64_t K, int64_t N, int64_t j) {
  const T* wj = w + j * K;
  const T* bj = bias ? bias + j : nullptr;
  int64_t m = 0;
  for (; m + 4 <= T_; m += 4) tile<NB, 4>(x + m * K, wj, bj, out + m * N + j, K, N);
  switch (T_ - m) {
    case 3: tile<NB, 3>(x + m * K, wj, bj, out + m * N + j, K, N); break;
    case 2: tile<NB, 2>(x + m * K, wj, bj, out + m * N + j, K, N); break;
    case 1: tile<NB, 1>(x + m * K, wj, bj, out + m * N + j, K, N); break;
  }
}

// Weight rows [j0, j1) against all the input rows, into out: output column j - j0, rows ld elements apart.
template <typename T>
static void linear_cols(const float* x, const T* w, const T* bias, T* out, int64_t T_, int64_t K, int64_t ld,
                        int64_t j0, int64_t j1) {
  const int64_t nb = T_ <= 2 ? 4 : 2;  // one input row: more weight rows in flight; more rows: reuse each load
  w += j0 * K;
  bias = bias ? bias + j0 : nullptr;
  int64_t j = 0;
  for (; j + nb <= j1 - j0; j += nb) {
    if (nb == 4) rows<4>(x, w, bias, out, T_, K, ld, j);
    else rows<2>(x, w, bias, out, T_, K, ld, j);
  }
  for (; j < j1 - j0; ++j) rows<1>(x, w, bias, out, T_, K, ld, j);
}

struct TeamLinear {
  const float* x;
  const at::BFloat16 *w, *bias;
  at::BFloat16* out;
  int64_t T, K, N;
};

static void team_linear(void* arg) {  // on each thread of the team: its share of whole groups of 4 weight rows
  const auto* g = static_cast<const TeamLinear*>(arg);
  const int64_t t = omp_get_thread_num(), n = omp_get_num_threads(), groups = (g->N + 3) / 4;
  const int64_t j0 = std::min(g->N, groups * t / n * 4), j1 = std::min(g->N, groups * (t + 1) / n * 4);
  linear_cols(g->x, g->w, g->bias, g->out + j0, g->T, g->K, g->N, j0, j1);
}

// NOTE: the weight rows are split as panel_linear splits its panels (cpu_linear.cpp): over the caller's OpenMP team
// when it has one; with one thread, in up to 4 column blocks shared with the helper while it is on (cpu_share.h);
// else alone. On one thread the kernel streamed the weights at half what two threads can pull on an AVX-512 Xeon.
at::Tensor linear(at::Tensor x, at::Tensor w, c10::optional<at::Tensor> bias) {
  TORCH_CHECK(x.scalar_type() == w.scalar_type() && x.dim() == 2 && w.is_contiguous() && x.size(1) == w.size(1) &&
              x.size(1) % 8 == 0 && (!bias.has_value() || (bias->is_contiguous() && bias->scalar_type() == w.scalar_type())));
  TORCH_CHECK(x.scalar_type() == at::kBFloat16, "bfloat16 only: float32 linears are MKL's (cpu_kernels.py)");
  const int64_t T = x.size(0), K = x.size(1), N = w.size(0);
  // (T, K): each input row widened once. NOTE: into a vector, not by x.to(kFloat): that ATen op alone cost ~7 us a
  // call on a Xeon, against ~25 us for a whole linear of a decode step.
  const at::Tensor xc = x.contiguous();
  auto xf = std::make_shared<std::vector<float>>(T * K);
  const at::BFloat16* xb = xc.data_ptr<at::BFloat16>();
  for (int64_t i = 0; i < T * K; ++i) (*xf)[i] = static_cast<float>(xb[i]);
  auto out = at::empty({T, N}, x.options());
  const float* xp = xf->data();
  const at::BFloat16* wp = w.data_ptr<at::BFloat16>();
  const at::BFloat16* bp = bias.has_value() ? bias->data_ptr<at::BFloat16>() : nullptr;
  auto* op = out.data_ptr<at::BFloat16>();
  const int threads = at::get_num_threads();
  int64_t n = threads == 1 && Helper::get().enabled() ? 4 : 1;
  while (n > 1 && (N % n || N / n % 4)) --n;  // column blocks of whole groups of 4 weight rows
  if (T == 0 || N < 8) {
    linear_cols(xp, wp, bp, op, T, K, N, 0, N);
  } else if (threads > 1) {
    TeamLinear g{xp, wp, bp, op, T, K, N};
    GOMP_parallel(team_linear, &g, static_cast<unsigned>(std::min<int64_t>(threads, N / 4)), 0);
  } else if (n > 1) {  // the tensors stay alive in the lambda: the helper may finish after the caller returned
    const int64_t Nc = N / n;
    auto run = [xf, w, bias, xp, wp, bp, T, K, Nc](int64_t i, void* into, size_t ld) {
      linear_cols(xp, wp, bp, static_cast<at::BFloat16*>(into), T, K, static_cast<int64_t>(ld / 2), i * Nc, (i + 1) * Nc);
    };
    run_shared(std::make_shared<Job>(n, static_cast<size_t>(T * Nc) * 2, reinterpret_cast<char*>(op), T, N * 2, run));
  } else {
    linear_cols(xp, wp, bp, op, T, K, N, 0, N);
  }
  return out;
}
#define HAVE_LINEAR 1
#endif

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  // NOTE: as torch's own ops do, the kernels run without the GIL: the replica's event loop (sending the last step's
  // tokens) and Ray's threads run beside a step instead of waiting for it.
  const auto nogil = py::call_guard<py::gil_scoped_release>();
  bind_attention(m);
  bind_linear(m);
  m.def("add_rms_norm", &add_rms_norm, nogil);
  m.def("rope_", &rope_, nogil);
  m.def("silu_mul", &silu_mul, nogil);
#ifdef HAVE_LINEAR
  m.def("linear", &linear, nogil);
#endif
}
