// decode_layer: a whole decoder layer in one op (layer_step), and the
// registration of DecodeStack (decode_stack.h), a model's layers held once and a
// decode step run by one call.  Built from the other fused ops (fused.h) and the
// quantized linears of woq.cpp and qact.cpp.
#include <torch/custom_class.h>
#include <torch/library.h>

#include "decode_stack.h"

at::Tensor ferrum_woq_linear(const at::Tensor& x, const at::Tensor& qweight, const at::Tensor& scales,
                             const at::Tensor& mins, int64_t bits);  // woq.cpp
at::Tensor ferrum_qact_linear(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& scales,
                              int64_t bits, int64_t digits, bool rotated);  // qact.cpp: packed codes

namespace ferrum_fused {

StackLayer checked_layer(const char* who, const at::Tensor& ln1, const at::Tensor& ln2, double eps,
                         std::array<std::vector<at::Tensor>, 4> lin, at::IntArrayRef bits, at::IntArrayRef digits,
                         at::IntArrayRef rotated, std::vector<at::Tensor> qk_norm) {
  TORCH_CHECK(bits.size() == 4 && digits.size() == 4 && rotated.size() == 4, who,
              ": bits, digits and rotated have four entries");
  StackLayer L{ln1, ln2, eps, {}, {}, {}, {}, std::move(qk_norm), {}};
  for (int i = 0; i < 4; ++i) {
    L.lin[i] = std::move(lin[i]);
    L.bits[i] = bits[i], L.digits[i] = digits[i], L.rotated[i] = rotated[i];
    TORCH_CHECK(bits[i] == 32 ? L.lin[i].size() == 1u || L.lin[i].size() == 2u
                              : L.lin[i].size() == (bits[i] < 0 ? 2u : 3u),
                who, ": each linear is [qweight, scales, mins], [codes, scales] with negated bits, "
                "or [weight] or [weight, panels] with bits 32");
  }
  return L;
}

at::Tensor layer_step(const at::Tensor& x, const StackLayer& L, const at::Tensor& cos, const at::Tensor& sin,
                      const at::Tensor& positions, const at::Tensor& k_cache, const at::Tensor& v_cache,
                      const at::Tensor& write_slots, const at::Tensor& tables, int64_t num_heads,
                      int64_t num_kv_heads, double scale, bool rows_silu, const LoraBatch* lora, int64_t layer,
                      const std::optional<at::Tensor>& k_scale, const std::optional<at::Tensor>& v_scale) {
  const auto &bits = L.bits, &digits = L.digits, &rotated = L.rotated;
  const std::vector<at::Tensor>& qk_norm = L.qk_norm;
  const double eps = L.eps;
  const bool all_rows = bits[0] == 32 && bits[1] == 32 && bits[2] == 32 && bits[3] == 32;
  TORCH_CHECK(x.dim() == 3 && (x.scalar_type() == at::kFloat || (all_rows && x.scalar_type() == at::kBFloat16)),
              "decode_layer: x must be (B, T, C) float32 (or bfloat16 with every linear on linear_rows)");
  TORCH_CHECK(qk_norm.empty() || qk_norm.size() == 2, "decode_layer: qk_norm is [] or [q_norm, k_norm] weights");
  const int64_t B = x.size(0), T = x.size(1), H = num_heads, Hkv = num_kv_heads, D = k_cache.size(3);
  auto lin = [&](const at::Tensor& in, at::TensorList w, int i) {
    if (lora != nullptr && bits[i] == 32 && w.size() == 1)
      return lora->linear(layer, i, in, w[0]);  // the deltas inside linear_rows' region
    at::Tensor out = bits[i] == 32 ? (w.size() == 2 ? panel_linear(in, w[1], w[0].size(0)) : linear_rows(in, w[0]))
                     : bits[i] < 0 ? ferrum_qact_linear(in, w[0], w[1], -bits[i], digits[i], rotated[i] != 0)
                                   : ferrum_woq_linear(in, w[0], w[1], w[2], bits[i]);
    if (lora != nullptr) lora->apply(layer, i, in, out);
    return out;
  };
  const at::Tensor qkv_out = lin(rms_norm(x, L.ln1, eps), L.lin[0], 0);  // (B, T, (H + 2 Hkv) D)
  TORCH_CHECK(qkv_out.size(-1) == (H + 2 * Hkv) * D, "decode_layer: q|k|v width does not match the heads");
  at::Tensor q = qkv_out.narrow(-1, 0, H * D).view({B, T, H, D});
  at::Tensor k = qkv_out.narrow(-1, H * D, Hkv * D).view({B, T, Hkv, D});
  if (!qk_norm.empty()) {  // Qwen3: RMSNorm over each head's D before RoPE
    q = rms_norm(q, qk_norm[0], eps);
    k = rms_norm(k, qk_norm[1], eps);
  }
  const at::Tensor v = qkv_out.narrow(-1, (H + Hkv) * D, Hkv * D).view({B, T, Hkv, D});
  const at::Tensor attn =
      paged_attention(q, k, v, cos, sin, positions, k_cache, v_cache, write_slots, tables, scale, k_scale, v_scale);
  at::Tensor h = x + lin(attn, L.lin[1], 1);
  const at::Tensor gu = lin(rms_norm(h, L.ln2, eps), L.lin[2], 2);
  return h.add_(lin(rows_silu ? silu_mul_rows(gu) : silu_mul(gu), L.lin[3], 3));
}

namespace {

at::Tensor decode_layer(const at::Tensor& x, const at::Tensor& ln1, const at::Tensor& ln2, double eps,
                        at::TensorList qkv, at::TensorList o, at::TensorList gate_up, at::TensorList down,
                        at::IntArrayRef bits, at::IntArrayRef digits, at::IntArrayRef rotated, at::TensorList qk_norm,
                        const at::Tensor& cos, const at::Tensor& sin, const at::Tensor& positions,
                        const at::Tensor& k_cache, const at::Tensor& v_cache, const at::Tensor& write_slots,
                        const at::Tensor& tables, int64_t num_heads, int64_t num_kv_heads, double scale) {
  const StackLayer L = checked_layer("decode_layer", ln1, ln2, eps, {qkv.vec(), o.vec(), gate_up.vec(), down.vec()},
                                     bits, digits, rotated, qk_norm.vec());
  return layer_step(x, L, cos, sin, positions, k_cache, v_cache, write_slots, tables, num_heads, num_kv_heads, scale,
                    false, nullptr, 0);
}

}  // namespace
}  // namespace ferrum_fused

TORCH_LIBRARY(ferrum_fused, m) {
  // lora.cpp's classes here, before DecodeStack, whose forward_lora takes a LoraBatch
  m.class_<ferrum_fused::LoraAdapter>("LoraAdapter")
      .def(torch::init<int64_t>())
      .def("set_site", &ferrum_fused::LoraAdapter::set_site)
      .def("layers", &ferrum_fused::LoraAdapter::layers);
  m.class_<ferrum_fused::LoraBatch>("LoraBatch")
      .def(torch::init<at::Tensor>())
      .def("add_adapter", &ferrum_fused::LoraBatch::add_adapter)
      .def("add", &ferrum_fused::LoraBatch::add)
      .def("linear", &ferrum_fused::LoraBatch::linear)
      .def("rows", &ferrum_fused::LoraBatch::rows);
  m.class_<ferrum_fused::DecodeStack>("DecodeStack")
      .def(torch::init<int64_t, int64_t, double>())
      .def("add_layer", &ferrum_fused::DecodeStack::add_layer)
      .def("forward", &ferrum_fused::DecodeStack::forward)
      .def("forward_ids", &ferrum_fused::DecodeStack::forward_ids)
      .def("forward_lora", &ferrum_fused::DecodeStack::forward_lora)
      .def("set_rows_silu", &ferrum_fused::DecodeStack::set_rows_silu)
      .def("set_regions", &ferrum_fused::DecodeStack::set_regions)
      .def("set_kv_scales", &ferrum_fused::DecodeStack::set_kv_scales)
      .def("set_whole_rows", &ferrum_fused::DecodeStack::set_whole_rows)
      .def("one_region", &ferrum_fused::DecodeStack::one_region)
      .def("panels_region", &ferrum_fused::DecodeStack::panels_region)
      .def("size", &ferrum_fused::DecodeStack::size);
  m.def("decode_layer(Tensor x, Tensor ln1, Tensor ln2, float eps, Tensor[] qkv, Tensor[] o, Tensor[] gate_up, "
        "Tensor[] down, int[] bits, int[] digits, int[] rotated, Tensor[] qk_norm, Tensor cos, Tensor sin, "
        "Tensor positions, Tensor(a!) k_cache, Tensor(b!) v_cache, Tensor write_slots, Tensor tables, "
        "int num_heads, int num_kv_heads, float scale) -> Tensor",
        ferrum_ops::on_cpu(&ferrum_fused::decode_layer));
}
