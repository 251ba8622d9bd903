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
// bfloat16 x on a CPU with AVX512-BF16 goes to gguf_dpbf16.cpp (blocks turned into bfloat16 in
// registers; for 1 to 3 rows with AVX512-VNNI, the blocks' bytes against x in fixed point) while
// the rows are few, and with more rows to linear_dpbf16.cpp's kernels on slices of W turned into
// bfloat16 pair panels (linear_by_panels). Otherwise each block widens to float32 (AVX2 where
// built for it) into a per-thread buffer that holds a group of rows of W, which every row of x
// then dots with (linear_impl): the weight is read once per call, as packed bytes, for any M.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include "gguf_blocks.h"
#include "transpose16.h"
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

#ifdef TANDEM_AVX2
// y[0 .. 16) = d * q + bias for 16 unsigned bytes q
inline void widen16(__m128i q, __m256 d, __m256 bias, float* y) {
  _mm256_storeu_ps(y, _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(q)), d, bias));
  _mm256_storeu_ps(y + 8, _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(q, 8))), d, bias));
}

// byte j of the result is 0x10 where bit j of `bits` is set, else 0
inline __m128i bit_per_byte(uint32_t bits16) {
  const __m128i spread = _mm_shuffle_epi8(_mm_set1_epi32(static_cast<int>(bits16)),
                                          _mm_setr_epi8(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1));
  const __m128i mask = _mm_set1_epi64x(static_cast<int64_t>(0x8040201008040201ULL));
  return _mm_and_si128(_mm_cmpeq_epi8(_mm_and_si128(spread, mask), mask), _mm_set1_epi8(0x10));
}
#endif

// 4-bit (and 5-bit) 32-value blocks: y[j] = d * q[j] + bias
template <bool five_bits>
inline void nibbles32(const uint8_t* qs, uint32_t qh, float d, float bias, float* y) {
#ifdef TANDEM_AVX2
  const __m128i bytes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(qs)), low4 = _mm_set1_epi8(15);
  __m128i lo = _mm_and_si128(bytes, low4), hi = _mm_and_si128(_mm_srli_epi16(bytes, 4), low4);
  if (five_bits) {
    lo = _mm_or_si128(lo, bit_per_byte(qh & 0xFFFF));
    hi = _mm_or_si128(hi, bit_per_byte(qh >> 16));
  }
  const __m256 vd = _mm256_set1_ps(d), vb = _mm256_set1_ps(bias);
  widen16(lo, vd, vb, y);
  widen16(hi, vd, vb, y + 16);
#else
  for (int j = 0; j < 16; ++j) {
    int lo = qs[j] & 15, hi = qs[j] >> 4;
    if (five_bits) {
      lo |= static_cast<int>((qh >> j) & 1) << 4;
      hi |= static_cast<int>((qh >> (j + 16)) & 1) << 4;
    }
    y[j] = d * static_cast<float>(lo) + bias;
    y[j + 16] = d * static_cast<float>(hi) + bias;
  }
#endif
}

struct Q4_0 {
  static constexpr int64_t elems = 32, bytes = 18;
  static void dequant(const uint8_t* b, float* y) {
    const float d = half_at(b);
    nibbles32<false>(b + 2, 0, d, -8.0f * d, y);
  }
};
struct Q4_1 {
  static constexpr int64_t elems = 32, bytes = 20;
  static void dequant(const uint8_t* b, float* y) { nibbles32<false>(b + 4, 0, half_at(b), half_at(b + 2), y); }
};
struct Q5_0 {
  static constexpr int64_t elems = 32, bytes = 22;
  static void dequant(const uint8_t* b, float* y) {
    const float d = half_at(b);
    nibbles32<true>(b + 6, u32_at(b + 2), d, -16.0f * d, y);
  }
};
struct Q5_1 {
  static constexpr int64_t elems = 32, bytes = 24;
  static void dequant(const uint8_t* b, float* y) { nibbles32<true>(b + 8, u32_at(b + 4), half_at(b), half_at(b + 2), y); }
};
struct Q8_0 {
  static constexpr int64_t elems = 32, bytes = 34;
  static void dequant(const uint8_t* b, float* y) {
    const float d = half_at(b);
    const int8_t* qs = reinterpret_cast<const int8_t*>(b + 2);
    for (int j = 0; j < 32; ++j) y[j] = d * static_cast<float>(qs[j]);
  }
};


template <bool five_bits>
inline void dequant_k4(const uint8_t* b, float* y) {
  const float d = half_at(b), dmin = half_at(b + 2);
  const uint8_t* scales = b + 4;
  const uint8_t* qh = b + 16;
  const uint8_t* qs = b + (five_bits ? 48 : 16);
  for (int s = 0; s < 8; ++s) {
    int sc, mn;
    tandem_gguf::scale_min_k4(scales, s, sc, mn);
    const float ds = d * static_cast<float>(sc), ms = dmin * static_cast<float>(mn);
    const uint8_t* q = qs + 32 * (s / 2);
    const int shift = 4 * (s % 2);
    float* ys = y + 32 * s;
#ifdef TANDEM_AVX2
    const __m128i low4 = _mm_set1_epi8(15), count = _mm_cvtsi32_si128(shift);
    const __m256 vd = _mm256_set1_ps(ds), vb = _mm256_set1_ps(-ms);
    for (int l = 0; l < 32; l += 16) {
      __m128i v = _mm_and_si128(_mm_srl_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(q + l)), count), low4);
      if (five_bits) {
        const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(qh + l));
        v = _mm_or_si128(v, _mm_slli_epi16(_mm_and_si128(_mm_srl_epi16(h, _mm_cvtsi32_si128(s)), _mm_set1_epi8(1)), 4));
      }
      widen16(v, vd, vb, ys + l);
    }
#else
    for (int l = 0; l < 32; ++l) {
      int v = (q[l] >> shift) & 15;
      if (five_bits) v |= ((qh[l] >> s) & 1) << 4;
      ys[l] = ds * static_cast<float>(v) - ms;
    }
#endif
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
#ifdef TANDEM_AVX2
          const int l = 16 * half;
          const __m128i lo = _mm_and_si128(
              _mm_srl_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(l4 + l)), _mm_cvtsi32_si128(shift)),
              _mm_set1_epi8(15));
          const __m128i hi = _mm_and_si128(
              _mm_srl_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(h2 + l)), _mm_cvtsi32_si128(2 * t)),
              _mm_set1_epi8(3));
          widen16(_mm_or_si128(lo, _mm_slli_epi16(hi, 4)), _mm256_set1_ps(ds), _mm256_set1_ps(-32.0f * ds), yt + l);
#else
          for (int l = 16 * half; l < 16 * half + 16; ++l) {
            const int q = ((l4[l] >> shift) & 15) | ((h2[l] >> (2 * t)) & 3) << 4;
            yt[l] = ds * static_cast<float>(q - 32);
          }
#endif
        }
      }
    }
  }
};

template <typename T>
inline void dequant_row(const uint8_t* row, int64_t k_size, float* y) {
  for (int64_t b = 0; b < k_size / T::elems; ++b) T::dequant(row + b * T::bytes, y + b * T::elems);
}

#ifdef TANDEM_AVX2
inline float hsum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_hadd_ps(s, s);
  return _mm_cvtss_f32(_mm_hadd_ps(s, s));
}
#endif

// out[r * ldo + c] = dot(x[r, :], w[c, :]) for r < rows, c < cols: each 8 weights loaded feed
// `rows` FMAs, each 8 inputs `cols` (k_size a multiple of 8)
template <int rows, int cols>
inline void dot_tile(const float* x, int64_t ldx, const float* w, int64_t ldw, int64_t k_size, float* out,
                     int64_t ldo) {
#ifdef TANDEM_AVX2
  __m256 acc[rows][cols];
  for (int r = 0; r < rows; ++r) {
    for (int c = 0; c < cols; ++c) acc[r][c] = _mm256_setzero_ps();
  }
  for (int64_t k = 0; k < k_size; k += 8) {
    __m256 wv[cols];
    for (int c = 0; c < cols; ++c) wv[c] = _mm256_loadu_ps(w + c * ldw + k);
    for (int r = 0; r < rows; ++r) {
      const __m256 xv = _mm256_loadu_ps(x + r * ldx + k);
      for (int c = 0; c < cols; ++c) acc[r][c] = _mm256_fmadd_ps(xv, wv[c], acc[r][c]);
    }
  }
  for (int r = 0; r < rows; ++r) {
    for (int c = 0; c < cols; ++c) out[r * ldo + c] = hsum(acc[r][c]);
  }
#else
  for (int r = 0; r < rows; ++r) {
    for (int c = 0; c < cols; ++c) {
      float sum = 0.0f;
      for (int64_t k = 0; k < k_size; ++k) sum += x[r * ldx + k] * w[c * ldw + k];
      out[r * ldo + c] = sum;
    }
  }
#endif
}

constexpr int kTileRows = 2, kTileCols = 4;

template <int rows>
void dot_tile_cols(int cols, const float* x, int64_t ldx, const float* w, int64_t ldw, int64_t k_size, float* out,
                   int64_t ldo) {
  switch (cols) {
    case 1: return dot_tile<rows, 1>(x, ldx, w, ldw, k_size, out, ldo);
    case 2: return dot_tile<rows, 2>(x, ldx, w, ldw, k_size, out, ldo);
    case 3: return dot_tile<rows, 3>(x, ldx, w, ldw, k_size, out, ldo);
    default: return dot_tile<rows, kTileCols>(x, ldx, w, ldw, k_size, out, ldo);
  }
}

// a float32 buffer per thread, grown to the largest size asked for, 64-byte aligned
float* scratch(std::vector<float>& buffer, int64_t size) {
  if (static_cast<int64_t>(buffer.size()) < size + 16) buffer.resize(size + 16);
  return reinterpret_cast<float*>((reinterpret_cast<uintptr_t>(buffer.data()) + 63) & ~uintptr_t{63});
}

// Threads take groups of `group` output rows from a shared counter, widen the group's rows of
// W into a float32 buffer once, and run 2 x 4 dot tiles of every row of x against it. Few rows
// of x: groups of 4 (16 K floats, in L1 for K up to 2048); more: groups of 16, so that x is
// read from cache once per 16 outputs rather than per 4.
template <typename T>
void linear_impl(float* out, const float* x, int64_t m_size, const uint8_t* w, int64_t n_size, int64_t k_size) {
  const int64_t row_bytes = k_size / T::elems * T::bytes;
  const int64_t group = m_size < 8 ? 4 : 16;
  const int64_t groups = (n_size + group - 1) / group;
  tandem_cpu::for_each_chunk(groups, tandem_cpu::chunk_for(groups, 8), [&](int64_t begin, int64_t end) {
    static thread_local std::vector<float> buffer;
    float* wide = scratch(buffer, group * k_size);
    for (int64_t g = begin; g < end; ++g) {
      const int64_t n0 = g * group, width = std::min(group, n_size - n0);
      for (int64_t c = 0; c < width; ++c) dequant_row<T>(w + (n0 + c) * row_bytes, k_size, wide + c * k_size);
      for (int64_t m0 = 0; m0 < m_size; m0 += kTileRows) {
        for (int64_t c0 = 0; c0 < width; c0 += kTileCols) {
          const int cols = static_cast<int>(std::min<int64_t>(kTileCols, width - c0));
          const float* xm = x + m0 * k_size;
          float* om = out + m0 * n_size + n0 + c0;
          if (m_size - m0 >= 2) {
            dot_tile_cols<2>(cols, xm, k_size, wide + c0 * k_size, k_size, k_size, om, n_size);
          } else {
            dot_tile_cols<1>(cols, xm, k_size, wide + c0 * k_size, k_size, k_size, om, n_size);
          }
        }
      }
    }
  });
}

#if defined(__x86_64__) && defined(__GNUC__)
#define TANDEM_PANELS 1
#define TANDEM_PANELS_TARGET __attribute__((target("avx512f,avx512bw,avx512vl,avx512bf16")))

using tandem_cpu::transpose16;

// W's rows [n0, n0 + rows) as bfloat16 pair panels, the layout of linear_dpbf16.cpp's kernels:
// panels [ceil(rows / 16), K / 2, 16, 2], panel p pair j column c = W[n0 + 16p + c, 2j .. 2j + 1],
// each value rounded to nearest even from its float32 dequantization (as a dequantized bfloat16
// model's weight is); columns past `rows` zero. A block of the panel's 16 rows at a time: widened
// to float32, each 32 values rounded to 16 bfloat16 pairs, the 16 x 16 pairs transposed into the
// panel's next 16 pair rows (1 KiB, contiguous).
template <typename T>
TANDEM_PANELS_TARGET void one_panel(uint32_t* panel, const uint8_t* first_row, int64_t row_bytes, int64_t live,
                                    int64_t k_size, float* block) {
  if (live < 16) std::fill(block, block + 16 * T::elems, 0.0f);
  for (int64_t kb = 0; kb < k_size / T::elems; ++kb) {
    for (int64_t c = 0; c < live; ++c) T::dequant(first_row + c * row_bytes + kb * T::bytes, block + c * T::elems);
    for (int64_t s = 0; s < T::elems; s += 32) {
      __m512i r[16];
      for (int c = 0; c < 16; ++c) {
        const float* v = block + c * T::elems + s;
        r[c] = (__m512i)_mm512_cvtne2ps_pbh(_mm512_loadu_ps(v + 16), _mm512_loadu_ps(v));
      }
      transpose16(r);
      uint32_t* dst = panel + (kb * T::elems + s) / 2 * 16;
      for (int j = 0; j < 16; ++j) _mm512_storeu_si512(dst + j * 16, r[j]);
    }
  }
}

template <typename T>
void panels_of(uint16_t* panels, const uint8_t* w, int64_t row_bytes, int64_t n0, int64_t rows, int64_t k_size) {
  const int64_t n_panels = (rows + 15) / 16;
  tandem_cpu::for_each_share(n_panels, 1, [&](int64_t begin, int64_t end) {
    static thread_local std::vector<float> buffer;
    float* block = scratch(buffer, 16 * T::elems);  // [16 rows][elems]
    for (int64_t p = begin; p < end; ++p) {
      tandem_gguf::prefetch_ahead(w + (n0 + p * 16) * row_bytes, 16 * row_bytes);
      one_panel<T>(reinterpret_cast<uint32_t*>(panels) + p * (k_size / 2) * 16, w + (n0 + p * 16) * row_bytes,
                   row_bytes, std::min<int64_t>(16, rows - p * 16), k_size, block);
    }
  });
}
#endif

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

bool gguf_linear_few_rows(float* out, const uint16_t* x, int64_t m_size, const uint8_t* w, int64_t n_size,
                          int64_t k_size, int64_t ggml_type);  // gguf_dpbf16.cpp
bool use_gguf_int8(bool on);                                // gguf_dpbf16.cpp
bool dpbf16_supported();                                    // linear_dpbf16.cpp
bool amx_supported();
void panel_linear_dpbf16(at::Tensor& out, const at::Tensor& x, const at::Tensor& panels,
                         const c10::optional<at::Tensor>& bias, bool bf16_values);
void panel_linear_amx(at::Tensor& out, const at::Tensor& x, const at::Tensor& panels,
                      const c10::optional<at::Tensor>& bias, bool bf16_values);

namespace {

// Many rows of bfloat16 x on a CPU with AVX512-BF16: W a slice of output rows at a time (about
// kPanelSliceBytes of bfloat16, so that it stays in L2) turned into pair panels, then multiplied by
// linear_dpbf16.cpp's AMX kernel (or its vdpbf16ps one without AMX). The slice's values are the
// dequantized bfloat16 model's, so are the products.
constexpr int64_t kPanelSliceBytes = int64_t{512} << 10;

template <typename T>
bool linear_by_panels(at::Tensor& out, const at::Tensor& x16, const uint8_t* w, int64_t n_size, int64_t k_size) {
#ifndef TANDEM_PANELS
  return false;
#endif
  const bool amx = amx_supported() && k_size % 32 == 0;
  if (!amx && !dpbf16_supported()) return false;
  const int64_t row_bytes = k_size / T::elems * T::bytes;
  const int64_t slice = std::max<int64_t>(16, kPanelSliceBytes / (k_size * 2) / 16 * 16);
  at::Tensor panels = at::empty({(std::min(slice, n_size) + 15) / 16, k_size / 2, 16, 2}, x16.options());
  for (int64_t n0 = 0; n0 < n_size; n0 += slice) {
    const int64_t rows = std::min(slice, n_size - n0);
    at::Tensor part = panels.narrow(0, 0, (rows + 15) / 16);
#ifdef TANDEM_PANELS
    panels_of<T>(reinterpret_cast<uint16_t*>(part.data_ptr()), w, row_bytes, n0, rows, k_size);
#endif
    at::Tensor cols = out.narrow(1, n0, rows);
    if (amx)
      panel_linear_amx(cols, x16, part, c10::nullopt, false);
    else
      panel_linear_dpbf16(cols, x16, part, c10::nullopt, false);
  }
  return true;
}

}  // namespace

at::Tensor gguf_linear(const at::Tensor& x, const at::Tensor& qweight, int64_t ggml_type, int64_t in_features) {
  TORCH_CHECK_VALUE(x.device().is_cpu() && x.dim() == 2 && x.size(1) == in_features &&
                        (x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16),
                    "gguf_linear: x must be a float32 or bfloat16 CPU tensor [M, in_features=", in_features, "]");
  at::Tensor out = at::empty({x.size(0), qweight.size(0)}, x.options().dtype(at::kFloat));
  bool done = false;
  dispatch(ggml_type, "gguf_linear", [&](auto type) {
    using T = decltype(type);
    check_qweight("gguf_linear", qweight, in_features, T::elems, T::bytes);
    if (x.size(0) == 0 || qweight.size(0) == 0) return;
    if (x.scalar_type() == at::kBFloat16) {
      const at::Tensor x16 = x.contiguous();
      done = gguf_linear_few_rows(out.data_ptr<float>(), reinterpret_cast<const uint16_t*>(x16.data_ptr()), x.size(0),
                                  qweight.data_ptr<uint8_t>(), qweight.size(0), in_features, ggml_type) ||
             linear_by_panels<T>(out, x16, qweight.data_ptr<uint8_t>(), qweight.size(0), in_features);
    }
    if (done) return;
    const at::Tensor x32 = x.to(at::kFloat).contiguous();
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
  m.def("use_gguf_int8(bool on) -> bool", &use_gguf_int8);
}

TORCH_LIBRARY_IMPL(tandem_cpu, CPU, m) {
  m.impl("gguf_linear", &gguf_linear);
  m.impl("gguf_dequantize_rows", &gguf_dequantize_rows);
}
