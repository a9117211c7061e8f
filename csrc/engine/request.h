// A request as the engine sees it: the sampling parameters it came with, and the sequence state
// the scheduler and the loop advance step by step.
#pragma once
#include <stdint.h>

#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "core/sampler_params.h"
#include "engine/grammar.h"
#include "engine/speculative.h"

namespace lmkit {

// How a request's prompt becomes one vector (an embedding): the final hidden state (after the model's final norm)
// of its last token, the mean over its tokens, or its first token's.
enum class Pooling : int32_t { kNone = 0, kLast = 1, kMean = 2, kFirst = 3 };

// Per-request sampling and stopping parameters (the sampler's, core/sampler_params.h, and the rest),
// read-only once submitted.
struct SamplingParams : SamplerParams {
  uint64_t seed = 0;
  bool has_seed = false;            // false -> seeded from the engine's random source
  int32_t max_new_tokens = 512;    // 0: only the prompt is computed (to score it: prompt_logprobs)
  int32_t min_new_tokens = 0;
  std::vector<int32_t> stop_token_ids;  // besides the model's eos ids
  bool ignore_eos = false;
  bool output_logits = false;  // return the logits row of every position computed (prompt and output)
  // -1: off; k >= 0: the logprob of every prompt token after the first under the model's raw logits (before
  // penalties and masks) and the k most likely alternatives there. Computed during prefill; such a request
  // takes no prefix-cache hits (the rows of a cached prefix are recomputed).
  int32_t prompt_logprobs = -1;
  int32_t n = 1;               // completions of the prompt, sharing its KV blocks
  // Structured output: every sampled token keeps the text inside this grammar, and the sequence ends
  // ("stop") when the grammar is complete. Null: free text.
  std::shared_ptr<const CompiledGrammar> grammar;
  int32_t grammar_after_token = -1;  // >= 0: the grammar starts after this token is sampled (reasoning's end)
  bool speculate = true;  // false: this request never carries draft tokens (an engine with speculation off: none do)
  std::vector<int32_t> prediction;  // the expected output (a rewrite's source): a draft source when speculating
  // != kNone: the prompt's final hidden states pooled into one vector, handed out with the request's last output
  // (RequestOutput::embedding); with max_new_tokens 0 nothing is generated. n must be 1.
  Pooling pooling = Pooling::kNone;

  // Checks the invariants the engine relies on (throws Error). The user's values are validated once, at the
  // boundary (lmkit.GenerationConfig, lmkit/messages.py): a failure here is a caller's bug, not bad input.
  void check_invariants() const;
  // The prompt's own rows are read (logits or logprobs), so every prompt position must be computed.
  bool reads_prompt_rows() const {
    return output_logits || prompt_logprobs >= 0 || pooling == Pooling::kMean || pooling == Pooling::kFirst;
  }
  // Whether prompt position pos (of num_prompt) goes into the pooled vector.
  bool pools(int32_t pos, int32_t num_prompt) const {
    return pooling == Pooling::kMean ? pos < num_prompt
         : pooling == Pooling::kLast ? pos == num_prompt - 1
         : pooling == Pooling::kFirst && pos == 0;
  }
};

enum class FinishReason : int32_t { kNone = 0, kStop = 1, kLength = 2, kError = 3, kCancelled = 4 };
const char* finish_reason_name(FinishReason r);

// Why a request ended with kError. kDoesNotFit is the caller's to fix (the request can never fit the KV pool:
// a 400); kGrammar (the grammar refused a sampled token) and kInternal (a step failed) are the engine's (a 500).
enum class ErrorKind : int32_t { kNone = 0, kDoesNotFit = 1, kGrammar = 2, kInternal = 3 };
const char* error_kind_name(ErrorKind k);  // "", "does_not_fit", "grammar", "internal"

struct Failure {
  ErrorKind kind = ErrorKind::kNone;
  std::string message;
};

// What the callback thread hands to a request's consumer after a step.
struct RequestOutput {
  int64_t request_id = 0;
  int32_t sample_index = 0;        // which of the request's n completions
  std::vector<int32_t> token_ids;  // tokens generated since the previous output
  bool finished = false;
  FinishReason finish_reason = FinishReason::kNone;
  std::string error;             // set when finish_reason == kError
  ErrorKind error_kind = ErrorKind::kNone;
  std::vector<float> logits;     // [rows, vocab] when output_logits, rows of this output's positions
  int32_t num_logit_rows = 0;
  int32_t num_prompt_tokens = 0;
  // With logprobs: per token of token_ids its logprob, then num_top alternatives (ids and logprobs).
  std::vector<float> logprobs;
  std::vector<int32_t> top_ids;       // [tokens, num_top]
  std::vector<float> top_logprobs;    // [tokens, num_top]
  int32_t num_top = 0;
  // With prompt_logprobs: for the prompt tokens [first_prompt_logprob_token, + prompt_logprobs.size()) (the
  // first output starts at token 1: token 0 has none) their logprob, then num_prompt_top alternatives each.
  std::vector<float> prompt_logprobs;
  std::vector<int32_t> prompt_top_ids;     // [prompt tokens, num_prompt_top]
  std::vector<float> prompt_top_logprobs;  // [prompt tokens, num_prompt_top]
  int32_t first_prompt_logprob_token = 0;
  int32_t num_prompt_top = 0;
  double emitted_at = 0;  // steady_seconds() (core/clock.h) when the step that produced this output ended
  double scheduled_at = 0;  // steady_seconds() (core/clock.h) when the request's first step was planned (0: not yet)
  std::vector<float> embedding;  // [hidden]: the pooled prompt (SamplingParams::pooling), on the finished output
};

using OutputCallback = std::function<void(RequestOutput&&)>;

enum class SeqState : int32_t { kWaiting = 0, kRunning = 1, kFinished = 2 };

// Sequence state, owned by the engine thread only.
//   tokens = prompt + generated; the KV cache holds tokens[0, num_computed_tokens);
//   the next forward feeds tokens[num_computed_tokens, ...). Decode == exactly one pending token.
struct Sequence {
  int64_t id = 0;          // unique per sequence inside the engine
  int64_t request_id = 0;  // the caller's id, shared by the n completions of one request
  int32_t sample_index = 0;
  int32_t num_forks = 0;   // completions still to fork off this one once its prompt is computed
  std::vector<int32_t> tokens;
  int32_t num_prompt_tokens = 0;
  int32_t num_computed_tokens = 0;
  int32_t max_total_tokens = 0;  // prompt + max_new_tokens, clipped to session_len
  std::vector<int32_t> block_table;
  int32_t num_keyed_blocks = 0;  // leading blocks published to the prefix cache
  uint64_t last_block_key = 0;   // prefix key of block num_keyed_blocks - 1 (0 before the first)
  // Recurrent state (a model with recurrent layers, state_pool.h): the slot holding this sequence's state as of
  // num_computed_tokens (-1: none held), and the slots reserved for the completions it will fork, which get a
  // copy of its state at the fork position (fork_states_copied once the copy is planned).
  int32_t state_slot = -1;
  std::vector<int32_t> fork_state_slots;
  bool fork_states_copied = false;
  // During a step that verifies j drafts: j slots where the step leaves the state as of each of its first j rows
  // (the checkpoints a rejection rolls back to; Scheduler::settle_draft_states).
  std::vector<int32_t> draft_state_slots;
  SamplingParams params;
  SeqState state = SeqState::kWaiting;
  int64_t arrival = 0;  // admission order (FCFS); preemption picks the largest
  double scheduled_at = 0;  // steady_seconds() (core/clock.h) when its first chunk was planned (its queueing's end)
  // The seed of this completion's draws (the request's seed, or the engine's random source; a forked completion's is
  // derived from its parent's and its index): generated token i is drawn with sample_seed(i), whichever step draws it
  // (a plain one, a verification of drafts, a recomputation after preemption).
  uint64_t seed = 0;
  uint64_t sample_seed(int32_t index) const {
    uint64_t z = seed + 0x9E3779B97F4A7C15ull * (uint64_t)(index + 1);  // SplitMix64 of (seed, index)
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
  }
  std::shared_ptr<OutputCallback> callback;  // released on the callback thread only
  // Pending output accumulated in a step, flushed to the callback thread at its end.
  std::vector<int32_t> pending_token_ids;
  std::vector<float> pending_logits;
  int32_t pending_logit_rows = 0;
  std::vector<float> pending_logprobs;
  std::vector<int32_t> pending_top_ids;
  std::vector<float> pending_top_logprobs;
  int32_t num_logit_rows_emitted = 0;  // logits of positions [0, n) already handed out (kept across preemption)
  std::vector<float> pending_prompt_logprobs;
  std::vector<int32_t> pending_prompt_top_ids;
  std::vector<float> pending_prompt_top_logprobs;
  // Pooling: the sum of the final hidden states of prompt positions [0, num_pooled_positions) that pool (kept across
  // preemption: a recomputed position is not added again).
  std::vector<double> pooled_sum;
  int32_t num_pooled_positions = 0;
  int32_t num_prompt_logprobs_emitted = 1;  // prompt tokens [1, n) have had their logprobs handed out (kept
                                            // across preemption; token 0 has none)
  // The grammar's state (params.grammar): created when the grammar starts (at once, or after
  // params.grammar_after_token was sampled), its mask of the next token requested after every token
  // (computed while the next forward runs).
  std::unique_ptr<GrammarMatcher> matcher;
  bool grammar_after_token_seen = false;
  // Speculative decoding (engine/speculative.h): the proposers' state, and the draft tokens proposed for the next
  // step (positions num_tokens() ...; the scheduler may take fewer: ScheduledSeq::num_draft_tokens), by which
  // proposer; verify_tokens = tokens + drafts while a step verifies them (the sampler's history of each row).
  std::unique_ptr<SpecState> spec;
  std::vector<int32_t> draft_tokens;
  int32_t draft_source = 0;
  std::vector<int32_t> verify_tokens;
  // The MTP head's draft of the token at position mtp_draft_at (= num_tokens() when it was drafted; stale otherwise).
  int32_t mtp_draft = -1;
  int32_t mtp_draft_at = -1;

  int32_t num_tokens() const { return (int32_t)tokens.size(); }
  int32_t num_pending_tokens() const { return num_tokens() - num_computed_tokens; }
  int32_t num_generated_tokens() const { return num_tokens() - num_prompt_tokens; }
  bool is_prefilling() const { return num_pending_tokens() > 1; }
};

}  // namespace lmkit
