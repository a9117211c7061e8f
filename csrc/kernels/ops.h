// The CPU kernels' interface: the CPU backend (model/backend_cpu.cpp), the kernel tests and the kernel
// benchmark call these; a model forward calls the Backend interface (model/backend.h), never these. One
// dispatch point per op: AVX-512 / AVX2+FMA / generic code is picked once, at run time, from what the CPU
// supports. (The CUDA kernels, kernels/cuda/ops_cuda.h, share this header's plain types.)
//
// Conventions:
//   - activations are fp32, row-major, rows = tokens of the fused batch;
//   - weights are views in their stored dtype (F32, F16 or BF16) and are converted inside the kernel,
//     never expanded into fp32 copies of whole matrices;
//   - kernels are multi-threaded over the calling thread's team (set_num_threads; cpu/thread_pool.h);
//   - inputs are checked at the door (dtype, shape) with LMKIT_CHECK.
#pragma once
#include <stdint.h>

#include <memory>
#include <vector>

#include "core/int4_source.h"
#include "core/tensor.h"

namespace lmkit::ops {

// Threads used by the ops called from this thread: its team, the caller included (default 1).
void set_num_threads(int num_threads);
// Name of the instruction set picked at run time: "avx512", "avx2" or "generic".
const char* cpu_isa();

// out[t, :] = table[ids[t], :] as fp32.            table: [vocab, hidden] F32/F16/BF16, out: [n, hidden]
void embedding(const Tensor& table, const int32_t* ids, int64_t num_tokens, float* out);

// out[r, :] = x[r, :] / sqrt(mean(x[r, :]^2) + eps) * weight     x, out: [num_rows, dim]; out may alias x.
void rmsnorm(const float* x, const Tensor& weight, float eps, int64_t num_rows, int64_t dim, float* out);

// residual[r, :] += x[r, :]; out[r, :] = rmsnorm(residual[r, :]) * weight.   (fused residual add + norm)
void add_rmsnorm(float* residual, const float* x, const Tensor& weight, float eps, int64_t num_rows,
                 int64_t dim, float* out);

// A linear layer's weight in the layout of this backend's kernels, made once at load time (owns its bytes;
// copies share them). Every layout is one WeightFormat; all a format is (its bytes, how it is packed, the
// kernel that runs it, whether this CPU has that kernel) is its entry in the traits table
// (weight_format_traits, kernels/cpu/linear_formats.cpp): a new format is a new entry, not a new flag.
// The CPU layouts, panels of kLinearPanelCols output columns, zero-padded past N:
//   Dense (pack_linear): k-major inside a panel, in the stored dtype (F32 / F16 / BF16):
//       data[(p * K + k) * kLinearPanelCols + j] = weight[p * kLinearPanelCols + j, k]
//     so that one k step of a panel is one contiguous row: no horizontal sums, one stream per thread.
//   Int4 (pack_linear_int4 from any int4 checkpoint layout; dtype F16 = the scales, but for Mxfp4 heads' u8
//     exponents): per panel, K / group_size
//     group blocks of
//       scales  [32] fp16      scale of (group, column j)
//       zeros   [32] u8        zero point of (group, column j), 0..15
//       quads   [g / 4][64] u8 byte i of 32-bit lane j of quad t: q[4t + i, j] | q[4t + i, j + 16] << 4
//     weight[n, k] = (q[k, n] - zero[k / g, n]) * scale[k / g, n]; one stream per panel, scales inline.
//     The group head has one of six forms (LinearWeight::group_head, from the source):
//       Zeros      scales [32] fp16 | zeros [32] u8                        as above (any zero point)
//       Symmetric  scales [32] fp16                                        every zero 8: weight = (q - 8) * scale
//                  (GGUF Q4_0, symmetric GPTQ / AWQ / compressed-tensors: 4.5 bits per weight at g = 32, the
//                  file's size, and no per-column zero in the kernels' sums)
//       Offsets    scales [32] fp16 | offsets [32] fp16                    weight = q * scale + offset (GGUF Q4_1)
//       KQuant   d [32] fp16 | dmin [32] fp16 | sc [8][32] u8 | m [8][32] u8
//                (GGUF Q4_K, g = 256: its super-block; sub-block b of 32 inputs has weight = q * (d * sc[b]) -
//                dmin * m[b], sc and m its 6-bit values; both products are exact in fp32, so this is lossless at
//                4.625 bits per weight, the file's 4.5 but for sc and m in whole bytes)
//       Mxfp4    f [32] u8                                               (OCP MXFP4: gpt-oss's experts, GGUF MXFP4;
//                g = 32) q is an e2m1 code, weight = e2m1x2[q] * 2^(f - 127), e2m1x2 = twice the e2m1 values
//                {0, 1, 2, 3, 4, 6, 8, 12, -0, -1, -2, -3, -4, -6, -8, -12} (integers) and f = e - 1 the fp32
//                exponent field of the file's e8m0 scale halved (2^(e - 128)); 4.25 bits per weight, the file's
//                size; lossless except that f = 0 (e <= 1: every weight of the block below 2^-123) reads as scale 0
//       Nvfp4    s [2][32] fp16                                          (NVFP4: compressed-tensors
//                nvfp4-pack-quantized; g = 32, two NVFP4 blocks of 16 inputs) sub-block b (inputs 16b..16b + 15)
//                has weight = e2m1x2[q] * s[b] * output_scale, s[b] the block's E4M3 scale (exact in fp16) and
//                output_scale = 1 / (2 * global_scale) the tensor's, applied once to each output; 5 bits per
//                weight (the file's 4.5 but for the scales in fp16), lossless
//   Int8 (pack_linear_int8 from a float weight; llama.cpp's Q8_0 and Q5_0 in our panels; dtype F16): per panel,
//     K / 32 blocks (group_size 32) of
//       scales  [32] fp16      d of (block, column j): max |w| / 127 over the block's 32 values
//       quads   [8][2][64] u8  byte i of 32-bit lane j of half h of quad t: q[4t + i, 16h + j] + 128
//     weight[n, k] = (u8 - 128) * d: fp32 activations give the exact product of the stored weight (every CPU);
//     int8_activations (where the CPU has integer dot products) the fast path, as for Int4.
//     group_size 16 (d * sc per 16 values, exact in fp32; dtype F32: GGUF Q6_K where K is no multiple of 256):
//     K / 16 blocks of
//       scales  [32] fp32 | quads [4][2][64] u8      (the same quads, 4 per block)
//     group_head Offsets (GGUF Q5_K, group_size 32, dtype F32): K / 32 blocks of
//       scales  [32] fp32 | offsets [32] fp32 | quads [8][2][64] u8     weight = (u8 - 128) * scale + offset
//     (Q5_K's sub-block: q = q5 in 0..31, scale d * sc and offset -dmin * m, both exact in fp32: lossless; the
//     int8-activation kernels add offset * sum(x) per block)
//   Int6 (GGUF Q6_K, from pack_linear_int8 of a source with read_block16_kquant; group_size 256, dtype F16 = d):
//     per panel, K / 256 super-blocks of
//       d       [32] fp16          the super-block's scale of column j
//       sc      [16][32] s8        sub-block b's (16 inputs) scale of column j
//       octets  [32][3][64] u8     octet o (k = 8o .. 8o + 7): the int4 quads of k 8o.. and 8o + 4.. holding the
//                                  low 4 bits of u = q + 32, then a plane of the high 2 bits: byte i of 32-bit lane j
//                                  = hi(uA[i, j]) | hi(uA[i, j + 16]) << 2 | hi(uB[i, j]) << 4 | hi(uB[i, j + 16]) << 6
//     weight[n, k] = (u - 32) * d * sc[b]: exact in fp32, 6.5625 bits per weight (the file's own size)
//   Bf16Pairs (pack_linear_bf16 from a float weight; dtype BF16): per panel, ceil(K / 2) rows of 32
//     little-endian 32-bit lanes; lane j of row r holds
//       bf16(weight[n, 2r]) | bf16(weight[n, 2r + 1]) << 16       (n = p * 32 + j; 0 past N and K)
//     the operand layout of AVX512_BF16's vdpbf16ps; x is rounded to bf16 per call, products summed in fp32.
constexpr int kLinearPanelCols = 32;
// The sizes of the K-quant layouts above, shared by the packers and every ISA's kernels: an Int4 KQuant group (a
// super-block) and its sub-blocks; an Int6 super-block, its sub-blocks, its octets and its head (d, then sc) and
// whole bytes per panel.
constexpr int64_t kLinearKQuantGroup = 256, kLinearKQuantSub = 32;
constexpr int64_t kLinearInt6Group = 256, kLinearInt6Sub = 16, kLinearInt6OctetBytes = 192;
constexpr int64_t kLinearInt6HeadBytes = kLinearPanelCols * (2 + kLinearInt6Group / kLinearInt6Sub);
constexpr int64_t kLinearInt6GroupBytes = kLinearInt6HeadBytes + kLinearInt6Group / 8 * kLinearInt6OctetBytes;
enum class WeightFormat : uint8_t { Dense, Int4, Int8, Bf16Pairs, Int6 };
// The group heads above: Int4 has all six; Int8 has Zeros (the plain blocks: scales only, the zero is the
// stored 128) and Offsets.
enum class GroupHead : uint8_t { Zeros, Offsets, KQuant, Symmetric, Mxfp4, Nvfp4 };
// Bytes of an Int4 panel's group head and of a whole group of g inputs (layouts above), for the packer and every
// ISA's kernels: per column an fp16 scale and a u8 zero (Zeros), the scale alone (Symmetric), scale and fp16 offset
// (Offsets), fp16 d, dmin and 8 u8 sc, m (KQuant), a u8 exponent (Mxfp4), or two fp16 scales (Nvfp4); then g / 2
// bytes of nibbles.
constexpr int64_t linear_int4_head_bytes(GroupHead head) {
  return kLinearPanelCols * (head == GroupHead::Zeros       ? 3
                             : head == GroupHead::Symmetric ? 2
                             : head == GroupHead::Offsets   ? 4
                             : head == GroupHead::Mxfp4     ? 1
                             : head == GroupHead::Nvfp4     ? 4
                                                            : 20);
}
// The twice-e2m1 value of each MXFP4 / NVFP4 code (Mxfp4 and Nvfp4 heads), for the packers, kernels and references.
constexpr int8_t kE2m1Twice[16] = {0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12};
constexpr int64_t linear_int4_group_bytes(int64_t g, GroupHead head) {
  return linear_int4_head_bytes(head) + g * kLinearPanelCols / 2;
}
struct LinearWeight;
struct WeightFormatTraits {
  WeightFormat format;
  const char* name;  // "dense", "int4", "int8", "bf16_pairs"
  // Bytes of the packed panels of w (from its n, k, dtype and group_size).
  int64_t (*packed_bytes)(const LinearWeight& w);
  // Packs a float weight [N, K] (F32/F16/BF16) into this format; nullptr where the format is made from
  // other tensors (Int4: a checkpoint's int4 layout read through an Int4Source, pack_linear_int4).
  LinearWeight (*pack_float)(const Tensor& weight);
  // nullptr when this CPU runs the format's kernel, else what it lacks (an error message).
  const char* (*unavailable)();
  // out[M, N] = x[M, K] @ w^T (+ bias[N] fp32 when non-null): the format's kernel; inputs already checked.
  void (*run)(const float* x, int64_t M, const LinearWeight& w, const float* bias, float* out);
};
const WeightFormatTraits& weight_format_traits(WeightFormat format);

struct LinearWeight {
  WeightFormat format = WeightFormat::Dense;
  // Dense: the stored dtype; Int4, Int6 and Int8: the scales' (F16; Int8 in blocks of 16: F32; Int4 Mxfp4 heads hold
  // u8 exponents, dtype F16 all the same); Bf16Pairs: BF16
  DType dtype = DType::F32;
  // Int4: 32 / 64 / 128 along K (KQuant: 256; Mxfp4, Nvfp4: 32); Int8: 32 or 16; Int6: 256; else 0
  int32_t group_size = 0;
  // Int4 and Int8: the form of the group heads (layouts above). AMX tiles run Int4 Zeros and Symmetric only.
  GroupHead group_head = GroupHead::Zeros;
  // Int4 only: null, or the order in which the weight takes the layer's inputs (Int4Source::input_perm);
  // ops::linear gathers x by it before the product.
  std::shared_ptr<const std::vector<int32_t>> input_perm;
  // Int4 Nvfp4 heads: the factor of every output (1 / (2 * the tensor's NVFP4 global scale)); else 1.
  float output_scale = 1.0f;
  // Int4, Int6 and Int8: quantize x to int8 per 32 values (per weight group for some Int4 layers, below) and use
  // integer dot products where the CPU has them (AVX2, AVX-512 VNNI; AMX-INT8 tiles in calls of
  // kLinearAmxInt8MinRows rows or more): decode and prefill.
  // The result differs from the exact fp32 product by the rounding of x (relative error of the output
  // ~3e-3, tested); the integer sums are exact, so every ISA gives the same up to the order of fp32 sums.
  bool int8_activations = false;
  int64_t n = 0, k = 0;                // the weight is [n, k]
  std::shared_ptr<void> storage;       // the packed panels
  bool is_empty() const { return storage == nullptr; }
  const WeightFormatTraits& traits() const { return weight_format_traits(format); }
  int64_t size_bytes() const { return traits().packed_bytes(*this); }
};
LinearWeight pack_linear(const Tensor& weight);  // weight: [N, K] F32/F16/BF16
// An int4 weight read from a checkpoint's layout (core/int4_source.h; the layouts: model/int4_layouts.h),
// N = source.num_out, K = source.num_in. Throws InvalidArgument when the group size or shape does not fit.
LinearWeight pack_linear_int4(const Int4Source& source);
// A float weight [N, K] (K a multiple of 32) quantized to int8 per 32 values along K (d = fp16(max |w| / 127),
// q = round(w / d), as llama.cpp's Q8_0). Its int8_activations is false: the caller sets it for the fast path.
LinearWeight pack_linear_int8(const Tensor& weight);
// An int8 weight read from a checkpoint (GGUF Q8_0, Q5_0; Q6_K in blocks of 16; Q5_K with offsets) into the same
// panels, its values, scales and offsets as they are; a Q6_K source (read_block16_kquant) with K a multiple of 256
// into Int6 panels instead.
LinearWeight pack_linear_int8(const Int8Source& source);
// A float weight [N, K] rounded to bf16 (nearest even) into pair panels, for linear layers as bf16 dot
// products with fp32 sums (EngineConfig dtype='bfloat16'); throws unless bf16_dot_available().
LinearWeight pack_linear_bf16(const Tensor& weight);
// Whether this CPU has the bf16 dot-product kernel (AVX-512 with AVX512_BF16); require_bf16_dot() throws
// InvalidArgument saying so (and what to use instead) when it has not.
bool bf16_dot_available();
void require_bf16_dot();
// Whether bf16 pair panels run on AMX tiles here (AMX-BF16, granted to the process by the OS), in every call,
// one row included, so that a row's bits do not depend on the rows beside it (the result is that of the
// dot-product kernel up to the order of fp32 sums), and so does paged_attention over a bf16 KV cache (head_dim,
// block_size_tokens % 32 == 0).
bool bf16_amx_available();
// Whether AWQ int4 layers with int8 activations run on AMX tiles (AMX-INT8, granted by the OS) in calls of
// at least kLinearAmxInt8MinRows rows (fewer stream the weight, as fast on VNNI), with the VNNI kernel's bits.
bool int8_amx_available();
constexpr int64_t kLinearAmxInt8MinRows = 32;
// Int4 Zeros and Symmetric layers with groups of more than 32 quantize x per weight group instead of per 32
// values on AVX-512 VNNI and AMX tiles, in every call (the floating-point work of each block runs once per group:
// prefill ~20% faster; and a row is quantized the same way whatever the batch); AVX2 keeps blocks of 32.

// One weight whose output columns are those of parts[0], then parts[1], ... (q/k/v or gate/up run as
// one call: one thread team, one activation quantization). The panels are copied as they are, so every
// part but the last needs N % kLinearPanelCols == 0 and all must share K and format; otherwise (or with
// fewer than two parts) returns an empty weight and the caller keeps the parts.
LinearWeight concat_linear(const std::vector<const LinearWeight*>& parts);
// Moves the packed bytes of every weight into one block, in the order given (a model's weights in the order
// a decode step reads them), backed by huge pages where the OS grants them; each weight then shares that
// block. Done once at load time: peak memory is the weights plus the largest one.
void gather_weights(const std::vector<LinearWeight*>& weights);
// Whether this CPU runs the integer dot-product kernels (int8 activations; AVX2 or AVX-512).
bool int8_dot_available();

// out[M, N] = x[M, K] @ weight[N, K]^T (+ bias[N]).   bias empty or any float dtype.
// One kernel for every M: decode (M = 1..few) streams the weight once, prefill is compute bound.
void linear(const float* x, int64_t M, const LinearWeight& weight, const Tensor& bias, float* out);
// The same for an unpacked weight: packs it first (tests and one-off calls; the model packs at load).
void linear(const float* x, int64_t M, const Tensor& weight, const Tensor& bias, float* out);
// Several independent linears in one thread team (a mixture-of-experts layer's active experts): for each job,
// out[M, w.n] = x[M, w.k] @ w^T, no bias; jobs may differ in format and shape. The panels of all jobs are split
// among the threads by their cost (rows + the weight's read), so that one large job or many small ones keep
// every thread busy and no weight is read twice. Each job's output equals ops::linear's on it.
struct LinearJob {
  const float* x = nullptr;
  int64_t M = 0;
  const LinearWeight* w = nullptr;
  float* out = nullptr;
};
void linear_group(const LinearJob* jobs, int64_t num_jobs);

// Rotary embedding in HF "rotate_half" layout, in place, over the first rotary_dim dims of each head
// (0: head_dim, else even and <= head_dim; partial rotary, Phi-4-mini: the rest of the head passes unchanged).
//   q: [n, num_heads, head_dim], k: [n, num_kv_heads, head_dim], inv_freq: [rotary_dim / 2]
//   for i < R = rotary_dim/2: angle = float(positions[t]) * inv_freq[i] (fp32 product, as HF computes it),
//   c = cos(angle) * attention_scaling, s = sin(angle) * attention_scaling,
//   (x[i], x[i + R]) <- (x[i] c - x[i + R] s, x[i + R] c + x[i] s)
void rope(float* q, float* k, const int32_t* positions, int64_t n, int num_heads, int num_kv_heads,
          int head_dim, const float* inv_freq, float attention_scaling, int rotary_dim = 0);

// out[t, j] = silu(gate[t, j]) * up[t, j]          all [n, inter]; out may alias gate or up.
void silu_mul(const float* gate, const float* up, int64_t n, int64_t inter, float* out);
// out[t, j] = gelu_tanh(gate[t, j]) * up[t, j]     (GeGLU; gelu_tanh(x) = 0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3))),
//                                                   torch's gelu(approximate='tanh')); out may alias gate or up.
void gelu_tanh_mul(const float* gate, const float* up, int64_t n, int64_t inter, float* out);
// out[t, j] = g sigmoid(alpha g) (u + 1), g = min(gate[t, j], limit), u = clamp(up[t, j], -limit, limit)
//                                                  (gpt-oss's clamped SwiGLU); out may alias gate or up; limit > 0.
void clamped_swiglu_mul(const float* gate, const float* up, int64_t n, int64_t inter, float alpha, float limit,
                        float* out);
// x[i] = cap * tanh(x[i] / cap) for i < n, in place (Gemma 2's final logit soft-capping); cap > 0.
void softcap(float* x, int64_t n, float cap);
// x[i] *= s for i < n, in place.
void scale(float* x, int64_t n, float s);
// out[r] = log(sum_i exp(x[r, i]))                                        x: [rows, n], out: [rows]
// (the log-softmax normaliser of a logits row; -inf entries add nothing, a row of -inf gives -inf);
// argmax[r] (when not null): the first index of the row's maximum (0 for a row of -inf or NaN).
void log_sum_exp(const float* x, int64_t rows, int64_t n, float* out, int32_t* argmax = nullptr);

// One layer of the blocked KV pool. k and v each point at num_blocks blocks of block_bytes() bytes:
//   bits 32 (fp32):    [num_kv_heads, block_size_tokens, head_dim] float
//   bits 16, CPU (bf16, round to nearest even; block_size_tokens even):
//                      k: [num_kv_heads, block_size_tokens, head_dim] bf16
//                      v: [num_kv_heads, block_size_tokens / 2, head_dim, 2] bf16: the rows of tokens 2i and 2i + 1
//                         interleaved, i.e. pair rows of 32-bit words (v[2i][d], v[2i + 1][d]), the operand
//                         layout of bf16 dot products over the keys (vdpbf16ps, AMX)
//   bits 16, CUDA:     [num_kv_heads, block_size_tokens, head_dim] in the activation dtype (fp16 / bf16), k and v
//   bits 8 / 4 (int):  [num_kv_heads, block_size_tokens, row_bytes()] quantized rows, then
//                      [num_kv_heads, block_size_tokens, 2] fp16 (scale, zero) of each row
// Quantized rows: per token and KV head, asymmetric over head_dim (lmkit/kv_policy.py gives the exact
// rounding): scale = fp16((max - min) / (2^bits - 1)), zero = fp16(min), x ~ q * scale + zero.
// int8: byte d = q[d].  int4: byte d (< head_dim / 2) = q[d] | q[d + head_dim / 2] << 4.
#ifdef __CUDACC__
#define LMKIT_HOST_DEVICE __host__ __device__
#else
#define LMKIT_HOST_DEVICE
#endif
struct KVLayer {
  void* k = nullptr;
  void* v = nullptr;
  int32_t bits = 32;
  int32_t num_blocks = 0;
  int32_t num_kv_heads = 0;
  int32_t block_size_tokens = 0;
  int32_t head_dim = 0;
  LMKIT_HOST_DEVICE bool is_quantized() const { return bits < 16; }
  LMKIT_HOST_DEVICE int64_t row_bytes() const { return (int64_t)head_dim * bits / 8; }
  LMKIT_HOST_DEVICE int64_t block_bytes() const {
    return (int64_t)num_kv_heads * block_size_tokens * (row_bytes() + (is_quantized() ? 4 : 0));
  }
};
constexpr int kKVQuantMaxHeadDim = 512;  // a bf16 or quantized KV pool: head_dim even and at most this (Gemma 4: 512)

// Writes k, v rows ([n, num_kv_heads, head_dim]) into the pool at slots[t] = block_id * block_size_tokens + offset.
void kv_write(const KVLayer& kv, const float* k, const float* v, const int32_t* slots, int64_t n);

// One sequence of the fused batch, as attention sees it.
struct AttnSeq {
  int32_t q_row = 0;    // first row of this sequence's queries in q / out
  int32_t q_len = 0;    // query rows (prefill chunk length, 1 for a decode step)
  int32_t ctx_len = 0;  // keys in the cache incl. this chunk; query j sits at position ctx_len - q_len + j
  const int32_t* block_table = nullptr;  // ceil(ctx_len / block_size_tokens) block ids, position p -> block p / block_size_tokens
  // The last num_decode_rows query rows (<= q_len) each attend as a decode step at their position would, bit for bit
  // (speculative decoding's draft rows); the rows before them as the chunk they form alone.
  int32_t num_decode_rows = 0;
  // Prompt rows (or rows computed again): all of them on the prefill kernel whatever their number, so that a row's
  // result does not depend on how its prompt was cut into chunks (a chunk of few rows would be decode-shaped).
  bool prefill = false;
};

// Causal paged attention over the blocked KV pool (keys/values of this chunk must already be written).
//   q: [rows, num_heads, head_dim], out: [rows, num_heads, head_dim]
//   query head h reads kv head h / (num_heads / num_kv_heads) (GQA);
//   a query at position p sees keys at positions k <= p, and when sliding_window > 0 only p - k < sliding_window;
//   block_table entries of blocks wholly outside every query's window are never read nor checked (they may be
//   -1: blocks the engine freed early), i.e. blocks holding only keys below ctx_len - q_len - sliding_window + 1.
//   out = softmax(s) V with s = scale * q . K^T, or with logit_softcap > 0 s = cap * tanh(scale * q . K^T / cap)
//   (Gemma 2), computed with an online softmax in fp32. sinks (nullptr: none): [num_heads], a logit per query head
//   that joins each row's softmax and carries no value (gpt-oss): out = softmax([s, sink])[keys] V.
//   Over a bf16 pool on AMX tiles (bf16_amx_available: every task, head_dim and block_size_tokens % 32 == 0), and
//   elsewhere on AVX512_BF16 dot products (bf16_dot_available: tasks of more than 4 rows and prompts where head_dim
//   % 16 == 0, decode tasks where head_dim % 32 == 0), the softmax weights are rounded to bf16 (fp32 sums): up to
//   ~3e-3 relative (per output row; tested at 5e-3) to the exact result over the pool's values. Other tasks and
//   CPUs: fp32 over the pool's values.
//   Batch-invariant: a sequence's rows do not depend on the other sequences of the call, nor on the threads.
void paged_attention(const float* q, const KVLayer& kv, const AttnSeq* seqs, int32_t num_seqs,
                     int32_t num_heads, float scale, int32_t sliding_window, float* out, float logit_softcap = 0.0f,
                     const float* sinks = nullptr);

// --- Gated DeltaNet (Qwen3.5 / Qwen3-Next linear attention) --------------------------------------------
// One sequence's rows of a recurrent layer, and its state: this layer's part of one slot of the state pool.
struct RecurrentSeq {
  int32_t first_row = 0;        // rows [first_row, first_row + num_rows), in order
  int32_t num_rows = 0;
  float* conv_state = nullptr;  // [conv_kernel - 1, channels]: the inputs of the rows before first_row, oldest first
  float* state = nullptr;       // [num_v_heads, k_head_dim, v_head_dim]: each value head's delta-rule matrix S
  // Checkpoints (speculative decoding's rollback): the state as of the end of row t, for t < num_checkpoints, is
  // also written to conv_checkpoints[t] (the window, laid out as conv_state) and state_checkpoints[t] (as state),
  // bit for bit what a call ending at row t leaves in conv_state / state. num_checkpoints <= num_rows.
  int32_t num_checkpoints = 0;
  float* const* conv_checkpoints = nullptr;
  float* const* state_checkpoints = nullptr;
};

// Causal depthwise convolution and SiLU, per sequence, in place:
//   x[t, c] <- silu(sum_j w[j, c] * in[t - K + 1 + j, c])
// where in[t'] is the input row t' of the sequence, and conv_state's rows before its first row; conv_state then
// holds the sequence's last K - 1 inputs (and conv_checkpoints[t] its K - 1 inputs up to row t). x: rows of
// row_stride floats, channels [0, channels) of each; w: [K, channels] (tap-major); K in [1, 8].
void causal_conv1d(float* x, int64_t row_stride, int64_t channels, const float* w, int K, const RecurrentSeq* seqs,
                   int32_t num_seqs);

// The gated delta rule, per sequence and value head h (reading key head h / (Hv / Hk)), rows in order:
//   q <- q / sqrt(|q|^2 + 1e-6) / sqrt(Dk),  k <- k / sqrt(|k|^2 + 1e-6)
//   S <- exp(g[t, h]) S;   u = beta[t, h] (v[t, h] - S^T k);   S <- S + k u^T;   out[t, h] = S^T q
// q, k: Hk heads of Dk floats at q + t * qkv_stride, k + t * qkv_stride; v: Hv heads of Dv at v + t * qkv_stride;
// g, beta: [rows, Hv]; out: Hv heads of Dv at out + t * out_stride. S: [Hv, Dk, Dv] (RecurrentSeq::state), in
// place; S after row t also in state_checkpoints[t] (t < num_checkpoints). Dk, Dv <= 512. Value head h reads key head h / (Hv / Hk) (grouped, as HF stores them), or h % Hk when
// value_heads_tiled (llama.cpp's GGUF order: every value-indexed tensor permuted so that heads repeat as a tile).
void gated_delta_rule(const float* q, const float* k, const float* v, int64_t qkv_stride, const float* g,
                      const float* beta, const RecurrentSeq* seqs, int32_t num_seqs, int num_k_heads, int num_v_heads,
                      int k_head_dim, int v_head_dim, float* out, int64_t out_stride, bool value_heads_tiled);

}  // namespace lmkit::ops
