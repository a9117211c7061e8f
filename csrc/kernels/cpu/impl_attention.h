// paged_attention: causal attention of each sequence's query rows over its keys in the blocked KV pool.
// Textually included by isa_body.h inside the ISA namespace (see simd.h); written once for every ISA.
//
// Work is split into tasks of up to R "rows" of one (sequence, kv head): row rho = i * group + g is
// query position i of the sequence with query head kv_head * group + g, so a decode step is one task
// holding the group's heads and a prefill chunk is many. Keys are walked in chunks through the block
// table; a row masks keys after its own position (causal) and before its sliding window; keys past
// the task's last query position are never read, so unused pool slots are never touched, and neither
// are keys before the window of the task's first row: the walk starts there, so the block table is
// read only over blocks some window reaches (the engine may put -1 in the others: freed blocks).
// Scores are s = scale * q . k, or cap * tanh(scale * q . k / cap) with logit soft-capping (Scores).
//
// Prefill tasks (attend_task): scores computed transposed, vectorised over the task's rows, so that
// neither K nor the softmax needs a horizontal reduction:
//   qt[hd][R]        <- the task's query rows, transposed once per task
//   st[j][0:R]        = sum_d K_j[d] * qt[d][0:R]        K_j[d] broadcast, 8 keys x R rows at a time
//   m, l [0:R]        online softmax in fp32, lane-wise over the rows (max over keys is vertical)
//   o[r][0:hd]       += sum_j st[j][r] * V_j[0:hd]       4 rows x 4 vectors of head_dim at a time
// Decode tasks (<= 4 rows, attend_task_dot; attend_task_dot_quant over int8 / int4 pools; attend_task_dot_bf16 over
// bf16 pools on AVX512_BF16, impl_attention_bf16.h): dot products over head_dim, see there. A decode task whose keys
// cross a multiple of kAttnSplitKeys is split there over its keys and the partial softmax states are merged
// (attend_merge): fixed segments, so that no row depends on its batch.

constexpr int kVecRegs = kW == 16 ? 32 : 16;  // vector registers: AVX-512 32; AVX2 and the generic unit 16
constexpr int kAttnKeyBlock = 8;            // keys whose scores are computed together
constexpr int kAttnChunk = 32;              // keys per online-softmax step
constexpr int kAttnRowVecs = 3;             // row vectors per task: R <= 3 * kW
constexpr int kAttnMaxRows = kAttnRowVecs * kW;
constexpr int kAttnMaxHeadDim = 1024;       // checked at the door
constexpr int kAttnMaxTaskFloats = 8192;    // R * padded head_dim: the task's output rows stay in L1
constexpr float kAttnNoMax = -1e30f;        // running max before any key: finite, so exp(-inf - m) = 0
constexpr int64_t kAttnSplitKeys = 256;     // decode tasks are split over their keys at multiples of this position

// out[0:hd] = q * scale + zero of one quantized pool row (ops::KVLayer), in fp32.
inline void kv_dequant_row(const uint8_t* q, const uint16_t* params, int hd, int bits, float* out) {
  const float s = half_to_float(params[0]), z = half_to_float(params[1]);
  const V vs = vset1(s), vz = vset1(z);
  if (bits == 8) {
    int d = 0;
    for (; d + kW <= hd; d += kW) vstore(out + d, vfma(vload_u8(q + d), vs, vz));
    for (; d < hd; ++d) out[d] = (float)q[d] * s + z;
  } else {
    const int half = hd / 2;
    int d = 0;
    for (; d + kW <= half; d += kW) {
      V lo, hi;
      vload_nibbles(q + d, lo, hi);
      vstore(out + d, vfma(lo, vs, vz));
      vstore(out + half + d, vfma(hi, vs, vz));
    }
    for (; d < half; ++d) out[d] = (float)(q[d] & 15) * s + z, out[half + d] = (float)(q[d] >> 4) * s + z;
  }
}

// Prefetch of `run` pool rows from row `row0` of a block, K and V (and a quantized pool's (scale, zero) pairs at
// start), spread over the reads: upto(x) issues the lines of the rows' first x bytes not issued yet.
struct KVPrefetch {
  const char* k = nullptr;
  const char* v = nullptr;
  int64_t done = 0, bytes = 0;
  void start(const KVLayer& kv, int32_t block, int64_t row0, int64_t run) {
    const int64_t rb = kv.row_bytes(), at = (int64_t)block * kv.block_bytes();
    k = (const char*)kv.k + at + row0 * rb, v = (const char*)kv.v + at + row0 * rb, bytes = run * rb;
    if (kv.bits <= 8) {
      const int64_t params = (int64_t)kv.num_kv_heads * kv.block_size_tokens * rb + row0 * 4;
      for (int64_t o = 0; o < run * 4; o += 64) prefetch((const char*)kv.k + at + params + o),
                                                prefetch((const char*)kv.v + at + params + o);
    }
  }
  void upto(int64_t x) {
    if (k == nullptr) return;
    for (x = x < bytes ? x : bytes; done < x; done += 64) prefetch(k + done), prefetch(v + done);
  }
};

// Walks keys c0 .. c0 + n - 1 of a sequence in kv head h as runs within a block (one block-table lookup per run,
// not per key), calling row(j, kb, vb, r, t) for each: j its index in the chunk, kb / vb the K and V bases of its
// block, r its row in the block (rows row_bytes apart), t its token in the block. The same rows of the next block
// (keys bs later) are prefetched as these are read, a line for a line, where that block holds keys before key_end
// (the task's end, or past it where a decode split's successor reads on): a task's blocks lie scattered over the
// pool, and the hardware prefetcher starts over at each of them. The one home of this prefetch policy, for
// gather_kv and attend_task_dot_quant (attend_task_dot_bf16 and the AMX tasks read the pool in their own order and
// prefetch beside their own reads).
template <class Row>
inline void walk_runs(const KVLayer& kv, const int32_t* table, int64_t h, int64_t c0, int n, int64_t key_end,
                      Row&& row) {
  const int64_t bs = kv.block_size_tokens, rb = kv.row_bytes(), bb = kv.block_bytes();
  int64_t b = c0 / bs, off = c0 % bs;
  for (int j = 0; j < n;) {
    const int run = n - j < bs - off ? n - j : (int)(bs - off);
    const char* kb = (const char*)kv.k + (int64_t)table[b] * bb;
    const char* vb = (const char*)kv.v + (int64_t)table[b] * bb;
    const int64_t row0 = h * bs + off;  // the run's first row
    KVPrefetch pf;
    if ((b + 1) * bs < key_end) pf.start(kv, table[b + 1], row0, run);
    for (int i = 0; i < run; ++i) {
      row(j + i, kb, vb, row0 + i, off + i);
      pf.upto((i + 1) * rb);
    }
    j += run, off = 0, ++b;
  }
}

// Pool rows of kv head h for keys c0 .. c0 + n - 1 of a sequence into krow[j], vrow[j] (j < n), and
// `zero` for j in [n, count). fp32 rows are pointed at in place; bf16 and quantized rows are converted
// into kbuf / vbuf (row j at j * head_dim): only this chunk of keys, never a copy of the cache.
// key_end: where walk_runs stops prefetching the next block (the end of the keys the task or its successors read).
inline void gather_kv(const KVLayer& kv, const int32_t* table, int64_t h, int64_t c0, int n, int count,
                      const float* zero, const float** krow, const float** vrow, float* kbuf, float* vbuf,
                      int64_t key_end) {
  const int64_t bs = kv.block_size_tokens, hd = kv.head_dim, rb = kv.row_bytes();
  const int64_t params_at = (int64_t)kv.num_kv_heads * bs * rb;
  if (kv.bits == 32) {
    walk_runs(kv, table, h, c0, n, key_end, [&](int j, const char* kb, const char* vb, int64_t r, int64_t) {
      krow[j] = (const float*)(kb + r * rb), vrow[j] = (const float*)(vb + r * rb);
    });
  } else if (kv.bits == 16) {  // bf16: K rows, V rows of a token pair interleaved (ops.h), over the same bytes
    walk_runs(kv, table, h, c0, n, key_end, [&](int j, const char* kb, const char* vb, int64_t r, int64_t t) {
      const uint16_t* kr = (const uint16_t*)(kb + r * rb);
      const uint32_t* vp = (const uint32_t*)vb + h * (bs / 2) * hd + (t >> 1) * hd;
      const int odd = (int)(t & 1);
      float* kd = kbuf + j * hd;
      float* vd = vbuf + j * hd;
      int64_t d = 0;
      for (; d + kW <= hd; d += kW) {  // whole vectors unmasked: masked 16-bit loads cost Zen 5 ~10% of a step
        vstore(kd + d, vload_bf16(kr + d));
        vstore(vd + d, vload_bf16_half(vp + d, odd));
      }
      if (d < hd) {
        const int m = (int)(hd - d);
        vstore_n(kd + d, vload_bf16_n(kr + d, m), m);
        vstore_n(vd + d, vload_bf16_half_n(vp + d, odd, m), m);
      }
      krow[j] = kd, vrow[j] = vd;
    });
  } else {
    walk_runs(kv, table, h, c0, n, key_end, [&](int j, const char* kb, const char* vb, int64_t r, int64_t) {
      const uint16_t* kp = (const uint16_t*)(kb + params_at) + 2 * r;
      const uint16_t* vp = (const uint16_t*)(vb + params_at) + 2 * r;
      kv_dequant_row((const uint8_t*)(kb + r * rb), kp, (int)hd, kv.bits, kbuf + j * hd);
      kv_dequant_row((const uint8_t*)(vb + r * rb), vp, (int)hd, kv.bits, vbuf + j * hd);
      krow[j] = kbuf + j * hd, vrow[j] = vbuf + j * hd;
    });
  }
  for (int j = n; j < count; ++j) krow[j] = vrow[j] = zero;
}

const float kZeroRow[kAttnMaxHeadDim] = {};

// The per-row state of a prefill task over rows [rho0, rho0 + rows): row r's query (returned), its output row
// orow[r], position pos[r], window start lo[r] (its first key) and online-softmax state m[r], lsum[r]. Rows r >=
// rows pad the task's row vectors: a zero query at the last row's position, no output row.
inline const float* task_row(const float* q, const AttnSeq& seq, int kvh, int group, int num_heads, int hd, int window,
                             int64_t rho0, int rows, int r, float* out, float** orow, float* pos, float* lo, float* m,
                             float* lsum) {
  const int64_t first_pos = (int64_t)seq.ctx_len - seq.q_len;
  const float* qr = kZeroRow;
  int64_t p = first_pos + (rho0 + rows - 1) / group;
  if (r < rows) {
    const int64_t rho = rho0 + r, head = (int64_t)kvh * group + rho % group, row = seq.q_row + rho / group;
    p = first_pos + rho / group;
    qr = q + (row * num_heads + head) * hd;
    orow[r] = out + (row * num_heads + head) * hd;
  }
  pos[r] = (float)p;
  lo[r] = window > 0 && p - window + 1 > 0 ? (float)(p - window + 1) : 0.0f;
  m[r] = kAttnNoMax;
  lsum[r] = 0.0f;
  return qr;
}

// An attention sink's share of a row's softmax (gpt-oss: a learned logit per query head that joins every row's
// softmax and carries no value): exp(sink - m), added to the row's sum l of exp(s - m) over its keys; 0 without
// sinks. The row's output o / (l + exp(sink - m)) is then exactly softmax([s, sink]) V over the keys' part.
inline float sink_weight(const float* sinks, int64_t head, float m) { return sinks ? expf(sinks[head] - m) : 0.0f; }

// Vector dv of a head_dim-long row (the last one partial when hd is not a multiple of kW).
inline V load_hd(const float* row, int dv, int hd) {
  const int rem = hd - dv * kW;
  return rem >= kW ? vload(row + dv * kW) : vload_n(row + dv * kW, rem);
}

// The scores of dot products q . k (ops.h): scale * dot, or with logit soft-capping (cap > 0)
// cap * tanh(dot * (scale / cap)). A kernel holding its dot products in a buffer multiplies them by `post`
// (1 when capped, else scale) and caps them there in a pass of its own (cap_in_place), so that the tanh's
// constants never compete for the registers of its main loop (inlined there, they slowed even uncapped calls).
struct Scores {
  V mul, cap, post;
  bool capped;
  Scores(float scale, float softcap)
      : mul(vset1(softcap > 0.0f ? scale / softcap : scale)), cap(vset1(softcap)),
        post(vset1(softcap > 0.0f ? 1.0f : scale)), capped(softcap > 0.0f) {}
  V operator()(V dot) const { return capped ? cap * vtanh(dot * mul) : dot * mul; }
  // p[0:count] = cap * tanh(p * scale / cap) when capped, masked scores (-inf) kept; count a multiple of kW
  void cap_in_place(float* p, int64_t count) const {
    if (!capped) return;
    const V lowest = vset1(-3.40282347e38f);
    for (int64_t i = 0; i < count; i += kW) {
      const V x = vload(p + i);
      vstore(p + i, vselect_lt(x, lowest, x, cap * vtanh(x * mul)));
    }
  }
};

// One chunk of an online softmax over a prefill task's row vector v (lanes v * kW ..): the scores of keys c0 ..
// c0 + n - 1 in st[j][v * kW ..] (rows ld floats apart) scaled by score.post and, when `masked`, set to -inf for
// keys after a row's position or before its window, in place; mx = the new running max of each row, m raised to
// it, and where it moved the rows' sums (l, from lsum) and outputs (obuf rows of hdp floats, rows < rows4)
// multiplied by exp(old - new). The caller adds the chunk's weights exp(s - mx) to l and o.
inline void chunk_max(float* st, int ld, int n, int v, int64_t c0, bool masked, const Scores& score, const float* pos,
                      const float* lo, float* m, const float* lsum, float* obuf, int rows4, int hdp, V& mx, V& l) {
  const V mv = vload(m + v * kW), pv = vload(pos + v * kW), lv = vload(lo + v * kW), neg_inf = vset1(-INFINITY);
  mx = mv;
  for (int j = 0; j < n; ++j) {
    V s = vload(st + j * ld + v * kW) * score.post;
    if (masked) {
      const V kp = vset1((float)(c0 + j));
      s = vselect_lt(pv, kp, neg_inf, s);  // key after the query
      s = vselect_lt(kp, lv, neg_inf, s);  // key before the window
    }
    vstore(st + j * ld + v * kW, s);
    mx = vmax(mx, s);
  }
  l = vload(lsum + v * kW);
  if (vany_gt(mx, mv)) {  // the running max moved for some rows: rescale their l and o
    const V c = vexp(mv - mx);  // exactly 1 where the max stayed
    alignas(64) float corr[kW];
    vstore(corr, c);
    l = l * c;
    for (int i = 0; i < kW; ++i) {
      if (corr[i] == 1.0f || v * kW + i >= rows4) continue;
      float* o = obuf + (v * kW + i) * hdp;
      const V ci = vset1(corr[i]);
      for (int dv = 0; dv < hdp / kW; ++dv) vstore(o + dv * kW, vload(o + dv * kW) * ci);
    }
    vstore(m + v * kW, mx);
  }
}

// st[j][v * kW ..] = K_j . qt[:, v * kW ..] for the kAttnKeyBlock keys krow[0..], RV row vectors: KS keys at a
// time, so that the KS x RV accumulators, the RV query vectors and a broadcast fit the registers (with 16, 8 x 3
// accumulators spilled on every d). Each score is the same sum over d in the same order whatever KS.
template <int RV>
inline void scores_t(const float* const* krow, const float* qt, int hd, float* st) {
  constexpr int KB = kAttnKeyBlock, ld = RV * kW;
  constexpr int KS = kVecRegs == 32 || RV == 1 ? KB : KB / 2;
  for (int j0 = 0; j0 < KB; j0 += KS) {
    V acc[KS][RV];
    for (int j = 0; j < KS; ++j)
      for (int v = 0; v < RV; ++v) acc[j][v] = vzero();
    const float* kr[KS];
    for (int j = 0; j < KS; ++j) kr[j] = krow[j0 + j];
    for (int d = 0; d < hd; ++d) {
      V qv[RV];
      for (int v = 0; v < RV; ++v) qv[v] = vload(qt + d * ld + v * kW);
#pragma GCC unroll 8
      for (int j = 0; j < KS; ++j) {
        const V kd = vset1(kr[j][d]);
        for (int v = 0; v < RV; ++v) acc[j][v] = vfma(kd, qv[v], acc[j][v]);
      }
    }
    for (int j = 0; j < KS; ++j)
      for (int v = 0; v < RV; ++v) vstore(st + (j0 + j) * ld + v * kW, acc[j][v]);
  }
}

// o[r0 + i][dv * kW ..] += sum_j st[j][r0 + i] * V_j[dv * kW ..] for i < 4, NV vectors of head_dim;
// st rows are ld floats apart.
template <int NV>
inline void pv_block(const float* st, int ld, int r0, const float* const* vrow, int n, int dv, int hd, float* o,
                     int hdp) {
  V acc[4][NV];
  for (int i = 0; i < 4; ++i)
    for (int u = 0; u < NV; ++u) acc[i][u] = vload(o + (r0 + i) * hdp + (dv + u) * kW);
  const bool full = (dv + NV) * kW <= hd;
  for (int j = 0; j < n; ++j) {
    V vv[NV];
    for (int u = 0; u < NV; ++u) {
      vv[u] = full ? vload(vrow[j] + (dv + u) * kW) : load_hd(vrow[j], dv + u, hd);
    }
    for (int i = 0; i < 4; ++i) {
      const V p = vset1(st[j * ld + r0 + i]);
      for (int u = 0; u < NV; ++u) acc[i][u] = vfma(p, vv[u], acc[i][u]);
    }
  }
  for (int i = 0; i < 4; ++i)
    for (int u = 0; u < NV; ++u) vstore(o + (r0 + i) * hdp + (dv + u) * kW, acc[i][u]);
}

// Rows [rho0, rho1) of sequence `seq` under kv head `kvh`; RV = row vectors (rows <= RV * kW).
template <int RV>
void attend_task(const float* q, const KVLayer& kv, const AttnSeq& seq, int kvh, int group, int num_heads,
                 int64_t rho0, int64_t rho1, float scale, float softcap, const float* sinks, int window, float* out) {
  constexpr int ld = RV * kW;  // rows <= ld, and rows * hdp <= kAttnMaxTaskFloats
  const int hd = kv.head_dim, nvec = (hd + kW - 1) / kW, hdp = nvec * kW;
  const int rows = (int)(rho1 - rho0), rows4 = (rows + 3) / 4 * 4;
  alignas(64) float obuf[kAttnMaxTaskFloats + 4 * kAttnMaxHeadDim];  // [rows4][hdp]
  alignas(64) float qt[kAttnMaxTaskFloats + kW * kAttnMaxHeadDim];    // [hd][ld]
  alignas(64) float st[kAttnChunk * ld];                                // [key][row]: scores, then p
  alignas(64) float pos[ld], lo[ld], m[ld], lsum[ld];
  float* orow[kAttnMaxRows];
  alignas(64) float kdq[kAttnChunk * kKVQuantMaxHeadDim], vdq[kAttnChunk * kKVQuantMaxHeadDim];  // quantized KV
  for (int r = 0; r < RV * kW; ++r) {
    const float* qr = task_row(q, seq, kvh, group, num_heads, hd, window, rho0, rows, r, out, orow, pos, lo, m, lsum);
    for (int d = 0; d < hd; ++d) qt[d * ld + r] = qr[d];
  }
  for (int i = 0; i < rows4 * hdp; ++i) obuf[i] = 0.0f;

  // rows are in position order: row 0 has the lowest position and window start, the last row the highest
  const int64_t key_lo = (int64_t)lo[0], key_hi = (int64_t)pos[rows - 1] + 1;
  const Scores score(scale, softcap);
  const float* krow[kAttnChunk];
  const float* vrow[kAttnChunk];
  // Chunks end at multiples of kAttnChunk (the first from key_lo): a row's keys fall into the same chunks whatever
  // the task's first row, so a prompt row's bits do not depend on how the prompt was chunked (with a window too).
  for (int64_t c0 = key_lo, c1; c0 < key_hi; c0 = c1) {
    c1 = (c0 / kAttnChunk + 1) * kAttnChunk < key_hi ? (c0 / kAttnChunk + 1) * kAttnChunk : key_hi;
    const int n = (int)(c1 - c0);
    const int nb = (n + kAttnKeyBlock - 1) / kAttnKeyBlock;
    gather_kv(kv, seq.block_table, kvh, c0, n, nb * kAttnKeyBlock, kZeroRow, krow, vrow, kdq, vdq, key_hi);
    for (int b = 0; b < nb; ++b) scores_t<RV>(krow + b * kAttnKeyBlock, qt, hd, st + b * kAttnKeyBlock * ld);
    score.cap_in_place(st, (int64_t)n * ld);
    // masking is needed only where the chunk crosses some row's position or window start
    const bool masked = (float)(c0 + n - 1) > pos[0] || (float)c0 < lo[RV * kW - 1];
    for (int v = 0; v < RV; ++v) {
      V mx, l;
      chunk_max(st, ld, n, v, c0, masked, score, pos, lo, m, lsum, obuf, rows4, hdp, mx, l);
      for (int j = 0; j < n; ++j) {
        const V p = vexp(vload(st + j * ld + v * kW) - mx);
        vstore(st + j * ld + v * kW, p);
        l = l + p;
      }
      vstore(lsum + v * kW, l);
    }
    // 4 rows x PV vectors of head_dim: 4 x PV accumulators and PV values of V in registers (4 x 4 + 4 spilled on
    // 16); the same sums in the same order whatever PV
    constexpr int PV = kVecRegs == 32 ? 4 : 2;
    for (int r0 = 0; r0 < rows4; r0 += 4) {
      int dv = 0;
      for (; dv + PV <= nvec; dv += PV) pv_block<PV>(st, ld, r0, vrow, n, dv, hd, obuf, hdp);
      for (; dv < nvec; ++dv) pv_block<1>(st, ld, r0, vrow, n, dv, hd, obuf, hdp);
    }
  }
  for (int r = 0; r < rows; ++r) {
    const int64_t head = (int64_t)kvh * group + (rho0 + r) % group;
    const V inv = vset1(1.0f / (lsum[r] + sink_weight(sinks, head, m[r])));
    const float* o = obuf + r * hdp;
    int dv = 0;
    for (; (dv + 1) * kW <= hd; ++dv) vstore(orow[r] + dv * kW, vload(o + dv * kW) * inv);
    if (dv * kW < hd) vstore_n(orow[r] + dv * kW, vload(o + dv * kW) * inv, hd - dv * kW);
  }
}

// The rows of a decode-shaped task (G <= 4: one or a few query positions x the group's heads): row r's query,
// output row, position, window start and running max, and the keys the task visits: from the first row's window
// start (or the split's begin) to the last row's position (or the split's end).
template <int G>
struct DecodeRows {
  const float* q[G];
  float* orow[G];
  float pos[G], lo[G], m[G];
  float sink[G];  // the row's head's attention sink, -inf without
  int64_t key_lo, key_hi;
  V iota;  // 0, 1, .., kW - 1
  DecodeRows(const float* qs, const AttnSeq& seq, int kvh, int group, int num_heads, int hd, int64_t rho0, int window,
             const float* sinks, float* out, int64_t split_begin, int64_t split_end) {
    const int64_t first_pos = (int64_t)seq.ctx_len - seq.q_len;
    for (int r = 0; r < G; ++r) {
      const int64_t rho = rho0 + r, head = (int64_t)kvh * group + rho % group, row = seq.q_row + rho / group;
      const int64_t p = first_pos + rho / group;
      q[r] = qs + (row * num_heads + head) * hd;
      orow[r] = out + (row * num_heads + head) * hd;
      pos[r] = (float)p;
      lo[r] = window > 0 && p - window + 1 > 0 ? (float)(p - window + 1) : 0.0f;
      m[r] = kAttnNoMax;
      sink[r] = sinks ? sinks[head] : -INFINITY;
    }
    key_lo = (int64_t)lo[0] > split_begin ? (int64_t)lo[0] : split_begin;
    key_hi = (int64_t)pos[G - 1] + 1 < split_end ? (int64_t)pos[G - 1] + 1 : split_end;
    float lanes_f[kW];
    for (int i = 0; i < kW; ++i) lanes_f[i] = (float)i;
    iota = vload(lanes_f);
  }
  // The positions of the kW keys from c0.
  V key_positions(int64_t c0) const { return iota + vset1((float)c0); }
  // The end of the keys the rows see, past the split's end: the bound of a split's prefetch, which runs on into the
  // next split's first block (the same thread's next job, most often; read cold, it cost a lone 32k decode 10-15%).
  int64_t seq_end() const { return (int64_t)pos[G - 1] + 1; }
  // Row r's scores s of the kW keys from c0 (positions kpos) with the keys it may not see set to -inf: past its
  // position or the split's end, before its window.
  V mask(V s, int r, int64_t c0, V kpos) const {
    const float last = pos[r] < (float)(key_hi - 1) ? pos[r] : (float)(key_hi - 1);
    if ((float)(c0 + kW - 1) > last || (float)c0 < lo[r]) {
      s = vselect_lt(vset1(last), kpos, vset1(-INFINITY), s);
      s = vselect_lt(kpos, vset1(lo[r]), vset1(-INFINITY), s);
    }
    return s;
  }
  // Row r's scores of the kW keys from c0 (positions kpos) from their dot products q . k: scaled or capped (Scores),
  // masked (mask), and its running max raised to them: c the factor by which the caller scales the row's sums.
  template <bool Capped>
  V scores(V dot, int r, int64_t c0, V kpos, const Scores& score, float& c) {
    V s;
    if constexpr (Capped) s = score.cap * vtanh(dot * score.mul);
    else s = dot * score.mul;
    s = mask(s, r, c0, kpos);
    c = raise_max(s, r);
    return s;
  }
  // Row r's running max raised to its scores s: the factor exp(old - new) by which the caller scales the row's
  // sums, 1 where the max stayed.
  float raise_max(V s, int r) {
    if (!vany_gt(s, vset1(m[r]))) return 1.0f;
    const float mx = vhmax(s), c = expf(m[r] - mx);
    m[r] = mx;
    return c;
  }
  // Row r's output: o[0:hd] + add (in every d) over l (and its sink's weight) into its output row, or with
  // `partial` set, unnormalised as (m, l, o + add) at partial[r * (hd + 2)] for attend_merge (which adds the sink).
  void finish(int r, const float* o, float l, float add, int hd, float* partial) const {
    float* dst = partial ? partial + r * (hd + 2) + 2 : orow[r];
    if (partial) dst[-2] = m[r], dst[-1] = l;
    const V inv = vset1(partial ? 1.0f : 1.0f / (l + expf(sink[r] - m[r]))), a = vset1(add);
    int dv = 0;
    for (; (dv + 1) * kW <= hd; ++dv) vstore(dst + dv * kW, (vload(o + dv * kW) + a) * inv);
    if (dv * kW < hd) vstore_n(dst + dv * kW, (vload(o + dv * kW) + a) * inv, hd - dv * kW);
  }
};

// A decode-shaped task (G <= 4 rows, e.g. one query position and the group's heads): the transposed
// form would waste most of its lanes, so scores are dot products over head_dim instead (4 keys x G
// rows of vector accumulators), turned into one vector of kW scores per row by a horizontal-sum fold:
//   a[j][0:kW] = partial sums of q . K_j,   vhsum(a)[j] = sum of a[j]'s lanes  ->  s[0:kW]
//
// Only keys in [split_begin, split_end) are visited. With `partial` set, the unnormalised state of
// each row r is written to partial[r * (hd + 2) ..] as (m, l, o[0:hd]) instead of the output, for
// attend_merge to combine the splits of a long context.
// Capped: the soft-cap's tanh is compiled in only where it is used (inside the key loop, a runtime choice
// between capped and plain scores costs uncapped calls the tanh too, once if-converted).
template <int G, bool Capped>
void attend_task_dot(const float* q, const KVLayer& kv, const AttnSeq& seq, int kvh, int group, int num_heads,
                     int64_t rho0, float scale, float softcap, const float* sinks, int window, float* out, int64_t split_begin = 0,
                     int64_t split_end = INT64_MAX, float* partial = nullptr) {
  const int hd = kv.head_dim, nvec = (hd + kW - 1) / kW, hdp = nvec * kW;
  alignas(64) float obuf[4 * kAttnMaxHeadDim];  // [G][hdp]
  alignas(64) float qbuf[4 * kAttnMaxHeadDim];  // [G][hdp], zero padded
  alignas(64) float pbuf[4 * kW];               // [G][kW] scores, then p
  alignas(64) float lsum[4 * kW];
  alignas(64) float kdq[kW * kKVQuantMaxHeadDim], vdq[kW * kKVQuantMaxHeadDim];  // quantized KV
  DecodeRows<G> rows(q, seq, kvh, group, num_heads, hd, rho0, window, sinks, out, split_begin, split_end);
  for (int r = 0; r < G; ++r) {
    for (int d = 0; d < hdp; ++d) qbuf[r * hdp + d] = d < hd ? rows.q[r][d] : 0.0f;
    for (int d = 0; d < hdp; ++d) obuf[r * hdp + d] = 0.0f;
    vstore(lsum + r * kW, vzero());
  }
  const int64_t key_lo = rows.key_lo, key_hi = rows.key_hi;
  const Scores score(scale, softcap);
  const float* krow[kW];
  const float* vrow[kW];
  for (int64_t c0 = key_lo; c0 < key_hi; c0 += kW) {
    const int n = key_hi - c0 < kW ? (int)(key_hi - c0) : kW;
    gather_kv(kv, seq.block_table, kvh, c0, n, kW, kZeroRow, krow, vrow, kdq, vdq, rows.seq_end());
    // a[r][j]: partial sums of row r . key j, in registers for G x KJ of them at a time (KJ keys and a query vector
    // beside them: 4 keys where 32 registers hold them, and on 16 for up to 2 rows; else 2). Each sum runs over
    // head_dim in the same order whatever KJ.
    constexpr int KJ = kVecRegs == 32 || G <= 2 ? 4 : 2;
    V a[G][kW];
    for (int j0 = 0; j0 < kW; j0 += KJ) {
      V acc[G][KJ];
      for (int r = 0; r < G; ++r)
        for (int i = 0; i < KJ; ++i) acc[r][i] = vzero();
      for (int dv = 0; dv < nvec; ++dv) {
        V kk[KJ];
        for (int i = 0; i < KJ; ++i) kk[i] = load_hd(krow[j0 + i], dv, hd);
        for (int r = 0; r < G; ++r) {
          const V qv = vload(qbuf + r * hdp + dv * kW);
          for (int i = 0; i < KJ; ++i) acc[r][i] = vfma(qv, kk[i], acc[r][i]);
        }
      }
      for (int r = 0; r < G; ++r)
        for (int i = 0; i < KJ; ++i) a[r][j0 + i] = acc[r][i];
    }
    const V kpos = rows.key_positions(c0);
    for (int r = 0; r < G; ++r) {
      float c;
      const V s = rows.template scores<Capped>(vhsum(a[r]), r, c0, kpos, score, c);
      V l = vload(lsum + r * kW);
      if (c != 1.0f) {
        l = l * vset1(c);
        float* o = obuf + r * hdp;
        for (int dv = 0; dv < nvec; ++dv) vstore(o + dv * kW, vload(o + dv * kW) * vset1(c));
      }
      const V p = vexp(s - vset1(rows.m[r]));
      vstore(lsum + r * kW, l + p);
      vstore(pbuf + r * kW, p);
    }
    // G x PU output vectors in registers, PU values of V beside them (4 on 32 registers, 2 on 16)
    constexpr int PU = kVecRegs == 32 ? 4 : 2;
    for (int dv = 0; dv < nvec; dv += PU) {
      const int nv = nvec - dv < PU ? nvec - dv : PU;
      if (nv == PU && (dv + PU) * kW <= hd) {
        V acc[G][PU];
        for (int r = 0; r < G; ++r)
          for (int u = 0; u < PU; ++u) acc[r][u] = vload(obuf + r * hdp + (dv + u) * kW);
        for (int j = 0; j < n; ++j) {
          V vv[PU];
          for (int u = 0; u < PU; ++u) vv[u] = vload(vrow[j] + (dv + u) * kW);
          for (int r = 0; r < G; ++r) {
            const V p = vset1(pbuf[r * kW + j]);
            for (int u = 0; u < PU; ++u) acc[r][u] = vfma(p, vv[u], acc[r][u]);
          }
        }
        for (int r = 0; r < G; ++r)
          for (int u = 0; u < PU; ++u) vstore(obuf + r * hdp + (dv + u) * kW, acc[r][u]);
      } else {
        for (int u = dv; u < dv + nv; ++u) {
          V acc[G];
          for (int r = 0; r < G; ++r) acc[r] = vload(obuf + r * hdp + u * kW);
          for (int j = 0; j < n; ++j) {
            const V vv = load_hd(vrow[j], u, hd);
            for (int r = 0; r < G; ++r) acc[r] = vfma(vset1(pbuf[r * kW + j]), vv, acc[r]);
          }
          for (int r = 0; r < G; ++r) vstore(obuf + r * hdp + u * kW, acc[r]);
        }
      }
    }
  }
  for (int r = 0; r < G; ++r) rows.finish(r, obuf + r * hdp, vsum(vload(lsum + r * kW)), 0.0f, hd, partial);
}

// A decode-shaped task (G <= 4 rows) over a quantized pool (Bits 8 or 4), its rows widened in registers instead of
// dequantized into buffers (gather_kv): with k = kq * s + z per row (ops::KVLayer), written k = c * s + z' with the
// levels centred, c = kq - 2^(Bits - 1), and z' = z + 2^(Bits - 1) s (the middle of the row's range),
//   q . k_j           = s_j (q . c_j) + z'_j sum(q)                  dot products over the centred levels
//   sum_j p_j v_j     = sum_j (p_j s_j) cv_j + (sum_j p_j z'_j) 1    the zeros' part a scalar per row (zl)
// so a key costs the widening of its levels and the fp32 FMAs of attend_task_dot, and nothing is stored. (Centred,
// neither part is much larger than the result: with the raw levels and the row minimum as zero, both parts were
// several times larger and cancelled, at several times the fp32 path's rounding error.) Needs
// head_dim % kW == 0 (Bits 8) or % 2 kW == 0 (Bits 4: a byte holds d in its low nibble and d + head_dim / 2 in its
// high one); attend_task_dot takes the others. Arguments as attend_task_dot's.
template <int G, bool Capped, int Bits>
void attend_task_dot_quant(const float* q, const KVLayer& kv, const AttnSeq& seq, int kvh, int group, int num_heads,
                           int64_t rho0, float scale, float softcap, const float* sinks, int window, float* out, int64_t split_begin = 0,
                           int64_t split_end = INT64_MAX, float* partial = nullptr) {
  const int hd = kv.head_dim, nvec = hd / kW;
  const int64_t bs = kv.block_size_tokens, rb = kv.row_bytes();
  const int64_t params_at = (int64_t)kv.num_kv_heads * bs * rb;
  alignas(64) float obuf[4 * kAttnMaxHeadDim];  // [G][hd]: sum_j (p_j s_j) vq_j
  alignas(64) float qbuf[4 * kAttnMaxHeadDim];  // [G][hd]
  alignas(64) float pbuf[4 * kW];               // [G][kW]: p_j s_j of V
  alignas(64) float lsum[4 * kW], zl[4 * kW];   // [G][kW]: sums of p_j and of p_j z_j (V's zeros)
  alignas(64) uint16_t ks[kW], kz[kW], vs[kW], vz[kW];  // the chunk's (scale, zero) pairs, fp16
  float qsum[G];
  DecodeRows<G> rows(q, seq, kvh, group, num_heads, hd, rho0, window, sinks, out, split_begin, split_end);
  for (int r = 0; r < G; ++r) {
    V acc = vzero();
    for (int dv = 0; dv < nvec; ++dv) {
      const V x = vload(rows.q[r] + dv * kW);
      vstore(qbuf + r * hd + dv * kW, x);
      vstore(obuf + r * hd + dv * kW, vzero());
      acc = acc + x;
    }
    qsum[r] = vsum(acc);
    vstore(lsum + r * kW, vzero());
    vstore(zl + r * kW, vzero());
  }
  const int64_t key_lo = rows.key_lo, key_hi = rows.key_hi;
  const Scores score(scale, softcap);
  const uint8_t* kzero = (const uint8_t*)kZeroRow;  // levels of the keys past the chunk's end: never weighed
  const V mid = vset1((float)(1 << (Bits - 1)));
  const uint8_t* krow[kW];
  const uint8_t* vrow[kW];
  for (int64_t c0 = key_lo; c0 < key_hi; c0 += kW) {
    const int n = key_hi - c0 < kW ? (int)(key_hi - c0) : kW;
    walk_runs(kv, seq.block_table, kvh, c0, n, rows.seq_end(), [&](int j, const char* kb, const char* vb, int64_t r, int64_t) {
      const uint16_t* kp = (const uint16_t*)(kb + params_at) + 2 * r;
      const uint16_t* vp = (const uint16_t*)(vb + params_at) + 2 * r;
      krow[j] = (const uint8_t*)(kb + r * rb), vrow[j] = (const uint8_t*)(vb + r * rb);
      ks[j] = kp[0], kz[j] = kp[1], vs[j] = vp[0], vz[j] = vp[1];
    });
    for (int j = n; j < kW; ++j) krow[j] = vrow[j] = kzero, ks[j] = kz[j] = vs[j] = vz[j] = 0;
    V a[G][kW];  // a[r][j]: partial sums of row r . kq_j (registers for G x 4 of them at a time)
    for (int j0 = 0; j0 < kW; j0 += 4) {
      V acc[G][4];
      for (int r = 0; r < G; ++r)
        for (int i = 0; i < 4; ++i) acc[r][i] = vzero();
      if constexpr (Bits == 8) {
        for (int dv = 0; dv < nvec; ++dv) {
          V kk[4];
          for (int i = 0; i < 4; ++i) kk[i] = vload_u8(krow[j0 + i] + dv * kW) - mid;
          for (int r = 0; r < G; ++r) {
            const V qv = vload(qbuf + r * hd + dv * kW);
            for (int i = 0; i < 4; ++i) acc[r][i] = vfma(qv, kk[i], acc[r][i]);
          }
        }
      } else {
        for (int dv = 0; dv < nvec / 2; ++dv) {
          V klo[4], khi[4];
          for (int i = 0; i < 4; ++i) {
            vload_nibbles(krow[j0 + i] + dv * kW, klo[i], khi[i]);
            klo[i] = klo[i] - mid, khi[i] = khi[i] - mid;
          }
          for (int r = 0; r < G; ++r) {
            const V ql = vload(qbuf + r * hd + dv * kW), qh = vload(qbuf + r * hd + hd / 2 + dv * kW);
            for (int i = 0; i < 4; ++i) acc[r][i] = vfma(qh, khi[i], vfma(ql, klo[i], acc[r][i]));
          }
        }
      }
      for (int r = 0; r < G; ++r)
        for (int i = 0; i < 4; ++i) a[r][j0 + i] = acc[r][i];
    }
    const V kpos = rows.key_positions(c0);
    const V kscale = vload_f16(ks), vscale = vload_f16(vs);
    const V kzero_v = vfma(mid, kscale, vload_f16(kz)), vzero_v = vfma(mid, vscale, vload_f16(vz));
    for (int r = 0; r < G; ++r) {
      float cs;
      const V s = rows.template scores<Capped>(vfma(vhsum(a[r]), kscale, kzero_v * vset1(qsum[r])), r, c0, kpos,
                                               score, cs);
      V l = vload(lsum + r * kW), z = vload(zl + r * kW);
      if (cs != 1.0f) {
        const V c = vset1(cs);
        l = l * c, z = z * c;
        float* o = obuf + r * hd;
        for (int dv = 0; dv < nvec; ++dv) vstore(o + dv * kW, vload(o + dv * kW) * c);
      }
      const V p = vexp(s - vset1(rows.m[r]));
      vstore(lsum + r * kW, l + p);
      vstore(zl + r * kW, vfma(p, vzero_v, z));
      vstore(pbuf + r * kW, p * vscale);
    }
    // o[r] += sum_j (p_j s_j) vq_j, four vectors of head_dim at a time (Bits 4: two from each nibble half)
    constexpr int kStep = Bits == 8 ? 4 : 2;
    const int span = Bits == 8 ? nvec : nvec / 2;
    for (int dv = 0; dv < span; dv += kStep) {
      const int nv = span - dv < kStep ? span - dv : kStep;
      if (nv == kStep) {
        // accumulator u's first dimension (Bits 4: u 0, 1 the low nibbles of byte vectors dv, dv + 1, in head_dim's
        // first half; u 2, 3 their high nibbles, in its second)
        auto dim = [&](int u) {
          return Bits == 8 ? (dv + u) * kW : (u < 2 ? (dv + u) * kW : hd / 2 + (dv + u - 2) * kW);
        };
        V acc[G][4];
        for (int r = 0; r < G; ++r)
          for (int u = 0; u < 4; ++u) acc[r][u] = vload(obuf + r * hd + dim(u));
        for (int j = 0; j < n; ++j) {
          V vv[4];
          if constexpr (Bits == 8) {
            for (int u = 0; u < 4; ++u) vv[u] = vload_u8(vrow[j] + (dv + u) * kW) - mid;
          } else {
            vload_nibbles(vrow[j] + dv * kW, vv[0], vv[2]);
            vload_nibbles(vrow[j] + (dv + 1) * kW, vv[1], vv[3]);
            for (int u = 0; u < 4; ++u) vv[u] = vv[u] - mid;
          }
          for (int r = 0; r < G; ++r) {
            const V p = vset1(pbuf[r * kW + j]);
            for (int u = 0; u < 4; ++u) acc[r][u] = vfma(p, vv[u], acc[r][u]);
          }
        }
        for (int r = 0; r < G; ++r)
          for (int u = 0; u < 4; ++u) vstore(obuf + r * hd + dim(u), acc[r][u]);
      } else {
        for (int u = dv; u < dv + nv; ++u) {  // one vector (Bits 8) or one nibble pair of vectors (Bits 4)
          V acc[G][2];
          const int d0 = u * kW, d1 = hd / 2 + u * kW;
          for (int r = 0; r < G; ++r) {
            acc[r][0] = vload(obuf + r * hd + d0);
            if constexpr (Bits == 4) acc[r][1] = vload(obuf + r * hd + d1);
          }
          for (int j = 0; j < n; ++j) {
            V v0, v1;
            if constexpr (Bits == 8) v0 = vload_u8(vrow[j] + d0) - mid;
            else vload_nibbles(vrow[j] + d0, v0, v1), v1 = v1 - mid, v0 = v0 - mid;
            for (int r = 0; r < G; ++r) {
              const V p = vset1(pbuf[r * kW + j]);
              acc[r][0] = vfma(p, v0, acc[r][0]);
              if constexpr (Bits == 4) acc[r][1] = vfma(p, v1, acc[r][1]);
            }
          }
          for (int r = 0; r < G; ++r) {
            vstore(obuf + r * hd + d0, acc[r][0]);
            if constexpr (Bits == 4) vstore(obuf + r * hd + d1, acc[r][1]);
          }
        }
      }
    }
  }
  for (int r = 0; r < G; ++r)  // plus sum_j p_j z'_j, V's zeros, in every d
    rows.finish(r, obuf + r * hd, vsum(vload(lsum + r * kW)), vsum(vload(zl + r * kW)), hd, partial);
}

// out row = sum_s o_s e^(m_s - m) / (sum_s l_s e^(m_s - m) + e^(sink - m)), m = max_s m_s, over the splits'
// partial states (m, l, o[0:hd]) laid out `stride` floats apart; sink -inf: none.
inline void attend_merge(const float* partial, int splits, int64_t stride, int hd, float sink, float* out) {
  float mx = kAttnNoMax;
  for (int s = 0; s < splits; ++s) mx = partial[s * stride] > mx ? partial[s * stride] : mx;
  float l = expf(sink - mx);
  for (int s = 0; s < splits; ++s) l += partial[s * stride + 1] * expf(partial[s * stride] - mx);
  for (int dv = 0; dv * kW < hd; ++dv) {
    const int n = hd - dv * kW < kW ? hd - dv * kW : kW;
    V acc = vzero();
    for (int s = 0; s < splits; ++s)
      acc = vfma(vset1(expf(partial[s * stride] - mx)), vload_n(partial + s * stride + 2 + dv * kW, n), acc);
    vstore_n(out + dv * kW, acc * vset1(1.0f / l), n);
  }
}

// The kernel of decode-shaped tasks (up to kMaxRows rows: one or a few query positions and the group's
// heads), as a policy of the task loops below: begin() / end() run once per chunk of tasks a thread takes.
// Here: dot products over head_dim (attend_task_dot). impl_attention_amx.h adds AMX tiles.
struct DotDecode {
  static constexpr int kMaxRows = 4;
  static constexpr bool kEveryTask = false;  // larger tasks go to attend_task
  void begin() {}
  void end() {}
  void operator()(int rows, const float* q, const KVLayer& kv, const AttnSeq& seq, int kvh, int group,
                  int num_heads, int64_t rho0, float scale, float softcap, const float* sinks, int window, float* out,
                  int64_t split_begin = 0, int64_t split_end = INT64_MAX, float* partial = nullptr) {
    if (softcap > 0.0f) return run<true>(rows, q, kv, seq, kvh, group, num_heads, rho0, scale, softcap, sinks, window, out,
                                         split_begin, split_end, partial);
    run<false>(rows, q, kv, seq, kvh, group, num_heads, rho0, scale, softcap, sinks, window, out, split_begin, split_end,
               partial);
  }
  template <bool Capped>
  static void run(int rows, const float* q, const KVLayer& kv, const AttnSeq& seq, int kvh, int group,
                  int num_heads, int64_t rho0, float scale, float softcap, const float* sinks, int window, float* out,
                  int64_t split_begin, int64_t split_end, float* partial) {
    if (kv.bits == 8 && kv.head_dim % kW == 0)
      return run_quant<Capped, 8>(rows, q, kv, seq, kvh, group, num_heads, rho0, scale, softcap, sinks, window, out,
                                  split_begin, split_end, partial);
    if (kv.bits == 4 && kv.head_dim % (2 * kW) == 0)
      return run_quant<Capped, 4>(rows, q, kv, seq, kvh, group, num_heads, rho0, scale, softcap, sinks, window, out,
                                  split_begin, split_end, partial);
    switch (rows) {
      case 1: return attend_task_dot<1, Capped>(q, kv, seq, kvh, group, num_heads, rho0, scale, softcap, sinks, window, out, split_begin, split_end, partial);
      case 2: return attend_task_dot<2, Capped>(q, kv, seq, kvh, group, num_heads, rho0, scale, softcap, sinks, window, out, split_begin, split_end, partial);
      case 3: return attend_task_dot<3, Capped>(q, kv, seq, kvh, group, num_heads, rho0, scale, softcap, sinks, window, out, split_begin, split_end, partial);
      default: return attend_task_dot<4, Capped>(q, kv, seq, kvh, group, num_heads, rho0, scale, softcap, sinks, window, out, split_begin, split_end, partial);
    }
  }
  template <bool Capped, int Bits>
  static void run_quant(int rows, const float* q, const KVLayer& kv, const AttnSeq& seq, int kvh, int group,
                        int num_heads, int64_t rho0, float scale, float softcap, const float* sinks, int window, float* out,
                        int64_t split_begin, int64_t split_end, float* partial) {
    switch (rows) {
      case 1: return attend_task_dot_quant<1, Capped, Bits>(q, kv, seq, kvh, group, num_heads, rho0, scale, softcap, sinks, window, out, split_begin, split_end, partial);
      case 2: return attend_task_dot_quant<2, Capped, Bits>(q, kv, seq, kvh, group, num_heads, rho0, scale, softcap, sinks, window, out, split_begin, split_end, partial);
      case 3: return attend_task_dot_quant<3, Capped, Bits>(q, kv, seq, kvh, group, num_heads, rho0, scale, softcap, sinks, window, out, split_begin, split_end, partial);
      default: return attend_task_dot_quant<4, Capped, Bits>(q, kv, seq, kvh, group, num_heads, rho0, scale, softcap, sinks, window, out, split_begin, split_end, partial);
    }
  }
};

// The kernel of prefill-shaped tasks (more rows than the Decode kernel takes), as a policy of the task loops
// below: here transposed score tiles in fp32 (attend_task); impl_attention_bf16.h adds bf16 dot products.
struct F32Prefill {
  static void run(int rv, const float* q, const KVLayer& kv, const AttnSeq& seq, int kvh, int group, int num_heads,
                  int64_t rho0, int64_t rho1, float scale, float softcap, const float* sinks, int window, float* out) {
    if (rv == 1) attend_task<1>(q, kv, seq, kvh, group, num_heads, rho0, rho1, scale, softcap, sinks, window, out);
    else if (rv == 2) attend_task<2>(q, kv, seq, kvh, group, num_heads, rho0, rho1, scale, softcap, sinks, window, out);
    else attend_task<3>(q, kv, seq, kvh, group, num_heads, rho0, rho1, scale, softcap, sinks, window, out);
  }
};

// One unit of paged_attention_with's work: rows [rho0, rho1) of sequence s under kv head kvh over keys
// [key_begin, key_end), its output in place or (partial >= 0) as partial softmax states at scratch + partial.
struct AttnJob {
  int32_t s, kvh;
  int64_t rho0, rho1, key_begin, key_end, partial;
  bool prefill;  // on the Prefill kernel (or a kEveryTask Decode kernel over all keys), whatever its rows
};
// A decode-shaped task split over key segments: its `rows` rows' partial states, nseg per row, from `partial` on.
struct AttnMerge {
  int32_t s, kvh, rows, nseg;
  int64_t partial;
};
// The keys [begin, last] a decode-shaped task of sequence a visits (from its first row's window start to its last
// row's position), in nseg segments of kAttnSplitKeys from segment seg0 on.
struct DecodeKeys {
  int64_t begin, last, seg0, nseg;
  DecodeKeys(const AttnSeq& a, int window) : last(a.ctx_len - 1) {
    const int64_t first = last - (a.q_len - 1);
    begin = window > 0 && first - window + 1 > 0 ? first - window + 1 : 0;
    seg0 = begin / kAttnSplitKeys;
    nseg = last / kAttnSplitKeys - seg0 + 1;
  }
};

// Tasks (sequence, kv head, row chunk): decode-shaped ones (all of a sequence's rows in one task of at most
// Decode::kMaxRows rows, not AttnSeq::prefill) on the Decode kernel, the others on the Prefill kernel whatever their
// rows, also the last few rows of a long chunk (a Decode kernel with kEveryTask takes those too, in chunks of
// kMaxRows rows): so a prompt row gives the same bits however its prompt was chunked. A decode-shaped task whose
// keys cross a multiple of kAttnSplitKeys is split there into jobs over key segments (one long sequence keeps every
// thread busy), and attend_merge combines their partial states. The segments are fixed positions, not a share of
// the threads: a row's result depends on its own keys only, never on the batch around it (batch-invariant, as the
// linear kernels: speculative decoding's draft rows then score exactly as their decode steps would).
template <class Decode, class Prefill = F32Prefill>
void paged_attention_with(const float* q, const KVLayer& kv, const AttnSeq* seqs, int32_t num_seqs,
                          int32_t num_heads, float scale, float softcap, const float* sinks, int32_t window, float* out) {
  const int group = num_heads / kv.num_kv_heads, nkv = kv.num_kv_heads, hd = kv.head_dim;
  const int hdp = (hd + kW - 1) / kW * kW;
  int rows_per_task = kAttnMaxTaskFloats / hdp / 4 * 4;
  rows_per_task = rows_per_task > kAttnMaxRows ? kAttnMaxRows : rows_per_task < 4 ? 4 : rows_per_task;
  if (Decode::kEveryTask) rows_per_task = Decode::kMaxRows;  // prefill rows too, in tasks of kMaxRows
  const int64_t stride = hd + 2, per_task = Decode::kMaxRows * stride;  // partial states: (m, l, o) per row
  int64_t num_jobs = 0, num_merges = 0;
  for (int s = 0; s < num_seqs; ++s) {
    const AttnSeq& a = seqs[s];
    const int64_t rows = (int64_t)a.q_len * group;
    if (rows == 0) continue;
    if (rows <= Decode::kMaxRows && !a.prefill) {
      const int64_t nseg = DecodeKeys(a, window).nseg;
      num_jobs += nseg * nkv;
      num_merges += nseg > 1 ? nkv : 0;
    } else {
      num_jobs += (rows + rows_per_task - 1) / rows_per_task * nkv;
    }
  }
  thread_local ScratchBuffer job_buffer, partial_buffer;
  AttnJob* jobs = (AttnJob*)job_buffer.get(sizeof(AttnJob) * (size_t)num_jobs + sizeof(AttnMerge) * (size_t)num_merges);
  AttnMerge* merges = (AttnMerge*)(jobs + num_jobs);
  int64_t nj = 0, nm = 0, partial_floats = 0;
  for (int s = 0; s < num_seqs; ++s) {
    const AttnSeq& a = seqs[s];
    const int64_t rows = (int64_t)a.q_len * group;
    if (rows == 0) continue;
    if (rows <= Decode::kMaxRows && !a.prefill) {
      const DecodeKeys keys(a, window);
      const int64_t begin = keys.begin, last = keys.last, seg0 = keys.seg0, nseg = keys.nseg;
      for (int kvh = 0; kvh < nkv; ++kvh) {
        if (nseg == 1) {
          jobs[nj++] = AttnJob{s, kvh, 0, rows, 0, INT64_MAX, -1, false};
          continue;
        }
        merges[nm++] = AttnMerge{s, kvh, (int32_t)rows, (int32_t)nseg, partial_floats};
        for (int64_t j = 0; j < nseg; ++j) {
          const int64_t b = (seg0 + j) * kAttnSplitKeys, e = b + kAttnSplitKeys;
          jobs[nj++] = AttnJob{s, kvh, 0, rows, b > begin ? b : begin, e < last + 1 ? e : last + 1,
                               partial_floats + j * per_task, false};
        }
        partial_floats += nseg * per_task;
      }
    } else {  // later chunks see more keys: hand them out first
      const int64_t chunks = (rows + rows_per_task - 1) / rows_per_task;
      for (int64_t c = chunks - 1; c >= 0; --c)
        for (int kvh = 0; kvh < nkv; ++kvh) {
          const int64_t rho0 = c * rows_per_task, rho1 = rho0 + rows_per_task < rows ? rho0 + rows_per_task : rows;
          jobs[nj++] = AttnJob{s, kvh, rho0, rho1, 0, INT64_MAX, -1, true};
        }
    }
  }
  float* partial = (float*)partial_buffer.get(sizeof(float) * (size_t)partial_floats);
  // small chunks of jobs: the policy's begin() / end() (AMX: the tile config) run once per chunk
  parallel_for(num_jobs, grain_for(num_jobs, 8), num_jobs > 1, [&](int64_t j0, int64_t j1) {
    Decode decode;
    decode.begin();
    for (int64_t j = j0; j < j1; ++j) {
      const AttnJob& job = jobs[j];
      const int rows = (int)(job.rho1 - job.rho0);
      if (!job.prefill || Decode::kEveryTask)
        decode(rows, q, kv, seqs[job.s], job.kvh, group, num_heads, job.rho0, scale, softcap, sinks, window, out,
               job.key_begin, job.key_end, job.partial >= 0 ? partial + job.partial : nullptr);
      else
        Prefill::run((rows + kW - 1) / kW, q, kv, seqs[job.s], job.kvh, group, num_heads, job.rho0, job.rho1, scale,
                     softcap, sinks, window, out);
    }
    decode.end();
  });
  if (num_merges == 0) return;
  parallel_for(num_merges, grain_for(num_merges), num_merges > 1, [&](int64_t m0, int64_t m1) {
    for (int64_t m = m0; m < m1; ++m) {
      const AttnMerge& mg = merges[m];
      const AttnSeq& seq = seqs[mg.s];
      for (int r = 0; r < mg.rows; ++r) {
        const int64_t row = seq.q_row + r / group, head = (int64_t)mg.kvh * group + r % group;
        attend_merge(partial + mg.partial + r * stride, mg.nseg, per_task, hd, sinks ? sinks[head] : -INFINITY,
                     out + (row * num_heads + head) * hd);
      }
    }
  });
}

void paged_attention(const float* q, const KVLayer& kv, const AttnSeq* seqs, int32_t num_seqs, int32_t num_heads,
                     float scale, int32_t window, float* out, float softcap,
                          const float* sinks) {
  paged_attention_with<DotDecode>(q, kv, seqs, num_seqs, num_heads, scale, softcap, sinks, window, out);
}
