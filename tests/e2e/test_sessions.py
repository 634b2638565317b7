"""Sessions through the real mesh: a conversation kept by GaaS across turns that send only their new
message (the official openai client with the x-gaas-session header, and the session_id body
extension), its turns landing on the worker that holds its prefix (served from that engine's
cache), a concurrent turn refused with HTTP 409, `gaas session list|show|delete`, another tenant's
session not found, and sessions counted in the tenant's usage."""

from __future__ import annotations

import json
import re
import threading
import uuid

import openai
import pytest

from gaas.sdk.client import GaasClient
from tests.meshutil import gaas, http
from tests.e2e.support import client, new_tenant
from tests.waiting import eventually

pytestmark = pytest.mark.mesh

MODEL = "gaas-tiny"


def sid() -> str:
    return f"s-{uuid.uuid4().hex[:12]}"


def test_a_chat_keeps_its_context_and_each_turn_sends_only_its_new_message(mesh):
    c = client(mesh, mesh.api_key)
    session = {"x-gaas-session": sid()}
    first = c.chat.completions.create(model=MODEL, max_tokens=6, extra_headers=session, messages=[
        {"role": "system", "content": "You answer in one line."}, {"role": "user", "content": "Name a colour."}])
    second = c.chat.completions.create(model=MODEL, max_tokens=6, extra_headers=session,
                                       messages=[{"role": "user", "content": "And another?"}])
    assert first.model_extra["gaas_session"] == {"id": session["x-gaas-session"], "version": 1, "turns": 1,
                                                 "context_tokens": first.usage.total_tokens, "created": True}
    turn = second.model_extra["gaas_session"]
    assert (turn["version"], turn["turns"], turn["created"]) == (2, 2, False)
    # The second prompt is the whole conversation: the first prompt, its reply, the new message.
    alone = c.chat.completions.create(model=MODEL, max_tokens=1, messages=[{"role": "user", "content": "And another?"}])
    assert second.usage.prompt_tokens > first.usage.total_tokens > alone.usage.prompt_tokens
    status, body = http(mesh, f"/v1/gaas/sessions/{session['x-gaas-session']}", method="GET")
    assert status == 200, body
    shown = json.loads(body)
    assert [m["role"] for m in shown["messages"]] == ["system", "user", "assistant", "user", "assistant"]
    assert shown["messages"][2]["content"] == first.choices[0].message.content
    assert shown["messages"][4]["content"] == second.choices[0].message.content


def test_a_sessions_turns_land_on_the_worker_holding_its_prefix(mesh):
    s = sid()
    workers, cached = [], []
    with GaasClient(mesh.ingress, api_key=mesh.api_key) as g:
        for i in range(4):
            # A long first message: several KV blocks to find again on the next turns.
            text = ("Tell me about the history of ships and harbours. " * 12) if i == 0 else f"Go on ({i})."
            final = list(g.generate("", messages=[("user", text)], session_id=s, max_tokens=8, timeout=60))[-1]
            workers.append(final.worker_id)
            cached.append(final.usage.cached_tokens)
            assert final.session.version == i + 1
    assert len(set(workers)) == 1, f"every turn went to the worker of the first: {workers}"
    assert all(c >= 128 for c in cached[1:]), f"later turns were served from that worker's cache: {cached}"


def test_a_second_turn_while_one_is_streaming_gets_409_and_the_first_commits(mesh):
    c = client(mesh, mesh.api_key)
    body = {"session_id": sid(), "ignore_eos": True}
    c.completions.create(model=MODEL, prompt="A long tale:", max_tokens=2, extra_body=body)
    done: dict = {}

    def long_turn():
        done["r"] = c.completions.create(model=MODEL, prompt=" Go on.", max_tokens=600, extra_body=body)

    t = threading.Thread(target=long_turn)
    t.start()
    def turn_in_progress() -> bool:
        _, listed = http(mesh, "/v1/gaas/sessions", method="GET")
        return any(x["session_id"] == body["session_id"] and x.get("turn_in_progress")
                   for x in json.loads(listed).get("sessions", []))

    eventually(turn_in_progress, 10, every=0.02, what="the long turn in progress")
    with pytest.raises(openai.ConflictError) as caught:
        c.completions.create(model=MODEL, prompt=" and then", max_tokens=4, extra_body=body)
    assert caught.value.body["code"] == "session_busy" and "turn in progress" in caught.value.body["message"]
    t.join(60)
    assert done["r"].model_extra["gaas_session"]["version"] == 2
    after = c.completions.create(model=MODEL, prompt=" and then", max_tokens=4, extra_body=body)
    assert after.model_extra["gaas_session"]["version"] == 3
    status, metrics = http(mesh, "/metrics", method="GET", key="")
    assert status == 200
    for outcome in ("busy", "committed"):
        assert re.search(rf'^gaas_router_session_turns_total{{outcome="{outcome}"}} [1-9]', metrics, re.M), outcome


def test_gaas_session_list_show_delete_and_another_tenant_sees_none_of_it(mesh):
    s = sid()
    c = client(mesh, mesh.api_key)
    c.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=4, extra_headers={"x-gaas-session": s})
    listed = gaas(mesh, "session", "list", "--json")
    assert listed.returncode == 0, listed.stderr
    row = next(r for r in json.loads(listed.stdout) if r["session_id"] == s)
    assert row["kind"] == "text" and row["version"] == 1 and row["model"] == MODEL and row["turns"] == 1
    shown = gaas(mesh, "session", "show", s)
    assert shown.returncode == 0 and "[prompt]\nOnce upon a time" in shown.stdout, shown.stdout
    name_b, key_b = new_tenant(mesh)
    # another tenant: not found under its key, whatever it tries; its own session of that id is its own
    assert http(mesh, f"/v1/gaas/sessions/{s}", method="GET", key=key_b)[0] == 404
    assert http(mesh, f"/v1/gaas/sessions/{s}", method="DELETE", key=key_b)[0] == 404
    assert s not in http(mesh, "/v1/gaas/sessions", method="GET", key=key_b)[1]
    theirs = client(mesh, key_b).completions.create(model=MODEL, prompt="Hi", max_tokens=2,
                                                    extra_headers={"x-gaas-session": s})
    assert theirs.model_extra["gaas_session"]["created"] is True
    # the operator names the tenant instead (through the router's sidecar, no API key)
    listed_b = gaas(mesh, "session", "list", "--tenant", name_b, "--json")
    assert listed_b.returncode == 0 and [r["session_id"] for r in json.loads(listed_b.stdout)] == [s], listed_b.stderr
    shown_b = gaas(mesh, "session", "show", s, "--tenant", name_b)
    assert shown_b.returncode == 0 and "[prompt]\nHi" in shown_b.stdout and "Once upon" not in shown_b.stdout
    deleted = gaas(mesh, "session", "delete", s)
    assert deleted.returncode == 0, deleted.stderr
    again = gaas(mesh, "session", "show", s)
    assert again.returncode == 1 and "NOT_FOUND" in again.stderr
    status, body = http(mesh, f"/v1/gaas/sessions/{s}", method="GET", key=key_b)
    assert status == 200 and json.loads(body)["version"] == 1, "deleting acme's did not touch theirs"


def test_sessions_are_counted_in_the_tenants_usage(mesh):
    name, key = new_tenant(mesh)
    c = client(mesh, key)
    for s in ("a", "a", "b"):
        c.completions.create(model=MODEL, prompt="Hello", max_tokens=2, extra_headers={"x-gaas-session": s})
    c.completions.create(model=MODEL, prompt="Hello", max_tokens=2)
    def usage() -> dict:
        status, body = http(mesh, "/v1/gaas/usage", method="GET", key=key)
        return json.loads(body).get("total", {}) if status == 200 else {}

    total = eventually(lambda: int((t := usage()).get("requests", 0)) == 4 and t, 20, every=0.5,
                       what=lambda: f"the 4 requests in the tenant's usage ({usage()})")
    assert int(total["sessions"]) == 2


def test_a_turn_that_does_not_fit_and_a_malformed_id_get_clear_400s(mesh):
    c = client(mesh, mesh.api_key)
    with pytest.raises(openai.BadRequestError, match="letters, digits"):
        c.completions.create(model=MODEL, prompt="x", max_tokens=2, extra_headers={"x-gaas-session": "no spaces"})
    with pytest.raises(openai.BadRequestError, match="one prompt, not a batch"):
        c.completions.create(model=MODEL, prompt=["a", "b"], max_tokens=2, extra_headers={"x-gaas-session": sid()})
    with pytest.raises(openai.BadRequestError, match="n must be 1"):
        c.completions.create(model=MODEL, prompt="a", n=2, max_tokens=2, extra_headers={"x-gaas-session": sid()})
