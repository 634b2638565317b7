"""Adaptive coalescing (services/router/coalescing.py): one token a message while the router is
lightly loaded, more as its streams grow, never past the cap; and the router asks the worker."""

import time

import pytest
from hypothesis import given
from hypothesis import strategies as st

from services.router.coalescing import Coalescing
from services.router.scheduling import WorkerId
from tests.unit.router.support import KEYS, FakeWorkers, OK


@pytest.mark.parametrize("in_flight, interval", [(0, 1), (3, 1), (7, 1), (8, 2), (12, 3), (31, 7), (32, 8), (500, 8)])
def test_tokens_per_message_grow_with_the_streams_in_flight(in_flight, interval):
    assert Coalescing(per_step=4, max_interval=8).interval(in_flight) == interval


def test_per_step_zero_turns_coalescing_off():
    assert Coalescing(per_step=0).interval(10_000) == 1


@given(st.integers(0, 10_000), st.integers(0, 10_000), st.integers(0, 64), st.integers(1, 64))
def test_the_interval_is_monotone_and_bounded(a, b, per_step, cap):
    c = Coalescing(per_step, cap)
    lo, hi = sorted((a, b))
    assert 1 <= c.interval(lo) <= c.interval(hi) <= max(1, cap)


async def test_a_busy_router_asks_the_worker_for_fuller_messages():
    from gaas.v1 import inference_pb2
    from tests.unit.router import support

    workers = FakeWorkers({"w0": OK})
    dispatcher = support.stages(("w0",), address="{w}", max_model_len=4096, workers_stub=workers, retries=0,
                                coalescing=Coalescing(per_step=2, max_interval=8))
    principal = KEYS["key-acme"]

    async def one():
        prepared = await dispatcher.preparer.prepare(inference_pb2.GenerateRequest(prompt="hi", max_tokens=2), principal)
        return [c async for c in dispatcher.relay.stream(prepared, principal, "req", None, time.perf_counter())]

    await one()
    for _ in range(6):  # six streams of this router already running
        dispatcher.inflight.start(WorkerId("w0"))
    await one()
    assert [req.stream_interval for _, req in workers.calls] == [0, 3]
