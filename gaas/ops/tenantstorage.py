"""What each tenant holds in the shared Redis through stored responses and sessions, against its cap
(gaas.contracts.tenantbytes), as `gaas top` shows it: read with the operator's Redis connection, one
pipelined round trip for all tenants (each tenant's accounting pruned of what expired first)."""

from __future__ import annotations

from collections.abc import Iterable

from gaas.contracts import tenantbytes


def held_by_tenant(client, tenants: Iterable[str], now_ms: int) -> list[dict]:
    """[{"tenant", "bytes", "cap"}] for the tenants that hold anything, the most first (cap 0: no
    router has applied one yet). client: a synchronous redis.Redis."""
    names = list(tenants)
    if not names:
        return []
    held = client.register_script(tenantbytes.HELD)
    pipe = client.pipeline(transaction=False)
    for name in names:
        held(keys=[tenantbytes.held_key(name), tenantbytes.held_until_key(name)], args=[now_ms], client=pipe)
        pipe.hget(tenantbytes.held_key(name), "cap")
    answers = pipe.execute()
    rows = [{"tenant": name, "bytes": int(answers[2 * i]), "cap": int(answers[2 * i + 1] or 0)}
            for i, name in enumerate(names)]
    return sorted((r for r in rows if r["bytes"] > 0), key=lambda r: (-r["bytes"], r["tenant"]))
