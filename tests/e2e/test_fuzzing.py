"""Fuzzing both surfaces through the real ingress (the OpenAI routes over HTTP, with tools,
structured output and the Responses API, query strings and headers; the native API over gRPC): no
input gets a 5xx, every error has OpenAI's (or gRPC's) shape, and the mesh keeps serving."""

from __future__ import annotations

import json

import grpc
import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from gaas.v1 import common_pb2, inference_pb2, inference_pb2_grpc
from tests.e2e.support import error_shaped, send
from tests.meshutil import openai_client as client

pytestmark = pytest.mark.mesh

MODEL = "gaas-tiny"


def _ok_shaped(path: str, body: str, stream: bool) -> None:
    if path == "/tokenize":
        assert isinstance(json.loads(body)["tokens"], list)
        return
    if path == "/detokenize":
        assert isinstance(json.loads(body)["prompt"], str)
        return
    if not stream:
        assert json.loads(body)["choices"]
        return
    events = [line.removeprefix("data: ") for line in body.split("\n\n") if line.strip()]
    assert events[-1] == "[DONE]"
    for e in events[:-1]:
        assert "error" not in json.loads(e), f"a stream failed after it started: {e}"


_evil_strings = st.sampled_from(["", "\ud800", "\x00", "gpt-9", "😀", "<|eot_id|>"]) | st.just(100_000).map(lambda n: "x" * n)
_ints = st.one_of(st.integers(-3, 40), st.integers(-(2**70), 2**70), st.sampled_from([2**31, 2**32, 2**33, 2**40, 2**63]))
_scalars = st.one_of(st.none(), st.booleans(), _ints, st.floats(allow_nan=False, allow_infinity=False), st.text(max_size=12), _evil_strings)
_json = st.recursive(_scalars, lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=6), inner, max_size=3), max_leaves=8)
_token_ids = st.lists(st.integers(0, 4095), min_size=1, max_size=8)

# Values a careful client sends: the body should be served (or refused for a reason it names).
_valid_prompt = st.one_of(st.text(min_size=1, max_size=40), _token_ids, st.lists(st.text(min_size=1, max_size=10), min_size=1, max_size=3))
_valid_messages = st.lists(
    st.fixed_dictionaries({"role": st.sampled_from(["user", "system", "assistant", "developer"]),
                           "content": st.text(max_size=30) | st.just([{"type": "text", "text": "hi"}])}),
    min_size=1, max_size=3,
)
_valid = {
    "temperature": st.floats(0, 2), "top_p": st.floats(0.01, 1), "top_k": st.integers(-1, 50), "min_p": st.floats(0, 1),
    "n": st.integers(1, 3), "seed": st.integers(-(2**63), 2**63 - 1), "stop": st.text(min_size=1, max_size=3) | st.lists(st.text(min_size=1, max_size=3), max_size=3),
    "presence_penalty": st.floats(-2, 2), "frequency_penalty": st.floats(-2, 2), "repetition_penalty": st.floats(0.5, 2),
    "logit_bias": st.dictionaries(st.integers(0, 4095).map(str), st.floats(-100, 100), max_size=3),
    "stop_token_ids": _token_ids, "allowed_token_ids": _token_ids, "min_tokens": st.integers(0, 2),
    "ignore_eos": st.booleans(), "stream": st.booleans(), "stream_options": st.just({"include_usage": True}),
    "bad_words": st.lists(st.text(min_size=1, max_size=5), max_size=2), "priority": st.integers(-1, 1),
    "user": st.text(max_size=10), "skip_special_tokens": st.booleans(), "include_stop_str_in_output": st.booleans(),
    "echo": st.just(False), "spaces_between_special_tokens": st.booleans(), "return_tokens_as_token_ids": st.booleans(),
}
_valid_completion = {**_valid, "logprobs": st.integers(0, 5), "add_special_tokens": st.booleans()}
_valid_chat = {**_valid, "logprobs": st.booleans(), "top_logprobs": st.integers(0, 5), "add_generation_prompt": st.just(True)}
# And whatever a careless or hostile one might.
_wild = {name: _json for name in [*_valid_completion, *_valid_chat, "tools", "response_format", "best_of", "colour"]}
_wild["messages"] = st.lists(st.fixed_dictionaries({"role": st.sampled_from(["user", "robot", 5]), "content": _json}), max_size=3) | _json
_wild["prompt"] = st.one_of(_evil_strings, st.lists(_ints, max_size=6), _json)


@st.composite
def _openai_body(draw):
    chat = draw(st.booleans())
    careful = draw(st.booleans())
    fields = (_valid_chat if chat else _valid_completion) if careful else _wild
    body = {"model": MODEL if careful else draw(st.sampled_from([MODEL, "", "nope"]) | _evil_strings | _scalars)}
    body["messages" if chat else "prompt"] = draw(_valid_messages if chat else _valid_prompt) if careful else draw(
        _wild["messages" if chat else "prompt"])
    # Always a small max_tokens (or a wrong one): a body without one would generate the whole context.
    body["max_completion_tokens" if chat and draw(st.booleans()) else "max_tokens"] = draw(
        st.integers(1, 4) if careful else st.integers(1, 4) | _ints | _scalars)
    for name in draw(st.lists(st.sampled_from(sorted(fields)), max_size=6, unique=True)):
        body[name] = draw(fields[name])
    raw = json.dumps(body).encode()
    # Sometimes damage the bytes themselves.
    damage = "none" if careful else draw(st.sampled_from(["none", "none", "truncate", "nest", "bigint", "bytes"]))
    if damage == "truncate":
        raw = raw[: draw(st.integers(0, max(0, len(raw) - 1)))]
    elif damage == "nest":
        raw = raw[:-1] + b', "deep": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"
    elif damage == "bigint":
        raw = raw[:-1] + b', "max_tokens": ' + b"9" * 5000 + b"}"
    elif damage == "bytes":
        raw = draw(st.binary(max_size=64))
    path = "/v1/chat/completions" if chat else "/v1/completions"
    if not careful and draw(st.integers(0, 9)) == 0:
        # The tokenizer routes take the same bodies' fields (prompt or messages, model) and tokens.
        path = draw(st.sampled_from(["/tokenize", "/detokenize"]))
        if path == "/detokenize" and draw(st.booleans()):
            raw = json.dumps({"model": body["model"], "tokens": draw(st.lists(_ints, max_size=4) | _json)}).encode()
    return path, raw, body.get("stream") is True


def _post(conn, mesh, path, raw, extra_headers=()):
    headers = {"authorization": f"Bearer {mesh.api_key}", "content-type": "application/json"}
    headers.update(extra_headers)
    return send(conn, "POST", path, raw, headers)


@settings(max_examples=1500, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True)
@given(case=_openai_body())
def test_fuzz_openai_http_never_answers_5xx(mesh, conn, case):
    path, raw, stream = case
    status, body = _post(conn, mesh, path, raw)
    event(f"HTTP {status}")
    if status == 200:
        _ok_shaped(path, body, stream)
    else:
        error_shaped(status, body)


_tool = st.fixed_dictionaries({"type": st.just("function"), "function": st.fixed_dictionaries(
    {"name": st.sampled_from(["get_weather", "f", "a b", ""]),
     "parameters": st.sampled_from([{"type": "object", "properties": {"x": {"type": "integer", "minimum": 0, "maximum": 9}}},
                                    {"type": "object"}, {"type": "foo"}, {}])})})
_agent_fields = {
    "tools": st.lists(_tool, max_size=2) | _json,
    "tool_choice": st.sampled_from(["none", "auto", "required", {"type": "function", "function": {"name": "f"}},
                                    {"type": "function", "name": "f"}]) | _json,
    "response_format": st.sampled_from([{"type": "json_object"}, {"type": "text"}, {"type": "json_schema", "json_schema": {
        "name": "a", "schema": {"type": "object", "properties": {"ok": {"type": "boolean"}}}}}]) | _json,
    "structured_outputs": st.sampled_from([{"choice": ["a", "b"]}, {"regex": "[a-c]{2}"}, {"regex": "(("},
                                           {"grammar": 'root ::= "x"'}]) | _json,
    "parallel_tool_calls": st.booleans() | _json, "stream": st.booleans(),
    "text": st.sampled_from([{"format": {"type": "json_object"}}, {"format": {"type": "xml"}}]) | _json,
    "previous_response_id": st.sampled_from(["resp_nope", "", "x" * 200]) | _json,
    "instructions": _evil_strings | _json, "store": st.booleans() | _json,
}


@st.composite
def _agent_body(draw):
    path = draw(st.sampled_from(["/v1/chat/completions", "/v1/responses"]))
    body: dict = {"model": MODEL}
    if path == "/v1/responses":
        body["input"] = draw(st.sampled_from(["hi", [{"role": "user", "content": "hi"}],
                                              [{"type": "function_call_output", "call_id": "c", "output": "1"}]]) | _json)
        body["max_output_tokens"] = draw(st.integers(1, 8))
    else:
        body["messages"] = draw(_valid_messages)
        body["max_tokens"] = draw(st.integers(1, 8))
    for name in draw(st.lists(st.sampled_from(sorted(_agent_fields)), max_size=4, unique=True)):
        body[name] = draw(_agent_fields[name])
    return path, json.dumps(body).encode()


@settings(max_examples=300, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True)
@given(case=_agent_body())
def test_fuzz_tools_structured_output_and_responses_never_answer_5xx(mesh, conn, case):
    path, raw = case
    status, body = _post(conn, mesh, path, raw)
    event(f"{path} HTTP {status}")
    if status != 200:
        error_shaped(status, body)
    elif body.startswith("event:") or body.startswith("data:"):
        # A stream that began ended as it should: no error event in it.
        assert "event: response.failed" not in body and 'data: {"error"' not in body, body[-500:]
    else:
        assert json.loads(body)["object"] in ("chat.completion", "response")


# Digits that str.isdigit takes and int() does not, numbers too long to be anything, and the rest.
_odd_digits = st.sampled_from(["²", "²d", "١٢", "७d", "９", "0", "-1", "7d", "30m", "1e9", "9" * 30, "9" * 30 + "d",
                               "2026-13-01", "2026-11-01T00:00:00Z", "\x00", " ", "%", "%ZZ", "&", "="])
_query_values = _odd_digits | st.text(max_size=12)


@settings(max_examples=300, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True)
@given(path=st.sampled_from(["/v1/gaas/usage", "/v1/gaas/sessions", "/v1/gaas/models", "/v1/models",
                             "/v1/responses/resp_1/input_items", "/v1/responses/x", "/v1/files", "/v1/batches",
                             "/v1/files/file-x", "/v1/files/file-x/content", "/v1/batches/batch_x"]),
       params=st.dictionaries(st.sampled_from(["since", "until", "by", "limit", "api-version", "x", "after", "order",
                                               "purpose"]) | st.text(max_size=5),
                              _query_values, max_size=4),
       raw=st.none() | st.text(max_size=20))
def test_fuzz_query_strings_never_answer_5xx(mesh, conn, path, params, raw):
    from urllib.parse import quote, urlencode

    query = urlencode(params) if raw is None else quote(raw, safe="=&%?")
    status, body = send(conn, "GET", f"{path}?{query}", headers={"authorization": f"Bearer {mesh.api_key}"})
    event(f"HTTP {status}")
    assert status < 500, f"{path}?{query}: {status} {body[:300]}"
    if status >= 400:
        error = json.loads(body)
        assert (error["message"] if path.startswith("/v1/gaas/") else error["error"]["message"])


_header_names = st.sampled_from([
    "x-gaas-session", "x-request-id", "x-gaas-explain", "x-gaas-worker", "x-gaas-tenant", "x-gaas-request-id",
    "x-gaas-ingress-start", "traceparent", "tracestate", "grpc-timeout", "content-type", "x-forwarded-for",
    "x-envoy-upstream-rq-timeout-ms", "x-envoy-max-retries", "x-envoy-retry-on", "te", "accept-encoding", "expect",
    # gRPC's own, parsed by the router's gRPC library (a malformed grpc-timeout once broke its connection)
    "grpc-encoding", "grpc-accept-encoding", "grpc-previous-rpc-attempts", "grpc-status", "grpc-trace-bin", "x-any-bin",
])
_header_values = _odd_digits | st.text(alphabet=st.characters(min_codepoint=0x20, max_codepoint=0xFF), max_size=40) | \
    st.sampled_from(["application/grpc", "application/grpc-web", "text/plain", "00-" + "f" * 32 + "-" + "f" * 16 + "-01",
                     "100-continue", "trailers", "127.0.0.1:1", "gzip"])


@settings(max_examples=300, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True)
@given(chat=st.booleans(), headers=st.dictionaries(_header_names, _header_values, min_size=1, max_size=4))
def test_fuzz_headers_never_answer_5xx(mesh, conn, chat, headers):
    body = ({"model": MODEL, "messages": [{"role": "user", "content": "hi"}]} if chat
            else {"model": MODEL, "prompt": "hi"}) | {"max_tokens": 2}
    path = "/v1/chat/completions" if chat else "/v1/completions"
    headers = {k: v.strip() for k, v in headers.items()}
    try:
        status, text = _post(conn, mesh, path, json.dumps(body).encode(), headers)
    except ValueError:  # (a value http.client itself refuses to send)
        return
    event(f"HTTP {status}")
    assert status < 500, f"{headers}: {status} {text[:300]}"
    if status >= 400:
        assert text, f"{headers}: {status} without a body"


def _sampling(careful: bool):
    f32 = lambda lo, hi: st.floats(lo, hi, width=32)  # noqa: E731
    return st.builds(
        common_pb2.SamplingParams,
        temperature=st.none() | (f32(0, 2) if careful else f32(-5, 5)),
        top_p=st.none() | (f32(0.125, 1) if careful else f32(-1, 2)),
        top_k=st.none() | (st.integers(-1, 50) if careful else st.integers(-(2**31), 2**31 - 1)),
        min_p=st.none() | (f32(0, 1) if careful else f32(-1, 2)),
        seed=st.none() | st.integers(-(2**63), 2**63 - 1),
        min_tokens=st.none() | (st.integers(0, 2) if careful else st.integers(0, 2**32 - 1)),
        ignore_eos=st.booleans(),
        stop_token_ids=st.lists(st.integers(0, 4095) if careful else st.integers(0, 2**32 - 1), max_size=3),
        logit_bias=st.dictionaries(st.integers(0, 4095) if careful else st.integers(0, 2**32 - 1),
                                   f32(-100, 100) if careful else st.floats(width=32, allow_nan=True), max_size=2),
        repetition_penalty=st.none() | (f32(0.5, 2) if careful else f32(-1, 200)),
        bad_words=st.lists(st.text(min_size=1, max_size=4) if careful else st.text(max_size=4), max_size=2),
    )


def _generate_request(careful: bool):
    return st.builds(
        inference_pb2.GenerateRequest,
        model=st.sampled_from(["", MODEL]) if careful else st.sampled_from(["", MODEL, "nope", "m" * 300]),
        prompt=st.text(min_size=1, max_size=20) if careful else st.text(max_size=20) | st.sampled_from(["", "x" * 3000]),
        prompt_token_ids=st.just([]) if careful else st.lists(st.integers(0, 2**32 - 1), max_size=4),
        sampling=_sampling(careful),
        max_tokens=st.integers(1, 4) if careful else st.integers(0, 4) | st.integers(0, 2**32 - 1),
        stop=st.lists(st.text(min_size=1, max_size=4) if careful else st.text(max_size=4), max_size=3),
        priority=st.integers(0, 3) if careful else st.integers(0, 2**31 - 1),
        request_id=st.text(max_size=8) | st.just("r" * 500),
        messages=st.just([]) if careful else st.lists(st.builds(
            inference_pb2.ChatMessage, role=st.sampled_from(["user", "robot", ""]), content=st.text(max_size=10)),
            max_size=2),
        n=st.integers(1, 3) if careful else st.integers(0, 2**32 - 1),
        logprobs=st.none() | (st.integers(0, 5) if careful else st.integers(0, 2**32 - 1)),
    )


_grpc_requests = _generate_request(True) | _generate_request(False)
CLIENT_ERRORS = {grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.NOT_FOUND, grpc.StatusCode.OUT_OF_RANGE,
                 grpc.StatusCode.FAILED_PRECONDITION}


@pytest.fixture(scope="module")
def stub(mesh):
    with grpc.insecure_channel(mesh.ingress) as ch:
        yield ch


@settings(max_examples=800, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True)
@given(req=_grpc_requests | st.binary(max_size=40))
def test_fuzz_grpc_never_answers_a_server_error(mesh, stub, req):
    if isinstance(req, bytes):
        call = stub.unary_stream("/gaas.v1.Inference/Generate")(req, timeout=60, metadata=mesh.auth)
    else:
        if 8 < req.max_tokens < 4096:
            req.max_tokens = 8  # valid but slow lengths are covered elsewhere
        call = inference_pb2_grpc.InferenceStub(stub).Generate(req, timeout=60, metadata=mesh.auth)
    try:
        chunks = list(call)
    except grpc.RpcError as err:
        event(err.code().name)
        assert err.code() in CLIENT_ERRORS, f"{err.code()}: {err.details()}"
        assert err.details()
        return
    event("OK")
    assert chunks and any(c.HasField("usage") for c in chunks)


def test_the_mesh_still_serves_after_the_fuzzing(mesh):
    r = client(mesh).completions.create(model=MODEL, prompt="still here", max_tokens=2)
    assert r.choices[0].text is not None and r.usage.completion_tokens == 2
