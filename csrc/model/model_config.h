// A model's shape and constants, filled from config.json by lmkit.models (Python, one module per
// architecture) and checked here. Field names are the Python ModelSpec's.
#pragma once
#include <stdint.h>

#include <string>
#include <vector>

namespace lmkit {

struct ModelConfig {
  std::string architecture;  // e.g. "LlamaForCausalLM" (for messages)
  std::string family;        // the forward registered under this name (model/registry.cpp): "llama", "gemma"
  int32_t vocab_size = 0;
  int32_t hidden_size = 0;
  int32_t intermediate_size = 0;
  int32_t num_layers = 0;
  int32_t num_heads = 0;
  int32_t num_kv_heads = 0;
  int32_t head_dim = 0;
  float rms_norm_eps = 1e-6f;
  float norm_weight_offset = 0.0f;  // every RMSNorm scales by (offset + w): Gemma's (1 + w) norms
  float embed_scale = 1.0f;         // embeddings times this (Gemma: sqrt(hidden_size))
  std::string hidden_act = "silu";  // gated MLP: "silu" (SwiGLU), "gelu_tanh" (GeGLU) or "clamped_swiglu" (gpt-oss:
                                    // g = min(gate, limit), u = clamp(up, +-limit), g sigmoid(alpha g) (u + 1))
  float swiglu_alpha = 0.0f, swiglu_limit = 0.0f;  // clamped_swiglu's constants
  float attn_scale = 0.0f;          // softmax scale of q . k; 0: 1 / sqrt(head_dim)
  float attn_logit_softcap = 0.0f;  // > 0: scores = cap * tanh(scores / cap)
  float final_logit_softcap = 0.0f; // > 0: logits = cap * tanh(logits / cap)
  bool has_qkv_bias = false;
  bool has_o_bias = false;          // o_proj has a bias (gpt-oss)
  bool attention_sinks = false;     // a learned logit per query head joins each row's softmax (gpt-oss: "sinks")
  bool has_qk_norm = false;         // RMSNorm of q and k before RoPE: per head over head_dim, or
  bool qk_norm_whole = false;       //   over the whole q / k projection (OLMoE: weights [q_size], [kv_size])
  int32_t rotary_dim = 0;           // dims of a head RoPE rotates; 0: head_dim
  std::vector<float> inv_freq;      // [rotary_dim / 2], rope scaling applied (computed as HF does)
  float attention_scaling = 1.0f;
  std::vector<float> inv_freq_local;  // a second table (Gemma 3's sliding layers); empty: none
  float attention_scaling_local = 1.0f;
  std::vector<int32_t> layer_rope;            // per layer: 0 no RoPE, 1 inv_freq, 2 inv_freq_local
  std::vector<int32_t> layer_sliding_window;  // per layer: 0 full attention, w: keys with p - k < w
  bool tie_word_embeddings = false;
  int32_t max_position_embeddings = 0;
  // An int4 checkpoint (dense layers allowed): its layout's name (model/int4_layouts.h: "awq", "gptq", "gptq_v2",
  // "pack_quantized", "mxfp4_pack_quantized", "nvfp4_pack_quantized", "nvfp4_modelopt"; "" for none) and its group
  // size along the inputs (0: one group per row; the FP4 layouts: their block, 32 or 16).
  std::string int4_layout;
  int32_t int4_group_size = 0;
  // q_proj / k_proj rows hold each head's rotary pairs interleaved (llama.cpp's GGUF "llama" files): the loader
  // reads them in HF's rotate_half order (model/ggml_blocks.h ggml_rotary_row_order).
  bool qk_rotary_interleaved = false;
  // Mixture of experts (num_experts 0: none). layer_moe[i] 1: layer i's MLP is num_experts gated MLPs of
  // moe_intermediate_size behind a router: softmax over the experts, each row's num_experts_per_tok best,
  // renormalized to sum 1 when norm_topk_prob; 0: the dense MLP of intermediate_size. Empty: all dense.
  int32_t num_experts = 0;
  int32_t num_experts_per_tok = 0;
  int32_t moe_intermediate_size = 0;
  bool norm_topk_prob = false;
  std::vector<int32_t> layer_moe;
  // gpt-oss's experts: the router and every expert's gate | up and down have biases, and gate and up rows alternate
  // in the checkpoint (gate j, up j, gate j + 1, ...), stored as transformers holds them ([E, hidden, 2 moe_inter]
  // and [E, moe_inter, hidden], inputs first) or in MXFP4 as shipped (model/mxfp4.h).
  bool moe_biases = false;
  bool experts_interleaved = false;
  // > 0: every MoE layer also runs a shared expert, a gated MLP of this width every row takes, its output scaled
  // by sigmoid(shared_expert_gate . x) and added to the routed experts' sum (Qwen3.5-MoE, Qwen3-Next). 0: none.
  int32_t shared_expert_intermediate_size = 0;
  // Recurrent layers (Gated DeltaNet: Qwen3.5, Qwen3-Next). layer_recurrent[i] 1: layer i mixes tokens by the
  // gated delta rule over a per-sequence state (linear_* below; no KV cache) instead of self-attention. Empty: none.
  std::vector<int32_t> layer_recurrent;
  int32_t linear_num_key_heads = 0;
  int32_t linear_num_value_heads = 0;
  int32_t linear_key_head_dim = 0;
  int32_t linear_value_head_dim = 0;
  int32_t linear_conv_kernel = 0;  // taps of the short causal convolution over q | k | v
  // llama.cpp's GGUF layout of these layers: every value-indexed tensor (v rows of in_proj_qkv and conv1d, in_proj_z,
  // in_proj_b / in_proj_a, A_log, dt_bias, out_proj's columns) in tiled head order, value head h reading key head
  // h % linear_num_key_heads (HF groups them: h / (value heads per key head)); and the A_log role holding the
  // decay rate -exp(A_log) itself (its ssm_a).
  bool linear_value_heads_tiled = false;
  bool linear_decay_rate_stored = false;
  // Self-attention with an output gate (Qwen3.5, Qwen3-Next): q_proj holds each head's query rows, then its gate
  // rows ([heads, 2, head_dim]); the attention output times sigmoid(gate) goes into o_proj.
  bool attn_output_gate = false;
  // Per-layer attention shapes (Gemma 4: head_dim 256 on sliding layers, 512 and fewer KV heads on global ones).
  // layer_head_dim[l] / layer_num_kv_heads[l]: layer l's (empty: head_dim / num_kv_heads on every layer).
  // layer_v_from_k[l] 1: layer l has no v_proj, its values are k_proj's output before k's norm and RoPE
  // (Gemma 4's attention_k_eq_v). has_v_norm: v = v / rms(v) per head, no weight, before the cache (Gemma 4).
  // has_layer_scalar: each layer ends by multiplying the residual stream by its stored scalar (Gemma 4).
  std::vector<int32_t> layer_head_dim;
  std::vector<int32_t> layer_num_kv_heads;
  std::vector<int32_t> layer_v_from_k;
  bool has_v_norm = false;
  bool has_layer_scalar = false;
  // Gemma 4's MoE layers: the dense MLP (intermediate_size) and the routed experts both run, the experts on their
  // own norm of the layer's input and routed on a weightless norm of it times the router's scale vector / sqrt(hidden);
  // each expert's routing weight times its per_expert_scale; post-norms on both, summed, then post_mlp_norm.
  bool moe_beside_mlp = false;
  // Cross-layer KV sharing (Gemma 4's E-models): layer_kv_source[l] is the layer whose KV cache layer l reads; l
  // itself when it keeps its own. A layer reading another's has only q_proj (no k/v projections, no k norm) and
  // no KV of its own; its source is an earlier layer of the same attention shape, window and rotary table.
  // Empty: every layer its own.
  std::vector<int32_t> layer_kv_source;
  // Per layer: its dense MLP's width (Gemma 4's use_double_wide_mlp: the KV-sharing layers' are twice as wide).
  // Empty: intermediate_size everywhere.
  std::vector<int32_t> layer_intermediate_size;
  // Per-layer embeddings (Gemma 4's E-models), per_layer_input_size P > 0: a second table [vocab, layers * P] and
  // a projection of the scaled embeddings give each layer a P-wide input, ple = (norm(proj(x) / sqrt(hidden)) +
  // table[id] * sqrt(P)) / sqrt(2) per layer slice; each layer ends with x += norm(proj(act(gate(x)) * ple_l)).
  int32_t per_layer_input_size = 0;
  // A multi-token-prediction head (Qwen3.5, Qwen3-Next: config mtp_num_hidden_layers, checkpoint mtp.*): this many
  // decoder layers after the model's, each shaped as its last full-attention layer (ModelWeights::mtp). Loaded; run
  // by speculative='mtp' (its first layer drafts one token a step: DecoderModel::mtp_step). 0: none.
  int32_t mtp_num_layers = 0;
  // The main layer whose attention and MLP shape the MTP layers take: the last full-attention one.
  int32_t mtp_shape_layer() const;

  // Throws InvalidArgument naming the field when the shape is impossible.
  void validate() const;
  int32_t q_size() const { return num_heads * head_dim; }
  int32_t kv_size() const { return num_kv_heads * head_dim; }
  int32_t rotary_dims() const { return rotary_dim > 0 ? rotary_dim : head_dim; }
  // layer l's attention shape (the per-layer lists, else the model's)
  int32_t head_dim_of(int32_t l) const { return layer_head_dim.empty() ? head_dim : layer_head_dim[l]; }
  int32_t kv_heads_of(int32_t l) const { return layer_num_kv_heads.empty() ? num_kv_heads : layer_num_kv_heads[l]; }
  int32_t q_size_of(int32_t l) const { return num_heads * head_dim_of(l); }
  int32_t kv_size_of(int32_t l) const { return kv_heads_of(l) * head_dim_of(l); }
  bool v_from_k(int32_t l) const { return !layer_v_from_k.empty() && layer_v_from_k[l] != 0; }
  int32_t kv_source(int32_t l) const { return layer_kv_source.empty() ? l : layer_kv_source[l]; }
  bool reads_shared_kv(int32_t l) const { return kv_source(l) != l; }
  int32_t intermediate_of(int32_t l) const {
    return layer_intermediate_size.empty() ? intermediate_size : layer_intermediate_size[l];
  }
  int32_t max_intermediate_size() const;
  int32_t max_q_size() const;    // the widest layer's q_size_of
  int32_t max_qkv_size() const;  // the widest layer's q_size_of + 2 kv_size_of
  float softmax_scale(int32_t l) const;
  // The window every layer attends within when all layers are windowed (the largest), else 0: blocks behind
  // it can be freed early.
  int32_t attention_window_tokens() const;
  bool is_moe_layer(int32_t l) const { return !layer_moe.empty() && layer_moe[l] != 0; }
  bool is_recurrent_layer(int32_t l) const { return !layer_recurrent.empty() && layer_recurrent[l] != 0; }
  int32_t num_recurrent_layers() const;
  int32_t linear_key_dim() const { return linear_num_key_heads * linear_key_head_dim; }
  int32_t linear_value_dim() const { return linear_num_value_heads * linear_value_head_dim; }
  int32_t linear_conv_dim() const { return 2 * linear_key_dim() + linear_value_dim(); }  // q | k | v
};

}  // namespace lmkit
