"""Billing service: reads the durable usage ledger (SQL).

Settings come from GAAS_* variables (see --help); `gaas up` sets them.
"""

from __future__ import annotations

import argparse

from gaas.runtime.server import ServiceRuntime, options_for, run_service
from gaas.runtime.sql import Database
from gaas.v1 import billing_pb2_grpc
from services.billing.config import BillingConfig
from services.billing.ledger import Ledger
from services.billing.servicer import BillingServicer

HELP_ENV = """environment:
  GAAS_INSTANCE               replica name (billing-0)
  GAAS_HOST/GAAS_PORT         where to listen (127.0.0.1:50091)
  GAAS_BILLING_DATABASE_URL   the ledger: sqlite:///path.db (default .gaas/billing.db) or postgresql://...
  GAAS_METRICS_PORT           /metrics port (-1: none)
"""


async def serve(cfg: BillingConfig) -> None:
    rt = ServiceRuntime(options_for("billing", cfg))
    rt.install_signal_handlers()
    db = Database(cfg.database_url)
    ledger = Ledger(db)
    await ledger.init_schema()
    rt.add_service(billing_pb2_grpc.add_BillingServicer_to_server, BillingServicer(ledger), "gaas.v1.Billing")
    await rt.start()
    await rt.set_serving(True)
    try:
        await rt.run_until_stopped()
    finally:
        db.close()


def main() -> None:
    argparse.ArgumentParser(
        description=__doc__, epilog=HELP_ENV, formatter_class=argparse.RawDescriptionHelpFormatter
    ).parse_args()
    run_service("billing", BillingConfig.from_env, serve)


if __name__ == "__main__":
    main()
