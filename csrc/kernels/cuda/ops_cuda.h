// The op interface of the CUDA backend: the same ops as kernels/ops.h on device memory, with fp16 or
// bf16 activations (fp32 accumulation everywhere). Plain C++ (no CUDA headers): the model and the
// Python binding include it; only the .cu files see CUDA. One dispatch point per op, checks at the door.
//
// Conventions:
//   - every pointer is device memory unless its name ends in _host; rows are tokens of the fused batch;
//   - `act` is the activation dtype (F16 or BF16) of x / out; weights keep their own dtype;
//   - every op is enqueued on `stream` (a cudaStream_t; nullptr = the legacy default stream) and returns
//     without synchronising; errors of the launch are thrown as lmkit::Error naming the op;
//   - kernels write every element of their outputs (tests poison outputs first).
#pragma once
#include <stdint.h>

#include <memory>
#include <string>
#include <utility>

#include "core/dtype.h"
#include "kernels/ops.h"

namespace lmkit::cuda {

using Stream = void*;

// ---- runtime ------------------------------------------------------------------------------------
// Whether a usable CUDA device is present (driver loaded, at least one device). Never throws.
bool is_available();
int device_count();
// "NVIDIA H100 80GB HBM3 (sm_90, 132 SMs)" of the current device.
std::string device_name();
// Compute capability of the current device as 10 * major + minor (90 for Hopper).
int compute_capability();
void set_device(int device);
// Free and total bytes of the current device.
void memory_info(int64_t* free_bytes, int64_t* total_bytes);
// Device memory that frees itself when the last copy goes (cudaFree, errors ignored at exit).
std::shared_ptr<void> allocate(int64_t size_bytes);
void copy_to_device(void* dst, const void* src_host, int64_t size_bytes, Stream stream);
void copy_to_host(void* dst_host, const void* src, int64_t size_bytes, Stream stream);
void copy_device(void* dst, const void* src, int64_t size_bytes, Stream stream);
void fill_bytes(void* dst, int value, int64_t size_bytes, Stream stream);
void synchronize(Stream stream);
Stream create_stream();
void destroy_stream(Stream stream);
// CUDA graphs: the ops enqueued on `stream` between begin_capture and end_capture (no synchronisation,
// allocation or host copy in between) become one executable graph, replayed by launch_graph with the same
// device pointers (their contents may change between replays).
void begin_capture(Stream stream);
std::shared_ptr<void> end_capture(Stream stream);
void launch_graph(const std::shared_ptr<void>& graph, Stream stream);
// Ends a capture that failed half-way, dropping what was recorded (errors ignored).
void abort_capture(Stream stream) noexcept;
// Device-to-device copy bandwidth in bytes/s (read + write counted), timed with events over `repeats`
// copies of size_bytes: the roofline figure of DESIGN.md section 7.
double measure_copy_bandwidth(int64_t size_bytes, int repeats);

// ---- elementwise --------------------------------------------------------------------------------
// out[t, :] = table[ids[t], :]        table: [vocab, hidden] F32/F16/BF16, out: [n, hidden] act
void embedding(const void* table, DType table_dtype, int64_t vocab, const int32_t* ids, int64_t n,
               int64_t hidden, void* out, DType act, Stream stream);
// out[r] = x[r] / sqrt(mean(x[r]^2) + eps) * weight        x, out: [rows, dim] act; out may alias x
void rmsnorm(const void* x, const void* weight, DType weight_dtype, float eps, int64_t rows, int64_t dim,
             void* out, DType act, Stream stream);
// residual[r] += x[r] (rounded to act); out[r] = rmsnorm(residual[r]) * weight      (fused)
void add_rmsnorm(void* residual, const void* x, const void* weight, DType weight_dtype, float eps,
                 int64_t rows, int64_t dim, void* out, DType act, Stream stream);
// out[t, j] = silu(gate_up[t, j]) * gate_up[t, inter + j]      gate_up: [n, 2 inter], out: [n, inter]
void silu_mul(const void* gate_up, int64_t n, int64_t inter, void* out, DType act, Stream stream);
// out[i, :] = x[rows[i], :] for i < num_rows                   x: [*, dim], out: [num_rows, dim]
void gather_rows(const void* x, const int32_t* rows, int64_t num_rows, int64_t dim, void* out, DType act,
                 Stream stream);

// ---- rotary embedding + KV write ----------------------------------------------------------------
// The blocked KV pool of one layer on the device: ops::KVLayer with bits 16 (the activation dtype,
// [num_kv_heads, block_size_tokens, head_dim] per block), 8 or 4 (the CPU backend's quantized rows and
// (scale, zero) pairs, byte for byte).
//
// qkv: [n, (num_heads + 2 num_kv_heads) head_dim] act, q | k | v of each token (the fused projection).
// In one pass: add bias (qkv_bias: [(num_heads + 2 num_kv_heads) head_dim] act, or null), rotate q and k
// as ops::rope does (inv_freq: [head_dim / 2] fp32), leave the rotated q in place, and write k, v into
// the pool at slots[t] = block * block_size_tokens + offset (slots[t] < 0: the row is skipped), quantized per
// token and head when kv.bits is 8 or 4 with the CPU backend's rounding (lmkit/kv_policy.py).
void qkv_rope_kv_write(void* qkv, const void* qkv_bias, const int32_t* positions, const int32_t* slots,
                       int64_t n, int32_t num_heads, const float* inv_freq, float attention_scaling,
                       const ops::KVLayer& kv, DType act, Stream stream);

// ---- paged attention ----------------------------------------------------------------------------
// The fused batch as attention sees it (device arrays, built by the host from the plan).
struct AttnBatch {
  const int32_t* q_start = nullptr;       // [num_seqs + 1] first query row of each sequence; last = rows
  const int32_t* ctx_lens = nullptr;      // [num_seqs] keys in the cache incl. this step's rows
  const int32_t* block_tables = nullptr;  // [num_seqs, max_blocks_per_seq] block ids
  const int32_t* row_seq = nullptr;       // [num_rows] sequence of each query row
  int32_t num_seqs = 0;
  int32_t num_rows = 0;
  int32_t max_blocks_per_seq = 0;
  int32_t max_ctx_len = 0;                // upper bound of ctx_lens (sizes the split-K grid)
};
// Bytes of workspace paged_attention needs for this batch shape (partial results of the split-K pass).
int64_t attention_workspace_bytes(int32_t num_rows, int32_t num_heads, int32_t head_dim, int32_t max_ctx_len);
// Causal paged attention as ops::paged_attention (q: [rows, num_heads, head_dim] act, read from qkv with
// row stride q_row_stride elements; out: [rows, num_heads, head_dim] act), over 16-bit, int8 or int4 KV.
// When the grid of (row, kv head) is small (decode), the keys are split into chunks processed in parallel
// (flash decoding) and merged by a second kernel in `workspace` (attention_workspace_bytes; null if 0).
void paged_attention(const void* q, int64_t q_row_stride, const ops::KVLayer& kv, const AttnBatch& batch,
                     int32_t num_heads, float scale, int32_t sliding_window, void* workspace, void* out,
                     DType act, Stream stream);

// ---- linear layers ------------------------------------------------------------------------------
// A linear weight [n, k] on the device in this backend's layout (made once at load time).
//   dense: data = [n, k] in the activation dtype (row-major, as stored in the checkpoint);
//   int4 (group_size > 0): data = uint32 [n, k / 8], word w of row r holds q[r, 8w + i] in bits 4i..4i+3;
//     scales = fp16 [n, k / group_size]; zeros = uint8 [n, k / group_size];
//     weight[r, c] = (q[r, c] - zero[r, c / g]) * scale[r, c / g].
struct Linear {
  DType dtype = DType::F16;  // dense: F16 / BF16; int4: the activation dtype it is used with
  int32_t group_size = 0;
  int64_t n = 0, k = 0;
  std::shared_ptr<void> data, scales, zeros;
  bool is_int4() const { return group_size > 0; }
  int64_t size_bytes() const;
};
// The int4 layout above from a checkpoint's int4 tensors (any layout, read through an Int4Source; host
// memory): host-side repacking, shared with the CPU tests of the layout. Throws InvalidArgument when the group
// size or shape does not fit, or the source permutes its inputs (act-order: not supported here yet).
struct HostInt4 {
  int64_t n = 0, k = 0;
  int32_t group_size = 0;
  std::shared_ptr<uint32_t[]> qweight;  // [n, k / 8]
  std::shared_ptr<uint16_t[]> scales;   // [n, k / g] fp16 bits
  std::shared_ptr<uint8_t[]> zeros;     // [n, k / g]
};
HostInt4 repack_int4(const Int4Source& source);
Linear upload_int4(const HostInt4& w, DType act, Stream stream);
// A float weight [n, k] (F32/F16/BF16 host view) converted to act and uploaded.
Linear upload_dense(const Tensor& weight, DType act, Stream stream);

// out[M, n] = x[M, k] @ w^T (+ bias[n] act, or null)        x: [M, k] act (row stride k, 16-byte aligned:
// the kernels load 8 values at a time; K % 8 == 0, and K % 32 == 0 for int4), out: [M, n] act
// Up to skinny_rows() rows (int4; dense with K % 32 == 0): the skinny tensor-core kernel (weights streamed
// once, int4 dequantized in registers, mma.sync with fp32 sums). Above: cuBLAS (cublasGemmEx, loaded at run
// time when libcublas is found; int4 weights dequantized first, a block of rows at a time, into a 64 MiB
// scratch per stream, made by upload_int4 for its stream), or without cuBLAS a tensor-core GEMM (mma.sync
// through WMMA, an int4 tile dequantized into shared memory).
constexpr int64_t kSkinnyInt4Rows = 64, kSkinnyDenseRows = 8;
constexpr int kCudaMaxHeadDim = 256;  // the KV pool's and attention's largest head_dim on the GPU (the CPU's: 512)
void linear(const void* x, int64_t M, const Linear& w, const void* bias, void* out, DType act, Stream stream);
// The largest M that the skinny kernel takes, (int4, dense); 0 turns it off (tests and benchmarks of the
// other paths). Process-wide, like set_dense_gemm_backend; a captured decode graph keeps what it captured.
void set_skinny_rows(int64_t int4_rows, int64_t dense_rows);
std::pair<int64_t, int64_t> skinny_rows();
// Whether the skinny kernel loads the next steps' weights while it multiplies the current ones, or (the
// default: 10-20% faster for int4 on an H200, the same for dense) loads twice as many steps, then multiplies them.
void set_skinny_pipeline(bool on);
bool skinny_pipeline();
// Which dense GEMM linear() uses: "cublas" (when libcublas loads) or "wmma" (ours); set_ forces one
// ("cublas" = use it when available).
const char* dense_gemm_backend();
void set_dense_gemm_backend(const std::string& name);

// ---- sampling -----------------------------------------------------------------------------------
// Per row of logits ([rows, vocab] fp32 or act, penalised in place): the parameters of its next token.
struct SampleParams {
  float temperature = 0.0f;  // <= 0: greedy
  int32_t top_k = 0;         // 0: off
  float top_p = 1.0f;
  float min_p = 0.0f;
  float repetition_penalty = 1.0f, presence_penalty = 0.0f, frequency_penalty = 0.0f;
  uint64_t seed = 0;         // with `step`, the counter of the row's random draws
  uint64_t step = 0;
};
// Penalised tokens: for row r, entries penalty_offsets[r] .. penalty_offsets[r + 1] - 1 of (token, count)
// pairs, one per distinct token of the sequence (penalty_offsets null when no row has any): count -1 bans
// the token (logit -inf: eos / stop ids before min_new_tokens); count >= 0 applies the repetition penalty
// (HF: over prompt and output) and, when count > 0 (times in the output), presence + frequency * count
// (OpenAI), in that order as the CPU sampler (kernels/cpu/sampling.h). Then temperature, then top-k,
// top-p and min-p as thresholds on the probability (found by bisection: no sort), and a draw by the
// Gumbel-max trick with a counter-based generator (seed, step, token). Greedy rows (temperature <= 0 or
// top_k == 1) take the arg max, lowest id on ties. out_tokens: [rows] int32.
void sample(void* logits, DType logits_dtype, int64_t rows, int64_t vocab, const SampleParams* params,
            const int32_t* penalty_offsets, const int32_t* penalty_tokens, const int32_t* penalty_counts,
            int32_t* out_tokens, Stream stream);

}  // namespace lmkit::cuda
