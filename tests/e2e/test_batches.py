"""OpenAI's Files and Batch APIs at the ingress, with the official `openai` client unmodified:
a JSONL file uploaded, a batch of it run to completion (its output and error files in OpenAI's
shape, every custom_id once), each item billed once at the batch price, a cancel that stops what
had not started, a file that is not a batch input, another tenant that sees nothing, fuzzed
uploads and bodies that never answer 5xx; and (destructive) a router and billing each killed -9
mid-batch: no item lost, none billed twice."""

from __future__ import annotations

import io
import json
import os
from functools import partial
import signal
import time

import openai
import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from gaas.contracts import pricing
from tests.e2e.support import (GOLD, children, error_shaped, instance, ledger_totals, needs_own_mesh, new_tenant, send,
                               wait_restarted, wait_serving)
from gaas.sdk.admin import Admin
from tests.conftest import on_direct_path
from tests.meshutil import openai_client, wait_for_lines
from tests.waiting import eventually

pytestmark = [pytest.mark.mesh,
              on_direct_path("batch items are run by the routers' runner and files go to the routers on either path: "
                             "once per suite, CI's budget")]

MODEL = "gaas-tiny"
CHAT = "/v1/chat/completions"
FINAL = ("completed", "failed", "expired", "cancelled")


client = partial(openai_client, timeout=120, retries=2)


def lines(n: int, max_tokens: int = 6, url: str = CHAT, bad: tuple[int, ...] = ()) -> bytes:
    out = []
    for i in range(n):
        body = ({"model": MODEL, "messages": [{"role": "user", "content": f"question {i}"}], "max_tokens": max_tokens,
                 "temperature": 0} if url == CHAT else {"model": MODEL, "prompt": f"p{i}", "max_tokens": max_tokens})
        if i in bad:
            body["max_tokens"] = -1
        out.append(json.dumps({"custom_id": f"req-{i}", "method": "POST", "url": url, "body": body}))
    return "\n".join(out).encode()


def run_batch(c: openai.OpenAI, data: bytes, endpoint: str = CHAT, **kw):
    f = c.files.create(file=("batch.jsonl", io.BytesIO(data)), purpose="batch")
    return c.batches.create(input_file_id=f.id, endpoint=endpoint, completion_window="24h", **kw)


def wait_final(c: openai.OpenAI, batch_id: str, timeout: float = 300):
    # (a router or billing may be restarting meanwhile)
    return eventually(lambda: (b := c.batches.retrieve(batch_id)).status in FINAL and b, timeout, every=0.5,
                      ignoring=(openai.APIConnectionError, openai.InternalServerError),
                      what=f"batch {batch_id} finished")


def jsonl(c: openai.OpenAI, file_id: str | None) -> list[dict]:
    return [json.loads(x) for x in c.files.content(file_id).text.splitlines()] if file_id else []


@pytest.fixture(scope="module")
def tenant(mesh):
    return new_tenant(mesh, "gold")


def test_a_batch_runs_to_completion_with_the_openai_client(mesh, tenant):
    _, key = tenant
    c = client(mesh, key)
    b = run_batch(c, lines(12, bad=(5,)), metadata={"job": "nightly"})
    assert b.status == "in_progress" and b.request_counts.total == 12 and b.metadata == {"job": "nightly"}
    done = wait_final(c, b.id)
    assert done.status == "completed" and done.completed_at and done.finalizing_at
    assert (done.request_counts.completed, done.request_counts.failed) == (11, 1)
    out, err = jsonl(c, done.output_file_id), jsonl(c, done.error_file_id)
    assert sorted(x["custom_id"] for x in out) == sorted(f"req-{i}" for i in range(12) if i != 5)
    for x in out:
        body = x["response"]["body"]
        assert x["response"]["status_code"] == 200 and body["object"] == "chat.completion"
        assert body["usage"]["completion_tokens"] == 6 and body["choices"][0]["message"]["content"] is not None
    assert [x["custom_id"] for x in err] == ["req-5"]
    assert err[0]["response"]["status_code"] == 400 and err[0]["response"]["body"]["error"]["param"] == "max_tokens"
    assert b.id in [x.id for x in c.batches.list(limit=100).data]
    info = c.files.retrieve(done.output_file_id)
    assert info.purpose == "batch_output" and info.bytes == len(c.files.content(done.output_file_id).content)


def test_each_item_is_billed_once_at_the_batch_price(mesh):
    name, key = new_tenant(mesh, "gold")
    c = client(mesh, key)
    done = wait_final(c, run_batch(c, lines(8, max_tokens=5)).id)
    out = jsonl(c, done.output_file_id)
    prompt = sum(x["response"]["body"]["usage"]["prompt_tokens"] for x in out)
    completion = sum(x["response"]["body"]["usage"]["completion_tokens"] for x in out)
    eventually(lambda: ledger_totals(mesh, name)[0] >= 8, 60, every=0.5, what="the batch's 8 requests in the ledger")
    requests, ledger_prompt, cached, ledger_completion = ledger_totals(mesh, name)
    assert (requests, ledger_prompt, ledger_completion) == (8, prompt, completion)
    from gaas.sdk.admin import BillingAdmin
    with BillingAdmin(instance(mesh, "billing-0")) as billing:
        cost = pricing.micros(billing.usage(name)["total"]["cost_usd"])
    full = pricing.cost_micros(GOLD, prompt, cached, completion)
    assert abs(cost - full / 2) <= 3 * 8, f"billed {cost} micro-USD; the batch price is half of {full}"


def test_completions_can_be_batched_too(mesh, tenant):
    c = client(mesh, tenant[1])
    done = wait_final(c, run_batch(c, lines(3, url="/v1/completions"), endpoint="/v1/completions").id)
    assert done.status == "completed"
    assert {x["response"]["body"]["object"] for x in jsonl(c, done.output_file_id)} == {"text_completion"}


def test_a_file_that_is_not_a_batch_input_makes_a_failed_batch_naming_its_lines(mesh, tenant):
    c = client(mesh, tenant[1])
    data = lines(2) + b"\nnot json\n" + lines(1)
    b = run_batch(c, data)
    assert b.status == "failed" and b.failed_at
    assert [(e.line, e.code) for e in b.errors.data] == [(3, "invalid_json_line"), (4, "duplicate_custom_id")]
    wrong = run_batch(c, lines(1, url="/v1/completions"))
    assert wrong.status == "failed" and wrong.errors.data[0].code == "mismatched_endpoint"


def test_cancel_stops_what_has_not_started(mesh, tenant):
    c = client(mesh, tenant[1])
    b = run_batch(c, lines(200, max_tokens=32))
    cancelled = c.batches.cancel(b.id)
    assert cancelled.status in ("cancelling", "cancelled")
    done = wait_final(c, b.id, timeout=120)
    assert done.status == "cancelled" and done.cancelled_at and done.cancelling_at
    ran = done.request_counts.completed + done.request_counts.failed
    assert ran < 200
    err = jsonl(c, done.error_file_id)
    assert len(err) == 200 - ran and {x["error"]["code"] for x in err} == {"batch_cancelled"}
    with pytest.raises(openai.BadRequestError):
        c.batches.cancel(b.id)


def wait_counts(c: openai.OpenAI, batch_id: str, done: int, timeout: float = 60):
    """The batch once at least done of its requests have run (completed or failed)."""
    def ran(b) -> bool:
        return b.request_counts.completed + b.request_counts.failed >= done or b.status in FINAL

    return eventually(lambda: ran(b := c.batches.retrieve(batch_id)) and b, timeout, every=0.3,
                      what=f"{done} requests of batch {batch_id} run")


def test_revoking_a_batchs_key_fails_its_next_request_and_cancels_the_batch(mesh):
    name, key = new_tenant(mesh, "gold")
    c = client(mesh, key)
    b = run_batch(c, lines(300, max_tokens=32))
    wait_counts(c, b.id, 1)
    with Admin(instance(mesh, "control-0")) as admin:
        [k] = admin.list_keys(name)
        admin.revoke_key(k["key_id"])
    with Admin(instance(mesh, "control-0")) as admin:
        _, other = admin.create_key(name)  # (the batch's owner reads it with another key)
    c = client(mesh, other)
    done = wait_final(c, b.id, timeout=120)
    assert done.status == "cancelled"
    codes = [x["error"]["code"] if x["error"] else x["response"]["status_code"] for x in jsonl(c, done.error_file_id)]
    assert 401 in codes and "batch_cancelled" in codes


def test_a_batch_is_held_to_its_tenants_quota(mesh):
    name, key = new_tenant(mesh, "gold")
    with Admin(instance(mesh, "control-0")) as admin:
        admin.update_tenant(name, limits={"rpm": 3})
    c = client(mesh, key)
    b = run_batch(c, lines(10))
    ran = wait_counts(c, b.id, 3)
    # Its fourth request is given back for the quota (and backs off) instead of running.
    wait_for_lines(mesh.run_dir / "logs" / "router-0.log", b.id, "given back", timeout=30)
    now = c.batches.retrieve(b.id)
    assert ran.request_counts.completed == now.request_counts.completed == 3 and now.status == "in_progress"
    c.batches.cancel(b.id)


def test_another_tenant_sees_none_of_a_tenants_files_or_batches(mesh, tenant):
    c = client(mesh, tenant[1])
    b = run_batch(c, lines(1))
    other = client(mesh, new_tenant(mesh, "silver")[1])
    for call in (lambda: other.batches.retrieve(b.id), lambda: other.batches.cancel(b.id),
                 lambda: other.files.retrieve(b.input_file_id), lambda: other.files.content(b.input_file_id),
                 lambda: other.files.delete(b.input_file_id),
                 lambda: other.batches.create(input_file_id=b.input_file_id, endpoint=CHAT, completion_window="24h")):
        with pytest.raises(openai.NotFoundError):
            call()
    assert b.id not in [x.id for x in other.batches.list().data]
    assert b.input_file_id not in [f.id for f in other.files.list().data]


def test_files_are_listed_retrieved_and_deleted(mesh, tenant):
    c = client(mesh, tenant[1])
    f = c.files.create(file=("mine.jsonl", io.BytesIO(lines(2))), purpose="batch")
    assert (f.filename, f.purpose, f.bytes) == ("mine.jsonl", "batch", len(lines(2)))
    assert c.files.content(f.id).content == lines(2)
    assert f.id in [x.id for x in c.files.list(purpose="batch").data]
    assert c.files.delete(f.id).deleted
    with pytest.raises(openai.NotFoundError):
        c.files.retrieve(f.id)
    with pytest.raises(openai.BadRequestError) as err:
        c.files.create(file=("x.jsonl", io.BytesIO(b"{}")), purpose="fine-tune")
    assert err.value.body["param"] == "purpose"


def test_gaas_batch_shows_a_batch_to_the_operator(mesh, tenant):
    from tests.meshutil import gaas

    c = client(mesh, tenant[1])
    done = wait_final(c, run_batch(c, lines(1)).id)
    r = gaas(mesh, "batch", "show", done.id, "--json")
    assert r.returncode == 0, r.stderr
    shown = json.loads(r.stdout)
    assert (shown["tenant"], shown["status"], shown["price_factor"]) == (tenant[0], "completed", 0.5)
    r = gaas(mesh, "batch", "list", "--tenant", tenant[0])
    assert r.returncode == 0 and done.id in r.stdout
    r = gaas(mesh, "batch", "cancel", done.id)
    assert r.returncode != 0 and "only a batch in progress" in r.stderr


# ------------------------------------------------------------------ fuzz

_parts = st.lists(st.tuples(st.sampled_from(["file", "purpose", "x", ""]),
                            st.sampled_from(["batch", "", "fine-tune", "a" * 300]) | st.text(max_size=8),
                            st.sampled_from([b"", b"{}", lines(1), b"\xff\xfe", b"\n\n"]) | st.binary(max_size=64)),
                  max_size=3)


@settings(max_examples=150, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True)
@given(parts=_parts, content_type=st.sampled_from(["multipart/form-data; boundary=B", "multipart/form-data",
                                                   "application/json", "multipart/mixed; boundary=B", ""]),
       tail=st.sampled_from([b"--B--\r\n", b"", b"--B"]))
def test_fuzz_uploads_never_answer_5xx(mesh, conn, parts, content_type, tail):
    body = b""
    for name, value, data in parts:
        body += f'--B\r\nContent-Disposition: form-data; name="{name}"'.encode()
        body += (b'; filename="f.jsonl"\r\n\r\n' + data if name == "file" else b"\r\n\r\n" + value.encode())
        body += b"\r\n"
    status, text = send(conn, "POST", "/v1/files", body + tail,
                         {"authorization": f"Bearer {mesh.api_key}", "content-type": content_type})
    event(f"HTTP {status}")
    if status != 200:
        error_shaped(status, text)
    else:
        assert json.loads(text)["object"] == "file"


_create_fields = {
    "input_file_id": st.sampled_from(["file-" + "0" * 32, "", "x" * 200, "batch_x"]) | st.integers() | st.none(),
    "endpoint": st.sampled_from([CHAT, "/v1/completions", "/v1/embeddings", "", "/v1/responses"]) | st.integers(),
    "completion_window": st.sampled_from(["24h", "1h", ""]) | st.integers() | st.none(),
    "metadata": st.dictionaries(st.text(max_size=70), st.text(max_size=10) | st.integers(), max_size=20) | st.text(),
    "output_expires_after": st.just({"anchor": "created_at", "seconds": 3600}),
    "extra": st.integers(),
}


@settings(max_examples=150, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True)
@given(fields=st.lists(st.sampled_from(sorted(_create_fields)), max_size=5, unique=True), data=st.data())
def test_fuzz_batch_creation_never_answers_5xx(mesh, conn, fields, data):
    body = {name: data.draw(_create_fields[name]) for name in fields}
    status, text = send(conn, "POST", "/v1/batches", json.dumps(body).encode(),
                         {"authorization": f"Bearer {mesh.api_key}", "content-type": "application/json"})
    event(f"HTTP {status}")
    assert status != 200, text  # no such file: never a batch
    error_shaped(status, text)


# ------------------------------------------------------------------ faults

@pytest.mark.destructive
def test_killing_the_router_and_billing_mid_batch_loses_no_item_and_bills_none_twice(mesh):
    needs_own_mesh(mesh)
    name, key = new_tenant(mesh, "gold")
    c = client(mesh, key)
    n = 120
    b = run_batch(c, lines(n, max_tokens=16))
    for victim in ("router-0", "billing-0"):
        start = c.batches.retrieve(b.id).request_counts.completed
        eventually(lambda: c.batches.retrieve(b.id).request_counts.completed >= start + 10, 120,
                   what="the batch's progress (10 more requests)")
        pid = children(mesh)[victim]
        os.kill(pid, signal.SIGKILL)
        wait_restarted(mesh, victim, pid)
        wait_serving(mesh, victim)
    done = wait_final(c, b.id)
    assert done.status == "completed" and done.request_counts.completed == n
    out = jsonl(c, done.output_file_id)
    assert sorted(x["custom_id"] for x in out) == sorted(f"req-{i}" for i in range(n))
    eventually(lambda: ledger_totals(mesh, name)[0] >= n, 60, every=0.5, what=f"the batch's {n} requests in the ledger")
    time.sleep(2)  # (a second bill of an item would land by now)
    assert ledger_totals(mesh, name)[0] == n, "each item is billed once"
