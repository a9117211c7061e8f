#include "engine/request.h"

#include <cmath>

#include "core/check.h"

namespace lmkit {

void SamplingParams::check_invariants() const {
  LMKIT_CHECK(std::isfinite(temperature) && temperature >= 0.0f,
              "temperature must be >= 0 (0 means greedy), got ", temperature);
  LMKIT_CHECK(top_k >= 0, "top_k must be >= 0 (0 disables it), got ", top_k);
  LMKIT_CHECK(std::isfinite(top_p) && top_p > 0.0f && top_p <= 1.0f, "top_p must be in (0, 1], got ", top_p);
  LMKIT_CHECK(std::isfinite(min_p) && min_p >= 0.0f && min_p < 1.0f, "min_p must be in [0, 1), got ", min_p);
  LMKIT_CHECK(std::isfinite(repetition_penalty) && repetition_penalty > 0.0f,
              "repetition_penalty must be > 0 (1 disables it), got ", repetition_penalty);
  LMKIT_CHECK(std::isfinite(presence_penalty) && presence_penalty >= -2.0f && presence_penalty <= 2.0f,
              "presence_penalty must be in [-2, 2], got ", presence_penalty);
  LMKIT_CHECK(std::isfinite(frequency_penalty) && frequency_penalty >= -2.0f && frequency_penalty <= 2.0f,
              "frequency_penalty must be in [-2, 2], got ", frequency_penalty);
  LMKIT_CHECK(logprobs >= -1 && logprobs <= 20, "logprobs must be in [0, 20] (or -1 for none), got ", logprobs);
  LMKIT_CHECK(prompt_logprobs >= -1 && prompt_logprobs <= 20,
              "prompt_logprobs must be in [0, 20] (or -1 for none), got ", prompt_logprobs);
  LMKIT_CHECK(n >= 1, "n must be >= 1, got ", n);
  LMKIT_CHECK(max_new_tokens >= 0, "max_new_tokens must be >= 0 (0: only the prompt is computed), got ",
              max_new_tokens);
  LMKIT_CHECK(min_new_tokens >= 0 && min_new_tokens <= max_new_tokens,
              "min_new_tokens must be in [0, max_new_tokens=", max_new_tokens, "], got ", min_new_tokens);
  LMKIT_CHECK(pooling == Pooling::kNone || n == 1, "pooling (an embedding) takes n = 1, got ", n);
  LMKIT_CHECK(grammar_after_token >= -1, "grammar_after_token must be a token id (or -1: from the start), got ",
              grammar_after_token);
}

const char* finish_reason_name(FinishReason r) {
  switch (r) {
    case FinishReason::kNone: return "";
    case FinishReason::kStop: return "stop";
    case FinishReason::kLength: return "length";
    case FinishReason::kError: return "error";
    case FinishReason::kCancelled: return "cancelled";
  }
  return "";
}

const char* error_kind_name(ErrorKind k) {
  switch (k) {
    case ErrorKind::kNone: return "";
    case ErrorKind::kDoesNotFit: return "does_not_fit";
    case ErrorKind::kGrammar: return "grammar";
    case ErrorKind::kInternal: return "internal";
  }
  return "";
}

}  // namespace lmkit
