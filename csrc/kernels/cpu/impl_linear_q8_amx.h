// AWQ int4 linear layers with int8 activations on AMX tiles (AMX-INT8): the prefill of a quantized model.
// Textually included by isa_body.h after impl_linear.h (the int4 panels) and impl_linear_bf16.h (the tile
// config type); built only in the avx512 unit.
//
// x is quantized to int8 per row and group of the weight (g = 32, 64 or 128 values: x ~ dx * qx, dx =
// max|x| / 127, round half to even), and each group of a panel is an exact int32 sum of g / kt TDPBSSD per
// 16 x 16 tile (kt = 32 or 64 k per instruction): A = qx [16 rows x kt] (s8), B = q - zero [kt x 16 columns]
// (s8, "VNNI-packed": row r holds k = 4r..4r+3 of 16 columns). The panel's nibble quads are already that
// layout (lane j of quad t = q[4t + 0..3, j] | q[4t + 0..3, j + 16] << 4): a mask (columns 0-15) or shift +
// mask (16-31) and a byte subtract of the zero points (Zeros heads; 8 for Symmetric ones) unpack them. Then per
// group, in fp32, as the VNNI kernel does it (impl_linear.h's q8_tile, XG):
//     acc[m, j] = fma(C[m, j], dx[m, group] * scale[group, j], acc[m, j])
// one chain per output over the whole K (a later K chunk goes on from the sums the output holds), the bias last:
// so a row gets the VNNI kernel's bits, alone or in a call of any height.
// A block of x per group rather than per 32 (decode's linear_int4_q8) is what makes tiles pay: every block
// costs a store of the int32 tiles and a pass of vector code over them, which at 32 k per block took most
// of the time (2026-11-26, 2-core Xeon with AMX, 1.2B shapes at M = 512: 0.8 TOP/s with 32 k per block,
// 1.6-1.7 at g = 128; the VNNI kernel 0.63-0.72, the fp32 path 0.27-0.32).
//
//        qx (Mp x K, s8)        B chunk (kc/4 rows x 128 B, s8)          cacc (32 x 32 fp32, L1)
//   A tiles [2 x 16 rows, kt] . B tiles [kt/4 rows, 16 + 16 columns] -> C tiles 0-3 -> += dx * s * C
//
// Tile registers: 0-3 C (rows 0-15 | 16-31 x columns 0-15 | 16-31), 4-5 A, 6-7 B. Threads take chunks of
// panels of one M block at a time; per panel a thread unpacks K chunks of kAmxQ8KC into an L1 buffer and
// runs every 32-row pair of tiles of the block over the chunk.
#if defined(__AVX512F__) && defined(LMKIT_HAVE_AMX)
#define LMKIT_AMX_I8 __attribute__((target("amx-tile,amx-int8,avx512vnni")))
constexpr int64_t kAmxQ8KC = 512;               // K chunk of an unpacked panel: 512 / 4 x 128 B = 16 KiB
constexpr int64_t kAmxQ8MBlockBytes = 1 << 20;  // rows of qx per M block (K bytes each): stay in L2

// kt = 32 (g = 32) and kt = 64 k per instruction: C 16 x 64 B, A 16 rows x kt B, B kt / 4 rows x 64 B.
constexpr AmxTileConfig kAmxQ8TileConfig32 = {
    1, 0, {}, {64, 64, 64, 64, 32, 32, 64, 64}, {16, 16, 16, 16, 16, 16, 8, 8}};
constexpr AmxTileConfig kAmxQ8TileConfig64 = {
    1, 0, {}, {64, 64, 64, 64, 64, 64, 64, 64}, {16, 16, 16, 16, 16, 16, 16, 16}};

// bq[t][0:64] = q - zero of columns 0-15, bq[t][64:128] of columns 16-31, for the quads t of panel
// k range [k0, k0 + kc) (whole groups); sc[gi][0:32] = the fp32 scales of each group gi of the range. head: Zeros
// or Symmetric (zero 8).
LMKIT_AMX_I8 inline void q8_amx_unpack(const uint8_t* panel, int64_t g, GroupHead head, int64_t k0, int64_t kc,
                                       int8_t* bq, float* sc) {
  const int64_t gb = linear_int4_group_bytes(g, head), hb = linear_int4_head_bytes(head);
  const bool sym = head == GroupHead::Symmetric;
  const __m512i low4 = _mm512_set1_epi8(0x0f), spread = _mm512_set1_epi32(0x01010101), eight = _mm512_set1_epi8(8);
  for (int64_t k = k0; k < k0 + kc; k += g) {
    const uint8_t* blk = panel + (k / g) * gb;
    float* s = sc + (k - k0) / g * kPanel;
    _mm512_storeu_ps(s, _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)blk)));
    _mm512_storeu_ps(s + 16, _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)(blk + 32))));
    // zero point of column j in all 4 bytes of 32-bit lane j
    const __m512i z0 = sym ? eight
                           : _mm512_mullo_epi32(_mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i*)(blk + 64))), spread);
    const __m512i z1 = sym ? eight
                           : _mm512_mullo_epi32(_mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i*)(blk + 80))), spread);
    for (int64_t t = 0; t < g / 4; ++t) {
      const __m512i raw = _mm512_loadu_si512(blk + hb + t * kI4Quad);
      int8_t* row = bq + ((k - k0) / 4 + t) * 128;
      _mm512_storeu_si512(row, _mm512_sub_epi8(_mm512_and_si512(raw, low4), z0));
      _mm512_storeu_si512(row + 64, _mm512_sub_epi8(_mm512_and_si512(_mm512_srli_epi16(raw, 4), low4), z1));
    }
  }
}

// cacc[16 MT][32] += the chunk's groups for qx rows [0, 16 MT) (ldq bytes apart; dx: their group scales, ldd
// apart, already offset to the chunk's first group); ng groups of g k, kt k per tile product. Software-
// pipelined: the tile products of group gi + 1 are issued before the vector code over group gi's sums, so
// the tile unit and the vector units work at the same time (two int32 buffers).
template <int MT>
LMKIT_AMX_I8 inline void q8_amx_block(const int8_t* qx, int64_t ldq, const float* dx, int64_t ldd,
                                      const int8_t* bq, const float* sc, int64_t g, int64_t kt, int64_t ng,
                                      float* cacc) {
  alignas(64) int32_t cbuf[2][2 * 16 * kPanel];
  auto products = [&](int64_t gi) {  // C tiles = the sums of group gi
    _tile_zero(0);
    _tile_zero(1);
    if constexpr (MT == 2) {
      _tile_zero(2);
      _tile_zero(3);
    }
    for (int64_t k = gi * g; k < (gi + 1) * g; k += kt) {
      _tile_loadd(4, qx + k, ldq);
      _tile_loadd(6, bq + k / 4 * 128, 128);
      _tile_loadd(7, bq + k / 4 * 128 + 64, 128);
      _tile_dpbssd(0, 4, 6);
      _tile_dpbssd(1, 4, 7);
      if constexpr (MT == 2) {
        _tile_loadd(5, qx + 16 * ldq + k, ldq);
        _tile_dpbssd(2, 5, 6);
        _tile_dpbssd(3, 5, 7);
      }
    }
  };
  auto store = [&](int32_t* c) {
    _tile_stored(0, c, 128);
    _tile_stored(1, c + 16, 128);
    if constexpr (MT == 2) {
      _tile_stored(2, c + 16 * kPanel, 128);
      _tile_stored(3, c + 16 * kPanel + 16, 128);
    }
    asm volatile("" ::: "memory");  // GCC's _tile_stored has no memory operand: read c after it
  };
  products(0);
  store(cbuf[0]);
  for (int64_t gi = 0; gi < ng; ++gi) {
    if (gi + 1 < ng) products(gi + 1);
    const int32_t* c = cbuf[gi & 1];
    const __m512 s0 = _mm512_loadu_ps(sc + gi * kPanel), s1 = _mm512_loadu_ps(sc + gi * kPanel + 16);
    for (int i = 0; i < 16 * MT; ++i) {
      const __m512 d = _mm512_set1_ps(dx[i * ldd + gi]);
      float* a = cacc + i * kPanel;
      const __m512 c0 = _mm512_cvtepi32_ps(_mm512_load_si512(c + i * kPanel));
      const __m512 c1 = _mm512_cvtepi32_ps(_mm512_load_si512(c + i * kPanel + 16));
      _mm512_storeu_ps(a, _mm512_fmadd_ps(c0, _mm512_mul_ps(d, s0), _mm512_loadu_ps(a)));
      _mm512_storeu_ps(a + 16, _mm512_fmadd_ps(c1, _mm512_mul_ps(d, s1), _mm512_loadu_ps(a + 16)));
    }
    asm volatile("" ::: "memory");  // the reads of this buffer before the next store into the other
    if (gi + 1 < ng) store(cbuf[(gi + 1) & 1]);
  }
}

// out = x @ w^T (+ bias) for int4 panels (group size g, Zeros or Symmetric heads), x as int8 per group, on AMX tiles.
LMKIT_AMX_I8 void linear_int4_amx(const float* x, int64_t M, const void* w, int64_t N, int64_t K, int64_t g,
                                  GroupHead head, const float* bias, float* out) {
  const int64_t ng = K / g, panel_bytes = K / g * linear_int4_group_bytes(g, head);
  const int64_t kt = g < 64 ? g : 64;
  const int64_t Mp = (M + 2 * kAmxRows - 1) / (2 * kAmxRows) * (2 * kAmxRows);
  int64_t mblock = kAmxQ8MBlockBytes / K / (2 * kAmxRows) * (2 * kAmxRows);
  if (mblock < 2 * kAmxRows) mblock = 2 * kAmxRows;
  thread_local ScratchBuffer scratch;  // dx [Mp, ng], then qx [Mp, K]
  float* dx = (float*)scratch.get((size_t)(Mp * ng * 4 + Mp * K));
  int8_t* qx = (int8_t*)(dx + Mp * ng);
  const bool worth = M * N * K >= (1 << 15);
  parallel_for(Mp, grain_for(Mp), worth, [&](int64_t r0, int64_t r1) LMKIT_AMX_I8 {
    for (int64_t m = r0; m < r1; ++m) {
      if (m < M) {
        q8_quantize_blocks(x + m * K, K, g, qx + m * K, dx + m * ng, nullptr);
      } else {  // padding rows: zeros, never stored
        memset(qx + m * K, 0, (size_t)K);
        memset(dx + m * ng, 0, (size_t)(ng * 4));
      }
    }
  });
  const PanelChunks chunks(Mp, N, mblock);
  parallel_for(chunks.count(), 1, worth, [&](int64_t c0, int64_t c1) LMKIT_AMX_I8 {
    asm volatile("" ::: "memory");  // GCC's _tile_loadd has no memory operand: keep the stores to qx before it
    _tile_loadconfig(kt == 32 ? &kAmxQ8TileConfig32 : &kAmxQ8TileConfig64);
    alignas(64) int8_t bq[kAmxQ8KC / 4 * 128];
    alignas(64) float sc[kAmxQ8KC / 32 * kPanel];
    alignas(64) float cacc[2 * kAmxRows * kPanel];
    alignas(64) float bias_tile[kPanel];
    chunks.each(c0, c1, bias, bias_tile, [&](int64_t mb, int64_t me, int64_t p, int ncols) LMKIT_AMX_I8 {
      const uint8_t* panel = (const uint8_t*)w + p * panel_bytes;
      for (int64_t k0 = 0; k0 < K; k0 += kAmxQ8KC) {
        const int64_t kc = K - k0 < kAmxQ8KC ? K - k0 : kAmxQ8KC;
        q8_amx_unpack(panel, g, head, k0, kc, bq, sc);
        asm volatile("" ::: "memory");
        const bool last = k0 + kc == K;
        for (int64_t m = mb; m < me; m += 2 * kAmxRows) {
          const int64_t valid = M - m < 2 * kAmxRows ? M - m : 2 * kAmxRows;  // rows to store
          if (valid <= 0) break;
          if (k0 == 0) memset(cacc, 0, sizeof(cacc));
          else amx_load(cacc, valid, out + m * N + p * kPanel, N, ncols);  // the sums so far, without the bias
          if (valid > kAmxRows)
            q8_amx_block<2>(qx + m * K + k0, K, dx + m * ng + k0 / g, ng, bq, sc, g, kt, kc / g, cacc);
          else
            q8_amx_block<1>(qx + m * K + k0, K, dx + m * ng + k0 / g, ng, bq, sc, g, kt, kc / g, cacc);
          amx_store(cacc, valid, out + m * N + p * kPanel, N, ncols, bias && last ? bias_tile : nullptr);
        }
      }
    });
    _tile_release();
  });
}
#endif  // AMX-INT8
