// The int4 checkpoint layouts lmkit loads, each read through one Int4Source (core/int4_source.h) that the
// backends' packers consume: nothing is dequantized, the nibbles, zeros and scales are moved as they are.
// A layout's tensors (N = out_features, K = in_features, G = groups along K; every int32 holds 8 nibbles,
// the first at bits 0..3):
//   AwqGemm (AutoAWQ "GEMM"; quant_method awq):  qweight I32 [K, N / 8], qzeros I32 [G, N / 8] with output
//       columns 0, 2, 4, 6, 1, 3, 5, 7 at nibbles 0..7;  scales F16 [G, N].
//   Gptq, GptqV2 (GPTQ / GPTQModel; checkpoint_format gptq or gptq_v2):  qweight I32 [K / 8, N] packed along
//       K;  qzeros I32 [G, N / 8] packed along N, stored as zero - 1 in gptq (read back by adding 0x11111111 to
//       the word, as GPTQModel does) and as is in gptq_v2;  scales [G, N];  g_idx I32 [K] (optional): the group
//       of each input (act-order: desc_act).
//   PackQuantized (compressed-tensors "pack-quantized", int4):  weight_packed I32 [N, K / 8] packed along K,
//       values q + 8;  weight_zero_point I32 [N / 8, G] packed along N, values z + 8 (asymmetric; absent when
//       symmetric: zero 8);  weight_scale [N, G];  weight_g_idx I32 [K] (optional, actorder "group").
// Every layout: weight[n, k] = (q - zero) * scale with q, zero in 0..15 after the offsets above. Scales in
// BF16 / F32 are rounded to fp16 (exact for BF16 scales in fp16's normal range). Groups larger than 128
// (a whole row: per-channel) become groups of 128, 64 or 32 that repeat the scale and zero: lossless.
#pragma once
#include <string>

#include "core/int4_source.h"
#include "core/tensor.h"

namespace lmkit {

enum class Int4Layout : uint8_t { None, AwqGemm, Gptq, GptqV2, PackQuantized };

// "" -> None, "awq", "gptq", "gptq_v2", "pack_quantized"; throws InvalidArgument listing them otherwise.
Int4Layout parse_int4_layout(const std::string& name);
const char* int4_layout_name(Int4Layout layout);
// One int4 linear as stored (views into the checkpoint's tensors named above; lmkit.models hands them over as
// the roles "<linear>.values", ".zeros", ".scales", ".g_idx"); zeros and g_idx may be empty where the layout
// allows.
struct Int4Tensors {
  Int4Layout layout = Int4Layout::None;
  Tensor values, zeros, scales, g_idx;
};

// The reader of a linear [num_out, num_in] stored as `t`, its checkpoint's group size `group_size` (0: one
// group per row). Checks every tensor's dtype and shape, the group size (a multiple of 32) and the g_idx groups
// (each of exactly group_size inputs); throws InvalidArgument naming `what` (the linear's role) and the tensor.
Int4Source int4_source(const Int4Tensors& t, int64_t num_out, int64_t num_in, int64_t group_size,
                       const std::string& what);

}  // namespace lmkit
