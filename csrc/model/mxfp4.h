// OCP MXFP4, the format gpt-oss ships its experts in: per block of 32 inputs along a row, 16 bytes of e2m1 codes (codes
// 0..7 = 0, 0.5, 1, 1.5, 2, 3, 4, 6, codes 8..15 the same negated) and one e8m0 scale byte e (2^(e - 127); 255 is NaN).
// Two layouts of the same numbers:
//   HF (the hub's checkpoints): blocks [N, K / 32, 16] and scales [N, K / 32] apart; value 2j in byte j's low nibble,
//     2j + 1 in its high one.
//   GGUF (llama.cpp's MXFP4 type): 17-byte blocks, e then 16 bytes; value j in the low nibble of byte j % 16 for
//     j < 16, the high one for j >= 16.
// Both are read as an int4 source with MXFP4 groups (core/int4_source.h): the kernels keep the codes as they are and
// each scale byte as the fp32 exponent field of its halved value (ops::GroupHead::Mxfp4, 4.25 bits a weight, the
// file's size; exact but for e <= 1, weights below 2^-123, read as 0).
#pragma once
#include <stdint.h>

#include <string>

#include "core/int4_source.h"
#include "core/tensor.h"
#include "model/ggml_blocks.h"

namespace lmkit {

// The source of an MXFP4 weight [N, K] in HF's layout (blocks [N, K / 32, 16] U8, scales [N, K / 32] U8; views of
// one expert's rows), its outputs in `rows` order (null: stored order). Throws InvalidArgument naming `what` for shapes
// that do not fit, and when a block read has the NaN scale (255).
Int4Source mxfp4_source(const Tensor& blocks, const Tensor& scales, const RowOrder& rows, const std::string& what);

// The same of a GGUF MXFP4 tensor t ([N, K], 17-byte blocks).
Int4Source mxfp4_ggml_source(const Tensor& t, const RowOrder& rows, const std::string& what);

}  // namespace lmkit
