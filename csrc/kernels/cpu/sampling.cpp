#include "kernels/cpu/sampling.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <unordered_map>
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

void apply_penalties(float* logits, int32_t vocab, const SamplingParams& p, const int32_t* history,
                     int32_t num_history, int32_t num_prompt, const int32_t* banned, int32_t num_banned) {
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
  if (p.presence_penalty != 0.0f || p.frequency_penalty != 0.0f) {
    std::unordered_map<int32_t, int32_t> counts;
    for (int32_t i = num_prompt; i < num_history; ++i) ++counts[history[i]];
    for (const auto& kv : counts)
      if (kv.first >= 0 && kv.first < vocab)
        logits[kv.first] -= p.presence_penalty + p.frequency_penalty * (float)kv.second;
  }
}

// log-softmax of logits: the chosen token's value and the k best (ties: lower id first).
void fill_logprobs(const float* logits, int32_t vocab, int32_t chosen, int32_t k, SampleLogprobs* out) {
  float top = logits[argmax(logits, vocab)];
  double total = 0;
  for (int32_t i = 0; i < vocab; ++i) total += std::exp((double)logits[i] - top);
  const double log_z = top + std::log(total);
  out->logprob = (float)(logits[chosen] - log_z);
  out->top_ids.clear();
  out->top_logprobs.clear();
  k = std::min(k, vocab);
  if (k <= 0) return;
  std::vector<int32_t> ids(vocab);
  for (int32_t i = 0; i < vocab; ++i) ids[i] = i;
  std::partial_sort(ids.begin(), ids.begin() + k, ids.end(), [&](int32_t a, int32_t b) {
    return logits[a] > logits[b] || (logits[a] == logits[b] && a < b);
  });
  for (int32_t i = 0; i < k; ++i) {
    out->top_ids.push_back(ids[i]);
    out->top_logprobs.push_back((float)(logits[ids[i]] - log_z));
  }
}

// Temperature, top-k, top-p, min-p, then one draw. logits are already penalised.
int32_t draw(const float* logits, int32_t vocab, const SamplingParams& p, std::mt19937_64& rng) {
  const float neg_inf = -std::numeric_limits<float>::infinity();
  std::vector<std::pair<float, int32_t>> cand;  // (logit / temperature, id), best first after top-k
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

  std::vector<double> prob(cand.size());  // softmax over the survivors, in double
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

}  // namespace

int32_t sample(float* logits, int32_t vocab, const SamplingParams& p, const int32_t* history, int32_t num_history,
               int32_t num_prompt, const int32_t* banned, int32_t num_banned, std::mt19937_64& rng,
               SampleLogprobs* logprobs) {
  apply_penalties(logits, vocab, p, history, num_history, num_prompt, banned, num_banned);
  const int32_t token = p.is_greedy() ? argmax(logits, vocab) : draw(logits, vocab, p, rng);
  if (logprobs && p.logprobs >= 0) fill_logprobs(logits, vocab, token, p.logprobs, logprobs);
  return token;
}

}  // namespace lmkit::ops
