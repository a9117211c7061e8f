// The pre-norm decoder: Llama, Mistral, Qwen2, Qwen3, Phi-3, SmolLM3 (what differs between them is data in
// ModelConfig: biases, q/k norms, windows, RoPE tables and which layers use them, fused checkpoint linears).
//   x = embed(ids)
//   per layer:  x += attention(norm(x));  x += mlp(norm(x))
#include "model/models/families.h"

namespace lmkit {

namespace {

class LlamaModel final : public DecoderModel {
 public:
  using DecoderModel::DecoderModel;

 protected:
  void forward_layers(int64_t rows) override {
    const ModelConfig& c = config_;
    Backend& b = backend();
    void* x = residual();
    void* h = hidden();
    const int64_t H = c.hidden_size;
    b.embedding(rows, H, c.embed_scale, x);
    for (int32_t l = 0; l < c.num_layers; ++l) {
      const Layer& w = layers_[l];
      if (l == 0)
        b.rmsnorm(x, w.input_norm, c.rms_norm_eps, rows, H, h);
      else  // x += the previous layer's mlp output (in h); h = norm(x)
        b.add_rmsnorm(x, h, w.input_norm, c.rms_norm_eps, rows, H, h);
      mixer_block(l, rows, h);
      b.add_rmsnorm(x, h, w.pre_mlp_norm, c.rms_norm_eps, rows, H, h);
      mlp_block(l, rows, h);
    }
  }
};

}  // namespace

std::unique_ptr<Executor> make_llama(const ModelConfig& config, ModelWeights weights, std::unique_ptr<Backend> backend,
                                     const ModelOptions& options) {
  return std::make_unique<LlamaModel>(config, std::move(weights), std::move(backend), options);
}

}  // namespace lmkit
