// Work items shared out over torch's OpenMP threads from a counter (tandem's CPU kernels).
//
// at::parallel_for hands each thread one fixed range; when the OS takes a core away from one of
// them for a while (the server's event loop, a client on the same machine), the whole call
// waits for that range. Here each thread takes the next `chunk` items until none are left, so a
// thread that is held up holds up only the chunk it is in, and uneven items (sequences of
// different lengths) even out.
#pragma once

#include <ATen/Parallel.h>

#include <algorithm>
#include <atomic>
#include <cstdint>

namespace tandem_cpu {

// f(begin, end) for consecutive ranges of at most `chunk` items covering [0, total), each range
// once, on any thread.
template <typename F>
inline void for_each_chunk(int64_t total, int64_t chunk, const F& f) {
  if (total <= 0) return;
  chunk = std::max<int64_t>(1, chunk);
  const int64_t threads = std::min<int64_t>(at::get_num_threads(), (total + chunk - 1) / chunk);
  if (threads <= 1 || at::in_parallel_region()) {
    f(0, total);
    return;
  }
  std::atomic<int64_t> next{0};
  at::parallel_for(0, threads, 1, [&](int64_t, int64_t) {
    for (int64_t begin; (begin = next.fetch_add(chunk, std::memory_order_relaxed)) < total;) {
      f(begin, std::min(total, begin + chunk));
    }
  });
}

// A chunk that gives each of the threads about `per_thread` chunks of `total` items.
inline int64_t chunk_for(int64_t total, int64_t per_thread) {
  return std::max<int64_t>(1, total / (std::max<int64_t>(1, at::get_num_threads()) * per_thread));
}

}  // namespace tandem_cpu
