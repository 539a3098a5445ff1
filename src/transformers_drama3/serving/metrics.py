"""Prometheus text metrics of the speech server (exposition format 0.0.4), without a client library.

    drama3_requests_total{outcome="eos"|"length"|"cancelled"|"timeout"|"error"|"rejected"}
    drama3_queue_depth, drama3_running_requests, drama3_batch_slots
    drama3_batch_occupancy        mean running requests per decode step so far
    drama3_prefix_cache_hits_total, drama3_prefix_cache_misses_total (with the voice-prefix cache)
    drama3_time_to_first_audio_seconds   histogram
    drama3_real_time_factor              histogram (generation seconds / audio seconds)
"""

from __future__ import annotations

import bisect
import threading

TTFA_BUCKETS = (0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)
RTF_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.0, 4.0)


class Histogram:
    """Cumulative buckets, sum and count of observations."""

    def __init__(self, buckets):
        self.buckets = tuple(buckets)
        self.counts = [0] * (len(self.buckets) + 1)
        self.total = 0.0

    def observe(self, value: float) -> None:
        self.counts[bisect.bisect_left(self.buckets, value)] += 1
        self.total += value

    def lines(self, name: str) -> list[str]:
        out, running = [], 0
        for bound, count in zip((*self.buckets, float("inf")), self.counts):
            running += count
            label = "+Inf" if bound == float("inf") else repr(bound)
            out.append(f'{name}_bucket{{le="{label}"}} {running}')
        out += [f"{name}_sum {self.total}", f"{name}_count {running}"]
        return out


class ServerMetrics:
    """What `/metrics` reports; `engine` gives the live gauges."""

    OUTCOMES = ("eos", "length", "cancelled", "timeout", "error", "rejected")

    def __init__(self):
        self.outcomes = dict.fromkeys(self.OUTCOMES, 0)
        self.time_to_first_audio = Histogram(TTFA_BUCKETS)
        self.real_time_factor = Histogram(RTF_BUCKETS)
        self.prefix_cache = None  # a `PrefixCache`, when the server has one
        self._lock = threading.Lock()

    def count(self, outcome: str) -> None:
        with self._lock:
            self.outcomes[outcome] = self.outcomes.get(outcome, 0) + 1

    def observe_first_audio(self, seconds: float) -> None:
        with self._lock:
            self.time_to_first_audio.observe(seconds)

    def observe_real_time_factor(self, factor: float) -> None:
        with self._lock:
            self.real_time_factor.observe(factor)

    def render(self, engine) -> str:
        with self._lock:
            stats = engine.stats if engine is not None else None
            occupancy = stats.occupied / stats.steps if stats is not None and stats.steps else 0.0
            lines = ["# HELP drama3_requests_total Speech requests by outcome.", "# TYPE drama3_requests_total counter"]
            lines += [f'drama3_requests_total{{outcome="{name}"}} {value}' for name, value in self.outcomes.items()]
            gauges = {
                "drama3_queue_depth": (engine.queue_depth if engine else 0, "Requests waiting for a slot."),
                "drama3_running_requests": (engine.running if engine else 0, "Requests in the running batch."),
                "drama3_batch_slots": (engine.max_batch if engine else 0, "Slots of the running batch."),
                "drama3_batch_occupancy": (occupancy, "Mean running requests per decode step."),
                "drama3_decode_steps_total": (stats.steps if stats else 0, "Decode steps run."),
            }
            if self.prefix_cache is not None:
                gauges["drama3_prefix_cache_hits_total"] = (self.prefix_cache.hits, "Prefills that reused a voice prefix.")
                gauges["drama3_prefix_cache_misses_total"] = (self.prefix_cache.misses, "Voice prefixes prefilled anew.")
            for name, (value, help_text) in gauges.items():
                kind = "counter" if name.endswith("_total") else "gauge"
                lines += [f"# HELP {name} {help_text}", f"# TYPE {name} {kind}", f"{name} {value}"]
            for name, histogram, help_text in (
                ("drama3_time_to_first_audio_seconds", self.time_to_first_audio, "Seconds from request to first audio."),
                ("drama3_real_time_factor", self.real_time_factor, "Generation seconds per second of audio."),
            ):
                lines += [f"# HELP {name} {help_text}", f"# TYPE {name} histogram", *histogram.lines(name)]
        return "\n".join(lines) + "\n"
