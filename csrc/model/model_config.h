// The decoder's shape and constants, filled from config.json by lmkit.models (Python) and checked here.
#pragma once
#include <stdint.h>

#include <string>
#include <vector>

namespace lmkit {

struct ModelConfig {
  std::string architecture;  // e.g. "LlamaForCausalLM" (for messages)
  int32_t vocab_size = 0;
  int32_t hidden_size = 0;
  int32_t intermediate_size = 0;
  int32_t num_layers = 0;
  int32_t num_heads = 0;
  int32_t num_kv_heads = 0;
  int32_t head_dim = 0;
  float rms_norm_eps = 1e-6f;
  std::vector<float> inv_freq;  // [head_dim / 2], rope scaling already applied (computed as HF does)
  float attention_scaling = 1.0f;
  int32_t sliding_window = 0;  // 0: full attention
  bool has_qkv_bias = false;
  bool tie_word_embeddings = false;
  int32_t max_position_embeddings = 0;
  int32_t awq_group_size = 0;  // > 0: an AWQ int4 checkpoint with this group size (dense layers allowed)

  // Throws InvalidArgument naming the field when the shape is impossible.
  void validate() const;
  int32_t q_size() const { return num_heads * head_dim; }
  int32_t kv_size() const { return num_kv_heads * head_dim; }
};

}  // namespace lmkit
