// Architecture families by name: a new family is one file under models/ and one line here.
#include <string>

#include "core/check.h"
#include "model/model.h"
#include "model/models/families.h"

namespace lmkit {

namespace {

using ModelFactory = std::unique_ptr<Executor> (*)(const ModelConfig&, ModelWeights, std::unique_ptr<Backend>,
                                                   const ModelOptions&);
struct Family {
  const char* name;
  ModelFactory make;
};
constexpr Family kFamilies[] = {
    {"llama", make_llama},
    {"gemma", make_gemma},
};

}  // namespace

std::unique_ptr<Executor> make_model(const ModelConfig& config, ModelWeights weights, std::unique_ptr<Backend> backend,
                                     const ModelOptions& options) {
  std::string known;
  for (const Family& f : kFamilies) {
    if (config.family == f.name) return f.make(config, std::move(weights), std::move(backend), options);
    known += std::string(known.empty() ? "" : ", ") + f.name;
  }
  LMKIT_CHECK_ARG(false, config.architecture, ": unknown model family '", config.family, "'; known: ", known);
  return nullptr;
}

}  // namespace lmkit
