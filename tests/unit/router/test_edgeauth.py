"""The ingress's key check (services/router/edgeauth.py) and what it relies on in the
Authenticator: the probes pass without a key, every other path needs one, a refusal is in the
shape the ingress's error filter reads, an address sending unknown keys is slowed (the client's
address as the ingress decided it, not its load balancer's), and a flood of unknown keys never
evicts the verified ones."""

import json

import pytest

from gaas.contracts import edge, errors
from gaas.v1 import ext_authz_pb2 as az
from services.router.auth import Authenticator, FailedAuthLimiter
from services.router.edgeauth import EdgeAuthorizer
from tests.fakeclock import FakeClock
from tests.unit.router.support import ACME


def check(path: str, key: str = "", client: str = "203.0.113.7", grpc_client: bool = False,
          decided: str = "") -> az.CheckRequest:
    """A check as the ingress sends it: client, the connection's peer; decided, the client's address
    as the ingress decided it (edge.CLIENT_ADDRESS_HEADER), when it says."""
    headers = {"content-type": b"application/grpc" if grpc_client else b"application/json"}
    if decided:
        headers[edge.CLIENT_ADDRESS_HEADER] = decided.encode()
    if key:
        headers["authorization"] = f"Bearer {key}".encode("latin-1")
    return az.CheckRequest(attributes=az.AttributeContext(
        source=az.AttributeContext.Peer(address=az.Address(socket_address=az.SocketAddress(address=client))),
        request=az.AttributeContext.Request(http=az.AttributeContext.HttpRequest(path=path.encode(),
                                                                                  headers=headers))))


@pytest.fixture
def setup():
    calls = []
    keys = {"good": ACME}

    async def lookup(key):
        calls.append(key)
        return keys.get(key)

    clock = FakeClock()
    auth = Authenticator(lookup, ttl_seconds=2, negative_ttl_seconds=1, clock=clock)
    return EdgeAuthorizer(auth), calls, clock, keys


@pytest.mark.parametrize("path", ["/health", "/ping?probe=1", "/version", "/load", "/metrics",
                                  "/gaas.v1.OpenAI/Health", "/grpc.health.v1.Health/Check",
                                  "/grpc.reflection.v1.ServerReflection/ServerReflectionInfo"])
async def test_the_probes_pass_without_a_key(setup, path):
    authz, calls, _, _ = setup
    assert (await authz.Check(check(path), None)).status.code == 0
    assert calls == []


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions", "/v1/models", "/tokenize",
                                  "/v1/generate", "/v1/gaas/usage?since=7d", "/gaas.v1.Inference/Generate",
                                  "/health/../v1/completions", "/healthz", "/v1/embeddings"])
async def test_every_other_path_needs_a_key(setup, path):
    authz, _, _, _ = setup
    r = await authz.Check(check(path), None)
    assert r.status.code != 0 and r.denied_response.status.code == 401
    # The body the ingress's error filter reads: the google.rpc.Status as the transcoder renders one.
    body = json.loads(r.denied_response.body)
    assert body["code"] == 16 and "Authorization: Bearer" in body["message"]
    assert (await authz.Check(check(path, "good"), None)).status.code == 0


async def test_a_grpc_client_is_refused_with_the_message_alone(setup):
    authz, _, _, _ = setup
    r = await authz.Check(check("/gaas.v1.Inference/Generate", "nope", grpc_client=True), None)
    assert r.denied_response.status.code == 401 and r.denied_response.body.startswith("invalid API key")


async def test_an_address_sending_unknown_keys_is_slowed_and_its_keys_no_longer_looked_up(setup):
    authz, calls, clock, _ = setup
    for i in range(edge.FAILED_AUTH_BURST):
        assert (await authz.Check(check("/v1/completions", f"made-up-{i}"), None)).denied_response.status.code == 401
    assert len(calls) == edge.FAILED_AUTH_BURST
    r = await authz.Check(check("/v1/completions", "made-up-next"), None)
    assert r.denied_response.status.code == 429 and "too many unknown API keys" in r.denied_response.body
    assert any(h.header.key == "retry-after" for h in r.denied_response.headers)
    assert len(calls) == edge.FAILED_AUTH_BURST, "not looked up"
    # Another address is not slowed, and a key verified before still passes from the slowed one.
    assert (await authz.Check(check("/v1/completions", "made-up-x", client="198.51.100.1"), None)
            ).denied_response.status.code == 401
    assert (await authz.Check(check("/v1/completions", "good", client="198.51.100.1"), None)).status.code == 0
    clock.advance(5)  # past the cache's TTL: looked up again, from the slowed address too
    assert (await authz.Check(check("/v1/completions", "good"), None)).status.code == 0
    # The bucket refills.
    clock.advance(1 / edge.FAILED_AUTH_PER_SECOND)
    assert (await authz.Check(check("/v1/completions", "made-up-later"), None)).denied_response.status.code == 401


async def test_the_limiter_keys_on_the_address_the_ingress_decided_not_the_balancers(setup):
    authz, calls, _, _ = setup
    balancer = "10.0.0.5"  # (every client behind it arrives from here)
    for i in range(edge.FAILED_AUTH_BURST + 1):
        r = await authz.Check(check("/v1/completions", f"made-up-{i}", client=balancer, decided="203.0.113.9"), None)
    assert r.denied_response.status.code == 429
    # Another client behind the same balancer is not slowed by the first one's bad keys.
    r = await authz.Check(check("/v1/completions", "made-up-x", client=balancer, decided="198.51.100.2"), None)
    assert r.denied_response.status.code == 401


async def test_a_flood_of_unknown_keys_never_evicts_the_verified_ones():
    down = False

    async def lookup(key):
        if down:
            raise errors.Unavailable("control down")
        return ACME if key == "good" else None

    clock = FakeClock()
    auth = Authenticator(lookup, ttl_seconds=2, clock=clock, max_entries=10, max_unknown=10,
                         limiter=FailedAuthLimiter(burst=10**9))
    assert await auth.authenticate("Bearer good") == ACME
    for i in range(1000):
        with pytest.raises(errors.Unauthenticated):
            await auth.authenticate(f"Bearer made-up-{i}", "203.0.113.7")
    down = True
    clock.advance(10)  # past the TTL, control away: the verified key is still served
    assert await auth.authenticate("Bearer good") == ACME


async def test_a_revoked_key_is_not_accepted_while_control_is_away():
    state = {"keys": {"good": ACME}, "down": False}

    async def lookup(key):
        if state["down"]:
            raise errors.Unavailable("control down")
        return state["keys"].get(key)

    clock = FakeClock()
    auth = Authenticator(lookup, ttl_seconds=2, negative_ttl_seconds=1, clock=clock)
    await auth.authenticate("Bearer good")
    del state["keys"]["good"]
    clock.advance(3)
    with pytest.raises(errors.Unauthenticated):
        await auth.authenticate("Bearer good")
    state["down"] = True
    clock.advance(3)
    with pytest.raises(errors.Unavailable):
        await auth.authenticate("Bearer good")


async def test_a_check_whose_headers_are_not_utf8_parses_and_is_refused(setup):
    """Envoy's CheckRequest declares header values as strings; a client's may hold any byte. The
    router reads them as bytes, so such a request is refused (401), not a failed check (503)."""
    authz, _, _, _ = setup
    raw = check("/v1/completions").SerializeToString()
    request = az.CheckRequest.FromString(raw)
    request.attributes.request.http.headers["authorization"] = b"Bearer \xb2\xff"
    request.attributes.request.http.path = b"/v1/completions?\xb2"
    parsed = az.CheckRequest.FromString(request.SerializeToString())
    assert (await authz.Check(parsed, None)).denied_response.status.code == 401
