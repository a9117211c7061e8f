// Speculative decoding's host side: the draft proposers and the adaptive rule that decides how many draft
// tokens a sequence carries into a step. The engine verifies the drafts in one forward (engine/batch.h:
// a decode row followed by its draft rows, every row sampled; Engine::apply_step keeps the accepted prefix).
//
// Proposers:
//   NgramIndex   prompt lookup over one sequence's own tokens (prompt + output): the longest suffix of
//                max_ngram .. min_ngram tokens that occurred before, and what followed its latest occurrence.
//                A hash index from n-gram to its latest end, grown as tokens are appended: O(1) per token and
//                per lookup, never a scan of the history.
//   AnswerStore  the same index over a bounded store of recently finished answers (suffix decoding's source:
//                agents and rewrites repeat what earlier answers said), shared by every sequence of an engine.
//   Prediction   the request's predicted output (OpenAI's "Predicted Outputs": the text a rewrite is expected to
//                mostly repeat): its continuation after the output so far while the output is its prefix, then
//                after where the output last aligned with it (one token replaced keeps the alignment: an edit),
//                else after the output's last n-gram found in it (an insertion or a deletion realigns).
//
// Adaptive: each proposer of a sequence has a measured per-token acceptance a (the chance that a draft is kept when
// the drafts before it were); the engine times steps by row count once at start (StepCost). A step takes a draft only while
// it raises the step's expected tokens per second: the j-th draft of a sequence adds a^j expected tokens and one
// row, whose cost the timings give. So speculation fades out where extra rows cost as much as steps (compute-bound
// steps: many streams, small CPUs) and where drafts miss; a proposer whose acceptance falls under kOffBelow stops
// proposing and probes again every kProbeInterval steps, so an always-wrong proposer costs only its probes.
#pragma once
#include <stdint.h>

#include <deque>
#include <memory>
#include <unordered_map>
#include <vector>

namespace lmkit {

struct SpeculativeConfig {
  bool enabled = false;
  int32_t max_draft_tokens = 8;   // per sequence and step at most
  int32_t min_ngram = 2;          // the shortest suffix a lookup matches (tokens)
  int32_t max_ngram = 4;          // the longest
  int32_t max_step_draft_tokens = 32;  // draft rows of one step at most (all sequences)
  bool adaptive = true;  // drafts only while they pay (choose_drafts); false: every proposal, up to the limits
  int32_t answer_store_tokens = 0;  // finished answers kept for lookup (tokens, oldest dropped first); 0: none
  // Drafts from the model's multi-token-prediction head (speculative='mtp') instead of the n-gram and answer lookups:
  // after every step the head drafts one token per decoding sequence (Engine::run_mtp).
  bool mtp = false;
  // Drafts from a draft model (speculative='draft', engine/draft_model.h) instead of the n-gram and answer lookups:
  // before a step it decodes greedily as many tokens ahead as the step takes (create_engine's draft).
  bool draft_model = false;
};

// An index of one token stream's n-grams (min_ngram..max_ngram tokens): for each, the position right after its
// latest occurrence that has a continuation (end < the stream's length). Grown incrementally: index(tokens, n)
// adds the n-grams ending at positions [indexed, n - 1]. Collisions are confirmed by comparing tokens.
class NgramIndex {
 public:
  NgramIndex(int32_t min_ngram, int32_t max_ngram);
  // Indexes tokens[0, num_tokens) as far as it was not yet (the stream only grows; a shorter num_tokens than
  // before, after a reset(), starts over).
  void index(const int32_t* tokens, int32_t num_tokens);
  // The continuation of the longest suffix of query[0, num_query) (up to max_ngram tokens, at least min_ngram)
  // found in stream[0, num_stream) at a position other than the query's own end: up to max_tokens tokens,
  // appended to out. A continuation that runs into the stream's end repeats itself (the pattern was periodic).
  // Returns how many tokens were appended.
  int32_t lookup(const int32_t* stream, int32_t num_stream, const int32_t* query, int32_t num_query,
                 int32_t max_tokens, std::vector<int32_t>& out) const;
  // Where the continuation lookup() proposes starts in the stream (the end of the matched n-gram), or -1.
  int32_t find(const int32_t* stream, int32_t num_stream, const int32_t* query, int32_t num_query) const;
  // Appends up to max_tokens of stream from position `at` (past the end: repeating what was appended, until a
  // negative separator); returns how many.
  static int32_t continuation(const int32_t* stream, int32_t num_stream, int32_t at, int32_t max_tokens,
                              std::vector<int32_t>& out);
  void reset();
  int32_t num_indexed() const { return indexed_; }

 private:
  static uint64_t hash(const int32_t* tokens, int32_t n);
  int32_t min_ngram_, max_ngram_;
  int32_t indexed_ = 0;  // n-grams ending at positions < indexed_ (with a continuation) are in the maps
  std::vector<std::unordered_map<uint64_t, int32_t>> ends_;  // [n - min_ngram]: hash -> latest end position
};

// Recently finished answers, concatenated (separated by -1, which no token equals), with one NgramIndex;
// the oldest answers are dropped when the store passes its capacity (the index is rebuilt then, amortised).
class AnswerStore {
 public:
  AnswerStore(int32_t capacity_tokens, int32_t min_ngram, int32_t max_ngram);
  void add(const int32_t* tokens, int32_t num_tokens);
  int32_t lookup(const int32_t* query, int32_t num_query, int32_t max_tokens, std::vector<int32_t>& out) const;
  int32_t num_tokens() const { return (int32_t)stream_.size(); }

 private:
  void rebuild();
  int32_t capacity_;
  std::vector<int32_t> stream_;
  std::deque<int32_t> lengths_;  // each answer's length in stream_ (separator included), oldest first
  NgramIndex index_;
};

// The proposers, in the order they are asked (the first that proposes wins) and as metrics count them. With
// SpeculativeConfig::mtp the MTP head, with SpeculativeConfig::draft_model the draft model, takes the n-gram and
// answer lookups' place.
enum DraftSource : int32_t {
  kDraftPrediction = 0, kDraftNgram = 1, kDraftAnswers = 2, kDraftMtp = 3, kDraftModel = 4, kNumDraftSources = 5
};

// A request's predicted output and where the sequence last aligned with it.
class PredictionLookup {
 public:
  PredictionLookup(std::vector<int32_t> prediction, int32_t min_ngram, int32_t max_ngram);
  // Drafts for a sequence of tokens[0, num_tokens) of which the last num_generated were generated.
  int32_t propose(const int32_t* tokens, int32_t num_tokens, int32_t num_generated, int32_t max_tokens,
                  std::vector<int32_t>& out);

 private:
  std::vector<int32_t> prediction_;  // the prediction, then a -1 marker (no continuation runs past its end)
  NgramIndex index_;
  int32_t min_ngram_;
  int32_t anchor_ = -1;         // the prediction position that sequence position anchor_tokens_ lined up with
  int32_t anchor_tokens_ = 0;
};

// One sequence's speculative state (engine thread only). Each proposer has its own acceptance, so that one that
// misses (a stale prediction) stops proposing while another that hits goes on.
struct SpecState {
  static constexpr int32_t kProbeInterval = 16;  // steps between probes of a proposer that was switched off
  static constexpr float kOffBelow = 0.1f;       // per-token acceptance under which a proposer is switched off
  static constexpr int32_t kProbeTokens = 2;
  SpecState(const SpeculativeConfig& c, const std::vector<int32_t>& prediction)
      : ngram(c.min_ngram, c.max_ngram) {
    if (!prediction.empty()) predicted = std::make_unique<PredictionLookup>(prediction, c.min_ngram, c.max_ngram);
  }
  NgramIndex ngram;
  std::unique_ptr<PredictionLookup> predicted;  // null: the request gave no prediction
  // Per proposer, decayed counts of drafts kept and drafts examined (kept, plus the first rejected one): the
  // per-token acceptance is their ratio.
  // an optimistic 0.75 to start: the first drafts get tried
  float kept[kNumDraftSources] = {3.0f, 3.0f, 3.0f, 3.0f, 3.0f};
  float examined[kNumDraftSources] = {4.0f, 4.0f, 4.0f, 4.0f, 4.0f};
  int32_t idle_steps[kNumDraftSources] = {};  // steps since the proposer was last asked while switched off
  int32_t steps_since_probe = 0;  // proposals since drafts were last verified (see choose_drafts' probes)
  bool catch_up_refused = false;  // the draft model's catch-up was refused (counted once: Engine::run_draft_model)
  float acceptance(int32_t source) const { return kept[source] / examined[source]; }
  // How many draft tokens `source` may propose now: max_tokens, or 0 while it is switched off (counting the steps
  // until its next probe, which may propose kProbeTokens).
  int32_t draft_budget(int32_t source, int32_t max_tokens);
  // Whether the next draft_budget(source, ...) will be > 0 (the MTP head drafts only for sequences that take it).
  bool will_propose(int32_t source) const {
    return acceptance(source) >= kOffBelow || idle_steps[source] + 1 >= kProbeInterval;
  }
  // After a verification of `source`'s drafts: accepted of proposed were kept.
  void record(int32_t source, int32_t proposed, int32_t accepted);
};

// Measured seconds of a step by its row count, as exponential averages; rows never measured are estimated from the
// nearest measured ones (beyond the largest: growing at a quarter of the rate of a compute-bound step).
class StepCost {
 public:
  explicit StepCost(int32_t max_rows) : seconds_((size_t)max_rows + 1, 0.0) {}
  void record(int32_t rows, double seconds);
  double seconds(int32_t rows) const;  // 0 before any step was measured
 private:
  std::vector<double> seconds_;  // [rows]: 0 = never measured
};

// One sequence's proposal for a step: its proposer's per-token acceptance, how many drafts it proposed, and how
// many it verifies whatever the cost (a probe, which keeps the acceptance and the step timings measured).
struct DraftCandidate {
  float acceptance = 0;
  int32_t proposed = 0;
  int32_t at_least = 0;
};

// Which drafts a step verifies; decode_rows: the rows the step has without drafts. Returns how many of each
// candidate's drafts to keep: the probes (while all of them add at most kProbeStepCost to the step's measured
// time: a probe is cheap exploration where rows cost little, and where the step is compute-bound, as for many
// streams on few cores, it waits for a cheaper step), then drafts best first (the j-th draft of a sequence is
// worth a^j expected tokens) while the expected tokens per second of the step grow, within max_rows draft rows
// in all. fixed_seconds: what the step costs besides its forward, whatever its rows (a draft model's passes).
constexpr double kProbeStepCost = 0.05;
std::vector<int32_t> choose_drafts(const std::vector<DraftCandidate>& candidates, int32_t decode_rows,
                                   int32_t max_rows, const StepCost& cost, double fixed_seconds = 0);

// With the adaptive rule off: every proposal, the first candidates first, within max_rows draft rows in all.
std::vector<int32_t> take_in_order(const std::vector<DraftCandidate>& candidates, int32_t max_rows);

// The drafts of a draft model's candidates (proposed: how many it may draft; at_least: a probe's): the probes
// whatever they cost (only a switched-off proposer probes: its only way back), then, weighing the verification rows
// and the draft model's passes (pass j runs over the sequences drafting j or more tokens: draft_cost by those rows),
// the depth d and the number k of sequences, best acceptance first, each drafting up to d tokens, whose step gives
// the most expected tokens per second; none beyond the probes where no such step beats one without drafts.
std::vector<int32_t> choose_model_drafts(const std::vector<DraftCandidate>& candidates, int32_t decode_rows,
                                         int32_t max_rows, const StepCost& cost, const StepCost& draft_cost);

// Seconds a draft model saves per token of a sequence decoding alone, at the best depth up to max_depth: a step of
// one row against a verification of d drafts and d draft passes, over the 1 + a + ... + a^d tokens it gives (a: the
// per-token acceptance). 0 where no depth saves anything; -1 while either cost is unmeasured.
double draft_saving_per_token(float acceptance, int32_t max_depth, const StepCost& cost, const StepCost& draft_cost);

// Whether a sequence should pay a draft model's catch-up over its context (catch_up_seconds) now, so that it
// drafts from its next token on: a rent-or-buy rule. It does once the tokens it has generated without drafts would
// have saved kCatchUpRent of it (saving seconds each): an answer shorter than that never pays for a catch-up, and
// against catching up at once (what vLLM and llama.cpp do) one of any length loses about kCatchUpRent of a catch-up
// (about: the caller prices it, and the pass also covers the tokens generated meanwhile). A short context (a
// catch-up that costs a token's saving or less) drafts at once; never where even its `left` tokens at most could not
// repay the catch-up. A saving of -1 (unmeasured): at once. (kCatchUpRent: benchmark/results/speculative.md, "The
// catch-up waits until it pays".)
constexpr double kCatchUpRent = 0.25;
bool worth_catching_up(double catch_up_seconds, double saving, int32_t generated, int32_t left);

}  // namespace lmkit
