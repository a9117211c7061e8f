// The recurrent-state pool's bookkeeping: which fixed-size state slots are held by which sequence. It never
// touches state memory; the executor maps slot ids to memory (a Gated DeltaNet layer's convolution window and
// delta-rule matrix, per layer).
//
// A slot is free or held. A running sequence of a model with recurrent layers holds one slot for itself and
// one for each completion it will fork (csrc/engine/README.md, "Recurrent state"); every way a sequence
// stops running (finish, cancel, preemption) gives them all back.
// Invariant, checkable at any point by verify(): num_free + num_held == num_total.
#pragma once
#include <stdint.h>

#include <set>
#include <vector>

namespace lmkit {

class StatePool {
 public:
  // num_slots 0: the model has no recurrent state (nothing is ever allocated).
  explicit StatePool(int32_t num_slots);

  int32_t num_total_slots() const { return (int32_t)held_.size(); }
  int32_t num_free_slots() const { return (int32_t)free_.size(); }
  int32_t num_held_slots() const { return num_total_slots() - num_free_slots(); }
  bool enabled() const { return !held_.empty(); }
  bool can_allocate(int32_t n) const { return n <= num_free_slots(); }

  // free -> held, lowest id first. Requires can_allocate(1).
  int32_t allocate();
  // held -> free; throws when the slot is not held (a double free is a bug).
  void release(int32_t slot);
  bool is_held(int32_t slot) const { return slot >= 0 && slot < num_total_slots() && held_[slot]; }

  // Throws lmkit::Error when the free set and the held flags disagree (a bug).
  void verify() const;

 private:
  std::vector<bool> held_;
  std::set<int32_t> free_;  // lowest id first
};

}  // namespace lmkit
