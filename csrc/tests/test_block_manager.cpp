// Block manager bookkeeping: exact block ids, free-list order, conservation, misuse detected.
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
  bm.free(a);         // 0 1 free again
  EXPECT(a.empty());
  bm.allocate(3, c);  // 0 1 4
  EXPECT_EQ(c, (Ids{0, 1, 4}));
  EXPECT_EQ(bm.num_free_blocks(), 1);
  bm.free(b);
  bm.free(c);
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
  bm.free(a);
  EXPECT_THROWS(bm.free(copy));  // already free
  Ids bogus{7};
  EXPECT_THROWS(bm.free(bogus));
  bm.verify();
  EXPECT_EQ(bm.num_free_blocks(), 3);
}

int main() { return lmkit::testing::run_all(); }
