// What bounds decode attention at 128 rows: the per-row kernel's arithmetic, the reads, or both.
//
// One thread runs SmolLM2's decode attention shape (128 rows x 161 keys, 3 KV heads of 64 dims with
// 3 query heads each, bf16 cache in 16-slot blocks in random order, 30 layers' caches cycled: 474 MB)
// the way attend_item_vec does (csrc/cpu_kernels.cpp: each (row, KV head) item widens 16 keys to
// float32, FMAs, one transposed reduction; softmax; values widened and FMA'd), in variants:
//   fma     that kernel's arithmetic;
//   dpbf16  the same passes on vdpbf16ps (bf16 pairs straight from the cache, P rounded to bf16);
//   read    the same rows read (K with the kernel's prefetches, then V), no arithmetic;
//   amx     on AMX tiles: S^T = K Q^T (A = 16 key rows straight from the cache, B = the G query
//           heads as columns), then P V with P as bf16 and V pre-laid as bf16 key pairs (a cache
//           layout that does not exist: the bound of packing nothing);
//   amxpack the same with each block's 16 value rows paired on the fly (unpack lo / hi);
//   amxsplit amxpack with P in two bf16 parts (hi + lo): float32 precision, as the per-row kernel;
//   check   the three AMX items' outputs against fma's (a few rows).
// With --resident every row's blocks are drawn from 64 blocks (768 KB of K and V: in L2), which
// leaves the arithmetic alone. docs/benchmarks.md#fig-decode-attention-bound, #fig-decode-tiles.
//
//   g++ -O3 -march=native -ffp-contract=off scripts/decode_attention_probe.cpp -o /tmp/probe
//   for m in fma dpbf16 read amx amxpack amxsplit; do /tmp/probe $m; /tmp/probe $m --resident; done
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
#include <sys/syscall.h>
#include <unistd.h>

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

// ---- AMX item: S^T = K Q^T (A tiles straight from the cache rows), P V on tiles with V as bf16
// pairs of keys (VNNI): VN = true reads them pre-laid in memory (a cache layout), false packs each
// block's 16 value rows on the fly (unpack lo/hi: dims permuted within 128-bit lanes; undone at the end)
struct TileCfg { uint8_t palette, start; uint8_t rsv[14]; uint16_t colsb[16]; uint8_t rows[16]; };
static void amx_setup() {
  if (syscall(SYS_arch_prctl, 0x1023, 18) != 0) { std::perror("arch_prctl"); std::exit(1); }
  TileCfg c{};
  c.palette = 1;
  for (int t = 0; t < 5; ++t) { c.colsb[t] = 64; c.rows[t] = 16; }
  c.colsb[5] = 32; c.rows[5] = 16;  // P: 16 rows (G valid) x 16 keys bf16
  c.colsb[6] = 64; c.rows[6] = 8;   // V: 8 key pairs x 16 dims x 2
  _tile_loadconfig(&c);
}
static const bf* vn;  // V in the VNNI layout: per (block, KV head) [slice 4][pair 8][32 bf16]
// a key's (block, KV head) in the pre-laid values, from its cache offset
static inline const bf* vn_block(int64_t off) {
  const int64_t e = off / D, h = e % HKV, b = e / HKV / BS;
  return vn + (b * HKV + h) * BS * D;
}
static inline int dim_of(int c, int n) { return (c >> 1) * 32 + (n >> 2) * 8 + (c & 1) * 4 + (n & 3); }

// O (tiles 0..3, one per 16-dim value slice) += P (tile 5) x V (each slice through tile 6)
static inline void pv_tiles(const uint16_t* p, const bf* v) {
  _tile_loadd(5, p, 32);
  _tile_loadd(6, v, 64);
  _tile_dpbf16ps(0, 5, 6);
  _tile_loadd(6, v + 256, 64);
  _tile_dpbf16ps(1, 5, 6);
  _tile_loadd(6, v + 512, 64);
  _tile_dpbf16ps(2, 5, 6);
  _tile_loadd(6, v + 768, 64);
  _tile_dpbf16ps(3, 5, 6);
}

template <bool VN, bool SPLIT = false>
static void amx_item(const int64_t* off, const bf* q, float* out) {
  alignas(64) uint32_t qt[2][16 * 16] = {};
  alignas(64) float sbuf[16 * 16], sc[G * L + 16], sums[G], ob[4][16 * 16];
  alignas(64) uint16_t pbuf[16 * 16] = {}, pbuf2[16 * 16] = {};
  alignas(64) bf vbuf[4 * 8 * 32];
  for (int r = 0; r < 16; ++r)  // Q^T as B tiles: row r = dims (2r, 2r+1) of each head (column n)
    for (int n = 0; n < G; ++n) {
      qt[0][r * 16 + n] = reinterpret_cast<const uint32_t*>(q + n * D)[r];
      qt[1][r * 16 + n] = reinterpret_cast<const uint32_t*>(q + n * D + 32)[r];
    }
  _tile_loadd(3, qt[0], 64);
  _tile_loadd(4, qt[1], 64);
  const __m512i gidx = _mm512_mullo_epi32(_mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0),
                                          _mm512_set1_epi32(16));
  for (int i = 0; i < 32 && i < L; ++i) prefetch_row(kc + off[i]);
  for (int t = 0; t < L; t += 16) {
    const int nk = std::min(16, L - t);
    for (int i = t + 32; i < std::min(t + 48, L); ++i) prefetch_row(kc + off[i]);
    if (VN) {
      const char* vb = reinterpret_cast<const char*>(vn_block(off[t]));
      for (int z = 0; z < 2048; z += 64) _mm_prefetch(vb + z, _MM_HINT_T0);
    } else {
      for (int i = t; i < t + nk; ++i) prefetch_row(vc + off[i]);
    }
    _tile_zero(0);  // (a last group of < 16 keys reads its block's other slots: scores not kept)
    _tile_loadd(1, kc + off[t], HKV * D * 2);
    _tile_loadd(2, kc + off[t] + 32, HKV * D * 2);
    _tile_dpbf16ps(0, 1, 3);
    _tile_dpbf16ps(0, 2, 4);
    _tile_stored(0, sbuf, 64);
    for (int g = 0; g < G; ++g) {
      const __m512 s = _mm512_mul_ps(_mm512_i32gather_ps(_mm512_add_epi32(gidx, _mm512_set1_epi32(g)), sbuf, 4),
                                     _mm512_set1_ps(0.125f));
      _mm512_mask_storeu_ps(sc + g * L + t, __mmask16((1u << nk) - 1), s);
    }
  }
  softmax(sc, sums);
  _tile_zero(0);
  _tile_zero(1);
  _tile_zero(2);
  _tile_zero(3);
  for (int t = 0; t < L; t += 16) {
    const int nk = std::min(16, L - t);
    for (int g = 0; g < G; ++g) {
      const __m512 p = _mm512_maskz_loadu_ps(__mmask16((1u << nk) - 1), sc + g * L + t);
      const __m256i hi = (__m256i)_mm512_cvtneps_pbh(p);
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(pbuf + g * 16), hi);
      if (SPLIT) {
        const __m512 hif = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(hi), 16));
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(pbuf2 + g * 16), (__m256i)_mm512_cvtneps_pbh(_mm512_sub_ps(p, hif)));
      }
    }
    const bf* src;
    if (VN) {
      src = vn_block(off[t]);
    } else {
      for (int p = 0; p < 8; ++p) {
        const bf* r0 = vc + off[t + std::min(2 * p, nk - 1)];
        const bf* r1 = vc + off[t + std::min(2 * p + 1, nk - 1)];
        for (int c = 0; c < 2; ++c) {
          const __m512i a = _mm512_loadu_si512(r0 + 32 * c), b = _mm512_loadu_si512(r1 + 32 * c);
          _mm512_store_si512(vbuf + ((2 * c) * 8 + p) * 32, _mm512_unpacklo_epi16(a, b));
          _mm512_store_si512(vbuf + ((2 * c + 1) * 8 + p) * 32, _mm512_unpackhi_epi16(a, b));
        }
      }
      src = vbuf;
    }
    pv_tiles(pbuf, src);
    if (SPLIT) pv_tiles(pbuf2, src);
  }
  _tile_stored(0, ob[0], 64);
  _tile_stored(1, ob[1], 64);
  _tile_stored(2, ob[2], 64);
  _tile_stored(3, ob[3], 64);
  for (int g = 0; g < G; ++g)
    for (int c = 0; c < 4; ++c)
      for (int n = 0; n < 16; ++n) out[g * D + dim_of(c, n)] = ob[c][g * 16 + n] / sums[g];
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
  if (mode != "fma" && mode != "dpbf16" && mode != "read" && mode != "amx" && mode != "amxpack" && mode != "check" && mode != "amxsplit") {
    std::fprintf(stderr, "usage: %s fma|dpbf16|read|amx|amxpack|amxsplit|check [--resident]\n", argv[0]);
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
  // V pre-laid as VNNI pairs (the amx mode's cache layout): per (block, KV head) [slice][pair][32]
  bf* vv = static_cast<bf*>(std::aligned_alloc(4096, n * 2));
  for (size_t b = 0; b < blocks; ++b)
    for (int h = 0; h < HKV; ++h)
      for (int c = 0; c < 4; ++c)
        for (int p = 0; p < 8; ++p)
          for (int w = 0; w < 16; ++w)
            for (int e = 0; e < 2; ++e)
              vv[(b * HKV + h) * BS * D + (c * 8 + p) * 32 + 2 * w + e] = v[((b * BS + 2 * p + e) * HKV + h) * D + dim_of(c, w)];
  vn = vv;
  if (mode == "amx" || mode == "amxpack" || mode == "amxsplit" || mode == "check") amx_setup();
  if (mode == "check") {  // the AMX items against the float32 one, a few rows
    std::vector<float> o1(G * D), o2(G * D), o3(G * D);
    double worst = 0, worst3 = 0;
    for (int r = 0; r < 8; ++r)
      for (int h = 0; h < HKV; ++h) {
        const int64_t* off = offs.data() + (size_t(r) * HKV + h) * L;
        const bf* qq = q.data() + (size_t(r) * HKV + h) * G * D;
        item<false>(off, qq, o1.data());
        amx_item<true>(off, qq, o2.data());
        amx_item<false, true>(off, qq, o3.data());
        for (int j = 0; j < G * D; ++j) {
          worst = std::max(worst, double(std::fabs(o1[j] - o2[j])));
          worst3 = std::max(worst3, double(std::fabs(o1[j] - o3[j])));
        }
      }
    std::printf("check: max |fma - amx| = %.3g (P as bf16), |fma - amxsplit| = %.3g (outputs ~0.75)\n", worst, worst3);
    return 0;
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
          else if (mode == "amx") amx_item<true>(off, q.data() + at, out.data() + at);
          else if (mode == "amxpack") amx_item<false>(off, q.data() + at, out.data() + at);
          else if (mode == "amxsplit") amx_item<false, true>(off, q.data() + at, out.data() + at);
          else item<false>(off, q.data() + at, out.data() + at);
        }
    ms.push_back(std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count() / LAYERS);
  }
  std::sort(ms.begin(), ms.end());
  std::printf("%-6s %-10s %.3f ms per layer [%.3f, %.3f] (1 thread, median of 7)\n", mode.c_str(),
              resident ? "resident" : "from DRAM", ms[3], ms[0], ms[6]);
  return 0;
}
