// Prompt pacing (engine/prompt_pacer.h) against a simulated step cost, T = D (the weights' read, any step) + A
// (the K/V a chunk reads, once per chunk) + n c: decodes beside a long prompt run at the slowdown asked on average,
// the prompt still moves and pays A once per chunk, not per step, and a prompt that ends within kFinishSeconds of
// work goes whole; with nothing decoding a step takes about
// kAloneStepSeconds of tokens (never under kMinAloneTokens), and a quarter of a chunk for the grace period after
// the last decode; off, the caps are the token budget.
#include <algorithm>
#include <cmath>

#include "engine/prompt_pacer.h"
#include "tests/testing.h"

using namespace lmkit;

namespace {

struct Cost {
  double decode = 0.010, kv_read = 0.005, token = 0.001;
  double step(int32_t decode_rows, int32_t prompt_tokens) const {
    return decode + (prompt_tokens > 0 ? kv_read + prompt_tokens * token : 0.0) + 1e-4 * decode_rows;
  }
};

}  // namespace

TEST(off_the_caps_are_the_token_budget) {
  PromptPacer pacer(8192, 0);
  EXPECT(!pacer.enabled());
  pacer.record(1, 0, 0.01);
  EXPECT_EQ(pacer.cap(true), 8192);
  EXPECT_EQ(pacer.cap(false), 8192);
}

TEST(beside_decodes_nothing_until_a_decode_step_was_timed) {
  PromptPacer pacer(8192, 2.0);
  EXPECT_EQ(pacer.cap(true), 0);
  EXPECT_EQ(pacer.cap(false), PromptPacer::kMinAloneTokens);  // alone, before any timing
  pacer.record(3, 0, 0.010);
  EXPECT(pacer.decode_seconds() > 0);
  EXPECT_EQ(pacer.cap(true), 0);  // D known; credit for one decode step, not for a chunk of kStepsPerChunk
  for (int i = 1; i < PromptPacer::kStepsPerChunk; ++i) pacer.record(3, 0, 0.010);
  EXPECT_EQ(pacer.cap(true), PromptPacer::kFirstTokens);  // a chunk paid for; the cost of a token not known yet
  PromptPacer small(8, 2.0);
  EXPECT_EQ(small.cap(false), 8);  // always within the token budget
}

TEST(decodes_beside_a_long_prompt_keep_the_speed_asked_and_the_prompt_moves) {
  for (double slowdown : {1.5, 2.0, 3.0}) {
    const Cost cost;
    PromptPacer pacer(8192, slowdown);
    pacer.record(1, 0, cost.step(1, 0));
    int32_t pending = 20000, chunks = 0;
    double seconds = 0, prompt_seconds = 0;
    int64_t steps = 0;
    while (pending > 0 && steps < 1000000) {
      const int32_t n = std::min(pacer.cap(true), pending);
      const double t = cost.step(1, n);
      pacer.record(1, n, t);
      pending -= n;
      seconds += t;
      if (n > 0) {
        prompt_seconds += t - cost.step(1, 0);
        ++chunks;
      }
      ++steps;
    }
    EXPECT_EQ(pending, 0);
    const double measured = seconds / (steps * cost.step(1, 0));  // a decode's time per token / alone
    EXPECT(std::fabs(measured - slowdown) < 0.1 * slowdown);
    // Chunks of about kStepsPerChunk decode steps of work: A is paid once per ~75 tokens, not once per token.
    EXPECT(chunks < 20000 / 50);
    EXPECT(prompt_seconds < 20000 * cost.token * 1.15);
  }
}

TEST(a_chunk_beside_decodes_waits_for_credit) {
  const Cost cost;
  PromptPacer pacer(8192, 2.0);
  for (int i = 0; i < 20; ++i) pacer.record(1, 0, cost.step(1, 0));
  EXPECT(pacer.credit_seconds() > 0);  // banked: at most one chunk
  EXPECT(pacer.credit_seconds() <= PromptPacer::kStepsPerChunk * pacer.decode_seconds() + 1e-12);
  pacer.record(1, 200, cost.step(1, 200));  // a chunk of 205 ms of work: a debt
  const double debt = pacer.credit_seconds();
  EXPECT(debt < 0);
  int32_t waited = 0;
  while (pacer.cap(true) == 0 && waited < 100) {  // decode-only steps repay it, (slowdown - 1) D each, and pay
    pacer.record(1, 0, cost.step(1, 0));       // for the next chunk before it is taken
    ++waited;
  }
  const double d = cost.step(1, 0);
  EXPECT(std::fabs(debt - (8 * d - 205e-3 + d)) < 1e-9);
  EXPECT_EQ(waited, (int32_t)std::ceil((8 * d - debt) / d - 1e-9));
  EXPECT_EQ(pacer.cap(false), std::max(1, pacer.chunk_tokens() / 4));  // nothing decodes, a moment after a decode
  pacer.record(0, 10, cost.step(0, 10));
  EXPECT(pacer.credit_seconds() <= 0);  // a step with nothing decoding ends what was banked
  for (int i = 0; i < 7; ++i) pacer.record(1, 0, d);
  EXPECT_EQ(pacer.cap(true), 0);  // so the next answer starts with none: 8 decode steps before a chunk
  pacer.record(1, 0, d);
  EXPECT(pacer.cap(true) > 0);
}

TEST(alone_steps_take_about_the_alone_time_and_never_under_the_floor) {
  for (double token : {0.0001, 0.002}) {
    Cost cost;
    cost.token = token;
    PromptPacer pacer(100000, 2.0);
    for (int i = 0; i < 20; ++i) {
      const int32_t n = pacer.cap(false);
      pacer.record(0, n, cost.step(0, n));
    }
    const int32_t n = pacer.cap(false);
    const int32_t expect = std::max<int32_t>(PromptPacer::kMinAloneTokens,
                                             (int32_t)(PromptPacer::kAloneStepSeconds / token));
    EXPECT(n >= PromptPacer::kMinAloneTokens);
    EXPECT(std::abs(n - expect) <= expect / 5);  // c is learned with D unknown: (T - 0) / n, a little high
  }
}

TEST(after_the_last_decode_chunks_stay_small_for_the_grace_period) {
  const Cost cost;
  PromptPacer pacer(100000, 2.0);
  for (int i = 0; i < 5; ++i) pacer.record(1, 0, cost.step(1, 0));
  pacer.record(1, 40, cost.step(1, 40));
  const int32_t beside =
      (int32_t)std::floor(PromptPacer::kStepsPerChunk * pacer.decode_seconds() / pacer.token_seconds());
  EXPECT_EQ(pacer.chunk_tokens(), beside);
  EXPECT_EQ(pacer.cap(false), beside / 4);  // nothing decodes now, but a decode ran a moment ago: a quarter chunk
  double since = 0;
  int32_t steps = 0;
  while (pacer.cap(false) < PromptPacer::kMinAloneTokens && steps < 1000) {
    const int32_t n = pacer.cap(false);
    const double t = cost.step(0, n);
    pacer.record(0, n, t);
    since += t;
    ++steps;
  }
  EXPECT(since >= PromptPacer::kGraceSeconds && since < PromptPacer::kGraceSeconds + 0.2);
}

TEST(a_prompt_that_ends_within_the_finish_time_goes_whole) {
  const Cost cost;  // c ~ 1 ms: a chunk (8 D ~ 81 ms of work) ~ 75 tokens, the finish time (0.25 s) ~ 230
  PromptPacer pacer(100000, 2.0);
  EXPECT_EQ(pacer.finish_tokens(), 0);  // D not known yet
  for (int i = 0; i < 8; ++i) pacer.record(1, 0, cost.step(1, 0));
  EXPECT_EQ(pacer.finish_tokens(), PromptPacer::kFirstTokens);  // c not known yet: a chunk's
  pacer.record(1, 75, cost.step(1, 75));
  const double c = pacer.token_seconds();
  EXPECT_EQ(pacer.finish_tokens(), (int32_t)std::floor(PromptPacer::kFinishSeconds / c));
  EXPECT(pacer.finish_tokens() > 2 * pacer.chunk_tokens());
  PromptPacer off(500, 0);
  EXPECT_EQ(off.finish_tokens(), 500);
}

TEST(refuses_a_slowdown_that_means_nothing) {
  EXPECT_THROWS(PromptPacer(8192, 1.0));
  EXPECT_THROWS(PromptPacer(8192, -2.0));
  EXPECT_THROWS(PromptPacer(8192, INFINITY));
  EXPECT_THROWS(PromptPacer(0, 2.0));
}

int main() { return lmkit::testing::run_all(); }
