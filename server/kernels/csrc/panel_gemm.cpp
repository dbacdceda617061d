// panel_linear: the batch-invariant float32 / bfloat16 linear, an outer-product
// GEMM over weights packed once (pack_panels) into K-major panels of 16 output
// columns.
//
// Every output is ONE sequential chain over k = 0..K-1, started from zero:
// acc = fma(x[k], w[k], acc) in float32 (bfloat16 widened, exactly), or, on the
// AVX-512 BF16 dot product, acc += x[2j] w[2j] + x[2j+1] w[2j+1] one pair j at a
// time.  No split of K, no tree: the register tile (how many rows and panels an
// inner loop holds), the row count, the edge tiles and the thread split decide
// only which outputs run side by side, never an output's sum, so a row's bits
// are the same alone, in any batch and on any thread count.  The fused
// multiply-add chain is also the same on every path (AVX-512F, AVX2+FMA and the
// portable loop's std::fma), so those give identical bits; the dot product's
// chain is its own (a different instruction, flushing subnormals), taken for
// bfloat16 wherever the CPU has it.  bfloat16 outputs are rounded once at the end.
//
// Layout: float32 (P, K, 16), P = ceil(N / 16), column c of panel p the weight
// row 16 p + c (zeros past N); bfloat16 (P, ceil(K / 2), 16, 2): each column's k
// pair side by side (zeros past N and K), what the dot product takes, and what
// the fused multiply-add paths split into even and odd k by a shift and a mask.
// The kernel broadcasts an activation element (or pair) and multiplies a
// panel's row of 16 into accumulators: MR rows x NP panels a tile, 24
// accumulators on AVX-512 (32 registers), 12 on AVX2 (16).  One or two rows take
// up to 8 panels at once, so a single row streams 8 panels' weights with 8
// independent chains (the FMA latency hidden, the step reading at memory speed).
#include <ATen/Parallel.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/zeros.h>
#include <torch/library.h>

#include "fused.h"
#include "ops.h"

#include <algorithm>
#include <atomic>
#include <cmath>

namespace ferrum_fused {
namespace {

constexpr int64_t kCols = 16;   // output columns a panel
constexpr int kMaxPanels = 8;   // panels a tile at most
constexpr int kMaxRows = 8;     // rows a tile at most
constexpr int64_t kTileStride = kMaxPanels * kCols;  // a tile's float32 results, row stride
// A prompt's GEMM (2 kClaimRows rows or more) runs as units of kClaimPanels panels (two
// 8x3 tiles wide) by kClaimRows rows, taken by whichever thread is free.
constexpr int64_t kClaimPanels = 6, kClaimRows = 64;

// What a tile reads: MR rows of x (row stride ldx), NP panels of w (panel stride
// ps elements) over K (bfloat16 panels: ceil(K / 2) pairs), results into c.
struct TileArgs {
  const void* x;
  int64_t ldx;
  const void* w;
  int64_t ps, K;
  float* c;
};

// The most panels a tile of `mr` rows takes with `acc` accumulator registers of
// `per_panel` vectors a panel.
constexpr int panels_for(int mr, int acc, int per_panel) {
  return std::max(1, std::min(kMaxPanels, acc / (mr * per_panel)));
}

#ifdef FERRUM_X86
// One or two rows stream their NP panels at memory speed only with the lines asked
// for ahead: the tile reads NP streams a cache line each per step, the hardware
// prefetcher stops at every 4 KiB page, and a step's small linears end before it
// has found its pace.  Each step asks for every panel's line kAhead steps on; past a
// panel's end, for that line of the panel NP on: the same stream of the next tile,
// which these rows take next (panels_range's tiles of one or two rows are consecutive
// panels), so the next tile starts on lines already asked for rather than on kAhead
// steps of misses (harmless past the weight's end too: a prefetch does not fault).
// Rows past two reuse each line enough to hide the wait.
constexpr int64_t kAhead = 24;  // steps (a panel's cache lines) ahead
template <int MR, int NP, typename E>
FERRUM_INLINE void ask_ahead(const E* w, int64_t ps, int64_t at) {
  if constexpr (MR <= 2) {
    int64_t ahead = at + kAhead * (64 / int64_t(sizeof(E)));
    if (ahead >= ps) ahead += (NP - 1) * ps;
    for (int j = 0; j < NP; ++j) _mm_prefetch(reinterpret_cast<const char*>(w + j * ps + ahead), _MM_HINT_T1);
  }
}
#endif

#ifdef FERRUM_X86
// ---- AVX-512F: float32 weights, or bfloat16 pairs by fused multiply-adds ------------
struct Avx512 {
  static constexpr int kRows = 8;
  static constexpr int panels(int mr) { return panels_for(mr, 24, 1); }
  template <int MR, int NP, bool BF>
  __attribute__((target("avx512f,fma"))) static void run(const TileArgs& a) {
    const float* x = static_cast<const float*>(a.x);
    __m512 acc[MR][NP];
    for (int r = 0; r < MR; ++r)
      for (int j = 0; j < NP; ++j) acc[r][j] = _mm512_setzero_ps();
    if constexpr (!BF) {
      const float* w = static_cast<const float*>(a.w);
      for (int64_t k = 0; k < a.K; ++k) {
        ask_ahead<MR, NP>(w, a.ps, k * kCols);
        __m512 b[NP];
        for (int j = 0; j < NP; ++j) b[j] = _mm512_loadu_ps(w + j * a.ps + k * kCols);
        for (int r = 0; r < MR; ++r) {
          const __m512 xv = _mm512_set1_ps(x[r * a.ldx + k]);
          for (int j = 0; j < NP; ++j) acc[r][j] = _mm512_fmadd_ps(xv, b[j], acc[r][j]);
        }
      }
    } else {
      const uint16_t* w = static_cast<const uint16_t*>(a.w);
      const __m512i high = _mm512_set1_epi32(int32_t(0xFFFF0000u));
      int64_t k = 0;
      for (; k + 2 <= a.K; k += 2) {  // pair k / 2: k's products for every row, then k + 1's
        ask_ahead<MR, NP>(w, a.ps, k * kCols);
        __m512 b[NP];
        for (int j = 0; j < NP; ++j)
          b[j] = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_loadu_si512(w + j * a.ps + k * kCols), 16));
        for (int r = 0; r < MR; ++r) {
          const __m512 xv = _mm512_set1_ps(x[r * a.ldx + k]);
          for (int j = 0; j < NP; ++j) acc[r][j] = _mm512_fmadd_ps(xv, b[j], acc[r][j]);
        }
        for (int j = 0; j < NP; ++j)
          b[j] = _mm512_castsi512_ps(_mm512_and_si512(_mm512_loadu_si512(w + j * a.ps + k * kCols), high));
        for (int r = 0; r < MR; ++r) {
          const __m512 xv = _mm512_set1_ps(x[r * a.ldx + k + 1]);
          for (int j = 0; j < NP; ++j) acc[r][j] = _mm512_fmadd_ps(xv, b[j], acc[r][j]);
        }
      }
      if (k < a.K)  // an odd K's last k: the even halves of the last pairs
        for (int r = 0; r < MR; ++r) {
          const __m512 xv = _mm512_set1_ps(x[r * a.ldx + k]);
          for (int j = 0; j < NP; ++j)
            acc[r][j] = _mm512_fmadd_ps(
                xv, _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_loadu_si512(w + j * a.ps + k * kCols), 16)),
                acc[r][j]);
        }
    }
    for (int r = 0; r < MR; ++r)
      for (int j = 0; j < NP; ++j) _mm512_storeu_ps(a.c + r * kTileStride + j * kCols, acc[r][j]);
  }
};
template <bool BF>
struct Avx512Of : Avx512 {
  template <int MR, int NP>
  static void tile(const TileArgs& a) { Avx512::run<MR, NP, BF>(a); }
};

// ---- AVX-512 BF16: bfloat16 pairs by the dot product --------------------------------
struct Dot {
  static constexpr int kRows = 8;
  static constexpr int panels(int mr) { return panels_for(mr, 24, 1); }
  template <int MR, int NP>
  __attribute__((target("avx512f,avx512bf16"))) static void tile(const TileArgs& a) {
    const uint16_t* x = static_cast<const uint16_t*>(a.x);  // rows padded to an even width
    const uint16_t* w = static_cast<const uint16_t*>(a.w);
    __m512 acc[MR][NP];
    for (int r = 0; r < MR; ++r)
      for (int j = 0; j < NP; ++j) acc[r][j] = _mm512_setzero_ps();
    for (int64_t k = 0; k < a.K; k += 2) {
      ask_ahead<MR, NP>(w, a.ps, k * kCols);
      __m512i b[NP];
      for (int j = 0; j < NP; ++j) b[j] = _mm512_loadu_si512(w + j * a.ps + k * kCols);
      for (int r = 0; r < MR; ++r) {
        int32_t pair;
        std::memcpy(&pair, x + r * a.ldx + k, sizeof pair);
        const __m512i xv = _mm512_set1_epi32(pair);
        for (int j = 0; j < NP; ++j) acc[r][j] = _mm512_dpbf16_ps(acc[r][j], (__m512bh)xv, (__m512bh)b[j]);
      }
    }
    for (int r = 0; r < MR; ++r)
      for (int j = 0; j < NP; ++j) _mm512_storeu_ps(a.c + r * kTileStride + j * kCols, acc[r][j]);
  }
};

// ---- AVX2+FMA: a panel as two 8-lane halves -----------------------------------------
struct Avx2 {
  static constexpr int kRows = 6;
  static constexpr int panels(int mr) { return panels_for(mr, 12, 2); }
  template <int MR, int V>
  __attribute__((target("avx2,fma"))) static FERRUM_INLINE void step(__m256 (&acc)[MR][V], const __m256 (&b)[V],
                                                                     const float* x, int64_t ldx, int64_t k) {
    for (int r = 0; r < MR; ++r) {
      const __m256 xv = _mm256_set1_ps(x[r * ldx + k]);
      for (int j = 0; j < V; ++j) acc[r][j] = _mm256_fmadd_ps(xv, b[j], acc[r][j]);
    }
  }
  // half j % 2 of panel j / 2's pairs at k (k even): 8 columns' k and k + 1
  __attribute__((target("avx2,fma"))) static FERRUM_INLINE __m256i pairs(const uint16_t* w, int64_t ps, int j,
                                                                         int64_t k) {
    return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + (j / 2) * ps + k * kCols + (j % 2) * 16));
  }
  template <int MR, int NP, bool BF>
  __attribute__((target("avx2,fma"))) static void run(const TileArgs& a) {
    const float* x = static_cast<const float*>(a.x);
    constexpr int V = 2 * NP;
    __m256 acc[MR][V];
    for (int r = 0; r < MR; ++r)
      for (int j = 0; j < V; ++j) acc[r][j] = _mm256_setzero_ps();
    __m256 b[V];
    if constexpr (!BF) {
      const float* w = static_cast<const float*>(a.w);
      for (int64_t k = 0; k < a.K; ++k) {
        ask_ahead<MR, NP>(w, a.ps, k * kCols);
        for (int j = 0; j < V; ++j) b[j] = _mm256_loadu_ps(w + (j / 2) * a.ps + k * kCols + (j % 2) * 8);
        step<MR, V>(acc, b, x, a.ldx, k);
      }
    } else {
      const uint16_t* w = static_cast<const uint16_t*>(a.w);
      const __m256i high = _mm256_set1_epi32(int32_t(0xFFFF0000u));
      int64_t k = 0;
      for (; k + 2 <= a.K; k += 2) {
        ask_ahead<MR, NP>(w, a.ps, k * kCols);
        for (int j = 0; j < V; ++j) b[j] = _mm256_castsi256_ps(_mm256_slli_epi32(pairs(w, a.ps, j, k), 16));
        step<MR, V>(acc, b, x, a.ldx, k);
        for (int j = 0; j < V; ++j) b[j] = _mm256_castsi256_ps(_mm256_and_si256(pairs(w, a.ps, j, k), high));
        step<MR, V>(acc, b, x, a.ldx, k + 1);
      }
      if (k < a.K) {
        for (int j = 0; j < V; ++j) b[j] = _mm256_castsi256_ps(_mm256_slli_epi32(pairs(w, a.ps, j, k), 16));
        step<MR, V>(acc, b, x, a.ldx, k);
      }
    }
    for (int r = 0; r < MR; ++r)
      for (int j = 0; j < V; ++j) _mm256_storeu_ps(a.c + r * kTileStride + j * 8, acc[r][j]);
  }
};
template <bool BF>
struct Avx2Of : Avx2 {
  template <int MR, int NP>
  static void tile(const TileArgs& a) { Avx2::run<MR, NP, BF>(a); }
};
#endif

// ---- portable: the same chain, std::fma an element at a time -------------------------
template <bool BF>
struct Portable {
  static constexpr int kRows = 4;
  static constexpr int panels(int) { return 2; }
  template <int MR, int NP>
  static void tile(const TileArgs& a) {
    const float* x = static_cast<const float*>(a.x);
    for (int r = 0; r < MR; ++r)
      for (int64_t col = 0; col < NP * kCols; ++col) {
        const int64_t base = (col / kCols) * a.ps, c = col % kCols;
        float acc = 0.0f;
        for (int64_t k = 0; k < a.K; ++k) {
          float wk;
          if constexpr (BF) wk = load(static_cast<const c10::BFloat16*>(a.w)[base + (k / 2) * 2 * kCols + 2 * c + k % 2]);
          else wk = static_cast<const float*>(a.w)[base + k * kCols + c];
          acc = std::fma(x[r * a.ldx + k], wk, acc);
        }
        a.c[r * kTileStride + col] = acc;
      }
  }
};

// A tile of `np` panels (1..Path::panels(MR)) for MR rows, as compile-time sizes.
template <class Path, int MR, int NP>
void tile_np(int np, const TileArgs& a) {
  if constexpr (NP > 1)
    if (np < NP) return tile_np<Path, MR, NP - 1>(np, a);
  Path::template tile<MR, NP>(a);
}
template <class Path, int MR = 1>
void tile(int mr, int np, const TileArgs& a) {
  if constexpr (MR < Path::kRows)
    if (mr > MR) return tile<Path, MR + 1>(mr, np, a);
  tile_np<Path, MR, Path::panels(MR)>(np, a);
}

// A tile row's results into y: float32 as they are, bfloat16 rounded as
// store<c10::BFloat16> rounds (8 at a time where the AVX2 loops run, 16 on AVX-512:
// the same rounding, NaN and subnormals included).
inline void store_row(float* out, const float* src, int64_t n) { std::copy(src, src + n, out); }
#ifdef FERRUM_X86
__attribute__((target("avx2,fma"))) void store_row_avx2(c10::BFloat16* out, const float* src, int64_t n) {
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) store8(out + i, _mm256_loadu_ps(src + i));
  for (; i < n; ++i) out[i] = store<c10::BFloat16>(src[i]);
}
__attribute__((target("avx2,fma,avx512f"))) void store_row_avx512(c10::BFloat16* out, const float* src, int64_t n) {
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) {  // bf16_bits on 16 lanes
    const __m512 v = _mm512_loadu_ps(src + i);
    const __m512i u = _mm512_castps_si512(v);
    const __m512i bias = _mm512_add_epi32(_mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1)),
                                          _mm512_set1_epi32(0x7FFF));
    const __m512i r = _mm512_mask_mov_epi32(_mm512_srli_epi32(_mm512_add_epi32(u, bias), 16),
                                            _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q), _mm512_set1_epi32(0x7FC0));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + i), _mm512_cvtepi32_epi16(r));
  }
  store_row_avx2(out + i, src + i, n - i);
}
#endif
inline void store_row(c10::BFloat16* out, const float* src, int64_t n) {
#ifdef FERRUM_X86
  const int isa = ferrum_active_isa();
  if (isa >= 2) return store_row_avx512(out, src, n);
  if (isa >= 1) return store_row_avx2(out, src, n);
#endif
  for (int64_t i = 0; i < n; ++i) out[i] = store<c10::BFloat16>(src[i]);
}

// Panels [p0, p1) for all M rows of x into y (M, N): groups of as many panels as a
// tile of the first rows takes (their weights stay in cache), every row tile of
// the group in turn.  xe: x's element size in bytes; ps: a panel's elements.
template <class Path, typename T>
void panels_range(const char* x, int64_t xe, int64_t ldx, int64_t M, const char* w, int64_t we, int64_t ps,
                  int64_t K, int64_t N, int64_t p0, int64_t p1, T* y) {
  alignas(64) float c[kMaxRows * kTileStride];
  const int group = Path::panels(int(std::min<int64_t>(M, Path::kRows)));
  for (int64_t g = p0; g < p1; g += group) {
    const int64_t g1 = std::min(p1, g + group);
    for (int64_t m = 0; m < M; m += Path::kRows) {
      const int mr = int(std::min<int64_t>(Path::kRows, M - m));
      for (int64_t p = g; p < g1;) {
        const int np = int(std::min<int64_t>(Path::panels(mr), g1 - p));
        tile<Path>(mr, np, TileArgs{x + m * ldx * xe, ldx, w + p * ps * we, ps, K, c});
        const int64_t n0 = p * kCols, cols = std::min<int64_t>(np * kCols, N - n0);
        for (int r = 0; r < mr; ++r) store_row(y + (m + r) * N + n0, c + r * kTileStride, cols);
        p += np;
      }
    }
  }
}

// Whether bfloat16 takes the dot product: the CPU has it, the cap allows AVX-512, and
// set_panel_dot has not turned it off (tests run the AVX-512 multiply-add path so).
std::atomic<bool> g_dot_allowed{true};
bool dot_on() {
#ifdef FERRUM_X86
  const ferrum_cpu::Features& f = ferrum_cpu::cpu_features();
  return f.avx512bf16 && f.avx512f && ferrum_active_isa() >= 2 && g_dot_allowed.load();
#else
  return false;
#endif
}

}  // namespace

// Allows (or not) the dot product for bfloat16; returns whether it was allowed.
bool set_panel_dot(bool allowed) { return g_dot_allowed.exchange(allowed); }

PanelPath panel_path(bool bf16) { return {bf16, bf16 && dot_on(), ferrum_active_isa()}; }

// Whether bfloat16 takes the dot product now (the CPU has it, the cap and set_panel_dot allow it).
bool panel_dot_runs() { return dot_on(); }

template <typename T>
void panel_range(const PanelPath& path, const void* xs, int64_t ldx, int64_t M, const at::Tensor& panels, int64_t K,
                 int64_t N, int64_t p0, int64_t p1, T* y) {
  const int64_t P = panels.size(0), ps = panels.numel() / P;
  const char* xp = static_cast<const char*>(xs);
  const char* wp = static_cast<const char*>(panels.data_ptr());
  const int64_t xe = path.dot ? 2 : 4, we = panels.element_size();
  auto range = [&](auto tiles) { panels_range<decltype(tiles), T>(xp, xe, ldx, M, wp, we, ps, K, N, p0, p1, y); };
#ifdef FERRUM_X86
  if (path.dot) return range(Dot{});
  if (path.isa >= 2) return path.bf16 ? range(Avx512Of<true>{}) : range(Avx512Of<false>{});
  if (path.isa >= 1) return path.bf16 ? range(Avx2Of<true>{}) : range(Avx2Of<false>{});
#endif
  path.bf16 ? range(Portable<true>{}) : range(Portable<false>{});
}
template void panel_range<float>(const PanelPath&, const void*, int64_t, int64_t, const at::Tensor&, int64_t, int64_t,
                                 int64_t, int64_t, float*);
template void panel_range<c10::BFloat16>(const PanelPath&, const void*, int64_t, int64_t, const at::Tensor&, int64_t,
                                         int64_t, int64_t, int64_t, c10::BFloat16*);

// weight (N, K) float32 or bfloat16, contiguous -> panel_linear's packed panels.
at::Tensor pack_panels(const at::Tensor& weight) {
  TORCH_CHECK(weight.dim() == 2 && (weight.scalar_type() == at::kFloat || weight.scalar_type() == at::kBFloat16),
              "pack_panels: weight must be (N, K) float32 or bfloat16");
  const int64_t N = weight.size(0), K = weight.size(1), P = (N + kCols - 1) / kCols;
  if (weight.scalar_type() == at::kFloat) {
    at::Tensor padded = at::zeros({P * kCols, K}, weight.options());
    padded.narrow(0, 0, N).copy_(weight);
    return padded.view({P, kCols, K}).transpose(1, 2).contiguous();
  }
  const int64_t K2 = (K + 1) / 2;
  at::Tensor padded = at::zeros({P * kCols, 2 * K2}, weight.options());
  padded.narrow(0, 0, N).narrow(1, 0, K).copy_(weight);
  return padded.view({P, kCols, K2, 2}).permute({0, 2, 1, 3}).contiguous();
}

// x (..., K) times the packed weight of pack_panels (N outputs) -> (..., N), no bias.
at::Tensor panel_linear(const at::Tensor& x, const at::Tensor& panels, int64_t N) {
  const bool bf16 = panels.scalar_type() == at::kBFloat16;
  TORCH_CHECK(x.scalar_type() == panels.scalar_type() && (bf16 || x.scalar_type() == at::kFloat),
              "panel_linear: float32 or bfloat16 only, x and panels alike");
  const int64_t K = x.size(-1), P = (N + kCols - 1) / kCols;
  TORCH_CHECK(panels.is_contiguous() && panels.dim() == (bf16 ? 4 : 3) && panels.size(0) == P &&
                  panels.size(1) == (bf16 ? (K + 1) / 2 : K) && panels.size(2) == kCols &&
                  (!bf16 || panels.size(3) == 2),
              "panel_linear: panels are not pack_panels' of an (", N, ", ", K, ") weight");
  const ferrum_ops::Rows io = ferrum_ops::rows_of(x, K, N);
  const at::Tensor &x2d = io.x2d, &out = io.out;
  const int64_t M = io.M;
  if (M == 0) return io.result();
  const PanelPath path = panel_path(bf16);
  // the rows as the tiles read them: bfloat16 pairs (an odd K padded) for the dot
  // product, float32 for the fused multiply-adds
  at::Tensor xs;
  if (path.dot && K % 2) {
    xs = at::zeros({M, K + 1}, x2d.options());
    xs.narrow(1, 0, K).copy_(x2d);
  } else {
    xs = path.dot ? x2d : x2d.to(at::kFloat);
  }
  const int64_t ldx = xs.size(1), xe = xs.element_size();
  auto range = [&](int64_t m0, int64_t m1, int64_t p0, int64_t p1) {
    const char* x = static_cast<const char*>(xs.data_ptr()) + m0 * ldx * xe;
    if (bf16) panel_range(path, x, ldx, m1 - m0, panels, K, N, p0, p1, out.data_ptr<c10::BFloat16>() + m0 * N);
    else panel_range(path, x, ldx, m1 - m0, panels, K, N, p0, p1, out.data_ptr<float>() + m0 * N);
  };
  const int threads = at::get_num_threads();
  if (M >= 2 * kClaimRows && threads > 1) {
    // a static split by panels left one thread waiting for the other at the end of most
    // GEMMs (a host's cores do not run at one speed); which thread computes an output,
    // and beside which rows, changes no bit
    const int64_t row_units = (M + kClaimRows - 1) / kClaimRows;
    const int64_t units = row_units * ((P + kClaimPanels - 1) / kClaimPanels);
    std::atomic<int64_t> next{0};
    at::parallel_for(0, threads, 1, [&](int64_t, int64_t) {
      for (int64_t u = next.fetch_add(1, std::memory_order_relaxed); u < units;
           u = next.fetch_add(1, std::memory_order_relaxed)) {
        const int64_t m0 = (u % row_units) * kClaimRows, p0 = (u / row_units) * kClaimPanels;
        range(m0, std::min(M, m0 + kClaimRows), p0, std::min(P, p0 + kClaimPanels));
      }
    });
    return io.result();
  }
  // a thread's share: whole groups of panels, at least a few per thread
  const int64_t grain = std::max<int64_t>(4, 2 * kMaxPanels * 64 / std::max<int64_t>(M, 64));
  at::parallel_for(0, P, grain, [&](int64_t b, int64_t e) { range(0, M, b, e); });
  return io.result();
}

}  // namespace ferrum_fused

TORCH_LIBRARY_FRAGMENT(ferrum_fused, m) {
  using ferrum_ops::on_cpu;
  m.def("pack_panels(Tensor weight) -> Tensor", on_cpu(&ferrum_fused::pack_panels));
  m.def("panel_linear(Tensor x, Tensor panels, int n) -> Tensor", on_cpu(&ferrum_fused::panel_linear));
  m.def("set_panel_dot(bool allowed) -> bool", &ferrum_fused::set_panel_dot);
  m.def("panel_dot_runs() -> bool", &ferrum_fused::panel_dot_runs);
}
