"""Prometheus metrics of the daemon (`prometheus_client`, one registry per server, served at /metrics)."""

from __future__ import annotations

import logging

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram, generate_latest

LATENCY_BUCKETS_S = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30)
TOKEN_BUCKETS_S = (0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.25, 0.5, 1)


class Metrics:
    def __init__(self, scheduler, power=None):
        """power: the Model's PowerController (None: off): its readings and plan become gauges."""
        r = self.registry = CollectorRegistry()
        self.requests = Counter("edgeinfer_requests", "completion requests answered (endpoint chat or completions), "
                                "and requests the key, a draining server, a web page's origin or a fork turned "
                                "away (endpoint other), by status", ["endpoint", "status"], registry=r)
        self.ttft = Histogram("edgeinfer_time_to_first_token_seconds", "from request received to first token",
                              buckets=LATENCY_BUCKETS_S, registry=r)
        self.tpot = Histogram("edgeinfer_time_per_output_token_seconds", "decode time per generated token",
                              buckets=TOKEN_BUCKETS_S, registry=r)
        self.prompt_tokens = Counter("edgeinfer_prompt_tokens", "prompt tokens of finished requests", registry=r)
        self.completion_tokens = Counter("edgeinfer_completion_tokens",
                                         "tokens generated (a request cut short: those its reply had reached)", registry=r)
        self.cached_tokens = Counter("edgeinfer_prompt_cached_tokens", "prompt tokens reused from a slot's cache",
                                     registry=r)
        self.prefix_hits = Counter("edgeinfer_prefix_cache_hits", "requests that reused a cached prefix", registry=r)
        self.dropped_tokens = Counter("edgeinfer_dropped_tokens", "tokens the overflow policy dropped", registry=r)
        self.decode_tok_s = Gauge("edgeinfer_decode_tokens_per_second", "decode speed of the last finished request",
                                  registry=r)
        Gauge("edgeinfer_queue_depth", "requests waiting for a slot", registry=r).set_function(
            lambda: max(0, scheduler.waiting))
        Gauge("edgeinfer_slots_busy", "slots generating now", registry=r).set_function(lambda: scheduler.busy)
        Gauge("edgeinfer_slots_total", "slots", registry=r).set(len(scheduler.slots))
        Gauge("edgeinfer_log_lines_dropped", "log lines dropped because the log could not keep up (standard "
              "error a pipe nobody reads, a full disk: `log.BackgroundLog`)", registry=r).set_function(
            lambda: sum(getattr(h, "dropped", 0) for h in logging.getLogger("edgeinfer.server").handlers))
        if power is not None:
            self._power_gauges(power)

    def _power_gauges(self, power) -> None:
        """One gauge per reading and plan field; a reading the device lacks is NaN (absent in PromQL)."""
        r = self.registry
        nan = float("nan")

        def reading(field: str):
            return lambda: nan if power.readings is None or getattr(power.readings, field) is None \
                else float(getattr(power.readings, field))

        def plan(fn):
            return lambda: nan if power.plan is None else fn(power.plan)

        for name, field, doc in (("temperature_celsius", "temp_c", "hottest CPU/SoC temperature"),
                                 ("battery_percent", "battery_pct", "battery charge"),
                                 ("power_watts", "power_w", "the device's power draw"),
                                 ("cpu_frequency_mhz", "cpu_freq_mhz", "mean CPU frequency")):
            Gauge(f"edgeinfer_power_{name}", doc, registry=r).set_function(reading(field))
        Gauge("edgeinfer_power_on_battery", "1 when running from battery", registry=r).set_function(
            lambda: nan if power.readings is None else float(power.readings.on_battery))
        Gauge("edgeinfer_power_plan_threads", "cores the plan runs on", registry=r).set_function(
            plan(lambda p: p.threads))
        Gauge("edgeinfer_power_plan_max_tokens_per_second", "the plan's pacing cap (0: unpaced)",
              registry=r).set_function(plan(lambda p: p.max_tokens_per_s or 0.0))
        Gauge("edgeinfer_power_plan_admit_background", "1 when background requests are admitted",
              registry=r).set_function(plan(lambda p: float(p.admit_background)))
        Gauge("edgeinfer_power_plan_hot", "1 when the plan was made hot", registry=r).set_function(
            plan(lambda p: float(p.level == "hot")))
        Gauge("edgeinfer_power_paced_seconds", "seconds decoding has slept for pacing, in all", registry=r
              ).set_function(lambda: power.paced_s_total)

    def request(self, endpoint: str, status: int) -> None:
        self.requests.labels(endpoint, str(status)).inc()

    def finished(self, completion, prompt_tokens: int, cached: int, ttft_s: float | None, total_s: float) -> None:
        u, t = completion.usage, completion.timings
        if ttft_s is not None:
            self.ttft.observe(ttft_s)
        if u.completion_tokens > 1 and t.tpot_ms > 0:
            self.tpot.observe(t.tpot_ms / 1e3)
            self.decode_tok_s.set(t.decode_tok_s)
        self.prompt_tokens.inc(prompt_tokens)
        self.completion_tokens.inc(u.completion_tokens)
        self.dropped_tokens.inc(u.dropped_tokens)
        if cached:
            self.cached_tokens.inc(cached)
            self.prefix_hits.inc()

    def cut(self, completion_tokens: int) -> None:
        """A request cut short (the client left, the server stopped, a failure) after generating
        `completion_tokens`: the device did that work, so they count."""
        self.completion_tokens.inc(completion_tokens)

    def render(self) -> tuple[bytes, str]:
        return generate_latest(self.registry), CONTENT_TYPE_LATEST
