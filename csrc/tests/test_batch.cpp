// The engine <-> executor contract without any kernel: Batch built from a plan (rows, positions, exact slots,
// block tables, logit rows, sample rows with their bans and seeds), and StepOutput applied by the engine (every
// stop rule in StopRules; logits rows handed out once; logprobs) through a real Engine whose executor returns
// scripted outputs.
#include <chrono>
#include <condition_variable>
#include <map>
#include <memory>
#include <mutex>

#include "engine/batch.h"
#include "engine/engine.h"
#include "tests/testing.h"

using namespace lmkit;
using Ids = std::vector<int32_t>;

namespace {

Sequence make_seq(int64_t id, Ids tokens, Ids table) {
  Sequence s;
  s.id = id;
  s.tokens = std::move(tokens);
  s.num_prompt_tokens = (int32_t)s.tokens.size();
  s.max_total_tokens = 100;
  s.block_table = std::move(table);
  s.seed = 7;
  return s;
}

}  // namespace

TEST(batch_rows_slots_and_tables) {
  // a: prefill chunk of positions 2..5 (block size 4: blocks 9, 3); b: decode at position 4 (blocks 5, 6)
  Sequence a = make_seq(1, {10, 11, 12, 13, 14, 15}, {9, 3});
  Sequence b = make_seq(2, {20, 21, 22, 23, 24}, {5, 6});
  b.num_prompt_tokens = 3;
  BatchPlan plan;
  plan.seqs.push_back(ScheduledSeq{&a, 2, 4, true});
  plan.seqs.push_back(ScheduledSeq{&b, 4, 1, true});
  plan.num_tokens = 5;
  StopRules rules({0});
  Batch batch = build_batch(plan, 4, rules);
  EXPECT_EQ(batch.num_tokens, 5);
  EXPECT(batch.token_ids == (Ids{12, 13, 14, 15, 24}));
  EXPECT(batch.positions == (Ids{2, 3, 4, 5, 4}));
  EXPECT(batch.slots == (Ids{9 * 4 + 2, 9 * 4 + 3, 3 * 4 + 0, 3 * 4 + 1, 6 * 4 + 0}));
  EXPECT(batch.block_tables == (Ids{9, 3, 5, 6}));
  EXPECT_EQ(batch.seqs.size(), 2u);
  EXPECT_EQ(batch.seqs[1].first_row, 4);
  EXPECT_EQ(batch.seqs[1].ctx_len, 5);
  EXPECT_EQ(batch.seqs[1].table_offset, 2);
  EXPECT_EQ(batch.max_ctx_len, 6);
  EXPECT(batch.logit_rows == (Ids{3, 4}));  // the last row of each sampled chunk
  EXPECT_EQ(batch.samples.size(), 2u);
  EXPECT_EQ(batch.samples[0].logit_index, 0);
  EXPECT_EQ(batch.samples[1].seq, 1);
  EXPECT_EQ(batch.samples[1].num_history, 5);
  EXPECT_EQ(batch.samples[1].num_prompt, 3);
  EXPECT(batch.logit_outputs.empty());
  EXPECT(!batch.is_decode_only());
}

TEST(batch_logit_outputs_once_and_bans) {
  Sequence a = make_seq(1, {1, 2, 3, 4}, {0});
  a.params.output_logits = true;
  a.num_logit_rows_emitted = 2;  // positions 0, 1 handed out before a preemption
  a.params.min_new_tokens = 1;
  a.params.stop_token_ids = {42};
  BatchPlan plan;
  plan.seqs.push_back(ScheduledSeq{&a, 0, 4, true});
  plan.num_tokens = 4;
  StopRules rules({0, 5});
  Batch batch = build_batch(plan, 4, rules);
  EXPECT(batch.logit_rows == (Ids{2, 3}));
  EXPECT_EQ(batch.logit_outputs.size(), 2u);
  EXPECT_EQ(batch.logit_outputs[0].position, 2);
  EXPECT_EQ(batch.samples.size(), 1u);
  EXPECT_EQ(batch.samples[0].logit_index, 1);
  EXPECT(batch.samples[0].banned == (Ids{0, 5, 42}));  // eos and stop ids before min_new_tokens
  a.params.ignore_eos = true;
  EXPECT(rules.banned(a) == (Ids{42}));
  a.tokens.push_back(7);  // one generated token: min_new_tokens reached
  EXPECT(rules.banned(a).empty());
}

TEST(batch_seeds_are_the_seed_of_the_token_each_row_draws) {
  Sequence a = make_seq(1, {1, 2}, {0});
  a.params.temperature = 0.8f;
  Sequence greedy = make_seq(2, {1, 2}, {1});
  greedy.params.temperature = 0.0f;
  BatchPlan plan;
  plan.seqs.push_back(ScheduledSeq{&a, 0, 2, true});
  plan.seqs.push_back(ScheduledSeq{&greedy, 0, 2, true});
  plan.num_tokens = 4;
  Batch batch = build_batch(plan, 4, StopRules({}));
  EXPECT_EQ(batch.samples[0].seed, a.sample_seed(0));
  EXPECT_EQ(batch.samples[1].seed, 0u);  // greedy draws nothing
  EXPECT(a.sample_seed(0) != a.sample_seed(1));
  Sequence b = make_seq(3, {1, 2}, {0});
  b.seed = 8;
  EXPECT(b.sample_seed(0) != a.sample_seed(0));
}

TEST(batch_draft_rows_are_sampled_with_the_drafts_before_them) {
  // prompt 5 6 7, generated 8 (pending), drafts 9 10: rows at positions 3, 4, 5 feed 8, 9, 10
  Sequence a = make_seq(1, {5, 6, 7}, {0, 1});
  a.tokens.push_back(8);
  a.num_computed_tokens = 3;
  a.params.temperature = 0.5f;
  a.params.min_new_tokens = 2;
  a.draft_tokens = {9, 10, 11};  // the scheduler took two
  BatchPlan plan;
  plan.seqs.push_back(ScheduledSeq{&a, 3, 3, true, 2});
  plan.num_tokens = 3;
  Batch batch = build_batch(plan, 4, StopRules({0}));
  EXPECT_EQ(batch.token_ids, (Ids{8, 9, 10}));
  EXPECT_EQ(batch.positions, (Ids{3, 4, 5}));
  EXPECT_EQ(batch.samples.size(), 3u);
  for (int32_t j = 0; j < 3; ++j) {
    const SampleRow& r = batch.samples[j];
    EXPECT_EQ(r.num_history, 4 + j);  // the drafts before the row count as generated
    EXPECT_EQ(r.history[3 + j], 8 + j);
    EXPECT_EQ(r.seed, a.sample_seed(1 + j));  // the row draws generated token 1 + j
    EXPECT_EQ(r.banned.size(), j == 0 ? 1u : 0u);  // eos banned until 2 tokens are generated
  }
  EXPECT_EQ(batch.seqs[0].num_checkpoints, 0);  // no recurrent state: no checkpoints
  EXPECT(batch.state_checkpoints.empty());
  // with recurrent state: a checkpoint slot per draft row, the state as of rows 0 and 1
  a.state_slot = 4;
  a.draft_state_slots = {7, 2};
  batch = build_batch(plan, 4, StopRules({0}));
  EXPECT_EQ(batch.seqs[0].num_checkpoints, 2);
  EXPECT_EQ(batch.seqs[0].checkpoint_offset, 0);
  EXPECT_EQ(batch.state_checkpoints, (Ids{7, 2}));
  a.draft_state_slots = {7};  // a checkpoint short is a bug
  EXPECT_THROWS(build_batch(plan, 4, StopRules({0})));
  a.draft_state_slots.clear();
  // drafts that do not follow the last token are a bug
  plan.seqs[0] = ScheduledSeq{&a, 2, 3, true, 2};
  EXPECT_THROWS(build_batch(plan, 4, StopRules({0})));
}

TEST(stop_rules) {
  StopRules rules({0});
  Sequence a = make_seq(1, {1, 2, 3}, {0});
  a.params.stop_token_ids = {9};
  a.max_total_tokens = 5;
  EXPECT(rules.on_token(a, 0) == FinishReason::kStop);
  EXPECT(rules.on_token(a, 9) == FinishReason::kStop);
  EXPECT(rules.on_token(a, 4) == FinishReason::kNone);
  a.tokens.push_back(4);  // 4 tokens: the next one reaches max_total_tokens
  EXPECT(rules.on_token(a, 4) == FinishReason::kLength);
  a.params.min_new_tokens = 2;  // 1 generated so far: a stop token counts as a token
  EXPECT(rules.on_token(a, 0) == FinishReason::kLength);
  a.params.ignore_eos = true;
  a.params.min_new_tokens = 0;
  EXPECT(rules.on_token(a, 0) == FinishReason::kLength);
  EXPECT(rules.on_token(a, 9) == FinishReason::kStop);
}

namespace {

// An executor without a model: each sampled row gets the next token of its script, logits rows are their
// position repeated, logprobs are -position. Records the batches it saw.
class ScriptedExecutor final : public Executor {
 public:
  explicit ScriptedExecutor(Ids script) : script_(std::move(script)) {}
  StepOutput step(const Batch& batch) override {
    StepOutput out = StepOutput::for_batch(batch, kVocab);
    for (size_t k = 0; k < batch.samples.size(); ++k) {
      out.tokens[k] = script_[next_++ % script_.size()];
      out.logprobs[k].logprob = -(float)batch.positions[batch.logit_rows[batch.samples[k].logit_index]];
      out.logprobs[k].top_ids = {out.tokens[k]};
      out.logprobs[k].top_logprobs = {out.logprobs[k].logprob};
      banned_seen.push_back(batch.samples[k].banned);
    }
    for (size_t r = 0; r < batch.logit_outputs.size(); ++r)
      for (int32_t v = 0; v < kVocab; ++v) out.logits[r * kVocab + v] = (float)batch.logit_outputs[r].position;
    return out;
  }
  int64_t kv_bytes_per_block() const override { return 1; }
  int64_t linear_weight_bytes() const override { return 1; }
  void allocate_kv_pool(int32_t) override {}
  int32_t vocab_size() const override { return kVocab; }
  static constexpr int32_t kVocab = 16;
  std::vector<Ids> banned_seen;

 private:
  Ids script_;
  size_t next_ = 0;
};

struct Collected {
  std::mutex mu;
  std::condition_variable cv;
  Ids tokens;
  std::vector<float> logits, logprobs;
  int32_t logit_rows = 0;
  bool finished = false;
  FinishReason reason = FinishReason::kNone;
};

void run(Ids script, const SamplingParams& params, Ids prompt, Collected& c, std::vector<Ids>* bans = nullptr) {
  EngineOptions options;
  options.num_blocks = 8;
  options.block_size_tokens = 4;
  options.session_len = 32;
  options.vocab_size = ScriptedExecutor::kVocab;
  options.eos_token_ids = {0};
  auto exec = std::make_unique<ScriptedExecutor>(std::move(script));
  ScriptedExecutor* raw = exec.get();
  Engine engine(options, std::move(exec));
  engine.submit(1, prompt, params, [&c](RequestOutput&& out) {
    std::lock_guard<std::mutex> lock(c.mu);
    c.tokens.insert(c.tokens.end(), out.token_ids.begin(), out.token_ids.end());
    c.logits.insert(c.logits.end(), out.logits.begin(), out.logits.end());
    c.logprobs.insert(c.logprobs.end(), out.logprobs.begin(), out.logprobs.end());
    c.logit_rows += out.num_logit_rows;
    if (out.finished) {
      c.finished = true;
      c.reason = out.finish_reason;
      c.cv.notify_all();
    }
  });
  std::unique_lock<std::mutex> lock(c.mu);
  c.cv.wait_for(lock, std::chrono::seconds(10), [&] { return c.finished; });
  lock.unlock();
  engine.check_integrity();
  EXPECT_EQ(engine.metrics().num_free_blocks, 8);
  engine.shutdown();
  if (bans) *bans = raw->banned_seen;
}

}  // namespace

TEST(engine_applies_eos_not_in_output) {
  Collected c;
  SamplingParams p;
  p.max_new_tokens = 10;
  run({3, 4, 0, 5}, p, {1, 2, 3}, c);
  EXPECT(c.finished);
  EXPECT(c.reason == FinishReason::kStop);
  EXPECT(c.tokens == (Ids{3, 4}));
}

TEST(engine_applies_length_and_logits_and_logprobs) {
  Collected c;
  SamplingParams p;
  p.max_new_tokens = 3;
  p.output_logits = true;
  p.logprobs = 1;
  run({7, 8, 9, 10}, p, {1, 2, 3}, c);
  EXPECT(c.reason == FinishReason::kLength);
  EXPECT(c.tokens == (Ids{7, 8, 9}));
  // logits of positions 0..4: the prompt's 3 and the first 2 generated tokens' (the last token is never fed)
  EXPECT_EQ(c.logit_rows, 5);
  for (int32_t r = 0; r < c.logit_rows; ++r) EXPECT_EQ(c.logits[(size_t)r * ScriptedExecutor::kVocab], (float)r);
  EXPECT(c.logprobs == (std::vector<float>{-2, -3, -4}));
}

TEST(engine_min_new_tokens_bans_then_stops) {
  Collected c;
  SamplingParams p;
  p.max_new_tokens = 10;
  p.min_new_tokens = 2;
  p.stop_token_ids = {6};
  std::vector<Ids> bans;
  // the scripted executor ignores bans: a stop token before min_new_tokens counts as an output token
  run({6, 3, 6, 3}, p, {1, 2}, c, &bans);
  EXPECT(c.tokens == (Ids{6, 3}));
  EXPECT(c.reason == FinishReason::kStop);
  EXPECT_EQ(bans.size(), 3u);
  EXPECT(bans[0] == (Ids{0, 6}));
  EXPECT(bans[1] == (Ids{0, 6}));
  EXPECT(bans[2].empty());
}

TEST(batch_prompt_logprob_rows_once) {
  // prompt of 7 tokens, chunk of positions 2..6 (the last one sampled); positions 0..2 were scored before a
  // preemption (prompt tokens 1..3 handed out): rows of positions 3..5 score tokens 4..6, position 6 only samples
  Sequence a = make_seq(1, {10, 11, 12, 13, 14, 15, 16}, {4, 8});
  a.params.prompt_logprobs = 3;
  a.num_prompt_logprobs_emitted = 4;
  BatchPlan plan;
  plan.seqs.push_back(ScheduledSeq{&a, 2, 5, true});
  plan.num_tokens = 5;
  StopRules rules({0});
  Batch batch = build_batch(plan, 4, rules);
  EXPECT(batch.logit_rows == (Ids{1, 2, 3, 4}));
  EXPECT_EQ(batch.prompt_logprob_rows.size(), 3u);
  for (int32_t k = 0; k < 3; ++k) {
    const PromptLogprobRow& r = batch.prompt_logprob_rows[k];
    EXPECT_EQ(r.logit_index, k);
    EXPECT_EQ(r.position, 3 + k);
    EXPECT_EQ(r.token, 14 + k);
    EXPECT_EQ(r.num_top, 3);
  }
  EXPECT_EQ(batch.samples.size(), 1u);
  EXPECT_EQ(batch.samples[0].logit_index, 3);
  StepOutput out = StepOutput::for_batch(batch, 32);
  EXPECT_EQ(out.prompt_logprobs.size(), 3u);
}

TEST(batch_pooled_rows_once_and_without_logits) {
  // mean pooling of a 6-token prompt, chunk of positions 1..5 unsampled (max_new_tokens 0); position 1 was pooled
  // before a preemption: rows of positions 2..5 are pooled, none needs logits
  Sequence a = make_seq(1, {10, 11, 12, 13, 14, 15}, {4, 8});
  a.params.pooling = Pooling::kMean;
  a.num_pooled_positions = 2;
  // last-token pooling beside it, its last prompt row also sampled (the row needs its logits)
  Sequence b = make_seq(2, {20, 21, 22}, {5});
  b.params.pooling = Pooling::kLast;
  BatchPlan plan;
  plan.seqs.push_back(ScheduledSeq{&a, 1, 5, false});
  plan.seqs.push_back(ScheduledSeq{&b, 0, 3, true});
  plan.num_tokens = 8;
  Batch batch = build_batch(plan, 4, StopRules({0}));
  EXPECT(batch.logit_rows == (Ids{1, 2, 3, 4, 7}));
  EXPECT_EQ(batch.hidden_outputs.size(), 5u);
  for (int32_t k = 0; k < 4; ++k) {
    EXPECT_EQ(batch.hidden_outputs[k].position, 2 + k);
    EXPECT(batch.hidden_outputs[k].hidden_only);
  }
  EXPECT_EQ(batch.hidden_outputs[4].position, 2);
  EXPECT(!batch.hidden_outputs[4].hidden_only);
  EXPECT(!batch.needs_logits(0, 4));  // the mean-pooled rows alone skip the lm_head
  EXPECT(batch.needs_logits(0, 5));
  EXPECT(batch.needs_logits(4, 1));
  EXPECT(batch.needs_logits(3, 4));  // rows past logit_rows (a backend's padding) count as read
  StepOutput out = StepOutput::for_batch(batch, 32, 6);
  EXPECT_EQ(out.hidden.size(), 30u);
  SamplingParams none;
  EXPECT(!none.pools(0, 1) && !none.reads_prompt_rows());
  b.params.pooling = Pooling::kFirst;
  EXPECT(b.params.pools(0, 3) && !b.params.pools(2, 3) && b.params.reads_prompt_rows());
}

int main() { return lmkit::testing::run_all(); }
