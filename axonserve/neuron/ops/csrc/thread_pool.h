// The kernels' own team: a persistent pool whose loops are claimed chunk by chunk.
//
// Why not at::parallel_for (OpenMP): a decode step runs ~270 parallel regions (9 a layer), each
// tens of microseconds. With OpenMP's threads sleeping between regions (the actors' default,
// OMP_WAIT_POLICY=PASSIVE) every region pays a futex wake-up of the team; spinning instead
// (GOMP_SPINCOUNT) costs whole time slices whenever another process holds one of the two cores,
// since a region's end waits for every member (docs/benchmarks.md#fig-kernel-pool). Here:
//  - each thread takes its own run of chunks first, in order (as a static schedule: a skinny
//    matmul's later passes find their weight columns in the same core's cache), then what is
//    left of the others';
//  - the calling thread starts at once; a member that has not woken up (or lost its core) does
//    not hold the loop up: its chunks are taken by the others, and the caller waits only for
//    chunks a member actually claimed (spinning briefly, then asleep: its core goes idle and the
//    scheduler can move a preempted member there);
//  - members spin for a bounded time after a loop (AXONSERVE_POOL_SPIN_US, default 20, 0-1000) before
//    they sleep on a futex, so the next loop of a step finds them awake;
// Loops go to the pool only inside a PoolScope (the decoder stack's steps whose linears are all
// the kernels' own); elsewhere pool_for is at::parallel_for. Chunk i of n covers
// [b + len * i / n, b + len * (i + 1) / n): which thread computes a chunk changes nothing in its
// result. AXONSERVE_POOL=0 (or set_thread_pool(False)) turns the pool off everywhere.
#pragma once

#include <ATen/Parallel.h>

#if defined(__linux__)
#include <linux/futex.h>
#include <pthread.h>
#include <sched.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <climits>
#include <cstdint>
#include <cstdlib>
#include <exception>
#include <mutex>
#include <thread>
#include <utility>
#include <vector>

namespace axpool {

inline void cpu_relax() {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_ia32_pause();
#elif defined(__aarch64__)
  __asm__ __volatile__("yield");
#endif
}

inline void futex_wait(std::atomic<uint32_t>* a, uint32_t v) {
  syscall(SYS_futex, reinterpret_cast<uint32_t*>(a), FUTEX_WAIT_PRIVATE, v, nullptr, nullptr, 0);
}
inline void futex_wake_all(std::atomic<uint32_t>* a) {
  syscall(SYS_futex, reinterpret_cast<uint32_t*>(a), FUTEX_WAKE_PRIVATE, INT_MAX, nullptr, nullptr, 0);
}

inline thread_local bool t_inside = false;  // this thread is running a chunk (nested loops run inline)
inline thread_local bool t_scope = false;   // this thread's loops go to the pool (PoolScope)

class Pool {
 public:
  using Call = void (*)(const void* ctx, int64_t b, int64_t e);
  static constexpr int MAX_SLOTS = 64;  // threads a loop takes (more: OpenMP's)

  // Never destroyed (members sleep in futex_wait at exit). A forked child has none of the
  // parent's members and maybe a mutex held by a parent thread: it starts a pool of its own.
  static Pool& get() {
    static std::atomic<Pool*> p{nullptr};
    static const bool hooked = [] {
      pthread_atfork(nullptr, nullptr, [] { p.store(nullptr); });
      return true;
    }();
    (void)hooked;
    Pool* q = p.load(std::memory_order_acquire);
    if (!q) {
      static std::mutex mu;  // one new Pool at a time
      std::lock_guard<std::mutex> g(mu);
      q = p.load(std::memory_order_acquire);
      if (!q) p.store(q = new Pool(), std::memory_order_release);
    }
    return *q;
  }

  // body(ctx, b, e) over [begin, end) in `chunks` (1..256) pieces, on the caller and up to
  // threads - 1 members; false (nothing run) while another thread's loop holds the pool
  bool run(int64_t begin, int64_t end, int64_t chunks, int threads, Call call, const void* ctx) {
    std::unique_lock<std::mutex> busy(job_mu_, std::try_to_lock);
    if (!busy.owns_lock()) return false;
    loops_.fetch_add(1, std::memory_order_relaxed);
    grow(threads - 1);
    begin_ = begin, len_ = end - begin, chunks_ = chunks, call_ = call, ctx_ = ctx;
    slots_n_.store(threads, std::memory_order_relaxed);
    err_ = nullptr;
    done_.store(0, std::memory_order_relaxed);
    const uint32_t g = gen_.load(std::memory_order_relaxed) + 1;
    for (int t = 0; t < threads; ++t)  // thread t's own run of chunks, as a static schedule's
      slots_[t].claim.store(pack(g, chunks * (t + 1) / threads, chunks * t / threads), std::memory_order_relaxed);
    gen_.store(g, std::memory_order_seq_cst);
    if (sleepers_.load(std::memory_order_seq_cst) > 0) futex_wake_all(&gen_);
    work(0, g);
    // The chunks members claimed: they run on a core now, or were preempted mid-chunk. After a
    // short spin this thread sleeps: its core goes idle, and the scheduler moves a member that
    // lost its core to another process here (a spinning or yielding caller would keep it busy).
    const auto t0 = std::chrono::steady_clock::now();
    for (int i = 1; done_.load(std::memory_order_acquire) < uint32_t(chunks); ++i) {
      cpu_relax();
      if ((i & 63) == 0 && std::chrono::steady_clock::now() - t0 > std::chrono::microseconds(spin_us_)) {
        caller_waits_.store(true, std::memory_order_seq_cst);
        for (uint32_t d; (d = done_.load(std::memory_order_seq_cst)) < uint32_t(chunks);) futex_wait(&done_, d);
        caller_waits_.store(false, std::memory_order_relaxed);
        break;
      }
    }
    if (err_) std::rethrow_exception(std::exchange(err_, nullptr));
    return true;
  }

  int64_t loops() const { return loops_.load(std::memory_order_relaxed); }
  int64_t spin_us() const { return spin_us_; }


 private:
  Pool() {
    const char* s = std::getenv("AXONSERVE_POOL_SPIN_US");
    // bounded: members spinning for long burn a core between steps for nothing (results unchanged)
    spin_us_ = s ? std::clamp<int64_t>(std::atoll(s), 0, MAX_SPIN_US) : 20;
  }

  static uint64_t pack(uint32_t g, uint32_t last, uint32_t next) {
    return (uint64_t(g) << 32) | (uint64_t(last) << 16) | next;
  }

  // Runs generation g's chunks as participant `self` (0: the caller): its own run first, in order
  // (a thread meets the same columns of a weight in every pass over it, as with OpenMP's static
  // schedule: they stay in its core's cache), then what is left of the others' (a late member's).
  void work(int self, uint32_t g) {
    const int n = std::min(slots_n_.load(std::memory_order_relaxed), MAX_SLOTS);
    for (int k = 0; k < n; ++k) {
      std::atomic<uint64_t>& slot = slots_[(self + k) % n].claim;
      uint64_t c = slot.load(std::memory_order_acquire);
      for (;;) {
        const uint32_t last = (c >> 16) & 0xffff, i = c & 0xffff;
        if (uint32_t(c >> 32) != g || i >= last) break;
        if (!slot.compare_exchange_weak(c, c + 1, std::memory_order_acq_rel, std::memory_order_acquire)) continue;
        // the job's fields are stable while one of its chunks is unfinished
        const int64_t total = chunks_, b = begin_ + len_ * i / total, e = begin_ + len_ * (i + 1) / total;
        t_inside = true;
        try {
          call_(ctx_, b, e);
        } catch (...) {
          std::lock_guard<std::mutex> g_(err_mu_);
          if (!err_) err_ = std::current_exception();
        }
        t_inside = false;
        if (done_.fetch_add(1, std::memory_order_seq_cst) + 1 == uint32_t(total) &&
            caller_waits_.load(std::memory_order_seq_cst))
          futex_wake_all(&done_);  // the last chunk: the caller sleeps on it
        c = slot.load(std::memory_order_acquire);
      }
    }
  }

  void grow(int n) {
    while (int(threads_.size()) < n) {
      const int id = threads_.size();
      threads_.emplace_back([this, id] { member(id); });
      pthread_setname_np(threads_.back().native_handle(), "axon-pool");
      threads_.back().detach();
    }
  }

  void member(int id) {
    uint32_t seen = gen_.load(std::memory_order_acquire);
    bool idle = false;
    for (;;) {
      auto t0 = std::chrono::steady_clock::now();
      for (int i = 1;; ++i) {
        if (gen_.load(std::memory_order_acquire) != seen) break;
        cpu_relax();
        if ((i & 63) == 0 &&
            (idle ||
             std::chrono::steady_clock::now() - t0 > std::chrono::microseconds(spin_us_))) {
          sleepers_.fetch_add(1, std::memory_order_seq_cst);
          futex_wait(&gen_, seen);
          sleepers_.fetch_sub(1, std::memory_order_seq_cst);
          t0 = std::chrono::steady_clock::now();
        }
      }
      seen = gen_.load(std::memory_order_acquire);
      idle = id + 1 >= slots_n_.load(std::memory_order_relaxed);  // beyond the loop's threads: sits out, asleep
      if (!idle) work(id + 1, seen);
    }
  }

  std::mutex job_mu_, err_mu_;
  std::vector<std::thread> threads_;
  std::atomic<uint32_t> gen_{0};
  struct alignas(64) Slot {
    std::atomic<uint64_t> claim{0};  // generation (32 bits) | end of the run (16) | next chunk (16)
  };
  Slot slots_[MAX_SLOTS];
  std::atomic<int64_t> loops_{0};   // loops run on the pool so far (tests)
  std::atomic<uint32_t> done_{0};  // the loop's finished chunks (the caller sleeps on it)
  std::atomic<bool> caller_waits_{false};
  std::atomic<int> sleepers_{0};
  static constexpr int64_t MAX_SPIN_US = 1000;
  int64_t spin_us_ = 20;
  // the running loop (written before its generation is published)
  int64_t begin_ = 0, len_ = 0, chunks_ = 1;
  Call call_ = nullptr;
  const void* ctx_ = nullptr;
  std::atomic<int> slots_n_{0};  // the loop's threads, the caller's slot first
  std::exception_ptr err_;
};

inline std::atomic<bool> g_enabled{[] {
  const char* s = std::getenv("AXONSERVE_POOL");
  return !(s && (s[0] == '0' || s[0] == 'f' || s[0] == 'n'));
}()};

}  // namespace axpool
#endif

// at::parallel_for's contract (f(b, e) over disjoint ranges covering [begin, end), ranges of about
// `grain` or more where there are several) on the kernels' pool inside a PoolScope: up to 4 chunks
// a thread. Inline for a small range, one thread, or inside a parallel region or a chunk.
template <class F>
void pool_for(int64_t begin, int64_t end, int64_t grain, const F& f) {
  const int64_t n = end - begin;
  if (n <= 0) return;
#if !defined(__linux__)
  at::parallel_for(begin, end, grain, f);
#else
  const int threads = at::get_num_threads();
  if (axpool::t_inside) {  // a loop inside a chunk (on a member: never OpenMP's team from there)
    f(begin, end);
    return;
  }
  if (!axpool::t_scope || threads > axpool::Pool::MAX_SLOTS || !axpool::g_enabled.load(std::memory_order_relaxed)) {
    at::parallel_for(begin, end, grain, f);
    return;
  }
  const int64_t g = std::max<int64_t>(grain, 1);
  if (threads <= 1 || n <= g || at::in_parallel_region()) {
    f(begin, end);
    return;
  }
  const int64_t chunks = std::min<int64_t>((n + g - 1) / g, 4 * threads);
  if (!axpool::Pool::get().run(begin, end, chunks, threads,
                               [](const void* ctx, int64_t b, int64_t e) { (*static_cast<const F*>(ctx))(b, e); }, &f))
    at::parallel_for(begin, end, grain, f);  // another thread's loop holds the pool
#endif
}

// The calling thread's loops run on the pool while one is alive (and the pool is enabled). Scoped
// to work whose loops are all the kernels' own: a step that also runs oneDNN's products (more rows
// than the skinny kernels take) alternates between OpenMP's team and the pool's, and served 128
// streams ~10 % slower so (docs/benchmarks.md#fig-kernel-pool).
class PoolScope {
 public:
  explicit PoolScope(bool on) {
#if defined(__linux__)
    prev_ = axpool::t_scope;
    axpool::t_scope = on;
#endif
  }
  ~PoolScope() {
#if defined(__linux__)
    axpool::t_scope = prev_;
#endif
  }
  PoolScope(const PoolScope&) = delete;
  PoolScope& operator=(const PoolScope&) = delete;

 private:
  bool prev_ = false;
};

// (tests, A/B scripts) sets the calling thread's scope outside a PoolScope; returns the previous
inline bool axpool_scope(bool on) {
#if defined(__linux__)
  const bool prev = axpool::t_scope;
  axpool::t_scope = on;
  return prev;
#else
  return false;
#endif
}

// Whether the calling thread's loops go to the kernels' pool now (inside a PoolScope, pool enabled)
inline bool axpool_in_scope() {
#if defined(__linux__)
  return axpool::t_scope && axpool::g_enabled.load(std::memory_order_relaxed);
#else
  return false;
#endif
}

inline int64_t axpool_loops() {
#if defined(__linux__)
  return axpool::Pool::get().loops();
#else
  return 0;
#endif
}

inline int64_t axpool_spin_us() {
#if defined(__linux__)
  return axpool::Pool::get().spin_us();
#else
  return 0;
#endif
}

inline void axpool_enable(bool on) {
#if defined(__linux__)
  axpool::g_enabled.store(on);
#endif
}
