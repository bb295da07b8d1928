"""Prometheus metrics of `pagecli serve` (GET /metrics), through prometheus-client.

Names mirror vLLM's `vllm:` metrics where the concept is the same, under `pagecli:`. Engine
state (requests running and waiting, KV blocks, prefix-cache tokens, preemptions) is read from
an `EngineStats` snapshot taken between two steps when /metrics is scraped; per-request
figures (tokens, latencies) are recorded by the request handlers as requests finish.
"""

from __future__ import annotations

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Histogram,
    disable_created_metrics,
    generate_latest,
)
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from pagecli.engine.stats import EngineStats

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

_LATENCY_BUCKETS = (
    0.005,
    0.01,
    0.02,
    0.04,
    0.06,
    0.08,
    0.1,
    0.25,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    7.5,
    10.0,
    20.0,
    40.0,
    80.0,
)
_TOKEN_LATENCY_BUCKETS = (
    0.001,
    0.005,
    0.01,
    0.02,
    0.04,
    0.06,
    0.08,
    0.1,
    0.15,
    0.2,
    0.3,
    0.4,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    10.0,
)


class _EngineCollector:
    """Turns the latest EngineStats snapshot into metric families at scrape time."""

    def __init__(self, model_name: str) -> None:
        self.model_name = model_name
        self.stats: EngineStats | None = None

    def collect(self):
        s = self.stats
        if s is None:
            return
        labels = ["model_name"]
        value = [self.model_name]

        def gauge(name: str, doc: str, number: float) -> GaugeMetricFamily:
            family = GaugeMetricFamily(f"pagecli:{name}", doc, labels=labels)
            family.add_metric(value, number)
            return family

        def counter(name: str, doc: str, number: float) -> CounterMetricFamily:
            family = CounterMetricFamily(f"pagecli:{name}", doc, labels=labels)
            family.add_metric(value, number)
            return family

        yield gauge("num_requests_running", "Sequences in the running batch.", s.num_running)
        yield gauge("num_requests_waiting", "Sequences waiting to be admitted.", s.num_waiting)
        yield gauge("num_requests_swapped", "Sequences swapped out to host memory.", s.num_swapped)
        yield gauge(
            "kv_cache_usage_perc",
            "KV blocks in use as a fraction of all blocks (1 = full).",
            s.blocks_in_use / s.num_blocks if s.num_blocks else 0.0,
        )
        yield gauge("kv_cache_blocks_in_use", "KV blocks held by a sequence.", s.blocks_in_use)
        yield gauge(
            "kv_cache_cached_free_blocks",
            "KV blocks held by no sequence whose prefix is still findable.",
            s.blocks_cached_free,
        )
        yield gauge("kv_cache_blocks_total", "KV blocks in the pool.", s.num_blocks)
        per_group = GaugeMetricFamily(
            "pagecli:kv_cache_group_blocks_in_use",
            "KV blocks held, by KV cache group (a table per layer type; windows give back "
            "what they no longer read).",
            labels=[*labels, "group", "kind"],
        )
        for g, (kind, used) in enumerate(zip(s.kv_groups, s.group_blocks_in_use)):
            per_group.add_metric([*value, str(g), kind], used)
        yield per_group
        yield gauge(
            "state_slots_in_use",
            "Recurrent-layer state slots held by running sequences (one each).",
            s.state_slots_in_use,
        )
        yield gauge(
            "state_snapshots_held",
            "Recurrent states kept at block boundaries for prefix hits.",
            s.state_snapshots_held,
        )
        yield counter(
            "kv_cache_window_freed_blocks",
            "KV blocks sliding-window tables gave back before their sequence ended.",
            s.window_freed_blocks,
        )
        yield gauge(
            "tensor_parallel_size",
            "Ranks that share each step (--tensor-parallel-size).",
            s.tensor_parallel_size,
        )
        yield counter(
            "prefix_cache_queries",
            "Prompt tokens looked up in the prefix cache.",
            s.prefix_query_tokens,
        )
        yield counter(
            "prefix_cache_hits", "Prompt tokens found in the prefix cache.", s.prefix_hit_tokens
        )
        preemptions = CounterMetricFamily(
            "pagecli:num_preemptions", "Preempted sequences, by mode.", labels=[*labels, "mode"]
        )
        preemptions.add_metric([*value, "recompute"], s.preemptions_recompute)
        preemptions.add_metric([*value, "swap"], s.preemptions_swap)
        yield preemptions
        # speculative decoding, as vLLM names it (zero while it is off)
        yield counter(
            "spec_decode_num_drafts", "Decodes that carried drafts to check.", s.spec_drafts
        )
        yield counter("spec_decode_num_draft_tokens", "Draft tokens checked.", s.spec_draft_tokens)
        yield counter(
            "spec_decode_num_accepted_tokens", "Draft tokens accepted.", s.spec_accepted_tokens
        )
        per_position = CounterMetricFamily(
            "pagecli:spec_decode_num_accepted_tokens_per_pos",
            "Draft tokens accepted, by their position among a decode's drafts (0 first).",
            labels=[*labels, "position"],
        )
        for position, accepted in enumerate(s.spec_accepted_per_position):
            per_position.add_metric([*value, str(position)], accepted)
        yield per_position


class ServerMetrics:
    """The server's registry: engine families plus per-request counters and histograms."""

    def __init__(self, model_name: str) -> None:
        disable_created_metrics()  # no `_created` series beside every counter and histogram
        self.registry = CollectorRegistry(auto_describe=False)
        self._engine = _EngineCollector(model_name)
        self.registry.register(self._engine)
        labels = ["model_name"]
        self._labels = {"model_name": model_name}
        self.prompt_tokens = Counter(
            "pagecli:prompt_tokens",
            "Prompt tokens of finished requests.",
            labels,
            registry=self.registry,
        )
        self.generation_tokens = Counter(
            "pagecli:generation_tokens",
            "Generated tokens of finished requests.",
            labels,
            registry=self.registry,
        )
        self.request_success = Counter(
            "pagecli:request_success",
            "Requests that finished, by finish reason.",
            [*labels, "finished_reason"],
            registry=self.registry,
        )
        self.ttft = Histogram(
            "pagecli:time_to_first_token_seconds",
            "Time from arrival to the first token.",
            labels,
            buckets=_LATENCY_BUCKETS,
            registry=self.registry,
        )
        self.itl = Histogram(
            "pagecli:inter_token_latency_seconds",
            "Time between two outputs of a request.",
            labels,
            buckets=_TOKEN_LATENCY_BUCKETS,
            registry=self.registry,
        )
        self.e2e = Histogram(
            "pagecli:e2e_request_latency_seconds",
            "Time from arrival to the last token.",
            labels,
            buckets=_LATENCY_BUCKETS,
            registry=self.registry,
        )

    def observe_request(
        self,
        prompt_tokens: int,
        completion_tokens: int,
        finish_reasons: list[str],
        ttft_s: float | None,
        itl_s: list[float],
        e2e_s: float,
    ) -> None:
        """Record one finished request."""
        lab = self._labels
        self.prompt_tokens.labels(**lab).inc(prompt_tokens)
        self.generation_tokens.labels(**lab).inc(completion_tokens)
        for reason in finish_reasons:
            self.request_success.labels(**lab, finished_reason=reason).inc()
        if ttft_s is not None:
            self.ttft.labels(**lab).observe(ttft_s)
        itl = self.itl.labels(**lab)
        for gap in itl_s:
            itl.observe(gap)
        self.e2e.labels(**lab).observe(e2e_s)

    def render(self, stats: EngineStats | None) -> bytes:
        """The Prometheus text exposition, with `stats` as the engine's state."""
        self._engine.stats = stats
        return generate_latest(self.registry)
