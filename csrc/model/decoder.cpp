#include "model/decoder.h"

#include <sys/mman.h>

#include <algorithm>
#include <cmath>
#include <cstring>

#include "core/check.h"
#include "kernels/cpu/sampling.h"

namespace lmkit {

namespace {
constexpr int32_t kLogitRowsPerGroup = 64;  // logits are computed and consumed in groups of rows
}

DecoderModel::DecoderModel(const ModelConfig& config, ModelWeights weights, const DecoderOptions& options)
    : config_(config), weights_(std::move(weights)), options_(options) {
  const int64_t T = options.max_step_tokens;
  LMKIT_CHECK(T > 0, "max_step_tokens must be > 0");
  residual_.resize(T * config.hidden_size);
  hidden_.resize(T * config.hidden_size);
  q_.resize(T * config.q_size());
  k_.resize(T * config.kv_size());
  v_.resize(T * config.kv_size());
  attn_.resize(T * config.q_size());
  wide_.resize(T * std::max<int64_t>(2 * config.intermediate_size, config.q_size() + 2 * config.kv_size()));
  logits_.resize((int64_t)kLogitRowsPerGroup * config.vocab_size);
  gathered_.resize((int64_t)kLogitRowsPerGroup * config.hidden_size);
  // dtype='bfloat16' is refused here on CPUs without the kernel, even when no dense layer would use it
  // (an AWQ model with an int8 lm_head): a setting that silently does nothing would mislead.
  if (options.bf16_linear) ops::require_bf16_dot();
  auto pack_dense = [&](const Tensor& w) {
    return options.bf16_linear ? ops::pack_linear_bf16(w) : ops::pack_linear(w);
  };
  auto pack = [&](const LinearTensors& t) {
    if (!t.is_awq()) return pack_dense(t.weight);
    ops::LinearWeight w = ops::pack_linear_awq(t.qweight, t.qzeros, t.scales, config.awq_group_size);
    w.int8_activations = options.awq_int8_activations;
    return w;
  };
  for (const LayerWeights& w : weights_.layers) {
    PackedLayer p;
    p.q_proj = pack(w.q_proj);
    p.k_proj = pack(w.k_proj);
    p.v_proj = pack(w.v_proj);
    p.qkv = ops::concat_linear({&p.q_proj, &p.k_proj, &p.v_proj});
    if (!p.qkv.is_empty()) {
      p.q_proj = p.k_proj = p.v_proj = ops::LinearWeight{};
      if (!w.q_bias.is_empty())
        for (const Tensor* b : {&w.q_bias, &w.k_bias, &w.v_bias})
          for (int64_t i = 0; i < b->numel(); ++i) p.qkv_bias.push_back(float_value(*b, i));
    }
    p.o_proj = pack(w.o_proj);
    p.gate_proj = pack(w.gate_proj);
    p.up_proj = pack(w.up_proj);
    p.gate_up = ops::concat_linear({&p.gate_proj, &p.up_proj});
    if (!p.gate_up.is_empty()) p.gate_proj = p.up_proj = ops::LinearWeight{};
    p.down_proj = pack(w.down_proj);
    packed_.push_back(std::move(p));
  }
  // With int8 activations, the lm_head (kept dense by AWQ; a third of SmolLM2's bytes) runs as int8
  // per 32 values too, as llama.cpp's Q8_0 output does: half the bytes of fp16 at negligible error.
  bool any_awq = false;
  for (const LayerWeights& w : weights_.layers) any_awq = any_awq || w.q_proj.is_awq() || w.gate_proj.is_awq();
  if (any_awq && options.awq_int8_activations && ops::int8_dot_available() && config.hidden_size % 32 == 0)
    lm_head_ = ops::pack_linear_int8(weights_.lm_head);
  else
    lm_head_ = pack_dense(weights_.lm_head);
  weights_.release_linear_pages();

  if (options_.kv_bits.empty()) options_.kv_bits.assign(config.num_layers, 32);
  LMKIT_CHECK_ARG((int32_t)options_.kv_bits.size() == config.num_layers, "KV precision is given for ",
                  options_.kv_bits.size(), " layers, the model has ", config.num_layers);
  // A packed (bf16 or quantized) KV cache needs an even head_dim, up to the kernels' largest; bf16 V is also
  // stored by token pairs, so its blocks must hold an even number of tokens (ops.h).
  const bool packed_kv_fits = config.head_dim % 2 == 0 && config.head_dim <= ops::kKVQuantMaxHeadDim;
  int64_t offset = 0;
  for (int32_t l = 0; l < config.num_layers; ++l) {
    int32_t& bits = options_.kv_bits[l];
    LMKIT_CHECK_ARG(bits == 32 || bits == 8 || bits == 4, "layer ", l, ": KV bits must be 32, 8 or 4, got ", bits);
    // "full precision" KV is the compute dtype: bf16 where its layout fits, else fp32
    if (bits == 32 && options_.bf16_linear && packed_kv_fits && options_.block_size_tokens % 2 == 0) bits = 16;
    LMKIT_CHECK_ARG(bits == 32 || packed_kv_fits,
                    "a bf16 or quantized KV cache needs an even head_dim <= ", ops::kKVQuantMaxHeadDim,
                    ", the model has ", config.head_dim);
    kv_layer_offset_.push_back(offset);
    offset += 2 * kv_layer_shape(l).block_bytes();
  }
  kv_layer_offset_.push_back(offset);
}

DecoderModel::~DecoderModel() {
  if (kv_pool_) ::munmap(kv_pool_, kv_pool_bytes_);
}

int64_t DecoderModel::kv_bytes_per_block() const { return kv_layer_offset_.back(); }

int64_t DecoderModel::linear_weight_bytes() const {
  int64_t bytes = lm_head_.size_bytes();
  for (const PackedLayer& p : packed_)
    for (const ops::LinearWeight* w : p.all())
      if (!w->is_empty()) bytes += w->size_bytes();
  return bytes;
}

void DecoderModel::allocate_kv_pool(int32_t num_blocks) {
  LMKIT_CHECK(kv_pool_ == nullptr, "the KV pool is allocated once");
  kv_pool_bytes_ = kv_bytes_per_block() * num_blocks;
  // Anonymous mapping: pages are committed when first written, lowest block ids first.
  void* p = ::mmap(nullptr, kv_pool_bytes_, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
  LMKIT_CHECK(p != MAP_FAILED, "cannot reserve ", kv_pool_bytes_, " bytes for the KV pool (", num_blocks,
              " blocks); lower cache_max_entry_count");
  kv_pool_ = static_cast<char*>(p);
  num_blocks_ = num_blocks;
}

void DecoderModel::bind_thread() {
  if (options_.num_threads > 0) ops::set_num_threads(options_.num_threads);
}

ops::KVLayer DecoderModel::kv_layer_shape(int32_t layer) const {
  ops::KVLayer kv;
  kv.bits = options_.kv_bits[layer];
  kv.num_blocks = num_blocks_;
  kv.num_kv_heads = config_.num_kv_heads;
  kv.block_size = options_.block_size_tokens;
  kv.head_dim = config_.head_dim;
  return kv;
}

ops::KVLayer DecoderModel::kv_layer(int32_t layer) const {
  ops::KVLayer kv = kv_layer_shape(layer);
  char* k = kv_pool_ + kv_layer_offset_[layer] * num_blocks_;
  kv.k = k;
  kv.v = k + kv.block_bytes() * num_blocks_;
  return kv;
}

void DecoderModel::forward(const BatchPlan& plan) {
  const ModelConfig& c = config_;
  const int64_t T = plan.num_tokens, H = c.hidden_size, I = c.intermediate_size;
  const int32_t bs = options_.block_size_tokens;
  LMKIT_CHECK(T <= options_.max_step_tokens, "step of ", T, " tokens exceeds the workspace of ",
              options_.max_step_tokens);
  LMKIT_CHECK(kv_pool_ != nullptr, "allocate_kv_pool() before the first step");

  token_ids_.resize(T);
  positions_.resize(T);
  slots_.resize(T);
  attn_seqs_.clear();
  logit_rows_.clear();
  int32_t row = 0;
  for (const ScheduledSeq& s : plan.seqs) {
    const Sequence& seq = *s.seq;
    LMKIT_CHECK((int64_t)seq.block_table.size() * bs >= s.start_pos + s.num_tokens, "sequence ", seq.id,
                " has too few blocks for its chunk");
    ops::AttnSeq a;
    a.q_row = row;
    a.q_len = s.num_tokens;
    a.ctx_len = s.start_pos + s.num_tokens;
    a.block_table = seq.block_table.data();
    attn_seqs_.push_back(a);
    for (int32_t j = 0; j < s.num_tokens; ++j, ++row) {
      const int32_t pos = s.start_pos + j;
      token_ids_[row] = seq.tokens[pos];
      positions_[row] = pos;
      slots_[row] = seq.block_table[pos / bs] * bs + pos % bs;
      const bool is_last = j == s.num_tokens - 1;
      if ((is_last && s.is_sampled) || seq.params.output_logits) logit_rows_.push_back(row);
    }
  }

  float* residual = residual_.data();
  float* h = hidden_.data();
  const Tensor no_bias;
  ops::embedding(weights_.embed_tokens, token_ids_.data(), T, residual);
  const float scale = 1.0f / std::sqrt((float)c.head_dim);
  for (int32_t l = 0; l < c.num_layers; ++l) {
    const LayerWeights& w = weights_.layers[l];
    const PackedLayer& pw = packed_[l];
    if (l == 0)
      ops::rmsnorm(residual, w.input_norm, c.rms_norm_eps, T, H, h);
    else  // residual += mlp output (in h); h = norm(residual)
      ops::add_rmsnorm(residual, h, w.input_norm, c.rms_norm_eps, T, H, h);
    float *q = q_.data(), *k = k_.data(), *v = v_.data();
    if (!pw.qkv.is_empty()) {
      const Tensor bias = pw.qkv_bias.empty() ? no_bias
                                              : make_view((void*)pw.qkv_bias.data(), DType::F32, pw.qkv.n);
      ops::linear(h, T, pw.qkv, bias, wide_.data());
      split_qkv(T, q, k, v);
    } else {
      ops::linear(h, T, pw.q_proj, w.q_bias, q);
      ops::linear(h, T, pw.k_proj, w.k_bias, k);
      ops::linear(h, T, pw.v_proj, w.v_bias, v);
    }
    ops::rope(q, k, positions_.data(), T, c.num_heads, c.num_kv_heads, c.head_dim, c.inv_freq.data(),
              c.attention_scaling);
    const ops::KVLayer kv = kv_layer(l);
    ops::kv_write(kv, k, v, slots_.data(), T);
    ops::paged_attention(q, kv, attn_seqs_.data(), (int32_t)attn_seqs_.size(), c.num_heads, scale,
                         c.sliding_window, attn_.data());
    ops::linear(attn_.data(), T, pw.o_proj, no_bias, h);
    ops::add_rmsnorm(residual, h, w.post_attention_norm, c.rms_norm_eps, T, H, h);
    float* act = wide_.data();  // silu(gate) * up, [T, I]
    if (!pw.gate_up.is_empty()) {
      ops::linear(h, T, pw.gate_up, no_bias, act);  // rows of gate | up
      // In place, row by row: row t's output [t I, (t + 1) I) ends before its input starts at 2 t I.
      for (int64_t t = 0; t < T; ++t) ops::silu_mul(act + 2 * t * I, act + (2 * t + 1) * I, 1, I, act + t * I);
    } else {
      float* up = act + T * I;
      ops::linear(h, T, pw.gate_proj, no_bias, act);
      ops::linear(h, T, pw.up_proj, no_bias, up);
      ops::silu_mul(act, up, T, I, act);
    }
    ops::linear(act, T, pw.down_proj, no_bias, h);
  }
}

// The fused q/k/v output in wide_ ([T, q | k | v]) as q, k, v: pointers into it for one row, else
// copied out into q_, k_, v_ ([T, q_size] etc.).
void DecoderModel::split_qkv(int64_t T, float*& q, float*& k, float*& v) {
  const int64_t Q = config_.q_size(), KV = config_.kv_size(), row = Q + 2 * KV;
  if (T == 1) {
    q = wide_.data();
    k = q + Q;
    v = k + KV;
    return;
  }
  const float* src = wide_.data();
  for (int64_t t = 0; t < T; ++t, src += row) {
    std::memcpy(q + t * Q, src, Q * sizeof(float));
    std::memcpy(k + t * KV, src + Q, KV * sizeof(float));
    std::memcpy(v + t * KV, src + Q + KV, KV * sizeof(float));
  }
}

void DecoderModel::step(const BatchPlan& plan, std::vector<int32_t>& sampled) {
  sampled.assign(plan.seqs.size(), -1);
  if (plan.empty()) return;
  forward(plan);
  const ModelConfig& c = config_;
  const int64_t H = c.hidden_size, V = c.vocab_size;

  // Map each logit row back to its plan entry: rows are in plan order.
  std::vector<int32_t> row_owner(plan.num_tokens);
  {
    int32_t row = 0;
    for (int32_t i = 0; i < (int32_t)plan.seqs.size(); ++i)
      for (int32_t j = 0; j < plan.seqs[i].num_tokens; ++j) row_owner[row++] = i;
  }
  std::vector<int32_t> row_start(plan.seqs.size());
  {
    int32_t row = 0;
    for (size_t i = 0; i < plan.seqs.size(); ++i) {
      row_start[i] = row;
      row += plan.seqs[i].num_tokens;
    }
  }

  std::vector<int32_t> banned;
  for (size_t g = 0; g < logit_rows_.size(); g += kLogitRowsPerGroup) {
    const int32_t n = (int32_t)std::min<size_t>(kLogitRowsPerGroup, logit_rows_.size() - g);
    // residual + last mlp output, final norm, for the gathered rows only.
    for (int32_t r = 0; r < n; ++r) {
      const int32_t row = logit_rows_[g + r];
      float* dst = gathered_.data() + r * H;
      const float* res = residual_.data() + (int64_t)row * H;
      const float* mlp = hidden_.data() + (int64_t)row * H;
      for (int64_t j = 0; j < H; ++j) dst[j] = res[j] + mlp[j];
    }
    ops::rmsnorm(gathered_.data(), weights_.final_norm, c.rms_norm_eps, n, H, gathered_.data());
    ops::linear(gathered_.data(), n, lm_head_, Tensor{}, logits_.data());

    for (int32_t r = 0; r < n; ++r) {
      const int32_t row = logit_rows_[g + r];
      const int32_t i = row_owner[row];
      const ScheduledSeq& s = plan.seqs[i];
      Sequence& seq = *s.seq;
      float* lr = logits_.data() + (int64_t)r * V;
      const int32_t pos = s.start_pos + (row - row_start[i]);
      if (seq.params.output_logits && pos >= (int32_t)seq.num_logit_rows_emitted) {
        seq.pending_logits.insert(seq.pending_logits.end(), lr, lr + V);
        ++seq.pending_logit_rows;
        seq.num_logit_rows_emitted = pos + 1;
      }
      const bool is_sample_row = s.is_sampled && row == row_start[i] + s.num_tokens - 1;
      if (!is_sample_row) continue;
      banned.clear();
      if (seq.num_generated_tokens() < seq.params.min_new_tokens) {
        if (!seq.params.ignore_eos) banned.insert(banned.end(), options_.eos_token_ids.begin(), options_.eos_token_ids.end());
        banned.insert(banned.end(), seq.params.stop_token_ids.begin(), seq.params.stop_token_ids.end());
      }
      ops::SampleLogprobs lp;
      sampled[i] = ops::sample(lr, (int32_t)V, seq.params, seq.tokens.data(), seq.num_tokens(), seq.num_prompt_tokens,
                               banned.data(), (int32_t)banned.size(), seq.rng, &lp);
      if (seq.params.logprobs >= 0) {
        seq.sample_logprob = lp.logprob;
        seq.sample_top_ids.swap(lp.top_ids);
        seq.sample_top_logprobs.swap(lp.top_logprobs);
      }
    }
  }
}

}  // namespace lmkit
