#include "kernels/cpu/sampling.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <unordered_map>
#include <unordered_set>
#include <utility>
#include <vector>
#if defined(__SSE2__)
#include <emmintrin.h>
#endif

#include "kernels/ops.h"

namespace lmkit::ops {

namespace {

// The lowest index of the maximum; NaN entries never win (all NaN: 0).
int32_t argmax_scalar(const float* x, int32_t n) {
  int32_t best = -1;
  for (int32_t i = 0; i < n; ++i)
    if (x[i] == x[i] && (best < 0 || x[i] > x[best])) best = i;
  return best < 0 ? 0 : best;
}

// The same, a block of kArgmaxBlock at a time: a vector max per block (maxps(x, m) keeps m where x is NaN), the
// first block whose max is strictly larger than every earlier one's, then the first index of that max in it. The
// scalar loop's branch per value took ~2% of a 16-stream SmolLM2 step (greedy, 49,152 logits a row) on the
// engine thread, with the team's other threads waiting.
constexpr int32_t kArgmaxBlock = 256;
int32_t argmax(const float* x, int32_t n) {
#if defined(__SSE2__)
  float best = -std::numeric_limits<float>::infinity();
  int32_t best_block = -1, best_tail = -1;  // the block holding the maximum, or its index in the tail
  int32_t b0 = 0;
  for (; b0 + kArgmaxBlock <= n; b0 += kArgmaxBlock) {
    __m128 m0 = _mm_set1_ps(best), m1 = m0, m2 = m0, m3 = m0;
    for (int32_t i = b0; i < b0 + kArgmaxBlock; i += 16) {
      m0 = _mm_max_ps(_mm_loadu_ps(x + i), m0);
      m1 = _mm_max_ps(_mm_loadu_ps(x + i + 4), m1);
      m2 = _mm_max_ps(_mm_loadu_ps(x + i + 8), m2);
      m3 = _mm_max_ps(_mm_loadu_ps(x + i + 12), m3);
    }
    alignas(16) float lanes[4];
    _mm_store_ps(lanes, _mm_max_ps(_mm_max_ps(m0, m1), _mm_max_ps(m2, m3)));
    const float m = std::max(std::max(lanes[0], lanes[1]), std::max(lanes[2], lanes[3]));
    if (m > best) best = m, best_block = b0;
  }
  for (int32_t i = b0; i < n; ++i)  // the tail, value by value
    if (x[i] > best) best = x[i], best_tail = i;
  if (best_tail >= 0) return best_tail;
  if (best_block < 0) return argmax_scalar(x, n);  // nothing above -inf: the first value that is not NaN
  for (int32_t i = best_block;; ++i)
    if (x[i] == best) return i;
#else
  return argmax_scalar(x, n);
#endif
}

void apply_penalties(float* logits, int32_t vocab, const SamplerParams& p, const int32_t* history,
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

// Tokens bucketed by the top bits of their weight's float pattern: a weight e is in (0, 1] (the best
// token has e = 1), where patterns order like values, so bucket b > b' means every weight of b is larger.
constexpr int kBucketShift = 19;                          // 8 exponent + 4 mantissa bits
constexpr int kNumBuckets = (0x3F800000 >> kBucketShift) + 1;  // up to the pattern of 1.0f

int bucket_of(float e) {
  uint32_t bits;
  std::memcpy(&bits, &e, 4);
  return (int)(bits >> kBucketShift);
}

// The best-first prefix of `ids` (order: weight desc, id asc) that stops at `max_count` tokens or as soon
// as its mass reaches `target`, whichever comes first; returned in no particular order. One pass
// histograms the tokens' weights by bucket; the prefix's boundary falls inside one bucket, and only that
// bucket's tokens are sorted.
std::vector<int32_t> best_prefix(const std::vector<int32_t>& ids, const float* e, int64_t max_count, double target) {
  std::vector<int64_t> count(kNumBuckets, 0);
  std::vector<double> mass(kNumBuckets, 0.0);
  for (int32_t i : ids) {
    const int b = bucket_of(e[i]);
    ++count[(size_t)b];
    mass[(size_t)b] += e[i];
  }
  int64_t n = 0;
  double m = 0;
  int boundary = -1;
  for (int b = kNumBuckets - 1; b >= 0; --b) {
    if (n + count[(size_t)b] >= max_count || m + mass[(size_t)b] >= target) {
      boundary = b;
      break;
    }
    n += count[(size_t)b];
    m += mass[(size_t)b];
  }
  if (boundary < 0) return ids;  // everything fits (rounding can leave the mass a hair under target)
  std::vector<int32_t> kept, edge;
  for (int32_t i : ids) {
    const int b = bucket_of(e[i]);
    if (b > boundary)
      kept.push_back(i);
    else if (b == boundary)
      edge.push_back(i);
  }
  std::sort(edge.begin(), edge.end(), [&](int32_t a, int32_t b) { return e[a] > e[b] || (e[a] == e[b] && a < b); });
  for (size_t j = 0; j < edge.size() && n < max_count && m < target; ++j, ++n) {
    kept.push_back(edge[j]);
    m += e[edge[j]];
  }
  return kept;
}

// Temperature, top-k, top-p, min-p, then one draw. logits are already penalised.
//
// Weights e = exp(logit / temperature - max), one pass over the vocabulary (float, summed in double); no
// sort of the vocabulary. Without filters the draw walks e in id order. The filters keep a best-first
// prefix (order: probability desc, id asc): top-k the k best, which then are the whole distribution (HF's
// order: top-p measures mass among them); top-p the shortest prefix whose mass reaches top_p; min-p the
// tokens with p >= min_p * p(best), i.e. e >= min_p. The kept set is drawn from in any order.
int32_t draw(const float* logits, int32_t vocab, const SamplerParams& p, std::mt19937_64& rng) {
  const float neg_inf = -std::numeric_limits<float>::infinity();
  const int32_t best = argmax(logits, vocab);
  if (logits[best] == neg_inf) return best;  // everything banned: the lowest id
  const float inv_t = 1.0f / p.temperature;
  const float top = logits[best];
  std::vector<float> e((size_t)vocab);
  double total = 0;
  for (int32_t i = 0; i < vocab; ++i) {
    // (logit - top) / t, never inf - inf even when t is tiny (inv_t = inf): d <= 0, and d == 0 -> 1;
    // -inf and NaN logits weigh 0
    const float d = logits[i] - top;
    const float w = d == 0.0f ? 1.0f : d < 0.0f ? std::exp(d * inv_t) : 0.0f;
    e[(size_t)i] = w;
    total += w;
  }
  std::uniform_real_distribution<double> uniform(0.0, 1.0);
  const bool use_k = p.top_k > 0 && p.top_k < vocab, use_p = p.top_p < 1.0f, use_min_p = p.min_p > 0.0f;
  if (!use_k && !use_p && !use_min_p) {
    double u = uniform(rng) * total;
    int32_t last = best;
    for (int32_t i = 0; i < vocab; ++i) {
      if (e[(size_t)i] == 0.0f) continue;
      last = i;
      u -= e[(size_t)i];
      if (u < 0) return i;
    }
    return last;  // rounding left u >= 0 after the last token
  }
  // Every filter keeps a prefix of one order, so the result is the shortest of the three prefixes; only
  // top-p's mass depends on the others: it is measured over the top-k set (HF's order), not over what
  // min-p leaves (min-p shortens the prefix, it does not renormalise).
  std::vector<int32_t> kept;
  kept.reserve((size_t)vocab);
  for (int32_t i = 0; i < vocab; ++i)
    if (e[(size_t)i] > 0.0f) kept.push_back(i);
  if (use_k) {
    kept = best_prefix(kept, e.data(), p.top_k, std::numeric_limits<double>::infinity());
    total = 0;
    for (int32_t i : kept) total += e[(size_t)i];
  }
  if (use_min_p)
    kept.erase(std::remove_if(kept.begin(), kept.end(), [&](int32_t i) { return e[(size_t)i] < p.min_p; }),
               kept.end());
  if (use_p) kept = best_prefix(kept, e.data(), INT64_MAX, (double)p.top_p * total);
  if (kept.empty()) return best;  // not reachable with top_p > 0 and min_p < 1 (validated); kept safe anyway
  double mass = 0;
  for (int32_t i : kept) mass += e[(size_t)i];
  double u = uniform(rng) * mass;
  for (int32_t i : kept) {
    u -= e[(size_t)i];
    if (u < 0) return i;
  }
  return kept.back();
}

}  // namespace

void token_logprobs(const float* logits, int32_t vocab, float log_z, int32_t chosen, int32_t k, SampleLogprobs* out,
                    int32_t argmax) {
  out->logprob = logits[chosen] - log_z;
  out->top_ids.clear();
  out->top_logprobs.clear();
  k = std::min(k, vocab);
  if (k <= 0) return;
  if (k == 1 && argmax >= 0) {
    out->top_ids.push_back(argmax);
    out->top_logprobs.push_back(logits[argmax] - log_z);
    return;
  }
  // One pass keeping the k best in descending order; ids come ascending, so an equal value never displaces
  // an earlier one (ties: lower id first) and NaN never enters.
  std::vector<int32_t>& ids = out->top_ids;
  for (int32_t i = 0; i < vocab; ++i) {
    const float v = logits[i];
    if ((int32_t)ids.size() == k && !(v > logits[ids.back()])) continue;
    if (!(v == v)) continue;
    if ((int32_t)ids.size() == k) ids.pop_back();
    auto at = std::upper_bound(ids.begin(), ids.end(), v, [&](float value, int32_t id) { return value > logits[id]; });
    ids.insert(at, i);
  }
  for (int32_t id : ids) out->top_logprobs.push_back(logits[id] - log_z);
}

int32_t sample(float* logits, int32_t vocab, const SamplerParams& p, const int32_t* history, int32_t num_history,
               int32_t num_prompt, const int32_t* banned, int32_t num_banned, const uint32_t* allowed,
               std::mt19937_64& rng, SampleLogprobs* logprobs) {
  if (allowed) {
    const float neg_inf = -std::numeric_limits<float>::infinity();
    for (int32_t w = 0; w * 32 < vocab; ++w) {
      const uint32_t bits = allowed[w];
      if (bits == 0xFFFFFFFFu) continue;
      const int32_t end = std::min(vocab, (w + 1) * 32);
      for (int32_t i = w * 32; i < end; ++i)
        if (!((bits >> (i - w * 32)) & 1u)) logits[i] = neg_inf;
    }
  }
  apply_penalties(logits, vocab, p, history, num_history, num_prompt, banned, num_banned);
  const int32_t token = p.is_greedy() ? argmax(logits, vocab) : draw(logits, vocab, p, rng);
  if (logprobs && p.logprobs >= 0) {
    float log_z = 0;
    int32_t best = 0;
    log_sum_exp(logits, 1, vocab, &log_z, &best);
    token_logprobs(logits, vocab, log_z, token, p.logprobs, logprobs, best);
  }
  return token;
}

}  // namespace lmkit::ops
