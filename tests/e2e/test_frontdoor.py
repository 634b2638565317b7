"""The front door, through the real ingress: the routes and parameters of vLLM's OpenAI server,
the tools people point at vLLM servers (the `openai` package, `vllm bench serve`, a generic gRPC
client using reflection), the client's request id, and a worker lost mid-stream. Fuzzing both
surfaces is test_fuzzing.py's."""

from __future__ import annotations

import itertools
import json
import os
import signal

import grpc
import openai
import pytest

from tests.conftest import INGRESS_PATH, ROOT
from tests.meshutil import generate, http, openai_client as client
from tests.waiting import eventually

pytestmark = pytest.mark.mesh

MODEL = "gaas-tiny"


# ------------------------------------------------------------------ routes and parameters


def test_client_request_id_is_echoed_but_gaas_names_the_request(mesh):
    raw = client(mesh).completions.with_raw_response.create(
        model=MODEL, prompt="hi", max_tokens=2, extra_headers={"x-request-id": "my-id-1"}
    )
    assert raw.headers["x-request-id"] == "my-id-1"
    body = raw.parse()
    assert body.id.startswith("cmpl-") and "my-id-1" not in body.id
    # Two requests with the same client id are still two requests.
    again = client(mesh).completions.create(model=MODEL, prompt="hi", max_tokens=2, extra_headers={"x-request-id": "my-id-1"})
    assert again.id != body.id


def test_sampling_parameters_of_vllm_are_honoured(mesh):
    c = client(mesh)
    extra = {"ignore_eos": True, "min_tokens": 6, "top_k": 5, "min_p": 0.01, "repetition_penalty": 1.1,
             "skip_special_tokens": True, "spaces_between_special_tokens": True}
    r = c.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=6, seed=3, extra_body=extra)
    assert r.usage.completion_tokens == 6 and r.choices[0].finish_reason == "length"
    # A seed fixes the sample.
    again = c.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=6, seed=3, extra_body=extra)
    assert again.choices[0].text == r.choices[0].text
    # allowed_token_ids confines the output: every generated token is one of them.
    r = c.completions.create(model=MODEL, prompt="x", max_tokens=5, logprobs=0,
                             extra_body={"allowed_token_ids": [100, 101], "ignore_eos": True})
    ids = [int(t.removeprefix("token_id:")) for t in c.completions.create(
        model=MODEL, prompt="x", max_tokens=5, logprobs=0,
        extra_body={"allowed_token_ids": [100, 101], "ignore_eos": True, "return_tokens_as_token_ids": True},
    ).choices[0].logprobs.tokens]
    assert set(ids) <= {100, 101} and len(ids) == 5
    # logit_bias of +100 on one token makes it the greedy choice.
    r = c.completions.create(model=MODEL, prompt="x", max_tokens=3, temperature=0, logit_bias={"100": 100},
                             logprobs=0, extra_body={"return_tokens_as_token_ids": True, "ignore_eos": True})
    assert r.choices[0].logprobs.tokens == ["token_id:100"] * 3


def test_stop_token_ids_end_the_output(mesh):
    c = client(mesh)
    greedy = c.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=8, temperature=0, logprobs=0,
                                  extra_body={"return_tokens_as_token_ids": True})
    ids = [int(t.removeprefix("token_id:")) for t in greedy.choices[0].logprobs.tokens]
    stop_at = ids[3]
    r = c.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=8, temperature=0,
                             extra_body={"stop_token_ids": [stop_at]})
    assert r.choices[0].finish_reason == "stop" and r.usage.completion_tokens == ids.index(stop_at) + 1


def test_n_choices_and_a_list_of_prompts(mesh):
    r = client(mesh).completions.create(model=MODEL, prompt=["Once upon", "A long time ago"], n=2, max_tokens=3,
                                        extra_body={"ignore_eos": True})
    assert [ch.index for ch in r.choices] == [0, 1, 2, 3], "indexed prompt * n + choice, as OpenAI and vLLM do"
    assert all(ch.finish_reason == "length" and ch.text for ch in r.choices)
    assert r.usage.completion_tokens == 12
    single = [client(mesh).completions.create(model=MODEL, prompt=p, max_tokens=1).usage.prompt_tokens
              for p in ("Once upon", "A long time ago")]
    assert r.usage.prompt_tokens == sum(single), "each prompt counted once, however many choices"
    chunks = list(client(mesh).chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "hi"}], n=3, max_tokens=2, stream=True,
        stream_options={"include_usage": True}, extra_body={"ignore_eos": True}))
    firsts = {}
    for ch in chunks:
        for choice in ch.choices:
            firsts.setdefault(choice.index, choice.delta.role)
    assert firsts == {0: "assistant", 1: "assistant", 2: "assistant"}
    assert chunks[-1].usage.completion_tokens == 6


def test_logprobs_in_both_shapes(mesh):
    c = client(mesh)
    r = c.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=4, logprobs=3, temperature=0)
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 4
    assert "".join(lp.tokens) == r.choices[0].text and lp.text_offset[0] == 0
    assert all(len(t) >= 3 for t in lp.top_logprobs)
    # Greedy: the chosen token is the most likely one.
    assert all(lp.token_logprobs[i] == max(lp.top_logprobs[i].values()) for i in range(4))
    chat = c.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=3,
                                     logprobs=True, top_logprobs=2, temperature=0)
    content = chat.choices[0].logprobs.content
    assert len(content) == 3 and all(len(t.top_logprobs) == 2 and t.logprob <= 0 for t in content)


def test_tokenize_and_detokenize_as_vllm_answers(mesh):
    status, body = http(mesh, "/tokenize", json.dumps({"model": MODEL, "prompt": "Once upon a time"}).encode())
    assert status == 200, body
    tokens = json.loads(body)
    assert tokens["count"] == len(tokens["tokens"]) and tokens["max_model_len"] == 2048 and tokens["token_strs"] is None
    usage = client(mesh).completions.create(model=MODEL, prompt="Once upon a time", max_tokens=1).usage
    assert usage.prompt_tokens == tokens["count"], "/tokenize counts what generation is charged for"
    status, body = http(mesh, "/detokenize", json.dumps({"model": MODEL, "tokens": tokens["tokens"]}).encode())
    assert status == 200 and json.loads(body)["prompt"].endswith("Once upon a time")
    messages = [{"role": "user", "content": "Hello"}]
    status, body = http(mesh, "/tokenize", json.dumps({"model": MODEL, "messages": messages}).encode())
    chat_usage = client(mesh).chat.completions.create(model=MODEL, messages=messages, max_tokens=1).usage
    assert json.loads(body)["count"] == chat_usage.prompt_tokens
    status, body = http(mesh, "/tokenize", json.dumps({"prompt": "x"}).encode(), key="")
    assert status == 401 and json.loads(body)["error"]["type"] == "authentication_error"


def test_probe_routes_answer_without_a_key(mesh):
    for path in ("/health", "/ping"):
        assert http(mesh, path, method="GET", key="")[0] == 200
    assert http(mesh, "/ping", b"", method="POST", key="")[0] == 200
    status, body = http(mesh, "/version", method="GET", key="")
    assert status == 200 and json.loads(body)["version"]
    status, body = http(mesh, "/load", method="GET", key="")
    assert status == 200 and json.loads(body)["server_load"] >= 0
    status, body = http(mesh, "/metrics", method="GET", key="")
    # (the router's: the generations it served, or on the direct path decided at the ingress)
    method = "Process" if INGRESS_PATH == "direct" else "Completions"
    assert status == 200 and f'gaas_router_grpc_requests_total{{code="OK",method="{method}"}}' in body


def test_query_parameters_of_other_clients_are_ignored(mesh):
    assert http(mesh, "/v1/models?api-version=2024-02-01", method="GET")[0] == 200


def test_reflection_at_the_ingress_shows_the_public_services_only(mesh):
    from google.protobuf.descriptor_pool import DescriptorPool
    from grpc_reflection.v1alpha.proto_reflection_descriptor_database import ProtoReflectionDescriptorDatabase

    with grpc.insecure_channel(mesh.ingress) as ch:
        db = ProtoReflectionDescriptorDatabase(ch)
        services = set(db.get_services())
        pool = DescriptorPool(db)
        methods = [m.name for m in pool.FindServiceByName("gaas.v1.Inference").methods]
        chunk_fields = set(pool.FindMessageTypeByName("gaas.v1.GenerateChunk").fields_by_name)
    assert services == {"gaas.v1.Inference", "gaas.v1.OpenAI", "grpc.health.v1.Health",
                        "grpc.reflection.v1alpha.ServerReflection"}
    assert methods == ["Generate", "ListModels", "GetUsage", "ListSessions", "GetSession", "DeleteSession"] and {"index", "logprobs", "usage"} <= chunk_fields


@pytest.mark.parametrize(
    "raw",
    [
        b"\x12\x03\xed\xa0\x80",  # prompt = a lone surrogate, UTF-8 encoded (not valid UTF-8)
        b"\x12\xff\xff\xff\xff\x0f",  # a length beyond the message
        b"\x0f",  # wire type 7 does not exist
    ],
)
def test_malformed_protobuf_is_invalid_argument(mesh, raw):
    with grpc.insecure_channel(mesh.ingress) as ch:
        with pytest.raises(grpc.RpcError) as err:
            list(ch.unary_stream("/gaas.v1.Inference/Generate")(raw, timeout=10, metadata=mesh.auth))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "not a valid GenerateRequest" in err.value.details()


@pytest.mark.parametrize(
    "body",
    [
        b'{"prompt": "\\ud800", "max_tokens": 2}',
        b'{"prompt": "x", "max_tokens": 8589934592}',
        b'{"prompt": "x", "max_tokens": ' + b"9" * 5000 + b"}",
        b'{"prompt": "x", "deep": ' + b"[" * 100_000 + b"]" * 100_000 + b"}",
        b'{"prompt": "x", "model": "' + b"m" * 100_000 + b'"}',
    ],
)
def test_the_native_json_api_refuses_what_it_cannot_parse_with_a_4xx(mesh, body):
    status, text = http(mesh, "/v1/generate", body)
    assert 400 <= status < 500, text[:300]


def test_internal_services_are_not_reachable_at_the_ingress(mesh):
    with grpc.insecure_channel(mesh.ingress) as ch:
        with pytest.raises(grpc.RpcError) as err:
            ch.unary_unary("/gaas.v1.Control/ListTenants")(b"", timeout=5, metadata=mesh.auth)
        assert err.value.code() == grpc.StatusCode.UNIMPLEMENTED
        # Without a key nothing gets past the key check, a path the ingress does not route neither.
        with pytest.raises(grpc.RpcError) as err:
            ch.unary_unary("/gaas.v1.Control/ListTenants")(b"", timeout=5)
        assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED


@pytest.mark.parametrize("backend", ["openai", "openai-chat"])
def test_vllm_bench_serve_runs_against_the_ingress(mesh, backend):
    """vLLM's own load tester, as its users run it: every request succeeds."""
    from bench.vllm_bench import run

    result = run(f"http://{mesh.ingress}", MODEL, str(ROOT / "models" / MODEL), backend=backend,
                 api_key=mesh.api_key, num_prompts=12, input_len=64, output_len=8, max_concurrency=4)
    assert result["completed"] == 12 and result.get("failed", 0) == 0, result["_output"]
    assert result["total_output_tokens"] == 12 * 8


# ------------------------------------------------------------------ a worker lost mid-stream


@pytest.mark.destructive
def test_a_worker_lost_mid_stream_ends_a_stream_nobody_can_carry_on_with_an_openai_error_event(mesh):
    """Kills worker-1 while it streams (worker-0 stays for the tests after this one) a request of
    two choices, which no other worker carries on (tests/e2e/test_faults.py has those that are):
    the client is told in an OpenAI error event. On the direct path no process in the stream
    outlives the worker and the connection is cut."""
    c = client(mesh)
    # A long prompt is routed where its prefix is cached: find one that worker-1 holds (for up to a
    # minute: a destructive test before this one may have left worker-1 a moment out of the view).
    tries = itertools.count()

    def landing_on_worker_1() -> str | None:
        prompt = f"Mid-stream loss test {next(tries)}: " + "tell me everything about the sea and the ships. " * 12
        return prompt if generate(mesh, prompt=prompt, max_tokens=1)[-1].worker_id == "worker-1" else None

    prompt = eventually(landing_on_worker_1, 60, what="a prompt landing on worker-1")
    stream = c.completions.create(model=MODEL, prompt=prompt, max_tokens=1500, stream=True, n=2,
                                  extra_body={"ignore_eos": True})
    assert next(iter(stream)).choices
    os.killpg(json.loads((mesh.run_dir / "mesh.json").read_text())["children"]["worker-1"], signal.SIGKILL)
    with pytest.raises(openai.APIError) as err:
        for _ in stream:
            pass
    message = str(err.value)
    if INGRESS_PATH == "direct":
        assert isinstance(err.value, openai.APIConnectionError), message
        return
    assert "failed after it had streamed tokens" in message and "may be retried" in message
    assert "RST_STREAM" not in message and "Stream removed" not in message
