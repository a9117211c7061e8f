// linear: out[M, N] = x[M, K] @ w[N, K]^T (+ bias), w in its stored dtype (F32 / F16 / BF16).
// Textually included by isa_body.h inside the ISA namespace (see simd.h); written once for every ISA.
//
// Two paths:
//   GEMV (M < kGemmMinRows, decode): memory bound. Each thread owns a contiguous range of output
//     columns n (= weight rows), streams those weight rows once, converting kW elements at a time,
//     and takes the dot products with up to kGemvMC activation rows per pass (the RT-row weight tile
//     stays in L1 across passes, so DRAM sees each weight row once).
//   GEMM (prefill): compute bound. Each thread owns a range of NR-column panels; per (panel, K block)
//     it converts w[n0:n0+NR, k0:k0+KC] into an fp32 panel bp[KC][NR] (in L1) and runs an MR x NR
//     register-blocked micro-kernel down all M rows:
//
//          x (M x K)            bp (KC x NR, L1)          out (M x N)
//       m0 [==== KC ====]  x    [ NR cols ]         ->   [ MR x NR tile, acc in registers ]

template <int DT>
inline V wload(const void* p, int64_t i) {
  if constexpr (DT == (int)DType::F16) return vload_f16((const uint16_t*)p + i);
  else if constexpr (DT == (int)DType::BF16) return vload_bf16((const uint16_t*)p + i);
  else return vload((const float*)p + i);
}
template <int DT>
inline V wload_n(const void* p, int64_t i, int n) {
  if constexpr (DT == (int)DType::F16) return vload_f16_n((const uint16_t*)p + i, n);
  else if constexpr (DT == (int)DType::BF16) return vload_bf16_n((const uint16_t*)p + i, n);
  else return vload_n((const float*)p + i, n);
}
template <int DT>
constexpr int64_t kElemBytes = DT == (int)DType::F32 ? 4 : 2;

// ---------------------------------------------------------------------------------------------- GEMV
#if defined(__AVX512F__)
#ifndef GEMV_RT
#define GEMV_RT 4
#define GEMV_MC 4
#endif
constexpr int kGemvRT = GEMV_RT, kGemvMC = GEMV_MC;
#elif defined(__AVX2__)
constexpr int kGemvRT = 4, kGemvMC = 2;
#else
constexpr int kGemvRT = 4, kGemvMC = 2;
#endif
#ifndef GEMM_MIN
#define GEMM_MIN 8
#endif
constexpr int64_t kGemmMinRows = GEMM_MIN;
constexpr int64_t kGemvPrefetchRows = 8;  // how far ahead (in weight rows) gemv_tile prefetches

// out[m, n0 + r] = x[m, :] . w[n0 + r, :] (+ bias) for r < RT, m < MC.
template <int DT, int RT, int MC>
inline void gemv_tile(const float* x, int64_t K, const void* w, int64_t n0, const float* bias, float* out,
                      int64_t N) {
  const char* rows[RT];
  for (int r = 0; r < RT; ++r) rows[r] = (const char*)w + (n0 + r) * K * kElemBytes<DT>;
  V acc[RT][MC];
  for (int r = 0; r < RT; ++r)
    for (int m = 0; m < MC; ++m) acc[r][m] = vzero();
  // The rows of the next tiles are fetched ahead explicitly: each row is only a few cache lines
  // long, too short for the hardware prefetcher to ramp up on its own.
  const int64_t ahead = kGemvPrefetchRows * K * kElemBytes<DT>;
  int64_t k = 0;
  for (; k + kW <= K; k += kW) {
    V wv[RT];
    for (int r = 0; r < RT; ++r) {
      prefetch(rows[r] + ahead + k * kElemBytes<DT>);
      wv[r] = wload<DT>(rows[r], k);
    }
    for (int m = 0; m < MC; ++m) {
      const V xv = vload(x + m * K + k);
      for (int r = 0; r < RT; ++r) acc[r][m] = vfma(wv[r], xv, acc[r][m]);
    }
  }
  if (k < K) {
    const int rem = (int)(K - k);
    V wv[RT];
    for (int r = 0; r < RT; ++r) wv[r] = wload_n<DT>(rows[r], k, rem);
    for (int m = 0; m < MC; ++m) {
      const V xv = vload_n(x + m * K + k, rem);
      for (int r = 0; r < RT; ++r) acc[r][m] = vfma(wv[r], xv, acc[r][m]);
    }
  }
  for (int m = 0; m < MC; ++m)
    for (int r = 0; r < RT; ++r) out[m * N + n0 + r] = vsum(acc[r][m]) + (bias ? bias[r] : 0.0f);
}

// Rows n0 .. n0 + RT of the output for all M activation rows, up to MC rows per pass.
template <int DT, int RT, int MC>
inline void gemv_rows(const float* x, int64_t M, int64_t K, const void* w, int64_t n0, const float* bias,
                      float* out, int64_t N) {
  int64_t m = 0;
  for (; m + MC <= M; m += MC) gemv_tile<DT, RT, MC>(x + m * K, K, w, n0, bias, out + m * N, N);
  if constexpr (MC > 1) {
    if (m < M) gemv_rows<DT, RT, MC - 1>(x + m * K, M - m, K, w, n0, bias, out + m * N, N);
  }
}

template <int DT>
void gemv(const float* x, int64_t M, const void* w, int64_t N, int64_t K, const float* bias, float* out) {
  const int64_t num_tiles = (N + kGemvRT - 1) / kGemvRT;
#pragma omp parallel if (N * K >= (1 << 14))
  {
    const int64_t nt = omp_get_num_threads(), tid = omp_get_thread_num();
    const int64_t t0 = num_tiles * tid / nt, t1 = num_tiles * (tid + 1) / nt;
    for (int64_t t = t0; t < t1; ++t) {
      const int64_t n0 = t * kGemvRT;
      const float* b = bias ? bias + n0 : nullptr;
      if (n0 + kGemvRT <= N) {
        gemv_rows<DT, kGemvRT, kGemvMC>(x, M, K, w, n0, b, out, N);
      } else {
        for (int64_t n = n0; n < N; ++n) gemv_rows<DT, 1, kGemvMC>(x, M, K, w, n, bias ? bias + n : nullptr, out, N);
      }
    }
  }
}

// ---------------------------------------------------------------------------------------------- GEMM
constexpr int kNR = 2 * kW;  // micro-kernel columns: two vectors
#if defined(__AVX512F__)
constexpr int kMR = 12;  // 24 zmm accumulators
#elif defined(__AVX2__)
constexpr int kMR = 6;  // 12 ymm accumulators
#else
constexpr int kMR = 4;
#endif
constexpr int64_t kKCMax = 256;  // bp = KC x NR fp32: 32 KiB with AVX-512, stays in L1

// bp[k][j] = w[n0 + j, k0 + k] as fp32 for k < kc, j < ncols; columns j >= ncols are 0.
// kW x kW blocks are converted a row at a time and transposed in registers.
template <int DT>
inline void pack_b(const void* w, int64_t K, int64_t n0, int ncols, int64_t k0, int64_t kc, float* bp) {
  for (int jb = 0; jb < kNR; jb += kW) {
    const char* rows[kW];
    const int nrows = ncols - jb < 0 ? 0 : (ncols - jb < kW ? ncols - jb : kW);
    for (int j = 0; j < kW; ++j) rows[j] = (const char*)w + (n0 + jb + (j < nrows ? j : 0)) * K * kElemBytes<DT>;
    int64_t k = 0;
    for (; k + kW <= kc; k += kW) {
      V r[kW];
      for (int j = 0; j < kW; ++j) r[j] = j < nrows ? wload<DT>(rows[j], k0 + k) : vzero();
      vtranspose(r);
      for (int i = 0; i < kW; ++i) vstore(bp + (k + i) * kNR + jb, r[i]);
    }
    if (k < kc) {
      const int rem = (int)(kc - k);
      V r[kW];
      for (int j = 0; j < kW; ++j) r[j] = j < nrows ? wload_n<DT>(rows[j], k0 + k, rem) : vzero();
      vtranspose(r);
      for (int i = 0; i < rem; ++i) vstore(bp + (k + i) * kNR + jb, r[i]);
    }
  }
}

// ap[k][i] = x[m0 + i, k0 + k] for k < kc, i < MR; rows past M are 0.
inline void pack_a(const float* x, int64_t M, int64_t K, int64_t m0, int64_t k0, int64_t kc, float* ap) {
  for (int i = 0; i < kMR; ++i) {
    if (m0 + i < M) {
      const float* src = x + (m0 + i) * K + k0;
      for (int64_t k = 0; k < kc; ++k) ap[k * kMR + i] = src[k];
    } else {
      for (int64_t k = 0; k < kc; ++k) ap[k * kMR + i] = 0.0f;
    }
  }
}

// c[i, 0:ncols] (+)= ap[:, i] . bp for i < rows: the `first` K block writes acc (+ bias), later ones add.
inline void micro_kernel(int64_t kc, const float* ap, const float* bp, float* c, int64_t ldc, int rows, int ncols,
                         bool first, const float* bias) {
  V acc0[kMR], acc1[kMR];
  for (int i = 0; i < kMR; ++i) acc0[i] = acc1[i] = vzero();
  for (int64_t k = 0; k < kc; ++k, ap += kMR, bp += kNR) {
    const V b0 = vload(bp), b1 = vload(bp + kW);
#pragma GCC unroll 16
    for (int i = 0; i < kMR; ++i) {
      const V av = vset1(ap[i]);
      acc0[i] = vfma(av, b0, acc0[i]);
      acc1[i] = vfma(av, b1, acc1[i]);
    }
  }
  V base0 = vzero(), base1 = vzero();
  if (first && bias) {
    base0 = vload(bias);
    base1 = vload(bias + kW);
  }
  for (int i = 0; i < rows; ++i) {
    float* ci = c + i * ldc;
    if (ncols == kNR) {
      vstore(ci, acc0[i] + (first ? base0 : vload(ci)));
      vstore(ci + kW, acc1[i] + (first ? base1 : vload(ci + kW)));
    } else {
      const int n0 = ncols < kW ? ncols : kW, n1 = ncols - n0;
      vstore_n(ci, acc0[i] + (first ? base0 : vload_n(ci, n0)), n0);
      if (n1 > 0) vstore_n(ci + kW, acc1[i] + (first ? base1 : vload_n(ci + kW, n1)), n1);
    }
  }
}

// Blocked over M so that the packed activations of a block (MC x K fp32, <= ~1 MiB) stay in L2:
//   for each M block:   all threads pack x[block, :] into MR-row micro-panels ap[kblock][tile][k][MR]
//     each thread, for its NR-column panels:  for each K block:  convert w[panel, K block] into bp (L1)
//                                                               and run it down the M block's tiles
// Each output tile is finished (all K blocks) while it is still in cache; the weight is streamed once
// per M block.
template <int DT>
void gemm(const float* x, int64_t M, const void* w, int64_t N, int64_t K, const float* bias, float* out) {
  const int64_t num_panels = (N + kNR - 1) / kNR;
  const int64_t num_kblocks = (K + kKCMax - 1) / kKCMax;
  const int64_t kc_size = (K + num_kblocks - 1) / num_kblocks;
  const int64_t num_mblocks = (M * K * 4 + (1 << 20) - 1) >> 20;
  const int64_t mc = ((M + num_mblocks - 1) / num_mblocks + kMR - 1) / kMR * kMR;
  const int64_t mc_tiles = mc / kMR;
  float* ap = (float*)aligned_alloc(64, (size_t)(mc * K * 4 + 63) / 64 * 64);
#pragma omp parallel
  {
    alignas(64) float bp[kKCMax * kNR];
    alignas(64) float bias_tile[kNR];
    const int64_t nt = omp_get_num_threads(), tid = omp_get_thread_num();
    const int64_t p0 = num_panels * tid / nt, p1 = num_panels * (tid + 1) / nt;
    for (int64_t mb = 0; mb < M; mb += mc) {
      const int64_t rows = M - mb < mc ? M - mb : mc, tiles = (rows + kMR - 1) / kMR;
      // ap + k0 * mc_tiles * kMR: the K block starting at k0; + t * kMR * kc: its tile t
      for (int64_t job = tid; job < tiles * num_kblocks; job += nt) {
        const int64_t t = job % tiles, k0 = job / tiles * kc_size, kc = K - k0 < kc_size ? K - k0 : kc_size;
        pack_a(x + mb * K, rows, K, t * kMR, k0, kc, ap + k0 * mc_tiles * kMR + t * kMR * kc);
      }
#pragma omp barrier
      for (int64_t p = p0; p < p1; ++p) {
        const int64_t n0 = p * kNR;
        const int ncols = (int)(N - n0 < kNR ? N - n0 : kNR);
        if (bias)
          for (int j = 0; j < kNR; ++j) bias_tile[j] = j < ncols ? bias[n0 + j] : 0.0f;
        for (int64_t k0 = 0; k0 < K; k0 += kc_size) {
          const int64_t kc = K - k0 < kc_size ? K - k0 : kc_size;
          pack_b<DT>(w, K, n0, ncols, k0, kc, bp);
          const float* apk = ap + k0 * mc_tiles * kMR;
          for (int64_t t = 0; t < tiles; ++t) {
            const int64_t m0 = t * kMR;
            micro_kernel(kc, apk + t * kMR * kc, bp, out + (mb + m0) * N + n0, N,
                         (int)(rows - m0 < kMR ? rows - m0 : kMR), ncols, k0 == 0, bias ? bias_tile : nullptr);
          }
        }
      }
#pragma omp barrier
    }
  }
  free(ap);
}

// ------------------------------------------------------------------------------------------- linear
template <int DT>
void linear_dt(const float* x, int64_t M, const void* w, int64_t N, int64_t K, const float* bias, float* out) {
  if (M < kGemmMinRows) gemv<DT>(x, M, w, N, K, bias, out);
  else gemm<DT>(x, M, w, N, K, bias, out);
}

// bias: nullptr or N fp32 values (dispatch.cpp converts other dtypes).
void linear(const float* x, int64_t M, const void* w, DType dt, int64_t N, int64_t K, const float* bias, float* out) {
  if (dt == DType::F16) linear_dt<(int)DType::F16>(x, M, w, N, K, bias, out);
  else if (dt == DType::BF16) linear_dt<(int)DType::BF16>(x, M, w, N, K, bias, out);
  else linear_dt<(int)DType::F32>(x, M, w, N, K, bias, out);
}
