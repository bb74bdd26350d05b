// The engine's CPU kernels (llm/model/cpu_kernels.py builds and documents them).
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <algorithm>
#include <cmath>
#include <type_traits>
#include <vector>

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define HAVE_AVX2 1

static inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
static inline __m256 load8(const at::BFloat16* p) {
  const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}

static inline float hsum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}

// exp of 8 floats <= 0 (softmax's shifted scores), to about 2 ulp: Cephes' expf (x = n ln2 + r, a degree-6
// polynomial in r, times 2^n), in AVX2. NOTE: glibc's expf does not vectorise here (no -ffast-math), and one per
// score per head was a large share of a decode step's attention.
static inline __m256 exp8(__m256 x) {
  x = _mm256_max_ps(x, _mm256_set1_ps(-87.3f));  // below: 0 for a softmax's purposes, and no denormal 2^n
  const __m256 n = _mm256_floor_ps(_mm256_fmadd_ps(x, _mm256_set1_ps(1.44269504089f), _mm256_set1_ps(0.5f)));
  x = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);  // ln2 in two parts: r = x - n ln2, exactly
  x = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), x);
  __m256 y = _mm256_set1_ps(1.9875691500e-4f);
  for (const float c : {1.3981999507e-3f, 8.3334519073e-3f, 4.1665795894e-2f, 1.6666665459e-1f, 5.0000001201e-1f})
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(c));
  y = _mm256_fmadd_ps(y, _mm256_mul_ps(x, x), _mm256_add_ps(x, _mm256_set1_ps(1.f)));
  const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(y, _mm256_castsi256_ps(e));
}

// The 4 dot products q . k0..k3 (n floats each, n a multiple of 8): 4 independent FMA chains, then one hadd tree.
template <typename T>
static inline __m128 dot4(const float* q, const T* k0, const T* k1, const T* k2, const T* k3, int64_t n) {
  __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
  for (int64_t d = 0; d < n; d += 8) {
    const __m256 qv = _mm256_loadu_ps(q + d);
    a0 = _mm256_fmadd_ps(qv, load8(k0 + d), a0);
    a1 = _mm256_fmadd_ps(qv, load8(k1 + d), a1);
    a2 = _mm256_fmadd_ps(qv, load8(k2 + d), a2);
    a3 = _mm256_fmadd_ps(qv, load8(k3 + d), a3);
  }
  const __m256 s = _mm256_hadd_ps(_mm256_hadd_ps(a0, a1), _mm256_hadd_ps(a2, a3));
  return _mm_add_ps(_mm256_castps256_ps128(s), _mm256_extractf128_ps(s, 1));  // (q.k0, q.k1, q.k2, q.k3)
}
#endif

// A row of n values as float32: float rows are read where they lie, 16-bit ones converted into `buf`.
static inline const float* load(const float* x, float*, int64_t) { return x; }
template <typename T>
static inline const float* load(const T* x, float* buf, int64_t n) {
  for (int64_t i = 0; i < n; ++i) buf[i] = static_cast<float>(x[i]);
  return buf;
}

// Asks for one key's or value's row ahead of its use (AHEAD rows: two blocks of 16), into L2 (prefetcht2: the L2
// tracks more misses in flight than L1). NOTE: each block is its own page-sized run, wherever the pool put it; the
// hardware prefetcher stops at page boundaries, so without this every block starts with misses at full memory
// latency. Distance and level were chosen by measurement (BENCHMARKS.md).
constexpr int64_t AHEAD = 32;
template <typename T>
static inline void prefetch_row(const T* row, int64_t hd) {
  const char* p = reinterpret_cast<const char*>(row);
  for (int64_t off = 0; off < hd * static_cast<int64_t>(sizeof(T)); off += 64) __builtin_prefetch(p + off, 0, 1);
}

template <typename T>
static void decode(const T* q, int64_t q_stride, const T* kv, const int32_t* tables, const int32_t* lens, T* out,
                   int64_t B, int64_t nh, int64_t nkv, int64_t hd, int64_t num_blocks, int64_t bs, int64_t W,
                   float scale) {
  const int64_t g = nh / nkv, head_stride = num_blocks * bs * hd;
  at::parallel_for(0, B * nkv, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> qf(g * hd), acc(g * hd), vf(hd), scores;
    for (int64_t task = begin; task < end; ++task) {
      const int64_t b = task / nkv, h = task % nkv, L = lens[b];
      const T* k_head = kv + h * head_stride;
      const T* v_head = kv + (nkv + h) * head_stride;
      const int32_t* table = tables + b * W;
      for (int64_t i = 0; i < g * hd; ++i) qf[i] = static_cast<float>(q[b * q_stride + h * g * hd + i]) * scale;
      scores.assign(g * L, 0.f);
      auto key = [&](int64_t t) { return k_head + (static_cast<int64_t>(table[t / bs]) * bs + t % bs) * hd; };
      auto value = [&](int64_t t) { return v_head + (static_cast<int64_t>(table[t / bs]) * bs + t % bs) * hd; };
      auto ahead = [&](int64_t i) {  // the i-th row this task reads (keys, then values), if there is one
        if (i < L) prefetch_row(key(i), hd);
        else if (i < 2 * L) prefetch_row(value(i - L), hd);
      };
      for (int64_t i = 0; i < std::min(AHEAD, L); ++i) prefetch_row(key(i), hd);
      int64_t t = 0;
#ifdef HAVE_AVX2
      if constexpr (std::is_same_v<T, float> || std::is_same_v<T, at::BFloat16>) {
        if (hd % 8 == 0) {  // scores 4 keys at a time: each key read once from memory, then from L1 for the g heads
          for (; t + 4 <= L; t += 4) {
            for (int64_t i = t + AHEAD; i < t + AHEAD + 4; ++i) ahead(i);
            const T *k0 = key(t), *k1 = key(t + 1), *k2 = key(t + 2), *k3 = key(t + 3);
            for (int64_t j = 0; j < g; ++j) {
              alignas(16) float s4[4];
              _mm_store_ps(s4, dot4(qf.data() + j * hd, k0, k1, k2, k3, hd));
              for (int i = 0; i < 4; ++i) scores[j * L + t + i] = s4[i];
            }
          }
        }
      }
#endif
      for (; t < L; ++t) {  // scores: each key read once for the g query heads
        ahead(t + AHEAD);
        const T* k = key(t);
        const float* kf = load(k, vf.data(), hd);
        for (int64_t j = 0; j < g; ++j) {
          const float* qj = qf.data() + j * hd;
          float s = 0.f;
#pragma omp simd reduction(+ : s)
          for (int64_t d = 0; d < hd; ++d) s += qj[d] * kf[d];
          scores[j * L + t] = s;
        }
      }
      std::vector<float> norm(g);
      for (int64_t j = 0; j < g; ++j) {  // softmax in float32
        float* sj = scores.data() + j * L;
        float m = -INFINITY, sum = 0.f;
        for (int64_t t = 0; t < L; ++t) m = std::max(m, sj[t]);
        int64_t t = 0;
#ifdef HAVE_AVX2
        for (const __m256 mv = _mm256_set1_ps(m); t + 8 <= L; t += 8)
          _mm256_storeu_ps(sj + t, exp8(_mm256_sub_ps(_mm256_loadu_ps(sj + t), mv)));
#endif
        for (; t < L; ++t) sj[t] = std::exp(sj[t] - m);
#pragma omp simd reduction(+ : sum)
        for (int64_t t = 0; t < L; ++t) sum += sj[t];
        norm[j] = 1.f / sum;
      }
      std::fill(acc.begin(), acc.end(), 0.f);
      for (int64_t t = 0; t < L; ++t) {  // values: each read once, added into the g heads' sums
        if (t + AHEAD < L) prefetch_row(value(t + AHEAD), hd);
        const T* v = v_head + (static_cast<int64_t>(table[t / bs]) * bs + t % bs) * hd;
        const float* vv = load(v, vf.data(), hd);
        for (int64_t j = 0; j < g; ++j) {
          const float p = scores[j * L + t];
          float* aj = acc.data() + j * hd;
#pragma omp simd
          for (int64_t d = 0; d < hd; ++d) aj[d] += p * vv[d];
        }
      }
      for (int64_t j = 0; j < g; ++j)
        for (int64_t d = 0; d < hd; ++d) out[(b * nh + h * g + j) * hd + d] = static_cast<T>(acc[j * hd + d] * norm[j]);
    }
  });
}

torch::Tensor paged_decode(torch::Tensor q, torch::Tensor kv_cache, torch::Tensor tables, torch::Tensor lens,
                           double scale) {
  TORCH_CHECK(q.stride(2) == 1 && q.stride(1) == q.size(2), "each row's heads must be contiguous");
  TORCH_CHECK(kv_cache.is_contiguous() && tables.is_contiguous() && lens.is_contiguous());
  TORCH_CHECK(tables.scalar_type() == torch::kInt32 && lens.scalar_type() == torch::kInt32);
  const int64_t B = q.size(0), nh = q.size(1), hd = q.size(2), nkv = kv_cache.size(0) / 2;
  auto out = torch::empty({B, nh, hd}, q.options());
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, q.scalar_type(), "paged_decode", [&] {
    decode<scalar_t>(q.data_ptr<scalar_t>(), q.stride(0), kv_cache.data_ptr<scalar_t>(), tables.data_ptr<int32_t>(),
                     lens.data_ptr<int32_t>(), out.data_ptr<scalar_t>(), B, nh, nkv, hd, kv_cache.size(1),
                     kv_cache.size(2), tables.size(1), static_cast<float>(scale));
  });
  return out;
}

// Rounds a float through T, as a torch op producing a T tensor would.
template <typename T>
static inline float through(float x) { return static_cast<float>(static_cast<T>(x)); }

// x (T, D) += delta (if given), then out = weight * T(x * rsqrt(mean(x^2) + eps)): transformers' Qwen2RMSNorm
// (float32 inside, the normalised row rounded to T before the weight), with the residual add before it.
torch::Tensor add_rms_norm(torch::Tensor x, c10::optional<torch::Tensor> delta, torch::Tensor weight, double eps) {
  TORCH_CHECK(x.is_contiguous() && weight.is_contiguous() && x.dim() == 2);
  const int64_t T = x.size(0), D = x.size(1);
  auto out = torch::empty_like(x);
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
// [cos, sin], in place, in float32: (x0, x1) -> (x0 c - x1 s, x0 s + x1 c).
void rope_(torch::Tensor qkv, torch::Tensor cis) {
  TORCH_CHECK(qkv.is_contiguous() && cis.is_contiguous() && cis.scalar_type() == torch::kFloat32);
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

template <typename T>
static void linear_rows(const float* x, const T* w, const T* bias, T* out, int64_t T_, int64_t K, int64_t N) {
  const int64_t nb = T_ <= 2 ? 4 : 2;  // one input row: more weight rows in flight; more rows: reuse each load
  at::parallel_for(0, N / nb, 16, [&](int64_t begin, int64_t end) {
    for (int64_t b = begin; b < end; ++b) {
      if (nb == 4) rows<4>(x, w, bias, out, T_, K, N, b * 4);
      else rows<2>(x, w, bias, out, T_, K, N, b * 2);
    }
  });
  for (int64_t j = N / nb * nb; j < N; ++j) rows<1>(x, w, bias, out, T_, K, N, j);
}

torch::Tensor linear(torch::Tensor x, torch::Tensor w, c10::optional<torch::Tensor> bias) {
  TORCH_CHECK(x.scalar_type() == w.scalar_type() && x.dim() == 2 && w.is_contiguous() && x.size(1) == w.size(1) &&
              x.size(1) % 8 == 0 && (!bias.has_value() || (bias->is_contiguous() && bias->scalar_type() == w.scalar_type())));
  const int64_t T = x.size(0), K = x.size(1), N = w.size(0);
  const torch::Tensor xf = x.to(at::kFloat).contiguous();  // (T, K): each input row widened once
  auto out = torch::empty({T, N}, x.options());
  const float* xp = xf.data_ptr<float>();
  TORCH_CHECK(x.scalar_type() == at::kBFloat16, "bfloat16 only: float32 linears are MKL's (cpu_kernels.py)");
  linear_rows(xp, w.data_ptr<at::BFloat16>(), bias.has_value() ? bias->data_ptr<at::BFloat16>() : nullptr,
              out.data_ptr<at::BFloat16>(), T, K, N);
  return out;
}
#define HAVE_LINEAR 1
#endif

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  // NOTE: as torch's own ops do, the kernels run without the GIL: the replica's event loop (sending the last step's
  // tokens) and Ray's threads run beside a step instead of waiting for it.
  const auto nogil = py::call_guard<py::gil_scoped_release>();
  m.def("paged_decode", &paged_decode, nogil);
  m.def("add_rms_norm", &add_rms_norm, nogil);
  m.def("rope_", &rope_, nogil);
#ifdef HAVE_LINEAR
  m.def("linear", &linear, nogil);
#endif
}
