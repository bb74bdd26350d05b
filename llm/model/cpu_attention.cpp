// Paged decode attention on CPU, and the helper thread that shares its tasks (llm/model/cpu_kernels.py documents
// both).
#include <ATen/core/Tensor.h>
#include <torch/csrc/utils/pybind.h>
#include <algorithm>
#include <cmath>
#include <numeric>
#include <type_traits>
#include <vector>

#include "cpu_share.h"
#include "cpu_simd.h"

#ifdef HAVE_AVX2
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

// One call's operands. The tensors are held, not borrowed: the helper may still be reading them after the call
// returned (a task it had started and the caller took over: cpu_share.h).
struct Problem {
  at::Tensor q, kv, tables, lens;
  int64_t nh, nkv, hd, head_stride, bs, W, q_stride;
  float scale;
};

struct Scratch {
  std::vector<float> qf, acc, vf, scores, norm;
  std::vector<int64_t> rows;
};

// Task b * nkv + h: decode row b's attention for KV head h, over the keys of its context, read where they lie; into
// dst, the g = nh / nkv query heads' hd values (contiguous in the output: task i's are at i * g * hd).
template <typename T>
static void attend(const Problem& p, int64_t task, T* dst, Scratch& sc) {
  const T* q = p.q.data_ptr<T>();
  const T* kv = p.kv.data_ptr<T>();
  const int32_t* tables = p.tables.data_ptr<int32_t>();
  const int32_t* lens = p.lens.data_ptr<int32_t>();
  const int64_t nkv = p.nkv, hd = p.hd, g = p.nh / nkv, head_stride = p.head_stride, bs = p.bs, W = p.W;
  const int64_t q_stride = p.q_stride;
  const float scale = p.scale;
  sc.qf.resize(g * hd);
  sc.vf.resize(hd);
  std::vector<float>& qf = sc.qf;
  std::vector<float>& vf = sc.vf;
  const int64_t b = task / nkv, h = task % nkv, L = lens[b];
  const T* k_head = kv + h * head_stride;
  const T* v_head = kv + (nkv + h) * head_stride;
  const int32_t* table = tables + b * W;
  for (int64_t i = 0; i < g * hd; ++i) qf[i] = static_cast<float>(q[b * q_stride + h * g * hd + i]) * scale;
  std::vector<float>& scores = sc.scores;
  scores.assign(g * L, 0.f);
  // Each key's offset in its head's blocks, found once. NOTE: not table[t / bs] at each use: bs is not known at compile
  // time, and a 64-bit division per key read (four or five of them) was most of this kernel's time on a Xeon, where
  // one takes ~40-90 cycles (AMD's Zen: ~15).
  std::vector<int64_t>& rows = sc.rows;
  rows.resize(L);
  for (int64_t blk = 0, t = 0; t < L; ++blk) {
    const int64_t base = static_cast<int64_t>(table[blk]) * bs * hd;
    for (int64_t o = 0; o < bs && t < L; ++o, ++t) rows[t] = base + o * hd;
  }
  auto key = [&](int64_t t) { return k_head + rows[t]; };
  auto value = [&](int64_t t) { return v_head + rows[t]; };
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
  sc.norm.resize(g);
  float* norm = sc.norm.data();
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
  std::vector<float>& acc = sc.acc;
  acc.assign(g * hd, 0.f);
  for (int64_t t = 0; t < L; ++t) {  // values: each read once, added into the g heads' sums
    if (t + AHEAD < L) prefetch_row(value(t + AHEAD), hd);
    const T* v = value(t);
    const float* vv = load(v, vf.data(), hd);
    for (int64_t j = 0; j < g; ++j) {
      const float p = scores[j * L + t];
      float* aj = acc.data() + j * hd;
#pragma omp simd
      for (int64_t d = 0; d < hd; ++d) aj[d] += p * vv[d];
    }
  }
  for (int64_t j = 0; j < g; ++j)
    for (int64_t d = 0; d < hd; ++d) dst[j * hd + d] = static_cast<T>(acc[j * hd + d] * norm[j]);
}

// A call shares its tasks with the helper (cpu_share.h) only above this many key rows in all (nkv * the rows'
// contexts): below, waking the helper costs about what it could take.
constexpr int64_t SHARE_MIN_KEYS = 512;

at::Tensor paged_decode(at::Tensor q, at::Tensor kv_cache, at::Tensor tables, at::Tensor lens, double scale) {
  TORCH_CHECK(q.stride(2) == 1 && q.stride(1) == q.size(2), "each row's heads must be contiguous");
  TORCH_CHECK(kv_cache.is_contiguous() && tables.is_contiguous() && lens.is_contiguous());
  TORCH_CHECK(tables.scalar_type() == at::kInt && lens.scalar_type() == at::kInt);
  const int64_t B = q.size(0), nh = q.size(1), hd = q.size(2), nkv = kv_cache.size(0) / 2;
  auto out = at::empty({B, nh, hd}, q.options());
  const Problem p{q, kv_cache, tables, lens, nh, nkv, hd, kv_cache.size(1) * kv_cache.size(2) * hd,
                  kv_cache.size(2), tables.size(1), q.stride(0), static_cast<float>(scale)};
  const int64_t n = B * nkv;
  const size_t task_bytes = (nh / nkv) * hd * q.element_size();
  char* dst = static_cast<char*>(out.data_ptr());
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, q.scalar_type(), "paged_decode", [&] {
    auto run = [p](int64_t task, void* into) {
      thread_local Scratch sc;
      attend<scalar_t>(p, task, static_cast<scalar_t*>(into), sc);
    };
    const int32_t* len = lens.data_ptr<int32_t>();
    const int64_t keys = nkv * std::accumulate(len, len + B, int64_t{0});
    if (Helper::get().enabled() && n > 1 && keys >= SHARE_MIN_KEYS) {
      run_shared(std::make_shared<Job>(n, task_bytes, dst, run));
    } else {
      for (int64_t i = 0; i < n; ++i) run(i, dst + i * task_bytes);
    }
  });
  return out;
}

void bind_attention(py::module& m) {
  const auto nogil = py::call_guard<py::gil_scoped_release>();
  m.def("paged_decode", &paged_decode, nogil);
}
