// Block manager bookkeeping: exact block ids, free-list order, conservation, misuse detected, holes
// (blocks released early, kNoBlock in the table) skipped by every walk.
#include "engine/block_manager.h"
#include "tests/testing.h"

using namespace lmkit;
using Ids = std::vector<int32_t>;

TEST(allocates_lowest_free_ids_in_order) {
  BlockManager bm(8, 16);
  Ids a, b;
  bm.allocate(3, a);
  bm.allocate(2, b);
  EXPECT_EQ(a, (Ids{0, 1, 2}));
  EXPECT_EQ(b, (Ids{3, 4}));
  EXPECT_EQ(bm.num_free_blocks(), 3);
  EXPECT_EQ(bm.num_active_blocks(), 5);
  bm.verify();
}

TEST(freed_ids_are_reused_lowest_first) {
  BlockManager bm(6, 4);
  Ids a, b, c;
  bm.allocate(2, a);  // 0 1
  bm.allocate(2, b);  // 2 3
  bm.release(a);         // 0 1 free again
  EXPECT(a.empty());
  bm.allocate(3, c);  // 0 1 4
  EXPECT_EQ(c, (Ids{0, 1, 4}));
  EXPECT_EQ(bm.num_free_blocks(), 1);
  bm.release(b);
  bm.release(c);
  EXPECT_EQ(bm.num_free_blocks(), 6);
  bm.verify();
}

TEST(blocks_for_tokens_rounds_up) {
  BlockManager bm(4, 16);
  EXPECT_EQ(bm.num_blocks_for(0), 0);
  EXPECT_EQ(bm.num_blocks_for(1), 1);
  EXPECT_EQ(bm.num_blocks_for(16), 1);
  EXPECT_EQ(bm.num_blocks_for(17), 2);
}

TEST(over_allocation_and_double_free_are_refused) {
  BlockManager bm(3, 8);
  Ids a;
  EXPECT(!bm.can_allocate(4));
  EXPECT_THROWS(bm.allocate(4, a));
  EXPECT(a.empty());
  bm.allocate(2, a);
  Ids copy = a;
  bm.release(a);
  EXPECT_THROWS(bm.release(copy));  // already free
  Ids bogus{7};
  EXPECT_THROWS(bm.release(bogus));
  bm.verify();
  EXPECT_EQ(bm.num_free_blocks(), 3);
}

namespace {
std::vector<int32_t> tokens_of(int32_t first, int32_t n) {
  std::vector<int32_t> t(n);
  for (int32_t i = 0; i < n; ++i) t[i] = first + i;
  return t;
}
}  // namespace

TEST(released_keyed_blocks_are_cached_and_hit) {
  BlockManager bm(6, 4);
  std::vector<int32_t> toks = tokens_of(100, 12);  // 3 full blocks
  Ids a;
  bm.allocate(3, a);  // 0 1 2
  uint64_t k = 0;
  for (int i = 0; i < 3; ++i) k = bm.publish(a[i], k, toks.data() + 4 * i);
  bm.release(a);  // all keyed -> cached
  EXPECT_EQ(bm.num_cached_blocks(), 3);
  EXPECT_EQ(bm.num_free_blocks(), 3);
  EXPECT_EQ(bm.num_active_blocks(), 0);
  bm.verify();
  EXPECT_EQ(bm.num_prefix_blocks(toks.data(), 3), 3);  // counted, nothing taken
  EXPECT_EQ(bm.num_prefix_blocks(toks.data(), 2), 2);
  EXPECT_EQ(bm.num_cached_blocks(), 3);
  Ids b;
  uint64_t key = 0;
  EXPECT_EQ(bm.match_prefix(toks.data(), 3, b, &key), 3);
  EXPECT_EQ(b, (Ids{0, 1, 2}));
  EXPECT_EQ(key, k);
  EXPECT_EQ(bm.num_cached_blocks(), 0);
  // A second sequence with the same first block but a different second one: one hit, shared.
  std::vector<int32_t> other = toks;
  other[5] = 7;
  Ids c;
  key = 0;
  EXPECT_EQ(bm.num_prefix_blocks(other.data(), 3), 1);
  EXPECT_EQ(bm.match_prefix(other.data(), 3, c, &key), 1);
  EXPECT_EQ(c, (Ids{0}));
  EXPECT_EQ(bm.ref_count(0), 2);
  bm.verify();
  bm.release(c);
  EXPECT_EQ(bm.ref_count(0), 1);
  bm.release(b);
  EXPECT_EQ(bm.num_cached_blocks(), 3);
  bm.verify();
}

TEST(eviction_is_lru_and_tail_first) {
  BlockManager bm(4, 2);
  std::vector<int32_t> t1 = tokens_of(10, 4), t2 = tokens_of(50, 4);
  Ids a, b;
  bm.allocate(2, a);  // 0 1
  bm.allocate(2, b);  // 2 3
  uint64_t k = bm.publish(a[0], 0, t1.data());
  bm.publish(a[1], k, t1.data() + 2);
  k = bm.publish(b[0], 0, t2.data());
  bm.publish(b[1], k, t2.data() + 2);
  bm.release(a);  // cached in order 1 then 0 (tail first)
  bm.release(b);  // then 3, 2
  EXPECT_EQ(bm.num_free_blocks(), 0);
  EXPECT_EQ(bm.num_cached_blocks(), 4);
  Ids c;
  bm.allocate(3, c);  // evicts 1, 0, 3: a's tail, a's head, b's tail
  EXPECT_EQ(c, (Ids{1, 0, 3}));
  uint64_t key = 0;
  Ids d;
  EXPECT_EQ(bm.match_prefix(t1.data(), 2, d, &key), 0);  // a is gone
  key = 0;
  EXPECT_EQ(bm.match_prefix(t2.data(), 2, d, &key), 1);  // b's head survives
  EXPECT_EQ(d, (Ids{2}));
  bm.verify();
  EXPECT_EQ(bm.num_free_blocks() + bm.num_cached_blocks() + bm.num_active_blocks(), 4);
}

TEST(duplicate_content_is_not_keyed_twice) {
  BlockManager bm(4, 2);
  std::vector<int32_t> t = tokens_of(1, 2);
  Ids a, b;
  bm.allocate(1, a);
  bm.allocate(1, b);
  bm.publish(a[0], 0, t.data());
  bm.publish(b[0], 0, t.data());  // same content computed twice (concurrent prefills)
  EXPECT(bm.has_key(a[0]));
  EXPECT(!bm.has_key(b[0]));
  bm.release(b);  // unkeyed -> free, not cached
  EXPECT_EQ(bm.num_free_blocks(), 3);
  bm.release(a);
  EXPECT_EQ(bm.num_cached_blocks(), 1);
  bm.verify();
}

TEST(release_range_leaves_holes_and_counts_blocks_returned) {
  BlockManager bm(6, 4);
  std::vector<int32_t> t = tokens_of(1, 4);
  Ids a;
  bm.allocate(4, a);  // 0 1 2 3
  bm.publish(a[0], 0, t.data());
  Ids b(a.begin(), a.begin() + 2);
  bm.share(b);  // 0 1 shared by a and b
  EXPECT_EQ(bm.release_range(a, 0, 3), 1);  // 2 -> free; 1 and 0 still held by b
  EXPECT_EQ(a, (Ids{kNoBlock, kNoBlock, kNoBlock, 3}));
  EXPECT_EQ(bm.ref_count(0), 1);
  EXPECT_EQ(bm.num_free_blocks(), 3);
  EXPECT_EQ(bm.release_range(a, 0, 3), 0);  // holes stay holes
  bm.share(a);                              // holes skipped: 3 gets a second reference
  EXPECT_EQ(bm.ref_count(3), 2);
  EXPECT_EQ(bm.release_range(b, 0, 2), 2);  // 1 -> free, 0 (keyed) -> cached
  EXPECT_EQ(b, (Ids{kNoBlock, kNoBlock}));
  EXPECT_EQ(bm.num_cached_blocks(), 1);
  EXPECT_THROWS(bm.release_range(b, 1, 3));
  bm.verify();
  bm.release(a);  // drops 3 once, skips the holes
  EXPECT(a.empty());
  EXPECT_EQ(bm.ref_count(3), 1);
  Ids c{kNoBlock, 3};
  bm.release(c);
  bm.release(b);
  EXPECT_EQ(bm.num_free_blocks() + bm.num_cached_blocks(), 6);
  bm.verify();
}

TEST(match_prefix_takes_only_the_live_tail) {
  BlockManager bm(8, 4);
  std::vector<int32_t> toks = tokens_of(100, 16);  // 4 full blocks
  Ids a;
  bm.allocate(4, a);  // 0 1 2 3
  uint64_t k = 0;
  for (int i = 0; i < 4; ++i) k = bm.publish(a[i], k, toks.data() + 4 * i);
  bm.release(a);  // cached 3 2 1 0, 0 newest
  Ids b;
  uint64_t key = 0;
  EXPECT_EQ(bm.match_prefix(toks.data(), 4, b, &key, 1), 4);  // all four confirmed, only the last taken
  EXPECT_EQ(b, (Ids{kNoBlock, kNoBlock, kNoBlock, 3}));
  EXPECT_EQ(key, k);
  EXPECT_EQ(bm.ref_count(3), 1);
  EXPECT_EQ(bm.num_cached_blocks(), 3);
  bm.verify();
  // The untaken ones got newer in the LRU, the first block newest: eviction takes 2 first.
  Ids c;
  bm.allocate(5, c);
  EXPECT_EQ(c, (Ids{4, 5, 6, 7, 2}));
  Ids d;
  key = 0;
  EXPECT_EQ(bm.match_prefix(toks.data(), 4, d, &key, 0), 2);  // the chain breaks at the evicted 2
  EXPECT_EQ(d, (Ids{kNoBlock, kNoBlock}));
  EXPECT_EQ(bm.num_cached_blocks(), 2);
  bm.verify();
  bm.release(b);
  bm.release(c);
  bm.release(d);
  EXPECT_EQ(bm.num_free_blocks() + bm.num_cached_blocks(), 8);
  bm.verify();
}

int main() { return lmkit::testing::run_all(); }
