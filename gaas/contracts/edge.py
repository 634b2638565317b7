"""The limits a client meets at the edge, in one place: the ingress Envoy's (gaas/envoy/config.py
renders them), the router's (services/router) and the OpenAI surface's (gaas/openai/api.py). The
table of limits in docs/configuration.md is this module's; the two an operator may change
(GAAS_MAX_BODY_BYTES, GAAS_MAX_STREAM_SECONDS) are the router's settings (gaas/settings/router.py),
whose defaults are here.

Why each is what it is:
  - a client must send its headers within REQUEST_HEADERS_TIMEOUT_S and its whole request within
    REQUEST_TIMEOUT_S (1 MiB in a minute is 17 KB/s), so connections that trickle cost a slot for
    seconds, not for ever;
  - the API key is checked on the headers, before any body is read (the ingress's external
    authorization, services/router/edgeauth.py); a client that sends unknown keys is slowed per
    address (FAILED_AUTH_*), and checks have a budget of their own (AUTHZ_CHECKS), apart from the
    streams of authenticated tenants (ROUTER_STREAMS);
  - a stream may be silent (a non-streamed answer being generated) as long as a generation may run,
    and a little more, so the router always answers first, with its own error;
  - a non-streamed answer is held whole until it is sent: its size is bounded before any work
    starts (MAX_ANSWER_*), with a 400 that names the limit.
"""

from __future__ import annotations

KIB, MIB = 1 << 10, 1 << 20

# --------------------------------------------------------------- the ingress (Envoy)

# A request's headers must have arrived within this many seconds of its connection or stream.
REQUEST_HEADERS_TIMEOUT_S = 10
# ... and the whole request (headers and body) within this.
REQUEST_TIMEOUT_S = 60
# A client connection with no request on it for this long is closed.
CONNECTION_IDLE_TIMEOUT_S = 300
# HTTP/2 streams at once on one client connection (HTTP/1.1 has one).
MAX_STREAMS_PER_CONNECTION = 100
# Bytes Envoy buffers per connection before it stops reading from it (and per upstream connection).
CONNECTION_BUFFER_BYTES = 32 * KIB
# Client connections the ingress holds at once; past it, new ones wait in the kernel's backlog.
MAX_CONNECTIONS = 20_000
# Streams the ingress sends the routers at once, all routers together (Envoy's default: 1,024).
ROUTER_STREAMS = 8_192
# API key checks in flight from the ingress to the routers: a budget of their own.
AUTHZ_CHECKS = 1_024
# How long the ingress waits for a router to check a key: longer than a router waits for control
# (services/router/controlclient.CONTROL_TIMEOUT, 2 s), so that while control does not answer a
# check falls back on the keys the router verified lately instead of failing.
AUTHZ_TIMEOUT_S = 5
# Envoy's own memory (the ingress's): past 95% it frees what it can, past 98% it refuses new requests.
ENVOY_HEAP_BYTES = 1024 * MIB

# gRPC services anyone may call at the ingress without a key (besides the OpenAI surface's probes,
# gaas.v1.OpenAI's methods that take a ProbeRequest): health and server reflection.
OPEN_GRPC_SERVICES = (
    "grpc.health.v1.Health",
    "grpc.reflection.v1alpha.ServerReflection",
    "grpc.reflection.v1.ServerReflection",
)

# --------------------------------------------------------------- requests

# The largest OpenAI request body (GAAS_MAX_BODY_BYTES); the ingress buffers at most this and
# the transcoder's framing (a body past both is 413 at the ingress, one between them the router's 400
# naming the limit).
MAX_BODY_BYTES = 1 * MIB
FRAMING_BYTES = 16 * KIB
# The largest gRPC request the router takes: a native prompt of gaas.contracts.genrequest.MAX_PROMPT_CHARS
# characters (up to 4 bytes each in UTF-8) and the rest of the request.
MAX_GRPC_REQUEST_BYTES = 4 * MIB + 256 * KIB
# A generation may stream this long when its client set no deadline (GAAS_MAX_STREAM_SECONDS).
MAX_STREAM_SECONDS = 600.0

# --------------------------------------------------------------- answers

# A non-streamed answer is assembled before it is sent: at most this many tokens (prompts x n x
# max_tokens, all choices together) ...
MAX_ANSWER_TOKENS = 131_072
# ... and this many logprob entries (each token's own and its top alternatives). A streamed
# answer is sent as it is made and held nowhere: neither bounds it.
MAX_ANSWER_LOGPROBS = 524_288
# A non-streamed answer goes to the ingress in messages of at most this many bytes; the ingress's
# transcoder takes a response message up to RESPONSE_MESSAGE_BYTES (a stream's events are smaller).
ANSWER_PIECE_BYTES = 256 * KIB
RESPONSE_MESSAGE_BYTES = 4 * ANSWER_PIECE_BYTES

# --------------------------------------------------------------- unknown keys

# Per client address, at each router: unknown or revoked keys accepted in a burst, then per second;
# past them the address gets 429 without its keys being looked up.
FAILED_AUTH_BURST = 20
FAILED_AUTH_PER_SECOND = 2.0
# Addresses (and unknown keys) remembered; the oldest are forgotten first.
FAILED_AUTH_ADDRESSES = 100_000
# The client's address as the ingress decided it (the connection's, or what a trusted load balancer
# said: X-Forwarded-For's trusted hops, the proxy protocol), set by the ingress over whatever a
# client sent; the key check's limiter keys on it.
CLIENT_ADDRESS_HEADER = "x-gaas-client-address"

