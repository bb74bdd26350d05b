// The helper thread that shares an op's tasks with the calling thread, never making it wait for a task the helper
// has not started (cpu_attention.cpp's decode attention and cpu_linear.cpp's chunked GEMMs use it; cpu_kernels.py
// documents it).
#pragma once
#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <cstring>
#include <functional>
#include <memory>
#include <mutex>
#include <thread>
#include <vector>
#ifdef __linux__
#include <sys/resource.h>
#include <sys/syscall.h>
#include <unistd.h>
#endif
#if defined(__x86_64__)
#include <immintrin.h>
static inline void relax() { _mm_pause(); }
#else
static inline void relax() { std::this_thread::yield(); }
#endif

// NOTE: the helper thread. A decode step's attention is one op of B * nkv independent tasks, and on a CPU node the
// engine's worker runs it on one thread, while the node's other core is often partly idle (BENCHMARKS.md: half a core
// during decode). Two OpenMP threads lost served: every op waits for the slower thread, and a team thread that the
// kernel preempted for the ingress stalls the step. So the tasks are shared differently: a helper thread claims tasks
// while it runs, and the caller never waits for one it has not started. Each task has a state; both claim tasks in
// order (a CAS from FREE); the helper computes into the job's own result slot and publishes it with a CAS from HELPER
// to DONE; the caller copies done results into the output. When the caller has claimed the last task, it waits a
// little (one task's time) for a task the helper is computing, then takes it over (HELPER -> STOLEN) and computes it
// itself; the helper's late result stays in its slot, unread. NOTE: the helper runs at nice 19, so a loaded node may
// leave it off the CPU for long: the caller never blocks on anything the helper holds (no lock: `offer` only tries
// it; no half-written output to wait for). The idea is work-stealing's (Cilk; OpenMP's dynamic schedule), with the
// caller free to redo a task instead of joining; the code is ours.
enum : uint8_t { FREE, MAIN, HELPER, DONE, STOLEN };

// How long the helper spins for the next offer before it sleeps (see Helper::loop).
constexpr int64_t SPIN_US = 200;

// torch's OpenMP runtime (libgomp), which oneDNN's GEMMs run on. The kernels are built without -fopenmp (no second
// runtime beside torch's), so a team is started by calling what GCC compiles `#pragma omp parallel` into,
// GOMP_parallel, which resolves to torch's own libgomp: the team torch's ops on this thread use.
extern "C" {
void omp_set_num_threads(int);
void GOMP_parallel(void (*fn)(void*), void* data, unsigned num_threads, unsigned flags);
int omp_get_thread_num();
int omp_get_num_threads();
}

// One op's tasks: n of them, task i's result task_bytes at out + i * task_bytes; or, with rows > 1, `rows` rows of
// task_bytes / rows bytes each, out_ld bytes apart, from out + i * (task_bytes / rows) (column blocks of a matrix).
// `run(i, into, ld)` computes task i into a buffer whose rows are ld bytes apart, and owns (holds) everything it
// reads. The helper's results go to `slots` (the job's own memory, rows packed), never to `out`.
struct Job {
  using Run = std::function<void(int64_t, void*, size_t)>;
  int64_t n;
  size_t task_bytes;
  char* out;
  int64_t rows;
  size_t row_bytes, out_ld;
  Run run;
  std::atomic<int64_t> next{0};
  std::unique_ptr<std::atomic<uint8_t>[]> state;
  std::unique_ptr<char[]> slots;

  Job(int64_t n, size_t task_bytes, char* out, int64_t rows, size_t out_ld, Run run)
      : n(n), task_bytes(task_bytes), out(out), rows(rows), row_bytes(task_bytes / rows), out_ld(out_ld),
        run(std::move(run)), state(new std::atomic<uint8_t>[n]), slots(new char[n * task_bytes]) {
    for (int64_t i = 0; i < n; ++i) state[i].store(FREE, std::memory_order_relaxed);
  }
  Job(int64_t n, size_t task_bytes, char* out, std::function<void(int64_t, void*)> run)
      : Job(n, task_bytes, out, 1, task_bytes, [run = std::move(run)](int64_t i, void* into, size_t) { run(i, into); }) {}

  char* dest(int64_t i) const { return out + i * (rows == 1 ? task_bytes : row_bytes); }
  char* slot(int64_t i) const { return slots.get() + i * task_bytes; }
  void mine(int64_t i) const { run(i, dest(i), out_ld); }  // the caller's task: straight into out
  void deliver(int64_t i) const {  // a task the helper published: from its slot into out
    for (int64_t r = 0; r < rows; ++r) std::memcpy(dest(i) + r * out_ld, slot(i) + r * row_bytes, row_bytes);
  }
};

class Helper {
 public:
  static Helper& get() {
    static Helper* helper = new Helper();  // never destroyed: its thread is detached and lives with the process
    return *helper;
  }

  // delay_us: the helper sleeps this long in each task it claimed (tests: a helper preempted mid-task).
  void enable(bool on, int64_t delay_us = 0) {
    std::lock_guard<std::mutex> lk(mu_);
    if (on && !started_) {
      std::thread([this] { loop(); }).detach();
      started_ = true;
    }
    delay_us_.store(delay_us);
    enabled_.store(on);
  }

  bool enabled() const { return enabled_.load(std::memory_order_relaxed); }

  // NOTE: a job holds tensors, and dropping a Python-made tensor's last reference takes the GIL (torch hands the
  // tensor's PyObject back to Python): on the helper, that would block it behind the engine's Python, and during
  // interpreter shutdown it ends the thread (pthread_exit through C++ frames: std::terminate, seen). So callers keep
  // every job they offered until the helper has let go of it, and drop it here, on their own thread.
  // Whether the helper was offered the job: not while it holds the lock (it may be off the CPU holding it).
  bool offer(std::shared_ptr<Job> job) {
    std::vector<std::shared_ptr<Job>> released;  // dropped when this returns, outside the lock
    {
      std::unique_lock<std::mutex> lk(mu_, std::try_to_lock);
      if (!lk.owns_lock()) return false;
      const auto held = std::partition(retired_.begin(), retired_.end(), [](const auto& j) { return j.use_count() > 1; });
      released.assign(std::make_move_iterator(held), std::make_move_iterator(retired_.end()));
      retired_.erase(held, retired_.end());
      retired_.push_back(job);
      job_ = std::move(job);
      generation_.fetch_add(1, std::memory_order_release);
    }
    cv_.notify_one();
    offered.fetch_add(1, std::memory_order_relaxed);
    return true;
  }

  std::atomic<int64_t> offered{0}, tasks{0}, stolen{0};

 private:
  void loop() {
#ifdef __linux__
    // The lowest priority (nice 19, this thread only): the helper runs on what the node leaves idle; any other
    // runnable thread (an encoder, the ingress) preempts it, and the caller takes its task over.
    setpriority(PRIO_PROCESS, static_cast<id_t>(syscall(SYS_gettid)), 19);
#endif
    // A task that calls into oneDNN (cpu_linear.cpp) runs on this thread alone: a new thread's OpenMP teams would
    // otherwise take the runtime's default size, every core.
    omp_set_num_threads(1);
    uint64_t seen = 0;
    for (;;) {
      // A step's next op comes within microseconds of the last (a few of torch's small ops between): spin a little
      // before sleeping, so the helper is on the CPU when it comes, not a wake-up (tens of us on a VM) behind.
      const auto idle = std::chrono::steady_clock::now();
      while (generation_.load(std::memory_order_acquire) == seen &&
             std::chrono::steady_clock::now() - idle < std::chrono::microseconds(SPIN_US))
        relax();
      std::shared_ptr<Job> job;
      {
        std::unique_lock<std::mutex> lk(mu_);
        cv_.wait(lk, [&] { return generation_.load() != seen; });
        seen = generation_.load();
        job = std::move(job_);
      }
      if (!job) continue;
      for (int64_t i; (i = job->next.fetch_add(1)) < job->n;) {
        uint8_t st = FREE;
        if (!job->state[i].compare_exchange_strong(st, HELPER)) continue;
        if (const int64_t us = delay_us_.load()) std::this_thread::sleep_for(std::chrono::microseconds(us));
        job->run(i, job->slot(i), job->row_bytes);
        st = HELPER;  // published (release) unless the caller took the task over meanwhile
        if (job->state[i].compare_exchange_strong(st, DONE, std::memory_order_acq_rel))
          tasks.fetch_add(1, std::memory_order_relaxed);
      }
    }
  }

  std::mutex mu_;
  std::condition_variable cv_;
  std::shared_ptr<Job> job_;                   // the last offer, until the helper takes it
  std::vector<std::shared_ptr<Job>> retired_;  // offers the helper may still hold (see offer)
  std::atomic<uint64_t> generation_{0};  // offers so far (written under mu_, read by the spinning helper)
  bool started_ = false;
  std::atomic<bool> enabled_{false};
  std::atomic<int64_t> delay_us_{0};
};

// Runs the job's tasks on the calling thread, and on the helper while it takes them; returns when all are in `out`.
inline void run_shared(std::shared_ptr<Job> job) {
  Helper& helper = Helper::get();
  if (!helper.offer(job)) {
    for (int64_t i = 0; i < job->n; ++i) job->mine(i);
    return;
  }
  const auto started = std::chrono::steady_clock::now();
  int64_t mine = 0;
  for (int64_t i; (i = job->next.fetch_add(1)) < job->n;) {
    uint8_t st = FREE;
    if (!job->state[i].compare_exchange_strong(st, MAIN)) continue;
    job->mine(i);
    ++mine;
  }
  // One of the caller's tasks' time, as the wait for a task the helper is computing before taking it over.
  const auto patience = (std::chrono::steady_clock::now() - started) / std::max<int64_t>(mine, 1);
  for (int64_t i = 0; i < job->n; ++i) {
    const auto waiting = std::chrono::steady_clock::now();
    for (;;) {
      uint8_t st = job->state[i].load(std::memory_order_acquire);
      if (st == MAIN || st == STOLEN) break;
      if (st == DONE) {
        job->deliver(i);
        break;
      }
      if (st == HELPER && std::chrono::steady_clock::now() - waiting < patience) {
        relax();
        continue;
      }
      if (job->state[i].compare_exchange_strong(st, STOLEN)) {  // FREE (claimed, not yet taken) or HELPER
        job->mine(i);
        if (st == HELPER) helper.stolen.fetch_add(1, std::memory_order_relaxed);
        break;
      }
    }
  }
}

