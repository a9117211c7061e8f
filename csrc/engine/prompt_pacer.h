// Prompt pacing: how many prompt tokens the next step may take, from the times of the steps before it.
//
// Every sequence in a step waits for the whole step. A decode-only step costs about one read of the weights
// (D); a step that also computes prompt tokens adds their share of the weights' FLOPs, their attention and a
// read of the K/V they attend to (on a CPU a chunk at 8k tokens of context reads as much K/V as a small model
// has weights). Taken whole, one 8,000-token prompt stalls every decode for seconds (minutes for a large model
// on a CPU). So prompt work is sized by time:
//   - beside decodes, a time budget: every step with decodes earns (slowdown - 1) D of credit, and a step that
//     carries prompt tokens spends what they cost (its time less D). A step takes a chunk of about
//     kStepsPerChunk D of work (at most kAloneStepSeconds) once the credit pays for one, and none otherwise:
//     decodes keep 1 / slowdown of their speed on average (slowdown 2: half), also over a short answer (it starts
//     with no credit: a step with nothing decoding ends what was banked), and chunks are large enough that the
//     K/V read is paid once per chunk, not once per step. A request's first chunk, and a prompt that ends within
//     kFinishSeconds of work, do not wait for credit (a request starts at once, and prompts of ordinary length
//     go as they would unpaced; the cost is charged, so the long prompts beside them wait): pacing holds back
//     only what stalls decodes for long;
//   - with nothing decoding, about kAloneStepSeconds of prompt tokens a step, never under kMinAloneTokens (the
//     GEMMs stay efficient: chunks of 128+ tokens cost a long prompt no time on the CPU kernels), so a request
//     arriving during a long prompt waits one short step, not the whole prompt; for kGraceSeconds of steps after
//     the last decode, a quarter of a chunk beside decodes (a client that sends its next request when an answer
//     ends finds a short step in flight).
// D is an average of decode-only steps, the cost of a prompt token (c) one of (T - D) / n over the steps with
// prompt tokens, weighted by n. Until D is known a step beside decodes takes no prompt token (it measures D).
// slowdown 0 turns pacing off: the caps are the token budget.
#pragma once
#include <stdint.h>

namespace lmkit {

class PromptPacer {
 public:
  static constexpr double kAloneStepSeconds = 0.1;
  static constexpr int32_t kMinAloneTokens = 128;
  static constexpr int32_t kFirstTokens = 16;  // a chunk beside decodes before c is known
  static constexpr double kStepsPerChunk = 8;
  static constexpr double kGraceSeconds = 0.25;
  static constexpr double kFinishSeconds = 0.25;
  static constexpr double kDecay = 0.7;  // of the averages, per step measured

  // max_tokens: the token budget of a step (max_prefill_token_num); slowdown: see above (0: off).
  PromptPacer(int32_t max_tokens, double slowdown);

  bool enabled() const { return slowdown_ > 0; }
  // After a step ran: its decode rows (drafts included), its prompt tokens and its wall time.
  void record(int32_t decode_rows, int32_t prompt_tokens, double seconds);
  // Prompt tokens the next step may take at most, beside decodes or with none running.
  int32_t cap(bool beside_decodes) const;
  // The tokens of one chunk beside decodes whatever the credit (0 until D is known): PromptCaps::chunk.
  int32_t chunk_tokens() const;
  // The tokens of kFinishSeconds of prompt work (at least a chunk; 0 until D is known): PromptCaps::finish.
  int32_t finish_tokens() const;

  double decode_seconds() const { return decode_seconds_; }  // D, 0 until measured
  double token_seconds() const;                                 // c, 0 until measured
  double credit_seconds() const { return credit_; }

 private:
  double chunk_seconds() const;  // the prompt work of a step beside decodes

  int32_t max_tokens_;
  double slowdown_;
  double decode_seconds_ = 0;
  int32_t decode_rows_measured_ = 0;  // the decode rows of the step D was last measured on
  double prompt_seconds_ = 0, prompt_tokens_ = 0;  // decayed sums of T - D and n
  double credit_ = 0;
  double since_decode_ = 1e30;  // seconds of steps since the last one with decode rows
};

}  // namespace lmkit
