// The skinny tensor-core linear of the CUDA backend (decode and small batches): out[M, N] = x[M, K] @ W[N, K]^T
// (+ bias) for int4 weights (ops_cuda.h's layout) up to 64 rows of x and dense fp16/bf16 weights up to 8,
// weights streamed from device memory once. Included by linear.cu only.
//
// A warp owns 16 weight rows (the A operand of m16n8k16: row g = lane / 4 and g + 8) and x rows in tiles of 8
// (the B operand: column g). K is walked in steps of 128: lane c = lane % 4 takes the 32 consecutive k of chunk
// 4 * step + c, one 16-byte load of int4 (or four of 16-bit) weights per row. A sum over k does not care which
// k meets which slot of the instruction, so a lane's k-slots (2c, 2c+1, 2c+8, 2c+9 of each mma) hold k's of its
// own chunk, and the B fragment of the same lane holds x at the same k's: no shuffles, no shared memory.
// Word j (8 k) of a chunk feeds two mma: pairs (0, 1) then (2, 3) of the word, where an int4 word's pair i is
// (k = i, i + 4) (the nibble pairs a mask takes out together) and a 16-bit word's pair i is (2i, 2i + 1).
#pragma once
#include <type_traits>

#include "kernels/cuda/common.cuh"

namespace lmkit::cuda {
namespace {

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
// its scale rounded from fp16 to bf16. bf16 thus rounds twice (the scale, then (q - z) * s), where the WMMA
// GEMM rounds the fp32 product once: within the bf16 bound of the tests, but results move a little when M
// crosses the skinny rows. Widening to fp32 for the product would cost ~4 instructions per pair.
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

// An int4 weight's group size (32, 64 or 128: upload_int4 checks) as a shift: group_size / 32 = 1 << shift.
inline int group_shift_of(const Linear& w) { return w.group_size == 128 ? 2 : w.group_size == 64 ? 1 : 0; }

template <typename T, bool kInt4, int MT>
void launch_mma_linear(const void* x, int64_t M, const Linear& w, const void* bias, void* out, bool pipeline,
                       cudaStream_t s) {
  const dim3 grid((unsigned)ceil_div(w.n, 16), (unsigned)ceil_div(M, 8 * MT));
  const int group_shift = group_shift_of(w);
  auto kernel = pipeline ? mma_linear_kernel<T, kInt4, MT, true> : mma_linear_kernel<T, kInt4, MT, false>;
  kernel<<<grid, kMmaWarps * 32, 0, s>>>(static_cast<const T*>(x), w.data.get(),
                                         static_cast<const uint16_t*>(w.scales.get()),
                                         static_cast<const uint8_t*>(w.zeros.get()), static_cast<const T*>(bias), M,
                                         w.n, w.k, group_shift, static_cast<T*>(out));
}

// out[M, N] = x @ w^T (+ bias) on the skinny kernel, in tiles of 8, 16, 32 or 64 x rows.
template <typename T, bool kInt4>
void launch_mma_linear(const void* x, int64_t M, const Linear& w, const void* bias, void* out, bool pipeline,
                       cudaStream_t s) {
  if (M <= 8)
    launch_mma_linear<T, kInt4, 1>(x, M, w, bias, out, pipeline, s);
  else if (M <= 16)
    launch_mma_linear<T, kInt4, 2>(x, M, w, bias, out, pipeline, s);
  else if (M <= 32)
    launch_mma_linear<T, kInt4, 4>(x, M, w, bias, out, pipeline, s);
  else
    launch_mma_linear<T, kInt4, 8>(x, M, w, bias, out, pipeline, s);
}

}  // namespace
}  // namespace lmkit::cuda
