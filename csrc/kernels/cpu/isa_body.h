// The body of one ISA translation unit. Before including it, isa_<name>.cpp includes isa_prelude.h
// and defines LMKIT_ISA (the namespace, e.g. avx512) and LMKIT_ISA_TABLE (e.g. avx512_table).
// All kernels land in an anonymous namespace inside lmkit::ops::cpu::LMKIT_ISA: internal linkage, one
// copy per ISA, so the linker can never mix code compiled for different instruction sets.

namespace lmkit::ops::cpu {
namespace LMKIT_ISA {
namespace {
#include "kernels/cpu/simd.h"
#include "kernels/cpu/parallel.h"
#include "kernels/cpu/impl_elementwise.h"
#include "kernels/cpu/impl_linear.h"
#include "kernels/cpu/impl_linear_bf16.h"
#include "kernels/cpu/impl_linear_q8_amx.h"
#include "kernels/cpu/impl_attention.h"
#include "kernels/cpu/impl_attention_bf16.h"
#include "kernels/cpu/impl_attention_amx.h"
#include "kernels/cpu/impl_attention_q8.h"
#include "kernels/cpu/impl_recurrent.h"
}  // namespace
}  // namespace LMKIT_ISA

#if defined(__AVX512F__) || defined(__AVX2__)
#define LMKIT_ISA_Q8 &LMKIT_ISA::linear_int4_q8, &LMKIT_ISA::linear_int8_q8, &LMKIT_ISA::linear_int6_q8
#else
#define LMKIT_ISA_Q8 nullptr, nullptr, nullptr
#endif
#if defined(__AVX512F__) && defined(LMKIT_HAVE_AMX)
#define LMKIT_ISA_BF16 &LMKIT_ISA::linear_bf16, &LMKIT_ISA::linear_bf16_amx
#define LMKIT_ISA_Q8_AMX &LMKIT_ISA::linear_int4_amx
#define LMKIT_ISA_ATTN_EXT \
  &LMKIT_ISA::paged_attention_bf16, &LMKIT_ISA::paged_attention_amx, &LMKIT_ISA::paged_attention_q8
#elif defined(__AVX512F__)
#define LMKIT_ISA_BF16 &LMKIT_ISA::linear_bf16, nullptr
#define LMKIT_ISA_Q8_AMX nullptr
#define LMKIT_ISA_ATTN_EXT &LMKIT_ISA::paged_attention_bf16, nullptr, &LMKIT_ISA::paged_attention_q8
#else
#define LMKIT_ISA_BF16 nullptr, nullptr
#define LMKIT_ISA_Q8_AMX nullptr
#define LMKIT_ISA_ATTN_EXT nullptr, nullptr, nullptr
#endif

const KernelTable* LMKIT_ISA_TABLE() {
  static const KernelTable table = {
      LMKIT_ISA_NAME,         &LMKIT_ISA::embedding, &LMKIT_ISA::rmsnorm, &LMKIT_ISA::add_rmsnorm,
      &LMKIT_ISA::linear,     &LMKIT_ISA::linear_int4, &LMKIT_ISA::linear_int8, &LMKIT_ISA::linear_int6, LMKIT_ISA_Q8, LMKIT_ISA_Q8_AMX, LMKIT_ISA_BF16,
      &LMKIT_ISA::rope,
      &LMKIT_ISA::silu_mul,   &LMKIT_ISA::gelu_tanh_mul, &LMKIT_ISA::clamped_swiglu_mul, &LMKIT_ISA::softcap, &LMKIT_ISA::scale,
      &LMKIT_ISA::log_sum_exp, &LMKIT_ISA::kv_write,
      &LMKIT_ISA::paged_attention, &LMKIT_ISA::causal_conv1d, &LMKIT_ISA::gated_delta_rule, LMKIT_ISA_ATTN_EXT,
  };
  return &table;
}

}  // namespace lmkit::ops::cpu
