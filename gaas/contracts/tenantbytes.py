"""What one tenant holds in the shared Redis through stored responses and sessions, in bytes, and
its cap: one tenant must not fill the Redis every tenant shares (it never evicts: full, sessions and
stored responses answer 503 for everyone).

Each entry a tenant keeps (a stored response "r:<id>", a session "s:<id>") is counted at the size
of what is written for it (its JSON) plus ENTRY_OVERHEAD for its key, its index entry and its
accounting; not Redis's exact MEMORY USAGE, but proportional to it and cheap. Two keys per tenant,
in the tenant's hash slot, beside its sessions' index (so the router's and worker's Redis users
already reach them):

  gaas:sessions:{tenant}:held        hash: entry -> bytes, "total" -> the sum of the entries, and
                                     "cap" -> the cap the router that last checked one applied
  gaas:sessions:{tenant}:held-until  sorted set: entry -> when it expires (Unix ms)

Every script that writes or deletes an entry updates both in the same script (atomic, O(1) per
write), overwriting an entry replaces its bytes rather than adding them. Redis expires the entries
themselves by TTL without telling anyone, so every script first prunes the accounting: the entries
whose expiry has passed are subtracted from the total and forgotten (PRUNE, amortised: each entry is
pruned once). An entry's expiry moves with its key's (a session's turn renews both). The two keys
themselves expire with the tenant's last entry, so a tenant that keeps nothing holds nothing.

A write that would take the tenant past its cap is refused (a stored response: PUT answers -1; a
session turn: BEGIN refuses the turn while the tenant is at its cap, and the turn it lets through
commits whatever it adds, so a tenant exceeds its cap by at most the turns it had in flight when it
reached it). Shrinking or unchanged overwrites are always let through. Pure: no Redis client here.
"""

from __future__ import annotations

import re

from gaas.contracts import errors

# The most a tenant may hold by default: 48 MiB, under 5% of the 1 GB maxmemory `gaas up` gives
# Redis (gaas/ops/redisacl.py MAXMEMORY); sessions.max_bytes_per_tenant in deploy/gaas.yaml.
DEFAULT_MAX_BYTES = 48 * 2**20
# Bytes counted for an entry beside its value: key name, index member, accounting fields.
ENTRY_OVERHEAD = 256


def held_key(tenant: str) -> str:
    return f"gaas:sessions:{{{tenant}}}:held"


def held_until_key(tenant: str) -> str:
    return f"gaas:sessions:{{{tenant}}}:held-until"


def response_entry(response_id: str) -> str:
    return f"r:{response_id}"


def session_entry(session_id: str) -> str:
    return f"s:{session_id}"


def refused(tenant: str, held: int, cap: int, what: str) -> errors.ResourceExhausted:
    """The 429 for a write past the tenant's cap: the limit, and what frees room."""
    return errors.ResourceExhausted(
        f"tenant {tenant} holds {mib(held)} of stored responses and sessions, and may hold {mib(cap)}: {what} is "
        "refused. Delete stored responses you no longer need (DELETE /v1/responses/ID) or sessions (DELETE "
        "/v1/gaas/sessions/ID), send \"store\": false for responses you will not fetch or continue, or let them "
        "expire", reason="storage_limit",
        quota=errors.QuotaViolation(f"tenant:{tenant}", f"bytes held in stored responses and sessions: {cap}"))


def mib(n: int) -> str:
    return f"{n / 2**20:.1f} MiB"


_UNITS = {"": 1, "b": 1, "k": 1000, "kb": 1024, "m": 1000**2, "mb": 1024**2, "g": 1000**3, "gb": 1024**3}


def memory_bytes(text: str) -> int:
    """A Redis memory size ("1gb", "512mb", "100000") in bytes, as redis.conf reads it."""
    m = re.fullmatch(r"\s*(\d+)\s*([a-zA-Z]*)\s*", text)
    if not m or m.group(2).lower() not in _UNITS:
        raise ValueError(f"not a Redis memory size: {text!r}")
    return int(m.group(1)) * _UNITS[m.group(2).lower()]


# ---------------------------------------------------------------- Lua

# Functions the scripts below start with. held, until: the two keys; now: Unix ms.
# prune: forget the entries past their expiry; -> the total held.
# account: set an entry's bytes (0: forget it) and expiry; the keys live as long as the last entry.
LIB = """
local function prune(held, until_, now)
  local gone = redis.call('ZRANGEBYSCORE', until_, '-inf', now, 'LIMIT', 0, 1000)
  if #gone > 0 then
    local freed = 0
    for _, e in ipairs(gone) do freed = freed + tonumber(redis.call('HGET', held, e) or '0') end
    redis.call('HDEL', held, unpack(gone))
    redis.call('ZREM', until_, unpack(gone))
    redis.call('HINCRBY', held, 'total', -freed)
  end
  return tonumber(redis.call('HGET', held, 'total') or '0')
end
local function account(held, until_, entry, bytes, expires, now)
  local old = tonumber(redis.call('HGET', held, entry) or '0')
  if bytes > 0 then
    redis.call('HSET', held, entry, bytes)
    redis.call('ZADD', until_, expires, entry)
  else
    redis.call('HDEL', held, entry)
    redis.call('ZREM', until_, entry)
  end
  local total = redis.call('HINCRBY', held, 'total', bytes - old)
  local last = redis.call('ZRANGE', until_, -1, -1, 'WITHSCORES')
  if #last == 0 then
    redis.call('DEL', held, until_)
    return 0
  end
  local ttl = math.max(tonumber(last[2]) - now, 1000)
  redis.call('PEXPIRE', held, ttl)
  redis.call('PEXPIRE', until_, ttl)
  return total
end
"""

# KEYS: held, until. ARGV: now ms. -> the bytes the tenant holds.
HELD = LIB + """
return prune(KEYS[1], KEYS[2], tonumber(ARGV[1]))
"""
