// The fused CPU ops for the decode step, one file each: each replaces a run of
// small eager ops, each of which pays a dispatch and a pass over its tensors:
//
//   rms_norm.cpp      rms_norm: x * rsqrt(mean(x^2) + eps) * weight          (~8 ops -> 1)
//   silu_mul.cpp      silu_mul, silu_mul_rows: silu(gate) * up over a fused
//                     gate|up projection                                     (~4 ops -> 1)
//   attention.cpp     paged_attention: RoPE on q and k, k/v written into the paged pool,
//                     causal attention read straight from the pool blocks   (~25 ops -> 1)
//   linear_rows.cpp   linear_rows: a float32 or bfloat16 linear over 1-4 rows, at memory
//                     speed; linear_rows_tiled: the same arithmetic over any number of
//                     rows
//   panel_gemm.cpp    pack_panels, panel_linear: the batch-invariant float linear, an
//                     outer-product GEMM over packed weight panels, one chain per output
//   decode_stack.cpp  decode_layer (a whole decoder layer) and DecodeStack (a model's
//                     layers, a decode step one call; decode_stack.h), built from the
//                     ops above
//   stack_regions.cpp DecodeStack's steps of a few rows as one OpenMP region
//   greedy.cpp        greedy_rows: a row of logits' largest value and its index, its
//                     smallest value and its log-normaliser, one pass (token choice)
//   lora.cpp          LoraAdapter, LoraBatch: LoRA deltas per row, each row its own
//                     adapter, after a projection (lora.h; the decode stack calls them)
//
// Each file registers its ops in the ferrum_fused library (decode_stack.cpp
// defines it, the others add fragments).  The eager torch ops in
// models/llama.py stay the fallback (--step-ops eager) and the reference these
// are probed against.  This header: what the files call in one another.
#pragma once

#include "common.h"

#include <c10/util/Half.h>

#include <optional>
#include <utility>
#include <vector>

namespace ferrum_fused {

// rms_norm.cpp: one row of c on the loops `avx2` picks (rms_norm's and the decode stack's: the same bits).
template <typename T>
void rms_on(bool avx2, const T* x, const T* w, int64_t c, float eps, T* y);
at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps);

// silu_mul.cpp: y = silu(g) * u over n elements on the loops `avx2` picks (silu_mul's and the decode stack's).
template <typename T>
void silu_mul_on(bool avx2, const T* g, const T* u, int64_t n, T* y);
at::Tensor silu_mul(const at::Tensor& gate_up);
at::Tensor silu_mul_rows(const at::Tensor& gate_up);  // this file's loops for any row count

// linear_rows.cpp: x (..., K) with 1-4 rows times weight (N, K), both float32 or both bfloat16.
constexpr int64_t kLinearRowsMax = 4;
at::Tensor linear_rows(const at::Tensor& x, const at::Tensor& weight);
// What linear_rows_with runs beside the linear: prepare(x2d, out) first, with x's
// rows (M, K) contiguous and the output (M, N) not yet written; then in each thread of
// one parallel region (or once, tid 0 of 1, on one thread) before(tid, nt, n0, n1),
// that thread's outputs [n0, n1) of the linear, a barrier, after(n0, n1) (every
// output one thread's).
struct RowsHook {
  virtual void prepare(const at::Tensor& x2d, const at::Tensor& out) = 0;
  virtual void before(int tid, int nt, int64_t n0, int64_t n1) = 0;
  virtual void after(int tid, int64_t n0, int64_t n1) = 0;
  // whether after() reads what other threads' before() wrote (a barrier between them)
  virtual bool joins() const { return true; }
  virtual ~RowsHook() = default;
};
// linear_rows (the same bits) with `hook` in its parallel region: no fork of its own.
at::Tensor linear_rows_with(const at::Tensor& x, const at::Tensor& weight, RowsHook& hook);

// panel_gemm.cpp: weight (N, K) packed once; x (..., K) times it -> (..., N), each output one chain over K.
at::Tensor pack_panels(const at::Tensor& weight);
at::Tensor panel_linear(const at::Tensor& x, const at::Tensor& panels, int64_t N);
// Which tiles panel_linear runs now: bfloat16 by the dot product (x read as
// bfloat16 pairs, rows of even width) or by fused multiply-adds (x read as float32).
struct PanelPath {
  bool bf16, dot;
  int isa;
};
PanelPath panel_path(bool bf16);
// panel_linear's outputs of panels [p0, p1) (columns [16 p0, 16 p1) & N) for M rows
// xs (row stride ldx, as `path` reads them) into y (M, N): the same bits however
// the panels are shared out.
template <typename T>
void panel_range(const PanelPath& path, const void* xs, int64_t ldx, int64_t M, const at::Tensor& panels, int64_t K,
                 int64_t N, int64_t p0, int64_t p1, T* y);

// ---- attention.cpp ------------------------------------------------------------------
// An int8 pool's row (a token's kv head, D values) is quantized in blocks of
// kKvScaleBlock values from its start, llama.cpp's q8_0: each block its own scale
// (absmax / 127 of the block), the last block shorter where D is no multiple of it
// (kv_scale_blocks(D) scales a row; one, of the whole row, where D <= 32).  A block's
// scale is a row's own, so a token's cached bits never depend on other rows.
constexpr int64_t kKvScaleBlock = 32;
inline int64_t kv_scale_blocks(int64_t D) { return (D + kKvScaleBlock - 1) / kKvScaleBlock; }

// An int8 pool layer's scales: (blocks, block_size, Hkv, kv_scale_blocks(D)) float16
// (kv/pool.py SCALE_DTYPE); a row at pool offset o (in elements) has its scales from
// (o / D) * kv_scale_blocks(D).  Null for a float pool.
struct KvScales {
  c10::Half* data = nullptr;
  float get(int64_t i) const { return float(data[i]); }
  // the scale s rounded to float16 (to nearest even) and stored at i; returns what was stored
  float put(int64_t i, float s) const { return float(data[i] = c10::Half(s)); }
  KvScales plus(int64_t n) const { return {data + n}; }  // the scales from element n on
};
// A scales tensor's view, checked: float16, contiguous.
KvScales kv_scales(const at::Tensor& t, const char* who);

struct AttnArgs {
  int64_t B, T, H, Hkv, D, bs, nb;
  const int64_t *pos, *tables;
  float scale;
  // An int8 pool layer's scales: rope_and_write writes them, the tasks read them.
  KvScales k_scale = {}, v_scale = {};
};

// An int8 pool's row: x (d) float32 -> q (d) int8 and its kv_scale_blocks(d) scales
// into s from index at.  Each block: scale = absmax / 127 rounded to s's storage, each
// value round(x / scale) (to nearest even, by the stored scale) clamped to +-127; a
// zero block scale 0 and values 0, a block with a NaN a NaN scale, with an infinity an
// infinite one (values 0 where the scale is not finite and positive).  kv/pool.py's
// quantize_rows: the same bits.
void quantize_row(const float* x, int64_t d, int8_t* q, const KvScales& s, int64_t at);

// The pool's indices checked (positions against cos/sin and the tables, write
// slots and block ids against the pool), as contiguous int64.
struct PagedIndex {
  at::Tensor pos, slots, tab;
};
PagedIndex checked_index(const at::Tensor& positions, const at::Tensor& write_slots, const at::Tensor& tables,
                         int64_t BT, int64_t B, const at::Tensor& cos, const at::Tensor& sin, int64_t D,
                         int64_t blocks, int64_t bs);

// Strides of a (B, T, heads, D) tensor with a contiguous last dim.
struct Heads {
  int64_t b, t, h;
};

// RoPE on each (b, t) of [bt0, bt1)'s queries (into qf (B*T, H, D) float32) and
// keys, and those keys and values written into the pool layer (slots sp).  The
// pool holds P: the activations' T, or bfloat16 under float32 activations (each
// key and value rounded once, as it is written), or int8 (each row quantized by
// quantize_row from its float32 value, its scales into a.k_scale / a.v_scale).
template <typename T, typename P = T>
void rope_and_write(const AttnArgs& a, const T* qp, Heads qs, const T* kp, Heads ks, const T* vp, Heads vs,
                    const float* cp, const float* snp, const int64_t* sp, int64_t bt0, int64_t bt1, float* qfp,
                    P* kc, P* vc);

// The attention's arithmetic is fixed per query, whatever the batch, the other
// queries of the forward, the thread count or the path (prompt, decode step,
// decode stack): its keys in chunks of kAttnChunk from key 0; per chunk and head
// the scores' max m, the sum l of exp(score - m) and the values' weighted sum; the
// chunks merged in order (attention_tasks.cpp).  A task is a block of up to
// kAttnBlock consecutive queries of one sequence (their K and V rows read once for
// the block and the kv head's query heads), one kv head, its heads [g0, g1) and its
// chunks [c0, c1): all of them, the output written; or one (a short batch: its
// chunks spread over the threads), the chunk's partial kept, and the group's last
// task to finish merges the partials.  How the work is cut into tasks (which
// depends on the threads) changes no bit.
constexpr int64_t kAttnChunk = 256;
constexpr int64_t kAttnBlock = 8;

struct AttnTask {
  int64_t b, t0, t1, kvh, g0, g1, c0, c1, cost;
  int64_t group;  // split chunks: the index of the tasks of the same queries and heads, else -1
};

struct AttnPlan {
  std::vector<AttnTask> tasks;
  std::vector<int64_t> cost_end;  // tasks' costs summed through each task
  std::vector<int> done;          // split chunks: each group's tasks finished (back to 0 once merged)
  int64_t chunks = 0;             // the most chunks of any query: the partials' stride
  std::vector<float> part;        // split chunks' partials: (B*T, H, chunks, 2 + D), m, l, then the sums
  // claimed (attend_claimed): the tasks as the threads take them, the costliest first, and
  // the next one's index in that order
  bool claimed = false;
  std::vector<int64_t> order;
  int64_t next = 0;
};

// The tasks for the queries of `a` on `threads` threads; `claim`: a caller that runs
// one region for this one forward may have its unsplit tasks claimed (attend_claimed).
AttnPlan attention_plan(const AttnArgs& a, int threads, bool claim = false);

// Thread `tid` of `nt`'s share of the plan's tasks, balanced by their keys.
std::pair<int64_t, int64_t> attention_share(const AttnPlan& plan, int tid, int nt);

// Tasks [begin, end) of the plan (after rope_and_write): out (B*T, H*D) in T from a
// pool of P (rope_and_write's).  Tasks may run on any threads at once; out is
// complete once all have run.
template <typename T, typename P = T>
void attend_tasks(const AttnArgs& a, AttnPlan& plan, const float* qfp, const P* kc, const P* vc, int64_t begin,
                  int64_t end, T* op);

// The plan's tasks taken one at a time by whichever thread is free, the costliest
// first, until none is left (plan.claimed; each thread of the region calls it once).
// Which thread runs a task changes no bit.
template <typename T, typename P = T>
void attend_claimed(const AttnArgs& a, AttnPlan& plan, const float* qfp, const P* kc, const P* vc, T* op);

at::Tensor paged_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& cos,
                           const at::Tensor& sin, const at::Tensor& positions, const at::Tensor& k_cache,
                           const at::Tensor& v_cache, const at::Tensor& write_slots, const at::Tensor& tables,
                           double scale, const std::optional<at::Tensor>& k_scale = std::nullopt,
                           const std::optional<at::Tensor>& v_scale = std::nullopt);

}  // namespace ferrum_fused
