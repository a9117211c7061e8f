// Row-wise ops of the CUDA backend: embedding, RMSNorm (plain and fused with the residual add),
// SiLU-and-mul, row gather. One block per row; fp32 arithmetic, one rounding to the output dtype.
#include "kernels/cuda/common.cuh"

namespace lmkit::cuda {
namespace {

constexpr int kRowThreads = 256;

template <typename W, typename T>
__global__ void embedding_kernel(const W* __restrict__ table, const int32_t* __restrict__ ids, int64_t vocab,
                                 int64_t hidden, T* __restrict__ out) {
  const int64_t t = blockIdx.x;
  const int64_t id = ids[t];
  T* o = out + t * hidden;
  if (id < 0 || id >= vocab) {  // checked on the host for host ids; here a NaN row makes it visible
    for (int64_t j = threadIdx.x; j < hidden; j += blockDim.x) o[j] = from_float<T>(NAN);
    return;
  }
  const W* row = table + id * hidden;
  for (int64_t j = threadIdx.x; j < hidden; j += blockDim.x) o[j] = from_float<T>(to_float(row[j]));
}

// residual == nullptr: plain RMSNorm of x. Otherwise residual[r] += x[r] first and the norm is of that sum
// (as stored, i.e. rounded to T, so that the next layer's residual and this norm agree).
template <typename T, typename W>
__global__ void rmsnorm_kernel(T* residual, const T* x, const W* __restrict__ weight, float eps, int64_t dim,
                               T* out) {
  __shared__ float scratch[32];
  const int64_t r = blockIdx.x;
  const T* xr = x + r * dim;
  T* rr = residual ? residual + r * dim : nullptr;
  float ss = 0.0f;
  for (int64_t j = threadIdx.x; j < dim; j += blockDim.x) {
    float v = to_float(xr[j]);
    if (rr) {
      const T sum = from_float<T>(to_float(rr[j]) + v);
      rr[j] = sum;
      v = to_float(sum);
    }
    ss += v * v;
  }
  ss = block_sum(ss, scratch);
  const float inv = rsqrtf(ss / (float)dim + eps);
  const T* src = rr ? rr : xr;
  T* o = out + r * dim;
  for (int64_t j = threadIdx.x; j < dim; j += blockDim.x)
    o[j] = from_float<T>(to_float(src[j]) * inv * to_float(weight[j]));
}

template <typename T>
__global__ void silu_mul_kernel(const T* __restrict__ gate_up, int64_t n, int64_t inter, T* __restrict__ out) {
  const int64_t total = n * inter;
  for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < total; i += (int64_t)gridDim.x * blockDim.x) {
    const int64_t t = i / inter, j = i - t * inter;
    const float g = to_float(gate_up[t * 2 * inter + j]), u = to_float(gate_up[t * 2 * inter + inter + j]);
    out[i] = from_float<T>(g / (1.0f + __expf(-g)) * u);
  }
}

template <typename T>
__global__ void gather_rows_kernel(const T* __restrict__ x, const int32_t* __restrict__ rows, int64_t dim,
                                   T* __restrict__ out) {
  const int64_t i = blockIdx.x;
  const T* src = x + (int64_t)rows[i] * dim;
  for (int64_t j = threadIdx.x; j < dim; j += blockDim.x) out[i * dim + j] = src[j];
}

int grid_for(int64_t total, int threads) {
  const int64_t blocks = ceil_div(total, threads);
  return (int)(blocks < 65535 * 8 ? blocks : 65535 * 8);
}

}  // namespace

void embedding(const void* table, DType table_dtype, int64_t vocab, const int32_t* ids, int64_t n,
               int64_t hidden, void* out, DType act, Stream stream) {
  LMKIT_CHECK_ARG(n >= 0 && hidden > 0 && vocab > 0, "cuda::embedding: bad shape n=", n, " hidden=", hidden);
  if (n == 0) return;
  dispatch_act(act, "cuda::embedding", [&](auto t) {
    using T = decltype(t);
    dispatch_float(table_dtype, "cuda::embedding table", [&](auto w) {
      using W = decltype(w);
      embedding_kernel<W, T><<<(unsigned)n, kRowThreads, 0, as_stream(stream)>>>(
          static_cast<const W*>(table), ids, vocab, hidden, static_cast<T*>(out));
    });
  });
  LMKIT_CUDA_LAUNCHED("cuda::embedding");
}

void rmsnorm(const void* x, const void* weight, DType weight_dtype, float eps, int64_t rows, int64_t dim, void* out,
             DType act, Stream stream) {
  LMKIT_CHECK_ARG(rows >= 0 && dim > 0, "cuda::rmsnorm: bad shape rows=", rows, " dim=", dim);
  if (rows == 0) return;
  dispatch_act(act, "cuda::rmsnorm", [&](auto t) {
    using T = decltype(t);
    dispatch_float(weight_dtype, "cuda::rmsnorm weight", [&](auto w) {
      using W = decltype(w);
      rmsnorm_kernel<T, W><<<(unsigned)rows, kRowThreads, 0, as_stream(stream)>>>(
          nullptr, static_cast<const T*>(x), static_cast<const W*>(weight), eps, dim, static_cast<T*>(out));
    });
  });
  LMKIT_CUDA_LAUNCHED("cuda::rmsnorm");
}

void add_rmsnorm(void* residual, const void* x, const void* weight, DType weight_dtype, float eps, int64_t rows,
                 int64_t dim, void* out, DType act, Stream stream) {
  LMKIT_CHECK_ARG(rows >= 0 && dim > 0, "cuda::add_rmsnorm: bad shape rows=", rows, " dim=", dim);
  if (rows == 0) return;
  dispatch_act(act, "cuda::add_rmsnorm", [&](auto t) {
    using T = decltype(t);
    dispatch_float(weight_dtype, "cuda::add_rmsnorm weight", [&](auto w) {
      using W = decltype(w);
      rmsnorm_kernel<T, W><<<(unsigned)rows, kRowThreads, 0, as_stream(stream)>>>(
          static_cast<T*>(residual), static_cast<const T*>(x), static_cast<const W*>(weight), eps, dim,
          static_cast<T*>(out));
    });
  });
  LMKIT_CUDA_LAUNCHED("cuda::add_rmsnorm");
}

void silu_mul(const void* gate_up, int64_t n, int64_t inter, void* out, DType act, Stream stream) {
  LMKIT_CHECK_ARG(n >= 0 && inter > 0, "cuda::silu_mul: bad shape n=", n, " inter=", inter);
  if (n == 0) return;
  dispatch_act(act, "cuda::silu_mul", [&](auto t) {
    using T = decltype(t);
    silu_mul_kernel<T><<<grid_for(n * inter, 256), 256, 0, as_stream(stream)>>>(static_cast<const T*>(gate_up), n,
                                                                                 inter, static_cast<T*>(out));
  });
  LMKIT_CUDA_LAUNCHED("cuda::silu_mul");
}

void gather_rows(const void* x, const int32_t* rows, int64_t num_rows, int64_t dim, void* out, DType act,
                 Stream stream) {
  LMKIT_CHECK_ARG(num_rows >= 0 && dim > 0, "cuda::gather_rows: bad shape rows=", num_rows, " dim=", dim);
  if (num_rows == 0) return;
  dispatch_act(act, "cuda::gather_rows", [&](auto t) {
    using T = decltype(t);
    gather_rows_kernel<T><<<(unsigned)num_rows, kRowThreads, 0, as_stream(stream)>>>(static_cast<const T*>(x), rows,
                                                                                     dim, static_cast<T*>(out));
  });
  LMKIT_CUDA_LAUNCHED("cuda::gather_rows");
}

}  // namespace lmkit::cuda
