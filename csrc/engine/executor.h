// The engine loop's view of the model: one call runs a step. Implemented by csrc/model/ (one forward per
// architecture family over a backend); the engine core stays free of kernels so its bookkeeping is
// unit-tested anywhere.
#pragma once
#include <stdint.h>

#include <algorithm>
#include <stdexcept>
#include <vector>

#include "core/clock.h"
#include "engine/batch.h"

namespace lmkit {

class Executor {
 public:
  virtual ~Executor() = default;
  // Runs one fused forward over batch and samples its sample rows: returns the tokens, logprobs and the
  // requested logits rows (StepOutput). Reads batch only; changes nothing but the KV pool rows at batch.slots
  // and the recurrent state of the batch's slots (batch.state_copies first, then each sequence's).
  virtual StepOutput step(const Batch& batch) = 0;
  // Bytes of KV memory one block of the pool takes (all layers, K and V).
  virtual int64_t kv_bytes_per_block() const = 0;
  // Bytes of weights one decode step reads (every linear layer and the lm_head, as packed): with the
  // KV bytes, the memory traffic that bounds decode speed (benchmark/profile_generation.py's roofline).
  virtual int64_t linear_weight_bytes() const = 0;
  // The multi-token-prediction head's decoder layers the executor holds (0: none) and their bytes as stored (in
  // linear_weight_bytes, as packed, only when the head runs: runs_mtp).
  virtual int32_t mtp_num_layers() const { return 0; }
  virtual int64_t mtp_weight_bytes() const { return 0; }
  // Whether the executor runs its MTP head (speculative='mtp'): then every step keeps its rows' final hidden states
  // and mtp_step may follow it.
  virtual bool runs_mtp() const { return false; }
  // The MTP head over the rows of the step just run: row r of batch (the next token after a position of that step,
  // at that position, with its KV slot; batch.stateless) reads the final hidden state of the step's row
  // hidden_rows[r], writes the head's K/V at its slot, and batch's sample rows are sampled from the head's logits (a
  // draft of the token after next). Changes nothing else.
  virtual StepOutput mtp_step(const Batch& /*batch*/, const std::vector<int32_t>& /*hidden_rows*/) {
    throw std::logic_error("this executor has no multi-token-prediction head");
  }
  // Allocates the pool; called once by the engine before the first step.
  virtual void allocate_kv_pool(int32_t num_blocks) = 0;
  // Whether read_kv_block() / write_kv_block() work (the disk store needs them: engine/kv_store.h).
  virtual bool can_copy_kv_blocks() const { return false; }
  // Copies KV block `block` (every layer's K and V, with their scales: kv_bytes_per_block() bytes) to host memory dst
  // / from host memory src, in one layout that round-trips. Called on the loop thread between steps.
  virtual void read_kv_block(int32_t /*block*/, void* /*dst*/) const {}
  virtual void write_kv_block(int32_t /*block*/, const void* /*src*/) {}
  // Bytes of recurrent state one sequence holds (every recurrent layer's, state_pool.h); 0: the model has none.
  virtual int64_t state_bytes_per_slot() const { return 0; }
  // Allocates num_slots state slots; called once by the engine before the first step when the model has state.
  virtual void allocate_state_pool(int32_t /*num_slots*/) {}
  virtual int32_t vocab_size() const = 0;
  // Called once on the engine's loop thread before its first step (thread pools, device binding).
  virtual void bind_thread() {}
  // Called on the loop thread when the engine has been idle a while: gives the memory of what holds nothing
  // back to the OS (the pages of the free KV blocks `free_blocks`, which no sequence or prefix holds, and the
  // step's scratch). Contents there are dead; the next step touches the pages again.
  virtual void release_idle_memory(const std::vector<int32_t>& /*free_blocks*/) {}
};

// Seconds of executor.step(batch), the faster of two runs after one that warms caches and pages: how speculative
// decoding's step timings are taken (Engine::calibrate_step_cost, DraftModel::calibrate). The faster, because a
// passing stall of a loaded machine would read as the cost of more rows, which only verified drafts measure again.
inline double timed_step(Executor& executor, const Batch& batch) {
  executor.step(batch);
  double best = 0;
  for (int run = 0; run < 2; ++run) {
    const double start = steady_seconds();
    executor.step(batch);
    const double seconds = steady_seconds() - start;
    best = run == 0 ? seconds : std::min(best, seconds);
  }
  return best;
}

}  // namespace lmkit
