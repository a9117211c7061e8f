// Structured output: grammars (JSON schema, regex, Lark) enforced token by token with llguidance.
//
// llguidance's C API is loaded at run time from the library the llguidance Python package ships (its
// extension exports the C entry points), so the engine links nothing of it and needs no GIL to use it.
//
//   GrammarTokenizer   one model's vocabulary as llguidance sees it (built once per engine, ~1 s for 150k ids)
//   CompiledGrammar    a parsed grammar: the prototype every request's matcher is cloned from (cached by the
//                      caller, keyed by grammar text); compiled on a thread of its own with a deep stack and a
//                      deadline (GrammarCompile)
//   GrammarMatcher     one sequence's state: consume(token) on the loop thread; its next mask is computed by
//                      the MaskWorker while the step's forward runs, and the sampler waits for it (wait()); with
//                      draft tokens (speculative decoding), also the mask after each draft: the worker consumes
//                      the drafts on a copy of the matcher and computes their masks
//   MaskWorker         one thread that computes masks in submission order
//
// Mask layout: bit i of word i / 32 set = token i allowed; ceil(vocab / 32) words.
#pragma once
#include <stdint.h>

#include <condition_variable>
#include <deque>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

namespace lmkit {

struct LlgApi;        // the C entry points (grammar.cpp)
struct LlgTokenizer;  // llguidance's opaque handles
struct LlgMatcher;
struct GrammarCompile;  // one compile on its own thread (grammar.cpp)

// A token mask computed beside the forward; the sampler reads it through wait() (batch.h SampleRow::mask).
class TokenMask {
 public:
  virtual ~TokenMask() = default;
  // Blocks until the mask of the next token is ready: ceil(vocab / 32) words, bit set = allowed. row j > 0: the
  // mask after the first j draft tokens (GrammarMatcher::request_draft_masks).
  virtual const uint32_t* wait(int32_t row = 0) const = 0;
};

class GrammarTokenizer {
 public:
  // library: path of llguidance's shared library; tokenizer_json: a Hugging Face tokenizer.json (its token
  // bytes, special tokens marked as llguidance marks them); vocab_size: the model's logits width (ids past the
  // tokenizer's are never allowed); eos_token_ids: what ends a grammar (at least one).
  // Throws InvalidArgument when the library cannot be loaded or llguidance refuses the vocabulary.
  GrammarTokenizer(const std::string& library, const std::string& tokenizer_json, int32_t vocab_size,
                   const std::vector<int32_t>& eos_token_ids);
  ~GrammarTokenizer();
  GrammarTokenizer(const GrammarTokenizer&) = delete;
  GrammarTokenizer& operator=(const GrammarTokenizer&) = delete;

  int32_t vocab_size() const { return vocab_size_; }
  const LlgApi& api() const { return *api_; }
  const LlgTokenizer* handle() const { return tok_; }
  // llguidance's version string (e.g. "llguidance@1.9.1 ...").
  std::string version() const;

  // Compiles whose caller stopped waiting at its deadline and that still run: kept here so that the next
  // compile for this vocabulary first waits for them (one overdue compile at a time, never a pile of them)
  // and the destructor joins them before the vocabulary they read is freed.
  void keep_overdue(std::shared_ptr<GrammarCompile> compile) const;
  void wait_overdue() const;

 private:
  std::shared_ptr<const LlgApi> api_;
  LlgTokenizer* tok_ = nullptr;
  int32_t vocab_size_ = 0;
  mutable std::mutex overdue_mu_;
  mutable std::vector<std::shared_ptr<GrammarCompile>> overdue_;
};

class CompiledGrammar {
 public:
  // kind: "json_schema" | "regex" | "lark"; text: the schema (JSON text), the regex or the grammar.
  // Parses the grammar and computes its first mask (what a request would wait for first: the lexer's
  // first states are built here, once). Throws InvalidArgument with llguidance's message when the grammar
  // is invalid or uses what llguidance does not support, and when compiling it takes longer than
  // timeout_s seconds (> 0; 0: no deadline). llguidance cannot be interrupted: an overdue compile runs to
  // its end on its thread, its result dropped (see GrammarTokenizer::keep_overdue).
  //
  // The compile runs on a thread with a kCompileStackBytes stack: llguidance recurses once per link of a
  // chain of rules or groups (a 3,000-rule chain overflows an 8 MiB stack and kills the process), so the
  // caller bounds the grammar's size (lmkit/structured.py MAX_GRAMMAR_CHARS: 256 KiB of Lark needs at most
  // ~256 MiB) and the stack is sized past that.
  CompiledGrammar(std::shared_ptr<const GrammarTokenizer> tokenizer, const std::string& kind,
                  const std::string& text, double timeout_s = 0);
  static constexpr size_t kCompileStackBytes = size_t(512) << 20;  // address space; pages touched as needed
  ~CompiledGrammar();
  CompiledGrammar(const CompiledGrammar&) = delete;
  CompiledGrammar& operator=(const CompiledGrammar&) = delete;

  const GrammarTokenizer& tokenizer() const { return *tokenizer_; }
  // A matcher in the grammar's start state (a clone of the prototype; thread-safe).
  LlgMatcher* clone_matcher() const;

 private:
  std::shared_ptr<const GrammarTokenizer> tokenizer_;
  LlgMatcher* prototype_ = nullptr;
  mutable std::mutex mu_;  // llguidance's clone reads the prototype: one at a time
};

class MaskWorker;

// One sequence's grammar state. The loop thread calls consume() / is_*(); between request_mask() and the
// end of wait() the worker owns the matcher, and the loop thread touches it only through wait().
class GrammarMatcher : public TokenMask {
 public:
  GrammarMatcher(std::shared_ptr<const CompiledGrammar> grammar, MaskWorker* worker);
  ~GrammarMatcher() override;  // waits for a mask in flight
  GrammarMatcher(const GrammarMatcher&) = delete;
  GrammarMatcher& operator=(const GrammarMatcher&) = delete;

  // Starts computing the mask of the next token (on the worker; synchronously without one).
  void request_mask();
  // How many of drafts[0, n) the grammar allows in a row from here (the matcher unchanged).
  int32_t num_valid(const int32_t* drafts, int32_t n);
  // Starts computing the mask after each of drafts[0, j], j < n (rows 1..n of wait()), drafts the grammar allows
  // (num_valid), on a copy of the matcher (this one is left as it is). Call after the next token's mask was
  // requested.
  void request_draft_masks(const int32_t* drafts, int32_t n);
  const uint32_t* wait(int32_t row = 0) const override;
  // Advances by a sampled token; false (see error()) when the grammar does not allow it.
  bool consume(int32_t token);
  // The grammar accepts what was consumed (an eos may end it here).
  bool is_accepting();
  // Nothing but an eos can follow (or the matcher failed): the sequence ends.
  bool is_stopped() const;
  std::string error() const;

 private:
  friend class MaskWorker;
  void compute();  // the worker's job: fills mask_, then the draft masks asked for
  bool in_vocab(int32_t token) const { return token >= 0 && (size_t)token < mask_.size() * 32; }  // a mask's bits

  std::shared_ptr<const CompiledGrammar> grammar_;
  MaskWorker* worker_;
  LlgMatcher* matcher_ = nullptr;
  std::vector<uint32_t> mask_;
  bool mask_current_ = false;  // mask_ is the next token's (false once a token is consumed)
  std::vector<int32_t> drafts_;  // the draft tokens whose masks the worker's job computes (then none)
  std::vector<uint32_t> draft_masks_;  // [row - 1] the mask after drafts [0, row), each mask_.size() words
  int32_t num_draft_masks_ = 0;
  bool pending_ = false;  // guarded by the worker's mutex
  bool failed_ = false;   // compute_mask failed (error() says why)
};

// Computes GrammarMatcher masks on its own thread, in submission order.
class MaskWorker {
 public:
  MaskWorker();
  ~MaskWorker();
  MaskWorker(const MaskWorker&) = delete;
  MaskWorker& operator=(const MaskWorker&) = delete;

  void submit(GrammarMatcher* m);
  void wait(const GrammarMatcher* m);

 private:
  void run();
  std::mutex mu_;
  std::condition_variable work_cv_, done_cv_;
  std::deque<GrammarMatcher*> queue_;
  bool stopping_ = false;
  std::thread thread_;
};

}  // namespace lmkit
