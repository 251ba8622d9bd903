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
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include <cmath>

namespace {

template <typename T>
inline float rnd(float v) {  // v rounded to T, as torch stores an intermediate of dtype T
  return static_cast<float>(static_cast<T>(v));
}
template <>
inline float rnd<float>(float v) {
  return v;
}

template <typename T>
void rms_norm_rows(T* out, T* residual, const T* x, const T* weight, int64_t rows, int64_t width, int64_t ldo,
                   int64_t ldr, int64_t ldx, float eps) {
  at::parallel_for(0, rows, 16, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const T* xr = x + r * ldx;
      T* res = residual == nullptr ? nullptr : residual + r * ldr;
      float sum = 0.f;
      for (int64_t i = 0; i < width; ++i) {
        float v = static_cast<float>(xr[i]);
        if (res != nullptr) {
          v = rnd<T>(v + static_cast<float>(res[i]));
          res[i] = static_cast<T>(v);
        }
        sum += v * v;
      }
      const float inv = 1.f / std::sqrt(sum / static_cast<float>(width) + eps);
      const T* src = res != nullptr ? res : xr;
      T* dst = out + r * ldo;
      for (int64_t i = 0; i < width; ++i) {
        const float normed = rnd<T>(static_cast<float>(src[i]) * inv);
        dst[i] = static_cast<T>(static_cast<float>(weight[i]) * normed);
      }
    }
  });
}

template <typename T>
void silu_mul_rows(T* out, const T* gate_up, int64_t rows, int64_t width, int64_t ldo, int64_t ldg) {
  at::parallel_for(0, rows, 16, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const T* g = gate_up + r * ldg;
      const T* u = g + width;
      T* dst = out + r * ldo;
      for (int64_t i = 0; i < width; ++i) {
        const float gv = static_cast<float>(g[i]);
        const float act = rnd<T>(gv / (1.f + std::exp(-gv)));
        dst[i] = static_cast<T>(act * static_cast<float>(u[i]));
      }
    }
  });
}

template <typename T>
void rotary_rows(T* x, const T* cos, const T* sin, int64_t tokens, int64_t heads, int64_t dim, int64_t xs0,
                 int64_t xs1, int64_t cs0, int64_t ss0) {
  const int64_t half = dim / 2;
  at::parallel_for(0, tokens, 8, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const T* c = cos + t * cs0;
      const T* s = sin + t * ss0;
      for (int64_t h = 0; h < heads; ++h) {
        T* v = x + t * xs0 + h * xs1;
        for (int64_t i = 0; i < half; ++i) {
          const float a = static_cast<float>(v[i]), b = static_cast<float>(v[i + half]);
          // torch: x * cos + cat(-x2, x1) * sin, each product and the sum rounded to T
          const float lo = rnd<T>(a * static_cast<float>(c[i])) + rnd<T>(-b * static_cast<float>(s[i]));
          const float hi = rnd<T>(b * static_cast<float>(c[i + half])) + rnd<T>(a * static_cast<float>(s[i + half]));
          v[i] = static_cast<T>(lo);
          v[i + half] = static_cast<T>(hi);
        }
      }
    }
  });
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
  TANDEM_DISPATCH(out.scalar_type(), silu_mul_rows<T>(out.data_ptr<T>(), gate_up.data_ptr<T>(), out.size(0), out.size(1),
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

TORCH_LIBRARY_FRAGMENT(tandem_cpu, m) {
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
}
