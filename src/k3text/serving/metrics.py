"""The server's Prometheus metrics (`GET /metrics`), in a registry of their own so several
servers in one process (tests) never share counts."""

from __future__ import annotations

import gc

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    GCCollector,
    Histogram,
    ProcessCollector,
    generate_latest,
)

_LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0,
                    10.0, 30.0, 60.0, 120.0)


class Metrics:
    def __init__(self, slots: int):
        r = self.registry = CollectorRegistry()
        self.requests = Counter("k3text_requests", "Finished requests by outcome "
                                "(stop, length, cancelled, error, rejected)", ["outcome"],
                                registry=r)
        self.running = Gauge("k3text_requests_running", "Requests holding a slot "
                             "(prefilling or decoding)", registry=r)
        self.waiting = Gauge("k3text_requests_waiting", "Requests queued for a slot",
                             registry=r)
        self.slots_total = Gauge("k3text_slots_total", "Decode slots in the pool", registry=r)
        self.slots_used = Gauge("k3text_slots_used", "Decode slots held by a request",
                                registry=r)
        self.ttft = Histogram("k3text_time_to_first_token_seconds", "Arrival to first token",
                              buckets=_LATENCY_BUCKETS, registry=r)
        self.tpot = Histogram("k3text_time_per_output_token_seconds", "Mean time between a "
                              "request's tokens after the first", buckets=_LATENCY_BUCKETS,
                              registry=r)
        self.e2e = Histogram("k3text_e2e_request_latency_seconds", "Arrival to last token",
                             buckets=_LATENCY_BUCKETS, registry=r)
        self.prompt_tokens = Counter("k3text_prompt_tokens", "Prompt tokens of admitted "
                                     "requests (restored from the prefix cache or prefilled)",
                                     registry=r)
        self.generation_tokens = Counter("k3text_generation_tokens", "Tokens generated",
                                         registry=r)
        self.decode_steps = Counter("k3text_decode_steps", "Decode steps run over the pool",
                                    registry=r)
        self.decode_seconds = Counter("k3text_decode_seconds", "Time in decode calls",
                                      registry=r)
        self.prefill_seconds = Counter("k3text_prefill_seconds", "Time in prefill chunks and "
                                       "inserts (first tokens)", registry=r)
        self.prefix_hit_tokens = Counter(
            "k3text_prefix_cache_hit_tokens", "Prompt tokens restored from the prefix cache "
            "instead of prefilled (hit rate: this / k3text_prefix_cache_queried_tokens)",
            registry=r)
        self.prefix_queried_tokens = Counter(
            "k3text_prefix_cache_queried_tokens", "Prompt tokens of requests that looked "
            "their prefix up in the cache", registry=r)
        self.prefix_hit_rate = Gauge("k3text_prefix_cache_hit_rate", "Prompt tokens restored "
                                     "from the prefix cache / prompt tokens looked up, since "
                                     "start", registry=r)
        self.prefix_evictions = Counter("k3text_prefix_cache_evictions", "Cached blocks "
                                        "evicted to make room", registry=r)
        self.prefix_cached_bytes = Gauge("k3text_prefix_cache_bytes", "Device bytes (per "
                                         "device) of the cached blocks", registry=r)
        self.prefix_cached_blocks = Gauge("k3text_prefix_cache_blocks", "Blocks cached",
                                          registry=r)
        self.pages_total = Gauge("k3text_pages_total", "MLA pages in the paged pool "
                                 "(serve_engine: paged; the null page left out)", registry=r)
        self.pages_used = Gauge("k3text_pages_used", "MLA pages held by requests", registry=r)
        self.preemptions = Counter("k3text_preemptions", "Running requests preempted when the "
                                   "pages ran out (their pages freed, recomputed later with "
                                   "the same output)", registry=r)
        self.slots_total.set(slots)
        # The process's own: CPU seconds, resident memory, open files (process_*), and Python's
        # garbage collections by generation (python_gc_*), as every Python server exports them.
        ProcessCollector(registry=r)
        GCCollector(registry=r)
        Gauge("k3text_gc_frozen_objects", "Objects exempt from Python's garbage collector: the "
              "heap as loaded, frozen once the programs are compiled", registry=r,
              ).set_function(gc.get_freeze_count)

    def render(self) -> bytes:
        return generate_latest(self.registry)
