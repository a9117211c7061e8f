// Speculative decoding's host side: the proposers (n-gram index over a growing stream, the store of finished
// answers, a request's prediction), the adaptive switch, and the scheduler's draft rows (within the budget and the
// free blocks, never preempting; the rejected rows' blocks given back; conservation after every step of a random
// run whose verifications accept random prefixes).
#include <algorithm>
#include <cmath>
#include <memory>
#include <random>

#include "engine/scheduler.h"
#include "engine/speculative.h"
#include "tests/testing.h"

using namespace lmkit;
using Ids = std::vector<int32_t>;

namespace {

Ids lookup(const NgramIndex& index, const Ids& stream, const Ids& query, int32_t max_tokens) {
  Ids out;
  index.lookup(stream.data(), (int32_t)stream.size(), query.data(), (int32_t)query.size(), max_tokens, out);
  return out;
}

std::unique_ptr<Sequence> make_seq(int64_t id, Ids tokens, int32_t max_new) {
  auto s = std::make_unique<Sequence>();
  s->id = s->request_id = id;
  s->num_prompt_tokens = (int32_t)tokens.size();
  s->max_total_tokens = s->num_prompt_tokens + max_new;
  s->tokens = std::move(tokens);
  s->params.max_new_tokens = max_new;
  return s;
}

}  // namespace

TEST(ngram_index_continues_the_longest_suffix_at_its_latest_occurrence) {
  NgramIndex index(2, 4);
  //            0  1  2  3  4  5  6  7  8  9
  Ids stream = {5, 6, 7, 8, 9, 5, 6, 1, 2, 3};
  index.index(stream.data(), (int32_t)stream.size());
  EXPECT_EQ(lookup(index, stream, Ids{4, 5, 6}, 3), (Ids{1, 2, 3}));  // "5 6" ends at 2 and 7: the latest
  EXPECT_EQ(lookup(index, stream, Ids{9, 5, 6, 7}, 2), (Ids{8, 9}));
  // past the stream's end the continuation repeats with the period it had (here 5 tokens)
  EXPECT_EQ(lookup(index, stream, Ids{7, 8, 9}, 8), (Ids{5, 6, 1, 2, 3, 5, 6, 1}));
  EXPECT(lookup(index, stream, Ids{4, 4}, 3).empty());
  EXPECT(lookup(index, stream, Ids{5}, 3).empty());  // shorter than min_ngram
  // the longest suffix wins over a later occurrence of a shorter one
  NgramIndex other(2, 3);
  Ids two = {7, 2, 3, 4, 8, 2, 3, 5, 6};
  other.index(two.data(), (int32_t)two.size());
  EXPECT_EQ(lookup(other, two, Ids{7, 2, 3}, 2), (Ids{4, 8}));
  EXPECT_EQ(lookup(other, two, Ids{1, 2, 3}, 2), (Ids{5, 6}));
}

TEST(ngram_index_grows_and_a_periodic_continuation_repeats) {
  NgramIndex index(2, 3);
  Ids stream = {1, 2, 3, 1, 2};
  index.index(stream.data(), (int32_t)stream.size());
  EXPECT_EQ(index.num_indexed(), 5);
  // "1 2" ended at 2 (continuation 3, 1, 2, then what was proposed: 3, 1, ...)
  EXPECT_EQ(lookup(index, stream, stream, 7), (Ids{3, 1, 2, 3, 1, 2, 3}));
  stream.push_back(4);  // the n-grams ending at 5 get a continuation
  index.index(stream.data(), (int32_t)stream.size());
  EXPECT_EQ(lookup(index, stream, Ids{3, 1, 2}, 2), (Ids{4, 4}));  // "3 1 2" ends at 5, one before the end: period 1
  // a stream's own suffix is never matched at its own end: the n-grams ending at the last position are not indexed
  Ids fresh = {7, 8, 9};
  NgramIndex other(2, 2);
  other.index(fresh.data(), 3);
  EXPECT(lookup(other, fresh, fresh, 4).empty());
}

TEST(answer_store_finds_earlier_answers_and_drops_the_oldest) {
  AnswerStore store(20, 2, 3);
  Ids a = {10, 11, 12, 13, 14, 15}, b = {20, 21, 22, 23, 24, 25};
  store.add(a.data(), 6);
  store.add(b.data(), 6);
  Ids out;
  EXPECT_EQ(store.lookup(Ids{9, 10, 11}.data(), 3, 8, out), 4);
  EXPECT_EQ(out, (Ids{12, 13, 14, 15}));  // stops at the answer's end, never into the next one
  Ids c = {30, 31, 32, 33, 34, 35, 36, 37, 38};
  store.add(c.data(), 9);  // 7 + 7 + 10 > 20: the oldest go
  out.clear();
  EXPECT_EQ(store.lookup(Ids{10, 11}.data(), 2, 8, out), 0);
  EXPECT(store.num_tokens() <= 20);
  EXPECT_EQ(store.lookup(Ids{31, 32}.data(), 2, 3, out), 3);
  EXPECT_EQ(out, (Ids{33, 34, 35}));
}

TEST(prediction_follows_the_output_through_a_replacement_and_an_insertion) {
  //                  0   1   2   3   4   5   6   7
  Ids prediction = {40, 41, 42, 43, 44, 45, 46, 47};
  PredictionLookup p(prediction, 2, 3);
  Ids tokens = {1, 2, 3, 40};  // prompt 1 2 3, first output token 40: the prediction's start
  Ids out;
  EXPECT_EQ(p.propose(tokens.data(), 4, 1, 3, out), 3);
  EXPECT_EQ(out, (Ids{41, 42, 43}));
  // 41 42 kept, then 99 instead of 43: a replaced token; the prediction goes on after it
  tokens.insert(tokens.end(), {41, 42, 99});
  out.clear();
  EXPECT_EQ(p.propose(tokens.data(), 7, 4, 3, out), 3);
  EXPECT_EQ(out, (Ids{44, 45, 46}));
  // 44 kept, then an insertion (77 78): nothing lines up
  tokens.insert(tokens.end(), {44, 77, 78});
  out.clear();
  EXPECT_EQ(p.propose(tokens.data(), 10, 7, 3, out), 0);
  // the output comes back to the prediction ("45 46"): realigned after it, never past its end
  tokens.insert(tokens.end(), {45, 46});
  out.clear();
  EXPECT_EQ(p.propose(tokens.data(), 12, 9, 8, out), 1);
  EXPECT_EQ(out, (Ids{47}));
  // an output that does not start like the prediction gets nothing until an n-gram lines up
  PredictionLookup q(prediction, 2, 3);
  Ids other = {1, 2, 3, 7};
  out.clear();
  EXPECT_EQ(q.propose(other.data(), 4, 1, 3, out), 0);
}

TEST(adaptive_switch_turns_a_proposer_off_and_probes) {
  SpeculativeConfig c;
  SpecState s(c, {});
  EXPECT(std::abs(s.acceptance(kDraftNgram) - 0.75f) < 1e-6f);  // an optimistic start
  for (int i = 0; i < 10; ++i) s.record(kDraftNgram, 8, 8);
  EXPECT(s.acceptance(kDraftNgram) > 0.95f);
  for (int i = 0; i < 30; ++i) s.record(kDraftNgram, 8, 1);  // one kept, the second rejected: a = 1/2
  EXPECT(std::abs(s.acceptance(kDraftNgram) - 0.5f) < 0.05f);
  EXPECT_EQ(s.draft_budget(kDraftNgram, 8), 8);
  for (int i = 0; i < 10; ++i) s.record(kDraftAnswers, 4, 0);  // always wrong
  int asked = 0;
  for (int step = 0; step < 4 * SpecState::kProbeInterval; ++step) asked += s.draft_budget(kDraftAnswers, 8) > 0 ? 1 : 0;
  EXPECT_EQ(asked, 4);  // a probe every kProbeInterval steps, nothing else
  EXPECT_EQ(s.draft_budget(kDraftAnswers, 8), 0);
  EXPECT_EQ(s.draft_budget(kDraftNgram, 8), 8);  // the other proposer goes on
}

// The MTP head drafts after a step only for sequences whose next draft_budget will be > 0 (Engine::run_mtp):
// will_propose must predict it exactly, through switch-offs, probes and recoveries.
TEST(will_propose_predicts_the_next_budget) {
  SpeculativeConfig c;
  SpecState s(c, {});
  std::mt19937 rng(3);
  int probes = 0, on = 0;
  for (int step = 0; step < 2000; ++step) {
    const bool predicted = s.will_propose(kDraftMtp);
    const int32_t budget = s.draft_budget(kDraftMtp, 1);
    EXPECT_EQ(predicted, budget > 0);
    if (budget > 0) {
      ++(s.acceptance(kDraftMtp) < SpecState::kOffBelow ? probes : on);
      // long runs of misses (switched off) and of hits (switched on again)
      const bool hit = (step / 200) % 2 == 1 ? rng() % 10 < 8 : rng() % 20 == 0;
      s.record(kDraftMtp, 1, hit ? 1 : 0);
    }
  }
  EXPECT(probes > 10 && on > 100);
}

TEST(step_cost_interpolates_and_extrapolates) {
  StepCost cost(64);
  EXPECT(cost.seconds(4) == 0.0);
  cost.record(1, 1.0);
  cost.record(5, 2.0);
  EXPECT(std::abs(cost.seconds(3) - 1.5) < 1e-9);          // on the line between 1 and 5 rows
  EXPECT(std::abs(cost.seconds(10) - 2.0 * 1.25) < 1e-9);  // 5 rows more than 5: a quarter of proportional growth
  cost.record(5, 3.0);                                      // an average: 0.8 * 2 + 0.2 * 3
  EXPECT(std::abs(cost.seconds(5) - 2.2) < 1e-9);
}

TEST(drafts_are_taken_while_they_pay) {
  StepCost flat(64), steep(64);
  for (int r = 1; r <= 32; ++r) {
    flat.record(r, 1.0 + 0.02 * r);  // bandwidth-bound: a row costs 2% of a step
    steep.record(r, 1.0 * r);        // compute-bound: a row costs a step
  }
  using C = std::vector<DraftCandidate>;
  // batch 1, acceptance 0.9: all 8 drafts pay on the flat cost, none on the steep one (but a probe's)
  EXPECT_EQ(choose_drafts(C{{0.9f, 8, 0}}, 1, 32, flat), (Ids{8}));
  EXPECT_EQ(choose_drafts(C{{0.9f, 8, 0}}, 1, 32, steep), (Ids{0}));
  // probes: taken where their rows cost little (2 rows: 4% of the step), not where a row costs a step
  EXPECT_EQ(choose_drafts(C{{0.0f, 8, 2}}, 1, 32, flat), (Ids{2}));
  EXPECT_EQ(choose_drafts(C{{0.0f, 8, 2}}, 1, 32, steep), (Ids{0}));
  EXPECT_EQ(choose_drafts(C{{0.0f, 8, 2}, {0.0f, 8, 2}}, 2, 32, flat), (Ids{2, 0}));  // both: 8%, so one
  // a poor proposer gets fewer than a good one; the step's draft rows are capped
  const Ids both = choose_drafts(C{{0.9f, 8, 0}, {0.2f, 8, 0}}, 2, 32, flat);
  EXPECT(both[0] == 8 && both[1] < 3);
  const Ids capped = choose_drafts(C{{0.9f, 8, 0}, {0.9f, 8, 0}}, 2, 5, flat);
  EXPECT_EQ(capped[0] + capped[1], 5);
  // nothing measured yet: only probes
  EXPECT_EQ(choose_drafts(C{{0.9f, 8, 0}, {0.1f, 3, 2}}, 2, 32, StepCost(64)), (Ids{0, 2}));
}

TEST(a_draft_model_drafts_while_its_passes_pay) {
  StepCost flat(64), steep(64), cheap(64), dear(64);
  for (int r = 1; r <= 32; ++r) {
    flat.record(r, 1.0 + 0.02 * r);  // the target: bandwidth-bound
    steep.record(r, 1.0 * r);        // compute-bound
    cheap.record(r, 0.05);           // draft passes of 5% of a target step
    dear.record(r, 1.0);             // as dear as a target step
  }
  using C = std::vector<DraftCandidate>;
  // acceptance 0.9 and cheap passes: deep drafts (each pass 5%: the expected tokens per second peak near depth 8)
  const Ids deep = choose_model_drafts(C{{0.9f, 8, 0}}, 1, 32, flat, cheap);
  EXPECT(deep[0] >= 6);
  // passes as dear as a step: (1 + 0.9 + ...) / (1.02 d + d) never beats 1 / 1.02
  EXPECT_EQ(choose_model_drafts(C{{0.9f, 8, 0}}, 1, 32, flat, dear), (Ids{0}));
  // a compute-bound target: none
  EXPECT_EQ(choose_model_drafts(C{{0.9f, 8, 0}}, 1, 32, steep, cheap), (Ids{0}));
  // a probe is taken even where drafting does not pay, at its depth
  EXPECT_EQ(choose_model_drafts(C{{0.0f, 8, 2}}, 1, 32, flat, dear), (Ids{2}));
  // a poor proposer's sequence drafts less deep than a good one's
  const Ids two = choose_model_drafts(C{{0.9f, 8, 0}, {0.3f, 8, 0}}, 2, 32, flat, cheap);
  EXPECT(two[0] >= 4 && two[1] < two[0]);
  // nothing measured: only probes
  EXPECT_EQ(choose_model_drafts(C{{0.9f, 8, 0}, {0.1f, 3, 2}}, 2, 32, flat, StepCost(64)), (Ids{0, 2}));
  // 32 streams on a compute-bound step: none, but the two switched-off sequences' probes (a draft kept 0.8 of the
  // time adds less than the step's 0.89 tokens a row)
  C many(32, DraftCandidate{0.8f, 8, 0});
  many[3] = many[20] = DraftCandidate{0.05f, 2, 2};
  Ids probes(32, 0);
  probes[3] = probes[20] = 2;
  StepCost steep64(64);
  for (int r = 1; r <= 64; ++r) steep64.record(r, 1.0 * r);
  EXPECT_EQ(choose_model_drafts(many, 32, 32, steep64, cheap), probes);
  // the depth that pays best, not the first that pays: with passes of 30% of a step depth 1 pays (1.95 tokens in
  // 1.34 steps) and depth 8 most (7.39 in 3.58)
  StepCost mid(64);
  for (int r = 1; r <= 32; ++r) mid.record(r, 0.3);
  EXPECT_EQ(choose_model_drafts(C{{0.95f, 8, 0}}, 1, 32, flat, mid), (Ids{8}));
}

TEST(a_long_catch_up_waits_until_the_tokens_without_drafts_would_have_saved_a_quarter_of_it) {
  StepCost flat(64), cheap(64), dear(64);
  for (int r = 1; r <= 32; ++r) flat.record(r, 1.0 + 0.02 * r), cheap.record(r, 0.05), dear.record(r, 1.0);
  // acceptance 0.9, passes of 5%: depth 8 gives 6.13 tokens in 1.18 + 0.4 steps: 1.02 - 1.58 / 6.13 = 0.762 saved
  const double saving = draft_saving_per_token(0.9f, 8, flat, cheap);
  EXPECT(std::fabs(saving - (1.02 - 1.58 / ((1 - std::pow(0.9, 9)) / 0.1))) < 1e-5);  // (0.9f)
  EXPECT_EQ(draft_saving_per_token(0.9f, 8, flat, dear), 0.0);  // passes as dear as a step never save
  EXPECT_EQ(draft_saving_per_token(0.0f, 8, flat, cheap), 0.0);
  EXPECT_EQ(draft_saving_per_token(0.9f, 8, flat, StepCost(64)), -1.0);  // unmeasured
  // a catch-up of 10 steps with 0.5 saved a token: once 5 tokens without drafts would have saved a quarter of it
  EXPECT(!worth_catching_up(10.0, 0.5, 4, 100));
  EXPECT(worth_catching_up(10.0, 0.5, 5, 100));
  EXPECT(!worth_catching_up(10.0, 0.5, 40, 19));  // 19 tokens left could not repay it
  EXPECT(worth_catching_up(0.4, 0.5, 1, 100));    // a short context: at once
  EXPECT(worth_catching_up(0.0, 0.0, 1, 100));    // a state one row behind: as drafting as before
  EXPECT(!worth_catching_up(10.0, 0.0, 1000, 1000));
  EXPECT(worth_catching_up(10.0, -1.0, 1, 100));  // unmeasured: at once
}

TEST(drafts_join_a_decode_within_the_budget_and_rejected_blocks_go_back) {
  BlockManager bm(8, 4);
  Scheduler sched(SchedulerConfig{4, 6, 64, false, 0}, bm);
  sched.add(make_seq(1, Ids{1, 2, 3}, 20));
  BatchPlan plan = sched.schedule();  // the prompt
  sched.advance(plan.seqs[0]);
  Sequence* seq = sched.find(1);
  seq->tokens.push_back(4);  // sampled: 4 tokens, 3 computed, one block
  seq->draft_tokens = {5, 6, 7, 8, 9, 10, 11, 12};
  plan = sched.schedule();
  EXPECT_EQ(plan.seqs.size(), 1u);
  EXPECT_EQ(plan.seqs[0].num_draft_tokens, 6);  // the budget of 6
  EXPECT_EQ(plan.seqs[0].num_tokens, 7);
  EXPECT_EQ(plan.num_draft_tokens, 6);
  EXPECT_EQ(seq->block_table.size(), 3u);  // positions up to 9: three blocks
  // two drafts kept, then a third token: rows 0..2 stand, the third block goes back
  seq->tokens.insert(seq->tokens.end(), {5, 6, 30});
  sched.advance(plan.seqs[0], 3);
  EXPECT_EQ(seq->num_computed_tokens, 6);
  EXPECT_EQ(seq->block_table.size(), 2u);
  EXPECT_EQ(bm.num_free_blocks(), 6);
  sched.verify();
}

TEST(drafts_take_only_free_blocks_and_never_preempt) {
  BlockManager bm(3, 4);
  Scheduler sched(SchedulerConfig{4, 64, 64, false, 0}, bm);
  sched.add(make_seq(1, Ids{1, 2}, 8));
  sched.add(make_seq(2, Ids(7, 1), 2));
  BatchPlan plan = sched.schedule();  // both prompts: 1 + 2 blocks, none left
  EXPECT_EQ(plan.seqs.size(), 2u);
  for (const ScheduledSeq& s : plan.seqs) {
    sched.advance(s);
    s.seq->tokens.push_back(3);
  }
  EXPECT_EQ(bm.num_free_blocks(), 0);
  Sequence* seq = sched.find(1);
  seq->draft_tokens = {5, 6, 7, 8, 9};
  plan = sched.schedule();
  EXPECT_EQ(sched.num_preemptions(), 0);
  EXPECT_EQ(plan.seqs[0].seq, seq);
  EXPECT_EQ(plan.seqs[0].num_draft_tokens, 1);  // 3 tokens in a table of 4 positions
  sched.advance(plan.seqs[0], 1);               // the draft rejected
  seq->tokens.push_back(9);
  sched.advance(plan.seqs[1]);
  sched.verify();
}

TEST(a_parent_still_to_fork_takes_no_drafts) {
  // Its prompt's last token alone (a chunk cut there): a decode-shaped step, but its completions fork from that
  // row's sample, so no drafts join it; its completions take them later.
  BlockManager bm(8, 4);
  Scheduler sched(SchedulerConfig{4, 64, 64, false, 0}, bm);
  auto parent = make_seq(1, Ids{1, 2, 3, 4, 5}, 6);
  parent->num_forks = 1;
  sched.add(std::move(parent));
  BatchPlan plan = sched.schedule(PromptCaps{4, 4, 0, 0, true});  // 4 of 5 prompt tokens
  sched.advance(plan.seqs[0]);
  Sequence* seq = sched.find(1);
  seq->draft_tokens = {6, 7};
  plan = sched.schedule();
  EXPECT_EQ(plan.seqs[0].num_tokens, 1);
  EXPECT(plan.seqs[0].is_sampled);
  EXPECT_EQ(plan.seqs[0].num_draft_tokens, 0);
  sched.advance(plan.seqs[0]);
  sched.fork(seq);
  seq->tokens.push_back(6);
  plan = sched.schedule();  // forked: the parent decodes with its drafts now
  EXPECT_EQ(plan.seqs[0].seq, seq);
  EXPECT_EQ(plan.seqs[0].num_draft_tokens, 2);
  sched.verify();
}

TEST(drafts_stay_within_the_token_limit) {
  BlockManager bm(8, 4);
  Scheduler sched(SchedulerConfig{4, 64, 64, false, 0}, bm);
  sched.add(make_seq(1, Ids{1, 2, 3}, 3));  // at most 6 tokens
  BatchPlan plan = sched.schedule();
  sched.advance(plan.seqs[0]);
  Sequence* seq = sched.find(1);
  seq->tokens.push_back(4);
  seq->draft_tokens = {5, 6, 7, 8};
  plan = sched.schedule();
  EXPECT_EQ(plan.seqs[0].num_draft_tokens, 2);  // 4 tokens: two drafts make 6 (the last row's sample is dropped)
}

TEST(random_verifications_conserve_blocks_every_step) {
  std::mt19937 rng(7);
  for (bool caching : {false, true}) {
    BlockManager bm(24, 4);
    Scheduler sched(SchedulerConfig{6, 16, 96, caching, 0}, bm);
    int64_t next = 1;
    for (int step = 0; step < 400; ++step) {
      if (rng() % 3 == 0 && sched.num_waiting() < 4) {
        Ids prompt(1 + rng() % 12);
        for (auto& t : prompt) t = (int32_t)(rng() % 5);
        sched.add(make_seq(next++, prompt, 1 + (int32_t)(rng() % 30)));
      }
      for (Sequence* s : sched.running()) {
        s->draft_tokens.clear();
        for (int k = (int)(rng() % 6); k > 0; --k) s->draft_tokens.push_back((int32_t)(rng() % 5));
      }
      BatchPlan plan = sched.schedule();
      std::vector<int64_t> done;
      for (const ScheduledSeq& s : plan.seqs) {
        Sequence* seq = s.seq;
        if (s.num_draft_tokens == 0) {
          sched.advance(s);
          if (s.is_sampled) seq->tokens.push_back((int32_t)(rng() % 5));
        } else {
          const int32_t kept = (int32_t)(rng() % (s.num_draft_tokens + 1));  // drafts accepted
          seq->tokens.insert(seq->tokens.end(), seq->draft_tokens.begin(), seq->draft_tokens.begin() + kept);
          seq->tokens.push_back((int32_t)(rng() % 5));
          sched.advance(s, kept + 1);
        }
        if (seq->num_tokens() >= seq->max_total_tokens || rng() % 40 == 0) done.push_back(seq->id);
      }
      for (int64_t id : done) sched.remove(id);
      sched.verify();
      for (const Sequence* s : sched.running())
        EXPECT((int32_t)s->block_table.size() <= bm.num_blocks_for(s->num_tokens()));
    }
  }
}

int main() { return lmkit::testing::run_all(); }
