// Linear layers of the CUDA backend: out[M, N] = x[M, K] @ W[N, K]^T (+ bias).
//
//   int4 up to 64 rows, dense   the skinny tensor-core kernel (linear_skinny.cuh; set_skinny_rows): weights
//   up to 8 with K % 32 == 0    streamed once, int4 dequantized in registers, mma.sync with fp32 sums.
//   int4, larger M, cuBLAS      the weight dequantized to the activation dtype, a block of rows at a time, into
//   found                       a per-stream scratch of kDequantScratchBytes, then cublasGemmEx into those
//                               columns of out (dequantize-then-GEMM: one extra pass over the weight, paid
//                               back from a few dozen rows on), then the bias.
//   dense, cuBLAS found         cublasGemmEx (cublas.cpp), then the bias.
//   otherwise                   gemm_kernel: 64 x 64 output tile per CTA of 4 warps, K in steps of 32; the
//                               weight tile is dequantized (int4) or copied (dense) into shared memory and
//                               multiplied on tensor cores through WMMA (mma.sync m16n16k16, fp32 accumulate).
// Dense weights are [N, K] in the activation dtype; the int4 layout is in ops_cuda.h.
#include <mma.h>

#include <mutex>
#include <unordered_map>
#include <vector>

#include "kernels/cuda/common.cuh"
#include "kernels/cuda/cublas.h"
#include "kernels/cuda/linear_skinny.cuh"

namespace lmkit::cuda {
namespace {

// ---- tensor-core GEMM (WMMA) ----------------------------------------------------------------------
constexpr int kBM = 64, kBN = 64, kBK = 32, kPad = 8, kGemmThreads = 128;

// Rows [r0, r0 + 64) x columns [k0, k0 + 32) of a row-major [rows, K] matrix into tile[64][kBK + kPad],
// zero past the edges. K % 8 == 0, so a chunk of 8 is either wholly inside or wholly outside.
template <typename T>
__device__ __forceinline__ void load_tile(const T* __restrict__ a, int64_t rows, int64_t K, int64_t r0, int64_t k0,
                                          T (*tile)[kBK + kPad]) {
  for (int c = threadIdx.x; c < kBM * kBK / 8; c += kGemmThreads) {
    const int r = c / (kBK / 8), kc = (c % (kBK / 8)) * 8;
    uint4 v = make_uint4(0, 0, 0, 0);
    if (r0 + r < rows && k0 + kc < K) v = *reinterpret_cast<const uint4*>(a + (r0 + r) * K + k0 + kc);
    *reinterpret_cast<uint4*>(&tile[r][kc]) = v;
  }
}

// Columns [n0, n0 + 64) x k in [k0, k0 + 32) of an int4 weight, dequantized into tile[n][k]: two threads
// per weight row, 16 values (two words) each; the 32 values lie in one group (group_size >= 32).
template <typename T>
__device__ __forceinline__ void load_tile_int4(const uint32_t* __restrict__ qweight, const __half* __restrict__ scales,
                                               const uint8_t* __restrict__ zeros, int64_t N, int64_t K, int group_size,
                                               int64_t n0, int64_t k0, T (*tile)[kBK + kPad]) {
  const int r = threadIdx.x >> 1, part = threadIdx.x & 1;
  const int64_t n = n0 + r;
  T* dst = &tile[r][part * 16];
  if (n >= N || k0 >= K) {
    for (int j = 0; j < 16; ++j) dst[j] = from_float<T>(0.0f);
    return;
  }
  const int64_t groups = K / group_size, g = k0 / group_size;
  const float s = __half2float(scales[n * groups + g]), z = (float)zeros[n * groups + g];
  const uint2 w = *reinterpret_cast<const uint2*>(qweight + n * (K / 8) + k0 / 8 + part * 2);
  for (int j = 0; j < 8; ++j) dst[j] = from_float<T>(((float)((w.x >> (4 * j)) & 15u) - z) * s);
  for (int j = 0; j < 8; ++j) dst[8 + j] = from_float<T>(((float)((w.y >> (4 * j)) & 15u) - z) * s);
}

template <typename T, bool kInt4>
__global__ void __launch_bounds__(kGemmThreads) gemm_kernel(const T* __restrict__ x, const T* __restrict__ w_dense,
                                                             const uint32_t* __restrict__ qweight,
                                                             const __half* __restrict__ scales,
                                                             const uint8_t* __restrict__ zeros, const T* __restrict__ bias,
                                                             int64_t M, int64_t N, int64_t K, int group_size,
                                                             T* __restrict__ out) {
  using namespace nvcuda;
  __shared__ __align__(32) T as[kBM][kBK + kPad];
  __shared__ __align__(32) T bs[kBN][kBK + kPad];
  __shared__ __align__(32) float cs[kBM][kBN + 4];
  const int warp = threadIdx.x >> 5;
  const int wm = (warp >> 1) * 32, wn = (warp & 1) * 32;  // this warp's 32 x 32 quarter of the tile
  const int64_t m0 = (int64_t)blockIdx.y * kBM, n0 = (int64_t)blockIdx.x * kBN;
  wmma::fragment<wmma::accumulator, 16, 16, 16, float> acc[2][2];
  for (int i = 0; i < 2; ++i)
    for (int j = 0; j < 2; ++j) wmma::fill_fragment(acc[i][j], 0.0f);
  for (int64_t k0 = 0; k0 < K; k0 += kBK) {
    load_tile<T>(x, M, K, m0, k0, as);
    if constexpr (kInt4)
      load_tile_int4<T>(qweight, scales, zeros, N, K, group_size, n0, k0, bs);
    else
      load_tile<T>(w_dense, N, K, n0, k0, bs);
    __syncthreads();
#pragma unroll
    for (int kk = 0; kk < kBK; kk += 16) {
      wmma::fragment<wmma::matrix_a, 16, 16, 16, T, wmma::row_major> fa[2];
      wmma::fragment<wmma::matrix_b, 16, 16, 16, T, wmma::col_major> fb[2];
      for (int i = 0; i < 2; ++i) wmma::load_matrix_sync(fa[i], &as[wm + 16 * i][kk], kBK + kPad);
      for (int j = 0; j < 2; ++j) wmma::load_matrix_sync(fb[j], &bs[wn + 16 * j][kk], kBK + kPad);
      for (int i = 0; i < 2; ++i)
        for (int j = 0; j < 2; ++j) wmma::mma_sync(acc[i][j], fa[i], fb[j], acc[i][j]);
    }
    __syncthreads();
  }
  for (int i = 0; i < 2; ++i)
    for (int j = 0; j < 2; ++j)
      wmma::store_matrix_sync(&cs[wm + 16 * i][wn + 16 * j], acc[i][j], kBN + 4, wmma::mem_row_major);
  __syncthreads();
  for (int e = threadIdx.x; e < kBM * kBN; e += kGemmThreads) {
    const int r = e / kBN, c = e % kBN;
    const int64_t m = m0 + r, n = n0 + c;
    if (m < M && n < N) out[m * N + n] = from_float<T>(cs[r][c] + (bias ? to_float(bias[n]) : 0.0f));
  }
}

template <typename T>
__global__ void add_bias_kernel(T* out, const T* __restrict__ bias, int64_t M, int64_t N) {
  for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < M * N; i += (int64_t)gridDim.x * blockDim.x)
    out[i] = from_float<T>(to_float(out[i]) + to_float(bias[i % N]));
}

template <typename T>
void add_bias(void* out, const void* bias, int64_t M, int64_t N, cudaStream_t s) {
  if (!bias) return;
  add_bias_kernel<T><<<(unsigned)std::min<int64_t>(ceil_div(M * N, 256), 65535), 256, 0, s>>>(
      static_cast<T*>(out), static_cast<const T*>(bias), M, N);
}

template <typename T>
void launch_gemm(const void* x, int64_t M, const Linear& w, const void* bias, void* out, cudaStream_t s) {
  const dim3 grid((unsigned)ceil_div(w.n, kBN), (unsigned)ceil_div(M, kBM));
  const T* xt = static_cast<const T*>(x);
  const T* bt = static_cast<const T*>(bias);
  T* ot = static_cast<T*>(out);
  if (w.is_int4())
    gemm_kernel<T, true><<<grid, kGemmThreads, 0, s>>>(xt, nullptr, static_cast<const uint32_t*>(w.data.get()),
                                                       static_cast<const __half*>(w.scales.get()),
                                                       static_cast<const uint8_t*>(w.zeros.get()), bt, M, w.n, w.k,
                                                       w.group_size, ot);
  else
    gemm_kernel<T, false><<<grid, kGemmThreads, 0, s>>>(xt, static_cast<const T*>(w.data.get()), nullptr, nullptr,
                                                        nullptr, bt, M, w.n, w.k, 0, ot);
}

// ---- int4: dequantize, then cuBLAS ----------------------------------------------------------------
constexpr int64_t kDequantScratchBytes = 64 << 20;

template <typename T>
__device__ __forceinline__ uint32_t pack2(float a, float b);
template <>
__device__ __forceinline__ uint32_t pack2<__half>(float a, float b) {
  const __half2 h = __floats2half2_rn(a, b);
  return *reinterpret_cast<const uint32_t*>(&h);
}
template <>
__device__ __forceinline__ uint32_t pack2<__nv_bfloat16>(float a, float b) {
  const __nv_bfloat162 h = __floats2bfloat162_rn(a, b);
  return *reinterpret_cast<const uint32_t*>(&h);
}

// Rows [n0, n0 + rows) of an int4 weight as T [rows, K]: a thread per 32-bit word (8 consecutive k, in one group
// since group_size >= 32), w = (q - zero) * scale in fp32 rounded once to T, as the WMMA tile. A warp reads 128
// contiguous bytes of words and writes 512 contiguous bytes of T (one 16-byte store a thread); the scale and
// zero of a group are the same address for the warp's threads. 32-bit indices: the scratch bounds rows * K / 8
// (kDequantScratchBytes / 16 words). The first version, a thread per 32 k with four stores 64 bytes apart across
// the warp, ran at ~1.8 TB/s of the H200's 4.2 (2026-12-04).
template <typename T>
__global__ void dequant_int4_kernel(const uint32_t* __restrict__ qwords, const uint16_t* __restrict__ scales,
                                    const uint8_t* __restrict__ zeros, int64_t n0, uint32_t rows, uint32_t K,
                                    int group_shift, T* __restrict__ out) {
  const uint32_t words = K / 8, groups = (K / 32) >> group_shift, total = rows * words;
  const uint32_t* q = qwords + n0 * words;
  const uint16_t* sc = scales + n0 * groups;
  const uint8_t* zr = zeros + n0 * groups;
  uint4* dst = reinterpret_cast<uint4*>(out);  // word i of the rows block -> its 8 values, 16 bytes
  for (uint32_t i = blockIdx.x * blockDim.x + threadIdx.x; i < total; i += gridDim.x * blockDim.x) {
    const uint32_t r = i / words, kw = i - r * words;
    const uint32_t w = __ldcs(q + i);
    const uint32_t gi = r * groups + (kw >> (2 + group_shift));  // 4 words a 32-k chunk
    const float s = __half2float(__ushort_as_half(sc[gi])), z = (float)zr[gi];
    auto v = [&](int j) { return ((float)((w >> (4 * j)) & 15u) - z) * s; };
    dst[i] = make_uint4(pack2<T>(v(0), v(1)), pack2<T>(v(2), v(3)), pack2<T>(v(4), v(5)), pack2<T>(v(6), v(7)));
  }
}

bool capturing(cudaStream_t s) {
  cudaStreamCaptureStatus status = cudaStreamCaptureStatusNone;
  LMKIT_CUDA_OK(cudaStreamIsCapturing(s, &status), "cudaStreamIsCapturing");
  return status != cudaStreamCaptureStatusNone;
}

// The scratch of each stream (made at upload_int4 for the uploading stream, so that the KV pool sized after
// the weights leaves room for it, else at the first use outside a graph capture); freed by destroy_stream.
// nullptr: none yet and the stream is capturing (no allocation there).
std::mutex g_scratch_mutex;
std::unordered_map<cudaStream_t, std::shared_ptr<void>> g_scratch;

void* dequant_scratch(cudaStream_t s) {
  std::lock_guard<std::mutex> lock(g_scratch_mutex);
  auto it = g_scratch.find(s);
  if (it != g_scratch.end()) return it->second.get();
  if (capturing(s)) return nullptr;
  return (g_scratch[s] = allocate(kDequantScratchBytes)).get();
}

// out[:, n0 : n0 + rows] for blocks of rows that fit the scratch, each dequantized then multiplied by cuBLAS.
template <typename T>
void launch_dequant_gemm(const void* x, int64_t M, const Linear& w, void* out, void* scratch, DType act,
                         cudaStream_t s) {
  const int group_shift = group_shift_of(w);
  const int64_t max_rows = std::max<int64_t>(16, kDequantScratchBytes / (w.k * 2) / 16 * 16);
  const int64_t blocks = ceil_div(w.n, max_rows), rows_per = ceil_div(ceil_div(w.n, blocks), 16) * 16;
  for (int64_t n0 = 0; n0 < w.n; n0 += rows_per) {
    const int64_t rows = std::min(rows_per, w.n - n0), total = rows * (w.k / 8);
    dequant_int4_kernel<T><<<(unsigned)std::min<int64_t>(ceil_div(total, 256), 1 << 20), 256, 0, s>>>(
        static_cast<const uint32_t*>(w.data.get()), static_cast<const uint16_t*>(w.scales.get()),
        static_cast<const uint8_t*>(w.zeros.get()), n0, (uint32_t)rows, (uint32_t)w.k, group_shift,
        static_cast<T*>(scratch));
    LMKIT_CUDA_LAUNCHED("cuda::linear (int4 dequantization)");
    cublas_gemm(x, scratch, static_cast<T*>(out) + n0, M, rows, w.k, act, s, w.n);
  }
}

bool g_force_wmma = false;
bool g_skinny_pipeline = false;
int64_t g_skinny_int4_rows = kSkinnyInt4Rows, g_skinny_dense_rows = kSkinnyDenseRows;

}  // namespace

void set_skinny_rows(int64_t int4_rows, int64_t dense_rows) {
  LMKIT_CHECK_ARG(int4_rows >= 0 && dense_rows >= 0, "skinny rows must be >= 0, got ", int4_rows, " and ", dense_rows);
  g_skinny_int4_rows = int4_rows, g_skinny_dense_rows = dense_rows;
}
std::pair<int64_t, int64_t> skinny_rows() { return {g_skinny_int4_rows, g_skinny_dense_rows}; }
void set_skinny_pipeline(bool on) { g_skinny_pipeline = on; }
bool skinny_pipeline() { return g_skinny_pipeline; }

void set_dense_gemm_backend(const std::string& name) {
  LMKIT_CHECK_ARG(name == "cublas" || name == "wmma", "dense GEMM backend must be 'cublas' or 'wmma', got '", name, "'");
  g_force_wmma = name == "wmma";
}

const char* dense_gemm_backend() { return !g_force_wmma && cublas_available() ? "cublas" : "wmma"; }

Linear upload_int4(const HostInt4& w, DType act, Stream stream) {
  check_act(act, "cuda::upload_int4");
  // the kernels' group index (linear_skinny.cuh's shift, the WMMA tile's 32 values in one group) assumes these;
  // checked here, where every int4 Linear is made, and not at each call
  LMKIT_CHECK_ARG(w.group_size == 32 || w.group_size == 64 || w.group_size == 128,
                  "cuda::upload_int4: int4 group size must be 32, 64 or 128, got ", w.group_size);
  Linear out;
  out.dtype = act, out.group_size = w.group_size, out.n = w.n, out.k = w.k;
  const int64_t groups = w.k / w.group_size;
  out.data = allocate(w.n * w.k / 2);
  out.scales = allocate(w.n * groups * 2);
  out.zeros = allocate(w.n * groups);
  copy_to_device(out.data.get(), w.qweight.get(), w.n * w.k / 2, stream);
  copy_to_device(out.scales.get(), w.scales.get(), w.n * groups * 2, stream);
  copy_to_device(out.zeros.get(), w.zeros.get(), w.n * groups, stream);
  if (!g_force_wmma && cublas_available()) dequant_scratch(as_stream(stream));  // see g_scratch
  synchronize(stream);  // the host buffers may go once this returns
  return out;
}

void release_dequant_scratch(Stream stream) {
  std::lock_guard<std::mutex> lock(g_scratch_mutex);
  g_scratch.erase(as_stream(stream));
}

Linear upload_dense(const Tensor& weight, DType act, Stream stream) {
  check_act(act, "cuda::upload_dense");
  LMKIT_CHECK_ARG(weight.ndim == 2, "cuda::upload_dense: the weight must be 2-d, got ", weight.ndim, " dims");
  LMKIT_CHECK_ARG(weight.dtype == DType::F32 || weight.dtype == DType::F16 || weight.dtype == DType::BF16,
                  "cuda::upload_dense: the weight must be F32, F16 or BF16, got ", dtype_name(weight.dtype));
  Linear out;
  out.dtype = act, out.n = weight.shape[0], out.k = weight.shape[1];
  const int64_t count = out.n * out.k;
  out.data = allocate(count * 2);
  if (weight.dtype == act) {
    copy_to_device(out.data.get(), weight.data, count * 2, stream);
  } else {
    std::vector<uint16_t> converted((size_t)count);
    for (int64_t i = 0; i < count; ++i) {
      const float v = float_value(weight, i);
      converted[(size_t)i] = act == DType::F16 ? f32_to_f16(v) : f32_to_bf16(v);
    }
    copy_to_device(out.data.get(), converted.data(), count * 2, stream);
  }
  synchronize(stream);
  return out;
}

void linear(const void* x, int64_t M, const Linear& w, const void* bias, void* out, DType act, Stream stream) {
  const char* op = "cuda::linear";
  check_act(act, op);
  LMKIT_CHECK_ARG(act == w.dtype, op, ": the weight was uploaded for ", dtype_name(w.dtype), " activations, got ",
                  dtype_name(act));
  LMKIT_CHECK_ARG(M >= 0 && w.n > 0 && w.k > 0 && w.k % 8 == 0, op, ": bad shape M=", M, " N=", w.n, " K=", w.k,
                  " (K must be a multiple of 8)");
  LMKIT_CHECK_ARG(!w.is_int4() || w.k % 32 == 0, op, ": int4 weights need K % 32 == 0, got K=", w.k);
  LMKIT_CHECK_ARG(reinterpret_cast<uintptr_t>(x) % 16 == 0, op, ": x must be 16-byte aligned (vector loads)");
  if (M == 0) return;
  cudaStream_t s = as_stream(stream);
  dispatch_act(act, op, [&](auto t) {
    using T = decltype(t);
    void* scratch = nullptr;
    if (w.is_int4() && M <= g_skinny_int4_rows) {
      launch_mma_linear<T, true>(x, M, w, bias, out, g_skinny_pipeline, s);
    } else if (w.is_int4() && !g_force_wmma && cublas_available() &&
               (scratch = dequant_scratch(s)) != nullptr) {
      launch_dequant_gemm<T>(x, M, w, out, scratch, act, s);
      add_bias<T>(out, bias, M, w.n, s);
    } else if (!w.is_int4() && M <= g_skinny_dense_rows && w.k % 32 == 0) {
      launch_mma_linear<T, false>(x, M, w, bias, out, g_skinny_pipeline, s);
    } else if (!w.is_int4() && !g_force_wmma && cublas_available()) {
      cublas_gemm(x, w.data.get(), out, M, w.n, w.k, act, stream);
      add_bias<T>(out, bias, M, w.n, s);
    } else {
      launch_gemm<T>(x, M, w, bias, out, s);
    }
  });
  LMKIT_CUDA_LAUNCHED("cuda::linear");
}

}  // namespace lmkit::cuda
