// Mixture-of-experts routing and the CPU backend's expert layer, against naive per-row loops in double.
#include <algorithm>
#include <cmath>
#include <limits>
#include <map>
#include <numeric>
#include <random>
#include <vector>

#include "model/backend.h"
#include "model/moe_routing.h"
#include "tests/testing.h"

using namespace lmkit;

namespace {

// Each row's (expert -> weight) as the HF routers compute it: softmax, top k, optionally renormalized.
std::vector<std::map<int, double>> naive_route(const std::vector<float>& logits, int rows, int E, int K, bool renorm) {
  std::vector<std::map<int, double>> out(rows);
  for (int r = 0; r < rows; ++r) {
    std::vector<double> p(E);
    double mx = -1e300, sum = 0;
    for (int e = 0; e < E; ++e) mx = std::max(mx, (double)logits[r * E + e]);
    for (int e = 0; e < E; ++e) sum += p[e] = std::exp(logits[r * E + e] - mx);
    std::vector<int> order(E);
    std::iota(order.begin(), order.end(), 0);
    std::stable_sort(order.begin(), order.end(), [&](int a, int b) { return p[a] > p[b]; });
    double kept = 0;
    for (int j = 0; j < K; ++j) kept += p[order[j]] / sum;
    for (int j = 0; j < K; ++j) out[r][order[j]] = p[order[j]] / sum / (renorm ? kept : 1.0);
  }
  return out;
}

void check_routing(const std::vector<float>& logits, int rows, int E, int K, bool renorm, const char* what) {
  ExpertRouting got;
  got.rows.assign(3, -7);  // stale contents must not survive
  route_top_k(logits.data(), rows, E, K, renorm, got);
  const auto want = naive_route(logits, rows, E, K, renorm);
  EXPECT((int)got.offsets.size() == E + 1 && got.offsets[0] == 0 && got.offsets[E] == rows * K);
  std::vector<std::map<int, double>> seen(rows);
  for (int e = 0; e < E; ++e) {
    for (int i = got.offsets[e]; i < got.offsets[e + 1]; ++i) {
      const int r = got.rows[i];
      EXPECT(r >= 0 && r < rows);
      if (i > got.offsets[e]) EXPECT(got.rows[i - 1] < r);  // ascending within an expert, no duplicates
      seen[r][e] = got.weights[i];
    }
  }
  for (int r = 0; r < rows; ++r) {
    EXPECT_EQ(seen[r].size(), want[r].size());
    for (const auto& [e, w] : want[r]) {
      const bool found = seen[r].count(e) > 0;
      EXPECT(found);
      if (found && std::fabs(seen[r][e] - w) > 1e-6) {
        std::printf("    %s: row %d expert %d weight %.8f, want %.8f\n", what, r, e, seen[r][e], w);
        EXPECT(false);
      }
    }
  }
}

TEST(route_top_k_matches_a_naive_router) {
  std::mt19937 rng(7);
  std::normal_distribution<float> n01;
  for (int E : {4, 8, 60})
    for (int K : {1, 2, 8})
      for (int rows : {0, 1, 7, 33})
        for (bool renorm : {false, true}) {
          if (K > E) continue;
          std::vector<float> logits(rows * E);
          for (float& x : logits) x = 2.0f * n01(rng);
          check_routing(logits, rows, E, K, renorm, "random");
        }
}

TEST(route_top_k_every_row_one_expert_and_idle_experts) {
  const int rows = 9, E = 6;
  std::vector<float> logits(rows * E, 0.0f);
  for (int r = 0; r < rows; ++r) logits[r * E + 4] = 10.0f, logits[r * E + (r % 2)] = 5.0f;
  check_routing(logits, rows, E, 1, false, "one expert");
  ExpertRouting got;
  route_top_k(logits.data(), rows, E, 1, true, got);
  EXPECT_EQ(got.count(4), rows);
  for (int e : {0, 1, 2, 3, 5}) EXPECT_EQ(got.count(e), 0);
  for (float w : got.weights) EXPECT(w == 1.0f);  // renormalized over one expert
  check_routing(logits, rows, E, 2, true, "one expert and one of two");
  route_top_k(logits.data(), rows, E, 2, false, got);
  EXPECT(got.count(4) == rows && got.count(0) == 5 && got.count(1) == 4 && got.count(2) == 0);
  // equal logits: the lower ids first (as torch.topk on the CPU)
  std::vector<float> flat(E, 1.0f);
  route_top_k(flat.data(), 1, E, 3, false, got);
  EXPECT(got.count(0) == 1 && got.count(1) == 1 && got.count(2) == 1 && got.count(3) == 0);
  EXPECT_THROWS(route_top_k(flat.data(), 1, E, E + 1, false, got));
  EXPECT_THROWS(route_top_k(flat.data(), 1, E, 0, false, got));
}

// A linear weight [n, k] for the backend (t) and its values in double (w): fp32 random, or a random AWQ
// "GEMM" int4 weight (group g; AutoAWQ's nibble order) dequantized from the format's definition.
struct Weight {
  std::vector<double> w;  // [n, k]
  std::vector<float> f32;
  std::vector<int32_t> qweight, qzeros;
  std::vector<uint16_t> scales;
  LinearTensors t;
  Weight(int n, int k, std::mt19937& rng, int awq_group = 0) : w((size_t)n * k) {
    std::normal_distribution<float> d(0.0f, 1.0f / std::sqrt((float)k));
    if (awq_group == 0) {
      f32.resize(w.size());
      for (size_t i = 0; i < w.size(); ++i) w[i] = f32[i] = d(rng);
      t.weight = make_view(f32.data(), DType::F32, n, k);
      return;
    }
    const int g = awq_group;
    std::uniform_int_distribution<uint32_t> bits;
    qweight.resize((size_t)k * n / 8), qzeros.resize((size_t)k / g * n / 8);
    for (auto& x : qweight) x = (int32_t)bits(rng);
    for (auto& x : qzeros) x = (int32_t)bits(rng);
    for (int i = 0; i < k / g * n; ++i) scales.push_back(f32_to_f16(0.3f * std::fabs(d(rng)) + 1e-3f));
    const int order[8] = {0, 2, 4, 6, 1, 3, 5, 7};  // nibble i holds column 8c + order[i]
    auto nibble = [&](const std::vector<int32_t>& m, int row, int col) {
      for (int i = 0; i < 8; ++i)
        if (order[i] == col % 8) return (int)(((uint32_t)m[(size_t)row * (n / 8) + col / 8] >> (4 * i)) & 15u);
      return -1;
    };
    for (int r = 0; r < n; ++r)
      for (int c = 0; c < k; ++c)
        w[(size_t)r * k + c] =
            (double)(nibble(qweight, c, r) - nibble(qzeros, c / g, r)) * f16_to_f32(scales[(size_t)c / g * n + r]);
    t.int4.layout = Int4Layout::AwqGemm;
    t.int4.values = make_view(qweight.data(), DType::I32, k, n / 8);
    t.int4.zeros = make_view(qzeros.data(), DType::I32, k / g, n / 8);
    t.int4.scales = make_view(scales.data(), DType::F16, k / g, n);
    t.int4_source = int4_source(t.int4, n, k, g, "expert");
  }
  double dot(int row, const double* x, int k) const {
    double s = 0;
    for (int c = 0; c < k; ++c) s += w[(size_t)row * k + c] * x[c];
    return s;
  }
};

struct MoeCase {
  int E, K, rows, H, I;
  bool renorm, in_place;
  int awq_group = 0;              // 0: fp32 experts
  bool int8_activations = false;  // AWQ experts with int8 activations (the decode path)
  bool same_expert = false;       // every row's router logits favour expert E - 1
};

// The CPU backend's moe() on one case against a per-row loop in double; returns the relative error.
double moe_error(const MoeCase& c, std::mt19937& rng) {
  std::normal_distribution<float> n01;
  const int E = c.E, K = c.K, rows = c.rows, H = c.H, I = c.I;
  BackendOptions options;
  options.num_threads = 2;
  options.int8_activations = c.int8_activations;
  std::unique_ptr<Backend> b = make_cpu_backend(options);
  Weight router(E, H, rng);
  if (c.same_expert)
    for (int col = 0; col < H; ++col) router.w[(size_t)(E - 1) * H + col] = router.f32[(size_t)(E - 1) * H + col] = 0;
  std::vector<Weight> gate, up, down;
  for (int e = 0; e < E; ++e)
    gate.emplace_back(I, H, rng, c.awq_group), up.emplace_back(I, H, rng, c.awq_group),
        down.emplace_back(H, I, rng, c.awq_group);
  PackedExperts pe;
  pe.router = b->pack_linear({&router.t});
  for (int e = 0; e < E; ++e) {
    pe.gate_up.push_back(b->pack_linear({&gate[e].t, &up[e].t}));
    pe.down.push_back(b->pack_linear({&down[e].t}));
  }
  MoeSpec spec;
  spec.top_k = K, spec.renormalize = c.renorm, spec.inter = I, spec.act = Activation::kSilu;
  std::vector<float> x((size_t)rows * H), out((size_t)rows * H, std::numeric_limits<float>::quiet_NaN());
  for (float& v : x) v = n01(rng);
  if (c.same_expert)  // x[:, 0] large and positive, router row E - 1 all zero but column 0: its logit wins
    for (int r = 0; r < rows; ++r) x[(size_t)r * H] = 5.0f + std::fabs(x[(size_t)r * H]);
  if (c.same_expert) router.w[(size_t)(E - 1) * H] = router.f32[(size_t)(E - 1) * H] = 3.0f;
  if (c.same_expert) pe.router = b->pack_linear({&router.t});
  const std::vector<float> x0 = x;
  b->moe(x.data(), rows, pe, spec, c.in_place ? x.data() : out.data());
  const std::vector<float>& got = c.in_place ? x : out;
  std::vector<float> logits((size_t)rows * E);
  std::vector<double> xd(H), hid(I);
  for (int r = 0; r < rows; ++r)
    for (int e = 0; e < E; ++e) {
      for (int col = 0; col < H; ++col) xd[col] = x0[(size_t)r * H + col];
      logits[(size_t)r * E + e] = (float)router.dot(e, xd.data(), H);
    }
  const auto routes = naive_route(logits, rows, E, K, c.renorm);
  if (c.same_expert)
    for (int r = 0; r < rows; ++r) EXPECT(routes[r].count(E - 1) == 1);
  double err = 0, norm = 0;
  for (int r = 0; r < rows; ++r) {
    for (int col = 0; col < H; ++col) xd[col] = x0[(size_t)r * H + col];
    std::vector<double> y(H, 0.0);
    for (const auto& [e, w] : routes[r]) {
      for (int i = 0; i < I; ++i) {
        const double g = gate[e].dot(i, xd.data(), H), u = up[e].dot(i, xd.data(), H);
        hid[i] = g / (1.0 + std::exp(-g)) * u;
      }
      for (int col = 0; col < H; ++col) y[col] += w * down[e].dot(col, hid.data(), I);
    }
    for (int col = 0; col < H; ++col) {
      const double d = got[(size_t)r * H + col] - y[col];
      err += std::isfinite(got[(size_t)r * H + col]) ? d * d : 1e30;
      norm += y[col] * y[col];
    }
  }
  return std::sqrt(err / norm);
}

// The CPU backend's moe() against a per-row loop in double: NaN-poisoned output, rows that share experts,
// experts no row picks, every row on one expert, in place (out == x); experts whose gate | up cannot be one
// weight (I = 24: run expert by expert) and those that can (I = 64: every projection one linear_group).
TEST(cpu_moe_matches_a_per_row_loop) {
  std::mt19937 rng(11);
  for (int E : {5, 16})
    for (int K : {1, 2, 4})
      for (int rows : {1, 3, 20})
        for (bool renorm : {false, true})
          for (bool in_place : {false, true})
            for (int I : {24, 64}) {
              const MoeCase c{E, K, rows, I == 24 ? 40 : 64, I, renorm, in_place};
              const double rel = moe_error(c, rng);
              if (!(rel < 1e-5))
                std::printf("    E %d K %d rows %d I %d renorm %d in place %d: rel err %.3g\n", E, K, rows, I, renorm,
                            in_place, rel);
              EXPECT(rel < 1e-5);
            }
  for (int rows : {1, 9}) {
    const MoeCase c{8, 2, rows, 64, 64, true, false, 0, false, true};
    EXPECT(moe_error(c, rng) < 1e-5);
  }
}

// AWQ int4 experts (group 32) against their dequantized values: exact dequantization (fp32 activations),
// or int8 activations (decode) within their rounding.
TEST(cpu_moe_awq_experts_match_their_dequantized_weights) {
  std::mt19937 rng(12);
  for (bool q8 : {false, true})
    for (int rows : {1, 2, 13}) {
      MoeCase c{8, 2, rows, 64, 96, true, false, 32, q8};
      const double rel = moe_error(c, rng);
      if (!(rel < (q8 ? 3e-2 : 1e-5))) std::printf("    AWQ int8 act %d rows %d: rel err %.3g\n", q8, rows, rel);
      EXPECT(rel < (q8 ? 3e-2 : 1e-5));
    }
}

}  // namespace

int main() { return lmkit::testing::run_all(); }
