"""Prometheus metrics of the server: engine state read at scrape time, request latencies observed
when each request finishes.

They live where the engine runs (its process under `atlas serve`, which every front end asks at scrape
time: one set of figures however many front ends there are). Names follow Prometheus conventions with an
`atlas_` prefix. Each engine has its own registry, so several servers in one process (tests) do not collide.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric

from atlas.engine.data_parallel import metric_labels
from atlas.outputs import BucketCounts, RequestOutput

LATENCY_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
                   10.0, 20.0, 40.0, 80.0)
TOKEN_BUCKETS = (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000, 20000, 50000, 100000)
TPOT_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.015, 0.02, 0.025, 0.03, 0.04, 0.05, 0.075, 0.1, 0.15, 0.2,
                0.3, 0.4, 0.5, 0.75, 1.0, 2.5)


class EngineCollector:
    """Gauges and counters read from the engine at scrape time (plain attribute reads)."""

    def __init__(self, core, labels: dict[str, str], step_failures: Callable[[], int]):
        self.core = core  # an EngineCore
        self.step_failures = step_failures
        self.labels = labels  # (data_parallel.metric_labels)

    def _gauge(self, name: str, doc: str, value: float) -> GaugeMetricFamily:
        g = GaugeMetricFamily(name, doc, labels=list(self.labels))
        g.add_metric(list(self.labels.values()), value)
        return g

    def _counter(self, name: str, doc: str, value: float) -> CounterMetricFamily:
        c = CounterMetricFamily(name, doc, labels=list(self.labels))
        c.add_metric(list(self.labels.values()), value)
        return c

    def _cache_info(self, name: str, pages_label: str) -> GaugeMetricFamily:
        """The KV cache's configuration as labels of a constant 1 (vLLM's cache_config_info), for dashboards."""
        core = self.core
        info = GaugeMetricFamily(name, "KV cache configuration (labels; the value is 1).",
                                 labels=[*self.labels, "block_size", "cache_dtype", pages_label])
        info.add_metric([*self.labels.values(), str(core.config.block_size),
                         str(core.runner.kv_dtype).removeprefix("torch."), str(core.kv.num_pages)], 1.0)
        return info

    def _histogram(self, name: str, doc: str, counts: BucketCounts) -> HistogramMetricFamily:
        """A histogram the engine counts itself (BucketCounts), as Prometheus' cumulative buckets."""
        per_bucket, total = list(counts.counts), counts.sum  # (a snapshot: the engine may add meanwhile)
        cumulative, buckets = 0, []
        for bound, n in zip((*counts.bounds, float("inf")), per_bucket, strict=True):
            cumulative += n
            buckets.append(("+Inf" if bound == float("inf") else repr(float(bound)), cumulative))
        h = HistogramMetricFamily(name, doc, labels=list(self.labels))
        h.add_metric(list(self.labels.values()), buckets, sum_value=total)
        return h

    def collect(self) -> Iterator[Metric]:
        core = self.core
        kv, stats, sched = core.kv, core.stats, core.scheduler
        yield self._cache_info("atlas_cache_config_info", "num_pages")
        yield self._gauge("atlas_num_requests_running", "Sequences in the running batch.", len(sched.running))
        yield self._gauge("atlas_num_requests_waiting", "Sequences waiting to be scheduled.", len(sched.waiting))
        yield self._gauge("atlas_kv_cache_usage_ratio", "Share of KV pages in use (0 to 1; with a window pool, "
                          "the fuller of the two pools).", kv.usage)
        yield self._gauge("atlas_kv_cache_pages_total", "KV pages in the pool (the global layers' pool where the "
                          "windowed layers keep their own).", kv.num_pages)
        yield self._gauge("atlas_kv_cache_pages_free", "KV pages free (cached content included).",
                          kv.num_free_pages)
        window = getattr(kv, "window", None)
        if window is not None:  # (KV cache groups: the sliding-window layers' own pool, engine/kv_groups.py)
            yield self._gauge("atlas_kv_cache_window_pages_total", "KV pages in the sliding-window layers' pool.",
                              window.num_pages)
            yield self._gauge("atlas_kv_cache_window_pages_free", "KV pages free in the sliding-window layers' "
                              "pool (cached content included).", window.num_free_pages)
        yield self._gauge("atlas_prefix_cache_hit_rate",
                          "Prompt tokens found in the prefix cache / prompt tokens looked up.", kv.stats.hit_rate)
        yield self._counter("atlas_prefix_cache_queries", "Prompt tokens looked up in the prefix cache.",
                            kv.stats.queries)
        yield self._counter("atlas_prefix_cache_hits", "Prompt tokens found in the prefix cache.", kv.stats.hits)
        yield self._counter("atlas_prompt_tokens", "Prompt tokens computed (prefix-cache hits excluded).",
                            stats.num_prompt_tokens)
        yield self._counter("atlas_generation_tokens", "Tokens generated.", stats.num_generation_tokens)
        yield self._counter("atlas_engine_steps", "Engine steps run.", stats.num_steps)
        yield self._counter("atlas_num_preemptions", "Sequences preempted (pages ran out).", sched.num_preemptions)
        yield self._counter("atlas_fair_row_skips", "Steps a sequence skipped because its request held more than its "
                            "share of the slots while a smaller request ran (fair rows).", sched.num_fair_row_skips)
        yield self._counter("atlas_engine_step_failures", "Engine steps that raised (their requests failed).",
                            self.step_failures())
        # Speculative decoding (zero without --speculative).
        drafts, accepted, verifies = stats.spec_num_draft_tokens, stats.spec_num_accepted_tokens, stats.spec_num_verify_steps
        yield self._counter("atlas_spec_decode_num_draft_tokens", "Speculative draft tokens proposed.", drafts)
        yield self._counter("atlas_spec_decode_num_accepted_tokens", "Speculative draft tokens accepted.", accepted)
        yield self._counter("atlas_spec_decode_num_verify_steps", "Speculative verify steps.", verifies)
        yield self._gauge("atlas_spec_decode_acceptance_rate", "Accepted / proposed draft tokens.",
                          stats.spec_acceptance_rate)
        yield self._gauge("atlas_spec_decode_mean_acceptance_length",
                          "Tokens emitted per verify step (accepted drafts + 1).",
                          stats.spec_mean_acceptance_length or 0.0)
        yield self._gauge("atlas_spec_decode_draft_length",
                          "Draft tokens per request of the speculation policy's last decision (0: plain steps).",
                          stats.spec_draft_length)
        yield self._counter("atlas_spec_decode_policy_probes",
                            "Drafted steps the speculation policy ran while drafting was off, to measure acceptance.",
                            stats.spec_policy_probes)
        yield self._counter("atlas_spec_decode_policy_switches",
                            "Times the speculation policy turned drafting on or off.",
                            stats.spec_policy_switches)
        yield from self._vllm(core, kv, stats, sched, drafts, accepted, verifies)

    def _vllm(self, core, kv, stats, sched, drafts, accepted, verifies) -> Iterator[Metric]:
        """The same figures under vLLM's names, so that its dashboards and tools read Atlas too."""
        yield self._cache_info("vllm:cache_config_info", "num_gpu_blocks")
        yield self._gauge("vllm:num_requests_running", "Sequences in the running batch.", len(sched.running))
        yield self._gauge("vllm:num_requests_waiting", "Sequences waiting to be scheduled.", len(sched.waiting))
        yield self._gauge("vllm:kv_cache_usage_perc", "KV cache usage (1 = full).", kv.usage)
        yield self._gauge("vllm:gpu_cache_usage_perc", "KV cache usage (1 = full; vLLM's older name).", kv.usage)
        yield self._counter("vllm:prefix_cache_queries", "Prompt tokens looked up in the prefix cache.",
                            kv.stats.queries)
        yield self._counter("vllm:prefix_cache_hits", "Prompt tokens found in the prefix cache.", kv.stats.hits)
        yield self._counter("vllm:num_preemptions", "Sequences preempted.", sched.num_preemptions)
        yield self._counter("vllm:prompt_tokens", "Prompt tokens computed.", stats.num_prompt_tokens)
        yield self._counter("vllm:generation_tokens", "Tokens generated.", stats.num_generation_tokens)
        yield self._counter("vllm:spec_decode_num_drafts", "Speculative verify steps.", verifies)
        yield self._counter("vllm:spec_decode_num_draft_tokens", "Speculative draft tokens proposed.", drafts)
        yield self._counter("vllm:spec_decode_num_accepted_tokens", "Speculative draft tokens accepted.", accepted)
        itl = "Seconds between two outputs of a request after its first (a verify step's tokens come together)."
        yield self._histogram("vllm:inter_token_latency_seconds", itl, stats.inter_token_latency)
        yield self._histogram("vllm:time_per_output_token_seconds", itl + " vLLM's older name.",
                              stats.inter_token_latency)
        yield self._histogram("vllm:iteration_tokens_total", "Tokens computed in each engine step.", stats.step_tokens)
        if core.lora is not None:  # (vLLM's: the adapters of the running and waiting requests, as labels)
            running, waiting = core.lora_requests()
            replica = {k: v for k, v in self.labels.items() if k == "engine"}  # (vLLM's labels, and -dp's replica)
            info = GaugeMetricFamily("vllm:lora_requests_info", "LoRA adapters of the running and waiting requests "
                                     "(labels; the value is the time of the scrape).",
                                     labels=[*replica, "running_lora_adapters", "waiting_lora_adapters", "max_lora"])
            info.add_metric([*replica.values(), ",".join(running), ",".join(waiting), str(core.lora.num_slots)],
                            time.time())
            yield info


def request_figures(out: RequestOutput) -> dict[str, float | None]:
    """A finished request's latencies (seconds; None where its metrics lack a time) and token counts."""
    m = out.metrics

    def span(start: float | None, end: float | None) -> float | None:
        return max(0.0, end - start) if start is not None and end is not None else None

    decode = span(m.first_token_time, m.finished_time)
    first = len(out.outputs[0].token_ids) if out.outputs else 0
    return {"ttft": span(m.arrival_time, m.first_token_time), "e2e": span(m.arrival_time, m.finished_time),
            "tpot": decode / (first - 1) if decode is not None and first > 1 else None,
            "queue": span(m.arrival_time, m.first_scheduled_time),
            "handover": span(m.arrival_time, m.received_time),
            "prefill": span(m.first_scheduled_time, m.first_token_time), "decode": decode,
            "inference": span(m.first_scheduled_time, m.finished_time),
            "prompt_tokens": len(out.prompt_token_ids),
            "generation_tokens": sum(len(c.token_ids) for c in out.outputs),
            "max_generation_tokens": max((len(c.token_ids) for c in out.outputs), default=0)}


class EngineMetrics:
    """The registry behind GET /metrics."""

    def __init__(self, core, model_name: str, step_failures: Callable[[], int], replica: int | None = None):
        """replica: this engine's index under --data-parallel-size (an `engine` label on every metric)."""
        self.registry = CollectorRegistry()
        labels = metric_labels(model_name, replica)
        self.registry.register(EngineCollector(core, labels, step_failures))
        self.label_values = list(labels.values())

        def hist(name: str, doc: str, buckets: tuple[float, ...]) -> Histogram:
            return Histogram(name, doc, list(labels), buckets=buckets, registry=self.registry).labels(*labels.values())

        self.finished = [Counter(name, "Requests finished, by finish reason.", [*labels, "finished_reason"],
                                 registry=self.registry) for name in ("atlas_request_success", "vllm:request_success")]
        # Each figure of a finished request (request_figures) -> its histograms: Atlas's names, then vLLM's (with
        # its per-phase ones: queue, prefill, decode, inference, tokens per request).
        self.histograms: dict[str, list] = {
            "ttft": [hist("atlas_time_to_first_token_seconds", "Time to first token.", LATENCY_BUCKETS),
                     hist("vllm:time_to_first_token_seconds", "Time to first token.", LATENCY_BUCKETS)],
            "tpot": [hist("atlas_time_per_output_token_seconds", "Time per output token after the first.",
                          TPOT_BUCKETS),
                     hist("vllm:request_time_per_output_token_seconds", "Mean time per output token of each request.",
                          TPOT_BUCKETS)],
            "e2e": [hist("atlas_e2e_request_latency_seconds", "End-to-end request latency.", LATENCY_BUCKETS),
                    hist("vllm:e2e_request_latency_seconds", "End-to-end request latency.", LATENCY_BUCKETS)],
            "queue": [hist("vllm:request_queue_time_seconds", "Time from arrival to the first step.", LATENCY_BUCKETS)],
            "handover": [hist("atlas_request_handover_seconds", "Time from arrival (the front end's stamp) to the "
                              "engine core taking the request in (part of the queue time).", LATENCY_BUCKETS)],
            "prefill": [hist("vllm:request_prefill_time_seconds", "Time from the first step to the first token.",
                             LATENCY_BUCKETS)],
            "decode": [hist("vllm:request_decode_time_seconds", "Time from the first token to the last.",
                            LATENCY_BUCKETS)],
            "inference": [hist("vllm:request_inference_time_seconds", "Time from the first step to the last token.",
                               LATENCY_BUCKETS)],
            "prompt_tokens": [hist("vllm:request_prompt_tokens", "Prompt tokens of each request.", TOKEN_BUCKETS)],
            "generation_tokens": [hist("vllm:request_generation_tokens", "Tokens generated for each request.",
                                       TOKEN_BUCKETS)],
            "max_generation_tokens": [hist("vllm:request_max_num_generation_tokens",
                                           "Tokens of each request's longest sequence (n > 1: its longest choice).",
                                           TOKEN_BUCKETS)],
        }

    def on_finished(self, out: RequestOutput) -> None:
        """Called where the engine runs with each finished request."""
        for c in out.outputs:
            for counter in self.finished:
                counter.labels(*self.label_values, c.finish_reason or "unknown").inc()
        if out.metrics is None:
            return
        for name, value in request_figures(out).items():
            if value is not None:
                for histogram in self.histograms[name]:
                    histogram.observe(value)

    def render(self) -> bytes:
        return generate_latest(self.registry)
