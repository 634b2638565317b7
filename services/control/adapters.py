"""The LoRA adapter catalogue, in SQL (`gaas lora add|remove|list`). An adapter is checked before it
is added: its name clashes with no model or adapter (and a deployment file is refused when one of
its models would take an adapter's name: names_apart), its base model is deployed with workers whose
engine serves adapters (a pool's engine: {max_loras: N}), its files are a PEFT LoRA adapter whose
matrices fit the base model's layers, its rank is within every such pool's max_lora_rank, and its
owner is a tenant. Nothing changes when a check fails; the error says what to change.

Workers load an adapter on its first request and unload it when it is removed here (their lease
renewals carry the ids catalogued for their model: services/worker/lease.py)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterable, Mapping
from pathlib import Path

from gaas.contracts import adapters as contract, errors
from gaas.contracts.adapters import Adapter
from gaas.contracts.pricing import Price
from gaas.model import lora
from gaas.runtime.migrations import migrate
from gaas.runtime.sql import Database
from gaas.settings.deployspec import SpecError
from gaas.settings.worker import lora_limits

MIGRATIONS: list[list[str]] = [
    [
        """CREATE TABLE IF NOT EXISTS lora_adapters (
            name TEXT PRIMARY KEY,
            base_model TEXT NOT NULL,
            path TEXT NOT NULL,
            rank INTEGER NOT NULL,
            owner TEXT NOT NULL,
            adapter_id BIGINT NOT NULL,
            price_input DOUBLE PRECISION,
            price_cached_input DOUBLE PRECISION,
            price_output DOUBLE PRECISION,
            created_ms BIGINT NOT NULL
        )""",
    ],
]
_COLUMNS = "name, base_model, path, rank, owner, adapter_id, price_input, price_cached_input, price_output, created_ms"
# Adapters per base model at most (each is a row every router reads twice a second).
MAX_ADAPTERS = 1000


def _adapter(row) -> Adapter:
    name, base, path, rank, owner, aid, pi, pc, po, created = row
    price = None if pi is None else Price(float(pi), float(pc), float(po))
    return Adapter(name, base, path, int(rank), owner, int(aid), price, int(created))


def still_served(adapters: Iterable[Adapter]):
    """check(spec) for a deployment file about to be applied (gaas.settings.deployspec.parse_text):
    SpecError, placed in the file, when it would leave a catalogued adapter unservable (its model
    removed, its pool's max_loras 0 or its max_lora_rank below the adapter's rank); nothing changes."""
    by_model: dict[str, list[Adapter]] = {}
    for a in adapters:
        by_model.setdefault(a.base_model, []).append(a)

    def check(spec) -> None:
        names = {m.name for m in spec.models}
        for i, m in enumerate(spec.models):
            mine = by_model.get(m.name)
            if not mine:
                continue
            slots, rank = lora_limits(m.engine)
            listed = ", ".join(a.name for a in mine)
            if not slots:
                raise SpecError(f"{m.name} serves LoRA adapters ({listed}): keep its engine's max_loras above 0, or "
                                "`gaas lora remove` them first", ("models", i, "engine"))
            over = [a for a in mine if a.rank > rank]
            if over:
                raise SpecError(f"{m.name}'s max_lora_rank {rank} is below the rank of its adapter(s) "
                                f"{', '.join(f'{a.name} ({a.rank})' for a in over)}: keep it at "
                                f"{max(a.rank for a in over)} or more, or `gaas lora remove` them first",
                                ("models", i, "engine", "max_lora_rank"))
        gone = sorted(set(by_model) - names)
        if gone:
            raise SpecError(f"{', '.join(gone)} serve(s) LoRA adapters ({', '.join(a.name for g in gone for a in by_model[g])}): "
                            "keep the model, or `gaas lora remove` them first", ("models",))

    return check


def names_apart(adapters: Iterable[Adapter]):
    """check(spec) for a deployment file about to be applied: SpecError, placed at the entry's name,
    when a model would take a catalogued adapter's name (adapters and models share one namespace: a
    request names either, and one name must mean one set of weights and one price)."""
    by_name = {a.name: a for a in adapters}

    def check(spec) -> None:
        for i, m in enumerate(spec.models):
            if (a := by_name.get(m.name)) is not None:
                owner = f"tenant {a.owner}'s" if a.owner else "public"
                raise SpecError(f"model {m.name} would take the name of LoRA adapter {a.name} (on {a.base_model}, "
                                f"{owner}): models and adapters share one namespace; rename the model, or `gaas lora "
                                f"remove {a.name}` first", ("models", i, "name"))

    return check


def apply_checks(adapters: Iterable[Adapter]):
    """Every check of a deployment file against the catalogued adapters (names_apart, still_served)."""
    adapters = list(adapters)
    checks = (names_apart(adapters), still_served(adapters))

    def check(spec) -> None:
        for c in checks:
            c(spec)

    return check


def serving_limits(pools: Iterable[Mapping]) -> tuple[int, int]:
    """(pools whose engine serves adapters, the lowest max_lora_rank among them) of a model's pools."""
    limits = [lora_limits(p.get("engine") or {}) for p in pools]
    ranks = [rank for slots, rank in limits if slots > 0]
    return len(ranks), min(ranks, default=0)


class AdapterStore:
    def __init__(self, db: Database, clock=time.time) -> None:
        self._db = db
        self._clock = clock

    async def init_schema(self) -> None:
        await migrate(self._db, "control-adapters", MIGRATIONS)

    async def add(self, a: Adapter, *, models: Mapping[str, tuple[str, list[Mapping]]], tenants: set[str]) -> Adapter:
        """Catalogue adapter a after every check. models: each deployed model's weights directory
        and its serving pools (their engine settings); tenants: the tenants that exist."""
        contract.check_name(a.name)
        if a.name in models:
            raise errors.AlreadyExists(f"{errors.quote(a.name)} is a model's name; give the adapter another",
                                       param="name")
        if a.base_model not in models:
            raise errors.NotFound(f"base model {errors.quote(a.base_model)} is not deployed (deployed: "
                                  f"{', '.join(sorted(models)) or 'none'})", param="base_model")
        if a.owner and a.owner not in tenants:
            raise errors.NotFound(f"no tenant {errors.quote(a.owner)} to own the adapter; `gaas tenant list` shows "
                                  "them (or add it --public)", param="owner")
        if a.price is not None and min(a.price.input, a.price.cached_input, a.price.output) < 0:
            raise errors.InvalidArgument("an adapter's prices must be 0 or more (USD per 1M tokens)", param="price")
        source, pools = models[a.base_model]
        serving, max_rank = serving_limits(pools)
        if not serving:
            raise errors.FailedPrecondition(
                f"model {errors.quote(a.base_model)}'s workers serve no LoRA adapters: set engine: {{max_loras: 2}} "
                "(and max_lora_rank) in its entry of the deployment file and `gaas apply` it", param="base_model")
        if not a.path.startswith("/"):
            raise errors.InvalidArgument("the adapter's path must be absolute (the directory the workers read)",
                                         param="path")
        try:
            found = await asyncio.to_thread(lora.read_adapter, Path(a.path))
            await asyncio.to_thread(lora.check_fits, found, Path(source), max_rank)
        except lora.AdapterError as exc:
            raise errors.InvalidArgument(f"adapter {a.name!r} cannot serve on {a.base_model}: {exc}",
                                         param="path") from None
        count = await self._db.execute("SELECT COUNT(*) FROM lora_adapters WHERE base_model = ?", (a.base_model,))
        if count and int(count[0][0]) >= MAX_ADAPTERS:
            raise errors.ResourceExhausted(f"{a.base_model} has {MAX_ADAPTERS} adapters, the most catalogued; remove "
                                           "some first", param="name")
        created = int(self._clock() * 1000)
        added = Adapter(a.name, a.base_model, a.path, found.rank, a.owner, contract.engine_id(a.name, created),
                        a.price, created)
        p = added.price

        def insert(execute) -> bool:
            if execute("SELECT 1 FROM lora_adapters WHERE name = ?", (added.name,)):
                return False
            execute(f"INSERT INTO lora_adapters ({_COLUMNS}) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
                    (added.name, added.base_model, added.path, added.rank, added.owner, added.adapter_id,
                     None if p is None else p.input, None if p is None else p.cached_input,
                     None if p is None else p.output, added.created_ms))
            return True

        if not await self._db.run(insert):
            raise errors.AlreadyExists(f"adapter {errors.quote(a.name)} exists; `gaas lora remove {a.name}` first to "
                                       "replace it", param="name")
        return added

    async def list(self, base_model: str = "") -> list[Adapter]:
        query, params = f"SELECT {_COLUMNS} FROM lora_adapters", ()
        if base_model:
            query, params = query + " WHERE base_model = ?", (base_model,)
        return [_adapter(row) for row in await self._db.execute(query + " ORDER BY base_model, name", params)]

    async def remove(self, name: str) -> Adapter:
        rows = await self._db.execute(f"SELECT {_COLUMNS} FROM lora_adapters WHERE name = ?", (name,))
        if not rows:
            raise errors.NotFound(f"no adapter {errors.quote(name)}; `gaas lora list` shows them", param="name")
        await self._db.execute("DELETE FROM lora_adapters WHERE name = ?", (name,))
        return _adapter(rows[0])
