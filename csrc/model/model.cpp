#include "model/model.h"

#include <algorithm>
#include <cmath>

#include "core/check.h"

namespace lmkit {

DecoderModel::DecoderModel(const ModelConfig& config, ModelWeights weights, std::unique_ptr<Backend> backend,
                           const ModelOptions& options)
    : config_(config), backend_(std::move(backend)), options_(options) {
  const ModelConfig& c = config_;
  c.validate();
  Backend& b = *backend_;
  b.prepare(c, weights);
  activation_ = c.hidden_act == "gelu_tanh"        ? Activation::kGeluTanh
                : c.hidden_act == "clamped_swiglu" ? Activation::kClampedSwiglu
                                                   : Activation::kSilu;
  moe_spec_.top_k = c.num_experts_per_tok;
  moe_spec_.renormalize = c.norm_topk_prob;
  moe_spec_.inter = c.moe_intermediate_size;
  moe_spec_.act = activation_;
  const float offset = c.norm_weight_offset;
  rope_tables_.push_back(b.upload_rope(c.inv_freq, c.attention_scaling));
  if (!c.inv_freq_local.empty()) rope_tables_.push_back(b.upload_rope(c.inv_freq_local, c.attention_scaling_local));
  auto norm = [&](const Tensor& t) { return t.is_empty() ? DeviceVector{} : b.upload_norm(t, offset); };
  bool quantized = false;
  // Layer i's weights packed (the MTP head's layer: shaped as config layer i = mtp_shape_layer())
  auto pack_layer = [&](const LayerWeights& w, int32_t i) {
    Layer l;
    l.input_norm = norm(w.input_norm);
    l.post_attention_norm = norm(w.post_attention_norm);
    l.pre_mlp_norm = norm(w.pre_mlp_norm);
    l.post_mlp_norm = norm(w.post_mlp_norm);
    if (c.is_recurrent_layer(i)) {
      l.is_recurrent = true;
      l.recurrent_in = b.pack_linear({&w.in_proj_qkv, &w.in_proj_z, &w.in_proj_b, &w.in_proj_a}, {}, true);
      l.recurrent_out = b.pack_linear({&w.out_proj}, {}, true);
      const int64_t C = c.linear_conv_dim(), K = c.linear_conv_kernel, HV = c.linear_num_value_heads;
      std::vector<float> taps(C * K), rate(HV);  // the convolution tap-major: [K, C]
      for (int64_t ch = 0; ch < C; ++ch)
        for (int64_t j = 0; j < K; ++j) taps[j * C + ch] = float_value(w.conv1d, ch * K + j);
      for (int64_t h = 0; h < HV; ++h)
        rate[h] = c.linear_decay_rate_stored ? float_value(w.a_log, h) : -std::exp(float_value(w.a_log, h));
      l.conv_weight = b.upload_norm(make_view(taps.data(), DType::F32, C * K), 0.0f);
      l.decay_rate = b.upload_norm(make_view(rate.data(), DType::F32, HV), 0.0f);
      l.dt_bias = b.upload_norm(w.dt_bias, 0.0f);
      l.recurrent_norm = b.upload_norm(w.linear_norm, 0.0f);  // a plain weight, whatever the model's other norms
    } else if (c.reads_shared_kv(i))  // q alone: its K/V are layer kv_source(i)'s
      l.qkv = b.pack_linear({&w.q_proj}, {}, true);
    else if (!w.qkv_proj.is_empty())
      l.qkv = b.pack_linear({&w.qkv_proj}, {&w.q_bias, &w.k_bias, &w.v_bias}, true);
    else
      l.qkv = b.pack_linear({&w.q_proj, &w.k_proj, &w.v_proj}, {&w.q_bias, &w.k_bias, &w.v_bias}, true);
    if (!l.is_recurrent) l.o_proj = b.pack_linear({&w.o_proj}, {&w.o_bias}, true);
    if (!w.sinks.is_empty()) l.sinks = b.upload_norm(w.sinks, 0.0f);  // a plain vector, whatever the norms' offset
    if (!w.attn_gate.is_empty()) l.attn_gate = b.pack_linear({&w.attn_gate}, {}, true);  // q_proj's gate rows
    if (!c.is_moe_layer(i) || c.moe_beside_mlp) {  // the dense MLP (Gemma 4's MoE layers keep it beside the experts)
      l.gate_up = w.gate_up_proj.is_empty() ? b.pack_linear({&w.gate_proj, &w.up_proj}, {}, true)
                                            : b.pack_linear({&w.gate_up_proj}, {}, true);
      l.down_proj = b.pack_linear({&w.down_proj}, {}, true);
    }
    if (c.is_moe_layer(i) && c.moe_beside_mlp) {  // Gemma 4: the norms around the two, the router's scales
      l.post_mlp_norm_1 = norm(w.post_mlp_norm_1);
      l.pre_moe_norm = norm(w.pre_moe_norm);
      l.post_moe_norm = norm(w.post_moe_norm);
      // the router's input: a weightless norm times scale times hidden^-0.5 (HF's order: one rounding apart)
      const float root = 1.0f / std::sqrt((float)c.hidden_size);
      std::vector<float> router_w(c.hidden_size);
      for (int64_t j = 0; j < c.hidden_size; ++j) router_w[j] = float_value(w.router_scale, j) * root;
      l.router_norm = b.upload_norm(make_view(router_w.data(), DType::F32, c.hidden_size), 0.0f);
      l.moe.expert_scale = b.upload_norm(w.expert_scale, 0.0f);  // a plain vector, whatever the norms' offset
    }
    if (c.is_moe_layer(i)) {
      l.moe.router = b.pack_linear({&w.router}, {&w.router_bias});
      for (const LayerWeights::Expert& e : w.experts) {
        l.moe.gate_up.push_back(b.pack_linear({&e.gate_proj, &e.up_proj}, {&e.gate_bias, &e.up_bias}, true));
        l.moe.down.push_back(b.pack_linear({&e.down_proj}, {&e.down_bias}, true));
      }
      if (c.shared_expert_intermediate_size > 0) {
        l.shared_gate_up = b.pack_linear({&w.shared_expert.gate_proj, &w.shared_expert.up_proj}, {}, true);
        l.shared_down = b.pack_linear({&w.shared_expert.down_proj}, {}, true);
        l.shared_gate = b.pack_linear({&w.shared_expert_gate});
      }
    }
    l.q_norm = norm(w.q_norm);
    l.k_norm = norm(w.k_norm);
    if (c.per_layer_input_size > 0) {
      l.ple_gate = b.pack_linear({&w.per_layer_input_gate});
      l.ple_proj = b.pack_linear({&w.per_layer_projection});
      l.ple_norm = norm(w.post_per_layer_input_norm);
    }
    // the value norm, an RMSNorm without weight: ones, whatever the norms' offset (none on a layer reading
    // another's KV)
    if (c.has_v_norm && !l.is_recurrent && !c.reads_shared_kv(i)) {
      const std::vector<float> ones(c.head_dim_of(i), 1.0f);
      l.v_norm = b.upload_norm(make_view((void*)ones.data(), DType::F32, (int64_t)ones.size()), 0.0f);
    }
    if (c.has_layer_scalar) l.scalar = float_value(w.layer_scalar, 0);
    return l;
  };
  for (int32_t i = 0; i < c.num_layers; ++i) {
    for (const LinearTensors* t : weights.layers[i].linears()) quantized = quantized || t->is_int4() || t->is_int8();
    layers_.push_back(pack_layer(weights.layers[i], i));
  }
  const int32_t mtp_shape = c.mtp_shape_layer();
  if (options.mtp) {
    LMKIT_CHECK_ARG(c.mtp_num_layers > 0 && !weights.mtp.layers.empty(), c.architecture,
                    ": speculative='mtp' needs a multi-token-prediction head (config mtp_num_hidden_layers > 0 and "
                    "the checkpoint's mtp.* tensors: Qwen3.5/3.6, Qwen3-Next); this model has none");
    mtp_layer_ = pack_layer(weights.mtp.layers[0], mtp_shape);
    mtp_fc_ = b.pack_linear({&weights.mtp.fc});
    mtp_norm_embedding_ = norm(weights.mtp.pre_fc_norm_embedding);
    mtp_norm_hidden_ = norm(weights.mtp.pre_fc_norm_hidden);
    mtp_norm_ = norm(weights.mtp.norm);
  }
  // Layer l (config layer i) attends over KV pool layer kv_layer (after the loop: the specs point into the Layer)
  auto set_attention_spec = [&](Layer& l, int32_t i, int32_t kv_layer) {
    AttentionSpec& a = l.attention;
    a.layer = kv_layer;
    a.reads_shared_kv = c.reads_shared_kv(i);
    a.num_heads = c.num_heads, a.num_kv_heads = c.kv_heads_of(i), a.head_dim = c.head_dim_of(i);
    a.q_norm = l.q_norm.is_empty() ? nullptr : &l.q_norm;
    a.k_norm = l.k_norm.is_empty() ? nullptr : &l.k_norm;
    a.norm_whole = c.qk_norm_whole;
    a.norm_eps = c.rms_norm_eps;
    a.rope = c.layer_rope[i] == 0 ? nullptr : &rope_tables_[c.layer_rope[i] - 1];
    a.scale = c.softmax_scale(i);
    a.sliding_window = c.layer_sliding_window[i];
    a.logit_softcap = c.attn_logit_softcap;
    a.sinks = l.sinks.is_empty() ? nullptr : &l.sinks;
    a.v_norm = l.v_norm.is_empty() ? nullptr : &l.v_norm;
  };
  std::vector<RecurrentSpec> recurrent;
  for (int32_t i = 0; i < c.num_layers; ++i) {  // after the loop: the specs point into layers_
    Layer& l = layers_[i];
    if (l.is_recurrent) {
      RecurrentSpec& r = l.recurrent;
      r.index = (int32_t)recurrent.size();
      r.num_k_heads = c.linear_num_key_heads, r.num_v_heads = c.linear_num_value_heads;
      r.k_head_dim = c.linear_key_head_dim, r.v_head_dim = c.linear_value_head_dim;
      r.conv_kernel = c.linear_conv_kernel;
      r.value_heads_tiled = c.linear_value_heads_tiled;
      r.conv_weight = &l.conv_weight, r.decay_rate = &l.decay_rate, r.dt_bias = &l.dt_bias;
      r.norm = &l.recurrent_norm;
      r.norm_eps = c.rms_norm_eps;
      recurrent.push_back(r);
      continue;
    }
    set_attention_spec(l, i, c.kv_source(i));
  }
  if (options.mtp) set_attention_spec(mtp_layer_, mtp_shape, c.num_layers);  // its KV: the pool's last layer
  final_norm_ = norm(weights.final_norm);
  lm_head_ = b.pack_lm_head(weights.lm_head, quantized);
  b.set_embedding(weights.embed_tokens);
  if (c.per_layer_input_size > 0) {
    b.set_per_layer_embedding(weights.embed_tokens_per_layer);
    ple_model_proj_ = b.pack_linear({&weights.per_layer_model_projection});
    ple_proj_norm_ = norm(weights.per_layer_projection_norm);
  }
  b.weights_packed(weights);

  std::vector<KVQuant> kv_quant = options.kv_quant;
  if (kv_quant.empty()) kv_quant.assign(c.num_layers, KVQuant::kNone);
  LMKIT_CHECK_ARG((int32_t)kv_quant.size() == c.num_layers, "KV precision is given for ", kv_quant.size(),
                  " layers, the model has ", c.num_layers);
  std::vector<int32_t> kv_heads(c.num_layers), head_dims(c.num_layers);
  for (int32_t i = 0; i < c.num_layers; ++i) {
    kv_heads[i] = c.is_recurrent_layer(i) || c.reads_shared_kv(i) ? 0 : c.kv_heads_of(i);
    head_dims[i] = c.head_dim_of(i);
  }
  if (options.mtp) {  // the MTP layer's K/V: one more pool layer, shaped and stored as its shape layer's
    kv_quant.push_back(kv_quant[mtp_shape]);
    kv_heads.push_back(c.kv_heads_of(mtp_shape));
    head_dims.push_back(c.head_dim_of(mtp_shape));
  }
  b.configure_kv(kv_quant, kv_heads, head_dims, options.block_size_tokens);
  b.configure_state(recurrent);

  const int64_t T = options.max_step_tokens, H = c.hidden_size, G = b.max_head_rows();
  LMKIT_CHECK(T > 0, "max_step_tokens must be > 0");
  residual_ = b.allocate_activations(T, H);
  hidden_ = b.allocate_activations(T, H);
  int64_t wide = std::max<int64_t>(2 * (int64_t)c.max_intermediate_size(), c.max_qkv_size());
  wide = std::max<int64_t>(wide, 2 * (int64_t)c.shared_expert_intermediate_size);
  int64_t mixed = c.max_q_size();  // the token mixer's output: attention's, or a recurrent layer's (value_dim)
  for (const RecurrentSpec& r : recurrent) wide = std::max(wide, r.proj_dim()), mixed = std::max(mixed, r.value_dim());
  wide_ = b.allocate_activations(T, wide);
  attn_ = b.allocate_activations(T, mixed);
  if (c.shared_expert_intermediate_size > 0) {
    shared_ = b.allocate_activations(T, H);
    shared_gate_ = b.allocate_activations(T, 1);
  }
  if (c.attn_output_gate) gate_ = b.allocate_activations(T, c.max_q_size());
  if (c.moe_beside_mlp) {
    moe_in_ = b.allocate_activations(T, H);
    router_in_ = b.allocate_activations(T, H);
  }
  if (c.per_layer_input_size > 0) {
    ple_ = b.allocate_activations(T, (int64_t)c.num_layers * c.per_layer_input_size);
    ple_gate_ = b.allocate_activations(T, c.per_layer_input_size);
  }
  if (options.mtp) {
    mtp_hidden_ = b.allocate_activations(T, H);  // the main step's final hidden states, every row
    mtp_cat_ = b.allocate_activations(T, 2 * H);
    mtp_attn_ = b.allocate_activations(G, c.q_size_of(mtp_shape));
    if (c.attn_output_gate) mtp_gate_ = b.allocate_activations(G, c.q_size_of(mtp_shape));
  }
  head_residual_ = b.allocate_activations(G, H);
  head_hidden_ = b.allocate_activations(G, H);
  logits_ = b.allocate_activations(G, c.vocab_size);
  weights_ = std::move(weights);  // the mappings stay alive for views still read (embedding, norms)
}

int64_t DecoderModel::Layer::dense_bytes() const {
  int64_t bytes = 0;
  for (const PackedLinear* w : {&qkv, &attn_gate, &o_proj, &gate_up, &down_proj, &recurrent_in, &recurrent_out,
                                &shared_gate_up, &shared_down, &shared_gate, &ple_gate, &ple_proj})
    bytes += w->size_bytes;
  return bytes;
}

int64_t DecoderModel::Layer::expert_bytes() const {
  int64_t bytes = moe.router.size_bytes;
  for (const std::vector<PackedLinear>* ws : {&moe.gate_up, &moe.down})
    for (const PackedLinear& w : *ws) bytes += w.size_bytes;
  return bytes;
}

int64_t DecoderModel::dense_weight_bytes() const {
  int64_t bytes = lm_head_.size_bytes + ple_model_proj_.size_bytes;
  for (const Layer& l : layers_) bytes += l.dense_bytes();
  return bytes;
}

int64_t DecoderModel::linear_weight_bytes() const {
  int64_t bytes = dense_weight_bytes();
  for (const Layer& l : layers_) bytes += l.expert_bytes();
  if (options_.mtp)  // the head's fc and layer, which every step runs
    bytes += mtp_fc_.size_bytes + mtp_layer_.dense_bytes() + mtp_layer_.expert_bytes();
  return bytes;
}

void DecoderModel::mixer_block(int32_t l, int64_t rows, void* h) {
  if (layers_[l].is_recurrent)
    recurrent_block(l, rows, h);
  else
    attention_block(l, rows, h);
}

void DecoderModel::attention_block(int32_t l, int64_t rows, void* h) {
  const Layer& w = layers_[l];
  backend_->linear(h, rows, w.qkv, wide_.get());
  if (!w.attn_gate.is_empty()) backend_->linear(h, rows, w.attn_gate, gate_.get());
  backend_->attention(wide_.get(), rows, w.attention, attn_.get());
  if (!w.attn_gate.is_empty()) backend_->sigmoid_gate(attn_.get(), gate_.get(), rows, config_.q_size_of(l));
  backend_->linear(attn_.get(), rows, w.o_proj, h);
}

void DecoderModel::recurrent_block(int32_t l, int64_t rows, void* h) {
  const Layer& w = layers_[l];
  backend_->linear(h, rows, w.recurrent_in, wide_.get());
  backend_->recurrent_mixer(wide_.get(), rows, w.recurrent, attn_.get());
  backend_->linear(attn_.get(), rows, w.recurrent_out, h);
}

void DecoderModel::mlp_block(int32_t l, int64_t rows, void* h) { mlp_block(layers_[l], l, rows, h); }

void DecoderModel::mlp_block(const Layer& w, int32_t l, int64_t rows, void* h) {
  if (w.moe.router.is_empty()) {
    gated_mlp(h, rows, w.gate_up, w.down_proj, config_.intermediate_of(l), h);
    return;
  }
  const bool shared = !w.shared_down.is_empty();
  if (shared) {  // from h, before the routed experts overwrite it
    gated_mlp(h, rows, w.shared_gate_up, w.shared_down, config_.shared_expert_intermediate_size, shared_.get());
    backend_->linear(h, rows, w.shared_gate, shared_gate_.get());
  }
  step_expert_bytes_ += backend_->moe(h, rows, w.moe, moe_spec_, h);
  if (shared) backend_->add_sigmoid_gated(h, shared_.get(), shared_gate_.get(), rows, config_.hidden_size);
}

void DecoderModel::mlp_beside_experts_block(int32_t l, int64_t rows, const void* x, void* h) {
  const Layer& w = layers_[l];
  const ModelConfig& c = config_;
  const int64_t H = c.hidden_size;
  gated_mlp(h, rows, w.gate_up, w.down_proj, c.intermediate_of(l), h);
  backend_->rmsnorm(h, w.post_mlp_norm_1, c.rms_norm_eps, rows, H, h);
  backend_->rmsnorm(x, w.pre_moe_norm, c.rms_norm_eps, rows, H, moe_in_.get());
  backend_->rmsnorm(x, w.router_norm, c.rms_norm_eps, rows, H, router_in_.get());
  step_expert_bytes_ += backend_->moe(moe_in_.get(), rows, w.moe, moe_spec_, moe_in_.get(), router_in_.get());
  backend_->rmsnorm(moe_in_.get(), w.post_moe_norm, c.rms_norm_eps, rows, H, moe_in_.get());
  backend_->add_rmsnorm(h, moe_in_.get(), w.post_mlp_norm, c.rms_norm_eps, rows, H, h);  // h += experts; norm
}

void DecoderModel::per_layer_inputs(int64_t rows, const void* x) {
  const ModelConfig& c = config_;
  const int64_t P = c.per_layer_input_size, LP = (int64_t)c.num_layers * P;
  backend_->linear(x, rows, ple_model_proj_, ple_.get());
  backend_->scale(ple_.get(), rows, LP, 1.0f / std::sqrt((float)c.hidden_size));
  backend_->rmsnorm(ple_.get(), ple_proj_norm_, c.rms_norm_eps, rows * c.num_layers, P, ple_.get());
  backend_->add_per_layer_embedding(rows, LP, std::sqrt((float)P), (float)std::sqrt(0.5), ple_.get());
}

void DecoderModel::per_layer_input_block(int32_t l, int64_t rows, void* x, void* h) {
  const ModelConfig& c = config_;
  const Layer& w = layers_[l];
  const int64_t P = c.per_layer_input_size, H = c.hidden_size;
  backend_->add(x, h, rows, H);
  backend_->linear(x, rows, w.ple_gate, ple_gate_.get());
  backend_->gated_product(ple_gate_.get(), ple_.get(), l * P, c.num_layers * P, rows, P, activation_);
  backend_->linear(ple_gate_.get(), rows, w.ple_proj, h);
  backend_->rmsnorm(h, w.ple_norm, c.rms_norm_eps, rows, H, h);
}

void DecoderModel::gated_mlp(const void* h, int64_t rows, const PackedLinear& gate_up, const PackedLinear& down,
                             int64_t inter, void* out) {
  backend_->linear(h, rows, gate_up, wide_.get());
  backend_->gated_activation(wide_.get(), rows, inter, activation_, wide_.get());
  backend_->linear(wide_.get(), rows, down, out);
}

void DecoderModel::head(int64_t first, int64_t n, bool logits) {
  if (n == 0) return;
  const int64_t H = config_.hidden_size;
  if (options_.mtp) {  // every row's final norm is in mtp_hidden_ already (step)
    backend_->gather_logit_rows(mtp_hidden_.get(), first, n, H, head_hidden_.get());
  } else {
    backend_->gather_logit_rows(residual_.get(), first, n, H, head_residual_.get());
    backend_->gather_logit_rows(hidden_.get(), first, n, H, head_hidden_.get());
    backend_->add_rmsnorm(head_residual_.get(), head_hidden_.get(), final_norm_, config_.rms_norm_eps, n, H,
                          head_hidden_.get());
  }
  if (!logits) return;
  backend_->linear(head_hidden_.get(), n, lm_head_, logits_.get());
  if (config_.final_logit_softcap > 0)
    backend_->softcap(logits_.get(), n, config_.vocab_size, config_.final_logit_softcap);
}

StepOutput DecoderModel::step(const Batch& batch) {
  const int64_t H = config_.hidden_size;
  StepOutput out = StepOutput::for_batch(batch, config_.vocab_size, (int32_t)H);
  if (batch.empty()) return out;
  const int64_t rows = backend_->begin_step(batch);
  step_expert_bytes_ = 0;
  const int64_t L = backend_->num_logit_rows(), G = backend_->max_head_rows();
  const bool one_head = L <= G;  // the head runs inside the step's device work (a graph replays both)
  backend_->execute([&] {
    forward_layers(rows);
    // the MTP head reads every row's final hidden state (mtp_step, after this step's tokens are known)
    if (options_.mtp)
      backend_->add_rmsnorm(residual_.get(), hidden_.get(), final_norm_, config_.rms_norm_eps, rows, H,
                            mtp_hidden_.get());
    if (one_head) head(0, L, batch.needs_logits(0, L));
  });
  for (int64_t first = 0; first < L; first += G) {
    const int64_t n = std::min(G, L - first);
    const bool logits = batch.needs_logits(first, n);  // rows only pooled skip the lm_head
    if (!one_head) head(first, n, logits);
    if (!batch.hidden_outputs.empty()) backend_->take_hidden(batch, first, n, head_hidden_.get(), H, out);
    if (logits) backend_->take_logits(batch, first, n, logits_.get(), config_.vocab_size, out);
  }
  out.weight_bytes_read = dense_weight_bytes() + step_expert_bytes_;
  return out;
}

StepOutput DecoderModel::mtp_step(const Batch& batch, const std::vector<int32_t>& hidden_rows) {
  const ModelConfig& c = config_;
  const int64_t H = c.hidden_size, V = c.vocab_size;
  StepOutput out = StepOutput::for_batch(batch, (int32_t)V, (int32_t)H);
  if (batch.empty()) return out;
  LMKIT_CHECK(options_.mtp, "mtp_step on a model built without its MTP head (ModelOptions::mtp)");
  LMKIT_CHECK(batch.stateless && batch.state_copies.empty(),
              "the MTP head's batch must leave the recurrent state alone");
  LMKIT_CHECK((int64_t)hidden_rows.size() == batch.num_tokens, "mtp_step: ", hidden_rows.size(), " hidden rows for ",
              batch.num_tokens, " tokens");
  Backend& b = *backend_;
  const int64_t rows = b.begin_step(batch);
  LMKIT_CHECK(rows == batch.num_tokens, "the MTP head runs unpadded steps");
  void* x = residual_.get();
  void* h = hidden_.get();
  // x = fc([norm_e(embed(next token)); norm_h(main model's final hidden state)])
  b.embedding(rows, H, c.embed_scale, x);
  b.rmsnorm(x, mtp_norm_embedding_, c.rms_norm_eps, rows, H, x);
  b.gather_rows(mtp_hidden_.get(), hidden_rows.data(), rows, H, h);
  b.rmsnorm(h, mtp_norm_hidden_, c.rms_norm_eps, rows, H, h);
  b.concat_columns(x, h, rows, H, mtp_cat_.get());
  b.linear(mtp_cat_.get(), rows, mtp_fc_, x);
  // its decoder layer, as the model's full-attention layers run (models/llama.cpp), over the pool's MTP layer: the
  // attention of every row (their K/V are what later drafts attend to), the rest only for the rows whose logits are
  // drawn (the layer's output anywhere else is read by nothing)
  const int32_t s = c.mtp_shape_layer();
  const Layer& w = mtp_layer_;
  b.rmsnorm(x, w.input_norm, c.rms_norm_eps, rows, H, h);
  b.linear(h, rows, w.qkv, wide_.get());
  b.attention(wide_.get(), rows, w.attention, attn_.get());
  const int64_t L = b.num_logit_rows(), G = b.max_head_rows(), Q = c.q_size_of(s);
  void* xr = head_residual_.get();
  void* hr = head_hidden_.get();
  for (int64_t first = 0; first < L; first += G) {
    const int64_t n = std::min(G, L - first);
    b.gather_logit_rows(x, first, n, H, xr);
    b.gather_logit_rows(attn_.get(), first, n, Q, mtp_attn_.get());
    if (!w.attn_gate.is_empty()) {
      b.gather_logit_rows(h, first, n, H, hr);
      b.linear(hr, n, w.attn_gate, mtp_gate_.get());
      b.sigmoid_gate(mtp_attn_.get(), mtp_gate_.get(), n, Q);
    }
    b.linear(mtp_attn_.get(), n, w.o_proj, hr);
    b.add_rmsnorm(xr, hr, w.pre_mlp_norm, c.rms_norm_eps, n, H, hr);
    mlp_block(w, s, n, hr);
    // x + h, the MTP norm, the shared lm_head, sampled as the batch asks
    b.add_rmsnorm(xr, hr, mtp_norm_, c.rms_norm_eps, n, H, hr);
    b.linear(hr, n, lm_head_, logits_.get());
    if (c.final_logit_softcap > 0) b.softcap(logits_.get(), n, V, c.final_logit_softcap);
    b.take_logits(batch, first, n, logits_.get(), V, out);
  }
  return out;
}

}  // namespace lmkit
