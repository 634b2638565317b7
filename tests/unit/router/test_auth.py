import pytest

from gaas.contracts.errors import Unauthenticated
from services.router.auth import Authenticator, SharedKeys, bearer_key
from tests.fakeclock import FakeClock
from tests.unit.router.support import ACME
from tests.waiting import eventually_async


@pytest.mark.parametrize(
    "header, key_or_error",
    [
        ("Bearer abc", "abc"),
        ("bearer  abc ", "abc"),
        ("", "missing API key"),
        ("Basic abc", "must be 'Bearer"),
        ("Bearer ", "must be 'Bearer"),
    ],
)
def test_bearer(header, key_or_error):
    if key_or_error in ("abc",):
        assert bearer_key(header) == key_or_error
    else:
        with pytest.raises(Unauthenticated, match=key_or_error):
            bearer_key(header)


async def test_cache_and_revocation_within_ttl():
    keys = {"good": ACME}
    calls = []

    async def lookup(key):
        calls.append(key)
        return keys.get(key)

    clock = FakeClock()
    auth = Authenticator(lookup, ttl_seconds=2, negative_ttl_seconds=1, clock=clock)
    assert await auth.authenticate("Bearer good") == ACME
    assert await auth.authenticate("Bearer good") == ACME
    assert calls == ["good"]  # cached
    del keys["good"]  # revoked in control
    clock.now = 1.9
    assert await auth.authenticate("Bearer good") == ACME  # still cached
    clock.now = 2.1
    with pytest.raises(Unauthenticated, match="unknown or was revoked"):
        await auth.authenticate("Bearer good")
    with pytest.raises(Unauthenticated):
        await auth.authenticate("Bearer good")
    assert calls == ["good", "good"]  # the miss is cached too, briefly


async def test_cache_is_bounded():
    async def lookup(key):
        return ACME

    auth = Authenticator(lookup, ttl_seconds=60, max_entries=3)
    for i in range(10):
        await auth.authenticate(f"Bearer k{i}")
    assert len(auth._cache) == 3


async def test_control_failures_propagate():
    async def lookup(key):
        raise ConnectionError("control down")

    with pytest.raises(ConnectionError):
        await Authenticator(lookup, 2).authenticate("Bearer k")


async def test_while_control_is_unreachable_keys_verified_within_the_bound_still_work():
    from gaas.contracts.errors import Unavailable

    down = False

    async def lookup(key):
        if down:
            raise Unavailable("the control plane does not answer")
        return ACME if key == "good" else None

    clock = FakeClock()
    auth = Authenticator(lookup, ttl_seconds=2, clock=clock, stale_seconds=60)
    assert await auth.authenticate("Bearer good") == ACME
    down = True
    clock.now = 30.0  # the cache entry expired, the lookup fails: verified 30 s ago is recent enough
    assert await auth.authenticate("Bearer good") == ACME
    with pytest.raises(Unavailable):  # never verified: refused
        await auth.authenticate("Bearer other")
    clock.now = 61.0
    with pytest.raises(Unavailable):  # verified too long ago
        await auth.authenticate("Bearer good")
    down = False
    assert await auth.authenticate("Bearer good") == ACME
    with pytest.raises(Unauthenticated):
        await auth.authenticate("Bearer other")


async def test_while_control_is_unreachable_only_one_request_a_second_waits_for_it():
    from gaas.contracts.errors import Unavailable

    calls = []

    async def lookup(key):
        calls.append(key)
        if len(calls) > 1:
            raise Unavailable("the control plane does not answer")
        return ACME

    clock = FakeClock()
    auth = Authenticator(lookup, ttl_seconds=2, clock=clock, stale_seconds=60)
    await auth.authenticate("Bearer good")
    clock.now = 3.0
    for _ in range(5):
        assert await auth.authenticate("Bearer good") == ACME
    assert len(calls) == 2  # one failed lookup, then the verified key is used without asking
    clock.now = 4.5
    await auth.authenticate("Bearer good")
    assert len(calls) == 3  # a second later, control is tried again


class FakeRedis:
    """The three calls SharedKeys makes, on a dict (a key's expiry is not modelled: `at` is)."""

    def __init__(self):
        self.data = {}

    async def set(self, key, value, px=None):
        self.data[key] = value

    async def get(self, key):
        return self.data.get(key)

    async def delete(self, key):
        self.data.pop(key, None)


async def settled(auth):
    await eventually_async(lambda: not auth._sharing, 5, every=0, what="the keys it verified shared")


async def test_a_router_restarted_while_control_is_away_accepts_the_keys_its_peers_verified():
    import dataclasses

    from gaas.contracts.errors import Unavailable
    from gaas.contracts.qos import Limits

    gold = dataclasses.replace(ACME, limits=Limits(rpm=60, tpm=1000, concurrency=4))
    down = False

    async def lookup(key):
        if down:
            raise Unavailable("the control plane does not answer")
        return gold if key == "good" else None

    shared = SharedKeys(FakeRedis(), stale_seconds=60)
    peer = Authenticator(lookup, ttl_seconds=2, shared=shared)
    assert await peer.authenticate("Bearer good") == gold
    await settled(peer)
    down = True
    restarted = Authenticator(lookup, ttl_seconds=2, shared=shared)  # nothing verified itself
    assert await restarted.authenticate("Bearer good") == gold
    with pytest.raises(Unavailable):  # a key no router verified is refused
        await restarted.authenticate("Bearer other")
    # Plain keys are never stored, only their digests.
    assert not any("good" in k or "good" in v for k, v in shared._redis.data.items())


async def test_a_key_control_says_is_revoked_is_forgotten_by_every_router():
    from gaas.contracts.errors import Unavailable

    keys, down = {"good": ACME}, False

    async def lookup(key):
        if down:
            raise Unavailable("the control plane does not answer")
        return keys.get(key)

    shared, clock = SharedKeys(FakeRedis(), stale_seconds=60), FakeClock()
    first = Authenticator(lookup, ttl_seconds=2, shared=shared, clock=clock)
    await first.authenticate("Bearer good")
    await settled(first)
    del keys["good"]
    clock.advance(3)  # its cached answer expired: it asks control again
    with pytest.raises(Unauthenticated):
        await first.authenticate("Bearer good")
    await settled(first)
    down = True
    with pytest.raises(Unavailable):
        await Authenticator(lookup, ttl_seconds=2, shared=shared).authenticate("Bearer good")


async def test_a_peers_verification_older_than_the_bound_is_not_accepted():
    import hashlib
    import json

    from gaas.contracts.errors import Unavailable

    async def lookup(key):
        raise Unavailable("the control plane does not answer")

    redis = FakeRedis()
    shared = SharedKeys(redis, stale_seconds=60)
    digest = hashlib.sha256(b"good").hexdigest()
    await shared.remember(digest, ACME)
    entry = json.loads(redis.data[SharedKeys.PREFIX + digest])
    redis.data[SharedKeys.PREFIX + digest] = json.dumps({**entry, "at": entry["at"] - 61})
    with pytest.raises(Unavailable):
        await Authenticator(lookup, ttl_seconds=2, stale_seconds=60, shared=shared).authenticate("Bearer good")
