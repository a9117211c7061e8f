// Linear layers over bf16 pair panels (EngineConfig dtype='bfloat16', ops::pack_linear_bf16), on
// AVX512_BF16 dot products and, where the CPU has them, AMX tiles. Textually included by isa_body.h
// inside the ISA namespace, after impl_linear.h (panels, for_each_panel, for_each_tile); compiled in the
// avx512 unit only, each kernel under its own target attribute and called only where the CPU has it.
//
#if defined(__AVX512F__)
// ------------------------------------------------------------------ bf16 pairs (AVX512_BF16)
// EngineConfig dtype='bfloat16': weights rounded to bf16 once at load (pack_linear_bf16), x rounded to
// bf16 per call, and vdpbf16ps sums a pair of products per 32-bit lane into fp32: two k per instruction
// where the fp32 path does one, so compute-bound calls (prefill, large decode batches) run up to twice as
// fast; decode of one row reads the same bytes as fp16 panels. Row r of a panel holds k = 2r, 2r + 1 of
// its 32 columns as 16 + 16 lanes (two zmm); a tile of MR rows broadcasts x's pair r per row.
#define LMKIT_BF16 __attribute__((target("avx512bf16")))
constexpr int kBfMR = 12;       // rows per tile: 24 zmm accumulators + 2 panel vectors + 1 broadcast
constexpr int64_t kBfKC = 128;  // pair rows per K block: 128 x 128 B = 16 KiB of panel, reused from L1

// c[i, 0:ncols] = (first ? 0 : c[i, :]) + sum over pair rows [r0, r0 + rc) (+ bias when last) for i < MR: one
// vdpbf16ps chain per accumulator over the pair rows in order, a K block continuing the block before it, so that
// a row's result is the same bits in a tile of any height and under any K blocking (batch-invariant, as
// impl_linear.h's panel_tile).
template <int MR>
LMKIT_BF16 inline void bf16_tile(const uint32_t* xp, int64_t ldx, const uint8_t* panel, int64_t r0, int64_t rc,
                                 float* c, int64_t ldc, int ncols, bool first, bool last, const float* bias) {
  __m512 acc[MR][2];
  for (int i = 0; i < MR; ++i)
    for (int v = 0; v < 2; ++v) {
      const int j = 16 * v, n = ncols - j < 16 ? ncols - j : 16;
      acc[i][v] = first || n <= 0 ? _mm512_setzero_ps()
                                  : _mm512_maskz_loadu_ps((__mmask16)((1u << n) - 1), c + i * ldc + j);
    }
  const uint8_t* rows = panel + r0 * 128;
  const uint32_t* xr = xp + r0;
#pragma GCC unroll 2
  for (int64_t r = 0; r < rc; ++r) {
    const uint8_t* row = rows + r * 128;
    _mm_prefetch((const char*)(row + kPrefetchBytes), _MM_HINT_T0);
    _mm_prefetch((const char*)(row + 64 + kPrefetchBytes), _MM_HINT_T0);
    const __m512bh b0 = (__m512bh)_mm512_loadu_si512(row), b1 = (__m512bh)_mm512_loadu_si512(row + 64);
#pragma GCC unroll 12
    for (int i = 0; i < MR; ++i) {
      const __m512bh a = (__m512bh)_mm512_set1_epi32((int)xr[i * ldx + r]);
      acc[i][0] = _mm512_dpbf16_ps(acc[i][0], a, b0);
      acc[i][1] = _mm512_dpbf16_ps(acc[i][1], a, b1);
    }
  }
  for (int i = 0; i < MR; ++i)
    for (int v = 0; v < 2; ++v) {
      const int j = 16 * v, n = ncols - j < 16 ? ncols - j : 16;
      if (n <= 0) break;
      const __mmask16 mask = (__mmask16)((1u << n) - 1);
      __m512 sum = acc[i][v];
      if (last && bias) sum = _mm512_add_ps(sum, _mm512_maskz_loadu_ps(mask, bias + j));
      _mm512_mask_storeu_ps(c + i * ldc + j, mask, sum);
    }
}

template <int MR = kBfMR>
LMKIT_BF16 inline void bf16_tile_n(int mr, const uint32_t* xp, int64_t ldx, const uint8_t* panel, int64_t r0,
                                   int64_t rc, float* c, int64_t ldc, int ncols, bool first, bool last,
                                   const float* bias) {
  if (mr == MR) bf16_tile<MR>(xp, ldx, panel, r0, rc, c, ldc, ncols, first, last, bias);
  else if constexpr (MR > 1) bf16_tile_n<MR - 1>(mr, xp, ldx, panel, r0, rc, c, ldc, ncols, first, last, bias);
}

// Row x[0:K] -> R = ceil(K / 2) pairs of bf16 (round to nearest even; a zero pads an odd K).
LMKIT_BF16 inline void bf16_pairs_row(const float* x, int64_t K, uint32_t* xp) {
  for (int64_t k = 0; k < K; k += 32) {
    const int64_t n = K - k < 32 ? K - k : 32;
    const __mmask16 m0 = (__mmask16)(n >= 16 ? 0xffff : (1u << n) - 1);
    const __mmask16 m1 = (__mmask16)(n >= 32 ? 0xffff : n > 16 ? (1u << (n - 16)) - 1 : 0);
    const __m512 a = _mm512_maskz_loadu_ps(m0, x + k), b = _mm512_maskz_loadu_ps(m1, x + k + 16);
    const __m512i packed = (__m512i)_mm512_cvtne2ps_pbh(b, a);  // a's 16 values, then b's
    const int64_t pairs = (n + 1) / 2;
    _mm512_mask_storeu_epi32(xp + k / 2, (__mmask16)(pairs >= 16 ? 0xffff : (1u << pairs) - 1), packed);
  }
}

LMKIT_BF16 void linear_bf16(const float* x, int64_t M, const void* w, int64_t N, int64_t K, const float* bias,
                            float* out) {
  const int64_t R = (K + 1) / 2, panel_bytes = R * 128;
  thread_local ScratchBuffer scratch;
  uint32_t* xp = (uint32_t*)scratch.get((size_t)(M * R * 4));
  parallel_for(M, grain_for(M), M * K >= (1 << 16), [&](int64_t m0, int64_t m1) LMKIT_BF16 {
    for (int64_t m = m0; m < m1; ++m) bf16_pairs_row(x + m * K, K, xp + m * R);
  });
  // M blocks whose bf16 rows stay in L2 while every panel of the thread passes over them
  int64_t mblock = kMBlockBytes / 2 / (R * 4) / kBfMR * kBfMR;
  if (mblock < kBfMR) mblock = kBfMR;
  for_each_panel(M, N, K, mblock, bias, [&](int64_t mb, int64_t rows, int64_t p, int ncols, const float* bias_tile,
                                            float*) {
    const uint8_t* panel = (const uint8_t*)w + p * panel_bytes;
    // one tile (decode): the panel streams once, in one pass; more tiles reuse it in L1-sized K blocks
    const int64_t kc = rows <= kBfMR ? R : kBfKC;
    for (int64_t r0 = 0; r0 < R; r0 += kc) {
      const int64_t rc = R - r0 < kc ? R - r0 : kc;
      for_each_tile<kBfMR>(rows, [&](int64_t m, int mr) {
        bf16_tile_n(mr, xp + (mb + m) * R, R, panel, r0, rc, out + (mb + m) * N + p * kPanel, N, ncols, r0 == 0,
                    r0 + rc == R, bias_tile);
      });
    }
  });
}

// ------------------------------------------------------------------ AMX tiles (AMX-BF16)
// The same pair panels as tile operands. A tile register holds 16 rows of 64 bytes; TDPBF16PS adds
// A[16 x 32 bf16] . B[32 bf16 x 16] to a 16 x 16 fp32 tile, where B is "VNNI-packed": row r holds the
// pairs (k = 2r, 2r + 1) of 16 columns, which is exactly 16 consecutive pair rows of a panel read at a
// stride of 128 bytes (columns 0-15 at byte 0 of each row, 16-31 at byte 64). x is rounded into pair
// rows padded with zeros to whole tiles (16 pairs; 16 rows, or a call's M rows when M < 16, its tiles then
// configured with M rows), so no tile ever reads past its operand:
//
//        xp (Mp x Rp pairs)             panel p (R pair rows x 32 columns)     C (16 MT x 32 fp32)
//   A tile [16 rows, 16 pairs]  .  B tiles [16 pair rows, 16 + 16 columns]  ->  2 MT tiles 16 x 16
//
// Tile registers: 0-3 accumulators (rows 0-15 | 16-31 x columns 0-15 | 16-31), 4-5 A, 6-7 B. A block
// of 32 rows (MT = 2) keeps four independent accumulator chains going; a block of up to 16 rows (decode)
// streams the panel, which memory bandwidth, not the tiles, limits: it takes two K steps at a time, 4, 6, 7
// and 5, 2, 3 (tiles 2-3 then hold weights), so that one step's loads overlap the other's products. The K
// tail of a panel that is not a whole number of 16 pair rows is copied into a zero-padded tile buffer. Each
// chunk of work configures the tiles on entry and releases them on exit (so the OS need not save 8 KiB of tile
// state on a switch).
#if defined(__GNUC__) && (__GNUC__ >= 11 || defined(__clang__))
#define LMKIT_HAVE_AMX 1
#define LMKIT_AMX __attribute__((target("amx-tile,amx-bf16,avx512bf16")))
constexpr int64_t kAmxRows = 16;                 // rows of a tile (of x, and pair rows of a panel)
constexpr int64_t kAmxMBlockRows = 256;          // rows of xp per M block: 256 x Rp x 4 B stay in L2
constexpr int64_t kAmxPrefetchBytes = 4096;        // how far ahead a lone block prefetches its panel

struct alignas(64) AmxTileConfig {  // the 64-byte operand of LDTILECFG (palette 1)
  uint8_t palette_id;
  uint8_t start_row;
  uint8_t reserved[14];
  uint16_t colsb[16];
  uint8_t rows[16];
};
// Tiles 0-7: 16 rows of 64 bytes. In static storage: GCC's _tile_loadconfig tells the compiler it reads only
// the first 8 bytes of its operand, so the stores that build a config on the stack can be dropped as dead.
// The accumulator and x tiles (0-1, 4-5) of r rows, the others of 16 (tiles 2-3: accumulators of a 32-row block,
// weights in amx_block<1>). r < 16 for a call of fewer than 16 rows (kAmxTileConfigRows[r]): no padding rows of x
// to write, nor to multiply (a decode row).
constexpr AmxTileConfig amx_config_rows(uint8_t r) {
  return {1, 0, {}, {64, 64, 64, 64, 64, 64, 64, 64}, {r, r, 16, 16, r, r, 16, 16}};
}
constexpr AmxTileConfig kAmxTileConfig = amx_config_rows(16);  // every tile 16 rows

LMKIT_AMX inline void amx_configure() { _tile_loadconfig(&kAmxTileConfig); }
constexpr AmxTileConfig kAmxTileConfigRows[kAmxRows] = {
    amx_config_rows(16), amx_config_rows(1),  amx_config_rows(2),  amx_config_rows(3),
    amx_config_rows(4),  amx_config_rows(5),  amx_config_rows(6),  amx_config_rows(7),
    amx_config_rows(8),  amx_config_rows(9),  amx_config_rows(10), amx_config_rows(11),
    amx_config_rows(12), amx_config_rows(13), amx_config_rows(14), amx_config_rows(15)};

// cbuf[16 MT][32] = xp rows [0, 16 MT) . panel (all R pair rows); xp rows are ldp pairs apart (ldp a
// multiple of 16, zero past R).
template <int MT>
LMKIT_AMX inline void amx_block(const uint32_t* xp, int64_t ldp, const uint8_t* panel, int64_t R, float* cbuf) {
  const int64_t full = R / kAmxRows, tail = R - full * kAmxRows, lda = ldp * 4;
  _tile_zero(0);
  _tile_zero(1);
  if constexpr (MT == 2) {
    _tile_zero(2);
    _tile_zero(3);
  }
  alignas(64) uint8_t btail[kAmxRows * 128];
  int64_t c = 0;
  if constexpr (MT == 1)  // two steps at a time on two sets of x and weight tiles (4, 6, 7 and 5, 2, 3), so that
    for (; c + 1 < full; c += 2) {  // the loads of one overlap the products of the other; the sums stay in order
      const uint8_t* b = panel + c * kAmxRows * 128;
      for (int j = 0; j < kAmxRows * 4; ++j) _mm_prefetch((const char*)(b + kAmxPrefetchBytes + 64 * j), _MM_HINT_T0);
      _tile_loadd(4, xp + c * kAmxRows, lda);
      _tile_loadd(6, b, 128);
      _tile_loadd(7, b + 64, 128);
      _tile_loadd(5, xp + (c + 1) * kAmxRows, lda);
      _tile_loadd(2, b + kAmxRows * 128, 128);
      _tile_loadd(3, b + kAmxRows * 128 + 64, 128);
      _tile_dpbf16ps(0, 4, 6);
      _tile_dpbf16ps(1, 4, 7);
      _tile_dpbf16ps(0, 5, 2);
      _tile_dpbf16ps(1, 5, 3);
    }
  for (; c < full + (tail > 0); ++c) {
    const uint8_t* b = panel + c * kAmxRows * 128;
    if (c == full) {  // the last pair rows, zero-padded to a whole tile
      memcpy(btail, b, (size_t)(tail * 128));
      memset(btail + tail * 128, 0, (size_t)((kAmxRows - tail) * 128));
      b = btail;
      asm volatile("" ::: "memory");
    }
    if constexpr (MT == 1)  // one block of rows streams the panel: prefetch as the dot-product tiles do
      for (int j = 0; j < kAmxRows * 2; ++j)
        _mm_prefetch((const char*)(panel + c * kAmxRows * 128 + kAmxPrefetchBytes + 64 * j), _MM_HINT_T0);
    _tile_loadd(4, xp + c * kAmxRows, lda);
    _tile_loadd(6, b, 128);
    _tile_loadd(7, b + 64, 128);
    _tile_dpbf16ps(0, 4, 6);
    _tile_dpbf16ps(1, 4, 7);
    if constexpr (MT == 2) {
      _tile_loadd(5, xp + kAmxRows * ldp + c * kAmxRows, lda);
      _tile_dpbf16ps(2, 5, 6);
      _tile_dpbf16ps(3, 5, 7);
    }
  }
  _tile_stored(0, cbuf, 128);
  _tile_stored(1, cbuf + 16, 128);
  if constexpr (MT == 2) {
    _tile_stored(2, cbuf + 16 * 32, 128);
    _tile_stored(3, cbuf + 16 * 32 + 16, 128);
  }
}

// out[m, 0 : ncols] = cbuf[m, :] (+ bias where there is one, as the dot-product kernels add it) for m < rows
// (cbuf rows 32 floats apart). Plain AVX-512: both AMX kernels call it.
inline void amx_store(const float* cbuf, int64_t rows, float* out, int64_t ldo, int ncols, const float* bias) {
  const __mmask16 m0 = lanes(ncols < 16 ? ncols : 16), m1 = lanes(ncols > 16 ? ncols - 16 : 0);  // ncols <= 32
  const __m512 b0 = bias ? _mm512_maskz_loadu_ps(m0, bias) : _mm512_setzero_ps();
  const __m512 b1 = bias ? _mm512_maskz_loadu_ps(m1, bias + 16) : _mm512_setzero_ps();
  for (int64_t i = 0; i < rows; ++i) {
    float* o = out + i * ldo;
    __m512 v0 = _mm512_loadu_ps(cbuf + i * 32), v1 = _mm512_loadu_ps(cbuf + i * 32 + 16);
    if (bias) v0 = _mm512_add_ps(v0, b0), v1 = _mm512_add_ps(v1, b1);
    _mm512_mask_storeu_ps(o, m0, v0);
    if (m1) _mm512_mask_storeu_ps(o + 16, m1, v1);
  }
}

// cbuf[m, :] = out[m, 0 : ncols], 0 beyond, for m < rows (cbuf rows 32 floats apart): the inverse of amx_store
// without bias.
inline void amx_load(float* cbuf, int64_t rows, const float* out, int64_t ldo, int ncols) {
  const __mmask16 m0 = lanes(ncols < 16 ? ncols : 16), m1 = lanes(ncols > 16 ? ncols - 16 : 0);
  for (int64_t i = 0; i < rows; ++i) {
    _mm512_storeu_ps(cbuf + i * 32, _mm512_maskz_loadu_ps(m0, out + i * ldo));
    _mm512_storeu_ps(cbuf + i * 32 + 16, _mm512_maskz_loadu_ps(m1, out + i * ldo + 16));
  }
}

// linear_bf16 on AMX tiles: same operands, same result up to the order of fp32 sums (and AMX's flush of
// bf16 denormals to zero).
LMKIT_AMX void linear_bf16_amx(const float* x, int64_t M, const void* w, int64_t N, int64_t K, const float* bias,
                               float* out) {
  const int64_t R = (K + 1) / 2, panel_bytes = R * 128;
  const int64_t ldp = (R + kAmxRows - 1) / kAmxRows * kAmxRows, Mp = (M + kAmxRows - 1) / kAmxRows * kAmxRows;
  // fewer than 16 rows: tiles of M rows (no padding rows); else whole tiles, the last padded with zero rows
  const int64_t xrows = M < kAmxRows ? M : Mp;
  thread_local ScratchBuffer scratch;
  uint32_t* xp = (uint32_t*)scratch.get((size_t)(Mp * ldp * 4));
  const bool worth = M * N * K >= (1 << 15);
  parallel_for(xrows, grain_for(xrows), M * K >= (1 << 16), [&](int64_t m0, int64_t m1) LMKIT_AMX {
    for (int64_t m = m0; m < m1; ++m) {  // x -> bf16 pair rows, zero-padded
      uint32_t* row = xp + m * ldp;
      int64_t done = 0;
      if (m < M) {
        bf16_pairs_row(x + m * K, K, row);
        done = R;
      }
      memset(row + done, 0, (size_t)((ldp - done) * 4));
    }
  });
  const PanelChunks chunks(Mp, N, kAmxMBlockRows);
  parallel_for(chunks.count(), 1, worth, [&](int64_t c0, int64_t c1) LMKIT_AMX {
    asm volatile("" ::: "memory");  // GCC's _tile_loadd has no memory operand: keep the stores to xp before it
    _tile_loadconfig(&kAmxTileConfigRows[M < kAmxRows ? M : 0]);
    alignas(64) float cbuf[2 * kAmxRows * kPanel];
    alignas(64) float bias_tile[kPanel];
    chunks.each(c0, c1, bias, bias_tile, [&](int64_t mb, int64_t me, int64_t p, int ncols) LMKIT_AMX {
      const uint8_t* panel = (const uint8_t*)w + p * panel_bytes;
      for (int64_t m = mb; m < me; m += 2 * kAmxRows) {
        const bool two = me - m >= 2 * kAmxRows;
        if (two) amx_block<2>(xp + m * ldp, ldp, panel, R, cbuf);
        else amx_block<1>(xp + m * ldp, ldp, panel, R, cbuf);
        const int64_t valid = M - m < (two ? 2 : 1) * kAmxRows ? M - m : (two ? 2 : 1) * kAmxRows;
        if (valid > 0) amx_store(cbuf, valid, out + m * N + p * kPanel, N, ncols, bias ? bias_tile : nullptr);
      }
    });
    _tile_release();
  });
}
#endif  // AMX
#endif  // __AVX512F__
