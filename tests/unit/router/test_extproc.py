"""The router's decision at the ingress (services/router/extproc.py; ingress.path: direct), with the
directory and tokenizer faked: a key judged on the headers, before the body; a placement holds its
worker's room until the request ends; the worker's report records it as one of the router's own
streams; a request no worker streams any more (its progress goes unwritten) is swept: its room and
reservation freed; a worker's failure counts against its breaker."""

import time

import grpc
import pytest

from gaas.metering import admission, direct
from gaas.contracts.principal import Principal
from gaas.v1 import common_pb2, inference_pb2
from services.router.auth import Authenticator
from services.router.stages import Stages
from services.router.extproc import ExternalProcessor, _Pending
from services.router.pipeline import Pipeline
from services.router.directory import ModelEntry
from services.router.scheduling import Candidate, WorkerId
from tests.unit.router import support
from tests.waiting import eventually_async

ACME = Principal("acme", "gold", "key_1", "salt-acme")


def stages(workers=("w0",)) -> Stages:
    return support.stages(workers, metrics=support.metrics())


def in_flight(d: Stages, worker: str = "w0") -> int:
    return d.flow.windows.state()[WorkerId(worker)].in_flight


def final(request_id: str) -> common_pb2.GenerateChunk:
    c = common_pb2.GenerateChunk(request_id=request_id, finish_reason=common_pb2.FINISH_REASON_LENGTH)
    c.usage.prompt_tokens, c.usage.completion_tokens, c.usage.cached_tokens = 5, 4, 0
    c.timings.ttft_ms, c.timings.decode_ms, c.timings.total_ms = 3.0, 6.0, 12.0
    return c


async def placed(d: Stages, request_id: str = "req-1"):
    prepared = await d.preparer.prepare(inference_pb2.GenerateRequest(model="tiny", prompt="hi", max_tokens=4), ACME)
    return await d.placer.place_direct(prepared, ACME, request_id, None)


async def test_a_placement_holds_its_room_until_the_workers_report_records_it():
    d = stages()
    p = await placed(d)
    assert p.worker.address == "w0:1" and p.request.request_id == "req-1" and p.request.cache_salt == "salt-acme"
    assert p.fallback is None and p.addresses == "w0:1"  # no other worker to fall back on
    assert in_flight(d) == 1 and d.in_flight == 1
    ep = ExternalProcessor(Pipeline(d, Authenticator(None, 1.0)), 1 << 20, instance="router-0")
    ep._pending["req-1"] = _Pending(p, None)
    ep.reported(direct.report(final("req-1")))
    assert in_flight(d) == 0 and d.in_flight == 0 and ep.pending == 0
    m = d.metrics
    assert m.requests.labels("tiny", "gold", "length")._value.get() == 1
    assert m.tokens.labels("tiny", "gold", "completion")._value.get() == 4
    # The TTFT the tenant saw: everything before the decode.
    assert m.ttft_seconds.labels("tiny", "gold")._sum.get() == pytest.approx(0.006)
    # A second report of the same request (or of one it never placed) changes nothing.
    ep.reported(direct.report(final("req-1")))
    ep.reported(direct.report(final("req-unknown")))
    assert m.requests.labels("tiny", "gold", "length")._value.get() == 1


class FakeMeter:
    def __init__(self):
        self.released = []
        self.claimed = []
        self.done = []

    def release_later(self, m):
        self.released.append(m)

    def claim_later(self, m):
        self.claimed.append(m)

    def ended(self, m, used_tokens=None):
        self.done.append(m)


class FakeRedis:
    """A progress key per request id, and its remaining life (ms), as GET and PTTL read them."""

    def __init__(self, keys: dict[str, tuple[str | None, int]]) -> None:
        self.keys = keys

    def pipeline(self, transaction=False):
        return _Pipe(self.keys)


class _Pipe:
    def __init__(self, keys):
        self._keys, self._ops = keys, []

    def get(self, key):
        self._ops.append((key, 0))

    def pttl(self, key):
        self._ops.append((key, 1))

    async def execute(self):
        out = []
        for key, which in self._ops:
            found = next((v for rid, v in self._keys.items() if key.endswith(":" + rid)), (None, -2))
            out.append(found[which])
        return out


def written(seconds_ago: float) -> int:
    """A progress key's PTTL, seconds_ago after its last write."""
    return int((admission.PROGRESS_TTL_SECONDS - seconds_ago) * 1000)


def pending(d, p, reservation, age_s: float) -> tuple[ExternalProcessor, FakeMeter]:
    meter = FakeMeter()
    ep = ExternalProcessor(Pipeline(d, Authenticator(None, 1.0), meter), 1 << 20, instance="router-0",
                           max_stream_s=60)
    ep._pending["req-1"] = _Pending(p, reservation, None, time.monotonic() - age_s)
    return ep, meter


async def test_a_request_whose_progress_goes_unwritten_ends_lost_and_is_billed_from_that_progress():
    """Its worker's process died: no report will come; the sweep frees the room and claims the usage."""
    d = stages()
    p = await placed(d)
    reservation = object()
    ep, meter = pending(d, p, reservation, age_s=30)
    await ep._sweep_once(FakeRedis({"req-1": ("12 0 w0", written(admission.PROGRESS_STALE_SECONDS + 1))}))
    # Billed for what the worker's progress says was sent, unless the worker billed it itself.
    assert ep.pending == 0 and in_flight(d) == 0 and meter.claimed == [reservation] and meter.released == []
    assert d.metrics.requests.labels("tiny", "gold", "cancelled")._value.get() == 1
    # Nothing is counted against the worker (no report says what happened).
    assert d.flow.breakers.state()[WorkerId("w0")].consecutive == 0


@pytest.mark.parametrize("value, pttl, age_s, lost", [
    ("12 0 w0", written(0.3), 30, False),          # its worker writes on: streaming
    ("0 0", written(1), 30, False),                # admitted a moment ago (a retry admitted anew)
    ("0 0", written(admission.PROGRESS_STALE_SECONDS + 1), 30, True),  # no worker ever started it
    (admission.BILLED, written(1), 30, True),      # the worker billed it; its report was lost
    (None, -2, 30, False),                         # no key (Redis away at its admission): its age will tell
    (None, -2, 60 + admission.PROGRESS_STALE_SECONDS + 1, True),  # older than the longest stream
    ("12 0 w0", written(30), 1, False),            # decided too lately to be looked at
])
async def test_the_sweep_ends_only_the_requests_no_worker_serves(value, pttl, age_s, lost):
    d = stages()
    p = await placed(d)
    ep, meter = pending(d, p, "reservation", age_s)
    await ep._sweep_once(FakeRedis({"req-1": (value, pttl)}))
    assert (ep.pending == 0) == lost and (meter.claimed == ["reservation"]) == lost


async def test_a_sweep_without_redis_goes_by_age_alone():
    d = stages()
    p = await placed(d)
    ep, _ = pending(d, p, "reservation", age_s=30)
    await ep._sweep_once(None)
    assert ep.pending == 1


async def test_a_workers_failure_report_counts_against_it_and_frees_everything():
    d = stages()
    p = await placed(d)
    ep, meter = pending(d, p, "reservation", age_s=0)
    ep.reported(direct.failure("req-1", "w0", "INTERNAL", "boom"))
    # The worker settled the usage (recorded or released): the router only gives the place back.
    assert ep.pending == 0 and in_flight(d) == 0 and meter.done == ["reservation"] and meter.claimed == []
    assert d.metrics.requests.labels("tiny", "gold", "INTERNAL")._value.get() == 1
    assert d.flow.breakers.state()[WorkerId("w0")].consecutive == 1


async def test_a_client_gone_is_no_failure_of_the_worker():
    d = stages()
    p = await placed(d)
    ep, meter = pending(d, p, "reservation", age_s=0)
    ep.reported(direct.failure("req-1", "w0", "CANCELLED"))
    assert ep.pending == 0 and in_flight(d) == 0 and meter.done == ["reservation"]
    assert d.metrics.requests.labels("tiny", "gold", "cancelled")._value.get() == 1
    assert d.flow.breakers.state()[WorkerId("w0")].consecutive == 0


async def test_a_first_choice_refusing_untaken_leaves_the_request_to_the_second_choices_report():
    d = stages(("w0", "w1"))
    p = await placed(d)
    first, second = p.worker.worker_id, p.fallback.worker_id
    ep, meter = pending(d, p, "reservation", age_s=0)
    ep.reported(direct.failure("req-1", first, "UNAVAILABLE", "no engine", untaken=True))
    assert ep.pending == 1 and meter.done == []
    served = final("req-1")
    served.worker_id = second
    ep.reported(direct.report(served))
    assert ep.pending == 0 and meter.done == ["reservation"]
    assert d.metrics.requests.labels("tiny", "gold", "length")._value.get() == 1


async def test_a_second_choices_failure_counts_against_it_and_the_first_one_for_not_taking_it():
    d = stages(("w0", "w1"))
    p = await placed(d)
    first, second = p.worker.worker_id, p.fallback.worker_id
    ep, _ = pending(d, p, "reservation", age_s=0)
    ep.reported(direct.failure("req-1", first, "UNAVAILABLE", "no engine", untaken=True))
    ep.reported(direct.failure("req-1", second, "INTERNAL", "boom"))
    assert ep.pending == 0 and in_flight(d, first) == 0
    breakers = d.flow.breakers.state()
    assert breakers[first].consecutive == 1 and breakers[second].consecutive == 1
    assert d.metrics.requests.labels("tiny", "gold", "INTERNAL")._value.get() == 1


async def test_the_ingress_is_given_a_second_choice_and_a_request_it_served_counts_against_the_first():
    d = stages(("w0", "w1"))
    p = await placed(d)
    assert p.fallback is not None and p.fallback.worker_id != p.worker.worker_id
    assert p.addresses == f"{p.worker.address},{p.fallback.address}"
    first, second = p.worker.worker_id, p.fallback.worker_id
    assert in_flight(d, first) == 1
    served = final("req-1")
    served.worker_id = second
    p.ended(grpc.StatusCode.OK, "", served)
    # The room was the first choice's; the first did not take the request: a failure for its breaker.
    assert in_flight(d, first) == 0
    assert d.flow.breakers.state()[first].consecutive == 1
    assert d.metrics.requests.labels("tiny", "gold", "length")._value.get() == 1


def test_a_native_grpc_refusal_at_the_ingress_is_a_trailers_only_grpc_status_with_its_details():
    import base64

    from google.rpc import status_pb2

    from gaas.contracts import errors
    from services.router.extproc_wire import immediate_grpc

    err = errors.ResourceExhausted("tenant x has made 3 requests", reason="rate_limit_exceeded", retry_after=2.0)
    r = immediate_grpc(err).immediate_response
    assert r.grpc_status.status == grpc.StatusCode.RESOURCE_EXHAUSTED.value[0] and r.status.code == 200
    assert r.body == b"tenant x has made 3 requests"
    (header,) = r.headers.set_headers
    assert header.header.key == "grpc-status-details-bin"
    details = status_pb2.Status.FromString(base64.b64decode(header.header.raw_value))
    kinds = {d.type_url.rsplit(".", 1)[-1] for d in details.details}
    assert details.code == grpc.StatusCode.RESOURCE_EXHAUSTED.value[0] and "RetryInfo" in kinds


async def test_a_router_that_cannot_hear_the_workers_holds_no_place_for_its_direct_requests():
    """Redis away: the reports of their ends cannot come, so the tenant's places go back (Redis's
    own count bounds them once it answers); the requests stay pending for their reports."""
    import asyncio

    d = stages()
    p = await placed(d)
    ep, meter = pending(d, p, "reservation", age_s=0)
    hearing = asyncio.create_task(ep.run_reports("redis://127.0.0.1:1/0"))
    await eventually_async(lambda: meter.done == ["reservation"], 5, every=0.01,
                           what="the reservation given back while Redis is away")
    hearing.cancel()
    await asyncio.gather(hearing, return_exceptions=True)
    assert meter.done == ["reservation"] and ep.pending == 1 and not ep._hearing


@pytest.mark.parametrize("path", ["/gaas.v1.OpenAI/Completions", "/v1/completions"])
async def test_a_generation_without_a_valid_key_is_refused_on_its_headers_before_its_body_is_read(path):
    import asyncio

    from gaas.v1 import ext_proc_pb2 as ep_pb

    async def unknown(key):
        return None

    ep = ExternalProcessor(Pipeline(stages(), Authenticator(unknown, 1.0)), 1 << 20, instance="router-0")
    read_on = False

    async def messages():
        nonlocal read_on
        headers = [(":path", path.encode()), ("authorization", b"Bearer gaas_not_a_key"),
                   ("x-gaas-client-address", b"192.0.2.7")]
        yield ep_pb.ProcessingRequest(request_headers=ep_pb.HttpHeaders(headers=ep_pb.HeaderMap(
            headers=[ep_pb.HeaderValue(key=k, raw_value=v) for k, v in headers])))
        read_on = True
        await asyncio.Event().wait()  # (the body never comes)

    answers = [r async for r in ep.process(messages())]
    assert [a.WhichOneof("response") for a in answers] == ["immediate_response"] and not read_on
    assert answers[0].immediate_response.status.code == 401
    assert b"API key" in answers[0].immediate_response.body


def _asked(path: str, body: bytes | None, key: str = "gaas_acme", **extra: str):
    """The ingress's messages for one request: its headers, then its body in one piece (if any)."""
    from gaas.v1 import ext_proc_pb2 as ep_pb

    headers = {":path": path, "authorization": f"Bearer {key}", "x-gaas-client-address": "192.0.2.7", **extra}

    async def messages():
        yield ep_pb.ProcessingRequest(request_headers=ep_pb.HttpHeaders(headers=ep_pb.HeaderMap(
            headers=[ep_pb.HeaderValue(key=k, raw_value=v.encode()) for k, v in headers.items()])))
        if body is not None:
            yield ep_pb.ProcessingRequest(request_body=ep_pb.HttpBody(body=body, end_of_stream=True))

    return messages()


def _acme_processor(max_body: int = 1 << 20, d: Stages | None = None) -> ExternalProcessor:
    async def lookup(key):
        return ACME if key == "gaas_acme" else None

    return ExternalProcessor(Pipeline(d or stages(), Authenticator(lookup, 1.0)), max_body, instance="router-0")


async def test_an_embeddings_request_is_decided_for_a_worker_of_its_model_with_its_inputs_token_ids():
    import json

    from gaas.v1 import worker_pb2

    d = support.stages(models=[ModelEntry("tiny", "1.0", 64, True), ModelEntry("embedder", "1.0", 64, False,
                                                                                 task="embed")],
                       candidates=[Candidate(WorkerId("w0"), "w0:1", "tiny", "1.0", 64),
                                   Candidate(WorkerId("w1"), "w1:1", "embedder", "1.0", 64)])
    body = json.dumps({"model": "embedder", "input": ["hi", [5, 6]]}).encode()
    answers = [r async for r in _acme_processor(d=d).process(_asked("/v1/embeddings", body))]
    assert [a.WhichOneof("response") for a in answers] == ["request_headers", "request_body"]
    decided = worker_pb2.DirectGenerate.FromString(answers[1].request_body.response.body_mutation.streamed_response.body)
    assert decided.openai_body == body and decided.prompts[0].request.model == "embedder"
    assert [list(i.token_ids) for i in decided.prompts[0].request.embed.inputs][1] == [5, 6]
    assert decided.metering.prompt_tokens == sum(len(i.token_ids) for i in decided.prompts[0].request.embed.inputs)


async def test_an_http_clients_openai_request_is_decided_on_its_json_and_its_worker_sent_the_decision_to_frame():
    """Asked about before the transcoder (the ingress's OpenAI routes): the body is the client's
    JSON, and the answer's body the worker's DirectGenerate itself, with the content type the
    transcoder puts in the HttpBody it frames."""
    import json

    from gaas.v1 import worker_pb2

    body = json.dumps({"model": "tiny", "prompt": "hi", "max_tokens": 4}).encode()
    answers = [r async for r in _acme_processor().process(_asked("/v1/completions?api-version=1", body))]
    assert [a.WhichOneof("response") for a in answers] == ["request_headers", "request_body"]
    set_headers = {h.header.key: h.header.raw_value.decode()
                   for h in answers[0].request_headers.response.header_mutation.set_headers}
    assert set_headers["x-gaas-worker"] and set_headers["content-type"] == direct.CONTENT_TYPE
    sent = answers[1].request_body.response.body_mutation.streamed_response
    decided = worker_pb2.DirectGenerate.FromString(sent.body)
    assert sent.end_of_stream and decided.openai_body == body and not decided.chat
    assert decided.metering.tenant == "acme" and decided.prompts[0].request.prompt_token_ids


@pytest.mark.parametrize("sent_length", [True, False])
async def test_an_http_clients_body_past_what_the_ingress_takes_is_413_as_the_ingress_gave_it(sent_length):
    """By its content-length, before the body is read; or, sent without one, once it passes the
    router's limit and the framing's room (edge.FRAMING_BYTES; between the two: jsonbody's 400)."""
    from gaas.contracts import edge

    body = b"x" * (1000 + edge.FRAMING_BYTES + 1)
    extra = {"content-length": str(len(body))} if sent_length else {}
    answers = [r async for r in _acme_processor(max_body=1000).process(_asked("/v1/chat/completions", body, **extra))]
    assert [a.WhichOneof("response") for a in answers] == ["immediate_response"]
    assert answers[0].immediate_response.status.code == 413
