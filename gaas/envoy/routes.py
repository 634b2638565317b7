"""Routes and their retries: what is tried again on another replica (only what never reached one),
how a sidecar marks its own answers for a service it could not reach, and the span name a traced
request gets on each route."""

from __future__ import annotations

from gaas.contracts.headers import UNREACHED_HEADER

# A request that never reached an instance (no connection, a refused stream, a reset before the
# request was sent) is tried on another replica; one that may have started work never is.
RETRY_UNREACHED = {
    "retry_on": "connect-failure,refused-stream,reset-before-request",
    "num_retries": 2,
    "retry_host_predicate": [{
        "name": "envoy.retry_host_predicates.previous_hosts",
        "typed_config": {"@type": "type.googleapis.com/envoy.extensions.retry.host.previous_hosts.v3.PreviousHostsPredicate"},
    }],
    "host_selection_retry_max_attempts": 5,
}

# A sidecar's own answer when its service could not be reached or died before answering (Envoy's
# response flags: UF connection failure, UC connection terminated, UH no healthy upstream) carries
# UNREACHED_HEADER, so the hop before it knows nothing was served and may try another replica.
UNREACHED_FLAGS = ["UF", "UC", "UH"]

# At the ingress, a router that dies before answering anything (no response header yet: no token
# was streamed) is retried on another router too, whether the ingress saw the reset itself or the
# router's sidecar answered for it (UNREACHED_HEADER). That is safe for what routers serve: a
# generation cut before its end records no usage, and the worker's stream ends with the router's.
RETRY_BEFORE_RESPONSE = {
    **RETRY_UNREACHED,
    "retry_on": "connect-failure,refused-stream,reset,retriable-headers",
    "retriable_headers": [{"name": UNREACHED_HEADER, "present_match": True}],
}


def unreached_replies() -> dict:
    """local_reply_config of a sidecar's inbound listener: mark its answers for a service it could
    not reach (UNREACHED_HEADER)."""
    return {"mappers": [{
        "filter": {"response_flag_filter": {"flags": UNREACHED_FLAGS}},
        "headers_to_add": [{"header": {"key": UNREACHED_HEADER, "value": "1"},
                            "append_action": "OVERWRITE_IF_EXISTS_OR_ADD"}],
    }]}


def decorator(operation: str) -> dict:
    """Names the span a traced request gets on this route (not passed on as a header)."""
    return {"decorator": {"operation": operation, "propagate": False}}


def grpc_route(prefix: str, cluster: str, *, retry: dict | None = None, operation: str = "", **match_extra) -> dict:
    """gRPC requests whose path starts with prefix, to cluster, retried by retry when given."""
    # timeout 0: no route timeout, generations stream as long as they need.
    route = {"cluster": cluster, "timeout": "0s"}
    if retry:
        route["retry_policy"] = retry
    return {"match": {"prefix": prefix, "grpc": {}, **match_extra}, "route": route,
            **(decorator(operation) if operation else {})}


# The ingress's own calls to a router (the key check, the direct path's decision): one that found
# no router, or a router gone (its connection refused or reset before any answer), is tried again
# on another: one router's death costs no request.
ROUTER_CALL_RETRY = {"retry_on": "connect-failure,refused-stream,reset,unavailable", "num_retries": 2}
