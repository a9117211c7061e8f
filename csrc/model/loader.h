// Builds a ready engine from the user's config, the model's config and its weight sources.
#pragma once
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "engine/engine.h"
#include "model/model_config.h"
#include "model/weights.h"

namespace lmkit {

// The two per-sequence pools: KV blocks, and recurrent-state slots (0 for a model without recurrent layers).
struct PoolSizes {
  int32_t num_blocks = 0;
  int32_t num_state_slots = 0;  // for sequences and prefix-cache snapshots
  int32_t num_draft_state_slots = 0;  // besides those, for speculative decoding's checkpoints
  int32_t num_store_queue_blocks = 0;  // the disk store's queue: evicted blocks' copies waiting for its writer
};

// Decides the pools once the weights are packed, from what only the C++ side knows: the bytes of one KV block
// and of one state slot (0: no recurrent layer), the packed linear weights' bytes, the resolved session_len and,
// on CUDA, the GPU memory still free for them (0 on the CPU). The policy lives in one place, lmkit/memory.py
// (plan_pools, plan_cuda_pools). What it throws ends create_engine.
using PoolSizer = std::function<PoolSizes(int64_t kv_bytes_per_block, int64_t state_bytes_per_slot,
                                          int64_t linear_weight_bytes, int32_t session_len,
                                          int64_t device_free_bytes)>;

// speculative='draft''s draft model: its config and weight sources (a model with the target's tokenizer).
struct DraftSpec {
  ModelConfig model;
  std::map<std::string, TensorSource> sources;
};

// Checks the config against the model, maps the weights, sizes the pools through size_pools and starts the
// engine. Throws InvalidArgument naming the setting when something cannot work (device, sizes). draft: the draft
// model of config.speculative.draft_model (else null), built on the same backend options, its KV pool of as many
// blocks as the model's (size_pools sees a block's bytes and the linear weights' bytes of both together).
std::unique_ptr<Engine> create_engine(const EngineConfig& config, const ModelConfig& model,
                                      const std::map<std::string, TensorSource>& sources,
                                      const std::vector<int32_t>& eos_token_ids, const PoolSizer& size_pools,
                                      const DraftSpec* draft = nullptr);

}  // namespace lmkit
