// The one dispatch point of the CPU backend: the public ops:: functions check their inputs here (at
// the door, in plain C++), then call the kernel table picked once for this CPU. The ISA translation
// units (isa_*.cpp) never check anything themselves: LMKIT_CHECK uses <sstream>, which must not be
// instantiated in code compiled with ISA-specific flags.
#if defined(__linux__) && (defined(__x86_64__) || defined(_M_X64))
#include <cpuid.h>
#include <sys/syscall.h>
#include <unistd.h>
#endif

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <vector>

#include "core/check.h"
#include "kernels/cpu/kernel_table.h"
#include "kernels/ops.h"

namespace lmkit::ops {
namespace cpu {
namespace {

// The widest ISA this process may use: LMKIT_CPU_ISA (avx512, avx2 or generic, read once) caps what the CPU
// has, as oneDNN's ONEDNN_MAX_CPU_ISA and CTranslate2's CT2_FORCE_CPU_ISA do, so that an AVX-512 machine can
// run (and measure) what an AVX2-only CPU runs: its tables, no VNNI, no AVX512_BF16, no AMX. Unset or unknown:
// no cap (lmkit/_ext.py refuses an unknown value before the engine loads).
int isa_rank(const char* isa) {
  if (std::strcmp(isa, "generic") == 0) return 0;
  if (std::strcmp(isa, "avx2") == 0) return 1;
  return 2;  // avx512 and its extensions
}
int isa_ceiling() {
  static const int ceiling = std::getenv("LMKIT_CPU_ISA") ? isa_rank(std::getenv("LMKIT_CPU_ISA")) : 2;
  return ceiling;
}

bool can_run(const char* isa) {
  if (std::strcmp(isa, "generic") == 0) return true;
  if (isa_rank(isa) > isa_ceiling()) return false;
#if defined(__x86_64__) || defined(_M_X64)
  __builtin_cpu_init();
  // __builtin_cpu_supports also checks that the OS saves the wider registers (XCR0).
  if (std::strcmp(isa, "avx2") == 0)
    return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c");
  if (std::strcmp(isa, "avx512") == 0)
    return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
           __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq") &&
           __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c");
  if (std::strcmp(isa, "avx512vnni") == 0)  // an extension of the avx512 table's ISA
    return can_run("avx512") && __builtin_cpu_supports("avx512vnni");
  if (std::strcmp(isa, "avx512bf16") == 0)  // likewise
    return can_run("avx512") && __builtin_cpu_supports("avx512bf16");
#endif
  return false;
}

const KernelTable* best_table() {
  for (const char* isa : {"avx512", "avx2", "generic"})
    if (const KernelTable* t = table_for(isa)) return t;
  return generic_table();
}

std::atomic<const KernelTable*> g_active{nullptr};

}  // namespace

const KernelTable& active() {
  const KernelTable* t = g_active.load(std::memory_order_acquire);
  if (t == nullptr) {
    static const KernelTable* const best = best_table();
    t = best;
    g_active.store(t, std::memory_order_release);
  }
  return *t;
}

namespace {
bool is_float_dtype(DType t) { return t == DType::F32 || t == DType::F16 || t == DType::BF16; }
}  // namespace

void check_weight(const Tensor& w, const char* op, const char* what) {
  LMKIT_CHECK(w.data != nullptr, op, ": ", what, " is empty");
  LMKIT_CHECK(w.device == Device::CPU, op, ": ", what, " must be on the CPU");
  LMKIT_CHECK(is_float_dtype(w.dtype), op, ": ", what, " must be F32, F16 or BF16, got ", dtype_name(w.dtype));
}

const KernelTable* table_for(const char* isa) {
  if (!can_run(isa)) return nullptr;
  if (std::strcmp(isa, "generic") == 0) return generic_table();
#if defined(__x86_64__) || defined(_M_X64)
  if (std::strcmp(isa, "avx2") == 0) return avx2_table();
  if (std::strcmp(isa, "avx512") == 0) return avx512_table();
#endif
  return nullptr;
}

bool force_isa(const char* isa) {
  const KernelTable* t = table_for(isa);
  if (t == nullptr) return false;
  g_active.store(t, std::memory_order_release);
  return true;
}

}  // namespace cpu

const char* cpu_isa() { return cpu::active().name; }

void embedding(const Tensor& table, const int32_t* ids, int64_t num_tokens, float* out) {
  cpu::check_weight(table, "embedding", "table");
  LMKIT_CHECK(table.ndim == 2, "embedding: table must be [vocab, hidden], got ndim ", table.ndim);
  LMKIT_CHECK(num_tokens >= 0, "embedding: num_tokens must be >= 0, got ", num_tokens);
  if (num_tokens == 0) return;
  LMKIT_CHECK(ids != nullptr && out != nullptr, "embedding: ids and out must be non-null");
  for (int64_t t = 0; t < num_tokens; ++t)
    LMKIT_CHECK(ids[t] >= 0 && ids[t] < table.shape[0], "embedding: token id ", ids[t], " at row ", t,
                " is outside the vocabulary [0, ", table.shape[0], ")");
  cpu::active().embedding(table.data, table.dtype, table.shape[1], ids, num_tokens, out);
}

void rmsnorm(const float* x, const Tensor& weight, float eps, int64_t num_rows, int64_t dim, float* out) {
  cpu::check_weight(weight, "rmsnorm", "weight");
  LMKIT_CHECK(weight.ndim == 1 && weight.shape[0] == dim, "rmsnorm: weight must be [", dim, "], got ndim ",
              weight.ndim, " shape[0] ", weight.shape[0]);
  LMKIT_CHECK(num_rows >= 0 && dim > 0, "rmsnorm: bad shape [", num_rows, ", ", dim, "]");
  if (num_rows == 0) return;
  LMKIT_CHECK(x != nullptr && out != nullptr, "rmsnorm: x and out must be non-null");
  cpu::active().rmsnorm(x, weight.data, weight.dtype, eps, num_rows, dim, out);
}

void add_rmsnorm(float* residual, const float* x, const Tensor& weight, float eps, int64_t num_rows, int64_t dim,
                 float* out) {
  cpu::check_weight(weight, "add_rmsnorm", "weight");
  LMKIT_CHECK(weight.ndim == 1 && weight.shape[0] == dim, "add_rmsnorm: weight must be [", dim, "], got ndim ",
              weight.ndim, " shape[0] ", weight.shape[0]);
  LMKIT_CHECK(num_rows >= 0 && dim > 0, "add_rmsnorm: bad shape [", num_rows, ", ", dim, "]");
  if (num_rows == 0) return;
  LMKIT_CHECK(residual != nullptr && x != nullptr && out != nullptr,
              "add_rmsnorm: residual, x and out must be non-null");
  cpu::active().add_rmsnorm(residual, x, weight.data, weight.dtype, eps, num_rows, dim, out);
}

namespace cpu {
// The table whose int8-activation kernels run here: the active one, except that the AVX-512 kernels
// need VNNI too; on an AVX-512 CPU without it the AVX2 kernels (vpmaddubsw) do the work. nullptr: none.
const KernelTable* q8_table() {
  static const bool has_vnni = can_run("avx512vnni");
  const KernelTable& t = active();
  if (t.linear_int4_q8 == nullptr) return nullptr;
  if (std::strcmp(t.name, "avx512") != 0 || has_vnni) return &t;
  return table_for("avx2");
}
}  // namespace cpu

bool int8_dot_available() { return cpu::q8_table() != nullptr; }

namespace cpu {
// The table with the bf16 dot-product kernel: the avx512 one on a CPU with AVX512_BF16 (whichever table
// is active for the other ops), else nullptr.
const KernelTable* bf16_table() {
  static const bool has_bf16 = can_run("avx512bf16");
  return has_bf16 ? table_for("avx512") : nullptr;
}
}  // namespace cpu

namespace cpu {
namespace {
// AMX-TILE and AMX-BF16 (CPUID leaf 7: EDX bits 24 and 22), and the tile registers granted to this
// process: Linux hands them out per process on request (arch_prctl ARCH_REQ_XCOMP_PERM for
// XFEATURE_XTILEDATA); a tile instruction without that grant is SIGILL.
bool request_amx() {
#if defined(__linux__) && (defined(__x86_64__) || defined(_M_X64))
  unsigned a = 0, b = 0, c = 0, d = 0;
  if (!__get_cpuid_count(7, 0, &a, &b, &c, &d) || !(d & (1u << 24)) || !(d & (1u << 22))) return false;
  constexpr long kArchReqXcompPerm = 0x1023, kXfeatureXtiledata = 18;
  return syscall(SYS_arch_prctl, kArchReqXcompPerm, kXfeatureXtiledata) == 0;
#else
  return false;
#endif
}

// The AMX kernel of the bf16 table, when this build has one and the process may use it, else nullptr.
const KernelTable* amx_table() {
  static const KernelTable* const t = [] {
    const KernelTable* bt = bf16_table();
    return bt != nullptr && bt->linear_bf16_amx != nullptr && request_amx() ? bt : nullptr;
  }();
  return t;
}
// The AMX-INT8 kernel of the avx512 table (CPUID leaf 7 EDX bit 25, with VNNI for its quantization of x),
// when this build has one and the process may use the tiles, else nullptr.
const KernelTable* amx_int8_table() {
  static const KernelTable* const t = []() -> const KernelTable* {
    unsigned a = 0, b = 0, c = 0, d = 0;
    if (!can_run("avx512vnni") || !__get_cpuid_count(7, 0, &a, &b, &c, &d) || !(d & (1u << 25))) return nullptr;
    const KernelTable* at = table_for("avx512");
    return at != nullptr && at->linear_int4_amx != nullptr && request_amx() ? at : nullptr;
  }();
  return t;
}
std::atomic<bool> g_amx_enabled{true};
std::atomic<bool> g_bf16_attention_enabled{true};
std::atomic<bool> g_int8_attention_enabled{true};
}  // namespace

const KernelTable* amx_table_in_use() {
  return g_amx_enabled.load(std::memory_order_relaxed) ? amx_table() : nullptr;
}
// The tiles quantize x as the avx512 table's VNNI kernel does and give its bits: they stand in for it only where it
// is the int8 kernel in use (not under force_isa("avx2"), whose kernels quantize x per 32 values).
const KernelTable* amx_int8_table_usable() {
  const KernelTable* t = amx_int8_table();
  return t != nullptr && q8_table() == t ? t : nullptr;
}
const KernelTable* amx_int8_table_in_use() {
  return g_amx_enabled.load(std::memory_order_relaxed) ? amx_int8_table_usable() : nullptr;
}

bool use_bf16_attention(bool enabled) {
  g_bf16_attention_enabled.store(enabled, std::memory_order_relaxed);
  return enabled && bf16_table() != nullptr && bf16_table()->paged_attention_bf16 != nullptr;
}

// The table with the VNNI attention kernel over int8 / int4 pools: the active one when it is the avx512 table and
// the CPU has VNNI (an AVX2 cap or force_isa("avx2") runs the fp32 kernel), else nullptr.
const KernelTable* int8_attention_table() {
  static const bool has_vnni = can_run("avx512vnni");
  const KernelTable& t = active();
  return has_vnni && t.paged_attention_q8 != nullptr && std::strcmp(t.name, "avx512") == 0 ? &t : nullptr;
}

bool use_int8_attention(bool enabled) {
  g_int8_attention_enabled.store(enabled, std::memory_order_relaxed);
  return enabled && int8_attention_table() != nullptr;
}

bool use_amx(bool enabled) {
  g_amx_enabled.store(enabled, std::memory_order_relaxed);
  return enabled && (amx_table() != nullptr || amx_int8_table_usable() != nullptr);
}
}  // namespace cpu

bool bf16_dot_available() { return cpu::bf16_table() != nullptr; }
bool bf16_amx_available() { return cpu::amx_table() != nullptr; }
bool int8_amx_available() { return cpu::amx_int8_table_usable() != nullptr; }

void require_bf16_dot() {
  LMKIT_CHECK_ARG(bf16_dot_available(), "dtype='bfloat16' needs a CPU with AVX-512 and AVX512_BF16 (Intel Cooper "
                  "Lake / Sapphire Rapids or later, AMD Zen 4 or later); this one has none: use dtype='float32'");
}


void rope(float* q, float* k, const int32_t* positions, int64_t n, int num_heads, int num_kv_heads, int head_dim,
          const float* inv_freq, float attention_scaling, int rotary_dim) {
  LMKIT_CHECK(n >= 0 && num_heads >= 0 && num_kv_heads >= 0, "rope: bad shape n ", n, " heads ", num_heads,
              " kv heads ", num_kv_heads);
  LMKIT_CHECK(head_dim > 0 && head_dim % 2 == 0 && head_dim <= 1024,
              "rope: head_dim must be even and in [2, 1024], got ", head_dim);
  LMKIT_CHECK(rotary_dim == 0 || (rotary_dim > 0 && rotary_dim % 2 == 0 && rotary_dim <= head_dim),
              "rope: rotary_dim must be 0 (all of head_dim) or even and in [2, head_dim = ", head_dim, "], got ",
              rotary_dim);
  if (n == 0) return;
  LMKIT_CHECK(positions != nullptr && inv_freq != nullptr, "rope: positions and inv_freq must be non-null");
  LMKIT_CHECK((q != nullptr || num_heads == 0) && (k != nullptr || num_kv_heads == 0),
              "rope: q and k must be non-null");
  cpu::active().rope(q, k, positions, n, num_heads, num_kv_heads, head_dim, inv_freq, attention_scaling,
                     rotary_dim == 0 ? head_dim : rotary_dim);
}

void silu_mul(const float* gate, const float* up, int64_t n, int64_t inter, float* out) {
  LMKIT_CHECK(n >= 0 && inter >= 0, "silu_mul: bad shape [", n, ", ", inter, "]");
  if (n == 0 || inter == 0) return;
  LMKIT_CHECK(gate != nullptr && up != nullptr && out != nullptr, "silu_mul: gate, up and out must be non-null");
  cpu::active().silu_mul(gate, up, n, inter, out);
}

void gelu_tanh_mul(const float* gate, const float* up, int64_t n, int64_t inter, float* out) {
  LMKIT_CHECK(n >= 0 && inter >= 0, "gelu_tanh_mul: bad shape [", n, ", ", inter, "]");
  if (n == 0 || inter == 0) return;
  LMKIT_CHECK(gate != nullptr && up != nullptr && out != nullptr, "gelu_tanh_mul: gate, up and out must be non-null");
  cpu::active().gelu_tanh_mul(gate, up, n, inter, out);
}

void clamped_swiglu_mul(const float* gate, const float* up, int64_t n, int64_t inter, float alpha, float limit,
                        float* out) {
  LMKIT_CHECK(n >= 0 && inter >= 0, "clamped_swiglu_mul: bad shape [", n, ", ", inter, "]");
  LMKIT_CHECK(limit > 0.0f && std::isfinite(alpha), "clamped_swiglu_mul: limit must be > 0, got ", limit);
  if (n == 0 || inter == 0) return;
  LMKIT_CHECK(gate != nullptr && up != nullptr && out != nullptr,
              "clamped_swiglu_mul: gate, up and out must be non-null");
  cpu::active().clamped_swiglu_mul(gate, up, n, inter, alpha, limit, out);
}

void softcap(float* x, int64_t n, float cap) {
  LMKIT_CHECK(cap > 0.0f && std::isfinite(cap), "softcap: cap must be finite and > 0, got ", cap);
  LMKIT_CHECK(n >= 0, "softcap: n must be >= 0, got ", n);
  if (n == 0) return;
  LMKIT_CHECK(x != nullptr, "softcap: x must be non-null");
  cpu::active().softcap(x, n, cap);
}

void scale(float* x, int64_t n, float s) {
  LMKIT_CHECK(n >= 0, "scale: n must be >= 0, got ", n);
  if (n == 0) return;
  LMKIT_CHECK(x != nullptr, "scale: x must be non-null");
  cpu::active().scale(x, n, s);
}

void log_sum_exp(const float* x, int64_t rows, int64_t n, float* out, int32_t* argmax) {
  LMKIT_CHECK(rows >= 0 && n > 0 && n <= INT32_MAX, "log_sum_exp: bad shape [", rows, ", ", n, "]");
  if (rows == 0) return;
  LMKIT_CHECK(x != nullptr && out != nullptr, "log_sum_exp: x and out must be non-null");
  cpu::active().log_sum_exp(x, rows, n, out, argmax);
}

namespace {
void check_kv(const KVLayer& kv, const char* op) {
  LMKIT_CHECK(kv.k != nullptr && kv.v != nullptr, op, ": KV layer has no k/v storage");
  LMKIT_CHECK(kv.num_blocks > 0 && kv.num_kv_heads > 0 && kv.block_size_tokens > 0, op, ": bad KV layer (blocks ",
              kv.num_blocks, ", kv heads ", kv.num_kv_heads, ", block_size_tokens ", kv.block_size_tokens, ")");
  LMKIT_CHECK(kv.head_dim > 0 && kv.head_dim <= 1024, op, ": head_dim must be in [1, 1024], got ", kv.head_dim);
  LMKIT_CHECK(kv.bits == 32 || kv.bits == 16 || kv.bits == 8 || kv.bits == 4, op,
              ": KV bits must be 32 (fp32), 16 (bf16), 8 or 4, got ", kv.bits);
  LMKIT_CHECK(kv.bits == 32 || (kv.head_dim % 2 == 0 && kv.head_dim <= kKVQuantMaxHeadDim), op,
              ": a bf16 or quantized KV cache needs an even head_dim <= ", kKVQuantMaxHeadDim, ", got ", kv.head_dim);
  LMKIT_CHECK(kv.bits != 16 || kv.block_size_tokens % 2 == 0, op,
              ": a bf16 KV cache stores V by token pairs: block_size_tokens must be even, got ", kv.block_size_tokens);
}
}  // namespace

void kv_write(const KVLayer& kv, const float* k, const float* v, const int32_t* slots, int64_t n) {
  check_kv(kv, "kv_write");
  LMKIT_CHECK(n >= 0, "kv_write: n must be >= 0, got ", n);
  if (n == 0) return;
  LMKIT_CHECK(k != nullptr && v != nullptr && slots != nullptr, "kv_write: k, v and slots must be non-null");
  const int64_t num_slots = (int64_t)kv.num_blocks * kv.block_size_tokens;
  for (int64_t t = 0; t < n; ++t)
    LMKIT_CHECK(slots[t] < num_slots, "kv_write: slot ", slots[t], " of row ", t, " is outside the pool (",
                num_slots, " slots)");
  cpu::active().kv_write(kv, k, v, slots, n);
}

void paged_attention(const float* q, const KVLayer& kv, const AttnSeq* seqs, int32_t num_seqs, int32_t num_heads,
                     float scale, int32_t sliding_window, float* out, float logit_softcap, const float* sinks) {
  check_kv(kv, "paged_attention");
  LMKIT_CHECK(logit_softcap >= 0.0f && std::isfinite(logit_softcap),
              "paged_attention: logit_softcap must be 0 (off) or finite and > 0, got ", logit_softcap);
  LMKIT_CHECK(sliding_window >= 0, "paged_attention: sliding_window must be >= 0 (0: none), got ", sliding_window);
  LMKIT_CHECK(num_seqs >= 0, "paged_attention: num_seqs must be >= 0, got ", num_seqs);
  LMKIT_CHECK(num_heads > 0 && num_heads % kv.num_kv_heads == 0, "paged_attention: num_heads ", num_heads,
              " must be a positive multiple of num_kv_heads ", kv.num_kv_heads);
  if (num_seqs == 0) return;
  LMKIT_CHECK(q != nullptr && out != nullptr && seqs != nullptr, "paged_attention: q, out and seqs must be non-null");
  for (int32_t s = 0; s < num_seqs; ++s) {
    const AttnSeq& a = seqs[s];
    LMKIT_CHECK(a.q_len >= 0 && a.q_row >= 0 && a.q_len <= a.ctx_len, "paged_attention: sequence ", s,
                " has q_len ", a.q_len, ", q_row ", a.q_row, ", ctx_len ", a.ctx_len, " (need 0 <= q_len <= ctx_len)");
    LMKIT_CHECK(a.num_decode_rows >= 0 && a.num_decode_rows <= a.q_len, "paged_attention: sequence ", s, " has ",
                a.num_decode_rows, " decode rows of its ", a.q_len);
    if (a.q_len == 0) continue;
    LMKIT_CHECK(a.block_table != nullptr, "paged_attention: sequence ", s, " has no block table");
    // the blocks some query's window reaches: keys from the first query's window start to ctx_len - 1 (the
    // entries before may be -1, blocks the engine freed, and are never read)
    const int64_t first_pos = (int64_t)a.ctx_len - a.q_len;
    const int64_t first_key = sliding_window > 0 ? std::max<int64_t>(0, first_pos - sliding_window + 1) : 0;
    const int64_t num_used = ((int64_t)a.ctx_len + kv.block_size_tokens - 1) / kv.block_size_tokens;
    for (int64_t b = first_key / kv.block_size_tokens; b < num_used; ++b)
      LMKIT_CHECK(a.block_table[b] >= 0 && a.block_table[b] < kv.num_blocks, "paged_attention: sequence ", s,
                  " block_table[", b, "] = ", a.block_table[b], " is outside the pool (", kv.num_blocks,
                  " blocks), and keys ", first_key, "..", a.ctx_len - 1, " of its queries' windows need it");
  }
  // decode rows: each a one-row sequence at its position, the rows before them one chunk
  thread_local std::vector<AttnSeq> split;
  if (std::any_of(seqs, seqs + num_seqs, [](const AttnSeq& a) { return a.num_decode_rows > 0; })) {
    split.clear();
    for (int32_t s = 0; s < num_seqs; ++s) {
      AttnSeq chunk = seqs[s];
      const int32_t d = chunk.num_decode_rows;
      chunk.q_len -= d;
      chunk.ctx_len -= d;
      chunk.num_decode_rows = 0;
      if (chunk.q_len > 0 || d == 0) split.push_back(chunk);
      for (int32_t j = 0; j < d; ++j) split.push_back(AttnSeq{chunk.q_row + chunk.q_len + j, 1, chunk.ctx_len + j + 1,
                                                              chunk.block_table, 0});
    }
    seqs = split.data();
    num_seqs = (int32_t)split.size();
  }
  // the cheap conditions first: amx_table() asks the OS for the tile registers on its first call
  const bool tiles_fit = kv.bits == 16 && kv.head_dim % 32 == 0 && kv.block_size_tokens % 32 == 0;
  const cpu::KernelTable* amx =
      tiles_fit && cpu::g_amx_enabled.load(std::memory_order_relaxed) ? cpu::amx_table() : nullptr;
  const cpu::KernelTable* bf16 =
      kv.bits == 16 && cpu::g_bf16_attention_enabled.load(std::memory_order_relaxed) ? cpu::bf16_table() : nullptr;
  const cpu::KernelTable* int8 = kv.bits <= 8 && cpu::g_int8_attention_enabled.load(std::memory_order_relaxed)
                                     ? cpu::int8_attention_table()
                                     : nullptr;
  if (int8 != nullptr)
    int8->paged_attention_q8(q, kv, seqs, num_seqs, num_heads, scale, sliding_window, out, logit_softcap, sinks);
  else if (amx != nullptr && amx->paged_attention_amx != nullptr)
    amx->paged_attention_amx(q, kv, seqs, num_seqs, num_heads, scale, sliding_window, out, logit_softcap, sinks);
  else if (bf16 != nullptr && bf16->paged_attention_bf16 != nullptr)
    bf16->paged_attention_bf16(q, kv, seqs, num_seqs, num_heads, scale, sliding_window, out, logit_softcap, sinks);
  else
    cpu::active().paged_attention(q, kv, seqs, num_seqs, num_heads, scale, sliding_window, out, logit_softcap, sinks);
}

namespace {
void check_recurrent_seqs(const RecurrentSeq* seqs, int32_t num_seqs, bool needs_conv, bool needs_state,
                          const char* op) {
  LMKIT_CHECK(num_seqs >= 0 && (num_seqs == 0 || seqs != nullptr), op, ": ", num_seqs, " sequences at ",
              (const void*)seqs);
  for (int32_t s = 0; s < num_seqs; ++s) {
    const RecurrentSeq& r = seqs[s];
    LMKIT_CHECK(r.first_row >= 0 && r.num_rows >= 0, op, ": sequence ", s, " has rows [", r.first_row, ", +",
                r.num_rows, ")");
    LMKIT_CHECK(!needs_conv || r.conv_state != nullptr, op, ": sequence ", s, " has no convolution state");
    LMKIT_CHECK(!needs_state || r.state != nullptr, op, ": sequence ", s, " has no delta-rule state");
    LMKIT_CHECK(r.num_checkpoints >= 0 && r.num_checkpoints <= r.num_rows, op, ": sequence ", s, " has ",
                r.num_checkpoints, " checkpoints for ", r.num_rows, " rows");
    for (int32_t t = 0; t < r.num_checkpoints; ++t)
      LMKIT_CHECK((!needs_conv || (r.conv_checkpoints != nullptr && r.conv_checkpoints[t] != nullptr)) &&
                      (!needs_state || (r.state_checkpoints != nullptr && r.state_checkpoints[t] != nullptr)),
                  op, ": sequence ", s, " has no memory for checkpoint ", t);
  }
}
}  // namespace

void causal_conv1d(float* x, int64_t row_stride, int64_t channels, const float* w, int K, const RecurrentSeq* seqs,
                   int32_t num_seqs) {
  LMKIT_CHECK(K >= 1 && K <= 8, "causal_conv1d: kernel size must be in [1, 8], got ", K);
  LMKIT_CHECK(channels > 0 && row_stride >= channels, "causal_conv1d: ", channels, " channels in rows of ",
              row_stride);
  check_recurrent_seqs(seqs, num_seqs, K > 1, false, "causal_conv1d");
  if (num_seqs == 0) return;
  LMKIT_CHECK(x != nullptr && w != nullptr, "causal_conv1d: x and w must be non-null");
  cpu::active().causal_conv1d(x, row_stride, channels, w, K, seqs, num_seqs);
}

void gated_delta_rule(const float* q, const float* k, const float* v, int64_t qkv_stride, const float* g,
                      const float* beta, const RecurrentSeq* seqs, int32_t num_seqs, int num_k_heads, int num_v_heads,
                      int k_head_dim, int v_head_dim, float* out, int64_t out_stride, bool value_heads_tiled) {
  LMKIT_CHECK(num_k_heads > 0 && num_v_heads > 0 && num_v_heads % num_k_heads == 0, "gated_delta_rule: ",
              num_v_heads, " value heads must be a positive multiple of ", num_k_heads, " key heads");
  LMKIT_CHECK(k_head_dim > 0 && k_head_dim <= 512 && v_head_dim > 0 && v_head_dim <= 512,
              "gated_delta_rule: head dims must be in [1, 512], got ", k_head_dim, " and ", v_head_dim);
  LMKIT_CHECK(out_stride >= (int64_t)num_v_heads * v_head_dim, "gated_delta_rule: out rows of ", out_stride,
              " floats hold fewer than ", num_v_heads, " x ", v_head_dim);
  check_recurrent_seqs(seqs, num_seqs, false, true, "gated_delta_rule");
  if (num_seqs == 0) return;
  LMKIT_CHECK(q && k && v && g && beta && out, "gated_delta_rule: q, k, v, g, beta and out must be non-null");
  cpu::active().gated_delta_rule(q, k, v, qkv_stride, g, beta, seqs, num_seqs, num_k_heads, num_v_heads, k_head_dim,
                                 v_head_dim, out, out_stride, value_heads_tiled);
}

}  // namespace lmkit::ops
