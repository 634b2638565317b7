"""Prices and what a request costs: one definition for the deployment file (which sets prices per
tier and model), the router (which prices each request when it ends, and estimates one before it
starts for the tenant's budget) and billing (which sums what the router priced).

Prices are USD per 1M tokens, so a request's cost in micro-dollars (the unit every total is kept
in, as an integer: sums are exact) is tokens times price.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass

from gaas.contracts.tenancy import TIERS

# "Any model" in the deployment file's price table.
ANY_MODEL = "*"
MICROS_PER_USD = 1_000_000


@dataclass(frozen=True, slots=True)
class Price:
    """USD per 1M tokens."""

    input: float = 0.0
    cached_input: float = 0.0
    output: float = 0.0

    def scaled(self, factor: float) -> "Price":
        """This price times factor (a batch's share of its tier's price)."""
        return Price(self.input * factor, self.cached_input * factor, self.output * factor)


FREE = Price()


def cost_parts(price: Price, prompt_tokens: int, cached_tokens: int, completion_tokens: int) -> tuple[int, int, int]:
    """What a request costs, micro-dollars, as (uncached prompt tokens at the input price, cached
    ones at the cached-input price, generated ones at the output price)."""
    cached = min(cached_tokens, prompt_tokens)
    return (
        round((prompt_tokens - cached) * price.input),
        round(cached * price.cached_input),
        round(completion_tokens * price.output),
    )


def cost_micros(price: Price, prompt_tokens: int, cached_tokens: int, completion_tokens: int) -> int:
    """What a request costs, micro-dollars (the sum of its cost_parts)."""
    return sum(cost_parts(price, prompt_tokens, cached_tokens, completion_tokens))


def estimate_micros(price: Price, prompt_tokens: int, max_completion_tokens: int) -> int:
    """The most a request can cost before it runs (every token generated, every prompt token at
    the dearer of the input prices): never below its cost_micros, whatever is cached."""
    dearest = max(price.input, price.cached_input)
    return math.ceil(prompt_tokens * dearest) + math.ceil(max_completion_tokens * price.output) + 2


def usd(micros: int) -> float:
    return micros / MICROS_PER_USD


def format_usd(micros: int) -> str:
    """Money for people: $12.50, $1,234.00; small amounts with the digits that matter ($0.000052)."""
    amount = usd(micros)
    if micros == 0 or abs(amount) >= 0.01:
        return f"${amount:,.2f}"
    return f"${amount:.6f}"


def micros(amount_usd: float) -> int:
    return round(amount_usd * MICROS_PER_USD)


def price_for(table: Mapping[str, Mapping[str, Price]], tier: str, model: str) -> Price:
    """The price of model for a tier: the model's own entry, else the tier's "*" entry, else free."""
    prices = table.get(tier, {})
    return prices.get(model) or prices.get(ANY_MODEL) or FREE


def parse_table(doc: object, where: str = "billing.prices") -> dict[str, dict[str, Price]]:
    """{tier: {model or "*": {input, cached_input, output}}} -> Prices; ValueError naming the entry."""
    if doc is None:
        return {}
    if not isinstance(doc, Mapping):
        raise ValueError(f"{where} must map tiers ({', '.join(TIERS)}) to prices per model")
    out: dict[str, dict[str, Price]] = {}
    for tier, models in doc.items():
        if tier not in TIERS:
            raise ValueError(f"{where}: unknown tier {tier!r}; tiers: {', '.join(TIERS)}")
        if not isinstance(models, Mapping):
            raise ValueError(f"{where}.{tier} must map model names (or \"*\") to prices")
        out[tier] = {}
        for model, entry in models.items():
            if not isinstance(entry, Mapping) or set(entry) - {"input", "cached_input", "output"}:
                raise ValueError(f"{where}.{tier}.{model} must be {{input, cached_input, output}} in USD per 1M tokens")
            try:
                price = Price(**{k: float(v) for k, v in entry.items()})
            except (TypeError, ValueError):
                raise ValueError(f"{where}.{tier}.{model}: prices must be numbers") from None
            if min(price.input, price.cached_input, price.output) < 0:
                raise ValueError(f"{where}.{tier}.{model}: prices cannot be negative")
            out[tier][str(model)] = price
    return out
