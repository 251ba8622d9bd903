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
#include <ATen/core/Tensor.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

#include "work_queue.h"

namespace {

constexpr int64_t kBlock = 256;

int64_t draw_row(const float* x, int64_t vocab, float u, float* p, double* block_sums) {
  float top = -std::numeric_limits<float>::infinity();
#pragma omp simd reduction(max : top)
  for (int64_t k = 0; k < vocab; ++k) top = std::max(top, x[k]);
  if (!(top > -std::numeric_limits<float>::infinity())) return -1;  // every logit is -inf
  const int64_t blocks = (vocab + kBlock - 1) / kBlock;
  double total = 0.0;
  for (int64_t b = 0; b < blocks; ++b) {
    const int64_t k0 = b * kBlock, k1 = std::min(vocab, k0 + kBlock);
    float sum = 0.f;
#pragma omp simd reduction(+ : sum)
    for (int64_t k = k0; k < k1; ++k) {
      p[k] = std::exp(x[k] - top);
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

TORCH_LIBRARY_FRAGMENT(tandem_cpu, m) { m.def("draw_rows(Tensor(a!) tokens, Tensor logits, Tensor uniforms) -> ()"); }

TORCH_LIBRARY_IMPL(tandem_cpu, CPU, m) { m.impl("draw_rows", &draw_rows); }
