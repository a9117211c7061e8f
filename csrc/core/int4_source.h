// An int4 weight as a checkpoint stores it, seen through one reader: the input contract of every backend's
// int4 packer (ops::pack_linear_int4, cuda::repack_int4). The checkpoint layouts (AutoAWQ GEMM, GPTQ,
// compressed-tensors pack-quantized) implement it in model/int4_layouts.cpp; the packers know none of them.
//
//   weight[n, j] = (q[j, n] - zero[j / group_size, n]) * scale[j / group_size, n]     n < num_out, j < num_in
//   (or q[j, n] * scale + offset[j / group_size, n] where the source has offsets, or
//    q[j, n] * d[g, n] * sc[g, n] - dmin[g, n] * m[g, n], g = j / group_size, where it has K-quant groups, or
//    e2m1(q[j, n]) * 2^(e[g, n] - 127) where it has MXFP4 groups, or
//    e2m1(q[j, n]) * scale[g, n] / nvfp4_global_scale where it has NVFP4 groups)
//   layer output[n] = sum_j weight[n, j] * x[input_perm[j]]     (x[j] when input_perm is empty)
//
// input_perm makes act-order checkpoints (GPTQ desc_act, whose g_idx scatters a group's inputs) contiguous in
// groups: the reader presents the inputs in that order and the backend gathers x by it before the product.
#pragma once
#include <stdint.h>

#include <functional>
#include <memory>
#include <vector>

namespace lmkit {

struct Int4Source {
  int64_t num_out = 0, num_in = 0;  // the weight is [num_out, num_in]
  int32_t group_size = 0;           // 32, 64 or 128 (NVFP4: 16); divides num_in
  std::shared_ptr<const std::vector<int32_t>> input_perm;  // null, or num_in distinct input indices
  // Reads group g (inputs [g * group_size, (g + 1) * group_size) in the order above) for outputs
  // [n0, n0 + count): q[r * count + c] = q of input g * group_size + r, output n0 + c (0..15);
  // zeros[c] (0..15) and scales[c] (fp16 bits) of output n0 + c. Thread-safe: packers call it in parallel.
  std::function<void(int64_t g, int64_t n0, int64_t count, uint8_t* q, uint8_t* zeros, uint16_t* scales)> read_group;
  // Set for affine groups (GGUF Q4_1: weight[n, j] = q * scale + offset, no zero point): offsets[c] (fp16 bits) of
  // group g, output n0 + c; read_group's zeros are then ignored. Thread-safe as read_group.
  std::function<void(int64_t g, int64_t n0, int64_t count, uint16_t* offsets)> read_offsets;
  // Set for K-quant groups (GGUF Q4_K, group_size 32: weight[n, j] = q * (d * sc) - dmin * m): d[c], dmin[c]
  // (fp16 bits: the super-block's) and sc[c], m[c] (0..63: the group's) of group g, output n0 + c; read_group's
  // zeros and scales are then ignored. Thread-safe as read_group. At most one of read_offsets and read_kquant.
  std::function<void(int64_t g, int64_t n0, int64_t count, uint16_t* d, uint16_t* dmin, uint8_t* sc, uint8_t* m)>
      read_kquant;
  // Set for MXFP4 groups (group_size 32): read_group's q are e2m1 codes (weight = e2m1(q) * 2^(e - 127); codes
  // 0..7 are 0, 0.5, 1, 1.5, 2, 3, 4, 6 and 8..15 the same negated), its zeros and scales ignored; e[c] is the e8m0
  // scale byte of group g, output n0 + c (the NaN 255 refused by the reader). Thread-safe as read_group; never with
  // offsets or K-quant groups.
  std::function<void(int64_t g, int64_t n0, int64_t count, uint8_t* e)> read_e8m0;
  // Nonzero for NVFP4 groups (group_size 16): read_group's q are e2m1 codes (as MXFP4's) and its scales each block's
  // FP8 E4M3 scale as fp16 bits (exact: E4M3's values are fp16 values), its zeros ignored; every weight is divided by
  // this, the tensor's global scale (compressed-tensors' weight_global_scale; positive and finite). Never with
  // offsets, K-quant or MXFP4 groups.
  float nvfp4_global_scale = 0.0f;
  // Every zero is 8 (GGUF Q4_0; symmetric GPTQ, AWQ or compressed-tensors checkpoints): the packer then keeps no
  // zeros (ops::GroupHead::Symmetric) and checks each one read_group gives. Without offsets or K-quant groups only.
  bool symmetric = false;
  bool has_offsets() const { return read_offsets != nullptr; }
  bool has_kquant() const { return read_kquant != nullptr; }
  bool has_e8m0() const { return read_e8m0 != nullptr; }
  bool has_nvfp4() const { return nvfp4_global_scale != 0.0f; }
};

// An int8 weight as a checkpoint stores it (GGUF Q8_0, Q5_0): weight[n, j] = q[j, n] * scale[j / 32, n], q in
// -127..127 (-128 allowed), blocks of 32 inputs with fp16 scales; or (GGUF Q6_K) blocks of 16 inputs with fp32
// scales; or (GGUF Q5_K) blocks of 32 with fp32 scales and offsets: q * scale + offset. The input of ops::pack_linear_int8 from a
// checkpoint.
struct Int8Source {
  int64_t num_out = 0, num_in = 0;  // the weight is [num_out, num_in]; num_in a multiple of 32
  // Reads block b (inputs [32 b, 32 b + 32)) for outputs [n0, n0 + count): q[r * count + c] = q of input
  // 32 b + r, output n0 + c; scales[c] (fp16 bits). Thread-safe.
  std::function<void(int64_t b, int64_t n0, int64_t count, int8_t* q, uint16_t* scales)> read_block;
  // Set instead of read_block for blocks of 16 inputs (b: inputs [16 b, 16 b + 16)) with fp32 scales[c].
  std::function<void(int64_t b, int64_t n0, int64_t count, int8_t* q, float* scales)> read_block16;
  // Set beside read_block16 where a block's scale is d[c] * sc[c] (GGUF Q6_K): d (fp16 bits) shared by the 16 blocks
  // of a super-block of 256 inputs, sc an int8 of block b's own, and every q in -32..31. The packer then keeps 6
  // bits per value (ops::WeightFormat::Int6) where K is a multiple of 256.
  std::function<void(int64_t b, int64_t n0, int64_t count, uint16_t* d, int8_t* sc)> read_block16_kquant;
  // Set instead of both for blocks of 32 whose values are q * scales[c] + offsets[c] (fp32 each).
  std::function<void(int64_t b, int64_t n0, int64_t count, int8_t* q, float* scales, float* offsets)>
      read_block_offsets;
  bool is_set() const { return read_block != nullptr || read_block16 != nullptr || read_block_offsets != nullptr; }
};

}  // namespace lmkit
