#include "engine/draft_model.h"

#include <algorithm>

#include "core/check.h"

namespace lmkit {

namespace {

constexpr int32_t kCalibrationRows[] = {1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64};
constexpr int32_t kContextCalibrationRows = 256;

}  // namespace

DraftModel::DraftModel(std::unique_ptr<Executor> executor, int32_t num_blocks, int32_t block_size_tokens,
                       int32_t max_rows, int32_t target_vocab, std::vector<int32_t> eos_token_ids,
                       bool prefix_caching)
    : executor_(std::move(executor)),
      blocks_(num_blocks, block_size_tokens),
      max_rows_(max_rows),
      target_vocab_(target_vocab),
      eos_token_ids_(std::move(eos_token_ids)),
      prefix_caching_(prefix_caching),
      pass_cost_(std::min(max_rows, 1024)) {
  LMKIT_CHECK(executor_ != nullptr, "a draft model needs an executor");
  LMKIT_CHECK(executor_->state_bytes_per_slot() == 0, "a draft model with recurrent layers is not supported");
  LMKIT_CHECK(max_rows >= 1 && num_blocks >= 1, "a draft model needs rows and blocks");
  greedy_.temperature = 0.0f;
  masks_fit_ = executor_->vocab_size() <= target_vocab;
  executor_->allocate_kv_pool(num_blocks);
}

bool DraftModel::reserve(State& st, int32_t end, const std::vector<int64_t>& busy) {
  const int32_t need = blocks_.num_blocks_for(end) - (int32_t)st.table.size();
  if (need <= 0) return true;
  if (!blocks_.can_allocate(need)) {  // idle states (sequences not drafting now) give their blocks back first
    for (auto it = states_.begin(); it != states_.end() && !blocks_.can_allocate(need);) {
      if (&it->second != &st && std::find(busy.begin(), busy.end(), it->first) == busy.end()) {
        blocks_.release(it->second.table);
        it = states_.erase(it);
      } else {
        ++it;
      }
    }
    if (!blocks_.can_allocate(need)) return false;
  }
  blocks_.allocate(need, st.table);
  return true;
}

void DraftModel::publish(State& st, const int32_t* tokens) {
  if (!prefix_caching_) return;  // (then no block has a key: released blocks are free)
  const int32_t bs = blocks_.block_size_tokens();
  for (; st.published < st.computed / bs; ++st.published)
    st.key = blocks_.publish(st.table[(size_t)st.published], st.key, tokens + (int64_t)st.published * bs);
}

void DraftModel::propose(const std::vector<const Sequence*>& seqs, const std::vector<int32_t>& max_tokens,
                         std::vector<std::vector<int32_t>>& drafts) {
  const int32_t bs = blocks_.block_size_tokens();
  const size_t n = seqs.size();
  drafts.assign(n, {});
  std::vector<int64_t> busy;
  for (const Sequence* seq : seqs) busy.push_back(seq->id);
  std::vector<State*> states(n, nullptr);
  std::vector<int32_t> want(n, 0);  // drafts each sequence decodes this time (0: catch-up only, or nothing)
  // Pass 1: each sequence's catch-up rows [computed, n), the last one sampled.
  Batch batch;
  batch.block_size_tokens = bs;
  std::vector<int32_t> pass_seq;  // batch sequence -> index into seqs
  std::vector<int32_t> catch_up(n, 0);
  std::vector<uint64_t> starting;  // the first uncached block's key of each new state caught up in this pass
  for (size_t i = 0; i < n; ++i) {
    const Sequence& seq = *seqs[i];
    const int32_t total = seq.num_tokens();
    State& st = states_[seq.id];
    states[i] = &st;
    // the drafts the target kept since the last pass: their K/V are the sequence's own now (the last token's row
    // at least is computed: it gives the first draft)
    st.computed = std::min(st.computed + kept_drafts(st, seq), total - 1);
    st.written.clear();
    if (!can_draft(seq)) continue;
    bool first_block = false;  // a new state that computes a block no cache holds yet, from first_key
    uint64_t first_key = 0;
    if (st.table.empty()) {  // a new state: the draft pool's prefix cache first
      st.computed = bs * blocks_.match_prefix(seq.tokens.data(), (total - 1) / bs, st.table, &st.key);
      st.published = st.computed / bs;
      // a prompt another sequence computes from the same block in this pass (the completions of an n > 1 request):
      // its blocks are in the prefix cache next time, so this one waits for them, as a new state again then
      if (prefix_caching_ && total - 1 >= st.computed + bs) {
        first_key = block_key(st.key, seq.tokens.data() + st.computed, bs);
        if (std::find(starting.begin(), starting.end(), first_key) != starting.end()) {
          blocks_.release(st.table);
          st = State{};
          continue;
        }
        first_block = true;
      }
    }
    const int32_t left = max_rows_ - batch.num_tokens;
    if (left <= 0) continue;
    int32_t rows = std::min(total - st.computed, left);
    want[i] = rows == total - st.computed ? std::max(max_tokens[i], 0) : 0;
    // room for the catch-up and for the drafts' inputs: positions [0, total - 1 + want)
    if (!reserve(st, st.computed + rows, busy)) {
      want[i] = 0;
      continue;
    }
    if (first_block && rows >= bs) starting.push_back(first_key);  // it computes that block now
    if (want[i] > 1 && !reserve(st, total - 1 + want[i], busy))
      want[i] = std::max(1, (int32_t)st.table.size() * bs - total + 1);
    catch_up[i] = rows;
    const int32_t end = st.computed + rows;
    const int32_t index = append_rows(batch, st.table.data(), st.computed, seq.tokens.data() + st.computed, rows,
                                      st.computed < seq.num_prompt_tokens,
                                      rows > 1 ? std::max(0, end - std::max(st.computed, seq.num_prompt_tokens)) : 0);
    if (want[i] > 0)  // under the grammar's mask of the next token, where the request has one
      sample_last_row(batch, index, &greedy_, seq.tokens.data(), total, seq.num_prompt_tokens,
                      masks_fit_ ? seq.matcher.get() : nullptr);
    pass_seq.push_back((int32_t)i);
  }
  if (batch.empty()) return;
  StepOutput out = executor_->step(batch);
  for (size_t b = 0; b < batch.seqs.size(); ++b) {
    const int32_t i = pass_seq[b];
    states[(size_t)i]->computed += catch_up[(size_t)i];
    publish(*states[(size_t)i], seqs[(size_t)i]->tokens.data());
  }
  for (size_t k = 0; k < batch.samples.size(); ++k) {
    const int32_t i = pass_seq[(size_t)batch.samples[k].seq];
    const int32_t t = out.tokens[k];
    if (t >= 0 && t < target_vocab_) drafts[(size_t)i].push_back(t);
  }
  // no draft after an end of sequence: the verification would stop there
  auto ended = [this](const std::vector<int32_t>& d) {
    return !d.empty() && std::find(eos_token_ids_.begin(), eos_token_ids_.end(), d.back()) != eos_token_ids_.end();
  };
  // Passes 2, 3, ...: one row each for the sequences that take another draft, its input the draft before.
  for (int32_t depth = 2;; ++depth) {
    Batch next;
    next.block_size_tokens = bs;
    std::vector<int32_t> rows_of;
    for (size_t i = 0; i < n; ++i) {
      if (want[i] < depth || (int32_t)drafts[i].size() != depth - 1 || ended(drafts[i])) continue;
      const Sequence& seq = *seqs[i];
      State& st = *states[i];
      // a grammar's mask after the drafts so far (none past a draft it refuses)
      GrammarMatcher* matcher = masks_fit_ ? seq.matcher.get() : nullptr;
      if (matcher && matcher->num_valid(drafts[i].data(), depth - 1) < depth - 1) continue;
      if (matcher) matcher->request_draft_masks(drafts[i].data(), depth - 1);
      const int32_t p = seq.num_tokens() + depth - 2;  // the position of draft depth - 1
      const int32_t index = append_rows(next, st.table.data(), p, &drafts[i].back(), 1);
      sample_last_row(next, index, &greedy_, seq.tokens.data(), seq.num_tokens(), seq.num_prompt_tokens, matcher,
                      depth - 1);
      rows_of.push_back((int32_t)i);
    }
    if (next.empty()) break;
    const StepOutput o = executor_->step(next);
    for (size_t k = 0; k < rows_of.size(); ++k) {
      const size_t i = (size_t)rows_of[k];
      states[i]->written.push_back(drafts[i].back());
      const int32_t t = o.tokens[k];
      if (t >= 0 && t < target_vocab_) drafts[i].push_back(t);
    }
  }
  for (size_t i = 0; i < n; ++i)
    if ((int32_t)drafts[i].size() > want[i]) drafts[i].resize((size_t)want[i]);
}

int32_t DraftModel::kept_drafts(const State& st, const Sequence& seq) {
  int32_t kept = 0;
  while (kept < (int32_t)st.written.size() && st.computed + kept < seq.num_tokens() &&
         st.written[(size_t)kept] == seq.tokens[(size_t)(st.computed + kept)])
    ++kept;
  return kept;
}

int32_t DraftModel::rows_behind(const Sequence& seq) const {
  const int32_t total = seq.num_tokens();
  const auto it = states_.find(seq.id);
  int32_t computed = 0;
  if (it != states_.end() && !it->second.table.empty())
    computed = it->second.computed + kept_drafts(it->second, seq);
  else if (prefix_caching_)  // a new state starts from the draft pool's prefix cache
    computed = blocks_.block_size_tokens() *
               blocks_.num_prefix_blocks(seq.tokens.data(), (total - 1) / blocks_.block_size_tokens());
  return std::max(total - computed, 1);
}

bool DraftModel::can_draft(const Sequence& seq) {
  State& st = states_[seq.id];
  const int32_t vocab = executor_->vocab_size();
  for (; !st.stuck && st.scanned < seq.num_tokens(); ++st.scanned)
    if (seq.tokens[(size_t)st.scanned] >= vocab) {  // never again: its blocks go back at once
      blocks_.release(st.table);
      st = State{};
      st.stuck = true;
    }
  return !st.stuck;
}

void DraftModel::release(int64_t seq_id) {
  auto it = states_.find(seq_id);
  if (it == states_.end()) return;
  blocks_.release(it->second.table);
  states_.erase(it);
}

void DraftModel::calibrate() {
  // Single-token rows of as many sequences at position 0, each in a block of its own (free: no request has
  // arrived), every row sampled greedily as a draft pass samples (timed_step).
  const int32_t bs = blocks_.block_size_tokens();
  const int32_t most = std::min(max_rows_, blocks_.num_free_blocks());
  const int32_t zero = 0;
  for (int32_t rows : kCalibrationRows) {
    if (rows > most) break;
    Batch b;
    b.block_size_tokens = bs;
    for (int32_t j = 0; j < rows; ++j)
      sample_last_row(b, append_rows(b, &j, 0, &zero, 1), &greedy_, &zero, 1, 1);
    pass_cost_.record(rows, timed_step(*executor_, b));
  }
  // One sequence's rows [0, R) in the first blocks, its last row sampled: a catch-up's shape.
  const int32_t rows = std::min({kContextCalibrationRows, max_rows_, bs * blocks_.num_free_blocks()});
  if (rows < 2) return;
  std::vector<int32_t> table((size_t)blocks_.num_blocks_for(rows)), inputs((size_t)rows, 0);
  for (size_t j = 0; j < table.size(); ++j) table[j] = (int32_t)j;
  Batch b;
  b.block_size_tokens = bs;
  sample_last_row(b, append_rows(b, table.data(), 0, inputs.data(), rows, true), &greedy_, inputs.data(), rows, rows);
  seconds_per_context_row_ = timed_step(*executor_, b) / rows;
}

std::vector<int64_t> DraftModel::state_ids() const {
  std::vector<int64_t> ids;
  for (const auto& kv : states_) ids.push_back(kv.first);
  return ids;
}

void DraftModel::check_integrity() const {
  blocks_.verify();
  std::vector<int32_t> refs((size_t)blocks_.num_total_blocks(), 0);
  for (const auto& kv : states_) {
    const State& st = kv.second;
    LMKIT_CHECK(st.computed >= 0 && st.computed <= (int32_t)st.table.size() * blocks_.block_size_tokens(),
                "draft state of sequence ", kv.first, " computed ", st.computed, " past its ", st.table.size(),
                " blocks");
    for (int32_t b : st.table) ++refs[(size_t)b];
  }
  for (int32_t b = 0; b < blocks_.num_total_blocks(); ++b)
    LMKIT_CHECK(refs[(size_t)b] == blocks_.ref_count(b), "draft block ", b, " has ", blocks_.ref_count(b),
                " references, the draft states hold ", refs[(size_t)b]);
}

}  // namespace lmkit
