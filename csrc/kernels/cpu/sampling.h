// Token sampling on the CPU: penalties, temperature, top-k, top-p, min-p, then a draw from the
// sequence's own generator. Plain C++ (not an ISA unit).
#pragma once
#include <stdint.h>

#include <random>
#include <vector>

#include "core/sampler_params.h"

namespace lmkit::ops {

// What sample() reports besides the token, when params.logprobs >= 0.
struct SampleLogprobs {
  float logprob = 0;  // of the chosen token
  std::vector<int32_t> top_ids;
  std::vector<float> top_logprobs;
};

// The log-softmax of logits[vocab] at `chosen` and at its k best entries (ties: lower id first, NaN never),
// given log_z = log_sum_exp of the row and, when >= 0, its argmax (both from ops::log_sum_exp; k = 1 then
// reads no more of the row).
void token_logprobs(const float* logits, int32_t vocab, float log_z, int32_t chosen, int32_t k, SampleLogprobs* out,
                    int32_t argmax = -1);

// Picks the next token from logits[vocab] (modified in place) under params.
//   history: prompt + generated tokens, the first num_prompt of them the prompt (repetition penalty over
//   all, HF semantics; presence/frequency penalties over the generated ones, OpenAI semantics);
//   banned: ids whose logits become -inf (eos and stop ids before min_new_tokens);
//   allowed: a grammar's token mask (bit i of word i / 32 set = id i allowed), the others become -inf; null: all.
// Order: allowed, banned, repetition, presence/frequency, [logprobs taken here: log-softmax of the penalised
// logits, before temperature and filters], temperature, top-k, top-p, min-p. Greedy (temperature 0)
// returns the lowest index of the maximum and draws nothing from rng.
int32_t sample(float* logits, int32_t vocab, const SamplerParams& params, const int32_t* history,
               int32_t num_history, int32_t num_prompt, const int32_t* banned, int32_t num_banned,
               const uint32_t* allowed, std::mt19937_64& rng, SampleLogprobs* logprobs);

}  // namespace lmkit::ops
