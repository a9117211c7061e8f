#include "kernels/cpu/sampling.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <unordered_set>
#include <utility>
#include <vector>

namespace lmkit::ops {

namespace {

int32_t argmax(const float* x, int32_t n) {
  int32_t best = 0;
  for (int32_t i = 1; i < n; ++i)
    if (x[i] > x[best]) best = i;
  return best;
}

}  // namespace

int32_t sample(float* logits, int32_t vocab, const SamplingParams& p, const int32_t* history, int32_t num_history,
               const int32_t* banned, int32_t num_banned, std::mt19937_64& rng) {
  const float neg_inf = -std::numeric_limits<float>::infinity();
  for (int32_t i = 0; i < num_banned; ++i)
    if (banned[i] >= 0 && banned[i] < vocab) logits[banned[i]] = neg_inf;
  if (p.repetition_penalty != 1.0f) {
    std::unordered_set<int32_t> seen(history, history + num_history);
    for (int32_t t : seen) {
      if (t < 0 || t >= vocab) continue;
      float& l = logits[t];
      l = l > 0 ? l / p.repetition_penalty : l * p.repetition_penalty;
    }
  }
  if (p.is_greedy()) return argmax(logits, vocab);

  // Candidates (logit / temperature, id), best first after top-k.
  std::vector<std::pair<float, int32_t>> cand;
  cand.reserve(vocab);
  const float inv_t = 1.0f / p.temperature;
  for (int32_t i = 0; i < vocab; ++i)
    if (logits[i] != neg_inf) cand.emplace_back(logits[i] * inv_t, i);
  if (cand.empty()) return argmax(logits, vocab);
  auto by_logit = [](const std::pair<float, int32_t>& a, const std::pair<float, int32_t>& b) {
    return a.first > b.first || (a.first == b.first && a.second < b.second);
  };
  if (p.top_k > 0 && p.top_k < (int32_t)cand.size()) {
    std::nth_element(cand.begin(), cand.begin() + p.top_k, cand.end(), by_logit);
    cand.resize(p.top_k);
  }
  std::sort(cand.begin(), cand.end(), by_logit);

  // Softmax over the survivors (in double: sums over 10^5 terms).
  std::vector<double> prob(cand.size());
  const double top = cand[0].first;
  double total = 0;
  for (size_t i = 0; i < cand.size(); ++i) total += prob[i] = std::exp((double)cand[i].first - top);
  for (double& x : prob) x /= total;

  size_t keep = cand.size();
  if (p.top_p < 1.0f) {  // smallest prefix whose mass reaches top_p (at least one token)
    double cum = 0;
    for (size_t i = 0; i < cand.size(); ++i) {
      cum += prob[i];
      if (cum >= p.top_p) {
        keep = i + 1;
        break;
      }
    }
  }
  if (p.min_p > 0.0f) {
    const double floor = p.min_p * prob[0];
    size_t n = 1;
    while (n < keep && prob[n] >= floor) ++n;
    keep = n;
  }
  double mass = 0;
  for (size_t i = 0; i < keep; ++i) mass += prob[i];
  double u = std::uniform_real_distribution<double>(0.0, 1.0)(rng) * mass;
  for (size_t i = 0; i < keep; ++i) {
    u -= prob[i];
    if (u < 0) return cand[i].second;
  }
  return cand[keep - 1].second;
}

}  // namespace lmkit::ops
