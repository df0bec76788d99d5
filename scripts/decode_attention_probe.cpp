// What bounds decode attention at 128 rows: the per-row kernel's arithmetic, the reads, or both.
//
// One thread runs SmolLM2's decode attention shape (128 rows x 161 keys, 3 KV heads of 64 dims with
// 3 query heads each, bf16 cache in 16-slot blocks in random order, 30 layers' caches cycled: 474 MB)
// the way attend_item_vec does (csrc/cpu_kernels.cpp: each (row, KV head) item widens 16 keys to
// float32, FMAs, one transposed reduction; softmax; values widened and FMA'd), in variants:
//   fma     that kernel's arithmetic;
//   dpbf16  the same passes on vdpbf16ps (bf16 pairs straight from the cache, P rounded to bf16);
//   read    the same rows read (K with the kernel's prefetches, then V), no arithmetic.
// With --resident every row's blocks are drawn from 64 blocks (768 KB of K and V: in L2), which
// leaves the arithmetic alone. docs/benchmarks.md#fig-decode-attention-bound.
//
//   g++ -O3 -march=native -ffp-contract=off scripts/decode_attention_probe.cpp -o /tmp/probe
//   for m in fma dpbf16 read; do /tmp/probe $m; /tmp/probe $m --resident; done
#include <immintrin.h>

#include "../axonserve/neuron/ops/csrc/avx512_math.h"  // exp16, reduce16x16: the kernels' own

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <string>
#include <vector>

using bf = uint16_t;
constexpr int R = 128, L = 161, HKV = 3, G = 3, D = 64, BS = 16, LAYERS = 30, PER = (L + BS - 1) / BS;

static __m512 widen16(const bf* p) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i*)p)), 16));
}

static const bf *kc, *vc;
static __m512 sink;

static void prefetch_row(const bf* p) {
  _mm_prefetch((const char*)p, _MM_HINT_T0);
  _mm_prefetch((const char*)(p + 32), _MM_HINT_T0);
}

// softmax over each query head's L scores in place; returns the sums (probabilities unnormalised)
static void softmax(float* sc, float* sums) {
  for (int g = 0; g < G; ++g) {
    float* s = sc + g * L;
    __m512 vm = _mm512_set1_ps(-INFINITY);
    int i = 0;
    for (; i + 16 <= L; i += 16) vm = _mm512_max_ps(vm, _mm512_loadu_ps(s + i));
    float m = _mm512_reduce_max_ps(vm);
    for (; i < L; ++i) m = std::max(m, s[i]);
    float sum = 0;
    for (i = 0; i + 16 <= L; i += 16) {
      const __m512 e = exp16(_mm512_sub_ps(_mm512_loadu_ps(s + i), _mm512_set1_ps(m)));
      _mm512_storeu_ps(s + i, e);
      sum += _mm512_reduce_add_ps(e);
    }
    for (; i < L; ++i) sum += (s[i] = std::exp(s[i] - m));
    sums[g] = sum;
  }
}

// one (row, KV head) item: off = its keys' element offsets, q = its G query heads, out = G x D
template <bool DP>
static void item(const int64_t* off, const bf* q, float* out) {
  alignas(64) float sc[G * L + 16], kb[16 * D], qs[G * D], sums[G];
  for (int j = 0; j < G * D; ++j) {
    uint32_t u = uint32_t(q[j]) << 16;
    std::memcpy(qs + j, &u, 4);
    qs[j] *= 0.125f;
  }
  for (int i = 0; i < 32; ++i) prefetch_row(kc + off[i]);
  for (int t = 0; t < L; t += 16) {
    const int nk = std::min(16, L - t);
    for (int i = t + 32; i < std::min(t + 48, L); ++i) prefetch_row(kc + off[i]);
    for (int i = t; i < t + nk; ++i) prefetch_row(vc + off[i]);
    if (!DP)
      for (int i = 0; i < nk; ++i)
        for (int c = 0; c < 4; ++c) _mm512_store_ps(kb + i * D + 16 * c, widen16(kc + off[t + i] + 16 * c));
    for (int g = 0; g < G; ++g) {
      __m512 acc[16];
      for (int i = 0; i < 16; ++i) {
        const int ti = i < nk ? i : 0;  // (a short last block repeats a key; its scores are not kept)
        if (DP) {
          const bf* k = kc + off[t + ti];
          acc[i] = _mm512_dpbf16_ps(_mm512_setzero_ps(), (__m512bh)_mm512_loadu_si512(q + g * D),
                                    (__m512bh)_mm512_loadu_si512(k));
          acc[i] = _mm512_dpbf16_ps(acc[i], (__m512bh)_mm512_loadu_si512(q + g * D + 32),
                                    (__m512bh)_mm512_loadu_si512(k + 32));
        } else {
          acc[i] = _mm512_mul_ps(_mm512_loadu_ps(qs + g * D), _mm512_load_ps(kb + ti * D));
          for (int c = 1; c < 4; ++c)
            acc[i] = _mm512_fmadd_ps(_mm512_loadu_ps(qs + g * D + 16 * c), _mm512_load_ps(kb + ti * D + 16 * c), acc[i]);
        }
      }
      alignas(64) float dots[16];
      _mm512_store_ps(dots, _mm512_mul_ps(reduce16x16(acc), _mm512_set1_ps(DP ? 0.125f : 1.f)));
      std::memcpy(sc + g * L + t, dots, nk * 4);
    }
  }
  softmax(sc, sums);
  __m512 acc[G][4];
  for (auto& a : acc)
    for (auto& x : a) x = _mm512_setzero_ps();
  if (DP) {  // two keys' values interleaved into bf16 pairs, times (p_t, p_t+1) as bf16
    alignas(64) uint16_t pb[G][L + 1];
    for (int g = 0; g < G; ++g) {
      for (int i = 0; i < L; ++i) {
        uint32_t u;
        std::memcpy(&u, sc + g * L + i, 4);
        pb[g][i] = uint16_t((u + 0x7FFF + ((u >> 16) & 1)) >> 16);
      }
      pb[g][L] = 0;
    }
    for (int t = 0; t < L; t += 2) {
      __m512i lo[2], hi[2];
      for (int c = 0; c < 2; ++c) {
        const __m512i v0 = _mm512_loadu_si512(vc + off[t] + 32 * c);
        const __m512i v1 = t + 1 < L ? _mm512_loadu_si512(vc + off[t + 1] + 32 * c) : _mm512_setzero_si512();
        lo[c] = _mm512_unpacklo_epi16(v0, v1);
        hi[c] = _mm512_unpackhi_epi16(v0, v1);
      }
      for (int g = 0; g < G; ++g) {
        uint32_t w;
        std::memcpy(&w, &pb[g][t], 4);
        const __m512bh p = (__m512bh)_mm512_set1_epi32(int(w));
        for (int c = 0; c < 2; ++c) {
          acc[g][2 * c] = _mm512_dpbf16_ps(acc[g][2 * c], (__m512bh)lo[c], p);
          acc[g][2 * c + 1] = _mm512_dpbf16_ps(acc[g][2 * c + 1], (__m512bh)hi[c], p);
        }
      }
    }
  } else {
    for (int t = 0; t < L; ++t) {
      __m512 v[4];
      for (int c = 0; c < 4; ++c) v[c] = widen16(vc + off[t] + 16 * c);
      for (int g = 0; g < G; ++g) {
        const __m512 p = _mm512_set1_ps(sc[g * L + t]);
        for (int c = 0; c < 4; ++c) acc[g][c] = _mm512_fmadd_ps(p, v[c], acc[g][c]);
      }
    }
  }
  for (int g = 0; g < G; ++g)
    for (int c = 0; c < 4; ++c) _mm512_storeu_ps(out + g * D + 16 * c, _mm512_mul_ps(acc[g][c], _mm512_set1_ps(1.f / sums[g])));
}

static void read_item(const int64_t* off) {  // the same rows, no arithmetic
  __m512i a = _mm512_setzero_si512();
  for (int i = 0; i < 32; ++i) prefetch_row(kc + off[i]);
  for (int t = 0; t < L; t += 16) {
    const int nk = std::min(16, L - t);
    for (int i = t + 32; i < std::min(t + 48, L); ++i) prefetch_row(kc + off[i]);
    for (int i = t; i < t + nk; ++i) prefetch_row(vc + off[i]);
    for (int i = t; i < t + nk; ++i)
      a = _mm512_xor_si512(a, _mm512_xor_si512(_mm512_loadu_si512(kc + off[i]), _mm512_loadu_si512(kc + off[i] + 32)));
  }
  for (int t = 0; t < L; ++t)
    a = _mm512_xor_si512(a, _mm512_xor_si512(_mm512_loadu_si512(vc + off[t]), _mm512_loadu_si512(vc + off[t] + 32)));
  sink = _mm512_add_ps(sink, _mm512_castsi512_ps(a));
}

int main(int argc, char** argv) {
  const std::string mode = argc > 1 ? argv[1] : "fma";
  const bool resident = argc > 2 && std::string(argv[2]) == "--resident";
  if (mode != "fma" && mode != "dpbf16" && mode != "read") {
    std::fprintf(stderr, "usage: %s fma|dpbf16|read [--resident]\n", argv[0]);
    return 2;
  }
  const size_t blocks = size_t(PER) * R * LAYERS, n = blocks * BS * HKV * D;
  bf* k = static_cast<bf*>(std::aligned_alloc(4096, n * 2));
  bf* v = static_cast<bf*>(std::aligned_alloc(4096, n * 2));
  std::mt19937 rng(1);
  for (size_t i = 0; i < n; ++i) {  // values in [0.5, 1): finite, no denormals
    k[i] = bf(0x3f00 + (rng() & 0xff));
    v[i] = bf(0x3f00 + (rng() & 0xff));
  }
  kc = k;
  vc = v;
  std::vector<bf> q(size_t(R) * HKV * G * D);
  for (auto& x : q) x = bf(0x3f00 + (rng() & 0xff));
  std::vector<float> out(size_t(R) * HKV * G * D);
  std::vector<int64_t> offs(size_t(LAYERS) * R * HKV * L);  // [layer][row][KV head][key]
  for (int l = 0; l < LAYERS; ++l) {
    std::vector<int> perm(PER * R);
    for (int i = 0; i < PER * R; ++i) perm[i] = l * PER * R + i;
    std::shuffle(perm.begin(), perm.end(), rng);
    for (int r = 0; r < R; ++r)
      for (int h = 0; h < HKV; ++h)
        for (int t = 0; t < L; ++t) {
          const int64_t b = resident ? perm[r * PER + t / BS] % 64 : perm[r * PER + t / BS];
          offs[((size_t(l) * R + r) * HKV + h) * L + t] = ((b * BS + t % BS) * HKV + h) * D;
        }
  }
  std::vector<double> ms;
  for (int rep = 0; rep < 7; ++rep) {
    const auto t0 = std::chrono::steady_clock::now();
    for (int l = 0; l < LAYERS; ++l)
      for (int r = 0; r < R; ++r)
        for (int h = 0; h < HKV; ++h) {
          const int64_t* off = offs.data() + ((size_t(l) * R + r) * HKV + h) * L;
          const size_t at = (size_t(r) * HKV + h) * G * D;
          if (mode == "read") read_item(off);
          else if (mode == "dpbf16") item<true>(off, q.data() + at, out.data() + at);
          else item<false>(off, q.data() + at, out.data() + at);
        }
    ms.push_back(std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count() / LAYERS);
  }
  std::sort(ms.begin(), ms.end());
  std::printf("%-6s %-10s %.3f ms per layer [%.3f, %.3f] (1 thread, median of 7)\n", mode.c_str(),
              resident ? "resident" : "from DRAM", ms[3], ms[0], ms[6]);
  return 0;
}
