"""The declarative deployment file (deploy/gaas.yaml): parsed and checked, with errors that name
the offending entry. Shared by the control plane (which applies it) and `gaas up`."""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path

import yaml

NAME_RE = re.compile(r"[a-z0-9][a-z0-9._-]{0,62}")


class SpecError(ValueError):
    """The deployment file is malformed; the message says where and what to fix."""


@dataclass(frozen=True, slots=True)
class ModelSpec:
    # Name clients ask for.
    name: str
    # Version string shown in usage records and chunks.
    version: str
    # Local directory (absolute after loading) or a hub id.
    source: str
    # `gaas model build` preset that produces source when it is missing; "" for none.
    preset: str
    # Longest prompt + completion, in tokens.
    max_model_len: int
    # Served when a request names no model.
    is_default: bool


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


def _model(entry: object, i: int, root: Path) -> ModelSpec:
    where = f"models[{i}]"
    if not isinstance(entry, dict):
        raise SpecError(f"{where}: expected a mapping with name, version, source")
    unknown = set(entry) - {"name", "version", "source", "preset", "max_model_len", "default"}
    if unknown:
        raise SpecError(f"{where}: unknown field(s) {', '.join(sorted(unknown))}")
    name = str(entry.get("name", ""))
    if not NAME_RE.fullmatch(name):
        raise SpecError(f"{where}: name {name!r} must be lower-case letters, digits, '.', '_' or '-'")
    source = str(entry.get("source", ""))
    if not source:
        raise SpecError(f"{where} ({name}): source is required (a model directory)")
    preset = str(entry.get("preset", ""))
    # A relative source is a project directory when it exists or gaas can build it; else a hub id.
    if not source.startswith("/") and (preset or (root / source).exists()):
        source = str((root / source).resolve())
    try:
        max_len = int(entry.get("max_model_len", 2048))
    except (TypeError, ValueError):
        raise SpecError(f"{where} ({name}): max_model_len must be an integer") from None
    if max_len <= 0:
        raise SpecError(f"{where} ({name}): max_model_len must be positive")
    return ModelSpec(
        name=name,
        version=str(entry.get("version", "0")),
        source=source,
        preset=preset,
        max_model_len=max_len,
        is_default=bool(entry.get("default", False)),
    )


def _billing(doc: object) -> tuple[dict, dict]:
    from gaas.contracts.pricing import parse_table

    if doc is None:
        return {}, dict(DEFAULT_METERS)
    if not isinstance(doc, dict) or set(doc) - {"prices", "meters"}:
        raise SpecError("billing: expected a mapping with 'prices' (by tier and model) and 'meters'")
    try:
        prices = parse_table(doc.get("prices"))
    except ValueError as exc:
        raise SpecError(str(exc)) from None
    meters = {**DEFAULT_METERS, **(doc.get("meters") or {})}
    if set(meters) != set(DEFAULT_METERS) or not all(isinstance(v, str) and 0 < len(v) <= 100 for v in meters.values()):
        raise SpecError("billing.meters: name the Stripe meter event of input, cached_input and output (1-100 characters)")
    return prices, meters


def parse(doc: object, root: Path) -> DeploySpec:
    if not isinstance(doc, dict):
        raise SpecError("the deployment file must be a mapping with a 'models' list")
    unknown = set(doc) - {"models", "billing", "qos", "sessions"}
    if unknown:
        raise SpecError(f"unknown section(s) {', '.join(sorted(unknown))}; the file has 'models', 'billing', 'qos' "
                        "and 'sessions'")
    entries = doc.get("models") or []
    if not isinstance(entries, list) or not entries:
        raise SpecError("'models' must be a non-empty list")
    models = tuple(_model(e, i, root) for i, e in enumerate(entries))
    names = [m.name for m in models]
    dupes = sorted({n for n in names if names.count(n) > 1})
    if dupes:
        raise SpecError(f"model name(s) listed twice: {', '.join(dupes)}")
    if sum(m.is_default for m in models) > 1:
        raise SpecError("only one model may be marked default: true")
    prices, meters = _billing(doc.get("billing"))
    from gaas.contracts.qos import parse_policies

    try:
        qos = parse_policies(doc.get("qos"))
    except ValueError as exc:
        raise SpecError(str(exc)) from None
    from gaas.contracts.sessions import parse_policy

    try:
        sessions = parse_policy(doc.get("sessions"))
    except ValueError as exc:
        raise SpecError(str(exc)) from None
    return DeploySpec(models=models, prices=prices, meters=meters, qos=qos, sessions=sessions)


def load(path: Path) -> DeploySpec:
    path = Path(path)
    try:
        doc = yaml.safe_load(path.read_text())
    except OSError as exc:
        raise SpecError(f"cannot read deployment file {path}: {exc.strerror}") from exc
    except yaml.YAMLError as exc:
        raise SpecError(f"{path} is not valid YAML: {exc}") from exc
    return parse(doc, path.resolve().parent.parent)
