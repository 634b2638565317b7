"""The mesh's live membership as Envoys take it: the endpoints of every worker the registry holds (draining ones too: a
router names none of them for new work, and what already streams there, or is carried on from
there, must still reach them),
worked out again each POLL_SECONDS (and at once when a worker registers or leaves through this
replica), with a version that names the content, so every control replica gives the same version to
the same set and an Envoy that moves to another replica is not sent what it has.

What the Envoys do with it is gaas/envoy/clusters.py's workers_cluster (an EDS cluster, the router
naming the endpoint); how it is sent is services/control/xds.py. No grpc here."""

from __future__ import annotations

import asyncio
import hashlib
import logging
from collections.abc import Awaitable, Callable, Iterable, Mapping
from dataclasses import dataclass

from gaas.contracts.ids import WorkerId
from services.control.registry import WorkerRecord

log = logging.getLogger(__name__)

# How often the registry is read again (a lease that lapsed, a worker another replica registered).
POLL_SECONDS = 0.5

# The one resource there is today: every worker of the mesh (gaas/envoy/clusters.py names it).
ALL_WORKERS = "workers"


@dataclass(frozen=True, slots=True, order=True)
class Endpoint:
    # Where its sidecar listens (what the router names in x-gaas-worker).
    host: str
    port: int
    # Whose it is (Envoy's hostname for the endpoint: its stats and logs name the worker).
    worker_id: WorkerId


def _endpoint(r: WorkerRecord) -> Endpoint | None:
    host, _, port = r.address.rpartition(":")
    if not host or not port.isdigit():
        log.warning("worker %s registered an address that is not host:port (%r): left out", r.worker_id, r.address)
        return None
    return Endpoint(host.strip("[]"), int(port), r.worker_id)


def resources_of(records: Iterable[WorkerRecord]) -> dict[str, tuple[Endpoint, ...]]:
    """Resource name -> its endpoints, sorted (one order for one set)."""
    endpoints = sorted(e for e in map(_endpoint, records) if e is not None)
    return {ALL_WORKERS: tuple(endpoints)}


def version_of(resources: Mapping[str, tuple[Endpoint, ...]]) -> str:
    """A version that names the content: the same set, the same version, on any replica."""
    text = repr(sorted(resources.items()))
    return hashlib.sha256(text.encode()).hexdigest()[:16]


class Membership:
    """The current resources and their version; waiters hear of each change."""

    def __init__(self, source: Callable[[], Awaitable[list[WorkerRecord]]], poll_seconds: float = POLL_SECONDS) -> None:
        self._source = source
        self._poll = poll_seconds
        self.resources: dict[str, tuple[Endpoint, ...]] = {}
        self.version = ""
        self._changed = asyncio.Event()

    async def refresh(self) -> bool:
        """Reads the registry; True when the resources changed (waiters are woken)."""
        resources = resources_of(await self._source())
        version = version_of(resources)
        if version == self.version:
            return False
        old = {e.worker_id for e in self.resources.get(ALL_WORKERS, ())}
        new = {e.worker_id for e in resources[ALL_WORKERS]}
        if self.version:
            log.info("membership %s: %d worker(s)%s%s", version, len(new),
                     f", joined {', '.join(sorted(new - old))}" if new - old else "",
                     f", left {', '.join(sorted(old - new))}" if old - new else "")
        self.resources, self.version = resources, version
        changed, self._changed = self._changed, asyncio.Event()
        changed.set()
        return True

    def changed(self) -> asyncio.Event:
        """Set at the next change (a new event after each)."""
        return self._changed

    async def run(self) -> None:
        """Follows the registry until cancelled (its owner, control's server, cancels it)."""
        while True:
            try:
                await self.refresh()
            except Exception as exc:  # Redis away: Envoys keep what they have until it is back
                log.debug("membership refresh failed: %s", exc)
            await asyncio.sleep(self._poll)
