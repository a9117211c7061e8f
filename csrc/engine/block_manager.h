// The blocked KV pool's bookkeeping: which block ids are free and which are owned by sequences.
// It never touches KV memory; the model runner maps block ids to memory.
//
// Block states (this issue: free and active; prefix caching adds cached):
//   free -> active   allocate()
//   active -> free   free()
// Invariant, checkable at any point by verify(): num_free + num_active == num_total.
#pragma once
#include <stdint.h>

#include <set>
#include <string>
#include <vector>

namespace lmkit {

class BlockManager {
 public:
  BlockManager(int32_t num_blocks, int32_t block_size_tokens);

  int32_t num_total_blocks() const { return num_total_; }
  int32_t num_free_blocks() const { return (int32_t)free_.size(); }
  int32_t num_active_blocks() const { return num_total_ - num_free_blocks(); }
  int32_t block_size_tokens() const { return block_size_; }

  // Blocks needed to hold num_tokens tokens.
  int32_t num_blocks_for(int32_t num_tokens) const { return (num_tokens + block_size_ - 1) / block_size_; }
  bool can_allocate(int32_t num_blocks) const { return num_blocks <= num_free_blocks(); }

  // free -> active: the num_blocks lowest free ids, appended to table. Requires can_allocate(num_blocks).
  void allocate(int32_t num_blocks, std::vector<int32_t>& table);
  // active -> free: every id in table (must be active, no repeats); table is cleared.
  void free(std::vector<int32_t>& table);

  // Throws lmkit::Error when the state is inconsistent (a bug).
  void verify() const;
  std::string repr() const;

 private:
  int32_t num_total_;
  int32_t block_size_;
  std::set<int32_t> free_;      // lowest id first: allocation order is deterministic
  std::vector<uint8_t> active_;  // per block: 1 when owned by a sequence
};

}  // namespace lmkit
