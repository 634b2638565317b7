"""LoRA adapters on a base model: the one definition of what an adapter is, how a request names one,
and who may use it (control catalogues them, the router resolves requests to them, workers load
them, billing meters them). Pure: no I/O.

A request names an adapter as its model, by its own name ("support-bot") or with its base model
("gaas-tiny:support-bot", vLLM's and LoRAX's habit). Adapter names follow model names' rules and
never clash with one. An adapter belongs to one tenant (only it may use it), or is public (every
tenant may); to any other tenant it does not exist (404, as an unknown model: a name must not tell
a tenant what another has).
"""

from __future__ import annotations

import zlib
from dataclasses import dataclass

from gaas.contracts import errors
from gaas.contracts.ids import MODEL_NAME_RE
from gaas.contracts.pricing import Price

# Model names' rule (they share one namespace), so "base:adapter" splits at its one colon.
NAME_RE = MODEL_NAME_RE
SEPARATOR = ":"


@dataclass(frozen=True, slots=True)
class Adapter:
    name: str
    base_model: str
    # The adapter's directory (PEFT format), as the workers read it.
    path: str
    rank: int
    # Its tenant; "" for a public adapter.
    owner: str = ""
    # The engine's id of it (vLLM's lora_int_id, > 0): new for each adapter added.
    adapter_id: int = 0
    # Its own price for every tier (None: the base model's).
    price: Price | None = None
    created_ms: int = 0

    @property
    def public(self) -> bool:
        return not self.owner

    def may_use(self, tenant: str) -> bool:
        return self.public or self.owner == tenant


def check_name(name: str) -> str:
    if not NAME_RE.fullmatch(name):
        raise errors.InvalidArgument(
            f"adapter name {errors.quote(name)} must be 1 to 63 lower-case letters, digits, '.', '_' or '-', "
            "beginning with a letter or digit", param="name")
    return name


def split_name(model: str) -> tuple[str, str]:
    """(base model, adapter) a request's model names: "base:adapter" -> both; a bare name -> (name,
    "") (it may still be an adapter's own name: the catalogue says)."""
    base, sep, adapter = model.partition(SEPARATOR)
    return (base, adapter) if sep else (model, "")


def engine_id(name: str, created_ms: int) -> int:
    """An adapter's engine id: positive, 31 bits, from its name and when it was added (one removed
    and added again gets another, so no worker serves the old weights under the new entry)."""
    return (zlib.crc32(f"{name}\0{created_ms}".encode()) & 0x7FFFFFFF) or 1


def not_found(model: str, available: list[str]) -> errors.NotFound:
    """The answer to a model name that is no model and no adapter the tenant may use (the same for
    another tenant's adapter: its name tells nothing)."""
    return errors.NotFound(
        f"model {errors.quote(model)} does not exist; available: {', '.join(available)}",
        param="model", reason="model_not_found",
    )
