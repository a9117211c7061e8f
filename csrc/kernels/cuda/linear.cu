// Linear layers of the CUDA backend: out[M, N] = x[M, K] @ W[N, K]^T (+ bias).
//
//   int4, M <= int4 rows of   mma_linear_kernel ("skinny"): each warp multiplies 16 weight rows by up to
//   set_skinny_rows (64);     64 x rows on tensor cores (mma.sync m16n8k16, fp32 accumulate) over its
//   dense, M <= dense rows    share of K, the 8 warps of a CTA add their partial sums in shared memory.
//   (8) and K % 32 == 0       Weights stream from device memory once, 16 bytes a load, several in flight;
//                             int4 is dequantized in registers ((q - z) * s, exact up to the product's
//                             rounding); x is read as fragments straight from global memory (L1-resident).
//   int4, larger M            gemv_int4_kernel (M <= kGemvMaxRows) or gemm_kernel: the older paths, kept
//                             for what the skinny kernel is not given (set_skinny_rows(0, 0) forces them).
//   int4 / dense, larger M    gemm_kernel: 64 x 64 output tile per CTA of 4 warps, K in steps of 32; the
//                             weight tile is dequantized (int4) or copied (dense) into shared memory and
//                             multiplied on tensor cores through WMMA (mma.sync m16n16k16, fp32 accumulate).
//   dense, cuBLAS found       cublasGemmEx (cublas.cpp), then the bias.
// Dense weights are [N, K] in the activation dtype; the int4 layout is in ops_cuda.h.
#include <mma.h>

#include <type_traits>
#include <vector>

#include "kernels/cuda/common.cuh"
#include "kernels/cuda/cublas.h"

namespace lmkit::cuda {
namespace {

// ---- int4 GEMV -----------------------------------------------------------------------------------
template <typename T, int M>
__global__ void gemv_int4_kernel(const T* __restrict__ x, const uint32_t* __restrict__ qweight,
                                 const __half* __restrict__ scales, const uint8_t* __restrict__ zeros,
                                 const T* __restrict__ bias, int64_t N, int64_t K, int group_size, T* __restrict__ out) {
  const int lane = threadIdx.x & 31;
  const int64_t n = (int64_t)blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5);
  if (n >= N) return;
  const int64_t num_quads = K / 32;  // 16-byte loads of 32 weights
  const int64_t groups = K / group_size;
  const uint4* wq = reinterpret_cast<const uint4*>(qweight + n * (K / 8));
  float acc[M];
  for (int m = 0; m < M; ++m) acc[m] = 0.0f;
  for (int64_t i = lane; i < num_quads; i += 32) {
    const uint4 w4 = wq[i];
    const uint32_t words[4] = {w4.x, w4.y, w4.z, w4.w};
    const int64_t k0 = i * 32;
    const int64_t g = k0 / group_size;
    const float s = __half2float(scales[n * groups + g]);
    const float z = (float)zeros[n * groups + g];
    for (int m = 0; m < M; ++m) {
      const T* xr = x + m * K + k0;
      float dq = 0.0f, sx = 0.0f;
#pragma unroll
      for (int wi = 0; wi < 4; ++wi) {
#pragma unroll
        for (int j = 0; j < 8; ++j) {
          const float xv = to_float(xr[wi * 8 + j]);
          dq += (float)((words[wi] >> (4 * j)) & 15u) * xv;
          sx += xv;
        }
      }
      acc[m] += s * (dq - z * sx);
    }
  }
  for (int m = 0; m < M; ++m) {
    const float v = warp_sum(acc[m]);
    if (lane == 0) out[m * N + n] = from_float<T>(v + (bias ? to_float(bias[n]) : 0.0f));
  }
}

// ---- skinny tensor-core linear (decode and small batches) --------------------------------------------
// A warp owns 16 weight rows (the A operand of m16n8k16: row g = lane / 4 and g + 8) and x rows in tiles of 8
// (the B operand: column g). K is walked in steps of 128: lane c = lane % 4 takes the 32 consecutive k of chunk
// 4 * step + c, one 16-byte load of int4 (or four of 16-bit) weights per row. A sum over k does not care which
// k meets which slot of the instruction, so a lane's k-slots (2c, 2c+1, 2c+8, 2c+9 of each mma) hold k's of its
// own chunk, and the B fragment of the same lane holds x at the same k's: no shuffles, no shared memory.
// Word j (8 k) of a chunk feeds two mma: pairs (0, 1) then (2, 3) of the word, where an int4 word's pair i is
// (k = i, i + 4) (the nibble pairs a mask takes out together) and a 16-bit word's pair i is (2i, 2i + 1).
constexpr int kMmaWarps = 8;

template <typename T>
__device__ __forceinline__ void mma_16816(float (&d)[4], uint32_t a0, uint32_t a1, uint32_t a2, uint32_t a3,
                                          uint32_t b0, uint32_t b1) {
  if constexpr (std::is_same_v<T, __half>) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
  } else {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
  }
}

__device__ __forceinline__ uint32_t word_of(const uint4& v, int j) {
  return j == 0 ? v.x : j == 1 ? v.y : j == 2 ? v.z : v.w;
}

template <typename T>
struct Pair;  // two values of T in one 32-bit register
template <>
struct Pair<__half> {
  using type = __half2;
};
template <>
struct Pair<__nv_bfloat16> {
  using type = __nv_bfloat162;
};
template <typename T>
__device__ __forceinline__ typename Pair<T>::type as_pair(uint32_t u) {
  return *reinterpret_cast<typename Pair<T>::type*>(&u);
}
template <typename T>
__device__ __forceinline__ uint32_t as_u32(typename Pair<T>::type p) {
  return *reinterpret_cast<uint32_t*>(&p);
}

// The per-(row, group) constants of the int4 dequantization, as pairs, made with integer operations from the
// scale's fp16 bits and the zero: fp16 subtracts 1024 + z (0x6400 | z) from 1024 + q (the exponent trick below)
// and adds -(64 + z) (0xD400 | z << 4) to (1024 + 16 q) / 16; bf16 subtracts 128 + z (0x4300 | z) from 128 + q,
// its scale rounded from fp16 to bf16.
struct Int4Consts {
  uint32_t scale, zero, zero_hi;
};
template <typename T>
__device__ __forceinline__ Int4Consts int4_consts(uint32_t scale_bits, uint32_t z) {
  Int4Consts c;
  if constexpr (std::is_same_v<T, __half>) {
    c.scale = scale_bits * 0x10001u;
    c.zero = (0x6400u | z) * 0x10001u;
    c.zero_hi = (0xD400u | (z << 4)) * 0x10001u;
  } else {
    const __nv_bfloat16 sb = __float2bfloat16_rn(__half2float(__ushort_as_half((unsigned short)scale_bits)));
    c.scale = (uint32_t)__bfloat16_as_ushort(sb) * 0x10001u;
    c.zero = (0x4300u | z) * 0x10001u;
    c.zero_hi = 0;
  }
  return c;
}

// The 8 int4 values of word w as 4 pairs (q_i - z) * s for nibbles (i, i + 4), i = 0..3. fp16: OR-ing a
// nibble into the mantissa of 1024.0 (0x6400) gives 1024 + q exactly, and the nibble one place up gives
// 1024 + 16 q, scaled back by an exact fma; bf16 (7 mantissa bits) takes each nibble down to bit 0 first.
template <typename T>
__device__ __forceinline__ void dequant_int4(uint32_t w, const Int4Consts& c, uint32_t (&out)[4]) {
  using P = typename Pair<T>::type;
  const P s = as_pair<T>(c.scale), z = as_pair<T>(c.zero);
  if constexpr (std::is_same_v<T, __half>) {
    const uint32_t hi = w >> 8;
    const __half2 sixteenth = __float2half2_rn(1.0f / 16.0f), zh = as_pair<T>(c.zero_hi);
    out[0] = as_u32<T>(__hmul2(__hsub2(as_pair<T>((w & 0x000f000fu) | 0x64006400u), z), s));
    out[1] = as_u32<T>(__hmul2(__hfma2(as_pair<T>((w & 0x00f000f0u) | 0x64006400u), sixteenth, zh), s));
    out[2] = as_u32<T>(__hmul2(__hsub2(as_pair<T>((hi & 0x000f000fu) | 0x64006400u), z), s));
    out[3] = as_u32<T>(__hmul2(__hfma2(as_pair<T>((hi & 0x00f000f0u) | 0x64006400u), sixteenth, zh), s));
  } else {
#pragma unroll
    for (int i = 0; i < 4; ++i)
      out[i] = as_u32<T>(__hmul2(__hsub2(as_pair<T>(((w >> (4 * i)) & 0x000f000fu) | 0x43004300u), z), s));
  }
}

// x values k0..k0+7 of one row (a uint4) as the B pairs of word j: int4 pairs (i, i + 4), dense (2i, 2i + 1).
template <bool kInt4>
__device__ __forceinline__ void x_pairs(const uint4& v, uint32_t (&b)[4]) {
  if constexpr (kInt4) {
    b[0] = __byte_perm(v.x, v.z, 0x5410);
    b[1] = __byte_perm(v.x, v.z, 0x7632);
    b[2] = __byte_perm(v.y, v.w, 0x5410);
    b[3] = __byte_perm(v.y, v.w, 0x7632);
  } else {
    b[0] = v.x, b[1] = v.y, b[2] = v.z, b[3] = v.w;
  }
}

// MT tiles of 8 x rows per CTA (blockIdx.y walks M in 8 * MT rows), 16 weight rows per CTA (blockIdx.x).
// kPipe: the next steps' weights are loaded before the current ones are multiplied (two register buffers of
// kSteps steps); without it a warp loads kSteps steps, then multiplies them.
template <typename T, bool kInt4, int MT, bool kPipe>
__global__ void __launch_bounds__(kMmaWarps * 32)
    mma_linear_kernel(const T* __restrict__ x, const void* __restrict__ weight, const uint16_t* __restrict__ scales,
                      const uint8_t* __restrict__ zeros, const T* __restrict__ bias, int64_t M, int64_t N, int64_t K,
                      int group_shift, T* __restrict__ out) {
  constexpr int kSteps = kInt4 ? (kPipe ? 2 : 4) : 1;  // 2-4 KB of weights per warp in flight
  constexpr int kVecs = kInt4 ? 1 : 4;                 // 16-byte loads per row and chunk
  __shared__ float partial[kMmaWarps][MT * 8][17];
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, g = lane >> 2, c = lane & 3;
  const int64_t n0 = (int64_t)blockIdx.x * 16, m0 = (int64_t)blockIdx.y * (8 * MT);
  const int64_t chunks = K / 32, steps = (chunks + 3) / 4, groups = kInt4 ? (chunks >> group_shift) : 0;
  const int64_t step_begin = steps * warp / kMmaWarps, step_end = steps * (warp + 1) / kMmaWarps;
  const uint4* wrow[2];
  const uint16_t* srow[2];
  const uint8_t* zrow[2];
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    const int64_t n = min(n0 + g + 8 * r, N - 1);  // rows past N compute, are not stored
    if constexpr (kInt4) {
      wrow[r] = reinterpret_cast<const uint4*>(static_cast<const uint32_t*>(weight) + n * (K / 8));
      srow[r] = scales + n * groups, zrow[r] = zeros + n * groups;
    } else {
      wrow[r] = reinterpret_cast<const uint4*>(static_cast<const T*>(weight) + n * K);
    }
  }
  const T* xrow[MT];
  bool xok[MT];
#pragma unroll
  for (int t = 0; t < MT; ++t) {
    const int64_t m = m0 + 8 * t + g;
    xok[t] = m < M;
    xrow[t] = x + (xok[t] ? m : 0) * K;
  }
  float acc[MT][4];
#pragma unroll
  for (int t = 0; t < MT; ++t) acc[t][0] = acc[t][1] = acc[t][2] = acc[t][3] = 0.0f;

  // int4: qs = the group's scale bits | zero << 16 (0 past the end: the weights multiply as zeros)
  auto load = [&](int64_t s0, uint4 (&wv)[kSteps][2][kVecs], uint32_t (&qs)[kSteps][2]) {
#pragma unroll
    for (int u = 0; u < kSteps; ++u) {
      const int64_t chunk = (s0 + u) * 4 + c;
      const bool valid = s0 + u < step_end && chunk < chunks;
#pragma unroll
      for (int r = 0; r < 2; ++r) {
#pragma unroll
        for (int v = 0; v < kVecs; ++v)
          wv[u][r][v] = valid ? __ldcs(wrow[r] + chunk * kVecs + v) : make_uint4(0, 0, 0, 0);
        if constexpr (kInt4)
          qs[u][r] = valid ? (uint32_t)srow[r][chunk >> group_shift] | ((uint32_t)zrow[r][chunk >> group_shift] << 16)
                           : 0u;
      }
    }
  };
  auto multiply = [&](int64_t s0, const uint4 (&wv)[kSteps][2][kVecs], const uint32_t (&qs)[kSteps][2]) {
#pragma unroll
    for (int u = 0; u < kSteps; ++u) {
      const int64_t chunk = (s0 + u) * 4 + c;
      const bool valid = s0 + u < step_end && chunk < chunks;
      Int4Consts consts[2];
      if constexpr (kInt4) {
#pragma unroll
        for (int r = 0; r < 2; ++r) consts[r] = int4_consts<T>(qs[u][r] & 0xffffu, qs[u][r] >> 16);
      }
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        uint32_t a[2][4];
#pragma unroll
        for (int r = 0; r < 2; ++r) {
          if constexpr (kInt4) {
            dequant_int4<T>(word_of(wv[u][r][0], j), consts[r], a[r]);
          } else {
            a[r][0] = wv[u][r][j].x, a[r][1] = wv[u][r][j].y, a[r][2] = wv[u][r][j].z, a[r][3] = wv[u][r][j].w;
          }
        }
#pragma unroll
        for (int t = 0; t < MT; ++t) {
          uint4 xv = make_uint4(0, 0, 0, 0);  // x rows past M and chunks past K multiply as zeros
          if (valid && xok[t]) xv = *reinterpret_cast<const uint4*>(xrow[t] + chunk * 32 + 8 * j);
          uint32_t b[4];
          x_pairs<kInt4>(xv, b);
          mma_16816<T>(acc[t], a[0][0], a[1][0], a[0][1], a[1][1], b[0], b[1]);
          mma_16816<T>(acc[t], a[0][2], a[1][2], a[0][3], a[1][3], b[2], b[3]);
        }
      }
    }
  };

  uint4 wv[kSteps][2][kVecs];
  uint32_t qs[kSteps][2];
  if constexpr (kPipe) {
    uint4 wn[kSteps][2][kVecs];
    uint32_t qn[kSteps][2];
    if (step_begin < step_end) load(step_begin, wv, qs);
    for (int64_t s0 = step_begin; s0 < step_end; s0 += kSteps) {
      const bool more = s0 + kSteps < step_end;
      if (more) load(s0 + kSteps, wn, qn);
      multiply(s0, wv, qs);
      if (more) {
#pragma unroll
        for (int u = 0; u < kSteps; ++u)
#pragma unroll
          for (int r = 0; r < 2; ++r) {
            qs[u][r] = qn[u][r];
#pragma unroll
            for (int v = 0; v < kVecs; ++v) wv[u][r][v] = wn[u][r][v];
          }
      }
    }
  } else {
    for (int64_t s0 = step_begin; s0 < step_end; s0 += kSteps) {
      load(s0, wv, qs);
      multiply(s0, wv, qs);
    }
  }
  // acc[t]: (weight row g, x row 2c), (g, 2c + 1), (g + 8, 2c), (g + 8, 2c + 1) of tile t
#pragma unroll
  for (int t = 0; t < MT; ++t) {
    partial[warp][8 * t + 2 * c][g] = acc[t][0];
    partial[warp][8 * t + 2 * c + 1][g] = acc[t][1];
    partial[warp][8 * t + 2 * c][g + 8] = acc[t][2];
    partial[warp][8 * t + 2 * c + 1][g + 8] = acc[t][3];
  }
  __syncthreads();
  for (int e = threadIdx.x; e < MT * 8 * 16; e += kMmaWarps * 32) {
    const int mi = e / 16, r = e % 16;
    const int64_t m = m0 + mi, n = n0 + r;
    if (m >= M || n >= N) continue;
    float sum = bias ? to_float(bias[n]) : 0.0f;
#pragma unroll
    for (int w = 0; w < kMmaWarps; ++w) sum += partial[w][mi][r];
    out[m * N + n] = from_float<T>(sum);
  }
}

bool g_skinny_pipeline = false;

template <typename T, bool kInt4, int MT>
void launch_mma_linear(const void* x, int64_t M, const Linear& w, const void* bias, void* out, cudaStream_t s) {
  const dim3 grid((unsigned)ceil_div(w.n, 16), (unsigned)ceil_div(M, 8 * MT));
  const int group_shift = w.group_size == 128 ? 2 : w.group_size == 64 ? 1 : 0;  // group_size / 32 = 1 << shift
  auto kernel = g_skinny_pipeline ? mma_linear_kernel<T, kInt4, MT, true> : mma_linear_kernel<T, kInt4, MT, false>;
  kernel<<<grid, kMmaWarps * 32, 0, s>>>(static_cast<const T*>(x), w.data.get(),
                                         static_cast<const uint16_t*>(w.scales.get()),
                                         static_cast<const uint8_t*>(w.zeros.get()), static_cast<const T*>(bias), M,
                                         w.n, w.k, group_shift, static_cast<T*>(out));
}

template <typename T, bool kInt4>
void launch_mma_linear(const void* x, int64_t M, const Linear& w, const void* bias, void* out, cudaStream_t s) {
  if (M <= 8)
    launch_mma_linear<T, kInt4, 1>(x, M, w, bias, out, s);
  else if (M <= 16)
    launch_mma_linear<T, kInt4, 2>(x, M, w, bias, out, s);
  else if (M <= 32)
    launch_mma_linear<T, kInt4, 4>(x, M, w, bias, out, s);
  else
    launch_mma_linear<T, kInt4, 8>(x, M, w, bias, out, s);
}

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

template <typename T, int M>
void launch_gemv(const void* x, const Linear& w, const void* bias, void* out, cudaStream_t s) {
  constexpr int kWarps = 8;
  gemv_int4_kernel<T, M><<<(unsigned)ceil_div(w.n, kWarps), 32 * kWarps, 0, s>>>(
      static_cast<const T*>(x), static_cast<const uint32_t*>(w.data.get()), static_cast<const __half*>(w.scales.get()),
      static_cast<const uint8_t*>(w.zeros.get()), static_cast<const T*>(bias), w.n, w.k, w.group_size,
      static_cast<T*>(out));
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

bool g_force_wmma = false;
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
  Linear out;
  out.dtype = act, out.group_size = w.group_size, out.n = w.n, out.k = w.k;
  const int64_t groups = w.k / w.group_size;
  out.data = allocate(w.n * w.k / 2);
  out.scales = allocate(w.n * groups * 2);
  out.zeros = allocate(w.n * groups);
  copy_to_device(out.data.get(), w.qweight.get(), w.n * w.k / 2, stream);
  copy_to_device(out.scales.get(), w.scales.get(), w.n * groups * 2, stream);
  copy_to_device(out.zeros.get(), w.zeros.get(), w.n * groups, stream);
  synchronize(stream);  // the host buffers may go once this returns
  return out;
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
    if (w.is_int4() && M <= g_skinny_int4_rows) {
      launch_mma_linear<T, true>(x, M, w, bias, out, s);
    } else if (!w.is_int4() && M <= g_skinny_dense_rows && w.k % 32 == 0) {
      launch_mma_linear<T, false>(x, M, w, bias, out, s);
    } else if (w.is_int4() && M <= kGemvMaxRows) {
      switch (M) {
        case 1: launch_gemv<T, 1>(x, w, bias, out, s); break;
        case 2: launch_gemv<T, 2>(x, w, bias, out, s); break;
        case 3: launch_gemv<T, 3>(x, w, bias, out, s); break;
        case 4: launch_gemv<T, 4>(x, w, bias, out, s); break;
        case 5: launch_gemv<T, 5>(x, w, bias, out, s); break;
        case 6: launch_gemv<T, 6>(x, w, bias, out, s); break;
        case 7: launch_gemv<T, 7>(x, w, bias, out, s); break;
        default: launch_gemv<T, 8>(x, w, bias, out, s); break;
      }
    } else if (!w.is_int4() && !g_force_wmma && cublas_available()) {
      cublas_gemm(x, w.data.get(), out, M, w.n, w.k, act, stream);
      if (bias) {
        const int64_t total = M * w.n;
        add_bias_kernel<T><<<(unsigned)std::min<int64_t>(ceil_div(total, 256), 65535), 256, 0, s>>>(
            static_cast<T*>(out), static_cast<const T*>(bias), M, w.n);
      }
    } else {
      launch_gemm<T>(x, M, w, bias, out, s);
    }
  });
  LMKIT_CUDA_LAUNCHED("cuda::linear");
}

}  // namespace lmkit::cuda
