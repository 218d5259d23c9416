// Rows times weights, out[m, n] = sum_k x[m, k] * w[n, k], with one summation order per
// (row, column) pair whatever the row count: engine/row_dot.py builds and loads this.
//
// Each output element owns one vector accumulator: lanes l of it sum x[m, k] * w[n, k]
// over k = l, l + W, l + 2W, ... (fused multiply-adds in k order), then the lanes are
// added in one fixed tree and the K % W tail, in k order, after it. Blocking (how many
// rows and weight rows share a pass) and threading (which thread takes which weight
// rows) change only which accumulators live together, never the order within one, so a
// row's bits do not depend on the other rows in the call. Weight rows are read once a
// call and the rows stay in cache: a few rows cost one pass over the weights (XLA:CPU's
// products pack the weights on every call at more than one row).
#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstring>
#include <memory>

#include "xla/ffi/api/ffi.h"

#if defined(__AVX__) && defined(__FMA__)
#include <immintrin.h>
#endif

namespace ffi = xla::ffi;

namespace {

constexpr int kLanes = 8;
typedef float Vec __attribute__((vector_size(kLanes * sizeof(float))));
// 4 x 3 accumulators, 3 weight vectors and a row's vector: AVX2's 16 registers (the
// fastest of 2x4, 3x3, 3x4 and 4x3 measured at 1-256 rows, bench/README "CPU products")
constexpr int kRowBlock = 4;     // rows sharing a pass over a block of weight rows
constexpr int kWeightBlock = 3;  // weight rows a pass holds
constexpr int64_t kTaskWeightRows = 48;  // weight rows a task takes (in L2 across row blocks)

// a * b + c rounded once, in every instantiation alike (built with -ffp-contract=off,
// so the compiler fuses nothing on its own)
inline Vec Fma(Vec a, Vec b, Vec c) {
#if defined(__AVX__) && defined(__FMA__)
  return reinterpret_cast<Vec>(_mm256_fmadd_ps(reinterpret_cast<__m256>(a),
                                                reinterpret_cast<__m256>(b),
                                                reinterpret_cast<__m256>(c)));
#else
  Vec r;
  for (int i = 0; i < kLanes; ++i) r[i] = __builtin_fmaf(a[i], b[i], c[i]);
  return r;
#endif
}

inline void Pause() {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_ia32_pause();
#endif
}

inline Vec Load(const float* p) {
  Vec v;
  std::memcpy(&v, p, sizeof(Vec));
  return v;
}

// The one reduction order: lanes in a fixed tree, then the tail in k order.
inline float Finish(Vec acc, const float* x, const float* w, int64_t from, int64_t k) {
  float s = ((acc[0] + acc[4]) + (acc[2] + acc[6])) + ((acc[1] + acc[5]) + (acc[3] + acc[7]));
  for (int64_t i = from; i < k; ++i) s = __builtin_fmaf(x[i], w[i], s);
  return s;
}

// out[m, n] for rows [m0, m0 + R) and weight rows [n0, n0 + C), R <= kRowBlock, C <= kWeightBlock.
template <int R, int C>
inline void Block(const float* x, const float* w, float* out, int64_t m0, int64_t n0, int64_t k,
                  int64_t n_total) {
  Vec acc[R][C];
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c) acc[r][c] = Vec{};
  const int64_t body = k - k % kLanes;
  for (int64_t i = 0; i < body; i += kLanes) {
    Vec wv[C];
    for (int c = 0; c < C; ++c) wv[c] = Load(w + (n0 + c) * k + i);
    for (int r = 0; r < R; ++r) {
      const Vec xv = Load(x + (m0 + r) * k + i);
      for (int c = 0; c < C; ++c) acc[r][c] = Fma(xv, wv[c], acc[r][c]);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c)
      out[(m0 + r) * n_total + n0 + c] =
          Finish(acc[r][c], x + (m0 + r) * k, w + (n0 + c) * k, body, k);
}

template <int R>
void Rows(const float* x, const float* w, float* out, int64_t m0, int64_t k, int64_t n_total,
          int64_t from, int64_t to) {
  int64_t n0 = from;
  for (; n0 + kWeightBlock <= to; n0 += kWeightBlock)
    Block<R, kWeightBlock>(x, w, out, m0, n0, k, n_total);
  for (; n0 < to; ++n0) Block<R, 1>(x, w, out, m0, n0, k, n_total);
}

// Every row against weight rows [from, to): a block of rows at a time (in L1) against
// every weight row of the range (in L2 after the first block of rows).
void Range(const float* x, const float* w, float* out, int64_t m, int64_t k, int64_t n_total,
           int64_t from, int64_t to) {
  int64_t m0 = 0;
  for (; m0 + kRowBlock <= m; m0 += kRowBlock) Rows<kRowBlock>(x, w, out, m0, k, n_total, from, to);
  for (; m0 < m; ++m0) Rows<1>(x, w, out, m0, k, n_total, from, to);
}

// Tasks claim blocks of weight rows; the caller claims too, so the call finishes even
// when no pool thread comes, and a late pool thread finds nothing left.
struct Work {
  const float* x;
  const float* w;
  float* out;
  int64_t m, k, n;
  int64_t tasks;
  std::atomic<int64_t> next{0};
  std::atomic<int64_t> done{0};

  void Run() {
    for (int64_t t; (t = next.fetch_add(1)) < tasks;) {
      const int64_t from = t * kTaskWeightRows;
      Range(x, w, out, m, k, n, from, std::min(n, from + kTaskWeightRows));
      done.fetch_add(1, std::memory_order_release);
    }
  }
};

ffi::Error Run(ffi::ThreadPool& pool, const float* x, const float* w, float* out, int64_t m,
               int64_t k, int64_t n) {
  auto work = std::make_shared<Work>();
  work->x = x;
  work->w = w;
  work->out = out;
  work->m = m;
  work->k = k;
  work->n = n;
  work->tasks = (n + kTaskWeightRows - 1) / kTaskWeightRows;
  const int64_t helpers = std::min<int64_t>(pool.num_threads(), work->tasks) - 1;
  for (int64_t i = 0; i < helpers; ++i) pool.Schedule([work] { work->Run(); });
  work->Run();
  while (work->done.load(std::memory_order_acquire) < work->tasks) Pause();
  return ffi::Error::Success();
}

ffi::Error RowDot(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::F32> w,
                  ffi::ResultBuffer<ffi::F32> out) {
  const auto xd = x.dimensions();
  const auto wd = w.dimensions();
  if (xd.size() != 2 || wd.size() != 2 || xd[1] != wd[1])
    return ffi::Error::InvalidArgument("row_dot takes x (M, K) and w (N, K)");
  return Run(pool, x.typed_data(), w.typed_data(), out->typed_data(), xd[0], xd[1], wd[0]);
}

// Layer `index` of stacked weights (L, N, K), read where it lies: a slice of the stack
// passed as an operand would be copied out of it first (a pass over the layer's weights).
ffi::Error RowDotLayer(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::F32> w,
                       ffi::Buffer<ffi::S32> index, ffi::ResultBuffer<ffi::F32> out) {
  const auto xd = x.dimensions();
  const auto wd = w.dimensions();
  if (xd.size() != 2 || wd.size() != 3 || xd[1] != wd[2] || index.element_count() != 1)
    return ffi::Error::InvalidArgument("row_dot_layer takes x (M, K), w (L, N, K), index ()");
  const int64_t layer = index.typed_data()[0];
  if (layer < 0 || layer >= wd[0])
    return ffi::Error::InvalidArgument("row_dot_layer: layer index out of range");
  const float* weights = w.typed_data() + layer * wd[1] * wd[2];
  return Run(pool, x.typed_data(), weights, out->typed_data(), xd[0], xd[1], wd[1]);
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(RowDotF32, RowDot,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(RowDotLayerF32, RowDotLayer,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>());
