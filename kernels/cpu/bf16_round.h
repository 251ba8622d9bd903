// float32 to bfloat16 bits, 16 lanes at a time, exactly as c10::BFloat16(float) rounds (tandem's
// AVX512 kernels' bfloat16 outputs), and bfloat16 bits back to float32. Included only where
// AVX512 code is built.
#pragma once

#include <immintrin.h>

namespace tandem_cpu {

// to nearest even by adding 0x7fff plus the lowest kept bit; NaN to 0x7fc0
__attribute__((target("avx512f"))) inline __m256i round_to_bf16(__m512 v) {
  const __m512i bits = _mm512_castps_si512(v);
  const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
  __m512i rounded = _mm512_srli_epi32(_mm512_add_epi32(bits, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7fff))), 16);
  rounded = _mm512_mask_mov_epi32(rounded, _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q), _mm512_set1_epi32(0x7fc0));
  return _mm512_cvtepi32_epi16(rounded);
}

// bfloat16 bits back to float32, exactly
__attribute__((target("avx512f"))) inline __m512 widened_bf16(__m256i bits) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(bits), 16));
}

// widened_bf16(round_to_bf16(v)) without leaving the float32 lanes (no narrowing and widening
// across lanes): the same rounding, the low 16 bits cleared
__attribute__((target("avx512f"))) inline __m512 rounded_bf16(__m512 v) {
  const __m512i bits = _mm512_castps_si512(v);
  const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
  const __m512i rounded = _mm512_and_si512(_mm512_add_epi32(bits, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7fff))),
                                           _mm512_set1_epi32(static_cast<int>(0xffff0000u)));
  return _mm512_mask_mov_ps(_mm512_castsi512_ps(rounded), _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q),
                            _mm512_castsi512_ps(_mm512_set1_epi32(0x7fc00000)));
}

}  // namespace tandem_cpu
