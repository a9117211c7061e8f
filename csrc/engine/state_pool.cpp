#include "engine/state_pool.h"

#include "core/check.h"

namespace lmkit {

StatePool::StatePool(int32_t num_slots) {
  LMKIT_CHECK(num_slots >= 0, "the state pool needs >= 0 slots, got ", num_slots);
  held_.assign(num_slots, false);
  for (int32_t i = 0; i < num_slots; ++i) free_.insert(free_.end(), i);
}

int32_t StatePool::allocate() {
  LMKIT_CHECK(!free_.empty(), "no free state slot (", num_total_slots(), " in the pool)");
  const int32_t slot = *free_.begin();
  free_.erase(free_.begin());
  held_[slot] = true;
  return slot;
}

void StatePool::release(int32_t slot) {
  LMKIT_CHECK(is_held(slot), "state slot ", slot, " is not held (", num_total_slots(), " in the pool)");
  held_[slot] = false;
  free_.insert(slot);
}

void StatePool::verify() const {
  int32_t held = 0;
  for (bool h : held_) held += h;
  LMKIT_CHECK(held + num_free_slots() == num_total_slots(), "state pool: ", held, " held + ", num_free_slots(),
              " free != ", num_total_slots());
  for (int32_t s : free_) LMKIT_CHECK(s >= 0 && s < num_total_slots() && !held_[s], "state slot ", s, " is free and held");
}

}  // namespace lmkit
