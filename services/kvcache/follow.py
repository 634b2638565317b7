"""The directory's change feed to the routers' read replicas (gaas.v1.KVCache.Follow;
services/router/kvreplica.py): a follower gets everything the directory holds, then each change as
it is made, in order, so that a router's placement looks its prompt up in its own memory.

The directory records its changes here (Feed) as it applies the workers' KV events and the routers'
provisions; everything recorded within one turn of the event loop goes to every follower as one
message. A follower more than MAX_QUEUED messages behind is cut off: it follows again and gets
everything anew (a resynchronisation), so a slow router never makes the directory hold more.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Iterable

from gaas.contracts.ids import WorkerId
from gaas.runtime.streams import until_cut_off
from gaas.v1 import kvcache_pb2 as pb

log = logging.getLogger(__name__)

# Messages a follower may fall behind before it is cut off (it resynchronises).
MAX_QUEUED = 1024
# Hashes per message of a snapshot (8 bytes each on the wire: ~0.5 MB).
SNAPSHOT_HASHES = 65536
# A quiet stream gets an empty message this often, so no proxy takes it for an idle one.
HEARTBEAT_SECONDS = 15.0

STORED, REMOVED, CLEARED, PROVISIONED, LEFT = (
    pb.BlockChange.STORED, pb.BlockChange.REMOVED, pb.BlockChange.CLEARED, pb.BlockChange.PROVISIONED,
    pb.BlockChange.LEFT)


class Feed:
    """Changes recorded since the last flush, in order, and the followers they go to."""

    def __init__(self, provision_ttl_seconds: float) -> None:
        self._ttl = provision_ttl_seconds
        self._followers: set[asyncio.Queue] = set()
        # (kind, worker, hashes) in the order made; consecutive ones of a kind and worker merged.
        self._pending: list[tuple[int, WorkerId, list[int]]] = []
        self._oldest_event = 0.0
        self._flush_scheduled = False
        self.cut_off = 0

    @property
    def followers(self) -> int:
        return len(self._followers)

    def record(self, kind: int, worker: WorkerId, hashes: Iterable[int] = ()) -> None:
        """A change (nothing is kept while nobody follows)."""
        if not self._followers:
            return
        last = self._pending[-1] if self._pending else None
        if last is not None and last[0] == kind and last[1] == worker and kind in (STORED, REMOVED, PROVISIONED):
            last[2].extend(hashes)
        else:
            self._pending.append((kind, worker, list(hashes)))
        if not self._flush_scheduled:
            try:
                asyncio.get_running_loop().call_soon(self.flush)
            except RuntimeError:
                return  # no event loop (a test drives it): flushed when it says
            self._flush_scheduled = True

    def event_emitted(self, unix: float) -> None:
        """An engine event among the changes being recorded was emitted then (its staleness)."""
        if unix and self._followers and (not self._oldest_event or unix < self._oldest_event):
            self._oldest_event = unix

    def flush(self) -> None:
        """Send what was recorded to every follower, as one message."""
        self._flush_scheduled = False
        if not self._pending:
            return
        msg = pb.DirectoryChanges(oldest_event_unix=self._oldest_event, provision_ttl_seconds=self._ttl)
        for kind, worker, hashes in self._pending:
            msg.changes.add(kind=kind, worker_id=worker, hashes=hashes)
        self._pending, self._oldest_event = [], 0.0
        for q in list(self._followers):
            if q.qsize() >= MAX_QUEUED:
                log.warning("a router's KV replica fell %d messages behind; cutting it off (it will resynchronise)",
                            MAX_QUEUED)
                self.cut_off += 1
                self._followers.discard(q)
                q.put_nowait(None)
            else:
                q.put_nowait(msg)

    def subscribe(self) -> asyncio.Queue:
        """A queue every message flushed from now on goes to (None once it is cut off); what was
        recorded before is flushed to the others first (a snapshot taken now holds it)."""
        self.flush()
        q: asyncio.Queue = asyncio.Queue()
        self._followers.add(q)
        return q

    def unsubscribe(self, q: asyncio.Queue) -> None:
        self._followers.discard(q)

    async def follow(self, snapshot: list[pb.DirectoryChanges]) -> AsyncIterator[pb.DirectoryChanges]:
        """snapshot (what the directory holds now, taken with no await before this), then every
        message flushed after it; ends when the follower is cut off."""
        q = self.subscribe()
        try:
            for msg in snapshot:
                yield msg
            async for msg in until_cut_off(q, HEARTBEAT_SECONDS, pb.DirectoryChanges):
                yield msg
        finally:
            self.unsubscribe(q)


def snapshot_messages(held: dict[WorkerId, Iterable[int]], provisional: dict[WorkerId, Iterable[int]],
                      ttl_seconds: float) -> list[pb.DirectoryChanges]:
    """Everything the directory holds (each worker's confirmed and provisioned blocks), as the
    messages a follower starts with: the first marked snapshot, each at most SNAPSHOT_HASHES."""
    out = [pb.DirectoryChanges(snapshot=True, provision_ttl_seconds=ttl_seconds)]
    size = 0
    for kind, by_worker in ((STORED, held), (PROVISIONED, provisional)):
        for worker, hashes in by_worker.items():
            hashes = list(hashes)
            for start in range(0, len(hashes), SNAPSHOT_HASHES):
                part = hashes[start:start + SNAPSHOT_HASHES]
                if size + len(part) > SNAPSHOT_HASHES:
                    out.append(pb.DirectoryChanges(provision_ttl_seconds=ttl_seconds))
                    size = 0
                out[-1].changes.add(kind=kind, worker_id=worker, hashes=part)
                size += len(part)
    return out
