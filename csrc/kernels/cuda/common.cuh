// Shared device helpers of the CUDA kernels: error checks, fp16/bf16 <-> fp32, warp and block reductions,
// dispatch on the activation dtype. Included by the .cu files only.
#pragma once
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>
#include <stdint.h>

#include "core/check.h"
#include "kernels/cuda/ops_cuda.h"

namespace lmkit::cuda {

#define LMKIT_CUDA_OK(expr, what)                                                                 \
  do {                                                                                            \
    cudaError_t err_ = (expr);                                                                    \
    if (err_ != cudaSuccess)                                                                      \
      throw ::lmkit::Error(::lmkit::detail::concat("lmkit (CUDA): ", what, ": ", cudaGetErrorString(err_))); \
  } while (0)
// After a kernel launch: configuration errors surface here, faults at the next synchronisation.
#define LMKIT_CUDA_LAUNCHED(what) LMKIT_CUDA_OK(cudaGetLastError(), what)

inline cudaStream_t as_stream(Stream s) { return static_cast<cudaStream_t>(s); }

__device__ __forceinline__ float to_float(float x) { return x; }
__device__ __forceinline__ float to_float(__half x) { return __half2float(x); }
__device__ __forceinline__ float to_float(__nv_bfloat16 x) { return __bfloat162float(x); }
template <typename T>
__device__ __forceinline__ T from_float(float x);
template <>
__device__ __forceinline__ float from_float<float>(float x) { return x; }
template <>
__device__ __forceinline__ __half from_float<__half>(float x) { return __float2half_rn(x); }
template <>
__device__ __forceinline__ __nv_bfloat16 from_float<__nv_bfloat16>(float x) { return __float2bfloat16_rn(x); }

__device__ __forceinline__ float warp_sum(float v) {
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}
__device__ __forceinline__ float warp_max(float v) {
  for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
  return v;
}
// Sum over the block (blockDim.x a multiple of 32, at most 1024); every thread gets the result.
// `scratch`: 32 floats of shared memory, reusable after the call returns.
__device__ __forceinline__ float block_sum(float v, float* scratch) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, num_warps = blockDim.x >> 5;
  v = warp_sum(v);
  __syncthreads();
  if (lane == 0) scratch[warp] = v;
  __syncthreads();
  v = lane < num_warps ? scratch[lane] : 0.0f;
  return warp_sum(v);
}
__device__ __forceinline__ float block_max(float v, float* scratch) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, num_warps = blockDim.x >> 5;
  v = warp_max(v);
  __syncthreads();
  if (lane == 0) scratch[warp] = v;
  __syncthreads();
  v = lane < num_warps ? scratch[lane] : -INFINITY;
  return warp_max(v);
}

// Frees the int4 dequantization scratch of a stream (linear.cu); destroy_stream calls it.
void release_dequant_scratch(Stream stream);

inline int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

inline void check_act(DType act, const char* op) {
  LMKIT_CHECK_ARG(act == DType::F16 || act == DType::BF16, op, ": activations must be F16 or BF16, got ",
                  dtype_name(act));
}

// Calls f(T{}) with T the device type of `dtype` (F32 -> float, F16 -> __half, BF16 -> __nv_bfloat16).
template <typename F>
void dispatch_float(DType dtype, const char* op, F&& f) {
  switch (dtype) {
    case DType::F32: f(float{}); return;
    case DType::F16: f(__half{}); return;
    case DType::BF16: f(__nv_bfloat16{}); return;
    default: LMKIT_CHECK_ARG(false, op, ": expected an F32, F16 or BF16 tensor, got ", dtype_name(dtype));
  }
}
template <typename F>
void dispatch_act(DType act, const char* op, F&& f) {
  check_act(act, op);
  if (act == DType::F16)
    f(__half{});
  else
    f(__nv_bfloat16{});
}

}  // namespace lmkit::cuda
