// OCP MXFP4, the format gpt-oss ships its experts in: per block of 32 inputs along a row, 16 bytes of e2m1 codes
// (value 2j in byte j's low nibble, 2j + 1 in its high one; codes 0..7 = 0, 0.5, 1, 1.5, 2, 3, 4, 6, codes 8..15 the
// same negated) and one e8m0 scale byte e (2^(e - 127); 255 is NaN), in two tensors: blocks [N, K / 32, 16] and
// scales [N, K / 32]. Twice an e2m1 value is an integer in -12..12, so a block is exactly int8 values times
// 2^(e - 128): it is read as the int8 kernels' blocks of 16 inputs with fp32 scales, lossless.
#pragma once
#include <stdint.h>

#include <string>

#include "core/int4_source.h"
#include "core/tensor.h"
#include "model/ggml_blocks.h"

namespace lmkit {

// The int8 source of an MXFP4 weight [N, K] (blocks [N, K / 32, 16] U8, scales [N, K / 32] U8; views of one expert's
// rows), its outputs in `rows` order (null: stored order). Throws InvalidArgument naming `what` for shapes that do
// not fit, and when a block read has the NaN scale (255).
Int8Source mxfp4_int8_source(const Tensor& blocks, const Tensor& scales, const RowOrder& rows, const std::string& what);

// Value j of stored row n of an MXFP4 weight, as fp32 (for tests and the float64 references).
float mxfp4_value(const Tensor& blocks, const Tensor& scales, int64_t n, int64_t j);

}  // namespace lmkit
