// Work items shared out over threads from a counter (tandem's CPU kernels).
//
// at::parallel_for hands each thread one fixed range; when the OS takes a core away from one of
// them for a while (the server's event loop, a client on the same machine), the whole call
// waits for that range. Here each thread takes the next `chunk` items until none are left, so a
// thread that is held up holds up only the chunk it is in, and uneven items (sequences of
// different lengths) even out.
//
// The threads are tandem's own (WorkPool: torch's thread count less the caller, started on
// first use), not OpenMP's: an OpenMP region ends only once every thread of the team has
// arrived, so on a machine whose cores are shared each call waits for a thread the OS has not
// even woken yet, though the caller did all the work. A WorkPool call returns as soon as every
// item is done; a helper that wakes late finds nothing left. Between calls the helpers spin for
// a while (kSpinMicros; kPassiveSpinMicros under OMP_WAIT_POLICY=PASSIVE, which tandem's CLI sets;
// TANDEM_CPU_SPIN_US overrides both), then sleep until the next call: a decode step's kernel
// calls follow each other within microseconds, so a short spin keeps the helpers awake through a
// step without holding a core long after it.
// for_each_share gives each thread a contiguous share of the items instead, eaten from its front a
// chunk at a time; a thread done with its own share takes chunks from the back of the others'.
// A kernel that streams its weight once (a decode step's matrix-vector products) then reads one
// unbroken range per core, which the hardware prefetchers follow, where taking turns from one
// counter would have each core skip the chunks the other took; a thread the OS holds up still
// holds up only the chunk it is in.
// Between calls the caller often works alone for a while (a decode step's norms, rotary and
// attention between its matrix products) while memory sits idle: warm() lets the idle helpers
// read the start of their shares of the next call's weight into their caches meanwhile (each
// stops at the next job, and at the next warm()).
// TANDEM_CPU_WORK_POOL=omp (or use_work_pool(false)) goes back to at::parallel_for.
#pragma once

#include <ATen/Parallel.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <mutex>
#include <thread>
#include <vector>

#if defined(__SSE2__)
#include <emmintrin.h>
#endif

#include <unistd.h>

namespace tandem_cpu {

inline void cpu_relax() {
#if defined(__SSE2__)
  _mm_pause();
#endif
}

class WorkPool {
 public:
  static constexpr int64_t kSpinMicros = 200, kPassiveSpinMicros = 50;

  static WorkPool& get() {
    static WorkPool* pool = new WorkPool();  // never destroyed: detached helpers may outlive exit
    return *pool;
  }

  static std::atomic<bool>& enabled() {
    static std::atomic<bool> on{[] {
      const char* env = std::getenv("TANDEM_CPU_WORK_POOL");
      return env == nullptr || std::strcmp(env, "omp") != 0;
    }()};
    return on;
  }

  // f(begin, end) over [0, total) in chunks, on this thread and up to threads - 1 helpers. False
  // (nothing run) when another call holds the pool: the caller runs the work itself.
  // shares: each of the threads starts on a contiguous share of its own (for_each_share).
  static constexpr int64_t kMaxShares = 64;

  template <typename F>
  bool run(int64_t total, int64_t chunk, int64_t threads, const F& f, bool shares = false) {
    std::unique_lock<std::mutex> owner(owner_, std::try_to_lock);
    if (!owner.owns_lock()) return false;
    start_helpers(threads - 1);
    Job job;
    job.total = total;
    job.chunk = chunk;
    job.helpers = threads - 1;
    job.ctx = &f;
    job.call = [](const void* ctx, int64_t b, int64_t e) { (*static_cast<const F*>(ctx))(b, e); };
    if (shares) {
      job.num_shares = std::min(threads, kMaxShares);
      for (int64_t i = 0; i < job.num_shares; ++i) {
        job.shares[i].store(pack(total * i / job.num_shares, total * (i + 1) / job.num_shares));
      }
    }
    job_.store(&job);
    generation_.fetch_add(1);
    if (sleepers_.load() > 0) {
      std::lock_guard<std::mutex> lock(sleep_mu_);
      wake_.notify_all();
    }
    work(job, 0);
    pause_until([&] { return job.done.load(std::memory_order_acquire) >= total; });
    job_.store(nullptr);
    pause_until([&] { return active_.load() == 0; });  // a helper may still hold &job
    return true;
  }

  // Helpers read [data, data + bytes) between jobs: helper i the share a for_each_share over
  // `threads` threads gives it first (bytes * (i + 1) / threads on), at most max_bytes of it, in
  // order, until a job or another warm() comes. warm(nullptr, ...) stops them and returns once no
  // helper reads the old range (call it before that memory may go). Nothing happens while
  // another thread holds the pool or the helpers sleep.
  void warm(const char* data, int64_t bytes, int64_t max_bytes, int64_t threads) {
    std::unique_lock<std::mutex> owner(owner_, std::try_to_lock);
    if (!owner.owns_lock()) return;
    warm_seq_.fetch_add(1);  // odd while the range changes
    warm_data_.store(data);
    warm_bytes_.store(bytes);
    warm_max_.store(max_bytes);
    warm_threads_.store(threads);
    warm_seq_.fetch_add(1);
    if (data == nullptr) {
      pause_until([&] { return warming_.load() == 0; });
    } else if (sleepers_.load() == 0) {
      generation_.fetch_add(1);  // the spinning helpers look up
    }
  }

 private:
  static constexpr int64_t kWarmStride = 1024;  // bytes read between checks for a job

  struct Job {
    int64_t total = 0, chunk = 1, helpers = 0, num_shares = 0;
    const void* ctx = nullptr;
    void (*call)(const void*, int64_t, int64_t) = nullptr;
    std::atomic<int64_t> next{0}, done{0};
    std::atomic<uint64_t> shares[kMaxShares];  // (front << 32 | back) of each share, when num_shares
  };

  static uint64_t pack(int64_t front, int64_t back) {
    return (static_cast<uint64_t>(front) << 32) | static_cast<uint64_t>(back);
  }

  WorkPool() : pid_(getpid()) {
    const char* policy = std::getenv("OMP_WAIT_POLICY");
    const bool passive = policy != nullptr && (std::strcmp(policy, "PASSIVE") == 0 || std::strcmp(policy, "passive") == 0);
    spin_micros_ = passive ? kPassiveSpinMicros : kSpinMicros;
    if (const char* spin = std::getenv("TANDEM_CPU_SPIN_US")) spin_micros_ = std::max<int64_t>(0, std::atoll(spin));
  }

  // spins until done(), giving the core away now and then: the helper it waits for may be
  // waiting for this very core
  template <typename Done>
  static void pause_until(const Done& done) {
    for (int spin = 1; !done(); ++spin) {
      if ((spin & 1023) == 0) std::this_thread::yield();
      cpu_relax();
    }
  }

  // participant `me` (0: the caller, helper i: i + 1)
  static void work(Job& job, int64_t me) {
    if (job.num_shares > 0) {
      for (int64_t k = 0; k < job.num_shares; ++k) take_share(job, (me + k) % job.num_shares, k == 0);
      return;
    }
    for (int64_t begin; (begin = job.next.fetch_add(job.chunk)) < job.total;) {
      const int64_t end = std::min(job.total, begin + job.chunk);
      job.call(job.ctx, begin, end);
      job.done.fetch_add(end - begin, std::memory_order_release);
    }
  }

  // chunks of share `index` until it is empty: from its front (its owner) or its back (another)
  static void take_share(Job& job, int64_t index, bool own) {
    std::atomic<uint64_t>& share = job.shares[index];
    for (uint64_t cur = share.load();;) {
      const int64_t front = static_cast<int64_t>(cur >> 32), back = static_cast<int64_t>(cur & 0xffffffffu);
      if (front >= back) return;
      const int64_t begin = own ? front : std::max(front, back - job.chunk);
      const int64_t end = own ? std::min(back, front + job.chunk) : back;
      if (!share.compare_exchange_weak(cur, own ? pack(end, back) : pack(front, begin))) continue;
      job.call(job.ctx, begin, end);
      job.done.fetch_add(end - begin, std::memory_order_release);
      cur = share.load();
    }
  }

  void start_helpers(int64_t count) {
    if (getpid() != pid_) {  // a forked child has none of its parent's threads
      pid_ = getpid();
      started_ = 0;
    }
    for (; started_ < count; ++started_) std::thread([this, index = started_] { helper(index); }).detach();
  }

  void helper(int64_t index) {
    uint64_t seen = generation_.load(), warm_seq = 0;
    int64_t warmed = 0;
    for (;;) {
      wait_for_change(seen);
      seen = generation_.load();
      active_.fetch_add(1);
      Job* job = job_.load();
      if (job != nullptr && index < job->helpers) work(*job, index + 1);
      active_.fetch_sub(1);
      warm_share(index, seen, warm_seq, warmed);
    }
  }

  // helper `index`'s part of the warm() range, from where it stopped last time (`warmed` bytes
  // into it) if the range is the same (`last_seq`)
  void warm_share(int64_t index, uint64_t seen, uint64_t& last_seq, int64_t& warmed) {
    warming_.fetch_add(1);
    const uint64_t seq = warm_seq_.load();
    const char* data = warm_data_.load();
    const int64_t bytes = warm_bytes_.load(), max_bytes = warm_max_.load(), threads = warm_threads_.load();
    if ((seq & 1) == 0 && data != nullptr && index + 1 < threads && warm_seq_.load() == seq) {
      if (seq != last_seq) {
        last_seq = seq;
        warmed = 0;
      }
      const int64_t begin = bytes * (index + 1) / threads;
      const int64_t end = std::min(bytes * (index + 2) / threads, begin + max_bytes);
      uint32_t sink = 0;
      while (begin + warmed < end) {
        const int64_t from = begin + warmed, to = std::min(end, from + kWarmStride);
        for (int64_t at = from; at < to; at += 64) sink += *reinterpret_cast<const volatile uint8_t*>(data + at);
        warmed = to - begin;
        if (generation_.load(std::memory_order_relaxed) != seen || warm_seq_.load(std::memory_order_relaxed) != seq) {
          break;
        }
      }
      warm_sink_.store(sink, std::memory_order_relaxed);
    }
    warming_.fetch_sub(1);
  }

  void wait_for_change(uint64_t seen) {
    const auto until = std::chrono::steady_clock::now() + std::chrono::microseconds(spin_micros_);
    for (int spin = 0; generation_.load() == seen; ++spin) {
      if ((spin & 255) == 0 && std::chrono::steady_clock::now() >= until) {
        std::unique_lock<std::mutex> lock(sleep_mu_);
        sleepers_.fetch_add(1);
        wake_.wait(lock, [&] { return generation_.load() != seen; });
        sleepers_.fetch_sub(1);
        return;
      }
      cpu_relax();
    }
  }

  std::mutex owner_, sleep_mu_;
  std::condition_variable wake_;
  std::atomic<Job*> job_{nullptr};
  std::atomic<uint64_t> generation_{0};
  std::atomic<int> active_{0}, sleepers_{0}, warming_{0};
  std::atomic<uint64_t> warm_seq_{0};
  std::atomic<const char*> warm_data_{nullptr};
  std::atomic<int64_t> warm_bytes_{0}, warm_max_{0}, warm_threads_{0};
  std::atomic<uint32_t> warm_sink_{0};
  int64_t started_ = 0;
  pid_t pid_;
  int64_t spin_micros_ = kSpinMicros;
};

// f(begin, end) for consecutive ranges of at most `chunk` items covering [0, total), each range
// once, on any thread; `shares`: each thread starts on a contiguous share of its own (the header's
// note; totals past 2^31 items, which a share cannot pack, go without).
template <typename F>
inline void run_chunks(int64_t total, int64_t chunk, const F& f, bool shares) {
  if (total <= 0) return;
  chunk = std::max<int64_t>(1, chunk);
  const int64_t threads = std::min<int64_t>(at::get_num_threads(), (total + chunk - 1) / chunk);
  if (threads <= 1 || at::in_parallel_region()) {
    f(0, total);
    return;
  }
  shares = shares && total < (int64_t{1} << 31);
  if (WorkPool::enabled().load(std::memory_order_relaxed)) {
    if (!WorkPool::get().run(total, chunk, threads, f, shares)) f(0, total);
    return;
  }
  std::atomic<int64_t> next{0};
  at::parallel_for(0, threads, 1, [&](int64_t t0, int64_t t1) {
    if (shares) {
      for (int64_t t = t0; t < t1; ++t) f(total * t / threads, total * (t + 1) / threads);
      return;
    }
    for (int64_t begin; (begin = next.fetch_add(chunk, std::memory_order_relaxed)) < total;) {
      f(begin, std::min(total, begin + chunk));
    }
  });
}

template <typename F>
inline void for_each_chunk(int64_t total, int64_t chunk, const F& f) {
  run_chunks(total, chunk, f, false);
}

// for_each_chunk with shares: for a kernel that streams memory in item order.
template <typename F>
inline void for_each_share(int64_t total, int64_t chunk, const F& f) {
  run_chunks(total, chunk, f, true);
}

// WorkPool::warm for the next for_each_share over [data, data + bytes) (no-op without the pool
// or with one thread); max_bytes per helper, TANDEM_CPU_WARM_KB (KiB; 0: never) by default.
inline void warm_next(const void* data, int64_t bytes) {
  static const int64_t max_bytes = [] {
    const char* kb = std::getenv("TANDEM_CPU_WARM_KB");
    return kb == nullptr ? int64_t{512} << 10 : std::max<int64_t>(0, std::atoll(kb)) << 10;
  }();
  if (max_bytes == 0 || !WorkPool::enabled().load(std::memory_order_relaxed)) return;
  const int64_t threads = at::get_num_threads();
  if (threads > 1 || data == nullptr) WorkPool::get().warm(static_cast<const char*>(data), bytes, max_bytes, threads);
}

// A chunk that gives each of the threads about `per_thread` chunks of `total` items.
inline int64_t chunk_for(int64_t total, int64_t per_thread) {
  return std::max<int64_t>(1, total / (std::max<int64_t>(1, at::get_num_threads()) * per_thread));
}

}  // namespace tandem_cpu
