"""`gaas models`: the models the mesh serves, with their ready workers (asked at the ingress) and
what each serves (generations, or embeddings: its task), and, for the mesh's operator, each model's
versions with workers, their roles and the split between them (asked at control)."""

from __future__ import annotations

import argparse
import json

from gaas.cli.common import DEFAULT_RUN_DIR, DEFAULT_TOPOLOGY, api_key, control_address, fail, ingress_address, ingress_tls


def cmd_models(args) -> int:
    from gaas.sdk.client import GaasClient, GaasError

    with GaasClient(ingress_address(args), api_key=api_key(args), **ingress_tls(args)) as client:
        try:
            models = client.list_models()
        except GaasError as exc:
            return fail(f"{exc.code}: {exc.message}")
    ready = {m.name: m.ready_workers for m in models}
    rows = [
        {"name": m.name, "version": m.version, "ready_workers": m.ready_workers, "max_model_len": m.max_model_len,
         "task": m.task or "generate"}
        for m in models
    ]
    deployed = None if args.api_only else _deployed(args)
    if deployed is not None:
        rows = [{**d, "ready_workers": ready.get(d["name"], 0)} for d in deployed]
    if args.json:
        print(json.dumps(rows, indent=2))
        return 0
    for r in rows:
        print(f"{r['name']:<16} {r['version']:<10} {r['ready_workers']} worker(s) ready  context {r['max_model_len']}"
              + (f"  replicas {r['replicas']}" if "replicas" in r else "")
              + ("  embeddings" if r.get("task") == "embed" else ""))
        split = r.get("split") or {}
        for v in r.get("versions", []) if r.get("replicas", "0") != "0" else []:
            share = ""
            if v["version"] == split.get("canary"):
                share = f"  {split['weight']}% of new requests" + (f", {split['shadow']}% copied (shadow)"
                                                                   if split.get("shadow") else "")
            elif v["version"] == split.get("stable") and split.get("canary"):
                share = f"  {100 - split['weight']}% of new requests"
            pinned = sorted(t for t, ver in split.get("pins", {}).items() if ver == v["version"])
            print(f"    {v['version']:<10} {v['role']:<7}{share}" + (f"  pinned: {', '.join(pinned)}" if pinned else "")
                  + (f"  tenants: {', '.join(v['tenants'])}" if v["tenants"] else ""))
    return 0


def _deployed(args) -> list[dict] | None:
    """The deployment as control holds it, when this is the mesh's operator (its run directory's
    certificate); None otherwise (a tenant sees what the ingress says)."""
    from gaas.sdk.admin import Admin
    from gaas.sdk.client import GaasError

    try:
        with Admin(control_address(args)) as admin:
            return admin.models()
    except (GaasError, OSError, ValueError):
        return None


def register(sub) -> None:
    """`gaas models`."""
    models = sub.add_parser("models", help="models the mesh serves, their versions, roles and split")
    models.add_argument("--ingress", default=None, help="host:port of the ingress")
    models.add_argument("--api-key", default=None, help="API key (env GAAS_API_KEY; default: the demo key)")
    models.add_argument("--run-dir", default=str(DEFAULT_RUN_DIR), help=argparse.SUPPRESS)
    models.add_argument("--topology", default=str(DEFAULT_TOPOLOGY), help=argparse.SUPPRESS)
    models.add_argument("--api-only", action="store_true",
                        help="only what the ingress says (/v1/models), not the versions control holds")
    models.add_argument("--json", action="store_true", help="machine-readable output")
    models.set_defaults(func=cmd_models)
