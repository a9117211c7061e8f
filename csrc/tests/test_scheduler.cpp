// Scheduler bookkeeping: FCFS admission by free blocks, decode before prefill, chunked prefill under
// the token budget, preemption of the newest request, exact block ids, and conservation checked after
// every step of a seeded random run with arrivals, growth, finishes and cancellations.
#include <memory>
#include <random>

#include "engine/scheduler.h"
#include "tests/testing.h"

using namespace lmkit;
using Ids = std::vector<int32_t>;

namespace {

std::unique_ptr<Sequence> make_seq(int64_t id, int32_t prompt_len, int32_t max_new) {
  auto s = std::make_unique<Sequence>();
  s->id = id;
  s->request_id = id;
  s->tokens.assign(prompt_len, 1);
  s->num_prompt_tokens = prompt_len;
  s->max_total_tokens = prompt_len + max_new;
  s->params.max_new_tokens = max_new;
  return s;
}

// What the engine does after a step: the computed tokens advance; sampled chunks add one token.
Scheduler* g_sched = nullptr;
void advance(const BatchPlan& plan) {
  for (const ScheduledSeq& s : plan.seqs) {
    g_sched->advance(s);
    if (s.is_sampled) s.seq->tokens.push_back(2);
  }
}

std::unique_ptr<Sequence> make_seq_tokens(int64_t id, std::vector<int32_t> tokens, int32_t max_new) {
  auto s = make_seq(id, (int32_t)tokens.size(), max_new);
  s->tokens = std::move(tokens);
  return s;
}

}  // namespace

TEST(admits_fcfs_with_exact_blocks) {
  BlockManager bm(10, 4);
  Scheduler sched({8, 100, 1000}, bm);
  g_sched = &sched;
  sched.add(make_seq(1, 5, 4));  // 2 blocks
  sched.add(make_seq(2, 3, 4));  // 1 block
  BatchPlan plan = sched.schedule();
  EXPECT_EQ(plan.seqs.size(), 2u);
  EXPECT_EQ(plan.seqs[0].seq->id, 1);
  EXPECT_EQ(plan.seqs[0].seq->block_table, (Ids{0, 1}));
  EXPECT_EQ(plan.seqs[1].seq->block_table, (Ids{2}));
  EXPECT_EQ(plan.num_tokens, 8);
  EXPECT_EQ(plan.num_prefill_tokens, 8);
  EXPECT(plan.seqs[0].is_sampled && plan.seqs[1].is_sampled);
  advance(plan);
  plan = sched.schedule();  // two decodes; seq 2 grows into its 4th token: still 1 block
  EXPECT_EQ(plan.num_decode_tokens, 2);
  EXPECT_EQ(plan.seqs[0].start_pos, 5);
  EXPECT_EQ(plan.seqs[1].start_pos, 3);
  EXPECT_EQ(plan.seqs[1].seq->block_table, (Ids{2}));
  advance(plan);
  plan = sched.schedule();  // seq 2 now needs a 2nd block: id 3
  EXPECT_EQ(plan.seqs[1].seq->block_table, (Ids{2, 3}));
  sched.verify();
}

TEST(chunked_prefill_respects_budget_and_runs_with_decodes) {
  BlockManager bm(64, 4);
  Scheduler sched({8, 10, 1000}, bm);
  g_sched = &sched;
  sched.add(make_seq(1, 3, 8));
  advance(sched.schedule());  // seq 1 prefilled, now decoding
  sched.add(make_seq(2, 25, 4));
  BatchPlan plan = sched.schedule();  // decode of 1 + first 10-token chunk of 2
  EXPECT_EQ(plan.seqs.size(), 2u);
  EXPECT_EQ(plan.num_decode_tokens, 1);
  EXPECT_EQ(plan.seqs[1].num_tokens, 10);
  EXPECT(!plan.seqs[1].is_sampled);
  advance(plan);
  plan = sched.schedule();
  EXPECT_EQ(plan.seqs[1].start_pos, 10);
  EXPECT_EQ(plan.seqs[1].num_tokens, 10);
  advance(plan);
  plan = sched.schedule();
  EXPECT_EQ(plan.seqs[1].num_tokens, 5);
  EXPECT(plan.seqs[1].is_sampled);
  sched.verify();
}

TEST(waits_when_blocks_are_short_and_never_skips_the_head) {
  BlockManager bm(4, 4);
  Scheduler sched({8, 100, 1000}, bm);
  g_sched = &sched;
  sched.add(make_seq(1, 12, 2));  // 3 blocks
  sched.add(make_seq(2, 8, 2));   // 2 blocks: must wait
  sched.add(make_seq(3, 2, 2));   // 1 block would fit, but FCFS keeps it behind 2
  BatchPlan plan = sched.schedule();
  EXPECT_EQ(plan.seqs.size(), 1u);
  EXPECT_EQ(sched.num_waiting(), 2);
  std::unique_ptr<Sequence> done = sched.remove(1);
  EXPECT(done->block_table.empty());
  plan = sched.schedule();
  EXPECT_EQ(plan.seqs.size(), 2u);
  EXPECT_EQ(plan.seqs[0].seq->id, 2);
  EXPECT_EQ(plan.seqs[0].seq->block_table, (Ids{0, 1}));
  EXPECT_EQ(plan.seqs[1].seq->block_table, (Ids{2}));
  sched.verify();
}

TEST(preempts_the_newest_and_recomputes_it) {
  BlockManager bm(4, 4);
  Scheduler sched({8, 100, 1000}, bm);
  g_sched = &sched;
  sched.add(make_seq(1, 4, 8));  // 1 block now, grows
  sched.add(make_seq(2, 8, 8));  // 2 blocks
  advance(sched.schedule());     // blocks 0 | 1 2; both sampled one token
  BatchPlan plan = sched.schedule();  // seq 1 needs block 3 for its 5th token; seq 2 needs one for its 9th: none left
  EXPECT_EQ(sched.num_preemptions(), 1);
  EXPECT_EQ(plan.seqs.size(), 1u);
  EXPECT_EQ(plan.seqs[0].seq->id, 1);
  Sequence* s2 = sched.find(2);
  EXPECT(s2->state == SeqState::kWaiting);
  EXPECT(s2->block_table.empty());
  EXPECT_EQ(s2->num_computed_tokens, 0);
  EXPECT_EQ(s2->num_tokens(), 9);  // its sampled token is kept and recomputed
  sched.verify();
  std::unique_ptr<Sequence> one = sched.remove(1);
  plan = sched.schedule();  // seq 2 comes back as a 9-token prefill
  EXPECT_EQ(plan.seqs.size(), 1u);
  EXPECT_EQ(plan.seqs[0].num_tokens, 9);
  EXPECT(plan.seqs[0].is_sampled);
  EXPECT_EQ(plan.seqs[0].seq->block_table, (Ids{0, 1, 2}));
  sched.verify();
}

TEST(refuses_a_request_that_can_never_fit) {
  BlockManager bm(4, 4);
  Scheduler sched({8, 100, 1000}, bm);
  g_sched = &sched;
  auto big = make_seq(1, 10, 7);  // 17 tokens -> 5 blocks
  EXPECT(!sched.fit_error(*big).empty());
  EXPECT_THROWS(sched.add(std::move(big)));
  auto ok = make_seq(2, 10, 6);  // 16 tokens -> 4 blocks
  EXPECT(sched.fit_error(*ok).empty());
}

TEST(prefix_hits_skip_computed_blocks) {
  BlockManager bm(16, 4);
  Scheduler sched({8, 100, 1000, true}, bm);
  g_sched = &sched;
  std::vector<int32_t> doc(10);
  for (int i = 0; i < 10; ++i) doc[i] = 30 + i;
  sched.add(make_seq_tokens(1, doc, 3));
  BatchPlan plan = sched.schedule();
  EXPECT_EQ(plan.seqs[0].num_tokens, 10);
  advance(plan);  // blocks 0 1 full and published; block 2 holds 2 tokens
  sched.remove(1);  // 0 1 cached, 2 free
  EXPECT_EQ(bm.num_cached_blocks(), 2);
  std::vector<int32_t> same_prefix = doc;
  same_prefix.push_back(99);
  sched.add(make_seq_tokens(2, same_prefix, 3));
  plan = sched.schedule();
  EXPECT_EQ(plan.seqs[0].start_pos, 8);  // two blocks reused
  EXPECT_EQ(plan.seqs[0].num_tokens, 3);
  EXPECT_EQ(plan.seqs[0].seq->block_table, (Ids{0, 1, 2}));
  EXPECT_EQ(sched.num_prefix_hit_tokens(), 8);
  sched.verify();
  // An exact repeat of a block-aligned prompt still computes its last token.
  std::vector<int32_t> aligned(doc.begin(), doc.begin() + 8);
  sched.add(make_seq_tokens(3, aligned, 3));
  plan = sched.schedule();
  bool found = false;
  for (const ScheduledSeq& s : plan.seqs)
    if (s.seq->id == 3) {
      found = true;
      EXPECT_EQ(s.start_pos, 4);
      EXPECT_EQ(s.num_tokens, 4);
      EXPECT_EQ(bm.ref_count(s.seq->block_table[0]), 2);  // shared with sequence 2
    }
  EXPECT(found);
  sched.verify();
}

TEST(forked_completions_share_full_prompt_blocks) {
  BlockManager bm(16, 4);
  Scheduler sched({8, 100, 1000}, bm);
  g_sched = &sched;
  auto parent = make_seq(7, 10, 4);  // prompt fills blocks 0 1 and half of 2
  parent->num_forks = 2;             // n = 3
  sched.add(std::move(parent));
  BatchPlan plan = sched.schedule();
  Sequence* p = plan.seqs[0].seq;
  for (const ScheduledSeq& s : plan.seqs) sched.advance(s);
  sched.fork(p);
  std::vector<Sequence*> all = sched.find_request(7);
  EXPECT_EQ(all.size(), 3u);
  EXPECT_EQ(bm.ref_count(0), 3);
  EXPECT_EQ(bm.ref_count(1), 3);
  EXPECT_EQ(bm.ref_count(2), 1);  // the block with the last prompt token stays the parent's
  for (Sequence* s : all)
    if (s != p) {
      EXPECT_EQ(s->num_computed_tokens, 8);
      EXPECT_EQ(s->num_pending_tokens(), 2);  // recompute the tail, then sample
    }
  sched.verify();
  p->tokens.push_back(2);
  plan = sched.schedule();  // parent decodes, children prefill their 2-token tails into fresh blocks
  EXPECT_EQ(plan.seqs.size(), 3u);
  EXPECT_EQ(plan.num_decode_tokens, 1);
  EXPECT_EQ(plan.num_prefill_tokens, 4);
  EXPECT_EQ(plan.seqs[1].seq->block_table, (Ids{0, 1, 3}));
  EXPECT_EQ(plan.seqs[2].seq->block_table, (Ids{0, 1, 4}));
  sched.verify();
  for (Sequence* s : sched.find_request(7)) sched.remove(s->id);
  EXPECT_EQ(bm.num_free_blocks(), 16);
}

TEST(random_run_conserves_blocks_every_step) {
  std::mt19937 rng(1234);
  BlockManager bm(40, 4);
  Scheduler sched({6, 24, 64, true}, bm);
  g_sched = &sched;
  std::vector<int32_t> shared(40);
  for (int i = 0; i < 40; ++i) shared[i] = 500 + i;
  int64_t next_id = 1;
  int finished = 0;
  for (int step = 0; step < 3000; ++step) {
    if (rng() % 3 == 0) {
      const int32_t prompt = 1 + rng() % 40, max_new = 1 + rng() % 40;
      // half the prompts share a prefix with each other, so prefix hits, sharing and eviction happen
      std::vector<int32_t> toks(prompt);
      const bool share = rng() % 2;
      for (int32_t i = 0; i < prompt; ++i) toks[i] = share ? shared[i] : (int32_t)(rng() % 1000);
      auto s = make_seq_tokens(next_id++, toks, max_new);
      if (sched.fit_error(*s).empty()) sched.add(std::move(s));
    }
    BatchPlan plan = sched.schedule();
    int32_t prefill = 0;
    for (const ScheduledSeq& s : plan.seqs) {
      EXPECT((int32_t)s.seq->block_table.size() * 4 >= s.start_pos + s.num_tokens);
      if (s.seq->num_pending_tokens() > 1) prefill += s.num_tokens;
    }
    EXPECT(prefill <= 24);
    EXPECT(sched.num_running() <= 6);
    advance(plan);
    // finish sequences at their limit, cancel some at random
    std::vector<int64_t> ids = sched.ids();
    for (int64_t id : ids) {
      Sequence* s = sched.find(id);
      if (s->num_tokens() >= s->max_total_tokens || rng() % 50 == 0) {
        sched.remove(id);
        ++finished;
      }
    }
    sched.verify();
    EXPECT_EQ(bm.num_free_blocks() + bm.num_cached_blocks() + bm.num_active_blocks(), bm.num_total_blocks());
  }
  for (int64_t id : sched.ids()) sched.remove(id);
  EXPECT_EQ(bm.num_free_blocks() + bm.num_cached_blocks(), 40);
  EXPECT(sched.num_prefix_hit_tokens() > 0);
  EXPECT(finished > 100);
  EXPECT(sched.num_preemptions() > 0);
}

int main() { return lmkit::testing::run_all(); }
