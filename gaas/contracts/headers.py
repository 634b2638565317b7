"""The metadata keys GaaS's processes and Envoys agree on (lower case, as gRPC delivers them).
gaas.runtime.context reads them into request-scoped values; the Envoy configs set and route on them."""

from __future__ import annotations

REQUEST_ID_HEADER = "x-gaas-request-id"
TENANT_HEADER = "x-gaas-tenant"
WORKER_HEADER = "x-gaas-worker"
# The ingress's arrival time of a request (seconds since the epoch), stamped by the ingress only:
# the start of the request's latency decomposition (gaas/contracts/latency.py).
INGRESS_START_HEADER = "x-gaas-ingress-start"
AUTHORIZATION_HEADER = "authorization"
# The client's own request id (OpenAI clients and vLLM's benchmark send it); echoed by the ingress.
CLIENT_REQUEST_ID_HEADER = "x-request-id"
# Who called, as the inbound sidecar verified the caller's certificate (Envoy sets it, replacing
# anything the caller sent); gaas.contracts.identity.caller_from_xfcc reads it.
CALLER_HEADER = "x-forwarded-client-cert"
# The address the caller's connection came from, as the inbound sidecar saw it (set by it, replacing
# anything the caller sent).
PEER_ADDRESS_HEADER = "x-gaas-peer-address"
# Marks an answer that says nothing of the request was done (a sidecar's own reply for a service it
# could not reach, or a service refusing a request it did not start: a worker busy or without its
# engine), so the hop before it may send it to another replica.
UNREACHED_HEADER = "x-gaas-unreached"
