#include "engine/prompt_pacer.h"

#include <algorithm>
#include <cmath>

#include "core/check.h"

namespace lmkit {

PromptPacer::PromptPacer(int32_t max_tokens, double slowdown) : max_tokens_(max_tokens), slowdown_(slowdown) {
  LMKIT_CHECK(max_tokens >= 1, "max_prefill_token_num must be >= 1, got ", max_tokens);
  LMKIT_CHECK(slowdown == 0 || (slowdown > 1 && std::isfinite(slowdown)),
              "decode_slowdown must be 0 (off) or a finite number > 1, got ", slowdown);
}

double PromptPacer::token_seconds() const { return prompt_tokens_ > 0 ? prompt_seconds_ / prompt_tokens_ : 0.0; }

double PromptPacer::chunk_seconds() const {
  return std::min(kAloneStepSeconds, kStepsPerChunk * decode_seconds_);
}

void PromptPacer::record(int32_t decode_rows, int32_t prompt_tokens, double seconds) {
  if (!enabled() || !(seconds > 0) || decode_rows + prompt_tokens <= 0) return;
  if (prompt_tokens == 0) {
    const bool moved = decode_rows > 2 * decode_rows_measured_ || 2 * decode_rows < decode_rows_measured_;
    decode_seconds_ = decode_seconds_ == 0 || moved ? seconds : kDecay * decode_seconds_ + (1 - kDecay) * seconds;
    decode_rows_measured_ = decode_rows;
  } else {
    const double work = std::max(0.0, seconds - decode_seconds_);
    prompt_seconds_ = kDecay * prompt_seconds_ + work;
    prompt_tokens_ = kDecay * prompt_tokens_ + prompt_tokens;
    if (decode_rows > 0) credit_ -= work;
    if (decode_rows == 0) credit_ = std::min(credit_, 0.0);  // nothing decoded: no credit to carry to the next
  }
  since_decode_ = decode_rows > 0 ? 0.0 : since_decode_ + seconds;
  if (decode_rows > 0 && decode_seconds_ > 0) {
    // Banked credit is at most one chunk; a debt at most two (a chunk that cost more than c foretold).
    credit_ += (slowdown_ - 1) * decode_seconds_;
    credit_ = std::max(-2 * chunk_seconds(), std::min(credit_, chunk_seconds()));
  }
}

int32_t PromptPacer::chunk_tokens() const {
  if (!enabled()) return max_tokens_;
  if (decode_seconds_ == 0) return 0;
  const double c = token_seconds();
  if (c == 0) return std::min(kFirstTokens, max_tokens_);
  return (int32_t)std::max(1.0, std::min(std::floor(chunk_seconds() / c), (double)max_tokens_));
}

int32_t PromptPacer::finish_tokens() const {
  if (!enabled()) return max_tokens_;
  const double c = token_seconds();
  if (decode_seconds_ == 0 || c == 0) return chunk_tokens();
  const double n = std::floor(std::max(kFinishSeconds, chunk_seconds()) / c);
  return (int32_t)std::max(1.0, std::min(n, (double)max_tokens_));
}

int32_t PromptPacer::cap(bool beside_decodes) const {
  if (!enabled()) return max_tokens_;
  // A chunk once the credit pays for it; none: a decode-only step (the first measures D).
  if (beside_decodes) return decode_seconds_ > 0 && credit_ >= chunk_seconds() ? chunk_tokens() : 0;
  const double c = token_seconds();
  if (c == 0) return std::min(kMinAloneTokens, max_tokens_);
  if (decode_seconds_ > 0 && since_decode_ < kGraceSeconds) return std::max(1, chunk_tokens() / 4);
  return (int32_t)std::min((double)max_tokens_, std::max(std::floor(kAloneStepSeconds / c), (double)kMinAloneTokens));
}

}  // namespace lmkit
