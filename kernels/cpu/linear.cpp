// Dense linear layers on the CPU: y = x @ W.T (+ bias), W packed once into 16-column panels
// (tandem.models.cpu_linear). Built into the tandem_cpu extension with the decode attention.
//
//   x      [M, K] float32, rows contiguous
//   panels [ceil(N / 16), K, 16] float32, bfloat16 or float16: panel p, row k holds
//          W[16p .. 16p + 15, k] (columns past N are zero)
//   out    [M, N] float32
//
// The weight streams from memory once per block of rows (kRowBlock of them, whose x stays in
// L2 while every panel goes by), a slice of K at a time (kKBlock rows of the panel, which stay in
// L1 for every tile of the row block); a 6 x 16 register tile accumulates, so each weight element
// loaded feeds up to 12 FMAs. Built for AVX512, float32 panels go two at a time under a 12 x 32
// tile (each x value broadcast feeds two 512-bit FMAs) from 32 rows on, one at a time under a
// 12 x 16 tile below that. 16-bit weights widen to float32 as they load (for 32 rows or more,
// once per slice into a float32 buffer that every tile reads): half the bytes of a float32
// copy, float32 products and sums. Threads take the panels (and, for long
// inputs, the row blocks) a few at a time from a shared counter (work_queue.h). Without AVX2
// (builds for other CPUs) the same loops run in plain C++.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include "work_queue.h"

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#include <immintrin.h>
#define TANDEM_AVX2 1
#endif

namespace {

constexpr int64_t kPanel = 16;
constexpr int64_t kTile = 6;
constexpr int64_t kRowBlock = 96;
constexpr int64_t kKBlock = 256;
constexpr int64_t kPrefetchSlices = 3;

#ifdef TANDEM_AVX2
inline void load16(const float* w, __m256& lo, __m256& hi) {
  lo = _mm256_loadu_ps(w);
  hi = _mm256_loadu_ps(w + 8);
}
inline void load16(const c10::BFloat16* w, __m256& lo, __m256& hi) {
  const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w));
  lo = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm256_castsi256_si128(raw)), 16));
  hi = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm256_extracti128_si256(raw, 1)), 16));
}
inline void load16(const c10::Half* w, __m256& lo, __m256& hi) {
  const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w));
  lo = _mm256_cvtph_ps(_mm256_castsi256_si128(raw));
  hi = _mm256_cvtph_ps(_mm256_extracti128_si256(raw, 1));
}

// rows x 16 outputs of one panel: tile[r * 16 + c] = sum_k x[r, k] * panel[k, c]
template <typename W, int rows>
inline void tile_kernel(const float* x, int64_t ldx, const W* panel, int64_t k_size, float* tile, bool accumulate,
                        const W* prefetch) {
  __m256 acc[rows][2];
  for (int r = 0; r < rows; ++r) {
    acc[r][0] = accumulate ? _mm256_loadu_ps(tile + r * kPanel) : _mm256_setzero_ps();
    acc[r][1] = accumulate ? _mm256_loadu_ps(tile + r * kPanel + 8) : _mm256_setzero_ps();
  }
  for (int64_t k = 0; k < k_size; ++k) {
    __m256 w0, w1;
    if (prefetch != nullptr) _mm_prefetch(reinterpret_cast<const char*>(prefetch + k * kPanel), _MM_HINT_T1);
    load16(panel + k * kPanel, w0, w1);
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
}
#ifdef __AVX512F__
// float32 weights (or 16-bit ones widened once per slice) with AVX512: rows x 16 outputs of one
// panel, one 512-bit sum per row, up to kFloatTile rows a tile (each weight row loaded feeds up to
// 12 FMAs, as the 256-bit tile's does, in half the instructions); with fewer than four rows the
// k rows go round-robin into `chains` sums per row so that four or more FMAs are in flight.
constexpr int64_t kFloatTile = 12;
template <int rows>
inline void tile_kernel512(const float* x, int64_t ldx, const float* panel, int64_t k_size, float* tile,
                           bool accumulate, const float* prefetch) {
  constexpr int chains = rows >= 4 ? 1 : (rows >= 2 ? 2 : 4);
  __m512 acc[chains][rows];
  for (int r = 0; r < rows; ++r) {
    acc[0][r] = accumulate ? _mm512_loadu_ps(tile + r * kPanel) : _mm512_setzero_ps();
    for (int c = 1; c < chains; ++c) acc[c][r] = _mm512_setzero_ps();
  }
  int64_t k = 0;
  for (; k + chains <= k_size; k += chains) {
    if (prefetch != nullptr) _mm_prefetch(reinterpret_cast<const char*>(prefetch + k * kPanel), _MM_HINT_T1);
    for (int c = 0; c < chains; ++c) {
      const __m512 w = _mm512_loadu_ps(panel + (k + c) * kPanel);
      for (int r = 0; r < rows; ++r) acc[c][r] = _mm512_fmadd_ps(_mm512_set1_ps(x[r * ldx + k + c]), w, acc[c][r]);
    }
  }
  for (; k < k_size; ++k) {
    const __m512 w = _mm512_loadu_ps(panel + k * kPanel);
    for (int r = 0; r < rows; ++r) acc[0][r] = _mm512_fmadd_ps(_mm512_set1_ps(x[r * ldx + k]), w, acc[0][r]);
  }
  for (int r = 0; r < rows; ++r) {
    __m512 sum = acc[0][r];
    for (int c = 1; c < chains; ++c) sum = _mm512_add_ps(sum, acc[c][r]);
    _mm512_storeu_ps(tile + r * kPanel, sum);
  }
}
// two adjacent panels at once (32 columns): each x value broadcast feeds two FMAs. For each k,
// two weight rows are asked for: at `prefetch` and one slice (k_size rows) past it, in memory
// order — along panel0, on into panel1 and the next pair (asking for each panel's own rows
// ahead instead measured slower at 64 rows)
template <int rows>
inline void tile_kernel512x2(const float* x, int64_t ldx, const float* panel0, const float* panel1, int64_t k_size,
                             float* tile0, float* tile1, bool accumulate, const float* prefetch) {
  __m512 acc0[rows], acc1[rows];
  for (int r = 0; r < rows; ++r) {
    acc0[r] = accumulate ? _mm512_loadu_ps(tile0 + r * kPanel) : _mm512_setzero_ps();
    acc1[r] = accumulate ? _mm512_loadu_ps(tile1 + r * kPanel) : _mm512_setzero_ps();
  }
  for (int64_t k = 0; k < k_size; ++k) {
    if (prefetch != nullptr) {
      _mm_prefetch(reinterpret_cast<const char*>(prefetch + k * kPanel), _MM_HINT_T1);
      _mm_prefetch(reinterpret_cast<const char*>(prefetch + (k_size + k) * kPanel), _MM_HINT_T1);
    }
    const __m512 w0 = _mm512_loadu_ps(panel0 + k * kPanel);
    const __m512 w1 = _mm512_loadu_ps(panel1 + k * kPanel);
    for (int r = 0; r < rows; ++r) {
      const __m512 xb = _mm512_set1_ps(x[r * ldx + k]);
      acc0[r] = _mm512_fmadd_ps(xb, w0, acc0[r]);
      acc1[r] = _mm512_fmadd_ps(xb, w1, acc1[r]);
    }
  }
  for (int r = 0; r < rows; ++r) {
    _mm512_storeu_ps(tile0 + r * kPanel, acc0[r]);
    _mm512_storeu_ps(tile1 + r * kPanel, acc1[r]);
  }
}
#define TANDEM_AVX512 1
#endif
#else
template <typename W, int rows>
inline void tile_kernel(const float* x, int64_t ldx, const W* panel, int64_t k_size, float* tile, bool accumulate,
                        const W* /*prefetch*/) {
  float acc[rows][kPanel] = {};
  if (accumulate) std::memcpy(acc, tile, sizeof(acc));
  for (int64_t k = 0; k < k_size; ++k) {
    const W* w = panel + k * kPanel;
    for (int r = 0; r < rows; ++r) {
      const float xv = x[r * ldx + k];
      for (int c = 0; c < kPanel; ++c) acc[r][c] += xv * static_cast<float>(w[c]);
    }
  }
  std::memcpy(tile, acc, sizeof(acc));
}
#endif

// 16-bit weights feeding kWidenOnceRows rows or more widen once per K-slice into this float32
// buffer, which every tile then reads, instead of once per tile: the widening's shuffles compete
// with the FMAs for the vector ports. Below about 30 rows the round trip through the buffer costs
// more than it saves. Where the buffer lives matters, for reasons not pinned down: keep it a
// function-local thread_local in linear_impl; on the stack next to the sums, or as a thread_local
// at namespace scope, it made the tiles slower than reading the weight itself.
constexpr int64_t kWidenOnceRows = 32;

// kc rows of a 16-bit panel widened to float32 into `wide`; for each row widened, the panel row
// at the same offset from `prefetch` is asked for (into L2)
template <typename W>
inline void widen_slice(const W* panel, int64_t kc, float* wide, const W* prefetch) {
  for (int64_t k = 0; k < kc; ++k) {
#ifdef TANDEM_AVX2
    _mm_prefetch(reinterpret_cast<const char*>(prefetch + k * kPanel), _MM_HINT_T1);
    __m256 lo, hi;
    load16(panel + k * kPanel, lo, hi);
    _mm256_store_ps(wide + k * kPanel, lo);
    _mm256_store_ps(wide + k * kPanel + 8, hi);
#else
    (void)prefetch;
    for (int64_t c = 0; c < kPanel; ++c) wide[k * kPanel + c] = static_cast<float>(panel[k * kPanel + c]);
#endif
  }
}

#ifdef TANDEM_AVX512
// f(std::integral_constant<int, n>()) for the tile of n = min(rows, kFloatTile) rows, rows >= 1
template <typename F>
inline void with_float_tile_rows(int64_t rows, const F& f) {
  switch (rows) {
#define TANDEM_CASE(n) case n: return f(std::integral_constant<int, n>());
    TANDEM_CASE(1) TANDEM_CASE(2) TANDEM_CASE(3) TANDEM_CASE(4) TANDEM_CASE(5) TANDEM_CASE(6)
    TANDEM_CASE(7) TANDEM_CASE(8) TANDEM_CASE(9) TANDEM_CASE(10) TANDEM_CASE(11)
#undef TANDEM_CASE
    default: return f(std::integral_constant<int, kFloatTile>());
  }
}
#endif

template <typename W>
void run_tile(int64_t rows, const float* x, int64_t ldx, const W* panel, int64_t k_size, float* tile, bool accumulate,
              const W* prefetch) {
  switch (rows) {
    case 1: return tile_kernel<W, 1>(x, ldx, panel, k_size, tile, accumulate, prefetch);
    case 2: return tile_kernel<W, 2>(x, ldx, panel, k_size, tile, accumulate, prefetch);
    case 3: return tile_kernel<W, 3>(x, ldx, panel, k_size, tile, accumulate, prefetch);
    case 4: return tile_kernel<W, 4>(x, ldx, panel, k_size, tile, accumulate, prefetch);
    case 5: return tile_kernel<W, 5>(x, ldx, panel, k_size, tile, accumulate, prefetch);
    default: return tile_kernel<W, 6>(x, ldx, panel, k_size, tile, accumulate, prefetch);
  }
}

// rows [row0, row_end) of one panel's sums (acc, 16 a row) into out's columns [col0, col0 + cols),
// plus the bias
inline void store_panel(float* op, int64_t ldo, const float* acc, int64_t row0, int64_t row_end, int64_t col0,
                        int64_t cols, const float* bias) {
  for (int64_t r = row0; r < row_end; ++r) {
    float* dst = op + r * ldo + col0;
    const float* src = acc + (r - row0) * kPanel;
    if (bias != nullptr) {
      for (int64_t c = 0; c < cols; ++c) dst[c] = src[c] + bias[col0 + c];
    } else {
      std::memcpy(dst, src, cols * sizeof(float));
    }
  }
}

// the tiles of rows [row0, row_end) over one float32 K-slice of a panel (or a widened one); the
// first asks for `prefetch` (see linear_impl)
inline void float_tiles(int64_t row0, int64_t row_end, const float* x, int64_t ldx, const float* panel, int64_t kc,
                        float* acc, bool accumulate, const float* prefetch) {
#ifdef TANDEM_AVX512
  for (int64_t r0 = row0; r0 < row_end; r0 += kFloatTile) {
    with_float_tile_rows(row_end - r0, [&](auto rows) {
      tile_kernel512<decltype(rows)::value>(x + (r0 - row0) * ldx, ldx, panel, kc, acc + (r0 - row0) * kPanel,
                                            accumulate, r0 == row0 ? prefetch : nullptr);
    });
  }
#else
  for (int64_t r0 = row0; r0 < row_end; r0 += kTile) {
    run_tile<float>(std::min(kTile, row_end - r0), x + (r0 - row0) * ldx, ldx, panel, kc, acc + (r0 - row0) * kPanel,
                    accumulate, r0 == row0 ? prefetch : nullptr);
  }
#endif
}

#ifdef TANDEM_AVX512
// float32 panels two at a time (see tile_kernel512x2), for kPairRows rows or more (fewer rows
// stream the weight from memory, where one panel at a time measured faster); an odd last panel
// alone. The loop nest is linear_impl's; a slice of both panels (2 x kKBlock x 16 floats, 32 KiB)
// no longer fits L1 beside x (shorter slices for pairs are not measured yet).
constexpr int64_t kPairRows = 32;
void linear_float_pairs(at::Tensor& out, const at::Tensor& x, const at::Tensor& panels, const float* bias) {
  const int64_t m_size = x.size(0), k_size = x.size(1), n_size = out.size(1);
  const int64_t n_panels = panels.size(0), ldx = x.stride(0), ldo = out.stride(0);
  const float* xp = x.data_ptr<float>();
  const float* wp = panels.data_ptr<float>();
  float* op = out.data_ptr<float>();
  const int64_t row_blocks = (m_size + kRowBlock - 1) / kRowBlock;
  const int64_t n_pairs = (n_panels + 1) / 2;
  const int64_t total = row_blocks * n_pairs;
  tandem_cpu::for_each_chunk(total, tandem_cpu::chunk_for(total, 4), [&](int64_t begin, int64_t end) {
    alignas(64) float acc[2][kRowBlock * kPanel];
    for (int64_t work = begin; work < end; ++work) {
      const int64_t rb = work / n_pairs, q = work % n_pairs;
      const int64_t p0 = 2 * q, count = std::min<int64_t>(2, n_panels - p0);
      const float* panel0 = wp + p0 * k_size * kPanel;
      const float* panel1 = panel0 + k_size * kPanel;
      const int64_t row0 = rb * kRowBlock, row_end = std::min(m_size, row0 + kRowBlock);
      for (int64_t k0 = 0; k0 < k_size; k0 += kKBlock) {
        const int64_t kc = std::min(kKBlock, k_size - k0);
        const float* xs = xp + row0 * ldx + k0;
        if (count == 1) {
          float_tiles(row0, row_end, xs, ldx, panel0 + k0 * kPanel, kc, acc[0], k0 > 0, nullptr);
          continue;
        }
        const float* ahead = panel0 + (k0 + kPrefetchSlices * kc) * kPanel;
        for (int64_t r0 = row0; r0 < row_end; r0 += kFloatTile) {
          with_float_tile_rows(row_end - r0, [&](auto rows) {
            tile_kernel512x2<decltype(rows)::value>(xs + (r0 - row0) * ldx, ldx, panel0 + k0 * kPanel,
                                                    panel1 + k0 * kPanel, kc, acc[0] + (r0 - row0) * kPanel,
                                                    acc[1] + (r0 - row0) * kPanel, k0 > 0,
                                                    r0 == row0 ? ahead : nullptr);
          });
        }
      }
      for (int64_t i = 0; i < count; ++i) {
        const int64_t col0 = (p0 + i) * kPanel;
        store_panel(op, ldo, acc[i], row0, row_end, col0, std::min(kPanel, n_size - col0), bias);
      }
    }
  });
}
#endif

template <typename W>
void linear_impl(at::Tensor& out, const at::Tensor& x, const at::Tensor& panels, const float* bias) {
  const int64_t m_size = x.size(0), k_size = x.size(1), n_size = out.size(1);
  const int64_t n_panels = panels.size(0), ldx = x.stride(0), ldo = out.stride(0);
  const float* xp = x.data_ptr<float>();
  const W* wp = panels.data_ptr<W>();
  float* op = out.data_ptr<float>();
  const int64_t row_block = kRowBlock;
  const int64_t row_blocks = (m_size + row_block - 1) / row_block;
  // a few panels per chunk: each chunk streams one contiguous run of the weight
  const int64_t total = row_blocks * n_panels;
  tandem_cpu::for_each_chunk(total, tandem_cpu::chunk_for(total, 8), [&](int64_t begin, int64_t end) {
    alignas(64) float acc[kRowBlock * kPanel];  // the row block's sums for one panel
    alignas(64) static thread_local float wide[kKBlock * kPanel];  // see kWidenOnceRows
    for (int64_t work = begin; work < end; ++work) {
      // consecutive work items walk the panels of one row block: each thread streams a
      // contiguous range of the weight
      const int64_t rb = work / n_panels, p = work % n_panels;
      const W* panel = wp + p * k_size * kPanel;
      const int64_t col0 = p * kPanel, cols = std::min(kPanel, n_size - col0);
      const int64_t row0 = rb * row_block, row_end = std::min(m_size, row0 + row_block);
      const bool widen_once = !std::is_same_v<W, float> && row_end - row0 >= kWidenOnceRows;
      // K in slices whose part of the panel (kKBlock x 16) stays in L1 for every tile
      for (int64_t k0 = 0; k0 < k_size; k0 += kKBlock) {
        const int64_t kc = std::min(kKBlock, k_size - k0);
        // the first tile of the slice asks for the weight kPrefetchSlices slices on (the
        // weight is contiguous: further along this panel or into the next ones), into L2, so
        // that its reads overlap this slice's FMAs rather than wait at the next slice's start
        const W* ahead = panel + (k0 + kPrefetchSlices * kc) * kPanel;
        if (widen_once) {
          widen_slice(panel + k0 * kPanel, kc, wide, ahead);
          float_tiles(row0, row_end, xp + row0 * ldx + k0, ldx, wide, kc, acc, k0 > 0, nullptr);
          continue;
        }
        if constexpr (std::is_same_v<W, float>) {
          float_tiles(row0, row_end, xp + row0 * ldx + k0, ldx, panel + k0 * kPanel, kc, acc, k0 > 0, ahead);
          continue;
        }
        for (int64_t r0 = row0; r0 < row_end; r0 += kTile) {
          run_tile<W>(std::min(kTile, row_end - r0), xp + r0 * ldx + k0, ldx, panel + k0 * kPanel, kc,
                      acc + (r0 - row0) * kPanel, k0 > 0, r0 == row0 ? ahead : nullptr);
        }
      }
      store_panel(op, ldo, acc, row0, row_end, col0, cols, bias);
    }
  });
}

}  // namespace

void panel_linear(at::Tensor& out, const at::Tensor& x, const at::Tensor& panels, const c10::optional<at::Tensor>& bias) {
  TORCH_CHECK(x.device().is_cpu() && panels.device().is_cpu() && out.device().is_cpu(), "panel_linear runs on the CPU");
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.stride(1) == 1, "panel_linear: x must be float32 [M, K] with contiguous rows");
  TORCH_CHECK(panels.dim() == 3 && panels.size(1) == x.size(1) && panels.size(2) == kPanel && panels.is_contiguous(),
              "panel_linear: panels must be contiguous [P, K, 16] with K = x.size(1)");
  TORCH_CHECK(out.dim() == 2 && out.size(0) == x.size(0) && out.scalar_type() == at::kFloat && out.stride(1) == 1 &&
                  out.size(1) <= panels.size(0) * kPanel && out.size(1) > (panels.size(0) - 1) * kPanel,
              "panel_linear: out must be float32 [M, N] with N filling the panels");
  const float* bp = nullptr;
  if (bias.has_value() && bias->defined()) {
    TORCH_CHECK(bias->scalar_type() == at::kFloat && bias->is_contiguous() && bias->numel() == out.size(1),
                "panel_linear: bias must be float32 [N]");
    bp = bias->data_ptr<float>();
  }
  if (x.size(0) == 0) return;
  switch (panels.scalar_type()) {
#ifdef TANDEM_AVX512
    case at::kFloat:
      return x.size(0) >= kPairRows ? linear_float_pairs(out, x, panels, bp) : linear_impl<float>(out, x, panels, bp);
#else
    case at::kFloat: return linear_impl<float>(out, x, panels, bp);
#endif
    case at::kBFloat16: return linear_impl<c10::BFloat16>(out, x, panels, bp);
    case at::kHalf: return linear_impl<c10::Half>(out, x, panels, bp);
    default: TORCH_CHECK(false, "panel_linear: unsupported weight dtype ", panels.scalar_type());
  }
}

TORCH_LIBRARY_FRAGMENT(tandem_cpu, m) {
  m.def("panel_linear(Tensor(a!) out, Tensor x, Tensor panels, Tensor? bias) -> ()");
}

TORCH_LIBRARY_IMPL(tandem_cpu, CPU, m) { m.impl("panel_linear", &panel_linear); }
