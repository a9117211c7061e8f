#include "engine/kv_store.h"

#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <sys/uio.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstddef>
#include <cstdio>
#include <cstring>
#include <functional>

#include "core/check.h"
#include "core/clock.h"
#include "core/threads.h"

namespace lmkit {

namespace {

constexpr char kMagic[8] = {'L', 'M', 'K', 'V', 'B', 'L', 'K', '\0'};
constexpr char kSuffix[] = ".kvb";
constexpr char kTmpPrefix[] = ".tmp-";
constexpr double kStaleTmpSeconds = 3600;  // a temporary file this old belongs to a writer that died
constexpr size_t kSpareBuffers = 8;  // buffers kept for reuse; the rest of a burst's are freed once written

// The file's first 64 bytes (native little-endian layout).
struct FileHeader {
  char magic[8];
  uint32_t format_version;
  uint32_t num_tokens;
  uint64_t identity;
  uint64_t key;
  uint64_t payload_bytes;
  uint64_t payload_checksum;
  uint64_t tokens_checksum;
  uint64_t header_checksum;  // of the 56 bytes before it
};
static_assert(sizeof(FileHeader) == 64, "the store's file header is 64 bytes");

uint64_t rotl(uint64_t x, int r) { return (x << r) | (x >> (64 - r)); }
constexpr uint64_t P1 = 11400714785074694791ull, P2 = 14029467366897019727ull, P3 = 1609587929392839161ull,
                   P4 = 9650029242287828579ull, P5 = 2870177450012600261ull;
uint64_t read64(const unsigned char* p) {
  uint64_t v;
  std::memcpy(&v, p, 8);
  return v;
}
uint32_t read32(const unsigned char* p) {
  uint32_t v;
  std::memcpy(&v, p, 4);
  return v;
}
uint64_t round64(uint64_t acc, uint64_t input) { return rotl(acc + input * P2, 31) * P1; }
uint64_t merge64(uint64_t acc, uint64_t val) { return (acc ^ round64(0, val)) * P1 + P4; }

// Reads exactly n bytes at offset; false on a short read or an error.
bool read_exactly(int fd, void* dst, size_t n, off_t offset) {
  char* p = static_cast<char*>(dst);
  while (n > 0) {
    const ssize_t got = ::pread(fd, p, n, offset);
    if (got < 0 && errno == EINTR) continue;
    if (got <= 0) return false;
    p += got, n -= (size_t)got, offset += got;
  }
  return true;
}

bool is_store_file(const char* name) {
  const size_t n = std::strlen(name);
  return n == 16 + 1 + 16 + sizeof(kSuffix) - 1 && std::strcmp(name + n - (sizeof(kSuffix) - 1), kSuffix) == 0;
}

}  // namespace

uint64_t checksum64(const void* data, size_t num_bytes, uint64_t seed) {
  const unsigned char* p = static_cast<const unsigned char*>(data);
  const unsigned char* end = p + num_bytes;
  uint64_t h;
  if (num_bytes >= 32) {
    uint64_t v1 = seed + P1 + P2, v2 = seed + P2, v3 = seed, v4 = seed - P1;
    const unsigned char* limit = end - 32;
    do {
      v1 = round64(v1, read64(p));
      v2 = round64(v2, read64(p + 8));
      v3 = round64(v3, read64(p + 16));
      v4 = round64(v4, read64(p + 24));
      p += 32;
    } while (p <= limit);
    h = rotl(v1, 1) + rotl(v2, 7) + rotl(v3, 12) + rotl(v4, 18);
    h = merge64(h, v1), h = merge64(h, v2), h = merge64(h, v3), h = merge64(h, v4);
  } else {
    h = seed + P5;
  }
  h += (uint64_t)num_bytes;
  for (; p + 8 <= end; p += 8) h = rotl(h ^ round64(0, read64(p)), 27) * P1 + P4;
  if (p + 4 <= end) h = rotl(h ^ (uint64_t)read32(p) * P1, 23) * P2 + P3, p += 4;
  for (; p < end; ++p) h = rotl(h ^ (uint64_t)*p * P5, 11) * P1;
  h ^= h >> 33, h *= P2, h ^= h >> 29, h *= P3, h ^= h >> 32;
  return h;
}

KVStore::KVStore(const KVStoreConfig& config) : config_(config) {
  LMKIT_CHECK_ARG(!config.dir.empty(), "kv_cache_dir is empty");
  LMKIT_CHECK_ARG(config.max_bytes > 0, "kv_cache_disk_gib must be > 0");
  LMKIT_CHECK_ARG(config.block_size_tokens > 0 && config.block_bytes > 0, "the disk store needs blocks of K/V bytes");
  LMKIT_CHECK_ARG(config.max_queued_blocks >= 1, "the disk store's queue needs room for a block");
  if (::mkdir(config.dir.c_str(), 0755) != 0 && errno != EEXIST)
    throw InvalidArgument(detail::concat("kv_cache_dir ", config.dir, " cannot be created: ", std::strerror(errno)));
  struct stat st;
  LMKIT_CHECK_ARG(::stat(config.dir.c_str(), &st) == 0 && S_ISDIR(st.st_mode), "kv_cache_dir ", config.dir,
                  " is not a directory");
  LMKIT_CHECK_ARG(::access(config.dir.c_str(), R_OK | W_OK | X_OK) == 0, "kv_cache_dir ", config.dir,
                  " is not readable and writable by this process");
  char hex[24];
  std::snprintf(hex, sizeof(hex), "%016llx-", (unsigned long long)config.identity);
  prefix_ = config.dir + "/" + hex;
  writer_ = std::thread([this] { writer_loop(); });
}

KVStore::~KVStore() { close(); }

std::string KVStore::path_of(uint64_t key) const {
  char hex[24];
  std::snprintf(hex, sizeof(hex), "%016llx", (unsigned long long)key);
  return prefix_ + hex + kSuffix;
}

std::vector<char> KVStore::acquire_buffer(bool wait, bool count_drop) {
  std::unique_lock<std::mutex> lock(mu_);
  auto room = [&] { return closing_ || num_in_flight_ < config_.max_queued_blocks; };
  const bool paused = steady_seconds() < paused_until_;
  if (!paused && wait) room_cv_.wait(lock, room);
  if (paused || closing_ || !room()) {
    if (count_drop) num_dropped_blocks_.fetch_add(1, std::memory_order_relaxed);
    return {};
  }
  ++num_in_flight_;  // the slot is held from here until the block is written (or put() is never called: see put)
  if (!spare_buffers_.empty()) {
    std::vector<char> b = std::move(spare_buffers_.back());
    spare_buffers_.pop_back();
    return b;
  }
  return std::vector<char>((size_t)config_.block_bytes);
}

void KVStore::put(uint64_t key, const int32_t* tokens, std::vector<char> payload) {
  LMKIT_CHECK((int64_t)payload.size() == config_.block_bytes, "put() of a buffer of ", payload.size(),
              " bytes into a store of ", config_.block_bytes, "-byte blocks");
  Job job;
  job.key = key;
  job.tokens.assign(tokens, tokens + config_.block_size_tokens);
  job.payload = std::move(payload);
  {
    std::lock_guard<std::mutex> lock(mu_);
    queue_.push_back(std::move(job));
  }
  work_cv_.notify_one();
}

void KVStore::abandon(std::vector<char> buffer) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    --num_in_flight_;
    if (spare_buffers_.size() < kSpareBuffers) spare_buffers_.push_back(std::move(buffer));
  }
  room_cv_.notify_all();
}

bool KVStore::contains(uint64_t key) const {
  struct stat st;
  return ::stat(path_of(key).c_str(), &st) == 0;
}

void KVStore::ignore_file(const std::string& path, const char* why) {
  num_ignored_files_.fetch_add(1, std::memory_order_relaxed);
  std::fprintf(stderr, "lmkit: kv store: ignoring %s (%s); removed\n", path.c_str(), why);
  ::unlink(path.c_str());
}

bool KVStore::read(uint64_t key, const int32_t* tokens, char* payload) {
  const std::string path = path_of(key);
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) return false;  // gone (evicted by another process): a miss
  struct Closer {
    int fd;
    ~Closer() { ::close(fd); }
  } closer{fd};
  const int32_t bs = config_.block_size_tokens;
  const int64_t token_bytes = (int64_t)bs * (int64_t)sizeof(int32_t);
  const int64_t file_bytes = (int64_t)sizeof(FileHeader) + token_bytes + config_.block_bytes;
  struct stat st;
  if (::fstat(fd, &st) != 0) return false;
  FileHeader h;
  if (st.st_size < (off_t)sizeof(FileHeader) || !read_exactly(fd, &h, sizeof(h), 0)) {
    ignore_file(path, "truncated header");
    return false;
  }
  if (std::memcmp(h.magic, kMagic, sizeof(kMagic)) != 0 ||
      h.header_checksum != checksum64(&h, offsetof(FileHeader, header_checksum))) {
    ignore_file(path, "not a store file, or a corrupt header");
    return false;
  }
  if (h.format_version != kKVStoreFormatVersion || h.identity != config_.identity || h.key != key ||
      h.num_tokens != (uint32_t)bs || h.payload_bytes != (uint64_t)config_.block_bytes) {
    ignore_file(path, "written for another model, layout, block or format");
    return false;
  }
  if (st.st_size != (off_t)file_bytes) {
    ignore_file(path, "truncated or padded");
    return false;
  }
  std::vector<int32_t> stored((size_t)bs);
  if (!read_exactly(fd, stored.data(), (size_t)token_bytes, sizeof(FileHeader)) ||
      checksum64(stored.data(), (size_t)token_bytes) != h.tokens_checksum) {
    ignore_file(path, "corrupt tokens");
    return false;
  }
  if (!std::equal(stored.begin(), stored.end(), tokens)) return false;  // a key collision: another prefix's block
  if (payload != nullptr) {
    if (!read_exactly(fd, payload, (size_t)config_.block_bytes, (off_t)(sizeof(FileHeader) + token_bytes)) ||
        checksum64(payload, (size_t)config_.block_bytes) != h.payload_checksum) {
      ignore_file(path, "corrupt K/V bytes");
      return false;
    }
    num_read_blocks_.fetch_add(1, std::memory_order_relaxed);
    num_read_bytes_.fetch_add(file_bytes, std::memory_order_relaxed);
  }
  ::futimens(fd, nullptr);  // most recently used (the LRU order is the files' mtime)
  return true;
}

void KVStore::flush() {
  std::unique_lock<std::mutex> lock(mu_);
  room_cv_.wait(lock, [&] { return num_in_flight_ == 0 || writer_done_; });
}

void KVStore::close() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (closing_ && !writer_.joinable()) return;
    closing_ = true;
  }
  work_cv_.notify_all();
  room_cv_.notify_all();
  if (writer_.joinable()) writer_.join();
}

KVStoreCounters KVStore::counters() const {
  KVStoreCounters c;
  c.num_read_blocks = num_read_blocks_.load(std::memory_order_relaxed);
  c.num_read_bytes = num_read_bytes_.load(std::memory_order_relaxed);
  c.num_written_blocks = num_written_blocks_.load(std::memory_order_relaxed);
  c.num_written_bytes = num_written_bytes_.load(std::memory_order_relaxed);
  c.num_dropped_blocks = num_dropped_blocks_.load(std::memory_order_relaxed);
  c.num_ignored_files = num_ignored_files_.load(std::memory_order_relaxed);
  c.num_write_errors = num_write_errors_.load(std::memory_order_relaxed);
  c.num_evicted_files = num_evicted_files_.load(std::memory_order_relaxed);
  c.bytes_on_disk = bytes_on_disk_.load(std::memory_order_relaxed);
  std::lock_guard<std::mutex> lock(mu_);
  c.is_writing = steady_seconds() >= paused_until_;
  return c;
}

void KVStore::writer_loop() {
  name_this_thread("lmkit-kvstore");
#if defined(__linux__)
  // Ten nice levels below the process (the engine's threads): on a busy host writes wait for idle CPU, steps do not.
  const id_t tid = (id_t)::syscall(SYS_gettid);
  errno = 0;
  const int nice = ::getpriority(PRIO_PROCESS, tid);
  if (errno == 0) ::setpriority(PRIO_PROCESS, tid, std::min(nice + 10, 19));
#endif
  trim();
  for (;;) {
    Job job;
    {
      std::unique_lock<std::mutex> lock(mu_);
      work_cv_.wait(lock, [&] { return closing_ || !queue_.empty(); });
      if (queue_.empty()) break;  // closing, and everything queued is written
      job = std::move(queue_.front());
      queue_.pop_front();
    }
    const bool paused = [&] {
      std::lock_guard<std::mutex> lock(mu_);
      return steady_seconds() < paused_until_;
    }();
    if (paused) num_dropped_blocks_.fetch_add(1, std::memory_order_relaxed);
    else write_file(job);
    {
      std::lock_guard<std::mutex> lock(mu_);
      --num_in_flight_;
      if (spare_buffers_.size() < kSpareBuffers) spare_buffers_.push_back(std::move(job.payload));
    }
    room_cv_.notify_all();
  }
  {
    std::lock_guard<std::mutex> lock(mu_);
    writer_done_ = true;
  }
  room_cv_.notify_all();
}

void KVStore::pause_writing(int err) {
  num_write_errors_.fetch_add(1, std::memory_order_relaxed);
  std::fprintf(stderr, "lmkit: kv store: writing to %s failed (%s); not writing for %g s\n", config_.dir.c_str(),
               std::strerror(err), config_.write_pause_seconds);
  std::lock_guard<std::mutex> lock(mu_);
  paused_until_ = steady_seconds() + config_.write_pause_seconds;
}

void KVStore::write_file(Job& job) {
  const std::string path = path_of(job.key);
  if (::utimensat(AT_FDCWD, path.c_str(), nullptr, 0) == 0) return;  // on disk already (this or another process)
  const int64_t token_bytes = (int64_t)job.tokens.size() * (int64_t)sizeof(int32_t);
  FileHeader h;
  std::memcpy(h.magic, kMagic, sizeof(kMagic));
  h.format_version = kKVStoreFormatVersion;
  h.num_tokens = (uint32_t)job.tokens.size();
  h.identity = config_.identity;
  h.key = job.key;
  h.payload_bytes = (uint64_t)job.payload.size();
  h.payload_checksum = checksum64(job.payload.data(), job.payload.size());
  h.tokens_checksum = checksum64(job.tokens.data(), (size_t)token_bytes);
  h.header_checksum = checksum64(&h, offsetof(FileHeader, header_checksum));
  char tmp_name[96];
  static std::atomic<uint64_t> next_tmp{0};  // unique among this process's stores; the pid among processes
  std::snprintf(tmp_name, sizeof(tmp_name), "/%s%d-%llu%s", kTmpPrefix, (int)::getpid(),
                (unsigned long long)next_tmp.fetch_add(1), kSuffix);
  const std::string tmp = config_.dir + tmp_name;
  const int fd = ::open(tmp.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0644);
  if (fd < 0) return pause_writing(errno);
  struct iovec parts[3] = {{&h, sizeof(h)},
                           {job.tokens.data(), (size_t)token_bytes},
                           {job.payload.data(), job.payload.size()}};
  const int64_t total = (int64_t)sizeof(h) + token_bytes + (int64_t)job.payload.size();
  int64_t done = 0;
  int err = 0;
  while (done < total) {  // writev, resumed after a short write
    struct iovec rest[3];
    int n = 0;
    int64_t skip = done;
    for (const iovec& part : parts) {
      if (skip >= (int64_t)part.iov_len) {
        skip -= (int64_t)part.iov_len;
        continue;
      }
      rest[n++] = {static_cast<char*>(part.iov_base) + skip, part.iov_len - (size_t)skip};
      skip = 0;
    }
    const ssize_t wrote = ::writev(fd, rest, n);
    if (wrote < 0 && errno == EINTR) continue;
    if (wrote <= 0) {
      err = wrote < 0 ? errno : ENOSPC;
      break;
    }
    done += wrote;
  }
  if (::close(fd) != 0 && err == 0) err = errno;
  if (err == 0 && ::rename(tmp.c_str(), path.c_str()) != 0) err = errno;
  if (err != 0) {
    ::unlink(tmp.c_str());
    if (err == ENOSPC || err == EDQUOT) trim(bytes_on_disk_.load() / 2);  // make room for others, then pause
    return pause_writing(err);
  }
  num_written_blocks_.fetch_add(1, std::memory_order_relaxed);
  num_written_bytes_.fetch_add(total, std::memory_order_relaxed);
  if (bytes_on_disk_.fetch_add(total) + total > config_.max_bytes) trim();
}

void KVStore::trim(int64_t target) {
  struct Entry {
    int64_t mtime_ns;
    int64_t bytes;
    std::string path;
  };
  std::vector<Entry> files;
  int64_t total = 0;
  DIR* d = ::opendir(config_.dir.c_str());
  if (d == nullptr) return;
  const double wall_now = (double)std::chrono::duration_cast<std::chrono::seconds>(
                              std::chrono::system_clock::now().time_since_epoch()).count();
  while (const dirent* e = ::readdir(d)) {
    const bool tmp = std::strncmp(e->d_name, kTmpPrefix, sizeof(kTmpPrefix) - 1) == 0;
    if (!tmp && !is_store_file(e->d_name)) continue;  // not ours: never touched
    std::string path = config_.dir + "/" + e->d_name;
    struct stat st;
    if (::stat(path.c_str(), &st) != 0 || !S_ISREG(st.st_mode)) continue;
    if (tmp) {
      if (wall_now - (double)st.st_mtime > kStaleTmpSeconds) ::unlink(path.c_str());
      continue;
    }
    total += (int64_t)st.st_size;
    files.push_back({(int64_t)st.st_mtim.tv_sec * 1000000000 + st.st_mtim.tv_nsec, (int64_t)st.st_size,
                     std::move(path)});
  }
  ::closedir(d);
  const int64_t limit = target >= 0 ? target : config_.max_bytes;
  if (total > limit) {
    const int64_t goal = limit / 10 * 9;
    std::sort(files.begin(), files.end(), [](const Entry& a, const Entry& b) { return a.mtime_ns < b.mtime_ns; });
    for (const Entry& f : files) {
      if (total <= goal) break;
      if (::unlink(f.path.c_str()) == 0) num_evicted_files_.fetch_add(1, std::memory_order_relaxed);
      total -= f.bytes;  // gone either way (another process may have removed it first)
    }
  }
  bytes_on_disk_.store(total);
}

}  // namespace lmkit
