import pytest

from gaas.contracts.ids import WorkerId
from services.control.registry import DRAINING, SERVING, LeaseExpired, WorkerRecord, WorkerRegistry
from tests.fakeclock import FakeClock
from tests.waiting import eventually_async

T0 = 1_800_000_000  # a Unix moment (s)


def record(worker_id="worker-0", model="gaas-tiny", address="127.0.0.1:20041"):
    return WorkerRecord(WorkerId(worker_id), address, model, "1.0.0", "vllm-cpu", "cpu", 32, 2048)


async def test_register_list_deregister(redis):
    reg = WorkerRegistry(redis, ttl_seconds=10)
    r = await reg.register(record())
    assert r.lease_expires_ms > r.registered_ms > 0
    await reg.register(record("worker-1", model="gaas-small", address="127.0.0.1:20051"))
    assert [w.worker_id for w in await reg.list()] == ["worker-0", "worker-1"]
    assert [w.worker_id for w in await reg.list("gaas-small")] == ["worker-1"]
    assert await reg.deregister(WorkerId("worker-0"))
    assert not await reg.deregister(WorkerId("worker-0"))
    assert [w.worker_id for w in await reg.list()] == ["worker-1"]


async def test_lease_lapses_without_renewal(redis):
    clock = FakeClock(T0)
    reg = WorkerRegistry(redis, ttl_seconds=1, clock=clock.millis)
    await reg.register(record())
    clock.advance(0.6)
    renewed = await reg.renew(WorkerId("worker-0"))
    clock.advance(0.6)
    assert [w.worker_id for w in await reg.list()] == ["worker-0"]  # the renewal kept it
    assert renewed.state == SERVING
    clock.advance(0.6)
    assert await reg.list() == []
    with pytest.raises(LeaseExpired, match="register again"):
        await reg.renew(WorkerId("worker-0"))


async def test_renew_changes_state(redis):
    reg = WorkerRegistry(redis, ttl_seconds=10)
    await reg.register(record())
    r = await reg.renew(WorkerId("worker-0"), DRAINING)
    assert r.state == DRAINING and (await reg.list())[0].state == DRAINING
    with pytest.raises(ValueError, match="unknown worker state"):
        await reg.renew(WorkerId("worker-0"), "sleeping")


async def test_two_registries_share_state(redis):
    """Control replicas see each other's registrations: state lives in Redis, not in a process."""
    a, b = WorkerRegistry(redis, 10), WorkerRegistry(redis, 10)
    await a.register(record())
    assert [w.worker_id for w in await b.list()] == ["worker-0"]


async def test_reregistration_keeps_first_registration_time(redis):
    clock = FakeClock(T0)
    reg = WorkerRegistry(redis, ttl_seconds=10, clock=clock.millis)
    first = await reg.register(record())
    clock.advance(0.01)
    again = await reg.register(record())
    assert again.registered_ms == first.registered_ms
    assert again.lease_expires_ms >= first.lease_expires_ms


async def test_a_gap_of_control_extends_the_leases_live_when_it_began(redis):
    """No control answered for 30 s (paused, restarting): leases that were live when it went quiet
    get one more TTL when it answers again; one that had lapsed before stays lapsed."""
    clock = FakeClock(T0)
    reg = WorkerRegistry(redis, ttl_seconds=10, clock=clock.millis)
    async def answering(seconds: int) -> None:  # control's heartbeat, once a second
        for _ in range(seconds):
            clock.advance(1)
            await reg.heartbeat()

    await reg.register(record("worker-0"))
    await answering(6)
    await reg.register(record("worker-1", address="127.0.0.1:20051"))  # lease ends at +16 s
    await answering(9)  # worker-0 lapses at +10 s while control answers
    assert [w.worker_id for w in await reg.list()] == ["worker-1"]
    clock.advance(30)  # control silent from +15 s to +45 s: worker-1's lease ran out meanwhile
    assert [w.worker_id for w in await reg.list()] == ["worker-1"]
    assert (await reg.list())[0].lease_expires_ms == clock.millis() + 10_000
    renewed = await reg.renew(WorkerId("worker-1"))
    assert renewed.worker_id == "worker-1"
    with pytest.raises(LeaseExpired):
        await reg.renew(WorkerId("worker-0"))


async def test_without_a_gap_a_lapsed_lease_is_not_extended(redis):
    clock = FakeClock(T0)
    reg = WorkerRegistry(redis, ttl_seconds=10, clock=clock.millis)
    await reg.register(record())
    for _ in range(12):  # control keeps answering (its heartbeat) while the worker is silent
        clock.advance(1)
        assert await reg.heartbeat() == 0
    assert await reg.list() == []
    with pytest.raises(LeaseExpired):
        await reg.renew(WorkerId("worker-0"))


async def test_registrations_departures_and_state_changes_are_announced_to_the_routers(redis, redis_url):
    """What services/router/registry_changes.py follows: one announcement per registration,
    departure and change of state, none for a renewal that changes nothing."""
    import asyncio

    from services.router import registry_changes

    heard = []

    async def changed():
        heard.append(1)

    follower = asyncio.create_task(registry_changes.follow(redis_url, changed))

    async def subscribed() -> bool:
        return dict(await redis.pubsub_numsub(registry_changes.CHANGED_CHANNEL)).get(
            registry_changes.CHANGED_CHANNEL, 0) > 0

    await eventually_async(subscribed, 5, every=0.01, what="the follower subscribed")
    reg = WorkerRegistry(redis, ttl_seconds=10)
    await reg.register(record())
    await reg.renew(WorkerId("worker-0"))
    await reg.renew(WorkerId("worker-0"), state=DRAINING)
    await reg.deregister(WorkerId("worker-0"))
    await eventually_async(lambda: len(heard) >= 3, 2, every=0.02, what="three changes heard")
    await asyncio.sleep(0.1)  # (and no fourth: a duration, the assertion is about nothing more coming)
    follower.cancel()
    await asyncio.gather(follower, return_exceptions=True)
    assert len(heard) == 3
