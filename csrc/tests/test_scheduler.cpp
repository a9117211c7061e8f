// Scheduler bookkeeping: FCFS admission by free blocks, decode before prefill, chunked prefill under
// the token budget, preemption of the newest request, exact block ids, and conservation checked after
// every step of a seeded random run with arrivals, growth, finishes and cancellations. With an attention
// window: blocks behind it go back at the exact step, prefix hits, preemption and forks with holes, a
// sequence longer than the pool, and a simulated KV pool that proves every key a query reads is its own.
// With recurrent-state slots: admission waits for slots, every exit gives them back, forks copy the state
// at their fork position, and a simulated state pool proves every chunk starts from its own sequence's state.
#include <algorithm>
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


// free + cached + active == total.
bool conserved(const BlockManager& bm) {
  return bm.num_free_blocks() + bm.num_cached_blocks() + bm.num_active_blocks() == bm.num_total_blocks();
}

// A stand-in for the KV pool: each slot holds a fingerprint of the tokens[0, p] whose K/V it would hold (K/V
// at p depend on every token up to p). step() writes a plan's chunks, then checks that every key each of
// their queries reads (p - k < window, or all k <= p without one) is in a live block holding exactly that
// sequence's fingerprint: a block freed too early, reused while still read, or hit with other content fails.
struct FakeKV {
  int32_t block_size_tokens, window;
  std::vector<std::vector<uint64_t>> slots;
  FakeKV(const BlockManager& bm, int32_t window_tokens)
      : block_size_tokens(bm.block_size_tokens()), window(window_tokens),
        slots(bm.num_total_blocks(), std::vector<uint64_t>(bm.block_size_tokens(), 0)) {}
  bool step(const BatchPlan& plan) {
    bool ok = true;
    for (const ScheduledSeq& s : plan.seqs) {
      const Sequence& seq = *s.seq;
      std::vector<uint64_t> fp(s.start_pos + s.num_tokens);
      uint64_t h = 1;
      for (size_t p = 0; p < fp.size(); ++p) fp[p] = h = h * 1000003u + (uint64_t)seq.tokens[p] + 1;
      for (int32_t p = s.start_pos; p < s.start_pos + s.num_tokens; ++p) {
        const int32_t id = seq.block_table[p / block_size_tokens];
        if (id == kNoBlock) return false;
        slots[id][p % block_size_tokens] = fp[p];
      }
      for (int32_t q = s.start_pos; q < s.start_pos + s.num_tokens; ++q)
        for (int32_t k = window > 0 ? std::max(0, q - window + 1) : 0; k <= q; ++k) {
          const int32_t id = seq.block_table[k / block_size_tokens];
          ok = ok && id != kNoBlock && slots[id][k % block_size_tokens] == fp[k];
        }
    }
    return ok;
  }
};

int32_t num_live_blocks(const Sequence& seq) {
  const auto is_live = [](int32_t b) { return b != kNoBlock; };
  return (int32_t)std::count_if(seq.block_table.begin(), seq.block_table.end(), is_live);
}

// One engine step: schedule, run on the fake pool, advance, fork a parent whose prompt is done, append samples.
// *ok stays true while every read is the sequence's own and no sequence holds more than max_live_blocks()
// (measured after schedule(), when it holds the most); *peak is the most live blocks any sequence held.
BatchPlan run_step(Scheduler& sched, FakeKV& kv, bool* ok, int32_t* peak = nullptr) {
  BatchPlan plan = sched.schedule();
  *ok = kv.step(plan) && *ok;
  for (const ScheduledSeq& s : plan.seqs) {
    const int32_t live = num_live_blocks(*s.seq);
    *ok = live <= sched.max_live_blocks(*s.seq) && *ok;
    if (peak != nullptr) *peak = std::max(*peak, live);
  }
  for (const ScheduledSeq& s : plan.seqs) {
    sched.advance(s);
    if (s.is_sampled && s.seq->num_forks > 0 && s.seq->num_generated_tokens() == 0) sched.fork(s.seq);
    if (s.is_sampled) s.seq->tokens.push_back(2 + (int32_t)(s.seq->id & 7));
  }
  return plan;
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

TEST(paced_prompts_take_the_cap_beside_decodes_and_alone) {
  BlockManager bm(64, 4);
  Scheduler sched({8, 100, 1000}, bm);
  g_sched = &sched;
  const PromptCaps caps{8, 3, 0, 0, true};
  sched.add(make_seq(1, 2, 3));
  advance(sched.schedule(caps));  // seq 1's prompt alone; it decodes from now on
  sched.add(make_seq(2, 20, 1));
  BatchPlan plan = sched.schedule(caps);  // beside a decode: 3 prompt tokens
  EXPECT_EQ(plan.num_decode_tokens, 1);
  EXPECT_EQ(plan.seqs[1].seq->id, 2);
  EXPECT_EQ(plan.seqs[1].num_tokens, 3);
  EXPECT_EQ(plan.seqs[1].seq->block_table, (Ids{1}));  // blocks for the chunk only: [0] is seq 1's
  advance(plan);
  plan = sched.schedule(PromptCaps{8, 0, 0, 0, true});  // no credit: a decode-only step, the prompt waits
  EXPECT_EQ(plan.seqs.size(), 1u);
  EXPECT_EQ(plan.num_prefill_tokens, 0);
  advance(plan);
  plan = sched.schedule(caps);  // seq 1 takes its last token: decode, then 3 more of seq 2
  EXPECT_EQ(plan.seqs[1].num_tokens, 3);
  EXPECT_EQ(plan.seqs[1].start_pos, 3);
  advance(plan);
  sched.remove(1);
  plan = sched.schedule(caps);  // alone: 8
  EXPECT_EQ(plan.seqs.size(), 1u);
  EXPECT_EQ(plan.seqs[0].start_pos, 6);
  EXPECT_EQ(plan.seqs[0].num_tokens, 8);
  advance(plan);
  plan = sched.schedule(caps);
  EXPECT_EQ(plan.seqs[0].num_tokens, 6);
  EXPECT(plan.seqs[0].is_sampled);
  sched.verify();
}

TEST(paced_beside_decodes_requests_start_and_short_prompts_end_without_credit) {
  BlockManager bm(64, 4);
  Scheduler sched({8, 100, 1000}, bm);
  g_sched = &sched;
  sched.add(make_seq(1, 2, 20));
  advance(sched.schedule(PromptCaps{8, 0, 0, 0, true}));  // seq 1 decodes from now on
  sched.add(make_seq(2, 30, 1));
  sched.add(make_seq(3, 5, 1));
  const PromptCaps no_credit{8, 0, 6, 6, true};
  BatchPlan plan = sched.schedule(no_credit);  // no credit, but seq 2 starts: a first chunk of 6, all of it
  EXPECT_EQ(plan.seqs.size(), 2u);
  EXPECT_EQ(plan.seqs[1].seq->id, 2);
  EXPECT_EQ(plan.seqs[1].num_tokens, 6);
  EXPECT_EQ(sched.num_waiting(), 1);
  advance(plan);
  plan = sched.schedule(no_credit);  // seq 2's middle waits for credit; seq 3 (shorter) starts and ends
  EXPECT_EQ(plan.seqs.size(), 2u);
  EXPECT_EQ(plan.seqs[1].seq->id, 3);
  EXPECT_EQ(plan.seqs[1].num_tokens, 5);
  EXPECT(plan.seqs[1].is_sampled);
  advance(plan);
  sched.add(make_seq(4, 4, 1));
  sched.add(make_seq(5, 4, 1));
  plan = sched.schedule(no_credit);  // one chunk's worth in a step: seq 4's 4, then the 2 left start seq 5
  EXPECT_EQ(plan.seqs.size(), 4u);
  EXPECT_EQ(plan.seqs[2].seq->id, 4);
  EXPECT_EQ(plan.seqs[2].num_tokens, 4);
  EXPECT_EQ(plan.seqs[3].seq->id, 5);
  EXPECT_EQ(plan.seqs[3].num_tokens, 2);
  advance(plan);
  plan = sched.schedule(no_credit);  // seq 5's last 2 fit: it ends; seq 2 (24 left) still waits
  EXPECT_EQ(plan.num_prefill_tokens, 2);
  EXPECT_EQ(sched.find(2)->num_computed_tokens, 6);
  advance(plan);
  plan = sched.schedule(PromptCaps{8, 0, 6, 24, true});  // seq 2's 24 fit in `finish`: it ends in one step
  EXPECT_EQ(plan.num_prefill_tokens, 24);
  EXPECT(plan.seqs[1].seq->id == 2 && plan.seqs[1].num_tokens == 24 && plan.seqs[1].is_sampled);
  advance(plan);
  sched.verify();
}

TEST(paced_a_short_prompt_goes_before_a_long_one) {
  BlockManager bm(64, 4);
  Scheduler sched({8, 100, 1000}, bm);
  g_sched = &sched;
  const PromptCaps caps{6, 6, 0, 0, true};
  sched.add(make_seq(1, 40, 2));
  advance(sched.schedule(caps));  // 6 of 40
  sched.add(make_seq(2, 4, 2));   // arrives while the long prompt is computed
  BatchPlan plan = sched.schedule(caps);  // the head is shorter than what seq 1 has left: it goes first
  EXPECT_EQ(plan.seqs.size(), 1u);
  EXPECT_EQ(plan.seqs[0].seq->id, 2);
  EXPECT_EQ(plan.seqs[0].num_tokens, 4);
  EXPECT(plan.seqs[0].is_sampled);
  advance(plan);
  plan = sched.schedule(caps);  // seq 2 decodes beside seq 1's next chunk
  EXPECT_EQ(plan.seqs.size(), 2u);
  EXPECT_EQ(plan.seqs[0].seq->id, 1);
  EXPECT_EQ(plan.seqs[0].start_pos, 6);
  EXPECT_EQ(plan.seqs[0].num_tokens, 6);
  advance(plan);
  // A running prompt with fewer tokens left goes first too: seq 3's 10 tokens take two steps of 6.
  sched.remove(2);
  sched.add(make_seq(3, 10, 2));
  plan = sched.schedule(caps);
  EXPECT_EQ(plan.seqs.size(), 1u);
  EXPECT_EQ(plan.seqs[0].seq->id, 3);
  EXPECT_EQ(plan.seqs[0].num_tokens, 6);
  advance(plan);
  plan = sched.schedule(caps);  // 4 left of seq 3 < 28 of seq 1
  EXPECT_EQ(plan.seqs.size(), 1u);
  EXPECT_EQ(plan.seqs[0].seq->id, 3);
  EXPECT_EQ(plan.seqs[0].num_tokens, 4);
  advance(plan);
  plan = sched.schedule(caps);  // seq 3 decodes, seq 1 goes on
  EXPECT_EQ(plan.seqs.size(), 2u);
  EXPECT_EQ(plan.seqs[0].seq->id, 1);
  EXPECT_EQ(plan.seqs[0].start_pos, 12);
  // Unpaced the same caps keep FCFS: the running prompt takes them first.
  BlockManager bm2(64, 4);
  Scheduler fcfs({8, 100, 1000}, bm2);
  g_sched = &fcfs;
  fcfs.add(make_seq(1, 40, 2));
  advance(fcfs.schedule(PromptCaps{6, 6, 0, 0, false}));
  fcfs.add(make_seq(2, 4, 2));
  plan = fcfs.schedule(PromptCaps{6, 6, 0, 0, false});
  EXPECT_EQ(plan.seqs.size(), 1u);
  EXPECT_EQ(plan.seqs[0].seq->id, 1);
  sched.verify();
  fcfs.verify();
}

TEST(paced_a_long_prompt_never_gives_way_to_a_head_that_cannot_start) {
  for (const int32_t pool : {12, 13}) {  // 12: no block for the head; 13: one
    BlockManager bm(pool, 4);
    Scheduler sched({8, 100, 1000}, bm);
    g_sched = &sched;
    sched.add(make_seq(1, 47, 1));  // 48 tokens: 12 blocks
    advance(sched.schedule(PromptCaps{45, 45, 0, 0, true}));  // 45 computed: all 12 blocks taken, 2 tokens left
    sched.add(make_seq(2, 1, 1));   // shorter, but its one block is there only in the larger pool
    BatchPlan plan = sched.schedule(PromptCaps{8, 8, 0, 0, true});
    EXPECT_EQ(plan.seqs.size(), 1u);
    EXPECT_EQ(plan.seqs[0].seq->id, pool == 12 ? 1 : 2);
    EXPECT_EQ(sched.num_preemptions(), 0);
    sched.verify();
  }
  // No batch slot for the head: the running prompt goes on.
  BlockManager bm(64, 4);
  Scheduler sched({1, 100, 1000}, bm);
  g_sched = &sched;
  const PromptCaps caps{8, 8, 0, 0, true};
  sched.add(make_seq(1, 40, 2));
  advance(sched.schedule(caps));
  sched.add(make_seq(2, 2, 1));
  BatchPlan plan = sched.schedule(caps);
  EXPECT_EQ(plan.seqs.size(), 1u);
  EXPECT_EQ(plan.seqs[0].seq->id, 1);
  EXPECT_EQ(plan.seqs[0].num_tokens, 8);
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

// Computes the 10-token prompt 30..39 as sequence 1 and removes it: blocks 0 1 (full, published) stay cached,
// block 2 (2 tokens) is free. Returns the prompt.
std::vector<int32_t> cache_ten_token_prompt(Scheduler& sched, BlockManager& bm) {
  std::vector<int32_t> doc(10);
  for (int i = 0; i < 10; ++i) doc[i] = 30 + i;
  sched.add(make_seq_tokens(1, doc, 3));
  BatchPlan plan = sched.schedule();
  EXPECT_EQ(plan.seqs[0].num_tokens, 10);
  advance(plan);
  sched.remove(1);
  EXPECT_EQ(bm.num_cached_blocks(), 2);
  return doc;
}

TEST(prefix_hits_skip_computed_blocks) {
  BlockManager bm(16, 4);
  Scheduler sched({8, 100, 1000, true}, bm);
  g_sched = &sched;
  std::vector<int32_t> doc = cache_ten_token_prompt(sched, bm);
  std::vector<int32_t> same_prefix = doc;
  same_prefix.push_back(99);
  sched.add(make_seq_tokens(2, same_prefix, 3));
  BatchPlan plan = sched.schedule();
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

TEST(prompt_rows_take_no_prefix_hits_and_max_new_zero_is_not_sampled) {
  BlockManager bm(16, 4);
  Scheduler sched({8, 100, 1000, true}, bm);
  g_sched = &sched;
  std::vector<int32_t> doc = cache_ten_token_prompt(sched, bm);
  auto scored = make_seq_tokens(2, doc, 0);  // max_new_tokens 0 with prompt logprobs: score the prompt
  scored->params.prompt_logprobs = 1;
  sched.add(std::move(scored));
  BatchPlan plan = sched.schedule();
  EXPECT_EQ(plan.seqs[0].start_pos, 0);  // the cached prefix is recomputed: its rows are needed
  EXPECT_EQ(plan.seqs[0].num_tokens, 10);
  EXPECT(!plan.seqs[0].is_sampled);      // nothing to generate
  EXPECT_EQ(sched.num_prefix_hit_tokens(), 0);
  advance(plan);
  EXPECT_EQ(plan.seqs[0].seq->num_pending_tokens(), 0);  // the engine finishes it (length)
  sched.remove(2);
  sched.verify();
  EXPECT(conserved(bm));
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

TEST(completions_still_to_fork_count_against_max_batch_size) {
  BlockManager bm(64, 4);
  Scheduler sched({4, 4, 1000}, bm);  // 4 running at most, 4 prompt tokens per step
  g_sched = &sched;
  auto parent = make_seq(1, 10, 3);  // n = 3: its prompt takes three steps, then two completions join
  parent->num_forks = 2;
  sched.add(std::move(parent));
  for (int64_t id = 2; id <= 5; ++id) sched.add(make_seq(id, 1, 3));
  int32_t most = 0;
  for (int step = 0; step < 12 && sched.has_work(); ++step) {
    BatchPlan plan = sched.schedule();
    for (const ScheduledSeq& s : plan.seqs) {
      sched.advance(s);
      if (s.is_sampled && s.seq->num_forks > 0 && s.seq->num_generated_tokens() == 0) sched.fork(s.seq);
      if (s.is_sampled) s.seq->tokens.push_back(2);
    }
    most = std::max(most, sched.num_running());
    for (int64_t id : sched.ids())
      if (sched.find(id)->num_tokens() >= sched.find(id)->max_total_tokens) sched.remove(id);
    sched.verify();
  }
  EXPECT_EQ(most, 4);  // the parent, its two completions and one other: never five
}

TEST(window_frees_blocks_behind_it_at_the_exact_step) {
  BlockManager bm(8, 4);
  Scheduler sched({8, 100, 1000, false, 6}, bm);  // a query at p reads keys p-5 .. p
  g_sched = &sched;
  sched.add(make_seq(1, 10, 8));
  Sequence* s = sched.find(1);
  advance(sched.schedule());  // prefill [0, 10) into 0 1 2; queries >= 10 read keys >= 5: block 0 is dead
  EXPECT_EQ(s->block_table, (Ids{kNoBlock, 1, 2}));
  EXPECT_EQ(bm.ref_count(0), 0);
  EXPECT_EQ(bm.num_free_blocks(), 6);  // 0 back to free (no prefix caching: unkeyed)
  EXPECT_EQ(sched.num_window_freed_blocks(), 1);
  EXPECT(conserved(bm));
  sched.verify();
  advance(sched.schedule());  // decode at 10: keys 5 .. 10, block 1 still read
  advance(sched.schedule());  // decode at 11
  EXPECT_EQ(s->block_table, (Ids{kNoBlock, 1, 2}));
  EXPECT_EQ(sched.num_window_freed_blocks(), 1);
  BatchPlan plan = sched.schedule();  // decode at 12 needs a 4th block: the lowest free id is the freed 0
  EXPECT_EQ(plan.seqs[0].start_pos, 12);
  EXPECT_EQ(s->block_table, (Ids{kNoBlock, 1, 2, 0}));
  advance(plan);  // 13 computed: queries >= 13 read keys >= 8, block 1 goes
  EXPECT_EQ(s->block_table, (Ids{kNoBlock, kNoBlock, 2, 0}));
  EXPECT_EQ(sched.num_window_freed_blocks(), 2);
  EXPECT_EQ(bm.num_active_blocks(), 2);
  EXPECT(conserved(bm));
  sched.verify();
  std::unique_ptr<Sequence> done = sched.remove(1);  // holes are skipped
  EXPECT(done->block_table.empty());
  EXPECT_EQ(bm.num_free_blocks(), 8);
  sched.verify();
}

TEST(window_zero_keeps_every_block) {
  BlockManager bm(8, 4);
  Scheduler sched({8, 100, 1000, false, 0}, bm);
  g_sched = &sched;
  sched.add(make_seq(1, 10, 8));
  for (int i = 0; i < 6; ++i) advance(sched.schedule());
  EXPECT_EQ(sched.find(1)->block_table, (Ids{0, 1, 2, 3}));
  EXPECT_EQ(sched.num_window_freed_blocks(), 0);
  sched.verify();
}

TEST(window_releases_keyed_blocks_to_the_cache_and_hits_them) {
  BlockManager bm(16, 4);
  Scheduler sched({8, 100, 1000, true, 6}, bm);
  g_sched = &sched;
  FakeKV kv(bm, 6);
  bool reads_ok = true;
  std::vector<int32_t> doc(18);
  for (int i = 0; i < 18; ++i) doc[i] = 100 + i;
  sched.add(make_seq_tokens(1, doc, 4));
  Sequence* s1 = sched.find(1);
  run_step(sched, kv, &reads_ok);  // [0, 18) into 0..4; blocks 0..3 published, then 0 1 2 fall out of the window
  EXPECT_EQ(s1->block_table, (Ids{kNoBlock, kNoBlock, kNoBlock, 3, 4}));
  EXPECT_EQ(bm.num_cached_blocks(), 3);  // keyed before released: cached, not free
  EXPECT(bm.has_key(0) && bm.has_key(1) && bm.has_key(2) && bm.has_key(3));
  EXPECT_EQ(bm.num_active_blocks(), 2);
  EXPECT_EQ(sched.num_window_freed_blocks(), 3);
  EXPECT(conserved(bm));
  sched.verify();
  // The same prompt again: the whole chain 0 1 2 3 matches (0..2 cached, 3 held by sequence 1); a query at
  // 16 reads keys >= 11, so only 2 and 3 are taken and the rest stays cached.
  sched.add(make_seq_tokens(2, doc, 4));
  BatchPlan plan = run_step(sched, kv, &reads_ok);
  Sequence* s2 = sched.find(2);
  EXPECT_EQ(plan.seqs.size(), 2u);
  EXPECT_EQ(plan.seqs[1].start_pos, 16);
  EXPECT_EQ(plan.seqs[1].num_tokens, 2);
  EXPECT_EQ(sched.num_prefix_hit_tokens(), 16);
  EXPECT_EQ(s2->block_table, (Ids{kNoBlock, kNoBlock, kNoBlock, 3, 5}));  // after advance: 2 went back again
  EXPECT_EQ(bm.ref_count(3), 2);
  EXPECT_EQ(bm.num_cached_blocks(), 3);
  EXPECT_EQ(sched.num_window_freed_blocks(), 4);
  EXPECT(conserved(bm));
  sched.verify();
  // Both end; a third copy finds every early-released block still cached and reads the same K/V.
  sched.remove(1);
  sched.remove(2);
  EXPECT_EQ(bm.num_active_blocks(), 0);
  sched.add(make_seq_tokens(3, doc, 4));
  plan = sched.schedule();
  EXPECT_EQ(plan.seqs[0].start_pos, 16);
  EXPECT_EQ(plan.seqs[0].seq->block_table, (Ids{kNoBlock, kNoBlock, 2, 3, 4}));
  reads_ok = kv.step(plan) && reads_ok;
  EXPECT(reads_ok);
  EXPECT(conserved(bm));
  sched.verify();
}

TEST(window_preempts_a_sequence_with_holes_and_recomputes_a_fresh_table) {
  BlockManager bm(7, 4);
  Scheduler sched({8, 8, 1000, false, 12}, bm);
  g_sched = &sched;
  FakeKV kv(bm, 12);
  bool reads_ok = true;
  sched.add(make_seq(1, 8, 40));
  run_step(sched, kv, &reads_ok);  // 1: 0 1
  sched.add(make_seq(2, 16, 40));
  run_step(sched, kv, &reads_ok);  // 1: 0 1 2; 2: first chunk [0, 8) into 3 4
  run_step(sched, kv, &reads_ok);  // 2: [8, 16) into 5 6; queries >= 16 read keys >= 5, block 3 goes
  Sequence* s2 = sched.find(2);
  EXPECT_EQ(s2->block_table, (Ids{kNoBlock, 4, 5, 6}));
  run_step(sched, kv, &reads_ok);  // 2 decodes at 16 into the freed 3
  EXPECT_EQ(s2->block_table, (Ids{kNoBlock, 4, 5, 6, 3}));
  EXPECT_EQ(bm.num_free_blocks(), 0);
  run_step(sched, kv, &reads_ok);
  EXPECT_EQ(sched.num_preemptions(), 0);
  // 1 decodes at 12 and needs a 4th block: none left, the newest (2, with a hole) is preempted, its live
  // blocks 3 6 5 4 go back; 1 takes 3, and 2 comes back in the same step as a fresh 8-token chunk.
  BatchPlan plan = run_step(sched, kv, &reads_ok);
  EXPECT_EQ(sched.num_preemptions(), 1);
  EXPECT_EQ(sched.find(1)->block_table, (Ids{0, 1, 2, 3}));
  EXPECT_EQ(plan.seqs[1].seq, s2);
  EXPECT_EQ(plan.seqs[1].start_pos, 0);
  EXPECT_EQ(s2->block_table, (Ids{4, 5}));
  EXPECT(conserved(bm));
  sched.verify();
  for (int i = 0; i < 30; ++i) {
    run_step(sched, kv, &reads_ok);
    sched.verify();
    EXPECT(conserved(bm));
  }
  EXPECT(reads_ok);
}

TEST(window_fork_shares_only_live_prompt_blocks) {
  BlockManager bm(16, 4);
  Scheduler sched({8, 100, 1000, false, 3}, bm);
  g_sched = &sched;
  FakeKV kv(bm, 3);
  bool reads_ok = true;
  auto parent = make_seq(7, 14, 4);
  parent->num_forks = 2;
  sched.add(std::move(parent));
  Sequence* p = sched.find(7);
  BatchPlan plan = sched.schedule();  // [0, 14) into 0 1 2 3
  reads_ok = kv.step(plan) && reads_ok;
  sched.advance(plan.seqs[0]);
  // Completions will compute from 12, reading keys >= 10: the parent holds 2 (its own queries need only 3).
  EXPECT_EQ(p->block_table, (Ids{kNoBlock, kNoBlock, 2, 3}));
  EXPECT_EQ(sched.num_dead_blocks(*p), 2);
  sched.verify();
  sched.fork(p);
  EXPECT_EQ(p->block_table, (Ids{kNoBlock, kNoBlock, kNoBlock, 3}));  // now 2 is the completions' only
  EXPECT_EQ(bm.ref_count(2), 2);
  for (Sequence* s : sched.find_request(7))
    if (s != p) {
      EXPECT_EQ(s->block_table, (Ids{kNoBlock, kNoBlock, 2}));  // holes stay holes
      EXPECT_EQ(s->num_computed_tokens, 12);
    }
  EXPECT_EQ(sched.num_window_freed_blocks(), 2);  // 0 1; 2 is still held
  sched.verify();
  p->tokens.push_back(2);
  plan = run_step(sched, kv, &reads_ok);  // parent decodes; completions recompute [12, 14) into 0 and 1
  EXPECT_EQ(plan.seqs.size(), 3u);
  EXPECT_EQ(plan.seqs[1].seq->block_table, (Ids{kNoBlock, kNoBlock, kNoBlock, 0}));
  EXPECT_EQ(plan.seqs[2].seq->block_table, (Ids{kNoBlock, kNoBlock, kNoBlock, 1}));
  EXPECT_EQ(bm.ref_count(2), 0);  // the second completion dropped the last reference
  EXPECT_EQ(sched.num_window_freed_blocks(), 3);
  EXPECT(reads_ok);
  EXPECT(conserved(bm));
  sched.verify();
  for (Sequence* s : sched.find_request(7)) sched.remove(s->id);
  EXPECT_EQ(bm.num_free_blocks(), 16);
}

TEST(window_lets_a_sequence_longer_than_the_pool_complete) {
  // A chunk of <= 8 tokens and the 7 keys before it span 15 positions: at most 5 blocks of 4, so a pool of
  // 5 holds a 50-token sequence (13 blocks) and a pool of 4 does not.
  BlockManager small(4, 4), exact(5, 4);
  Scheduler refuse({8, 8, 1000, false, 8}, small), none({8, 8, 1000, false, 0}, exact);
  auto long_seq = make_seq(1, 30, 20);  // 50 tokens: 13 blocks without a window
  EXPECT(!refuse.fit_error(*long_seq).empty());
  EXPECT(refuse.fit_error(*long_seq).find("attention window of 8 tokens") != std::string::npos);
  EXPECT(!none.fit_error(*long_seq).empty());
  for (bool caching : {false, true}) {
    BlockManager bm(5, 4);
    Scheduler sched({8, 8, 1000, caching, 8}, bm);
    g_sched = &sched;
    FakeKV kv(bm, 8);
    bool reads_ok = true;
    EXPECT_EQ(sched.max_live_blocks(*long_seq), 5);
    EXPECT(sched.fit_error(*long_seq).empty());
    // A 3-token prompt first takes part of the budget, so the long prompt's chunks start off block
    // boundaries: [0, 5) [5, 13) [13, 21) ... and at [13, 21) it reads keys 6..20: 5 blocks, the whole pool.
    sched.add(make_seq(2, 3, 1));
    auto seq = make_seq(1, 30, 20);
    for (int32_t i = 0; i < 30; ++i) seq->tokens[i] = 10 + i;
    sched.add(std::move(seq));
    int steps = 0;
    int32_t peak = 0;
    while (sched.has_work() && steps < 200) {
      run_step(sched, kv, &reads_ok, &peak);
      for (int64_t id : sched.ids()) {
        Sequence* s = sched.find(id);
        if (s->num_tokens() >= s->max_total_tokens) sched.remove(id);
      }
      sched.verify();
      EXPECT(conserved(bm));
      ++steps;
    }
    EXPECT(!sched.has_work());
    EXPECT(reads_ok);
    EXPECT_EQ(peak, 5);  // the bound is reached, and is enough
    EXPECT_EQ(sched.num_preemptions(), 0);
    EXPECT(sched.num_window_freed_blocks() >= 8);
  }
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

TEST(random_paced_run_conserves_blocks_and_drains) {
  std::mt19937 rng(99);
  BlockManager bm(40, 4);
  Scheduler sched({6, 24, 64, true}, bm);
  g_sched = &sched;
  int64_t next_id = 1;
  int finished = 0;
  auto step = [&](const PromptCaps& caps) {
    BatchPlan plan = sched.schedule(caps);
    int32_t prefill = 0, decodes = 0;
    for (const ScheduledSeq& s : plan.seqs) {
      EXPECT((int32_t)s.seq->block_table.size() * 4 >= s.start_pos + s.num_tokens);
      if (s.seq->num_pending_tokens() > 1)
        prefill += s.num_tokens;
      else
        ++decodes;
    }
    // Before the step some sequence decoded or none did: the prompt tokens stay within that cap (or the whole-
    // prompt allowance beside decodes), and always within the budget.
    EXPECT(prefill <= 24);
    EXPECT(prefill <= std::max({caps.alone, caps.beside_decodes, caps.finish}));
    advance(plan);
    for (int64_t id : sched.ids()) {
      Sequence* s = sched.find(id);
      if (s->num_tokens() >= s->max_total_tokens || rng() % 80 == 0) {
        sched.remove(id);
        ++finished;
      }
    }
    sched.verify();
    EXPECT(conserved(bm));
    return plan;
  };
  for (int i = 0; i < 3000; ++i) {
    if (rng() % 3 == 0) {
      auto s = make_seq(next_id++, 1 + rng() % 40, 1 + rng() % 30);
      if (sched.fit_error(*s).empty()) sched.add(std::move(s));
    }
    step(PromptCaps{1 + (int32_t)(rng() % 24), (int32_t)(rng() % 12), (int32_t)(rng() % 12), (int32_t)(rng() % 30),
                    true});
  }
  // No more arrivals: with any positive caps everything ends, and no step with work is empty.
  int32_t steps = 0;
  while (sched.has_work() && steps < 2000) {
    EXPECT(!step(PromptCaps{1 + (int32_t)(rng() % 24), 1 + (int32_t)(rng() % 12), 0, 0, true}).empty());
    ++steps;
  }
  EXPECT(!sched.has_work());
  EXPECT(finished > 100);
  EXPECT_EQ(bm.num_free_blocks() + bm.num_cached_blocks(), 40);
}

TEST(random_windowed_run_reads_only_its_own_keys) {
  for (int32_t window : {1, 5, 9, 16}) {
    std::mt19937 rng(99 + window);
    BlockManager bm(24, 4);
    Scheduler sched({6, 12, 96, true, window}, bm);
    FakeKV kv(bm, window);
    bool reads_ok = true;
    std::vector<int32_t> shared(60);
    for (int i = 0; i < 60; ++i) shared[i] = 500 + i;
    int64_t next_id = 1;
    int finished = 0;
    for (int step = 0; step < 2500 || sched.has_work(); ++step) {
      if (step < 2500 && rng() % 3 == 0) {
        const int32_t prompt = 1 + rng() % 60, max_new = 1 + rng() % 36;
        std::vector<int32_t> toks(prompt);
        const bool share = rng() % 2;
        for (int32_t i = 0; i < prompt; ++i) toks[i] = share ? shared[i] : (int32_t)(rng() % 1000);
        auto s = make_seq_tokens(next_id++, toks, max_new);
        s->num_forks = rng() % 4 == 0 ? 1 + rng() % 2 : 0;
        if (sched.fit_error(*s).empty()) sched.add(std::move(s));
      }
      run_step(sched, kv, &reads_ok);
      for (int64_t id : sched.ids()) {
        Sequence* s = sched.find(id);
        // a parent is never cancelled before it forks: its completions would be lost (the engine ends them)
        if (s->num_tokens() >= s->max_total_tokens || (s->num_forks == 0 && rng() % 60 == 0)) {
          sched.remove(id);
          ++finished;
        }
      }
      sched.verify();
      EXPECT(conserved(bm));
      if (step > 20000) break;  // a livelock: fails below
    }

    EXPECT(!sched.has_work());
    EXPECT(reads_ok);
    EXPECT_EQ(bm.num_free_blocks() + bm.num_cached_blocks(), 24);
    EXPECT(finished > 100);
    EXPECT(sched.num_window_freed_blocks() > 0);
    EXPECT(sched.num_prefix_hit_tokens() > 0);
  }
}

// A stand-in for the recurrent-state pool: each slot holds (position, fingerprint of tokens[0, position)).
// step() applies the plan's copies, then checks that each chunk finds its own sequence's state as of its first
// position (a chunk at 0 starts from the zero state) and advances it.
struct FakeState {
  struct Slot {
    int32_t pos = -1;
    uint64_t fp = 0;
  };
  std::vector<Slot> slots;
  explicit FakeState(int32_t n) : slots(n) {}
  static uint64_t fingerprint(const Sequence& seq, int32_t n) {
    uint64_t h = 7;
    for (int32_t p = 0; p < n; ++p) h = h * 1000003u + (uint64_t)seq.tokens[p] + 1;
    return h;
  }
  bool step(const BatchPlan& plan) {
    for (const StateCopy& c : plan.state_copies) slots.at(c.dst) = slots.at(c.src);
    bool ok = true;
    for (const ScheduledSeq& s : plan.seqs) {
      Slot& slot = slots.at(s.seq->state_slot);
      if (s.start_pos == 0) slot = Slot{0, fingerprint(*s.seq, 0)};
      ok = ok && slot.pos == s.start_pos && slot.fp == fingerprint(*s.seq, s.start_pos);
      slot = Slot{s.start_pos + s.num_tokens, fingerprint(*s.seq, s.start_pos + s.num_tokens)};
    }
    return ok;
  }
};

TEST(state_slots_gate_admission_and_every_exit_gives_them_back) {
  BlockManager bm(32, 4);
  StatePool states(2);
  Scheduler sched({8, 100, 1000, true}, bm, &states);
  g_sched = &sched;
  for (int64_t id = 1; id <= 3; ++id) sched.add(make_seq(id, 5, 4));
  BatchPlan plan = sched.schedule();  // two slots: the third waits although blocks and batch slots are left
  EXPECT_EQ(plan.seqs.size(), 2u);
  EXPECT_EQ(plan.seqs[0].seq->state_slot, 0);
  EXPECT_EQ(plan.seqs[1].seq->state_slot, 1);
  EXPECT_EQ(sched.num_waiting(), 1);
  EXPECT_EQ(states.num_free_slots(), 0);
  sched.verify();
  advance(plan);
  sched.remove(1);  // finished or cancelled: its slot is free at once
  EXPECT_EQ(states.num_free_slots(), 1);
  plan = sched.schedule();
  EXPECT_EQ(plan.seqs.size(), 2u);
  EXPECT_EQ(plan.seqs[1].seq->id, 3);
  EXPECT_EQ(plan.seqs[1].seq->state_slot, 0);
  EXPECT_EQ(plan.seqs[1].start_pos, 0);  // the prompt is cached, but no slot was free to keep its state: no hit
  sched.verify();
  for (int64_t id : sched.ids()) sched.remove(id);
  EXPECT_EQ(states.num_free_slots(), 2);
  EXPECT_EQ(sched.num_prefix_hit_tokens(), 0);
  // n beyond the slots can never run
  auto wide = make_seq(9, 5, 4);
  wide->num_forks = 2;
  EXPECT(sched.fit_error(*wide).find("state slots") != std::string::npos);
}

// Speculative decoding on a model with recurrent state: a decode's drafts take checkpoint slots from those kept for
// them (never from the sequences' share, and fewer drafts when fewer are free); after a verification the checkpoint
// of the last row kept becomes the sequence's slot and every other slot goes back; an exit mid-step frees them too.
TEST(draft_checkpoints_come_from_their_own_slots_and_the_kept_one_becomes_the_state) {
  BlockManager bm(32, 4);
  StatePool states(5);
  Scheduler sched({8, 100, 1000, false, 0, 2}, bm, &states);  // 3 slots for sequences, 2 for checkpoints
  g_sched = &sched;
  for (int64_t id = 1; id <= 4; ++id) sched.add(make_seq(id, 5, 20));
  BatchPlan plan = sched.schedule();
  EXPECT_EQ(plan.seqs.size(), 3u);  // the fourth waits: the kept slots are not for sequences
  EXPECT_EQ(states.num_free_slots(), 2);
  advance(plan);
  Sequence* a = plan.seqs[0].seq;
  Sequence* b = plan.seqs[1].seq;
  a->draft_tokens = {3, 4, 5};
  b->draft_tokens = {6, 7};
  plan = sched.schedule();
  EXPECT_EQ(plan.seqs[0].num_draft_tokens, 2);  // as many as checkpoint slots are free
  EXPECT_EQ(plan.seqs[1].num_draft_tokens, 0);
  EXPECT_EQ(a->draft_state_slots.size(), 2u);
  EXPECT_EQ(states.num_free_slots(), 0);
  sched.verify();
  const int32_t slot = a->state_slot, second = a->draft_state_slots[1];
  // rows 0 and 1 stand (draft 3 kept, draft 4 rejected): the state as of row 1 is the second checkpoint
  a->tokens.push_back(3);
  a->tokens.push_back(9);
  sched.advance(plan.seqs[0], 2);
  for (size_t i = 1; i < plan.seqs.size(); ++i) {
    sched.advance(plan.seqs[i]);
    plan.seqs[i].seq->tokens.push_back(2);
  }
  EXPECT_EQ(a->state_slot, second);
  EXPECT(a->draft_state_slots.empty());
  EXPECT(!states.is_held(slot));
  EXPECT_EQ(states.num_free_slots(), 2);
  sched.verify();
  // every draft kept: the slot holds the state as of the last row already
  a->draft_tokens = {9, 9};
  plan = sched.schedule();
  EXPECT_EQ(plan.seqs[0].num_draft_tokens, 2);
  a->tokens.insert(a->tokens.end(), {9, 9, 1});
  sched.advance(plan.seqs[0], 3);
  EXPECT_EQ(a->state_slot, second);
  EXPECT_EQ(states.num_free_slots(), 2);
  for (size_t i = 1; i < plan.seqs.size(); ++i) {
    sched.advance(plan.seqs[i]);
    plan.seqs[i].seq->tokens.push_back(2);
  }
  // a sequence that ends mid-step gives its checkpoints back with its slot
  a->draft_tokens.clear();
  b->draft_tokens = {1, 1};
  plan = sched.schedule();
  EXPECT_EQ(b->draft_state_slots.size(), 2u);
  sched.remove(b->id);
  EXPECT_EQ(states.num_free_slots(), 3);
  sched.verify();
  for (int64_t id : sched.ids()) sched.remove(id);
  EXPECT_EQ(states.num_free_slots(), 5);
  sched.verify();
}

TEST(stateful_fork_stops_at_the_fork_position_and_copies_the_state) {
  BlockManager bm(16, 4);
  StatePool states(4);
  Scheduler sched({8, 100, 1000}, bm, &states);
  g_sched = &sched;
  FakeState fake(4);
  auto parent = make_seq(7, 10, 4);  // fork position 8: the children share blocks 0 1
  parent->num_forks = 2;
  sched.add(std::move(parent));
  BatchPlan plan = sched.schedule();
  Sequence* p = plan.seqs[0].seq;
  EXPECT_EQ(plan.seqs[0].num_tokens, 8);  // the chunk stops at the fork position
  EXPECT(!plan.seqs[0].is_sampled);
  EXPECT_EQ(p->state_slot, 0);
  EXPECT_EQ(p->fork_state_slots, (Ids{1, 2}));
  EXPECT(plan.state_copies.empty());
  EXPECT(fake.step(plan));
  advance(plan);
  plan = sched.schedule();  // from the fork position on: the state is copied into the children's slots first
  EXPECT_EQ(plan.seqs[0].start_pos, 8);
  EXPECT_EQ(plan.state_copies.size(), 2u);
  EXPECT_EQ(plan.state_copies[0].src, 0);
  EXPECT_EQ(plan.state_copies[0].dst, 1);
  EXPECT_EQ(plan.state_copies[1].dst, 2);
  EXPECT(fake.step(plan));
  sched.advance(plan.seqs[0]);
  sched.fork(p);
  p->tokens.push_back(2);
  sched.verify();
  std::vector<Sequence*> all = sched.find_request(7);
  EXPECT_EQ(all.size(), 3u);
  for (Sequence* s : all)
    if (s != p) {
      EXPECT_EQ(s->num_computed_tokens, 8);
      EXPECT(s->state_slot == 1 || s->state_slot == 2);
    }
  plan = sched.schedule();  // the children compute their tails from the copied state; nothing copied again
  EXPECT(plan.state_copies.empty());
  EXPECT(fake.step(plan));
  sched.verify();
  for (Sequence* s : sched.find_request(7)) sched.remove(s->id);
  EXPECT_EQ(states.num_free_slots(), 4);
  EXPECT_EQ(bm.num_free_blocks(), 16);
}

TEST(stateful_fork_of_a_one_block_prompt_starts_the_children_at_zero) {
  BlockManager bm(16, 4);
  StatePool states(3);
  Scheduler sched({8, 100, 1000}, bm, &states);
  FakeState fake(3);
  auto parent = make_seq(7, 3, 4);
  parent->num_forks = 2;
  sched.add(std::move(parent));
  BatchPlan plan = sched.schedule();
  Sequence* p = plan.seqs[0].seq;
  EXPECT_EQ(plan.seqs[0].num_tokens, 3);
  EXPECT(plan.seqs[0].is_sampled);
  EXPECT(fake.step(plan));
  sched.advance(plan.seqs[0]);
  sched.fork(p);
  p->tokens.push_back(2);
  plan = sched.schedule();
  EXPECT(plan.state_copies.empty());
  EXPECT_EQ(plan.seqs.size(), 3u);
  EXPECT_EQ(plan.seqs[1].start_pos, 0);
  EXPECT(fake.step(plan));
  sched.verify();
}

TEST(stateful_prefix_hits_start_from_a_snapshot_at_the_last_full_block) {
  BlockManager bm(32, 4);
  StatePool states(4);
  Scheduler sched({2, 100, 1000, true}, bm, &states);
  g_sched = &sched;
  FakeState fake(4);
  std::vector<int32_t> prompt = {5, 6, 7, 8, 9, 10, 11, 12, 13, 14};  // fork position 8: two full blocks before it
  sched.add(make_seq_tokens(1, prompt, 2));
  BatchPlan plan = sched.schedule();
  EXPECT_EQ(plan.seqs[0].num_tokens, 8);  // stops where the state is kept
  EXPECT(fake.step(plan));
  advance(plan);
  plan = sched.schedule();  // the state as of position 8 goes into a snapshot slot before the step goes on
  EXPECT_EQ(plan.state_copies.size(), 1u);
  EXPECT_EQ(plan.state_copies[0].src, 0);
  EXPECT_EQ(plan.state_copies[0].dst, 1);
  EXPECT_EQ(sched.num_state_snapshots(), 1);
  EXPECT(fake.step(plan));
  advance(plan);
  sched.remove(1);
  sched.verify();
  // the same prompt with another tail: a hit of two blocks, starting from a copy of the snapshot
  std::vector<int32_t> other = prompt;
  other.back() = 99;
  sched.add(make_seq_tokens(2, other, 2));
  plan = sched.schedule();
  EXPECT_EQ(plan.seqs[0].start_pos, 8);
  EXPECT_EQ(plan.state_copies.size(), 1u);
  EXPECT_EQ(plan.state_copies[0].src, 1);
  EXPECT_EQ(plan.state_copies[0].dst, plan.seqs[0].seq->state_slot);
  EXPECT(fake.step(plan));
  EXPECT_EQ(sched.num_prefix_hit_tokens(), 8);
  advance(plan);
  sched.verify();
  // a prompt that differs inside the first block: no hit
  std::vector<int32_t> third = prompt;
  third[1] = 77;
  sched.add(make_seq_tokens(3, third, 2));
  plan = sched.schedule();
  EXPECT_EQ(plan.seqs.back().seq->id, 3);
  EXPECT_EQ(plan.seqs.back().start_pos, 0);
  EXPECT(fake.step(plan));
  sched.verify();
  for (int64_t id : sched.ids()) sched.remove(id);
  // running sequences take the snapshots' slots when none is free
  for (int64_t id = 10; id < 12; ++id) sched.add(make_seq(id, 3, 2));
  plan = sched.schedule();
  EXPECT_EQ(plan.seqs.size(), 2u);
  EXPECT(states.num_free_slots() + sched.num_state_snapshots() + 2 == 4);
  sched.verify();
}

TEST(random_stateful_run_starts_every_chunk_from_its_own_state) {
  std::mt19937 rng(4321);
  BlockManager bm(30, 4);
  StatePool states(9);
  Scheduler sched({6, 12, 64, true}, bm, &states);
  g_sched = &sched;
  FakeState fake(9);
  std::vector<int32_t> shared(30);
  for (int i = 0; i < 30; ++i) shared[i] = 100 + i;
  int64_t next_id = 1;
  int finished = 0, forks = 0;
  for (int step = 0; step < 3000; ++step) {
    if (rng() % 3 == 0) {
      const int32_t prompt = 1 + rng() % 30, max_new = 1 + rng() % 30;
      std::vector<int32_t> toks(prompt);
      const bool share = rng() % 2;  // half share a prefix: snapshots, hits and evictions happen
      for (int32_t i = 0; i < prompt; ++i) toks[i] = share ? shared[i] : (int32_t)(rng() % 50);
      auto s = make_seq_tokens(next_id++, toks, max_new);
      s->num_forks = rng() % 4 == 0 ? 1 + rng() % 2 : 0;
      if (sched.fit_error(*s).empty()) sched.add(std::move(s));
    }
    BatchPlan plan = sched.schedule();
    EXPECT(fake.step(plan));
    for (const ScheduledSeq& s : plan.seqs) {
      sched.advance(s);
      if (s.is_sampled && s.seq->num_forks > 0 && s.seq->num_generated_tokens() == 0) sched.fork(s.seq), ++forks;
      if (s.is_sampled) s.seq->tokens.push_back((int32_t)(rng() % 50));
    }
    for (int64_t id : sched.ids()) {
      Sequence* s = sched.find(id);
      if (s->num_tokens() >= s->max_total_tokens || rng() % 60 == 0) {
        sched.remove(id);
        ++finished;
      }
    }
    sched.verify();
  }
  for (int64_t id : sched.ids()) sched.remove(id);
  EXPECT_EQ(states.num_free_slots() + sched.num_state_snapshots(), 9);
  EXPECT(sched.num_prefix_hit_tokens() > 0);
  EXPECT(finished > 100);
  EXPECT(forks > 20);
  EXPECT(sched.num_preemptions() > 0);
}

int main() { return lmkit::testing::run_all(); }
