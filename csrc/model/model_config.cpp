#include "model/model_config.h"

#include "core/check.h"

namespace lmkit {

void ModelConfig::validate() const {
  LMKIT_CHECK_ARG(vocab_size > 0, architecture, ": vocab_size must be > 0, got ", vocab_size);
  LMKIT_CHECK_ARG(hidden_size > 0, architecture, ": hidden_size must be > 0, got ", hidden_size);
  LMKIT_CHECK_ARG(intermediate_size > 0, architecture, ": intermediate_size must be > 0, got ", intermediate_size);
  LMKIT_CHECK_ARG(num_layers > 0, architecture, ": num_hidden_layers must be > 0, got ", num_layers);
  LMKIT_CHECK_ARG(num_heads > 0 && num_kv_heads > 0 && num_heads % num_kv_heads == 0, architecture,
                  ": num_attention_heads (", num_heads, ") must be a positive multiple of num_key_value_heads (",
                  num_kv_heads, ")");
  LMKIT_CHECK_ARG(head_dim > 0 && head_dim % 2 == 0, architecture, ": head_dim must be even and > 0, got ", head_dim);
  LMKIT_CHECK_ARG((int32_t)inv_freq.size() == head_dim / 2, architecture, ": rope inv_freq has ", inv_freq.size(),
                  " entries, head_dim / 2 = ", head_dim / 2);
  LMKIT_CHECK_ARG(rms_norm_eps > 0, architecture, ": rms_norm_eps must be > 0");
  LMKIT_CHECK_ARG(sliding_window >= 0, architecture, ": sliding_window must be >= 0");
}

}  // namespace lmkit
