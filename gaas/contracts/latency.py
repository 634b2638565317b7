"""The latency decomposition of a request, completed by the router on its last chunk:

    total = tenant + router + queue + prefill + decode + net

The worker measured its part (its engine's queue, its time to the first token and to the last);
the router measured the rest: the tenant's admission (authentication, quota, budget) and its usage
event's writing before the last chunk is released (add_tenant), its wait in
the router's queue, the whole worker call as it saw it, and the ingress's stamp of the request's
arrival. What the router saw of the call less what the worker measured is the network (both
sidecars, both ways); the router's time less the tenant's, the queue's and the call's is the
router's own work. So the parts add up to the total by construction, each measured where it
happens. Parts and order: PARTS (also the router's histograms' `part` label, the OpenAI routes'
usage.gaas_latency_ms and `gaas generate --explain`).
"""

from __future__ import annotations

from collections.abc import Mapping

from gaas.contracts.headers import INGRESS_START_HEADER
from gaas.v1 import common_pb2

PARTS = ("tenant", "router", "queue", "prefill", "decode", "net")
# What each part is, for people.
MEANING = {
    "tenant": "authentication, quota and budget admission, the usage event",
    "router": "the router's own work: tokenizing, the KV lookup, picking a worker",
    "queue": "waiting: in the router's queue and in the engine's scheduler",
    "prefill": "the worker's arrival, less the engine's queue, to the first token",
    "decode": "first token to last token",
    "net": "the hops: ingress to router, router to worker and back, Envoys included",
}

# A stamp further back than this (or ahead) is not believed: clocks of another host, a replay.
MAX_INGRESS_SECONDS = 60.0


def ingress_seconds(metadata: Mapping[str, str], arrived_wall: float) -> float:
    """Seconds from the ingress's arrival stamp to the router's arrival (wall clock); 0 without a
    believable stamp."""
    raw = metadata.get(INGRESS_START_HEADER, "")
    try:
        s = arrived_wall - float(raw)
    except ValueError:
        return 0.0
    return s if 0.0 <= s <= MAX_INGRESS_SECONDS else 0.0


def complete(
    t: common_pb2.Timings, *, total_s: float, tenant_s: float, router_queue_s: float, call_s: float, ingress_s: float,
) -> None:
    """Fill t's decomposition from the worker's fields (queue_ms: the engine's queue; ttft_ms,
    engine_ms) and what the router measured:
      total_s         router arrival to last token
      tenant_s        admission (authentication, quota, budget)
      router_queue_s  waiting in the router's queue
      call_s          the worker call as the router saw it, sent to last chunk
      ingress_s       ingress arrival to router arrival."""
    engine = worker_parts(t, router_queue_s * 1000)
    call_ms = max(call_s * 1000, engine)
    t.tenant_ms = tenant_s * 1000
    t.ingress_ms = ingress_s * 1000
    t.net_ms = t.ingress_ms + (call_ms - engine)
    t.router_ms = max(0.0, total_s * 1000 - t.tenant_ms - t.router_queue_ms - call_ms)
    t.total_ms = sum(part_ms(t, p) for p in PARTS)


def worker_parts(t: common_pb2.Timings, router_queue_ms: float) -> float:
    """Fill the parts the worker measured (from its queue_ms, ttft_ms and engine_ms: the engine's
    queue, its first token and its last) with the router's queue added to the queue; returns the
    engine's whole time (ms) as the parts count it."""
    engine_queue = max(0.0, t.queue_ms)
    ttft = max(t.ttft_ms, engine_queue)
    engine = max(t.engine_ms, ttft)
    t.router_queue_ms = router_queue_ms
    t.queue_ms = router_queue_ms + engine_queue
    t.prefill_ms = ttft - engine_queue
    t.decode_ms = engine - ttft
    return engine


def add_tenant(t: common_pb2.Timings, seconds: float) -> None:
    """More of the tenant's time after the last token (writing its usage event before the last
    chunk is released): part of the request, so of the total too, but not of its first token."""
    t.tenant_ms += seconds * 1000
    t.usage_ms += seconds * 1000
    t.total_ms += seconds * 1000


def first_token_ms(t: common_pb2.Timings) -> float:
    """From the request's arrival (the ingress's, else the router's) to its first token: the total
    less the decode and the usage event's writing after the last token."""
    return max(0.0, t.total_ms - t.decode_ms - t.usage_ms)


def part_ms(t: common_pb2.Timings, part: str) -> float:
    return getattr(t, f"{part}_ms")


def as_dict(t: common_pb2.Timings) -> dict[str, float]:
    """The decomposition as the OpenAI routes return it (usage.gaas_latency_ms): the parts, their
    total and the time to the first token."""
    return {**{p: round(part_ms(t, p), 3) for p in PARTS}, "total": round(t.total_ms, 3),
            "ttft": round(first_token_ms(t), 3)}
