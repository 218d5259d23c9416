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
// products pack the weights on every call at more than one row). Float32 rows and
// weights, or bfloat16 ones summed in float32 (namespace bf16 below says how), or
// weights packed once at load for broadcast rows (namespace packed: one lane an output,
// the engine's layers and head in float32, and in bfloat16 where AVX512-BF16 is native).
#include <algorithm>
#include <cstdint>
#include <cstring>
#include <memory>
#include <type_traits>

#include "cpu_kernel.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

using cpu_kernel::Claims;
using cpu_kernel::Fma;
using cpu_kernel::kLanes;
using cpu_kernel::Load;
using cpu_kernel::Vec;
// 4 x 3 accumulators, 3 weight vectors and a row's vector: AVX2's 16 registers (the
// fastest of 2x4, 3x3, 3x4 and 4x3 measured at 1-256 rows, bench/README "CPU products";
// on x86-64 the 4 x 3 pass is written in assembly, Pass4x3)
constexpr int kRowBlock = 4;     // rows sharing a pass over a block of weight rows
constexpr int kWeightBlock = 3;  // weight rows a pass holds
constexpr int64_t kTaskWeightRows = 48;  // weight rows a task takes (in L2 across row blocks)

// The one reduction order: lanes in a fixed tree (cpu_kernel::Sum), then the tail in k
// order.
inline float Finish(Vec acc, const float* x, const float* w, int64_t from, int64_t k) {
  float s = cpu_kernel::Sum(acc);
  for (int64_t i = from; i < k; ++i) s = __builtin_fmaf(x[i], w[i], s);
  return s;
}

#if defined(__AVX__) && defined(__FMA__) && defined(__x86_64__)
// The 4 x 3 pass in assembly: GCC 12 folds the weight loads into each row's FMA (four
// loads of one weight vector) and spills an accumulator; here each weight vector and
// each row vector is loaded once per k step, and the 12 accumulators stay in registers.
// The FMAs are the C form's, in the same order: the bits are the same.
inline void Pass4x3(const float* x0, const float* x1, const float* x2, const float* x3,
                    const float* w0, const float* w1, const float* w2, int64_t body,
                    float* acc) {
  asm volatile(
      "vxorps %%ymm0, %%ymm0, %%ymm0\n\t"
      "vxorps %%ymm1, %%ymm1, %%ymm1\n\t"
      "vxorps %%ymm2, %%ymm2, %%ymm2\n\t"
      "vxorps %%ymm3, %%ymm3, %%ymm3\n\t"
      "vxorps %%ymm4, %%ymm4, %%ymm4\n\t"
      "vxorps %%ymm5, %%ymm5, %%ymm5\n\t"
      "vxorps %%ymm6, %%ymm6, %%ymm6\n\t"
      "vxorps %%ymm7, %%ymm7, %%ymm7\n\t"
      "vxorps %%ymm8, %%ymm8, %%ymm8\n\t"
      "vxorps %%ymm9, %%ymm9, %%ymm9\n\t"
      "vxorps %%ymm10, %%ymm10, %%ymm10\n\t"
      "vxorps %%ymm11, %%ymm11, %%ymm11\n\t"
      "xorq %%rax, %%rax\n\t"
      "testq %[n], %[n]\n\t"
      "jle 2f\n\t"
      ".p2align 4\n"
      "1:\n\t"
      "vmovups (%[w0],%%rax,4), %%ymm12\n\t"
      "vmovups (%[w1],%%rax,4), %%ymm13\n\t"
      "vmovups (%[w2],%%rax,4), %%ymm14\n\t"
      "vmovups (%[x0],%%rax,4), %%ymm15\n\t"
      "vfmadd231ps %%ymm12, %%ymm15, %%ymm0\n\t"
      "vfmadd231ps %%ymm13, %%ymm15, %%ymm1\n\t"
      "vfmadd231ps %%ymm14, %%ymm15, %%ymm2\n\t"
      "vmovups (%[x1],%%rax,4), %%ymm15\n\t"
      "vfmadd231ps %%ymm12, %%ymm15, %%ymm3\n\t"
      "vfmadd231ps %%ymm13, %%ymm15, %%ymm4\n\t"
      "vfmadd231ps %%ymm14, %%ymm15, %%ymm5\n\t"
      "vmovups (%[x2],%%rax,4), %%ymm15\n\t"
      "vfmadd231ps %%ymm12, %%ymm15, %%ymm6\n\t"
      "vfmadd231ps %%ymm13, %%ymm15, %%ymm7\n\t"
      "vfmadd231ps %%ymm14, %%ymm15, %%ymm8\n\t"
      "vmovups (%[x3],%%rax,4), %%ymm15\n\t"
      "vfmadd231ps %%ymm12, %%ymm15, %%ymm9\n\t"
      "vfmadd231ps %%ymm13, %%ymm15, %%ymm10\n\t"
      "vfmadd231ps %%ymm14, %%ymm15, %%ymm11\n\t"
      "addq $8, %%rax\n\t"
      "cmpq %[n], %%rax\n\t"
      "jl 1b\n"
      "2:\n\t"
      "vmovups %%ymm0, (%[acc])\n\t"
      "vmovups %%ymm1, 32(%[acc])\n\t"
      "vmovups %%ymm2, 64(%[acc])\n\t"
      "vmovups %%ymm3, 96(%[acc])\n\t"
      "vmovups %%ymm4, 128(%[acc])\n\t"
      "vmovups %%ymm5, 160(%[acc])\n\t"
      "vmovups %%ymm6, 192(%[acc])\n\t"
      "vmovups %%ymm7, 224(%[acc])\n\t"
      "vmovups %%ymm8, 256(%[acc])\n\t"
      "vmovups %%ymm9, 288(%[acc])\n\t"
      "vmovups %%ymm10, 320(%[acc])\n\t"
      "vmovups %%ymm11, 352(%[acc])\n\t"
      "vzeroupper\n\t"
      :
      : [x0] "r"(x0), [x1] "r"(x1), [x2] "r"(x2), [x3] "r"(x3), [w0] "r"(w0), [w1] "r"(w1),
        [w2] "r"(w2), [n] "r"(body), [acc] "r"(acc)
      : "rax", "memory", "cc", "xmm0", "xmm1", "xmm2", "xmm3", "xmm4", "xmm5", "xmm6", "xmm7",
        "xmm8", "xmm9", "xmm10", "xmm11", "xmm12", "xmm13", "xmm14", "xmm15");
}
#define HAVE_PASS4X3 1
#endif

#if defined(__AVX512VL__) && defined(__FMA__) && defined(__x86_64__)
// The 8 x 3 pass where AVX-512 gives 32 vector registers (EVEX-encoded 256-bit
// instructions, the same 8-lane FMAs as the 4 x 3 pass, in the same order: the bits are
// the same): 24 accumulators, and each weight vector loaded once a k step for 8 rows, so
// a decode step of 8 rows streams the weights once, not twice. `stride` is a row's bytes.
inline void Pass8x3(const float* x, int64_t stride, const float* w0, const float* w1,
                    const float* w2, int64_t body, float* acc) {
  const float* p;
  const float* q;
  asm volatile(
      "vxorps %%ymm0, %%ymm0, %%ymm0\n\t"
      "vxorps %%ymm1, %%ymm1, %%ymm1\n\t"
      "vxorps %%ymm2, %%ymm2, %%ymm2\n\t"
      "vxorps %%ymm3, %%ymm3, %%ymm3\n\t"
      "vxorps %%ymm4, %%ymm4, %%ymm4\n\t"
      "vxorps %%ymm5, %%ymm5, %%ymm5\n\t"
      "vxorps %%ymm6, %%ymm6, %%ymm6\n\t"
      "vxorps %%ymm7, %%ymm7, %%ymm7\n\t"
      "vxorps %%ymm8, %%ymm8, %%ymm8\n\t"
      "vxorps %%ymm9, %%ymm9, %%ymm9\n\t"
      "vxorps %%ymm10, %%ymm10, %%ymm10\n\t"
      "vxorps %%ymm11, %%ymm11, %%ymm11\n\t"
      "vxorps %%ymm12, %%ymm12, %%ymm12\n\t"
      "vxorps %%ymm13, %%ymm13, %%ymm13\n\t"
      "vxorps %%ymm14, %%ymm14, %%ymm14\n\t"
      "vxorps %%ymm15, %%ymm15, %%ymm15\n\t"
      "vxorps %%ymm16, %%ymm16, %%ymm16\n\t"
      "vxorps %%ymm17, %%ymm17, %%ymm17\n\t"
      "vxorps %%ymm18, %%ymm18, %%ymm18\n\t"
      "vxorps %%ymm19, %%ymm19, %%ymm19\n\t"
      "vxorps %%ymm20, %%ymm20, %%ymm20\n\t"
      "vxorps %%ymm21, %%ymm21, %%ymm21\n\t"
      "vxorps %%ymm22, %%ymm22, %%ymm22\n\t"
      "vxorps %%ymm23, %%ymm23, %%ymm23\n\t"
      "xorq %%rax, %%rax\n\t"
      "testq %[n], %[n]\n\t"
      "jle 2f\n\t"
      ".p2align 4\n"
      "1:\n\t"
      "leaq (%[x],%%rax,4), %[p]\n\t"
      "leaq (%[p],%[s],4), %[q]\n\t"
      "vmovups (%[w0],%%rax,4), %%ymm24\n\t"
      "vmovups (%[w1],%%rax,4), %%ymm25\n\t"
      "vmovups (%[w2],%%rax,4), %%ymm26\n\t"
      "vmovups (%[p]), %%ymm27\n\t"
      "vfmadd231ps %%ymm24, %%ymm27, %%ymm0\n\t"
      "vfmadd231ps %%ymm25, %%ymm27, %%ymm1\n\t"
      "vfmadd231ps %%ymm26, %%ymm27, %%ymm2\n\t"
      "vmovups (%[p],%[s],1), %%ymm27\n\t"
      "vfmadd231ps %%ymm24, %%ymm27, %%ymm3\n\t"
      "vfmadd231ps %%ymm25, %%ymm27, %%ymm4\n\t"
      "vfmadd231ps %%ymm26, %%ymm27, %%ymm5\n\t"
      "vmovups (%[p],%[s],2), %%ymm27\n\t"
      "vfmadd231ps %%ymm24, %%ymm27, %%ymm6\n\t"
      "vfmadd231ps %%ymm25, %%ymm27, %%ymm7\n\t"
      "vfmadd231ps %%ymm26, %%ymm27, %%ymm8\n\t"
      "vmovups (%[p],%[s3],1), %%ymm27\n\t"
      "vfmadd231ps %%ymm24, %%ymm27, %%ymm9\n\t"
      "vfmadd231ps %%ymm25, %%ymm27, %%ymm10\n\t"
      "vfmadd231ps %%ymm26, %%ymm27, %%ymm11\n\t"
      "vmovups (%[q]), %%ymm27\n\t"
      "vfmadd231ps %%ymm24, %%ymm27, %%ymm12\n\t"
      "vfmadd231ps %%ymm25, %%ymm27, %%ymm13\n\t"
      "vfmadd231ps %%ymm26, %%ymm27, %%ymm14\n\t"
      "vmovups (%[q],%[s],1), %%ymm27\n\t"
      "vfmadd231ps %%ymm24, %%ymm27, %%ymm15\n\t"
      "vfmadd231ps %%ymm25, %%ymm27, %%ymm16\n\t"
      "vfmadd231ps %%ymm26, %%ymm27, %%ymm17\n\t"
      "vmovups (%[q],%[s],2), %%ymm27\n\t"
      "vfmadd231ps %%ymm24, %%ymm27, %%ymm18\n\t"
      "vfmadd231ps %%ymm25, %%ymm27, %%ymm19\n\t"
      "vfmadd231ps %%ymm26, %%ymm27, %%ymm20\n\t"
      "vmovups (%[q],%[s3],1), %%ymm27\n\t"
      "vfmadd231ps %%ymm24, %%ymm27, %%ymm21\n\t"
      "vfmadd231ps %%ymm25, %%ymm27, %%ymm22\n\t"
      "vfmadd231ps %%ymm26, %%ymm27, %%ymm23\n\t"
      "addq $8, %%rax\n\t"
      "cmpq %[n], %%rax\n\t"
      "jl 1b\n"
      "2:\n\t"
      "vmovups %%ymm0, (%[acc])\n\t"
      "vmovups %%ymm1, 32(%[acc])\n\t"
      "vmovups %%ymm2, 64(%[acc])\n\t"
      "vmovups %%ymm3, 96(%[acc])\n\t"
      "vmovups %%ymm4, 128(%[acc])\n\t"
      "vmovups %%ymm5, 160(%[acc])\n\t"
      "vmovups %%ymm6, 192(%[acc])\n\t"
      "vmovups %%ymm7, 224(%[acc])\n\t"
      "vmovups %%ymm8, 256(%[acc])\n\t"
      "vmovups %%ymm9, 288(%[acc])\n\t"
      "vmovups %%ymm10, 320(%[acc])\n\t"
      "vmovups %%ymm11, 352(%[acc])\n\t"
      "vmovups %%ymm12, 384(%[acc])\n\t"
      "vmovups %%ymm13, 416(%[acc])\n\t"
      "vmovups %%ymm14, 448(%[acc])\n\t"
      "vmovups %%ymm15, 480(%[acc])\n\t"
      "vmovups %%ymm16, 512(%[acc])\n\t"
      "vmovups %%ymm17, 544(%[acc])\n\t"
      "vmovups %%ymm18, 576(%[acc])\n\t"
      "vmovups %%ymm19, 608(%[acc])\n\t"
      "vmovups %%ymm20, 640(%[acc])\n\t"
      "vmovups %%ymm21, 672(%[acc])\n\t"
      "vmovups %%ymm22, 704(%[acc])\n\t"
      "vmovups %%ymm23, 736(%[acc])\n\t"
      "vzeroupper\n\t"
      : [p] "=&r"(p), [q] "=&r"(q)
      : [x] "r"(x), [s] "r"(stride), [s3] "r"(3 * stride), [w0] "r"(w0), [w1] "r"(w1),
        [w2] "r"(w2), [n] "r"(body), [acc] "r"(acc)
      : "rax", "memory", "cc", "xmm0", "xmm1", "xmm2", "xmm3", "xmm4", "xmm5", "xmm6", "xmm7",
        "xmm8", "xmm9", "xmm10", "xmm11", "xmm12", "xmm13", "xmm14", "xmm15", "xmm16",
        "xmm17", "xmm18", "xmm19", "xmm20", "xmm21", "xmm22", "xmm23", "xmm24", "xmm25",
        "xmm26", "xmm27");
}
#define HAVE_PASS8X3 1
#endif

// acc[r][c]: the lanes of out[m0 + r, n0 + c] over k's body (the assembly passes where
// they exist, the same FMAs in C otherwise).
template <int R, int C>
inline void Accumulate(const float* x, const float* w, Vec (&acc)[R][C], int64_t m0, int64_t n0,
                       int64_t k, int64_t body) {
#ifdef HAVE_PASS8X3
  if constexpr (R == 8 && C == 3) {
    Pass8x3(x + m0 * k, k * static_cast<int64_t>(sizeof(float)), w + n0 * k, w + (n0 + 1) * k,
            w + (n0 + 2) * k, body, reinterpret_cast<float*>(acc));
    return;
  }
#endif
#ifdef HAVE_PASS4X3
  if constexpr (R == 4 && C == 3) {
    const float* xr = x + m0 * k;
    const float* wr = w + n0 * k;
    Pass4x3(xr, xr + k, xr + 2 * k, xr + 3 * k, wr, wr + k, wr + 2 * k, body,
            reinterpret_cast<float*>(acc));
    return;
  }
#endif
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c) acc[r][c] = Vec{};
  for (int64_t i = 0; i < body; i += kLanes) {
    Vec wv[C];
    for (int c = 0; c < C; ++c) wv[c] = Load(w + (n0 + c) * k + i);
    for (int r = 0; r < R; ++r) {
      const Vec xv = Load(x + (m0 + r) * k + i);
      for (int c = 0; c < C; ++c) acc[r][c] = Fma(xv, wv[c], acc[r][c]);
    }
  }
}

// out[m, n] for rows [m0, m0 + R) and weight rows [n0, n0 + C), R <= 8, C <= kWeightBlock.
template <int R, int C>
inline void Block(const float* x, const float* w, float* out, int64_t m0, int64_t n0, int64_t k,
                  int64_t n_total) {
  Vec acc[R][C];
  const int64_t body = k - k % kLanes;
  Accumulate<R, C>(x, w, acc, m0, n0, k, body);
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
#ifdef HAVE_PASS8X3
  for (; m0 + 2 * kRowBlock <= m; m0 += 2 * kRowBlock)
    Rows<2 * kRowBlock>(x, w, out, m0, k, n_total, from, to);
#endif
  for (; m0 + kRowBlock <= m; m0 += kRowBlock) Rows<kRowBlock>(x, w, out, m0, k, n_total, from, to);
  for (; m0 < m; ++m0) Rows<1>(x, w, out, m0, k, n_total, from, to);
}


// bfloat16 rows and weights, summed in float32: each output element owns 16 float32
// lanes; lane l sums the pairs (k, k + 1) = (32 j + 2 l, 32 j + 2 l + 1) over j in order
// (AVX512-BF16's VDPBF16PS: both products exact in float32, added to the lane), the
// K % 32 tail as one more step with zeros past K; then lanes l and l + 8 are added and
// the 8 sums go through cpu_kernel::Sum. As for float32, blocking and threading change
// which accumulators live together, never one's order. Without AVX512-BF16 the same
// steps are emulated lane by lane (slow: engine.row_dot serves bfloat16 with it only
// where the instruction is there, `RowDotBf16Native`).
namespace bf16 {

constexpr int64_t kStep = 32;  // bfloat16 values a step takes (16 lanes of pairs)

#if defined(__AVX512BF16__) && defined(__AVX512F__) && defined(__AVX512BW__)
constexpr bool kNative = true;
typedef __m512 Acc;
typedef __m512bh Pairs;
inline Acc Zero() { return _mm512_setzero_ps(); }
inline Pairs Ld(const uint16_t* p) { return reinterpret_cast<Pairs>(_mm512_loadu_si512(p)); }
inline Pairs LdTail(const uint16_t* p, int64_t n) {
  return reinterpret_cast<Pairs>(_mm512_maskz_loadu_epi16(static_cast<__mmask32>((1ull << n) - 1), p));
}
inline Acc Dot(Acc acc, Pairs a, Pairs b) { return _mm512_dpbf16_ps(acc, a, b); }
inline void Put(float* p, Acc a) { _mm512_storeu_ps(p, a); }
#else
constexpr bool kNative = false;
struct Acc { float l[16]; };
struct Pairs { uint16_t v[32]; };
inline Acc Zero() { return Acc{}; }
inline Pairs Ld(const uint16_t* p) { Pairs r; std::memcpy(r.v, p, sizeof r.v); return r; }
inline Pairs LdTail(const uint16_t* p, int64_t n) {
  Pairs r{};
  std::memcpy(r.v, p, n * sizeof(uint16_t));
  return r;
}
inline float Wide(uint16_t b) {
  const uint32_t bits = static_cast<uint32_t>(b) << 16;
  float f;
  std::memcpy(&f, &bits, sizeof f);
  return f;
}
inline Acc Dot(Acc acc, const Pairs& a, const Pairs& b) {
  for (int l = 0; l < 16; ++l) {
    acc.l[l] = acc.l[l] + Wide(a.v[2 * l + 1]) * Wide(b.v[2 * l + 1]);
    acc.l[l] = acc.l[l] + Wide(a.v[2 * l]) * Wide(b.v[2 * l]);
  }
  return acc;
}
inline void Put(float* p, const Acc& a) { std::memcpy(p, a.l, sizeof a.l); }
#endif

// Lanes l and l + 8 added: the 8 sums the lane tree takes.
inline Vec Halves(const Acc& acc) {
#if defined(__AVX512BF16__) && defined(__AVX512F__) && defined(__AVX512BW__) && \
    defined(__AVX512DQ__)
  return reinterpret_cast<Vec>(
      _mm256_add_ps(_mm512_castps512_ps256(acc), _mm512_extractf32x8_ps(acc, 1)));
#else
  alignas(64) float lanes[16];
  Put(lanes, acc);
  return Load(lanes) + Load(lanes + 8);
#endif
}

// Every output of a block: its halves through the lane tree, 8 outputs at once
// (cpu_kernel::Sums, the same tree as cpu_kernel::Sum, which takes the rest).
template <int N>
inline void Finish(const Acc* acc, float* sums) {
  Vec halves[N];
  for (int i = 0; i < N; ++i) halves[i] = Halves(acc[i]);
  int i = 0;
  for (; i + cpu_kernel::kLanes <= N; i += cpu_kernel::kLanes)
    cpu_kernel::Store(sums + i, cpu_kernel::Sums(halves + i));
  for (; i < N; ++i) sums[i] = cpu_kernel::Sum(halves[i]);
}

// out[m, n] for rows [m0, m0 + R) and weight rows [n0, n0 + C)
template <int R, int C>
inline void Block(const uint16_t* x, const uint16_t* w, float* out, int64_t m0, int64_t n0,
                  int64_t k, int64_t n_total) {
  Acc acc[R][C];
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c) acc[r][c] = Zero();
  const int64_t body = k - k % kStep;
  for (int64_t i = 0; i < body; i += kStep) {
    Pairs wv[C];
    for (int c = 0; c < C; ++c) wv[c] = Ld(w + (n0 + c) * k + i);
    for (int r = 0; r < R; ++r) {
      const Pairs xv = Ld(x + (m0 + r) * k + i);
      for (int c = 0; c < C; ++c) acc[r][c] = Dot(acc[r][c], xv, wv[c]);
    }
  }
  if (body < k) {
    Pairs wv[C];
    for (int c = 0; c < C; ++c) wv[c] = LdTail(w + (n0 + c) * k + body, k - body);
    for (int r = 0; r < R; ++r) {
      const Pairs xv = LdTail(x + (m0 + r) * k + body, k - body);
      for (int c = 0; c < C; ++c) acc[r][c] = Dot(acc[r][c], xv, wv[c]);
    }
  }
  float sums[R * C];
  Finish<R * C>(&acc[0][0], sums);
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c) out[(m0 + r) * n_total + n0 + c] = sums[r * C + c];
}

template <int R>
void Rows(const uint16_t* x, const uint16_t* w, float* out, int64_t m0, int64_t k,
          int64_t n_total, int64_t from, int64_t to) {
  int64_t n0 = from;
  for (; n0 + kWeightBlock <= to; n0 += kWeightBlock)
    Block<R, kWeightBlock>(x, w, out, m0, n0, k, n_total);
  for (; n0 < to; ++n0) Block<R, 1>(x, w, out, m0, n0, k, n_total);
}

}  // namespace bf16

void Range(const uint16_t* x, const uint16_t* w, float* out, int64_t m, int64_t k,
           int64_t n_total, int64_t from, int64_t to) {
  int64_t m0 = 0;
  if constexpr (bf16::kNative)  // 24 accumulators in 32 registers
    for (; m0 + 8 <= m; m0 += 8) bf16::Rows<8>(x, w, out, m0, k, n_total, from, to);
  for (; m0 + kRowBlock <= m; m0 += kRowBlock)
    bf16::Rows<kRowBlock>(x, w, out, m0, k, n_total, from, to);
  for (; m0 < m; ++m0) bf16::Rows<1>(x, w, out, m0, k, n_total, from, to);
}

// Weights packed once at load for broadcast rows (engine.row_dot.pack), 16 outputs a
// vector: float32 w (NB, K, 16), lane o of step j output 16 b + o's w[., j]; bfloat16 w
// (NB, K / 2, 32), lane o of step j the pair (2 j, 2 j + 1) of output 16 b + o. A step
// broadcasts a row's value (float32) or pair (bfloat16) to every lane and adds its
// products with the 16 outputs' (a fused multiply-add; VDPBF16PS, as bf16::Dot), so an
// output's sum runs over k in order from zero in one lane: no lane tree to finish, 16
// outputs stored at once (the lane forms' fixed cost per block of outputs was a quarter
// of their time at K = 576, bench/README "Packed bfloat16 weights"). Blocking and
// threading again choose only which accumulators live together: a row's bits are the
// same at any row count, and float32's the same on every processor (a lane's chain of
// FMAs in k order).
namespace packed {

constexpr int64_t kOutputs = 16;     // outputs a vector holds
constexpr int64_t kTaskVectors = 3;  // 48 outputs a task, in L2 across row blocks

// bfloat16: a step takes a row's k pair.
struct Bf16 {
  using T = uint16_t;
  using Acc = bf16::Acc;
  using Step = bf16::Pairs;
  static constexpr int64_t kPer = 2;       // k a step takes
  static constexpr int kRows = 8;          // rows a pass: 24 accumulators of 32 registers
  static constexpr int kVectors = 3;       // vectors a pass
  static Acc Zero() { return bf16::Zero(); }
  static Step Ld(const T* p) { return bf16::Ld(p); }
  static Step Broadcast(const T* p) {
#if defined(__AVX512BF16__) && defined(__AVX512F__) && defined(__AVX512BW__)
    uint32_t pair;
    std::memcpy(&pair, p, sizeof pair);
    return reinterpret_cast<Step>(_mm512_set1_epi32(static_cast<int>(pair)));
#else
    Step r;
    for (int l = 0; l < 16; ++l) {
      r.v[2 * l] = p[0];
      r.v[2 * l + 1] = p[1];
    }
    return r;
#endif
  }
  static Acc Dot(Acc acc, const Step& x, const Step& w) { return bf16::Dot(acc, x, w); }
  static void Put(float* p, const Acc& a) { bf16::Put(p, a); }
};

// float32: a step takes one k, x[k] * w + acc rounded once in each lane.
struct F32 {
  using T = float;
  static constexpr int64_t kPer = 1;
#if defined(__AVX512F__)
  using Acc = __m512;
  using Step = __m512;
  static constexpr int kRows = 8;
  static constexpr int kVectors = 3;
  static Acc Zero() { return _mm512_setzero_ps(); }
  static Step Ld(const T* p) { return _mm512_loadu_ps(p); }
  static Step Broadcast(const T* p) { return _mm512_set1_ps(*p); }
  static Acc Dot(Acc acc, Step x, Step w) { return _mm512_fmadd_ps(x, w, acc); }
  static void Put(float* p, Acc a) { _mm512_storeu_ps(p, a); }
#else  // two 8-lane halves (AVX2's registers, cpu_kernel::Fma)
  struct Acc { Vec lo, hi; };
  using Step = Acc;
  static constexpr int kRows = 4;    // 8 accumulators, 2 weight halves, a row value: of 16
  static constexpr int kVectors = 1;
  static Acc Zero() { return Acc{}; }
  static Step Ld(const T* p) { return Acc{Load(p), Load(p + kLanes)}; }
  static Step Broadcast(const T* p) {
    Vec v;
    for (int l = 0; l < kLanes; ++l) v[l] = *p;
    return Acc{v, v};
  }
  static Acc Dot(Acc acc, const Step& x, const Step& w) {
    return Acc{Fma(x.lo, w.lo, acc.lo), Fma(x.hi, w.hi, acc.hi)};
  }
  static void Put(float* p, const Acc& a) {
    cpu_kernel::Store(p, a.lo);
    cpu_kernel::Store(p + kLanes, a.hi);
  }
#endif
};

// out[m, 16 b + o] for rows [m0, m0 + R) and vectors [b0, b0 + C)
template <typename F, int R, int C>
inline void Block(const typename F::T* x, const typename F::T* w, float* out, int64_t m0,
                  int64_t b0, int64_t k, int64_t n_total) {
  const int64_t steps = k / F::kPer;
  const int64_t width = kOutputs * F::kPer;  // a vector's values a step
  typename F::Acc acc[R][C];
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c) acc[r][c] = F::Zero();
  for (int64_t j = 0; j < steps; ++j) {
    typename F::Step wv[C];
    for (int c = 0; c < C; ++c) wv[c] = F::Ld(w + ((b0 + c) * steps + j) * width);
    for (int r = 0; r < R; ++r) {
      const typename F::Step xv = F::Broadcast(x + (m0 + r) * k + F::kPer * j);
      for (int c = 0; c < C; ++c) acc[r][c] = F::Dot(acc[r][c], xv, wv[c]);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c) F::Put(out + (m0 + r) * n_total + (b0 + c) * kOutputs, acc[r][c]);
}

template <typename F, int R>
void Rows(const typename F::T* x, const typename F::T* w, float* out, int64_t m0, int64_t k,
          int64_t n_total, int64_t from, int64_t to) {
  int64_t b = from;
  for (; b + F::kVectors <= to; b += F::kVectors)
    Block<F, R, F::kVectors>(x, w, out, m0, b, k, n_total);
  for (; b < to; ++b) Block<F, R, 1>(x, w, out, m0, b, k, n_total);
}

// Every row against vectors [from, to): F::kRows rows a pass, then 4, then 1.
template <typename F>
void Range(const typename F::T* x, const typename F::T* w, float* out, int64_t m, int64_t k,
           int64_t n_total, int64_t from, int64_t to) {
  int64_t m0 = 0;
  for (; m0 + F::kRows <= m; m0 += F::kRows) Rows<F, F::kRows>(x, w, out, m0, k, n_total, from, to);
  if constexpr (F::kRows > 4)
    for (; m0 + 4 <= m; m0 += 4) Rows<F, 4>(x, w, out, m0, k, n_total, from, to);
  for (; m0 < m; ++m0) Rows<F, 1>(x, w, out, m0, k, n_total, from, to);
}

}  // namespace packed

// Every row against weight units [from, to) (weight rows, or packed vectors of 16).
template <typename T>
using RangeFn = void (*)(const T*, const T*, float*, int64_t, int64_t, int64_t, int64_t,
                         int64_t);

// How a form splits its weights into tasks: `per_task` of its `units` a task.
template <typename T>
struct Tiling {
  RangeFn<T> range;
  int64_t per_task;
  int64_t units;
};

// A task is a block of weight units against every row.
template <typename T>
struct Work : Claims {
  const T* x;
  const T* w;
  float* out;
  int64_t m, k, n;
  Tiling<T> tiling;

  void Run() {
    Each([this](int64_t t) {
      const int64_t from = t * tiling.per_task;
      tiling.range(x, w, out, m, k, n, from, std::min(tiling.units, from + tiling.per_task));
    });
  }
};

// Rows from `live` on are padding (a step's bucket past its tokens): their outputs are
// zeros, and they cost nothing (a row's products never involve another row). The lane
// forms' units are weight rows; `tiling` gives another form's.
template <typename T>
ffi::Error Run(ffi::ThreadPool& pool, const T* x, const T* w, float* out, int64_t m, int64_t k,
               int64_t n, const ffi::Buffer<ffi::S32>& live, Tiling<T> tiling = {}) {
  if (live.element_count() != 1) return ffi::Error::InvalidArgument("row_dot: live is one int");
  if (tiling.range == nullptr) tiling = {Range, kTaskWeightRows, n};
  const int64_t rows = std::clamp<int64_t>(live.typed_data()[0], 0, m);
  std::fill(out + rows * n, out + m * n, 0.0f);
  auto work = std::make_shared<Work<T>>();
  work->x = x;
  work->w = w;
  work->out = out;
  work->m = rows;
  work->k = k;
  work->n = n;
  work->tiling = tiling;
  work->tasks = (tiling.units + tiling.per_task - 1) / tiling.per_task;
  cpu_kernel::RunOnPool(pool, work);
  return ffi::Error::Success();
}

// The element type a handler takes: float32, or bfloat16 read as its 16 bits.
template <ffi::DataType D>
using Elem = std::conditional_t<D == ffi::F32, float, uint16_t>;

template <ffi::DataType D>
const Elem<D>* Data(const ffi::Buffer<D>& b) {
  return reinterpret_cast<const Elem<D>*>(b.untyped_data());
}

template <ffi::DataType D>
ffi::Error RowDot(ffi::ThreadPool pool, ffi::Buffer<D> x, ffi::Buffer<D> w,
                  ffi::Buffer<ffi::S32> live, ffi::ResultBuffer<ffi::F32> out) {
  const auto xd = x.dimensions();
  const auto wd = w.dimensions();
  if (xd.size() != 2 || wd.size() != 2 || xd[1] != wd[1])
    return ffi::Error::InvalidArgument("row_dot takes x (M, K) and w (N, K)");
  return Run(pool, Data(x), Data(w), out->typed_data(), xd[0], xd[1], wd[0], live);
}

// Layer `index` of stacked weights (L, N, K), read where it lies: a slice of the stack
// passed as an operand would be copied out of it first (a pass over the layer's weights).
template <ffi::DataType D>
ffi::Error RowDotLayer(ffi::ThreadPool pool, ffi::Buffer<D> x, ffi::Buffer<D> w,
                       ffi::Buffer<ffi::S32> index, ffi::Buffer<ffi::S32> live,
                       ffi::ResultBuffer<ffi::F32> out) {
  const auto xd = x.dimensions();
  const auto wd = w.dimensions();
  if (xd.size() != 2 || wd.size() != 3 || xd[1] != wd[2] || index.element_count() != 1)
    return ffi::Error::InvalidArgument("row_dot_layer takes x (M, K), w (L, N, K), index ()");
  const int64_t layer = index.typed_data()[0];
  if (layer < 0 || layer >= wd[0])
    return ffi::Error::InvalidArgument("row_dot_layer: layer index out of range");
  const Elem<D>* weights = Data(w) + layer * wd[1] * wd[2];
  return Run(pool, Data(x), weights, out->typed_data(), xd[0], xd[1], wd[1], live);
}

// The packed form of an element type: float32's or bfloat16's.
template <ffi::DataType D>
using PackedForm = std::conditional_t<D == ffi::F32, packed::F32, packed::Bf16>;

// Layer `index` of packed weights (L, N / 16, K / P, 16 P) (engine.row_dot.pack; P = 1
// for float32, 2 for bfloat16) against x (M, K): out (M, N), rows from `live` on zeros
// at no cost.
template <ffi::DataType D>
ffi::Error RowDotPackedLayer(ffi::ThreadPool pool, ffi::Buffer<D> x, ffi::Buffer<D> w,
                             ffi::Buffer<ffi::S32> index, ffi::Buffer<ffi::S32> live,
                             ffi::ResultBuffer<ffi::F32> out) {
  using F = PackedForm<D>;
  const auto xd = x.dimensions();
  const auto wd = w.dimensions();
  const auto od = out->dimensions();
  if (xd.size() != 2 || wd.size() != 4 || od.size() != 2 || index.element_count() != 1 ||
      xd[1] % F::kPer != 0 || wd[2] != xd[1] / F::kPer || wd[3] != F::kPer * packed::kOutputs ||
      od[0] != xd[0] || od[1] != wd[1] * packed::kOutputs)
    return ffi::Error::InvalidArgument(
        "row_dot_packed takes x (M, K), w (L, N / 16, K / P, 16 P), index (), live (1,)");
  const int64_t layer = index.typed_data()[0];
  if (layer < 0 || layer >= wd[0])
    return ffi::Error::InvalidArgument("row_dot_packed: layer index out of range");
  const Elem<D>* weights = Data(w) + layer * wd[1] * wd[2] * wd[3];
  const Tiling<Elem<D>> vectors{packed::Range<F>, packed::kTaskVectors, wd[1]};
  return Run(pool, Data(x), weights, out->typed_data(), xd[0], xd[1], od[1], live, vectors);
}

}  // namespace

// Whether the bfloat16 kernel runs on AVX512-BF16 here (else on its slow emulation).
extern "C" int RowDotBf16Native() { return bf16::kNative ? 1 : 0; }

// A layer's binding (x, the stack, the layer index, live rows): the lane and packed forms'.
#define ROW_DOT_LAYER_BINDING(D)       \
  ffi::Ffi::Bind()                     \
      .Ctx<ffi::ThreadPool>()          \
      .Arg<ffi::Buffer<D>>()           \
      .Arg<ffi::Buffer<D>>()           \
      .Arg<ffi::Buffer<ffi::S32>>()    \
      .Arg<ffi::Buffer<ffi::S32>>()    \
      .Ret<ffi::Buffer<ffi::F32>>()

#define ROW_DOT_HANDLERS(SUFFIX, D)                                                          \
  XLA_FFI_DEFINE_HANDLER_SYMBOL(RowDot##SUFFIX, RowDot<D>,                                   \
                                ffi::Ffi::Bind()                                             \
                                    .Ctx<ffi::ThreadPool>()                                  \
                                    .Arg<ffi::Buffer<D>>()                                   \
                                    .Arg<ffi::Buffer<D>>()                                   \
                                    .Arg<ffi::Buffer<ffi::S32>>()                            \
                                    .Ret<ffi::Buffer<ffi::F32>>());                          \
  XLA_FFI_DEFINE_HANDLER_SYMBOL(RowDotLayer##SUFFIX, RowDotLayer<D>, ROW_DOT_LAYER_BINDING(D)); \
  XLA_FFI_DEFINE_HANDLER_SYMBOL(RowDotPackedLayer##SUFFIX, RowDotPackedLayer<D>,             \
                                ROW_DOT_LAYER_BINDING(D));

ROW_DOT_HANDLERS(F32, ffi::F32)
ROW_DOT_HANDLERS(Bf16, ffi::BF16)
