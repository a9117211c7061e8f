// speculative='draft': a smaller model with the target's tokenizer drafts tokens by greedy decoding, run by the same
// engine on its loop thread (the same kernel team), with a KV pool and block manager of its own.
//
// Each sequence has a draft state: a block table in the draft pool and how many of its positions hold K/V of the
// sequence's own tokens (`computed`); the positions after those hold K/V of the drafts it decoded last time, whose
// inputs it remembers (`written`). Before a step, propose() takes a sequence whose tokens [0, n) are known (n - 1
// pending, in no KV yet): the drafts the target kept since then count as computed (their inputs equal the tokens),
// one pass over positions [computed, n) (the catch-up: usually the last token, or two; the whole prompt the first
// time, after a prefix-cache hit in the draft pool's own cache, kept as the engine's pool keeps one) samples the first draft, and each further pass
// decodes one draft more for every sequence that takes it. Nothing of the target's state is touched: a draft state
// lives until the sequence ends (release()), a fork starts its own from the draft pool's prefix cache, and a draft
// pool that runs out only means fewer drafts (idle states are given back first). A grammar-constrained sequence's
// drafts are sampled under its masks (the next token's, then after each draft before), so that they are drafts the
// grammar allows.
#pragma once
#include <stdint.h>

#include <memory>
#include <unordered_map>
#include <vector>

#include "engine/block_manager.h"
#include "engine/executor.h"
#include "engine/grammar.h"
#include "engine/request.h"
#include "engine/speculative.h"

namespace lmkit {

class DraftModel {
 public:
  // executor: the draft model, its KV pool not allocated yet (here: num_blocks blocks of block_size_tokens);
  // max_rows: rows of one forward at most (its workspaces); target_vocab: a draft id at or past it ends the drafts;
  // eos_token_ids: a draft of one of them is the last; prefix_caching: the draft pool keeps the blocks of ended
  // sequences for prefix hits (as the engine's pool does with enable_prefix_caching), else they are free at once.
  DraftModel(std::unique_ptr<Executor> executor, int32_t num_blocks, int32_t block_size_tokens, int32_t max_rows,
             int32_t target_vocab, std::vector<int32_t> eos_token_ids = {}, bool prefix_caching = true);

  // Drafts for each seqs[i] (one pending token) up to max_tokens[i] tokens: the draft model's greedy continuation of
  // its tokens, into drafts[i]. Fewer where the draft pool has no room, where the catch-up of a long prompt does not
  // fit this pass's max_rows (it goes on next time, with no drafts now), where a draft falls outside the target's
  // vocabulary or follows an end of sequence, and none where the sequence has an id outside the draft model's. Throws
  // what the executor throws (the caller then drops the drafts; the states stay consistent).
  void propose(const std::vector<const Sequence*>& seqs, const std::vector<int32_t>& max_tokens,
               std::vector<std::vector<int32_t>>& drafts);
  // Whether the draft model can draft for seq: not once seq holds an id past the draft's vocabulary (a larger
  // target's padding, or a request's own ids; its draft state's blocks then go back). Scans only tokens not seen yet.
  bool can_draft(const Sequence& seq);
  // Gives back sequence seq_id's draft state (its blocks become cached or free). Unknown ids are ignored.
  void release(int64_t seq_id);
  // Rows the next propose() for seq runs before its first draft: its tokens whose K/V its draft state lacks (one or
  // two for a sequence that drafted last step; for one without a state, or whose state was given back, its context
  // past what the draft pool's prefix cache holds).
  int32_t rows_behind(const Sequence& seq) const;
  // Times passes of 1 to 64 single-token rows into pass_cost() and a pass over one sequence's first rows into
  // catch_up_seconds() (once, before the first request).
  void calibrate();
  // Seconds of one draft pass by its rows (calibrate(); 0 before it).
  const StepCost& pass_cost() const { return pass_cost_; }
  // Seconds of a pass over `rows` rows of one sequence's context (calibrate(); 0 before it).
  double catch_up_seconds(int32_t rows) const { return rows * seconds_per_context_row_; }
  // Gives the pages of the draft pool's free blocks and of the draft's scratch back to the OS (Executor's).
  void release_idle_memory() { executor_->release_idle_memory(blocks_.free_block_ids()); }
  // Throws when the draft pool's bookkeeping is inconsistent (block states, references against the tables).
  void check_integrity() const;
  std::vector<int64_t> state_ids() const;
  int32_t num_free_blocks() const { return blocks_.num_available_blocks(); }
  Executor& executor() { return *executor_; }

 private:
  struct State {
    std::vector<int32_t> table;    // draft-pool blocks of positions [0, table.size() * block size)
    int32_t computed = 0;          // positions [0, computed) hold K/V of the sequence's tokens
    std::vector<int32_t> written;  // inputs of positions [computed, computed + written.size()): drafts decoded
    int32_t published = 0;         // full blocks given a prefix key (the draft pool's own prefix cache)
    uint64_t key = 0;              // the key of block published - 1
    int32_t scanned = 0;           // tokens can_draft() has looked at
    bool stuck = false;            // the sequence holds an id past the draft's vocabulary
  };
  // Room in st's table for positions [0, end): allocates what is missing, giving back idle states (not in `busy`)
  // when the pool is short. Returns whether it all fits.
  bool reserve(State& st, int32_t end, const std::vector<int64_t>& busy);
  // How many of the drafts st wrote the sequence holds as its own tokens now (their K/V are its own).
  static int32_t kept_drafts(const State& st, const Sequence& seq);
  void publish(State& st, const int32_t* tokens);

  std::unique_ptr<Executor> executor_;
  BlockManager blocks_;
  int32_t max_rows_;
  int32_t target_vocab_;
  std::vector<int32_t> eos_token_ids_;
  bool prefix_caching_;
  bool masks_fit_ = false;  // the draft's logits are no wider than a grammar's masks (the target's vocabulary)
  SamplingParams greedy_;
  StepCost pass_cost_;
  double seconds_per_context_row_ = 0;
  std::unordered_map<int64_t, State> states_;  // by Sequence::id
};

}  // namespace lmkit
