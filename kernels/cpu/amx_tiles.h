// AMX tile configuration shared by tandem's tile kernels (linear_dpbf16.cpp, linear_amx_f32.cpp).
// A kernel loads the configuration on the thread that runs it and releases it when done.
#pragma once

#include <cstdint>

namespace tandem_cpu {

// palette 1, every tile 16 rows of 64 bytes (a 16 x 32 bfloat16 A or B tile, a 16 x 16 float32 C)
struct alignas(64) TileConfig {
  uint8_t palette = 1, start_row = 0, reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

inline TileConfig full_tiles() {
  TileConfig cfg;
  for (int t = 0; t < 8; ++t) cfg.colsb[t] = 64, cfg.rows[t] = 16;
  return cfg;
}

}  // namespace tandem_cpu

// Whether this CPU and its operating system give the process AMX-BF16 (linear_dpbf16.cpp).
bool amx_supported();
