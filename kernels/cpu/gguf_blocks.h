// What the GGUF kernels (gguf_matmul.cpp, gguf_dpbf16.cpp) share about ggml's block layouts.
#pragma once

#include <cstdint>

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

}  // namespace tandem_gguf
