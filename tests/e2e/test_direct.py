"""The direct path (topology ingress.path: direct): the router decides each OpenAI generation at the
ingress (ext_proc) and the tokens stream from the worker to the ingress without passing through
it. The contract's pure parts, then a mesh of its own (`gaas up --ingress-path direct`, one worker)
used as a client would: the official openai client, usage in the ledger, refusals in OpenAI's
shape, a session turn (which the router still serves), a client hanging up."""

from __future__ import annotations

import itertools
import json
import os
import signal

import grpc
import openai
import pytest
from hypothesis import given
from hypothesis import strategies as st

from gaas.contracts import errors, pricing
from gaas.metering import direct
from gaas.v1 import common_pb2, worker_pb2
from services.router.extproc_wire import grpc_frame, grpc_unframe, immediate
from gaas.ops import probe
from gaas.ops.topology import LocalSockets, sockets_root
from tests.conftest import INGRESS_PATH
from tests.meshutil import (
    cli_tenant, cli_usage, generate, http, openai_client, own_mesh, refused_on_headers, served_again,
    wait_for_lines,
)
from tests.waiting import eventually

MODEL = "gaas-tiny"


# ------------------------------------------------------------ the contract, without a mesh

def test_a_grpc_frame_round_trips_and_anything_else_is_refused():
    assert grpc_unframe(grpc_frame(b"abc")) == b"abc"
    assert grpc_unframe(grpc_frame(b"")) == b""
    for bad in (b"", b"\x00\x00", b"\x01\x00\x00\x00\x01a", grpc_frame(b"abc") + b"x"):
        with pytest.raises(errors.InvalidArgument):
            grpc_unframe(bad)


def test_a_refusal_at_the_ingress_is_rendered_as_the_transcoder_renders_the_routers_own():
    err = errors.ResourceExhausted("tenant x has made 3 requests", reason="rate_limit_exceeded", retry_after=2.5,
                                   quota=errors.QuotaViolation("tenant:x", "requests per minute: 3"))
    r = immediate(err).immediate_response
    assert r.status.code == 429
    body = json.loads(r.body)
    # What the ingress's error filter reads: the gRPC code first, the reason, the retry delay.
    assert r.body.startswith(b'{"code": 8')
    assert body["message"] == "tenant x has made 3 requests"
    kinds = {d["@type"].rsplit(".", 1)[-1]: d for d in body["details"]}
    assert kinds["ErrorInfo"]["reason"] == "rate_limit_exceeded"
    assert kinds["RetryInfo"]["retry_delay"] == "2.500s"
    assert immediate(errors.NotFound("no such model")).immediate_response.status.code == 404


@given(
    queue=st.floats(0, 1e4), ttft=st.floats(0, 1e4), engine=st.floats(0, 1e5), ingress=st.floats(0, 1e3),
    tenant=st.floats(0, 1e3), router=st.floats(0, 1e3), router_queue=st.floats(0, 1e4), flight=st.floats(0, 10),
)
def test_a_direct_generations_decomposition_adds_up_to_its_total(queue, ttft, engine, ingress, tenant, router,
                                                                    router_queue, flight):
    d = worker_pb2.DirectGenerate(ingress_ms=ingress, tenant_ms=tenant, router_ms=router, router_queue_ms=router_queue,
                                  decided_unix=1000.0)
    t = common_pb2.Timings(queue_ms=queue, ttft_ms=ttft, engine_ms=engine)
    direct.complete(t, d, 1000.0 + flight)
    parts = sum(getattr(t, f"{p}_ms") for p in ("tenant", "router", "queue", "prefill", "decode", "net"))
    assert parts == pytest.approx(t.total_ms, abs=1e-6)
    assert min(t.prefill_ms, t.decode_ms, t.net_ms) >= 0
    assert t.net_ms == pytest.approx(ingress + flight * 1000, abs=1e-6)
    assert t.queue_ms == pytest.approx(router_queue + queue, abs=1e-6)


def test_the_report_of_a_requests_end_carries_no_text_and_reads_back():
    c = common_pb2.GenerateChunk(request_id="req-1", text="secret", token_ids=[1, 2], worker_id="worker-0",
                                 finish_reason=common_pb2.FINISH_REASON_STOP)
    c.usage.prompt_tokens, c.usage.completion_tokens = 7, 2
    c.timings.ttft_ms = 3.5
    back = direct.read_report(direct.report(c)).final
    assert back.request_id == "req-1" and back.usage.completion_tokens == 2 and back.timings.ttft_ms == 3.5
    assert not back.text and not back.token_ids
    assert direct.read_report("not base64 of a report!") is None


def test_a_worker_meters_a_direct_generation_as_the_router_admitted_it():
    d = worker_pb2.DirectGenerate(request_id="req-9")
    d.prompts.add(request_id="req-9", cache_salt="salt-acme")
    m = d.metering
    m.tenant, m.tier, m.key_id, m.model, m.model_version = "acme", "gold", "key_1", MODEL, "1.0.0"
    m.price_input, m.price_cached_input, m.price_output, m.admitted, m.prompt_tokens = 0.6, 0.06, 2.4, True, 12
    record = direct.metered(d, arrived=0.0)
    assert (record.request_id, record.principal.tenant, record.principal.tier, record.principal.key_id) == \
        ("req-9", "acme", "gold", "key_1")
    assert record.price == pricing.Price(0.6, 0.06, 2.4) and record.admitted and record.prompt_tokens == 12
    assert record.parts == 1


# ------------------------------------------------------------ a mesh on the direct path

@pytest.fixture(scope="module")
def direct_mesh(tmp_path_factory):
    """A mesh with two workers on the direct path, started by `gaas up` as a user would (not
    again when the suite runs on the router path: the direct path's tests ran in its own run)."""
    if INGRESS_PATH != "direct":
        pytest.skip("the direct path's own mesh: run with the suite on the direct path (the default)")
    with own_mesh(tmp_path_factory.mktemp("direct-mesh"), port_start=29000, workers=2, ingress_path="direct") as m:
        yield m


def test_the_openai_client_is_served_by_the_worker_with_the_router_out_of_the_stream(direct_mesh):
    c = openai_client(direct_mesh)
    r = c.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=8, extra_body={"ignore_eos": True})
    assert r.usage.completion_tokens == 8 and r.choices[0].finish_reason == "length"
    text = "".join(ch.choices[0].text for ch in c.completions.create(
        model=MODEL, prompt="Once upon a time", max_tokens=8, stream=True, extra_body={"ignore_eos": True})
        if ch.choices)
    assert text
    chat = c.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=4)
    assert chat.choices[0].message.role == "assistant" and chat.usage.completion_tokens <= 4
    # The ingress sent the generations to the workers' sidecars, not to the router's.
    workers = {w["address"] for w in direct_mesh.ready["workers"]}
    log = wait_for_lines(direct_mesh.run_dir / "logs" / "envoy-ingress-access.log", '"path":"/v1/chat/completions"')
    upstreams = {json.loads(x)["upstream"] for x in log.splitlines() if '"/v1/' in x and "completions" in x}
    assert upstreams and upstreams <= workers
    # And the router recorded each one as its own, from the worker's report.
    metrics = http(direct_mesh, "/metrics", method="GET", key="")[1]
    assert 'gaas_router_requests_total{model="gaas-tiny",outcome="length",tier="gold"} 3.0' in metrics


def ingress_key_checks(mesh) -> int:
    """The key checks (ext_authz) the ingress's Envoys have asked the routers for, all together."""
    root, total = sockets_root(mesh.run_dir.resolve()), 0
    for replica in itertools.count():
        admin = LocalSockets.of(root, f"ingress-{replica}").admin
        if not admin.exists():
            return total
        status, body = probe.envoy_admin(admin, r"/stats?filter=^http\.ingress\.ext_authz\.(ok|denied|error)$")
        assert status == 200 and b"ext_authz.ok" in body, body[:200]
        total += sum(int(line.rsplit(":", 1)[1]) for line in body.decode().splitlines() if ":" in line)


def test_an_http_clients_generation_costs_one_call_to_a_router(direct_mesh):
    """The key of an OpenAI request sent over HTTP is checked in its decision call, on its headers
    before its body is read: the ingress makes no key check of its own (it did, before the
    transcoder, whose routes it was decided by)."""
    c = openai_client(direct_mesh)
    c.models.list()  # (a route the ingress checks the key of itself: the counter is there)
    before = ingress_key_checks(direct_mesh)
    assert c.completions.create(model=MODEL, prompt="one call", max_tokens=1).choices
    assert c.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "one call"}],
                                     max_tokens=1).choices
    assert ingress_key_checks(direct_mesh) == before


def test_the_ledger_holds_exactly_what_the_client_was_told(direct_mesh):
    key = cli_tenant(direct_mesh, "direct-ledger")
    c = openai_client(direct_mesh, key)
    told = [c.completions.create(model=MODEL, prompt=f"count {i}", max_tokens=5 + i).usage for i in range(3)]
    chunks = list(c.completions.create(model=MODEL, prompt="streamed", max_tokens=6, stream=True,
                                       stream_options={"include_usage": True}))
    told.append(chunks[-1].usage)
    total = cli_usage(direct_mesh, "direct-ledger", 4)
    assert total["requests"] == 4
    assert total["prompt_tokens"] == sum(u.prompt_tokens for u in told)
    assert total["completion_tokens"] == sum(u.completion_tokens for u in told)


def test_refusals_at_the_ingress_come_in_openais_shape(direct_mesh):
    c = openai_client(direct_mesh)
    with pytest.raises(openai.NotFoundError) as info:
        c.completions.create(model="gpt-9", prompt="hi")
    assert info.value.code == "model_not_found" and "gpt-9" in info.value.message
    with pytest.raises(openai.AuthenticationError):
        openai_client(direct_mesh, "gaas_not_a_key").completions.create(model=MODEL, prompt="hi")
    with pytest.raises(openai.BadRequestError) as info:
        c.completions.create(model=MODEL, prompt="hi", temperature=9)
    assert info.value.param == "temperature"
    key = cli_tenant(direct_mesh, "direct-rpm", "--rpm", "2")
    limited = openai_client(direct_mesh, key)
    for _ in range(2):
        limited.completions.create(model=MODEL, prompt="hi", max_tokens=1)
    with pytest.raises(openai.RateLimitError) as info:
        limited.completions.create(model=MODEL, prompt="hi", max_tokens=1)
    assert info.value.code == "rate_limit_exceeded"
    assert int(info.value.response.headers["retry-after"]) >= 1
    # An unknown key is refused on the request's headers, before its body is read (or decided).
    status, body = refused_on_headers(direct_mesh, "/v1/completions", "gaas_not_a_key")
    assert "401" in status and "API key" in body


def test_a_client_that_hangs_up_is_billed_for_what_it_got_and_frees_its_place(direct_mesh):
    key = cli_tenant(direct_mesh, "direct-hangup", "--concurrency", "1")
    c = openai_client(direct_mesh, key)
    stream = c.completions.create(model=MODEL, prompt="a long one", max_tokens=400, stream=True,
                                  extra_body={"ignore_eos": True})
    for n, _ in enumerate(stream):
        if n == 4:
            break
    stream.close()
    total = cli_usage(direct_mesh, "direct-hangup", 1)
    assert total["requests"] == 1 and 5 <= total["completion_tokens"] < 400
    served_again(c)  # its one place is free again (the concurrency limit is 1)


def test_no_prefill_without_a_bill_on_the_direct_path(direct_mesh):
    """As on the router's path (tests/e2e/test_metering.py), with the worker metering: its engine runs a
    request whose client left to its first token, and the worker bills it."""
    from tests.meshutil import hang_ups_are_billed_for_what_engines_computed

    key = cli_tenant(direct_mesh, "direct-prefill")
    hang_ups_are_billed_for_what_engines_computed(direct_mesh, 2, "direct-prefill", key)


def test_the_native_grpc_api_is_served_by_the_worker_and_metered_once(direct_mesh):
    key = cli_tenant(direct_mesh, "direct-native")
    md = (("authorization", f"Bearer {key}"),)
    chunks = generate(direct_mesh, metadata=md, prompt="Once upon a time", max_tokens=6,
                      sampling=common_pb2.SamplingParams(ignore_eos=True))
    last = chunks[-1]
    assert last.usage.completion_tokens == 6 and last.finish_reason == common_pb2.FINISH_REASON_LENGTH
    assert sum(len(c.token_ids) for c in chunks) == 6 and last.tenant == "direct-native"
    assert last.timings.total_ms > 0 and last.worker_id.startswith("worker-")
    # Over HTTP too (the transcoder's JSON), then both in the ledger, once each.
    status, body = http(direct_mesh, "/v1/generate", json.dumps({"prompt": "JSON too", "max_tokens": 3}).encode(),
                        key=key)
    assert status == 200, body
    answer = [json.loads(line) for line in body.splitlines() if line.strip()]
    assert answer[-1]["usage"]["completion_tokens"] <= 3
    total = cli_usage(direct_mesh, "direct-native", 2)
    assert (total["requests"], total["completion_tokens"]) == (2, 6 + answer[-1]["usage"]["completion_tokens"])
    # Sent to the workers' sidecars, not to the router's.
    workers = {w["address"] for w in direct_mesh.ready["workers"]}
    log = wait_for_lines(direct_mesh.run_dir / "logs" / "envoy-ingress-access.log", '"path":"/v1/generate"')
    upstreams = {json.loads(x)["upstream"] for x in log.splitlines()
                 if '"/gaas.v1.Inference/Generate"' in x or '"/v1/generate"' in x}
    assert upstreams and upstreams <= workers, upstreams


def test_native_refusals_at_the_ingress_come_as_the_routers_own(direct_mesh):
    with pytest.raises(grpc.RpcError) as err:
        generate(direct_mesh, prompt="hi", model="no-such-model")
    assert err.value.code() == grpc.StatusCode.NOT_FOUND and "no-such-model" in err.value.details()
    with pytest.raises(grpc.RpcError) as err:
        generate(direct_mesh, metadata=(("authorization", "Bearer nope"),), prompt="hi")
    assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
    # An HTTP client of the native API gets the HTTP status and the status as JSON.
    status, body = http(direct_mesh, "/v1/generate", json.dumps({"prompt": "hi", "model": "no-such-model"}).encode())
    assert status == 404 and "no-such-model" in body


def test_a_session_turn_is_committed_by_the_worker_that_streamed_it(direct_mesh):
    """The router takes the turn at the ingress, the worker commits the reply before its last
    chunk: the next turn, sent as soon as the answer is in, finds it there (never session_busy),
    through the router's copy of the context too (it follows the worker's report, not a reload)."""
    c = openai_client(direct_mesh)
    first = c.completions.create(model=MODEL, prompt="My name is Ada.", max_tokens=3,
                                 extra_headers={"x-gaas-session": "direct-s1"})
    second = c.completions.create(model=MODEL, prompt="What is my name?", max_tokens=3,
                                  extra_headers={"x-gaas-session": "direct-s1"})
    turn1, turn2 = first.model_extra["gaas_session"], second.model_extra["gaas_session"]
    assert (turn1["turns"], turn1["version"], turn2["turns"], turn2["version"]) == (1, 1, 2, 2)
    assert second.usage.prompt_tokens > first.usage.prompt_tokens  # the first turn came before it
    chat = []
    for i in range(3):
        answer = c.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": f"turn {i}"}],
                                           max_tokens=2, stream=i == 1, extra_headers={"x-gaas-session": "direct-s2"})
        # A streamed turn is read to its end before the next is sent (a turn still streaming holds its
        # session: the next would rightly get 409; CI saw that on a loaded host).
        chat.append(list(answer) if i == 1 else answer)
    streamed = [ch for ch in chat[1] if ch.choices]
    assert streamed[-1].model_extra["gaas_session"]["turns"] == 2
    assert chat[2].model_extra["gaas_session"]["turns"] == 3
    # Every generation went to a worker, none to the router's own route.
    log = wait_for_lines(direct_mesh.run_dir / "logs" / "envoy-ingress-access.log", '"path":"/v1/chat/completions"')
    workers = {w["address"] for w in direct_mesh.ready["workers"]}
    served = [json.loads(x) for x in log.splitlines() if "completions" in x]
    assert {x["upstream"] for x in served if x["status"] == 200} <= workers
    metrics = http(direct_mesh, "/metrics", method="GET", key="")[1]
    assert 'gaas_router_session_turns_total{outcome="committed"} 5.0' in metrics
    reloads = float(next(x for x in metrics.splitlines() if x.startswith("gaas_router_session_reloads_total ")).split()[1])
    # (a next turn may outrun the report of the last one now and then, and be read from Redis)
    assert reloads <= 1, f"{reloads:.0f} of 5 turns reloaded: the router's copy did not follow the worker's commits"


def test_a_prompt_list_is_served_whole_by_one_worker_and_billed_once(direct_mesh):
    key = cli_tenant(direct_mesh, "direct-list")
    c = openai_client(direct_mesh, key)
    r = c.completions.create(model=MODEL, prompt=["one", "two two", "three three three"], max_tokens=4,
                             extra_body={"ignore_eos": True})
    assert sorted(x.index for x in r.choices) == [0, 1, 2] and r.usage.completion_tokens == 12
    chunks = list(c.completions.create(model=MODEL, prompt=["four", "five"], max_tokens=3, n=2, stream=True,
                                       stream_options={"include_usage": True}, extra_body={"ignore_eos": True}))
    assert {x.index for ch in chunks for x in ch.choices} == {0, 1, 2, 3}
    assert chunks[-1].usage.completion_tokens == 12
    total = cli_usage(direct_mesh, "direct-list", 2)
    assert (total["requests"], total["completion_tokens"]) == (2, 24)
    assert total["prompt_tokens"] == r.usage.prompt_tokens + chunks[-1].usage.prompt_tokens
    # The router recorded each as one of its own, from the worker's one report (none went unreported).
    router_log = direct_mesh.run_dir / "logs" / "router-0.log"
    eventually(lambda: router_log.read_text().count("served for direct-list") >= 2, 10,
               what="the router recording both requests from the worker's reports")


def test_a_request_whose_worker_is_gone_is_served_by_the_routers_second_choice(direct_mesh):
    """The router still sends a prompt where its prefix is cached, to a worker killed a moment
    ago (its lease has not lapsed, the KV directory still lists its blocks): the ingress sends
    each such request to the router's second choice, before any token; none fails."""
    tries = itertools.count()

    def landing_on_worker_1() -> str | None:  # (the native API says who served it)
        prompt = f"Second choice test {next(tries)}: " + "tell me about the rivers and the mountains. " * 12
        return prompt if generate(direct_mesh, prompt=prompt, max_tokens=1)[-1].worker_id == "worker-1" else None

    prompt = eventually(landing_on_worker_1, 60, every=0, what="a prompt whose prefix worker-1 holds")
    os.kill(direct_mesh.children["worker-1"], signal.SIGKILL)
    c = openai_client(direct_mesh)
    for n in range(6):
        r = c.completions.create(model=MODEL, prompt=prompt + f" ({n})", max_tokens=2)
        assert r.choices[0].text is not None
    log = wait_for_lines(direct_mesh.run_dir / "logs" / "envoy-ingress-access.log", '"attempts":2')
    retried = [json.loads(x) for x in log.splitlines() if '"attempts":2' in x]
    assert all(x["status"] == 200 for x in retried)


def restarted_pid(mesh, name: str, old: int, timeout: float = 30.0) -> int:
    """The pid of `name` once gaas up has started it again in place of pid old (its state file)."""
    def restarted() -> int | None:
        pid = json.loads((mesh.run_dir / "mesh.json").read_text())["children"].get(name)
        return pid if pid and pid != old else None

    return eventually(restarted, timeout, every=0.05, ignoring=(OSError, ValueError), what=f"gaas up restarting {name}")


def test_with_no_router_to_decide_clients_get_503_in_openais_shape_then_are_served_again(direct_mesh):
    """router-0 killed mid-stream: the streams it decided run to their end (the router is out of
    them once it has answered); until `gaas up` has it back, the ingress answers the decision it
    cannot ask for with a 503 a client can read and retry (not an empty reply); then requests are
    served."""
    c = openai_client(direct_mesh)
    streams = [c.completions.create(model=MODEL, prompt=f"decided before the router died {i}", max_tokens=96,
                                    stream=True, stream_options={"include_usage": True},
                                    extra_body={"ignore_eos": True}) for i in range(3)]
    for s in streams:
        next(s)  # its first chunk: decided, and streaming from its worker
    os.kill(direct_mesh.children["router-0"], signal.SIGKILL)
    # And again once gaas up has restarted it (1 s later), so that it stays away longer (its next
    # restart waits 2 s) than the ingress holds a request while retrying its router: a router back
    # within that serves the request, and no client sees the 503 this test is about.
    os.kill(restarted_pid(direct_mesh, "router-0", direct_mesh.children["router-0"]), signal.SIGKILL)
    for s in streams:
        chunks = list(s)
        assert chunks[-1].usage.completion_tokens == 96
        assert [ch.choices[0].finish_reason for ch in chunks if ch.choices][-1] == "length"
    def refused() -> openai.InternalServerError | None:
        try:
            c.completions.create(model=MODEL, prompt="is anyone deciding?", max_tokens=1)
        except openai.InternalServerError as exc:
            return exc
        return None

    err = eventually(refused, 10, every=0, what="a request refused while the router is down")
    assert err.status_code == 503 and err.code == "router_unavailable"
    assert "retry" in err.message and err.response.headers["retry-after"] == "1"
    assert err.response.headers["content-type"] == "application/json"
    served_again(c, timeout=90, refused=openai.InternalServerError)
