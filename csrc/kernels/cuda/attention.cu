// Paged attention of the CUDA backend over the blocked KV pool (fp16/bf16, int8 or int4 rows), for the
// fused batch: prefill chunks and decode rows in one launch, causal, GQA, optional sliding window.
//
// Split-K ("flash decoding"): the keys a query row may see are cut into `num_splits` chunks. A CTA is
// (query row, kv head, chunk); its warps are the query heads that share the kv head, so a K/V row loaded
// once serves the whole group from L1. Each warp keeps an online softmax (max m, sum l, acc[head_dim])
// over its chunk; with one chunk it writes the output directly, otherwise its (m, l, acc) go to the
// workspace and a second kernel merges the chunks:
//     M = max_c m_c,  out = sum_c exp(m_c - M) acc_c / sum_c exp(m_c - M) l_c.
// Lane l owns head_dim elements [l E, l E + E), E = ceil(head_dim / 32); the dot product of one key is a
// warp sum. Quantized rows are dequantized in registers (no copy of the cache).
#include <algorithm>

#include "kernels/cuda/common.cuh"

namespace lmkit::cuda {
namespace {

constexpr int kTargetCtas = 2048;    // split only while the grid is smaller than this
constexpr int kMinChunkTokens = 16;  // ... and never into chunks shorter than this

struct SplitPlan {
  int num_splits;
};
SplitPlan plan_splits(int32_t num_rows, int32_t num_heads, int32_t max_ctx_len) {
  const int64_t work = std::max<int64_t>(1, (int64_t)num_rows * num_heads);
  int64_t splits = std::max<int64_t>(1, kTargetCtas / work);
  splits = std::min<int64_t>(splits, std::max<int64_t>(1, ceil_div(max_ctx_len, kMinChunkTokens)));
  return {(int)splits};
}

// Element d of row `row` of a K or V block, as float.
template <typename T>
__device__ __forceinline__ void load_row(const ops::KVLayer& kv, const char* block, int64_t row, int d0, int E,
                                         float* out) {
  const int hd = kv.head_dim;
  if (kv.bits == 16) {
    const T* r = reinterpret_cast<const T*>(block) + row * hd;
    for (int e = 0; e < E; ++e) out[e] = d0 + e < hd ? to_float(r[d0 + e]) : 0.0f;
    return;
  }
  const uint8_t* q = reinterpret_cast<const uint8_t*>(block) + row * kv.row_bytes();
  const __half* params = reinterpret_cast<const __half*>(block + (int64_t)kv.num_kv_heads * kv.block_size_tokens * kv.row_bytes());
  const float s = __half2float(params[2 * row]), z = __half2float(params[2 * row + 1]);
  if (kv.bits == 8) {
    for (int e = 0; e < E; ++e) out[e] = d0 + e < hd ? (float)q[d0 + e] * s + z : 0.0f;
  } else {
    const int half = hd / 2;
    for (int e = 0; e < E; ++e) {
      const int d = d0 + e;
      if (d >= hd) {
        out[e] = 0.0f;
        continue;
      }
      const uint8_t b = q[d < half ? d : d - half];
      out[e] = (float)(d < half ? (b & 15) : (b >> 4)) * s + z;
    }
  }
}

constexpr int kMaxGroup = 16;  // query heads per kv head (warps per CTA) at most

// kKeys keys at a time: their table entries, K and V rows are all loaded before the first is used, so a warp
// waits for one round trip to memory per kKeys keys instead of one per key. Split (decode-sized) grids take 4
// (2 for head_dim > 128): with chunks of 16 keys, batch-1 decode of Llama-2-7B on an H200 gained ~29 us a layer
// (fp16 144 -> 166 tok/s) of the 67 us its attention took.
// Unsplit grids (prefill, big batches) take 1: the 4-key loop made a 16 x 512-token prefill 50% slower on an
// H200 (90 registers against 40: fewer warps per SM, where the warps of a prefill already cover the latency).
// A minimum of 1 block per SM lets ptxas give the 4-key instance its 90 registers (without it: 64 and a
// spill); 0 is the default, for the one-key instance.
template <typename T, int E, int kKeys>
__global__ void __launch_bounds__(32 * kMaxGroup, kKeys > 1 ? 1 : 0)
    attention_kernel(const T* __restrict__ q, int64_t q_row_stride, ops::KVLayer kv, AttnBatch batch, int num_heads,
                     float scale, int sliding_window, int num_splits, float* __restrict__ workspace,
                     T* __restrict__ out) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int group = num_heads / kv.num_kv_heads;
  const int r = blockIdx.x;
  const int kv_head = blockIdx.y;
  const int split = blockIdx.z;
  const int h = kv_head * group + warp;
  const int hd = kv.head_dim;
  const int s = batch.row_seq[r];
  const int q0 = batch.q_start[s], q_len = batch.q_start[s + 1] - q0, ctx = batch.ctx_lens[s];
  const int pos = ctx - q_len + (r - q0);
  int lo = sliding_window > 0 ? max(0, pos - sliding_window + 1) : 0;
  int hi = pos + 1;  // keys [lo, hi), cut into num_splits chunks of this row's own length (at least
                     // kMinChunkTokens; trailing chunks may be empty), so a short row in a batch planned for a
                     // long one (a CUDA graph is planned for session_len) still spreads over the splits
  const int chunk = max(kMinChunkTokens, (hi - lo + num_splits - 1) / num_splits);
  lo = lo + split * chunk;
  hi = min(hi, lo + chunk);

  const int d0 = lane * E;
  float qv[E], acc[E];
  const T* qr = q + (int64_t)r * q_row_stride + (int64_t)h * hd;
  for (int e = 0; e < E; ++e) {
    qv[e] = d0 + e < hd ? to_float(qr[d0 + e]) * scale : 0.0f;
    acc[e] = 0.0f;
  }
  float m = -INFINITY, l = 0.0f;
  // Only the entries of blocks holding keys [lo, hi) are read: those of blocks wholly before the window may
  // be kNoBlock (freed by the scheduler).
  const int32_t* table = batch.block_tables + (int64_t)s * batch.max_blocks_per_seq;
  const int64_t block_bytes = kv.block_bytes();
  const char* kbase = static_cast<const char*>(kv.k);
  const char* vbase = static_cast<const char*>(kv.v);
  for (int j0 = lo; j0 < hi; j0 += kKeys) {
    float kr[kKeys][E], vr[kKeys][E];
#pragma unroll
    for (int u = 0; u < kKeys; ++u) {
      const int j = j0 + u;
      if (j < hi) {
        const int64_t block = table[j / kv.block_size_tokens];
        const int64_t row = (int64_t)kv_head * kv.block_size_tokens + j % kv.block_size_tokens;
        load_row<T>(kv, kbase + block * block_bytes, row, d0, E, kr[u]);
        load_row<T>(kv, vbase + block * block_bytes, row, d0, E, vr[u]);
      } else {
#pragma unroll
        for (int e = 0; e < E; ++e) kr[u][e] = vr[u][e] = 0.0f;
      }
    }
    float dot[kKeys];
#pragma unroll
    for (int u = 0; u < kKeys; ++u) {
      float d = 0.0f;
#pragma unroll
      for (int e = 0; e < E; ++e) d += qv[e] * kr[u][e];
      dot[u] = d;
    }
#pragma unroll
    for (int u = 0; u < kKeys; ++u) dot[u] = j0 + u < hi ? warp_sum(dot[u]) : -INFINITY;
    float m_new = m;
#pragma unroll
    for (int u = 0; u < kKeys; ++u) m_new = fmaxf(m_new, dot[u]);  // finite: key j0 < hi is real
    const float corr = __expf(m - m_new);
    l *= corr;
#pragma unroll
    for (int e = 0; e < E; ++e) acc[e] *= corr;
#pragma unroll
    for (int u = 0; u < kKeys; ++u) {
      const float p = __expf(dot[u] - m_new);  // 0 for the keys past hi
      l += p;
#pragma unroll
      for (int e = 0; e < E; ++e) acc[e] += p * vr[u][e];
    }
    m = m_new;
  }
  if (num_splits == 1) {
    T* o = out + ((int64_t)r * num_heads + h) * hd;
    const float inv = l > 0.0f ? 1.0f / l : 0.0f;
    for (int e = 0; e < E; ++e)
      if (d0 + e < hd) o[d0 + e] = from_float<T>(acc[e] * inv);
    return;
  }
  // workspace: [rows, num_heads, num_splits, head_dim + 2] (acc, then m, l)
  float* w = workspace + (((int64_t)r * num_heads + h) * num_splits + split) * (hd + 2);
  for (int e = 0; e < E; ++e)
    if (d0 + e < hd) w[d0 + e] = acc[e];
  if (lane == 0) w[hd] = m, w[hd + 1] = l;
}

template <typename T>
__global__ void merge_splits_kernel(const float* __restrict__ workspace, int64_t num_pairs, int num_splits, int hd,
                                    T* __restrict__ out) {
  const int64_t pair = (int64_t)blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5);  // row * num_heads + head
  if (pair >= num_pairs) return;
  const int lane = threadIdx.x & 31;
  const float* w = workspace + pair * num_splits * (hd + 2);
  float M = -INFINITY;
  for (int c = 0; c < num_splits; ++c) M = fmaxf(M, w[c * (hd + 2) + hd]);
  float L = 0.0f;
  for (int c = 0; c < num_splits; ++c) {
    const float mc = w[c * (hd + 2) + hd];
    if (mc > -INFINITY) L += __expf(mc - M) * w[c * (hd + 2) + hd + 1];
  }
  const float inv = L > 0.0f ? 1.0f / L : 0.0f;
  for (int d = lane; d < hd; d += 32) {
    float v = 0.0f;
    for (int c = 0; c < num_splits; ++c) {
      const float mc = w[c * (hd + 2) + hd];
      if (mc > -INFINITY) v += __expf(mc - M) * w[c * (hd + 2) + d];
    }
    out[pair * hd + d] = from_float<T>(v * inv);
  }
}

template <typename T, int E>
void launch_attention(const void* q, int64_t q_row_stride, const ops::KVLayer& kv, const AttnBatch& batch,
                      int32_t num_heads, float scale, int32_t sliding_window, const SplitPlan& plan, void* workspace,
                      void* out, cudaStream_t stream) {
  const dim3 grid((unsigned)batch.num_rows, (unsigned)kv.num_kv_heads, (unsigned)plan.num_splits);
  const int threads = 32 * (num_heads / kv.num_kv_heads);
  auto kernel = plan.num_splits > 1 ? attention_kernel<T, E, (E <= 4 ? 4 : 2)> : attention_kernel<T, E, 1>;
  kernel<<<grid, threads, 0, stream>>>(static_cast<const T*>(q), q_row_stride, kv, batch, num_heads, scale,
                                       sliding_window, plan.num_splits, static_cast<float*>(workspace),
                                       static_cast<T*>(out));
}

}  // namespace

int64_t attention_workspace_bytes(int32_t num_rows, int32_t num_heads, int32_t head_dim, int32_t max_ctx_len) {
  const SplitPlan plan = plan_splits(num_rows, num_heads, max_ctx_len);
  if (plan.num_splits == 1) return 0;
  return (int64_t)num_rows * num_heads * plan.num_splits * (head_dim + 2) * (int64_t)sizeof(float);
}

void paged_attention(const void* q, int64_t q_row_stride, const ops::KVLayer& kv, const AttnBatch& batch,
                     int32_t num_heads, float scale, int32_t sliding_window, void* workspace, void* out, DType act,
                     Stream stream) {
  const char* op = "cuda::paged_attention";
  LMKIT_CHECK_ARG(kv.bits == 16 || kv.bits == 8 || kv.bits == 4, op, ": KV bits must be 16, 8 or 4, got ", kv.bits);
  LMKIT_CHECK_ARG(kv.head_dim > 0 && kv.head_dim % 2 == 0 && kv.head_dim <= kCudaMaxHeadDim, op,
                  ": head_dim must be even and at most ", kCudaMaxHeadDim, ", got ", kv.head_dim);
  LMKIT_CHECK_ARG(num_heads > 0 && kv.num_kv_heads > 0 && num_heads % kv.num_kv_heads == 0, op, ": num_heads ",
                  num_heads, " must be a multiple of num_kv_heads ", kv.num_kv_heads);
  LMKIT_CHECK_ARG(num_heads / kv.num_kv_heads <= kMaxGroup, op, ": at most ", kMaxGroup,
                  " query heads per kv head, got ", num_heads / kv.num_kv_heads);
  LMKIT_CHECK_ARG(q_row_stride >= (int64_t)num_heads * kv.head_dim, op, ": q_row_stride ", q_row_stride,
                  " is shorter than a row of q");
  if (batch.num_rows == 0) return;
  const SplitPlan plan = plan_splits(batch.num_rows, num_heads, batch.max_ctx_len);
  LMKIT_CHECK_ARG(plan.num_splits == 1 || workspace != nullptr, op, ": this batch needs ",
                  attention_workspace_bytes(batch.num_rows, num_heads, kv.head_dim, batch.max_ctx_len),
                  " bytes of workspace");
  const int E = (kv.head_dim + 31) / 32;
  cudaStream_t s = as_stream(stream);
  dispatch_act(act, op, [&](auto t) {
    using T = decltype(t);
    switch (E) {
      case 1: launch_attention<T, 1>(q, q_row_stride, kv, batch, num_heads, scale, sliding_window, plan, workspace, out, s); break;
      case 2: launch_attention<T, 2>(q, q_row_stride, kv, batch, num_heads, scale, sliding_window, plan, workspace, out, s); break;
      case 3: launch_attention<T, 3>(q, q_row_stride, kv, batch, num_heads, scale, sliding_window, plan, workspace, out, s); break;
      case 4: launch_attention<T, 4>(q, q_row_stride, kv, batch, num_heads, scale, sliding_window, plan, workspace, out, s); break;
      case 5: launch_attention<T, 5>(q, q_row_stride, kv, batch, num_heads, scale, sliding_window, plan, workspace, out, s); break;
      case 6: launch_attention<T, 6>(q, q_row_stride, kv, batch, num_heads, scale, sliding_window, plan, workspace, out, s); break;
      case 7: launch_attention<T, 7>(q, q_row_stride, kv, batch, num_heads, scale, sliding_window, plan, workspace, out, s); break;
      default: launch_attention<T, 8>(q, q_row_stride, kv, batch, num_heads, scale, sliding_window, plan, workspace, out, s); break;
    }
    LMKIT_CUDA_LAUNCHED("cuda::paged_attention");
    if (plan.num_splits > 1) {
      const int64_t pairs = (int64_t)batch.num_rows * num_heads;
      merge_splits_kernel<T><<<(unsigned)ceil_div(pairs, 8), 256, 0, s>>>(static_cast<const float*>(workspace), pairs,
                                                                        plan.num_splits, kv.head_dim, static_cast<T*>(out));
      LMKIT_CUDA_LAUNCHED("cuda::paged_attention merge");
    }
  });
}

}  // namespace lmkit::cuda
