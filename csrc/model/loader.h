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

// Decides the KV pool's block count once the weights are packed, from what only the C++ side knows: the
// bytes of one block, the bytes held beside the pool (the packed linear weights and the recurrent-state pool),
// the resolved session_len and, on CUDA, the GPU memory still free for it (0 on the CPU). The policy lives in
// one place, lmkit/memory.py (plan_kv_pool, plan_cuda_kv_pool).
// What it throws ends create_engine.
using KVPoolSizer = std::function<int32_t(int64_t kv_bytes_per_block, int64_t resident_bytes,
                                          int32_t session_len, int64_t device_free_bytes)>;

// Checks the config against the model, maps the weights, sizes the KV pool through size_kv_pool and starts the
// engine. Throws InvalidArgument naming the setting when something cannot work (device, sizes).
std::unique_ptr<Engine> create_engine(const EngineConfig& config, const ModelConfig& model,
                                      const std::map<std::string, TensorSource>& sources,
                                      const std::vector<int32_t>& eos_token_ids, const KVPoolSizer& size_kv_pool);

}  // namespace lmkit
