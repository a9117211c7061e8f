#include "engine/speculative.h"

#include <algorithm>
#include <cmath>

#include "core/check.h"

namespace lmkit {

NgramIndex::NgramIndex(int32_t min_ngram, int32_t max_ngram) : min_ngram_(min_ngram), max_ngram_(max_ngram) {
  LMKIT_CHECK(min_ngram >= 1 && max_ngram >= min_ngram, "n-gram sizes must satisfy 1 <= min <= max, got ", min_ngram,
              " and ", max_ngram);
  ends_.resize(max_ngram - min_ngram + 1);
}

uint64_t NgramIndex::hash(const int32_t* tokens, int32_t n) {
  uint64_t h = 0x9E3779B97F4A7C15ull ^ (uint64_t)n;
  for (int32_t i = 0; i < n; ++i) {
    h ^= (uint64_t)(uint32_t)tokens[i] + 0x9E3779B97F4A7C15ull + (h << 6) + (h >> 2);
    h *= 0xBF58476D1CE4E5B9ull;
  }
  return h ^ (h >> 31);
}

void NgramIndex::reset() {
  indexed_ = 0;
  for (auto& m : ends_) m.clear();
}

void NgramIndex::index(const int32_t* tokens, int32_t num_tokens) {
  if (num_tokens < indexed_) reset();
  // An n-gram ending at e (tokens[e - n, e)) is indexed once tokens[e] exists: e <= num_tokens - 1.
  for (int32_t e = std::max(indexed_, min_ngram_); e < num_tokens; ++e)
    for (int32_t n = min_ngram_; n <= std::min(max_ngram_, e); ++n) ends_[n - min_ngram_][hash(tokens + e - n, n)] = e;
  indexed_ = std::max(indexed_, num_tokens);
}

int32_t NgramIndex::find(const int32_t* stream, int32_t num_stream, const int32_t* query, int32_t num_query) const {
  for (int32_t n = std::min(max_ngram_, num_query); n >= min_ngram_; --n) {
    const int32_t* suffix = query + num_query - n;
    const auto& ends = ends_[n - min_ngram_];
    auto it = ends.find(hash(suffix, n));
    if (it == ends.end()) continue;
    const int32_t e = it->second;
    if (e >= n && e < num_stream && std::equal(suffix, suffix + n, stream + e - n)) return e;  // else a collision
  }
  return -1;
}

int32_t NgramIndex::continuation(const int32_t* stream, int32_t num_stream, int32_t at, int32_t max_tokens,
                                 std::vector<int32_t>& out) {
  const size_t start = out.size();
  for (int32_t j = 0; j < max_tokens; ++j) {
    const int64_t i = (int64_t)at + j;
    // past the stream's end the continuation repeats itself: ext = stream + what was proposed so far
    const int32_t t = i < num_stream ? stream[i] : out[start + (size_t)(i - num_stream)];
    if (t < 0) break;  // a separator or an end marker
    out.push_back(t);
  }
  return (int32_t)(out.size() - start);
}

int32_t NgramIndex::lookup(const int32_t* stream, int32_t num_stream, const int32_t* query, int32_t num_query,
                           int32_t max_tokens, std::vector<int32_t>& out) const {
  if (max_tokens <= 0) return 0;
  const int32_t e = find(stream, num_stream, query, num_query);
  return e < 0 ? 0 : continuation(stream, num_stream, e, max_tokens, out);
}

AnswerStore::AnswerStore(int32_t capacity_tokens, int32_t min_ngram, int32_t max_ngram)
    : capacity_(capacity_tokens), index_(min_ngram, max_ngram) {}

void AnswerStore::add(const int32_t* tokens, int32_t num_tokens) {
  if (capacity_ <= 0 || num_tokens <= 0) return;
  if (num_tokens > capacity_ - 1) {  // an answer longer than the store: its last tokens
    tokens += num_tokens - (capacity_ - 1);
    num_tokens = capacity_ - 1;
  }
  stream_.insert(stream_.end(), tokens, tokens + num_tokens);
  stream_.push_back(-1);
  lengths_.push_back(num_tokens + 1);
  // Past the capacity the oldest answers go until a quarter of it is free, so the index is rebuilt once per
  // quarter of the capacity added, not once per answer.
  int32_t drop = 0;
  const int32_t keep = (int32_t)stream_.size() > capacity_ ? capacity_ - capacity_ / 4 : capacity_;
  while ((int32_t)stream_.size() - drop > keep && lengths_.size() > 1) {
    drop += lengths_.front();
    lengths_.pop_front();
  }
  if (drop > 0) {
    stream_.erase(stream_.begin(), stream_.begin() + drop);
    rebuild();
  } else {
    index_.index(stream_.data(), (int32_t)stream_.size());
  }
}

void AnswerStore::rebuild() {
  index_.reset();
  index_.index(stream_.data(), (int32_t)stream_.size());
}

int32_t AnswerStore::lookup(const int32_t* query, int32_t num_query, int32_t max_tokens,
                            std::vector<int32_t>& out) const {
  if (stream_.empty()) return 0;
  // The store ends with a separator: a continuation never runs past it into a repeat.
  return index_.lookup(stream_.data(), (int32_t)stream_.size(), query, num_query, max_tokens, out);
}

PredictionLookup::PredictionLookup(std::vector<int32_t> prediction, int32_t min_ngram, int32_t max_ngram)
    : prediction_(std::move(prediction)), index_(min_ngram, max_ngram), min_ngram_(min_ngram) {
  prediction_.push_back(-1);  // the end marker: the last n-grams are indexed, their continuation is empty
  index_.index(prediction_.data(), (int32_t)prediction_.size());
}

int32_t PredictionLookup::propose(const int32_t* tokens, int32_t num_tokens, int32_t num_generated, int32_t max_tokens,
                                  std::vector<int32_t>& out) {
  const int32_t size = (int32_t)prediction_.size() - 1;
  int32_t at = -1;
  if (anchor_ < 0) {
    // Before the first proposal: the output so far lines up with the prediction's start, or not at all.
    if (num_generated <= size && std::equal(tokens + num_tokens - num_generated, tokens + num_tokens, prediction_.data()))
      at = num_generated;
  } else {
    // Still aligned when the tokens since the anchor match the prediction from there (the drafts were kept and the
    // token after them too), checked on the last min_ngram as a lookup would match them; or when all but the last
    // do: the model replaced one token of the prediction (an edit), which it then goes on after.
    const int32_t c = anchor_ + (num_tokens - anchor_tokens_);
    const int32_t m = std::min({min_ngram_, num_generated - 1, c - 1});
    const int32_t* p = prediction_.data();
    if (c <= size && m > 0 && std::equal(tokens + num_tokens - 1 - m, tokens + num_tokens - 1, p + c - 1 - m)) at = c;
  }
  // Else realign on the output's last n-gram (generated tokens only: the prompt is not the prediction's context).
  if (at < 0) at = index_.find(prediction_.data(), size + 1, tokens + num_tokens - num_generated, num_generated);
  if (at < 0) return 0;
  const int32_t proposed = NgramIndex::continuation(prediction_.data(), size + 1, at, max_tokens, out);
  if (proposed > 0) anchor_ = at, anchor_tokens_ = num_tokens;
  return proposed;
}

int32_t SpecState::draft_budget(int32_t source, int32_t max_tokens) {
  if (acceptance(source) >= kOffBelow) return max_tokens;
  if (++idle_steps[source] < kProbeInterval) return 0;
  idle_steps[source] = 0;
  return std::min(kProbeTokens, max_tokens);  // a probe
}

void SpecState::record(int32_t source, int32_t proposed, int32_t accepted) {
  if (proposed <= 0) return;
  constexpr float kDecay = 0.8f;  // about the last five verifications count
  kept[source] = kDecay * kept[source] + (float)accepted;
  examined[source] = kDecay * examined[source] + (float)(accepted + (accepted < proposed ? 1 : 0));
}

void StepCost::record(int32_t rows, double seconds) {
  if (rows <= 0 || rows >= (int32_t)seconds_.size() || !(seconds > 0)) return;
  double& s = seconds_[(size_t)rows];
  s = s == 0.0 ? seconds : 0.8 * s + 0.2 * seconds;
}

double StepCost::seconds(int32_t rows) const {
  rows = std::max(1, std::min(rows, (int32_t)seconds_.size() - 1));
  if (seconds_[(size_t)rows] > 0) return seconds_[(size_t)rows];
  int32_t below = rows - 1, above = rows + 1;
  while (below >= 1 && seconds_[(size_t)below] == 0.0) --below;
  while (above < (int32_t)seconds_.size() && seconds_[(size_t)above] == 0.0) ++above;
  const bool has_below = below >= 1, has_above = above < (int32_t)seconds_.size();
  if (has_below && has_above) {  // between two measurements: on the line through them
    const double t = (double)(rows - below) / (double)(above - below);
    return seconds_[(size_t)below] + t * (seconds_[(size_t)above] - seconds_[(size_t)below]);
  }
  if (has_above) return seconds_[(size_t)above];  // fewer rows never cost more
  if (!has_below) return 0.0;
  // beyond the largest measurement: a quarter of the growth of a compute-bound step (cost proportional to rows)
  return seconds_[(size_t)below] * (1.0 + 0.25 * (double)(rows - below) / (double)below);
}

std::vector<int32_t> choose_drafts(const std::vector<DraftCandidate>& candidates, int32_t decode_rows,
                                   int32_t max_rows, const StepCost& cost, double fixed_seconds) {
  const size_t n = candidates.size();
  std::vector<int32_t> take(n, 0);
  std::vector<float> next_gain(n);  // the worth of each sequence's next draft: a^(taken + 1)
  double tokens = std::max(decode_rows, 1);
  int32_t rows = std::max(decode_rows, 1), extra = 0;
  const bool measured = cost.seconds(1) > 0.0;
  const double probe_limit = cost.seconds(rows) * (1.0 + kProbeStepCost);  // unmeasured: every probe
  for (size_t i = 0; i < n; ++i) {
    const DraftCandidate& c = candidates[i];
    next_gain[i] = c.acceptance;
    int32_t probe = std::max(std::min({c.at_least, c.proposed, max_rows - extra}), 0);
    if (probe > 0 && measured && cost.seconds(rows + extra + probe) > probe_limit) probe = 0;
    for (int32_t j = 0; j < probe; ++j) tokens += next_gain[i], next_gain[i] *= c.acceptance;
    take[i] = probe;
    extra += probe;
  }
  rows += extra;
  while (extra < max_rows && measured) {
    size_t best = n;
    for (size_t i = 0; i < n; ++i)
      if (take[i] < candidates[i].proposed && (best == n || next_gain[i] > next_gain[best])) best = i;
    if (best == n) break;
    const double gain = next_gain[best];
    // take it while tokens per second grow: (tokens + gain) / (T(rows + 1) + F) > tokens / (T(rows) + F)
    if ((tokens + gain) * (cost.seconds(rows) + fixed_seconds) <= tokens * (cost.seconds(rows + 1) + fixed_seconds))
      break;
    tokens += gain;
    ++rows, ++extra, ++take[best];
    next_gain[best] *= candidates[best].acceptance;
  }
  return take;
}

std::vector<int32_t> take_in_order(const std::vector<DraftCandidate>& candidates, int32_t max_rows) {
  std::vector<int32_t> take;
  for (const DraftCandidate& c : candidates) {
    take.push_back(std::max(std::min(c.proposed, max_rows), 0));
    max_rows -= take.back();
  }
  return take;
}

std::vector<int32_t> choose_model_drafts(const std::vector<DraftCandidate>& candidates, int32_t decode_rows,
                                         int32_t max_rows, const StepCost& cost, const StepCost& draft_cost) {
  const size_t n = candidates.size();
  // the probes first, within the step's draft rows: always taken (a proposer switched off comes back only so)
  std::vector<int32_t> take(n, 0);
  int32_t rows = std::max(decode_rows, 1), left = max_rows, deepest = 0;
  double tokens = rows;
  for (size_t i = 0; i < n; ++i) {
    take[i] = std::max(std::min({candidates[i].at_least, candidates[i].proposed, left}), 0);
    left -= take[i];
    rows += take[i];
    float gain = candidates[i].acceptance;
    for (int32_t j = 0; j < take[i]; ++j) tokens += gain, gain *= candidates[i].acceptance;
    deepest = std::max(deepest, candidates[i].proposed);
  }
  if (!(cost.seconds(1) > 0.0) || !(draft_cost.seconds(1) > 0.0)) return take;  // unmeasured: the probes only
  // pass j runs over the sequences drafting j or more tokens: its rows, depth by depth
  std::vector<int32_t> at_depth((size_t)deepest + 2, 0);
  for (int32_t t : take)
    for (int32_t j = 1; j <= t; ++j) ++at_depth[(size_t)j];
  auto rate = [&](double tok, int32_t r) {
    double passes = 0;
    for (int32_t j = 1; j <= deepest && at_depth[(size_t)j] > 0; ++j) passes += draft_cost.seconds(at_depth[(size_t)j]);
    return tok / (cost.seconds(r) + passes);
  };
  std::vector<int32_t> best = take;
  double best_rate = rate(tokens, rows);
  // Then, for each depth d, the sequences by acceptance, best first: the first k of them drafting d tokens (or as
  // many as they propose), for the d and k whose step gives the most expected tokens per second.
  std::vector<size_t> order(n);
  for (size_t i = 0; i < n; ++i) order[i] = i;
  std::stable_sort(order.begin(), order.end(), [&](size_t a, size_t b) {
    return candidates[a].acceptance > candidates[b].acceptance;
  });
  const std::vector<int32_t> probes = take;
  const std::vector<int32_t> probe_depths = at_depth;
  const double probe_tokens = tokens;
  const int32_t probe_rows = rows, probe_left = left;
  for (int32_t depth = 1; depth <= deepest; ++depth) {
    take = probes, at_depth = probe_depths, tokens = probe_tokens, rows = probe_rows, left = probe_left;
    for (size_t i : order) {
      const int32_t want = std::min({candidates[i].proposed, depth, take[i] + left});
      if (want <= take[i]) continue;
      double gain = std::pow((double)candidates[i].acceptance, (double)(take[i] + 1));
      for (int32_t j = take[i] + 1; j <= want; ++j) {
        tokens += gain, gain *= candidates[i].acceptance;
        ++at_depth[(size_t)j];
      }
      rows += want - take[i], left -= want - take[i], take[i] = want;
      const double r = rate(tokens, rows);
      if (r > best_rate) best_rate = r, best = take;
    }
  }
  return best;
}

double draft_saving_per_token(float acceptance, int32_t max_depth, const StepCost& cost, const StepCost& draft_cost) {
  const double one = cost.seconds(1), pass = draft_cost.seconds(1);
  if (!(one > 0.0) || !(pass > 0.0)) return -1.0;
  const double a = std::min(std::max((double)acceptance, 0.0), 1.0);
  double best = 0.0, tokens = 1.0, gain = 1.0;
  for (int32_t d = 1; d <= max_depth; ++d) {
    gain *= a;
    tokens += gain;
    best = std::max(best, one - (cost.seconds(1 + d) + d * pass) / tokens);
  }
  return best;
}

bool worth_catching_up(double catch_up_seconds, double saving, int32_t generated, int32_t left) {
  if (saving < 0.0 || catch_up_seconds <= std::max(saving, 0.0)) return true;
  if (saving == 0.0 || (double)left * saving < catch_up_seconds) return false;
  return (double)generated * saving >= kCatchUpRent * catch_up_seconds;
}

}  // namespace lmkit
