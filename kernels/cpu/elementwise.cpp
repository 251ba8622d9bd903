// Fused element-wise steps of the Llama-family decoder layers on the CPU (tandem.models.layers
// calls them once tandem.models.cpu_linear.pack_cpu_linears has marked the modules). Each one
// reproduces the torch code it replaces operation by operation, rounding to the tensor's dtype
// wherever torch would (so a bfloat16 model rounds as it does under torch), in one pass over the
// rows instead of one pass per operation:
//
//   rms_norm(out, x, weight, eps)             out = weight * to_dtype(rms_norm(float(x)))
//   add_rms_norm(x, residual, weight, eps)    residual = x + residual; x = rms_norm of it (in place)
//   silu_and_mul(out, gate_up)                out = silu(gate) * up, gate_up = [gate | up] per row
//   rotary_neox(x, cos, sin)                  x = x * cos + rotate_half(x) * sin, in place, for
//                                             x [T, heads, D] and cos/sin [T, D] (HF Llama's rope)
//   head_rms_norm(x, weight, eps, gemma)      each head of x [T, heads, D] normed in place over D
//                                             (q/k norms: Qwen3's RMSNorm, or Gemma's with gemma)
//   gemma_rms_norm(out, x, weight, eps)       out = to_dtype(rms_norm(float(x)) * (1 + float(weight)))
//   gemma_add_rms_norm(residual, h, w, eps)   residual = residual + gemma_rms_norm(h), in place
//   gelu_tanh_and_mul(out, gate_up)           out = gelu_tanh(gate) * up (Gemma's MLP)
//   copy_rows(dst, index, src)                dst[index[i]] = src[i] (a prompt's K and V into
//                                             the pool: index_copy_ row by row, in parallel)
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include "work_queue.h"

#include <algorithm>
#include <cmath>
#include <cstring>

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__)
#include <immintrin.h>

#include "vec_exp.h"
#define TANDEM_SILU16 1
#endif

namespace {

// bfloat16 as bits, rounded to nearest even as c10::BFloat16 rounds a number (infinities too), in
// operations the compiler vectorizes (c10's conversion, with its NaN branch, it does not)
inline uint32_t bf16_rounded_bits(float f) {
  uint32_t u;
  std::memcpy(&u, &f, sizeof(u));
  return (u + 0x7FFFu + ((u >> 16) & 1u)) & 0xFFFF0000u;
}

template <typename T>
inline float rnd(float v) {  // v rounded to T, as torch stores an intermediate of dtype T
  return static_cast<float>(static_cast<T>(v));
}
template <>
inline float rnd<float>(float v) {
  return v;
}
template <>
inline float rnd<c10::BFloat16>(float v) {
  const uint32_t u = bf16_rounded_bits(v);
  float r;
  std::memcpy(&r, &u, sizeof(r));
  return r;
}

template <typename T>
inline T to_dtype(float v) {  // v stored as T (rounded as torch rounds)
  return static_cast<T>(v);
}
template <>
inline c10::BFloat16 to_dtype<c10::BFloat16>(float v) {
  return c10::BFloat16(static_cast<uint16_t>(bf16_rounded_bits(v) >> 16), c10::BFloat16::from_bits());
}

// f(begin, end) over [0, items), each item `values` values of work: on this thread when the whole
// call is at most kSerialValues values (a decode step's few rows, where handing work out costs
// more than doing it), else in chunks of about kChunkValues on tandem's work pool (work_queue.h)
// — not on OpenMP's team, whose wake-up under OMP_WAIT_POLICY=PASSIVE costs tens of microseconds.
constexpr int64_t kSerialValues = int64_t{1} << 15, kChunkValues = int64_t{1} << 13;

template <typename F>
void over_items(int64_t items, int64_t values, const F& f) {
  if (items * values <= kSerialValues) {
    f(0, items);
    return;
  }
  tandem_cpu::for_each_chunk(items, std::max<int64_t>(1, kChunkValues / std::max<int64_t>(1, values)), f);
}

template <typename T>
void rms_norm_rows(T* out, T* residual, const T* x, const T* weight, int64_t rows, int64_t width, int64_t ldo,
                   int64_t ldr, int64_t ldx, float eps) {
  over_items(rows, width, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const T* xr = x + r * ldx;
      T* res = residual == nullptr ? nullptr : residual + r * ldr;
      float sum = 0.f;
      for (int64_t i = 0; i < width; ++i) {
        float v = static_cast<float>(xr[i]);
        if (res != nullptr) {
          v = rnd<T>(v + static_cast<float>(res[i]));
          res[i] = to_dtype<T>(v);
        }
        sum += v * v;
      }
      const float inv = 1.f / std::sqrt(sum / static_cast<float>(width) + eps);
      const T* src = res != nullptr ? res : xr;
      T* dst = out + r * ldo;
      for (int64_t i = 0; i < width; ++i) {
        const float normed = rnd<T>(static_cast<float>(src[i]) * inv);
        dst[i] = to_dtype<T>(static_cast<float>(weight[i]) * normed);
      }
    }
  });
}

inline float silu(float x) { return x / (1.f + std::exp(-x)); }

// out = act(gate) * up per row, gate_up = [gate | up]; act's value rounded to T as torch stores it
template <typename T, float (*act)(float)>
void act_mul_rows(T* out, const T* gate_up, int64_t rows, int64_t width, int64_t ldo, int64_t ldg) {
  over_items(rows, 2 * width, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const T* g = gate_up + r * ldg;
      const T* u = g + width;
      T* dst = out + r * ldo;
      for (int64_t i = 0; i < width; ++i) {
        const float a = rnd<T>(act(static_cast<float>(g[i])));
        dst[i] = to_dtype<T>(a * static_cast<float>(u[i]));
      }
    }
  });
}

#ifdef TANDEM_SILU16
// act_mul_rows' SiLU for bfloat16 and float32 rows, 16 values at a time (vec_exp.h's silu16, the
// last ones of a row masked): the same roundings, exp16's exp in place of libm's
inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
inline __m512 load16(const c10::BFloat16* p) {
  return tandem_cpu::widened_bf16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}
inline __m512 load16(const float* p, __mmask16 live) { return _mm512_maskz_loadu_ps(live, p); }
inline __m512 load16(const c10::BFloat16* p, __mmask16 live) {
  return tandem_cpu::widened_bf16(_mm256_maskz_loadu_epi16(live, p));
}
inline void store16(float* p, __m512 gate, __m512 up) { _mm512_storeu_ps(p, _mm512_mul_ps(tandem_cpu::silu16(gate), up)); }
inline void store16(c10::BFloat16* p, __m512 gate, __m512 up) {
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), tandem_cpu::silu_mul_bf16(gate, up));
}
inline void store16(float* p, __m512 gate, __m512 up, __mmask16 live) {
  _mm512_mask_storeu_ps(p, live, _mm512_mul_ps(tandem_cpu::silu16(gate), up));
}
inline void store16(c10::BFloat16* p, __m512 gate, __m512 up, __mmask16 live) {
  _mm256_mask_storeu_epi16(p, live, tandem_cpu::silu_mul_bf16(gate, up));
}

template <typename T>
void silu_mul_rows(T* out, const T* gate_up, int64_t rows, int64_t width, int64_t ldo, int64_t ldg) {
  over_items(rows, 2 * width, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const T* g = gate_up + r * ldg;
      T* dst = out + r * ldo;
      int64_t i = 0;
      for (; i + 16 <= width; i += 16) store16(dst + i, load16(g + i), load16(g + width + i));
      if (i < width) {
        const auto live = static_cast<__mmask16>((1u << (width - i)) - 1u);
        store16(dst + i, load16(g + i, live), load16(g + width + i, live), live);
      }
    }
  });
}
#endif

template <typename T>
void rotary_rows(T* x, const T* cos, const T* sin, int64_t tokens, int64_t heads, int64_t dim, int64_t xs0,
                 int64_t xs1, int64_t cs0, int64_t ss0) {
  const int64_t half = dim / 2;
  over_items(tokens, heads * dim, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const T* c = cos + t * cs0;
      const T* s = sin + t * ss0;
      for (int64_t h = 0; h < heads; ++h) {
        T* v = x + t * xs0 + h * xs1;
#pragma omp simd
        for (int64_t i = 0; i < half; ++i) {
          const float a = static_cast<float>(v[i]), b = static_cast<float>(v[i + half]);
          // torch: x * cos + cat(-x2, x1) * sin, each product and the sum rounded to T
          const float lo = rnd<T>(a * static_cast<float>(c[i])) + rnd<T>(-b * static_cast<float>(s[i]));
          const float hi = rnd<T>(b * static_cast<float>(c[i + half])) + rnd<T>(a * static_cast<float>(s[i + half]));
          v[i] = to_dtype<T>(lo);
          v[i + half] = to_dtype<T>(hi);
        }
      }
    }
  });
}

// One vector of `width` values normed: dst = weight * to_T(normed) (plain, HF's LlamaRMSNorm), or
// with GEMMA dst = to_T(normed * (1 + weight)) (HF's Gemma3RMSNorm: the scale in float32); with
// ADD, dst = to_T(dst + that) (Gemma's residual add after the norm). dst may be src.
template <typename T, bool GEMMA, bool ADD>
inline void norm_vector(T* dst, const T* src, const T* weight, int64_t width, float eps) {
  float sum = 0.f;
  for (int64_t i = 0; i < width; ++i) {
    const float v = static_cast<float>(src[i]);
    sum += v * v;
  }
  const float inv = 1.f / std::sqrt(sum / static_cast<float>(width) + eps);
  for (int64_t i = 0; i < width; ++i) {
    const float normed = static_cast<float>(src[i]) * inv;
    float v = GEMMA ? rnd<T>(normed * (1.f + static_cast<float>(weight[i])))
                    : static_cast<float>(weight[i]) * rnd<T>(normed);
    if (ADD) v += static_cast<float>(dst[i]);
    dst[i] = to_dtype<T>(v);
  }
}

// rows x heads vectors of `width` at dst/src + r * ld + h * hs (one stride pair for both)
template <typename T, bool GEMMA, bool ADD>
void norm_vectors(T* dst, const T* src, const T* weight, int64_t rows, int64_t heads, int64_t width, int64_t ldd,
                  int64_t hsd, int64_t lds, int64_t hss, float eps) {
  over_items(rows * heads, width, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const int64_t r = i / heads, h = i % heads;
      norm_vector<T, GEMMA, ADD>(dst + r * ldd + h * hsd, src + r * lds + h * hss, weight, width, eps);
    }
  });
}

// gelu with torch's tanh approximation, 0.5 x (1 + tanh(y)) with y = sqrt(2 / pi) (x + 0.044715 x^3),
// computed as x / (1 + exp(-2y)) (the same function, without the cancellation of 1 + tanh(y) near
// -1, and a form the compiler vectorizes); y kept above -40 so exp never overflows (-ffast-math
// assumes no infinities), where the value is 0 to float32 anyway
inline float gelu_tanh(float x) {
  const float y = std::fmax(0.7978845608028654f * (x + 0.044715f * x * x * x), -40.f);
  return x / (1.f + std::exp(-2.f * y));
}

void check_rows(const at::Tensor& t, const char* name) {
  TORCH_CHECK(t.device().is_cpu() && t.dim() == 2 && t.stride(1) == 1, name, " must be a CPU [rows, width] tensor with contiguous rows");
}

#define TANDEM_DISPATCH(dtype, ...)                                                              \
  switch (dtype) {                                                                               \
    case at::kFloat: { using T = float; __VA_ARGS__; break; }                                    \
    case at::kBFloat16: { using T = c10::BFloat16; __VA_ARGS__; break; }                         \
    case at::kHalf: { using T = c10::Half; __VA_ARGS__; break; }                                 \
    default: TORCH_CHECK(false, "unsupported dtype ", dtype);                                    \
  }

}  // namespace

void rms_norm(at::Tensor& out, const at::Tensor& x, const at::Tensor& weight, double eps) {
  check_rows(out, "out");
  check_rows(x, "x");
  TORCH_CHECK(out.sizes() == x.sizes() && out.scalar_type() == x.scalar_type() && weight.scalar_type() == x.scalar_type() &&
                  weight.is_contiguous() && weight.numel() == x.size(1),
              "rms_norm: out, x [rows, width] and weight [width] of one dtype");
  TANDEM_DISPATCH(x.scalar_type(), rms_norm_rows<T>(out.data_ptr<T>(), nullptr, x.data_ptr<T>(), weight.data_ptr<T>(),
                                                    x.size(0), x.size(1), out.stride(0), 0, x.stride(0), eps))
}

void add_rms_norm(at::Tensor& x, at::Tensor& residual, const at::Tensor& weight, double eps) {
  check_rows(x, "x");
  check_rows(residual, "residual");
  TORCH_CHECK(residual.sizes() == x.sizes() && residual.scalar_type() == x.scalar_type() &&
                  weight.scalar_type() == x.scalar_type() && weight.is_contiguous() && weight.numel() == x.size(1),
              "add_rms_norm: x, residual [rows, width] and weight [width] of one dtype");
  TANDEM_DISPATCH(x.scalar_type(), rms_norm_rows<T>(x.data_ptr<T>(), residual.data_ptr<T>(), x.data_ptr<T>(),
                                                    weight.data_ptr<T>(), x.size(0), x.size(1), x.stride(0),
                                                    residual.stride(0), x.stride(0), eps))
}

void silu_and_mul(at::Tensor& out, const at::Tensor& gate_up) {
  check_rows(out, "out");
  check_rows(gate_up, "gate_up");
  TORCH_CHECK(gate_up.size(0) == out.size(0) && gate_up.size(1) == 2 * out.size(1) && gate_up.scalar_type() == out.scalar_type(),
              "silu_and_mul: gate_up [rows, 2 * width] and out [rows, width] of one dtype");
#ifdef TANDEM_SILU16
  if (out.scalar_type() == at::kBFloat16) {
    return silu_mul_rows(out.data_ptr<c10::BFloat16>(), gate_up.data_ptr<c10::BFloat16>(), out.size(0), out.size(1),
                         out.stride(0), gate_up.stride(0));
  }
  if (out.scalar_type() == at::kFloat) {
    return silu_mul_rows(out.data_ptr<float>(), gate_up.data_ptr<float>(), out.size(0), out.size(1), out.stride(0),
                         gate_up.stride(0));
  }
#endif
  TANDEM_DISPATCH(out.scalar_type(), act_mul_rows<T, silu>(out.data_ptr<T>(), gate_up.data_ptr<T>(), out.size(0), out.size(1),
                                                      out.stride(0), gate_up.stride(0)))
}

void rotary_neox(at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin) {
  TORCH_CHECK(x.device().is_cpu() && x.dim() == 3 && x.stride(2) == 1 && x.size(2) % 2 == 0,
              "rotary_neox: x must be a CPU [T, heads, D] tensor, D even and contiguous");
  check_rows(cos, "cos");
  check_rows(sin, "sin");
  TORCH_CHECK(cos.size(0) == x.size(0) && cos.size(1) == x.size(2) && sin.sizes() == cos.sizes() &&
                  cos.scalar_type() == x.scalar_type() && sin.scalar_type() == x.scalar_type(),
              "rotary_neox: cos and sin must be [T, D] of x's dtype");
  TANDEM_DISPATCH(x.scalar_type(), rotary_rows<T>(x.data_ptr<T>(), cos.data_ptr<T>(), sin.data_ptr<T>(), x.size(0),
                                                  x.size(1), x.size(2), x.stride(0), x.stride(1), cos.stride(0),
                                                  sin.stride(0)))
}

void head_rms_norm(at::Tensor& x, const at::Tensor& weight, double eps, bool gemma) {
  TORCH_CHECK(x.device().is_cpu() && x.dim() == 3 && x.stride(2) == 1 && weight.is_contiguous() &&
                  weight.numel() == x.size(2) && weight.scalar_type() == x.scalar_type(),
              "head_rms_norm: x [T, heads, D] with D contiguous and weight [D], of one dtype");
  TANDEM_DISPATCH(x.scalar_type(), {
    T* p = x.data_ptr<T>();
    if (gemma) {
      norm_vectors<T, true, false>(p, p, weight.data_ptr<T>(), x.size(0), x.size(1), x.size(2), x.stride(0),
                                   x.stride(1), x.stride(0), x.stride(1), eps);
    } else {
      norm_vectors<T, false, false>(p, p, weight.data_ptr<T>(), x.size(0), x.size(1), x.size(2), x.stride(0),
                                    x.stride(1), x.stride(0), x.stride(1), eps);
    }
  })
}

void gemma_rms_norm(at::Tensor& out, const at::Tensor& x, const at::Tensor& weight, double eps) {
  check_rows(out, "out");
  check_rows(x, "x");
  TORCH_CHECK(out.sizes() == x.sizes() && out.scalar_type() == x.scalar_type() && weight.scalar_type() == x.scalar_type() &&
                  weight.is_contiguous() && weight.numel() == x.size(1),
              "gemma_rms_norm: out, x [rows, width] and weight [width] of one dtype");
  TANDEM_DISPATCH(x.scalar_type(), norm_vectors<T, true, false>(out.data_ptr<T>(), x.data_ptr<T>(), weight.data_ptr<T>(),
                                                                x.size(0), 1, x.size(1), out.stride(0), 0, x.stride(0),
                                                                0, eps))
}

void gemma_add_rms_norm(at::Tensor& residual, const at::Tensor& h, const at::Tensor& weight, double eps) {
  check_rows(residual, "residual");
  check_rows(h, "h");
  TORCH_CHECK(residual.sizes() == h.sizes() && residual.scalar_type() == h.scalar_type() &&
                  weight.scalar_type() == h.scalar_type() && weight.is_contiguous() && weight.numel() == h.size(1),
              "gemma_add_rms_norm: residual, h [rows, width] and weight [width] of one dtype");
  TANDEM_DISPATCH(h.scalar_type(), norm_vectors<T, true, true>(residual.data_ptr<T>(), h.data_ptr<T>(),
                                                               weight.data_ptr<T>(), h.size(0), 1, h.size(1),
                                                               residual.stride(0), 0, h.stride(0), 0, eps))
}

void gelu_tanh_and_mul(at::Tensor& out, const at::Tensor& gate_up) {
  check_rows(out, "out");
  check_rows(gate_up, "gate_up");
  TORCH_CHECK(gate_up.size(0) == out.size(0) && gate_up.size(1) == 2 * out.size(1) && gate_up.scalar_type() == out.scalar_type(),
              "gelu_tanh_and_mul: gate_up [rows, 2 * width] and out [rows, width] of one dtype");
  TANDEM_DISPATCH(out.scalar_type(), act_mul_rows<T, gelu_tanh>(out.data_ptr<T>(), gate_up.data_ptr<T>(), out.size(0), out.size(1),
                                                      out.stride(0), gate_up.stride(0)))
}

// copy_rows: each row (all dimensions past the first) one contiguous run in dst and in src, of
// one dtype and the same shape; index int64 [src rows], every entry a row of dst (checked first,
// so that a bad one copies nothing). Rows named twice: which lands is unspecified.
void copy_rows(at::Tensor& dst, const at::Tensor& index, const at::Tensor& src) {
  TORCH_CHECK(dst.device().is_cpu() && src.device().is_cpu() && index.device().is_cpu(),
              "copy_rows: CPU tensors only");
  TORCH_CHECK(dst.dim() >= 1 && dst.dim() == src.dim() && dst.scalar_type() == src.scalar_type() &&
                  dst.sizes().slice(1) == src.sizes().slice(1),
              "copy_rows: dst [R, ...] and src [N, ...] of one dtype with the same row shape");
  TORCH_CHECK(index.scalar_type() == at::kLong && index.dim() == 1 && index.is_contiguous() &&
                  index.numel() == src.size(0),
              "copy_rows: index must be int64 [N], one entry a src row");
  int64_t width = 1;
  for (int64_t d = dst.dim() - 1; d >= 1; --d) {
    TORCH_CHECK((dst.size(d) == 1 || dst.stride(d) == width) && (src.size(d) == 1 || src.stride(d) == width),
                "copy_rows: each row of dst and of src must be one contiguous run");
    width *= dst.size(d);
  }
  const int64_t n = src.size(0), rows = dst.size(0);
  const int64_t* idx = index.data_ptr<int64_t>();
  for (int64_t i = 0; i < n; ++i) TORCH_CHECK(idx[i] >= 0 && idx[i] < rows, "copy_rows: index ", idx[i], " out of range for ", rows, " rows");
  if (n == 0 || width == 0) return;
  const int64_t el = dst.element_size(), bytes = width * el, lds = src.stride(0) * el, ldd = dst.stride(0) * el;
  const char* from = static_cast<const char*>(src.data_ptr());
  char* to = static_cast<char*>(dst.data_ptr());
  over_items(n, width, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) std::memcpy(to + idx[i] * ldd, from + i * lds, bytes);
  });
}

TORCH_LIBRARY_FRAGMENT(tandem_cpu, m) {
  m.def("copy_rows(Tensor(a!) dst, Tensor index, Tensor src) -> ()");
  m.def("head_rms_norm(Tensor(a!) x, Tensor weight, float eps, bool gemma) -> ()");
  m.def("gemma_rms_norm(Tensor(a!) out, Tensor x, Tensor weight, float eps) -> ()");
  m.def("gemma_add_rms_norm(Tensor(a!) residual, Tensor h, Tensor weight, float eps) -> ()");
  m.def("gelu_tanh_and_mul(Tensor(a!) out, Tensor gate_up) -> ()");
  m.def("rms_norm(Tensor(a!) out, Tensor x, Tensor weight, float eps) -> ()");
  m.def("add_rms_norm(Tensor(a!) x, Tensor(b!) residual, Tensor weight, float eps) -> ()");
  m.def("silu_and_mul(Tensor(a!) out, Tensor gate_up) -> ()");
  m.def("rotary_neox(Tensor(a!) x, Tensor cos, Tensor sin) -> ()");
}

TORCH_LIBRARY_IMPL(tandem_cpu, CPU, m) {
  m.impl("rms_norm", &rms_norm);
  m.impl("add_rms_norm", &add_rms_norm);
  m.impl("silu_and_mul", &silu_and_mul);
  m.impl("rotary_neox", &rotary_neox);
  m.impl("head_rms_norm", &head_rms_norm);
  m.impl("gemma_rms_norm", &gemma_rms_norm);
  m.impl("gemma_add_rms_norm", &gemma_add_rms_norm);
  m.impl("gelu_tanh_and_mul", &gelu_tanh_and_mul);
  m.impl("copy_rows", &copy_rows);
}
