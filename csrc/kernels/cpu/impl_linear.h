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
// Rows per tile of the dense kernels (panel_rows): AVX2 takes up to 6 rows in two column halves
// (kPassNV), 2.5x the FMAs per panel load of a 2-row tile; tiles of 1-2 rows are unchanged. The int4
// tiles (qpanel_tile, q8_tile) keep kMRMax / kQ8MR.
constexpr int kMRTall = kW == 8 ? 6 : kMRMax;
constexpr int64_t kKC = 256;                     // K block of a converted panel: 256 x 32 fp32 = 32 KiB (L1)
constexpr int64_t kMBlockBytes = 1 << 20;        // x rows of one M block, fp32: stay in L2
// Rows from which a panel block is converted to fp32 once (into L1) rather than per tile in registers.
// Measured: AVX-512 below ~64 rows (6 tiles) converting per tile wins; AVX2 (two passes per tall tile)
// wins by converting as soon as there is more than one tile.
constexpr int64_t kConvertMinRows = kW == 8 ? kMRTall + 1 : 5 * kMRMax + 1;
constexpr int64_t kPrefetchBytes = 2048;         // how far ahead a tile prefetches its panel
constexpr int64_t kQ8Span = 1024;                // k per pass of the int8-activation tiles over a shared panel
constexpr int64_t kQ8MBlockBytes = 1 << 18;      // qx rows (K bytes each) of one M block of those tiles: stay in L2

// Vectors of a panel row per pass down the panel: all kNV of them, except in AVX2 tiles of more than 2
// rows, which take the panel in two 16-column halves (16 ymm: 6 rows x 2 accumulators + 2 panel
// vectors + 1 broadcast; 12 independent FMA chains cover the FMA latency x 2 ports).
template <int MR>
constexpr int kPassNV = (kW == 8 && MR > 2) ? 2 : kNV;

// c[i, 0:ncols] = (first ? 0 : c[i, :]) + x[i, 0:kc] . panel[0:kc, 0:ncols] (+ bias when last) for i < MR.
// Batch-invariant: each (row, column) is one FMA chain over k in order, whatever MR, and a K block continues the
// chain of the block before it (c holds its exact partial sum, the bias comes last), so a row's result is the same
// bits in a tile of any height, alone or among others, straight from the panel or from a converted K block
// (conversions of f16 / bf16 / quantized weights to fp32 are exact). Speculative decoding relies on it: a sequence's
// draft rows must score as its plain decode rows would. The cost: one chain per accumulator leaves 1-2-row tiles
// latency-bound on a panel in cache; a panel streaming from memory (decode) is bandwidth-bound either way.
template <int DT, int MR, bool PF>
inline void panel_tile(const float* x, int64_t ldx, const void* panel, int64_t kc, float* c, int64_t ldc,
                       int ncols, bool first, bool last, const float* bias) {
  constexpr int64_t row_bytes = kPanel * kElemBytes<DT>;
  constexpr int NVP = kPassNV<MR>;
  const char* pb = (const char*)panel;
  for (int v0 = 0; v0 < kNV && v0 * kW < ncols; v0 += NVP) {
    V acc[MR][NVP];
    for (int i = 0; i < MR; ++i)
      for (int v = 0; v < NVP; ++v) {
        const int j = (v0 + v) * kW, n = ncols - j < kW ? ncols - j : kW;
        acc[i][v] = first || n <= 0 ? vzero() : n == kW ? vload(c + i * ldc + j) : vload_n(c + i * ldc + j, n);
      }
#pragma GCC unroll 2
    for (int64_t k = 0; k < kc; ++k) {
      const char* row = pb + k * row_bytes;
      if constexpr (PF)
        if (v0 == 0)
          for (int64_t off = 0; off < row_bytes; off += 64) prefetch(row + kPrefetchBytes + off);
      V b[NVP];
      for (int v = 0; v < NVP; ++v) b[v] = wload<DT>(row, (v0 + v) * kW);
#pragma GCC unroll 16
      for (int i = 0; i < MR; ++i) {
        const V a = vset1(x[i * ldx + k]);
        for (int v = 0; v < NVP; ++v) acc[i][v] = vfma(a, b[v], acc[i][v]);
      }
    }
    for (int i = 0; i < MR; ++i) {
      float* ci = c + i * ldc;
      for (int v = 0; v < NVP; ++v) {
        V sum = acc[i][v];
        const int j = (v0 + v) * kW, n = ncols - j < kW ? ncols - j : kW;
        if (n <= 0) break;
        if (last && bias) sum = sum + vload(bias + j);
        if (n == kW) vstore(ci + j, sum);
        else vstore_n(ci + j, sum, n);
      }
    }
  }
}

template <int DT, bool PF, int MR = kMRMax>
inline void panel_tile_n(int mr, const float* x, int64_t ldx, const void* panel, int64_t kc, float* c, int64_t ldc,
                         int ncols, bool first, bool last, const float* bias) {
  if (mr == MR) panel_tile<DT, MR, PF>(x, ldx, panel, kc, c, ldc, ncols, first, last, bias);
  else if constexpr (MR > 1) panel_tile_n<DT, PF, MR - 1>(mr, x, ldx, panel, kc, c, ldc, ncols, first, last, bias);
}

// fn(m, mr) over `rows` rows in tiles of nearly equal height mr <= MRMAX (16 rows at 12: 8 + 8).
template <int MRMAX, class Fn>
inline void for_each_tile(int64_t rows, Fn&& fn) {
  int64_t tiles = (rows + MRMAX - 1) / MRMAX;
  for (int64_t m = 0; m < rows; --tiles) {
    const int mr = (int)((rows - m + tiles - 1) / tiles);
    fn(m, mr);
    m += mr;
  }
}

// All `rows` rows of x against one panel (K block), in tiles of nearly equal height <= MRMAX.
// PF: prefetch the panel ahead (it streams from memory; not for a converted block already in L1).
template <int DT, bool PF, int MRMAX = kMRMax>
inline void panel_rows(const float* x, int64_t ldx, int64_t rows, const void* panel, int64_t kc, float* c,
                       int64_t ldc, int ncols, bool first, bool last, const float* bias) {
  for_each_tile<MRMAX>(rows, [&](int64_t m, int mr) {
    panel_tile_n<DT, PF, MRMAX>(mr, x + m * ldx, ldx, panel, kc, c + m * ldc, ldc, ncols, first, last, bias);
  });
}

// bp[k][j] = panel[k0 + k][j] as fp32, k < kc.
template <int DT>
inline void convert_panel(const void* panel, int64_t k0, int64_t kc, float* bp) {
  const char* src = (const char*)panel + k0 * kPanel * kElemBytes<DT>;
  for (int64_t i = 0; i < kc * kPanel; i += kW) vstore(bp + i, wload<DT>(src, i));
}

// Rows of x per M block, so that a block's fp32 rows stay in L2.
inline int64_t m_block_rows(int64_t K) {
  const int64_t mblock = kMBlockBytes / (K * 4) / kMRMax * kMRMax;
  return mblock < kMRMax ? kMRMax : mblock;
}

// The work items of the linear kernels: (M block, panel) pairs, M block by M block, in chunks of consecutive
// panels (about four per thread and M block; a chunk never spans two M blocks). Chunk c holds rows [mb, me)
// and panels [p0, p1) of an [rows, N] output.
struct PanelChunks {
  int64_t rows, N, mblock, num_panels, grain, per_mblock;
  PanelChunks(int64_t rows_, int64_t N_, int64_t mblock_)
      : rows(rows_), N(N_), mblock(mblock_), num_panels((N_ + kPanel - 1) / kPanel), grain(grain_for(num_panels)),
        per_mblock((num_panels + grain - 1) / grain) {}
  int64_t count() const { return (rows + mblock - 1) / mblock * per_mblock; }
  // fn(mb, me, p, ncols) for every (M block, panel) of chunks [c0, c1), with bias_tile holding the panel's
  // 32 bias values first (0 beyond ncols) where there is a bias (untouched without one).
  template <class Fn>
  void each(int64_t c0, int64_t c1, const float* bias, float* bias_tile, Fn&& fn) const {
    for (int64_t c = c0; c < c1; ++c) {
      const int64_t mb = c / per_mblock * mblock, me = rows - mb < mblock ? rows : mb + mblock;
      const int64_t p0 = c % per_mblock * grain, p1 = p0 + grain < num_panels ? p0 + grain : num_panels;
      for (int64_t p = p0; p < p1; ++p) {
        const int64_t n0 = p * kPanel;
        const int ncols = (int)(N - n0 < kPanel ? N - n0 : kPanel);
        // Only with a bias: `bias && j < ncols ? bias[n0 + j] : 0` vectorizes into masked loads from bias + n0,
        // which with a null bias (no lane enabled) still cost a microcode assist each on Zen 4: 5% of a
        // 1.2B decode step went there.
        if (bias != nullptr)
          for (int j = 0; j < kPanel; ++j) bias_tile[j] = j < ncols ? bias[n0 + j] : 0.0f;
        fn(mb, me, p, ncols);
      }
    }
  }
};

// The driver of every linear kernel: the PanelChunks handed out over the thread team (when the work is big
// enough); for each (M block, panel),
//   fn(mb, rows, p, ncols, bias_tile, bp)
// with bias_tile the panel's 32 bias values (0 beyond ncols; nullptr without bias) and bp the thread's
// L1 buffer of kKC x kPanel fp32 for converted K blocks.
template <class Fn>
inline void for_each_panel(int64_t M, int64_t N, int64_t K, int64_t mblock, const float* bias, Fn&& fn) {
  const PanelChunks chunks(M, N, mblock);
  parallel_for(chunks.count(), 1, M * N * K >= (1 << 15), [&](int64_t c0, int64_t c1) {
    alignas(64) float bp[kKC * kPanel];
    alignas(64) float bias_tile[kPanel];
    chunks.each(c0, c1, bias, bias_tile, [&](int64_t mb, int64_t me, int64_t p, int ncols) {
      fn(mb, me - mb, p, ncols, bias ? bias_tile : nullptr, bp);
    });
  });
}

// c[0 : NP * 32] = x[0:K] . NP adjacent panels (+ bias) for one row: NP * kNV FMA chains in flight where a 1-row
// panel_tile has kNV (latency-bound on Zen 5 with kNV = 2), each output still one chain over k in order (the same
// bits as panel_tile's). The last panel holds ncols_last columns.
template <int DT, int NP>
inline void row_panels(const float* x, const char* panel, int64_t panel_bytes, int64_t K, float* c, int ncols_last,
                       const float* bias) {
  constexpr int64_t row_bytes = kPanel * kElemBytes<DT>;
  V acc[NP][kNV];
  for (int q = 0; q < NP; ++q)
    for (int v = 0; v < kNV; ++v) acc[q][v] = vzero();
#pragma GCC unroll 2
  for (int64_t k = 0; k < K; ++k) {
    const V a = vset1(x[k]);
    for (int q = 0; q < NP; ++q) {
      const char* row = panel + q * panel_bytes + k * row_bytes;
      for (int64_t off = 0; off < row_bytes; off += 64) prefetch(row + kPrefetchBytes + off);
      for (int v = 0; v < kNV; ++v) acc[q][v] = vfma(a, wload<DT>(row, v * kW), acc[q][v]);
    }
  }
  for (int q = 0; q < NP; ++q)
    for (int v = 0; v < kNV; ++v) {
      const int j = v * kW, ncols = q == NP - 1 ? ncols_last : kPanel, n = ncols - j < kW ? ncols - j : kW;
      if (n <= 0) break;
      V sum = acc[q][v];
      if (bias) sum = sum + vload(bias + q * kPanel + j);
      if (n == kW) vstore(c + q * kPanel + j, sum);
      else vstore_n(c + q * kPanel + j, sum, n);
    }
}

template <int DT>
void linear_dt(const float* x, int64_t M, const void* w, int64_t N, int64_t K, const float* bias, float* out) {
  const int64_t panel_bytes = K * kPanel * kElemBytes<DT>;
  if (M == 1) {  // one row: panels two at a time (row_panels)
    const int64_t np = (N + kPanel - 1) / kPanel, pairs = (np + 1) / 2;
    parallel_for(pairs, grain_for(pairs), N * K >= (1 << 15), [&](int64_t a, int64_t b) {
      alignas(64) float bias_tile[2 * kPanel];
      for (int64_t pp = a; pp < b; ++pp) {
        const int64_t p = 2 * pp, count = np - p < 2 ? np - p : 2;
        const int ncols_last = (int)(N - (p + count - 1) * kPanel < kPanel ? N - (p + count - 1) * kPanel : kPanel);
        if (bias != nullptr)
          for (int64_t j = 0; j < count * kPanel; ++j) bias_tile[j] = p * kPanel + j < N ? bias[p * kPanel + j] : 0.0f;
        const char* panel = (const char*)w + p * panel_bytes;
        if (count == 2) row_panels<DT, 2>(x, panel, panel_bytes, K, out + p * kPanel, ncols_last, bias ? bias_tile : nullptr);
        else row_panels<DT, 1>(x, panel, panel_bytes, K, out + p * kPanel, ncols_last, bias ? bias_tile : nullptr);
      }
    });
    return;
  }
  const int64_t mblock = m_block_rows(K);
  const bool convert = DT != (int)DType::F32 && (M < mblock ? M : mblock) >= kConvertMinRows;
  for_each_panel(M, N, K, mblock, bias, [&](int64_t mb, int64_t rows, int64_t p, int ncols, const float* bias_tile,
                                            float* bp) {
    const char* panel = (const char*)w + p * panel_bytes;
    float* c = out + mb * N + p * kPanel;
    if (!convert) {  // fp32 panels, or too few rows to pay for converting: straight from the panel
      panel_rows<DT, true, kMRTall>(x + mb * K, K, rows, panel, K, c, N, ncols, true, true, bias_tile);
      return;
    }
    for (int64_t k0 = 0; k0 < K; k0 += kKC) {
      const int64_t kc = K - k0 < kKC ? K - k0 : kKC;
      convert_panel<DT>(panel, k0, kc, bp);
      panel_rows<(int)DType::F32, false, kMRTall>(x + mb * K + k0, K, rows, bp, kc, c, N, ncols, k0 == 0,
                                                   k0 + kc == K, bias_tile);
    }
  });
}

// ------------------------------------------------------------------------------------------- linear
// w: packed panels (ops::pack_linear); bias: nullptr or N fp32 values (dispatch.cpp converts other dtypes).
void linear(const float* x, int64_t M, const void* w, DType dt, int64_t N, int64_t K, const float* bias, float* out) {
  if (dt == DType::F16) linear_dt<(int)DType::F16>(x, M, w, N, K, bias, out);
  else if (dt == DType::BF16) linear_dt<(int)DType::BF16>(x, M, w, N, K, bias, out);
  else linear_dt<(int)DType::F32>(x, M, w, N, K, bias, out);
}

// ------------------------------------------------------------------------------------------- int4
// The int4 panels of ops::LinearWeight (AWQ, repacked at load): per panel, K / g group blocks of
//   scales [32] fp16 | zeros [32] u8 | g / 4 quads of 64 bytes
// quad t: 16 little-endian 32-bit lanes; byte i of lane j = q[4t + i, j] | q[4t + i, j + 16] << 4,
// i.e. lane j holds 4 consecutive k of columns j and j + 16: the operand layout of VNNI's vpdpbusd
// (4 u8 x 4 s8 products per 32-bit lane), and for the fp32 path one shift + mask per k and vector.
// w[k, j] = (q - zero) * scale = fma(q, scale, -zero * scale): both products are exact in fp32 (4-bit
// integers times an fp16 scale), so the dequantized weight is exact and so is the fp32 path built on it.
//   - decode (M small): a tile unpacks each k of a quad in registers (no dequantized copy anywhere),
//     or, with int8 activations on a VNNI CPU, runs integer dot products (linear_int4_q8 below);
//   - prefill: a K block of the panel is dequantized once into the L1 buffer and reused by every tile.
// The other group heads (ops::LinearWeight::group_head) replace the zeros:
//   Symmetric (GGUF Q4_0, symmetric GPTQ / AWQ / compressed-tensors): scales [32] fp16 | quads;  w = (q - 8) * scale
//   Offsets (GGUF Q4_1):  scales [32] fp16 | offsets [32] fp16 | quads;          w = q * scale + offset
//   KQuant (GGUF Q4_K, g = 256: a super-block of 8 sub-blocks of 32):
//                         d [32] fp16 | dmin [32] fp16 | sc [8][32] u8 | m [8][32] u8 | quads;
//                         sub-block b: w = q * (d * sc[b]) - dmin * m[b]   (both products exact in fp32: so is w)
//                         4.625 bits per weight, the file's 4.5 but for sc and m in whole bytes
//   Mxfp4 (OCP MXFP4, g = 32):  f [32] u8 | quads;   w = e2m1x2[q] * 2^(f - 127)   (a table lookup of the code,
//                         exact in fp32: twice an e2m1 value is an integer in -12..12)
//   Nvfp4 (NVFP4, g = 32: two blocks of 16):  s [2][32] fp16 | quads;   sub-block b: w = e2m1x2[q] * s[b] (exact in
//                         fp32; the tensor's output_scale is applied to the layer's outputs by the caller)
constexpr int64_t kI4Quad = 64;      // 4 k x 32 columns of nibbles
constexpr int64_t kKQuantSub = kLinearKQuantSub;  // inputs of a K-quant sub-block
constexpr int64_t kKQuantSc = kPanel * 4, kKQuantM = kPanel * 12;  // where a K-quant head's sc and m start
constexpr int64_t kNvfp4Sub = 16;  // inputs of an NVFP4 block (half an Nvfp4 group)
// Inputs that share one scale and offset: a K-quant head's sub-block, else the whole group.
inline int64_t i4_sub_size(int64_t g, GroupHead head) {
  return head == GroupHead::KQuant ? kKQuantSub : head == GroupHead::Nvfp4 ? kNvfp4Sub : g;
}

// Sub-block sb's scale and -zero * scale (its offset; -dmin * m) per column vector.
__attribute__((always_inline)) inline void i4_group_params(const uint8_t* blk, GroupHead head, int64_t sb, V s[kNV],
                                                           V nzs[kNV]) {
  for (int v = 0; v < kNV; ++v) {
    if (head == GroupHead::Mxfp4) {
      s[v] = vload_exp2(blk + v * kW), nzs[v] = vzero();
      continue;
    }
    if (head == GroupHead::Nvfp4) {
      s[v] = vload_f16((const uint16_t*)blk + sb * kPanel + v * kW), nzs[v] = vzero();
      continue;
    }
    s[v] = vload_f16((const uint16_t*)blk + v * kW);
    if (head == GroupHead::Zeros) {
      nzs[v] = vzero() - s[v] * vload_u8(blk + kPanel * 2 + v * kW);
    } else if (head == GroupHead::Symmetric) {
      nzs[v] = s[v] * vset1(-8.0f);
    } else if (head == GroupHead::Offsets) {
      nzs[v] = vload_f16((const uint16_t*)(blk + kPanel * 2) + v * kW);
    } else {
      s[v] = s[v] * vload_u8(blk + kKQuantSc + sb * kPanel + v * kW);
      nzs[v] = vzero() - vload_f16((const uint16_t*)(blk + kPanel * 2) + v * kW) *
                             vload_u8(blk + kKQuantM + sb * kPanel + v * kW);
    }
  }
}
// The 32 dequantized weights of k = 4t + i of a quad (Mxfp4 and Nvfp4 heads: the codes' twice-e2m1 values times the
// scale).
__attribute__((always_inline)) inline void i4_row(const uint8_t* quad, int i, GroupHead head, const V s[kNV],
                                                  const V nzs[kNV], V w[kNV]) {
  if (head == GroupHead::Mxfp4 || head == GroupHead::Nvfp4) {
    for (int h = 0; h < kNV / 2; ++h) vload_dword_e2m1(quad + h * kW * 4, 8 * i, w[h], w[h + kNV / 2]);
    for (int v = 0; v < kNV; ++v) w[v] = w[v] * s[v];
    return;
  }
  for (int h = 0; h < kNV / 2; ++h) vload_dword_nibbles(quad + h * kW * 4, 8 * i, w[h], w[h + kNV / 2]);
  for (int v = 0; v < kNV; ++v) w[v] = vfma(w[v], s[v], nzs[v]);
}

// ------------------------------------------------------------------------------------------- int8
// The int8 panels of ops::LinearWeight (GGUF Q8_0, or a float weight rounded per 32 values): per panel,
// K / 32 blocks of
//   scales [32] fp16 | 8 quads of 128 bytes
// quad t, half h (columns 16h..16h+15): 16 little-endian 32-bit lanes, byte i of lane j = q[4t + i, 16h + j] + 128
// (VNNI's operand layout, for the int8-activation kernel below). With fp32 activations each k is one shift and
// mask per vector: w[k, j] = (u8 - 128) * d = fma(u8, d, -128 d), exact in fp32 (an 8-bit integer times an
// fp16 scale), so this path gives the exact product of the stored weight, as the int4 one does.
// Blocks of 16 (GGUF Q6_K: d * sc, exact in fp32) hold fp32 scales and 4 quads: scales [32] fp32 | 4 quads.
// Offset heads (GroupHead::Offsets, GGUF Q5_K, blocks of 32): scales [32] fp32 | offsets [32] fp32 | 8 quads;
// w = (u8 - 128) * d + offset = fma(u8, d, offset - 128 d).
constexpr int64_t kI8Block = 32;
constexpr int64_t kI8Head = kPanel * 2;  // fp16 scales
constexpr int64_t kI8Quad = 128;         // 4 k x 32 columns of bytes
constexpr int64_t kI8BlockBytes = kI8Head + kI8Block / 4 * kI8Quad;
inline int64_t i8_head_bytes(int64_t g, GroupHead head) {
  return head == GroupHead::Offsets ? kPanel * 8 : g == 16 ? kPanel * 4 : kI8Head;
}
inline int64_t i8_block_bytes(int64_t g, GroupHead head) { return i8_head_bytes(g, head) + g / 4 * kI8Quad; }

__attribute__((always_inline)) inline void i8_block_params(const uint8_t* blk, int64_t g, GroupHead head, V s[kNV],
                                                           V nzs[kNV]) {
  for (int v = 0; v < kNV; ++v) {
    s[v] = g == 16 || head == GroupHead::Offsets ? vload((const float*)blk + v * kW)
                                                 : vload_f16((const uint16_t*)blk + v * kW);
    nzs[v] = s[v] * vset1(-128.0f);
    if (head == GroupHead::Offsets) nzs[v] = nzs[v] + vload((const float*)blk + kPanel + v * kW);
  }
}
// The 32 dequantized weights of k = 4t + i of a quad: columns v * kW.. lie in half v * kW / 16.
__attribute__((always_inline)) inline void i8_row(const uint8_t* quad, int i, const V s[kNV], const V nzs[kNV], V w[kNV]) {
  for (int v = 0; v < kNV; ++v) {
    const int col = v * kW;
    w[v] = vfma(vload_dword_byte(quad + (col / 16) * 64 + (col % 16) * 4, 8 * i), s[v], nzs[v]);
  }
}

// ------------------------------------------------------------------------------------------- int6
// The 6-bit panels of ops::LinearWeight Int6 (GGUF Q6_K, lossless at 6.5625 bits per weight, as the file): per
// panel, K / 256 super-blocks of
//   d [32] fp16 | sc [16][32] s8 | 32 octets of 192 bytes
// octet o (k = 8o .. 8o + 7): quads A (k 8o .. 8o + 3) and B (8o + 4 .. 8o + 7) of low nibbles laid out as the int4
// quads (byte i of lane j: lo4(u[k, j]) | lo4(u[k, j + 16]) << 4), then a plane of their high bits: byte i of lane j =
// hi2(uA[i, j]) | hi2(uA[i, j + 16]) << 2 | hi2(uB[i, j]) << 4 | hi2(uB[i, j + 16]) << 6.
// u in 0..63; sub-block b (16 k): w = (u - 32) * (d * sc[b]) = fma(u, s, -32 s), exact in fp32 (an fp16 value times
// an 8-bit integer, times a 6-bit one).
constexpr int64_t kI6Group = kLinearInt6Group, kI6Sub = kLinearInt6Sub, kI6Octet = kLinearInt6OctetBytes;
constexpr int64_t kI6Head = kLinearInt6HeadBytes, kI6GroupBytes = kLinearInt6GroupBytes;

__attribute__((always_inline)) inline void i6_sub_params(const uint8_t* blk, int64_t sb, V s[kNV], V nzs[kNV]) {
  for (int v = 0; v < kNV; ++v) {
    s[v] = vload_f16((const uint16_t*)blk + v * kW) * vload_s8(blk + kPanel * 2 + sb * kPanel + v * kW);
    nzs[v] = s[v] * vset1(-32.0f);
  }
}
// The 32 dequantized weights of k = 8o + i of an octet.
__attribute__((always_inline)) inline void i6_row(const uint8_t* octet, int i, const V s[kNV], const V nzs[kNV],
                                                  V w[kNV]) {
  const uint8_t* quad = octet + (i / 4) * kI4Quad;
  const int shift = 8 * (i % 4), hshift = shift + 4 * (i / 4);
  for (int h = 0; h < kNV / 2; ++h)
    vload_dword_sixes(quad + h * kW * 4, octet + 2 * kI4Quad + h * kW * 4, shift, hshift, w[h], w[h + kNV / 2]);
  for (int v = 0; v < kNV; ++v) w[v] = vfma(w[v], s[v], nzs[v]);
}

// What the fp32-activation kernels need of a quantized panel format (BITS 4: int4 groups of g, their heads of
// any form; BITS 8: int8 blocks of g = 32 or 16, offset heads or none; BITS 6: int6 super-blocks, g = 256): a group's
// bytes, its head, the inputs that share one scale (sub), one unit of kRows k (kQuad bytes), and its dequantized rows.
template <int BITS>
struct QuantPanel;
template <>
struct QuantPanel<4> {
  static constexpr int64_t kQuad = kI4Quad;
  static constexpr int kRows = 4;
  static int64_t group_bytes(int64_t g, GroupHead head) { return linear_int4_group_bytes(g, head); }
  static int64_t head_bytes(int64_t, GroupHead head) { return linear_int4_head_bytes(head); }
  static int64_t sub(int64_t g, GroupHead head) { return i4_sub_size(g, head); }
  __attribute__((always_inline)) static void params(const uint8_t* blk, int64_t, GroupHead head, int64_t sb, V s[kNV],
                                                    V nzs[kNV]) {
    i4_group_params(blk, head, sb, s, nzs);
  }
  __attribute__((always_inline)) static void row(const uint8_t* quad, int i, GroupHead head, const V s[kNV],
                                                 const V nzs[kNV], V w[kNV]) {
    i4_row(quad, i, head, s, nzs, w);
  }
};
template <>
struct QuantPanel<8> {
  static constexpr int64_t kQuad = kI8Quad;
  static constexpr int kRows = 4;
  static int64_t group_bytes(int64_t g, GroupHead head) { return i8_block_bytes(g, head); }
  static int64_t head_bytes(int64_t g, GroupHead head) { return i8_head_bytes(g, head); }
  static int64_t sub(int64_t g, GroupHead) { return g; }
  __attribute__((always_inline)) static void params(const uint8_t* blk, int64_t g, GroupHead head, int64_t, V s[kNV],
                                                    V nzs[kNV]) {
    i8_block_params(blk, g, head, s, nzs);
  }
  __attribute__((always_inline)) static void row(const uint8_t* quad, int i, GroupHead, const V s[kNV],
                                                 const V nzs[kNV], V w[kNV]) {
    i8_row(quad, i, s, nzs, w);
  }
};
template <>
struct QuantPanel<6> {
  static constexpr int64_t kQuad = kI6Octet;
  static constexpr int kRows = 8;
  static int64_t group_bytes(int64_t, GroupHead) { return kI6GroupBytes; }
  static int64_t head_bytes(int64_t, GroupHead) { return kI6Head; }
  static int64_t sub(int64_t, GroupHead) { return kI6Sub; }
  __attribute__((always_inline)) static void params(const uint8_t* blk, int64_t, GroupHead, int64_t sb, V s[kNV],
                                                    V nzs[kNV]) {
    i6_sub_params(blk, sb, s, nzs);
  }
  __attribute__((always_inline)) static void row(const uint8_t* octet, int i, GroupHead, const V s[kNV],
                                                 const V nzs[kNV], V w[kNV]) {
    i6_row(octet, i, s, nzs, w);
  }
};

// c[i, 0:ncols] = bias + x[i, 0:K] . W_panel for i < MR, dequantizing in registers (groups of g along K); one FMA
// chain per accumulator, as panel_tile (batch-invariant: the same bits as the converted path's panel_tile).
template <int BITS, int MR>
inline void qpanel_tile(const float* x, int64_t ldx, const uint8_t* panel, int64_t K, int64_t g, GroupHead head,
                        float* c, int64_t ldc, int ncols, const float* bias) {
  using P = QuantPanel<BITS>;
  V acc[MR][kNV];
  for (int i = 0; i < MR; ++i)
    for (int v = 0; v < kNV; ++v) acc[i][v] = vzero();
  const int64_t gb = P::group_bytes(g, head), hb = P::head_bytes(g, head), sub = P::sub(g, head);
  for (int64_t k0 = 0; k0 < K; k0 += g) {
    const uint8_t* blk = panel + (k0 / g) * gb;
    V s[kNV], nzs[kNV];
    constexpr int R = P::kRows;
    for (int64_t t = 0; t < g / R; ++t) {
      if (t % (sub / R) == 0) P::params(blk, g, head, R * t / sub, s, nzs);
      const uint8_t* quad = blk + hb + t * P::kQuad;
      for (int64_t off = 0; off < P::kQuad; off += 64) prefetch(quad + off + kPrefetchBytes);
#pragma GCC unroll 2
      for (int r = 0; r < R; ++r) {
        V w[kNV];
        P::row(quad, r, head, s, nzs, w);
#pragma GCC unroll 16
        for (int i = 0; i < MR; ++i) {
          const V a = vset1(x[i * ldx + k0 + R * t + r]);
          for (int v = 0; v < kNV; ++v) acc[i][v] = vfma(a, w[v], acc[i][v]);
        }
      }
    }
  }
  for (int i = 0; i < MR; ++i) {
    float* ci = c + i * ldc;
    for (int v = 0; v < kNV; ++v) {
      V sum = acc[i][v];
      const int j = v * kW, n = ncols - j < kW ? ncols - j : kW;
      if (n <= 0) break;
      if (bias) sum = sum + vload(bias + j);
      if (n == kW) vstore(ci + j, sum);
      else vstore_n(ci + j, sum, n);
    }
  }
}

template <int BITS, int MR = kMRMax>
inline void qpanel_tile_n(int mr, const float* x, int64_t ldx, const uint8_t* panel, int64_t K, int64_t g,
                          GroupHead head, float* c, int64_t ldc, int ncols, const float* bias) {
  if (mr == MR) qpanel_tile<BITS, MR>(x, ldx, panel, K, g, head, c, ldc, ncols, bias);
  else if constexpr (MR > 1) qpanel_tile_n<BITS, MR - 1>(mr, x, ldx, panel, K, g, head, c, ldc, ncols, bias);
}

// bp[k][j] = w[k0 + k, j] as fp32 for k < kc (k0 and kc multiples of g).
template <int BITS>
inline void qpanel_convert(const uint8_t* panel, int64_t g, GroupHead head, int64_t k0, int64_t kc, float* bp) {
  using P = QuantPanel<BITS>;
  const int64_t gb = P::group_bytes(g, head), hb = P::head_bytes(g, head), sub = P::sub(g, head);
  for (int64_t k = k0; k < k0 + kc; k += g) {
    const uint8_t* blk = panel + (k / g) * gb;
    V s[kNV], nzs[kNV];
    for (int64_t r = 0; r < g; ++r) {
      if (r % sub == 0) P::params(blk, g, head, r / sub, s, nzs);
      V w[kNV];
      P::row(blk + hb + r / P::kRows * P::kQuad, (int)(r % P::kRows), head, s, nzs, w);
      for (int v = 0; v < kNV; ++v) vstore(bp + (k - k0 + r) * kPanel + v * kW, w[v]);
    }
  }
}

constexpr int64_t kQuantConvertMinRows = 2 * kMRMax + 1;  // from here on, dequantizing into L1 once wins

// out = x @ w^T (+ bias) over quantized panels with fp32 activations: decode tiles dequantize in registers,
// prefill dequantizes one K block of a panel into L1 and reuses it for every tile.
template <int BITS>
void linear_qpanels(const float* x, int64_t M, const void* w, int64_t N, int64_t K, int64_t g, GroupHead head,
                    const float* bias, float* out) {
  const int64_t panel_bytes = K / g * QuantPanel<BITS>::group_bytes(g, head);
  const int64_t kcb = kKC / g * g;  // K block: whole groups
  const int64_t mblock = m_block_rows(K);
  const bool convert = (M < mblock ? M : mblock) >= kQuantConvertMinRows;
  for_each_panel(M, N, K, mblock, bias, [&](int64_t mb, int64_t rows, int64_t p, int ncols, const float* bias_tile,
                                            float* bp) {
    const uint8_t* panel = (const uint8_t*)w + p * panel_bytes;
    float* c = out + mb * N + p * kPanel;
    const float* xb = x + mb * K;
    if (!convert) {
      for_each_tile<kMRMax>(rows, [&](int64_t m, int mr) {
        qpanel_tile_n<BITS>(mr, xb + m * K, K, panel, K, g, head, c + m * N, N, ncols, bias_tile);
      });
      return;
    }
    for (int64_t k0 = 0; k0 < K; k0 += kcb) {
      const int64_t kc = K - k0 < kcb ? K - k0 : kcb;
      qpanel_convert<BITS>(panel, g, head, k0, kc, bp);
      panel_rows<(int)DType::F32, false, kMRTall>(xb + k0, K, rows, bp, kc, c, N, ncols, k0 == 0, k0 + kc == K,
                                                   bias_tile);
    }
  });
}

void linear_int4(const float* x, int64_t M, const void* w, int64_t N, int64_t K, int64_t g, GroupHead head,
                 const float* bias, float* out) {
  linear_qpanels<4>(x, M, w, N, K, g, head, bias, out);
}
void linear_int8(const float* x, int64_t M, const void* w, int64_t N, int64_t K, int64_t g, GroupHead head,
                 const float* bias, float* out) {
  linear_qpanels<8>(x, M, w, N, K, g, head, bias, out);
}
void linear_int6(const float* x, int64_t M, const void* w, int64_t N, int64_t K, const float* bias, float* out) {
  linear_qpanels<6>(x, M, w, N, K, kI6Group, GroupHead::Zeros, bias, out);
}

// ------------------------------------------------------------------ int4 x int8 (AVX-512 VNNI)
// llama.cpp's trick for bandwidth-bound decode: activations are quantized to int8 per block of 32
// (x ~ dx * qx, dx = max|x| / 127, round half to even), and each block of a panel is a sum of integer
// dot products, vpdpbusd(u8 weight nibbles, s8 activations), exact in int32; per block and column:
//   sum_k x[k] w[k, j] ~ dx * (scale_j * sum_k q[k, j] qx[k] - scale_j * zero_j * sum_k qx[k])
// The only approximation is the rounding of x (relative error ~ 1/254 per value, averaging out over K):
// the engine's fp32 path stays exact and is chosen with int8_activations=false. Prefill calls take
// the same kernel (AVX-512: 6-row tiles, the nibbles of a quad unpacked once per 12 dot products; a panel
// shared by several tiles is taken kQ8Span k at a time, see linear_q8), or on an AMX-INT8 CPU the tile kernel
// of impl_linear_q8_amx.h.
// The k range of one pass of a tile over its panel: [begin, end), whole groups of the panel; the tile's sums start
// at zero (first) or from what c holds, and end in c with the bias (last) or without. A tile prefetches its panel
// `prefetch` bytes ahead of its reads (kPrefetchBytes in a single pass; the next k range's bytes when the tiles of
// a panel take it range by range).
struct KSpan {
  int64_t begin, end, prefetch;
  bool first, last;
};

// 127 / amax, the factor that quantizes a block of max |x| = amax to int8 (both ISAs' q8 quantization): 0 for a
// zero block, and at most FLT_MAX (a block of max |x| under ~3.7e-37 would overflow it to infinity: every value to
// INT_MIN, saturated to -128 as int8 but not in the block's sum, which only the VNNI kernels take, so AMX tiles
// would differ from them).
inline float q8_inverse_scale(float amax) {
  const float inv = 127.0f / amax;
  return amax > 0.0f ? (inv < __FLT_MAX__ ? inv : __FLT_MAX__) : 0.0f;
}

#if defined(__AVX512F__)
#define LMKIT_VNNI __attribute__((target("avx512vnni")))
constexpr int kQ8Block = 32;
constexpr int kQ8MR = 6;  // rows per tile: 6 x (2 int32 + 2 fp32 accumulators) + operands in 32 zmm (4 rows: 10%
                          // slower at 16 streams, 8: spills)
constexpr bool kQ8SymmetricInit = false;  // see the AVX2 section
constexpr bool kQ8Nvfp4Sums = true;       // the NVFP4 tile's sums start at -kE2m1Offset x x's sums per 16

// Row x[0:K] -> qx[0:K] and, per block of `block` values (a multiple of 16: 32 here, the weight's group on
// AMX tiles), dx[K / block] and, unless sx is nullptr, sx[K / block] (the block's sum of qx, as float).
inline void q8_quantize_blocks(const float* x, int64_t K, int64_t block, int8_t* qx, float* dx, float* sx) {
  const __m512 sign = _mm512_set1_ps(-0.0f);
  for (int64_t b = 0; b < K / block; ++b) {
    const float* xb = x + b * block;
    __m512 m = _mm512_setzero_ps();
    for (int64_t i = 0; i < block; i += 16) m = _mm512_max_ps(m, _mm512_andnot_ps(sign, _mm512_loadu_ps(xb + i)));
    const float amax = _mm512_reduce_max_ps(m);
    const __m512 inv = _mm512_set1_ps(q8_inverse_scale(amax));
    __m512i sum = _mm512_setzero_si512();
    for (int64_t i = 0; i < block; i += 16) {
      const __m512i q = _mm512_cvtps_epi32(_mm512_mul_ps(_mm512_loadu_ps(xb + i), inv));
      _mm_storeu_si128((__m128i*)(qx + b * block + i), _mm512_cvtsepi32_epi8(q));
      sum = _mm512_add_epi32(sum, q);
    }
    dx[b] = amax / 127.0f;
    if (sx) sx[b] = (float)_mm512_reduce_add_epi32(sum);
  }
}
// Row x[0:K] -> qx[0:K], dx[K / 32], sx[K / 32].
inline void q8_quantize_row(const float* x, int64_t K, int8_t* qx, float* dx, float* sx) {
  q8_quantize_blocks(x, K, kQ8Block, qx, dx, sx);
}

// 16 bytes as fp32 lanes.
inline __m512 q8_u8x16(const uint8_t* p) {
  return _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i*)p)));
}

// c[i, 0:ncols] = tot[i] (+ bias) for the MR rows of a tile (two 16-column halves each).
template <int MR>
inline void q8_store(const __m512 (*tot)[2], float* c, int64_t ldc, int ncols, const float* bias) {
  for (int i = 0; i < MR; ++i)
    for (int v = 0; v < 2; ++v) {
      const int j = 16 * v, n = ncols - j < 16 ? ncols - j : 16;
      if (n <= 0) break;
      V sum = {tot[i][v]};
      if (bias) sum = sum + vload(bias + j);
      vstore_n(c + i * ldc + j, sum, n);
    }
}

// tot = zero for the first k range of a tile, else what c[i, 0:ncols] holds.
template <int MR>
inline void q8_begin(__m512 (*tot)[2], const float* c, int64_t ldc, int ncols, bool first) {
  for (int i = 0; i < MR; ++i)
    for (int v = 0; v < 2; ++v) {
      const int j = 16 * v, n = ncols - j < 16 ? ncols - j : 16;  // as q8_store
      tot[i][v] = first || n <= 0 ? _mm512_setzero_ps() : vload_n(c + i * ldc + j, n).v;
    }
}

// HEAD Zeros: each block's integer sums start at -zero * sum_k qx[k] (exact in int32: |.| <= 15 * 32 * 127), so that
// the block ends as sum_k (q - zero) qx and takes one multiply-add by dx * scale: two fewer floating-point operations
// per accumulator and block than a correction in fp32, on the ports the dot products use. HEAD Symmetric: they start
// at -8 * sum_k qx[k], one broadcast per row: no zeros to load and no vpmulld (which takes a dot product's slot;
// +10% for an L1-resident tile on Zen 5).
// XG (Zeros and Symmetric heads, g > 32, in every call: ops.h): x quantized per weight group (dx and sx per row and
// group), so that the integer sums run over the whole group, from -zero * sx (a vpmaddwd per accumulator and group:
// one per 32 dot products at g = 128; |sx| <= 128 * 127 fits int16) or -8 * sx, and take the floating-point work
// once per group instead of once per block of 32: that work shares the dot products' ports, and per block it cost a
// 6-row tile about a quarter of its time. AMX tiles quantize x so too and take each group's sum (q - zero) qx into
// fp32 in the same order, so a row gets the same bits on either kernel.
constexpr bool kQ8GroupX = true;
// HEAD Mxfp4: a byte shuffle maps each code to its twice-e2m1 value plus kE2m1Offset (0..24, an unsigned operand of
// vpdpbusd), and the sums start at -kE2m1Offset * sum_k qx[k], as Symmetric's at -8 * sum_k qx[k].
// HEAD Nvfp4: the same codes in two blocks of 16 per group, each with its own scale: sx then holds the sums of qx
// per 16, and the sums of the first block are taken into tot after its 4 quads and start again for the second.
constexpr int32_t kE2m1Offset = 12;
inline __m512i e2m1_offset_table() {
  return _mm512_broadcast_i32x4(
      _mm_add_epi8(_mm_loadu_si128((const __m128i*)kE2m1Twice), _mm_set1_epi8((char)kE2m1Offset)));
}
template <int MR, GroupHead HEAD, bool XG = false>
LMKIT_VNNI inline void q8_tile(const int8_t* qx, const float* dx, const float* sx, int64_t K, const uint8_t* panel,
                               int64_t g, float* c, int64_t ldc, int ncols, const float* bias, KSpan span) {
  static_assert(!XG || HEAD == GroupHead::Zeros || HEAD == GroupHead::Symmetric, "XG: Zeros and Symmetric heads");
  const int64_t nb = XG ? K / g : K / kQ8Block, ng = K / g, n16 = K / kNvfp4Sub;
  const int64_t gb = linear_int4_group_bytes(g, HEAD), hb = linear_int4_head_bytes(HEAD);
  const __m512i low4 = _mm512_set1_epi8(0x0f), e2m1 = e2m1_offset_table();
  __m512 tot[MR][2];
  q8_begin<MR>(tot, c, ldc, ncols, span.first);
  const uint8_t* blk = panel + span.begin / g * gb;
  for (int64_t k0 = span.begin; k0 < span.end; k0 += g, blk += gb) {
    __m512 s[2], zs[2], h0[2], h1[2];  // zs: minus the offset, or dmin * m; h0, h1: d, dmin
    __m512i z[2];                      // the zeros
    for (int v = 0; v < 2; ++v) {
      if constexpr (HEAD == GroupHead::Mxfp4) {
        s[v] = vload_exp2(blk + 16 * v).v;
        continue;
      }
      s[v] = h0[v] = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)(blk + 32 * v)));
      if constexpr (HEAD == GroupHead::Nvfp4) {  // h1: the second block's scales
        h1[v] = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)(blk + 64 + 32 * v)));
        continue;
      }
      if constexpr (HEAD == GroupHead::Zeros) {
        z[v] = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i*)(blk + 64 + 16 * v)));
      } else if constexpr (HEAD != GroupHead::Symmetric) {
        h1[v] = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)(blk + 64 + 32 * v)));
        zs[v] = _mm512_sub_ps(_mm512_setzero_ps(), h1[v]);
      }
    }
    __m512i acc[MR][2];
    if constexpr (XG)  // a group's sums: from -zero (Symmetric: -8) * sum_k qx[k] over the group
      for (int i = 0; i < MR; ++i) {
        const int32_t sum = (int32_t)sx[i * ng + k0 / g];
        if constexpr (HEAD == GroupHead::Symmetric) {
          acc[i][0] = acc[i][1] = _mm512_set1_epi32(-8 * sum);
        } else {  // zero * -sum as vpmaddwd of (zero, 0) and (-sum, 0) int16 pairs: one uop, where vpmulld takes two
          const __m512i nsum = _mm512_set1_epi32((int32_t)(uint16_t)(int16_t)-sum);
          acc[i][0] = _mm512_madd_epi16(z[0], nsum), acc[i][1] = _mm512_madd_epi16(z[1], nsum);
        }
      }
    for (int64_t b = 0; b < g / kQ8Block; ++b) {
      const int64_t kb = k0 / kQ8Block + b;
      if constexpr (HEAD == GroupHead::KQuant)  // sub-block b: d * sc[b], dmin * m[b]
        for (int v = 0; v < 2; ++v) {
          s[v] = _mm512_mul_ps(h0[v], q8_u8x16(blk + kKQuantSc + b * kPanel + 16 * v));
          zs[v] = _mm512_mul_ps(h1[v], q8_u8x16(blk + kKQuantM + b * kPanel + 16 * v));
        }
      for (int i = 0; i < MR && !XG; ++i) {
        if constexpr (HEAD == GroupHead::Zeros) {
          const __m512i nsum = _mm512_set1_epi32(-(int32_t)sx[i * nb + kb]);
          acc[i][0] = _mm512_mullo_epi32(z[0], nsum), acc[i][1] = _mm512_mullo_epi32(z[1], nsum);
        } else if constexpr (HEAD == GroupHead::Symmetric) {
          acc[i][0] = acc[i][1] = _mm512_set1_epi32(-8 * (int32_t)sx[i * nb + kb]);
        } else if constexpr (HEAD == GroupHead::Mxfp4) {
          acc[i][0] = acc[i][1] = _mm512_set1_epi32(-kE2m1Offset * (int32_t)sx[i * nb + kb]);
        } else if constexpr (HEAD == GroupHead::Nvfp4) {
          acc[i][0] = acc[i][1] = _mm512_set1_epi32(-kE2m1Offset * (int32_t)sx[i * n16 + 2 * kb]);
        } else {
          acc[i][0] = acc[i][1] = _mm512_setzero_si512();
        }
      }
      const uint8_t* quads = blk + hb + b * (kQ8Block / 4) * kI4Quad;
#pragma GCC unroll 8
      for (int t = 0; t < kQ8Block / 4; ++t) {
        if constexpr (HEAD == GroupHead::Nvfp4)
          if (t == kNvfp4Sub / 4)  // the first block's sums into tot; the second's start
            for (int i = 0; i < MR; ++i) {
              const __m512 d = _mm512_set1_ps(dx[i * nb + kb]);
              for (int v = 0; v < 2; ++v)
                tot[i][v] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(acc[i][v]), _mm512_mul_ps(d, s[v]), tot[i][v]);
              acc[i][0] = acc[i][1] = _mm512_set1_epi32(-kE2m1Offset * (int32_t)sx[i * n16 + 2 * kb + 1]);
            }
        const __m512i raw = _mm512_loadu_si512(quads + t * kI4Quad);
        _mm_prefetch((const char*)(quads + t * kI4Quad + span.prefetch), _MM_HINT_T0);
        __m512i lo = _mm512_and_si512(raw, low4), hi = _mm512_and_si512(_mm512_srli_epi16(raw, 4), low4);
        if constexpr (HEAD == GroupHead::Mxfp4 || HEAD == GroupHead::Nvfp4)
          lo = _mm512_shuffle_epi8(e2m1, lo), hi = _mm512_shuffle_epi8(e2m1, hi);
        for (int i = 0; i < MR; ++i) {
          int32_t q4;
          memcpy(&q4, qx + i * K + kb * kQ8Block + 4 * t, 4);
          const __m512i xq = _mm512_set1_epi32(q4);
          acc[i][0] = _mm512_dpbusd_epi32(acc[i][0], lo, xq);
          acc[i][1] = _mm512_dpbusd_epi32(acc[i][1], hi, xq);
        }
      }
      for (int i = 0; i < MR && !XG; ++i) {
        const __m512 d = _mm512_set1_ps(dx[i * nb + kb]);
        if constexpr (HEAD == GroupHead::Zeros || HEAD == GroupHead::Symmetric || HEAD == GroupHead::Mxfp4) {
          for (int v = 0; v < 2; ++v)
            tot[i][v] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(acc[i][v]), _mm512_mul_ps(d, s[v]), tot[i][v]);
        } else if constexpr (HEAD == GroupHead::Nvfp4) {
          for (int v = 0; v < 2; ++v)
            tot[i][v] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(acc[i][v]), _mm512_mul_ps(d, h1[v]), tot[i][v]);
        } else {
          const __m512 sum = _mm512_set1_ps(sx[i * nb + kb]);
          for (int v = 0; v < 2; ++v) {
            const __m512 f = _mm512_fnmadd_ps(zs[v], sum, _mm512_mul_ps(_mm512_cvtepi32_ps(acc[i][v]), s[v]));
            tot[i][v] = _mm512_fmadd_ps(d, f, tot[i][v]);
          }
        }
      }
    }
    if constexpr (XG)
      for (int i = 0; i < MR; ++i) {
        const __m512 d = _mm512_set1_ps(dx[i * ng + k0 / g]);
        for (int v = 0; v < 2; ++v)
          tot[i][v] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(acc[i][v]), _mm512_mul_ps(d, s[v]), tot[i][v]);
      }
  }
  q8_store<MR>(tot, c, ldc, ncols, span.last ? bias : nullptr);
}

// The same for an int8 panel (ops::LinearWeight Int8): per G-k block (G = 32: fp16 scales, or fp32 scales and
// offsets when OFFSETS; 16: fp32 scales), the head then G / 4 quads x 2 halves (columns 0-15, 16-31) of
// u8 = q + 128, so that
//   sum_k q[k, j] qx[k] = sum_k u8[k, j] qx[k] - 128 * sum_k qx[k]      (exact in int32 / fp32)
// and an offset o adds o * sum_k qx[k]. sx: the sums of qx per G values (dx stays per 32).
template <int MR, int G, bool OFFSETS = false>
LMKIT_VNNI inline void q8_tile_i8(const int8_t* qx, const float* dx, const float* sx, int64_t K,
                                  const uint8_t* panel, float* c, int64_t ldc, int ncols, const float* bias,
                                  KSpan span) {
  constexpr GroupHead kHead = OFFSETS ? GroupHead::Offsets : GroupHead::Zeros;
  const int64_t nb = K / kQ8Block, ng = K / G, block_bytes = i8_block_bytes(G, kHead), hb = i8_head_bytes(G, kHead);
  __m512 tot[MR][2];
  q8_begin<MR>(tot, c, ldc, ncols, span.first);
  const __m512 m128 = _mm512_set1_ps(128.0f);
  for (int64_t kg = span.begin / G; kg < span.end / G; ++kg) {
    const uint8_t* blk = panel + kg * block_bytes;
    const int64_t kb = kg * G / kQ8Block;
    __m512 d[2], o[2];
    for (int v = 0; v < 2; ++v) {
      d[v] = G == 16 || OFFSETS ? _mm512_loadu_ps((const float*)blk + 16 * v)
                                : _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)(blk + 32 * v)));
      if constexpr (OFFSETS) o[v] = _mm512_loadu_ps((const float*)blk + kPanel + 16 * v);
    }
    __m512i acc[MR][2];
    for (int i = 0; i < MR; ++i) acc[i][0] = acc[i][1] = _mm512_setzero_si512();
    const uint8_t* quads = blk + hb;
#pragma GCC unroll 8
    for (int t = 0; t < G / 4; ++t) {
      const __m512i w0 = _mm512_loadu_si512(quads + t * 128), w1 = _mm512_loadu_si512(quads + t * 128 + 64);
      _mm_prefetch((const char*)(quads + t * 128 + span.prefetch), _MM_HINT_T0);
      _mm_prefetch((const char*)(quads + t * 128 + 64 + span.prefetch), _MM_HINT_T0);
      for (int i = 0; i < MR; ++i) {
        int32_t q4;
        memcpy(&q4, qx + i * K + kg * G + 4 * t, 4);
        const __m512i xq = _mm512_set1_epi32(q4);
        acc[i][0] = _mm512_dpbusd_epi32(acc[i][0], w0, xq);
        acc[i][1] = _mm512_dpbusd_epi32(acc[i][1], w1, xq);
      }
    }
    for (int i = 0; i < MR; ++i) {
      const __m512 dxi = _mm512_set1_ps(dx[i * nb + kb]), sxi = _mm512_set1_ps(sx[i * ng + kg]);
      const __m512 corr = _mm512_mul_ps(m128, sxi);
      for (int v = 0; v < 2; ++v) {
        const __m512 f = _mm512_sub_ps(_mm512_cvtepi32_ps(acc[i][v]), corr);
        __m512 sum = _mm512_mul_ps(f, d[v]);
        if constexpr (OFFSETS) sum = _mm512_fmadd_ps(o[v], sxi, sum);
        tot[i][v] = _mm512_fmadd_ps(dxi, sum, tot[i][v]);
      }
    }
  }
  q8_store<MR>(tot, c, ldc, ncols, span.last ? bias : nullptr);
}

// The same for an int6 panel (ops::LinearWeight Int6): per octet the 6-bit values of quads A and B are put together
// in registers (nibbles | high pairs << 4, u8 in 0..63), two vpdpbusd per half; per sub-block of 16,
//   sum_k (u - 32) s qx = s * (sum_k u qx - 32 sum_k qx)     (exact in int32 / fp32)
// with sx the sums of qx per 16 values (dx stays per 32).
template <int MR>
LMKIT_VNNI inline void q8_tile_i6(const int8_t* qx, const float* dx, const float* sx, int64_t K, const uint8_t* panel,
                                  float* c, int64_t ldc, int ncols, const float* bias, KSpan span) {
  const int64_t nb = K / kQ8Block, ns = K / kI6Sub;
  const __m512i low4 = _mm512_set1_epi8(0x0f), high2 = _mm512_set1_epi8(0x30);
  const __m512 m32 = _mm512_set1_ps(32.0f);
  __m512 tot[MR][2];
  q8_begin<MR>(tot, c, ldc, ncols, span.first);
  for (int64_t k0 = span.begin; k0 < span.end; k0 += kI6Group) {
    const uint8_t* blk = panel + (k0 / kI6Group) * kI6GroupBytes;
    __m512 d[2];
    for (int v = 0; v < 2; ++v) d[v] = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)(blk + 32 * v)));
    for (int64_t b = 0; b < kI6Group / kI6Sub; ++b) {
      __m512i acc[MR][2];
      for (int i = 0; i < MR; ++i) acc[i][0] = acc[i][1] = _mm512_setzero_si512();
#pragma GCC unroll 2
      for (int o = 0; o < 2; ++o) {
        const uint8_t* oct = blk + kI6Head + (2 * b + o) * kI6Octet;
        for (int64_t off = 0; off < kI6Octet; off += 64) _mm_prefetch((const char*)(oct + off + span.prefetch), _MM_HINT_T0);
        const __m512i qa = _mm512_loadu_si512(oct), qb = _mm512_loadu_si512(oct + 64), h = _mm512_loadu_si512(oct + 128);
        const __m512i al = _mm512_or_si512(_mm512_and_si512(qa, low4), _mm512_and_si512(_mm512_slli_epi16(h, 4), high2));
        const __m512i ah = _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi16(qa, 4), low4),
                                           _mm512_and_si512(_mm512_slli_epi16(h, 2), high2));
        const __m512i bl = _mm512_or_si512(_mm512_and_si512(qb, low4), _mm512_and_si512(h, high2));
        const __m512i bh = _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi16(qb, 4), low4),
                                           _mm512_and_si512(_mm512_srli_epi16(h, 2), high2));
        const int64_t k = k0 + b * kI6Sub + 8 * o;
        for (int i = 0; i < MR; ++i) {
          int32_t xa, xb;
          memcpy(&xa, qx + i * K + k, 4);
          memcpy(&xb, qx + i * K + k + 4, 4);
          const __m512i va = _mm512_set1_epi32(xa), vb = _mm512_set1_epi32(xb);
          acc[i][0] = _mm512_dpbusd_epi32(_mm512_dpbusd_epi32(acc[i][0], al, va), bl, vb);
          acc[i][1] = _mm512_dpbusd_epi32(_mm512_dpbusd_epi32(acc[i][1], ah, va), bh, vb);
        }
      }
      __m512 sv[2];
      for (int v = 0; v < 2; ++v)
        sv[v] = _mm512_mul_ps(d[v], _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(
                                        _mm_loadu_si128((const __m128i*)(blk + kPanel * 2 + b * kPanel + 16 * v)))));
      const int64_t kb = (k0 + b * kI6Sub) / kQ8Block, ks = (k0 + b * kI6Sub) / kI6Sub;
      for (int i = 0; i < MR; ++i) {
        const __m512 dxi = _mm512_set1_ps(dx[i * nb + kb]), sxi = _mm512_set1_ps(sx[i * ns + ks]);
        for (int v = 0; v < 2; ++v) {
          const __m512 f = _mm512_fnmadd_ps(m32, sxi, _mm512_cvtepi32_ps(acc[i][v]));
          tot[i][v] = _mm512_fmadd_ps(_mm512_mul_ps(dxi, sv[v]), f, tot[i][v]);
        }
      }
    }
  }
  q8_store<MR>(tot, c, ldc, ncols, span.last ? bias : nullptr);
}

// BITS 4: int4 panels with group size g; BITS 8: int8 panels of blocks of g (sx then per g values); BITS 6: int6
// panels (sx per 16).
// xg: x quantized per group (q8_tile's XG; Zeros and Symmetric heads of g > 32 only).
template <int BITS, int MR = kQ8MR>
LMKIT_VNNI inline void q8_tile_n(int mr, const int8_t* qx, const float* dx, const float* sx, int64_t K,
                                 const uint8_t* panel, int64_t g, GroupHead head, bool xg, float* c, int64_t ldc,
                                 int ncols, const float* bias, KSpan span) {
  if (mr == MR) {
    if constexpr (BITS == 4) {
      if (head == GroupHead::Zeros && xg)
        q8_tile<MR, GroupHead::Zeros, true>(qx, dx, sx, K, panel, g, c, ldc, ncols, bias, span);
      else if (head == GroupHead::Zeros)
        q8_tile<MR, GroupHead::Zeros>(qx, dx, sx, K, panel, g, c, ldc, ncols, bias, span);
      else if (head == GroupHead::Symmetric && xg)
        q8_tile<MR, GroupHead::Symmetric, true>(qx, dx, sx, K, panel, g, c, ldc, ncols, bias, span);
      else if (head == GroupHead::Symmetric)
        q8_tile<MR, GroupHead::Symmetric>(qx, dx, sx, K, panel, g, c, ldc, ncols, bias, span);
      else if (head == GroupHead::Mxfp4) q8_tile<MR, GroupHead::Mxfp4>(qx, dx, sx, K, panel, g, c, ldc, ncols, bias, span);
      else if (head == GroupHead::Nvfp4)
        q8_tile<MR, GroupHead::Nvfp4>(qx, dx, sx, K, panel, g, c, ldc, ncols, bias, span);
      else if (head == GroupHead::Offsets) q8_tile<MR, GroupHead::Offsets>(qx, dx, sx, K, panel, g, c, ldc, ncols, bias, span);
      else q8_tile<MR, GroupHead::KQuant>(qx, dx, sx, K, panel, g, c, ldc, ncols, bias, span);
    }
    else if constexpr (BITS == 6) q8_tile_i6<MR>(qx, dx, sx, K, panel, c, ldc, ncols, bias, span);
    else if (g == 16) q8_tile_i8<MR, 16>(qx, dx, sx, K, panel, c, ldc, ncols, bias, span);
    else if (head == GroupHead::Offsets) q8_tile_i8<MR, 32, true>(qx, dx, sx, K, panel, c, ldc, ncols, bias, span);
    else q8_tile_i8<MR, 32>(qx, dx, sx, K, panel, c, ldc, ncols, bias, span);
  } else if constexpr (MR > 1) {
    q8_tile_n<BITS, MR - 1>(mr, qx, dx, sx, K, panel, g, head, xg, c, ldc, ncols, bias, span);
  }
}

#elif defined(__AVX2__)
// ------------------------------------------------------------------ int4 / int8 x int8 (AVX2)
// The same arithmetic without VNNI: vpmaddubsw(u8, s8) sums adjacent products into int16, vpmaddwd
// with ones sums those pairs into int32 (llama.cpp's AVX2 route). A 256-bit half of a quad holds lanes
// 0-7 or 8-15, so vector v of a panel row covers columns 8v..8v+7: v = 0, 1 the low nibbles of halves
// 0, 1; v = 2, 3 the high nibbles. int4: q <= 15 and |qx| <= 127, so a vpmaddubsw pair is at most
// 3,810 and the 8 quads of a 32-k block sum exactly in int16 (<= 30,480) before one widening per block.
// int8: s8 = u8 ^ 0x80 = q, and vpmaddubsw(|q|, sign(qx, q)) = q * qx per pair (<= 32,512), widened
// to int32 every quad. Exact in the integers, as the VNNI path.
#define LMKIT_VNNI
constexpr int kQ8Block = 32;
constexpr bool kQ8GroupX = false;  // x per block of 32 in every call
constexpr int kQ8MR = 4;  // rows per tile: int4, int8 and int6 tiles take 4 rows x 16 columns at a time (8
                          // accumulators), the MXFP4 one 2 rows x 32 columns, twice
// Symmetric int4 heads (GGUF Q4_0): the tiles start each block's int16 sums at -8 x x's pair sums
// (q8_symmetric_init) instead of subtracting 8 * scale * sum(x) per column in fp32 (a mul and an FMA per 8 columns,
// row and block: 5% of a Q4_0 prefill)
constexpr bool kQ8SymmetricInit = true;
constexpr bool kQ8Nvfp4Sums = false;  // the NVFP4 tile multiplies signed values (as MXFP4's): no sums of x

inline float q8_hmax(__m256 a) {
  __m128 m = _mm_max_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
  m = _mm_max_ps(m, _mm_movehl_ps(m, m));
  return _mm_cvtss_f32(_mm_max_ss(m, _mm_movehdup_ps(m)));
}
inline int32_t q8_hsum(__m256i a) {
  __m128i s = _mm_add_epi32(_mm256_castsi256_si128(a), _mm256_extracti128_si256(a, 1));
  s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0x4e));
  return _mm_cvtsi128_si32(_mm_add_epi32(s, _mm_shuffle_epi32(s, 0xb1)));
}

// Row x[0:K] -> qx[0:K], dx[K / 32], sx[K / 32] (sum of each block's qx, as float); as the AVX-512 path.
inline void q8_quantize_row(const float* x, int64_t K, int8_t* qx, float* dx, float* sx) {
  const __m256 sign = _mm256_set1_ps(-0.0f);
  const __m256i order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
  for (int64_t b = 0; b < K / kQ8Block; ++b) {
    __m256 a[4];
    __m256 m = _mm256_setzero_ps();
    for (int i = 0; i < 4; ++i) {
      a[i] = _mm256_loadu_ps(x + b * kQ8Block + 8 * i);
      m = _mm256_max_ps(m, _mm256_andnot_ps(sign, a[i]));
    }
    const float amax = q8_hmax(m);
    const float d = amax / 127.0f, inv = q8_inverse_scale(amax);
    __m256i q[4];
    for (int i = 0; i < 4; ++i) q[i] = _mm256_cvtps_epi32(_mm256_mul_ps(a[i], _mm256_set1_ps(inv)));
    // the packs work per 128-bit lane: dwords come out as q0[0:4] q1[0:4] q2[0:4] q3[0:4] q0[4:8] ...
    const __m256i p = _mm256_packs_epi16(_mm256_packs_epi32(q[0], q[1]), _mm256_packs_epi32(q[2], q[3]));
    _mm256_storeu_si256((__m256i*)(qx + b * kQ8Block), _mm256_permutevar8x32_epi32(p, order));
    dx[b] = d;
    sx[b] = (float)q8_hsum(_mm256_add_epi32(_mm256_add_epi32(q[0], q[1]), _mm256_add_epi32(q[2], q[3])));
  }
}
// linear_q8's call for x per `block` values: here blocks of 32 only (kQ8GroupX is false).
inline void q8_quantize_blocks(const float* x, int64_t K, int64_t block, int8_t* qx, float* dx, float* sx) {
  if (block == kQ8Block) q8_quantize_row(x, K, qx, dx, sx);
  else abort();
}

// 8 bytes as fp32 lanes.
inline __m256 q8_u8x8(const uint8_t* p) {
  return _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i*)p)));
}

// The int4 panels' heads as the AVX2 tiles take them: an offset or zero corrected in fp32 per block (Zeros, Offsets,
// KQuant), Symmetric (Q4_0: the sums start at -8 x x's pair sums, q8_symmetric_init), or MXFP4 codes.
enum class I4Tile { Affine, Symmetric, Mxfp4, Nvfp4 };

// tot[i][0:32] += this int4 panel's sums (group size g) for rows i < MR (up to 4), a half panel at a time: half h of
// a quad is 8 lanes whose low nibbles are columns 8h..8h+7 and high nibbles 16+8h.., so a block of 32 k is 8 quads x
// (1 load, 3 ops to unpack, per row 2 vpmaddubsw + 2 vpaddw) into 2 int16 accumulators per row, then per row and 8
// columns s * dx * (dot - zero * sx) in fp32. Four rows keep 8 accumulators, the two nibble vectors, the mask and
// a broadcast of x in registers; 2 rows x 32 columns (8 accumulators, 4 weight vectors) left GCC too few and it
// spilled most of them (1.5x slower). The empty asm keeps each accumulator one chain in a register (GCC otherwise
// re-associates the unrolled int16 adds into trees of temporaries, and spills).
// MXFP4: a byte shuffle maps each code to its twice-e2m1 value w (-12..12) and vpmaddubsw(|w|, sign(qx, w)) sums
// w * qx (pairs <= 3,048: a block sums exactly in int16 too); no zero, the scale a power of two per group.
// NVFP4: the same codes in two blocks of 16 per group, each with its fp16 scale: the first block's sums are taken
// into tot after its 4 quads and the accumulators start again for the second.
template <int MR, I4Tile KIND>
inline void q8_tile_i4(const int8_t* qx, const float* dx, const float* sx, int64_t K, const uint8_t* panel,
                       int64_t g, GroupHead head, float (*tot)[kPanel], KSpan span) {
  const int64_t nb = K / kQ8Block, gb = linear_int4_group_bytes(g, head), hb = linear_int4_head_bytes(head);
  const __m256i low4 = _mm256_set1_epi8(0x0f), ones = _mm256_set1_epi16(1);
  const __m256i e2m1 = _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i*)kE2m1Twice));
  for (int64_t k0 = span.begin; k0 < span.end; k0 += g) {
    const uint8_t* blk = panel + (k0 / g) * gb;
    for (int64_t b = 0; b < g / kQ8Block; ++b) {
      const int64_t kb = (k0 / kQ8Block) + b;
      const uint8_t* quads = blk + hb + b * (kQ8Block / 4) * kI4Quad;
      const int8_t* xb = qx + kb * kQ8Block;
      for (int h = 0; h < 2; ++h) {
        __m256i acc[MR][2];
        for (int i = 0; i < MR; ++i) {
          int32_t init = 0;  // Symmetric: sx holds q8_symmetric_init's int32s
          if constexpr (KIND == I4Tile::Symmetric) memcpy(&init, sx + i * nb + kb, 4);
          acc[i][0] = acc[i][1] = _mm256_set1_epi32(init);
        }
        // tot[i][8v..8v + 7] += dx * s_of(v) * the sums (v = h, h + 2), for the kinds whose sums are of the
        // weights' values (all but Affine); fp16_at(at): the fp16 scales at byte `at` of the group
        auto take = [&](auto s_of) {
          for (int n = 0; n < 2; ++n) {
            const int v = h + 2 * n;
            const __m256 s = s_of(v);
            for (int i = 0; i < MR; ++i) {
              const __m256 dot = _mm256_cvtepi32_ps(_mm256_madd_epi16(acc[i][n], ones));
              _mm256_storeu_ps(tot[i] + 8 * v, _mm256_fmadd_ps(_mm256_mul_ps(_mm256_set1_ps(dx[i * nb + kb]), s), dot,
                                                               _mm256_loadu_ps(tot[i] + 8 * v)));
            }
          }
        };
        auto fp16_at = [&](int64_t at) {
          return [&, at](int v) { return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)(blk + at + 16 * v))); };
        };
#pragma GCC unroll 8
        for (int t = 0; t < kQ8Block / 4; ++t) {
          if constexpr (KIND == I4Tile::Nvfp4)
            if (t == kNvfp4Sub / 4) {  // the first block's sums into tot; the second's start at zero
              take(fp16_at(0));
              for (int i = 0; i < MR; ++i) acc[i][0] = acc[i][1] = _mm256_setzero_si256();
            }
          if (h == 0) _mm_prefetch((const char*)(quads + t * kI4Quad + span.prefetch), _MM_HINT_T0);
          const __m256i raw = _mm256_loadu_si256((const __m256i*)(quads + t * kI4Quad + 32 * h));
          const __m256i lo = _mm256_and_si256(raw, low4), hi = _mm256_and_si256(_mm256_srli_epi16(raw, 4), low4);
          if constexpr (KIND == I4Tile::Mxfp4 || KIND == I4Tile::Nvfp4) {
            const __m256i wl = _mm256_shuffle_epi8(e2m1, lo), wh = _mm256_shuffle_epi8(e2m1, hi);
            const __m256i al = _mm256_abs_epi8(wl), ah = _mm256_abs_epi8(wh);
            for (int i = 0; i < MR; ++i) {
              int32_t q4;
              memcpy(&q4, xb + i * K + 4 * t, 4);
              const __m256i xq = _mm256_set1_epi32(q4);
              acc[i][0] = _mm256_add_epi16(acc[i][0], _mm256_maddubs_epi16(al, _mm256_sign_epi8(xq, wl)));
              acc[i][1] = _mm256_add_epi16(acc[i][1], _mm256_maddubs_epi16(ah, _mm256_sign_epi8(xq, wh)));
              __asm__("" : "+x"(acc[i][0]), "+x"(acc[i][1]));
            }
          } else {
            for (int i = 0; i < MR; ++i) {
              int32_t q4;
              memcpy(&q4, xb + i * K + 4 * t, 4);
              const __m256i xq = _mm256_set1_epi32(q4);
              acc[i][0] = _mm256_add_epi16(acc[i][0], _mm256_maddubs_epi16(lo, xq));
              acc[i][1] = _mm256_add_epi16(acc[i][1], _mm256_maddubs_epi16(hi, xq));
              __asm__("" : "+x"(acc[i][0]), "+x"(acc[i][1]));
            }
          }
        }
        if constexpr (KIND == I4Tile::Nvfp4) {  // the second block's scales
          take(fp16_at(2 * kPanel));
        } else if constexpr (KIND == I4Tile::Mxfp4) {
          take([&](int v) { return vload_exp2(blk + 8 * v).v; });
        } else if constexpr (KIND == I4Tile::Symmetric) {
          take(fp16_at(0));
        }
        if constexpr (KIND != I4Tile::Affine) continue;
        for (int n = 0; n < 2; ++n) {
          const int v = h + 2 * n;  // the 8 columns of this accumulator: 8v..8v+7
          __m256 s = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)(blk + 16 * v))), zs;
          if (head == GroupHead::Zeros) {  // zs: zero * scale, minus the offset, or dmin * m
            zs = _mm256_mul_ps(s, q8_u8x8(blk + 64 + 8 * v));
          } else {
            const __m256 h1 = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)(blk + 64 + 16 * v)));
            if (head == GroupHead::Offsets) {
              zs = _mm256_sub_ps(_mm256_setzero_ps(), h1);
            } else {  // sub-block b: d * sc[b], dmin * m[b]
              s = _mm256_mul_ps(s, q8_u8x8(blk + kKQuantSc + b * kPanel + 8 * v));
              zs = _mm256_mul_ps(h1, q8_u8x8(blk + kKQuantM + b * kPanel + 8 * v));
            }
          }
          for (int i = 0; i < MR; ++i) {
            const __m256 dot = _mm256_cvtepi32_ps(_mm256_madd_epi16(acc[i][n], ones));
            const __m256 f = _mm256_fnmadd_ps(zs, _mm256_set1_ps(sx[i * nb + kb]), _mm256_mul_ps(s, dot));
            _mm256_storeu_ps(tot[i] + 8 * v, _mm256_fmadd_ps(_mm256_set1_ps(dx[i * nb + kb]), f,
                                                             _mm256_loadu_ps(tot[i] + 8 * v)));
          }
        }
      }
    }
  }
}

// tot[i][0:32] += this int8 panel's sums (layout as the AVX-512 path's q8_tile_i8, blocks of G, offset heads when
// OFFSETS: + offset * sx, sx the sums of qx per G values) for rows i < MR (up to 4), half a panel (16 columns:
// vectors 2h and 2h + 1) at a time, as q8_tile_i4 and for the same reason: 8 int32 accumulators, 2 weights and
// their magnitudes, a broadcast of x and a temporary fit the 16 registers, where 2 rows x 32 columns spilled (+18%).
template <int MR, int G, bool OFFSETS = false>
inline void q8_tile_i8(const int8_t* qx, const float* dx, const float* sx, int64_t K, const uint8_t* panel,
                       float (*tot)[kPanel], KSpan span) {
  constexpr GroupHead kHead = OFFSETS ? GroupHead::Offsets : GroupHead::Zeros;
  const int64_t nb = K / kQ8Block, ng = K / G, block_bytes = i8_block_bytes(G, kHead), hb = i8_head_bytes(G, kHead);
  const __m256i flip = _mm256_set1_epi8((char)0x80), ones = _mm256_set1_epi16(1);
  for (int64_t kg = span.begin / G; kg < span.end / G; ++kg) {
    const uint8_t* blk = panel + kg * block_bytes;
    const int64_t kb = kg * G / kQ8Block;
    const uint8_t* quads = blk + hb;
    const int8_t* xg = qx + kg * G;
    for (int h = 0; h < 2; ++h) {
      __m256i acc[MR][2];
      for (int i = 0; i < MR; ++i) acc[i][0] = acc[i][1] = _mm256_setzero_si256();
#pragma GCC unroll 4
      for (int t = 0; t < G / 4; ++t) {
        _mm_prefetch((const char*)(quads + t * 128 + 64 * h + span.prefetch), _MM_HINT_T0);
        const __m256i w0 = _mm256_xor_si256(_mm256_loadu_si256((const __m256i*)(quads + t * 128 + 64 * h)), flip);
        const __m256i w1 = _mm256_xor_si256(_mm256_loadu_si256((const __m256i*)(quads + t * 128 + 64 * h + 32)), flip);
        const __m256i a0 = _mm256_abs_epi8(w0), a1 = _mm256_abs_epi8(w1);
        for (int i = 0; i < MR; ++i) {
          int32_t q4;
          memcpy(&q4, xg + i * K + 4 * t, 4);
          const __m256i xq = _mm256_set1_epi32(q4);
          acc[i][0] = _mm256_add_epi32(acc[i][0], _mm256_madd_epi16(_mm256_maddubs_epi16(a0, _mm256_sign_epi8(xq, w0)), ones));
          acc[i][1] = _mm256_add_epi32(acc[i][1], _mm256_madd_epi16(_mm256_maddubs_epi16(a1, _mm256_sign_epi8(xq, w1)), ones));
          __asm__("" : "+x"(acc[i][0]), "+x"(acc[i][1]));
        }
      }
      for (int n = 0; n < 2; ++n) {
        const int v = 2 * h + n;  // columns 8v..8v+7
        const __m256 d = G == 16 || OFFSETS ? _mm256_loadu_ps((const float*)blk + 8 * v)
                                            : _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)(blk + 16 * v)));
        for (int i = 0; i < MR; ++i) {
          __m256 f = _mm256_mul_ps(_mm256_cvtepi32_ps(acc[i][n]), d);
          if constexpr (OFFSETS)
            f = _mm256_fmadd_ps(_mm256_loadu_ps((const float*)blk + kPanel + 8 * v), _mm256_set1_ps(sx[i * ng + kg]), f);
          _mm256_storeu_ps(tot[i] + 8 * v, _mm256_fmadd_ps(_mm256_set1_ps(dx[i * nb + kb]), f,
                                                           _mm256_loadu_ps(tot[i] + 8 * v)));
        }
      }
    }
  }
}

// tot[i][0:32] += this int6 panel's sums (layout as the AVX-512 path's q8_tile_i6; sx the sums of qx per 16) for
// rows i < MR (up to 4), half a panel (lanes 8hf..8hf+7: columns 8hf.. from the low nibbles, 16 + 8hf.. from the high
// ones) at a time, as q8_tile_i4 (2 rows x 32 columns spilled: 6% slower). Per octet the products of quads A and
// B sum exactly in int16 (u <= 63: 4 x 63 x 128 = 32,256) before one widening.
template <int MR>
inline void q8_tile_i6(const int8_t* qx, const float* dx, const float* sx, int64_t K, const uint8_t* panel,
                       float (*tot)[kPanel], KSpan span) {
  const int64_t nb = K / kQ8Block, ns = K / kI6Sub;
  const __m256i low4 = _mm256_set1_epi8(0x0f), high2 = _mm256_set1_epi8(0x30), ones = _mm256_set1_epi16(1);
  for (int64_t k0 = span.begin; k0 < span.end; k0 += kI6Group) {
    const uint8_t* blk = panel + (k0 / kI6Group) * kI6GroupBytes;
    for (int64_t b = 0; b < kI6Group / kI6Sub; ++b) {
      const int64_t kb = (k0 + b * kI6Sub) / kQ8Block, ks = (k0 + b * kI6Sub) / kI6Sub;
      for (int hf = 0; hf < 2; ++hf) {
        __m256i acc[MR][2];
        for (int i = 0; i < MR; ++i) acc[i][0] = acc[i][1] = _mm256_setzero_si256();
        for (int o = 0; o < 2; ++o) {
          const uint8_t* oct = blk + kI6Head + (2 * b + o) * kI6Octet;
          if (hf == 0)
            for (int64_t off = 0; off < kI6Octet; off += 64) _mm_prefetch((const char*)(oct + off + span.prefetch), _MM_HINT_T0);
          const int64_t k = k0 + b * kI6Sub + 8 * o;
          const __m256i qa = _mm256_loadu_si256((const __m256i*)(oct + 32 * hf));
          const __m256i qb = _mm256_loadu_si256((const __m256i*)(oct + 64 + 32 * hf));
          const __m256i h = _mm256_loadu_si256((const __m256i*)(oct + 128 + 32 * hf));
          const __m256i al = _mm256_or_si256(_mm256_and_si256(qa, low4), _mm256_and_si256(_mm256_slli_epi16(h, 4), high2));
          const __m256i ah = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(qa, 4), low4),
                                             _mm256_and_si256(_mm256_slli_epi16(h, 2), high2));
          const __m256i bl = _mm256_or_si256(_mm256_and_si256(qb, low4), _mm256_and_si256(h, high2));
          const __m256i bh = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(qb, 4), low4),
                                             _mm256_and_si256(_mm256_srli_epi16(h, 2), high2));
          for (int i = 0; i < MR; ++i) {
            int32_t xa, xb;
            memcpy(&xa, qx + i * K + k, 4);
            memcpy(&xb, qx + i * K + k + 4, 4);
            const __m256i va = _mm256_set1_epi32(xa), vb = _mm256_set1_epi32(xb);
            const __m256i lo = _mm256_add_epi16(_mm256_maddubs_epi16(al, va), _mm256_maddubs_epi16(bl, vb));
            const __m256i hi = _mm256_add_epi16(_mm256_maddubs_epi16(ah, va), _mm256_maddubs_epi16(bh, vb));
            acc[i][0] = _mm256_add_epi32(acc[i][0], _mm256_madd_epi16(lo, ones));
            acc[i][1] = _mm256_add_epi32(acc[i][1], _mm256_madd_epi16(hi, ones));
            __asm__("" : "+x"(acc[i][0]), "+x"(acc[i][1]));
          }
        }
        for (int n = 0; n < 2; ++n) {
          const int v = hf + 2 * n;  // columns 8v..8v+7
          const __m256 s = _mm256_mul_ps(_mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)(blk + 16 * v))),
                                         _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(
                                             _mm_loadl_epi64((const __m128i*)(blk + kPanel * 2 + b * kPanel + 8 * v)))));
          for (int i = 0; i < MR; ++i) {
            const __m256 f = _mm256_fnmadd_ps(_mm256_set1_ps(32.0f), _mm256_set1_ps(sx[i * ns + ks]),
                                              _mm256_cvtepi32_ps(acc[i][n]));
            _mm256_storeu_ps(tot[i] + 8 * v, _mm256_fmadd_ps(_mm256_mul_ps(_mm256_set1_ps(dx[i * nb + kb]), s), f,
                                                             _mm256_loadu_ps(tot[i] + 8 * v)));
          }
        }
      }
    }
  }
}

// BITS 4: int4 panels with group size g; BITS 8: int8 panels of blocks of g; BITS 6: int6 panels.
template <int BITS, int MR = kQ8MR>
inline void q8_tile_n(int mr, const int8_t* qx, const float* dx, const float* sx, int64_t K, const uint8_t* panel,
                      int64_t g, GroupHead head, bool /*xg: never here*/, float* c, int64_t ldc, int ncols,
                      const float* bias, KSpan span) {
  if (mr == MR) {
    alignas(32) float tot[MR][kPanel] = {};
    if (!span.first)
      for (int i = 0; i < MR; ++i) memcpy(tot[i], c + i * ldc, (size_t)ncols * 4);
    if constexpr (BITS == 8) {
      if (g == 16) q8_tile_i8<MR, 16>(qx, dx, sx, K, panel, tot, span);
      else if (head == GroupHead::Offsets) q8_tile_i8<MR, 32, true>(qx, dx, sx, K, panel, tot, span);
      else q8_tile_i8<MR, 32>(qx, dx, sx, K, panel, tot, span);
    } else if constexpr (BITS == 6) {
      q8_tile_i6<MR>(qx, dx, sx, K, panel, tot, span);
    } else if (head == GroupHead::Mxfp4) {
      q8_tile_i4<MR, I4Tile::Mxfp4>(qx, dx, sx, K, panel, g, head, tot, span);
    } else if (head == GroupHead::Nvfp4) {
      q8_tile_i4<MR, I4Tile::Nvfp4>(qx, dx, sx, K, panel, g, head, tot, span);
    } else if (head == GroupHead::Symmetric) {
      q8_tile_i4<MR, I4Tile::Symmetric>(qx, dx, sx, K, panel, g, head, tot, span);
    } else {
      q8_tile_i4<MR, I4Tile::Affine>(qx, dx, sx, K, panel, g, head, tot, span);
    }
    const float* b = span.last ? bias : nullptr;
    for (int i = 0; i < MR; ++i)
      for (int j = 0; j < ncols; ++j) c[i * ldc + j] = b ? tot[i][j] + b[j] : tot[i][j];
  } else if constexpr (MR > 1) {
    q8_tile_n<BITS, MR - 1>(mr, qx, dx, sx, K, panel, g, head, false, c, ldc, ncols, bias, span);
  }
}
#endif

#if defined(__AVX512F__) || defined(__AVX2__)
// Per block of 32 of a quantized row qx: the int16 pair (-8 x the sum of qx[k] with k % 4 in {0, 1}, -8 x that with
// k % 4 in {2, 3}) as one int32 (its bits stored in init[b], a float slot), which is what a tile's vpmaddubsw sums
// start at in every 32-bit lane (int16 lane 0 of a column sums those k, lane 1 these), so that they end at
// sum (q - 8) qx: |.| <= 16 x 8 x 127 per lane, exact in int16 (the wrapping sums on the way come back).
inline void q8_symmetric_init(const int8_t* qx, int64_t K, float* init) {
  const __m256i ones = _mm256_set1_epi8(1);
  for (int64_t b = 0; b < K / 32; ++b) {
    __m256i p = _mm256_maddubs_epi16(ones, _mm256_loadu_si256((const __m256i*)(qx + 32 * b)));  // qx[2j] + qx[2j + 1]
    p = _mm256_add_epi16(p, _mm256_permute2x128_si256(p, p, 1));
    p = _mm256_add_epi16(p, _mm256_shuffle_epi32(p, 0x4e));
    p = _mm256_add_epi16(p, _mm256_shuffle_epi32(p, 0xb1));
    const int32_t v = _mm256_cvtsi256_si32(_mm256_sub_epi16(_mm256_setzero_si256(), _mm256_slli_epi16(p, 3)));
    memcpy(init + b, &v, 4);
  }
}

// out = x @ w^T (+ bias) with int8 activations over int4 (BITS 4, groups of g), int8 (BITS 8, blocks of g = 32
// or 16) or int6 (BITS 6, super-blocks of 256) panels; K % 32 == 0.
template <int BITS>
LMKIT_VNNI void linear_q8(const float* x, int64_t M, const void* w, int64_t N, int64_t K, int64_t g, GroupHead head,
                          const float* bias, float* out) {
  const int64_t nb = K / kQ8Block;
  const int64_t panel_bytes = BITS == 4   ? K / g * linear_int4_group_bytes(g, head)
                              : BITS == 6 ? K / kI6Group * kI6GroupBytes
                                          : K / g * i8_block_bytes(g, head);
  // scales per 16 values: their own sums of qx (the AVX2 NVFP4 tile takes none: it sums the weights' signed values)
  const bool fine = BITS == 6 || (BITS == 8 && g == 16) || (kQ8Nvfp4Sums && BITS == 4 && head == GroupHead::Nvfp4);
  // Zeros or Symmetric groups of several blocks on VNNI: x per group (q8_tile's XG), in every call whatever M, so
  // that a row quantizes the same way alone and in a batch
  const bool xg = kQ8GroupX && BITS == 4 && g > kQ8Block && (head == GroupHead::Zeros || head == GroupHead::Symmetric);
  const int64_t nx = xg ? K / g : nb;  // x's blocks per row: dx, sx
  // Symmetric int4 heads on AVX2: q8_symmetric_init's int32s per block
  const bool symmetric_init = kQ8SymmetricInit && BITS == 4 && head == GroupHead::Symmetric;
  const int64_t ns = fine ? K / 16 : nx;
  const bool own = fine || symmetric_init;  // the tiles take sums of their own, not sx
  thread_local ScratchBuffer scratch;  // dx, sx (per block of x), then the tiles' own sums where `own`, then qx
  float* dx = (float*)scratch.get((size_t)((2 * M * nx + (own ? M * ns : 0)) * 4 + M * K));
  float* sx = dx + M * nx;
  float* sg = own ? sx + M * nx : sx;  // the sums the tiles take
  int8_t* qx = (int8_t*)(sx + M * nx + (own ? M * ns : 0));
  parallel_for(M, grain_for(M), M * K >= (1 << 16), [&](int64_t m0, int64_t m1) {
    for (int64_t m = m0; m < m1; ++m) {
      q8_quantize_blocks(x + m * K, K, xg ? g : kQ8Block, qx + m * K, dx + m * nx, sx + m * nx);
      if (fine)
        for (int64_t b = 0; b < ns; ++b) {
          int32_t sum = 0;
          for (int64_t i = 0; i < 16; ++i) sum += qx[m * K + 16 * b + i];
          sg[m * ns + b] = (float)sum;
        }
      if (symmetric_init) q8_symmetric_init(qx + m * K, K, sg + m * ns);
    }
  });
  // Prefill takes the rows in M blocks whose qx stays in L2 (a panel's pass over all of a 512-token prompt's rows
  // read them from L3: 10% slower for a 1.2B gate_up). With more than one tile the tiles take the panel kQ8Span k
  // at a time (whole groups): the first tile reads a range from memory, the others from L1, and each prefetches
  // the next range. One pass per tile over the whole K had the first tile wait on memory and the others on the dot
  // products, never both at once.
  const int64_t unit = BITS == 6 ? kI6Group : g;
  const int64_t span = M > kQ8MR ? (kQ8Span + unit - 1) / unit * unit : K;
  const int64_t span_bytes = panel_bytes / (K / unit) * (span / unit);
  const int64_t mblock_rows = kQ8MBlockBytes / K / kQ8MR * kQ8MR;
  const int64_t mblock = mblock_rows < 8 * kQ8MR ? 8 * kQ8MR : mblock_rows;
  for_each_panel(M, N, K, mblock, bias, [&](int64_t mb, int64_t rows, int64_t p, int ncols, const float* bias_tile,
                                            float*) {
    const uint8_t* panel = (const uint8_t*)w + p * panel_bytes;
    for (int64_t k0 = 0; k0 < K; k0 += span) {
      const int64_t k1 = K - k0 < span ? K : k0 + span;
      const KSpan ks{k0, k1, span < K ? span_bytes : kPrefetchBytes, k0 == 0, k1 == K};
      for_each_tile<kQ8MR>(rows, [&](int64_t m0, int mr) {
        const int64_t m = mb + m0;
        q8_tile_n<BITS>(mr, qx + m * K, dx + m * nx, sg + m * ns, K, panel, g, head, xg, out + m * N + p * kPanel,
                        N, ncols, bias_tile, ks);
      });
    }
  });
}
void linear_int4_q8(const float* x, int64_t M, const void* w, int64_t N, int64_t K, int64_t g, GroupHead head,
                    const float* bias, float* out) {
  linear_q8<4>(x, M, w, N, K, g, head, bias, out);
}
void linear_int8_q8(const float* x, int64_t M, const void* w, int64_t N, int64_t K, int64_t g, GroupHead head,
                    const float* bias, float* out) {
  linear_q8<8>(x, M, w, N, K, g, head, bias, out);
}
void linear_int6_q8(const float* x, int64_t M, const void* w, int64_t N, int64_t K, const float* bias, float* out) {
  linear_q8<6>(x, M, w, N, K, kI6Group, GroupHead::Zeros, bias, out);
}
#endif
