// The engine loop's view of the model: one call runs a planned step. Implemented by model/ (CPU now,
// CUDA later); the engine core stays free of kernels so its bookkeeping is unit-tested anywhere.
#pragma once
#include <stdint.h>

#include <vector>

#include "engine/scheduler.h"

namespace lmkit {

class Executor {
 public:
  virtual ~Executor() = default;
  // Runs one fused forward over plan. For every plan.seqs[i] with is_sampled, sampled[i] receives the next
  // token (sampled with that sequence's parameters and generator); others get -1. Sequences with
  // output_logits get their new logits rows appended to pending_logits. Does not advance sequence state.
  virtual void step(const BatchPlan& plan, std::vector<int32_t>& sampled) = 0;
  // Bytes of KV memory one block of the pool takes (all layers, K and V).
  virtual int64_t kv_bytes_per_block() const = 0;
  // Bytes of weights one decode step reads (every linear layer and the lm_head, as packed): with the
  // KV bytes, the memory traffic that bounds decode speed (benchmark/profile_generation.py's roofline).
  virtual int64_t linear_weight_bytes() const = 0;
  // Allocates the pool; called once by the engine before the first step.
  virtual void allocate_kv_pool(int32_t num_blocks) = 0;
  virtual int32_t vocab_size() const = 0;
  // Called once on the engine's loop thread before its first step (thread pools, device binding).
  virtual void bind_thread() {}
};

}  // namespace lmkit
