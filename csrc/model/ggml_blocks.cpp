#include "model/ggml_blocks.h"

#include <cmath>
#include <cstring>

#include "core/check.h"
#include "kernels/ops.h"
#include "model/mxfp4.h"

namespace lmkit {

namespace {

constexpr int64_t kBlock = 32;

uint16_t load_u16(const uint8_t* p) {
  uint16_t v;
  std::memcpy(&v, p, 2);
  return v;
}

// The bytes of block b (of dtype_block_elems values) of stored row r.
const uint8_t* block_at(const Tensor& t, int64_t r, int64_t b) {
  const int64_t row_bytes = t.shape[1] / dtype_block_elems(t.dtype) * dtype_block_bytes(t.dtype);
  return t.ptr<const uint8_t>() + r * row_bytes + b * dtype_block_bytes(t.dtype);
}

int64_t stored_row(const RowOrder& rows, int64_t n) { return rows ? (*rows)[n] : n; }

// The 32 values of an int8-valued block (Q8_0, Q5_0) as int8, value j at q[j * stride].
void int8_values(DType dtype, const uint8_t* blk, int8_t* q, int64_t stride) {
  if (dtype == DType::Q8_0) {
    for (int64_t j = 0; j < kBlock; ++j) q[j * stride] = (int8_t)blk[2 + j];
    return;
  }
  uint32_t qh;  // Q5_0: bit j is the fifth bit of value j
  std::memcpy(&qh, blk + 2, 4);
  const uint8_t* qs = blk + 6;
  for (int64_t j = 0; j < kBlock / 2; ++j) {
    q[j * stride] = (int8_t)(((qs[j] & 15) | ((qh >> j) & 1) << 4) - 16);
    q[(j + kBlock / 2) * stride] = (int8_t)(((qs[j] >> 4) | ((qh >> (j + 16)) & 1) << 4) - 16);
  }
}

// Q4_K super-block: fp16 d, fp16 dmin, scales[12] (eight 6-bit scales and mins), qs[128]: sub-block j (32 values)
// is the low (j even) or high (j odd) nibbles of qs[32 (j / 2) .. 32 (j / 2) + 31], value = d sc_j q - dmin m_j.
void kquant_scale_min(const uint8_t* scales, int64_t j, uint8_t* sc, uint8_t* m) {
  if (j < 4) {
    *sc = scales[j] & 63;
    *m = scales[j + 4] & 63;
  } else {
    *sc = (uint8_t)((scales[j + 4] & 15) | (scales[j - 4] >> 6) << 4);
    *m = (uint8_t)((scales[j + 4] >> 4) | (scales[j] >> 6) << 4);
  }
}
// The 32 nibbles of sub-block j of a Q4_K super-block, value l at q[l * stride].
void kquant_nibbles(const uint8_t* blk, int64_t j, uint8_t* q, int64_t stride) {
  const uint8_t* qs = blk + 16 + 32 * (j / 2);
  const int shift = (int)(j % 2) * 4;
  for (int64_t l = 0; l < kBlock; ++l) q[l * stride] = (uint8_t)((qs[l] >> shift) & 15);
}

// Q5_K super-block: Q4_K's d, dmin and scales, then qh[32] (bit j of qh[l]: the fifth bit of value l of sub-block
// j), then Q4_K's qs[128]. The 32 values q5 (0..31) of sub-block j, value l at q[l * stride].
void q5k_values(const uint8_t* blk, int64_t j, int8_t* q, int64_t stride) {
  const uint8_t* qh = blk + 16;
  const uint8_t* qs = blk + 48 + 32 * (j / 2);
  const int shift = (int)(j % 2) * 4;
  for (int64_t l = 0; l < kBlock; ++l)
    q[l * stride] = (int8_t)(((qs[l] >> shift) & 15) | ((qh[l] >> j) & 1) << 4);
}

// Value e (0..255) of a Q6_K super-block, q6 - 32: its low 4 bits in ql, its high 2 in qh.
int8_t q6k_value(const uint8_t* blk, int64_t e) {
  const int64_t h = e / 128, r = e % 128;
  const int lo = (blk[h * 64 + r % 64] >> (4 * (r / 64))) & 15;
  const int hi = (blk[128 + h * 32 + r % 32] >> (2 * (r / 32))) & 3;
  return (int8_t)((lo | hi << 4) - 32);
}
float q6k_scale(const uint8_t* blk, int64_t sub) {  // d * sc of sub-block `sub` of 16 values: exact in fp32
  return f16_to_f32(load_u16(blk + 208)) * (float)(int8_t)blk[192 + sub];
}

void check_block_tensor(const Tensor& t, const RowOrder& rows, const std::string& what) {
  const int64_t block = dtype_block_elems(t.dtype);
  LMKIT_CHECK_ARG(t.ndim == 2 && t.shape[0] > 0 && t.shape[1] > 0 && t.shape[1] % block == 0, what, ": a GGUF ",
                  dtype_name(t.dtype), " tensor must be [N, K] with K a multiple of ", block, ", got ", shape_str(t));
  LMKIT_CHECK_ARG(!rows || (!rows->empty() && (int64_t)rows->size() <= t.shape[0]), what, ": a row selection of ",
                  rows ? rows->size() : 0, " entries for ", t.shape[0], " rows");
  if (rows)
    for (int32_t r : *rows) LMKIT_CHECK_ARG(r >= 0 && r < t.shape[0], what, ": row ", r, " of ", t.shape[0]);
}

}  // namespace

RowOrder ggml_rotary_row_order(int64_t num_heads, int64_t head_dim) {
  LMKIT_CHECK_ARG(head_dim % 2 == 0, "interleaved rotary rows need an even head_dim, got ", head_dim);
  auto order = std::make_shared<std::vector<int32_t>>(num_heads * head_dim);
  const int64_t half = head_dim / 2;
  for (int64_t h = 0; h < num_heads; ++h)
    for (int64_t j = 0; j < 2; ++j)
      for (int64_t i = 0; i < half; ++i) (*order)[h * head_dim + j * half + i] = (int32_t)(h * head_dim + 2 * i + j);
  return order;
}

Int4Source ggml_int4_source(const Tensor& t, const RowOrder& rows, const std::string& what) {
  LMKIT_CHECK_ARG(t.dtype == DType::Q4_0 || t.dtype == DType::Q4_1 || t.dtype == DType::Q4_K || t.dtype == DType::MXFP4,
                  what, ": ", dtype_name(t.dtype), " is not a GGUF int4 block type");
  check_block_tensor(t, rows, what);
  if (t.dtype == DType::MXFP4) return mxfp4_ggml_source(t, rows, what);
  Int4Source src;
  src.num_out = rows ? (int64_t)rows->size() : t.shape[0];
  src.num_in = t.shape[1];
  src.group_size = kBlock;
  if (t.dtype == DType::Q4_K) {  // group g: sub-block g % 8 of super-block g / 8
    src.read_group = [t, rows](int64_t g, int64_t n0, int64_t count, uint8_t* q, uint8_t*, uint16_t*) {
      for (int64_t c = 0; c < count; ++c)
        kquant_nibbles(block_at(t, stored_row(rows, n0 + c), g / 8), g % 8, q + c, count);
    };
    src.read_kquant = [t, rows](int64_t g, int64_t n0, int64_t count, uint16_t* d, uint16_t* dmin, uint8_t* sc,
                                uint8_t* m) {
      for (int64_t c = 0; c < count; ++c) {
        const uint8_t* blk = block_at(t, stored_row(rows, n0 + c), g / 8);
        d[c] = load_u16(blk);
        dmin[c] = load_u16(blk + 2);
        kquant_scale_min(blk + 4, g % 8, sc + c, m + c);
      }
    };
    return src;
  }
  const bool q4_1 = t.dtype == DType::Q4_1;
  const int64_t qs = q4_1 ? 4 : 2;  // where the nibbles start in a block
  src.symmetric = !q4_1;            // Q4_0: (q - 8) * d
  src.read_group = [t, rows, qs, q4_1](int64_t g, int64_t n0, int64_t count, uint8_t* q, uint8_t* zeros,
                                       uint16_t* scales) {
    for (int64_t c = 0; c < count; ++c) {
      const uint8_t* blk = block_at(t, stored_row(rows, n0 + c), g);
      scales[c] = load_u16(blk);
      zeros[c] = q4_1 ? 0 : 8;
      for (int64_t j = 0; j < kBlock / 2; ++j) {
        q[j * count + c] = blk[qs + j] & 15;
        q[(j + kBlock / 2) * count + c] = blk[qs + j] >> 4;
      }
    }
  };
  if (q4_1)
    src.read_offsets = [t, rows](int64_t g, int64_t n0, int64_t count, uint16_t* offsets) {
      for (int64_t c = 0; c < count; ++c) offsets[c] = load_u16(block_at(t, stored_row(rows, n0 + c), g) + 2);
    };
  return src;
}

Int8Source ggml_int8_source(const Tensor& t, const RowOrder& rows, const std::string& what) {
  LMKIT_CHECK_ARG(dtype_is_int8_block(t.dtype), what, ": ", dtype_name(t.dtype), " is not a GGUF int8-valued block type");
  check_block_tensor(t, rows, what);
  Int8Source src;
  src.num_out = rows ? (int64_t)rows->size() : t.shape[0];
  src.num_in = t.shape[1];
  if (t.dtype == DType::Q5_K) {  // block b of 32: sub-block b % 8 of super-block b / 8
    src.read_block_offsets = [t, rows](int64_t b, int64_t n0, int64_t count, int8_t* q, float* scales,
                                       float* offsets) {
      for (int64_t c = 0; c < count; ++c) {
        const uint8_t* blk = block_at(t, stored_row(rows, n0 + c), b / 8);
        uint8_t sc, m;
        kquant_scale_min(blk + 4, b % 8, &sc, &m);
        scales[c] = f16_to_f32(load_u16(blk)) * sc;  // both exact: an fp16 value times a 6-bit integer
        offsets[c] = -(f16_to_f32(load_u16(blk + 2)) * m);
        q5k_values(blk, b % 8, q + c, count);
      }
    };
    return src;
  }
  if (t.dtype == DType::Q6_K) {  // block b of 16: sub-block b % 16 of super-block b / 16
    src.read_block16 = [t, rows](int64_t b, int64_t n0, int64_t count, int8_t* q, float* scales) {
      for (int64_t c = 0; c < count; ++c) {
        const uint8_t* blk = block_at(t, stored_row(rows, n0 + c), b / 16);
        scales[c] = q6k_scale(blk, b % 16);
        for (int64_t l = 0; l < 16; ++l) q[l * count + c] = q6k_value(blk, (b % 16) * 16 + l);
      }
    };
    src.read_block16_kquant = [t, rows](int64_t b, int64_t n0, int64_t count, uint16_t* d, int8_t* sc) {
      for (int64_t c = 0; c < count; ++c) {
        const uint8_t* blk = block_at(t, stored_row(rows, n0 + c), b / 16);
        d[c] = load_u16(blk + 208);
        sc[c] = (int8_t)blk[192 + b % 16];
      }
    };
    return src;
  }
  src.read_block = [t, rows](int64_t b, int64_t n0, int64_t count, int8_t* q, uint16_t* scales) {
    for (int64_t c = 0; c < count; ++c) {
      const uint8_t* blk = block_at(t, stored_row(rows, n0 + c), b);
      scales[c] = load_u16(blk);
      int8_values(t.dtype, blk, q + c, count);
    }
  };
  return src;
}

void ggml_dequantize_row(const Tensor& t, int64_t row, float* out) {
  LMKIT_CHECK(dtype_is_block(t.dtype) && t.ndim == 2 && row >= 0 && row < t.shape[0], "ggml_dequantize_row: bad call");
  // through the readers the packers take: each block type's values have one definition
  const int64_t K = t.shape[1];
  if (dtype_is_int8_block(t.dtype)) {
    const Int8Source src = ggml_int8_source(t, nullptr, "embedding");
    const int64_t block = src.read_block16 ? 16 : kBlock;
    for (int64_t b = 0; b < K / block; ++b) {
      int8_t q[kBlock];
      float s, o = 0.0f;
      if (src.read_block_offsets) {
        src.read_block_offsets(b, row, 1, q, &s, &o);
      } else if (src.read_block16) {
        src.read_block16(b, row, 1, q, &s);
      } else {
        uint16_t h;
        src.read_block(b, row, 1, q, &h);
        s = f16_to_f32(h);
      }
      for (int64_t j = 0; j < block; ++j) out[b * block + j] = std::fma((float)q[j], s, o);
    }
    return;
  }
  const Int4Source src = ggml_int4_source(t, nullptr, "embedding");
  for (int64_t g = 0; g < K / kBlock; ++g) {
    uint8_t q[kBlock], zero = 0;
    uint16_t scale = 0;
    src.read_group(g, row, 1, q, &zero, &scale);
    float s = f16_to_f32(scale), o = -(float)zero * s;  // value = q * s + o, every term exact
    if (src.has_e8m0()) {  // twice the e2m1 value times 2^(e - 128): exact
      uint8_t e;
      src.read_e8m0(g, row, 1, &e);
      for (int64_t j = 0; j < kBlock; ++j) out[g * kBlock + j] = std::ldexp((float)ops::kE2m1Twice[q[j]], (int)e - 128);
      continue;
    }
    if (src.has_kquant()) {
      uint16_t d, dmin;
      uint8_t sc, m;
      src.read_kquant(g, row, 1, &d, &dmin, &sc, &m);
      s = f16_to_f32(d) * sc;
      o = -(f16_to_f32(dmin) * m);
    } else if (src.has_offsets()) {
      uint16_t offset;
      src.read_offsets(g, row, 1, &offset);
      o = f16_to_f32(offset);
    }
    for (int64_t j = 0; j < kBlock; ++j) out[g * kBlock + j] = q[j] * s + o;
  }
}

Tensor reorder_rows(const Tensor& t, const RowOrder& rows, std::shared_ptr<void>& storage) {
  LMKIT_CHECK_ARG(t.ndim == 2 && rows && (int64_t)rows->size() == t.shape[0] && !dtype_is_block(t.dtype),
                  "reorder_rows: a float [N, K] tensor and N row indices");
  const int64_t row_bytes = t.shape[1] * dtype_size_bytes(t.dtype);
  storage = std::shared_ptr<void>(new uint8_t[t.shape[0] * row_bytes], std::default_delete<uint8_t[]>());
  for (int64_t n = 0; n < t.shape[0]; ++n)
    std::memcpy(static_cast<uint8_t*>(storage.get()) + n * row_bytes, t.ptr<const uint8_t>() + (*rows)[n] * row_bytes,
                (size_t)row_bytes);
  Tensor out = t;
  out.data = storage.get();
  return out;
}

}  // namespace lmkit
