#include "model/model_config.h"

#include <algorithm>
#include <cmath>

#include "core/check.h"

namespace lmkit {

void ModelConfig::validate() const {
  const std::string& a = architecture;
  LMKIT_CHECK_ARG(vocab_size > 0, a, ": vocab_size must be > 0, got ", vocab_size);
  LMKIT_CHECK_ARG(hidden_size > 0, a, ": hidden_size must be > 0, got ", hidden_size);
  LMKIT_CHECK_ARG(num_layers > 0, a, ": num_hidden_layers must be > 0, got ", num_layers);
  LMKIT_CHECK_ARG(num_heads > 0 && num_kv_heads > 0 && num_heads % num_kv_heads == 0, a,
                  ": num_attention_heads (", num_heads, ") must be a positive multiple of num_key_value_heads (",
                  num_kv_heads, ")");
  LMKIT_CHECK_ARG(head_dim > 0 && head_dim % 2 == 0, a, ": head_dim must be even and > 0, got ", head_dim);
  LMKIT_CHECK_ARG(rotary_dim >= 0 && rotary_dim <= head_dim && rotary_dim % 2 == 0, a,
                  ": the rotary dimension must be even and at most head_dim (", head_dim, "), got ", rotary_dim);
  for (const std::vector<int32_t>* v : {&layer_head_dim, &layer_num_kv_heads, &layer_v_from_k})
    LMKIT_CHECK_ARG(v->empty() || (int32_t)v->size() == num_layers, a, ": a per-layer attention list has ", v->size(),
                    " entries for ", num_layers, " layers");
  for (int32_t l = 0; l < num_layers; ++l) {
    const int32_t hd = head_dim_of(l), kvh = kv_heads_of(l);
    LMKIT_CHECK_ARG(hd > 0 && hd % 2 == 0, a, ": layer ", l, " head_dim must be even and > 0, got ", hd);
    LMKIT_CHECK_ARG(kvh > 0 && num_heads % kvh == 0, a, ": layer ", l, " num_attention_heads (", num_heads,
                    ") must be a positive multiple of its KV heads (", kvh, ")");
  }
  // Without per-layer head dims the global table covers rotary_dim; with them each table covers at most the head
  // dims of the layers that use it (Gemma 4: 256 local, 512 global with zero frequencies past its rotated part).
  if (layer_head_dim.empty())
    LMKIT_CHECK_ARG((int32_t)inv_freq.size() == rotary_dims() / 2, a, ": rope inv_freq has ", inv_freq.size(),
                    " entries, rotary_dim / 2 = ", rotary_dims() / 2);
  LMKIT_CHECK_ARG(!layer_head_dim.empty() || inv_freq_local.empty() || inv_freq_local.size() == inv_freq.size(), a,
                  ": the local rope table has ", inv_freq_local.size(), " entries, the global one ", inv_freq.size());
  LMKIT_CHECK_ARG(rms_norm_eps > 0, a, ": rms_norm_eps must be > 0");
  LMKIT_CHECK_ARG(hidden_act == "silu" || hidden_act == "gelu_tanh" || hidden_act == "clamped_swiglu", a,
                  ": hidden_act '", hidden_act, "' is not supported (silu, gelu_tanh, clamped_swiglu)");
  LMKIT_CHECK_ARG(hidden_act != "clamped_swiglu" || (swiglu_limit > 0 && std::isfinite(swiglu_limit) &&
                                                     std::isfinite(swiglu_alpha)),
                  a, ": the clamped SwiGLU needs a finite swiglu_limit > 0, got ", swiglu_limit);
  LMKIT_CHECK_ARG(std::isfinite(attn_scale) && attn_scale >= 0, a, ": attn_scale must be >= 0");
  LMKIT_CHECK_ARG(attn_logit_softcap >= 0 && final_logit_softcap >= 0, a, ": soft-caps must be >= 0");
  LMKIT_CHECK_ARG((int32_t)layer_rope.size() == num_layers, a, ": layer_rope has ", layer_rope.size(),
                  " entries for ", num_layers, " layers");
  LMKIT_CHECK_ARG((int32_t)layer_sliding_window.size() == num_layers, a, ": layer_sliding_window has ",
                  layer_sliding_window.size(), " entries for ", num_layers, " layers");
  for (int32_t l = 0; l < num_layers; ++l) {
    LMKIT_CHECK_ARG(layer_rope[l] >= 0 && layer_rope[l] <= 2, a, ": layer ", l, " rope table ", layer_rope[l],
                    " is not 0 (none), 1 (global) or 2 (local)");
    LMKIT_CHECK_ARG(layer_rope[l] != 2 || !inv_freq_local.empty(), a, ": layer ", l,
                    " uses the local rope table, which is empty");
    LMKIT_CHECK_ARG(layer_sliding_window[l] >= 0, a, ": layer ", l, " sliding window must be >= 0");
    const std::vector<float>& table = layer_rope[l] == 2 ? inv_freq_local : inv_freq;
    LMKIT_CHECK_ARG(layer_rope[l] == 0 || (int32_t)table.size() * 2 <= head_dim_of(l), a, ": layer ", l,
                    " rope table rotates ", table.size() * 2, " dims of a head of ", head_dim_of(l));
  }
  LMKIT_CHECK_ARG(layer_moe.empty() || (int32_t)layer_moe.size() == num_layers, a, ": layer_moe has ",
                  layer_moe.size(), " entries for ", num_layers, " layers");
  bool any_dense = false;  // a layer with the dense MLP of intermediate_size (0 where every layer is MoE)
  for (int32_t l = 0; l < num_layers; ++l) any_dense = any_dense || !is_moe_layer(l);
  LMKIT_CHECK_ARG(intermediate_size > 0 || (!any_dense && intermediate_size == 0), a,
                  ": intermediate_size must be > 0, got ", intermediate_size);
  LMKIT_CHECK_ARG(mtp_num_layers >= 0, a, ": mtp_num_hidden_layers must be >= 0, got ", mtp_num_layers);
  LMKIT_CHECK_ARG(mtp_num_layers == 0 || mtp_shape_layer() >= 0, a,
                  ": an MTP head needs a full-attention layer to take its shape from; every layer is recurrent");
  LMKIT_CHECK_ARG(layer_recurrent.empty() || (int32_t)layer_recurrent.size() == num_layers, a,
                  ": layer_recurrent has ", layer_recurrent.size(), " entries for ", num_layers, " layers");
  if (num_recurrent_layers() > 0) {
    LMKIT_CHECK_ARG(linear_num_key_heads > 0 && linear_num_value_heads > 0 &&
                        linear_num_value_heads % linear_num_key_heads == 0,
                    a, ": linear_num_value_heads (", linear_num_value_heads,
                    ") must be a positive multiple of linear_num_key_heads (", linear_num_key_heads, ")");
    LMKIT_CHECK_ARG(linear_key_head_dim > 0 && linear_key_head_dim <= 512 && linear_value_head_dim > 0 &&
                        linear_value_head_dim <= 512,
                    a, ": linear attention head dims must be in [1, 512], got ", linear_key_head_dim, " and ",
                    linear_value_head_dim);
    LMKIT_CHECK_ARG(linear_conv_kernel >= 1 && linear_conv_kernel <= 8, a,
                    ": linear_conv_kernel_dim must be in [1, 8], got ", linear_conv_kernel);
  }
  const bool any_moe = std::any_of(layer_moe.begin(), layer_moe.end(), [](int32_t m) { return m != 0; });
  if (any_moe) {
    LMKIT_CHECK_ARG(num_experts > 0 && num_experts_per_tok > 0 && num_experts_per_tok <= num_experts, a,
                    ": num_experts_per_tok (", num_experts_per_tok, ") must be in [1, num_experts = ", num_experts, "]");
    LMKIT_CHECK_ARG(moe_intermediate_size > 0, a, ": moe_intermediate_size must be > 0, got ",
                    moe_intermediate_size);
  }
  LMKIT_CHECK_ARG(!moe_beside_mlp || (any_moe && intermediate_size > 0 && family == "gemma"), a,
                  ": the MLP beside the experts needs MoE layers, an intermediate_size and the gemma family");
  for (const std::vector<int32_t>* v : {&layer_kv_source, &layer_intermediate_size})
    LMKIT_CHECK_ARG(v->empty() || (int32_t)v->size() == num_layers, a, ": a per-layer list has ", v->size(),
                    " entries for ", num_layers, " layers");
  for (int32_t l = 0; l < num_layers; ++l) {
    const int32_t s = kv_source(l);
    LMKIT_CHECK_ARG(s >= 0 && s <= l, a, ": layer ", l, " reads the KV cache of layer ", s, ", not an earlier one");
    if (s == l) continue;
    LMKIT_CHECK_ARG(!reads_shared_kv(s) && !is_recurrent_layer(s) && !is_recurrent_layer(l), a, ": layer ", l,
                    " reads the KV cache of layer ", s, ", which keeps none of its own");
    LMKIT_CHECK_ARG(head_dim_of(s) == head_dim_of(l) && kv_heads_of(s) == kv_heads_of(l) &&
                        layer_sliding_window[s] == layer_sliding_window[l] && layer_rope[s] == layer_rope[l],
                    a, ": layer ", l, " reads the KV cache of layer ", s, ", whose head dim, KV heads, window or "
                    "rotary table differ");
    LMKIT_CHECK_ARG(!v_from_k(l), a, ": layer ", l, " reads another layer's KV cache and takes values from k_proj");
  }
  for (int32_t l = 0; l < num_layers; ++l)
    LMKIT_CHECK_ARG((is_moe_layer(l) && !moe_beside_mlp) || intermediate_of(l) > 0, a, ": layer ", l,
                    " intermediate size must be > 0, got ", intermediate_of(l));
  LMKIT_CHECK_ARG(per_layer_input_size >= 0, a, ": hidden_size_per_layer_input must be >= 0, got ",
                  per_layer_input_size);
  LMKIT_CHECK_ARG(per_layer_input_size == 0 || family == "gemma", a, ": per-layer embeddings need the gemma family");
  LMKIT_CHECK_ARG(shared_expert_intermediate_size >= 0, a, ": shared_expert_intermediate_size must be >= 0, got ",
                  shared_expert_intermediate_size);
}

int32_t ModelConfig::num_recurrent_layers() const {
  return (int32_t)std::count_if(layer_recurrent.begin(), layer_recurrent.end(), [](int32_t r) { return r != 0; });
}

float ModelConfig::softmax_scale(int32_t l) const {
  return attn_scale > 0 ? attn_scale : 1.0f / std::sqrt((float)head_dim_of(l));
}

int32_t ModelConfig::max_q_size() const {
  int32_t widest = q_size();
  for (int32_t l = 0; l < num_layers; ++l) widest = std::max(widest, q_size_of(l));
  return widest;
}

int32_t ModelConfig::max_intermediate_size() const {
  int32_t widest = intermediate_size;
  for (int32_t l = 0; l < num_layers; ++l) widest = std::max(widest, intermediate_of(l));
  return widest;
}

int32_t ModelConfig::max_qkv_size() const {
  int32_t widest = q_size() + 2 * kv_size();
  for (int32_t l = 0; l < num_layers; ++l) widest = std::max(widest, q_size_of(l) + 2 * kv_size_of(l));
  return widest;
}

int32_t ModelConfig::attention_window_tokens() const {
  int32_t window = 0;
  for (int32_t w : layer_sliding_window) {
    if (w <= 0) return 0;
    window = std::max(window, w);
  }
  return window;
}

int32_t ModelConfig::mtp_shape_layer() const {
  for (int32_t l = num_layers - 1; l >= 0; --l)
    if (!is_recurrent_layer(l)) return l;
  return -1;
}

}  // namespace lmkit
