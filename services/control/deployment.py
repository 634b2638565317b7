"""The deployment the control plane runs, in SQL so that every control replica (and a restarted
one) runs the same: the numbered revisions of what was applied, each model version's pool, each
model's stable version, and its roll-outs (services/control/rollout/machine.py, persisted as JSON).

From them: the pools of workers to run now (what `gaas up`, or any launcher, reconciles its workers
with), and each model's versions and split (what routers apply). What an apply changes is
services/control/deployplan.py's; the roll-outs are driven by services/control/rollout/driver.py.
No grpc here."""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path

from gaas.contracts import errors
from gaas.contracts.autoscale import AutoscalePolicy
from gaas.contracts.rollout import Split, State
from gaas.runtime.sql import Database
from gaas.settings.deployspec import DeploySpec, ModelSpec, parse_text, root_of
from services.control.catalog import ModelCatalog
from services.control.deployplan import Change, Current, Plan, plan, sections_of
from services.control.deploytables import SCHEMA
from services.control.rollout.machine import Decision, Rollout

log = logging.getLogger(__name__)

# Scale decisions kept per pool (the oldest go).
DECISIONS_KEPT = 200

# Roles of a version's pool.
STABLE, CANARY, KEPT = "stable", "canary", "kept"

# What `gaas up`'s start-up apply is recorded as (a file applied again only when it changed since).
STARTUP = "gaas up"


@dataclass(frozen=True, slots=True)
class Pool:
    """A version's workers, as a launcher runs them."""

    model: str
    version: str
    # ModelSpec.pool(): source, preset, seed, max_model_len, replicas, engine, device, tenants,
    # autoscale (replicas: for an autoscaled pool, what its autoscaler decided).
    spec: Mapping
    role: str
    # An autoscaled pool's last decision: why it has its replicas ("" none yet, or not autoscaled).
    reason: str = ""

    @property
    def autoscale(self) -> AutoscalePolicy | None:
        a = self.spec.get("autoscale")
        return AutoscalePolicy.from_dict(a) if a else None


@dataclass(frozen=True, slots=True)
class Served:
    """One model as routers see it: its versions with workers and the split between them."""

    model: ModelSpec
    # Version -> its pool (ModelSpec.pool()), and its role.
    versions: Mapping[str, Mapping]
    roles: Mapping[str, str]
    split: Split


@dataclass(slots=True)
class View:
    """The deployment as of one read of SQL."""

    revision: int = 0
    spec: DeploySpec | None = None
    models: dict[str, ModelSpec] = field(default_factory=dict)
    stable: dict[str, str] = field(default_factory=dict)
    pools: dict[tuple[str, str], dict] = field(default_factory=dict)
    live: dict[str, Rollout] = field(default_factory=dict)
    # Rollout id of each live roll-out.
    ids: dict[str, int] = field(default_factory=dict)
    # (model, version) -> an autoscaled pool's workers as last decided, and why.
    scale: dict[tuple[str, str], tuple[int, str]] = field(default_factory=dict)

    def current(self) -> Current:
        return Current(models=self.models, stable=self.stable, rolling={m: r.version for m, r in self.live.items()},
                       pools=self.pools, sections=sections_of(self.spec) if self.spec else {})


def _root(file: str) -> Path:
    return root_of(file) if file else Path.cwd()


class Deployment:
    def __init__(self, db: Database, catalog: ModelCatalog, check_source: Callable[[ModelSpec], str | None],
                 clock: Callable[[], float] = time.time) -> None:
        self._db = db
        self._catalog = catalog
        self._check_source = check_source
        self._clock = clock
        self._lock = asyncio.Lock()
        # The parsed spec of each revision's file (parsing once).
        self._specs: dict[int, DeploySpec] = {}
        # Told after each change made here (the servicer's caches, the rollout driver).
        self.on_change: list[Callable[[], None]] = []
        # The tiers' quotas and targets as last applied (None before the first).
        self.qos: dict | None = None

    async def init_schema(self) -> None:
        for statement in SCHEMA:
            await self._db.execute(statement)

    # ------------------------------------------------------------------ reading

    async def view(self) -> View:
        return await self._db.run(self._read)

    def _read(self, execute) -> View:
        v = View()
        rows = execute("SELECT number, file, text, models FROM deploy_revisions ORDER BY number DESC LIMIT 1")
        if not rows:
            return v
        number, file, text, models = rows[0]
        v.revision = int(number)
        v.spec = self._spec(v.revision, file, text)
        declared = tuple(ModelSpec.from_dict(d) for d in json.loads(models))
        v.spec = v.spec.with_models(declared)
        v.models = {m.name: m for m in declared}
        v.stable = {m: ver for m, ver in execute("SELECT model, version FROM deploy_stable")}
        v.pools = {(m, ver): json.loads(p) for m, ver, p in execute("SELECT model, version, pool FROM deploy_pools")}
        for rid, model, data in execute("SELECT id, model, data FROM rollouts WHERE live = 1"):
            v.live[model] = Rollout.from_dict(json.loads(data))
            v.ids[model] = int(rid)
        v.scale = {(m, ver): (int(n), reason) for m, ver, n, reason in
                   execute("SELECT model, version, replicas, reason FROM pool_scale")}
        return v

    def _spec(self, number: int, file: str, text: str) -> DeploySpec:
        spec = self._specs.get(number)
        if spec is None:
            spec = parse_text(text, _root(file), file)
            self._specs = {number: spec}
        return spec

    async def served(self, view: View | None = None) -> list[Served]:
        """Every declared model with the versions that have workers and its split."""
        v = view or await self.view()
        out = []
        for name, m in v.models.items():
            stable = v.stable.get(name, m.version)
            live = v.live.get(name)
            roles = {stable: STABLE}
            if live is not None and not live.state.ended:
                roles[live.version] = CANARY
            for version in m.pins.values():
                if version not in roles and (name, version) in v.pools:
                    roles[version] = KEPT
            versions = {ver: v.pools.get((name, ver)) or m.pool() for ver in roles}
            split = live.split() if live is not None else Split(name, stable=stable)
            split = replace(
                split,
                pins={t: ver for t, ver in m.pins.items() if ver in roles},
                kept=tuple(ver for ver, r in roles.items() if r == KEPT),
                tenants={ver: frozenset(p.get("tenants") or ()) for ver, p in versions.items() if p.get("tenants")},
            )
            out.append(Served(m, versions, roles, split))
        return out

    async def pools(self, view: View | None = None) -> list[Pool]:
        """The pools of workers to run now: each served model's stable version, a live roll-out's new
        version, and versions kept for pinned tenants."""
        v = view or await self.view()
        out = []
        for s in await self.served(v):
            if not s.model.serves:
                continue
            for version, role in s.roles.items():
                spec = s.versions[version]
                if role == STABLE and version == s.model.version:
                    spec = s.model.pool()  # the declared replicas
                reason = ""
                if spec.get("autoscale"):
                    policy = AutoscalePolicy.from_dict(spec["autoscale"])
                    replicas, reason = v.scale.get((s.model.name, version), (policy.initial, ""))
                    spec = {**spec, "replicas": max(policy.min, min(policy.max, replicas))}
                out.append(Pool(s.model.name, version, spec, role, reason))
        return out

    async def scaled(self, model: str, version: str, replicas: int, reason: str) -> None:
        """An autoscaled pool's new count of workers (what ListPools tells launchers), and why."""
        at = int(self._clock() * 1000)

        def write(execute) -> None:
            execute("DELETE FROM pool_scale WHERE model = ? AND version = ?", (model, version))
            execute("INSERT INTO pool_scale (model, version, replicas, reason, at_ms) VALUES (?, ?, ?, ?, ?)",
                    (model, version, replicas, reason[:500], at))
            execute("INSERT INTO scale_decisions (model, version, replicas, reason, at_ms) VALUES (?, ?, ?, ?, ?)",
                    (model, version, replicas, reason[:500], at))
            rows = execute("SELECT at_ms FROM scale_decisions WHERE model = ? AND version = ? ORDER BY at_ms DESC "
                           f"LIMIT 1 OFFSET {DECISIONS_KEPT}", (model, version))
            if rows:
                execute("DELETE FROM scale_decisions WHERE model = ? AND version = ? AND at_ms <= ?",
                        (model, version, rows[0][0]))

        await self._db.run(write)
        self._changed()

    async def scale_decisions(self, model: str = "", limit: int = 50) -> list[dict]:
        """The autoscalers' latest decisions, newest first (model: only its pools')."""
        where, args = ("WHERE model = ?", (model,)) if model else ("", ())
        rows = await self._db.execute(
            f"SELECT model, version, replicas, reason, at_ms FROM scale_decisions {where} ORDER BY at_ms DESC "
            f"LIMIT {int(limit)}", args)
        return [{"model": m, "version": v, "replicas": int(n), "reason": r, "at_ms": int(at)} for m, v, n, r, at in rows]

    async def revisions(self, model: str = "") -> list[dict]:
        rows = await self._db.execute(
            "SELECT number, applied_ms, origin, digest, changes FROM deploy_revisions ORDER BY number")
        out = []
        for number, at, origin, digest, changes in rows:
            lines = json.loads(changes)
            if model and not any(line.split(":", 1)[0] == model for line in lines):
                continue
            out.append({"number": int(number), "applied_ms": int(at), "origin": origin, "digest": digest,
                        "changes": lines})
        return out

    async def rollout(self, model: str) -> tuple[Rollout | None, int]:
        """The model's live roll-out, else its last one (None when it never had one), and its id."""
        rows = await self._db.execute(
            "SELECT id, data FROM rollouts WHERE model = ? ORDER BY live DESC, id DESC LIMIT 1", (model,))
        if not rows:
            return None, 0
        return Rollout.from_dict(json.loads(rows[0][1])), int(rows[0][0])

    async def failures(self, model: str, version: str, since_ms: int) -> list[str]:
        rows = await self._db.execute(
            "SELECT reason, worker FROM pool_failures WHERE model = ? AND version = ? AND at_ms >= ? ORDER BY at_ms",
            (model, version, since_ms))
        return [f"{w + ': ' if w else ''}{r}" for r, w in rows]

    # ------------------------------------------------------------------ applying

    async def apply_file(self, text: str, file: str, origin: str, dry_run: bool = False,
                         check=None) -> tuple[int, list[Change]]:
        """Apply a deployment file's text: (the revision made, or 0, and what changed). SpecError for
        a malformed file (or one check(spec) refuses), errors.* for a change that cannot be made;
        nothing changes then."""
        spec = parse_text(text, _root(file), file, check)
        return await self.apply(spec, file, origin, dry_run)

    async def apply(self, spec: DeploySpec, file: str, origin: str, dry_run: bool = False) -> tuple[int, list[Change]]:
        async with self._lock:
            view = await self.view()
            p = plan(view.current(), spec, self._check_source)
            if dry_run or not p.changed:
                return 0, p.changes
            number = await self._db.run(lambda execute: self._write(execute, view, spec, file, origin, p))
            log.info("applied revision %d (%s): %s", number, origin, "; ".join(c.line() for c in p.changes))
        await self._sync_catalog()
        self._changed()
        return number, p.changes

    async def startup(self, spec: DeploySpec, file: str) -> int:
        """At control's start: the deployment file applied when it changed since `gaas up` last
        applied it from there (what `gaas apply` did since stays otherwise). Returns the revision (0: none)."""
        rows = await self._db.execute(
            "SELECT digest FROM deploy_revisions WHERE file = ? AND origin = ? ORDER BY number DESC LIMIT 1",
            (file, STARTUP))
        view = await self.view()
        if rows and rows[0][0] == spec.digest and view.revision:
            await self._sync_catalog()
            return 0
        try:
            number, _ = await self.apply(spec, file, STARTUP)
        except errors.GaasError as exc:
            log.warning("the deployment file %s was not applied: %s; the mesh runs what was applied before", file, exc)
            await self._sync_catalog()
            return 0
        if not number:
            # Same models as running: remember the file as applied all the same.
            await self._db.transaction([self._revision_row(view.revision + 1, file, STARTUP, spec,
                                                           [m.as_dict() for m in view.models.values()], [])])
        return number

    async def startup_without_file(self) -> None:
        """At a start with no deployment file: what was applied before."""
        await self._sync_catalog()

    def _revision_row(self, number: int, file: str, origin: str, spec: DeploySpec, models: list[dict],
                      changes: list[str]) -> tuple[str, tuple]:
        return ("INSERT INTO deploy_revisions (number, applied_ms, origin, file, digest, text, models, changes) "
                "VALUES (?, ?, ?, ?, ?, ?, ?, ?)",
                (number, int(self._clock() * 1000), origin, file, spec.digest, spec.text, json.dumps(models),
                 json.dumps(changes)))

    def _write(self, execute, view: View, spec: DeploySpec, file: str, origin: str, p: Plan) -> int:
        number = view.revision + 1
        now = self._clock()
        q, args = self._revision_row(number, file, origin, spec, [m.as_dict() for m in spec.models],
                                     [c.line() for c in p.changes])
        execute(q, args)
        for (model, version), pool in p.pools.items():
            execute("DELETE FROM deploy_pools WHERE model = ? AND version = ?", (model, version))
            execute("INSERT INTO deploy_pools (model, version, pool) VALUES (?, ?, ?)", (model, version, json.dumps(pool)))
        for model, version in p.stable.items():
            execute("DELETE FROM deploy_stable WHERE model = ?", (model,))
            execute("INSERT INTO deploy_stable (model, version) VALUES (?, ?)", (model, version))
        for model in p.removed:
            execute("DELETE FROM deploy_stable WHERE model = ?", (model,))
            if model in view.live:
                r = view.live[model]
                r.undo(now)
                self._save(execute, view.ids[model], r, live=False)
        for model in p.undo:
            r = view.live[model]
            r.undo(now)
            self._save(execute, view.ids[model], r, live=False)
        by_name = {m.name: m for m in spec.models}
        for model, r in view.live.items():
            # A live roll-out the file keeps going takes its model's policy as the file says it now.
            if model in by_name and model not in p.undo and model not in p.removed and r.version == by_name[model].version:
                if r.adopt(by_name[model].rollout, now) is not None:
                    self._save(execute, view.ids[model], r, live=True)
        for model, (stable, version) in p.rollouts.items():
            r = Rollout(model, stable, version, by_name[model].rollout, now)
            rid = self._next_id(execute)
            execute("INSERT INTO rollouts (id, model, version, live, revision, data, updated_ms) VALUES (?, ?, ?, 1, ?, ?, ?)",
                    (rid, model, version, number, json.dumps(r.as_dict()), int(now * 1000)))
        return number

    @staticmethod
    def _next_id(execute) -> int:
        rows = execute("SELECT MAX(id) FROM rollouts")
        return int(rows[0][0] or 0) + 1

    def _save(self, execute, rid: int, r: Rollout, live: bool) -> None:
        execute("UPDATE rollouts SET data = ?, live = ?, updated_ms = ? WHERE id = ?",
                (json.dumps(r.as_dict()), 1 if live else 0, int(self._clock() * 1000), rid))

    async def _sync_catalog(self) -> None:
        """The catalogue (what `gaas models` lists, and prices) as the deployment declares it, each
        model at its stable version."""
        view = await self.view()
        if view.spec is None:
            return
        self.qos = view.spec.qos or None
        models = []
        for m in view.spec.models:
            stable = view.stable.get(m.name, m.version)
            models.append(m if stable == m.version or (m.name, stable) not in view.pools
                          else m.at(view.pools[(m.name, stable)]))
        await self._catalog.apply(view.spec.with_models(tuple(models)))

    def _changed(self) -> None:
        for fn in self.on_change:
            fn()

    # ------------------------------------------------------------------ roll-outs

    async def step(self, model: str, version: str, tick: Callable[[Rollout], Decision | None]) -> Decision | None:
        """One look of the driver's at a model's live roll-out to version: tick(rollout) on its
        state as stored now (an operator's command meanwhile is not lost), the decision saved, an
        end finished (promoted: the new version is the stable one; rolled back or halted: the model
        is declared at its stable version again, in a new revision that says why)."""
        async with self._lock:
            view = await self.view()
            r = view.live.get(model)
            if r is None or r.version != version:
                return None  # undone or replaced meanwhile
            decision = tick(r)
            if decision is None:
                return None
            await self._db.run(lambda execute: self._finish(execute, view, model, view.ids[model], r, decision))
        if r.state.ended:
            await self._sync_catalog()
        self._changed()
        return decision

    def _finish(self, execute, view: View, model: str, rid: int, r: Rollout, decision: Decision) -> None:
        self._save(execute, rid, r, live=not r.state.ended)
        if r.state is State.PROMOTED:
            execute("DELETE FROM deploy_stable WHERE model = ?", (model,))
            execute("INSERT INTO deploy_stable (model, version) VALUES (?, ?)", (model, r.version))
            log.info("%s %s promoted: it is the stable version (%s drains)", model, r.version, r.stable)
        elif r.state in (State.ROLLED_BACK, State.HALTED):
            # The model is declared at its stable version again (a new revision says why), so the
            # file that named the new version rolls it out again when applied again.
            self._declare_stable(execute, view, model, r.stable, f"control: {decision.reason}")
            log.warning("%s %s %s: %s", model, r.version, r.state, decision.reason)

    def _declare_stable(self, execute, view: View, model: str, stable: str, origin: str) -> None:
        declared = view.models[model]
        pool = view.pools.get((model, stable))
        back = declared.at(pool) if pool else replace(declared, version=stable)
        models = [back.as_dict() if m.name == model else m.as_dict() for m in view.models.values()]
        rows = execute("SELECT file, text FROM deploy_revisions WHERE number = ?", (view.revision,))
        file, text = rows[0]
        execute("INSERT INTO deploy_revisions (number, applied_ms, origin, file, digest, text, models, changes) "
                "VALUES (?, ?, ?, ?, ?, ?, ?, ?)",
                (view.revision + 1, int(self._clock() * 1000), origin, file, view.spec.digest if view.spec else "",
                 text, json.dumps(models), json.dumps([f"{model}: rollback: {declared.version} -> {stable}"])))

    async def change(self, model: str, action: str, to_revision: int = 0) -> Rollout:
        """The operator's command on a model's roll-out: pause, resume, promote, undo."""
        if action not in ("pause", "resume", "promote", "undo"):
            raise errors.InvalidArgument(f"unknown roll-out action {action!r}: pause, resume, promote or undo",
                                         param="action")
        now = self._clock()
        async with self._lock:
            view = await self.view()
            if model not in view.models:
                raise errors.NotFound(f"model {errors.quote(model)} is not deployed; `gaas models` lists them",
                                      param="model")
            r = view.live.get(model)
            if r is None:
                if action != "undo":
                    last, _ = await self.rollout(model)
                    said = f" (its last one {last.state})" if last else ""
                    raise errors.FailedPrecondition(f"{model} has no roll-out under way{said}; nothing to {action}")
                undo_to = await self._previous_version(view, model, to_revision)
            else:
                if to_revision:
                    raise errors.FailedPrecondition(
                        f"{model}'s roll-out to {r.version} is under way: `gaas rollout undo {model}` rolls it back; "
                        "--to-revision goes back to an earlier revision's version once no roll-out is under way")
                getattr(r, action)(now)
                decision = r.decisions[-1]
                await self._db.run(lambda execute: self._finish(execute, view, model, view.ids[model], r, decision))
                undo_to = None
        if undo_to is not None:
            # An ended roll-out undone: the model's earlier version rolled out again.
            m = view.models[model]
            target = m.at(view.pools[(model, undo_to)])
            spec = view.spec.with_models(tuple(target if x.name == model else x for x in view.spec.models))
            rows = await self._db.execute("SELECT file FROM deploy_revisions WHERE number = ?", (view.revision,))
            await self.apply(spec, rows[0][0], f"gaas rollout undo {model}" + (f" --to-revision {to_revision}"
                                                                               if to_revision else ""))
            r, _ = await self.rollout(model)
            return r
        await self._sync_catalog()
        self._changed()
        return r

    async def _previous_version(self, view: View, model: str, to_revision: int) -> str:
        rows = await self._db.execute("SELECT number, models FROM deploy_revisions ORDER BY number DESC")
        current = view.stable.get(model)
        for number, models in rows:
            if to_revision and int(number) != to_revision:
                continue
            version = next((d["version"] for d in json.loads(models) if d["name"] == model), None)
            if to_revision:
                if version is None:
                    raise errors.NotFound(f"revision {to_revision} does not declare {model}", param="to_revision")
                if version == current:
                    raise errors.FailedPrecondition(f"{model} is at {version}, revision {to_revision}'s version, already")
                return version
            if version is not None and version != current and (model, version) in view.pools:
                return version
        if to_revision:
            raise errors.NotFound(f"there is no revision {to_revision}; `gaas rollout history` lists them",
                                  param="to_revision")
        raise errors.FailedPrecondition(f"{model} has served no other version to go back to")

    async def report_failure(self, model: str, version: str, reason: str, worker: str = "") -> None:
        await self._db.execute(
            "INSERT INTO pool_failures (model, version, reason, worker, at_ms) VALUES (?, ?, ?, ?, ?)",
            (model, version, reason[:2000], worker, int(self._clock() * 1000)))
        self._changed()

