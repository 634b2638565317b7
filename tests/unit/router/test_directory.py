import asyncio

import pytest

from gaas.contracts import errors
from services.router.directory import READY, SCALED_TO_ZERO, STARTING, MeshDirectory, ModelEntry, model_state
from services.router.scheduling import Candidate, WorkerId
from tests.fakeclock import FakeClock

MODELS = [ModelEntry("tiny", "1", 2048, True), ModelEntry("small", "1", 4096, False)]
WORKERS = [Candidate(WorkerId(f"worker-{i}"), f"127.0.0.1:{i}", "tiny", "1", 2048) for i in range(2)]


@pytest.fixture
def setup():
    calls = []

    async def fetch():
        calls.append(1)
        if isinstance(fetch.fail, Exception):
            raise fetch.fail
        return MODELS, WORKERS

    fetch.fail = None
    clock = FakeClock()
    return MeshDirectory(fetch, refresh_seconds=0.01, max_stale_seconds=10.0, clock=clock), clock, calls, fetch


async def test_requests_reuse_the_view_until_it_is_too_stale(setup):
    d, clock, calls, _ = setup
    await d.snapshot()
    await d.snapshot()
    assert len(calls) == 1
    clock.now = 11.0  # nobody refreshed it for longer than max_stale: the request fetches itself
    await d.snapshot()
    assert len(calls) == 2


async def test_the_background_refresh_keeps_the_last_view_when_control_fails(setup):
    d, clock, calls, fetch = setup
    task = asyncio.create_task(d.run())
    await eventually_async(lambda: len(calls) >= 2, 2, every=0.01, what="refreshes in the background")
    fetch.fail, before = errors.Unavailable("control down"), len(calls)
    await eventually_async(lambda: len(calls) >= before + 2, 2, every=0.01, what="refreshes failing")
    assert [w.worker_id for w in await d.workers("tiny")] == ["worker-0", "worker-1"], "the last view stays"
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)


async def test_the_first_view_is_awaited_until_control_answers(setup):
    d, _, calls, fetch = setup
    fetch.fail = errors.Unavailable("control down")
    task = asyncio.create_task(d.run())
    waiting = asyncio.create_task(d.first_view())
    await eventually_async(lambda: len(calls) >= 2, 2, every=0.01, what="several refreshes, every one failing")
    assert not waiting.done()
    fetch.fail = None
    await asyncio.wait_for(waiting, 1.0)
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)


async def test_resolve_model(setup):
    d, _, _, _ = setup
    assert (await d.resolve_model("")).name == "tiny"
    assert (await d.resolve_model("small")).max_model_len == 4096
    with pytest.raises(errors.NotFound, match="available: tiny, small") as err:
        await d.resolve_model("huge")
    assert err.value.param == "model" and err.value.openai_code == "model_not_found"
    with pytest.raises(errors.NotFound) as err:
        await d.resolve_model("x" * 100_000)
    assert len(err.value.message) < 200, "a huge name is cut before it is echoed"


async def test_workers_of_a_model(setup):
    d, clock, _, _ = setup
    assert len(await d.workers("tiny")) == 2
    with pytest.raises(errors.Unavailable, match=r"'small' is deployed with no workers \(replicas: 0\).*gaas apply"):
        await d.workers("small")


async def test_a_request_for_a_model_whose_workers_are_starting_is_told_so_with_retry_after():
    starting = [ModelEntry("tiny", "1", 2048, True, wants_workers=True)]

    async def fetch():
        return starting, []

    d = MeshDirectory(fetch, refresh_seconds=1.0, clock=FakeClock())
    with pytest.raises(errors.Unavailable, match="its workers are starting") as caught:
        await d.workers("tiny")
    assert caught.value.retry_after == 5.0


@pytest.mark.parametrize("entry, ready, state", [
    (ModelEntry("m", "1", 2048, True), 2, READY),
    (ModelEntry("m", "1", 2048, True, wants_workers=True), 0, STARTING),
    (ModelEntry("m", "1", 2048, True, autoscaled=True), 0, SCALED_TO_ZERO),
    (ModelEntry("m", "1", 2048, True, autoscaled=True, wants_workers=True), 0, STARTING),
    (ModelEntry("m", "1", 2048, True), 0, ""),  # catalogued only: not listed
])
def test_what_the_model_list_says_of_a_model_by_its_workers_and_deployment(entry, ready, state):
    assert model_state(entry, ready) == state


async def test_a_miss_looks_again_unless_the_view_is_brand_new():
    """Right after `gaas up` says ready, a worker may not be in the router's view yet: a request
    for its model fetches a fresh view instead of answering 503."""
    views = [(MODELS, []), (MODELS, WORKERS)]
    clock = FakeClock()

    async def fetch():
        return views.pop(0) if len(views) > 1 else views[0]

    d = MeshDirectory(fetch, refresh_seconds=1.0, clock=clock)
    await d.snapshot()
    with pytest.raises(errors.Unavailable):
        await d.workers("tiny")  # the view is brand new: no second fetch
    clock.now = 0.5
    assert len(await d.workers("tiny")) == 2


async def test_with_control_unreachable_requests_route_on_the_last_view_until_it_is_too_old():
    up = True
    clock = FakeClock()

    async def fetch():
        if not up:
            raise errors.Unavailable("the control plane does not answer")
        return MODELS, WORKERS

    d = MeshDirectory(fetch, refresh_seconds=0.5, max_stale_seconds=60.0, clock=clock)
    await d.snapshot()
    up = False
    clock.now = 59.0
    assert len(await d.workers("tiny")) == 2
    await d.resolve_model("tiny")
    with pytest.raises(errors.NotFound):  # an unknown model looks again, fails, and keeps the last view's answer
        await d.resolve_model("nope")
    clock.now = 61.0
    with pytest.raises(errors.Unavailable):
        await d.workers("tiny")


async def test_the_view_is_exported_at_each_scrape_without_fetching():
    from prometheus_client import CollectorRegistry, generate_latest

    from services.router.directory import DirectoryCollector
    from services.router.scheduling.types import Load

    busy = [Candidate(WorkerId("worker-0"), "127.0.0.1:1", "tiny", "1", 2048,
                      load=Load(running=3, waiting=2, kv_usage=0.25, memory_used=7 * 2**30, utilization=0.5))]
    calls = []

    async def fetch():
        calls.append(1)
        return MODELS, busy

    clock = FakeClock()
    d = MeshDirectory(fetch, refresh_seconds=1.0, clock=clock)
    registry = CollectorRegistry()
    registry.register(DirectoryCollector(d, clock=clock))
    assert "worker-0" not in generate_latest(registry).decode()  # no view yet, and none fetched for a scrape
    assert calls == []
    await d.snapshot()
    clock.now = 2.5
    body = generate_latest(registry).decode()
    for line in ('gaas_router_worker_running_requests{model="tiny",worker="worker-0"} 3.0',
                 'gaas_router_worker_waiting_requests{model="tiny",worker="worker-0"} 2.0',
                 'gaas_router_worker_kv_cache_usage{model="tiny",worker="worker-0"} 0.25',
                 'gaas_router_worker_device_memory_used_bytes{model="tiny",worker="worker-0"} 7.516192768e+09',
                 'gaas_router_worker_device_utilization{model="tiny",worker="worker-0"} 0.5',
                 "gaas_router_mesh_view_age_seconds 2.5"):
        assert line in body, line
    assert calls == [1]


async def test_no_model_named_means_the_default_if_served_else_the_model_the_workers_serve():
    """A mesh started with another model (`gaas up --model gaas-small`) answers a request that
    names none with that model, not with a default nobody serves."""
    small_workers = [Candidate(WorkerId("worker-0"), "127.0.0.1:1", "small", "1", 4096)]

    async def fetch():
        return MODELS, small_workers

    d = MeshDirectory(fetch, refresh_seconds=0.01, max_stale_seconds=10.0)
    assert (await d.resolve_model("")).name == "small"
    assert (await d.resolve_model("tiny")).name == "tiny", "a named model is still that model"


# ------------------------------------------------------------ LoRA adapters

from gaas.contracts.adapters import Adapter  # noqa: E402
from gaas.contracts.pricing import Price  # noqa: E402
from tests.waiting import eventually_async

ADAPTERS = {"bot": Adapter("bot", "tiny", "/a/bot", 8, owner="acme", adapter_id=7, price=Price(1, 0.1, 4)),
            "pub": Adapter("pub", "tiny", "/a/pub", 8, adapter_id=9)}


@pytest.fixture
def with_adapters():
    models = [ModelEntry("tiny", "1", 2048, True, prices={"gold": Price(0.6, 0.06, 2.4)}, adapters=ADAPTERS),
              ModelEntry("small", "1", 4096, False)]

    async def fetch():
        return models, WORKERS

    return MeshDirectory(fetch, refresh_seconds=1, clock=FakeClock())


@pytest.mark.parametrize("name", ["bot", "tiny:bot"])
async def test_a_tenant_names_its_adapter_by_its_name_or_with_its_base(with_adapters, name):
    m = await with_adapters.resolve_model(name, "acme")
    assert (m.name, m.adapter.name, m.served_name) == ("tiny", "bot", "bot")
    assert m.prices == {t: Price(1, 0.1, 4) for t in ("gold", "silver", "bronze")}, \
        "the adapter's own prices replace the base model's, in every tier"


async def test_a_public_adapter_is_every_tenants_at_the_base_models_prices(with_adapters):
    m = await with_adapters.resolve_model("tiny:pub", "other")
    assert (m.adapter.name, m.prices) == ("pub", {"gold": Price(0.6, 0.06, 2.4)})


@pytest.mark.parametrize("name, tenant", [("bot", "other"), ("tiny:bot", "other"), ("small:bot", "acme"),
                                          ("tiny:nothing", "acme"), ("bot", None)])
async def test_an_adapter_not_the_tenants_is_as_unknown_as_no_model(with_adapters, name, tenant):
    with pytest.raises(errors.NotFound, match="does not exist; available: tiny, small") as e:
        await with_adapters.resolve_model(name, tenant)
    assert e.value.reason == "model_not_found" and "acme" not in str(e.value)


async def test_the_base_model_alone_has_no_adapter(with_adapters):
    m = await with_adapters.resolve_model("tiny", "acme")
    assert m.adapter is None and m.served_name == "tiny"
