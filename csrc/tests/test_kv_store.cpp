// The disk store (engine/kv_store.h): a block round-trips byte for byte; a corrupt, truncated, foreign or
// colliding file is never served (and corrupt ones are counted and removed); two stores on one directory share it;
// the size cap evicts the least recently used files; a write error pauses writing instead of failing; the checksum
// is XXH64. And the scheduler's side (PrefixTier): an admission continues its prefix chain in a tier, exact block
// ids, and stops where the tier's copy is unusable.
#include <fcntl.h>
#include <signal.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <map>
#include <string>
#include <thread>
#include <vector>

#include "engine/kv_store.h"
#include "engine/scheduler.h"
#include "tests/testing.h"

using namespace lmkit;

namespace {

// A fresh directory per test, removed at exit.
std::string make_dir() {
  struct Dirs {
    std::vector<std::string> made;
    ~Dirs() {
      for (const std::string& d : made) std::system(("rm -rf '" + d + "'").c_str());
    }
  };
  static Dirs dirs;
  char tmpl[] = "/tmp/lmkit-kvstore-test-XXXXXX";
  const char* d = ::mkdtemp(tmpl);
  if (d == nullptr) std::abort();
  dirs.made.push_back(d);
  return d;
}

KVStoreConfig small_config(const std::string& dir, uint64_t identity = 7) {
  KVStoreConfig c;
  c.dir = dir;
  c.max_bytes = 1 << 20;
  c.identity = identity;
  c.block_size_tokens = 4;
  c.block_bytes = 256;
  return c;
}

std::vector<char> pattern(int seed, int64_t n) {
  std::vector<char> v((size_t)n);
  for (int64_t i = 0; i < n; ++i) v[(size_t)i] = (char)(seed * 31 + i * 7);
  return v;
}

void write_block(KVStore& s, uint64_t key, const std::vector<int32_t>& tokens, int seed) {
  std::vector<char> b = s.acquire_buffer(true, true);
  EXPECT(!b.empty());
  const std::vector<char> p = pattern(seed, s.config().block_bytes);
  std::copy(p.begin(), p.end(), b.begin());
  s.put(key, tokens.data(), std::move(b));
  s.flush();
}

int64_t file_size(const std::string& path) {
  struct stat st;
  return ::stat(path.c_str(), &st) == 0 ? (int64_t)st.st_size : -1;
}

void flip_byte(const std::string& path, int64_t offset) {
  const int fd = ::open(path.c_str(), O_RDWR);
  char c;
  if (::pread(fd, &c, 1, offset) != 1) std::abort();
  c ^= 0x5a;
  if (::pwrite(fd, &c, 1, offset) != 1) std::abort();
  ::close(fd);
}

}  // namespace

TEST(checksum_is_xxh64) {
  // XXH64 reference values (seed 0)
  EXPECT_EQ(checksum64("", 0), 0xef46db3751d8e999ull);
  EXPECT_EQ(checksum64("a", 1), 0xd24ec4f1a98c6e5bull);
  const char* s = "Nobody inspects the spammish repetition";
  EXPECT_EQ(checksum64(s, std::strlen(s)), 0xfbcea83c8a378bf1ull);
}

TEST(a_block_round_trips_and_a_second_store_reads_it) {
  const std::string dir = make_dir();
  const std::vector<int32_t> tokens{1, 2, 3, 4};
  {
    KVStore s(small_config(dir));
    EXPECT(!s.contains(42));
    write_block(s, 42, tokens, 1);
    EXPECT(s.contains(42));
    EXPECT_EQ(s.counters().num_written_blocks, 1);
    write_block(s, 42, tokens, 1);  // already on disk: not written again
    EXPECT_EQ(s.counters().num_written_blocks, 1);
  }
  KVStore again(small_config(dir));  // a restart
  std::vector<char> out(256);
  EXPECT(again.read(42, tokens.data(), out.data()));
  EXPECT(out == pattern(1, 256));
  EXPECT(again.read(42, tokens.data(), nullptr));  // header and tokens only
  const std::vector<int32_t> other{1, 2, 3, 5};
  EXPECT(!again.read(42, other.data(), out.data()));  // a key collision is not a hit, and the file stays
  EXPECT(again.contains(42));
  EXPECT_EQ(again.counters().num_ignored_files, 0);
  EXPECT_EQ(again.counters().num_read_blocks, 1);
}

TEST(corrupt_truncated_and_foreign_files_are_ignored_counted_and_removed) {
  const std::string dir = make_dir();
  const std::vector<int32_t> tokens{9, 8, 7, 6};
  KVStore s(small_config(dir));
  std::vector<char> out(256);
  const int64_t payload_at = 64 + 4 * 4;
  // a flipped payload byte, a flipped token byte, a flipped header byte
  for (int64_t offset : {payload_at + 100, (int64_t)64 + 5, (int64_t)20}) {
    write_block(s, 1, tokens, 2);
    flip_byte(s.path_of(1), offset);
    EXPECT(!s.read(1, tokens.data(), out.data()));
    EXPECT(!s.contains(1));
  }
  EXPECT_EQ(s.counters().num_ignored_files, 3);
  // truncated
  write_block(s, 2, tokens, 3);
  EXPECT(::truncate(s.path_of(2).c_str(), file_size(s.path_of(2)) - 1) == 0);
  EXPECT(!s.read(2, tokens.data(), out.data()));
  EXPECT_EQ(s.counters().num_ignored_files, 4);
  // a file of another identity renamed into this one's name
  KVStore foreign(small_config(dir, 8));
  write_block(foreign, 3, tokens, 4);
  EXPECT(::rename(foreign.path_of(3).c_str(), s.path_of(3).c_str()) == 0);
  EXPECT(!s.read(3, tokens.data(), out.data()));
  EXPECT_EQ(s.counters().num_ignored_files, 5);
  // not a store file at all
  {
    FILE* f = std::fopen(s.path_of(4).c_str(), "w");
    std::fputs("hello", f);
    std::fclose(f);
  }
  EXPECT(!s.read(4, tokens.data(), out.data()));
  EXPECT_EQ(s.counters().num_ignored_files, 6);
  EXPECT_EQ(s.counters().num_read_blocks, 0);
}

TEST(two_stores_on_one_directory_write_the_same_block_and_read_each_other) {
  const std::string dir = make_dir();
  KVStore a(small_config(dir)), b(small_config(dir));
  const std::vector<int32_t> tokens{5, 5, 5, 5};
  std::vector<std::thread> writers;
  for (KVStore* s : {&a, &b})
    writers.emplace_back([s, &tokens] {
      for (uint64_t key = 100; key < 140; ++key) {
        std::vector<char> buf = s->acquire_buffer(true, true);
        const std::vector<char> p = pattern((int)key, 256);
        std::copy(p.begin(), p.end(), buf.begin());
        s->put(key, tokens.data(), std::move(buf));
      }
      s->flush();
    });
  std::vector<char> out(256);
  int64_t hits = 0;
  for (int round = 0; round < 200; ++round)  // a reader racing the writers: whole files or misses, never garbage
    for (uint64_t key = 100; key < 140; ++key)
      if (a.read(key, tokens.data(), out.data())) {
        ++hits;
        EXPECT(out == pattern((int)key, 256));
      }
  for (std::thread& t : writers) t.join();
  for (uint64_t key = 100; key < 140; ++key) {
    EXPECT(b.read(key, tokens.data(), out.data()));
    EXPECT(out == pattern((int)key, 256));
  }
  EXPECT_EQ(a.counters().num_ignored_files + b.counters().num_ignored_files, 0);
  EXPECT(hits >= 0);
}

TEST(the_size_cap_evicts_least_recently_used_files) {
  const std::string dir = make_dir();
  KVStoreConfig c = small_config(dir);
  const int64_t file_bytes = 64 + 16 + 256;
  c.max_bytes = file_bytes * 10;
  KVStore s(c);
  const std::vector<int32_t> tokens{1, 1, 1, 1};
  std::vector<char> out(256);
  for (uint64_t key = 0; key < 10; ++key) {
    write_block(s, key, tokens, (int)key);
    std::this_thread::sleep_for(std::chrono::milliseconds(5));  // distinct mtimes
  }
  EXPECT(s.read(0, tokens.data(), out.data()));  // block 0 becomes the most recently used
  std::this_thread::sleep_for(std::chrono::milliseconds(5));
  write_block(s, 10, tokens, 10);  // over the cap: trimmed to 90% (9 files), the oldest go
  EXPECT(s.counters().bytes_on_disk <= c.max_bytes);
  EXPECT(s.counters().num_evicted_files >= 2);
  EXPECT(s.contains(0));
  EXPECT(s.contains(10));
  EXPECT(!s.contains(1));
  EXPECT(!s.contains(2));
}

TEST(a_write_error_pauses_writing_and_drops_instead_of_failing) {
  const std::string dir = make_dir();
  KVStoreConfig c = small_config(dir);
  c.write_pause_seconds = 3600;
  KVStore s(c);
  const std::vector<int32_t> tokens{2, 2, 2, 2};
  // a file-size limit below one block: the write fails with EFBIG, as on a full disk
  struct rlimit old;
  ::getrlimit(RLIMIT_FSIZE, &old);
  struct rlimit small = old;
  small.rlim_cur = 100;
  ::signal(SIGXFSZ, SIG_IGN);
  ::setrlimit(RLIMIT_FSIZE, &small);
  write_block(s, 1, tokens, 1);
  ::setrlimit(RLIMIT_FSIZE, &old);
  EXPECT_EQ(s.counters().num_write_errors, 1);
  EXPECT(!s.counters().is_writing);
  EXPECT(!s.contains(1));
  EXPECT(s.acquire_buffer(false, true).empty());  // paused: dropped, counted
  EXPECT(s.counters().num_dropped_blocks >= 1);
}

TEST(a_directory_that_cannot_be_made_is_a_clear_error) {
  KVStoreConfig c = small_config("/proc/no-such-dir/kv");
  EXPECT_THROWS(KVStore s(c));
  const std::string dir = make_dir();
  const std::string file = dir + "/file";
  std::fclose(std::fopen(file.c_str(), "w"));
  EXPECT_THROWS(KVStore s(small_config(file)));
}

// ---- the scheduler's side

namespace {

// A tier holding some blocks of one prompt by key; load() marks the pool block it filled.
struct FakeTier : PrefixTier {
  std::map<uint64_t, std::vector<int32_t>> blocks;  // key -> tokens
  std::vector<std::pair<uint64_t, int32_t>> loads;  // (key, pool block) in order
  uint64_t broken = 0;                              // a key whose copy is unusable
  bool contains(uint64_t key) override { return blocks.count(key) != 0; }
  bool load(uint64_t key, const int32_t* tokens, int32_t block) override {
    auto it = blocks.find(key);
    if (it == blocks.end() || key == broken || !std::equal(it->second.begin(), it->second.end(), tokens)) return false;
    loads.push_back({key, block});
    return true;
  }
};

std::unique_ptr<Sequence> prompt_seq(int64_t id, const std::vector<int32_t>& tokens) {
  auto s = std::make_unique<Sequence>();
  s->id = s->request_id = id;
  s->tokens = tokens;
  s->num_prompt_tokens = (int32_t)tokens.size();
  s->max_total_tokens = (int32_t)tokens.size() + 4;
  s->params.max_new_tokens = 4;
  return s;
}

}  // namespace

TEST(admission_continues_the_prefix_chain_in_the_tier) {
  BlockManager bm(16, 4);
  Scheduler sched(SchedulerConfig{4, 64, 256, true, 0}, bm);
  FakeTier tier;
  sched.set_prefix_tier(&tier);
  std::vector<int32_t> tokens;
  for (int32_t i = 0; i < 18; ++i) tokens.push_back(i + 10);
  uint64_t key = 0;
  std::vector<uint64_t> keys;
  for (int b = 0; b < 4; ++b) {  // the tier holds the first 4 blocks (16 tokens)
    key = block_key(key, tokens.data() + b * 4, 4);
    keys.push_back(key);
    tier.blocks[key] = std::vector<int32_t>(tokens.begin() + b * 4, tokens.begin() + b * 4 + 4);
  }
  tier.broken = keys[3];  // the 4th copy is unusable: the chain ends after 3
  sched.add(prompt_seq(1, tokens));
  BatchPlan plan = sched.schedule();
  EXPECT_EQ(plan.seqs.size(), (size_t)1);
  const Sequence& seq = *plan.seqs[0].seq;
  EXPECT_EQ(seq.num_computed_tokens, 12);  // 3 blocks read back
  EXPECT_EQ(plan.seqs[0].start_pos, 12);
  EXPECT_EQ(plan.seqs[0].num_tokens, 6);
  EXPECT_EQ(tier.loads.size(), (size_t)3);
  EXPECT_EQ(seq.block_table, (std::vector<int32_t>{0, 1, 2, 3, 4}));  // read into 0 1 2; 3 was freed again, reused
  EXPECT(bm.has_key(0) && bm.has_key(1) && bm.has_key(2));
  EXPECT_EQ(sched.num_tier_lookups(), 1);
  EXPECT_EQ(sched.num_tier_hit_tokens(), 12);
  EXPECT_EQ(sched.num_prefix_hit_tokens(), 12);
  sched.verify();
  std::unique_ptr<Sequence> done = sched.remove(1);
  // the blocks read back are in the pool's cache now: the next admission hits them there, not in the tier
  sched.add(prompt_seq(2, tokens));
  plan = sched.schedule();
  EXPECT_EQ(plan.seqs[0].seq->num_computed_tokens, 12);
  EXPECT_EQ(tier.loads.size(), (size_t)3);
  EXPECT_EQ(sched.num_tier_lookups(), 2);
  EXPECT_EQ(sched.num_tier_missed_lookups(), 1);  // asked for block 3, which is broken: loads nothing
  sched.verify();
  sched.remove(2);
  bm.verify();
}

TEST(a_windowed_tier_hit_reads_only_the_live_blocks) {
  BlockManager bm(16, 4);
  Scheduler sched(SchedulerConfig{4, 64, 256, true, /*window*/ 6}, bm);  // live: (6 - 1 + 3) / 4 = 2 blocks
  FakeTier tier;
  sched.set_prefix_tier(&tier);
  std::vector<int32_t> tokens;
  for (int32_t i = 0; i < 21; ++i) tokens.push_back(i + 3);
  uint64_t key = 0;
  for (int b = 0; b < 5; ++b) {
    key = block_key(key, tokens.data() + b * 4, 4);
    tier.blocks[key] = std::vector<int32_t>(tokens.begin() + b * 4, tokens.begin() + b * 4 + 4);
  }
  sched.add(prompt_seq(1, tokens));
  BatchPlan plan = sched.schedule();
  const Sequence& seq = *plan.seqs[0].seq;
  EXPECT_EQ(seq.num_computed_tokens, 20);
  EXPECT_EQ(seq.block_table, (std::vector<int32_t>{kNoBlock, kNoBlock, kNoBlock, 0, 1, 2}));
  EXPECT_EQ(tier.loads.size(), (size_t)5);  // 3 confirmed (block kNoBlock), 2 read
  EXPECT_EQ(tier.loads[0].second, kNoBlock);
  EXPECT_EQ(tier.loads[3].second, 0);
  EXPECT_EQ(tier.loads[4].second, 1);
  sched.verify();
  sched.remove(1);
  bm.verify();
}

int main() { return lmkit::testing::run_all(); }
