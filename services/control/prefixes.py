"""Public prefixes, in SQL: prompt beginnings (a common system prompt) that the operator lets every
tenant share in the prefix cache. A request that starts with one is cached under the prefix's
salt instead of its tenant's, so tenants sending the same system prompt reuse each other's blocks.

What this shares: a request's whole chain of blocks is keyed by the salt of its first block
(that is how vLLM's cache_salt works), so two tenants also share the blocks after the public
prefix when their continuations are identical token for token; a tenant can then tell, by
timing, that another sent exactly that continuation. Mark a prefix public only where that is
acceptable.
"""

from __future__ import annotations

import hashlib
import time
from dataclasses import dataclass

from gaas.contracts import errors
from gaas.runtime.sql import Database

SCHEMA = [
    """CREATE TABLE IF NOT EXISTS public_prefixes (
        prefix_id TEXT PRIMARY KEY,
        model TEXT NOT NULL,
        text TEXT NOT NULL,
        created_ms BIGINT NOT NULL
    )""",
]
MAX_TEXT = 1 << 16


@dataclass(frozen=True, slots=True)
class PublicPrefix:
    prefix_id: str
    model: str
    text: str
    created_ms: int


def prefix_id(model: str, text: str) -> str:
    return "pub_" + hashlib.sha256(f"{model}\0{text}".encode()).hexdigest()[:16]


class PrefixStore:
    def __init__(self, db: Database) -> None:
        self._db = db

    async def init_schema(self) -> None:
        for statement in SCHEMA:
            await self._db.execute(statement)

    async def add(self, model: str, text: str, known_models: set[str]) -> PublicPrefix:
        if model not in known_models:
            raise errors.NotFound(f"model {errors.quote(model)} is not deployed (known: {', '.join(sorted(known_models))})",
                                  param="model")
        if not text.strip():
            raise errors.InvalidArgument("a public prefix needs text", param="text")
        if len(text) > MAX_TEXT:
            raise errors.InvalidArgument(f"a public prefix is at most {MAX_TEXT} characters", param="text")
        p = PublicPrefix(prefix_id(model, text), model, text, int(time.time() * 1000))
        existing = await self._db.execute("SELECT created_ms FROM public_prefixes WHERE prefix_id = ?", (p.prefix_id,))
        if existing:
            return PublicPrefix(p.prefix_id, model, text, existing[0][0])
        await self._db.execute(
            "INSERT INTO public_prefixes (prefix_id, model, text, created_ms) VALUES (?, ?, ?, ?)",
            (p.prefix_id, p.model, p.text, p.created_ms),
        )
        return p

    async def list(self, model: str = "") -> list[PublicPrefix]:
        query, params = "SELECT prefix_id, model, text, created_ms FROM public_prefixes", ()
        if model:
            query, params = query + " WHERE model = ?", (model,)
        return [PublicPrefix(*row) for row in await self._db.execute(query + " ORDER BY created_ms, prefix_id", params)]

    async def remove(self, pid: str) -> None:
        rows = await self._db.execute("SELECT prefix_id FROM public_prefixes WHERE prefix_id = ?", (pid,))
        if not rows:
            raise errors.NotFound(f"no public prefix {errors.quote(pid)}; `gaas kv public list` shows them",
                                  param="prefix_id")
        await self._db.execute("DELETE FROM public_prefixes WHERE prefix_id = ?", (pid,))
