// Mixture-of-experts routing on the host: each row's top-k experts from its router logits, grouped by expert
// so that a backend runs every active expert once per step over all the rows routed to it (its weights read
// once), then adds each row's expert outputs with their router weights.
#pragma once
#include <stdint.h>

#include <vector>

namespace lmkit {

struct ExpertRouting {
  int32_t num_experts = 0;
  // Expert e's entries are [offsets[e], offsets[e + 1]): rows routed to e (ascending) and their weights.
  std::vector<int32_t> offsets;
  std::vector<int32_t> rows;
  std::vector<float> weights;
  int32_t count(int32_t e) const { return offsets[e + 1] - offsets[e]; }
};

// logits [num_rows, num_experts] -> per row the top_k experts by softmax probability (ties: the lower
// expert id first, as torch.topk on CPU), with their probabilities, renormalized to sum 1 when renormalize
// (Qwen3-MoE / OLMoE norm_topk_prob; Mixtral always), grouped by expert into out. Softmax in fp32.
void route_top_k(const float* logits, int64_t num_rows, int32_t num_experts, int32_t top_k, bool renormalize,
                 ExpertRouting& out);

}  // namespace lmkit
