#include "model/decoder_cuda.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <unordered_map>

#include "core/check.h"
#include "kernels/cpu/sampling.h"

namespace lmkit {

namespace {

constexpr int32_t kLogitRows = 64;  // logits are computed and consumed in groups of rows, as on the CPU
constexpr int32_t kGraphBatchSizes[] = {1, 2, 4, 8, 12, 16, 24, 32, 48, 64, 96, 128, 160, 192, 224, 256};

int32_t graph_batch_size(int64_t rows) {
  for (int32_t g : kGraphBatchSizes)
    if (g >= rows) return g;
  return 0;
}
// The int32 inputs of a step of `rows` rows and `seqs` sequences, one after another in one buffer (one
// host -> device copy): token ids, positions, slots, row -> sequence [rows each], q_start [seqs + 1],
// ctx_lens [seqs], block tables [seqs x max_blocks]. The same views serve the host copy and the device one.
struct StepInts {
  int32_t *token_ids, *positions, *slots, *row_seq, *q_start, *ctx_lens, *tables;
  StepInts(int32_t* base, int64_t rows, int64_t seqs)
      : token_ids(base), positions(base + rows), slots(base + 2 * rows), row_seq(base + 3 * rows),
        q_start(base + 4 * rows), ctx_lens(q_start + seqs + 1), tables(ctx_lens + seqs) {}
  static int64_t count(int64_t rows, int64_t seqs, int64_t max_blocks) {
    return 4 * rows + (seqs + 1) + seqs + seqs * max_blocks;
  }
  // The attention view of a device copy.
  cuda::AttnBatch attn_batch(int32_t rows, int32_t seqs, int32_t max_blocks, int32_t max_ctx) const {
    cuda::AttnBatch b;
    b.row_seq = row_seq, b.q_start = q_start, b.ctx_lens = ctx_lens, b.block_tables = tables;
    b.num_seqs = seqs, b.num_rows = rows, b.max_blocks_per_seq = max_blocks, b.max_ctx_len = max_ctx;
    return b;
  }
};

float act_to_float(uint16_t bits, DType act) { return act == DType::F16 ? f16_to_f32(bits) : bf16_to_f32(bits); }
uint16_t float_to_act(float v, DType act) { return act == DType::F16 ? f32_to_f16(v) : f32_to_bf16(v); }

int64_t dense_bytes(const LinearTensors& t) { return t.weight.numel() * 2; }
int64_t int4_bytes(const LinearTensors& t) {
  const int64_t K = t.qweight.shape[0], N = t.qweight.shape[1] * 8, G = t.scales.shape[0];
  return N * K / 2 + N * G * 3;
}
int64_t linear_bytes(const LinearTensors& t) { return t.is_awq() ? int4_bytes(t) : dense_bytes(t); }

// Rows of several weights [n_i, k] as one weight [sum n_i, k] (q | k | v, gate | up), uploaded once.
// All AWQ: repacked and joined in the int4 layout; otherwise every part dense in the activation dtype
// (an AWQ part dequantized on the host: checkpoints that keep some of a fused group unquantized).
cuda::Linear upload_fused(const std::vector<const LinearTensors*>& parts, int32_t group_size, DType act,
                          cuda::Stream stream) {
  bool all_awq = true;
  for (const LinearTensors* p : parts) all_awq = all_awq && p->is_awq();
  std::vector<cuda::HostInt4> packed;
  if (all_awq || std::any_of(parts.begin(), parts.end(), [](const LinearTensors* p) { return p->is_awq(); }))
    for (const LinearTensors* p : parts)
      packed.push_back(p->is_awq() ? cuda::repack_awq(p->qweight, p->qzeros, p->scales, group_size) : cuda::HostInt4{});
  if (all_awq) {
    cuda::HostInt4 joined;
    joined.k = packed[0].k, joined.group_size = group_size;
    for (const cuda::HostInt4& h : packed) {
      LMKIT_CHECK(h.k == joined.k, "fused AWQ parts differ in input size");
      joined.n += h.n;
    }
    const int64_t K = joined.k, G = K / group_size;
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
    return cuda::upload_int4(joined, act, stream);
  }
  int64_t N = 0, K = -1;
  for (const LinearTensors* p : parts) {
    const int64_t n = p->is_awq() ? p->qweight.shape[1] * 8 : p->weight.shape[0];
    const int64_t k = p->is_awq() ? p->qweight.shape[0] : p->weight.shape[1];
    LMKIT_CHECK(K < 0 || k == K, "fused parts differ in input size");
    K = k, N += n;
  }
  std::vector<uint16_t> host((size_t)(N * K));
  int64_t row = 0;
  for (size_t i = 0; i < parts.size(); ++i) {
    const LinearTensors& p = *parts[i];
    if (!p.is_awq()) {
      const int64_t count = p.weight.numel();
      uint16_t* dst = host.data() + row * K;
      if (p.weight.dtype == act)
        std::memcpy(dst, p.weight.data, count * 2);
      else
        for (int64_t j = 0; j < count; ++j) dst[j] = float_to_act(float_value(p.weight, j), act);
      row += p.weight.shape[0];
      continue;
    }
    const cuda::HostInt4& h = packed[i];
    const int64_t G = K / h.group_size;
    for (int64_t n = 0; n < h.n; ++n, ++row)
      for (int64_t k = 0; k < K; ++k) {
        const uint32_t q = (h.qweight[n * (K / 8) + k / 8] >> (4 * (k % 8))) & 15u;
        const float s = f16_to_f32(h.scales[n * G + k / h.group_size]);
        host[(size_t)(row * K + k)] = float_to_act(((float)q - (float)h.zeros[n * G + k / h.group_size]) * s, act);
      }
  }
  Tensor view = make_view(host.data(), act, N, K);
  return cuda::upload_dense(view, act, stream);
}

}  // namespace

CudaDecoderModel::CudaDecoderModel(const ModelConfig& config, ModelWeights weights, const DecoderOptions& options)
    : config_(config), options_(options) {
  LMKIT_CHECK_ARG(cuda::is_available(), "device='cuda' but no CUDA device is usable (driver missing or no GPU)");
  const ModelConfig& c = config_;
  act_ = weights.embed_tokens.dtype == DType::BF16 ? DType::BF16 : DType::F16;
  LMKIT_CHECK_ARG(c.hidden_size % 8 == 0 && c.intermediate_size % 8 == 0 && c.q_size() % 8 == 0,
                  "the CUDA backend needs hidden_size, intermediate_size and num_heads * head_dim to be multiples of 8");
  LMKIT_CHECK_ARG(c.head_dim % 2 == 0 && c.head_dim <= ops::kKVQuantMaxHeadDim,
                  "the CUDA backend needs an even head_dim of at most ", ops::kKVQuantMaxHeadDim, ", the model has ",
                  c.head_dim);

  // Will the weights fit? (before any allocation, so the message is about the model, not a buffer)
  int64_t weight_bytes = (int64_t)c.vocab_size * c.hidden_size * 2 * (c.tie_word_embeddings ? 1 : 2);
  for (const LayerWeights& w : weights.layers)
    for (const LinearTensors* t : {&w.q_proj, &w.k_proj, &w.v_proj, &w.o_proj, &w.gate_proj, &w.up_proj, &w.down_proj})
      weight_bytes += linear_bytes(*t);
  const int64_t T = options.max_step_tokens, H = c.hidden_size, I = c.intermediate_size;
  const int64_t width = c.q_size() + 2 * c.kv_size();
  const int64_t workspace_bytes =
      2 * (T * (2 * H + width + c.q_size() + 3 * I) + (int64_t)kLogitRows * 2 * H +
           std::max<int64_t>(kLogitRows, graph_batch_size(std::min<int64_t>(T, 256))) * c.vocab_size);
  int64_t free_bytes = 0, total_bytes = 0;
  cuda::memory_info(&free_bytes, &total_bytes);
  LMKIT_CHECK_ARG(weight_bytes + workspace_bytes < free_bytes, "the model needs ", (weight_bytes >> 20),
                  " MiB of GPU memory for its weights and ", (workspace_bytes >> 20), " MiB for activations (max ",
                  T, " tokens per step), but the GPU has ", (free_bytes >> 20), " MiB free of ", (total_bytes >> 20),
                  " MiB; use an AWQ checkpoint, a smaller model or a smaller max_prefill_token_num");

  stream_ = cuda::create_stream();
  // Embedding and lm_head: [vocab, hidden] in act; one copy when tied.
  lm_head_ = cuda::upload_dense(weights.lm_head, act_, stream_);
  if (c.tie_word_embeddings && weights.lm_head.data == weights.embed_tokens.data) {
    embed_tokens_ = lm_head_.data;
  } else {
    embed_tokens_ = cuda::upload_dense(weights.embed_tokens, act_, stream_).data;
  }
  final_norm_ = upload_vector({&weights.final_norm});
  inv_freq_ = cuda::allocate((int64_t)c.inv_freq.size() * 4);
  cuda::copy_to_device(inv_freq_.get(), c.inv_freq.data(), (int64_t)c.inv_freq.size() * 4, stream_);
  for (const LayerWeights& w : weights.layers) {
    Layer l;
    l.qkv = upload_fused({&w.q_proj, &w.k_proj, &w.v_proj}, c.awq_group_size, act_, stream_);
    l.o_proj = upload_fused({&w.o_proj}, c.awq_group_size, act_, stream_);
    l.gate_up = upload_fused({&w.gate_proj, &w.up_proj}, c.awq_group_size, act_, stream_);
    l.down_proj = upload_fused({&w.down_proj}, c.awq_group_size, act_, stream_);
    if (!w.q_bias.is_empty()) l.qkv_bias = upload_vector({&w.q_bias, &w.k_bias, &w.v_bias});
    l.input_norm = upload_vector({&w.input_norm});
    l.post_attention_norm = upload_vector({&w.post_attention_norm});
    layers_.push_back(std::move(l));
  }

  if (options_.kv_bits.empty()) options_.kv_bits.assign(c.num_layers, 32);
  LMKIT_CHECK_ARG((int32_t)options_.kv_bits.size() == c.num_layers, "KV precision is given for ",
                  options_.kv_bits.size(), " layers, the model has ", c.num_layers);
  int64_t offset = 0;
  for (int32_t l = 0; l < c.num_layers; ++l) {
    int32_t& bits = options_.kv_bits[l];
    LMKIT_CHECK_ARG(bits == 32 || bits == 8 || bits == 4, "layer ", l, ": KV bits must be 32, 8 or 4, got ", bits);
    if (bits == 32) bits = 16;  // "full precision" is the activation dtype on the GPU
    kv_layer_offset_.push_back(offset);
    offset += 2 * kv_layer(l).block_bytes();
  }
  kv_layer_offset_.push_back(offset);

  const int64_t a = 2;  // bytes of an activation
  residual_ = cuda::allocate(T * H * a);
  hidden_ = cuda::allocate(T * H * a);
  qkv_ = cuda::allocate(T * width * a);
  attn_ = cuda::allocate(T * c.q_size() * a);
  gate_up_ = cuda::allocate(T * 2 * I * a);
  mlp_act_ = cuda::allocate(T * I * a);
  gathered_res_ = cuda::allocate((int64_t)kLogitRows * H * a);
  gathered_h_ = cuda::allocate((int64_t)kLogitRows * H * a);
  // the largest captured size that fits the workspaces (a step pads up to a captured size)
  max_graph_rows_ = 0;
  if (options.cuda_graphs && options.max_blocks_per_seq > 0)
    for (int32_t g : kGraphBatchSizes)
      if (g <= T) max_graph_rows_ = g;
  const int64_t logit_rows = std::max<int64_t>(kLogitRows, graph_batch_size(max_graph_rows_));
  logits_ = cuda::allocate(logit_rows * c.vocab_size * a);
  if (max_graph_rows_ > 0) {
    const int32_t G = graph_batch_size(max_graph_rows_);
    graph_ints_ = cuda::allocate(StepInts::count(G, G, options.max_blocks_per_seq) * 4);
    int64_t ws = 0;
    for (int32_t g : kGraphBatchSizes)
      if (g <= G)
        ws = std::max(ws, cuda::attention_workspace_bytes(g, c.num_heads, c.head_dim,
                                                          options.max_blocks_per_seq * options.block_size_tokens));
    graph_attn_workspace_ = cuda::allocate(std::max<int64_t>(ws, 16));
  }
  sample_params_ = cuda::allocate((int64_t)kLogitRows * sizeof(cuda::SampleParams));
  sampled_dev_ = cuda::allocate((int64_t)kLogitRows * 4);
  cuda::synchronize(stream_);
}

CudaDecoderModel::~CudaDecoderModel() {
  if (stream_) {
    try {
      cuda::synchronize(stream_);
    } catch (...) {
    }
    cuda::destroy_stream(stream_);
  }
}

std::shared_ptr<void> CudaDecoderModel::upload_vector(const std::vector<const Tensor*>& parts) {
  std::vector<uint16_t> host;
  for (const Tensor* t : parts)
    for (int64_t i = 0; i < t->numel(); ++i) host.push_back(float_to_act(float_value(*t, i), act_));
  auto dev = cuda::allocate((int64_t)host.size() * 2);
  cuda::copy_to_device(dev.get(), host.data(), (int64_t)host.size() * 2, stream_);
  cuda::synchronize(stream_);
  return dev;
}

int64_t CudaDecoderModel::linear_weight_bytes() const {
  int64_t bytes = lm_head_.size_bytes();
  for (const Layer& l : layers_)
    for (const cuda::Linear* w : {&l.qkv, &l.o_proj, &l.gate_up, &l.down_proj}) bytes += w->size_bytes();
  return bytes;
}

void CudaDecoderModel::allocate_kv_pool(int32_t num_blocks) {
  LMKIT_CHECK(kv_pool_ == nullptr, "the KV pool is allocated once");
  kv_pool_ = cuda::allocate(kv_bytes_per_block() * num_blocks);
  // zeros, not garbage, under the padded rows of graph steps (they read block 0; their outputs are dropped)
  cuda::fill_bytes(kv_pool_.get(), 0, kv_bytes_per_block() * num_blocks, stream_);
  cuda::synchronize(stream_);
  num_blocks_ = num_blocks;
}

void CudaDecoderModel::bind_thread() { cuda::set_device(device_); }

ops::KVLayer CudaDecoderModel::kv_layer(int32_t layer) const {
  ops::KVLayer kv;
  kv.bits = options_.kv_bits[layer];
  kv.num_blocks = num_blocks_;
  kv.num_kv_heads = config_.num_kv_heads;
  kv.block_size = options_.block_size_tokens;
  kv.head_dim = config_.head_dim;
  if (kv_pool_) {
    char* k = static_cast<char*>(kv_pool_.get()) + kv_layer_offset_[layer] * num_blocks_;
    kv.k = k;
    kv.v = k + kv.block_bytes() * num_blocks_;
  }
  return kv;
}

void CudaDecoderModel::ensure_attention_workspace(int64_t bytes) {
  if (bytes <= attn_workspace_bytes_) return;
  cuda::synchronize(stream_);  // the old buffer may still be in use by the previous layer's launch
  attn_workspace_ = cuda::allocate(bytes);
  attn_workspace_bytes_ = bytes;
}

bool CudaDecoderModel::is_graph_step(const BatchPlan& plan) const {
  if (max_graph_rows_ == 0 || plan.num_tokens > max_graph_rows_) return false;
  const int64_t max_ctx = (int64_t)options_.max_blocks_per_seq * options_.block_size_tokens;
  for (const ScheduledSeq& s : plan.seqs) {
    if (s.num_tokens != 1 || !(s.is_sampled || s.seq->params.output_logits)) return false;  // every row's logits
    if (s.start_pos + 1 > max_ctx) return false;  // beyond the graphs' block tables: the eager path serves it
  }
  return true;
}

// Per-step int32 inputs: the StepInts layout, then the logit rows [R]; one host -> device copy.
bool CudaDecoderModel::forward(const BatchPlan& plan) {
  const ModelConfig& c = config_;
  const int64_t T = plan.num_tokens;
  const int32_t bs = options_.block_size_tokens;
  const int32_t S = (int32_t)plan.seqs.size();
  LMKIT_CHECK(T <= options_.max_step_tokens, "step of ", T, " tokens exceeds the workspace of ",
              options_.max_step_tokens);
  LMKIT_CHECK(kv_pool_ != nullptr, "allocate_kv_pool() before the first step");
  for (const ScheduledSeq& s : plan.seqs)
    LMKIT_CHECK((int64_t)s.seq->block_table.size() * bs >= s.start_pos + s.num_tokens, "sequence ", s.seq->id,
                " has too few blocks for its chunk");
  if (is_graph_step(plan)) {
    forward_graph(plan);
    return true;
  }
  int32_t max_blocks = 1, max_ctx = 1;
  for (const ScheduledSeq& s : plan.seqs) {
    const int32_t ctx = s.start_pos + s.num_tokens;
    max_ctx = std::max(max_ctx, ctx);
    max_blocks = std::max(max_blocks, (ctx + bs - 1) / bs);
  }
  logit_rows_.clear();
  host_ints_.assign(StepInts::count(T, S, max_blocks), 0);
  const StepInts h(host_ints_.data(), T, S);
  int32_t *token_ids = h.token_ids, *positions = h.positions, *slots = h.slots, *row_seq = h.row_seq;
  int32_t *q_start = h.q_start, *ctx_lens = h.ctx_lens, *tables = h.tables;
  int32_t row = 0;
  for (int32_t i = 0; i < S; ++i) {
    const ScheduledSeq& s = plan.seqs[i];
    const Sequence& seq = *s.seq;
    const int32_t ctx = s.start_pos + s.num_tokens;
    q_start[i] = row;
    ctx_lens[i] = ctx;
    std::copy(seq.block_table.begin(), seq.block_table.begin() + (ctx + bs - 1) / bs, tables + (int64_t)i * max_blocks);
    for (int32_t j = 0; j < s.num_tokens; ++j, ++row) {
      const int32_t pos = s.start_pos + j;
      token_ids[row] = seq.tokens[pos];
      positions[row] = pos;
      slots[row] = seq.block_table[pos / bs] * bs + pos % bs;
      row_seq[row] = i;
      const bool is_last = j == s.num_tokens - 1;
      if ((is_last && s.is_sampled) || seq.params.output_logits) logit_rows_.push_back(row);
    }
  }
  q_start[S] = row;
  for (int64_t t = 0; t < T; ++t)
    LMKIT_CHECK(token_ids[t] >= 0 && token_ids[t] < c.vocab_size, "token id ", token_ids[t],
                " is outside the vocabulary (", c.vocab_size, ")");
  const int64_t num_ints = (int64_t)host_ints_.size() + (int64_t)logit_rows_.size();
  if (num_ints > step_ints_capacity_) {
    cuda::synchronize(stream_);
    step_ints_capacity_ = std::max<int64_t>(num_ints, 2 * step_ints_capacity_);
    step_ints_ = cuda::allocate(step_ints_capacity_ * 4);
  }
  int32_t* dev = static_cast<int32_t*>(step_ints_.get());
  cuda::copy_to_device(dev, host_ints_.data(), (int64_t)host_ints_.size() * 4, stream_);
  cuda::copy_to_device(dev + host_ints_.size(), logit_rows_.data(), (int64_t)logit_rows_.size() * 4, stream_);
  const StepInts d(dev, T, S);
  ensure_attention_workspace(cuda::attention_workspace_bytes((int32_t)T, c.num_heads, c.head_dim, max_ctx));
  run_layers(T, d.token_ids, d.positions, d.slots, d.attn_batch((int32_t)T, S, max_blocks, max_ctx),
             attn_workspace_.get());
  return false;
}

void CudaDecoderModel::forward_graph(const BatchPlan& plan) {
  const ModelConfig& c = config_;
  const int64_t T = plan.num_tokens;
  const int32_t G = graph_batch_size(T);
  const int32_t bs = options_.block_size_tokens, MB = options_.max_blocks_per_seq;
  // The layout of a G-row step: real rows first, then padding rows (token 0 at position 0, slot -1: no KV
  // write; a one-key context in block 0) whose outputs nobody reads.
  host_ints_.assign(StepInts::count(G, G, MB), 0);
  const StepInts h(host_ints_.data(), G, G);
  int32_t *token_ids = h.token_ids, *positions = h.positions, *slots = h.slots, *row_seq = h.row_seq;
  int32_t *q_start = h.q_start, *ctx_lens = h.ctx_lens, *tables = h.tables;
  logit_rows_.clear();
  for (int32_t i = 0; i < G; ++i) {
    row_seq[i] = i;
    q_start[i] = i;
    ctx_lens[i] = 1;
    slots[i] = -1;
    if (i >= T) continue;
    const ScheduledSeq& s = plan.seqs[i];
    const Sequence& seq = *s.seq;
    const int32_t pos = s.start_pos, ctx = pos + 1;  // ctx <= MB * bs (is_graph_step)
    token_ids[i] = seq.tokens[pos];
    LMKIT_CHECK(token_ids[i] >= 0 && token_ids[i] < c.vocab_size, "token id ", token_ids[i],
                " is outside the vocabulary (", c.vocab_size, ")");
    positions[i] = pos;
    slots[i] = seq.block_table[pos / bs] * bs + pos % bs;
    ctx_lens[i] = ctx;
    std::copy(seq.block_table.begin(), seq.block_table.begin() + (ctx + bs - 1) / bs, tables + (int64_t)i * MB);
    logit_rows_.push_back(i);
  }
  q_start[G] = G;
  int32_t* dev = static_cast<int32_t*>(graph_ints_.get());
  cuda::copy_to_device(dev, host_ints_.data(), (int64_t)host_ints_.size() * 4, stream_);
  const StepInts d(dev, G, G);
  const cuda::AttnBatch batch = d.attn_batch(G, G, MB, MB * bs);
  // layers, final norm of every row, lm_head of every row: logits_ [G, vocab]
  auto record = [&] {
    run_layers(G, d.token_ids, d.positions, d.slots, batch, graph_attn_workspace_.get());
    cuda::add_rmsnorm(residual_.get(), hidden_.get(), final_norm_.get(), act_, c.rms_norm_eps, G, c.hidden_size,
                      hidden_.get(), act_, stream_);
    cuda::linear(hidden_.get(), G, lm_head_, nullptr, logits_.get(), act_, stream_);
  };
  auto it = graphs_.find(G);
  if (it != graphs_.end()) {
    cuda::launch_graph(it->second, stream_);
    return;
  }
  // First step of this size: run it eagerly (which also lets cuBLAS settle its state for these shapes),
  // then record the same work as a graph for the next ones. Recording executes nothing, so the eager
  // step's logits stand whether or not the capture succeeds; a capture that fails turns graphs off (with
  // one line on stderr) and the engine goes on eagerly.
  record();
  cuda::synchronize(stream_);
  try {
    cuda::begin_capture(stream_);
    record();
    graphs_[G] = cuda::end_capture(stream_);
  } catch (const std::exception& e) {
    cuda::abort_capture(stream_);
    graphs_.clear();
    max_graph_rows_ = 0;
    std::fprintf(stderr, "lmkit: CUDA graph capture failed (%s); decode steps run without graphs\n", e.what());
  }
}

void CudaDecoderModel::run_layers(int64_t T, const int32_t* d_tokens, const int32_t* d_positions,
                                  const int32_t* d_slots, const cuda::AttnBatch& batch, void* attn_workspace) {
  const ModelConfig& c = config_;
  const int64_t H = c.hidden_size, I = c.intermediate_size;
  void* residual = residual_.get();
  void* h = hidden_.get();
  const int64_t width = c.q_size() + 2 * c.kv_size();
  const float scale = 1.0f / std::sqrt((float)c.head_dim);
  cuda::embedding(embed_tokens_.get(), act_, c.vocab_size, d_tokens, T, H, residual, act_, stream_);
  for (int32_t l = 0; l < c.num_layers; ++l) {
    const Layer& w = layers_[l];
    if (l == 0)
      cuda::rmsnorm(residual, w.input_norm.get(), act_, c.rms_norm_eps, T, H, h, act_, stream_);
    else  // residual += mlp output (in h); h = norm(residual)
      cuda::add_rmsnorm(residual, h, w.input_norm.get(), act_, c.rms_norm_eps, T, H, h, act_, stream_);
    cuda::linear(h, T, w.qkv, nullptr, qkv_.get(), act_, stream_);
    const ops::KVLayer kv = kv_layer(l);
    cuda::qkv_rope_kv_write(qkv_.get(), w.qkv_bias.get(), d_positions, d_slots, T, c.num_heads,
                            (const float*)inv_freq_.get(), c.attention_scaling, kv, act_, stream_);
    cuda::paged_attention(qkv_.get(), width, kv, batch, c.num_heads, scale, c.sliding_window, attn_workspace,
                          attn_.get(), act_, stream_);
    cuda::linear(attn_.get(), T, w.o_proj, nullptr, h, act_, stream_);
    cuda::add_rmsnorm(residual, h, w.post_attention_norm.get(), act_, c.rms_norm_eps, T, H, h, act_, stream_);
    cuda::linear(h, T, w.gate_up, nullptr, gate_up_.get(), act_, stream_);
    cuda::silu_mul(gate_up_.get(), T, I, mlp_act_.get(), act_, stream_);
    cuda::linear(mlp_act_.get(), T, w.down_proj, nullptr, h, act_, stream_);
  }
}

void CudaDecoderModel::step(const BatchPlan& plan, std::vector<int32_t>& sampled) {
  sampled.assign(plan.seqs.size(), -1);
  if (plan.empty()) return;
  const bool logits_ready = forward(plan);  // a graph step: logits_ holds every row's, in plan order
  const ModelConfig& c = config_;
  const int64_t H = c.hidden_size, V = c.vocab_size;
  std::vector<int32_t> row_owner(plan.num_tokens), row_start(plan.seqs.size());
  {
    int32_t row = 0;
    for (int32_t i = 0; i < (int32_t)plan.seqs.size(); ++i) {
      row_start[i] = row;
      for (int32_t j = 0; j < plan.seqs[i].num_tokens; ++j) row_owner[row++] = i;
    }
  }
  const int32_t* d_logit_rows =
      logits_ready ? nullptr : static_cast<const int32_t*>(step_ints_.get()) + host_ints_.size();
  std::vector<cuda::SampleParams> params;
  std::vector<int32_t> offsets, tokens, counts, gpu_tokens, banned;
  std::unordered_map<int32_t, int32_t> seen;
  for (size_t g = 0; g < logit_rows_.size(); g += kLogitRows) {
    const int32_t n = (int32_t)std::min<size_t>(kLogitRows, logit_rows_.size() - g);
    void* logits = logits_.get();
    if (logits_ready) {
      logits = static_cast<char*>(logits) + (int64_t)g * V * 2;
    } else {  // residual + last mlp output, final norm, lm_head: for the gathered rows only
      cuda::gather_rows(residual_.get(), d_logit_rows + g, n, H, gathered_res_.get(), act_, stream_);
      cuda::gather_rows(hidden_.get(), d_logit_rows + g, n, H, gathered_h_.get(), act_, stream_);
      cuda::add_rmsnorm(gathered_res_.get(), gathered_h_.get(), final_norm_.get(), act_, c.rms_norm_eps, n, H,
                        gathered_h_.get(), act_, stream_);
      cuda::linear(gathered_h_.get(), n, lm_head_, nullptr, logits, act_, stream_);
    }

    // Rows whose logits go to the host: returned logits, and sampling with logprobs (the CPU sampler).
    bool need_host = false;
    for (int32_t r = 0; r < n; ++r) {
      const Sequence& seq = *plan.seqs[row_owner[logit_rows_[g + r]]].seq;
      need_host = need_host || seq.params.output_logits || seq.params.logprobs >= 0;
    }
    if (need_host) {
      host_logits_raw_.resize((size_t)(n * V));
      cuda::copy_to_host(host_logits_raw_.data(), logits, n * V * 2, stream_);
      cuda::synchronize(stream_);
      host_logits_.resize((size_t)(n * V));
      for (int64_t i = 0; i < n * V; ++i) host_logits_[(size_t)i] = act_to_float(host_logits_raw_[(size_t)i], act_);
    }
    params.assign(n, cuda::SampleParams{});
    offsets.assign(1, 0);
    tokens.clear();
    counts.clear();
    bool any_gpu_sample = false;
    for (int32_t r = 0; r < n; ++r) {
      const int32_t row = logit_rows_[g + r];
      const int32_t i = row_owner[row];
      const ScheduledSeq& s = plan.seqs[i];
      Sequence& seq = *s.seq;
      const int32_t pos = s.start_pos + (row - row_start[i]);
      if (seq.params.output_logits && pos >= (int32_t)seq.num_logit_rows_emitted) {
        const float* lr = host_logits_.data() + (int64_t)r * V;
        seq.pending_logits.insert(seq.pending_logits.end(), lr, lr + V);
        ++seq.pending_logit_rows;
        seq.num_logit_rows_emitted = pos + 1;
      }
      const bool is_sample_row = s.is_sampled && row == row_start[i] + s.num_tokens - 1;
      banned.clear();
      if (is_sample_row && seq.num_generated_tokens() < seq.params.min_new_tokens) {
        if (!seq.params.ignore_eos) banned.insert(banned.end(), options_.eos_token_ids.begin(), options_.eos_token_ids.end());
        banned.insert(banned.end(), seq.params.stop_token_ids.begin(), seq.params.stop_token_ids.end());
      }
      if (is_sample_row && seq.params.logprobs >= 0) {  // the CPU sampler, on the host copy
        ops::SampleLogprobs lp;
        sampled[i] = ops::sample(host_logits_.data() + (int64_t)r * V, (int32_t)V, seq.params, seq.tokens.data(),
                                 seq.num_tokens(), seq.num_prompt_tokens, banned.data(), (int32_t)banned.size(),
                                 seq.rng, &lp);
        seq.sample_logprob = lp.logprob;
        seq.sample_top_ids.swap(lp.top_ids);
        seq.sample_top_logprobs.swap(lp.top_logprobs);
      } else if (is_sample_row) {
        any_gpu_sample = true;
        const SamplingParams& sp = seq.params;
        cuda::SampleParams& p = params[r];
        p.temperature = sp.is_greedy() ? 0.0f : sp.temperature;
        p.top_k = sp.top_k, p.top_p = sp.top_p, p.min_p = sp.min_p;
        p.repetition_penalty = sp.repetition_penalty;
        p.presence_penalty = sp.presence_penalty, p.frequency_penalty = sp.frequency_penalty;
        if (!sp.is_greedy()) p.seed = seq.rng();  // greedy draws nothing, as on the CPU
        // Penalised tokens: (token, times in the output), -1 for banned ones (kernels/cuda/ops_cuda.h).
        seen.clear();
        const bool rep = sp.repetition_penalty != 1.0f;
        const bool pres = sp.presence_penalty != 0.0f || sp.frequency_penalty != 0.0f;
        if (rep)
          for (int32_t t = 0; t < seq.num_prompt_tokens; ++t) seen.emplace(seq.tokens[t], 0);
        if (rep || pres)
          for (int32_t t = seq.num_prompt_tokens; t < seq.num_tokens(); ++t) ++seen[seq.tokens[t]];
        for (int32_t b : banned) seen[b] = -1;
        for (const auto& kv : seen) tokens.push_back(kv.first), counts.push_back(kv.second);
      }
      offsets.push_back((int32_t)tokens.size());
    }
    if (!any_gpu_sample) continue;
    cuda::copy_to_device(sample_params_.get(), params.data(), (int64_t)n * sizeof(cuda::SampleParams), stream_);
    const int32_t* d_offsets = nullptr;
    if (!tokens.empty()) {
      penalty_host_.clear();
      penalty_host_.insert(penalty_host_.end(), offsets.begin(), offsets.end());
      penalty_host_.insert(penalty_host_.end(), tokens.begin(), tokens.end());
      penalty_host_.insert(penalty_host_.end(), counts.begin(), counts.end());
      if ((int64_t)penalty_host_.size() > penalty_capacity_) {
        cuda::synchronize(stream_);
        penalty_capacity_ = std::max<int64_t>((int64_t)penalty_host_.size(), 2 * penalty_capacity_);
        penalty_ints_ = cuda::allocate(penalty_capacity_ * 4);
      }
      cuda::copy_to_device(penalty_ints_.get(), penalty_host_.data(), (int64_t)penalty_host_.size() * 4, stream_);
      d_offsets = static_cast<const int32_t*>(penalty_ints_.get());
    }
    const int32_t* d_tokens = d_offsets ? d_offsets + offsets.size() : nullptr;
    const int32_t* d_counts = d_tokens ? d_tokens + tokens.size() : nullptr;
    cuda::sample(logits, act_, n, V, static_cast<const cuda::SampleParams*>(sample_params_.get()), d_offsets,
                 d_tokens, d_counts, static_cast<int32_t*>(sampled_dev_.get()), stream_);
    gpu_tokens.resize(n);
    cuda::copy_to_host(gpu_tokens.data(), sampled_dev_.get(), (int64_t)n * 4, stream_);
    cuda::synchronize(stream_);  // also keeps params / penalties alive until the kernel has read them
    for (int32_t r = 0; r < n; ++r) {
      const int32_t row = logit_rows_[g + r];
      const int32_t i = row_owner[row];
      const ScheduledSeq& s = plan.seqs[i];
      const bool is_sample_row = s.is_sampled && row == row_start[i] + s.num_tokens - 1;
      if (is_sample_row && s.seq->params.logprobs < 0) sampled[i] = gpu_tokens[r];
    }
  }
  cuda::synchronize(stream_);
}

}  // namespace lmkit
