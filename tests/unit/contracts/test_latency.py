"""The latency decomposition (gaas/contracts/latency.py): its parts add up to the total, each
what a hop measured, whatever the clocks of the hosts; the ingress's stamp believed only when plausible."""

from __future__ import annotations


from hypothesis import given
from hypothesis import strategies as st

from gaas.contracts import latency
from gaas.runtime.context import INGRESS_START_HEADER
from gaas.v1 import common_pb2

ms = st.floats(0, 5_000, allow_nan=False)


@given(engine_queue=ms, prefill=ms, decode=ms, net=ms, tenant=ms, router=ms, router_queue=ms, ingress=ms)
def test_the_parts_add_up_to_the_total_and_are_each_what_was_measured(
    engine_queue, prefill, decode, net, tenant, router, router_queue, ingress,
):
    # A request as each hop would see it: the worker's own clock, the router's around it.
    t = common_pb2.Timings(queue_ms=engine_queue, ttft_ms=engine_queue + prefill,
                           engine_ms=engine_queue + prefill + decode)
    call_s = (t.engine_ms + net) / 1000
    total_s = (tenant + router + router_queue) / 1000 + call_s
    latency.complete(t, total_s=total_s, tenant_s=tenant / 1000, router_queue_s=router_queue / 1000, call_s=call_s,
                     ingress_s=ingress / 1000)
    tol = 1e-6 * (1 + total_s * 1000 + ingress)
    assert abs(t.total_ms - sum(latency.part_ms(t, p) for p in latency.PARTS)) < tol
    assert abs(t.total_ms - (total_s * 1000 + ingress)) < tol
    expected = {"tenant": tenant, "router": router, "queue": router_queue + engine_queue, "prefill": prefill,
                "decode": decode, "net": net + ingress}
    for part, value in expected.items():
        assert abs(latency.part_ms(t, part) - value) < tol, part
    assert abs(t.ingress_ms - ingress) < tol and abs(t.router_queue_ms - router_queue) < tol


def test_the_usage_events_writing_after_the_last_token_is_the_tenants_time_but_not_the_first_tokens():
    t = common_pb2.Timings(queue_ms=2, ttft_ms=40, engine_ms=200)
    latency.complete(t, total_s=0.230, tenant_s=0.004, router_queue_s=0.0, call_s=0.220, ingress_s=0.001)
    before = latency.first_token_ms(t)
    assert abs(before - (t.total_ms - t.decode_ms)) < 1e-9
    latency.add_tenant(t, 0.150)  # a slow write of the usage event, after the last token
    assert abs(t.tenant_ms - 154) < 1e-6 and abs(t.total_ms - 381) < 1e-6
    assert abs(t.total_ms - sum(latency.part_ms(t, p) for p in latency.PARTS)) < 1e-6
    assert latency.first_token_ms(t) == before
    assert latency.as_dict(t)["ttft"] == round(before, 3)


def test_a_worker_clock_ahead_of_the_routers_never_gives_negative_parts():
    t = common_pb2.Timings(queue_ms=5, ttft_ms=3, engine_ms=2)  # inconsistent: each at least the one before
    latency.complete(t, total_s=0.001, tenant_s=0.0, router_queue_s=0.0, call_s=0.0001, ingress_s=0.0)
    assert all(latency.part_ms(t, p) >= 0 for p in latency.PARTS)


def test_the_ingress_stamp_is_believed_only_when_plausible():
    now = 1_800_000_000.0
    assert abs(latency.ingress_seconds({INGRESS_START_HEADER: f"{now - 0.0015:.6f}"}, now) - 0.0015) < 1e-5
    for bad in ("", "soon", f"{now + 1}", f"{now - 3600}", "nan"):
        assert latency.ingress_seconds({INGRESS_START_HEADER: bad}, now) == 0.0


# ------------------------------------------------------------------ through the mesh
