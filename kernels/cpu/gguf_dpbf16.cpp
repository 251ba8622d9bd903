// GGUF linear layers with bfloat16 activations on CPUs with AVX512-BF16: y = x @ W.T with W read
// from its ggml blocks (gguf_matmul.cpp has the block layouts), every 32 weights turned into
// bfloat16 in registers and multiplied by vdpbf16ps, never written out.
//
// Every type with a kernel here is a run of 32-value groups, each w[j] = d * q[j] + m with small
// integer q[j] and one d and m a group (Q6_K: a d per 16 values). q[j] is exact in bfloat16, so
//
//   sum_j w[j] x[j] = d * sum_j q[j] x[j] + m * sum_j x[j]
//
// where the first sum is vdpbf16ps's exact products of bfloat16 values added in float32 and the
// second a float32 sum of x's group taken once a call. Small q become bfloat16 by a table lookup
// (vpermw, or vpermt2w for Q6_K's 64 values) that also applies the type's offset (Q4_0: q - 8);
// Q8_0's signed bytes go through float32. Types: Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q5_K, Q6_K.
// The 16-byte nibble runs of Q4_0 .. Q5_1 come out in a "spread" order that costs no shuffle
// (nibbles_spread), and x is put in that order once a call; the sums of products do not care.
//
// Loop nest: threads take contiguous shares of output rows (in the weight's order, as the decode
// loop's helpers warm it); a share goes in groups of 16 output rows; a group's rows in tiles of
// up to 4 rows of x by 4 output rows whose 16 sums stay in registers over all of K. The half-float
// scales of 4 output rows go to float32 arrays first, once for all rows of x (a gather of 16
// blocks' heads at a time), so that the main loop takes d as a broadcast from memory and keeps
// the shuffle port for the lookups. For up to kMaxRows rows of x (decode): each block is turned into bfloat16 once per 4
// rows, which beats gguf_matmul.cpp's widening to float32 only while the rows are few. The
// AVX512-BF16 code is compiled for that ISA alone (a target attribute) and runs only where
// dpbf16_supported() (linear_dpbf16.cpp).
//
// For 1 to 3 rows of x (a decode step at low concurrency), linear_int8 takes x in 15-bit fixed
// point and multiplies bytes by AVX512-VNNI's vpdpbusd instead (its own comment says how, and how
// close to x it stays); it needs AVX512-VNNI, not AVX512-BF16.
#include "gguf_blocks.h"
#include "work_queue.h"

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstring>
#include <vector>

bool dpbf16_supported();

#if defined(__x86_64__) && defined(__GNUC__)
#include <immintrin.h>
#define TANDEM_GGUF_DPBF16 1
#define TANDEM_GGUF_TARGET __attribute__((target("avx512f,avx512bw,avx512vl,avx512bf16,f16c,bmi2")))
// the int8 kernel (linear_int8) and what it shares with the bfloat16 one: no bfloat16 instructions
#define TANDEM_GGUF_BASE __attribute__((target("avx512f,avx512bw,avx512vl,f16c,bmi2")))
#define TANDEM_GGUF_VNNI __attribute__((target("avx512f,avx512bw,avx512vl,avx512vnni,fma,f16c,bmi2")))
#endif

namespace {

std::atomic<bool> g_int8{true};  // use_gguf_int8

#ifdef TANDEM_GGUF_DPBF16

constexpr int kRows = 4;    // rows of x a tile
constexpr int kCols = 4;    // output rows a tile
constexpr int64_t kGroup = 16;  // output rows a group
constexpr int64_t kMaxRows = 12;  // rows of x taken here (gguf_linear_few_rows)
constexpr int64_t kInt8Rows = 3;  // rows of x taken by linear_int8 (measured: from 4 the bfloat16 kernel)

TANDEM_GGUF_BASE inline float half_at(const uint8_t* p) {
  uint16_t bits;
  std::memcpy(&bits, p, 2);
  return _cvtsh_ss(bits);
}

// bfloat16 bits of float v (v exactly representable)
constexpr uint16_t bf16_bits(int v) {
  // small integers: exact; built by hand so the table is a constant
  if (v == 0) return 0;
  const uint16_t sign = v < 0 ? 0x8000 : 0;
  int a = v < 0 ? -v : v, e = 0;
  while ((a >> e) > 1) ++e;
  const int mantissa = (a << (7 - e)) & 0x7F;  // a < 256: 7 mantissa bits hold it exactly
  return static_cast<uint16_t>(sign | ((127 + e) << 7) | mantissa);
}

// 32 words: bfloat16 of (i + offset) for i < 32, built at compile time
// (period 16: bfloat16 of (i % 16 + offset), for 4-bit indices whose 5th bit is left over)
template <int offset, int period>
struct Table32 {
  alignas(64) uint16_t bits[32];
  constexpr Table32() : bits() {
    for (int i = 0; i < 32; ++i) bits[i] = bf16_bits(i % period + offset);
  }
};
template <int offset, int period>
constexpr Table32<offset, period> kTable{};

template <int offset, int period = 32>
TANDEM_GGUF_TARGET inline __m512i table32() {
  return _mm512_load_si512(kTable<offset, period>.bits);
}

// 32 group values (words, each < 32) as bfloat16 through `table`
TANDEM_GGUF_TARGET inline __m512i lookup(__m512i q, __m512i table) { return _mm512_permutexvar_epi16(q, table); }

// The 32 values of a 16-byte run of nibbles (value j < 16: low nibble of byte j; j >= 16: high
// nibble of byte j - 16) as 32 words in "spread" order: the bytes in each 128-bit lane (a load
// that broadcasts, no shuffle) shifted by 0, 4, 8, 12 bits, so that word 8L + p holds in its low
// 4 bits value 2p (L = 0), 16 + 2p (L = 1), 2p + 1 (L = 2), 17 + 2p (L = 3), garbage above.
// x is put in the same order once a call (spread_x).
TANDEM_GGUF_TARGET inline __m512i nibbles_spread(const uint8_t* qs) {
  const __m512i bytes = _mm512_broadcast_i32x4(_mm_loadu_si128(reinterpret_cast<const __m128i*>(qs)));
  return _mm512_srlv_epi16(bytes, _mm512_set_epi64(0x000C000C000C000CLL, 0x000C000C000C000CLL, 0x0008000800080008LL,
                                                   0x0008000800080008LL, 0x0004000400040004LL, 0x0004000400040004LL,
                                                   0, 0));
}

// where in a 32-group value j sits in spread order
constexpr int spread_position(int j) {
  return j < 16 ? (j % 2 == 0 ? j / 2 : 16 + j / 2) : (j % 2 == 0 ? 8 + (j - 16) / 2 : 24 + (j - 16) / 2);
}

// bit spread_position(j) = bit j of qh
TANDEM_GGUF_TARGET inline uint32_t spread_bits(uint32_t qh) {
  return _pext_u32(qh, 0x5555u) | _pext_u32(qh, 0x55550000u) << 8 | _pext_u32(qh, 0xAAAAu) << 16 |
         _pext_u32(qh, 0xAAAA0000u) << 24;
}

// 32 bytes, the nibble at `shift` (0 or 4) of each -> 32 words
TANDEM_GGUF_TARGET inline __m512i nibbles32(const uint8_t* qs, int shift) {
  const __m256i bytes = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(qs));
  return _mm512_cvtepu8_epi16(_mm256_and_si256(_mm256_srl_epi16(bytes, _mm_cvtsi32_si128(shift)), _mm256_set1_epi8(15)));
}

struct Tables {
  __m512i plain, plain16, minus8_16, minus16, minus32;
  TANDEM_GGUF_TARGET Tables()
      : plain(table32<0>()), plain16(table32<0, 16>()), minus8_16(table32<-8, 16>()), minus16(table32<-16>()),
        minus32(table32<-32>()) {}
};


// linear_int8's view of a 32-value group: its values as 32 unsigned bytes u in natural order
// (value j in byte j), w[j] = d * (u[j] - offset) + m (as_u8 below).
// 16 bytes of nibbles: value j < 16 the low nibble of byte j, value j >= 16 the high one of j - 16
TANDEM_GGUF_BASE inline __m256i nibble_bytes(const uint8_t* qs) {
  const __m256i both = _mm256_broadcastsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(qs)));
  return _mm256_and_si256(_mm256_srlv_epi64(both, _mm256_set_epi64x(4, 4, 0, 0)), _mm256_set1_epi8(15));
}
// 32 bytes, the nibble at `shift` (0 or 4) of each
TANDEM_GGUF_BASE inline __m256i nibble_bytes32(const uint8_t* qs, int shift) {
  const __m256i bytes = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(qs));
  return _mm256_and_si256(_mm256_srl_epi16(bytes, _mm_cvtsi32_si128(shift)), _mm256_set1_epi8(15));
}
// 16 added to byte j where bit j of the 4 bytes at qh is set
TANDEM_GGUF_BASE inline __m256i fifth_bit(__m256i u, const uint8_t* qh_bytes) {
  uint32_t qh;
  std::memcpy(&qh, qh_bytes, 4);
  return _mm256_mask_add_epi8(u, static_cast<__mmask32>(qh), u, _mm256_set1_epi8(16));
}


// A block type: `groups` 32-value groups a block; values(b, s) the q of group s as 32 bfloat16
// words (in spread order where `spread`); scales(b, s, d, m) its d (d[0] for values 0-15, d[1]
// for 16-31) and m. `has_m`: some m is not 0; `two_d`: d[0] and d[1] differ. For linear_int8:
// as_u8(b, s) the same values as unsigned bytes u, q = u - offset; the K-quants' group_scales(b,
// d, m) the d of every group (Q6_K: of every 16 values) and its m, as float32.
struct Q4_0 {
  static constexpr int64_t elems = 32, bytes = 18;
  static constexpr bool has_m = false, spread = true, two_d = false;
  static constexpr int offset = 8;
  TANDEM_GGUF_BASE static __m256i as_u8(const uint8_t* b, int) { return nibble_bytes(b + 2); }
  TANDEM_GGUF_TARGET static __m512i values(const uint8_t* b, int, const Tables& t) {
    return lookup(nibbles_spread(b + 2), t.minus8_16);
  }
  TANDEM_GGUF_TARGET static void scales(const uint8_t* b, int, float* d, float* m) { *d = half_at(b), *m = 0.0f; }
};
struct Q4_1 {
  static constexpr int64_t elems = 32, bytes = 20;
  static constexpr bool has_m = true, spread = true, two_d = false;
  static constexpr int offset = 0;
  TANDEM_GGUF_BASE static __m256i as_u8(const uint8_t* b, int) { return nibble_bytes(b + 4); }
  TANDEM_GGUF_TARGET static __m512i values(const uint8_t* b, int, const Tables& t) {
    return lookup(nibbles_spread(b + 4), t.plain16);
  }
  TANDEM_GGUF_TARGET static void scales(const uint8_t* b, int, float* d, float* m) {
    *d = half_at(b), *m = half_at(b + 2);
  }
};
// the 5th bit of value j is bit j of qh: 16 added where it is set
TANDEM_GGUF_TARGET inline __m512i five_bits(const uint8_t* qs, const uint8_t* qh_bytes) {
  uint32_t qh;
  std::memcpy(&qh, qh_bytes, 4);
  const __m512i q = _mm512_and_si512(nibbles_spread(qs), _mm512_set1_epi16(15));
  return _mm512_mask_add_epi16(q, static_cast<__mmask32>(spread_bits(qh)), q, _mm512_set1_epi16(16));
}
struct Q5_0 {
  static constexpr int64_t elems = 32, bytes = 22;
  static constexpr bool has_m = false, spread = true, two_d = false;
  static constexpr int offset = 16;
  TANDEM_GGUF_BASE static __m256i as_u8(const uint8_t* b, int) { return fifth_bit(nibble_bytes(b + 6), b + 2); }
  TANDEM_GGUF_TARGET static __m512i values(const uint8_t* b, int, const Tables& t) {
    return lookup(five_bits(b + 6, b + 2), t.minus16);
  }
  TANDEM_GGUF_TARGET static void scales(const uint8_t* b, int, float* d, float* m) { *d = half_at(b), *m = 0.0f; }
};
struct Q5_1 {
  static constexpr int64_t elems = 32, bytes = 24;
  static constexpr bool has_m = true, spread = true, two_d = false;
  static constexpr int offset = 0;
  TANDEM_GGUF_BASE static __m256i as_u8(const uint8_t* b, int) { return fifth_bit(nibble_bytes(b + 8), b + 4); }
  TANDEM_GGUF_TARGET static __m512i values(const uint8_t* b, int, const Tables& t) {
    return lookup(five_bits(b + 8, b + 4), t.plain);
  }
  TANDEM_GGUF_TARGET static void scales(const uint8_t* b, int, float* d, float* m) {
    *d = half_at(b), *m = half_at(b + 2);
  }
};
struct Q8_0 {
  static constexpr int64_t elems = 32, bytes = 34;
  static constexpr bool has_m = false, spread = false, two_d = false;
  static constexpr int offset = 128;
  TANDEM_GGUF_BASE static __m256i as_u8(const uint8_t* b, int) {  // two's complement plus 128
    return _mm256_xor_si256(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(b + 2)),
                            _mm256_set1_epi8(static_cast<char>(0x80)));
  }
  TANDEM_GGUF_TARGET static __m512i values(const uint8_t* b, int, const Tables&) {
    const __m128i lo = _mm_loadu_si128(reinterpret_cast<const __m128i*>(b + 2));
    const __m128i hi = _mm_loadu_si128(reinterpret_cast<const __m128i*>(b + 18));
    const __m512 flo = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(lo)), fhi = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(hi));
    // vcvtne2ps2bf16 a, b: b's 16 values in the low half, a's in the high half
    return (__m512i)_mm512_cvtne2ps_pbh(fhi, flo);
  }
  TANDEM_GGUF_TARGET static void scales(const uint8_t* b, int, float* d, float* m) { *d = half_at(b), *m = 0.0f; }
};
TANDEM_GGUF_TARGET inline void scales_k4(const uint8_t* b, int s, float* d, float* m) {
  int sc, mn;
  tandem_gguf::scale_min_k4(b + 4, s, sc, mn);
  *d = half_at(b) * static_cast<float>(sc), *m = -half_at(b + 2) * static_cast<float>(mn);
}
// 8 bytes as 8 float32 (a function, not a lambda: a lambda does not take its caller's target)
TANDEM_GGUF_BASE inline __m256 byte_floats(uint64_t bytes) {
  return _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_cvtsi64_si128(static_cast<long long>(bytes))));
}
// the d * sc and -dmin * mn of a Q4_K / Q5_K super-block's 8 groups (scale_min_k4's unpacking,
// the 8 groups at once: bytes 0-3 of the 12 hold sc 0-3 and the top 2 bits of sc 4-7, bytes 4-7 mn
// 0-3 and the top bits of mn 4-7, bytes 8-11 the low 4 bits of sc 4-7 and of mn 4-7)
TANDEM_GGUF_BASE inline void group_scales_k4(const uint8_t* b, float* d, float* m) {
  uint32_t a, bb, c;
  std::memcpy(&a, b + 4, 4), std::memcpy(&bb, b + 8, 4), std::memcpy(&c, b + 12, 4);
  const uint64_t sc = uint64_t{a & 0x3F3F3F3Fu} | uint64_t{(c & 0x0F0F0F0Fu) | ((a >> 2) & 0x30303030u)} << 32;
  const uint64_t mn = uint64_t{bb & 0x3F3F3F3Fu} | uint64_t{((c >> 4) & 0x0F0F0F0Fu) | ((bb >> 2) & 0x30303030u)} << 32;
  _mm256_storeu_ps(d, _mm256_mul_ps(_mm256_set1_ps(half_at(b)), byte_floats(sc)));
  _mm256_storeu_ps(m, _mm256_mul_ps(_mm256_set1_ps(-half_at(b + 2)), byte_floats(mn)));
}
struct Q4_K {
  static constexpr int64_t elems = 256, bytes = 144;
  static constexpr bool has_m = true, spread = false, two_d = false;
  static constexpr int offset = 0;
  TANDEM_GGUF_BASE static __m256i as_u8(const uint8_t* b, int s) {
    return nibble_bytes32(b + 16 + 32 * (s / 2), 4 * (s % 2));
  }
  TANDEM_GGUF_BASE static void group_scales(const uint8_t* b, float* d, float* m) { group_scales_k4(b, d, m); }
  TANDEM_GGUF_TARGET static __m512i values(const uint8_t* b, int s, const Tables& t) {
    return lookup(nibbles32(b + 16 + 32 * (s / 2), 4 * (s % 2)), t.plain);
  }
  TANDEM_GGUF_TARGET static void scales(const uint8_t* b, int s, float* d, float* m) { scales_k4(b, s, d, m); }
};
struct Q5_K {
  static constexpr int64_t elems = 256, bytes = 176;
  static constexpr bool has_m = true, spread = false, two_d = false;
  static constexpr int offset = 0;
  TANDEM_GGUF_BASE static __m256i as_u8(const uint8_t* b, int s) {
    const __m256i u = nibble_bytes32(b + 48 + 32 * (s / 2), 4 * (s % 2));
    const __m256i qh = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b + 16));
    const __mmask32 fifth = _mm256_test_epi8_mask(qh, _mm256_set1_epi8(static_cast<char>(1 << s)));
    return _mm256_mask_add_epi8(u, fifth, u, _mm256_set1_epi8(16));
  }
  TANDEM_GGUF_BASE static void group_scales(const uint8_t* b, float* d, float* m) { group_scales_k4(b, d, m); }
  TANDEM_GGUF_TARGET static __m512i values(const uint8_t* b, int s, const Tables& t) {
    const __m512i q = nibbles32(b + 48 + 32 * (s / 2), 4 * (s % 2));
    const __m256i qh = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b + 16));
    const __mmask32 fifth = _mm256_test_epi8_mask(qh, _mm256_set1_epi8(static_cast<char>(1 << s)));
    return lookup(_mm512_mask_add_epi16(q, fifth, q, _mm512_set1_epi16(16)), t.plain);
  }
  TANDEM_GGUF_TARGET static void scales(const uint8_t* b, int s, float* d, float* m) { scales_k4(b, s, d, m); }
};
// group s = 4h + t holds values 128h + 32t + l: 4 bits from ql, 2 from qh, a scale a 16 values
struct Q6_K {
  static constexpr int64_t elems = 256, bytes = 210;
  static constexpr bool has_m = false, spread = false, two_d = true;
  static constexpr int offset = 32;
  TANDEM_GGUF_BASE static __m256i as_u8(const uint8_t* b, int s) {
    const int h = s / 4, tt = s % 4;
    const __m256i lo = nibble_bytes32(b + 64 * h + 32 * (tt % 2), 4 * (tt / 2));
    const __m256i qh = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b + 128 + 32 * h));
    const __m256i two = _mm256_and_si256(_mm256_srl_epi16(qh, _mm_cvtsi32_si128(2 * tt)), _mm256_set1_epi8(3));
    return _mm256_or_si256(lo, _mm256_slli_epi16(two, 4));  // 0 .. 63: no bit crosses into the next byte
  }
  // d of values 16i .. 16i + 15 (group s: 2s and 2s + 1)
  TANDEM_GGUF_BASE static void group_scales(const uint8_t* b, float* d, float*) {
    const __m512i sc = _mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(b + 192)));
    _mm512_storeu_ps(d, _mm512_mul_ps(_mm512_set1_ps(half_at(b + 208)), _mm512_cvtepi32_ps(sc)));
  }
  TANDEM_GGUF_TARGET static __m512i values(const uint8_t* b, int s, const Tables& t) {
    const int h = s / 4, tt = s % 4;
    const __m512i lo = nibbles32(b + 64 * h + 32 * (tt % 2), 4 * (tt / 2));
    const __m256i qh = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b + 128 + 32 * h));
    const __m256i two = _mm256_and_si256(_mm256_srl_epi16(qh, _mm_cvtsi32_si128(2 * tt)), _mm256_set1_epi8(3));
    const __m512i q = _mm512_or_si512(lo, _mm512_slli_epi16(_mm512_cvtepu8_epi16(two), 4));  // 0 .. 63
    return _mm512_permutex2var_epi16(t.minus32, q, t.plain);  // q - 32: q < 32 from the first table
  }
  TANDEM_GGUF_TARGET static void scales(const uint8_t* b, int s, float* d, float* m) {
    const int8_t* sc = reinterpret_cast<const int8_t*>(b + 192) + 8 * (s / 4) + 2 * (s % 4);
    const float base = half_at(b + 208);
    d[0] = base * static_cast<float>(sc[0]), d[1] = base * static_cast<float>(sc[1]), *m = 0.0f;
  }
};

// d[g] (d[2g], d[2g + 1] where two_d) and m[g] for the groups of a row of `blocks` blocks. The
// 32-value types keep d (and m) as the block's first half floats: 16 blocks' first four bytes
// come in one gather and convert together.
template <typename B>
TANDEM_GGUF_TARGET void scales_row(const uint8_t* row, int64_t blocks, float* d, float* m) {
  if constexpr (B::elems == 32 && !B::two_d) {
    const __m512i offsets = _mm512_mullo_epi32(_mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0),
                                               _mm512_set1_epi32(static_cast<int>(B::bytes)));
    for (int64_t kb = 0; kb < blocks; kb += 16) {
      const __mmask16 live = blocks - kb >= 16 ? __mmask16(0xFFFF) : __mmask16((1u << (blocks - kb)) - 1);
      const __m512i heads = _mm512_mask_i32gather_epi32(_mm512_setzero_si512(), live, offsets, row + kb * B::bytes, 1);
      _mm512_mask_storeu_ps(d + kb, live, _mm512_cvtph_ps(_mm512_cvtepi32_epi16(heads)));
      if (B::has_m) _mm512_mask_storeu_ps(m + kb, live, _mm512_cvtph_ps(_mm512_cvtepi32_epi16(_mm512_srli_epi32(heads, 16))));
    }
  } else {
    constexpr int per_block = static_cast<int>(B::elems / 32), nd = B::two_d ? 2 : 1;
    for (int64_t kb = 0; kb < blocks; ++kb) {
      for (int s = 0; s < per_block; ++s) {
        const int64_t g = kb * per_block + s;
        B::scales(row + kb * B::bytes, s, d + g * nd, m + g);
      }
    }
  }
}

// out[r * ldo + c] = x[r] . w[c] for r < rows, c < cols: x rows bfloat16 (ldx apart, spread
// where the type is), sums[r] the float32 sums of x[r]'s 32-value groups (types with m), dq and
// mq the output rows' scales_row (K / 32 * nd and K / 32 apart): the main loop's FMAs take d as
// a broadcast from memory; m's part is a dot product after it.
template <typename B, int rows, int cols>
TANDEM_GGUF_TARGET void tile(const uint16_t* x, int64_t ldx, const float* sums, int64_t lds, const uint8_t* w,
                             int64_t row_bytes, int64_t k_size, float* out, int64_t ldo, const Tables& t,
                             const float* dq, const float* mq) {
  constexpr int per_block = static_cast<int>(B::elems / 32);
  constexpr int nd = B::two_d ? 2 : 1;
  const int64_t blocks = k_size / B::elems, groups = k_size / 32;
  __m512 acc[rows][cols];
  for (int r = 0; r < rows; ++r) {
    for (int c = 0; c < cols; ++c) acc[r][c] = _mm512_setzero_ps();
  }
  tandem_gguf::prefetch_ahead(w, cols * row_bytes);
  for (int64_t kb = 0; kb < blocks; ++kb) {
    for (int s = 0; s < per_block; ++s) {
      const int64_t g = kb * per_block + s;
      __m512bh xv[rows];
      for (int r = 0; r < rows; ++r) xv[r] = (__m512bh)_mm512_loadu_si512(x + r * ldx + 32 * g);
      for (int c = 0; c < cols; ++c) {
        const __m512bh q = (__m512bh)B::values(w + c * row_bytes + kb * B::bytes, s, t);
        const float* d = dq + (c * groups + g) * nd;
        const __m512 dv = B::two_d ? _mm512_castpd_ps(_mm512_insertf64x4(_mm512_castps_pd(_mm512_set1_ps(d[0])),
                                                                          _mm256_castps_pd(_mm256_set1_ps(d[1])), 1))
                                   : _mm512_set1_ps(d[0]);
        for (int r = 0; r < rows; ++r)
          acc[r][c] = _mm512_fmadd_ps(_mm512_dpbf16_ps(_mm512_setzero_ps(), q, xv[r]), dv, acc[r][c]);
      }
    }
  }
  for (int r = 0; r < rows; ++r) {
    for (int c = 0; c < cols; ++c) {
      float m_part = 0.0f;
      if (B::has_m) {
        const float* mc = mq + c * groups;
        const float* sr = sums + r * lds;
        for (int64_t g = 0; g < groups; ++g) m_part += mc[g] * sr[g];
      }
      out[r * ldo + c] = _mm512_reduce_add_ps(acc[r][c]) + m_part;
    }
  }
}

template <typename B, int rows>
TANDEM_GGUF_TARGET void tile_cols(int cols, const uint16_t* x, int64_t ldx, const float* sums, int64_t lds,
                                  const uint8_t* w, int64_t row_bytes, int64_t k_size, float* out, int64_t ldo,
                                  const Tables& t, const float* dq, const float* mq) {
  switch (cols) {
    case 1: return tile<B, rows, 1>(x, ldx, sums, lds, w, row_bytes, k_size, out, ldo, t, dq, mq);
    case 2: return tile<B, rows, 2>(x, ldx, sums, lds, w, row_bytes, k_size, out, ldo, t, dq, mq);
    case 3: return tile<B, rows, 3>(x, ldx, sums, lds, w, row_bytes, k_size, out, ldo, t, dq, mq);
    default: return tile<B, rows, kCols>(x, ldx, sums, lds, w, row_bytes, k_size, out, ldo, t, dq, mq);
  }
}

template <typename B>
TANDEM_GGUF_TARGET void tile_any(int rows, int cols, const uint16_t* x, int64_t ldx, const float* sums, int64_t lds,
                                 const uint8_t* w, int64_t row_bytes, int64_t k_size, float* out, int64_t ldo,
                                 const Tables& t, const float* dq, const float* mq) {
  switch (rows) {
    case 1: return tile_cols<B, 1>(cols, x, ldx, sums, lds, w, row_bytes, k_size, out, ldo, t, dq, mq);
    case 2: return tile_cols<B, 2>(cols, x, ldx, sums, lds, w, row_bytes, k_size, out, ldo, t, dq, mq);
    case 3: return tile_cols<B, 3>(cols, x, ldx, sums, lds, w, row_bytes, k_size, out, ldo, t, dq, mq);
    default: return tile_cols<B, kRows>(cols, x, ldx, sums, lds, w, row_bytes, k_size, out, ldo, t, dq, mq);
  }
}

// sums[r * (K / 32) + g] = float32 sum of x[r, 32g .. 32g + 31]
TANDEM_GGUF_TARGET void group_sums(const uint16_t* x, int64_t m_size, int64_t k_size, float* sums) {
  const int64_t groups = k_size / 32;
  for (int64_t r = 0; r < m_size; ++r) {
    for (int64_t g = 0; g < groups; ++g) {
      const __m512i v = _mm512_loadu_si512(x + r * k_size + 32 * g);
      // a bfloat16 value is the high half of its float32
      const __m512 even = _mm512_castsi512_ps(_mm512_slli_epi32(v, 16));
      const __m512 odd = _mm512_castsi512_ps(_mm512_and_si512(v, _mm512_set1_epi32(static_cast<int>(0xFFFF0000u))));
      sums[r * groups + g] = _mm512_reduce_add_ps(_mm512_add_ps(even, odd));
    }
  }
}

template <typename B>
TANDEM_GGUF_TARGET void linear(float* out, const uint16_t* x, int64_t m_size, const uint8_t* w, int64_t n_size,
                               int64_t k_size) {
  const int64_t row_bytes = k_size / B::elems * B::bytes;
  std::vector<float> sums;
  if (B::has_m) {
    sums.resize(m_size * (k_size / 32));
    group_sums(x, m_size, k_size, sums.data());
  }
  std::vector<uint16_t> spread;
  if (B::spread) {  // x in the order the weights' values come out of nibbles_spread
    spread.resize(m_size * k_size);
    for (int64_t i = 0; i < m_size * k_size; i += 32) {
      for (int j = 0; j < 32; ++j) spread[i + spread_position(j)] = x[i + j];
    }
    x = spread.data();
  }
  const float* sp = sums.data();
  const int64_t lds = k_size / 32;
  const int64_t groups = (n_size + kGroup - 1) / kGroup;
  tandem_cpu::for_each_share(groups, 1, [&](int64_t begin, int64_t end) {
    const Tables t;
    static thread_local std::vector<float> scratch;
    scratch.resize(static_cast<size_t>(kCols * lds * 3));
    constexpr int64_t nd = B::two_d ? 2 : 1;
    float* dq = scratch.data();         // [kCols][K / 32 * nd]
    float* mq = dq + kCols * lds * nd;  // [kCols][K / 32]
    for (int64_t g = begin; g < end; ++g) {
      const int64_t n0 = g * kGroup, width = std::min(kGroup, n_size - n0);
      for (int64_t c0 = 0; c0 < width; c0 += kCols) {
        const int cols = static_cast<int>(std::min<int64_t>(kCols, width - c0));
        const uint8_t* wc = w + (n0 + c0) * row_bytes;
        for (int c = 0; c < cols; ++c)
          scales_row<B>(wc + c * row_bytes, k_size / B::elems, dq + c * lds * nd, mq + c * lds);
        for (int64_t m0 = 0; m0 < m_size; m0 += kRows) {
          const int rows = static_cast<int>(std::min<int64_t>(kRows, m_size - m0));
          tile_any<B>(rows, cols, x + m0 * k_size, k_size, sp + m0 * lds, lds, wc, row_bytes, k_size,
                      out + m0 * n_size + n0 + c0, n_size, t, dq, mq);
        }
      }
    }
  });
}


// ---- int8 products (AVX512-VNNI) for up to kInt8Rows rows of bfloat16 x ----
//
// Each 32-value group of a row of x becomes 15-bit fixed point: xq = x / step rounded to the
// nearest integer, step = 2^(e - 13) for the group's largest |x| in [2^e, 2^(e + 1)), so |xq| <=
// 255 * 2^6 and every value within a factor 2^7 of the group's largest is exact (bfloat16 has 8
// significant bits); a smaller one is off by at most step / 2. xq = 256 hi + lo with signed bytes
// hi and lo, and vpdpbusd (unsigned bytes times signed bytes, four products a lane added in
// int32) takes a block's bytes u (as_u8) against both: 256 (u . hi) + u . lo, exact in int32.
// With w = d (u - offset) + m, lane by lane (4 values a lane, so Q6_K's d of 16 values is one a
// half of the lanes):
//
//   x . w = sum_g step_g d_g (u . xq - offset * sum xq)_g + sum_g m_g step_g (sum xq)_g
//
// The offset's part is an int32 vector a group of x (corr), taken off before the lanes convert to
// float32 (exact below 2^24, a float32 rounding above) and meet d * step in an FMA; d and m come
// from the block's head in the loop (the K-quants': group_scales, once a block). A block turns into
// bytes in about half the instructions it takes to turn it into bfloat16, and its products need
// 32-byte registers only: for a decode step's one to three rows the fixed point is the better trade.
struct FixedRows {
  std::vector<int8_t> hi, lo;  // [M][K]
  std::vector<int32_t> corr;   // [M][K / 32][8]: offset times each lane's sum of xq
  std::vector<float> step;     // [M][K / 32]
  std::vector<float> sums;     // [M][K / 32]: step times the group's sum of xq
};

TANDEM_GGUF_VNNI inline float pow2(int e) {  // 2^e for -126 <= e <= 127
  const uint32_t bits = static_cast<uint32_t>(127 + e) << 23;
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}

// x [M, K] bfloat16 as fixed point for a type of `offset`; false (fx partly written) where x
// holds an infinity or a NaN
TANDEM_GGUF_VNNI bool to_fixed(const uint16_t* x, int64_t m_size, int64_t k_size, int offset, FixedRows& fx) {
  const int64_t n = m_size * k_size / 32;
  fx.hi.resize(32 * n), fx.lo.resize(32 * n), fx.corr.resize(8 * n), fx.step.resize(n), fx.sums.resize(n);
  const __m512i exponent = _mm512_set1_epi32(0x7F80);
  for (int64_t i = 0; i < n; ++i) {
    const __m512i b0 = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(x + 32 * i)));
    const __m512i b1 = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(x + 32 * i + 16)));
    const int top = static_cast<int>(_mm512_reduce_max_epu32(
                        _mm512_max_epu32(_mm512_and_si512(b0, exponent), _mm512_and_si512(b1, exponent)))) >> 7;
    if (top == 255) return false;
    const int e = std::max(top - 127, -100);  // a group of zeros (or of subnormals) is all 0
    const __m512 inv = _mm512_set1_ps(pow2(13 - e));
    const float step = pow2(e - 13);
    const __m512i q0 = _mm512_cvtps_epi32(_mm512_mul_ps(_mm512_castsi512_ps(_mm512_slli_epi32(b0, 16)), inv));
    const __m512i q1 = _mm512_cvtps_epi32(_mm512_mul_ps(_mm512_castsi512_ps(_mm512_slli_epi32(b1, 16)), inv));
    const __m512i h0 = _mm512_srai_epi32(_mm512_add_epi32(q0, _mm512_set1_epi32(128)), 8);
    const __m512i h1 = _mm512_srai_epi32(_mm512_add_epi32(q1, _mm512_set1_epi32(128)), 8);
    const __m256i hi = _mm256_set_m128i(_mm512_cvtepi32_epi8(h1), _mm512_cvtepi32_epi8(h0));
    const __m256i lo = _mm256_set_m128i(_mm512_cvtepi32_epi8(_mm512_sub_epi32(q1, _mm512_slli_epi32(h1, 8))),
                                        _mm512_cvtepi32_epi8(_mm512_sub_epi32(q0, _mm512_slli_epi32(h0, 8))));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(fx.hi.data() + 32 * i), hi);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(fx.lo.data() + 32 * i), lo);
    const __m256i ones = _mm256_set1_epi8(1);
    const __m256i lanes =  // each lane's sum of xq, taken as the tile takes u . xq
        _mm256_dpbusd_epi32(_mm256_slli_epi32(_mm256_dpbusd_epi32(_mm256_setzero_si256(), ones, hi), 8), ones, lo);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(fx.corr.data() + 8 * i),
                        _mm256_mullo_epi32(lanes, _mm256_set1_epi32(offset)));
    fx.step[i] = step;
    fx.sums[i] = step * static_cast<float>(_mm512_reduce_add_epi32(_mm512_add_epi32(q0, q1)));
  }
  return true;
}

// out[r * ldo + c] = x[r] . w[c] for r < rows (all of fx's rows, K apart), c < cols (w's rows
// row_bytes apart)
template <typename B, int rows, int cols>
TANDEM_GGUF_VNNI void tile_int8(const FixedRows& fx, const uint8_t* w, int64_t row_bytes, int64_t k_size, float* out,
                                int64_t ldo) {
  const int64_t groups = k_size / 32;
  const int8_t* hi = fx.hi.data();
  const int8_t* lo = fx.lo.data();
  const int32_t* corr = fx.corr.data();
  const float* step = fx.step.data();
  const float* sums = fx.sums.data();
  __m256 acc[rows][cols], acc_m[rows][cols];
  for (int r = 0; r < rows; ++r) {
    for (int c = 0; c < cols; ++c) acc[r][c] = acc_m[r][c] = _mm256_setzero_ps();
  }
  constexpr int per_block = static_cast<int>(B::elems / 32);
  tandem_gguf::prefetch_ahead(w, cols * row_bytes);
  alignas(64) float block_d[cols][16], block_m[cols][8];  // a K-quant block's group_scales
  for (int64_t g = 0; g < groups; ++g) {
    const int64_t kb = g / per_block;
    const int s = static_cast<int>(g % per_block);
    __m256i u[cols];
    __m256 d[cols], m[cols];
    for (int c = 0; c < cols; ++c) {
      const uint8_t* b = w + c * row_bytes + kb * B::bytes;
      u[c] = B::as_u8(b, s);
      if constexpr (per_block == 1) {
        uint32_t head;  // d, and m where the type has one
        std::memcpy(&head, b, 4);
        const __m256 dm = _mm256_cvtph_ps(_mm_set1_epi32(static_cast<int>(head)));
        d[c] = _mm256_permute_ps(dm, 0x00);
        if (B::has_m) m[c] = _mm256_permute_ps(dm, 0x55);
      } else {
        if (s == 0) B::group_scales(b, block_d[c], block_m[c]);
        if (B::two_d)  // lanes 0-3 sum values 0-15, lanes 4-7 values 16-31
          d[c] = _mm256_insertf128_ps(_mm256_castps128_ps256(_mm_broadcast_ss(block_d[c] + 2 * s)),
                                      _mm_broadcast_ss(block_d[c] + 2 * s + 1), 1);
        else
          d[c] = _mm256_broadcast_ss(block_d[c] + s);
        if (B::has_m) m[c] = _mm256_broadcast_ss(block_m[c] + s);
      }
    }
    for (int r = 0; r < rows; ++r) {
      const __m256i xh = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(hi + r * k_size + 32 * g));
      const __m256i xl = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(lo + r * k_size + 32 * g));
      const __m256 sv = _mm256_broadcast_ss(step + r * groups + g);
      const __m256i off = B::offset ? _mm256_loadu_si256(reinterpret_cast<const __m256i*>(corr + (r * groups + g) * 8))
                                    : _mm256_setzero_si256();
      for (int c = 0; c < cols; ++c) {
        __m256i a = _mm256_dpbusd_epi32(_mm256_setzero_si256(), u[c], xh);
        a = _mm256_dpbusd_epi32(_mm256_slli_epi32(a, 8), u[c], xl);
        if (B::offset) a = _mm256_sub_epi32(a, off);
        acc[r][c] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(a), _mm256_mul_ps(d[c], sv), acc[r][c]);
        if (B::has_m) acc_m[r][c] = _mm256_fmadd_ps(m[c], _mm256_broadcast_ss(sums + r * groups + g), acc_m[r][c]);
      }
    }
  }
  for (int r = 0; r < rows; ++r) {
    for (int c = 0; c < cols; ++c) {
      const __m128 s = _mm_add_ps(_mm256_castps256_ps128(acc[r][c]), _mm256_extractf128_ps(acc[r][c], 1));
      const __m128 t = _mm_add_ps(s, _mm_movehl_ps(s, s));
      // acc_m's lanes are equal: one is the m part
      out[r * ldo + c] = _mm_cvtss_f32(_mm_add_ss(t, _mm_movehdup_ps(t))) + _mm256_cvtss_f32(acc_m[r][c]);
    }
  }
}

template <typename B, int rows>
TANDEM_GGUF_VNNI void tile_int8_cols(int cols, const FixedRows& fx, const uint8_t* w, int64_t row_bytes,
                                     int64_t k_size, float* out, int64_t ldo) {
  switch (cols) {
    case 1: return tile_int8<B, rows, 1>(fx, w, row_bytes, k_size, out, ldo);
    case 2: return tile_int8<B, rows, 2>(fx, w, row_bytes, k_size, out, ldo);
    case 3: return tile_int8<B, rows, 3>(fx, w, row_bytes, k_size, out, ldo);
    default: return tile_int8<B, rows, kCols>(fx, w, row_bytes, k_size, out, ldo);
  }
}

// linear()'s loop nest on x's fixed-point rows (m_size <= kInt8Rows); false where x is not finite
template <typename B>
TANDEM_GGUF_VNNI bool linear_int8(float* out, const uint16_t* x, int64_t m_size, const uint8_t* w, int64_t n_size,
                                  int64_t k_size) {
  static thread_local FixedRows fx;
  if (!to_fixed(x, m_size, k_size, B::offset, fx)) return false;
  const int64_t row_bytes = k_size / B::elems * B::bytes;
  const int64_t units = (n_size + kGroup - 1) / kGroup;
  const FixedRows& rows_x = fx;
  tandem_cpu::for_each_share(units, 1, [&](int64_t begin, int64_t end) {
    for (int64_t unit = begin; unit < end; ++unit) {
      const int64_t n0 = unit * kGroup, width = std::min(kGroup, n_size - n0);
      for (int64_t c0 = 0; c0 < width; c0 += kCols) {
        const int cols = static_cast<int>(std::min<int64_t>(kCols, width - c0));
        const uint8_t* wc = w + (n0 + c0) * row_bytes;
        float* o = out + n0 + c0;
        switch (m_size) {
          case 1: tile_int8_cols<B, 1>(cols, rows_x, wc, row_bytes, k_size, o, n_size); break;
          case 2: tile_int8_cols<B, 2>(cols, rows_x, wc, row_bytes, k_size, o, n_size); break;
          default: tile_int8_cols<B, kInt8Rows>(cols, rows_x, wc, row_bytes, k_size, o, n_size); break;
        }
      }
    }
  });
  return true;
}

TANDEM_GGUF_BASE bool cpu_has_vnni() {
  static const bool supported = __builtin_cpu_supports("avx512vnni") && __builtin_cpu_supports("avx512bw") &&
                                __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("fma") &&
                                __builtin_cpu_supports("f16c") && __builtin_cpu_supports("bmi2");
  return supported;
}
#endif  // TANDEM_GGUF_DPBF16

}  // namespace

// out [M, N] float32 = x [M, K] bfloat16 (contiguous) @ W.T of ggml_type's blocks: up to
// kInt8Rows rows by linear_int8 where the CPU has AVX512-VNNI (and use_gguf_int8 did not turn it
// off) and x is finite, else by linear on AVX512-BF16. False, with
// nothing written, where neither takes it: no AVX512-BF16, a type without a kernel here, or M
// above kMaxRows (where gguf_matmul.cpp's kernel, which widens each block once a call for every
// row, is the faster)
bool gguf_linear_few_rows(float* out, const uint16_t* x, int64_t m_size, const uint8_t* w, int64_t n_size,
                          int64_t k_size, int64_t ggml_type) {
#ifdef TANDEM_GGUF_DPBF16
  if (m_size <= kInt8Rows && g_int8.load(std::memory_order_relaxed) && cpu_has_vnni()) {
    bool done = false;
    switch (ggml_type) {
      case 2: done = linear_int8<Q4_0>(out, x, m_size, w, n_size, k_size); break;
      case 3: done = linear_int8<Q4_1>(out, x, m_size, w, n_size, k_size); break;
      case 6: done = linear_int8<Q5_0>(out, x, m_size, w, n_size, k_size); break;
      case 7: done = linear_int8<Q5_1>(out, x, m_size, w, n_size, k_size); break;
      case 8: done = linear_int8<Q8_0>(out, x, m_size, w, n_size, k_size); break;
      case 12: done = linear_int8<Q4_K>(out, x, m_size, w, n_size, k_size); break;
      case 13: done = linear_int8<Q5_K>(out, x, m_size, w, n_size, k_size); break;
      case 14: done = linear_int8<Q6_K>(out, x, m_size, w, n_size, k_size); break;
      default: break;
    }
    if (done) return true;
  }
  if (m_size > kMaxRows || !dpbf16_supported()) return false;
  switch (ggml_type) {
    case 2: linear<Q4_0>(out, x, m_size, w, n_size, k_size); return true;
    case 3: linear<Q4_1>(out, x, m_size, w, n_size, k_size); return true;
    case 6: linear<Q5_0>(out, x, m_size, w, n_size, k_size); return true;
    case 7: linear<Q5_1>(out, x, m_size, w, n_size, k_size); return true;
    case 8: linear<Q8_0>(out, x, m_size, w, n_size, k_size); return true;
    case 12: linear<Q4_K>(out, x, m_size, w, n_size, k_size); return true;
    case 13: linear<Q5_K>(out, x, m_size, w, n_size, k_size); return true;
    case 14: linear<Q6_K>(out, x, m_size, w, n_size, k_size); return true;
    default: return false;
  }
#else
  (void)out, (void)x, (void)m_size, (void)w, (void)n_size, (void)k_size, (void)ggml_type;
  return false;
#endif
}

// whether gguf_linear_few_rows gives up to kInt8Rows rows to linear_int8 (the default) or to the
// bfloat16 kernel from now on, in this process; returns the previous setting
bool use_gguf_int8(bool on) { return g_int8.exchange(on); }
