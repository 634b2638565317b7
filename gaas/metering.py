"""Token metering's shared contract: the usage event (one per request, appended by the router to a
Redis Stream before it releases the request's last chunk, consumed by billing into the ledger),
and the Redis keys and atomic scripts behind monthly budgets.

Budgets, in Redis so every router replica enforces one figure:
  gaas:budget:{tenant}           the tenant's monthly budget, micro-dollars (absent: no budget)
  gaas:spend:{tenant}:YYYYMM     what its requests cost this month (added with each usage event)
  gaas:reserved:{tenant}         request id -> the most a request in flight can still cost
  gaas:reserved-exp:{tenant}     request id -> when that reservation lapses (a router that died)
A request is admitted only if spend + reservations + its own estimate fit the budget, atomically
(RESERVE), so concurrent requests cannot race past it; its usage event then adds its real cost
and drops its reservation in the same step as the event is appended (RECORD). Billing rebuilds a
lost spend counter from the ledger. (Single-Redis deployments; in Redis Cluster the tenant's keys
share a hash slot but the stream does not.)
"""

from __future__ import annotations

import functools
import json
import time
from dataclasses import MISSING, dataclass, fields
from datetime import datetime, timezone

from gaas import errors

STREAM = "gaas:usage"
GROUP = "billing"
# Spend counters outlive their month by this much (billing reads last month's at the turn).
SPEND_TTL_SECONDS = 40 * 86400

OUTCOMES = ("finished", "cancelled", "failed")

# What a tenant's usage can be grouped by, besides the total: model, UTC day, API key id.
USAGE_GROUPS = ("model", "day", "key")


@dataclass(frozen=True, slots=True)
class UsageEvent:
    """One request's usage, as its tenant is billed for it."""

    # GaaS's id of the request (never the client's).
    request_id: str
    tenant: str
    # The API key's public id.
    key_id: str
    tier: str
    model: str
    model_version: str
    prompt_tokens: int
    cached_tokens: int
    completion_tokens: int
    # What it cost at the prices of the time, micro-dollars: uncached prompt, cached prompt, output.
    cost_input_micros: int
    cost_cached_micros: int
    cost_output_micros: int
    # finished, cancelled (the client went away) or failed (after tokens were produced).
    outcome: str
    # The worker(s) that served it.
    worker: str
    # When it ended, Unix ms.
    finished_ms: int
    # Time in the engine's queue, to its first token, and from arrival to the end, ms.
    queue_ms: float = 0.0
    ttft_ms: float = 0.0
    e2e_ms: float = 0.0
    # The id the client gave its request, for the tenant's own records.
    client_request_id: str = ""

    @property
    def cost_micros(self) -> int:
        return self.cost_input_micros + self.cost_cached_micros + self.cost_output_micros

    def to_fields(self) -> dict[str, str]:
        """The stream entry: the event as one JSON field (cheap to append and to read back)."""
        return {"v": "1", "event": json.dumps({name: getattr(self, name) for name in _FIELDS}, separators=(",", ":"))}

    @classmethod
    def from_fields(cls, raw: dict) -> "UsageEvent":
        """The event of a stream entry; ValueError when it is not one."""
        data = raw.get("event", raw.get(b"event"))
        if data is None:
            raise ValueError("stream entry without an event")
        try:
            values = json.loads(data)
        except (TypeError, ValueError) as exc:
            raise ValueError(f"event is not JSON: {exc}") from None
        if not isinstance(values, dict):
            raise ValueError("event is not a JSON object")
        kwargs = {}
        for name, kind in _FIELDS.items():
            if name not in values:
                if name in _DEFAULTS:
                    continue
                raise ValueError(f"usage event without {name}")
            value = values[name]
            if kind is float and isinstance(value, int) and not isinstance(value, bool):
                value = float(value)
            if type(value) is not kind:
                raise ValueError(f"usage event's {name} is not a {kind.__name__}")
            kwargs[name] = value
        event = cls(**kwargs)
        if event.outcome not in OUTCOMES or min(event.prompt_tokens, event.cached_tokens, event.completion_tokens) < 0:
            raise ValueError(f"usage event {event.request_id} is malformed")
        return event


# Field name -> type, and the fields with defaults (an older router's event may lack them).
_FIELDS = {f.name: {"int": int, "float": float, "str": str}[f.type] for f in fields(UsageEvent)}
_DEFAULTS = {f.name for f in fields(UsageEvent) if f.default is not MISSING}


def month_of(ms: int) -> str:
    """The UTC month of a Unix-ms time, YYYYMM (budgets and invoices are monthly)."""
    return _month_of_hour(ms // 3_600_000)  # months begin on the hour: cached per hour


@functools.lru_cache(maxsize=64)
def _month_of_hour(hour: int) -> str:
    return datetime.fromtimestamp(hour * 3600, tz=timezone.utc).strftime("%Y%m")


def month_bounds(month: str) -> tuple[int, int]:
    """[start, end) of a YYYYMM month, Unix ms."""
    year, mon = int(month[:4]), int(month[4:])
    start = datetime(year, mon, 1, tzinfo=timezone.utc)
    end = datetime(year + (mon == 12), 1 if mon == 12 else mon + 1, 1, tzinfo=timezone.utc)
    return int(start.timestamp() * 1000), int(end.timestamp() * 1000)


def now_ms() -> int:
    return int(time.time() * 1000)


_UNITS = {"s": 1, "m": 60, "h": 3600, "d": 86400, "w": 7 * 86400}


def parse_time(text: str, param: str, now: int | None = None) -> int:
    """A usage query's time bound as Unix ms (0 for empty): an ISO 8601 date or time (UTC unless
    it names an offset), Unix seconds, or a duration back from now (30m, 24h, 7d, 2w)."""
    text = text.strip()
    if not text:
        return 0
    now = now_ms() if now is None else now
    if text[-1:] in _UNITS and text[:-1].isdigit():
        return max(0, now - int(text[:-1]) * _UNITS[text[-1]] * 1000)
    if text.isdigit():
        return int(text) * 1000
    try:
        moment = datetime.fromisoformat(text.replace("Z", "+00:00").replace("z", "+00:00"))
    except ValueError:
        raise errors.InvalidArgument(
            f"{param} must be an ISO 8601 date or time (2026-11-01, 2026-11-01T12:00:00Z), Unix seconds, "
            f"or a duration back from now (30m, 24h, 7d); got {text[:40]!r}", param=param,
        ) from None
    if moment.tzinfo is None:
        moment = moment.replace(tzinfo=timezone.utc)
    return max(0, int(moment.timestamp() * 1000))


def budget_key(tenant: str) -> str:
    return f"gaas:budget:{{{tenant}}}"


def spend_key(tenant: str, month: str) -> str:
    return f"gaas:spend:{{{tenant}}}:{month}"


def reserved_key(tenant: str) -> str:
    return f"gaas:reserved:{{{tenant}}}"


def reserved_exp_key(tenant: str) -> str:
    return f"gaas:reserved-exp:{{{tenant}}}"


# KEYS: budget, spend, reserved, reserved-exp. ARGV: request id, estimate, now ms, expiry ms.
# -> {1, budget or -1, spend, reserved} when admitted, {0, budget, spend, reserved} when not.
RESERVE = """
local budget = redis.call('GET', KEYS[1])
if not budget then return {1, -1, 0, 0} end
budget = tonumber(budget)
local stale = redis.call('ZRANGEBYSCORE', KEYS[4], '-inf', ARGV[3])
if #stale > 0 then
  redis.call('HDEL', KEYS[3], unpack(stale))
  redis.call('ZREM', KEYS[4], unpack(stale))
end
local spend = tonumber(redis.call('GET', KEYS[2]) or '0')
local reserved = 0
for _, v in ipairs(redis.call('HVALS', KEYS[3])) do reserved = reserved + tonumber(v) end
local estimate = tonumber(ARGV[2])
if spend + reserved + estimate > budget then return {0, budget, spend, reserved} end
redis.call('HSET', KEYS[3], ARGV[1], estimate)
redis.call('ZADD', KEYS[4], ARGV[4], ARGV[1])
return {1, budget, spend, reserved}
"""

# KEYS: stream, spend, reserved, reserved-exp. ARGV: request id, cost, spend ttl, then the event's
# field/value pairs. Appends the event, adds its cost, drops its reservation: all or nothing.
RECORD = """
local entry = redis.call('XADD', KEYS[1], '*', unpack(ARGV, 4))
redis.call('INCRBY', KEYS[2], ARGV[2])
redis.call('EXPIRE', KEYS[2], ARGV[3])
redis.call('HDEL', KEYS[3], ARGV[1])
redis.call('ZREM', KEYS[4], ARGV[1])
return entry
"""

# KEYS: reserved, reserved-exp. ARGV: request id. A request that ends without usage.
RELEASE = """
redis.call('HDEL', KEYS[1], ARGV[1])
redis.call('ZREM', KEYS[2], ARGV[1])
return 1
"""


def record_args(event: UsageEvent) -> tuple[list[str], list[str]]:
    """KEYS and ARGV of RECORD for an event."""
    flat: list[str] = []
    for k, v in event.to_fields().items():
        flat += [k, v]
    keys = [STREAM, spend_key(event.tenant, month_of(event.finished_ms)), reserved_key(event.tenant),
            reserved_exp_key(event.tenant)]
    return keys, [event.request_id, str(event.cost_micros), str(SPEND_TTL_SECONDS), *flat]
