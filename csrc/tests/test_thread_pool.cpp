// The kernels' thread teams (kernels/cpu/thread_pool.h): every split covers each item exactly once, with
// every team size, grain and spin setting; a thread that stalls inside a chunk, or never shows up, delays
// only its share; loops nest inline; teams of different calling threads work side by side; resizing a team.
#include <atomic>
#include <chrono>
#include <thread>
#include <vector>

#include "kernels/cpu/thread_pool.h"
#include "kernels/ops.h"
#include "tests/testing.h"

using namespace lmkit;

namespace {
#include "kernels/cpu/parallel.h"

// Runs [0, n) in chunks of `grain` and returns how often each item was visited (and checks chunk bounds: a
// team of one runs the whole range in one call).
std::vector<int> visits(int64_t n, int64_t grain, bool* bounds_ok) {
  std::vector<std::atomic<int>> seen(n);
  std::atomic<bool> ok{true};
  parallel_for(n, grain, true, [&](int64_t i0, int64_t i1) {
    if (!(0 <= i0 && i0 < i1 && i1 <= n && (i1 - i0 <= grain || ops::cpu::team_threads() == 1))) ok = false;
    for (int64_t i = i0; i < i1; ++i) seen[i].fetch_add(1);
  });
  *bounds_ok = ok;
  std::vector<int> out(n);
  for (int64_t i = 0; i < n; ++i) out[i] = seen[i].load();
  return out;
}

bool all_once(const std::vector<int>& v) {
  for (int x : v)
    if (x != 1) return false;
  return true;
}

}  // namespace

TEST(every_split_covers_each_item_once) {
  for (int spin : {0, 5, ops::cpu::kDefaultSpinUs}) {
    ops::cpu::set_spin_us(spin);
    for (int threads : {1, 2, 3, 5, 8}) {
      ops::set_num_threads(threads);
      EXPECT_EQ(ops::cpu::team_threads(), threads);
      for (int64_t n : {1, 2, 3, 7, 64, 1000, 4097})
        for (int64_t grain : {(int64_t)1, (int64_t)3, (int64_t)64, n, n + 5}) {
          bool bounds = false;
          const std::vector<int> v = visits(n, grain, &bounds);
          EXPECT(bounds);
          EXPECT(all_once(v));
        }
    }
  }
  ops::cpu::set_spin_us(ops::cpu::kDefaultSpinUs);
  ops::set_num_threads(1);
}

TEST(empty_and_inline_loops) {
  ops::set_num_threads(4);
  int calls = 0;
  parallel_for(0, 1, true, [&](int64_t, int64_t) { ++calls; });
  EXPECT_EQ(calls, 0);
  parallel_for(100, 1, false, [&](int64_t i0, int64_t i1) {  // not worth threads: one call, on this thread
    ++calls;
    EXPECT(i0 == 0 && i1 == 100);
  });
  EXPECT_EQ(calls, 1);
  ops::set_num_threads(1);
}

TEST(many_jobs_in_a_row) {
  // short loops back to back (a decode step's pattern): no lost wake-up, no job read by a late worker
  for (int spin : {0, ops::cpu::kDefaultSpinUs}) {
    ops::cpu::set_spin_us(spin);
    ops::set_num_threads(3);
    int64_t total = 0;
    std::vector<int64_t> buf(16);
    for (int job = 0; job < 20000; ++job) {
      parallel_for(16, 1, true, [&](int64_t i0, int64_t i1) {
        for (int64_t i = i0; i < i1; ++i) buf[i] = job + i;
      });
      for (int64_t i = 0; i < 16; ++i) total += buf[i] - job - i;
    }
    EXPECT_EQ(total, 0);
  }
  ops::cpu::set_spin_us(ops::cpu::kDefaultSpinUs);
  ops::set_num_threads(1);
}

TEST(nested_loops_run_inline) {
  ops::set_num_threads(4);
  std::atomic<int64_t> sum{0};
  parallel_for(8, 1, true, [&](int64_t i0, int64_t i1) {
    for (int64_t i = i0; i < i1; ++i) {
      const std::thread::id outer = std::this_thread::get_id();
      parallel_for(10, 1, true, [&](int64_t j0, int64_t j1) {
        EXPECT(std::this_thread::get_id() == outer);
        for (int64_t j = j0; j < j1; ++j) sum += i * 10 + j;
      });
    }
  });
  EXPECT_EQ(sum.load(), (int64_t)(79 * 80 / 2));
  ops::set_num_threads(1);
}

TEST(a_stalled_thread_delays_only_its_chunk) {
  // one chunk stalls 200 ms (a thread descheduled in the middle of its work); the others still finish
  // theirs, and the loop ends when the stalled chunk does: about 200 ms, not 200 ms per chunk it owned
  ops::set_num_threads(2);
  std::atomic<int> done{0};
  const auto t0 = std::chrono::steady_clock::now();
  parallel_for(64, 1, true, [&](int64_t i0, int64_t i1) {
    for (int64_t i = i0; i < i1; ++i) {
      if (i == 1) std::this_thread::sleep_for(std::chrono::milliseconds(200));
      done.fetch_add(1);
    }
  });
  const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  EXPECT_EQ(done.load(), 64);
  EXPECT(s < 5.0);  // a guard against a hang, not a timing claim
  ops::set_num_threads(1);
}

TEST(teams_of_different_threads_work_side_by_side) {
  // two engines in one process: each calling thread has its own team and size
  std::atomic<int> failures{0};
  auto run = [&](int threads) {
    ops::set_num_threads(threads);
    for (int rep = 0; rep < 500; ++rep) {
      bool bounds = false;
      if (!all_once(visits(257, 7, &bounds)) || !bounds) failures.fetch_add(1);
    }
  };
  std::thread a(run, 2), b(run, 3);
  a.join();
  b.join();
  EXPECT_EQ(failures.load(), 0);
}

TEST(resizing_a_team) {
  for (int threads : {2, 6, 1, 3, 3, 2}) {
    ops::set_num_threads(threads);
    bool bounds = false;
    EXPECT(all_once(visits(99, 2, &bounds)));
    EXPECT(bounds);
  }
  EXPECT_THROWS(ops::set_num_threads(0));
  ops::set_num_threads(1);
}

int main() { return lmkit::testing::run_all(); }
