"""Paged decode attention on CPU that reads the KV blocks in place: a small C++ kernel, built at replica start.

The eager path (llm/attention.py) gathers every decode row's blocks into a contiguous copy, then runs two batched
matmuls: on the bench checkpoint at batch 32 the gather and the matmuls were half of a decode step. This kernel
reads each key and value once, where it lies: one task per (sequence, KV head) on the calling thread's OpenMP team
(at::parallel_for), the KV head's keys loaded once for its whole GQA group of query heads; scores, a float32
softmax and the weighted sum of values per task, nothing materialised but the scores. Keys past a row's context
are never read. The idea is vLLM's and SGLang's CPU decode kernels (paged attention per sequence and head); the
code is ours.

It is compiled with torch's cpp_extension (ninja, the machine's C++ compiler, -O3 -march=native) the first time a
process asks for it; the build is cached under TORCH_EXTENSIONS_DIR, so later processes load it in about a second.
Where it cannot be built (no compiler), `load()` says why once and returns None, and attention keeps the gather.
"""

from __future__ import annotations

import logging
import threading
import time

import torch

logger = logging.getLogger(__name__)

_SOURCE = r"""
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <cmath>
#include <vector>

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
      for (int64_t t = 0; t < L; ++t) {  // scores: each key read once for the g query heads
        const T* k = k_head + (static_cast<int64_t>(table[t / bs]) * bs + t % bs) * hd;
        for (int64_t d = 0; d < hd; ++d) vf[d] = static_cast<float>(k[d]);
        for (int64_t j = 0; j < g; ++j) {
          const float* qj = qf.data() + j * hd;
          float s = 0.f;
#pragma omp simd reduction(+ : s)
          for (int64_t d = 0; d < hd; ++d) s += qj[d] * vf[d];
          scores[j * L + t] = s;
        }
      }
      std::vector<float> norm(g);
      for (int64_t j = 0; j < g; ++j) {  // softmax in float32
        float* sj = scores.data() + j * L;
        float m = -INFINITY, sum = 0.f;
        for (int64_t t = 0; t < L; ++t) m = std::max(m, sj[t]);
        for (int64_t t = 0; t < L; ++t) { sj[t] = std::exp(sj[t] - m); sum += sj[t]; }
        norm[j] = 1.f / sum;
      }
      std::fill(acc.begin(), acc.end(), 0.f);
      for (int64_t t = 0; t < L; ++t) {  // values: each read once, added into the g heads' sums
        const T* v = v_head + (static_cast<int64_t>(table[t / bs]) * bs + t % bs) * hd;
        for (int64_t d = 0; d < hd; ++d) vf[d] = static_cast<float>(v[d]);
        for (int64_t j = 0; j < g; ++j) {
          const float p = scores[j * L + t];
          float* aj = acc.data() + j * hd;
#pragma omp simd
          for (int64_t d = 0; d < hd; ++d) aj[d] += p * vf[d];
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

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) { m.def("paged_decode", &paged_decode); }
"""

_lock = threading.Lock()
_module: object | None = None
_tried = False


def load():
    """The compiled module, or None where it cannot be built (said once in the log)."""
    global _module, _tried
    with _lock:
        if not _tried:
            _tried = True
            from torch.utils.cpp_extension import load_inline

            t0 = time.monotonic()
            try:
                _module = load_inline("vlm_paged_decode_cpu", cpp_sources=_SOURCE,
                                      extra_cflags=["-O3", "-march=native", "-fopenmp-simd"], verbose=False)
                logger.info("CPU paged decode attention ready in %.1f s", time.monotonic() - t0)
            except Exception as e:  # no compiler, no ninja, no headers: the gather path still works
                logger.warning("CPU paged decode attention could not be built (%s); decode gathers its blocks", e)
    return _module


def available() -> bool:
    """Built in this process (by `load()`); never builds it."""
    return _module is not None


def paged_decode_cpu(q: torch.Tensor, kv_cache: torch.Tensor, block_tables: torch.Tensor,
                     context_lens: torch.Tensor, scale: float) -> torch.Tensor:
    """q (B, nh, hd); kv_cache (2 * nkv, num_blocks, block_size, hd): keys then values; block_tables (B, W) int32;
    context_lens (B,) int32, keys per row (>= 1) -> (B, nh, hd). `load()` must have returned the module."""
    return _module.paged_decode(q, kv_cache, block_tables, context_lens, scale)


__all__ = ["available", "load", "paged_decode_cpu"]
