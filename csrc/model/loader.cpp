#include "model/loader.h"

#include "core/check.h"
#include "model/model.h"
#ifdef LMKIT_WITH_CUDA
#include "kernels/cuda/ops_cuda.h"
#endif

namespace lmkit {

std::unique_ptr<Engine> create_engine(const EngineConfig& config, const ModelConfig& model,
                                      const std::map<std::string, TensorSource>& sources,
                                      const std::vector<int32_t>& eos_token_ids,
                                      const PoolSizer& size_pools, const DraftSpec* draft) {
#ifdef LMKIT_WITH_CUDA
  LMKIT_CHECK_ARG(config.device == "cpu" || config.device == "cuda", "device must be 'cpu' or 'cuda', got '",
                  config.device, "'");
  LMKIT_CHECK_ARG(config.device == "cpu" || cuda::is_available(),
                  "device='cuda' but no CUDA device is usable (no driver or no GPU); use device='cpu'");
#else
  LMKIT_CHECK_ARG(config.device == "cpu", "device='", config.device,
                  "' is not available in this build (built without the CUDA backend); use device='cpu'");
#endif
  LMKIT_CHECK_ARG(config.max_batch_size >= 1, "max_batch_size must be >= 1, got ", config.max_batch_size);
  LMKIT_CHECK_ARG(config.block_size_tokens >= 1, "cache_block_seq_len must be >= 1, got ", config.block_size_tokens);
  LMKIT_CHECK_ARG(config.max_prefill_token_num >= 1, "max_prefill_token_num must be >= 1, got ",
                  config.max_prefill_token_num);
  LMKIT_CHECK_ARG(config.decode_slowdown == 0 || config.decode_slowdown > 1,
                  "decode_slowdown must be 0 (no pacing) or > 1, got ", config.decode_slowdown);
  LMKIT_CHECK_ARG(config.num_threads >= 0, "num_threads must be >= 0, got ", config.num_threads);
  model.validate();

  EngineOptions options;
  options.max_batch_size = config.max_batch_size;
  options.session_len = config.session_len > 0 ? config.session_len : model.max_position_embeddings;
  LMKIT_CHECK_ARG(options.session_len > 1, "session_len must be > 1 (the model's max_position_embeddings is ",
                  model.max_position_embeddings, ")");
  options.block_size_tokens = config.block_size_tokens;
  options.max_prefill_token_num = config.max_prefill_token_num;
  options.decode_slowdown = config.decode_slowdown;
  options.vocab_size = model.vocab_size;
  options.eos_token_ids = eos_token_ids;
  options.enable_prefix_caching = config.enable_prefix_caching;
  options.engine_cpus = config.engine_cpus;
  options.callback_cpus = config.callback_cpus;
  options.kv_cache_dir = config.kv_cache_dir;
  options.kv_cache_disk_bytes = config.kv_cache_disk_bytes;
  options.kv_cache_read_bytes_per_step = config.kv_cache_read_bytes_per_step;
  options.kv_cache_identity = config.kv_cache_identity;

  BackendOptions backend;
  backend.max_step_tokens = config.max_prefill_token_num + config.max_batch_size;
  backend.num_threads = config.num_threads;
  backend.int8_activations = config.int8_activations;
  backend.bf16_linear = config.bf16_linear;
  backend.bf16_kv = config.bf16_kv;
  backend.int8_weights = config.int8_weights;
  backend.max_blocks_per_seq = (options.session_len + config.block_size_tokens - 1) / config.block_size_tokens;
  backend.cuda_graphs = config.cuda_graphs;
  ModelOptions model_options;
  model_options.block_size_tokens = config.block_size_tokens;
  model_options.max_step_tokens = backend.max_step_tokens;
  model_options.kv_quant = config.kv_quant;
  model_options.mtp = config.speculative.enabled && config.speculative.mtp;
  ModelWeights weights = ModelWeights::load(model, sources);
  std::unique_ptr<Backend> device;
  int64_t device_free_bytes = 0;  // CUDA: free GPU memory once weights and workspaces are in; CPU: 0
#ifdef LMKIT_WITH_CUDA
  if (config.device == "cuda") {
    const DType act = weights.embed_tokens.dtype == DType::BF16 ? DType::BF16 : DType::F16;
    device = make_cuda_backend(backend, act, model.hidden_size, model.vocab_size);
  }
#endif
  if (!device) device = make_cpu_backend(backend);
  const bool is_cuda = std::string(device->name()) == "cuda";
  std::unique_ptr<Executor> executor = make_model(model, std::move(weights), std::move(device), model_options);
#ifdef LMKIT_WITH_CUDA
  if (is_cuda) {
    int64_t total_bytes = 0;
    cuda::memory_info(&device_free_bytes, &total_bytes);
  }
#endif
  // speculative='draft': the draft model on the same backend options, without a KV policy or an MTP head
  LMKIT_CHECK_ARG(config.speculative.enabled && config.speculative.draft_model ? draft != nullptr : draft == nullptr,
                  "a draft model goes with speculative='draft' (and speculative='draft' needs one)");
  LMKIT_CHECK_ARG(!draft || !is_cuda, "speculative='draft' runs on the CPU backend: use speculative='off' with "
                  "device='cuda'");
  std::unique_ptr<Executor> draft_executor;
  if (draft) {
    draft->model.validate();
    ModelOptions draft_options;
    draft_options.block_size_tokens = config.block_size_tokens;
    draft_options.max_step_tokens = backend.max_step_tokens;
    draft_executor = make_model(draft->model, ModelWeights::load(draft->model, draft->sources),
                                make_cpu_backend(backend), draft_options);
    LMKIT_CHECK_ARG(draft_executor->state_bytes_per_slot() == 0, "the draft model (", draft->model.family,
                    ") has recurrent layers, whose state a draft cannot roll back yet: draft with an attention-only "
                    "model");
  }
  const int64_t draft_kv_bytes = draft_executor ? draft_executor->kv_bytes_per_block() : 0;
  const int64_t draft_weight_bytes = draft_executor ? draft_executor->linear_weight_bytes() : 0;
  options.attention_window_tokens = model.attention_window_tokens();
  options.kv_bytes_per_block = executor->kv_bytes_per_block();
  options.linear_weight_bytes = executor->linear_weight_bytes();
  options.mtp_num_layers = executor->mtp_num_layers();
  options.mtp_weight_bytes = executor->mtp_weight_bytes();
  // A model with recurrent layers: a state slot per running sequence, and with prefix caching as many again for
  // the snapshots prefix hits start from (engine/scheduler.h), as far as memory allows (lmkit/memory.py).
  const int64_t state_bytes = executor->state_bytes_per_slot();
  LMKIT_CHECK(size_pools != nullptr, "create_engine needs a pool sizer (lmkit/memory.py sizes every pool)");
  const PoolSizes sizes = size_pools(options.kv_bytes_per_block + draft_kv_bytes, state_bytes,
                                     options.linear_weight_bytes + draft_weight_bytes, options.session_len,
                                     is_cuda ? device_free_bytes : 0);
  LMKIT_CHECK_ARG(sizes.num_blocks >= 1, "the pool sizer gave ", sizes.num_blocks, " KV blocks; it needs >= 1");
  LMKIT_CHECK_ARG(state_bytes > 0 ? sizes.num_state_slots >= 1 : sizes.num_state_slots == 0, "the pool sizer gave ",
                  sizes.num_state_slots, " state slots for a model with ", state_bytes, " bytes of state per slot");
  options.num_blocks = sizes.num_blocks;
  LMKIT_CHECK_ARG(sizes.num_draft_state_slots >= 0 && (sizes.num_draft_state_slots == 0 ||
                                                        (state_bytes > 0 && config.speculative.enabled)),
                  "the pool sizer gave ", sizes.num_draft_state_slots, " draft checkpoint slots (they need speculative "
                  "decoding and a model with recurrent layers)");
  LMKIT_CHECK_ARG(config.kv_cache_dir.empty() ? sizes.num_store_queue_blocks == 0 : sizes.num_store_queue_blocks >= 1,
                  "the pool sizer gave a disk-store queue of ", sizes.num_store_queue_blocks, " blocks (kv_cache_dir ",
                  config.kv_cache_dir.empty() ? "unset" : "set", ")");
  options.kv_cache_queue_blocks = sizes.num_store_queue_blocks;
  options.num_state_slots = sizes.num_state_slots + sizes.num_draft_state_slots;
  options.num_draft_state_slots = sizes.num_draft_state_slots;
  options.speculative = config.speculative;
  LMKIT_CHECK_ARG(!config.speculative.enabled || !is_cuda, "speculative decoding runs on the CPU backend; the CUDA "
                  "backend does not verify draft tokens yet: use speculative='off' with device='cuda'");
  std::unique_ptr<DraftModel> draft_model;
  if (draft_executor)
    draft_model = std::make_unique<DraftModel>(std::move(draft_executor), sizes.num_blocks, config.block_size_tokens,
                                               backend.max_step_tokens, model.vocab_size, eos_token_ids,
                                               config.enable_prefix_caching);
  return std::make_unique<Engine>(options, std::move(executor), std::move(draft_model));
}

}  // namespace lmkit
