"""Keeps a worker registered with the control plane: register once the engine is up, renew the
lease while alive (re-registering when it lapsed), deregister on shutdown."""

from __future__ import annotations

import asyncio
import logging

import grpc

from gaas.v1 import control_pb2 as pb
from gaas.v1 import control_pb2_grpc

log = logging.getLogger(__name__)

RPC_TIMEOUT = 2.0


class LeaseKeeper:
    def __init__(self, stub: control_pb2_grpc.ControlStub, info: pb.WorkerInfo, renew_seconds: float) -> None:
        self._stub = stub
        self._info = info
        self._renew_seconds = renew_seconds
        self._state = pb.WORKER_STATE_SERVING
        self._task: asyncio.Task | None = None
        self.registered = asyncio.Event()

    def start(self) -> None:
        self._task = asyncio.create_task(self._run(), name="lease-keeper")

    async def _register(self) -> None:
        info = pb.WorkerInfo()
        info.CopyFrom(self._info)
        info.state = self._state
        lease = await self._stub.RegisterWorker(pb.RegisterWorkerRequest(worker=info), timeout=RPC_TIMEOUT)
        if not self.registered.is_set():
            log.info("registered with control as %s at %s (lease %d s)", info.worker_id, info.address, lease.ttl_seconds)
        self.registered.set()
        # Renew three times per lease, never less often than configured.
        self._interval = min(self._renew_seconds, max(0.5, lease.ttl_seconds / 3))

    async def _run(self) -> None:
        self._interval = self._renew_seconds
        backoff = 0.5
        while True:
            try:
                if not self.registered.is_set():
                    await self._register()
                else:
                    await self._stub.RenewLease(
                        pb.RenewLeaseRequest(worker_id=self._info.worker_id, state=self._state), timeout=RPC_TIMEOUT
                    )
                backoff = 0.5
                await asyncio.sleep(self._interval)
            except grpc.aio.AioRpcError as exc:
                if exc.code() == grpc.StatusCode.NOT_FOUND:
                    log.warning("lease lapsed; registering again")
                    self.registered.clear()
                    continue
                if exc.code() in (grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.FAILED_PRECONDITION):
                    log.error("control refused the registration: %s", exc.details())
                else:
                    log.warning("control unreachable (%s: %s); retrying in %.1f s", exc.code().name, exc.details(), backoff)
                await asyncio.sleep(backoff)
                backoff = min(backoff * 2, 5.0)

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
