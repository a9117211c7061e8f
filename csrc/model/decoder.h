// The Llama-family decoder (Llama, Mistral, Qwen2) on the CPU backend: one fused forward over a
// BatchPlan that mixes prefill chunks and decode tokens, K/V kept in the blocked pool.
#pragma once
#include <stdint.h>

#include <memory>
#include <vector>

#include "engine/executor.h"
#include "kernels/ops.h"
#include "model/model_config.h"
#include "model/weights.h"

namespace lmkit {

struct DecoderOptions {
  int32_t block_size_tokens = 64;
  int32_t max_step_tokens = 8192;  // rows of one forward at most (prefill budget + decodes)
  int32_t num_threads = 0;         // 0: all cores
  bool awq_int8_activations = true;  // ops::LinearWeight::int8_activations of every AWQ layer
  bool bf16_linear = false;          // dense linear layers packed as bf16 pairs (ops::pack_linear_bf16)
  std::vector<int32_t> kv_bits;    // per layer: 32 (fp32; bf16 with bf16_linear where it fits), 8 or 4; empty: 32
  std::vector<int32_t> eos_token_ids;
  int32_t max_blocks_per_seq = 0;  // ceil(session_len / block size): the CUDA graphs' fixed block tables
  bool cuda_graphs = true;         // CUDA backend: decode steps as CUDA graphs
};

class DecoderModel : public Executor {
 public:
  DecoderModel(const ModelConfig& config, ModelWeights weights, const DecoderOptions& options);
  ~DecoderModel() override;

  void step(const BatchPlan& plan, std::vector<int32_t>& sampled) override;
  int64_t kv_bytes_per_block() const override;
  int64_t linear_weight_bytes() const override;
  void allocate_kv_pool(int32_t num_blocks) override;
  int32_t vocab_size() const override { return config_.vocab_size; }
  void bind_thread() override;

  const ModelConfig& config() const { return config_; }
  int64_t weight_size_bytes() const { return weights_.size_bytes; }

 private:
  // hidden_out: [rows, hidden] final-normed hidden states of the rows listed in logit_rows.
  void forward(const BatchPlan& plan);
  void split_qkv(int64_t T, float*& q, float*& k, float*& v);
  ops::KVLayer kv_layer(int32_t layer) const;
  ops::KVLayer kv_layer_shape(int32_t layer) const;  // without storage

  ModelConfig config_;
  ModelWeights weights_;
  // The linear weights in the kernels' layout, packed once here (the mapped files keep the rest).
  // q/k/v and gate/up run fused (one call each: one thread team, one int8 quantization of the input)
  // when ops::concat_linear can join them; the parts are then dropped, else `qkv` / `gate_up` stay empty.
  struct PackedLayer {
    ops::LinearWeight qkv, q_proj, k_proj, v_proj, o_proj, gate_up, gate_proj, up_proj, down_proj;
    std::vector<float> qkv_bias;  // fp32 [q_size + 2 kv_size] with qkv, when the model has q/k/v biases
    std::vector<const ops::LinearWeight*> all() const {
      return {&qkv, &q_proj, &k_proj, &v_proj, &o_proj, &gate_up, &gate_proj, &up_proj, &down_proj};
    }
  };
  std::vector<PackedLayer> packed_;
  ops::LinearWeight lm_head_;
  DecoderOptions options_;

  // KV pool: per layer, K then V, each num_blocks blocks in that layer's format (ops::KVLayer),
  // lazily committed. kv_layer_offset_[l]: bytes before layer l's K, per block of the pool.
  char* kv_pool_ = nullptr;
  std::vector<int64_t> kv_layer_offset_;
  int64_t kv_pool_bytes_ = 0;
  int32_t num_blocks_ = 0;

  // Per-step inputs, rebuilt from the plan.
  std::vector<int32_t> token_ids_, positions_, slots_;
  std::vector<ops::AttnSeq> attn_seqs_;
  std::vector<int32_t> logit_rows_;  // rows whose logits are needed, in plan order

  // Workspace rows: max_step_tokens.
  // wide_: [rows, max(2 intermediate, q_size + 2 kv_size)], the fused q/k/v output, then gate | up.
  std::vector<float> residual_, hidden_, q_, k_, v_, attn_, wide_, logits_, gathered_;
};

}  // namespace lmkit
