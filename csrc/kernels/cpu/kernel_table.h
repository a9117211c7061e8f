// The CPU kernel table: one struct of function pointers per instruction set, chosen once at run time
// by dispatch.cpp. Entries take raw pointers (weights as data + dtype) so the ISA translation units
// never touch the C++ standard library (see isa_body.h for why). Shapes and dtypes are already
// checked when an entry is called.
#pragma once
#include <stdint.h>

#include "kernels/ops.h"

namespace lmkit::ops::cpu {

struct KernelTable {
  const char* name;  // "avx512", "avx2" or "generic"
  // out[t, :] = table[ids[t], :]                        table: [*, hidden] of dtype
  void (*embedding)(const void* table, DType dtype, int64_t hidden, const int32_t* ids, int64_t num_tokens,
                    float* out);
  void (*rmsnorm)(const float* x, const void* weight, DType wdtype, float eps, int64_t num_rows, int64_t dim,
                  float* out);
  void (*add_rmsnorm)(float* residual, const float* x, const void* weight, DType wdtype, float eps,
                      int64_t num_rows, int64_t dim, float* out);
  // out[M, N] = x[M, K] @ w[N, K]^T (+ bias[N] when bias != nullptr; fp32, converted at the door);
  // w in the packed panel layout of ops::LinearWeight
  void (*linear)(const float* x, int64_t M, const void* w, DType wdtype, int64_t N, int64_t K, const float* bias,
                 float* out);
  // the same for an int4 weight (ops::LinearWeight int4 panels, group size g, group heads of form `head`)
  void (*linear_int4)(const float* x, int64_t M, const void* w, int64_t N, int64_t K, int64_t g, GroupHead head,
                      const float* bias, float* out);
  // the same for int8 panels (ops::LinearWeight Int8, blocks of g = 32 or 16, heads of form `head`), fp32
  // activations: the exact product
  void (*linear_int8)(const float* x, int64_t M, const void* w, int64_t N, int64_t K, int64_t g, GroupHead head,
                      const float* bias, float* out);
  // the same for int6 panels (ops::LinearWeight Int6, super-blocks of 256), fp32 activations: the exact product
  void (*linear_int6)(const float* x, int64_t M, const void* w, int64_t N, int64_t K, const float* bias, float* out);
  // the same with activations quantized to int8 per 32 values and integer dot products (AVX2, AVX-512 VNNI);
  // nullptr where this ISA has none; the avx512 ones also need VNNI (dispatch.cpp q8_table picks)
  void (*linear_int4_q8)(const float* x, int64_t M, const void* w, int64_t N, int64_t K, int64_t g, GroupHead head,
                         const float* bias, float* out);
  // out = x @ w^T (+ bias) for int8 panels (pack_linear_int8), int8 activations; nullptr as above
  void (*linear_int8_q8)(const float* x, int64_t M, const void* w, int64_t N, int64_t K, int64_t g, GroupHead head,
                         const float* bias, float* out);
  // out = x @ w^T (+ bias) for int6 panels, int8 activations; nullptr as above
  void (*linear_int6_q8)(const float* x, int64_t M, const void* w, int64_t N, int64_t K, const float* bias,
                         float* out);
  // linear_int4_q8 on AMX tiles (AMX-INT8; GroupHead::Zeros and Symmetric only); nullptr where this build has none;
  // dispatch.cpp calls it only once the process may use the tile registers
  void (*linear_int4_amx)(const float* x, int64_t M, const void* w, int64_t N, int64_t K, int64_t g, GroupHead head,
                          const float* bias, float* out);
  // out = x @ w^T (+ bias) for bf16 pair panels (pack_linear_bf16): x rounded to bf16, vdpbf16ps; nullptr
  // where this ISA has none; the avx512 one also needs AVX512_BF16 (dispatch.cpp checks)
  void (*linear_bf16)(const float* x, int64_t M, const void* w, int64_t N, int64_t K, const float* bias,
                      float* out);
  // the same on AMX tiles (AMX-BF16); nullptr where this build has none; dispatch.cpp calls it only once the
  // process may use the tile registers
  void (*linear_bf16_amx)(const float* x, int64_t M, const void* w, int64_t N, int64_t K, const float* bias,
                          float* out);
  // rotary_dim: resolved at the door (0 -> head_dim), even and <= head_dim
  void (*rope)(float* q, float* k, const int32_t* positions, int64_t n, int num_heads, int num_kv_heads,
               int head_dim, const float* inv_freq, float attention_scaling, int rotary_dim);
  void (*silu_mul)(const float* gate, const float* up, int64_t n, int64_t inter, float* out);
  void (*gelu_tanh_mul)(const float* gate, const float* up, int64_t n, int64_t inter, float* out);
  void (*clamped_swiglu_mul)(const float* gate, const float* up, int64_t n, int64_t inter, float alpha, float limit,
                             float* out);
  void (*softcap)(float* x, int64_t n, float cap);  // cap > 0
  void (*scale)(float* x, int64_t n, float s);
  void (*log_sum_exp)(const float* x, int64_t rows, int64_t n, float* out, int32_t* argmax);
  void (*kv_write)(const KVLayer& kv, const float* k, const float* v, const int32_t* slots, int64_t n);
  // logit_softcap 0: no soft-capping. Reads the block table only over the keys some query's window reaches.
  void (*paged_attention)(const float* q, const KVLayer& kv, const AttnSeq* seqs, int32_t num_seqs,
                          int32_t num_heads, float scale, int32_t sliding_window, float* out, float logit_softcap,
                          const float* sinks);
  // Gated DeltaNet (ops.h): the short convolution and the delta rule, per sequence of the batch
  void (*causal_conv1d)(float* x, int64_t row_stride, int64_t channels, const float* w, int K,
                        const RecurrentSeq* seqs, int32_t num_seqs);
  void (*gated_delta_rule)(const float* q, const float* k, const float* v, int64_t qkv_stride, const float* g,
                           const float* beta, const RecurrentSeq* seqs, int32_t num_seqs, int num_k_heads,
                           int num_v_heads, int k_head_dim, int v_head_dim, float* out, int64_t out_stride,
                           bool value_heads_tiled);
  // paged_attention over a bf16 pool (bits 16) with prefill tasks on AVX512_BF16 dot products (P rounded to bf16);
  // nullptr where this build has none; dispatch.cpp calls it only where the CPU has AVX512_BF16
  void (*paged_attention_bf16)(const float* q, const KVLayer& kv, const AttnSeq* seqs, int32_t num_seqs,
                               int32_t num_heads, float scale, int32_t sliding_window, float* out,
                               float logit_softcap, const float* sinks);
  // the same over a bf16 pool (bits 16) with every task on AMX tiles; nullptr where this build has none;
  // dispatch.cpp calls it only once the process may use the tiles, for head_dim and block_size_tokens % 32 == 0
  void (*paged_attention_amx)(const float* q, const KVLayer& kv, const AttnSeq* seqs, int32_t num_seqs,
                              int32_t num_heads, float scale, int32_t sliding_window, float* out,
                              float logit_softcap, const float* sinks);
  // paged_attention over an int8 / int4 pool (bits 8, 4) with decode tasks on VNNI integer dot products; nullptr
  // where this build has none; dispatch.cpp calls it only where the CPU has AVX512-VNNI and this table is active
  void (*paged_attention_q8)(const float* q, const KVLayer& kv, const AttnSeq* seqs, int32_t num_seqs,
                             int32_t num_heads, float scale, int32_t sliding_window, float* out,
                             float logit_softcap, const float* sinks);
};

// Tables of the instruction sets compiled into this build (isa_*.cpp). Call only when the CPU has the ISA.
const KernelTable* generic_table();
#if defined(__x86_64__) || defined(_M_X64)
const KernelTable* avx2_table();
const KernelTable* avx512_table();
#endif

// Hidden hooks for tests and benchmarks: the table named `isa` when this CPU can run it, else nullptr;
// force_isa makes every ops:: call use that table (false, and nothing changes, when it cannot run here).
const KernelTable* table_for(const char* isa);
bool force_isa(const char* isa);
// Whether linear layers (bf16 pairs; int4 x int8) and attention over a bf16 KV cache may use AMX tiles
// (default: yes, where the CPU and OS allow); returns whether some will. For tests and benchmarks.
bool use_amx(bool enabled);
// Whether prefill tasks of attention over a bf16 KV cache may use AVX512_BF16 dot products where AMX does not
// take them (default: yes, where the CPU has them; else fp32 FMAs over converted rows); returns whether they
// will. For tests and benchmarks.
bool use_bf16_attention(bool enabled);
// Whether decode tasks of attention over an int8 / int4 KV cache may use VNNI integer dot products (default: yes,
// where the CPU has them and the avx512 table is active; else fp32 FMAs over widened levels); returns whether they
// will. For tests and benchmarks.
bool use_int8_attention(bool enabled);

// dispatch.cpp's choices of table, for the ops:: entry points defined in other files (linear_formats.cpp).
const KernelTable& active();              // the table of this CPU (or the one force_isa chose)
const KernelTable* q8_table();            // int8-activation kernels (AVX2, or AVX-512 with VNNI), else nullptr
const KernelTable* bf16_table();          // bf16 dot-product kernels (AVX512_BF16), else nullptr
const KernelTable* int8_attention_table();  // VNNI attention over int8 / int4 pools (avx512 active), else nullptr
const KernelTable* amx_table_in_use();    // AMX tiles for bf16 linear layers, when allowed (use_amx), else nullptr
const KernelTable* amx_int8_table_in_use();  // AMX tiles for int4 x int8 linear layers, when allowed, else nullptr
// Throws naming op and what unless w is a non-empty F32/F16/BF16 tensor on the CPU.
void check_weight(const Tensor& w, const char* op, const char* what);

}  // namespace lmkit::ops::cpu
