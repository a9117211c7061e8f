#include <vector>

#include "kernels/cpu/sampling.h"
#include "kernels/ops.h"
#include "model/backend.h"

namespace lmkit {

void take_prompt_logprobs(const Batch& batch, int64_t first, int64_t n, const float* logits, int64_t vocab,
                          StepOutput& out) {
  const std::vector<PromptLogprobRow>& rows = batch.prompt_logprob_rows;
  std::vector<float> log_z;
  std::vector<int32_t> argmax;
  size_t r = 0;
  while (r < rows.size()) {
    const int64_t i = rows[r].logit_index - first;
    if (i < 0 || i >= n) {
      ++r;
      continue;
    }
    // a run of consecutive logit rows (one prefill chunk) is normalised in one threaded call
    size_t end = r + 1;
    while (end < rows.size() && rows[end].logit_index == rows[end - 1].logit_index + 1 &&
           rows[end].logit_index - first < n)
      ++end;
    log_z.resize(end - r);
    argmax.resize(end - r);
    ops::log_sum_exp(logits + i * vocab, (int64_t)(end - r), vocab, log_z.data(), argmax.data());
    for (size_t k = r; k < end; ++k) {
      const PromptLogprobRow& row = rows[k];
      ops::SampleLogprobs lp;
      ops::token_logprobs(logits + (row.logit_index - first) * vocab, (int32_t)vocab, log_z[k - r], row.token,
                          row.num_top, &lp, argmax[k - r]);
      out.prompt_logprobs[k] = TokenLogprobs{lp.logprob, std::move(lp.top_ids), std::move(lp.top_logprobs)};
    }
    r = end;
  }
}

}  // namespace lmkit
