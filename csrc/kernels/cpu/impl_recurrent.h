// Recurrent layers: Gated DeltaNet's short causal convolution and gated delta rule (ops.h), each sequence's rows
// in order with its state carried in place (and copied out after each checkpointed row). Both are one step per row (the recurrent form), for prompt rows as
// for decode rows: per row and value head the delta rule reads and writes the Dk x Dv matrix twice (decay and
// S^T k, then the update and S^T q), a few flops per weight-row byte, so a layer's time stays in its linears.

// Per sequence and run of channels: the K - 1 previous inputs of each channel in registers, one row at a time.
void causal_conv1d(float* x, int64_t row_stride, int64_t channels, const float* w, int K, const RecurrentSeq* seqs,
                   int32_t num_seqs) {
  const int64_t kRun = 16 * kW;  // channels per task
  const int64_t runs = (channels + kRun - 1) / kRun;
  int64_t rows = 0;
  for (int32_t s = 0; s < num_seqs; ++s) rows += seqs[s].num_rows;
  parallel_for(num_seqs * runs, 1, worth_threads(rows * channels * K), [&](int64_t i0, int64_t i1) {
    for (int64_t i = i0; i < i1; ++i) {
      const RecurrentSeq& sq = seqs[i / runs];
      const int64_t c_begin = (i % runs) * kRun, c_end = c_begin + kRun < channels ? c_begin + kRun : channels;
      for (int64_t c = c_begin; c < c_end; c += kW) {
        const int r = c_end - c < kW ? (int)(c_end - c) : kW;
        V taps[8], hist[8];
        for (int j = 0; j < K; ++j) taps[j] = vload_r(w + j * channels + c, r);
        for (int j = 0; j + 1 < K; ++j) hist[j] = vload_r(sq.conv_state + j * channels + c, r);
        for (int32_t t = 0; t < sq.num_rows; ++t) {
          float* row = x + (int64_t)(sq.first_row + t) * row_stride + c;
          const V in = vload_r(row, r);
          V y = taps[K - 1] * in;
          for (int j = 0; j + 1 < K; ++j) y = vfma(taps[j], hist[j], y);
          for (int j = 0; j + 2 < K; ++j) hist[j] = hist[j + 1];
          if (K > 1) hist[K - 2] = in;
          vstore_r(row, vsilu(y), r);
          if (t < sq.num_checkpoints)
            for (int j = 0; j + 1 < K; ++j) vstore_r(sq.conv_checkpoints[t] + j * channels + c, hist[j], r);
        }
        for (int j = 0; j + 1 < K; ++j) vstore_r(sq.conv_state + j * channels + c, hist[j], r);
      }
    }
  });
}

// a[0, n) . b[0, n)
inline float dot_n(const float* a, const float* b, int n) {
  V acc = vzero();
  int i = 0;
  for (; i + kW <= n; i += kW) acc = vfma(vload(a + i), vload(b + i), acc);
  if (i < n) acc = vfma(vload_n(a + i, n - i), vload_n(b + i, n - i), acc);
  return vsum(acc);
}

// One task per (sequence, value head): its rows in order against its Dk x Dv matrix.
void gated_delta_rule(const float* q, const float* k, const float* v, int64_t qkv_stride, const float* g,
                      const float* beta, const RecurrentSeq* seqs, int32_t num_seqs, int num_k_heads, int num_v_heads,
                      int k_head_dim, int v_head_dim, float* out, int64_t out_stride, bool value_heads_tiled) {
  const int Hv = num_v_heads, Dk = k_head_dim, Dv = v_head_dim, group = num_v_heads / num_k_heads;
  int64_t rows = 0;
  for (int32_t s = 0; s < num_seqs; ++s) rows += seqs[s].num_rows;
  parallel_for((int64_t)num_seqs * Hv, 1, worth_threads(rows * Hv * Dk * Dv), [&](int64_t i0, int64_t i1) {
    float qs[512], ks[512], kv[512], u[512], o[512];
    const float q_scale = 1.0f / sqrtf((float)Dk);
    for (int64_t i = i0; i < i1; ++i) {
      const RecurrentSeq& sq = seqs[i / Hv];
      const int h = (int)(i % Hv), kh = value_heads_tiled ? h % num_k_heads : h / group;
      float* S = sq.state + (int64_t)h * Dk * Dv;
      for (int32_t t = 0; t < sq.num_rows; ++t) {
        const int64_t row = sq.first_row + t;
        const float* qr = q + row * qkv_stride + (int64_t)kh * Dk;
        const float* kr = k + row * qkv_stride + (int64_t)kh * Dk;
        const float* vr = v + row * qkv_stride + (int64_t)h * Dv;
        const float rq = q_scale / sqrtf(dot_n(qr, qr, Dk) + 1e-6f), rk = 1.0f / sqrtf(dot_n(kr, kr, Dk) + 1e-6f);
        for (int d = 0; d < Dk; ++d) qs[d] = qr[d] * rq, ks[d] = kr[d] * rk;
        const V decay = vset1(expf(g[row * Hv + h]));
        // pass 1: S <- decay S, kv = S^T k
        for (int e = 0; e < Dv; ++e) kv[e] = 0.0f;
        for (int d = 0; d < Dk; ++d) {
          float* Sd = S + (int64_t)d * Dv;
          const V kd = vset1(ks[d]);
          int e = 0;
          for (; e + kW <= Dv; e += kW) {
            const V s = vload(Sd + e) * decay;
            vstore(Sd + e, s);
            vstore(kv + e, vfma(kd, s, vload(kv + e)));
          }
          if (e < Dv) {
            const int r = Dv - e;
            const V s = vload_n(Sd + e, r) * decay;
            vstore_n(Sd + e, s, r);
            vstore_n(kv + e, vfma(kd, s, vload_n(kv + e, r)), r);
          }
        }
        const float b = beta[row * Hv + h];
        for (int e = 0; e < Dv; ++e) u[e] = b * (vr[e] - kv[e]), o[e] = 0.0f;
        // pass 2: S <- S + k u^T, o = S^T q
        for (int d = 0; d < Dk; ++d) {
          float* Sd = S + (int64_t)d * Dv;
          const V kd = vset1(ks[d]), qd = vset1(qs[d]);
          int e = 0;
          for (; e + kW <= Dv; e += kW) {
            const V s = vfma(kd, vload(u + e), vload(Sd + e));
            vstore(Sd + e, s);
            vstore(o + e, vfma(qd, s, vload(o + e)));
          }
          if (e < Dv) {
            const int r = Dv - e;
            const V s = vfma(kd, vload_n(u + e, r), vload_n(Sd + e, r));
            vstore_n(Sd + e, s, r);
            vstore_n(o + e, vfma(qd, s, vload_n(o + e, r)), r);
          }
        }
        float* dst = out + row * out_stride + (int64_t)h * Dv;
        for (int e = 0; e < Dv; ++e) dst[e] = o[e];
        if (t < sq.num_checkpoints)
          memcpy(sq.state_checkpoints[t] + (int64_t)h * Dk * Dv, S, (size_t)Dk * Dv * sizeof(float));
      }
    }
  });
}
