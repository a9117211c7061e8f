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

// The same for rows of dim % 8 == 0 up to kRowThreads * 8 * kNormVecs with 16-byte aligned rows: each thread
// loads all its 16-byte vectors (x and residual) before the first use and keeps the sums in registers for the
// scaling. The loop above waits on each load in turn: one row of 4096 took 8.4 us at batch 1 (H200, ncu).
constexpr int kNormVecs = 4;

template <typename T, typename W>
__global__ void __launch_bounds__(kRowThreads) rmsnorm_vec_kernel(T* residual, const T* x, const W* __restrict__ weight,
                                                                  float eps, int64_t dim, T* out) {
  __shared__ float scratch[32];
  const int64_t r = blockIdx.x;
  const int vecs = (int)(dim / 8);
  const uint4* xr = reinterpret_cast<const uint4*>(x + r * dim);
  uint4* rr = residual ? reinterpret_cast<uint4*>(residual + r * dim) : nullptr;
  uint4 v[kNormVecs], res[kNormVecs];
#pragma unroll
  for (int i = 0; i < kNormVecs; ++i) {
    const int j = threadIdx.x + i * kRowThreads;
    v[i] = res[i] = make_uint4(0, 0, 0, 0);
    if (j < vecs) {
      v[i] = xr[j];
      if (rr) res[i] = rr[j];
    }
  }
  float ss = 0.0f;
#pragma unroll
  for (int i = 0; i < kNormVecs; ++i) {
    const int j = threadIdx.x + i * kRowThreads;
    T* e = reinterpret_cast<T*>(&v[i]);
    const T* q = reinterpret_cast<const T*>(&res[i]);
#pragma unroll
    for (int k = 0; k < 8; ++k) {
      float a = to_float(e[k]);
      if (rr) {
        e[k] = from_float<T>(to_float(q[k]) + a);  // the sum as stored, as the loop above
        a = to_float(e[k]);
      }
      ss += a * a;
    }
    if (rr && j < vecs) rr[j] = v[i];
  }
  ss = block_sum(ss, scratch);
  const float inv = rsqrtf(ss / (float)dim + eps);
  uint4* o = reinterpret_cast<uint4*>(out + r * dim);
#pragma unroll
  for (int i = 0; i < kNormVecs; ++i) {
    const int j = threadIdx.x + i * kRowThreads;
    if (j >= vecs) continue;
    T* e = reinterpret_cast<T*>(&v[i]);
#pragma unroll
    for (int k = 0; k < 8; ++k) e[k] = from_float<T>(to_float(e[k]) * inv * to_float(weight[8 * j + k]));
    o[j] = v[i];
  }
}

template <typename T, typename W>
void launch_rmsnorm(T* residual, const T* x, const W* weight, float eps, int64_t rows, int64_t dim, T* out,
                    cudaStream_t s) {
  auto aligned = [](const void* p) { return reinterpret_cast<uintptr_t>(p) % 16 == 0; };
  if (dim % 8 == 0 && dim <= kRowThreads * 8 * kNormVecs && aligned(x) && aligned(out) && aligned(residual))
    rmsnorm_vec_kernel<T, W><<<(unsigned)rows, kRowThreads, 0, s>>>(residual, x, weight, eps, dim, out);
  else
    rmsnorm_kernel<T, W><<<(unsigned)rows, kRowThreads, 0, s>>>(residual, x, weight, eps, dim, out);
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
      launch_rmsnorm<T, W>(nullptr, static_cast<const T*>(x), static_cast<const W*>(weight), eps, rows, dim,
                           static_cast<T*>(out), as_stream(stream));
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
      launch_rmsnorm<T, W>(static_cast<T*>(residual), static_cast<const T*>(x), static_cast<const W*>(weight), eps,
                           rows, dim, static_cast<T*>(out), as_stream(stream));
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
