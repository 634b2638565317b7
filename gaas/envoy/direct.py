"""The direct path (ingress.path: direct): the ingress asks a router where each generation goes
(Envoy's external processing; services/router/extproc.py) and streams it from the worker the router
named, the router out of the token stream: both OpenAI routes and the native API's Generate.
Session turns and prompt lists go through the router either way."""

from __future__ import annotations

from gaas.envoy.clusters import WORKERS_CLUSTER
from gaas.envoy.routes import RETRY_BEFORE_RESPONSE, ROUTER_CALL_RETRY, UNREACHED_HEADER, decorator, grpc_route
from gaas.contracts.services import DIRECT_GENERATION, OPENAI_DIRECT_HTTP
from gaas.runtime.context import WORKER_HEADER

# The router's decision, twice in the ingress's filters: before the transcoder for the OpenAI routes'
# HTTP requests (their JSON bodies; the key checked on their headers before anything reads the
# body), and after it for the native API's Generate, gRPC or transcoded from JSON.
TRANSCODER = "envoy.filters.http.grpc_json_transcoder"
EXT_PROC_FILTER = "envoy.filters.http.ext_proc"
OPENAI_DECISION_FILTER = "gaas.decision.openai"
EXT_PROC_PER_ROUTE = "type.googleapis.com/envoy.extensions.filters.http.ext_proc.v3.ExtProcPerRoute"
# How long the router may take to decide (a request may wait in its queue for a worker's room
# that long; its tier's deadline ends the wait first).
DECISION_TIMEOUT = "300s"


def ext_proc(name: str = EXT_PROC_FILTER) -> dict:
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
    undecided (only a router sets x-gaas-worker). name: OPENAI_DECISION_FILTER's call, which is
    made as the request's body arrives, does not fail open (its body went to the call): its failure
    to reach a router is answered router_unavailable (gaas.envoy.errors)."""
    return {
        "name": name,
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
            # (The OpenAI routes' HTTP requests are asked about as their body arrives, which then
            # cannot go on without the call: its failure is answered 503, gaas.envoy.errors.)
            "failure_mode_allow": name == EXT_PROC_FILTER,
        },
    }


def ext_proc_disabled(*names: str) -> dict:
    """A route's typed_per_filter_config that keeps the router's decision (those ext_proc filters,
    both by default) off it."""
    return {name: {"@type": EXT_PROC_PER_ROUTE, "disabled": True} for name in names or (EXT_PROC_FILTER,
                                                                                         OPENAI_DECISION_FILTER)}


def openai_http_routes(descriptor_set_limit: dict) -> list[dict]:
    """The OpenAI generation routes as their HTTP requests arrive (POST /v1/completions, POST
    /v1/chat/completions), before the transcoder: the router's decision is asked here (the key
    checked on the headers, the JSON body read as it comes), then the transcoder turns the
    decision's body into the gRPC request to the worker named and the route is chosen again by the
    gRPC path. A request the transcoder did not turn (none should) is not found: nothing reaches a
    router or a worker from here unchecked. descriptor_set_limit: the transcoder's config here, its
    limit the decision's body (the client's and what the router adds: the prompts' token ids, a
    session's context)."""
    return [{
        "match": {"path": path, "headers": [{"name": ":method", "string_match": {"exact": "POST"}}]},
        "direct_response": {"status": 404},
        "typed_per_filter_config": {TRANSCODER: descriptor_set_limit},
        **decorator("ingress, asking a router"),
    } for path in OPENAI_DIRECT_HTTP]


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
