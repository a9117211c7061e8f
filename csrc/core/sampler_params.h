// What the token sampler reads of a request: the distribution to draw from (penalties, temperature, filters)
// and how many alternatives' logprobs to report. The engine's SamplingParams (engine/request.h) is this plus
// the rest of a request; the samplers (kernels/cpu/sampling.h, and the CUDA backend's copy into its own
// SampleParams) take it as it is, so kernels need no engine header.
#pragma once
#include <stdint.h>

namespace lmkit {

struct SamplerParams {
  float temperature = 1.0f;         // 0 -> greedy (the one encoding: lmkit/messages.py maps top_k 1 to it)
  int32_t top_k = 0;                // 0 -> off
  float top_p = 1.0f;               // (0, 1]
  float min_p = 0.0f;               // [0, 1)
  float repetition_penalty = 1.0f;  // HF semantics: logit > 0 ? logit / p : logit * p over prompt + output
  float presence_penalty = 0.0f;    // OpenAI semantics over output tokens: logit -= presence * (count > 0)
  float frequency_penalty = 0.0f;   //                                       logit -= frequency * count
  int32_t logprobs = -1;            // -1: off; k >= 0: each output token's logprob and the k most likely others
  bool is_greedy() const { return temperature == 0.0f; }
};

}  // namespace lmkit
