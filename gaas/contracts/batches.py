"""Batches (OpenAI's /v1/batches): one definition of their terms for the deployment file
(`batches:`), billing (which keeps files, batches and items) and the routers (which run the
items in their own priority band, below bronze: gaas.contracts.qos.BATCH).

A batch's items are billed at price_factor times the tier's price (OpenAI bills batches at half).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, replace

from gaas.contracts.edge import KIB, MIB
from gaas.contracts.tenancy import TIERS

# The only completion window (OpenAI's): a batch not finished 24 h after its creation expires,
# its unrun items failed as batch_expired.
COMPLETION_WINDOW = "24h"
WINDOW_SECONDS = 24 * 3600
# The endpoints a batch's requests may be for.
ENDPOINTS = ("/v1/chat/completions", "/v1/completions", "/v1/embeddings")
# The largest file an upload may carry through the ingress and the router (a gRPC message each).
MAX_UPLOAD_BYTES = 4 * MIB - 64 * KIB
# An item's lease: its runner renews it every LEASE_RENEW_S while the item runs; a runner that
# stopped loses it within LEASE_SECONDS, and the item is claimed again.
LEASE_SECONDS = 30.0
LEASE_RENEW_S = 5.0
# The largest answer one item may have (its JSON body, as POST {endpoint} would answer it): what
# one gRPC message carries to billing. A larger one is the item's error (answer_too_large).
MAX_ANSWER_BYTES = 4 * MIB - 64 * KIB
# An item that cannot run for want of something its tenant lacks or the mesh lacks for it (a
# quota, its budget, a worker for its model, session room) is given back and claimed again after
# ITEM_BACKOFF_S, doubling each time up to ITEM_BACKOFF_MAX_S; after ITEM_ATTEMPTS runs it fails
# with the reason (about 14 minutes of trying).
ITEM_ATTEMPTS = 10
ITEM_BACKOFF_S = 2.0
ITEM_BACKOFF_MAX_S = 300.0
# Tokens per message of a batch item's stream (the worker's most): nobody reads it as it comes.
STREAM_INTERVAL = 64
# Batch and file ids.
BATCH_PREFIX = "batch_"
FILE_PREFIX = "file-"
# Statuses a batch ends in.
FINAL = ("failed", "completed", "expired", "cancelled")


@dataclass(frozen=True, slots=True)
class BatchPolicy:
    # The share of the tier's price (deploy billing.prices) a batch item is billed at.
    price_factor: Mapping[str, float] = field(default_factory=lambda: {t: 0.5 for t in TIERS})
    # Per file: its size and request lines.
    max_file_bytes: int = MAX_UPLOAD_BYTES
    max_items: int = 50_000
    # Per batch: the bytes of its answers (its output and error files together).
    max_output_bytes: int = 256 * MIB
    # Per tenant: batches not finished yet; files kept (output files included); the bytes of its
    # files and of its running batches' answers together.
    max_active_batches: int = 16
    max_files: int = 1_000
    max_tenant_bytes: int = 1024 * MIB

    def factor(self, tier: str) -> float:
        return self.price_factor.get(tier, 1.0)


DEFAULT_POLICY = BatchPolicy()
_KEYS = ("price_factor", "max_file_bytes", "max_items", "max_output_bytes", "max_active_batches", "max_files",
         "max_tenant_bytes")


def parse_policy(doc: object, where: str = "batches") -> BatchPolicy:
    """The deployment file's batches section over the defaults; ValueError naming the entry."""
    if doc is None:
        return DEFAULT_POLICY
    if not isinstance(doc, Mapping) or set(doc) - set(_KEYS):
        raise ValueError(f"{where} takes {', '.join(_KEYS)}")
    values: dict = {}
    factors = doc.get("price_factor")
    if factors is not None:
        if not isinstance(factors, Mapping) or set(factors) - set(TIERS):
            raise ValueError(f"{where}.price_factor maps tiers ({', '.join(TIERS)}) to a share of their price, e.g. 0.5")
        for tier, f in factors.items():
            if isinstance(f, bool) or not isinstance(f, (int, float)) or not 0 <= f <= 1:
                raise ValueError(f"{where}.price_factor.{tier} must be between 0 and 1 (a share of the tier's price), "
                                 f"got {f!r}")
        values["price_factor"] = {**DEFAULT_POLICY.price_factor, **{t: float(f) for t, f in factors.items()}}
    for key in _KEYS[1:]:
        if key not in doc:
            continue
        v = doc[key]
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise ValueError(f"{where}.{key} must be a whole number above 0, got {v!r}")
        values[key] = v
    if values.get("max_file_bytes", 0) > MAX_UPLOAD_BYTES:
        raise ValueError(f"{where}.max_file_bytes can be at most {MAX_UPLOAD_BYTES} (what one upload carries "
                         "through the ingress)")
    return replace(DEFAULT_POLICY, **values)


def item_backoff_s(attempts: int) -> float:
    """How long an item given back after its attempts-th run waits before it is claimed again."""
    return min(ITEM_BACKOFF_MAX_S, ITEM_BACKOFF_S * 2 ** max(0, attempts - 1))
