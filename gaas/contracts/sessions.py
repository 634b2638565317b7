"""Multi-turn sessions: a conversation's context kept by GaaS, so each turn sends only what is new.

A session starts with the first request naming a session_id. Its context (the system messages,
the turns with their replies, the token count, the worker that served it last, the model) lives in
Redis under its tenant's namespace, with a version that grows by one on every committed turn and a
TTL that each turn renews. One definition here for every router replica:

  gaas:session:{tenant}:<id>   hash: v (version; absent until the first turn commits), ctx (the
                               context, JSON), turn / turn_until (the request holding the turn, and
                               until when, Unix ms), summary fields for listing (model, kind, turns,
                               tokens, worker, created, updated)
  gaas:sessions:{tenant}       sorted set: session id -> when it expires (Unix ms), for listing
  gaas:response:{tenant}:<id>  a stored Response (the Responses API): JSON of the response, its
                               input items, the conversation that continues it and its version
                               (responses before it in its chain, plus one); TTL response_ttl_seconds
  gaas:responses:{tenant}      sorted set: response id -> when it expires, the oldest dropped past
                               max_responses_per_tenant
  gaas:response:{tenant}:<id>:cancel  a background response's cancel asked for
  gaas:sessions:{tenant}:held[-until]  the bytes the tenant holds in sessions and stored responses,
                               against max_bytes_per_tenant (gaas.contracts.tenantbytes)

A turn's life (seed 003's Init -> Extend -> Evict, the version checked before every extend):
BEGIN takes the turn (ABORTED if another request holds it and its lease has not lapsed) and
returns the version, with the context only when the router's cached copy is older; the router
renews the lease while the turn streams; COMMIT writes the extended context only if the version
is still the one BEGIN read and the turn is still this request's (a compare-and-set), so two turns
racing on one session are served one after the other or the later one is refused, never
interleaved or lost. A turn that ends without a reply (cancelled, failed) RELEASEs the turn and
changes nothing.

Context longer than the model's window: the declared policy keeps the system messages and drops
the oldest turns until the prompt leaves the reply its room (the request's max_tokens, else the
policy's reserve), and the response says how many turns and tokens were dropped.

Pure: no Redis client, no grpc (services/router/sessions.py runs the scripts).
"""

from __future__ import annotations

import json
import re
from dataclasses import asdict, dataclass, field, replace

from gaas.contracts import errors, tenantbytes

SESSION_ID_RE = re.compile(r"[A-Za-z0-9._:-]{1,128}")
KINDS = ("chat", "text")
# Roles of the leading messages a chat session keeps whatever it drops.
SYSTEM_ROLES = ("system", "developer")


@dataclass(frozen=True, slots=True)
class SessionPolicy:
    """deploy/gaas.yaml `sessions:`."""

    # A session is forgotten this long after its last turn.
    ttl_seconds: int = 3600
    # Room a turn without max_tokens keeps for its reply when the context must be shortened.
    reply_reserve_tokens: int = 256
    # A turn holds its session this long unless renewed (a router that died mid-turn frees it).
    lease_seconds: int = 30
    # What happens when the context outgrows the model's window (the one policy so far).
    truncation: str = "drop_oldest_turns"
    # Sessions a tenant may keep at once (its Redis memory bounded with them); a turn that would
    # start one more is refused until some are deleted or expire.
    max_per_tenant: int = 1000
    # A stored response (the Responses API's store) is kept this long, and a tenant keeps at most
    # this many (the oldest go first).
    response_ttl_seconds: int = 7 * 86400
    max_responses_per_tenant: int = 10000
    # The most a tenant may hold in Redis through its sessions and stored responses together, in
    # bytes (by default under 5% of the Redis `gaas up` starts: gaas.contracts.tenantbytes); a
    # response stored or a session turn past it is refused with 429 until some are deleted or expire.
    max_bytes_per_tenant: int = tenantbytes.DEFAULT_MAX_BYTES


TRUNCATIONS = ("drop_oldest_turns",)


def parse_policy(doc: object) -> SessionPolicy:
    """The `sessions:` section; ValueError naming what is wrong."""
    if doc is None:
        return SessionPolicy()
    known = {"ttl_seconds", "reply_reserve_tokens", "lease_seconds", "truncation", "max_per_tenant",
             "response_ttl_seconds", "max_responses_per_tenant", "max_bytes_per_tenant"}
    if not isinstance(doc, dict) or set(doc) - known:
        raise ValueError(f"sessions: expected a mapping with {', '.join(sorted(known))}")
    out = {}
    for name in ("ttl_seconds", "reply_reserve_tokens", "lease_seconds", "max_per_tenant", "response_ttl_seconds",
                 "max_responses_per_tenant", "max_bytes_per_tenant"):
        if name in doc:
            value = doc[name]
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"sessions.{name} must be a whole number of at least 1, got {value!r}")
            out[name] = value
    if "truncation" in doc:
        if doc["truncation"] not in TRUNCATIONS:
            raise ValueError(f"sessions.truncation must be one of {', '.join(TRUNCATIONS)}, got {doc['truncation']!r}")
        out["truncation"] = doc["truncation"]
    return SessionPolicy(**out)


def check_id(session_id: str) -> str:
    if not SESSION_ID_RE.fullmatch(session_id):
        raise errors.InvalidArgument(
            "session_id must be 1-128 letters, digits and . _ : - (e.g. a UUID)", param="session_id"
        )
    return session_id


def session_key(tenant: str, session_id: str) -> str:
    return f"gaas:session:{{{tenant}}}:{session_id}"


def index_key(tenant: str) -> str:
    return f"gaas:sessions:{{{tenant}}}"


RESPONSE_ID_RE = re.compile(r"resp_[A-Za-z0-9]{1,96}")


def response_key(tenant: str, response_id: str) -> str:
    return f"gaas:response:{{{tenant}}}:{response_id}"


def responses_index_key(tenant: str) -> str:
    return f"gaas:responses:{{{tenant}}}"


def response_cancel_key(tenant: str, response_id: str) -> str:
    """Set when a background response's cancel is asked for; its runner (on whichever router) looks."""
    return f"{response_key(tenant, response_id)}:cancel"


@dataclass(slots=True)
class Turn:
    # chat: the turn's own messages (role, content); text: one ("prompt", text).
    messages: list[tuple[str, str]]
    reply: str
    # Tokens the turn added to the context (its messages and its reply), as measured when it ran.
    tokens: int = 0


@dataclass(slots=True)
class Context:
    model: str
    kind: str
    # chat: the leading system / developer messages, which truncation keeps.
    system: list[tuple[str, str]] = field(default_factory=list)
    turns: list[Turn] = field(default_factory=list)
    # Tokens of the context as its last turn sent it (prompt + reply).
    tokens: int = 0
    # The worker that served the last turn, and the model version its first turn took (its turns
    # stay on it while it serves: a roll-out does not change a conversation's model mid-way).
    worker: str = ""
    model_version: str = ""
    created_ms: int = 0
    updated_ms: int = 0
    committed_turns: int = 0
    dropped_turns: int = 0

    # ------------------------------------------------------------ storage

    def to_json(self) -> str:
        d = asdict(self)
        d["turns"] = [[[list(m) for m in t.messages], t.reply, t.tokens] for t in self.turns]
        d["system"] = [list(m) for m in self.system]
        return json.dumps(d, separators=(",", ":"), ensure_ascii=False)

    @classmethod
    def from_json(cls, data: str | bytes) -> "Context":
        d = json.loads(data)
        d["system"] = [tuple(m) for m in d.get("system", [])]
        d["turns"] = [Turn([tuple(m) for m in msgs], reply, tokens) for msgs, reply, tokens in d.get("turns", [])]
        return cls(**d)

    def summary(self) -> dict[str, str]:
        """The hash fields listing reads without parsing the context."""
        return {"model": self.model, "kind": self.kind, "turns": str(len(self.turns)), "tokens": str(self.tokens),
                "worker": self.worker, "model_version": self.model_version, "created": str(self.created_ms), "updated": str(self.updated_ms),
                "committed": str(self.committed_turns), "dropped": str(self.dropped_turns)}

    # ------------------------------------------------------------ what the engine is sent

    def chat_messages(self, skip: int = 0) -> list[tuple[str, str]]:
        """The conversation so far: system messages, then each turn's messages and its reply
        (the oldest `skip` turns left out)."""
        out = list(self.system)
        for t in self.turns[skip:]:
            out += t.messages
            out.append(("assistant", t.reply))
        return out

    def text(self, skip: int = 0) -> str:
        return "".join(t.messages[0][1] + t.reply for t in self.turns[skip:])

    def new_part(self, messages: list[tuple[str, str]] | None, prompt: str | None) -> list[tuple[str, str]]:
        """What a turn adds: its messages (or prompt), less the stored conversation when the client
        sent the whole of it again (a client written for a stateless API)."""
        if self.kind == "chat":
            if messages is None:
                raise errors.InvalidArgument(
                    "this session is a chat: continue it with messages (chat completions), not a prompt", param="prompt")
            held = self.chat_messages()
            if held and len(messages) > len(held) and messages[: len(held)] == held:
                messages = messages[len(held):]
            if not messages:
                raise errors.InvalidArgument("a turn must add at least one message", param="messages")
            return messages
        if prompt is None:
            raise errors.InvalidArgument(
                "this session is a text prompt: continue it with a prompt (completions), not messages",
                param="messages")
        held_text = self.text()
        if held_text and len(prompt) > len(held_text) and prompt.startswith(held_text):
            prompt = prompt[len(held_text):]
        return [("prompt", prompt)]

    @classmethod
    def new(cls, model: str, kind: str, first: list[tuple[str, str]]) -> tuple["Context", list[tuple[str, str]]]:
        """A session's context before its first turn, and that turn's own part: a chat's leading
        system messages become the session's (kept whatever truncation drops)."""
        i = 0
        if kind == "chat":
            while i < len(first) - 1 and first[i][0] in SYSTEM_ROLES:
                i += 1
        return cls(model=model, kind=kind, system=list(first[:i])), first[i:]

    def drop_for(self, excess: int, kept_from: int) -> int:
        """The first turn to keep so that about `excess` more tokens are dropped than dropping up
        to kept_from does (at least one more turn, while any is left)."""
        i, dropped = kept_from, 0
        while i < len(self.turns) and (dropped < excess or i == kept_from):
            dropped += max(1, self.turns[i].tokens)
            i += 1
        return i

    def committed(self, new: list[tuple[str, str]], reply: str, keep_from: int, prompt_tokens: int,
                  completion_tokens: int, worker: str, now_ms: int) -> "Context":
        """The context after a turn (this one is left as it was: a router's cached copy): turns
        before keep_from dropped, the new turn with its reply appended. A turn's tokens are what it
        added to the prompt the context had (an estimate when turns were dropped: what truncation
        works from)."""
        kept_prior = max(0, self.tokens - dropped_tokens(self, keep_from))
        turn = Turn(list(new), reply, max(1, prompt_tokens - kept_prior + completion_tokens))
        return replace(
            self, turns=[*self.turns[keep_from:], turn], tokens=prompt_tokens + completion_tokens, worker=worker,
            updated_ms=now_ms, created_ms=self.created_ms or now_ms, committed_turns=self.committed_turns + 1,
            dropped_turns=self.dropped_turns + keep_from,
        )


def dropped_tokens(ctx: Context, keep_from: int) -> int:
    return sum(t.tokens for t in ctx.turns[:keep_from])


# ---------------------------------------------------------------- Redis scripts

# KEYS: session, index, held, held-until. ARGV: request id, now ms, lease ms, ttl ms, session id,
# the version the caller holds (-1: none), the most sessions the tenant may keep (0: any number),
# the most bytes it may hold (0: any).
# -> {-1, holder, ms left}: another turn holds the session; {-3, kept, most}: it would be one
# session more than the tenant may keep; {-4, held, most}: the tenant holds its most bytes; {0}: no
# session yet (this turn starts it); {version}: the caller's copy is current; {version, ctx}: it is
# not, here is the context.
BEGIN = tenantbytes.LIB + """
local now = tonumber(ARGV[2])
local most = tonumber(ARGV[7] or '0')
local cap = tonumber(ARGV[8] or '0')
if cap > 0 then
  local held = prune(KEYS[3], KEYS[4], now)
  if held >= cap then return {-4, held, cap} end
  if held > 0 then redis.call('HSET', KEYS[3], 'cap', cap) end
end
if most > 0 and redis.call('EXISTS', KEYS[1]) == 0 then
  redis.call('ZREMRANGEBYSCORE', KEYS[2], '-inf', now)
  local kept = redis.call('ZCARD', KEYS[2])
  if kept >= most then return {-3, kept, most} end
end
local holder = redis.call('HGET', KEYS[1], 'turn')
if holder and holder ~= '' and holder ~= ARGV[1] then
  local till = tonumber(redis.call('HGET', KEYS[1], 'turn_until') or '0')
  if till > now then return {-1, holder, till - now} end
end
redis.call('HSET', KEYS[1], 'turn', ARGV[1], 'turn_until', now + tonumber(ARGV[3]))
local v = redis.call('HGET', KEYS[1], 'v')
if not v then
  redis.call('PEXPIRE', KEYS[1], math.max(tonumber(ARGV[3]), 1000))
  return {0}
end
redis.call('PEXPIRE', KEYS[1], tonumber(ARGV[4]))
redis.call('ZADD', KEYS[2], now + tonumber(ARGV[4]), ARGV[5])
local bytes = tonumber(redis.call('HGET', KEYS[3], 's:' .. ARGV[5]) or '0')
if bytes > 0 then account(KEYS[3], KEYS[4], 's:' .. ARGV[5], bytes, now + tonumber(ARGV[4]), now) end
if v == ARGV[6] then return {tonumber(v)} end
return {tonumber(v), redis.call('HGET', KEYS[1], 'ctx')}
"""

# KEYS: session. ARGV: request id, now ms, lease ms. -> 1 renewed, 0 the turn is not ours.
RENEW = """
if redis.call('HGET', KEYS[1], 'turn') ~= ARGV[1] then return 0 end
redis.call('HSET', KEYS[1], 'turn_until', tonumber(ARGV[2]) + tonumber(ARGV[3]))
if not redis.call('HGET', KEYS[1], 'v') then redis.call('PEXPIRE', KEYS[1], tonumber(ARGV[3])) end
return 1
"""

# KEYS: session, index, held, held-until. ARGV: request id, expected version, ctx JSON, now ms, ttl
# ms, session id, then summary field/value pairs. -> {version}: committed; {-1, version}: the
# version moved; {-2}: the turn is no longer this request's (its lease lapsed and another took it,
# or the session was deleted). The session's bytes are its context and summary (BEGIN let the turn
# through: it commits whatever it adds).
COMMIT = tenantbytes.LIB + """
if redis.call('HGET', KEYS[1], 'turn') ~= ARGV[1] then return {-2} end
local v = tonumber(redis.call('HGET', KEYS[1], 'v') or '0')
if v ~= tonumber(ARGV[2]) then return {-1, v} end
local fields = {'v', v + 1, 'ctx', ARGV[3], 'turn', '', 'turn_until', 0}
for i = 7, #ARGV do fields[#fields + 1] = ARGV[i] end
redis.call('HSET', KEYS[1], unpack(fields))
redis.call('PEXPIRE', KEYS[1], tonumber(ARGV[5]))
redis.call('ZADD', KEYS[2], tonumber(ARGV[4]) + tonumber(ARGV[5]), ARGV[6])
local bytes = ENTRY_OVERHEAD
for i = 3, #ARGV do if i == 3 or i >= 7 then bytes = bytes + #ARGV[i] end end
account(KEYS[3], KEYS[4], 's:' .. ARGV[6], bytes, tonumber(ARGV[4]) + tonumber(ARGV[5]), tonumber(ARGV[4]))
return {v + 1}
""".replace("ENTRY_OVERHEAD", str(tenantbytes.ENTRY_OVERHEAD))

# KEYS: session. ARGV: request id. A turn that ends without committing gives the session back
# (a session its first turn never committed is removed).
RELEASE = """
if redis.call('HGET', KEYS[1], 'turn') ~= ARGV[1] then return 0 end
if not redis.call('HGET', KEYS[1], 'v') then
  redis.call('DEL', KEYS[1])
  return 1
end
redis.call('HSET', KEYS[1], 'turn', '', 'turn_until', 0)
return 1
"""

# KEYS: session, index, held, held-until. ARGV: session id, now ms. -> 1: a session was deleted
# (one whose first turn committed), else 0; its bytes are no longer the tenant's.
DELETE = tenantbytes.LIB + """
local existed = redis.call('HEXISTS', KEYS[1], 'v')
redis.call('DEL', KEYS[1])
redis.call('ZREM', KEYS[2], ARGV[1])
account(KEYS[3], KEYS[4], 's:' .. ARGV[1], 0, 0, tonumber(ARGV[2]))
return existed
"""

# KEYS: index. ARGV: now ms, most ids. -> the live ids, most recently renewed first (expired
# ones are removed from the index as they are found).
LIST = """
redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', tonumber(ARGV[1]))
return redis.call('ZREVRANGE', KEYS[1], 0, tonumber(ARGV[2]) - 1, 'WITHSCORES')
"""

# KEYS: response, responses index, held, held-until. ARGV: now ms, ttl ms, the record's JSON, response
# id, the most responses the tenant keeps, the most bytes it may hold (0: any), the prefix of its
# response keys (the oldest are deleted past the most responses).
# -> {-1, held, most}: refused, it would hold more than its most bytes; {held}: stored.
RESPONSE_PUT = tenantbytes.LIB + """
local now, ttl = tonumber(ARGV[1]), tonumber(ARGV[2])
local total = prune(KEYS[3], KEYS[4], now)
local entry = 'r:' .. ARGV[4]
local bytes = #ARGV[3] + ENTRY_OVERHEAD
local old = tonumber(redis.call('HGET', KEYS[3], entry) or '0')
local cap = tonumber(ARGV[6])
if cap > 0 and bytes > old and total - old + bytes > cap then return {-1, total, cap} end
redis.call('SET', KEYS[1], ARGV[3], 'PX', ttl)
redis.call('ZADD', KEYS[2], now + ttl, ARGV[4])
redis.call('ZREMRANGEBYSCORE', KEYS[2], '-inf', now)
redis.call('PEXPIRE', KEYS[2], ttl)
total = account(KEYS[3], KEYS[4], entry, bytes, now + ttl, now)
local over = redis.call('ZCARD', KEYS[2]) - tonumber(ARGV[5])
if over > 0 then
  local gone = redis.call('ZPOPMIN', KEYS[2], over)
  for i = 1, #gone, 2 do
    redis.call('DEL', ARGV[7] .. gone[i])
    total = account(KEYS[3], KEYS[4], 'r:' .. gone[i], 0, 0, now)
  end
end
if total > 0 then redis.call('HSET', KEYS[3], 'cap', ARGV[6]) end
return {total}
""".replace("ENTRY_OVERHEAD", str(tenantbytes.ENTRY_OVERHEAD))

# KEYS: response, responses index, held, held-until. ARGV: response id, now ms. -> 1 deleted, 0 none.
RESPONSE_DELETE = tenantbytes.LIB + """
local deleted = redis.call('DEL', KEYS[1])
redis.call('ZREM', KEYS[2], ARGV[1])
account(KEYS[3], KEYS[4], 'r:' .. ARGV[1], 0, 0, tonumber(ARGV[2]))
return deleted
"""
