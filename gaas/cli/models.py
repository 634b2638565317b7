"""`gaas models`: the models the mesh serves, with their ready workers (asked at the ingress)."""

from __future__ import annotations

import argparse
import json

from gaas.cli.common import DEFAULT_RUN_DIR, api_key, fail, ingress_address, ingress_tls


def cmd_models(args) -> int:
    from gaas.sdk.client import GaasClient, GaasError

    with GaasClient(ingress_address(args), api_key=api_key(args), **ingress_tls(args)) as client:
        try:
            models = client.list_models()
        except GaasError as exc:
            return fail(f"{exc.code}: {exc.message}")
    rows = [
        {"name": m.name, "version": m.version, "ready_workers": m.ready_workers, "max_model_len": m.max_model_len}
        for m in models
    ]
    if args.json:
        print(json.dumps(rows, indent=2))
    else:
        for r in rows:
            print(f"{r['name']:<16} {r['version']:<10} {r['ready_workers']} worker(s)  context {r['max_model_len']}")
    return 0


def register(sub) -> None:
    """`gaas models`."""
    models = sub.add_parser("models", help="models the mesh serves, with their ready workers")
    models.add_argument("--ingress", default=None, help="host:port of the ingress")
    models.add_argument("--api-key", default=None, help="API key (env GAAS_API_KEY; default: the demo key)")
    models.add_argument("--run-dir", default=str(DEFAULT_RUN_DIR), help=argparse.SUPPRESS)
    models.add_argument("--json", action="store_true", help="machine-readable output")
    models.set_defaults(func=cmd_models)
