// DecodeStack: a model's layers held once and a decode step run by one call
// (decode_stack.cpp; its steps of a few rows as one OpenMP region in
// stack_regions.cpp), and layer_step, the whole decoder layer it runs a layer at a
// time otherwise.
#pragma once

#include <ATen/Parallel.h>
#include <ATen/TensorOperators.h>
#include <torch/custom_class.h>

#include "fused.h"
#include "lora.h"
#include "qact.h"

#include <array>
#include <cstring>
#include <vector>

namespace ferrum_fused {

// A decoder layer's weights as decode_layer takes them (layer_step's comment says
// what each holds), and for the one region, the quantized linears' packed views.
struct StackLayer {
  at::Tensor ln1, ln2;
  double eps;
  std::vector<at::Tensor> lin[4];  // qkv, o, gate_up, down: decode_layer's weight lists
  std::array<int64_t, 4> bits, digits, rotated;
  std::vector<at::Tensor> qk_norm;
  ferrum_qact::Packed packed[4];  // where bits < 0
};

// A layer from decode_layer's arguments, checked (`who` names the op in errors):
// four entries each in bits, digits and rotated, each linear's list as its bits say.
StackLayer checked_layer(const char* who, const at::Tensor& ln1, const at::Tensor& ln2, double eps,
                         std::array<std::vector<at::Tensor>, 4> lin, at::IntArrayRef bits, at::IntArrayRef digits,
                         at::IntArrayRef rotated, std::vector<at::Tensor> qk_norm);

// One Llama (or Qwen3: qk_norm holds the q/k RMSNorm weights, else empty)
// decoder layer for a decode-sized float32 forward whose projections
// are all our int8/int4 linears: the same ops, in the same order, as
// models/llama.py runs them one Python call at a time (RMSNorm, fused q|k|v,
// paged attention, o, residual, RMSNorm, fused gate|up, silu*up, down,
// residual), so a step makes 30 op calls instead of ~400.  Each weight list is
// [qweight, scales, mins], or [codes, scales] in qact.cpp's packed layout for the
// linears that quantize their activations too, whose widths (8 or 4) bits holds
// negated, digits their activation digits (1: w8a8, w4a8; 2: int8, int4) and
// rotated whether their activations are rotated first (w8a8: qact.cpp rotate16),
// or [weight] (N, K) float32 with bits 32: linear_rows, so 1-4 rows only, or
// [weight, panels] with bits 32: panel_linear on pack_panels' copy, any rows (the
// batch-invariant model's); bfloat16 weights and x too where every linear is one of
// those (the eager path's roundings).
// `rows_silu`: silu*up on silu_mul_rows' loops at any row count (the batch-invariant
// model's MLP), not silu_mul's (ATen's past 4 rows, as the default model's).
// With `lora` (the forward's LoRA rows), each linear's output takes their deltas
// for layer `layer` (lora.cpp), in float, after the base kernel ran: inside
// linear_rows' parallel region for the float linears, by a call of their own after
// the quantized ones.
at::Tensor layer_step(const at::Tensor& x, const StackLayer& L, const at::Tensor& cos, const at::Tensor& sin,
                      const at::Tensor& positions, const at::Tensor& k_cache, const at::Tensor& v_cache,
                      const at::Tensor& write_slots, const at::Tensor& tables, int64_t num_heads,
                      int64_t num_kv_heads, double scale, bool rows_silu, const LoraBatch* lora, int64_t layer,
                      const std::optional<at::Tensor>& k_scale = std::nullopt,
                      const std::optional<at::Tensor>& v_scale = std::nullopt);

// A model's layers held once, as decode_layer takes them, and run by one call a
// step.  A Python call per layer pays argument conversion and dispatch each time,
// and each of a layer's five parallel loops an OpenMP fork and join.  Where every
// linear quantizes its activations, or every linear is a float panel linear, and a
// step has at most kStackRows rows (kInvariantRows for the batch-invariant model,
// whose silu*up runs on the per-row loops at every row count: set_rows_silu), the
// whole step is one parallel region (stack_regions.cpp): the threads split each
// linear's weights and the attention's tasks as decode_layer's loops do, and meet
// at a barrier between phases; a row's RoPE goes to the thread that owns the row,
// its norms and quantizations too (or to every thread, kWholeRows), silu*up and its
// quantization by blocks.  Each output is the same kernel's arithmetic in the same
// order, so the bits equal layer_step's.  One fork and join a step, where layer_step
// forks and joins ~8 times a layer.  Otherwise (LoRA rows, longer forwards) the
// layers run one layer_step each, in C++.
constexpr int64_t kStackRows = 4;
// Decode batches up to this many rows gain from the one region; longer prompt parts
// run faster as a layer_step a layer (bench.stack_regions times both), so they stay there.
constexpr int64_t kInvariantRows = 64;
// Steps of at most this many rows: each thread norms, quantizes and (silu * up)
// computes every row itself, into buffers of its own, instead of its share into
// shared ones and a barrier before the linear that reads them: the same code on
// the same rows, so the same bits.  Neither thread waits out the other's short
// per-row work, and a layer's threads meet 6 times, not 10.
constexpr int64_t kWholeRows = 2;

// A step's inputs besides the hidden states, as DecodeStack's forwards take them:
// the RoPE tables, positions, the pool (layers, blocks, block_size, Hkv, D), the
// write slots and block tables, and the layers [first, last) to run; over an int8
// pool, its scales (layers, blocks, block_size, Hkv, ceil(D / 32)) float16 (null for
// a float pool).
struct StackStep {
  const at::Tensor &cos, &sin, &positions, &k_pool, &v_pool, &write_slots, &tables;
  int64_t first, last;
  const at::Tensor *k_scale = nullptr, *v_scale = nullptr;
};

class DecodeStack : public torch::CustomClassHolder {
 public:
  DecodeStack(int64_t num_heads, int64_t num_kv_heads, double scale)
      : H_(num_heads), Hkv_(num_kv_heads), scale_(scale) {
    TORCH_CHECK(H_ > 0 && Hkv_ > 0 && H_ % Hkv_ == 0, "DecodeStack: heads must be a multiple of kv heads");
  }

  void add_layer(at::Tensor ln1, at::Tensor ln2, double eps, std::vector<at::Tensor> qkv, std::vector<at::Tensor> o,
                 std::vector<at::Tensor> gate_up, std::vector<at::Tensor> down, std::vector<int64_t> bits,
                 std::vector<int64_t> digits, std::vector<int64_t> rotated, std::vector<at::Tensor> qk_norm) {
    for (at::Tensor& w : qk_norm) w = w.contiguous();  // the one region reads the norms' weights by pointer
    StackLayer L = checked_layer("DecodeStack", ln1.contiguous(), ln2.contiguous(), eps,
                                 {std::move(qkv), std::move(o), std::move(gate_up), std::move(down)}, bits, digits,
                                 rotated, qk_norm);
    bool packed = true;
    for (int i = 0; i < 4; ++i) {
      if (bits[i] < 0) L.packed[i] = ferrum_qact::packed(L.lin[i][0], L.lin[i][1], -bits[i]);
      packed = packed && bits[i] < 0 && (digits[i] == 1 || digits[i] == 2) && (!rotated[i] || digits[i] == 1);
    }
    if (packed) {  // the widths the one-region step relies on, alike in every layer
      const int64_t C = ln1.numel(), I = L.packed[3].G * 32, D = L.packed[0].N / (H_ + 2 * Hkv_);
      packed = ln1.scalar_type() == at::kFloat && ln2.scalar_type() == at::kFloat && ln1.dim() == 1 &&
               ln2.dim() == 1 && ln2.numel() == C &&
               L.packed[0].G * 32 == C && L.packed[0].N == (H_ + 2 * Hkv_) * D && L.packed[1].G * 32 == H_ * D &&
               L.packed[1].N == C && L.packed[2].G * 32 == C && L.packed[2].N == 2 * I && L.packed[3].N == C &&
               (qk_norm.empty() || (qk_norm.size() == 2 && qk_norm[0].numel() == D && qk_norm[1].numel() == D &&
                                    qk_norm[0].scalar_type() == at::kFloat && qk_norm[1].scalar_type() == at::kFloat));
      packed = packed && (layers_.empty() || (C == C_ && I == I_ && D == D_));
      C_ = C, I_ = I, D_ = D;
    }
    one_region_ = packed && (layers_.empty() || one_region_);
    bool panels = true;
    for (int i = 0; i < 4; ++i) panels = panels && bits[i] == 32 && L.lin[i].size() == 2u;
    if (panels) {  // float linears on their packed panels: the widths the panels' region relies on
      const at::ScalarType dt = L.lin[0][1].scalar_type();
      const int64_t C = ln1.numel(), Wq = L.lin[0][0].size(0), D = Wq / (H_ + 2 * Hkv_), I = L.lin[3][0].size(1);
      panels = (dt == at::kFloat || dt == at::kBFloat16) && ln1.scalar_type() == dt && ln2.scalar_type() == dt &&
               ln1.dim() == 1 && ln2.dim() == 1 && ln2.numel() == C && Wq == (H_ + 2 * Hkv_) * D &&
               L.lin[0][0].size(1) == C && L.lin[1][0].size(0) == C && L.lin[1][0].size(1) == H_ * D &&
               L.lin[2][0].size(0) == 2 * I && L.lin[2][0].size(1) == C && L.lin[3][0].size(0) == C &&
               (qk_norm.empty() || (qk_norm.size() == 2 && qk_norm[0].numel() == D && qk_norm[1].numel() == D &&
                                    qk_norm[0].scalar_type() == dt && qk_norm[1].scalar_type() == dt));
      for (int i = 0; i < 4; ++i) panels = panels && L.lin[i][1].scalar_type() == dt;
      panels = panels && (layers_.empty() || (C == C_ && I == I_ && D == D_ && dt == panel_dtype_));
      C_ = C, I_ = I, D_ = D, panel_dtype_ = dt;
    }
    panels_region_ = panels && (layers_.empty() || panels_region_);
    layers_.push_back(std::move(L));
  }

  // x (B, T, C) -> (B, T, C) after layers [first, last); k_pool/v_pool (layers,
  // blocks, block_size, Hkv, D), the rest as decode_layer takes them.
  at::Tensor forward(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin, const at::Tensor& positions,
                     const at::Tensor& k_pool, const at::Tensor& v_pool, const at::Tensor& write_slots,
                     const at::Tensor& tables, int64_t first, int64_t last) {
    return run(x, {cos, sin, positions, k_pool, v_pool, write_slots, tables, first, last}, nullptr);
  }

  // The whole step from token ids: ids (B, T) int64 -> the rows of `embed` (V, C) they
  // name, every layer, then the final RMSNorm (norm (C), eps): the hidden states the LM
  // head takes.  One call where the embedding, the layers and the norm were three (each
  // torch op after the layers' weights have streamed through the caches costs tens of
  // microseconds of cold dispatch).  The norm is rms_norm's own loop, so the bits equal
  // forward's followed by rms_norm.
  at::Tensor forward_ids(const at::Tensor& ids, const at::Tensor& embed, const at::Tensor& norm, double eps,
                         const at::Tensor& cos, const at::Tensor& sin, const at::Tensor& positions,
                         const at::Tensor& k_pool, const at::Tensor& v_pool, const at::Tensor& write_slots,
                         const at::Tensor& tables) {
    TORCH_CHECK(ids.dim() == 2 && ids.scalar_type() == at::kLong && embed.dim() == 2 && embed.is_contiguous() &&
                    norm.dim() == 1 && norm.numel() == embed.size(1) && norm.scalar_type() == embed.scalar_type() &&
                    (embed.scalar_type() == at::kFloat || embed.scalar_type() == at::kBFloat16),
                "DecodeStack: forward_ids takes (B, T) int64 ids, a (V, C) float32 or bfloat16 embedding and a (C) norm");
    const at::Tensor idc = ids.contiguous(), wc = norm.contiguous();
    const int64_t V = embed.size(0), C = embed.size(1), rows = idc.numel(), bytes = C * embed.element_size();
    at::Tensor x = at::empty({ids.size(0), ids.size(1), C}, embed.options());
    const int64_t* id = idc.data_ptr<int64_t>();
    const char* table = static_cast<const char*>(embed.data_ptr());
    char* xp = static_cast<char*>(x.data_ptr());
    for (int64_t r = 0; r < rows; ++r) {
      TORCH_CHECK(0 <= id[r] && id[r] < V, "DecodeStack: token id ", id[r], " is outside the vocabulary of ", V);
      std::memcpy(xp + r * bytes, table + id[r] * bytes, bytes);
    }
    const at::Tensor h = run(x, {cos, sin, positions, k_pool, v_pool, write_slots, tables, 0, size()}, nullptr).contiguous();
    at::Tensor out = at::empty_like(h);
    const bool avx2 = avx2_on();
    auto normed = [&](auto* hp, const auto* wp, auto* op) {
      for (int64_t r = 0; r < rows; ++r) rms_on(avx2, hp + r * C, wp, C, float(eps), op + r * C);
    };
    if (h.scalar_type() == at::kFloat)
      normed(h.data_ptr<float>(), wc.data_ptr<float>(), out.data_ptr<float>());
    else
      normed(h.data_ptr<c10::BFloat16>(), wc.data_ptr<c10::BFloat16>(), out.data_ptr<c10::BFloat16>());
    return out;
  }

  // forward, each token with the LoRA adapter `lora` names for it (the layers one
  // layer_step each: the deltas follow their base linears).
  at::Tensor forward_lora(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin,
                          const at::Tensor& positions, const at::Tensor& k_pool, const at::Tensor& v_pool,
                          const at::Tensor& write_slots, const at::Tensor& tables, int64_t first, int64_t last,
                          c10::intrusive_ptr<LoraBatch> lora) {
    TORCH_CHECK(x.dim() == 3 && lora->rows() == x.size(0) * x.size(1), "DecodeStack: one LoRA row per token");
    return run(x, {cos, sin, positions, k_pool, v_pool, write_slots, tables, first, last}, lora.get());
  }

  bool one_region() const { return one_region_; }
  // An int8 pool's scales (layers, blocks, block_size, kv_heads, ceil(head_dim / 32))
  // float16 (fused.h: KvScales), which the forwards over an int8 pool
  // (k_pool int8) read and write beside it; the caller sets them for the pool it passes.
  void set_kv_scales(const at::Tensor& k_scale, const at::Tensor& v_scale) {
    TORCH_CHECK(k_scale.dim() == 5 && v_scale.sizes() == k_scale.sizes() &&
                    k_scale.scalar_type() == at::kHalf && v_scale.scalar_type() == at::kHalf && k_scale.is_contiguous() &&
                    v_scale.is_contiguous(),
                "DecodeStack: an int8 pool's scales are (layers, blocks, block_size, kv_heads, ceil(head_dim / 32)) "
                "float16, contiguous");
    k_scale_ = k_scale, v_scale_ = v_scale;
  }
  // whether a step of a few rows whose linears are all float panels runs as one region
  bool panels_region() const { return panels_region_; }
  // whether steps of a few rows may run as one region (both kinds; off: a layer_step a
  // layer, the same bits): for benchmarks and tests that compare the two
  void set_regions(bool on) { regions_ = on; }
  // Steps of at most n rows have every thread do every row's norms (kWholeRows by
  // default; 0: each thread its share): the same bits either way.
  void set_whole_rows(int64_t n) { whole_rows_ = n; }
  // silu*up per row at any row count (layer_step's rows_silu): the batch-invariant model's
  void set_rows_silu(bool on) { rows_silu_ = on; }
  int64_t size() const { return int64_t(layers_.size()); }

 private:
  at::Tensor run(const at::Tensor& x, StackStep s, const LoraBatch* lora) {
    TORCH_CHECK(0 <= s.first && s.first <= s.last && s.last <= size(), "DecodeStack: layers ", s.first, "..", s.last,
                " of ", size());
    TORCH_CHECK(s.k_pool.dim() == 5 && s.v_pool.sizes() == s.k_pool.sizes() && s.k_pool.size(0) == size(),
                "DecodeStack: the pool must be (layers, blocks, block_size, kv_heads, head_dim)");
    // the pool holds the activations' dtype, or bfloat16 under float32 activations, or
    // int8 with the scales set_kv_scales gave (the step carries them)
    const bool bf16_pool = s.k_pool.scalar_type() == at::kBFloat16, int8_pool = s.k_pool.scalar_type() == at::kChar;
    TORCH_CHECK(!int8_pool || (k_scale_.defined() && k_scale_.sizes().slice(0, 4) == s.k_pool.sizes().slice(0, 4) &&
                               k_scale_.size(4) == kv_scale_blocks(s.k_pool.size(4))),
                "DecodeStack: an int8 pool needs its scales (set_kv_scales) shaped as its first four dims and "
                "ceil(head_dim / 32)");
    if (int8_pool) s.k_scale = &k_scale_, s.v_scale = &v_scale_;
    // a forward the regions take: no LoRA rows, (B, T, C) with few enough rows
    const bool region_shape = lora == nullptr && regions_ && x.dim() == 3 &&
                              x.size(0) * x.size(1) <= (rows_silu_ ? kInvariantRows : kStackRows) &&
                              x.size(2) == C_ && s.k_pool.size(4) == D_;
    if (region_shape && one_region_ && x.scalar_type() == at::kFloat) {
      if (int8_pool) return forward_one_region<int8_t>(x, s);
      return bf16_pool ? forward_one_region<c10::BFloat16>(x, s) : forward_one_region<float>(x, s);
    }
    if (region_shape && panels_region_ && x.scalar_type() == panel_dtype_) {
      const bool bf16 = panel_dtype_ == at::kBFloat16;
      // the dot product reads rows of bfloat16 pairs: every linear's input width even
      if (!panel_path(bf16).dot || (C_ % 2 == 0 && (H_ * D_) % 2 == 0 && I_ % 2 == 0)) {
        if (int8_pool) return bf16 ? forward_panels<c10::BFloat16, int8_t>(x, s) : forward_panels<float, int8_t>(x, s);
        if (bf16) return forward_panels<c10::BFloat16, c10::BFloat16>(x, s);
        return bf16_pool ? forward_panels<float, c10::BFloat16>(x, s) : forward_panels<float, float>(x, s);
      }
    }
    at::Tensor h = x;
    for (int64_t l = s.first; l < s.last; ++l) {
      h = layer_step(h, layers_[l], s.cos, s.sin, s.positions, s.k_pool.select(0, l), s.v_pool.select(0, l),
                     s.write_slots, s.tables, H_, Hkv_, scale_, rows_silu_, lora, l,
                     int8_pool ? std::optional<at::Tensor>(s.k_scale->select(0, l)) : std::nullopt,
                     int8_pool ? std::optional<at::Tensor>(s.v_scale->select(0, l)) : std::nullopt);
    }
    return h;
  }

  template <typename P>
  at::Tensor forward_one_region(const at::Tensor& x, const StackStep& s);
  template <typename E, typename P>
  at::Tensor forward_panels(const at::Tensor& x, const StackStep& s);

  std::vector<StackLayer> layers_;
  at::Tensor k_scale_, v_scale_;  // an int8 pool's (set_kv_scales)
  int64_t H_, Hkv_, D_ = 0, C_ = 0, I_ = 0;
  double scale_;
  bool one_region_ = false;
  bool panels_region_ = false;
  bool regions_ = true;
  int64_t whole_rows_ = kWholeRows;
  at::ScalarType panel_dtype_ = at::kFloat;
  bool rows_silu_ = false;
};

}  // namespace ferrum_fused
