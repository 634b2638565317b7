"""Router service: the mesh's edge behind the Envoy ingress. Picks a worker for each request and
streams the generation from it through the sidecars.

Settings come from GAAS_* variables (see --help); `gaas up` sets them from the topology.
"""

from __future__ import annotations

import argparse

from gaas.runtime.server import ServiceRuntime, options_for, run_service
from gaas.v1 import control_pb2_grpc, inference_pb2_grpc, worker_pb2_grpc
from services.router.config import RouterConfig
from services.router.directory import MeshDirectory
from services.router.picker import make_picker
from services.router.servicer import InferenceServicer, control_fetcher

HELP_ENV = """environment:
  GAAS_INSTANCE        replica name (router-0)
  GAAS_HOST/GAAS_PORT  where to listen (127.0.0.1:50071)
  GAAS_OUTBOUND        host:port of the sidecar's outbound listener (required)
  GAAS_ROUTER_PICKER   worker-picking policy (round_robin)
  GAAS_REGISTRY_TTL    seconds the worker list is cached (1)
  GAAS_ROUTER_RETRIES  other workers tried before the first token (2)
  GAAS_EJECT_SECONDS   seconds a failed worker is skipped (5)
  GAAS_METRICS_PORT    /metrics port (-1: none)
"""


async def serve(cfg: RouterConfig) -> None:
    # The edge: tenant metadata from outside is never believed.
    rt = ServiceRuntime(options_for("router", cfg, trust_tenant=False))
    rt.install_signal_handlers()
    channel = rt.channel(cfg.outbound)
    directory = MeshDirectory(
        control_fetcher(control_pb2_grpc.ControlStub(channel)), cfg.registry_ttl_seconds, cfg.eject_seconds
    )
    servicer = InferenceServicer(
        directory,
        make_picker(cfg.picker),
        worker_pb2_grpc.WorkerStub(channel),
        retries=cfg.retries,
        max_stream_seconds=cfg.max_stream_seconds,
    )
    rt.add_service(inference_pb2_grpc.add_InferenceServicer_to_server, servicer, "gaas.v1.Inference")
    await rt.start()
    await rt.set_serving(True)
    try:
        await rt.run_until_stopped()
    finally:
        await channel.close()


def main() -> None:
    argparse.ArgumentParser(
        description=__doc__, epilog=HELP_ENV, formatter_class=argparse.RawDescriptionHelpFormatter
    ).parse_args()
    run_service("router", RouterConfig.from_env, serve)


if __name__ == "__main__":
    main()
