// The disk store: a second tier for prefix blocks evicted from the KV pool (CPU backend). One file per block in a
// directory that the lmkit processes of a host may share, bounded in bytes (least recently used files go first).
//
//   pool eviction / idle persist --copy of the block's bytes--> bounded queue --writer thread--> tmp file -> rename
//   admission: the pool's prefix chain ends --contains(key)? read(key) --> a freshly allocated block --> computed
//
// File `<identity:016x>-<key:016x>.kvb`: identity names what the bytes mean (model, tokenizer, KV dtype and policy,
// layout, block size, store format: KVStoreConfig::identity), key is the block's prefix key (block_key(): chained
// over the prompt's blocks). Contents, little-endian:
//
//   offset 0   FileHeader (64 bytes: magic, format version, identity, key, tokens, payload size and checksum,
//              header checksum)
//          64  int32 tokens[num_tokens]        the block's token ids: a hit is confirmed by comparing them exactly
//          ..  payload[payload_bytes]          the block as the pool holds it (Executor::read_kv_block)
//
// A file is written to a temporary name and renamed, so a reader sees a whole file or none (two writers of one
// block: the last rename wins, both whole; a reader keeps the inode it opened). A file that is truncated, whose
// checksums fail, or whose header names another identity, key, size or tokens is ignored, counted and removed:
// never served. Write errors (a full disk, EFBIG, permissions) are counted and turn writing off for a while:
// the store degrades to fewer hits, never to an error of a request.
#pragma once
#include <stdint.h>

#include <atomic>
#include <condition_variable>
#include <deque>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

namespace lmkit {

// XXH64 of data (the published algorithm): the files' checksums.
uint64_t checksum64(const void* data, size_t num_bytes, uint64_t seed = 0);

constexpr uint32_t kKVStoreFormatVersion = 1;

struct KVStoreConfig {
  std::string dir;                  // created if missing
  int64_t max_bytes = 0;            // the directory's size cap (every identity's files together)
  uint64_t identity = 0;            // what the bytes mean; files of other identities are never read
  int32_t block_size_tokens = 0;    // tokens per block
  int64_t block_bytes = 0;          // payload bytes per block (Executor::kv_bytes_per_block)
  int32_t max_queued_blocks = 8;    // blocks waiting for the writer at most; an eviction beyond is dropped
  double write_pause_seconds = 30;  // writing stays off this long after a write error
};

// Monotonic counters (bytes_on_disk is the writer's estimate of the directory's size).
struct KVStoreCounters {
  int64_t num_read_blocks = 0;      // blocks read back whole
  int64_t num_read_bytes = 0;
  int64_t num_written_blocks = 0;   // files written (a block already on disk is not written again)
  int64_t num_written_bytes = 0;
  int64_t num_dropped_blocks = 0;   // evictions not written: the queue was full or writing was off
  int64_t num_ignored_files = 0;    // corrupt, truncated or foreign files found (and removed)
  int64_t num_write_errors = 0;     // writes that failed (full disk, permissions, ...)
  int64_t num_evicted_files = 0;    // files removed to stay within max_bytes
  int64_t bytes_on_disk = 0;
  bool is_writing = true;           // false while writing is paused after an error
};

class KVStore {
 public:
  // Creates the directory; throws InvalidArgument naming it when it cannot be created or is not a directory.
  // Starts the writer thread, which first measures the directory (and trims it to max_bytes).
  explicit KVStore(const KVStoreConfig& config);
  ~KVStore();  // close()
  KVStore(const KVStore&) = delete;
  KVStore& operator=(const KVStore&) = delete;

  // A buffer of block_bytes for put(), recycled between writes (a few are kept). Empty (nothing to copy) when
  // writing is paused or the queue is full; with wait, it waits for room instead (idle and shutdown persisting),
  // unless writing is paused. count_drop: an empty answer counts as a dropped block.
  std::vector<char> acquire_buffer(bool wait, bool count_drop);
  // Queues block `key` (tokens: block_size_tokens ids; payload from acquire_buffer, filled) for the writer.
  void put(uint64_t key, const int32_t* tokens, std::vector<char> payload);
  // Gives back a buffer from acquire_buffer() that will not be put() (its copy failed).
  void abandon(std::vector<char> buffer);
  // Whether a file for key exists (one stat; the file is checked when read).
  bool contains(uint64_t key) const;
  // Reads block key into payload (block_bytes) when its file is whole, of this identity and holds exactly tokens,
  // and makes it the most recently used; otherwise false (a bad file is counted and removed). payload nullptr:
  // checks the header and tokens only (a block the caller will not read: behind a sliding window).
  bool read(uint64_t key, const int32_t* tokens, char* payload);
  // Waits until every queued block is written (or dropped).
  void flush();
  // Writes what is queued and stops the writer. Idempotent.
  void close();

  KVStoreCounters counters() const;
  std::string path_of(uint64_t key) const;
  const KVStoreConfig& config() const { return config_; }

 private:
  struct Job {
    uint64_t key = 0;
    std::vector<int32_t> tokens;
    std::vector<char> payload;
  };
  void writer_loop();
  void write_file(Job& job);
  // Measures the directory and, above max_bytes (or `target` when given), removes the least recently used files
  // down to 90% of it; stale temporary files of dead writers go too.
  void trim(int64_t target = -1);
  void pause_writing(int err);
  void ignore_file(const std::string& path, const char* why);

  KVStoreConfig config_;
  std::string prefix_;  // dir + "/" + identity hex + "-"

  mutable std::mutex mu_;
  std::condition_variable work_cv_, room_cv_;
  std::deque<Job> queue_;
  std::vector<std::vector<char>> spare_buffers_;
  int32_t num_in_flight_ = 0;  // queued or being written
  bool closing_ = false;
  bool writer_done_ = false;  // the writer thread has left its loop
  double paused_until_ = 0;  // steady seconds
  std::thread writer_;

  std::atomic<int64_t> num_read_blocks_{0}, num_read_bytes_{0}, num_written_blocks_{0}, num_written_bytes_{0},
      num_dropped_blocks_{0}, num_ignored_files_{0}, num_write_errors_{0}, num_evicted_files_{0}, bytes_on_disk_{0};
};

}  // namespace lmkit
