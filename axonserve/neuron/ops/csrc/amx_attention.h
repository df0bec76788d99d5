// Flash attention for prefill chunks on AMX tiles, or on AVX512-BF16's dot product where the CPU
// has no AMX (the `TILES` template flag; included by cpu_kernels.cpp after its AMX section).
//
// The per-row kernel (attend_item_vec) reads every key once per query row: right for decodes,
// but a chunk of n prompt tokens reads its keys n times over, at float32 FMA speed. Here a chunk
// ("run": consecutive rows of one sequence at consecutive positions) is cut into tiles of 16 query
// rows of one head, and each tile runs flash attention on the tile unit: S = Q K^T and O += P V
// are tile multiplies (bf16 in, float32 accumulation), the softmax is exact per KV_CHUNK keys with
// the running max / sum rescaling O between chunks (online softmax). K and V are packed once per
// (run, KV head) into the B-operand layout (K^T and V as bf16 pairs), shared by every query tile
// and every query head of the group. P is rounded to bf16 for the P V product, as torch's flash
// SDPA does for bf16 inputs; scores, max, sums and O stay float32.
//
// Tiles, per chunk: S = Q K^T with Q in tiles 6 (dims 0..31) and 7 (dims 32..63) and up to 4 key
// blocks' accumulators in tiles 0..3 (the first chunk), or one block after each row's softmax of
// the chunk before (tile 0, K in 4 / 5: the tile unit multiplies while the vector units do the
// exponentials; two S buffers); then O += P V with O (16 rows x 16 dims per tile) in tiles
// 0..D/16-1, kept in a float32 buffer between chunks (where a row's rescale happens). P V uses all
// eight tiles, so Q is reloaded after it when another chunk follows.
//
// Without AMX the same products run as vdpbf16ps loops on the same packed layouts (dot_s_blocks,
// dot_pv_blocks: a vector of 16 keys or 16 dims, a query or probability pair broadcast), and a
// chunk's S is made whole after its P V; the softmax, P's rounding and the buffers are the same.

constexpr int64_t KV_CHUNK = 256;  // keys per softmax chunk (multiple of 32)

struct AttnRun {
  int64_t row0, n;  // rows row0 .. row0 + n - 1; row row0 + i attends to kvl[row0] + i keys
};

// 2^x for x <= 0 (below -126: ~0; NaN stays NaN, so a NaN score makes its row's output NaN):
// degree-5 polynomial on [-0.5, 0.5] (relative error < 3e-6; P is rounded to bf16 right after, 2^-9)
inline __m512 exp2_neg(__m512 x) {
  x = _mm512_max_ps(_mm512_set1_ps(-126.f), x);  // (operand order: vmaxps returns the second on NaN)
  const __m512 n = _mm512_roundscale_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m512 f = _mm512_sub_ps(x, n);
  __m512 p = _mm512_set1_ps(1.3333558e-3f);
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(9.6181291e-3f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(5.5504109e-2f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(2.4022651e-1f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(6.9314718e-1f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.f));
  return _mm512_scalef_ps(p, n);
}

// r[k] := column k of the 16 x 16 matrix of 32-bit words whose rows are r[0..15]
inline void transpose16(__m512i r[16]) {
  __m512i t[16];
  for (int i = 0; i < 8; ++i) {
    t[2 * i] = _mm512_unpacklo_epi32(r[2 * i], r[2 * i + 1]);
    t[2 * i + 1] = _mm512_unpackhi_epi32(r[2 * i], r[2 * i + 1]);
  }
  for (int i = 0; i < 4; ++i) {
    r[4 * i] = _mm512_unpacklo_epi64(t[4 * i], t[4 * i + 2]);
    r[4 * i + 1] = _mm512_unpackhi_epi64(t[4 * i], t[4 * i + 2]);
    r[4 * i + 2] = _mm512_unpacklo_epi64(t[4 * i + 1], t[4 * i + 3]);
    r[4 * i + 3] = _mm512_unpackhi_epi64(t[4 * i + 1], t[4 * i + 3]);
  }
  for (int i = 0; i < 2; ++i)
    for (int j = 0; j < 4; ++j) {
      t[8 * i + j] = _mm512_shuffle_i32x4(r[8 * i + j], r[8 * i + 4 + j], 0x88);
      t[8 * i + 4 + j] = _mm512_shuffle_i32x4(r[8 * i + j], r[8 * i + 4 + j], 0xDD);
    }
  for (int j = 0; j < 8; ++j) {
    r[j] = _mm512_shuffle_i32x4(t[j], t[8 + j], 0x88);
    r[8 + j] = _mm512_shuffle_i32x4(t[j], t[8 + j], 0xDD);
  }
}

// K of one (run, KV head) as S's B tiles: block b of 16 keys, dim half c -> 16 rows (dim pairs) x
// 16 keys of bf16 pairs, at kt + (b * ND32 + c) * 512. V as P V's B tiles: block b of 32 keys, dim
// block db -> 16 rows (key pairs) x 16 dims of bf16 pairs, at vp + (b * D/16 + db) * 512. Keys
// past L are zeros (their probabilities are exactly 0; a zero V keeps 0 x V finite).
template <int ND32>
void pack_kv(const bf16* kc, const bf16* vc, const int64_t* off, int64_t L, uint16_t* kt, uint16_t* vp) {
  constexpr int D = 32 * ND32, NDB = D / 16;
  const int64_t nb16 = (L + 15) / 16, nb32 = (L + 31) / 32;
  constexpr int64_t LINES = D * 2 / 64, KEY_AHEAD = 64;  // cache lines a key row; keys requested ahead
  for (int64_t b = 0; b < nb16; ++b) {
    // the keys come from blocks scattered over the cache: the rows KEY_AHEAD keys on are requested now
    if (b == 0) prefetch_rows<_MM_HINT_T0>(kc, off, 16, std::min<int64_t>(L, KEY_AHEAD), LINES);
    prefetch_rows<_MM_HINT_T0>(kc, off, std::min(L, b * 16 + KEY_AHEAD), std::min(L, b * 16 + 16 + KEY_AHEAD), LINES);
    for (int c = 0; c < ND32; ++c) {  // 16 keys x 16 dim pairs, transposed as 32-bit words
      __m512i r[16];
      for (int n = 0; n < 16; ++n)
        r[n] = b * 16 + n < L ? _mm512_loadu_si512(kc + off[b * 16 + n] + 32 * c) : _mm512_setzero_si512();
      transpose16(r);
      for (int kp = 0; kp < 16; ++kp) _mm512_storeu_si512(kt + ((b * ND32 + c) * 16 + kp) * 32, r[kp]);
    }
  }
  // two key rows -> their dims interleaved: lanes (2n, 2n+1) of a tile row = dim 16 db + n of keys 2kp, 2kp+1
  alignas(64) static const uint16_t lo_idx[32] = {0, 32, 1, 33, 2, 34, 3, 35, 4, 36, 5, 37, 6, 38, 7, 39,
                                                  8, 40, 9, 41, 10, 42, 11, 43, 12, 44, 13, 45, 14, 46, 15, 47};
  const __m512i lo = _mm512_load_si512(lo_idx), step = _mm512_set1_epi16(16);
  const __m512i zero = _mm512_setzero_si512();
  prefetch_rows<_MM_HINT_T0>(vc, off, 0, std::min<int64_t>(L, KEY_AHEAD), LINES);
  for (int64_t b = 0; b < nb32; ++b)
    for (int kp = 0; kp < 16; ++kp) {
      const int64_t t0 = b * 32 + 2 * kp, t1 = t0 + 1;
      if (t0 + KEY_AHEAD + 1 < L) prefetch_rows<_MM_HINT_T0>(vc, off, t0 + KEY_AHEAD, t0 + KEY_AHEAD + 2, LINES);
      for (int h = 0; h < ND32; ++h) {  // 32 dims at a time
        const __m512i x0 = t0 < L ? _mm512_loadu_si512(vc + off[t0] + 32 * h) : zero;
        const __m512i x1 = t1 < L ? _mm512_loadu_si512(vc + off[t1] + 32 * h) : zero;
        for (int half = 0; half < 2; ++half) {
          const int db = 2 * h + half;
          const __m512i idx = half ? _mm512_add_epi16(lo, step) : lo;
          _mm512_storeu_si512(vp + ((b * NDB + db) * 16 + kp) * 32, _mm512_permutex2var_epi16(x0, idx, x1));
        }
      }
    }
}

#ifdef AXON_AMX
// S for up to 4 blocks of 16 keys: one accumulator each (tiles 0..3: independent chains; a single
// accumulator would wait out each multiply's latency), B operands alternating in tiles 4 and 5.
template <int ND32>
inline void s_blocks(const uint16_t* kb, int64_t nb, float* S) {
  _tile_zero(0);
  _tile_zero(1);
  _tile_zero(2);
  _tile_zero(3);
#define AXON_S_BLOCK(T)                          \
  if (T < nb) {                                  \
    _tile_loadd(4, kb + T * ND32 * 512, 64);     \
    _tile_dpbf16ps(T, 6, 4);                     \
    if (ND32 == 2) {                             \
      _tile_loadd(5, kb + T * ND32 * 512 + 512, 64); \
      _tile_dpbf16ps(T, 7, 5);                   \
    }                                            \
  }
  AXON_S_BLOCK(0) AXON_S_BLOCK(1) AXON_S_BLOCK(2) AXON_S_BLOCK(3)
#undef AXON_S_BLOCK
  _tile_stored(0, S, KV_CHUNK * 4);
  if (nb > 1) _tile_stored(1, S + 16, KV_CHUNK * 4);
  if (nb > 2) _tile_stored(2, S + 32, KV_CHUNK * 4);
  if (nb > 3) _tile_stored(3, S + 48, KV_CHUNK * 4);
}

// S for one block of 16 keys in tile 0 (Q in tiles 6 / 7, K in 4 / 5)
template <int ND32>
inline void s_block(const uint16_t* kb, float* S) {
  _tile_zero(0);
  _tile_loadd(4, kb, 64);
  _tile_dpbf16ps(0, 6, 4);
  if (ND32 == 2) {
    _tile_loadd(5, kb + 512, 64);
    _tile_dpbf16ps(0, 7, 5);
  }
  _tile_stored(0, S, KV_CHUNK * 4);
}

// O (tiles 0..3, loaded from and stored back to obuf [16 x D] float32) += P V over np blocks of 32
// keys; P in tiles 6 / 7 alternately, V in 4 / 5. SPLIT: P is two bf16 parts, P (tile 6) and P2
// (its rounding error, tile 7), each multiplied by V: P to ~2^-17, about float32's own precision.
template <int NDB, bool SPLIT = false>
inline void pv_blocks(const bf16* P, const uint16_t* vb, int64_t np, float* obuf, const bf16* P2 = nullptr) {
  constexpr int64_t OS = NDB * 64;  // obuf row stride, bytes
  _tile_loadd(0, obuf, OS);
  _tile_loadd(1, obuf + 16, OS);
  if (NDB > 2) {
    _tile_loadd(2, obuf + 32, OS);
    _tile_loadd(3, obuf + 48, OS);
  }
#define AXON_PV_BLOCK(PT)              \
  {                                    \
    _tile_loadd(PT, P + b * 32, KV_CHUNK * 2); \
    _tile_loadd(4, vb, 64);            \
    _tile_dpbf16ps(0, PT, 4);          \
    _tile_loadd(5, vb + 512, 64);      \
    _tile_dpbf16ps(1, PT, 5);          \
    if (NDB > 2) {                     \
      _tile_loadd(4, vb + 1024, 64);   \
      _tile_dpbf16ps(2, PT, 4);        \
      _tile_loadd(5, vb + 1536, 64);   \
      _tile_dpbf16ps(3, PT, 5);        \
    }                                  \
  }
#define AXON_PV_SPLIT(O, VT, AT)       \
  _tile_loadd(VT, vb + AT, 64);        \
  _tile_dpbf16ps(O, 6, VT);            \
  _tile_dpbf16ps(O, 7, VT);
  for (int64_t b = 0; b < np; ++b, vb += NDB * 512) {  // (tile numbers are immediates)
    if constexpr (SPLIT) {
      _tile_loadd(6, P + b * 32, KV_CHUNK * 2);
      _tile_loadd(7, P2 + b * 32, KV_CHUNK * 2);
      AXON_PV_SPLIT(0, 4, 0)
      AXON_PV_SPLIT(1, 5, 512)
      if (NDB > 2) {
        AXON_PV_SPLIT(2, 4, 1024)
        AXON_PV_SPLIT(3, 5, 1536)
      }
    } else if (b & 1) AXON_PV_BLOCK(7) else AXON_PV_BLOCK(6)
  }
#undef AXON_PV_SPLIT
#undef AXON_PV_BLOCK
  _tile_stored(0, obuf, OS);
  _tile_stored(1, obuf + 16, OS);
  if (NDB > 2) {
    _tile_stored(2, obuf + 32, OS);
    _tile_stored(3, obuf + 48, OS);
  }
}
#endif

// S = Q K^T for nb blocks of 16 keys (rows of S KV_CHUNK apart) on the dot product: the skinny
// matmul's tile (bdot_tile), 8 query rows x up to 3 key blocks a pass. A packed K block is one
// stream of its dim pairs (pair p's 16 keys at p * 32), as a packed weight's column block is.
template <int ND32>
inline void dot_s_blocks(const bf16* qbuf, const uint16_t* kb, int64_t nb, float* S) {
  constexpr int D = 32 * ND32;
  for (int r0 = 0; r0 < 16; r0 += 8) {
    const int32_t* xr[8];
    for (int m = 0; m < 8; ++m) xr[m] = reinterpret_cast<const int32_t*>(qbuf + (r0 + m) * D);
    for (int64_t b0 = 0; b0 < nb; b0 += 3) {
      const bf16* wj[3];
      for (int64_t j = 0; j < 3; ++j)
        wj[j] = reinterpret_cast<const bf16*>(kb + std::min(b0 + j, nb - 1) * ND32 * 512);
      float* s = S + r0 * KV_CHUNK + b0 * 16;
      with_count<3>(std::min<int64_t>(3, nb - b0),
                    [&](auto blocks) { bdot_tile<8, decltype(blocks)::value, false>(xr, wj, s, KV_CHUNK, D / 2, nullptr); });
    }
  }
}

// O (obuf rows, float32 [MR x D]) += P V over np blocks of 32 keys on the dot product: MR rows x
// the D / 16 dim blocks (MR x NDB accumulators), a V vector (16 dims x one key pair) per load and
// each row's probability pair broadcast. SPLIT: P's second bf16 part (P2) too, as pv_blocks.
// (not inlined: inside the item loop GCC kept the accumulators in memory, ~4x slower)
template <int MR, int NDB, bool SPLIT>
[[gnu::noinline]] void dot_pv_tile(const bf16* P, const bf16* P2, const uint16_t* vb, int64_t np, float* obuf) {
  constexpr int D = NDB * 16;
  __m512 acc[MR][NDB];
  for (int m = 0; m < MR; ++m)
    for (int d = 0; d < NDB; ++d) acc[m][d] = _mm512_loadu_ps(obuf + m * D + d * 16);
  const int32_t* pr = reinterpret_cast<const int32_t*>(P);  // row m's key pair kp: pr[m * KV_CHUNK / 2 + kp]
  const int32_t* pr2 = reinterpret_cast<const int32_t*>(P2);
  for (int64_t kp = 0; kp < np * 16; ++kp) {
    const uint16_t* v = vb + ((kp / 16) * NDB * 16 + kp % 16) * 32;
    __m512bh w[NDB];
#pragma GCC unroll 4
    for (int d = 0; d < NDB; ++d) w[d] = (__m512bh)_mm512_loadu_si512(v + d * 512);
#pragma GCC unroll 8
    for (int m = 0; m < MR; ++m) {
      const __m512bh b = (__m512bh)_mm512_set1_epi32(pr[m * KV_CHUNK / 2 + kp]);
#pragma GCC unroll 4
      for (int d = 0; d < NDB; ++d) acc[m][d] = _mm512_dpbf16_ps(acc[m][d], b, w[d]);
      if constexpr (SPLIT) {
        const __m512bh b2 = (__m512bh)_mm512_set1_epi32(pr2[m * KV_CHUNK / 2 + kp]);
#pragma GCC unroll 4
        for (int d = 0; d < NDB; ++d) acc[m][d] = _mm512_dpbf16_ps(acc[m][d], b2, w[d]);
      }
    }
  }
  for (int m = 0; m < MR; ++m)
    for (int d = 0; d < NDB; ++d) _mm512_storeu_ps(obuf + m * D + d * 16, acc[m][d]);
}

template <int NDB, bool SPLIT = false>
inline void dot_pv_blocks(const bf16* P, const uint16_t* vb, int64_t np, float* obuf, const bf16* P2 = nullptr) {
  constexpr int MR = NDB > 2 ? 6 : 8, D = NDB * 16;
  for (int r0 = 0; r0 < 16; r0 += MR) {
    const bf16* p = P + r0 * KV_CHUNK;
    const bf16* p2 = SPLIT ? P2 + r0 * KV_CHUNK : nullptr;
    if (16 - r0 >= MR) dot_pv_tile<MR, NDB, SPLIT>(p, p2, vb, np, obuf + r0 * D);
    else dot_pv_tile<(16 % MR ? 16 % MR : 1), NDB, SPLIT>(p, p2, vb, np, obuf + r0 * D);
  }
}

// the bf16 values of x's low / high 256 bits as float32
inline __m512 bf16_lo_ps(__m512i x) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm512_castsi512_si256(x)), 16));
}
inline __m512 bf16_hi_ps(__m512i x) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm512_extracti64x4_epi64(x, 1)), 16));
}

// Flash attention of one tile of 16 query rows (qbuf, bf16 [16 x D]; row j attends to its first
// kvl[j] keys, Lt the most of them) against packed K / V: leaves the unnormalized output in obuf
// (float32 [16 x D]), each row's running max in base-2 units (score x scale x log2 e) in m and its
// sum of exponentials in l. SPLIT: P V with P in two bf16 parts (pv_blocks), for the shared
// prefixes of decode rows, whose outputs the per-row kernel finishes in float32. TILES: on AMX
// (the caller has loaded the tile configuration), else on the dot product.
template <int ND32, bool TILES, bool SPLIT = false>
void amx_flash(const AttnArgs& a, const uint16_t* kt, const uint16_t* vp, const int64_t* kvl, int64_t Lt,
               const bf16* qbuf, float* S, bf16* P, bf16* P2, float* obuf, float* m, float* l) {
  constexpr int D = 32 * ND32, NDB = D / 16;
  const float c = a.scale * 1.44269504088896341f;  // scores in base-2 units
  std::memset(obuf, 0, 16 * D * sizeof(float));
  for (int j = 0; j < 16; ++j) { m[j] = -INFINITY; l[j] = 0.f; }
  const __m512 ninf = _mm512_set1_ps(-INFINITY);
  const int64_t nb0 = (std::min(KV_CHUNK, Lt) + 15) / 16;  // the first chunk's S = Q K^T
  if constexpr (TILES) {
#ifdef AXON_AMX
    _tile_loadd(6, qbuf, D * 2);
    if (ND32 == 2) _tile_loadd(7, qbuf + 32, D * 2);
    for (int64_t b = 0; b < nb0; b += 4) s_blocks<ND32>(kt + b * ND32 * 512, std::min<int64_t>(4, nb0 - b), S + b * 16);
#endif
  } else {
    dot_s_blocks<ND32>(qbuf, kt, nb0, S);
  }
  for (int64_t k0 = 0, ci = 0; k0 < Lt; k0 += KV_CHUNK, ++ci) {
    const int64_t nk = std::min(KV_CHUNK, Lt - k0), np = (nk + 31) / 32;
    // the next chunk's S blocks, on AMX one after each row's softmax: the tile unit works while the
    // vector units do the exponentials (a chunk has at most 16 blocks of 16 keys)
    const int64_t nb_next = (std::max<int64_t>(0, std::min(KV_CHUNK, Lt - k0 - KV_CHUNK)) + 15) / 16;
    const float* Sc = S + (ci & 1) * 16 * KV_CHUNK;
    float* Sn = S + ((ci + 1) & 1) * 16 * KV_CHUNK;
    const uint16_t* kn = kt + (k0 + KV_CHUNK) / 16 * ND32 * 512;
    for (int j = 0; j < 16; ++j) {  // the softmax over this chunk, row by row (lanes = keys)
      const float* s = Sc + j * KV_CHUNK;
      bf16* p = P + j * KV_CHUNK;
      auto store_p = [&](bf16* at, __m512 p0, __m512 p1) {  // 32 probabilities as bf16 (SPLIT: their rest in P2)
        const __m512i hi = (__m512i)_mm512_cvtne2ps_pbh(p1, p0);
        _mm512_storeu_si512(at, hi);
        if constexpr (SPLIT)
          _mm512_storeu_si512(P2 + (at - P), (__m512i)_mm512_cvtne2ps_pbh(_mm512_sub_ps(p1, bf16_hi_ps(hi)),
                                                                          _mm512_sub_ps(p0, bf16_lo_ps(hi))));
      };
      const int64_t valid = std::max<int64_t>(0, std::min(nk, kvl[j] - k0)), full = valid & ~int64_t(31);
      __m512 vmax = ninf, vmax1 = ninf;
      for (int64_t z = 0; z < full; z += 32) {
        vmax = _mm512_max_ps(vmax, _mm512_loadu_ps(s + z));
        vmax1 = _mm512_max_ps(vmax1, _mm512_loadu_ps(s + z + 16));
      }
      vmax = _mm512_max_ps(vmax, vmax1);
      for (int64_t z = full; z < valid; z += 16) {
        const __mmask16 mk = valid - z >= 16 ? __mmask16(0xFFFF) : __mmask16((1u << (valid - z)) - 1);
        vmax = _mm512_max_ps(vmax, _mm512_mask_loadu_ps(ninf, mk, s + z));
      }
      const float mnew = std::max(m[j], _mm512_reduce_max_ps(vmax) * c);
      const float alpha = m[j] == -INFINITY ? 0.f : m[j] == mnew ? 1.f : std::exp2(m[j] - mnew);  // (exp2(0) is 1)
      if (alpha != 1.f && k0 > 0)  // this row's max grew: rescale its output so far
        for (int d = 0; d < D; d += 16)
          _mm512_storeu_ps(obuf + j * D + d, _mm512_mul_ps(_mm512_loadu_ps(obuf + j * D + d), _mm512_set1_ps(alpha)));
      const __m512 mm = _mm512_set1_ps(-mnew), cc = _mm512_set1_ps(c);
      __m512 sum = _mm512_setzero_ps(), sum1 = _mm512_setzero_ps();
      for (int64_t z = 0; z < full; z += 32) {  // whole blocks of 32 valid keys
        const __m512 p0 = exp2_neg(_mm512_fmadd_ps(_mm512_loadu_ps(s + z), cc, mm));
        const __m512 p1 = exp2_neg(_mm512_fmadd_ps(_mm512_loadu_ps(s + z + 16), cc, mm));
        sum = _mm512_add_ps(sum, p0);
        sum1 = _mm512_add_ps(sum1, p1);
        store_p(p + z, p0, p1);
      }
      sum = _mm512_add_ps(sum, sum1);
      for (int64_t z = full; z < np * 32; z += 32) {  // the block the row's last key is in, and masked ones
        const int64_t v0 = valid - z, v1 = valid - z - 16;
        const __mmask16 k0m = v0 >= 16 ? __mmask16(0xFFFF) : v0 <= 0 ? __mmask16(0) : __mmask16((1u << v0) - 1);
        const __mmask16 k1m = v1 >= 16 ? __mmask16(0xFFFF) : v1 <= 0 ? __mmask16(0) : __mmask16((1u << v1) - 1);
        const __m512 p0 = _mm512_maskz_mov_ps(k0m, exp2_neg(_mm512_fmadd_ps(_mm512_maskz_loadu_ps(k0m, s + z), cc, mm)));
        const __m512 p1 =
            _mm512_maskz_mov_ps(k1m, exp2_neg(_mm512_fmadd_ps(_mm512_maskz_loadu_ps(k1m, s + z + 16), cc, mm)));
        sum = _mm512_add_ps(sum, _mm512_add_ps(p0, p1));
        store_p(p + z, p0, p1);
      }
      l[j] = l[j] * alpha + _mm512_reduce_add_ps(sum);
      m[j] = mnew;
#ifdef AXON_AMX
      if constexpr (TILES)
        if (j < nb_next) s_block<ND32>(kn + j * ND32 * 512, Sn + j * 16);
#endif
    }
    const uint16_t* vb = vp + (k0 / 32) * NDB * 512;
    if constexpr (TILES) {
#ifdef AXON_AMX
      pv_blocks<NDB, SPLIT>(P, vb, np, obuf, P2);  // O += P V (tiles 0..7)
      if (nb_next) {
        _tile_loadd(6, qbuf, D * 2);
        if (ND32 == 2) _tile_loadd(7, qbuf + 32, D * 2);
      }
#endif
    } else {
      dot_pv_blocks<NDB, SPLIT>(P, vb, np, obuf, P2);
      if (nb_next) dot_s_blocks<ND32>(qbuf, kn, nb_next, Sn);
    }
  }
}

// One tile: query rows row0 .. row0 + nq - 1 (nq <= 16) of query head h, whose last attends to Lt keys.
template <int ND32, bool TILES>
void amx_attend_tile(const AttnArgs& a, const bf16* qp, bf16* op, const uint16_t* kt, const uint16_t* vp,
                     int64_t row0, int64_t nq, int64_t h, float* S, bf16* P, float* obuf, bf16* qbuf) {
  constexpr int D = 32 * ND32;
  int64_t kvl[16];
  for (int j = 0; j < 16; ++j) kvl[j] = a.kvl[row0 + std::min<int64_t>(j, nq - 1)];
  for (int j = 0; j < 16; ++j) {
    const bf16* src = qp + (row0 + j) * a.q_rs + h * a.q_hs;
    for (int d = 0; d < D; d += 32)
      _mm512_storeu_si512(qbuf + j * D + d, j < nq ? _mm512_loadu_si512(src + d) : _mm512_setzero_si512());
  }
  float m[16], l[16];
  amx_flash<ND32, TILES>(a, kt, vp, kvl, kvl[15], qbuf, S, P, nullptr, obuf, m, l);
  for (int64_t j = 0; j < nq; ++j) {
    const __m512 inv = _mm512_set1_ps(1.f / l[j]);
    bf16* o = op + (row0 + j) * a.o_rs + h * a.o_hs;
    for (int d = 0; d < D; d += 16) store16(o + d, _mm512_mul_ps(_mm512_loadu_ps(obuf + j * D + d), inv));
  }
}

// Takes the runs of AMX_ATTN_MIN_RUN+ rows without extra keys (bf16 q and cache, head_dim 32 or 64,
// no window: the caller checks) and returns the rows left for the per-row kernel, in order; on AMX
// tiles (TILES) or the dot product. (A value
// row past a row's keys is multiplied by its zero probability: an inf there would make it NaN, where
// the per-row kernel never reads it; K/V rows of a sequence are finite unless its model overflowed.)
template <int ND32, bool TILES>
std::vector<int64_t> amx_attend_runs(const AttnArgs& a, const bf16* qp, bf16* op, const bf16* kc, const bf16* vc) {
  constexpr int D = 32 * ND32;
  std::vector<AttnRun> runs;
  std::vector<int64_t> rest;
  auto plain = [&](int64_t r) {  // no extra keys (a draft tree's rows have some: per-row kernel)
    for (int64_t e = 0; e < a.E; ++e)
      if (a.extra[r * a.E + e] >= 0) return false;
    return true;
  };
  for (int64_t r = 0; r < a.R;) {
    int64_t e = r + 1;
    if (plain(r))
      while (e < a.R && a.seq[e] == a.seq[r] && a.kvl[e] == a.kvl[e - 1] + 1 && plain(e)) ++e;
    if (e - r >= AMX_ATTN_MIN_RUN) runs.push_back({r, e - r});
    else
      for (int64_t i = r; i < e; ++i) rest.push_back(i);
    r = e;
  }
  if (runs.empty()) return rest;
  // packed K / V per (run, KV head)
  const int64_t nr = runs.size();
  std::vector<int64_t> base(nr * a.Hkv + 1, 0);
  for (int64_t i = 0; i < nr; ++i) {
    const int64_t L = a.kvl[runs[i].row0 + runs[i].n - 1];
    const int64_t per = ((L + 15) / 16) * ND32 * 512 + ((L + 31) / 32) * (D / 16) * 512;
    for (int64_t h = 0; h < a.Hkv; ++h) base[i * a.Hkv + h + 1] = base[i * a.Hkv + h] + per;
  }
  std::unique_ptr<uint16_t[]> packed(new uint16_t[base.back()]);  // (every element is written by pack_kv)
  auto kt_of = [&](int64_t i, int64_t h) { return packed.get() + base[i * a.Hkv + h]; };
  auto vp_of = [&](int64_t i, int64_t h) {
    const int64_t L = a.kvl[runs[i].row0 + runs[i].n - 1];
    return kt_of(i, h) + ((L + 15) / 16) * ND32 * 512;
  };
  pool_for(0, nr * a.Hkv, 1, [&](int64_t b, int64_t e) {
    std::vector<int64_t> off;
    for (int64_t it = b; it < e; ++it) {
      const int64_t i = it / a.Hkv, h = it % a.Hkv;
      const int64_t L = key_offsets<false>(a, runs[i].row0 + runs[i].n - 1, h, off);
      pack_kv<ND32>(kc, vc, off.data(), L, kt_of(i, h), vp_of(i, h));
    }
  });
  // items (run, query head, tile of 16 rows), split between threads by their keys
  struct Item { int64_t run, h, row0, nq; };
  std::vector<Item> items;
  std::vector<int64_t> cum{0};
  for (int64_t i = 0; i < nr; ++i)
    for (int64_t h = 0; h < a.Hq; ++h)
      for (int64_t t = 0; t < runs[i].n; t += 16) {
        const int64_t nq = std::min<int64_t>(16, runs[i].n - t), row0 = runs[i].row0 + t;
        items.push_back({i, h, row0, nq});
        cum.push_back(cum.back() + a.kvl[row0 + nq - 1] + 16);
      }
  const int64_t n = items.size(), threads = std::max<int64_t>(1, std::min<int64_t>(at::get_num_threads(), n));
  const int64_t parts = std::min<int64_t>(4 * threads, n);  // claimed as threads come free (thread_pool.h)
  pool_for(0, parts, 1, [&](int64_t t0, int64_t t1) {
#ifdef AXON_AMX
    if constexpr (TILES) load_attention_tiles();
#endif
    std::vector<float> S(2 * 16 * KV_CHUNK), obuf(16 * D);  // S: this chunk's and the next's
    std::vector<bf16> P(16 * KV_CHUNK), qbuf(16 * D);
    auto first_at = [&](int64_t share) {
      return std::lower_bound(cum.begin(), cum.end(), cum[n] * share / parts) - cum.begin();
    };
    for (int64_t t = t0; t < t1; ++t)
      for (int64_t i = first_at(t), end = t + 1 == parts ? n : first_at(t + 1); i < end; ++i) {
        const Item& it = items[i];
        const int64_t g = it.h / a.G;
        amx_attend_tile<ND32, TILES>(a, qp, op, kt_of(it.run, g), vp_of(it.run, g), it.row0, it.nq, it.h, S.data(),
                                     P.data(), obuf.data(), qbuf.data());
      }
#ifdef AXON_AMX
    if constexpr (TILES) _tile_release();
#endif
  });
  return rest;
}

#ifdef AXON_AMX
// ------------------------------------------------------------------ shared prefixes of decode rows
// Rows whose sequences share their first KV blocks (prefix caching: requests with one system
// prompt; the n samples of one prompt) read those keys once for all of them instead of once a
// row: per (group of rows, KV head) the prefix is packed once and its query vectors (the group's
// rows x G heads) go through amx_flash in tiles of 16, as a prompt's rows do. What comes out is
// each (row, query head)'s unnormalized prefix output, its max and its sum (`state`: [R, Hq, D + 2]
// float32); the per-row kernel then attends to the row's own keys after the prefix (AttnArgs'
// pre_len) and merges the two (softmax_inplace with m0, l0). P V takes P in two bf16 parts, so the result is
// attention at float32 precision, as the per-row kernel computes it (in another summation order).
// docs/benchmarks.md#fig-shared-prefix.
constexpr int64_t PREFIX_MIN_KEYS = 128;   // a shorter common prefix stays on the per-row kernel (64: 1.09x slower)
constexpr int64_t PREFIX_MIN_QUERIES = 8;  // query vectors (rows x G) a group needs to fill a tile enough

// `rows`: the rows the per-row kernel takes. Groups of rows on one first block whose tables agree
// on P >= PREFIX_MIN_KEYS keys, each row keeping at least one key of its own after them.
std::vector<PrefixGroup> shared_prefix_groups(const AttnArgs& a, const std::vector<int64_t>& rows) {
  const int64_t nrows = rows.size();
  std::vector<std::pair<int64_t, int64_t>> by(nrows);  // (first block, row); rows under one block apart
  for (int64_t i = 0; i < nrows; ++i) {
    const int64_t r = rows[i];
    by[i] = {a.kvl[r] > a.bs ? a.bt[a.seq[r] * a.W] : -1 - r, r};
  }
  std::sort(by.begin(), by.end());
  std::vector<PrefixGroup> groups;
  for (int64_t i = 0, j; i < nrows; i = j) {
    for (j = i + 1; j < nrows && by[j].first == by[i].first;) ++j;
    if (by[i].first < 0 || (j - i) * a.G < PREFIX_MIN_QUERIES) continue;
    int64_t min_kv = a.kvl[by[i].second];
    for (int64_t k = i; k < j; ++k) min_kv = std::min(min_kv, a.kvl[by[k].second]);
    const int64_t* t0 = a.bt + a.seq[by[i].second] * a.W;
    int64_t nb = 0;
    for (const int64_t most = (min_kv - 1) / a.bs; nb < most; ++nb) {
      bool same = true;
      for (int64_t k = i + 1; k < j && same; ++k) same = a.bt[a.seq[by[k].second] * a.W + nb] == t0[nb];
      if (!same) break;
    }
    if (nb * a.bs < PREFIX_MIN_KEYS) continue;
    PrefixGroup g{{}, nb * a.bs};
    for (int64_t k = i; k < j; ++k) g.rows.push_back(by[k].second);
    groups.push_back(std::move(g));
  }
  return groups;
}

// One group's prefix for KV head h: packs it (into this thread's buffer) and writes the state of
// every (row, query head h * G + g) of the group. The caller has loaded the tile configuration.
template <int ND32>
void amx_prefix_head(const AttnArgs& a, const bf16* qp, const bf16* kc, const bf16* vc, const PrefixGroup& gr,
                     int64_t h, float* state) {
  constexpr int D = 32 * ND32;
  const int64_t L = gr.P, nkt = ((L + 15) / 16) * ND32 * 512;
  static thread_local std::vector<uint16_t> packed;
  static thread_local std::vector<int64_t> off;
  static thread_local std::vector<float> S(2 * 16 * KV_CHUNK), obuf(16 * D);
  static thread_local std::vector<bf16> P(16 * KV_CHUNK), P2(16 * KV_CHUNK), qbuf(16 * D);
  packed.resize(nkt + ((L + 31) / 32) * (D / 16) * 512);
  off.resize(L);
  const int64_t* table = a.bt + a.seq[gr.rows[0]] * a.W;
  for (int64_t t = 0; t < L; ++t) off[t] = ((table[t / a.bs] * a.bs + t % a.bs) * a.Hkv + h) * a.D;
  pack_kv<ND32>(kc, vc, off.data(), L, packed.data(), packed.data() + nkt);
  int64_t kvl[16];
  std::fill(kvl, kvl + 16, L);
  const int64_t nv = int64_t(gr.rows.size()) * a.G;  // vectors, row-major over (row, g)
  for (int64_t k0 = 0; k0 < nv; k0 += 16) {
    const int64_t n = std::min<int64_t>(16, nv - k0);
    int64_t at[16];  // each vector's row * Hq + query head
    for (int64_t j = 0; j < 16; ++j) {
      const int64_t v = k0 + std::min(j, n - 1), r = gr.rows[v / a.G], hq = h * a.G + v % a.G;
      at[j] = r * a.Hq + hq;
      const bf16* src = qp + r * a.q_rs + hq * a.q_hs;
      for (int d = 0; d < D; d += 32)
        _mm512_storeu_si512(qbuf.data() + j * D + d, j < n ? _mm512_loadu_si512(src + d) : _mm512_setzero_si512());
    }
    float m[16], l[16];
    amx_flash<ND32, true, true>(a, packed.data(), packed.data() + nkt, kvl, L, qbuf.data(), S.data(), P.data(),
                                P2.data(), obuf.data(), m, l);
    for (int64_t j = 0; j < n; ++j) {
      float* st = state + at[j] * (D + 2);
      std::memcpy(st, obuf.data() + j * D, D * sizeof(float));
      st[D] = m[j];
      st[D + 1] = l[j];
    }
  }
}

void amx_prefix_head(const AttnArgs& a, const bf16* qp, const bf16* kc, const bf16* vc, const PrefixGroup& gr,
                     int64_t h, float* state) {
  if (a.D == 64) amx_prefix_head<2>(a, qp, kc, vc, gr, h, state);
  else amx_prefix_head<1>(a, qp, kc, vc, gr, h, state);
}

void load_attention_tiles() {
  TileConfig cfg;
  for (int i = 0; i < 8; ++i) { cfg.rows[i] = 16; cfg.colsb[i] = 64; }
  _tile_loadconfig(&cfg);
}
#endif
