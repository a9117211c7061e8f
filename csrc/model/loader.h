// Builds a ready engine from the user's config, the model's config and its weight sources.
#pragma once
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "engine/engine.h"
#include "model/model_config.h"
#include "model/weights.h"

namespace lmkit {

// Checks the config against the model, maps the weights, sizes the KV pool and starts the engine.
// Throws InvalidArgument naming the setting when something cannot work (device, quant_policy, sizes).
std::unique_ptr<Engine> create_engine(const EngineConfig& config, const ModelConfig& model,
                                      const std::map<std::string, TensorSource>& sources,
                                      const std::vector<int32_t>& eos_token_ids);

}  // namespace lmkit
