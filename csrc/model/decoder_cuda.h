// The Llama-family decoder on the CUDA backend: the same fused forward over a BatchPlan as the CPU
// DecoderModel (decoder.h), on device memory with fp16/bf16 activations, through kernels/cuda/ops_cuda.h.
// Built only with the CUDA backend; plain C++ (no CUDA headers).
#pragma once
#include <stdint.h>

#include <map>
#include <memory>
#include <vector>

#include "engine/executor.h"
#include "kernels/cuda/ops_cuda.h"
#include "model/decoder.h"
#include "model/model_config.h"
#include "model/weights.h"

namespace lmkit {

class CudaDecoderModel : public Executor {
 public:
  // Uploads the weights (q/k/v and gate/up fused into one weight each, AWQ repacked) to the current
  // device. Throws with the bytes needed and free when the model does not fit. options.kv_bits: 32 means
  // the activation dtype (16-bit) here.
  CudaDecoderModel(const ModelConfig& config, ModelWeights weights, const DecoderOptions& options);
  ~CudaDecoderModel() override;

  void step(const BatchPlan& plan, std::vector<int32_t>& sampled) override;
  int64_t kv_bytes_per_block() const override { return kv_layer_offset_.back(); }
  int64_t linear_weight_bytes() const override;
  void allocate_kv_pool(int32_t num_blocks) override;
  int32_t vocab_size() const override { return config_.vocab_size; }
  void bind_thread() override;

  DType activation_dtype() const { return act_; }

 private:
  struct Layer {
    cuda::Linear qkv, o_proj, gate_up, down_proj;
    std::shared_ptr<void> qkv_bias, input_norm, post_attention_norm;  // act
  };
  // Fills logit rows' hidden states (eager) or, for a graph step, the logits of every row; returns whether
  // logits_ already holds them (rows in plan order).
  bool forward(const BatchPlan& plan);
  // Embedding and every layer over T rows: residual_ and hidden_ (the last MLP output) end filled.
  void run_layers(int64_t T, const int32_t* d_tokens, const int32_t* d_positions, const int32_t* d_slots,
                  const cuda::AttnBatch& batch, void* attn_workspace);
  // A decode step (every row one token, all rows' logits wanted) of at most max_graph_rows_ rows: padded to
  // the next captured batch size and replayed as a CUDA graph (captured on first use of that size).
  bool is_graph_step(const BatchPlan& plan) const;
  void forward_graph(const BatchPlan& plan);
  void ensure_attention_workspace(int64_t bytes);
  ops::KVLayer kv_layer(int32_t layer) const;
  std::shared_ptr<void> upload_vector(const std::vector<const Tensor*>& parts);  // concatenated, as act

  ModelConfig config_;
  DecoderOptions options_;
  DType act_ = DType::F16;
  int device_ = 0;
  cuda::Stream stream_ = nullptr;

  std::vector<Layer> layers_;
  std::shared_ptr<void> embed_tokens_, final_norm_, inv_freq_;
  DType embed_dtype_ = DType::F16;
  cuda::Linear lm_head_;

  std::shared_ptr<void> kv_pool_;
  std::vector<int64_t> kv_layer_offset_;  // bytes before layer l's K, per block of the pool
  int32_t num_blocks_ = 0;

  // Device workspaces sized for max_step_tokens rows (act unless noted).
  std::shared_ptr<void> residual_, hidden_, qkv_, attn_, gate_up_, mlp_act_;
  std::shared_ptr<void> gathered_res_, gathered_h_, logits_;  // [kLogitRows, hidden], [kLogitRows, vocab]
  std::shared_ptr<void> attn_workspace_;
  int64_t attn_workspace_bytes_ = 0;
  // Per-step int32 inputs in one device buffer (see forward()), and the sampler's.
  std::shared_ptr<void> step_ints_, sample_params_, penalty_ints_, sampled_dev_;
  int64_t step_ints_capacity_ = 0, penalty_capacity_ = 0;

  // Host copies of the per-step inputs.
  std::vector<int32_t> host_ints_, logit_rows_, penalty_host_;

  // CUDA graphs of decode steps, by padded batch size. Their inputs live at fixed addresses: graph_ints_
  // (the per-step int32 layout for that size, block tables max_blocks_per_seq wide) and their own attention
  // workspace (split plan fixed by the longest context, session_len).
  int32_t max_graph_rows_ = 0;
  std::map<int32_t, std::shared_ptr<void>> graphs_;
  std::shared_ptr<void> graph_ints_, graph_attn_workspace_;
  std::vector<float> host_logits_;
  std::vector<uint16_t> host_logits_raw_;
};

}  // namespace lmkit
