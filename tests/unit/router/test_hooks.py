"""The hooks around a scheduling cycle: each kind runs in order, and the router's own plugins do
what the router's stages did inline before (the KV answer into the context, in-flight counts, blocks
provisioned only when a choice was made, the flow told of each response)."""

from __future__ import annotations


import grpc

from gaas.contracts import qos
from services.router.flow import Flow
from services.router.scheduling import Candidate, RequestContext, WorkerId
from services.router.scheduling.hooks import Hooks
from services.router.scheduling.hooks.flow_accounting import FlowAccounting
from services.router.scheduling.hooks.inflight import InflightSince
from services.router.scheduling.hooks.prediction import PredictionCheck
from services.router.scheduling.hooks.provision import Provision
from services.router.scheduling.types import PostResponse, Response

W0, W1 = WorkerId("w0"), WorkerId("w1")
CANDS = [Candidate(W0, "w0:1", "tiny", "1", 64, block_size=16), Candidate(W1, "w1:1", "tiny", "1", 64, block_size=16)]


class Recorder(PostResponse):
    name = "recorder"

    def __init__(self, seen: list, tag: str) -> None:
        self.seen, self.tag = seen, tag

    def first_token(self, r): self.seen.append((self.tag, "first_token", r.worker))
    def failed(self, r): self.seen.append((self.tag, "failed", r.code))
    def served(self, r): self.seen.append((self.tag, "served", r.cached_tokens))
    def ended(self, r): self.seen.append((self.tag, "ended", r.worker))


def test_response_hooks_run_in_their_order_for_each_event():
    seen: list = []
    hooks = Hooks(response=[Recorder(seen, "a"), Recorder(seen, "b")])
    hooks.first_token(Response(W0))
    hooks.served(Response(W0, cached_tokens=32))
    hooks.ended(Response(W0))
    assert seen == [("a", "first_token", W0), ("b", "first_token", W0), ("a", "served", 32), ("b", "served", 32),
                    ("a", "ended", W0), ("b", "ended", W0)]
    hooks.succeeded(Response(W0))  # a hook that does not override an event ignores it
    assert len(seen) == 6


async def test_pre_cycle_hooks_gather_the_requests_sent_since_each_report():
    ctx = RequestContext(model="tiny")
    sent_since = {W0: 4, W1: 0}
    await Hooks(pre=[InflightSince(lambda w, reported_ms: sent_since[w])]).before(ctx, CANDS)
    assert ctx.inflight == {W0: 4, W1: 0}


def test_blocks_are_provisioned_under_their_owner_only_when_the_cycle_had_a_choice():
    class KV:
        calls: list = []

        def provision(self, worker, hashes, owner, best_matched=0):
            self.calls.append((worker, list(hashes), owner, best_matched))

    kv = KV()
    ctx = RequestContext(model="tiny", block_hashes=[1, 2], cache_owner="acme", prefix={W0: 1})
    Provision(kv).picked(ctx, CANDS[1], CANDS)
    Provision(kv).picked(ctx, CANDS[0], CANDS[:1])  # one candidate: the engine's events tell the directory
    Provision(kv).picked(RequestContext(model="tiny"), CANDS[0], CANDS)  # no full block
    assert kv.calls == [(W1, [1, 2], "acme", 1)]


def test_the_flow_learns_first_tokens_failures_and_ends_through_its_hook():
    flow = Flow(qos.DEFAULT_POLICIES)
    hook = FlowAccounting(flow)
    flow.windows.acquire(W0)
    flow.breakers.started(W0)
    assert flow.windows.state()[W0].in_flight == 1
    hook.failed(Response(W0, "gold", code=grpc.StatusCode.INTERNAL, detail="boom"))
    assert flow.breakers.state()[W0].consecutive == 1
    hook.first_token(Response(W0, "gold", ttft_ms=5.0, seen_ms=6.0))
    assert flow.breakers.state()[W0].consecutive == 0
    hook.ended(Response(W0, "gold"))
    assert flow.windows.state()[W0].in_flight == 0


def test_prediction_check_gets_what_the_worker_served_beside_what_was_predicted():
    checked = []
    PredictionCheck(lambda *a: checked.append(a)).served(
        Response(W0, cached_tokens=16, confirmed_blocks=3, block_size=16))
    assert checked == [(W0, 3, 16, 16)]
