#include "engine/engine.h"

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <exception>
#include <iterator>

#include "core/check.h"
#include "core/clock.h"
#include "core/threads.h"

namespace lmkit {

Engine::Engine(const EngineOptions& options, std::unique_ptr<Executor> executor, std::unique_ptr<DraftModel> draft)
    : options_(options),
      executor_(std::move(executor)),
      blocks_(options.num_blocks, options.block_size_tokens),
      states_(options.num_state_slots),
      scheduler_(SchedulerConfig{options.max_batch_size, options.max_prefill_token_num, options.session_len,
                                 options.enable_prefix_caching, options.attention_window_tokens,
                                 options.num_draft_state_slots},
                 blocks_, &states_),
      stop_rules_(options.eos_token_ids),
      seed_source_(std::random_device{}()),
      answers_(options.speculative.enabled ? options.speculative.answer_store_tokens : 0,
               options.speculative.min_ngram, options.speculative.max_ngram),
      step_cost_(std::min(options.max_prefill_token_num + options.max_batch_size, 1024)),
      pacer_(options.max_prefill_token_num, options.decode_slowdown) {
  LMKIT_CHECK(executor_ != nullptr, "engine needs an executor");
  LMKIT_CHECK_ARG(options.session_len > 1, "session_len must be > 1, got ", options.session_len);
  LMKIT_CHECK((options.num_state_slots > 0) == (executor_->state_bytes_per_slot() > 0), "the model ",
              executor_->state_bytes_per_slot() > 0 ? "has" : "has no", " recurrent state but the engine was given ",
              options.num_state_slots, " state slots");
  LMKIT_CHECK(options.num_draft_state_slots == 0 || options.speculative.enabled, "draft checkpoint slots without "
              "speculative decoding");
  LMKIT_CHECK(!options.speculative.enabled || (options.speculative.max_draft_tokens >= 1 &&
                                               options.speculative.max_step_draft_tokens >= 1),
              "speculative decoding needs max_draft_tokens and max_step_draft_tokens >= 1");
  mtp_ = options.speculative.enabled && options.speculative.mtp;
  LMKIT_CHECK(!mtp_ || executor_->runs_mtp(), "speculative='mtp' with an executor that does not run its MTP head");
  mtp_greedy_.temperature = 0.0f;
  draft_ = std::move(draft);
  LMKIT_CHECK((draft_ != nullptr) == (options.speculative.enabled && options.speculative.draft_model),
              "speculative='draft' needs a draft model, and a draft model needs speculative='draft'");
  LMKIT_CHECK(!(mtp_ && draft_), "speculative='mtp' and a draft model exclude each other");
  executor_->allocate_kv_pool(options.num_blocks);
  if (options.num_state_slots > 0) executor_->allocate_state_pool(options.num_state_slots);
  if (!options.kv_cache_dir.empty()) start_store();
  metrics_.num_total_blocks = options.num_blocks;
  metrics_.num_free_blocks = options.num_blocks;
  metrics_.num_total_state_slots = metrics_.num_free_state_slots = options.num_state_slots;
  published_metrics_ = metrics_;
  callback_thread_ = std::thread([this] { callback_loop(); });
  loop_thread_ = std::thread([this] { loop(); });
}

Engine::~Engine() { shutdown(); }

void Engine::submit(int64_t request_id, std::vector<int32_t> prompt, const SamplingParams& params,
                    OutputCallback callback) {
  params.check_invariants();
  LMKIT_CHECK_ARG(!prompt.empty(), "the prompt is empty: give at least one token");
  LMKIT_CHECK_ARG((int32_t)prompt.size() < options_.session_len, "the prompt has ", prompt.size(),
                  " tokens, which leaves no room in session_len=", options_.session_len,
                  "; shorten the prompt or raise session_len");
  for (int32_t t : prompt)
    LMKIT_CHECK_ARG(t >= 0 && t < options_.vocab_size, "token id ", t, " is outside the vocabulary [0, ",
                    options_.vocab_size, ")");
  LMKIT_CHECK_ARG(params.n <= options_.max_batch_size, "n=", params.n, " completions exceed max_batch_size=",
                  options_.max_batch_size);
  for (int32_t t : params.stop_token_ids)
    LMKIT_CHECK_ARG(t >= 0 && t < options_.vocab_size, "stop token id ", t, " is outside the vocabulary [0, ",
                    options_.vocab_size, ")");
  if (params.grammar)
    LMKIT_CHECK_ARG(params.grammar->tokenizer().vocab_size() == options_.vocab_size, "the grammar was compiled for "
                    "a vocabulary of ", params.grammar->tokenizer().vocab_size(), " ids, this model has ",
                    options_.vocab_size);
  LMKIT_CHECK_ARG(params.grammar_after_token < options_.vocab_size, "grammar_after_token ",
                  params.grammar_after_token, " is outside the vocabulary [0, ", options_.vocab_size, ")");
  auto seq = std::make_unique<Sequence>();
  seq->request_id = request_id;
  seq->num_forks = params.n - 1;
  seq->num_prompt_tokens = (int32_t)prompt.size();
  seq->tokens = std::move(prompt);
  seq->max_total_tokens =
      (int32_t)std::min<int64_t>((int64_t)seq->num_prompt_tokens + params.max_new_tokens, options_.session_len);
  seq->params = params;
  seq->callback = std::make_shared<OutputCallback>(std::move(callback));
  {
    std::lock_guard<std::mutex> lock(inbox_mu_);
    LMKIT_CHECK_ARG(!stopping_, "the engine is shut down");
    LMKIT_CHECK_ARG(live_samples_.count(request_id) == 0, "request id ", request_id, " is already in use");
    seq->id = next_seq_id_++;
    seq->seed = params.has_seed ? params.seed : seed_source_();
    live_samples_[request_id] = params.n;
    inbox_new_.push_back(std::move(seq));
  }
  inbox_cv_.notify_one();
}

void Engine::cancel(int64_t request_id, int32_t sample_index) {
  {
    std::lock_guard<std::mutex> lock(inbox_mu_);
    if (!live_samples_.count(request_id)) return;
    inbox_cancel_.emplace_back(request_id, sample_index);
  }
  inbox_cv_.notify_one();
}

namespace {

// The scheduler's view of the disk store: a block is read into the pool through the executor.
class StoreTier : public PrefixTier {
 public:
  StoreTier(KVStore& store, Executor& executor, std::unordered_set<uint64_t>& persisted)
      : store_(store), executor_(executor), persisted_(persisted) {}
  bool contains(uint64_t key) override { return store_.contains(key); }
  bool load(uint64_t key, const int32_t* tokens, int32_t block) override {
    if (block == kNoBlock) return store_.read(key, tokens, nullptr);
    buffer_.resize((size_t)store_.config().block_bytes);
    if (!store_.read(key, tokens, buffer_.data())) return false;
    executor_.write_kv_block(block, buffer_.data());
    persisted_.insert(key);  // on disk: no need to write it when it leaves the pool again
    return true;
  }

 private:
  KVStore& store_;
  Executor& executor_;
  std::unordered_set<uint64_t>& persisted_;
  std::vector<char> buffer_;
};

}  // namespace

void Engine::start_store() {
  const EngineOptions& o = options_;
  LMKIT_CHECK_ARG(o.enable_prefix_caching, "kv_cache_dir needs enable_prefix_caching=True (the disk store keeps "
                  "prefix-cache blocks)");
  LMKIT_CHECK_ARG(o.num_state_slots == 0, "kv_cache_dir: models with recurrent layers are not supported by the "
                  "disk store (their prefix hits start from state snapshots, which it does not keep); leave "
                  "kv_cache_dir unset");
  LMKIT_CHECK_ARG(executor_->can_copy_kv_blocks(), "kv_cache_dir: this backend cannot copy KV blocks to host memory "
                  "(the disk store runs on the CPU backend); leave kv_cache_dir unset");
  LMKIT_CHECK_ARG(o.kv_cache_disk_bytes > 0, "kv_cache_disk_gib must be > 0, got ", o.kv_cache_disk_bytes, " bytes");
  LMKIT_CHECK_ARG(o.kv_cache_read_bytes_per_step >= 0, "kv_cache_read_mib_per_step must be >= 0, got ",
                  o.kv_cache_read_bytes_per_step, " bytes");
  KVStoreConfig c;
  c.dir = o.kv_cache_dir;
  c.max_bytes = o.kv_cache_disk_bytes;
  c.block_size_tokens = o.block_size_tokens;
  c.block_bytes = executor_->kv_bytes_per_block();
  // One prefill chunk may evict hundreds of blocks at once: the queue's size is the pool sizer's (counted in memory)
  c.max_queued_blocks = o.kv_cache_queue_blocks;
  // What the bytes mean: the caller's identity (weights, tokenizer, dtype, KV policy) and the layout as the
  // executor has it, with the store's format version.
  const std::string identity = detail::concat(o.kv_cache_identity, "|block_size_tokens=", o.block_size_tokens,
                                              "|kv_bytes_per_block=", c.block_bytes, "|vocab_size=", o.vocab_size,
                                              "|format=", kKVStoreFormatVersion);
  c.identity = checksum64(identity.data(), identity.size());
  store_ = std::make_unique<KVStore>(c);
  store_tier_ = std::make_unique<StoreTier>(*store_, *executor_, persisted_keys_);
  // 0: no cap; else at least one block a step
  const int32_t read_blocks = o.kv_cache_read_bytes_per_step == 0 ? 0 : (int32_t)std::clamp<int64_t>(
      o.kv_cache_read_bytes_per_step / std::max<int64_t>(c.block_bytes, 1), 1, INT32_MAX);
  scheduler_.set_prefix_tier(store_tier_.get(), read_blocks);
  blocks_.set_eviction_listener([this](int32_t block, uint64_t key, const std::vector<int32_t>& tokens) {
    on_evict(block, key, tokens);
  });
  metrics_.has_kv_store = true;
}

void Engine::on_evict(int32_t block, uint64_t key, const std::vector<int32_t>& tokens) {
  if (persisted_keys_.erase(key)) return;  // on disk already
  std::vector<char> buffer = store_->acquire_buffer(false, true);  // never waits: a full queue drops the block
  if (!buffer.empty()) copy_to_store(block, key, tokens, std::move(buffer));
}

void Engine::copy_to_store(int32_t block, uint64_t key, const std::vector<int32_t>& tokens, std::vector<char> buffer) {
  try {
    executor_->read_kv_block(block, buffer.data());
  } catch (...) {
    store_->abandon(std::move(buffer));  // the queue's slot goes back; the caller's step sees the error
    throw;
  }
  store_->put(key, tokens.data(), std::move(buffer));
}

bool Engine::persist_cached_blocks(bool wait, double deadline, int32_t max_blocks) {
  std::lock_guard<std::mutex> state(state_mu_);
  int32_t num_copied = 0;
  for (int32_t id : blocks_.cached_block_ids()) {  // most recently released first: a prompt's head before its tail
    const uint64_t key = blocks_.key_of(id);
    if (persisted_keys_.count(key)) continue;
    if ((deadline > 0 && steady_seconds() > deadline) || num_copied++ == max_blocks) return true;
    std::vector<char> buffer = store_->acquire_buffer(wait, false);
    if (buffer.empty()) return store_->counters().is_writing;  // the queue is full: later; writing paused: stop
    copy_to_store(id, key, blocks_.tokens_of(id), std::move(buffer));
    persisted_keys_.insert(key);
  }
  return false;
}

EngineMetrics Engine::metrics() const {
  EngineMetrics m;
  {
    std::lock_guard<std::mutex> lock(metrics_mu_);  // not state_mu_: that one is held for a whole step
    m = published_metrics_;
  }
  if (store_) {  // the writer's counters move while the loop sleeps: read them now
    const KVStoreCounters c = store_->counters();
    m.num_store_read_blocks = c.num_read_blocks;
    m.num_store_read_bytes = c.num_read_bytes;
    m.num_store_written_blocks = c.num_written_blocks;
    m.num_store_written_bytes = c.num_written_bytes;
    m.num_store_dropped_blocks = c.num_dropped_blocks;
    m.num_store_ignored_files = c.num_ignored_files;
    m.num_store_write_errors = c.num_write_errors;
    m.num_store_evicted_files = c.num_evicted_files;
    m.num_store_bytes = c.bytes_on_disk;
  }
  return m;
}

void Engine::flush_kv_store() {
  if (!store_) return;
  while (persist_cached_blocks(false)) std::this_thread::sleep_for(kPersistPause);
  store_->flush();
}

void Engine::publish_metrics() {
  metrics_.num_running = scheduler_.num_running();
  metrics_.num_waiting = scheduler_.num_waiting();
  metrics_.num_free_blocks = blocks_.num_free_blocks();
  metrics_.num_active_blocks = blocks_.num_active_blocks();
  metrics_.num_preemptions = scheduler_.num_preemptions();
  metrics_.num_cached_blocks = blocks_.num_cached_blocks();
  metrics_.num_free_state_slots = states_.num_free_slots();
  metrics_.num_state_snapshots = scheduler_.num_state_snapshots();
  metrics_.num_prefix_query_tokens = scheduler_.num_prefix_query_tokens();
  metrics_.num_prefix_hit_tokens = scheduler_.num_prefix_hit_tokens();
  metrics_.num_window_freed_blocks = scheduler_.num_window_freed_blocks();
  metrics_.num_store_lookups = scheduler_.num_tier_lookups();
  metrics_.num_store_missed_lookups = scheduler_.num_tier_missed_lookups();
  metrics_.num_store_hit_tokens = scheduler_.num_tier_hit_tokens();
  {
    std::lock_guard<std::mutex> lock(metrics_mu_);
    published_metrics_ = metrics_;
  }
  {  // this iteration's outputs become deliverable only now, after the metrics that count them
    std::lock_guard<std::mutex> lock(outbox_mu_);
    std::move(staged_.begin(), staged_.end(), std::back_inserter(outbox_));
  }
  staged_.clear();
  outbox_cv_.notify_one();
}

void Engine::check_integrity() const {
  std::lock_guard<std::mutex> lock(state_mu_);
  scheduler_.verify();
  if (draft_) {
    draft_->check_integrity();
    for (int64_t id : draft_->state_ids())
      LMKIT_CHECK(scheduler_.find(id) != nullptr, "the draft model holds a state of sequence ", id, ", which ended");
  }
}

void Engine::post_release(std::shared_ptr<OutputCallback> cb) {
  // An empty output entry whose only job is to drop the last reference on the callback thread.
  staged_.emplace_back(std::move(cb), RequestOutput{});
  staged_.back().second.request_id = -1;
}

void Engine::post(std::shared_ptr<OutputCallback> cb, RequestOutput&& out) {
  // Staged until publish_metrics() hands the iteration's outputs to the callback thread: a consumer that sees
  // its final output also sees metrics that count it (the callback thread, still delivering the last batch,
  // would otherwise take a finish before the step that freed its blocks is published).
  staged_.emplace_back(std::move(cb), std::move(out));
}

void Engine::flush(Sequence& seq, bool finished, FinishReason reason, const Failure& failure) {
  if (!finished && seq.pending_token_ids.empty() && seq.pending_logit_rows == 0 &&
      seq.pending_prompt_logprobs.empty())
    return;
  RequestOutput out;
  out.request_id = seq.request_id;
  out.sample_index = seq.sample_index;
  out.emitted_at = steady_seconds();
  out.scheduled_at = seq.scheduled_at;
  out.token_ids.swap(seq.pending_token_ids);
  out.logprobs.swap(seq.pending_logprobs);
  out.top_ids.swap(seq.pending_top_ids);
  out.top_logprobs.swap(seq.pending_top_logprobs);
  out.num_top = std::max(seq.params.logprobs, 0);
  out.logits.swap(seq.pending_logits);
  out.num_logit_rows = seq.pending_logit_rows;
  out.first_prompt_logprob_token = seq.num_prompt_logprobs_emitted - (int32_t)seq.pending_prompt_logprobs.size();
  out.prompt_logprobs.swap(seq.pending_prompt_logprobs);
  out.prompt_top_ids.swap(seq.pending_prompt_top_ids);
  out.prompt_top_logprobs.swap(seq.pending_prompt_top_logprobs);
  out.num_prompt_top = std::max(seq.params.prompt_logprobs, 0);
  seq.pending_logit_rows = 0;
  out.finished = finished;
  out.finish_reason = reason;
  out.error = failure.message;
  out.error_kind = failure.kind;
  out.num_prompt_tokens = seq.num_prompt_tokens;
  if (finished && reason != FinishReason::kError && reason != FinishReason::kCancelled && !seq.pooled_sum.empty()) {
    const double count = seq.params.pooling == Pooling::kMean ? seq.num_prompt_tokens : 1;
    out.embedding.resize(seq.pooled_sum.size());
    for (size_t c = 0; c < seq.pooled_sum.size(); ++c) out.embedding[c] = (float)(seq.pooled_sum[c] / count);
  }
  post(finished ? std::move(seq.callback) : seq.callback, std::move(out));
}

// A finished output without tokens for one completion of seq's request. Caller holds state_mu_.
void Engine::post_final(const Sequence& seq, int32_t sample_index, FinishReason reason, const Failure& failure) {
  RequestOutput out;
  out.request_id = seq.request_id;
  out.sample_index = sample_index;
  out.finished = true;
  out.finish_reason = reason;
  out.error = failure.message;
  out.error_kind = failure.kind;
  out.num_prompt_tokens = seq.num_prompt_tokens;
  out.emitted_at = steady_seconds();
  out.scheduled_at = seq.scheduled_at;
  post(seq.callback, std::move(out));
  end_sample(seq.request_id);
  ++metrics_.num_finished_requests;
}

void Engine::end_sample(int64_t request_id) {
  std::lock_guard<std::mutex> lock(inbox_mu_);
  auto it = live_samples_.find(request_id);
  if (it != live_samples_.end() && --it->second <= 0) live_samples_.erase(it);
}

// Ends seq: frees its blocks and slot, sends its last output. Caller holds state_mu_.
void Engine::finish(Sequence* seq, FinishReason reason, const Failure& failure) {
  std::unique_ptr<Sequence> owned = scheduler_.remove(seq->id);
  if (draft_) draft_->release(owned->id);
  if (options_.speculative.enabled && (reason == FinishReason::kStop || reason == FinishReason::kLength) &&
      owned->num_generated_tokens() > 0)
    answers_.add(owned->tokens.data() + owned->num_prompt_tokens, owned->num_generated_tokens());
  // Completions not forked yet (the prompt never finished) end with their parent.
  for (int32_t k = 1; k <= owned->num_forks; ++k) post_final(*owned, k, reason, failure);
  flush(*owned, true, reason, failure);
  end_sample(owned->request_id);
  ++metrics_.num_finished_requests;
}

double Engine::propose_drafts() {
  const SpeculativeConfig& c = options_.speculative;
  std::vector<Sequence*> proposing, modelled;  // modelled: those the draft model drafts for (run_draft_model)
  std::vector<int32_t> model_want;
  std::vector<DraftCandidate> candidates;
  int32_t decode_rows = 0;
  for (Sequence* seq : scheduler_.running()) {  // oldest first
    seq->draft_tokens.clear();
    if (seq->num_pending_tokens() != 1) continue;
    ++decode_rows;
    const SamplingParams& p = seq->params;
    // Not for requests that read every row's logits.
    const int32_t room = seq->max_total_tokens - seq->num_tokens();
    if (!p.speculate || p.output_logits || room <= 0) continue;
    if (!seq->spec) seq->spec = std::make_unique<SpecState>(c, p.prediction);
    SpecState& spec = *seq->spec;
    const int32_t most = std::min(c.max_draft_tokens, room);
    const int32_t* tokens = seq->tokens.data();
    const int32_t n = seq->num_tokens();
    std::vector<int32_t>& drafts = seq->draft_tokens;
    spec.ngram.index(tokens, n);  // every step, so the index never falls behind
    // The first proposer with a budget that finds something, in DraftSource order.
    for (int32_t source = 0; source < kNumDraftSources && drafts.empty(); ++source) {
      if ((source == kDraftPrediction && !spec.predicted) || (source == kDraftAnswers && answers_.num_tokens() == 0))
        continue;
      if (source == kDraftMtp ? !c.mtp : source == kDraftModel ? !c.draft_model
                                 : (c.mtp || c.draft_model) && (source == kDraftNgram || source == kDraftAnswers))
        continue;
      if (source == kDraftModel && !draft_->can_draft(*seq)) continue;  // (it takes no rows then)
      const int32_t want = spec.draft_budget(source, most);
      if (want <= 0) continue;
      if (source == kDraftModel) {  // drafted below, with the others the draft model drafts for
        seq->draft_source = source;
        modelled.push_back(seq);
        model_want.push_back(want);
        break;
      }
      // the head drafted for this length exactly when this budget was to be > 0 (SpecState::will_propose), unless the
      // sequence sat out the last step: then a probe waits for the next draft
      if (source == kDraftMtp && seq->mtp_draft_at != n) {
        if (spec.acceptance(source) < SpecState::kOffBelow) spec.idle_steps[source] = SpecState::kProbeInterval - 1;
        continue;
      }
      seq->draft_source = source;
      if (source == kDraftPrediction)
        spec.predicted->propose(tokens, n, seq->num_generated_tokens(), want, drafts);
      else if (source == kDraftNgram)
        spec.ngram.lookup(tokens, n, tokens, n, want, drafts);
      else if (source == kDraftMtp)
        drafts.push_back(seq->mtp_draft);
      else
        answers_.lookup(tokens, n, want, drafts);
    }
    if (p.grammar) cut_drafts_to_grammar(*seq);
    if (drafts.empty()) continue;
    proposing.push_back(seq);
    // every kProbeInterval proposals a few drafts are verified whatever their expected worth (in a step where their
    // rows cost little: choose_drafts), so that neither the acceptance nor the timings of more rows go stale
    const bool probe = ++spec.steps_since_probe >= SpecState::kProbeInterval;
    candidates.push_back({spec.acceptance(seq->draft_source), (int32_t)drafts.size(), probe ? SpecState::kProbeTokens : 0});
  }
  // a model with recurrent state: no more draft rows than checkpoint slots
  int32_t max_rows = std::min(c.max_step_draft_tokens, scheduler_.num_free_draft_slots());
  double seconds = 0;
  if (!modelled.empty()) {  // the draft model's drafts are final once drawn: its passes are spent
    const double start = steady_seconds();
    for (Sequence* seq : modelled) start_grammar(*seq);  // its drafts are sampled under its masks
    run_draft_model(modelled, model_want, decode_rows, max_rows);
    for (Sequence* seq : modelled) {
      if (seq->params.grammar) cut_drafts_to_grammar(*seq);
      max_rows -= (int32_t)seq->draft_tokens.size();
    }
    seconds = steady_seconds() - start;
  }
  if (proposing.empty()) return seconds;
  // A step with a prompt chunk is dominated by it: its drafts are weighed against the decode rows' cost alone.
  // (adaptive off: every proposal, oldest sequences first, within the step's draft rows)
  const std::vector<int32_t> take = c.adaptive ? choose_drafts(candidates, decode_rows, max_rows, step_cost_)
                                               : take_in_order(candidates, max_rows);
  for (size_t i = 0; i < proposing.size(); ++i) proposing[i]->draft_tokens.resize((size_t)take[i]);
  return seconds;
}

void Engine::run_draft_model(const std::vector<Sequence*>& seqs, const std::vector<int32_t>& want,
                             int32_t decode_rows, int32_t max_rows) {
  // as many as pay, the draft model's passes counted, and the probes: a switched-off draft model's budget
  // (SpecState::draft_budget), every kProbeInterval proposals. (No probe of one that is on: its passes' timings are
  // fixed at start, and its acceptance waits for the steps where it pays.) Adaptive off: every proposal, oldest first.
  // A sequence whose draft state is far behind (a new request's prompt) drafts once its catch-up pays
  // (worth_catching_up, priced at the catch-up of the context before its answer, at the acceptance of the draft
  // model's recent verifications): until then it is not a candidate. Every kProbeInterval-th sequence refused goes on
  // all the same, so that this acceptance is measured again even while every catch-up waits; a sequence's own probe
  // (its draft model switched off) goes on whatever its catch-up costs.
  const bool adaptive = options_.speculative.adaptive;
  const float expected = model_kept_ / model_examined_;
  std::vector<DraftCandidate> candidates;
  std::vector<Sequence*> listed;
  for (size_t i = 0; i < seqs.size(); ++i) {
    Sequence& seq = *seqs[i];
    SpecState& spec = *seq.spec;
    const float acceptance = spec.acceptance(kDraftModel);
    const bool probe = acceptance < SpecState::kOffBelow;
    if (adaptive && !probe) {
      const double saving = draft_saving_per_token(expected, want[i], step_cost_, draft_->pass_cost());
      const int32_t generated = seq.num_generated_tokens();
      const int32_t behind = std::max(draft_->rows_behind(seq) - 1 - generated, 0);
      if (!worth_catching_up(draft_->catch_up_seconds(behind), saving, generated,
                             seq.max_total_tokens - seq.num_tokens())) {
        const bool first = !spec.catch_up_refused;
        spec.catch_up_refused = true;
        if (!first || ++refused_catch_ups_ % SpecState::kProbeInterval != 0) continue;
      }
    }
    candidates.push_back({acceptance, want[i], probe ? want[i] : 0});
    listed.push_back(seqs[i]);
  }
  const std::vector<int32_t> take =
      adaptive ? choose_model_drafts(candidates, decode_rows, max_rows, step_cost_, draft_->pass_cost())
               : take_in_order(candidates, max_rows);
  std::vector<Sequence*> of;  // (a sequence that takes none now catches up when it next drafts)
  std::vector<int32_t> max_tokens;
  for (size_t i = 0; i < listed.size(); ++i) {
    if (take[i] <= 0) continue;
    of.push_back(listed[i]);
    max_tokens.push_back(take[i]);
  }
  const std::vector<const Sequence*> drafting(of.begin(), of.end());
  if (drafting.empty()) return;
  std::vector<std::vector<int32_t>> drafts;
  try {
    draft_->propose(drafting, max_tokens, drafts);
  } catch (const std::exception& e) {  // the step goes on without drafts
    std::fprintf(stderr, "lmkit: the draft model's pass failed (no drafts this step): %s\n", e.what());
    return;
  }
  for (size_t i = 0; i < of.size(); ++i) of[i]->draft_tokens = std::move(drafts[i]);
}

void Engine::cut_drafts_to_grammar(Sequence& seq) {
  std::vector<int32_t>& drafts = seq.draft_tokens;
  if (drafts.empty()) return;  // (num_valid waits for the next mask: only when there is something to check)
  start_grammar(seq);  // when its start token came last step: its matcher is made in the step after that
  if (seq.matcher) {
    drafts.resize((size_t)seq.matcher->num_valid(drafts.data(), (int32_t)drafts.size()));
  } else if (seq.params.grammar_after_token >= 0) {  // the row after the start token would need the grammar's mask
    drafts.erase(std::find(drafts.begin(), drafts.end(), seq.params.grammar_after_token), drafts.end());
  }
}

FinishReason Engine::take_token(Sequence& seq, int32_t token, const TokenLogprobs& logprobs, Failure& failure,
                                bool next_mask) {
  ++metrics_.num_generated_tokens;
  const FinishReason reason = stop_rules_.on_token(seq, token);
  if (reason == FinishReason::kStop) return reason;  // a stop token is not part of the output
  seq.tokens.push_back(token);
  seq.pending_token_ids.push_back(token);
  if (seq.params.logprobs >= 0) {
    seq.pending_logprobs.push_back(logprobs.logprob);
    seq.pending_top_ids.insert(seq.pending_top_ids.end(), logprobs.top_ids.begin(), logprobs.top_ids.end());
    seq.pending_top_logprobs.insert(seq.pending_top_logprobs.end(), logprobs.top_logprobs.begin(),
                                    logprobs.top_logprobs.end());
  }
  return advance_grammar(seq, token, reason, failure, next_mask);
}

int32_t Engine::apply_verification(const ScheduledSeq& s, int32_t first_sample, const StepOutput& out,
                                   FinishReason& reason, Failure& failure) {
  Sequence& seq = *s.seq;
  const int32_t drafts = s.num_draft_tokens;
  int32_t accepted = 0, rows = 0;
  for (int32_t j = 0; j <= drafts; ++j) {
    const int32_t k = first_sample + j;
    const int32_t t = out.tokens[k];
    rows = j + 1;  // row j's input stands: the last known token, or draft j - 1, kept
    reason = take_token(seq, t, out.logprobs[k], failure, false);
    const bool agrees = j < drafts && t == seq.draft_tokens[j];
    accepted += agrees ? 1 : 0;
    if (reason != FinishReason::kNone || !agrees) break;
  }
  if (reason == FinishReason::kNone && seq.matcher) seq.matcher->request_mask();  // after the last token only
  const int src = seq.draft_source;
  metrics_.num_draft_tokens[src] += drafts;
  metrics_.num_accepted_draft_tokens[src] += accepted;
  ++metrics_.num_verifications[src];
  if (src == kDraftModel) {
    constexpr float kDecay = 0.95f;  // about the last twenty verifications count
    model_kept_ = kDecay * model_kept_ + (float)accepted;
    model_examined_ = kDecay * model_examined_ + (float)(accepted + (accepted < drafts ? 1 : 0));
  }
  if (seq.spec) {
    seq.spec->record(src, drafts, accepted);
    seq.spec->steps_since_probe = 0;  // (here, not when chosen: the scheduler may cut chosen drafts to none)
  }
  return rows;
}

void Engine::run_step() {
  // the draft model's passes count with the step's forward for the pacer
  const double draft_seconds = options_.speculative.enabled ? propose_drafts() : 0.0;
  PromptCaps caps;
  if (pacer_.enabled())  // the scheduler picks alone or beside_decodes: it knows whether any running sequence decodes
    caps = PromptCaps{pacer_.cap(false), pacer_.cap(true), pacer_.chunk_tokens(), pacer_.finish_tokens(), true};
  BatchPlan plan = scheduler_.schedule(caps);
  if (plan.empty()) return;
  memory_released_ = false;
  const double planned_at = steady_seconds();
  for (const ScheduledSeq& s : plan.seqs)
    if (s.seq->scheduled_at == 0) s.seq->scheduled_at = planned_at;
  for (const ScheduledSeq& s : plan.seqs) {
    if (s.is_sampled) start_grammar(*s.seq);  // its mask is computed while the forward runs
    if (s.num_draft_tokens > 0 && s.seq->matcher)  // and the mask after each draft
      s.seq->matcher->request_draft_masks(s.seq->draft_tokens.data(), s.num_draft_tokens);
  }
  StepOutput out;
  Batch batch;
  double step_seconds = draft_seconds;
  try {
    batch = build_batch(plan, options_.block_size_tokens, stop_rules_);
    const double start = steady_seconds();
    out = executor_->step(batch);
    step_seconds += steady_seconds() - start;
  } catch (const std::exception& e) {
    for (const ScheduledSeq& s : plan.seqs) finish(s.seq, FinishReason::kError, {ErrorKind::kInternal, std::string("step failed: ") + e.what()});
    return;
  }
  ++metrics_.num_steps;
  metrics_.num_prompt_tokens += plan.num_prefill_tokens;
  metrics_.num_weight_bytes_read += out.weight_bytes_read;
  std::vector<Ending> endings = apply_step(plan, batch, out);
  if (mtp_) step_seconds += run_mtp(plan, batch, endings);
  pacer_.record(plan.num_decode_tokens + plan.num_draft_tokens, plan.num_prefill_tokens, step_seconds);
  for (Ending& e : endings) finish(e.seq, e.reason, e.failure);
}

double Engine::run_mtp(const BatchPlan& plan, const Batch& batch, const std::vector<Ending>& endings) {
  const double start = steady_seconds();
  std::unordered_set<const Sequence*> ending;
  for (const Ending& e : endings) ending.insert(e.seq);
  Batch mb;
  mb.block_size_tokens = batch.block_size_tokens;
  mb.stateless = true;
  std::vector<int32_t> hidden_rows;
  std::vector<Sequence*> seqs;
  for (size_t i = 0; i < plan.seqs.size(); ++i) {  // (apply_step finished none of them: the caller does, after)
    Sequence& seq = *plan.seqs[i].seq;
    const BatchSeq& src = batch.seqs[i];
    const int32_t start = src.ctx_len - src.num_rows;  // the chunk's first position
    // the rows the step kept (a verification's accepted ones), each with the token after it known
    const int32_t kept = std::min({src.num_rows, seq.num_computed_tokens - start, seq.num_tokens() - 1 - start});
    if (kept <= 0) continue;
    // row p reads the token at p + 1, at p's slot (the step's)
    const int32_t index = append_rows(mb, batch.block_tables.data() + src.table_offset, start,
                                      seq.tokens.data() + start + 1, kept, src.prefill,
                                      std::min(src.num_decode_rows, kept));
    for (int32_t j = 0; j < kept; ++j) hidden_rows.push_back(src.first_row + j);
    // a draft for a sequence that decodes next and takes one from the head
    const SamplingParams& p = seq.params;
    const bool drafts = !ending.count(&seq) && seq.num_pending_tokens() == 1 && p.speculate && !p.output_logits &&
                        seq.max_total_tokens > seq.num_tokens() && (!seq.spec || seq.spec->will_propose(kDraftMtp));
    if (drafts)
      sample_last_row(mb, index, &mtp_greedy_, seq.tokens.data(), seq.num_tokens(), seq.num_prompt_tokens);
    seqs.push_back(&seq);
  }
  if (mb.empty()) return 0;
  StepOutput out;
  try {
    out = executor_->mtp_step(mb, hidden_rows);
  } catch (const std::exception& e) {  // the step's own output stands: only no drafts come of it
    std::fprintf(stderr, "lmkit: the MTP head's pass failed (no drafts this step): %s\n", e.what());
    return steady_seconds() - start;
  }
  for (size_t k = 0; k < mb.samples.size(); ++k) {
    Sequence& seq = *seqs[(size_t)mb.samples[k].seq];
    seq.mtp_draft = out.tokens[k];
    seq.mtp_draft_at = seq.num_tokens();
  }
  return steady_seconds() - start;
}

void Engine::release_idle_memory() {
  std::lock_guard<std::mutex> state(state_mu_);
  if (scheduler_.has_work()) return;
  try {
    executor_->release_idle_memory(blocks_.free_block_ids());
    if (draft_) draft_->release_idle_memory();
  } catch (const std::exception& e) {  // advice to the OS: a failure costs memory, not correctness
    std::fprintf(stderr, "lmkit: releasing idle memory failed: %s\n", e.what());
  }
  memory_released_ = true;
}

void Engine::start_grammar(Sequence& seq) {
  const SamplingParams& p = seq.params;
  if (!p.grammar || seq.matcher || (p.grammar_after_token >= 0 && !seq.grammar_after_token_seen)) return;
  seq.matcher = std::make_unique<GrammarMatcher>(p.grammar, &mask_worker_);
  seq.matcher->request_mask();
}

FinishReason Engine::advance_grammar(Sequence& seq, int32_t token, FinishReason reason, Failure& failure,
                                     bool next_mask) {
  if (!seq.matcher) {
    if (seq.params.grammar && token == seq.params.grammar_after_token) seq.grammar_after_token_seen = true;
    return reason;
  }
  if (!seq.matcher->consume(token)) {
    failure = {ErrorKind::kGrammar, detail::concat("the grammar refused token ", token, ": ", seq.matcher->error())};
    return FinishReason::kError;
  }
  if (seq.matcher->is_stopped()) return FinishReason::kStop;  // complete: nothing but an eos could follow
  if (reason == FinishReason::kNone && next_mask) seq.matcher->request_mask();
  return reason;
}

std::vector<Engine::Ending> Engine::apply_step(const BatchPlan& plan, const Batch& batch, StepOutput& out) {
  const int64_t V = out.vocab_size;
  for (size_t r = 0; r < batch.logit_outputs.size(); ++r) {
    const LogitOutputRow& row = batch.logit_outputs[r];
    Sequence& seq = *plan.seqs[row.seq].seq;
    const float* src = out.logits.data() + (int64_t)r * V;
    seq.pending_logits.insert(seq.pending_logits.end(), src, src + V);
    ++seq.pending_logit_rows;
    seq.num_logit_rows_emitted = row.position + 1;
  }
  for (size_t r = 0; r < batch.hidden_outputs.size(); ++r) {
    const HiddenOutputRow& row = batch.hidden_outputs[r];
    Sequence& seq = *plan.seqs[row.seq].seq;
    const float* src = out.hidden.data() + r * (size_t)out.hidden_size;
    seq.pooled_sum.resize((size_t)out.hidden_size, 0.0);
    for (int32_t c = 0; c < out.hidden_size; ++c) seq.pooled_sum[c] += src[c];
    seq.num_pooled_positions = row.position + 1;
  }
  for (size_t r = 0; r < batch.prompt_logprob_rows.size(); ++r) {
    Sequence& seq = *plan.seqs[batch.prompt_logprob_rows[r].seq].seq;
    const TokenLogprobs& lp = out.prompt_logprobs[r];
    seq.pending_prompt_logprobs.push_back(lp.logprob);
    seq.pending_prompt_top_ids.insert(seq.pending_prompt_top_ids.end(), lp.top_ids.begin(), lp.top_ids.end());
    seq.pending_prompt_top_logprobs.insert(seq.pending_prompt_top_logprobs.end(), lp.top_logprobs.begin(),
                                           lp.top_logprobs.end());
    seq.num_prompt_logprobs_emitted = batch.prompt_logprob_rows[r].position + 2;
  }
  std::vector<int32_t> sample_of(plan.seqs.size(), -1);  // plan index -> its (first) sample row
  for (size_t k = batch.samples.size(); k-- > 0;) sample_of[batch.samples[k].seq] = (int32_t)k;
  std::vector<Sequence*> done;
  std::vector<FinishReason> reasons;
  std::vector<Failure> failures;
  // A sampled sequence either ends (after the loop: finishing removes it from the scheduler) or sends what it has.
  auto settle = [&](Sequence& seq, FinishReason reason, Failure&& failure) {
    if (reason != FinishReason::kNone) {
      done.push_back(&seq);
      reasons.push_back(reason);
      failures.push_back(std::move(failure));
    } else {
      flush(seq, false, FinishReason::kNone, {});
    }
  };
  for (size_t i = 0; i < plan.seqs.size(); ++i) {
    const ScheduledSeq& s = plan.seqs[i];
    Sequence& seq = *s.seq;
    if (s.num_draft_tokens > 0) {  // a verification: the kept rows decide how far the sequence computed
      FinishReason reason = FinishReason::kNone;
      Failure failure;
      scheduler_.advance(s, apply_verification(s, sample_of[i], out, reason, failure));
      settle(seq, reason, std::move(failure));
      continue;
    }
    scheduler_.advance(s);
    if (s.is_sampled && seq.num_forks > 0 && seq.num_generated_tokens() == 0) scheduler_.fork(&seq);
    if (sample_of[i] < 0) {
      if (seq.num_pending_tokens() == 0) {  // computed to its limit without a sample: max_new_tokens 0
        done.push_back(&seq);
        reasons.push_back(FinishReason::kLength);
        failures.emplace_back();
      } else {
        flush(seq, false, FinishReason::kNone, {});
      }
      continue;
    }
    const int32_t k = sample_of[i];
    Failure failure;
    const FinishReason reason = take_token(seq, out.tokens[k], out.logprobs[k], failure);
    settle(seq, reason, std::move(failure));
  }
  std::vector<Ending> endings;
  for (size_t i = 0; i < done.size(); ++i) endings.push_back({done[i], reasons[i], std::move(failures[i])});
  return endings;
}

void Engine::calibrate_step_cost() {
  // One sequence of R rows at positions [0, R) in the pool's first blocks and state slots (free: no request has
  // arrived), every row's logits sampled greedily, as a verification's are (timed_step).
  const int32_t bs = options_.block_size_tokens;
  const int32_t most = std::min({kCalibrationRows, options_.num_blocks * bs,
                                 options_.max_prefill_token_num + options_.max_batch_size});
  SamplingParams greedy;
  greedy.temperature = 0.0f;
  const std::vector<int32_t> history((size_t)most, 0);
  for (int32_t rows : {1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64}) {
    if (rows > most) break;
    Batch b;
    b.num_tokens = rows;
    b.block_size_tokens = bs;
    const int32_t blocks = (rows + bs - 1) / bs;
    for (int32_t i = 0; i < blocks; ++i) b.block_tables.push_back(i);
    BatchSeq seq{0, rows, rows, 0, blocks, -1};
    if (options_.num_state_slots > 0) {  // slot 0, and checkpoints in the next ones as a verification takes them
      seq.state_slot = 0;
      seq.num_checkpoints = std::min(rows - 1, options_.num_draft_state_slots);
      for (int32_t t = 0; t < seq.num_checkpoints; ++t) b.state_checkpoints.push_back(1 + t);
    }
    b.seqs.push_back(seq);
    b.max_ctx_len = rows;
    b.max_blocks_per_seq = blocks;
    for (int32_t j = 0; j < rows; ++j) {
      b.token_ids.push_back(0);
      b.positions.push_back(j);
      b.slots.push_back(j);
      b.logit_rows.push_back(j);
      SampleRow r;
      r.logit_index = j;
      r.params = &greedy;
      r.history = history.data();
      r.num_history = j + 1;
      r.num_prompt = 1;
      b.samples.push_back(std::move(r));
    }
    step_cost_.record(rows, timed_step(*executor_, b));
  }
}

void Engine::loop() {
  name_this_thread("lmkit-engine");
  pin_this_thread(options_.engine_cpus);  // before bind_thread: the kernel team it starts inherits the CPUs
  executor_->bind_thread();
  if (options_.speculative.enabled && options_.speculative.adaptive) {
    try {
      calibrate_step_cost();
      if (draft_) draft_->calibrate();
    } catch (const std::exception& e) {  // then only probes verify drafts
      std::fprintf(stderr, "lmkit: timing steps for speculative decoding failed: %s\n", e.what());
    }
  }
  for (;;) {
    std::vector<std::unique_ptr<Sequence>> arrivals;
    std::vector<std::pair<int64_t, int32_t>> cancels;
    bool stop = false;
    {
      std::unique_lock<std::mutex> lock(inbox_mu_);
      auto ready = [&] { return stopping_ || !inbox_new_.empty() || !inbox_cancel_.empty() || scheduler_.has_work(); };
      if (!memory_released_ && !ready() && !inbox_cv_.wait_for(lock, kIdleRelease, ready)) {
        lock.unlock();
        release_idle_memory();
        lock.lock();
      }
      // Idle: the cached blocks not yet on disk go to the store's writer, a few at a time (as far as its queue has
      // room), so that a request arriving meanwhile waits for a few block copies at most.
      while (store_ && memory_released_ && !ready()) {
        lock.unlock();
        const bool more = persist_cached_blocks(false, 0, kPersistBatchBlocks);
        lock.lock();
        if (!more) break;
        inbox_cv_.wait_for(lock, kPersistPause, ready);
      }
      inbox_cv_.wait(lock, ready);
      arrivals.swap(inbox_new_);
      cancels.swap(inbox_cancel_);
      stop = stopping_;
    }
    std::lock_guard<std::mutex> state(state_mu_);
    for (auto& seq : arrivals) {
      const std::string why = scheduler_.fit_error(*seq);
      if (why.empty()) {
        scheduler_.add(std::move(seq));
        continue;
      }
      // Never fits the pool: fail at once with the reason.
      for (int32_t k = 0; k <= seq->num_forks; ++k) post_final(*seq, k, FinishReason::kError, {ErrorKind::kDoesNotFit, why});
      post_release(std::move(seq->callback));
    }
    for (const auto& c : cancels)
      for (Sequence* seq : scheduler_.find_request(c.first))
        if (c.second < 0 || seq->sample_index == c.second) finish(seq, FinishReason::kCancelled);
    if (stop) {
      for (int64_t id : scheduler_.ids()) finish(scheduler_.find(id), FinishReason::kCancelled);
      break;
    }
    try {
      run_step();
    } catch (const std::exception& e) {
      // A bug in bookkeeping: fail everything in flight rather than spin or die.
      std::fprintf(stderr, "lmkit: engine step failed: %s\n", e.what());
      std::vector<Sequence*> all = scheduler_.running();
      for (Sequence* s : all) finish(s, FinishReason::kError, {ErrorKind::kInternal, e.what()});
    }
    publish_metrics();
  }
  publish_metrics();  // the shutdown's cancelled outputs go out now, not after the disk store's writes
  if (store_) {  // the pool's cached blocks survive a restart: written (waiting for the writer) before the loop ends
    try {
      if (persist_cached_blocks(true, steady_seconds() + kShutdownPersistSeconds))
        std::fprintf(stderr, "lmkit: shutdown: the KV pool's cached blocks not written to the disk store within %g s "
                     "are left out\n", kShutdownPersistSeconds);
    } catch (const std::exception& e) {
      std::fprintf(stderr, "lmkit: writing the KV pool's cached blocks to the disk store failed: %s\n", e.what());
    }
    store_->close();
  }
  {  // published above: the store's writes change no metric (its counters are read live)
    std::lock_guard<std::mutex> lock(outbox_mu_);
    outbox_closed_ = true;
  }
  outbox_cv_.notify_one();
}

void Engine::callback_loop() {
  name_this_thread("lmkit-callback");
  pin_this_thread(options_.callback_cpus);
  std::vector<std::pair<std::shared_ptr<OutputCallback>, RequestOutput>> batch;
  for (;;) {
    {
      std::unique_lock<std::mutex> lock(outbox_mu_);
      outbox_cv_.wait(lock, [&] { return outbox_closed_ || !outbox_.empty(); });
      if (outbox_.empty()) return;  // closed and drained
      batch.assign(std::make_move_iterator(outbox_.begin()), std::make_move_iterator(outbox_.end()));
      outbox_.clear();
    }
    auto deliver = [&batch] {
      for (auto& item : batch) {
        try {
          if (item.first && *item.first && item.second.request_id >= 0) (*item.first)(std::move(item.second));
        } catch (const std::exception& e) {
          std::fprintf(stderr, "lmkit: output callback raised: %s\n", e.what());
        }
        item.first.reset();  // the last reference of a finished request's callback dies here
      }
      batch.clear();
    };
    if (delivery_scope_) delivery_scope_(deliver);
    else deliver();
  }
}

void Engine::shutdown() {
  std::call_once(shutdown_once_, [this] {
    {
      std::lock_guard<std::mutex> lock(inbox_mu_);
      stopping_ = true;
    }
    inbox_cv_.notify_one();
    if (loop_thread_.joinable()) loop_thread_.join();
    if (callback_thread_.joinable()) callback_thread_.join();
  });
}

}  // namespace lmkit
