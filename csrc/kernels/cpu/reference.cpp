#include "kernels/cpu/reference.h"

#include <algorithm>
#include <cmath>
#include <vector>

namespace lmkit::ops::reference {

float weight_at(const Tensor& w, int64_t i) {
  switch (w.dtype) {
    case DType::F16: return f16_to_f32(w.ptr<uint16_t>()[i]);
    case DType::BF16: return bf16_to_f32(w.ptr<uint16_t>()[i]);
    default: return w.ptr<float>()[i];
  }
}

void embedding(const Tensor& table, const int32_t* ids, int64_t num_tokens, float* out) {
  const int64_t hidden = table.shape[1];
  for (int64_t t = 0; t < num_tokens; ++t)
    for (int64_t i = 0; i < hidden; ++i) out[t * hidden + i] = weight_at(table, ids[t] * hidden + i);
}

void rmsnorm(const float* x, const Tensor& weight, float eps, int64_t num_rows, int64_t dim, float* out) {
  for (int64_t r = 0; r < num_rows; ++r) {
    double ss = 0;
    for (int64_t i = 0; i < dim; ++i) ss += (double)x[r * dim + i] * x[r * dim + i];
    const double inv = 1.0 / std::sqrt(ss / dim + eps);
    for (int64_t i = 0; i < dim; ++i) out[r * dim + i] = (float)(x[r * dim + i] * inv * weight_at(weight, i));
  }
}

void add_rmsnorm(float* residual, const float* x, const Tensor& weight, float eps, int64_t num_rows, int64_t dim,
                 float* out) {
  for (int64_t i = 0; i < num_rows * dim; ++i) residual[i] += x[i];
  rmsnorm(residual, weight, eps, num_rows, dim, out);
}

void linear(const float* x, int64_t M, const Tensor& weight, const Tensor& bias, float* out) {
  const int64_t N = weight.shape[0], K = weight.shape[1];
  std::vector<double> w(N * K);  // the weight as exact doubles, converted once
  for (int64_t i = 0; i < N * K; ++i) w[i] = weight_at(weight, i);
  for (int64_t m = 0; m < M; ++m)
    for (int64_t n = 0; n < N; ++n) {
      double s = bias.is_empty() ? 0.0 : weight_at(bias, n);
      const double* wr = w.data() + n * K;
      for (int64_t k = 0; k < K; ++k) s += (double)x[m * K + k] * wr[k];
      out[m * N + n] = (float)s;
    }
}

void rope(float* q, float* k, const int32_t* positions, int64_t n, int num_heads, int num_kv_heads, int head_dim,
          const float* inv_freq, float attention_scaling, int rotary_dim) {
  const int half = (rotary_dim == 0 ? head_dim : rotary_dim) / 2;  // dims from 2 * half on pass unchanged
  auto rotate = [&](float* x, const std::vector<double>& c, const std::vector<double>& s) {
    for (int i = 0; i < half; ++i) {
      const double a = x[i], b = x[i + half];
      x[i] = (float)(a * c[i] - b * s[i]);
      x[i + half] = (float)(b * c[i] + a * s[i]);
    }
  };
  std::vector<double> c(half), s(half);
  for (int64_t t = 0; t < n; ++t) {
    for (int i = 0; i < half; ++i) {
      const float angle = (float)positions[t] * inv_freq[i];  // fp32 product, by contract
      c[i] = std::cos((double)angle) * attention_scaling;
      s[i] = std::sin((double)angle) * attention_scaling;
    }
    for (int h = 0; h < num_heads; ++h) rotate(q + (t * num_heads + h) * head_dim, c, s);
    for (int h = 0; h < num_kv_heads; ++h) rotate(k + (t * num_kv_heads + h) * head_dim, c, s);
  }
}

void silu_mul(const float* gate, const float* up, int64_t n, int64_t inter, float* out) {
  for (int64_t i = 0; i < n * inter; ++i) {
    const double g = gate[i];
    out[i] = (float)(g / (1.0 + std::exp(-g)) * up[i]);
  }
}

void gelu_tanh_mul(const float* gate, const float* up, int64_t n, int64_t inter, float* out) {
  const double k = std::sqrt(2.0 / M_PI);
  for (int64_t i = 0; i < n * inter; ++i) {
    const double g = gate[i];
    out[i] = (float)(0.5 * g * (1.0 + std::tanh(k * (g + 0.044715 * g * g * g))) * up[i]);
  }
}

void clamped_swiglu_mul(const float* gate, const float* up, int64_t n, int64_t inter, float alpha, float limit,
                        float* out) {
  for (int64_t i = 0; i < n * inter; ++i) {
    const double g = std::min((double)gate[i], (double)limit);
    const double u = std::max(-(double)limit, std::min((double)up[i], (double)limit));
    out[i] = (float)(g / (1.0 + std::exp(-(double)alpha * g)) * (u + 1.0));
  }
}

void softcap(float* x, int64_t n, float cap) {
  for (int64_t i = 0; i < n; ++i) x[i] = (float)(cap * std::tanh((double)x[i] / cap));
}

void scale(float* x, int64_t n, float s) {
  for (int64_t i = 0; i < n; ++i) x[i] = (float)((double)x[i] * s);
}

void log_sum_exp(const float* x, int64_t rows, int64_t n, float* out, int32_t* argmax) {
  for (int64_t r = 0; r < rows; ++r) {
    const float* row = x + r * n;
    double m = -INFINITY;
    int32_t best = 0;
    for (int64_t i = 0; i < n; ++i)
      if ((double)row[i] > m) m = row[i], best = (int32_t)i;
    if (argmax) argmax[r] = best;
    if (m == -INFINITY) {
      out[r] = (float)m;
      continue;
    }
    double total = 0;
    for (int64_t i = 0; i < n; ++i) total += std::exp((double)row[i] - m);
    out[r] = (float)(m + std::log(total));
  }
}

namespace {
// Byte offset of pool row (block, head, offset) and of its (scale, zero) pair: the layout of ops.h.
int64_t kv_row_offset(const KVLayer& kv, int64_t block, int64_t h, int64_t off) {
  return block * kv.block_bytes() + (h * kv.block_size_tokens + off) * kv.row_bytes();
}
// bits 16: element d of token `off` of kv head h: K rows [h][off][d]; V rows of a token pair interleaved,
// [h][off / 2][d][off % 2] (ops.h).
uint16_t* bf16_element(const KVLayer& kv, bool is_v, int64_t block, int64_t h, int64_t off, int64_t d) {
  uint16_t* b = (uint16_t*)((char*)(is_v ? kv.v : kv.k) + block * kv.block_bytes());
  const int64_t hd = kv.head_dim, bs = kv.block_size_tokens;
  if (!is_v) return b + (h * bs + off) * hd + d;
  return b + ((h * (bs / 2) + off / 2) * hd + d) * 2 + off % 2;
}

int64_t kv_params_offset(const KVLayer& kv, int64_t block, int64_t h, int64_t off) {
  return block * kv.block_bytes() + (int64_t)kv.num_kv_heads * kv.block_size_tokens * kv.row_bytes() +
         (h * kv.block_size_tokens + off) * 4;
}

void write_row(const KVLayer& kv, bool is_v, int64_t block, int64_t h, int64_t off, const float* x) {
  const int64_t hd = kv.head_dim;
  void* base = is_v ? kv.v : kv.k;
  char* row = (char*)base + kv_row_offset(kv, block, h, off);
  if (kv.bits == 32) {
    for (int64_t d = 0; d < hd; ++d) ((float*)row)[d] = x[d];
    return;
  }
  if (kv.bits == 16) {
    for (int64_t d = 0; d < hd; ++d) *bf16_element(kv, is_v, block, h, off, d) = f32_to_bf16(x[d]);
    return;
  }
  // straight from the definition: fp16 scale and zero, round half to even, clamp
  const float lo = *std::min_element(x, x + hd), hi = *std::max_element(x, x + hd);
  const float qmax = (float)((1 << kv.bits) - 1);
  const uint16_t sh = f32_to_f16((hi - lo) / qmax), zh = f32_to_f16(lo);
  const float scale = f16_to_f32(sh), zero = f16_to_f32(zh);
  uint16_t* params = (uint16_t*)((char*)base + kv_params_offset(kv, block, h, off));
  params[0] = sh;
  params[1] = zh;
  std::vector<int> q(hd);
  for (int64_t d = 0; d < hd; ++d)
    q[d] = scale == 0.0f ? 0 : std::clamp((int)std::nearbyint((x[d] - zero) / scale), 0, (int)qmax);
  uint8_t* bytes = (uint8_t*)row;
  for (int64_t d = 0; d < hd; ++d) {
    if (kv.bits == 8) bytes[d] = (uint8_t)q[d];
    else if (d < hd / 2) bytes[d] = (uint8_t)(q[d] | (q[d + hd / 2] << 4));
  }
}
}  // namespace

double kv_value(const KVLayer& kv, bool is_v, int64_t block, int64_t h, int64_t off, int64_t d) {
  const char* base = (const char*)(is_v ? kv.v : kv.k);
  const char* row = base + kv_row_offset(kv, block, h, off);
  if (kv.bits == 32) return ((const float*)row)[d];
  if (kv.bits == 16) return bf16_to_f32(*bf16_element(kv, is_v, block, h, off, d));
  const uint16_t* params = (const uint16_t*)(base + kv_params_offset(kv, block, h, off));
  const int64_t half = kv.head_dim / 2;
  const uint8_t b = ((const uint8_t*)row)[kv.bits == 8 ? d : d % half];
  const int q = kv.bits == 8 ? b : d < half ? (b & 15) : (b >> 4);
  return (double)q * f16_to_f32(params[0]) + f16_to_f32(params[1]);
}

void kv_write(const KVLayer& kv, const float* k, const float* v, const int32_t* slots, int64_t n) {
  const int64_t hd = kv.head_dim, nkv = kv.num_kv_heads, bs = kv.block_size_tokens;
  for (int64_t t = 0; t < n; ++t) {
    if (slots[t] < 0) continue;
    const int64_t block = slots[t] / bs, offset = slots[t] % bs;
    for (int64_t h = 0; h < nkv; ++h) {
      write_row(kv, false, block, h, offset, k + (t * nkv + h) * hd);
      write_row(kv, true, block, h, offset, v + (t * nkv + h) * hd);
    }
  }
}

void paged_attention(const float* q, const KVLayer& kv, const AttnSeq* seqs, int32_t num_seqs, int32_t num_heads,
                     float scale, int32_t sliding_window, float* out, float logit_softcap, const float* sinks) {
  const int64_t hd = kv.head_dim, nkv = kv.num_kv_heads, bs = kv.block_size_tokens, group = num_heads / nkv;
  auto window_start = [&](int64_t pos) {  // the first key the query at pos attends to
    return sliding_window > 0 ? std::max<int64_t>(0, pos - sliding_window + 1) : int64_t{0};
  };
  for (int32_t si = 0; si < num_seqs; ++si) {
    const AttnSeq& s = seqs[si];
    // Every key and value this sequence's queries read, through kv_value once each (the queries of a group and
    // of a prefill share them): positions from the first query's window start, so no freed block is read.
    const int64_t first = window_start((int64_t)s.ctx_len - s.q_len);
    auto index = [&](int64_t h, int64_t p, int64_t d) { return ((p - first) * nkv + h) * hd + d; };
    std::vector<double> keys((s.ctx_len - first) * nkv * hd), values(keys.size());
    for (int64_t p = first; p < s.ctx_len; ++p)
      for (int64_t h = 0; h < nkv; ++h)
        for (int64_t d = 0; d < hd; ++d) {
          keys[index(h, p, d)] = kv_value(kv, false, s.block_table[p / bs], h, p % bs, d);
          values[index(h, p, d)] = kv_value(kv, true, s.block_table[p / bs], h, p % bs, d);
        }
    auto at = [&](bool is_v, int64_t h, int64_t p, int64_t d) { return (is_v ? values : keys)[index(h, p, d)]; };
    for (int64_t j = 0; j < s.q_len; ++j) {
      const int64_t r = s.q_row + j, pos = (int64_t)s.ctx_len - s.q_len + j;
      const int64_t lo = window_start(pos);
      for (int64_t h = 0; h < num_heads; ++h) {
        const float* qr = q + (r * num_heads + h) * hd;
        std::vector<double> w(pos + 1 - lo);
        double mx = -INFINITY;
        for (int64_t p = lo; p <= pos; ++p) {
          double d = 0;
          for (int64_t i = 0; i < hd; ++i) d += (double)qr[i] * at(false, h / group, p, i);
          w[p - lo] = logit_softcap > 0 ? logit_softcap * std::tanh(d * scale / logit_softcap) : d * scale;
          mx = std::max(mx, w[p - lo]);
        }
        // the sink: one more logit in the softmax, with no value
        if (sinks) mx = std::max(mx, (double)sinks[h]);
        double sum = sinks ? std::exp((double)sinks[h] - mx) : 0.0;
        for (double& x : w) sum += (x = std::exp(x - mx));
        std::vector<double> acc(hd, 0.0);
        for (int64_t p = lo; p <= pos; ++p)
          for (int64_t i = 0; i < hd; ++i) acc[i] += w[p - lo] * at(true, h / group, p, i);
        for (int64_t i = 0; i < hd; ++i) out[(r * num_heads + h) * hd + i] = (float)(acc[i] / sum);
      }
    }
  }
}

void causal_conv1d(float* x, int64_t row_stride, int64_t channels, const float* w, int K, const RecurrentSeq* seqs,
                   int32_t num_seqs) {
  for (int32_t s = 0; s < num_seqs; ++s) {
    const RecurrentSeq& sq = seqs[s];
    for (int64_t c = 0; c < channels; ++c) {
      std::vector<double> in;  // the K - 1 inputs before the first row, then the rows
      for (int j = 0; j + 1 < K; ++j) in.push_back(sq.conv_state[j * channels + c]);
      for (int32_t t = 0; t < sq.num_rows; ++t) in.push_back(x[(int64_t)(sq.first_row + t) * row_stride + c]);
      for (int32_t t = 0; t < sq.num_rows; ++t) {
        double y = 0;
        for (int j = 0; j < K; ++j) y += (double)w[j * channels + c] * in[t + j];
        x[(int64_t)(sq.first_row + t) * row_stride + c] = (float)(y / (1.0 + std::exp(-y)));
        for (int j = 0; j + 1 < K && t < sq.num_checkpoints; ++j)  // the K - 1 inputs up to row t
          sq.conv_checkpoints[t][j * channels + c] = (float)in[t + 1 + j];
      }
      for (int j = 0; j + 1 < K; ++j) sq.conv_state[j * channels + c] = (float)in[in.size() - (K - 1) + j];
    }
  }
}

void gated_delta_rule(const float* q, const float* k, const float* v, int64_t qkv_stride, const float* g,
                      const float* beta, const RecurrentSeq* seqs, int32_t num_seqs, int num_k_heads, int num_v_heads,
                      int k_head_dim, int v_head_dim, float* out, int64_t out_stride, bool value_heads_tiled) {
  const int Dk = k_head_dim, Dv = v_head_dim, group = num_v_heads / num_k_heads;
  for (int32_t s = 0; s < num_seqs; ++s) {
    const RecurrentSeq& sq = seqs[s];
    for (int h = 0; h < num_v_heads; ++h) {
      const int64_t kh = value_heads_tiled ? h % num_k_heads : h / group;  // the key head value head h reads
      std::vector<double> S(sq.state + (int64_t)h * Dk * Dv, sq.state + (int64_t)(h + 1) * Dk * Dv);
      for (int32_t t = 0; t < sq.num_rows; ++t) {
        const int64_t row = sq.first_row + t;
        const float* qr = q + row * qkv_stride + kh * Dk;
        const float* kr = k + row * qkv_stride + kh * Dk;
        const float* vr = v + row * qkv_stride + (int64_t)h * Dv;
        double nq = 0, nk = 0;
        for (int d = 0; d < Dk; ++d) nq += (double)qr[d] * qr[d], nk += (double)kr[d] * kr[d];
        std::vector<double> qn(Dk), kn(Dk);
        for (int d = 0; d < Dk; ++d)
          qn[d] = qr[d] / std::sqrt(nq + 1e-6) / std::sqrt((double)Dk), kn[d] = kr[d] / std::sqrt(nk + 1e-6);
        const double decay = std::exp((double)g[row * num_v_heads + h]), b = beta[row * num_v_heads + h];
        for (double& x : S) x *= decay;
        for (int e = 0; e < Dv; ++e) {
          double kv = 0;
          for (int d = 0; d < Dk; ++d) kv += S[(int64_t)d * Dv + e] * kn[d];
          const double u = b * (vr[e] - kv);
          double o = 0;
          for (int d = 0; d < Dk; ++d) {
            S[(int64_t)d * Dv + e] += kn[d] * u;
            o += S[(int64_t)d * Dv + e] * qn[d];
          }
          out[row * out_stride + (int64_t)h * Dv + e] = (float)o;
        }
        for (int64_t i = 0; i < (int64_t)Dk * Dv && t < sq.num_checkpoints; ++i)
          sq.state_checkpoints[t][(int64_t)h * Dk * Dv + i] = (float)S[i];
      }
      for (int64_t i = 0; i < (int64_t)Dk * Dv; ++i) sq.state[(int64_t)h * Dk * Dv + i] = (float)S[i];
    }
  }
}

}  // namespace lmkit::ops::reference
