// The blocked KV pool's bookkeeping: block states, reference counts and the prefix cache index.
// It never touches KV memory; the model runner maps block ids to memory.
//
// Block states:
//   free   -> active   allocate()                 (lowest free id first)
//   cached -> active   allocate() (evicts the least recently released cached block when no free one is left)
//   cached -> active   match_prefix() hit          (the block's K/V are reused)
//   active -> active   match_prefix() hit on a block another sequence holds (reference count + 1)
//   active -> free     release() of the last reference to a block without a prefix key
//   active -> cached   release() of the last reference to a block with a prefix key
//   cached -> cached   match_prefix() hit on a block the caller will not hold (it only gets newer in the LRU)
// release_range() drops references like release() but leaves kNoBlock (a hole) in the table: the scheduler
// frees blocks that fell out of every layer's attention window this way, before the sequence ends.
// A block gets a prefix key (publish()) once all its tokens are computed; the key is a hash chained
// over (parent key, the block's token ids), and a hit is confirmed by comparing the tokens exactly.
// Invariant, checkable at any point by verify(): num_free + num_cached + num_active == num_total.
#pragma once
#include <stdint.h>

#include <functional>
#include <set>
#include <string>
#include <unordered_map>
#include <utility>
#include <vector>

namespace lmkit {

// A block_table entry whose block was given back early (it fell out of the attention window): a hole.
constexpr int32_t kNoBlock = -1;

// Prefix key of a full block: hash of (parent key, tokens). The first block's parent is 0.
uint64_t block_key(uint64_t parent_key, const int32_t* tokens, int32_t num_tokens);

class BlockManager {
 public:
  BlockManager(int32_t num_blocks, int32_t block_size_tokens);

  int32_t num_total_blocks() const { return num_total_; }
  int32_t num_free_blocks() const { return (int32_t)free_.size(); }
  int32_t num_cached_blocks() const { return (int32_t)lru_.size(); }
  int32_t num_active_blocks() const { return num_total_ - num_free_blocks() - num_cached_blocks(); }
  // Blocks an allocation can take now: free ones and evictable cached ones.
  int32_t num_available_blocks() const { return num_free_blocks() + num_cached_blocks(); }
  int32_t block_size_tokens() const { return block_size_; }

  // Blocks needed to hold num_tokens tokens.
  int32_t num_blocks_for(int32_t num_tokens) const { return (num_tokens + block_size_ - 1) / block_size_; }
  bool can_allocate(int32_t num_blocks) const { return num_blocks <= num_available_blocks(); }

  // free|cached -> active: appends num_blocks ids to table, lowest free ids first, then evicting cached
  // blocks least recently released first (each evicted block is shown to the eviction listener first, while it
  // still holds its K/V). Requires can_allocate(num_blocks).
  void allocate(int32_t num_blocks, std::vector<int32_t>& table);
  // active -> active: one more reference to every block of table (a forked sequence shares them); holes
  // (kNoBlock) are skipped.
  void share(const std::vector<int32_t>& table);
  // Drops one reference to every block of table (last block first, so a sequence's tail is evicted
  // before its head); a block whose last reference goes becomes cached if it has a prefix key, else free.
  // Holes are skipped. table is cleared.
  void release(std::vector<int32_t>& table);
  // The same for table[begin, end) only, leaving kNoBlock in those entries (holes stay holes). Returns how
  // many blocks went back to the pool (free or cached): a block other sequences still hold is not counted.
  int32_t release_range(std::vector<int32_t>& table, int32_t begin, int32_t end);

  // Prefix cache lookup: finds the blocks holding tokens[0, k * block_size_tokens) for the largest k (at most
  // max_blocks) whose chained keys are present with exactly these tokens, and appends k entries to table:
  // the last min(k, max_live_blocks) blocks, with a reference taken to each, after kNoBlock for the ones
  // before them (confirmed by their tokens like the rest, but not taken: no query of the caller reads
  // them; those that are cached get newer in the LRU, the first block newest). Returns k. Updates
  // *last_key to the key of block k - 1.
  int32_t match_prefix(const int32_t* tokens, int32_t max_blocks, std::vector<int32_t>& table, uint64_t* last_key,
                       int32_t max_live_blocks = INT32_MAX);
  // How many blocks match_prefix(tokens, max_blocks, ...) from the first block would find, touching nothing.
  int32_t num_prefix_blocks(const int32_t* tokens, int32_t max_blocks) const;
  // Gives active block `block` (now holding exactly `tokens`, block_size_tokens of them) the prefix key
  // block_key(parent_key, tokens) and returns that key. If another block already has the key, this block
  // stays unkeyed (it will be freed, not cached, on release).
  uint64_t publish(int32_t block, uint64_t parent_key, const int32_t* tokens);

  // Called by allocate() for each cached block it evicts, before the block changes hands: its id, prefix key and
  // tokens (the disk store copies it out here, engine/kv_store.h).
  using EvictionListener = std::function<void(int32_t block, uint64_t key, const std::vector<int32_t>& tokens)>;
  void set_eviction_listener(EvictionListener listener) { on_evict_ = std::move(listener); }
  // The cached blocks, most recently released first.
  std::vector<int32_t> cached_block_ids() const;
  uint64_t key_of(int32_t block) const { return blocks_[block].key; }
  const std::vector<int32_t>& tokens_of(int32_t block) const { return blocks_[block].tokens; }

  int32_t ref_count(int32_t block) const { return blocks_[block].ref_count; }
  // The free blocks (no holder, no prefix key), lowest id first.
  std::vector<int32_t> free_block_ids() const { return std::vector<int32_t>(free_.begin(), free_.end()); }
  bool has_key(int32_t block) const { return blocks_[block].has_key; }

  // Throws lmkit::Error when the state is inconsistent (a bug).
  void verify() const;
  std::string repr() const;

 private:
  struct Block {
    int32_t ref_count = 0;
    bool has_key = false;
    uint64_t key = 0;
    uint64_t released_at = 0;     // LRU tick while cached
    std::vector<int32_t> tokens;  // the keyed content, for exact confirmation of hits
  };
  // How many blocks (k <= max_blocks) hold tokens[0, k * block size) after the block keyed *parent (0: from the
  // first): their ids into hits (when not null), the last one's key into *parent (unchanged when none).
  int32_t find_prefix(const int32_t* tokens, int32_t max_blocks, uint64_t* parent, std::vector<int32_t>* hits) const;
  void take(int32_t id);  // any state -> active (+1 reference)
  void drop(int32_t id);  // -1 reference; active -> cached|free at the last one
  void touch(int32_t id);  // cached -> cached, most recently released
  void drop_key(int32_t id);

  int32_t num_total_;
  int32_t block_size_;
  std::vector<Block> blocks_;
  std::set<int32_t> free_;                           // lowest id first
  std::set<std::pair<uint64_t, int32_t>> lru_;       // cached blocks by (released_at, id)
  std::unordered_map<uint64_t, int32_t> key_to_block_;
  uint64_t tick_ = 0;
  EvictionListener on_evict_;
};

}  // namespace lmkit
