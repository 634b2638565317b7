"""The direct path's contract (topology: ingress.path: direct), one definition for both ends: the
router decides a generation at the ingress (services/router/extproc.py) and the ingress sends a
gaas.v1.DirectGenerate straight to the chosen worker (services/worker/direct.py), which formats
and meters the answer and reports its end to that router (report_channel)."""

from __future__ import annotations

import base64

from google.protobuf.message import DecodeError

from gaas.contracts import latency, pricing
from gaas.metering.meter import Metered
from gaas.contracts.principal import Principal
from gaas.v1 import common_pb2, worker_pb2

# The content type of the HttpBody that carries a DirectGenerate.
CONTENT_TYPE = "application/x-gaas-direct"
# How a direct generation's end reaches the router that decided it, which is out of the stream
# once it has decided (its ext_proc call ends there): the worker publishes a report of every end
# on the router's Redis channel: its final chunk without the text (usage, finish reason, the
# latency decomposition) as soon as the usage event is written, or the failure (a gRPC status
# code, and whether the worker refused it untaken: the ingress then tries the router's second
# choice), or the client gone; the router records the request as it records its own (metrics,
# windows, breakers). A request no report ends (its worker died, or none got it) the router finds
# from the worker's progress (gaas.metering.admission): services/router/extproc.py. A worker
# publishes a report until a subscriber has it, for REPORT_SECONDS at most.
REPORT_SECONDS = 30.0


def report_channel(router: str) -> str:
    """The Redis channel of the router instance's reports."""
    return f"gaas:direct:{router}:ended"


def router_ms(d: worker_pb2.DirectGenerate) -> float:
    """Everything before the router's answer: the ingress's hop to it, the tenant's admission, the
    router's own work and its queue."""
    return d.ingress_ms + d.tenant_ms + d.router_ms + d.router_queue_ms


def metered(d: worker_pb2.DirectGenerate, arrived: float) -> Metered:
    """The usage record of a direct generation, as the router admitted it. arrived: the
    request's arrival at the ingress, on this process's perf_counter clock."""
    m = d.metering
    principal = Principal(tenant=m.tenant, tier=m.tier, key_id=m.key_id,
                          cache_salt=d.prompts[0].cache_salt if d.prompts else "")
    price = pricing.Price(input=m.price_input, cached_input=m.price_cached_input, output=m.price_output)
    out = Metered(d.request_id, principal, m.model, m.model_version, price, max(1, len(d.prompts)),
                  m.client_request_id, arrived, prompt_tokens=m.prompt_tokens, session_id=d.session.session_id)
    out.admitted = m.admitted
    out.adapter = m.adapter
    return out


def arrived_at(d: worker_pb2.DirectGenerate, worker_arrived: float, worker_arrived_unix: float) -> float:
    """The request's arrival at the ingress on this process's perf_counter clock."""
    return worker_arrived - router_ms(d) / 1000 - in_flight_s(d, worker_arrived_unix)


def in_flight_s(d: worker_pb2.DirectGenerate, worker_arrived_unix: float) -> float:
    """From the router's answer to the worker's arrival (the ingress and both Envoys on the way)."""
    return max(0.0, worker_arrived_unix - d.decided_unix) if d.decided_unix else 0.0


def complete(t: common_pb2.Timings, d: worker_pb2.DirectGenerate, worker_arrived_unix: float) -> None:
    """The latency decomposition of a direct generation (gaas.contracts.latency's parts): the router's parts
    as it measured them, the worker's own (t: queue_ms, ttft_ms and engine_ms as the engine
    measured them), and the network: the ingress's hop to the router and from the router's answer
    to the worker. (The way back to the ingress is not measured here.)"""
    latency.worker_parts(t, d.router_queue_ms)
    t.tenant_ms = d.tenant_ms
    t.router_ms = d.router_ms
    t.ingress_ms = d.ingress_ms
    t.net_ms = d.ingress_ms + in_flight_s(d, worker_arrived_unix) * 1000
    t.total_ms = sum(latency.part_ms(t, p) for p in latency.PARTS)


def failure(request_id: str, worker_id: str, code: str, detail: str = "", untaken: bool = False) -> str:
    """The report of a request that ended otherwise than served: its gRPC status code's name
    (CANCELLED: its client went away), and whether the worker refused it untaken."""
    out = worker_pb2.DirectReport(code=code, detail=detail[:200], untaken=untaken)
    out.final.request_id, out.final.worker_id = request_id, worker_id
    return base64.b64encode(out.SerializeToString()).decode()


def report(final: common_pb2.GenerateChunk, finals: list[common_pb2.GenerateChunk] = (),
           session_reply: str = "", committed_ms: int = 0, request_id: str = "") -> str:
    """The report of a request's end (base64: Redis clients here decode text): its final chunk
    without the text, under the request's id (request_id; a prompt list's final chunks carry
    their own engine requests'), its usage the sum of every prompt's (finals: each prompt's final
    chunk, for a prompt list), and a committed session turn's reply."""
    out = worker_pb2.DirectReport(session_reply=session_reply, session_committed_ms=committed_ms)
    out.final.CopyFrom(final)
    if request_id:
        out.final.request_id = request_id
    for name in ("text", "token_ids", "logprobs"):
        out.final.ClearField(name)
    if len(finals) > 1:
        u = out.final.usage
        u.prompt_tokens = sum(c.usage.prompt_tokens for c in finals)
        u.cached_tokens = sum(c.usage.cached_tokens for c in finals)
        u.completion_tokens = sum(c.usage.completion_tokens for c in finals)
    return base64.b64encode(out.SerializeToString()).decode()


def read_report(value: str) -> worker_pb2.DirectReport | None:
    """A report of a request's end; None if unreadable."""
    try:
        raw = base64.b64decode(value + "=" * (-len(value) % 4))
        return worker_pb2.DirectReport.FromString(raw)
    except (ValueError, DecodeError):
        return None
