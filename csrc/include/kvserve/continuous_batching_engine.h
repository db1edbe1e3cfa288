#pragma once
// The serving engine: requests join and leave at every step. A step is three calls:
// Scheduler::schedule() picks how many tokens each request advances under the token budget,
// ModelRunner::execute() runs one forward over that flattened mix and samples, and
// update_from_output() appends the tokens, applies stop conditions, frees what finished and
// reports what every request produced.
//
// Threads: one owner thread calls step() (and finish_completion()); any thread may call
// add_request(), abort_request(), has_unfinished_requests() and get_stats() at any time. Those
// validate at once and queue their change, which the next step applies first (or at once, when no
// step is running). Two step() calls at once serialize.

#include <atomic>
#include <cstdint>
#include <deque>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <unordered_map>
#include <unordered_set>
#include <vector>

#include "kvserve/causal_lm.h"
#include "kvserve/engine_config.h"
#include "kvserve/engine_stats.h"
#include "kvserve/kv_transfer.h"
#include "kvserve/model_runner.h"
#include "kvserve/paged_block_manager.h"
#include "kvserve/request_output.h"
#include "kvserve/sampler.h"
#include "kvserve/sampling_params.h"
#include "kvserve/scheduler.h"
#include "kvserve/sequence_state.h"
#include "kvserve/speculative_decoder.h"

namespace kvserve {

class ContinuousBatchingEngine {
 public:
  /// Allocates the paged KV cache (config.num_blocks blocks) for `model`, and with
  /// config.speculative.method "draft_model" one of as many blocks for `draft_model` (same
  /// vocabulary). Throws std::invalid_argument on a bad config or draft model.
  /// workers: with tensor parallelism, the control group of the model's ranks; this engine is
  /// rank 0's and each step's forward also runs on the others (TensorParallelWorker, the same
  /// config.num_blocks); the draft model, if any, runs on rank 0 alone.
  ContinuousBatchingEngine(std::shared_ptr<CausalLM> model, EngineConfig config,
                           std::shared_ptr<CausalLM> draft_model = nullptr,
                           std::shared_ptr<Communicator> workers = nullptr);

  /// Queues a request (thread-safe). Throws std::invalid_argument, changing nothing, for an empty
  /// or duplicate id (of an unfinished request), an empty prompt, a token id outside the
  /// vocabulary, invalid params (n, logprobs beyond max_logprobs or the vocabulary), an
  /// arrival_time that is not finite or lies in the future, or a request that could never fit:
  /// prompt + max_tokens beyond max_model_len, or its n samples at full length beyond the pool,
  /// more stop strings than config.max_stop_strings, a stop token id outside the vocabulary or
  /// more of them than it has entries, or a stop string longer
  /// than config.max_stop_string_length characters. Throws EngineOverloaded when
  /// config.max_waiting_requests requests already wait (the request itself is valid).
  /// lora_slot: the LoRA adapter its tokens run with (a slot of set_lora; -1: the base model);
  /// lora_key: salts its prefix-cache hashes, so that requests share cached blocks only with
  /// requests of the same adapter (0: the base model's; one key per adapter ever loaded, not per
  /// slot, since a slot is reused). A slot outside [-1, num_lora_slots) is invalid, but for
  /// Scheduler::kLoraPending: an adapter that waits for a free slot; the request waits (as
  /// waiting requests do, counted among them) until assign_lora names its slot, and those behind
  /// it run meanwhile.
  /// kv_transfer: kHold or kLoad (see KVTransfer) need n = 1; kLoad also no prompt_logprobs and
  /// no draft model (whose KV the transfer does not bring).
  void add_request(const std::string& request_id, const std::vector<int64_t>& prompt_token_ids,
                   const SamplingParams& params, std::optional<double> arrival_time = std::nullopt,
                   int64_t priority = 0, int32_t lora_slot = -1, uint64_t lora_key = 0,
                   KVTransfer kv_transfer = KVTransfer::kNone);

  /// The kLoad requests admitted since the last call, their blocks allocated (thread-safe).
  /// Each must be answered with finish_kv_load or fail_kv_load: until then its blocks stay
  /// allocated, even when the request is aborted meanwhile.
  std::vector<KVLoad> take_kv_loads();
  /// A load's KV is written (thread-safe; applied before the next step's work): its request
  /// continues from `first_token`, the token the producer sampled from the prompt's last
  /// logits (with its logprobs when the request asks), and decodes from the next step. A
  /// token outside the vocabulary ends the request with an error. Ignored for a load whose
  /// request has ended (its blocks are freed).
  void finish_kv_load(int64_t load_id, int64_t first_token,
                      std::optional<TokenLogprobs> logprobs = std::nullopt);
  /// A load failed (thread-safe): its request ends with finish_reason "error" and `error`, and
  /// its blocks are freed.
  void fail_kv_load(int64_t load_id, const std::string& error);
  /// The blocks a finished kHold request holds, or nullopt (thread-safe).
  std::optional<HeldKV> held_kv(const std::string& request_id) const;
  /// Frees a held request's blocks (thread-safe; at once when no step runs, else before the
  /// next step's work). False when nothing is held under that id.
  bool release_kv(const std::string& request_id);

  /// The slot and prefix-cache key of a request added with Scheduler::kLoraPending, now that its
  /// adapter is loaded (thread-safe; applied before the next step's work). False when no such
  /// request is unfinished. Throws std::invalid_argument for a slot outside [0, num_lora_slots).
  bool assign_lora(const std::string& request_id, int32_t lora_slot, uint64_t lora_key);

  /// Loads one LoRA adapter's factors into `slot` of the model (CausalLM::set_lora), or clears
  /// the slot when `factors` is empty; waits for a running step to end. The caller must not
  /// load into a slot that unfinished requests use. With tensor parallelism, `factors` are
  /// rank 0's shard and worker_factors[i] rank i + 1's, sent to the workers before the next
  /// step. Throws std::invalid_argument when the model serves no adapters, the slot is out of
  /// range or worker_factors does not name every worker (and only them).
  void set_lora(int64_t slot, const LoraFactors& factors,
                const std::vector<LoraFactors>& worker_factors = {});

  /// Stops a request and frees its blocks (thread-safe; applied before the next step's work).
  /// Its final output, finish_reason "abort", comes from that step. False if the id is unknown or
  /// already finished.
  bool abort_request(const std::string& request_id);

  /// Runs one iteration: schedule -> execute -> update_from_output. Returns every request that
  /// produced tokens or finished in it, aborted ones included. If the forward throws, the step's
  /// requests end with finish_reason "error" (RequestOutput::error says why; reported by the
  /// next step) and the exception propagates; the engine keeps serving the others.
  /// Requests that can never be scheduled (nothing runs for two steps in a row while they wait)
  /// finish with finish_reason "error" instead of waiting forever.
  /// finished_only: report only the requests that finished, aborted ones included, and those
  /// whose SamplingParams have stop strings (their caller matches text as tokens arrive); the
  /// others' tokens come in their final output's new_token_ids (LLM.generate's steps: no
  /// per-step output to build and convert for every running request).
  std::vector<RequestOutput> step(bool finished_only = false);

  /// True while a request is queued, running, or has an output step() has not reported yet.
  bool has_unfinished_requests() const;

  /// Ends one sample of a running request with `reason` (e.g. "stop" when the caller matched a
  /// stop string in its text) and frees its blocks; the request finishes with its last sample,
  /// silently (the caller already knows). Returns the request's metrics, with finished_time set
  /// when this finished it. Owner thread only. A no-op returning the metrics for a sample that
  /// already finished, and for a request aborted since the last step (another thread's abort
  /// may land between step() and the caller's post-processing; its abort output still comes
  /// from the next step). Throws std::out_of_range for an unknown request or index.
  RequestMetrics finish_completion(const std::string& request_id, int64_t index,
                                   const std::string& reason);

  /// Fault injection (the serving chaos tests): the next `count` steps that run a forward fail
  /// as if the forward threw, through the same path (their requests end with an error, the
  /// exception propagates). Thread-safe; 0 clears it. Throws std::invalid_argument for count < 0.
  void inject_step_failures(int64_t count);

  /// Counters, gauges and latency histograms (thread-safe, O(1): nothing per request).
  EngineStats get_stats() const;

  const Scheduler& scheduler() const { return scheduler_; }
  const PagedBlockManager& block_manager() const { return block_manager_; }
  const PagedKVCache& kv_cache() const { return runner_.kv_cache(); }
  const EngineConfig& config() const { return config_; }
  CausalLM& model() { return runner_.model(); }
  /// Null without speculation.
  const SpeculativeDecoder* speculative_decoder() const { return speculator_.get(); }

 private:
  struct Completion {
    int64_t seq_id;
    CompletionOutput output;
    size_t num_reported = 0;  ///< token_ids already returned by step()
    RequestRandom random;
    bool forked = true;  ///< false from plan_samples() until update_from_output() forks it
  };
  struct Request {
    std::string id;
    std::vector<int64_t> prompt;
    SamplingParams params;
    int64_t priority = 0;
    int32_t lora_slot = -1;
    uint64_t lora_key = 0;
    RequestMetrics metrics;
    std::vector<Completion> completions;  ///< one until the prompt's first sample, then n
    int64_t num_cached_tokens = 0;        ///< prefix-cache hit when first scheduled
    /// Prompt tokens 1, 2, ... scored so far (SamplingParams::prompt_logprobs), and whether an
    /// output has carried them all.
    std::vector<TokenLogprobs> prompt_logprobs;
    bool prompt_logprobs_reported = false;
    std::string error;
    uint64_t mark = 0;  ///< the last step or count that touched it (dedup without a set)
    KVTransfer kv_transfer = KVTransfer::kNone;
  };
  struct Where {  ///< a sequence's request and completion
    Request* request;
    size_t completion;
  };
  struct Command {  ///< a queued change from another thread
    enum class Kind { kAdd, kAbort, kLoaded, kLoadFailed, kRelease, kAssignLora };
    Kind kind;
    std::unique_ptr<Request> request;  ///< kAdd
    std::string id;                    ///< kAbort, kRelease, kAssignLora: the request's
    int32_t lora_slot = -1;            ///< kAssignLora
    uint64_t lora_key = 0;             ///< kAssignLora
    int64_t load_id = -1;              ///< kLoaded, kLoadFailed
    int64_t token = -1;                ///< kLoaded: the first token
    std::optional<TokenLogprobs> logprobs;
    std::string error;  ///< kLoadFailed
  };
  /// The sampling side of one step: its targets, and the requests whose samples fork after it.
  struct StepSamples {
    std::vector<SamplingTarget> targets;
    std::vector<std::pair<Request*, Completion*>> completions;  ///< one per target
    std::vector<int64_t> seq_ids;  ///< one per target: its completion's sequence
    std::vector<Request*> forking;
    std::vector<PromptLogprobsTarget> prompt_targets;
    std::vector<Request*> prompt_requests;  ///< one per prompt target
  };

  void validate(const std::string& request_id, const std::vector<int64_t>& prompt,
                const SamplingParams& params, std::optional<double> arrival_time) const;
  /// Applies queued commands if no step runs now (called after queueing one).
  void try_apply_commands();
  void apply_commands();  ///< owner: under step_mutex_
  void admit(std::unique_ptr<Request> request);
  /// What a request's first sequence salts its prefix-cache hashes with.
  static uint64_t cache_key(const Request& request, int64_t seq_id);
  void assign_lora_now(const Command& c);
  void abort_now(const std::string& request_id);
  /// A load ended (Command kLoaded / kLoadFailed): the request decodes from its first token,
  /// or ends with the error; a request that ended meanwhile just frees its blocks.
  void end_load(Command& command);
  /// A kHold request's completion finished with `reason`: its sequence holds its blocks
  /// (stop, length) or frees them. False when it is not a kHold request.
  bool hold_blocks(Request& request, Completion& completion, const std::string& reason);
  /// The loads the step's schedule admitted, queued for take_kv_loads.
  void queue_loads(const SchedulerOutput& work);
  /// Outputs of the requests whose loads ended since the last step (their first token).
  void report_loaded(std::vector<RequestOutput>& outputs);
  /// Ends every unfinished sample of `request` with `reason` (`error`: why), counts it and moves
  /// it to aborted_, whose outputs the next step reports; its id stays in use until then.
  void end_request(const std::string& request_id, const std::string& reason,
                   const std::string& error);
  /// The final outputs of requests aborted since the last step (each reported once); their ids
  /// are free again.
  std::vector<RequestOutput> take_aborted_outputs();
  /// Records first-scheduled times and builds the step's sampling targets; a prompt whose n > 1
  /// samples start now gets its samples' completions (forked in the scheduler after the step).
  StepSamples plan_samples(const SchedulerOutput& work);
  /// The prompt tokens the step scores (SamplingParams::prompt_logprobs), each once.
  void plan_prompt_logprobs(const SchedulerOutput& work, StepSamples& samples);
  /// runner_.execute; if it throws, ends the step's requests with an error and drops the prefix
  /// cache.
  ModelRunnerOutput execute(const SchedulerOutput& work, const StepSamples& samples);
  void update_from_output(const SchedulerOutput& work, const StepSamples& samples,
                          const ModelRunnerOutput& result, std::vector<RequestOutput>& outputs,
                          bool finished_only);
  /// The scheduler's side of a step that ran: what it computed, and the step counters.
  void advance(const SchedulerOutput& work, bool cuda_graph);
  /// The step sampled the first tokens of these requests' n samples: their sequences fork.
  void fork_samples(const StepSamples& samples);
  /// The step's samples into their completions (stop conditions, outputs). pending: the step
  /// was launched asynchronously; its sequences end with kPendingToken (set here) and those
  /// that ended since are skipped.
  void take_samples(const SchedulerOutput& work, const StepSamples& samples,
                    const ModelRunnerOutput& result, std::vector<RequestOutput>& outputs,
                    bool finished_only, bool pending);

  // Asynchronous scheduling (EngineConfig::async_scheduling), in
  // continuous_batching_engine_async.cpp.
  /// A step launched by launch_step whose samples are not taken yet.
  struct LaunchedWork {
    SchedulerOutput work;
    StepSamples samples;
    LaunchedStep launched;
  };
  /// Launches `work`, feeding the in-flight step's samples on the device, then takes those
  /// samples, advances the scheduler past `work` and leaves it in flight, each of its sequences
  /// ending with a kPendingToken (but those whose next token ends them by length).
  void launch_step(SchedulerOutput work, StepSamples samples, std::vector<RequestOutput>& outputs,
                   bool finished_only);
  /// Waits for the in-flight step's samples and takes them.
  void finish_in_flight(std::vector<RequestOutput>& outputs, bool finished_only);
  /// A launch or a wait failed: ends the requests of `work` and of the step in flight with the
  /// error and drops the prefix cache.
  void fail_step(const SchedulerOutput* work, const std::string& error);
  /// Ends every waiting request with an error after two steps in a row scheduled nothing.
  void fail_if_stalled(std::vector<RequestOutput>& outputs);
  /// Ends `completion` with `reason`, freeing its sequence.
  void end_completion(Completion& completion, const std::string& reason);
  /// Appends `token` to `completion` (kv_written: an accepted draft whose KV the step wrote) and
  /// applies the stop conditions. False when the completion ended.
  /// pending: the token is the sequence's kPendingToken's value (asynchronous scheduling).
  bool append_token(Request& request, Completion& completion, int64_t token, bool kv_written,
                    bool pending = false);
  /// Counts a target's verified drafts in the request's metrics and the engine's stats.
  void count_speculation(Request& request, const SampledTokens& sampled);
  bool all_finished(const Request& request) const;
  RequestOutput make_output(Request& request) const;
  /// Stamps finished_time, counts the request in the stats and (release_id) frees its id.
  void retire(Request& request, double finished_time, bool release_id = true);
  void publish_stats();

  std::shared_ptr<CausalLM> model_;
  EngineConfig config_;
  PagedBlockManager block_manager_;
  SequenceTable sequences_;  ///< every queued or running sequence's tokens and progress
  Scheduler scheduler_;
  std::unique_ptr<SpeculativeDecoder> speculator_;
  std::shared_ptr<Communicator> workers_;  ///< the other ranks' control group; null: none
  ModelRunner runner_;

  // Owned by the thread holding step_mutex_.
  std::mutex step_mutex_;
  std::unordered_map<std::string, std::unique_ptr<Request>> requests_;
  std::unordered_map<int64_t, Where> where_;  ///< seq id -> its request and completion
  std::vector<std::unique_ptr<Request>> aborted_;  ///< reported by the current step()
  int64_t next_seq_id_ = 0;
  uint64_t next_mark_ = 0;
  int64_t num_idle_steps_ = 0;
  EngineStats stats_;
  std::atomic<int64_t> num_injected_failures_{0};
  std::vector<std::string> loaded_;  ///< requests whose load ended since the last step
  std::optional<LaunchedWork> in_flight_;  ///< asynchronous scheduling's launched step

  // Shared with other threads, under inbox_mutex_.
  mutable std::mutex inbox_mutex_;
  std::deque<Command> inbox_;
  /// Queued or unfinished requests, and ended ones whose output is not reported yet (an id
  /// stays in use until then).
  std::unordered_set<std::string> live_ids_;
  std::unordered_set<std::string> unreported_ids_;  ///< ended in end_request, not reported
  EngineStats published_stats_;
  std::vector<KVLoad> pending_loads_;  ///< admitted loads not yet taken
  std::unordered_map<std::string, std::pair<int64_t, HeldKV>> held_;  ///< id -> seq, blocks
};

}  // namespace kvserve
