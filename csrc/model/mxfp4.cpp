#include "model/mxfp4.h"

#include <cmath>
#include <memory>

#include "core/check.h"

namespace lmkit {

namespace {

constexpr int8_t kTwiceE2m1[16] = {0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12};

// 2^(e - 128): the scale of twice the e2m1 values (exact in fp32 for every e < 255)
float half_e8m0(uint8_t e) { return std::ldexp(1.0f, (int)e - 128); }

}  // namespace

Int8Source mxfp4_int8_source(const Tensor& blocks, const Tensor& scales, const RowOrder& rows, const std::string& what) {
  LMKIT_CHECK_ARG(blocks.dtype == DType::U8 && scales.dtype == DType::U8 && blocks.ndim == 3 && scales.ndim == 2 &&
                      blocks.shape[2] == 16 && blocks.shape[0] == scales.shape[0] &&
                      blocks.shape[1] == scales.shape[1],
                  what, ": MXFP4 blocks must be U8 [N, K / 32, 16] with U8 scales [N, K / 32]");
  const int64_t stored = blocks.shape[0], nb = blocks.shape[1];
  Int8Source src;
  src.num_out = rows ? (int64_t)rows->size() : stored;
  src.num_in = nb * 32;
  if (rows)
    for (int32_t r : *rows) LMKIT_CHECK_ARG(r >= 0 && r < stored, what, ": MXFP4 row ", r, " of ", stored);
  const uint8_t* q = static_cast<const uint8_t*>(blocks.data);
  const uint8_t* e = static_cast<const uint8_t*>(scales.data);
  src.read_block16 = [q, e, nb, rows, what](int64_t b, int64_t n0, int64_t count, int8_t* out, float* out_scales) {
    const int64_t block = b / 2, half = b % 2;  // 16 inputs: half of an MXFP4 block
    for (int64_t c = 0; c < count; ++c) {
      const int64_t n = rows ? (*rows)[n0 + c] : n0 + c;
      const uint8_t scale = e[n * nb + block];
      LMKIT_CHECK_ARG(scale != 255, what, ": MXFP4 row ", n, " block ", block, " has the NaN scale (255)");
      out_scales[c] = half_e8m0(scale);
      const uint8_t* bytes = q + (n * nb + block) * 16 + half * 8;
      for (int j = 0; j < 8; ++j) {
        out[(2 * j) * count + c] = kTwiceE2m1[bytes[j] & 15];
        out[(2 * j + 1) * count + c] = kTwiceE2m1[bytes[j] >> 4];
      }
    }
  };
  return src;
}

float mxfp4_value(const Tensor& blocks, const Tensor& scales, int64_t n, int64_t j) {
  const int64_t nb = blocks.shape[1];
  const uint8_t byte = static_cast<const uint8_t*>(blocks.data)[(n * nb + j / 32) * 16 + (j % 32) / 2];
  const uint8_t e = static_cast<const uint8_t*>(scales.data)[n * nb + j / 32];
  return kTwiceE2m1[j % 2 ? byte >> 4 : byte & 15] * half_e8m0(e);
}

}  // namespace lmkit
