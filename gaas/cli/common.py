"""What every `gaas` command shares: where the repository and the run directory are, how a
command finds the running mesh (the state `gaas up` writes, its topology, its ingress, control
and the API key to use), the options naming a mesh, and how messages and errors are printed."""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

from gaas.launcher.rundir import STATE_FILE

ROOT = Path(__file__).resolve().parents[2]
DEFAULT_TOPOLOGY = ROOT / "deploy" / "topology.yaml"
DEFAULT_RUN_DIR = Path(os.environ.get("GAAS_HOME", ROOT / ".gaas"))


def say(msg: str) -> None:
    print(f"gaas: {msg}", file=sys.stderr, flush=True)


def fail(msg: str, code: int = 1) -> int:
    print(f"gaas: error: {msg}", file=sys.stderr, flush=True)
    return code


def mesh_state(run_dir: Path) -> dict | None:
    """What a running `gaas up` wrote about itself, if it is still alive."""
    path = run_dir / STATE_FILE
    try:
        state = json.loads(path.read_text())
        os.kill(state["pid"], 0)
        return state
    except (OSError, ValueError, KeyError):
        return None


def mesh_topology(args, state: dict | None = None, *, auto_workers: int = 1):
    """The topology of args (or of the running mesh, from its state); worker replicas "auto"
    become auto_workers."""
    from gaas.ops import topology

    overrides: dict = {"auto_workers": auto_workers}
    if state:
        overrides = {
            "host": state["host"],
            "port_base": state["port_base"],
            "ingress_port": state["ingress_port"],
            "ingress_path": state.get("ingress_path"),
            "workers": state.get("auto_workers"),
        }
    for key in ("port_base", "ingress_port", "ingress_path", "workers"):
        if getattr(args, key, None) is not None:
            overrides[key] = getattr(args, key)
    path = Path(args.topology)
    # The running mesh's own topology (its replicas), unless another file is named.
    if state and state.get("topology") and path == DEFAULT_TOPOLOGY and Path(state["topology"]).exists():
        path = Path(state["topology"])
    topo = topology.load(path, **overrides)
    if state and isinstance(state.get("workers"), list):
        # The workers it runs now (the deployment's, as `gaas up` started them).
        topo = topology.with_state_workers(topo, state["workers"])
    return topo


def ingress_address(args) -> str:
    if args.ingress:
        return args.ingress
    if env := os.environ.get("GAAS_INGRESS"):
        return env
    state = mesh_state(Path(args.run_dir))
    if state:
        return f"{state['host']}:{state['ingress_port']}"
    return f"127.0.0.1:{os.environ.get('GAAS_INGRESS_PORT', '8080')}"


def ingress_tls(args) -> dict:
    """How to reach the ingress: TLS when the running mesh serves it (`gaas up --tls-cert`) or
    GAAS_CA_CERT names the certificates to trust; a self-signed ingress certificate is trusted as
    its own root."""
    if ca := os.environ.get("GAAS_CA_CERT"):
        return {"tls": True, "tls_roots": Path(ca).read_bytes()}
    cert = (mesh_state(Path(args.run_dir)) or {}).get("ingress_tls_cert")
    if not cert:
        return {}
    from cryptography import x509

    pem = Path(cert).read_bytes()
    leaf = x509.load_pem_x509_certificate(pem)
    return {"tls": True, "tls_roots": pem if leaf.issuer == leaf.subject else None}


def api_key(args) -> str | None:
    """--api-key, else GAAS_API_KEY, else the demo key `gaas up` saved in the run directory."""
    if getattr(args, "api_key", None):
        return args.api_key
    if env := os.environ.get("GAAS_API_KEY"):
        return env
    from gaas.sdk.admin import DEMO_KEY_FILE

    path = Path(args.run_dir) / DEMO_KEY_FILE
    try:
        return path.read_text().strip() or None
    except OSError:
        return None


def control_address(args) -> str:
    """Where the control plane is reached: --control, else control-0's sidecar of the running mesh."""
    if getattr(args, "control", None):
        return args.control
    topo = mesh_topology(args, mesh_state(Path(args.run_dir)))
    return topo.of("control")[0].inbound


def _workers_arg(value: str) -> int | str:
    """--workers: a number of replicas (1 or more), or auto."""
    if value == "auto":
        return value
    try:
        n = int(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"a number of workers or auto, got {value!r}") from None
    if n < 1:
        raise argparse.ArgumentTypeError("at least 1 worker")
    return n


def admin_call(args, fn, client=None, address: str | None = None):
    """fn(admin) against control (control_address), or with another operator's client at address
    (billing's); (result, None) or (None, exit code)."""
    from gaas.sdk.admin import Admin
    from gaas.sdk.client import GaasError

    try:
        with (client or Admin)(address or control_address(args)) as admin:
            return fn(admin), None
    except GaasError as exc:
        return None, fail(f"{exc.code}: {exc.message}", 1)


def add_mesh_args(sp, *, workers: bool = True) -> None:
    """The options that say which mesh a command means: its topology, run directory and ports."""
    sp.add_argument("--topology", default=str(DEFAULT_TOPOLOGY), help="topology file (default: deploy/topology.yaml)")
    sp.add_argument("--run-dir", default=str(DEFAULT_RUN_DIR), help="state, logs and generated configs (default: .gaas, or $GAAS_HOME)")
    sp.add_argument("--port-base", type=int, default=None, help="first port of the instances' port blocks (env GAAS_PORT_BASE; default from the topology)")
    sp.add_argument("--ingress-port", type=int, default=None, help="ingress port (env GAAS_INGRESS_PORT; default 8080)")
    sp.add_argument("--ingress-path", choices=("router", "direct"), default=None,
                    help="how generations reach their worker: direct, from the ingress straight to the worker the "
                    "router picked there (the tokens never pass through the router), or router, through the "
                    "router, which relays every token (env GAAS_INGRESS_PATH; default from the topology: direct)")
    if workers:
        sp.add_argument("--workers", type=_workers_arg, default=None,
                        help="worker replicas, or auto: one per GPU on a GPU host, else one (env GAAS_WORKERS; "
                        "default from the topology: auto)")


def add_admin_args(sp) -> None:
    """The options of a command that calls control (tenants, keys, public prefixes)."""
    add_mesh_args(sp, workers=False)
    sp.add_argument("--control", default=None, help="host:port of control (default: control-0's sidecar of the running mesh)")
    sp.add_argument("--json", action="store_true", help="machine-readable output")
