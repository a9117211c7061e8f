// An int4 weight as a checkpoint stores it, seen through one reader: the input contract of every backend's
// int4 packer (ops::pack_linear_int4, cuda::repack_int4). The checkpoint layouts (AutoAWQ GEMM, GPTQ,
// compressed-tensors pack-quantized) implement it in model/int4_layouts.cpp; the packers know none of them.
//
//   weight[n, j] = (q[j, n] - zero[j / group_size, n]) * scale[j / group_size, n]     n < num_out, j < num_in
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
  int32_t group_size = 0;           // 32, 64 or 128; divides num_in
  std::shared_ptr<const std::vector<int32_t>> input_perm;  // null, or num_in distinct input indices
  // Reads group g (inputs [g * group_size, (g + 1) * group_size) in the order above) for outputs
  // [n0, n0 + count): q[r * count + c] = q of input g * group_size + r, output n0 + c (0..15);
  // zeros[c] (0..15) and scales[c] (fp16 bits) of output n0 + c. Thread-safe: packers call it in parallel.
  std::function<void(int64_t g, int64_t n0, int64_t count, uint8_t* q, uint8_t* zeros, uint16_t* scales)> read_group;
};

}  // namespace lmkit
