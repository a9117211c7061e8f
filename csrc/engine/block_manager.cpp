#include "engine/block_manager.h"

#include <sstream>

#include "core/check.h"

namespace lmkit {

BlockManager::BlockManager(int32_t num_blocks, int32_t block_size_tokens)
    : num_total_(num_blocks), block_size_(block_size_tokens), active_(num_blocks, 0) {
  LMKIT_CHECK(num_blocks > 0, "the KV pool needs at least one block, got ", num_blocks);
  LMKIT_CHECK(block_size_tokens > 0, "cache_block_seq_len must be > 0, got ", block_size_tokens);
  for (int32_t i = 0; i < num_blocks; ++i) free_.insert(free_.end(), i);
}

void BlockManager::allocate(int32_t num_blocks, std::vector<int32_t>& table) {
  LMKIT_CHECK(can_allocate(num_blocks), "allocate(", num_blocks, ") with only ", num_free_blocks(), " free blocks");
  for (int32_t i = 0; i < num_blocks; ++i) {
    int32_t id = *free_.begin();
    free_.erase(free_.begin());
    active_[id] = 1;  // free -> active
    table.push_back(id);
  }
}

void BlockManager::free(std::vector<int32_t>& table) {
  for (int32_t id : table) {
    LMKIT_CHECK(id >= 0 && id < num_total_ && active_[id], "free() of block ", id, " which is not active");
    active_[id] = 0;  // active -> free
    free_.insert(id);
  }
  table.clear();
}

void BlockManager::verify() const {
  int32_t active = 0;
  for (int32_t i = 0; i < num_total_; ++i) {
    bool is_free = free_.count(i) != 0;
    LMKIT_CHECK(is_free != (active_[i] != 0), "block ", i, " is ", is_free ? "free and active" : "neither free nor active");
    active += active_[i];
  }
  LMKIT_CHECK(num_free_blocks() + active == num_total_, "free ", num_free_blocks(), " + active ", active,
              " != total ", num_total_);
}

std::string BlockManager::repr() const {
  std::ostringstream os;
  os << "BlockManager(total=" << num_total_ << ", free=" << num_free_blocks() << ", active=" << num_active_blocks()
     << ", block_size=" << block_size_ << ")";
  return os.str();
}

}  // namespace lmkit
