// Paged attention over a bf16 KV cache on AMX tiles (AMX-BF16): every task (up to 16 query rows of one sequence
// and kv head: a decode step, or 16 rows of a prefill chunk) as two tile products. Textually
// included by isa_body.h after impl_attention_bf16.h (exp_for_bf16) and impl_linear_bf16.h (amx_configure); avx512 unit only,
// called by dispatch.cpp only once the process may use the tiles, for head_dim % 32 == 0 and
// block_size_tokens % 32 == 0 (so that 32 keys never straddle a block).
//
// A task's R <= 16 rows (query heads x positions) over keys [k_lo, k_hi), in two passes (exact softmax):
//   scores  S^T[16 keys x 16 rows]  = K[16 keys x 32 d] . Q^T[32 d x 16 rows]   per 32 d, tiles 0 (C) 1 (K) 2 (Q^T)
//           K rows come straight from the cache; Q^T is the task's rows as pairs of d (VNNI), built once;
//           S^T transposed in registers; row r scaled and masked -> S[r][keys] (fp32)
//   softmax S[r] soft-capped in place first when capped (Scores), m_r = max S[r], P[r][j] = bf16(exp(S[r][j] - m_r)),
//           l_r = sum of those bf16 values
//   output  O[16 rows x 16 d]      += P[16 rows x 32 keys] . V[32 keys x 16 d]   tiles 4-7 (C) 1 (P) 2 (V)
//           V's token pairs are interleaved in the cache (ops.h): 16 pair rows are exactly the VNNI operand
//   out[r] = O[r] / l_r     (or, for a split of the keys, the unnormalised state (m_r, l_r, O[r]))
// Keys at or past ctx_len in the last block were never written (they may hold anything, NaN included):
// their scores are masked by selection, and their V rows are replaced by zeros in a staging tile, since
// 0 * NaN would otherwise reach O. P is rounded to bf16 (the products and sums stay fp32), from an exp good to
// 1e-5: each output row is within ~3e-3 (relative) of the exact attention over the bf16 cache, whatever the
// scale of the scores (tested at 5e-3, per row).
#if defined(LMKIT_HAVE_AMX)
constexpr int kAmxAttnRows = 16;    // query rows of a decode task on tiles
constexpr int kAmxAttnKeys = 32;    // keys per P . V step (and the alignment of the key range)

// The 16 x 16 fp32 matrix in x[0..15] (x[i] = row i), transposed in registers: unpacks build the columns of
// each 4-row group within 128-bit lanes, then two rounds of lane shuffles gather the four groups (a gather
// per row cost about as much as the tile products of the scores).
LMKIT_AMX inline void transpose16x16(__m512 x[16]) {
  __m512 t[16];
  for (int i = 0; i < 8; ++i) {
    t[2 * i] = _mm512_unpacklo_ps(x[2 * i], x[2 * i + 1]);
    t[2 * i + 1] = _mm512_unpackhi_ps(x[2 * i], x[2 * i + 1]);
  }
  // u[4g + c], 128-bit lane j: column 4j + c of rows 4g .. 4g + 3
  __m512 u[16];
  for (int g = 0; g < 4; ++g) {
    const __m512d lo0 = _mm512_castps_pd(t[4 * g]), lo1 = _mm512_castps_pd(t[4 * g + 2]);
    const __m512d hi0 = _mm512_castps_pd(t[4 * g + 1]), hi1 = _mm512_castps_pd(t[4 * g + 3]);
    u[4 * g] = _mm512_castpd_ps(_mm512_unpacklo_pd(lo0, lo1));
    u[4 * g + 1] = _mm512_castpd_ps(_mm512_unpackhi_pd(lo0, lo1));
    u[4 * g + 2] = _mm512_castpd_ps(_mm512_unpacklo_pd(hi0, hi1));
    u[4 * g + 3] = _mm512_castpd_ps(_mm512_unpackhi_pd(hi0, hi1));
  }
  for (int c = 0; c < 4; ++c) {  // a 4 x 4 transpose of 128-bit lanes: x[4j + c] = lane j of u[c], u[4 + c], ...
    const __m512 v0 = _mm512_shuffle_f32x4(u[c], u[4 + c], 0x44), v1 = _mm512_shuffle_f32x4(u[c], u[4 + c], 0xee);
    const __m512 v2 = _mm512_shuffle_f32x4(u[8 + c], u[12 + c], 0x44);
    const __m512 v3 = _mm512_shuffle_f32x4(u[8 + c], u[12 + c], 0xee);
    x[c] = _mm512_shuffle_f32x4(v0, v2, 0x88);
    x[4 + c] = _mm512_shuffle_f32x4(v0, v2, 0xdd);
    x[8 + c] = _mm512_shuffle_f32x4(v1, v3, 0x88);
    x[12 + c] = _mm512_shuffle_f32x4(v1, v3, 0xdd);
  }
}

struct AmxDecode {
  static constexpr int kMaxRows = kAmxAttnRows;
  static constexpr bool kEveryTask = true;  // prefill rows too: tiles beat the fp32 dot path at any task shape
  LMKIT_AMX void begin() { amx_configure(); }
  LMKIT_AMX void end() { _tile_release(); }
  LMKIT_AMX void operator()(int rows, const float* q, const KVLayer& kv, const AttnSeq& seq, int kvh, int group,
                            int num_heads, int64_t rho0, float scale, float softcap, const float* sinks, int window, float* out,
                            int64_t split_begin = 0, int64_t split_end = INT64_MAX, float* partial = nullptr);
};

LMKIT_AMX void AmxDecode::operator()(int R, const float* q, const KVLayer& kv, const AttnSeq& seq, int kvh,
                                     int group, int num_heads, int64_t rho0, float scale, float softcap, const float* sinks, int window,
                                     float* out, int64_t split_begin, int64_t split_end, float* partial) {
  const int64_t hd = kv.head_dim, bs = kv.block_size_tokens, bb = kv.block_bytes();
  const int64_t first_pos = (int64_t)seq.ctx_len - seq.q_len;
  float pos[kAmxAttnRows], lo[kAmxAttnRows];
  float* orow[kAmxAttnRows];
  // Q^T as pairs of d: qt[c][pr][r] = (q[r][32c + 2pr], q[r][32c + 2pr + 1]), zero for r >= R; q in two bf16
  // parts, q = hi + lo (qt_hi, qt_lo: 16 bits of mantissa between them), so that the scores carry the error
  // of K's bf16 values only: a q rounded to bf16 would put ~2^-9 |q| |k| into every score, which exp turns
  // into a relative error of that size in P (2.5e-2 at scores of 20x unit scale).
  alignas(64) uint32_t qt_hi[kKVQuantMaxHeadDim / 32 * 16 * 16], qt_lo[kKVQuantMaxHeadDim / 32 * 16 * 16];
  memset(qt_hi, 0, (size_t)(hd / 32) * 16 * 16 * 4);
  memset(qt_lo, 0, (size_t)(hd / 32) * 16 * 16 * 4);
  for (int r = 0; r < R; ++r) {
    const int64_t rho = rho0 + r, head = (int64_t)kvh * group + rho % group, row = seq.q_row + rho / group;
    const int64_t p = first_pos + rho / group;
    const float* qr = q + (row * num_heads + head) * hd;
    for (int64_t d = 0; d < hd; d += 2) {
      const uint16_t h0 = bf16_bits(qr[d]), h1 = bf16_bits(qr[d + 1]);
      const uint16_t l0 = bf16_bits(qr[d] - bfloat_to_float(h0)), l1 = bf16_bits(qr[d + 1] - bfloat_to_float(h1));
      const int64_t at = (d / 32) * 256 + ((d % 32) / 2) * 16 + r;
      qt_hi[at] = (uint32_t)h0 | (uint32_t)h1 << 16;
      qt_lo[at] = (uint32_t)l0 | (uint32_t)l1 << 16;
    }
    orow[r] = out + (row * num_heads + head) * hd;
    pos[r] = (float)p;
    lo[r] = window > 0 && p - window + 1 > 0 ? (float)(p - window + 1) : 0.0f;
  }
  int64_t k_lo = (int64_t)lo[0], k_hi = (int64_t)pos[R - 1] + 1;  // rows are in position order
  k_lo = k_lo > split_begin ? k_lo : split_begin;
  k_hi = k_hi < split_end ? k_hi : split_end;
  // aligned start: in k_lo's block (block_size_tokens % 32 == 0), so no block before the window's is read
  const int64_t a0 = k_lo / kAmxAttnKeys * kAmxAttnKeys;
  const int64_t len = (k_hi - a0 + kAmxAttnKeys - 1) / kAmxAttnKeys * kAmxAttnKeys;       // keys from a0
  thread_local ScratchBuffer s_buf, p_buf;
  float* S = (float*)s_buf.get((size_t)(R * len) * 4);              // [R][len] scores, masked
  uint16_t* P = (uint16_t*)p_buf.get((size_t)(kAmxAttnRows * len) * 2);  // [16][len] bf16, rows >= R zero

  // GCC's _tile_loadd has no memory operand: keep the stores to qt_hi / qt_lo (and below P, vstage) before it
  asm volatile("" ::: "memory");
  // ---- scores: 16 keys at a time
  alignas(64) float sbuf[16 * 16];
  const Scores score(scale, softcap);
  const __m512 neg_inf = _mm512_set1_ps(-INFINITY);
  const __m512 key_iota = _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
  const __m512 v_lo = _mm512_set1_ps((float)k_lo), v_hi = _mm512_set1_ps((float)k_hi);
  // A task's blocks lie scattered over the pool, and the hardware prefetcher starts over at each of them: as
  // 16 keys' K rows (32 keys' V pair rows) are read, the same rows of the next block (keys bs later) are
  // prefetched, where that block holds some of the task's keys (walk_runs' KVPrefetch, for tiles).
  const int64_t k_rows_bytes = 16 * hd * 2, v_rows_bytes = kAmxAttnKeys * hd * 2;
  for (int64_t c0 = a0; c0 < k_hi; c0 += 16) {
    const int64_t k_at = ((int64_t)kvh * bs + c0 % bs) * hd * 2;
    const char* kb = (const char*)kv.k + (int64_t)seq.block_table[c0 / bs] * bb + k_at;
    if ((c0 / bs + 1) * bs < k_hi) {
      const char* next = (const char*)kv.k + (int64_t)seq.block_table[c0 / bs + 1] * bb + k_at;
      for (int64_t o = 0; o < k_rows_bytes; o += 64) prefetch(next + o);
    }
    _tile_zero(0);
    for (int64_t c = 0; c < hd / 32; ++c) {
      _tile_loadd(1, kb + c * 64, hd * 2);
      _tile_loadd(2, qt_hi + c * 256, 64);
      _tile_dpbf16ps(0, 1, 2);
      _tile_loadd(2, qt_lo + c * 256, 64);
      _tile_dpbf16ps(0, 1, 2);
    }
    _tile_stored(0, sbuf, 64);
    __m512 rows[16];  // S^T's 16 keys -> S's 16 rows
    for (int j = 0; j < 16; ++j) rows[j] = _mm512_load_ps(sbuf + 16 * j);
    transpose16x16(rows);
    const __m512 kpos = _mm512_add_ps(key_iota, _mm512_set1_ps((float)c0));
    const __mmask16 in_range = _mm512_cmp_ps_mask(kpos, v_lo, _CMP_GE_OQ) & _mm512_cmp_ps_mask(kpos, v_hi, _CMP_LT_OQ);
    for (int r = 0; r < R; ++r) {
      const __m512 s = _mm512_mul_ps(rows[r], score.post.v);
      const __mmask16 seen = in_range & _mm512_cmp_ps_mask(kpos, _mm512_set1_ps(pos[r]), _CMP_LE_OQ) &
                             _mm512_cmp_ps_mask(kpos, _mm512_set1_ps(lo[r]), _CMP_GE_OQ);
      _mm512_storeu_ps(S + r * len + (c0 - a0), _mm512_mask_blend_ps(seen, neg_inf, s));
    }
  }
  for (int64_t j = (k_hi - a0 + 15) / 16 * 16; j < len; j += 16)  // the last 32 keys' second half, unscored
    for (int r = 0; r < R; ++r) _mm512_storeu_ps(S + r * len + j, neg_inf);

  // ---- softmax per row, over 16 keys at a time; P in bf16
  float m[kAmxAttnRows], l[kAmxAttnRows];
  for (int r = 0; r < R; ++r) {
    float* sr = S + r * len;
    score.cap_in_place(sr, len);  // here, only R rows (not S^T's 16) and out of the 16-register loop above
    __m512 mx = _mm512_set1_ps(kAttnNoMax);
    for (int64_t j = 0; j < len; j += 16) mx = _mm512_max_ps(mx, _mm512_loadu_ps(sr + j));
    m[r] = _mm512_reduce_max_ps(mx);
    const __m512 vm = _mm512_set1_ps(m[r]);
    __m512 sum = _mm512_setzero_ps();
    uint16_t* pr = P + r * len;
    for (int64_t j = 0; j < len; j += 32) {
      const __m512 e0 = exp_for_bf16(_mm512_sub_ps(_mm512_loadu_ps(sr + j), vm));
      const __m512 e1 = exp_for_bf16(_mm512_sub_ps(_mm512_loadu_ps(sr + j + 16), vm));
      const __m512i packed = (__m512i)_mm512_cvtne2ps_pbh(e1, e0);  // e0's 16 values, then e1's
      _mm512_storeu_si512(pr + j, packed);
      // the sum of what P . V will weigh: the bf16 values, widened back
      sum = _mm512_add_ps(sum, _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm512_castsi512_si256(packed)), 16)));
      sum = _mm512_add_ps(sum, _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm512_extracti64x4_epi64(packed, 1)), 16)));
    }
    l[r] = _mm512_reduce_add_ps(sum);
  }
  for (int r = R; r < kAmxAttnRows; ++r) memset(P + r * len, 0, (size_t)len * 2);
  asm volatile("" ::: "memory");

  // ---- P . V: 32 keys (16 token pairs) x 16 d per tile, 64 d (4 accumulators) per pass over the keys
  alignas(64) uint32_t vstage[16 * kKVQuantMaxHeadDim];  // pair rows of a last block's partly written 32 keys
  alignas(64) float obuf[16 * kKVQuantMaxHeadDim];
  for (int64_t dg = 0; dg < hd; dg += 64) {
    const int nt = hd - dg >= 64 ? 4 : (int)((hd - dg) / 16);  // hd % 32 == 0: 2 or 4 tiles
    _tile_zero(4);
    _tile_zero(5);
    _tile_zero(6);
    _tile_zero(7);
    for (int64_t k0 = a0; k0 < k_hi; k0 += kAmxAttnKeys) {
      const int64_t v_at = ((int64_t)kvh * (bs / 2) + (k0 % bs) / 2) * hd * 4;
      const uint32_t* vp = (const uint32_t*)((const char*)kv.v + (int64_t)seq.block_table[k0 / bs] * bb + v_at);
      if (dg == 0 && (k0 / bs + 1) * bs < k_hi) {  // later passes over d find the rows in cache
        const char* next = (const char*)kv.v + (int64_t)seq.block_table[k0 / bs + 1] * bb + v_at;
        for (int64_t o = 0; o < v_rows_bytes; o += 64) prefetch(next + o);
      }
      const int64_t written = seq.ctx_len - k0;  // keys of this step that hold data
      if (written < kAmxAttnKeys) {
        memset(vstage, 0, (size_t)16 * hd * 4);
        for (int64_t pr = 0; pr < written / 2; ++pr) memcpy(vstage + pr * hd, vp + pr * hd, (size_t)hd * 4);
        if (written % 2)  // the pair's second token is unwritten: keep the first's half only
          for (int64_t d = 0; d < hd; ++d) vstage[(written / 2) * hd + d] = vp[(written / 2) * hd + d] & 0xffffu;
        vp = vstage;
        asm volatile("" ::: "memory");
      }
      _tile_loadd(1, P + (k0 - a0), len * 2);
      _tile_loadd(2, vp + dg, hd * 4);
      _tile_dpbf16ps(4, 1, 2);
      _tile_loadd(2, vp + dg + 16, hd * 4);
      _tile_dpbf16ps(5, 1, 2);
      if (nt == 4) {
        _tile_loadd(2, vp + dg + 32, hd * 4);
        _tile_dpbf16ps(6, 1, 2);
        _tile_loadd(2, vp + dg + 48, hd * 4);
        _tile_dpbf16ps(7, 1, 2);
      }
    }
    _tile_stored(4, obuf + dg, hd * 4);
    _tile_stored(5, obuf + dg + 16, hd * 4);
    if (nt == 4) {
      _tile_stored(6, obuf + dg + 32, hd * 4);
      _tile_stored(7, obuf + dg + 48, hd * 4);
    }
  }
  for (int r = 0; r < R; ++r) {
    float* dst = partial ? partial + r * (hd + 2) + 2 : orow[r];
    if (partial) dst[-2] = m[r], dst[-1] = l[r];
    const int64_t head = (int64_t)kvh * group + (rho0 + r) % group;
    const __m512 inv = _mm512_set1_ps(partial ? 1.0f : 1.0f / (l[r] + sink_weight(sinks, head, m[r])));
    for (int64_t d = 0; d < hd; d += 16) _mm512_storeu_ps(dst + d, _mm512_mul_ps(_mm512_loadu_ps(obuf + r * hd + d), inv));
  }
}

LMKIT_AMX void paged_attention_amx(const float* q, const KVLayer& kv, const AttnSeq* seqs, int32_t num_seqs,
                                   int32_t num_heads, float scale, int32_t window, float* out, float softcap,
                          const float* sinks) {
  paged_attention_with<AmxDecode>(q, kv, seqs, num_seqs, num_heads, scale, softcap, sinks, window, out);
}
#endif
