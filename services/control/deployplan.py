"""What applying a deployment file changes (`gaas apply`, `gaas diff`, and `gaas up` when the file
changed): the file's models against what the control plane runs now, as the changes an operator
reads and the steps control takes. Pure: the current state comes in, a Plan goes out; nothing
changes when a change is refused.

Per model:
  - a new model is added at its version (no roll-out: nothing served it before);
  - a model left out is removed (its workers drain; a live roll-out of it ends);
  - a new version of a served model is rolled out from the stable one by the model's rollout
    policy; while a roll-out is live, the file may name its new version (nothing to do) or the stable
    one (the roll-out is undone), nothing else;
  - the same version: replicas (or autoscale) scale, tenants, pins and the rollout policy change at once; what its
    workers run with (source, engine, device, max_model_len) needs a new version while it has any.
Sections other than models: prices take effect at once (routers read them from control); qos,
sessions and the Stripe meters are read by routers and billing when they start.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace

from gaas.contracts import errors
from gaas.settings.deployspec import DeploySpec, ModelSpec

# What a worker of a version runs with: changing it needs a new version while the version has workers.
RUNS_WITH = ("source", "preset", "seed", "engine", "device", "device_needs", "max_model_len")


@dataclass(frozen=True, slots=True)
class Change:
    # The model, or the section, it is about.
    subject: str
    # added, removed, rollout, undo, scaled, changed.
    kind: str
    detail: str

    def line(self) -> str:
        return f"{self.subject}: {self.kind}: {self.detail}"


@dataclass(frozen=True, slots=True)
class Current:
    """What the control plane runs now."""

    # The models as declared (a roll-out's model at its new version).
    models: Mapping[str, ModelSpec]
    # Model -> the version that serves all new requests (but a live roll-out's share).
    stable: Mapping[str, str]
    # Model -> the version a live roll-out takes it to.
    rolling: Mapping[str, str] = field(default_factory=dict)
    # (model, version) -> that version's pool as last declared (gaas.settings.deployspec.ModelSpec.pool).
    pools: Mapping[tuple[str, str], Mapping] = field(default_factory=dict)
    # The other sections as declared (qos, prices, sessions, meters), to tell what changed.
    sections: Mapping[str, object] = field(default_factory=dict)


@dataclass(slots=True)
class Plan:
    changes: list[Change] = field(default_factory=list)
    # The models as declared once applied.
    models: tuple[ModelSpec, ...] = ()
    # Model -> its stable version from now (a model added, or one with no workers whose version changed).
    stable: dict[str, str] = field(default_factory=dict)
    # Roll-outs to start: model -> (from the stable version, to the new one).
    rollouts: dict[str, tuple[str, str]] = field(default_factory=dict)
    # Models whose live roll-out the file takes back (it names the stable version again).
    undo: list[str] = field(default_factory=list)
    # Models left out (their pools drain, a live roll-out of theirs ends).
    removed: list[str] = field(default_factory=list)
    # Pools to record (model, version) -> pool.
    pools: dict[tuple[str, str], dict] = field(default_factory=dict)

    @property
    def changed(self) -> bool:
        return bool(self.changes)


def sections_of(spec: DeploySpec) -> dict[str, object]:
    """The sections other than models, comparable between two files."""
    return {"prices": repr(sorted((t, sorted(p.items())) for t, p in spec.prices.items())),
            "meters": repr(sorted(spec.meters.items())), "qos": repr(sorted(spec.qos.items())),
            "sessions": repr(spec.sessions), "batches": repr(spec.batches)}


def _workers(m: ModelSpec) -> str:
    if (a := m.autoscale) is not None:
        start = f", starting at {a.initial_scale}" if a.initial_scale is not None else ""
        return f"{a.min}-{a.max} workers on load ({a.target_requests:g} requests each{start})"
    if m.replicas == "auto":
        return "auto workers"
    return f"{m.replicas} worker{'s' if m.replicas != 1 else ''}" if m.replicas else "no workers (catalogued)"


def _strategy(m: ModelSpec) -> str:
    r = m.rollout
    if r.strategy == "canary":
        return f"canary {' -> '.join(f'{s}%' for s in r.steps)}, each step held {r.hold_s:.0f} s"
    if r.strategy == "shadow":
        return f"shadow ({r.shadow}% of requests copied to it) until promoted, then canary"
    return "blue-green (switched at once when ready, the old version kept warm until promoted)"


def plan(current: Current, new: DeploySpec, check_source: Callable[[ModelSpec], str | None]) -> Plan:
    """The changes applying new makes; errors.FailedPrecondition or InvalidArgument (nothing
    applied) for what cannot be. check_source: what is wrong with a version's weights (None: fine)."""
    out = Plan(models=new.models)
    for m in new.models:
        cur = current.models.get(m.name)
        _check_pins(current, m)
        if cur is None:
            _need_source(m, check_source)
            out.stable[m.name] = m.version
            out.pools[(m.name, m.version)] = m.pool()
            out.changes.append(Change(m.name, "added", f"version {m.version}, {_workers(m)}"))
            continue
        stable = current.stable.get(m.name, cur.version)
        rolling = current.rolling.get(m.name)
        if rolling is not None and m.version not in (rolling, stable):
            raise errors.FailedPrecondition(
                f"{m.name}: a roll-out from {stable} to {rolling} is under way; the file may name {rolling} (to let "
                f"it go on) or {stable} (to undo it), not {m.version}: `gaas rollout promote {m.name}` or `gaas rollout "
                f"undo {m.name}` first")
        if rolling is not None and m.version == rolling and m.rollout.strategy != cur.rollout.strategy:
            raise errors.FailedPrecondition(
                f"{m.name}: the roll-out to {rolling} is a {cur.rollout.strategy}; its strategy cannot change under way "
                f"(`gaas rollout promote {m.name}` or `gaas rollout undo {m.name}` first)")
        if rolling is not None and m.version == stable:
            out.undo.append(m.name)
            out.changes.append(Change(m.name, "undo", f"the roll-out to {rolling} is undone; {stable} keeps serving"))
            _same_version(out, current.models[m.name].at(current.pools[(m.name, stable)])
                          if (m.name, stable) in current.pools else cur, m, served=True)
            continue
        if m.version != cur.version:
            # No live roll-out (cur.version is the stable one).
            if cur.serves and m.serves:
                _need_source(m, check_source)
                out.rollouts[m.name] = (stable, m.version)
                out.pools[(m.name, m.version)] = m.pool()
                out.changes.append(Change(m.name, "rollout", f"{stable} -> {m.version} ({_workers(m)}): {_strategy(m)}"))
            else:
                if m.serves:
                    _need_source(m, check_source)
                out.stable[m.name] = m.version
                out.pools[(m.name, m.version)] = m.pool()
                out.changes.append(Change(m.name, "changed", f"version {cur.version} -> {m.version} (nothing served "
                                                             f"{cur.version}: no roll-out), {_workers(m)}"))
            _settings(out, cur, m)
            continue
        if not cur.serves and m.serves:
            _need_source(m, check_source)
        _same_version(out, cur, m, served=cur.serves)
    for name in current.models:
        if all(m.name != name for m in new.models):
            out.removed.append(name)
            live = current.rolling.get(name)
            out.changes.append(Change(name, "removed", "its workers drain" + (f"; the roll-out to {live} ends" if live else "")))
    new_sections = sections_of(new)
    for section, value in new_sections.items():
        if current.sections and current.sections.get(section) != value:
            when = ("at once (routers read prices from control)" if section == "prices" else
                    "when routers restart (gaas restart router)" if section in ("qos", "sessions") else
                    "when billing restarts (gaas restart billing)")
            out.changes.append(Change(section, "changed", f"takes effect {when}"))
    return out


def _same_version(out: Plan, cur: ModelSpec, m: ModelSpec, served: bool) -> None:
    """cur and m at the same version: what changes at once, and what would need a new version."""
    differs = [k for k in RUNS_WITH if cur.pool()[k] != m.pool()[k]]
    if differs and served and cur.serves:
        raise errors.FailedPrecondition(
            f"{m.name} {m.version}: its workers run with its {', '.join(differs)} as applied; a change of "
            f"{', '.join(differs)} needs a new version (change `version:` and it is rolled out)")
    scaled = cur.replicas != m.replicas or cur.autoscale != m.autoscale
    if differs or scaled:
        out.pools[(m.name, m.version)] = m.pool()
    if scaled:
        out.changes.append(Change(m.name, "scaled", f"{m.version}: {_workers(cur)} -> {_workers(m)}"))
    if differs:
        out.changes.append(Change(m.name, "changed", f"{m.version}: {', '.join(differs)}"))
    _settings(out, cur, m)


def _settings(out: Plan, cur: ModelSpec, m: ModelSpec) -> None:
    """What takes effect at once whatever the version: tenants, pins, the roll-out policy, default."""
    if cur.tenants != m.tenants and cur.version == m.version:
        out.changes.append(Change(m.name, "changed", f"tenants: {', '.join(m.tenants) or 'every tenant'}"))
    if dict(cur.pins) != dict(m.pins):
        pins = ", ".join(f"{t} -> {v}" for t, v in sorted(m.pins.items())) or "none"
        out.changes.append(Change(m.name, "changed", f"pins: {pins}"))
    if cur.rollout != m.rollout and cur.version == m.version:
        if cur.rollout.guard != m.rollout.guard and replace(cur.rollout, guard=m.rollout.guard) == m.rollout:
            g = m.rollout.guard
            targets = ", ".join(f"{t} {ms:.0f} ms" for t, ms in sorted(g.ttft_targets_ms.items()))
            out.changes.append(Change(m.name, "changed", f"rollout guard: TTFT p95 targets {targets}, window "
                                                         f"{g.window_s:.0f} s"))
        else:
            out.changes.append(Change(m.name, "changed", f"rollout: {_strategy(m)}"))
    if cur.is_default != m.is_default:
        out.changes.append(Change(m.name, "changed", "the default model" if m.is_default else "no longer the default"))


def _need_source(m: ModelSpec, check_source: Callable[[ModelSpec], str | None]) -> None:
    if m.serves and (wrong := check_source(m)):
        raise errors.InvalidArgument(wrong, param="source")


def _check_pins(current: Current, m: ModelSpec) -> None:
    known = {v for (name, v) in current.pools if name == m.name} | {m.version}
    if m.name in current.stable:
        known.add(current.stable[m.name])
    for tenant, version in sorted(m.pins.items()):
        if version not in known:
            raise errors.InvalidArgument(
                f"{m.name}: pins: {tenant} -> {version}, a version {m.name} never served (known: "
                f"{', '.join(sorted(known))})", param="pins")
