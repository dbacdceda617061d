// decode_layer: a whole decoder layer in one op; DecodeStack: a model's layers
// held once and a decode step run by one call, as one OpenMP region where every
// linear quantizes its activations.  Built from the other fused ops (fused.h)
// and the quantized linears of woq.cpp and qact.cpp.
#include <ATen/Parallel.h>
#include <ATen/TensorOperators.h>
#include <torch/custom_class.h>
#include <torch/library.h>
#include <omp.h>

#include "fused.h"
#include "lora.h"
#include "qact.h"

#include <algorithm>
#include <array>
#include <atomic>
#include <thread>
#include <utility>
#include <vector>

at::Tensor ferrum_woq_linear(const at::Tensor& x, const at::Tensor& qweight, const at::Tensor& scales,
                             const at::Tensor& mins, int64_t bits);  // woq.cpp
at::Tensor ferrum_qact_linear(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& scales,
                              int64_t bits, int64_t digits, bool rotated);  // qact.cpp: packed codes

namespace ferrum_fused {
namespace {

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
at::Tensor layer_step(const at::Tensor& x, const at::Tensor& ln1, const at::Tensor& ln2, double eps,
                      at::TensorList qkv, at::TensorList o, at::TensorList gate_up, at::TensorList down,
                      at::IntArrayRef bits, at::IntArrayRef digits, at::IntArrayRef rotated, at::TensorList qk_norm,
                      const at::Tensor& cos, const at::Tensor& sin, const at::Tensor& positions,
                      const at::Tensor& k_cache, const at::Tensor& v_cache, const at::Tensor& write_slots,
                      const at::Tensor& tables, int64_t num_heads, int64_t num_kv_heads, double scale,
                      bool rows_silu, const LoraBatch* lora, int64_t layer) {
  TORCH_CHECK(bits.size() == 4 && digits.size() == 4 && rotated.size() == 4,
              "decode_layer: bits, digits and rotated have four entries");
  const bool all_rows = bits[0] == 32 && bits[1] == 32 && bits[2] == 32 && bits[3] == 32;
  TORCH_CHECK(x.dim() == 3 && (x.scalar_type() == at::kFloat || (all_rows && x.scalar_type() == at::kBFloat16)),
              "decode_layer: x must be (B, T, C) float32 (or bfloat16 with every linear on linear_rows)");
  TORCH_CHECK(qk_norm.empty() || qk_norm.size() == 2, "decode_layer: qk_norm is [] or [q_norm, k_norm] weights");
  const at::TensorList lists[] = {qkv, o, gate_up, down};
  for (int i = 0; i < 4; ++i)
    TORCH_CHECK(bits[i] == 32 ? lists[i].size() == 1u || lists[i].size() == 2u
                              : lists[i].size() == (bits[i] < 0 ? 2u : 3u),
                "decode_layer: each linear is [qweight, scales, mins], [codes, scales] with negated bits, "
                "or [weight] or [weight, panels] with bits 32");
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
  const at::Tensor qkv_out = lin(rms_norm(x, ln1, eps), qkv, 0);  // (B, T, (H + 2 Hkv) D)
  TORCH_CHECK(qkv_out.size(-1) == (H + 2 * Hkv) * D, "decode_layer: q|k|v width does not match the heads");
  at::Tensor q = qkv_out.narrow(-1, 0, H * D).view({B, T, H, D});
  at::Tensor k = qkv_out.narrow(-1, H * D, Hkv * D).view({B, T, Hkv, D});
  if (!qk_norm.empty()) {  // Qwen3: RMSNorm over each head's D before RoPE
    q = rms_norm(q, qk_norm[0], eps);
    k = rms_norm(k, qk_norm[1], eps);
  }
  const at::Tensor v = qkv_out.narrow(-1, (H + Hkv) * D, Hkv * D).view({B, T, Hkv, D});
  const at::Tensor attn = paged_attention(q, k, v, cos, sin, positions, k_cache, v_cache, write_slots, tables, scale);
  at::Tensor h = x + lin(attn, o, 1);
  const at::Tensor gu = lin(rms_norm(h, ln2, eps), gate_up, 2);
  return h.add_(lin(rows_silu ? silu_mul_rows(gu) : silu_mul(gu), down, 3));
}

at::Tensor decode_layer(const at::Tensor& x, const at::Tensor& ln1, const at::Tensor& ln2, double eps,
                        at::TensorList qkv, at::TensorList o, at::TensorList gate_up, at::TensorList down,
                        at::IntArrayRef bits, at::IntArrayRef digits, at::IntArrayRef rotated, at::TensorList qk_norm,
                        const at::Tensor& cos, const at::Tensor& sin, const at::Tensor& positions,
                        const at::Tensor& k_cache, const at::Tensor& v_cache, const at::Tensor& write_slots,
                        const at::Tensor& tables, int64_t num_heads, int64_t num_kv_heads, double scale) {
  return layer_step(x, ln1, ln2, eps, qkv, o, gate_up, down, bits, digits, rotated, qk_norm, cos, sin, positions,
                    k_cache, v_cache, write_slots, tables, num_heads, num_kv_heads, scale, false, nullptr, 0);
}

// ---- the decode stack ---------------------------------------------------------------
// A model's layers held once, as decode_layer takes them, and run by one call a
// step.  A Python call per layer cost ~14 us of argument conversion and
// dispatch (30 layers: 0.4 ms of a 5 ms batch-1 step), and each of a layer's
// five parallel loops an OpenMP fork and join.  Where every linear quantizes its
// activations and a step has at most kStackRows rows, the whole step is one
// parallel region: the threads split each linear's weight units and the
// attention's tasks as decode_layer's loops do, and meet at a barrier between
// phases; a row's RoPE goes to the thread that owns the row, its norms and
// quantizations too (or to every thread, kWholeRows), silu*up and its
// quantization by blocks.  Each output is the same kernel's
// arithmetic in the same order, so the bits equal decode_layer's.  Otherwise
// (float32 linears, batches) the layers run one decode_layer each, in C++.
constexpr int64_t kStackRows = 4;
// Steps of at most this many rows: each thread norms, quantizes and (silu * up)
// computes every row itself, into buffers of its own, instead of its share into
// shared ones and a barrier before the linear that reads them: the same code on
// the same rows, so the same bits.  One row's norm is ~1 us, which the other
// thread spent waiting; a layer meets 6 times, not 10.
constexpr int64_t kWholeRows = 2;
constexpr int64_t kPrefetchBytes = 256 << 10;  // of o's weights, behind the attention

// The regions' barrier: the threads meet 6-10 times a layer, a few microseconds
// apart, and libgomp's barrier spins only GOMP_SPINCOUNT times before it sleeps on
// a futex (the server sets 2,000 so that idle threads give the cores back between
// calls), so a wait cost a sleep and a wake-up.  This one spins with pause, then
// yields the core (a thread whose partner was descheduled does not burn it); the
// region's end is still libgomp's.  Sense by phase: each thread reads the phase
// before it arrives, the last to arrive resets the count and advances the phase.
class SpinBarrier {
 public:
  void set_threads(int n) { n_ = n; }
  void wait() {
    const int phase = phase_.load(std::memory_order_relaxed);
    if (count_.fetch_add(1, std::memory_order_acq_rel) + 1 == n_) {
      count_.store(0, std::memory_order_relaxed);
      phase_.store(phase + 1, std::memory_order_release);
      return;
    }
    for (int spins = 0; phase_.load(std::memory_order_acquire) == phase;) {
      if (spins < kSpins) {
        ++spins;
#ifdef FERRUM_X86
        _mm_pause();
#endif
      } else {
        std::this_thread::yield();
      }
    }
  }

 private:
  static constexpr int kSpins = 1 << 12;  // ~0.1 ms of pause on the machines seen
  alignas(64) std::atomic<int> count_{0};
  alignas(64) std::atomic<int> phase_{0};
  int n_ = 1;
};

struct StackLayer {
  at::Tensor ln1, ln2;
  double eps;
  std::vector<at::Tensor> lin[4];  // qkv, o, gate_up, down: decode_layer's weight lists
  std::array<int64_t, 4> bits, digits, rotated;
  std::vector<at::Tensor> qk_norm;
  ferrum_qact::Packed packed[4];  // where bits < 0
};

// A region's rows [m0, m1) of q|k|v (M, (H + 2 Hkv) D) after the qkv linear, in
// place: Qwen3's RMSNorm over each head (where the layer has q/k norms), then RoPE
// (the queries into qf) and the new keys and values written into the pool layer.
template <typename E, typename P>
void norm_rope_rows(const AttnArgs& a, const StackLayer& L, bool avx2, E* qkv, int64_t m0, int64_t m1,
                    const float* cp, const float* sp, const int64_t* slots, float* qf, P* kc, P* vc) {
  const int64_t H = a.H, Hkv = a.Hkv, D = a.D, Wq = (H + 2 * Hkv) * D;
  if (!L.qk_norm.empty())
    for (int64_t m = m0; m < m1; ++m)
      for (int64_t hd = 0; hd < H + Hkv; ++hd) {
        E* head = qkv + m * Wq + hd * D;
        rms_on<E>(avx2, head, L.qk_norm[hd < H ? 0 : 1].data_ptr<E>(), D, float(L.eps), head);
      }
  const Heads rows{a.T * Wq, Wq, D};
  rope_and_write<E, P>(a, qkv, rows, qkv + H * D, rows, qkv + (H + Hkv) * D, rows, cp, sp, slots, m0, m1, qf, kc, vc);
}

class DecodeStack : public torch::CustomClassHolder {
 public:
  DecodeStack(int64_t num_heads, int64_t num_kv_heads, double scale)
      : H_(num_heads), Hkv_(num_kv_heads), scale_(scale) {
    TORCH_CHECK(H_ > 0 && Hkv_ > 0 && H_ % Hkv_ == 0, "DecodeStack: heads must be a multiple of kv heads");
  }

  void add_layer(at::Tensor ln1, at::Tensor ln2, double eps, std::vector<at::Tensor> qkv, std::vector<at::Tensor> o,
                 std::vector<at::Tensor> gate_up, std::vector<at::Tensor> down, std::vector<int64_t> bits,
                 std::vector<int64_t> digits, std::vector<int64_t> rotated, std::vector<at::Tensor> qk_norm) {
    TORCH_CHECK(bits.size() == 4 && digits.size() == 4 && rotated.size() == 4,
                "DecodeStack: bits, digits and rotated have four entries");
    for (at::Tensor& w : qk_norm) w = w.contiguous();  // the one region reads the norms' weights by pointer
    StackLayer L{ln1.contiguous(), ln2.contiguous(), eps, {qkv, o, gate_up, down}, {}, {}, {}, qk_norm, {}};
    bool packed = true;
    for (int i = 0; i < 4; ++i) {
      L.bits[i] = bits[i], L.digits[i] = digits[i], L.rotated[i] = rotated[i];
      TORCH_CHECK(bits[i] == 32 ? L.lin[i].size() == 1u || L.lin[i].size() == 2u
                                : L.lin[i].size() == (bits[i] < 0 ? 2u : 3u),
                  "DecodeStack: each linear is [qweight, scales, mins], [codes, scales] with negated bits, "
                  "or [weight] or [weight, panels] with bits 32");
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
    return run(x, cos, sin, positions, k_pool, v_pool, write_slots, tables, first, last, nullptr);
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
    const at::Tensor h = run(x, cos, sin, positions, k_pool, v_pool, write_slots, tables, 0, size(), nullptr).contiguous();
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
    return run(x, cos, sin, positions, k_pool, v_pool, write_slots, tables, first, last, lora.get());
  }

  bool one_region() const { return one_region_; }
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
  at::Tensor run(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin, const at::Tensor& positions,
                 const at::Tensor& k_pool, const at::Tensor& v_pool, const at::Tensor& write_slots,
                 const at::Tensor& tables, int64_t first, int64_t last, const LoraBatch* lora) {
    TORCH_CHECK(0 <= first && first <= last && last <= size(), "DecodeStack: layers ", first, "..", last, " of ", size());
    TORCH_CHECK(k_pool.dim() == 5 && v_pool.sizes() == k_pool.sizes() && k_pool.size(0) == size(),
                "DecodeStack: the pool must be (layers, blocks, block_size, kv_heads, head_dim)");
    // the pool holds the activations' dtype, or bfloat16 under float32 activations
    const bool bf16_pool = k_pool.scalar_type() == at::kBFloat16;
    if (lora == nullptr && regions_ && one_region_ && x.dim() == 3 && x.scalar_type() == at::kFloat &&
        x.size(0) * x.size(1) <= kStackRows && x.size(2) == C_ && k_pool.size(4) == D_)
      return bf16_pool ? forward_one_region<c10::BFloat16>(x, cos, sin, positions, k_pool, v_pool, write_slots,
                                                           tables, first, last)
                       : forward_one_region<float>(x, cos, sin, positions, k_pool, v_pool, write_slots, tables,
                                                   first, last);
    if (lora == nullptr && regions_ && panels_region_ && x.dim() == 3 && x.scalar_type() == panel_dtype_ &&
        x.size(0) * x.size(1) <= kStackRows && x.size(2) == C_ && k_pool.size(4) == D_) {
      const bool bf16 = panel_dtype_ == at::kBFloat16;
      // the dot product reads rows of bfloat16 pairs: every linear's input width even
      if (!panel_path(bf16).dot || (C_ % 2 == 0 && (H_ * D_) % 2 == 0 && I_ % 2 == 0)) {
        if (bf16)
          return forward_panels<c10::BFloat16, c10::BFloat16>(x, cos, sin, positions, k_pool, v_pool, write_slots,
                                                              tables, first, last);
        return bf16_pool ? forward_panels<float, c10::BFloat16>(x, cos, sin, positions, k_pool, v_pool, write_slots,
                                                                tables, first, last)
                         : forward_panels<float, float>(x, cos, sin, positions, k_pool, v_pool, write_slots, tables,
                                                        first, last);
      }
    }
    at::Tensor h = x;
    for (int64_t l = first; l < last; ++l) {
      const StackLayer& L = layers_[l];
      h = layer_step(h, L.ln1, L.ln2, L.eps, L.lin[0], L.lin[1], L.lin[2], L.lin[3], L.bits, L.digits, L.rotated,
                     L.qk_norm, cos, sin, positions, k_pool.select(0, l), v_pool.select(0, l), write_slots, tables,
                     H_, Hkv_, scale_, rows_silu_, lora, l);
    }
    return h;
  }

  template <typename P>
  at::Tensor forward_one_region(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin,
                                const at::Tensor& positions, const at::Tensor& k_pool, const at::Tensor& v_pool,
                                const at::Tensor& write_slots, const at::Tensor& tables, int64_t first, int64_t last);
  template <typename E, typename P>
  at::Tensor forward_panels(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin,
                            const at::Tensor& positions, const at::Tensor& k_pool, const at::Tensor& v_pool,
                            const at::Tensor& write_slots, const at::Tensor& tables, int64_t first, int64_t last);

  std::vector<StackLayer> layers_;
  int64_t H_, Hkv_, D_ = 0, C_ = 0, I_ = 0;
  double scale_;
  bool one_region_ = false;
  bool panels_region_ = false;
  bool regions_ = true;
  int64_t whole_rows_ = kWholeRows;
  at::ScalarType panel_dtype_ = at::kFloat;
  bool rows_silu_ = false;
};

template <typename P>
at::Tensor DecodeStack::forward_one_region(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin,
                                           const at::Tensor& positions, const at::Tensor& k_pool,
                                           const at::Tensor& v_pool, const at::Tensor& write_slots,
                                           const at::Tensor& tables, int64_t first, int64_t last) {
  const int64_t B = x.size(0), T = x.size(1), M = B * T, C = C_, I = I_, H = H_, Hkv = Hkv_, D = D_;
  const int64_t Wq = (H + 2 * Hkv) * D;
  TORCH_CHECK(k_pool.is_contiguous() && v_pool.is_contiguous() &&
              k_pool.scalar_type() == c10::CppTypeToScalarType<P>::value &&
              v_pool.scalar_type() == k_pool.scalar_type() && k_pool.size(3) == Hkv, "DecodeStack: pool layers");
  const PagedIndex ix = checked_index(positions, write_slots, tables, M, B, cos, sin, D, k_pool.size(1), k_pool.size(2));
  at::Tensor h = x.contiguous().clone();  // (B, T, C): the residual stream, updated in place
  if (M == 0) return h;
  const int64_t maxK = std::max({C, H * D, I});
  std::vector<float> att(M * H * D), qkv(M * Wq), qf(M * H * D), gu(M * 2 * I), y(M * C);
  const int threads = at::get_num_threads();
  const bool whole = M <= whole_rows_;  // every thread does every row's norm and quantization
  const int copies = whole ? threads : 1;
  // the rows a linear reads (quantized), and the norm's or silu*up's output before that: a copy a thread, or one
  std::vector<ferrum_qact::Q8Rows> Xs(copies, ferrum_qact::rows_for(M, maxK, 2));
  std::vector<std::vector<float>> xns(copies, std::vector<float>(M * maxK)), scratches(xns);
  const AttnArgs args{B, T, H, Hkv, D, k_pool.size(2), ix.tab.size(1), ix.pos.data_ptr<int64_t>(),
                      ix.tab.data_ptr<int64_t>(), float(scale_)};
  const int64_t layer_elems = k_pool.stride(0), *slots = ix.slots.data_ptr<int64_t>();
  float* hp = h.data_ptr<float>();
  P *kp = k_pool.data_ptr<P>(), *vp = v_pool.data_ptr<P>();
  const float *cp = cos.data_ptr<float>(), *sp = sin.data_ptr<float>();
  const bool avx2 = avx2_on();
  const int isa = ferrum_qact::isa_level();
  AttnPlan plan = attention_plan(args, threads);  // the same positions in every layer
  SpinBarrier bar;
#pragma omp parallel num_threads(threads)
  {
    const int tid = omp_get_thread_num(), nt = omp_get_num_threads();
#pragma omp single
    bar.set_threads(nt);  // the team as formed (single's own barrier publishes it)
    auto mine = [&](int64_t n) { return std::pair<int64_t, int64_t>{n * tid / nt, n * (tid + 1) / nt}; };
    auto rows = [&](int64_t n) { return whole ? std::pair<int64_t, int64_t>{0, n} : mine(n); };  // this thread's rows
    auto rows_ready = [&] { if (!whole) bar.wait(); };  // every thread's rows, where each did its share
    ferrum_qact::Q8Rows& X = Xs[whole ? tid : 0];
    float *xn = xns[whole ? tid : 0].data(), *scratch = scratches[whole ? tid : 0].data();
    auto rms = [&](const float* in, const at::Tensor& w, int64_t c, double eps, float* out) {
      rms_on(avx2, in, w.data_ptr<float>(), c, float(eps), out);
    };
    // rows of `in` (M, K) quantized for linear i: this thread's rows
    auto quantize_rows = [&](const StackLayer& L, int i, const float* in, int64_t K) {
      const auto [m0, m1] = rows(M);
      ferrum_qact::quantize_blocks(in, m0 * K / 32, m1 * K / 32, K, int(L.digits[i]), L.rotated[i] != 0, isa, X,
                                   scratch);
    };
    // linear i over the quantized rows: this thread's units into out (M, N)
    auto linear = [&](const StackLayer& L, int i, float* out) {
      const auto [u0, u1] = mine(L.packed[i].U);
      ferrum_qact::run_units(isa, L.packed[i], int(-L.bits[i]), u0, u1, X, M, int(L.digits[i]), out);
      return std::pair<int64_t, int64_t>{u0 * 16, std::min(u1 * 16, L.packed[i].N)};
    };
    auto norm_and_quantize = [&](const StackLayer& L, const at::Tensor& w, int i) {  // h's rows for linear i
      const auto [m0, m1] = rows(M);
      for (int64_t m = m0; m < m1; ++m) rms(hp + m * C, w, C, L.eps, xn + m * C);
      quantize_rows(L, i, xn, C);
    };
    auto residual = [&](std::pair<int64_t, int64_t> cols) {  // h += y over this thread's columns
      for (int64_t m = 0; m < M; ++m)
        for (int64_t n = cols.first; n < cols.second; ++n) hp[m * C + n] += y[m * C + n];
    };
    for (int64_t l = first; l < last; ++l) {
      const StackLayer& L = layers_[l];
      P *kc = kp + l * layer_elems, *vc = vp + l * layer_elems;
      norm_and_quantize(L, L.ln1, 0);
      rows_ready();
      linear(L, 0, qkv.data());
      bar.wait();
      {
        // o's weights (a thread's share: ~90 KB on SmolLM2) into L2 while RoPE and the
        // attention run, which leave memory idle: o's phase 206 -> 121 us a step,
        // RoPE's 35 -> 97 (issuing the hints), the step 0.03-0.06 ms shorter, w4a8
        // batch 1 on Zen 4, alternating rounds.  The same at the start of the other
        // linears (32 KB, behind their 1-2 us phases) measured nothing.
        const auto [o0, o1] = mine(L.packed[1].U);
        ferrum_qact::prefetch_units(L.packed[1], int(-L.bits[1]), o0, o1, kPrefetchBytes);
        const auto [m0, m1] = mine(M);
        norm_rope_rows<float, P>(args, L, avx2, qkv.data(), m0, m1, cp, sp, slots, qf.data(), kc, vc);
      }
      bar.wait();
      {
        const auto [t0, t1] = attention_share(plan, tid, nt);
        attend_tasks<float, P>(args, plan, qf.data(), kc, vc, t0, t1, att.data());
      }
      bar.wait();
      quantize_rows(L, 1, att.data(), H * D);
      rows_ready();
      residual(linear(L, 1, y.data()));
      bar.wait();
      norm_and_quantize(L, L.ln2, 2);
      rows_ready();
      linear(L, 2, gu.data());
      bar.wait();
      {  // silu(gate) * up and its quantization, by blocks of 32 (every block where `whole`)
        const auto [b0, b1] = whole ? std::pair<int64_t, int64_t>{0, M * I / 32} : mine(M * I / 32);
        for (int64_t b = b0; b < b1; ++b) {
          const int64_t m = b / (I / 32), c = b % (I / 32) * 32;
          const float* g = gu.data() + m * 2 * I + c;
          silu_mul_on(avx2, g, g + I, 32, xn + m * I + c);
        }
        ferrum_qact::quantize_blocks(xn, b0, b1, I, int(L.digits[3]), L.rotated[3] != 0, isa, X, scratch);
      }
      rows_ready();
      residual(linear(L, 3, y.data()));
      bar.wait();
    }
  }
  return h;
}

// The step of a few rows when every linear is a float panel linear (the batch-
// invariant float32 and bfloat16 models): one parallel region as above, each
// linear's panels shared out (panel_range), norms, RoPE and the pool write by the
// threads that own the rows, the attention's tasks by attention_share, silu*up by
// blocks of 32.  Each output is the per-op path's arithmetic (rms_norm,
// panel_linear, paged_attention, silu_mul_rows, the residual adds rounded as
// ATen rounds a bfloat16 sum), so the bits equal layer_step's.
template <typename E, typename P>
at::Tensor DecodeStack::forward_panels(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin,
                                       const at::Tensor& positions, const at::Tensor& k_pool,
                                       const at::Tensor& v_pool, const at::Tensor& write_slots,
                                       const at::Tensor& tables, int64_t first, int64_t last) {
  const int64_t B = x.size(0), Tn = x.size(1), M = B * Tn, C = C_, I = I_, H = H_, Hkv = Hkv_, D = D_;
  const int64_t Wq = (H + 2 * Hkv) * D;
  TORCH_CHECK(k_pool.is_contiguous() && v_pool.is_contiguous() &&
              k_pool.scalar_type() == c10::CppTypeToScalarType<P>::value &&
              v_pool.scalar_type() == k_pool.scalar_type() && k_pool.size(3) == Hkv, "DecodeStack: pool layers");
  const PagedIndex ix = checked_index(positions, write_slots, tables, M, B, cos, sin, D, k_pool.size(1), k_pool.size(2));
  at::Tensor h = x.contiguous().clone();  // (B, T, C): the residual stream, updated in place
  if (M == 0) return h;
  const PanelPath path = panel_path(std::is_same_v<E, c10::BFloat16>);
  const bool widen = !std::is_same_v<E, float> && !path.dot;  // the tiles read bfloat16 rows widened to float32
  const int64_t maxK = std::max({C, H * D, I});
  std::vector<E> att(M * H * D), qkv(M * Wq), gu(M * 2 * I), y(M * C);
  std::vector<float> qf(M * H * D);
  const int threads = at::get_num_threads();
  const bool whole = M <= whole_rows_;  // every thread does every row's norm (and widening)
  const int copies = whole ? threads : 1;
  // a linear's input rows (the norm's or silu*up's output), and those widened: a copy a thread, or one
  std::vector<std::vector<E>> xns(copies, std::vector<E>(M * maxK));
  std::vector<std::vector<float>> xws(copies, std::vector<float>(widen ? M * maxK : 0));
  const AttnArgs args{B, Tn, H, Hkv, D, k_pool.size(2), ix.tab.size(1), ix.pos.data_ptr<int64_t>(),
                      ix.tab.data_ptr<int64_t>(), float(scale_)};
  const int64_t layer_elems = k_pool.stride(0), *slots = ix.slots.data_ptr<int64_t>();
  E* hp = h.data_ptr<E>();
  P *kp = k_pool.data_ptr<P>(), *vp = v_pool.data_ptr<P>();
  const float *cp = cos.data_ptr<float>(), *sp = sin.data_ptr<float>();
  const bool avx2 = avx2_on();
  AttnPlan plan = attention_plan(args, threads);  // the same positions in every layer
  SpinBarrier bar;
#pragma omp parallel num_threads(threads)
  {
    const int tid = omp_get_thread_num(), nt = omp_get_num_threads();
#pragma omp single
    bar.set_threads(nt);  // the team as formed (single's own barrier publishes it)
    auto mine = [&](int64_t n) { return std::pair<int64_t, int64_t>{n * tid / nt, n * (tid + 1) / nt}; };
    auto rows = [&](int64_t n) { return whole ? std::pair<int64_t, int64_t>{0, n} : mine(n); };  // this thread's rows
    auto rows_ready = [&] { if (!whole) bar.wait(); };  // every thread's rows, where each did its share
    E* xn = xns[whole ? tid : 0].data();
    float* xw = xws[whole ? tid : 0].data();
    // elements [i0, i1) of `in` into xw, where the tiles read float32
    auto widened = [&](const E* in, int64_t i0, int64_t i1) {
      if (widen)
        for (int64_t i = i0; i < i1; ++i) xw[i] = load(in[i]);
    };
    // linear i over the rows `in` (M, K): this thread's panels into out (M, N); its columns
    auto linear = [&](const StackLayer& L, int i, const E* in, int64_t K, E* out) {
      const at::Tensor& panels = L.lin[i][1];
      const int64_t N = L.lin[i][0].size(0);
      const auto [p0, p1] = mine(panels.size(0));
      panel_range<E>(path, widen ? static_cast<const void*>(xw) : in, K, M, panels, K, N, p0, p1, out);
      return std::pair<int64_t, int64_t>{p0 * 16, std::min(p1 * 16, N)};
    };
    auto norm = [&](const at::Tensor& w, double eps) {  // h's rows into xn: this thread's rows
      const auto [m0, m1] = rows(M);
      for (int64_t m = m0; m < m1; ++m) rms_on<E>(avx2, hp + m * C, w.data_ptr<E>(), C, float(eps), xn + m * C);
      widened(xn, m0 * C, m1 * C);
    };
    auto residual = [&](std::pair<int64_t, int64_t> cols) {  // h += y over this thread's columns
      for (int64_t m = 0; m < M; ++m)
        for (int64_t n = cols.first; n < cols.second; ++n)
          hp[m * C + n] = store<E>(load(hp[m * C + n]) + load(y[m * C + n]));
    };
    for (int64_t l = first; l < last; ++l) {
      const StackLayer& L = layers_[l];
      P *kc = kp + l * layer_elems, *vc = vp + l * layer_elems;
      norm(L.ln1, L.eps);
      rows_ready();
      linear(L, 0, xn, C, qkv.data());
      bar.wait();
      {
#ifdef FERRUM_X86
        {  // o's panels (this thread's share) into L2 while RoPE and the attention leave memory idle
          const at::Tensor& panels = L.lin[1][1];
          const int64_t bytes = panels.nbytes() / panels.size(0);
          const auto [p0, p1] = mine(panels.size(0));
          const char* base = static_cast<const char*>(panels.data_ptr()) + p0 * bytes;
          const int64_t n = std::min((p1 - p0) * bytes, kPrefetchBytes);
          for (int64_t i = 0; i < n; i += 64) _mm_prefetch(base + i, _MM_HINT_T1);
        }
#endif
        const auto [m0, m1] = mine(M);
        norm_rope_rows<E, P>(args, L, avx2, qkv.data(), m0, m1, cp, sp, slots, qf.data(), kc, vc);
      }
      bar.wait();
      {
        const auto [t0, t1] = attention_share(plan, tid, nt);
        attend_tasks<E, P>(args, plan, qf.data(), kc, vc, t0, t1, att.data());
      }
      bar.wait();
      if (widen) {
        const auto [m0, m1] = rows(M);
        widened(att.data(), m0 * H * D, m1 * H * D);
        rows_ready();
      }
      residual(linear(L, 1, att.data(), H * D, y.data()));
      bar.wait();
      norm(L.ln2, L.eps);
      rows_ready();
      linear(L, 2, xn, C, gu.data());
      bar.wait();
      {  // silu(gate) * up by blocks of 32 (a row's vector loops and tail as silu_mul_rows runs them)
        const int64_t per_row = (I + 31) / 32;
        const auto [b0, b1] = whole ? std::pair<int64_t, int64_t>{0, M * per_row} : mine(M * per_row);
        for (int64_t b = b0; b < b1; ++b) {
          const int64_t m = b / per_row, c = b % per_row * 32, n = std::min<int64_t>(32, I - c);
          const E* g = gu.data() + m * 2 * I + c;
          silu_mul_on<E>(avx2, g, g + I, n, xn + m * I + c);
          widened(xn, m * I + c, m * I + c + n);
        }
      }
      rows_ready();
      residual(linear(L, 3, xn, I, y.data()));
      bar.wait();
    }
  }
  return h;
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
      .def("set_whole_rows", &ferrum_fused::DecodeStack::set_whole_rows)
      .def("one_region", &ferrum_fused::DecodeStack::one_region)
      .def("panels_region", &ferrum_fused::DecodeStack::panels_region)
      .def("size", &ferrum_fused::DecodeStack::size);
  m.def("decode_layer(Tensor x, Tensor ln1, Tensor ln2, float eps, Tensor[] qkv, Tensor[] o, Tensor[] gate_up, "
        "Tensor[] down, int[] bits, int[] digits, int[] rotated, Tensor[] qk_norm, Tensor cos, Tensor sin, "
        "Tensor positions, Tensor(a!) k_cache, Tensor(b!) v_cache, Tensor write_slots, Tensor tables, "
        "int num_heads, int num_kv_heads, float scale) -> Tensor");
}

TORCH_LIBRARY_IMPL(ferrum_fused, CPU, m) {
  m.impl("decode_layer", &ferrum_fused::decode_layer);
}
