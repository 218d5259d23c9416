// Attention over paged KV, read in place, for every query row of a step: decode rows and
// the rows of a prompt chunk alike (engine/attention/cpu_kernel.py builds and loads this;
// engine/attention/cpu.py calls it).
//
// One query is always computed in one fixed order, whatever else runs: the scores of its
// query heads over its positions in position order (each a dot product of 8-lane partial
// sums added in one fixed tree), their maximum, the exponentials and their sum (8 lanes
// at a time from its first position, one fixed order), then the values weighted in
// position order, over the sum. Nothing in that order depends on the other rows, their
// count, their lengths or which rows share a task, so a query's bits are its own in any
// batch, and a prompt position has the bits it would have as a decode row.
//
// A task is (a block of consecutive rows of one sequence, a kv head): a decode row is a
// block of one; a prompt chunk's rows go up to kBlockRows a block, sharing each key and
// value row they read while it is in cache. Threads only choose which task runs where.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <memory>
#include <type_traits>
#include <vector>

#include "../cpu_kernel.h"
#include "xla/ffi/api/ffi.h"

#if defined(__AVX__)
#include <immintrin.h>
#endif

namespace ffi = xla::ffi;

namespace {

using cpu_kernel::Claims;
using cpu_kernel::Fma;
using cpu_kernel::kLanes;
using cpu_kernel::Load;
using cpu_kernel::Store;
using cpu_kernel::Sum;
using cpu_kernel::Sums;
using cpu_kernel::Vec;
typedef int32_t IVec __attribute__((vector_size(kLanes * sizeof(int32_t))));

inline Vec Splat(float x) { return Vec{} + x; }

inline Vec Floor(Vec x) {
#if defined(__AVX__)
  return reinterpret_cast<Vec>(_mm256_floor_ps(reinterpret_cast<__m256>(x)));
#else
  for (int i = 0; i < kLanes; ++i) x[i] = std::floor(x[i]);
  return x;
#endif
}

inline Vec Max(Vec a, Vec b) { return a < b ? b : a; }

// 8 lanes of a page row as float32: float32 pages as they are, bfloat16 ones widened
// (exact), so a bfloat16 row's arithmetic is the float32 kernel's on the same values.
inline Vec LoadPage(const float* p) { return Load(p); }
inline Vec LoadPage(const uint16_t* p) {
#if defined(__AVX2__)
  const __m128i half = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return reinterpret_cast<Vec>(_mm256_slli_epi32(_mm256_cvtepu16_epi32(half), 16));
#else
  IVec bits;
  for (int i = 0; i < kLanes; ++i) bits[i] = static_cast<int32_t>(static_cast<uint32_t>(p[i]) << 16);
  Vec v;
  std::memcpy(&v, &bits, sizeof v);
  return v;
#endif
}

// exp(x) for x <= 0, a degree-5 polynomial on x - n ln 2 times 2^n (Cephes' expf, within
// 2 ulp); below -87 it gives 0 as the softmax of a far lower score must.
inline Vec Exp(Vec x) {
  const Vec low = Splat(-87.0f);
  const IVec tiny = x < low;
  x = x < low ? low : x;
  Vec fx = Fma(x, Splat(1.44269504088896341f), Splat(0.5f));
  const Vec n = Floor(fx);
  x = Fma(n, Splat(-0.693359375f), x);
  x = Fma(n, Splat(2.12194440e-4f), x);
  Vec y = Splat(1.9875691500e-4f);
  y = Fma(y, x, Splat(1.3981999507e-3f));
  y = Fma(y, x, Splat(8.3334519073e-3f));
  y = Fma(y, x, Splat(4.1665795894e-2f));
  y = Fma(y, x, Splat(1.6666665459e-1f));
  y = Fma(y, x, Splat(5.0000001201e-1f));
  y = Fma(y, x * x, x + Splat(1.0f));
  const IVec bits = (__builtin_convertvector(n, IVec) + 127) << 23;
  Vec scale;
  std::memcpy(&scale, &bits, sizeof(Vec));
  const Vec out = y * scale;
  return tiny ? Splat(0.0f) : out;
}

constexpr int kMaxGroups = 16;   // query heads per kv head this kernel takes
constexpr int kMaxDimVecs = 32;  // head_dim / kLanes this kernel takes (head_dim <= 256)
constexpr int64_t kBlockRows = 16;  // a prompt chunk's rows a task
constexpr int64_t kValueSpan = 32;  // positions whose values stay in cache while rows pass

// acc[0..C) += p * v[0..C) lanes at a time, for each position; C known at compile time
// so the accumulators live in registers.
template <int C, typename P>
void Weigh(Vec* acc, const float* probs, const P* const* rows, int64_t value_offset,
           int64_t count) {
  Vec a[C];
  for (int c = 0; c < C; ++c) a[c] = acc[c];
  for (int64_t i = 0; i < count; ++i) {
    const Vec p = Splat(probs[i]);
    const P* v = rows[i] + value_offset;
    for (int c = 0; c < C; ++c) a[c] = Fma(p, LoadPage(v + c * kLanes), a[c]);
  }
  for (int c = 0; c < C; ++c) acc[c] = a[c];
}

template <typename P>
void WeighAny(int vecs, Vec* acc, const float* probs, const P* const* rows,
              int64_t value_offset, int64_t count) {
  switch (vecs) {
    case 1: return Weigh<1>(acc, probs, rows, value_offset, count);
    case 2: return Weigh<2>(acc, probs, rows, value_offset, count);
    case 3: return Weigh<3>(acc, probs, rows, value_offset, count);
    case 4: return Weigh<4>(acc, probs, rows, value_offset, count);
    case 5: return Weigh<5>(acc, probs, rows, value_offset, count);
    case 6: return Weigh<6>(acc, probs, rows, value_offset, count);
    case 7: return Weigh<7>(acc, probs, rows, value_offset, count);
    default: return Weigh<8>(acc, probs, rows, value_offset, count);
  }
}

template <typename P>
struct Scratch {
  std::vector<const P*> at;  // the block's positions lo .. hi + kLanes: key rows
  std::vector<float> scores;     // (block rows, groups, span): scores, then probabilities
  std::vector<Vec> acc;          // (block rows, groups, dim / kLanes)
};

template <typename P>  // the pages' element: float, or bfloat16's bits
struct Work : Claims {  // a task: one (block, kv head)
  const float* q;        // (rows, heads, dim)
  const int32_t* lens;   // (rows,): positions a row attends over (its query at len - 1), 0: none
  const int32_t* seqs;   // (rows,): the row's page table
  const int32_t* table;  // (sequences, table_width)
  const P* pages;        // (num_pages, page_size, 2 * kv, dim): keys then values per kv head
  float* out;            // (rows, heads, dim)
  int64_t rows, heads, dim, kv, page_size, table_width, sequences;
  int32_t window;  // 0: none
  float scale;
  std::vector<int64_t> starts;  // block b: rows starts[b] .. starts[b + 1]

  void Run() {
    Scratch<P> scratch;
    const int64_t blocks = static_cast<int64_t>(starts.size()) - 1;
    // later blocks of a chunk see more positions: they go first
    Each([&](int64_t t) { Block(blocks - 1 - t / kv, t % kv, scratch); });
  }

  static void Fetch(const P* row, int64_t count) {
    constexpr int64_t line = 64 / sizeof(P);  // elements a 64-byte line holds
    for (int64_t d = 0; d < count; d += line) __builtin_prefetch(row + d);
  }

  void Block(int64_t b, int64_t h, Scratch<P>& s) const {
    const int64_t r0 = starts[b], n_rows = starts[b + 1] - r0;
    const int64_t groups = heads / kv, vecs = dim / kLanes;
    int64_t lo = INT64_MAX, hi = 0;
    for (int64_t r = r0; r < r0 + n_rows; ++r) {
      if (lens[r] <= 0) {  // no row: zeros
        float* dst = out + (r * heads + h * groups) * dim;
        std::fill(dst, dst + groups * dim, 0.0f);
        continue;
      }
      lo = std::min(lo, First(r));
      hi = std::max<int64_t>(hi, lens[r]);
    }
    if (hi == 0) return;
    // one pointer per position: its key row; its value row follows
    const int64_t span = hi - lo + kLanes;
    const int32_t* row_table = table + static_cast<int64_t>(seqs[r0]) * table_width;
    const int64_t stride = 2 * kv * dim;
    s.at.resize(span);
    for (int64_t pos = lo; pos < lo + span; ++pos) {
      const int64_t p = std::min(pos, hi - 1);  // past the end: a row read, then masked
      s.at[pos - lo] =
          pages + (static_cast<int64_t>(row_table[p / page_size]) * page_size + p % page_size) *
                      stride + 2 * h * dim;
    }
    s.scores.assign(n_rows * groups * span, -INFINITY);  // unseen: exp gives 0
    float top[kBlockRows * kMaxGroups];
    std::fill(top, top + n_rows * groups, -INFINITY);

    // scores, 8 positions at a time, every row of the block over the same key rows
    for (int64_t p0 = lo; p0 < hi; p0 += kLanes) {
      const P* const* keys = s.at.data() + (p0 - lo);
      if (p0 + kLanes < hi)
        for (int64_t j = 0; j < kLanes && p0 + kLanes + j < hi; ++j) Fetch(keys[kLanes + j], dim);
      for (int64_t i = 0; i < n_rows; ++i) {
        const int64_t r = r0 + i, len = lens[r];
        if (len <= 0) continue;
        const int64_t first = First(r);
        if (p0 >= len || p0 + kLanes <= first) continue;
        IVec pos;
        for (int l = 0; l < kLanes; ++l) pos[l] = static_cast<int32_t>(p0 + l);
        const IVec seen = (pos >= IVec{} + static_cast<int32_t>(first)) &
                          (pos < IVec{} + static_cast<int32_t>(len));
        for (int64_t g = 0; g < groups; ++g) {
          const float* qg = q + (r * heads + h * groups + g) * dim;
          Vec acc[kLanes] = {};
          for (int64_t c = 0; c < vecs; ++c) {
            const Vec qc = Load(qg + c * kLanes);
            for (int l = 0; l < kLanes; ++l) acc[l] = Fma(qc, LoadPage(keys[l] + c * kLanes), acc[l]);
          }
          const Vec sc = seen ? Sums(acc) * Splat(scale) : Splat(-INFINITY);
          Store(s.scores.data() + (i * groups + g) * span + (p0 - lo), sc);
          Vec t = Splat(top[i * groups + g]);
          t = Max(t, sc);
          float m = t[0];
          for (int l = 1; l < kLanes; ++l) m = std::max(m, t[l]);
          top[i * groups + g] = m;
        }
      }
    }

    // exponentials and their sum, 8 at a time from each row's first position
    float total[kBlockRows * kMaxGroups];
    for (int64_t i = 0; i < n_rows; ++i) {
      const int64_t r = r0 + i, len = lens[r];
      if (len <= 0) continue;
      const int64_t first = First(r);
      const int64_t padded = (len - first + kLanes - 1) / kLanes * kLanes;
      for (int64_t g = 0; g < groups; ++g) {
        float* sg = s.scores.data() + (i * groups + g) * span + (first - lo);
        const Vec t = Splat(top[i * groups + g]);
        Vec sum{};
        for (int64_t k = 0; k < padded; k += kLanes) {
          const Vec p = Exp(Load(sg + k) - t);
          Store(sg + k, p);
          sum += p;
        }
        total[i * groups + g] = Sum(sum);
      }
    }

    // values weighted in position order, kValueSpan positions at a time for every row
    s.acc.assign(n_rows * groups * vecs, Vec{});
    for (int64_t p0 = lo; p0 < hi; p0 += kValueSpan) {
      const int64_t p1 = std::min(hi, p0 + kValueSpan);
      for (int64_t j = p1; j < std::min(hi, p1 + kValueSpan); ++j) Fetch(s.at[j - lo] + dim, dim);
      for (int64_t i = 0; i < n_rows; ++i) {
        const int64_t r = r0 + i, len = lens[r];
        if (len <= 0) continue;
        const int64_t from = std::max(p0, First(r)), to = std::min<int64_t>(p1, len);
        if (from >= to) continue;
        for (int64_t g = 0; g < groups; ++g) {
          const float* probs = s.scores.data() + (i * groups + g) * span + (from - lo);
          Vec* acc = s.acc.data() + (i * groups + g) * vecs;
          for (int64_t c = 0; c < vecs; c += 8)
            WeighAny(static_cast<int>(std::min<int64_t>(8, vecs - c)), acc + c, probs,
                     s.at.data() + (from - lo), dim + c * kLanes, to - from);
        }
      }
    }
    for (int64_t i = 0; i < n_rows; ++i) {
      const int64_t r = r0 + i;
      if (lens[r] <= 0) continue;
      for (int64_t g = 0; g < groups; ++g) {
        float* dst = out + (r * heads + h * groups + g) * dim;
        const Vec* acc = s.acc.data() + (i * groups + g) * vecs;
        for (int64_t c = 0; c < vecs; ++c)
          Store(dst + c * kLanes, acc[c] / Splat(total[i * groups + g]));
      }
    }
  }

  int64_t First(int64_t r) const { return window > 0 ? std::max<int64_t>(0, lens[r] - window) : 0; }
};

// Blocks of consecutive rows of one sequence at consecutive positions, kBlockRows at most;
// a row of no positions stands alone.
std::vector<int64_t> Blocks(const int32_t* lens, const int32_t* seqs, int64_t rows) {
  std::vector<int64_t> starts{0};
  for (int64_t r = 1; r < rows; ++r) {
    const bool joins = lens[r] > 0 && lens[r - 1] > 0 && seqs[r] == seqs[r - 1] &&
                       lens[r] == lens[r - 1] + 1 && r - starts.back() < kBlockRows;
    if (!joins) starts.push_back(r);
  }
  if (rows > 0) starts.push_back(rows);
  return starts;
}

template <ffi::DataType D>
ffi::Error QueryAttention(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> q,
                          ffi::Buffer<ffi::S32> lens, ffi::Buffer<ffi::S32> seqs,
                          ffi::Buffer<ffi::S32> table, ffi::Buffer<D> pages,
                          ffi::Buffer<ffi::S32> window, ffi::ResultBuffer<ffi::F32> out) {
  const auto qd = q.dimensions();
  const auto td = table.dimensions();
  const auto pd = pages.dimensions();
  if (qd.size() != 3 || td.size() != 2 || pd.size() != 4 || lens.element_count() != qd[0] ||
      seqs.element_count() != qd[0] || pd[2] % 2 != 0 || pd[3] != qd[2] ||
      window.element_count() != 1)
    return ffi::Error::InvalidArgument(
        "query_attention takes q (R, H, D), lens (R,), seqs (R,), table (S, P), pages "
        "(N, S, 2KV, D), window ()");
  const int64_t kv = pd[2] / 2;
  if (kv < 1 || qd[1] % kv != 0 || qd[1] / kv > kMaxGroups || qd[2] % kLanes != 0 ||
      qd[2] / kLanes > kMaxDimVecs)
    return ffi::Error::InvalidArgument(
        "query_attention: at most 16 query heads per kv head and a head_dim of 8 to 256 "
        "in steps of 8");
  const int32_t* lens_data = lens.typed_data();
  const int32_t* seqs_data = seqs.typed_data();
  for (int64_t r = 0; r < qd[0]; ++r)
    if (lens_data[r] > 0 && (seqs_data[r] < 0 || seqs_data[r] >= td[0] ||
                             lens_data[r] > td[1] * pd[1]))
      return ffi::Error::InvalidArgument("query_attention: a row past its page table");
  using P = std::conditional_t<D == ffi::F32, float, uint16_t>;
  auto work = std::make_shared<Work<P>>();
  work->q = q.typed_data();
  work->lens = lens_data;
  work->seqs = seqs_data;
  work->table = table.typed_data();
  work->pages = reinterpret_cast<const P*>(pages.untyped_data());
  work->out = out->typed_data();
  work->rows = qd[0];
  work->heads = qd[1];
  work->dim = qd[2];
  work->kv = kv;
  work->page_size = pd[1];
  work->table_width = td[1];
  work->sequences = td[0];
  work->window = window.typed_data()[0];
  work->scale = 1.0f / std::sqrt(static_cast<float>(qd[2]));
  work->starts = Blocks(lens_data, seqs_data, qd[0]);
  work->tasks = (static_cast<int64_t>(work->starts.size()) - 1) * kv;
  if (work->tasks > 0) cpu_kernel::RunOnPool(pool, work);
  return ffi::Error::Success();
}

}  // namespace

#define QUERY_ATTENTION_HANDLER(SUFFIX, D)                                          \
  XLA_FFI_DEFINE_HANDLER_SYMBOL(QueryAttention##SUFFIX, QueryAttention<D>,          \
                                ffi::Ffi::Bind()                                    \
                                    .Ctx<ffi::ThreadPool>()                         \
                                    .Arg<ffi::Buffer<ffi::F32>>()                   \
                                    .Arg<ffi::Buffer<ffi::S32>>()                   \
                                    .Arg<ffi::Buffer<ffi::S32>>()                   \
                                    .Arg<ffi::Buffer<ffi::S32>>()                   \
                                    .Arg<ffi::Buffer<D>>()                          \
                                    .Arg<ffi::Buffer<ffi::S32>>()                   \
                                    .Ret<ffi::Buffer<ffi::F32>>());

QUERY_ATTENTION_HANDLER(F32, ffi::F32)
QUERY_ATTENTION_HANDLER(Bf16, ffi::BF16)
QUERY_ATTENTION_HANDLER(U16, ffi::U16)  // bfloat16 pages kept as their bits (KVLayout.bits)
