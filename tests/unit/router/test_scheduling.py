"""The scheduler's plugins, each alone (table-driven), and the profiles put together."""

import random

import pytest

from gaas.contracts import errors
from services.router.scheduling import Candidate, Load, RequestContext, WorkerId, make_scheduler
from services.router.scheduling.filters.context_fit import ContextFitFilter
from services.router.scheduling.filters.breaker import BreakerFilter
from services.router.scheduling.filters.not_tried import NotTriedFilter
from services.router.scheduling.filters.window import WindowFilter
from services.router.scheduling.filters.model import ModelFilter
from services.router.scheduling.filters.saturation import SaturationFilter
from services.router.scheduling.pickers.max_score import MaxScorePicker
from services.router.scheduling.pickers.round_robin import RoundRobinPicker
from services.router.scheduling.profiles import parse_weights
from services.router.scheduling.scorers.device_memory import DeviceMemoryScorer
from services.router.scheduling.scorers.kv_usage import KVUsageScorer
from services.router.scheduling.scorers.prefix import PrefixScorer
from services.router.scheduling.scorers.queue import QueueScorer


def cand(wid="w0", model="m", ctx_len=2048, **load):
    return Candidate(WorkerId(wid), f"addr-{wid}", model, "1", ctx_len, load=Load(**load))


def ctx(**kw):
    return RequestContext(model="m", **kw)


@pytest.mark.parametrize(
    "plugin, context, candidate, keep",
    [
        (ModelFilter(), ctx(), cand(model="m"), True),
        (ModelFilter(), ctx(), cand(model="other"), False),
        (NotTriedFilter(), ctx(tried=frozenset({"w0"})), cand("w0"), False),
        (NotTriedFilter(), ctx(tried=frozenset({"w1"})), cand("w0"), True),
        (BreakerFilter(), ctx(blocked=frozenset({"w0"})), cand("w0"), False),
        (BreakerFilter(), ctx(blocked=frozenset({"w1"})), cand("w0"), True),
        (WindowFilter(), ctx(room={"w0": 0}), cand("w0"), False),
        (WindowFilter(), ctx(room={"w0": 2}), cand("w0"), True),
        (WindowFilter(), ctx(room=None), cand("w0"), True),
        (ContextFitFilter(), ctx(prompt_tokens=2000, max_tokens=48), cand(ctx_len=2048), True),
        (ContextFitFilter(), ctx(prompt_tokens=2000, max_tokens=49), cand(ctx_len=2048), False),
        (SaturationFilter(max_queue=4), ctx(), cand(running=2, waiting=1), True),
        (SaturationFilter(max_queue=4), ctx(inflight={"w0": 1}), cand(running=2, waiting=1), False),
        (SaturationFilter(max_kv_usage=0.9), ctx(), cand(kv_usage=0.95), False),
    ],
)
def test_filters(plugin, context, candidate, keep):
    assert plugin.keep(context, candidate) is keep


@pytest.mark.parametrize(
    "scorer, context, candidate, expected",
    [
        (PrefixScorer(), ctx(block_hashes=[1, 2, 3, 4], prefix={"w0": 3}), cand(), 0.75),
        (PrefixScorer(), ctx(block_hashes=[1, 2], prefix={"w1": 2}), cand(), 0.0),
        (PrefixScorer(), ctx(), cand(), 0.0),
        (QueueScorer(half_at=4), ctx(), cand(), 1.0),
        (QueueScorer(half_at=4), ctx(inflight={"w0": 1}), cand(running=2, waiting=1), 0.5),
        (KVUsageScorer(), ctx(), cand(kv_usage=0.25), 0.75),
        (DeviceMemoryScorer(), ctx(), cand(memory_used=30, memory_total=120), 0.75),
        # Same host's RAM read a moment apart: a tie, not a preference.
        (DeviceMemoryScorer(), ctx(), cand(memory_used=30_100, memory_total=120_000), 0.75),
        (DeviceMemoryScorer(), ctx(), cand(), 0.5),
    ],
)
def test_scorers(scorer, context, candidate, expected):
    assert scorer.score(context, candidate) == pytest.approx(expected)


def test_max_score_picker_breaks_ties_at_random():
    picker = MaxScorePicker(random.Random(7))
    cs = [cand("w0"), cand("w1"), cand("w2")]
    picks = {picker.pick(ctx(), cs, {"w0": 1.0, "w1": 1.0, "w2": 0.5}).worker_id for _ in range(50)}
    assert picks == {"w0", "w1"}


def test_round_robin_cycles_in_id_order():
    p = RoundRobinPicker()
    cs = [cand("w-b"), cand("w-a"), cand("w-c")]
    assert [p.pick(ctx(), cs, {}).worker_id for _ in range(6)] == ["w-a", "w-b", "w-c"] * 2


def test_kv_aware_goes_where_the_prefix_lives_unless_load_says_otherwise():
    s = make_scheduler("kv_aware")
    holder, idle = cand("w0", running=1), cand("w1")
    full = ctx(block_hashes=list(range(10)), prefix={"w0": 10})
    assert s.schedule(full, [holder, idle]).worker.worker_id == "w0"
    # The holder is saturated: the other worker takes it, cache or not.
    swamped = cand("w0", running=10, waiting=8)
    assert s.schedule(full, [swamped, idle]).worker.worker_id == "w1"
    # Without a prefix anywhere, the less loaded one.
    none = ctx(block_hashes=list(range(10)))
    assert s.schedule(none, [holder, idle]).worker.worker_id == "w1"


def test_soft_filters_keep_everyone_when_everyone_is_saturated():
    s = make_scheduler("least_load")
    busy = [cand("w0", running=30), cand("w1", running=20)]
    assert s.schedule(ctx(), busy).worker.worker_id == "w1"


def test_hard_filters_leaving_nobody_are_a_typed_error_saying_why():
    s = make_scheduler("kv_aware")
    with pytest.raises(errors.Unavailable, match="no worker is serving 'm'"):
        s.schedule(ctx(), [cand(model="other")])
    with pytest.raises(errors.Unavailable, match="failed this request"):
        s.schedule(ctx(tried=frozenset({"w0"})), [cand("w0")])
    with pytest.raises(errors.Unavailable, match="context holds"):
        s.schedule(ctx(prompt_tokens=4000), [cand()])


def test_profiles_weights_and_their_errors():
    assert make_scheduler("round_robin").needs_prefix is False
    assert make_scheduler("kv_aware").needs_prefix is True
    assert make_scheduler("least_load", {"prefix": 1.0}).needs_prefix is True
    assert make_scheduler("kv_aware", {"prefix": 0}).needs_prefix is False, "a zero weight drops the scorer"
    assert parse_weights("prefix=3, queue=2") == {"prefix": 3.0, "queue": 2.0}
    with pytest.raises(ValueError, match="unknown routing policy 'fastest'"):
        make_scheduler("fastest")
    with pytest.raises(ValueError, match="unknown scorer 'speed' in the weights; scorers: adapter_affinity, "):
        make_scheduler("kv_aware", parse_weights("speed=1"))
    with pytest.raises(ValueError, match="must be a number"):
        parse_weights("queue=lots")


def test_every_plugin_reports_its_time():
    seen = []
    s = make_scheduler("kv_aware", observe=lambda plugin, seconds: seen.append(plugin))
    s.schedule(ctx(block_hashes=[1]), [cand()])
    assert set(seen) == {"model", "not_tried", "breaker", "context_fit", "adapter", "window", "saturation", "prefix",
                         "queue", "kv_usage", "device_memory", "session", "adapter_affinity", "max_score"}


def test_no_room_in_any_window_is_a_wait_not_a_refusal():
    from gaas.contracts import errors
    from services.router.scheduling.types import NoCapacity

    s = make_scheduler("kv_aware")
    with pytest.raises(NoCapacity):
        s.schedule(ctx(room={"w0": 0, "w1": 0}), [cand("w0"), cand("w1")])
    assert s.schedule(ctx(room={"w0": 0, "w1": 1}), [cand("w0"), cand("w1")]).worker.worker_id == "w1"
    # A worker that cannot take the model at all is a refusal, not a wait.
    with pytest.raises(errors.Unavailable) as info:
        s.schedule(RequestContext(model="other", room={"w0": 1}), [cand("w0")])
    assert not isinstance(info.value, NoCapacity)


# ------------------------------------------------------------ LoRA adapters

def test_a_request_with_an_adapter_goes_where_it_is_loaded_else_where_a_slot_is_free():
    from services.router.scheduling.filters.adapter import AdapterFilter
    from services.router.scheduling.scorers.adapter_affinity import AdapterAffinityScorer

    holds = cand("w-holds", adapters=frozenset({"bot"}), adapter_slots=2)
    free = cand("w-free", adapters=frozenset({"x"}), adapter_slots=2)
    full = cand("w-full", adapters=frozenset({"x", "y"}), adapter_slots=2)
    none = cand("w-none")
    score, keep = AdapterAffinityScorer().score, AdapterFilter().keep
    c = ctx(adapter="bot")
    assert [score(c, w) for w in (holds, free, full)] == [1.0, 0.5, 0.0]
    assert [keep(c, w) for w in (holds, full, none)] == [True, True, False], "no adapters on w-none's engine"
    assert score(ctx(), full) == 1.0 and keep(ctx(), none), "a request without an adapter: all alike"
    picked = make_scheduler("kv_aware").schedule(c, [full, free, holds]).worker
    assert picked.worker_id == "w-holds"


async def test_an_adapter_just_sent_to_a_worker_counts_as_held_there_until_its_reports_say():
    from services.router.scheduling.hooks.adapters_sent import SENT_SECONDS, AdaptersSent
    from services.router.scheduling.scorers.adapter_affinity import AdapterAffinityScorer
    from tests.fakeclock import FakeClock

    clock = FakeClock()
    hook, score = AdaptersSent(clock), AdapterAffinityScorer().score
    a, b = cand("a", adapter_slots=2), cand("b", adapter_slots=2)
    first = ctx(adapter="bot")
    await hook.before(first, [a, b])
    hook.picked(first, b, [a, b])
    nxt = ctx(adapter="bot")
    await hook.before(nxt, [a, b])
    assert (score(nxt, a), score(nxt, b)) == (0.5, 1.0), "b is loading it: the next request goes there too"
    clock.now += SENT_SECONDS + 1
    later = ctx(adapter="bot")
    await hook.before(later, [a, b])
    assert score(later, b) == 0.5, "past SENT_SECONDS the worker's own reports say what it holds"


def test_every_profile_names_registered_plugins_and_each_plugin_registers_itself_once():
    from gaas.settings.router import PROFILES
    from services.router.scheduling import registry

    filters, scorers, pickers = (registry.plugins(k) for k in registry.KINDS)
    assert set(filters) == {"model", "not_tried", "breaker", "context_fit", "adapter", "window", "saturation"}
    assert set(scorers) == {"prefix", "queue", "kv_usage", "device_memory", "session", "adapter_affinity"}
    assert set(pickers) == {"round_robin", "max_score"}
    for name, p in PROFILES.items():
        s = make_scheduler(name)
        assert [f.name for f in s.filters] == list(p.filters) and s.picker.name == p.picker

    class Again(registry.get("scorer", "queue")):
        name = "queue"

    with pytest.raises(ValueError, match="two scorer plugins are named 'queue'"):
        registry.plugin("scorer")(Again)


def test_a_profile_naming_a_plugin_nobody_registered_is_refused_naming_the_ones_there_are(monkeypatch):
    from gaas.settings import router

    monkeypatch.setitem(router.PROFILES, "odd", router.Profile(("model", "fastest"), {}, "max_score"))
    with pytest.raises(ValueError, match="unknown filter 'fastest' in the odd profile; filters: adapter, breaker"):
        make_scheduler("odd")
