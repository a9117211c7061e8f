#include "engine/batch.h"

#include <algorithm>

#include "core/check.h"

namespace lmkit {

StepOutput StepOutput::for_batch(const Batch& batch, int32_t vocab_size, int32_t hidden_size) {
  StepOutput out;
  out.vocab_size = vocab_size;
  out.hidden_size = hidden_size;
  out.hidden.assign(batch.hidden_outputs.size() * (size_t)hidden_size, 0.0f);
  out.tokens.assign(batch.samples.size(), -1);
  out.logprobs.resize(batch.samples.size());
  out.logits.assign(batch.logit_outputs.size() * (size_t)vocab_size, 0.0f);
  out.prompt_logprobs.resize(batch.prompt_logprob_rows.size());
  return out;
}

bool Batch::needs_logits(int64_t first, int64_t n) const {
  if (hidden_outputs.empty()) return true;
  const int64_t real = std::min<int64_t>(first + n, (int64_t)logit_rows.size()) - first;
  if (real < n) return true;
  int64_t only_pooled = 0;
  for (const HiddenOutputRow& r : hidden_outputs)
    only_pooled += r.hidden_only && r.logit_index >= first && r.logit_index < first + n;
  return only_pooled < n;
}

bool StopRules::is_stop(const Sequence& seq, int32_t token) const {
  const auto& stops = seq.params.stop_token_ids;
  if (std::find(stops.begin(), stops.end(), token) != stops.end()) return true;
  return !seq.params.ignore_eos && std::find(eos_token_ids_.begin(), eos_token_ids_.end(), token) != eos_token_ids_.end();
}

std::vector<int32_t> StopRules::banned(const Sequence& seq, int32_t ahead) const {
  std::vector<int32_t> ids;
  if (seq.num_generated_tokens() + ahead >= seq.params.min_new_tokens) return ids;
  if (!seq.params.ignore_eos) ids = eos_token_ids_;
  ids.insert(ids.end(), seq.params.stop_token_ids.begin(), seq.params.stop_token_ids.end());
  return ids;
}

FinishReason StopRules::on_token(const Sequence& seq, int32_t token) const {
  // A banned stop token can still come back (every other logit -inf): it then counts as a token.
  if (is_stop(seq, token) && seq.num_generated_tokens() >= seq.params.min_new_tokens) return FinishReason::kStop;
  return seq.num_tokens() + 1 >= seq.max_total_tokens ? FinishReason::kLength : FinishReason::kNone;
}

Batch build_batch(const BatchPlan& plan, int32_t block_size_tokens, const StopRules& rules) {
  Batch b;
  b.block_size_tokens = block_size_tokens;
  b.num_tokens = plan.num_tokens;
  b.token_ids.resize(plan.num_tokens);
  b.positions.resize(plan.num_tokens);
  b.slots.resize(plan.num_tokens);
  int32_t row = 0;
  for (int32_t i = 0; i < (int32_t)plan.seqs.size(); ++i) {
    const ScheduledSeq& s = plan.seqs[i];
    Sequence& seq = *s.seq;
    BatchSeq bs;
    bs.first_row = row;
    bs.num_rows = s.num_tokens;
    bs.ctx_len = s.start_pos + s.num_tokens;
    bs.num_blocks = (bs.ctx_len + block_size_tokens - 1) / block_size_tokens;
    bs.table_offset = (int32_t)b.block_tables.size();
    bs.state_slot = seq.state_slot;
    LMKIT_CHECK((int32_t)seq.block_table.size() >= bs.num_blocks, "sequence ", seq.id,
                " has too few blocks for its chunk");
    b.block_tables.insert(b.block_tables.end(), seq.block_table.begin(), seq.block_table.begin() + bs.num_blocks);
    b.max_ctx_len = std::max(b.max_ctx_len, bs.ctx_len);
    b.max_blocks_per_seq = std::max(b.max_blocks_per_seq, bs.num_blocks);
    const int32_t num_drafts = s.num_draft_tokens;
    bs.num_draft_rows = num_drafts;
    bs.prefill = s.start_pos < seq.num_prompt_tokens;
    const int32_t generated_rows = bs.ctx_len - std::max(s.start_pos, seq.num_prompt_tokens);
    bs.num_decode_rows = s.num_tokens > 1 ? std::max(0, generated_rows) : 0;
    LMKIT_CHECK(num_drafts == 0 || (s.is_sampled && s.start_pos + s.num_tokens - num_drafts == seq.num_tokens() &&
                                    num_drafts <= (int32_t)seq.draft_tokens.size() && !seq.params.output_logits),
                "sequence ", seq.id, ": ", num_drafts, " draft rows do not follow its last token");
    if (!seq.draft_state_slots.empty()) {  // a stateful verification: the state as of each row before a draft
      LMKIT_CHECK((int32_t)seq.draft_state_slots.size() == num_drafts, "sequence ", seq.id, " holds ",
                  seq.draft_state_slots.size(), " draft checkpoints for ", num_drafts, " draft rows");
      bs.checkpoint_offset = (int32_t)b.state_checkpoints.size();
      bs.num_checkpoints = num_drafts;
      b.state_checkpoints.insert(b.state_checkpoints.end(), seq.draft_state_slots.begin(), seq.draft_state_slots.end());
    }
    b.seqs.push_back(bs);
    if (num_drafts > 0) {
      seq.verify_tokens.assign(seq.tokens.begin(), seq.tokens.end());
      seq.verify_tokens.insert(seq.verify_tokens.end(), seq.draft_tokens.begin(), seq.draft_tokens.begin() + num_drafts);
    }
    const int32_t* stream = num_drafts > 0 ? seq.verify_tokens.data() : seq.tokens.data();
    const int32_t first_sample_row = s.num_tokens - 1 - num_drafts;  // the last known token's row
    for (int32_t j = 0; j < s.num_tokens; ++j, ++row) {
      const int32_t pos = s.start_pos + j;
      const int32_t block = seq.block_table[pos / block_size_tokens];
      LMKIT_CHECK(block >= 0, "sequence ", seq.id, " has no block for position ", pos);
      b.token_ids[row] = stream[pos];
      b.positions[row] = pos;
      b.slots[row] = block * block_size_tokens + pos % block_size_tokens;
      const bool is_sample_row = s.is_sampled && j >= first_sample_row;
      // logits of a position are handed out once, also when a preempted sequence recomputes it
      const bool is_output_row = seq.params.output_logits && pos >= seq.num_logit_rows_emitted;
      // the row of position pos scores prompt token pos + 1 (also handed out once)
      const bool is_prompt_row = seq.params.prompt_logprobs >= 0 && pos + 1 < seq.num_prompt_tokens &&
                                 pos + 1 >= seq.num_prompt_logprobs_emitted;
      // a pooled position is added once, also when a preempted sequence recomputes it
      const bool is_hidden_row = pos >= seq.num_pooled_positions && seq.params.pools(pos, seq.num_prompt_tokens);
      if (!is_sample_row && !is_output_row && !is_prompt_row && !is_hidden_row) continue;
      const int32_t logit_index = (int32_t)b.logit_rows.size();
      b.logit_rows.push_back(row);
      if (is_hidden_row)
        b.hidden_outputs.push_back({logit_index, i, pos, !is_sample_row && !is_output_row && !is_prompt_row});
      if (is_output_row) b.logit_outputs.push_back(LogitOutputRow{logit_index, i, pos});
      if (is_prompt_row) b.prompt_logprob_rows.push_back(PromptLogprobRow{logit_index, i, pos, seq.tokens[pos + 1], seq.params.prompt_logprobs});
      if (!is_sample_row) continue;
      const int32_t ahead = j - first_sample_row;  // drafts before this row
      SampleRow r;
      r.logit_index = logit_index;
      r.seq = i;
      r.params = &seq.params;
      r.history = stream;
      r.num_history = seq.num_tokens() + ahead;
      r.num_prompt = seq.num_prompt_tokens;
      r.banned = rules.banned(seq, ahead);
      r.mask = seq.matcher.get();
      r.mask_row = ahead;
      if (!seq.params.is_greedy()) r.seed = seq.sample_seed(seq.num_generated_tokens() + ahead);  // greedy: none
      b.samples.push_back(std::move(r));
    }
  }
  b.state_copies = plan.state_copies;
  return b;
}

int32_t append_rows(Batch& b, const int32_t* table, int32_t start, const int32_t* inputs, int32_t rows, bool prefill,
                    int32_t decode_rows) {
  const int32_t bs = b.block_size_tokens;
  BatchSeq seq;
  seq.first_row = b.num_tokens;
  seq.num_rows = rows;
  seq.ctx_len = start + rows;
  seq.table_offset = (int32_t)b.block_tables.size();
  seq.num_blocks = (seq.ctx_len + bs - 1) / bs;
  seq.prefill = prefill;
  seq.num_decode_rows = decode_rows;
  b.block_tables.insert(b.block_tables.end(), table, table + seq.num_blocks);
  for (int32_t j = 0; j < rows; ++j) {
    const int32_t p = start + j;
    b.token_ids.push_back(inputs[j]);
    b.positions.push_back(p);
    b.slots.push_back(table[p / bs] * bs + p % bs);
  }
  b.num_tokens += rows;
  b.max_ctx_len = std::max(b.max_ctx_len, seq.ctx_len);
  b.max_blocks_per_seq = std::max(b.max_blocks_per_seq, seq.num_blocks);
  b.seqs.push_back(seq);
  return (int32_t)b.seqs.size() - 1;
}

void sample_last_row(Batch& b, int32_t index, const SamplingParams* params, const int32_t* history,
                     int32_t num_history, int32_t num_prompt, const TokenMask* mask, int32_t mask_row) {
  const BatchSeq& seq = b.seqs[(size_t)index];
  SampleRow row;
  row.logit_index = (int32_t)b.logit_rows.size();
  row.seq = index;
  row.params = params;
  row.history = history;
  row.num_history = num_history;
  row.num_prompt = num_prompt;
  row.mask = mask;
  row.mask_row = mask_row;
  b.logit_rows.push_back(seq.first_row + seq.num_rows - 1);
  b.samples.push_back(std::move(row));
}

}  // namespace lmkit
