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
          const float* inv_freq, float attention_scaling) {
  const int half = head_dim / 2;
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

void kv_write(const KVLayer& kv, const float* k, const float* v, const int32_t* slots, int64_t n) {
  const int64_t hd = kv.head_dim, nkv = kv.num_kv_heads, bs = kv.block_size;
  for (int64_t t = 0; t < n; ++t) {
    if (slots[t] < 0) continue;
    const int64_t block = slots[t] / bs, offset = slots[t] % bs;
    for (int64_t h = 0; h < nkv; ++h)
      for (int64_t d = 0; d < hd; ++d) {
        kv.k[((block * nkv + h) * bs + offset) * hd + d] = k[(t * nkv + h) * hd + d];
        kv.v[((block * nkv + h) * bs + offset) * hd + d] = v[(t * nkv + h) * hd + d];
      }
  }
}

void paged_attention(const float* q, const KVLayer& kv, const AttnSeq* seqs, int32_t num_seqs, int32_t num_heads,
                     float scale, int32_t sliding_window, float* out) {
  const int64_t hd = kv.head_dim, nkv = kv.num_kv_heads, bs = kv.block_size, group = num_heads / nkv;
  auto row = [&](const float* base, const AttnSeq& s, int64_t h, int64_t p) {
    return base + (((int64_t)s.block_table[p / bs] * nkv + h) * bs + p % bs) * hd;
  };
  for (int32_t si = 0; si < num_seqs; ++si) {
    const AttnSeq& s = seqs[si];
    for (int64_t j = 0; j < s.q_len; ++j) {
      const int64_t r = s.q_row + j, pos = (int64_t)s.ctx_len - s.q_len + j;
      const int64_t lo = sliding_window > 0 ? std::max<int64_t>(0, pos - sliding_window + 1) : 0;
      for (int64_t h = 0; h < num_heads; ++h) {
        const float* qr = q + (r * num_heads + h) * hd;
        std::vector<double> w(pos + 1 - lo);
        double mx = -INFINITY;
        for (int64_t p = lo; p <= pos; ++p) {
          const float* kr = row(kv.k, s, h / group, p);
          double d = 0;
          for (int64_t i = 0; i < hd; ++i) d += (double)qr[i] * kr[i];
          w[p - lo] = d * scale;
          mx = std::max(mx, w[p - lo]);
        }
        double sum = 0;
        for (double& x : w) sum += (x = std::exp(x - mx));
        for (int64_t i = 0; i < hd; ++i) {
          double acc = 0;
          for (int64_t p = lo; p <= pos; ++p) acc += w[p - lo] * row(kv.v, s, h / group, p)[i];
          out[(r * num_heads + h) * hd + i] = (float)(acc / sum);
        }
      }
    }
  }
}

}  // namespace lmkit::ops::reference
