// The engine: a gateway that takes requests from any thread, one loop thread that schedules and runs
// steps, and one callback thread that delivers outputs so a slow consumer never stalls the loop.
//
//   submit()/cancel() --inbox--> loop: schedule -> executor.step -> emit --outbox--> callback thread
//
// Every request ends with exactly one output whose finished flag is set (stop, length, error or
// cancelled); after it the request holds no KV block and no slot.
#pragma once
#include <stdint.h>

#include <atomic>
#include <condition_variable>
#include <deque>
#include <chrono>
#include <memory>
#include <functional>
#include <mutex>
#include <random>
#include <string>
#include <thread>
#include <unordered_map>
#include <unordered_set>
#include <vector>

#include "core/kv_quant.h"
#include "engine/batch.h"
#include "engine/block_manager.h"
#include "engine/draft_model.h"
#include "engine/executor.h"
#include "engine/kv_store.h"
#include "engine/prompt_pacer.h"
#include "engine/request.h"
#include "engine/scheduler.h"

namespace lmkit {

// The user's engine settings (lmkit.EngineConfig, validated in Python, checked again here).
struct EngineConfig {
  std::string device = "cpu";
  int32_t max_batch_size = 64;
  int32_t session_len = 0;  // 0: the model's max_position_embeddings
  int32_t block_size_tokens = 64;  // tokens per KV block (lmkit.EngineConfig.cache_block_seq_len)
  int32_t max_prefill_token_num = 8192;
  double decode_slowdown = 1.75;  // prompt pacing (engine/prompt_pacer.h); 0: off
  std::vector<KVQuant> kv_quant;  // per layer (from quant_policy or a kv_policy file); empty: kNone everywhere
  bool enable_prefix_caching = false;
  int32_t num_threads = 0;  // CPU threads, 0: all cores
  // CPUs of the engine thread and its kernel team, and of the callback thread (which runs the caller's
  // Python callbacks); empty: wherever the process may run (lmkit/cpus.py plans them)
  std::vector<int32_t> engine_cpus, callback_cpus;
  bool int8_activations = true;  // int4 / int8 layers: int8 activations, integer dot products (decode and prefill)
  bool bf16_linear = false;          // CPU backend: dense linear layers as bf16 dot products (dtype='bfloat16')
  bool bf16_kv = false;              // CPU backend: a full-precision KV cache as bf16 (bf16_linear implies it)
  bool int8_weights = false;         // CPU backend: dense projections and lm_head as int8 per 32 (quantization="int8")
  bool cuda_graphs = true;           // CUDA backend: decode steps replayed as CUDA graphs
  SpeculativeConfig speculative;     // draft tokens verified in one step (engine/speculative.h); CPU backend
  // The disk store of evicted prefix blocks (engine/kv_store.h; CPU backend, prefix caching, no recurrent state):
  // its directory (empty: none), its size cap, and what the blocks' bytes mean besides the layout the engine knows
  // (model weights, tokenizer, dtype, KV policy: lmkit/kv_store.py writes it).
  std::string kv_cache_dir;
  int64_t kv_cache_disk_bytes = 0;
  std::string kv_cache_identity;
  int64_t kv_cache_read_bytes_per_step = 64 << 20;  // disk store: read back per step at most while others run
};

// What the engine runs with, derived from EngineConfig and the model.
struct EngineOptions {
  int32_t max_batch_size = 64;
  int32_t session_len = 4096;
  int32_t block_size_tokens = 64;
  int32_t max_prefill_token_num = 8192;
  double decode_slowdown = 0;  // prompt pacing (engine/prompt_pacer.h); 0: off
  int32_t num_blocks = 0;  // size of the KV pool, decided by the caller (create_engine's PoolSizer)
  int32_t num_state_slots = 0;  // recurrent-state slots (0: the model has no recurrent layers)
  // of those, kept for speculative decoding's checkpoints (SchedulerConfig::num_draft_state_slots)
  int32_t num_draft_state_slots = 0;
  int64_t kv_bytes_per_block = 0;  // the executor's, for reporting
  int64_t linear_weight_bytes = 0;  // the executor's, for reporting
  // The multi-token-prediction head the executor holds (Executor::mtp_num_layers; run with speculative='mtp'), for
  // reporting
  int32_t mtp_num_layers = 0;
  int64_t mtp_weight_bytes = 0;
  bool enable_prefix_caching = false;
  int32_t vocab_size = 0;
  std::vector<int32_t> eos_token_ids;
  int32_t attention_window_tokens = 0;  // > 0: every layer attends within this window (blocks behind it are freed)
  std::vector<int32_t> engine_cpus, callback_cpus;  // EngineConfig's (empty: not pinned)
  SpeculativeConfig speculative;  // CPU backend (create_engine)
  std::string kv_cache_dir;  // EngineConfig's (empty: no disk store)
  int32_t kv_cache_queue_blocks = 8;  // evicted blocks' copies waiting for the store's writer at most (lmkit/memory.py)
  int64_t kv_cache_disk_bytes = 0;
  std::string kv_cache_identity;
  int64_t kv_cache_read_bytes_per_step = 64 << 20;
};


struct EngineMetrics {
  int32_t num_running = 0;
  int32_t num_waiting = 0;
  int32_t num_total_blocks = 0;
  int32_t num_free_blocks = 0;
  int32_t num_active_blocks = 0;
  int32_t num_cached_blocks = 0;     // released blocks kept for prefix hits (evictable)
  int32_t num_total_state_slots = 0;  // recurrent-state slots (0: the model has no recurrent layers)
  int32_t num_free_state_slots = 0;
  int32_t num_state_snapshots = 0;   // slots holding a prefix's state for prefix hits (evictable)
  int64_t num_steps = 0;
  int64_t num_prompt_tokens = 0;     // prompt tokens computed (recomputation included)
  int64_t num_generated_tokens = 0;  // tokens sampled
  int64_t num_preemptions = 0;
  int64_t num_finished_requests = 0;
  int64_t num_prefix_query_tokens = 0;  // tokens of admitted sequences looked up in the prefix cache
  int64_t num_prefix_hit_tokens = 0;    // of those, tokens whose K/V were reused
  int64_t num_window_freed_blocks = 0;  // blocks released early: behind every layer's sliding window
  int64_t num_weight_bytes_read = 0;    // weights the steps' forwards read, summed (StepOutput)
  // The disk store (engine/kv_store.h; all 0 without one): admissions that looked there (their chain went on past
  // the pool), those that found nothing, prompt tokens read back (also in num_prefix_hit_tokens), and the store's
  // counters (KVStoreCounters).
  bool has_kv_store = false;
  int64_t num_store_lookups = 0;
  int64_t num_store_missed_lookups = 0;
  int64_t num_store_hit_tokens = 0;
  int64_t num_store_read_blocks = 0;
  int64_t num_store_read_bytes = 0;
  int64_t num_store_written_blocks = 0;
  int64_t num_store_written_bytes = 0;
  int64_t num_store_dropped_blocks = 0;
  int64_t num_store_ignored_files = 0;
  int64_t num_store_write_errors = 0;
  int64_t num_store_evicted_files = 0;
  int64_t num_store_bytes = 0;
  // Speculative decoding, per proposer (DraftSource, engine/speculative.h): draft tokens verified, of those
  // accepted, and verifications (a sequence's step with drafts).
  static constexpr int kDraftSources = kNumDraftSources;
  int64_t num_draft_tokens[kDraftSources] = {};
  int64_t num_accepted_draft_tokens[kDraftSources] = {};
  int64_t num_verifications[kDraftSources] = {};
};

class Engine {
 public:
  // draft: speculative='draft''s draft model (SpeculativeConfig::draft_model), else null.
  Engine(const EngineOptions& options, std::unique_ptr<Executor> executor, std::unique_ptr<DraftModel> draft = nullptr);
  ~Engine();  // shutdown()
  Engine(const Engine&) = delete;
  Engine& operator=(const Engine&) = delete;

  // Queues a request. Throws InvalidArgument (nothing queued, callback never called) when the prompt is
  // empty, has ids outside the vocabulary, leaves no room in session_len, or params are invalid.
  void submit(int64_t request_id, std::vector<int32_t> prompt, const SamplingParams& params,
              OutputCallback callback);
  // Ends a request (all its completions, or only completion sample_index >= 0) in any state with finish
  // reason "cancelled"; its blocks are free within one step. Unknown or finished ids are ignored.
  void cancel(int64_t request_id, int32_t sample_index = -1);
  EngineMetrics metrics() const;
  // The disk store (no-op without one): copies the pool's cached blocks not yet on disk out to its writer and waits
  // until every queued block is written. Any thread; the loop does the same by itself when idle and at shutdown.
  void flush_kv_store();
  // Checks free + cached + active == total and that every block's reference count equals the number of
  // sequences holding it. Throws on violation.
  void check_integrity() const;
  // Stops the loop; every unfinished request ends as cancelled. Idempotent.
  void shutdown();

  // Wraps each batch of deliveries on the callback thread (all outputs queued at that moment): the
  // Python binding takes the GIL once per batch instead of once per output. Set before the first submit.
  using DeliveryScope = std::function<void(const std::function<void()>&)>;
  void set_delivery_scope(DeliveryScope scope) { delivery_scope_ = std::move(scope); }

  const EngineOptions& options() const { return options_; }

 private:
  void loop();
  void callback_loop();
  void run_step();
  // Applies a step's output to its sequences: logits rows, sampled tokens and every stop rule (StopRules). Returns
  // the sequences that end, with why, for the caller to finish (after the MTP head's pass over their rows).
  struct Ending {
    Sequence* seq;
    FinishReason reason;
    Failure failure;
  };
  std::vector<Ending> apply_step(const BatchPlan& plan, const Batch& batch, StepOutput& out);
  // Creates seq's grammar matcher once its grammar starts and requests its first mask.
  void start_grammar(Sequence& seq);
  // Speculative decoding: draft tokens for the running decodes that take them (Sequence::draft_tokens). Returns the
  // seconds the draft model's passes took (0 without one).
  double propose_drafts();
  // speculative='mtp', after a step: the MTP head over the rows the step kept (each row with the token after it, so
  // that its K/V in the head's pool layer are complete for later drafts, prefix hits and recomputation: also those of
  // the sequences that end with this step, finished after it), and a draft of the next token for those that decode
  // next and take drafts (Sequence::mtp_draft). Returns the seconds it took.
  double run_mtp(const BatchPlan& plan, const Batch& batch, const std::vector<Ending>& endings);
  // Times forwards of 1 to kCalibrationRows rows into step_cost_, once, on the loop thread before the first request:
  // the costs the adaptive rule weighs drafts with stay the same for the engine's life, so a request's drafts (and
  // the arithmetic of its steps) do not depend on how fast earlier steps happened to run.
  void calibrate_step_cost();
  static constexpr int32_t kCalibrationRows = 64;
  // After kIdleRelease with nothing to do, the pages of the free KV blocks and of the step's scratch go back to the
  // OS (Executor::release_idle_memory), once per idle spell: a long prompt's memory does not stay resident.
  void release_idle_memory();
  static constexpr std::chrono::milliseconds kIdleRelease{1000};
  bool memory_released_ = true;  // nothing ran since the last release (or since start)
  // seq sampled `token`: the stop rules (a stop token is not appended), its logprobs, its grammar (failure set
  // when the grammar refuses it; next_mask: the grammar's next mask requested if seq goes on). Returns how seq
  // ends, kNone when it goes on.
  FinishReason take_token(Sequence& seq, int32_t token, const TokenLogprobs& logprobs, Failure& failure,
                          bool next_mask = true);
  // Applies the sample rows of a chunk with draft rows: keeps the drafts up to the first one its row's sample
  // disagrees with, then that sample (or, all accepted, the last row's): returns the rows whose input stands.
  int32_t apply_verification(const ScheduledSeq& s, int32_t first_sample, const StepOutput& out,
                             FinishReason& reason, Failure& failure);
  // After seq sampled `token` (appended): advances its grammar. Returns kStop when the grammar is complete,
  // kError (failure set) when it refuses the token, else `reason`; requests the next mask if seq goes on (and
  // next_mask: a verification asks once, after its last token).
  FinishReason advance_grammar(Sequence& seq, int32_t token, FinishReason reason, Failure& failure,
                               bool next_mask = true);
  // A grammar-constrained decode's drafts: cut to those its grammar allows in a row (before the grammar starts:
  // to those before its start token).
  void cut_drafts_to_grammar(Sequence& seq);
  // speculative='draft': the draft model's drafts for seqs (each wanting up to want[i]; decode_rows: the step's rows
  // without drafts), as many as pay (choose_model_drafts, or all with adaptive off, oldest first) within max_rows in
  // all, into their draft_tokens.
  void run_draft_model(const std::vector<Sequence*>& seqs, const std::vector<int32_t>& want, int32_t decode_rows,
                       int32_t max_rows);
  void publish_metrics();  // the loop thread only: under state_mu_ in the loop, without it after the loop
  // The disk store: a cached block evicted from the pool is copied out for the writer (BlockManager's eviction
  // listener); while idle, and at shutdown, cached blocks not yet on disk are copied out too, so that they survive a
  // restart. persist_cached_blocks() queues what the writer has room for (all, waiting for room, with wait), at most
  // max_blocks of them and until `deadline` when > 0 (engine seconds), and returns whether some are left; it takes
  // state_mu_. on_evict runs inside a step's schedule() (BlockManager's eviction listener), under state_mu_.
  void start_store();
  void on_evict(int32_t block, uint64_t key, const std::vector<int32_t>& tokens);
  // Copies pool block `block` into buffer (from KVStore::acquire_buffer) and queues it for the writer.
  void copy_to_store(int32_t block, uint64_t key, const std::vector<int32_t>& tokens, std::vector<char> buffer);
  bool persist_cached_blocks(bool wait, double deadline = 0, int32_t max_blocks = INT32_MAX);
  static constexpr int32_t kPersistBatchBlocks = 8;  // blocks one idle pass copies out
  static constexpr double kShutdownPersistSeconds = 30;  // a shutdown waits this long at most for the writes
  static constexpr std::chrono::milliseconds kPersistPause{5};
  void finish(Sequence* seq, FinishReason reason, const Failure& failure = {});
  void flush(Sequence& seq, bool finished, FinishReason reason, const Failure& failure);
  void post(std::shared_ptr<OutputCallback> cb, RequestOutput&& out);
  void post_release(std::shared_ptr<OutputCallback> cb);
  void end_sample(int64_t request_id);
  // A finished output without tokens for one completion of seq's request (that completion then ends).
  void post_final(const Sequence& seq, int32_t sample_index, FinishReason reason, const Failure& failure);

  EngineOptions options_;
  std::unique_ptr<Executor> executor_;
  MaskWorker mask_worker_;  // before the scheduler: a sequence's matcher waits for it when destroyed
  BlockManager blocks_;
  StatePool states_;
  Scheduler scheduler_;
  StopRules stop_rules_;
  std::mt19937_64 seed_source_;
  AnswerStore answers_;  // finished answers, for draft lookup
  StepCost step_cost_;   // seconds of a step by row count (calibrate_step_cost), for choose_drafts
  // The draft model's per-token acceptance over every sequence's verifications (decayed counts, from an optimistic
  // 0.75): what a sequence that has not drafted yet expects of it (run_draft_model's catch-up rule).
  float model_kept_ = 3.0f, model_examined_ = 4.0f;
  int32_t refused_catch_ups_ = 0;  // sequences whose catch-up was refused (every kProbeInterval-th goes on)
  bool mtp_ = false;     // speculative='mtp': the executor runs its MTP head after each step (run_mtp)
  std::unique_ptr<DraftModel> draft_;  // speculative='draft': the draft model, else null
  SamplingParams mtp_greedy_;  // the MTP head's drafts: its argmax
  PromptPacer pacer_;    // sizes each step's prompt tokens from the step times
  std::unique_ptr<KVStore> store_;             // the disk store, or none
  std::unique_ptr<PrefixTier> store_tier_;     // the scheduler's view of it
  std::unordered_set<uint64_t> persisted_keys_;  // pool-cached blocks this process wrote or read (skip them)

  // inbox (any thread -> loop)
  mutable std::mutex inbox_mu_;
  std::condition_variable inbox_cv_;
  std::vector<std::unique_ptr<Sequence>> inbox_new_;
  std::vector<std::pair<int64_t, int32_t>> inbox_cancel_;  // (request id, sample index or -1)
  std::unordered_map<int64_t, int32_t> live_samples_;  // request id -> its completions not yet finished
  int64_t next_seq_id_ = 1;
  bool stopping_ = false;

  // state lock: held by the loop around each step, and by readers of scheduler state
  mutable std::mutex state_mu_;
  // metrics_ as of the end of the last loop iteration, readable without waiting for a step
  mutable std::mutex metrics_mu_;
  EngineMetrics published_metrics_;
  EngineMetrics metrics_;

  // outbox (loop -> callback thread)
  std::mutex outbox_mu_;
  std::condition_variable outbox_cv_;
  std::deque<std::pair<std::shared_ptr<OutputCallback>, RequestOutput>> outbox_;
  bool outbox_closed_ = false;
  std::vector<std::pair<std::shared_ptr<OutputCallback>, RequestOutput>> staged_;  // loop thread only

  std::thread loop_thread_;
  std::thread callback_thread_;
  DeliveryScope delivery_scope_;
  std::once_flag shutdown_once_;
};

}  // namespace lmkit
