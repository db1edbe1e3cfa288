"""Prometheus metrics of a serving engine, named after vLLM's (`vllm:` -> `kvserve:`) so that
existing dashboards work. Engine counters and gauges are read from LLMEngine.get_stats() at
each scrape; per-request latencies and token counts are observed as requests finish."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

# vLLM's buckets (seconds)
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0,
                7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
TPOT_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0,
                7.5, 10.0, 20.0, 40.0, 80.0)
E2E_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0,
               120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)


class _EngineCollector:
    """Gauges and counters the engine keeps, read at scrape time."""

    def __init__(self, engine, model_name: str, serving=None):
        self.engine, self.model_name, self.serving = engine, model_name, serving

    def collect(self):
        s = self.engine.get_stats()
        labels, values = ["model_name"], [self.model_name]

        def family(kind, name, help_text, value):
            metric = kind(name, help_text, labels=labels)
            metric.add_metric(values, value)
            return metric

        yield family(GaugeMetricFamily, "kvserve:num_requests_running",
                     "Requests in the running batch.", s.num_running_requests)
        yield family(GaugeMetricFamily, "kvserve:num_requests_waiting",
                     "Requests waiting to be scheduled.", s.num_waiting_requests)
        yield family(GaugeMetricFamily, "kvserve:kv_cache_usage_perc",
                     "Fraction of KV-cache blocks in use (1 = full).", s.kv_cache_usage)
        for name, help_text, value in [
                ("prefix_cache_queries", "Prompt tokens looked up in the prefix cache.",
                 s.prefix_cache_queries),
                ("prefix_cache_hits", "Prompt tokens found in the prefix cache.",
                 s.prefix_cache_hits),
                ("generation_tokens", "Tokens generated.", s.num_generated_tokens),
                ("prompt_tokens_computed", "Prompt tokens a forward computed (prefix-cache "
                 "hits and KV-loaded prompts excluded).", s.num_computed_prompt_tokens),
                ("num_preemptions", "Sequences preempted (their KV recomputed later).",
                 s.num_preemptions)]:
            yield family(CounterMetricFamily, f"kvserve:{name}", help_text, value)
        if self.serving is not None:  # the AsyncLLMEngine that serves it
            a = self.serving
            yield family(GaugeMetricFamily, "kvserve:engine_healthy",
                         "1 while the engine steps normally (/health 200).", float(a.healthy))
            for name, help_text, value in [
                    ("failed_steps", "Engine steps that raised (their requests ended with an "
                     "error).", a.num_failed_steps),
                    ("stream_lag_aborts", "Requests aborted because their client fell more than "
                     "max_stream_lag seconds behind.", a.num_lagging_aborts),
                    ("request_failed", "Requests that ended with finish_reason error.",
                     s.num_failed_requests)]:
                yield family(CounterMetricFamily, f"kvserve:{name}", help_text, value)
        connector = self.engine.kv_connector
        if connector is not None:  # prefill/decode disaggregation
            yield family(GaugeMetricFamily, "kvserve:num_requests_loading_kv",
                         "Requests waiting for their prompt's KV from a producer.",
                         s.num_loading_requests)
            yield family(GaugeMetricFamily, "kvserve:num_requests_holding_kv",
                         "Finished requests holding their KV for a consumer's pull.",
                         s.num_held_requests)
            for name, help_text, value in [
                    ("prompt_tokens_loaded", "Prompt tokens whose KV a transfer brought.",
                     s.num_loaded_prompt_tokens),
                    ("kv_transfers_served", "KV pulls this producer answered.",
                     connector.num_pulled),
                    ("kv_transfers_expired", "Held KV freed after the transfer timeout, "
                     "never pulled.", connector.num_expired),
                    ("kv_transfers_failed", "KV pulls of this consumer that failed.",
                     connector.num_failed),
                    ("kv_transfers_loaded", "KV pulls of this consumer that succeeded.",
                     connector.num_loaded),
                    ("kv_transfer_seconds", "Seconds the successful pulls took, summed (from "
                     "the pull's start to its last page).", connector.transfer_seconds)]:
                yield family(CounterMetricFamily, f"kvserve:{name}", help_text, value)
        if self.engine.engine.config.speculative.enabled:
            for name, help_text, value in [
                    ("spec_decode_num_drafts", "Speculative drafts verified.", s.num_drafts),
                    ("spec_decode_num_draft_tokens", "Draft tokens proposed.",
                     s.num_draft_tokens),
                    ("spec_decode_num_accepted_tokens", "Draft tokens accepted.",
                     s.num_accepted_tokens)]:
                yield family(CounterMetricFamily, f"kvserve:{name}", help_text, value)


class ServerMetrics:
    """The registry /metrics exposes: the engine's collector plus per-request observations."""

    def __init__(self, model_name: str):
        self.model_name = model_name
        self.registry = CollectorRegistry()
        labels = ["model_name"]
        self.prompt_tokens = Counter("kvserve:prompt_tokens", "Prompt tokens of finished "
                                     "requests.", labels, registry=self.registry)
        self.request_success = Counter("kvserve:request_success", "Finished requests by "
                                       "finish reason.", labels + ["finished_reason"],
                                       registry=self.registry)
        self.ttft = Histogram("kvserve:time_to_first_token_seconds", "Time to first token.",
                              labels, buckets=TTFT_BUCKETS, registry=self.registry)
        self.tpot = Histogram("kvserve:time_per_output_token_seconds", "Mean time per output "
                              "token after the first, per request.", labels,
                              buckets=TPOT_BUCKETS, registry=self.registry)
        self.e2e = Histogram("kvserve:e2e_request_latency_seconds", "Arrival to finish.",
                             labels, buckets=E2E_BUCKETS, registry=self.registry)
        self.errors = Counter("kvserve:http_errors", "HTTP requests answered with an error, by "
                              "status (400, 413, 429, 500, 503, ...).", labels + ["status"],
                              registry=self.registry)

    def rejected(self, status: int) -> None:
        """Counts one error answer."""
        self.errors.labels(self.model_name, str(status)).inc()

    def attach(self, engine, serving=None) -> None:
        """Starts reading the counters of `engine` (an LLMEngine, once it has loaded) and of the
        AsyncLLMEngine `serving` it, if given."""
        self.registry.register(_EngineCollector(engine, self.model_name, serving))

    def observe(self, output) -> None:
        """A finished RequestOutput: its prompt tokens, finish reasons and latencies."""
        m, name = output.metrics, self.model_name
        self.prompt_tokens.labels(name).inc(len(output.prompt_token_ids))
        for sample in output.outputs:
            self.request_success.labels(name, sample.finish_reason or "abort").inc()
        if m is None or m.first_token_time == 0:
            return
        self.ttft.labels(name).observe(m.time_to_first_token)
        if m.num_generated_tokens > 1:
            self.tpot.labels(name).observe(m.time_per_output_token)
        self.e2e.labels(name).observe(m.e2e_latency)
