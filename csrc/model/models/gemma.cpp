// Gemma 2 and Gemma 3 (text): norms before and after each block, embeddings scaled by sqrt(hidden), GeGLU,
// (1 + w) norms (ModelConfig::norm_weight_offset), soft-capping and alternating windows as data.
//   x = embed(ids) * sqrt(hidden)
//   per layer:  x += post_norm(attention(norm(x)));  x += post_norm(mlp(norm(x)))
#include "model/models/families.h"

namespace lmkit {

namespace {

class GemmaModel final : public DecoderModel {
 public:
  using DecoderModel::DecoderModel;

 protected:
  void forward_layers(int64_t rows) override {
    const ModelConfig& c = config_;
    Backend& b = backend();
    void* x = residual();
    void* h = hidden();
    const int64_t H = c.hidden_size;
    const float eps = c.rms_norm_eps;
    b.embedding(rows, H, c.embed_scale, x);
    for (int32_t l = 0; l < c.num_layers; ++l) {
      const Layer& w = layers_[l];
      if (l == 0)
        b.rmsnorm(x, w.input_norm, eps, rows, H, h);
      else  // x += the previous layer's normed mlp output (in h); h = norm(x)
        b.add_rmsnorm(x, h, w.input_norm, eps, rows, H, h);
      mixer_block(l, rows, h);
      b.rmsnorm(h, w.post_attention_norm, eps, rows, H, h);
      b.add_rmsnorm(x, h, w.pre_mlp_norm, eps, rows, H, h);
      mlp_block(l, rows, h);
      b.rmsnorm(h, w.post_mlp_norm, eps, rows, H, h);
    }
  }
};

}  // namespace

std::unique_ptr<Executor> make_gemma(const ModelConfig& config, ModelWeights weights, std::unique_ptr<Backend> backend,
                                     const ModelOptions& options) {
  return std::make_unique<GemmaModel>(config, std::move(weights), std::move(backend), options);
}

}  // namespace lmkit
