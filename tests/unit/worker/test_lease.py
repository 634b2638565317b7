"""The lease keeper keeps a serving worker in the registry whatever its load report does."""

from __future__ import annotations

import asyncio
import logging

from gaas.v1 import common_pb2
from gaas.v1 import control_pb2 as pb
from services.worker.lease import LeaseKeeper
from tests.waiting import eventually_async


class Control:
    def __init__(self, fail_first: int = 0) -> None:
        self.registrations: list[pb.RegisterWorkerRequest] = []
        self.renewals: list[pb.RenewLeaseRequest] = []
        self.fail_first = fail_first

    async def RegisterWorker(self, request, timeout=None):
        if self.fail_first:
            self.fail_first -= 1
            raise RuntimeError("a bug on the way")
        self.registrations.append(request)
        return pb.Lease(ttl_seconds=3)

    async def RenewLease(self, request, timeout=None):
        self.renewals.append(request)
        return pb.Lease(ttl_seconds=3)


async def test_a_failing_load_report_does_not_keep_the_worker_out_of_the_registry(caplog):
    control = Control()

    def load() -> common_pb2.WorkerLoad:
        raise AttributeError("'AsyncLLM' object has no attribute 'get_num_unfinished_requests'")

    keeper = LeaseKeeper(control, pb.WorkerInfo(worker_id="worker-0", address="127.0.0.1:1"), 0.05, load=load)
    with caplog.at_level(logging.ERROR, logger="services.worker.lease"):
        keeper.start()
        await asyncio.wait_for(keeper.registered.wait(), 5)
        await eventually_async(lambda: len(control.renewals) >= 2, 5, every=0.01, what="two renewals")
    keeper._task.cancel()
    assert not control.registrations[0].worker.HasField("load")
    assert sum("cannot read this worker's load" in r.message for r in caplog.records) == 1  # said once, not per renewal


async def test_an_unexpected_error_is_logged_and_retried_not_fatal(caplog):
    control = Control(fail_first=2)
    keeper = LeaseKeeper(control, pb.WorkerInfo(worker_id="worker-0", address="127.0.0.1:1"), 0.05,
                         load=lambda: common_pb2.WorkerLoad(worker_id="worker-0", running_requests=1))
    with caplog.at_level(logging.ERROR, logger="services.worker.lease"):
        keeper.start()
        await asyncio.wait_for(keeper.registered.wait(), 10)
    keeper._task.cancel()
    assert control.registrations[0].worker.load.running_requests == 1
    assert any("registration or renewal failed (RuntimeError" in r.message for r in caplog.records)


async def test_every_renewal_tells_the_engine_which_adapters_the_catalogue_holds():
    """Not only when the catalogue changes: an adapter a lagging router had loaded here just after
    its removal must go at the next renewal too."""
    control = Control()
    control.RenewLease = lambda request, timeout=None: _lease_with(control, request, [7, 9])
    told: list[frozenset[int]] = []

    async def adapters(ids):
        told.append(ids)

    keeper = LeaseKeeper(control, pb.WorkerInfo(worker_id="worker-0", address="127.0.0.1:1"), 0.05,
                         adapters=adapters)
    keeper.start()
    await eventually_async(lambda: len(told) >= 3, 5, every=0.01, what="three renewals told of the adapters")
    keeper._task.cancel()
    assert told[1:3] == [frozenset({7, 9})] * 2, "the same catalogue, told again at each renewal"


async def _lease_with(control, request, ids):
    control.renewals.append(request)
    return pb.Lease(ttl_seconds=3, adapter_ids=ids)
