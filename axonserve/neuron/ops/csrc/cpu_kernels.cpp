// Fused CPU kernels for the decode hot path (built at first use by axonserve/neuron/ops/native.py).
//
// Each kernel replaces several torch ops whose per-op dispatch and extra memory passes dominate a
// small model's step: paged attention reads K/V blocks in place (no gather copy), rotary + KV-cache
// write is one pass over q/k/v, add + RMSNorm is one pass over the residual stream, SiLU-and-mul
// one pass over the MLP activations. bf16 results are rounded at the same points as the torch ops
// they replace (transformers' rounding), so greedy outputs stay equal to transformers'.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdlib>
#include <cstdint>
#include <cstring>
#include <limits>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <tuple>
#include <type_traits>
#include <vector>

#include "thread_pool.h"

#if defined(__linux__)
#include <sys/syscall.h>
#include <unistd.h>
#endif

#if defined(__AVX512F__)
#include <immintrin.h>
#define AXON_AVX512 1
#elif defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#endif
#if defined(AXON_AVX512) && defined(__AVX512BF16__) && defined(__AMX_TILE__) && defined(__AMX_BF16__) && \
    defined(__linux__)
#define AXON_AMX 1
#endif

namespace {

using bf16 = c10::BFloat16;

inline float to_f(float x) { return x; }
inline float to_f(int8_t x) { return float(x); }
// FP8 codes (`--kv-cache-dtype fp8*`, `--quantization fp8`; layers/fp8.py): the 7 magnitude bits
// shifted under a float32's exponent field give 2^(e - 127) (1 + m / 2^M) (or a denormal for e = 0),
// and one multiply by 2^(127 - bias) rebiases it: exact for every finite code, subnormals included.
// NaN codes never occur (writers clamp to the format's largest finite value first).
struct fp8e4m3 { uint8_t x; };  // torch.float8_e4m3fn: bias 7, 3 mantissa bits, max 448
struct fp8e5m2 { uint8_t x; };  // torch.float8_e5m2: bias 15, 2 mantissa bits, max 57344
inline float fp8_bits(uint8_t c, int shift, float rebias) {
  uint32_t u = (uint32_t(c & 0x80) << 24) | (uint32_t(c & 0x7F) << shift);
  float f;
  std::memcpy(&f, &u, 4);
  return f * rebias;
}
inline float to_f(fp8e4m3 x) { return fp8_bits(x.x, 20, 0x1p120f); }
inline float to_f(fp8e5m2 x) { return fp8_bits(x.x, 21, 0x1p112f); }
// a float already clamped to the format's range -> its code, rounded to nearest even as torch does
inline void to_code(float v, fp8e4m3* q) { *q = fp8e4m3{c10::Float8_e4m3fn(v).x}; }
inline void to_code(float v, fp8e5m2* q) { *q = fp8e5m2{c10::Float8_e5m2(v).x}; }
template <typename C> constexpr float fp8_max() { return std::is_same_v<C, fp8e4m3> ? 448.f : 57344.f; }
// a KV cache of codes with a float32 scale per (slot, KV head): int8 or either FP8 format
template <typename C>
constexpr bool scaled_cache_v = std::is_same_v<C, int8_t> || std::is_same_v<C, fp8e4m3> || std::is_same_v<C, fp8e5m2>;
inline float to_f(bf16 x) { uint32_t u = uint32_t(x.x) << 16; float f; std::memcpy(&f, &u, 4); return f; }

template <typename T> inline T from_f(float x);
template <> inline float from_f<float>(float x) { return x; }
template <> inline bf16 from_f<bf16>(float x) { return bf16(x); }  // round-to-nearest-even, like torch

// Round a float to T's precision and back: the rounding a torch op with a T output applies.
template <typename T> inline float rnd(float x) { return to_f(from_f<T>(x)); }

#ifdef AXON_AVX512
inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
inline __m512 load16(const bf16* p) {
  __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}
inline __m512 load16(const int8_t* p) {
  return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
}
inline __m512 fp8_load16(const uint8_t* p, int shift, float rebias) {
  const __m512i c = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  const __m512i u = _mm512_or_si512(_mm512_slli_epi32(_mm512_and_si512(c, _mm512_set1_epi32(0x80)), 24),
                                    _mm512_sllv_epi32(_mm512_and_si512(c, _mm512_set1_epi32(0x7F)), _mm512_set1_epi32(shift)));
  return _mm512_mul_ps(_mm512_castsi512_ps(u), _mm512_set1_ps(rebias));
}
inline __m512 load16(const fp8e4m3* p) { return fp8_load16(reinterpret_cast<const uint8_t*>(p), 20, 0x1p120f); }
inline __m512 load16(const fp8e5m2* p) { return fp8_load16(reinterpret_cast<const uint8_t*>(p), 21, 0x1p112f); }
inline void store16(float* p, __m512 v) { _mm512_storeu_ps(p, v); }
inline void store16(bf16* p, __m512 v) {
#if defined(__AVX512BF16__)
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), (__m256i)_mm512_cvtneps_pbh(v));
#else  // round to nearest even by integer arithmetic (finite inputs)
  __m512i u = _mm512_castps_si512(v);
  __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
  u = _mm512_add_epi32(u, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7FFF)));
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), _mm512_cvtepi32_epi16(_mm512_srli_epi32(u, 16)));
#endif
}
#include "avx512_math.h"  // exp16, reduce16x16

// rnd<T> on 16 lanes
template <typename T> inline __m512 rnd16(__m512 v);
template <> inline __m512 rnd16<float>(__m512 v) { return v; }
template <> inline __m512 rnd16<bf16>(__m512 v) {  // in register: c10's round-to-nearest-even
  __m512i u = _mm512_castps_si512(v);
  __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
  u = _mm512_add_epi32(u, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7FFF)));
  const __m512 r = _mm512_castsi512_ps(_mm512_and_si512(u, _mm512_set1_epi32(int(0xFFFF0000u))));
  // NaN stays NaN (c10's 0x7FC0), where the carry could otherwise make it inf or -0
  return _mm512_mask_blend_ps(_mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q), r,
                              _mm512_castsi512_ps(_mm512_set1_epi32(0x7FC00000)));
}
#endif

// f(std::integral_constant<int, n>{}, args...) for 1 <= n <= N: a run-time count as a constant, so a
// kernel's accumulators for n rows / heads / blocks stay in registers
template <int N, typename F, typename... A>
inline void with_count(int64_t n, F&& f, A&&... args) {
  if constexpr (N > 1)
    if (n < N) return with_count<N - 1>(n, f, args...);
  f(std::integral_constant<int, N>{}, args...);
}

// Rows per task so that a kernel call with under ~32k elements of work stays on the calling
// thread: the OpenMP team's wake-up and barrier cost more than such a call's work, and when the
// serving processes preempt one of the team's threads a tiny region stalls the whole step.
inline int64_t serial_grain(int64_t per_row, int64_t min_rows) {
  return std::max<int64_t>(min_rows, 32768 / std::max<int64_t>(per_row, 1));
}
// The same for a decode step's small row-wise ops (RMSNorm, rotary + KV write): on the kernels' pool
// a loop costs a few µs, so from ~4k elements they split; inline, 32 rows' rotary (~30 µs) outlasted
// the member's spin, which then started the attention after it late (docs/benchmarks.md#fig-small-ops-on-pool).
inline int64_t row_op_grain(int64_t per_row, int64_t min_rows) {
  if (!axpool_in_scope()) return serial_grain(per_row, min_rows);
  return std::max<int64_t>(1, 4096 / std::max<int64_t>(per_row, 1));
}

// Calls f(T{}) with T the kernel type of `t` (bfloat16 or float32): one dtype switch for every kernel.
template <typename F>
void by_dtype(at::ScalarType t, const char* name, F&& f) {
  if (t == at::kBFloat16)
    f(bf16{});
  else if (t == at::kFloat)
    f(float{});
  else
    TORCH_CHECK(false, name, ": float32 or bfloat16 only");
}

// The panel and dot-product kernels (float32 linears, block codes) are AVX2 code, built on every
// AVX2 + FMA CPU, AVX-512 ones included; AXON_AVX2 marks an AVX2 CPU without AVX-512 (the
// 8-lane attention and softmax paths).
#if defined(__AVX2__) && defined(__FMA__)
#define AXON_PANELS 1
inline float hmax8(__m256 v) {
  __m128 s = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_max_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_max_ss(s, _mm_shuffle_ps(s, s, 1)));
}
inline float hadd8(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_add_ss(s, _mm_shuffle_ps(s, s, 1)));
}
#endif

#if defined(__AVX2__) && defined(__FMA__) && !defined(AXON_AVX512)
#define AXON_AVX2 1
// exp on 8 lanes: exp16's Cephes polynomial; 2^n built in the exponent field (n clamped to the
// normal range: exp of the softmax's shifted scores is <= 1, and below 2^-126 it is 0 for us)
inline __m256 exp8(__m256 x) {
  x = _mm256_max_ps(_mm256_min_ps(x, _mm256_set1_ps(88.3762626647949f)), _mm256_set1_ps(-87.3365447505531f));
  __m256 fx = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                              _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 r = _mm256_fnmadd_ps(fx, _mm256_set1_ps(0.693359375f), x);
  r = _mm256_fnmadd_ps(fx, _mm256_set1_ps(-2.12194440e-4f), r);
  __m256 y = _mm256_set1_ps(1.9875691500E-4f);
  y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(1.3981999507E-3f));
  y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(8.3334519073E-3f));
  y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(4.1665795894E-2f));
  y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(1.6666665459E-1f));
  y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(5.0000001201E-1f));
  y = _mm256_fmadd_ps(y, _mm256_mul_ps(r, r), _mm256_add_ps(r, _mm256_set1_ps(1.0f)));
  const __m256i n = _mm256_max_epi32(_mm256_min_epi32(_mm256_cvtps_epi32(fx), _mm256_set1_epi32(127)), _mm256_set1_epi32(-126));
  return _mm256_mul_ps(y, _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(n, _mm256_set1_epi32(127)), 23)));
}
// out[i] = sum of a[i]'s 8 lanes, for 8 vectors at once (hadd tree + one cross-half add)
inline __m256 reduce8x8(const __m256* a) {
  const __m256 t0 = _mm256_hadd_ps(_mm256_hadd_ps(a[0], a[1]), _mm256_hadd_ps(a[2], a[3]));
  const __m256 t1 = _mm256_hadd_ps(_mm256_hadd_ps(a[4], a[5]), _mm256_hadd_ps(a[6], a[7]));
  return _mm256_add_ps(_mm256_permute2f128_ps(t0, t1, 0x20), _mm256_permute2f128_ps(t0, t1, 0x31));
}
#endif

// exp over n floats in place
inline void exp_inplace(float* x, int64_t n) {
  int64_t i = 0;
#ifdef AXON_AVX512
  for (; i + 16 <= n; i += 16) _mm512_storeu_ps(x + i, exp16(_mm512_loadu_ps(x + i)));
  if (i < n) {
    __mmask16 m = (__mmask16)((1u << (n - i)) - 1);
    _mm512_mask_storeu_ps(x + i, m, exp16(_mm512_maskz_loadu_ps(m, x + i)));
    i = n;
  }
#elif defined(AXON_AVX2)
  for (; i + 8 <= n; i += 8) _mm256_storeu_ps(x + i, exp8(_mm256_loadu_ps(x + i)));
#endif
  for (; i < n; ++i) x[i] = std::exp(x[i]);
}

// in place: s = softmax(s) over n scores. After a prefix already reduced to its max m0 and its sum
// l0 of exp(score - m0) (a shared prefix), s becomes these keys' share of the probabilities over
// prefix and keys together, and the factor for the prefix's unnormalized output is returned.
inline float softmax_inplace(float* s, int64_t n, float m0 = -INFINITY, float l0 = 0.f) {
  float m = m0, sum = 0.f;
  int64_t i = 0;
#ifdef AXON_AVX512
  __m512 vm = _mm512_set1_ps(m0);
  for (; i + 16 <= n; i += 16) vm = _mm512_max_ps(vm, _mm512_loadu_ps(s + i));
  m = _mm512_reduce_max_ps(vm);
#elif defined(AXON_AVX2)
  __m256 vm = _mm256_set1_ps(m0);
  for (; i + 8 <= n; i += 8) vm = _mm256_max_ps(vm, _mm256_loadu_ps(s + i));
  m = hmax8(vm);
#endif
  for (; i < n; ++i) m = std::max(m, s[i]);
  i = 0;
#ifdef AXON_AVX512
  __m512 vs = _mm512_setzero_ps();
  const __m512 mm = _mm512_set1_ps(m);
  for (; i + 16 <= n; i += 16) {
    __m512 e = exp16(_mm512_sub_ps(_mm512_loadu_ps(s + i), mm));
    _mm512_storeu_ps(s + i, e);
    vs = _mm512_add_ps(vs, e);
  }
  sum = _mm512_reduce_add_ps(vs);
#elif defined(AXON_AVX2)
  __m256 vs = _mm256_setzero_ps();
  const __m256 mm = _mm256_set1_ps(m);
  for (; i + 8 <= n; i += 8) {
    __m256 e = exp8(_mm256_sub_ps(_mm256_loadu_ps(s + i), mm));
    _mm256_storeu_ps(s + i, e);
    vs = _mm256_add_ps(vs, e);
  }
  sum = hadd8(vs);
#endif
  for (; i < n; ++i) { s[i] = std::exp(s[i] - m); sum += s[i]; }
  const float w = l0 > 0.f ? std::exp(m0 - m) : 0.f, inv = 1.f / (sum + l0 * w);  // (no prefix: 1 / sum)
  i = 0;
#ifdef AXON_AVX512
  for (; i + 16 <= n; i += 16) _mm512_storeu_ps(s + i, _mm512_mul_ps(_mm512_loadu_ps(s + i), _mm512_set1_ps(inv)));
#elif defined(AXON_AVX2)
  for (; i + 8 <= n; i += 8) _mm256_storeu_ps(s + i, _mm256_mul_ps(_mm256_loadu_ps(s + i), _mm256_set1_ps(inv)));
#endif
  for (; i < n; ++i) s[i] *= inv;
  return w * inv;
}

// ------------------------------------------------------------------ paged attention
// Row r of q attends to the first kv_len[r] positions of sequence seq[r]'s blocks, then to the
// positions in extra[r] (optional [R, E], -1 padded: a draft tree's ancestors); with a sliding
// window W > 0 only to the last W of those kv_len positions (the row's query sits at kv_len - 1:
// keys > query - W, ops/window.py), so the blocks before them are never read. Work item =
// (row, kv head): the `group` query heads sharing that KV head read each key once. Scores are
// exact softmax (max, exp, sum) over the row's keys; accumulation in float32.
struct AttnArgs {
  int64_t R, Hq, D, bs, Hkv, G, q_rs, q_hs, o_rs, o_hs, W;
  const int64_t *bt, *seq, *kvl;
  float scale;
  const float *ks = nullptr, *vs = nullptr;  // int8 caches: scale per (slot, KV head)
  const int64_t* extra = nullptr;  // [R, E] key positions past kv_len (-1: none)
  int64_t E = 0;
  int64_t win = 0;  // sliding window (0: none)
  // shared prefixes (amx_prefix_head): keys each row's prefix took (0: none), and the prefix's
  // state per (row, query head): [R, Hq, D + 2] float32 (unnormalized output, max in base-2 units, sum)
  const int64_t* pre_len = nullptr;
  const float* pre = nullptr;
};

// element offset of each key row (same for K and V): walks the block table without a division per key
// (and of the row's extra positions after them); returns the number of keys. WIN: a sliding window
// (a.win > 0), a separate instantiation so the full-attention code is the one it always was.
template <bool WIN>
inline int64_t key_offsets(const AttnArgs& a, int64_t r, int64_t h, std::vector<int64_t>& off) {
  const int64_t L = a.kvl[r];  // the first key: the window's, or after the row's shared prefix (whole blocks)
  const int64_t lo = WIN ? (L > a.win ? L - a.win : 0) : a.pre_len ? a.pre_len[r] : 0;
  const int64_t* table = a.bt + a.seq[r] * a.W;
  off.resize(L - lo + a.E);
  for (int64_t t0 = lo - lo % a.bs, b = lo / a.bs; t0 < L; t0 += a.bs, ++b) {  // (blocks before lo: untouched)
    const int64_t base = (table[b] * a.bs * a.Hkv + h) * a.D, n = std::min(a.bs, L - t0);
    for (int64_t i = WIN && t0 < lo ? lo - t0 : 0; i < n; ++i) off[t0 + i - lo] = base + i * a.Hkv * a.D;
  }
  int64_t n = L - lo;
  for (int64_t e = 0; e < a.E; ++e) {
    const int64_t p = a.extra[r * a.E + e];
    if (p >= 0) off[n++] = ((table[p / a.bs] * a.bs + p % a.bs) * a.Hkv + h) * a.D;
  }
  off.resize(n);
  return n;
}

// Requests the rows off[t0 .. t1) of a cache (each `lines` cache lines) into L1 (T0) or L2 (T1).
// As asm: GCC 12 can vectorize a loop of _mm_prefetch over gathered offsets, dropping the prefetches.
template <int HINT, typename C>
inline void prefetch_rows(const C* base, const int64_t* off, int64_t t0, int64_t t1, int64_t lines) {
  for (int64_t i = t0; i < t1; ++i)
    for (int64_t c = 0; c < lines; ++c) {
      const char* p = reinterpret_cast<const char*>(base + off[i]) + 64 * c;
      if constexpr (HINT == _MM_HINT_T1) asm volatile("prefetcht1 %0" : : "m"(*p));
      else asm volatile("prefetcht0 %0" : : "m"(*p));
    }
}

#if defined(AXON_AVX512) && defined(__AVX512BF16__)
// Scores of nk <= 16 keys (bf16 rows at kc + off[i]) against one bf16 query of 32 * NP dims on the
// dot product: each lane adds its dim pairs' exact products in float32 (vdpbf16ps), the scale after.
template <int NP>
inline void dot_scores(const bf16* q, const bf16* kc, const int64_t* off, int64_t nk, float scale, float* out) {
  __m512bh qv[NP];
  for (int c = 0; c < NP; ++c) qv[c] = (__m512bh)_mm512_loadu_si512(q + 32 * c);
  auto dot = [&](int64_t i) {
    const bf16* k = kc + off[i];
    __m512 acc = _mm512_dpbf16_ps(_mm512_setzero_ps(), qv[0], (__m512bh)_mm512_loadu_si512(k));
    for (int c = 1; c < NP; ++c) acc = _mm512_dpbf16_ps(acc, qv[c], (__m512bh)_mm512_loadu_si512(k + 32 * c));
    return acc;
  };
  if (nk == 16) {  // then one transposed reduction
    __m512 acc[16];
    for (int i = 0; i < 16; ++i) acc[i] = dot(i);
    _mm512_storeu_ps(out, _mm512_mul_ps(reduce16x16(acc), _mm512_set1_ps(scale)));
  } else {
    for (int64_t i = 0; i < nk; ++i) out[i] = _mm512_reduce_add_ps(dot(i)) * scale;
  }
}
#endif

// head_dim = 16 * ND with AVX-512. The G query heads of the KV head share each key/value load: a
// block of 16 keys is scored against every query head, on the dot product where queries and keys
// are bf16 (dot_scores: ~0.87x the kernel's time at 32-128 rows from DRAM on the Zen 4,
// docs/benchmarks.md#fig-decode-attention-dot), else widened to float32 once (in L1); each value
// row is widened once and accumulated into up to GC heads' outputs in registers (bf16 widening
// otherwise costs as much as the FMAs, G times over).
// `off`: the item's key offsets (key_offsets); `next`: the next item's on this thread, or null.
template <typename T, typename C, int ND>
void attend_item_vec(const AttnArgs& a, const T* qp, T* op, const C* kc, const C* vc, int64_t r, int64_t h,
                     std::vector<float>& scores, const std::vector<int64_t>& off, const std::vector<int64_t>* next) {
#ifdef AXON_AVX512
  constexpr int D = 16 * ND, GC = ND >= 16 ? 1 : 16 / ND;  // GC * ND accumulators <= 16 registers
  constexpr bool Q8 = scaled_cache_v<C>;  // int8 / fp8 cache: a float32 scale per (slot, head)
  const int64_t G = a.G, L = int64_t(off.size());
  scores.resize(G * L + G * D + (Q8 ? 2 * L : 0));
  float* qs = scores.data() + G * L;  // the G query rows, scaled, as float32
  float* ksc = qs + G * D;  // Q8: the keys' and values' scales, in key order
  float* vsc = ksc + L;
  if constexpr (Q8)
    for (int64_t t = 0; t < L; ++t) { ksc[t] = a.ks[off[t] / D]; vsc[t] = a.vs[off[t] / D]; }
#ifdef __AVX512BF16__
  constexpr bool DP = std::is_same_v<T, bf16> && std::is_same_v<C, bf16>;  // scores on dot_scores
#else
  constexpr bool DP = false;
#endif
  if constexpr (!DP)
    for (int64_t g = 0; g < G; ++g) {
      const T* qg = qp + r * a.q_rs + (h * G + g) * a.q_hs;
      for (int c = 0; c < ND; ++c)
        _mm512_storeu_ps(qs + g * D + 16 * c, _mm512_mul_ps(load16(qg + 16 * c), _mm512_set1_ps(a.scale)));
    }
  alignas(64) float kb[DP ? 16 : 16 * D];
  // the keys sit in blocks scattered over the cache, a row of one head every Hkv * D elements: too
  // short a run for the hardware prefetcher, so each block's successor keys and this block's values
  // are requested while its scores are computed (cache-cold, 32 rows x 100 keys: ~300 -> ~190 us)
  constexpr int64_t ROW_LINES = (D * sizeof(C) + 63) / 64;
  prefetch_rows<_MM_HINT_T0>(kc, off.data(), 0, std::min<int64_t>(32, L), ROW_LINES);
  for (int64_t t = 0; t < L; t += 16) {
    const int64_t nk = std::min<int64_t>(16, L - t);
    prefetch_rows<_MM_HINT_T0>(kc, off.data(), t + 32, std::min<int64_t>(t + 48, L), ROW_LINES);
    prefetch_rows<_MM_HINT_T0>(vc, off.data(), t, t + nk, ROW_LINES);
#ifdef __AVX512BF16__
    if constexpr (DP) {
      for (int64_t g = 0; g < G; ++g)
        dot_scores<ND / 2>(qp + r * a.q_rs + (h * G + g) * a.q_hs, kc, off.data() + t, nk, a.scale, scores.data() + g * L + t);
      continue;
    }
#endif
    for (int64_t i = 0; i < nk; ++i)
      for (int c = 0; c < ND; ++c) _mm512_store_ps(kb + i * D + 16 * c, load16(kc + off[t + i] + 16 * c));
    for (int64_t g = 0; g < G; ++g) {
      __m512 q[ND];
      for (int c = 0; c < ND; ++c) q[c] = _mm512_loadu_ps(qs + g * D + 16 * c);
      float* sg = scores.data() + g * L;
      if (nk == 16) {  // products per key, then one transposed reduction
        __m512 acc[16];
        for (int i = 0; i < 16; ++i) {
          acc[i] = _mm512_mul_ps(q[0], _mm512_load_ps(kb + i * D));
          for (int c = 1; c < ND; ++c) acc[i] = _mm512_fmadd_ps(q[c], _mm512_load_ps(kb + i * D + 16 * c), acc[i]);
        }
        const __m512 dots = reduce16x16(acc);
        _mm512_storeu_ps(sg + t, Q8 ? _mm512_mul_ps(dots, _mm512_loadu_ps(ksc + t)) : dots);
      } else {
        for (int64_t i = 0; i < nk; ++i) {
          __m512 acc = _mm512_mul_ps(q[0], _mm512_load_ps(kb + i * D));
          for (int c = 1; c < ND; ++c) acc = _mm512_fmadd_ps(q[c], _mm512_load_ps(kb + i * D + 16 * c), acc);
          sg[t + i] = _mm512_reduce_add_ps(acc) * (Q8 ? ksc[t + i] : 1.0f);
        }
      }
    }
  }
  // after a shared prefix (amx_prefix_head): its state per query head, merged into this softmax
  const float* pre = a.pre_len && a.pre_len[r] ? a.pre + (r * a.Hq + h * G) * (D + 2) : nullptr;
  float keep[16];  // the prefix output's factor per query head (G <= 16 where prefixes are shared)
  for (int64_t g = 0; g < G; ++g) {
    if (pre) keep[g] = softmax_inplace(scores.data() + g * L, L, pre[g * (D + 2) + D] * 0.69314718055994531f, pre[g * (D + 2) + D + 1]);
    else softmax_inplace(scores.data() + g * L, L);
  }
  if constexpr (Q8)  // each value's scale goes into its probability
    for (int64_t g = 0; g < G; ++g)
      for (int64_t t = 0; t < L; ++t) scores[g * L + t] *= vsc[t];
  // GN (<= GC) query heads' outputs at a time, in registers (GN a constant: with a run-time count
  // GCC kept them in memory, a store per FMA)
  auto values = [&](auto gn, int64_t g0) {
    constexpr int GN = decltype(gn)::value;
    __m512 acc[GN][ND];
    for (int gi = 0; gi < GN; ++gi)
      for (int c = 0; c < ND; ++c)
        acc[gi][c] = pre ? _mm512_mul_ps(_mm512_loadu_ps(pre + (g0 + gi) * (D + 2) + 16 * c), _mm512_set1_ps(keep[g0 + gi]))
                         : _mm512_setzero_ps();
    const float* s0 = scores.data() + g0 * L;
    auto step = [&](int64_t t) {
      __m512 v[ND];
      const C* vp = vc + off[t];
      for (int c = 0; c < ND; ++c) v[c] = load16(vp + 16 * c);
      for (int gi = 0; gi < GN; ++gi) {
        const __m512 p = _mm512_set1_ps(s0[gi * L + t]);
        for (int c = 0; c < ND; ++c) acc[gi][c] = _mm512_fmadd_ps(p, v[c], acc[gi][c]);
      }
    };
    // The first values pass also requests the next item's keys and values into L2, a row a key: the
    // scores pass above keeps the memory busy with its own rows, this one otherwise leaves it idle
    // (one core's reads and this kernel's arithmetic about equal at 64-128 decode rows; 128 x 161
    // keys from DRAM: ~0.92x the time; docs/benchmarks.md#fig-decode-attention-bound).
    const int64_t nn = g0 == 0 && next ? int64_t(next->size()) : 0;
    if (nn > L) prefetch_rows<_MM_HINT_T1>(kc, next->data(), L, nn, ROW_LINES);  // (its keys past ours)
    if (nn > L) prefetch_rows<_MM_HINT_T1>(vc, next->data(), L, nn, ROW_LINES);
    int64_t t = 0;
    for (; t < std::min(L, nn); ++t) {
      prefetch_rows<_MM_HINT_T1>(kc, next->data(), t, t + 1, ROW_LINES);
      prefetch_rows<_MM_HINT_T1>(vc, next->data(), t, t + 1, ROW_LINES);
      step(t);
    }
    for (; t < L; ++t) step(t);
    for (int gi = 0; gi < GN; ++gi) {
      T* o = op + r * a.o_rs + (h * G + g0 + gi) * a.o_hs;
      for (int c = 0; c < ND; ++c) store16(o + 16 * c, acc[gi][c]);
    }
  };
  for (int64_t g0 = 0; g0 < G; g0 += GC) with_count<GC>(std::min<int64_t>(GC, G - g0), values, g0);
#endif
}

// head_dim = 8 * ND with AVX2 (no AVX-512): attend_item_vec's plan at 8 lanes. Keys and values
// of 8 positions are widened to float32 into L1 once and shared by the G query heads; scores of
// 8 keys come out of one transposed reduction; the output is accumulated 8 chunks (64 dims) at a
// time in registers. Same math as the scalar path, in a different summation order.
template <typename T, typename C, int ND>
void attend_item_avx2(const AttnArgs& a, const T* qp, T* op, const C* kc, const C* vc, int64_t r, int64_t h,
                      std::vector<float>& scores, const std::vector<int64_t>& off, const std::vector<int64_t>*) {
#ifdef AXON_AVX2
  constexpr int D = 8 * ND;
  constexpr bool Q8 = scaled_cache_v<C>;
  const int64_t G = a.G, L = int64_t(off.size());
  scores.resize(G * L + G * D + (Q8 ? 2 * L : 0));
  float* qs = scores.data() + G * L;  // the G query rows, scaled, as float32
  float* ksc = qs + G * D;
  float* vsc = ksc + L;
  if constexpr (Q8)
    for (int64_t t = 0; t < L; ++t) { ksc[t] = a.ks[off[t] / D]; vsc[t] = a.vs[off[t] / D]; }
  for (int64_t g = 0; g < G; ++g) {
    const T* qg = qp + r * a.q_rs + (h * G + g) * a.q_hs;
    for (int j = 0; j < D; ++j) qs[g * D + j] = to_f(qg[j]) * a.scale;
  }
  alignas(32) float kb[8 * D];
  constexpr int64_t LINE = 64 / sizeof(C), ROW_LINES = (D + LINE - 1) / LINE;
  auto prefetch_rows = [&](const C* base, int64_t t0, int64_t t1) {
    for (int64_t i = t0; i < t1; ++i)
      for (int64_t c = 0; c < ROW_LINES; ++c) _mm_prefetch(reinterpret_cast<const char*>(base + off[i] + c * LINE), _MM_HINT_T0);
  };
  prefetch_rows(kc, 0, std::min<int64_t>(16, L));
  for (int64_t t = 0; t < L; t += 8) {
    const int64_t nk = std::min<int64_t>(8, L - t);
    prefetch_rows(kc, t + 16, std::min<int64_t>(t + 24, L));
    for (int64_t i = 0; i < 8; ++i) {  // (rows past nk: zeros, their scores are not kept)
      if (i < nk) {
        const C* kp = kc + off[t + i];
        for (int j = 0; j < D; ++j) kb[i * D + j] = to_f(kp[j]);
      } else {
        std::memset(kb + i * D, 0, sizeof(float) * D);
      }
    }
    for (int64_t g = 0; g < G; ++g) {
      const float* qg = qs + g * D;
      __m256 acc[8];
      for (int i = 0; i < 8; ++i) {
        acc[i] = _mm256_mul_ps(_mm256_loadu_ps(qg), _mm256_load_ps(kb + i * D));
        for (int c = 1; c < ND; ++c) acc[i] = _mm256_fmadd_ps(_mm256_loadu_ps(qg + 8 * c), _mm256_load_ps(kb + i * D + 8 * c), acc[i]);
      }
      float* sg = scores.data() + g * L + t;
      const __m256 dv = reduce8x8(acc);
      if (nk == 8) {  // (a vector store: GCC made the 8-float copy a `rep movs`, ~10% of the kernel)
        _mm256_storeu_ps(sg, Q8 ? _mm256_mul_ps(dv, _mm256_loadu_ps(ksc + t)) : dv);
      } else {
        alignas(32) float dots[8];
        _mm256_store_ps(dots, dv);
        for (int64_t i = 0; i < nk; ++i) sg[i] = Q8 ? dots[i] * ksc[t + i] : dots[i];
      }
    }
  }
  for (int64_t g = 0; g < G; ++g) softmax_inplace(scores.data() + g * L, L);
  if constexpr (Q8)  // each value's scale goes into its probability
    for (int64_t g = 0; g < G; ++g)
      for (int64_t t = 0; t < L; ++t) scores[g * L + t] *= vsc[t];
  // Weighted sum of the values: up to 3 query heads x 4 output chunks (32 dims) in 12 registers
  // per pass, so each value row is loaded (and widened) once for 3 heads. Keys in order: the same
  // sums as one head at a time.
  constexpr int CT = ND < 4 ? ND : 4;
  auto value_pass = [&](auto gc, int64_t g0) {
    constexpr int GC = decltype(gc)::value;
    for (int c0 = 0; c0 < ND; c0 += CT) {
      __m256 acc[GC * CT];
      for (int i = 0; i < GC * CT; ++i) acc[i] = _mm256_setzero_ps();
      for (int64_t t = 0; t < L; ++t) {
        const C* vp = vc + off[t] + 8 * c0;
        __m256 p[GC];
        for (int g = 0; g < GC; ++g) p[g] = _mm256_set1_ps(scores[(g0 + g) * L + t]);
        for (int c = 0; c < CT; ++c) {
          __m256 v;
          if constexpr (std::is_same_v<C, float>) {
            v = _mm256_loadu_ps(vp + 8 * c);
          } else {
            alignas(32) float vb[8];
            for (int j = 0; j < 8; ++j) vb[j] = to_f(vp[8 * c + j]);
            v = _mm256_load_ps(vb);
          }
          for (int g = 0; g < GC; ++g) acc[g * CT + c] = _mm256_fmadd_ps(p[g], v, acc[g * CT + c]);
        }
      }
      for (int g = 0; g < GC; ++g) {
        T* o = op + r * a.o_rs + (h * G + g0 + g) * a.o_hs + 8 * c0;
        alignas(32) float res[8 * CT];
        for (int c = 0; c < CT; ++c) _mm256_store_ps(res + 8 * c, acc[g * CT + c]);
        for (int j = 0; j < 8 * CT; ++j) o[j] = from_f<T>(res[j]);
      }
    }
  };
  for (int64_t g0 = 0; g0 < G; g0 += 3) with_count<3>(std::min<int64_t>(3, G - g0), value_pass, g0);
#endif
}

template <typename T, typename C>
void attend_item_scalar(const AttnArgs& a, const T* qp, T* op, const C* kc, const C* vc, int64_t r, int64_t h,
                        std::vector<float>& scores, const std::vector<int64_t>& off, const std::vector<int64_t>*) {
  constexpr bool Q8 = scaled_cache_v<C>;
  const int64_t G = a.G, L = int64_t(off.size()), D = a.D;
  scores.resize(G * L);
  std::vector<float> acc(D);
  for (int64_t g = 0; g < G; ++g) {
    const T* qg = qp + r * a.q_rs + (h * G + g) * a.q_hs;
    float* sg = scores.data() + g * L;
    for (int64_t t = 0; t < L; ++t) {
      const C* kp = kc + off[t];
      float s = 0.f;
      for (int64_t j = 0; j < D; ++j) s += to_f(qg[j]) * a.scale * to_f(kp[j]);
      sg[t] = Q8 ? s * a.ks[off[t] / D] : s;
    }
    float m = -INFINITY, sum = 0.f;
    for (int64_t t = 0; t < L; ++t) m = std::max(m, sg[t]);
    for (int64_t t = 0; t < L; ++t) { sg[t] = std::exp(sg[t] - m); sum += sg[t]; }
    std::fill(acc.begin(), acc.end(), 0.f);
    for (int64_t t = 0; t < L; ++t) {
      const C* vp = vc + off[t];
      const float p = Q8 ? sg[t] * a.vs[off[t] / D] : sg[t];
      for (int64_t j = 0; j < D; ++j) acc[j] += p * to_f(vp[j]);
    }
    T* o = op + r * a.o_rs + (h * G + g) * a.o_hs;
    for (int64_t j = 0; j < D; ++j) o[j] = from_f<T>(acc[j] / sum);
  }
}

#if defined(AXON_AVX512) && defined(__AVX512BF16__)
constexpr int64_t AMX_ATTN_MIN_RUN = 16;  // chunks shorter than this stay on the per-row kernel
template <int ND32, bool TILES>
std::vector<int64_t> amx_attend_runs(const AttnArgs& a, const bf16* qp, bf16* op, const bf16* kc, const bf16* vc);
bool chunk_tiles();
#endif
#ifdef AXON_AMX
bool amx_permitted();
struct PrefixGroup {
  std::vector<int64_t> rows;  // rows whose sequences' tables agree on the first P keys' blocks
  int64_t P;
};
std::vector<PrefixGroup> shared_prefix_groups(const AttnArgs& a, const std::vector<int64_t>& rows);
void amx_prefix_head(const AttnArgs& a, const bf16* qp, const bf16* kc, const bf16* vc, const PrefixGroup& gr,
                     int64_t h, float* state);
void load_attention_tiles();
#endif

// Attention work (keys x query heads a KV head x head_dim) under which a call stays on the calling
// thread: an OpenMP team's wake-up costs more. On the kernels' pool (the decoder stack's small
// steps) a loop costs a few µs and the bar is lower: there an inline attention longer than the
// members' spin (20 µs: one row of SmolLM2 at ~130 keys) let the member fall asleep and start the
// next linear (o_proj) late; on the pool a 1-row decode step took 0.93x the time, beside a busy
// process the same (docs/benchmarks.md#fig-attention-on-pool).
constexpr int64_t ATTN_INLINE_WORK = 8 * 32768, ATTN_INLINE_WORK_POOL = 32768;

// run(begin, end) over the items 0 .. n - 1 (n = cum.size() - 1), split between the pool's threads
// so that each gets a contiguous run holding an equal share of the cost cum[n] (cum: running sums
// of the items' costs), four parts a thread, claimed as threads come free (thread_pool.h). `small`
// (or one thread, or already inside a parallel region): all on this thread.
template <typename Run>
void run_by_cost(const std::vector<int64_t>& cum, bool small, Run&& run) {
  const int64_t n = int64_t(cum.size()) - 1, threads = std::min<int64_t>(at::get_num_threads(), n);
  if (small || threads <= 1 || at::in_parallel_region()) {
    run(0, n);
    return;
  }
  const int64_t parts = std::min<int64_t>(4 * threads, n);
  pool_for(0, parts, 1, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) {
      auto first_at = [&](int64_t share) {
        return std::lower_bound(cum.begin(), cum.end(), cum[n] * share / parts) - cum.begin();
      };
      run(first_at(t), t + 1 == parts ? n : first_at(t + 1));
    }
  });
}

#ifdef AXON_AMX
// paged_attention_impl with shared prefixes (`groups`): one unit of work per (group, KV head) runs
// the group's prefix on tiles, then each of its rows' own keys on the per-row kernel (in that
// thread, so no barrier between them), and one per other (row, KV head); `rows`: the rows to take.
template <typename T, typename C, typename ItemFn>
void attend_with_prefixes(AttnArgs a, const T* qp, T* op, const C* kc, const C* vc, const std::vector<int64_t>& rows,
                          const std::vector<PrefixGroup>& groups, ItemFn item_fn) {
  std::vector<int64_t> pre_len(a.R, 0);
  std::vector<float> state(a.R * a.Hq * (a.D + 2));
  for (const PrefixGroup& g : groups)
    for (int64_t r : g.rows) pre_len[r] = g.P;
  a.pre_len = pre_len.data();
  a.pre = state.data();
  std::vector<std::pair<int64_t, int64_t>> units;  // (group, head), or (-1 - row, head)
  std::vector<int64_t> cum{0};  // split by keys (a prefix's counted at a quarter: its keys are read once)
  for (int64_t g = 0; g < int64_t(groups.size()); ++g) {
    int64_t own = 0;
    for (int64_t r : groups[g].rows) own += a.kvl[r] - groups[g].P + 1;
    for (int64_t h = 0; h < a.Hkv; ++h) {
      units.push_back({g, h});
      cum.push_back(cum.back() + groups[g].P / 4 + own);
    }
  }
  for (int64_t r : rows)
    if (!pre_len[r])
      for (int64_t h = 0; h < a.Hkv; ++h) {
        units.push_back({-1 - r, h});
        cum.push_back(cum.back() + a.kvl[r] + 1);
      }
  const int64_t n = units.size();
  auto run = [&](int64_t begin, int64_t end) {
    std::vector<float> scores;
    std::vector<int64_t> off, next;
    bool tiles = false;
    for (int64_t u = begin; u < end; ++u) {
      const auto [x, h] = units[u];
      if (x < 0) {
        key_offsets<false>(a, -1 - x, h, off);
        item_fn(a, qp, op, kc, vc, -1 - x, h, scores, off, nullptr);
        continue;
      }
      if (!tiles) load_attention_tiles();
      tiles = true;
      amx_prefix_head(a, qp, kc, vc, groups[x], h, state.data());  // (instantiated for bf16 only)
      const std::vector<int64_t>& gr = groups[x].rows;
      key_offsets<false>(a, gr[0], h, next);
      for (size_t k = 0; k < gr.size(); ++k) {  // (each requests the next row's keys, as run() does)
        std::swap(off, next);
        if (k + 1 < gr.size()) key_offsets<false>(a, gr[k + 1], h, next);
        item_fn(a, qp, op, kc, vc, gr[k], h, scores, off, k + 1 < gr.size() ? &next : nullptr);
      }
    }
    if (tiles) _tile_release();
  };
  run_by_cost(cum, false, run);
}
#endif

template <typename T, typename C>
void paged_attention_impl(at::Tensor& out, const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                          const at::Tensor& block_table, const at::Tensor& row_seq, const at::Tensor& row_kv_len,
                          double scale, const float* ks, const float* vs, const c10::optional<at::Tensor>& extra,
                          int64_t window) {
  AttnArgs a{q.size(0), q.size(1), q.size(2), k_cache.size(1), k_cache.size(2), q.size(1) / k_cache.size(2),
             q.stride(0), q.stride(1), out.stride(0), out.stride(1), block_table.size(1),
             block_table.data_ptr<int64_t>(), row_seq.data_ptr<int64_t>(), row_kv_len.data_ptr<int64_t>(),
             static_cast<float>(scale), ks, vs};
  if (extra.has_value() && extra->defined() && extra->numel()) {
    a.extra = extra->data_ptr<int64_t>();
    a.E = extra->size(1);
  }
  a.win = window;
  const T* qp = q.data_ptr<T>();
  T* op = out.data_ptr<T>();
  const C* kc = static_cast<const C*>(k_cache.data_ptr());
  const C* vc = static_cast<const C*>(v_cache.data_ptr());
  const bool win = a.win > 0;
  auto item_fn = &attend_item_scalar<T, C>;  // (a window is in the key offsets the caller passes)
#ifdef AXON_AVX512
  if (a.D == 64) item_fn = &attend_item_vec<T, C, 4>;
  else if (a.D == 128) item_fn = &attend_item_vec<T, C, 8>;
  else if (a.D == 32) item_fn = &attend_item_vec<T, C, 2>;
  else if (a.D == 256) item_fn = &attend_item_vec<T, C, 16>;
#elif defined(AXON_AVX2)
  if (a.D == 64) item_fn = &attend_item_avx2<T, C, 8>;
  else if (a.D == 128) item_fn = &attend_item_avx2<T, C, 16>;
  else if (a.D == 32) item_fn = &attend_item_avx2<T, C, 4>;
  else if (a.D == 256) item_fn = &attend_item_avx2<T, C, 32>;
#endif
  // prefill chunks of bf16 models: flash attention on AMX tiles or the dot product (amx_attention.h);
  // the rows left come here
  std::optional<std::vector<int64_t>> rest;  // (unset: every row)
#if defined(AXON_AVX512) && defined(__AVX512BF16__)
  if constexpr (std::is_same_v<T, bf16> && std::is_same_v<C, bf16>)
    if (!win && (a.D == 64 || a.D == 32) && a.R >= AMX_ATTN_MIN_RUN) {
      if (chunk_tiles()) rest = a.D == 64 ? amx_attend_runs<2, true>(a, qp, op, kc, vc) : amx_attend_runs<1, true>(a, qp, op, kc, vc);
      else rest = a.D == 64 ? amx_attend_runs<2, false>(a, qp, op, kc, vc) : amx_attend_runs<1, false>(a, qp, op, kc, vc);
    }
#endif
  const int64_t nrows = rest ? int64_t(rest->size()) : a.R;
  auto row_of = [&](int64_t i) { return rest ? (*rest)[i] : i; };
  const int64_t n = nrows * a.Hkv;
#ifdef AXON_AMX
  // rows sharing a prefix's blocks: the prefix on AMX tiles once for all of them (amx_attention.h),
  // their own keys after it on the per-row kernel
  if constexpr (std::is_same_v<T, bf16> && std::is_same_v<C, bf16>)
    if (!win && a.E == 0 && nrows > 1 && a.G <= 16 && (a.D == 64 || a.D == 32) && amx_permitted()) {
      std::vector<int64_t> rows(nrows);
      for (int64_t i = 0; i < nrows; ++i) rows[i] = row_of(i);
      const std::vector<PrefixGroup> groups = shared_prefix_groups(a, rows);
      if (!groups.empty()) {
        attend_with_prefixes(a, qp, op, kc, vc, rows, groups, item_fn);
        return;
      }
    }
#endif
  auto offsets = [&](int64_t item, std::vector<int64_t>& off) {
    if (win) key_offsets<true>(a, row_of(item / a.Hkv), item % a.Hkv, off);
    else key_offsets<false>(a, row_of(item / a.Hkv), item % a.Hkv, off);
  };
  auto run = [&](int64_t begin, int64_t end) {
    std::vector<float> scores;
    std::vector<int64_t> off, next;  // this item's key offsets and the next one's (it prefetches them)
    if (begin < end) offsets(begin, next);
    for (int64_t item = begin; item < end; ++item) {
      std::swap(off, next);
      if (item + 1 < end) offsets(item + 1, next);
      item_fn(a, qp, op, kc, vc, row_of(item / a.Hkv), item % a.Hkv, scores, off, item + 1 < end ? &next : nullptr);
    }
  };
  if (n == 0) return;
  // Each thread takes a contiguous run of items holding an equal share of the keys (+1 per item
  // for its fixed cost): the rows' contexts differ, and a split by item count leaves one thread
  // streaming while the other waits at the barrier. A small call stays here (ATTN_INLINE_WORK).
  std::vector<int64_t> cum(n + 1, 0);
  for (int64_t i = 0; i < n; ++i) {
    const int64_t kv = a.kvl[row_of(i / a.Hkv)];
    cum[i + 1] = cum[i] + (a.win > 0 ? std::min(kv, a.win) : kv) + 1;
  }
  run_by_cost(cum, cum[n] * a.G * a.D < (axpool_in_scope() ? ATTN_INLINE_WORK_POOL : ATTN_INLINE_WORK), run);
}

// An int8 or FP8 KV cache (`--kv-cache-dtype int8|fp8*`) holds each (slot, KV head) row as 8-bit
// codes times a float32 scale, k_scale / v_scale [blocks, block_size, Hkv]: half the bytes of bf16.
bool scaled_cache(at::ScalarType t) { return t == at::kChar || t == at::kFloat8_e4m3fn || t == at::kFloat8_e5m2; }

// Calls f(C{}) with C the code type of a scaled cache.
template <typename F>
void by_cache_codes(at::ScalarType t, F&& f) {
  if (t == at::kChar) f(int8_t{});
  else if (t == at::kFloat8_e4m3fn) f(fp8e4m3{});
  else f(fp8e5m2{});
}

void check_cache_scales(const at::Tensor& cache, const c10::optional<at::Tensor>& scale) {
  if (!scaled_cache(cache.scalar_type())) {
    TORCH_CHECK(!scale.has_value() || !scale->defined(), "scales are for an int8 / fp8 cache");
    return;
  }
  TORCH_CHECK(scale.has_value() && scale->defined() && scale->scalar_type() == at::kFloat && scale->is_contiguous() &&
              scale->numel() * cache.size(3) == cache.numel(), "an int8 / fp8 cache needs its float32 [blocks, block, Hkv] scales");
}

void paged_attention(at::Tensor out, at::Tensor q, at::Tensor k_cache, at::Tensor v_cache, at::Tensor block_table,
                     at::Tensor row_seq, at::Tensor row_kv_len, double scale, c10::optional<at::Tensor> k_scale,
                     c10::optional<at::Tensor> v_scale, c10::optional<at::Tensor> row_extra, int64_t window) {
  TORCH_CHECK(window >= 0, "window: 0 (none) or a positive sliding window");
  TORCH_CHECK(q.dim() == 3 && q.stride(2) == 1 && out.stride(2) == 1, "q/out: [rows, heads, head_dim], last dim dense");
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous() && block_table.is_contiguous(), "contiguous caches");
  TORCH_CHECK(out.scalar_type() == q.scalar_type() && k_cache.scalar_type() == v_cache.scalar_type(), "one dtype");
  TORCH_CHECK(k_cache.scalar_type() == q.scalar_type() || scaled_cache(k_cache.scalar_type()), "cache: q's dtype, int8 or fp8");
  check_cache_scales(k_cache, k_scale);
  check_cache_scales(v_cache, v_scale);
  if (row_extra.has_value() && row_extra->defined())
    TORCH_CHECK(row_extra->dim() == 2 && row_extra->size(0) == q.size(0) && row_extra->is_contiguous() &&
                row_extra->scalar_type() == at::kLong, "row_extra: contiguous int64 [rows, E]");
  const bool q8 = scaled_cache(k_cache.scalar_type());
  const float* ks = q8 ? k_scale->data_ptr<float>() : nullptr;
  const float* vs = q8 ? v_scale->data_ptr<float>() : nullptr;
  by_dtype(q.scalar_type(), "paged_attention", [&](auto tag) {
    using T = decltype(tag);
    if (!q8) {
      paged_attention_impl<T, T>(out, q, k_cache, v_cache, block_table, row_seq, row_kv_len, scale, ks, vs, row_extra,
                                 window);
      return;
    }
    by_cache_codes(k_cache.scalar_type(), [&](auto code) {
      paged_attention_impl<T, decltype(code)>(out, q, k_cache, v_cache, block_table, row_seq, row_kv_len, scale, ks, vs,
                                              row_extra, window);
    });
  });
}

// ------------------------------------------------------------------ rotary + KV-cache write
// One (slot, KV head) row into an int8 cache: codes round(x / s) with s = max|x| / 127 (at least
// 1e-30), exactly as attention.py's quantize_kv computes them.
template <typename T>
inline void quantize_row(const T* x, int64_t D, int8_t* q, float* scale) {
#ifdef AXON_AVX512
  if (D % 16 == 0 && D <= 256) {  // the same arithmetic on 16 lanes (IEEE division, round to nearest even)
    __m512 v[16], m = _mm512_setzero_ps();
    for (int64_t c = 0; c < D / 16; ++c) m = _mm512_max_ps(m, _mm512_abs_ps(v[c] = load16(x + 16 * c)));
    const float s = std::max(_mm512_reduce_max_ps(m) / 127.0f, 1e-30f);
    const __m512 sv = _mm512_set1_ps(s), lo = _mm512_set1_ps(-127.f), hi = _mm512_set1_ps(127.f);
    for (int64_t c = 0; c < D / 16; ++c) {
      const __m512 y = _mm512_min_ps(hi, _mm512_max_ps(lo, _mm512_div_ps(v[c], sv)));
      _mm_storeu_si128(reinterpret_cast<__m128i*>(q + 16 * c), _mm512_cvtepi32_epi8(_mm512_cvtps_epi32(y)));
    }
    *scale = s;
    return;
  }
#endif
  float amax = 0.f;
  for (int64_t j = 0; j < D; ++j) amax = std::max(amax, std::fabs(to_f(x[j])));
  const float s = std::max(amax / 127.0f, 1e-30f);
  for (int64_t j = 0; j < D; ++j) q[j] = int8_t(std::nearbyint(std::min(127.f, std::max(-127.f, to_f(x[j]) / s))));
  *scale = s;
}

// The same row into an FP8 cache: s = max|x| / the format's largest value (at least 1e-30), codes
// x / s clamped to it and rounded to nearest even: attention.py's quantize_kv, bit for bit.
template <typename T, typename C>
inline void quantize_row(const T* x, int64_t D, C* q, float* scale) {
  constexpr float fmax = fp8_max<C>();
  float amax = 0.f;
  for (int64_t j = 0; j < D; ++j) amax = std::max(amax, std::fabs(to_f(x[j])));
  const float s = std::max(amax / fmax, 1e-30f);
  for (int64_t j = 0; j < D; ++j) to_code(std::min(fmax, std::max(-fmax, to_f(x[j]) / s)), q + j);
  *scale = s;
}

// qkv: [T, Hq + 2 Hkv, D] (contiguous). Rotates the Q and K heads in place with the half-split
// layout (cos, signed sin tables indexed by position: x*cos + roll(x, D/2)*sin, each product rounded
// to T like torch's ops), then writes the rotated K heads and the V heads into their cache slots
// (an int8 cache: codes and scales by quantize_row).
template <typename T, typename C>
void rotary_kv_impl(at::Tensor& qkv, int64_t Hq, int64_t Hkv, const at::Tensor& cos, const at::Tensor& sin,
                    const at::Tensor& positions, at::Tensor& k_cache, at::Tensor& v_cache, const at::Tensor& slots,
                    float* ks, float* vs) {
  const int64_t Tn = qkv.size(0), D = qkv.size(2), half = D / 2, H = Hq + 2 * Hkv;
  T* x = qkv.data_ptr<T>();
  const T* ct = cos.data_ptr<T>();
  const T* st = sin.data_ptr<T>();
  const int64_t* pos = positions.data_ptr<int64_t>();
  const int64_t* sl = slots.data_ptr<int64_t>();
  char* kc = static_cast<char*>(k_cache.data_ptr());
  char* vc = static_cast<char*>(v_cache.data_ptr());
  pool_for(0, Tn, row_op_grain((Hq + Hkv) * D, 16), [&](int64_t begin, int64_t end) {
    std::vector<float> row(D);
    for (int64_t t = begin; t < end; ++t) {
      const T* c = ct + pos[t] * D;
      const T* s = st + pos[t] * D;
      for (int64_t h = 0; h < Hq + Hkv; ++h) {
        T* xh = x + (t * H + h) * D;
#ifdef AXON_AVX512
        if (half % 16 == 0 && D <= 256) {  // the whole head in registers, then rotated out of them
          __m512 v[16];
          const int64_t nc = D / 16, hc = nc / 2;
          for (int64_t j = 0; j < nc; ++j) v[j] = load16(xh + 16 * j);
          for (int64_t j = 0; j < nc; ++j) {
            __m512 a = rnd16<T>(_mm512_mul_ps(v[j], load16(c + 16 * j)));
            __m512 b = rnd16<T>(_mm512_mul_ps(v[j < hc ? j + hc : j - hc], load16(s + 16 * j)));
            store16(xh + 16 * j, _mm512_add_ps(a, b));
          }
          continue;
        }
#endif
        for (int64_t j = 0; j < D; ++j) row[j] = to_f(xh[j]);
        for (int64_t j = 0; j < D; ++j) {
          const float a = rnd<T>(row[j] * to_f(c[j]));
          const float b = rnd<T>(row[(j + half) % D] * to_f(s[j]));
          xh[j] = from_f<T>(a + b);
        }
      }
      if (sl[t] < 0) continue;
      if constexpr (scaled_cache_v<C>) {  // int8 / fp8 cache
        for (int64_t hh = 0; hh < Hkv; ++hh) {
          const int64_t row = sl[t] * Hkv + hh;
          quantize_row(x + (t * H + Hq + hh) * D, D, reinterpret_cast<C*>(kc) + row * D, ks + row);
          quantize_row(x + (t * H + Hq + Hkv + hh) * D, D, reinterpret_cast<C*>(vc) + row * D, vs + row);
        }
        continue;
      }
      std::memcpy(kc + sl[t] * Hkv * D * sizeof(T), x + (t * H + Hq) * D, Hkv * D * sizeof(T));
      std::memcpy(vc + sl[t] * Hkv * D * sizeof(T), x + (t * H + Hq + Hkv) * D, Hkv * D * sizeof(T));
    }
  });
}

void rotary_kv_write(at::Tensor qkv, int64_t Hq, int64_t Hkv, at::Tensor cos, at::Tensor sin, at::Tensor positions,
                     at::Tensor k_cache, at::Tensor v_cache, at::Tensor slots, c10::optional<at::Tensor> k_scale,
                     c10::optional<at::Tensor> v_scale) {
  TORCH_CHECK(qkv.is_contiguous() && cos.is_contiguous() && sin.is_contiguous(), "contiguous qkv and tables");
  TORCH_CHECK(qkv.scalar_type() == cos.scalar_type() && k_cache.scalar_type() == v_cache.scalar_type() &&
              (qkv.scalar_type() == k_cache.scalar_type() || scaled_cache(k_cache.scalar_type())),
              "one dtype (or int8 / fp8 caches)");
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous(), "contiguous caches");
  check_cache_scales(k_cache, k_scale);
  check_cache_scales(v_cache, v_scale);
  const bool q8 = scaled_cache(k_cache.scalar_type());
  float* ks = q8 ? k_scale->data_ptr<float>() : nullptr;
  float* vs = q8 ? v_scale->data_ptr<float>() : nullptr;
  by_dtype(qkv.scalar_type(), "rotary_kv_write", [&](auto tag) {
    using T = decltype(tag);
    if (!q8) return rotary_kv_impl<T, T>(qkv, Hq, Hkv, cos, sin, positions, k_cache, v_cache, slots, ks, vs);
    by_cache_codes(k_cache.scalar_type(), [&](auto code) {
      rotary_kv_impl<T, decltype(code)>(qkv, Hq, Hkv, cos, sin, positions, k_cache, v_cache, slots, ks, vs);
    });
  });
}

// ------------------------------------------------------------------ (add +) RMSNorm
// With a residual: residual = residual + x (rounded to T), out = norm(residual). Without: out =
// norm(x). norm(y) = w * T(y * rsqrt(mean(y^2) + eps)) for bf16 (transformers' rounding), y * rsqrt * w
// for float32. out may alias x.
template <typename T>
void rms_norm_impl(at::Tensor& out, const at::Tensor& x, at::Tensor* residual, const at::Tensor& w, double eps) {
  const int64_t Tn = x.size(0), H = x.size(1);
  const T* xp = x.data_ptr<T>();
  T* op = out.data_ptr<T>();
  T* rp = residual ? residual->data_ptr<T>() : nullptr;
  const T* wp = w.data_ptr<T>();
  const bool is_f32 = std::is_same<T, float>::value;
  pool_for(0, Tn, row_op_grain(H, 8), [&](int64_t begin, int64_t end) {
    std::vector<float> y(H);
    for (int64_t t = begin; t < end; ++t) {
      const T* xr = xp + t * H;
#ifdef AXON_AVX512
      if (H % 16 == 0) {  // the loops around, 16 lanes at a time (same sums, same roundings)
        __m512 acc = _mm512_setzero_ps();
        for (int64_t j = 0; j < H; j += 16) {
          __m512 v = load16(xr + j);
          if (rp) {
            v = rnd16<T>(_mm512_add_ps(load16(rp + t * H + j), v));
            store16(rp + t * H + j, v);
          }
          _mm512_storeu_ps(y.data() + j, v);
          acc = _mm512_add_ps(acc, _mm512_mul_ps(v, v));  // two roundings, as the loop
        }
        alignas(64) float lanes[16];
        _mm512_store_ps(lanes, acc);
        float ss = 0.f;
        for (int l = 0; l < 16; ++l) ss += lanes[l];
        const __m512 inv = _mm512_set1_ps(1.f / std::sqrt(ss / float(H) + float(eps)));
        T* o = op + t * H;
        for (int64_t k = 0; k < H; k += 16) {
          const __m512 n = _mm512_mul_ps(_mm512_loadu_ps(y.data() + k), inv);
          store16(o + k, is_f32 ? _mm512_mul_ps(n, load16(wp + k)) : _mm512_mul_ps(load16(wp + k), rnd16<T>(n)));
        }
        continue;
      }
#endif
      if (rp) {
        T* rr = rp + t * H;
        for (int64_t j = 0; j < H; ++j) { rr[j] = from_f<T>(to_f(rr[j]) + to_f(xr[j])); y[j] = to_f(rr[j]); }
      } else {
        for (int64_t j = 0; j < H; ++j) y[j] = to_f(xr[j]);
      }
      float lanes[16] = {0};
      int64_t j = 0;
      for (; j + 16 <= H; j += 16)
        for (int l = 0; l < 16; ++l) lanes[l] += y[j + l] * y[j + l];
      float ss = 0.f;
      for (int l = 0; l < 16; ++l) ss += lanes[l];
      for (; j < H; ++j) ss += y[j] * y[j];
      const float inv = 1.f / std::sqrt(ss / float(H) + float(eps));
      T* o = op + t * H;
      if (is_f32)
        for (int64_t k = 0; k < H; ++k) o[k] = from_f<T>(y[k] * inv * to_f(wp[k]));
      else
        for (int64_t k = 0; k < H; ++k) o[k] = from_f<T>(to_f(wp[k]) * rnd<T>(y[k] * inv));
    }
  });
}

void rms_norm(at::Tensor out, at::Tensor x, c10::optional<at::Tensor> residual, at::Tensor weight, double eps) {
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous() && out.is_contiguous(), "x/out: contiguous [tokens, hidden]");
  TORCH_CHECK(!residual || residual->is_contiguous(), "contiguous residual");
  at::Tensor* r = residual ? &residual.value() : nullptr;
  by_dtype(x.scalar_type(), "rms_norm", [&](auto tag) { rms_norm_impl<decltype(tag)>(out, x, r, weight, eps); });
}

// ------------------------------------------------------------------ SiLU(gate) * up
// gate_up: [T, 2I] -> out [T, I]; T(T(silu(gate)) * up) like torch's two ops.
#ifdef AXON_AVX512
// 16 lanes of T(silu(g)) * u (g, u already at T's precision), before the final rounding: shared by
// silu_and_mul and the AMX gate_up epilogue (gate_up_silu), which so compute the same bits
template <typename T>
inline __m512 silu_mul16(__m512 g, __m512 u) {
  const __m512 ex = exp16(_mm512_sub_ps(_mm512_setzero_ps(), g));
  return _mm512_mul_ps(rnd16<T>(_mm512_div_ps(g, _mm512_add_ps(_mm512_set1_ps(1.f), ex))), u);
}
#endif
template <typename T>
void silu_and_mul_impl(at::Tensor& out, const at::Tensor& gu) {
  const int64_t Tn = gu.size(0), I = gu.size(1) / 2;
  const T* g = gu.data_ptr<T>();
  T* op = out.data_ptr<T>();
  pool_for(0, Tn, serial_grain(I, 4), [&](int64_t begin, int64_t end) {
    std::vector<float> e(I);
    for (int64_t t = begin; t < end; ++t) {
      const T* gr = g + t * 2 * I;
      const T* ur = gr + I;
      T* o = op + t * I;
      int64_t j0 = 0;
#ifdef AXON_AVX512
      for (; j0 + 16 <= I; j0 += 16)  // the scalar loop below, 16 lanes at a time (same roundings)
        store16(o + j0, silu_mul16<T>(load16(gr + j0), load16(ur + j0)));
#endif
      for (int64_t j = j0; j < I; ++j) e[j - j0] = -to_f(gr[j]);
      exp_inplace(e.data(), I - j0);
      for (int64_t j = j0; j < I; ++j) {
        const float x = to_f(gr[j]);
        o[j] = from_f<T>(rnd<T>(x / (1.f + e[j - j0])) * to_f(ur[j]));
      }
    }
  });
}

at::Tensor silu_and_mul(at::Tensor gate_up) {
  TORCH_CHECK(gate_up.dim() == 2 && gate_up.is_contiguous(), "gate_up: contiguous [tokens, 2 * inter]");
  at::Tensor out = at::empty({gate_up.size(0), gate_up.size(1) / 2}, gate_up.options());
  by_dtype(gate_up.scalar_type(), "silu_and_mul", [&](auto tag) { silu_and_mul_impl<decltype(tag)>(out, gate_up); });
  return out;
}

// ------------------------------------------------------------------ greedy argmax
// Row-wise argmax of [N, V] logits in their own dtype (no float32 copy); the first index wins a tie.
// row_argmax also hands back the maximum (sample_impl's softmax shift).
template <typename T>
inline int64_t row_argmax(const T* row, int64_t V, float* max) {
  int64_t best = 0;
  float bv = to_f(row[0]);
  int64_t j = 1;
#ifdef AXON_AVX512
  // block maxima first; a block is scanned only when it beats the best so far
  for (; j + 16 <= V; j += 16) {
    const float m = _mm512_reduce_max_ps(load16(row + j));
    if (m > bv)
      for (int64_t k = j; k < j + 16; ++k)
        if (to_f(row[k]) > bv) { bv = to_f(row[k]); best = k; }
  }
#endif
  for (; j < V; ++j)
    if (to_f(row[j]) > bv) { bv = to_f(row[j]); best = j; }
  *max = bv;
  return best;
}

template <typename T>
void argmax_impl(const at::Tensor& x, at::Tensor& out) {
  const int64_t N = x.size(0), V = x.size(1), rs = x.stride(0);
  const T* xp = x.data_ptr<T>();
  int64_t* op = out.data_ptr<int64_t>();
  pool_for(0, N, serial_grain(V, 1), [&](int64_t begin, int64_t end) {
    float m;
    for (int64_t i = begin; i < end; ++i) op[i] = row_argmax(xp + i * rs, V, &m);
  });
}

at::Tensor argmax_rows(at::Tensor x) {
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1, "logits: [rows, vocab], last dim dense");
  at::Tensor out = at::empty({x.size(0)}, x.options().dtype(at::kLong));
  by_dtype(x.scalar_type(), "argmax_rows", [&](auto tag) { argmax_impl<decltype(tag)>(x, out); });
  return out;
}

// ------------------------------------------------------------------ top-k log-probabilities
// Per row, the k largest logits (descending; of equal ones the first index first) and their
// log-softmax values: one pass that only looks closer at a 16-lane block holding something above
// the current k-th, then one exp-sum pass, no float32 copy. EAGLE-2 tree drafting expands nodes
// into their k best children each depth; torch's float() + topk + logsumexp cost ~0.2 ms there.
template <typename T>
inline float block_exp_sum(const T* row, int64_t j0, int64_t j1, float m, float it);

template <typename T>
void topk_logprobs_impl(const at::Tensor& x, int64_t k, float* vals, int64_t* idx) {
  const int64_t N = x.size(0), V = x.size(1), rs = x.stride(0);
  const T* xp = x.data_ptr<T>();
  pool_for(0, N, serial_grain(V, 1), [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const T* row = xp + r * rs;
      float* tv = vals + r * k;
      int64_t* ti = idx + r * k;
      std::fill(tv, tv + k, -INFINITY);
      std::fill(ti, ti + k, int64_t(-1));
      auto push = [&](int64_t c, float v) {
        if (!(v > tv[k - 1]) && ti[k - 1] >= 0) return;
        int64_t p = k - 1;
        while (p > 0 && (v > tv[p - 1] || ti[p - 1] < 0)) { tv[p] = tv[p - 1]; ti[p] = ti[p - 1]; --p; }
        tv[p] = v;
        ti[p] = c;
      };
      int64_t j = 0;
#ifdef AXON_AVX512
      for (; j < k && j < V; ++j) push(j, to_f(row[j]));
      for (; j + 16 <= V; j += 16) {
        __mmask16 m = _mm512_cmp_ps_mask(load16(row + j), _mm512_set1_ps(tv[k - 1]), _CMP_GT_OQ);
        for (; m; m &= m - 1) {
          const int b = __builtin_ctz(m);
          push(j + b, to_f(row[j + b]));
        }
      }
#endif
      for (; j < V; ++j) push(j, to_f(row[j]));
      const float lse = tv[0] + std::log(block_exp_sum(row, 0, V, tv[0], 1.f));
      for (int64_t q = 0; q < k; ++q) tv[q] -= lse;
    }
  });
}

std::tuple<at::Tensor, at::Tensor> topk_logprobs(at::Tensor x, int64_t k) {
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1 && k >= 1 && k <= x.size(1), "logits: [rows, vocab >= k], last dim dense");
  at::Tensor vals = at::empty({x.size(0), k}, x.options().dtype(at::kFloat));
  at::Tensor idx = at::empty({x.size(0), k}, x.options().dtype(at::kLong));
  by_dtype(x.scalar_type(), "topk_logprobs", [&](auto tag) {
    topk_logprobs_impl<decltype(tag)>(x, k, vals.data_ptr<float>(), idx.data_ptr<int64_t>());
  });
  return {vals, idx};
}

// ------------------------------------------------------------------ temperature sampling
// One draw per row from softmax(x / T) by the inverse CDF: the caller brings one uniform u per row
// (from the request's own generator, so a seeded request's tokens do not depend on its batch);
// the row is read in its own dtype, three passes (max, block sums, a walk inside one block), no
// float32 copy of the logits, no per-element random numbers (the exponential race drew 49k of
// them per row: ~3x the decode step at 64 rows). inv_t <= 0 marks a greedy row (first index of a
// tie). A -inf logit (a banned token) has probability exactly 0 and is never drawn.
constexpr int64_t SAMPLE_BLOCK = 512;

template <typename T>
inline float block_exp_sum(const T* row, int64_t j0, int64_t j1, float m, float it) {
  float s = 0.f;
  int64_t j = j0;
#ifdef AXON_AVX512
  __m512 acc = _mm512_setzero_ps();
  const __m512 vm = _mm512_set1_ps(m), vit = _mm512_set1_ps(it), ninf = _mm512_set1_ps(-INFINITY);
  for (; j + 16 <= j1; j += 16) {
    const __m512 x = load16(row + j);
    const __m512 e = exp16(_mm512_mul_ps(_mm512_sub_ps(x, vm), vit));
    acc = _mm512_add_ps(acc, _mm512_maskz_mov_ps(_mm512_cmp_ps_mask(x, ninf, _CMP_NEQ_OQ), e));
  }
  s = _mm512_reduce_add_ps(acc);
#endif
  for (; j < j1; ++j) {
    const float x = to_f(row[j]);
    if (x != -INFINITY) s += std::exp((x - m) * it);
  }
  return s;
}

template <typename T>
void sample_impl(const at::Tensor& x, const float* inv_t, const double* u, int64_t* out) {
  const int64_t N = x.size(0), V = x.size(1), rs = x.stride(0);
  const T* xp = x.data_ptr<T>();
  const int64_t nb = (V + SAMPLE_BLOCK - 1) / SAMPLE_BLOCK;
  pool_for(0, N, serial_grain(V, 1), [&](int64_t begin, int64_t end) {
    std::vector<double> sums(nb);
    for (int64_t i = begin; i < end; ++i) {
      const T* row = xp + i * rs;
      float m;
      const int64_t best = row_argmax(row, V, &m);  // the greedy answer, and the softmax's shift
      const float it = inv_t[i];
      if (it <= 0.f || m == -INFINITY) { out[i] = best; continue; }
      double total = 0.0;
      for (int64_t b = 0; b < nb; ++b)
        total += sums[b] = block_exp_sum(row, b * SAMPLE_BLOCK, std::min(V, (b + 1) * SAMPLE_BLOCK), m, it);
      double target = u[i] * total, cum = 0.0;
      int64_t b = 0;
      while (b + 1 < nb && cum + sums[b] <= target) cum += sums[b++];
      // walk the chosen block; rounding may leave target just past its end: take its last nonzero
      int64_t pick = -1;
      for (int64_t j = b * SAMPLE_BLOCK, j1 = std::min(V, (b + 1) * SAMPLE_BLOCK); j < j1; ++j) {
        const float v = to_f(row[j]);
        if (v == -INFINITY) continue;
        pick = j;
        cum += std::exp((v - m) * it);
        if (cum > target) break;
      }
      out[i] = pick >= 0 ? pick : best;
    }
  });
}

at::Tensor sample_rows(at::Tensor x, at::Tensor inv_temp, at::Tensor u) {
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1, "logits: [rows, vocab], last dim dense");
  TORCH_CHECK(inv_temp.scalar_type() == at::kFloat && inv_temp.is_contiguous() && inv_temp.numel() == x.size(0),
              "inv_temp: float32 [rows]");
  TORCH_CHECK(u.scalar_type() == at::kDouble && u.is_contiguous() && u.numel() == x.size(0), "u: float64 [rows]");
  at::Tensor out = at::empty({x.size(0)}, x.options().dtype(at::kLong));
  by_dtype(x.scalar_type(), "sample_rows", [&](auto tag) {
    sample_impl<decltype(tag)>(x, inv_temp.data_ptr<float>(), u.data_ptr<double>(), out.data_ptr<int64_t>());
  });
  return out;
}

// ------------------------------------------------------------------ skinny bf16 matmul
// out[M, N] = x[M, K] @ W^T for a decode batch (M <= DOT_MAX_ROWS) without AMX: the weight is
// streamed once in a layout made for AVX512-BF16's pair dot product, wp [N/16, K/2, 16, 2] (16
// output columns x one K pair per 64-byte vector), float32 accumulation, one rounding to bf16.
// oneDNN's kernels read bf16 weights at about half the memory bandwidth at 1-8 rows; this loop
// streams them near the memory limit, and at 32-64 rows runs nearer the dot product's peak.

// Where column block b of a packed weight lies, `bs` elements a block. `half` (gate_up_silu): the
// weight is [gate; up] with `half` column blocks each, and the kernels walk its blocks interleaved
// (gate 0, up 0, gate 1, up 1, ...) so a pass holds a gate block and its up block side by side; 0:
// blocks in order.
template <typename W>
struct BlockMap {
  const W* w;
  int64_t bs, half;
  const W* at(int64_t b) const { return w + (half ? ((b & 1) ? half + (b >> 1) : b >> 1) : b) * bs; }
};

// Rows qdot_bf16 takes: a step of up to 4 rows waits on the weight's bytes more than on rebuilding
// it from codes (SmolLM2's decode step on the Zen 4: docs/benchmarks.md#fig-code-copies), and with a
// block's d and m in four registers each, 4 x 2 accumulators fit
constexpr int QDOT_ROWS = 4;

#if defined(AXON_AVX512) && defined(__AVX512BF16__)
// The weight's 16-column blocks are taken a few at a time, and every row group of x passes over
// those blocks while they are in L2 (rows x blocks float32 accumulators, each x pair broadcast
// from memory), so the weight streams from memory once whatever M is; the second row group
// requests the next blocks into L2. A row's sums run in K order in one accumulator: its result
// does not depend on the other rows (1 row or 128). SILU: the blocks come in (gate i, up i) pairs
// of gate_up_proj's weight and the epilogue writes silu_and_mul's bits of the two rounded products.
template <bool SILU> constexpr int bdot_nr() { return SILU ? 4 : 3; }  // blocks a group
template <bool SILU> constexpr int bdot_mr() { return SILU ? 6 : 8; }  // rows a group (24 accumulators)

// One K pair of an MR x NR tile: each row's x pair (broadcast) times each of the NR weight vectors,
// into its (row, block) accumulator. Shared by bdot_tile and qdot_tile, which so sum alike.
template <int MR, int NR>
[[gnu::always_inline]] inline void dot_pair(__m512 (&acc)[MR][NR], const int32_t* const* xr, int64_t p,
                                            const __m512bh* w) {
#pragma GCC unroll 8
  for (int m = 0; m < MR; ++m) {
    const __m512bh b = (__m512bh)_mm512_set1_epi32(xr[m][p]);
#pragma GCC unroll 4
    for (int j = 0; j < NR; ++j) acc[m][j] = _mm512_dpbf16_ps(acc[m][j], b, w[j]);
  }
}

// A tile's accumulators out: rounded to O, or (SILU) each (gate, up) block pair rounded to bf16 and
// through silu_and_mul's arithmetic.
template <int MR, int NR, bool SILU, typename O>
[[gnu::always_inline]] inline void store_tile(__m512 (&acc)[MR][NR], O* op, int64_t os) {
#pragma GCC unroll 8
  for (int m = 0; m < MR; ++m) {
    if constexpr (SILU) {
#pragma GCC unroll 4
      for (int i = 0; i < NR / 2; ++i)
        store16(op + m * os + i * 16, silu_mul16<bf16>(rnd16<bf16>(acc[m][2 * i]), rnd16<bf16>(acc[m][2 * i + 1])));
    } else {
#pragma GCC unroll 4
      for (int j = 0; j < NR; ++j) store16(op + m * os + j * 16, acc[m][j]);
    }
  }
}

// O: the output's type (bf16, rounded once; float, as summed: the prompt attention's scores)
template <int MR, int NR, bool SILU, typename O = bf16>
[[gnu::noinline]] void bdot_tile(const int32_t* const* xr, const bf16* const* wj, O* op, int64_t os, int64_t K2,
                                 const bf16* const* pf) {
  __m512 acc[MR][NR];
  for (int m = 0; m < MR; ++m)
    for (int j = 0; j < NR; ++j) acc[m][j] = _mm512_setzero_ps();
  for (int64_t p = 0; p < K2; ++p) {
    __m512bh w[NR];
#pragma GCC unroll 4
    for (int j = 0; j < NR; ++j) w[j] = (__m512bh)_mm512_loadu_si512(wj[j] + p * 32);
    if (pf)
#pragma GCC unroll 4
      for (int j = 0; j < NR; ++j) _mm_prefetch(reinterpret_cast<const char*>(pf[j] + p * 32), _MM_HINT_T1);
    dot_pair<MR, NR>(acc, xr, p, w);
  }
  store_tile<MR, NR, SILU>(acc, op, os);
}

template <int NR, bool SILU>
void bdot_group(const bf16* xp, int64_t xs, int64_t M, const bf16* const* wj, bf16* op, int64_t os, int64_t K2,
               const bf16* const* next) {
  constexpr int MR = bdot_mr<SILU>();
  const int32_t* xr[MR];
  for (int64_t m0 = 0, r = 0; m0 < M; m0 += MR, ++r) {
    const int64_t mr = std::min<int64_t>(MR, M - m0);
    for (int64_t m = 0; m < mr; ++m) xr[m] = reinterpret_cast<const int32_t*>(xp + (m0 + m) * xs);
    // the next blocks into L2 during the second row group (the first streams these from memory)
    const bf16* const* pf = r == std::min<int64_t>(1, (M - 1) / MR) ? next : nullptr;
    with_count<MR>(mr, [&](auto rows) { bdot_tile<decltype(rows)::value, NR, SILU>(xr, wj, op + m0 * os, os, K2, pf); });
  }
}

// f(v0, nr, ahead) for each group of NR column blocks (v0 its first, nr <= NR of them; ahead: the
// next group is the same task's and whole, so its blocks may be requested meanwhile), the groups
// split between the kernels' pool at ~64k weight pairs x rows a task (a small product stays on the
// calling thread).
template <int NR, typename F>
void for_block_groups(int64_t NB, int64_t K2, int64_t M, F&& f) {
  pool_for(0, (NB + NR - 1) / NR, std::max<int64_t>(1, 65536 / (K2 * 16 * NR * M)), [&](int64_t begin, int64_t end) {
    for (int64_t g = begin; g < end; ++g) f(g * NR, std::min<int64_t>(NR, NB - g * NR), g + 1 < end && NB - g * NR >= 2 * NR);
  });
}

template <bool SILU>
void bdot_rows(const at::Tensor& x, const at::Tensor& wp, at::Tensor& out) {
  constexpr int NR = bdot_nr<SILU>();
  const int64_t NB = wp.size(0), K2 = wp.size(1), M = x.size(0);
  const BlockMap<bf16> map{wp.data_ptr<bf16>(), K2 * 32, SILU ? NB / 2 : 0};  // SILU: gate 0, up 0, gate 1, ...
  const bf16* xp = x.data_ptr<bf16>();
  bf16* op = out.data_ptr<bf16>();
  const int64_t xs = x.stride(0), os = out.stride(0);
  for_block_groups<NR>(NB, K2, M, [&](int64_t v0, int64_t nr, bool ahead) {
    const bf16* wj[NR];
    const bf16* nx[NR];
    for (int j = 0; j < NR; ++j) {
      wj[j] = map.at(std::min(v0 + j, NB - 1));
      nx[j] = map.at(std::min(v0 + NR + j, NB - 1));
    }
    const bf16* const* next = ahead ? nx : nullptr;  // the next group's blocks into L2 while this one is in use
    bf16* o = op + (SILU ? v0 / 2 : v0) * 16;
    if (nr == NR) bdot_group<NR, SILU>(xp, xs, M, wj, o, os, K2, next);
    else if (nr == 2) bdot_group<2, SILU>(xp, xs, M, wj, o, os, K2, nullptr);  // (SILU: one pair)
    else if constexpr (!SILU) bdot_group<1, SILU>(xp, xs, M, wj, o, os, K2, nullptr);
  });
}

// The same products from block codes (`qdot_bf16`): a GGUF Q4_1 / Q8_0 weight that the converter
// dequantized to float32 and the loader rounded to bf16 is kept as its codes and float16 scales
// (layers/quant.py `code_copy`, checked bit for bit at load), and each 64-byte bf16 vector of
// bdot_tile's layout is rebuilt in registers: fma(q, d, m) in float32 (the converter's one
// rounding) and vcvtne2ps2bf16 (the loader's round-to-nearest-even). So the products, their order
// and the bits are bdot_rows', from 5 (Q4_1) or 9 (Q8_0) bits a weight streamed instead of 16: a
// decode step of a few rows waits on those bytes. Codes [NB, K/2, CB]: byte i of a (block, K pair)
// holds lane i of the low 16 floats (column i / 2, K 2p + i % 2) and lane i of the high 16 (column
// 8 + i / 2): a nibble each for Q4_1 (CB 16), a signed byte each for Q8_0 (CB 32, high lanes in
// bytes 16-31). Scales [NB, K/32, 2, 16] float16: d then m of the block's 16 columns.
template <int BITS> constexpr int64_t qdot_cb() { return BITS == 4 ? 16 : 32; }  // code bytes a (block, K pair)

template <int BITS>
inline __m512bh qdot_decode(const uint8_t* c, const __m512* dm) {
  __m512i lo, hi;
  if constexpr (BITS == 4) {
    const __m512i v = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(c)));
    lo = _mm512_and_si512(v, _mm512_set1_epi32(15));
    hi = _mm512_srli_epi32(v, 4);
  } else {
    lo = _mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(c)));
    hi = _mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(c + 16)));
  }
  const __m512 wl = _mm512_fmadd_ps(_mm512_cvtepi32_ps(lo), dm[0], dm[1]);
  const __m512 wh = _mm512_fmadd_ps(_mm512_cvtepi32_ps(hi), dm[2], dm[3]);
  return _mm512_cvtne2ps_pbh(wh, wl);  // words 0-15 from wl, 16-31 from wh: (column, K pair) lanes
}

template <int MR, int NR, bool SILU, int BITS>
[[gnu::noinline]] void qdot_tile(const int32_t* const* xr, const uint8_t* const* cj, const at::Half* const* sj,
                                 bf16* op, int64_t os, int64_t K2, const uint8_t* const* pf) {
  constexpr int64_t CB = qdot_cb<BITS>();
  const __m512i lo_idx = _mm512_set_epi32(7, 7, 6, 6, 5, 5, 4, 4, 3, 3, 2, 2, 1, 1, 0, 0);
  const __m512i hi_idx = _mm512_add_epi32(lo_idx, _mm512_set1_epi32(8));
  __m512 acc[MR][NR];
  for (int m = 0; m < MR; ++m)
    for (int j = 0; j < NR; ++j) acc[m][j] = _mm512_setzero_ps();
  for (int64_t p0 = 0; p0 < K2; p0 += 16) {  // a K block of 32: one d and m a column
    __m512 dm[NR][4];
#pragma GCC unroll 4
    for (int j = 0; j < NR; ++j) {
      const at::Half* s = sj[j] + p0 * 2;  // (p0 / 16) * 32
      const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(s)));
      const __m512 m = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(s + 16)));
      dm[j][0] = _mm512_permutexvar_ps(lo_idx, d);
      dm[j][1] = _mm512_permutexvar_ps(lo_idx, m);
      dm[j][2] = _mm512_permutexvar_ps(hi_idx, d);
      dm[j][3] = _mm512_permutexvar_ps(hi_idx, m);
    }
#pragma GCC unroll 2
    for (int64_t p = p0; p < p0 + 16; ++p) {
      __m512bh w[NR];
#pragma GCC unroll 4
      for (int j = 0; j < NR; ++j) w[j] = qdot_decode<BITS>(cj[j] + p * CB, dm[j]);
      if (pf && (p * CB) % 64 == 0)
#pragma GCC unroll 4
        for (int j = 0; j < NR; ++j) _mm_prefetch(reinterpret_cast<const char*>(pf[j] + p * CB), _MM_HINT_T1);
      dot_pair<MR, NR>(acc, xr, p, w);
    }
  }
  store_tile<MR, NR, SILU>(acc, op, os);
}

// bdot_rows over block codes for up to QDOT_ROWS rows: two 16-column blocks a task step (SILU: a gate
// block and its up block) rebuilt in registers once for all the rows, the next pair's codes
// requested into L2 meanwhile. (More rows pay the rebuild more than they save in bytes: rebuilding
// into an L2 buffer for bdot_tile's row groups ran 6-16-row steps no faster than the bf16 copy.)
template <bool SILU, int BITS>
void qdot_rows(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& scales, at::Tensor& out) {
  constexpr int NR = 2;
  const int64_t NB = codes.size(0), K2 = codes.size(1), M = x.size(0);
  const int64_t half = SILU ? NB / 2 : 0;  // SILU: gate 0, up 0, gate 1, ...
  const BlockMap<uint8_t> cmap{static_cast<const uint8_t*>(codes.data_ptr()), K2 * qdot_cb<BITS>(), half};
  const BlockMap<at::Half> smap{scales.data_ptr<at::Half>(), K2 * 2, half};
  const int32_t* xr[QDOT_ROWS];
  for (int64_t m = 0; m < M; ++m) xr[m] = reinterpret_cast<const int32_t*>(x.data_ptr<bf16>() + m * x.stride(0));
  bf16* op = out.data_ptr<bf16>();
  const int64_t os = out.stride(0);
  for_block_groups<NR>(NB, K2, M, [&](int64_t v0, int64_t nr, bool ahead) {
    const uint8_t* cj[NR];
    const uint8_t* nx[NR];
    const at::Half* sj[NR];
    for (int j = 0; j < NR; ++j) {
      cj[j] = cmap.at(std::min(v0 + j, NB - 1));
      sj[j] = smap.at(std::min(v0 + j, NB - 1));
      nx[j] = cmap.at(std::min(v0 + NR + j, NB - 1));
    }
    bf16* o = op + (SILU ? v0 / 2 : v0) * 16;
    with_count<QDOT_ROWS>(M, [&](auto rows) {
      constexpr int R = decltype(rows)::value;
      if (nr == NR) qdot_tile<R, NR, SILU, BITS>(xr, cj, sj, o, os, K2, ahead ? nx : nullptr);
      else if constexpr (!SILU) qdot_tile<R, 1, SILU, BITS>(xr, cj, sj, o, os, K2, nullptr);
    });
  });
}
#endif

bool has_bf16_gemv() {
#if defined(AXON_AVX512) && defined(__AVX512BF16__)
  return true;
#else
  return false;
#endif
}

// ------------------------------------------------------------------ AMX tiles for 1..128 rows
// The same packed weight read by AMX's tile multiply: a B tile is 16 consecutive K pairs of one
// 16-column block (16 rows x 64 bytes, contiguous in the layout), an A tile up to 16 rows x 32 K
// values of x, the accumulator tile [rows x 16] float32. Weights are streamed once; a batch of up
// to 32 rows costs about what one row does (oneDNN's brgemm reads them at about half that rate at
// these sizes on this machine); more rows take passes of 32 over each pair of column blocks while
// it is in cache (amx_rows32). SmolLM2's 121 decode linears from DRAM (scripts/linear_ab.py):
// 0.75x oneDNN's time at 64 rows, 0.74-0.86x at 96-128, 0.87-0.95x at 192-256 (not taken: within
// the noise of the hour). An int8 weight is widened again on every pass, so it stops at 64 rows
// (0.84x the two-pass kernel there; at 128 rows even with oneDNN, at 256 1.5x slower).
constexpr int64_t AMX_MAX_ROWS = 128, AMX_INT8_MAX_ROWS = 64, AMX_PASS_ROWS = 32;

#ifdef AXON_AMX
struct TileConfig {  // ldtilecfg's 64-byte layout (palette 1)
  uint8_t palette = 1, start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

// Linux hands out the AMX register state only on request (arch_prctl ARCH_REQ_XCOMP_PERM for
// XTILEDATA), once per process; without it the first tile instruction raises SIGILL.
bool amx_permitted() {
  static const bool ok = syscall(SYS_arch_prctl, 0x1023 /* ARCH_REQ_XCOMP_PERM */, 18 /* XTILEDATA */) == 0;
  return ok;
}

// Accumulator tile -> bf16 output rows; with int8 weights each column is first multiplied by
// its scale (`sc`, the block's 16 scales; null for bf16 weights).
inline void store_tile_rows(int tile, float* buf, bf16* op, int64_t os, int64_t rows, const float* sc) {
  switch (tile) {  // tile numbers are immediates
    case 0: _tile_stored(0, buf, 64); break;
    case 1: _tile_stored(1, buf, 64); break;
    case 2: _tile_stored(2, buf, 64); break;
    default: _tile_stored(3, buf, 64); break;
  }
  if (sc) {
    const __m512 s = _mm512_loadu_ps(sc);
    for (int64_t m = 0; m < rows; ++m) store16(op + m * os, _mm512_mul_ps(_mm512_load_ps(buf + m * 16), s));
  } else {
    for (int64_t m = 0; m < rows; ++m) store16(op + m * os, _mm512_load_ps(buf + m * 16));
  }
}

// Each column block's tiles are one sequential stream; a tile a few K steps ahead is requested
// in software too, which keeps more of the stream in flight than the hardware prefetcher alone
// when attention's KV reads compete for memory (past a block's end it touches the next block:
// harmless, prefetches do not fault).
// Into L1 4 tiles ahead; a one-pass batch of 17-32 rows (two streams, where 1-16 rows have four) also
// into L2 32 tiles ahead, which keeps more of the stream in flight: SmolLM2's decode linears from
// DRAM (scripts/linear_ab.py) at 32 rows 0.94-0.95x the time (16 tiles: 0.985x; 12 tiles into L1
// instead: 1.02x slower); at 1-16 rows it made no difference, with more passes it doubled the
// requests of amx_rows32's next-pair prefetch (1.10x slower at 128 rows).
constexpr int64_t AMX_PREFETCH = 4 * 512;      // elements
constexpr int64_t AMX_PREFETCH_L2 = 32 * 512;  // elements
template <typename W, int HINT = _MM_HINT_T0>
inline void prefetch_tile(const W* p) {
  const char* c = reinterpret_cast<const char*>(p);
  for (int i = 0; i < int(512 * sizeof(W)); i += 64) _mm_prefetch(c + i, static_cast<_mm_hint>(HINT));
}

// A B tile for _tile_loadd: bf16 weights are used where they lie; an int8 tile (512 bytes) is
// widened to exact bf16 integers in `buf` (L1) by two 128-entry byte tables (vpermi2b): the low
// and high byte of bf16(|q|), the sign or-ed in; q = -128 never occurs (symmetric +-127). The
// bytes come out interleaved per 128-bit lane, so pack_int8_weight stores each 64 bytes in that
// order. ~6 instructions per 64 weights, where int8 -> int32 -> float -> bf16 took ~16.
struct Int8Tables {
  __m512i lo0, lo1, hi0, hi1;
  Int8Tables() {
    alignas(64) uint8_t lo[128], hi[128];
    for (int a = 0; a < 128; ++a) {
      const uint16_t b = bf16(float(a)).x;
      lo[a] = uint8_t(b & 0xFF);
      hi[a] = uint8_t(b >> 8);
    }
    lo0 = _mm512_load_si512(lo); lo1 = _mm512_load_si512(lo + 64);
    hi0 = _mm512_load_si512(hi); hi1 = _mm512_load_si512(hi + 64);
  }
};
const Int8Tables& int8_tables() {
  static const Int8Tables t;
  return t;
}

inline void widen_tile(const int8_t* w, bf16* buf, const Int8Tables& t) {
  const __m512i sign = _mm512_set1_epi8(char(0x80));
  for (int r = 0; r < 8; ++r) {  // 64 weights: two tile rows
    const __m512i v = _mm512_loadu_si512(w + r * 64);
    const __m512i a = _mm512_abs_epi8(v);
    const __m512i lo = _mm512_permutex2var_epi8(t.lo0, a, t.lo1);
    const __m512i hi = _mm512_ternarylogic_epi32(_mm512_permutex2var_epi8(t.hi0, a, t.hi1), v, sign, 0xF8);
    _mm512_store_si512(buf + r * 64, _mm512_unpacklo_epi8(lo, hi));
    _mm512_store_si512(buf + r * 64 + 32, _mm512_unpackhi_epi8(lo, hi));
  }
}

// Where a pass's B tiles come from (block j of the pass at column block nb, K step kc): bf16
// weights where they lie; int8 weights widened one K step ahead into a double buffer, so a tile
// load never waits on the stores that just wrote it (loading right after them ran no faster than
// bf16's twice-as-large stream). Block order: BlockMap (gate_up_silu: gate and up interleaved).
template <typename W> struct BTiles;
template <> struct BTiles<bf16> : BlockMap<bf16> {
  void widen(int64_t, int64_t, int64_t) {}
  const bf16* get(int64_t nb, int64_t kc, int64_t j) const { return at(nb + j) + kc * 512; }
};
template <> struct BTiles<int8_t> : BlockMap<int8_t> {
  const Int8Tables& tab = int8_tables();
  alignas(64) bf16 buf[2][4][512];
  void widen(int64_t nb, int64_t kc, int64_t n) {
    for (int64_t j = 0; j < n; ++j) widen_tile(at(nb + j) + kc * 512, buf[kc & 1][j], tab);
  }
  const bf16* get(int64_t, int64_t kc, int64_t j) const { return buf[kc & 1][j]; }
};

// Gate and up accumulator tiles (0 and 1, or with `second` 2 and 3; rows x 16 columns) -> bf16 rows
// of T(silu(g)) * u at op: each rounded to bf16 first, as gate_up's output is before silu_and_mul.
inline void store_silu_rows(bool second, float* buf, bf16* op, int64_t os, int64_t rows) {
  if (second) {  // (tile numbers are immediates)
    _tile_stored(2, buf, 128);
    _tile_stored(3, buf + 16, 128);
  } else {
    _tile_stored(0, buf, 128);
    _tile_stored(1, buf + 16, 128);
  }
  auto as_bf16 = [](__m512 v) {  // what store16 then load16 give
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32((__m256i)_mm512_cvtneps_pbh(v)), 16));
  };
  for (int64_t m = 0; m < rows; ++m)
    store16(op + m * os,
            silu_mul16<bf16>(as_bf16(_mm512_load_ps(buf + m * 32)), as_bf16(_mm512_load_ps(buf + m * 32 + 16))));
}

// M <= 16: accumulators 0..3 = four column blocks, A = tile 4, B = tiles 5..7. SILU: blocks
// mapped by `half` (BlockMap), each gate / up pair written as silu(gate) * up at block nb / 2.
template <typename W, bool SILU = false>
void amx_rows16(const bf16* xp, int64_t xs, const W* w, const float* scales, int64_t K2, int64_t M, bf16* op,
                int64_t os, int64_t nb0, int64_t nb1, int64_t half = 0) {
  TileConfig cfg;
  for (int t = 0; t < 8; ++t) { cfg.rows[t] = t < 5 ? M : 16; cfg.colsb[t] = 64; }
  _tile_loadconfig(&cfg);
  alignas(64) float buf[16 * 16];
  const int64_t bs = K2 * 32;  // elements from one column block to the next
  BTiles<W> bt{{w, bs, half}};
  const int64_t KC = K2 / 16;
  for (int64_t nb = nb0; nb < nb1; nb += 4) {
    const int64_t n = std::min<int64_t>(4, nb1 - nb);
    _tile_zero(0); _tile_zero(1); _tile_zero(2); _tile_zero(3);
    bt.widen(nb, 0, n);
    for (int64_t kc = 0; kc < KC; ++kc) {
      for (int64_t j = 0; j < n; ++j) prefetch_tile(bt.at(nb + j) + kc * 512 + AMX_PREFETCH);
      _tile_loadd(4, xp + kc * 32, xs * 2);
      _tile_loadd(5, bt.get(nb, kc, 0), 64);
      _tile_dpbf16ps(0, 4, 5);
      if (n > 1) { _tile_loadd(6, bt.get(nb, kc, 1), 64); _tile_dpbf16ps(1, 4, 6); }
      if (n > 2) { _tile_loadd(7, bt.get(nb, kc, 2), 64); _tile_dpbf16ps(2, 4, 7); }
      if (n > 3) { _tile_loadd(5, bt.get(nb, kc, 3), 64); _tile_dpbf16ps(3, 4, 5); }
      if (kc + 1 < KC) bt.widen(nb, kc + 1, n);
    }
    if constexpr (SILU) {  // (n is even: the pool's ranges start at multiples of 4 blocks, NB is even)
      alignas(64) float pair[16 * 32];
      store_silu_rows(false, pair, op + nb / 2 * 16, os, M);
      if (n > 2) store_silu_rows(true, pair, op + (nb / 2 + 1) * 16, os, M);
    } else {
      for (int j = 0; j < n; ++j)
        store_tile_rows(j, buf, op + (nb + j) * 16, os, M, scales ? scales + (nb + j) * 16 : nullptr);
    }
  }
  _tile_release();
}

// 16 < M: passes of up to 32 rows (two row tiles, A = tiles 4, 5) over each pair of column blocks
// (B = tiles 6, 7); accumulators 0, 1 = a pass's rows 0..15 and 2, 3 its rows 16..31 of blocks nb,
// nb + 1. All of a pair's passes run before the next pair, so the weights stream from memory once
// and the later passes find the pair's tiles in L1/L2 (one pass over the whole weight per 32 rows
// read it again from DRAM: this machine's shared L3 is hardly faster). While the passes compute,
// the next pair's tiles are requested into L2, spread over them, so the memory keeps streaming.
// Each output element sees the same tile products in the same K order as in one pass: the bits do
// not depend on how the rows are cut.
template <typename W, bool SILU = false>
void amx_rows32(const bf16* xp, int64_t xs, const W* w, const float* scales, int64_t K2, int64_t M, bf16* op,
                int64_t os, int64_t nb0, int64_t nb1, int64_t half = 0) {
  alignas(64) float buf[16 * 16];
  const int64_t bs = K2 * 32;
  BTiles<W> bt{{w, bs, half}};
  const int64_t KC = K2 / 16;
  const int64_t P = (M + AMX_PASS_ROWS - 1) / AMX_PASS_ROWS;
  // the first pass that requests the next pair: bf16 from the first at 2-3 passes (0.90x the time
  // at 64 rows, 0.95x at 96, against from the second), from the second at 4 (compute-bound there:
  // from the first was 1.01-1.03x slower); int8 from the second (its first pass is busy widening:
  // from the first 1.07x slower at 64 rows)
  const int64_t P0 = std::is_same_v<W, int8_t> || P >= 4 ? 1 : 0;
  int64_t configured = 0;  // the rows of the pass the tiles are configured for
  for (int64_t nb = nb0; nb < nb1; nb += 2) {
    const int64_t nbl = nb + 1 < nb1 ? 2 : 1;
    const int64_t nn = std::min<int64_t>(2, std::max<int64_t>(0, nb1 - nb - 2));  // blocks in the next pair
    const int64_t next = nn * KC;                                                   // and their tiles
    for (int64_t p = 0; p < P; ++p) {
      const int64_t m0 = p * AMX_PASS_ROWS, pm = std::min(AMX_PASS_ROWS, M - m0);
      const int64_t M0 = std::min<int64_t>(16, pm), M1 = pm - M0;
      if (pm != configured) {
        TileConfig cfg;
        const uint8_t rows[8] = {uint8_t(M0), uint8_t(M0), uint8_t(M1), uint8_t(M1), uint8_t(M0), uint8_t(M1), 16, 16};
        for (int t = 0; t < 8; ++t) { cfg.rows[t] = rows[t]; cfg.colsb[t] = rows[t] ? 64 : 0; }
        _tile_loadconfig(&cfg);
        configured = pm;
      }
      const bf16* xa = xp + m0 * xs;
      const bf16* xb = xa + 16 * xs;
      _tile_zero(0); _tile_zero(1);
      if (M1) { _tile_zero(2); _tile_zero(3); }
      bt.widen(nb, 0, nbl);
      for (int64_t kc = 0; kc < KC; ++kc) {
        const W* wk = bt.at(nb) + kc * 512;
        const W* wk1 = bt.at(nb + 1) + kc * 512;
        if (p == 0) {
          prefetch_tile(wk + AMX_PREFETCH);
          if (nbl == 2) prefetch_tile(wk1 + AMX_PREFETCH);
          if (P == 1) {  // (with more passes the next pair is requested instead)
            prefetch_tile<W, _MM_HINT_T1>(wk + AMX_PREFETCH_L2);
            if (nbl == 2) prefetch_tile<W, _MM_HINT_T1>(wk1 + AMX_PREFETCH_L2);
          }
        }
        if (P > 1 && p >= P0) {
          const int64_t slot = (p - P0) * KC + kc, slots = (P - P0) * KC;
          for (int64_t t = slot * next / slots; t < (slot + 1) * next / slots; ++t)
            prefetch_tile<W, _MM_HINT_T1>(bt.at(nb + 2 + t % nn) + (t / nn) * 512);
        }
        _tile_loadd(4, xa + kc * 32, xs * 2);
        if (M1) _tile_loadd(5, xb + kc * 32, xs * 2);
        _tile_loadd(6, bt.get(nb, kc, 0), 64);
        _tile_dpbf16ps(0, 4, 6);
        if (M1) _tile_dpbf16ps(2, 5, 6);
        if (nbl == 2) {
          _tile_loadd(7, bt.get(nb, kc, 1), 64);
          _tile_dpbf16ps(1, 4, 7);
          if (M1) _tile_dpbf16ps(3, 5, 7);
        }
        if (kc + 1 < KC) bt.widen(nb, kc + 1, nbl);
      }
      if constexpr (SILU) {  // (nbl is 2: NB is even)
        alignas(64) float pair[16 * 32];
        store_silu_rows(false, pair, op + m0 * os + nb / 2 * 16, os, M0);
        if (M1) store_silu_rows(true, pair, op + (m0 + 16) * os + nb / 2 * 16, os, M1);
      } else {
        for (int j = 0; j < nbl; ++j) {
          const float* sc = scales ? scales + (nb + j) * 16 : nullptr;
          store_tile_rows(j, buf, op + m0 * os + (nb + j) * 16, os, M0, sc);
          if (M1) store_tile_rows(2 + j, buf, op + (m0 + 16) * os + (nb + j) * 16, os, M1, sc);
        }
      }
    }
  }
  if (configured) _tile_release();
}

// Up to AMX_MAX_ROWS rows: M <= 16 on one row tile and four column blocks at a time, more on
// amx_rows32's passes of 32 rows. SILU (gate_up_silu): the weight is [gate; up], out [M, N / 2].
template <typename W, bool SILU = false>
void amx_matmul(const at::Tensor& x, const W* w, const float* scales, int64_t NB, int64_t K2, at::Tensor& out) {
  const int64_t M = x.size(0);
  const bf16* xp = x.data_ptr<bf16>();
  bf16* op = out.data_ptr<bf16>();
  const int64_t xs = x.stride(0), os = out.stride(0), half = SILU ? NB / 2 : 0;
  const int64_t group = M <= 16 ? 4 : 2;  // column blocks per tile pass
  const int64_t groups = (NB + group - 1) / group;
  // ~16k weight pairs per task: a small matrix stays on the calling thread
  pool_for(0, groups, std::max<int64_t>(1, 16384 / (K2 * 16 * group)), [&](int64_t b, int64_t e) {
    const int64_t nb0 = b * group, nb1 = std::min(NB, e * group);
    if (M <= 16) amx_rows16<W, SILU>(xp, xs, w, scales, K2, M, op, os, nb0, nb1, half);
    else amx_rows32<W, SILU>(xp, xs, w, scales, K2, M, op, os, nb0, nb1, half);
  });
}

#endif

#if defined(AXON_AVX512) && defined(__AVX512BF16__)
#include "amx_attention.h"

// Whether prefill chunks' flash attention runs on AMX tiles (else on the dot product): where the CPU
// has them, unless AXONSERVE_AMX_ATTENTION=0 (A/B runs, and tests of the dot path on AMX machines;
// read per call: a chunk's attention takes ms).
bool chunk_tiles() {
#ifdef AXON_AMX
  const char* e = std::getenv("AXONSERVE_AMX_ATTENTION");
  const std::string v = e ? e : "";
  return amx_permitted() && !(v == "0" || v == "false" || v == "no");
#else
  return false;
#endif
}
#endif

// Whether paged_attention runs prefill chunks on AMX tiles (bf16, head_dim 32 or 64: amx_attention.h).
bool amx_attention(int64_t head_dim) {
#ifdef AXON_AMX
  return (head_dim == 32 || head_dim == 64) && amx_permitted();
#else
  (void)head_dim;
  return false;
#endif
}

// Whether paged_attention runs bf16 prefill chunks of any length itself (flash attention on AMX
// tiles or AVX512-BF16's dot product, head_dim 32 or 64: amx_attention.h).
bool chunk_attention(int64_t head_dim) { return (head_dim == 32 || head_dim == 64) && has_bf16_gemv(); }

bool amx_fits(const at::Tensor& wp) {
#ifdef AXON_AMX
  return wp.size(1) % 16 == 0 && amx_permitted();
#else
  (void)wp;
  return false;
#endif
}

// W [N, K] bf16 -> [N/16, K/2, 16, 2]
at::Tensor pack_gemv_weight(at::Tensor w) {
  TORCH_CHECK(w.dim() == 2 && w.scalar_type() == at::kBFloat16, "weight: [N, K] bfloat16");
  const int64_t N = w.size(0), K = w.size(1);
  TORCH_CHECK(N % 16 == 0 && K % 2 == 0, "N must be a multiple of 16 and K even");
  return w.reshape({N / 16, 16, K / 2, 2}).permute({0, 2, 1, 3}).contiguous();
}

// W [N, K] int8 (symmetric, -127..127) -> skinny_int8's layout: pack_gemv_weight's order with each
// 64 bytes [2 halves, 4 lanes, 8] stored [4 lanes, 2 halves, 8], the order b_tile's byte unpack
// gives back.
at::Tensor pack_int8_weight(at::Tensor w) {
  TORCH_CHECK(w.dim() == 2 && w.scalar_type() == at::kChar, "weight: [N, K] int8");
  const int64_t N = w.size(0), K = w.size(1);
  TORCH_CHECK(N % 16 == 0 && K % 32 == 0, "N must be a multiple of 16 and K of 32");
  at::Tensor p = w.reshape({N / 16, 16, K / 2, 2}).permute({0, 2, 1, 3}).contiguous();
  return p.view({-1, 2, 4, 8}).transpose(1, 2).contiguous().view({N / 16, K / 2, 16, 2});
}

void check_skinny_args(const at::Tensor& x, const at::Tensor& wp, at::ScalarType wt = at::kBFloat16) {
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1 && x.scalar_type() == at::kBFloat16, "x: [M, K] bfloat16, rows dense");
  TORCH_CHECK(wp.scalar_type() == wt, "wp: ", wt, " expected, got ", wp.scalar_type());
  TORCH_CHECK(wp.dim() == 4 && wp.is_contiguous() && wp.size(2) == 16 && wp.size(3) == 2, "wp: pack_gemv_weight's");
  TORCH_CHECK(x.size(1) == 2 * wp.size(1), "x has ", x.size(1), " columns, the weight ", 2 * wp.size(1));
}

// x @ W^T for 0..DOT_MAX_ROWS rows on AVX512-BF16's dot-product loop (bdot_rows): skinny_bf16's
// kernel where AMX does not take the weight; with `silu`, gate_up_silu's there. Exposed on its own
// so that tests run it on AMX machines too.
constexpr int64_t DOT_MAX_ROWS = 128;
at::Tensor dot_bf16(at::Tensor x, at::Tensor wp, bool silu) {
  TORCH_CHECK(has_bf16_gemv(), "dot_bf16 needs AVX512-BF16");
  check_skinny_args(x, wp);
  const int64_t M = x.size(0), NB = wp.size(0);
  TORCH_CHECK(M <= DOT_MAX_ROWS, "dot_bf16 takes 0..", DOT_MAX_ROWS, " rows");
  TORCH_CHECK(!silu || NB % 2 == 0, "silu: I a multiple of 16");
  at::Tensor out = at::empty({M, silu ? NB / 2 * 16 : NB * 16}, x.options());
  if (M == 0) return out;
#if defined(AXON_AVX512) && defined(__AVX512BF16__)
  if (silu) bdot_rows<true>(x, wp, out);
  else bdot_rows<false>(x, wp, out);
#endif
  return out;
}

// dot_bf16's product (silu: gate_up_silu's) from block codes (qdot_rows): the same bits as dot_bf16
// over the bf16 weight the codes rebuild. codes: uint8 [NB, K/2, 16] (Q4_1) or int8 [NB, K/2, 32]
// (Q8_0); scales float16 [NB, K/32, 2, 16].
at::Tensor qdot_bf16(at::Tensor x, at::Tensor codes, at::Tensor scales, bool silu) {
  TORCH_CHECK(has_bf16_gemv(), "qdot_bf16 needs AVX512-BF16");
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1 && x.scalar_type() == at::kBFloat16, "x: [M, K] bfloat16, rows dense");
  const bool q4 = codes.scalar_type() == at::kByte;
  TORCH_CHECK(q4 || codes.scalar_type() == at::kChar, "codes: uint8 (Q4_1) or int8 (Q8_0)");
  TORCH_CHECK(codes.dim() == 3 && codes.is_contiguous() && codes.size(2) == (q4 ? 16 : 32), "codes: [NB, K/2, ",
              q4 ? 16 : 32, "]");
  const int64_t NB = codes.size(0), K2 = codes.size(1), M = x.size(0);
  TORCH_CHECK(x.size(1) == 2 * K2 && K2 % 16 == 0, "x has ", x.size(1), " columns, the codes ", 2 * K2,
              " (a multiple of 32)");
  TORCH_CHECK(scales.scalar_type() == at::kHalf && scales.is_contiguous() && scales.dim() == 4 &&
              scales.size(0) == NB && scales.size(1) == K2 / 16 && scales.size(2) == 2 && scales.size(3) == 16,
              "scales: float16 [NB, K/32, 2, 16]");
  TORCH_CHECK(M <= QDOT_ROWS, "qdot_bf16 takes 0..", QDOT_ROWS, " rows");
  TORCH_CHECK(!silu || NB % 2 == 0, "silu: I a multiple of 16");
  at::Tensor out = at::empty({M, silu ? NB / 2 * 16 : NB * 16}, x.options());
  if (M == 0) return out;
#if defined(AXON_AVX512) && defined(__AVX512BF16__)
  if (q4) silu ? qdot_rows<true, 4>(x, codes, scales, out) : qdot_rows<false, 4>(x, codes, scales, out);
  else silu ? qdot_rows<true, 8>(x, codes, scales, out) : qdot_rows<false, 8>(x, codes, scales, out);
#endif
  return out;
}

// GGUF block codes found in a float32 weight (layers/quant.py block_fit says why): every block of 32
// inputs of a row as fma(q, d, m) exactly, with float16 d and m. Q4 (Q4_1): m the block's minimum, d
// its span over 15, q 0..15; Q8 (Q8_0): d its largest magnitude over 127, m 0, q -127..127. With
// `ref`, each value's bf16 rounding must also be ref's bits (a code copy's bf16 weight).
namespace {
inline float f16_value(float x) { return static_cast<float>(c10::Half(x)); }  // RNE, as torch's .half()

inline uint16_t bf16_bits(float f) { return c10::BFloat16(f).x; }  // RNE, as .bfloat16() and vcvtne2ps2bf16

template <int BITS>
bool fit_block(const float* v, const uint16_t* ref, int8_t* q, float* d_out, float* m_out) {
  float lo = v[0], hi = v[0], amax = std::fabs(v[0]);
  for (int i = 1; i < 32; i++) {
    lo = std::min(lo, v[i]);
    hi = std::max(hi, v[i]);
    amax = std::max(amax, std::fabs(v[i]));
  }
  if (!std::isfinite(lo) || !std::isfinite(hi)) return false;
  const float d = f16_value(BITS == 4 ? (hi - lo) / 15.0f : amax / 127.0f), m = BITS == 4 ? lo : 0.0f;
  if (BITS == 4 && f16_value(lo) != lo) return false;
  const float qmin = BITS == 4 ? 0.0f : -127.0f, qmax = BITS == 4 ? 15.0f : 127.0f;
  float c[32];
  for (int i = 0; i < 32; i++)
    c[i] = d > 0.0f ? std::min(std::max(std::nearbyint((v[i] - m) / d), qmin), qmax) : 0.0f;
  for (int i = 0; i < 32; i++) {
    const float r = std::fma(c[i], d, m);
    if (r != v[i] || (ref && bf16_bits(r) != ref[i])) return false;
    q[i] = static_cast<int8_t>(c[i]);
  }
  *d_out = d;
  *m_out = m;
  return true;
}
}  // namespace

// (bits, q int8 [N, K], d, m float32 [N, K/32]): bits 4 when every block fits Q4, else 8 when every
// block fits Q8, else 0 (q, d, m then meaningless). N a multiple of 16 and K of 32, else 0.
std::tuple<int64_t, at::Tensor, at::Tensor, at::Tensor> fit_codes(at::Tensor w, std::optional<at::Tensor> ref) {
  TORCH_CHECK(w.dim() == 2 && w.scalar_type() == at::kFloat && w.is_contiguous(), "weight: contiguous float32 [N, K]");
  const int64_t N = w.size(0), K = w.size(1);
  const uint16_t* r = nullptr;
  if (ref.has_value() && ref->defined()) {
    TORCH_CHECK(ref->scalar_type() == at::kBFloat16 && ref->is_contiguous() && ref->sizes() == w.sizes(),
                "ref: contiguous bfloat16, the weight's shape");
    r = reinterpret_cast<const uint16_t*>(ref->data_ptr<at::BFloat16>());
  }
  const bool shaped = N > 0 && K > 0 && N % 16 == 0 && K % 32 == 0;
  at::Tensor q = at::empty({shaped ? N : 0, shaped ? K : 0}, at::kChar);
  at::Tensor d = at::empty({shaped ? N : 0, shaped ? K / 32 : 0}, at::kFloat), m = at::empty_like(d);
  if (!shaped) return {0, q, d, m};
  const float* v = w.data_ptr<float>();
  int8_t* qp = q.data_ptr<int8_t>();
  float *dp = d.data_ptr<float>(), *mp = m.data_ptr<float>();
  for (int bits : {4, 8}) {
    std::atomic<bool> ok{true};
    at::parallel_for(0, N, 16, [&](int64_t b, int64_t e) {
      for (int64_t row = b; row < e && ok.load(std::memory_order_relaxed); row++)
        for (int64_t j = 0; j < K / 32; j++) {
          const int64_t o = row * K + j * 32, s = row * (K / 32) + j;
          const uint16_t* rr = r ? r + o : nullptr;
          if (!(bits == 4 ? fit_block<4>(v + o, rr, qp + o, dp + s, mp + s)
                          : fit_block<8>(v + o, rr, qp + o, dp + s, mp + s))) {
            ok.store(false, std::memory_order_relaxed);
            break;
          }
        }
    });
    if (ok.load()) return {bits, q, d, m};
  }
  return {0, q, d, m};
}

// fit_codes' (q, d, m) of a bits-bit weight into qdot_bf16's layout: codes [N/16, K/2, 16] uint8
// (Q4: byte j of a K pair holds row j/2's code low, row 8 + j/2's high) or [N/16, K/2, 32] int8 (Q8:
// rows 0-7's 16 bytes, then rows 8-15's), vcvtne2ps2bf16's lane order; scales float16
// [N/16, K/32, 2 (d, m), 16].
std::tuple<at::Tensor, at::Tensor> pack_codes(at::Tensor q, at::Tensor d, at::Tensor m, int64_t bits) {
  TORCH_CHECK(bits == 4 || bits == 8, "bits: 4 or 8");
  TORCH_CHECK(q.dim() == 2 && q.scalar_type() == at::kChar && q.is_contiguous(), "q: contiguous int8 [N, K]");
  const int64_t N = q.size(0), K = q.size(1), G = N / 16, P = K / 2, B = K / 32;
  TORCH_CHECK(N % 16 == 0 && K % 32 == 0, "N a multiple of 16, K of 32");
  for (const at::Tensor& t : {d, m})
    TORCH_CHECK(t.scalar_type() == at::kFloat && t.is_contiguous() && t.dim() == 2 && t.size(0) == N && t.size(1) == B,
                "d, m: contiguous float32 [N, K/32]");
  const int W = bits == 4 ? 16 : 32;
  at::Tensor codes = at::empty({G, P, W}, bits == 4 ? at::kByte : at::kChar);
  at::Tensor scales = at::empty({G, B, 2, 16}, at::kHalf);
  const int8_t* qp = q.data_ptr<int8_t>();
  const float *dp = d.data_ptr<float>(), *mp = m.data_ptr<float>();
  uint8_t* cp = reinterpret_cast<uint8_t*>(codes.data_ptr());
  at::Half* sp = scales.data_ptr<at::Half>();
  at::parallel_for(0, G, 1, [&](int64_t g0, int64_t g1) {
    for (int64_t g = g0; g < g1; g++) {
      const int8_t* rows = qp + g * 16 * K;
      for (int64_t p = 0; p < P; p++) {
        uint8_t* out = cp + (g * P + p) * W;
        for (int j = 0; j < 16; j++) {
          const int64_t c = 2 * p + (j & 1);
          const uint8_t lo = static_cast<uint8_t>(rows[(j >> 1) * K + c]);
          const uint8_t hi = static_cast<uint8_t>(rows[(8 + (j >> 1)) * K + c]);
          if (bits == 4) {
            out[j] = static_cast<uint8_t>(lo | (hi << 4));
          } else {
            out[j] = lo;
            out[16 + j] = hi;
          }
        }
      }
      for (int64_t b = 0; b < B; b++)
        for (int r = 0; r < 16; r++) {
          sp[((g * B + b) * 2 + 0) * 16 + r] = at::Half(dp[(g * 16 + r) * B + b]);
          sp[((g * B + b) * 2 + 1) * 16 + r] = at::Half(mp[(g * 16 + r) * B + b]);
        }
    }
  });
  return {codes, scales};
}

// The most rows qdot_bf16 should take in place of skinny_bf16 (where that runs the dot-product loop,
// whose bits it has): QDOT_ROWS; 0 where AMX tiles take the bf16 weight (other bits) or there is no
// AVX512-BF16.
int64_t code_rows() {
#ifdef AXON_AMX
  if (amx_permitted()) return 0;
#endif
  return has_bf16_gemv() ? QDOT_ROWS : 0;
}

// The most rows skinny_bf16 should take for this packed weight: 128 with AMX (K a multiple of 32)
// or with AVX512-BF16 alone (dot_bf16: SmolLM2's decode linears from DRAM on a 2-core Zen 4 took
// 0.52x oneDNN's time at 1 row, 0.63x at 4-8, 0.79x at 32, 0.85x at 64, 0.96x at 128,
// docs/benchmarks.md#fig-zen4-dot); 0 without either. An int8 weight (skinny_int8) takes 64 with
// AMX, else 0.
int64_t skinny_rows(at::Tensor wp) {
  if (!has_bf16_gemv()) return 0;
  const bool int8 = wp.scalar_type() == at::kChar;
  if (amx_fits(wp)) return int8 ? AMX_INT8_MAX_ROWS : AMX_MAX_ROWS;
  return int8 ? 0 : DOT_MAX_ROWS;
}

// x @ W^T for 1..skinny_rows(wp) rows: through AMX tiles when the CPU has them (one row too:
// with weights cache-cold its 1 KiB tile loads stream ~20 % faster than the dot-product loop's
// 64-byte loads), else through the loop.
at::Tensor skinny_bf16(at::Tensor x, at::Tensor wp) {
  const int64_t M = x.size(0);
  check_skinny_args(x, wp);
  if (M == 0) return at::empty({0, wp.size(0) * 16}, x.options());  // a zero-row tile config is invalid
  if (!amx_fits(wp)) return dot_bf16(x, wp, false);
  TORCH_CHECK(M <= AMX_MAX_ROWS, "skinny_bf16 takes 1..", AMX_MAX_ROWS, " rows");
  at::Tensor out = at::empty({M, wp.size(0) * 16}, x.options());
#ifdef AXON_AMX
  amx_matmul(x, wp.data_ptr<bf16>(), nullptr, wp.size(0), wp.size(1), out);
#endif
  return out;
}

// silu(x @ Wg^T) * (x @ Wu^T) for 1..AMX_MAX_ROWS rows, W = [Wg; Wu] packed (pack_gemv_weight of
// gate_up_proj's weight): skinny_bf16 then silu_and_mul in one pass over the tiles, bit for bit
// (each accumulator rounded to bf16 first, then silu_and_mul's arithmetic), without writing and
// reading back the [M, 2I] product. On AMX tiles, else on AVX512-BF16's dot-product loop
// (bdot_rows); I a multiple of 16. On AMX a decode step 0.93-0.97x the time at 1-128 rows
// (docs/benchmarks.md#fig-gate-up-silu).
at::Tensor gate_up_silu(at::Tensor x, at::Tensor wp) {
  check_skinny_args(x, wp);
  TORCH_CHECK(has_bf16_gemv() && wp.size(0) % 2 == 0, "gate_up_silu needs AVX512-BF16 and I a multiple of 16");
  const int64_t M = x.size(0), NB = wp.size(0);
  TORCH_CHECK(M <= AMX_MAX_ROWS, "gate_up_silu takes 0..", AMX_MAX_ROWS, " rows");
  if (!amx_fits(wp)) return dot_bf16(x, wp, true);
  at::Tensor out = at::empty({M, NB / 2 * 16}, x.options());
#ifdef AXON_AMX
  if (M) amx_matmul<bf16, true>(x, wp.data_ptr<bf16>(), nullptr, NB, wp.size(1), out);
#endif
  return out;
}

// x @ (W * scales[:, None])^T for 0..AMX_INT8_MAX_ROWS rows with W int8 in the skinny layout (one
// symmetric scale per output column, layers/quant.py's int8): half the bytes of bf16 streamed.
// Each 512-byte B tile is widened to exact bf16 integers in L1 (b_tile, one K step ahead) and the
// scales multiply the float32 accumulators. AMX only. SmolLM2's 121 decode matmuls, cache-cold:
// 5.7 vs 9.9 ms for bf16 at 1 row, 8.7 vs 12.2 at 32.
at::Tensor skinny_int8(at::Tensor x, at::Tensor wp, at::Tensor scales) {
  check_skinny_args(x, wp, at::kChar);
  TORCH_CHECK(amx_fits(wp), "skinny_int8 needs AMX and K a multiple of 32");
  TORCH_CHECK(scales.scalar_type() == at::kFloat && scales.is_contiguous() && scales.numel() == wp.size(0) * 16,
              "scales: float32 [N]");
  const int64_t M = x.size(0);
  TORCH_CHECK(M <= AMX_INT8_MAX_ROWS, "skinny_int8 takes 0..", AMX_INT8_MAX_ROWS, " rows");
  at::Tensor out = at::empty({M, wp.size(0) * 16}, x.options());
  if (M == 0) return out;
#ifdef AXON_AMX
  amx_matmul(x, wp.data_ptr<int8_t>(), scales.data_ptr<float>(), wp.size(0), wp.size(1), out);
#endif
  return out;
}

// ------------------------------------------------------------------ fp8 weights
// x @ (W * scales[:, None])^T with W [N, K] float8_e4m3fn codes and one float32 scale per output
// row (`--quantization fp8`, layers/fp8.py). Up to FP8_SKINNY_ROWS rows stream the 1-byte codes and
// widen them in registers (fp8_bits), accumulating in float32 with the scale applied to the sum:
// half the bytes of a bf16 weight. Larger batches (long prefill chunks) dequantize the whole weight
// to x's dtype (code x scale, rounded once) and run torch's matmul; layers/fp8.py's torch fallback
// computes those same bits. On the 2-core AVX2 dev machine (no AVX512-BF16, so torch's bf16 matmul
// is slow) the skinny kernel beat the per-call dequantization at every size measured, 1-256 rows,
// bf16 and float32 ([3072, 576] weight: 256 rows 60 vs 192 ms bf16, 74 vs 95 ms float32).
constexpr int64_t FP8_SKINNY_ROWS = 256;

#if defined(__AVX2__) && defined(__FMA__) && !defined(AXON_AVX512)
inline __m256 fp8x8(const uint8_t* p) {
  const __m256i c = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
  const __m256i u = _mm256_or_si256(_mm256_slli_epi32(_mm256_and_si256(c, _mm256_set1_epi32(0x80)), 24),
                                    _mm256_slli_epi32(_mm256_and_si256(c, _mm256_set1_epi32(0x7F)), 20));
  return _mm256_mul_ps(_mm256_castsi256_ps(u), _mm256_set1_ps(0x1p120f));
}
inline float hsum8(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_add_ss(s, _mm_shuffle_ps(s, s, 1)));
}
#endif

// rows m0..m0+MB of xf (float32 [M, K]) against weight row wr: MB dot products
template <int MB>
inline void fp8_dot_rows(const float* xf, int64_t K, const uint8_t* wr, float* dots) {
  int64_t k = 0;
  float acc_s[MB] = {};
#if defined(AXON_AVX512)
  __m512 acc[MB];
  for (int m = 0; m < MB; ++m) acc[m] = _mm512_setzero_ps();
  for (; k + 16 <= K; k += 16) {
    const __m512 w = fp8_load16(wr + k, 20, 0x1p120f);
    for (int m = 0; m < MB; ++m) acc[m] = _mm512_fmadd_ps(_mm512_loadu_ps(xf + m * K + k), w, acc[m]);
  }
  for (int m = 0; m < MB; ++m) acc_s[m] = _mm512_reduce_add_ps(acc[m]);
#elif defined(__AVX2__) && defined(__FMA__)
  __m256 acc[MB];
  for (int m = 0; m < MB; ++m) acc[m] = _mm256_setzero_ps();
  for (; k + 8 <= K; k += 8) {
    const __m256 w = fp8x8(wr + k);
    for (int m = 0; m < MB; ++m) acc[m] = _mm256_fmadd_ps(_mm256_loadu_ps(xf + m * K + k), w, acc[m]);
  }
  for (int m = 0; m < MB; ++m) acc_s[m] = hsum8(acc[m]);
#endif
  for (; k < K; ++k) {
    const float w = to_f(fp8e4m3{wr[k]});
    for (int m = 0; m < MB; ++m) acc_s[m] += xf[m * K + k] * w;
  }
  for (int m = 0; m < MB; ++m) dots[m] = acc_s[m];
}

void check_fp8_weight(const at::Tensor& x, const at::Tensor& w, const at::Tensor& scales) {
  TORCH_CHECK(x.dim() == 2 && w.dim() == 2 && x.size(1) == w.size(1), "x [M, K], w [N, K]");
  TORCH_CHECK(w.scalar_type() == at::kFloat8_e4m3fn && w.is_contiguous(), "w: contiguous float8_e4m3fn");
  TORCH_CHECK(scales.scalar_type() == at::kFloat && scales.is_contiguous() && scales.numel() == w.size(0),
              "scales: float32 [N]");
}

// The skinny path for any row count (fp8_linear takes it up to FP8_SKINNY_ROWS).
at::Tensor skinny_fp8(at::Tensor x, at::Tensor w, at::Tensor scales) {
  check_fp8_weight(x, w, scales);
  const int64_t M = x.size(0), K = x.size(1), N = w.size(0);
  at::Tensor out = at::empty({M, N}, x.options());
  if (M == 0 || N == 0) return out;
  const at::Tensor xf = x.to(at::kFloat).contiguous();
  const float* xp = xf.data_ptr<float>();
  const uint8_t* wp = static_cast<const uint8_t*>(w.data_ptr());
  const float* sc = scales.data_ptr<float>();
  by_dtype(x.scalar_type(), "skinny_fp8", [&](auto tag) {
    using T = decltype(tag);
    T* op = out.data_ptr<T>();
    pool_for(0, N, serial_grain(K * std::min<int64_t>(M, 4), 16), [&](int64_t n0, int64_t n1) {
      float dots[4];
      for (int64_t n = n0; n < n1; ++n) {
        const uint8_t* wr = wp + n * K;
        int64_t m = 0;
        for (; m + 4 <= M; m += 4) {
          fp8_dot_rows<4>(xp + m * K, K, wr, dots);
          for (int i = 0; i < 4; ++i) op[(m + i) * N + n] = from_f<T>(dots[i] * sc[n]);
        }
        for (; m < M; ++m) {
          fp8_dot_rows<1>(xp + m * K, K, wr, dots);
          op[m * N + n] = from_f<T>(dots[0] * sc[n]);
        }
      }
    });
  });
  return out;
}

// x @ (W * scales[:, None])^T: the skinny kernel up to FP8_SKINNY_ROWS rows, else the dequantized weight.
at::Tensor fp8_linear(at::Tensor x, at::Tensor w, at::Tensor scales) {
  check_fp8_weight(x, w, scales);
  if (x.size(0) <= FP8_SKINNY_ROWS) return skinny_fp8(x, w, scales);
  return at::linear(x, (w.to(at::kFloat) * scales.unsqueeze(1)).to(x.scalar_type()));
}

// ------------------------------------------------------------------ panel matmul (float32, AVX2)
// y = x @ W^T for float32 x on AVX2 CPUs, AVX-512 ones included (layers/quant.py PanelWeight). MKL's
// float32 GEMM ran SmolLM2's decode matmuls at 7-80 GFLOP/s on the 2-core AMD EPYC (1-32 rows;
// ~190 peak): these register-blocked tiles run them at 27 (1 row: DRAM-bound) to 167 (32 rows),
// and prefill sizes at ~175-187 (docs/benchmarks.md#fig-panel-gemm). W [N, K] is stored once as
// [N/16, K, 16] panels (a 16-column strip per K step, streamed in order). A bf16 checkpoint served
// in float32 keeps its bf16 values (exact, half the bytes; widened in registers by one unpack with
// zeros), else the panels hold float32. Products accumulate in float32 over K in order.
#ifdef AXON_PANELS
// one K step of a panel: columns 0-7 and 8-15 as float32. bf16 panels are stored in the order
// _mm256_unpack{lo,hi}_epi16 takes 128-bit lanes apart in (pack_panels' permutation).
inline void panel_row(const bf16* p, __m256& lo, __m256& hi) {
  const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  lo = _mm256_castsi256_ps(_mm256_unpacklo_epi16(_mm256_setzero_si256(), v));
  hi = _mm256_castsi256_ps(_mm256_unpackhi_epi16(_mm256_setzero_si256(), v));
}
inline void panel_row(const float* p, __m256& lo, __m256& hi) {
  lo = _mm256_loadu_ps(p);
  hi = _mm256_loadu_ps(p + 8);
}

// A tile's accumulators: acc[2 (m NB + j) + h] holds rows m, panel j, columns 8h..8h+7.
template <int MR, int NB>
__attribute__((always_inline)) inline void tile_fma(__m256* acc, const float* x, int64_t xs, int64_t k, int j,
                                                    __m256 lo, __m256 hi) {
#pragma GCC unroll 8
  for (int m = 0; m < MR; ++m) {
    const __m256 b = _mm256_broadcast_ss(x + m * xs + k);
    acc[2 * (m * NB + j)] = _mm256_fmadd_ps(b, lo, acc[2 * (m * NB + j)]);
    acc[2 * (m * NB + j) + 1] = _mm256_fmadd_ps(b, hi, acc[2 * (m * NB + j) + 1]);
  }
}

template <int MR, int NB>
__attribute__((always_inline)) inline void tile_store(const __m256* acc, float* out, int64_t os) {
#pragma GCC unroll 8
  for (int m = 0; m < MR; ++m)
#pragma GCC unroll 8
    for (int j = 0; j < NB; ++j) {
      _mm256_storeu_ps(out + m * os + j * 16, acc[2 * (m * NB + j)]);
      _mm256_storeu_ps(out + m * os + j * 16 + 8, acc[2 * (m * NB + j) + 1]);
    }
}

// MR rows x NB panels: 2 MR NB accumulators (<= 12 of the 16 ymm registers), one broadcast per row
// and K step. A 1-D accumulator array: GCC keeps it in registers (a [MR][NB][2] one it spilled).
template <int MR, int NB, typename W>
inline void panel_tile(const float* x, int64_t xs, const W* w, int64_t K, float* out, int64_t os) {
  __m256 acc[2 * MR * NB];
#pragma GCC unroll 16
  for (int i = 0; i < 2 * MR * NB; ++i) acc[i] = _mm256_setzero_ps();
  for (int64_t k = 0; k < K; ++k) {
#pragma GCC unroll 8
    for (int j = 0; j < NB; ++j) {
      __m256 lo, hi;
      panel_row(w + j * K * 16 + k * 16, lo, hi);
      tile_fma<MR, NB>(acc, x, xs, k, j, lo, hi);
    }
  }
  tile_store<MR, NB>(acc, out, os);
}

template <typename W>
inline void panel_rows(int64_t r, const float* x, int64_t xs, const W* w, int64_t K, float* out, int64_t os) {
  switch (r) {
    case 1: panel_tile<1, 1>(x, xs, w, K, out, os); break;
    case 2: panel_tile<2, 1>(x, xs, w, K, out, os); break;
    case 3: panel_tile<3, 1>(x, xs, w, K, out, os); break;
    case 4: panel_tile<4, 1>(x, xs, w, K, out, os); break;
    case 5: panel_tile<5, 1>(x, xs, w, K, out, os); break;
    default: panel_tile<6, 1>(x, xs, w, K, out, os); break;
  }
}

// Where a tile's panels come from: stored as bf16 / float32 (read in place), or as block codes
// (a GGUF Q4_1 / Q8_0 weight re-encoded exactly at load, layers/quant.py): per output column and
// group of 32 K steps a float16 scale d and offset m, codes q in 4 bits (two columns a byte: col
// c low nibble, col c + 8 high) or signed 8 bits; w = fma(q, d, m) rebuilds the checkpoint's
// float32 values bit for bit (d q is exact, one rounding). Code panels are widened into a per-thread
// float32 buffer (L2) once per tile and reused by every row group.
template <typename W>
struct StoredPanels {
  using Elem = W;
  const W* w;
  int64_t K;
  const W* get(int64_t p, int64_t, float*) const { return w + p * K * 16; }
  int64_t buffer_floats(int64_t) const { return 0; }
};

// One K step of a code panel's 16 columns as floats (the codes, not yet scaled): low nibbles or
// bytes 0-7 are columns 0-7, high nibbles or bytes 8-15 columns 8-15.
template <int BITS>
inline void code_row_16(const uint8_t* c, int64_t k, __m256& lo, __m256& hi) {
  __m256i a, b;
  if constexpr (BITS == 4) {
    const __m256i v = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(c + k * 8)));
    a = _mm256_and_si256(v, _mm256_set1_epi32(0xF));
    b = _mm256_srli_epi32(v, 4);
  } else {
    const __m128i v = _mm_loadu_si128(reinterpret_cast<const __m128i*>(c + k * 16));
    a = _mm256_cvtepi8_epi32(v);
    b = _mm256_cvtepi8_epi32(_mm_srli_si128(v, 8));
  }
  lo = _mm256_cvtepi32_ps(a);
  hi = _mm256_cvtepi32_ps(b);
}

struct CodePanels {
  using Elem = float;
  const uint8_t* codes;
  const at::Half *d, *m;
  int64_t K, bits;
  int64_t buffer_floats(int64_t panels) const { return panels * K * 16; }
  const float* get(int64_t p0, int64_t n, float* buf) const {
    const int64_t G = K / 32, row_bytes = bits * 2;  // code bytes per K step: 8 (4-bit) or 16
    for (int64_t p = p0; p < p0 + n; ++p) {
      float* out = buf + (p - p0) * K * 16;
      const uint8_t* c = codes + p * K * row_bytes;
      for (int64_t g = 0; g < G; ++g) {
        const __m128i* dp = reinterpret_cast<const __m128i*>(d + (p * G + g) * 16);
        const __m128i* mp = reinterpret_cast<const __m128i*>(m + (p * G + g) * 16);
        const __m256 dlo = _mm256_cvtph_ps(_mm_loadu_si128(dp)), dhi = _mm256_cvtph_ps(_mm_loadu_si128(dp + 1));
        const __m256 mlo = _mm256_cvtph_ps(_mm_loadu_si128(mp)), mhi = _mm256_cvtph_ps(_mm_loadu_si128(mp + 1));
        for (int64_t k = g * 32; k < g * 32 + 32; ++k) {
          __m256 lo, hi;
          bits == 4 ? code_row_16<4>(c, k, lo, hi) : code_row_16<8>(c, k, lo, hi);
          _mm256_storeu_ps(out + k * 16, _mm256_fmadd_ps(lo, dlo, mlo));
          _mm256_storeu_ps(out + k * 16 + 8, _mm256_fmadd_ps(hi, dhi, mhi));
        }
      }
    }
    return buf;
  }
};

// 1-3 rows: several panels per tile (6 / 3 / 2) so that 12 accumulator chains hide the FMA latency.
template <typename Src>
void panel_few_rows(const float* x, int64_t M, int64_t K, const Src& src, int64_t NP, float* out) {
  using W = typename Src::Elem;
  const int64_t N = NP * 16, nb = M == 1 ? 6 : M == 2 ? 3 : 2;
  const int64_t chunks = (NP + nb - 1) / nb;
  pool_for(0, chunks, serial_grain(K * 16 * nb, 1), [&](int64_t c0, int64_t c1) {
    std::vector<float> buf(src.buffer_floats(nb));
    for (int64_t c = c0; c < c1; ++c) {
      const int64_t p = c * nb, left = std::min(nb, NP - p);
      const W* wp = src.get(p, left, buf.data());
      float* op = out + p * 16;
      if (left < nb) {
        for (int64_t q = 0; q < left; ++q) panel_rows(M, x, K, wp + q * K * 16, K, op + q * 16, N);
      } else if (M == 1) {
        panel_tile<1, 6>(x, K, wp, K, op, N);
      } else if (M == 2) {
        panel_tile<2, 3>(x, K, wp, K, op, N);
      } else {
        panel_tile<3, 2>(x, K, wp, K, op, N);
      }
    }
  });
}

// 4+ rows: per panel (in L1 while it is reused), rows in near-equal groups of <= 6; rows in
// blocks of PANEL_ROW_BLOCK so a block's activations stay in L2 across the panels.
constexpr int64_t PANEL_ROW_BLOCK = 192;
template <typename Src>
void panel_many_rows(const float* x, int64_t M, int64_t K, const Src& src, int64_t NP, float* out) {
  const int64_t N = NP * 16;
  for (int64_t m0 = 0; m0 < M; m0 += PANEL_ROW_BLOCK) {
    const int64_t MB = std::min(PANEL_ROW_BLOCK, M - m0), groups = (MB + 5) / 6;
    pool_for(0, NP, serial_grain(K * 16 * MB, 1), [&](int64_t p0, int64_t p1) {
      std::vector<float> buf(src.buffer_floats(1));
      for (int64_t p = p0; p < p1; ++p) {
        const auto* wp = src.get(p, 1, buf.data());
        int64_t m = m0;
        for (int64_t g = 0; g < groups; ++g) {
          const int64_t r = (m0 + MB - m) / (groups - g);
          panel_rows(r, x + m * K, K, wp, K, out + m * N + p * 16, N);
          m += r;
        }
      }
    });
  }
}

// Few rows against code panels: the weights are rebuilt in registers (no buffer round trip), the
// same fma(q, d, m) then the same products in the same K order as the buffered path. At a few rows
// the widening, not the bytes, bounds the step: the buffered path spent as long on a 1-row step as
// float32 panels did (docs/benchmarks.md#fig-panel-gemm).

template <int MR, int NB, int BITS>
void code_tile(const float* x, int64_t xs, const CodePanels& src, int64_t p0, float* out, int64_t os) {
  const int64_t K = src.K, G = K / 32, row_bytes = BITS * 2;
  __m256 acc[2 * MR * NB];
  for (int i = 0; i < 2 * MR * NB; ++i) acc[i] = _mm256_setzero_ps();
  for (int64_t g = 0; g < G; ++g) {
    __m256 dm[4 * NB];  // per panel: d lo, d hi, m lo, m hi
#pragma GCC unroll 8
    for (int j = 0; j < NB; ++j) {
      const int64_t at = ((p0 + j) * G + g) * 16;
      const __m128i* dp = reinterpret_cast<const __m128i*>(src.d + at);
      const __m128i* mp = reinterpret_cast<const __m128i*>(src.m + at);
      dm[4 * j] = _mm256_cvtph_ps(_mm_loadu_si128(dp));
      dm[4 * j + 1] = _mm256_cvtph_ps(_mm_loadu_si128(dp + 1));
      dm[4 * j + 2] = _mm256_cvtph_ps(_mm_loadu_si128(mp));
      dm[4 * j + 3] = _mm256_cvtph_ps(_mm_loadu_si128(mp + 1));
    }
    for (int64_t k = g * 32; k < g * 32 + 32; ++k) {
#pragma GCC unroll 8
      for (int j = 0; j < NB; ++j) {
        __m256 lo, hi;
        code_row_16<BITS>(src.codes + (p0 + j) * K * row_bytes, k, lo, hi);
        lo = _mm256_fmadd_ps(lo, dm[4 * j], dm[4 * j + 2]);
        hi = _mm256_fmadd_ps(hi, dm[4 * j + 1], dm[4 * j + 3]);
        tile_fma<MR, NB>(acc, x, xs, k, j, lo, hi);
      }
    }
  }
  tile_store<MR, NB>(acc, out, os);
}

// Rows in registers against code panels: up to CODE_REG_ROWS rows, in near-equal groups of <= 4
// per panel (each group rebuilds the panel's weights again); more rows go through the buffer.
constexpr int64_t CODE_REG_ROWS = 8;
template <int BITS>
void code_rows_1(int64_t r, const float* x, int64_t K, const CodePanels& src, int64_t p, float* out, int64_t N) {
  switch (r) {
    case 1: code_tile<1, 1, BITS>(x, K, src, p, out, N); break;
    case 2: code_tile<2, 1, BITS>(x, K, src, p, out, N); break;
    case 3: code_tile<3, 1, BITS>(x, K, src, p, out, N); break;
    default: code_tile<4, 1, BITS>(x, K, src, p, out, N); break;
  }
}

template <int BITS>
void code_few_rows(const float* x, int64_t M, const CodePanels& src, int64_t NP, float* out) {
  const int64_t K = src.K, N = NP * 16, nb = M == 1 ? 2 : 1, groups = (M + 3) / 4;
  pool_for(0, (NP + nb - 1) / nb, serial_grain(K * 16 * nb, 1), [&](int64_t c0, int64_t c1) {
    for (int64_t c = c0; c < c1; ++c) {
      const int64_t p = c * nb;
      if (M == 1 && p + 2 <= NP) {
        code_tile<1, 2, BITS>(x, K, src, p, out + p * 16, N);
        continue;
      }
      int64_t m = 0;
      for (int64_t g = 0; g < groups; ++g) {
        const int64_t r = (M - m) / (groups - g);
        code_rows_1<BITS>(r, x + m * K, K, src, p, out + m * N + p * 16, N);
        m += r;
      }
    }
  });
}

template <typename Src>
void panel_matmul(const float* x, int64_t M, int64_t K, const Src& src, int64_t NP, float* out) {
  if constexpr (std::is_same_v<Src, CodePanels>) {  // (few rows: in registers, never the buffer)
    if (M <= CODE_REG_ROWS) src.bits == 4 ? code_few_rows<4>(x, M, src, NP, out) : code_few_rows<8>(x, M, src, NP, out);
    else panel_many_rows(x, M, K, src, NP, out);
  } else {
    if (M <= 3) panel_few_rows(x, M, K, src, NP, out);
    else panel_many_rows(x, M, K, src, NP, out);
  }
}
#endif

bool has_panel_gemm() {
#ifdef AXON_PANELS
  return true;
#else
  return false;
#endif
}

// W [N, K] (N a multiple of 16) bf16 or float32 -> [N/16, K, 16] panels (bf16 in unpack order).
at::Tensor pack_panels(at::Tensor w) {
  TORCH_CHECK(w.dim() == 2 && w.size(0) % 16 == 0, "pack_panels: W [N, K] with N a multiple of 16");
  TORCH_CHECK(w.scalar_type() == at::kBFloat16 || w.scalar_type() == at::kFloat, "pack_panels: bf16 or float32");
  at::Tensor p = w.view({w.size(0) / 16, 16, w.size(1)}).transpose(1, 2);
  if (w.scalar_type() == at::kBFloat16) {
    // stored position -> column: each 128-bit lane's low 4 go to the `lo` vector, its high 4 to `hi`
    static const int64_t order[16] = {0, 1, 2, 3, 8, 9, 10, 11, 4, 5, 6, 7, 12, 13, 14, 15};
    p = p.index_select(2, at::tensor(c10::IntArrayRef(order, 16), at::kLong));
  }
  return p.contiguous();
}

at::Tensor panel_out(const at::Tensor& x, int64_t K, int64_t NP) {
  TORCH_CHECK(has_panel_gemm(), "panel_linear needs AVX2 + FMA");
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat, "panel_linear: x float32 [M, K]");
  TORCH_CHECK(x.size(1) == K, "panel_linear: panels with K = x.size(1)");
  return at::empty({x.size(0), NP * 16}, x.options());
}

// x [M, K] float32 @ panels^T -> [M, N] float32
at::Tensor panel_linear(at::Tensor x, at::Tensor wp) {
  TORCH_CHECK(wp.dim() == 3 && wp.size(2) == 16 && wp.is_contiguous() &&
                  (wp.scalar_type() == at::kBFloat16 || wp.scalar_type() == at::kFloat),
              "panel_linear: wp from pack_panels");
  const int64_t M = x.size(0), K = wp.size(1), NP = wp.size(0);
  at::Tensor out = panel_out(x, K, NP);
  if (M == 0 || NP == 0) return out;
  if (K == 0) return out.zero_();
#ifdef AXON_PANELS
  const at::Tensor xc = x.contiguous();
  auto run = [&](auto* w) {
    using W = std::remove_const_t<std::remove_pointer_t<decltype(w)>>;
    panel_matmul(xc.data_ptr<float>(), M, K, StoredPanels<W>{w, K}, NP, out.data_ptr<float>());
  };
  if (wp.scalar_type() == at::kBFloat16) run(static_cast<const bf16*>(wp.data_ptr()));
  else run(wp.data_ptr<float>());
#endif
  return out;
}

// The output of x @ W^T for block codes of NP panels and K inputs, once d and m fit them.
at::Tensor codes_out(const at::Tensor& x, int64_t NP, int64_t K, const at::Tensor& d, const at::Tensor& m) {
  TORCH_CHECK(K % 32 == 0, "codes: K a multiple of 32");
  for (const at::Tensor* t : {&d, &m})
    TORCH_CHECK(t->scalar_type() == at::kHalf && t->is_contiguous() && t->dim() == 3 && t->size(0) == NP &&
                    t->size(1) == K / 32 && t->size(2) == 16,
                "d, m: float16 [N/16, K/32, 16]");
  return panel_out(x, K, NP);
}

// x [M, K] float32 @ W^T with W as block codes: codes uint8 [N/16, K, 8] (4-bit) or int8
// [N/16, K, 16], d and m float16 [N/16, K/32, 16] (layers/quant.py block_codes).
at::Tensor panel_linear_codes(at::Tensor x, at::Tensor codes, at::Tensor d, at::Tensor m) {
  const bool four = codes.scalar_type() == at::kByte;
  TORCH_CHECK(codes.dim() == 3 && codes.is_contiguous() && codes.size(2) == (four ? 8 : 16) &&
                  (four || codes.scalar_type() == at::kChar),
              "codes: uint8 [N/16, K, 8] or int8 [N/16, K, 16]");
  const int64_t NP = codes.size(0), K = codes.size(1);
  at::Tensor out = codes_out(x, NP, K, d, m);
  const int64_t M = x.size(0);
  if (M == 0 || NP == 0) return out;
  if (K == 0) return out.zero_();
#ifdef AXON_PANELS
  const at::Tensor xc = x.contiguous();
  const CodePanels src{static_cast<const uint8_t*>(codes.data_ptr()), d.data_ptr<at::Half>(), m.data_ptr<at::Half>(),
                       K, four ? 4 : 8};
  panel_matmul(xc.data_ptr<float>(), M, K, src, NP, out.data_ptr<float>());
#endif
  return out;
}

// ------------------------------------------------------------------ integer dot products (opt-in)
// `--quantize-activations`: block-code weights (GGUF Q4_1 / Q8_0, above) times activations rounded
// to int8 per block of 32 inputs (d = max|x| / 127, q = round(x / d): llama.cpp's Q8_1), summed in
// integers: per block, out += d_w d_x sum(q_w q_x) + m_w d_x sum(q_x). Not bit-exact (the
// activations lose bits), so it is opt-in and `axonserve validate` bounds the drift. It spares the
// widening of every code to float32 that bounds code_tile (docs/benchmarks.md): vpmaddubsw
// multiplies 32 code / activation byte pairs in one instruction.
// Layout ("dot"): per panel of 16 columns and quad of 4 K steps, 32 bytes. 4-bit: byte 4c + i holds
// column c's code for K step 4t + i in its low nibble and column c + 8's in its high one; 8-bit:
// 64 bytes, columns 0-7 (4c + i) then columns 8-15. One load feeds a column's 4 K steps.
#ifdef AXON_PANELS
struct DotActs {  // x [M, K] as int8 codes q, per (row, block) scale d and d * sum(q)
  std::vector<int8_t> q;
  std::vector<float> d, s;
};

DotActs quantize_acts(const float* x, int64_t M, int64_t K) {
  const int64_t G = K / 32;
  DotActs a{std::vector<int8_t>(M * K), std::vector<float>(M * G), std::vector<float>(M * G)};
  // a block takes ~10 ns: below ~2,000 blocks (a 32-row step's inputs) waking the team costs more
  pool_for(0, M * G, serial_grain(16, 64), [&](int64_t b0, int64_t b1) {
    for (int64_t b = b0; b < b1; ++b) {
      const float* p = x + b * 32;  // blocks are contiguous: row b / G, block b % G
      const __m256 sign = _mm256_set1_ps(-0.f), inf = _mm256_set1_ps(INFINITY);
      __m256 v[4], mx = _mm256_setzero_ps(), bad = _mm256_setzero_ps();
      for (int i = 0; i < 4; ++i) {
        v[i] = _mm256_loadu_ps(p + 8 * i);
        const __m256 mag = _mm256_andnot_ps(sign, v[i]);
        mx = _mm256_max_ps(mx, mag);
        bad = _mm256_or_ps(bad, _mm256_cmp_ps(mag, inf, _CMP_NLT_UQ));  // NaN or +-inf
      }
      if (_mm256_movemask_ps(bad)) {  // a NaN scale: the row's outputs come out NaN, as the exact path's would
        std::memset(a.q.data() + b * 32, 0, 32);
        a.d[b] = a.s[b] = NAN;
        continue;
      }
      const float d = hmax8(mx) / 127.f, id = d > 0.f ? 1.f / d : 0.f;
      __m256i q[4];
      for (int i = 0; i < 4; ++i) q[i] = _mm256_cvtps_epi32(_mm256_mul_ps(v[i], _mm256_set1_ps(id)));  // to even
      const __m256i sum = _mm256_add_epi32(_mm256_add_epi32(q[0], q[1]), _mm256_add_epi32(q[2], q[3]));
      const __m128i s4 = _mm_add_epi32(_mm256_castsi256_si128(sum), _mm256_extracti128_si256(sum, 1));
      const __m128i s2 = _mm_add_epi32(s4, _mm_shuffle_epi32(s4, 0x4E));
      const int32_t total = _mm_cvtsi128_si32(_mm_add_epi32(s2, _mm_shuffle_epi32(s2, 0xB1)));
      // int32 -> int8 in order: packs interleave 128-bit lanes, each permute puts 64-bit chunks back
      const __m256i h01 = _mm256_permute4x64_epi64(_mm256_packs_epi32(q[0], q[1]), 0xD8);
      const __m256i h23 = _mm256_permute4x64_epi64(_mm256_packs_epi32(q[2], q[3]), 0xD8);
      const __m256i w8 = _mm256_permute4x64_epi64(_mm256_packs_epi16(h01, h23), 0xD8);
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(a.q.data() + b * 32), w8);
      a.d[b] = d;
      a.s[b] = d * float(total);
    }
  });
  return a;
}

// acc + per-4 sums of u8 x s8 products in int32 lanes: one VNNI instruction (vpdpbusd) where the
// CPU has it (AVX-VNNI, AVX512-VNNI), else vpmaddubsw then vpmaddwd (its int16 pair sums cannot
// saturate here: |w| <= 128 and |x| <= 127 or w <= 15). The same integers either way.
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
constexpr bool kVnni = true;
inline __m256i dot4_add(__m256i acc, __m256i u, __m256i s) { return _mm256_dpbusd_epi32(acc, u, s); }
#elif defined(__AVXVNNI__)
constexpr bool kVnni = true;
inline __m256i dot4_add(__m256i acc, __m256i u, __m256i s) { return _mm256_dpbusd_avx_epi32(acc, u, s); }
#else
constexpr bool kVnni = false;
inline __m256i dot4_add(__m256i acc, __m256i u, __m256i s) {
  return _mm256_add_epi32(acc, _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), _mm256_set1_epi16(1)));
}
#endif

// MR rows x NB panels against dot-layout codes; per block the int sums become floats once.
template <int MR, int NB, int BITS>
void dot_tile(const DotActs& a, int64_t row0, const uint8_t* codes, const at::Half* dp, const at::Half* mp, int64_t K,
              int64_t p0, float* out, int64_t os) {
  const int8_t* xq = a.q.data() + row0 * K;
  const int64_t G = K / 32, quad_bytes = BITS * 8;  // 32 (4-bit) or 64 (8-bit) bytes per panel quad
  const __m256i ones = _mm256_set1_epi16(1), low = _mm256_set1_epi8(0x0F);
  float facc[MR * NB * 16] = {};
  for (int64_t g = 0; g < G; ++g) {
    __m256i acc[2 * MR * NB];
#pragma GCC unroll 16
    for (int i = 0; i < 2 * MR * NB; ++i) acc[i] = _mm256_setzero_si256();
#pragma GCC unroll 8
    for (int t = 0; t < 8; ++t) {
#pragma GCC unroll 4
      for (int j = 0; j < NB; ++j) {
        const uint8_t* c = codes + (((p0 + j) * G + g) * 8 + t) * quad_bytes;
        const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(c));
        if constexpr (BITS == 4) {  // i16 sums of 8 quads stay below 2 * 8 * 15 * 127 < 2^15
          const __m256i lo = _mm256_and_si256(v, low), hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), low);
#pragma GCC unroll 8
          for (int m = 0; m < MR; ++m) {
            int32_t xb;
            std::memcpy(&xb, xq + m * K + g * 32 + t * 4, 4);
            const __m256i x4 = _mm256_set1_epi32(xb);
            __m256i &c0 = acc[2 * (m * NB + j)], &c1 = acc[2 * (m * NB + j) + 1];
            if constexpr (kVnni) {  // int32 sums at once
              c0 = dot4_add(c0, lo, x4);
              c1 = dot4_add(c1, hi, x4);
            } else {
              c0 = _mm256_add_epi16(c0, _mm256_maddubs_epi16(lo, x4));
              c1 = _mm256_add_epi16(c1, _mm256_maddubs_epi16(hi, x4));
            }
          }
        } else {  // signed codes: |w| times x with w's sign; pairs to i32 every quad (i16 would overflow)
          const __m256i v2 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(c + 32));
          const __m256i a1 = _mm256_abs_epi8(v), a2 = _mm256_abs_epi8(v2);
#pragma GCC unroll 8
          for (int m = 0; m < MR; ++m) {
            int32_t xb;
            std::memcpy(&xb, xq + m * K + g * 32 + t * 4, 4);
            const __m256i x4 = _mm256_set1_epi32(xb);
            acc[2 * (m * NB + j)] = dot4_add(acc[2 * (m * NB + j)], a1, _mm256_sign_epi8(x4, v));
            acc[2 * (m * NB + j) + 1] = dot4_add(acc[2 * (m * NB + j) + 1], a2, _mm256_sign_epi8(x4, v2));
          }
        }
      }
    }
#pragma GCC unroll 4
    for (int j = 0; j < NB; ++j) {
      const int64_t at = ((p0 + j) * G + g) * 16;
      const __m256 d0 = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(dp + at)));
      const __m256 d1 = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(dp + at + 8)));
      __m256 m0 = _mm256_setzero_ps(), m1 = _mm256_setzero_ps();
      if constexpr (BITS == 4) {
        m0 = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(mp + at)));
        m1 = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(mp + at + 8)));
      }
#pragma GCC unroll 8
      for (int m = 0; m < MR; ++m) {
        const int64_t b = (row0 + m) * G + g;
        const __m256 xd = _mm256_set1_ps(a.d[b]);
        __m256i s0 = acc[2 * (m * NB + j)], s1 = acc[2 * (m * NB + j) + 1];
        if constexpr (BITS == 4 && !kVnni) { s0 = _mm256_madd_epi16(s0, ones); s1 = _mm256_madd_epi16(s1, ones); }
        float* f = facc + (m * NB + j) * 16;
        __m256 f0 = _mm256_fmadd_ps(_mm256_cvtepi32_ps(s0), _mm256_mul_ps(d0, xd), _mm256_loadu_ps(f));
        __m256 f1 = _mm256_fmadd_ps(_mm256_cvtepi32_ps(s1), _mm256_mul_ps(d1, xd), _mm256_loadu_ps(f + 8));
        if constexpr (BITS == 4) {
          const __m256 xs = _mm256_set1_ps(a.s[b]);
          f0 = _mm256_fmadd_ps(m0, xs, f0);
          f1 = _mm256_fmadd_ps(m1, xs, f1);
        }
        _mm256_storeu_ps(f, f0);
        _mm256_storeu_ps(f + 8, f1);
      }
    }
  }
  for (int m = 0; m < MR; ++m)
    for (int j = 0; j < NB; ++j) std::memcpy(out + m * os + j * 16, facc + (m * NB + j) * 16, 16 * sizeof(float));
}

template <int BITS>
void dot_rows(int64_t r, const DotActs& a, int64_t row0, const uint8_t* codes, const at::Half* d, const at::Half* m,
              int64_t K, int64_t p, float* out, int64_t N) {
  switch (r) {
    case 1: dot_tile<1, 1, BITS>(a, row0, codes, d, m, K, p, out, N); break;
    case 2: dot_tile<2, 1, BITS>(a, row0, codes, d, m, K, p, out, N); break;
    case 3: dot_tile<3, 1, BITS>(a, row0, codes, d, m, K, p, out, N); break;
    default: dot_tile<4, 1, BITS>(a, row0, codes, d, m, K, p, out, N); break;
  }
}

// One row: 4 panels a tile (8 integer accumulators); more rows: per panel (in L1 while reused),
// rows in near-equal groups of <= 4, in blocks of PANEL_ROW_BLOCK rows.
template <int BITS>
void dot_matmul(const DotActs& a, int64_t M, int64_t K, const uint8_t* codes, const at::Half* d, const at::Half* m,
                int64_t NP, float* out) {
  const int64_t N = NP * 16;
  if (M == 1) {
    constexpr int64_t nb = 4;
    pool_for(0, (NP + nb - 1) / nb, serial_grain(K * 16 * nb, 1), [&](int64_t c0, int64_t c1) {
      for (int64_t c = c0; c < c1; ++c) {
        const int64_t p = c * nb;
        if (p + nb <= NP) dot_tile<1, nb, BITS>(a, 0, codes, d, m, K, p, out + p * 16, N);
        else for (int64_t q = p; q < NP; ++q) dot_rows<BITS>(1, a, 0, codes, d, m, K, q, out + q * 16, N);
      }
    });
    return;
  }
  for (int64_t m0 = 0; m0 < M; m0 += PANEL_ROW_BLOCK) {
    const int64_t MB = std::min(PANEL_ROW_BLOCK, M - m0), groups = (MB + 3) / 4;
    pool_for(0, NP, serial_grain(K * 16 * MB, 1), [&](int64_t p0, int64_t p1) {
      for (int64_t p = p0; p < p1; ++p) {
        int64_t r0 = m0;
        for (int64_t g = 0; g < groups; ++g) {
          const int64_t r = (m0 + MB - r0) / (groups - g);
          dot_rows<BITS>(r, a, r0, codes, d, m, K, p, out + r0 * N + p * 16, N);
          r0 += r;
        }
      }
    });
  }
}
#endif

// Block codes from block_codes' panels ([N/16, K, 8] uint8 | [N/16, K, 16] int8) -> the dot layout
// ([N/16, K/4, 32 | 64] uint8).
at::Tensor pack_dot_codes(at::Tensor codes) {
  const bool four = codes.scalar_type() == at::kByte;
  TORCH_CHECK(codes.dim() == 3 && codes.size(2) == (four ? 8 : 16) && (four || codes.scalar_type() == at::kChar) &&
                  codes.size(1) % 32 == 0,
              "pack_dot_codes: uint8 [N/16, K, 8] or int8 [N/16, K, 16] with K a multiple of 32");
  const int64_t NP = codes.size(0), K = codes.size(1);
  // [NP, K/4, 4, C] -> [NP, K/4, C, 4]: a column's 4 K steps side by side
  at::Tensor t = codes.view({NP, K / 4, 4, codes.size(2)}).transpose(2, 3);
  if (!four) t = t.reshape({NP, K / 4, 2, 8, 4});  // columns 0-7, then 8-15
  return t.contiguous().view(at::kByte).reshape({NP, K / 4, four ? 32 : 64});
}

// x [M, K] float32 @ W^T with W as dot-layout codes (pack_dot_codes) and block_codes' d, m (8-bit
// codes: m is not read; PanelWeight refuses 8-bit codes with an offset). A block of x holding a NaN
// or an infinity makes its row's outputs NaN.
at::Tensor dot_linear_codes(at::Tensor x, at::Tensor codes, at::Tensor d, at::Tensor m) {
  TORCH_CHECK(codes.dim() == 3 && codes.is_contiguous() && codes.scalar_type() == at::kByte &&
                  (codes.size(2) == 32 || codes.size(2) == 64),
              "codes: uint8 [N/16, K/4, 32 | 64] from pack_dot_codes");
  const int64_t NP = codes.size(0), K = codes.size(1) * 4;
  at::Tensor out = codes_out(x, NP, K, d, m);
  const int64_t M = x.size(0);
  if (M == 0 || NP == 0) return out;
#ifdef AXON_PANELS
  const at::Tensor xc = x.contiguous();
  const DotActs a = quantize_acts(xc.data_ptr<float>(), M, K);
  const auto* c = static_cast<const uint8_t*>(codes.data_ptr());
  if (codes.size(2) == 32) dot_matmul<4>(a, M, K, c, d.data_ptr<at::Half>(), m.data_ptr<at::Half>(), NP, out.data_ptr<float>());
  else dot_matmul<8>(a, M, K, c, d.data_ptr<at::Half>(), m.data_ptr<at::Half>(), NP, out.data_ptr<float>());
#endif
  return out;
}

// ------------------------------------------------------------------ decoder stack
// A Llama-family decoder (dense MLP, no per-head norms, one rank) run layer by layer here instead
// of from Python: the same kernels, in the same order, with the same roundings as the Python
// modules (models/llama.py), so outputs are bit-identical; what goes is ~15 Python-dispatched calls
// per layer (~150 us of interpreter and dispatch per layer on this machine, ~4.5 ms of a 30-layer
// SmolLM2 step at any batch size).

// oneDNN's bf16 matmul (x [M, K] contiguous, w reordered by mkldnn::_reorder_linear_weight).
at::Tensor onednn_call(const at::Tensor& x, const at::Tensor& w) {
  static const c10::OperatorHandle op = c10::Dispatcher::singleton().findSchemaOrThrow("mkldnn::_linear_pointwise", "");
  std::vector<c10::IValue> s{x, w, c10::IValue(), c10::IValue(std::string("none")),
                             c10::IValue(c10::List<c10::optional<at::Scalar>>()), c10::IValue(std::string(""))};
  op.callBoxed(&s);
  return s.back().toTensor();
}

// The same product with x's rows split between the threads, each slice one oneDNN call on one
// thread (oneDNN runs sequentially inside a parallel region). The slices are cut in the calling
// thread: views of an inference tensor are made where InferenceMode is on.
at::Tensor onednn_row_split(const at::Tensor& x, const at::Tensor& w) {
  const int64_t M = x.size(0), T = at::get_num_threads();
  std::vector<at::Tensor> xs(T), ys(T);
  for (int64_t t = 0; t < T; ++t) xs[t] = x.narrow(0, M * t / T, M * (t + 1) / T - M * t / T);
  at::parallel_for(0, T, 1, [&](int64_t b, int64_t e) {
    for (int64_t t = b; t < e; ++t) ys[t] = onednn_call(xs[t], w);
  });
  return at::cat(ys, 0);
}

// oneDNN (3.x, torch's) threads some bf16 products poorly: at 2 threads SmolLM2's down_proj
// (K 1,536, N 576) runs at one thread's speed for 384..1,280 rows and at twice that from 1,344,
// qkv (N 960) at 768..1,024 rows (docs/benchmarks.md#fig-onednn-rows). Which row counts is
// oneDNN's blocking choice, not predictable here, so the first product of each (K, N, 64-row
// bucket, threads) measures: it runs once each way untimed (each builds its oneDNN primitives for
// these row counts, ~3x a product's time), then three times each way alternating; where the
// split's best time beats oneDNN's by over 30 %, the bucket's next product measures again (three
// each), and the bucket keeps the rows split between the threads only if that agrees (misthreaded
// shapes ran 1.4-1.7x faster split; where oneDNN threads well it is ~1.1-1.4x faster than the
// split; one measurement at a 20 % margin let this machine's noise make 2,048-row buckets pick the
// split). The measured products are computed eight (and six) times; later ones once. The two
// ways accumulate in other orders: bf16 results within one rounding of each other.
// AXONSERVE_ONEDNN_SPLIT=0 never splits, =force always does (where it may: tests, A/B).
constexpr int64_t SPLIT_MIN_SLICE = 128;  // rows per thread below which the split is not tried
constexpr int64_t SPLIT_BUCKET = 64;      // rows: products of one bucket share the choice
// Products above this keep oneDNN's own threading unmeasured: the misthreaded ones seen are up to
// 2.3 GFLOP, and measuring computes a product eight times (a vocabulary head's 50-100 ms ones,
// which oneDNN threads well: 1.8-2x at 2 threads from 256 rows).
constexpr double SPLIT_MAX_MEASURED_FLOP = 4e9;

// AXONSERVE_ONEDNN_SPLIT (read per call: a product takes ms): 0 never split, 1 always, -1 measure
int split_mode() {
  const char* env = std::getenv("AXONSERVE_ONEDNN_SPLIT");
  const std::string mode = env ? env : "";
  return mode == "0" || mode == "false" || mode == "no" ? 0 : mode == "force" ? 1 : -1;
}

// Each (K, N, row bucket, threads)'s choice, made by its first products
enum SplitWay : int { UNKNOWN = -1, ONEDNN = 0, SPLIT = 1, SPLIT_ONCE = 2 };  // SPLIT_ONCE: to be confirmed
using SplitKey = std::tuple<int64_t, int64_t, int64_t, int64_t>;
std::mutex split_mu;
std::map<SplitKey, int> split_ways;

SplitKey split_key(int64_t K, int64_t N, int64_t M) { return {K, N, M / SPLIT_BUCKET, at::get_num_threads()}; }

// Whether a product of this shape is one whose way is measured (else oneDNN's own threading)
bool split_measured(int64_t M, int64_t K, int64_t N) {
  const int64_t T = at::get_num_threads();
  return T >= 2 && M >= SPLIT_MIN_SLICE * T && 2.0 * M * K * N <= SPLIT_MAX_MEASURED_FLOP;
}

int split_way(const SplitKey& key) {
  std::lock_guard<std::mutex> g(split_mu);
  const auto it = split_ways.find(key);
  return it == split_ways.end() ? UNKNOWN : it->second;
}

at::Tensor onednn_linear(const at::Tensor& x, const at::Tensor& w) {
  const int64_t M = x.size(0), T = at::get_num_threads();
  if (x.dim() != 2 || T < 2 || M < SPLIT_MIN_SLICE * T || at::in_parallel_region()) return onednn_call(x, w);
  const int mode = split_mode();
  if (mode == 0) return onednn_call(x, w);
  if (mode == 1) return onednn_row_split(x, w);
  if (!split_measured(M, x.size(1), w.size(0))) return onednn_call(x, w);
  const SplitKey key = split_key(x.size(1), w.size(0), M);
  const int known = split_way(key);
  auto run = [&](int way) { return way == SPLIT ? onednn_row_split(x, w) : onednn_call(x, w); };
  if (known == ONEDNN || known == SPLIT) return run(known);
  if (known == UNKNOWN) {  // this bucket's primitives
    run(ONEDNN);
    run(SPLIT);
  }
  double best[2] = {1e30, 1e30};
  at::Tensor y[2];
  for (int rep = 0; rep < 3; ++rep)
    for (int way = 0; way < 2; ++way) {
      const auto t0 = std::chrono::steady_clock::now();
      y[way] = run(way);
      best[way] = std::min(best[way], std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
    }
  const bool split = best[0] > 1.3 * best[1];
  {
    std::lock_guard<std::mutex> g(split_mu);
    split_ways[key] = !split ? ONEDNN : known == SPLIT_ONCE ? SPLIT : SPLIT_ONCE;
  }
  return y[split];
}

// onednn_linear's choice for every row bucket of this weight up to max_rows, made now (start-up:
// the runner's warm-up) instead of in the first served product of each bucket, whose measurement
// computes it 8-14 times (SmolLM2's down_proj: ~16x a product's time; a 32-stream wave's prefill
// paid it in its TTFT). Each bucket is run twice: the second confirms a split. Returns the
// products run.
int64_t onednn_settle(const at::Tensor& w, int64_t max_rows) {
  const int64_t T = at::get_num_threads(), K = w.size(1), N = w.size(0);
  const int64_t first = SPLIT_MIN_SLICE * T / SPLIT_BUCKET, last = max_rows / SPLIT_BUCKET;
  if (T < 2 || last < first || split_mode() != -1) return 0;
  const at::Tensor x = at::randn({std::min(max_rows, last * SPLIT_BUCKET + SPLIT_BUCKET / 2), K}).to(at::kBFloat16);
  int64_t runs = 0;
  for (int64_t b = first; b <= last; ++b) {
    const int64_t M = std::min(max_rows, b * SPLIT_BUCKET + SPLIT_BUCKET / 2);
    if (M / SPLIT_BUCKET != b || !split_measured(M, K, N)) continue;
    for (int rep = 0; rep < 2; ++rep, ++runs) onednn_linear(x.narrow(0, 0, M), w);
  }
  return runs;
}

// AXONSERVE_GATE_UP_SILU=0: the decoder stack keeps gate_up and silu_and_mul apart (A/B runs; the
// same bits either way), read when a stack is built
bool gate_up_fusion() {
  const char* e = std::getenv("AXONSERVE_GATE_UP_SILU");
  const std::string v = e ? e : "";
  return !(v == "0" || v == "false" || v == "no");
}

// One projection as the Python layer runs it (layers/linear.py `linear`, layers/quant.py).
struct StackLinear {
  enum Kind : int64_t { DENSE = 0, PACKED = 1, INT8 = 2, INT4 = 3, FP8 = 4, PANEL = 5, DOT = 6 };
  int64_t kind = DENSE;
  at::Tensor w;     // dense weight | oneDNN-packed bf16 | int8 / int4 packed data | float32 x panels
  at::Tensor aux;   // PACKED: the skinny copy (bf16, or int8 with `scales`; may be empty); INT8 / INT4 / FP8: scales;
                    // PANEL: block codes' d (with `scales` their m; empty: stored panels); DOT: likewise
  at::Tensor bias;  // may be undefined
  int64_t rows = 0;   // PACKED: the most rows the skinny copy takes
  int64_t group = 0;  // INT4: input columns per scale
  at::Tensor scales;  // PACKED with an int8 skinny copy: its float32 column scales
  at::Tensor codes, code_scales;  // PACKED: the bf16 weight as block codes (qdot_bf16; may be empty)
                                  // (set only where code_rows() > 0: steps of up to QDOT_ROWS rows)

  // The most rows x may have for this projection to run on the kernels' own loops only (no oneDNN,
  // no torch op large enough for OpenMP's team: ATen splits elementwise ops from 32,768 elements)
  int64_t own_rows() const {
    const int64_t any = std::numeric_limits<int64_t>::max();
    const int64_t with_bias = bias.defined() ? 32768 / std::max<int64_t>(bias.numel(), 1) : any;  // y + bias
    switch (kind) {
      case PACKED: return std::min(rows, with_bias);
      case FP8: return std::min({FP8_SKINNY_ROWS, 32768 / w.size(1), with_bias});  // skinny_fp8's x.to(float)
      case PANEL:
      case DOT: return with_bias;
      default: return 0;
    }
  }

  at::Tensor operator()(const at::Tensor& x) const {
    at::Tensor y;
    switch (kind) {
      case DENSE:
        if (x.size(0) == 1 && x.scalar_type() == at::kBFloat16)  // linear(): one bf16 row through mv
          y = at::mv(w, x[0]).unsqueeze(0);
        else
          return at::linear(x, w, bias.defined() ? c10::optional<at::Tensor>(bias) : c10::nullopt);
        break;
      case PACKED:
        if (codes.defined() && x.size(0) <= QDOT_ROWS && x.stride(1) == 1) y = qdot_bf16(x, codes, code_scales, false);
        else if (x.size(0) > rows) y = onednn_linear(x.contiguous(), w);
        else y = aux.scalar_type() == at::kChar ? skinny_int8(x, aux, scales) : skinny_bf16(x, aux);
        break;
      case INT8: y = at::_weight_int8pack_mm(x.to(aux.scalar_type()), w, aux); break;
      case FP8: y = fp8_linear(x, w, aux); break;
      case PANEL: y = aux.defined() && aux.numel() ? panel_linear_codes(x, w, aux, scales) : panel_linear(x, w); break;
      case DOT: y = dot_linear_codes(x, w, aux, scales); break;
      default: y = at::_weight_int4pack_mm_for_cpu(x.to(aux.scalar_type()), w, group, aux); break;
    }
    return bias.defined() ? y + bias : y;
  }

  // silu_and_mul of this projection (gate_up_proj): in one pass (gate_up_silu, the same bits) where
  // its skinny copy is bf16 (AMX or AVX512-BF16) without a bias and takes the rows; else the product, then
  // silu_and_mul. (Prompt rows keep oneDNN: an AMX pass like amx_rows32's over L2-sized column
  // groups ran at oneDNN's speed, so fusing there bought nothing; docs/benchmarks.md#fig-gate-up-silu.)
  at::Tensor silu_mul(const at::Tensor& x) const {
    if (silu_fused && codes.defined() && x.size(0) <= QDOT_ROWS && x.stride(1) == 1)
      return qdot_bf16(x, codes, code_scales, true);
    if (silu_fused && x.size(0) <= rows && x.stride(1) == 1) return gate_up_silu(x, aux);
    return silu_and_mul((*this)(x));
  }
  bool silu_fused = false;  // set by DecoderStack for gate_up_proj (fusable())
  bool fusable() const {
    return kind == PACKED && !bias.defined() && aux.defined() && aux.numel() && aux.scalar_type() == at::kBFloat16 &&
           has_bf16_gemv() && aux.size(0) % 2 == 0;
  }
};

struct DecoderStack {
  struct Layer {
    at::Tensor in_norm, post_norm;
    StackLinear qkv, o, gate_up, down;
  };
  int64_t Hq, Hkv, D;
  double eps, scale;
  at::Tensor final_norm, cos, sin;
  std::vector<Layer> layers;
  std::vector<at::Tensor> k_caches, v_caches;
  std::vector<c10::optional<at::Tensor>> k_scales, v_scales;  // int8 caches' scales (else none)
  std::vector<int64_t> windows;  // per layer: its sliding window (0: none); empty: none anywhere
  int64_t pool_rows = std::numeric_limits<int64_t>::max();  // steps of up to this many rows run on the pool

  DecoderStack(int64_t hq, int64_t hkv, int64_t d, double eps_, double scale_, at::Tensor final_norm_, at::Tensor cos_,
               at::Tensor sin_)
      : Hq(hq), Hkv(hkv), D(d), eps(eps_), scale(scale_), final_norm(final_norm_), cos(cos_), sin(sin_) {}

  // linears: (kind, w, aux, bias, rows, group, scales, codes, code scales) for qkv, o, gate_up, down;
  // empty tensors stand for none
  void add_layer(at::Tensor in_norm, at::Tensor post_norm, std::vector<int64_t> kinds, std::vector<at::Tensor> w,
                 std::vector<at::Tensor> aux, std::vector<at::Tensor> bias, std::vector<int64_t> rows,
                 std::vector<int64_t> group, std::vector<at::Tensor> scales, std::vector<at::Tensor> codes,
                 std::vector<at::Tensor> code_scales) {
    TORCH_CHECK(kinds.size() == 4 && w.size() == 4 && aux.size() == 4 && bias.size() == 4 && rows.size() == 4 &&
                group.size() == 4 && scales.size() == 4 && codes.size() == 4 && code_scales.size() == 4,
                "add_layer: four linears (qkv, o, gate_up, down)");
    StackLinear lin[4];
    for (int i = 0; i < 4; ++i) {
      TORCH_CHECK(kinds[i] >= StackLinear::DENSE && kinds[i] <= StackLinear::DOT, "unknown linear kind ", kinds[i]);
      lin[i] = StackLinear{kinds[i], w[i], aux[i], bias[i].numel() ? bias[i] : at::Tensor(), rows[i], group[i],
                           scales[i]};
      if (kinds[i] == StackLinear::PACKED && codes[i].numel() && code_rows()) {
        lin[i].codes = codes[i];
        lin[i].code_scales = code_scales[i];
      }
    }
    lin[2].silu_fused = lin[2].fusable() && gate_up_fusion();
    layers.push_back(Layer{in_norm, post_norm, lin[0], lin[1], lin[2], lin[3]});
    for (const StackLinear& l : lin) pool_rows = std::min(pool_rows, l.own_rows());
  }

  // ks / vs: each int8 cache's scales (empty lists for bf16 / float32 caches)
  void set_caches(std::vector<at::Tensor> k, std::vector<at::Tensor> v, std::vector<at::Tensor> ks,
                  std::vector<at::Tensor> vs) {
    TORCH_CHECK(k.size() == layers.size() && v.size() == layers.size(), "one K and one V cache per layer");
    TORCH_CHECK(ks.size() == vs.size() && (ks.empty() || ks.size() == k.size()), "scales for every layer or none");
    k_caches = std::move(k);
    v_caches = std::move(v);
    k_scales.assign(k_caches.size(), c10::nullopt);
    v_scales.assign(k_caches.size(), c10::nullopt);
    for (size_t l = 0; l < ks.size(); ++l) { k_scales[l] = ks[l]; v_scales[l] = vs[l]; }
  }

  void set_windows(std::vector<int64_t> w) {
    TORCH_CHECK(w.size() == layers.size(), "one window per layer (0: none)");
    windows = std::move(w);
  }

  // x: [T, hidden] embedded tokens, every row attending through paged_attention (decodes, short
  // chunks); returns the final-norm hidden states (without a final norm: the residual stream). The
  // residual stream is updated in place by the fused add + RMSNorm, as LlamaDecoderLayer's
  // `h + mlp` then the next layer's norm would.
  at::Tensor forward(at::Tensor x, at::Tensor positions, at::Tensor slots, at::Tensor block_table, at::Tensor row_seq,
                     at::Tensor row_kv_len, c10::optional<at::Tensor> row_extra) {
    TORCH_CHECK(x.dim() == 2 && !layers.empty() && k_caches.size() == layers.size(), "forward: caches not set");
    const int64_t T = x.size(0);
    PoolScope scope(T <= pool_rows);  // thread_pool.h: a step of the kernels' own loops runs on their pool
    at::Tensor h = x.contiguous().clone();  // the residual stream
    at::Tensor add;                          // what the next norm adds into h first
    for (size_t l = 0; l < layers.size(); ++l) {
      const Layer& L = layers[l];
      at::Tensor n = at::empty_like(h);
      rms_norm(n, add.defined() ? add : h, add.defined() ? c10::optional<at::Tensor>(h) : c10::nullopt, L.in_norm, eps);
      at::Tensor qkv = L.qkv(n).view({T, Hq + 2 * Hkv, D});
      rotary_kv_write(qkv, Hq, Hkv, cos, sin, positions, k_caches[l], v_caches[l], slots, k_scales[l], v_scales[l]);
      at::Tensor attn = at::empty({T, Hq, D}, h.options());
      paged_attention(attn, qkv.narrow(1, 0, Hq), k_caches[l], v_caches[l], block_table, row_seq, row_kv_len, scale,
                      k_scales[l], v_scales[l], row_extra, windows.empty() ? 0 : windows[l]);
      at::Tensor o = L.o(attn.view({T, Hq * D}));
      at::Tensor n2 = at::empty_like(h);
      rms_norm(n2, o, h, L.post_norm, eps);
      add = L.down(L.gate_up.silu_mul(n2));
    }
    if (final_norm.numel() == 0) return h.add_(add);  // no final norm (an EAGLE head's layer)
    at::Tensor out = at::empty_like(h);
    rms_norm(out, add, h, final_norm, eps);
    return out;
  }
};

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  pybind11::class_<DecoderStack>(m, "DecoderStack", "a Llama-family decoder stack run in C++ (models/fused.py)")
      .def(pybind11::init<int64_t, int64_t, int64_t, double, double, at::Tensor, at::Tensor, at::Tensor>())
      .def("add_layer", &DecoderStack::add_layer)
      .def("set_caches", &DecoderStack::set_caches)
      .def("set_windows", &DecoderStack::set_windows)
      .def("gate_up_fused", [](const DecoderStack& d) { return !d.layers.empty() && d.layers[0].gate_up.silu_fused; },
           "whether gate_up and silu_and_mul run as one pass (gate_up_silu) in this stack")
      .def("forward", &DecoderStack::forward, pybind11::arg("x"), pybind11::arg("positions"), pybind11::arg("slots"),
           pybind11::arg("block_table"), pybind11::arg("row_seq"), pybind11::arg("row_kv_len"),
           pybind11::arg("row_extra") = pybind11::none(), pybind11::call_guard<pybind11::gil_scoped_release>());
  m.def("paged_attention", &paged_attention, "paged attention, rows against their sequences' KV blocks",
        pybind11::arg("out"), pybind11::arg("q"), pybind11::arg("k_cache"), pybind11::arg("v_cache"),
        pybind11::arg("block_table"), pybind11::arg("row_seq"), pybind11::arg("row_kv_len"), pybind11::arg("scale"),
        pybind11::arg("k_scale") = pybind11::none(), pybind11::arg("v_scale") = pybind11::none(),
        pybind11::arg("row_extra") = pybind11::none(), pybind11::arg("window") = 0);
  m.def("amx_attention", &amx_attention, "paged_attention takes bf16 prefill chunks on AMX tiles at this head_dim");
  m.def("chunk_attention", &chunk_attention,
        "paged_attention takes bf16 prefill chunks itself at this head_dim (AMX tiles or AVX512-BF16)");
  m.def("rotary_kv_write", &rotary_kv_write, "rotary on Q/K heads in place + K/V cache write (int8: quantized)",
        pybind11::arg("qkv"), pybind11::arg("hq"), pybind11::arg("hkv"), pybind11::arg("cos"), pybind11::arg("sin"),
        pybind11::arg("positions"), pybind11::arg("k_cache"), pybind11::arg("v_cache"), pybind11::arg("slots"),
        pybind11::arg("k_scale") = pybind11::none(), pybind11::arg("v_scale") = pybind11::none());
  m.def("rms_norm", &rms_norm, "(residual add +) RMSNorm");
  m.def("silu_and_mul", &silu_and_mul, "SiLU(gate) * up");
  m.def("argmax_rows", &argmax_rows, "row-wise argmax, first index of a tie");
  m.def("topk_logprobs", &topk_logprobs, "per row: the k largest logits' log-softmax values and indices");
  m.def("sample_rows", &sample_rows, "one inverse-CDF draw per row from softmax(x * inv_temp); inv_temp <= 0: argmax");
  m.def("set_thread_pool", [](bool on) { axpool_enable(on); },
        "the kernels' loops on their own pool where a scope asks (thread_pool.h; default on, AXONSERVE_POOL=0 off)");
  m.def("pool_loops", &axpool_loops, "loops the kernels' pool has run in this process");
  m.def("pool_spin_us", &axpool_spin_us, "how long the pool's members spin after a loop (AXONSERVE_POOL_SPIN_US, bounded)");
  m.def("pool_scope", [](bool on) { return axpool_scope(on); },
        "this thread's kernel loops on the pool (as the decoder stack's small steps); returns the previous setting");
  m.def("has_bf16_gemv", &has_bf16_gemv, "dot_bf16 is compiled in (AVX512-BF16)");
  m.def("pack_gemv_weight", &pack_gemv_weight, "bf16 [N, K] weight into the skinny kernels' layout");
  m.def("skinny_rows", &skinny_rows, "the most rows skinny_bf16 takes for this packed weight");
  m.def("pack_int8_weight", &pack_int8_weight, "int8 [N, K] weight into skinny_int8's layout");
  m.def("skinny_int8", &skinny_int8, "x @ (W * scales)^T for 0..64 bf16 rows, W int8 packed (AMX)");
  m.def("onednn_settle", &onednn_settle, "onednn_linear's split choice for every row bucket up to max_rows, now");
  m.def("onednn_split_choice", [](int64_t K, int64_t N, int64_t M) { return split_way(split_key(K, N, M)); },
        "onednn_linear's choice for this shape at this thread count: -1 not made, 0 oneDNN, 1 split, 2 split once");
  m.def("onednn_linear", &onednn_linear, "x @ W^T through oneDNN's bf16 matmul (W reordered), rows split where that is faster",
        pybind11::call_guard<pybind11::gil_scoped_release>());
  m.def("gate_up_silu", &gate_up_silu, "silu(x @ Wg^T) * (x @ Wu^T) for 1..128 rows, W = [Wg; Wu] packed (AMX, or AVX512-BF16)");
  m.def("dot_bf16", &dot_bf16, "x @ W^T for 0..128 rows on AVX512-BF16's dot-product loop (skinny_bf16 without AMX); "
        "silu: gate_up_silu's product", py::arg("x"), py::arg("wp"), py::arg("silu") = false);
  m.def("fit_codes", &fit_codes, "(bits, q, d, m): the GGUF Q4_1 / Q8_0 block codes that rebuild a float32 weight "
        "exactly (and, given ref, its bf16 rounding bit for bit); bits 0: none", py::arg("w"),
        py::arg("ref") = std::nullopt);
  m.def("pack_codes", &pack_codes, "fit_codes' (q, d, m) into qdot_bf16's (codes, scales)", py::arg("q"),
        py::arg("d"), py::arg("m"), py::arg("bits"));
  m.def("code_rows", &code_rows, "the most rows qdot_bf16 takes in place of skinny_bf16 on this CPU (0: none)");
  m.def("qdot_bf16", &qdot_bf16, "dot_bf16's product (silu: gate_up_silu's) with the weight rebuilt from Q4_1 / "
        "Q8_0 block codes in registers, bit for bit", py::arg("x"), py::arg("codes"), py::arg("scales"),
        py::arg("silu") = false);
  m.def("skinny_bf16", &skinny_bf16, "x @ W^T for 1..skinny_rows rows: AMX tiles, else the dot-product loop");
  m.def("skinny_fp8", &skinny_fp8, "x @ (W * scales)^T, W float8_e4m3fn [N, K] widened in registers");
  m.def("fp8_linear", &fp8_linear, "x @ (W * scales)^T: skinny_fp8 up to FP8_SKINNY_ROWS rows, else dequantized");
  m.def("has_panel_gemm", &has_panel_gemm, "panel_linear is compiled in (AVX2 + FMA)");
  m.def("pack_panels", &pack_panels, "bf16 / float32 [N, K] weight into panel_linear's [N/16, K, 16] panels");
  m.def("panel_linear", &panel_linear, "float32 x @ W^T with W in panels (bf16 widened in registers)");
  m.def("panel_linear_codes", &panel_linear_codes, "float32 x @ W^T with W as 4- / 8-bit block codes in panels");
  m.def("pack_dot_codes", &pack_dot_codes, "block codes' panels into dot_linear_codes' layout");
  m.def("dot_linear_codes", &dot_linear_codes, "x @ W^T: block codes times int8 activations (opt-in, approximate)");
  m.attr("FP8_SKINNY_ROWS") = FP8_SKINNY_ROWS;
}
