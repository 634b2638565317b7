"""Keeps a worker registered with the control plane: register once the engine is up, renew the
lease while alive (re-registering when it lapsed), deregister on shutdown. Each renewal carries
the worker's load, so routers read every worker's load from the registry instead of asking each
one per request."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable

import grpc

from gaas.v1 import common_pb2
from gaas.v1 import control_pb2 as pb
from gaas.v1 import control_pb2_grpc

log = logging.getLogger(__name__)

RPC_TIMEOUT = 2.0
# Retries while control is unreachable back off only to this: a renewal is cheap, and after a gap
# (control restarted, paused, its sidecar ejecting it for a while) the worker must be back in the
# registry within about a second, before routers conclude that no worker serves.
MAX_BACKOFF = 1.0


class LeaseKeeper:
    def __init__(
        self,
        stub: control_pb2_grpc.ControlStub,
        info: pb.WorkerInfo,
        renew_seconds: float,
        load: Callable[[], common_pb2.WorkerLoad] | None = None,
        adapters: Callable[[frozenset[int]], Awaitable[None]] | None = None,
    ) -> None:
        """adapters: told, at each renewal, the engine ids of the adapters catalogued for the
        worker's model (the engine unloads those it holds that are not among them)."""
        self._stub = stub
        self._info = info
        # Renewals (with a load report) this often; the lease's TTL bounds it from above.
        self._renew_seconds = renew_seconds
        self._load = load
        self._adapters = adapters
        self._adapters_failed = False
        self._state = pb.WORKER_STATE_SERVING
        self._task: asyncio.Task | None = None
        self._load_failed = False
        self.registered = asyncio.Event()

    def start(self) -> None:
        self._task = asyncio.create_task(self._run(), name="lease-keeper")

    async def _register(self) -> None:
        info = pb.WorkerInfo()
        info.CopyFrom(self._info)
        info.state = self._state
        if (load := await self._load_report()) is not None:
            info.load.CopyFrom(load)
        lease = await self._stub.RegisterWorker(pb.RegisterWorkerRequest(worker=info), timeout=RPC_TIMEOUT)
        await self._adapters_are(lease)
        if not self.registered.is_set():
            log.info("registered with control as %s at %s (lease %d s)", info.worker_id, info.address, lease.ttl_seconds)
        self.registered.set()
        # Renew three times per lease, never less often than configured.
        self._interval = min(self._renew_seconds, max(0.5, lease.ttl_seconds / 3))

    async def _adapters_are(self, lease: pb.Lease) -> None:
        """Told at every renewal, not only when the catalogue changes: a router whose view lagged
        may have had an adapter loaded here just after its removal, and the next renewal unloads it."""
        if self._adapters is None:
            return
        try:
            await self._adapters(frozenset(lease.adapter_ids))
            self._adapters_failed = False
        except Exception as exc:  # noqa: BLE001 - tried again at the next renewal
            if not self._adapters_failed:
                log.warning("cannot unload the adapters removed from the catalogue: %s: %s", type(exc).__name__, exc)
            self._adapters_failed = True

    async def _load_report(self) -> common_pb2.WorkerLoad | None:
        """The load to send, or None when there is none or it cannot be read: a broken load report
        must not keep a serving worker out of the registry (it registers without its load)."""
        if self._load is None:
            return None
        try:
            return await asyncio.to_thread(self._load)
        except Exception as exc:  # noqa: BLE001 - logged, and the lease goes on without the load
            if not self._load_failed:
                log.error("cannot read this worker's load (%s: %s); registering without it", type(exc).__name__, exc,
                          exc_info=True)
            self._load_failed = True
            return None

    async def _run(self) -> None:
        self._interval = self._renew_seconds
        backoff = 0.5
        while True:
            try:
                if not self.registered.is_set():
                    await self._register()
                else:
                    renew = pb.RenewLeaseRequest(worker_id=self._info.worker_id, state=self._state)
                    if (load := await self._load_report()) is not None:
                        renew.load.CopyFrom(load)
                    await self._adapters_are(await self._stub.RenewLease(renew, timeout=RPC_TIMEOUT))
                backoff = 0.5
                await asyncio.sleep(self._interval)
            except grpc.aio.AioRpcError as exc:
                if exc.code() == grpc.StatusCode.NOT_FOUND:
                    log.warning("lease lapsed; registering again")
                    self.registered.clear()
                    continue
                if exc.code() in (grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.FAILED_PRECONDITION,
                                  grpc.StatusCode.PERMISSION_DENIED):
                    log.error("control refused the registration: %s", exc.details())
                else:
                    log.warning("control unreachable (%s: %s); retrying in %.1f s", exc.code().name, exc.details(), backoff)
                await asyncio.sleep(backoff)
                backoff = min(backoff * 2, MAX_BACKOFF)
            except Exception as exc:  # noqa: BLE001 - a bug here must not end the lease silently
                # (the worker would go on SERVING, unregistered, with nothing in its log)
                log.error("registration or renewal failed (%s: %s); retrying in %.1f s", type(exc).__name__, exc,
                          backoff, exc_info=backoff == 0.5)
                await asyncio.sleep(backoff)
                backoff = min(backoff * 2, MAX_BACKOFF)

    async def stop(self) -> None:
        if self._task:
            self._task.cancel()
            try:
                await self._task
            except asyncio.CancelledError:
                pass
        try:
            await self._stub.DeregisterWorker(
                pb.DeregisterWorkerRequest(worker_id=self._info.worker_id), timeout=RPC_TIMEOUT
            )
            log.info("deregistered from control")
        except grpc.aio.AioRpcError as exc:
            log.warning("could not deregister (%s); the lease will lapse on its own", exc.code().name)
