// The CPU backend: fp32 activations (bf16 dot products for dense layers with bf16_linear), weights packed
// into the kernels' panels (kernels/ops.h), the KV pool in one anonymous mapping, the sampler on the host.
#include <malloc.h>
#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <random>
#include <thread>

#include "core/check.h"
#include "kernels/cpu/sampling.h"
#include "model/backend.h"
#include "model/moe_routing.h"

namespace lmkit {

namespace {

constexpr int64_t kHeadRows = 64;  // logits are computed and consumed in groups of rows

float* f32(void* p) { return static_cast<float*>(p); }
const float* f32(const void* p) { return static_cast<const float*>(p); }

// A packed linear: one weight, or (parts that cannot be joined in place) several run one after another
// into a scratch and interleaved into the output's columns.
struct CpuLinear {
  std::vector<ops::LinearWeight> parts;
  std::vector<float> bias;  // fp32 [n], or empty
};

class CpuBackend final : public Backend {
 public:
  explicit CpuBackend(const BackendOptions& options) : options_(options) {
    // dtype='bfloat16' is refused on CPUs without the kernel, even when no dense layer would use it (an AWQ
    // model with an int8 lm_head): a setting that silently does nothing would mislead.
    if (options.bf16_linear) ops::require_bf16_dot();
  }
  ~CpuBackend() override {
    if (kv_pool_) ::munmap(kv_pool_, kv_pool_bytes_);
    if (state_pool_) ::munmap(state_pool_, state_pool_bytes_);
  }
  const char* name() const override { return "cpu"; }

  void prepare(const ModelConfig& config, const ModelWeights& /*weights*/) override {
    swiglu_alpha_ = config.swiglu_alpha, swiglu_limit_ = config.swiglu_limit;
  }

  PackedLinear pack_linear(const std::vector<const LinearTensors*>& parts, const std::vector<const Tensor*>& biases,
                           bool projection) override {
    auto impl = std::make_shared<CpuLinear>();
    PackedLinear out;
    for (const LinearTensors* t : parts) {
      ops::LinearWeight w = pack_part(*t, projection && options_.int8_weights);
      LMKIT_CHECK(out.k == 0 || out.k == w.k, "fused linear parts differ in input size");
      out.k = w.k;
      out.n += w.n;
      impl->parts.push_back(std::move(w));
    }
    if (impl->parts.size() > 1) {
      std::vector<const ops::LinearWeight*> ptrs;
      for (const ops::LinearWeight& w : impl->parts) ptrs.push_back(&w);
      ops::LinearWeight joined = ops::concat_linear(ptrs);
      if (!joined.is_empty()) impl->parts = {std::move(joined)};
    }
    bool any_bias = false;
    for (const Tensor* b : biases) any_bias = any_bias || !b->is_empty();
    if (any_bias)
      for (const Tensor* b : biases)
        for (int64_t i = 0; i < b->numel(); ++i) impl->bias.push_back(float_value(*b, i));
    LMKIT_CHECK(impl->bias.empty() || (int64_t)impl->bias.size() == out.n, "bias of ", impl->bias.size(),
                " values for a linear of ", out.n, " outputs");
    for (const ops::LinearWeight& w : impl->parts) out.size_bytes += w.size_bytes();
    out.impl = impl;
    packed_.push_back(impl);
    return out;
  }

  PackedLinear pack_lm_head(const Tensor& weight, bool quantized) override {
    // With int8 activations, the lm_head (kept dense by int4 checkpoints; a third of SmolLM2's bytes) runs as int8 per 32
    // values too, as llama.cpp's Q8_0 output does: half the bytes of fp16 at negligible error. A GGUF head runs
    // in its own blocks.
    auto impl = std::make_shared<CpuLinear>();
    const bool int8 = (quantized || options_.int8_weights) && options_.int8_activations && ops::int8_dot_available() &&
                      weight.shape[1] % 32 == 0;
    if (dtype_is_block(weight.dtype))
      impl->parts.push_back(pack_part(single_tensor_linear(weight, nullptr, "lm_head")));
    else
      impl->parts.push_back(int8 ? int8_activation_head(weight) : pack_dense(weight));
    PackedLinear out;
    out.n = impl->parts[0].n, out.k = impl->parts[0].k, out.size_bytes = impl->parts[0].size_bytes();
    out.impl = impl;
    packed_.push_back(impl);
    return out;
  }

  // Every weight into one huge-page block, in packing order (the order a step reads them); then the
  // checkpoint's pages of the linears leave resident memory.
  void weights_packed(const ModelWeights& weights) override {
    std::vector<ops::LinearWeight*> all;
    for (const std::shared_ptr<CpuLinear>& l : packed_)
      for (ops::LinearWeight& w : l->parts) all.push_back(&w);
    ops::gather_weights(all);
    packed_.clear();
    weights.release_linear_pages();
  }

  DeviceVector upload_norm(const Tensor& w, float offset) override {
    auto v = std::shared_ptr<float>(new float[w.numel()], std::default_delete<float[]>());
    for (int64_t i = 0; i < w.numel(); ++i) v.get()[i] = offset + float_value(w, i);
    return DeviceVector{v, w.numel()};
  }

  RopeTable upload_rope(const std::vector<float>& inv_freq, float attention_scaling) override {
    auto v = std::shared_ptr<float>(new float[inv_freq.size()], std::default_delete<float[]>());
    std::copy(inv_freq.begin(), inv_freq.end(), v.get());
    return RopeTable{v, (int32_t)(2 * inv_freq.size()), attention_scaling};
  }

  void set_embedding(const Tensor& table) override { embedding_ = table; }
  void set_per_layer_embedding(const Tensor& table) override { per_layer_embedding_ = table; }

  std::shared_ptr<void> allocate_activations(int64_t rows, int64_t cols) override {
    const int64_t bytes = std::max<int64_t>(rows * cols, 1) * (int64_t)sizeof(float);
    if (bytes < kMappedActivationBytes)
      return std::shared_ptr<float>(new float[std::max<int64_t>(rows * cols, 1)], std::default_delete<float[]>());
    // Large workspaces get their own mapping: pages committed as steps touch rows, returned when idle.
    void* p =
        ::mmap(nullptr, (size_t)bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
    LMKIT_CHECK(p != MAP_FAILED, "cannot map ", bytes, " bytes of activations");
    mapped_activations_.emplace_back(p, bytes);
    return std::shared_ptr<void>(p, [this, bytes](void* q) {  // the model frees them before its backend
      mapped_activations_.erase(std::remove(mapped_activations_.begin(), mapped_activations_.end(),
                                            std::make_pair(q, bytes)),
                                mapped_activations_.end());
      ::munmap(q, (size_t)bytes);
    });
  }

  void release_idle_memory(const std::vector<int32_t>& free_blocks) override {
    const int64_t page = ::sysconf(_SC_PAGESIZE);
    auto drop = [page](char* begin, char* end) {  // the whole pages inside [begin, end)
      const uintptr_t b = ((uintptr_t)begin + page - 1) / page * page, e = (uintptr_t)end / page * page;
      if (e > b) ::madvise((void*)b, e - b, MADV_DONTNEED);
    };
    if (kv_pool_ != nullptr)
      for (size_t i = 0; i < free_blocks.size();) {  // runs of consecutive free ids, in every layer's K and V
        size_t j = i + 1;
        while (j < free_blocks.size() && free_blocks[j] == free_blocks[j - 1] + 1) ++j;
        for (const ops::KVLayer& kv : kv_layers_) {
          const int64_t bb = kv.block_bytes();
          for (char* base : {(char*)kv.k, (char*)kv.v})
            drop(base + free_blocks[i] * bb, base + (free_blocks[j - 1] + 1) * bb);
        }
        i = j;
      }
    for (const auto& [p, bytes] : mapped_activations_) drop((char*)p, (char*)p + bytes);
    for (std::vector<float>* v : {&q_, &k_, &v_, &scratch_, &row_, &moe_logits_, &moe_sum_, &moe_x_, &moe_gate_up_,
                                  &moe_y_, &gates_})
      std::vector<float>().swap(*v);
#ifdef __GLIBC__
    ::malloc_trim(0);  // what the process freed (rendered answers, step outputs) back to the OS too
#endif
  }

  void configure_kv(const std::vector<KVQuant>& layer_quant, const std::vector<int32_t>& layer_kv_heads,
                    const std::vector<int32_t>& layer_head_dim, int32_t block_size_tokens) override {
    LMKIT_CHECK(layer_kv_heads.size() == layer_quant.size() && layer_head_dim.size() == layer_quant.size(),
                "KV heads of ", layer_kv_heads.size(), " and head dims of ", layer_head_dim.size(), " layers for ",
                layer_quant.size());
    kv_layers_.clear();
    kv_layer_offset_.clear();
    int64_t offset = 0;
    for (size_t l = 0; l < layer_quant.size(); ++l) {
      // A packed (bf16 or quantized) KV cache needs an even head_dim, up to the kernels' largest; bf16 V is also
      // stored by token pairs, so its blocks must hold an even number of tokens (ops.h).
      const int32_t head_dim = layer_head_dim[l];
      const bool packed_fits = head_dim % 2 == 0 && head_dim <= ops::kKVQuantMaxHeadDim;
      // full precision (KVQuant::kNone) is bf16 with bf16 compute or bf16_kv where its layout fits, else fp32
      int32_t bits = layer_quant[l] == KVQuant::kNone ? 32 : static_cast<int32_t>(layer_quant[l]);
      LMKIT_CHECK(bits == 32 || bits == 8 || bits == 4, "layer ", l, ": unknown KVQuant ", bits);
      const bool bf16 = options_.bf16_linear || options_.bf16_kv;
      if (bits == 32 && bf16 && packed_fits && block_size_tokens % 2 == 0) bits = 16;
      LMKIT_CHECK_ARG(bits == 32 || packed_fits, "a bf16 or quantized KV cache needs an even head_dim <= ",
                      ops::kKVQuantMaxHeadDim, ", layer ", l, " has ", head_dim);
      ops::KVLayer kv;
      kv.bits = bits, kv.num_kv_heads = layer_kv_heads[l], kv.block_size_tokens = block_size_tokens;
      kv.head_dim = head_dim;
      kv_layers_.push_back(kv);
      kv_layer_offset_.push_back(offset);
      offset += 2 * kv.block_bytes();
    }
    kv_layer_offset_.push_back(offset);
  }

  int64_t kv_bytes_per_block() const override { return kv_layer_offset_.back(); }

  void allocate_kv_pool(int32_t num_blocks) override {
    LMKIT_CHECK(kv_pool_ == nullptr, "the KV pool is allocated once");
    kv_pool_bytes_ = std::max<int64_t>(kv_bytes_per_block(), 1) * num_blocks;  // one byte: no layer keeps K/V
    // Anonymous mapping: pages are committed when first written, lowest block ids first.
    void* p = ::mmap(nullptr, kv_pool_bytes_, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE,
                     -1, 0);
    LMKIT_CHECK(p != MAP_FAILED, "cannot reserve ", kv_pool_bytes_, " bytes for the KV pool (", num_blocks,
                " blocks); lower cache_max_entry_count");
    kv_pool_ = static_cast<char*>(p);
    for (size_t l = 0; l < kv_layers_.size(); ++l) {
      ops::KVLayer& kv = kv_layers_[l];
      kv.num_blocks = num_blocks;
      char* k = kv_pool_ + kv_layer_offset_[l] * num_blocks;
      kv.k = k;
      kv.v = k + kv.block_bytes() * num_blocks;
    }
  }

  // One block's bytes: layer 0's K, layer 0's V, layer 1's K, ... (each with its scales), kv_bytes_per_block() in all.
  bool can_copy_kv_blocks() const override { return true; }
  void read_kv_block(int32_t block, void* dst) const override {
    LMKIT_CHECK(kv_pool_ != nullptr && block >= 0 && block < kv_layers_[0].num_blocks, "read_kv_block(", block,
                ") outside the pool");
    char* out = static_cast<char*>(dst);
    for (const ops::KVLayer& kv : kv_layers_) {
      const int64_t bb = kv.block_bytes();
      for (const void* base : {kv.k, kv.v}) {
        std::memcpy(out, static_cast<const char*>(base) + block * bb, (size_t)bb);
        out += bb;
      }
    }
  }
  void write_kv_block(int32_t block, const void* src) override {
    LMKIT_CHECK(kv_pool_ != nullptr && block >= 0 && block < kv_layers_[0].num_blocks, "write_kv_block(", block,
                ") outside the pool");
    const char* in = static_cast<const char*>(src);
    for (ops::KVLayer& kv : kv_layers_) {
      const int64_t bb = kv.block_bytes();
      for (void* base : {kv.k, kv.v}) {
        std::memcpy(static_cast<char*>(base) + block * bb, in, (size_t)bb);
        in += bb;
      }
    }
  }

  void configure_state(const std::vector<RecurrentSpec>& layers) override {
    state_layer_offset_.assign(1, 0);
    for (const RecurrentSpec& r : layers) {
      const int64_t floats = (int64_t)(r.conv_kernel - 1) * r.conv_dim() + r.value_dim() * r.k_head_dim;
      state_layer_offset_.push_back(state_layer_offset_.back() + floats);
    }
  }
  int64_t state_bytes_per_slot() const override { return state_layer_offset_.back() * (int64_t)sizeof(float); }
  void allocate_state_pool(int32_t num_slots) override {
    LMKIT_CHECK(state_pool_ == nullptr, "the state pool is allocated once");
    state_pool_bytes_ = state_bytes_per_slot() * num_slots;
    if (state_pool_bytes_ == 0) return;
    void* p = ::mmap(nullptr, state_pool_bytes_, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE,
                     -1, 0);
    LMKIT_CHECK(p != MAP_FAILED, "cannot reserve ", state_pool_bytes_, " bytes for the recurrent-state pool (",
                num_slots, " slots); lower max_batch_size");
    state_pool_ = static_cast<float*>(p);
    num_state_slots_ = num_slots;
  }

  int64_t begin_step(const Batch& batch) override {
    LMKIT_CHECK(batch.num_tokens <= options_.max_step_tokens, "step of ", batch.num_tokens,
                " tokens exceeds the workspace of ", options_.max_step_tokens);
    LMKIT_CHECK(kv_pool_ != nullptr, "allocate_kv_pool() before the first step");
    batch_ = &batch;
    // recurrent state: copies first (a parent's state into its completions' slots), then a chunk at position 0
    // starts from zeros
    const int64_t slot_floats = state_layer_offset_.back();
    for (const StateCopy& c : batch.state_copies) {
      LMKIT_CHECK(c.src >= 0 && c.src < num_state_slots_ && c.dst >= 0 && c.dst < num_state_slots_,
                  "state copy ", c.src, " -> ", c.dst, " outside the pool of ", num_state_slots_, " slots");
      std::memcpy(state_pool_ + c.dst * slot_floats, state_pool_ + c.src * slot_floats, slot_floats * sizeof(float));
    }
    LMKIT_CHECK(slot_floats > 0 || batch.state_checkpoints.empty(), "state checkpoints for a model without "
                "recurrent layers");
    for (const BatchSeq& s : batch.seqs) {
      if (slot_floats == 0 || batch.stateless) break;
      LMKIT_CHECK(s.state_slot >= 0 && s.state_slot < num_state_slots_, "a sequence of a model with recurrent "
                  "layers has state slot ", s.state_slot, " (", num_state_slots_, " in the pool)");
      LMKIT_CHECK(s.num_checkpoints >= 0 && s.num_checkpoints < s.num_rows && s.checkpoint_offset >= 0 &&
                      s.checkpoint_offset + s.num_checkpoints <= (int64_t)batch.state_checkpoints.size(),
                  "a sequence of ", s.num_rows, " rows has checkpoints [", s.checkpoint_offset, ", +",
                  s.num_checkpoints, ") of ", batch.state_checkpoints.size());
      for (int32_t t = 0; t < s.num_checkpoints; ++t) {
        const int32_t c = batch.state_checkpoints[s.checkpoint_offset + t];
        LMKIT_CHECK(c >= 0 && c < num_state_slots_ && c != s.state_slot, "checkpoint slot ", c, " (the sequence's: ",
                    s.state_slot, ", ", num_state_slots_, " in the pool)");
      }
      if (s.ctx_len == s.num_rows) std::memset(state_pool_ + s.state_slot * slot_floats, 0, slot_floats * sizeof(float));
    }
    attn_seqs_.clear();
    for (const BatchSeq& s : batch.seqs) {
      ops::AttnSeq a;
      a.q_row = s.first_row;
      a.q_len = s.num_rows;
      a.ctx_len = s.ctx_len;
      a.block_table = batch.block_tables.data() + s.table_offset;
      a.num_decode_rows = s.num_decode_rows;
      a.prefill = s.prefill;
      attn_seqs_.push_back(a);
    }
    return batch.num_tokens;
  }
  int64_t num_logit_rows() const override { return (int64_t)batch_->logit_rows.size(); }
  int64_t max_head_rows() const override { return kHeadRows; }

  void add_per_layer_embedding(int64_t rows, int64_t dim, float scale, float mix, void* out) override {
    const Tensor& t = per_layer_embedding_;
    LMKIT_CHECK(t.ndim == 2 && t.shape[1] == dim, "per-layer embedding table not set");
    per_layer_rows_.resize(rows * dim);
    float* e = per_layer_rows_.data();
    if (dtype_is_block(t.dtype)) {
      for (int64_t r = 0; r < rows; ++r) {
        const int32_t id = batch_->token_ids[r];
        LMKIT_CHECK(id >= 0 && id < t.shape[0], "per-layer embedding: token id ", id, " out of range");
        ggml_dequantize_row(t, id, e + r * dim);
      }
    } else {
      ops::embedding(t, batch_->token_ids.data(), rows, e);
    }
    float* o = f32(out);
    for (int64_t i = 0; i < rows * dim; ++i) o[i] = (o[i] + e[i] * scale) * mix;
  }

  void embedding(int64_t rows, int64_t hidden, float scale, void* out) override {
    LMKIT_CHECK(embedding_.ndim == 2 && embedding_.shape[1] == hidden, "embedding table not set");
    if (dtype_is_block(embedding_.dtype)) {  // GGUF blocks: each row dequantized as it is looked up
      for (int64_t t = 0; t < rows; ++t) {
        const int32_t id = batch_->token_ids[t];
        LMKIT_CHECK(id >= 0 && id < embedding_.shape[0], "embedding: token id ", id, " out of range");
        ggml_dequantize_row(embedding_, id, f32(out) + t * hidden);
      }
    } else {
      ops::embedding(embedding_, batch_->token_ids.data(), rows, f32(out));
    }
    if (scale != 1.0f) ops::scale(f32(out), rows * hidden, scale);
  }

  void rmsnorm(const void* x, const DeviceVector& w, float eps, int64_t rows, int64_t dim, void* out) override {
    ops::rmsnorm(f32(x), view(w), eps, rows, dim, f32(out));
  }

  void add_rmsnorm(void* residual, const void* x, const DeviceVector& w, float eps, int64_t rows, int64_t dim,
                   void* out) override {
    ops::add_rmsnorm(f32(residual), f32(x), view(w), eps, rows, dim, f32(out));
  }

  void linear(const void* x, int64_t rows, const PackedLinear& w, void* out) override {
    const CpuLinear& l = *static_cast<const CpuLinear*>(w.impl.get());
    const Tensor bias = l.bias.empty() ? Tensor{} : make_view((void*)l.bias.data(), DType::F32, w.n);
    if (l.parts.size() == 1) {
      ops::linear(f32(x), rows, l.parts[0], bias, f32(out));
      return;
    }
    // parts one by one, then their columns side by side: out[t] = part0[t] | part1[t] | ...
    int64_t col = 0;
    for (const ops::LinearWeight& p : l.parts) {
      scratch_.resize(rows * p.n);
      ops::linear(f32(x), rows, p, Tensor{}, scratch_.data());
      for (int64_t t = 0; t < rows; ++t)
        std::memcpy(f32(out) + t * w.n + col, scratch_.data() + t * p.n, p.n * sizeof(float));
      col += p.n;
    }
    if (!l.bias.empty())
      for (int64_t t = 0; t < rows; ++t)
        for (int64_t j = 0; j < w.n; ++j) f32(out)[t * w.n + j] += l.bias[j];
  }

  void attention(void* qkv, int64_t rows, const AttentionSpec& a, void* out) override {
    const int64_t Q = (int64_t)a.num_heads * a.head_dim, KV = (int64_t)a.num_kv_heads * a.head_dim;
    float *q, *k = nullptr, *v = nullptr;
    if (a.reads_shared_kv) {  // q only; K/V are the source layer's, already in the cache
      q = f32(qkv);
      if (a.q_norm) ops::rmsnorm(q, view(*a.q_norm), a.norm_eps, rows * a.num_heads, a.head_dim, q);
      if (a.rope)
        ops::rope(q, nullptr, batch_->positions.data(), rows, a.num_heads, 0, a.head_dim,
                  static_cast<const float*>(a.rope->inv_freq.get()), a.rope->attention_scaling, a.rope->rotary_dim);
      ops::paged_attention(q, kv_layers_[a.layer], attn_seqs_.data(), (int32_t)attn_seqs_.size(), a.num_heads, a.scale,
                           a.sliding_window, f32(out), a.logit_softcap,
                           a.sinks ? static_cast<const float*>(a.sinks->data.get()) : nullptr);
      return;
    }
    split_qkv(f32(qkv), rows, Q, KV, q, k, v);
    if (a.q_norm && a.norm_whole) ops::rmsnorm(q, view(*a.q_norm), a.norm_eps, rows, Q, q);
    else if (a.q_norm) ops::rmsnorm(q, view(*a.q_norm), a.norm_eps, rows * a.num_heads, a.head_dim, q);
    if (a.k_norm && a.norm_whole) ops::rmsnorm(k, view(*a.k_norm), a.norm_eps, rows, KV, k);
    else if (a.k_norm) ops::rmsnorm(k, view(*a.k_norm), a.norm_eps, rows * a.num_kv_heads, a.head_dim, k);
    if (a.v_norm) ops::rmsnorm(v, view(*a.v_norm), a.norm_eps, rows * a.num_kv_heads, a.head_dim, v);
    if (a.rope)
      ops::rope(q, k, batch_->positions.data(), rows, a.num_heads, a.num_kv_heads, a.head_dim,
                static_cast<const float*>(a.rope->inv_freq.get()), a.rope->attention_scaling, a.rope->rotary_dim);
    const ops::KVLayer& kv = kv_layers_[a.layer];
    ops::kv_write(kv, k, v, batch_->slots.data(), rows);
    ops::paged_attention(q, kv, attn_seqs_.data(), (int32_t)attn_seqs_.size(), a.num_heads, a.scale, a.sliding_window,
                         f32(out), a.logit_softcap,
                         a.sinks ? static_cast<const float*>(a.sinks->data.get()) : nullptr);
  }

  void recurrent_mixer(void* proj, int64_t rows, const RecurrentSpec& r, void* out) override {
    const int64_t P = r.proj_dim(), KD = r.key_dim(), VD = r.value_dim(), C = r.conv_dim(), Hv = r.num_v_heads;
    const int64_t slot_floats = state_layer_offset_.back(), layer_offset = state_layer_offset_[r.index];
    float* x = f32(proj);
    const int64_t conv_floats = (int64_t)(r.conv_kernel - 1) * C;
    recurrent_seqs_.clear();
    // this layer's part of each checkpoint slot (pointers into a vector sized first: it does not move)
    checkpoint_ptrs_.resize(2 * batch_->state_checkpoints.size());
    float** conv_ptrs = checkpoint_ptrs_.data();
    float** state_ptrs = conv_ptrs + batch_->state_checkpoints.size();
    for (size_t i = 0; i < batch_->state_checkpoints.size(); ++i) {
      conv_ptrs[i] = state_pool_ + batch_->state_checkpoints[i] * slot_floats + layer_offset;
      state_ptrs[i] = conv_ptrs[i] + conv_floats;
    }
    for (const BatchSeq& s : batch_->seqs) {
      float* slot = state_pool_ + s.state_slot * slot_floats + layer_offset;
      ops::RecurrentSeq rs{s.first_row, s.num_rows, slot, slot + conv_floats};
      rs.num_checkpoints = s.num_checkpoints;
      rs.conv_checkpoints = conv_ptrs + s.checkpoint_offset;
      rs.state_checkpoints = state_ptrs + s.checkpoint_offset;
      recurrent_seqs_.push_back(rs);
    }
    const int32_t n = (int32_t)recurrent_seqs_.size();
    ops::causal_conv1d(x, P, C, f32(r.conv_weight->data.get()), r.conv_kernel, recurrent_seqs_.data(), n);
    // beta = sigmoid(b), log decay g = -exp(A_log) * softplus(a + dt_bias)
    gates_.resize(2 * rows * Hv);
    float* g = gates_.data();
    float* beta = g + rows * Hv;
    const float* rate = f32(r.decay_rate->data.get());
    const float* dt = f32(r.dt_bias->data.get());
    for (int64_t t = 0; t < rows; ++t) {
      const float* b = x + t * P + C + VD;
      const float* a = b + Hv;
      for (int64_t h = 0; h < Hv; ++h) {
        const float y = a[h] + dt[h];
        const float softplus = y > 20.0f ? y : std::log1p(std::exp(y));
        g[t * Hv + h] = rate[h] * softplus;
        beta[t * Hv + h] = 1.0f / (1.0f + std::exp(-b[h]));
      }
    }
    ops::gated_delta_rule(x, x + KD, x + 2 * KD, P, g, beta, recurrent_seqs_.data(), n, r.num_k_heads, r.num_v_heads,
                          r.k_head_dim, r.v_head_dim, f32(out), VD, r.value_heads_tiled);
    // gated RMSNorm per value head: norm(o) * w * silu(z), z read in place in each row of proj
    ops::rmsnorm(f32(out), view(*r.norm), r.norm_eps, rows * Hv, r.v_head_dim, f32(out));
    for (int64_t t = 0; t < rows; ++t) ops::silu_mul(x + t * P + C, f32(out) + t * VD, 1, VD, f32(out) + t * VD);
  }

  void sigmoid_gate(void* x, const void* gate, int64_t rows, int64_t dim) override {
    float* o = f32(x);
    const float* gt = f32(gate);
    for (int64_t i = 0; i < rows * dim; ++i) o[i] *= 1.0f / (1.0f + std::exp(-gt[i]));
  }

  void add_sigmoid_gated(void* out, const void* x, const void* gate, int64_t rows, int64_t dim) override {
    for (int64_t t = 0; t < rows; ++t) {
      const float s = 1.0f / (1.0f + std::exp(-f32(gate)[t]));
      const float* src = f32(x) + t * dim;
      float* dst = f32(out) + t * dim;
      for (int64_t c = 0; c < dim; ++c) dst[c] += s * src[c];
    }
  }

  void gated_activation(void* gate_up, int64_t rows, int64_t inter, Activation act, void* out) override {
    float* gu = f32(gate_up);
    // Row by row: row t's output [t I, (t + 1) I) ends before its input starts at 2 t I, so out may alias gate_up.
    for (int64_t t = 0; t < rows; ++t) {
      const float *g = gu + 2 * t * inter, *u = g + inter;
      float* o = f32(out) + t * inter;
      if (act == Activation::kClampedSwiglu) ops::clamped_swiglu_mul(g, u, 1, inter, swiglu_alpha_, swiglu_limit_, o);
      else if (act == Activation::kGeluTanh) ops::gelu_tanh_mul(g, u, 1, inter, o);
      else ops::silu_mul(g, u, 1, inter, o);
    }
  }

  // Router logits for all rows, then each expert's rows gathered (ordered by expert), gate | up of every active
  // expert in one linear_group, act(gate) * up over all of them, down in one linear_group, and each output
  // row added into the sum with its router weight. One thread team per projection splits the panels of all
  // active experts among the threads: across experts and across an expert's columns, every weight read once.
  int64_t moe(const void* x, int64_t rows, const PackedExperts& w, const MoeSpec& spec, void* out,
              const void* router_x = nullptr) override {
    const int64_t H = w.router.k, E = w.router.n, I = spec.inter;
    int64_t bytes = w.router.size_bytes;
    moe_logits_.resize(rows * E);
    linear(router_x != nullptr ? router_x : x, rows, w.router, moe_logits_.data());
    route_top_k(moe_logits_.data(), rows, (int32_t)E, spec.top_k, spec.renormalize, routing_);
    if (!w.expert_scale.is_empty()) {  // each expert's weights times its scale, after the renormalization
      const float* scale = static_cast<const float*>(w.expert_scale.data.get());
      for (int32_t e = 0; e < (int32_t)E; ++e)
        for (int64_t j = routing_.offsets[e]; j < routing_.offsets[e] + routing_.count(e); ++j)
          routing_.weights[j] *= scale[e];
    }
    const int64_t n = (int64_t)routing_.rows.size();  // (row, expert) pairs, grouped by expert
    moe_x_.resize(n * H);
    for (int64_t j = 0; j < n; ++j)
      std::memcpy(moe_x_.data() + j * H, f32(x) + (int64_t)routing_.rows[j] * H, H * sizeof(float));
    moe_gate_up_.resize(n * 2 * I);
    moe_y_.resize(n * H);
    gate_up_jobs_.clear(), down_jobs_.clear();
    bool grouped = true;
    for (int32_t e = 0; e < (int32_t)E; ++e) {
      const int64_t m = routing_.count(e), first = routing_.offsets[e];
      if (m == 0) continue;
      bytes += w.gate_up[e].size_bytes + w.down[e].size_bytes;
      const CpuLinear& gu = *static_cast<const CpuLinear*>(w.gate_up[e].impl.get());
      const CpuLinear& dn = *static_cast<const CpuLinear*>(w.down[e].impl.get());
      grouped = grouped && gu.parts.size() == 1 && dn.parts.size() == 1;
      gate_up_jobs_.push_back({moe_x_.data() + first * H, m, &gu.parts[0], moe_gate_up_.data() + first * 2 * I});
      down_jobs_.push_back({moe_gate_up_.data() + first * I, m, &dn.parts[0], moe_y_.data() + first * H});
    }
    // gate | up that could not be joined into one weight (an intermediate size not a multiple of the panel
    // width) run expert by expert through linear(), which interleaves the parts
    // (grouped: without the experts' biases, added after over each expert's rows, gpt-oss's)
    auto run = [&](std::vector<ops::LinearJob>& jobs, const std::vector<PackedLinear>& ws) {
      if (!grouped) {
        for (int32_t e = 0, i = 0; e < (int32_t)E; ++e)
          if (routing_.count(e) > 0) linear(jobs[i].x, jobs[i].M, ws[e], jobs[i].out), ++i;
        return;
      }
      ops::linear_group(jobs.data(), (int64_t)jobs.size());
      for (int32_t e = 0, i = 0; e < (int32_t)E; ++e) {
        if (routing_.count(e) == 0) continue;
        const std::vector<float>& bias = static_cast<const CpuLinear*>(ws[e].impl.get())->bias;
        const ops::LinearJob& job = jobs[i++];
        if (bias.empty()) continue;
        for (int64_t r = 0; r < job.M; ++r)
          for (int64_t j = 0; j < (int64_t)bias.size(); ++j) job.out[r * (int64_t)bias.size() + j] += bias[j];
      }
    };
    run(gate_up_jobs_, w.gate_up);
    gated_activation(moe_gate_up_.data(), n, I, spec.act, moe_gate_up_.data());  // [n, I] packed in place
    run(down_jobs_, w.down);
    moe_sum_.assign(rows * H, 0.0f);
    for (int64_t j = 0; j < n; ++j) {
      float* dst = moe_sum_.data() + (int64_t)routing_.rows[j] * H;
      const float* src = moe_y_.data() + j * H;
      const float wt = routing_.weights[j];
      for (int64_t c = 0; c < H; ++c) dst[c] += wt * src[c];
    }
    std::memcpy(out, moe_sum_.data(), rows * H * sizeof(float));
    return bytes;
  }

  void gather_logit_rows(const void* x, int64_t first, int64_t n, int64_t dim, void* out) override {
    gather_rows(x, batch_->logit_rows.data() + first, n, dim, out);
  }

  void gather_rows(const void* x, const int32_t* rows, int64_t n, int64_t dim, void* out) override {
    for (int64_t i = 0; i < n; ++i)
      std::memcpy(f32(out) + i * dim, f32(x) + (int64_t)rows[i] * dim, dim * sizeof(float));
  }
  void concat_columns(const void* a, const void* b, int64_t rows, int64_t dim, void* out) override {
    for (int64_t r = 0; r < rows; ++r) {
      std::memcpy(f32(out) + r * 2 * dim, f32(a) + r * dim, dim * sizeof(float));
      std::memcpy(f32(out) + r * 2 * dim + dim, f32(b) + r * dim, dim * sizeof(float));
    }
  }

  void softcap(void* x, int64_t rows, int64_t dim, float cap) override { ops::softcap(f32(x), rows * dim, cap); }
  void add(void* x, const void* y, int64_t rows, int64_t dim) override {
    float* a = f32(x);
    const float* b = static_cast<const float*>(y);
    for (int64_t i = 0; i < rows * dim; ++i) a[i] += b[i];
  }
  void gated_product(void* gate, const void* x, int64_t x_first, int64_t x_stride, int64_t rows, int64_t dim,
                     Activation act) override {
    LMKIT_CHECK(act == Activation::kGeluTanh || act == Activation::kSilu, "gated_product: silu or gelu_tanh");
    for (int64_t t = 0; t < rows; ++t) {
      float* g = f32(gate) + t * dim;
      const float* u = static_cast<const float*>(x) + t * x_stride + x_first;
      if (act == Activation::kGeluTanh) ops::gelu_tanh_mul(g, u, 1, dim, g);
      else ops::silu_mul(g, u, 1, dim, g);
    }
  }
  void scale(void* x, int64_t rows, int64_t dim, float s) override { ops::scale(f32(x), rows * dim, s); }

  void take_logits(const Batch& batch, int64_t first, int64_t n, const void* logits, int64_t vocab,
                   StepOutput& out) override {
    const float* lg = f32(logits);
    for (size_t r = 0; r < batch.logit_outputs.size(); ++r) {
      const int64_t i = batch.logit_outputs[r].logit_index - first;
      if (i >= 0 && i < n) std::memcpy(out.logits.data() + r * vocab, lg + i * vocab, vocab * sizeof(float));
    }
    take_prompt_logprobs(batch, first, n, lg, vocab, out);
    for (size_t k = 0; k < batch.samples.size(); ++k) {
      const SampleRow& s = batch.samples[k];
      const int64_t i = s.logit_index - first;
      if (i < 0 || i >= n) continue;
      row_.assign(lg + i * vocab, lg + (i + 1) * vocab);  // the sampler works in place
      std::mt19937_64 rng(s.seed);
      ops::SampleLogprobs lp;
      out.tokens[k] = ops::sample(row_.data(), (int32_t)vocab, *s.params, s.history, s.num_history, s.num_prompt,
                                  s.banned.data(), (int32_t)s.banned.size(), s.mask ? s.mask->wait(s.mask_row) : nullptr,
                                  rng, s.params->logprobs >= 0 ? &lp : nullptr);
      if (s.params->logprobs >= 0) {
        out.logprobs[k].logprob = lp.logprob;
        out.logprobs[k].top_ids = std::move(lp.top_ids);
        out.logprobs[k].top_logprobs = std::move(lp.top_logprobs);
      }
    }
  }

  void take_hidden(const Batch& batch, int64_t first, int64_t n, const void* hidden, int64_t dim,
                   StepOutput& out) override {
    for (size_t r = 0; r < batch.hidden_outputs.size(); ++r) {
      const int64_t i = batch.hidden_outputs[r].logit_index - first;
      if (i >= 0 && i < n) std::memcpy(out.hidden.data() + r * dim, f32(hidden) + i * dim, dim * sizeof(float));
    }
  }

  void bind_thread() override {
    const int hw = (int)std::thread::hardware_concurrency();
    ops::set_num_threads(options_.num_threads > 0 ? options_.num_threads : hw > 0 ? hw : 1);
  }

 private:
  ops::LinearWeight pack_dense(const Tensor& w) const {
    const auto format = options_.bf16_linear ? ops::WeightFormat::Bf16Pairs : ops::WeightFormat::Dense;
    return ops::weight_format_traits(format).pack_float(w);
  }
  static ops::LinearWeight int8_activation_head(const Tensor& w) {
    ops::LinearWeight head = ops::pack_linear_int8(w);
    head.int8_activations = true;
    return head;
  }
  // One stored linear in its kernel's layout: int4 (checkpoint layouts, GGUF Q4_0/Q4_1), int8 (GGUF Q5_0/Q8_0; a float
  // weight rounded per 32 inputs where `int8`, BackendOptions::int8_weights), dense; the quantized ones with int8
  // activations where the engine asks for them (else the exact fp32 product of the stored weights).
  ops::LinearWeight pack_part(const LinearTensors& t, bool int8 = false) const {
    const bool dense = !t.is_int4() && !t.is_int8();
    if (dense && !(int8 && !dtype_is_block(t.weight.dtype) && t.weight.shape[1] % 32 == 0)) return pack_dense(t.weight);
    ops::LinearWeight w = t.is_int4() ? ops::pack_linear_int4(t.int4_source)
                          : t.is_int8() ? ops::pack_linear_int8(t.int8_source)
                                        : ops::pack_linear_int8(t.weight);
    w.int8_activations = options_.int8_activations;
    return w;
  }
  static Tensor view(const DeviceVector& v) { return make_view(v.data.get(), DType::F32, v.n); }

  // The fused projection [rows, Q | KV | KV] as q, k, v: pointers into it for one row, else copied out
  // ([rows, Q], [rows, KV], [rows, KV]) so that every kernel reads packed rows.
  void split_qkv(float* qkv, int64_t rows, int64_t Q, int64_t KV, float*& q, float*& k, float*& v) {
    if (rows == 1) {
      q = qkv, k = qkv + Q, v = qkv + Q + KV;
      return;
    }
    q_.resize(rows * Q), k_.resize(rows * KV), v_.resize(rows * KV);
    q = q_.data(), k = k_.data(), v = v_.data();
    const float* src = qkv;
    for (int64_t t = 0; t < rows; ++t, src += Q + 2 * KV) {
      std::memcpy(q + t * Q, src, Q * sizeof(float));
      std::memcpy(k + t * KV, src + Q, KV * sizeof(float));
      std::memcpy(v + t * KV, src + Q + KV, KV * sizeof(float));
    }
  }

  static constexpr int64_t kMappedActivationBytes = 1 << 20;
  BackendOptions options_;
  std::vector<std::pair<void*, int64_t>> mapped_activations_;  // (mapping, bytes): released when idle
  std::vector<std::shared_ptr<CpuLinear>> packed_;  // what pack_linear / pack_lm_head made, until weights_packed
  Tensor embedding_;
  Tensor per_layer_embedding_;
  std::vector<float> per_layer_rows_;  // the step's rows of per_layer_embedding_
  const Batch* batch_ = nullptr;
  std::vector<ops::AttnSeq> attn_seqs_;
  std::vector<float> q_, k_, v_, scratch_, row_;
  ExpertRouting routing_;
  std::vector<float> moe_logits_, moe_sum_, moe_x_, moe_gate_up_, moe_y_;
  float swiglu_alpha_ = 0.0f, swiglu_limit_ = 0.0f;  // Activation::kClampedSwiglu's constants (prepare)
  std::vector<ops::LinearJob> gate_up_jobs_, down_jobs_;

  // KV pool: per layer, K then V, each num_blocks blocks in that layer's format (ops::KVLayer), lazily
  // committed. kv_layer_offset_[l]: bytes before layer l's K, per block of the pool.
  std::vector<ops::KVLayer> kv_layers_;
  std::vector<int64_t> kv_layer_offset_{0};
  char* kv_pool_ = nullptr;
  int64_t kv_pool_bytes_ = 0;

  // Recurrent-state pool: num_state_slots_ slots of every recurrent layer's state (state_layer_offset_[i]: floats
  // before layer i's part of a slot: its convolution window [kernel - 1, conv_dim], then its [Hv, Dk, Dv]
  // matrices), zero-filled on first touch.
  std::vector<int64_t> state_layer_offset_{0};
  float* state_pool_ = nullptr;
  int64_t state_pool_bytes_ = 0;
  int32_t num_state_slots_ = 0;
  std::vector<ops::RecurrentSeq> recurrent_seqs_;
  std::vector<float*> checkpoint_ptrs_;  // a recurrent layer's part of each checkpoint slot: conv, then state
  std::vector<float> gates_;
};

}  // namespace

std::unique_ptr<Backend> make_cpu_backend(const BackendOptions& options) {
  return std::make_unique<CpuBackend>(options);
}

}  // namespace lmkit
