// bfloat16 linear layers on CPUs with AVX512-BF16: y = x @ W.T (+ bias) by vdpbf16ps, which
// multiplies pairs of bfloat16 values and adds both products to a float32 sum, 32 products an
// instruction (the float32 FMAs of linear.cpp do 8 a 256-bit instruction).
//
//   x      [M, K] bfloat16, rows contiguous, K even
//   panels [ceil(N / 16), K / 2, 16, 2] bfloat16: panel p, pair row j holds, for each of its 16
//          columns c, W[16p + c, 2j] and W[16p + c, 2j + 1] side by side (columns past N zero),
//          so one 64-byte load gives the 16 columns' next two weights
//   out    [M, N] float32, or bfloat16 (each sum rounded to nearest even as torch's conversion
//          rounds it, bias added first: the values of a float32 out converted, without its pass);
//          a float32 out with bf16_values holds those rounded values widened back (a bfloat16
//          model's logits as `.to(bfloat16).float()` gives them, without either pass)
//
// Products of two bfloat16 values are exact in float32, so the result equals float32 arithmetic
// on the same values up to the order of the sums. The loop nest is linear.cpp's (row blocks,
// K-slices of up to 2048 values, tiles of up to kTile rows accumulating in registers, panels shared
// out from a counter; with one row block, a decode step's, each thread takes a contiguous share
// of the panels, so that it streams one range of the weight and asks for the next panel's pairs
// while it computes this one's). The AVX512-BF16 code is compiled for that ISA alone (a target attribute),
// whatever the rest of the library targets, and runs only where the CPU reports it
// (dpbf16_supported): on other CPUs it is built but never called.
//
// panel_linear_amx multiplies the same panels on AMX tiles (TDPBF16PS: a 16 x 32 bfloat16 tile
// of x times a 32 x 16 tile of W into 16 x 16 float32 sums, 16K products an instruction). An AMX
// B tile is 16 rows of 64 bytes, row i holding the 16 columns' weights 2i and 2i + 1 side by
// side: 16 consecutive pair rows of a panel, so the panels are B tiles as they lie (K a multiple
// of 32). Two panels and 32 rows at a time: C tiles 0-3 (rows 0-15 and 16-31 by panel 0 and 1),
// A tiles 4-5, B tiles 6-7. Rows past M in a last partial block of 16 come from a zero-padded
// copy, so a tile never reads past x. It needs Linux's permission for the tile state
// (arch_prctl ARCH_REQ_XCOMP_PERM), asked once; amx_supported() is false where the CPU lacks the
// instructions or the kernel refuses.
#include <ATen/core/Tensor.h>
#include <c10/util/BFloat16.h>
#include <torch/library.h>

#include "amx_tiles.h"
#include "work_queue.h"

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <type_traits>

#if defined(__x86_64__) && defined(__GNUC__)
#include <immintrin.h>

#include "bf16_round.h"
#include "vec_exp.h"
#define TANDEM_DPBF16 1
#define TANDEM_DPBF16_TARGET __attribute__((target("avx512f,avx512bw,avx512vl,avx512bf16")))
#if defined(__linux__) && __GNUC__ >= 11
#include <cpuid.h>
#include <sys/syscall.h>
#include <unistd.h>
#include <vector>
#define TANDEM_AMX 1
#define TANDEM_AMX_TARGET __attribute__((target("amx-tile,amx-bf16,avx512f,avx512bw,avx512vl,avx512bf16")))
#endif
#endif

namespace {

constexpr int64_t kPanel = 16;
constexpr int64_t kTile = 8;
constexpr int64_t kRowBlock = 96;
// Pair rows of a panel per K-slice (64 KiB of it): the whole of K up to 2048. Slices of 128 pairs
// (8 KiB, to stay in L1) measured slower on Zen 4 at every shape and row count tried
// (docs/benchmarks.md): each slice adds a round of the tile's sums through memory.
constexpr int64_t kPairBlock = 1024;
constexpr int64_t kPrefetchSlices = 2;
constexpr int64_t kWideRows = 64;

struct Problem {
  const uint16_t* x;
  const uint16_t* w;
  float* out;           // float32 out, or
  c10::BFloat16* out16;  // bfloat16 out
  const float* bias;
  bool bf16_values;      // float32 out rounded to bfloat16 values
  int64_t m, pairs, n, n_panels, ldx, ldo;
  // panel_linear_amx_silu: W = [gate; up], out = SiLU(x gate^T) * (x up^T) [M, N / 2]; up's
  // panels start up_panels panels on (0: a plain product)
  int64_t up_panels = 0;
};

#ifdef TANDEM_DPBF16
// rows x 16 outputs of one panel over `pairs` pair rows: tile[r * 16 + c] (+)= sum_j x-pair . w-pair.
// A sum waits for the previous vdpbf16ps into it (several cycles): with fewer than eight rows the
// pair rows go round-robin into `chains` sums per row, added up at the end, so that enough
// independent instructions are in flight (eight or more sums).
template <int rows>
TANDEM_DPBF16_TARGET inline void tile_kernel(const uint16_t* x, int64_t ldx, const uint16_t* panel, int64_t pairs,
                                             float* tile, bool accumulate, const uint16_t* prefetch) {
  constexpr int chains = rows >= 8 ? 1 : (rows >= 4 ? 2 : 4);
  __m512 acc[chains][rows];
  for (int r = 0; r < rows; ++r) {
    acc[0][r] = accumulate ? _mm512_loadu_ps(tile + r * kPanel) : _mm512_setzero_ps();
    for (int c = 1; c < chains; ++c) acc[c][r] = _mm512_setzero_ps();
  }
  int64_t j = 0;
  for (; j + chains <= pairs; j += chains) {
    for (int c = 0; c < chains && prefetch != nullptr; ++c)
      _mm_prefetch(reinterpret_cast<const char*>(prefetch + (j + c) * 2 * kPanel), _MM_HINT_T1);
    for (int c = 0; c < chains; ++c) {
      const __m512i w = _mm512_loadu_si512(panel + (j + c) * 2 * kPanel);
      for (int r = 0; r < rows; ++r) {
        int32_t pair;
        std::memcpy(&pair, x + r * ldx + 2 * (j + c), sizeof(pair));
        acc[c][r] = _mm512_dpbf16_ps(acc[c][r], (__m512bh)_mm512_set1_epi32(pair), (__m512bh)w);
      }
    }
  }
  for (; j < pairs; ++j) {
    const __m512i w = _mm512_loadu_si512(panel + j * 2 * kPanel);
    for (int r = 0; r < rows; ++r) {
      int32_t pair;
      std::memcpy(&pair, x + r * ldx + 2 * j, sizeof(pair));
      acc[0][r] = _mm512_dpbf16_ps(acc[0][r], (__m512bh)_mm512_set1_epi32(pair), (__m512bh)w);
    }
  }
  for (int r = 0; r < rows; ++r) {
    __m512 sum = acc[0][r];
    for (int c = 1; c < chains; ++c) sum = _mm512_add_ps(sum, acc[c][r]);
    _mm512_storeu_ps(tile + r * kPanel, sum);
  }
}

TANDEM_DPBF16_TARGET void run_tile(int64_t rows, const uint16_t* x, int64_t ldx, const uint16_t* panel, int64_t pairs,
                                   float* tile, bool accumulate, const uint16_t* prefetch) {
  switch (rows) {
    case 1: return tile_kernel<1>(x, ldx, panel, pairs, tile, accumulate, prefetch);
    case 2: return tile_kernel<2>(x, ldx, panel, pairs, tile, accumulate, prefetch);
    case 3: return tile_kernel<3>(x, ldx, panel, pairs, tile, accumulate, prefetch);
    case 4: return tile_kernel<4>(x, ldx, panel, pairs, tile, accumulate, prefetch);
    case 5: return tile_kernel<5>(x, ldx, panel, pairs, tile, accumulate, prefetch);
    case 6: return tile_kernel<6>(x, ldx, panel, pairs, tile, accumulate, prefetch);
    case 7: return tile_kernel<7>(x, ldx, panel, pairs, tile, accumulate, prefetch);
    default: return tile_kernel<8>(x, ldx, panel, pairs, tile, accumulate, prefetch);
  }
}

// rows [row0, row_end) of one panel's output from acc (row r at acc + (r - row0) * 16), bias added
inline void store_rows(const Problem& p, const float* acc, int64_t row0, int64_t row_end, int64_t col0, int64_t cols) {
  for (int64_t r = row0; r < row_end; ++r) {
    const float* src = acc + (r - row0) * kPanel;
    if (p.out16 != nullptr) {
      c10::BFloat16* dst = p.out16 + r * p.ldo + col0;
      for (int64_t c = 0; c < cols; ++c) dst[c] = c10::BFloat16(p.bias != nullptr ? src[c] + p.bias[col0 + c] : src[c]);
      continue;
    }
    float* dst = p.out + r * p.ldo + col0;
    if (p.bf16_values) {
      for (int64_t c = 0; c < cols; ++c)
        dst[c] = static_cast<float>(c10::BFloat16(p.bias != nullptr ? src[c] + p.bias[col0 + c] : src[c]));
    } else if (p.bias != nullptr) {
      for (int64_t c = 0; c < cols; ++c) dst[c] = src[c] + p.bias[col0 + c];
    } else {
      std::memcpy(dst, src, cols * sizeof(float));
    }
  }
}

using tandem_cpu::round_to_bf16;  // bf16_round.h
using tandem_cpu::rounded_bf16;

#ifdef TANDEM_DPBF16
// rows [row0, row_end) of one gate panel's SiLU(gate) * up into the bfloat16 out (columns col0..,
// a full panel) from the gate and up panels' sums (row r at g / u + (r - row0) * 16): gate and up
// rounded to bfloat16, then silu_and_mul's roundings (vec_exp.h)
TANDEM_DPBF16_TARGET void store_silu_rows(const Problem& p, const float* g, const float* u, int64_t row0,
                                          int64_t row_end, int64_t col0) {
  for (int64_t r = row0; r < row_end; ++r) {
    const int64_t i = (r - row0) * kPanel;
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(p.out16 + r * p.ldo + col0),
                        tandem_cpu::silu_mul_bf16(rounded_bf16(_mm512_loadu_ps(g + i)),
                                                  rounded_bf16(_mm512_loadu_ps(u + i))));
  }
}
#endif

// store_rows for a row block of at least kWideRows rows (a prefill's): 16 lanes at a time, the
// columns past N masked off. Fewer rows (a decode step's) keep the scalar loop, which measured
// faster there on Zen 4 (batch 1 and 16 steps slower with this one).
TANDEM_DPBF16_TARGET void store_rows_wide(const Problem& p, const float* acc, int64_t row0, int64_t row_end,
                                          int64_t col0, int64_t cols) {
  const __mmask16 mask = static_cast<__mmask16>((1u << cols) - 1u);
  const __m512 bias = p.bias != nullptr ? _mm512_maskz_loadu_ps(mask, p.bias + col0) : _mm512_setzero_ps();
  for (int64_t r = row0; r < row_end; ++r) {
    __m512 v = _mm512_loadu_ps(acc + (r - row0) * kPanel);
    if (p.bias != nullptr) v = _mm512_add_ps(v, bias);
    if (p.out16 != nullptr) {
      _mm256_mask_storeu_epi16(p.out16 + r * p.ldo + col0, mask, round_to_bf16(v));
      continue;
    }
    if (p.bf16_values)  // the rounded bits back in the high half of a float32
      v = rounded_bf16(v);
    _mm512_mask_storeu_ps(p.out + r * p.ldo + col0, mask, v);
  }
}

// store_rows_wide for two neighbouring full panels into a bfloat16 out: a row's 32 values leave
// as one 64-byte store. Two 32-byte stores into one line, made a whole tile of rows apart, cost
// the line twice in a prefill's output, which does not stay in cache (docs/benchmarks.md).
TANDEM_DPBF16_TARGET void store_pair_wide(const Problem& p, const float* acc0, const float* acc1, int64_t row0,
                                          int64_t row_end, int64_t col0) {
  const __m512 bias0 = p.bias != nullptr ? _mm512_loadu_ps(p.bias + col0) : _mm512_setzero_ps();
  const __m512 bias1 = p.bias != nullptr ? _mm512_loadu_ps(p.bias + col0 + kPanel) : _mm512_setzero_ps();
  for (int64_t r = row0; r < row_end; ++r) {
    const __m512 v0 = _mm512_add_ps(_mm512_loadu_ps(acc0 + (r - row0) * kPanel), bias0);
    const __m512 v1 = _mm512_add_ps(_mm512_loadu_ps(acc1 + (r - row0) * kPanel), bias1);
    _mm512_storeu_si512(p.out16 + r * p.ldo + col0,
                        _mm512_inserti64x4(_mm512_castsi256_si512(round_to_bf16(v0)), round_to_bf16(v1), 1));
  }
}

// work items [begin, end): item = row block * n_panels + panel (a thread walks consecutive panels
// of one row block, streaming a contiguous range of the weight)
// With up_panels (panel_linear_dpbf16_silu): item = row block * up_panels + gate panel, whose up
// panel's sums follow into acc_up, then SiLU(gate) * up is stored.
TANDEM_DPBF16_TARGET void run_items(const Problem& p, int64_t begin, int64_t end) {
  alignas(64) float acc[kRowBlock * kPanel];
  alignas(64) float acc_up[kRowBlock * kPanel];
  const int64_t per_block = p.up_panels > 0 ? p.up_panels : p.n_panels;
  // rows [row0, row_end) of panel panel_index over the whole of K into sums
  const auto panel_sums = [&](int64_t panel_index, int64_t row0, int64_t row_end, float* sums) {
    const uint16_t* panel = p.w + panel_index * p.pairs * 2 * kPanel;
    for (int64_t j0 = 0; j0 < p.pairs; j0 += kPairBlock) {
      const int64_t jc = std::min(kPairBlock, p.pairs - j0);
      const uint16_t* ahead = panel + (j0 + kPrefetchSlices * jc) * 2 * kPanel;
      for (int64_t r0 = row0; r0 < row_end; r0 += kTile) {
        run_tile(std::min(kTile, row_end - r0), p.x + r0 * p.ldx + 2 * j0, p.ldx, panel + j0 * 2 * kPanel, jc,
                 sums + (r0 - row0) * kPanel, j0 > 0, r0 == row0 ? ahead : nullptr);
      }
    }
  };
  for (int64_t work = begin; work < end; ++work) {
    const int64_t rb = work / per_block, panel_index = work % per_block;
    const int64_t col0 = panel_index * kPanel, cols = std::min(kPanel, p.n - col0);
    const int64_t row0 = rb * kRowBlock, row_end = std::min(p.m, row0 + kRowBlock);
    panel_sums(panel_index, row0, row_end, acc);
    if (p.up_panels > 0) {
      panel_sums(panel_index + p.up_panels, row0, row_end, acc_up);
      store_silu_rows(p, acc, acc_up, row0, row_end, col0);
      continue;
    }
    if (row_end - row0 >= kWideRows)
      store_rows_wide(p, acc, row0, row_end, col0, cols);
    else
      store_rows(p, acc, row0, row_end, col0, cols);
  }
}

// M <= kTile (a decode step's few rows): one tile over the whole of K per panel. The weight is
// read once, in order, and each thread's share of the panels is one contiguous range
// (for_each_share): the hardware prefetchers follow it on their own at one to three rows, while
// from kPrefetchRows rows on each panel row asks for the next panel's, which measured faster
// there and slower at two rows (docs/benchmarks.md).
constexpr int64_t kPrefetchRows = 4;
// With up_panels: [begin, end) are gate panels, each followed by its up panel (which its rows
// ask for), then SiLU(gate) * up is stored.
TANDEM_DPBF16_TARGET void run_few_rows(const Problem& p, int64_t begin, int64_t end) {
  alignas(64) float acc[kTile * kPanel], acc_up[kTile * kPanel];
  const int64_t panel_size = p.pairs * 2 * kPanel;
  const bool ahead = p.m >= kPrefetchRows;
  for (int64_t panel_index = begin; panel_index < end; ++panel_index) {
    const uint16_t* panel = p.w + panel_index * panel_size;
    const int64_t col0 = panel_index * kPanel, cols = std::min(kPanel, p.n - col0);
    if (p.up_panels > 0) {
      const uint16_t* up = panel + p.up_panels * panel_size;
      run_tile(p.m, p.x, p.ldx, panel, p.pairs, acc, false, ahead ? up : nullptr);
      run_tile(p.m, p.x, p.ldx, up, p.pairs, acc_up, false, ahead ? panel + panel_size : nullptr);
      store_silu_rows(p, acc, acc_up, 0, p.m, col0);
      continue;
    }
    run_tile(p.m, p.x, p.ldx, panel, p.pairs, acc, false, ahead ? panel + panel_size : nullptr);
    store_rows(p, acc, 0, p.m, col0, cols);
  }
}
#endif

#ifdef TANDEM_AMX
constexpr int64_t kAmxRows = 16;        // rows of an A or C tile
constexpr int64_t kAmxPairs = 16;       // pair rows of a B tile (32 values of K)
constexpr int64_t kAmxShareRows = 64;   // up to these rows, each thread streams one range of panels
constexpr int64_t kAmxChunkRows = 128;  // more rows go in chunks of this many (x's chunk stays in L2)

using tandem_cpu::TileConfig;
using tandem_cpu::full_tiles;

// x's rows for the AMX tiles: rows [0, full) straight from x, the rest (fewer than 16) from a
// zero-padded copy
struct AmxRows {
  const Problem& p;
  int64_t full;
  const uint16_t* tail;  // 16 rows of K values, row i = x row full + i (zeros past M)
  const uint16_t* at(int64_t row, int64_t& stride_bytes) const {
    if (row < full) return stride_bytes = p.ldx * 2, p.x + row * p.ldx;
    return stride_bytes = p.pairs * 4, tail + (row - full) * p.pairs * 2;
  }
};

// rows [r, r + 16 or 32) by panel `panel` (and the next with two): sums into acc0 (and acc1),
// 16 floats a row; `ahead`, when given, is asked for as the K loop reads the panels
template <bool two, bool both, typename Step = std::nullptr_t>
TANDEM_AMX_TARGET void amx_block(const AmxRows& xs, int64_t r, const uint16_t* panel, int64_t panel_size,
                                 const uint16_t* ahead, float* acc0, float* acc1, Step* step_done = nullptr) {
  int64_t s0 = 0, s1 = 0;
  const uint16_t* a0 = xs.at(r, s0);
  const uint16_t* a1 = both ? xs.at(r + kAmxRows, s1) : nullptr;
  _tile_zero(0);
  if (two) _tile_zero(1);
  if (both) _tile_zero(2);
  if (two && both) _tile_zero(3);
  const int64_t steps = xs.p.pairs / kAmxPairs, step = kAmxPairs * 2 * kPanel;
  for (int64_t ks = 0; ks < steps; ++ks) {
    if (ahead != nullptr) {
      for (int line = 0; line < 16; ++line) {
        _mm_prefetch(reinterpret_cast<const char*>(ahead + ks * step + line * 32), _MM_HINT_T1);
        if (two) _mm_prefetch(reinterpret_cast<const char*>(ahead + panel_size + ks * step + line * 32), _MM_HINT_T1);
      }
    }
    _tile_loadd(6, panel + ks * step, 64);
    if (two) _tile_loadd(7, panel + panel_size + ks * step, 64);
    _tile_loadd(4, a0 + ks * 2 * kAmxPairs, s0);
    if (both) _tile_loadd(5, a1 + ks * 2 * kAmxPairs, s1);
    _tile_dpbf16ps(0, 4, 6);
    if (two) _tile_dpbf16ps(1, 4, 7);
    if (both) _tile_dpbf16ps(2, 5, 6);
    if (two && both) _tile_dpbf16ps(3, 5, 7);
    if constexpr (!std::is_same_v<Step, std::nullptr_t>) step_done->step();
  }
  _tile_stored(0, acc0, 64);
  if (two) _tile_stored(1, acc1, 64);
  if (both) _tile_stored(2, acc0 + kAmxRows * kPanel, 64);
  if (two && both) _tile_stored(3, acc1 + kAmxRows * kPanel, 64);
}

// A block of rows whose outputs are still to be written from its sums (`Write::write(begin,
// end)` writes rows [begin, end) of it), written a few rows per K step while the tiles multiply
// the next block: the AMX unit and the vector units are separate, so the rounding, stores and
// SiLU run in the time the tiles take instead of after them. `pace` spreads what is left over
// the next block's K steps; `upto(rows)` finishes it.
template <typename Write>
struct PendingRows {
  int64_t rows = 0, done = 0, per_step = 1;

  void pace(int64_t steps) { per_step = std::max<int64_t>(1, (rows - done + steps - 1) / steps); }
  TANDEM_AMX_TARGET inline void upto(int64_t end) {
    end = std::min(end, rows);
    if (done < end) static_cast<Write*>(this)->write(done, end);
    done = std::max(done, end);
  }
  TANDEM_AMX_TARGET inline void step() { upto(done + per_step); }
};

// rows [r, r + rows) of panels first, first + 1 (with two) from their sums in (acc0, acc1): bias,
// rounding and stores as store_pair_wide / store_rows_wide (16 lanes a row at any row count:
// store_rows' scalar loop is for dpbf16's few rows)
struct PendingStore : PendingRows<PendingStore> {
  const Problem* p = nullptr;
  const float *acc0 = nullptr, *acc1 = nullptr;
  int64_t r = 0, first = 0;
  bool two = false;

  TANDEM_AMX_TARGET inline void write(int64_t begin, int64_t end) {
    const int64_t off = begin * kPanel;
    if (two && p->out16 != nullptr && (first + 2) * kPanel <= p->n) {
      store_pair_wide(*p, acc0 + off, acc1 + off, r + begin, r + end, first * kPanel);
      return;
    }
    for (int64_t q = 0; q < (two ? 2 : 1); ++q) {
      const int64_t col0 = (first + q) * kPanel;
      store_rows_wide(*p, (q == 0 ? acc0 : acc1) + off, r + begin, r + end, col0, std::min(kPanel, p->n - col0));
    }
  }
};

// work items [begin, end): item = row chunk * groups + group of two panels (the last group may
// have one); `chunk_rows` rows a chunk. The sums of consecutive blocks alternate between two
// pairs of buffers, and a block's stores run while the next one multiplies (PendingRows).
TANDEM_AMX_TARGET void amx_items(const AmxRows& xs, int64_t chunk_rows, int64_t begin, int64_t end) {
  const Problem& p = xs.p;
  const TileConfig cfg = full_tiles();
  _tile_loadconfig(&cfg);
  constexpr int64_t kBuf = 2 * kAmxRows * kPanel;
  alignas(64) float bufs[2][2][kBuf];
  const int64_t groups = (p.n_panels + 1) / 2, panel_size = p.pairs * 2 * kPanel;
  const int64_t steps = p.pairs / kAmxPairs;  // K steps of one block
  PendingStore pending;
  pending.p = &p;
  int parity = 0;
  for (int64_t work = begin; work < end; ++work) {
    const int64_t chunk = work / groups, first = (work % groups) * 2;
    const bool two = first + 1 < p.n_panels;
    const uint16_t* panel = p.w + first * panel_size;
    // the next group's weights while this one's first rows read these (a thread's items are
    // consecutive groups)
    const uint16_t* ahead = work + 1 < end && first + 2 < p.n_panels ? panel + 2 * panel_size : nullptr;
    const int64_t row_end = std::min(p.m, (chunk + 1) * chunk_rows);
    for (int64_t r = chunk * chunk_rows; r < row_end; r += 2 * kAmxRows) {
      const bool both = row_end - r > kAmxRows;
      const uint16_t* pf = r == chunk * chunk_rows ? ahead : nullptr;
      float* acc0 = bufs[parity][0];
      float* acc1 = bufs[parity][1];
      const int64_t rows_end = std::min(row_end, r + 2 * kAmxRows);
      pending.pace(steps);
      if (two && both) amx_block<true, true>(xs, r, panel, panel_size, pf, acc0, acc1, &pending);
      else if (two) amx_block<true, false>(xs, r, panel, panel_size, pf, acc0, acc1, &pending);
      else if (both) amx_block<false, true>(xs, r, panel, panel_size, pf, acc0, acc1, &pending);
      else amx_block<false, false>(xs, r, panel, panel_size, pf, acc0, acc1, &pending);
      pending.upto(pending.rows);  // whatever the steps left
      pending.acc0 = acc0, pending.acc1 = acc1, pending.r = r, pending.first = first, pending.two = two;
      pending.rows = rows_end - r, pending.done = 0;
      parity ^= 1;
    }
  }
  pending.upto(pending.rows);
  _tile_release();
}

// SiLU(gate) * up of 16 columns from their float32 sums, as silu_and_mul computes it after a
// bfloat16 gate_up product (elementwise.cpp): gate and up rounded to bfloat16 first
TANDEM_AMX_TARGET inline __m256i silu_mul16(const float* gate, const float* up) {
  return tandem_cpu::silu_mul_bf16(rounded_bf16(_mm512_loadu_ps(gate)), rounded_bf16(_mm512_loadu_ps(up)));
}

// rows [0, rows) of a block's SiLU(gate) * up from its gate sums (g0, g1) and up sums (u0, u1),
// into dst (the block's first row at the group's first column), a row's 32 outputs as one store
struct PendingSilu : PendingRows<PendingSilu> {
  const float *g0 = nullptr, *g1 = nullptr, *u0 = nullptr, *u1 = nullptr;
  c10::BFloat16* dst = nullptr;
  int64_t ldo = 0;
  bool two = false;

  TANDEM_AMX_TARGET inline void write(int64_t begin, int64_t end) {
    for (int64_t row = begin; row < end; ++row) {
      const int64_t i = row * kPanel;
      c10::BFloat16* out = dst + row * ldo;
      const __m256i lo = silu_mul16(g0 + i, u0 + i);
      if (two)
        _mm512_storeu_si512(out, _mm512_inserti64x4(_mm512_castsi256_si512(lo),
                                                    silu_mul16(g1 + i, u1 + i), 1));
      else
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(out), lo);
    }
  }
};

// amx_block for gate's panels (into g0, g1) and then up's (into u0, u1), the same rows, with
// `pending`'s rows written as the K loops go
template <bool two, bool both>
TANDEM_AMX_TARGET void gate_up_blocks(const AmxRows& xs, int64_t r, const uint16_t* gate, const uint16_t* up,
                                      int64_t panel_size, bool lead, float* g0, float* g1, float* u0, float* u1,
                                      PendingSilu* pending) {
  amx_block<two, both>(xs, r, gate, panel_size, lead ? gate + 2 * panel_size : nullptr, g0, g1, pending);
  amx_block<two, both>(xs, r, up, panel_size, lead ? up + 2 * panel_size : nullptr, u0, u1, pending);
}

// panel_linear_amx_silu's work items [begin, end): item = row chunk * groups + group, group j
// the gate panels 2j and 2j + 1 (the last may have one) and the same two up panels, multiplied
// as two panel pairs; a row's 32 outputs leave as one 64-byte store (store_pair_wide's reason).
// The sums of consecutive blocks alternate between two sets of buffers: a block's SiLU is
// written while the next block multiplies (PendingRows), the last one's at the end.
TANDEM_AMX_TARGET void amx_silu_items(const AmxRows& xs, int64_t chunk_rows, int64_t begin, int64_t end) {
  const Problem& p = xs.p;
  const TileConfig cfg = full_tiles();
  _tile_loadconfig(&cfg);
  constexpr int64_t kBuf = 2 * kAmxRows * kPanel;
  alignas(64) float bufs[2][4][kBuf];
  const int64_t half = p.up_panels, groups = (half + 1) / 2, panel_size = p.pairs * 2 * kPanel;
  const int64_t steps = 2 * (p.pairs / kAmxPairs);  // K steps of one block (gate's and up's)
  PendingSilu pending;
  int parity = 0;
  for (int64_t work = begin; work < end; ++work) {
    const int64_t chunk = work / groups, first = (work % groups) * 2;
    const bool two = first + 1 < half;
    const uint16_t* gate = p.w + first * panel_size;
    const uint16_t* up = gate + half * panel_size;
    const bool next = work + 1 < end && first + 2 < half;
    const int64_t row_end = std::min(p.m, (chunk + 1) * chunk_rows);
    for (int64_t r = chunk * chunk_rows; r < row_end; r += 2 * kAmxRows) {
      // the next group's weights asked for while this group's first rows read these
      const bool both = row_end - r > kAmxRows, lead = r == chunk * chunk_rows && next;
      float* g0 = bufs[parity][0];
      float* g1 = bufs[parity][1];
      float* u0 = bufs[parity][2];
      float* u1 = bufs[parity][3];
      pending.pace(steps);
      if (two && both) gate_up_blocks<true, true>(xs, r, gate, up, panel_size, lead, g0, g1, u0, u1, &pending);
      else if (two) gate_up_blocks<true, false>(xs, r, gate, up, panel_size, lead, g0, g1, u0, u1, &pending);
      else if (both) gate_up_blocks<false, true>(xs, r, gate, up, panel_size, lead, g0, g1, u0, u1, &pending);
      else gate_up_blocks<false, false>(xs, r, gate, up, panel_size, lead, g0, g1, u0, u1, &pending);
      pending.upto(pending.rows);  // whatever the steps left
      pending.g0 = g0, pending.g1 = g1, pending.u0 = u0, pending.u1 = u1, pending.two = two;
      pending.dst = p.out16 + r * p.ldo + first * kPanel, pending.ldo = p.ldo;
      pending.rows = std::min(row_end, r + 2 * kAmxRows) - r, pending.done = 0;
      parity ^= 1;
    }
  }
  pending.upto(pending.rows);
  _tile_release();
}
#endif

bool cpu_has_dpbf16() {
#ifdef TANDEM_DPBF16
  static const bool supported = __builtin_cpu_supports("avx512bf16") && __builtin_cpu_supports("avx512bw") &&
                                __builtin_cpu_supports("avx512vl");
  return supported;
#else
  return false;
#endif
}

// AMX-TILE and AMX-BF16 (CPUID leaf 7: EDX bits 24 and 22), and Linux's leave to use the tile
// data state (asked once for the process; kernels before 5.16 or without AMX support refuse)
bool cpu_has_amx() {
#ifdef TANDEM_AMX
  static const bool supported = [] {
    unsigned a = 0, b = 0, c = 0, d = 0;
    if (!cpu_has_dpbf16() || !__get_cpuid_count(7, 0, &a, &b, &c, &d)) return false;
    if (!(d & (1u << 24)) || !(d & (1u << 22))) return false;
    constexpr long kArchReqXcompPerm = 0x1023, kXfeatureXtiledata = 18;
    return syscall(SYS_arch_prctl, kArchReqXcompPerm, kXfeatureXtiledata) == 0;
  }();
  return supported;
#else
  return false;
#endif
}

}  // namespace

bool dpbf16_supported() { return cpu_has_dpbf16(); }

bool amx_supported() { return cpu_has_amx(); }

namespace {

// The arguments' checks (both kernels take the same), and the problem they describe.
// `pairs_out`: out holds half the columns the panels make (panel_linear_amx_silu's [M, N / 2]).
Problem checked_problem(const char* name, at::Tensor& out, const at::Tensor& x, const at::Tensor& panels,
                        const c10::optional<at::Tensor>& bias, bool bf16_values, bool pairs_out = false) {
  TORCH_CHECK(x.device().is_cpu() && panels.device().is_cpu() && out.device().is_cpu(), name, " runs on the CPU");
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kBFloat16 && x.stride(1) == 1 && x.size(1) % 2 == 0 &&
                  x.stride(0) % 2 == 0,
              name, ": x must be bfloat16 [M, K], K even, with contiguous rows at even strides");
  TORCH_CHECK(panels.dim() == 4 && panels.scalar_type() == at::kBFloat16 && panels.size(1) * 2 == x.size(1) &&
                  panels.size(2) == kPanel && panels.size(3) == 2 && panels.is_contiguous(),
              name, ": panels must be contiguous bfloat16 [P, K / 2, 16, 2]");
  const bool out16 = out.scalar_type() == at::kBFloat16;
  const int64_t n = out.size(1) * (pairs_out ? 2 : 1);
  TORCH_CHECK(out.dim() == 2 && out.size(0) == x.size(0) && (out16 || out.scalar_type() == at::kFloat) &&
                  out.stride(1) == 1 && n <= panels.size(0) * kPanel && n > (panels.size(0) - 1) * kPanel,
              name, ": out must be float32 or bfloat16 [M, N] with N filling the panels");
  TORCH_CHECK(!(bf16_values && out16), name, ": bf16_values is for a float32 out");
  const float* bp = nullptr;
  if (bias.has_value() && bias->defined()) {
    TORCH_CHECK(bias->scalar_type() == at::kFloat && bias->is_contiguous() && bias->numel() == out.size(1),
                name, ": bias must be float32 [N]");
    bp = bias->data_ptr<float>();
  }
  return Problem{reinterpret_cast<const uint16_t*>(x.data_ptr<c10::BFloat16>()),
                 reinterpret_cast<const uint16_t*>(panels.data_ptr<c10::BFloat16>()),
                 out16 ? nullptr : out.data_ptr<float>(), out16 ? out.data_ptr<c10::BFloat16>() : nullptr, bp, bf16_values,
                 x.size(0), panels.size(1), n, panels.size(0),
                 x.stride(0), out.stride(0)};
}

// panel_linear_dpbf16 and panel_linear_dpbf16_silu on a checked problem
void run_dpbf16(const Problem& p) {
  if (p.m == 0) return;
#ifdef TANDEM_DPBF16
  const int64_t per_block = p.up_panels > 0 ? p.up_panels : p.n_panels;  // work items a row block
  if (p.m <= kTile) {
    tandem_cpu::for_each_share(per_block, tandem_cpu::chunk_for(per_block, 8),
                               [&](int64_t begin, int64_t end) { run_few_rows(p, begin, end); });
    return;
  }
  const int64_t row_blocks = (p.m + kRowBlock - 1) / kRowBlock;
  const int64_t total = row_blocks * per_block;
  if (row_blocks == 1) {  // a decode step's rows: each thread streams one range of the panels (as run_few_rows)
    tandem_cpu::for_each_share(total, tandem_cpu::chunk_for(total, 8),
                               [&](int64_t begin, int64_t end) { run_items(p, begin, end); });
    return;
  }
  tandem_cpu::for_each_chunk(total, tandem_cpu::chunk_for(total, 8),
                             [&](int64_t begin, int64_t end) { run_items(p, begin, end); });
#endif
}

// The checks of a gated MLP's one pass (panel_linear_dpbf16_silu, panel_linear_amx_silu), and its problem
Problem checked_silu_problem(const char* name, at::Tensor& out, const at::Tensor& x, const at::Tensor& panels) {
  TORCH_CHECK(panels.dim() == 4 && panels.size(0) % 2 == 0 && out.dim() == 2 &&
                  out.size(1) * 2 == panels.size(0) * kPanel && out.scalar_type() == at::kBFloat16,
              name, ": panels of [gate; up] with gate's rows a multiple of 16, and a bfloat16 out [M, rows of gate]");
  Problem p = checked_problem(name, out, x, panels, c10::nullopt, false, true);
  p.up_panels = panels.size(0) / 2;
  return p;
}

}  // namespace

void panel_linear_dpbf16(at::Tensor& out, const at::Tensor& x, const at::Tensor& panels,
                         const c10::optional<at::Tensor>& bias, bool bf16_values) {
  TORCH_CHECK(cpu_has_dpbf16(), "panel_linear_dpbf16: this CPU has no AVX512-BF16 instructions");
  run_dpbf16(checked_problem("panel_linear_dpbf16", out, x, panels, bias, bf16_values));
}

void panel_linear_dpbf16_silu(at::Tensor& out, const at::Tensor& x, const at::Tensor& panels) {
  TORCH_CHECK(cpu_has_dpbf16(), "panel_linear_dpbf16_silu: this CPU has no AVX512-BF16 instructions");
  run_dpbf16(checked_silu_problem("panel_linear_dpbf16_silu", out, x, panels));
}

namespace {

// panel_linear_amx and panel_linear_amx_silu on a checked problem
void run_amx(const Problem& p) {
#ifdef TANDEM_AMX
  TORCH_CHECK(p.pairs % kAmxPairs == 0, "panel_linear_amx: K must be a multiple of 32");
  if (p.m == 0) return;
  const int64_t full = p.m / kAmxRows * kAmxRows;
  std::vector<uint16_t> tail(full < p.m ? kAmxRows * p.pairs * 2 : 0, 0);
  for (int64_t r = full; r < p.m; ++r)
    std::memcpy(tail.data() + (r - full) * p.pairs * 2, p.x + r * p.ldx, p.pairs * 4);
  const AmxRows xs{p, full, tail.data()};
  const bool silu = p.up_panels > 0;
  const int64_t groups = ((silu ? p.up_panels : p.n_panels) + 1) / 2;
  const auto items = [&](int64_t chunk_rows, int64_t begin, int64_t end) {
    if (silu) amx_silu_items(xs, chunk_rows, begin, end);
    else amx_items(xs, chunk_rows, begin, end);
  };
  if (p.m <= kAmxShareRows) {
    tandem_cpu::for_each_share(groups, tandem_cpu::chunk_for(groups, 8),
                               [&](int64_t begin, int64_t end) { items(kAmxShareRows, begin, end); });
    return;
  }
  const int64_t total = (p.m + kAmxChunkRows - 1) / kAmxChunkRows * groups;
  tandem_cpu::for_each_chunk(total, tandem_cpu::chunk_for(total, 8),
                             [&](int64_t begin, int64_t end) { items(kAmxChunkRows, begin, end); });
#else
  (void)p;
#endif
}

}  // namespace

void panel_linear_amx(at::Tensor& out, const at::Tensor& x, const at::Tensor& panels,
                      const c10::optional<at::Tensor>& bias, bool bf16_values) {
  TORCH_CHECK(cpu_has_amx(), "panel_linear_amx: this CPU (or its kernel) gives no AMX-BF16 instructions");
  run_amx(checked_problem("panel_linear_amx", out, x, panels, bias, bf16_values));
}

void panel_linear_amx_silu(at::Tensor& out, const at::Tensor& x, const at::Tensor& panels) {
  TORCH_CHECK(cpu_has_amx(), "panel_linear_amx_silu: this CPU (or its kernel) gives no AMX-BF16 instructions");
  run_amx(checked_silu_problem("panel_linear_amx_silu", out, x, panels));
}

TORCH_LIBRARY_FRAGMENT(tandem_cpu, m) {
  m.def("panel_linear_dpbf16(Tensor(a!) out, Tensor x, Tensor panels, Tensor? bias, bool bf16_values=False) -> ()");
  m.def("panel_linear_dpbf16_silu(Tensor(a!) out, Tensor x, Tensor panels) -> ()");
  m.def("dpbf16_supported() -> bool", &dpbf16_supported);
  m.def("panel_linear_amx(Tensor(a!) out, Tensor x, Tensor panels, Tensor? bias, bool bf16_values=False) -> ()");
  m.def("panel_linear_amx_silu(Tensor(a!) out, Tensor x, Tensor panels) -> ()");
  m.def("amx_supported() -> bool", &amx_supported);
}

TORCH_LIBRARY_IMPL(tandem_cpu, CPU, m) {
  m.impl("panel_linear_dpbf16", &panel_linear_dpbf16);
  m.impl("panel_linear_dpbf16_silu", &panel_linear_dpbf16_silu);
  m.impl("panel_linear_amx", &panel_linear_amx);
  m.impl("panel_linear_amx_silu", &panel_linear_amx_silu);
}
