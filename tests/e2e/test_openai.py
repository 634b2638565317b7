"""The OpenAI-compatible API at the ingress, driven by the official `openai` package, unmodified,
and by raw HTTP; tenants, keys and their isolation. Uses the shared mesh of the session."""

from __future__ import annotations

import json
import time

import grpc
import openai
import pytest

from tests.meshutil import gaas, generate, http, openai_client as client, refused_on_headers, worker_addresses
from tests.waiting import eventually

pytestmark = pytest.mark.mesh

MODEL = "gaas-tiny"
# Tests that count tokens use temperature=0: a random sample could pick the end-of-text token early.
LONG_PROMPT = "A tenant's prompt that is long enough to fill several KV blocks of 32 tokens each. " * 8


@pytest.fixture(scope="module")
def tenants(mesh):
    """Two tenants with a key each, made with the CLI as an operator would."""
    keys = {}
    for name, tier in (("acme", "gold"), ("beta", "silver")):
        r = gaas(mesh, "tenant", "create", name, "--tier", tier, "--json")
        assert r.returncode == 0, r.stderr
        r = gaas(mesh, "key", "create", name, "--json")
        assert r.returncode == 0, r.stderr
        keys[name] = json.loads(r.stdout)
    return keys


def test_models_list_shows_only_what_can_be_served(mesh):
    """gaas-small is deployed but no worker serves it: a client picking the first listed model must
    get one that answers. gaas-embed's pool starts at zero: listed, saying so, as its first request
    brings a worker."""
    models = {m.id: m for m in client(mesh).models.list()}
    assert set(models) == {"gaas-tiny", "gaas-embed"} and next(iter(models)) == MODEL, "the default model first"
    assert models[MODEL].owned_by == "gaas" and models[MODEL].root == MODEL
    assert (models["gaas-embed"].state, models["gaas-embed"].task) == ("scaled_to_zero", "embed")
    catalogue = {m["name"]: m["ready_workers"] for m in json.loads(gaas(mesh, "models", "--json").stdout)}
    assert catalogue == {"gaas-tiny": 2, "gaas-small": 0, "gaas-long": 0, "gaas-embed": 0}, \
        "`gaas models` keeps the whole catalogue"


def test_completion(mesh):
    r = client(mesh).completions.create(model=MODEL, prompt="Once upon a time", max_tokens=7, temperature=0)
    assert r.object == "text_completion" and r.model == MODEL and r.id.startswith("cmpl-")
    assert r.choices[0].finish_reason == "length" and r.choices[0].text
    assert r.usage.completion_tokens == 7 and r.usage.total_tokens == r.usage.prompt_tokens + 7
    # A prompt shorter than one KV block (32 tokens) can never be served from the prefix cache.
    assert r.usage.prompt_tokens < 32 and r.usage.prompt_tokens_details.cached_tokens == 0


def test_completion_stream_with_usage(mesh):
    stream = client(mesh).completions.create(
        model=MODEL, prompt="Once upon a time", max_tokens=6, temperature=0, stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    texts = [c.choices[0].text for c in chunks if c.choices]
    assert len(texts) >= 2
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 6
    # Streaming and not give the same text (greedy).
    whole = client(mesh).completions.create(model=MODEL, prompt="Once upon a time", max_tokens=6, temperature=0)
    assert "".join(texts) == whole.choices[0].text


def test_chat(mesh):
    r = client(mesh).chat.completions.create(
        model=MODEL, messages=[{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello"}],
        max_tokens=5, temperature=0,
    )
    assert r.object == "chat.completion" and r.choices[0].message.role == "assistant"
    assert r.choices[0].message.content and r.usage.completion_tokens == 5
    # The chat template wraps the messages: more prompt tokens than the words themselves.
    assert r.usage.prompt_tokens > 10


def test_chat_stream(mesh):
    stream = client(mesh).chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Hello"}], max_tokens=4, temperature=0, stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    deltas = [c.choices[0].delta for c in chunks if c.choices]
    assert deltas[0].role == "assistant"
    assert "".join(d.content or "" for d in deltas)
    assert chunks[-2].choices[0].finish_reason == "length"
    assert chunks[-1].usage.completion_tokens == 4


def test_stream_without_usage_has_no_usage_chunk(mesh):
    chunks = list(client(mesh).completions.create(model=MODEL, prompt="hi", max_tokens=3, stream=True))
    assert all(c.choices for c in chunks) and all(c.usage is None for c in chunks)


def test_cached_tokens_are_reported(mesh):
    c = client(mesh)
    usages = [
        c.completions.create(model=MODEL, prompt=LONG_PROMPT, max_tokens=1).usage
        for _ in range(len(worker_addresses(mesh)) + 1)
    ]
    assert max(u.prompt_tokens_details.cached_tokens for u in usages) >= 32


@pytest.mark.parametrize(
    "call, error",
    [
        (lambda c: c.completions.create(model="gpt-9", prompt="hi"), openai.NotFoundError),
        (lambda c: c.completions.create(model=MODEL, prompt="hi", temperature=9), openai.BadRequestError),
        (lambda c: c.completions.create(model=MODEL, prompt="hi", max_tokens=100_000), openai.BadRequestError),
        (lambda c: c.completions.create(model=MODEL, prompt="hi", n=17), openai.BadRequestError),
        (lambda c: c.completions.create(model=MODEL, prompt="hi", max_tokens=2**33), openai.BadRequestError),
        (lambda c: c.completions.create(model="gaas-small", prompt="hi"), openai.InternalServerError),
        (lambda c: c.completions.create(model=MODEL, prompt="hi", extra_body={"colour": "red"}), openai.BadRequestError),
        (lambda c: c.chat.completions.create(model=MODEL, messages=[{"role": "robot", "content": "x"}]),
         openai.BadRequestError),
        (lambda c: c.chat.completions.create(model="gpt-9", messages=[{"role": "user", "content": "x"}], stream=True),
         openai.NotFoundError),
    ],
)
def test_errors_raise_the_matching_class(mesh, call, error):
    with pytest.raises(error) as err:
        call(client(mesh))
    body = err.value.body
    assert isinstance(body, dict) and body["message"] and body["type"] and "code" in body


@pytest.mark.parametrize("key", ["gaas_not_a_real_key", "sk-from-somewhere-else"])
def test_bad_keys_are_refused(mesh, key):
    with pytest.raises(openai.AuthenticationError) as err:
        client(mesh, key=key).models.list()
    assert err.value.status_code == 401


def test_missing_key_is_401_with_a_hint(mesh):
    status, body = http(mesh, "/v1/models", method="GET", key="")
    assert status == 401
    error = json.loads(body)["error"]
    assert "Authorization: Bearer" in error["message"] and error["type"] == "authentication_error"


@pytest.mark.parametrize("key", ["", "gaas_made_up"])
@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions", "/tokenize", "/v1/generate"])
def test_a_request_without_a_valid_key_is_refused_on_its_headers_before_its_body(mesh, path, key):
    status, body = refused_on_headers(mesh, path, key)
    assert "401" in status, status
    assert "API key" in body


@pytest.mark.parametrize(
    "raw, message",
    [
        (b'{"model": "gaas-tiny", "prompt": ', "not valid JSON"),
        (b'{"model": "gaas-tiny", "prompt": 42}', "'prompt' must be a string"),
        (b'{"model": "gaas-tiny", "prompt": "x", "max_tokens": "ten"}', "'max_tokens' must be an integer"),
        (b'{"model": "gaas-tiny", "prompt": "x", "colour": "red"}', "unknown field(s) 'colour'"),
        (b'["not", "an", "object"]', "must be a JSON object"),
        # Just over the router's limit: the ingress takes it (its framing), the router names the limit.
        (json.dumps({"model": "gaas-tiny", "prompt": "x" * (1 << 20)}).encode(), "the limit is"),
    ],
)
def test_malformed_bodies_are_400_in_openai_shape(mesh, raw, message):
    status, body = http(mesh, "/v1/completions", raw)
    assert status == 400, body
    error = json.loads(body)["error"]
    assert message in error["message"] and error["type"] == "invalid_request_error"
    # ... and nothing broke: the next request is served.
    assert client(mesh).completions.create(model=MODEL, prompt="still fine", max_tokens=1).choices


def test_a_body_larger_than_the_ingress_takes_is_413_naming_the_limit(mesh):
    status, body = http(mesh, "/v1/completions", json.dumps({"model": MODEL, "prompt": "x" * (2 << 20)}).encode())
    assert status == 413, body
    error = json.loads(body)["error"]
    assert "1048576 bytes" in error["message"] and error["code"] == "request_too_large"


def test_unknown_endpoint_is_404_in_openai_shape(mesh):
    status, body = http(mesh, "/v1/audio/transcriptions", b"{}")
    assert status == 404 and "no such endpoint" in json.loads(body)["error"]["message"]


def test_cli_lists_tenants_and_keys_without_secrets(mesh, tenants):
    listed = json.loads(gaas(mesh, "tenant", "list", "--json").stdout)
    assert {"acme", "beta", "demo"} <= {t["name"] for t in listed}
    assert {t["name"]: t["tier"] for t in listed}["acme"] == "gold"
    keys = gaas(mesh, "key", "list", "acme", "--json").stdout
    assert tenants["acme"]["key_id"] in keys and tenants["acme"]["api_key"] not in keys


def test_each_tenant_authenticates_as_itself(mesh, tenants):
    for name, key in tenants.items():
        final = generate(mesh, metadata=(("authorization", f"Bearer {key['api_key']}"),), prompt="hi", max_tokens=1)[-1]
        assert final.tenant == name


def test_a_forged_tenant_header_from_outside_is_ignored(mesh, tenants):
    acme = (("authorization", f"Bearer {tenants['acme']['api_key']}"),)
    final = generate(mesh, metadata=acme + (("x-gaas-tenant", "beta"),), prompt="hi", max_tokens=1)[-1]
    assert final.tenant == "acme"
    status, body = http(mesh, "/v1/completions", json.dumps({"model": MODEL, "prompt": "hi", "max_tokens": 1}).encode(),
                        key=tenants["acme"]["api_key"], headers=[("x-gaas-tenant", "beta")])
    assert status == 200, body
    # The worker's sidecar saw the request (GaaS's id is the response id's tail) as acme's.
    request_id = "req-" + json.loads(body)["id"].removeprefix("cmpl-")
    logs = mesh.run_dir / "logs"

    def logged() -> list:
        paths = [logs / f"envoy-{w}-access.log" for w in worker_addresses(mesh)]
        return [json.loads(x) for p in paths if p.exists() for x in p.read_text().splitlines() if request_id in x]

    lines = eventually(logged, 10, every=0.3, what=f"request {request_id} in a worker sidecar's access log")
    assert {line["tenant"] for line in lines} == {"acme"}


def test_tenants_never_share_prefix_cache(mesh, tenants):
    """No timing side channel: another tenant's identical prompt never hits acme's cached blocks,
    even on the worker that holds them."""
    from concurrent.futures import ThreadPoolExecutor

    from gaas.sdk.admin import Admin

    acme = (("authorization", f"Bearer {tenants['acme']['api_key']}"),)
    prompt = "Only acme has ever sent this exact prompt before, block after block after block. " * 8
    holder = generate(mesh, metadata=acme, prompt=prompt, max_tokens=1)[-1].worker_id
    assert generate(mesh, metadata=acme, prompt=prompt, max_tokens=1)[-1].usage.cached_tokens >= 32
    suffix = str(time.time_ns() % 10**8)
    keys = []
    with Admin(mesh.ready["instances"][0]["address"]) as admin:  # control-0's sidecar
        for i in range(12):
            name = f"iso{i}x{suffix}"
            admin.create_tenant(name, "silver")
            keys.append((name, admin.create_key(name)[1]))
    # Fresh tenants have no prefix of their own anywhere: one at a time they all go wherever the
    # load scorers prefer; sent at once, the router spreads them over the workers, the holder too.
    landed_on_holder = False
    with ThreadPoolExecutor(len(keys) // 2) as pool:
        for burst in (keys[:6], keys[6:]):
            finals = list(pool.map(lambda nk: (nk[0], generate(mesh, metadata=(("authorization", f"Bearer {nk[1]}"),),
                                                               prompt=prompt, max_tokens=1)[-1]), burst))
            for name, final in finals:
                assert final.usage.cached_tokens == 0, f"{name} hit acme's blocks on {final.worker_id}"
                landed_on_holder = landed_on_holder or final.worker_id == holder
            if landed_on_holder:
                break
    assert landed_on_holder, "no other tenant's request reached the worker holding acme's prompt"


def test_revoked_key_stops_working_within_seconds(mesh, tenants):
    r = gaas(mesh, "key", "create", "beta", "--json")
    key = json.loads(r.stdout)
    c = client(mesh, key["api_key"])
    assert c.completions.create(model=MODEL, prompt="hi", max_tokens=1).choices
    revoked_at = time.monotonic()
    r = gaas(mesh, "key", "revoke", key["key_id"])
    assert r.returncode == 0 and "revoked" in r.stdout
    def refused() -> bool:
        try:
            c.completions.create(model=MODEL, prompt="hi", max_tokens=1)
        except openai.AuthenticationError:
            return True
        return False

    eventually(refused, 5 - (time.monotonic() - revoked_at), what="the revoked key refused within 5 s of revoking")
    # gRPC refuses it too; the tenant's other key still works.
    with pytest.raises(grpc.RpcError) as err:
        generate(mesh, metadata=(("authorization", f"Bearer {key['api_key']}"),), prompt="hi", max_tokens=1)
    assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
    assert client(mesh, tenants["beta"]["api_key"]).completions.create(model=MODEL, prompt="hi", max_tokens=1).choices


def test_cli_admin_errors_are_clear(mesh):
    r = gaas(mesh, "key", "create", "ghost")
    assert r.returncode == 1 and "NOT_FOUND" in r.stderr and "gaas tenant create" in r.stderr
    r = gaas(mesh, "tenant", "create", "Bad Name")
    assert r.returncode == 1 and "lower-case" in r.stderr
