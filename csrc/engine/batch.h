// The engine <-> executor contract of one step, as plain data.
//   Batch: built once from the scheduler's plan (token ids, positions, KV slots, block tables, the rows whose
//          logits are needed, per-row sampling parameters and banned tokens). Read-only for the executor.
//   StepOutput: what the executor returns (sampled tokens, their logprobs, logits rows). The engine applies
//          it to its sequences (Engine::apply_step); no executor writes into a Sequence.
// Host-only; built and applied without any kernel (csrc/tests/test_batch.cpp).
#pragma once
#include <stdint.h>

#include <vector>

#include "engine/request.h"
#include "engine/scheduler.h"

namespace lmkit {

// One sequence's rows of the fused batch.
//   rows [first_row, first_row + num_rows) hold positions [ctx_len - num_rows, ctx_len);
//   block_tables[table_offset, table_offset + num_blocks) map position p to block p / block_size_tokens
//   (num_blocks = ceil(ctx_len / block_size_tokens); an entry may be kNoBlock when the scheduler freed a block no
//   layer's window reaches any more);
//   state_slot: the recurrent-state slot holding the sequence's state as of position ctx_len - num_rows (-1: the
//   model has no recurrent layers); a chunk at position 0 starts from the zero state, whatever the slot holds;
//   num_draft_rows: its last rows are draft tokens to verify (each scored as its decode step would be);
//   num_checkpoints: the state as of each of its first num_checkpoints rows is also left in slot
//   state_checkpoints[checkpoint_offset + t] (a stateful verification: one per draft row, for the rollback);
//   prefill, num_decode_rows: how attention sees the rows (ops::AttnSeq) so that a row gives the same bits however
//   the sequence's tokens were cut into steps: rows of prompt tokens on the prefill kernel whatever their number
//   (prefill), and, in a chunk of more than one row, the rows of generated tokens (computed again after a
//   preemption) and draft rows each as the decode step it was or would be (the last num_decode_rows rows).
struct BatchSeq {
  int32_t first_row = 0;
  int32_t num_rows = 0;
  int32_t ctx_len = 0;
  int32_t table_offset = 0;
  int32_t num_blocks = 0;
  int32_t state_slot = -1;
  int32_t num_draft_rows = 0;
  int32_t checkpoint_offset = 0;
  int32_t num_checkpoints = 0;
  bool prefill = false;
  int32_t num_decode_rows = 0;
};

// A row whose logits are sampled. The sampler reads params and history as they are during the step.
struct SampleRow {
  int32_t logit_index = 0;                // into Batch::logit_rows
  int32_t seq = 0;                        // the plan's index of the row's sequence
  const SamplingParams* params = nullptr;
  const int32_t* history = nullptr;       // prompt + generated tokens (penalties)
  int32_t num_history = 0;
  int32_t num_prompt = 0;
  std::vector<int32_t> banned;            // ids that must not be sampled now (StopRules::banned)
  uint64_t seed = 0;                      // the generator of this draw (drawn from the sequence's own)
  const TokenMask* mask = nullptr;        // the grammar's allowed tokens (wait() before sampling); null: all
  int32_t mask_row = 0;                   // which of its masks: the drafts before this row (TokenMask::wait)
};

// A logits row the caller asked for (output_logits): copied into StepOutput::logits.
struct LogitOutputRow {
  int32_t logit_index = 0;
  int32_t seq = 0;
  int32_t position = 0;
};

// A prompt row whose next token's logprob is asked for (prompt_logprobs): the log-softmax of its raw logits at
// `token` (= the prompt token at position + 1) and its num_top best go to StepOutput::prompt_logprobs.
struct PromptLogprobRow {
  int32_t logit_index = 0;
  int32_t seq = 0;
  int32_t position = 0;
  int32_t token = 0;
  int32_t num_top = 0;
};

// A prompt row whose final hidden state (after the final norm) is pooled (SamplingParams::pooling): copied into
// StepOutput::hidden. hidden_only: nothing reads the row's logits.
struct HiddenOutputRow {
  int32_t logit_index = 0;
  int32_t seq = 0;
  int32_t position = 0;
  bool hidden_only = false;
};

struct Batch {
  int32_t num_tokens = 0;
  int32_t block_size_tokens = 0;
  std::vector<int32_t> token_ids, positions, slots;  // [num_tokens]; slot = block id * block_size_tokens + offset
  std::vector<BatchSeq> seqs;
  std::vector<int32_t> block_tables;                 // every sequence's table, concatenated
  int32_t max_ctx_len = 0;
  int32_t max_blocks_per_seq = 0;                    // the longest table
  std::vector<int32_t> logit_rows;                   // rows whose logits are computed, ascending
  std::vector<SampleRow> samples;                    // ordered by logit_index
  std::vector<LogitOutputRow> logit_outputs;         // ordered by logit_index
  std::vector<PromptLogprobRow> prompt_logprob_rows;  // ordered by logit_index
  std::vector<HiddenOutputRow> hidden_outputs;       // ordered by logit_index
  std::vector<StateCopy> state_copies;               // recurrent-state slot copies, applied before the forward
  std::vector<int32_t> state_checkpoints;            // the sequences' checkpoint slots (BatchSeq::num_checkpoints)
  bool stateless = false;  // no recurrent layer runs (the MTP head's pass): state slots are neither read nor zeroed

  bool empty() const { return num_tokens == 0; }
  // Every row is one sequence's single (decode) token and every row's logits are needed.
  bool is_decode_only() const { return (int32_t)seqs.size() == num_tokens && (int32_t)logit_rows.size() == num_tokens; }
  // Whether any of logit rows [first, first + n) has its logits read (a row only pooled has not); rows past
  // logit_rows (a backend's padding) count as read.
  bool needs_logits(int64_t first, int64_t n) const;
};

// The logprobs of one sampled token (when its params ask for them).
struct TokenLogprobs {
  float logprob = 0;
  std::vector<int32_t> top_ids;
  std::vector<float> top_logprobs;
};

struct StepOutput {
  std::vector<int32_t> tokens;             // [samples]: the sampled token of Batch::samples[i]
  std::vector<TokenLogprobs> logprobs;     // [samples]: filled where params->logprobs >= 0
  std::vector<float> logits;               // [logit_outputs, vocab]
  std::vector<TokenLogprobs> prompt_logprobs;  // [prompt_logprob_rows]
  std::vector<float> hidden;               // [hidden_outputs, hidden_size]: final hidden states, after the norm
  int32_t hidden_size = 0;
  int32_t vocab_size = 0;
  int64_t weight_bytes_read = 0;           // weights the forward streamed (a mixture of experts: those it ran)

  // Sized for batch: tokens -1, logits and hidden states zero.
  static StepOutput for_batch(const Batch& batch, int32_t vocab_size, int32_t hidden_size = 0);
};

// Every token-level stop rule of the engine, in one place: eos and stop ids (not part of the output), their
// ban before min_new_tokens, the length limits.
class StopRules {
 public:
  explicit StopRules(std::vector<int32_t> eos_token_ids) : eos_token_ids_(std::move(eos_token_ids)) {}
  // Ids seq must not sample next (eos unless ignore_eos, and stop ids) while it has fewer than
  // min_new_tokens generated tokens; ahead: tokens it will have generated before this one (draft rows).
  std::vector<int32_t> banned(const Sequence& seq, int32_t ahead = 0) const;
  // What sampling `token` does to seq: kStop (eos or a stop id, not appended), kLength (appended, then the
  // sequence is at its token limit) or kNone (appended).
  FinishReason on_token(const Sequence& seq, int32_t token) const;
  const std::vector<int32_t>& eos_token_ids() const { return eos_token_ids_; }

 private:
  bool is_stop(const Sequence& seq, int32_t token) const;
  std::vector<int32_t> eos_token_ids_;
};

// Appends one sequence's rows to b: positions [start, start + rows) with inputs[0, rows), its K/V in the blocks of
// table (position p in table[p / block size]); prefill and decode_rows as BatchSeq's. Returns its index in b.seqs.
// (The passes beside a step: the MTP head's, the draft model's.)
int32_t append_rows(Batch& b, const int32_t* table, int32_t start, const int32_t* inputs, int32_t rows,
                    bool prefill = false, int32_t decode_rows = 0);

// Samples b's sequence `index` at its last row with `params` (history: the tokens its penalties read), under mask row
// mask_row of `mask` when given.
void sample_last_row(Batch& b, int32_t index, const SamplingParams* params, const int32_t* history,
                     int32_t num_history, int32_t num_prompt, const TokenMask* mask = nullptr, int32_t mask_row = 0);

// The step's Batch from the scheduler's plan; fills verify_tokens of sequences with draft rows (the only change to
// a sequence here). A chunk with k draft rows ends with k + 1 sample rows: the row of the last known token and one
// per draft, each with the drafts before it in its history; the engine keeps a draft when the row before it
// sampled exactly it. A sampled row's seed is the sequence's seed of the generated token it draws
// (Sequence::sample_seed), so a token is drawn the same whether a verification or a plain step draws it.
// Throws if a table is too short for its chunk.
Batch build_batch(const BatchPlan& plan, int32_t block_size_tokens, const StopRules& rules);

}  // namespace lmkit
