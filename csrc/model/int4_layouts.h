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
//   Mxfp4PackQuantized, Nvfp4PackQuantized (compressed-tensors "mxfp4-pack-quantized", "nvfp4-pack-quantized"):
//       weight_packed U8 [N, K / 2], e2m1 codes, value 2j in byte j's low nibble and 2j + 1 in its high one;
//       weight_scale [N, K / B]: MXFP4 (B = 32) U8 e8m0 exponents (read as model/mxfp4.h's HF layout), NVFP4
//       (B = 16) FP8 E4M3 bytes (safetensors F8_E4M3, handed over as U8); NVFP4's weight_global_scale [1]:
//       weight[n, k] = e2m1(q) * e4m3(scale) / global_scale.
//   Nvfp4ModelOpt (NVIDIA ModelOpt's NVFP4, quant_method modelopt): the same bytes as weight U8 [N, K / 2] and
//       weight_scale F8_E4M3 [N, K / 16], with weight_scale_2 [1] a multiplier: weight = e2m1 * e4m3 * weight_scale_2
//       (read as the global scale 1 / weight_scale_2: within fp32's rounding of the reciprocal).
// The integer layouts: weight[n, k] = (q - zero) * scale with q, zero in 0..15 after the offsets above. Scales in
// BF16 / F32 are rounded to fp16 (exact for BF16 scales in fp16's normal range). Groups larger than 128
// (a whole row: per-channel) become groups of 128, 64 or 32 that repeat the scale and zero: lossless.
#pragma once
#include <string>

#include "core/int4_source.h"
#include "core/tensor.h"

namespace lmkit {

enum class Int4Layout : uint8_t {
  None, AwqGemm, Gptq, GptqV2, PackQuantized, Mxfp4PackQuantized, Nvfp4PackQuantized, Nvfp4ModelOpt
};

// "" -> None, "awq", "gptq", "gptq_v2", "pack_quantized", "mxfp4_pack_quantized", "nvfp4_pack_quantized",
// "nvfp4_modelopt"; throws InvalidArgument listing them otherwise.
Int4Layout parse_int4_layout(const std::string& name);
const char* int4_layout_name(Int4Layout layout);
// One int4 linear as stored (views into the checkpoint's tensors named above; lmkit.models hands them over as
// the roles "<linear>.values", ".zeros", ".scales", ".g_idx", ".global_scale"); zeros, g_idx and global_scale may be
// empty where the layout allows.
struct Int4Tensors {
  Int4Layout layout = Int4Layout::None;
  Tensor values, zeros, scales, g_idx, global_scale;
};

// The reader of a linear [num_out, num_in] stored as `t`, its checkpoint's group size `group_size` (0: one
// group per row). Checks every tensor's dtype and shape, the group size (a multiple of 32; the FP4 layouts: their
// block) and the g_idx groups
// (each of exactly group_size inputs); throws InvalidArgument naming `what` (the linear's role) and the tensor.
Int4Source int4_source(const Int4Tensors& t, int64_t num_out, int64_t num_in, int64_t group_size,
                       const std::string& what);

}  // namespace lmkit
