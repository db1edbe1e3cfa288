// Python bindings of the ContinuousBatchingEngine, its config, Scheduler (read-only), outputs and
// stats.
#include <torch/csrc/utils/pybind.h>
#include <pybind11/stl.h>

#include "bindings/bindings.h"
#include "kvserve/continuous_batching_engine.h"

namespace py = pybind11;

namespace kvserve::bindings {
namespace {

py::object none_if_empty(const std::string& s) {
  if (s.empty()) return py::none();
  return py::str(s);
}

void bind_outputs(py::module_& m) {
  py::class_<RequestMetrics>(m, "RequestMetrics",
                             "Times of one request (seconds, time.monotonic() clock; 0 until the "
                             "moment happens).")
      .def_readonly("arrival_time", &RequestMetrics::arrival_time)
      .def_readonly("first_scheduled_time", &RequestMetrics::first_scheduled_time)
      .def_readonly("first_token_time", &RequestMetrics::first_token_time)
      .def_readonly("last_token_time", &RequestMetrics::last_token_time)
      .def_readonly("finished_time", &RequestMetrics::finished_time)
      .def_readonly("num_generated_tokens", &RequestMetrics::num_generated_tokens)
      .def_readonly("num_drafts", &RequestMetrics::num_drafts)
      .def_readonly("num_draft_tokens", &RequestMetrics::num_draft_tokens)
      .def_readonly("num_accepted_tokens", &RequestMetrics::num_accepted_tokens)
      .def_property_readonly("mean_acceptance_length", [](const RequestMetrics& r) {
        return r.num_drafts ? 1.0 + static_cast<double>(r.num_accepted_tokens) /
                                        static_cast<double>(r.num_drafts)
                            : 0.0;
      })
      .def_property_readonly("time_to_first_token", &RequestMetrics::time_to_first_token)
      .def_property_readonly("queue_time", &RequestMetrics::queue_time)
      .def_property_readonly("e2e_latency", &RequestMetrics::e2e_latency)
      .def_property_readonly("time_per_output_token", &RequestMetrics::time_per_output_token)
      .def("__repr__", [](const RequestMetrics& r) {
        return "RequestMetrics(ttft=" + std::to_string(r.time_to_first_token()) +
               ", tpot=" + std::to_string(r.time_per_output_token()) +
               ", e2e=" + std::to_string(r.e2e_latency()) +
               ", num_generated_tokens=" + std::to_string(r.num_generated_tokens) + ")";
      });

  py::class_<CompletionOutput>(m, "CompletionOutput",
                               "One sample's token ids (kvserve.CompletionOutput adds its text).")
      .def_readonly("index", &CompletionOutput::index)
      .def_readonly("token_ids", &CompletionOutput::token_ids)
      .def_readonly("new_token_ids", &CompletionOutput::new_token_ids)
      .def_property_readonly("finish_reason", [](const CompletionOutput& o) {
        return none_if_empty(o.finish_reason);
      })
      .def_readonly("logprobs", &CompletionOutput::logprobs)
      .def_readonly("new_logprobs", &CompletionOutput::new_logprobs)
      .def_property_readonly("finished", &CompletionOutput::finished);

  py::class_<RequestOutput>(m, "RequestOutput",
                            "What one request produced in a step, in token ids "
                            "(kvserve.RequestOutput adds the text).")
      .def_readonly("request_id", &RequestOutput::request_id)
      .def_readonly("prompt_token_ids", &RequestOutput::prompt_token_ids)
      .def_readonly("outputs", &RequestOutput::outputs)
      .def_readonly("finished", &RequestOutput::finished)
      .def_readonly("num_cached_tokens", &RequestOutput::num_cached_tokens)
      .def_readonly("prompt_logprobs", &RequestOutput::prompt_logprobs)
      .def_readonly("metrics", &RequestOutput::metrics)
      .def_property_readonly("error", [](const RequestOutput& o) { return none_if_empty(o.error); })
      .def("__repr__", [](const RequestOutput& o) {
        return "RequestOutput(request_id='" + o.request_id + "', finished=" +
               (o.finished ? "True" : "False") + ", outputs=" +
               std::to_string(o.outputs.size()) + ")";
      });

  py::class_<LatencyHistogram>(m, "LatencyHistogram",
                               "Counts per fixed bucket: counts[i] holds observations <= "
                               "bounds[i] (and above the previous bound); the last is +inf.")
      .def_property_readonly_static("bounds", [](py::object) {
        return std::vector<double>(LatencyHistogram::kBounds.begin(),
                                   LatencyHistogram::kBounds.end());
      })
      .def_property_readonly("counts", [](const LatencyHistogram& h) {
        return std::vector<int64_t>(h.counts.begin(), h.counts.end());
      })
      .def_readonly("count", &LatencyHistogram::count)
      .def_readonly("sum", &LatencyHistogram::sum);

  py::class_<EngineStats>(m, "EngineStats")
      .def_readonly("num_running_requests", &EngineStats::num_running_requests)
      .def_readonly("num_waiting_requests", &EngineStats::num_waiting_requests)
      .def_readonly("num_running_sequences", &EngineStats::num_running_sequences)
      .def_readonly("kv_cache_usage", &EngineStats::kv_cache_usage)
      .def_readonly("prefix_cache_queries", &EngineStats::prefix_cache_queries)
      .def_readonly("prefix_cache_hits", &EngineStats::prefix_cache_hits)
      .def_property_readonly("prefix_cache_hit_rate", [](const EngineStats& s) {
        return s.prefix_cache_queries ? static_cast<double>(s.prefix_cache_hits) /
                                            static_cast<double>(s.prefix_cache_queries)
                                      : 0.0;
      })
      .def_readonly("num_preemptions", &EngineStats::num_preemptions)
      .def_readonly("num_finished_requests", &EngineStats::num_finished_requests)
      .def_readonly("num_aborted_requests", &EngineStats::num_aborted_requests)
      .def_readonly("num_failed_requests", &EngineStats::num_failed_requests)
      .def_readonly("num_steps", &EngineStats::num_steps)
      .def_readonly("num_cuda_graph_steps", &EngineStats::num_cuda_graph_steps)
      .def_readonly("num_async_steps", &EngineStats::num_async_steps)
      .def_readonly("num_generated_tokens", &EngineStats::num_generated_tokens)
      .def_readonly("num_computed_prompt_tokens", &EngineStats::num_computed_prompt_tokens)
      .def_readonly("num_loaded_prompt_tokens", &EngineStats::num_loaded_prompt_tokens)
      .def_readonly("num_loading_requests", &EngineStats::num_loading_requests)
      .def_readonly("num_held_requests", &EngineStats::num_held_requests)
      .def_readonly("time_to_first_token", &EngineStats::time_to_first_token)
      .def_readonly("time_per_output_token", &EngineStats::time_per_output_token)
      .def_readonly("e2e_latency", &EngineStats::e2e_latency)
      .def_readonly("num_drafts", &EngineStats::num_drafts)
      .def_readonly("num_draft_tokens", &EngineStats::num_draft_tokens)
      .def_readonly("num_accepted_tokens", &EngineStats::num_accepted_tokens)
      .def_readonly("accepted_per_position", &EngineStats::accepted_per_position)
      .def_property_readonly("acceptance_rate", [](const EngineStats& s) {
        return s.num_draft_tokens ? static_cast<double>(s.num_accepted_tokens) /
                                        static_cast<double>(s.num_draft_tokens)
                                  : 0.0;
      })
      .def_property_readonly("mean_acceptance_length", [](const EngineStats& s) {
        return s.num_drafts ? 1.0 + static_cast<double>(s.num_accepted_tokens) /
                                        static_cast<double>(s.num_drafts)
                            : 0.0;
      })
      .def_property_readonly("acceptance_rate_per_position", [](const EngineStats& s) {
        std::vector<double> rates;
        for (int64_t n : s.accepted_per_position) {
          rates.push_back(s.num_drafts ? static_cast<double>(n) / static_cast<double>(s.num_drafts)
                                       : 0.0);
        }
        return rates;
      })
      .def_readonly("propose_seconds", &EngineStats::propose_seconds)
      .def_readonly("verify_seconds", &EngineStats::verify_seconds)
      .def("__repr__", [](const EngineStats& s) {
        auto mean_ms = [](const LatencyHistogram& h) {
          return h.count ? std::to_string(h.sum / static_cast<double>(h.count) * 1e3) : "-";
        };
        return "EngineStats(running=" + std::to_string(s.num_running_requests) +
               ", waiting=" + std::to_string(s.num_waiting_requests) +
               ", kv_cache_usage=" + std::to_string(s.kv_cache_usage) +
               ", finished=" + std::to_string(s.num_finished_requests) +
               ", aborted=" + std::to_string(s.num_aborted_requests) +
               ", failed=" + std::to_string(s.num_failed_requests) +
               ", preemptions=" + std::to_string(s.num_preemptions) +
               ", mean_ttft_ms=" + mean_ms(s.time_to_first_token) +
               ", mean_tpot_ms=" + mean_ms(s.time_per_output_token) + ")";
      });
}

}  // namespace

void bind_continuous_batching_engine(py::module_& m) {
  bind_outputs(m);

  m.def(
      "speculative_methods",
      [] {
        std::vector<std::pair<std::string, bool>> methods;
        for (const ProposerEntry& e : proposer_registry()) {
          methods.emplace_back(e.method, e.needs_draft_model);
        }
        return methods;
      },
      "[(method, drafts with a second model)] of the proposer registry, in its order.");
  py::class_<SpeculativeConfig>(m, "SpeculativeConfig",
                                "How the engine speculates: method \"draft_model\" or \"ngram\" "
                                "(\"\": off).")
      .def(py::init([](std::string method, int64_t num_speculative_tokens,
                       int64_t prompt_lookup_min, int64_t prompt_lookup_max,
                       int64_t disable_batch_size, int64_t max_verify_tokens) {
             SpeculativeConfig c{std::move(method), num_speculative_tokens, prompt_lookup_min,
                                 prompt_lookup_max, disable_batch_size, max_verify_tokens};
             c.validate();
             return c;
           }),
           py::kw_only(), py::arg("method") = "", py::arg("num_speculative_tokens") = 0,
           py::arg("prompt_lookup_min") = 1, py::arg("prompt_lookup_max") = 4,
           py::arg("disable_batch_size") = 0, py::arg("max_verify_tokens") = 0)
      .def_readonly("method", &SpeculativeConfig::method)
      .def_readonly("num_speculative_tokens", &SpeculativeConfig::num_speculative_tokens)
      .def_readonly("prompt_lookup_min", &SpeculativeConfig::prompt_lookup_min)
      .def_readonly("prompt_lookup_max", &SpeculativeConfig::prompt_lookup_max)
      .def_readonly("disable_batch_size", &SpeculativeConfig::disable_batch_size)
      .def_readonly("max_verify_tokens", &SpeculativeConfig::max_verify_tokens)
      .def_property_readonly("enabled", &SpeculativeConfig::enabled);

  const EngineConfig defaults;
  py::class_<EngineConfig>(m, "EngineConfig",
                           "An engine's limits and KV pool (kvserve.EngineArgs fills it).")
      .def(py::init([](int64_t max_num_seqs, int64_t max_num_batched_tokens,
                       int64_t max_model_len, int64_t block_size, int64_t num_blocks,
                       int64_t kv_cache_memory, bool enable_prefix_caching,
                       std::vector<int64_t> eos_token_ids, int64_t max_logprobs,
                       SpeculativeConfig speculative,
                       std::optional<at::ScalarType> kv_cache_dtype,
                       int64_t cuda_graph_max_batch, int64_t max_stop_strings,
                       int64_t max_stop_string_length, int64_t max_waiting_requests,
                       std::optional<at::ScalarType> ssm_state_dtype,
                       int64_t num_state_snapshots, bool async_scheduling) {
             EngineConfig c;
             c.async_scheduling = async_scheduling;
             c.ssm_state_dtype = ssm_state_dtype;
             c.num_state_snapshots = num_state_snapshots;
             c.max_num_seqs = max_num_seqs;
             c.max_num_batched_tokens = max_num_batched_tokens;
             c.max_model_len = max_model_len;
             c.block_size = block_size;
             c.num_blocks = num_blocks;
             c.kv_cache_memory = kv_cache_memory;
             c.kv_cache_dtype = kv_cache_dtype;
             c.enable_prefix_caching = enable_prefix_caching;
             c.eos_token_ids = std::move(eos_token_ids);
             c.max_logprobs = max_logprobs;
             c.speculative = std::move(speculative);
             c.cuda_graph_max_batch = cuda_graph_max_batch;
             c.max_stop_strings = max_stop_strings;
             c.max_stop_string_length = max_stop_string_length;
             c.max_waiting_requests = max_waiting_requests;
             return c;
           }),
           py::kw_only(), py::arg("max_num_seqs") = defaults.max_num_seqs,
           py::arg("max_num_batched_tokens") = defaults.max_num_batched_tokens,
           py::arg("max_model_len") = defaults.max_model_len,
           py::arg("block_size") = defaults.block_size,
           py::arg("num_blocks") = defaults.num_blocks,
           py::arg("kv_cache_memory") = defaults.kv_cache_memory,
           py::arg("enable_prefix_caching") = defaults.enable_prefix_caching,
           py::arg("eos_token_ids") = std::vector<int64_t>{},
           py::arg("max_logprobs") = defaults.max_logprobs,
           py::arg("speculative") = SpeculativeConfig{}, py::arg("kv_cache_dtype") = py::none(),
           py::arg("cuda_graph_max_batch") = defaults.cuda_graph_max_batch,
           py::arg("max_stop_strings") = defaults.max_stop_strings,
           py::arg("max_stop_string_length") = defaults.max_stop_string_length,
           py::arg("max_waiting_requests") = defaults.max_waiting_requests,
           py::arg("ssm_state_dtype") = py::none(),
           py::arg("num_state_snapshots") = defaults.num_state_snapshots,
           py::arg("async_scheduling") = defaults.async_scheduling)
      .def_readonly("async_scheduling", &EngineConfig::async_scheduling)
      .def_readonly("ssm_state_dtype", &EngineConfig::ssm_state_dtype)
      .def_readonly("num_state_snapshots", &EngineConfig::num_state_snapshots)
      .def_readonly("kv_cache_memory", &EngineConfig::kv_cache_memory)
      .def_readonly("max_num_seqs", &EngineConfig::max_num_seqs)
      .def_readonly("max_num_batched_tokens", &EngineConfig::max_num_batched_tokens)
      .def_readonly("max_model_len", &EngineConfig::max_model_len)
      .def_readonly("block_size", &EngineConfig::block_size)
      .def_readonly("num_blocks", &EngineConfig::num_blocks)
      .def_readonly("kv_cache_dtype", &EngineConfig::kv_cache_dtype)
      .def_readonly("enable_prefix_caching", &EngineConfig::enable_prefix_caching)
      .def_readonly("eos_token_ids", &EngineConfig::eos_token_ids)
      .def_readonly("max_logprobs", &EngineConfig::max_logprobs)
      .def_readonly("speculative", &EngineConfig::speculative)
      .def_readonly("cuda_graph_max_batch", &EngineConfig::cuda_graph_max_batch)
      .def_readonly("max_stop_strings", &EngineConfig::max_stop_strings)
      .def_readonly("max_stop_string_length", &EngineConfig::max_stop_string_length)
      .def_readonly("max_waiting_requests", &EngineConfig::max_waiting_requests);

  m.def("resolve_engine_config", &resolve_engine_config, py::arg("config"), py::arg("model"),
        py::arg("dtype"), py::arg("draft") = nullptr,
        "The config checked against the model (its ModelConfig and dtype) and an optional draft "
        "model's config, with max_model_len and num_blocks derived where 0; ValueError names "
        "the first bad option.");
  m.attr("DEFAULT_KV_CACHE_MEMORY") = kDefaultKVCacheMemory;
  m.attr("LORA_PENDING") = Scheduler::kLoraPending;

  py::register_exception<EngineOverloaded>(m, "EngineOverloadedError", PyExc_RuntimeError);

  py::class_<Scheduler>(m, "Scheduler", "The engine's scheduler (read-only from Python).")
      .def_property_readonly("has_pending_work", &Scheduler::has_pending_work)
      .def_property_readonly("num_running", &Scheduler::num_running)
      .def_property_readonly("num_waiting", &Scheduler::num_waiting)
      .def_property_readonly("num_preemptions", &Scheduler::num_preemptions)
      .def_property_readonly("num_loading", &Scheduler::num_loading)
      .def_property_readonly("num_held", &Scheduler::num_held)
      .def("check_invariants", &Scheduler::check_invariants);

  py::enum_<KVTransfer>(m, "KVTransfer", "A request's part in a KV transfer.")
      .value("NONE", KVTransfer::kNone)
      .value("HOLD", KVTransfer::kHold)
      .value("LOAD", KVTransfer::kLoad);
  py::class_<KVLoad>(m, "KVLoad", "A request whose blocks wait for its prompt's KV.")
      .def_readonly("load_id", &KVLoad::load_id)
      .def_readonly("request_id", &KVLoad::request_id)
      .def_readonly("num_prompt_tokens", &KVLoad::num_prompt_tokens)
      .def_readonly("num_cached_tokens", &KVLoad::num_cached_tokens)
      .def_readonly("block_tables", &KVLoad::block_tables)
      .def_readonly("state_slot", &KVLoad::state_slot);
  py::class_<HeldKV>(m, "HeldKV", "The blocks a finished producer request holds.")
      .def_readonly("block_tables", &HeldKV::block_tables)
      .def_readonly("num_tokens", &HeldKV::num_tokens)
      .def_readonly("state_slot", &HeldKV::state_slot);

  py::class_<ContinuousBatchingEngine>(
      m, "ContinuousBatchingEngine",
      "Iteration-level batching over a model and a paged KV cache; drive it with step().")
      .def(py::init<std::shared_ptr<CausalLM>, EngineConfig, std::shared_ptr<CausalLM>,
                    std::shared_ptr<Communicator>>(),
           py::arg("model"), py::arg("config"), py::arg("draft_model") = nullptr,
           py::arg("workers") = nullptr,
           "workers: tensor parallelism's control group (kvserve.distributed), this engine "
           "being rank 0's; the other ranks run TensorParallelWorker.serve().")
      // The GIL is released wherever a call may wait for the step lock or run the model, so
      // that other Python threads keep running (and a step never waits on the GIL).
      .def("add_request", &ContinuousBatchingEngine::add_request, py::arg("request_id"),
           py::arg("prompt_token_ids"), py::arg("sampling_params"),
           py::arg("arrival_time") = py::none(), py::arg("priority") = 0,
           py::arg("lora_slot") = -1, py::arg("lora_key") = 0,
           py::arg("kv_transfer") = KVTransfer::kNone, py::call_guard<py::gil_scoped_release>(),
           "Thread-safe: validates now, applied before the next step's work.")
      .def("take_kv_loads", &ContinuousBatchingEngine::take_kv_loads,
           "The KV-loading requests admitted since the last call (thread-safe).")
      .def("finish_kv_load", &ContinuousBatchingEngine::finish_kv_load, py::arg("load_id"),
           py::arg("first_token"), py::arg("logprobs") = py::none(),
           py::call_guard<py::gil_scoped_release>())
      .def("fail_kv_load", &ContinuousBatchingEngine::fail_kv_load, py::arg("load_id"),
           py::arg("error"), py::call_guard<py::gil_scoped_release>())
      .def("held_kv", &ContinuousBatchingEngine::held_kv, py::arg("request_id"))
      .def("release_kv", &ContinuousBatchingEngine::release_kv, py::arg("request_id"),
           py::call_guard<py::gil_scoped_release>())
      .def("set_lora", &ContinuousBatchingEngine::set_lora, py::arg("slot"), py::arg("factors"),
           py::arg("worker_factors") = std::vector<LoraFactors>{},
           py::call_guard<py::gil_scoped_release>(),
           "Loads {target name: (a [r, in], b [r, out])} into a LoRA slot ({} clears it); waits "
           "for a running step. With tensor parallelism: rank 0's shard, and worker_factors[i] "
           "rank i + 1's, sent to the workers.")
      .def("step", &ContinuousBatchingEngine::step, py::arg("finished_only") = false,
           py::call_guard<py::gil_scoped_release>(),
           "One iteration; the requests that produced tokens or finished in it (finished_only: "
           "only those that finished, and those with stop strings).")
      .def("has_unfinished_requests", &ContinuousBatchingEngine::has_unfinished_requests)
      .def("abort_request", &ContinuousBatchingEngine::abort_request, py::arg("request_id"),
           py::call_guard<py::gil_scoped_release>())
      .def("assign_lora", &ContinuousBatchingEngine::assign_lora, py::arg("request_id"),
           py::arg("lora_slot"), py::arg("lora_key"), py::call_guard<py::gil_scoped_release>(),
           "The adapter slot and key of a request added with lora_slot=LORA_PENDING; False "
           "when it is no longer unfinished.")
      .def("finish_completion", &ContinuousBatchingEngine::finish_completion,
           py::arg("request_id"), py::arg("index"), py::arg("reason"),
           py::call_guard<py::gil_scoped_release>())
      .def("inject_step_failures", &ContinuousBatchingEngine::inject_step_failures,
           py::arg("count"), "Fault injection: the next `count` forward steps fail.")
      .def("get_stats", &ContinuousBatchingEngine::get_stats)
      .def_property_readonly("scheduler", &ContinuousBatchingEngine::scheduler,
                             py::return_value_policy::reference_internal)
      .def_property_readonly("block_manager", &ContinuousBatchingEngine::block_manager,
                             py::return_value_policy::reference_internal)
      .def_property_readonly("kv_cache", &ContinuousBatchingEngine::kv_cache,
                             py::return_value_policy::reference_internal)
      .def_property_readonly("config", &ContinuousBatchingEngine::config,
                             py::return_value_policy::reference_internal);
}

}  // namespace kvserve::bindings
