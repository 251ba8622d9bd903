// Paged decode attention on the CPU, reading the KV pool in place (tandem.kernels.cpu_ops).
//
// One query row attends to the first seq_len keys of its own sequence (the last `window` of
// them when window > 0), which live in the blocks its block-table row names. Work items are
// rows (or, with few rows, (row, KV head) pairs), taken one at a time by tandem's work pool's
// threads from a shared counter (work_queue.h; a decode step's many rows on AVX512-BF16 in
// contiguous shares instead, each thread asking for its next row's blocks while it computes one:
// ItemAhead); each walks its blocks once, front to back: the scores of
// all its query heads against every key of the block (kept head-major, so that max, exp and sum
// run over whole vectors of keys), then the block folded into a running (max, sum, weighted V)
// softmax, in float32. While it computes a block it asks for the next one, a share of it per
// query head (NextBlock), so that the reads overlap the arithmetic (asking for the whole block at
// once gains nothing: the requests queue up and the core waits).
// Built for AVX512 with a head size that divides by 16, the query heads that share a KV head (up
// to four at a time) take each key and value converted to float32 once, 16 lanes wide; otherwise
// each query head reads them itself (8 lanes with AVX2, scalar without).
// bfloat16 queries and pool, a head size that divides by 32 and 16-token blocks, on a CPU with
// AVX512-BF16 (row_dpbf16): a row's blocks go in chunks of eight, each chunk's scores first (16
// keys at once by vdpbf16ps on the bfloat16 values, whose products are exact in float32), then
// one softmax pass over the chunk, then its values in float32 FMAs.
// A prefill is rows too (the cpu backend sends every token of a step as a row that sees the keys
// up to its own position): the rows of one sequence read the same blocks, from cache. On the
// bfloat16 path with AVX512-BF16, runs of such rows go to prefill_tiles.cpp (16 rows at a time as
// tile products, on AMX or in vdpbf16ps);
// the rows it leaves (decodes, short runs, a window) come here.
//
//   q, out   [T, H, D]                    rows[i] is the token row of query row i
//   kv       [num_blocks, 2, bs, Hkv, D]  one layer of the pool (index 0: K, 1: V), D contiguous
//   tables   [S, max_blocks] int64        block ids of each sequence
//   row_tables [N] int64, optional        the table of query row i: tables[row_tables[i]] (the
//                                         rows of one prefill share one table); without it,
//                                         tables[i] (S == N)
//   seq_lens [N] int64                    keys visible to query row i
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <torch/library.h>

#include "prefill_tiles.h"
#include "work_queue.h"
#ifdef __AVX512F__
#include "bf16_round.h"
#include "vec_exp.h"
#endif

#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <algorithm>
#include <cmath>
#include <type_traits>
#include <vector>

#if defined(__SSE__)
#include <xmmintrin.h>
#endif

#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#include <immintrin.h>
#define TANDEM_AVX2 1
#endif

bool dpbf16_supported();  // linear_dpbf16.cpp: the CPU has AVX512-BF16

namespace {

// The running max before any key: finite (the file is built with -ffast-math), low enough that
// exp(kNoScore - any real score) is 0.
constexpr float kNoScore = -1e30f;

template <typename cache_t>
inline float dot(const float* q, const cache_t* k, int64_t d) {
  float s = 0.f;
#pragma omp simd reduction(+ : s)
  for (int64_t i = 0; i < d; ++i) s += q[i] * static_cast<float>(k[i]);
  return s;
}

template <typename cache_t>
inline void axpy(float* acc, float p, const cache_t* v, int64_t d) {
#pragma omp simd
  for (int64_t i = 0; i < d; ++i) acc[i] += p * static_cast<float>(v[i]);
}

// The next block of a work item (its heads' keys, or values, of every token), requested from
// memory a share at a time while the current block is computed: in share j of n, the tokens
// j * bs / n .. (j + 1) * bs / n - 1. Spread this way (one or two tokens' lines per query head
// of the item) the reads overlap the arithmetic; all at once at the block's start they queue up
// behind each other and the core waits on them. base == nullptr: nothing to fetch.
struct NextBlock {
  const char* base = nullptr;  // token 0's first head of the item
  int64_t token_stride = 0;    // bytes from one token to the next
  int64_t token_bytes = 0;     // bytes of one token's heads of the item (contiguous)
  int64_t tokens = 0;

  // always_inline: out of line, GCC judges a function that only prefetches to have no effect
  // and drops its calls (a prefetch builtin inside the caller's own body stays)
  [[gnu::always_inline]] inline void fetch(int64_t share, int64_t shares) const {
    if (base == nullptr) return;
    for (int64_t t = share * tokens / shares, end = (share + 1) * tokens / shares; t < end; ++t) {
      const char* row = base + t * token_stride;
      for (int64_t off = 0; off < token_bytes; off += 64) prefetch_line(row + off);
    }
  }

  // into L2, not L1: the L1's few miss buffers fill up and stall the prefetching loop; L2 has
  // more, and a line comes from L2 fast enough when its block is reached
  [[gnu::always_inline]] static inline void prefetch_line(const char* p) {
#if defined(__SSE__)
    _mm_prefetch(p, _MM_HINT_T1);
#else
    __builtin_prefetch(p, 0, 2);
#endif
  }
};

#ifdef TANDEM_AVX2
inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 load8(const c10::BFloat16* p) {
  const __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(raw), 16));
}
inline __m256 load8(const c10::Half* p) {
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}
#endif

#ifdef __AVX512F__
#define TANDEM_AVX512 1
inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
inline __m512 load16(const c10::BFloat16* p) {
  return tandem_cpu::widened_bf16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}
inline __m512 load16(const c10::Half* p) {
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}
inline __m256 halves_added(__m512 a) {
  return _mm256_add_ps(_mm512_castps512_ps256(a),
                       _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(a), 1)));
}

// out[u] = the sum of a[u]'s 16 lanes, u < 4
inline void sums_of_four(const __m512* a, float* out) {
  const __m256 h = _mm256_hadd_ps(_mm256_hadd_ps(halves_added(a[0]), halves_added(a[1])),
                                  _mm256_hadd_ps(halves_added(a[2]), halves_added(a[3])));
  _mm_storeu_ps(out, _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1)));
}

// scores of G query heads (q: the first's d values, the others after it) that share one KV head
// (k: token 0's key of that head), against keys t0..t1-1: each key converted once for the G heads
template <int G, typename cache_t>
void scores_of_heads(float* scores, int64_t bs, int64_t j0, const float* q, const cache_t* k, int64_t ks2, int64_t t0,
                     int64_t t1, int64_t d) {
  int64_t t = t0;
  for (; t + 4 <= t1; t += 4) {
    __m512 a[G][4];
    for (int g = 0; g < G; ++g)
      for (int u = 0; u < 4; ++u) a[g][u] = _mm512_setzero_ps();
    const cache_t* k0 = k + t * ks2;
    for (int64_t x = 0; x < d; x += 16) {
      const __m512 kv0 = load16(k0 + x), kv1 = load16(k0 + ks2 + x);
      const __m512 kv2 = load16(k0 + 2 * ks2 + x), kv3 = load16(k0 + 3 * ks2 + x);
      for (int g = 0; g < G; ++g) {
        const __m512 qv = _mm512_loadu_ps(q + g * d + x);
        a[g][0] = _mm512_fmadd_ps(qv, kv0, a[g][0]);
        a[g][1] = _mm512_fmadd_ps(qv, kv1, a[g][1]);
        a[g][2] = _mm512_fmadd_ps(qv, kv2, a[g][2]);
        a[g][3] = _mm512_fmadd_ps(qv, kv3, a[g][3]);
      }
    }
    for (int g = 0; g < G; ++g) sums_of_four(a[g], scores + (j0 + g) * bs + t);
  }
  for (; t < t1; ++t)
    for (int g = 0; g < G; ++g) scores[(j0 + g) * bs + t] = dot(q + g * d, k + t * ks2, d);
}

// acc of G query heads (j0.., d values each) += p-weighted values of keys t0..t1-1 of their KV
// head (v: token 0's value of it; p[(j0 + g) * ps + t] the weight of key t for head j0 + g): each
// value converted once for the G heads, X 16-lane chunks of the head at a time so that G * X sums
// are in flight (one chunk at a time, each token's FMA would wait on the previous one's)
template <int G, int X, typename cache_t>
inline void values_tile(float* acc, const float* p, int64_t ps, const cache_t* v, int64_t ks2, int64_t t0,
                        int64_t t1, int64_t d, int64_t x0) {
  __m512 c[G][X];
  for (int g = 0; g < G; ++g)
    for (int u = 0; u < X; ++u) c[g][u] = _mm512_loadu_ps(acc + g * d + x0 + 16 * u);
  for (int64_t t = t0; t < t1; ++t) {
    const cache_t* vt = v + t * ks2 + x0;
    __m512 vv[X];
    for (int u = 0; u < X; ++u) vv[u] = load16(vt + 16 * u);
    for (int g = 0; g < G; ++g) {
      const __m512 pg = _mm512_set1_ps(p[g * ps + t]);
      for (int u = 0; u < X; ++u) c[g][u] = _mm512_fmadd_ps(pg, vv[u], c[g][u]);
    }
  }
  for (int g = 0; g < G; ++g)
    for (int u = 0; u < X; ++u) _mm512_storeu_ps(acc + g * d + x0 + 16 * u, c[g][u]);
}

template <int G, typename cache_t>
void values_of_heads(float* acc, const float* p, int64_t ps, int64_t j0, const cache_t* v, int64_t ks2, int64_t t0,
                     int64_t t1, int64_t d) {
  constexpr int X = G <= 2 ? 8 : 4;  // at most 16 sums held
  float* a = acc + j0 * d;
  const float* pj = p + j0 * ps;
  int64_t x0 = 0;
  for (; x0 + 16 * X <= d; x0 += 16 * X) values_tile<G, X>(a, pj, ps, v, ks2, t0, t1, d, x0);
  for (; x0 + 32 <= d; x0 += 32) values_tile<G, 2>(a, pj, ps, v, ks2, t0, t1, d, x0);
  for (; x0 < d; x0 += 16) values_tile<G, 1>(a, pj, ps, v, ks2, t0, t1, d, x0);
}

// f(G, hh, j0) for each run of G <= 4 query heads j0 .. j0 + G - 1 (G a std::integral_constant)
// that share the KV head hh of the work item, after asking for their share of the next block
template <typename F>
void for_head_runs(int64_t part_heads, int64_t groups, const NextBlock& next, const F& f) {
  for (int64_t hh = 0; hh < part_heads; ++hh) {
    for (int64_t g0 = 0; g0 < groups; g0 += 4) {
      const int64_t j0 = hh * groups + g0, n = std::min<int64_t>(4, groups - g0);
      for (int64_t j = j0; j < j0 + n; ++j) next.fetch(j, part_heads * groups);
      switch (n) {
        case 1: f(std::integral_constant<int, 1>(), hh, j0); break;
        case 2: f(std::integral_constant<int, 2>(), hh, j0); break;
        case 3: f(std::integral_constant<int, 3>(), hh, j0); break;
        default: f(std::integral_constant<int, 4>(), hh, j0); break;
      }
    }
  }
}
#endif

// scores[j * bs + t] = q_j . k_t for the block's keys t0..t1-1 and the work item's query heads j
// (query head j = hh * groups + g uses KV head hh of the item). AVX2 with d % 8 == 0: four keys
// at a time, their sums reduced together.
template <typename cache_t>
void block_scores(float* scores, int64_t bs, const float* qf, const cache_t* kb, int64_t ks2, int64_t ks3, int64_t t0,
                  int64_t t1, int64_t part_heads, int64_t groups, int64_t d, const NextBlock& next) {
#ifdef TANDEM_AVX512
  if (d % 16 == 0) {
    for_head_runs(part_heads, groups, next, [&](auto heads, int64_t hh, int64_t j0) {
      scores_of_heads<decltype(heads)::value>(scores, bs, j0, qf + j0 * d, kb + hh * ks3, ks2, t0, t1, d);
    });
    return;
  }
#endif
  for (int64_t hh = 0; hh < part_heads; ++hh) {
    for (int64_t g = 0; g < groups; ++g) {
      const int64_t j = hh * groups + g;
      next.fetch(j, part_heads * groups);
      const float* qj = qf + j * d;
      int64_t t = t0;
#ifdef TANDEM_AVX2
      if (d % 8 == 0) {
        for (; t + 4 <= t1; t += 4) {
          const cache_t* k0 = kb + t * ks2 + hh * ks3;
          __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
          for (int64_t x = 0; x < d; x += 8) {
            const __m256 qv = _mm256_loadu_ps(qj + x);
            a0 = _mm256_fmadd_ps(qv, load8(k0 + x), a0);
            a1 = _mm256_fmadd_ps(qv, load8(k0 + ks2 + x), a1);
            a2 = _mm256_fmadd_ps(qv, load8(k0 + 2 * ks2 + x), a2);
            a3 = _mm256_fmadd_ps(qv, load8(k0 + 3 * ks2 + x), a3);
          }
          const __m256 h = _mm256_hadd_ps(_mm256_hadd_ps(a0, a1), _mm256_hadd_ps(a2, a3));
          alignas(16) float sums[4];
          _mm_store_ps(sums, _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1)));
          for (int u = 0; u < 4; ++u) scores[j * bs + t + u] = sums[u];
        }
      }
#endif
      for (; t < t1; ++t) scores[j * bs + t] = dot(qj, kb + t * ks2 + hh * ks3, d);
    }
  }
}

// acc[j * d + x] += sum over the block's keys t of p[j * bs + t] * v_t[x]. AVX2 with d % 32 == 0:
// 32 outputs of one head held in registers across the block.
template <typename cache_t>
void block_values(float* acc, const float* p, int64_t bs, const cache_t* vb, int64_t ks2, int64_t ks3, int64_t t0,
                  int64_t t1, int64_t part_heads, int64_t groups, int64_t d, const NextBlock& next) {
#ifdef TANDEM_AVX512
  if (d % 16 == 0) {
    for_head_runs(part_heads, groups, next, [&](auto heads, int64_t hh, int64_t j0) {
      values_of_heads<decltype(heads)::value>(acc, p, bs, j0, vb + hh * ks3, ks2, t0, t1, d);
    });
    return;
  }
#endif
  for (int64_t hh = 0; hh < part_heads; ++hh) {
    for (int64_t g = 0; g < groups; ++g) {
      const int64_t j = hh * groups + g;
      next.fetch(j, part_heads * groups);
      float* aj = acc + j * d;
#ifdef TANDEM_AVX2
      if (d % 32 == 0) {
        for (int64_t x0 = 0; x0 < d; x0 += 32) {
          __m256 c0 = _mm256_loadu_ps(aj + x0), c1 = _mm256_loadu_ps(aj + x0 + 8);
          __m256 c2 = _mm256_loadu_ps(aj + x0 + 16), c3 = _mm256_loadu_ps(aj + x0 + 24);
          for (int64_t t = t0; t < t1; ++t) {
            const cache_t* v = vb + t * ks2 + hh * ks3 + x0;
            const __m256 pt = _mm256_set1_ps(p[j * bs + t]);
            c0 = _mm256_fmadd_ps(pt, load8(v), c0);
            c1 = _mm256_fmadd_ps(pt, load8(v + 8), c1);
            c2 = _mm256_fmadd_ps(pt, load8(v + 16), c2);
            c3 = _mm256_fmadd_ps(pt, load8(v + 24), c3);
          }
          _mm256_storeu_ps(aj + x0, c0);
          _mm256_storeu_ps(aj + x0 + 8, c1);
          _mm256_storeu_ps(aj + x0 + 16, c2);
          _mm256_storeu_ps(aj + x0 + 24, c3);
        }
        continue;
      }
#endif
      for (int64_t t = t0; t < t1; ++t) axpy(aj, p[j * bs + t], vb + t * ks2 + hh * ks3, d);
    }
  }
}

#ifdef TANDEM_AVX512
#define TANDEM_ATTN_DPBF16 1
#define TANDEM_DPBF16_TARGET __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx512bf16")))

// lane t of the result = the sum of v[t]'s 16 lanes, t < 16 (a transpose folded into the adds)
TANDEM_DPBF16_TARGET inline __m512 sums_of_sixteen(const __m512* v) {
  __m512 w[8], x[4];
  for (int i = 0; i < 8; ++i)  // 128-bit lane k: [v2i: 4k + {0, 2}, v2i+1: .., v2i: 4k + {1, 3}, v2i+1: ..]
    w[i] = _mm512_add_ps(_mm512_unpacklo_ps(v[2 * i], v[2 * i + 1]), _mm512_unpackhi_ps(v[2 * i], v[2 * i + 1]));
  for (int i = 0; i < 4; ++i)  // 128-bit lane k of x[i]: one partial of each of v4i .. v4i+3
    x[i] = _mm512_add_ps(_mm512_shuffle_ps(w[2 * i], w[2 * i + 1], _MM_SHUFFLE(1, 0, 1, 0)),
                         _mm512_shuffle_ps(w[2 * i], w[2 * i + 1], _MM_SHUFFLE(3, 2, 3, 2)));
  const __m512 s01 = _mm512_add_ps(_mm512_shuffle_f32x4(x[0], x[1], _MM_SHUFFLE(1, 0, 1, 0)),
                                   _mm512_shuffle_f32x4(x[0], x[1], _MM_SHUFFLE(3, 2, 3, 2)));
  const __m512 s23 = _mm512_add_ps(_mm512_shuffle_f32x4(x[2], x[3], _MM_SHUFFLE(1, 0, 1, 0)),
                                   _mm512_shuffle_f32x4(x[2], x[3], _MM_SHUFFLE(3, 2, 3, 2)));
  return _mm512_add_ps(_mm512_shuffle_f32x4(s01, s23, _MM_SHUFFLE(2, 0, 2, 0)),
                       _mm512_shuffle_f32x4(s01, s23, _MM_SHUFFLE(3, 1, 3, 1)));
}

// scores[t] = scale * q . k_t for the 16 token slots of one block (k: token 0's key of the head,
// d % 32 == 0), by vdpbf16ps on the bfloat16 values themselves (their products are exact in
// float32); slots outside [t0, t1) get kNoScore (whatever bits the pool holds there)
TANDEM_DPBF16_TARGET inline void block_scores_dpbf16(float* scores, const c10::BFloat16* q, const c10::BFloat16* k,
                                                     int64_t ks2, int64_t t0, int64_t t1, int64_t d, float scale) {
  __m512 a[16];
  for (int t = 0; t < 16; ++t) a[t] = _mm512_setzero_ps();
  for (int64_t x = 0; x < d; x += 32) {
    const __m512bh qv = (__m512bh)_mm512_loadu_si512(q + x);
    for (int t = 0; t < 16; ++t)
      a[t] = _mm512_dpbf16_ps(a[t], qv, (__m512bh)_mm512_loadu_si512(k + t * ks2 + x));
  }
  const __mmask16 live = static_cast<__mmask16>(((1u << t1) - 1u) & ~((1u << t0) - 1u));
  _mm512_storeu_ps(scores, _mm512_mask_mul_ps(_mm512_set1_ps(kNoScore), live, sums_of_sixteen(a), _mm512_set1_ps(scale)));
}

// One work item of decode_dpbf16: query row i's heads h0 * groups .. over its KV, in chunks of
// up to kChunkBlocks blocks: every score of a chunk first (keys of the next block asked for while
// one is scored), then one softmax pass over the chunk per head (the running max and sum move
// once a chunk), then the chunk's values.
constexpr int64_t kChunkBlocks = 8;
constexpr int64_t kKeysAhead = 2;  // blocks; one ahead left the core waiting on each row's keys

// The blocks of the work item its thread takes next, asked for a share at each step of the
// current item (a query head's scores of a block, a KV head's values of a block), into L2. A row's
// own requests look only a block or two ahead: without these, each row began by waiting on its
// first blocks, and memory sat idle during the values, which ask for nothing.
struct ItemAhead {
  std::vector<NextBlock> blocks;  // the next item's keys, block by block (its values v_offset on)
  int64_t v_offset = 0;
  int64_t steps = 1, step = 0;

  // the next share: the tokens of units [step * U / steps, (step + 1) * U / steps), a unit being
  // one token's keys or values of one block (U = blocks * 2 * 16)
  [[gnu::always_inline]] inline void fetch_next() {
    const int64_t units = static_cast<int64_t>(blocks.size()) * 32;
    const int64_t u1 = std::min(units, (step + 1) * units / steps);
    for (int64_t u = step * units / steps; u < u1; ++u) {
      const NextBlock& b = blocks[u / 32];
      const int64_t t = u % 16;
      if (t >= b.tokens) continue;
      const char* row = b.base + ((u / 16) % 2) * v_offset + t * b.token_stride;
      for (int64_t off = 0; off < b.token_bytes; off += 64) NextBlock::prefetch_line(row + off);
    }
    ++step;
  }
};

TANDEM_DPBF16_TARGET void row_dpbf16(const c10::BFloat16* q, int64_t qs1, c10::BFloat16* o, int64_t os1,
                                     const c10::BFloat16* kvp, const int64_t* table, int64_t len, int64_t first,
                                     int64_t bs, int64_t ks0, int64_t ks1, int64_t ks2, int64_t ks3, int64_t part_heads,
                                     int64_t groups, int64_t d, float scale, float* acc, float* scores, float* m,
                                     float* l, ItemAhead& ahead) {
  const int64_t nq = part_heads * groups, cw = kChunkBlocks * 16;  // cw: a head's row of chunk scores
  std::fill(acc, acc + nq * d, 0.f);
  std::fill(m, m + nq, kNoScore);
  std::fill(l, l + nq, 0.f);
  const int64_t last_block = len > 0 ? (len - 1) / bs : -1;  // no keys: a zero output
  // the keys of block b, to be asked for kKeysAhead blocks before they are scored
  const auto keys_of = [&](int64_t b) {
    return b <= last_block ? NextBlock{reinterpret_cast<const char*>(kvp + table[b] * ks0), ks2 * 2,
                                       part_heads * ks3 * 2, std::min(bs, len - b * bs)}
                           : NextBlock{};
  };
  for (int64_t b = first / bs + 1; b < first / bs + kKeysAhead; ++b) keys_of(b).fetch(0, 1);
  ahead.step = 0;
  ahead.steps = std::max<int64_t>(1, (last_block - first / bs + 1) * (nq + part_heads));
  for (int64_t c0 = first / bs; c0 <= last_block; c0 += kChunkBlocks) {
    const int64_t c1 = std::min(last_block + 1, c0 + kChunkBlocks);
    for (int64_t b = c0; b < c1; ++b) {
      const int64_t t0 = std::max(b * bs, first) - b * bs, t1 = std::min(bs, len - b * bs);
      const c10::BFloat16* kb = kvp + table[b] * ks0;
      // while it is scored: this block's values and the keys kKeysAhead blocks on
      const NextBlock next_v{reinterpret_cast<const char*>(kb + ks1), ks2 * 2, part_heads * ks3 * 2, t1};
      const NextBlock next_k = keys_of(b + kKeysAhead);
      for (int64_t j = 0; j < nq; ++j) {
        next_v.fetch(j, nq);
        next_k.fetch(j, nq);
        ahead.fetch_next();
        block_scores_dpbf16(scores + j * cw + (b - c0) * 16, q + j * qs1, kb + (j / groups) * ks3, ks2, t0, t1, d,
                            scale);
      }
    }
    const int64_t n = (c1 - c0) * 16;
    for (int64_t j = 0; j < nq; ++j) {
      float* sj = scores + j * cw;
      __m512 mx = _mm512_set1_ps(kNoScore);
      for (int64_t t = 0; t < n; t += 16) mx = _mm512_max_ps(mx, _mm512_loadu_ps(sj + t));
      const float m_new = std::max(m[j], _mm512_reduce_max_ps(mx));
      const float keep = std::exp(m[j] - m_new);  // 0 before the first chunk
      m[j] = m_new;
      // the weights, inline (vec_exp.h; a call into libm's vector exp per 16 cost more than its work)
      const __m512 mv = _mm512_set1_ps(m_new);
      __m512 sums = _mm512_setzero_ps();
      for (int64_t t = 0; t < n; t += 16) {
        const __m512 e = tandem_cpu::exp16(_mm512_sub_ps(_mm512_loadu_ps(sj + t), mv));
        _mm512_storeu_ps(sj + t, e);
        sums = _mm512_add_ps(sums, e);
      }
      const float sum = _mm512_reduce_add_ps(sums);
      l[j] = l[j] * keep + sum;
      if (keep != 1.f) {
        float* a = acc + j * d;
#pragma omp simd
        for (int64_t x = 0; x < d; ++x) a[x] *= keep;
      }
    }
    for (int64_t b = c0; b < c1; ++b) {
      const int64_t t0 = std::max(b * bs, first) - b * bs, t1 = std::min(bs, len - b * bs);
      const c10::BFloat16* vb = kvp + table[b] * ks0 + ks1;
      const float* pb = scores + (b - c0) * 16;
      for (int64_t hh = 0; hh < part_heads; ++hh) {
        ahead.fetch_next();
        for (int64_t g0 = 0; g0 < groups; g0 += 4) {
          const int64_t j0 = hh * groups + g0, g = std::min<int64_t>(4, groups - g0);
          const c10::BFloat16* v = vb + hh * ks3;
          switch (g) {
            case 1: values_of_heads<1>(acc, pb, cw, j0, v, ks2, t0, t1, d); break;
            case 2: values_of_heads<2>(acc, pb, cw, j0, v, ks2, t0, t1, d); break;
            case 3: values_of_heads<3>(acc, pb, cw, j0, v, ks2, t0, t1, d); break;
            default: values_of_heads<4>(acc, pb, cw, j0, v, ks2, t0, t1, d); break;
          }
        }
      }
    }
  }
  for (int64_t j = 0; j < nq; ++j) {
    const __m512 inv = _mm512_set1_ps(l[j] > 0.f ? 1.f / l[j] : 0.f);
    for (int64_t x = 0; x < d; x += 16)  // d % 32 == 0
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(o + j * os1 + x),
                          tandem_cpu::round_to_bf16(_mm512_mul_ps(_mm512_loadu_ps(acc + j * d + x), inv)));
  }
}
#endif

template <typename scalar_t, typename cache_t>
void decode(at::Tensor& out, const at::Tensor& q, const at::Tensor& kv, const at::Tensor& rows,
            const at::Tensor& tables, const c10::optional<at::Tensor>& row_tables, const at::Tensor& seq_lens,
            double scale, int64_t window) {
  const int64_t n_rows = rows.size(0), heads = q.size(1), d = q.size(2);
  const int64_t bs = kv.size(2), kv_heads = kv.size(3), groups = heads / kv_heads;
  const int64_t max_blocks = tables.size(1);
  const int64_t qs0 = q.stride(0), qs1 = q.stride(1), os0 = out.stride(0), os1 = out.stride(1);
  const int64_t ks0 = kv.stride(0), ks1 = kv.stride(1), ks2 = kv.stride(2), ks3 = kv.stride(3);
  const scalar_t* qp = q.data_ptr<scalar_t>();
  scalar_t* op = out.data_ptr<scalar_t>();
  const cache_t* kvp = kv.data_ptr<cache_t>();
  const int64_t* rp = rows.data_ptr<int64_t>();
  const int64_t* tables_p = tables.data_ptr<int64_t>();
  const int64_t* trp = row_tables.has_value() ? row_tables->data_ptr<int64_t>() : nullptr;
  const auto table_of = [&](int64_t i) { return tables_p + (trp != nullptr ? trp[i] : i) * max_blocks; };
  const int64_t* lp = seq_lens.data_ptr<int64_t>();
  const float fscale = static_cast<float>(scale);
  // Few rows: split each row's KV heads over the threads too; many: a row per work item, so that
  // each block is read front to back (every head of a token is one contiguous run).
  const int64_t head_parts = n_rows >= 4 * at::get_num_threads() ? 1 : kv_heads;
  const int64_t part_heads = kv_heads / head_parts;

#ifdef TANDEM_ATTN_DPBF16
  if constexpr (std::is_same_v<scalar_t, at::BFloat16> && std::is_same_v<cache_t, at::BFloat16>) {
    if (d % 32 == 0 && bs == 16 && dpbf16_supported()) {
      // a prompt's runs of rows as tile products where it can (prefill_tiles.cpp), the rest here
      const std::vector<int64_t> left = prefill_rows_tiled(op, os0, os1, qp, qs0, qs1, kvp, ks0, ks1, ks2, ks3, rp,
                                                           lp, trp, tables_p, max_blocks, n_rows, kv_heads, groups, d,
                                                           fscale, window);
      const int64_t total = static_cast<int64_t>(left.size()) * head_parts;
      // Many rows, each its own sequence's (a decode step; a row a work item): each thread takes a
      // contiguous share of them, so that the item after the current one is most likely its own
      // next, and asks for that one's blocks (ItemAhead). Few rows (a row's KV heads split over
      // the threads) measured no faster with it; rows that share a table (a prompt's) read the
      // same blocks from cache, and keep the one counter that evens out their lengths.
      const bool rows_ahead = head_parts == 1 && trp == nullptr;
      const auto run = [&](int64_t begin, int64_t end) {
        const int64_t nq = part_heads * groups;
        std::vector<float> acc(nq * d), scores(nq * kChunkBlocks * 16), m(nq), l(nq);
        ItemAhead ahead;
        ahead.v_offset = ks1 * 2;
        for (int64_t work = begin; work < end; ++work) {
          const int64_t i = left[work / head_parts];
          const int64_t h0 = (work % head_parts) * part_heads;
          const int64_t row = rp[i], len = lp[i];
          const int64_t first = window > 0 ? std::max<int64_t>(0, len - window) : 0;
          ahead.blocks.clear();
          if (rows_ahead && work + 1 < total) {
            const int64_t next = left[work + 1], next_len = lp[next];
            const int64_t* next_table = table_of(next);
            for (int64_t b = (window > 0 ? std::max<int64_t>(0, next_len - window) : 0) / bs; b * bs < next_len; ++b)
              ahead.blocks.push_back({reinterpret_cast<const char*>(kvp + next_table[b] * ks0), ks2 * 2,
                                      kv_heads * ks3 * 2, std::min(bs, next_len - b * bs)});
          }
          row_dpbf16(qp + row * qs0 + h0 * groups * qs1, qs1, op + row * os0 + h0 * groups * os1, os1,
                     kvp + h0 * ks3, table_of(i), len, first, bs, ks0, ks1, ks2, ks3, part_heads, groups, d,
                     fscale, acc.data(), scores.data(), m.data(), l.data(), ahead);
        }
      };
      if (rows_ahead) {
        tandem_cpu::for_each_share(total, tandem_cpu::chunk_for(total, 4), run);
      } else {
        tandem_cpu::for_each_chunk(total, 1, run);
      }
      return;
    }
  }
#endif
  tandem_cpu::for_each_chunk(n_rows * head_parts, 1, [&](int64_t begin, int64_t end) {
    const int64_t nq = part_heads * groups;  // query heads of one work item
    std::vector<float> qf(nq * d), acc(nq * d), scores(nq * bs), m(nq), l(nq);
    for (int64_t work = begin; work < end; ++work) {
      const int64_t i = work / head_parts, h0 = (work % head_parts) * part_heads;
      const int64_t row = rp[i], len = lp[i];
      const int64_t* tp = table_of(i);
      const int64_t first = window > 0 ? std::max<int64_t>(0, len - window) : 0;
      for (int64_t j = 0; j < nq; ++j) {
        const scalar_t* src = qp + row * qs0 + (h0 * groups + j) * qs1;
        for (int64_t x = 0; x < d; ++x) qf[j * d + x] = static_cast<float>(src[x]) * fscale;
      }
      std::fill(acc.begin(), acc.end(), 0.f);
      std::fill(m.begin(), m.end(), kNoScore);
      std::fill(l.begin(), l.end(), 0.f);
      for (int64_t b = first / bs; b * bs < len; ++b) {
        const int64_t t0 = std::max(b * bs, first) - b * bs, t1 = std::min(bs, len - b * bs);
        const cache_t* kb = kvp + tp[b] * ks0 + h0 * ks3;
        const cache_t* vb = kb + ks1;
        // the next block's keys come in during this block's scores, its values during its values
        NextBlock next_k, next_v;
        if ((b + 1) * bs < len) {
          next_k = {reinterpret_cast<const char*>(kvp + tp[b + 1] * ks0 + h0 * ks3),
                    ks2 * static_cast<int64_t>(sizeof(cache_t)), part_heads * ks3 * static_cast<int64_t>(sizeof(cache_t)),
                    std::min(bs, len - (b + 1) * bs)};
          next_v = next_k;
          next_v.base += ks1 * static_cast<int64_t>(sizeof(cache_t));
        }
        block_scores(scores.data(), bs, qf.data(), kb, ks2, ks3, t0, t1, part_heads, groups, d, next_k);
        // per query head, over the block's keys (contiguous: whole vectors for exp, max, sum)
        for (int64_t j = 0; j < nq; ++j) {
          float* sj = scores.data() + j * bs;
          float block_max = kNoScore;
#pragma omp simd reduction(max : block_max)
          for (int64_t t = t0; t < t1; ++t) block_max = std::max(block_max, sj[t]);
          const float m_new = std::max(m[j], block_max);
          const float keep = std::exp(m[j] - m_new);  // 0 before the first block
          m[j] = m_new;
          float sum = 0.f;
#ifdef TANDEM_AVX512
          if (bs == 16) {  // the block's slots t0..t1-1 in one vector, exp inline (vec_exp.h)
            const __mmask16 live = static_cast<__mmask16>(((1u << t1) - 1u) & ~((1u << t0) - 1u));
            const __m512 e = tandem_cpu::exp16(_mm512_sub_ps(_mm512_maskz_loadu_ps(live, sj), _mm512_set1_ps(m_new)));
            _mm512_mask_storeu_ps(sj, live, e);
            sum = _mm512_mask_reduce_add_ps(live, e);
          } else
#endif
          {
#pragma omp simd reduction(+ : sum)
            for (int64_t t = t0; t < t1; ++t) {
              sj[t] = std::exp(sj[t] - m_new);
              sum += sj[t];
            }
          }
          l[j] = l[j] * keep + sum;
          if (keep != 1.f) {  // the running max moved: rescale what was summed so far
            float* a = acc.data() + j * d;
#pragma omp simd
            for (int64_t x = 0; x < d; ++x) a[x] *= keep;
          }
        }
        block_values(acc.data(), scores.data(), bs, vb, ks2, ks3, t0, t1, part_heads, groups, d, next_v);
      }
      for (int64_t j = 0; j < nq; ++j) {
        scalar_t* dst = op + row * os0 + (h0 * groups + j) * os1;
        const float inv = l[j] > 0.f ? 1.f / l[j] : 0.f;
        for (int64_t x = 0; x < d; ++x) dst[x] = static_cast<scalar_t>(acc[j * d + x] * inv);
      }
    }
  });
}

template <typename scalar_t>
void dispatch_cache(at::Tensor& out, const at::Tensor& q, const at::Tensor& kv, const at::Tensor& rows,
                    const at::Tensor& tables, const c10::optional<at::Tensor>& row_tables, const at::Tensor& seq_lens,
                    double scale, int64_t window) {
  switch (kv.scalar_type()) {
    case at::kFloat: return decode<scalar_t, float>(out, q, kv, rows, tables, row_tables, seq_lens, scale, window);
    case at::kBFloat16:
      return decode<scalar_t, at::BFloat16>(out, q, kv, rows, tables, row_tables, seq_lens, scale, window);
    case at::kHalf: return decode<scalar_t, at::Half>(out, q, kv, rows, tables, row_tables, seq_lens, scale, window);
    default: TORCH_CHECK(false, "paged_decode: unsupported KV dtype ", kv.scalar_type());
  }
}

}  // namespace

// row_tables as paged_decode takes it, checked against n_rows query rows and n_tables table rows
// (without it, there must be one table row per query row); undefined becomes nullopt
c10::optional<at::Tensor> checked_row_tables(const c10::optional<at::Tensor>& row_tables, int64_t n_rows,
                                             int64_t n_tables) {
  if (!row_tables.has_value() || !row_tables->defined()) {
    TORCH_CHECK(n_tables == n_rows, "paged_decode: without row_tables, one table row per query row");
    return c10::nullopt;
  }
  const at::Tensor& t = *row_tables;
  TORCH_CHECK(t.scalar_type() == at::kLong && t.is_contiguous() && t.dim() == 1 && t.size(0) == n_rows,
              "paged_decode: row_tables must be contiguous int64 [N], one per query row");
  const int64_t* v = t.data_ptr<int64_t>();
  for (int64_t i = 0; i < n_rows; ++i)
    TORCH_CHECK(v[i] >= 0 && v[i] < n_tables, "paged_decode: row_tables[", i, "] = ", v[i], " names no row of tables (",
                n_tables, " rows)");
  return t;
}

void paged_decode(at::Tensor& out, const at::Tensor& q, const at::Tensor& kv, const at::Tensor& rows,
                  const at::Tensor& tables, const at::Tensor& seq_lens, double scale, int64_t window,
                  const c10::optional<at::Tensor>& row_tables_in) {
  TORCH_CHECK(q.device().is_cpu() && kv.device().is_cpu(), "paged_decode runs on the CPU");
  TORCH_CHECK(q.dim() == 3 && out.sizes() == q.sizes() && out.scalar_type() == q.scalar_type(),
              "paged_decode: q and out must be [T, H, D] of one dtype");
  TORCH_CHECK(kv.dim() == 5 && kv.size(1) == 2 && kv.size(4) == q.size(2), "paged_decode: kv must be [blocks, 2, bs, Hkv, D]");
  TORCH_CHECK(q.stride(2) == 1 && out.stride(2) == 1 && kv.stride(4) == 1, "paged_decode: the head dimension must be contiguous");
  TORCH_CHECK(q.size(1) % kv.size(3) == 0, "paged_decode: query heads must be a multiple of KV heads");
  TORCH_CHECK(rows.scalar_type() == at::kLong && tables.scalar_type() == at::kLong && seq_lens.scalar_type() == at::kLong,
              "paged_decode: rows, tables and seq_lens must be int64");
  TORCH_CHECK(rows.is_contiguous() && tables.is_contiguous() && seq_lens.is_contiguous(), "paged_decode: index tensors must be contiguous");
  TORCH_CHECK(tables.dim() == 2 && seq_lens.size(0) == rows.size(0), "paged_decode: tables must be 2-d, one seq_len per query row");
  const c10::optional<at::Tensor> row_tables = checked_row_tables(row_tables_in, rows.size(0), tables.size(0));
  switch (q.scalar_type()) {
    case at::kFloat: return dispatch_cache<float>(out, q, kv, rows, tables, row_tables, seq_lens, scale, window);
    case at::kBFloat16:
      return dispatch_cache<at::BFloat16>(out, q, kv, rows, tables, row_tables, seq_lens, scale, window);
    case at::kHalf: return dispatch_cache<at::Half>(out, q, kv, rows, tables, row_tables, seq_lens, scale, window);
    default: TORCH_CHECK(false, "paged_decode: unsupported query dtype ", q.scalar_type());
  }
}

TORCH_LIBRARY(tandem_cpu, m) {
  m.def("paged_decode(Tensor(a!) out, Tensor q, Tensor kv, Tensor rows, Tensor tables, Tensor seq_lens, "
        "float scale, int window, Tensor? row_tables=None) -> ()");
  m.def("use_prefill_amx(bool on) -> bool", &use_prefill_amx);
}

TORCH_LIBRARY_IMPL(tandem_cpu, CPU, m) { m.impl("paged_decode", &paged_decode); }
