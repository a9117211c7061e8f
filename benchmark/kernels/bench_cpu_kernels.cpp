// Micro-benchmark of the CPU kernels (ops.h) at SmolLM2-135M shapes, plus a streaming-read bandwidth
// probe to compare the decode GEMV against. Build and run with ./run.sh [isa] [threads] [section];
// section "smoke" runs everything once in seconds (built and run by ctest so that it cannot rot).
#if defined(__GNUC__) && !defined(__clang__)  // GCC bug 105593: false positives inside its AVX-512 headers
#pragma GCC diagnostic ignored "-Wuninitialized"
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#endif
#include <immintrin.h>
#include <sys/mman.h>

#include <algorithm>
#include <ctime>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <memory>
#include <numeric>
#include <random>
#include <vector>

#include "kernels/cpu/kernel_table.h"
#include "kernels/cpu/thread_pool.h"
#include "kernels/ops.h"
#include "model/int4_layouts.h"

using namespace lmkit;

namespace {

// An AWQ GEMM weight packed as the engine packs one (through its layout's Int4Source).
ops::LinearWeight pack_awq(const Tensor& qw, const Tensor& qz, const Tensor& sc, int64_t g) {
  Int4Tensors t;
  t.layout = Int4Layout::AwqGemm;
  t.values = qw, t.zeros = qz, t.scales = sc;
  return ops::pack_linear_int4(int4_source(t, qw.shape[1] * 8, qw.shape[0], g, "bench"));
}
#include "kernels/cpu/parallel.h"

// Fastest of `reps` runs after one warm-up, in seconds (the minimum: this machine may be shared;
// LMKIT_BENCH_STAT=median or mean reports that instead, closer to what a model step sees).
// With LMKIT_BENCH_CPU_TIME=1 it times process CPU seconds instead of wall seconds: with one thread
// that ignores time lost to other processes on a shared machine.
double now_s() {
  static const bool cpu = std::getenv("LMKIT_BENCH_CPU_TIME") && std::getenv("LMKIT_BENCH_CPU_TIME")[0] == '1';
  timespec ts;
  clock_gettime(cpu ? CLOCK_PROCESS_CPUTIME_ID : CLOCK_MONOTONIC, &ts);
  return ts.tv_sec + ts.tv_nsec * 1e-9;
}
bool g_smoke = false;  // "smoke": every section once, one timed run, no cold copies (ctest runs it)
constexpr int64_t kSmokeBigN = 3072;  // the one 1.2B shape (qkv 3072x2048) a smoke run keeps per section

double time_it(const std::function<void()>& fn, int reps) {
  if (g_smoke) reps = 1;
  fn();
  std::vector<double> t(reps);
  for (int i = 0; i < reps; ++i) {
    const double t0 = now_s();
    fn();
    t[i] = now_s() - t0;
  }
  std::sort(t.begin(), t.end());
  static const char* stat = std::getenv("LMKIT_BENCH_STAT");  // min (default) | median | mean
  if (stat && std::strcmp(stat, "median") == 0) return t[reps / 2];
  if (stat && std::strcmp(stat, "mean") == 0) return std::accumulate(t.begin(), t.end(), 0.0) / reps;
  return t[0];
}

std::vector<float> randn(int64_t n, float scale = 1.0f) {
  std::mt19937 rng(42);
  std::normal_distribution<float> d(0.0f, scale);
  std::vector<float> v(n);
  for (auto& x : v) x = d(rng);
  return v;
}

// Seconds per call of x[M, K] @ w^T, cycling through `ws` (copies of one weight, so that each call
// streams its weight from DRAM as a decode step does rather than from the L3).
double time_linear_cold(const std::vector<ops::LinearWeight>& ws, int64_t M, int64_t N, int64_t K) {
  std::vector<float> x = randn(M * K), out(M * N);
  size_t next = 0;
  return time_it([&] {
    ops::linear(x.data(), M, ws[next], Tensor{}, out.data());
    next = (next + 1) % ws.size();
  }, N > 10000 ? 3 * (int)ws.size() : 201);
}

struct Weight {
  std::vector<float> f32;
  std::vector<uint16_t> u16;
  Tensor t;
};
Weight make_weight(DType dt, int64_t rows, int64_t cols) {
  Weight w;
  w.f32 = randn(rows * cols, 0.05f);
  void* data = w.f32.data();
  if (dt != DType::F32) {
    w.u16.resize(w.f32.size());
    for (size_t i = 0; i < w.f32.size(); ++i)
      w.u16[i] = dt == DType::F16 ? f32_to_f16(w.f32[i]) : f32_to_bf16(w.f32[i]);
    data = w.u16.data();
    std::vector<float>().swap(w.f32);
  }
  w.t = make_view(data, dt, rows, cols);
  return w;
}

// Streaming read bandwidth (GB/s) over `bytes`, all threads, each summing its own contiguous share
// with 512-bit loads where the CPU has them.
__attribute__((target("avx512f"))) float sum_avx512(const float* p, size_t n, bool prefetch) {
  __m512 a0 = _mm512_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
  for (size_t i = 0; i + 64 <= n; i += 64) {
    if (prefetch) _mm_prefetch((const char*)(p + i + 2048), _MM_HINT_T0);  // 8 KiB ahead
    a0 = _mm512_add_ps(a0, _mm512_load_ps(p + i));
    a1 = _mm512_add_ps(a1, _mm512_load_ps(p + i + 16));
    a2 = _mm512_add_ps(a2, _mm512_load_ps(p + i + 32));
    a3 = _mm512_add_ps(a3, _mm512_load_ps(p + i + 48));
  }
  return _mm512_reduce_add_ps(_mm512_add_ps(_mm512_add_ps(a0, a1), _mm512_add_ps(a2, a3)));
}
float sum_plain(const float* p, size_t n) {
  float a[16] = {0};
  for (size_t i = 0; i + 16 <= n; i += 16)
    for (int j = 0; j < 16; ++j) a[j] += p[i + j];
  return std::accumulate(a, a + 16, 0.0f);
}
double read_bandwidth(size_t bytes, bool prefetch) {
  const size_t n = bytes / 4;
  float* buf = static_cast<float*>(std::aligned_alloc(64, bytes));
  std::fill(buf, buf + n, 1.0f);
  const bool avx512 = __builtin_cpu_supports("avx512f");
  volatile float sink = 0;
  const int64_t nt = ops::cpu::team_threads();
  std::vector<float> partial(nt);
  auto fn = [&] {  // one contiguous share per chunk, as many chunks as the kernels' team has threads
    parallel_for(nt, 1, true, [&](int64_t t0, int64_t t1) {
      for (int64_t t = t0; t < t1; ++t) {
        const size_t b = n / 64 * t / nt * 64, e = n / 64 * (t + 1) / nt * 64;
        partial[t] = avx512 ? sum_avx512(buf + b, e - b, prefetch) : sum_plain(buf + b, e - b);
      }
    });
    sink = std::accumulate(partial.begin(), partial.end(), 0.0f);
  };
  double t = time_it(fn, 7);
  (void)sink;
  std::free(buf);
  return bytes / t / 1e9;
}

}  // namespace

// Weight formats of the gemv section: panels of a stored dtype, or bf16 pairs (dtype='bfloat16', AVX512_BF16
// CPUs) on the dot-product kernel or on AMX tiles (amx: AMX-BF16 CPUs); every_shape: timed on every shape,
// else on the lm_head only.
struct Fmt {
  const char* name;
  DType dtype;
  bool bf16_pairs, every_shape, amx;
};
const Fmt kGemvFormats[] = {{"F16", DType::F16, false, true, false},   {"BF16", DType::BF16, false, false, false},
                            {"F32", DType::F32, false, false, false},  {"bf16x2", DType::F16, true, true, false},
                            {"amx", DType::F16, true, true, true}};

// A KV pool of `ctx` random keys and values for one sequence, written through kv_write as the model does
// (rounding or quantizing for bits 16 / 8 / 4), in blocks 0.. of `table` (shuffled when asked).
struct BenchPool {
  ops::KVLayer kv;
  std::vector<uint8_t> kp, vp;
  std::vector<int32_t> table;
  // rows: the ctx x kv_heads x hd values written as K and as V (default: randn's, which are the same for every
  // pool, so a caller that builds many pools draws them once and passes them)
  BenchPool(int bits, int kv_heads, int hd, int bs, int ctx, bool shuffle, const std::vector<float>* rows = nullptr) {
    const int num_blocks = (ctx + bs - 1) / bs;
    kv.bits = bits, kv.num_blocks = num_blocks, kv.num_kv_heads = kv_heads, kv.block_size_tokens = bs, kv.head_dim = hd;
    kp.resize(kv.block_bytes() * num_blocks), vp.resize(kp.size());
    kv.k = kp.data(), kv.v = vp.data();
    table.resize(num_blocks);
    std::iota(table.begin(), table.end(), 0);
    if (shuffle) std::shuffle(table.begin(), table.end(), std::mt19937(1));
    std::vector<int32_t> slots(ctx);
    for (int p = 0; p < ctx; ++p) slots[p] = table[p / bs] * bs + p % bs;
    const std::vector<float> drawn = rows ? std::vector<float>() : randn((int64_t)ctx * kv_heads * hd);
    const float* r = rows ? rows->data() : drawn.data();
    ops::kv_write(kv, r, r, slots.data(), ctx);
  }
};

int main(int argc, char** argv) {
  const char* isa = argc > 1 && std::strcmp(argv[1], "-") != 0 ? argv[1] : nullptr;  // "-": the CPU's best
  const int threads = argc > 2 ? std::atoi(argv[2]) : 2;
  const char* only = argc > 3 ? argv[3] : "";
  g_smoke = std::strcmp(only, "smoke") == 0;
  if (g_smoke) only = "";
  if (isa && !ops::cpu::force_isa(isa)) {
    std::printf("cannot run isa %s here\n", isa);
    return 1;
  }
  ops::set_num_threads(threads);
  std::printf("isa %s, %d threads\n", ops::cpu_isa(), threads);
  auto want = [&](const char* what) { return !*only || std::strstr(what, only) != nullptr; };

  if (want("bw")) {
    // with the full 1 GB, most reads come from DRAM; 56 MB (the F16 lm_head) may fit a large L3
    for (size_t mb : {8, 56, 1024}) {
      if (g_smoke && mb != 8) continue;
      std::printf("read bandwidth %5zu MB: %.1f GB/s (%.1f GB/s with software prefetch)\n", mb,
                  read_bandwidth(mb << 20, false), read_bandwidth(mb << 20, true));
    }
  }

  if (want("gemv576") || want("gemv1.2b")) {  // "gemv" runs both
    struct S {
      const char* name;
      int64_t N, K;
    };
    // SmolLM2-135M's shapes, then (section "gemv1.2b") the 1.2B Llama's, at M = 1 and 16 only
    for (S s : {S{"lm_head", 49152, 576}, S{"qkv 960x576", 960, 576}, S{"gate_up 3072x576", 3072, 576},
                S{"down 576x1536", 576, 1536}, S{"lm_head 1.2b", 49152, 2048}, S{"qkv 3072x2048", 3072, 2048},
                S{"o 2048x2048", 2048, 2048}, S{"gate_up 16384x2048", 16384, 2048}, S{"down 2048x8192", 2048, 8192}})
      for (const Fmt& f : kGemvFormats) {
        const DType dt = f.dtype;
        const bool big = s.K >= 2048;
        if (big ? !want("gemv1.2b") : !want("gemv576")) continue;
        if (g_smoke && big && s.N != kSmokeBigN) continue;  // the others run the same code, only slower to set up
        if (s.N != 49152 && !f.every_shape) continue;
        if (f.bf16_pairs && !ops::bf16_dot_available()) continue;
        if (ops::cpu::use_amx(f.amx) != f.amx) continue;
        // "cold": cycle through copies of the weight totalling > 400 MB, so that each call streams
        // it from DRAM as a decode step does (a large L3 would otherwise hold it)
        const double bytes = (double)s.N * s.K * dtype_size_bytes(dt);
        const int copies = g_smoke ? 1 : (int)std::ceil(400e6 / bytes);
        std::vector<ops::LinearWeight> ws;  // packed once, as the model does at load time
        for (int c = 0; c < copies; ++c) {
          const Weight w = make_weight(dt, s.N, s.K);
          ws.push_back(f.bf16_pairs ? ops::pack_linear_bf16(w.t) : ops::pack_linear(w.t));
        }
        for (int64_t M : {1, 2, 4, 8, 12, 16, 24, 32, 48, 64}) {
          if (big && M != 1 && M != 16) continue;
          const double t = time_linear_cold(ws, M, s.N, s.K);
          std::printf("gemv %-16s %-6s M %2d%s: %8.1f us  %6.1f GB/s  %6.1f GFLOP/s\n", s.name,
                      f.name,
                      (int)M, copies > 1 ? " (cold)" : "       ", t * 1e6, bytes / t / 1e9, 2.0 * M * s.N * s.K / t / 1e9);
        }
      }
    ops::cpu::use_amx(true);
  }

  if (want("gemv")) {  // the quantized formats of an AWQ decode step: int4 g64 and int8, int8 activations
    struct S {
      const char* name;
      int64_t N, K;
      bool int8;  // int8 panels (the lm_head of an AWQ model) instead of int4 g64
    };
    std::mt19937 rng(7);
    for (S s : {S{"lm_head", 49152, 576, true}, S{"qkv 960x576", 960, 576, false},
                S{"gate_up 3072x576", 3072, 576, false}, S{"down 576x1536", 576, 1536, false}}) {
      if (s.int8 && !ops::int8_dot_available()) continue;
      std::vector<ops::LinearWeight> ws;
      double bytes = 0;
      const int g = 64;
      while (ws.empty() || (!g_smoke && bytes * ws.size() < 400e6)) {
        ops::LinearWeight w;
        if (s.int8) {
          w = ops::pack_linear_int8(make_weight(DType::F32, s.N, s.K).t);
        } else {
          std::vector<int32_t> qw(s.K * s.N / 8), qz(s.K / g * s.N / 8);
          for (auto& v : qw) v = (int32_t)rng();
          for (auto& v : qz) v = (int32_t)rng();
          Weight sc = make_weight(DType::F16, s.K / g, s.N);
          w = pack_awq(make_view(qw.data(), DType::I32, s.K, s.N / 8), make_view(qz.data(), DType::I32, s.K / g, s.N / 8), sc.t, g);
          w.int8_activations = true;
        }
        bytes = (double)w.size_bytes();
        ws.push_back(w);
      }
      for (int64_t M : {1, 2, 4, 8, 16}) {
        const double t = time_linear_cold(ws, M, s.N, s.K);
        std::printf("gemv %-16s %-4s M %2d%s: %8.1f us  %6.1f GB/s  %6.1f GFLOP/s\n", s.name, s.int8 ? "I8" : "I4g64",
                    (int)M, ws.size() > 1 ? " (cold)" : "       ", t * 1e6, bytes / t / 1e9,
                    2.0 * M * s.N * s.K / t / 1e9);
      }
    }
  }

  if (want("gguf")) {  // GGUF panels at the 1.2B Llama's shapes: Q4_0, Q4_K (int4 super-blocks), Q6_K (int6), MXFP4
    struct S {
      const char* name;
      int64_t N, K;
    };
    std::mt19937 rng(11);
    enum Fmt { Q4_0, Q4_K, Q6_K, MXFP4 };
    static const char* const fmt_names[] = {"Q4_0", "Q4_K", "Q6_K", "MXFP4"};
    for (Fmt fmt : {Q4_0, Q4_K, Q6_K, MXFP4})
      for (S s : {S{"qkv 3072x2048", 3072, 2048}, S{"gate_up 16384x2048", 16384, 2048},
                  S{"down 2048x8192", 2048, 8192}, S{"lm_head 1.2b", 49152, 2048}}) {
        if (!ops::int8_dot_available()) break;
        if (g_smoke && s.N != kSmokeBigN) continue;
        std::vector<ops::LinearWeight> ws;
        double bytes = 0;
        const int64_t N = s.N, K = s.K;
        while (ws.empty() || (!g_smoke && bytes * ws.size() < 400e6)) {
          ops::LinearWeight w;
          if (fmt == Q6_K) {  // random values, d and sc (the kernels do not care which)
            Int8Source src;
            src.num_out = N, src.num_in = K;
            const uint32_t seed = rng();
            const float d0 = f16_to_f32(f32_to_f16(0.001f));
            src.read_block16 = [seed, d0](int64_t b, int64_t n0, int64_t count, int8_t* q, float* scales) {
              for (int64_t c = 0; c < count; ++c) {
                scales[c] = d0 * (int8_t)((b * 7 + n0 + c) * 37);
                for (int64_t r = 0; r < 16; ++r) q[r * count + c] = (int8_t)(((seed + b * 131 + r * 17 + c) % 64) - 32);
              }
            };
            src.read_block16_kquant = [](int64_t b, int64_t n0, int64_t count, uint16_t* d, int8_t* sc) {
              for (int64_t c = 0; c < count; ++c) d[c] = f32_to_f16(0.001f), sc[c] = (int8_t)((b * 7 + n0 + c) * 37);
            };
            w = ops::pack_linear_int8(src);
          } else {
            Int4Source src;
            src.num_out = N, src.num_in = K, src.group_size = 32;
            src.symmetric = fmt == Q4_0;  // zero 8: Symmetric heads, as the GGUF reader gives Q4_0
            src.read_group = [](int64_t g, int64_t, int64_t count, uint8_t* q, uint8_t* z, uint16_t* scales) {
              for (int64_t i = 0; i < 32 * count; ++i) q[i] = (uint8_t)((g * 5 + i) % 16);
              for (int64_t c = 0; c < count; ++c) z[c] = 8, scales[c] = f32_to_f16(0.001f * (1 + (g + c) % 7));
            };
            if (fmt == MXFP4)  // e2m1 codes, e8m0 scales around 2^-7
              src.read_e8m0 = [](int64_t g, int64_t, int64_t count, uint8_t* e) {
                for (int64_t c = 0; c < count; ++c) e[c] = (uint8_t)(118 + (g + c) % 5);
              };
            if (fmt == Q4_K) src.read_kquant = [](int64_t g, int64_t, int64_t count, uint16_t* d, uint16_t* dmin, uint8_t* sc,
                                 uint8_t* m) {
              for (int64_t c = 0; c < count; ++c)
                d[c] = f32_to_f16(0.001f), dmin[c] = f32_to_f16(0.002f), sc[c] = (uint8_t)((g + c) % 64), m[c] = (uint8_t)(c % 64);
            };
            w = ops::pack_linear_int4(src);
          }
          w.int8_activations = true;
          bytes = (double)w.size_bytes();
          ws.push_back(w);
        }
        for (int64_t M : {1, 16, 512}) {  // decode, 16 streams, a 512-token prefill (Q4_0, not the lm_head)
          if (M == 512 && (fmt != Q4_0 || s.N == 49152)) continue;
          const double t = time_linear_cold(ws, M, N, K);
          std::printf("gguf %-18s %-4s M %2d%s: %8.1f us  %6.1f GB/s  %6.1f GOP/s\n", s.name, fmt_names[fmt],
                      (int)M, ws.size() > 1 ? " (cold)" : "       ", t * 1e6, bytes / t / 1e9, 2.0 * M * N * K / t / 1e9);
        }
      }
  }

  if (want("gemm")) {
    struct S {
      int64_t M, N, K;
    };
    for (S s : {S{512, 1536, 576}, S{512, 576, 1536}, S{512, 49152, 576}, S{512, 576, 576}, S{512, 192, 576},
                S{128, 1536, 576}, S{64, 1536, 576}, S{32, 1536, 576}, S{16, 1536, 576}})
      for (DType dt : {DType::F32, DType::F16, DType::BF16}) {
        const ops::LinearWeight w = ops::pack_linear(make_weight(dt, s.N, s.K).t);
        std::vector<float> x = randn(s.M * s.K), out(s.M * s.N);
        double t = time_it([&] { ops::linear(x.data(), s.M, w, Tensor{}, out.data()); }, s.N > 10000 ? 5 : 21);
        std::printf("gemm [%d x %d] x [%d x %d]^T %-4s: %8.3f ms  %6.1f GFLOP/s\n", (int)s.M, (int)s.K, (int)s.N,
                    (int)s.K, dtype_name(dt), t * 1e3, 2.0 * s.M * s.N * s.K / t / 1e9);
      }
    // dtype='bfloat16': bf16 pair panels, vdpbf16ps (AVX512_BF16 CPUs only) and AMX tiles (AMX-BF16 CPUs)
    if (ops::bf16_dot_available())
      for (bool amx : {false, true}) {
        if (ops::cpu::use_amx(amx) != amx) continue;
        for (S s : {S{512, 1536, 576}, S{512, 576, 1536}, S{512, 49152, 576}, S{128, 1536, 576}, S{64, 1536, 576},
                    S{32, 1536, 576}, S{16, 1536, 576}, S{1, 1536, 576}}) {
          const ops::LinearWeight w = ops::pack_linear_bf16(make_weight(DType::F16, s.N, s.K).t);
          std::vector<float> x = randn(s.M * s.K), out(s.M * s.N);
          double t = time_it([&] { ops::linear(x.data(), s.M, w, Tensor{}, out.data()); }, s.N > 10000 ? 5 : 21);
          std::printf("gemm [%d x %d] x [%d x %d]^T bf16 pairs%s: %8.3f ms  %6.1f GFLOP/s\n", (int)s.M, (int)s.K,
                      (int)s.N, (int)s.K, amx ? " (amx)" : "", t * 1e3, 2.0 * s.M * s.N * s.K / t / 1e9);
        }
      }
    ops::cpu::use_amx(true);
  }

  if (want("awq")) {  // AWQ int4 g128 prefill at a 1.2B Llama's shapes (hidden 2048, intermediate 8192)
    struct S {
      const char* name;
      int64_t M, N, K;
    };
    std::mt19937 rng(7);
    const int g = 128;
    for (S s : {S{"qkv", 512, 3072, 2048}, S{"o", 512, 2048, 2048}, S{"gate_up", 512, 16384, 2048},
                S{"down", 512, 2048, 8192}, S{"gate_up", 64, 16384, 2048}, S{"gate_up", 32, 16384, 2048},
                S{"gate_up", 16, 16384, 2048}}) {
      std::vector<int32_t> qw(s.K * s.N / 8), qz(s.K / g * s.N / 8);
      for (auto& v : qw) v = (int32_t)rng();
      for (auto& v : qz) v = (int32_t)rng();
      Weight sc = make_weight(DType::F16, s.K / g, s.N);
      ops::LinearWeight w = pack_awq(make_view(qw.data(), DType::I32, s.K, s.N / 8), make_view(qz.data(), DType::I32, s.K / g, s.N / 8), sc.t, g);
      std::vector<float> x = randn(s.M * s.K), out(s.M * s.N);
      struct P {
        const char* name;
        bool int8, amx;
      };
      for (P p : {P{"fp32", false, false}, P{"int8 dot", true, false}, P{"int8 amx", true, true}}) {
        if ((p.int8 && !ops::int8_dot_available()) || (p.amx && !ops::int8_amx_available())) continue;
        w.int8_activations = p.int8;
        ops::cpu::use_amx(p.amx);
        const double t = time_it([&] { ops::linear(x.data(), s.M, w, Tensor{}, out.data()); }, 5);
        std::printf("awq %-8s [%3d x %4d] x [%5d x %4d]^T I4g128 %-9s: %8.3f ms  %7.1f GOP/s\n", s.name, (int)s.M,
                    (int)s.K, (int)s.N, (int)s.K, p.name, t * 1e3, 2.0 * s.M * s.N * s.K / t / 1e9);
      }
      ops::cpu::use_amx(true);
    }
  }

  if (want("q4prefill")) {  // GGUF Q4_0 / Q4_1 (int4 groups of 32) x int8 activations: prompt rows and 16 streams
    struct S {
      const char* name;
      int64_t N, K;
    };
    for (bool offsets : {false, true})
      for (S s : {S{"smol gate_up 3072x576", 3072, 576}, S{"smol down 576x1536", 576, 1536},
                  S{"smol qkv 960x576", 960, 576}, S{"1.2b gate_up 16384x2048", 16384, 2048},
                  S{"1.2b down 2048x8192", 2048, 8192}}) {
        if (!ops::int8_dot_available()) break;
        if (g_smoke && s.N != 960) continue;
        Int4Source src;
        src.num_out = s.N, src.num_in = s.K, src.group_size = 32;
        src.symmetric = !offsets;  // Q4_0: zero 8; Q4_1: an fp16 offset per group
        src.read_group = [](int64_t g, int64_t, int64_t count, uint8_t* q, uint8_t* z, uint16_t* scales) {
          for (int64_t i = 0; i < 32 * count; ++i) q[i] = (uint8_t)((g * 5 + i) % 16);
          for (int64_t c = 0; c < count; ++c) z[c] = 8, scales[c] = f32_to_f16(0.001f * (1 + (g + c) % 7));
        };
        if (offsets)
          src.read_offsets = [](int64_t g, int64_t, int64_t count, uint16_t* o) {
            for (int64_t c = 0; c < count; ++c) o[c] = f32_to_f16(-0.004f * (1 + (g + c) % 5));
          };
        ops::LinearWeight w = ops::pack_linear_int4(src);
        w.int8_activations = true;
        for (int64_t M : {16, 64, 512}) {
          if (s.N > 10000 && M != 512) continue;
          std::vector<float> x = randn(M * s.K);
          const size_t out_bytes = (size_t)(M * s.N) * 4;
          float* out = (float*)mmap(nullptr, out_bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
          const double t = time_it([&] { ops::linear(x.data(), M, w, Tensor{}, out); }, s.N > 10000 ? 5 : 21);
          munmap(out, out_bytes);
          std::printf("q4prefill %-24s %s M %3d: %8.3f ms  %6.1f GOP/s\n", s.name, offsets ? "Q4_1" : "Q4_0", (int)M,
                      t * 1e3, 2.0 * M * s.N * s.K / t / 1e9);
        }
      }
  }

  if (want("q8prefill")) {  // int8 panels (GGUF Q8_0: SmolLM2's tied lm_head) x int8 activations, 16 streams
    if (ops::int8_dot_available()) {
      const int64_t N = g_smoke ? 960 : 49152, K = 576;
      ops::LinearWeight w = ops::pack_linear_int8(make_weight(DType::F32, N, K).t);
      w.int8_activations = true;
      for (int64_t M : {16, 64}) {
        std::vector<float> x = randn(M * K), out(M * N);
        const double t = time_it([&] { ops::linear(x.data(), M, w, Tensor{}, out.data()); }, 11);
        std::printf("q8prefill smol lm_head %lldx576 Q8_0 M %3d: %8.3f ms  %6.1f GOP/s\n", (long long)N, (int)M,
                    t * 1e3, 2.0 * M * N * K / t / 1e9);
      }
    }
  }

  if (want("attn")) {
    // fp32 and int8 caches in blocks of 16; the bf16 cache of dtype='bfloat16' in the engine's default blocks of
    // 64, on the dot path and, where the CPU has AMX-BF16, on tiles
    const int heads = 9, kv_heads = 3, hd = 64;
    for (int bits : {32, 8, 16}) {
      const int bs = bits == 16 ? 64 : 16;
      for (int ctx : {64, 160, 512, 2048}) {
        const BenchPool pool(bits, kv_heads, hd, bs, ctx, true);
        const ops::KVLayer& kv = pool.kv;
        const std::vector<int32_t>& table = pool.table;
        const char* kv_name = bits == 32 ? "fp32" : bits == 16 ? "bf16" : "int8";
        for (bool amx : {false, true}) {
          if ((bits != 16 && amx) || ops::cpu::use_amx(amx) != amx) continue;
          const char* path = bits != 16 ? "" : amx ? " amx" : " dot";
          for (int q_len : {1, 512}) {
            if (q_len > ctx || (bits == 8 && q_len > 1)) continue;
            ops::AttnSeq seq{0, q_len, ctx, table.data()};
            std::vector<float> q = randn((int64_t)q_len * heads * hd), out(q.size());
            double t = time_it([&] { ops::paged_attention(q.data(), kv, &seq, 1, heads, 0.125f, 0, out.data()); },
                               q_len == 1 ? 501 : 21);
            const double flops = 4.0 * heads * hd *
                                 (q_len == 1 ? ctx : (double)q_len * (q_len + 1) / 2 + (double)q_len * (ctx - q_len));
            std::printf("attention KV %-4s%-4s q_len %4d ctx %4d (9/3 heads, hd 64, bs %2d): %9.1f us  %6.1f GFLOP/s\n",
                        kv_name, path, q_len, ctx, bs, t * 1e6, flops / t / 1e9);
          }
          if (ctx < 512) continue;
          // a decode batch: 8 sequences at this ctx sharing the pool
          std::vector<ops::AttnSeq> seqs(8);
          for (int i = 0; i < 8; ++i) seqs[i] = ops::AttnSeq{i, 1, ctx, table.data()};
          std::vector<float> q = randn(8 * heads * hd), out(q.size());
          double t = time_it([&] { ops::paged_attention(q.data(), kv, seqs.data(), 8, heads, 0.125f, 0, out.data()); }, 201);
          std::printf("attention KV %-4s%-4s decode batch 8 x ctx %4d: %9.1f us\n", kv_name, path, ctx, t * 1e6);
        }
        ops::cpu::use_amx(true);
      }
    }
    // prefill of a 1.2B Llama's layer (32/8 heads, head_dim 64) over a bf16 cache in blocks of 64: fp32 FMAs over
    // converted rows against AVX512_BF16 dot products (and AMX tiles where present)
    for (int ctx : {512, 2048}) {
      const int lh = 32, lhd = 64;
      const BenchPool pool(16, 8, lhd, 64, ctx, false);
      const ops::KVLayer& kv = pool.kv;
      ops::AttnSeq seq{0, ctx, ctx, pool.table.data()};
      std::vector<float> q = randn((int64_t)ctx * lh * lhd), out(q.size());
      for (const char* path : {"fp32", "bf16", "amx"}) {
        const bool amx = std::strcmp(path, "amx") == 0, bf16 = std::strcmp(path, "fp32") != 0;
        if (ops::cpu::use_amx(amx) != amx || ops::cpu::use_bf16_attention(bf16) != bf16) continue;
        const double t = time_it([&] { ops::paged_attention(q.data(), kv, &seq, 1, lh, 0.125f, 0, out.data()); },
                                 ctx > 1024 ? 3 : 7);
        const double flops = 4.0 * lh * lhd * (double)ctx * (ctx + 1) / 2;
        std::printf("attention KV bf16 %-4s prefill %4d (32/8 heads, hd 64, bs 64): %9.2f ms  %6.1f GFLOP/s\n", path,
                    ctx, t * 1e3, flops / t / 1e9);
      }
      ops::cpu::use_amx(true), ops::cpu::use_bf16_attention(true);
    }
    // a lone long decode at Qwen3.5's attention shape (16/4 heads, head_dim 256, blocks of 64): the "flat in the
    // context" figure of a hybrid model hangs on it; KV bytes read per call against the time (GB/s)
    // (bf16: on AVX512_BF16 dot products; int8 / int4: on VNNI dot products; and with those off on fp32 FMAs over
    // converted rows)
    for (int bits : {16, 8, 4}) {
      for (int ctx : {1024, 8192, 32768}) {
        if (g_smoke && ctx > 1024) continue;
        const int qh = 16, qkv = 4, qhd = 256;
        const BenchPool pool(bits, qkv, qhd, 64, ctx, true);
        ops::AttnSeq seq{0, 1, ctx, pool.table.data()};
        std::vector<float> q = randn(qh * qhd), out(q.size());
        for (bool dot : {true, false}) {
          const bool on = bits == 16 ? ops::cpu::use_bf16_attention(dot) : ops::cpu::use_int8_attention(dot);
          if (on != dot) continue;
          const double t = time_it([&] { ops::paged_attention(q.data(), pool.kv, &seq, 1, qh, 0.0625f, 0, out.data()); },
                                   ctx > 8192 ? 21 : 101);
          const double bytes = (double)pool.kv.block_bytes() * 2 * ((ctx + 63) / 64);
          std::printf("attention KV %-4s%-9s long decode ctx %5d (16/4 heads, hd 256, bs 64): %9.1f us  %6.1f GB/s\n",
                      bits == 16 ? "bf16" : bits == 8 ? "int8" : "int4",
                      !dot ? " fp32" : bits == 16 ? " bf16 dot" : " vnni", ctx, t * 1e6, bytes / t / 1e9);
        }
        ops::cpu::use_bf16_attention(true), ops::cpu::use_int8_attention(true);
      }
    }
    // Gemma 2's attention (8/4 heads, head_dim 256): logit soft-capping at 50 against none, fp32 and bf16 KV (bs 64)
    for (int bits : {32, 16}) {
      const int gh = 8, ghd = 256, ctx = g_smoke ? 128 : 2048;
      const BenchPool pool(bits, 4, ghd, 64, ctx, false);
      const ops::KVLayer& kv = pool.kv;
      const std::vector<int32_t>& table = pool.table;
      for (bool amx : {false, true}) {
        if ((bits != 16 && amx) || ops::cpu::use_amx(amx) != amx) continue;
        for (int q_len : {1, 128}) {
          ops::AttnSeq seq{0, q_len, ctx, table.data()};
          std::vector<float> q = randn((int64_t)q_len * gh * ghd), out(q.size());
          double t[2];
          for (int capped = 0; capped < 2; ++capped)
            t[capped] = time_it([&] {
              ops::paged_attention(q.data(), kv, &seq, 1, gh, 0.0625f, 0, out.data(), capped ? 50.0f : 0.0f);
            }, q_len == 1 ? 201 : 11);
          std::printf("attention Gemma 2 KV %s%s q_len %3d ctx %4d (8/4 heads, hd 256): %9.1f us, softcap 50 %9.1f us\n",
                      bits == 32 ? "fp32" : "bf16", bits != 16 ? "" : amx ? " amx" : " dot", q_len, ctx, t[0] * 1e6,
                      t[1] * 1e6);
        }
      }
      ops::cpu::use_amx(true);
    }
  }

  if (want("attn decode16")) {
    const int heads = 9, kv_heads = 3, hd = 64;
    // a decode step of 16 streams, each with a context of its own (SmolLM2's 9/3 heads, hd 64, blocks of 64), over
    // the pools of 8 layers or more in turn, 1 GB at least: read from DRAM, as in a batched long-context decode,
    // even where the L3 is large (a Xeon's 300 MB held 8 layers' pools of 2,048 tokens)
    for (int bits : {32, 16, 8, 4}) {
      for (int ctx : g_smoke ? std::vector<int>{128} : std::vector<int>{1024, 2048}) {
        const int streams = 16, bs = 64;
        ops::KVLayer shape;  // for its block_bytes(): K and V, plus a quantized pool's (scale, zero) pairs
        shape.bits = bits, shape.num_kv_heads = kv_heads, shape.block_size_tokens = bs, shape.head_dim = hd;
        const double pool_bytes = 2.0 * (double)shape.block_bytes() * (streams * ctx / bs);
        const int layers = g_smoke ? 2 : std::max(8, (int)std::ceil(1e9 / pool_bytes));
        std::vector<std::unique_ptr<BenchPool>> pools;
        const std::vector<float> rows = randn((int64_t)ctx * streams * kv_heads * hd);  // drawn once: up to ~300 pools
        for (int l = 0; l < layers; ++l)
          pools.emplace_back(new BenchPool(bits, kv_heads, hd, bs, ctx * streams, true, &rows));
        std::vector<ops::AttnSeq> seqs(streams);
        for (int i = 0; i < streams; ++i)
          seqs[i] = ops::AttnSeq{i, 1, ctx, pools[0]->table.data() + (int64_t)i * (ctx / bs)};
        std::vector<float> q = randn((int64_t)streams * heads * hd), out(q.size());
        // int8 / int4: on VNNI dot products where the CPU has them (int4 needs head_dim % 128: not here), then fp32
        for (bool dot : {true, false}) {
          if (bits > 8 && !dot) continue;
          if (bits <= 8 && ops::cpu::use_int8_attention(dot) != dot) continue;
          int layer = 0;
          const double t = time_it([&] {
            const BenchPool& p = *pools[layer++ % layers];
            for (int i = 0; i < streams; ++i) seqs[i].block_table = p.table.data() + (int64_t)i * (ctx / bs);
            ops::paged_attention(q.data(), p.kv, seqs.data(), streams, heads, 0.125f, 0, out.data());
          }, 41);
          const double bytes = (double)streams * ctx * kv_heads * 2 * pools[0]->kv.row_bytes();
          std::printf("attention KV %-4s%-5s decode 16 streams x ctx %4d, own KV (9/3 heads, hd 64, bs 64): %8.1f us  "
                      "%5.1f GB/s of KV rows\n", bits == 32 ? "fp32" : bits == 16 ? "bf16" : bits == 8 ? "int8" : "int4",
                      bits > 8 ? "" : dot ? " vnni" : " fp32", ctx, t * 1e6, bytes / t / 1e9);
        }
        ops::cpu::use_int8_attention(true);
      }
    }
  }

  if (want("elem")) {
    const int64_t n = 512, hidden = 576, inter = 1536;
    Weight nw = make_weight(DType::F16, hidden, 1);
    nw.t = make_view(nw.t.data, DType::F16, hidden);
    std::vector<float> x = randn(n * hidden), res = randn(n * hidden), out(n * hidden);
    std::vector<float> g = randn(n * inter), u = randn(n * inter), o2(n * inter);
    std::vector<float> q = randn(n * 9 * 64), k = randn(n * 3 * 64), inv(32);
    std::vector<int32_t> pos(n), ids(n);
    for (int i = 0; i < 32; ++i) inv[i] = std::pow(100000.0f, -i / 32.0f);
    for (int i = 0; i < n; ++i) pos[i] = i, ids[i] = (i * 7919) % 49152;
    Weight emb = make_weight(DType::F16, 49152, hidden);
    for (int64_t rows : {1, 512}) {
      double t1 = time_it([&] { ops::rmsnorm(x.data(), nw.t, 1e-5f, rows, hidden, out.data()); }, 201);
      double t2 = time_it([&] { ops::add_rmsnorm(res.data(), x.data(), nw.t, 1e-5f, rows, hidden, out.data()); }, 201);
      double t3 = time_it([&] { ops::silu_mul(g.data(), u.data(), rows, inter, o2.data()); }, 201);
      double t4 = time_it([&] { ops::rope(q.data(), k.data(), pos.data(), rows, 9, 3, 64, inv.data(), 1.0f); }, 201);
      double t5 = time_it([&] { ops::embedding(emb.t, ids.data(), rows, out.data()); }, 201);
      double t6 = time_it([&] { ops::gelu_tanh_mul(g.data(), u.data(), rows, inter, o2.data()); }, 201);
      std::printf("rows %3d: rmsnorm %7.1f us  add_rmsnorm %7.1f us  silu_mul %7.1f us  gelu_tanh_mul %7.1f us  "
                  "rope %7.1f us  embedding %7.1f us\n",
                  (int)rows, t1 * 1e6, t2 * 1e6, t3 * 1e6, t6 * 1e6, t4 * 1e6, t5 * 1e6);
    }
    // Gemma's final logit soft-capping over one row of its 256k vocabulary, and a scale of the same row
    std::vector<float> logits = randn(256000, 10.0f);
    double t7 = time_it([&] { ops::softcap(logits.data(), (int64_t)logits.size(), 30.0f); }, 201);
    double t8 = time_it([&] { ops::scale(logits.data(), (int64_t)logits.size(), 1.0f); }, 201);
    std::printf("[1 x 256000]: softcap %7.1f us  scale %7.1f us\n", t7 * 1e6, t8 * 1e6);
  }
  return 0;
}
