"""The declarative deployment file (deploy/gaas.yaml): parsed and checked, with errors that name
the file, the line and the field. Shared by the control plane (which applies it: at start-up, and
on `gaas apply`), `gaas up` and `gaas apply`/`gaas diff`, which check it before sending it.

Each model entry is a pool of workers serving one version of the model: where its weights are,
its engine settings, how many workers (`replicas`), the device they need, which tenants may use it,
the tenants kept on an earlier version (`pins`), how a new version is rolled out when the file
changes the version (`rollout`; gaas.contracts.rollout), and, instead of a fixed `replicas`, how
its pool scales on load (`autoscale`; gaas.contracts.autoscale)."""

from __future__ import annotations

import hashlib
import re
from collections.abc import Hashable, Mapping
from dataclasses import dataclass, field
from pathlib import Path

import yaml

from gaas.contracts.ids import MODEL_NAME_RE
from gaas.contracts.autoscale import AutoscalePolicy
from gaas.contracts.device import DeviceError, DeviceRequirement
from gaas.contracts.rollout import GuardPolicy, RolloutPolicy, Strategy
from gaas.contracts.tenancy import TENANT_NAME_RE, TIERS
from gaas.settings import located, modelsource
from gaas.settings.located import Located

NAME_RE = MODEL_NAME_RE
# A version: what usage records, chunks and `gaas models` show.
VERSION_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._+-]{0,62}")
TENANT_RE = TENANT_NAME_RE

# replicas: auto, as `gaas up` resolves it: one worker per GPU on a GPU host, one on a CPU host
# (`gaas up --workers N`: N).
AUTO = "auto"
# The device a pool's workers need: any (the host's), or a CPU or a GPU host's.
DEVICES = ("any", "cpu", "gpu")

MODEL_FIELDS = ("name", "version", "source", "hub", "preset", "seed", "max_model_len", "default", "replicas",
                "engine", "device", "tenants", "pins", "rollout", "autoscale")
# autoscale's fields: the file's name -> AutoscalePolicy's.
AUTOSCALE_FIELDS = {"min": "min", "max": "max", "target_requests": "target_requests",
                    "target_kv_usage": "target_kv_usage", "up_after_seconds": "up_after_s",
                    "down_after_seconds": "down_after_s", "cooldown_seconds": "cooldown_s",
                    "zero_after_seconds": "zero_after_s", "initial_scale": "initial_scale"}
ROLLOUT_FIELDS = ("strategy", "steps", "hold_seconds", "start_timeout_seconds", "shadow_percent", "guard")
GUARD_FIELDS = ("window_seconds", "ttft_p95_ms", "min_samples", "min_requests", "ttft_tolerance", "error_margin",
                "throughput_tolerance")


class SpecError(ValueError):
    """The deployment file is malformed; the message says where (file, line, field) and what to fix."""

    def __init__(self, message: str, path: tuple[Hashable, ...] = ()) -> None:
        super().__init__(message)
        self.path = tuple(path)


@dataclass(frozen=True, slots=True)
class ModelSpec:
    # Name clients ask for.
    name: str
    # Version string shown in usage records and chunks; a new one rolls out (rollout below).
    version: str
    # Local directory (absolute after loading) or a hub id (gaas.settings.modelsource).
    source: str
    # `gaas model build` preset that produces source when it is missing; "" for none. seed: the
    # random weights' seed it builds with (another seed, another model of the same shape).
    preset: str
    # Longest prompt + completion, in tokens.
    max_model_len: int
    # Served when a request names no model.
    is_default: bool
    seed: int = 0
    # Workers serving this version: a number (0: catalogued, not served) or AUTO.
    replicas: int | str = 0
    # Engine settings of its workers beyond the topology's services.worker defaults
    # (gaas.settings.worker.TOPOLOGY_OPTIONS).
    engine: Mapping[str, object] = field(default_factory=dict)
    # The device its workers need (DEVICES).
    device: str = "any"
    # The only tenants that may use it (empty: every tenant).
    tenants: tuple[str, ...] = ()
    # Tenant -> the version it is kept on (this one, or one the model served before).
    pins: Mapping[str, str] = field(default_factory=dict)
    # How a new version of the model is rolled out.
    rollout: RolloutPolicy = field(default_factory=RolloutPolicy)
    # How its workers scale on load (None: replicas, fixed).
    autoscale: AutoscalePolicy | None = None
    # What a device must offer its workers beyond its kind (device above): gpu_memory_gib,
    # gpu_models, compute_capability, interconnect, cpu_cores, memory_gib (gaas.contracts.device).
    device_needs: Mapping[str, object] = field(default_factory=dict)

    @property
    def requirement(self) -> DeviceRequirement:
        return DeviceRequirement.parse(dict(self.device_needs) or self.device)

    def pool(self) -> dict:
        """What a worker of this version is started with (the pool control keeps by version)."""
        return {"model": self.name, "version": self.version, "source": self.source, "preset": self.preset,
                "seed": self.seed, "max_model_len": self.max_model_len, "replicas": self.replicas,
                "engine": dict(self.engine), "device": self.device, "tenants": list(self.tenants),
                "autoscale": self.autoscale.as_dict() if self.autoscale else None,
                "device_needs": dict(self.device_needs)}

    def as_dict(self) -> dict:
        """Everything about it, as JSON (what control's revisions keep); from_dict reads it back."""
        return {**self.pool(), "name": self.name, "is_default": self.is_default, "pins": dict(self.pins),
                "rollout": self.rollout.as_dict()}

    @classmethod
    def from_dict(cls, d: Mapping) -> ModelSpec:
        return cls(name=d["name"], version=d["version"], source=d["source"], preset=d.get("preset", ""),
                   max_model_len=int(d["max_model_len"]), is_default=bool(d.get("is_default")),
                   seed=int(d.get("seed", 0)), replicas=d.get("replicas", 0), engine=dict(d.get("engine") or {}),
                   device=d.get("device", "any"), tenants=tuple(d.get("tenants") or ()),
                   pins=dict(d.get("pins") or {}), rollout=RolloutPolicy.from_dict(d["rollout"]),
                   autoscale=AutoscalePolicy.from_dict(d["autoscale"]) if d.get("autoscale") else None,
                   device_needs=dict(d.get("device_needs") or {}))

    def at(self, pool: Mapping) -> ModelSpec:
        """This model as it was declared for another version (pool: that version's, as pool() gave it)."""
        from dataclasses import replace

        return replace(self, version=pool["version"], source=pool["source"], preset=pool.get("preset", ""),
                       seed=int(pool.get("seed", 0)), max_model_len=int(pool["max_model_len"]),
                       replicas=pool.get("replicas", 0), engine=dict(pool.get("engine") or {}),
                       device=pool.get("device", "any"), tenants=tuple(pool.get("tenants") or ()),
                       autoscale=AutoscalePolicy.from_dict(pool["autoscale"]) if pool.get("autoscale") else None,
                       device_needs=dict(pool.get("device_needs") or {}))

    @property
    def serves(self) -> bool:
        """Whether it is to have workers (replicas auto or above 0, or autoscaled: a pool at zero
        is brought back by its first request)."""
        return self.replicas == AUTO or bool(self.replicas) or self.autoscale is not None


# Stripe meter event names per kind of token, unless the deployment file names others.
DEFAULT_METERS = {"input": "gaas_input_tokens", "cached_input": "gaas_cached_input_tokens", "output": "gaas_output_tokens"}


@dataclass(frozen=True, slots=True)
class DeploySpec:
    models: tuple[ModelSpec, ...]
    # USD per 1M tokens by tier, then model (or "*").
    prices: dict = field(default_factory=dict)
    # Stripe meter event name per kind of token (input, cached_input, output).
    meters: dict = field(default_factory=lambda: dict(DEFAULT_METERS))
    # Quotas and service targets per tier (gaas.contracts.qos).
    qos: dict = field(default_factory=dict)
    # Multi-turn sessions: how long they are kept, how their context is shortened (gaas.contracts.sessions).
    sessions: object = None
    # Batches: their price per tier and limits per tenant (gaas.contracts.batches).
    batches: object = None
    # The file's text as written (what control keeps in its revision history), and its digest.
    text: str = ""

    def policy(self, tier: str):
        from gaas.contracts.qos import DEFAULT_POLICIES

        return self.qos.get(tier) or DEFAULT_POLICIES[tier]

    def model(self, name: str) -> ModelSpec:
        for m in self.models:
            if m.name == name:
                return m
        raise SpecError(f"model {name!r} is not in the deployment file (known: {', '.join(self.names())})")

    def names(self) -> list[str]:
        return [m.name for m in self.models]

    @property
    def default_model(self) -> ModelSpec:
        return next((m for m in self.models if m.is_default), self.models[0])

    @property
    def served(self) -> list[ModelSpec]:
        """The models with workers (replicas auto or above 0), the default first."""
        return sorted((m for m in self.models if m.serves), key=lambda m: not m.is_default)

    def with_models(self, models: tuple[ModelSpec, ...]) -> DeploySpec:
        from dataclasses import replace

        return replace(self, models=tuple(models))

    @property
    def digest(self) -> str:
        """Of what it says, not how (comments and layout aside): a file whose digest is unchanged
        applies nothing new."""
        import json

        said = {"models": [m.as_dict() for m in self.models], "prices": repr(sorted(self.prices.items())),
                "meters": sorted(self.meters.items()), "qos": repr(sorted(self.qos.items())),
                "sessions": repr(self.sessions), "batches": repr(self.batches)}
        return hashlib.sha256(json.dumps(said, sort_keys=True).encode()).hexdigest()[:16]


class _Checker:
    """Walks a document, raising SpecError with the path of what is wrong."""

    def __init__(self, root: Path) -> None:
        self.root = root

    @staticmethod
    def fail(path: tuple, message: str):
        raise SpecError(message, path)

    def mapping(self, value: object, path: tuple, known: tuple[str, ...], what: str) -> dict:
        if value is None:
            return {}
        if not isinstance(value, dict):
            self.fail(path, f"{what} must be a mapping with {', '.join(known)}")
        for k in value:
            if k not in known:
                self.fail((*path, k), f"unknown field {k!r}; {what} has {', '.join(known)}")
        return value

    def integer(self, value: object, path: tuple, what: str, minimum: int | None = None) -> int:
        if isinstance(value, bool) or not isinstance(value, int):
            try:
                if isinstance(value, bool) or isinstance(value, float):
                    raise ValueError
                value = int(str(value))
            except ValueError:
                self.fail(path, f"{what} must be an integer, got {value!r}")
        if minimum is not None and value < minimum:
            self.fail(path, f"{what} must be at least {minimum}, got {value}")
        return int(value)

    def number(self, value: object, path: tuple, what: str, positive: bool = True) -> float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            self.fail(path, f"{what} must be a number, got {value!r}")
        if positive and not value > 0:
            self.fail(path, f"{what} must be above 0, got {value}")
        return float(value)

    # -- a model entry -------------------------------------------------------------------------

    def model(self, entry: object, i: int, qos: Mapping) -> ModelSpec:
        path = ("models", i)
        if not isinstance(entry, dict):
            self.fail(path, "expected a mapping with name, version, source")
        for k in entry:
            if k not in MODEL_FIELDS:
                self.fail((*path, k), f"unknown field {k!r}; a model has {', '.join(MODEL_FIELDS)}")
        name = str(entry.get("name", ""))
        if not NAME_RE.fullmatch(name):
            self.fail((*path, "name"), f"name {name!r} must be lower-case letters, digits, '.', '_' or '-'")
        version = str(entry.get("version", "0"))
        if not VERSION_RE.fullmatch(version):
            self.fail((*path, "version"), f"version {version!r} must be letters, digits, '.', '_', '+' or '-'")
        preset = str(entry.get("preset", "") or "")
        # (Whether an absolute source exists, or the preset is one gaas builds, is
        # gaas.model.build.check_source's: what runs the workers checks it.)
        try:
            source = modelsource.resolve(entry.get("source"), entry.get("hub"), preset, self.root, name)
        except modelsource.SourceError as exc:
            self.fail((*path, exc.field), str(exc))
        seed = self.integer(entry.get("seed", 0), (*path, "seed"), "seed", 0)
        max_len = self.integer(entry.get("max_model_len", 2048), (*path, "max_model_len"), "max_model_len")
        if max_len <= 0:
            self.fail((*path, "max_model_len"), "max_model_len must be positive")
        replicas = entry.get("replicas", 0)
        if replicas != AUTO:
            replicas = self.integer(replicas, (*path, "replicas"), "replicas (a number or auto)", 0)
        engine = self.mapping(entry.get("engine"), (*path, "engine"), _engine_keys(), "engine")
        try:
            from gaas.settings.worker import ENGINE_OPTIONS, engine_options

            engine = engine_options(engine, ENGINE_OPTIONS)
        except ValueError as exc:
            key = str(exc).split(" ", 1)[0]
            self.fail((*path, "engine", key) if key in engine else (*path, "engine"), str(exc))
        try:
            need = DeviceRequirement.parse(entry.get("device", "any"))
        except DeviceError as exc:
            self.fail((*path, "device", exc.field) if exc.field else (*path, "device"), str(exc))
        device, device_needs = need.kind, ({} if need.simple else need.as_dict())
        tenants = entry.get("tenants") or []
        if not isinstance(tenants, list) or not all(isinstance(t, str) and TENANT_RE.fullmatch(t) for t in tenants):
            self.fail((*path, "tenants"), "tenants must be a list of tenant names ([]: every tenant)")
        pins = entry.get("pins") or {}
        if not isinstance(pins, dict):
            self.fail((*path, "pins"), "pins must map tenant names to the version each is kept on")
        for tenant, v in pins.items():
            if not isinstance(tenant, str) or not TENANT_RE.fullmatch(tenant):
                self.fail((*path, "pins", tenant), f"pins: {tenant!r} is not a tenant name")
            if not isinstance(v, (str, int, float)) or not VERSION_RE.fullmatch(str(v)):
                self.fail((*path, "pins", tenant), f"pins: {tenant}'s version {v!r} is not a version")
        rollout = self.rollout(entry.get("rollout"), (*path, "rollout"), qos)
        autoscale = None
        if entry.get("autoscale") is not None:
            if "replicas" in entry:
                self.fail((*path, "autoscale"), f"{name}: give replicas (a fixed count) or autoscale (min and max), "
                                                "not both")
            autoscale = self.autoscale(entry["autoscale"], (*path, "autoscale"))
            replicas = autoscale.min
        return ModelSpec(name=name, version=version, source=source, preset=preset, max_model_len=max_len,
                         is_default=bool(entry.get("default", False)), seed=seed, replicas=replicas, engine=engine,
                         device=device, tenants=tuple(tenants), pins={t: str(v) for t, v in pins.items()},
                         rollout=rollout, autoscale=autoscale, device_needs=device_needs)

    def autoscale(self, doc: object, path: tuple) -> AutoscalePolicy:
        doc = self.mapping(doc, path, tuple(AUTOSCALE_FIELDS), "autoscale")
        if "max" not in doc:
            self.fail(path, "autoscale needs max (the most workers), e.g. {min: 1, max: 4}")
        kw: dict = {}
        for key, attr in AUTOSCALE_FIELDS.items():
            if key not in doc:
                continue
            if key in ("min", "max", "initial_scale"):
                kw[attr] = self.integer(doc[key], (*path, key), f"autoscale.{key}", 0)
            else:
                kw[attr] = self.number(doc[key], (*path, key), f"autoscale.{key}",
                                       positive=key in ("target_requests", "target_kv_usage"))
        try:
            return AutoscalePolicy(**kw)
        except ValueError as exc:
            which = next((k for k in AUTOSCALE_FIELDS if f"autoscale.{k} " in str(exc)), "min")
            self.fail((*path, which) if which in doc else path, str(exc))

    def rollout(self, doc: object, path: tuple, qos: Mapping) -> RolloutPolicy:
        doc = self.mapping(doc, path, ROLLOUT_FIELDS, "rollout")
        kw: dict = {}
        if "strategy" in doc:
            try:
                kw["strategy"] = Strategy(doc["strategy"])
            except ValueError:
                self.fail((*path, "strategy"), f"strategy must be one of {', '.join(s.value for s in Strategy)}, "
                                               f"got {doc['strategy']!r}")
        if "steps" in doc:
            steps = doc["steps"]
            if not isinstance(steps, list) or not steps:
                self.fail((*path, "steps"), "steps must be a list of percentages ending at 100, e.g. [5, 25, 50, 100]")
            kw["steps"] = tuple(self.integer(s, (*path, "steps", j), "a step", 1) for j, s in enumerate(steps))
        for key, attr in (("hold_seconds", "hold_s"), ("start_timeout_seconds", "start_timeout_s")):
            if key in doc:
                kw[attr] = self.number(doc[key], (*path, key), key, positive=key != "hold_seconds")
        if "shadow_percent" in doc:
            kw["shadow"] = self.integer(doc["shadow_percent"], (*path, "shadow_percent"), "shadow_percent", 1)
        kw["guard"] = self.guard(doc.get("guard"), (*path, "guard"), qos)
        try:
            return RolloutPolicy(**kw)
        except ValueError as exc:
            which = "steps" if "step" in str(exc) else "shadow_percent" if "shadow" in str(exc) else None
            self.fail((*path, which) if which else path, str(exc))

    def guard(self, doc: object, path: tuple, qos: Mapping) -> GuardPolicy:
        doc = self.mapping(doc, path, GUARD_FIELDS, "rollout.guard")
        targets = {tier: float(p.ttft_target_ms) for tier, p in qos.items()}
        own = doc.get("ttft_p95_ms") or {}
        if not isinstance(own, dict):
            self.fail((*path, "ttft_p95_ms"), f"ttft_p95_ms must map tiers ({', '.join(TIERS)}) to milliseconds")
        for tier, ms in own.items():
            if tier not in TIERS:
                self.fail((*path, "ttft_p95_ms", tier), f"unknown tier {tier!r}; tiers: {', '.join(TIERS)}")
            targets[tier] = self.number(ms, (*path, "ttft_p95_ms", tier), f"ttft_p95_ms.{tier}")
        kw: dict = {"ttft_targets_ms": targets}
        if "window_seconds" in doc:
            kw["window_s"] = self.number(doc["window_seconds"], (*path, "window_seconds"), "window_seconds")
        if "min_samples" in doc:
            kw["min_ttft_samples"] = self.integer(doc["min_samples"], (*path, "min_samples"), "min_samples", 1)
        if "min_requests" in doc:
            kw["min_requests"] = self.integer(doc["min_requests"], (*path, "min_requests"), "min_requests", 1)
        for key in ("ttft_tolerance", "error_margin", "throughput_tolerance"):
            if key in doc:
                kw[key] = self.number(doc[key], (*path, key), key, positive=False)
        try:
            return GuardPolicy(**kw)
        except ValueError as exc:
            self.fail(path, str(exc))


def _engine_keys() -> tuple[str, ...]:
    from gaas.settings.worker import ENGINE_OPTIONS

    return ENGINE_OPTIONS


def _billing(doc: object) -> tuple[dict, dict]:
    from gaas.contracts.pricing import parse_table

    if doc is None:
        return {}, dict(DEFAULT_METERS)
    if not isinstance(doc, dict) or set(doc) - {"prices", "meters"}:
        raise SpecError("billing: expected a mapping with 'prices' (by tier and model) and 'meters'", ("billing",))
    try:
        prices = parse_table(doc.get("prices"))
    except ValueError as exc:
        raise SpecError(str(exc), ("billing", "prices")) from None
    meters = {**DEFAULT_METERS, **(doc.get("meters") or {})}
    if set(meters) != set(DEFAULT_METERS) or not all(isinstance(v, str) and 0 < len(v) <= 100 for v in meters.values()):
        raise SpecError("billing.meters: name the Stripe meter event of input, cached_input and output (1-100 characters)",
                        ("billing", "meters"))
    return prices, meters


def parse(doc: object, root: Path, text: str = "") -> DeploySpec:
    """The deployment file's document (root: what relative sources are relative to); SpecError
    with the path of what is wrong (load() and parse_text() add the file and line)."""
    if not isinstance(doc, dict):
        raise SpecError("the deployment file must be a mapping with a 'models' list")
    unknown = set(doc) - {"models", "billing", "qos", "sessions", "batches"}
    if unknown:
        first = sorted(unknown)[0]
        raise SpecError(f"unknown section(s) {', '.join(sorted(unknown))}; the file has 'models', 'billing', 'qos', "
                        "'sessions' and 'batches'", (first,))
    from gaas.contracts.qos import parse_policies

    try:
        qos = parse_policies(doc.get("qos"))
    except ValueError as exc:
        raise SpecError(str(exc), ("qos",)) from None
    entries = doc.get("models") or []
    if not isinstance(entries, list) or not entries:
        raise SpecError("'models' must be a non-empty list", ("models",))
    checker = _Checker(root)
    models = tuple(checker.model(e, i, qos) for i, e in enumerate(entries))
    names = [m.name for m in models]
    for i, n in enumerate(names):
        if n in names[:i]:
            raise SpecError(f"model name(s) listed twice: {n}", ("models", i, "name"))
    defaults = [i for i, m in enumerate(models) if m.is_default]
    if len(defaults) > 1:
        raise SpecError("only one model may be marked default: true", ("models", defaults[1], "default"))
    prices, meters = _billing(doc.get("billing"))
    from gaas.contracts.sessions import parse_policy

    try:
        sessions = parse_policy(doc.get("sessions"))
    except ValueError as exc:
        raise SpecError(str(exc), ("sessions",)) from None
    from gaas.contracts.batches import parse_policy as parse_batches

    try:
        batches = parse_batches(doc.get("batches"))
    except ValueError as exc:
        raise SpecError(str(exc), ("batches",)) from None
    return DeploySpec(models=models, prices=prices, meters=meters, qos=qos, sessions=sessions, batches=batches,
                      text=text)


def parse_text(text: str, root: Path, name: str = "", check=None) -> DeploySpec:
    """A deployment file's text; SpecError naming name, the line and the field of what is wrong.
    check(spec): more to check once it parses (SpecError with a path), placed in the file alike."""

    try:
        doc = located.parse(text, name)
    except yaml.YAMLError as exc:
        raise SpecError(f"{name or 'the deployment file'} is not valid YAML: {exc}") from exc
    except RecursionError:  # (YAML's reader recurses: a file of nested brackets runs out of stack)
        raise SpecError(f"{name or 'the deployment file'} is nested too deeply to read") from None

    def parse_and_check() -> DeploySpec:
        spec = parse(doc.doc, root, text)
        if check is not None:
            check(spec)
        return spec

    return _located(doc, parse_and_check)


def _located(doc: Located, fn):
    try:
        return fn()
    except SpecError as exc:
        raise SpecError(f"{doc.where(exc.path)}: {exc}" if doc.where(exc.path) else str(exc), exc.path) from None


def load(path: Path, check=None) -> DeploySpec:
    path = Path(path)
    try:
        text = path.read_text()
    except OSError as exc:
        raise SpecError(f"cannot read deployment file {path}: {exc.strerror}") from exc
    return parse_text(text, root_of(path), str(path), check)


# What relative sources are relative to: the project (the directory holding deploy/ and models/),
# wherever the file that names them is.
PROJECT_ROOT = Path(__file__).resolve().parents[2]


def root_of(path: Path | str) -> Path:
    """What a deployment file's relative sources are relative to (PROJECT_ROOT, whatever the file)."""
    return PROJECT_ROOT
