"""KV-cache directory service: indexes the workers' KV events and answers prefix lookups.

Its state is in memory and rebuilt from the event streams, so replicas need no shared store.
"""

from __future__ import annotations

import argparse

from gaas.runtime.server import ServiceRuntime, options_for, run_service
from gaas.v1 import kvcache_pb2_grpc
from services.kvcache.config import KVCacheConfig
from services.kvcache.directory import BlockDirectory
from services.kvcache.servicer import KVCacheServicer

HELP_ENV = """environment:
  GAAS_INSTANCE        replica name (kvcache-0)
  GAAS_HOST/GAAS_PORT  where to listen (127.0.0.1:50081)
  GAAS_METRICS_PORT    /metrics port (-1: none)
"""


async def serve(cfg: KVCacheConfig) -> None:
    rt = ServiceRuntime(options_for("kvcache", cfg))
    rt.install_signal_handlers()
    rt.add_service(kvcache_pb2_grpc.add_KVCacheServicer_to_server, KVCacheServicer(BlockDirectory()), "gaas.v1.KVCache")
    await rt.start()
    await rt.set_serving(True)
    await rt.run_until_stopped()


def main() -> None:
    argparse.ArgumentParser(
        description=__doc__, epilog=HELP_ENV, formatter_class=argparse.RawDescriptionHelpFormatter
    ).parse_args()
    run_service("kvcache", KVCacheConfig.from_env, serve)


if __name__ == "__main__":
    main()
