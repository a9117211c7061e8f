// The op interface: the model code calls these and nothing else. One dispatch point per op;
// the CPU backend picks AVX-512 / AVX2+FMA / generic code once, at run time, from what the CPU supports.
//
// Conventions (CPU backend):
//   - activations are fp32, row-major, rows = tokens of the fused batch;
//   - weights are views in their stored dtype (F32, F16 or BF16) and are converted inside the kernel,
//     never expanded into fp32 copies of whole matrices;
//   - kernels are multi-threaded with OpenMP over the calling thread's thread count (set_num_threads);
//   - inputs are checked at the door (dtype, shape) with LMKIT_CHECK.
#pragma once
#include <stdint.h>

#include <memory>

#include "core/tensor.h"

namespace lmkit::ops {

// Threads used by the ops called from this thread (OpenMP ICV of the caller).
void set_num_threads(int num_threads);
// Name of the instruction set picked at run time: "avx512", "avx2" or "generic".
const char* cpu_isa();

// out[t, :] = table[ids[t], :] as fp32.            table: [vocab, hidden] F32/F16/BF16, out: [n, hidden]
void embedding(const Tensor& table, const int32_t* ids, int64_t num_tokens, float* out);

// out[r, :] = x[r, :] / sqrt(mean(x[r, :]^2) + eps) * weight     x, out: [num_rows, dim]; out may alias x.
void rmsnorm(const float* x, const Tensor& weight, float eps, int64_t num_rows, int64_t dim, float* out);

// residual[r, :] += x[r, :]; out[r, :] = rmsnorm(residual[r, :]) * weight.   (fused residual add + norm)
void add_rmsnorm(float* residual, const float* x, const Tensor& weight, float eps, int64_t num_rows,
                 int64_t dim, float* out);

// A linear layer's weight in the layout of this backend's kernels, made once at load time by
// pack_linear (owns its bytes; copies share them). CPU layout: panels of kLinearPanelCols output
// columns, k-major inside a panel, in the stored dtype (F32 / F16 / BF16), zero-padded past N:
//     data[(p * K + k) * kLinearPanelCols + j] = weight[p * kLinearPanelCols + j, k]
// so that one k step of a panel is one contiguous row: no horizontal sums, one stream per thread.
constexpr int kLinearPanelCols = 32;
struct LinearWeight {
  DType dtype = DType::F32;
  int64_t n = 0, k = 0;                // the weight is [n, k]
  std::shared_ptr<void> storage;       // the packed panels
  bool is_empty() const { return storage == nullptr; }
  int64_t size_bytes() const;
};
LinearWeight pack_linear(const Tensor& weight);  // weight: [N, K] F32/F16/BF16

// out[M, N] = x[M, K] @ weight[N, K]^T (+ bias[N]).   bias empty or any float dtype.
// One kernel for every M: decode (M = 1..few) streams the weight once, prefill is compute bound.
void linear(const float* x, int64_t M, const LinearWeight& weight, const Tensor& bias, float* out);
// The same for an unpacked weight: packs it first (tests and one-off calls; the model packs at load).
void linear(const float* x, int64_t M, const Tensor& weight, const Tensor& bias, float* out);

// Rotary embedding in HF "rotate_half" layout, in place.
//   q: [n, num_heads, head_dim], k: [n, num_kv_heads, head_dim]
//   for i < head_dim/2: angle = float(positions[t]) * inv_freq[i] (fp32 product, as HF computes it),
//   c = cos(angle) * attention_scaling, s = sin(angle) * attention_scaling,
//   (x[i], x[i + head_dim/2]) <- (x[i] c - x[i + head_dim/2] s, x[i + head_dim/2] c + x[i] s)
void rope(float* q, float* k, const int32_t* positions, int64_t n, int num_heads, int num_kv_heads,
          int head_dim, const float* inv_freq, float attention_scaling);

// out[t, j] = silu(gate[t, j]) * up[t, j]          all [n, inter]; out may alias gate or up.
void silu_mul(const float* gate, const float* up, int64_t n, int64_t inter, float* out);

// One layer of the blocked KV pool (fp32 for now; quantized layouts come with quant_policy).
//   k, v: [num_blocks, num_kv_heads, block_size, head_dim]
struct KVLayer {
  float* k = nullptr;
  float* v = nullptr;
  int32_t num_blocks = 0;
  int32_t num_kv_heads = 0;
  int32_t block_size = 0;
  int32_t head_dim = 0;
};

// Writes k, v rows ([n, num_kv_heads, head_dim]) into the pool at slots[t] = block_id * block_size + offset.
void kv_write(const KVLayer& kv, const float* k, const float* v, const int32_t* slots, int64_t n);

// One sequence of the fused batch, as attention sees it.
struct AttnSeq {
  int32_t q_row = 0;    // first row of this sequence's queries in q / out
  int32_t q_len = 0;    // query rows (prefill chunk length, 1 for a decode step)
  int32_t ctx_len = 0;  // keys in the cache incl. this chunk; query j sits at position ctx_len - q_len + j
  const int32_t* block_table = nullptr;  // ceil(ctx_len / block_size) block ids, position p -> block p / block_size
};

// Causal paged attention over the blocked KV pool (keys/values of this chunk must already be written).
//   q: [rows, num_heads, head_dim], out: [rows, num_heads, head_dim]
//   query head h reads kv head h / (num_heads / num_kv_heads) (GQA);
//   a query at position p sees keys at positions k <= p, and when sliding_window > 0 only p - k < sliding_window.
//   out = softmax(scale * q . K^T) V, computed with an online softmax in fp32.
void paged_attention(const float* q, const KVLayer& kv, const AttnSeq* seqs, int32_t num_seqs,
                     int32_t num_heads, float scale, int32_t sliding_window, float* out);

}  // namespace lmkit::ops
