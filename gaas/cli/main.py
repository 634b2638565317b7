"""The `gaas` command's entry point (pyproject's [project.scripts] gaas = gaas.cli.main:main): the
top-level parser, which module adds which commands, in the order `gaas --help` lists them, and main().

Each command group is one module of gaas.cli with a register(subparsers) that adds its commands
(their options and a func that runs them); adding a command is adding or extending one module.
What the commands share (finding the running mesh, the options naming it) is gaas.cli.common.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from gaas.ops import protogen

# What `gaas --help` says above the list of commands.
OVERVIEW = """gaas: run and use the GaaS inference mesh.

  gaas up                      start everything (Redis if needed, services, Envoys); Ctrl-C stops it
  gaas generate "Once upon"    stream a generation through the ingress
  gaas status                  health of every service instance, Envoy and worker
  gaas models                  models the mesh serves, their versions and roll-outs
  gaas apply -f deploy/gaas.yaml   apply the deployment live (`gaas diff -f` first shows what changes);
                               a model's new version is rolled out: `gaas rollout status MODEL`
  gaas placement               where each pool's workers may run on this host, and why
  gaas lora add bot gaas-tiny DIR --owner acme
                               a LoRA adapter, loaded by the workers on its first request
  gaas kv stats                the KV-cache directory: blocks per worker and tenant, hit ratio
  gaas tenant create acme      tenants (tiers gold / silver / bronze) and their API keys:
  gaas key create acme           the key is printed once; `gaas key revoke KEY_ID` ends it
  gaas usage acme --by model   a tenant's metered usage and cost, from the ledger
  gaas budget set acme 50      a monthly budget, USD; past it the tenant's requests get HTTP 429
  gaas invoice preview acme    this month's bill so far, line by line
  gaas batch list              tenants' batches (POST /v1/batches); `gaas batch show|cancel ID`
  gaas model build             build the local test/benchmark model
  gaas bench sits              the SITS2026 scorecard on a live mesh (`gaas bench` lists the benchmarks)
  gaas envoy render            write the Envoy configs the topology produces
  gaas k8s render              the mesh as Kubernetes manifests (Kustomize); `gaas k8s validate` checks them
"""


def commands() -> tuple:
    """The command modules, in the order `gaas --help` lists their commands (imported once the
    gRPC modules they use exist: ensure_generated)."""
    from gaas.cli import (
        bench, billing, deploy, envoy, generate, k8s, kv, lora, model, models, placement, restart, sessions, status,
        tenants, top, trace, up,
    )

    return (up, trace, generate, sessions, status, top, restart, models, deploy, placement, lora, tenants, billing, kv,
            model, bench, envoy, k8s)


def ensure_generated() -> str | None:
    """Generate gaas/v1 from protos/ when this checkout lacks it or a .proto changed since (what
    `make proto` does); None, or what to run where it cannot."""
    if not protogen.PROTO_DIR.is_dir():
        return None  # an installed package: generated when it was built
    try:
        if not protogen.is_stale():
            return None
        print("gaas: generating the gRPC modules from protos/ (make proto) ...", file=sys.stderr, flush=True)
        protogen.generate()
    except ImportError as exc:
        return (f"the gRPC modules are not generated and cannot be ({exc}): run `make install`, then `make proto`, "
                "from the repository")
    return None


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="gaas", description=OVERVIEW, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for module in commands():
        module.register(sub)
    return p


def main(argv: list[str] | None = None) -> int:
    if (missing := ensure_generated()) is not None:
        print(f"gaas: {missing}", file=sys.stderr)
        return 2
    from gaas.cli.common import fail

    args = build_parser().parse_args(argv)
    if getattr(args, "run_dir", None):
        # Everything in this process reaches the mesh as the operator of this run directory
        # (its CA and certificate: gaas.ops.pki.operator_channel).
        os.environ["GAAS_HOME"] = str(Path(args.run_dir).resolve())
    try:
        return args.func(args)
    except ValueError as exc:
        # A malformed topology file, whichever command read it (a TopologyError: gaas.ops.topology is
        # loaded by then; not imported here, so commands that never read it do not pay for it).
        topology = sys.modules.get("gaas.ops.topology")
        if topology is not None and isinstance(exc, topology.TopologyError):
            return fail(str(exc), 2)
        raise


if __name__ == "__main__":
    sys.exit(main())
