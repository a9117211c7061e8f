// Holds every CPU op of every instruction-set path this machine can run (generic, avx2, avx512) to
// the scalar double-accumulation reference (kernels/cpu/reference.h): relative error
// ||out - ref|| / ||ref|| <= 1e-5 on fresh random inputs with odd shapes, all weight dtypes, bias
// present/absent, in-place aliasing where the contract allows it, and paged attention over shuffled
// block ids with every unused KV slot poisoned with NaN, with logit soft-capping, and with the blocks
// outside every sliding window freed (-1). Standalone: exit code 1 on any failure.
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <numeric>
#include <optional>
#include <random>
#include <string>
#include <vector>

#include "core/check.h"
#include "kernels/cpu/kernel_table.h"
#include "kernels/cpu/reference.h"
#include "kernels/cpu/sampling.h"
#include "kernels/cpu/thread_pool.h"
#include "kernels/ops.h"
#include "model/int4_layouts.h"
#include "model/mxfp4.h"

using namespace lmkit;

namespace {

int g_passed = 0, g_failed = 0;
// SplitMix64: a few instructions per draw where std::mt19937 was a sixth of this binary's time; statistically
// ample for test inputs (a UniformRandomBitGenerator, so the <random> distributions take it).
struct SplitMix64 {
  using result_type = uint64_t;
  uint64_t state;
  static constexpr result_type min() { return 0; }
  static constexpr result_type max() { return ~uint64_t{0}; }
  result_type operator()() {
    uint64_t z = (state += 0x9E3779B97F4A7C15ull);
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
  }
};
SplitMix64 g_rng{1234};
const char* g_isa = "";
int g_threads = 1;  // the thread count main() set (tests that change it restore it)

void expect(bool ok, const std::string& what) {
  if (ok) {
    ++g_passed;
  } else {
    ++g_failed;
    std::printf("FAIL [%s] %s\n", g_isa, what.c_str());
  }
}

// ||a - b|| / ||b||, infinite when a has a NaN.
double rel_err(const std::vector<float>& a, const std::vector<float>& b) {
  double num = 0, den = 0;
  for (size_t i = 0; i < a.size(); ++i) {
    if (!std::isfinite(a[i])) return INFINITY;
    num += ((double)a[i] - b[i]) * ((double)a[i] - b[i]);
    den += (double)b[i] * b[i];
  }
  return den == 0 ? std::sqrt(num) : std::sqrt(num / den);
}

void expect_close(const std::vector<float>& out, const std::vector<float>& ref, const std::string& what,
                  double tol = 1e-5) {
  const double e = rel_err(out, ref);
  char buf[64];
  std::snprintf(buf, sizeof(buf), " (rel err %.3g)", e);
  expect(e <= tol, what + buf);
}

// Whether f throws lmkit::Error (a check at the door).
template <class F>
bool throws(F&& f) {
  try {
    f();
  } catch (const Error&) {
    return true;
  }
  return false;
}

// Uniform in [-scale * sqrt(3), scale * sqrt(3)): unit variance at scale 1, cheaper than a normal.
std::vector<float> randn(int64_t n, float scale = 1.0f) {
  std::vector<float> v(n);
  const float half_width = 1.7320508f * scale;
  for (auto& x : v) x = ((float)(g_rng() >> 40) * 0x1.0p-24f * 2.0f - 1.0f) * half_width;  // 24 random bits
  return v;
}

// A weight of the given dtype holding rounded copies of random values; `t` views its storage.
struct Weight {
  std::vector<float> f32;
  std::vector<uint16_t> u16;
  Tensor t;
};
Weight make_weight(DType dt, int64_t rows, int64_t cols, float scale = 1.0f) {
  Weight w;
  w.f32 = randn(rows * std::max<int64_t>(cols, 1), scale);
  void* data = w.f32.data();
  if (dt != DType::F32) {
    w.u16.resize(w.f32.size());
    for (size_t i = 0; i < w.f32.size(); ++i)
      w.u16[i] = dt == DType::F16 ? f32_to_f16(w.f32[i]) : f32_to_bf16(w.f32[i]);
    data = w.u16.data();
  }
  w.t = cols > 0 ? make_view(data, dt, rows, cols) : make_view(data, dt, rows);
  return w;
}

const DType kWeightDTypes[] = {DType::F32, DType::F16, DType::BF16};
std::string dt_name(DType dt) { return dtype_name(dt); }

void test_embedding() {
  for (DType dt : kWeightDTypes)
    for (int64_t hidden : {1, 17, 576}) {
      Weight table = make_weight(dt, 301, hidden);
      std::vector<int32_t> ids = {0, 300, 7, 7, 150, 299, 1};
      std::vector<float> out(ids.size() * hidden, NAN), ref(out.size());
      ops::embedding(table.t, ids.data(), (int64_t)ids.size(), out.data());
      ops::reference::embedding(table.t, ids.data(), (int64_t)ids.size(), ref.data());
      expect(out == ref, "embedding " + dt_name(dt) + " hidden " + std::to_string(hidden) + " is exact");
    }
  Weight table = make_weight(DType::F32, 10, 8);
  int32_t bad = 10;
  float out[8];
  bool threw = false;
  try {
    ops::embedding(table.t, &bad, 1, out);
  } catch (const Error&) {
    threw = true;
  }
  expect(threw, "embedding rejects an out-of-vocabulary id");
}

void test_rmsnorm() {
  for (DType dt : kWeightDTypes)
    for (int64_t dim : {1, 5, 64, 576, 1001})
      for (int64_t rows : {1, 3, 130}) {
        const std::string name = " " + dt_name(dt) + " [" + std::to_string(rows) + ", " + std::to_string(dim) + "]";
        Weight w = make_weight(dt, dim, 0);
        std::vector<float> x = randn(rows * dim, 3.0f), ref(x.size()), out(x.size());
        ops::reference::rmsnorm(x.data(), w.t, 1e-5f, rows, dim, ref.data());
        ops::rmsnorm(x.data(), w.t, 1e-5f, rows, dim, out.data());
        expect_close(out, ref, "rmsnorm" + name);
        std::vector<float> inplace = x;
        ops::rmsnorm(inplace.data(), w.t, 1e-5f, rows, dim, inplace.data());
        expect_close(inplace, ref, "rmsnorm in place" + name);

        std::vector<float> res = randn(rows * dim), xr = randn(rows * dim), res_ref = res;
        ops::reference::add_rmsnorm(res_ref.data(), xr.data(), w.t, 1e-6f, rows, dim, ref.data());
        ops::add_rmsnorm(res.data(), xr.data(), w.t, 1e-6f, rows, dim, out.data());
        expect_close(out, ref, "add_rmsnorm out" + name);
        expect_close(res, res_ref, "add_rmsnorm residual" + name, 0.0);
        // out may alias x (the decoder normalises into the buffer it adds from)
        std::vector<float> res2 = res_ref, xr2 = xr, res2_ref = res_ref;
        ops::reference::add_rmsnorm(res2_ref.data(), xr.data(), w.t, 1e-6f, rows, dim, ref.data());
        ops::add_rmsnorm(res2.data(), xr2.data(), w.t, 1e-6f, rows, dim, xr2.data());
        expect_close(xr2, ref, "add_rmsnorm out = x" + name);
        expect_close(res2, res2_ref, "add_rmsnorm residual, out = x" + name, 0.0);
      }
}

void test_linear() {
  struct Shape {
    int64_t M, N, K;
  };
  const Shape shapes[] = {{1, 1, 1},    {1, 37, 576},  {2, 65, 576},   {3, 100, 33},  {4, 64, 1536},
                          {5, 4099, 576}, {7, 31, 577},  {8, 96, 576},   {9, 33, 100},  {13, 200, 576},
                          {40, 65, 1536}, {100, 129, 577}, {64, 1536, 64}, {3, 17, 15},
                          {30, 3, 7},   {25, 1, 1}};
  for (DType dt : kWeightDTypes)
    for (const Shape& s : shapes)
      for (int bias_kind = 0; bias_kind < 3; ++bias_kind) {
        if (bias_kind > 0 && (s.N * s.K > 1'000'000)) continue;
        Weight w = make_weight(dt, s.N, s.K, 0.05f);
        Weight b;
        if (bias_kind > 0) b = make_weight(bias_kind == 1 ? DType::F32 : DType::BF16, s.N, 0);
        std::vector<float> x = randn(s.M * s.K), out(s.M * s.N, NAN), ref(out.size());
        ops::linear(x.data(), s.M, w.t, b.t, out.data());
        ops::reference::linear(x.data(), s.M, w.t, b.t, ref.data());
        expect_close(out, ref,
                     "linear " + dt_name(dt) + " M " + std::to_string(s.M) + " N " + std::to_string(s.N) + " K " +
                         std::to_string(s.K) + (bias_kind ? " bias" : ""));
      }
  // several M blocks per thread (M x K x 4 bytes > 1 MiB), few columns (threads split M)
  {
    Weight w = make_weight(DType::BF16, 70, 576, 0.05f);
    Weight b = make_weight(DType::F16, 70, 0);
    std::vector<float> x = randn(700 * 576), out(700 * 70), ref(out.size());
    ops::linear(x.data(), 700, w.t, b.t, out.data());
    ops::reference::linear(x.data(), 700, w.t, b.t, ref.data());
    expect_close(out, ref, "linear BF16 M 700 N 70 K 576 bias");
  }
  // a large-M GEMM against the lm_head width: the first 2053 rows of a [49152 x 576] F16 weight
  Weight w = make_weight(DType::F16, 2053, 576, 0.05f);
  std::vector<float> x = randn(97 * 576), out(97 * 2053), ref(out.size());
  ops::linear(x.data(), 97, w.t, Tensor{}, out.data());
  ops::reference::linear(x.data(), 97, w.t, Tensor{}, ref.data());
  expect_close(out, ref, "linear F16 M 97 N 2053 K 576");
  // packed once, used for many calls (as the model does); the packed size is whole panels
  const ops::LinearWeight packed = ops::pack_linear(w.t);
  expect(packed.size_bytes() == (2053 + 31) / 32 * 32 * 576 * 2, "packed F16 [2053 x 576] is 65 panels of 32 x 576");
  for (int64_t M : {1, 16, 97}) {
    std::fill(out.begin(), out.end(), NAN);
    ops::linear(x.data(), M, packed, Tensor{}, out.data());
    ops::reference::linear(x.data(), M, w.t, Tensor{}, ref.data());
    expect_close(std::vector<float>(out.begin(), out.begin() + M * 2053), std::vector<float>(ref.begin(), ref.begin() + M * 2053),
                 "linear packed F16 M " + std::to_string(M) + " N 2053 K 576");
  }
  bool threw_empty = false;
  try {
    ops::linear(x.data(), 1, ops::LinearWeight{}, Tensor{}, out.data());
  } catch (const Error&) {
    threw_empty = true;
  }
  expect(threw_empty, "linear rejects an unpacked (empty) LinearWeight");
  bool threw = false;
  Weight bad_bias = make_weight(DType::F32, 3, 0);
  try {
    ops::linear(x.data(), 1, w.t, bad_bias.t, out.data());
  } catch (const Error&) {
    threw = true;
  }
  expect(threw, "linear rejects a bias of the wrong length");
}

// A random AWQ "GEMM" weight [N, K] (qweight I32 [K, N / 8], qzeros I32 [K / g, N / 8], scales F16
// [K / g, N]) and its dequantized values, unpacked here from the format's definition in double.
struct AwqWeight {
  std::vector<int32_t> qweight, qzeros;
  std::vector<uint16_t> scales;
  std::vector<double> dense;  // [N, K]
  Tensor qw, qz, sc;
};
// out[m, n] = bias[n] + sum_k x[m, k] w[n, k] in float64 (bias: nullptr for none), rounded to fp32 at the end.
std::vector<float> linear_f64(const std::vector<float>& x, int64_t M, const std::vector<double>& w, int64_t N,
                              int64_t K, const float* bias) {
  std::vector<float> out(M * N);
  for (int64_t m = 0; m < M; ++m)
    for (int64_t n = 0; n < N; ++n) {
      double acc = bias ? bias[n] : 0.0;
      for (int64_t k = 0; k < K; ++k) acc += (double)x[m * K + k] * w[n * K + k];
      out[m * N + n] = (float)acc;
    }
  return out;
}

// symmetric: every zero 8 (what GGUF Q4_0 and symmetric GPTQ / compressed-tensors checkpoints hold), which the
// layout's source reports and the packer turns into zero-less Symmetric heads.
// fill: every word of qweight (8 nibbles) this value instead of random bits.
AwqWeight make_awq(int64_t N, int64_t K, int64_t g, bool symmetric = false, std::optional<uint32_t> fill = {}) {
  AwqWeight a;
  std::uniform_int_distribution<uint32_t> bits;
  a.qweight.resize(K * N / 8);
  a.qzeros.resize(K / g * N / 8);
  for (auto& x : a.qweight) x = (int32_t)(fill ? *fill : bits(g_rng));
  for (auto& x : a.qzeros) x = symmetric ? (int32_t)0x88888888u : (int32_t)bits(g_rng);
  std::vector<float> s = randn(K / g * N, 0.02f);
  for (float x : s) a.scales.push_back(f32_to_f16(x));
  const int order[8] = {0, 2, 4, 6, 1, 3, 5, 7};  // nibble i holds column 8c + order[i]
  auto nibble = [&](const std::vector<int32_t>& m, int64_t row, int64_t n) {
    for (int i = 0; i < 8; ++i)
      if (order[i] == n % 8) return (int)(((uint32_t)m[row * (N / 8) + n / 8] >> (4 * i)) & 15u);
    return -1;
  };
  a.dense.resize(N * K);
  for (int64_t n = 0; n < N; ++n)
    for (int64_t k = 0; k < K; ++k)
      a.dense[n * K + k] =
          (double)(nibble(a.qweight, k, n) - nibble(a.qzeros, k / g, n)) * f16_to_f32(a.scales[k / g * N + n]);
  a.qw = make_view(a.qweight.data(), DType::I32, K, N / 8);
  a.qz = make_view(a.qzeros.data(), DType::I32, K / g, N / 8);
  a.sc = make_view(a.scales.data(), DType::F16, K / g, N);
  return a;
}

// An AWQ weight packed as the engine packs one: through the AutoAWQ GEMM layout's Int4Source.
ops::LinearWeight pack_awq_tensors(const Tensor& qw, const Tensor& qz, const Tensor& sc, int64_t g) {
  Int4Tensors t;
  t.layout = Int4Layout::AwqGemm;
  t.values = qw, t.zeros = qz, t.scales = sc;
  return ops::pack_linear_int4(int4_source(t, qw.shape[1] * 8, qw.shape[0], g, "test"));
}
ops::LinearWeight pack_awq(const AwqWeight& a, int64_t g) { return pack_awq_tensors(a.qw, a.qz, a.sc, g); }

std::vector<float> quantize_q8(const std::vector<float>& x, int64_t M, int64_t K, int64_t block);

// A random weight in a checkpoint's own blocks, read through the source the engine's packers take, and its
// values in double from the format's definition: int8 (GGUF Q8_0: q in -128..127, fp16 d per 32 inputs) and
// int4 with offsets (GGUF Q4_1: q in 0..15, fp16 scale and offset per group), int4 K-quant groups (GGUF Q4_K:
// fp16 d and dmin per super-block of 256, 6-bit sc and m per group of 32), int8 in blocks of 16 with fp32 scales
// (GGUF Q6_K: q in -32..31, d * sc per 16 inputs).
struct SourceWeight {
  std::vector<int8_t> q8;
  std::vector<uint8_t> q4, sc, m;         // sc, m: [K / 32, N]
  std::vector<uint16_t> scales, offsets;  // [K / group, N]; Q4_K: d and dmin, [K / 256, N]
  std::vector<float> scales32;            // Q6_K: [K / 16, N]; Q5_K: [K / 32, N]
  std::vector<float> offsets32;           // Q5_K: [K / 32, N]
  std::vector<double> dense;              // [N, K]
  std::vector<int8_t> sc8;                // Q6_K as int6: [K / 16, N] (its d in scales, [K / 256, N])
};
SourceWeight make_int8_weight(int64_t N, int64_t K) {
  SourceWeight a;
  std::uniform_int_distribution<int> q(-128, 127);
  a.q8.resize(N * K);
  for (auto& v : a.q8) v = (int8_t)q(g_rng);
  for (float x : randn(K / 32 * N, 0.002f)) a.scales.push_back(f32_to_f16(x));
  a.dense.resize(N * K);
  for (int64_t n = 0; n < N; ++n)
    for (int64_t k = 0; k < K; ++k) a.dense[n * K + k] = (double)a.q8[n * K + k] * f16_to_f32(a.scales[k / 32 * N + n]);
  return a;
}
// Block b (`block` inputs) of a's int8 values for outputs [n0, n0 + count), as an Int8Source reader gives it.
template <typename Scale>
void read_int8_block(const SourceWeight& a, const std::vector<Scale>& all_scales, int64_t N, int64_t K, int64_t block,
                     int64_t b, int64_t n0, int64_t count, int8_t* q, Scale* scales) {
  for (int64_t c = 0; c < count; ++c) {
    scales[c] = all_scales[b * N + n0 + c];
    for (int64_t r = 0; r < block; ++r) q[r * count + c] = a.q8[(n0 + c) * K + block * b + r];
  }
}
ops::LinearWeight pack_int8_source(const SourceWeight& a, int64_t N, int64_t K) {
  Int8Source src;
  src.num_out = N, src.num_in = K;
  src.read_block = [&a, N, K](int64_t b, int64_t n0, int64_t count, int8_t* q, uint16_t* scales) {
    read_int8_block(a, a.scales, N, K, 32, b, n0, count, q, scales);
  };
  return ops::pack_linear_int8(src);
}
SourceWeight make_int8_fine_weight(int64_t N, int64_t K) {
  SourceWeight a;
  std::uniform_int_distribution<int> q(-32, 31), sc(-128, 127);
  a.q8.resize(N * K);
  for (auto& v : a.q8) v = (int8_t)q(g_rng);
  for (float x : randn(K / 16 * N, 0.0001f)) a.scales32.push_back(f16_to_f32(f32_to_f16(x)) * (float)sc(g_rng));
  a.dense.resize(N * K);
  for (int64_t n = 0; n < N; ++n)
    for (int64_t k = 0; k < K; ++k) a.dense[n * K + k] = (double)a.q8[n * K + k] * a.scales32[k / 16 * N + n];
  return a;
}
ops::LinearWeight pack_int8_fine_source(const SourceWeight& a, int64_t N, int64_t K) {
  Int8Source src;
  src.num_out = N, src.num_in = K;
  src.read_block16 = [&a, N, K](int64_t b, int64_t n0, int64_t count, int8_t* q, float* scales) {
    read_int8_block(a, a.scales32, N, K, 16, b, n0, count, q, scales);
  };
  ops::LinearWeight w = ops::pack_linear_int8(src);
  expect(w.group_size == 16 && w.dtype == DType::F32, "a source of blocks of 16 packs into int8 blocks of 16");
  return w;
}
// Q6_K as the GGUF reader gives it: values -32..31 in blocks of 16 whose scale is the super-block's fp16 d times
// the block's int8 sc (both readers: read_block16 and read_block16_kquant), packed into int6 panels.
SourceWeight make_int6_kquant_weight(int64_t N, int64_t K) {
  SourceWeight a;
  std::uniform_int_distribution<int> q(-32, 31), sc(-128, 127);
  a.q8.resize(N * K);
  for (auto& v : a.q8) v = (int8_t)q(g_rng);
  for (float x : randn(K / 256 * N, 0.0001f)) a.scales.push_back(f32_to_f16(x));
  for (int64_t i = 0; i < K / 16 * N; ++i) a.sc8.push_back((int8_t)sc(g_rng));
  for (int64_t b = 0; b < K / 16; ++b)
    for (int64_t n = 0; n < N; ++n) a.scales32.push_back(f16_to_f32(a.scales[b / 16 * N + n]) * a.sc8[b * N + n]);
  a.dense.resize(N * K);
  for (int64_t n = 0; n < N; ++n)
    for (int64_t k = 0; k < K; ++k) a.dense[n * K + k] = (double)a.q8[n * K + k] * a.scales32[k / 16 * N + n];
  return a;
}
Int8Source int6_kquant_source(const SourceWeight& a, int64_t N, int64_t K) {
  Int8Source src;
  src.num_out = N, src.num_in = K;
  src.read_block16 = [&a, N, K](int64_t b, int64_t n0, int64_t count, int8_t* q, float* scales) {
    read_int8_block(a, a.scales32, N, K, 16, b, n0, count, q, scales);
  };
  src.read_block16_kquant = [&a, N](int64_t b, int64_t n0, int64_t count, uint16_t* d, int8_t* sc) {
    for (int64_t c = 0; c < count; ++c) d[c] = a.scales[b / 16 * N + n0 + c], sc[c] = a.sc8[b * N + n0 + c];
  };
  return src;
}
ops::LinearWeight pack_int6_source(const SourceWeight& a, int64_t N, int64_t K) {
  ops::LinearWeight w = ops::pack_linear_int8(int6_kquant_source(a, N, K));
  expect(w.format == ops::WeightFormat::Int6 && w.group_size == 256 &&
             w.size_bytes() == (N + 31) / 32 * (K / 256) * 32 * (2 + 16 + 256 * 6 / 8),
         "a Q6_K source packs into int6 panels: per super-block and column fp16 d, 16 sc, 6 bits per value");
  return w;
}
// Q5_K's sub-blocks as an Int8Source gives them: q5 in 0..31, scale d * sc, offset -dmin * m (fp16 d, dmin and
// 6-bit sc, m: each product exact in fp32).
SourceWeight make_int8_offset_weight(int64_t N, int64_t K) {
  SourceWeight a;
  std::uniform_int_distribution<int> q(0, 31), six(0, 63);
  a.q8.resize(N * K);
  for (auto& v : a.q8) v = (int8_t)q(g_rng);
  for (float x : randn(K / 32 * N, 0.0005f))
    a.scales32.push_back(f16_to_f32(f32_to_f16(std::fabs(x))) * (float)six(g_rng));
  for (float x : randn(K / 32 * N, 0.001f))
    a.offsets32.push_back(-(f16_to_f32(f32_to_f16(std::fabs(x))) * (float)six(g_rng)));
  a.dense.resize(N * K);
  for (int64_t n = 0; n < N; ++n)
    for (int64_t k = 0; k < K; ++k)
      a.dense[n * K + k] = (double)a.q8[n * K + k] * a.scales32[k / 32 * N + n] + a.offsets32[k / 32 * N + n];
  return a;
}
ops::LinearWeight pack_int8_offset_source(const SourceWeight& a, int64_t N, int64_t K) {
  Int8Source src;
  src.num_out = N, src.num_in = K;
  src.read_block_offsets = [&a, N, K](int64_t b, int64_t n0, int64_t count, int8_t* q, float* scales,
                                      float* offsets) {
    read_int8_block(a, a.scales32, N, K, 32, b, n0, count, q, scales);
    for (int64_t c = 0; c < count; ++c) offsets[c] = a.offsets32[b * N + n0 + c];
  };
  ops::LinearWeight w = ops::pack_linear_int8(src);
  expect(w.group_size == 32 && w.dtype == DType::F32 && w.group_head == ops::GroupHead::Offsets,
         "a source with offsets packs into int8 blocks with offset heads");
  return w;
}
SourceWeight make_int4_offset_weight(int64_t N, int64_t K, int64_t g) {
  SourceWeight a;
  std::uniform_int_distribution<int> q(0, 15);
  a.q4.resize(N * K);
  for (auto& v : a.q4) v = (uint8_t)q(g_rng);
  for (float x : randn(K / g * N, 0.02f)) a.scales.push_back(f32_to_f16(x));
  for (float x : randn(K / g * N, 0.1f)) a.offsets.push_back(f32_to_f16(x));
  a.dense.resize(N * K);
  for (int64_t n = 0; n < N; ++n)
    for (int64_t k = 0; k < K; ++k)
      a.dense[n * K + k] = (double)a.q4[n * K + k] * f16_to_f32(a.scales[k / g * N + n]) +
                           f16_to_f32(a.offsets[k / g * N + n]);
  return a;
}
ops::LinearWeight pack_int4_offset_source(const SourceWeight& a, int64_t N, int64_t K, int64_t g) {
  Int4Source src;
  src.num_out = N, src.num_in = K, src.group_size = (int32_t)g;
  src.read_group = [&a, N, K, g](int64_t gi, int64_t n0, int64_t count, uint8_t* q, uint8_t* zeros, uint16_t* scales) {
    for (int64_t c = 0; c < count; ++c) {
      zeros[c] = 0;
      scales[c] = a.scales[gi * N + n0 + c];
      for (int64_t r = 0; r < g; ++r) q[r * count + c] = a.q4[(n0 + c) * K + gi * g + r];
    }
  };
  src.read_offsets = [&a, N](int64_t gi, int64_t n0, int64_t count, uint16_t* offsets) {
    for (int64_t c = 0; c < count; ++c) offsets[c] = a.offsets[gi * N + n0 + c];
  };
  ops::LinearWeight w = ops::pack_linear_int4(src);
  expect(w.group_head == ops::GroupHead::Offsets, "an int4 source with offsets packs into offset panels");
  return w;
}
SourceWeight make_int4_kquant_weight(int64_t N, int64_t K) {
  SourceWeight a;
  std::uniform_int_distribution<int> q(0, 15), six(0, 63);
  a.q4.resize(N * K);
  for (auto& v : a.q4) v = (uint8_t)q(g_rng);
  a.sc.resize(K / 32 * N), a.m.resize(K / 32 * N);
  for (auto& v : a.sc) v = (uint8_t)six(g_rng);
  for (auto& v : a.m) v = (uint8_t)six(g_rng);
  for (float x : randn(K / 256 * N, 0.001f)) a.scales.push_back(f32_to_f16(std::fabs(x)));
  for (float x : randn(K / 256 * N, 0.002f)) a.offsets.push_back(f32_to_f16(std::fabs(x)));
  a.dense.resize(N * K);
  for (int64_t n = 0; n < N; ++n)
    for (int64_t k = 0; k < K; ++k)
      a.dense[n * K + k] = (double)a.q4[n * K + k] * f16_to_f32(a.scales[k / 256 * N + n]) * a.sc[k / 32 * N + n] -
                           (double)f16_to_f32(a.offsets[k / 256 * N + n]) * a.m[k / 32 * N + n];
  return a;
}
Int4Source int4_kquant_source(const SourceWeight& a, int64_t N, int64_t K) {
  Int4Source src;
  src.num_out = N, src.num_in = K, src.group_size = 32;
  src.read_group = [&a, N, K](int64_t gi, int64_t n0, int64_t count, uint8_t* q, uint8_t* zeros, uint16_t* scales) {
    for (int64_t c = 0; c < count; ++c) {
      zeros[c] = 7, scales[c] = 0x3c00;  // ignored with K-quant groups
      for (int64_t r = 0; r < 32; ++r) q[r * count + c] = a.q4[(n0 + c) * K + gi * 32 + r];
    }
  };
  src.read_kquant = [&a, N](int64_t gi, int64_t n0, int64_t count, uint16_t* d, uint16_t* dmin, uint8_t* sc,
                            uint8_t* m) {
    for (int64_t c = 0; c < count; ++c) {
      d[c] = a.scales[gi / 8 * N + n0 + c], dmin[c] = a.offsets[gi / 8 * N + n0 + c];
      sc[c] = a.sc[gi * N + n0 + c], m[c] = a.m[gi * N + n0 + c];
    }
  };
  return src;
}
ops::LinearWeight pack_int4_kquant_source(const SourceWeight& a, int64_t N, int64_t K) {
  ops::LinearWeight w = ops::pack_linear_int4(int4_kquant_source(a, N, K));
  expect(w.group_head == ops::GroupHead::KQuant && w.group_size == 256 &&
             w.size_bytes() == (N + 31) / 32 * (K / 256) * 32 * (20 + 256 / 2),
         "a K-quant source packs into K-quant panels: per super-block and column fp16 d, dmin, 8 sc, 8 m, nibbles");
  return w;
}

// A K-quant source whose sub-blocks do not share their super-block's d (or dmin) is refused by name, also when
// the packing threads find it (N = 1024: 4 panel ranges), and a K that is no multiple of 256 is refused.
void test_kquant_source_checks() {
  const int64_t N = 1024, K = 512;
  SourceWeight a = make_int4_kquant_weight(N, K);
  Int4Source src = int4_kquant_source(a, N, K);
  const auto read = src.read_kquant;
  src.read_kquant = [read, N](int64_t gi, int64_t n0, int64_t count, uint16_t* d, uint16_t* dmin, uint8_t* sc,
                              uint8_t* m) {
    read(gi, n0, count, d, dmin, sc, m);
    if (gi == 11 && n0 <= N - 7 && N - 7 < n0 + count) dmin[N - 7 - n0] ^= 1;  // sub-block 3 of super-block 1
  };
  std::string what;
  try {
    ops::pack_linear_int4(src);
  } catch (const std::exception& e) {
    what = e.what();
  }
  expect(what.find("K-quant sub-block 11") != std::string::npos, "a d or dmin of a sub-block's own is refused: " + what);
  Int4Source narrow = int4_kquant_source(a, N, K);
  narrow.num_in = 288;
  expect(throws([&] { ops::pack_linear_int4(narrow); }), "a K-quant weight of 288 inputs is refused");

  // int6: a value outside -32..31, a block with a d of its own, a scale that is not d * sc: each named
  SourceWeight b = make_int6_kquant_weight(N, K);
  for (int fault = 0; fault < 3; ++fault) {
    SourceWeight bad = b;
    if (fault == 0) bad.q8[(N - 3) * K + 300] = 40;
    if (fault == 1) bad.scales[1 * N + N - 5] ^= 1;  // super-block 1's d of column N - 5, seen by block 19 alone
    if (fault == 2) bad.scales32[21 * N + N - 9] += 1.0f;
    Int8Source src = int6_kquant_source(bad, N, K);
    if (fault == 1) {
      const SourceWeight* pb = &b;
      const auto read = src.read_block16_kquant;
      src.read_block16_kquant = [read, pb, N](int64_t blk, int64_t n0, int64_t count, uint16_t* d, int8_t* sc) {
        read(blk, n0, count, d, sc);
        if (blk != 19)
          for (int64_t c = 0; c < count; ++c) d[c] = pb->scales[blk / 16 * N + n0 + c];
      };
    }
    std::string msg;
    try {
      ops::pack_linear_int8(src);
    } catch (const std::exception& e) {
      msg = e.what();
    }
    const char* want[] = {"outside -32..31", "block 19 of panel 31 has a d of its own", "not its d * sc"};
    expect(msg.find(want[fault]) != std::string::npos, std::string("int6 refuses: ") + want[fault] + ", got: " + msg);
  }
}

// GGUF's blocks through the engine's packers, with fp32 activations (the exact path: the product of the stored
// weight, 1e-5 from float64) and with int8 activations (the float64 product of the quantized operands, only the
// order of fp32 sums differs): Q8_0 as int8 panels, Q4_1 as int4 panels with offsets, Q4_K as int4 panels with
// K-quant heads (K a multiple of 256), Q6_K as int8 blocks of 16, Q5_K as int8 blocks with offsets, decode and
// prefill rows, partial panels (N % 32), NaN-poisoned outputs.
void test_linear_gguf_blocks() {
  struct Shape {
    int64_t M, N, K;
  };
  const Shape shapes[] = {{1, 8, 32},     {1, 576, 576}, {2, 40, 96},    {3, 200, 640},   {5, 192, 1536},
                          {13, 64, 1536}, {25, 96, 576}, {40, 200, 384}, {100, 136, 576}, {33, 50, 2048},
                          {1, 40, 256},   {4, 72, 768}};
  const bool q8_runs = ops::int8_dot_available();
  for (const Shape& s : shapes)
    for (bool act8 : {false, true}) {
      if (act8 && !q8_runs) continue;
      for (int kind = 0; kind < 6; ++kind) {
        if (kind >= 2 && s.K % 256 != 0) continue;
        const int64_t g = kind == 1 ? (s.K % 64 == 0 ? 64 : 32) : 32;
        const SourceWeight a = kind == 0   ? make_int8_weight(s.N, s.K)
                               : kind == 1 ? make_int4_offset_weight(s.N, s.K, g)
                               : kind == 2 ? make_int4_kquant_weight(s.N, s.K)
                               : kind == 3 ? make_int8_fine_weight(s.N, s.K)
                               : kind == 4 ? make_int8_offset_weight(s.N, s.K)
                                           : make_int6_kquant_weight(s.N, s.K);
        ops::LinearWeight w = kind == 0   ? pack_int8_source(a, s.N, s.K)
                              : kind == 1 ? pack_int4_offset_source(a, s.N, s.K, g)
                              : kind == 2 ? pack_int4_kquant_source(a, s.N, s.K)
                              : kind == 3 ? pack_int8_fine_source(a, s.N, s.K)
                              : kind == 4 ? pack_int8_offset_source(a, s.N, s.K)
                                          : pack_int6_source(a, s.N, s.K);
        w.int8_activations = act8;
        Weight b = make_weight(DType::F32, s.N, 0);
        std::vector<float> x = randn(s.M * s.K), out(s.M * s.N, NAN);
        ops::linear(x.data(), s.M, w, b.t, out.data());
        const std::vector<float> ref = linear_f64(act8 ? quantize_q8(x, s.M, s.K, 32) : x, s.M, a.dense, s.N, s.K,
                                                  b.f32.data());
        expect_close(out, ref,
                     std::string(kind == 0   ? "linear Q8_0 (int8 panels)"
                                 : kind == 1 ? "linear Q4_1 (int4 offsets)"
                                 : kind == 2 ? "linear Q4_K (int4 K-quant heads)"
                                 : kind == 3 ? "linear Q6_K (int8 blocks of 16)"
                                 : kind == 4 ? "linear Q5_K (int8 blocks with offsets)"
                                             : "linear Q6_K (int6 panels)") +
                         (act8 ? " x int8" : " x fp32") + " M " + std::to_string(s.M) + " N " + std::to_string(s.N) +
                         " K " + std::to_string(s.K));
      }
    }
  if (!q8_runs) std::printf("skip [%s] GGUF blocks x int8: no int8 dot-product kernels here\n", g_isa);
}

// The weight-format traits table: one entry per format, found by its format; every packer makes a weight
// of its format whose size_bytes is the bytes it wrote (an overrun would be caught by the allocator's
// neighbours; here: the fused copy of two parts equals both parts back to back); what a CPU lacks is named.
void test_weight_format_traits() {
  using F = ops::WeightFormat;
  for (F f : {F::Dense, F::Int4, F::Int8, F::Bf16Pairs, F::Int6})
    expect(ops::weight_format_traits(f).format == f && ops::weight_format_traits(f).run != nullptr,
           std::string("traits table entry of ") + ops::weight_format_traits(f).name);
  expect(ops::weight_format_traits(F::Int4).pack_float == nullptr && ops::weight_format_traits(F::Int6).pack_float == nullptr,
         "int4 and int6 are not packed from a float weight");
  expect(ops::weight_format_traits(F::Int8).unavailable() == nullptr,
         "int8 weights run on every CPU (fp32 activations; int8 ones where the dot-product kernels are)");
  expect((ops::weight_format_traits(F::Bf16Pairs).unavailable() == nullptr) == ops::bf16_dot_available(),
         "bf16 pair weights are available exactly where the bf16 dot-product kernel is");
  const Weight w = make_weight(DType::F16, 64, 96, 0.05f);
  for (F f : {F::Dense, F::Int8, F::Bf16Pairs}) {
    const ops::WeightFormatTraits& t = ops::weight_format_traits(f);
    if (t.unavailable() != nullptr) {
      expect(throws([&] { t.pack_float(w.t); }), std::string(t.name) + ": packing refuses on this CPU");
      continue;
    }
    const ops::LinearWeight a = t.pack_float(w.t), b = t.pack_float(w.t);
    expect(a.format == f && a.n == 64 && a.k == 96, std::string(t.name) + ": the packer makes its format");
    const ops::LinearWeight ab = ops::concat_linear({&a, &b});
    expect(!ab.is_empty() && ab.size_bytes() == 2 * a.size_bytes() &&
               std::memcmp(ab.storage.get(), a.storage.get(), (size_t)a.size_bytes()) == 0 &&
               std::memcmp(static_cast<char*>(ab.storage.get()) + a.size_bytes(), b.storage.get(),
                           (size_t)b.size_bytes()) == 0,
           std::string(t.name) + ": concat_linear copies whole parts of size_bytes each");
  }
  const AwqWeight q = make_awq(64, 128, 64);
  const ops::LinearWeight awq = pack_awq(q, 64);
  expect(awq.format == F::Int4 && awq.size_bytes() == 2 * 2 * (32 * 3 + 64 / 4 * 64),
         "int4: 2 panels x 2 groups of 32 scales, 32 zeros and the nibbles");
  const ops::LinearWeight dense = ops::pack_linear(w.t);
  expect(ops::concat_linear({&awq, &dense}).is_empty(), "concat_linear refuses parts of different formats");
}

// gather_weights: the weights' bytes move into one 2 MiB-aligned block, in the order given, and every
// weight computes exactly what it computed before.
void test_gather_weights() {
  std::vector<ops::LinearWeight> ws;
  ws.push_back(ops::pack_linear(make_weight(DType::F16, 100, 96, 0.05f).t));
  const AwqWeight q = make_awq(64, 128, 64);
  ws.push_back(pack_awq(q, 64));
  ws.push_back(ops::LinearWeight{});  // an empty one is skipped
  ws.push_back(ops::pack_linear(make_weight(DType::F32, 33, 40, 0.05f).t));
  auto outputs = [&] {
    std::vector<std::vector<float>> outs;
    for (const ops::LinearWeight& w : ws) {
      if (w.is_empty()) continue;
      std::vector<float> x(3 * w.k), out(3 * w.n, NAN);
      for (size_t i = 0; i < x.size(); ++i) x[i] = std::sin(0.37f * (float)i);
      ops::linear(x.data(), 3, w, Tensor{}, out.data());
      outs.push_back(out);
    }
    return outs;
  };
  const auto before = outputs();
  std::vector<ops::LinearWeight*> ptrs;
  for (ops::LinearWeight& w : ws) ptrs.push_back(&w);
  ops::gather_weights(ptrs);
  expect(outputs() == before, "gather_weights: every weight computes the same after the move");
  const char* base = static_cast<const char*>(ws[0].storage.get());
  expect((uintptr_t)base % (2 << 20) == 0, "gather_weights: the block is 2 MiB-aligned");
  const int64_t a = (ws[0].size_bytes() + 63) / 64 * 64, b = (ws[1].size_bytes() + 63) / 64 * 64;
  expect(static_cast<const char*>(ws[1].storage.get()) == base + a &&
             static_cast<const char*>(ws[3].storage.get()) == base + a + b && ws[2].is_empty(),
         "gather_weights: the weights lie in the order given, 64-byte aligned, the empty one left empty");
}

// linear_group: jobs of every format and of 0, 1, a few and many rows, in one call, each output bitwise
// equal to ops::linear's on its own (the same panels through the same kernel), nothing written past a job's
// output (NaN-poisoned, with a guard after it), and a group of one large job split across the threads.
void test_linear_group() {
  std::vector<ops::LinearWeight> ws;
  ws.push_back(ops::pack_linear(make_weight(DType::F16, 100, 96, 0.05f).t));
  ws.push_back(ops::pack_linear(make_weight(DType::F32, 200, 64, 0.05f).t));
  for (bool q8 : {false, true}) {
    const AwqWeight a = make_awq(256, 128, 64);
    ws.push_back(pack_awq(a, 64));
    ws.back().int8_activations = q8;
  }
  for (bool q8 : {false, true}) {
    ws.push_back(ops::pack_linear_int8(make_weight(DType::F32, 96, 128, 0.05f).t));
    ws.back().int8_activations = q8;
  }
  if (ops::bf16_dot_available()) ws.push_back(ops::pack_linear_bf16(make_weight(DType::F32, 96, 128, 0.05f).t));
  const int64_t kGuard = 7;
  for (const std::vector<int64_t>& rows : std::vector<std::vector<int64_t>>{{1, 1, 1, 1, 1, 1},
                                                                            {3, 0, 70, 1, 2, 65},
                                                                            {0, 0, 0, 0, 0, 0}}) {
    std::vector<std::vector<float>> xs, outs, refs;
    std::vector<ops::LinearJob> jobs;
    for (size_t i = 0; i < ws.size(); ++i) {
      const int64_t M = rows[i % rows.size()];
      xs.push_back(randn(std::max<int64_t>(M, 1) * ws[i].k));
      outs.emplace_back(M * ws[i].n + kGuard, NAN);
      refs.emplace_back(M * ws[i].n, NAN);
      if (M > 0) ops::linear(xs[i].data(), M, ws[i], Tensor{}, refs[i].data());
    }
    for (size_t i = 0; i < ws.size(); ++i) jobs.push_back({xs[i].data(), rows[i % rows.size()], &ws[i], outs[i].data()});
    ops::linear_group(jobs.data(), (int64_t)jobs.size());
    for (size_t i = 0; i < ws.size(); ++i) {
      const std::string what = std::string("linear_group ") + ws[i].traits().name + " M " + std::to_string(jobs[i].M);
      expect(std::memcmp(outs[i].data(), refs[i].data(), refs[i].size() * sizeof(float)) == 0,
             what + ": equals ops::linear");
      bool guard = true;
      for (int64_t g = 0; g < kGuard; ++g) guard = guard && std::isnan(outs[i][refs[i].size() + g]);
      expect(guard, what + ": nothing written past the output");
    }
  }
  const ops::LinearWeight big = ops::pack_linear(make_weight(DType::F16, 1000, 64, 0.05f).t);
  const std::vector<float> x = randn(64);
  std::vector<float> out(1000, NAN), ref(1000, NAN);
  const ops::LinearJob one{x.data(), 1, &big, out.data()};
  ops::linear_group(&one, 1);
  ops::linear(x.data(), 1, big, Tensor{}, ref.data());
  expect(out == ref, "linear_group: one job alone equals ops::linear");
  // 64 threads (oversubscribed here): a 64-core split of 8 decode experts, more threads than most jobs have
  // panels, so threads share jobs and jobs span threads; still each job's exact output.
  std::vector<ops::LinearJob> experts;
  std::vector<std::vector<float>> eouts(8, std::vector<float>(big.n, NAN));
  for (auto& o : eouts) experts.push_back({x.data(), 1, &big, o.data()});
  ops::set_num_threads(64);
  ops::linear_group(experts.data(), (int64_t)experts.size());
  ops::set_num_threads(g_threads);
  for (const auto& o : eouts) expect(o == ref, "linear_group: 8 jobs over 64 threads equal ops::linear");
  const ops::LinearJob no_weight{x.data(), 1, nullptr, out.data()};
  expect(throws([&] { ops::linear_group(&no_weight, 1); }), "linear_group rejects a job without a weight");
}

// x quantized as ops.h defines int8 activations: per row and block of `block` values (32; AMX: the group
// size), d = max|x| / 127 (fp32), q = round-half-even(x * (127 / max|x|)) (fp32 product); returns d * q.
std::vector<float> quantize_q8(const std::vector<float>& x, int64_t M, int64_t K, int64_t block) {
  std::vector<float> xq(x.size());
  for (int64_t m = 0; m < M; ++m)
    for (int64_t k0 = 0; k0 < K; k0 += block) {
      float amax = 0.0f;
      for (int64_t k = k0; k < k0 + block; ++k) amax = std::max(amax, std::fabs(x[m * K + k]));
      const float d = amax / 127.0f, inv = amax > 0.0f ? 127.0f / amax : 0.0f;
      for (int64_t k = k0; k < k0 + block; ++k) {
        const float q = std::clamp(std::nearbyint(x[m * K + k] * inv), -128.0f, 127.0f);
        xq[m * K + k] = d * q;  // exact: q has at most 8 bits
      }
    }
  return xq;
}

bool same_bits(const float* a, const float* b, int64_t n) { return std::memcmp(a, b, sizeof(float) * (size_t)n) == 0; }

// Whether `out`, x @ w^T computed with AMX tiles on, holds the bits the call gives with them off (the VNNI kernel's,
// for int8 activations); the tiles are on again after it.
bool same_bits_without_amx(const std::vector<float>& x, int64_t M, const ops::LinearWeight& w, const Tensor& bias,
                           const std::vector<float>& out) {
  std::vector<float> dot(out.size(), NAN);
  ops::cpu::use_amx(false);
  ops::linear(x.data(), M, w, bias, dot.data());
  ops::cpu::use_amx(true);
  return same_bits(dot.data(), out.data(), (int64_t)out.size());
}

// AWQ int4 x int8 activations on one kernel ("dot": AVX2 x per 32 values, VNNI per group; "amx": AMX-INT8 tiles from kLinearAmxInt8MinRows rows on, x per
// group) against the float64 product of the quantized operands (only the order of fp32 sums differs): decode
// and prefill row counts,
// whole and partial 16- and 32-row tiles, K chunks of 512 with a tail, the dot kernel's k spans of 1,024 over a
// panel shared by several tiles (K 1,152, 1,536, 2,048, and 1,088 in groups of 32), M blocks (1,000 rows of K
// 2,048: two on AMX, eight of the dot kernel's 126 / 128 rows; 127 and 129 rows: a last block of one row),
// zeros, zeros with a bias, and symmetric heads (every zero 8) without and with one, columns past N, zero rows,
// NaN-poisoned outputs (every element must be written).
void test_linear_int4_q8(const char* kernel) {
  struct Shape {
    int64_t M, N, K, g;
  };
  const Shape shapes[] = {{1, 8, 32, 32},      {3, 200, 640, 128},  {16, 64, 256, 64},  {31, 96, 576, 32},
                          {32, 40, 1152, 128}, {33, 72, 576, 64},   {47, 200, 1536, 64}, {64, 32, 96, 32},
                          {100, 136, 576, 64}, {300, 33 * 8, 1152, 128}, {700, 64, 256, 32},
                          {1000, 40, 2048, 128}, {20, 72, 1088, 32}, {127, 40, 2048, 64}, {129, 40, 2048, 32},
                          {40, 56, 640, 64}, {3, 56, 640, 64}};  // 56: a last panel of 24 columns
  for (const Shape& s : shapes)
    for (int variant = 0; variant < 4; ++variant) {
      const bool with_bias = variant % 2 == 1, symmetric = variant >= 2;
      AwqWeight a = make_awq(s.N, s.K, s.g, symmetric);
      ops::LinearWeight w = pack_awq(a, (int32_t)s.g);
      expect(w.group_head == (symmetric ? ops::GroupHead::Symmetric : ops::GroupHead::Zeros),
             "an AWQ weight packs into Symmetric heads exactly when every zero is 8");
      w.int8_activations = true;
      Weight b = make_weight(DType::F32, s.N, 0);
      std::vector<float> x = randn(s.M * s.K), out(s.M * s.N, NAN);
      for (int64_t k = 0; k < s.K; ++k) x[(s.M / 2) * s.K + k] = 0.0f;  // a zero row: d = 0
      ops::linear(x.data(), s.M, w, with_bias ? b.t : Tensor{}, out.data());
      const bool tiles = std::strcmp(kernel, "amx") == 0 && s.M >= ops::kLinearAmxInt8MinRows;
      if (tiles)  // the tiles give VNNI's bits: the same x per group, integer sums and fp32 steps in its order
        expect(same_bits_without_amx(x, s.M, w, with_bias ? b.t : Tensor{}, out),
               "linear int4 x int8 g" + std::to_string(s.g) + " M " + std::to_string(s.M) + " N " +
                   std::to_string(s.N) + " K " + std::to_string(s.K) + (with_bias ? " bias" : "") +
                   (symmetric ? " symmetric" : "") + ": AMX tiles give the VNNI kernel's bits");
      const bool vnni_groups = std::strcmp(g_isa, "avx512") == 0;
      const std::vector<float> xq = quantize_q8(x, s.M, s.K, tiles || vnni_groups ? s.g : 32);
      const std::vector<float> ref = linear_f64(xq, s.M, a.dense, s.N, s.K, with_bias ? b.f32.data() : nullptr);
      expect_close(out, ref,
                   std::string("linear int4 x int8 (") + kernel + ") g" + std::to_string(s.g) + " M " +
                       std::to_string(s.M) + " N " + std::to_string(s.N) + " K " + std::to_string(s.K) +
                       (with_bias ? " bias" : "") + (symmetric ? " symmetric" : ""));
    }
  // The integer sums at their extremes: every q 0 or 15 (q - 8 = -8 or 7: the AVX2 Symmetric tiles start at -8 x
  // x's pair sums and must land back in int16), or alternating, against rows of qx all +127 or all -127, and a row
  // of mixed signs; 5 rows: a 4-row tile and a single one
  for (uint32_t fill : {0x00000000u, 0xffffffffu, 0xf0f0f0f0u})
    for (bool symmetric : {true, false}) {
      const int64_t M = 5, N = 64, K = 256, g = 32;
      const AwqWeight a = make_awq(N, K, g, symmetric, fill);
      ops::LinearWeight w = pack_awq(a, g);
      w.int8_activations = true;
      std::vector<float> x(M * K), out(M * N, NAN);
      for (int64_t m = 0; m < M; ++m)
        for (int64_t k = 0; k < K; ++k) x[m * K + k] = m == 4 ? (k % 3 == 0 ? -1.0f : 1.0f) : (m % 2 ? -1.0f : 1.0f);
      ops::linear(x.data(), M, w, Tensor{}, out.data());
      const std::vector<float> ref = linear_f64(quantize_q8(x, M, K, 32), M, a.dense, N, K, nullptr);
      expect_close(out, ref, std::string("linear int4 x int8 (") + kernel + ") at the integer extremes, words " +
                                 std::to_string(fill) + (symmetric ? " symmetric" : ""));
    }
  // Rows of tiny values (max |x| 1e-38 and 1e-30 per group: 127 / max overflows fp32 for the first): finite outputs,
  // and on the tiles (a call of 32 rows) the VNNI kernel's bits
  for (bool symmetric : {false, true}) {
    const int64_t M = 32, N = 32, K = 256, g = 64;
    const AwqWeight a = make_awq(N, K, g, symmetric);
    ops::LinearWeight w = pack_awq(a, g);
    w.int8_activations = true;
    std::vector<float> x = randn(M * K), out(M * N, NAN);
    for (int64_t i = 0; i < M * K; ++i) x[i] *= i / K % 2 ? 1e-30f : 1e-38f;
    ops::linear(x.data(), M, w, Tensor{}, out.data());
    bool finite = true;
    for (float v : out) finite &= std::isfinite(v) && std::fabs(v) < 1e-25f;
    const std::string name = std::string("linear int4 x int8 (") + kernel + ") of tiny rows" +
                             (symmetric ? " symmetric" : "");
    expect(finite, name + ": finite and tiny");
    if (std::strcmp(kernel, "amx") == 0) expect(same_bits_without_amx(x, M, w, Tensor{}, out), name + ": VNNI's bits");
  }
}

void test_linear_int4() {
  struct Shape {
    int64_t M, N, K, g;
  };
  const Shape shapes[] = {{1, 8, 32, 32},     {1, 576, 576, 64},  {2, 40, 96, 32},    {3, 200, 640, 128},
                          {5, 1536, 576, 64}, {12, 72, 256, 128}, {13, 64, 1536, 64}, {25, 96, 576, 32},
                          {40, 200, 384, 128}, {100, 136, 576, 64}, {7, 8, 64, 64}};
  for (const Shape& s : shapes)
    for (bool symmetric : {false, true}) {
      AwqWeight a = make_awq(s.N, s.K, s.g, symmetric);
      const ops::LinearWeight w = pack_awq(a, (int32_t)s.g);
      expect(w.size_bytes() == (s.N + 31) / 32 * (s.K / s.g) * 32 * ((symmetric ? 2 : 3) + s.g / 2),
             "int4 panels: per group and column an fp16 scale, a zero unless symmetric, the nibbles");
      for (int with_bias = 0; with_bias < 2; ++with_bias) {
        Weight b = make_weight(DType::F32, s.N, 0);
        std::vector<float> x = randn(s.M * s.K), out(s.M * s.N, NAN);
        ops::linear(x.data(), s.M, w, with_bias ? b.t : Tensor{}, out.data());
        const std::vector<float> ref = linear_f64(x, s.M, a.dense, s.N, s.K, with_bias ? b.f32.data() : nullptr);
        expect_close(out, ref,
                     "linear int4 g" + std::to_string(s.g) + " M " + std::to_string(s.M) + " N " +
                         std::to_string(s.N) + " K " + std::to_string(s.K) + (with_bias ? " bias" : "") +
                         (symmetric ? " symmetric" : ""));
      }
    }
  // int8 activations (AVX2 vpmaddubsw or AVX-512 VNNI; under generic the flag changes nothing): within
  // the stated bound of 1e-2 relative to the float64 reference of the unrounded x, and visibly not the fp32
  // path; then against the float64 reference of the quantized operands on every kernel (test_linear_int4_q8)
  const bool q8_runs = ops::int8_dot_available();
  for (const Shape& s : shapes) {
    AwqWeight a = make_awq(s.N, s.K, s.g);
    ops::LinearWeight w = pack_awq(a, (int32_t)s.g);
    w.int8_activations = true;
    Weight b = make_weight(DType::F32, s.N, 0);
    std::vector<float> x = randn(s.M * s.K), out(s.M * s.N, NAN);
    ops::linear(x.data(), s.M, w, b.t, out.data());
    const std::vector<float> ref = linear_f64(x, s.M, a.dense, s.N, s.K, b.f32.data());
    const std::string name = "linear int4 x int8 g" + std::to_string(s.g) + " M " + std::to_string(s.M) + " N " +
                             std::to_string(s.N) + " K " + std::to_string(s.K);
    expect_close(out, ref, name, 1e-2);
    if (q8_runs) expect(rel_err(out, ref) > 1e-6, name + " ran the int8 path");
  }
  if (!q8_runs) {
    std::printf("skip [%s] linear int4 x int8: no int8 dot-product kernels here\n", g_isa);
  } else {
    if (!ops::int8_amx_available()) std::printf("skip [%s] linear int4 x int8 on AMX tiles: no AMX-INT8 here\n", g_isa);
    for (bool amx : {false, true}) {
      if (amx && (ops::cpu::use_amx(true), !ops::int8_amx_available())) continue;
      ops::cpu::use_amx(amx);
      test_linear_int4_q8(amx ? "amx" : "dot");
    }
    ops::cpu::use_amx(true);
  }
  // int8 weights (the lm_head of int8-activation decode), where the CPU has the kernels: against the double
  // product with the weight as ops.h defines the int8 panels (per 32 values along K, d = fp16(max |w| / 127),
  // q = round(w / d)), so that, as above, only the rounding of x is left to the 1e-2 bound (with the weight's
  // rounding too, 8 outputs of one block exceed 1e-2 by chance about once in four draws)
  if (ops::int8_dot_available()) {
    for (const Shape& s : shapes) {
      Weight w = make_weight(DType::BF16, s.N, s.K, 0.05f);
      std::vector<float> wq(s.N * s.K);
      for (int64_t n = 0; n < s.N; ++n)
        for (int64_t k0 = 0; k0 < s.K; k0 += 32) {
          float amax = 0.0f;
          for (int64_t k = k0; k < k0 + 32; ++k) amax = std::max(amax, std::fabs(float_value(w.t, n * s.K + k)));
          const float d = f16_to_f32(f32_to_f16(amax / 127.0f));
          for (int64_t k = k0; k < k0 + 32; ++k)
            wq[n * s.K + k] = d == 0.0f ? 0.0f : std::clamp(std::nearbyint(float_value(w.t, n * s.K + k) / d), -127.0f, 127.0f) * d;
        }
      ops::LinearWeight packed = ops::pack_linear_int8(w.t);
      packed.int8_activations = true;
      std::vector<float> x = randn(s.M * s.K), out(s.M * s.N, NAN), ref(out.size());
      ops::linear(x.data(), s.M, packed, Tensor{}, out.data());
      ops::reference::linear(x.data(), s.M, make_view(wq.data(), DType::F32, s.N, s.K), Tensor{}, ref.data());
      expect_close(out, ref, "linear int8 x int8 M " + std::to_string(s.M) + " N " + std::to_string(s.N) + " K " +
                                 std::to_string(s.K), 1e-2);
    }
  }
  // a source that says symmetric but gives another zero is refused by name, also from a packing thread (N 1,024:
  // several panel ranges); the one zero that is not 8 sits in the last group of the last panel
  {
    AwqWeight sym = make_awq(1024, 128, 32, true);
    sym.qzeros.back() = (int32_t)0x88888878u;  // nibble 1 of the last word: column 1016 + 2 (AWQ order)
    Int4Tensors t;
    t.layout = Int4Layout::AwqGemm;
    t.values = sym.qw, t.zeros = sym.qz, t.scales = sym.sc;
    Int4Source src = int4_source(t, 1024, 128, 32, "test");
    expect(!src.symmetric, "an AWQ source with one zero other than 8 is not symmetric");
    src.symmetric = true;
    std::string msg;
    try {
      ops::pack_linear_int4(src);
    } catch (const std::exception& e) {
      msg = e.what();
    }
    expect(msg.find("symmetric source has zero 7 in group 3, output 1018") != std::string::npos,
           "the packer names the zero of a symmetric source that is not 8, got: " + msg);
  }
  // shape errors name the tensor
  AwqWeight a = make_awq(64, 128, 64);
  expect(throws([&] { pack_awq(a, 48); }), "the AWQ layout rejects group size 48");
  expect(throws([&] { pack_awq(a, 32); }), "the AWQ layout rejects qzeros of another g");
  expect(throws([&] { pack_awq_tensors(a.qw, a.sc, a.sc, 64); }), "the AWQ layout rejects F16 qzeros");
}

// MXFP4 (gpt-oss's experts, ops::GroupHead::Mxfp4) in HF's layout and in GGUF's: random codes, scales around 2^-6 with
// the edge bytes e = 0, 1 (below fp32's normal range: read as 0) and 2 placed in some blocks, a whole block of
// code 8 (-0); read through model/mxfp4.h's sources with and without a row order (a fused gate/up's rows). Against
// the float64 product of the format's definition (e2m1(code) * 2^(e - 127)): the fp32 path within 1e-5, int8
// activations within 1e-5 of the float64 product of the rounded x (blocks of 32) and 1e-2 of the exact one; the two
// layouts pack to the same bytes (4.25 bits a weight); one row gives the same bits alone and in a call of 40; the
// NaN scale (255) is refused naming the tensor; NaN-poisoned outputs.
struct Mxfp4Weight {
  std::vector<uint8_t> blocks, scales, ggml;  // HF [N, K / 32, 16] and [N, K / 32]; GGUF [N, K / 32, 17]
  std::vector<double> dense;                  // [N, K] (rows in stored order)
  Tensor hf_blocks, hf_scales, ggml_t;
};
// OCP e2m1 from its fields (sign, 2-bit exponent with bias 1, 1-bit mantissa; exponent 0: subnormal), not from the
// kernels' table.
double e2m1_value(int code) {
  const int e = (code >> 1) & 3, m = code & 1;
  const double magnitude = e == 0 ? 0.5 * m : std::ldexp(1.0 + 0.5 * m, e - 1);
  return code & 8 ? -magnitude : magnitude;
}
Mxfp4Weight make_mxfp4(int64_t N, int64_t K) {
  Mxfp4Weight a;
  const int64_t nb = K / 32;
  a.blocks.resize(N * nb * 16), a.scales.resize(N * nb), a.ggml.resize(N * nb * 17), a.dense.resize(N * K);
  for (auto& b : a.blocks) b = (uint8_t)(g_rng() >> 56);
  for (auto& e : a.scales) e = (uint8_t)(121 + g_rng() % 7);  // values up to 6 * 2^-3
  const uint8_t edges[] = {0, 1, 2};
  for (int i = 0; i < 3 && i < N * nb; ++i) a.scales[(i * 7919) % (N * nb)] = edges[i];
  if (N * nb > 4) std::fill(a.blocks.begin() + 16 * 3, a.blocks.begin() + 16 * 4, 0x88);
  for (int64_t n = 0; n < N; ++n)
    for (int64_t b = 0; b < nb; ++b) {
      const uint8_t* q = &a.blocks[(n * nb + b) * 16];
      uint8_t* g = &a.ggml[(n * nb + b) * 17];
      g[0] = a.scales[n * nb + b];
      for (int i = 0; i < 32; ++i) {
        const int code = i % 2 ? q[i / 2] >> 4 : q[i / 2] & 15;  // HF: value 2j low nibble, 2j + 1 high
        g[1 + i % 16] |= (uint8_t)(i < 16 ? code : code << 4);    // GGUF: value j in byte j % 16, high for j >= 16
        a.dense[n * K + 32 * b + i] = e2m1_value(code) * std::ldexp(1.0, g[0] - 127);
      }
    }
  a.hf_blocks = make_view(a.blocks.data(), DType::U8, N, nb, 16);
  a.hf_scales = make_view(a.scales.data(), DType::U8, N, nb);
  a.ggml_t = make_view(a.ggml.data(), DType::MXFP4, N, K);
  return a;
}

// The checks of an FP4 weight w (MXFP4 / NVFP4 heads) of [N, K] whose float64 values are `dense`, on M random rows:
// with and without a bias, the fp32 path within 1e-5 of the float64 product; int8 activations (where the CPU has
// them) within 1e-5 of the float64 product of the rounded x (blocks of 32) and 1e-2 of the exact one; a row alone
// gives the bits it gives in the call (both paths); NaN-poisoned outputs.
void expect_fp4_linear(ops::LinearWeight& w, const std::vector<double>& dense, int64_t M, int64_t N, int64_t K,
                       const std::string& name) {
  const bool q8_runs = ops::int8_dot_available();
  Weight b = make_weight(DType::F32, N, 0);
  std::vector<float> x = randn(M * K, 4.0f);
  for (int with_bias = 0; with_bias < 2; ++with_bias)
    for (bool int8_x : {false, true}) {
      if (int8_x && !q8_runs) continue;
      w.int8_activations = int8_x;
      std::vector<float> out(M * N, NAN);
      ops::linear(x.data(), M, w, with_bias ? b.t : Tensor{}, out.data());
      const float* bias = with_bias ? b.f32.data() : nullptr;
      const std::string what = name + (with_bias ? " bias" : "") + (int8_x ? " int8 x" : "");
      if (!int8_x) {
        expect_close(out, linear_f64(x, M, dense, N, K, bias), what);
        continue;
      }
      expect_close(out, linear_f64(quantize_q8(x, M, K, 32), M, dense, N, K, bias), what);
      if (K >= 256)  // the 1e-2 bound is statistical: a row of one block misses it by chance
        expect_close(out, linear_f64(x, M, dense, N, K, bias), what + " (unrounded x)", 1e-2);
    }
  for (bool int8_x : {false, true}) {  // batch-invariant: row 0 alone gives the bits it gives in the call
    if (M < 2 || (int8_x && !q8_runs)) continue;
    w.int8_activations = int8_x;
    std::vector<float> all(M * N), one(N);
    ops::linear(x.data(), M, w, Tensor{}, all.data());
    ops::linear(x.data(), 1, w, Tensor{}, one.data());
    expect(std::memcmp(all.data(), one.data(), one.size() * 4) == 0,
           name + (int8_x ? " int8 x" : "") + ": a row alone = the same row in the call");
  }
}

void test_linear_mxfp4() {
  struct Shape {
    int64_t M, N, K;
  };
  const Shape shapes[] = {{1, 8, 32},     {1, 96, 2880},  {2, 40, 96},     {5, 200, 640},   {13, 64, 1536},
                          {25, 96, 576},  {40, 72, 384},  {100, 136, 576}, {300, 40, 1152}, {7, 33, 2880}};
  for (const Shape& s : shapes) {
    Mxfp4Weight a = make_mxfp4(s.N, s.K);
    const std::string name = "linear mxfp4 M " + std::to_string(s.M) + " N " + std::to_string(s.N) + " K " +
                             std::to_string(s.K);
    ops::LinearWeight w = ops::pack_linear_int4(mxfp4_source(a.hf_blocks, a.hf_scales, nullptr, "t"));
    const ops::LinearWeight wg = ops::pack_linear_int4(mxfp4_ggml_source(a.ggml_t, nullptr, "t"));
    expect(w.group_head == ops::GroupHead::Mxfp4 && w.group_size == 32 &&
               w.size_bytes() == (s.N + 31) / 32 * 32 * s.K / 32 * 17,
           name + ": MXFP4 heads, 4.25 bits a weight");
    expect(wg.size_bytes() == w.size_bytes() &&
               std::memcmp(wg.storage.get(), w.storage.get(), (size_t)w.size_bytes()) == 0,
           name + ": HF's and GGUF's layouts pack to the same bytes");
    expect_fp4_linear(w, a.dense, s.M, s.N, s.K, name);
  }
  // a row order: outputs are stored rows 2j + 1 (the up rows of gpt-oss's interleaved gate_up)
  {
    const int64_t N = 64, K = 320;
    Mxfp4Weight a = make_mxfp4(N, K);
    auto rows = std::make_shared<std::vector<int32_t>>();
    std::vector<double> dense;
    for (int32_t j = 0; j < N / 2; ++j) {
      rows->push_back(2 * j + 1);
      dense.insert(dense.end(), a.dense.begin() + (2 * j + 1) * K, a.dense.begin() + (2 * j + 2) * K);
    }
    const ops::LinearWeight w = ops::pack_linear_int4(mxfp4_source(a.hf_blocks, a.hf_scales, rows, "t"));
    std::vector<float> x = randn(3 * K), out(3 * N / 2, NAN);
    ops::linear(x.data(), 3, w, Tensor{}, out.data());
    expect_close(out, linear_f64(x, 3, dense, N / 2, K, nullptr), "linear mxfp4 with a row order");
  }
  // the NaN scale: refused with the tensor, row and block named
  {
    Mxfp4Weight a = make_mxfp4(40, 96);
    a.scales[37 * 3 + 2] = 255;
    std::string msg;
    try {
      ops::pack_linear_int4(mxfp4_source(a.hf_blocks, a.hf_scales, nullptr, "layers.0.experts.down_proj"));
    } catch (const Error& e) {
      msg = e.what();
    }
    expect(msg.find("layers.0.experts.down_proj: MXFP4 row 37 block 2 has the NaN scale (255)") != std::string::npos,
           "an MXFP4 NaN scale is refused by name, got: " + msg);
  }
}

// NVFP4 (compressed-tensors nvfp4-pack-quantized, ops::GroupHead::Nvfp4) read through model/int4_layouts.h's reader:
// random codes, random FP8 E4M3 block scales with the edge bytes 0, 1 (the least subnormal), 0x80 (-0), 0x7e (448) and
// a negative scale placed in some blocks, a global scale that is no power of two. Against the float64 product of the
// format's definition (e2m1(code) * e4m3(scale) / global, both decoded from their bit fields here): the fp32 path
// within 1e-5, int8 activations within 1e-5 of the float64 product of the rounded x (blocks of 32) and 1e-2 of the
// exact one; 5 bits a weight; a row alone gives the bits it gives in a call; compressed-tensors' MXFP4 layout packs to
// the bytes of gpt-oss's (the same numbers); NaN scales, a global scale of 0 and a wrong group size are refused by
// name; NaN-poisoned outputs.
double e4m3_value(uint8_t b) {
  const int e = (b >> 3) & 15, m = b & 7;
  const double magnitude = e == 0 ? m / 8.0 * std::ldexp(1.0, -6) : (1.0 + m / 8.0) * std::ldexp(1.0, e - 7);
  return b & 0x80 ? -magnitude : magnitude;
}
struct Nvfp4Weight {
  std::vector<uint8_t> packed, scales;  // [N, K / 2], [N, K / 16]
  float global = 37.3f;
  std::vector<double> dense;  // [N, K]
  Tensor values, scale_t;
};
Nvfp4Weight make_nvfp4(int64_t N, int64_t K) {
  Nvfp4Weight a;
  a.packed.resize(N * K / 2), a.scales.resize(N * K / 16), a.dense.resize(N * K);
  for (auto& b : a.packed) b = (uint8_t)(g_rng() >> 56);
  for (auto& b : a.scales) b = (uint8_t)(40 + g_rng() % 40);  // exponent fields 5..9: 0.25 .. 7.5
  const uint8_t edges[] = {0x00, 0x01, 0x80, 0x7e, 0xc3};
  for (int i = 0; i < 5 && i < N * K / 16; ++i) a.scales[(i * 7919) % (N * K / 16)] = edges[i];
  for (int64_t n = 0; n < N; ++n)
    for (int64_t k = 0; k < K; ++k) {
      const uint8_t byte = a.packed[n * (K / 2) + k / 2];
      const int code = k % 2 ? byte >> 4 : byte & 15;
      a.dense[n * K + k] = e2m1_value(code) * e4m3_value(a.scales[n * (K / 16) + k / 16]) / (double)a.global;
    }
  a.values = make_view(a.packed.data(), DType::U8, N, K / 2);
  a.scale_t = make_view(a.scales.data(), DType::U8, N, K / 16);
  return a;
}
Int4Source nvfp4_source(const Nvfp4Weight& a, int64_t N, int64_t K, const std::string& what, int64_t group = 16) {
  Int4Tensors t;
  t.layout = Int4Layout::Nvfp4PackQuantized;
  t.values = a.values, t.scales = a.scale_t;
  t.global_scale = make_view(const_cast<float*>(&a.global), DType::F32, 1);
  return int4_source(t, N, K, group, what);
}

void test_linear_nvfp4() {
  struct Shape {
    int64_t M, N, K;
  };
  const Shape shapes[] = {{1, 8, 32},     {1, 96, 2880},  {2, 40, 96},     {5, 200, 640},   {13, 64, 1536},
                          {25, 96, 576},  {40, 72, 384},  {100, 136, 576}, {300, 40, 1152}, {7, 33, 2880}};
  for (const Shape& s : shapes) {
    Nvfp4Weight a = make_nvfp4(s.N, s.K);
    const std::string name = "linear nvfp4 M " + std::to_string(s.M) + " N " + std::to_string(s.N) + " K " +
                             std::to_string(s.K);
    ops::LinearWeight w = ops::pack_linear_int4(nvfp4_source(a, s.N, s.K, "t"));
    expect(w.group_head == ops::GroupHead::Nvfp4 && w.group_size == 32 &&
               w.size_bytes() == (s.N + 31) / 32 * 32 * s.K * 5 / 8 && w.output_scale == 0.5f / a.global,
           name + ": NVFP4 heads, 5 bits a weight, the global scale as the outputs' factor");
    expect_fp4_linear(w, a.dense, s.M, s.N, s.K, name);
  }
  // in a group of jobs (panels split over threads, no bias there): the same outputs as alone
  {
    Nvfp4Weight a = make_nvfp4(96, 256);
    const ops::LinearWeight w = ops::pack_linear_int4(nvfp4_source(a, 96, 256, "t"));
    std::vector<float> x = randn(3 * 256), alone(3 * 96), grouped(3 * 96, NAN);
    ops::linear(x.data(), 3, w, Tensor{}, alone.data());
    const ops::LinearJob job{x.data(), 3, &w, grouped.data()};
    ops::linear_group(&job, 1);
    expect(std::memcmp(alone.data(), grouped.data(), alone.size() * 4) == 0, "linear nvfp4 in linear_group");
  }
  // compressed-tensors' MXFP4 (weight_packed [N, K / 2], weight_scale [N, K / 32]) packs as gpt-oss's HF layout
  {
    const int64_t N = 40, K = 320;
    Mxfp4Weight a = make_mxfp4(N, K);
    Int4Tensors t;
    t.layout = Int4Layout::Mxfp4PackQuantized;
    t.values = make_view(a.blocks.data(), DType::U8, N, K / 2), t.scales = a.hf_scales;
    const ops::LinearWeight ct = ops::pack_linear_int4(int4_source(t, N, K, 32, "t"));
    const ops::LinearWeight hf = ops::pack_linear_int4(mxfp4_source(a.hf_blocks, a.hf_scales, nullptr, "t"));
    expect(ct.group_head == ops::GroupHead::Mxfp4 && ct.size_bytes() == hf.size_bytes() &&
               std::memcmp(ct.storage.get(), hf.storage.get(), (size_t)hf.size_bytes()) == 0,
           "compressed-tensors' MXFP4 packs to the bytes of gpt-oss's layout");
  }
  // refusals, by name
  auto message = [](auto&& f) {
    try {
      f();
    } catch (const Error& e) {
      return std::string(e.what());
    }
    return std::string();
  };
  {
    Nvfp4Weight a = make_nvfp4(40, 96);
    a.scales[37 * 6 + 2] = 0xff;
    const std::string msg =
        message([&] { ops::pack_linear_int4(nvfp4_source(a, 40, 96, "layers.0.mlp.down_proj")); });
    expect(msg.find("layers.0.mlp.down_proj.weight_scale[37, 2] is NaN") != std::string::npos,
           "an NVFP4 NaN scale is refused by name, got: " + msg);
    a.global = 0.0f;
    const std::string zero = message([&] { nvfp4_source(a, 40, 96, "q_proj"); });
    expect(zero.find("q_proj.weight_global_scale is 0") != std::string::npos,
           "an NVFP4 global scale of 0 is refused by name, got: " + zero);
    a.global = 1.0f;
    const std::string group = message([&] { nvfp4_source(a, 40, 96, "q_proj", 32); });
    expect(group.find("the format's blocks are 16 inputs") != std::string::npos,
           "an NVFP4 layer with group size 32 is refused, got: " + group);
    const std::string shape = message([&] { nvfp4_source(a, 40, 128, "q_proj"); });
    expect(shape.find("q_proj.weight_packed has shape") != std::string::npos,
           "an NVFP4 layer of another shape is refused naming the tensor, got: " + shape);
  }
}

void test_linear_bf16_kernel(const char* kernel);

// bf16 pair panels (dtype='bfloat16'): against the double reference of the bf16-rounded x and weight
// (only the fp32 summation order differs), and visibly different from the unrounded product; on both
// the dot-product kernel and, where the CPU has AMX, the tile kernel (whole and partial 16-row tiles,
// K tails of 1-15 pair rows, M blocks of 256 rows).
void test_linear_bf16() {
  if (!ops::bf16_dot_available()) {
    std::printf("skip [%s] linear bf16: this CPU has no AVX512_BF16\n", g_isa);
    return;
  }
  if (!ops::bf16_amx_available()) std::printf("skip [%s] linear bf16 on AMX tiles: this CPU has no AMX-BF16\n", g_isa);
  for (bool amx : {false, true}) {
    if (ops::cpu::use_amx(amx) != amx) continue;
    test_linear_bf16_kernel(amx ? "amx" : "dot");
  }
  ops::cpu::use_amx(true);
}

void test_linear_bf16_kernel(const char* kernel) {
  struct Shape {
    int64_t M, N, K;
  };
  const Shape shapes[] = {{1, 1, 1},     {1, 37, 576},    {2, 65, 577},   {3, 100, 33},    {4, 64, 1536},
                          {12, 96, 576}, {13, 200, 576},  {25, 1, 7},     {40, 65, 1536},  {100, 129, 577},
                          {700, 70, 576}, {5, 33, 15},    {16, 32, 64},   {17, 64, 62},    {33, 96, 96},
                          {300, 33, 100}, {1, 56, 576},   {40, 56, 96}};  // 56: a last panel of 24 columns
  auto round_bf16 = [](std::vector<float> v) {
    for (float& x : v) x = bf16_to_f32(f32_to_bf16(x));
    return v;
  };
  for (DType dt : kWeightDTypes)
    for (const Shape& s : shapes)
      for (bool with_bias : {false, true}) {
        Weight w = make_weight(dt, s.N, s.K, 0.05f);
        Weight b;
        if (with_bias) b = make_weight(DType::F32, s.N, 0);
        std::vector<float> wf(s.N * s.K);  // the weight as stored, then rounded to bf16
        for (int64_t i = 0; i < s.N * s.K; ++i) wf[i] = float_value(w.t, i);
        std::vector<float> wr = round_bf16(wf), x = randn(s.M * s.K), xr = round_bf16(x);
        std::vector<float> out(s.M * s.N, NAN), ref(out.size()), exact(out.size());
        const ops::LinearWeight packed = ops::pack_linear_bf16(w.t);
        expect(packed.format == ops::WeightFormat::Bf16Pairs && packed.size_bytes() == (s.N + 31) / 32 * ((s.K + 1) / 2) * 128,
               "pack_linear_bf16: whole panels of pair rows");
        ops::linear(x.data(), s.M, packed, b.t, out.data());
        ops::reference::linear(xr.data(), s.M, make_view(wr.data(), DType::F32, s.N, s.K), b.t, ref.data());
        ops::reference::linear(x.data(), s.M, make_view(wf.data(), DType::F32, s.N, s.K), b.t, exact.data());
        const std::string name = std::string("linear bf16 pairs (") + kernel + ") from " + dt_name(dt) + " M " +
                                 std::to_string(s.M) + " N " +
                                 std::to_string(s.N) + " K " + std::to_string(s.K) + (with_bias ? " bias" : "");
        expect_close(out, ref, name);
        if (s.K >= 15) expect(rel_err(out, exact) > 1e-4, name + ": rounds to bf16");
        // bit for bit the same after a call of other rows (scratch, stack and tiles hold someone else's values)
        std::vector<float> other = randn((s.M + 37) * s.K), other_out((s.M + 37) * s.N), again(out.size(), NAN);
        ops::linear(other.data(), s.M + 37, packed, b.t, other_out.data());
        ops::linear(x.data(), s.M, packed, b.t, again.data());
        expect(std::memcmp(again.data(), out.data(), out.size() * 4) == 0, name + ": the same bits on a second call");
        // rows come out alike in a call of fewer rows, a single one included (on AMX CPUs every call takes the tiles)
        const int64_t h = s.M / 2;
        if (h > 0) {
          std::vector<float> tail((s.M - h) * s.N, NAN);
          ops::linear(x.data() + h * s.K, s.M - h, packed, b.t, tail.data());
          expect(std::memcmp(tail.data(), out.data() + h * s.N, tail.size() * 4) == 0, name + ": rows alike in fewer");
        }
      }
}

// Full and partial rotary (Phi-4-mini: head_dim 128, rotary_dim 96): the first rotary_dim dims of each head
// against the reference, the rest bit for bit as they were.
void test_rope() {
  const std::pair<int, int> dims[] = {{64, 0}, {6, 0}, {128, 0}, {128, 96}, {128, 64}, {128, 128}, {10, 4},
                                      {80, 2}, {96, 50}, {256, 64}};
  for (auto [head_dim, rotary_dim] : dims)
    for (float scaling : {1.0f, 0.75f}) {
      const int64_t n = 11;
      const int heads = 9, kv_heads = 3, rot = rotary_dim == 0 ? head_dim : rotary_dim;
      std::vector<float> inv_freq(rot / 2);
      for (int i = 0; i < rot / 2; ++i) inv_freq[i] = (float)std::pow(100000.0, -2.0 * i / rot);
      std::vector<int32_t> pos(n);
      for (int64_t t = 0; t < n; ++t) pos[t] = (int32_t)(g_rng() % 8192);
      pos[0] = 0;
      std::vector<float> q = randn(n * heads * head_dim), k = randn(n * kv_heads * head_dim);
      const std::vector<float> q_in = q, k_in = k;
      std::vector<float> q_ref = q, k_ref = k;
      ops::rope(q.data(), k.data(), pos.data(), n, heads, kv_heads, head_dim, inv_freq.data(), scaling, rotary_dim);
      ops::reference::rope(q_ref.data(), k_ref.data(), pos.data(), n, heads, kv_heads, head_dim, inv_freq.data(),
                           scaling, rotary_dim);
      const std::string name = " head_dim " + std::to_string(head_dim) + " rotary_dim " + std::to_string(rotary_dim) +
                               " scaling " + std::to_string(scaling);
      expect_close(q, q_ref, "rope q" + name);
      expect_close(k, k_ref, "rope k" + name);
      bool kept = true;
      for (size_t i = 0; i < q.size(); ++i) kept &= (int)(i % head_dim) < rot || q[i] == q_in[i];
      for (size_t i = 0; i < k.size(); ++i) kept &= (int)(i % head_dim) < rot || k[i] == k_in[i];
      expect(kept, "rope leaves dims >= rotary_dim as they were" + name);
    }
  std::vector<float> q(64), k(64), inv_freq(32);
  const int32_t pos = 3;
  for (int bad : {-2, 3, 66})
    expect(throws([&] { ops::rope(q.data(), k.data(), &pos, 1, 1, 1, 64, inv_freq.data(), 1.0f, bad); }),
           "rope rejects rotary_dim " + std::to_string(bad) + " of head_dim 64");
}

void test_silu_mul() {
  for (int64_t inter : {1, 15, 1536, 1537}) {
    const int64_t n = 5;
    std::vector<float> g = randn(n * inter, 4.0f), u = randn(n * inter), out(n * inter), ref(n * inter);
    if (inter > 100) g[3] = -100.0f, g[4] = 100.0f, g[5] = -88.5f, g[6] = 0.0f;
    ops::reference::silu_mul(g.data(), u.data(), n, inter, ref.data());
    ops::silu_mul(g.data(), u.data(), n, inter, out.data());
    expect_close(out, ref, "silu_mul inter " + std::to_string(inter));
    std::vector<float> g2 = g, u2 = u;
    ops::silu_mul(g2.data(), u.data(), n, inter, g2.data());
    ops::silu_mul(g.data(), u2.data(), n, inter, u2.data());
    expect_close(g2, ref, "silu_mul out = gate, inter " + std::to_string(inter));
    expect_close(u2, ref, "silu_mul out = up, inter " + std::to_string(inter));
  }
}

// gpt-oss's clamped SwiGLU against its definition in double: values on both sides of the clamps (gate past
// limit, up past +-limit), extremes, aliasing; and far from the unclamped SwiGLU (proof the clamps ran).
void test_clamped_swiglu_mul() {
  for (int64_t inter : {1, 15, 1536, 1537}) {
    const int64_t n = 5;
    std::vector<float> g = randn(n * inter, 6.0f), u = randn(n * inter, 6.0f), out(n * inter, NAN), ref(n * inter);
    if (inter > 100) g[3] = -100.0f, g[4] = 100.0f, g[5] = 7.0f, g[6] = 0.0f, u[7] = 1e30f, u[8] = -1e30f, g[9] = -1e30f;
    ops::reference::clamped_swiglu_mul(g.data(), u.data(), n, inter, 1.702f, 7.0f, ref.data());
    ops::clamped_swiglu_mul(g.data(), u.data(), n, inter, 1.702f, 7.0f, out.data());
    const std::string name = " inter " + std::to_string(inter);
    expect_close(out, ref, "clamped_swiglu_mul" + name);
    if (inter > 100) {
      std::vector<float> plain(n * inter);
      ops::reference::silu_mul(g.data(), u.data(), n, inter, plain.data());
      expect(rel_err(out, plain) > 0.1, "clamped_swiglu_mul" + name + ": far from the plain SwiGLU");
    }
    std::vector<float> g2 = g, u2 = u;
    ops::clamped_swiglu_mul(g2.data(), u.data(), n, inter, 1.702f, 7.0f, g2.data());
    ops::clamped_swiglu_mul(g.data(), u2.data(), n, inter, 1.702f, 7.0f, u2.data());
    expect(g2 == out, "clamped_swiglu_mul out = gate" + name);
    expect(u2 == out, "clamped_swiglu_mul out = up" + name);
  }
  expect(throws([] { float x = 0; ops::clamped_swiglu_mul(&x, &x, 1, 1, 1.702f, 0.0f, &x); }),
         "clamped_swiglu_mul refuses limit 0");
}

// GeGLU against torch's definition in double; per element within 1e-6 of |gate * up| (where the tanh form
// itself cancels, for gate << 0, only that absolute bound means anything); extremes, aliasing, threads.
void test_gelu_tanh_mul() {
  for (int64_t inter : {1, 15, 1536, 1537, 9217}) {
    const int64_t n = 5;
    std::vector<float> g = randn(n * inter, 4.0f), u = randn(n * inter), out(n * inter, NAN), ref(n * inter);
    if (inter > 100) g[3] = -100.0f, g[4] = 100.0f, g[5] = -9.0f, g[6] = 0.0f, g[7] = 1e-20f, g[8] = -1e30f, g[9] = 1e30f;
    ops::reference::gelu_tanh_mul(g.data(), u.data(), n, inter, ref.data());
    ops::gelu_tanh_mul(g.data(), u.data(), n, inter, out.data());
    const std::string name = " inter " + std::to_string(inter);
    expect_close(out, ref, "gelu_tanh_mul" + name);
    double worst = 0;
    for (int64_t i = 0; i < n * inter; ++i)
      if (std::isfinite((double)g[i] * u[i]))
        worst = std::max(worst, std::fabs((double)out[i] - ref[i]) / std::max(1e-30, std::fabs((double)g[i] * u[i])));
    char buf[64];
    std::snprintf(buf, sizeof(buf), " (worst %.3g)", worst);
    expect(worst <= 1e-6, "gelu_tanh_mul per element vs |gate * up|" + name + buf);
    std::vector<float> g2 = g, u2 = u;
    ops::gelu_tanh_mul(g2.data(), u.data(), n, inter, g2.data());
    ops::gelu_tanh_mul(g.data(), u2.data(), n, inter, u2.data());
    expect(g2 == out, "gelu_tanh_mul out = gate" + name);
    expect(u2 == out, "gelu_tanh_mul out = up" + name);
  }
}

// softcap per element within 1e-6 (relative) of the double tanh, over odd sizes up to a 262k vocabulary row
// (threads), small and capped values, around vtanh's clamp (|x| = 9 cap), +-inf (to +-cap) and NaN (stays NaN);
// scale exactly the fp32 product.
void test_softcap_scale() {
  for (int64_t n : {1, 7, 16, 1001, 262147})
    for (float cap : {50.0f, 30.0f, 0.5f}) {
      std::vector<float> x = randn(n, cap * 2.0f);
      if (n > 100) {
        const float special[] = {0.0f, -0.0f, 1e-30f, -1e-30f, 1e-3f * cap, -0.5f * cap, 8.99f * cap, -9.0f * cap,
                                 9.01f * cap, 1e30f, -1e30f, INFINITY, -INFINITY};
        std::copy(std::begin(special), std::end(special), x.begin() + 17);
      }
      std::vector<float> out = x, ref = x;
      ops::softcap(out.data(), n, cap);
      ops::reference::softcap(ref.data(), n, cap);
      double worst = 0;
      for (int64_t i = 0; i < n; ++i)
        worst = std::max(worst, ref[i] == 0 ? std::fabs(out[i]) : std::fabs(((double)out[i] - ref[i]) / ref[i]));
      char buf[96];
      std::snprintf(buf, sizeof(buf), "softcap n %lld cap %g (worst %.3g)", (long long)n, cap, worst);
      expect(worst <= 1e-6, buf);
      std::vector<float> scaled = x, scaled_ref = x;
      ops::scale(scaled.data(), n, 0.0625f * cap + 0.01f);
      ops::reference::scale(scaled_ref.data(), n, 0.0625f * cap + 0.01f);
      expect(scaled == scaled_ref, "scale n " + std::to_string(n) + " is the fp32 product");
    }
  float nan = NAN;
  ops::softcap(&nan, 1, 50.0f);
  expect(std::isnan(nan), "softcap keeps a NaN a NaN");
  float x = 1.0f;
  expect(throws([&] { ops::softcap(&x, 1, 0.0f); }), "softcap rejects cap 0");
  expect(throws([&] { ops::softcap(&x, 1, -3.0f); }), "softcap rejects a negative cap");
}

// log_sum_exp per row within 2e-6 (absolute; it is a log) of the double reference, over rows of odd lengths up
// to a 262k vocabulary (threads), logits of a wide spread, -inf entries (masked tokens) and a row of only -inf;
// outputs poisoned with NaN first, so a row left unwritten fails.
void test_log_sum_exp() {
  for (int64_t n : {1, 7, 16, 1001, 49152, 262147}) {
    const int64_t rows = n > 100000 ? 2 : 5;
    std::vector<float> x = randn(rows * n, 8.0f), out(rows, NAN), ref(rows);
    std::vector<int32_t> argmax(rows, -7), ref_argmax(rows);
    if (n > 100) {
      x[3] = 60.0f, x[4] = -INFINITY, x[n + 5] = -80.0f;
      x[n + 40] = x[n + 70] = 50.0f;  // a tie for the maximum: the first index wins
      for (int64_t i = 0; i < n; ++i) x[(rows - 1) * n + i] = -INFINITY;
    }
    ops::log_sum_exp(x.data(), rows, n, out.data(), argmax.data());
    ops::reference::log_sum_exp(x.data(), rows, n, ref.data(), ref_argmax.data());
    expect(argmax == ref_argmax, "log_sum_exp argmax n " + std::to_string(n));
    double worst = 0;
    for (int64_t r = 0; r < rows; ++r) {
      const double d = ref[r] == out[r] ? 0.0 : std::fabs((double)out[r] - ref[r]);  // NaN (unwritten): inf
      worst = std::isnan(d) ? INFINITY : std::max(worst, d);
    }
    char buf[96];
    std::snprintf(buf, sizeof(buf), "log_sum_exp n %lld (worst %.3g)", (long long)n, worst);
    expect(worst <= 2e-6 * std::max(1.0, std::fabs((double)ref[0])), buf);
  }
  float x = 1.0f, out = 0.0f;
  expect(throws([&] { ops::log_sum_exp(&x, 1, 0, &out); }), "log_sum_exp rejects an empty row");
}

const char* g_attn_path = "f32";  // the path use_attention_path chose last
// The "int8" path's bound at unit scale: q in 16-bit fixed point (steps of 2^-15 of its largest value) moves the
// scores, and the output rows by up to 1.7e-4 (measured 2026-12-05, the worst row of a case with sinks; 5.4e-5 on a
// whole case), ~25x below what the pool's own 8-bit rounding does to them
constexpr double kInt8PathTol = 4e-4;

// Whether the "int8" path's VNNI kernel takes some task of this case: a decode-shaped one (at most 4 rows: query
// positions x the group's heads) with more than one key over a pool whose head_dim it takes.
bool int8_path_runs(int bits, int heads, int kv_heads, int hd, const std::vector<std::pair<int, int>>& q_ctx) {
  if (bits > 8 || hd % (bits == 8 ? 64 : 128) != 0) return false;
  for (auto& [ql, cl] : q_ctx)
    if (ql > 0 && ql * (heads / kv_heads) <= 4 && cl > 1) return true;
  return false;
}

// The paths of attention, chosen for the whole process: "f32" (fp32 FMAs over rows converted from bf16 or widened
// from int8 / int4 levels: exact over the pool's values), "bf16" (a bf16 pool's prefill and decode tasks on
// AVX512_BF16 dot products), "amx" (a bf16 pool's every task on AMX tiles where head_dim and block_size_tokens are
// multiples of 32, else as "bf16"), "int8" (an int8 / int4 pool's decode tasks on VNNI integer dot products). False
// (and "f32" set) where this CPU cannot take the path.
bool use_attention_path(const char* path) {
  g_attn_path = path;
  const bool want_amx = std::strcmp(path, "amx") == 0, want_int8 = std::strcmp(path, "int8") == 0;
  const bool want_bf16 = want_amx || std::strcmp(path, "bf16") == 0;
  const bool amx = ops::cpu::use_amx(want_amx) && ops::bf16_amx_available();
  const bool bf16 = ops::cpu::use_bf16_attention(want_bf16), int8 = ops::cpu::use_int8_attention(want_int8);
  if ((want_amx && !amx) || (want_bf16 && !bf16) || (want_int8 && !int8)) {
    ops::cpu::use_amx(false), ops::cpu::use_bf16_attention(false), ops::cpu::use_int8_attention(false);
    g_attn_path = "f32";
    return false;
  }
  return true;
}

// Every attention path back to its default (on where the CPU has it).
void default_attention_paths() {
  ops::cpu::use_amx(true), ops::cpu::use_bf16_attention(true), ops::cpu::use_int8_attention(true);
}

// A pool with several sequences written through kv_write at shuffled blocks; everything else NaN. bits 32: fp32
// pool, 16: bf16, 8 / 4: quantized (poison: all bytes 0xff, so an unwritten row's fp16 scale, or bf16 value, is
// NaN). With a sliding window, the blocks no query's window reaches are then freed as the engine will: their table
// entries set to -1 and their contents poisoned again.
// Attention options: the bound per output row (each row one head of one query), the scale of q (the scores' scale),
// whether a path other than fp32 should have run (one rounding the softmax weights to bf16: AMX tiles, or
// AVX512_BF16 dot products, path_rounds; or the int8 path's fixed points, int8_path_runs; then the result must
// differ from the fp32 path's, which rounds nothing: proof that the other path was taken), and the logit soft-cap
// (then the result must also be far from the uncapped attention: proof that the case exercises the cap), and
// attention sinks (a random logit per head, some above the scores, some below; then the result must be far from the
// sinkless one).
struct AttnCheck {
  double row_tol = 0;
  float q_scale = 1.0f;
  bool other_path = false;
  float softcap = 0.0f;
  bool sinks = false;
};

// The thread counts test_attention_case runs the kernels at, against one float64 reference (whose cost dominates):
// main() runs the attention tests once per ISA at 1, 2 and 3 threads; cases of decode key splits at 7, 8 and 9.
std::vector<int> g_attn_threads = {1};

// Runs the cases of f at the kernels' thread counts `threads` (test_attention_case's), then restores the previous.
template <class F>
void at_threads(std::vector<int> threads, F&& f) {
  std::swap(g_attn_threads, threads);
  f();
  std::swap(g_attn_threads, threads);
}

void test_attention_case(int num_heads, int num_kv_heads, int head_dim, int block_size_tokens, int window,
                         const std::vector<std::pair<int, int>>& q_ctx, int bits = 32, double tol = 1e-5,
                         AttnCheck check = {}) {
  int num_blocks = 3;
  for (auto& [ql, cl] : q_ctx) num_blocks += (cl + block_size_tokens - 1) / block_size_tokens;
  ops::KVLayer kv;
  kv.bits = bits;
  kv.num_blocks = num_blocks;
  kv.num_kv_heads = num_kv_heads;
  kv.block_size_tokens = block_size_tokens;
  kv.head_dim = head_dim;
  // one poisoned guard block before the pool: what a block id of -1 would read
  const int64_t bb = kv.block_bytes(), pool = (num_blocks + 1) * bb;
  std::vector<uint8_t> kpool(pool, 0xff), vpool(pool, 0xff), kpool_ref(pool, 0xff), vpool_ref(pool, 0xff);
  ops::KVLayer kv_ref = kv;
  kv.k = kpool.data() + bb, kv.v = vpool.data() + bb, kv_ref.k = kpool_ref.data() + bb, kv_ref.v = vpool_ref.data() + bb;
  std::vector<int32_t> free_blocks(num_blocks);
  std::iota(free_blocks.begin(), free_blocks.end(), 0);
  std::shuffle(free_blocks.begin(), free_blocks.end(), g_rng);

  std::vector<std::vector<int32_t>> tables(q_ctx.size()), slots(q_ctx.size());
  std::vector<std::vector<float>> keys(q_ctx.size()), values(q_ctx.size());
  std::vector<ops::AttnSeq> seqs(q_ctx.size());
  int32_t rows = 0;
  size_t next_free = 0;
  for (size_t s = 0; s < q_ctx.size(); ++s) {
    const auto [q_len, ctx_len] = q_ctx[s];
    for (int b = 0; b < (ctx_len + block_size_tokens - 1) / block_size_tokens; ++b) tables[s].push_back(free_blocks[next_free++]);
    seqs[s] = ops::AttnSeq{rows, q_len, ctx_len, tables[s].data()};
    rows += q_len;
    // every position of the context, written the way the engine does (a slot per token)
    for (int p = 0; p < ctx_len; ++p)
      slots[s].push_back(tables[s][p / block_size_tokens] * block_size_tokens + p % block_size_tokens);
    keys[s] = randn((int64_t)ctx_len * num_kv_heads * head_dim);
    values[s] = randn((int64_t)ctx_len * num_kv_heads * head_dim);
    ops::reference::kv_write(kv_ref, keys[s].data(), values[s].data(), slots[s].data(), ctx_len);
  }
  const std::vector<uint8_t> kpool_written = kpool_ref, vpool_written = vpool_ref;
  const std::string name = "bits " + std::to_string(bits) + " heads " + std::to_string(num_heads) + "/" + std::to_string(num_kv_heads) + " hd " +
                           std::to_string(head_dim) + " bs " + std::to_string(block_size_tokens) + " window " +
                           std::to_string(window) + " seqs " + std::to_string(q_ctx.size()) + " (q_len " +
                           std::to_string(q_ctx[0].first) + ", ctx " + std::to_string(q_ctx[0].second) + ")";
  std::vector<int32_t> freed;  // the blocks no query's window reaches
  for (size_t s = 0; s < q_ctx.size() && window > 0; ++s) {
    const auto [q_len, ctx_len] = q_ctx[s];
    const int first_key = std::max(0, ctx_len - q_len - window + 1);  // the first query's window start
    for (int b = 0; b < first_key / block_size_tokens; ++b) {
      freed.push_back(tables[s][b]);
      tables[s][b] = -1;
    }
  }
  auto free_blocks_of = [&](std::vector<uint8_t>& k, std::vector<uint8_t>& v) {
    for (int32_t b : freed)
      for (std::vector<uint8_t>* p : {&k, &v}) std::fill_n(p->begin() + (b + 1) * bb, bb, 0xff);
  };
  free_blocks_of(kpool_ref, vpool_ref);
  const std::string full_name = name + (freed.empty() ? "" : " freed " + std::to_string(freed.size())) +
                                (check.softcap > 0 ? " softcap " + std::to_string((int)check.softcap) : "") +
                                (check.sinks ? " sinks" : "");

  std::vector<float> q = randn((int64_t)rows * num_heads * head_dim), ref(q.size());
  for (float& x : q) x *= check.q_scale;
  const float scale = 1.0f / std::sqrt((float)head_dim);
  std::vector<float> sink_logits;
  if (check.sinks) {
    // about the log of the keys' summed weights (so that the sink takes a share of it), spread either way
    int longest = 1;
    for (auto& [ql, cl] : q_ctx) longest = std::max(longest, window > 0 ? std::min(cl, window) : cl);
    sink_logits = randn(num_heads);
    for (float& x : sink_logits) x = x * 3.0f * std::max(1.0f, check.q_scale / 4) + std::log((float)longest);
    // one head's sink above the log of its keys' summed weights (at most the largest score, below 5 q_scale, plus
    // the log of their number), so that the result is far from the sinkless one whatever the draw (all heads'
    // sinks drawn low left it within 10x the bound once in a run of 2026-12-03)
    sink_logits[0] = std::log((float)longest) + 4.0f + 5.0f * check.q_scale;
  }
  const float* sinks = check.sinks ? sink_logits.data() : nullptr;
  ops::reference::paged_attention(q.data(), kv_ref, seqs.data(), (int32_t)seqs.size(), num_heads, scale, window,
                                  ref.data(), check.softcap, sinks);
  std::vector<float> sinkless, uncapped;
  if (check.sinks) {
    sinkless.resize(q.size());
    ops::reference::paged_attention(q.data(), kv_ref, seqs.data(), (int32_t)seqs.size(), num_heads, scale, window,
                                    sinkless.data(), check.softcap);
  }
  if (check.softcap > 0) {
    uncapped.resize(q.size());
    ops::reference::paged_attention(q.data(), kv_ref, seqs.data(), (int32_t)seqs.size(), num_heads, scale, window,
                                    uncapped.data());
  }

  const int restore = ops::cpu::team_threads();
  for (int threads : g_attn_threads) {
    ops::set_num_threads(threads);
    const std::string at = " threads " + std::to_string(threads);
    std::fill(kpool.begin(), kpool.end(), 0xff), std::fill(vpool.begin(), vpool.end(), 0xff);
    for (size_t s = 0; s < q_ctx.size(); ++s)
      ops::kv_write(kv, keys[s].data(), values[s].data(), slots[s].data(), q_ctx[s].second);
    expect(kpool == kpool_written && vpool == vpool_written, "kv_write " + name + at);
    free_blocks_of(kpool, vpool);
    std::vector<float> out(q.size(), NAN);
    ops::paged_attention(q.data(), kv, seqs.data(), (int32_t)seqs.size(), num_heads, scale, window, out.data(),
                         check.softcap, sinks);
    expect_close(out, ref, "paged_attention " + full_name + at, tol);
    if (check.sinks)
      expect(rel_err(out, sinkless) > 10 * tol, "paged_attention " + full_name + at + ": far from the sinkless result");
    if (check.softcap > 0)
      expect(rel_err(out, uncapped) > 10 * tol, "paged_attention " + full_name + at + ": far from the uncapped result");
    if (check.row_tol > 0) {
      double worst = 0;
      for (size_t r = 0; r < out.size() / head_dim; ++r) {
        const std::vector<float> o(out.begin() + r * head_dim, out.begin() + (r + 1) * head_dim),
            e(ref.begin() + r * head_dim, ref.begin() + (r + 1) * head_dim);
        worst = std::max(worst, rel_err(o, e));
      }
      char buf[64];
      std::snprintf(buf, sizeof(buf), " (worst row %.3g)", worst);
      expect(worst <= check.row_tol,
             "paged_attention per row, q x " + std::to_string(check.q_scale) + " " + full_name + at + buf);
    }
    if (check.other_path) {
      std::vector<float> exact(out.size(), NAN);
      const char* path = g_attn_path;
      use_attention_path("f32");
      ops::paged_attention(q.data(), kv, seqs.data(), (int32_t)seqs.size(), num_heads, scale, window, exact.data(),
                           check.softcap, sinks);
      use_attention_path(path);
      const double moved = std::strcmp(path, "int8") == 0 ? 1e-7 : 1e-6;
      expect(rel_err(out, exact) > moved,
             "paged_attention " + full_name + at + ": the " + path + " path ran (result differs from fp32)");
    }
  }
  ops::set_num_threads(restore);
}

// Whether `path` rounds the softmax weights of some task of this case: AMX tiles take every task (a lone key
// weighs exactly 1 either way), bf16 dot products the decode tasks (at most 4 rows: query positions x the group's
// heads) when head_dim % 32 == 0, and the prefill tasks when head_dim % 16 == 0.
bool path_rounds(const char* path, int heads, int kv_heads, int hd, int bs, const std::vector<std::pair<int, int>>& q_ctx) {
  const bool one_key = q_ctx.size() == 1 && q_ctx[0].second == 1;
  if (std::strcmp(path, "amx") == 0 && hd % 32 == 0 && bs % 32 == 0) return !one_key;
  if (std::strcmp(path, "f32") == 0 || hd % 16 != 0) return false;
  if (hd % 32 == 0 && !one_key) return true;
  for (auto& [ql, cl] : q_ctx)
    if (ql * (heads / kv_heads) > 4) return true;
  return false;
}

// cases(run) on every KV format and every attention path of this CPU, blocks of 16 and 32 tokens, where
// run(heads, kv_heads, head_dim, window, q_ctx, q_scale, cap, sinks) checks one case at the path's tolerance: fp32
// scores carry an error that grows with their scale, as above; the bf16-rounding paths ~3e-3.
template <class Cases>
void on_every_pool_and_path(Cases&& cases) {
  for (int bits : {32, 16, 8, 4})
    for (const char* path : {"f32", "bf16", "amx", "int8"}) {
      const bool f32 = std::strcmp(path, "f32") == 0, int8 = std::strcmp(path, "int8") == 0;
      if ((bits == 32 && !f32) || (bits == 16 && int8) || (bits <= 8 && !f32 && !int8) || !use_attention_path(path))
        continue;
      for (int bs : {16, 32}) {
        auto run = [&](int heads, int kv_heads, int hd, int window, const std::vector<std::pair<int, int>>& q_ctx,
                       float q_scale, float cap, bool sinks) {
          const bool rounds = bits == 16 && path_rounds(path, heads, kv_heads, hd, bs, q_ctx);
          const double unit = int8 ? kInt8PathTol : 1e-5;  // a row's bound grows with the scores' scale
          const double tol = rounds ? 5e-3 : unit, row_tol = rounds ? 5e-3 : unit * std::max(1.0f, q_scale / 4);
          const bool other = rounds || (int8 && int8_path_runs(bits, heads, kv_heads, hd, q_ctx));
          test_attention_case(heads, kv_heads, hd, bs, window, q_ctx, bits, tol,
                              AttnCheck{row_tol, q_scale, other, cap, sinks});
        };
        cases(run);
      }
    }
  default_attention_paths();
}

// Gemma 2's logit soft-capping (cap 50 at head_dim 256, also cap 5) and sliding windows whose dead blocks are
// freed (-1 in the table, NaN in the pool), on every KV format and every path: decode tasks (dot products, or
// AMX tiles over a bf16 pool), prefill chunks after cached context (transposed tiles, or AMX), decode key splits
// (7, 8 and 9 threads). Scores up to ~30x unit scale.
void test_attention_softcap_and_freed_blocks() {
  on_every_pool_and_path([&](auto& run) {
    run(8, 4, 256, 64, {{1, 300}, {40, 200}, {3, 90}}, 30.0f, 50.0f, false);  // Gemma 2: decode, chunk, short seq
    run(8, 4, 256, 0, {{1, 150}, {24, 24}}, 30.0f, 50.0f, false);             // its global layers
    run(4, 1, 128, 0, {{1, 200}, {30, 30}}, 10.0f, 5.0f, false);              // hard capping
    run(4, 2, 64, 50, {{1, 500}, {100, 400}, {64, 64}, {2, 77}}, 1.0f, 0.0f, false);  // windows alone
    run(2, 1, 96, 33, {{150, 150}}, 8.0f, 20.0f, false);                     // prefill alone, windowed
    run(8, 2, 512, 0, {{1, 300}, {24, 24}}, 30.0f, 50.0f, false);           // Gemma 4's global layers
    at_threads({7, 8, 9}, [&] {  // decode key splits (over the window's keys: 2-4 splits of >= 128 keys)
      run(8, 4, 256, 400, {{1, 1100}}, 30.0f, 50.0f, false);
      run(4, 2, 64, 300, {{2, 900}, {1, 40}}, 8.0f, 20.0f, false);
      run(4, 2, 64, 600, {{1, 1000}}, 1.0f, 0.0f, false);
    });
  });
}

// The door: a -1 entry of a block some window reaches is refused; one before every window is never read.
void test_attention_freed_block_door() {
  ops::KVLayer kv;
  kv.num_blocks = 4, kv.num_kv_heads = 1, kv.block_size_tokens = 4, kv.head_dim = 8;
  std::vector<float> kp(kv.num_blocks * kv.block_bytes() / 4, 0.5f), vp(kp.size(), 0.25f), q(8, 1.0f), out(8);
  kv.k = kp.data(), kv.v = vp.data();
  auto attend = [&](std::vector<int32_t> table, int q_len, int window, float cap = 0.0f) {
    const ops::AttnSeq seq{0, q_len, 12, table.data()};
    out.assign(q_len * 8, NAN);
    q.assign(q_len * 8, 1.0f);
    ops::paged_attention(q.data(), kv, &seq, 1, 1, 0.3f, window, out.data(), cap);
  };
  expect(!throws([&] { attend({-1, 1, 2}, 1, 5); }), "paged_attention takes a freed block before the window (decode)");
  expect(std::all_of(out.begin(), out.end(), [](float x) { return std::fabs(x - 0.25f) < 1e-6f; }),
         "paged_attention reads the live blocks only");
  expect(!throws([&] { attend({-1, 1, 2}, 4, 5); }), "paged_attention takes a freed block before every window (prefill)");
  expect(throws([&] { attend({-1, 1, 2}, 4, 6); }), "paged_attention refuses a freed block the first query's window reaches");
  expect(throws([&] { attend({0, -1, 2}, 1, 5); }), "paged_attention refuses a freed block inside the window");
  expect(throws([&] { attend({-1, 1, 2}, 1, 0); }), "paged_attention refuses a freed block without a window");
  expect(throws([&] { attend({0, 1, 2}, 1, 0, -1.0f); }), "paged_attention refuses a negative logit_softcap");
  expect(throws([&] { attend({0, 1, 2}, 1, 0, NAN); }), "paged_attention refuses a NaN logit_softcap");
}

// gpt-oss's attention sinks (a logit per query head in every row's softmax, no value), with its alternating
// windows, on every KV format and every path: decode tasks, prefill chunks after cached context, decode key splits
// (7, 8 and 9 threads), where a split's partial states are merged (the sink joins the merge once).
void test_attention_sinks() {
  on_every_pool_and_path([&](auto& run) {
    run(8, 2, 64, 32, {{1, 300}, {40, 200}, {3, 90}}, 4.0f, 0.0f, true);  // gpt-oss's sliding layers (window 128)
    run(8, 2, 64, 0, {{1, 150}, {24, 24}, {2, 2}}, 4.0f, 0.0f, true);     // its full layers
    run(4, 1, 128, 0, {{1, 1}, {30, 30}}, 1.0f, 0.0f, true);               // a lone key beside the sink
    at_threads({7, 8, 9}, [&] {  // decode key splits
      run(8, 2, 64, 0, {{1, 1100}}, 4.0f, 0.0f, true);
      run(4, 2, 64, 300, {{2, 900}, {1, 40}}, 4.0f, 0.0f, true);
    });
  });
}

// Quantized pools' (scale, zero) pairs at the edges of fp16, byte-exact with the reference quantizer (dtype.h's
// converters; the kernels convert with F16C where the ISA has it): rows whose range gives a subnormal scale, a
// zero scale (constant rows), scales and zeros near the largest half, and random scales over 1e-9 .. 1e4. (Past
// the largest half, where the zero is -inf, the kernels and the reference quantize differently: 255 against 0,
// both meaningless.)
void test_kv_write_half_edges() {
  for (int bits : {8, 4}) {
    ops::KVLayer kv;
    kv.bits = bits, kv.num_blocks = 1, kv.num_kv_heads = 1, kv.block_size_tokens = 64, kv.head_dim = 32;
    const int rows = kv.block_size_tokens, hd = kv.head_dim;
    std::vector<float> k((size_t)rows * hd), v(k.size());
    std::uniform_real_distribution<float> expo(-9.0f, 4.0f);
    for (int r = 0; r < rows; ++r) {
      float scale = std::pow(10.0f, expo(g_rng)), offset = 0.0f;
      if (r == 0) scale = 0.0f, offset = 1.5f;    // constant row: scale 0
      if (r == 1) scale = 1e-4f;                    // range ~6e-4: a subnormal fp16 scale
      if (r == 2) scale = 6e-8f, offset = 1e-5f;    // subnormal scale and zero
      if (r == 3) scale = 2e4f;                     // zero near -65504
      if (r == 4) scale = 1.0f, offset = 65000.0f;  // zero rounding at the top of the range
      for (int d = 0; d < hd; ++d) {
        k[(size_t)r * hd + d] = offset + scale * (float)(d % 7 - 3) * (d % 2 ? 1.0f : 0.37f);
        v[(size_t)r * hd + d] = offset - scale * (float)((d * 5) % 11 - 5) * 0.21f;
      }
    }
    std::vector<int32_t> slots(rows);
    std::iota(slots.begin(), slots.end(), 0);
    std::vector<uint8_t> kp(kv.block_bytes()), vp(kp.size()), kr(kp.size()), vr(kp.size());
    ops::KVLayer ref = kv;
    kv.k = kp.data(), kv.v = vp.data(), ref.k = kr.data(), ref.v = vr.data();
    ops::kv_write(kv, k.data(), v.data(), slots.data(), rows);
    ops::reference::kv_write(ref, k.data(), v.data(), slots.data(), rows);
    expect(kp == kr && vp == vr,
           "kv_write: fp16 scales and zeros at the edges of the range, bits " + std::to_string(bits));
  }
}

void test_attention() {
  // quantized pools: kv_write byte-exact with the reference quantizer, attention against a float64
  // reference over the dequantized values (prefill, decode, split decode, odd block sizes, windows), on fp32 FMAs
  // and on VNNI dot products (decode tasks; its fixed points at 2^-16 of the largest value)
  for (const char* path : {"f32", "int8"}) {
    if (!use_attention_path(path)) {
      std::printf("skip [%s] attention over an int8 / int4 pool on the %s path: not on this CPU\n", g_isa, path);
      continue;
    }
    const bool int8 = std::strcmp(path, "int8") == 0;
    const double tol = int8 ? kInt8PathTol : 1e-5;
    for (int bits : {8, 4}) {
      auto run = [&](int heads, int kv_heads, int hd, int bs, int window,
                     const std::vector<std::pair<int, int>>& q_ctx) {
        const bool vnni = int8 && int8_path_runs(bits, heads, kv_heads, hd, q_ctx);  // then it must differ from fp32
        test_attention_case(heads, kv_heads, hd, bs, window, q_ctx, bits, tol, AttnCheck{0, 1.0f, vnni});
      };
      run(9, 3, 64, 16, 0, {{1, 1}});
      run(9, 3, 64, 7, 0, {{1, 45}, {13, 13}, {5, 100}, {1, 7}, {33, 70}});
      run(9, 3, 64, 5, 17, {{1, 45}, {40, 40}, {6, 51}});
      run(4, 2, 80, 6, 0, {{2, 50}, {1, 33}, {2, 2}});
      run(8, 1, 72, 12, 4, {{30, 30}, {1, 99}});
      run(2, 1, 256, 16, 0, {{20, 20}, {1, 40}});
      run(4, 1, 512, 16, 0, {{20, 20}, {1, 300}});  // Gemma 4's global layers
      run(16, 4, 256, 64, 0, {{1, 900}, {2, 77}, {1, 3}});  // Qwen3.5's shape
      run(8, 2, 128, 16, 9, {{1, 70}, {1, 3}});
      run(4, 4, 128, 16, 0, {{1, 300}, {1, 2}});    // one row a task
      run(6, 2, 128, 32, 40, {{1, 300}, {1, 9}});   // three rows a task, windowed
      run(6, 2, 24, 1, 0, {{10, 10}, {2, 37}});
      run(9, 3, 64, 16, 0, {{1, 700}});
    }
  }
  default_attention_paths();
  // bf16 pools (V stored by token pairs, so even block sizes): kv_write byte-exact with the reference's
  // rounding, attention against the float64 reference over the bf16 values; prefill, decode, split decode.
  // With AMX (head_dim and block_size_tokens multiples of 32), every task (16 rows: decode steps and prefill) runs on
  // tiles, rounding the softmax weights to bf16: measured up to 3.0e-3 on a row, held to 5e-3 overall and per
  // row, also at 20x the scores' scale (q keeps 16 bits of mantissa on the tiles); so do prefill tasks on
  // AVX512_BF16 dot products ("bf16"); 1e-5 on the fp32 path
  for (const char* path : {"f32", "bf16", "amx"}) {
    if (!use_attention_path(path)) {
      std::printf("skip [%s] attention over a bf16 pool on the %s path: not on this CPU\n", g_isa, path);
      continue;
    }
    for (int bs : {2, 6, 32, 64, 96}) {
      auto run = [&](int heads, int kv_heads, int hd, int window, const std::vector<std::pair<int, int>>& q_ctx,
                     float q_scale = 1.0f) {
        const bool rounds = path_rounds(path, heads, kv_heads, hd, bs, q_ctx);
        // fp32 scores carry an error that grows with their scale
        const double tol = rounds ? 5e-3 : 1e-5, row_tol = rounds ? 5e-3 : 1e-5 * std::max(1.0f, q_scale);
        test_attention_case(heads, kv_heads, hd, bs, window, q_ctx, 16, tol, AttnCheck{row_tol, q_scale, rounds});
      };
      run(9, 3, 64, 0, {{1, 1}});
      run(9, 3, 64, 0, {{1, 45}, {13, 13}, {5, 100}, {1, 7}, {33, 70}});
      run(9, 3, 64, 17, {{1, 45}, {40, 40}, {6, 51}});
      run(4, 2, 80, 0, {{2, 50}, {1, 33}, {2, 2}});
      run(8, 1, 72, 4, {{30, 30}, {1, 99}});
      run(2, 1, 256, 0, {{20, 20}, {1, 40}});
      run(3, 1, 96, 0, {{1, 64}, {2, 95}, {1, 33}});
      run(6, 2, 24, 0, {{10, 10}, {2, 37}});
      run(9, 3, 64, 0, {{1, 700}});
      run(9, 3, 64, 300, {{1, 700}});
      run(16, 1, 64, 0, {{1, 300}, {1, 2}, {1, 77}});
      run(16, 2, 128, 0, {{2, 129}, {1, 1}});
      run(2, 2, 32, 0, {{1, 90}, {1, 3}});                   // one row per task
      run(4, 1, 64, 5, {{4, 40}, {0, 10}, {3, 33}});         // per-row windows inside a task; a sequence with no query
      for (int hd : {32, 160, 192, 224, 512}) run(4, 2, hd, 0, {{1, 70}, {3, 41}});  // 512: Gemma 4's global layers
      run(8, 1, 512, 0, {{1, 600}, {40, 90}});
      run(8, 2, 128, 0, {{1, 45}, {1, 300}, {2, 1000}}, 20.0f);  // scores at 20x unit scale
      run(9, 3, 64, 0, {{300, 300}});                        // prefill alone: tasks of 16 rows over ~5 positions
      run(9, 3, 64, 100, {{200, 700}, {37, 37}});            // a prefill chunk after cached context, windowed
      run(8, 2, 128, 0, {{150, 400}}, 20.0f);                // prefill at 20x unit scale
      // prefill tasks of 1, 2 and 3 row vectors, head_dim of 5 and 3 vectors, windows starting at odd keys
      run(4, 2, 80, 0, {{30, 50}, {9, 9}});
      run(6, 2, 48, 9, {{25, 60}, {7, 30}});
      run(8, 8, 64, 0, {{3, 77}, {20, 20}});
      run(4, 1, 128, 7, {{12, 100}, {5, 40}}, 8.0f);
    }
    // more threads than a decode step has (sequence, kv head) tasks: key splits, some of them empty and unaligned,
    // and splits of multi-position tasks under a window
    at_threads({7, 8, 9}, [&] {
      for (int bs : {32, 6}) {
        for (auto [heads, kv_heads, window, q_ctx] :
             {std::tuple{9, 3, 0, std::vector<std::pair<int, int>>{{1, 1100}, {1, 3}}}, std::tuple{4, 2, 300, std::vector<std::pair<int, int>>{{4, 1100}}}}) {
          const bool rounds = path_rounds(path, heads, kv_heads, 64, bs, q_ctx);
          const double tol = rounds ? 5e-3 : 1e-5;
          test_attention_case(heads, kv_heads, 64, bs, window, q_ctx, 16, tol, AttnCheck{tol, 1.0f, rounds});
        }
      }
    });
  }
  default_attention_paths();
  // decode steps, prefill chunks and mixed batches; block sizes not powers of two; ctx not a multiple
  test_attention_case(9, 3, 64, 16, 0, {{1, 1}});
  test_attention_case(9, 3, 64, 16, 0, {{1, 512}});
  test_attention_case(9, 3, 64, 16, 0, {{200, 200}});
  test_attention_case(9, 3, 64, 7, 0, {{1, 45}, {13, 13}, {5, 100}, {1, 7}, {33, 70}});
  test_attention_case(9, 3, 64, 5, 17, {{1, 45}, {40, 40}, {6, 51}});
  test_attention_case(4, 4, 40, 3, 0, {{9, 20}, {1, 2}});
  test_attention_case(8, 1, 72, 12, 4, {{30, 30}, {1, 99}});
  test_attention_case(2, 2, 128, 16, 0, {{70, 90}, {1, 1000}});
  test_attention_case(6, 2, 24, 1, 0, {{10, 10}, {2, 37}});
  test_attention_case(3, 1, 64, 32, 1, {{20, 20}});
  // decode-shaped tasks of 1..4 rows (dot-product path), incl. two query positions per task
  test_attention_case(8, 2, 64, 16, 9, {{1, 70}, {1, 3}});
  test_attention_case(4, 2, 80, 6, 0, {{2, 50}, {1, 33}, {2, 2}});
  test_attention_case(2, 1, 16, 4, 0, {{1, 19}, {3, 7}});
  test_attention_case(2, 1, 256, 16, 0, {{20, 20}, {1, 40}});
  // single long decode steps: split over the keys across threads, then merged
  test_attention_case(9, 3, 64, 16, 300, {{1, 700}});
  test_attention_case(8, 2, 40, 7, 0, {{1, 650}});
  test_attention_case(4, 4, 24, 5, 0, {{1, 600}});
  test_attention_case(4, 2, 64, 16, 0, {{2, 400}});
}

}  // namespace

// ops::concat_linear: the fused weight gives exactly the parts' outputs side by side (same panels, same
// tiles), for dense, int4 (fp32 and int8-activation paths) and int8 weights; unjoinable parts are refused.
void test_concat_linear() {
  auto check = [](const std::vector<ops::LinearWeight>& parts, int64_t K, const std::string& what) {
    std::vector<const ops::LinearWeight*> ptrs;
    int64_t N = 0;
    for (const ops::LinearWeight& p : parts) ptrs.push_back(&p), N += p.n;
    const ops::LinearWeight fused = ops::concat_linear(ptrs);
    expect(!fused.is_empty() && fused.n == N && fused.k == K, what + ": joined");
    for (int64_t M : {1, 3, 16, 70}) {
      std::vector<float> x = randn(M * K), out(M * N, NAN), ref(M * N, NAN);
      ops::linear(x.data(), M, fused, Tensor{}, out.data());
      int64_t n0 = 0;
      for (const ops::LinearWeight& p : parts) {
        std::vector<float> part(M * p.n);
        ops::linear(x.data(), M, p, Tensor{}, part.data());
        for (int64_t m = 0; m < M; ++m)
          for (int64_t j = 0; j < p.n; ++j) ref[m * N + n0 + j] = part[m * p.n + j];
        n0 += p.n;
      }
      expect(std::memcmp(out.data(), ref.data(), out.size() * sizeof(float)) == 0,
             what + " M " + std::to_string(M) + ": equals the parts side by side");
    }
  };
  for (DType dt : kWeightDTypes) {
    std::vector<ops::LinearWeight> parts;
    for (int64_t n : {64, 32, 40}) parts.push_back(ops::pack_linear(make_weight(dt, n, 96, 0.05f).t));
    check(parts, 96, std::string("concat_linear ") + dtype_name(dt));
  }
  for (bool q8 : {false, true}) {
    std::vector<ops::LinearWeight> parts;
    for (int64_t n : {96, 32, 8}) {
      AwqWeight a = make_awq(n, 128, 64);
      parts.push_back(pack_awq(a, 64));
      parts.back().int8_activations = q8;
    }
    check(parts, 128, q8 ? "concat_linear int4 x int8" : "concat_linear int4");
  }
  for (bool q8 : {false, true}) {
    std::vector<ops::LinearWeight> parts;
    for (int64_t n : {32, 50}) {
      parts.push_back(ops::pack_linear_int8(make_weight(DType::F32, n, 64, 0.05f).t));
      parts.back().int8_activations = q8;
    }
    check(parts, 64, q8 ? "concat_linear int8 x int8" : "concat_linear int8");
  }
  if (ops::bf16_dot_available()) {
    std::vector<ops::LinearWeight> parts;
    for (int64_t n : {64, 50}) parts.push_back(ops::pack_linear_bf16(make_weight(DType::F16, n, 97, 0.05f).t));
    check(parts, 97, "concat_linear bf16");
    const ops::LinearWeight dense = ops::pack_linear(make_weight(DType::F16, 32, 97).t);
    expect(ops::concat_linear({&parts[0], &dense}).is_empty(), "concat_linear refuses bf16 pairs beside F16 panels");
  }
  const ops::LinearWeight a = ops::pack_linear(make_weight(DType::F32, 40, 64).t);
  const ops::LinearWeight b = ops::pack_linear(make_weight(DType::F32, 32, 64).t);
  const ops::LinearWeight c = ops::pack_linear(make_weight(DType::F16, 32, 64).t);
  const ops::LinearWeight d = ops::pack_linear(make_weight(DType::F32, 32, 96).t);
  expect(ops::concat_linear({&a, &b}).is_empty(), "concat_linear refuses a first part of 40 columns (not whole panels)");
  expect(!ops::concat_linear({&b, &a}).is_empty(), "concat_linear takes a partial last part");
  expect(ops::concat_linear({&b, &c}).is_empty(), "concat_linear refuses parts of different dtypes");
  expect(ops::concat_linear({&b, &d}).is_empty(), "concat_linear refuses parts of different K");
  expect(ops::concat_linear({&b}).is_empty(), "concat_linear needs two parts");
}

// Greedy sampling (plain C++, one build for every ISA) against the definition: the lowest index of the maximum,
// NaN never chosen (all NaN: 0). Rows of 1 to 49,152 values around the vector blocks of 256 and their tails, the
// maximum twice (same block, two blocks, block and tail), NaN at and around it, +inf, all -inf, all NaN.
void test_greedy_sample() {
  auto reference = [](const std::vector<float>& x) {
    int32_t best = -1;
    for (int32_t i = 0; i < (int32_t)x.size(); ++i)
      if (!std::isnan(x[i]) && (best < 0 || x[i] > x[best])) best = i;
    return best < 0 ? 0 : best;
  };
  SamplerParams greedy;
  greedy.temperature = 0.0f;
  std::mt19937_64 rng(1);
  std::uniform_int_distribution<int> coin(0, 7);
  int checks = 0, bad = 0;
  for (int32_t n : {1, 5, 16, 255, 256, 257, 511, 512, 700, 1000, 49152, 49155}) {
    for (int trial = 0; trial < 40; ++trial) {
      std::vector<float> x = randn(n);
      std::uniform_int_distribution<int32_t> at(0, n - 1);
      const int32_t a = at(g_rng), b = at(g_rng);
      const int kind = trial % 8;
      if (kind == 1) x[a] = x[b] = 9.0f;                                   // the maximum twice
      if (kind == 2) x[a] = NAN, x[b] = 9.0f;                              // NaN beside the maximum
      if (kind == 3) x[a] = 9.0f, x[(a + 1) % n] = NAN, x[(a + n - 1) % n] = 9.0f;
      if (kind == 4) x[a] = INFINITY;
      if (kind == 5) std::fill(x.begin(), x.end(), -INFINITY), x[b] = coin(g_rng) < 4 ? NAN : -INFINITY;
      if (kind == 6) std::fill(x.begin(), x.end(), NAN);
      if (kind == 7) x[n - 1] = 9.0f, x[a] = 9.0f;                         // the last value (a tail) ties
      if (kind == 0 && n > 300) x[256] = 9.0f, x[n - 1] = 9.0f;            // a block's first value and the tail
      const int32_t want = reference(x);
      const int32_t got = ops::sample(x.data(), n, greedy, nullptr, 0, 0, nullptr, 0, nullptr, rng, nullptr);
      ++checks;
      if (got != want) {
        ++bad;
        if (bad <= 5) std::printf("greedy n %d kind %d: got %d, want %d\n", n, kind, got, want);
      }
    }
  }
  expect(bad == 0, "greedy sampling: the lowest index of the maximum, NaN never (" + std::to_string(checks) + " rows)");
}

// test_cpu_kernels [ISA...]: every kernel on each ISA named (generic, avx2, avx512; default all three), so that
// Gated DeltaNet: the short convolution and the delta rule against their double references, over sequences of
// 1, 7 and 33 rows (one row is a decode) sharing one batch, head dims that are not a multiple of the vector
// width and Qwen3.5's 128, gates near 0 and near 1, NaN-poisoned outputs; then the same rows cut into two calls
// (a prompt cut into chunks) give the state and outputs of one pass.
void test_recurrent() {
  struct Shape { int Hk, Hv, Dk, Dv, K; };
  for (const Shape sh : {Shape{2, 4, 20, 24, 4}, Shape{1, 2, 128, 128, 4}, Shape{3, 3, 7, 33, 2}}) {
    const std::vector<int32_t> lens = {1, 7, 33};
    int32_t rows = 0;
    for (int32_t n : lens) rows += n;
    const int64_t key = (int64_t)sh.Hk * sh.Dk, value = (int64_t)sh.Hv * sh.Dv, conv = 2 * key + value;
    const int64_t stride = conv + 5;  // the fused projection's row carries more (z, b, a) after q | k | v
    const std::string name = " Hk " + std::to_string(sh.Hk) + " Hv " + std::to_string(sh.Hv) + " Dk " +
                             std::to_string(sh.Dk) + " Dv " + std::to_string(sh.Dv);
    std::vector<float> x = randn(rows * stride), w = randn(sh.K * conv, 0.5f);
    std::vector<float> g(rows * sh.Hv), beta(rows * sh.Hv);
    std::uniform_real_distribution<float> unit(0.0f, 1.0f);
    for (int64_t i = 0; i < (int64_t)g.size(); ++i) {
      const float r = unit(g_rng);  // decay exp(g) near 0, near 1 and between; beta likewise
      g[i] = i % 3 == 0 ? -20.0f : i % 3 == 1 ? -1e-6f : std::log(0.05f + 0.9f * r);
      beta[i] = i % 4 == 0 ? 0.001f : i % 4 == 1 ? 0.999f : unit(g_rng);
    }
    const int64_t conv_state_n = (int64_t)(sh.K - 1) * conv, state_n = value * sh.Dk;
    auto seqs_over = [&](std::vector<float>& cs, std::vector<float>& st, const std::vector<int32_t>& first,
                         const std::vector<int32_t>& n) {
      std::vector<ops::RecurrentSeq> out(lens.size());
      for (size_t i = 0; i < lens.size(); ++i)
        out[i] = {first[i], n[i], cs.data() + i * conv_state_n, st.data() + i * state_n};
      return out;
    };
    std::vector<int32_t> first(lens.size());
    for (size_t i = 1; i < lens.size(); ++i) first[i] = first[i - 1] + lens[i - 1];
    const std::vector<float> cs0 = randn(lens.size() * conv_state_n), st0 = randn(lens.size() * state_n, 0.3f);

    // convolution
    std::vector<float> xr = x, xo = x, csr = cs0, cso = cs0, str = st0, sto = st0;
    auto sr = seqs_over(csr, str, first, lens), so = seqs_over(cso, sto, first, lens);
    ops::reference::causal_conv1d(xr.data(), stride, conv, w.data(), sh.K, sr.data(), (int32_t)sr.size());
    ops::causal_conv1d(xo.data(), stride, conv, w.data(), sh.K, so.data(), (int32_t)so.size());
    expect_close(xo, xr, "causal_conv1d" + name);
    expect_close(cso, csr, "causal_conv1d window state" + name);
    // delta rule on the convolved rows
    std::vector<float> outr(rows * value), outo(rows * value, NAN);
    ops::reference::gated_delta_rule(xr.data(), xr.data() + key, xr.data() + 2 * key, stride, g.data(), beta.data(),
                                     sr.data(), (int32_t)sr.size(), sh.Hk, sh.Hv, sh.Dk, sh.Dv, outr.data(), value,
                                     false);
    ops::gated_delta_rule(xr.data(), xr.data() + key, xr.data() + 2 * key, stride, g.data(), beta.data(), so.data(),
                          (int32_t)so.size(), sh.Hk, sh.Hv, sh.Dk, sh.Dv, outo.data(), value, false);
    expect_close(outo, outr, "gated_delta_rule" + name, 1e-4);
    expect_close(sto, str, "gated_delta_rule state" + name, 1e-4);

    // the same rows in two calls, each sequence cut after its first third
    std::vector<float> xc = x, csc = cs0, stc = st0, outc(rows * value, NAN);
    std::vector<int32_t> n1(lens.size()), f2(lens.size()), n2(lens.size());
    for (size_t i = 0; i < lens.size(); ++i) n1[i] = lens[i] / 3, f2[i] = first[i] + n1[i], n2[i] = lens[i] - n1[i];
    for (const auto& part : {std::make_pair(first, n1), std::make_pair(f2, n2)}) {
      auto sc = seqs_over(csc, stc, part.first, part.second);
      ops::causal_conv1d(xc.data(), stride, conv, w.data(), sh.K, sc.data(), (int32_t)sc.size());
      ops::gated_delta_rule(xc.data(), xc.data() + key, xc.data() + 2 * key, stride, g.data(), beta.data(), sc.data(),
                            (int32_t)sc.size(), sh.Hk, sh.Hv, sh.Dk, sh.Dv, outc.data(), value, false);
    }
    expect_close(outc, outr, "gated_delta_rule in two chunks" + name, 1e-4);
    expect_close(stc, str, "gated_delta_rule state after two chunks" + name, 1e-4);

    // value heads tiled (GGUF): the same inputs with every value-indexed operand moved from grouped head
    // kh * R + r to tiled head r * Hk + kh give the same outputs and states, moved the same way
    const int R = sh.Hv / sh.Hk;
    auto tiled_of = [&](int h) { return (h % R) * sh.Hk + h / R; };  // grouped head -> its tiled position
    std::vector<float> xt = xr, gt(g.size()), bt(beta.size()), stt(st0.size());
    for (int64_t t = 0; t < rows; ++t)
      for (int h = 0; h < sh.Hv; ++h) {
        const int ht = tiled_of(h);
        std::copy_n(xr.data() + t * stride + 2 * key + (int64_t)h * sh.Dv, sh.Dv,
                    xt.data() + t * stride + 2 * key + (int64_t)ht * sh.Dv);
        gt[t * sh.Hv + ht] = g[t * sh.Hv + h], bt[t * sh.Hv + ht] = beta[t * sh.Hv + h];
      }
    const int64_t head_state = (int64_t)sh.Dk * sh.Dv;
    for (size_t i = 0; i < lens.size(); ++i)
      for (int h = 0; h < sh.Hv; ++h)
        std::copy_n(st0.data() + i * state_n + h * head_state, head_state,
                    stt.data() + i * state_n + tiled_of(h) * head_state);
    std::vector<float> stt_ref = stt, outt_ref(rows * value), outt(rows * value, NAN), ex(rows * value), est(stt.size());
    auto st_seqs = seqs_over(csr, stt_ref, first, lens), so_t = seqs_over(csr, stt, first, lens);
    ops::reference::gated_delta_rule(xt.data(), xt.data() + key, xt.data() + 2 * key, stride, gt.data(), bt.data(),
                                     st_seqs.data(), (int32_t)st_seqs.size(), sh.Hk, sh.Hv, sh.Dk, sh.Dv,
                                     outt_ref.data(), value, true);
    ops::gated_delta_rule(xt.data(), xt.data() + key, xt.data() + 2 * key, stride, gt.data(), bt.data(), so_t.data(),
                          (int32_t)so_t.size(), sh.Hk, sh.Hv, sh.Dk, sh.Dv, outt.data(), value, true);
    for (int64_t t = 0; t < rows; ++t)
      for (int h = 0; h < sh.Hv; ++h)
        std::copy_n(outr.data() + t * value + (int64_t)h * sh.Dv, sh.Dv,
                    ex.data() + t * value + (int64_t)tiled_of(h) * sh.Dv);
    for (size_t i = 0; i < lens.size(); ++i)
      for (int h = 0; h < sh.Hv; ++h)
        std::copy_n(str.data() + i * state_n + h * head_state, head_state,
                    est.data() + i * state_n + tiled_of(h) * head_state);
    expect_close(outt_ref, ex, "gated_delta_rule reference, value heads tiled" + name, 1e-12);
    expect_close(stt_ref, est, "gated_delta_rule reference state, value heads tiled" + name, 1e-12);
    expect_close(outt, ex, "gated_delta_rule value heads tiled" + name, 1e-4);
    expect_close(stt, est, "gated_delta_rule state, value heads tiled" + name, 1e-4);
  }
  expect(throws([] { ops::gated_delta_rule(nullptr, nullptr, nullptr, 0, nullptr, nullptr, nullptr, 0, 2, 3, 8, 8,
                                           nullptr, 24, false); }),
         "gated_delta_rule rejects value heads that are not a multiple of the key heads");
  expect(throws([] { ops::causal_conv1d(nullptr, 4, 4, nullptr, 9, nullptr, 0); }),
         "causal_conv1d rejects a kernel of 9 taps");
}

// Checkpoints (speculative decoding's rollback): the state after each checkpointed row, written during a call over
// many rows, is bit for bit what a call over the rows up to it leaves (so a rolled-back sequence continues as if the
// rejected rows never ran), and within 1e-4 of the double reference's checkpoints; the call's outputs and final
// state do not change. Checkpoint buffers start NaN-poisoned.
void test_recurrent_checkpoints() {
  struct Shape { int Hk, Hv, Dk, Dv, K; };
  for (const Shape sh : {Shape{2, 4, 20, 24, 4}, Shape{1, 2, 128, 128, 4}, Shape{3, 3, 7, 33, 1}}) {
    const std::vector<int32_t> lens = {1, 9, 33}, checkpoints = {1, 8, 3};
    int32_t rows = 0;
    for (int32_t n : lens) rows += n;
    const int64_t key = (int64_t)sh.Hk * sh.Dk, value = (int64_t)sh.Hv * sh.Dv, conv = 2 * key + value;
    const int64_t stride = conv + 3, conv_n = (int64_t)(sh.K - 1) * conv, state_n = value * sh.Dk;
    const std::string name = " Hk " + std::to_string(sh.Hk) + " Hv " + std::to_string(sh.Hv) + " Dk " +
                             std::to_string(sh.Dk) + " Dv " + std::to_string(sh.Dv) + " K " + std::to_string(sh.K);
    const std::vector<float> x0 = randn(rows * stride), w = randn(sh.K * conv, 0.5f);
    std::vector<float> g(rows * sh.Hv), beta(rows * sh.Hv);
    std::uniform_real_distribution<float> unit(0.0f, 1.0f);
    for (int64_t i = 0; i < (int64_t)g.size(); ++i) g[i] = std::log(0.05f + 0.9f * unit(g_rng)), beta[i] = unit(g_rng);
    const std::vector<float> cs0 = randn(lens.size() * conv_n), st0 = randn(lens.size() * state_n, 0.3f);
    std::vector<int32_t> first(lens.size());
    for (size_t i = 1; i < lens.size(); ++i) first[i] = first[i - 1] + lens[i - 1];

    // One call over every row, with checkpoints (kernel, and the double reference), and without.
    struct Run {
      std::vector<float> x, cs, st, out, cc, sc;  // cc / sc: the checkpoints, [seq][t] at (offset + t) * n
      std::vector<float*> cp, sp;
    };
    int32_t total = 0;
    for (int32_t c : checkpoints) total += c;
    auto run = [&](bool reference, bool with_checkpoints) {
      Run r{x0, cs0, st0, std::vector<float>(rows * value, NAN), std::vector<float>(std::max<int64_t>(total * conv_n, 1), NAN),
            std::vector<float>(total * state_n, NAN), {}, {}};
      std::vector<ops::RecurrentSeq> seqs(lens.size());
      for (int32_t t = 0; t < total; ++t) r.cp.push_back(r.cc.data() + t * conv_n), r.sp.push_back(r.sc.data() + t * state_n);
      int32_t offset = 0;
      for (size_t i = 0; i < lens.size(); ++i) {
        seqs[i] = {first[i], lens[i], r.cs.data() + i * conv_n, r.st.data() + i * state_n};
        if (with_checkpoints)
          seqs[i].num_checkpoints = checkpoints[i], seqs[i].conv_checkpoints = r.cp.data() + offset,
          seqs[i].state_checkpoints = r.sp.data() + offset;
        offset += checkpoints[i];
      }
      float* x = r.x.data();
      if (reference) {
        ops::reference::causal_conv1d(x, stride, conv, w.data(), sh.K, seqs.data(), (int32_t)seqs.size());
        ops::reference::gated_delta_rule(x, x + key, x + 2 * key, stride, g.data(), beta.data(), seqs.data(),
                                         (int32_t)seqs.size(), sh.Hk, sh.Hv, sh.Dk, sh.Dv, r.out.data(), value, false);
      } else {
        ops::causal_conv1d(x, stride, conv, w.data(), sh.K, seqs.data(), (int32_t)seqs.size());
        ops::gated_delta_rule(x, x + key, x + 2 * key, stride, g.data(), beta.data(), seqs.data(), (int32_t)seqs.size(),
                              sh.Hk, sh.Hv, sh.Dk, sh.Dv, r.out.data(), value, false);
      }
      return r;
    };
    const Run ck = run(false, true), plain = run(false, false), ref = run(true, true);
    expect(std::memcmp(ck.out.data(), plain.out.data(), ck.out.size() * 4) == 0 &&
               std::memcmp(ck.st.data(), plain.st.data(), ck.st.size() * 4) == 0 &&
               std::memcmp(ck.cs.data(), plain.cs.data(), ck.cs.size() * 4) == 0,
           "recurrent checkpoints leave the outputs and final state as they were" + name);
    expect_close(ck.sc, ref.sc, "gated_delta_rule checkpoints vs the reference" + name, 1e-4);
    if (sh.K > 1) expect_close(ck.cc, ref.cc, "causal_conv1d checkpoints vs the reference" + name, 1e-6);

    // Each checkpoint against a call over its sequence's rows up to it, alone.
    int32_t offset = 0, exact = 0;
    for (size_t i = 0; i < lens.size(); ++i) {
      for (int32_t t = 0; t < checkpoints[i]; ++t) {
        std::vector<float> x = x0, cs(cs0.begin() + i * conv_n, cs0.begin() + (i + 1) * conv_n),
                           st(st0.begin() + i * state_n, st0.begin() + (i + 1) * state_n), out(rows * value);
        ops::RecurrentSeq one{first[i], t + 1, cs.data(), st.data()};
        ops::causal_conv1d(x.data(), stride, conv, w.data(), sh.K, &one, 1);
        ops::gated_delta_rule(x.data(), x.data() + key, x.data() + 2 * key, stride, g.data(), beta.data(), &one, 1,
                              sh.Hk, sh.Hv, sh.Dk, sh.Dv, out.data(), value, false);
        const bool same = std::memcmp(st.data(), ck.sc.data() + (offset + t) * state_n, state_n * 4) == 0 &&
                          (conv_n == 0 || std::memcmp(cs.data(), ck.cc.data() + (offset + t) * conv_n, conv_n * 4) == 0);
        exact += same ? 1 : 0;
      }
      offset += checkpoints[i];
    }
    expect(exact == total, "recurrent checkpoints: " + std::to_string(exact) + " of " + std::to_string(total) +
                               " bit for bit the state of a call ending there" + name);
  }
  ops::RecurrentSeq too_many{0, 2, nullptr, nullptr};
  too_many.num_checkpoints = 3;
  expect(throws([&] { ops::causal_conv1d(nullptr, 4, 4, nullptr, 1, &too_many, 1); }),
         "causal_conv1d rejects more checkpoints than rows");
}

// ctest can run the ISAs side by side as separate tests.
// Batch invariance, which speculative decoding's exactness rests on (a draft row must score as its decode step
// would): a row of x gives the same bits alone and in a call of any height, at any place in it, for every linear
// format and kernel this ISA runs, with AMX tiles off and, where the CPU has them, on (bf16 pairs take the tiles
// in every call; AWQ x int8 from kLinearAmxInt8MinRows rows, with VNNI's bits); paged_attention gives a
// sequence's rows the same bits whatever else the call holds and at any thread count, and a decode row
// (AttnSeq::num_decode_rows) the bits of its own decode step.
void test_linear_batch_invariance(bool amx);
void test_attention_batch_invariance();

void test_batch_invariance() {
  for (bool amx : {false, true})
    if (ops::cpu::use_amx(amx) == amx) test_linear_batch_invariance(amx);
  ops::cpu::use_amx(true);
  test_attention_batch_invariance();
}

void test_linear_batch_invariance(bool amx) {
  const int64_t N = 104, K = 640, M = 40;  // N: a partial last panel; K: two K chunks of the AMX-INT8 kernel
  std::vector<std::pair<std::string, ops::LinearWeight>> ws;
  for (DType dt : {DType::F32, DType::F16, DType::BF16}) {
    const Weight w = make_weight(dt, N, K);
    ws.emplace_back(std::string("dense ") + (dt == DType::F32 ? "f32" : dt == DType::F16 ? "f16" : "bf16"),
                    ops::pack_linear(w.t));
    if (dt == DType::F32) {
      ops::LinearWeight i8 = ops::pack_linear_int8(w.t);
      ws.emplace_back("int8", i8);
      if (ops::int8_dot_available()) {
        i8.int8_activations = true;
        ws.emplace_back("int8 x int8", i8);
      }
      if (ops::bf16_dot_available()) ws.emplace_back("bf16 pairs", ops::pack_linear_bf16(w.t));
    }
  }
  for (int64_t g : {32, 128})
    for (bool symmetric : {false, true}) {
      ops::LinearWeight w = pack_awq(make_awq(N, K, g, symmetric), g);
      const std::string name = "int4 g" + std::to_string(g) + (symmetric ? " symmetric" : "");
      ws.emplace_back(name, w);
      if (ops::int8_dot_available()) {
        w.int8_activations = true;
        ws.emplace_back(name + " x int8", w);
      }
    }
  const Weight bias = make_weight(DType::F32, N, 0);
  const std::vector<float> x = randn(M * K);
  for (auto& [name, w] : ws) {
    std::vector<float> full(M * N, NAN);
    ops::linear(x.data(), M, w, bias.t, full.data());
    for (auto [r0, m] : std::vector<std::pair<int64_t, int64_t>>{{0, 1}, {7, 1}, {39, 1}, {3, 2}, {5, 3}, {1, 12},
                                                                 {2, 13}, {9, 31}, {0, 33}}) {
      std::vector<float> part(m * N, NAN);
      ops::linear(x.data() + r0 * K, m, w, bias.t, part.data());
      expect(same_bits(part.data(), full.data() + r0 * N, m * N),
             "linear " + name + (amx ? " (AMX on)" : "") + ": rows " + std::to_string(r0) + ".." +
                 std::to_string(r0 + m) + " of a call of " + std::to_string(M) + " give the bits of a call of " +
                 std::to_string(m));
    }
  }
}

void test_attention_batch_invariance() {
  // attention: one target sequence (chunk of 2 rows + 4 decode rows, keys crossing the 256-key segments), alone,
  // among others, at other thread counts, and each decode row as its own decode step
  for (int bits : {32, 16, 8})
    for (int window : {0, 300}) {
      const int num_heads = 9, nkv = 3, hd = 64, bs = 16, ctx = 600, q_len = 6, d = 4;
      ops::KVLayer kv;
      kv.bits = bits, kv.num_kv_heads = nkv, kv.block_size_tokens = bs, kv.head_dim = hd;
      kv.num_blocks = 3 * ((ctx + bs - 1) / bs);
      std::vector<uint8_t> kpool(kv.num_blocks * kv.block_bytes(), 0xff), vpool(kpool.size(), 0xff);
      kv.k = kpool.data(), kv.v = vpool.data();
      std::vector<int32_t> blocks(kv.num_blocks);
      std::iota(blocks.begin(), blocks.end(), 0);
      std::shuffle(blocks.begin(), blocks.end(), g_rng);
      const int per_seq = (ctx + bs - 1) / bs;
      for (int s = 0; s < 3; ++s) {  // three sequences of ctx keys: the target, and two others
        std::vector<int32_t> slots(ctx);
        for (int p = 0; p < ctx; ++p) slots[p] = blocks[s * per_seq + p / bs] * bs + p % bs;
        const std::vector<float> k = randn((int64_t)ctx * nkv * hd), v = randn((int64_t)ctx * nkv * hd);
        ops::kv_write(kv, k.data(), v.data(), slots.data(), ctx);
      }
      const int32_t* table = blocks.data();
      const std::vector<float> q = randn((int64_t)(q_len + 40) * num_heads * hd);
      const int64_t row_floats = (int64_t)num_heads * hd;
      const float scale = 0.125f;
      auto run = [&](std::vector<ops::AttnSeq> seqs, int threads) {
        int32_t rows = 0;
        for (const ops::AttnSeq& a : seqs) rows = std::max(rows, a.q_row + a.q_len);
        std::vector<float> out(rows * row_floats, NAN);
        ops::set_num_threads(threads);
        ops::paged_attention(q.data(), kv, seqs.data(), (int32_t)seqs.size(), num_heads, scale, window, out.data());
        ops::set_num_threads(g_threads);
        return out;
      };
      ops::AttnSeq target{0, q_len, ctx, table, d};
      const std::vector<float> alone = run({target}, 1);
      const std::string name = "attention bits " + std::to_string(bits) + " window " + std::to_string(window);
      // among a decode step and a prefill chunk of other sequences, rows placed after the target's
      const std::vector<float> among = run({ops::AttnSeq{q_len, 1, 500, table + per_seq},
                                            target, ops::AttnSeq{q_len + 1, 30, 300, table + 2 * per_seq}}, 3);
      expect(same_bits(alone.data(), among.data(), q_len * row_floats), name + ": a sequence among others, on 3 threads");
      for (int j = 0; j < d; ++j) {  // decode row j: the decode step at position ctx - d + j
        const int32_t row = q_len - d + j;
        const std::vector<float> step = run({ops::AttnSeq{row, 1, ctx - d + j + 1, table}}, 2);
        expect(same_bits(alone.data() + row * row_floats, step.data() + row * row_floats, row_floats),
               name + ": decode row " + std::to_string(j) + " as its decode step");
      }
      const std::vector<float> chunk = run({ops::AttnSeq{0, q_len - d, ctx - d, table}}, 2);
      expect(same_bits(alone.data(), chunk.data(), (q_len - d) * row_floats), name + ": the rows before, as their chunk");
      // prompt rows (AttnSeq::prefill): the last 40 positions as one chunk, and cut into chunks of 1, 2, 3, 11 and
      // 23 rows (a chunk of few rows would be decode-shaped): the same bits, AMX tiles off and on
      for (bool amx : {false, true}) {
        if (ops::cpu::use_amx(amx) != amx) continue;
        const int P = 40;
        const std::vector<float> whole = run({ops::AttnSeq{0, P, ctx, table, 0, true}}, 2);
        std::vector<ops::AttnSeq> pieces;
        for (int at = 0, k = 0; at < P; ++k) {
          const int len = std::min(P - at, std::vector<int>{1, 2, 3, 11, 23}[k % 5]);
          pieces.push_back(ops::AttnSeq{at, len, ctx - P + at + len, table, 0, true});
          at += len;
        }
        for (const ops::AttnSeq& piece : pieces) {
          const std::vector<float> part = run({piece}, 3);
          expect(same_bits(whole.data() + piece.q_row * row_floats, part.data() + piece.q_row * row_floats,
                           piece.q_len * row_floats),
                 name + (amx ? " (AMX on)" : "") + ": prompt rows " + std::to_string(piece.q_row) + "+" +
                     std::to_string(piece.q_len) + " as a chunk of their own");
        }
      }
      ops::cpu::use_amx(true);
    }
}

int main(int argc, char** argv) {
  std::setvbuf(stdout, nullptr, _IOLBF, 0);  // keep every line if a kernel crashes
  test_greedy_sample();
  std::vector<const char*> isas = {"generic", "avx2", "avx512"};
  if (argc > 1) isas.assign(argv + 1, argv + argc);
  for (const char* isa : isas) {
    g_isa = isa;
    if (!ops::cpu::force_isa(isa)) {
      std::printf("skip [%s]: this CPU cannot run it\n", isa);
      continue;
    }
    expect(std::strcmp(ops::cpu_isa(), isa) == 0, "cpu_isa() names the forced table");
    for (int threads : {1, 2, 3}) {
      ops::set_num_threads(threads);
      g_threads = threads;
      test_embedding();
      test_rmsnorm();
      test_linear();
      test_linear_int4();
      test_linear_gguf_blocks();
      test_linear_mxfp4();
      test_linear_nvfp4();
      test_kquant_source_checks();
      test_weight_format_traits();
      test_gather_weights();
      test_linear_group();
      test_linear_bf16();
      test_concat_linear();
      test_rope();
      test_silu_mul();
      test_gelu_tanh_mul();
      test_clamped_swiglu_mul();
      test_recurrent();
      test_recurrent_checkpoints();
      test_softcap_scale();
      test_log_sum_exp();
      if (threads == 1)  // once, each case at 1, 2 and 3 threads against one float64 reference
        at_threads({1, 2, 3}, [] {
          test_attention();
          test_attention_softcap_and_freed_blocks();
          test_attention_sinks();
        });
      test_kv_write_half_edges();
      test_attention_freed_block_door();
      test_batch_invariance();
    }
    std::printf("[%s] done\n", isa);
  }
  std::printf("%d passed, %d failed\n", g_passed, g_failed);
  return g_failed == 0 ? 0 : 1;
}
