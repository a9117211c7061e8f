// The forward of each architecture family, registered by name in model/registry.cpp.
#pragma once
#include "model/model.h"

namespace lmkit {

std::unique_ptr<Executor> make_llama(const ModelConfig& config, ModelWeights weights, std::unique_ptr<Backend> backend,
                                     const ModelOptions& options);
std::unique_ptr<Executor> make_gemma(const ModelConfig& config, ModelWeights weights, std::unique_ptr<Backend> backend,
                                     const ModelOptions& options);

}  // namespace lmkit
