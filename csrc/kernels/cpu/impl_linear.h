// linear: out[M, N] = x[M, K] @ w[N, K]^T (+ bias), w in its stored dtype (F32 / F16 / BF16), used in
// place (never expanded into a full fp32 copy). Textually included by isa_body.h inside the ISA
// namespace (see simd.h); written once for every ISA.
//
// Two paths, chosen by M (kGemmMinRows, measured):
//   GEMV (decode, small M): memory bound. Each thread owns a contiguous range of weight rows (output
//     columns), streams them once with explicit prefetch, converting kW elements at a time, and takes
//     RT x MC dot products per pass (the RT-row weight tile stays in L1 across the passes over M, so
//     DRAM sees each weight row once); one horizontal sum per output.
//   GEMM (prefill): compute bound. Threads split the output into a tm x tn grid; each packs its rows
//     of x into MR-row micro-panels ap (private, L2) and, per NR-column panel and K block, converts
//     the weight into an fp32 panel bp[KC][NR] (L1, transposed in registers), then runs the MR x NR
//     register-blocked micro-kernel (MR broadcasts x 2 vectors of bp per k) down its rows:
//
//          ap (MR x KC per tile)      bp (KC x NR, L1)          out (M x N)
//       m0 [==== KC ====]        x    [ NR cols ]         ->   [ MR x NR tile, acc in registers ]

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
// RT x MC accumulators per GEMV tile; kGemmMinRows: the measured M where the GEMM path starts to win.
#if defined(__AVX512F__)
constexpr int kGemvRT = 4, kGemvMC = 6;  // 24 zmm accumulators
constexpr int64_t kGemmMinRows = 20;
#else
constexpr int kGemvRT = 4, kGemvMC = 2;
constexpr int64_t kGemmMinRows = 12;
#endif
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
constexpr int64_t kPackedRowsBytes = 3 << 19;  // 1.5 MiB: a thread's packed rows of x per M block, in L2
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

// ap[k][i] = x[m0 + i, k0 + k] for k < kc, i < MR; rows past M are 0. (kMR <= kW: one transpose
// of a kW x kW block, padded with zero rows, yields kW values of k at once.)
inline void pack_a(const float* x, int64_t M, int64_t K, int64_t m0, int64_t k0, int64_t kc, float* ap) {
  static_assert(kMR <= kW, "pack_a transposes kW x kW blocks");
  const float* rows[kMR];
  const int nrows = M - m0 < kMR ? (int)(M - m0) : kMR;
  for (int i = 0; i < kMR; ++i) rows[i] = x + (m0 + (i < nrows ? i : 0)) * K + k0;
  int64_t k = 0;
  for (; k < kc; k += kW) {
    const int n = kc - k < kW ? (int)(kc - k) : kW;
    V r[kW];
    for (int i = 0; i < kW; ++i)
      r[i] = i < kMR && i < nrows ? (n == kW ? vload(rows[i] + k) : vload_n(rows[i] + k, n)) : vzero();
    vtranspose(r);
    for (int j = 0; j < n; ++j) vstore_n(ap + (k + j) * kMR, r[j], kMR);
  }
}

// c[i, 0:ncols] (+)= ap[:, i] . bp for i < rows: the `first` K block writes acc (+ bias), later ones add.
inline void micro_kernel(int64_t kc, const float* ap, const float* bp, float* c, int64_t ldc, int rows, int ncols,
                         bool first, const float* bias) {
  V acc0[kMR], acc1[kMR];
  for (int i = 0; i < kMR; ++i) acc0[i] = acc1[i] = vzero();
#pragma GCC unroll 4
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

// Threads split the output into a grid of tm x tn blocks (tm * tn = threads), chosen to pack the
// least: each thread packs its own rows of x (private, stays in its L2) and converts its own weight
// panels. Within a thread, blocked over M so that its packed rows (MC x K fp32, <= 1.5 MiB) stay in L2:
//   for each M block:   pack x[block, :] into MR-row micro-panels ap[kblock][tile][k][MR]
//     for each of its NR-column panels:  for each K block:  convert w[panel, K block] into bp (L1)
//                                                           and run it down the M block's tiles
// Each output tile is finished (all K blocks) while it is still in cache.
template <int DT>
void gemm(const float* x, int64_t M, const void* w, int64_t N, int64_t K, const float* bias, float* out) {
  const int64_t num_panels = (N + kNR - 1) / kNR, num_mtiles = (M + kMR - 1) / kMR;
  const int64_t num_kblocks = (K + kKCMax - 1) / kKCMax;
  const int64_t kc_size = (K + num_kblocks - 1) / num_kblocks;
  const int nt_max = omp_get_max_threads();
  // cost of a grid, per thread, in packed elements: rows of x once, weight panels twice (convert)
  int grid_m = 1;
  double best = -1;
  for (int tm = 1; tm <= nt_max; ++tm) {
    if (nt_max % tm != 0 || tm > num_mtiles || nt_max / tm > num_panels) continue;
    const double cost = (double)M / tm * K + 2.0 * N / (nt_max / tm) * K;
    if (best < 0 || cost < best) best = cost, grid_m = tm;
  }
#pragma omp parallel
  {
    alignas(64) float bp[kKCMax * kNR];
    alignas(64) float bias_tile[kNR];
    const int nt = omp_get_num_threads(), tid = omp_get_thread_num();
    const int tm = nt == nt_max ? grid_m : 1, tn = nt / tm;  // nt < nt_max: a nested or limited team
    const int tid_m = tid % tm, tid_n = tid / tm;
    const int64_t p0 = num_panels * tid_n / tn, p1 = num_panels * (tid_n + 1) / tn;
    const int64_t m_begin = num_mtiles * tid_m / tm * kMR, m_stop = num_mtiles * (tid_m + 1) / tm * kMR;
    const int64_t m_end = m_stop < M ? m_stop : M;
    const int64_t my_rows = m_end - m_begin;
    const int64_t num_mblocks = my_rows > 0 ? (my_rows * K * 4 + kPackedRowsBytes - 1) / kPackedRowsBytes : 1;
    const int64_t mc = ((my_rows + num_mblocks - 1) / num_mblocks + kMR - 1) / kMR * kMR;
    const int64_t mc_tiles = mc / kMR;
    float* ap = my_rows > 0 && p1 > p0 ? (float*)aligned_alloc(64, (size_t)(mc * K * 4 + 63) / 64 * 64) : nullptr;
    if (my_rows > 0 && p1 > p0 && ap == nullptr) abort();  // out of memory; no way to report it from here
    for (int64_t mb = m_begin; ap && mb < m_end; mb += mc) {
      const int64_t rows = m_end - mb < mc ? m_end - mb : mc, tiles = (rows + kMR - 1) / kMR;
      // ap + k0 * mc_tiles * kMR: the K block starting at k0; + t * kMR * kc: its tile t
      for (int64_t k0 = 0; k0 < K; k0 += kc_size) {
        const int64_t kc = K - k0 < kc_size ? K - k0 : kc_size;
        for (int64_t t = 0; t < tiles; ++t) pack_a(x + mb * K, rows, K, t * kMR, k0, kc, ap + k0 * mc_tiles * kMR + t * kMR * kc);
      }
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
    }
    free(ap);
  }
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
