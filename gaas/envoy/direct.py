"""The direct path (ingress.path: direct): the ingress asks a router where each generation goes
(Envoy's external processing; services/router/extproc.py) and streams it from the worker the router
named, the router out of the token stream: both OpenAI routes and the native API's Generate.
Session turns and prompt lists go through the router either way."""

from __future__ import annotations

from gaas.envoy.clusters import WORKERS_CLUSTER
from gaas.envoy.routes import RETRY_BEFORE_RESPONSE, ROUTER_CALL_RETRY, UNREACHED_HEADER, decorator, grpc_route
from gaas.contracts.services import DIRECT_GENERATION
from gaas.runtime.context import WORKER_HEADER

EXT_PROC_FILTER = "envoy.filters.http.ext_proc"
EXT_PROC_PER_ROUTE = "type.googleapis.com/envoy.extensions.filters.http.ext_proc.v3.ExtProcPerRoute"
# How long the router may take to decide (a request may wait in its queue for a worker's room
# that long; its tier's deadline ends the wait first).
DECISION_TIMEOUT = "300s"


def ext_proc() -> dict:
    """The ingress asks a router where each generation goes (ingress.path: direct;
    services/router/extproc.py): the request's headers and whole body go to the router, which
    answers with the worker (x-gaas-worker) and the body to send it, and ends the call there: it
    hears how the request ended from the worker's report. Nothing of the response passes through
    it, the tokens nor the trailers.

    A decision call that fails (its router died, or none answers) lets the request go on
    (failure_mode_allow): one decided streams on from its worker, without the router; one not yet
    decided goes on unprocessed: without x-gaas-worker it takes the router's own route,
    which retries it on another router (gaas.envoy.routes.RETRY_BEFORE_RESPONSE) and serves it
    there, or answers router_unavailable when none is up; a request is never sent to a worker
    undecided (only a router sets x-gaas-worker)."""
    return {
        "name": EXT_PROC_FILTER,
        "typed_config": {
            "@type": "type.googleapis.com/envoy.extensions.filters.http.ext_proc.v3.ExternalProcessor",
            "grpc_service": {"envoy_grpc": {"cluster_name": "router"}, "retry_policy": ROUTER_CALL_RETRY},
            "processing_mode": {
                "request_header_mode": "SEND",
                # Headers and body go at once; the router answers both when the body is whole.
                "request_body_mode": "FULL_DUPLEX_STREAMED",
                "request_trailer_mode": "SEND",  # (Envoy requires it with full-duplex bodies)
                "response_header_mode": "SKIP",
                "response_body_mode": "NONE",
                # Not even the trailers: a call still open when its router dies cuts the stream
                # (failure_mode_allow notwithstanding); the router hears of the end from the worker.
                "response_trailer_mode": "SKIP",
            },
            "message_timeout": DECISION_TIMEOUT,
            "failure_mode_allow": True,
        },
    }


def ext_proc_disabled() -> dict:
    """A route's typed_per_filter_config that keeps the router's decision (ext_proc) off it."""
    return {EXT_PROC_FILTER: {"@type": EXT_PROC_PER_ROUTE, "disabled": True}}


# On the direct path, a generation that never reached its worker (no connection, a refused or
# reset stream before any answer, the worker's sidecar answering for a dead worker, the worker
# refusing what it did not start: busy, or without its engine; UNREACHED_HEADER on both) goes to
# the router's second choice, named after the first in x-gaas-worker; never one that may have
# streamed a token (nothing has answered yet), nor one whose worker failed it after doing it (a
# non-streamed answer that could not be finished: its status alone would not say).
RETRY_ON_FALLBACK = {
    "retry_on": "connect-failure,refused-stream,reset,retriable-headers",
    "retriable_headers": [{"name": UNREACHED_HEADER, "present_match": True}],
    "num_retries": 1,
}
# The request a retry resends is held until then (a larger one is not retried).
DIRECT_RETRY_BUFFER = 16 << 20



def direct_routes() -> list[dict]:
    """Each generation method twice: to the workers the router named (x-gaas-worker, set by the
    router's decision, whose answer makes Envoy route the request again: its pick, then its
    second choice should the first not take it), and to the router (the decision passed it on:
    a session turn, a batch of prompts)."""
    out = []
    for path in DIRECT_GENERATION:
        out.append({
            "match": {"path": path, "grpc": {},
                      "headers": [{"name": WORKER_HEADER, "present_match": True}]},
            "route": {"cluster": WORKERS_CLUSTER, "timeout": "0s", "retry_policy": RETRY_ON_FALLBACK},
            "request_body_buffer_limit": DIRECT_RETRY_BUFFER,
            **decorator("ingress to a worker"),
        })
    for path in DIRECT_GENERATION:
        out.append(grpc_route(path, "router", retry=RETRY_BEFORE_RESPONSE, operation="ingress"))
    return out
