// Gemma 2, 3 and 4 (text): norms before and after each block, embeddings scaled by sqrt(hidden), GeGLU,
// (1 + w) norms (ModelConfig::norm_weight_offset; Gemma 4: plain w), soft-capping and alternating windows as data;
// Gemma 4's per-layer head dims, value norm and shared k/v are the attention's (AttentionSpec); its MoE layers
// run the dense MLP and the experts side by side (DecoderModel::mlp_beside_experts_block); its E-models' per-layer
// embeddings end each layer (DecoderModel::per_layer_input_block) and their last layers read earlier layers' KV.
//   x = embed(ids) * sqrt(hidden)
//   per layer:  x += post_norm(attention(norm(x)));  x += post_norm(mlp(norm(x)));
//               x += norm(proj(gelu(gate(x)) * ple_l)) (E-models);  x *= scalar (Gemma 4)
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
    if (c.per_layer_input_size > 0) per_layer_inputs(rows, x);
    for (int32_t l = 0; l < c.num_layers; ++l) {
      const Layer& w = layers_[l];
      if (l == 0)
        b.rmsnorm(x, w.input_norm, eps, rows, H, h);
      else  // x += the previous layer's normed mlp output (in h); h = norm(x)
        b.add_rmsnorm(x, h, w.input_norm, eps, rows, H, h);
      mixer_block(l, rows, h);
      b.rmsnorm(h, w.post_attention_norm, eps, rows, H, h);
      b.add_rmsnorm(x, h, w.pre_mlp_norm, eps, rows, H, h);
      if (c.moe_beside_mlp && c.is_moe_layer(l)) {
        mlp_beside_experts_block(l, rows, x, h);  // post_mlp_norm applied
      } else {
        mlp_block(l, rows, h);
        b.rmsnorm(h, w.post_mlp_norm, eps, rows, H, h);
      }
      if (c.per_layer_input_size > 0) per_layer_input_block(l, rows, x, h);
      if (w.scalar != 1.0f) {  // (x + h) * s, the add still deferred: both parts scaled
        b.scale(x, rows, H, w.scalar);
        b.scale(h, rows, H, w.scalar);
      }
    }
  }
};

}  // namespace

std::unique_ptr<Executor> make_gemma(const ModelConfig& config, ModelWeights weights, std::unique_ptr<Backend> backend,
                                     const ModelOptions& options) {
  return std::make_unique<GemmaModel>(config, std::move(weights), std::move(backend), options);
}

}  // namespace lmkit
