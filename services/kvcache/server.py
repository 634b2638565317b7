"""KV-cache directory service: watches every registered worker's KV events, indexes the blocks
they hold (per tenant), and answers the routers' prefix lookups.

Its state is in memory, rebuilt from the workers' snapshots and events, so replicas need no shared
store: each watches every worker.
"""

from __future__ import annotations

import argparse
import asyncio

from gaas.runtime.context import WORKER_HEADER
from gaas.runtime.server import ServiceRuntime, options_for, run_service
from gaas.settings.docs import help_epilog
from gaas.settings.kvcache import KVCacheSettings
from gaas.v1 import control_pb2, control_pb2_grpc, kvcache_pb2_grpc, worker_pb2, worker_pb2_grpc
from gaas.contracts.ids import WorkerId
from services.kvcache.directory import BlockDirectory
from services.kvcache.servicer import KVCacheServicer
from services.kvcache.watcher import WatchedWorker, WorkerWatcher


async def serve(cfg: KVCacheSettings) -> None:
    rt = ServiceRuntime(options_for("kvcache", cfg))
    rt.install_signal_handlers()
    directory = BlockDirectory(provision_ttl_seconds=cfg.provision_ttl_seconds)
    channel = rt.channel(cfg.outbound)
    control = control_pb2_grpc.ControlStub(channel)
    workers = worker_pb2_grpc.WorkerStub(channel)

    async def list_workers() -> list[WatchedWorker]:
        resp = await control.ListWorkers(control_pb2.ListWorkersRequest(), timeout=2.0)
        return [WatchedWorker(WorkerId(w.worker_id), w.address, w.block_size) for w in resp.workers]

    def watch(w: WatchedWorker):
        return workers.WatchKVEvents(worker_pb2.WatchKVEventsRequest(), metadata=((WORKER_HEADER, w.address),))

    rt.add_service(kvcache_pb2_grpc.add_KVCacheServicer_to_server, KVCacheServicer(directory), "gaas.v1.KVCache")
    await rt.start()
    watcher = asyncio.create_task(WorkerWatcher(directory, list_workers, watch, cfg.poll_seconds).run(), name="watcher")

    async def stop_watching() -> None:
        watcher.cancel()
        await asyncio.gather(watcher, return_exceptions=True)

    rt.on_stop(stop_watching)
    await rt.set_serving(True)
    try:
        await rt.run_until_stopped()
    finally:
        await channel.close()


def main() -> None:
    argparse.ArgumentParser(
        description=__doc__, epilog=help_epilog("kvcache"), formatter_class=argparse.RawDescriptionHelpFormatter
    ).parse_args()
    run_service("kvcache", KVCacheSettings.from_env, serve)


if __name__ == "__main__":
    main()
