#include "model/moe_routing.h"

#include <algorithm>
#include <cmath>
#include <numeric>

#include "core/check.h"

namespace lmkit {

void route_top_k(const float* logits, int64_t num_rows, int32_t num_experts, int32_t top_k, bool renormalize,
                 ExpertRouting& out) {
  LMKIT_CHECK(num_experts > 0 && top_k > 0 && top_k <= num_experts, "route_top_k: top_k ", top_k,
              " of ", num_experts, " experts");
  LMKIT_CHECK(num_rows >= 0 && (num_rows == 0 || logits != nullptr), "route_top_k: no logits");
  const int32_t E = num_experts, K = top_k;
  std::vector<int32_t> chosen((size_t)num_rows * K);
  std::vector<float> weight((size_t)num_rows * K);
  std::vector<float> prob(E);
  std::vector<int32_t> order(E);
  out.num_experts = E;
  out.offsets.assign(E + 1, 0);
  for (int64_t r = 0; r < num_rows; ++r) {
    const float* z = logits + r * E;
    const float mx = *std::max_element(z, z + E);
    float sum = 0.0f;
    for (int32_t e = 0; e < E; ++e) sum += prob[e] = std::exp(z[e] - mx);
    for (int32_t e = 0; e < E; ++e) prob[e] /= sum;
    std::iota(order.begin(), order.end(), 0);
    std::partial_sort(order.begin(), order.begin() + K, order.end(),
                      [&](int32_t a, int32_t b) { return prob[a] > prob[b] || (prob[a] == prob[b] && a < b); });
    float kept = 0.0f;
    for (int32_t j = 0; j < K; ++j) kept += prob[order[j]];
    for (int32_t j = 0; j < K; ++j) {
      chosen[r * K + j] = order[j];
      weight[r * K + j] = renormalize ? prob[order[j]] / kept : prob[order[j]];
      ++out.offsets[order[j] + 1];
    }
  }
  for (int32_t e = 0; e < E; ++e) out.offsets[e + 1] += out.offsets[e];
  out.rows.resize((size_t)num_rows * K);
  out.weights.resize((size_t)num_rows * K);
  std::vector<int32_t> fill(out.offsets.begin(), out.offsets.end() - 1);
  for (int64_t r = 0; r < num_rows; ++r)  // rows in order: ascending within each expert
    for (int32_t j = 0; j < K; ++j) {
      const int32_t at = fill[chosen[r * K + j]]++;
      out.rows[at] = (int32_t)r;
      out.weights[at] = weight[r * K + j];
    }
}

}  // namespace lmkit
