"""/metrics in Prometheus text format (prometheus-client), one registry per app.

Engine state (running, queued, cache hits, cached tokens) is read from engine.stats() at scrape
time; the server itself counts requests by route and status, generated tokens, TTFT, and keeps a
10-second window of generated tokens for the tokens/s gauge.
"""
from __future__ import annotations

import collections
import threading
import time

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
_WINDOW_S = 10.0
_TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)


class _EngineCollector:
    def __init__(self, engine, labels):
        self.engine, self.labels = engine, labels

    def collect(self):
        s = self.engine.stats()
        names, values = list(self.labels), list(self.labels.values())
        for key, kind, doc in (("running", "g", "requests in a slot now"),
                               ("queued", "g", "requests admitted and waiting for a slot"),
                               ("cache_hits", "c", "requests that reused a cached prompt prefix"),
                               ("cached_tokens", "c", "prompt tokens taken from the prompt cache"),
                               ("cache_evictions", "c", "prompt-cache nodes evicted to keep the memory bound"),
                               ("kv_cache_bytes_used", "b", "KV memory counted against --kv-cache-bytes "
                                                            "(cached prefixes and running requests)"),
                               ("cache_nodes", "b", "token runs held by the prompt cache"),
                               ("steps", "c", "engine steps (one forward each)"),
                               ("decode_tokens", "c", "tokens decoded by engine steps (decode batch = this / steps)"),
                               ("draft_tokens", "c", "tokens drafted by speculative decoding"),
                               ("accepted_draft_tokens", "c", "drafted tokens the model accepted"),
                               ("verify_steps", "c", "speculative verification forwards"),
                               ("gemm_cache_bytes_used", "b", "memory held by unpacked weight tiles (gemm cache)")):
            if key not in s:
                continue
            fam = (GaugeMetricFamily if kind != "c" else CounterMetricFamily)(
                f"mixqrt_{'requests_' + key if kind == 'g' else key}", doc, labels=names)
            fam.add_metric(values, float(s[key]))
            yield fam


class Metrics:
    def __init__(self, engine, replica: str | None = None):
        self.registry = CollectorRegistry()
        labels = {"replica": replica or "0"}
        self._labels = labels
        r = self.registry
        self.requests = Counter("mixqrt_http_requests", "HTTP requests by route and status",
                                ["replica", "route", "status"], registry=r)
        self.tokens = Counter("mixqrt_generation_tokens", "tokens generated and sent", ["replica"], registry=r)
        self.prompt_tokens = Counter("mixqrt_prompt_tokens", "prompt tokens of finished requests", ["replica"],
                                     registry=r)
        self.ttft = Histogram("mixqrt_time_to_first_token_seconds", "submit to first token",
                              ["replica"], buckets=_TTFT_BUCKETS, registry=r)
        self.tps = Gauge("mixqrt_generation_tokens_per_second", f"tokens generated over the last {_WINDOW_S:g} s",
                         ["replica"], registry=r)
        self.tps.labels(**labels).set_function(self._rate)
        Gauge("mixqrt_replica_info", "this replica", ["replica"], registry=r).labels(**labels).set(1)
        r.register(_EngineCollector(engine, labels))
        self._recent = collections.deque()
        self._lock = threading.Lock()

    def request(self, route: str, status: int) -> None:
        self.requests.labels(self._labels["replica"], route, str(status)).inc()

    def token(self, n: int = 1) -> None:
        self.tokens.labels(**self._labels).inc(n)
        now = time.monotonic()
        with self._lock:
            self._recent.append((now, n))

    def finished(self, prompt_tokens: int, ttft_s: float | None) -> None:
        self.prompt_tokens.labels(**self._labels).inc(prompt_tokens)
        if ttft_s is not None:
            self.ttft.labels(**self._labels).observe(ttft_s)

    def _rate(self) -> float:
        cut = time.monotonic() - _WINDOW_S
        with self._lock:
            while self._recent and self._recent[0][0] < cut:
                self._recent.popleft()
            return sum(n for _, n in self._recent) / _WINDOW_S

    def render(self) -> bytes:
        return generate_latest(self.registry)
