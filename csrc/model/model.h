// A decoder-only transformer over the backend interface: the weights packed by the backend, the step (Batch
// in, StepOutput out), the head (final norm, lm_head, soft-cap, sampling) and the layer kinds every family
// assembles (token mixers: attention, full or windowed, optional q/k norm, RoPE table or none, soft-cap, output
// gate; or a recurrent Gated DeltaNet layer over the state pool; gated MLP, dense or a mixture of experts).
// A family (models/<family>.cpp) writes only forward_layers(), once for every backend, and registers by name
// in registry.cpp.
#pragma once
#include <stdint.h>

#include <memory>
#include <string>
#include <vector>

#include "engine/executor.h"
#include "model/backend.h"
#include "model/model_config.h"
#include "model/weights.h"

namespace lmkit {

struct ModelOptions {
  int32_t block_size_tokens = 64;
  int32_t max_step_tokens = 8192;  // rows of one forward at most (prefill budget + decodes)
  // Run the multi-token-prediction head (speculative='mtp'): its layer's K/V as the pool's last layer, and every
  // step's final hidden states kept for mtp_step.
  bool mtp = false;
  std::vector<KVQuant> kv_quant;   // per layer; empty: KVQuant::kNone (the backend's full precision) everywhere
};

class DecoderModel : public Executor {
 public:
  DecoderModel(const ModelConfig& config, ModelWeights weights, std::unique_ptr<Backend> backend,
               const ModelOptions& options);

  StepOutput step(const Batch& batch) override;
  StepOutput mtp_step(const Batch& batch, const std::vector<int32_t>& hidden_rows) override;
  bool runs_mtp() const override { return options_.mtp; }
  int64_t kv_bytes_per_block() const override { return backend_->kv_bytes_per_block(); }
  int64_t linear_weight_bytes() const override;
  int32_t mtp_num_layers() const override { return (int32_t)weights_.mtp.layers.size(); }
  int64_t mtp_weight_bytes() const override { return weights_.mtp.size_bytes; }
  // Every linear but the experts (and their routers): what each step reads whatever the routing.
  int64_t dense_weight_bytes() const;
  void allocate_kv_pool(int32_t num_blocks) override { backend_->allocate_kv_pool(num_blocks); }
  bool can_copy_kv_blocks() const override { return backend_->can_copy_kv_blocks(); }
  void read_kv_block(int32_t block, void* dst) const override { backend_->read_kv_block(block, dst); }
  void write_kv_block(int32_t block, const void* src) override { backend_->write_kv_block(block, src); }
  int64_t state_bytes_per_slot() const override { return backend_->state_bytes_per_slot(); }
  void allocate_state_pool(int32_t num_slots) override { backend_->allocate_state_pool(num_slots); }
  int32_t vocab_size() const override { return config_.vocab_size; }
  void bind_thread() override { backend_->bind_thread(); }
  void release_idle_memory(const std::vector<int32_t>& free_blocks) override {
    backend_->release_idle_memory(free_blocks);
  }
  const ModelConfig& config() const { return config_; }

 protected:
  // Embedding and every layer over `rows` rows. Leaves the residual stream in residual() and the last block's
  // output, not yet added, in hidden(): the head adds them.
  virtual void forward_layers(int64_t rows) = 0;

  struct Layer {
    PackedLinear qkv, attn_gate, o_proj, gate_up, down_proj;  // attn_gate: the attention output gate, or empty
    PackedExperts moe;  // a mixture-of-experts layer's MLP (router non-empty), instead of gate_up / down_proj
    // its shared expert (config shared_expert_intermediate_size), or empty: gate | up, down, and the [1, hidden] gate
    PackedLinear shared_gate_up, shared_down, shared_gate;
    DeviceVector input_norm, post_attention_norm, pre_mlp_norm, post_mlp_norm, q_norm, k_norm;
    DeviceVector sinks;  // the attention sinks (config attention_sinks), or empty
    DeviceVector v_norm;  // ones of head_dim (config has_v_norm), or empty
    // moe_beside_mlp (Gemma 4): the dense MLP's output norm, the experts' input and output norms, and the router's
    // input norm (its scale / sqrt(hidden) as the weight)
    DeviceVector post_mlp_norm_1, pre_moe_norm, post_moe_norm, router_norm;
    float scalar = 1.0f;  // the residual stream times this after the layer (config has_layer_scalar)
    // per-layer embeddings (config per_layer_input_size): the gate, the projection back and its norm, or empty
    PackedLinear ple_gate, ple_proj;
    DeviceVector ple_norm;
    AttentionSpec attention;
    // a recurrent layer (is_recurrent) instead of attention: q | k | v | z | b | a in one linear, and out_proj
    bool is_recurrent = false;
    PackedLinear recurrent_in, recurrent_out;
    DeviceVector conv_weight, decay_rate, dt_bias, recurrent_norm;
    RecurrentSpec recurrent;
    // Bytes of its linears as packed: all but the experts and their router (what every step reads), and those.
    int64_t dense_bytes() const;
    int64_t expert_bytes() const;
  };
  // h [rows, hidden] -> layer l's token mixer (self-attention, or its recurrent layer) -> h (output linear applied)
  void mixer_block(int32_t l, int64_t rows, void* h);
  // h [rows, hidden] -> self-attention of layer l -> h (o_proj applied)
  void attention_block(int32_t l, int64_t rows, void* h);
  // h [rows, hidden] -> the Gated DeltaNet mixer of layer l -> h (out_proj applied)
  void recurrent_block(int32_t l, int64_t rows, void* h);
  // h [rows, hidden] -> gated MLP of layer l (dense, or its mixture of experts and shared expert) -> h
  void mlp_block(int32_t l, int64_t rows, void* h);
  void mlp_block(const Layer& w, int32_t l, int64_t rows, void* h);  // layer w shaped as config layer l
  // Gemma 4's MoE layer (config moe_beside_mlp): x [rows, hidden] the residual stream, h = pre_mlp_norm(x) ->
  // h = post_mlp_norm(post_mlp_norm_1(mlp(h)) + post_moe_norm(experts(pre_moe_norm(x), routed on router_norm(x))))
  void mlp_beside_experts_block(int32_t l, int64_t rows, const void* x, void* h);
  // Per-layer embeddings (config per_layer_input_size P): from the scaled embeddings x [rows, hidden], every
  // layer's input ple_ [rows, layers, P] = (norm(proj(x) / sqrt(hidden)) + table[ids] * sqrt(P)) / sqrt(2).
  void per_layer_inputs(int64_t rows, const void* x);
  // The end of layer l with per-layer embeddings: x += h (the block output still pending), then
  // h = norm(proj(act(gate(x)) * ple_[:, l])), pending in turn.
  void per_layer_input_block(int32_t l, int64_t rows, void* x, void* h);
  // h [rows, hidden] -> the gated MLP gate_up, down (inter wide) -> out; h and out may alias
  void gated_mlp(const void* h, int64_t rows, const PackedLinear& gate_up, const PackedLinear& down, int64_t inter,
                 void* out);

  Backend& backend() { return *backend_; }
  void* residual() { return residual_.get(); }
  void* hidden() { return hidden_.get(); }

  const ModelConfig config_;
  std::vector<Layer> layers_;

 private:
  // Final norm of logit rows [first, first + n) into head_hidden_ [n, hidden], then (with logits) the lm_head and
  // soft-cap: logits_ [n, vocab].
  void head(int64_t first, int64_t n, bool logits);

  std::unique_ptr<Backend> backend_;
  ModelOptions options_;
  Activation activation_ = Activation::kSilu;
  MoeSpec moe_spec_;
  int64_t step_expert_bytes_ = 0;  // routers and experts the current step ran
  DeviceVector final_norm_;
  PackedLinear lm_head_;
  PackedLinear ple_model_proj_;  // per-layer embeddings: the projection of the scaled embeddings, and its norm
  DeviceVector ple_proj_norm_;
  // The MTP head (options_.mtp): its decoder layer (config mtp_shape_layer()'s shape, KV pool layer num_layers),
  // fc, its three norms; mtp_hidden_ [max_step_tokens, hidden]: the last step's final hidden states, every row;
  // mtp_cat_ [max_step_tokens, 2 hidden]: fc's input; mtp_attn_, mtp_gate_ [max_head_rows, q]: the attention
  // output and gate of the rows whose logits are drawn
  Layer mtp_layer_;
  PackedLinear mtp_fc_;
  DeviceVector mtp_norm_embedding_, mtp_norm_hidden_, mtp_norm_;
  std::shared_ptr<void> mtp_hidden_, mtp_cat_, mtp_attn_, mtp_gate_;
  std::vector<RopeTable> rope_tables_;  // [0] global, [1] local
  ModelWeights weights_;                // keeps the mapped files of views still read (embedding)
  // Workspaces, max_step_tokens rows (wide_: the fused q/k/v output, then gate | up; shared_: the shared expert's
  // output and its gate's [rows, 1]; moe_in_, router_in_: Gemma 4's experts' and router's inputs); head:
  // max_head_rows().
  std::shared_ptr<void> residual_, hidden_, wide_, attn_, gate_, shared_, shared_gate_, moe_in_, router_in_,
      head_residual_, head_hidden_, logits_, ple_, ple_gate_;
};

// The family's model for config.family (registry.cpp); InvalidArgument listing the known families otherwise.
std::unique_ptr<Executor> make_model(const ModelConfig& config, ModelWeights weights,
                                     std::unique_ptr<Backend> backend, const ModelOptions& options);

}  // namespace lmkit
