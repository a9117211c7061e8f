// paged_attention: causal attention of each sequence's query rows over its keys in the blocked KV pool.
// Textually included by isa_body.h inside the ISA namespace (see simd.h); written once for every ISA.

// Pool row of kv head h at position p of a sequence:  base[((table[p / bs] * nkv + h) * bs + p % bs) * hd]
inline const float* kv_row(const float* base, const KVLayer& kv, const int32_t* table, int64_t h, int64_t p) {
  const int64_t bs = kv.block_size;
  return base + (((int64_t)table[p / bs] * kv.num_kv_heads + h) * bs + p % bs) * kv.head_dim;
}

// One query row: out = softmax(scale * q . K[lo..hi]^T) V[lo..hi], online softmax over keys lo..hi-1.
inline void attend_row(const float* q, const KVLayer& kv, const int32_t* table, int64_t h, int64_t lo, int64_t hi,
                       float scale, float* out) {
  const int hd = kv.head_dim;
  float acc[1024];
  for (int d = 0; d < hd; ++d) acc[d] = 0.0f;
  float m = -INFINITY, l = 0.0f;
  for (int64_t p = lo; p < hi; ++p) {
    const float* kr = kv_row(kv.k, kv, table, h, p);
    const float* vr = kv_row(kv.v, kv, table, h, p);
    V s = vzero();
    int d = 0;
    for (; d + kW <= hd; d += kW) s = vfma(vload(q + d), vload(kr + d), s);
    if (d < hd) s = vfma(vload_n(q + d, hd - d), vload_n(kr + d, hd - d), s);
    const float score = vsum(s) * scale;
    if (score > m) {
      const float corr = expf(m - score);
      l *= corr;
      const V vc = vset1(corr);
      for (d = 0; d + kW <= hd; d += kW) vstore(acc + d, vload(acc + d) * vc);
      for (; d < hd; ++d) acc[d] *= corr;
      m = score;
    }
    const float e = expf(score - m);
    l += e;
    const V ve = vset1(e);
    for (d = 0; d + kW <= hd; d += kW) vstore(acc + d, vfma(ve, vload(vr + d), vload(acc + d)));
    for (; d < hd; ++d) acc[d] += e * vr[d];
  }
  const float inv = 1.0f / l;
  for (int d = 0; d < hd; ++d) out[d] = acc[d] * inv;
}

void paged_attention(const float* q, const KVLayer& kv, const AttnSeq* seqs, int32_t num_seqs, int32_t num_heads,
                     float scale, int32_t window, float* out) {
  const int64_t hd = kv.head_dim, group = num_heads / kv.num_kv_heads;
#pragma omp parallel for collapse(2) schedule(dynamic, 1)
  for (int32_t s = 0; s < num_seqs; ++s) {
    for (int32_t h = 0; h < num_heads; ++h) {
      const AttnSeq& seq = seqs[s];
      for (int32_t j = 0; j < seq.q_len; ++j) {
        const int64_t row = seq.q_row + j, pos = (int64_t)seq.ctx_len - seq.q_len + j;
        const int64_t lo = window > 0 && pos - window + 1 > 0 ? pos - window + 1 : 0;
        attend_row(q + (row * num_heads + h) * hd, kv, seq.block_table, h / group, lo, pos + 1, scale,
                   out + (row * num_heads + h) * hd);
      }
    }
  }
}
