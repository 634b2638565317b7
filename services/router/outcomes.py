"""What the router records of each generation's outcome, whichever path served it: requests by
model, tier and outcome, their tokens by kind, TTFT and time per output token, the latency
decomposition by part, the KV directory's predictions the engines did not bear out, and, for a
model under a roll-out or autoscaled, each request's outcome by version for the control plane's
SLO guard and autoscaler."""

from __future__ import annotations

import asyncio
import json
import logging
import time
from dataclasses import dataclass

from prometheus_client import Counter, Histogram

from gaas.contracts import latency
from gaas.contracts.ids import WorkerId
from gaas.contracts.rollout import OUTCOMES_KEPT, OUTCOMES_STREAM, Outcome
from gaas.v1 import common_pb2

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class RouterMetrics:
    """What the router's stages record, when the server gives it a registry."""

    # Requests sent, by policy and worker.
    routed: Counter | None = None
    # Engines serving fewer cached tokens than the directory said they held.
    prediction_misses: Counter | None = None
    lookup_seconds: Histogram | None = None
    # The latency decomposition of every request, by part (gaas.contracts.latency) and tier.
    latency_seconds: Histogram | None = None
    # Requests by model, tier and outcome (a finish reason: stop, length...; a status: UNAVAILABLE...;
    # or cancelled), and their tokens by kind (prompt, completion, cached): cached / prompt is the
    # prefix cache's hit ratio.
    requests: Counter | None = None
    tokens: Counter | None = None
    # The ingress's arrival to the first token, and the time per output token after it.
    ttft_seconds: Histogram | None = None
    tpot_seconds: Histogram | None = None
    # Streams carried on by another worker after theirs failed mid-stream, by model and outcome
    # (moved, or failed: no worker could), and the prefill the new workers recomputed (the
    # mesh's cost, not billed).
    moves: Counter | None = None
    moved_prefill_tokens: Counter | None = None


class RolloutReporter:
    """The outcomes of requests of models under a roll-out, appended to the stream the control
    plane's guard reads (gaas.contracts.rollout.OUTCOMES_STREAM), in one entry every flush_seconds.
    Redis away: what it could not write is dropped (the guard judges on what it gets; nothing is
    billed from it), and said once."""

    def __init__(self, redis, flush_seconds: float = 0.25, max_buffered: int = 20_000) -> None:
        self._redis = redis
        self._flush_seconds = flush_seconds
        self._max = max_buffered
        self._buffer: list[list] = []
        self._failing = False

    def add(self, o: Outcome) -> None:
        if len(self._buffer) < self._max:
            self._buffer.append(o.encode())

    async def flush(self) -> None:
        if not self._buffer:
            return
        batch, self._buffer = self._buffer, []
        try:
            await self._redis.xadd(OUTCOMES_STREAM, {"o": json.dumps(batch, separators=(",", ":"))},
                                   maxlen=OUTCOMES_KEPT, approximate=True)
            if self._failing:
                log.info("roll-out outcomes reach Redis again")
            self._failing = False
        except Exception as exc:  # Redis away: the guard gets the next ones
            if not self._failing:
                log.warning("cannot report roll-out outcomes (%s); %d dropped", exc, len(batch))
            self._failing = True

    async def run(self) -> None:
        """Flush until cancelled (the router's server owns it)."""
        while True:
            await asyncio.sleep(self._flush_seconds)
            await self.flush()


class Outcomes:
    def __init__(self, metrics: RouterMetrics, reporter: RolloutReporter | None = None) -> None:
        self._metrics = metrics
        self._reporter = reporter
        self._last_miss_log = 0.0

    def rollout(self, model, tier: str, ok: bool, ttft_ms: float | None = None, output_tokens: int = 0,
                decode_s: float = 0.0, shadow: bool = False) -> None:
        """A request of model (services/router/directory.ModelEntry, at the version that served it)
        ended: its outcome for the guard, while a roll-out of the model is under way, and for the
        autoscaler of an autoscaled model."""
        if self._reporter is None or not (model.rolling_out or model.autoscaled):
            return
        self._reporter.add(Outcome(at=time.time(), version=model.version, tier=tier, ok=ok, ttft_ms=ttft_ms,
                                   output_tokens=output_tokens, decode_s=decode_s, model=model.name, shadow=shadow))

    def check_prediction(self, worker: WorkerId, confirmed: int, block_size: int, cached_tokens: int) -> None:
        """The directory said the worker's engine holds `confirmed` leading blocks; the engine
        served fewer from its cache. Now and then an eviction in between; always, a disagreement
        between the router's hashes and the engine's blocks: counted, and logged."""
        if confirmed < 2 or cached_tokens >= (confirmed - 1) * block_size:
            return
        if self._metrics.prediction_misses is not None:
            self._metrics.prediction_misses.inc()
        now = time.monotonic()
        if now - self._last_miss_log > 30:
            self._last_miss_log = now
            log.warning(
                "the KV directory said %s holds %d blocks of this prompt, but its engine served %d tokens from cache "
                "(an eviction in between, or hashes that disagree: see `gaas kv stats`)",
                worker, confirmed, cached_tokens,
            )

    def observe_latency(self, t: common_pb2.Timings, tier: str) -> None:
        """Record a request's latency decomposition once it is complete (after metering: the
        servicers call this on the last chunk they release)."""
        h = self._metrics.latency_seconds
        if h is None:
            return
        for part in latency.PARTS:
            h.labels(part, tier).observe(latency.part_ms(t, part) / 1000)
        h.labels("total", tier).observe(t.total_ms / 1000)

    def count(self, labels: tuple[str, str], u: common_pb2.Usage, decode_s: float | None) -> int:
        """Count a finished request's tokens by kind, and its time per output token from decode_s
        (first token to last; None: unknown). Returns its tokens, prompt and completion."""
        m = self._metrics
        if m.tokens is not None:
            m.tokens.labels(*labels, "prompt").inc(u.prompt_tokens)
            m.tokens.labels(*labels, "completion").inc(u.completion_tokens)
            m.tokens.labels(*labels, "cached").inc(u.cached_tokens)
        if m.tpot_seconds is not None and decode_s is not None and u.completion_tokens > 1:
            m.tpot_seconds.labels(*labels).observe(decode_s / (u.completion_tokens - 1))
        return u.prompt_tokens + u.completion_tokens
