"""Token metering's shared contract: the usage event (one per request, appended by the router to a
Redis Stream before it releases the request's last chunk, consumed by billing into the ledger),
its months and the time bounds of usage queries. The Redis keys and scripts that admit a request
(quotas, budgets) and append its event are gaas.metering.admission's."""

from __future__ import annotations

import functools
import json
import time
from dataclasses import MISSING, dataclass, fields
from datetime import datetime, timezone

from gaas.contracts import errors
from gaas.contracts.jsonbody import is_digits

STREAM = "gaas:usage"
GROUP = "billing"

# A request's outcome; and a supplement's, an event that bills a direct request's output beyond what
# its first record billed (gaas.metering.admission.supplement), not counted as a request.
SUPPLEMENT = "supplement"
OUTCOMES = ("finished", "cancelled", "failed", SUPPLEMENT)

# What a tenant's usage can be grouped by, besides the total: model, model and version ("gaas-tiny
# 2.0.0": what each version of a roll-out served), UTC day, API key id, LoRA adapter ("gaas-tiny:bot";
# the base model alone for requests without one).
USAGE_GROUPS = ("model", "version", "day", "key", "adapter")


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
    # finished, cancelled (the client went away) or failed (after tokens were produced); or SUPPLEMENT.
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
    # The session the request was a turn of ("": none).
    session_id: str = ""
    # The LoRA adapter it was served with ("": the base model alone).
    adapter: str = ""

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


# Unix seconds have 10 digits until the year 2286; more than 12 is no time (and would not fit an int64 of ms).
_MAX_DIGITS = 12


def parse_time(text: str, param: str, now: int | None = None) -> int:
    """A usage query's time bound as Unix ms (0 for empty): an ISO 8601 date or time (UTC unless
    it names an offset), Unix seconds, or a duration back from now (30m, 24h, 7d, 2w)."""
    text = text.strip()
    if not text:
        return 0
    now = now_ms() if now is None else now
    # (ASCII digits only, and few enough to be a time: "²" is a digit to str.isdigit, not to int)
    if text[-1:] in _UNITS and is_digits(text[:-1]) and len(text) <= _MAX_DIGITS:
        return max(0, now - int(text[:-1]) * _UNITS[text[-1]] * 1000)
    if is_digits(text) and len(text) <= _MAX_DIGITS:
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
