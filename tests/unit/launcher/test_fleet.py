"""The workers a mesh runs, reconciled with the control plane's pools."""

from __future__ import annotations

import pytest

from gaas.launcher.fleet import PoolSpec, Running, reconcile

V1 = PoolSpec("tiny", "1", "/m/tiny", replicas="auto")
V2 = PoolSpec("tiny", "2", "/m/tiny2", replicas=1, role="canary")
SMALL = PoolSpec("small", "1", "/m/small", replicas=2, device="gpu")


@pytest.mark.parametrize("pools, running, auto, start, stop", [
    # A fresh mesh: auto is the host's number.
    ([V1], [], 2, [(0, V1), (1, V1)], []),
    # A canary beside the stable version: the next free number.
    ([V1, V2], [Running(0, V1.key), Running(1, V1.key)], 2, [(2, V2)], []),
    # Promoted: the old version's workers drain, highest first.
    ([PoolSpec("tiny", "2", "/m/tiny2", replicas=1)], [Running(0, V1.key), Running(1, V1.key), Running(2, V2.key)],
     2, [], [1, 0]),
    # A number freed by a worker that left is taken again; a retiring one's is not.
    ([V1], [Running(1, V1.key), Running(0, V2.key, retiring=True)], 2, [(2, V1)], []),
    # Scaled down.
    ([PoolSpec("tiny", "1", "/m/tiny", replicas=1)], [Running(0, V1.key), Running(1, V1.key)], 1, [], [1]),
    # Nothing to do.
    ([V1], [Running(0, V1.key)], 1, [], []),
])
def test_the_workers_follow_the_pools(pools, running, auto, start, stop):
    actions = reconcile(pools, running, auto)
    assert (actions.start, actions.stop) == (start, stop)
    assert bool(actions) is bool(start or stop)


def test_a_pool_this_host_cannot_run_gets_no_worker():
    actions = reconcile([V1, SMALL], [], 1, placeable=lambda p: p.device != "gpu")
    assert actions.start == [(0, V1)]


def test_a_pool_from_control_reads_its_replicas_and_engine():
    from gaas.v1 import control_pb2

    p = PoolSpec.from_pb(control_pb2.Pool(model="m", version="2", source="/s", replicas="auto",
                                          engine_json='{"max_num_seqs": 4}', role="canary"))
    assert (p.replicas, dict(p.engine), p.role, p.count(3)) == ("auto", {"max_num_seqs": 4}, "canary", 3)
    assert PoolSpec.from_pb(control_pb2.Pool(model="m", version="1", source="/s", replicas="2")).count(3) == 2
