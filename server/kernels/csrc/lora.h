// LoRA deltas on the fused CPU path (lora.cpp): an adapter's weights held per layer
// and fused projection (LoraAdapter), and one forward's rows with the adapter each
// runs (LoraBatch), which adds every row's delta (x @ A^T) @ B^T to a projection's
// output in place.  decode_stack.cpp registers both classes (before DecodeStack,
// whose forward_lora takes a LoraBatch) and calls LoraBatch::linear for its float
// linears (the deltas in the linear's parallel region), LoraBatch::apply after the others.
#pragma once

#include <torch/custom_class.h>

#include "common.h"

#include <array>
#include <vector>

namespace ferrum_fused {

// The projections of a decoder layer an adapter can touch, as the decode stack's
// linears are numbered: fused q|k|v, o, fused gate|up, down.
constexpr int kLoraSites = 4;

// B's outputs a packed block (lora.cpp's vectors read a block's rank rows in turn).
constexpr int64_t kLoraPack = 32;

// One module's B, packed: (blocks, rank, kLoraPack), block j holding outputs
// [j kLoraPack, (j + 1) kLoraPack) & width (zeros past it), each as its rank values;
// read by the module's outputs [out_lo, out_lo + width) and the site's low-rank
// values [r_lo, r_lo + rank).
struct LoraSegment {
  at::Tensor packed;
  int64_t out_lo, width, r_lo, rank, blocks;
};

// An adapter's weights at one (layer, projection): the stacked A (R, K) of the
// modules it targets there and their B blocks.
struct LoraSite {
  at::Tensor a;  // undefined: the adapter leaves this projection alone
  std::vector<LoraSegment> segments;
  int64_t R = 0, K = 0;
};

// One or two rows that run one adapter's weights at a projection: the rows, the
// site, where their low-rank values start in the call's t (R each), and the first
// of their units in each phase (lora.cpp).
struct RowBlock {
  int64_t m[2];
  int rows;
  const LoraSite* site;
  int64_t t_off, down_unit, up_unit;
};

// A projection's deltas for one forward: its row blocks, grouped by adapter, the
// low-rank values and units they take, and their multiply-adds.
struct LoraPlan {
  std::vector<RowBlock> blocks;
  int64_t total_r = 0, total_down = 0, total_up = 0, work = 0;
};

class LoraAdapter : public torch::CustomClassHolder {
 public:
  explicit LoraAdapter(int64_t layers);
  // The weights of projection `site` of `layer`: a (R, K) contiguous; packed[i] a
  // module's B as LoraSegment holds it, on outputs [out_lo[i], + widths[i]) and a's
  // rows [r_lo[i], + its rank).
  void set_site(int64_t layer, int64_t site, at::Tensor a, std::vector<at::Tensor> packed,
                std::vector<int64_t> widths, std::vector<int64_t> out_lo, std::vector<int64_t> r_lo);
  int64_t layers() const { return int64_t(sites_.size()); }
  const LoraSite& site(int64_t layer, int64_t s) const { return sites_[layer][s]; }

 private:
  std::vector<std::array<LoraSite, kLoraSites>> sites_;
};

class LoraBatch : public torch::CustomClassHolder {
 public:
  // rows (M,) int64: each token's index among the adapters added next, -1 the base.
  explicit LoraBatch(const at::Tensor& rows);
  void add_adapter(c10::intrusive_ptr<LoraAdapter> adapter);
  // y (..., N) += each row's delta at projection `site` of `layer`, from x (..., K).
  void apply(int64_t layer, int64_t site, const at::Tensor& x, const at::Tensor& y) const;
  // The Python binding: the same, y returned.
  at::Tensor add(int64_t layer, int64_t site, const at::Tensor& x, at::Tensor y) const;
  // linear_rows(x, weight) with each row's delta at projection `site` of `layer`
  // added: the bits of linear_rows then apply, the deltas inside the linear's own
  // parallel region (no fork or call of their own).
  at::Tensor linear(int64_t layer, int64_t site, const at::Tensor& x, const at::Tensor& weight) const;
  int64_t rows() const { return int64_t(rows_.size()); }

 private:
  // The row blocks of projection `site` of `layer` for x of width K, dtype, into N outputs (checked).
  LoraPlan plan(int64_t layer, int64_t site, int64_t K, int64_t N, at::ScalarType dtype) const;
  std::vector<int64_t> rows_;
  std::vector<c10::intrusive_ptr<LoraAdapter>> adapters_;
  std::vector<int64_t> order_;  // the rows that run an adapter, grouped by adapter (the weights stay in cache)
};

}  // namespace ferrum_fused
