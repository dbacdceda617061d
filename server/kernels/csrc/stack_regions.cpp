// DecodeStack's steps of a few rows (decode_stack.h) as one OpenMP region: the
// threads share out each linear's weights and the attention's tasks and meet at a
// barrier between phases.  forward_one_region where every linear quantizes its
// activations (qact.cpp's units), forward_panels where every linear is a float
// panel linear (panel_gemm.cpp).
#include <ATen/Parallel.h>
#include <omp.h>

#include "decode_stack.h"

#include <algorithm>
#include <atomic>
#include <thread>
#include <type_traits>
#include <utility>
#include <vector>

namespace ferrum_fused {
// Named, not anonymous: the regions' lambdas (members of DecodeStack, which links
// externally) hold a Team.
namespace regions {

constexpr int64_t kPrefetchBytes = 256 << 10;  // of o's weights, behind the attention

// The regions' barrier: the threads meet 6-10 times a layer, a few microseconds
// apart, and libgomp's barrier spins only GOMP_SPINCOUNT times before it sleeps on
// a futex (the server lowers it so that idle threads give the cores back between
// calls: server/cli.py), so a wait could cost a sleep and a wake-up.  This one spins with pause, then
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

// What both regions start from, checked once: the pool against P (the layers, kv
// heads), the step's paged index and the attention's arguments over it, the
// residual stream h (x's copy, updated in place), the pointers the phases take and
// the team's size.  ix keeps the index tensors args points into alive.  Over an int8
// pool (P int8_t), its scales too: layer_args gives layer l's.
template <typename P>
struct Region {
  int64_t M, maxK;  // rows; the widest linear input (C, H * D or I)
  at::Tensor h;
  PagedIndex ix;
  AttnArgs args;
  const int64_t* slots;
  int64_t layer_elems;  // one layer's elements in the pool
  P *kp, *vp;
  KvScales ksp, vsp;        // an int8 pool's scales (empty for a float pool)
  int64_t layer_scales = 0;  // one layer's scales
  const float *cp, *sp;
  int threads;
  bool whole;  // every thread does every row's norm (whole_rows)
  int copies;  // per-thread buffers: one a thread where whole, else one shared

  // the attention's arguments for layer l: args with that layer's scales over an int8 pool
  AttnArgs layer_args(int64_t l) const {
    AttnArgs a = args;
    if (ksp.data != nullptr) a.k_scale = ksp.plus(l * layer_scales), a.v_scale = vsp.plus(l * layer_scales);
    return a;
  }
};

template <typename P>
Region<P> region(const at::Tensor& x, const StackStep& s, int64_t C, int64_t I, int64_t H, int64_t Hkv, int64_t D,
                 double scale, int64_t whole_rows) {
  const at::Tensor &k_pool = s.k_pool, &v_pool = s.v_pool;
  TORCH_CHECK(k_pool.is_contiguous() && v_pool.is_contiguous() &&
              k_pool.scalar_type() == c10::CppTypeToScalarType<P>::value &&
              v_pool.scalar_type() == k_pool.scalar_type() && k_pool.size(3) == Hkv, "DecodeStack: pool layers");
  const int64_t B = x.size(0), T = x.size(1), M = B * T;
  Region<P> r{M, std::max({C, H * D, I}), {},
              checked_index(s.positions, s.write_slots, s.tables, M, B, s.cos, s.sin, D, k_pool.size(1),
                            k_pool.size(2))};
  r.h = x.contiguous().clone();  // (B, T, C)
  const PagedIndex& ix = r.ix;
  r.args = AttnArgs{B, T, H, Hkv, D, k_pool.size(2), ix.tab.size(1), ix.pos.data_ptr<int64_t>(),
                    ix.tab.data_ptr<int64_t>(), float(scale)};
  r.slots = ix.slots.data_ptr<int64_t>();
  r.layer_elems = k_pool.stride(0);
  r.kp = k_pool.data_ptr<P>(), r.vp = v_pool.data_ptr<P>();
  if constexpr (std::is_same_v<P, int8_t>) {  // run() checked the scales against the pool
    TORCH_CHECK(s.k_scale != nullptr && s.v_scale != nullptr, "DecodeStack: an int8 pool needs its scales");
    r.ksp = kv_scales(*s.k_scale, "DecodeStack"), r.vsp = kv_scales(*s.v_scale, "DecodeStack");
    r.layer_scales = s.k_scale->stride(0);
  }
  r.cp = s.cos.data_ptr<float>(), r.sp = s.sin.data_ptr<float>();
  r.threads = at::get_num_threads();
  r.whole = M <= whole_rows;
  r.copies = r.whole ? r.threads : 1;
  return r;
}

// A thread's place in a region's team: its share of n items (mine), the rows it
// norms and quantizes (rows: every row where `whole`, else its share), and the wait
// for every thread's rows where each did its share (rows_ready).
struct Team {
  int tid, nt;
  bool whole;
  SpinBarrier& bar;
  std::pair<int64_t, int64_t> mine(int64_t n) const { return {n * tid / nt, n * (tid + 1) / nt}; }
  std::pair<int64_t, int64_t> rows(int64_t n) const { return whole ? std::pair<int64_t, int64_t>{0, n} : mine(n); }
  void rows_ready() const {
    if (!whole) bar.wait();
  }
  int copy() const { return whole ? tid : 0; }  // which of the per-thread buffers (one, unless whole) is this thread's
};

// Every thread at its region's start: the team as formed (single's own barrier
// publishes the count to the barrier).
Team join_team(SpinBarrier& bar, bool whole) {
  const int tid = omp_get_thread_num(), nt = omp_get_num_threads();
#pragma omp single
  bar.set_threads(nt);
  return {tid, nt, whole, bar};
}

// h[i] = h[i] + y[i] for i in [0, n), each sum in float32 and rounded to bfloat16 as
// c10::BFloat16 rounds: the residual add as ATen makes it.  8 at a time where the
// AVX2 loops run (the plain loop does not vectorise).
#ifdef FERRUM_X86
__attribute__((target("avx2,fma"))) void add_rounded_avx2(c10::BFloat16* h, const c10::BFloat16* y, int64_t n) {
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) store8(h + i, _mm256_add_ps(load8(h + i), load8(y + i)));
  for (; i < n; ++i) h[i] = store<c10::BFloat16>(load(h[i]) + load(y[i]));
}
#endif

template <typename E>
void add_rounded(bool avx2, E* h, const E* y, int64_t n) {
#ifdef FERRUM_X86
  if constexpr (std::is_same_v<E, c10::BFloat16>)
    if (avx2) return add_rounded_avx2(h, y, n);
#endif
  for (int64_t i = 0; i < n; ++i) h[i] = store<E>(load(h[i]) + load(y[i]));
}

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

// Layer l's attention in a region, between the qkv linear and o: this thread's rows
// of q|k|v normed and RoPE'd (the new keys and values, and an int8 pool's scales, into
// the pool's layer), then, once every row is, its share of the attention's tasks into
// att (M, H * D); the team meets after each.
template <typename E, typename P>
void attention_phase(const Region<P>& in, const Team& team, AttnPlan& plan, const StackLayer& L, int64_t l,
                     bool avx2, E* qkv, float* qf, E* att) {
  P *kc = in.kp + l * in.layer_elems, *vc = in.vp + l * in.layer_elems;
  const AttnArgs args = in.layer_args(l);
  const auto [m0, m1] = team.mine(in.M);
  norm_rope_rows<E, P>(args, L, avx2, qkv, m0, m1, in.cp, in.sp, in.slots, qf, kc, vc);
  team.bar.wait();
  const auto [t0, t1] = attention_share(plan, team.tid, team.nt);
  attend_tasks<E, P>(args, plan, qf, kc, vc, t0, t1, att);
  team.bar.wait();
}

}  // namespace regions

using namespace regions;

template <typename P>
at::Tensor DecodeStack::forward_one_region(const at::Tensor& x, const StackStep& s) {
  const Region<P> in = region<P>(x, s, C_, I_, H_, Hkv_, D_, scale_, whole_rows_);
  if (in.M == 0) return in.h;
  const int64_t M = in.M, C = C_, I = I_, H = H_, D = D_, Wq = (H + 2 * Hkv_) * D, maxK = in.maxK;
  const int threads = in.threads, copies = in.copies;
  std::vector<float> att(M * H * D), qkv(M * Wq), qf(M * H * D), gu(M * 2 * I), y(M * C);
  // the rows a linear reads (quantized), and the norm's or silu*up's output before that: a copy a thread, or one
  const int isa = ferrum_qact::isa_level();
  std::vector<ferrum_qact::Q8Rows> Xs(copies, ferrum_qact::rows_for(M, maxK, 2, isa));
  std::vector<std::vector<float>> xns(copies, std::vector<float>(M * maxK)), scratches(xns);
  float* hp = in.h.template data_ptr<float>();
  const bool avx2 = avx2_on();
  AttnPlan plan = attention_plan(in.args, threads);  // the same positions in every layer
  SpinBarrier bar;
#pragma omp parallel num_threads(threads)
  {
    const Team team = join_team(bar, in.whole);
    ferrum_qact::Q8Rows& X = Xs[team.copy()];
    float *xn = xns[team.copy()].data(), *scratch = scratches[team.copy()].data();
    auto rms = [&](const float* in, const at::Tensor& w, int64_t c, double eps, float* out) {
      rms_on(avx2, in, w.data_ptr<float>(), c, float(eps), out);
    };
    // rows of `in` (M, K) quantized for linear i: this thread's rows
    auto quantize_rows = [&](const StackLayer& L, int i, const float* in, int64_t K) {
      const auto [m0, m1] = team.rows(M);
      ferrum_qact::quantize_blocks(in, m0 * K / 32, m1 * K / 32, K, int(L.digits[i]), L.rotated[i] != 0, isa, X,
                                   scratch);
    };
    // linear i over the quantized rows: this thread's units into out (M, N)
    auto linear = [&](const StackLayer& L, int i, float* out) {
      const auto [u0, u1] = team.mine(L.packed[i].U);
      ferrum_qact::run_units(isa, L.packed[i], int(-L.bits[i]), u0, u1, X, M, int(L.digits[i]), out);
      return std::pair<int64_t, int64_t>{u0 * 16, std::min(u1 * 16, L.packed[i].N)};
    };
    auto norm_and_quantize = [&](const StackLayer& L, const at::Tensor& w, int i) {  // h's rows for linear i
      const auto [m0, m1] = team.rows(M);
      for (int64_t m = m0; m < m1; ++m) rms(hp + m * C, w, C, L.eps, xn + m * C);
      quantize_rows(L, i, xn, C);
    };
    auto residual = [&](std::pair<int64_t, int64_t> cols) {  // h += y over this thread's columns
      for (int64_t m = 0; m < M; ++m)
        for (int64_t n = cols.first; n < cols.second; ++n) hp[m * C + n] += y[m * C + n];
    };
    for (int64_t l = s.first; l < s.last; ++l) {
      const StackLayer& L = layers_[l];
      norm_and_quantize(L, L.ln1, 0);
      team.rows_ready();
      linear(L, 0, qkv.data());
      bar.wait();
      {
        // o's weights (a thread's share) into L2 while RoPE and the attention run,
        // which leave memory idle, so o's phase starts on lines already asked for.
        // The other linears follow phases too short to hide such hints behind.
        const auto [o0, o1] = team.mine(L.packed[1].U);
        ferrum_qact::prefetch_units(L.packed[1], int(-L.bits[1]), o0, o1, kPrefetchBytes);
      }
      attention_phase<float, P>(in, team, plan, L, l, avx2, qkv.data(), qf.data(), att.data());
      quantize_rows(L, 1, att.data(), H * D);
      team.rows_ready();
      residual(linear(L, 1, y.data()));
      bar.wait();
      norm_and_quantize(L, L.ln2, 2);
      team.rows_ready();
      linear(L, 2, gu.data());
      bar.wait();
      {  // silu(gate) * up and its quantization, by blocks of 32 (every block where `whole`)
        const auto [b0, b1] = team.rows(M * I / 32);
        for (int64_t b = b0; b < b1; ++b) {
          const int64_t m = b / (I / 32), c = b % (I / 32) * 32;
          const float* g = gu.data() + m * 2 * I + c;
          silu_mul_on(avx2, g, g + I, 32, xn + m * I + c);
        }
        ferrum_qact::quantize_blocks(xn, b0, b1, I, int(L.digits[3]), L.rotated[3] != 0, isa, X, scratch);
      }
      team.rows_ready();
      residual(linear(L, 3, y.data()));
      bar.wait();
    }
  }
  return in.h;
}

// The step of a few rows when every linear is a float panel linear (the batch-
// invariant float32 and bfloat16 models): one parallel region as above, each
// linear's panels shared out (panel_range), norms, RoPE and the pool write by the
// threads that own the rows, the attention's tasks by attention_share, silu*up by
// blocks of 32.  Each output is the per-op path's arithmetic (rms_norm,
// panel_linear, paged_attention, silu_mul_rows, the residual adds rounded as
// ATen rounds a bfloat16 sum), so the bits equal layer_step's.
template <typename E, typename P>
at::Tensor DecodeStack::forward_panels(const at::Tensor& x, const StackStep& s) {
  const Region<P> in = region<P>(x, s, C_, I_, H_, Hkv_, D_, scale_, whole_rows_);
  if (in.M == 0) return in.h;
  const int64_t M = in.M, C = C_, I = I_, H = H_, D = D_, Wq = (H + 2 * Hkv_) * D, maxK = in.maxK;
  const int threads = in.threads, copies = in.copies;
  const PanelPath path = panel_path(std::is_same_v<E, c10::BFloat16>);
  const bool widen = !std::is_same_v<E, float> && !path.dot;  // the tiles read bfloat16 rows widened to float32
  std::vector<E> att(M * H * D), qkv(M * Wq), gu(M * 2 * I), y(M * C);
  std::vector<float> qf(M * H * D);
  // a linear's input rows (the norm's or silu*up's output), and those widened: a copy a thread, or one
  std::vector<std::vector<E>> xns(copies, std::vector<E>(M * maxK));
  std::vector<std::vector<float>> xws(copies, std::vector<float>(widen ? M * maxK : 0));
  E* hp = in.h.template data_ptr<E>();
  const bool avx2 = avx2_on();
  AttnPlan plan = attention_plan(in.args, threads);  // the same positions in every layer
  SpinBarrier bar;
#pragma omp parallel num_threads(threads)
  {
    const Team team = join_team(bar, in.whole);
    E* xn = xns[team.copy()].data();
    float* xw = xws[team.copy()].data();
    // elements [i0, i1) of `in` into xw, where the tiles read float32
    auto widened = [&](const E* in, int64_t i0, int64_t i1) {
      if (widen)
        for (int64_t i = i0; i < i1; ++i) xw[i] = load(in[i]);
    };
    // linear i over the rows `in` (M, K): this thread's panels into out (M, N); its columns
    auto linear = [&](const StackLayer& L, int i, const E* in, int64_t K, E* out) {
      const at::Tensor& panels = L.lin[i][1];
      const int64_t N = L.lin[i][0].size(0);
      const auto [p0, p1] = team.mine(panels.size(0));
      panel_range<E>(path, widen ? static_cast<const void*>(xw) : in, K, M, panels, K, N, p0, p1, out);
      return std::pair<int64_t, int64_t>{p0 * 16, std::min(p1 * 16, N)};
    };
    auto norm = [&](const at::Tensor& w, double eps) {  // h's rows into xn: this thread's rows
      const auto [m0, m1] = team.rows(M);
      for (int64_t m = m0; m < m1; ++m) rms_on<E>(avx2, hp + m * C, w.data_ptr<E>(), C, float(eps), xn + m * C);
      widened(xn, m0 * C, m1 * C);
    };
    auto residual = [&](std::pair<int64_t, int64_t> cols) {  // h += y over this thread's columns
      for (int64_t m = 0; m < M; ++m)
        add_rounded<E>(avx2, hp + m * C + cols.first, y.data() + m * C + cols.first, cols.second - cols.first);
    };
    for (int64_t l = s.first; l < s.last; ++l) {
      const StackLayer& L = layers_[l];
      norm(L.ln1, L.eps);
      team.rows_ready();
      linear(L, 0, xn, C, qkv.data());
      bar.wait();
#ifdef FERRUM_X86
      {  // o's panels (this thread's share) into L2 while RoPE and the attention leave memory idle
        const at::Tensor& panels = L.lin[1][1];
        const int64_t bytes = panels.nbytes() / panels.size(0);
        const auto [p0, p1] = team.mine(panels.size(0));
        const char* base = static_cast<const char*>(panels.data_ptr()) + p0 * bytes;
        const int64_t n = std::min((p1 - p0) * bytes, kPrefetchBytes);
        for (int64_t i = 0; i < n; i += 64) _mm_prefetch(base + i, _MM_HINT_T1);
      }
#endif
      attention_phase<E, P>(in, team, plan, L, l, avx2, qkv.data(), qf.data(), att.data());
      if (widen) {
        const auto [m0, m1] = team.rows(M);
        widened(att.data(), m0 * H * D, m1 * H * D);
        team.rows_ready();
      }
      residual(linear(L, 1, att.data(), H * D, y.data()));
      bar.wait();
      norm(L.ln2, L.eps);
      team.rows_ready();
      linear(L, 2, xn, C, gu.data());
      bar.wait();
      {  // silu(gate) * up by blocks of 32 (a row's vector loops and tail as silu_mul_rows runs them)
        const int64_t per_row = (I + 31) / 32;
        const auto [b0, b1] = team.rows(M * per_row);
        for (int64_t b = b0; b < b1; ++b) {
          const int64_t m = b / per_row, c = b % per_row * 32, n = std::min<int64_t>(32, I - c);
          const E* g = gu.data() + m * 2 * I + c;
          silu_mul_on<E>(avx2, g, g + I, n, xn + m * I + c);
          widened(xn, m * I + c, m * I + c + n);
        }
      }
      team.rows_ready();
      residual(linear(L, 3, xn, I, y.data()));
      bar.wait();
    }
  }
  return in.h;
}

// The instantiations run() takes (decode_stack.h).
#define FERRUM_STACK_ARGS const at::Tensor&, const StackStep&
template at::Tensor DecodeStack::forward_one_region<float>(FERRUM_STACK_ARGS);
template at::Tensor DecodeStack::forward_one_region<c10::BFloat16>(FERRUM_STACK_ARGS);
template at::Tensor DecodeStack::forward_panels<c10::BFloat16, c10::BFloat16>(FERRUM_STACK_ARGS);
template at::Tensor DecodeStack::forward_panels<float, c10::BFloat16>(FERRUM_STACK_ARGS);
template at::Tensor DecodeStack::forward_panels<float, float>(FERRUM_STACK_ARGS);
template at::Tensor DecodeStack::forward_one_region<int8_t>(FERRUM_STACK_ARGS);
template at::Tensor DecodeStack::forward_panels<float, int8_t>(FERRUM_STACK_ARGS);
template at::Tensor DecodeStack::forward_panels<c10::BFloat16, int8_t>(FERRUM_STACK_ARGS);
#undef FERRUM_STACK_ARGS

}  // namespace ferrum_fused
