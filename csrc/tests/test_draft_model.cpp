// DraftModel's bookkeeping (engine/draft_model.h) over an executor whose next token is a function of the row's input
// token and position: the rows each pass computes (positions, slots of exact block ids, inputs), the catch-up after a
// verification, the draft pool's prefix cache, a pool that runs short, long catch-ups cut at max_rows, drafts past the
// target's vocabulary, and states given back.
#include <algorithm>
#include <chrono>
#include <memory>
#include <thread>
#include <vector>

#include "engine/draft_model.h"
#include "tests/testing.h"

using namespace lmkit;
using Ids = std::vector<int32_t>;

namespace {

constexpr int32_t kVocab = 16;
int32_t next_of(int32_t token, int32_t position) { return (token * 5 + position) % kVocab; }

struct Row {
  int32_t token, position, slot;
};

// The next token of a sampled row: next_of(its input, its position). Records each pass's rows and block tables.
class RuleExecutor final : public Executor {
 public:
  StepOutput step(const Batch& batch) override {
    if (fail) throw std::runtime_error("scripted failure");
    if (seconds_per_row > 0)
      std::this_thread::sleep_for(std::chrono::duration<double>(seconds_per_row * batch.num_tokens));
    StepOutput out = StepOutput::for_batch(batch, kVocab);
    for (size_t k = 0; k < batch.samples.size(); ++k) {
      const int32_t r = batch.logit_rows[(size_t)batch.samples[k].logit_index];
      out.tokens[k] = next_of(batch.token_ids[(size_t)r], batch.positions[(size_t)r]);
    }
    passes.emplace_back();
    for (int32_t r = 0; r < batch.num_tokens; ++r)
      passes.back().push_back({batch.token_ids[(size_t)r], batch.positions[(size_t)r], batch.slots[(size_t)r]});
    tables.push_back(batch.block_tables);
    return out;
  }
  int64_t kv_bytes_per_block() const override { return 1; }
  int64_t linear_weight_bytes() const override { return 1; }
  void allocate_kv_pool(int32_t blocks) override { num_blocks = blocks; }
  int32_t vocab_size() const override { return kVocab; }
  std::vector<std::vector<Row>> passes;
  std::vector<Ids> tables;
  int32_t num_blocks = 0;
  bool fail = false;
  double seconds_per_row = 0;  // each pass sleeps this long per row
};

std::unique_ptr<Sequence> make_seq(int64_t id, Ids tokens, int32_t num_prompt) {
  auto seq = std::make_unique<Sequence>();
  seq->id = id;
  seq->tokens = std::move(tokens);
  seq->num_prompt_tokens = num_prompt;
  return seq;
}

// The greedy continuation under next_of of tokens (the last one at position size - 1), `count` tokens.
Ids chain(const Ids& tokens, int32_t count) {
  Ids out;
  int32_t t = tokens.back(), p = (int32_t)tokens.size() - 1;
  for (int32_t j = 0; j < count; ++j) out.push_back(t = next_of(t, p++));
  return out;
}

struct Fixture {
  RuleExecutor* exec;
  std::unique_ptr<DraftModel> draft;
  Fixture(int32_t blocks, int32_t block_size, int32_t max_rows, int32_t target_vocab = kVocab, Ids eos = {},
          bool prefix_caching = true) {
    auto e = std::make_unique<RuleExecutor>();
    exec = e.get();
    draft = std::make_unique<DraftModel>(std::move(e), blocks, block_size, max_rows, target_vocab, eos,
                                         prefix_caching);
  }
  std::vector<Ids> propose(const std::vector<const Sequence*>& seqs, const Ids& most) {
    std::vector<Ids> drafts;
    draft->propose(seqs, most, drafts);
    draft->check_integrity();
    return drafts;
  }
};

}  // namespace

TEST(first_drafts_catch_up_the_whole_sequence_then_one_row_a_pass) {
  Fixture f(8, 4, 64);
  EXPECT_EQ(f.exec->num_blocks, 8);
  auto seq = make_seq(1, Ids{3, 1, 4, 1, 5, 9}, 5);  // 5 prompt tokens and one generated, pending
  EXPECT_EQ(f.draft->rows_behind(*seq), 6);
  const std::vector<Ids> drafts = f.propose({seq.get()}, Ids{3});
  EXPECT_EQ(drafts[0], chain(seq->tokens, 3));
  EXPECT_EQ(f.exec->passes.size(), (size_t)3);
  // pass 1: positions 0..5 in blocks 0 and 1 (ids 0, 1: the lowest free), the sequence's own tokens
  EXPECT_EQ(f.exec->passes[0].size(), (size_t)6);
  for (int32_t p = 0; p < 6; ++p) {
    EXPECT_EQ(f.exec->passes[0][(size_t)p].token, seq->tokens[(size_t)p]);
    EXPECT_EQ(f.exec->passes[0][(size_t)p].slot, p);
  }
  // passes 2 and 3: draft 1 at position 6, draft 2 at 7 (the third draft's input is never written)
  EXPECT_EQ(f.exec->passes[1].size(), (size_t)1);
  EXPECT_EQ(f.exec->passes[1][0].token, drafts[0][0]);
  EXPECT_EQ(f.exec->passes[1][0].position, 6);
  EXPECT_EQ(f.exec->passes[2][0].position, 7);
  EXPECT_EQ(f.exec->passes[2][0].slot, 7);
  EXPECT_EQ(f.exec->tables[2], (Ids{0, 1}));

  // the target keeps the first draft and samples another token: positions 6 (kept) hold the sequence's own; the
  // catch-up is position 7 alone, whose input is the new token
  seq->tokens.push_back(drafts[0][0]);
  seq->tokens.push_back((drafts[0][1] + 1) % kVocab);
  EXPECT_EQ(f.draft->rows_behind(*seq), 1);
  f.exec->passes.clear();
  const std::vector<Ids> next = f.propose({seq.get()}, Ids{2});
  EXPECT_EQ(f.exec->passes[0].size(), (size_t)1);
  EXPECT_EQ(f.exec->passes[0][0].position, 7);
  EXPECT_EQ(f.exec->passes[0][0].token, seq->tokens[7]);
  EXPECT_EQ(next[0], chain(seq->tokens, 2));

  // every draft kept (2 of 2) and one more: the catch-up is the last draft's input and the new token (2 rows)
  seq->tokens.push_back(next[0][0]);
  seq->tokens.push_back(next[0][1]);
  seq->tokens.push_back(7);
  EXPECT_EQ(f.draft->rows_behind(*seq), 2);
  f.exec->passes.clear();
  f.propose({seq.get()}, Ids{1});
  EXPECT_EQ(f.exec->passes.size(), (size_t)1);
  EXPECT_EQ(f.exec->passes[0].size(), (size_t)2);
  EXPECT_EQ(f.exec->passes[0][0].position, 9);
  EXPECT_EQ(f.exec->passes[0][1].position, 10);
  f.draft->release(1);
  f.draft->release(1);  // (twice: ignored)
  f.draft->check_integrity();
  EXPECT(f.draft->state_ids().empty());
  EXPECT_EQ(f.draft->num_free_blocks(), 8);
}

TEST(calibration_times_single_rows_and_a_context_pass) {
  Fixture f(64, 4, 128);
  f.exec->seconds_per_row = 2e-4;
  f.draft->calibrate();
  // the last pass: one sequence's rows [0, 128) (max_rows) in blocks 0..31, its last row sampled
  const std::vector<Row>& last = f.exec->passes.back();
  EXPECT_EQ(last.size(), (size_t)128);
  EXPECT_EQ(last.back().position, 127);
  EXPECT_EQ(f.exec->tables.back().size(), (size_t)32);
  // (sleeps bound the timings from below)
  EXPECT(f.draft->catch_up_seconds(100) >= 100 * 2e-4);
  EXPECT(f.draft->pass_cost().seconds(8) >= 8 * 2e-4);
  EXPECT(f.draft->state_ids().empty());
  EXPECT_EQ(f.draft->num_free_blocks(), 64);
}

TEST(completions_of_one_prompt_compute_it_once) {
  Fixture f(16, 4, 64);
  const Ids prompt{1, 2, 3, 4, 5, 6, 7, 8, 9, 10};
  auto a = make_seq(1, prompt, 10), b = make_seq(2, prompt, 10), c = make_seq(3, Ids{1, 2, 3, 9}, 4);
  std::vector<Ids> drafts = f.propose({a.get(), b.get(), c.get()}, Ids{2, 2, 2});
  EXPECT_EQ(drafts[0], chain(prompt, 2));
  EXPECT(drafts[1].empty());  // b waits for a's blocks; c's first block differs: it goes on
  EXPECT_EQ(drafts[2], chain(c->tokens, 2));
  EXPECT_EQ(f.exec->passes[0].size(), (size_t)(10 + 4));
  f.exec->passes.clear();
  drafts = f.propose({b.get()}, Ids{2});  // b: positions 8 and 9 only (a published blocks 0 and 1)
  EXPECT_EQ(drafts[0], chain(prompt, 2));
  EXPECT_EQ(f.exec->passes[0].size(), (size_t)2);
  EXPECT_EQ(f.exec->passes[0][0].position, 8);
}

TEST(completions_past_a_cached_block_wait_as_new_states) {
  Fixture f(16, 4, 64);
  const Ids prompt{1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13};
  auto doc = make_seq(1, Ids{1, 2, 3, 4, 5, 6}, 6);  // caches block 0 (tokens 1..4)
  f.propose({doc.get()}, Ids{1});
  f.draft->release(1);
  auto a = make_seq(2, prompt, 13), b = make_seq(3, prompt, 13);
  f.exec->passes.clear();
  std::vector<Ids> drafts = f.propose({a.get(), b.get()}, Ids{1, 1});
  EXPECT_EQ(f.exec->passes[0].size(), (size_t)(13 - 4));  // a alone, from block 1 on
  EXPECT(drafts[1].empty());
  f.exec->passes.clear();
  drafts = f.propose({b.get()}, Ids{1});  // b: blocks 0-2 from the cache, positions 12 on
  EXPECT_EQ(f.exec->passes[0].size(), (size_t)1);
  EXPECT_EQ(f.exec->passes[0][0].position, 12);
  EXPECT_EQ(drafts[0], chain(prompt, 1));
  f.draft->check_integrity();
}

TEST(without_prefix_caching_nothing_is_kept_and_completions_do_not_wait) {
  Fixture f(16, 4, 64, kVocab, {}, false);
  const Ids prompt{1, 2, 3, 4, 5, 6, 7, 8, 9, 10};
  auto a = make_seq(1, prompt, 10), b = make_seq(2, prompt, 10);
  const std::vector<Ids> drafts = f.propose({a.get(), b.get()}, Ids{2, 2});
  EXPECT_EQ(drafts[0], chain(prompt, 2));
  EXPECT_EQ(drafts[1], chain(prompt, 2));  // each computes the prompt
  EXPECT_EQ(f.exec->passes[0].size(), (size_t)20);
  f.draft->release(1);
  f.draft->release(2);
  f.draft->check_integrity();
  EXPECT_EQ(f.draft->num_free_blocks(), 16);
  auto c = make_seq(3, prompt, 10);
  f.exec->passes.clear();
  f.propose({c.get()}, Ids{1});
  EXPECT_EQ(f.exec->passes[0].size(), (size_t)10);  // no hit
}

TEST(several_sequences_share_each_pass_and_stop_at_their_own_depth) {
  Fixture f(16, 4, 64);
  auto a = make_seq(1, Ids{1, 2, 3}, 2), b = make_seq(2, Ids{4, 5, 6, 7, 8}, 5), c = make_seq(3, Ids{9}, 1);
  const std::vector<Ids> drafts = f.propose({a.get(), b.get(), c.get()}, Ids{1, 3, 0});
  EXPECT_EQ(drafts[0], chain(a->tokens, 1));
  EXPECT_EQ(drafts[1], chain(b->tokens, 3));
  EXPECT(drafts[2].empty());  // 0 wanted: its catch-up only
  EXPECT_EQ(f.exec->passes.size(), (size_t)3);
  EXPECT_EQ(f.exec->passes[0].size(), (size_t)(3 + 5 + 1));
  EXPECT_EQ(f.exec->passes[1].size(), (size_t)1);  // b alone goes on
  // distinct blocks: a in 0, b in 1 and 2, c in 3
  EXPECT_EQ(f.exec->passes[0][3].slot, 4);
  EXPECT_EQ(f.exec->passes[0][8].slot, 12);
}

TEST(the_draft_pools_prefix_cache_serves_a_second_sequence) {
  Fixture f(16, 4, 64);
  const Ids prompt{1, 2, 3, 4, 5, 6, 7, 8, 9, 10};
  auto a = make_seq(1, prompt, 9);
  f.propose({a.get()}, Ids{2});
  auto b = make_seq(2, Ids{1, 2, 3, 4, 5, 6, 7, 8, 11, 12}, 9);  // the same first two blocks
  const int32_t free_before = f.draft->num_free_blocks();
  EXPECT_EQ(f.draft->rows_behind(*b), 2);  // looked up, not taken: the pool is as it was
  EXPECT_EQ(f.draft->num_free_blocks(), free_before);
  EXPECT(f.draft->state_ids().size() == 1u);
  f.exec->passes.clear();
  const std::vector<Ids> drafts = f.propose({b.get()}, Ids{1});
  EXPECT_EQ(f.exec->passes[0].size(), (size_t)2);  // positions 8 and 9 only
  EXPECT_EQ(f.exec->passes[0][0].position, 8);
  EXPECT_EQ(f.exec->tables[0][0], 0);  // a's blocks
  EXPECT_EQ(f.exec->tables[0][1], 1);
  EXPECT_EQ(drafts[0], chain(b->tokens, 1));
  f.draft->release(1);
  f.draft->release(2);
  f.draft->check_integrity();
}

TEST(a_short_pool_gives_idle_states_back_and_then_fewer_drafts) {
  Fixture f(3, 4, 64);
  auto a = make_seq(1, Ids{1, 2, 3, 4, 5}, 5), b = make_seq(2, Ids{6, 7, 8, 9, 10}, 5);
  f.propose({a.get()}, Ids{1});  // a: 2 blocks
  EXPECT_EQ(f.draft->num_free_blocks(), 1);
  // b needs 2 blocks for its catch-up: a (not drafting now) gives its state back
  std::vector<Ids> drafts = f.propose({b.get()}, Ids{1});
  EXPECT_EQ(drafts[0], chain(b->tokens, 1));
  EXPECT_EQ(f.draft->state_ids(), (std::vector<int64_t>{2}));
  // both drafting, b first: b takes the free block for its 6 drafts (inputs at positions 5..9 of 12); a finds none
  // for its catch-up (2 blocks) and no idle state to take them from: no drafts for a, nothing breaks
  drafts = f.propose({b.get(), a.get()}, Ids{6, 1});
  EXPECT_EQ(drafts[0], chain(b->tokens, 6));
  EXPECT(drafts[1].empty());
  // b wants more than the pool holds: as many as its 3 blocks fit (inputs at positions 5..11: 8 drafts)
  drafts = f.propose({b.get()}, Ids{9});
  EXPECT_EQ(drafts[0], chain(b->tokens, 8));
  f.draft->release(1);
  f.draft->release(2);
  EXPECT_EQ(f.draft->num_free_blocks(), 3);
}

TEST(a_long_catch_up_goes_over_several_proposals_without_drafts) {
  Fixture f(16, 4, 8);  // 8 rows a pass
  Ids tokens;
  for (int32_t i = 0; i < 20; ++i) tokens.push_back(i % kVocab);
  auto a = make_seq(1, tokens, 20);
  EXPECT(f.propose({a.get()}, Ids{3})[0].empty());  // rows 0..7
  EXPECT(f.propose({a.get()}, Ids{3})[0].empty());  // rows 8..15
  const std::vector<Ids> drafts = f.propose({a.get()}, Ids{3});  // rows 16..19, then drafts
  EXPECT_EQ(drafts[0], chain(tokens, 3));
  EXPECT_EQ(f.exec->passes[2].size(), (size_t)4);
  EXPECT_EQ(f.exec->passes[2][0].position, 16);
}

TEST(drafts_end_at_an_id_past_the_targets_vocabulary_and_failures_keep_states_consistent) {
  // target vocabulary 8: a draft of 8 or more ends the drafts there
  Fixture f(8, 4, 64, 8);
  auto a = make_seq(1, Ids{1, 2, 3}, 3);
  const Ids full = chain(a->tokens, 6);
  const std::vector<Ids> drafts = f.propose({a.get()}, Ids{6});
  auto below_8 = [](Ids chained) {  // the drafts up to the first id past the target's vocabulary
    chained.erase(std::find_if(chained.begin(), chained.end(), [](int32_t t) { return t >= 8; }), chained.end());
    return chained;
  };
  EXPECT(below_8(full).size() < full.size());  // (the rule gives one here)
  EXPECT_EQ(drafts[0], below_8(full));
  f.exec->fail = true;
  bool threw = false;
  std::vector<Ids> none;
  try {
    f.draft->propose({a.get()}, Ids{2}, none);
  } catch (const std::exception&) {
    threw = true;
  }
  EXPECT(threw);
  f.draft->check_integrity();
  f.exec->fail = false;
  EXPECT_EQ(f.propose({a.get()}, Ids{2})[0], below_8(chain(a->tokens, 2)));
}

TEST(drafts_stop_after_an_eos_and_an_id_past_the_drafts_vocabulary_stops_only_its_sequence) {
  const Ids tokens{1, 2, 3};
  const Ids full = chain(tokens, 6);
  Fixture f(8, 4, 64, 64, Ids{full[2]});  // target vocabulary 64; the third draft is an eos
  auto a = make_seq(1, tokens, 3);
  auto b = make_seq(2, Ids{4, 20, 5}, 3);  // 20: no embedding row in the draft model's 16
  const std::vector<Ids> drafts = f.propose({a.get(), b.get()}, Ids{6, 6});
  EXPECT_EQ(drafts[0], Ids(full.begin(), full.begin() + 3));  // up to the eos, included
  EXPECT(drafts[1].empty());
  EXPECT_EQ(f.exec->passes[0].size(), (size_t)3);  // a's rows only
  EXPECT_EQ(f.exec->passes.size(), (size_t)3);
  EXPECT(!f.draft->can_draft(*b) && f.draft->can_draft(*a));
  f.draft->release(1);
  f.draft->check_integrity();
  EXPECT_EQ(f.draft->num_free_blocks(), 8);  // b's state holds no block
  f.draft->release(2);
}

int main() { return lmkit::testing::run_all(); }
