"""Billing service: consumes the routers' usage events into the durable ledger (exactly once per
request), keeps the tenants' monthly budgets (mirrored into Redis for the routers), and reports
usage to Stripe as meter events through an outbox.

Settings come from GAAS_* variables (see --help); `gaas up` sets them.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import time
from pathlib import Path

from gaas.settings import deployspec
from gaas.runtime import redisconn
from gaas.runtime.server import ServiceRuntime, options_for, run_service
from gaas.settings.docs import help_epilog
from gaas.settings.billing import BillingSettings
from gaas.runtime.sql import Database
from gaas.v1 import billing_pb2_grpc, control_pb2, control_pb2_grpc
from gaas.contracts.batches import DEFAULT_POLICY as DEFAULT_BATCH_POLICY
from services.billing.batches import BatchStore
from services.billing.budgets import Budgets
from services.billing.filestore import DirectoryFileStore
from services.billing.consumer import UsageConsumer
from services.billing.ledger import Ledger
from services.billing.servicer import BillingServicer
from services.billing.stripe_sync import StripeMeterSender, StripeSync

log = logging.getLogger("gaas.billing")


def tenant_customers(stub: control_pb2_grpc.ControlStub | None, ttl: float = 10.0):
    """customers(max_age=ttl) -> {tenant: Stripe customer}, from control, cached up to max_age s."""
    cache: dict = {"at": -ttl, "value": {}}

    async def customers(max_age: float = ttl) -> dict[str, str]:
        if stub is None:
            return {}
        if time.monotonic() - cache["at"] > max_age:
            resp = await stub.ListTenants(control_pb2.ListTenantsRequest(), timeout=2.0)
            cache["value"] = {t.name: t.stripe_customer for t in resp.tenants}
            cache["at"] = time.monotonic()
        return cache["value"]

    return customers


async def maintain_batches(batches: BatchStore, every_s: float = 2.0) -> None:
    """Batches past their window expire; stopped ones whose last items' runners are gone finish."""
    while True:
        try:
            await batches.maintain()
        except Exception:  # noqa: BLE001 - the database away for a while: the next round tries again
            log.warning("batches: cannot finish or expire batches now", exc_info=True)
        await asyncio.sleep(every_s)


async def serve(cfg: BillingSettings) -> None:
    rt = ServiceRuntime(options_for("billing", cfg))
    rt.install_signal_handlers()
    db = Database(cfg.database_url)
    ledger = Ledger(db)
    await ledger.init_schema()
    redis = redisconn.connect(cfg.redis_url, timeout=5.0)
    channel = rt.channel(cfg.outbound) if cfg.outbound else None
    customers = tenant_customers(control_pb2_grpc.ControlStub(channel) if channel else None)
    spec = deployspec.load(Path(cfg.deploy_file)) if cfg.deploy_file else None
    meters = spec.meters if spec is not None else dict(deployspec.DEFAULT_METERS)
    batches = BatchStore(db, DirectoryFileStore(Path(cfg.files_dir)),
                         spec.batches if spec is not None and spec.batches is not None else DEFAULT_BATCH_POLICY)
    await batches.init_schema()
    sender, reason = None, ""
    if not cfg.stripe_api_key:
        reason = "no Stripe key: set GAAS_STRIPE_API_KEY to report usage to Stripe"
    else:
        sender = StripeMeterSender(cfg.stripe_api_key, cfg.stripe_api_base)
    sync = StripeSync(db, sender, meters, customers, cfg.stripe_window_seconds, cfg.stripe_grace_seconds, cfg.stripe_rate)
    recorded = rt.metrics.counter("usage_events_total", "Usage events written to the ledger (new ones)")
    lag = rt.metrics.histogram("metering_lag_seconds", "From a request's end to its ledger row")

    def on_recorded(new: int, events) -> None:
        recorded.inc(new)
        now = time.time() * 1000
        for e in events:
            lag.observe(max(0.0, (now - e.finished_ms) / 1000))

    consumer = UsageConsumer(redis, ledger, cfg.instance, on_recorded=on_recorded)
    budgets = Budgets(ledger, redis)
    rt.add_service(
        billing_pb2_grpc.add_BillingServicer_to_server,
        BillingServicer(ledger, budgets, sync, consumer, customers, reason, batches),
        "gaas.v1.Billing",
    )
    await rt.start()
    tasks = [asyncio.create_task(consumer.run(), name="usage-consumer"),
             asyncio.create_task(budgets.run(), name="budgets"),
             asyncio.create_task(maintain_batches(batches), name="batches")]
    if sender is not None:
        tasks.append(asyncio.create_task(sync.run(), name="stripe-sync"))
        log.info("reporting usage to Stripe at %s (meters: %s)", cfg.stripe_api_base, ", ".join(meters.values()))
    else:
        log.info("Stripe sync is off: %s", reason)

    async def stop_tasks() -> None:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        await redis.aclose()

    rt.on_stop(stop_tasks)
    await rt.set_serving(True)
    try:
        await rt.run_until_stopped()
    finally:
        if channel is not None:
            await channel.close()
        db.close()


def main() -> None:
    argparse.ArgumentParser(
        description=__doc__, epilog=help_epilog("billing"), formatter_class=argparse.RawDescriptionHelpFormatter
    ).parse_args()
    run_service("billing", BillingSettings.from_env, serve)


if __name__ == "__main__":
    main()
