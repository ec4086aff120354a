"""Prometheus metrics of the server (official ``prometheus-client``, one registry per server).

Engine gauges and counters (running / waiting requests, KV-cache usage, prefix-hit rate,
preemptions) are read at scrape time from the last snapshot the engine thread published;
latency histograms and token counters are recorded by the request front end as requests run.
Names follow vLLM's with the ``pagedcore:`` prefix.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from typing import Any

__all__ = ["ServeMetrics"]

_LATENCY_BUCKETS = (0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0,
                    7.5, 10.0, 20.0, 40.0, 80.0)
_TPOT_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.015, 0.02, 0.025, 0.03, 0.04, 0.05, 0.075, 0.1,
                 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5)


class _EngineCollector:
    """Yields the engine's gauges and counters from its latest stats snapshot."""

    def __init__(self, snapshot: Callable[[], Mapping[str, Any]], model_name: str) -> None:
        self._snapshot = snapshot
        self._model_name = model_name

    def collect(self) -> Iterator[Any]:
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        stats = self._snapshot()
        labels = ["model_name"]
        value = [self._model_name]

        def gauge(name: str, doc: str, key: str) -> Any:
            family = GaugeMetricFamily(name, doc, labels=labels)
            family.add_metric(value, float(stats.get(key, 0.0)))
            return family

        def counter(name: str, doc: str, key: str) -> Any:
            family = CounterMetricFamily(name, doc, labels=labels)
            family.add_metric(value, float(stats.get(key, 0.0)))
            return family

        yield gauge("pagedcore:num_requests_running", "Requests the scheduler is running.",
                    "running")
        yield gauge("pagedcore:num_requests_waiting",
                    "Requests admitted but not running (scheduler queue and not yet handed to "
                    "the engine).", "waiting")
        yield gauge("pagedcore:kv_cache_usage_perc",
                    "Fraction of KV-cache blocks held by requests (0-1).", "kv_cache_usage")
        yield gauge("pagedcore:prefix_cache_hit_rate",
                    "Prompt tokens served from the prefix cache / prompt tokens scheduled.",
                    "prefix_hit_rate")
        yield counter("pagedcore:num_preemptions", "Requests preempted (recomputed later).",
                      "preemptions")
        yield counter("pagedcore:prefix_cache_hit_tokens", "Prompt tokens served from the "
                      "prefix cache.", "prefix_hit_tokens")
        yield counter("pagedcore:engine_steps", "Engine steps run.", "steps")
        yield counter("pagedcore:engine_step_seconds", "Seconds the engine spent in its steps "
                      "(host time, GPU waits included).", "step_time_s")


class ServeMetrics:
    """The server's metrics in their own `prometheus_client.CollectorRegistry`.

    Parameters
    ----------
    model_name:
        The ``model_name`` label of every metric.
    snapshot:
        Returns the engine's latest stats (``LLM.stats()`` keys plus ``waiting``), read at
        scrape time.
    """

    def __init__(self, model_name: str, snapshot: Callable[[], Mapping[str, Any]]) -> None:
        from prometheus_client import CollectorRegistry, Counter, Histogram

        self.registry = CollectorRegistry()
        self.registry.register(_EngineCollector(snapshot, model_name))
        self._label = model_name
        kw: dict[str, Any] = {"labelnames": ["model_name"], "registry": self.registry}
        self.ttft = Histogram("pagedcore:time_to_first_token_seconds",
                              "Seconds from admission to the first generated token.",
                              buckets=_LATENCY_BUCKETS, **kw).labels(model_name)
        self.tpot = Histogram("pagedcore:time_per_output_token_seconds",
                              "Mean seconds between generated tokens after the first, per "
                              "request.", buckets=_TPOT_BUCKETS, **kw).labels(model_name)
        self.e2e = Histogram("pagedcore:e2e_request_latency_seconds",
                             "Seconds from admission to the last token.",
                             buckets=_LATENCY_BUCKETS, **kw).labels(model_name)
        self.prompt_tokens = Counter("pagedcore:prompt_tokens", "Prompt tokens admitted.",
                                     **kw).labels(model_name)
        self.generation_tokens = Counter("pagedcore:generation_tokens",
                                         "Tokens generated.", **kw).labels(model_name)
        self._success = Counter("pagedcore:request_success", "Finished requests by reason.",
                                labelnames=["model_name", "finished_reason"],
                                registry=self.registry)
        self._refused = Counter("pagedcore:request_refused",
                                "Requests refused by admission control.", **kw).labels(model_name)

    def finished(self, reason: str) -> None:
        """Count a request that finished with `reason` ("stop", "length", "abort", "error")."""
        self._success.labels(self._label, reason).inc()

    def refused(self) -> None:
        """Count a request refused because the queue was full."""
        self._refused.inc()

    def render(self) -> tuple[bytes, str]:
        """The metrics in Prometheus text format, and its content type."""
        from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

        return generate_latest(self.registry), CONTENT_TYPE_LATEST
