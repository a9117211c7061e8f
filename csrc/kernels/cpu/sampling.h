// Token sampling on the CPU: penalties, temperature, top-k, top-p, min-p, then a draw from the
// sequence's own generator. Plain C++ (not an ISA unit).
#pragma once
#include <stdint.h>

#include <random>

#include "engine/request.h"

namespace lmkit::ops {

// Picks the next token from logits[vocab] (modified in place) under params.
//   history: prompt + generated tokens (repetition penalty, HF semantics);
//   banned: ids whose logits become -inf (eos and stop ids before min_new_tokens).
// Order as in HF generate: repetition penalty, temperature, top-k, top-p, min-p. Greedy (temperature 0
// or top_k 1) returns the lowest index of the maximum and draws nothing from rng.
int32_t sample(float* logits, int32_t vocab, const SamplingParams& params, const int32_t* history,
               int32_t num_history, const int32_t* banned, int32_t num_banned, std::mt19937_64& rng);

}  // namespace lmkit::ops
