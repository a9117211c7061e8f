// Paged attention over a bf16 KV cache on AVX512_BF16 dot products (vdpbf16ps): prefill tasks, and decode tasks
// (attend_task_dot_bf16, below), for CPUs
// without AMX (or with the tiles not allowed). Textually included by isa_body.h after impl_attention.h and
// impl_linear_bf16.h (LMKIT_BF16); avx512 unit only, called by dispatch.cpp only where the CPU has AVX512_BF16.
//
// The fp32 prefill task (attend_task) converts every key's K and V row of a chunk into fp32 buffers and runs
// one FMA per product. Here both products read the cache as it lies, two per instruction:
//   scores  st[j][0:R] = sum over pairs (d, d + 1) of K_j[d, d + 1] . qt[d, d + 1][0:R]
//           K_j's pair broadcast as one 32-bit word straight from the cache; qt holds the task's rows as pairs
//           of d, q in two bf16 parts q = hi + lo (16 bits of mantissa between them, as on AMX tiles), so that
//           a score carries the error of K's bf16 values only
//   softmax online over chunks of 32 keys, lane-wise over the rows as attend_task; P rounded to bf16 and
//           stored as token pairs pp[t][0:R] = (p[2t], p[2t + 1]); l sums those rounded weights
//   output  o[r][0:hd] += sum over token pairs t of pp[t][r] . V pair row t   (V's token pairs are interleaved
//           in the cache, ops.h: a pair row of 16 d is one vdpbf16ps operand)
// Each output row is within ~3e-3 (relative) of the exact attention over the bf16 cache (P's rounding), as on
// the AMX path. Chunks start at an even key: when the first row's window starts at an odd key, the key before
// it is read and masked; keys past the last row's position are never scored, and the V halves of keys outside
// [window start, last position] are zeroed in a staging row (a slot past ctx_len may hold NaN, and 0 * NaN
// would reach the output).
#if defined(__AVX512F__)
constexpr int kBfAttnKeys = 32;  // keys per online-softmax step (16 token pairs)
constexpr int kBfAttnKeyBlock = 8;  // keys whose scores are computed together (x 3 row vectors x hi, lo)

// e^x for the softmax's x <= 0, to 1e-5 relative (the weights are rounded to bf16 next: 2^-9), 0 below -87:
// 2^(x log2 e) = 2^n 2^f with |f| <= 1/2, 2^f by a degree-4 polynomial fitted for relative error, 2^n by
// vscalefps: about half the instructions of simd.h's fp32-accurate vexp, in the kernel's innermost loop.
inline __m512 exp_for_bf16(__m512 x) {
  const __m512 floor = _mm512_set1_ps(-87.0f);
  const __mmask16 live = _mm512_cmp_ps_mask(x, floor, _CMP_GE_OQ);
  const __m512 t = _mm512_mul_ps(_mm512_max_ps(x, floor), _mm512_set1_ps(1.44269504088896341f));
  const __m512 n = _mm512_roundscale_ps(t, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m512 f = _mm512_sub_ps(t, n);
  __m512 p = _mm512_fmadd_ps(_mm512_set1_ps(9.5605105e-3f), f, _mm512_set1_ps(5.5917040e-2f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(2.4024981e-1f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(6.9312197e-1f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(9.9999917e-1f));
  return _mm512_maskz_mov_ps(live, _mm512_scalef_ps(p, n));
}

const uint16_t kZeroBf16Row[kKVQuantMaxHeadDim] = {};

// st[j][v * 16 ..] = K_j . (qh + ql)[:, v * 16 ..] for the kBfAttnKeyBlock keys krow[0..], RV row vectors;
// qh, ql: [np pairs of d][RV * 16] 32-bit pair words.
template <int RV>
LMKIT_BF16 inline void scores_bf16(const uint16_t* const* krow, const uint32_t* qh, const uint32_t* ql, int np,
                                   float* st) {
  constexpr int KB = kBfAttnKeyBlock, ld = RV * 16;
  __m512 acc[KB][RV];
  for (int j = 0; j < KB; ++j)
    for (int v = 0; v < RV; ++v) acc[j][v] = _mm512_setzero_ps();
  const uint32_t* kr[KB];
  for (int j = 0; j < KB; ++j) kr[j] = (const uint32_t*)krow[j];
  for (int dp = 0; dp < np; ++dp) {
    __m512bh h[RV], l[RV];
    for (int v = 0; v < RV; ++v) {
      h[v] = (__m512bh)_mm512_loadu_si512(qh + dp * ld + v * 16);
      l[v] = (__m512bh)_mm512_loadu_si512(ql + dp * ld + v * 16);
    }
    for (int j = 0; j < KB; ++j) {
      const __m512bh kd = (__m512bh)_mm512_set1_epi32((int)kr[j][dp]);
      for (int v = 0; v < RV; ++v) {
        acc[j][v] = _mm512_dpbf16_ps(acc[j][v], h[v], kd);
        acc[j][v] = _mm512_dpbf16_ps(acc[j][v], l[v], kd);
      }
    }
  }
  for (int j = 0; j < KB; ++j)
    for (int v = 0; v < RV; ++v) _mm512_storeu_ps(st + j * ld + v * 16, acc[j][v]);
}

// o[r0 + i][(dv + u) * 16 ..] += sum_t pp[t][r0 + i] . vpr[t][(dv + u) * 16 ..] for i < 4, u < NV; o rows hd apart.
template <int NV>
LMKIT_BF16 inline void pv_bf16(const uint32_t* pp, int ld, int r0, const uint32_t* const* vpr, int npairs, int dv,
                               int hd, float* o) {
  __m512 acc[4][NV];
  for (int i = 0; i < 4; ++i)
    for (int u = 0; u < NV; ++u) acc[i][u] = _mm512_loadu_ps(o + (r0 + i) * hd + (dv + u) * 16);
  for (int t = 0; t < npairs; ++t) {
    __m512bh vv[NV];
    for (int u = 0; u < NV; ++u) vv[u] = (__m512bh)_mm512_loadu_si512(vpr[t] + (dv + u) * 16);
    for (int i = 0; i < 4; ++i) {
      const __m512bh p = (__m512bh)_mm512_set1_epi32((int)pp[t * ld + r0 + i]);
      for (int u = 0; u < NV; ++u) acc[i][u] = _mm512_dpbf16_ps(acc[i][u], p, vv[u]);
    }
  }
  for (int i = 0; i < 4; ++i)
    for (int u = 0; u < NV; ++u) _mm512_storeu_ps(o + (r0 + i) * hd + (dv + u) * 16, acc[i][u]);
}

// Rows [rho0, rho1) of sequence `seq` under kv head `kvh` (as attend_task); head_dim % 16 == 0, bits 16.
template <int RV>
LMKIT_BF16 void attend_task_bf16(const float* q, const KVLayer& kv, const AttnSeq& seq, int kvh, int group,
                                 int num_heads, int64_t rho0, int64_t rho1, float scale, float softcap, const float* sinks, int window,
                                 float* out) {
  constexpr int ld = RV * 16;
  const int hd = kv.head_dim, np = hd / 2, nvec = hd / 16;
  const int64_t bs = kv.block_size_tokens, bb = kv.block_bytes();
  const int rows = (int)(rho1 - rho0), rows4 = (rows + 3) / 4 * 4;
  alignas(64) uint32_t qt_hi[kKVQuantMaxHeadDim / 2 * ld], qt_lo[kKVQuantMaxHeadDim / 2 * ld];  // [np][ld]
  alignas(64) float obuf[kAttnMaxTaskFloats + 4 * kKVQuantMaxHeadDim];                         // [rows4][hd]
  alignas(64) float st[kBfAttnKeys * ld];                                                       // [key][row]
  alignas(64) uint32_t pp[kBfAttnKeys / 2 * ld];                                                // [pair][row]
  alignas(64) uint32_t vstage[2][kKVQuantMaxHeadDim];  // boundary pair rows with one token's half zeroed
  alignas(64) float pos[ld], lo[ld], m[ld], lsum[ld];
  float* orow[kAttnMaxRows];
  for (int r = 0; r < ld; ++r) {
    const float* qr = task_row(q, seq, kvh, group, num_heads, hd, window, rho0, rows, r, out, orow, pos, lo, m, lsum);
    for (int d = 0; d < hd; d += 2) {
      const uint16_t h0 = bf16_bits(qr[d]), h1 = bf16_bits(qr[d + 1]);
      const uint16_t l0 = bf16_bits(qr[d] - bfloat_to_float(h0)), l1 = bf16_bits(qr[d + 1] - bfloat_to_float(h1));
      qt_hi[(d / 2) * ld + r] = (uint32_t)h0 | (uint32_t)h1 << 16;
      qt_lo[(d / 2) * ld + r] = (uint32_t)l0 | (uint32_t)l1 << 16;
    }
  }
  for (int i = 0; i < rows4 * hd; ++i) obuf[i] = 0.0f;

  // rows are in position order: row 0 has the lowest position and window start, the last row the highest
  const int64_t key_lo = (int64_t)lo[0], key_hi = (int64_t)pos[rows - 1] + 1;
  const Scores score(scale, softcap);
  const __m512i ones = _mm512_set1_epi16(0x3f80);  // bf16 1.0: l += p[2t] + p[2t + 1] by one dot product
  const __m512i interleave = _mm512_set_epi16(31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9, 24, 8, 23, 7,
                                              22, 6, 21, 5, 20, 4, 19, 3, 18, 2, 17, 1, 16, 0);
  const uint16_t* krow[kBfAttnKeys];
  const uint32_t* vpr[kBfAttnKeys / 2];
  // Chunks end at multiples of kBfAttnKeys (the first from key_lo's pair): the same for a row whatever the task's
  // first row (see attend_task).
  for (int64_t c0 = key_lo & ~(int64_t)1, c1; c0 < key_hi; c0 = c1) {
    c1 = (c0 / kBfAttnKeys + 1) * kBfAttnKeys < key_hi ? (c0 / kBfAttnKeys + 1) * kBfAttnKeys : key_hi;
    const int n = (int)(c1 - c0);
    const int npairs = (n + 1) / 2, nb = (n + kBfAttnKeyBlock - 1) / kBfAttnKeyBlock;
    int64_t b = c0 / bs, off = c0 % bs;  // c0 and bs are even: a token pair never straddles a block
    for (int j = 0; j < n; j += 2) {
      const char* kb = (const char*)kv.k + (int64_t)seq.block_table[b] * bb;
      const char* vb = (const char*)kv.v + (int64_t)seq.block_table[b] * bb;
      krow[j] = (const uint16_t*)kb + ((int64_t)kvh * bs + off) * hd;
      if (j + 1 < n) krow[j + 1] = krow[j] + hd;
      vpr[j / 2] = (const uint32_t*)vb + ((int64_t)kvh * (bs / 2) + off / 2) * hd;
      if ((off += 2) == bs) off = 0, ++b;
    }
    for (int j = n; j < nb * kBfAttnKeyBlock; ++j) krow[j] = kZeroBf16Row;
    const uint32_t keep_odd = 0xffff0000u, keep_even = 0x0000ffffu;
    if (c0 < key_lo) {  // the first pair's even key lies before every row's window
      for (int d = 0; d < hd; ++d) vstage[0][d] = vpr[0][d] & keep_odd;
      vpr[0] = vstage[0];
    }
    if (n % 2) {  // the last pair's odd key lies past the last row's position
      for (int d = 0; d < hd; ++d) vstage[1][d] = vpr[npairs - 1][d] & keep_even;
      vpr[npairs - 1] = vstage[1];
    }
    for (int kb = 0; kb < nb; ++kb)
      scores_bf16<RV>(krow + kb * kBfAttnKeyBlock, qt_hi, qt_lo, np, st + kb * kBfAttnKeyBlock * ld);
    score.cap_in_place(st, (int64_t)n * ld);
    // masking is needed only where the chunk crosses some row's position or window start
    const bool masked = (float)(c0 + n - 1) > pos[0] || (float)c0 < lo[ld - 1];
    for (int v = 0; v < RV; ++v) {
      V vmx, vl;
      chunk_max(st, ld, n, v, c0, masked, score, pos, lo, m, lsum, obuf, rows4, hd, vmx, vl);
      const __m512 mx = vmx.v;
      __m512 l = vl.v;
      for (int t = 0; t < npairs; ++t) {
        const __m512 e0 = exp_for_bf16(_mm512_sub_ps(_mm512_loadu_ps(st + 2 * t * ld + v * 16), mx));
        const __m512 e1 = 2 * t + 1 < n ? exp_for_bf16(_mm512_sub_ps(_mm512_loadu_ps(st + (2 * t + 1) * ld + v * 16), mx))
                                        : _mm512_setzero_ps();
        // e0's 16 values then e1's, interleaved into token pairs (e0[r], e1[r]) per 32-bit lane
        const __m512i packed = _mm512_permutexvar_epi16(interleave, (__m512i)_mm512_cvtne2ps_pbh(e1, e0));
        _mm512_storeu_si512(pp + t * ld + v * 16, packed);
        l = _mm512_dpbf16_ps(l, (__m512bh)packed, (__m512bh)ones);
      }
      _mm512_store_ps(lsum + v * 16, l);
    }
    for (int r0 = 0; r0 < rows4; r0 += 4) {
      int dv = 0;
      for (; dv + 4 <= nvec; dv += 4) pv_bf16<4>(pp, ld, r0, vpr, npairs, dv, hd, obuf);
      for (; dv < nvec; ++dv) pv_bf16<1>(pp, ld, r0, vpr, npairs, dv, hd, obuf);
    }
  }
  for (int r = 0; r < rows; ++r) {
    const int64_t head = (int64_t)kvh * group + (rho0 + r) % group;
    const __m512 inv = _mm512_set1_ps(1.0f / (lsum[r] + sink_weight(sinks, head, m[r])));
    for (int dv = 0; dv < nvec; ++dv)
      _mm512_storeu_ps(orow[r] + dv * 16, _mm512_mul_ps(_mm512_loadu_ps(obuf + r * hd + dv * 16), inv));
  }
}

// o[r][(dv + u) * 16 ..] += sum_t pp[r][t] . vpr[t][(dv + u) * 16 ..] for r < G, u < NV (o rows hd apart; pp rows of
// 8 token-pair words), prefetching vfut[t]'s same lines.
template <int G, int NV>
LMKIT_BF16 inline void pv_rows_bf16(const uint32_t* pp, const uint32_t* const* vpr, const uint32_t* const* vfut,
                                    int npairs, int dv, int hd, float* o) {
  __m512 acc[G][NV];
  for (int r = 0; r < G; ++r)
    for (int u = 0; u < NV; ++u) acc[r][u] = _mm512_loadu_ps(o + r * hd + (dv + u) * 16);
  for (int t = 0; t < npairs; ++t) {
    __m512bh vv[NV];
    for (int u = 0; u < NV; ++u) {
      vv[u] = (__m512bh)_mm512_loadu_si512(vpr[t] + (dv + u) * 16);
      prefetch(vfut[t] + (dv + u) * 16);
    }
    for (int r = 0; r < G; ++r) {
      const __m512bh p = (__m512bh)_mm512_set1_epi32((int)pp[r * 8 + t]);
      for (int u = 0; u < NV; ++u) acc[r][u] = _mm512_dpbf16_ps(acc[r][u], p, vv[u]);
    }
  }
  for (int r = 0; r < G; ++r)
    for (int u = 0; u < NV; ++u) _mm512_storeu_ps(o + r * hd + (dv + u) * 16, acc[r][u]);
}

constexpr int kBfDecodePrefetchKeys = 64;  // a block of the engine's default size
// A decode-shaped task (G <= 4 rows) over a bf16 pool on dot products, head_dim % 32 == 0. attend_task_dot converts
// each chunk's K and V rows into fp32 buffers (32 KB for 16 keys at head_dim 256: the step's other data then leaves
// L1) and runs an FMA per product; here both products read the cache as it lies:
//   scores  a[r][j] = sum over 32-d vectors of K_j . (qh + ql)[r]: vdpbf16ps of K's row with q's two bf16 parts (a
//           score carries the error of K's bf16 values only, as the prefill kernel's), folded to 16 scores per row
//   softmax online over chunks of 16 keys as attend_task_dot (masks, running max, splits, sinks); P rounded to bf16,
//           l the sum of the rounded weights
//   output  o[r] += sum over token pairs of (p[2t], p[2t + 1]) . V pair row t (the cache's interleaved token pairs)
// Chunks start at an even key: a task whose first key is odd (a window start) reads the key before it, written
// and masked; a chunk's last pair whose second key lies past the task's keys takes a staging row with that half
// zeroed (the slot may be unwritten: NaN). Within ~3e-3 of the exact attention over the bf16 cache, as the other
// bf16 paths. Batch-invariant as attend_task_dot: a row's chunks and splits depend on its own keys only.
template <int G, bool Capped>
LMKIT_BF16 void attend_task_dot_bf16(const float* q, const KVLayer& kv, const AttnSeq& seq, int kvh, int group,
                                     int num_heads, int64_t rho0, float scale, float softcap, const float* sinks,
                                     int window, float* out, int64_t split_begin, int64_t split_end, float* partial) {
  const int hd = kv.head_dim, nq = hd / 32, nvec = hd / 16;
  const int64_t bs = kv.block_size_tokens, bb = kv.block_bytes();
  alignas(64) uint16_t qh[4 * kKVQuantMaxHeadDim], ql[4 * kKVQuantMaxHeadDim];  // [G][hd] bf16 parts of q
  alignas(64) float obuf[4 * kKVQuantMaxHeadDim];                                // [G][hd]
  alignas(64) uint32_t pp[4 * 8];                                                 // [G][8 token pairs]
  alignas(64) uint32_t vstage[kKVQuantMaxHeadDim];
  alignas(64) float lsum[4];
  DecodeRows<G> rows(q, seq, kvh, group, num_heads, hd, rho0, window, sinks, out, split_begin, split_end);
  for (int r = 0; r < G; ++r) {
    for (int d = 0; d < hd; ++d) {
      const uint16_t h = bf16_bits(rows.q[r][d]);
      qh[r * hd + d] = h, ql[r * hd + d] = bf16_bits(rows.q[r][d] - bfloat_to_float(h));
      obuf[r * hd + d] = 0.0f;
    }
    lsum[r] = 0.0f;
  }
  const int64_t key_lo = rows.key_lo, key_hi = rows.key_hi, pf_hi = rows.seq_end();
  const Scores score(scale, softcap);
  const uint16_t* krow[kW];
  const uint16_t* kfut[kW];
  const uint32_t* vpr[kW / 2];
  const uint32_t* vfut[kW / 2];
  auto k_row = [&](int64_t c) {
    return (const uint16_t*)((const char*)kv.k + (int64_t)seq.block_table[c / bs] * bb) + (kvh * bs + c % bs) * hd;
  };
  auto v_pair = [&](int64_t c) {  // c even
    return (const uint32_t*)((const char*)kv.v + (int64_t)seq.block_table[c / bs] * bb) + (kvh * (bs / 2) + c % bs / 2) * hd;
  };
  for (int64_t c0 = key_lo & ~(int64_t)1; c0 < key_hi; c0 += kW) {
    const int n = key_hi - c0 < kW ? (int)(key_hi - c0) : kW, npairs = (n + 1) / 2;
    for (int j = 0; j < kW; ++j) krow[j] = j < n ? k_row(c0 + j) : kZeroBf16Row;
    for (int t = 0; t < npairs; ++t) vpr[t] = v_pair(c0 + 2 * t);
    if (n % 2) {  // the last pair's second key lies past the task's keys
      for (int d = 0; d < hd; ++d) vstage[d] = vpr[npairs - 1][d] & 0x0000ffffu;
      vpr[npairs - 1] = vstage;
    }
    // the rows kBfDecodePrefetchKeys keys on, prefetched a line for a line as these are read (blocks scatter over the
    // pool, and the hardware prefetcher starts over at each), past the split's end (DecodeRows::seq_end); rows past
    // the sequence's keys prefetch this chunk's again
    for (int j = 0; j < kW; ++j)
      kfut[j] = c0 + kBfDecodePrefetchKeys + j < pf_hi ? k_row(c0 + kBfDecodePrefetchKeys + j) : krow[j];
    for (int t = 0; t < npairs; ++t)
      vfut[t] = c0 + kBfDecodePrefetchKeys + 2 * t < pf_hi ? v_pair(c0 + kBfDecodePrefetchKeys + 2 * t) : vpr[t];
    V a[G][kW];
    for (int j0 = 0; j0 < kW; j0 += 4) {
      __m512 acc[G][4];
      for (int r = 0; r < G; ++r)
        for (int i = 0; i < 4; ++i) acc[r][i] = _mm512_setzero_ps();
      for (int dv = 0; dv < nq; ++dv) {
        __m512bh kk[4];
        for (int i = 0; i < 4; ++i) {
          kk[i] = (__m512bh)_mm512_loadu_si512(krow[j0 + i] + dv * 32);
          prefetch(kfut[j0 + i] + dv * 32);
        }
        for (int r = 0; r < G; ++r) {
          const __m512bh h = (__m512bh)_mm512_loadu_si512(qh + r * hd + dv * 32);
          const __m512bh l = (__m512bh)_mm512_loadu_si512(ql + r * hd + dv * 32);
          for (int i = 0; i < 4; ++i) acc[r][i] = _mm512_dpbf16_ps(_mm512_dpbf16_ps(acc[r][i], h, kk[i]), l, kk[i]);
        }
      }
      for (int r = 0; r < G; ++r)
        for (int i = 0; i < 4; ++i) a[r][j0 + i].v = acc[r][i];
    }
    const V kpos = rows.key_positions(c0);
    for (int r = 0; r < G; ++r) {
      float c;
      const V s = rows.template scores<Capped>(vhsum(a[r]), r, c0, kpos, score, c);
      if (c != 1.0f) {
        lsum[r] *= c;
        float* o = obuf + r * hd;
        for (int dv = 0; dv < nvec; ++dv) _mm512_storeu_ps(o + dv * 16, _mm512_mul_ps(_mm512_loadu_ps(o + dv * 16), _mm512_set1_ps(c)));
      }
      const __m256bh pb = _mm512_cvtneps_pbh(exp_for_bf16(_mm512_sub_ps(s.v, _mm512_set1_ps(rows.m[r]))));
      _mm256_store_si256((__m256i*)(pp + r * 8), (__m256i)pb);  // word t = (p[2t], p[2t + 1])
      lsum[r] += _mm512_reduce_add_ps(_mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32((__m256i)pb), 16)));
    }
    int dv = 0;
    for (; dv + 4 <= nvec; dv += 4) pv_rows_bf16<G, 4>(pp, vpr, vfut, npairs, dv, hd, obuf);
    if (dv < nvec) pv_rows_bf16<G, 2>(pp, vpr, vfut, npairs, dv, hd, obuf);  // nvec is even
  }
  for (int r = 0; r < G; ++r) rows.finish(r, obuf + r * hd, lsum[r], 0.0f, hd, partial);
}

// Decode-shaped tasks of a bf16 pool on dot products (head_dim % 32 == 0; others on attend_task_dot), as a policy of
// paged_attention_with.
struct Bf16Decode {
  static constexpr int kMaxRows = 4;
  static constexpr bool kEveryTask = false;
  void begin() {}
  void end() {}
  LMKIT_BF16 void operator()(int rows, const float* q, const KVLayer& kv, const AttnSeq& seq, int kvh, int group,
                             int num_heads, int64_t rho0, float scale, float softcap, const float* sinks, int window,
                             float* out, int64_t split_begin = 0, int64_t split_end = INT64_MAX,
                             float* partial = nullptr) {
    if (kv.head_dim % 32 != 0)
      return DotDecode()(rows, q, kv, seq, kvh, group, num_heads, rho0, scale, softcap, sinks, window, out,
                         split_begin, split_end, partial);
    if (softcap > 0.0f) return run<true>(rows, q, kv, seq, kvh, group, num_heads, rho0, scale, softcap, sinks, window,
                                         out, split_begin, split_end, partial);
    run<false>(rows, q, kv, seq, kvh, group, num_heads, rho0, scale, softcap, sinks, window, out, split_begin,
               split_end, partial);
  }
  template <bool Capped>
  LMKIT_BF16 static void run(int rows, const float* q, const KVLayer& kv, const AttnSeq& seq, int kvh, int group,
                             int num_heads, int64_t rho0, float scale, float softcap, const float* sinks, int window,
                             float* out, int64_t split_begin, int64_t split_end, float* partial) {
    switch (rows) {
      case 1: return attend_task_dot_bf16<1, Capped>(q, kv, seq, kvh, group, num_heads, rho0, scale, softcap, sinks, window, out, split_begin, split_end, partial);
      case 2: return attend_task_dot_bf16<2, Capped>(q, kv, seq, kvh, group, num_heads, rho0, scale, softcap, sinks, window, out, split_begin, split_end, partial);
      case 3: return attend_task_dot_bf16<3, Capped>(q, kv, seq, kvh, group, num_heads, rho0, scale, softcap, sinks, window, out, split_begin, split_end, partial);
      default: return attend_task_dot_bf16<4, Capped>(q, kv, seq, kvh, group, num_heads, rho0, scale, softcap, sinks, window, out, split_begin, split_end, partial);
    }
  }
};

// Prefill tasks of a bf16 pool on dot products (head_dim % 16 == 0; others on attend_task), as a policy of
// paged_attention_with.
struct Bf16Prefill {
  LMKIT_BF16 static void run(int rv, const float* q, const KVLayer& kv, const AttnSeq& seq, int kvh, int group,
                             int num_heads, int64_t rho0, int64_t rho1, float scale, float softcap, const float* sinks, int window,
                             float* out) {
    if (kv.head_dim % 16 != 0) return F32Prefill::run(rv, q, kv, seq, kvh, group, num_heads, rho0, rho1, scale, softcap, sinks, window, out);
    if (rv == 1) attend_task_bf16<1>(q, kv, seq, kvh, group, num_heads, rho0, rho1, scale, softcap, sinks, window, out);
    else if (rv == 2) attend_task_bf16<2>(q, kv, seq, kvh, group, num_heads, rho0, rho1, scale, softcap, sinks, window, out);
    else attend_task_bf16<3>(q, kv, seq, kvh, group, num_heads, rho0, rho1, scale, softcap, sinks, window, out);
  }
};

void paged_attention_bf16(const float* q, const KVLayer& kv, const AttnSeq* seqs, int32_t num_seqs, int32_t num_heads,
                          float scale, int32_t window, float* out, float softcap,
                          const float* sinks) {
  paged_attention_with<Bf16Decode, Bf16Prefill>(q, kv, seqs, num_seqs, num_heads, scale, softcap, sinks, window, out);
}
#endif
