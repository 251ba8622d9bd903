// A whole decode step through a stack of Llama-family decoder layers in one call (the layer loop
// of tandem.models.cpu_decode_loop). A small model's decode step costs more in the dispatch of its
// many small operators — Python frames, tensor wrappers, conversions, per layer ~60 of them —
// than in its matmuls; here the same kernels run one after another from C++:
//
//   per layer l (h, residual [M, hidden] in the model's dtype T; the first layer's residual is h):
//     x        = add_rms_norm(h, residual, norms[l][0])         (rms_norm(h) for the first layer)
//     qkv      = linear(x, 4l)                                  [M, (H + 2 Hkv) D]
//     head_rms_norm(q, k of qkv, norms[l][q], norms[l][k])     in place, with QK_NORM
//     rotary_neox(qkv[:, : (H + Hkv) D], cos, sin)              in place (cos_local, sin_local
//                                                               where local[l])
//     pool[slot of row t, l] = k, v of row t                    KV write
//     attn     = paged_decode(q, pool[:, l], rows, tables, seq_lens, scale, windows[l], row_tables)
//     h        = linear(attn, 4l + 1)
//     x        = add_rms_norm(h, residual, norms[l][1])
//     h        = linear(act_and_mul(linear(x, 4l + 2)), 4l + 3)  act: SiLU, or GELU-tanh with GELU
//                                                               (SiLU on a bfloat16 dpbf16 or amx
//                                                               gate_up: one pass, panel_linear_
//                                                               {dpbf16,amx}_silu)
//
// returning the last (h, residual). With GEMMA the layer is Gemma 3's, the residual stream h
// itself (norms scaled by 1 + weight in float32, four of them around the two blocks):
//
//     h        = h + gemma_rms_norm(attention block(gemma_rms_norm(h, norms[l][0])), norms[l][1])
//     h        = h + gemma_rms_norm(mlp(gemma_rms_norm(h, norms[l][2])), norms[l][3])
//
// returning (h, h). With final_norm (the model's norm after its last layer) the step ends with it
// as the model's forward would: (add_rms_norm(h, residual, final_norm), residual), with GEMMA
// (gemma_rms_norm(h, final_norm), h). norms[l] is the layer's [input, post-attention, (pre-, post-feedforward with
// GEMMA), (q, k with QK_NORM)]. Every step is the kernel the Python modules call, with the
// same conversions, so the values are theirs bit for bit. Linear i is parts[i] consecutive
// entries of weights (a GGUF layer whose shards come in blocks of different types has one per
// run of a type; their outputs side by side make the layer's), entry j being weights[j] with
// info[4j .. 4j + 3] = (kind, out_features, in_features, ggml_type):
//
//   kind 0  tandem's panels   (x widened to float32, panel_linear, rounded back to T)
//   kind 1  oneDNN's packing  (mkldnn::_linear_pointwise in the weight's dtype)
//   kind 2  a dense weight    (at::linear in the weight's dtype)
//   kind 3  GGUF blocks       (gguf_linear of ggml_type)
//   kind 4  bfloat16 pairs    (x in bfloat16, panel_linear_dpbf16, rounded back to T)
//   kind 5  the same on AMX   (panel_linear_amx; a float32 weight: x in float32, panel_linear_amx_f32
//                              on tandem's panels)
//
// Each part runs under a profiler scope ("decode_layers.linear" with the panel kernel itself as
// ".matmul" inside it, ".norm", ".rotary", ".kv_write", ".attention", ".act_and_mul"; free when
// no profiler is on), so torch.profiler splits the step.
//
// pool [num_blocks, L, 2, bs, Hkv, D] of dtype T (D and the heads contiguous); slots [M] int64,
// each >= 0; rows, tables, seq_lens, row_tables as paged_decode takes them (one query row per
// token).
#include <ATen/ATen.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/record_function.h>
#include <torch/library.h>

#include <cstdlib>
#include <cstring>
#include <tuple>
#include <vector>

#include "work_queue.h"

void panel_linear(at::Tensor& out, const at::Tensor& x, const at::Tensor& panels, const c10::optional<at::Tensor>& bias);
void panel_linear_dpbf16(at::Tensor& out, const at::Tensor& x, const at::Tensor& panels,
                         const c10::optional<at::Tensor>& bias, bool bf16_values);
void panel_linear_amx_f32(at::Tensor& out, const at::Tensor& x, const at::Tensor& panels,
                          const c10::optional<at::Tensor>& bias);
void panel_linear_amx_silu(at::Tensor& out, const at::Tensor& x, const at::Tensor& panels);
void panel_linear_dpbf16_silu(at::Tensor& out, const at::Tensor& x, const at::Tensor& panels);
void panel_linear_amx(at::Tensor& out, const at::Tensor& x, const at::Tensor& panels,
                      const c10::optional<at::Tensor>& bias, bool bf16_values);
void paged_decode(at::Tensor& out, const at::Tensor& q, const at::Tensor& kv, const at::Tensor& rows,
                  const at::Tensor& tables, const at::Tensor& seq_lens, double scale, int64_t window,
                  const c10::optional<at::Tensor>& row_tables);
c10::optional<at::Tensor> checked_row_tables(const c10::optional<at::Tensor>& row_tables, int64_t n_rows,
                                             int64_t n_tables);
void rms_norm(at::Tensor& out, const at::Tensor& x, const at::Tensor& weight, double eps);
void add_rms_norm(at::Tensor& x, at::Tensor& residual, const at::Tensor& weight, double eps);
void silu_and_mul(at::Tensor& out, const at::Tensor& gate_up);
void rotary_neox(at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin);
void head_rms_norm(at::Tensor& x, const at::Tensor& weight, double eps, bool gemma);
void gemma_rms_norm(at::Tensor& out, const at::Tensor& x, const at::Tensor& weight, double eps);
void gemma_add_rms_norm(at::Tensor& residual, const at::Tensor& h, const at::Tensor& weight, double eps);
void gelu_tanh_and_mul(at::Tensor& out, const at::Tensor& gate_up);
at::Tensor gguf_linear(const at::Tensor& x, const at::Tensor& qweight, int64_t ggml_type, int64_t in_features);

namespace {

constexpr int64_t kInfo = 4;
constexpr int64_t kQkNorm = 1, kGemma = 2, kGelu = 4;  // the flags (cpu_decode_loop.FLAGS)

at::Tensor onednn_linear(const at::Tensor& x, const at::Tensor& w) {
  static const c10::OperatorHandle op = c10::Dispatcher::singleton().findSchemaOrThrow("mkldnn::_linear_pointwise", "");
  torch::jit::Stack stack{x, w, c10::IValue(), std::string("none"), c10::List<std::optional<at::Scalar>>(),
                          std::string("")};
  op.callBoxed(&stack);
  return stack[0].toTensor();
}

at::Tensor in_dtype(const at::Tensor& t, at::ScalarType dtype) {
  return t.scalar_type() == dtype ? t : t.to(dtype);
}

// x [M, K] of dtype T with contiguous rows -> [M, N] of dtype T
at::Tensor linear_part(const at::Tensor& x, const at::Tensor& w, const int64_t* info) {
  RECORD_FUNCTION("decode_layers.linear", std::vector<c10::IValue>());
  const at::ScalarType dtype = x.scalar_type();
  switch (info[0]) {
    case 0: {
      at::Tensor out = at::empty({x.size(0), info[1]}, x.options().dtype(at::kFloat));
      const at::Tensor x32 = in_dtype(x, at::kFloat);
      {
        RECORD_FUNCTION("decode_layers.matmul", std::vector<c10::IValue>());
        panel_linear(out, x32, w, c10::nullopt);
      }
      return in_dtype(out, dtype);
    }
    case 1: return in_dtype(onednn_linear(in_dtype(x, w.scalar_type()), w), dtype);
    case 2: return in_dtype(at::linear(in_dtype(x, w.scalar_type()), w), dtype);
    case 3: return gguf_linear(x, w, info[3], info[2]);
    case 5:
      if (w.scalar_type() == at::kFloat) {
        at::Tensor out = at::empty({x.size(0), info[1]}, x.options().dtype(at::kFloat));
        panel_linear_amx_f32(out, in_dtype(x, at::kFloat).contiguous(), w, c10::nullopt);
        return in_dtype(out, dtype);
      }
      [[fallthrough]];
    case 4: {  // a bfloat16 model's out straight from the kernel, rounded as .to() rounds it
      const at::ScalarType out_dtype = dtype == at::kBFloat16 ? dtype : at::kFloat;
      at::Tensor out = at::empty({x.size(0), info[1]}, x.options().dtype(out_dtype));
      const at::Tensor x16 = in_dtype(x, at::kBFloat16).contiguous();
      if (info[0] == 4)
        panel_linear_dpbf16(out, x16, w, c10::nullopt, false);
      else
        panel_linear_amx(out, x16, w, c10::nullopt, false);
      return in_dtype(out, dtype);
    }
    default: TORCH_CHECK(false, "decode_layers: unknown linear kind ", info[0]);
  }
}

// The stack's linear layers: linear i of x is its parts' outputs side by side.
struct Linears {
  at::TensorList weights;
  const int64_t* info;
  std::vector<int64_t> first;  // linear i's entries: first[i] .. first[i + 1] - 1

  at::Tensor operator()(const at::Tensor& x, int64_t i) const {
    at::Tensor y;
    if (first[i + 1] - first[i] == 1) {
      y = linear_part(x, weights[first[i]], info + kInfo * first[i]);
    } else {
      std::vector<at::Tensor> outs;
      for (int64_t j = first[i]; j < first[i + 1]; ++j) outs.push_back(linear_part(x, weights[j], info + kInfo * j));
      y = at::cat(outs, 1);
    }
    warm(i + 1);
    return y;
  }

  // SiLU(gate) * up of linear i, a gated MLP's [gate; up], in one pass where the Python module
  // takes that pass (tandem.models.cpu_linear.silu_pass): one bfloat16 dpbf16 or amx part, gate's
  // rows a multiple of 16. Returns an undefined tensor where it does not apply.
  at::Tensor silu_and_mul_of(const at::Tensor& x, int64_t i) const {
    if (first[i + 1] - first[i] != 1) return at::Tensor();
    const int64_t* part = info + kInfo * first[i];
    const at::Tensor& w = weights[first[i]];
    if ((part[0] != 4 && part[0] != 5) || w.scalar_type() != at::kBFloat16 || x.scalar_type() != at::kBFloat16 ||
        part[1] % 32 != 0)
      return at::Tensor();
    at::Tensor act = at::empty({x.size(0), part[1] / 2}, x.options());
    {
      RECORD_FUNCTION("decode_layers.linear", std::vector<c10::IValue>());
      {
        RECORD_FUNCTION("decode_layers.matmul", std::vector<c10::IValue>());
        if (part[0] == 5) {
          panel_linear_amx_silu(act, x.contiguous(), w);
        } else {
          panel_linear_dpbf16_silu(act, x.contiguous(), w);
        }
      }
    }
    warm(i + 1);
    return act;
  }

  // the idle helpers read the start of their shares of linear i's (first) weight while the caller
  // does the work in between (work_queue.h); only for the kernels that share a weight out in
  // order (tandem's panels, AVX512-BF16 pairs on either kernel, GGUF blocks)
  void warm(int64_t i) const {
    if (i + 1 >= static_cast<int64_t>(first.size())) return;
    const int64_t kind = info[kInfo * first[i]];
    if (kind != 0 && kind != 3 && kind != 4 && kind != 5) return;
    const at::Tensor& w = weights[first[i]];
    tandem_cpu::warm_next(w.data_ptr(), w.nbytes());
  }
};

// Stops the helpers' reads of the stack's weights when the call ends, however it ends.
struct StopWarming {
  ~StopWarming() { tandem_cpu::warm_next(nullptr, 0); }
};

// k and v of every row of qkv into the layer's pool slots
void write_kv(const at::Tensor& qkv, const at::Tensor& kv, const int64_t* slots, int64_t heads, int64_t kv_heads,
              int64_t d) {
  RECORD_FUNCTION("decode_layers.kv_write", std::vector<c10::IValue>());
  const int64_t bs = kv.size(2), row_bytes = kv_heads * d * kv.element_size();
  const char* src = static_cast<const char*>(qkv.data_ptr());
  char* dst = static_cast<char*>(kv.data_ptr());
  const int64_t el = kv.element_size(), ld = qkv.stride(0) * el;
  for (int64_t t = 0; t < qkv.size(0); ++t) {
    const int64_t block = slots[t] / bs, offset = slots[t] % bs;
    char* k = dst + (block * kv.stride(0) + offset * kv.stride(2)) * el;
    std::memcpy(k, src + t * ld + heads * d * el, row_bytes);
    std::memcpy(k + kv.stride(1) * el, src + t * ld + (heads + kv_heads) * d * el, row_bytes);
  }
}

// The layer's KV blocks this step's attention reads, asked for (into this core's L2) before the
// layer's qkv product: the weights streamed since the previous step have evicted them, and
// attention would otherwise wait on memory for each sequence's first blocks. At most max_bytes
// (0: none), the first rows' blocks first. Whether it pays depends on the CPU (the caller
// measures: cpu_decode_loop.KvPrefetchChoice).
void prefetch_kv(const at::Tensor& kv, const at::Tensor& tables, const c10::optional<at::Tensor>& row_tables,
                 const at::Tensor& seq_lens, int64_t window, int64_t max_bytes) {
  if (max_bytes <= 0) return;
  // kv: one layer of the pool, [blocks, 2, bs, Hkv, D], a block's K and V one contiguous run
  const int64_t el = kv.element_size(), bs = kv.size(2), block_step = kv.stride(0) * el,
                block_bytes = 2 * kv.stride(1) * el, ld = tables.stride(0), cols = tables.size(1),
                col_step = tables.stride(1);
  const char* base = static_cast<const char*>(kv.data_ptr());
  const int64_t* table = tables.data_ptr<int64_t>();
  const int64_t* lens = seq_lens.data_ptr<int64_t>();
  const int64_t* table_rows = row_tables.has_value() ? row_tables->data_ptr<int64_t>() : nullptr;
  int64_t budget = max_bytes;
  for (int64_t i = 0; i < seq_lens.size(0) && budget > 0; ++i) {
    const int64_t t = table_rows != nullptr ? table_rows[i] : i;
    // a sequence's next rows (drafts being checked) read its blocks again, the last row the most
    if (i + 1 < seq_lens.size(0) && table_rows != nullptr && table_rows[i + 1] == t) continue;
    const int64_t first = window > 0 ? std::max<int64_t>(0, lens[i] - window) / bs : 0;
    const int64_t last = std::min(cols, (lens[i] + bs - 1) / bs);  // prefetches do not fault; the reads must not
    for (int64_t b = first; b < last && budget > 0; ++b, budget -= block_bytes) {
      const char* block = base + table[t * ld + b * col_step] * block_step;
      for (int64_t off = 0; off < block_bytes; off += 64) __builtin_prefetch(block + off, 0, 2);
    }
  }
}

// The layer's attention block from its normed input x: q/k norms, rotary, KV write, paged decode
// attention, o_proj.
at::Tensor attention_block(const at::Tensor& x, at::TensorList norms, const Linears& linear, int64_t l,
                           const at::Tensor& cos, const at::Tensor& sin, const at::Tensor& kv, const int64_t* slot,
                           const at::Tensor& rows, const at::Tensor& tables,
                           const c10::optional<at::Tensor>& row_tables, const at::Tensor& seq_lens, int64_t window,
                           int64_t heads, int64_t kv_heads, int64_t head_dim, double scale, double eps,
                           int64_t flags, int64_t prefetch_kv_bytes) {
  const int64_t m = x.size(0);
  prefetch_kv(kv, tables, row_tables, seq_lens, window, prefetch_kv_bytes);
  at::Tensor qkv = linear(x, 4 * l);
  at::Tensor qk = qkv.narrow(1, 0, (heads + kv_heads) * head_dim).view({m, heads + kv_heads, head_dim});
  if (flags & kQkNorm) {
    RECORD_FUNCTION("decode_layers.norm", std::vector<c10::IValue>());
    const size_t first = (flags & kGemma) ? 4 : 2;
    at::Tensor q = qk.narrow(1, 0, heads), k = qk.narrow(1, heads, kv_heads);
    head_rms_norm(q, norms[first], eps, flags & kGemma);
    head_rms_norm(k, norms[first + 1], eps, flags & kGemma);
  }
  {
    RECORD_FUNCTION("decode_layers.rotary", std::vector<c10::IValue>());
    rotary_neox(qk, cos, sin);
  }
  write_kv(qkv, kv, slot, heads, kv_heads, head_dim);
  at::Tensor attn = at::empty({m, heads, head_dim}, x.options());
  {
    RECORD_FUNCTION("decode_layers.attention", std::vector<c10::IValue>());
    paged_decode(attn, qk.narrow(1, 0, heads), kv, rows, tables, seq_lens, scale, window, row_tables);
  }
  return linear(attn.view({m, heads * head_dim}), 4 * l + 1);
}

// The MLP from its normed input x: gate_up, act_and_mul, down.
at::Tensor mlp_block(const at::Tensor& x, const Linears& linear, int64_t l, int64_t flags) {
  if (!(flags & kGelu)) {
    at::Tensor act = linear.silu_and_mul_of(x, 4 * l + 2);
    if (act.defined()) return linear(act, 4 * l + 3);
  }
  at::Tensor gate_up = linear(x, 4 * l + 2);
  at::Tensor act = at::empty({x.size(0), gate_up.size(1) / 2}, x.options());
  {
    RECORD_FUNCTION("decode_layers.act_and_mul", std::vector<c10::IValue>());
    if (flags & kGelu) {
      gelu_tanh_and_mul(act, gate_up);
    } else {
      silu_and_mul(act, gate_up);
    }
  }
  return linear(act, 4 * l + 3);
}

}  // namespace

std::tuple<at::Tensor, at::Tensor> decode_layers(
    const at::Tensor& hidden, const c10::optional<at::Tensor>& residual_in, at::TensorList norms,
    at::TensorList weights, at::IntArrayRef info, at::IntArrayRef parts, const at::Tensor& cos, const at::Tensor& sin,
    const c10::optional<at::Tensor>& cos_local, const c10::optional<at::Tensor>& sin_local, at::IntArrayRef local,
    at::Tensor& pool, const at::Tensor& slots, const at::Tensor& rows, const at::Tensor& tables,
    const at::Tensor& seq_lens, at::IntArrayRef windows, int64_t heads, int64_t kv_heads, int64_t head_dim,
    double scale, double eps, int64_t flags, const c10::optional<at::Tensor>& final_norm,
    int64_t prefetch_kv_bytes, const c10::optional<at::Tensor>& row_tables_in) {
  const int64_t layers = static_cast<int64_t>(windows.size()), m = hidden.size(0);
  const int64_t per_layer = 2 + ((flags & kGemma) ? 2 : 0) + ((flags & kQkNorm) ? 2 : 0);
  TORCH_CHECK(static_cast<int64_t>(norms.size()) == per_layer * layers &&
                  static_cast<int64_t>(parts.size()) == 4 * layers && static_cast<int64_t>(local.size()) == layers,
              "decode_layers: ", per_layer, " norms, 4 linears and one local flag per layer");
  Linears linear{weights, info.data(), {0}};
  for (const int64_t count : parts) {
    TORCH_CHECK(count >= 1, "decode_layers: a linear of no parts");
    linear.first.push_back(linear.first.back() + count);
  }
  TORCH_CHECK(static_cast<int64_t>(weights.size()) == linear.first.back() &&
                  static_cast<int64_t>(info.size()) == kInfo * linear.first.back(),
              "decode_layers: one weight and 4 info values per part");
  TORCH_CHECK(hidden.dim() == 2 && hidden.is_contiguous() && pool.dim() == 6 && pool.size(1) >= layers &&
                  pool.scalar_type() == hidden.scalar_type() && pool.size(4) == kv_heads && pool.size(5) == head_dim &&
                  pool.stride(5) == 1 && pool.stride(4) == head_dim,
              "decode_layers: hidden [M, hidden] contiguous, pool [blocks, >= layers, 2, bs, Hkv, D] of its dtype");
  TORCH_CHECK(slots.scalar_type() == at::kLong && slots.is_contiguous() && slots.numel() == m,
              "decode_layers: one int64 slot per row");
  bool any_local = false;
  for (int64_t l = 0; l < layers; ++l) any_local = any_local || local[l] != 0;
  TORCH_CHECK(!any_local || (cos_local.has_value() && cos_local->defined() && sin_local.has_value() &&
                             sin_local->defined()),
              "decode_layers: local layers need cos_local and sin_local");
  TORCH_CHECK(tables.scalar_type() == at::kLong && tables.dim() == 2 && tables.is_contiguous() &&
                  seq_lens.scalar_type() == at::kLong && seq_lens.is_contiguous() && seq_lens.numel() == rows.numel(),
              "decode_layers: tables int64 [S, max_blocks] and seq_lens int64 [N], contiguous");
  const c10::optional<at::Tensor> row_tables = checked_row_tables(row_tables_in, rows.numel(), tables.size(0));
  const int64_t* slot = slots.data_ptr<int64_t>();
  for (int64_t t = 0; t < m; ++t) {
    TORCH_CHECK(slot[t] >= 0 && slot[t] < pool.size(0) * pool.size(3), "decode_layers: slot out of the pool");
  }
  at::Tensor h = hidden, residual;
  const StopWarming stop_warming;
  linear.warm(0);  // while the caller checks in below and the first norm runs
  for (int64_t l = 0; l < layers; ++l) {
    at::TensorList ln = norms.slice(l * per_layer, per_layer);
    const at::Tensor& c = local[l] ? *cos_local : cos;
    const at::Tensor& s = local[l] ? *sin_local : sin;
    at::Tensor kv = pool.select(1, l);
    if (flags & kGemma) {  // h is the residual stream
      at::Tensor x = at::empty_like(h);
      {
        RECORD_FUNCTION("decode_layers.norm", std::vector<c10::IValue>());
        gemma_rms_norm(x, h, ln[0], eps);
      }
      at::Tensor a = attention_block(x, ln, linear, l, c, s, kv, slot, rows, tables, row_tables, seq_lens, windows[l], heads,
                                     kv_heads, head_dim, scale, eps, flags, prefetch_kv_bytes);
      {
        RECORD_FUNCTION("decode_layers.norm", std::vector<c10::IValue>());
        gemma_add_rms_norm(h, a, ln[1], eps);
        gemma_rms_norm(x, h, ln[2], eps);
      }
      at::Tensor f = mlp_block(x, linear, l, flags);
      {
        RECORD_FUNCTION("decode_layers.norm", std::vector<c10::IValue>());
        gemma_add_rms_norm(h, f, ln[3], eps);
      }
      residual = h;
      continue;
    }
    at::Tensor x;
    {
      RECORD_FUNCTION("decode_layers.norm", std::vector<c10::IValue>());
      if (l == 0 && !(residual_in.has_value() && residual_in->defined())) {
        residual = h;
        x = at::empty_like(h);
        rms_norm(x, h, ln[0], eps);
      } else {
        if (l == 0) residual = *residual_in;
        add_rms_norm(h, residual, ln[0], eps);
        x = h;
      }
    }
    h = attention_block(x, ln, linear, l, c, s, kv, slot, rows, tables, row_tables, seq_lens, windows[l], heads, kv_heads,
                        head_dim, scale, eps, flags, prefetch_kv_bytes);
    {
      RECORD_FUNCTION("decode_layers.norm", std::vector<c10::IValue>());
      add_rms_norm(h, residual, ln[1], eps);
    }
    h = mlp_block(h, linear, l, flags);
  }
  if (final_norm.has_value() && final_norm->defined()) {  // the model's norm after its last layer
    RECORD_FUNCTION("decode_layers.norm", std::vector<c10::IValue>());
    if (flags & kGemma) {
      at::Tensor x = at::empty_like(h);
      gemma_rms_norm(x, h, *final_norm, eps);
      return {x, h};
    }
    add_rms_norm(h, residual, *final_norm, eps);
  }
  return {h, residual};
}

TORCH_LIBRARY_FRAGMENT(tandem_cpu, m) {
  m.def("decode_layers(Tensor(b!) hidden, Tensor(c!)? residual, Tensor[] norms, Tensor[] weights, int[] info, int[] parts, Tensor cos, "
        "Tensor sin, Tensor? cos_local, Tensor? sin_local, int[] local, Tensor(a!) pool, Tensor slots, Tensor rows, "
        "Tensor tables, Tensor seq_lens, int[] windows, int heads, int kv_heads, int head_dim, float scale, float eps, "
        "int flags, Tensor? final_norm=None, int prefetch_kv_bytes=1048576, Tensor? row_tables=None) -> (Tensor, Tensor)");
}

TORCH_LIBRARY_IMPL(tandem_cpu, CPU, m) { m.impl("decode_layers", &decode_layers); }

// oneDNN's packed weights are tensors of their own backend: a call that holds one dispatches here
TORCH_LIBRARY_IMPL(tandem_cpu, MkldnnCPU, m) { m.impl("decode_layers", &decode_layers); }
