// Policy: which sequences run in the next step and how many of their tokens.
// Host-only; hands the model runner a plain BatchPlan.
//
// One step (schedule()):
//   1. running sequences, oldest first: a decode takes 1 token (and its draft tokens, as far as the prefill
//      token budget and free blocks allow: drafts never preempt), a partly prefilled prompt the next chunk
//      under the prefill token budget and the step's prompt cap (PromptCaps); when the pool cannot grow a
//      sequence, the newest running sequence is preempted (blocks freed, recomputed later from its tokens,
//      output unchanged);
//   2. waiting sequences in FCFS order are admitted while blocks, batch slots, budget and prompt cap last;
//      admission never skips ahead of the head of the queue. With prefix caching, an admitted sequence first takes
//      the cached blocks of its longest matching prefix and computes only the rest.
// A sequence that could never fit (its token limit beyond the pool) is refused by add().
//
// Sliding windows (attention_window_tokens = W > 0): a query at position p reads keys k with p - k < W.
// The next query of a sequence sits at position >= num_computed_tokens, so once tokens are computed
// (advance()) a block covering [b * bs, (b + 1) * bs) that no future query can read,
//   (b + 1) * bs <= horizon - W + 1,   horizon = num_computed_tokens,
// goes back to the pool (keyed -> cached, unkeyed -> free, at its last reference) and its block_table
// entry becomes kNoBlock:
//
//   positions  0   4   8   12  16  20        bs = 4, W = 6, num_computed_tokens = 18
//   table     [-1][-1][-1][ 7][ 3]           queries >= 18 read keys >= 13: entries 3 and 4
//
// The holes are always exactly the first num_dead_blocks() entries. A sequence with completions still to
// fork keeps the blocks its completions will read: its horizon is min(num_computed_tokens, the first
// position they compute).
//
// Recurrent state (a StatePool with slots: the model has recurrent layers): a running sequence holds a state
// slot, and one more per completion it will fork, taken at admission (admission waits for them as for
// blocks) and given back when it stops running (finish, cancel, preemption: recomputed from position 0 like
// its KV). A parent's prompt chunks stop at its fork position (fork_position()), and the step that computes
// on from there first copies its state into the reserved slots (BatchPlan::state_copies), so each completion
// starts at the fork position with the state as of it.
// With prefix caching, the state is also kept at that position (the last block boundary before the prompt's last
// token) in a snapshot slot keyed by the prefix (its tokens, compared exactly on a hit), the same way: the chunk
// stops there and the next step copies the state out first. A prefix hit takes the longest cached prefix that has
// a snapshot (at most the blocks it found) and starts from a copy of it. Snapshots are a cache: the least
// recently used one gives its slot up whenever a sequence needs one and none is free.
// Speculative decoding: a decode with k draft rows also takes k checkpoint slots (from the num_draft_state_slots
// kept for them; fewer drafts when fewer are free), where the step leaves the state as of each of its first k rows
// (Sequence::draft_state_slots). advance() keeps the one as of the last row that stands: it becomes the sequence's
// slot (no copy), and the others, the old slot among them when a draft was rejected, go back.
#pragma once
#include <stdint.h>

#include <deque>
#include <memory>
#include <string>
#include <unordered_map>
#include <vector>

#include "engine/block_manager.h"
#include "engine/request.h"
#include "engine/state_pool.h"

namespace lmkit {

// A second tier behind the pool's prefix cache: blocks evicted from the pool that can be read back (the disk store,
// engine/kv_store.h, through the engine). When a sequence's prefix chain ends in the pool, the scheduler continues
// it here and reads the blocks into freshly allocated ones, which then count as computed.
class PrefixTier {
 public:
  virtual ~PrefixTier() = default;
  // Whether the tier may hold the block keyed `key` (a cheap check; load() confirms).
  virtual bool contains(uint64_t key) = 0;
  // Fills pool block `block` (block >= 0) with the tier's copy of the block keyed `key` holding exactly `tokens`,
  // or, with block kNoBlock, only confirms that the tier holds it. False: not usable (the chain ends there).
  virtual bool load(uint64_t key, const int32_t* tokens, int32_t block) = 0;
};

struct SchedulerConfig {
  int32_t max_batch_size = 64;          // running sequences at most
  int32_t max_prefill_token_num = 8192;  // prompt tokens per step at most
  int32_t session_len = 4096;           // tokens per sequence at most (prompt + output)
  bool enable_prefix_caching = false;   // reuse full blocks of identical prefixes
  // > 0: every layer of the model attends at most this many positions back (a query at p reads keys k with
  // p - k < attention_window_tokens), so blocks behind the window are freed early; 0: no window (the model
  // has a layer of full attention).
  int32_t attention_window_tokens = 0;
  // Of the state pool's slots, those kept for speculative decoding's checkpoints (a model with recurrent layers):
  // a decode's j-th draft row needs one for the state as of it, held during the step only; sequences and snapshots
  // never take them.
  int32_t num_draft_state_slots = 0;
};

// One sequence's share of a step: tokens[start_pos, start_pos + num_tokens) are fed.
struct ScheduledSeq {
  Sequence* seq = nullptr;
  int32_t start_pos = 0;
  int32_t num_tokens = 0;
  bool is_sampled = false;  // the chunk reaches the last known token: its logits row is sampled
  // A decode's draft tokens (Sequence::draft_tokens) after its last known token: the chunk's last rows, each
  // sampled too (speculative decoding verifies them; engine/speculative.h).
  int32_t num_draft_tokens = 0;
};

// The prompt tokens a step may take (engine/prompt_pacer.h sizes them from measured step times), below the
// token budget: `alone` when no running sequence decodes, `beside_decodes` when some do. Beside decodes, whatever
// `beside_decodes` is, a step may take up to `finish` tokens for prompts that end within them, and for the first
// chunk (up to `chunk` tokens) of requests it admits: a request starts at once and a short prompt ends at once;
// only the middle of a long prompt waits for the cap. Paced, the shortest
// prompt goes first: a running prompt takes no token in a step where a shorter one takes them (a later running
// prompt with fewer tokens to compute, or the head of the queue when it can be admitted now), so a short request
// is not queued behind a long prompt.
struct PromptCaps {
  int32_t alone = INT32_MAX;
  int32_t beside_decodes = INT32_MAX;
  int32_t chunk = 0;
  int32_t finish = 0;
  bool paced = false;
};

// Copy the recurrent state of slot src into slot dst before the step's forward.
struct StateCopy {
  int32_t src = 0;
  int32_t dst = 0;
};

struct BatchPlan {
  std::vector<ScheduledSeq> seqs;  // decodes and prefill chunks, fused into one forward
  std::vector<StateCopy> state_copies;  // applied before the forward
  int32_t num_tokens = 0;
  int32_t num_prefill_tokens = 0;
  int32_t num_decode_tokens = 0;
  int32_t num_draft_tokens = 0;
  bool empty() const { return seqs.empty(); }
};

class Scheduler {
 public:
  // states: the recurrent-state slots (nullptr or empty: the model has none).
  Scheduler(const SchedulerConfig& config, BlockManager& blocks, StatePool* states = nullptr);

  // Empty when seq (and the completions it forks) can fit the pool at its token limit; otherwise why it
  // never can. With a window the bound is the most blocks a sequence can hold live (max_live_blocks()).
  std::string fit_error(const Sequence& seq) const;
  // waiting <- seq. Requires fit_error(*seq) to be empty.
  void add(std::unique_ptr<Sequence> seq);
  // Removes a sequence in any state, freeing its blocks; nullptr if unknown.
  std::unique_ptr<Sequence> remove(int64_t id);
  Sequence* find(int64_t id) const;
  // The sequences (completions) of one caller request id.
  std::vector<Sequence*> find_request(int64_t request_id) const;
  // Forks parent's num_forks completions: each shares the parent's full prompt blocks (all but the block
  // holding the last prompt token; the parent's holes stay holes), recomputes the rest and samples on its
  // own; they join running. Then the parent frees the blocks only its completions needed.
  // Call right after parent's prompt is computed, before its first token is appended.
  void fork(Sequence* parent);
  // Ids of every sequence held (running and waiting).
  std::vector<int64_t> ids() const;

  // Builds the next step's plan; allocates the blocks it needs, preempting when short.
  BatchPlan schedule(const PromptCaps& caps = PromptCaps{});
  // After a step ran: seq's num_computed_tokens += s.num_tokens; newly full blocks join the prefix cache;
  // then, with a window, blocks no future query can read go back to the pool (holes in the table).
  void advance(const ScheduledSeq& s) { advance(s, s.num_tokens); }
  // The same when only the chunk's first num_kept rows stand (a verification rejected the drafts after them;
  // the accepted ones are appended to seq's tokens already): their K/V is kept, the rejected rows' is
  // overwritten when those positions are computed again, and blocks past the sequence's tokens go back.
  void advance(const ScheduledSeq& s, int32_t num_kept);

  int32_t num_running() const { return (int32_t)running_.size(); }
  int32_t num_waiting() const { return (int32_t)waiting_.size(); }
  int64_t num_preemptions() const { return num_preemptions_; }
  int64_t num_prefix_query_tokens() const { return num_prefix_query_tokens_; }
  int64_t num_prefix_hit_tokens() const { return num_prefix_hit_tokens_; }
  // Blocks that went back to the pool (free or cached) early, because they fell out of the window.
  int64_t num_window_freed_blocks() const { return num_window_freed_blocks_; }
  int32_t num_state_snapshots() const { return (int32_t)snapshots_.size(); }
  // Draft rows the next step can checkpoint (a model with recurrent state; INT32_MAX without).
  int32_t num_free_draft_slots() const {
    return has_state() ? config_.num_draft_state_slots - num_held_draft_slots_ : INT32_MAX;
  }
  // The second tier (nullptr: none): admissions continue their prefix chains there (prefix caching, no state).
  // max_blocks_per_step > 0: while other sequences run, an admission reads at most that many blocks from the
  // tier in a step and waits at the head of the queue for the rest (the blocks read are cached in the pool
  // meanwhile), so a long prefix read back from disk does not hold up their steps; 0: all at once.
  void set_prefix_tier(PrefixTier* tier, int32_t max_blocks_per_step = 0) {
    tier_ = tier;
    max_tier_blocks_per_step_ = max_blocks_per_step;
  }
  // Admissions whose chain went on past the pool and asked the tier, those that found nothing there, and the
  // prompt tokens read back from it (counted in num_prefix_hit_tokens too).
  int64_t num_tier_lookups() const { return num_tier_lookups_; }
  int64_t num_tier_missed_lookups() const { return num_tier_missed_lookups_; }
  int64_t num_tier_hit_tokens() const { return num_tier_hit_tokens_; }
  bool has_work() const { return !running_.empty() || !waiting_.empty(); }
  const std::vector<Sequence*>& running() const { return running_; }

  // Leading block_table entries of seq that are holes once its computed tokens are advanced: 0 without
  // a window.
  int32_t num_dead_blocks(const Sequence& seq) const;
  // Where seq's forked completions start computing: the first position of the block holding its last prompt
  // token (they share the full blocks before it).
  int32_t fork_position(const Sequence& seq) const;
  bool has_state() const { return states_ != nullptr && states_->enabled(); }
  // The most blocks seq can hold at once up to its token limit (each completion it forks, as many).
  int32_t max_live_blocks(const Sequence& seq) const;

  // Throws lmkit::Error when bookkeeping is inconsistent: every block's reference count equals the
  // sequences holding it, tables large enough for the computed tokens, holes exactly the first
  // num_dead_blocks() entries, block manager consistent.
  void verify() const;

 private:
  static bool is_last_chunk_sampled(const Sequence& seq, int32_t chunk);
  // Grows seq's block table to hold num_tokens tokens, preempting the newest running sequences
  // (never one already in plan) when short. False if seq itself had to be preempted.
  bool reserve(Sequence* seq, int32_t num_tokens, const BatchPlan& plan);
  void preempt(Sequence* seq);
  // How many of decode seq's draft tokens join its chunk (their blocks allocated).
  int32_t reserve_drafts(Sequence* seq, int32_t budget);
  void insert_waiting(Sequence* seq);
  void release_blocks(Sequence* seq);
  // Reuses cached blocks for seq's leading full blocks (never its last token: it must be computed); with a
  // window the matched blocks behind it are holes from the start. True when the tier holds more of seq's prefix
  // than this step read (set_prefix_tier's max_blocks_per_step): admit it in a later step.
  bool match_prefix(Sequence* seq);
  // After the pool's hits (seq's first num_keyed_blocks blocks, of at most max_blocks), the chain continued in the
  // tier: the blocks found are read into fresh blocks (as far as the pool has them to spare, and up to
  // max_tier_blocks_per_step_ while others run) and published. True when blocks were left to read.
  bool match_tier(Sequence* seq, int32_t max_blocks);
  // Releases seq's blocks behind the window (entries [first live, num_dead_blocks)) into holes.
  void release_dead_blocks(Sequence* seq);
  // Gives back seq's state slot, its completions' reserved ones and its draft checkpoints.
  void release_state(Sequence* seq);
  // After a verification of which the first num_kept rows stand: the checkpoint as of the last of them becomes
  // seq's state slot (when a draft was rejected); the other slots go back.
  void settle_draft_states(Sequence* seq, int32_t num_kept);
  // A stateful sequence's chunk stops at its fork position when completions or a snapshot want the state there;
  // the step that starts from there copies the state into their slots first.
  bool wants_state_at_fork_position(const Sequence& seq) const;
  int32_t cap_at_fork_position(const Sequence& seq, int32_t chunk) const;
  void plan_state_copies_at_fork_position(Sequence* seq, BatchPlan& plan);
  // Blocks behind the window a prefix hit's first query never reads are not taken: the most it takes live.
  int32_t max_live_hit_blocks() const;
  // A free state slot, taking the least recently used snapshot's when none is free. Requires can_take_slots(1).
  int32_t take_slot();
  bool can_take_slots(int32_t n) const { return n <= num_free_sequence_slots() + (int32_t)snapshots_.size(); }
  // Free slots less those kept for draft checkpoints (never negative: drafts take only the slots kept for them).
  int32_t num_free_sequence_slots() const {
    return states_->num_free_slots() - (config_.num_draft_state_slots - num_held_draft_slots_);
  }
  // Slots for sequences and snapshots: the pool less those kept for draft checkpoints.
  int32_t num_sequence_slots() const { return states_->num_total_slots() - config_.num_draft_state_slots; }
  // A stateful sequence's prefix hit: takes the blocks of the longest cached prefix that has a snapshot and
  // returns the snapshot's slot (-1: no hit).
  int32_t match_prefix_with_state(Sequence* seq);

  SchedulerConfig config_;
  BlockManager& blocks_;
  StatePool* states_;
  std::unordered_map<int64_t, std::unique_ptr<Sequence>> seqs_;
  std::vector<Sequence*> running_;  // ordered by arrival, oldest first
  std::deque<Sequence*> waiting_;   // ordered by arrival, oldest first
  int64_t next_arrival_ = 0;
  int64_t next_fork_id_ = -1;  // forked completions get negative sequence ids
  int64_t num_preemptions_ = 0;
  int64_t num_prefix_query_tokens_ = 0;
  int64_t num_prefix_hit_tokens_ = 0;
  int64_t num_window_freed_blocks_ = 0;
  PrefixTier* tier_ = nullptr;
  int32_t max_tier_blocks_per_step_ = 0;
  int64_t num_tier_lookups_ = 0, num_tier_missed_lookups_ = 0, num_tier_hit_tokens_ = 0;
  // Recurrent-state snapshots (prefix caching): key of the prefix's last block -> its slot and exact tokens.
  struct Snapshot {
    int32_t slot = 0;
    uint64_t last_used = 0;
    std::vector<int32_t> tokens;
  };
  std::unordered_map<uint64_t, Snapshot> snapshots_;
  uint64_t snapshot_tick_ = 0;
  int32_t num_held_draft_slots_ = 0;  // draft checkpoints held (during a step only)
};

}  // namespace lmkit
