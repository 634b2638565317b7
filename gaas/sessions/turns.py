"""A session's turn between the BEGIN that took it and the COMMIT of its reply, and that commit, one
definition for both processes that stream a turn: the router (its own route; it also begins the
turn, services/router/sessions.py) and, on the direct path, the worker the ingress sends the turn
to (services/worker/direct.py), which commits the reply before its last chunk goes out.

committing() relays a turn's chunks and, at the usage chunk, stores the context extended by the
reply with a compare-and-set on the version the turn read (gaas.contracts.sessions.COMMIT), so a
client that has the last chunk can send the next turn at once; the chunk then says what the turn
did to its session. A turn that ends otherwise is given back unchanged (release)."""

from __future__ import annotations

import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field

from redis.asyncio import Redis
from redis.exceptions import RedisError

from gaas.contracts import errors, latency, sessions, tenantbytes, usage as metering
from gaas.contracts.sessions import Context
from gaas.runtime.redisconn import Script
from gaas.v1 import common_pb2

log = logging.getLogger(__name__)


@dataclass(slots=True)
class OpenTurn:
    """A session's turn, held by one request until its reply is committed or it is given back."""

    tenant: str
    session_id: str
    # The request holding the turn (what COMMIT and RELEASE check).
    request_id: str
    # The version the turn read (0: the turn starts the session), and the context then (None
    # until the turn is planned, for a session that had none).
    version: int
    context: Context | None
    # The turn's own part (its messages; a text session's one ("prompt", text)), and the first
    # stored turn kept (the ones before it dropped to fit the model's window).
    new: list[tuple[str, str]] = field(default_factory=list)
    keep_from: int = 0
    # The reply's text as it streams.
    reply: list[str] = field(default_factory=list)

    @property
    def created(self) -> bool:
        return self.version == 0

    def extended(self, final: common_pb2.GenerateChunk, now_ms: int) -> Context:
        """The context after this turn, from its final chunk (usage, the worker that served it)."""
        return self.context.committed(self.new, "".join(self.reply), self.keep_from, final.usage.prompt_tokens,
                                      final.usage.completion_tokens, final.worker_id, now_ms)

    def summary(self, version: int, context: Context) -> common_pb2.SessionTurn:
        """What the turn did to its session, as its last chunk says."""
        return common_pb2.SessionTurn(
            session_id=self.session_id, version=version, turns=len(context.turns), context_tokens=context.tokens,
            created=self.created, dropped_turns=self.keep_from,
            dropped_tokens=sessions.dropped_tokens(self.context, self.keep_from),
        )


def unavailable() -> errors.Unavailable:
    return errors.Unavailable(
        "this turn's reply could not be added to its session: Redis does not answer; the session is as it "
        "was before this turn"
    )


def changed(session_id: str, moved: bool) -> errors.Aborted:
    why = ("another turn was committed meanwhile" if moved
           else "the session was deleted, or its hold lapsed and another turn took it")
    return errors.Aborted(
        f"this turn's reply was not added to session {session_id!r}: {why}; read it again "
        "(GET /v1/gaas/sessions/ID) before the next turn",
        reason="session_changed",
    )


class TurnEnds:
    """The Redis side of a turn's end: its reply committed, or the turn given back."""

    def __init__(self, redis: Redis, clock: Callable[[], int] = metering.now_ms) -> None:
        self._clock = clock
        self._commit = Script(redis, sessions.COMMIT)
        self._release = Script(redis, sessions.RELEASE)

    def now_ms(self) -> int:
        return self._clock()

    async def commit(self, turn: OpenTurn, context: Context, ttl_ms: int) -> int:
        """Store context if the session is still at the version the turn read and the turn is
        still this request's; the new version. errors.Aborted when not (the reply is then not in
        the session); RedisError when Redis does not answer."""
        summary = [v for pair in context.summary().items() for v in pair]
        answer = await self._commit(
            keys=[sessions.session_key(turn.tenant, turn.session_id), sessions.index_key(turn.tenant),
                  tenantbytes.held_key(turn.tenant), tenantbytes.held_until_key(turn.tenant)],
            args=[turn.request_id, turn.version, context.to_json(), self._clock(), ttl_ms, turn.session_id, *summary],
        )
        version = int(answer[0])
        if version < 0:
            raise changed(turn.session_id, moved=version == -1)
        return version

    async def release(self, turn: OpenTurn) -> None:
        """Give the turn back unchanged (a session its first turn never committed is removed)."""
        try:
            await self._release(keys=[sessions.session_key(turn.tenant, turn.session_id)], args=[turn.request_id])
        except RedisError as exc:
            log.warning("cannot release the turn of session %s (%s); it lapses by itself", turn.session_id, exc)


async def committing(turn: OpenTurn, chunks: AsyncIterator[common_pb2.GenerateChunk],
                     commit: Callable[[Context], Awaitable[int]], now_ms: Callable[[], int]
                     ) -> AsyncIterator[common_pb2.GenerateChunk]:
    """Relay a turn's chunks, committing its reply (commit(context) -> the new version) before the
    last one is released, which then says what the turn did to its session. commit's time is the
    tenant's (its latency decomposition)."""
    async for chunk in chunks:
        turn.reply.append(chunk.text)
        if chunk.HasField("usage"):
            started = time.perf_counter()
            context = turn.extended(chunk, now_ms())
            version = await commit(context)
            latency.add_tenant(chunk.timings, time.perf_counter() - started)
            chunk.session.CopyFrom(turn.summary(version, context))
        yield chunk
