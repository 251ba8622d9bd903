// A prompt's query rows in paged_decode (paged_attention.cpp) as tile products, bfloat16: on
// AMX tiles where the CPU has them, else in vdpbf16ps (AVX512-BF16).
//
// paged_decode gets every token of a prefill (or of a chunk of one) as a query row that sees the
// keys up to its own position. Row by row, each query row re-reads its whole prefix and scores
// it one (head, key) at a time. Here runs of up to 16 consecutive query rows of one sequence,
// each seeing one key more than the one before (the rows of a prompt), go together, flash
// attention style: per KV head and chunk of 32 keys (two blocks),
//
//   S = Q K^T    A tile: the 16 rows' query head (16 x 32 head dims), B tiles: the keys
//                transposed into pairs of head dims (built once a chunk, for all the KV head's
//                query heads), two tile products per 32 head dims
//   softmax      per row over the chunk (keys past the row's own position masked), the running
//                max and sum moved as in paged_decode, in float32
//   O += P V     A tile: the rows' probabilities rounded to bfloat16 (16 x 32 keys), B tiles:
//                the values with pairs of keys interleaved (built once a chunk), one tile product
//                per 16 head dims; O kept in float32 (rescaled when a row's max moves)
//
// A tile product C[16 x 16] += A[16 x 32] B (B: 16 rows of 16 columns' pairs, AMX's layout) is
// one TDPBF16PS on AMX; without AMX (DpTiles) it is 16 vdpbf16ps a row, each an A row's pair
// broadcast against a B row, 8 rows and two B tiles at a time (16 sums in registers). Both give
// the same sums up to their order.
//
// Scores are exact products in float32 as in the row kernel; the probabilities are rounded to
// bfloat16 for P V (as flash attention does on GPUs), which moves a bfloat16 model's output by
// well under its own rounding. Keys past the end of the sequence's last block are never read;
// slots past a row's length get no weight and their values are zeroed in the interleaved copy
// (whatever bits the pool holds there never reach a sum).
#include <ATen/core/Tensor.h>
#include <c10/util/BFloat16.h>

#include "amx_tiles.h"
#include "transpose16.h"
#include "work_queue.h"

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstring>
#include <vector>

#if defined(__x86_64__) && defined(__GNUC__) && defined(__linux__) && __GNUC__ >= 11
#include <immintrin.h>

#include "vec_exp.h"
#define TANDEM_PREFILL_TILES 1
#define TANDEM_DPBF16_TARGET __attribute__((target("avx512f,avx512bw,avx512vl,avx512bf16")))
#define TANDEM_AMX_TARGET __attribute__((target("amx-tile,amx-bf16,avx512f,avx512bw,avx512vl,avx512bf16")))
#endif

#include "prefill_tiles.h"

bool dpbf16_supported();  // linear_dpbf16.cpp: the CPU has AVX512-BF16

namespace {

constexpr int64_t kRows = 16;     // query rows of a run (an A tile's rows)
constexpr int64_t kChunk = 32;    // keys a chunk (two 16-token blocks; an A tile's K of P V)
constexpr int64_t kMinRows = 8;   // shorter runs stay with the row kernel
constexpr float kNoScore = -1e30f;

#ifdef TANDEM_PREFILL_TILES
using tandem_cpu::transpose16;

using tandem_cpu::exp16;

struct Run {
  int64_t first;  // its first query row (rows first .. first + n - 1)
  int64_t n;
};

struct Problem {
  c10::BFloat16* out;
  int64_t os0, os1;
  const c10::BFloat16* q;
  int64_t qs0, qs1;
  const c10::BFloat16* kv;
  int64_t ks0, ks1, ks2, ks3;
  const int64_t *rows, *lens, *table_rows, *tables;
  int64_t max_blocks, kv_heads, groups, d;
  float scale;
};

// The two products of a run and chunk, for one query head (16 rows; rows past the run's n are
// zero in q and p, and their scores are never used):
//   scores: s [16][32] float32 = q [16][d] . the chunk's keys^T (kt: two halves of 16 keys, each
//           `steps` B tiles of 32 head dims)
//   values: o [16][d] float32 += p [16][32] . vt (d / 16 B tiles of 16 key pairs x 16 dims)
struct AmxTiles {
  static TANDEM_AMX_TARGET void begin() {
    const tandem_cpu::TileConfig cfg = tandem_cpu::full_tiles();
    _tile_loadconfig(&cfg);
  }
  static TANDEM_AMX_TARGET void end() { _tile_release(); }

  static TANDEM_AMX_TARGET void scores(float* s, const uint16_t* q, int64_t d, const uint16_t* kt, int64_t steps,
                                       int64_t) {
    _tile_zero(0);
    _tile_zero(1);
    for (int64_t st = 0; st < steps; ++st) {
      _tile_loadd(4, q + st * 32, d * 2);
      _tile_loadd(6, kt + st * 512, 64);
      _tile_loadd(7, kt + (steps + st) * 512, 64);
      _tile_dpbf16ps(0, 4, 6);
      _tile_dpbf16ps(1, 4, 7);
    }
    _tile_stored(0, s, 128);
    _tile_stored(1, s + 16, 128);
  }

  // four tiles of 16 head dims at a time (independent sums)
  static TANDEM_AMX_TARGET void values(float* o, int64_t d, const uint16_t* p, const uint16_t* vt, int64_t) {
    _tile_loadd(4, p, 64);
    for (int64_t x = 0; x < d / 16; x += 4) {
      _tile_loadd(0, o + x * 16, d * 4);
      _tile_loadd(1, o + (x + 1) * 16, d * 4);
      _tile_loadd(2, o + (x + 2) * 16, d * 4);
      _tile_loadd(3, o + (x + 3) * 16, d * 4);
      _tile_loadd(6, vt + x * 512, 64);
      _tile_loadd(7, vt + (x + 1) * 512, 64);
      _tile_dpbf16ps(0, 4, 6);
      _tile_dpbf16ps(1, 4, 7);
      _tile_loadd(6, vt + (x + 2) * 512, 64);
      _tile_loadd(7, vt + (x + 3) * 512, 64);
      _tile_dpbf16ps(2, 4, 6);
      _tile_dpbf16ps(3, 4, 7);
      _tile_stored(0, o + x * 16, d * 4);
      _tile_stored(1, o + (x + 1) * 16, d * 4);
      _tile_stored(2, o + (x + 2) * 16, d * 4);
      _tile_stored(3, o + (x + 3) * 16, d * 4);
    }
  }
};

// The same products in vdpbf16ps: an A row's pair broadcast against a B row (16 columns' pairs),
// 8 rows by two B tiles at a time (16 sums in registers, each A pair loaded once for both);
// groups of 8 rows wholly past the run are skipped.
struct DpTiles {
  static void begin() {}
  static void end() {}

  [[gnu::always_inline]] static TANDEM_DPBF16_TARGET inline __m512bh pair_of(const uint16_t* a) {
    int32_t pair;
    std::memcpy(&pair, a, sizeof(pair));
    return (__m512bh)_mm512_set1_epi32(pair);
  }

  static TANDEM_DPBF16_TARGET void scores(float* s, const uint16_t* q, int64_t d, const uint16_t* kt, int64_t steps,
                                          int64_t rows) {
    for (int64_t r0 = 0; r0 < rows; r0 += 8) {
      __m512 lo[8], hi[8];  // keys 0-15 and 16-31 of the chunk
      for (int r = 0; r < 8; ++r) lo[r] = hi[r] = _mm512_setzero_ps();
      for (int64_t st = 0; st < steps; ++st) {
        const uint16_t* qs = q + r0 * d + st * 32;
        for (int j = 0; j < 16; ++j) {
          const __m512bh b0 = (__m512bh)_mm512_loadu_si512(kt + st * 512 + j * 32);
          const __m512bh b1 = (__m512bh)_mm512_loadu_si512(kt + (steps + st) * 512 + j * 32);
          for (int r = 0; r < 8; ++r) {
            const __m512bh a = pair_of(qs + r * d + 2 * j);
            lo[r] = _mm512_dpbf16_ps(lo[r], a, b0);
            hi[r] = _mm512_dpbf16_ps(hi[r], a, b1);
          }
        }
      }
      for (int r = 0; r < 8; ++r) {
        _mm512_storeu_ps(s + (r0 + r) * 32, lo[r]);
        _mm512_storeu_ps(s + (r0 + r) * 32 + 16, hi[r]);
      }
    }
  }

  static TANDEM_DPBF16_TARGET void values(float* o, int64_t d, const uint16_t* p, const uint16_t* vt,
                                          int64_t rows) {
    for (int64_t r0 = 0; r0 < rows; r0 += 8) {
      for (int64_t x = 0; x < d / 16; x += 2) {  // d % 64 == 0
        __m512 c0[8], c1[8];
        for (int r = 0; r < 8; ++r) {
          c0[r] = _mm512_loadu_ps(o + (r0 + r) * d + x * 16);
          c1[r] = _mm512_loadu_ps(o + (r0 + r) * d + x * 16 + 16);
        }
        for (int kp = 0; kp < 16; ++kp) {
          const __m512bh b0 = (__m512bh)_mm512_loadu_si512(vt + x * 512 + kp * 32);
          const __m512bh b1 = (__m512bh)_mm512_loadu_si512(vt + (x + 1) * 512 + kp * 32);
          for (int r = 0; r < 8; ++r) {
            const __m512bh a = pair_of(p + (r0 + r) * 32 + 2 * kp);
            c0[r] = _mm512_dpbf16_ps(c0[r], a, b0);
            c1[r] = _mm512_dpbf16_ps(c1[r], a, b1);
          }
        }
        for (int r = 0; r < 8; ++r) {
          _mm512_storeu_ps(o + (r0 + r) * d + x * 16, c0[r]);
          _mm512_storeu_ps(o + (r0 + r) * d + x * 16 + 16, c1[r]);
        }
      }
    }
  }
};

// One run's query heads of KV head h
template <typename Tiles>
TANDEM_DPBF16_TARGET void run_tiles(const Problem& p, const Run& run, int64_t h, std::vector<char>& scratch) {
  const int64_t d = p.d, g_n = p.groups, steps = d / 32, dtiles = d / 16;  // d: a multiple of 64
  const int64_t* table = p.tables + p.table_rows[run.first] * p.max_blocks;
  const int64_t len0 = p.lens[run.first], len_last = len0 + run.n - 1;
  // scratch: queries [g][16][d] bf16 | keys^T [2][steps][16][32] bf16 | values [dtiles][16][32]
  // bf16 | O [g][16][d] f32 | S [16][32] f32 | P [16][32] bf16 | m, l [g][16]
  const int64_t q_bytes = g_n * kRows * d * 2, k_bytes = 2 * steps * 1024, v_bytes = dtiles * 1024;
  const int64_t o_bytes = g_n * kRows * d * 4;
  scratch.resize(q_bytes + k_bytes + v_bytes + o_bytes + 2048 + 1024 + 2 * g_n * kRows * 4 + 64);
  char* base = reinterpret_cast<char*>((reinterpret_cast<uintptr_t>(scratch.data()) + 63) & ~uintptr_t{63});
  auto* qt = reinterpret_cast<uint16_t*>(base);
  auto* kt = reinterpret_cast<uint16_t*>(base + q_bytes);
  auto* vt = reinterpret_cast<uint16_t*>(base + q_bytes + k_bytes);
  auto* o = reinterpret_cast<float*>(base + q_bytes + k_bytes + v_bytes);
  auto* s = reinterpret_cast<float*>(base + q_bytes + k_bytes + v_bytes + o_bytes);
  auto* pt = reinterpret_cast<uint16_t*>(base + q_bytes + k_bytes + v_bytes + o_bytes + 2048);
  float* m = reinterpret_cast<float*>(base + q_bytes + k_bytes + v_bytes + o_bytes + 3072);
  float* l = m + g_n * kRows;
  std::memset(qt, 0, q_bytes);
  for (int64_t g = 0; g < g_n; ++g)
    for (int64_t r = 0; r < run.n; ++r)
      std::memcpy(qt + (g * kRows + r) * d, p.q + p.rows[run.first + r] * p.qs0 + (h * g_n + g) * p.qs1, d * 2);
  std::memset(o, 0, o_bytes);
  std::fill(m, m + g_n * kRows, kNoScore);
  std::fill(l, l + g_n * kRows, 0.f);
  for (int64_t c0 = 0; c0 < len_last; c0 += kChunk) {
    const int64_t valid = std::min(kChunk, len_last - c0);  // keys of the chunk some row sees
    // keys^T: for each block of the chunk and 32 head dims, a B tile of 16 pair rows x 16 keys
    for (int64_t half = 0; half < 2; ++half) {
      const int64_t keys = std::clamp<int64_t>(valid - half * 16, 0, 16);
      uint16_t* dst = kt + half * steps * 512;
      if (keys == 0) {
        std::memset(dst, 0, steps * 1024);
        continue;
      }
      const c10::BFloat16* kb = p.kv + table[(c0 + half * 16) / 16] * p.ks0 + h * p.ks3;
      for (int64_t st = 0; st < steps; ++st) {
        __m512i r[16];
        for (int t = 0; t < 16; ++t)
          r[t] = t < keys ? _mm512_loadu_si512(kb + t * p.ks2 + st * 32) : _mm512_setzero_si512();
        transpose16(r);
        for (int j = 0; j < 16; ++j) _mm512_storeu_si512(dst + st * 512 + j * 32, r[j]);
      }
    }
    // values: for each 16 head dims a B tile of 16 key pairs x 16 dims (keys past `valid` zero)
    for (int64_t kp = 0; kp < 16; ++kp) {
      const int64_t k0 = 2 * kp, k1 = 2 * kp + 1;
      const c10::BFloat16* v0 = k0 < valid ? p.kv + table[(c0 + k0) / 16] * p.ks0 + p.ks1 + ((c0 + k0) % 16) * p.ks2 + h * p.ks3 : nullptr;
      const c10::BFloat16* v1 = k1 < valid ? p.kv + table[(c0 + k1) / 16] * p.ks0 + p.ks1 + ((c0 + k1) % 16) * p.ks2 + h * p.ks3 : nullptr;
      for (int64_t x = 0; x < d; x += 32) {
        const __m512i a = v0 != nullptr ? _mm512_loadu_si512(v0 + x) : _mm512_setzero_si512();
        const __m512i b = v1 != nullptr ? _mm512_loadu_si512(v1 + x) : _mm512_setzero_si512();
        // dims x .. x + 15 and x + 16 .. x + 31, each value of a beside b's (index 32 + i: b's i)
        const __m512i low = _mm512_setr_epi32(0x00200000, 0x00210001, 0x00220002, 0x00230003, 0x00240004, 0x00250005,
                                              0x00260006, 0x00270007, 0x00280008, 0x00290009, 0x002a000a, 0x002b000b,
                                              0x002c000c, 0x002d000d, 0x002e000e, 0x002f000f);
        const __m512i first = _mm512_permutex2var_epi16(a, low, b);
        const __m512i second = _mm512_permutex2var_epi16(a, _mm512_add_epi16(low, _mm512_set1_epi16(16)), b);
        _mm512_storeu_si512(vt + (x / 16) * 512 + kp * 32, first);
        _mm512_storeu_si512(vt + (x / 16 + 1) * 512 + kp * 32, second);
      }
    }
    for (int64_t g = 0; g < g_n; ++g) {
      Tiles::scores(s, qt + g * kRows * d, d, kt, steps, run.n);  // S = Q K^T: 16 rows x 32 keys
      float* mg = m + g * kRows;
      float* lg = l + g * kRows;
      float* og = o + g * kRows * d;
      // each row's scores scaled, keys it does not see at kNoScore, and its max over the chunk
      alignas(64) float top[kRows], keep[kRows];
      __mmask32 live[kRows];
      for (int64_t r = 0; r < kRows; ++r) {
        const int64_t seen = r < run.n ? std::clamp<int64_t>(len0 + r - c0, 0, kChunk) : 0;  // keys row r sees
        live[r] = seen >= 32 ? ~__mmask32{0} : static_cast<__mmask32>((uint64_t{1} << seen) - 1);
        const __m512 s0 = _mm512_mask_mul_ps(_mm512_set1_ps(kNoScore), static_cast<__mmask16>(live[r]),
                                             _mm512_loadu_ps(s + r * 32), _mm512_set1_ps(p.scale));
        const __m512 s1 = _mm512_mask_mul_ps(_mm512_set1_ps(kNoScore), static_cast<__mmask16>(live[r] >> 16),
                                             _mm512_loadu_ps(s + r * 32 + 16), _mm512_set1_ps(p.scale));
        _mm512_storeu_ps(s + r * 32, s0);
        _mm512_storeu_ps(s + r * 32 + 16, s1);
        top[r] = _mm512_reduce_max_ps(_mm512_max_ps(s0, s1));
      }
      // the running maxima move (a row that sees nothing here keeps its own: keep = 1)
      const __m512 m_old = _mm512_loadu_ps(mg), m_new = _mm512_max_ps(m_old, _mm512_load_ps(top));
      _mm512_store_ps(keep, exp16(_mm512_sub_ps(m_old, m_new)));
      _mm512_storeu_ps(mg, m_new);
      for (int64_t r = 0; r < kRows; ++r) {
        __m512i pb = _mm512_setzero_si512();
        if (live[r] != 0) {
          const __m512 mr = _mm512_set1_ps(mg[r]);
          const __m512 e0 = _mm512_maskz_mov_ps(static_cast<__mmask16>(live[r]),
                                                exp16(_mm512_sub_ps(_mm512_loadu_ps(s + r * 32), mr)));
          const __m512 e1 = _mm512_maskz_mov_ps(static_cast<__mmask16>(live[r] >> 16),
                                                exp16(_mm512_sub_ps(_mm512_loadu_ps(s + r * 32 + 16), mr)));
          lg[r] = lg[r] * keep[r] + _mm512_reduce_add_ps(_mm512_add_ps(e0, e1));
          if (keep[r] != 1.f) {
            for (int64_t x = 0; x < d; x += 16)
              _mm512_storeu_ps(og + r * d + x, _mm512_mul_ps(_mm512_loadu_ps(og + r * d + x), _mm512_set1_ps(keep[r])));
          }
          pb = (__m512i)_mm512_cvtne2ps_pbh(e1, e0);
        }
        _mm512_storeu_si512(pt + r * 32, pb);
      }
      Tiles::values(og, d, pt, vt, run.n);  // O += P V
    }
  }
  for (int64_t g = 0; g < g_n; ++g)
    for (int64_t r = 0; r < run.n; ++r) {
      const float inv = l[g * kRows + r] > 0.f ? 1.f / l[g * kRows + r] : 0.f;
      c10::BFloat16* dst = p.out + p.rows[run.first + r] * p.os0 + (h * g_n + g) * p.os1;
      const float* src = o + (g * kRows + r) * d;
      for (int64_t x = 0; x < d; x += 16)  // rounded to nearest even, as c10's conversion rounds
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst + x),
                            (__m256i)_mm512_cvtneps_pbh(_mm512_mul_ps(_mm512_loadu_ps(src + x), _mm512_set1_ps(inv))));
    }
}

// work items [begin, end): item = run * kv_heads + KV head
template <typename Tiles>
void run_items(const Problem& p, const std::vector<Run>& runs, int64_t begin, int64_t end) {
  Tiles::begin();
  std::vector<char> scratch;
  for (int64_t w = begin; w < end; ++w) run_tiles<Tiles>(p, runs[w / p.kv_heads], w % p.kv_heads, scratch);
  Tiles::end();
}
#endif

std::atomic<bool> g_amx{true};  // use_prefill_amx

}  // namespace

bool use_prefill_amx(bool on) { return g_amx.exchange(on); }

std::vector<int64_t> prefill_rows_tiled(c10::BFloat16* out, int64_t os0, int64_t os1, const c10::BFloat16* q,
                                        int64_t qs0, int64_t qs1, const c10::BFloat16* kv, int64_t ks0, int64_t ks1,
                                        int64_t ks2, int64_t ks3, const int64_t* rows, const int64_t* lens,
                                        const int64_t* table_rows, const int64_t* tables, int64_t max_blocks,
                                        int64_t n_rows, int64_t kv_heads, int64_t groups, int64_t d, float scale,
                                        int64_t window) {
  std::vector<int64_t> rest;
#ifdef TANDEM_PREFILL_TILES
  std::vector<Run> runs;
  // a window some row reaches past leaves every row to the caller; one none does changes nothing
  const bool windowed = window > 0 && n_rows > 0 && *std::max_element(lens, lens + n_rows) > window;
  const bool amx = g_amx.load(std::memory_order_relaxed) && amx_supported();
  if (!windowed && table_rows != nullptr && d % 64 == 0 && (amx || dpbf16_supported())) {
    for (int64_t i = 0; i < n_rows;) {
      int64_t n = 1;
      while (n < kRows && i + n < n_rows && table_rows[i + n] == table_rows[i] && lens[i + n] == lens[i] + n &&
             lens[i] >= 1)
        ++n;
      if (n >= kMinRows) {
        runs.push_back({i, n});
      } else {
        for (int64_t j = i; j < i + n; ++j) rest.push_back(j);
      }
      i += n;
    }
  }
  if (runs.empty()) {
    rest.resize(n_rows);
    for (int64_t i = 0; i < n_rows; ++i) rest[i] = i;
    return rest;
  }
  const Problem p{out, os0, os1, q, qs0, qs1, kv, ks0, ks1, ks2, ks3, rows, lens, table_rows, tables, max_blocks,
                  kv_heads, groups, d, scale};
  const int64_t total = static_cast<int64_t>(runs.size()) * kv_heads;
  tandem_cpu::for_each_chunk(total, 1, [&](int64_t begin, int64_t end) {
    if (amx) {
      run_items<AmxTiles>(p, runs, begin, end);
    } else {
      run_items<DpTiles>(p, runs, begin, end);
    }
  });
#else
  rest.resize(n_rows);
  for (int64_t i = 0; i < n_rows; ++i) rest[i] = i;
#endif
  return rest;
}
