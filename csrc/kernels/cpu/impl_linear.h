// linear: out[M, N] = x[M, K] @ w[N, K]^T (+ bias), w packed once at load time (ops::pack_linear) into
// panels of kPanel output columns, k-major inside a panel, in its stored dtype (F32 / F16 / BF16):
//     panel[p][k][j] = w[p * kPanel + j, k]        (zero past N)
// Textually included by isa_body.h inside the ISA namespace (see simd.h); written once for every ISA.
//
// One kernel for every M. A thread owns a contiguous range of panels; for an MR-row tile of x it runs
// down a panel once: per k, kNV vectors of the panel row (converted to fp32 in registers), MR
// broadcasts of x[i, k], MR x kNV FMAs into register accumulators (no horizontal sums, no packing of
// x). Rows are split into tiles of nearly equal height (16 rows -> 8 + 8, not 12 + 4).
//   - decode (M small): the panel streams from memory once per tile; the weight read is the cost.
//   - prefill (M large): each K block of the panel is converted to fp32 once into an L1 buffer and
//     reused by every tile of an M block (x rows of the block stay in L2).
//
//        x (M x K)            panel p (K x kPanel)          out (M x N)
//   tile [MR rows]   .   [k rows, kPanel cols]     ->   [MR x kPanel, acc in registers]

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

// ------------------------------------------------------------------------------------------- panels
constexpr int kPanel = 32;         // == ops::kLinearPanelCols
constexpr int kNV = kPanel / kW;   // vectors per panel row
#if defined(__AVX512F__)
constexpr int kMRMax = 12;         // 24 zmm accumulators + 2 panel vectors + 1 broadcast
#elif defined(__AVX2__)
constexpr int kMRMax = 2;          // 8 ymm accumulators + 4 panel vectors + 1 broadcast
#else
constexpr int kMRMax = 1;
#endif
constexpr int64_t kKC = 256;                     // K block of a converted panel: 256 x 32 fp32 = 32 KiB (L1)
constexpr int64_t kMBlockBytes = 1 << 20;        // x rows of one M block, fp32: stay in L2
constexpr int64_t kConvertMinTiles = 6;  // measured: below ~64 rows, converting in registers per tile wins
constexpr int64_t kPrefetchBytes = 2048;         // how far ahead a tile prefetches its panel

// c[i, 0:ncols] = (first ? bias : c[i, :]) + x[i, 0:kc] . panel[0:kc, 0:ncols] for i < MR.
template <int DT, int MR, bool PF>
inline void panel_tile(const float* x, int64_t ldx, const void* panel, int64_t kc, float* c, int64_t ldc,
                       int ncols, bool first, const float* bias) {
  constexpr int64_t row_bytes = kPanel * kElemBytes<DT>;
  // One row's chains are kNV FMAs long per k: for MR <= 2 split k in two to hide the FMA latency.
  constexpr int KU = MR <= 2 ? 2 : 1;
  V acc[KU][MR][kNV];
  for (int u = 0; u < KU; ++u)
    for (int i = 0; i < MR; ++i)
      for (int v = 0; v < kNV; ++v) acc[u][i][v] = vzero();
  const char* pb = (const char*)panel;
  int64_t k = 0;
  for (; k + KU <= kc; k += KU) {
#pragma GCC unroll 2
    for (int u = 0; u < KU; ++u) {
      const char* row = pb + (k + u) * row_bytes;
      if constexpr (PF)
        for (int64_t off = 0; off < row_bytes; off += 64) prefetch(row + kPrefetchBytes + off);
      V b[kNV];
      for (int v = 0; v < kNV; ++v) b[v] = wload<DT>(row, v * kW);
#pragma GCC unroll 16
      for (int i = 0; i < MR; ++i) {
        const V a = vset1(x[i * ldx + k + u]);
        for (int v = 0; v < kNV; ++v) acc[u][i][v] = vfma(a, b[v], acc[u][i][v]);
      }
    }
  }
  for (; k < kc; ++k) {
    const char* row = pb + k * row_bytes;
    V b[kNV];
    for (int v = 0; v < kNV; ++v) b[v] = wload<DT>(row, v * kW);
    for (int i = 0; i < MR; ++i) {
      const V a = vset1(x[i * ldx + k]);
      for (int v = 0; v < kNV; ++v) acc[0][i][v] = vfma(a, b[v], acc[0][i][v]);
    }
  }
  for (int i = 0; i < MR; ++i) {
    float* ci = c + i * ldc;
    for (int v = 0; v < kNV; ++v) {
      V sum = acc[0][i][v];
      for (int u = 1; u < KU; ++u) sum = sum + acc[u][i][v];
      const int j = v * kW, n = ncols - j < kW ? ncols - j : kW;
      if (n <= 0) break;
      const V base = first ? (bias ? vload(bias + j) : vzero()) : (n == kW ? vload(ci + j) : vload_n(ci + j, n));
      if (n == kW) vstore(ci + j, sum + base);
      else vstore_n(ci + j, sum + base, n);
    }
  }
}

template <int DT, bool PF, int MR = kMRMax>
inline void panel_tile_n(int mr, const float* x, int64_t ldx, const void* panel, int64_t kc, float* c, int64_t ldc,
                         int ncols, bool first, const float* bias) {
  if (mr == MR) panel_tile<DT, MR, PF>(x, ldx, panel, kc, c, ldc, ncols, first, bias);
  else if constexpr (MR > 1) panel_tile_n<DT, PF, MR - 1>(mr, x, ldx, panel, kc, c, ldc, ncols, first, bias);
}

// All `rows` rows of x against one panel (K block), in tiles of nearly equal height <= kMRMax.
// PF: prefetch the panel ahead (it streams from memory; not for a converted block already in L1).
template <int DT, bool PF>
inline void panel_rows(const float* x, int64_t ldx, int64_t rows, const void* panel, int64_t kc, float* c,
                       int64_t ldc, int ncols, bool first, const float* bias) {
  int64_t tiles = (rows + kMRMax - 1) / kMRMax;
  for (int64_t m = 0; m < rows; --tiles) {
    const int mr = (int)((rows - m + tiles - 1) / tiles);
    panel_tile_n<DT, PF>(mr, x + m * ldx, ldx, panel, kc, c + m * ldc, ldc, ncols, first, bias);
    m += mr;
  }
}

// bp[k][j] = panel[k0 + k][j] as fp32, k < kc.
template <int DT>
inline void convert_panel(const void* panel, int64_t k0, int64_t kc, float* bp) {
  const char* src = (const char*)panel + k0 * kPanel * kElemBytes<DT>;
  for (int64_t i = 0; i < kc * kPanel; i += kW) vstore(bp + i, wload<DT>(src, i));
}

template <int DT>
void linear_dt(const float* x, int64_t M, const void* w, int64_t N, int64_t K, const float* bias, float* out) {
  const int64_t num_panels = (N + kPanel - 1) / kPanel;
  const int64_t panel_bytes = K * kPanel * kElemBytes<DT>;
  int64_t mblock = kMBlockBytes / (K * 4) / kMRMax * kMRMax;
  if (mblock < kMRMax) mblock = kMRMax;
  const bool convert = DT != (int)DType::F32 && (M < mblock ? M : mblock) > (kConvertMinTiles - 1) * kMRMax;
#pragma omp parallel if (M * N * K >= (1 << 15))
  {
    alignas(64) float bp[kKC * kPanel];
    alignas(64) float bias_tile[kPanel];
    const int64_t nt = omp_get_num_threads(), tid = omp_get_thread_num();
    const int64_t p0 = num_panels * tid / nt, p1 = num_panels * (tid + 1) / nt;
    for (int64_t mb = 0; mb < M; mb += mblock) {
      const int64_t rows = M - mb < mblock ? M - mb : mblock;
      for (int64_t p = p0; p < p1; ++p) {
        const int64_t n0 = p * kPanel;
        const int ncols = (int)(N - n0 < kPanel ? N - n0 : kPanel);
        if (bias)
          for (int j = 0; j < kPanel; ++j) bias_tile[j] = j < ncols ? bias[n0 + j] : 0.0f;
        const char* panel = (const char*)w + p * panel_bytes;
        float* c = out + mb * N + n0;
        if (!convert) {
          panel_rows<DT, true>(x + mb * K, K, rows, panel, K, c, N, ncols, true, bias ? bias_tile : nullptr);
          continue;
        }
        for (int64_t k0 = 0; k0 < K; k0 += kKC) {
          const int64_t kc = K - k0 < kKC ? K - k0 : kKC;
          convert_panel<DT>(panel, k0, kc, bp);
          panel_rows<(int)DType::F32, false>(x + mb * K + k0, K, rows, bp, kc, c, N, ncols, k0 == 0,
                                      bias ? bias_tile : nullptr);
        }
      }
    }
  }
}

// ------------------------------------------------------------------------------------------- linear
// w: packed panels (ops::pack_linear); bias: nullptr or N fp32 values (dispatch.cpp converts other dtypes).
void linear(const float* x, int64_t M, const void* w, DType dt, int64_t N, int64_t K, const float* bias, float* out) {
  if (dt == DType::F16) linear_dt<(int)DType::F16>(x, M, w, N, K, bias, out);
  else if (dt == DType::BF16) linear_dt<(int)DType::BF16>(x, M, w, N, K, bias, out);
  else linear_dt<(int)DType::F32>(x, M, w, N, K, bias, out);
}
