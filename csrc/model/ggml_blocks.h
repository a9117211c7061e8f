// GGUF's (llama.cpp's) quantized block types, read where they lie in the mapped file: each linear through the
// source its kernel's packer takes (core/int4_source.h), each embedding row dequantized when a token looks it up.
// Nothing is dequantized into a full copy. Blocks of 32 values along a row (the input dimension), per block:
//   Q4_0: d fp16, qs[16]             value j = (nibble_j - 8) * d                      -> int4, zero 8, scale d
//   Q4_1: d fp16, m fp16, qs[16]     value j = nibble_j * d + m                        -> int4 with offset m
//   Q5_0: d fp16, qh u32, qs[16]     value j = (nibble_j | bit j of qh << 4) - 16) * d  -> int8 blocks (-16..15)
//   Q8_0: d fp16, qs[32] int8        value j = qs[j] * d                               -> int8 blocks
//   Q4_K: super-blocks of 256: d fp16, dmin fp16, 8 x (6-bit sc, 6-bit m), qs[128]; sub-block i (32 values)
//         value = q * d * sc_i - dmin * m_i                                           -> int4, K-quant heads
//   Q5_K: super-blocks of 256: d fp16, dmin fp16, 8 x (6-bit sc, 6-bit m), qh[32], qs[128]; sub-block i (32 values)
//         value = q5 * d * sc_i - dmin * m_i, q5 = nibble | bit i of qh << 4           -> int8 blocks with offsets
//   Q6_K: super-blocks of 256: ql[128], qh[64], int8 sc[16], d fp16; sub-block i (16 values)
//         value = (q6 - 32) * d * sc_i                                               -> int8 blocks of 16
//   MXFP4: e e8m0, qs[16]           value j = e2m1(nibble_j) * 2^(e - 127)            -> int4, MXFP4 heads
//         (model/mxfp4.h, with HF's layout; exact but for e <= 1, weights below 2^-123, read as 0)
// nibble_j = qs[j] & 15 for j < 16, qs[j - 16] >> 4 for j >= 16. Each is lossless in the kernels' layouts (Q5_0
// widened to 8 bits: 8.5 bits per weight instead of 5.5, the price of running on the int8 kernels; Q5_K's q5 as
// int8 values with d * sc and -dmin * m as fp32 scale and offset, both exact).
#pragma once
#include <stdint.h>

#include <memory>
#include <string>
#include <vector>

#include "core/int4_source.h"
#include "core/tensor.h"

namespace lmkit {

// A row order: output n of the layer is stored row (*order)[n]; null: n. Fewer entries than stored rows select
// those rows (a part of a fused projection, as Qwen3.5's query and gate rows). (GGUF's llama q/k projections hold
// each head's rotary pairs interleaved; the loader reads them back in HF's order, ggml_rotary_row_order.)
using RowOrder = std::shared_ptr<const std::vector<int32_t>>;

// The rows of a [num_heads * head_dim, K] projection that llama.cpp's convert_hf_to_gguf.py permuted for its
// interleaved rotary: HF row h * head_dim + j * head_dim / 2 + i is GGUF row h * head_dim + 2 i + j.
RowOrder ggml_rotary_row_order(int64_t num_heads, int64_t head_dim);

// The block types read as int8 values (the rest as int4).
inline bool dtype_is_int8_block(DType t) {
  return t == DType::Q8_0 || t == DType::Q5_0 || t == DType::Q5_K || t == DType::Q6_K;
}

// Sources of a block tensor t ([N, K], dtype Q4_0 / Q4_1 / Q4_K / MXFP4 for int4, Q5_0 / Q8_0 / Q5_K / Q6_K for int8;
// K whole blocks). Throw InvalidArgument naming `what` when the dtype or shape does not fit.
Int4Source ggml_int4_source(const Tensor& t, const RowOrder& rows, const std::string& what);
Int8Source ggml_int8_source(const Tensor& t, const RowOrder& rows, const std::string& what);

// out[0:K] = row `row` of block tensor t ([N, K]) as fp32, exactly as the gguf package dequantizes it.
void ggml_dequantize_row(const Tensor& t, int64_t row, float* out);

// A dense tensor [N, K] (F32/F16/BF16) with its rows in `rows` order, owned by `storage` (a copy: only the q/k
// projections of GGUF llama files stored in a float dtype).
Tensor reorder_rows(const Tensor& t, const RowOrder& rows, std::shared_ptr<void>& storage);

}  // namespace lmkit
