"""Prometheus metrics (prometheus-client), named after vLLM's v1 metrics under a `kvchat:`
prefix with the same histogram buckets, plus kvchat's own: pinned sessions, session reuse,
offloads / restores / drops, history trims and summaries, cached tokens by source, WebSocket
connections, rate-limited requests, the replica's name (`kvchat:replica_info{replica=...}`, the
name HAProxy's server and the `X-Kvchat-Replica` header carry) and sessions that moved here from
another replica.

Engine-side values come from the EngineStats the engine thread publishes after each step (the
snapshot admission control reads), and the history counters from the service's own
(app.ops.history_counters), both read when scraped (gauges and monotonic counters); latencies
are observed by the service as requests finish."""

from __future__ import annotations

from collections.abc import Callable, Iterator

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    Info,
    generate_latest,
)
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from kvchat.app.ops.history_counters import HistoryCounters
from kvchat.inference import EngineStats

PREFIX = "kvchat:"

# vLLM's buckets (vllm/v1/metrics/loggers.py).
TTFT_BUCKETS = (
    0.001,
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
    160.0,
    640.0,
    2560.0,
)
ITL_BUCKETS = (
    0.01,
    0.025,
    0.05,
    0.075,
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
    7.5,
    10.0,
    20.0,
    40.0,
    80.0,
)
LATENCY_BUCKETS = (
    0.3,
    0.5,
    0.8,
    1.0,
    1.5,
    2.0,
    2.5,
    5.0,
    10.0,
    15.0,
    20.0,
    30.0,
    40.0,
    50.0,
    60.0,
    120.0,
    240.0,
    480.0,
    960.0,
    1920.0,
    7680.0,
)


# memory.KVStoreStats' counters, as kvchat:kv_store_<name>_total.
KV_STORE_COUNTERS = {
    "hits": "Blocks loaded from the KV store.",
    "misses": "KV store lookups that found no usable block.",
    "skipped": "KV store files not used (corrupt, partial, another model's).",
    "writes": "Blocks written to the KV store.",
    "evictions": "KV store files evicted by its byte cap.",
    "dropped": "Copies queued for the KV store dropped unwritten (its queue at its cap, or the "
    "store off).",
    "write_seconds": "The KV store writer thread's time.",
    "copy_seconds": "The engine thread's time copying blocks out for the KV store's writer "
    "(the write-behind's share of the turn's path).",
}


class EngineCollector(Collector):
    """What the engine and the history planner know, read at scrape time."""

    def __init__(self, stats: Callable[[], EngineStats], history: HistoryCounters) -> None:
        self.stats = stats
        self.history = history

    def describe(self) -> list[Metric]:
        return []

    def collect(self) -> Iterator[Metric]:
        report = self.stats()
        stats = report.cache
        history = self.history.total()

        def gauge(name: str, doc: str, value: float) -> GaugeMetricFamily:
            return GaugeMetricFamily(PREFIX + name, doc, value=value)

        def counter(name: str, doc: str, value: float) -> CounterMetricFamily:
            return CounterMetricFamily(PREFIX + name, doc, value=value)

        yield gauge("num_requests_running", "Requests in the running batch.", report.num_running)
        yield gauge("num_requests_waiting", "Requests waiting to be scheduled.", report.num_waiting)
        yield gauge(
            "num_requests_swapped", "Requests preempted to host memory.", report.num_swapped
        )
        yield gauge(
            "kv_cache_usage_perc",
            "Fraction of the KV pool's blocks in use (0-1).",
            report.kv_cache_usage,
        )
        pinned = GaugeMetricFamily(
            PREFIX + "pinned_sessions", "Idle sessions holding KV, by tier.", labels=["tier"]
        )
        pinned.add_metric(["gpu"], report.num_resident_sessions)
        pinned.add_metric(["host"], report.num_offloaded_sessions)
        pinned.add_metric(["disk"], report.num_stored_sessions)
        yield pinned
        yield from _retention_metrics(report)
        yield counter(
            "prefix_cache_queries", "Prompt tokens looked up for reuse.", stats.prompt_tokens
        )
        yield counter(
            "prefix_cache_hits",
            "Prompt tokens served by the global prefix cache.",
            stats.from_prefix_cache,
        )
        yield counter("prompt_tokens", "Prompt tokens admitted.", stats.prompt_tokens)
        yield counter(
            "num_preemptions",
            "Running requests preempted (swap or recompute).",
            stats.preemptions_swap + stats.preemptions_recompute,
        )
        yield counter(
            "session_reuse_tokens", "Prompt tokens served by a pinned session.", stats.from_session
        )
        cached = CounterMetricFamily(
            PREFIX + "cached_tokens",
            "Prompt tokens whose KV was reused, by source.",
            labels=["source"],
        )
        cached.add_metric(["session"], stats.from_session)
        cached.add_metric(["prefix_cache"], stats.from_prefix_cache)
        cached.add_metric(["host"], stats.from_host)
        cached.add_metric(["kv_store"], stats.from_store)
        yield cached
        store = report.kv_store
        if store is not None:
            yield gauge(
                "kv_store_bytes",
                "Bytes in the KV store (as this replica last saw it).",
                store.num_bytes,
            )
            yield gauge("kv_store_blocks", "Blocks in the KV store.", store.num_blocks)
            for name, doc in KV_STORE_COUNTERS.items():
                yield counter("kv_store_" + name, doc, getattr(store, name))
            yield gauge(
                "kv_store_enabled",
                "1 while the KV store serves; 0 while it has turned itself off.",
                1.0 if store.enabled else 0.0,
            )
            errors = CounterMetricFamily(
                PREFIX + "kv_store_errors",
                "Faults the KV store caught (each cost a recompute or a write), by what it was "
                "doing and why.",
                labels=["op", "reason"],
            )
            for (op, reason), count in sorted(store.errors.items()):
                errors.add_metric([op, reason], count)
            yield errors
        yield counter(
            "engine_failed_steps",
            "Engine steps that raised: their requests failed with engine_error, the engine went "
            "on (it stops after several in a row).",
            report.num_failed_steps,
        )
        if report.cpu_threads is not None:
            yield gauge(
                "engine_cpu_threads",
                "Threads the engine's last step ran on (adaptive CPU threads: one or torch's "
                "count, whichever that step's shape was faster on lately).",
                report.cpu_threads,
            )
            yield counter(
                "engine_cpu_thread_switches",
                "Times the adaptive CPU threads changed the engine's thread count.",
                report.num_cpu_thread_switches,
            )
        yield counter(
            "engine_failed_requests",
            "Requests failed because a step they were in raised.",
            report.num_failed_requests,
        )
        yield counter(
            "computed_prompt_tokens",
            "Prompt tokens computed (prefilled).",
            stats.computed + stats.recomputed,
        )
        yield counter(
            "session_offloads", "Idle sessions moved to the host pool.", stats.session_offloads
        )
        yield counter(
            "session_restores", "Offloaded sessions brought back.", stats.session_restores
        )
        yield counter(
            "session_drops",
            "Sessions whose KV was dropped (recomputed later).",
            stats.session_drops,
        )
        yield counter("history_trims", "History trim events.", history.trims)
        yield counter(
            "history_dropped_tokens", "Prompt tokens dropped by trims.", history.dropped_tokens
        )
        yield counter("history_summaries", "Running summaries made.", history.summaries)
        yield counter(
            "history_summaries_extracted",
            "Running summaries extracted from the dropped user messages (no generation, or "
            "the generated one lost facts, copied the transcript or repeated itself).",
            history.summaries_extracted,
        )
        yield counter(
            "history_window_turns", "Turns run in sink + window mode.", history.window_turns
        )


def _retention_metrics(report: EngineStats) -> Iterator[Metric]:
    """The retention policy's counters (memory.retention): where returning sessions' KV was,
    prefetches, bytes moved between tiers, holds broken."""
    stats = report.cache
    hits = CounterMetricFamily(
        PREFIX + "session_hits",
        "Turns whose session's KV was waiting in a tier when they came (device, host, disk).",
        labels=["tier"],
    )
    hits.add_metric(["device"], stats.session_hits_device)
    hits.add_metric(["host"], stats.session_hits_host)
    hits.add_metric(["disk"], stats.session_hits_disk)
    yield hits
    prefetches = CounterMetricFamily(
        PREFIX + "session_prefetches",
        "Sessions brought onto the device ahead of their turn: all, those their turn used, "
        "those that left the device unused.",
        labels=["outcome"],
    )
    prefetches.add_metric(["issued"], stats.prefetches)
    prefetches.add_metric(["used"], stats.prefetches_used)
    prefetches.add_metric(["wasted"], stats.prefetches_wasted)
    yield prefetches
    moved = CounterMetricFamily(
        PREFIX + "kv_bytes_moved",
        "KV bytes copied between tiers (device to host: offloads and swap-outs; host to "
        "device: restores, swap-ins, prefetches; disk to device: loads from the KV store).",
        labels=["from", "to"],
    )
    block = report.bytes_per_block
    moved.add_metric(["device", "host"], stats.blocks_to_host * block)
    moved.add_metric(["host", "device"], stats.blocks_from_host * block)
    moved.add_metric(["disk", "device"], stats.blocks_from_store * block)
    moved.add_metric(["device", "disk"], stats.blocks_to_store * block)
    yield moved
    yield CounterMetricFamily(
        PREFIX + "session_holds_broken",
        "Held sessions (mid tool call, typing, inside their TTL) whose KV was moved down "
        "under pressure all the same.",
        value=stats.holds_broken,
    )
    yield CounterMetricFamily(
        PREFIX + "admissions_held_back",
        "Requests that waited to start rather than break a held session's hold at once (for "
        "at most what breaking it would cost that session's next turn).",
        value=stats.admissions_held_back,
    )


class Metrics:
    def __init__(self, stats: Callable[[], EngineStats], history: HistoryCounters) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.ttft = Histogram(
            PREFIX + "time_to_first_token_seconds",
            "Time to the first generated token.",
            buckets=TTFT_BUCKETS,
            registry=r,
        )
        self.itl = Histogram(
            PREFIX + "inter_token_latency_seconds",
            "Time between consecutive generated tokens.",
            buckets=ITL_BUCKETS,
            registry=r,
        )
        self.e2e = Histogram(
            PREFIX + "e2e_request_latency_seconds",
            "Request latency, arrival to last token.",
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.queue = Histogram(
            PREFIX + "request_queue_time_seconds",
            "Time a request waited before it was first scheduled.",
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.generation_tokens = Counter(
            PREFIX + "generation_tokens", "Tokens generated.", registry=r
        )
        self.request_success = Counter(
            PREFIX + "request_success",
            "Requests finished, by finish reason.",
            ["finished_reason"],
            registry=r,
        )
        self.cut_tool_replies = Counter(
            PREFIX + "cut_tool_replies",
            "Tool-call replies kvchat ended before the model did: `repeat` (it repeated one "
            "of its calls), `loop` (it was caught in a loop), or, with nothing sent yet, "
            "answered without a call instead: `answered_repeat` (it would only make the "
            "calls the last turn made), `answered_loop` (it looped before its first call).",
            ["outcome"],
            registry=r,
        )
        self.rate_limited = Counter(
            PREFIX + "rate_limited_requests", "Requests refused by a rate limit.", registry=r
        )
        self.websocket_connections = Gauge(
            PREFIX + "websocket_connections", "Open WebSocket connections.", registry=r
        )
        self.replica = Info(
            PREFIX + "replica", "The replica this process is (its replica id).", registry=r
        )
        self.session_moves = Counter(
            PREFIX + "session_moves",
            "Turns of a conversation whose session lease another "
            "replica held: its KV here, if any, was reused only as far as its token ids match.",
            registry=r,
        )
        r.register(EngineCollector(stats, history))

    def finished(
        self,
        *,
        ttft_s: float | None,
        e2e_s: float,
        queue_s: float | None,
        completion_tokens: int,
        finish_reason: str,
    ) -> None:
        if ttft_s is not None:
            self.ttft.observe(ttft_s)
        self.e2e.observe(e2e_s)
        if queue_s is not None:
            self.queue.observe(queue_s)
        self.generation_tokens.inc(completion_tokens)
        self.request_success.labels(finish_reason).inc()

    def name_replica(self, replica_id: str) -> None:
        self.replica.info({"replica": replica_id})

    def render(self) -> bytes:
        return generate_latest(self.registry)
