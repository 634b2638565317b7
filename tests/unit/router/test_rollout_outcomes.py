"""What the router tells the roll-out guard (outcomes of a model under a roll-out, in batches to a
Redis stream) and which requests it copies to a shadowing version."""

from __future__ import annotations

import json

from gaas.contracts.rollout import OUTCOMES_STREAM, Outcome, Split
from services.router.directory import ModelEntry, VersionEntry
from services.router.outcomes import Outcomes, RolloutReporter, RouterMetrics
from services.router.shadow import Shadow
from tests.waiting import eventually_async


class FakeRedis:
    def __init__(self, fail: bool = False) -> None:
        self.fail = fail
        self.added: list[tuple[str, dict]] = []

    async def xadd(self, key, fields, maxlen=None, approximate=True):
        if self.fail:
            raise ConnectionError("Redis is away")
        self.added.append((key, fields))


def model(split: Split | None, version: str = "1") -> ModelEntry:
    m = ModelEntry("m", "1", 2048, True, "/m", versions={"1": VersionEntry("/m", 2048), "2": VersionEntry("/m2", 2048,
                                                                                                      "canary")},
                   split=split)
    return m.at(version)


async def test_outcomes_of_a_model_under_a_rollout_go_to_the_stream_in_one_batch():
    redis = FakeRedis()
    reporter = RolloutReporter(redis)
    outcomes = Outcomes(RouterMetrics(), reporter)
    rolling = Split("m", stable="1", canary="2", weight=25)
    outcomes.rollout(model(rolling, "2"), "gold", True, 42.0, 10, 0.5)
    outcomes.rollout(model(rolling), "silver", False)
    outcomes.rollout(model(None), "gold", True, 1.0), outcomes.rollout(model(Split("m", "1")), "gold", True, 1.0)
    await reporter.flush()
    ((key, fields),) = redis.added
    rows = [Outcome.decode(r) for r in json.loads(fields["o"])]
    assert key == OUTCOMES_STREAM and [(o.model, o.version, o.tier, o.ok, o.ttft_ms) for o in rows] == [
        ("m", "2", "gold", True, 42.0), ("m", "1", "silver", False, None)], "only a model under a roll-out"
    await reporter.flush()
    assert len(redis.added) == 1, "nothing new, nothing sent"


async def test_with_redis_away_the_outcomes_are_dropped_and_the_request_goes_on():
    reporter = RolloutReporter(FakeRedis(fail=True))
    reporter.add(Outcome(at=1.0, version="2", tier="gold", model="m"))
    await reporter.flush()  # no exception: the guard judges on what it gets


class NoCopy(Exception):
    pass


class RecordingShadow(Shadow):
    def __init__(self, max_copies: int = 32) -> None:
        super().__init__(None, None, None, None, Outcomes(RouterMetrics()), max_copies=max_copies)
        self.copied: list[str] = []

    async def _copy(self, request, principal, served_by, version, request_id):
        self.copied.append(version)


async def test_a_share_of_the_stable_versions_requests_is_copied_while_shadowing():
    from gaas.contracts.principal import Principal

    shadow = RecordingShadow(max_copies=1000)
    p = Principal(tenant="acme", tier="gold", key_id="k", cache_salt="s")
    shadowing = Split("m", stable="1", canary="2", weight=0, shadow=50)
    for _ in range(100):
        shadow.maybe_copy(None, p, model(shadowing), "r")
    shadow.maybe_copy(None, p, model(shadowing, "2"), "r")  # served by the new version itself: no copy
    shadow.maybe_copy(None, p, model(Split("m", stable="1", canary="2", weight=5)), "r")  # a canary: no copy
    await eventually_async(lambda: len(shadow.copied) >= 50, 5, every=0, what="the copies sent")
    assert len(shadow.copied) == 50 and set(shadow.copied) == {"2"}


async def test_copies_beyond_the_cap_are_dropped_not_queued():
    from gaas.contracts.principal import Principal

    shadow = RecordingShadow(max_copies=3)
    p = Principal(tenant="acme", tier="gold", key_id="k", cache_salt="s")
    for _ in range(10):
        shadow.maybe_copy(None, p, model(Split("m", stable="1", canary="2", shadow=100)), "r")
    await eventually_async(lambda: len(shadow.copied) >= 3, 5, every=0, what="the copies sent")
    assert (len(shadow.copied), shadow.dropped) == (3, 7)
