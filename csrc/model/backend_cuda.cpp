// The CUDA backend: fp16/bf16 activations on the device through kernels/cuda/ops_cuda.h, weights uploaded once
// (q | k | v and gate | up joined into one weight, int4 checkpoints repacked into the int4 layout), the KV pool in one device
// allocation, the step's integers in one buffer, decode steps replayed as CUDA graphs, sampling on the GPU (rows
// with logprobs or returned logits: the CPU sampler on a host copy, so logprobs mean the same on both backends).
//
// What has no CUDA kernel yet (q/k norms, partial rotary, layers without RoPE, soft-capping, GeGLU, scaled
// embeddings) is refused by prepare() at load time, naming the architecture and the op.
#include <algorithm>
#include <cstdio>
#include <cstring>
#include <map>
#include <random>
#include <unordered_map>

#include "core/check.h"
#include "kernels/cpu/sampling.h"
#include "kernels/cuda/ops_cuda.h"
#include "model/backend.h"

namespace lmkit {

namespace {

// GGUF block tensors have no CUDA kernels yet.
void refuse_blocks(const Tensor& t) {
  LMKIT_CHECK_ARG(!dtype_is_block(t.dtype), "GGUF ", dtype_name(t.dtype),
                  " weights are not supported by the CUDA backend yet; run them with device='cpu'");
}

constexpr int64_t kHeadRows = 64;  // logits are computed and consumed in groups of rows, as on the CPU
constexpr int32_t kGraphBatchSizes[] = {1, 2, 4, 8, 12, 16, 24, 32, 48, 64, 96, 128, 160, 192, 224, 256};
constexpr int32_t kMaxQueryHeadsPerKVHead = 16;  // the attention kernel's warps per CTA

// The captured size a decode step of `rows` rows pads to; 0 above the largest.
int32_t graph_batch_size(int64_t rows) {
  for (int32_t g : kGraphBatchSizes)
    if (g >= rows) return g;
  return 0;
}

float act_to_float(uint16_t bits, DType act) { return act == DType::F16 ? f16_to_f32(bits) : bf16_to_f32(bits); }
uint16_t float_to_act(float v, DType act) { return act == DType::F16 ? f32_to_f16(v) : f32_to_bf16(v); }

// Bytes a linear takes on the device (the int4 layout of ops_cuda.h, or dense in the activation dtype).
int64_t device_bytes(const LinearTensors& t) {
  if (!t.is_int4()) return t.weight.numel() * 2;
  const int64_t K = t.num_in(), N = t.num_out(), G = K / t.int4_source.group_size;
  return N * K / 2 + N * G * 3;
}

// The int32 inputs of a step of `rows` rows and `seqs` sequences, one after another in one buffer (one
// host -> device copy):
//   token ids | positions | slots | row -> seq   [rows each]
//   q_start [seqs + 1] | ctx_lens [seqs] | block tables [seqs, max_blocks] | logit rows [num_logit_rows]
// The same views serve the host copy and the device one.
struct StepInts {
  int32_t *token_ids, *positions, *slots, *row_seq, *q_start, *ctx_lens, *tables, *logit_rows;
  StepInts() = default;
  StepInts(int32_t* base, int64_t rows, int64_t seqs, int64_t max_blocks)
      : token_ids(base), positions(base + rows), slots(base + 2 * rows), row_seq(base + 3 * rows),
        q_start(base + 4 * rows), ctx_lens(q_start + seqs + 1), tables(ctx_lens + seqs),
        logit_rows(tables + seqs * max_blocks) {}
  static int64_t count(int64_t rows, int64_t seqs, int64_t max_blocks, int64_t num_logit_rows) {
    return 4 * rows + (seqs + 1) + seqs + seqs * max_blocks + num_logit_rows;
  }
  cuda::AttnBatch attn_batch(int32_t rows, int32_t seqs, int32_t max_blocks, int32_t max_ctx) const {
    cuda::AttnBatch b;
    b.row_seq = row_seq, b.q_start = q_start, b.ctx_lens = ctx_lens, b.block_tables = tables;
    b.num_seqs = seqs, b.num_rows = rows, b.max_blocks_per_seq = max_blocks, b.max_ctx_len = max_ctx;
    return b;
  }
};

// A packed linear: the weight in the backend's layout and its bias ([n] act, or null).
struct CudaLinear {
  cuda::Linear w;
  std::shared_ptr<void> bias;
};

class CudaBackend final : public Backend {
 public:
  CudaBackend(const BackendOptions& options, DType act, int64_t hidden_size, int64_t vocab_size)
      : options_(options), act_(act), hidden_size_(hidden_size), vocab_size_(vocab_size) {
    LMKIT_CHECK_ARG(cuda::is_available(), "device='cuda' but no CUDA device is usable (no driver or no GPU); use "
                    "device='cpu'");
    LMKIT_CHECK_ARG(act == DType::F16 || act == DType::BF16, "the CUDA backend computes in float16 or bfloat16, got ",
                    dtype_name(act));
    LMKIT_CHECK(options.max_step_tokens > 0, "max_step_tokens must be > 0");
    // the largest captured size that fits the workspaces (a step pads up to a captured size)
    if (options.cuda_graphs && options.max_blocks_per_seq > 0)
      for (int32_t g : kGraphBatchSizes)
        if (g <= options.max_step_tokens) max_graph_rows_ = g;
    max_head_rows_ = std::max<int64_t>(kHeadRows, max_graph_rows_);  // a graph step's head runs inside its graph
    stream_ = cuda::create_stream();
    sample_params_ = cuda::allocate(max_head_rows_ * (int64_t)sizeof(cuda::SampleParams));
    sampled_dev_ = cuda::allocate(max_head_rows_ * 4);
    if (max_graph_rows_ > 0) {
      const int64_t G = max_graph_rows_;
      graph_ints_ = cuda::allocate(StepInts::count(G, G, options.max_blocks_per_seq, G) * 4);
    }
  }
  ~CudaBackend() override {
    if (!stream_) return;
    try {
      cuda::synchronize(stream_);  // nothing in flight reads the buffers freed after this
    } catch (...) {
    }
    cuda::destroy_stream(stream_);
  }
  const char* name() const override { return "cuda"; }

  // Refuses, before anything is uploaded, what has no CUDA kernel yet and a model that does not fit.
  void prepare(const ModelConfig& c, const ModelWeights& weights) override {
    architecture_ = c.architecture;
    num_heads_ = c.num_heads;
    std::vector<std::string> missing;
    if (c.has_qk_norm) missing.push_back("the q/k norm (per-head RMSNorm of q and k)");
    if (c.rotary_dims() < c.head_dim)
      missing.push_back(detail::concat("partial rotary embedding (rotary_dim ", c.rotary_dims(), " < head_dim ",
                                       c.head_dim, ")"));
    if (std::count(c.layer_rope.begin(), c.layer_rope.end(), 0) > 0) missing.push_back("layers without RoPE");
    if (c.attn_logit_softcap > 0) missing.push_back("attention logit soft-capping");
    if (c.final_logit_softcap > 0) missing.push_back("final logit soft-capping");
    if (c.hidden_act != "silu") missing.push_back("the " + c.hidden_act + " activation (hidden_act)");
    if (c.embed_scale != 1.0f) missing.push_back("the embedding scale");
    if (std::count(c.layer_moe.begin(), c.layer_moe.end(), 1) > 0) missing.push_back("mixture-of-experts layers");
    if (c.num_recurrent_layers() > 0) missing.push_back("recurrent (Gated DeltaNet) layers");
    if (c.attn_output_gate) missing.push_back("the attention output gate");
    if (c.attention_sinks) missing.push_back("attention sinks");
    if (c.has_o_bias) missing.push_back("an o_proj bias");
    if (!c.layer_head_dim.empty() || !c.layer_num_kv_heads.empty())
      missing.push_back("per-layer head dims and KV heads");
    if (!c.layer_v_from_k.empty()) missing.push_back("values taken from k_proj (attention_k_eq_v)");
    if (c.has_v_norm) missing.push_back("the value norm");
    if (c.has_layer_scalar) missing.push_back("per-layer output scalars");
    if (c.moe_beside_mlp) missing.push_back("an MLP beside the experts");
    if (!c.layer_kv_source.empty()) missing.push_back("cross-layer KV sharing");
    if (!c.layer_intermediate_size.empty()) missing.push_back("per-layer MLP widths");
    if (c.per_layer_input_size > 0) missing.push_back("per-layer embeddings");
    bool int8_weights = false;  // compressed-tensors int8 (GGUF's int8 blocks are refused with their own message)
    for (const LayerWeights& w : weights.layers)
      for (const LinearTensors* t : w.linears())
        int8_weights = int8_weights || (t->is_int8() && !dtype_is_block(t->weight.dtype));
    if (int8_weights) missing.push_back("int8 weights (compressed-tensors W8A8 / W8A16)");
    if (!missing.empty()) {
      std::string list = missing[0];
      for (size_t i = 1; i < missing.size(); ++i) list += (i + 1 == missing.size() ? " and " : ", ") + missing[i];
      unsupported(list, missing.size() > 1);
    }
    LMKIT_CHECK_ARG(c.hidden_size % 8 == 0 && c.intermediate_size % 8 == 0 && c.q_size() % 8 == 0, "device='cuda' ",
                    "needs hidden_size, intermediate_size and num_heads * head_dim to be multiples of 8; ",
                    c.architecture, " has ", c.hidden_size, ", ", c.intermediate_size, ", ", c.q_size(),
                    "; use device='cpu'");
    LMKIT_CHECK_ARG(c.head_dim <= cuda::kCudaMaxHeadDim, "device='cuda' needs head_dim <= ",
                    cuda::kCudaMaxHeadDim, ", ", c.architecture, " has ", c.head_dim, "; use device='cpu'");
    LMKIT_CHECK_ARG(c.num_heads / c.num_kv_heads <= kMaxQueryHeadsPerKVHead, "device='cuda' supports at most ",
                    kMaxQueryHeadsPerKVHead, " query heads per KV head, ", c.architecture, " has ",
                    c.num_heads / c.num_kv_heads, "; use device='cpu'");

    // Will it fit? (before any upload, so that the message is about the model, not a buffer)
    const bool tied = weights.lm_head.data == weights.embed_tokens.data;
    int64_t weight_bytes = (int64_t)c.vocab_size * c.hidden_size * 2 * (tied ? 1 : 2);
    for (const LayerWeights& w : weights.layers)
      for (const LinearTensors* t : w.linears()) weight_bytes += device_bytes(*t);
    // DecoderModel's workspaces (residual, hidden, q|k|v or gate|up, attention out; head rows and logits), 16 bits each
    const int64_t T = options_.max_step_tokens, H = c.hidden_size, G = max_head_rows_;
    const int64_t wide = std::max<int64_t>(2 * (int64_t)c.intermediate_size, c.q_size() + 2 * c.kv_size());
    const int64_t workspace_bytes = 2 * (T * (2 * H + wide + c.q_size()) + G * (2 * H + c.vocab_size));
    int64_t free_bytes = 0, total_bytes = 0;
    cuda::memory_info(&free_bytes, &total_bytes);
    LMKIT_CHECK_ARG(weight_bytes + workspace_bytes < free_bytes, "the model needs ", (weight_bytes >> 20),
                    " MiB of GPU memory for its weights and ", (workspace_bytes >> 20), " MiB for activations (max ",
                    T, " tokens per step), but the GPU has ", (free_bytes >> 20), " MiB free of ", (total_bytes >> 20),
                    " MiB; use an AWQ checkpoint, a smaller model or a smaller max_prefill_token_num");
  }

  // --- load time ---------------------------------------------------------------------------------------
  PackedLinear pack_linear(const std::vector<const LinearTensors*>& parts, const std::vector<const Tensor*>& biases,
                           bool /*projection: int8_weights is a CPU option*/) override {
    auto impl = std::make_shared<CudaLinear>();
    impl->w = upload_joined(parts);
    std::vector<const Tensor*> present;
    for (const Tensor* b : biases)
      if (!b->is_empty()) present.push_back(b);
    if (!present.empty()) {
      LMKIT_CHECK(present.size() == biases.size(), "a fused linear has biases on some of its parts only");
      impl->bias = upload_vector(present, 0.0f);
      LMKIT_CHECK(bias_count(present) == impl->w.n, "bias of ", bias_count(present), " values for a linear of ",
                  impl->w.n, " outputs");
    }
    return packed(impl);
  }

  PackedLinear pack_lm_head(const Tensor& weight, bool /*quantized: the lm_head stays in the activation dtype*/) override {
    refuse_blocks(weight);
    auto impl = std::make_shared<CudaLinear>();
    impl->w = cuda::upload_dense(weight, act_, stream_);
    lm_head_host_ = weight.data;
    lm_head_ = impl->w.data;
    return packed(impl);
  }

  DeviceVector upload_norm(const Tensor& w, float offset) override {
    return DeviceVector{upload_vector({&w}, offset), w.numel()};
  }

  RopeTable upload_rope(const std::vector<float>& inv_freq, float attention_scaling) override {
    auto dev = cuda::allocate((int64_t)inv_freq.size() * 4);
    cuda::copy_to_device(dev.get(), inv_freq.data(), (int64_t)inv_freq.size() * 4, stream_);
    cuda::synchronize(stream_);
    return RopeTable{dev, (int32_t)(2 * inv_freq.size()), attention_scaling};
  }

  void set_embedding(const Tensor& table) override {
    refuse_blocks(table);
    LMKIT_CHECK(table.ndim == 2 && table.shape[0] == vocab_size_ && table.shape[1] == hidden_size_,
                "the embedding table must be [", vocab_size_, ", ", hidden_size_, "]");
    // tied: one copy on the device, the lm_head's
    embedding_ = table.data == lm_head_host_ && lm_head_ ? lm_head_ : cuda::upload_dense(table, act_, stream_).data;
  }

  std::shared_ptr<void> allocate_activations(int64_t rows, int64_t cols) override {
    return cuda::allocate(std::max<int64_t>(rows * cols, 1) * 2);
  }

  // --- KV pool ------------------------------------------------------------------------------------------
  void configure_kv(const std::vector<KVQuant>& layer_quant, const std::vector<int32_t>& layer_kv_heads,
                    const std::vector<int32_t>& layer_head_dim, int32_t block_size_tokens) override {
    LMKIT_CHECK(layer_kv_heads.size() == layer_quant.size() && layer_head_dim.size() == layer_quant.size(),
                "KV heads of ", layer_kv_heads.size(), " and head dims of ", layer_head_dim.size(), " layers for ",
                layer_quant.size());
    LMKIT_CHECK(std::all_of(layer_head_dim.begin(), layer_head_dim.end(),
                            [&](int32_t d) { return d == layer_head_dim[0]; }),
                "device='cuda' needs one head_dim for every layer");
    const int32_t head_dim = layer_head_dim.empty() ? 0 : layer_head_dim[0];
    LMKIT_CHECK_ARG(head_dim % 2 == 0 && head_dim <= cuda::kCudaMaxHeadDim, "device='cuda' needs an even head_dim ",
                    "of at most ", cuda::kCudaMaxHeadDim, ", the model has ", head_dim);
    LMKIT_CHECK(num_heads_ > 0, "CudaBackend::prepare() must be called before configure_kv()");
    block_size_ = block_size_tokens;
    kv_layers_.clear();
    kv_layer_offset_.assign(1, 0);
    for (size_t l = 0; l < layer_quant.size(); ++l) {
      // full precision (KVQuant::kNone) is the activation dtype
      const int32_t bits = layer_quant[l] == KVQuant::kNone ? 16 : static_cast<int32_t>(layer_quant[l]);
      LMKIT_CHECK(bits == 16 || bits == 8 || bits == 4, "layer ", l, ": unknown KVQuant ", bits);
      ops::KVLayer kv;
      kv.bits = bits, kv.num_kv_heads = layer_kv_heads[l], kv.block_size_tokens = block_size_tokens;
      kv.head_dim = head_dim;
      kv_layers_.push_back(kv);
      kv_layer_offset_.push_back(kv_layer_offset_.back() + 2 * kv.block_bytes());
    }
    // One attention workspace for every step: the largest any row count up to max_step_tokens needs at the
    // longest context (small: the kernel splits the keys only while rows x heads is small).
    const int32_t max_ctx = options_.max_blocks_per_seq > 0 ? options_.max_blocks_per_seq * block_size_tokens : 1 << 24;
    max_attention_ctx_ = max_ctx;
    int64_t bytes = 0;
    for (int32_t r = 1; r <= options_.max_step_tokens; ++r) {
      const int64_t b = cuda::attention_workspace_bytes(r, num_heads_, head_dim, max_ctx);
      if (b == 0) break;  // more rows split no more
      bytes = std::max(bytes, b);
    }
    attn_workspace_bytes_ = bytes;
    attn_workspace_ = bytes > 0 ? cuda::allocate(bytes) : nullptr;
  }

  int64_t kv_bytes_per_block() const override { return kv_layer_offset_.back(); }

  void allocate_kv_pool(int32_t num_blocks) override {
    LMKIT_CHECK(kv_pool_ == nullptr, "the KV pool is allocated once");
    const int64_t bytes = kv_bytes_per_block() * num_blocks;
    kv_pool_ = cuda::allocate(bytes);
    // zeros, not garbage, under the padded rows of graph steps (they read block 0; their outputs are dropped)
    cuda::fill_bytes(kv_pool_.get(), 0, bytes, stream_);
    cuda::synchronize(stream_);
    for (size_t l = 0; l < kv_layers_.size(); ++l) {
      ops::KVLayer& kv = kv_layers_[l];
      kv.num_blocks = num_blocks;
      char* k = static_cast<char*>(kv_pool_.get()) + kv_layer_offset_[l] * num_blocks;
      kv.k = k;
      kv.v = k + kv.block_bytes() * num_blocks;
    }
  }

  // --- one step -----------------------------------------------------------------------------------------
  int64_t begin_step(const Batch& batch) override {
    LMKIT_CHECK(batch.num_tokens <= options_.max_step_tokens, "step of ", batch.num_tokens,
                " tokens exceeds the workspace of ", options_.max_step_tokens);
    LMKIT_CHECK(kv_pool_ != nullptr, "allocate_kv_pool() before the first step");
    LMKIT_CHECK(batch.block_size_tokens == block_size_, "a batch of ", batch.block_size_tokens, "-token blocks for a pool of ",
                block_size_);
    for (int32_t id : batch.token_ids)
      LMKIT_CHECK(id >= 0 && id < vocab_size_, "token id ", id, " is outside the vocabulary (", vocab_size_, ")");
    LMKIT_CHECK(batch.max_ctx_len <= max_attention_ctx_, "a context of ", batch.max_ctx_len,
                " tokens is longer than the attention workspace's ", max_attention_ctx_);
    graph_rows_ = is_graph_step(batch) ? graph_batch_size(batch.num_tokens) : 0;
    if (graph_rows_ > 0) {
      upload_graph_step(batch);
      return graph_rows_;
    }
    upload_step(batch);
    return batch.num_tokens;
  }
  int64_t num_logit_rows() const override { return num_logit_rows_; }
  int64_t max_head_rows() const override { return max_head_rows_; }

  // A decode step of a captured size replays its graph; the first step of a size runs eagerly (which also
  // lets cuBLAS settle its state for these shapes), then the same work is recorded for the next ones.
  // Recording executes nothing, so the eager step's results stand whether or not the capture succeeds; a
  // capture that fails turns graphs off (one line on stderr) and the engine goes on eagerly.
  void execute(const std::function<void()>& forward) override {
    if (graph_rows_ == 0) {
      forward();
      return;
    }
    auto it = graphs_.find(graph_rows_);
    if (it != graphs_.end()) {
      cuda::launch_graph(it->second, stream_);
      return;
    }
    forward();
    cuda::synchronize(stream_);
    try {
      cuda::begin_capture(stream_);
      forward();
      graphs_[graph_rows_] = cuda::end_capture(stream_);
    } catch (const std::exception& e) {
      cuda::abort_capture(stream_);
      graphs_.clear();
      max_graph_rows_ = 0;
      std::fprintf(stderr, "lmkit: CUDA graph capture failed (%s); decode steps run without graphs\n", e.what());
    }
  }

  void embedding(int64_t rows, int64_t hidden, float scale, void* out) override {
    if (scale != 1.0f) unsupported("the embedding scale");
    LMKIT_CHECK(embedding_ != nullptr && hidden == hidden_size_, "embedding table not set");
    cuda::embedding(embedding_.get(), act_, vocab_size_, ints_.token_ids, rows, hidden, out, act_, stream_);
  }

  void rmsnorm(const void* x, const DeviceVector& w, float eps, int64_t rows, int64_t dim, void* out) override {
    cuda::rmsnorm(x, w.data.get(), act_, eps, rows, dim, out, act_, stream_);
  }

  void add_rmsnorm(void* residual, const void* x, const DeviceVector& w, float eps, int64_t rows, int64_t dim,
                   void* out) override {
    cuda::add_rmsnorm(residual, x, w.data.get(), act_, eps, rows, dim, out, act_, stream_);
  }

  void linear(const void* x, int64_t rows, const PackedLinear& w, void* out) override {
    const CudaLinear& l = *static_cast<const CudaLinear*>(w.impl.get());
    cuda::linear(x, rows, l.w, l.bias.get(), out, act_, stream_);
  }

  void attention(void* qkv, int64_t rows, const AttentionSpec& a, void* out) override {
    if (a.q_norm || a.k_norm) unsupported("the q/k norm (per-head RMSNorm of q and k)");
    if (!a.rope) unsupported("layers without RoPE");
    if (a.rope->rotary_dim != a.head_dim) unsupported("partial rotary embedding");
    if (a.logit_softcap > 0) unsupported("attention logit soft-capping");
    LMKIT_CHECK(rows == attn_.num_rows, "attention over ", rows, " rows in a step of ", attn_.num_rows);
    const ops::KVLayer& kv = kv_layers_[a.layer];
    // bias (if any) came with the linear; RoPE of q and k in place, k and v into the pool at the step's slots
    cuda::qkv_rope_kv_write(qkv, nullptr, ints_.positions, ints_.slots, rows, a.num_heads,
                            static_cast<const float*>(a.rope->inv_freq.get()), a.rope->attention_scaling, kv, act_,
                            stream_);
    const int64_t width = (int64_t)(a.num_heads + 2 * a.num_kv_heads) * a.head_dim;  // q is read in place
    cuda::paged_attention(qkv, width, kv, attn_, a.num_heads, a.scale, a.sliding_window, attn_workspace_.get(), out,
                          act_, stream_);
  }

  // In place (out == gate_up), silu_mul's threads would overwrite inputs other threads have not read yet: row
  // t's output [t I, (t + 1) I) lies in row t / 2's input. Rows [a, 2a) write [a I, 2a I), inputs already
  // consumed, and read [2a I, 4a I): so the rows go in launches [0, 1), [1, 2), [2, 4), [4, 8), ...
  //   gate_up: | g0 u0 | g1 u1 | g2 u2 | g3 u3 | ...      out: | o0 | o1 | o2 | o3 | ...
  void gated_activation(void* gate_up, int64_t rows, int64_t inter, Activation act, void* out) override {
    if (act != Activation::kSilu) unsupported("GeGLU (gelu_tanh)");
    if (out != gate_up) {
      cuda::silu_mul(gate_up, rows, inter, out, act_, stream_);
      return;
    }
    const int64_t row_bytes = inter * 2;
    for (int64_t a = 0; a < rows; a = std::max<int64_t>(1, 2 * a)) {
      const int64_t b = std::min<int64_t>(rows, std::max<int64_t>(1, 2 * a));
      cuda::silu_mul(static_cast<char*>(gate_up) + 2 * a * row_bytes, b - a, inter,
                     static_cast<char*>(out) + a * row_bytes, act_, stream_);
    }
  }

  void gather_logit_rows(const void* x, int64_t first, int64_t n, int64_t dim, void* out) override {
    cuda::gather_rows(x, ints_.logit_rows + first, n, dim, out, act_, stream_);
  }

  void softcap(void*, int64_t, int64_t, float) override { unsupported("final logit soft-capping"); }

  void take_logits(const Batch& batch, int64_t first, int64_t n, const void* logits, int64_t vocab,
                   StepOutput& out) override;

  void take_hidden(const Batch& batch, int64_t first, int64_t n, const void* hidden, int64_t dim,
                   StepOutput& out) override {
    bool any = false;
    for (const HiddenOutputRow& r : batch.hidden_outputs)
      any = any || (r.logit_index >= first && r.logit_index < first + n);
    if (!any) return;
    host_hidden_raw_.resize((size_t)(n * dim));
    cuda::copy_to_host(host_hidden_raw_.data(), hidden, n * dim * 2, stream_);
    cuda::synchronize(stream_);
    for (size_t r = 0; r < batch.hidden_outputs.size(); ++r) {
      const int64_t i = batch.hidden_outputs[r].logit_index - first;
      if (i < 0 || i >= n) continue;
      for (int64_t c = 0; c < dim; ++c)
        out.hidden[r * dim + c] = act_to_float(host_hidden_raw_[(size_t)(i * dim + c)], act_);
    }
  }

  void bind_thread() override { cuda::set_device(device_); }

 private:
  [[noreturn]] void unsupported(const std::string& what, bool plural = false) const {
    throw InvalidArgument(detail::concat("device='cuda' does not support ", architecture_, " yet: ", what,
                                         plural ? " have" : " has", " no CUDA kernel; use device='cpu'"));
  }

  static int64_t bias_count(const std::vector<const Tensor*>& parts) {
    int64_t n = 0;
    for (const Tensor* t : parts) n += t->numel();
    return n;
  }

  // offset + the parts, concatenated, summed in fp32 on the host and rounded once to the activation dtype.
  std::shared_ptr<void> upload_vector(const std::vector<const Tensor*>& parts, float offset) {
    std::vector<uint16_t> host;
    for (const Tensor* t : parts)
      for (int64_t i = 0; i < t->numel(); ++i) host.push_back(float_to_act(offset + float_value(*t, i), act_));
    auto dev = cuda::allocate((int64_t)host.size() * 2);
    cuda::copy_to_device(dev.get(), host.data(), (int64_t)host.size() * 2, stream_);
    cuda::synchronize(stream_);
    return dev;
  }

  PackedLinear packed(const std::shared_ptr<CudaLinear>& impl) const {
    PackedLinear out;
    out.n = impl->w.n, out.k = impl->w.k, out.size_bytes = impl->w.size_bytes();
    out.impl = impl;
    return out;
  }

  cuda::Linear upload_joined(const std::vector<const LinearTensors*>& parts);
  bool is_graph_step(const Batch& batch) const;
  void upload_step(const Batch& batch);
  void upload_graph_step(const Batch& batch);
  void sample_on_gpu(void* logits, int64_t n, int64_t vocab, const std::vector<int32_t>& sample_of_row,
                     const Batch& batch, StepOutput& out);

  BackendOptions options_;
  DType act_;
  int64_t hidden_size_, vocab_size_;
  int device_ = 0;
  cuda::Stream stream_ = nullptr;
  std::string architecture_ = "this model";  // for messages (prepare())
  int32_t num_heads_ = 0;

  const void* lm_head_host_ = nullptr;  // the lm_head's host tensor, to recognise a tied embedding
  std::shared_ptr<void> lm_head_, embedding_;  // [vocab, hidden] act

  // KV pool: per layer, K then V, each num_blocks blocks in that layer's format (ops::KVLayer).
  // kv_layer_offset_[l]: bytes before layer l's K, per block of the pool.
  std::vector<ops::KVLayer> kv_layers_;
  std::vector<int64_t> kv_layer_offset_{0};
  std::shared_ptr<void> kv_pool_;
  int32_t block_size_ = 0;

  // The step: its ints on the device (ints_ views step_ints_ or, for a graph step, graph_ints_), the
  // attention's view of them, the logit rows the head reads.
  StepInts ints_{};
  cuda::AttnBatch attn_;
  int64_t num_logit_rows_ = 0;
  std::vector<int32_t> host_ints_;
  std::shared_ptr<void> step_ints_;
  int64_t step_ints_capacity_ = 0;
  std::shared_ptr<void> attn_workspace_;
  int64_t attn_workspace_bytes_ = 0;
  int32_t max_attention_ctx_ = 0;

  // CUDA graphs of decode steps, by padded batch size. Their inputs live at fixed addresses: graph_ints_ (the
  // StepInts of the largest size, block tables max_blocks_per_seq wide) and the shared attention workspace
  // (split plan fixed by the longest context, session_len).
  int32_t max_graph_rows_ = 0;
  int64_t max_head_rows_ = kHeadRows;
  int32_t graph_rows_ = 0;  // this step's padded size; 0: eager
  std::map<int32_t, std::shared_ptr<void>> graphs_;
  std::shared_ptr<void> graph_ints_;

  // The sampler's inputs and outputs.
  std::shared_ptr<void> sample_params_, penalty_ints_, sampled_dev_;
  int64_t penalty_capacity_ = 0;
  std::vector<cuda::SampleParams> params_host_;
  std::vector<int32_t> penalty_host_, sampled_host_;
  std::vector<uint16_t> host_logits_raw_, host_hidden_raw_;
  std::vector<float> host_logits_;
};

// Rows of several weights [n_i, k] as one weight [sum n_i, k] (q | k | v, gate | up), uploaded once.
// All int4: repacked and joined in the int4 layout; otherwise every part dense in the activation dtype
// (an int4 part dequantized on the host: checkpoints that keep some of a fused group unquantized).
cuda::Linear CudaBackend::upload_joined(const std::vector<const LinearTensors*>& parts) {
  LMKIT_CHECK(!parts.empty(), "a linear needs at least one part");
  for (const LinearTensors* p : parts) refuse_blocks(p->weight);
  const bool all_int4 = std::all_of(parts.begin(), parts.end(), [](const LinearTensors* p) { return p->is_int4(); });
  const bool any_int4 = std::any_of(parts.begin(), parts.end(), [](const LinearTensors* p) { return p->is_int4(); });
  if (parts.size() == 1 && !any_int4) return cuda::upload_dense(parts[0]->weight, act_, stream_);
  std::vector<cuda::HostInt4> packed;
  if (any_int4)
    for (const LinearTensors* p : parts)
      packed.push_back(p->is_int4() ? cuda::repack_int4(p->int4_source) : cuda::HostInt4{});
  if (all_int4) {
    if (parts.size() == 1) return cuda::upload_int4(packed[0], act_, stream_);
    cuda::HostInt4 joined;
    joined.k = packed[0].k, joined.group_size = packed[0].group_size;
    for (const cuda::HostInt4& h : packed) {
      LMKIT_CHECK(h.k == joined.k && h.group_size == joined.group_size,
                  "fused int4 parts differ in input size or group size");
      joined.n += h.n;
    }
    const int64_t K = joined.k, G = K / joined.group_size;
    joined.qweight.reset(new uint32_t[joined.n * (K / 8)]);
    joined.scales.reset(new uint16_t[joined.n * G]);
    joined.zeros.reset(new uint8_t[joined.n * G]);
    int64_t row = 0;
    for (const cuda::HostInt4& h : packed) {
      std::memcpy(joined.qweight.get() + row * (K / 8), h.qweight.get(), h.n * (K / 8) * 4);
      std::memcpy(joined.scales.get() + row * G, h.scales.get(), h.n * G * 2);
      std::memcpy(joined.zeros.get() + row * G, h.zeros.get(), h.n * G);
      row += h.n;
    }
    return cuda::upload_int4(joined, act_, stream_);
  }
  int64_t N = 0, K = -1;
  for (const LinearTensors* p : parts) {
    const int64_t n = p->num_out(), k = p->num_in();
    LMKIT_CHECK(K < 0 || k == K, "fused linear parts differ in input size");
    K = k, N += n;
  }
  std::vector<uint16_t> host((size_t)(N * K));
  int64_t row = 0;
  for (size_t i = 0; i < parts.size(); ++i) {
    const LinearTensors& p = *parts[i];
    if (!p.is_int4()) {
      const int64_t count = p.weight.numel();
      uint16_t* dst = host.data() + row * K;
      if (p.weight.dtype == act_)
        std::memcpy(dst, p.weight.data, count * 2);
      else
        for (int64_t j = 0; j < count; ++j) dst[j] = float_to_act(float_value(p.weight, j), act_);
      row += p.weight.shape[0];
      continue;
    }
    const cuda::HostInt4& h = packed[i];
    const int64_t G = K / h.group_size;
    for (int64_t n = 0; n < h.n; ++n, ++row)
      for (int64_t k = 0; k < K; ++k) {
        const uint32_t q = (h.qweight[n * (K / 8) + k / 8] >> (4 * (k % 8))) & 15u;
        const float s = f16_to_f32(h.scales[n * G + k / h.group_size]);
        host[(size_t)(row * K + k)] = float_to_act(((float)q - (float)h.zeros[n * G + k / h.group_size]) * s, act_);
      }
  }
  return cuda::upload_dense(make_view(host.data(), act_, N, K), act_, stream_);
}

// A decode step (every row one sequence's single token, every row's logits) of at most max_graph_rows_ rows
// whose contexts fit the graphs' block tables; longer steps, prefill chunks and rows without logits run eagerly.
bool CudaBackend::is_graph_step(const Batch& batch) const {
  return max_graph_rows_ > 0 && batch.is_decode_only() && batch.num_tokens <= max_graph_rows_ &&
         batch.max_blocks_per_seq <= options_.max_blocks_per_seq;
}

void CudaBackend::upload_step(const Batch& batch) {
  const int64_t T = batch.num_tokens, S = (int64_t)batch.seqs.size(), L = (int64_t)batch.logit_rows.size();
  const int32_t max_blocks = std::max(1, batch.max_blocks_per_seq);
  host_ints_.assign(StepInts::count(T, S, max_blocks, L), 0);
  const StepInts h(host_ints_.data(), T, S, max_blocks);
  std::copy(batch.token_ids.begin(), batch.token_ids.end(), h.token_ids);
  std::copy(batch.positions.begin(), batch.positions.end(), h.positions);
  std::copy(batch.slots.begin(), batch.slots.end(), h.slots);
  for (int64_t i = 0; i < S; ++i) {
    const BatchSeq& s = batch.seqs[i];
    h.q_start[i] = s.first_row;
    h.ctx_lens[i] = s.ctx_len;
    std::fill(h.row_seq + s.first_row, h.row_seq + s.first_row + s.num_rows, (int32_t)i);
    std::copy_n(batch.block_tables.begin() + s.table_offset, s.num_blocks, h.tables + i * max_blocks);
  }
  h.q_start[S] = (int32_t)T;
  std::copy(batch.logit_rows.begin(), batch.logit_rows.end(), h.logit_rows);
  if ((int64_t)host_ints_.size() > step_ints_capacity_) {
    cuda::synchronize(stream_);  // the previous buffer may still be read by the previous step
    step_ints_capacity_ = std::max<int64_t>((int64_t)host_ints_.size(), 2 * step_ints_capacity_);
    step_ints_ = cuda::allocate(step_ints_capacity_ * 4);
  }
  cuda::copy_to_device(step_ints_.get(), host_ints_.data(), (int64_t)host_ints_.size() * 4, stream_);
  ints_ = StepInts(static_cast<int32_t*>(step_ints_.get()), T, S, max_blocks);
  const int32_t max_ctx = std::max(1, batch.max_ctx_len);
  attn_ = ints_.attn_batch((int32_t)T, (int32_t)S, max_blocks, max_ctx);
  LMKIT_CHECK(cuda::attention_workspace_bytes((int32_t)T, num_heads_, kv_layers_[0].head_dim, max_ctx) <=
                  attn_workspace_bytes_, "the attention workspace is too small for this step");
  num_logit_rows_ = L;
}

// The layout of a G-row step: the real rows first, then padding rows (token 0 at position 0, slot -1: no KV
// write; a one-key context in block 0) whose outputs nobody reads. Every row is a logit row.
void CudaBackend::upload_graph_step(const Batch& batch) {
  const int32_t G = graph_rows_, MB = options_.max_blocks_per_seq;
  host_ints_.assign(StepInts::count(G, G, MB, G), 0);
  const StepInts h(host_ints_.data(), G, G, MB);
  for (int32_t i = 0; i < G; ++i) {
    h.row_seq[i] = i;
    h.q_start[i] = i;
    h.ctx_lens[i] = 1;
    h.slots[i] = -1;
    h.logit_rows[i] = i;
  }
  h.q_start[G] = G;
  for (int32_t i = 0; i < (int32_t)batch.seqs.size(); ++i) {
    const BatchSeq& s = batch.seqs[i];
    LMKIT_CHECK(s.first_row == i && s.num_rows == 1 && batch.logit_rows[i] == i, "a decode step's row ", i,
                " is not its sequence's single logit row");
    h.token_ids[i] = batch.token_ids[i];
    h.positions[i] = batch.positions[i];
    h.slots[i] = batch.slots[i];
    h.ctx_lens[i] = s.ctx_len;
    std::copy_n(batch.block_tables.begin() + s.table_offset, s.num_blocks, h.tables + (int64_t)i * MB);
  }
  cuda::copy_to_device(graph_ints_.get(), host_ints_.data(), (int64_t)host_ints_.size() * 4, stream_);
  ints_ = StepInts(static_cast<int32_t*>(graph_ints_.get()), G, G, MB);
  attn_ = ints_.attn_batch(G, G, MB, MB * block_size_);
  num_logit_rows_ = G;
}

// Rows whose logits go to the host (returned logits, samples with logprobs: the CPU sampler on the host copy,
// seeded by SampleRow::seed as on the CPU backend); every other sample row on the GPU sampler.
void CudaBackend::take_logits(const Batch& batch, int64_t first, int64_t n, const void* logits, int64_t vocab,
                              StepOutput& out) {
  auto in_group = [&](int32_t logit_index) { return logit_index >= first && logit_index < first + n; };
  std::vector<int32_t> sample_of_row(n, -1);  // row of this group -> index into batch.samples
  bool need_host = false, any_gpu = false;
  for (const LogitOutputRow& r : batch.logit_outputs) need_host = need_host || in_group(r.logit_index);
  for (const PromptLogprobRow& r : batch.prompt_logprob_rows) need_host = need_host || in_group(r.logit_index);
  for (size_t k = 0; k < batch.samples.size(); ++k) {
    const SampleRow& s = batch.samples[k];
    if (!in_group(s.logit_index)) continue;
    // logprobs and grammar masks are taken by the host sampler (the GPU one has neither)
    const bool on_host = s.params->logprobs >= 0 || s.mask != nullptr;
    need_host = need_host || on_host;
    any_gpu = any_gpu || !on_host;
    if (!on_host) sample_of_row[s.logit_index - first] = (int32_t)k;
  }
  if (need_host) {  // before the GPU sampler, which penalises the logits in place
    host_logits_raw_.resize((size_t)(n * vocab));
    cuda::copy_to_host(host_logits_raw_.data(), logits, n * vocab * 2, stream_);
    cuda::synchronize(stream_);
    host_logits_.resize((size_t)(n * vocab));
    for (int64_t i = 0; i < n * vocab; ++i) host_logits_[(size_t)i] = act_to_float(host_logits_raw_[(size_t)i], act_);
    for (size_t r = 0; r < batch.logit_outputs.size(); ++r) {
      const int64_t i = batch.logit_outputs[r].logit_index - first;
      if (i >= 0 && i < n)
        std::memcpy(out.logits.data() + r * vocab, host_logits_.data() + i * vocab, vocab * sizeof(float));
    }
    take_prompt_logprobs(batch, first, n, host_logits_.data(), vocab, out);
    for (size_t k = 0; k < batch.samples.size(); ++k) {
      const SampleRow& s = batch.samples[k];
      if (!in_group(s.logit_index) || (s.params->logprobs < 0 && !s.mask)) continue;
      std::mt19937_64 rng(s.seed);
      ops::SampleLogprobs lp;
      out.tokens[k] = ops::sample(host_logits_.data() + (s.logit_index - first) * vocab, (int32_t)vocab, *s.params,
                                  s.history, s.num_history, s.num_prompt, s.banned.data(), (int32_t)s.banned.size(),
                                  s.mask ? s.mask->wait(s.mask_row) : nullptr, rng, &lp);
      out.logprobs[k].logprob = lp.logprob;
      out.logprobs[k].top_ids = std::move(lp.top_ids);
      out.logprobs[k].top_logprobs = std::move(lp.top_logprobs);
    }
  }
  // logits are the model's head workspace of this step, consumed here: the GPU sampler penalises them in place
  if (any_gpu) sample_on_gpu(const_cast<void*>(logits), n, vocab, sample_of_row, batch, out);
}

// The GPU sampler over the group's n rows (rows without a sample: greedy, and their token dropped).
void CudaBackend::sample_on_gpu(void* logits, int64_t n, int64_t vocab, const std::vector<int32_t>& sample_of_row,
                                const Batch& batch, StepOutput& out) {
  params_host_.assign(n, cuda::SampleParams{});
  // penalised tokens: offsets [n + 1], then (token, times in the output or -1 for banned) pairs (ops_cuda.h)
  std::vector<int32_t> offsets(1, 0), tokens, counts;
  std::unordered_map<int32_t, int32_t> seen;
  for (int64_t r = 0; r < n; ++r) {
    if (sample_of_row[r] >= 0) {
      const SampleRow& s = batch.samples[sample_of_row[r]];
      const SamplingParams& sp = *s.params;
      cuda::SampleParams& p = params_host_[r];
      p.temperature = sp.temperature;  // 0: greedy
      p.top_k = sp.top_k, p.top_p = sp.top_p, p.min_p = sp.min_p;
      p.repetition_penalty = sp.repetition_penalty;
      p.presence_penalty = sp.presence_penalty, p.frequency_penalty = sp.frequency_penalty;
      p.seed = s.seed;
      seen.clear();
      const bool rep = sp.repetition_penalty != 1.0f;
      const bool pres = sp.presence_penalty != 0.0f || sp.frequency_penalty != 0.0f;
      if (rep)
        for (int32_t t = 0; t < s.num_prompt; ++t) seen.emplace(s.history[t], 0);
      if (rep || pres)
        for (int32_t t = s.num_prompt; t < s.num_history; ++t) ++seen[s.history[t]];
      for (int32_t b : s.banned) seen[b] = -1;
      for (const auto& kv : seen) tokens.push_back(kv.first), counts.push_back(kv.second);
    }
    offsets.push_back((int32_t)tokens.size());
  }
  cuda::copy_to_device(sample_params_.get(), params_host_.data(), n * (int64_t)sizeof(cuda::SampleParams), stream_);
  const int32_t *d_offsets = nullptr, *d_tokens = nullptr, *d_counts = nullptr;
  if (!tokens.empty()) {
    penalty_host_ = offsets;
    penalty_host_.insert(penalty_host_.end(), tokens.begin(), tokens.end());
    penalty_host_.insert(penalty_host_.end(), counts.begin(), counts.end());
    if ((int64_t)penalty_host_.size() > penalty_capacity_) {
      cuda::synchronize(stream_);
      penalty_capacity_ = std::max<int64_t>((int64_t)penalty_host_.size(), 2 * penalty_capacity_);
      penalty_ints_ = cuda::allocate(penalty_capacity_ * 4);
    }
    cuda::copy_to_device(penalty_ints_.get(), penalty_host_.data(), (int64_t)penalty_host_.size() * 4, stream_);
    d_offsets = static_cast<const int32_t*>(penalty_ints_.get());
    d_tokens = d_offsets + offsets.size();
    d_counts = d_tokens + tokens.size();
  }
  cuda::sample(logits, act_, n, vocab, static_cast<const cuda::SampleParams*>(sample_params_.get()), d_offsets,
               d_tokens, d_counts, static_cast<int32_t*>(sampled_dev_.get()), stream_);
  sampled_host_.resize(n);
  cuda::copy_to_host(sampled_host_.data(), sampled_dev_.get(), n * 4, stream_);
  cuda::synchronize(stream_);  // also keeps params and penalties alive until the kernel has read them
  for (int64_t r = 0; r < n; ++r)
    if (sample_of_row[r] >= 0) out.tokens[sample_of_row[r]] = sampled_host_[r];
}

}  // namespace

std::unique_ptr<Backend> make_cuda_backend(const BackendOptions& options, DType act, int64_t hidden_size,
                                           int64_t vocab_size) {
  return std::make_unique<CudaBackend>(options, act, hidden_size, vocab_size);
}

}  // namespace lmkit
