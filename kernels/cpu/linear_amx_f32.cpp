// float32 linear layers on AMX tiles: y = x @ W.T (+ bias) with float32 x and W, on CPUs with
// AMX-BF16 (which has no float32 tile product).
//
//   x      [M, K] float32, rows contiguous, K a multiple of 32
//   panels [ceil(N / 16), K, 16] float32: tandem's panels (linear.cpp), panel p row k holding
//          W[16p .. 16p + 15, k], columns past N zero
//   out    [M, N] float32, rows contiguous
//
// Each float32 value v is split into three bfloat16 values, v = h + m + l exactly: h = v rounded
// to bfloat16 (8 significant bits), m = (v - h) rounded, l = v - h - m (each difference is exact
// in float32, and the last has at most 8 significant bits). Of the nine products of x's and W's
// parts the kernel sums the six whose parts' orders add up to at most two (h.h, h.m, m.h, h.l,
// m.m, l.h); each of the three left out (m.l, l.m, l.l) is at most about 2^-24 |x| |w|, the size
// of float32's own rounding of a product, and a product of two bfloat16 values is exact in
// float32. The six go into one float32 accumulator tile, the smallest first, so that they are
// added while it is small and h.h last. The result is float32 arithmetic up to the order of the
// sums (the tests hold it to float64 within float32's rounding, and measure it at least as close
// as torch's float32 product). Six TDPBF16PS do the work of 16 x 16 x 32 float32 FMAs: where a
// CPU's tiles run much faster than its FMAs this wins from a few tens of rows on; the tuner
// (cpu_tuning) times it against the float32 kernels and keeps it only where it measured faster.
//
// The weights are split where they are used, so a float32 layer keeps one packing (tandem's) for
// both kernels: a work item (two panels, a chunk of rows) first turns its panels into three
// bfloat16 pair panels (linear_dpbf16.cpp's layout, a B tile per 16 pair rows) in a per-thread
// scratch that stays in L2, then runs its rows' tiles over them. x is split once per call into
// three zero-padded planes. Tiles: 0-3 the accumulators (rows 0-15 and 16-31 by panels 0 and 1),
// 4-5 a part of x for each row group, 6-7 a part of each panel.
#include <ATen/core/Tensor.h>
#include <torch/library.h>

#include "amx_tiles.h"
#include "work_queue.h"

#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <vector>

#if defined(__x86_64__) && defined(__GNUC__) && defined(__linux__) && __GNUC__ >= 11
#include <immintrin.h>
#define TANDEM_AMX_F32 1
#define TANDEM_AMX_TARGET __attribute__((target("amx-tile,amx-bf16,avx512f,avx512bw,avx512vl,avx512bf16")))
#endif

namespace {

constexpr int64_t kPanel = 16;
constexpr int64_t kRows = 16;          // rows of an A or C tile
constexpr int64_t kStep = 32;          // values of K a tile product takes
constexpr int64_t kShareRows = 64;     // up to these rows, each thread streams one range of panels
constexpr int64_t kMaxChunkRows = 512; // more rows go in chunks of at most this many
constexpr int kParts = 3;

struct Problem {
  const float* w;
  float* out;
  const float* bias;
  int64_t m, k, n, n_panels, ldo;
  const uint16_t* xs;  // x's parts: part t, row r at xs + (t * padded_m + r) * k (rows past M zero)
  int64_t padded_m;
};

#ifdef TANDEM_AMX_F32
TANDEM_AMX_TARGET inline __m512 widened(__m512 v) {  // v rounded to bfloat16, as float32
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32((__m256i)_mm512_cvtneps_pbh(v)), 16));
}

// v = h + m + l: the values whose roundings to bfloat16 are the three parts are v, r1 = v - h
// and r2 = r1 - m (each difference exact in float32; r2 is already a bfloat16 value)
TANDEM_AMX_TARGET inline void residues(__m512 v, __m512& r1, __m512& r2) {
  r1 = _mm512_sub_ps(v, widened(v));
  r2 = _mm512_sub_ps(r1, widened(r1));
}

// n values (a multiple of 16) into parts at h, h + stride, h + 2 * stride
TANDEM_AMX_TARGET void split(const float* src, int64_t n, uint16_t* h, int64_t stride) {
  for (int64_t i = 0; i < n; i += 16) {
    const __m512 v = _mm512_loadu_ps(src + i);
    __m512 r1, r2;
    residues(v, r1, r2);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(h + i), (__m256i)_mm512_cvtneps_pbh(v));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(h + stride + i), (__m256i)_mm512_cvtneps_pbh(r1));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(h + 2 * stride + i), (__m256i)_mm512_cvtneps_pbh(r2));
  }
}

// 32 float32 values (two 16-column rows of a panel, K = 2j and 2j + 1) as bfloat16 bits in the
// pair layout: value 2c is column c of the first row, 2c + 1 column c of the second
TANDEM_AMX_TARGET inline __m512i pairs_of(__m512 first, __m512 second) {
  alignas(64) static const uint16_t order[32] = {0, 16, 1, 17, 2, 18, 3, 19, 4,  20, 5,  21, 6,  22, 7,  23,
                                                 8, 24, 9, 25, 10, 26, 11, 27, 12, 28, 13, 29, 14, 30, 15, 31};
  const __m512i both = (__m512i)_mm512_cvtne2ps_pbh(second, first);
  return _mm512_permutexvar_epi16(_mm512_load_si512(order), both);
}

// one panel [K][16] float32 into its three bfloat16 parts in the pair layout (part t at
// parts + t * k * 16, pair row j at + j * 32)
TANDEM_AMX_TARGET void split_panel(const float* panel, int64_t k, uint16_t* parts) {
  const int64_t part = k * kPanel;
  for (int64_t j = 0; j < k / 2; ++j) {
    const __m512 v0 = _mm512_loadu_ps(panel + 2 * j * kPanel), v1 = _mm512_loadu_ps(panel + (2 * j + 1) * kPanel);
    __m512 a1, a2, b1, b2;
    residues(v0, a1, a2);
    residues(v1, b1, b2);
    uint16_t* row = parts + j * 2 * kPanel;
    _mm512_storeu_si512(row, pairs_of(v0, v1));
    _mm512_storeu_si512(row + part, pairs_of(a1, b1));
    _mm512_storeu_si512(row + 2 * part, pairs_of(a2, b2));
  }
}

// a thread's scratch for its panels' parts, kept between calls (64-byte aligned)
uint16_t* scratch(int64_t values) {
  thread_local std::unique_ptr<uint16_t, decltype(&std::free)> buffer{nullptr, &std::free};
  thread_local int64_t size = 0;
  if (size < values) {
    const int64_t bytes = (values * 2 + 63) / 64 * 64;
    buffer.reset(static_cast<uint16_t*>(std::aligned_alloc(64, bytes)));
    TORCH_CHECK(buffer != nullptr, "panel_linear_amx_f32: out of memory for its scratch");
    size = values;
  }
  return buffer.get();
}

// The six products: (x's part, W's part), the smallest first, so that the accumulator holds
// little when they are added and much only when h.h comes last
constexpr int kProducts[6][2] = {{2, 0}, {1, 1}, {0, 2}, {1, 0}, {0, 1}, {0, 0}};

// rows [r, r + 16 or 32) by one or two panels of parts at `parts` (panel q, part t at
// parts + (q * 3 + t) * part_size): sums into acc (row group g, panel q at acc + (2 g + q) * 256)
template <bool two, bool both>
TANDEM_AMX_TARGET void tile_rows(const Problem& p, int64_t r, const uint16_t* parts, int64_t part_size, float* acc) {
  const int64_t stride = p.k * 2, plane = p.padded_m * p.k;
  _tile_zero(0);
  if (two) _tile_zero(1);
  if (both) _tile_zero(2);
  if (two && both) _tile_zero(3);
  for (const auto& product : kProducts) {
    const uint16_t* a0 = p.xs + product[0] * plane + r * p.k;
    const uint16_t* a1 = a0 + kRows * p.k;
    const uint16_t* b0 = parts + product[1] * part_size;
    const uint16_t* b1 = b0 + kParts * part_size;
    for (int64_t ks = 0; ks < p.k / kStep; ++ks) {
      const int64_t col = ks * kStep, at = ks * kStep * kPanel;
      _tile_loadd(6, b0 + at, 64);
      if (two) _tile_loadd(7, b1 + at, 64);
      _tile_loadd(4, a0 + col, stride);
      if (both) _tile_loadd(5, a1 + col, stride);
      _tile_dpbf16ps(0, 4, 6);
      if (two) _tile_dpbf16ps(1, 4, 7);
      if (both) _tile_dpbf16ps(2, 5, 6);
      if (two && both) _tile_dpbf16ps(3, 5, 7);
    }
  }
  _tile_stored(0, acc, 64);
  if (two) _tile_stored(1, acc + kRows * kPanel, 64);
  if (both) _tile_stored(2, acc + 2 * kRows * kPanel, 64);
  if (two && both) _tile_stored(3, acc + 3 * kRows * kPanel, 64);
}

// out rows [r, end) of the panel at col0 from acc (16 floats a row), bias added
TANDEM_AMX_TARGET void store(const Problem& p, const float* acc, int64_t r, int64_t end, int64_t col0) {
  const int64_t cols = std::min(kPanel, p.n - col0);
  const __mmask16 mask = static_cast<__mmask16>((1u << cols) - 1u);
  const __m512 bias = p.bias != nullptr ? _mm512_maskz_loadu_ps(mask, p.bias + col0) : _mm512_setzero_ps();
  for (int64_t i = 0; i < end - r; ++i) {
    const __m512 v = _mm512_add_ps(_mm512_loadu_ps(acc + i * kPanel), bias);
    _mm512_mask_storeu_ps(p.out + (r + i) * p.ldo + col0, mask, v);
  }
}

// work items [begin, end): item = row chunk * groups + group of two panels (the last may have one)
TANDEM_AMX_TARGET void run_items(const Problem& p, int64_t chunk_rows, int64_t begin, int64_t end) {
  const tandem_cpu::TileConfig cfg = tandem_cpu::full_tiles();
  _tile_loadconfig(&cfg);
  const int64_t groups = (p.n_panels + 1) / 2, part_size = p.k * kPanel;  // a part is a panel's size
  uint16_t* parts = scratch(2 * kParts * part_size);
  alignas(64) float acc[4 * kRows * kPanel];
  for (int64_t work = begin; work < end; ++work) {
    const int64_t chunk = work / groups, first = (work % groups) * 2;
    const bool two = first + 1 < p.n_panels;
    for (int64_t q = 0; q < (two ? 2 : 1); ++q)
      split_panel(p.w + (first + q) * part_size, p.k, parts + q * kParts * part_size);
    const int64_t row_end = std::min(p.m, (chunk + 1) * chunk_rows);
    for (int64_t r = chunk * chunk_rows; r < row_end; r += 2 * kRows) {
      const bool both = row_end - r > kRows;
      if (two && both) tile_rows<true, true>(p, r, parts, part_size, acc);
      else if (two) tile_rows<true, false>(p, r, parts, part_size, acc);
      else if (both) tile_rows<false, true>(p, r, parts, part_size, acc);
      else tile_rows<false, false>(p, r, parts, part_size, acc);
      for (int64_t g = 0; g < (both ? 2 : 1); ++g) {
        const int64_t r0 = r + g * kRows, r1 = std::min(row_end, r0 + kRows);
        store(p, acc + 2 * g * kRows * kPanel, r0, r1, first * kPanel);
        if (two) store(p, acc + (2 * g + 1) * kRows * kPanel, r0, r1, (first + 1) * kPanel);
      }
    }
  }
  _tile_release();
}
#endif

}  // namespace

void panel_linear_amx_f32(at::Tensor& out, const at::Tensor& x, const at::Tensor& panels,
                          const c10::optional<at::Tensor>& bias) {
  constexpr const char* name = "panel_linear_amx_f32";
  TORCH_CHECK(amx_supported(), name, ": this CPU (or its kernel) gives no AMX-BF16 instructions");
  TORCH_CHECK(x.device().is_cpu() && panels.device().is_cpu() && out.device().is_cpu(), name, " runs on the CPU");
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.stride(1) == 1 && x.size(1) % kStep == 0, name,
              ": x must be float32 [M, K], K a multiple of 32, with contiguous rows");
  TORCH_CHECK(panels.dim() == 3 && panels.scalar_type() == at::kFloat && panels.size(1) == x.size(1) &&
                  panels.size(2) == kPanel && panels.is_contiguous(),
              name, ": panels must be contiguous float32 [P, K, 16]");
  TORCH_CHECK(out.dim() == 2 && out.size(0) == x.size(0) && out.scalar_type() == at::kFloat && out.stride(1) == 1 &&
                  out.size(1) <= panels.size(0) * kPanel && out.size(1) > (panels.size(0) - 1) * kPanel,
              name, ": out must be float32 [M, N] with N filling the panels");
  const float* bp = nullptr;
  if (bias.has_value() && bias->defined()) {
    TORCH_CHECK(bias->scalar_type() == at::kFloat && bias->is_contiguous() && bias->numel() == out.size(1), name,
                ": bias must be float32 [N]");
    bp = bias->data_ptr<float>();
  }
#ifdef TANDEM_AMX_F32
  const int64_t m = x.size(0), k = x.size(1);
  if (m == 0) return;
  const int64_t padded_m = (m + kRows - 1) / kRows * kRows;
  std::vector<uint16_t> xs(kParts * padded_m * k);
  const float* xp = x.data_ptr<float>();
  if (padded_m > m) std::memset(xs.data(), 0, xs.size() * sizeof(uint16_t));
  tandem_cpu::for_each_chunk(m, std::max<int64_t>(1, 4096 / k), [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) split(xp + r * x.stride(0), k, xs.data() + r * k, padded_m * k);
  });
  const Problem p{panels.data_ptr<float>(), out.data_ptr<float>(), bp, m, k, out.size(1), panels.size(0),
                  out.stride(0), xs.data(), padded_m};
  const int64_t groups = (p.n_panels + 1) / 2;
  if (m <= kShareRows) {
    tandem_cpu::for_each_share(groups, tandem_cpu::chunk_for(groups, 8),
                               [&](int64_t begin, int64_t end) { run_items(p, kShareRows, begin, end); });
    return;
  }
  // x's parts for a chunk of rows stay in L2 (about 1 MiB) while the chunk's panels go by
  const int64_t chunk_rows = std::clamp<int64_t>((1 << 20) / (k * kParts * 2) / 32 * 32, 32, kMaxChunkRows);
  const int64_t total = (m + chunk_rows - 1) / chunk_rows * groups;
  tandem_cpu::for_each_chunk(total, tandem_cpu::chunk_for(total, 8),
                             [&](int64_t begin, int64_t end) { run_items(p, chunk_rows, begin, end); });
#endif
}

TORCH_LIBRARY_FRAGMENT(tandem_cpu, m) {
  m.def("panel_linear_amx_f32(Tensor(a!) out, Tensor x, Tensor panels, Tensor? bias) -> ()");
}

TORCH_LIBRARY_IMPL(tandem_cpu, CPU, m) { m.impl("panel_linear_amx_f32", &panel_linear_amx_f32); }
