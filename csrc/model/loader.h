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

// Sizes the KV pool once the weights are packed and before the pool is allocated (lmkit/memory.py does it
// for the CPU backend): given the executor's bytes per KV block and packed linear weight bytes and the
// resolved session_len, returns the number of blocks (>= 1). What it throws ends create_engine.
using KVPoolSizer =
    std::function<int32_t(int64_t kv_bytes_per_block, int64_t linear_weight_bytes, int32_t session_len)>;

// Checks the config against the model, maps the weights, sizes the KV pool (size_kv_pool when given, else
// kv_pool_num_blocks) and starts the engine.
// Throws InvalidArgument naming the setting when something cannot work (device, quant_policy, sizes).
std::unique_ptr<Engine> create_engine(const EngineConfig& config, const ModelConfig& model,
                                      const std::map<std::string, TensorSource>& sources,
                                      const std::vector<int32_t>& eos_token_ids,
                                      const KVPoolSizer& size_kv_pool = nullptr);

}  // namespace lmkit
