"""/metrics: the engine's state in Prometheus text, under vLLM's metric names and meanings,
so a dashboard made for vLLM reads minillm unchanged.

    gauges      vllm:num_requests_running, vllm:num_requests_waiting, vllm:kv_cache_usage_perc (0..1)
    counters    vllm:prompt_tokens, vllm:generation_tokens, vllm:num_preemptions,
                vllm:prefix_cache_queries, vllm:prefix_cache_hits (tokens),
                vllm:request_success{finished_reason="stop"|"length"|"abort"|"error"}
                (Prometheus shows counters with a _total suffix)
    histograms  vllm:time_to_first_token_seconds, vllm:inter_token_latency_seconds,
                vllm:e2e_request_latency_seconds, vllm:request_queue_time_seconds,
                vllm:iteration_tokens_total (tokens computed per engine step)
    routing     minillm:routed_requests{routed_to=...}: requests to model "auto", by the model that answered

Every series carries the label model_name. Each server has its own registry, so several can
live in one process (the tests start more than one); the models of one server share it.
"""
from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, disable_created_metrics, generate_latest

disable_created_metrics()     # as vLLM does: no *_created series beside each counter and histogram

_LATENCY = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
            20.0, 40.0, 80.0, 160.0, 640.0)
_STEP_TOKENS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192)


class ServerMetrics:
    def __init__(self, model_name: str, share: "ServerMetrics | None" = None):
        """share: the metrics of another model of the same server: one registry, series told apart by label."""
        self.model_name = model_name
        if share is None:
            self.registry, self._families = CollectorRegistry(), {}
        else:
            self.registry, self._families = share.registry, share._families
        lab = ["model_name"]

        def family(kind, name, doc, *args, **kw):
            if name not in self._families:
                self._families[name] = kind(name, doc, *args, registry=self.registry, **kw)
            return self._families[name]

        def gauge(name, doc):
            return family(Gauge, name, doc, lab).labels(model_name)

        def counter(name, doc):
            return family(Counter, name, doc, lab).labels(model_name)

        def hist(name, doc, buckets=_LATENCY):
            return family(Histogram, name, doc, lab, buckets=buckets).labels(model_name)

        self.running = gauge("vllm:num_requests_running", "Requests in the running batch (holding KV blocks).")
        self.waiting = gauge("vllm:num_requests_waiting", "Requests waiting to be admitted.")
        self.kv_usage = gauge("vllm:kv_cache_usage_perc", "Fraction of KV-cache blocks in use (1 = full).")
        self.prompt_tokens = counter("vllm:prompt_tokens", "Prompt tokens of finished requests.")
        self.generation_tokens = counter("vllm:generation_tokens", "Generated tokens.")
        self.preemptions = counter("vllm:num_preemptions", "Requests preempted (blocks freed, recomputed later).")
        self.cache_queries = counter("vllm:prefix_cache_queries", "Prompt tokens looked up in the prefix cache.")
        self.cache_hits = counter("vllm:prefix_cache_hits", "Prompt tokens found in the prefix cache.")
        self.success = family(Counter, "vllm:request_success", "Finished requests, by finish reason.",
                              lab + ["finished_reason"])
        self.ttft = hist("vllm:time_to_first_token_seconds", "Arrival to first token.")
        self.itl = hist("vllm:inter_token_latency_seconds", "Gaps between consecutive tokens of a request.")
        self.e2e = hist("vllm:e2e_request_latency_seconds", "Arrival to finish.")
        self.queue = hist("vllm:request_queue_time_seconds", "Arrival to first scheduled.")
        self.step_tokens = hist("vllm:iteration_tokens_total", "Tokens computed per engine step.", _STEP_TOKENS)
        self.routed = family(Counter, "minillm:routed_requests", "Requests sent to model 'auto', by the model that "
                             "answered (the cheap one, or the exact one after escalation).", lab + ["routed_to"])
        self._last = {"num_preemptions": 0, "prefix_cache_queries": 0, "prefix_cache_hits": 0}

    def on_step(self, engine, outputs) -> None:
        """Called by the engine thread after every step."""
        st = engine.stats()
        self.running.set(st["running"])
        self.waiting.set(st["waiting"])
        self.kv_usage.set(st["kv_blocks_used"] / st["kv_blocks_total"])
        for key, metric in (("num_preemptions", self.preemptions), ("prefix_cache_queries", self.cache_queries),
                            ("prefix_cache_hits", self.cache_hits)):
            metric.inc(st[key] - self._last[key])
            self._last[key] = st[key]
        if st["tokens_last_step"]:
            self.step_tokens.observe(st["tokens_last_step"])
        for out in outputs:
            self.generation_tokens.inc(len(out.new_token_ids))
            if out.finished:
                self._finished(out)

    def _finished(self, out) -> None:
        self.success.labels(self.model_name, out.finish_reason or "abort").inc()
        self.prompt_tokens.inc(len(out.prompt_token_ids))
        m = out.metrics
        for value, hist in ((m.ttft_s, self.ttft), (m.e2e_s, self.e2e), (m.queue_s, self.queue)):
            if value is not None:
                hist.observe(value)
        for gap in m.itl_s:
            self.itl.observe(gap)

    def render(self) -> bytes:
        return generate_latest(self.registry)
