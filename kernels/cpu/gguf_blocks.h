// What the GGUF kernels (gguf_matmul.cpp, gguf_dpbf16.cpp) share about ggml's block layouts.
#pragma once

#include <cstdint>

#if defined(__x86_64__) || defined(__i386__)
#include <xmmintrin.h>
#endif

namespace tandem_gguf {

// the 6-bit scale and min of sub-block s of a Q4_K / Q5_K super-block's 12 scale bytes
inline void scale_min_k4(const uint8_t* scales, int s, int& sc, int& mn) {
  if (s < 4) {
    sc = scales[s] & 63;
    mn = scales[s + 4] & 63;
  } else {
    sc = (scales[s + 4] & 15) | (scales[s - 4] >> 6) << 4;
    mn = (scales[s + 4] >> 4) | (scales[s] >> 6) << 4;
  }
}

// A kernel about to read `bytes` of blocks from `w` (a tile's output rows, a panel's) asks for
// the lines kPrefetchAheadBytes further on, into L2 (prefetcht1), all at once. The decode kernels
// compute slower than memory delivers; from memory a thread waits on its own loads, and the
// hardware prefetchers do not run far enough ahead. Requests into L1 (prefetcht0), or spread over
// the K loop, measured no faster on Zen 4; these measured faster on an LM head, the distance
// within a wide flat optimum (docs/benchmarks.md).
constexpr int64_t kPrefetchAheadBytes = 16384;
inline void prefetch_ahead(const uint8_t* w, int64_t bytes) {
#if defined(__x86_64__) || defined(__i386__)
  const char* ahead = reinterpret_cast<const char*>(w) + kPrefetchAheadBytes;
  for (int64_t i = 0; i < bytes; i += 64) _mm_prefetch(ahead + i, _MM_HINT_T1);
#else
  (void)w, (void)bytes;
#endif
}

}  // namespace tandem_gguf
