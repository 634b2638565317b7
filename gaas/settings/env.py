"""Settings read from GAAS_* environment variables, with errors that name them, and written back
(what `gaas up` hands each service's process).

A service's settings are one frozen dataclass (gaas/settings/<service>.py) whose every field is
declared with setting(): its variable, default and help, once; its type is the field's annotation
(str, int, float or bool) unless it names a kind of its own. from_env reads the class from an
environment, to_env and env_of write it, gaas.settings.docs describes it.

A variable that is unset or empty takes its default.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, TypeVar


class ConfigError(ValueError):
    """A setting is missing or malformed; the message names the variable."""


@dataclass(frozen=True, slots=True)
class Kind:
    """How a setting's text becomes its value and back."""

    # (variable, its text, never empty) -> the value; ConfigError naming the variable.
    read: Callable[[str, str], Any]
    # The value -> the text read() takes back.
    write: Callable[[Any], str] = str


def _read_int(name: str, text: str) -> int:
    try:
        return int(text)
    except ValueError:
        raise ConfigError(f"{name} must be an integer, got {text!r}") from None


def _read_float(name: str, text: str) -> float:
    try:
        return float(text)
    except ValueError:
        raise ConfigError(f"{name} must be a number, got {text!r}") from None


def _read_bool(name: str, text: str) -> bool:
    if text.lower() in ("1", "true", "yes", "on"):
        return True
    if text.lower() in ("0", "false", "no", "off"):
        return False
    raise ConfigError(f"{name} must be true or false, got {text!r}")


def _write_bool(value: bool) -> str:
    return "true" if value else "false"


STR = Kind(lambda name, text: text)
INT = Kind(_read_int)
FLOAT = Kind(_read_float)
BOOL = Kind(_read_bool, _write_bool)
# The kind of a field by its annotation (the modules declaring settings use `from __future__ import
# annotations`: the annotation is its text). Any other type names its kind in setting().
KINDS = {"str": STR, "int": INT, "float": FLOAT, "bool": BOOL}

# A required setting's default: unset or empty, it is an error naming the variable.
REQUIRED: Any = dataclasses.MISSING


@dataclass(frozen=True, slots=True)
class Var:
    """One setting: its variable and what it means; the rest is the field's."""

    # GAAS_*
    name: str
    # What it sets, for --help and docs/configuration.md (one line, no trailing full stop).
    help: str
    # None: by the field's annotation (KINDS).
    kind: Kind | None = None
    # The value -> what is wrong with it (said after the variable's name), or None when it is fine.
    check: Callable[[Any], str | None] | None = None
    # A default that depends on settings declared before it: (their values by field) -> the default.
    derived: Callable[[dict[str, Any]], Any] | None = None
    # The default as --help and the docs show it; None: the default's text ("" for none).
    shown_default: str | None = None


def setting(
    name: str,
    default: Any,
    help: str,
    *,
    kind: Kind | None = None,
    check: Callable[[Any], str | None] | None = None,
    derived: Callable[[dict[str, Any]], Any] | None = None,
    shown_default: str | None = None,
    default_factory: Callable[[], Any] | None = None,
) -> Any:
    """A settings field: read from variable `name`, `default` when it is unset or empty (REQUIRED:
    an error then; derived: computed from the fields before it)."""
    var = Var(name, help, kind, check, derived, shown_default)
    if default_factory is not None:
        return dataclasses.field(default_factory=default_factory, metadata={"var": var})
    return dataclasses.field(default=default, metadata={"var": var})


@dataclass(frozen=True, slots=True)
class Variable:
    """A settings field as its variable: what from_env, to_env and the docs walk."""

    field: str
    var: Var
    kind: Kind
    # dataclasses.MISSING when required or derived.
    default: Any

    @property
    def name(self) -> str:
        return self.var.name

    @property
    def required(self) -> bool:
        return self.default is dataclasses.MISSING and self.var.derived is None

    def shown_default(self) -> str:
        """The default as --help and the docs show it ("" when none, or required)."""
        if self.var.shown_default is not None:
            return self.var.shown_default
        if self.default is dataclasses.MISSING:
            return ""
        return self.kind.write(self.default)


def variables(cls: type) -> tuple[Variable, ...]:
    """The settings of a settings class, in declaration order."""
    out = []
    for f in dataclasses.fields(cls):
        var = f.metadata.get("var")
        if var is None:
            raise TypeError(f"{cls.__name__}.{f.name} is not declared with setting()")
        kind = var.kind or KINDS.get(f.type if isinstance(f.type, str) else getattr(f.type, "__name__", ""))
        if kind is None:
            raise TypeError(f"{cls.__name__}.{f.name}: a {f.type} setting names its kind")
        if f.default_factory is not dataclasses.MISSING:
            default = f.default_factory()
        else:
            default = f.default
        out.append(Variable(f.name, var, kind, default))
    return tuple(out)


S = TypeVar("S")


def _read(v: Variable, env: Mapping[str, str], before: dict[str, Any]) -> Any:
    text = env.get(v.name)
    if text:
        value = v.kind.read(v.name, text)
    elif v.var.derived is not None:
        value = v.var.derived(before)
    elif v.required:
        raise ConfigError(f"{v.name} is required")
    else:
        value = v.default
    if v.var.check is not None and (wrong := v.var.check(value)) is not None:
        raise ConfigError(f"{v.name} {wrong}")
    return value


def from_env(cls: type[S], env: Mapping[str, str]) -> S:
    """Read settings class cls from env; ConfigError naming the first variable that is wrong."""
    values: dict[str, Any] = {}
    for v in variables(cls):
        values[v.field] = _read(v, env, values)
    return cls(**values)


def default_of(cls: type, field: str) -> Any:
    """A setting's default, as its class declares it."""
    return next(v.default for v in variables(cls) if v.field == field)


def value_from_env(cls: type, field: str, env: Mapping[str, str] = os.environ) -> Any:
    """One setting of cls read from env as the service reads it (for what another process sizes
    by a service's setting: `gaas up` the Envoys by the router's, the GPUs' shares by the workers').
    Not for a default derived from other settings."""
    v = next((v for v in variables(cls) if v.field == field), None)
    if v is None:
        raise TypeError(f"{cls.__name__} has no setting {field}")
    return _read(v, env, {})


def env_of(cls: type, **values: Any) -> dict[str, str]:
    """Some settings of cls, by field name, as the variables that set them (what `gaas up` decides
    for a service; the rest it leaves to the service's defaults or the environment it inherits)."""
    by_field = {v.field: v for v in variables(cls)}
    unknown = set(values) - set(by_field)
    if unknown:
        raise TypeError(f"{cls.__name__} has no setting {', '.join(sorted(unknown))}")
    return {by_field[k].name: by_field[k].kind.write(value) for k, value in values.items()}


def to_env(settings: Any) -> dict[str, str]:
    """Every setting of a settings object as its variable: from_env reads the same object back."""
    return env_of(type(settings), **{v.field: getattr(settings, v.field) for v in variables(type(settings))})


class Settings:
    """What every settings class has: reading itself from the environment."""

    __slots__ = ()

    @classmethod
    def from_env(cls: type[S], env: Mapping[str, str] = os.environ) -> S:
        return from_env(cls, env)
