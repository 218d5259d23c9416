// What the engine's C++ CPU kernels share (engine/row_dot.cc, engine/attention/cpu_queries.cc):
// an 8-lane float vector with its load, store, fused multiply-add and the one tree its
// lanes are added in, and the one way a kernel spreads its tasks over XLA's thread pool.
// engine/row_dot.py builds each kernel with this header beside it (the header's bytes are
// part of a built library's name).
#ifndef JAX_LLM_SERVER_ENGINE_CPU_KERNEL_H_
#define JAX_LLM_SERVER_ENGINE_CPU_KERNEL_H_

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstring>
#include <memory>

#include "xla/ffi/api/ffi.h"

#if defined(__AVX__)
#include <immintrin.h>
#endif

namespace cpu_kernel {

constexpr int kLanes = 8;
typedef float Vec __attribute__((vector_size(kLanes * sizeof(float))));

inline Vec Load(const float* p) {
  Vec v;
  std::memcpy(&v, p, sizeof(Vec));
  return v;
}

inline void Store(float* p, Vec v) { std::memcpy(p, &v, sizeof(Vec)); }

// a * b + c rounded once, in every instantiation alike (the kernels are built with
// -ffp-contract=off, so the compiler fuses nothing on its own)
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

// The lanes of v added in one fixed tree.
inline float Sum(Vec v) {
  return ((v[0] + v[4]) + (v[2] + v[6])) + ((v[1] + v[5]) + (v[3] + v[7]));
}

// {Sum(a[0]), ..., Sum(a[7])}: the same tree of adds for each, 8 at once.
inline Vec Sums(const Vec* a) {
#if defined(__AVX__)
  __m256 w[4];
  for (int j = 0; j < 4; ++j) {  // lanes l + l + 4: a[j] in the low half, a[j + 4] high
    const __m256 x = reinterpret_cast<__m256>(a[j]);
    const __m256 y = reinterpret_cast<__m256>(a[j + 4]);
    w[j] = _mm256_add_ps(_mm256_permute2f128_ps(x, y, 0x20), _mm256_permute2f128_ps(x, y, 0x31));
  }
  // (v0 + v4) + (v2 + v6) and (v1 + v5) + (v3 + v7), two rows to a half
  const __m256 x01 = _mm256_add_ps(_mm256_shuffle_ps(w[0], w[1], 0x44), _mm256_shuffle_ps(w[0], w[1], 0xEE));
  const __m256 x23 = _mm256_add_ps(_mm256_shuffle_ps(w[2], w[3], 0x44), _mm256_shuffle_ps(w[2], w[3], 0xEE));
  // the two halves of each sum added: rows 0-3 low, 4-7 high
  return reinterpret_cast<Vec>(
      _mm256_add_ps(_mm256_shuffle_ps(x01, x23, 0x88), _mm256_shuffle_ps(x01, x23, 0xDD)));
#else
  Vec out;
  for (int j = 0; j < kLanes; ++j) out[j] = Sum(a[j]);
  return out;
#endif
}

inline void Pause() {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_ia32_pause();
#endif
}

// Tasks 0 .. tasks - 1, each claimed once by whichever thread comes first: a kernel's
// work object derives from it and calls Each from its Run.
struct Claims {
  int64_t tasks = 0;
  std::atomic<int64_t> next{0};
  std::atomic<int64_t> done{0};

  template <typename Fn>
  void Each(Fn fn) {
    for (int64_t t; (t = next.fetch_add(1)) < tasks;) {
      fn(t);
      done.fetch_add(1, std::memory_order_release);
    }
  }
};

// Runs work->Run() on the caller and on up to pool-size - 1 helpers, and returns once
// every task is done. The caller claims too, so the call finishes even when no helper
// comes, and a late helper finds nothing left (it holds the work object until then).
template <typename W>
void RunOnPool(xla::ffi::ThreadPool& pool, const std::shared_ptr<W>& work) {
  const int64_t helpers = std::min<int64_t>(pool.num_threads(), work->tasks) - 1;
  for (int64_t i = 0; i < helpers; ++i) pool.Schedule([work] { work->Run(); });
  work->Run();
  while (work->done.load(std::memory_order_acquire) < work->tasks) Pause();
}

}  // namespace cpu_kernel

#endif  // JAX_LLM_SERVER_ENGINE_CPU_KERNEL_H_
