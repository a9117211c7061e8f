#include "model/mxfp4.h"

#include <memory>

#include "core/check.h"
#include "core/dtype.h"

namespace lmkit {

namespace {

// Where the scale byte of block b of stored row n lies, and its codes (value i of the block, i < 32).
struct Layout {
  const uint8_t* scales;
  int64_t row_stride, block_stride;  // of the scale bytes
  const uint8_t* codes;
  int64_t code_row_stride, code_block_stride;
  bool ggml;  // value i in nibble i % 16 (ggml) or in byte i / 2, nibble i % 2 (HF)
  uint8_t scale(int64_t n, int64_t b) const { return scales[n * row_stride + b * block_stride]; }
  uint8_t code(int64_t n, int64_t b, int64_t i) const {
    const uint8_t* q = codes + n * code_row_stride + b * code_block_stride;
    const uint8_t byte = ggml ? q[i % 16] : q[i / 2];
    return (ggml ? i >= 16 : i % 2) ? byte >> 4 : byte & 15;
  }
};

Int4Source make_source(const Layout& l, int64_t stored, int64_t nb, const RowOrder& rows, const std::string& what) {
  Int4Source src;
  src.num_out = rows ? (int64_t)rows->size() : stored;
  src.num_in = nb * 32;
  src.group_size = 32;
  if (rows)
    for (int32_t r : *rows) LMKIT_CHECK_ARG(r >= 0 && r < stored, what, ": MXFP4 row ", r, " of ", stored);
  auto row = [rows](int64_t n) { return rows ? (int64_t)(*rows)[n] : n; };
  src.read_group = [l, row](int64_t b, int64_t n0, int64_t count, uint8_t* q, uint8_t*, uint16_t*) {
    for (int64_t c = 0; c < count; ++c) {
      const int64_t n = row(n0 + c);
      for (int64_t i = 0; i < 32; ++i) q[i * count + c] = l.code(n, b, i);
    }
  };
  src.read_e8m0 = [l, row, what](int64_t b, int64_t n0, int64_t count, uint8_t* e) {
    for (int64_t c = 0; c < count; ++c) {
      const int64_t n = row(n0 + c);
      e[c] = l.scale(n, b);
      LMKIT_CHECK_ARG(e[c] != 255, what, ": MXFP4 row ", n, " block ", b, " has the NaN scale (255)");
    }
  };
  return src;
}

}  // namespace

Int4Source mxfp4_source(const Tensor& blocks, const Tensor& scales, const RowOrder& rows, const std::string& what) {
  LMKIT_CHECK_ARG(blocks.dtype == DType::U8 && scales.dtype == DType::U8 && blocks.ndim == 3 && scales.ndim == 2 &&
                      blocks.shape[2] == 16 && blocks.shape[0] == scales.shape[0] &&
                      blocks.shape[1] == scales.shape[1],
                  what, ": MXFP4 blocks must be U8 [N, K / 32, 16] with U8 scales [N, K / 32]");
  const int64_t nb = blocks.shape[1];
  const Layout l{static_cast<const uint8_t*>(scales.data), nb, 1, static_cast<const uint8_t*>(blocks.data), nb * 16, 16,
                 false};
  return make_source(l, blocks.shape[0], nb, rows, what);
}

Int4Source mxfp4_ggml_source(const Tensor& t, const RowOrder& rows, const std::string& what) {
  LMKIT_CHECK_ARG(t.dtype == DType::MXFP4 && t.ndim == 2 && t.shape[1] % 32 == 0, what,
                  ": an MXFP4 tensor [N, K] with K a multiple of 32");
  const int64_t nb = t.shape[1] / 32;
  const uint8_t* base = static_cast<const uint8_t*>(t.data);
  const Layout l{base, nb * 17, 17, base + 1, nb * 17, 17, true};
  return make_source(l, t.shape[0], nb, rows, what);
}

}  // namespace lmkit
