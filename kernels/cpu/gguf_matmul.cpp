// Linear layers whose weight stays in GGUF's packed ggml blocks: y = x @ W.T, W [N, K] read
// straight from the file's bytes, one row of blocks per output feature. Built into the
// tandem_cpu extension with the other kernels.
//
//   x       [M, K] float32 or bfloat16, rows contiguous (bfloat16 widens to float32 first)
//   qweight [N, row_bytes] uint8, row n = K / elems blocks of one ggml type, in file order
//   out     [M, N] in x's dtype; products and sums in float32
//
// The blocks (every multi-byte field little-endian; d, dmin, m are IEEE half floats):
//
//   Q4_0  32 values, 18 B: d | qs[16]                  w[j] = d * (q[j] - 8)
//   Q4_1  32 values, 20 B: d | m | qs[16]              w[j] = d * q[j] + m
//   Q5_0  32 values, 22 B: d | qh[4] | qs[16]          w[j] = d * (q[j] - 16)
//   Q5_1  32 values, 24 B: d | m | qh[4] | qs[16]      w[j] = d * q[j] + m
//   Q8_0  32 values, 34 B: d | int8 qs[32]             w[j] = d * qs[j]
//         4-bit q[j]: low nibble of qs[j] for j < 16, high nibble of qs[j - 16] above; the 5th
//         bit of q[j] is bit j of the uint32 qh.
//   Q4_K 256 values, 144 B: d | dmin | scales[12] | qs[128]
//   Q5_K 256 values, 176 B: d | dmin | scales[12] | qh[32] | qs[128]
//         eight sub-blocks of 32, w = d * sc[s] * q - dmin * mn[s]; sub-block s = 2i + h takes
//         nibble h of qs[32i .. 32i + 31] (and for Q5_K bit s of qh[0 .. 31] as its 5th bit);
//         sc, mn are 6 bits each: s < 4: sc = scales[s] & 63, mn = scales[s + 4] & 63;
//         s >= 4: sc = (scales[s + 4] & 15) | (scales[s - 4] >> 6) << 4,
//                 mn = (scales[s + 4] >> 4) | (scales[s] >> 6) << 4
//   Q6_K 256 values, 210 B: ql[128] | qh[64] | int8 scales[16] | d
//         value 128h + 32t + l (h < 2, t < 4, l < 32): q = nibble t / 2 of ql[64h + 32(t % 2) + l]
//         | bits 2t, 2t + 1 of qh[32h + l] << 4;  w = d * scales[8h + 2t + l / 16] * (q - 32)
//
// Few rows (M < kPanelRows): each thread takes output rows a few at a time (work_queue.h),
// widens one row of W into a float32 buffer (L1) and dots it with every row of x: the weight is
// read once, as packed bytes. More rows: each thread widens 16 rows of W at a time into a
// [K, 16] panel (L2) and runs 6 x 16 register tiles over all of x, as panel_linear does.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include "work_queue.h"

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#include <immintrin.h>
#define TANDEM_AVX2 1
#endif

namespace {

constexpr int64_t kPanel = 16;
constexpr int64_t kTile = 6;
constexpr int64_t kPanelRows = 8;

inline float half_at(const uint8_t* p) {
  uint16_t bits;
  std::memcpy(&bits, p, 2);
#ifdef TANDEM_AVX2
  return _cvtsh_ss(bits);
#else
  return c10::detail::fp16_ieee_to_fp32_value(bits);
#endif
}

inline uint32_t u32_at(const uint8_t* p) {
  uint32_t v;
  std::memcpy(&v, p, 4);
  return v;
}

// 4-bit (and 5-bit) 32-value blocks: y[j] = d * q[j] + bias
inline void nibbles32(const uint8_t* qs, uint32_t qh, float d, float bias, float* y) {
  for (int j = 0; j < 16; ++j) {
    const int lo = (qs[j] & 15) | static_cast<int>((qh >> j) & 1) << 4;
    const int hi = (qs[j] >> 4) | static_cast<int>((qh >> (j + 16)) & 1) << 4;
    y[j] = d * static_cast<float>(lo) + bias;
    y[j + 16] = d * static_cast<float>(hi) + bias;
  }
}

struct Q4_0 {
  static constexpr int64_t elems = 32, bytes = 18;
  static void dequant(const uint8_t* b, float* y) {
    const float d = half_at(b);
    nibbles32(b + 2, 0, d, -8.0f * d, y);
  }
};
struct Q4_1 {
  static constexpr int64_t elems = 32, bytes = 20;
  static void dequant(const uint8_t* b, float* y) { nibbles32(b + 4, 0, half_at(b), half_at(b + 2), y); }
};
struct Q5_0 {
  static constexpr int64_t elems = 32, bytes = 22;
  static void dequant(const uint8_t* b, float* y) {
    const float d = half_at(b);
    nibbles32(b + 6, u32_at(b + 2), d, -16.0f * d, y);
  }
};
struct Q5_1 {
  static constexpr int64_t elems = 32, bytes = 24;
  static void dequant(const uint8_t* b, float* y) { nibbles32(b + 8, u32_at(b + 4), half_at(b), half_at(b + 2), y); }
};
struct Q8_0 {
  static constexpr int64_t elems = 32, bytes = 34;
  static void dequant(const uint8_t* b, float* y) {
    const float d = half_at(b);
    const int8_t* qs = reinterpret_cast<const int8_t*>(b + 2);
    for (int j = 0; j < 32; ++j) y[j] = d * static_cast<float>(qs[j]);
  }
};

// the 6-bit scale and min of sub-block s of a Q4_K / Q5_K super-block
inline void scale_min_k4(const uint8_t* scales, int s, int& sc, int& mn) {
  if (s < 4) {
    sc = scales[s] & 63;
    mn = scales[s + 4] & 63;
  } else {
    sc = (scales[s + 4] & 15) | (scales[s - 4] >> 6) << 4;
    mn = (scales[s + 4] >> 4) | (scales[s] >> 6) << 4;
  }
}

template <bool five_bits>
inline void dequant_k4(const uint8_t* b, float* y) {
  const float d = half_at(b), dmin = half_at(b + 2);
  const uint8_t* scales = b + 4;
  const uint8_t* qh = b + 16;
  const uint8_t* qs = b + (five_bits ? 48 : 16);
  for (int s = 0; s < 8; ++s) {
    int sc, mn;
    scale_min_k4(scales, s, sc, mn);
    const float ds = d * static_cast<float>(sc), ms = dmin * static_cast<float>(mn);
    const uint8_t* q = qs + 32 * (s / 2);
    const int shift = 4 * (s % 2);
    float* ys = y + 32 * s;
    for (int l = 0; l < 32; ++l) {
      int v = (q[l] >> shift) & 15;
      if (five_bits) v |= ((qh[l] >> s) & 1) << 4;
      ys[l] = ds * static_cast<float>(v) - ms;
    }
  }
}

struct Q4_K {
  static constexpr int64_t elems = 256, bytes = 144;
  static void dequant(const uint8_t* b, float* y) { dequant_k4<false>(b, y); }
};
struct Q5_K {
  static constexpr int64_t elems = 256, bytes = 176;
  static void dequant(const uint8_t* b, float* y) { dequant_k4<true>(b, y); }
};
struct Q6_K {
  static constexpr int64_t elems = 256, bytes = 210;
  static void dequant(const uint8_t* b, float* y) {
    const uint8_t* ql = b;
    const uint8_t* qh = b + 128;
    const int8_t* scales = reinterpret_cast<const int8_t*>(b + 192);
    const float d = half_at(b + 208);
    for (int h = 0; h < 2; ++h) {
      for (int t = 0; t < 4; ++t) {
        const uint8_t* l4 = ql + 64 * h + 32 * (t % 2);
        const uint8_t* h2 = qh + 32 * h;
        const int shift = 4 * (t / 2);
        float* yt = y + 128 * h + 32 * t;
        for (int half = 0; half < 2; ++half) {
          const float ds = d * static_cast<float>(scales[8 * h + 2 * t + half]);
          for (int l = 16 * half; l < 16 * half + 16; ++l) {
            const int q = ((l4[l] >> shift) & 15) | ((h2[l] >> (2 * t)) & 3) << 4;
            yt[l] = ds * static_cast<float>(q - 32);
          }
        }
      }
    }
  }
};

template <typename T>
inline void dequant_row(const uint8_t* row, int64_t k_size, float* y) {
  for (int64_t b = 0; b < k_size / T::elems; ++b) T::dequant(row + b * T::bytes, y + b * T::elems);
}

inline float dot(const float* a, const float* b, int64_t n) {
#ifdef TANDEM_AVX2
  __m256 acc0 = _mm256_setzero_ps(), acc1 = _mm256_setzero_ps(), acc2 = _mm256_setzero_ps(),
         acc3 = _mm256_setzero_ps();
  int64_t i = 0;
  for (; i + 32 <= n; i += 32) {
    acc0 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i), acc0);
    acc1 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i + 8), _mm256_loadu_ps(b + i + 8), acc1);
    acc2 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i + 16), _mm256_loadu_ps(b + i + 16), acc2);
    acc3 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i + 24), _mm256_loadu_ps(b + i + 24), acc3);
  }
  const __m256 sum = _mm256_add_ps(_mm256_add_ps(acc0, acc1), _mm256_add_ps(acc2, acc3));
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(sum), _mm256_extractf128_ps(sum, 1));
  s = _mm_hadd_ps(s, s);
  s = _mm_hadd_ps(s, s);
  float total = _mm_cvtss_f32(s);
#else
  float total = 0.0f;
  int64_t i = 0;
#endif
  for (; i < n; ++i) total += a[i] * b[i];
  return total;
}

// rows x 16 outputs of one widened panel: tile[r * 16 + c] = sum_k x[r, k] * panel[k, c]
template <int rows>
inline void tile_kernel(const float* x, int64_t ldx, const float* panel, int64_t k_size, float* tile) {
#ifdef TANDEM_AVX2
  __m256 acc[rows][2];
  for (int r = 0; r < rows; ++r) acc[r][0] = acc[r][1] = _mm256_setzero_ps();
  for (int64_t k = 0; k < k_size; ++k) {
    const __m256 w0 = _mm256_load_ps(panel + k * kPanel), w1 = _mm256_load_ps(panel + k * kPanel + 8);
    for (int r = 0; r < rows; ++r) {
      const __m256 xb = _mm256_broadcast_ss(x + r * ldx + k);
      acc[r][0] = _mm256_fmadd_ps(xb, w0, acc[r][0]);
      acc[r][1] = _mm256_fmadd_ps(xb, w1, acc[r][1]);
    }
  }
  for (int r = 0; r < rows; ++r) {
    _mm256_storeu_ps(tile + r * kPanel, acc[r][0]);
    _mm256_storeu_ps(tile + r * kPanel + 8, acc[r][1]);
  }
#else
  float acc[rows][kPanel] = {};
  for (int64_t k = 0; k < k_size; ++k) {
    for (int r = 0; r < rows; ++r) {
      for (int c = 0; c < kPanel; ++c) acc[r][c] += x[r * ldx + k] * panel[k * kPanel + c];
    }
  }
  std::memcpy(tile, acc, sizeof(acc));
#endif
}

void run_tile(int64_t rows, const float* x, int64_t ldx, const float* panel, int64_t k_size, float* tile) {
  switch (rows) {
    case 1: return tile_kernel<1>(x, ldx, panel, k_size, tile);
    case 2: return tile_kernel<2>(x, ldx, panel, k_size, tile);
    case 3: return tile_kernel<3>(x, ldx, panel, k_size, tile);
    case 4: return tile_kernel<4>(x, ldx, panel, k_size, tile);
    case 5: return tile_kernel<5>(x, ldx, panel, k_size, tile);
    default: return tile_kernel<6>(x, ldx, panel, k_size, tile);
  }
}

// a float32 buffer per thread, grown to the largest size asked for
float* scratch(std::vector<float>& buffer, int64_t size) {
  if (static_cast<int64_t>(buffer.size()) < size + 16) buffer.resize(size + 16);
  return reinterpret_cast<float*>((reinterpret_cast<uintptr_t>(buffer.data()) + 63) & ~uintptr_t{63});
}

template <typename T>
void rows_impl(float* out, const float* x, int64_t m_size, const uint8_t* w, int64_t n_size, int64_t k_size) {
  const int64_t row_bytes = k_size / T::elems * T::bytes;
  tandem_cpu::for_each_chunk(n_size, tandem_cpu::chunk_for(n_size, 8), [&](int64_t begin, int64_t end) {
    static thread_local std::vector<float> buffer;
    float* wide = scratch(buffer, k_size);
    for (int64_t n = begin; n < end; ++n) {
      dequant_row<T>(w + n * row_bytes, k_size, wide);
      for (int64_t m = 0; m < m_size; ++m) out[m * n_size + n] = dot(wide, x + m * k_size, k_size);
    }
  });
}

template <typename T>
void panels_impl(float* out, const float* x, int64_t m_size, const uint8_t* w, int64_t n_size, int64_t k_size) {
  const int64_t row_bytes = k_size / T::elems * T::bytes;
  const int64_t n_panels = (n_size + kPanel - 1) / kPanel;
  tandem_cpu::for_each_chunk(n_panels, tandem_cpu::chunk_for(n_panels, 4), [&](int64_t begin, int64_t end) {
    static thread_local std::vector<float> buffer;
    float* wide = scratch(buffer, k_size * (kPanel + 1));
    float* row = wide + k_size * kPanel;
    alignas(32) float tile[kTile * kPanel];
    for (int64_t p = begin; p < end; ++p) {
      const int64_t col0 = p * kPanel, cols = std::min(kPanel, n_size - col0);
      for (int64_t c = 0; c < kPanel; ++c) {
        if (c < cols) dequant_row<T>(w + (col0 + c) * row_bytes, k_size, row);
        for (int64_t k = 0; k < k_size; ++k) wide[k * kPanel + c] = c < cols ? row[k] : 0.0f;
      }
      for (int64_t r0 = 0; r0 < m_size; r0 += kTile) {
        const int64_t rows = std::min(kTile, m_size - r0);
        run_tile(rows, x + r0 * k_size, k_size, wide, k_size, tile);
        for (int64_t r = 0; r < rows; ++r) std::memcpy(out + (r0 + r) * n_size + col0, tile + r * kPanel, cols * sizeof(float));
      }
    }
  });
}

template <typename T>
void linear_impl(float* out, const float* x, int64_t m_size, const uint8_t* w, int64_t n_size, int64_t k_size) {
  if (m_size < kPanelRows) return rows_impl<T>(out, x, m_size, w, n_size, k_size);
  panels_impl<T>(out, x, m_size, w, n_size, k_size);
}

template <typename T>
void dequant_rows_impl(float* out, const uint8_t* w, const int64_t* rows, int64_t count, int64_t k_size) {
  const int64_t row_bytes = k_size / T::elems * T::bytes;
  at::parallel_for(0, count, 16, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) dequant_row<T>(w + rows[i] * row_bytes, k_size, out + i * k_size);
  });
}

// f(T{}) with T the block struct (elems, bytes, dequant) of the ggml type number
template <typename F>
void dispatch(int64_t ggml_type, const char* op, const F& f) {
  switch (ggml_type) {
    case 2: return f(Q4_0{});
    case 3: return f(Q4_1{});
    case 6: return f(Q5_0{});
    case 7: return f(Q5_1{});
    case 8: return f(Q8_0{});
    case 12: return f(Q4_K{});
    case 13: return f(Q5_K{});
    case 14: return f(Q6_K{});
    default: TORCH_CHECK_VALUE(false, op, ": no kernel for ggml type ", ggml_type);
  }
}

void check_qweight(const char* op, const at::Tensor& qweight, int64_t k_size, int64_t elems, int64_t bytes) {
  TORCH_CHECK_VALUE(qweight.device().is_cpu() && qweight.scalar_type() == at::kByte && qweight.dim() == 2 &&
                        qweight.is_contiguous(),
                    op, ": qweight must be a contiguous uint8 CPU tensor [N, row_bytes]");
  TORCH_CHECK_VALUE(k_size > 0 && k_size % elems == 0, op, ": in_features=", k_size,
                    " must be a positive multiple of the type's block of ", elems);
  TORCH_CHECK_VALUE(qweight.size(1) == k_size / elems * bytes, op, ": qweight rows hold ", qweight.size(1),
                    " bytes, expected ", k_size / elems * bytes, " for in_features=", k_size);
}

}  // namespace

at::Tensor gguf_linear(const at::Tensor& x, const at::Tensor& qweight, int64_t ggml_type, int64_t in_features) {
  TORCH_CHECK_VALUE(x.device().is_cpu() && x.dim() == 2 && x.size(1) == in_features &&
                        (x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16),
                    "gguf_linear: x must be a float32 or bfloat16 CPU tensor [M, in_features=", in_features, "]");
  const at::Tensor x32 = x.to(at::kFloat).contiguous();
  at::Tensor out = at::empty({x.size(0), qweight.size(0)}, x32.options());
  dispatch(ggml_type, "gguf_linear", [&](auto type) {
    using T = decltype(type);
    check_qweight("gguf_linear", qweight, in_features, T::elems, T::bytes);
    if (x.size(0) == 0 || qweight.size(0) == 0) return;
    linear_impl<T>(out.data_ptr<float>(), x32.data_ptr<float>(), x.size(0), qweight.data_ptr<uint8_t>(),
                   qweight.size(0), in_features);
  });
  return out.to(x.scalar_type());
}

at::Tensor gguf_dequantize_rows(const at::Tensor& qweight, int64_t ggml_type, int64_t in_features,
                                const at::Tensor& rows, at::ScalarType dtype) {
  TORCH_CHECK_VALUE(rows.device().is_cpu() && rows.scalar_type() == at::kLong && rows.dim() == 1,
                    "gguf_dequantize_rows: rows must be a 1-d int64 CPU tensor");
  const at::Tensor index = rows.contiguous();
  at::Tensor out = at::empty({index.size(0), in_features}, at::TensorOptions().dtype(at::kFloat));
  dispatch(ggml_type, "gguf_dequantize_rows", [&](auto type) {
    using T = decltype(type);
    check_qweight("gguf_dequantize_rows", qweight, in_features, T::elems, T::bytes);
    if (index.numel() == 0) return;
    const int64_t* ip = index.data_ptr<int64_t>();
    const int64_t n_rows = qweight.size(0);
    for (int64_t i = 0; i < index.numel(); ++i) {
      TORCH_CHECK_INDEX(ip[i] >= 0 && ip[i] < n_rows, "gguf_dequantize_rows: row ", ip[i], " out of range [0, ",
                        n_rows, ")");
    }
    dequant_rows_impl<T>(out.data_ptr<float>(), qweight.data_ptr<uint8_t>(), ip, index.numel(), in_features);
  });
  return out.to(dtype);
}

TORCH_LIBRARY_FRAGMENT(tandem_cpu, m) {
  m.def("gguf_linear(Tensor x, Tensor qweight, int ggml_type, int in_features) -> Tensor");
  m.def("gguf_dequantize_rows(Tensor qweight, int ggml_type, int in_features, Tensor rows, ScalarType dtype) -> Tensor");
}

TORCH_LIBRARY_IMPL(tandem_cpu, CPU, m) {
  m.impl("gguf_linear", &gguf_linear);
  m.impl("gguf_dequantize_rows", &gguf_dequantize_rows);
}
