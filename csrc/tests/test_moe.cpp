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

struct Dense {
  std::vector<float> w;  // [n, k]
  LinearTensors t;
  Dense(int n, int k, std::mt19937& rng) : w((size_t)n * k) {
    std::normal_distribution<float> d(0.0f, 1.0f / std::sqrt((float)k));
    for (float& x : w) x = d(rng);
    t.weight = make_view(w.data(), DType::F32, n, k);
  }
  double dot(int row, const double* x, int k) const {
    double s = 0;
    for (int c = 0; c < k; ++c) s += (double)w[(size_t)row * k + c] * x[c];
    return s;
  }
};

// The CPU backend's moe() against a per-row loop in double: NaN-poisoned output, rows that share experts,
// experts no row picks, and in place (out == x).
TEST(cpu_moe_matches_a_per_row_loop) {
  std::mt19937 rng(11);
  std::normal_distribution<float> n01;
  for (int E : {5, 16})
    for (int K : {1, 2, 4})
      for (int rows : {1, 3, 20})
        for (bool renorm : {false, true})
          for (bool in_place : {false, true}) {
            const int H = 40, I = 24;
            BackendOptions options;
            options.num_threads = 2;
            std::unique_ptr<Backend> b = make_cpu_backend(options);
            Dense router(E, H, rng);
            std::vector<Dense> gate, up, down;
            for (int e = 0; e < E; ++e) gate.emplace_back(I, H, rng), up.emplace_back(I, H, rng), down.emplace_back(H, I, rng);
            PackedExperts pe;
            pe.router = b->pack_linear({&router.t});
            for (int e = 0; e < E; ++e) {
              pe.gate_up.push_back(b->pack_linear({&gate[e].t, &up[e].t}));
              pe.down.push_back(b->pack_linear({&down[e].t}));
            }
            MoeSpec spec;
            spec.top_k = K, spec.renormalize = renorm, spec.inter = I, spec.act = Activation::kSilu;
            std::vector<float> x((size_t)rows * H), out((size_t)rows * H, std::numeric_limits<float>::quiet_NaN());
            for (float& v : x) v = n01(rng);
            const std::vector<float> x0 = x;
            b->moe(x.data(), rows, pe, spec, in_place ? x.data() : out.data());
            const std::vector<float>& got = in_place ? x : out;
            std::vector<float> logits((size_t)rows * E);
            std::vector<double> xd(H), hid(I);
            for (int r = 0; r < rows; ++r)
              for (int e = 0; e < E; ++e) {
                for (int c = 0; c < H; ++c) xd[c] = x0[r * H + c];
                logits[r * E + e] = (float)router.dot(e, xd.data(), H);
              }
            const auto routes = naive_route(logits, rows, E, K, renorm);
            double err = 0, norm = 0;
            for (int r = 0; r < rows; ++r) {
              for (int c = 0; c < H; ++c) xd[c] = x0[r * H + c];
              std::vector<double> y(H, 0.0);
              for (const auto& [e, w] : routes[r]) {
                for (int i = 0; i < I; ++i) {
                  const double g = gate[e].dot(i, xd.data(), H), u = up[e].dot(i, xd.data(), H);
                  hid[i] = g / (1.0 + std::exp(-g)) * u;
                }
                for (int c = 0; c < H; ++c) y[c] += w * down[e].dot(c, hid.data(), I);
              }
              for (int c = 0; c < H; ++c) {
                const double d = got[r * H + c] - y[c];
                err += std::isfinite(got[r * H + c]) ? d * d : 1e30;
                norm += y[c] * y[c];
              }
            }
            const double rel = std::sqrt(err / norm);
            if (!(rel < 1e-5))
              std::printf("    E %d K %d rows %d renorm %d in place %d: rel err %.3g\n", E, K, rows, renorm, in_place, rel);
            EXPECT(rel < 1e-5);
          }
}

}  // namespace

int main() { return lmkit::testing::run_all(); }
