// Linears whose output columns come in chunks that the helper thread (cpu_share.h) shares with the caller: on
// oneDNN's packed weights, or on ours in panels of 16 columns (cpu_gemm.h); llm/model/cpu_kernels.py documents which.
#include <ATen/core/Tensor.h>
#include <torch/csrc/utils/pybind.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <c10/core/InferenceMode.h>
#include <c10/core/impl/LocalDispatchKeySet.h>
#include <cstring>
#include <memory>
#include <optional>
#include <string_view>
#include <vector>

#include "cpu_gemm.h"
#include "cpu_share.h"

namespace {

// torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], None): the op torch's packed linears run.
at::Tensor onednn_linear(const at::Tensor& x, const at::Tensor& packed, const std::optional<at::Tensor>& bias) {
  static const auto op =
      c10::Dispatcher::singleton()
          .findSchemaOrThrow("mkldnn::_linear_pointwise", "")
          .typed<at::Tensor(const at::Tensor&, const at::Tensor&, const std::optional<at::Tensor>&, std::string_view,
                            c10::List<std::optional<at::Scalar>>, std::optional<std::string_view>)>();
  return op.call(x, packed, bias, "none", c10::List<std::optional<at::Scalar>>(), std::nullopt);
}

// x (T, K) times the weight whose row chunks of equal height Nc were packed one by one (`chunks`), plus bias (N):
// (T, N). Chunk i is a task; its (T, Nc) result is laid out chunk-major in a (n, T, Nc) buffer, which is transposed
// into the output at the end (T * N values: small beside the weight the GEMMs read). The chunks are shared with the
// helper when the caller runs one OpenMP thread (a decode step); a caller with a team (a prefill chunk on a node's
// idle cores) runs them itself.
at::Tensor chunked_linear(at::Tensor x, std::vector<at::Tensor> chunks, std::optional<at::Tensor> bias) {
  TORCH_CHECK(x.dim() == 2 && !chunks.empty());
  // One op of ours to a Python dispatch mode (op counts, tests), as the other kernels are: not the ops inside it.
  c10::impl::ExcludeDispatchKeyGuard no_python(
      c10::DispatchKeySet({c10::DispatchKey::Python, c10::DispatchKey::PythonTLSSnapshot}));
  const bool share = at::get_num_threads() == 1 && Helper::get().enabled();
  x = x.contiguous();
  const int64_t n = static_cast<int64_t>(chunks.size()), T = x.size(0), Nc = chunks[0].size(0), N = n * Nc;
  TORCH_CHECK(!bias.has_value() || (bias->dim() == 1 && bias->size(0) == N), "bias must have n * Nc values");
  std::vector<std::optional<at::Tensor>> biases(n);
  if (bias.has_value())
    for (int64_t i = 0; i < n; ++i) biases[i] = bias->narrow(0, i * Nc, Nc);
  auto buf = at::empty({n, T, Nc}, x.options());
  const size_t task_bytes = static_cast<size_t>(T * Nc) * x.element_size();
  auto run = [x, chunks = std::move(chunks), biases = std::move(biases), task_bytes](int64_t i, void* into) {
    c10::InferenceMode guard;  // thread-local: the helper's thread has none of the caller's modes
    const at::Tensor r = onednn_linear(x, chunks[i], biases[i]);
    std::memcpy(into, r.data_ptr(), task_bytes);
  };
  char* dst = static_cast<char*>(buf.data_ptr());
  if (share && n > 1) {
    run_shared(std::make_shared<Job>(n, task_bytes, dst, run));
  } else {
    for (int64_t i = 0; i < n; ++i) run(i, dst + i * task_bytes);
  }
  if (n == 1 || T == 1) return buf.view({T, N});
  return buf.permute({1, 0, 2}).reshape({T, N});
}

#ifdef HAVE_AVX2
// NOTE: a caller with an OpenMP team of its own (a prefill chunk on a node's idle cores) splits the panels over that
// team, through GOMP_parallel (cpu_share.h).
struct TeamGemm {
  const float *x, *panels, *bias;
  int64_t T, K, P;
  float* y;
};

static void team_gemm(void* arg) {  // on each thread of the team: its share of the panels, into the output
  const auto* g = static_cast<const TeamGemm*>(arg);
  const int64_t t = omp_get_thread_num(), n = omp_get_num_threads();
  const int64_t p0 = g->P * t / n, p1 = g->P * (t + 1) / n;
  gemm_panels(g->x, g->T, g->K, g->panels, p0, p1, g->y + p0 * 16, g->P * 16, g->bias);
}

// x (T, K) float32 times the weight packed as `panels` (P, K, 16): (T, 16 P), plus bias. A caller with a team splits
// the panels over it (above); one of one thread shares them with the helper while it is on (in up to 4 tasks of whole
// panels, column blocks of the output); else it runs them alone.
at::Tensor panel_linear(at::Tensor x, at::Tensor panels, std::optional<at::Tensor> bias) {
  TORCH_CHECK(x.dim() == 2 && panels.dim() == 3 && panels.size(2) == 16 && x.size(1) == panels.size(1));
  TORCH_CHECK(x.scalar_type() == at::kFloat && panels.scalar_type() == at::kFloat && panels.is_contiguous());
  c10::impl::ExcludeDispatchKeyGuard no_python(
      c10::DispatchKeySet({c10::DispatchKey::Python, c10::DispatchKey::PythonTLSSnapshot}));
  x = x.contiguous();
  const int64_t T = x.size(0), K = x.size(1), P = panels.size(0), N = P * 16;
  std::optional<at::Tensor> b;
  if (bias.has_value()) {
    TORCH_CHECK(bias->dim() == 1 && bias->size(0) == N && bias->scalar_type() == at::kFloat);
    b = bias->contiguous();
  }
  const float* bp = b.has_value() ? b->data_ptr<float>() : nullptr;
  const float* xp = x.data_ptr<float>();
  const float* pp = panels.data_ptr<float>();
  const int threads = at::get_num_threads();
  int64_t n = threads == 1 && Helper::get().enabled() ? 4 : 1;
  while (P % n) --n;
  if (n == 1 || T == 0) {
    auto y = at::empty({T, N}, x.options());
    if (threads > 1 && T > 0) {
      TeamGemm g{xp, pp, bp, T, K, P, y.data_ptr<float>()};
      GOMP_parallel(team_gemm, &g, static_cast<unsigned>(std::min<int64_t>(threads, P)), 0);
    } else {
      gemm_panels(xp, T, K, pp, 0, P, y.data_ptr<float>(), N, bp);
    }
    return y;
  }
  // Task i: panels [i Pc, (i + 1) Pc), columns [i Nc, (i + 1) Nc) of the output, by the caller straight into it and
  // by the helper into its slot, copied in row by row when the caller collects it.
  const int64_t Pc = P / n, Nc = Pc * 16;
  auto y = at::empty({T, N}, x.options());
  // The tensors stay alive in the lambda: the helper may finish a task after the caller took it over and returned.
  auto run = [x, panels, b, xp, pp, bp, T, K, Pc](int64_t i, void* into, size_t ld) {
    gemm_panels(xp, T, K, pp, i * Pc, (i + 1) * Pc, static_cast<float*>(into), ld / sizeof(float), bp);
  };
  run_shared(std::make_shared<Job>(n, static_cast<size_t>(T * Nc) * sizeof(float), static_cast<char*>(y.data_ptr()),
                                   T, N * sizeof(float), run));
  return y;
}
#endif

}  // namespace

void bind_linear(py::module& m) {
  const auto nogil = py::call_guard<py::gil_scoped_release>();
  m.def("chunked_linear", &chunked_linear, nogil);
#ifdef HAVE_AVX2
  m.def("panel_linear", &panel_linear, nogil);
#endif
#ifdef __AVX512F__
  m.attr("avx512") = true;
#else
  m.attr("avx512") = false;
#endif
  m.def("use_helper", [](bool on, int64_t delay_us) { Helper::get().enable(on, delay_us); }, py::arg("on"),
        py::arg("delay_us") = 0, nogil);
  m.def("helper_stats", [] {
    Helper& h = Helper::get();
    return py::make_tuple(h.offered.load(), h.tasks.load(), h.stolen.load());
  });
}
