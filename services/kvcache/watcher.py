"""Keeps the directory in step with every registered worker: one watch per worker
(Worker.WatchKVEvents: a snapshot, then live batches), started when the worker registers and
ended, with its blocks dropped, when its lease ends. A sequence gap or a broken watch starts the
watch over, and the fresh snapshot replaces what the directory believed.

Every directory replica runs its own watcher, so each holds the whole index; one that starts late
catches up from the workers' snapshots instead of staying blind to what was cached before it.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass

from gaas.v1 import kvcache_pb2 as pb
from gaas.contracts.ids import WorkerId
from services.kvcache.directory import BlockDirectory, Stored

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class WatchedWorker:
    worker_id: WorkerId
    # Its sidecar (what x-gaas-worker names).
    address: str
    block_size: int


def apply(directory: BlockDirectory, worker: WorkerId, batch: pb.KVEventBatch, block_size: int | None) -> None:
    """Apply a batch's events (sequence already checked)."""
    for ev in batch.events:
        kind = ev.WhichOneof("event")
        if kind == "stored":
            s = ev.stored
            directory.stored(
                worker,
                Stored(
                    engine_hashes=list(s.block_hashes),
                    parent=s.parent_block_hash if s.HasField("parent_block_hash") else None,
                    token_ids=list(s.token_ids),
                    block_size=s.block_size,
                    cache_salt=s.cache_salt,
                    lora_name=s.lora_name,
                ),
                block_size,
            )
        elif kind == "removed":
            directory.removed(worker, list(ev.removed.block_hashes))
        elif kind == "cleared":
            directory.cleared(worker)


def _short(exc: Exception) -> str:
    """A failure in one line (a gRPC error's code and details, not its repr)."""
    if hasattr(exc, "code") and hasattr(exc, "details"):
        return f"{exc.code().name}: {exc.details()}"
    return f"{type(exc).__name__}: {exc}"


class Resync(Exception):
    """The watch must start over (a sequence gap)."""


class WorkerWatcher:
    def __init__(
        self,
        directory: BlockDirectory,
        list_workers: Callable[[], Awaitable[list[WatchedWorker]]],
        watch: Callable[[WatchedWorker], AsyncIterator[pb.KVEventBatch]],
        poll_seconds: float = 1.0,
        retry_seconds: float = 1.0,
    ) -> None:
        self._dir = directory
        self._list = list_workers
        self._watch = watch
        self._poll = poll_seconds
        self._retry = retry_seconds
        self._tasks: dict[WorkerId, asyncio.Task] = {}

    async def run(self) -> None:
        """Follow the registry until cancelled."""
        failing = False
        try:
            while True:
                try:
                    workers = {w.worker_id: w for w in await self._list()}
                except Exception as exc:  # noqa: BLE001 - keep the last view; the registry comes back
                    if not failing:
                        log.warning("cannot list the workers (%s); keeping the current watches", _short(exc))
                    failing = True
                else:
                    failing = False
                    self._reconcile(workers)
                self._dir.expire()
                await asyncio.sleep(self._poll)
        finally:
            for t in self._tasks.values():
                t.cancel()
            await asyncio.gather(*self._tasks.values(), return_exceptions=True)

    def _reconcile(self, workers: dict[WorkerId, WatchedWorker]) -> None:
        for worker_id in list(self._tasks):
            if worker_id not in workers:
                log.info("%s left the registry: dropping its blocks", worker_id)
                self._tasks.pop(worker_id).cancel()
                self._dir.drop_worker(worker_id)
        for worker_id, w in workers.items():
            task = self._tasks.get(worker_id)
            if task is None or task.done():
                self._tasks[worker_id] = asyncio.create_task(self._follow(w), name=f"watch-{worker_id}")

    async def _follow(self, w: WatchedWorker) -> None:
        while True:
            try:
                await self._follow_once(w)
                log.info("%s ended its KV event stream; watching again", w.worker_id)
            except asyncio.CancelledError:
                raise
            except Resync as exc:
                log.warning("%s: %s; resynchronising from a snapshot", w.worker_id, exc)
                continue
            except Exception as exc:  # noqa: BLE001 - a worker restarting or unreachable: retry
                log.info("cannot watch %s's KV events (%s); retrying in %.0f s", w.worker_id, _short(exc), self._retry)
            await asyncio.sleep(self._retry)

    async def _follow_once(self, w: WatchedWorker) -> None:
        first = True
        async for batch in self._watch(w):
            if first or batch.snapshot:
                if first:
                    if not batch.snapshot:
                        raise Resync("the watch did not begin with a snapshot")
                    self._dir.resync(w.worker_id, batch.epoch, batch.seq)
                    first = False
                apply(self._dir, w.worker_id, batch, w.block_size)
                continue
            if not batch.events:
                continue  # a heartbeat
            if not self._dir.note_seq(w.worker_id, batch.epoch, batch.seq):
                raise Resync(f"batch {batch.seq} of epoch {batch.epoch} does not follow the last one")
            self._dir.feed.event_emitted(batch.emitted_unix)
            apply(self._dir, w.worker_id, batch, w.block_size)
