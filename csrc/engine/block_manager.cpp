#include "engine/block_manager.h"

#include <algorithm>

#include "core/check.h"

namespace lmkit {

uint64_t block_key(uint64_t parent_key, const int32_t* tokens, int32_t num_tokens) {
  // FNV-1a over the parent key and the token ids, then a final avalanche (splitmix64).
  uint64_t h = 1469598103934665603ull ^ parent_key;
  auto mix = [&h](uint32_t v) {
    for (int i = 0; i < 4; ++i) {
      h ^= (v >> (8 * i)) & 0xff;
      h *= 1099511628211ull;
    }
  };
  for (int32_t i = 0; i < num_tokens; ++i) mix((uint32_t)tokens[i]);
  h ^= h >> 30;
  h *= 0xbf58476d1ce4e5b9ull;
  h ^= h >> 27;
  h *= 0x94d049bb133111ebull;
  h ^= h >> 31;
  return h;
}

BlockManager::BlockManager(int32_t num_blocks, int32_t block_size_tokens)
    : num_total_(num_blocks), block_size_(block_size_tokens) {
  LMKIT_CHECK(num_blocks > 0, "the KV pool needs at least one block, got ", num_blocks);
  LMKIT_CHECK(block_size_tokens > 0, "cache_block_seq_len must be > 0, got ", block_size_tokens);
  blocks_.resize(num_blocks);
  for (int32_t i = 0; i < num_blocks; ++i) free_.insert(free_.end(), i);
}

void BlockManager::drop_key(int32_t id) {
  Block& b = blocks_[id];
  if (!b.has_key) return;
  auto it = key_to_block_.find(b.key);
  if (it != key_to_block_.end() && it->second == id) key_to_block_.erase(it);
  b.has_key = false;
  b.tokens.clear();
}

void BlockManager::take(int32_t id) {
  Block& b = blocks_[id];
  if (b.ref_count == 0) {
    if (b.has_key) {
      lru_.erase({b.released_at, id});  // cached -> active
    } else {
      free_.erase(id);  // free -> active
    }
  }
  ++b.ref_count;  // active -> active when shared
}

void BlockManager::allocate(int32_t num_blocks, std::vector<int32_t>& table) {
  LMKIT_CHECK(can_allocate(num_blocks), "allocate(", num_blocks, ") with only ", num_available_blocks(),
              " blocks available");
  for (int32_t i = 0; i < num_blocks; ++i) {
    int32_t id;
    if (!free_.empty()) {
      id = *free_.begin();  // free -> active
      free_.erase(free_.begin());
    } else {
      id = lru_.begin()->second;  // cached -> active: evict the least recently released
      lru_.erase(lru_.begin());
      if (on_evict_) on_evict_(id, blocks_[id].key, blocks_[id].tokens);
      drop_key(id);
    }
    blocks_[id].ref_count = 1;
    table.push_back(id);
  }
}

std::vector<int32_t> BlockManager::cached_block_ids() const {
  std::vector<int32_t> ids;
  ids.reserve(lru_.size());
  for (auto it = lru_.rbegin(); it != lru_.rend(); ++it) ids.push_back(it->second);
  return ids;
}

void BlockManager::share(const std::vector<int32_t>& table) {
  for (int32_t id : table) {
    if (id == kNoBlock) continue;
    LMKIT_CHECK(id >= 0 && id < num_total_ && blocks_[id].ref_count > 0, "share() of block ", id,
                " which is not active");
    ++blocks_[id].ref_count;
  }
}

void BlockManager::drop(int32_t id) {
  LMKIT_CHECK(id >= 0 && id < num_total_ && blocks_[id].ref_count > 0, "release() of block ", id,
              " which is not active");
  Block& b = blocks_[id];
  if (--b.ref_count > 0) return;  // active -> active, still shared
  if (b.has_key) {
    b.released_at = ++tick_;  // active -> cached
    lru_.insert({b.released_at, id});
  } else {
    free_.insert(id);  // active -> free
  }
}

void BlockManager::touch(int32_t id) {
  Block& b = blocks_[id];
  if (b.ref_count > 0) return;  // held by another sequence: not in the LRU
  lru_.erase({b.released_at, id});
  b.released_at = ++tick_;
  lru_.insert({b.released_at, id});
}

void BlockManager::release(std::vector<int32_t>& table) {
  for (auto it = table.rbegin(); it != table.rend(); ++it)
    if (*it != kNoBlock) drop(*it);
  table.clear();
}

int32_t BlockManager::release_range(std::vector<int32_t>& table, int32_t begin, int32_t end) {
  LMKIT_CHECK(0 <= begin && begin <= end && end <= (int32_t)table.size(), "release_range(", begin, ", ", end,
              ") of a table of ", table.size(), " blocks");
  int32_t num_returned = 0;
  for (int32_t i = end - 1; i >= begin; --i) {
    const int32_t id = table[i];
    if (id == kNoBlock) continue;
    drop(id);
    num_returned += blocks_[id].ref_count == 0;
    table[i] = kNoBlock;
  }
  return num_returned;
}

int32_t BlockManager::find_prefix(const int32_t* tokens, int32_t max_blocks, uint64_t* parent,
                                  std::vector<int32_t>* hits) const {
  int32_t k = 0;
  for (; k < max_blocks; ++k) {
    const int32_t* block_tokens = tokens + (int64_t)k * block_size_;
    const uint64_t key = block_key(*parent, block_tokens, block_size_);
    auto it = key_to_block_.find(key);
    if (it == key_to_block_.end()) break;
    const Block& b = blocks_[it->second];
    if (!std::equal(b.tokens.begin(), b.tokens.end(), block_tokens)) break;  // hash collision
    if (hits != nullptr) hits->push_back(it->second);
    *parent = key;
  }
  return k;
}

int32_t BlockManager::num_prefix_blocks(const int32_t* tokens, int32_t max_blocks) const {
  uint64_t parent = 0;
  return find_prefix(tokens, max_blocks, &parent, nullptr);
}

int32_t BlockManager::match_prefix(const int32_t* tokens, int32_t max_blocks, std::vector<int32_t>& table,
                                   uint64_t* last_key, int32_t max_live_blocks) {
  LMKIT_CHECK(max_live_blocks >= 0, "match_prefix() with max_live_blocks ", max_live_blocks);
  std::vector<int32_t> hits;
  uint64_t parent = *last_key;
  find_prefix(tokens, max_blocks, &parent, &hits);
  const int32_t matched = (int32_t)hits.size();
  const int32_t num_holes = std::max(0, matched - max_live_blocks);
  for (int32_t i = num_holes - 1; i >= 0; --i) touch(hits[i]);  // the first block ends newest, as after release()
  for (int32_t i = 0; i < matched; ++i) {
    if (i < num_holes) {
      table.push_back(kNoBlock);
    } else {
      take(hits[i]);
      table.push_back(hits[i]);
    }
  }
  *last_key = parent;
  return matched;
}

uint64_t BlockManager::publish(int32_t block, uint64_t parent_key, const int32_t* tokens) {
  Block& b = blocks_[block];
  LMKIT_CHECK(b.ref_count > 0, "publish() of block ", block, " which is not active");
  const uint64_t key = block_key(parent_key, tokens, block_size_);
  if (b.has_key) return b.key;
  if (key_to_block_.count(key)) return key;  // the same content is already cached elsewhere
  b.has_key = true;
  b.key = key;
  b.tokens.assign(tokens, tokens + block_size_);
  key_to_block_[key] = block;
  return key;
}

void BlockManager::verify() const {
  int32_t free = 0, cached = 0, active = 0;
  for (int32_t i = 0; i < num_total_; ++i) {
    const Block& b = blocks_[i];
    const bool in_free = free_.count(i) != 0;
    const bool in_lru = lru_.count({b.released_at, i}) != 0;
    if (b.ref_count > 0) {
      LMKIT_CHECK(!in_free && !in_lru, "active block ", i, " is also listed as free or cached");
      ++active;
    } else if (b.has_key) {
      LMKIT_CHECK(in_lru && !in_free, "cached block ", i, " is not in the LRU list exactly");
      ++cached;
    } else {
      LMKIT_CHECK(in_free && !in_lru, "free block ", i, " is not in the free list exactly");
      ++free;
    }
    if (b.has_key) {
      auto it = key_to_block_.find(b.key);
      LMKIT_CHECK(it != key_to_block_.end() && it->second == i, "block ", i, " has a key the index lost");
      LMKIT_CHECK((int32_t)b.tokens.size() == block_size_, "keyed block ", i, " has ", b.tokens.size(), " tokens");
    }
  }
  LMKIT_CHECK(free == num_free_blocks() && cached == num_cached_blocks(), "free/cached counts disagree");
  LMKIT_CHECK(free + cached + active == num_total_, "free ", free, " + cached ", cached, " + active ", active,
              " != total ", num_total_);
  for (const auto& kv : key_to_block_)
    LMKIT_CHECK(blocks_[kv.second].has_key && blocks_[kv.second].key == kv.first, "index entry for block ",
                kv.second, " is stale");
}

std::string BlockManager::repr() const {
  return detail::concat("BlockManager(total=", num_total_, ", free=", num_free_blocks(), ", cached=",
                        num_cached_blocks(), ", active=", num_active_blocks(), ", block_size_tokens=", block_size_, ")");
}

}  // namespace lmkit
