"""Batches' durable state on SQLite and PostgreSQL: a file's lines checked at creation, items
claimed with leases (a lapsed one claimed again), each completed once, the output and error
files written once when the last item is done, cancel and expiry, and a tenant that sees only
its own files and batches."""

import json

import pytest

from gaas.contracts import batches as terms, errors
from gaas.runtime.sql import Database
from gaas.v1 import billing_pb2 as pb
from services.billing.batches import BatchStore
from services.billing.filestore import DirectoryFileStore

TABLES = ("batch_files", "batches", "batch_items", "schema_migrations")
CHAT = "/v1/chat/completions"


class Clock:
    def __init__(self) -> None:
        self.t = 1_800_000_000.0

    def __call__(self) -> float:
        return self.t


@pytest.fixture
async def store(database_url, tmp_path):
    db = Database(database_url)
    for t in TABLES:
        db.execute_sync(f"DROP TABLE IF EXISTS {t}")
    clock = Clock()
    s = BatchStore(db, DirectoryFileStore(tmp_path / "files"), terms.BatchPolicy(max_items=100), clock=clock)
    s.clock = clock
    await s.init_schema()
    yield s
    for t in TABLES:
        db.execute_sync(f"DROP TABLE IF EXISTS {t}")
    db.close()


def owner(tenant="acme"):
    return pb.BatchOwner(tenant=tenant, tier="gold", key_id="key_1", cache_salt="salt")


def lines(n, url=CHAT):
    return b"".join(json.dumps({"custom_id": f"r{i}", "method": "POST", "url": url,
                                "body": {"model": "m", "messages": [{"role": "user", "content": f"q{i}"}]}}).encode()
                    + b"\n" for i in range(n))


async def new_batch(store, n=3, tenant="acme"):
    f = await store.files.create(tenant, "in.jsonl", "batch", lines(n))
    return await store.create_batch(owner(tenant), f.id, CHAT, {"job": "x"})


async def read(store, tenant, file_id) -> bytes:
    return b"".join([piece async for piece in await store.files.read(tenant, file_id)])


def ref(item):
    return pb.BatchItemRef(batch_id=item.batch_id, index=item.index)


async def test_a_batch_runs_each_item_once_and_writes_its_output_in_input_order(store):
    b = await new_batch(store, 3)
    assert b.status == "in_progress" and b.total == 3 and b.price_factor == 0.5
    items = await store.claim("router-0", 10, 30)
    assert [i.custom_id for i in items] == ["r0", "r1", "r2"] and items[0].owner.cache_salt == "salt"
    assert await store.claim("router-1", 10, 30) == []  # all leased
    for item in reversed(items):
        code = 400 if item.index == 1 else 200
        body = {"error": {"message": "bad"}} if code == 400 else {"choices": [{"index": 0}]}
        assert await store.complete("router-0", ref(item), code, json.dumps(body).encode(), f"batch-{item.index}")
    assert not await store.complete("router-0", ref(items[0]), 200, b"{}", "again")  # once
    done = await store.get_batch("acme", b.id)
    assert (done.status, done.completed, done.failed) == ("completed", 2, 1)
    out = [json.loads(x) for x in (await read(store, "acme", done.output_file_id)).splitlines()]
    assert [x["custom_id"] for x in out] == ["r0", "r2"] and out[0]["response"]["status_code"] == 200
    err = [json.loads(x) for x in (await read(store, "acme", done.error_file_id)).splitlines()]
    assert err[0]["custom_id"] == "r1" and err[0]["response"]["body"]["error"]["message"] == "bad"
    await store.maintain()  # finishing again changes nothing
    assert (await store.get_batch("acme", b.id)).output_file_id == done.output_file_id


async def test_an_item_whose_runner_stopped_is_claimed_again_after_its_lease(store):
    await new_batch(store, 1)
    first = await store.claim("router-0", 10, 30)
    store.clock.t += 31
    again = await store.claim("router-1", 10, 30)
    assert [i.custom_id for i in again] == ["r0"] and again[0].attempt == 2
    assert await store.renew("router-0", [ref(first[0])], 30) == []  # no longer router-0's
    assert len(await store.renew("router-1", [ref(again[0])], 30)) == 1


async def test_released_items_are_claimable_at_once_and_not_counted_as_a_run(store):
    await new_batch(store, 2)
    items = await store.claim("router-0", 10, 30)
    await store.release("router-0", [ref(i) for i in items])
    again = await store.claim("router-1", 10, 30)
    assert [i.attempt for i in again] == [1, 1]


async def test_a_file_that_is_not_a_batch_input_makes_a_failed_batch_naming_its_lines(store):
    data = lines(1) + b"not json\n" + lines(1) + json.dumps({"custom_id": "x", "method": "GET", "url": CHAT,
                                                               "body": {"model": "m"}}).encode()
    f = await store.files.create("acme", "in.jsonl", "batch", data)
    b = await store.create_batch(owner(), f.id, CHAT, {})
    assert b.status == "failed" and b.failed_at
    assert [(e.line, e.code) for e in b.errors] == [(2, "invalid_json_line"), (3, "duplicate_custom_id"),
                                                     (4, "invalid_method")]
    assert await store.claim("router-0", 10, 30) == []


async def test_cancel_stops_unclaimed_items_and_waits_for_running_ones(store):
    b = await new_batch(store, 3)
    running = await store.claim("router-0", 1, 30)
    c = await store.cancel_batch("acme", b.id)
    assert c.status == "cancelling" and c.cancelling_at
    assert await store.claim("router-1", 10, 30) == []
    assert await store.renew("router-0", [ref(running[0])], 30) == []  # its runner stops it
    await store.complete("router-0", ref(running[0]), 200, b"{}", "req")
    c = await store.get_batch("acme", b.id)
    assert c.status == "cancelled" and c.completed == 1
    err = [json.loads(x) for x in (await read(store, "acme", c.error_file_id)).splitlines()]
    assert [x["error"]["code"] for x in err] == ["batch_cancelled"] * 2
    with pytest.raises(errors.FailedPrecondition):
        await store.cancel_batch("acme", b.id)


async def test_a_batch_past_its_window_expires_with_its_unrun_items_failed(store):
    b = await new_batch(store, 2)
    done = await store.claim("router-0", 1, 30)
    await store.complete("router-0", ref(done[0]), 200, b"{}", "req")
    store.clock.t += terms.WINDOW_SECONDS + 1
    assert await store.claim("router-0", 10, 30) == []
    await store.maintain()
    e = await store.get_batch("acme", b.id)
    assert e.status == "expired" and e.expired_at and e.output_file_id and e.error_file_id


async def test_a_tenant_sees_only_its_own_files_and_batches(store):
    b = await new_batch(store, 1, tenant="acme")
    with pytest.raises(errors.NotFound):
        await store.get_batch("globex", b.id)
    with pytest.raises(errors.NotFound):
        await read(store, "globex", b.input_file_id)
    with pytest.raises(errors.NotFound):
        await store.create_batch(owner("globex"), b.input_file_id, CHAT, {})
    assert (await store.list_batches("globex", 20, ""))[0] == []
    assert [x.id for x in (await store.list_batches("", 20, ""))[0]] == [b.id]  # the operator's view


async def test_files_list_in_pages_and_a_deleted_file_is_gone(store):
    ids = []
    for i in range(3):
        store.clock.t += 1
        ids.append((await store.files.create("acme", f"{i}.jsonl", "batch", lines(1))).id)
    page, more = await store.files.list("acme", "", 2, "", "")
    assert [f.id for f in page] == ids[::-1][:2] and more
    page, more = await store.files.list("acme", "", 2, page[-1].id, "")
    assert [f.id for f in page] == [ids[0]] and not more
    assert (await store.files.delete("acme", ids[0])).deleted
    with pytest.raises(errors.NotFound):
        await read(store, "acme", ids[0])


async def test_limits_refuse_a_large_file_and_too_many_requests(store):
    with pytest.raises(errors.InvalidArgument, match="at most"):
        await store.files.create("acme", "big.jsonl", "batch", b"x" * (terms.MAX_UPLOAD_BYTES + 1))
    f = await store.files.create("acme", "in.jsonl", "batch", lines(101))
    b = await store.create_batch(owner(), f.id, CHAT, {})
    assert b.status == "failed" and b.errors[0].code == "too_many_requests"


async def test_a_restarted_runner_claims_its_previous_lifes_items_at_once(store):
    await new_batch(store, 2)
    await store.claim("router-0", 10, 30)
    assert await store.claim("router-0", 10, 30) == []
    again = await store.claim("router-0", 10, 30, fresh=True)
    assert [i.attempt for i in again] == [2, 2]


async def test_claims_go_round_the_tenants_so_one_tenants_old_batch_never_holds_anothers_back(store):
    await new_batch(store, 20, tenant="hog")
    store.clock.t += 1
    await new_batch(store, 2, tenant="acme")
    first = await store.claim("router-0", 2, 30)
    assert sorted(i.owner.tenant for i in first) == ["acme", "hog"]
    second = await store.claim("router-0", 1, 30)
    third = await store.claim("router-0", 1, 30)
    assert {second[0].owner.tenant, third[0].owner.tenant} == {"acme", "hog"}


async def test_an_item_that_cannot_run_backs_off_then_fails_with_its_reason_while_others_run(store):
    stuck = await new_batch(store, 1, tenant="broke")
    store.clock.t += 1
    other = await new_batch(store, 1, tenant="acme")
    claimed = []
    for attempt in range(1, terms.ITEM_ATTEMPTS + 1):
        claimed += await store.claim("router-0", 10, 30)
        items = [i for i in claimed if i.owner.tenant == "broke"]
        assert [i.attempt for i in items] == [attempt]
        await store.release("router-0", [ref(items[0])], "tenant broke has used its monthly budget")
        assert await store.claim("router-0", 10, 30) == []  # backing off; acme's item is running
        claimed = [i for i in claimed if i.owner.tenant == "acme"]
        store.clock.t += terms.item_backoff_s(attempt) + 0.01
    done = await store.get_batch("broke", stuck.id)
    assert (done.status, done.failed) == ("completed", 1)
    err = json.loads(await read(store, "broke", done.error_file_id))
    assert err["error"]["code"] == "not_run" and "monthly budget" in err["error"]["message"]
    assert (await store.get_batch("acme", other.id)).status == "in_progress"


async def test_an_item_given_back_is_not_claimed_again_before_its_back_off(store):
    await new_batch(store, 1)
    items = await store.claim("router-0", 10, 30)
    await store.release("router-0", [ref(items[0])], "no worker serves model m")
    assert await store.claim("router-0", 10, 30) == []
    store.clock.t += terms.item_backoff_s(1) + 0.01
    assert [i.attempt for i in await store.claim("router-0", 10, 30)] == [2]


async def test_an_answer_over_the_most_an_item_may_have_is_kept_as_its_error(store):
    b = await new_batch(store, 1)
    items = await store.claim("router-0", 10, 30)
    huge = b'{"choices":"' + b"x" * terms.MAX_ANSWER_BYTES + b'"}'
    assert await store.complete("router-0", ref(items[0]), 200, huge, "req")
    done = await store.get_batch("acme", b.id)
    assert (done.completed, done.failed, done.output_file_id) == (0, 1, "")
    err = json.loads(await read(store, "acme", done.error_file_id))
    assert err["error"]["code"] == "answer_too_large" and "max_tokens" in err["error"]["message"]


async def test_a_batch_whose_answers_reach_its_limit_stops_with_the_rest_unrun(database_url, tmp_path):
    s = await policy_store(database_url, tmp_path, terms.BatchPolicy(max_output_bytes=2000))
    f = await s.files.create("acme", "in.jsonl", "batch", lines(5))
    b = await s.create_batch(owner(), f.id, CHAT, {})
    items = await s.claim("router-0", 2, 30)
    for item in items:
        await s.complete("router-0", ref(item), 200, b'{"text":"' + b"y" * 900 + b'"}', "req")
    done = await s.get_batch("acme", b.id)
    assert (done.status, done.completed, done.failed) == ("failed", 1, 1)
    assert done.errors[0].code == "output_limit_exceeded"
    err = [json.loads(x)["error"]["code"] for x in (await read(s, "acme", done.error_file_id)).splitlines()]
    assert err == ["batch_output_limit"] * 4


async def test_a_tenants_files_and_answers_are_bounded_in_bytes_and_outputs_count_as_files(database_url, tmp_path):
    s = await policy_store(database_url, tmp_path, terms.BatchPolicy(max_tenant_bytes=3000, max_files=4))
    f = await s.files.create("acme", "in.jsonl", "batch", lines(2))
    with pytest.raises(errors.ResourceExhausted, match="bytes") as err:
        await s.files.create("acme", "big.jsonl", "batch", b"x" * 3000)
    assert err.value.reason == "too_many_file_bytes"
    await s.files.create("globex", "big.jsonl", "batch", b"x" * 2500)  # another tenant's room is its own
    await s.create_batch(owner(), f.id, CHAT, {})
    with pytest.raises(errors.ResourceExhausted, match="output and error files") as err:
        await s.create_batch(owner(), f.id, CHAT, {})  # 1 kept + room for 2 x 2 outputs > 4
    assert err.value.reason == "too_many_files"


async def test_finishing_writes_answers_larger_than_a_page_whole_and_in_order(store, monkeypatch):
    from services.billing import batches
    monkeypatch.setattr(batches, "_PAGE_BYTES", 300)
    b = await new_batch(store, 7)
    for item in await store.claim("router-0", 10, 30):
        await store.complete("router-0", ref(item), 200, json.dumps({"i": item.index, "pad": "p" * 200}).encode(), "r")
    done = await store.get_batch("acme", b.id)
    out = [json.loads(x)["response"]["body"]["i"] for x in (await read(store, "acme", done.output_file_id)).splitlines()]
    assert out == list(range(7))


async def policy_store(database_url, tmp_path, policy):
    db = Database(database_url)
    for t in TABLES:
        db.execute_sync(f"DROP TABLE IF EXISTS {t}")
    s = BatchStore(db, DirectoryFileStore(tmp_path / "files"), policy)
    await s.init_schema()
    return s
