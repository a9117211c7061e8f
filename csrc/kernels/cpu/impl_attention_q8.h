// Paged attention's decode-shaped tasks over an int8 or int4 KV pool on AVX512-VNNI integer dot products
// (vpdpbusd). Textually included by isa_body.h after impl_attention.h (DecodeRows, walk_runs, the algebra of
// attend_task_dot_quant) and impl_linear.h (LMKIT_VNNI); avx512 unit only, called by dispatch.cpp only where the
// CPU has VNNI and the avx512 table is the active one. Prefill tasks stay on the fp32 path (F32Prefill).
//
// attend_task_dot_quant widens every level into fp32 and runs an FMA per product (~7 instructions a level at four
// rows); here both products run on the levels as they lie, four bytes a lane of one instruction:
//   q       each row in 16-bit fixed point, q ~= a Q with Q = 256 qh + ql, qh and ql int8 and a = max |q| / 32512
//   scores  q . c_j = a (Q . kq_j - mid sum Q), the levels kq_j (u8) against qh and ql (s8): two vpdpbusd a 64-byte
//           row chunk a row; the accumulators start at -mid times the lane sums of qh and ql, so that they hold the
//           centred dot products as exact integers, converted once; then s_j (q . c_j) + z'_j sum q as there
//   output  o += sum_j w_j cv_j with w_j = p_j s_j (V's scale) per step of 32 keys in 16-bit fixed point as well,
//           w_j ~= b W_j, W = 256 wh + wl with u8 parts and b = max_j w_j / 65280, against the centred levels
//           cv_j = vq_j - mid (s8), the rows of 4 keys interleaved byte by byte (vpunpck) so that a lane holds the
//           4 keys' levels of one d; the step's int32 sums are converted and added into o times b
// The output accumulators hold d in a permuted order, undone at the end: lane i of accumulator u of 64-d chunk c is
// d = 64 c + 16 (i / 4) + 4 u + i % 4 (an unpack works within 128-bit lanes). Both fixed points keep 15-16 bits of
// their row's (step's) largest value: q's moves the scores by ~2^-16 of max |q| |k|, which puts an output row within
// ~2e-4 of the exact attention over the pool's dequantized values (the fp32 path's ~1e-6; the pool's own rounding
// moves it by ~4e-3). Needs head_dim % 64 == 0 (Bits 8) or % 128 == 0 (Bits 4: a byte holds d in its low nibble and
// d + head_dim / 2 in its high one); DotDecode takes the others, and a task whose query is not finite (its fixed
// point has no scale; its task-mates with it, so a non-finite row moves its group's rows onto that path). Batch-
// invariant as attend_task_dot: a row's fixed points depend on its own q and keys, and the 32-key steps start at the
// task's first key (its first row's window start, or its split's begin), so a one-position task (a decode step, and
// each of speculative decoding's verification rows, which the dispatch gives tasks of their own) scores the same
// whatever the batch around it.
#if defined(__AVX512F__)
constexpr int kQ8QMax = 32512;  // 127 x 256: qh in [-127, 127]
constexpr int kQ8WMax = 65280;  // 255 x 256: wh in [0, 255]
constexpr int kQ8PrefetchKeys = 64;  // a block of the engine's default size
constexpr int kQ8StepKeys = 32;      // keys an online-softmax step: two vectors of scores, one fixed point of w
constexpr float kQ8Tiny = 1e-30f;    // a fixed point's largest value below this: all zeros (its inverse overflows)

// x[0:hd] (hd % 16 == 0) -> qh, ql (int8) with x ~= a (256 qh + ql), ql in [-128, 127]; returns a, or 0 (qh, ql
// unwritten) where x is not finite.
LMKIT_VNNI inline float q8_fixed16(const float* x, int hd, int8_t* qh, int8_t* ql) {
  __m512 m = _mm512_setzero_ps();
  __mmask16 bad = 0;
  for (int d = 0; d < hd; d += 16) {
    const __m512 v = _mm512_loadu_ps(x + d);
    bad |= _mm512_fpclass_ps_mask(v, 0x99);  // NaN, +-inf
    m = _mm512_max_ps(m, _mm512_abs_ps(v));
  }
  if (bad) return 0.0f;
  const float amax = _mm512_reduce_max_ps(m);
  const float a = amax > kQ8Tiny ? amax / (float)kQ8QMax : 1.0f;  // a tinier row: Q = 0 (1 / a would overflow)
  const __m512 inv = _mm512_set1_ps(1.0f / a);
  const __m512i top = _mm512_set1_epi32(kQ8QMax), bottom = _mm512_set1_epi32(-kQ8QMax);
  for (int d = 0; d < hd; d += 16) {
    __m512i v = _mm512_cvtps_epi32(_mm512_mul_ps(_mm512_loadu_ps(x + d), inv));  // to nearest
    v = _mm512_min_epi32(_mm512_max_epi32(v, bottom), top);
    const __m512i lo = _mm512_srai_epi32(_mm512_slli_epi32(v, 24), 24);  // the low byte, signed
    _mm_storeu_si128((__m128i*)(ql + d), _mm512_cvtepi32_epi8(lo));
    _mm_storeu_si128((__m128i*)(qh + d), _mm512_cvtepi32_epi8(_mm512_srai_epi32(_mm512_sub_epi32(v, lo), 8)));
  }
  return a;
}

// The levels of 64-byte row vector bv of a pool row (Bits 8), or its low and high nibbles (Bits 4), as u8.
template <int Bits>
LMKIT_VNNI inline void q8_levels(const uint8_t* row, int bv, __m512i& lo, __m512i& hi) {
  const __m512i x = _mm512_loadu_si512(row + bv * 64);
  if constexpr (Bits == 8) {
    lo = x;
  } else {
    const __m512i m = _mm512_set1_epi8(15);
    lo = _mm512_and_si512(x, m), hi = _mm512_and_si512(_mm512_srli_epi16(x, 4), m);
  }
}

// Row vectors of 4 keys (levels centred, s8) interleaved: x[0..1] (half 0) or x[2..3] (half 1) of the four
// accumulators' operands of a 64-d chunk, lane i of x[u] holding the 4 keys' levels of d = 16 (i / 4) + 4 u + i % 4.
LMKIT_VNNI inline void q8_interleave(const __m512i v[4], int half, __m512i& x0, __m512i& x1) {
  const __m512i a = half ? _mm512_unpackhi_epi8(v[0], v[1]) : _mm512_unpacklo_epi8(v[0], v[1]);
  const __m512i b = half ? _mm512_unpackhi_epi8(v[2], v[3]) : _mm512_unpacklo_epi8(v[2], v[3]);
  x0 = _mm512_unpacklo_epi16(a, b), x1 = _mm512_unpackhi_epi16(a, b);
}

// Arguments as attend_task_dot_quant's (impl_attention.h).
template <int G, bool Capped, int Bits>
LMKIT_VNNI void attend_task_dot_q8(const float* q, const KVLayer& kv, const AttnSeq& seq, int kvh, int group,
                                   int num_heads, int64_t rho0, float scale, float softcap, const float* sinks,
                                   int window, float* out, int64_t split_begin, int64_t split_end, float* partial) {
  const int hd = kv.head_dim, nc = hd / 64, nb = Bits == 8 ? nc : nc / 2;  // 64-d chunks; 64-byte row vectors
  const int64_t bs = kv.block_size_tokens, rb = kv.row_bytes(), bb = kv.block_bytes();
  const int64_t params_at = (int64_t)kv.num_kv_heads * bs * rb;
  constexpr int mid = 1 << (Bits - 1), KC = kQ8StepKeys;
  alignas(64) int8_t qh[4 * kKVQuantMaxHeadDim], ql[4 * kKVQuantMaxHeadDim];  // [G][hd]
  alignas(64) float obuf[4 * kKVQuantMaxHeadDim];  // [G][hd]: sum_j w_j cv_j, d permuted (above)
  alignas(64) float onat[kKVQuantMaxHeadDim];
  alignas(64) int32_t corr_h[4 * 16], corr_l[4 * 16];  // [G][16]: -mid x the lane sums of qh, ql
  alignas(64) uint8_t wh[4 * KC], wl[4 * KC];           // [G][KC keys]: W's parts
  alignas(64) float lsum[4 * kW], zl[4 * kW];           // [G][kW]: sums of p_j and of p_j z'_j (V's zeros)
  alignas(64) uint16_t ks[KC], kz[KC], vs[KC], vz[KC];  // the step's (scale, zero) pairs, fp16
  float qa[G], qsum[G], wb[G];
  DecodeRows<G> rows(q, seq, kvh, group, num_heads, hd, rho0, window, sinks, out, split_begin, split_end);
  for (int r = 0; r < G; ++r)  // a row that is not finite: the task on the fp32 kernel (its fixed point has no scale)
    if ((qa[r] = q8_fixed16(rows.q[r], hd, qh + r * hd, ql + r * hd)) == 0.0f)
      return attend_task_dot_quant<G, Capped, Bits>(q, kv, seq, kvh, group, num_heads, rho0, scale, softcap, sinks,
                                                    window, out, split_begin, split_end, partial);
  for (int r = 0; r < G; ++r) {
    V sum = vzero();
    for (int d = 0; d < hd; d += kW) sum = sum + vload(rows.q[r] + d), vstore(obuf + r * hd + d, vzero());
    qsum[r] = vsum(sum);
    __m512i ch = _mm512_setzero_si512(), cl = _mm512_setzero_si512();
    const __m512i m = _mm512_set1_epi8((char)mid);
    for (int c = 0; c < nc; ++c) {
      ch = _mm512_dpbusd_epi32(ch, m, _mm512_loadu_si512(qh + r * hd + c * 64));
      cl = _mm512_dpbusd_epi32(cl, m, _mm512_loadu_si512(ql + r * hd + c * 64));
    }
    _mm512_store_si512(corr_h + r * 16, _mm512_sub_epi32(_mm512_setzero_si512(), ch));
    _mm512_store_si512(corr_l + r * 16, _mm512_sub_epi32(_mm512_setzero_si512(), cl));
    vstore(lsum + r * kW, vzero());
    vstore(zl + r * kW, vzero());
  }
  const int64_t key_lo = rows.key_lo, key_hi = rows.key_hi, pf_hi = rows.seq_end();
  const Scores score(scale, softcap);
  const uint8_t* kzero = (const uint8_t*)kZeroRow;  // levels of the keys past the step's end: never weighed
  const uint8_t* krow[KC];
  const uint8_t* vrow[KC];
  const uint8_t* kfut[KC];
  const uint8_t* vfut[KC];
  auto block_at = [&](int64_t c) { return (int64_t)seq.block_table[c / bs] * bb; };
  const __m512i centre = _mm512_set1_epi8(Bits == 8 ? (char)0x80 : (char)8);
  const V midv = vset1((float)mid);
  for (int64_t c0 = key_lo; c0 < key_hi; c0 += KC) {
    const int n = key_hi - c0 < KC ? (int)(key_hi - c0) : KC;
    for (int j = 0; j < KC; ++j) {
      if (j < n) {
        const int64_t at = block_at(c0 + j), r = kvh * bs + (c0 + j) % bs;
        const uint16_t* kp = (const uint16_t*)((const char*)kv.k + at + params_at) + 2 * r;
        const uint16_t* vp = (const uint16_t*)((const char*)kv.v + at + params_at) + 2 * r;
        krow[j] = (const uint8_t*)kv.k + at + r * rb, vrow[j] = (const uint8_t*)kv.v + at + r * rb;
        ks[j] = kp[0], kz[j] = kp[1], vs[j] = vp[0], vz[j] = vp[1];
      } else {
        krow[j] = vrow[j] = kzero, ks[j] = kz[j] = vs[j] = vz[j] = 0;
      }
      // the rows kQ8PrefetchKeys keys on, prefetched beside the reads of these (a line for a line, in the loops
      // below; a burst here stalls on the cache's fill buffers); rows past the keys the task and its successors
      // read prefetch this step's again
      const int64_t f = c0 + kQ8PrefetchKeys + j;
      if (f < pf_hi) {
        const int64_t at = block_at(f), r = kvh * bs + f % bs;
        kfut[j] = (const uint8_t*)kv.k + at + r * rb, vfut[j] = (const uint8_t*)kv.v + at + r * rb;
        if (j % 16 == 0 || f % bs == 0)  // their (scale, zero) pairs: 16 rows a line
          prefetch((const char*)kv.k + at + params_at + 4 * r), prefetch((const char*)kv.v + at + params_at + 4 * r);
      } else {
        kfut[j] = krow[j], vfut[j] = vrow[j];
      }
    }
    // scores of the step's two vectors of keys: a[r][j] = Q_r . c_j, KJ keys x G rows x (hi, lo) accumulators at
    // a time; then scaled, masked and the rows' maxima raised (cf: the factor of the rows' sums so far)
    constexpr int KJ = G <= 2 ? 4 : 2;
    V s[G][2];
    float cf[G];
    for (int r = 0; r < G; ++r) cf[r] = 1.0f;
    for (int hv = 0; hv < 2; ++hv) {
      const int k0 = hv * kW;
      V a[G][kW];
      for (int j0 = 0; j0 < kW; j0 += KJ) {
        __m512i ah[G][KJ], al[G][KJ];
        for (int r = 0; r < G; ++r)
          for (int i = 0; i < KJ; ++i)
            ah[r][i] = _mm512_load_si512(corr_h + r * 16), al[r][i] = _mm512_load_si512(corr_l + r * 16);
        for (int bv = 0; bv < nb; ++bv) {
          __m512i klo[KJ], khi[KJ];
          for (int i = 0; i < KJ; ++i) {
            q8_levels<Bits>(krow[k0 + j0 + i], bv, klo[i], khi[i]);
            prefetch(kfut[k0 + j0 + i] + bv * 64);
          }
          for (int r = 0; r < G; ++r) {
            const __m512i h = _mm512_loadu_si512(qh + r * hd + bv * 64), l = _mm512_loadu_si512(ql + r * hd + bv * 64);
            for (int i = 0; i < KJ; ++i)
              ah[r][i] = _mm512_dpbusd_epi32(ah[r][i], klo[i], h), al[r][i] = _mm512_dpbusd_epi32(al[r][i], klo[i], l);
            if constexpr (Bits == 4) {  // the high nibbles: d + head_dim / 2
              const __m512i h2 = _mm512_loadu_si512(qh + r * hd + (bv + nb) * 64);
              const __m512i l2 = _mm512_loadu_si512(ql + r * hd + (bv + nb) * 64);
              for (int i = 0; i < KJ; ++i)
                ah[r][i] = _mm512_dpbusd_epi32(ah[r][i], khi[i], h2),
                al[r][i] = _mm512_dpbusd_epi32(al[r][i], khi[i], l2);
            }
          }
        }
        for (int r = 0; r < G; ++r)
          for (int i = 0; i < KJ; ++i)
            a[r][j0 + i].v = _mm512_cvtepi32_ps(_mm512_add_epi32(_mm512_slli_epi32(ah[r][i], 8), al[r][i]));
      }
      const V kpos = rows.key_positions(c0 + k0), kscale = vload_f16(ks + k0);
      const V kzero_v = vfma(midv, kscale, vload_f16(kz + k0));
      for (int r = 0; r < G; ++r) {
        float c;
        const V dot = vfma(vhsum(a[r]) * vset1(qa[r]), kscale, kzero_v * vset1(qsum[r]));
        s[r][hv] = rows.template scores<Capped>(dot, r, c0 + k0, kpos, score, c);
        cf[r] *= c;
      }
    }
    const V vscale0 = vload_f16(vs), vscale1 = vload_f16(vs + kW);
    const V vzero0 = vfma(midv, vscale0, vload_f16(vz)), vzero1 = vfma(midv, vscale1, vload_f16(vz + kW));
    for (int r = 0; r < G; ++r) {
      V l = vload(lsum + r * kW), z = vload(zl + r * kW);
      if (cf[r] != 1.0f) {
        const V c = vset1(cf[r]);
        l = l * c, z = z * c;
        float* o = obuf + r * hd;
        for (int d = 0; d < hd; d += kW) vstore(o + d, vload(o + d) * c);
      }
      const V m = vset1(rows.m[r]), p0 = vexp(s[r][0] - m), p1 = vexp(s[r][1] - m);
      vstore(lsum + r * kW, l + p0 + p1);
      vstore(zl + r * kW, vfma(p1, vzero1, vfma(p0, vzero0, z)));
      // w = p s in 16-bit fixed point, b = max w / kQ8WMax (0: no weight in this step, or under kQ8Tiny of the
      // running max's 1); V's scales are >= 0 (kv_write's (max - min) / levels)
      const V w0 = p0 * vscale0, w1 = p1 * vscale1;
      const float wmax = vhmax(vmax(w0, w1));
      wb[r] = wmax > kQ8Tiny ? wmax / (float)kQ8WMax : 0.0f;
      const V inv = vset1(wmax > kQ8Tiny ? 1.0f / wb[r] : 0.0f);
      for (int hv = 0; hv < 2; ++hv) {
        const __m512i W = _mm512_min_epi32(
            _mm512_max_epi32(_mm512_cvtps_epi32(((hv ? w1 : w0) * inv).v), _mm512_setzero_si512()),
            _mm512_set1_epi32(kQ8WMax));
        _mm_store_si128((__m128i*)(wh + r * KC + hv * kW), _mm512_cvtepi32_epi8(_mm512_srli_epi32(W, 8)));
        _mm_store_si128((__m128i*)(wl + r * KC + hv * kW),
                        _mm512_cvtepi32_epi8(_mm512_and_si512(W, _mm512_set1_epi32(255))));
      }
    }
    // output: o[r] += b_r sum_j W_j cv_j, a 64-d chunk at a time, its four accumulators in passes of NH halves
    // (G x 2 NH x (hi, lo) accumulators in registers)
    constexpr int NH = G <= 2 ? 2 : 1;
    const int ngroups = (n + 3) / 4;
    for (int c = 0; c < nc; ++c) {
      const int bv = c % nb, high = c / nb;  // Bits 4: chunks of head_dim's second half are the high nibbles
      for (int h0 = 0; h0 < 2; h0 += NH) {
        __m512i sh[G][2 * NH], sl[G][2 * NH];
        for (int r = 0; r < G; ++r)
          for (int u = 0; u < 2 * NH; ++u) sh[r][u] = sl[r][u] = _mm512_setzero_si512();
        for (int g = 0; g < ngroups; ++g) {
          __m512i v[4];
          for (int t = 0; t < 4; ++t) {
            __m512i lo, hi;
            q8_levels<Bits>(vrow[4 * g + t], bv, lo, hi);
            if (h0 == 0 && !high) prefetch(vfut[4 * g + t] + bv * 64);
            v[t] = Bits == 8 ? _mm512_xor_si512(lo, centre) : _mm512_sub_epi8(high ? hi : lo, centre);
          }
          __m512i x[2 * NH];
          for (int h = 0; h < NH; ++h) q8_interleave(v, h0 + h, x[2 * h], x[2 * h + 1]);
          for (int r = 0; r < G; ++r) {
            int32_t h4, l4;  // the 4 keys' parts as one 32-bit word
            memcpy(&h4, wh + r * KC + 4 * g, 4), memcpy(&l4, wl + r * KC + 4 * g, 4);
            const __m512i bh = _mm512_set1_epi32(h4), bl = _mm512_set1_epi32(l4);
            for (int u = 0; u < 2 * NH; ++u)
              sh[r][u] = _mm512_dpbusd_epi32(sh[r][u], bh, x[u]), sl[r][u] = _mm512_dpbusd_epi32(sl[r][u], bl, x[u]);
          }
        }
        for (int r = 0; r < G; ++r)
          for (int u = 0; u < 2 * NH; ++u) {
            float* o = obuf + r * hd + c * 64 + (2 * h0 + u) * 16;
            const __m512 sum = _mm512_cvtepi32_ps(_mm512_add_epi32(_mm512_slli_epi32(sh[r][u], 8), sl[r][u]));
            _mm512_storeu_ps(o, _mm512_fmadd_ps(sum, _mm512_set1_ps(wb[r]), _mm512_loadu_ps(o)));
          }
      }
    }
  }
  for (int r = 0; r < G; ++r) {  // d back in order; plus sum_j p_j z'_j, V's zeros, in every d
    const float* o = obuf + r * hd;
    for (int c = 0; c < nc; ++c) {  // a 4 x 4 transpose of 128-bit lanes: [u][i / 4] -> [i / 4][u]
      const __m512 u0 = _mm512_loadu_ps(o + c * 64), u1 = _mm512_loadu_ps(o + c * 64 + 16);
      const __m512 u2 = _mm512_loadu_ps(o + c * 64 + 32), u3 = _mm512_loadu_ps(o + c * 64 + 48);
      const __m512 a01 = _mm512_shuffle_f32x4(u0, u1, 0x44), b01 = _mm512_shuffle_f32x4(u0, u1, 0xEE);
      const __m512 a23 = _mm512_shuffle_f32x4(u2, u3, 0x44), b23 = _mm512_shuffle_f32x4(u2, u3, 0xEE);
      _mm512_storeu_ps(onat + c * 64, _mm512_shuffle_f32x4(a01, a23, 0x88));
      _mm512_storeu_ps(onat + c * 64 + 16, _mm512_shuffle_f32x4(a01, a23, 0xDD));
      _mm512_storeu_ps(onat + c * 64 + 32, _mm512_shuffle_f32x4(b01, b23, 0x88));
      _mm512_storeu_ps(onat + c * 64 + 48, _mm512_shuffle_f32x4(b01, b23, 0xDD));
    }
    rows.finish(r, onat, vsum(vload(lsum + r * kW)), vsum(vload(zl + r * kW)), hd, partial);
  }
}

template <int G>
struct RowsOf {  // a task's row count as a type (no standard library in an ISA unit: isa_prelude.h)
  static constexpr int kRows = G;
};

// Decode-shaped tasks of an int8 / int4 pool on VNNI (head_dim % 64, or % 128 for int4; others on DotDecode, and
// tasks with a query row that is not finite on attend_task_dot_quant), as a policy of paged_attention_with.
struct Q8Decode {
  static constexpr int kMaxRows = 4;
  static constexpr bool kEveryTask = false;
  void begin() {}
  void end() {}
  LMKIT_VNNI void operator()(int rows, const float* q, const KVLayer& kv, const AttnSeq& seq, int kvh, int group,
                             int num_heads, int64_t rho0, float scale, float softcap, const float* sinks, int window,
                             float* out, int64_t split_begin = 0, int64_t split_end = INT64_MAX,
                             float* partial = nullptr) {
    const bool fits = (kv.bits == 8 && kv.head_dim % 64 == 0) || (kv.bits == 4 && kv.head_dim % 128 == 0);
    if (fits) {
      if (softcap > 0.0f) return run<true>(rows, q, kv, seq, kvh, group, num_heads, rho0, scale, softcap, sinks,
                                           window, out, split_begin, split_end, partial);
      return run<false>(rows, q, kv, seq, kvh, group, num_heads, rho0, scale, softcap, sinks, window, out,
                        split_begin, split_end, partial);
    }
    DotDecode()(rows, q, kv, seq, kvh, group, num_heads, rho0, scale, softcap, sinks, window, out, split_begin,
                split_end, partial);
  }
  template <bool Capped>
  LMKIT_VNNI static void run(int rows, const float* q, const KVLayer& kv, const AttnSeq& seq, int kvh, int group,
                             int num_heads, int64_t rho0, float scale, float softcap, const float* sinks, int window,
                             float* out, int64_t split_begin, int64_t split_end, float* partial) {
    if (kv.bits == 8) return run_bits<Capped, 8>(rows, q, kv, seq, kvh, group, num_heads, rho0, scale, softcap, sinks,
                                                 window, out, split_begin, split_end, partial);
    run_bits<Capped, 4>(rows, q, kv, seq, kvh, group, num_heads, rho0, scale, softcap, sinks, window, out,
                        split_begin, split_end, partial);
  }
  template <bool Capped, int Bits>
  LMKIT_VNNI static void run_bits(int rows, const float* q, const KVLayer& kv, const AttnSeq& seq, int kvh, int group,
                                  int num_heads, int64_t rho0, float scale, float softcap, const float* sinks,
                                  int window, float* out, int64_t split_begin, int64_t split_end, float* partial) {
    auto task = [&](auto g) {  // g: a RowsOf<G>
      attend_task_dot_q8<decltype(g)::kRows, Capped, Bits>(q, kv, seq, kvh, group, num_heads, rho0, scale, softcap,
                                                           sinks, window, out, split_begin, split_end, partial);
    };
    switch (rows) {
      case 1: return task(RowsOf<1>());
      case 2: return task(RowsOf<2>());
      case 3: return task(RowsOf<3>());
      default: return task(RowsOf<4>());
    }
  }
};

void paged_attention_q8(const float* q, const KVLayer& kv, const AttnSeq* seqs, int32_t num_seqs, int32_t num_heads,
                        float scale, int32_t window, float* out, float softcap, const float* sinks) {
  paged_attention_with<Q8Decode>(q, kv, seqs, num_seqs, num_heads, scale, softcap, sinks, window, out);
}
#endif
