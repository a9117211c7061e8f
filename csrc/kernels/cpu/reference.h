// Scalar reference of every CPU op (ops.h), written for clarity: double accumulation, no threads, no
// SIMD. The kernel tests hold every ISA path to these. Same signatures and contracts as ops.h.
#pragma once
#include <stdint.h>

#include "kernels/ops.h"

namespace lmkit::ops::reference {

// Element i of a float weight (F32 / F16 / BF16) as float.
float weight_at(const Tensor& w, int64_t i);

void embedding(const Tensor& table, const int32_t* ids, int64_t num_tokens, float* out);
void rmsnorm(const float* x, const Tensor& weight, float eps, int64_t num_rows, int64_t dim, float* out);
void add_rmsnorm(float* residual, const float* x, const Tensor& weight, float eps, int64_t num_rows, int64_t dim,
                 float* out);
void linear(const float* x, int64_t M, const Tensor& weight, const Tensor& bias, float* out);
void rope(float* q, float* k, const int32_t* positions, int64_t n, int num_heads, int num_kv_heads, int head_dim,
          const float* inv_freq, float attention_scaling, int rotary_dim = 0);
void silu_mul(const float* gate, const float* up, int64_t n, int64_t inter, float* out);
// gelu_tanh in the tanh form of the definition (torch's gelu(approximate='tanh')), in double.
void gelu_tanh_mul(const float* gate, const float* up, int64_t n, int64_t inter, float* out);
void clamped_swiglu_mul(const float* gate, const float* up, int64_t n, int64_t inter, float alpha, float limit,
                        float* out);
void softcap(float* x, int64_t n, float cap);
void scale(float* x, int64_t n, float s);
void log_sum_exp(const float* x, int64_t rows, int64_t n, float* out, int32_t* argmax = nullptr);
// Value d of pool row (block, head h, offset off) of K (is_v false) or V, dequantized in double.
double kv_value(const KVLayer& kv, bool is_v, int64_t block, int64_t h, int64_t off, int64_t d);
// Quantizes (bits 8 / 4) straight from the definition in ops.h.
void kv_write(const KVLayer& kv, const float* k, const float* v, const int32_t* slots, int64_t n);
// Plain two-pass softmax in double (not online), straight from the definition (sinks: one more logit per head, with
// no value); reads the block table only at the positions a query's window reaches.
void paged_attention(const float* q, const KVLayer& kv, const AttnSeq* seqs, int32_t num_seqs, int32_t num_heads,
                     float scale, int32_t sliding_window, float* out, float logit_softcap = 0.0f,
                     const float* sinks = nullptr);

// Gated DeltaNet (ops.h), in double: the convolution per channel, the delta rule per head, row by row.
void causal_conv1d(float* x, int64_t row_stride, int64_t channels, const float* w, int K, const RecurrentSeq* seqs,
                   int32_t num_seqs);
void gated_delta_rule(const float* q, const float* k, const float* v, int64_t qkv_stride, const float* g,
                      const float* beta, const RecurrentSeq* seqs, int32_t num_seqs, int num_k_heads, int num_v_heads,
                      int k_head_dim, int v_head_dim, float* out, int64_t out_stride, bool value_heads_tiled);

}  // namespace lmkit::ops::reference
