// The kernels' thread teams (thread_pool.h). One Team per calling thread; one loop (job) at a time.
//
// Job protocol. Jobs alternate between two slots (job s in slot s % 2). A slot holds the job (body, ctx, n,
// grain), its chunk counters and state = (seq << 32) | kOpen | active threads. The caller writes job s into
// its slot (once nobody is left in it from job s - 2), stores state = (s << 32) | kOpen | 1 (itself active)
// and then job_seq = s, which the idle workers poll (or sleep on). A worker that sees a new job_seq joins by
// incrementing the slot's active count, but only while the state still names that job and is open; it then
// takes chunks from `next` until none is left, adds the items it did to `done` and leaves (active - 1).
// The caller takes chunks too, waits until `done` == n, then closes the job and leaves in one step. It
// never waits for a worker to show up or to leave: a worker descheduled before it joined finds the job
// closed (or its slot holding a later job) and skips it; one still inside a slot only delays the job two
// later, which must wait for the slot (normally long free).
//
// Waiting. Every wait polls for up to g_spin_us, then sleeps on a futex word (job_seq for workers,
// caller_word for the caller). A waiter: sleepers++, recheck, FUTEX_WAIT(word, value seen before); a waker:
// its seq_cst update of the condition, then a read of sleepers, and only if someone sleeps a change of the
// word and FUTEX_WAKE. One of the two sees the other, so no wake-up is lost, and the common case (nobody
// asleep) costs no extra cache-line transfer.
#include "kernels/cpu/thread_pool.h"

#include "core/threads.h"

#include <linux/futex.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <climits>
#include <memory>
#include <thread>
#include <vector>
#if defined(__x86_64__) || defined(_M_X64)
#include <immintrin.h>
#endif

#include "core/check.h"
#include "kernels/ops.h"

namespace lmkit::ops::cpu {
namespace {

std::atomic<int> g_spin_us{kDefaultSpinUs};

inline void cpu_relax() {
#if defined(__x86_64__) || defined(_M_X64)
  _mm_pause();
#endif
}

void futex_wait(std::atomic<uint32_t>* word, uint32_t seen) {
  syscall(SYS_futex, reinterpret_cast<uint32_t*>(word), FUTEX_WAIT_PRIVATE, seen, nullptr, nullptr, 0);
}
void futex_wake_all(std::atomic<uint32_t>* word) {
  syscall(SYS_futex, reinterpret_cast<uint32_t*>(word), FUTEX_WAKE_PRIVATE, INT_MAX, nullptr, nullptr, 0);
}

// Returns once ready() holds: polls for up to g_spin_us, then sleeps on `word` between checks.
template <class Ready>
void wait_until(std::atomic<uint32_t>& word, std::atomic<int>& sleepers, Ready ready) {
  const auto spin = std::chrono::microseconds(g_spin_us.load(std::memory_order_relaxed));
  if (spin.count() > 0) {
    const auto until = std::chrono::steady_clock::now() + spin;
    for (uint32_t i = 1;; ++i) {
      if (ready()) return;
      cpu_relax();
      if (i % 64 == 0 && std::chrono::steady_clock::now() >= until) break;
    }
  }
  for (;;) {
    const uint32_t seen = word.load(std::memory_order_seq_cst);
    if (ready()) return;
    sleepers.fetch_add(1, std::memory_order_seq_cst);
    if (!ready()) futex_wait(&word, seen);
    sleepers.fetch_sub(1, std::memory_order_seq_cst);
  }
}

// After a seq_cst update of what a waiter on `word` checks: wakes it if it sleeps.
void wake_sleepers(std::atomic<uint32_t>& word, std::atomic<int>& sleepers) {
  if (sleepers.load(std::memory_order_seq_cst) > 0) {
    word.fetch_add(1, std::memory_order_seq_cst);
    futex_wake_all(&word);
  }
}

thread_local bool tl_in_body = false;  // this thread runs a chunk body (or is a worker): nested loops run inline

class Team {
 public:
  explicit Team(int num_threads) : num_threads_(num_threads) {
    for (int t = 1; t < num_threads; ++t)
      workers_.emplace_back([this] {
        name_this_thread("lmkit-worker");  // inherits the creating thread's CPUs (see core/threads.h)
        worker_loop();
      });
  }
  ~Team() {
    stop_.store(true, std::memory_order_seq_cst);
    job_seq_.fetch_add(1, std::memory_order_seq_cst);
    futex_wake_all(&job_seq_);
    for (auto& w : workers_) w.join();
  }
  int num_threads() const { return num_threads_; }

  void run(ChunkBody body, void* ctx, int64_t n, int64_t grain) {
    const uint32_t seq = job_seq_.load(std::memory_order_relaxed) + 1;
    Slot& slot = slots_[seq & 1];
    // a worker may still be inside this slot's previous job (two jobs ago): wait until it has left
    wait_until(caller_word_, caller_sleepers_,
               [&] { return (slot.state.load(std::memory_order_acquire) & kActive) == 0; });
    slot.body = body, slot.ctx = ctx, slot.n = n, slot.grain = grain;
    slot.next.store(0, std::memory_order_relaxed);
    slot.done.store(0, std::memory_order_relaxed);
    slot.state.store((uint64_t)seq << 32 | kOpen | 1, std::memory_order_release);  // publishes the fields
    job_seq_.store(seq, std::memory_order_seq_cst);
    if (worker_sleepers_.load(std::memory_order_seq_cst) > 0) futex_wake_all(&job_seq_);
    take_chunks(slot);
    wait_until(caller_word_, caller_sleepers_, [&] { return slot.done.load(std::memory_order_acquire) == n; });
    slot.state.fetch_sub(kOpen | 1, std::memory_order_acq_rel);  // closed (no one joins any more), and left
  }

 private:
  static constexpr uint64_t kOpen = 1ull << 31, kActive = kOpen - 1;

  struct alignas(64) Slot {
    ChunkBody body = nullptr;
    void* ctx = nullptr;
    int64_t n = 0, grain = 1;
    alignas(64) std::atomic<int64_t> next{0};
    alignas(64) std::atomic<int64_t> done{0};
    alignas(64) std::atomic<uint64_t> state{0};  // (seq << 32) | kOpen | active threads
  };

  // Takes chunks of the slot's job until none is left; then adds the items done to slot.done.
  void take_chunks(Slot& slot) {
    const bool nested = tl_in_body;
    tl_in_body = true;
    int64_t items = 0;
    for (;;) {
      const int64_t i = slot.next.fetch_add(slot.grain, std::memory_order_relaxed);
      if (i >= slot.n) break;
      const int64_t e = slot.n - i < slot.grain ? slot.n : i + slot.grain;
      slot.body(slot.ctx, i, e);
      items += e - i;
    }
    if (items > 0 && slot.done.fetch_add(items, std::memory_order_seq_cst) + items == slot.n)
      wake_sleepers(caller_word_, caller_sleepers_);
    tl_in_body = nested;
  }

  void worker_loop() {
    tl_in_body = true;
    uint32_t seen = 0;
    for (;;) {
      wait_until(job_seq_, worker_sleepers_, [&] {
        return job_seq_.load(std::memory_order_acquire) != seen || stop_.load(std::memory_order_relaxed);
      });
      if (stop_.load(std::memory_order_acquire)) return;
      seen = job_seq_.load(std::memory_order_acquire);
      Slot& slot = slots_[seen & 1];
      uint64_t s = slot.state.load(std::memory_order_acquire);
      bool joined = false;
      while ((uint32_t)(s >> 32) == seen && (s & kOpen)) {
        if (slot.state.compare_exchange_weak(s, s + 1, std::memory_order_acq_rel)) {
          joined = true;
          break;
        }
      }
      if (!joined) continue;  // the job was over before this thread got to it
      take_chunks(slot);
      tl_in_body = true;
      if (((slot.state.fetch_sub(1, std::memory_order_seq_cst) - 1) & kActive) == 0)
        wake_sleepers(caller_word_, caller_sleepers_);  // a caller may wait for this slot
    }
  }

  const int num_threads_;
  std::vector<std::thread> workers_;
  Slot slots_[2];
  alignas(64) std::atomic<uint32_t> job_seq_{0};  // the latest job; futex word of idle workers
  std::atomic<int> worker_sleepers_{0};
  alignas(64) std::atomic<uint32_t> caller_word_{0};  // futex word of the waiting caller
  std::atomic<int> caller_sleepers_{0};
  std::atomic<bool> stop_{false};
};

thread_local int tl_num_threads = 1;
thread_local std::unique_ptr<Team> tl_team;

}  // namespace

void run_chunks(ChunkBody body, void* ctx, int64_t n, int64_t grain) {
  if (n <= 0) return;
  if (grain < 1) grain = 1;
  if (tl_num_threads == 1 || tl_in_body || n <= grain) {
    body(ctx, 0, n);
    return;
  }
  if (tl_team == nullptr || tl_team->num_threads() != tl_num_threads) {
    tl_team.reset();
    tl_team = std::make_unique<Team>(tl_num_threads);
  }
  tl_team->run(body, ctx, n, grain);
}

int team_threads() { return tl_num_threads; }

void set_spin_us(int us) { g_spin_us.store(us < 0 ? 0 : us, std::memory_order_relaxed); }

}  // namespace lmkit::ops::cpu

namespace lmkit::ops {
void set_num_threads(int num_threads) {
  LMKIT_CHECK_ARG(num_threads >= 1, "set_num_threads: num_threads must be >= 1, got ", num_threads);
  cpu::tl_num_threads = num_threads;
}
}  // namespace lmkit::ops
