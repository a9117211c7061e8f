// llguidance through dlopen: the entry points and structs below are declared with llguidance's C ABI
// (llguidance.h: opaque handles, zero-initialised init structs, LlgTokenizerInitV2 sized by struct_size), so
// no llguidance header or library is needed to build.
#include "engine/grammar.h"

#include <dlfcn.h>
#include <pthread.h>

#include <chrono>
#include <cstring>
#include <map>
#include <sstream>

#include "core/check.h"

namespace lmkit {

namespace {

struct ParserLimits {
  size_t max_items_in_row;
  uint64_t initial_lexer_fuel;
  uint64_t step_lexer_fuel;
  size_t step_max_items;
  size_t max_lexer_states;
  size_t max_grammar_size;
  bool precompute_large_lexemes;
  bool verbose_errors;
};

struct ConstraintInit {
  const LlgTokenizer* tokenizer;
  uint32_t log_buffer_level;
  uint32_t log_stderr_level;
  bool ff_tokens_ok;
  bool backtrack_ok;
  ParserLimits limits;
};

// Room for fields a newer library may append (it zero-fills nothing itself: the caller must).
union ConstraintInitBuffer {
  ConstraintInit init;
  unsigned char bytes[1024];
};

using TokenizeFn = size_t (*)(const void*, const uint8_t*, size_t, uint32_t*, size_t);

struct TokenizerInitV2 {
  size_t struct_size;
  uint32_t vocab_size;
  uint32_t tok_eos;
  const uint32_t* token_lens;
  const uint8_t* token_bytes;
  const char* tokenizer_json;
  bool tokenize_assumes_string;
  TokenizeFn tokenize_fn;
  bool use_approximate_greedy_tokenize_fn;
  const void* tokenize_user_data;
  const char* const* slices;
  const uint32_t* tok_eos_extra;
  uint32_t tok_eos_extra_count;
};

}  // namespace

struct LlgApi {
  void* lib = nullptr;
  LlgTokenizer* (*new_tokenizer_v2)(const TokenizerInitV2*, char*, size_t) = nullptr;
  void (*free_tokenizer)(LlgTokenizer*) = nullptr;
  void (*constraint_init_set_defaults)(ConstraintInit*, const LlgTokenizer*) = nullptr;
  LlgMatcher* (*new_matcher)(const ConstraintInit*, const char*, const char*) = nullptr;
  const char* (*matcher_get_error)(LlgMatcher*) = nullptr;
  int32_t (*matcher_compute_mask)(LlgMatcher*) = nullptr;
  int32_t (*matcher_compute_mask_into)(LlgMatcher*, uint32_t*, size_t) = nullptr;
  size_t (*matcher_get_mask_byte_size)(const LlgMatcher*) = nullptr;
  int32_t (*matcher_consume_token)(LlgMatcher*, uint32_t) = nullptr;
  int32_t (*matcher_validate_tokens)(LlgMatcher*, const uint32_t*, size_t) = nullptr;
  bool (*matcher_is_accepting)(LlgMatcher*) = nullptr;
  bool (*matcher_is_stopped)(const LlgMatcher*) = nullptr;
  LlgMatcher* (*clone_matcher)(const LlgMatcher*) = nullptr;
  void (*free_matcher)(LlgMatcher*) = nullptr;
  const char* (*get_version)() = nullptr;

  // One per library path for the life of the process (dlclose would unload code llguidance's threads run).
  static std::shared_ptr<const LlgApi> load(const std::string& path) {
    static std::mutex mu;
    static std::map<std::string, std::shared_ptr<const LlgApi>> loaded;
    std::lock_guard<std::mutex> lock(mu);
    auto it = loaded.find(path);
    if (it != loaded.end()) return it->second;
    void* lib = dlopen(path.c_str(), RTLD_NOW | RTLD_LOCAL);
    LMKIT_CHECK_ARG(lib != nullptr, "cannot load llguidance from ", path, ": ", dlerror(),
                    " (structured output needs the llguidance package: pip install llguidance)");
    auto api = std::make_shared<LlgApi>();
    api->lib = lib;
    bool ok = true;
    auto sym = [&](auto& fn, const char* name) {
      fn = reinterpret_cast<std::remove_reference_t<decltype(fn)>>(dlsym(lib, name));
      ok = ok && fn != nullptr;
    };
    sym(api->new_tokenizer_v2, "llg_new_tokenizer_v2");
    sym(api->free_tokenizer, "llg_free_tokenizer");
    sym(api->constraint_init_set_defaults, "llg_constraint_init_set_defaults");
    sym(api->new_matcher, "llg_new_matcher");
    sym(api->matcher_get_error, "llg_matcher_get_error");
    sym(api->matcher_compute_mask, "llg_matcher_compute_mask");
    sym(api->matcher_compute_mask_into, "llg_matcher_compute_mask_into");
    sym(api->matcher_get_mask_byte_size, "llg_matcher_get_mask_byte_size");
    sym(api->matcher_consume_token, "llg_matcher_consume_token");
    sym(api->matcher_validate_tokens, "llg_matcher_validate_tokens");
    sym(api->matcher_is_accepting, "llg_matcher_is_accepting");
    sym(api->matcher_is_stopped, "llg_matcher_is_stopped");
    sym(api->clone_matcher, "llg_clone_matcher");
    sym(api->free_matcher, "llg_free_matcher");
    sym(api->get_version, "llg_get_version");
    LMKIT_CHECK_ARG(ok, path, " does not export llguidance's C API (llg_new_matcher, ...): install llguidance "
                    ">= 1.0 (pip install -U llguidance)");
    loaded[path] = api;
    return api;
  }
};

GrammarTokenizer::GrammarTokenizer(const std::string& library, const std::string& tokenizer_json,
                                   int32_t vocab_size, const std::vector<int32_t>& eos_token_ids)
    : api_(LlgApi::load(library)), vocab_size_(vocab_size) {
  LMKIT_CHECK_ARG(vocab_size > 0, "vocab_size must be > 0, got ", vocab_size);
  LMKIT_CHECK_ARG(!eos_token_ids.empty(), "a grammar needs at least one eos token id to end on");
  std::vector<uint32_t> extra(eos_token_ids.begin() + 1, eos_token_ids.end());
  TokenizerInitV2 init;
  std::memset(&init, 0, sizeof(init));
  init.struct_size = sizeof(init);
  init.vocab_size = (uint32_t)vocab_size;
  init.tok_eos = (uint32_t)eos_token_ids[0];
  init.tokenizer_json = tokenizer_json.c_str();
  // Masks never need tokenizing text (lmkit takes no fast-forward tokens): the greedy tokenizer serves.
  init.use_approximate_greedy_tokenize_fn = true;
  init.tok_eos_extra = extra.empty() ? nullptr : extra.data();
  init.tok_eos_extra_count = (uint32_t)extra.size();
  char error[1024] = {0};
  tok_ = api_->new_tokenizer_v2(&init, error, sizeof(error));
  LMKIT_CHECK_ARG(tok_ != nullptr, "llguidance cannot use this tokenizer: ", error);
}

GrammarTokenizer::~GrammarTokenizer() {
  wait_overdue();  // they read tok_
  if (tok_) api_->free_tokenizer(tok_);
}

std::string GrammarTokenizer::version() const { return api_->get_version ? api_->get_version() : ""; }

// One compile: llguidance's new_matcher and first mask, on a thread of its own (a deep stack; a caller that can
// stop waiting). The thread owns nothing it could outlive: the destructor joins it.
struct GrammarCompile {
  const LlgApi* api = nullptr;
  ConstraintInitBuffer init;
  std::string kind, text;

  std::mutex mu;
  std::condition_variable cv;
  bool done = false;               // guarded by mu
  LlgMatcher* matcher = nullptr;   // the result (guarded by mu): owned here until taken
  std::string error;               // llguidance's message when it refused the grammar
  pthread_t thread{};
  bool joinable = false;

  void run() {
    LlgMatcher* m = api->new_matcher(&init.init, kind.c_str(), text.c_str());
    const char* e = api->matcher_get_error(m);
    if (!e && api->matcher_compute_mask(m) != 0) e = api->matcher_get_error(m);
    std::string message = e ? e : "";
    if (e) {
      api->free_matcher(m);
      m = nullptr;
    }
    {
      std::lock_guard<std::mutex> lock(mu);
      matcher = m;
      error = std::move(message);
      done = true;
    }
    cv.notify_all();
  }

  static void* trampoline(void* self) {
    static_cast<GrammarCompile*>(self)->run();
    return nullptr;
  }

  // Starts the thread (a smaller stack, then the calling thread, where the address space is short).
  void start() {
    for (size_t stack : {CompiledGrammar::kCompileStackBytes, CompiledGrammar::kCompileStackBytes / 8}) {
      pthread_attr_t attr;
      pthread_attr_init(&attr);
      pthread_attr_setstacksize(&attr, stack);
      joinable = pthread_create(&thread, &attr, &GrammarCompile::trampoline, this) == 0;
      pthread_attr_destroy(&attr);
      if (joinable) return;
    }
    run();
  }

  // True when the compile ended within timeout_s (<= 0: waits for it).
  bool wait(double timeout_s) {
    std::unique_lock<std::mutex> lock(mu);
    if (timeout_s <= 0) {
      cv.wait(lock, [&] { return done; });
      return true;
    }
    return cv.wait_for(lock, std::chrono::duration<double>(timeout_s), [&] { return done; });
  }

  ~GrammarCompile() {
    if (joinable) pthread_join(thread, nullptr);
    if (matcher) api->free_matcher(matcher);
  }
};

void GrammarTokenizer::keep_overdue(std::shared_ptr<GrammarCompile> compile) const {
  std::lock_guard<std::mutex> lock(overdue_mu_);
  overdue_.push_back(std::move(compile));
}

void GrammarTokenizer::wait_overdue() const {
  std::vector<std::shared_ptr<GrammarCompile>> overdue;
  {
    std::lock_guard<std::mutex> lock(overdue_mu_);
    overdue.swap(overdue_);
  }
  overdue.clear();  // each destructor joins its thread
}

CompiledGrammar::CompiledGrammar(std::shared_ptr<const GrammarTokenizer> tokenizer, const std::string& kind,
                                 const std::string& text, double timeout_s)
    : tokenizer_(std::move(tokenizer)) {
  LMKIT_CHECK_ARG(kind == "json_schema" || kind == "regex" || kind == "lark", "grammar kind must be json_schema, "
                  "regex or lark, got '", kind, "'");
  LMKIT_CHECK_ARG(timeout_s >= 0 && timeout_s < 1e9, "timeout_s must be >= 0 (0: no deadline), got ", timeout_s);
  tokenizer_->wait_overdue();
  auto compile = std::make_shared<GrammarCompile>();
  compile->api = &tokenizer_->api();
  std::memset(&compile->init, 0, sizeof(compile->init));
  compile->api->constraint_init_set_defaults(&compile->init.init, tokenizer_->handle());
  compile->init.init.log_stderr_level = 0;  // errors come back as exceptions, not as lines on the server's stderr
  compile->init.init.limits.verbose_errors = false;  // the error, not the parser's state after it (clients read these)
  compile->kind = kind;
  compile->text = text;
  compile->start();
  if (!compile->wait(timeout_s)) {
    tokenizer_->keep_overdue(std::move(compile));
    std::ostringstream what;
    what << "compiling the " << (kind == "json_schema" ? "JSON schema" : kind == "regex" ? "regex" : "grammar")
         << " took longer than " << timeout_s << " s: make it smaller or simpler";
    throw InvalidArgument(what.str());
  }
  std::lock_guard<std::mutex> lock(compile->mu);
  if (!compile->matcher) throw InvalidArgument("invalid " + kind + ": " + compile->error);
  prototype_ = compile->matcher;
  compile->matcher = nullptr;
}

CompiledGrammar::~CompiledGrammar() {
  if (prototype_) tokenizer_->api().free_matcher(prototype_);
}

LlgMatcher* CompiledGrammar::clone_matcher() const {
  std::lock_guard<std::mutex> lock(mu_);
  return tokenizer_->api().clone_matcher(prototype_);
}

GrammarMatcher::GrammarMatcher(std::shared_ptr<const CompiledGrammar> grammar, MaskWorker* worker)
    : grammar_(std::move(grammar)), worker_(worker), matcher_(grammar_->clone_matcher()) {
  const size_t bytes = grammar_->tokenizer().api().matcher_get_mask_byte_size(matcher_);
  mask_.assign((bytes + 3) / 4, 0);
}

GrammarMatcher::~GrammarMatcher() {
  if (worker_) worker_->wait(this);
  grammar_->tokenizer().api().free_matcher(matcher_);
}

void GrammarMatcher::compute() {
  const LlgApi& api = grammar_->tokenizer().api();
  if (!mask_current_) {
    if (api.matcher_compute_mask_into(matcher_, mask_.data(), mask_.size() * 4) != 0) {
      failed_ = true;
      std::fill(mask_.begin(), mask_.end(), 0u);
    }
    mask_current_ = true;
  }
  if (drafts_.empty()) return;
  // Each draft consumed by a copy of the matcher, the mask after it computed: the sequence's own matcher never
  // sees a draft (an error puts a matcher in an error state for good, and a validated draft may still be refused:
  // llguidance's validation of several tokens can skip a length limit). From a draft the copy refuses, or whose
  // mask fails, on, rows take the mask before it: their draft is rejected there, and their samples dropped.
  const size_t words = mask_.size();
  const int32_t n = (int32_t)drafts_.size();
  draft_masks_.resize((size_t)n * words);
  LlgMatcher* copy = api.clone_matcher(matcher_);
  bool ok = copy != nullptr;
  for (int32_t j = 0; j < n; ++j) {
    uint32_t* out = draft_masks_.data() + (size_t)j * words;
    const uint32_t* before = j == 0 ? mask_.data() : out - words;
    ok = ok && in_vocab(drafts_[j]) &&
         api.matcher_consume_token(copy, (uint32_t)drafts_[j]) == 0 &&
         api.matcher_compute_mask_into(copy, out, words * 4) == 0;
    if (!ok) std::copy(before, before + words, out);
  }
  if (copy) api.free_matcher(copy);
  num_draft_masks_ = n;
  drafts_.clear();
}

void GrammarMatcher::request_mask() {
  if (worker_)
    worker_->submit(this);
  else
    compute();
}

int32_t GrammarMatcher::num_valid(const int32_t* drafts, int32_t n) {
  wait();
  std::vector<uint32_t> ids;
  for (int32_t j = 0; j < n && in_vocab(drafts[j]); ++j) ids.push_back(drafts[j]);
  if (ids.empty() || failed_) return 0;
  const int32_t valid = grammar_->tokenizer().api().matcher_validate_tokens(matcher_, ids.data(), ids.size());
  return valid < 0 ? 0 : valid;
}

void GrammarMatcher::request_draft_masks(const int32_t* drafts, int32_t n) {
  wait();  // the worker's job reads drafts_
  drafts_.assign(drafts, drafts + n);
  num_draft_masks_ = 0;
  request_mask();
}

const uint32_t* GrammarMatcher::wait(int32_t row) const {
  if (worker_) worker_->wait(this);
  if (row <= 0) return mask_.data();
  LMKIT_CHECK(row <= num_draft_masks_, "grammar mask of draft row ", row, " asked, ", num_draft_masks_, " computed");
  return draft_masks_.data() + (size_t)(row - 1) * mask_.size();
}

bool GrammarMatcher::consume(int32_t token) {
  wait();
  const LlgApi& api = grammar_->tokenizer().api();
  if (!in_vocab(token)) return false;
  mask_current_ = false;
  num_draft_masks_ = 0;
  return api.matcher_consume_token(matcher_, (uint32_t)token) == 0;
}

bool GrammarMatcher::is_accepting() {
  wait();
  return grammar_->tokenizer().api().matcher_is_accepting(matcher_);
}

bool GrammarMatcher::is_stopped() const {
  wait();
  return failed_ || grammar_->tokenizer().api().matcher_is_stopped(matcher_);
}

std::string GrammarMatcher::error() const {
  wait();
  const char* e = grammar_->tokenizer().api().matcher_get_error(matcher_);
  return e ? e : "";
}

MaskWorker::MaskWorker() : thread_([this] { run(); }) {}

MaskWorker::~MaskWorker() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    stopping_ = true;
  }
  work_cv_.notify_one();
  thread_.join();
}

void MaskWorker::submit(GrammarMatcher* m) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (m->pending_) return;  // already on its way
    m->pending_ = true;
    queue_.push_back(m);
  }
  work_cv_.notify_one();
}

void MaskWorker::wait(const GrammarMatcher* m) {
  std::unique_lock<std::mutex> lock(mu_);
  done_cv_.wait(lock, [&] { return !m->pending_; });
}

void MaskWorker::run() {
  for (;;) {
    GrammarMatcher* m = nullptr;
    {
      std::unique_lock<std::mutex> lock(mu_);
      work_cv_.wait(lock, [&] { return stopping_ || !queue_.empty(); });
      if (queue_.empty()) return;  // stopping and drained
      m = queue_.front();
      queue_.pop_front();
    }
    m->compute();
    {
      std::lock_guard<std::mutex> lock(mu_);
      m->pending_ = false;
    }
    done_cv_.notify_all();
  }
}

}  // namespace lmkit
