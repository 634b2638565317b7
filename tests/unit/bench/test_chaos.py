"""The soak's pure parts (bench.common.chaos, bench.common.loadgen): which process of each kind is
killed and in what order, which kills may not overlap, what a call's outcome is, and how usage the
clients received is found in the ledger or counted lost; without a mesh."""

import pytest

from bench.common.chaos import Kill, Target, kind_of, lost, report, targets
from bench.common.loadgen import Call, tally

CHILDREN = ["redis", "ingress-0", "ingress-1", "control-0", "sidecar-control-0", "router-0", "router-1",
            "sidecar-router-0", "sidecar-router-1", "kvcache-0", "sidecar-kvcache-0", "billing-0",
            "sidecar-billing-0", "worker-0", "worker-1", "sidecar-worker-0", "sidecar-worker-1", "tracesink"]


@pytest.mark.parametrize("name, kind", [
    ("router-1", "router"), ("sidecar-router-0", "sidecar-router"), ("ingress-1", "ingress"), ("redis", "redis"),
    ("worker-1:engine", "engine"), ("tracesink", "tracesink"), ("worker-12", "worker"),
])
def test_a_process_kind_is_its_name_without_the_instance_number(name, kind):
    assert kind_of(name) == kind


def test_one_of_each_kind_is_killed_every_ingress_too_the_engine_first_and_the_workers_last():
    plan = [t.name for t in targets(CHILDREN)]
    assert plan == ["worker-1:engine", "ingress-0", "ingress-1", "redis", "router-0", "control-0", "billing-0",
                    "kvcache-0", "sidecar-router-0", "sidecar-control-0", "sidecar-billing-0", "sidecar-kvcache-0",
                    "tracesink", "sidecar-worker-0", "worker-0"]


def test_a_worker_its_engine_and_its_sidecar_are_one_group_and_so_are_the_ingresses():
    assert {Target(n, kind_of(n)).group for n in ("worker-0", "worker-1:engine", "sidecar-worker-0")} == {"worker"}
    assert {Target(n, kind_of(n)).group for n in ("router-0", "sidecar-router-1")} == {"router"}
    assert {Target(n, kind_of(n)).group for n in ("ingress-0", "ingress-1")} == {"ingress"}


def call(id="a", end=1.0, tokens=0, usage=None, error="", statuses=(200,)):
    c = Call(id, start=0.0, end=end, first=0.5 if tokens else None, tokens=tokens, usage=usage, error=error)
    c.statuses = list(statuses)
    return c


@pytest.mark.parametrize("c, outcome", [
    (call(tokens=24, usage=(10, 0, 24)), "ok"),
    (call(tokens=5), "mid_stream"),
    (call(tokens=5, error="APIError: worker lost"), "mid_stream"),
    (call(error="APIConnectionError: Connection error.", statuses=(0, 0, 0)), "before_first_token"),
    (call(), "before_first_token"),  # a stream that ended before its first token
])
def test_a_call_ends_whole_cut_mid_stream_or_before_its_first_token(c, outcome):
    assert c.outcome == outcome


@pytest.mark.parametrize("c, billed, want", [
    (call(tokens=24, usage=(10, 0, 24)), (1, 10, 0, 24), 0),
    (call(tokens=24, usage=(10, 0, 24)), None, 34),  # not in the ledger at all
    (call(tokens=24, usage=(10, 0, 24)), (1, 10, 0, 20), 4),
    (call(tokens=24, usage=(10, 0, 24)), (2, 20, 0, 25), 0),  # billed beyond: not lost
    (call(tokens=7), (1, 10, 0, 9), 0),  # cut: billed for what the engine computed
    (call(tokens=7), (1, 10, 0, 5), 2),
    (call(), None, 0),  # nothing received, nothing to lose
])
def test_usage_is_lost_when_the_ledger_bills_less_than_the_client_received(c, billed, want):
    assert lost(c, billed) == want


def test_a_kill_is_charged_the_calls_that_ended_until_the_next_kill():
    class Load:
        calls = [call("w", end=0.5, tokens=24, usage=(9, 0, 24)),
                 call("a", end=1.5, statuses=(0, 0, 0)), call("b", end=2.5, tokens=24, usage=(9, 0, 24),
                                                           statuses=(503, 200)),
                 call("c", end=3.5, tokens=3), call("d", end=4.0, tokens=24, usage=(9, 0, 24), statuses=(429, 200))]

    kills = [Kill(Target("ingress-0", "ingress"), 1, at=1.0, back=2.0), Kill(Target("redis", "redis"), 2, at=3.0)]
    rows = {"b": (1, 9, 0, 24), "c": (1, 9, 0, 3), "w": (1, 9, 0, 24)}
    per_kill, total = report(kills, Load(), rows)
    assert [(r["target"], r["requests"], r["failed_before_first_token"], r["cut_mid_stream"], r["retried"],
             r["answered_429"], r["back_s"]) for r in per_kill] == [
        ("ingress-0", 2, 1, 0, 1, 0, 1.0), ("redis", 2, 0, 1, 1, 1, None)]
    assert per_kill[1]["usage_lost_tokens"] == 9 + 24 and per_kill[1]["unbilled"] == 1
    assert total["requests"] == 5 and total["usage_lost_tokens"] == 33


def test_tally_counts_what_the_openai_client_saw_fail_not_what_it_retried():
    t = tally([call(tokens=24, usage=(1, 0, 24), statuses=(0, 200)), call(statuses=(0, 0, 0))])
    assert (t["requests"], t["failed_before_first_token"], t["retried"]) == (2, 1, 1)


def test_control_is_not_killed_while_a_router_it_must_answer_is_not_back():
    assert Target("router-0", "router").needs == ("control",) == Target("sidecar-router-0", "sidecar-router").needs
    assert Target("billing-0", "billing").needs == () == Target("worker-0", "worker").needs
