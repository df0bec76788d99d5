// The kernels' own team: a persistent pool whose loops are claimed chunk by chunk.
//
// Why not at::parallel_for (OpenMP): a decode step runs ~270 parallel regions (9 a layer), each
// tens of microseconds. With OpenMP's threads sleeping between regions (the actors' default,
// OMP_WAIT_POLICY=PASSIVE) every region pays a futex wake-up of the team; spinning instead
// (GOMP_SPINCOUNT) costs whole time slices whenever another process holds one of the two cores,
// since a region's end waits for every member (docs/benchmarks.md#fig-kernel-pool). Here:
//  - the calling thread starts on the work at once and claims chunks until none are left; a
//    member that has not woken up by then does not hold the loop up: a loop waits only for
//    chunks another member has actually claimed;
//  - members spin for a bounded time after a loop (AXONSERVE_POOL_SPIN_US, default 50) before
//    they sleep on a futex, so the next region of a step finds them awake;
//  - park() sends them to sleep at once (before oneDNN's OpenMP team takes the cores).
// Chunk i of n covers [b + len * i / n, b + len * (i + 1) / n): which thread computes a chunk
// changes nothing in its result. AXONSERVE_POOL=0 (or set_thread_pool(False)) runs the loops on
// at::parallel_for again.
#pragma once

#include <ATen/Parallel.h>

#if defined(__linux__)
#include <linux/futex.h>
#include <pthread.h>
#include <sched.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <climits>
#include <cstdint>
#include <cstdlib>
#include <exception>
#include <mutex>
#include <thread>
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

class Pool {
 public:
  using Call = void (*)(const void* ctx, int64_t b, int64_t e);

  static Pool& get() {
    static Pool* p = new Pool();  // never destroyed: members sleep in futex_wait at exit
    return *p;
  }

  // body(ctx, b, e) over [begin, end) in `chunks` pieces, on the caller and up to threads - 1 members
  void run(int64_t begin, int64_t end, int64_t chunks, int threads, Call call, const void* ctx) {
    std::unique_lock<std::mutex> busy(job_mu_, std::try_to_lock);
    if (!busy.owns_lock() || chunks > 0xffff) {  // another thread's loop is running: this one runs alone
      call(ctx, begin, end);
      return;
    }
    grow(threads - 1);
    begin_ = begin, len_ = end - begin, call_ = call, ctx_ = ctx;
    members_.store(threads - 1, std::memory_order_relaxed);
    err_ = nullptr;
    done_.store(0, std::memory_order_relaxed);
    const uint32_t g = gen_.load(std::memory_order_relaxed) + 1;
    claim_.store(pack(g, uint32_t(chunks), 0), std::memory_order_release);
    park_.store(false, std::memory_order_relaxed);
    gen_.store(g, std::memory_order_seq_cst);
    if (sleepers_.load(std::memory_order_seq_cst) > 0) futex_wake_all(&gen_);
    work(g);
    // the chunks members claimed: they run on a core now, or were preempted mid-chunk
    for (int i = 0; done_.load(std::memory_order_acquire) < chunks; ++i) {
      if (i < 4096) cpu_relax();
      else sched_yield();  // a preempted member may be waiting for this core
    }
    if (err_) std::rethrow_exception(err_);
  }

  // members go to sleep now instead of spinning (the next loop wakes them)
  void park() { park_.store(true, std::memory_order_relaxed); }

 private:
  Pool() {
    const char* s = std::getenv("AXONSERVE_POOL_SPIN_US");
    spin_us_ = s ? std::atoll(s) : 50;
  }

  static uint64_t pack(uint32_t g, uint32_t n, uint32_t i) { return (uint64_t(g) << 32) | (uint64_t(n) << 16) | i; }

  // claims and runs generation g's chunks until none is left; the caller's share, or a member's
  void work(uint32_t g) {
    uint64_t c = claim_.load(std::memory_order_acquire);
    for (;;) {
      const uint32_t n = (c >> 16) & 0xffff, i = c & 0xffff;
      if (uint32_t(c >> 32) != g || i >= n) return;
      if (!claim_.compare_exchange_weak(c, c + 1, std::memory_order_acq_rel, std::memory_order_acquire)) continue;
      // the job's fields are stable while one of its chunks is unfinished
      const int64_t b = begin_ + len_ * i / n, e = begin_ + len_ * (i + 1) / n;
      t_inside = true;
      try {
        call_(ctx_, b, e);
      } catch (...) {
        std::lock_guard<std::mutex> g_(err_mu_);
        if (!err_) err_ = std::current_exception();
      }
      t_inside = false;
      done_.fetch_add(1, std::memory_order_acq_rel);
      c = claim_.load(std::memory_order_acquire);
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
    for (;;) {
      auto t0 = std::chrono::steady_clock::now();
      for (int i = 1;; ++i) {
        if (gen_.load(std::memory_order_acquire) != seen) break;
        cpu_relax();
        if ((i & 63) == 0 &&
            (park_.load(std::memory_order_relaxed) ||
             std::chrono::steady_clock::now() - t0 > std::chrono::microseconds(spin_us_))) {
          sleepers_.fetch_add(1, std::memory_order_seq_cst);
          futex_wait(&gen_, seen);
          sleepers_.fetch_sub(1, std::memory_order_seq_cst);
          t0 = std::chrono::steady_clock::now();
        }
      }
      seen = gen_.load(std::memory_order_acquire);
      if (id < members_.load(std::memory_order_relaxed)) work(seen);  // (a member beyond this loop's thread count sits it out)
    }
  }

  std::mutex job_mu_, err_mu_;
  std::vector<std::thread> threads_;
  std::atomic<uint32_t> gen_{0};
  std::atomic<uint64_t> claim_{0};  // generation (32 bits) | chunks (16) | next chunk (16)
  std::atomic<int64_t> done_{0};
  std::atomic<int> sleepers_{0};
  std::atomic<bool> park_{false};
  int64_t spin_us_ = 50;
  // the running loop (written before its generation is published)
  int64_t begin_ = 0, len_ = 0;
  Call call_ = nullptr;
  const void* ctx_ = nullptr;
  std::atomic<int> members_{0};
  std::exception_ptr err_;
};

inline std::atomic<bool> g_enabled{[] {
  const char* s = std::getenv("AXONSERVE_POOL");
  return !(s && (s[0] == '0' || s[0] == 'f' || s[0] == 'n'));
}()};

}  // namespace axpool
#endif

// at::parallel_for's contract (f(b, e) over disjoint ranges covering [begin, end), ranges of at
// least `grain` where there are several) on the kernels' pool: up to 4 chunks a thread, claimed
// as threads come free. Inline for a small range, one thread, or inside a parallel region.
template <class F>
void pool_for(int64_t begin, int64_t end, int64_t grain, const F& f) {
  const int64_t n = end - begin;
  if (n <= 0) return;
#if !defined(__linux__)
  at::parallel_for(begin, end, grain, f);
#else
  const int threads = at::get_num_threads();
  if (!axpool::g_enabled.load(std::memory_order_relaxed)) {
    at::parallel_for(begin, end, grain, f);
    return;
  }
  if (threads <= 1 || n <= grain || axpool::t_inside || at::in_parallel_region()) {
    f(begin, end);
    return;
  }
  const int64_t chunks = std::min<int64_t>((n + grain - 1) / std::max<int64_t>(grain, 1), 4 * threads);
  axpool::Pool::get().run(begin, end, chunks, threads,
                          [](const void* ctx, int64_t b, int64_t e) { (*static_cast<const F*>(ctx))(b, e); }, &f);
#endif
}

inline void axpool_enable(bool on) {
#if defined(__linux__)
  axpool::g_enabled.store(on);
#endif
}

// Before work that runs on OpenMP's team (oneDNN, torch's ops): the pool's members stop spinning.
inline void pool_park() {
#if defined(__linux__)
  axpool::Pool::get().park();
#endif
}
