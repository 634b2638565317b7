"""The router's side of sessions (gaas/contracts/sessions.py has the model, the policy and the scripts):
taking a session's turn in Redis, building the turn's request from the stored context (shortened
to the model's window by the declared policy), committing the reply with a compare-and-set on the
version before the turn's last chunk is released, and the tenant's list / show / delete.

Every router replica shares the sessions through Redis; each keeps copies of the contexts it
served lately, reloading one whenever Redis holds a newer version.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import OrderedDict
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field

from redis.asyncio import Redis
from redis.exceptions import RedisError

from gaas.contracts import errors, genrequest, sessions, tenantbytes, usage as metering
from gaas.contracts.sessions import Context, SessionPolicy
from gaas.model.tokenizer import PromptPrefix
from gaas.v1 import common_pb2, inference_pb2
from gaas.contracts.principal import Principal
from services.router.prepare import Prepared, Preparer
from gaas.runtime.redisconn import Script
from gaas.sessions.turns import OpenTurn, TurnEnds, committing as committing_turn, unavailable

log = logging.getLogger(__name__)

# Contexts each router keeps a copy of (the sessions it served last).
CACHE_SESSIONS = 1024
# Attempts at dropping turns to fit, before giving up on shortening.
FIT_ATTEMPTS = 8
# A turn's hold is renewed at most this long (a turn whose stream never ended lets it lapse).
MAX_TURN_SECONDS = 900
LIST_MAX = 1000


def _unavailable() -> errors.Unavailable:
    return errors.Unavailable(
        "sessions are kept in Redis, which does not answer right now; retry shortly (a request without "
        "session_id is served meanwhile)"
    )


@dataclass(slots=True)
class Held(OpenTurn):
    """A session's turn as this router took it: the turn (gaas.sessions.turns), and what the router
    keeps beside it."""

    # How the session's last prompt was tokenized (this router's copy): reused by the next one.
    prefix: PromptPrefix = field(default_factory=PromptPrefix)
    renewing: asyncio.Task | None = None
    done: bool = False


@dataclass(slots=True)
class TurnPlan:
    """A turn ready to go: its held turn (context, new part, the first turn kept, then its reply),
    and its request prepared."""

    held: Held
    prepared: Prepared | None = None
    # Time taken by the session's store before the turn (the tenant's part of its latency).
    tenant_s: float = 0.0

    @property
    def created(self) -> bool:
        return self.held.created


SESSION_OUTCOMES = ("committed", "busy", "changed", "released", "unavailable")


@dataclass(frozen=True, slots=True)
class SessionMetrics:
    # Turns by outcome: committed; busy (another turn held the session); changed (the version moved
    # before the commit); released (ended without a reply); unavailable (Redis did not answer).
    turns: object = None
    # Contexts reloaded because this router's copy was older than Redis's.
    reloads: object = None
    # Turns dropped from contexts to fit a model's window.
    dropped_turns: object = None

    def count(self, outcome: str) -> None:
        if self.turns is not None:
            self.turns.labels(outcome).inc()


class SessionStore:
    def __init__(self, redis: Redis, policy: SessionPolicy = SessionPolicy(),
                 clock: Callable[[], int] = metering.now_ms, cache_size: int = CACHE_SESSIONS,
                 metrics: SessionMetrics = SessionMetrics()) -> None:
        self.policy = policy
        self.metrics = metrics
        self._redis = redis
        self._clock = clock
        self._begin = Script(redis, sessions.BEGIN)
        self._renew = Script(redis, sessions.RENEW)
        self.ends = TurnEnds(redis, clock)
        self._list = Script(redis, sessions.LIST)
        self._delete = Script(redis, sessions.DELETE)
        self._cache: OrderedDict[tuple[str, str], tuple[int, Context, PromptPrefix]] = OrderedDict()
        self._cache_size = cache_size
        self._tasks: set[asyncio.Task] = set()
        # Contexts read from Redis because this router's copy was missing or older.
        self.reloads = 0

    def now_ms(self) -> int:
        return self._clock()

    @property
    def ttl_ms(self) -> int:
        return self.policy.ttl_seconds * 1000

    @property
    def lease_ms(self) -> int:
        return self.policy.lease_seconds * 1000

    # ------------------------------------------------------------ a turn

    async def begin(self, tenant: str, session_id: str, request_id: str) -> Held:
        """Take the session's turn; errors.Aborted when another request holds it."""
        key = (tenant, session_id)
        cached = self._cache.get(key)
        try:
            answer = await self._begin(
                keys=[sessions.session_key(tenant, session_id), sessions.index_key(tenant),
                      tenantbytes.held_key(tenant), tenantbytes.held_until_key(tenant)],
                args=[request_id, self._clock(), self.lease_ms, self.ttl_ms, session_id,
                      cached[0] if cached else -1, self.policy.max_per_tenant, self.policy.max_bytes_per_tenant],
            )
        except RedisError as exc:
            log.warning("cannot begin a turn of a session (%s)", exc)
            self.metrics.count("unavailable")
            raise _unavailable() from None
        version = int(answer[0])
        if version == -4:
            raise tenantbytes.refused(tenant, int(answer[1]), int(answer[2]), "this session's turn")
        if version == -3:
            kept, most = int(answer[1]), int(answer[2])
            raise errors.ResourceExhausted(
                f"tenant {tenant} keeps {kept} sessions, the most it may: delete some (DELETE /v1/gaas/sessions/ID, "
                f"or `gaas session delete`) or let them expire ({self.policy.ttl_seconds} s after their last turn) "
                "before starting another", reason="session_limit",
                quota=errors.QuotaViolation(f"tenant:{tenant}", f"sessions kept: {most}"))
        if version < 0:
            self.metrics.count("busy")
            holder, left_ms = _text(answer[1]), int(answer[2])
            raise errors.Aborted(
                f"session {session_id!r} has a turn in progress (request {holder}); send the next turn when it has "
                f"finished (its hold lapses within {max(1, -(-left_ms // 1000))} s if that request was lost)",
                reason="session_busy",
            )
        # (a stale copy's prompt prefix stays: it is only reused where the new prompt begins with it)
        prefix = cached[2] if cached else PromptPrefix()
        if version == 0:
            context = None
            self._cache.pop(key, None)
        elif len(answer) > 1:
            context = Context.from_json(answer[1])
            self.reloads += 1
            if self.metrics.reloads is not None:
                self.metrics.reloads.inc()
            self._remember(key, version, context, prefix)
        else:
            context = cached[1]
            self._cache.move_to_end(key)
        held = Held(tenant, session_id, request_id, version, context, prefix=prefix)
        held.renewing = asyncio.create_task(self._keep(held), name=f"session-lease-{session_id}")
        return held

    async def _keep(self, held: Held) -> None:
        """Renew the turn's lease while it runs (a router that dies lets it lapse)."""
        key = sessions.session_key(held.tenant, held.session_id)
        until = time.monotonic() + MAX_TURN_SECONDS
        while time.monotonic() < until:
            await asyncio.sleep(self.policy.lease_seconds / 3)
            try:
                if not await self._renew(keys=[key], args=[held.request_id, self._clock(), self.lease_ms]):
                    log.warning("session %s: request %s no longer holds its turn", held.session_id, held.request_id)
                    return
            except RedisError as exc:
                log.warning("cannot renew the turn of session %s (%s)", held.session_id, exc)

    def _stop(self, held: Held) -> None:
        held.done = True
        if held.renewing is not None:
            held.renewing.cancel()

    async def commit(self, held: Held, context: Context) -> int:
        """Store the turn's context if the session is still at the version the turn read; the
        new version. errors.Aborted when it moved (the turn's reply is then not in the session)."""
        self._stop(held)
        key = (held.tenant, held.session_id)
        try:
            version = await self.ends.commit(held, context, self.ttl_ms)
        except RedisError as exc:
            log.warning("cannot commit a turn of session %s (%s)", held.session_id, exc)
            self.metrics.count("unavailable")
            self._cache.pop(key, None)
            self.release_later(held, force=True)
            raise unavailable() from None
        except errors.Aborted:
            self.metrics.count("changed")
            self._cache.pop(key, None)
            raise
        self.committed(held, version, context)
        return version

    def committed(self, held: Held, version: int, context: Context) -> None:
        """The turn's reply is in the session (committed here, or by the worker that streamed it):
        this router's copy is the session's as it now is."""
        self._stop(held)
        self._remember((held.tenant, held.session_id), version, context, held.prefix)
        self.metrics.count("committed")

    def release_later(self, held: Held, force: bool = False) -> None:
        """Give back a turn that will not commit (from a stream's cleanup: it does not wait)."""
        if held.done and not force:
            return
        if not held.done:
            self.metrics.count("released")
        self._stop(held)
        task = asyncio.get_running_loop().create_task(self._give_back(held))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _give_back(self, held: Held) -> None:
        await self.ends.release(held)

    def _remember(self, key: tuple[str, str], version: int, context: Context, prefix: PromptPrefix) -> None:
        self._cache[key] = (version, context, prefix)
        self._cache.move_to_end(key)
        while len(self._cache) > self._cache_size:
            self._cache.popitem(last=False)

    async def close(self) -> None:
        if self._tasks:
            await asyncio.gather(*self._tasks, return_exceptions=True)

    # ------------------------------------------------------------ the tenant's view

    async def list(self, tenant: str, limit: int = 100) -> list[dict]:
        limit = min(max(1, limit or 100), LIST_MAX)
        try:
            flat = await self._list(keys=[sessions.index_key(tenant)], args=[self._clock(), limit])
            ids = [(_text(flat[i]), int(float(flat[i + 1]))) for i in range(0, len(flat), 2)]
            pipe = self._redis.pipeline(transaction=False)
            for sid, _ in ids:
                pipe.hgetall(sessions.session_key(tenant, sid))
            rows = await pipe.execute()
        except RedisError as exc:
            log.warning("cannot list sessions (%s)", exc)
            raise _unavailable() from None
        now = self._clock()
        return [_summary(sid, expires, raw, now) for (sid, expires), raw in zip(ids, rows) if raw and raw.get("v")]

    async def get(self, tenant: str, session_id: str) -> tuple[dict, Context]:
        sessions.check_id(session_id)
        key = sessions.session_key(tenant, session_id)
        try:
            pipe = self._redis.pipeline(transaction=False)
            pipe.hgetall(key)
            pipe.pttl(key)
            raw, ttl = await pipe.execute()
        except RedisError as exc:
            log.warning("cannot read a session (%s)", exc)
            raise _unavailable() from None
        if not raw or not raw.get("v"):
            raise _not_found(session_id)
        now = self._clock()
        return _summary(session_id, now + max(0, int(ttl)), raw, now), Context.from_json(raw["ctx"])

    async def delete(self, tenant: str, session_id: str) -> None:
        sessions.check_id(session_id)
        try:
            existed = int(await self._delete(
                keys=[sessions.session_key(tenant, session_id), sessions.index_key(tenant),
                      tenantbytes.held_key(tenant), tenantbytes.held_until_key(tenant)],
                args=[session_id, self._clock()]))
        except RedisError as exc:
            log.warning("cannot delete a session (%s)", exc)
            raise _unavailable() from None
        self._cache.pop((tenant, session_id), None)
        if not existed:
            raise _not_found(session_id)


def _text(value) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def _not_found(session_id: str) -> errors.NotFound:
    return errors.NotFound(f"no session {session_id!r} (it may have expired: a session is kept for a while after "
                           "its last turn)", param="session_id")


def _summary(session_id: str, expires_ms: int, raw: dict, now: int) -> dict:
    def field_(name: str, default: str = "0") -> str:
        return _text(raw.get(name, default))

    return {
        "session_id": session_id, "model": field_("model", ""), "kind": field_("kind", ""),
        "version": int(field_("v")), "turns": int(field_("turns")), "committed_turns": int(field_("committed")),
        "dropped_turns": int(field_("dropped")), "context_tokens": int(field_("tokens")),
        "worker_id": field_("worker", ""), "created_unix_ms": int(field_("created")),
        "updated_unix_ms": int(field_("updated")), "expires_unix_ms": expires_ms,
        "turn_in_progress": bool(field_("turn", "")) and int(field_("turn_until")) > now,
    }


def available(store: SessionStore | None) -> SessionStore:
    if store is None:
        raise errors.Unimplemented("sessions are not available on this router")
    return store


# The session calls as both APIs answer them: a tenant's own (gaas.v1.Inference, the API key's
# tenant) and any tenant's (gaas.v1.Router, the operator's).

async def list_response(store: SessionStore | None, tenant: str, limit: int) -> inference_pb2.ListSessionsResponse:
    rows = await available(store).list(tenant, limit)
    return inference_pb2.ListSessionsResponse(sessions=[session_message(r) for r in rows])


async def get_response(store: SessionStore | None, tenant: str, session_id: str) -> inference_pb2.Session:
    return session_message(*await available(store).get(tenant, session_id))


async def delete_response(store: SessionStore | None, tenant: str, session_id: str) -> inference_pb2.DeleteSessionResponse:
    await available(store).delete(tenant, session_id)
    return inference_pb2.DeleteSessionResponse(session_id=session_id, deleted=True)


def session_message(summary: dict, context: Context | None = None) -> inference_pb2.Session:
    s = inference_pb2.Session(**summary)
    if context is not None:
        if context.kind == "chat":
            pairs = context.chat_messages()
        else:
            pairs = [p for t in context.turns for p in (("prompt", t.messages[0][1]), ("completion", t.reply))]
        s.messages.extend(inference_pb2.ChatMessage(role=r, content=c) for r, c in pairs)
    return s


# ---------------------------------------------------------------- a turn's request and reply


def check_turn(request: inference_pb2.GenerateRequest) -> str:
    """The session id of a request that is a turn ("" when it is not), checked."""
    if not request.session_id:
        return ""
    sessions.check_id(request.session_id)
    if request.n > 1:
        raise errors.InvalidArgument("a session turn generates one reply: n must be 1", param="n")
    if request.prompt_token_ids:
        raise errors.InvalidArgument(
            "a session keeps text: send a turn's prompt as text or messages, not prompt_token_ids", param="prompt")
    if request.continue_final_message:
        raise errors.InvalidArgument("a session turn cannot continue_final_message", param="continue_final_message")
    return request.session_id


async def plan_turn(store: SessionStore, preparer: Preparer, request: inference_pb2.GenerateRequest,
                    principal: Principal,
                    request_id: str, for_ingress: bool = False) -> TurnPlan:
    """Take the session's turn and prepare its request: the stored context, then the turn's new
    part; the context's oldest turns dropped while the prompt leaves the reply no room
    (for_ingress: as Preparer.prepare's)."""
    check_turn(request)
    started = time.perf_counter()
    held = await store.begin(principal.tenant, request.session_id, request_id)
    began = time.perf_counter() - started
    try:
        plan = await _plan(store, preparer, request, principal, held, for_ingress)
    except BaseException:
        store.release_later(held)
        raise
    plan.tenant_s = began
    return plan


async def _plan(store: SessionStore, preparer: Preparer, request: inference_pb2.GenerateRequest, principal: Principal,
                held: Held, for_ingress: bool) -> TurnPlan:
    messages = [(m.role, m.content) for m in request.messages] if request.messages else None
    prompt = request.prompt if not request.messages else None
    if held.context is not None:
        context = held.context
        model = await preparer.resolve_model(request.model or context.model, principal.tenant)
        if model.name != context.model:
            raise errors.InvalidArgument(
                f"session {held.session_id!r} is a conversation with {context.model}; continue it with that "
                "model (or leave model out), or start another session", param="model")
        new = context.new_part(messages, prompt)
    else:
        model = await preparer.resolve_model(request.model, principal.tenant)
        context, new = Context.new(model.name, "chat" if messages is not None else "text", messages or [("prompt", prompt)])
        if not new:
            raise errors.InvalidArgument("a session's first turn needs a message besides the system prompt",
                                         param="messages")
    held.context, held.new = context, new
    plan = TurnPlan(held)
    limit = model.max_model_len
    want = request.max_tokens or store.policy.reply_reserve_tokens
    for _ in range(FIT_ATTEMPTS):
        full = turn_request(request, context, new, held.keep_from)
        try:
            plan.prepared = await preparer.prepare(full, principal, held.prefix, context.model_version,
                                                   for_ingress=for_ingress)
            room, too_long = limit - plan.prepared.prompt_tokens, None
        except genrequest.ContextTooLong as exc:
            plan.prepared, room, too_long = None, limit - exc.prompt_tokens, exc
        if not limit or room >= want or held.keep_from >= len(context.turns):
            if too_long is not None:
                raise too_long
            break
        held.keep_from = context.drop_for(want - room, held.keep_from)
    else:
        if plan.prepared is None:
            raise errors.InvalidArgument(f"session {held.session_id!r} cannot be shortened to fit the model's context; "
                                         "start another session", param="session_id")
    plan.prepared.session_worker = context.worker
    if not context.model_version:
        # The version its first turn took is the session's (services/router/versions.py keeps it there).
        context.model_version = plan.prepared.model.version
    if held.keep_from:
        if store.metrics.dropped_turns is not None:
            store.metrics.dropped_turns.inc(held.keep_from)
        log.info("session %s: dropped its %d oldest turn(s) (about %d tokens) to fit %s's %d tokens", held.session_id,
                 held.keep_from, sessions.dropped_tokens(context, held.keep_from), model.name, limit)
    return plan


def turn_request(request: inference_pb2.GenerateRequest, context: Context, new: list[tuple[str, str]],
                 keep_from: int) -> inference_pb2.GenerateRequest:
    """The engine request of a turn: the context (from turn keep_from), then the turn's part."""
    full = inference_pb2.GenerateRequest()
    full.CopyFrom(request)
    full.model = context.model
    full.ClearField("messages")
    full.ClearField("prompt")
    if context.kind == "chat":
        full.messages.extend(
            inference_pb2.ChatMessage(role=r, content=c) for r, c in context.chat_messages(keep_from) + new)
    else:
        full.prompt = context.text(keep_from) + new[0][1]
    return full


async def committing(store: SessionStore, plan: TurnPlan,
                     chunks: AsyncIterator[common_pb2.GenerateChunk]) -> AsyncIterator[common_pb2.GenerateChunk]:
    """Relay a turn's chunks, committing its reply to the session before the last one is released
    (gaas.sessions.turns.committing). A turn that ends otherwise gives the session back unchanged."""
    held = plan.held
    try:
        async for chunk in committing_turn(held, chunks, lambda context: store.commit(held, context), store.now_ms):
            yield chunk
    finally:
        store.release_later(held)
