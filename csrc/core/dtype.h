// Element types of weights and activations, with scalar fp16/bf16 <-> fp32 conversion.
// Plain C-style header (no std templates): included by the ISA-specific kernel units.
#pragma once
#include <stdint.h>
#include <string.h>

namespace lmkit {

// Q4_0, Q4_1, Q5_0, Q8_0, MXFP4 (blocks of 32 values), Q4_K, Q5_K, Q6_K (super-blocks of 256): GGUF (llama.cpp) block types,
// stored
// as they are in the file and read through model/ggml_blocks.h; a tensor of them has its logical shape, its rows whole
// blocks (dtype_block_*).
enum class DType : int32_t {
  F32 = 0, F16 = 1, BF16 = 2, I32 = 3, I8 = 4, U8 = 5, Q4_0 = 6, Q4_1 = 7, Q8_0 = 8, Q5_0 = 9, Q4_K = 10, Q6_K = 11,
  Q5_K = 12, MXFP4 = 13
};

inline int dtype_size_bytes(DType t) {
  switch (t) {
    case DType::F32: return 4;
    case DType::F16: return 2;
    case DType::BF16: return 2;
    case DType::I32: return 4;
    case DType::I8: return 1;
    case DType::U8: return 1;
    default: return 0;  // block types: dtype_block_bytes
  }
}

inline bool dtype_is_block(DType t) {
  return t == DType::Q4_0 || t == DType::Q4_1 || t == DType::Q5_0 || t == DType::Q8_0 || t == DType::Q4_K ||
         t == DType::Q5_K || t == DType::Q6_K || t == DType::MXFP4;
}
// Values per block (1 for the element types) and bytes per block.
inline int dtype_block_elems(DType t) {
  return t == DType::Q4_K || t == DType::Q5_K || t == DType::Q6_K ? 256 : dtype_is_block(t) ? 32 : 1;
}
inline int dtype_block_bytes(DType t) {
  switch (t) {
    case DType::Q4_0: return 18;  // fp16 d, 16 bytes of nibbles
    case DType::Q4_1: return 20;  // fp16 d, fp16 m, 16 bytes of nibbles
    case DType::Q5_0: return 22;  // fp16 d, 32 high bits, 16 bytes of low nibbles
    case DType::Q8_0: return 34;  // fp16 d, 32 int8
    case DType::Q4_K: return 144;  // fp16 d, fp16 dmin, 12 bytes of 6-bit scales and mins, 128 bytes of nibbles
    case DType::Q5_K: return 176;  // as Q4_K, with 32 bytes of fifth bits between the scales and the nibbles
    case DType::Q6_K: return 210;  // 128 bytes of low nibbles, 64 of high 2-bit pairs, 16 int8 scales, fp16 d
    case DType::MXFP4: return 17;  // e8m0 scale, 16 bytes of e2m1 nibbles
    default: return dtype_size_bytes(t);
  }
}

inline const char* dtype_name(DType t) {
  switch (t) {
    case DType::F32: return "F32";
    case DType::F16: return "F16";
    case DType::BF16: return "BF16";
    case DType::I32: return "I32";
    case DType::I8: return "I8";
    case DType::U8: return "U8";
    case DType::Q4_0: return "Q4_0";
    case DType::Q4_1: return "Q4_1";
    case DType::Q5_0: return "Q5_0";
    case DType::Q8_0: return "Q8_0";
    case DType::Q4_K: return "Q4_K";
    case DType::Q5_K: return "Q5_K";
    case DType::Q6_K: return "Q6_K";
    case DType::MXFP4: return "MXFP4";
  }
  return "?";
}

inline float bf16_to_f32(uint16_t h) {
  uint32_t u = (uint32_t)h << 16;
  float f;
  memcpy(&f, &u, 4);
  return f;
}

// IEEE half -> float, exact for every input (subnormals, inf, nan included).
inline float f16_to_f32(uint16_t h) {
  uint32_t sign = (uint32_t)(h & 0x8000) << 16;
  uint32_t exp = (h >> 10) & 0x1f;
  uint32_t mant = h & 0x3ff;
  uint32_t u;
  if (exp == 0) {
    if (mant == 0) {
      u = sign;
    } else {  // subnormal: normalise
      int e = -1;
      do {
        mant <<= 1;
        ++e;
      } while (!(mant & 0x400));
      mant &= 0x3ff;
      u = sign | ((uint32_t)(127 - 15 - e) << 23) | (mant << 13);
    }
  } else if (exp == 31) {
    u = sign | 0x7f800000u | (mant << 13);
  } else {
    u = sign | ((exp + 127 - 15) << 23) | (mant << 13);
  }
  float f;
  memcpy(&f, &u, 4);
  return f;
}

// float -> IEEE half, round to nearest even.
inline uint16_t f32_to_f16(float f) {
  uint32_t x;
  memcpy(&x, &f, 4);
  uint32_t sign = (x >> 16) & 0x8000;
  int32_t exp = (int32_t)((x >> 23) & 0xff) - 127 + 15;
  uint32_t mant = x & 0x7fffff;
  if (((x >> 23) & 0xff) == 0xff) return (uint16_t)(sign | 0x7c00 | (mant ? 0x200 : 0));
  if (exp >= 31) return (uint16_t)(sign | 0x7c00);
  if (exp <= 0) {
    if (exp < -10) return (uint16_t)sign;
    mant |= 0x800000;
    uint32_t shift = (uint32_t)(14 - exp);
    uint32_t half = mant >> shift;
    uint32_t rem = mant & ((1u << shift) - 1);
    uint32_t mid = 1u << (shift - 1);
    if (rem > mid || (rem == mid && (half & 1))) ++half;
    return (uint16_t)(sign | half);
  }
  uint32_t half = sign | ((uint32_t)exp << 10) | (mant >> 13);
  uint32_t rem = mant & 0x1fff;
  if (rem > 0x1000 || (rem == 0x1000 && (half & 1))) ++half;
  return (uint16_t)half;
}

inline uint16_t f32_to_bf16(float f) {
  uint32_t u;
  memcpy(&u, &f, 4);
  if ((u & 0x7fffffff) > 0x7f800000) return (uint16_t)((u >> 16) | 0x40);  // quiet nan
  u += 0x7fff + ((u >> 16) & 1);
  return (uint16_t)(u >> 16);
}

}  // namespace lmkit
