// The backend interface: every op a model forward calls, implemented once per device (backend_cpu.cpp,
// backend_cuda.cpp). A forward (models/*.cpp) is written once over it; workspaces' layouts, weight packing,
// the KV pool and CUDA graphs stay inside the backend.
//
// Activations are opaque device buffers (void*) of the backend's activation dtype (fp32 on the CPU, fp16/bf16
// on CUDA), row-major: rows are the step's tokens (or gathered logit rows), [rows, cols]. The step's integer
// inputs (token ids, positions, KV slots, attention layout, logit rows) are uploaded once by begin_step() and
// read implicitly by the ops that need them.
#pragma once
#include <stdint.h>

#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "core/check.h"
#include "core/kv_quant.h"
#include "engine/batch.h"
#include "kernels/ops.h"
#include "model/model_config.h"
#include "model/weights.h"

namespace lmkit {

// A linear layer packed by the backend: out[rows, n] = x[rows, k] @ W^T (+ bias).
struct PackedLinear {
  std::shared_ptr<void> impl;  // the backend's own
  int64_t n = 0, k = 0;
  int64_t size_bytes = 0;      // bytes one call reads (the weight as packed)
  bool is_empty() const { return impl == nullptr; }
};

// A vector (norm weight) on the device, fp32 on the CPU, the activation dtype on CUDA.
struct DeviceVector {
  std::shared_ptr<void> data;
  int64_t n = 0;
  bool is_empty() const { return data == nullptr; }
};

// A rotary table: inv_freq [rotary_dim / 2] on the device, and the attention scaling of cos / sin.
struct RopeTable {
  std::shared_ptr<void> inv_freq;
  int32_t rotary_dim = 0;
  float attention_scaling = 1.0f;
};

// Of the gated MLP: act(gate) * up, or gpt-oss's clamped SwiGLU (ModelConfig::hidden_act; its constants are the
// config's swiglu_alpha and swiglu_limit, which the backend reads in prepare()).
enum class Activation : int32_t { kSilu = 0, kGeluTanh = 1, kClampedSwiglu = 2 };

// Everything one attention layer needs besides its linears.
struct AttentionSpec {
  int32_t layer = 0;              // KV pool layer (another layer's when reads_shared_kv)
  bool reads_shared_kv = false;   // qkv holds only q [rows, H hd]: the cache of `layer` is read, nothing written
  int32_t num_heads = 0, num_kv_heads = 0, head_dim = 0;
  const DeviceVector* q_norm = nullptr;  // RMSNorm before RoPE (nullptr: none): per head, or over the
  const DeviceVector* k_norm = nullptr;  //   whole q / k projection when norm_whole (OLMoE)
  bool norm_whole = false;
  float norm_eps = 1e-6f;
  const RopeTable* rope = nullptr;       // nullptr: no rotary embedding on this layer
  float scale = 0;                       // softmax scale of q . k
  int32_t sliding_window = 0;            // 0: full attention
  float logit_softcap = 0;               // 0: off
  const DeviceVector* sinks = nullptr;   // [num_heads]: a logit per query head in each row's softmax (gpt-oss)
  const DeviceVector* v_norm = nullptr;  // [head_dim] ones: v = v / rms(v) per head before the cache (Gemma 4)
};

// Everything one recurrent (Gated DeltaNet) layer needs besides its linears.
struct RecurrentSpec {
  int32_t index = 0;  // among the model's recurrent layers: which part of a state slot is this layer's
  int32_t num_k_heads = 0, num_v_heads = 0, k_head_dim = 0, v_head_dim = 0, conv_kernel = 0;
  bool value_heads_tiled = false;  // value head h reads key head h % num_k_heads (GGUF), not h / group (ops.h)
  const DeviceVector* conv_weight = nullptr;  // [conv_kernel, conv_dim] (tap-major), conv_dim = 2 key + value
  const DeviceVector* decay_rate = nullptr;   // [Hv]: -exp(A_log)
  const DeviceVector* dt_bias = nullptr;      // [Hv]
  const DeviceVector* norm = nullptr;         // [v_head_dim]: the gated RMSNorm's weight
  float norm_eps = 1e-6f;
  int64_t key_dim() const { return (int64_t)num_k_heads * k_head_dim; }
  int64_t value_dim() const { return (int64_t)num_v_heads * v_head_dim; }
  int64_t conv_dim() const { return 2 * key_dim() + value_dim(); }
  // the fused input projection's width: q | k | v | z | b | a
  int64_t proj_dim() const { return conv_dim() + value_dim() + 2 * (int64_t)num_v_heads; }
};

// One mixture-of-experts layer: the router and every expert's gated MLP (gate | up fused, down), packed.
struct PackedExperts {
  PackedLinear router;                // [num_experts, hidden]
  std::vector<PackedLinear> gate_up;  // per expert [2 inter, hidden]
  std::vector<PackedLinear> down;     // per expert [hidden, inter]
  DeviceVector expert_scale;          // [num_experts]: each expert's routing weight times this (Gemma 4), or empty
};
struct MoeSpec {
  int32_t top_k = 0;
  bool renormalize = false;  // top-k probabilities rescaled to sum 1
  int64_t inter = 0;         // an expert's intermediate size
  Activation act = Activation::kSilu;
};

class Backend {
 public:
  virtual ~Backend() = default;
  virtual const char* name() const = 0;

  // --- load time ---------------------------------------------------------------------------------------
  // Called once by the model before anything is packed: throws InvalidArgument naming config.architecture and
  // the op when the backend has no kernel for something config needs, or when weights and workspaces do not
  // fit its memory.
  virtual void prepare(const ModelConfig& /*config*/, const ModelWeights& /*weights*/) {}
  // One linear layer whose output columns are those of parts[0], parts[1], ... (q | k | v, gate | up: one call),
  // with the concatenated biases when given (empty tensors: no bias). Parts may be dense or int4. projection: one
  // of the model's attention, MLP, expert or Gated DeltaNet projections, whose dense parts
  // BackendOptions::int8_weights rounds (routers, gates and per-layer projections stay as stored).
  virtual PackedLinear pack_linear(const std::vector<const LinearTensors*>& parts,
                                   const std::vector<const Tensor*>& biases = {}, bool projection = false) = 0;
  // The lm_head ([vocab, hidden] float, or GGUF blocks); quantized: the model's layers are int4 / int8 (the CPU
  // backend then runs a float head as int8 when it runs int4 layers with int8 activations).
  virtual PackedLinear pack_lm_head(const Tensor& weight, bool quantized) = 0;
  // offset + w, as the backend's norms read it (Gemma's (1 + w) norms: offset 1).
  virtual DeviceVector upload_norm(const Tensor& w, float offset) = 0;
  virtual RopeTable upload_rope(const std::vector<float>& inv_freq, float attention_scaling) = 0;
  // The embedding table, read by embedding(); may be the lm_head's tensor (tied).
  virtual void set_embedding(const Tensor& table) = 0;
  // The per-layer embedding table [vocab, layers * P] (config per_layer_input_size P > 0): a view kept as given
  virtual void set_per_layer_embedding(const Tensor& table) {
    LMKIT_CHECK(table.is_empty(), name(), " backend has no per-layer embeddings");
  }
  // An activation workspace of rows x cols.
  virtual std::shared_ptr<void> allocate_activations(int64_t rows, int64_t cols) = 0;
  // The packed weights are in: release what the backend no longer reads from the mapped files.
  virtual void weights_packed(const ModelWeights& weights) { weights.release_linear_pages(); }

  // --- KV pool ------------------------------------------------------------------------------------------
  // The format of each layer's cache, as the user asked it (core/kv_quant.h); the backend resolves
  // KVQuant::kNone to its own full precision (fp32, bf16, the activation dtype) in ops::KVLayer::bits.
  // layer_kv_heads: each layer's KV heads, 0 for a layer that keeps no KV (a recurrent one); layer_head_dim: each
  // layer's head_dim. Call once, before kv_bytes_per_block() and allocate_kv_pool().
  virtual void configure_kv(const std::vector<KVQuant>& layer_quant, const std::vector<int32_t>& layer_kv_heads,
                            const std::vector<int32_t>& layer_head_dim, int32_t block_size_tokens) = 0;
  virtual int64_t kv_bytes_per_block() const = 0;
  virtual void allocate_kv_pool(int32_t num_blocks) = 0;
  // Executor::read_kv_block / write_kv_block (the disk store); a backend without them says so here.
  virtual bool can_copy_kv_blocks() const { return false; }
  virtual void read_kv_block(int32_t /*block*/, void* /*dst*/) const {
    LMKIT_CHECK(false, name(), " backend cannot copy KV blocks to host memory");
  }
  virtual void write_kv_block(int32_t /*block*/, const void* /*src*/) {
    LMKIT_CHECK(false, name(), " backend cannot copy KV blocks from host memory");
  }
  // Executor::release_idle_memory: the pages of the free KV blocks and of the activations and scratch.
  virtual void release_idle_memory(const std::vector<int32_t>& /*free_blocks*/) {}

  // --- recurrent-state pool (csrc/engine/state_pool.h) ----------------------------------------------------
  // The model's recurrent layers, in order: call once, before state_bytes_per_slot() and allocate_state_pool().
  // A slot holds every recurrent layer's state for one sequence. begin_step() applies the batch's state copies,
  // then zeroes the slot of every sequence whose chunk starts at position 0.
  virtual void configure_state(const std::vector<RecurrentSpec>& layers) {
    LMKIT_CHECK(layers.empty(), name(), " backend has no recurrent (Gated DeltaNet) layers");
  }
  virtual int64_t state_bytes_per_slot() const { return 0; }
  virtual void allocate_state_pool(int32_t /*num_slots*/) {}

  // --- one step -----------------------------------------------------------------------------------------
  // Uploads batch's integer inputs. Returns the rows the forward runs over: batch.num_tokens, or more when
  // the backend pads (CUDA graphs); padded rows' outputs are never read.
  virtual int64_t begin_step(const Batch& batch) = 0;
  // Rows whose logits the head computes this step (batch.logit_rows, padded like the rows), and how many of
  // them one head call takes at most.
  virtual int64_t num_logit_rows() const = 0;
  virtual int64_t max_head_rows() const = 0;
  // Runs forward (the whole step's device work); a backend may record it once and replay it (CUDA graphs).
  virtual void execute(const std::function<void()>& forward) { forward(); }

  // out = table[step ids] * scale                                              out: [rows, hidden]
  virtual void embedding(int64_t rows, int64_t hidden, float scale, void* out) = 0;
  // Per-layer embeddings (Gemma 4's E-models): out = (out + per_layer_table[step ids] * scale) * mix, the table from
  // set_per_layer_embedding                                                     out: [rows, dim]
  virtual void add_per_layer_embedding(int64_t rows, int64_t dim, float scale, float mix, void* out) {
    LMKIT_CHECK(false, name(), " backend has no per-layer embeddings");
  }
  // x += y                                                                       x, y: [rows, dim]
  virtual void add(void* x, const void* y, int64_t rows, int64_t dim) {
    LMKIT_CHECK(false, name(), " backend has no per-layer embeddings");
  }
  // gate[r] = act(gate[r]) * x[r x_stride + x_first ...] (act: silu or gelu_tanh)     gate: [rows, dim]
  virtual void gated_product(void* gate, const void* x, int64_t x_first, int64_t x_stride, int64_t rows, int64_t dim,
                             Activation act) {
    LMKIT_CHECK(false, name(), " backend has no per-layer embeddings");
  }
  // out = x / rms(x) * w (w from upload_norm)                                  x, out: [rows, dim]; may alias
  virtual void rmsnorm(const void* x, const DeviceVector& w, float eps, int64_t rows, int64_t dim, void* out) = 0;
  // residual += x; out = rmsnorm(residual) * w
  virtual void add_rmsnorm(void* residual, const void* x, const DeviceVector& w, float eps, int64_t rows,
                           int64_t dim, void* out) = 0;
  // out[rows, w.n] = x[rows, w.k] @ W^T (+ bias)
  virtual void linear(const void* x, int64_t rows, const PackedLinear& w, void* out) = 0;
  // Self-attention of one layer over the KV pool, from the fused projection qkv [rows, (H + 2 KVH) hd]
  // (q | k | v per row; read and overwritten): q/k norms, RoPE, K/V written at the step's slots, then paged
  // attention of the step's sequences. out: [rows, H hd]. With spec.reads_shared_kv qkv is q alone, over the
  // cache an earlier layer wrote this step.
  virtual void attention(void* qkv, int64_t rows, const AttentionSpec& spec, void* out) = 0;
  // The token mixer of one recurrent layer, from the fused projection proj [rows, spec.proj_dim()] (q | k | v | z |
  // b | a per row; read and overwritten): the short causal convolution and SiLU over q | k | v, the gated delta
  // rule (beta = sigmoid(b), decay log g = decay_rate * softplus(a + dt_bias)) on each sequence's state slot, then
  // the gated RMSNorm per value head, norm(o) * w * silu(z). out: [rows, value_dim] (out_proj not applied).
  virtual void recurrent_mixer(void* proj, int64_t rows, const RecurrentSpec& spec, void* out) {
    LMKIT_CHECK(false, name(), " backend has no recurrent (Gated DeltaNet) layers");
  }
  // x *= sigmoid(gate)                                                         x, gate: [rows, dim]
  virtual void sigmoid_gate(void* x, const void* gate, int64_t rows, int64_t dim) {
    LMKIT_CHECK(false, name(), " backend has no attention output gate");
  }
  // out[r] += sigmoid(gate[r]) * x[r]: a gate of one column per row             out, x: [rows, dim]; gate: [rows, 1]
  virtual void add_sigmoid_gated(void* out, const void* x, const void* gate, int64_t rows, int64_t dim) {
    LMKIT_CHECK(false, name(), " backend has no shared experts");
  }
  // out[rows, inter] = act(gate) * up from gate_up [rows, 2 inter] (gate | up per row); out may alias gate_up.
  virtual void gated_activation(void* gate_up, int64_t rows, int64_t inter, Activation act, void* out) = 0;
  // Mixture of experts: out[rows, hidden] = sum over each row's top_k experts (router softmax, model/moe_routing.h)
  // of weight * expert(x); every active expert runs once over all the rows routed to it. out may alias x.
  // router_x: the router's input when it is not x (Gemma 4), else nullptr.
  // A backend without it refuses MoE models in prepare().
  // Returns the bytes of the weights it read (the router and the experts it ran).
  virtual int64_t moe(const void* x, int64_t rows, const PackedExperts& experts, const MoeSpec& spec, void* out,
                      const void* router_x = nullptr) {
    LMKIT_CHECK(false, name(), " backend has no mixture-of-experts layers");
    return 0;
  }
  // out[i] = x[logit_rows[first + i]] for i < n                                 x: [rows, dim], out: [n, dim]
  virtual void gather_logit_rows(const void* x, int64_t first, int64_t n, int64_t dim, void* out) = 0;
  // The multi-token-prediction head's inputs (DecoderModel::mtp_step):
  // out[i] = x[rows[i]] for i < n                                          x: [>= max rows + 1, dim], out: [n, dim]
  virtual void gather_rows(const void* x, const int32_t* rows, int64_t n, int64_t dim, void* out) {
    LMKIT_CHECK(false, name(), " backend does not run multi-token-prediction heads");
  }
  // out[r] = [a[r]; b[r]]                                                       a, b: [rows, dim], out: [rows, 2 dim]
  virtual void concat_columns(const void* a, const void* b, int64_t rows, int64_t dim, void* out) {
    LMKIT_CHECK(false, name(), " backend does not run multi-token-prediction heads");
  }
  // x = cap * tanh(x / cap)                                                     x: [rows, dim]
  virtual void softcap(void* x, int64_t rows, int64_t dim, float cap) = 0;
  // x *= s                                                                      x: [rows, dim]
  virtual void scale(void* x, int64_t rows, int64_t dim, float s) {
    LMKIT_CHECK(false, name(), " backend has no per-layer output scalars");
  }
  // Consumes the logits [n, vocab] of logit rows [first, first + n): samples batch's sample rows among them,
  // copies its logit_outputs among them into out and scores its prompt_logprob_rows
  // (take_prompt_logprobs).
  virtual void take_logits(const Batch& batch, int64_t first, int64_t n, const void* logits, int64_t vocab,
                           StepOutput& out) = 0;
  // Copies the final hidden states [n, hidden] of logit rows [first, first + n) that are batch's hidden_outputs
  // into out.hidden (as float).
  virtual void take_hidden(const Batch& batch, int64_t first, int64_t n, const void* hidden, int64_t dim,
                           StepOutput& out) = 0;

  // Called once on the engine's loop thread (thread pools, device binding).
  virtual void bind_thread() {}
};

// out.prompt_logprobs of batch's prompt_logprob_rows among logit rows [first, first + n), from their raw
// logits (fp32 on the host, [n, vocab]): log-softmax at the row's token and its top alternatives.
void take_prompt_logprobs(const Batch& batch, int64_t first, int64_t n, const float* logits, int64_t vocab,
                          StepOutput& out);

// Backend settings from EngineConfig.
struct BackendOptions {
  int32_t max_step_tokens = 8192;    // rows of one forward at most (prefill budget + decodes)
  int32_t num_threads = 0;           // CPU: 0 = all cores
  bool int8_activations = true;  // CPU: int4 and int8 layers (any layout) with int8 activations (decode and prefill)
  bool bf16_linear = false;          // CPU: dense linear layers (and full-precision KV) as bf16
  bool bf16_kv = false;              // CPU: full-precision KV as bf16 with float32 linear layers too
  // CPU: the dense projections (pack_linear's projection) and the lm_head as int8 per 32 inputs (llama.cpp's Q8_0
  // numerics), run with int8 activations where int8_activations is set (EngineConfig.quantization="int8")
  bool int8_weights = false;
  int32_t max_blocks_per_seq = 0;    // CUDA: ceil(session_len / block size), the graphs' fixed tables
  bool cuda_graphs = true;           // CUDA: decode steps as CUDA graphs
};

std::unique_ptr<Backend> make_cpu_backend(const BackendOptions& options);
#ifdef LMKIT_WITH_CUDA
// act: the activation dtype (F16 or BF16).
std::unique_ptr<Backend> make_cuda_backend(const BackendOptions& options, DType act, int64_t hidden_size,
                                           int64_t vocab_size);
#endif

}  // namespace lmkit
