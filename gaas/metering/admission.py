"""Admission in Redis, shared by every router replica (one figure per tenant whichever replica a
request reaches): a tenant's quotas (requests and tokens per minute, sequences at once) and its
monthly budget, checked and reserved in one atomic script before a request starts (ADMIT; refusal()
is the error of a refused answer), and settled in the same script that appends the request's usage
event when it ends (RECORD).

Keys (a tenant's share a Redis Cluster hash slot, {tenant}):
  gaas:inflight:{t}        request id -> "cost tokens second sequences": what a request in flight
                           may still cost (micro-dollars), the tokens reserved for it, when it was
                           admitted, and the sequences it runs (n choices of each of its prompts:
                           what the concurrency quota counts; an entry without one is one)
  gaas:inflight-exp:{t}    request id -> when that entry lapses (a router that died mid-request)
  gaas:rpm:{t}, gaas:tpm:{t}  second -> requests / tokens admitted in it (the last 60 s count)
  gaas:budget:{t}          the monthly budget, micro-dollars (absent: none)
  gaas:spend:{t}:YYYYMM    what the tenant's requests cost this month
  gaas:direct:{t}:<id>     a request the ingress streams from a worker (the direct path): the tokens
                           its client has been sent so far and who streams it, "completion cached
                           worker", as the worker streaming it writes them every PROGRESS_SECONDS
                           they move, and every PROGRESS_HEARTBEAT_SECONDS regardless ("0 0" until
                           then); "billed" once its usage event is appended. Should the worker die
                           mid-stream (its key goes unwritten), the router that admitted it appends
                           the event from these figures (RECORD's "claim"), so a request is billed
                           once whichever of them records it.
A request's tokens (prompt + the most it may generate) are reserved at admission and settled to
what it used when its event is appended; a request that produced nothing gets them back.
Minute windows are sliding, in one-second buckets. Billing rebuilds a lost spend counter from the
ledger.
"""

from __future__ import annotations

from dataclasses import replace

from gaas.contracts import errors, pricing, usage as metering
from gaas.contracts.usage import UsageEvent

# Spend counters outlive their month by this much (billing reads last month's at the turn).
SPEND_TTL_SECONDS = 40 * 86400
WINDOW_SECONDS = 60

# ADMIT's answers (its first value).
ADMITTED, OVER_CONCURRENCY, OVER_RPM, OVER_TPM, TOO_LARGE_FOR_TPM, OVER_BUDGET, TOO_MANY_SEQUENCES = 1, 2, 3, 4, 5, 6, 7


def budget_key(tenant: str) -> str:
    return f"gaas:budget:{{{tenant}}}"


def spend_key(tenant: str, month: str) -> str:
    return f"gaas:spend:{{{tenant}}}:{month}"


def inflight_key(tenant: str) -> str:
    return f"gaas:inflight:{{{tenant}}}"


def inflight_exp_key(tenant: str) -> str:
    return f"gaas:inflight-exp:{{{tenant}}}"


def rpm_key(tenant: str) -> str:
    return f"gaas:rpm:{{{tenant}}}"


def tpm_key(tenant: str) -> str:
    return f"gaas:tpm:{{{tenant}}}"


def progress_key(tenant: str, request_id: str) -> str:
    return f"gaas:direct:{{{tenant}}}:{request_id}"


# How often a worker writes the progress of the streams it serves on the direct path: what a
# request whose worker died within this of its last tokens may go unbilled for.
PROGRESS_SECONDS = 0.25
# A stream's progress is written at least this often while it runs, moved or not; a progress key
# not written for STALE_SECONDS (its key's life tells, in Redis's own clock) is of a request no
# worker streams: its worker's process died, or none ever started it.
PROGRESS_HEARTBEAT_SECONDS = 1.0
PROGRESS_STALE_SECONDS = 10.0
# How long a progress key lasts (its request's reservation's life), "billed" included.
PROGRESS_TTL_SECONDS = 900
# A progress key's value once its request is billed starts with this, then what was billed of its
# output (billed_value).
BILLED = "billed"


def admit_keys(tenant: str, month: str, request_id: str | None = None) -> list[str]:
    """ADMIT's keys; request_id: a request the ingress will stream from a worker, whose progress
    key is made with its admission."""
    keys = [budget_key(tenant), spend_key(tenant, month), inflight_key(tenant), inflight_exp_key(tenant),
            rpm_key(tenant), tpm_key(tenant)]
    return keys if request_id is None else [*keys, progress_key(tenant, request_id)]


# KEYS: budget, spend, inflight, inflight-exp, rpm, tpm, and a direct request's progress key.
# ARGV: request id, cost estimate (micro-$), tokens estimate, now ms, expiry ms, rpm, tpm, concurrency
# limits (0: none), sequences. -> {answer, a, b, c, retry ms}: ADMITTED with the budget (-1: none),
# spend and what requests in flight hold; otherwise which limit refused, with its figures (see
# Meter.admit).
ADMIT = """
local now = tonumber(ARGV[4])
local now_s = math.floor(now / 1000)
local window = %(window)d
local stale = redis.call('ZRANGEBYSCORE', KEYS[4], '-inf', now)
if #stale > 0 then
  redis.call('HDEL', KEYS[3], unpack(stale))
  redis.call('ZREM', KEYS[4], unpack(stale))
end
local concurrency, sequences = tonumber(ARGV[8]), tonumber(ARGV[9] or '1')
if concurrency > 0 then
  if sequences > concurrency then return {%(too_many)d, sequences, concurrency, 0, 0} end
  local n = 0
  for _, v in ipairs(redis.call('HVALS', KEYS[3])) do n = n + tonumber(string.match(v, '^%%S+ %%S+ %%S+ (%%d+)$') or '1') end
  if n + sequences > concurrency then return {%(concurrency)d, n, concurrency, 0, 1000} end
end
-- What the last minute used of a limit, and when enough of it frees for `want` more (ms).
local function used(key, limit, want)
  local flat = redis.call('HGETALL', key)
  local total, buckets = 0, {}
  for i = 1, #flat, 2 do
    local s, v = tonumber(flat[i]), tonumber(flat[i + 1])
    if s <= now_s - window then
      redis.call('HDEL', key, flat[i])
    else
      total = total + v
      buckets[#buckets + 1] = {s, v}
    end
  end
  if total + want <= limit then return total, 0 end
  table.sort(buckets, function(x, y) return x[1] < y[1] end)
  local need, freed = total + want - limit, 0
  for _, b in ipairs(buckets) do
    freed = freed + b[2]
    if freed >= need then return total, math.max(100, (b[1] + window) * 1000 - now) end
  end
  return total, window * 1000
end
local rpm, tpm, tokens = tonumber(ARGV[6]), tonumber(ARGV[7]), tonumber(ARGV[3])
if rpm > 0 then
  local n, retry = used(KEYS[5], rpm, 1)
  if retry > 0 then return {%(rpm)d, n, rpm, 0, retry} end
end
if tpm > 0 then
  if tokens > tpm then return {%(too_large)d, tokens, tpm, 0, 0} end
  local n, retry = used(KEYS[6], tpm, tokens)
  if retry > 0 then return {%(tpm)d, n, tpm, 0, retry} end
end
local budget = redis.call('GET', KEYS[1])
local spend, held = 0, 0
if budget then
  budget = tonumber(budget)
  spend = tonumber(redis.call('GET', KEYS[2]) or '0')
  for _, v in ipairs(redis.call('HVALS', KEYS[3])) do held = held + tonumber(string.match(v, '^(%%-?%%d+)')) end
  if spend + held + tonumber(ARGV[2]) > budget then return {%(budget)d, budget, spend, held, 0} end
else
  budget = -1
end
if rpm > 0 then
  redis.call('HINCRBY', KEYS[5], now_s, 1)
  redis.call('EXPIRE', KEYS[5], 2 * window)
end
local reserved = 0
if tpm > 0 then
  reserved = tokens
  redis.call('HINCRBY', KEYS[6], now_s, tokens)
  redis.call('EXPIRE', KEYS[6], 2 * window)
end
redis.call('HSET', KEYS[3], ARGV[1], ARGV[2] .. ' ' .. reserved .. ' ' .. now_s .. ' ' .. sequences)
redis.call('ZADD', KEYS[4], ARGV[5], ARGV[1])
if KEYS[7] then redis.call('SET', KEYS[7], '0 0', 'EX', %(progress_ttl)d) end
return {%(admitted)d, budget, spend, held, 0}
""" % {"window": WINDOW_SECONDS, "concurrency": OVER_CONCURRENCY, "rpm": OVER_RPM, "tpm": OVER_TPM,
       "too_large": TOO_LARGE_FOR_TPM, "budget": OVER_BUDGET, "admitted": ADMITTED, "too_many": TOO_MANY_SEQUENCES,
       "progress_ttl": PROGRESS_TTL_SECONDS}

# Give back what a request in flight holds: its place, and its reserved tokens less `used`.
_SETTLE = """
local function settle(inflight, inflight_exp, tpm, id, used)
  local held = redis.call('HGET', inflight, id)
  if not held then return end
  local _, reserved, second = string.match(held, '^(%-?%d+) (%d+) (%d+)')
  reserved = tonumber(reserved)
  if reserved and reserved > 0 and redis.call('HEXISTS', tpm, second) == 1 then
    redis.call('HINCRBY', tpm, second, used - reserved)
  end
  redis.call('HDEL', inflight, id)
  redis.call('ZREM', inflight_exp, id)
end
"""

# KEYS: stream, spend, inflight, inflight-exp, tpm, and with a mode, the request's progress key.
# ARGV: request id, cost, spend ttl, tokens used, mode, the progress key's value once billed, the
# value it must have ("more" only), then the event's field/value pairs. Appends the event, adds its
# cost, settles its admission: all or nothing. Modes: "" (a request the router streams); "own" (the
# worker streaming a direct request: unless it was billed already, when the billed value is
# returned for the worker to bill what its attempt sent beyond it: supplement()); "claim" (the
# router, for a direct request whose worker went silent: only if the worker's progress is there
# and not billed); "more" (a supplement: only if the billed value is still the one it was made
# against). -> the entry's id; or nil, or the billed value ("own"), when it was billed already.
RECORD = _SETTLE + """
local mode = ARGV[5]
if mode ~= '' then
  local v = redis.call('GET', KEYS[6])
  local billed = v and string.sub(v, 1, %(len)d) == '%(billed)s'
  if mode == 'more' then
    if v ~= ARGV[7] then return false end
  elseif billed then
    if mode == 'own' then return v end
    return false
  elseif mode == 'claim' and not v then
    return false
  end
  redis.call('SET', KEYS[6], ARGV[6], 'EX', %(progress_ttl)d)
end
settle(KEYS[3], KEYS[4], KEYS[5], ARGV[1], tonumber(ARGV[4]))
local entry = redis.call('XADD', KEYS[1], '*', unpack(ARGV, 8))
redis.call('INCRBY', KEYS[2], ARGV[2])
redis.call('EXPIRE', KEYS[2], ARGV[3])
return entry
""" % {"billed": BILLED, "len": len(BILLED), "progress_ttl": PROGRESS_TTL_SECONDS}

# KEYS: a direct request's progress key. ARGV: "completion cached". Written unless it is billed (or
# gone: its admission lapsed).
PROGRESS = """
local v = redis.call('GET', KEYS[1])
if v and string.sub(v, 1, %(len)d) ~= '%(billed)s' then redis.call('SET', KEYS[1], ARGV[1], 'EX', %(progress_ttl)d) end
return 1
""" % {"billed": BILLED, "len": len(BILLED), "progress_ttl": PROGRESS_TTL_SECONDS}

# KEYS: inflight, inflight-exp, tpm. ARGV: request id, tokens used (absent: none). A request that
# ends without a usage event: having produced nothing, or a /tokenize (its tokens count a minute).
RELEASE = _SETTLE + """
settle(KEYS[1], KEYS[2], KEYS[3], ARGV[1], tonumber(ARGV[2] or '0'))
return 1
"""


def record_args(event: UsageEvent, mode: str = "", billed: str = "") -> tuple[list[str], list[str]]:
    """KEYS and ARGV of RECORD for an event (mode: RECORD's; billed: the value a "more" event was
    made against)."""
    flat: list[str] = []
    for k, v in event.to_fields().items():
        flat += [k, v]
    t = event.tenant
    keys = [metering.STREAM, spend_key(t, metering.month_of(event.finished_ms)), inflight_key(t), inflight_exp_key(t),
            tpm_key(t)]
    if mode:
        keys.append(progress_key(t, event.request_id.partition(SUPPLEMENT_MARK)[0]))
    used = event.prompt_tokens + event.completion_tokens
    return keys, [event.request_id, str(event.cost_micros), str(SPEND_TTL_SECONDS), str(used), mode,
                  billed_value(event, billed), billed, *flat]


# A supplement's request id is its request's, this, and what the request is billed in all.
SUPPLEMENT_MARK = "+"


def billed_value(event: UsageEvent, before: str = "") -> str:
    """A direct request's progress key once event is billed: the output billed of it in all
    (before: the value it had, for a supplement)."""
    completion, cost = _billed(before) if before else (0, 0)
    return f"{BILLED} {completion + event.completion_tokens} {cost + event.cost_output_micros}"


def _billed(value: str) -> tuple[int, int]:
    """(completion tokens, their cost) a billed value says were billed; a plain "billed" (written
    before values carried them) counts as all there was."""
    parts = value.split()
    try:
        return int(parts[1]), int(parts[2])
    except (IndexError, ValueError):
        return 1 << 62, 1 << 62


def supplement(event: UsageEvent, billed: str) -> UsageEvent | None:
    """What a direct request's attempt (event) sent beyond what was billed of it (billed: its
    progress key's value): the ingress retried a request on its second choice after the first had
    begun it (the first's sidecar died before passing its answer on), and the first, cut, billed
    its prompt and what it made; the client was sent the second's whole answer. The prompt stays
    billed once; the output the second made beyond the first's is billed as an event of its own
    (outcome "supplement", not counted as a request). None: nothing beyond."""
    completion, cost = _billed(billed)
    if event.completion_tokens <= completion:
        return None
    total = event.completion_tokens
    return replace(event, request_id=f"{event.request_id}{SUPPLEMENT_MARK}{total}", outcome=metering.SUPPLEMENT,
                   prompt_tokens=0, cached_tokens=0, completion_tokens=total - completion, cost_input_micros=0,
                   cost_cached_micros=0, cost_output_micros=max(0, event.cost_output_micros - cost))


def progress_value(completion: int, cached: int, worker: str) -> str:
    return f"{completion} {cached} {worker}"


def read_progress(value: str | None) -> tuple[int, int] | None:
    """(completion, cached) tokens of a progress key's value; None: gone, billed, or unreadable."""
    if value is None or is_billed(value):
        return None
    try:
        completion, cached = (int(x) for x in value.split()[:2])
    except ValueError:
        return None
    return completion, cached


def is_billed(value: str | None) -> bool:
    """Whether a progress key's value says its request is billed."""
    return value is not None and value.split(" ", 1)[0] == BILLED


def progress_age(pttl_ms: int) -> float | None:
    """Seconds since a progress key was last written (admitted, or a worker's progress), from its
    remaining life (PTTL); None: the key is gone."""
    return None if pttl_ms < 0 else PROGRESS_TTL_SECONDS - pttl_ms / 1000


def progress_worker(value: str | None) -> str:
    """Who streams the request a progress key's value is of ("": no worker has written it yet)."""
    parts = (value or "").split()
    return parts[2] if len(parts) > 2 else ""


def release_keys(tenant: str) -> list[str]:
    return [inflight_key(tenant), inflight_exp_key(tenant), tpm_key(tenant)]


def refusal(
    tenant: str, answer: int, a: int, b: int, c: int, retry_ms: int, estimate: int, tokens: int, now: int,
) -> errors.ResourceExhausted:
    """The error of an ADMIT answer that refused a request (its figures as the script returned them)."""
    retry = max(1.0, retry_ms / 1000)
    subject = f"tenant:{tenant}"
    if answer == OVER_CONCURRENCY:
        return errors.ResourceExhausted(
            f"tenant {tenant} has {a} sequences in flight (each choice of each prompt counts), its limit is {b} at "
            "once: retry when one has finished", reason="rate_limit_exceeded", retry_after=retry,
            quota=errors.QuotaViolation(subject, f"concurrent sequences: {b}"))
    if answer == TOO_MANY_SEQUENCES:
        return errors.ResourceExhausted(
            f"this request runs {a} sequences at once (n choices of each prompt), more than tenant {tenant}'s "
            f"limit of {b}: ask for fewer choices or send fewer prompts", param="n", reason="rate_limit_exceeded",
            quota=errors.QuotaViolation(subject, f"concurrent sequences: {b}"))
    if answer == OVER_RPM:
        return errors.ResourceExhausted(
            f"tenant {tenant} has made {a} requests in the last minute, its quota is {b} requests per minute: "
            f"retry in {retry:.0f} s", reason="rate_limit_exceeded", retry_after=retry,
            quota=errors.QuotaViolation(subject, f"requests per minute: {b}"))
    if answer == OVER_TPM:
        return errors.ResourceExhausted(
            f"tenant {tenant} has used {a} tokens in the last minute (prompts plus the most each request may "
            f"generate), its quota is {b} tokens per minute and this request needs up to {tokens}: retry in "
            f"{retry:.0f} s, or ask for fewer max_tokens", reason="rate_limit_exceeded", retry_after=retry,
            quota=errors.QuotaViolation(subject, f"tokens per minute: {b}"))
    if answer == TOO_LARGE_FOR_TPM:
        return errors.ResourceExhausted(
            f"this request needs up to {a} tokens (its prompt plus max_tokens), more than tenant {tenant}'s quota "
            f"of {b} tokens per minute: ask for fewer max_tokens or a shorter prompt", param="max_tokens",
            reason="rate_limit_exceeded", quota=errors.QuotaViolation(subject, f"tokens per minute: {b}"))
    _, month_end = metering.month_bounds(metering.month_of(now))
    return errors.ResourceExhausted(
        f"tenant {tenant} has used its monthly budget of {pricing.format_usd(a)} ({pricing.format_usd(b)} spent "
        f"this month, {pricing.format_usd(c)} held by requests in flight; this request could cost up to "
        f"{pricing.format_usd(estimate)}); requests are served again when the budget is raised or the month turns",
        reason="insufficient_quota", retry_after=max(1.0, (month_end - now) / 1000),
        quota=errors.QuotaViolation(subject, f"monthly budget: {pricing.format_usd(a)}"))
