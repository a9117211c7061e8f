// lmkit._engine: the coarse boundary between Python and the C++ engine. A handful of objects
// (configs, the engine, request outputs, metrics); every blocking call releases the GIL, and the
// callback thread takes it only to call the consumer.
#include <pybind11/functional.h>
#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include "core/check.h"
#include "core/clock.h"
#include "engine/engine.h"
#include "kernels/cpu/kernel_table.h"
#include "kernels/cpu/thread_pool.h"
#include "kernels/ops.h"
#include "model/loader.h"

namespace py = pybind11;
using namespace lmkit;

void bind_cuda(py::module_& parent);  // bind_cuda.cpp: the lmkit._engine.cuda submodule

namespace {

const char* const kPoolingNames[] = {"none", "last", "mean", "first"};  // by Pooling value

DType parse_dtype(const std::string& s) {
  if (s == "F32") return DType::F32;
  if (s == "F16") return DType::F16;
  if (s == "BF16") return DType::BF16;
  if (s == "I32") return DType::I32;
  if (s == "I8") return DType::I8;
  if (s == "U8") return DType::U8;
  if (s == "Q4_0") return DType::Q4_0;
  if (s == "Q4_1") return DType::Q4_1;
  if (s == "Q5_0") return DType::Q5_0;
  if (s == "Q8_0") return DType::Q8_0;
  if (s == "Q4_K") return DType::Q4_K;
  if (s == "Q5_K") return DType::Q5_K;
  if (s == "Q6_K") return DType::Q6_K;
  if (s == "MXFP4") return DType::MXFP4;
  throw InvalidArgument("unsupported tensor dtype " + s);
}

// Engine objects die without the GIL: shutdown joins the callback thread, which may be waiting for it.
struct GilReleasingDelete {
  void operator()(Engine* e) const {
    py::gil_scoped_release release;
    delete e;
  }
};
using EnginePtr = std::unique_ptr<Engine, GilReleasingDelete>;

}  // namespace

PYBIND11_MODULE(_engine, m) {
  m.doc() = "lmkit C++ engine (import through lmkit, not directly)";
  py::register_local_exception_translator([](std::exception_ptr p) {
    try {
      if (p) std::rethrow_exception(p);
    } catch (const InvalidArgument& e) {
      PyErr_SetString(PyExc_ValueError, e.what());
    } catch (const Error& e) {
      PyErr_SetString(PyExc_RuntimeError, e.what());
    }
  });

  bind_cuda(m);
#ifdef LMKIT_BUILD_DIR
  m.attr("build_dir") = std::string(LMKIT_BUILD_DIR);  // the CMake build this module came from
#else
  m.attr("build_dir") = std::string();
#endif
  m.def("cpu_isa", &ops::cpu_isa, "Instruction set the CPU kernels picked at run time.");
  m.def("cpu_bf16_available", &ops::bf16_dot_available,
        "Whether this CPU runs the bf16 dot-product kernel of EngineConfig(dtype='bfloat16') (AVX512_BF16).");
  m.def("cpu_amx_available", &ops::bf16_amx_available,
        "Whether dtype='bfloat16' linear layers run on AMX tiles here (AMX-BF16; every call, one row included).");
  m.def("cpu_amx_int8_available", &ops::int8_amx_available,
        "Whether AWQ layers with int8 activations run on AMX tiles here (AMX-INT8; calls of 32 rows or more, with the "
        "VNNI kernel's bits).");
  m.def("cpu_use_amx", &ops::cpu::use_amx, py::arg("enabled"),
        "Whether linear layers and attention may use AMX tiles (default: yes, where the CPU allows), for every engine "
        "of the process; returns whether some will. For tests and benchmarks: the paths without tiles.");
  m.def("cpu_set_spin_us", &ops::cpu::set_spin_us,
        "How long idle kernel threads poll before they sleep, in microseconds (default 50), for every team of the "
        "process; for benchmarks.");
  m.def("now", &steady_seconds, "The engine's clock (seconds, steady), as in RequestOutput.emitted_at.");

  py::class_<ModelConfig>(m, "ModelConfig")
      .def(py::init<>())
      .def_readwrite("architecture", &ModelConfig::architecture)
      .def_readwrite("family", &ModelConfig::family)
      .def_readwrite("vocab_size", &ModelConfig::vocab_size)
      .def_readwrite("hidden_size", &ModelConfig::hidden_size)
      .def_readwrite("intermediate_size", &ModelConfig::intermediate_size)
      .def_readwrite("num_layers", &ModelConfig::num_layers)
      .def_readwrite("num_heads", &ModelConfig::num_heads)
      .def_readwrite("num_kv_heads", &ModelConfig::num_kv_heads)
      .def_readwrite("head_dim", &ModelConfig::head_dim)
      .def_readwrite("rms_norm_eps", &ModelConfig::rms_norm_eps)
      .def_readwrite("norm_weight_offset", &ModelConfig::norm_weight_offset)
      .def_readwrite("embed_scale", &ModelConfig::embed_scale)
      .def_readwrite("hidden_act", &ModelConfig::hidden_act)
      .def_readwrite("attn_scale", &ModelConfig::attn_scale)
      .def_readwrite("attn_logit_softcap", &ModelConfig::attn_logit_softcap)
      .def_readwrite("final_logit_softcap", &ModelConfig::final_logit_softcap)
      .def_readwrite("has_qkv_bias", &ModelConfig::has_qkv_bias)
      .def_readwrite("has_qk_norm", &ModelConfig::has_qk_norm)
      .def_readwrite("rotary_dim", &ModelConfig::rotary_dim)
      .def_readwrite("inv_freq", &ModelConfig::inv_freq)
      .def_readwrite("attention_scaling", &ModelConfig::attention_scaling)
      .def_readwrite("inv_freq_local", &ModelConfig::inv_freq_local)
      .def_readwrite("attention_scaling_local", &ModelConfig::attention_scaling_local)
      .def_readwrite("layer_rope", &ModelConfig::layer_rope)
      .def_readwrite("layer_sliding_window", &ModelConfig::layer_sliding_window)
      .def_readwrite("tie_word_embeddings", &ModelConfig::tie_word_embeddings)
      .def_readwrite("max_position_embeddings", &ModelConfig::max_position_embeddings)
      .def_readwrite("int4_layout", &ModelConfig::int4_layout)
      .def_readwrite("int4_group_size", &ModelConfig::int4_group_size)
      .def_readwrite("qk_rotary_interleaved", &ModelConfig::qk_rotary_interleaved)
      .def_readwrite("qk_norm_whole", &ModelConfig::qk_norm_whole)
      .def_readwrite("num_experts", &ModelConfig::num_experts)
      .def_readwrite("num_experts_per_tok", &ModelConfig::num_experts_per_tok)
      .def_readwrite("moe_intermediate_size", &ModelConfig::moe_intermediate_size)
      .def_readwrite("norm_topk_prob", &ModelConfig::norm_topk_prob)
      .def_readwrite("shared_expert_intermediate_size", &ModelConfig::shared_expert_intermediate_size)
      .def_readwrite("layer_moe", &ModelConfig::layer_moe)
      .def_readwrite("layer_recurrent", &ModelConfig::layer_recurrent)
      .def_readwrite("linear_num_key_heads", &ModelConfig::linear_num_key_heads)
      .def_readwrite("linear_num_value_heads", &ModelConfig::linear_num_value_heads)
      .def_readwrite("linear_key_head_dim", &ModelConfig::linear_key_head_dim)
      .def_readwrite("linear_value_head_dim", &ModelConfig::linear_value_head_dim)
      .def_readwrite("linear_conv_kernel", &ModelConfig::linear_conv_kernel)
      .def_readwrite("linear_value_heads_tiled", &ModelConfig::linear_value_heads_tiled)
      .def_readwrite("linear_decay_rate_stored", &ModelConfig::linear_decay_rate_stored)
      .def_readwrite("attn_output_gate", &ModelConfig::attn_output_gate)
      .def_readwrite("swiglu_alpha", &ModelConfig::swiglu_alpha)
      .def_readwrite("swiglu_limit", &ModelConfig::swiglu_limit)
      .def_readwrite("has_o_bias", &ModelConfig::has_o_bias)
      .def_readwrite("attention_sinks", &ModelConfig::attention_sinks)
      .def_readwrite("layer_head_dim", &ModelConfig::layer_head_dim)
      .def_readwrite("layer_num_kv_heads", &ModelConfig::layer_num_kv_heads)
      .def_readwrite("layer_v_from_k", &ModelConfig::layer_v_from_k)
      .def_readwrite("layer_kv_source", &ModelConfig::layer_kv_source)
      .def_readwrite("layer_intermediate_size", &ModelConfig::layer_intermediate_size)
      .def_readwrite("per_layer_input_size", &ModelConfig::per_layer_input_size)
      .def_readwrite("mtp_num_layers", &ModelConfig::mtp_num_layers)
      .def_readwrite("has_v_norm", &ModelConfig::has_v_norm)
      .def_readwrite("has_layer_scalar", &ModelConfig::has_layer_scalar)
      .def_readwrite("moe_beside_mlp", &ModelConfig::moe_beside_mlp)
      .def_readwrite("moe_biases", &ModelConfig::moe_biases)
      .def_readwrite("experts_interleaved", &ModelConfig::experts_interleaved);

  py::enum_<KVQuant>(m, "KVQuant", "A layer's KV-cache precision (core/kv_quant.h)")
      .value("none", KVQuant::kNone)
      .value("int8", KVQuant::kInt8)
      .value("int4", KVQuant::kInt4);
  py::class_<SpeculativeConfig>(m, "SpeculativeConfig", "Speculative decoding (engine/speculative.h)")
      .def(py::init<>())
      .def_readwrite("enabled", &SpeculativeConfig::enabled)
      .def_readwrite("max_draft_tokens", &SpeculativeConfig::max_draft_tokens)
      .def_readwrite("min_ngram", &SpeculativeConfig::min_ngram)
      .def_readwrite("max_ngram", &SpeculativeConfig::max_ngram)
      .def_readwrite("max_step_draft_tokens", &SpeculativeConfig::max_step_draft_tokens)
      .def_readwrite("adaptive", &SpeculativeConfig::adaptive)
      .def_readwrite("answer_store_tokens", &SpeculativeConfig::answer_store_tokens)
      .def_readwrite("mtp", &SpeculativeConfig::mtp)
      .def_readwrite("draft_model", &SpeculativeConfig::draft_model);
  py::class_<EngineConfig>(m, "EngineConfig")
      .def(py::init<>())
      .def_readwrite("device", &EngineConfig::device)
      .def_readwrite("max_batch_size", &EngineConfig::max_batch_size)
      .def_readwrite("session_len", &EngineConfig::session_len)
      .def_readwrite("block_size_tokens", &EngineConfig::block_size_tokens)
      .def_readwrite("max_prefill_token_num", &EngineConfig::max_prefill_token_num)
      .def_readwrite("decode_slowdown", &EngineConfig::decode_slowdown)
      .def_readwrite("kv_quant", &EngineConfig::kv_quant)
      .def_readwrite("int8_activations", &EngineConfig::int8_activations)
      .def_readwrite("bf16_linear", &EngineConfig::bf16_linear)
      .def_readwrite("int8_weights", &EngineConfig::int8_weights)
      .def_readwrite("bf16_kv", &EngineConfig::bf16_kv)
      .def_readwrite("cuda_graphs", &EngineConfig::cuda_graphs)
      .def_readwrite("enable_prefix_caching", &EngineConfig::enable_prefix_caching)
      .def_readwrite("num_threads", &EngineConfig::num_threads)
      .def_readwrite("engine_cpus", &EngineConfig::engine_cpus)
      .def_readwrite("callback_cpus", &EngineConfig::callback_cpus)
      .def_readwrite("speculative", &EngineConfig::speculative)
      .def_readwrite("kv_cache_dir", &EngineConfig::kv_cache_dir)
      .def_readwrite("kv_cache_disk_bytes", &EngineConfig::kv_cache_disk_bytes)
      .def_readwrite("kv_cache_read_bytes_per_step", &EngineConfig::kv_cache_read_bytes_per_step)
      .def_readwrite("kv_cache_identity", &EngineConfig::kv_cache_identity);

  py::class_<SamplingParams>(m, "SamplingParams")
      .def(py::init<>())
      .def_readwrite("temperature", &SamplingParams::temperature)
      .def_readwrite("top_k", &SamplingParams::top_k)
      .def_readwrite("top_p", &SamplingParams::top_p)
      .def_readwrite("min_p", &SamplingParams::min_p)
      .def_readwrite("repetition_penalty", &SamplingParams::repetition_penalty)
      .def_readwrite("presence_penalty", &SamplingParams::presence_penalty)
      .def_readwrite("frequency_penalty", &SamplingParams::frequency_penalty)
      .def_readwrite("logprobs", &SamplingParams::logprobs)
      .def_readwrite("prompt_logprobs", &SamplingParams::prompt_logprobs)
      .def_readwrite("n", &SamplingParams::n)
      .def_readwrite("seed", &SamplingParams::seed)
      .def_readwrite("has_seed", &SamplingParams::has_seed)
      .def_readwrite("max_new_tokens", &SamplingParams::max_new_tokens)
      .def_readwrite("min_new_tokens", &SamplingParams::min_new_tokens)
      .def_readwrite("stop_token_ids", &SamplingParams::stop_token_ids)
      .def_readwrite("ignore_eos", &SamplingParams::ignore_eos)
      .def_readwrite("output_logits", &SamplingParams::output_logits)
      .def_property(
          "grammar", [](const SamplingParams& p) { return std::const_pointer_cast<CompiledGrammar>(p.grammar); },
          [](SamplingParams& p, std::shared_ptr<CompiledGrammar> g) { p.grammar = std::move(g); })
      .def_readwrite("grammar_after_token", &SamplingParams::grammar_after_token)
      .def_readwrite("speculate", &SamplingParams::speculate)
      .def_readwrite("prediction", &SamplingParams::prediction)
      .def_property(
          "pooling", [](const SamplingParams& p) { return std::string(kPoolingNames[(int)p.pooling]); },
          [](SamplingParams& p, const std::string& name) {
            for (int i = 0; i < 4; ++i)
              if (name == kPoolingNames[i]) return void(p.pooling = (Pooling)i);
            throw py::value_error("pooling must be none, last, mean or first, got " + name);
          },
          "The prompt pooled into one vector (RequestOutput.embedding): none, last, mean or first.");

  py::class_<GrammarTokenizer, std::shared_ptr<GrammarTokenizer>>(
      m, "GrammarTokenizer", "One model's vocabulary for llguidance (structured output); see lmkit/structured.py.")
      .def(py::init<const std::string&, const std::string&, int32_t, const std::vector<int32_t>&>(),
           py::arg("library"), py::arg("tokenizer_json"), py::arg("vocab_size"), py::arg("eos_token_ids"),
           py::call_guard<py::gil_scoped_release>())
      .def_property_readonly("vocab_size", &GrammarTokenizer::vocab_size)
      .def_property_readonly("version", &GrammarTokenizer::version);

  py::class_<CompiledGrammar, std::shared_ptr<CompiledGrammar>>(m, "CompiledGrammar",
                                                                "A parsed grammar, ready to constrain requests.")
      .def(py::init<std::shared_ptr<const GrammarTokenizer>, const std::string&, const std::string&, double>(),
           py::arg("tokenizer"), py::arg("kind"), py::arg("text"), py::arg("timeout_s") = 0.0,
           py::call_guard<py::gil_scoped_release>())
      .def("matcher", [](std::shared_ptr<CompiledGrammar> g) { return std::make_unique<GrammarMatcher>(g, nullptr); },
           "A matcher in the start state, its masks computed on the calling thread (what the engine's sampler "
           "applies; for tests and tools).");

  py::class_<GrammarMatcher>(m, "GrammarMatcher")
      .def("consume", &GrammarMatcher::consume, py::arg("token"), py::call_guard<py::gil_scoped_release>())
      .def("mask",
           [](GrammarMatcher& g, int32_t vocab_size) {
             const uint32_t* words;
             {
               py::gil_scoped_release release;
               g.request_mask();
               words = g.wait();
             }
             py::array_t<bool> allowed(vocab_size);
             bool* out = allowed.mutable_data();
             for (int32_t i = 0; i < vocab_size; ++i) out[i] = (words[i >> 5] >> (i & 31)) & 1u;
             return allowed;
           },
           py::arg("vocab_size"), "The tokens allowed next: bool[vocab_size].")
      .def("is_accepting", &GrammarMatcher::is_accepting)
      .def("is_stopped", &GrammarMatcher::is_stopped)
      .def_property_readonly("error", &GrammarMatcher::error);

  py::class_<RequestOutput>(m, "RequestOutput")
      .def_readonly("request_id", &RequestOutput::request_id)
      .def_readonly("sample_index", &RequestOutput::sample_index)
      .def_readonly("emitted_at", &RequestOutput::emitted_at)
      .def_readonly("scheduled_at", &RequestOutput::scheduled_at)
      .def_readonly("logprobs", &RequestOutput::logprobs)
      .def_readonly("num_top", &RequestOutput::num_top)
      .def_readonly("top_ids", &RequestOutput::top_ids)
      .def_readonly("top_logprobs", &RequestOutput::top_logprobs)
      .def_readonly("prompt_logprobs", &RequestOutput::prompt_logprobs)
      .def_readonly("prompt_top_ids", &RequestOutput::prompt_top_ids)
      .def_readonly("prompt_top_logprobs", &RequestOutput::prompt_top_logprobs)
      .def_readonly("first_prompt_logprob_token", &RequestOutput::first_prompt_logprob_token)
      .def_readonly("num_prompt_top", &RequestOutput::num_prompt_top)
      .def_readonly("token_ids", &RequestOutput::token_ids)
      .def_readonly("finished", &RequestOutput::finished)
      .def_property_readonly("finish_reason",
                             [](const RequestOutput& o) { return std::string(finish_reason_name(o.finish_reason)); })
      .def_readonly("error", &RequestOutput::error)
      .def_property_readonly("error_kind", [](const RequestOutput& o) { return error_kind_name(o.error_kind); })
      .def_readonly("num_prompt_tokens", &RequestOutput::num_prompt_tokens)
      .def_property_readonly("embedding", [](const RequestOutput& o) -> py::object {
        if (o.embedding.empty()) return py::none();
        py::array_t<float> a((py::ssize_t)o.embedding.size());
        std::memcpy(a.mutable_data(), o.embedding.data(), o.embedding.size() * sizeof(float));
        return a;
      })
      .def_property_readonly("logits", [](const RequestOutput& o) -> py::object {
        if (o.num_logit_rows == 0) return py::none();
        const py::ssize_t rows = o.num_logit_rows, vocab = (py::ssize_t)(o.logits.size() / o.num_logit_rows);
        py::array_t<float> a({rows, vocab});
        std::memcpy(a.mutable_data(), o.logits.data(), o.logits.size() * sizeof(float));
        return a;
      });

  py::class_<EngineMetrics>(m, "EngineMetrics")
      .def_readonly("num_running", &EngineMetrics::num_running)
      .def_readonly("num_waiting", &EngineMetrics::num_waiting)
      .def_readonly("num_total_blocks", &EngineMetrics::num_total_blocks)
      .def_readonly("num_free_blocks", &EngineMetrics::num_free_blocks)
      .def_readonly("num_active_blocks", &EngineMetrics::num_active_blocks)
      .def_readonly("num_cached_blocks", &EngineMetrics::num_cached_blocks)
      .def_readonly("num_total_state_slots", &EngineMetrics::num_total_state_slots)
      .def_readonly("num_free_state_slots", &EngineMetrics::num_free_state_slots)
      .def_readonly("num_state_snapshots", &EngineMetrics::num_state_snapshots)
      .def_readonly("num_prefix_query_tokens", &EngineMetrics::num_prefix_query_tokens)
      .def_readonly("num_prefix_hit_tokens", &EngineMetrics::num_prefix_hit_tokens)
      .def_readonly("num_steps", &EngineMetrics::num_steps)
      .def_readonly("num_prompt_tokens", &EngineMetrics::num_prompt_tokens)
      .def_readonly("num_generated_tokens", &EngineMetrics::num_generated_tokens)
      .def_readonly("num_preemptions", &EngineMetrics::num_preemptions)
      .def_readonly("num_window_freed_blocks", &EngineMetrics::num_window_freed_blocks)
      .def_readonly("num_weight_bytes_read", &EngineMetrics::num_weight_bytes_read)
      .def_readonly("num_finished_requests", &EngineMetrics::num_finished_requests)
      .def_readonly("has_kv_store", &EngineMetrics::has_kv_store)
      .def_readonly("num_store_lookups", &EngineMetrics::num_store_lookups)
      .def_readonly("num_store_missed_lookups", &EngineMetrics::num_store_missed_lookups)
      .def_readonly("num_store_hit_tokens", &EngineMetrics::num_store_hit_tokens)
      .def_readonly("num_store_read_blocks", &EngineMetrics::num_store_read_blocks)
      .def_readonly("num_store_read_bytes", &EngineMetrics::num_store_read_bytes)
      .def_readonly("num_store_written_blocks", &EngineMetrics::num_store_written_blocks)
      .def_readonly("num_store_written_bytes", &EngineMetrics::num_store_written_bytes)
      .def_readonly("num_store_dropped_blocks", &EngineMetrics::num_store_dropped_blocks)
      .def_readonly("num_store_ignored_files", &EngineMetrics::num_store_ignored_files)
      .def_readonly("num_store_write_errors", &EngineMetrics::num_store_write_errors)
      .def_readonly("num_store_evicted_files", &EngineMetrics::num_store_evicted_files)
      .def_readonly("num_store_bytes", &EngineMetrics::num_store_bytes)
      .def_property_readonly("num_draft_tokens", [](const EngineMetrics& m) {
        return std::vector<int64_t>(m.num_draft_tokens, m.num_draft_tokens + EngineMetrics::kDraftSources); })
      .def_property_readonly("num_accepted_draft_tokens", [](const EngineMetrics& m) {
        return std::vector<int64_t>(m.num_accepted_draft_tokens, m.num_accepted_draft_tokens + EngineMetrics::kDraftSources); })
      .def_property_readonly("num_verifications", [](const EngineMetrics& m) {
        return std::vector<int64_t>(m.num_verifications, m.num_verifications + EngineMetrics::kDraftSources); });

  py::class_<Engine, EnginePtr>(m, "Engine")
      .def(py::init([](const EngineConfig& config, const ModelConfig& model, const py::dict& sources,
                       const std::vector<int32_t>& eos_token_ids, const py::object& size_pools,
                       const py::object& draft_model, const py::object& draft_sources) {
             // sources: role -> (path, offset, dtype, shape)
             auto to_sources = [](const py::dict& sources) {
               std::map<std::string, TensorSource> srcs;
               for (auto item : sources) {
                 auto t = item.second.cast<py::tuple>();
                 TensorSource s;
                 s.path = t[0].cast<std::string>();
                 s.offset = t[1].cast<int64_t>();
                 s.dtype = parse_dtype(t[2].cast<std::string>());
                 s.shape = t[3].cast<std::vector<int64_t>>();
                 srcs[item.first.cast<std::string>()] = std::move(s);
               }
               return srcs;
             };
             const std::map<std::string, TensorSource> srcs = to_sources(sources);
             // speculative='draft': the draft model's config and sources, both or neither
             std::unique_ptr<DraftSpec> draft;
             if (!draft_model.is_none() || !draft_sources.is_none()) {
               if (draft_model.is_none() || draft_sources.is_none())
                 throw py::value_error("draft_model and draft_sources go together");
               draft = std::make_unique<DraftSpec>(
                   DraftSpec{draft_model.cast<ModelConfig>(), to_sources(draft_sources.cast<py::dict>())});
             }
             // size_pools(kv_bytes_per_block, state_bytes_per_slot, linear_weight_bytes, session_len,
             // device_free_bytes) -> (blocks, state slots, draft checkpoint slots, disk-store queue blocks)
             // (loader.h's PoolSizer), called once on this thread after the weights are packed; what it raises
             // propagates. A borrowed handle: the argument outlives create_engine, and nothing here touches its
             // reference count without the GIL.
             const PoolSizer sizer = [fn = py::handle(size_pools)](int64_t bytes_per_block, int64_t state_bytes,
                                                                   int64_t weight_bytes, int32_t session_len,
                                                                   int64_t free_bytes) {
               py::gil_scoped_acquire gil;
               const auto sizes = fn(bytes_per_block, state_bytes, weight_bytes, session_len, free_bytes)
                                      .cast<std::tuple<int32_t, int32_t, int32_t, int32_t>>();
               return PoolSizes{std::get<0>(sizes), std::get<1>(sizes), std::get<2>(sizes), std::get<3>(sizes)};
             };
             py::gil_scoped_release release;
             EnginePtr engine(create_engine(config, model, srcs, eos_token_ids, sizer, draft.get()).release());
             engine->set_delivery_scope([](const std::function<void()>& deliver) {
               py::gil_scoped_acquire gil;  // once per batch; the per-call acquires inside nest cheaply
               deliver();
             });
             return engine;
           }),
           py::arg("config"), py::arg("model"), py::arg("sources"), py::arg("eos_token_ids"),
           py::arg("size_pools"), py::arg("draft_model") = py::none(), py::arg("draft_sources") = py::none())
      .def("submit", &Engine::submit, py::arg("request_id"), py::arg("prompt"), py::arg("params"),
           py::arg("callback"), py::call_guard<py::gil_scoped_release>(),
           "Queues a request; callback(RequestOutput) runs on the engine's callback thread.")
      .def("cancel", &Engine::cancel, py::arg("request_id"), py::arg("sample_index") = -1,
           py::call_guard<py::gil_scoped_release>())
      .def("metrics", &Engine::metrics, py::call_guard<py::gil_scoped_release>())
      .def("check_integrity", &Engine::check_integrity, py::call_guard<py::gil_scoped_release>())
      .def("flush_kv_store", &Engine::flush_kv_store, py::call_guard<py::gil_scoped_release>(),
           "Writes the pool's cached blocks not yet in the disk store and waits for the writer (no-op without one).")
      .def("shutdown", &Engine::shutdown, py::call_guard<py::gil_scoped_release>())
      .def_property_readonly("num_total_blocks", [](const Engine& e) { return e.options().num_blocks; })
      .def_property_readonly("kv_bytes_per_block", [](const Engine& e) { return e.options().kv_bytes_per_block; })
      .def_property_readonly("linear_weight_bytes", [](const Engine& e) { return e.options().linear_weight_bytes; })
      .def_property_readonly("mtp_num_layers", [](const Engine& e) { return e.options().mtp_num_layers; })
      .def_property_readonly("mtp_weight_bytes", [](const Engine& e) { return e.options().mtp_weight_bytes; })
      .def_property_readonly("session_len", [](const Engine& e) { return e.options().session_len; })
      .def_property_readonly("block_size_tokens", [](const Engine& e) { return e.options().block_size_tokens; });
}
