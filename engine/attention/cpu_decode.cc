// Decode attention over paged KV, read in place: one query per row, each row's keys and
// values read from its own pages where they lie (engine/attention/cpu_kernel.py builds
// and loads this; engine/attention/cpu.py calls it for the decode rows of a step).
//
// A (row, kv head) pair is one task, computed alone: the scores of its query heads over
// the row's positions in position order, their maximum, the exponentials and their sum
// (one fixed order), then the values weighted in position order, over the sum. Nothing
// in that order depends on the other rows, their count or their lengths, so a row's
// bits are its own in any batch; threads only choose which task runs where.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <memory>
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

inline float Sum(Vec v) {
  return ((v[0] + v[4]) + (v[2] + v[6])) + ((v[1] + v[5]) + (v[3] + v[7]));
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

struct Work : Claims {  // a task: one (row, kv head)
  const float* q;        // (rows, heads, dim)
  const int32_t* lens;   // (rows,): positions a row attends over, 0 for no row
  const int32_t* table;  // (rows, table_width): its pages
  const float* pages;    // (num_pages, page_size, 2 * kv, dim): keys then values per kv head
  float* out;            // (rows, heads, dim)
  int64_t rows, heads, dim, kv, page_size, table_width;
  int32_t window;  // 0: none
  float scale;

  void Run() {
    std::vector<float> scores;
    Each([&](int64_t t) { Task(t / kv, t % kv, scores); });
  }

  // fn(i, keys) for the row's positions first + i in order; its values follow its keys.
  // `half` (0: keys, dim: values) is fetched kAhead positions early: one head's row of a
  // position lies a whole position's stride from the next, a step the hardware's
  // prefetcher does not follow, and each read would otherwise wait on memory.
  template <typename Fn>
  void Positions(int64_t r, int64_t h, int64_t first, int64_t len, int64_t half, Fn fn) const {
    constexpr int64_t kAhead = 8;
    const int32_t* row_table = table + r * table_width;
    const int64_t stride = 2 * kv * dim;  // one position's keys and values, every kv head
    auto at = [&](int64_t pos) {
      const int64_t page = row_table[pos / page_size];
      return pages + (page * page_size + pos % page_size) * stride + 2 * h * dim;
    };
    for (int64_t pos = first; pos < std::min(len, first + kAhead); ++pos) Fetch(at(pos) + half);
    for (int64_t pos = first; pos < len;) {
      const int64_t slot = pos % page_size;
      const int64_t count = std::min(page_size - slot, len - pos);
      const float* base = at(pos);
      for (int64_t j = 0; j < count; ++j) {
        const int64_t later = pos + j + kAhead;
        if (later < len) Fetch((j + kAhead < count ? base + (j + kAhead) * stride : at(later)) + half);
        fn(pos - first + j, base + j * stride);
      }
      pos += count;
    }
  }

  void Fetch(const float* row) const {
    for (int64_t d = 0; d < dim; d += 16) __builtin_prefetch(row + d);  // 64-byte lines
  }

  void Task(int64_t r, int64_t h, std::vector<float>& scores) const {
    const int64_t groups = heads / kv;
    const int64_t vecs = dim / kLanes;
    float* dst = out + (r * heads + h * groups) * dim;
    const int64_t len = lens[r];
    if (len <= 0) {
      std::fill(dst, dst + groups * dim, 0.0f);
      return;
    }
    const int64_t first = window > 0 ? std::max<int64_t>(0, len - window) : 0;
    const int64_t n = len - first;
    const int64_t padded = (n + kLanes - 1) / kLanes * kLanes;
    scores.assign(groups * padded, -INFINITY);  // past n: exp gives 0
    const float* query = q + (r * heads + h * groups) * dim;
    float top[kMaxGroups];
    for (int64_t g = 0; g < groups; ++g) top[g] = -INFINITY;
    Positions(r, h, first, len, 0, [&](int64_t i, const float* k) {
      for (int64_t g = 0; g < groups; ++g) {
        const float* qg = query + g * dim;
        Vec acc{};
        for (int64_t c = 0; c < vecs; ++c) acc = Fma(Load(qg + c * kLanes), Load(k + c * kLanes), acc);
        const float s = Sum(acc) * scale;
        scores[g * padded + i] = s;
        top[g] = std::max(top[g], s);
      }
    });
    float total[kMaxGroups];
    for (int64_t g = 0; g < groups; ++g) {
      float* sg = scores.data() + g * padded;
      Vec sum{};
      for (int64_t i = 0; i < padded; i += kLanes) {
        const Vec p = Exp(Load(sg + i) - Splat(top[g]));
        Store(sg + i, p);
        sum += p;
      }
      total[g] = Sum(sum);
    }
    Vec acc[kMaxGroups * kMaxDimVecs];
    for (int64_t a = 0; a < groups * vecs; ++a) acc[a] = Vec{};
    Positions(r, h, first, len, dim, [&](int64_t i, const float* k) {
      const float* v = k + dim;
      for (int64_t c = 0; c < vecs; ++c) {
        const Vec vv = Load(v + c * kLanes);
        for (int64_t g = 0; g < groups; ++g)
          acc[g * vecs + c] = Fma(Splat(scores[g * padded + i]), vv, acc[g * vecs + c]);
      }
    });
    for (int64_t g = 0; g < groups; ++g)
      for (int64_t c = 0; c < vecs; ++c)
        Store(dst + g * dim + c * kLanes, acc[g * vecs + c] / Splat(total[g]));
  }
};

ffi::Error DecodeAttention(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> q,
                           ffi::Buffer<ffi::S32> lens, ffi::Buffer<ffi::S32> table,
                           ffi::Buffer<ffi::F32> pages, ffi::Buffer<ffi::S32> window,
                           ffi::ResultBuffer<ffi::F32> out) {
  const auto qd = q.dimensions();
  const auto td = table.dimensions();
  const auto pd = pages.dimensions();
  if (qd.size() != 3 || td.size() != 2 || pd.size() != 4 || lens.element_count() != qd[0] ||
      td[0] != qd[0] || pd[2] % 2 != 0 || pd[3] != qd[2] || window.element_count() != 1)
    return ffi::Error::InvalidArgument(
        "decode_attention takes q (R, H, D), lens (R,), table (R, P), pages (N, S, 2KV, D), "
        "window ()");
  const int64_t kv = pd[2] / 2;
  if (kv < 1 || qd[1] % kv != 0 || qd[1] / kv > kMaxGroups || qd[2] % kLanes != 0 ||
      qd[2] / kLanes > kMaxDimVecs)
    return ffi::Error::InvalidArgument(
        "decode_attention: at most 16 query heads per kv head and a head_dim of 8 to 256 "
        "in steps of 8");
  auto work = std::make_shared<Work>();
  work->q = q.typed_data();
  work->lens = lens.typed_data();
  work->table = table.typed_data();
  work->pages = pages.typed_data();
  work->out = out->typed_data();
  work->rows = qd[0];
  work->heads = qd[1];
  work->dim = qd[2];
  work->kv = kv;
  work->page_size = pd[1];
  work->table_width = td[1];
  work->window = window.typed_data()[0];
  work->scale = 1.0f / std::sqrt(static_cast<float>(qd[2]));
  work->tasks = work->rows * kv;
  cpu_kernel::RunOnPool(pool, work);
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(DecodeAttentionF32, DecodeAttention,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>());
