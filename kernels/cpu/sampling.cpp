// The sampler's draw on the CPU (tandem.worker.sampler._draw): one token per row of
// softmax(logits), by inverse CDF, in one pass for the max, one for exp and the block sums and
// a partial one for the search, instead of torch's softmax, cumsum and searchsorted over the
// whole [rows, vocab] matrix (three full passes and two [rows, vocab] temporaries).
//
//   draw_rows(tokens [N] int64, logits [N, V] float32, uniforms [N] float32 in [0, 1))
//
// Row i: p_k = exp(x_k - max); total = the sum of p; target = u_i * total, kept below total;
// tokens[i] = the first k whose running sum of p passes target. The running sum goes a block of
// kBlock tokens at a time (the blocks' sums in float64, added in order: the search adds the same
// numbers in the same order, so the total is reached exactly and target < total is always found;
// within the block that passes, its tokens' own sums). A token of probability 0 is never drawn.
// Logits hold no NaN or +inf (the sampler's processing makes none); a row of -inf only gets -1.
// exp runs on x - max clamped to kExpFloor: the vector exp falls back to scalar code, lane by
// lane, below about -87 (where the result is no longer a normal float; a random model's logits
// span hundreds, so most of a row would go that way); a token that far below the max gets
// probability 0 (it would get under 1e-34 of the total), as a -inf logit does.
//
//   argmax_rows(tokens [N] int64, logits [N, V] float32)
//
// The greedy fast path (tandem.worker.sampler._plain_argmax): tokens[i] = the first index of row
// i's largest logit, or -1 where the row holds a NaN (the sampler then sanitizes the batch), as
// torch's max(dim=-1) but in one vector pass (torch's takes far longer than its amax).
#include <ATen/core/Tensor.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

#ifdef __AVX2__
#include <immintrin.h>
#endif

#include "work_queue.h"

namespace {

constexpr int64_t kBlock = 256;
constexpr float kExpFloor = -80.f;  // exp(-80) = 1.8e-35: a normal float, clear of the vector exp's limit

int64_t draw_row(const float* x, int64_t vocab, float u, float* p, double* block_sums) {
  float top = -std::numeric_limits<float>::infinity();
#pragma omp simd reduction(max : top)
  for (int64_t k = 0; k < vocab; ++k) top = std::max(top, x[k]);
  if (!(top > -std::numeric_limits<float>::infinity())) return -1;  // every logit is -inf
  const int64_t blocks = (vocab + kBlock - 1) / kBlock;
  double total = 0.0;
  for (int64_t b = 0; b < blocks; ++b) {
    const int64_t k0 = b * kBlock, k1 = std::min(vocab, k0 + kBlock);
    // three loops, not one: in one, the compiler sees the clamp as redundant where the result is
    // kept and drops it, and exp gets the unclamped values again
#pragma omp simd
    for (int64_t k = k0; k < k1; ++k) p[k] = std::max(x[k] - top, kExpFloor);
#pragma omp simd
    for (int64_t k = k0; k < k1; ++k) p[k] = std::exp(p[k]);
    float sum = 0.f;
#pragma omp simd reduction(+ : sum)
    for (int64_t k = k0; k < k1; ++k) {
      if (x[k] - top < kExpFloor) p[k] = 0.f;
      sum += p[k];
    }
    block_sums[b] = sum;
    total += sum;
  }
  // u < 1, but u * total may round up to total: the largest double below it is still inside
  double target = static_cast<double>(u) * total;
  if (target >= total) target = std::nextafter(total, 0.0);
  double acc = 0.0;
  for (int64_t b = 0; b < blocks; ++b) {
    if (acc + block_sums[b] <= target) {
      acc += block_sums[b];
      continue;
    }
    const int64_t k0 = b * kBlock, k1 = std::min(vocab, k0 + kBlock);
    int64_t last = -1;  // the block's last token of nonzero probability
    for (int64_t k = k0; k < k1; ++k) {
      if (p[k] <= 0.f) continue;
      last = k;
      acc += p[k];
      if (acc > target) return k;
    }
    // rounding: the tokens' own sum fell short of the block's
    if (last >= 0) return last;
  }
  // not reached (the blocks add up to total > target); the last token of nonzero probability
  for (int64_t k = vocab - 1; k >= 0; --k) {
    if (p[k] > 0.f) return k;
  }
  return -1;
}

// The first index of the row's largest value; -1 when the row holds a NaN. Two passes: the
// largest value (four independent running maxima, so the loop is not one chain of dependent
// compares) and any NaN, then the first index holding it (from the start, usually stopping early;
// the row is in the cache by then). Bit tests, not float compares, find NaNs (the file is built
// with -ffast-math, under which the compiler may assume there are none); -0 and +0 compare equal,
// so either is the first zero, as torch's max.
int64_t argmax_row(const float* x, int64_t vocab) {
  int64_t k = 0;
  float best = -std::numeric_limits<float>::infinity();
  bool nan = false;
#ifdef __AVX2__
  const __m256i abs_mask = _mm256_set1_epi32(0x7fffffff), inf_bits = _mm256_set1_epi32(0x7f800000);
  if (vocab >= 32) {
    __m256 m[4];
    __m256i nan_seen = _mm256_setzero_si256();
    for (auto& lane : m) lane = _mm256_set1_ps(best);
    for (; k + 32 <= vocab; k += 32) {
      for (int i = 0; i < 4; ++i) {
        const __m256 v = _mm256_loadu_ps(x + k + 8 * i);
        m[i] = _mm256_max_ps(m[i], v);
        nan_seen = _mm256_or_si256(nan_seen, _mm256_cmpgt_epi32(_mm256_and_si256(_mm256_castps_si256(v), abs_mask), inf_bits));
      }
    }
    nan = !_mm256_testz_si256(nan_seen, nan_seen);
    alignas(32) float vals[8];
    _mm256_store_ps(vals, _mm256_max_ps(_mm256_max_ps(m[0], m[1]), _mm256_max_ps(m[2], m[3])));
    for (float v : vals) best = std::max(best, v);
  }
#endif
  for (; k < vocab; ++k) {
    uint32_t bits;
    std::memcpy(&bits, x + k, sizeof(bits));
    nan |= (bits & 0x7fffffffu) > 0x7f800000u;
    best = std::max(best, x[k]);
  }
  if (nan) return -1;
  k = 0;
#ifdef __AVX2__
  const __m256 target = _mm256_set1_ps(best);
  for (; k + 8 <= vocab; k += 8) {
    const int hits = _mm256_movemask_ps(_mm256_cmp_ps(_mm256_loadu_ps(x + k), target, _CMP_EQ_OQ));
    if (hits != 0) return k + __builtin_ctz(static_cast<unsigned>(hits));
  }
#endif
  for (; k < vocab; ++k) {
    if (x[k] == best) return k;
  }
  return 0;  // not reached: best is one of the row's values
}

}  // namespace

void draw_rows(at::Tensor& tokens, const at::Tensor& logits, const at::Tensor& uniforms) {
  TORCH_CHECK(logits.device().is_cpu() && logits.dim() == 2 && logits.scalar_type() == at::kFloat &&
                  logits.stride(1) == 1,
              "draw_rows: logits must be float32 [N, V] on the CPU with contiguous rows");
  const int64_t rows = logits.size(0), vocab = logits.size(1);
  TORCH_CHECK(uniforms.scalar_type() == at::kFloat && uniforms.is_contiguous() && uniforms.numel() == rows,
              "draw_rows: uniforms must be float32 [N]");
  TORCH_CHECK(tokens.scalar_type() == at::kLong && tokens.is_contiguous() && tokens.numel() == rows,
              "draw_rows: tokens must be int64 [N]");
  if (rows == 0) return;
  TORCH_CHECK(vocab > 0, "draw_rows: the vocabulary is empty");
  const float* xp = logits.data_ptr<float>();
  const float* up = uniforms.data_ptr<float>();
  int64_t* tp = tokens.data_ptr<int64_t>();
  const int64_t ldx = logits.stride(0);
  tandem_cpu::for_each_chunk(rows, 1, [&](int64_t begin, int64_t end) {
    thread_local std::vector<float> p;  // a row's exp values and block sums, kept per thread
    thread_local std::vector<double> block_sums;
    p.resize(vocab);
    block_sums.resize((vocab + kBlock - 1) / kBlock);
    for (int64_t i = begin; i < end; ++i) tp[i] = draw_row(xp + i * ldx, vocab, up[i], p.data(), block_sums.data());
  });
}

void argmax_rows(at::Tensor& tokens, const at::Tensor& logits) {
  TORCH_CHECK(logits.device().is_cpu() && logits.dim() == 2 && logits.scalar_type() == at::kFloat &&
                  logits.stride(1) == 1,
              "argmax_rows: logits must be float32 [N, V] on the CPU with contiguous rows");
  const int64_t rows = logits.size(0), vocab = logits.size(1);
  TORCH_CHECK(tokens.scalar_type() == at::kLong && tokens.is_contiguous() && tokens.numel() == rows,
              "argmax_rows: tokens must be int64 [N]");
  if (rows == 0) return;
  TORCH_CHECK(vocab > 0 && vocab < (int64_t{1} << 31), "argmax_rows: the vocabulary must have 1 to 2^31 - 1 entries");
  const float* xp = logits.data_ptr<float>();
  int64_t* tp = tokens.data_ptr<int64_t>();
  const int64_t ldx = logits.stride(0);
  tandem_cpu::for_each_chunk(rows, 1, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) tp[i] = argmax_row(xp + i * ldx, vocab);
  });
}

TORCH_LIBRARY_FRAGMENT(tandem_cpu, m) {
  m.def("draw_rows(Tensor(a!) tokens, Tensor logits, Tensor uniforms) -> ()");
  m.def("argmax_rows(Tensor(a!) tokens, Tensor logits) -> ()");
}

TORCH_LIBRARY_IMPL(tandem_cpu, CPU, m) {
  m.impl("draw_rows", &draw_rows);
  m.impl("argmax_rows", &argmax_rows);
}
