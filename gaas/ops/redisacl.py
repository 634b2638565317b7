"""Least privilege in the Redis `gaas up` starts: one ACL user per service kind, each allowed only
the keys and pub/sub channels its service uses, and no administrative or dangerous command
(FLUSHALL, CONFIG, KEYS, DEBUG ...). The default user, with the password kept in the run
directory, stays the operator's. A Redis the operator runs (GAAS_REDIS_URL that answers) is used
as given.

Each pattern stands for keys another module defines (gaas.metering.admission, gaas.metering.peers,
gaas.contracts.sessions, gaas.metering.direct, gaas.contracts.usage, services/control/registry.py,
services/router/auth.py);
tests/unit/ops/test_redisacl.py checks that every key those modules make matches its user's patterns, and the
mesh's tests run under these users.

The Redis also gets a memory bound (maxmemory, GAAS_REDIS_MAXMEMORY) and never evicts (the usage
stream must not lose an entry): full, its writes fail, and every writer degrades as it does when
Redis is away (usage to the spool, admission by each router's own count, sessions 503).
"""

from __future__ import annotations

import os
import secrets
from dataclasses import dataclass

# Keys (~pattern) and channels (&pattern) per service kind. (A script's keys need read and write
# access whatever it does with them, so the budget a router's admission script only reads, and the
# usage stream it only appends to, are not narrower than that.)
PERMISSIONS: dict[str, tuple[str, ...]] = {
    # Worker registrations and leases.
    # Roll-outs: the requests' outcomes the guard judges, and which replica drives them.
    # Autoscaling: the requests a router holds for a model no worker serves.
    # Registry changes announced to the routers.
    "control": ("~gaas:worker:*", "~gaas:workers", "~gaas:control:*", "~gaas:rollout:*", "~gaas:autoscale:*",
                "&gaas:workers:changed"),
    # Admission (quotas, budgets, spend), the usage stream, sessions, stored responses, on the direct path the
    # workers' reports of requests' ends and their streams' progress, and the outcomes of requests
    # of models under a roll-out or autoscaled, and those held for a model no worker serves; the
    # registry's changes, announced; the live routers (gaas.metering.peers); the keys a router verified,
    # for the others while control is away (services/router/auth.SharedKeys).
    "router": ("~gaas:routers", "~gaas:auth:verified:*", "~gaas:inflight:*", "~gaas:inflight-exp:*", "~gaas:rpm:*", "~gaas:tpm:*",
               "~gaas:budget:*", "~gaas:spend:*", "~gaas:usage", "~gaas:session:*", "~gaas:sessions:*", "~gaas:response:*",
               "~gaas:responses:*", "~gaas:direct:*", "&gaas:direct:*", "~gaas:rollout:outcomes", "~gaas:autoscale:demand:*", "&gaas:workers:changed"),
    # On the direct path: a request's usage appended (settling its admission), its progress, a
    # session turn's reply committed, its end reported.
    "worker": ("~gaas:inflight:*", "~gaas:inflight-exp:*", "~gaas:tpm:*", "~gaas:spend:*", "~gaas:usage",
               "~gaas:direct:*", "~gaas:session:*", "~gaas:sessions:*", "&gaas:direct:*"),
    # The usage stream (read by a consumer group), budgets and spend.
    "billing": ("~gaas:usage", "~gaas:spend:*", "~gaas:budget:*"),
}
# What every service user may run: anything but administration and what the ACL calls dangerous.
COMMANDS = "+@all -@admin -@dangerous"
# The Redis gaas starts holds at most this, by default (GAAS_REDIS_MAXMEMORY, Redis's units).
MAXMEMORY = "1gb"


@dataclass(frozen=True, slots=True)
class ServiceUser:
    name: str
    password: str


def users() -> dict[str, ServiceUser]:
    """A user with a fresh password for each service kind (made at each start: Redis starts with
    the mesh, and so do its users)."""
    return {kind: ServiceUser(f"gaas-{kind}", secrets.token_urlsafe(24)) for kind in PERMISSIONS}


def config_lines(service_users: dict[str, ServiceUser]) -> list[str]:
    """redis.conf lines declaring them, and the memory bound."""
    lines = [f"maxmemory {os.environ.get('GAAS_REDIS_MAXMEMORY') or MAXMEMORY}", "maxmemory-policy noeviction"]
    for kind, user in service_users.items():
        lines.append(f"user {user.name} on >{user.password} resetkeys resetchannels "
                     f"{' '.join(PERMISSIONS[kind])} {COMMANDS}")
    return lines


def url_for(url: str, user: ServiceUser) -> str:
    """url (redis://[:password@]host:port/db) as user."""
    from urllib.parse import urlparse

    u = urlparse(url)
    return u._replace(netloc=f"{user.name}:{user.password}@{u.hostname}:{u.port or 6379}").geturl()
