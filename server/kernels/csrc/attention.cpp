// paged_attention: RoPE on q and k, k and v written into the paged pool, and
// causal attention read straight from the pool blocks, one op for the eager
// path's ~25 (fused.h lists the fused ops).  Its pieces (rope_and_write,
// attention_plan, attend_tasks in attention_tasks.cpp) serve the decode stack's
// one-region step too.
#include <ATen/Parallel.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include "fused.h"

#include <algorithm>
#include <type_traits>
#include <vector>

namespace ferrum_fused {
namespace {

constexpr int64_t kRopeGrain = 32;  // tokens a thread's share of RoPE and the pool write at least

// x (D) rotated by RoPE at one position into y: y = x * cos + rotate_half(x) * sin.
template <typename T>
FERRUM_INLINE void rope(const T* x, const float* cos, const float* sin, int64_t d, float* y) {
  const int64_t h = d / 2;
#pragma omp simd
  for (int64_t i = 0; i < h; ++i) y[i] = load(x[i]) * cos[i] - load(x[i + h]) * sin[i];
#pragma omp simd
  for (int64_t i = h; i < d; ++i) y[i] = load(x[i]) * cos[i] + load(x[i - h]) * sin[i];
}

}  // namespace

void quantize_row(const float* x, int64_t d, int8_t* q, const KvScales& s, int64_t at) {
  for (int64_t b0 = 0; b0 < d; b0 += kKvScaleBlock) {
    const int64_t b1 = std::min(d, b0 + kKvScaleBlock);
    float m = 0.0f;
    bool nan = false;
    for (int64_t i = b0; i < b1; ++i) {
      const float a = std::fabs(x[i]);
      nan |= a != a;
      m = a > m ? a : m;
    }
    const float scale = s.put(at + b0 / kKvScaleBlock, nan ? NAN : m / 127.0f);
    const bool ok = std::isfinite(scale) && scale > 0.0f;
    for (int64_t i = b0; i < b1; ++i)
      q[i] = ok ? int8_t(std::clamp(std::nearbyint(x[i] / scale), -127.0f, 127.0f)) : int8_t(0);
  }
}

KvScales kv_scales(const at::Tensor& t, const char* who) {
  TORCH_CHECK(t.scalar_type() == at::kHalf && t.is_contiguous(), who, ": an int8 pool's scales are float16, contiguous");
  return {t.data_ptr<c10::Half>()};
}

PagedIndex checked_index(const at::Tensor& positions, const at::Tensor& write_slots, const at::Tensor& tables,
                         int64_t BT, int64_t B, const at::Tensor& cos, const at::Tensor& sin, int64_t D,
                         int64_t blocks, int64_t bs) {
  TORCH_CHECK(cos.scalar_type() == at::kFloat && sin.scalar_type() == at::kFloat && cos.is_contiguous() &&
              sin.is_contiguous() && cos.dim() == 2 && cos.size(1) == D && sin.sizes() == cos.sizes(),
              "paged_attention: cos/sin must be (positions, D) float32");
  PagedIndex ix{positions.to(at::kLong).contiguous(), write_slots.to(at::kLong).contiguous(),
                tables.to(at::kLong).contiguous()};
  TORCH_CHECK(ix.pos.numel() == BT && ix.slots.numel() == BT && ix.tab.dim() == 2 && ix.tab.size(0) == B,
              "paged_attention: positions/slots/tables shapes");
  const int64_t *pp = ix.pos.data_ptr<int64_t>(), *sp = ix.slots.data_ptr<int64_t>();
  for (int64_t i = 0; i < BT; ++i) {
    TORCH_CHECK(sp[i] >= 0 && sp[i] < blocks * bs, "paged_attention: write slot out of range");
    TORCH_CHECK(pp[i] >= 0 && pp[i] < cos.size(0) && pp[i] < ix.tab.size(1) * bs,
                "paged_attention: position out of range");
  }
  const int64_t* tp = ix.tab.data_ptr<int64_t>();
  for (int64_t i = 0; i < ix.tab.numel(); ++i)
    TORCH_CHECK(tp[i] >= 0 && tp[i] < blocks, "paged_attention: block id out of range");
  return ix;
}

template <typename T, typename P>
void rope_and_write(const AttnArgs& a, const T* qp, Heads qs, const T* kp, Heads ks, const T* vp, Heads vs,
                    const float* cp, const float* snp, const int64_t* sp, int64_t bt0, int64_t bt1, float* qfp,
                    P* kc, P* vc) {
  const int64_t H = a.H, Hkv = a.Hkv, D = a.D;
  std::vector<float> tmp(D), vtmp(D);
  for (int64_t bt = bt0; bt < bt1; ++bt) {
    const int64_t b = bt / a.T, t = bt % a.T, p = a.pos[bt];
    const float *c = cp + p * D, *s = snp + p * D;
    for (int64_t h = 0; h < H; ++h) rope(qp + b * qs.b + t * qs.t + h * qs.h, c, s, D, qfp + (bt * H + h) * D);
    for (int64_t h = 0; h < Hkv; ++h) {
      rope(kp + b * ks.b + t * ks.t + h * ks.h, c, s, D, tmp.data());
      P* kd = kc + (sp[bt] * Hkv + h) * D;
      P* vd = vc + (sp[bt] * Hkv + h) * D;
      const T* vsrc = vp + b * vs.b + t * vs.t + h * vs.h;
      if constexpr (std::is_same_v<P, int8_t>) {  // each row quantized on its own, its scales beside it
        for (int64_t i = 0; i < D; ++i) vtmp[i] = load(vsrc[i]);
        const int64_t at = (sp[bt] * Hkv + h) * kv_scale_blocks(D);
        quantize_row(tmp.data(), D, kd, a.k_scale, at);
        quantize_row(vtmp.data(), D, vd, a.v_scale, at);
        continue;
      }
      for (int64_t i = 0; i < D; ++i) {
        kd[i] = store<P>(tmp[i]);
        if constexpr (std::is_same_v<T, P>) vd[i] = vsrc[i];
        else if constexpr (!std::is_same_v<P, int8_t>) vd[i] = store<P>(load(vsrc[i]));
      }
    }
  }
}

template void rope_and_write<float>(const AttnArgs&, const float*, Heads, const float*, Heads, const float*, Heads,
                                    const float*, const float*, const int64_t*, int64_t, int64_t, float*, float*,
                                    float*);
template void rope_and_write<float, c10::BFloat16>(const AttnArgs&, const float*, Heads, const float*, Heads,
                                                   const float*, Heads, const float*, const float*, const int64_t*,
                                                   int64_t, int64_t, float*, c10::BFloat16*, c10::BFloat16*);
template void rope_and_write<c10::BFloat16>(const AttnArgs&, const c10::BFloat16*, Heads, const c10::BFloat16*, Heads,
                                            const c10::BFloat16*, Heads, const float*, const float*, const int64_t*,
                                            int64_t, int64_t, float*, c10::BFloat16*, c10::BFloat16*);
template void rope_and_write<float, int8_t>(const AttnArgs&, const float*, Heads, const float*, Heads, const float*,
                                            Heads, const float*, const float*, const int64_t*, int64_t, int64_t,
                                            float*, int8_t*, int8_t*);
template void rope_and_write<c10::BFloat16, int8_t>(const AttnArgs&, const c10::BFloat16*, Heads,
                                                    const c10::BFloat16*, Heads, const c10::BFloat16*, Heads,
                                                    const float*, const float*, const int64_t*, int64_t, int64_t,
                                                    float*, int8_t*, int8_t*);

AttnPlan attention_plan(const AttnArgs& a, int threads, bool claim) {
  AttnPlan plan;
  const int64_t G = a.H / a.Hkv, C = kAttnChunk;
  struct Block {
    int64_t b, t0, t1, chunks;
  };
  std::vector<Block> blocks;
  for (int64_t b = 0; b < a.B; ++b)
    for (int64_t t0 = 0; t0 < a.T; t0 += kAttnBlock) {
      const int64_t t1 = std::min(a.T, t0 + kAttnBlock);
      int64_t n = 0;
      for (int64_t t = t0; t < t1; ++t) n = std::max(n, a.pos[b * a.T + t] + 1);
      blocks.push_back({b, t0, t1, (n + C - 1) / C});
      plan.chunks = std::max(plan.chunks, blocks.back().chunks);
    }
  // Few blocks (short batches): a task per chunk, then per pair of query heads too, so
  // threads balance (a pair, not a head: the vector loops take a kv head's query heads in
  // pairs, each K and V row read once for both).
  int64_t split_tasks = 0;
  for (const Block& k : blocks) split_tasks += k.chunks * a.Hkv;
  const bool split = int64_t(blocks.size()) * a.Hkv < 4 * threads, per_head = split && split_tasks < 4 * threads;
  const int64_t heads = per_head ? std::min<int64_t>(2, G) : G;  // query heads a task
  const int64_t per_kvh = (G + heads - 1) / heads;                  // tasks a kv head a chunk
  // Split chunks go chunk by chunk, every kv head's tasks of a chunk together: a
  // thread's share is then a run of whole chunks, each pool block read for all its
  // kv heads at once (a token's row holds them side by side), not one kv head's part of
  // it in each of Hkv passes over the context.
  for (const Block& k : blocks) {
    const int64_t first_group = int64_t(plan.done.size());
    if (split) plan.done.resize(plan.done.size() + a.Hkv * per_kvh, 0);
    for (int64_t c0 = 0; c0 < k.chunks; c0 += split ? 1 : k.chunks)
      for (int64_t kvh = 0; kvh < a.Hkv; ++kvh)
        for (int64_t g0 = 0; g0 < G; g0 += heads) {
          const int64_t group = split ? first_group + kvh * per_kvh + g0 / heads : -1;
          const int64_t g1 = std::min(g0 + heads, G), c1 = split ? c0 + 1 : k.chunks;
          int64_t cost = 1;
          for (int64_t t = k.t0; t < k.t1; ++t)
            cost += std::max<int64_t>(0, std::min(a.pos[k.b * a.T + t] + 1, c1 * C) - c0 * C) * (g1 - g0);
          plan.tasks.push_back({k.b, k.t0, k.t1, kvh, g0, g1, c0, c1, cost, group});
          plan.cost_end.push_back((plan.cost_end.empty() ? 0 : plan.cost_end.back()) + cost);
        }
  }
  if (split && plan.chunks > 1) plan.part.resize(a.B * a.T * a.H * plan.chunks * (2 + a.D));
  // Unsplit tasks (a prompt's blocks of queries) differ in cost by their keys, and a
  // static share by cost still leaves threads waiting on each other: where the caller
  // can, they are taken as each thread comes free, the costliest first.  Split tasks
  // keep their shares (runs of whole chunks, read once for all kv heads), as do the
  // decode stack's regions (one plan for every layer, shared out by attention_share).
  plan.claimed = claim && !split && threads > 1;
  if (plan.claimed) {
    plan.order.resize(plan.tasks.size());
    for (size_t i = 0; i < plan.order.size(); ++i) plan.order[i] = int64_t(i);
    std::stable_sort(plan.order.begin(), plan.order.end(),
                     [&](int64_t x, int64_t y) { return plan.tasks[x].cost > plan.tasks[y].cost; });
  }
  return plan;
}

std::pair<int64_t, int64_t> attention_share(const AttnPlan& plan, int tid, int nt) {
  // a task goes to the thread whose even share of the keys holds its middle
  const int64_t total = plan.cost_end.empty() ? 0 : plan.cost_end.back();
  auto boundary = [&](int i) {
    int64_t lo = 0, hi = int64_t(plan.tasks.size());
    const int64_t cut = 2 * total * i / nt;
    while (lo < hi) {  // the first task whose middle (2 end - cost, doubled) is at or past the cut
      const int64_t m = (lo + hi) / 2;
      if (2 * plan.cost_end[m] - plan.tasks[m].cost < cut) lo = m + 1;
      else hi = m;
    }
    return lo;
  };
  return {tid == 0 ? 0 : boundary(tid), tid + 1 == nt ? int64_t(plan.tasks.size()) : boundary(tid + 1)};
}

// q (B, T, H, D), k/v (B, T, Hkv, D): any strides but a contiguous last dim.
// cos/sin (max_pos, D) float32; positions (B, T) int64; k_cache/v_cache
// (blocks, block_size, Hkv, D) contiguous, one layer of the pool, in q's dtype or
// bfloat16 under float32 q, or int8 with its k_scale / v_scale (blocks, block_size,
// Hkv, ceil(D / 32)) float16 (rope_and_write quantizes each new row by
// blocks of 32; the tasks read each row as its values times its blocks' scales); write_slots
// (B*T) int64 pool slots for the new keys/values; tables (B, nb) int64 block
// ids.  Writes k (rotated) and v into the pool, then returns the attention
// output (B, T, H*D), each query seeing keys 0..its position.
at::Tensor paged_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& cos,
                           const at::Tensor& sin, const at::Tensor& positions, const at::Tensor& k_cache,
                           const at::Tensor& v_cache, const at::Tensor& write_slots, const at::Tensor& tables,
                           double scale, const std::optional<at::Tensor>& k_scale,
                           const std::optional<at::Tensor>& v_scale) {
  TORCH_CHECK(q.dim() == 4 && k.dim() == 4 && v.dim() == 4, "paged_attention: q, k, v must be (B, T, heads, D)");
  const int64_t B = q.size(0), T = q.size(1), H = q.size(2), D = q.size(3), Hkv = k.size(2);
  TORCH_CHECK(q.stride(3) == 1 && k.stride(3) == 1 && v.stride(3) == 1, "paged_attention: head dim must be contiguous");
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous() && k_cache.dim() == 4, "paged_attention: pool layer");
  TORCH_CHECK(k_cache.size(2) == Hkv && k_cache.size(3) == D && H % Hkv == 0, "paged_attention: head shapes");
  const bool int8 = k_cache.scalar_type() == at::kChar;
  TORCH_CHECK(k.scalar_type() == q.scalar_type() && v.scalar_type() == q.scalar_type() &&
              v_cache.scalar_type() == k_cache.scalar_type() &&
              (k_cache.scalar_type() == q.scalar_type() || int8 ||
               (q.scalar_type() == at::kFloat && k_cache.scalar_type() == at::kBFloat16)),
              "paged_attention: q, k, v share a dtype, and the pool holds it (or bfloat16 under float32, or int8)");
  TORCH_CHECK(int8 == (k_scale.has_value() && v_scale.has_value()) && int8 == (k_scale.has_value() || v_scale.has_value()),
              "paged_attention: an int8 pool comes with its k_scale and v_scale, a float pool with none");
  if (int8) {
    std::vector<int64_t> want(k_cache.sizes().begin(), k_cache.sizes().end());
    want.back() = kv_scale_blocks(D);
    TORCH_CHECK(q.scalar_type() != at::kDouble && k_scale->sizes() == at::IntArrayRef(want) &&
                    v_scale->sizes() == k_scale->sizes() && v_scale->scalar_type() == k_scale->scalar_type(),
                "paged_attention: an int8 pool's scales are (blocks, block_size, kv_heads, ceil(head_dim / 32))");
  }
  const PagedIndex ix = checked_index(positions, write_slots, tables, B * T, B, cos, sin, D, k_cache.size(0), k_cache.size(1));
  at::Tensor out = at::empty({B, T, H * D}, q.options());
  at::Tensor qf = at::empty({B, T, H, D}, q.options().dtype(at::kFloat));
  AttnArgs args{B, T, H, Hkv, D, k_cache.size(1), ix.tab.size(1), ix.pos.data_ptr<int64_t>(),
                ix.tab.data_ptr<int64_t>(), float(scale)};
  if (int8) args.k_scale = kv_scales(*k_scale, "paged_attention"), args.v_scale = kv_scales(*v_scale, "paged_attention");
  const int threads = at::get_num_threads();
  auto run = [&](auto* q_type, auto* pool_type) {
    using T_ = std::remove_pointer_t<decltype(q_type)>;
    using P_ = std::remove_pointer_t<decltype(pool_type)>;
    P_ *kc = k_cache.data_ptr<P_>(), *vc = v_cache.data_ptr<P_>();
    // 1. rotate q into float32, rotate k and write it and v into the pool (all writes before any read).
    // (each token's rows on their own: a prompt's spread over the threads)
    at::parallel_for(0, B * T, kRopeGrain, [&](int64_t bt0, int64_t bt1) {
      rope_and_write<T_, P_>(args, q.data_ptr<T_>(), {q.stride(0), q.stride(1), q.stride(2)}, k.data_ptr<T_>(),
                             {k.stride(0), k.stride(1), k.stride(2)}, v.data_ptr<T_>(),
                             {v.stride(0), v.stride(1), v.stride(2)}, cos.data_ptr<float>(), sin.data_ptr<float>(),
                             ix.slots.data_ptr<int64_t>(), bt0, bt1, qf.data_ptr<float>(), kc, vc);
    });
    // 2. the queries' heads over their sequences' blocks
    AttnPlan plan = attention_plan(args, threads, true);
    at::parallel_for(0, threads, 1, [&](int64_t begin, int64_t end) {
      for (int64_t tid = begin; tid < end; ++tid) {
        if (plan.claimed) {
          attend_claimed<T_, P_>(args, plan, qf.data_ptr<float>(), kc, vc, out.data_ptr<T_>());
          continue;
        }
        const auto [t0, t1] = attention_share(plan, int(tid), threads);
        attend_tasks<T_, P_>(args, plan, qf.data_ptr<float>(), kc, vc, t0, t1, out.data_ptr<T_>());
      }
    });
  };
  if (int8) {
    if (q.scalar_type() == at::kFloat) run(static_cast<float*>(nullptr), static_cast<int8_t*>(nullptr));
    else run(static_cast<c10::BFloat16*>(nullptr), static_cast<int8_t*>(nullptr));
    return out;
  }
  if (k_cache.scalar_type() != q.scalar_type()) {
    run(static_cast<float*>(nullptr), static_cast<c10::BFloat16*>(nullptr));
    return out;
  }
  AT_DISPATCH_FLOATING_TYPES_AND(at::kBFloat16, q.scalar_type(), "paged_attention", [&] {
    run(static_cast<scalar_t*>(nullptr), static_cast<scalar_t*>(nullptr));
  });
  return out;
}

}  // namespace ferrum_fused

TORCH_LIBRARY_FRAGMENT(ferrum_fused, m) {
  m.def("paged_attention(Tensor q, Tensor k, Tensor v, Tensor cos, Tensor sin, Tensor positions, "
        "Tensor(a!) k_cache, Tensor(b!) v_cache, Tensor write_slots, Tensor tables, float scale, "
        "Tensor(c!)? k_scale=None, Tensor(d!)? v_scale=None) -> Tensor",
        ferrum_ops::on_cpu(&ferrum_fused::paged_attention));
}
