// The decoder's weights: views into memory-mapped safetensors files, in their stored dtype.
// lmkit.models (Python) reads the headers and the per-architecture key table and hands over one
// TensorSource per role; this file maps the files and checks every shape against the config.
#pragma once
#include <stdint.h>

#include <map>
#include <memory>
#include <string>
#include <vector>

#include "core/tensor.h"
#include "model/ggml_blocks.h"
#include "model/int4_layouts.h"
#include "model/model_config.h"

namespace lmkit {

// Where one tensor lives: a byte range of a file, as recorded in its safetensors header.
struct TensorSource {
  std::string path;
  int64_t offset = 0;  // absolute byte offset in the file
  DType dtype = DType::F32;
  std::vector<int64_t> shape;
};

class MappedFile {
 public:
  explicit MappedFile(const std::string& path);
  ~MappedFile();
  MappedFile(const MappedFile&) = delete;
  MappedFile& operator=(const MappedFile&) = delete;
  const uint8_t* data() const { return data_; }
  int64_t size_bytes() const { return size_; }

 private:
  std::string path_;
  uint8_t* data_ = nullptr;
  int64_t size_ = 0;
};

// One linear layer as stored: a dense weight, int4 tensors in one of the layouts of model/int4_layouts.h, or a
// GGUF block tensor (model/ggml_blocks.h); the quantized ones are read through `int4_source` / `int8_source`
// (num_out x num_in).
struct LinearTensors {
  Tensor weight;      // [out, in] F32/F16/BF16, or GGUF blocks (ggml_blocks.h); empty for an int4 layout
  Int4Tensors int4;   // layout None unless a checkpoint int4 layout
  Int4Source int4_source;  // int4 layouts, Q4_0, Q4_1, Q4_K, MXFP4 (weight: its blocks)
  Tensor int8_scales;       // compressed-tensors int8: weight_scale [out, 1] or [out, groups] (weight is the int8)
  Int8Source int8_source;  // Q5_0, Q8_0, Q5_K, Q6_K, compressed-tensors int8
  bool is_int4() const { return int4_source.read_group != nullptr; }
  bool is_int8() const { return int8_source.is_set(); }
  bool is_empty() const { return weight.is_empty() && !is_int4() && !is_int8(); }
  int64_t num_out() const {
    return is_int4() ? int4_source.num_out : is_int8() ? int8_source.num_out : weight.shape[0];
  }
  int64_t num_in() const { return is_int4() ? int4_source.num_in : is_int8() ? int8_source.num_in : weight.shape[1]; }
};

// A linear stored as one tensor: F32/F16/BF16, or GGUF blocks read through the matching source; its outputs in
// `rows` order when given (a float weight is then copied in that order, the copy kept in `owned`).
LinearTensors single_tensor_linear(const Tensor& weight, const RowOrder& rows, const std::string& what,
                                   std::vector<std::shared_ptr<void>>* owned = nullptr);

// A compressed-tensors int8 weight ([N, K] I8, symmetric) with its float scales ([N, 1] / [N] per channel, or [N, G]
// per group of K / G inputs, K / G a multiple of 16) as the int8 kernels' source: exact (blocks of 32 with fp16
// scales where every scale is an fp16 value, else blocks of 16 with fp32 scales). Throws InvalidArgument naming
// `what` for shapes or scales that do not fit.
Int8Source int8_channel_source(const Tensor& weight, const Tensor& scales, const std::string& what);

// One decoder layer's tensors. Which are present depends on the model (ModelConfig): the Gemma family's norms
// after attention and MLP, q/k norms, q/k/v biases; q/k/v and gate/up either as parts or fused in the
// checkpoint (Phi-3).
struct LayerWeights {
  Tensor input_norm;                    // [hidden], before attention
  Tensor post_attention_norm;           // [hidden], on the attention output (Gemma)
  Tensor pre_mlp_norm;                  // [hidden], before the MLP
  Tensor post_mlp_norm;                 // [hidden], on the MLP output (Gemma)
  Tensor q_norm, k_norm;                // [head_dim] when has_qk_norm
  LinearTensors qkv_proj;               // fused [q_size + 2 kv_size, hidden], or empty and then:
  LinearTensors q_proj, k_proj, v_proj; //   [q_size, hidden], [kv_size, hidden] x2
  Tensor q_bias, k_bias, v_bias;        // empty unless has_qkv_bias
  Tensor o_bias;                        // [hidden] when has_o_bias
  Tensor sinks;                         // [num_heads] when attention_sinks
  Tensor layer_scalar;                  // [1] when has_layer_scalar: the residual stream times it after the layer
  // moe_beside_mlp (Gemma 4): the dense MLP's output norm, the experts' input and output norms, the router's input
  // scale [hidden] and each expert's output scale [num_experts]
  Tensor post_mlp_norm_1, pre_moe_norm, post_moe_norm, router_scale, expert_scale;
  LinearTensors attn_gate;              // [q_size, hidden]: q_proj's gate rows (attn_output_gate), or empty
  LinearTensors o_proj;                 // [hidden, q_size]
  LinearTensors gate_up_proj;           // fused [2 inter, hidden], or empty and then:
  LinearTensors gate_proj, up_proj;     //   [inter, hidden] x2
  LinearTensors down_proj;              // [hidden, inter]
  // A mixture-of-experts layer (ModelConfig::is_moe_layer) has these instead of the MLP above:
  struct Expert {
    LinearTensors gate_proj, up_proj;   // [moe_inter, hidden] x2
    LinearTensors down_proj;            // [hidden, moe_inter]
    Tensor gate_bias, up_bias, down_bias;  // moe_biases: [moe_inter] x2, [hidden]; else empty
  };
  LinearTensors router;                 // [num_experts, hidden]
  Tensor router_bias;                   // [num_experts] when moe_biases
  std::vector<Expert> experts;
  Expert shared_expert;                 // [shared_inter, hidden] x2, [hidden, shared_inter] (config: > 0), or empty
  LinearTensors shared_expert_gate;     // [1, hidden]: the shared expert's sigmoid gate
  // A Gated DeltaNet layer (ModelConfig::is_recurrent_layer) has these instead of attention's:
  LinearTensors in_proj_qkv;            // [2 key_dim + value_dim, hidden]: q | k | v
  LinearTensors in_proj_z;              // [value_dim, hidden]: the output gate
  LinearTensors in_proj_b, in_proj_a;   // [Hv, hidden]: beta's and the decay's inputs
  LinearTensors out_proj;               // [hidden, value_dim]
  Tensor conv1d;                        // [conv_dim, 1, kernel] (or [conv_dim, kernel]): the short convolution
  Tensor dt_bias, a_log;                // [Hv]
  Tensor linear_norm;                   // [v_head_dim]: the gated RMSNorm's weight
  // Per-layer embeddings (config per_layer_input_size P > 0): the layer's gate [P, hidden] and projection
  // [hidden, P] and the norm [hidden] after it
  LinearTensors per_layer_input_gate, per_layer_projection;
  Tensor post_per_layer_input_norm;
  std::vector<const LinearTensors*> linears() const {
    std::vector<const LinearTensors*> all = {&qkv_proj, &q_proj, &k_proj,       &v_proj,  &o_proj,
                                             &gate_up_proj, &gate_proj, &up_proj, &down_proj, &router,
                                             &in_proj_qkv, &in_proj_z, &in_proj_b, &in_proj_a, &out_proj,
                                             &per_layer_input_gate, &per_layer_projection};
    for (const LinearTensors* t :
         {&shared_expert.gate_proj, &shared_expert.up_proj, &shared_expert.down_proj, &shared_expert_gate})
      all.push_back(t);
    for (const Expert& e : experts)
      for (const LinearTensors* t : {&e.gate_proj, &e.up_proj, &e.down_proj}) all.push_back(t);
    return all;
  }
};

// The multi-token-prediction head (ModelConfig::mtp_num_layers > 0; Qwen3.5, Qwen3-Next). It drafts the token after
// next from the next token t and the main model's final hidden state h (after its final norm, the lm_head's input,
// as vLLM's Qwen3-Next MTP reads it): x = fc([pre_fc_norm_embedding(embed(t)); pre_fc_norm_hidden(h)]), then a
// layer (full gated attention with its own KV cache, the MLP or MoE of the main model's full-attention layers), then
// norm, then the main model's lm_head (DecoderModel::mtp_step).
struct MtpWeights {
  LinearTensors fc;                                   // [hidden, 2 hidden]: inputs the embedding's half, then h's
  Tensor pre_fc_norm_embedding, pre_fc_norm_hidden;   // [hidden] x2
  Tensor norm;                                        // [hidden], before the shared lm_head
  std::vector<LayerWeights> layers;                   // mtp_num_layers, shaped as ModelConfig::mtp_shape_layer()
  int64_t size_bytes = 0;                             // of every tensor above as stored (not in ModelWeights')
};

struct ModelWeights {
  Tensor embed_tokens;  // [vocab, hidden]
  Tensor final_norm;    // [hidden]
  Tensor lm_head;       // [vocab, hidden]; the embedding when tied
  // per_layer_input_size P > 0: the per-layer table [vocab, layers * P], the scaled embeddings' projection
  // [layers * P, hidden] and the norm [P] of each layer's slice of it
  Tensor embed_tokens_per_layer;
  LinearTensors per_layer_model_projection;
  Tensor per_layer_projection_norm;
  std::vector<LayerWeights> layers;
  MtpWeights mtp;
  std::vector<std::shared_ptr<MappedFile>> files;  // keep the mappings alive
  std::vector<std::shared_ptr<void>> owned;        // reordered copies (GGUF llama q/k in a float dtype, gpt-oss experts)
  int64_t size_bytes = 0;

  // Roles: "embed_tokens", "norm", "lm_head" (optional when tied), and per layer i "layers.{i}." +
  // input_norm, pre_mlp_norm (always), post_attention_norm, post_mlp_norm (family "gemma"), q_norm, k_norm
  // (has_qk_norm), q_proj, k_proj, v_proj or qkv_proj, q_bias, k_bias, v_bias (has_qkv_bias), o_proj,
  // gate_proj, up_proj or gate_up_proj, down_proj; in a mixture-of-experts layer instead router and
  // "experts.{e}." + gate_proj, up_proj, down_proj for every expert e, or all of them in two float tensors,
  // "experts.gate_up_proj" [experts, 2 moe_inter, hidden] and "experts.down_proj" (and with
  // shared_expert_intermediate_size
  // "shared_expert." + gate_proj, up_proj, down_proj and shared_expert_gate); in a recurrent layer instead of the
  // attention roles in_proj_qkv, in_proj_z, in_proj_b, in_proj_a, out_proj, conv1d, dt_bias, A_log, linear_norm.
  // With attn_output_gate, q_proj is [2 q_size, hidden] (each head's query rows, then its gate rows).
  // gpt-oss (experts_interleaved): "experts.gate_up_proj" [E, hidden, 2 moe_inter] and "experts.down_proj"
  // [E, moe_inter, hidden] (inputs first, gate and up columns alternating), or in MXFP4 "experts.gate_up_proj_blocks"
  // [E, 2 moe_inter, hidden / 32, 16] U8 with "experts.gate_up_proj_scales" [E, 2 moe_inter, hidden / 32] U8 (rows
  // alternating) and "experts.down_proj_blocks" / "_scales"; "experts.gate_up_bias" [E, 2 moe_inter] (alternating)
  // and "experts.down_bias" [E, hidden] with moe_biases, as "router_bias"; "o_bias" (has_o_bias), "sinks".
  // A layer reading another's KV cache (layer_kv_source) has q_proj and q_norm, no k/v roles. Per-layer
  // embeddings: "embed_tokens_per_layer", "per_layer_model_projection", "per_layer_projection_norm" and per layer
  // "per_layer_input_gate", "per_layer_projection", "post_per_layer_input_norm".
  // MTP head (mtp_num_layers > 0): "mtp.fc", "mtp.pre_fc_norm_embedding", "mtp.pre_fc_norm_hidden", "mtp.norm" and
  // per MTP layer j "mtp.layers.{j}." + a full-attention layer's roles (above), all required.
  // An int4 linear (config.int4_layout set) comes as "<role>.values", "<role>.zeros", "<role>.scales" and
  // "<role>.g_idx" (the layout's tensors, model/int4_layouts.h; zeros and g_idx where it has them) instead of
  // "<role>"; linears left dense (modules_to_not_convert, ignore lists) keep the plain role. Linears, the
  // embedding and the lm_head may also be GGUF block tensors (any block dtype) under the plain role.
  static ModelWeights load(const ModelConfig& config, const std::map<std::string, TensorSource>& sources);

  // Once a backend has packed the linear layers (and the lm_head) into buffers of its own, their file pages
  // leave this process's resident memory (MADV_DONTNEED on the read-only private mapping: a later read refaults
  // from the file, so a view that is still read, such as a tied embedding, stays valid). The MTP head's are kept:
  // its reordered copies (w.owned) would read back as zeros.
  void release_linear_pages() const;
};

}  // namespace lmkit
