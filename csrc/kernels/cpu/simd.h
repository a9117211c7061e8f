// SIMD wrapper: one fp32 vector type `V` of kW lanes whose operations follow the instruction set the
// including translation unit is compiled for: __AVX512F__ -> 16 lanes (zmm), __AVX2__ -> 8 lanes (ymm,
// FMA, F16C), otherwise 4 lanes of GCC vector extensions (portable, SSE2 on x86-64).
//
// Textually included by isa_body.h INSIDE `namespace lmkit::ops::cpu::<isa> { namespace { ... } }`, so
// every function here has internal linkage and one copy per ISA: no inline function compiled with
// AVX-512 flags can be picked by the linker for generic code. Hence also: no #include here; the
// system headers (<immintrin.h>, <math.h>, ...) come from isa_prelude.h at file scope.

// bf16 <-> fp32, the same in every ISA (own copies of dtype.h's converters, which are not inline-safe here):
// fp32 -> bf16 bits rounds to nearest even and keeps NaN a NaN; bf16 -> fp32 is exact.
inline uint16_t bf16_bits(float f) {
  uint32_t u;
  memcpy(&u, &f, 4);
  if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x40);
  u += 0x7fffu + ((u >> 16) & 1u);
  return (uint16_t)(u >> 16);
}
inline float bfloat_to_float(uint16_t h) {
  uint32_t u = (uint32_t)h << 16;
  float f;
  memcpy(&f, &u, 4);
  return f;
}

// IEEE half <-> fp32 for scalars (own copies of dtype.h's converters, which are not inline-safe here): one
// F16C instruction where the ISA has it, else the same bit arithmetic; exact for every half, and fp32 -> half
// rounds to nearest even (a NaN stays a NaN).
#if defined(__F16C__)
inline float half_to_float(uint16_t h) { return _cvtsh_ss(h); }
inline uint16_t float_to_half(float f) { return (uint16_t)_cvtss_sh(f, _MM_FROUND_TO_NEAREST_INT); }
#else
inline float half_to_float(uint16_t h) {
  const uint32_t sign = (uint32_t)(h & 0x8000) << 16, exp = (h >> 10) & 0x1f;
  uint32_t mant = h & 0x3ff, u;
  if (exp == 0 && mant == 0) {
    u = sign;
  } else if (exp == 0) {  // subnormal: normalise
    int e = -1;
    do mant <<= 1, ++e;
    while (!(mant & 0x400));
    u = sign | ((uint32_t)(127 - 15 - e) << 23) | ((mant & 0x3ff) << 13);
  } else if (exp == 31) {
    u = sign | 0x7f800000u | (mant << 13);
  } else {
    u = sign | ((exp + 127 - 15) << 23) | (mant << 13);
  }
  float f;
  memcpy(&f, &u, 4);
  return f;
}
inline uint16_t float_to_half(float f) {
  uint32_t x;
  memcpy(&x, &f, 4);
  const uint32_t sign = (x >> 16) & 0x8000;
  const int32_t exp = (int32_t)((x >> 23) & 0xff) - 127 + 15;
  uint32_t mant = x & 0x7fffff;
  if (((x >> 23) & 0xff) == 0xff) return (uint16_t)(sign | 0x7c00 | (mant ? 0x200 : 0));
  if (exp >= 31) return (uint16_t)(sign | 0x7c00);
  if (exp <= 0) {
    if (exp < -10) return (uint16_t)sign;
    mant |= 0x800000;
    const uint32_t shift = (uint32_t)(14 - exp), rem = mant & ((1u << shift) - 1), mid = 1u << (shift - 1);
    uint32_t half = mant >> shift;
    if (rem > mid || (rem == mid && (half & 1))) ++half;
    return (uint16_t)(sign | half);
  }
  uint32_t half = sign | ((uint32_t)exp << 10) | (mant >> 13);
  const uint32_t rem = mant & 0x1fff;
  if (rem > 0x1000 || (rem == 0x1000 && (half & 1))) ++half;
  return (uint16_t)half;
}
#endif

#if defined(__AVX512F__)

constexpr int kW = 16;
struct V {
  __m512 v;
};
inline __mmask16 lanes(int n) { return (__mmask16)((1u << n) - 1u); }  // n in [0, 16]
inline V vzero() { return {_mm512_setzero_ps()}; }
inline V vset1(float a) { return {_mm512_set1_ps(a)}; }
inline V vload(const float* p) { return {_mm512_loadu_ps(p)}; }
inline void vstore(float* p, V a) { _mm512_storeu_ps(p, a.v); }
inline V vload_n(const float* p, int n) { return {_mm512_maskz_loadu_ps(lanes(n), p)}; }
inline void vstore_n(float* p, V a, int n) { _mm512_mask_storeu_ps(p, lanes(n), a.v); }
inline V vload_f16(const uint16_t* p) { return {_mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)p))}; }
inline V vload_f16_n(const uint16_t* p, int n) {
  return {_mm512_cvtph_ps(_mm256_maskz_loadu_epi16(lanes(n), p))};
}
inline V bf16_widen(__m256i h) { return {_mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16))}; }
inline V vload_bf16(const uint16_t* p) { return bf16_widen(_mm256_loadu_si256((const __m256i*)p)); }
inline V vload_bf16_n(const uint16_t* p, int n) { return bf16_widen(_mm256_maskz_loadu_epi16(lanes(n), p)); }
// Lanes i < n: the low (odd = 0) or high (odd = 1) bf16 of the 32-bit word p[i], as fp32 (0 past n).
inline V bf16_half(__m512i w, int odd) {
  return {_mm512_castsi512_ps(odd ? _mm512_and_si512(w, _mm512_set1_epi32((int)0xffff0000u)) : _mm512_slli_epi32(w, 16))};
}
inline V vload_bf16_half_n(const uint32_t* p, int odd, int n) { return bf16_half(_mm512_maskz_loadu_epi32(lanes(n), p), odd); }
inline V vload_bf16_half(const uint32_t* p, int odd) { return bf16_half(_mm512_loadu_si512(p), odd); }
inline V operator+(V a, V b) { return {_mm512_add_ps(a.v, b.v)}; }
inline V operator-(V a, V b) { return {_mm512_sub_ps(a.v, b.v)}; }
inline V operator*(V a, V b) { return {_mm512_mul_ps(a.v, b.v)}; }
inline V operator/(V a, V b) { return {_mm512_div_ps(a.v, b.v)}; }
inline V vfma(V a, V b, V c) { return {_mm512_fmadd_ps(a.v, b.v, c.v)}; }  // a * b + c
inline V vmax(V a, V b) { return {_mm512_max_ps(a.v, b.v)}; }
inline V vmin(V a, V b) { return {_mm512_min_ps(a.v, b.v)}; }
inline float vsum(V a) { return _mm512_reduce_add_ps(a.v); }
inline float vhmax(V a) { return _mm512_reduce_max_ps(a.v); }
// lanes where a < b take z, others take y
inline V vselect_lt(V a, V b, V z, V y) { return {_mm512_mask_blend_ps(_mm512_cmp_ps_mask(a.v, b.v, _CMP_LT_OQ), y.v, z.v)}; }
inline bool vany_gt(V a, V b) { return _mm512_cmp_ps_mask(a.v, b.v, _CMP_GT_OQ) != 0; }  // some a[i] > b[i]
// 1 / d to ~1 ulp: 14-bit estimate and one Newton step (error ~2^-28 before rounding)
inline V vrcp(V d) {
  const __m512 r = _mm512_rcp14_ps(d.v);
  return {_mm512_fmadd_ps(r, _mm512_fnmadd_ps(d.v, r, _mm512_set1_ps(1.0f)), r)};
}
// 2^n for integer-valued n in [-126, 127], given t = n + 1.5 * 2^23 as a float.
inline V vpow2_from_magic(V t) {
  __m512i i = _mm512_sub_epi32(_mm512_castps_si512(t.v), _mm512_set1_epi32(0x4B400000));
  return {_mm512_castsi512_ps(_mm512_slli_epi32(_mm512_add_epi32(i, _mm512_set1_epi32(127)), 23))};
}
inline void prefetch(const void* p) { _mm_prefetch((const char*)p, _MM_HINT_T0); }
// kW bytes as floats; and the low / high nibbles of kW bytes as floats.
inline V vload_u8(const uint8_t* p) { return {_mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i*)p)))}; }
inline V vload_s8(const uint8_t* p) { return {_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i*)p)))}; }
inline void vload_nibbles(const uint8_t* p, V& lo, V& hi) {
  const __m512i b = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i*)p));
  lo.v = _mm512_cvtepi32_ps(_mm512_and_si512(b, _mm512_set1_epi32(15)));
  hi.v = _mm512_cvtepi32_ps(_mm512_srli_epi32(b, 4));
}
// kW 32-bit lanes at p: lo = float((lane >> shift) & 15), hi = float((lane >> (shift + 4)) & 15).
inline void vload_dword_nibbles(const uint8_t* p, int shift, V& lo, V& hi) {
  const __m512i d = _mm512_srl_epi32(_mm512_loadu_si512(p), _mm_cvtsi32_si128(shift)), m = _mm512_set1_epi32(15);
  lo.v = _mm512_cvtepi32_ps(_mm512_and_si512(d, m));
  hi.v = _mm512_cvtepi32_ps(_mm512_and_si512(_mm512_srli_epi32(d, 4), m));
}
// kW 32-bit lanes at p: float((lane >> shift) & 255).
inline V vload_dword_byte(const uint8_t* p, int shift) {
  const __m512i d = _mm512_srl_epi32(_mm512_loadu_si512(p), _mm_cvtsi32_si128(shift));
  return {_mm512_cvtepi32_ps(_mm512_and_si512(d, _mm512_set1_epi32(255)))};
}
// kW 32-bit lanes at p: lo = e2m1x2((lane >> shift) & 15), hi = e2m1x2((lane >> (shift + 4)) & 15), twice the e2m1 value
// of an MXFP4 code (ops.h's kE2m1Twice, where code 8, -0, is 0: the same sums).
inline void vload_dword_e2m1(const uint8_t* p, int shift, V& lo, V& hi) {
  const __m512 lut = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i*)kE2m1Twice)));
  const __m512i d = _mm512_srl_epi32(_mm512_loadu_si512(p), _mm_cvtsi32_si128(shift));
  lo.v = _mm512_permutexvar_ps(d, lut);  // the index's low 4 bits
  hi.v = _mm512_permutexvar_ps(_mm512_srli_epi32(d, 4), lut);
}
// kW bytes at p, fp32 exponent fields f: 2^(f - 127) (0 for f = 0).
inline V vload_exp2(const uint8_t* p) {
  return {_mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i*)p)), 23))};
}
// 6-bit values from kW 32-bit lanes of nibbles at p and of 2-bit pairs at h (the int6 panels):
// lo = float((p >> shift) & 15 | ((h >> hshift) & 3) << 4), hi = float((p >> (shift + 4)) & 15 | ((h >> (hshift + 2)) & 3) << 4).
inline void vload_dword_sixes(const uint8_t* p, const uint8_t* h, int shift, int hshift, V& lo, V& hi) {
  const __m512i d = _mm512_srl_epi32(_mm512_loadu_si512(p), _mm_cvtsi32_si128(shift));
  const __m512i e = _mm512_srl_epi32(_mm512_loadu_si512(h), _mm_cvtsi32_si128(hshift));
  const __m512i m = _mm512_set1_epi32(15), m2 = _mm512_set1_epi32(0x30);
  lo.v = _mm512_cvtepi32_ps(_mm512_or_si512(_mm512_and_si512(d, m), _mm512_and_si512(_mm512_slli_epi32(e, 4), m2)));
  hi.v = _mm512_cvtepi32_ps(
      _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi32(d, 4), m), _mm512_and_si512(_mm512_slli_epi32(e, 2), m2)));
}
// Lane i of the result = the sum of the lanes of r[i] (16 horizontal sums at once): pairs of vectors are
// folded into one at every level (unpack, in-lane shuffle, 128-bit chunk shuffles: 30 shuffles and 15 adds,
// where transposing first takes 64 shuffles).
inline V vhsum(const V r[16]) {
  __m512 t[8], w[4];
  for (int k = 0; k < 8; ++k)  // chunk c of t[k]: [x4c+x4c+2, y4c+y4c+2, x4c+1+x4c+3, y4c+1+y4c+3], x = r[2k], y = r[2k+1]
    t[k] = _mm512_add_ps(_mm512_unpacklo_ps(r[2 * k].v, r[2 * k + 1].v), _mm512_unpackhi_ps(r[2 * k].v, r[2 * k + 1].v));
  for (int m = 0; m < 4; ++m)  // position p of chunk c of w[m]: chunk c's sum of r[4m + p]
    w[m] = _mm512_add_ps(_mm512_shuffle_ps(t[2 * m], t[2 * m + 1], 0x44), _mm512_shuffle_ps(t[2 * m], t[2 * m + 1], 0xEE));
  const __m512 z01 = _mm512_add_ps(_mm512_shuffle_f32x4(w[0], w[1], 0x44), _mm512_shuffle_f32x4(w[0], w[1], 0xEE));
  const __m512 z23 = _mm512_add_ps(_mm512_shuffle_f32x4(w[2], w[3], 0x44), _mm512_shuffle_f32x4(w[2], w[3], 0xEE));
  return {_mm512_add_ps(_mm512_shuffle_f32x4(z01, z23, 0x88), _mm512_shuffle_f32x4(z01, z23, 0xDD))};
}

#elif defined(__AVX2__)

constexpr int kW = 8;
struct V {
  __m256 v;
};
inline __m256i lanes(int n) {  // n in [0, 8]
  return _mm256_cmpgt_epi32(_mm256_set1_epi32(n), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
}
inline V vzero() { return {_mm256_setzero_ps()}; }
inline V vset1(float a) { return {_mm256_set1_ps(a)}; }
inline V vload(const float* p) { return {_mm256_loadu_ps(p)}; }
inline void vstore(float* p, V a) { _mm256_storeu_ps(p, a.v); }
inline V vload_n(const float* p, int n) { return {_mm256_maskload_ps(p, lanes(n))}; }
inline void vstore_n(float* p, V a, int n) { _mm256_maskstore_ps(p, lanes(n), a.v); }
inline V vload_f16(const uint16_t* p) { return {_mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)p))}; }
inline __m128i load_u16_n(const uint16_t* p, int n) {
  uint16_t tmp[8] = {0, 0, 0, 0, 0, 0, 0, 0};
  memcpy(tmp, p, (size_t)n * 2);
  return _mm_loadu_si128((const __m128i*)tmp);
}
inline V vload_f16_n(const uint16_t* p, int n) { return {_mm256_cvtph_ps(load_u16_n(p, n))}; }
inline V bf16_widen(__m128i h) { return {_mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16))}; }
inline V vload_bf16(const uint16_t* p) { return bf16_widen(_mm_loadu_si128((const __m128i*)p)); }
inline V vload_bf16_n(const uint16_t* p, int n) { return bf16_widen(load_u16_n(p, n)); }
// Lanes i < n: the low (odd = 0) or high (odd = 1) bf16 of the 32-bit word p[i], as fp32 (0 past n).
inline V bf16_half(__m256i w, int odd) {
  return {_mm256_castsi256_ps(odd ? _mm256_and_si256(w, _mm256_set1_epi32((int)0xffff0000u)) : _mm256_slli_epi32(w, 16))};
}
inline V vload_bf16_half_n(const uint32_t* p, int odd, int n) {
  return bf16_half(_mm256_maskload_epi32((const int*)p, lanes(n)), odd);
}
inline V vload_bf16_half(const uint32_t* p, int odd) { return bf16_half(_mm256_loadu_si256((const __m256i*)p), odd); }
inline V operator+(V a, V b) { return {_mm256_add_ps(a.v, b.v)}; }
inline V operator-(V a, V b) { return {_mm256_sub_ps(a.v, b.v)}; }
inline V operator*(V a, V b) { return {_mm256_mul_ps(a.v, b.v)}; }
inline V operator/(V a, V b) { return {_mm256_div_ps(a.v, b.v)}; }
inline V vfma(V a, V b, V c) { return {_mm256_fmadd_ps(a.v, b.v, c.v)}; }
inline V vmax(V a, V b) { return {_mm256_max_ps(a.v, b.v)}; }
inline V vmin(V a, V b) { return {_mm256_min_ps(a.v, b.v)}; }
inline float vsum(V a) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(a.v), _mm256_extractf128_ps(a.v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}
inline float vhmax(V a) {
  __m128 s = _mm_max_ps(_mm256_castps256_ps128(a.v), _mm256_extractf128_ps(a.v, 1));
  s = _mm_max_ps(s, _mm_movehl_ps(s, s));
  s = _mm_max_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}
inline V vselect_lt(V a, V b, V z, V y) { return {_mm256_blendv_ps(y.v, z.v, _mm256_cmp_ps(a.v, b.v, _CMP_LT_OQ))}; }
inline bool vany_gt(V a, V b) { return _mm256_movemask_ps(_mm256_cmp_ps(a.v, b.v, _CMP_GT_OQ)) != 0; }
// 1 / d to ~1-2 ulp: 12-bit estimate and one Newton step
inline V vrcp(V d) {
  const __m256 r = _mm256_rcp_ps(d.v);
  return {_mm256_fmadd_ps(r, _mm256_fnmadd_ps(d.v, r, _mm256_set1_ps(1.0f)), r)};
}
inline V vpow2_from_magic(V t) {
  __m256i i = _mm256_sub_epi32(_mm256_castps_si256(t.v), _mm256_set1_epi32(0x4B400000));
  return {_mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(i, _mm256_set1_epi32(127)), 23))};
}
inline void prefetch(const void* p) { _mm_prefetch((const char*)p, _MM_HINT_T0); }
// kW bytes as floats; and the low / high nibbles of kW bytes as floats.
inline V vload_u8(const uint8_t* p) { return {_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i*)p)))}; }
inline V vload_s8(const uint8_t* p) { return {_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i*)p)))}; }
inline void vload_nibbles(const uint8_t* p, V& lo, V& hi) {
  const __m256i b = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i*)p));
  lo.v = _mm256_cvtepi32_ps(_mm256_and_si256(b, _mm256_set1_epi32(15)));
  hi.v = _mm256_cvtepi32_ps(_mm256_srli_epi32(b, 4));
}
inline void vload_dword_nibbles(const uint8_t* p, int shift, V& lo, V& hi) {
  const __m256i d = _mm256_srl_epi32(_mm256_loadu_si256((const __m256i*)p), _mm_cvtsi32_si128(shift));
  const __m256i m = _mm256_set1_epi32(15);
  lo.v = _mm256_cvtepi32_ps(_mm256_and_si256(d, m));
  hi.v = _mm256_cvtepi32_ps(_mm256_and_si256(_mm256_srli_epi32(d, 4), m));
}
inline V vload_dword_byte(const uint8_t* p, int shift) {
  const __m256i d = _mm256_srl_epi32(_mm256_loadu_si256((const __m256i*)p), _mm_cvtsi32_si128(shift));
  return {_mm256_cvtepi32_ps(_mm256_and_si256(d, _mm256_set1_epi32(255)))};
}
inline void vload_dword_e2m1(const uint8_t* p, int shift, V& lo, V& hi) {  // magnitude by the low 3 bits, sign bit 3
  const __m256 lut = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i*)kE2m1Twice)));
  const __m256i d = _mm256_srl_epi32(_mm256_loadu_si256((const __m256i*)p), _mm_cvtsi32_si128(shift));
  const __m256i d4 = _mm256_srli_epi32(d, 4), sign = _mm256_set1_epi32((int)0x80000000u);
  lo.v = _mm256_xor_ps(_mm256_permutevar8x32_ps(lut, d), _mm256_castsi256_ps(_mm256_and_si256(_mm256_slli_epi32(d, 28), sign)));
  hi.v = _mm256_xor_ps(_mm256_permutevar8x32_ps(lut, d4), _mm256_castsi256_ps(_mm256_and_si256(_mm256_slli_epi32(d4, 28), sign)));
}
inline V vload_exp2(const uint8_t* p) {
  return {_mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i*)p)), 23))};
}
inline void vload_dword_sixes(const uint8_t* p, const uint8_t* h, int shift, int hshift, V& lo, V& hi) {
  const __m256i d = _mm256_srl_epi32(_mm256_loadu_si256((const __m256i*)p), _mm_cvtsi32_si128(shift));
  const __m256i e = _mm256_srl_epi32(_mm256_loadu_si256((const __m256i*)h), _mm_cvtsi32_si128(hshift));
  const __m256i m = _mm256_set1_epi32(15), m2 = _mm256_set1_epi32(0x30);
  lo.v = _mm256_cvtepi32_ps(_mm256_or_si256(_mm256_and_si256(d, m), _mm256_and_si256(_mm256_slli_epi32(e, 4), m2)));
  hi.v = _mm256_cvtepi32_ps(
      _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi32(d, 4), m), _mm256_and_si256(_mm256_slli_epi32(e, 2), m2)));
}
// Lane i of the result = the sum of the lanes of r[i] (see the AVX-512 version: 14 shuffles and 7 adds).
inline V vhsum(const V r[8]) {
  __m256 t[4], w[2];
  for (int k = 0; k < 4; ++k)
    t[k] = _mm256_add_ps(_mm256_unpacklo_ps(r[2 * k].v, r[2 * k + 1].v), _mm256_unpackhi_ps(r[2 * k].v, r[2 * k + 1].v));
  for (int m = 0; m < 2; ++m)
    w[m] = _mm256_add_ps(_mm256_shuffle_ps(t[2 * m], t[2 * m + 1], 0x44), _mm256_shuffle_ps(t[2 * m], t[2 * m + 1], 0xEE));
  return {_mm256_add_ps(_mm256_permute2f128_ps(w[0], w[1], 0x20), _mm256_permute2f128_ps(w[0], w[1], 0x31))};
}

#else  // generic: GCC/Clang vector extensions

constexpr int kW = 4;
typedef float vf4 __attribute__((vector_size(16)));
typedef int32_t vi4 __attribute__((vector_size(16)));
struct V {
  vf4 v;
};
inline V vzero() { return {vf4{0.f, 0.f, 0.f, 0.f}}; }
inline V vset1(float a) { return {vf4{a, a, a, a}}; }
inline V vload(const float* p) {
  V r;
  memcpy(&r.v, p, sizeof(r.v));
  return r;
}
inline void vstore(float* p, V a) { memcpy(p, &a.v, sizeof(a.v)); }
inline V vload_n(const float* p, int n) {
  V r = vzero();
  memcpy(&r.v, p, (size_t)n * 4);
  return r;
}
inline void vstore_n(float* p, V a, int n) { memcpy(p, &a.v, (size_t)n * 4); }
inline V vload_f16_n(const uint16_t* p, int n) {
  V r = vzero();
  for (int i = 0; i < n; ++i) r.v[i] = half_to_float(p[i]);
  return r;
}
inline V vload_f16(const uint16_t* p) { return vload_f16_n(p, 4); }
inline V vload_bf16_n(const uint16_t* p, int n) {
  V r = vzero();
  for (int i = 0; i < n; ++i) r.v[i] = bfloat_to_float(p[i]);
  return r;
}
inline V vload_bf16(const uint16_t* p) { return vload_bf16_n(p, 4); }
// Lanes i < n: the low (odd = 0) or high (odd = 1) bf16 of the 32-bit word p[i], as fp32 (0 past n).
inline V vload_bf16_half_n(const uint32_t* p, int odd, int n) {
  V r = vzero();
  for (int i = 0; i < n; ++i) {
    const uint32_t bits = odd ? (p[i] & 0xffff0000u) : (p[i] << 16);
    memcpy(&r.v[i], &bits, 4);
  }
  return r;
}
inline V vload_bf16_half(const uint32_t* p, int odd) { return vload_bf16_half_n(p, odd, kW); }
inline V operator+(V a, V b) { return {a.v + b.v}; }
inline V operator-(V a, V b) { return {a.v - b.v}; }
inline V operator*(V a, V b) { return {a.v * b.v}; }
inline V operator/(V a, V b) { return {a.v / b.v}; }
inline V vfma(V a, V b, V c) { return {a.v * b.v + c.v}; }
inline V vmax(V a, V b) { return {a.v > b.v ? a.v : b.v}; }
inline V vmin(V a, V b) { return {a.v < b.v ? a.v : b.v}; }
inline float vsum(V a) { return (a.v[0] + a.v[1]) + (a.v[2] + a.v[3]); }
inline float vhmax(V a) {
  float x = a.v[0] > a.v[1] ? a.v[0] : a.v[1], y = a.v[2] > a.v[3] ? a.v[2] : a.v[3];
  return x > y ? x : y;
}
inline V vselect_lt(V a, V b, V z, V y) { return {a.v < b.v ? z.v : y.v}; }
inline bool vany_gt(V a, V b) { return a.v[0] > b.v[0] || a.v[1] > b.v[1] || a.v[2] > b.v[2] || a.v[3] > b.v[3]; }
inline V vrcp(V d) { return {vf4{1.0f, 1.0f, 1.0f, 1.0f} / d.v}; }
inline V vpow2_from_magic(V t) {
  vi4 i;
  memcpy(&i, &t.v, 16);
  i = (i - 0x4B400000 + 127) << 23;
  V r;
  memcpy(&r.v, &i, 16);
  return r;
}
inline void prefetch(const void* p) { __builtin_prefetch(p); }
// kW bytes as floats; and the low / high nibbles of kW bytes as floats.
inline V vload_u8(const uint8_t* p) { return {vf4{(float)p[0], (float)p[1], (float)p[2], (float)p[3]}}; }
inline V vload_s8(const uint8_t* p) {
  return {vf4{(float)(int8_t)p[0], (float)(int8_t)p[1], (float)(int8_t)p[2], (float)(int8_t)p[3]}};
}
inline void vload_nibbles(const uint8_t* p, V& lo, V& hi) {
  for (int i = 0; i < 4; ++i) lo.v[i] = (float)(p[i] & 15), hi.v[i] = (float)(p[i] >> 4);
}
inline void vload_dword_nibbles(const uint8_t* p, int shift, V& lo, V& hi) {
  for (int i = 0; i < 4; ++i) {
    uint32_t d;
    memcpy(&d, p + 4 * i, 4);
    lo.v[i] = (float)((d >> shift) & 15), hi.v[i] = (float)((d >> (shift + 4)) & 15);
  }
}
inline V vload_dword_byte(const uint8_t* p, int shift) {
  V r;
  for (int i = 0; i < 4; ++i) {
    uint32_t d;
    memcpy(&d, p + 4 * i, 4);
    r.v[i] = (float)((d >> shift) & 255);
  }
  return r;
}
inline void vload_dword_e2m1(const uint8_t* p, int shift, V& lo, V& hi) {
  for (int i = 0; i < 4; ++i) {
    uint32_t d;
    memcpy(&d, p + 4 * i, 4);
    lo.v[i] = (float)kE2m1Twice[(d >> shift) & 15], hi.v[i] = (float)kE2m1Twice[(d >> (shift + 4)) & 15];
  }
}
inline V vload_exp2(const uint8_t* p) {
  V r;
  for (int i = 0; i < 4; ++i) {
    const uint32_t u = (uint32_t)p[i] << 23;
    memcpy(&r.v[i], &u, 4);
  }
  return r;
}
inline void vload_dword_sixes(const uint8_t* p, const uint8_t* h, int shift, int hshift, V& lo, V& hi) {
  for (int i = 0; i < 4; ++i) {
    uint32_t d, e;
    memcpy(&d, p + 4 * i, 4);
    memcpy(&e, h + 4 * i, 4);
    lo.v[i] = (float)(((d >> shift) & 15) | ((e >> hshift) & 3) << 4);
    hi.v[i] = (float)(((d >> (shift + 4)) & 15) | ((e >> (hshift + 2)) & 3) << 4);
  }
}
// Lane i of the result = the sum of the lanes of r[i].
inline V vhsum(const V r[4]) { return {vf4{vsum(r[0]), vsum(r[1]), vsum(r[2]), vsum(r[3])}}; }

#endif

// Bytes of one stored element (an own copy of dtype_size_bytes, which is not inline-safe here).
inline int64_t elem_bytes(DType dt) { return dt == DType::F32 ? 4 : 2; }

// kW elements of a weight row starting at element i, converted to fp32 (n < kW: the first n, rest 0).
inline V vload_w(const void* p, DType dt, int64_t i) {
  if (dt == DType::F16) return vload_f16((const uint16_t*)p + i);
  if (dt == DType::BF16) return vload_bf16((const uint16_t*)p + i);
  return vload((const float*)p + i);
}
inline V vload_w_n(const void* p, DType dt, int64_t i, int n) {
  if (dt == DType::F16) return vload_f16_n((const uint16_t*)p + i, n);
  if (dt == DType::BF16) return vload_bf16_n((const uint16_t*)p + i, n);
  return vload_n((const float*)p + i, n);
}

// exp(x) in fp32, ~1 ulp (Cephes expf polynomial): exp(x) = 2^n * p(r), n = round(x / ln2).
// Returns 0 below -87.33 (and for -inf), saturates at exp(88) above 88.
inline V vexp(V x) {
  const V lo = vset1(-87.3365447505f);
  V xc = vmin(vmax(x, lo), vset1(88.0f));
  const V magic = vset1(12582912.0f);  // 1.5 * 2^23: adding it rounds to the nearest integer
  V t = vfma(xc, vset1(1.44269504088896341f), magic);
  V n = t - magic;
  V r = vfma(n, vset1(-0.693359375f), xc);
  r = vfma(n, vset1(2.12194440e-4f), r);
  V p = vset1(1.9875691500e-4f);
  p = vfma(p, r, vset1(1.3981999507e-3f));
  p = vfma(p, r, vset1(8.3334519073e-3f));
  p = vfma(p, r, vset1(4.1665795894e-2f));
  p = vfma(p, r, vset1(1.6666665459e-1f));
  p = vfma(p, r, vset1(5.0000001201e-1f));
  p = vfma(p, r * r, r + vset1(1.0f));
  V y = p * vpow2_from_magic(t);
  return vselect_lt(x, lo, vzero(), y);
}

// tanh(x) in fp32 to ~4e-7 relative: x P(x^2) / Q(x^2), a rational fit of relative error 6e-8 on [0, 9]
// (minimax by reweighted least squares; tanh(9) is 1 in fp32), with x clamped to +-9 and the result to +-1.
// Half the instructions of the exp form 1 - 2 / (exp(2x) + 1), and no cancellation near 0. NaN stays NaN (the
// clamps return their second operand when one is NaN).
inline V vtanh(V x) {
  const V xc = vmin(vset1(9.0f), vmax(vset1(-9.0f), x)), t = xc * xc;
  V p = vset1(1.825389492e-11f);
  p = vfma(p, t, vset1(-1.277983230e-08f));
  p = vfma(p, t, vset1(9.267189853e-06f));
  p = vfma(p, t, vset1(2.920733998e-03f));
  p = vfma(p, t, vset1(1.291920096e-01f));
  p = vfma(p, t, vset1(9.999999404e-01f));
  V q = vset1(2.280965127e-04f);
  q = vfma(q, t, vset1(2.376305126e-02f));
  q = vfma(q, t, vset1(4.625248611e-01f));
  q = vfma(q, t, vset1(1.0f));
  return vmax(vset1(-1.0f), vmin(vset1(1.0f), xc * p * vrcp(q)));
}

// r = kW: a whole vector; r < kW: the first r lanes (0 past them). Inlined with a constant r, the test folds.
inline V vload_r(const float* p, int r) { return r == kW ? vload(p) : vload_n(p, r); }
inline void vstore_r(float* p, V a, int r) {
  if (r == kW) vstore(p, a);
  else vstore_n(p, a, r);
}

// A grow-only heap buffer for the per-call scratch of kernels called many times per token (one per
// call site, thread_local): no malloc/free on every decode call. (No std::vector in an ISA unit: see
// isa_prelude.h.)
struct ScratchBuffer {
  void* p = nullptr;
  size_t bytes = 0;
  ~ScratchBuffer() { free(p); }
  void* get(size_t need) {
    if (bytes < need) {
      free(p);
      p = malloc(need);
      if (p == nullptr) abort();  // out of memory; no way to report it from a kernel
      bytes = need;
    }
    return p;
  }
};
