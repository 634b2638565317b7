"""Sessions (gaas/contracts/sessions.py, gaas/sessions/turns.py, services/router/sessions.py) against a
real Redis, with the router's real stages and the workers faked: a turn gets the stored context
before its new part, the version compare-and-set under turns racing through two router replicas, a
concurrent turn refused, a lapsed hold, TTL expiry, the truncation policy, tenant isolation, a
replica's stale copy reloaded, session affinity in the scheduler, and on the direct path a turn
the worker commits, which the router's copy follows from its report."""

import asyncio
import time

import grpc
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gaas.contracts import errors, sessions
from gaas.runtime import redisconn
from gaas.contracts.sessions import Context, SessionPolicy, Turn
from gaas.v1 import common_pb2, inference_pb2
from gaas.contracts.principal import Principal
from services.router.directory import ModelEntry
from services.router.scheduling import Candidate, Load, RequestContext, WorkerId, make_scheduler
from gaas.metering import direct
from gaas.sessions.turns import OpenTurn, TurnEnds, committing as committing_turn
from services.router.auth import Authenticator
from services.router.extproc import ExternalProcessor, _Pending
from services.router.pipeline import Pipeline
from services.router.sessions import SessionStore, committing, plan_turn
from tests.fakeclock import FakeClock
from tests.unit.router import support
from tests.unit.router.support import FakeWorkers, chunk
from tests.waiting import eventually_async

ACME = Principal("acme", "gold", "key_1", "salt-acme")
OTHER = Principal("other", "gold", "key_2", "salt-other")


def decode(ids) -> str:
    """FakeTokenizer's ids back to text (ASCII)."""
    return "".join(chr(i - 1) for i in ids if i)  # (0: BOS)


class SlowWorkers(FakeWorkers):
    """Replies "ab" with a pause between chunks, so turns overlap."""

    def __init__(self, workers, pause=0.0):
        super().__init__({w: [] for w in workers})
        self.pause = pause

    def Generate(self, request, timeout=None, metadata=()):
        address = dict(metadata)["x-gaas-worker"]
        self.calls.append((address, request))
        pause, n = self.pause, len(request.request.prompt_token_ids)

        class Call:
            """A grpc.aio stream call's read(): a chunk, a pause, the final chunk, EOF."""

            def __init__(self):
                self._steps = self._script()

            def cancel(self):
                pass

            async def _script(self):
                yield chunk("a")
                await asyncio.sleep(pause)
                final = chunk("b", final=True)
                final.usage.prompt_tokens = n
                final.worker_id = address
                yield final

            async def read(self):
                return await anext(self._steps, grpc.aio.EOF)

        return Call()


def stages(workers=("w0",), max_model_len=4096, pause=0.0):
    fake = SlowWorkers(workers, pause)
    return support.stages(workers, address="{w}", max_model_len=max_model_len, workers_stub=fake,
                          scheduler="kv_aware", retries=0), fake


async def turn(store, disp, principal=ACME, request_id=None, **req):
    """One turn, start to commit: the chunks the client gets."""
    request = inference_pb2.GenerateRequest(**req)
    rid = request_id or f"req-{time.perf_counter_ns()}"
    plan = await plan_turn(store, disp.preparer, request, principal, rid)
    stream = disp.relay.stream(plan.prepared, principal, rid, None, time.perf_counter())
    return [c async for c in committing(store, plan, stream)]


async def turn_in_progress(redis, session_id: str, held: bool = True) -> None:
    """Until a request holds the session's turn (held=False: until it is given back), as Redis
    holds it (a first turn's session has no version to read through the store until it commits)."""
    async def now() -> bool:
        return bool(await redis.hget(sessions.session_key("acme", session_id), "turn")) == held

    await eventually_async(now, 5, every=0.01, what=f"session {session_id}'s turn {'held' if held else 'given back'}")


async def _gone(redis, key: str) -> bool:
    return not await redis.exists(key)


def chat(*pairs):
    return [inference_pb2.ChatMessage(role=r, content=c) for r, c in pairs]


# ------------------------------------------------------------------ a turn's request


async def test_a_turn_sends_only_its_new_message_and_gets_the_stored_context_before_it(redis):
    store, (disp, fake) = SessionStore(redis), stages()
    first = await turn(store, disp, session_id="s1", messages=chat(("system", "S"), ("user", "hi")), max_tokens=4)
    second = await turn(store, disp, session_id="s1", messages=chat(("user", "again")), max_tokens=4)
    assert decode(fake.calls[0][1].request.prompt_token_ids) == "<system>S<user>hi"
    assert decode(fake.calls[1][1].request.prompt_token_ids) == "<system>S<user>hi<assistant>ab<user>again"
    s1, s2 = first[-1].session, second[-1].session
    assert (s1.version, s1.turns, s1.created) == (1, 1, True)
    assert (s2.version, s2.turns, s2.created) == (2, 2, False)
    assert s2.context_tokens == len(fake.calls[1][1].request.prompt_token_ids) + 2
    summary, ctx = await store.get("acme", "s1")
    assert ctx.system == [("system", "S")] and [t.reply for t in ctx.turns] == ["ab", "ab"]
    assert summary["version"] == 2 and summary["worker_id"] == "w0" and not summary["turn_in_progress"]


async def test_a_client_that_resends_the_whole_conversation_does_not_get_it_twice(redis):
    store, (disp, fake) = SessionStore(redis), stages()
    await turn(store, disp, session_id="s1", messages=chat(("user", "hi")), max_tokens=4)
    await turn(store, disp, session_id="s1", messages=chat(("user", "hi"), ("assistant", "ab"), ("user", "more")),
               max_tokens=4)
    assert decode(fake.calls[1][1].request.prompt_token_ids) == "<user>hi<assistant>ab<user>more"


async def test_a_text_session_continues_its_prompt(redis):
    store, (disp, fake) = SessionStore(redis), stages()
    await turn(store, disp, session_id="t1", prompt="Once", max_tokens=4)
    await turn(store, disp, session_id="t1", prompt=" then", max_tokens=4)
    assert decode(fake.calls[1][1].request.prompt_token_ids) == "Onceab then"
    with pytest.raises(errors.InvalidArgument, match="text prompt"):
        await turn(store, disp, session_id="t1", messages=chat(("user", "x")))


@pytest.mark.parametrize("req, message", [
    ({"n": 2, "prompt": "x"}, "n must be 1"),
    ({"prompt_token_ids": [1, 2]}, "not prompt_token_ids"),
    ({"prompt": "x", "session_id": "bad id!"}, "letters, digits"),
])
async def test_what_a_turn_cannot_be_is_refused_before_any_work(redis, req, message):
    store, (disp, fake) = SessionStore(redis), stages()
    with pytest.raises(errors.InvalidArgument, match=message):
        await turn(store, disp, **{"session_id": "s1", **req})
    assert fake.calls == []


# ------------------------------------------------------------------ concurrency


async def test_a_second_turn_while_one_streams_is_aborted_and_the_first_commits(redis):
    store, (disp, _) = SessionStore(redis), stages(pause=0.3)
    running = asyncio.create_task(turn(store, disp, session_id="s1", messages=chat(("user", "one"))))
    await turn_in_progress(redis, "s1")
    with pytest.raises(errors.Aborted, match="turn in progress") as caught:
        await turn(store, disp, session_id="s1", messages=chat(("user", "two")))
    assert errors.STATUS_TABLE[caught.value.code].http_status == 409
    assert (await running)[-1].session.version == 1
    assert [t.messages for t in (await store.get("acme", "s1"))[1].turns] == [[("user", "one")]]


async def test_turns_racing_through_two_router_replicas_are_neither_lost_nor_duplicated(redis_url, redis):
    replicas = []
    for _ in range(2):
        client = redisconn.connect(redis_url)
        replicas.append((client, SessionStore(client), stages(pause=0.01)[0]))
    committed: list[tuple[int, str]] = []
    refused = 0

    async def speaker(i: int) -> None:
        nonlocal refused
        _, store, disp = replicas[i % 2]
        while True:
            try:
                chunks = await turn(store, disp, session_id="race", messages=chat(("user", f"m{i}")), max_tokens=2)
            except errors.Aborted:
                refused += 1
                await asyncio.sleep(0.005 * (1 + i % 3))
                continue
            committed.append((chunks[-1].session.version, f"m{i}"))
            return

    try:
        await asyncio.gather(*(speaker(i) for i in range(24)))
    finally:
        for client, store, _ in replicas:
            await store.close()
            await client.aclose()
    assert refused > 0, "the turns did overlap"
    versions = [v for v, _ in committed]
    assert sorted(versions) == list(range(1, 25)), "every turn committed once, each version once"
    in_commit_order = [m for _, m in sorted(committed)]
    summary, ctx = await SessionStore(redis).get("acme", "race")
    assert [t.messages[0][1] for t in ctx.turns] == in_commit_order, "the context holds each turn once, in order"
    assert summary["version"] == 24 and summary["turns"] == 24


async def test_a_replica_whose_copy_is_older_reloads_it(redis_url, redis):
    other = redisconn.connect(redis_url)
    try:
        a, b = SessionStore(redis), SessionStore(other)
        (da, fa), (db, _) = stages(), stages()
        await turn(a, da, session_id="s", messages=chat(("user", "one")), max_tokens=2)
        await turn(b, db, session_id="s", messages=chat(("user", "two")), max_tokens=2)
        assert b.reloads == 1
        await turn(a, da, session_id="s", messages=chat(("user", "three")), max_tokens=2)
        assert a.reloads == 1, "a's copy (version 1) was older than Redis's (2)"
        assert "<user>two<assistant>ab<user>three" in decode(fa.calls[-1][1].request.prompt_token_ids)
        await turn(a, da, session_id="s", messages=chat(("user", "four")), max_tokens=2)
        assert a.reloads == 1, "a's copy is current: the context is not read again"
    finally:
        await other.aclose()


async def test_a_hold_whose_router_died_lapses_and_its_late_commit_is_refused(redis):
    clock = FakeClock(1_800_000_000)
    store = SessionStore(redis, SessionPolicy(lease_seconds=1), clock=clock.millis)
    disp, _ = stages()
    await turn(store, disp, session_id="s", messages=chat(("user", "one")), max_tokens=2)
    lost = await store.begin("acme", "s", "req-lost")
    lost.renewing.cancel()  # the router died: nobody renews it
    with pytest.raises(errors.Aborted):
        await store.begin("acme", "s", "req-next")
    clock.advance(1.1)  # the hold's lease is kept by the clock the store is given
    chunks = await turn(store, disp, session_id="s", messages=chat(("user", "two")), max_tokens=2)
    assert chunks[-1].session.version == 2
    with pytest.raises(errors.Aborted, match="not added"):
        await store.commit(lost, lost.context)


async def test_a_turn_that_ends_without_a_reply_leaves_the_session_as_it_was(redis):
    store, (disp, _) = SessionStore(redis), stages(pause=0.5)
    await turn(store, disp, session_id="s", messages=chat(("user", "one")), max_tokens=2)
    task = asyncio.create_task(turn(store, disp, session_id="s", messages=chat(("user", "cut"))))
    await turn_in_progress(redis, "s")
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    await turn_in_progress(redis, "s", held=False)  # (given back by a task of its own)
    summary, ctx = await store.get("acme", "s")
    assert summary["version"] == 1 and len(ctx.turns) == 1
    # and a first turn that never finished leaves no session behind
    task = asyncio.create_task(turn(store, disp, session_id="never", messages=chat(("user", "x"))))
    await turn_in_progress(redis, "never")
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)
    await eventually_async(lambda: _gone(redis, sessions.session_key("acme", "never")), 5, every=0.01,
                           what="the unfinished first turn's session removed")


# ------------------------------------------------------------------ lifetime, truncation, isolation


async def test_a_session_expires_its_ttl_after_its_last_turn(redis):
    # Real time: a session's TTL is its key's expiry in Redis (PEXPIRE), which no fake clock moves.
    store, (disp, _) = SessionStore(redis, SessionPolicy(ttl_seconds=1)), stages()
    await turn(store, disp, session_id="s", messages=chat(("user", "one")), max_tokens=2)
    await asyncio.sleep(0.6)
    await turn(store, disp, session_id="s", messages=chat(("user", "two")), max_tokens=2)  # renews
    await asyncio.sleep(0.6)
    assert [r["session_id"] for r in await store.list("acme")] == ["s"], "the second turn renewed it"
    await asyncio.sleep(0.6)
    with pytest.raises(errors.NotFound):
        await store.get("acme", "s")
    assert await store.list("acme") == []
    chunks = await turn(store, disp, session_id="s", messages=chat(("user", "three")), max_tokens=2)
    assert chunks[-1].session.created, "an expired session's id starts a new one"


async def test_a_context_past_the_window_drops_its_oldest_turns_and_keeps_the_system_prompt(redis):
    store = SessionStore(redis, SessionPolicy(reply_reserve_tokens=8))
    disp, fake = stages(max_model_len=120)
    system = ("system", "You are terse.")
    for i in range(6):
        chunks = await turn(store, disp, session_id="long", messages=chat(*([system] if i == 0 else []),
                                                                          ("user", f"question {i}")), max_tokens=8)
        prompt = decode(fake.calls[-1][1].request.prompt_token_ids)
        assert len(prompt) + 8 <= 120, "the prompt always leaves the reply its room"
        assert prompt.startswith("<system>You are terse."), "the system prompt is kept"
        assert prompt.endswith(f"<user>question {i}"), "the new message is always sent"
    last = chunks[-1].session
    assert last.dropped_turns >= 1 and last.dropped_tokens > 0
    assert "question 0" not in prompt, "the oldest turns went first"
    summary, ctx = await store.get("acme", "long")
    assert summary["dropped_turns"] >= 2 and summary["committed_turns"] == 6
    assert ctx.turns[-1].messages == [("user", "question 5")]
    # a new message that cannot fit even alone is refused, naming the limit
    with pytest.raises(errors.InvalidArgument, match="context of 120 tokens"):
        await turn(store, disp, session_id="long", messages=chat(("user", "x" * 200)), max_tokens=8)
    await store.close()  # (the give-back is not waited for by the refusal)
    assert not (await store.get("acme", "long"))[0]["turn_in_progress"], "a refused turn gives the session back"


async def test_another_tenants_session_is_not_found_and_its_id_is_its_own(redis):
    store, (disp, fake) = SessionStore(redis), stages()
    await turn(store, disp, session_id="shared-name", messages=chat(("user", "acme's secret")), max_tokens=2)
    with pytest.raises(errors.NotFound):
        await store.get("other", "shared-name")
    with pytest.raises(errors.NotFound):
        await store.delete("other", "shared-name")
    assert await store.list("other") == []
    chunks = await turn(store, disp, OTHER, session_id="shared-name", messages=chat(("user", "hello")), max_tokens=2)
    assert chunks[-1].session.created and chunks[-1].session.turns == 1
    assert "secret" not in decode(fake.calls[-1][1].request.prompt_token_ids)
    assert (await store.get("acme", "shared-name"))[0]["version"] == 1
    await store.delete("acme", "shared-name")
    with pytest.raises(errors.NotFound):
        await store.get("acme", "shared-name")
    assert (await store.get("other", "shared-name"))[0]["version"] == 1


async def test_a_session_keeps_its_model(redis):
    models = [ModelEntry("tiny", "1.0", 4096, True), ModelEntry("big", "1.0", 4096, False)]
    cands = [Candidate(WorkerId("w0"), "w0", "tiny", "1.0", 4096), Candidate(WorkerId("w1"), "w1", "big", "1.0", 4096)]
    disp = support.stages(models=models, candidates=cands, workers_stub=SlowWorkers(("w0", "w1")), scheduler="kv_aware",
                          retries=0)
    store = SessionStore(redis)
    await turn(store, disp, session_id="s", messages=chat(("user", "one")), max_tokens=2)
    await turn(store, disp, session_id="s", messages=chat(("user", "two")), max_tokens=2)  # no model: the session's
    with pytest.raises(errors.InvalidArgument, match="conversation with tiny"):
        await turn(store, disp, session_id="s", model="big", messages=chat(("user", "three")), max_tokens=2)


# ------------------------------------------------------------------ routing


def test_a_sessions_turn_leans_to_the_worker_of_its_last_turn_unless_it_is_saturated():
    s = make_scheduler("kv_aware")
    idle = [Candidate(WorkerId(w), w, "m", "1", 4096) for w in ("w0", "w1", "w2")]
    for worker in ("w1", "w2"):
        ctx = RequestContext(model="m", session_worker=WorkerId(worker))
        assert s.schedule(ctx, idle).worker.worker_id == worker
    busy = [idle[0], Candidate(WorkerId("w1"), "w1", "m", "1", 4096, load=Load(running=64, waiting=40, kv_usage=0.99))]
    assert s.schedule(RequestContext(model="m", session_worker=WorkerId("w1")), busy).worker.worker_id == "w0"


# ------------------------------------------------------------------ the context itself


turns_st = st.lists(st.builds(Turn, st.lists(st.tuples(st.sampled_from(["user", "tool"]), st.text(max_size=20)),
                                             min_size=1, max_size=3),
                              st.text(max_size=20), st.integers(1, 500)), max_size=8)


@settings(max_examples=100, deadline=None)
@given(turns=turns_st, system=st.lists(st.tuples(st.just("system"), st.text(max_size=20)), max_size=2),
       worker=st.text(max_size=10))
def test_a_context_survives_storage_unchanged(turns, system, worker):
    ctx = Context("m", "chat", system, turns, tokens=sum(t.tokens for t in turns), worker=worker, created_ms=5,
                  updated_ms=9, committed_turns=len(turns) + 3, dropped_turns=3)
    assert Context.from_json(ctx.to_json()) == ctx


@settings(max_examples=200, deadline=None)
@given(turns=turns_st, excess=st.integers(0, 3000), kept_from=st.integers(0, 8))
def test_dropping_for_an_excess_drops_at_least_one_turn_and_enough_tokens_or_all(turns, excess, kept_from):
    ctx = Context("m", "chat", [], turns)
    kept_from = min(kept_from, len(turns))
    keep = ctx.drop_for(excess, kept_from)
    assert kept_from <= keep <= len(turns)
    if kept_from < len(turns):
        assert keep > kept_from, "each attempt drops at least one more turn"
        dropped = sum(t.tokens for t in turns[kept_from:keep])
        assert dropped >= excess or keep == len(turns)
        # and no more than needed: without its last turn the excess would not be covered
        assert keep == kept_from + 1 or dropped - turns[keep - 1].tokens < excess


def test_a_committed_turn_leaves_the_context_it_came_from_unchanged():
    ctx = Context("m", "chat", [("system", "S")], [Turn([("user", "a")], "b", 5)], tokens=10, worker="w0")
    before = ctx.to_json()
    after = ctx.committed([("user", "c")], "d", 1, prompt_tokens=12, completion_tokens=3, worker="w1", now_ms=7)
    assert ctx.to_json() == before, "a router's cached copy is not touched by a turn that may yet fail"
    assert after.turns == [Turn([("user", "c")], "d", 12 - (10 - 5) + 3)]
    assert (after.dropped_turns, after.committed_turns, after.tokens, after.worker) == (1, 1, 15, "w1")


def test_the_session_policy_is_read_from_the_deployment_file():
    assert sessions.parse_policy({"ttl_seconds": 60, "reply_reserve_tokens": 32}) == SessionPolicy(60, 32)
    for bad in ({"ttl_seconds": 0}, {"truncation": "summarize"}, {"unknown": 1}, "yes"):
        with pytest.raises(ValueError):
            sessions.parse_policy(bad)


def test_a_turn_chunk_says_what_it_did_to_its_session():
    c = common_pb2.GenerateChunk()
    c.session.CopyFrom(common_pb2.SessionTurn(session_id="s", version=3, dropped_turns=1))
    from gaas.openai.stream import session_json

    assert session_json(c.session, "drop_oldest_turns") == {
        "id": "s", "version": 3, "turns": 0, "context_tokens": 0, "created": False,
        "truncated": {"dropped_turns": 1, "dropped_tokens": 0, "policy": "drop_oldest_turns"},
    }


@pytest.mark.parametrize("session_id", ["trip\n", "trip\r", "", "x" * 129, "a b", "trip\u00b2"])
def test_a_session_id_outside_its_pattern_is_refused_whole(session_id):
    """A pattern ending in "$" would let "trip\\n" through: ids are matched whole."""
    from gaas.contracts import errors
    from gaas.contracts.sessions import check_id

    with pytest.raises(errors.InvalidArgument) as info:
        check_id(session_id)
    assert info.value.param == "session_id"


async def test_a_tenant_keeps_at_most_its_sessions_and_one_more_is_refused_naming_the_limit(redis):
    """Sessions (and the Redis memory they hold) are bounded per tenant: a turn that would start
    one session more is refused before any work; turns of the kept ones go on; a deleted one frees
    its room."""
    store, (disp, _) = SessionStore(redis, SessionPolicy(max_per_tenant=2)), stages()
    for sid in ("k1", "k2"):
        await turn(store, disp, session_id=sid, prompt="Once", max_tokens=2)
    with pytest.raises(errors.ResourceExhausted) as info:
        await turn(store, disp, session_id="k3", prompt="Once", max_tokens=2)
    assert "keeps 2 sessions" in info.value.message and info.value.reason == "session_limit"
    await turn(store, disp, session_id="k1", prompt=" more", max_tokens=2)  # a kept one goes on
    await store.delete("acme", "k2")
    await turn(store, disp, session_id="k3", prompt="Once", max_tokens=2)


# ------------------------------------------------------------------ on the direct path


async def worker_turn(store, disp, redis, request_id, **req):
    """A turn as the direct path serves it: the router plans it (and holds it), a worker streams
    and commits it with gaas.sessions.turns (its own TurnEnds, as services/worker/direct.py does),
    and the router then follows the worker's report (ExternalProcessor.reported)."""
    plan = await plan_turn(store, disp.preparer, inference_pb2.GenerateRequest(**req), ACME, request_id)
    p = await disp.placer.place_direct(plan.prepared, ACME, request_id, None)
    ep = ExternalProcessor(Pipeline(disp, Authenticator(None, 1.0), sessions=store), 1 << 20, instance="router-0")
    ep._pending[request_id] = _Pending(p, None, plan.held)
    # The worker's copy of the turn: what the DirectGenerate carries.
    held = plan.held
    mine = OpenTurn(held.tenant, held.session_id, held.request_id, held.version, Context.from_json(held.context.to_json()),
                    list(held.new), held.keep_from)
    ends = TurnEnds(redis)
    at = []

    async def commit(ctx):
        at.append(ctx.updated_ms)
        return await ends.commit(mine, ctx, store.ttl_ms)

    stream = disp.relay.stream(plan.prepared, ACME, request_id, None, time.perf_counter())
    chunks = [c async for c in committing_turn(mine, stream, commit, ends.now_ms)]
    ep.reported(direct.report(chunks[-1], session_reply="".join(mine.reply), committed_ms=at[0], request_id=request_id))
    return chunks


async def test_a_turn_the_worker_committed_is_the_routers_copy_without_reading_it_again(redis):
    store, (disp, fake) = SessionStore(redis), stages()
    first = await worker_turn(store, disp, redis, "req-d1", session_id="d", messages=chat(("user", "one")), max_tokens=2)
    second = await worker_turn(store, disp, redis, "req-d2", session_id="d", messages=chat(("user", "two")), max_tokens=2)
    assert (first[-1].session.version, second[-1].session.version) == (1, 2)
    assert store.reloads == 0, "the router's copy followed the worker's commits"
    assert decode(fake.calls[1][1].request.prompt_token_ids) == "<user>one<assistant>ab<user>two"
    summary, ctx = await store.get("acme", "d")
    cached = store._cache[("acme", "d")]
    assert cached[0] == 2 and cached[1] == ctx, "the router's copy is exactly what the session holds"
    assert not summary["turn_in_progress"]


async def test_a_turn_whose_worker_never_reports_is_given_back_unchanged(redis):
    store, (disp, _) = SessionStore(redis), stages()
    await turn(store, disp, session_id="g", messages=chat(("user", "one")), max_tokens=2)
    plan = await plan_turn(store, disp.preparer, inference_pb2.GenerateRequest(session_id="g", messages=chat(("user", "lost"))),
                           ACME, "req-lost")
    p = await disp.placer.place_direct(plan.prepared, ACME, "req-lost", None)
    ep = ExternalProcessor(Pipeline(disp, Authenticator(None, 1.0), sessions=store), 1 << 20, instance="router-0")
    ep._pending["req-lost"] = _Pending(p, None, plan.held)
    ep._lost("req-lost")  # (its worker died: the sweep found its progress unwritten)
    await store.close()
    summary, ctx = await store.get("acme", "g")
    assert summary["version"] == 1 and not summary["turn_in_progress"] and len(ctx.turns) == 1
