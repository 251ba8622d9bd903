// A vector exp for tandem's AVX512 kernels (prefill_tiles.cpp's softmax, paged_attention.cpp's),
// and SiLU on it (elementwise.cpp's silu_and_mul, linear_dpbf16.cpp's SiLU after the gate/up
// product). Included only where AVX512 code is built.
#pragma once

#include <immintrin.h>

#include "bf16_round.h"

namespace tandem_cpu {

// exp of 16 float32 values: 2^n p(r) with x = n ln 2 + r, |r| <= ln 2 / 2, p Cephes' degree-6
// polynomial (within 2 ulp of exp); x clamped to [-104, 88] first (0 below; e^88 above, near float32's
// largest)
__attribute__((target("avx512f"))) inline __m512 exp16(__m512 x) {
  x = _mm512_max_ps(_mm512_min_ps(x, _mm512_set1_ps(88.f)), _mm512_set1_ps(-104.f));
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);  // ln 2 in two parts: n * the first is exact
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
  __m512 p = _mm512_set1_ps(1.9875691500e-4f);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
  p = _mm512_fmadd_ps(p, _mm512_mul_ps(r, r), _mm512_add_ps(r, _mm512_set1_ps(1.f)));
  return _mm512_scalef_ps(p, n);
}

// silu(x) = x / (1 + exp(-x)) as torch computes it in float32, exp16's exp in place of libm's
// (within a last bit or two of it); where exp(-x) overflows float32 (x below -ln of its largest),
// x * 0: -0 as torch's x / inf, NaN for -inf as torch's -inf / inf
__attribute__((target("avx512f"))) inline __m512 silu16(__m512 x) {
  const __m512 neg = _mm512_sub_ps(_mm512_setzero_ps(), x);
  const __m512 s = _mm512_div_ps(x, _mm512_add_ps(_mm512_set1_ps(1.f), exp16(neg)));
  return _mm512_mask_mul_ps(s, _mm512_cmp_ps_mask(neg, _mm512_set1_ps(88.7228394f), _CMP_GT_OQ), x,
                            _mm512_setzero_ps());
}

// SiLU(gate) * up of 16 values as silu_and_mul computes it on bfloat16 tensors (torch's
// roundings), gate and up bfloat16 values already: SiLU's value rounded, the product rounded; the
// result's bfloat16 bits
__attribute__((target("avx512f"))) inline __m256i silu_mul_bf16(__m512 gate, __m512 up) {
  return round_to_bf16(_mm512_mul_ps(rounded_bf16(silu16(gate)), up));
}

}  // namespace tandem_cpu
