"""Control plane service: worker registry (Redis leases), model catalogue, tenants and API keys (SQL).

Settings come from GAAS_* variables (see --help); `gaas up` sets them from the topology.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
from pathlib import Path

from prometheus_client import Gauge

from gaas.contracts import qos
from gaas.settings import deployspec
from gaas.runtime import redisconn
from gaas.runtime.server import ServiceRuntime, options_for, run_service
from gaas.settings.docs import help_epilog
from gaas.settings.control import ControlSettings
from gaas.runtime.sql import Database
from gaas.v1 import control_pb2_grpc, xds_pb2_grpc
from gaas.model.build import check_model
from services.control.catalog import ModelCatalog
from services.control.deployment import Deployment
from services.control.rollout.driver import Driver
from services.control.scaling import Autoscalers
from services.control.membership import Membership
from services.control.prefixes import PrefixStore
from services.control.adapters import AdapterStore, apply_checks
from services.control.registry import WorkerRegistry
from services.control.servicer import ControlServicer
from services.control.tenants import TenantStore
from services.control.xds import AggregatedDiscovery

log = logging.getLogger("gaas.control")


async def serve(cfg: ControlSettings) -> None:
    rt = ServiceRuntime(options_for("control", cfg))
    rt.install_signal_handlers()
    redis = redisconn.connect(cfg.redis_url)
    await redisconn.ping(redis, cfg.redis_url)
    db = Database(cfg.database_url)
    catalog = ModelCatalog(db)
    await catalog.init_schema()
    deployment = Deployment(db, catalog, check_source=check_model)
    await deployment.init_schema()
    policies = dict(qos.DEFAULT_POLICIES)
    adapters = AdapterStore(db)
    await adapters.init_schema()
    if cfg.deploy_file:
        # Applied when it changed since the last start applied it; what `gaas apply` did since stays.
        path = str(Path(cfg.deploy_file).resolve())
        spec = deployspec.load(Path(path))
        try:
            # (held to the catalogued LoRA adapters as `gaas apply` is: no model takes an adapter's name)
            deployspec.load(Path(path), check=apply_checks(await adapters.list()))
        except deployspec.SpecError as exc:
            log.warning("the deployment file %s was not applied: %s; the mesh runs what was applied before", path, exc)
            await deployment.startup_without_file()
        else:
            number = await deployment.startup(spec, path)
            log.info("%s %s: models %s", "applied" if number else "kept what was applied; unchanged:",
                     cfg.deploy_file, ", ".join(spec.names()))
    else:
        await deployment.startup_without_file()
    tenants = TenantStore(db)
    await tenants.init_schema()
    prefixes = PrefixStore(db)
    await prefixes.init_schema()
    registry = WorkerRegistry(redis, cfg.lease_ttl_seconds)
    heartbeat = asyncio.create_task(_heartbeat(registry), name="registry-heartbeat")
    # The workers' endpoints every Envoy of the mesh takes from here (xDS), following the registry.
    membership = Membership(registry.list)
    following = asyncio.create_task(membership.run(), name="membership")
    # Roll-outs and the autoscaled pools, driven by whichever control replica holds the lead.
    autoscalers = Autoscalers(
        deployment, registry, redis,
        replicas_gauge=Gauge("gaas_control_pool_replicas", "Workers each autoscaled pool is to have, as its "
                             "autoscaler decided (on the control replica that drives)", ["model", "version"],
                             registry=rt.metrics.registry),
        decisions_counter=rt.metrics.counter("autoscale_decisions_total", "Autoscaling decisions by model and "
                                             "direction (up, down, zero)", ("model", "direction")))
    driver = Driver(deployment, registry, redis, cfg.instance, autoscalers=autoscalers,
                    weights=Gauge("gaas_control_rollout_weight_percent", "Share of new requests each live roll-out's "
                                  "new version takes, percent (on the control replica that drives roll-outs)",
                                  ["model", "version"], registry=rt.metrics.registry),
                    decisions=rt.metrics.counter("rollout_decisions_total", "Roll-out decisions by model and the state "
                                                 "they led to (progressing, promoted, rolled-back, halted...)",
                                                 ("model", "state")))
    driving = asyncio.create_task(driver.run(), name="rollouts")
    servicer = ControlServicer(registry, catalog, tenants, prefixes, policies, membership_changed=membership.refresh,
                               deployment=deployment, driver=driver, adapters=adapters)
    rt.add_service(control_pb2_grpc.add_ControlServicer_to_server, servicer, "gaas.v1.Control")
    discovery = AggregatedDiscovery(membership)
    rt.add_service(xds_pb2_grpc.add_AggregatedDiscoveryServiceServicer_to_server, discovery,
                   "envoy.service.discovery.v3.AggregatedDiscoveryService", listed=False)
    rt.on_stop(discovery.close)
    await rt.start()
    await rt.set_serving(True)
    try:
        await rt.run_until_stopped()
    finally:
        heartbeat.cancel()
        following.cancel()
        driving.cancel()
        await redis.aclose()
        db.close()


async def _heartbeat(registry: WorkerRegistry) -> None:
    """Tells the registry every second that control answers, so a gap (this process paused, every
    replica down) is noticed and the leases it would have dropped are extended."""
    while True:
        try:
            await registry.heartbeat()
        except Exception as exc:  # Redis away: the calls themselves will say so
            log.debug("registry heartbeat failed: %s", exc)
        await asyncio.sleep(1.0)


def main() -> None:
    argparse.ArgumentParser(
        description=__doc__, epilog=help_epilog("control"), formatter_class=argparse.RawDescriptionHelpFormatter
    ).parse_args()
    run_service("control", ControlSettings.from_env, serve)


if __name__ == "__main__":
    main()
