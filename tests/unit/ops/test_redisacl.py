"""Least privilege in Redis (gaas/ops/redisacl.py): every key and channel each service makes is within
its user's patterns (so the mesh runs under them), and against a real Redis each user can do its
job and nothing beside it: no other service's keys, no budget written by a router, no admin
command."""

from __future__ import annotations

import fnmatch
import json

import pytest
import redis as redis_sync

from gaas.contracts import rollout, sessions, usage as metering
from gaas.contracts.autoscale import DEMAND_KEY
from gaas.metering import admission, direct, peers
from gaas.ops import redisacl
from gaas.contracts.usage import UsageEvent
from services.control import registry
from services.router.auth import SharedKeys


TENANT = "acme"


def _made_by() -> dict[str, list[str]]:
    """Keys (and &channels) each service kind's code makes, from the modules that define them."""
    event = UsageEvent(request_id="r1", tenant=TENANT, key_id="k", tier="gold", model="m", model_version="1",
                       prompt_tokens=1, cached_tokens=0, completion_tokens=1, cost_input_micros=0, cost_cached_micros=0,
                       cost_output_micros=0, outcome="finished", worker="w", finished_ms=1_800_000_000_000)
    record_keys, _ = admission.record_args(event)
    claim_keys, _ = admission.record_args(event, "claim")
    return {
        "router": [*admission.admit_keys(TENANT, "202612", "r1"), *record_keys, *claim_keys,
                   *admission.release_keys(TENANT), sessions.session_key(TENANT, "s1"), sessions.index_key(TENANT),
                   "&" + direct.report_channel("router-0"), rollout.OUTCOMES_STREAM, DEMAND_KEY.format("gaas-tiny"),
                   "&" + registry.CHANGED_CHANNEL, peers.ROUTERS_KEY,
                   SharedKeys.PREFIX + "0" * 64],
        "worker": [*admission.record_args(event, "own")[0], admission.progress_key(TENANT, "r1"),
                   sessions.session_key(TENANT, "s1"), sessions.index_key(TENANT), "&" + direct.report_channel("router-0")],
        "billing": [metering.STREAM, admission.spend_key(TENANT, "202612"), admission.budget_key(TENANT)],
        "control": [registry._KEY.format("worker-0"), registry._INDEX, registry._ALIVE, rollout.OUTCOMES_STREAM,
                    rollout.LEADER_KEY, DEMAND_KEY.format("gaas-tiny"), "&" + registry.CHANGED_CHANNEL],
    }


def _allows(patterns: tuple[str, ...], key: str) -> bool:
    if key.startswith("&"):
        return any(fnmatch.fnmatchcase(key[1:], p[1:]) for p in patterns if p.startswith("&"))
    return any(fnmatch.fnmatchcase(key, p.split("~", 1)[1]) for p in patterns if "~" in p)


@pytest.mark.parametrize("kind", sorted(redisacl.PERMISSIONS))
def test_every_key_a_service_makes_is_within_its_users_patterns(kind):
    made = _made_by()[kind]
    assert made
    assert [k for k in made if not _allows(redisacl.PERMISSIONS[kind], k)] == []


@pytest.fixture
def acl(redis_url):
    """The session's Redis with the services' users, and a client as each."""
    admin = redis_sync.Redis.from_url(redis_url)
    users = redisacl.users()
    for line in redisacl.config_lines(users):
        if line.startswith("user "):
            admin.execute_command("ACL", "SETUSER", *line.split()[1:])
    clients = {kind: redis_sync.Redis.from_url(redisacl.url_for(redis_url, u)) for kind, u in users.items()}
    yield admin, clients
    for c in clients.values():
        c.close()
    for u in users.values():
        admin.execute_command("ACL", "DELUSER", u.name)
    admin.close()


def test_each_user_does_its_job_and_nothing_beside_it(acl):
    admin, c = acl
    router, billing, control, worker = c["router"], c["billing"], c["control"], c["worker"]
    admin.flushdb()
    # The router admits (its script reads the budget) and appends usage.
    admin.set(admission.budget_key(TENANT), 10**9)
    answer = router.eval(admission.ADMIT, 6, *admission.admit_keys(TENANT, "202612"),
                         "r1", 1, 10, 1_800_000_000_000, 1_800_000_900_000, 0, 0, 0, 1)
    assert int(answer[0]) == admission.ADMITTED
    # It counts the live routers (gaas.metering.peers), in a transaction.
    pipe = router.pipeline(transaction=True)
    pipe.zadd(peers.ROUTERS_KEY, {"router-0": 1}).zremrangebyscore(peers.ROUTERS_KEY, "-inf", 0)
    assert pipe.zcard(peers.ROUTERS_KEY).execute()[-1] == 1
    # Billing reads the stream and sets budgets; it cannot touch sessions or leases.
    router.xadd(metering.STREAM, {"event": json.dumps({"x": 1})})
    assert billing.xrange(metering.STREAM)
    billing.set(admission.budget_key(TENANT), 5)
    for client, key in ((billing, sessions.session_key(TENANT, "s")), (billing, registry._INDEX),
                        (router, registry._INDEX), (worker, registry._INDEX), (worker, admission.budget_key(TENANT)),
                        (control, admission.budget_key(TENANT))):
        with pytest.raises(redis_sync.exceptions.NoPermissionError):
            client.get(key)
    # On the direct path a worker commits a session's turn, writes its streams' progress, records
    # their usage and reports their ends on a router's channel.
    worker.hset(sessions.session_key(TENANT, "s"), "v", 1)
    worker.eval(admission.PROGRESS, 1, admission.progress_key(TENANT, "r1"), "3 0")
    worker.publish(direct.report_channel("router-0"), "x")
    # Control announces the registry's changes to the routers; a worker cannot.
    control.publish(registry.CHANGED_CHANNEL, "1")
    with pytest.raises(redis_sync.exceptions.NoPermissionError):
        worker.publish(registry.CHANGED_CHANNEL, "1")
    # No admin command for anyone.
    for client in c.values():
        for command in (("FLUSHALL",), ("CONFIG", "GET", "maxmemory"), ("KEYS", "*"), ("SHUTDOWN",), ("ACL", "LIST")):
            with pytest.raises(redis_sync.exceptions.NoPermissionError):
                client.execute_command(*command)
    admin.flushdb()
