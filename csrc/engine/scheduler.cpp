#include "engine/scheduler.h"

#include <algorithm>

#include "core/check.h"

namespace lmkit {

Scheduler::Scheduler(const SchedulerConfig& config, BlockManager& blocks, StatePool* states)
    : config_(config), blocks_(blocks), states_(states) {
  LMKIT_CHECK(config.max_batch_size > 0, "max_batch_size must be > 0");
  LMKIT_CHECK(config.max_prefill_token_num > 0, "max_prefill_token_num must be > 0");
  LMKIT_CHECK(config.attention_window_tokens >= 0, "attention_window_tokens must be >= 0 (0: no window), got ",
              config.attention_window_tokens);
  LMKIT_CHECK(config.num_draft_state_slots == 0 ||
                  (config.num_draft_state_slots > 0 && states != nullptr &&
                   config.num_draft_state_slots < states->num_total_slots()),
              "num_draft_state_slots (", config.num_draft_state_slots, ") must leave slots of the state pool (",
              states ? states->num_total_slots() : 0, ") for sequences");
}

int32_t Scheduler::num_dead_blocks(const Sequence& seq) const {
  const int32_t window = config_.attention_window_tokens;
  if (window == 0) return 0;
  const int32_t bs = blocks_.block_size_tokens();
  int32_t horizon = seq.num_computed_tokens;  // no future query sits below it
  if (seq.num_forks > 0) horizon = std::min(horizon, (seq.num_prompt_tokens - 1) / bs * bs);  // where forks start
  return std::max(0, (horizon - window + 1) / bs);  // blocks b with (b + 1) * bs <= horizon - window + 1
}

int32_t Scheduler::fork_position(const Sequence& seq) const {
  const int32_t bs = blocks_.block_size_tokens();
  return (seq.num_prompt_tokens - 1) / bs * bs;
}

int32_t Scheduler::max_live_blocks(const Sequence& seq) const {
  const int32_t whole = blocks_.num_blocks_for(seq.max_total_tokens);
  const int32_t window = config_.attention_window_tokens;
  if (window == 0) return whole;
  // When a step is planned for a chunk tokens[c, c + n), the sequence holds the blocks of positions
  // [c - W + 1, c + n): keys its first query reads, up to its last token. That is at most W - 1 + n
  // positions with n <= max_prefill_token_num (a decode is 1), and a run of m positions at any offset
  // touches at most (m + bs - 2) / bs + 1 blocks:
  //
  //   bs = 4, m = 15:  [..xx][xxxx][xxxx][xxxx][x...]  5 blocks (4 if it started on a boundary)
  //
  // A parent waiting to fork keeps up to bs - 1 more positions (its horizon is held back to a block
  // boundary): one more block.
  const int64_t bs = blocks_.block_size_tokens();
  const int64_t chunk = std::min(config_.max_prefill_token_num, seq.max_total_tokens);
  const int64_t span = window - 1 + std::max<int64_t>(chunk, 1);
  const int64_t live = (span + bs - 2) / bs + 1 + (seq.num_forks > 0 ? 1 : 0);
  return (int32_t)std::min<int64_t>(live, whole);
}

std::string Scheduler::fit_error(const Sequence& seq) const {
  const int32_t limit = seq.max_total_tokens;
  const int32_t shared = (seq.num_prompt_tokens - 1) / blocks_.block_size_tokens();
  const int32_t whole = blocks_.num_blocks_for(limit);
  int64_t need = whole + (int64_t)seq.num_forks * (whole - shared);
  // With a window each of the 1 + num_forks sequences holds at most max_live_blocks (shared ones counted
  // for each holder); either bound holds, so the smaller does.
  if (config_.attention_window_tokens > 0)
    need = std::min<int64_t>(need, (1 + (int64_t)seq.num_forks) * max_live_blocks(seq));
  if (has_state() && 1 + seq.num_forks > num_sequence_slots())
    return detail::concat("the request's ", 1 + seq.num_forks, " completions need as many recurrent-state slots, but "
                          "the pool has ", num_sequence_slots(), " (sized at start-up by max_batch_size and memory); lower n");
  if (need <= blocks_.num_total_blocks()) return "";
  const std::string window =
      config_.attention_window_tokens > 0
          ? detail::concat(" within an attention window of ", config_.attention_window_tokens, " tokens")
          : std::string();
  return detail::concat("the request needs up to ", limit, " tokens (prompt ", seq.num_prompt_tokens,
                        " + max_new_tokens", seq.num_forks ? ", for each of n completions" : "", ")", window,
                        " = ", need, " KV blocks of ", blocks_.block_size_tokens(),
                        " tokens, but the whole KV pool has ", blocks_.num_total_blocks(),
                        " blocks; lower max_new_tokens or raise cache_max_entry_count");
}

void Scheduler::add(std::unique_ptr<Sequence> seq) {
  LMKIT_CHECK(seq && seqs_.count(seq->id) == 0, "request id ", seq ? seq->id : -1, " is already in the engine");
  const std::string why = fit_error(*seq);
  LMKIT_CHECK(why.empty(), why);
  seq->state = SeqState::kWaiting;
  seq->arrival = next_arrival_++;
  Sequence* raw = seq.get();
  seqs_.emplace(raw->id, std::move(seq));
  waiting_.push_back(raw);
}

Sequence* Scheduler::find(int64_t id) const {
  auto it = seqs_.find(id);
  return it == seqs_.end() ? nullptr : it->second.get();
}

std::vector<Sequence*> Scheduler::find_request(int64_t request_id) const {
  std::vector<Sequence*> out;
  for (const auto& kv : seqs_)
    if (kv.second->request_id == request_id) out.push_back(kv.second.get());
  return out;
}

void Scheduler::fork(Sequence* parent) {
  const int32_t bs = blocks_.block_size_tokens();
  const int32_t shared = std::min<int32_t>((parent->num_prompt_tokens - 1) / bs, (int32_t)parent->block_table.size());
  for (int32_t k = 1; k <= parent->num_forks; ++k) {
    auto child = std::make_unique<Sequence>();
    child->id = next_fork_id_--;
    child->request_id = parent->request_id;
    child->sample_index = k;
    child->tokens.assign(parent->tokens.begin(), parent->tokens.begin() + parent->num_prompt_tokens);
    child->num_prompt_tokens = parent->num_prompt_tokens;
    child->max_total_tokens = parent->max_total_tokens;
    child->params = parent->params;
    child->num_prompt_logprobs_emitted = parent->num_prompt_logprobs_emitted;  // the prompt is scored once
    child->scheduled_at = parent->scheduled_at;  // queued with its parent
    child->callback = parent->callback;
    child->seed = parent->sample_seed(-1 - k);  // deterministic given the parent's seed, distinct per completion
    // the parent held the blocks a query at shared * bs reads, so the child's holes are its dead blocks
    child->block_table.assign(parent->block_table.begin(), parent->block_table.begin() + shared);
    blocks_.share(child->block_table);  // active -> active, one more reference each
    child->num_computed_tokens = shared * bs;
    if (has_state()) child->state_slot = parent->fork_state_slots[k - 1];  // its state as of shared * bs
    child->state = SeqState::kRunning;
    child->arrival = next_arrival_++;
    running_.push_back(child.get());
    seqs_.emplace(child->id, std::move(child));
  }
  parent->num_forks = 0;
  parent->fork_state_slots.clear();
  release_dead_blocks(parent);  // those only its completions needed
}

std::vector<int64_t> Scheduler::ids() const {
  std::vector<int64_t> out;
  for (const auto& kv : seqs_) out.push_back(kv.first);
  return out;
}

std::unique_ptr<Sequence> Scheduler::remove(int64_t id) {
  auto it = seqs_.find(id);
  if (it == seqs_.end()) return nullptr;
  std::unique_ptr<Sequence> seq = std::move(it->second);
  seqs_.erase(it);
  running_.erase(std::remove(running_.begin(), running_.end(), seq.get()), running_.end());
  waiting_.erase(std::remove(waiting_.begin(), waiting_.end(), seq.get()), waiting_.end());
  release_blocks(seq.get());
  release_state(seq.get());
  seq->state = SeqState::kFinished;
  return seq;
}

void Scheduler::insert_waiting(Sequence* seq) {
  auto pos = std::lower_bound(waiting_.begin(), waiting_.end(), seq,
                              [](const Sequence* a, const Sequence* b) { return a->arrival < b->arrival; });
  waiting_.insert(pos, seq);
}

void Scheduler::release_blocks(Sequence* seq) {
  blocks_.release(seq->block_table);
  seq->num_computed_tokens = 0;
  seq->num_keyed_blocks = 0;
  seq->last_block_key = 0;
}

void Scheduler::release_state(Sequence* seq) {
  if (seq->state_slot >= 0) states_->release(seq->state_slot);
  for (int32_t slot : seq->fork_state_slots) states_->release(slot);
  seq->state_slot = -1;
  seq->fork_state_slots.clear();
  seq->fork_states_copied = false;
  settle_draft_states(seq, 0);
}

void Scheduler::settle_draft_states(Sequence* seq, int32_t num_kept) {
  std::vector<int32_t>& drafts = seq->draft_state_slots;
  // Row num_kept - 1 is the last that stands; the state as of it is checkpoint num_kept - 1, or the slot itself
  // when every draft was kept (the slot holds the state as of the step's last row).
  if (num_kept >= 1 && num_kept - 1 < (int32_t)drafts.size()) std::swap(seq->state_slot, drafts[num_kept - 1]);
  for (int32_t slot : drafts) states_->release(slot);
  num_held_draft_slots_ -= (int32_t)drafts.size();
  drafts.clear();
}

bool Scheduler::wants_state_at_fork_position(const Sequence& seq) const {
  return has_state() && (seq.num_forks > 0 || config_.enable_prefix_caching) && fork_position(seq) > 0;
}

int32_t Scheduler::cap_at_fork_position(const Sequence& seq, int32_t chunk) const {
  if (!wants_state_at_fork_position(seq) || seq.num_computed_tokens >= fork_position(seq)) return chunk;
  return std::min(chunk, fork_position(seq) - seq.num_computed_tokens);
}

int32_t Scheduler::take_slot() {
  if (num_free_sequence_slots() == 0) {
    LMKIT_CHECK(!snapshots_.empty(), "no state slot to take");
    auto lru = snapshots_.begin();
    for (auto it = snapshots_.begin(); it != snapshots_.end(); ++it)
      if (it->second.last_used < lru->second.last_used) lru = it;
    states_->release(lru->second.slot);
    snapshots_.erase(lru);
  }
  return states_->allocate();
}

void Scheduler::plan_state_copies_at_fork_position(Sequence* seq, BatchPlan& plan) {
  // At position 0 the completions start from the zero state like any sequence: nothing to copy.
  if (!wants_state_at_fork_position(*seq) || seq->num_computed_tokens != fork_position(*seq)) return;
  if (seq->num_forks > 0 && !seq->fork_states_copied) {
    for (int32_t slot : seq->fork_state_slots) plan.state_copies.push_back({seq->state_slot, slot});
    seq->fork_states_copied = true;
  }
  const int32_t bs = blocks_.block_size_tokens();
  if (!config_.enable_prefix_caching || seq->num_keyed_blocks * bs != seq->num_computed_tokens ||
      snapshots_.count(seq->last_block_key) > 0 || !can_take_slots(1))
    return;
  Snapshot snap;
  snap.slot = take_slot();
  snap.last_used = ++snapshot_tick_;
  snap.tokens.assign(seq->tokens.begin(), seq->tokens.begin() + seq->num_computed_tokens);
  plan.state_copies.push_back({seq->state_slot, snap.slot});
  snapshots_.emplace(seq->last_block_key, std::move(snap));
}

int32_t Scheduler::match_prefix_with_state(Sequence* seq) {
  if (!config_.enable_prefix_caching || seq->params.reads_prompt_rows() || !seq->block_table.empty() ||
      snapshots_.empty())
    return -1;
  const int32_t bs = blocks_.block_size_tokens();
  const int32_t max_blocks = (seq->num_tokens() - 1) / bs;
  std::vector<std::pair<int32_t, uint64_t>> candidates;  // (blocks, key) of the snapshots of this prompt's prefixes
  uint64_t key = 0;
  for (int32_t j = 1; j <= max_blocks; ++j) {
    key = block_key(key, seq->tokens.data() + (int64_t)(j - 1) * bs, bs);
    auto it = snapshots_.find(key);
    if (it != snapshots_.end() && (int64_t)it->second.tokens.size() == (int64_t)j * bs &&
        std::equal(it->second.tokens.begin(), it->second.tokens.end(), seq->tokens.begin()))
      candidates.emplace_back(j, key);
  }
  const int32_t max_live = max_live_hit_blocks();
  int32_t limit = max_blocks;
  for (auto c = candidates.rbegin(); c != candidates.rend(); ++c) {
    if (c->first > limit) continue;
    uint64_t last = 0;
    const int32_t hits = blocks_.match_prefix(seq->tokens.data(), c->first, seq->block_table, &last, max_live);
    if (hits == c->first) {
      seq->num_computed_tokens = hits * bs;
      seq->num_keyed_blocks = hits;
      seq->last_block_key = last;
      Snapshot& snap = snapshots_.at(c->second);
      snap.last_used = ++snapshot_tick_;
      return snap.slot;
    }
    release_blocks(seq);  // some of its blocks were evicted: a shorter prefix, if one has a snapshot
    limit = hits;
  }
  return -1;
}

int32_t Scheduler::max_live_hit_blocks() const {
  // A query at a block boundary reads the (W - 1 + bs - 1) / bs blocks before it: the matched ones before
  // those are dead (num_dead_blocks() at num_computed_tokens = hits * bs) and never taken.
  const int32_t window = config_.attention_window_tokens, bs = blocks_.block_size_tokens();
  return window > 0 ? (window - 1 + bs - 1) / bs : INT32_MAX;
}

bool Scheduler::match_prefix(Sequence* seq) {
  if (!config_.enable_prefix_caching || has_state() || seq->params.reads_prompt_rows() || !seq->block_table.empty())
    return false;
  const int32_t bs = blocks_.block_size_tokens();
  const int32_t max_blocks = (seq->num_tokens() - 1) / bs;
  uint64_t key = 0;
  const int32_t hits =
      blocks_.match_prefix(seq->tokens.data(), max_blocks, seq->block_table, &key, max_live_hit_blocks());
  seq->num_computed_tokens = hits * bs;
  seq->num_keyed_blocks = hits;
  seq->last_block_key = key;
  return tier_ != nullptr && match_tier(seq, max_blocks);
}

bool Scheduler::match_tier(Sequence* seq, int32_t max_blocks) {
  const int32_t k = seq->num_keyed_blocks;  // the pool's hits: blocks [0, k)
  if (k >= max_blocks) return false;
  ++num_tier_lookups_;
  const int32_t bs = blocks_.block_size_tokens();
  const int32_t* tokens = seq->tokens.data();
  std::vector<uint64_t> keys;  // of blocks [k, k + n) that the tier may hold
  for (uint64_t key = seq->last_block_key; k + (int32_t)keys.size() < max_blocks;) {
    key = block_key(key, tokens + (int64_t)(k + keys.size()) * bs, bs);
    if (!tier_->contains(key)) break;
    keys.push_back(key);
  }
  // After the extension the live blocks are the last max_live of [0, k + n) (all of them without a window): the
  // fresh ones among them take pool blocks, and one block stays for the first chunk.
  const int32_t max_live = max_live_hit_blocks();
  int32_t n = (int32_t)keys.size();
  const int32_t spare = blocks_.num_available_blocks() - 1;
  if (std::min(n, max_live) > spare) n = std::max(0, spare);
  if (n == 0) {
    ++num_tier_missed_lookups_;
    return false;
  }
  // While others run, a step reads a bounded share, so that their steps do not wait on a long read (without a
  // window only: with one, the holes' bookkeeping below reads a chain in one pass).
  bool more = false;
  if (max_tier_blocks_per_step_ > 0 && max_live == INT32_MAX && !running_.empty() && n > max_tier_blocks_per_step_) {
    n = max_tier_blocks_per_step_;
    more = true;
  }
  const int32_t first_live = max_live == INT32_MAX ? 0 : std::max(0, k + n - max_live);
  // the pool's hits now behind the window become holes (active -> cached)
  if (first_live > 0) blocks_.release_range(seq->block_table, 0, std::min(first_live, k));
  uint64_t parent = seq->last_block_key;
  int32_t loaded = 0;
  for (int32_t i = k; i < k + n; ++i, ++loaded) {
    const int32_t* block_tokens = tokens + (int64_t)i * bs;
    const uint64_t key = keys[i - k];
    if (i < first_live) {  // a hole: confirmed, not read
      if (!tier_->load(key, block_tokens, kNoBlock)) break;
      seq->block_table.push_back(kNoBlock);
    } else {
      blocks_.allocate(1, seq->block_table);  // free|cached -> active
      const int32_t id = seq->block_table.back();
      if (!tier_->load(key, block_tokens, id)) {
        std::vector<int32_t> unread{id};
        blocks_.release(unread);  // active -> free: it never got a key
        seq->block_table.pop_back();
        break;
      }
      blocks_.publish(id, parent, block_tokens);
    }
    parent = key;
  }
  if (loaded < n && first_live > 0) {
    // The chain ended early where the window had turned entries into holes the shorter chain needs live: start
    // over from the pool alone (the blocks read so far are cached now, so the pool finds them).
    release_blocks(seq);
    seq->num_computed_tokens = seq->num_keyed_blocks = 0;
    uint64_t key = 0;
    const int32_t hits =
        blocks_.match_prefix(seq->tokens.data(), max_blocks, seq->block_table, &key, max_live_hit_blocks());
    num_tier_hit_tokens_ += (int64_t)std::max(0, hits - k) * bs;
    if (hits <= k) ++num_tier_missed_lookups_;
    seq->num_computed_tokens = hits * bs;
    seq->num_keyed_blocks = hits;
    seq->last_block_key = key;
    return false;
  }
  if (loaded == 0) ++num_tier_missed_lookups_;
  num_tier_hit_tokens_ += (int64_t)loaded * bs;
  seq->num_keyed_blocks = k + loaded;
  seq->num_computed_tokens = (k + loaded) * bs;
  seq->last_block_key = parent;
  return more && loaded == n;  // a block that failed to read ends the chain: no more to wait for
}

void Scheduler::release_dead_blocks(Sequence* seq) {
  // The holes are a prefix of the table: walk back from the dead bound to the last hole.
  const int32_t dead = num_dead_blocks(*seq);
  int32_t first = dead;
  while (first > 0 && seq->block_table[first - 1] != kNoBlock) --first;
  num_window_freed_blocks_ += blocks_.release_range(seq->block_table, first, dead);  // active -> cached|free
}

void Scheduler::advance(const ScheduledSeq& s, int32_t num_kept) {
  Sequence* seq = s.seq;
  LMKIT_CHECK(num_kept >= 0 && num_kept <= s.num_tokens && (num_kept == s.num_tokens || s.num_draft_tokens > 0),
              "sequence ", seq->id, ": ", num_kept, " of ", s.num_tokens, " rows kept");
  seq->num_computed_tokens += num_kept;
  LMKIT_CHECK(seq->num_computed_tokens <= seq->num_tokens(), "sequence ", seq->id, " computed ",
              seq->num_computed_tokens, " of ", seq->num_tokens(), " tokens");
  if (!seq->draft_state_slots.empty()) settle_draft_states(seq, num_kept);
  if (s.num_draft_tokens > 0) {  // the rejected drafts' blocks past the last token (never keyed, never shared)
    const int32_t keep = blocks_.num_blocks_for(seq->num_tokens());
    if ((int32_t)seq->block_table.size() > keep) {
      blocks_.release_range(seq->block_table, keep, (int32_t)seq->block_table.size());
      seq->block_table.resize(keep);
    }
  }
  const int32_t bs = blocks_.block_size_tokens();
  // Publish first, so a block is keyed (cached, not free) when the window releases it. A hole's key still
  // chains: it needs the parent key and the tokens, not the block.
  while (config_.enable_prefix_caching && (seq->num_keyed_blocks + 1) * bs <= seq->num_computed_tokens) {
    const int32_t i = seq->num_keyed_blocks++;
    const int32_t* tokens = seq->tokens.data() + (int64_t)i * bs;
    const int32_t id = seq->block_table[i];
    seq->last_block_key = id == kNoBlock ? block_key(seq->last_block_key, tokens, bs)
                                         : blocks_.publish(id, seq->last_block_key, tokens);
  }
  release_dead_blocks(seq);
}

void Scheduler::preempt(Sequence* seq) {
  running_.erase(std::remove(running_.begin(), running_.end(), seq), running_.end());
  release_blocks(seq);  // the tokens stay and are recomputed (or found in the prefix cache) on readmission
  release_state(seq);  // and so is the recurrent state, from position 0
  seq->state = SeqState::kWaiting;
  insert_waiting(seq);
  ++num_preemptions_;
}

bool Scheduler::reserve(Sequence* seq, int32_t num_tokens, const BatchPlan& plan) {
  const int32_t need = blocks_.num_blocks_for(num_tokens) - (int32_t)seq->block_table.size();
  if (need <= 0) return true;
  while (!blocks_.can_allocate(need)) {
    // The newest running sequence not yet planned gives its blocks back.
    Sequence* victim = running_.back();
    for (const ScheduledSeq& s : plan.seqs)
      LMKIT_CHECK(s.seq != victim, "preemption victim ", victim->id, " is already in this step's plan");
    preempt(victim);
    if (victim == seq) return false;
  }
  blocks_.allocate(need, seq->block_table);
  return true;
}

int32_t Scheduler::reserve_drafts(Sequence* seq, int32_t budget) {
  // Drafts stay within the tokens the sequence may still generate (when all are kept the last row's sample is
  // past the limit and dropped), the budget, and the blocks (and, with recurrent state, checkpoint slots) free
  // now: they never preempt.
  const int32_t room = seq->max_total_tokens - seq->num_tokens();
  int32_t drafts = std::min({(int32_t)seq->draft_tokens.size(), std::max(budget, 0), std::max(room, 0),
                              num_free_draft_slots()});
  if (drafts <= 0) return 0;
  const int32_t bs = blocks_.block_size_tokens();
  const int32_t need = blocks_.num_blocks_for(seq->num_tokens() + drafts) - (int32_t)seq->block_table.size();
  if (need > 0 && !blocks_.can_allocate(need)) {
    drafts = std::min(drafts, (int32_t)seq->block_table.size() * bs - seq->num_tokens());
    if (drafts <= 0) return 0;
  } else if (need > 0) {
    blocks_.allocate(need, seq->block_table);
  }
  if (has_state()) {  // from the slots kept for checkpoints: free, whatever sequences and snapshots hold
    LMKIT_CHECK(seq->draft_state_slots.empty(), "sequence ", seq->id, " holds draft checkpoints from a past step");
    for (int32_t j = 0; j < drafts; ++j) seq->draft_state_slots.push_back(states_->allocate());
    num_held_draft_slots_ += drafts;
  }
  return drafts;
}

// A chunk that reaches the last known token is sampled, unless the sequence may not grow (max_new_tokens 0:
// only its prompt is computed).
bool Scheduler::is_last_chunk_sampled(const Sequence& seq, int32_t chunk) {
  return chunk == seq.num_pending_tokens() && seq.num_tokens() < seq.max_total_tokens;
}

BatchPlan Scheduler::schedule(const PromptCaps& caps) {
  BatchPlan plan;
  int32_t budget = config_.max_prefill_token_num;  // rows besides one per decode: prompt tokens and drafts
  int32_t num_decoding = 0;
  int32_t batch_slots = 0;  // a running parent's completions still to fork count against max_batch_size already
  for (const Sequence* s : running_) {
    num_decoding += s->num_pending_tokens() == 1 ? 1 : 0;
    batch_slots += 1 + s->num_forks;
  }
  int32_t prompt_budget = std::min(budget, num_decoding > 0 ? caps.beside_decodes : caps.alone);
  // Beside decodes, whatever the cap: a prompt whose remaining tokens fit in what is left of caps.finish, and an
  // admission's first chunk (up to caps.chunk of it).
  int32_t free_budget = num_decoding > 0 ? std::min(budget, caps.finish) : 0;
  auto allowance = [&](int32_t pending, bool admitting) {
    const int32_t free = pending <= free_budget ? pending : admitting ? std::min(caps.chunk, free_budget) : 0;
    return std::min(budget, std::max(prompt_budget, free));
  };
  auto spend = [&](int32_t chunk) {
    budget -= chunk;
    prompt_budget = std::max(0, std::min(prompt_budget - chunk, budget));
    free_budget = std::max(0, free_budget - chunk);
  };
  // Paced: the fewest prompt tokens to compute among the running prompts after each one, and the head of the
  // queue's (INT32_MAX: none) when it can be admitted in this step (a batch slot, state slots, and blocks for
  // its first chunk without a prefix hit, so that a prompt which gives way to it never does so for nothing).
  std::vector<int32_t> shorter_after;
  int32_t head_tokens = INT32_MAX;
  if (caps.paced) {
    const Sequence* head = waiting_.empty() ? nullptr : waiting_.front();
    const int32_t first = head ? std::min(head->num_tokens(), allowance(head->num_tokens(), true)) : 0;
    if (first > 0 && batch_slots + 1 + head->num_forks <= config_.max_batch_size &&
        (!has_state() || can_take_slots(1 + head->num_forks)) && blocks_.can_allocate(blocks_.num_blocks_for(first)))
      head_tokens = head->num_tokens();
    shorter_after.assign(running_.size(), head_tokens);
    int32_t fewest = head_tokens;
    for (size_t i = running_.size(); i-- > 0;) {
      shorter_after[i] = fewest;
      const int32_t pending = running_[i]->num_pending_tokens();
      if (pending > 1) fewest = std::min(fewest, pending);
    }
  }

  // 1. running sequences, oldest first. Iterate over a snapshot: preemption shrinks running_ from the back.
  std::vector<Sequence*> snapshot = running_;
  for (size_t i = 0; i < snapshot.size(); ++i) {
    Sequence* seq = snapshot[i];
    if (seq->state != SeqState::kRunning) continue;  // preempted earlier in this loop
    const int32_t pending = seq->num_pending_tokens();
    const bool is_decode = pending == 1;
    if (!is_decode && caps.paced && shorter_after[i] < pending) continue;  // a shorter prompt goes first
    const int32_t chunk = is_decode ? 1 : cap_at_fork_position(*seq, std::min(pending, allowance(pending, false)));
    if (chunk <= 0) continue;
    if (!reserve(seq, seq->num_computed_tokens + chunk, plan)) continue;
    if (!is_decode) spend(chunk);
    plan_state_copies_at_fork_position(seq, plan);
    const bool sampled = is_last_chunk_sampled(*seq, chunk);
    // (a parent whose completions are still to fork takes none: they fork from its first sample row)
    const int32_t drafts = is_decode && sampled && seq->num_forks == 0 ? reserve_drafts(seq, budget) : 0;
    budget -= drafts;
    prompt_budget = std::min(prompt_budget, budget);
    free_budget = std::min(free_budget, budget);
    plan.seqs.push_back({seq, seq->num_computed_tokens, chunk + drafts, sampled, drafts});
  }

  // 2. waiting sequences, FCFS, while slots, budget, prompt cap and blocks last.
  batch_slots = (int32_t)running_.size();  // less the sequences preempted above
  for (const Sequence* s : running_) batch_slots += s->num_forks;
  while (!waiting_.empty() && (prompt_budget > 0 || free_budget > 0) &&
         batch_slots + 1 + waiting_.front()->num_forks <= config_.max_batch_size) {
    Sequence* seq = waiting_.front();
    if (has_state() && !can_take_slots(1 + seq->num_forks)) break;
    if (match_prefix(seq)) {
      release_blocks(seq);  // the blocks read stay cached: the next step's match finds them and reads on
      break;
    }
    // A stateful hit starts from a copy of its snapshot, the most recently used one now: the slots taken below
    // evict others first, and one spare slot keeps it.
    int32_t snapshot = has_state() ? match_prefix_with_state(seq) : -1;
    if (snapshot >= 0 && !can_take_slots(2 + seq->num_forks)) {
      release_blocks(seq);  // taking the slots would evict that snapshot: from position 0 instead
      snapshot = -1;
    }
    const int32_t pending = seq->num_pending_tokens();
    const int32_t chunk = cap_at_fork_position(*seq, std::min(pending, allowance(pending, true)));
    const int32_t need = blocks_.num_blocks_for(seq->num_computed_tokens + chunk) - (int32_t)seq->block_table.size();
    if (chunk <= 0 || !blocks_.can_allocate(need)) {
      release_blocks(seq);  // hits go back to the cache; try again next step
      break;
    }
    num_prefix_query_tokens_ += seq->num_tokens();
    num_prefix_hit_tokens_ += seq->num_computed_tokens;
    blocks_.allocate(need, seq->block_table);
    if (has_state()) {
      seq->state_slot = take_slot();
      for (int32_t k = 0; k < seq->num_forks; ++k) seq->fork_state_slots.push_back(take_slot());
      if (snapshot >= 0) plan.state_copies.push_back({snapshot, seq->state_slot});
      plan_state_copies_at_fork_position(seq, plan);  // a hit may start right at the fork position
    }
    waiting_.pop_front();
    seq->state = SeqState::kRunning;
    running_.insert(std::lower_bound(running_.begin(), running_.end(), seq,
                                     [](const Sequence* a, const Sequence* b) { return a->arrival < b->arrival; }),
                    seq);
    spend(chunk);
    batch_slots += 1 + seq->num_forks;
    plan.seqs.push_back({seq, seq->num_computed_tokens, chunk, is_last_chunk_sampled(*seq, chunk)});
  }

  for (const ScheduledSeq& s : plan.seqs) {
    plan.num_tokens += s.num_tokens;
    plan.num_draft_tokens += s.num_draft_tokens;
    if (s.seq->num_pending_tokens() == 1)
      plan.num_decode_tokens += 1;
    else
      plan.num_prefill_tokens += s.num_tokens;
  }
  return plan;
}

void Scheduler::verify() const {
  blocks_.verify();
  std::vector<int32_t> owner(blocks_.num_total_blocks(), 0);
  for (const auto& kv : seqs_) {
    const Sequence& s = *kv.second;
    LMKIT_CHECK((int32_t)s.block_table.size() >= blocks_.num_blocks_for(s.num_computed_tokens), "sequence ", s.id,
                " has ", s.block_table.size(), " blocks for ", s.num_computed_tokens, " computed tokens");
    if (s.state == SeqState::kWaiting)
      LMKIT_CHECK(s.block_table.empty() && s.num_computed_tokens == 0, "waiting sequence ", s.id, " holds blocks");
    const int32_t dead = num_dead_blocks(s);
    for (int32_t i = 0; i < (int32_t)s.block_table.size(); ++i) {
      const int32_t b = s.block_table[i];
      LMKIT_CHECK((b == kNoBlock) == (i < dead), "sequence ", s.id, " block_table[", i, "] = ", b, " with ", dead,
                  " blocks behind the window (", s.num_computed_tokens,
                  " tokens computed): the holes must be exactly those");
      if (b == kNoBlock) continue;
      LMKIT_CHECK(b >= 0 && b < blocks_.num_total_blocks(), "sequence ", s.id, " holds block id ", b);
      ++owner[b];
    }
  }
  if (states_ != nullptr) {
    states_->verify();
    std::vector<int32_t> holders(states_->num_total_slots(), 0);
    int32_t held_drafts = 0;
    for (const auto& kv : seqs_) {
      const Sequence& s = *kv.second;
      const bool running = s.state == SeqState::kRunning;
      LMKIT_CHECK((s.state_slot >= 0) == (running && has_state()), "sequence ", s.id, " (",
                  running ? "running" : "waiting", ") holds state slot ", s.state_slot);
      LMKIT_CHECK((int32_t)s.fork_state_slots.size() == (running && has_state() ? s.num_forks : 0), "sequence ", s.id,
                  " reserved ", s.fork_state_slots.size(), " state slots for ", s.num_forks, " completions");
      if (s.state_slot >= 0) ++holders.at(s.state_slot);
      for (int32_t slot : s.fork_state_slots) ++holders.at(slot);
      for (int32_t slot : s.draft_state_slots) ++holders.at(slot);
      held_drafts += (int32_t)s.draft_state_slots.size();
    }
    LMKIT_CHECK(held_drafts == num_held_draft_slots_ && held_drafts <= config_.num_draft_state_slots &&
                    num_free_sequence_slots() >= 0,
                held_drafts, " draft checkpoints held, ", num_held_draft_slots_, " counted, ",
                config_.num_draft_state_slots, " kept for them, ", states_->num_free_slots(), " slots free");
    for (const auto& kv : snapshots_) ++holders.at(kv.second.slot);
    for (int32_t i = 0; i < states_->num_total_slots(); ++i)
      LMKIT_CHECK(holders[i] == (states_->is_held(i) ? 1 : 0), "state slot ", i, " has ", holders[i],
                  " holders but is ", states_->is_held(i) ? "held" : "free");
  }
  for (int32_t b = 0; b < blocks_.num_total_blocks(); ++b)
    LMKIT_CHECK(owner[b] == blocks_.ref_count(b), "block ", b, " has ", blocks_.ref_count(b),
                " references but ", owner[b], " owners");
  LMKIT_CHECK(running_.size() + waiting_.size() == seqs_.size(), "running + waiting != sequences");
}

}  // namespace lmkit
