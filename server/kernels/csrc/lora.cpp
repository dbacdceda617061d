// LoRA deltas added to a projection's output rows, each row with its own adapter
// (the BGMV shape: a row gathers its adapter's A and B), in one call per projection
// and in the decode stack's layers (lora.h declares the classes).
//
// A row's delta runs in two phases.  Down: t = A x into float32, each component
// one chain of 8 lanes over K's blocks of 8 in order, the lanes summed in one fixed
// tree, then the products past the last whole block one fused multiply-add at a
// time.  Up: each output n of a module starts at 0 and takes B[n, r] t[r] for r in
// ascending order, one fused multiply-add each, then y[n] += that sum.  Every
// output is one thread's sum in that order, whatever the threads, the blocking,
// the other rows or their adapters, so a row's bits do not depend on its batch
// (batch-invariant mode).
//
// Rows are taken grouped by adapter, two at a time where two share one (each
// weight vector loaded once for both), so an adapter's weights are read from memory
// once a projection and from cache for its other rows.  B is packed in blocks of
// kLoraPack outputs, (blocks, rank, kLoraPack): a block's rank vectors lie side by
// side, so the up phase reads B in order, eight outputs a vector with t[r]
// broadcast, several vectors' sums in flight.
//
// In the decode stack a float linear's deltas run inside the linear's own parallel
// region (LoraBatch::linear, linear_rows_with): each thread computes the whole down
// phase before its share of the base outputs, then adds the deltas of the outputs it
// wrote, so a step with adapters forks and waits no more than one without.  The up
// phase by output columns takes the packed blocks as the one by units does and keeps
// only the thread's outputs: every output the same sum.
#include <omp.h>
#include <ATen/Parallel.h>

#include "fused.h"
#include "lora.h"

#include <algorithm>
#include <cmath>
#include <type_traits>

namespace ferrum_fused {
namespace {

constexpr int64_t kParallelWork = 1 << 15;  // multiply-adds below which one thread runs a call

// The blocking: one row, 8 components (down) and 2 packed blocks (up) a step; two
// rows, 4 components and 1 block.  Each fits AVX2's 16 registers (8 sums).
constexpr int kDown1 = 8, kDown2 = 4;
static_assert(kDown2 * 2 <= kDown1, "a down step's sums fit kDown1");

#ifdef FERRUM_X86
__attribute__((target("avx2,fma"))) FERRUM_INLINE float hsum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}

// out[m * RB + r] = A row a[r] . row x[m], for MB rows and RB components.
template <typename T, int MB, int RB>
__attribute__((target("avx2,fma"))) void down_avx2(const T* const* a, const T* const* x, int64_t K, float* out) {
  __m256 acc[MB][RB];
  for (int m = 0; m < MB; ++m)
    for (int r = 0; r < RB; ++r) acc[m][r] = _mm256_setzero_ps();
  int64_t k = 0;
  for (; k + 8 <= K; k += 8) {
    __m256 xv[MB];
    for (int m = 0; m < MB; ++m) xv[m] = load8(x[m] + k);
    for (int r = 0; r < RB; ++r) {
      const __m256 av = load8(a[r] + k);
      for (int m = 0; m < MB; ++m) acc[m][r] = _mm256_fmadd_ps(av, xv[m], acc[m][r]);
    }
  }
  for (int m = 0; m < MB; ++m)
    for (int r = 0; r < RB; ++r) {
      float s = hsum(acc[m][r]);
      for (int64_t j = k; j < K; ++j) s = std::fma(load(a[r][j]), load(x[m][j]), s);
      out[m * RB + r] = s;
    }
}

// y[i] += acc's lane i for i in [lo, hi) & [0, 8), each rounded once to T.
template <typename T>
__attribute__((target("avx2,fma"))) FERRUM_INLINE void add8(__m256 acc, T* y, int64_t lo, int64_t hi) {
  float d[8];
  _mm256_storeu_ps(d, acc);
  if constexpr (std::is_same_v<T, float>) {
    if (lo <= 0 && hi >= 8) return _mm256_storeu_ps(y, _mm256_add_ps(_mm256_loadu_ps(y), acc));
  }
  for (int64_t i = std::max<int64_t>(lo, 0); i < std::min<int64_t>(hi, 8); ++i) y[i] = store<T>(load(y[i]) + d[i]);
}
// y[m][lo..hi) += the sums of NB packed blocks at p (block stride rank * kLoraPack) with
// t[m], hi <= NB kLoraPack.
template <typename T, int MB, int NB>
__attribute__((target("avx2,fma"))) void up_avx2(const T* p, int64_t rank, const float* const* t, int64_t lo,
                                                 int64_t hi, T* const* y) {
  constexpr int V = NB * kLoraPack / 8;
  __m256 acc[MB][V];
  for (int m = 0; m < MB; ++m)
    for (int v = 0; v < V; ++v) acc[m][v] = _mm256_setzero_ps();
  for (int64_t r = 0; r < rank; ++r) {
    __m256 tr[MB];
    for (int m = 0; m < MB; ++m) tr[m] = _mm256_set1_ps(t[m][r]);
    for (int v = 0; v < V; ++v) {
      const __m256 bv = load8(p + (v * 8 / kLoraPack) * rank * kLoraPack + r * kLoraPack + v * 8 % kLoraPack);
      for (int m = 0; m < MB; ++m) acc[m][v] = _mm256_fmadd_ps(bv, tr[m], acc[m][v]);
    }
  }
  for (int m = 0; m < MB; ++m)
    for (int v = lo / 8; v < V && v * 8 < hi; ++v) add8(acc[m][v], y[m] + v * 8, lo - v * 8, hi - v * 8);
}
#endif

// The same sums, portably (the lanes' tree as hsum's).
template <typename T, int MB, int RB>
void down_portable(const T* const* a, const T* const* x, int64_t K, float* out) {
  for (int m = 0; m < MB; ++m)
    for (int r = 0; r < RB; ++r) {
      float l[8] = {0, 0, 0, 0, 0, 0, 0, 0};
      int64_t k = 0;
      for (; k + 8 <= K; k += 8)
        for (int i = 0; i < 8; ++i) l[i] = std::fma(load(a[r][k + i]), load(x[m][k + i]), l[i]);
      float s = ((l[0] + l[4]) + (l[2] + l[6])) + ((l[1] + l[5]) + (l[3] + l[7]));
      for (; k < K; ++k) s = std::fma(load(a[r][k]), load(x[m][k]), s);
      out[m * RB + r] = s;
    }
}
template <typename T, int MB, int NB>
void up_portable(const T* p, int64_t rank, const float* const* t, int64_t lo, int64_t hi, T* const* y) {
  for (int m = 0; m < MB; ++m)
    for (int64_t i = lo; i < std::min<int64_t>(hi, NB * kLoraPack); ++i) {
      const T* b = p + i / kLoraPack * rank * kLoraPack + i % kLoraPack;
      float c = 0.0f;
      for (int64_t r = 0; r < rank; ++r) c = std::fma(load(b[r * kLoraPack]), t[m][r], c);
      y[m][i] = store<T>(load(y[m][i]) + c);
    }
}

template <typename T, int MB, int RB>
void down(bool avx2, const T* const* a, const T* const* x, int64_t K, float* out) {
#ifdef FERRUM_X86
  if (avx2) return down_avx2<T, MB, RB>(a, x, K, out);
#endif
  down_portable<T, MB, RB>(a, x, K, out);
}
template <typename T, int MB, int NB>
void up(bool avx2, const T* p, int64_t rank, const float* const* t, int64_t lo, int64_t hi, T* const* y) {
#ifdef FERRUM_X86
  if (avx2) return up_avx2<T, MB, NB>(p, rank, t, lo, hi, y);
#endif
  up_portable<T, MB, NB>(p, rank, t, lo, hi, y);
}

// A row block's units: components of kDown1 or kDown2 (down), packed blocks of its
// segments two or one at a time (up).
int64_t down_units(const RowBlock& b) {
  const int64_t step = b.rows == 1 ? kDown1 : kDown2;
  return (b.site->R + step - 1) / step;
}
int64_t up_units(const RowBlock& b) {
  int64_t n = 0;
  for (const LoraSegment& s : b.site->segments) n += b.rows == 1 ? (s.blocks + 1) / 2 : s.blocks;
  return n;
}

// One projection's deltas over rows x (M, K) into y (M, N): the two phases by units
// (down, then up once every t is known), or the up phase by output columns.
template <typename T>
struct Runner {
  const LoraPlan& plan;
  const T* x;
  int64_t K;
  T* y;
  int64_t N;
  float* low;  // each row block's t, at its t_off
  bool avx2;

  int64_t find(int64_t u, int64_t RowBlock::*first) const {  // the block holding unit u: the last starting <= u
    const auto it = std::upper_bound(plan.blocks.begin(), plan.blocks.end(), u,
                                     [&](int64_t v, const RowBlock& b) { return v < b.*first; });
    return int64_t(it - plan.blocks.begin()) - 1;
  }
  void down_range(int64_t u0, int64_t u1) const {
    const auto& blocks = plan.blocks;
    for (int64_t u = u0, i = u0 < u1 ? find(u0, &RowBlock::down_unit) : 0; u < u1; ++u) {
      while (i + 1 < int64_t(blocks.size()) && blocks[i + 1].down_unit <= u) ++i;
      const RowBlock& b = blocks[i];
      const int64_t R = b.site->R, step = b.rows == 1 ? kDown1 : kDown2, r0 = (u - b.down_unit) * step;
      const T* a[kDown1];
      for (int r = 0; r < step; ++r) a[r] = b.site->a.data_ptr<T>() + std::min(r0 + r, R - 1) * K;  // past R: discarded
      const T* xs[2] = {x + b.m[0] * K, x + b.m[b.rows - 1] * K};
      float out[kDown1];
      if (b.rows == 1) down<T, 1, kDown1>(avx2, a, xs, K, out);
      else down<T, 2, kDown2>(avx2, a, xs, K, out);
      for (int m = 0; m < b.rows; ++m)
        for (int64_t r = r0; r < std::min(r0 + step, R); ++r) low[b.t_off + m * R + r] = out[m * step + r - r0];
    }
  }
  // The packed blocks [first, first + nb) of segment s for row block b, their outputs
  // [lo, hi) (counted from the first block's first output).
  void up_blocks(const RowBlock& b, const LoraSegment& s, int64_t first, int64_t nb, int64_t lo, int64_t hi) const {
    const int64_t n0 = first * kLoraPack;
    const T* p = s.packed.data_ptr<T>() + first * s.rank * kLoraPack;
    const float* t[2] = {low + b.t_off + s.r_lo, low + b.t_off + b.site->R * (b.rows - 1) + s.r_lo};
    T* ys[2] = {y + b.m[0] * N + s.out_lo + n0, y + b.m[b.rows - 1] * N + s.out_lo + n0};
    if (b.rows == 2) up<T, 2, 1>(avx2, p, s.rank, t, lo, hi, ys);
    else if (nb == 2) up<T, 1, 2>(avx2, p, s.rank, t, lo, hi, ys);
    else up<T, 1, 1>(avx2, p, s.rank, t, lo, hi, ys);
  }
  void up_range(int64_t u0, int64_t u1) const {
    const auto& blocks = plan.blocks;
    for (int64_t u = u0, i = u0 < u1 ? find(u0, &RowBlock::up_unit) : 0; u < u1; ++u) {
      while (i + 1 < int64_t(blocks.size()) && blocks[i + 1].up_unit <= u) ++i;
      const RowBlock& b = blocks[i];
      const int64_t per = b.rows == 1 ? 2 : 1;  // packed blocks a unit
      int64_t left = u - b.up_unit;
      for (const LoraSegment& s : b.site->segments) {
        const int64_t units = (s.blocks + per - 1) / per;
        if (left >= units) {
          left -= units;
          continue;
        }
        const int64_t first = left * per, nb = std::min(per, s.blocks - first);
        up_blocks(b, s, first, nb, 0, std::min(nb * kLoraPack, s.width - first * kLoraPack));
        break;
      }
    }
  }
  // The A rows of down units [u0, u1) and the packed B blocks of outputs [c0, c1)
  // fetched toward the core's L2 cache, all requests at once: the down phase reads
  // each A row (a few cache lines) beside 7 others, streams too short for the hardware
  // prefetcher to learn, and B's blocks arrive while the base linear runs.
  void prefetch(int64_t u0, int64_t u1, int64_t c0, int64_t c1) const {
#ifdef FERRUM_X86
    auto lines = [](const void* p, int64_t bytes) {
      for (int64_t o = 0; o < bytes; o += 64) _mm_prefetch(static_cast<const char*>(p) + o, _MM_HINT_T1);
    };
    for (const RowBlock& b : plan.blocks) {
      const int64_t step = b.rows == 1 ? kDown1 : kDown2, units = down_units(b);
      const int64_t lo = std::max(u0, b.down_unit), hi = std::min(u1, b.down_unit + units);
      if (lo < hi)
        lines(b.site->a.data_ptr<T>() + (lo - b.down_unit) * step * K,
              (std::min((hi - b.down_unit) * step, b.site->R) - (lo - b.down_unit) * step) * K * int64_t(sizeof(T)));
      for (const LoraSegment& s : b.site->segments) {
        const int64_t first = (std::max(c0, s.out_lo) - s.out_lo) / kLoraPack;
        const int64_t last = (std::min(c1, s.out_lo + s.width) - s.out_lo + kLoraPack - 1) / kLoraPack;
        if (first < last)
          lines(s.packed.data_ptr<T>() + first * s.rank * kLoraPack,
                (last - first) * s.rank * kLoraPack * int64_t(sizeof(T)));
      }
    }
#endif
  }
  // Every row block's outputs [c0, c1) of the projection: the packed blocks that touch
  // them, taken as up_range takes them (each output the same sum), only those added.
  void up_cols(int64_t c0, int64_t c1) const {
    for (const RowBlock& b : plan.blocks) {
      const int64_t per = b.rows == 1 ? 2 : 1;
      for (const LoraSegment& s : b.site->segments) {
        const int64_t lo = std::max(c0, s.out_lo) - s.out_lo, hi = std::min(c1, s.out_lo + s.width) - s.out_lo;
        if (lo >= hi) continue;
        for (int64_t first = lo / kLoraPack; first * kLoraPack < hi; first += per) {
          const int64_t nb = std::min(per, s.blocks - first), n0 = first * kLoraPack;
          up_blocks(b, s, first, nb, std::max<int64_t>(lo - n0, 0), std::min(hi - n0, nb * kLoraPack));
        }
      }
    }
  }
};

template <typename T>
void run(const LoraPlan& plan, const T* x, int64_t K, T* y, int64_t N, bool parallel) {
  std::vector<float> low(static_cast<size_t>(plan.total_r));  // each row's t
  const Runner<T> r{plan, x, K, y, N, low.data(), avx2_on()};
  if (!parallel) {
    r.down_range(0, plan.total_down);
    r.up_range(0, plan.total_up);
    return;
  }
#pragma omp parallel num_threads(at::get_num_threads())
  {
    const int64_t tid = omp_get_thread_num(), nt = omp_get_num_threads();
    r.down_range(plan.total_down * tid / nt, plan.total_down * (tid + 1) / nt);
#pragma omp barrier
    r.up_range(plan.total_up * tid / nt, plan.total_up * (tid + 1) / nt);
  }
}

// The deltas run inside linear_rows_with's region (1-4 rows): every thread computes all
// of the down phase (each t the same sum on any thread; a few thousand multiply-adds a
// row) into its own t, then its share of the base outputs, then the deltas of those
// outputs: no barrier between the phases.
class LoraHook : public RowsHook {
 public:
  explicit LoraHook(const LoraPlan& plan)
      : plan_(plan), lows_(static_cast<size_t>(std::max(1, at::get_num_threads())),
                           std::vector<float>(static_cast<size_t>(plan.total_r))) {}
  void prepare(const at::Tensor& x2d, const at::Tensor& out) override { x_ = x2d, y_ = out; }
  void before(int tid, int nt, int64_t n0, int64_t n1) override {
    with(tid, [&](const auto& r) {
      r.prefetch(0, plan_.total_down, n0, n1);  // A, and this thread's B blocks
      r.down_range(0, plan_.total_down);
    });
  }
  void after(int tid, int64_t n0, int64_t n1) override {
    with(tid, [&](const auto& r) { r.up_cols(n0, n1); });
  }
  bool joins() const override { return false; }

 private:
  template <typename F>
  void with(int tid, F f) {
    const int64_t K = x_.size(1), N = y_.size(1);
    float* low = lows_.at(static_cast<size_t>(tid)).data();
    if (x_.scalar_type() == at::kFloat)
      f(Runner<float>{plan_, x_.data_ptr<float>(), K, y_.data_ptr<float>(), N, low, avx2_on()});
    else
      f(Runner<c10::BFloat16>{plan_, x_.data_ptr<c10::BFloat16>(), K, y_.data_ptr<c10::BFloat16>(), N, low,
                              avx2_on()});
  }
  const LoraPlan& plan_;
  std::vector<std::vector<float>> lows_;  // a t per thread
  at::Tensor x_, y_;
};

}  // namespace

LoraAdapter::LoraAdapter(int64_t layers) : sites_(static_cast<size_t>(std::max<int64_t>(layers, 0))) {
  TORCH_CHECK(layers > 0, "LoraAdapter: layers must be positive");
}

void LoraAdapter::set_site(int64_t layer, int64_t site, at::Tensor a, std::vector<at::Tensor> packed,
                           std::vector<int64_t> widths, std::vector<int64_t> out_lo, std::vector<int64_t> r_lo) {
  TORCH_CHECK(0 <= layer && layer < layers() && 0 <= site && site < kLoraSites, "LoraAdapter: layer ", layer,
              " site ", site, " out of range");
  TORCH_CHECK(a.dim() == 2 && a.is_contiguous() && (a.scalar_type() == at::kFloat || a.scalar_type() == at::kBFloat16),
              "LoraAdapter: A must be (R, K) contiguous float32 or bfloat16");
  TORCH_CHECK(!packed.empty() && packed.size() == widths.size() && packed.size() == out_lo.size() &&
              packed.size() == r_lo.size(), "LoraAdapter: one width, out_lo and r_lo per B");
  LoraSite s{a, {}, a.size(0), a.size(1)};
  for (size_t i = 0; i < packed.size(); ++i) {
    const at::Tensor& b = packed[i];
    TORCH_CHECK(b.dim() == 3 && b.size(2) == kLoraPack && b.is_contiguous() && b.scalar_type() == a.scalar_type(),
                "LoraAdapter: each B must be packed (blocks, rank, ", kLoraPack, ") contiguous, A's dtype");
    TORCH_CHECK(widths[i] > (b.size(0) - 1) * kLoraPack && widths[i] <= b.size(0) * kLoraPack,
                "LoraAdapter: B ", i, " of width ", widths[i], " in ", b.size(0), " blocks");
    TORCH_CHECK(out_lo[i] >= 0 && r_lo[i] >= 0 && r_lo[i] + b.size(1) <= s.R, "LoraAdapter: B ", i,
                " reads ranks ", r_lo[i], "..", r_lo[i] + b.size(1), " of ", s.R);
    s.segments.push_back({b, out_lo[i], widths[i], r_lo[i], b.size(1), b.size(0)});
  }
  sites_[layer][site] = std::move(s);
}

LoraBatch::LoraBatch(const at::Tensor& rows) {
  TORCH_CHECK(rows.dim() == 1 && rows.scalar_type() == at::kLong, "LoraBatch: rows must be (M,) int64");
  const at::Tensor r = rows.contiguous();
  rows_.assign(r.data_ptr<int64_t>(), r.data_ptr<int64_t>() + r.numel());
  for (int64_t m = 0; m < int64_t(rows_.size()); ++m)
    if (rows_[m] >= 0) order_.push_back(m);
  std::stable_sort(order_.begin(), order_.end(), [&](int64_t a, int64_t b) { return rows_[a] < rows_[b]; });
}

void LoraBatch::add_adapter(c10::intrusive_ptr<LoraAdapter> adapter) { adapters_.push_back(std::move(adapter)); }

LoraPlan LoraBatch::plan(int64_t layer, int64_t site, int64_t K, int64_t N, at::ScalarType dtype) const {
  TORCH_CHECK(0 <= site && site < kLoraSites, "LoraBatch: site ", site, " out of range");
  LoraPlan plan;
  auto& blocks = plan.blocks;
  for (const int64_t m : order_) {
    TORCH_CHECK(rows_[m] < int64_t(adapters_.size()), "LoraBatch: row ", m, " names adapter ", rows_[m], " of ",
                adapters_.size());
    const LoraAdapter& adapter = *adapters_[rows_[m]];
    TORCH_CHECK(0 <= layer && layer < adapter.layers(), "LoraBatch: layer ", layer, " out of range");
    const LoraSite& s = adapter.site(layer, site);
    if (!s.a.defined()) continue;
    if (!blocks.empty() && blocks.back().site == &s && blocks.back().rows == 1) {  // a second row, same weights
      blocks.back().m[1] = m, blocks.back().rows = 2;
    } else {
      TORCH_CHECK(s.K == K && s.a.scalar_type() == dtype, "LoraBatch: the adapter's A is (", s.R, ", ", s.K, ") ",
                  s.a.scalar_type(), ", x has width ", K, " ", dtype);
      for (const LoraSegment& g : s.segments)
        TORCH_CHECK(g.out_lo + g.width <= N, "LoraBatch: a B writes outputs up to ", g.out_lo + g.width, " of ", N);
      if (!blocks.empty()) {
        const RowBlock& b = blocks.back();
        plan.total_down += down_units(b), plan.total_up += up_units(b), plan.total_r += b.rows * b.site->R;
      }
      blocks.push_back({{m, m}, 1, &s, plan.total_r, plan.total_down, plan.total_up});
    }
    plan.work += s.R * K;
    for (const LoraSegment& g : s.segments) plan.work += g.rank * g.width;
  }
  if (!blocks.empty()) {
    const RowBlock& last = blocks.back();
    plan.total_down += down_units(last), plan.total_up += up_units(last), plan.total_r += last.rows * last.site->R;
  }
  return plan;
}

void LoraBatch::apply(int64_t layer, int64_t site, const at::Tensor& x, const at::Tensor& y) const {
  const int64_t K = x.size(-1), N = y.size(-1), M = int64_t(rows_.size());
  TORCH_CHECK(x.numel() == M * K && y.numel() == M * N, "LoraBatch: x and y must have ", M, " rows");
  TORCH_CHECK(y.is_contiguous() && y.scalar_type() == x.scalar_type(), "LoraBatch: y must be contiguous, x's dtype");
  const LoraPlan plan = this->plan(layer, site, K, N, x.scalar_type());
  if (plan.blocks.empty()) return;
  const at::Tensor xc = x.contiguous();
  const bool parallel = plan.work >= kParallelWork && at::get_num_threads() > 1 && !omp_in_parallel();
  if (x.scalar_type() == at::kFloat)
    run<float>(plan, xc.data_ptr<float>(), K, y.data_ptr<float>(), N, parallel);
  else if (x.scalar_type() == at::kBFloat16)
    run<c10::BFloat16>(plan, xc.data_ptr<c10::BFloat16>(), K, y.data_ptr<c10::BFloat16>(), N, parallel);
  else
    TORCH_CHECK(false, "LoraBatch: float32 or bfloat16 only");
}

at::Tensor LoraBatch::add(int64_t layer, int64_t site, const at::Tensor& x, at::Tensor y) const {
  apply(layer, site, x, y);
  return y;
}

at::Tensor LoraBatch::linear(int64_t layer, int64_t site, const at::Tensor& x, const at::Tensor& weight) const {
  const int64_t K = x.size(-1), N = weight.size(0), M = int64_t(rows_.size());
  TORCH_CHECK(x.numel() == M * K, "LoraBatch: x must have ", M, " rows");
  const LoraPlan plan = this->plan(layer, site, K, N, x.scalar_type());
  if (plan.blocks.empty()) return linear_rows(x, weight);
  LoraHook hook(plan);
  return linear_rows_with(x, weight, hook);
}

}  // namespace ferrum_fused
