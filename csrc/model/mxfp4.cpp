#include "model/mxfp4.h"

#include <cmath>
#include <memory>

#include "core/check.h"
#include "core/dtype.h"

namespace lmkit {

namespace {

constexpr int8_t kTwiceE2m1[16] = {0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12};

// 2^(e - 128): the scale of twice the e2m1 values (exact in fp32 for every e < 255)
float half_e8m0(uint8_t e) { return std::ldexp(1.0f, (int)e - 128); }

// Where the scale byte of block b of stored row n lies, and its nibbles (value i of the block, i < 32).
struct Layout {
  const uint8_t* scales;
  int64_t row_stride, block_stride;  // of the scale bytes
  const uint8_t* codes;
  int64_t code_row_stride, code_block_stride;
  bool ggml;  // value i in nibble i % 16 (ggml) or in byte i / 2, nibble i % 2 (HF)
  uint8_t scale(int64_t n, int64_t b) const { return scales[n * row_stride + b * block_stride]; }
  int8_t value(int64_t n, int64_t b, int64_t i) const {
    const uint8_t* q = codes + n * code_row_stride + b * code_block_stride;
    const uint8_t byte = ggml ? q[i % 16] : q[i / 2];
    return kTwiceE2m1[(ggml ? i >= 16 : i % 2) ? byte >> 4 : byte & 15];
  }
};

Int8Source make_source(const Layout& l, int64_t stored, int64_t nb, const RowOrder& rows, const std::string& what) {
  Int8Source src;
  src.num_out = rows ? (int64_t)rows->size() : stored;
  src.num_in = nb * 32;
  if (rows)
    for (int32_t r : *rows) LMKIT_CHECK_ARG(r >= 0 && r < stored, what, ": MXFP4 row ", r, " of ", stored);
  auto row = [rows](int64_t n) { return rows ? (int64_t)(*rows)[n] : n; };
  src.read_block16 = [l, row, what](int64_t b, int64_t n0, int64_t count, int8_t* out, float* out_scales) {
    const int64_t block = b / 2, half = b % 2;  // 16 inputs: half of an MXFP4 block
    for (int64_t c = 0; c < count; ++c) {
      const int64_t n = row(n0 + c);
      const uint8_t e = l.scale(n, block);
      LMKIT_CHECK_ARG(e != 255, what, ": MXFP4 row ", n, " block ", block, " has the NaN scale (255)");
      out_scales[c] = half_e8m0(e);
      for (int64_t i = 0; i < 16; ++i) out[i * count + c] = l.value(n, block, half * 16 + i);
    }
  };
  return src;
}

}  // namespace

Int8Source mxfp4_int8_source(const Tensor& blocks, const Tensor& scales, const RowOrder& rows, const std::string& what) {
  LMKIT_CHECK_ARG(blocks.dtype == DType::U8 && scales.dtype == DType::U8 && blocks.ndim == 3 && scales.ndim == 2 &&
                      blocks.shape[2] == 16 && blocks.shape[0] == scales.shape[0] &&
                      blocks.shape[1] == scales.shape[1],
                  what, ": MXFP4 blocks must be U8 [N, K / 32, 16] with U8 scales [N, K / 32]");
  const int64_t nb = blocks.shape[1];
  const Layout l{static_cast<const uint8_t*>(scales.data), nb, 1, static_cast<const uint8_t*>(blocks.data), nb * 16, 16,
                 false};
  return make_source(l, blocks.shape[0], nb, rows, what);
}

Int8Source mxfp4_ggml_int8_source(const Tensor& t, const RowOrder& rows, const std::string& what) {
  LMKIT_CHECK_ARG(t.dtype == DType::MXFP4 && t.ndim == 2 && t.shape[1] % 32 == 0, what,
                  ": an MXFP4 tensor [N, K] with K a multiple of 32");
  const int64_t nb = t.shape[1] / 32;
  const uint8_t* base = static_cast<const uint8_t*>(t.data);
  const Layout l{base, nb * 17, 17, base + 1, nb * 17, 17, true};
  return make_source(l, t.shape[0], nb, rows, what);
}

}  // namespace lmkit
