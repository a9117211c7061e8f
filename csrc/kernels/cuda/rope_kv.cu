// The fused QKV epilogue of the CUDA backend: bias add, rotary embedding of q and k, and the write of
// k and v into the blocked KV pool (fp16/bf16 rows, or int8/int4 rows quantized per token and head).
// One warp per (token, head); lane l holds the rotary pairs (i, i + head_dim / 2) for i = l, l + 32, ...,
// which are also the two nibbles of one int4 byte.
#include "kernels/cuda/common.cuh"

namespace lmkit::cuda {
namespace {

constexpr int kMaxPairsPerLane = kCudaMaxHeadDim / 2 / 32;  // head_dim <= 256

template <typename T>
__device__ __forceinline__ void store_kv_row(const ops::KVLayer& kv, void* pool, int32_t slot, int kv_head, const float* a,
                             const float* b, int half, int lane) {
  const int64_t block = slot / kv.block_size_tokens, off = slot % kv.block_size_tokens;
  const int64_t row = (int64_t)kv_head * kv.block_size_tokens + off;
  char* base = static_cast<char*>(pool) + block * kv.block_bytes();
  if (kv.bits == 16) {
    T* dst = reinterpret_cast<T*>(base) + row * kv.head_dim;
    for (int p = 0, i = lane; i < half; ++p, i += 32) {
      dst[i] = from_float<T>(a[p]);
      dst[i + half] = from_float<T>(b[p]);
    }
    return;
  }
  float mn = INFINITY, mx = -INFINITY;
  for (int p = 0, i = lane; i < half; ++p, i += 32) mn = fminf(mn, fminf(a[p], b[p])), mx = fmaxf(mx, fmaxf(a[p], b[p]));
  mn = -warp_max(-mn);
  mx = warp_max(mx);
  const float qmax = kv.bits == 8 ? 255.0f : 15.0f;
  const __half s16 = __float2half_rn((mx - mn) / qmax), z16 = __float2half_rn(mn);
  const float s = __half2float(s16), z = __half2float(z16);
  uint8_t* q = reinterpret_cast<uint8_t*>(base) + row * kv.row_bytes();
  for (int p = 0, i = lane; i < half; ++p, i += 32) {
    const float ra = s == 0.0f ? 0.0f : fminf(fmaxf(rintf((a[p] - z) / s), 0.0f), qmax);
    const float rb = s == 0.0f ? 0.0f : fminf(fmaxf(rintf((b[p] - z) / s), 0.0f), qmax);
    if (kv.bits == 8) {
      q[i] = (uint8_t)ra;
      q[i + half] = (uint8_t)rb;
    } else {
      q[i] = (uint8_t)((uint32_t)ra | (uint32_t)rb << 4);
    }
  }
  if (lane == 0) {
    __half* params = reinterpret_cast<__half*>(base + (int64_t)kv.num_kv_heads * kv.block_size_tokens * kv.row_bytes());
    params[2 * row] = s16;
    params[2 * row + 1] = z16;
  }
}

template <typename T>
__global__ void qkv_rope_kv_write_kernel(T* qkv, const T* __restrict__ bias, const int32_t* __restrict__ positions,
                                         const int32_t* __restrict__ slots, int64_t n, int num_heads,
                                         const float* __restrict__ inv_freq, float attention_scaling,
                                         ops::KVLayer kv) {
  const int lane = threadIdx.x & 31;
  const int heads_all = num_heads + 2 * kv.num_kv_heads;
  const int64_t w = (int64_t)blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5);
  if (w >= n * heads_all) return;
  const int64_t t = w / heads_all;
  const int h = (int)(w - t * heads_all);
  const int hd = kv.head_dim, half = hd / 2;
  const bool is_q = h < num_heads, is_k = !is_q && h < num_heads + kv.num_kv_heads;
  const int32_t slot = slots[t];
  if (!is_q && slot < 0) return;
  T* x = qkv + t * (int64_t)heads_all * hd + (int64_t)h * hd;
  const T* bx = bias ? bias + (int64_t)h * hd : nullptr;
  float a[kMaxPairsPerLane], b[kMaxPairsPerLane];
  const float pos = (float)positions[t];
  for (int p = 0, i = lane; i < half; ++p, i += 32) {
    float x1 = to_float(x[i]), x2 = to_float(x[i + half]);
    if (bx) x1 = to_float(from_float<T>(x1 + to_float(bx[i]))), x2 = to_float(from_float<T>(x2 + to_float(bx[i + half])));
    if (is_q || is_k) {
      const float angle = pos * inv_freq[i];
      const float c = cosf(angle) * attention_scaling, s = sinf(angle) * attention_scaling;
      const float r1 = x1 * c - x2 * s, r2 = x2 * c + x1 * s;
      x1 = r1, x2 = r2;
    }
    a[p] = x1, b[p] = x2;
  }
  if (is_q) {
    for (int p = 0, i = lane; i < half; ++p, i += 32) x[i] = from_float<T>(a[p]), x[i + half] = from_float<T>(b[p]);
    return;
  }
  if (kv.bits == 16) {  // the pool holds T: round as the pool will
    for (int p = 0, i = lane; i < half; ++p, i += 32) a[p] = to_float(from_float<T>(a[p])), b[p] = to_float(from_float<T>(b[p]));
  }
  const int kv_head = is_k ? h - num_heads : h - num_heads - kv.num_kv_heads;
  store_kv_row<T>(kv, is_k ? kv.k : kv.v, slot, kv_head, a, b, half, lane);
}

}  // namespace

void qkv_rope_kv_write(void* qkv, const void* qkv_bias, const int32_t* positions, const int32_t* slots, int64_t n,
                       int32_t num_heads, const float* inv_freq, float attention_scaling, const ops::KVLayer& kv,
                       DType act, Stream stream) {
  LMKIT_CHECK_ARG(kv.bits == 16 || kv.bits == 8 || kv.bits == 4, "cuda::qkv_rope_kv_write: KV bits must be 16, 8 or 4, got ",
                  kv.bits);
  LMKIT_CHECK_ARG(kv.head_dim > 0 && kv.head_dim % 2 == 0 && kv.head_dim <= kCudaMaxHeadDim,
                  "cuda::qkv_rope_kv_write: head_dim must be even and at most ", kCudaMaxHeadDim, ", got ",
                  kv.head_dim);
  LMKIT_CHECK_ARG(num_heads > 0 && kv.num_kv_heads > 0 && num_heads % kv.num_kv_heads == 0,
                  "cuda::qkv_rope_kv_write: num_heads ", num_heads, " must be a multiple of num_kv_heads ", kv.num_kv_heads);
  LMKIT_CHECK_ARG(n >= 0, "cuda::qkv_rope_kv_write: n must be >= 0, got ", n);
  if (n == 0) return;
  const int64_t warps = n * (num_heads + 2 * kv.num_kv_heads);
  constexpr int kWarpsPerBlock = 8;
  dispatch_act(act, "cuda::qkv_rope_kv_write", [&](auto t) {
    using T = decltype(t);
    qkv_rope_kv_write_kernel<T><<<(unsigned)ceil_div(warps, kWarpsPerBlock), 32 * kWarpsPerBlock, 0, as_stream(stream)>>>(
        static_cast<T*>(qkv), static_cast<const T*>(qkv_bias), positions, slots, n, num_heads, inv_freq,
        attention_scaling, kv);
  });
  LMKIT_CUDA_LAUNCHED("cuda::qkv_rope_kv_write");
}

}  // namespace lmkit::cuda
