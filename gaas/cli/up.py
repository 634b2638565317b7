"""`gaas up`: start the whole mesh in this process (gaas.launcher.mesh does the work), wait until it
serves, set up the demo tenant, print where to send requests, and stop it all on Ctrl-C or SIGTERM."""

from __future__ import annotations

import json
import os
import signal
import threading
import time
from pathlib import Path

from gaas.cli.common import ROOT, add_mesh_args, fail, mesh_topology, say
from gaas.cli.router_settings import router_policies

DEFAULT_DEPLOY = ROOT / "deploy" / "gaas.yaml"
DEFAULT_REDIS = "redis://127.0.0.1:6379/0"


def _examples(ingress: str, key: str, model: str, scheme: str = "http") -> str:
    return (
        f"  curl:   curl -N {scheme}://{ingress}/v1/chat/completions -H 'Authorization: Bearer {key}' \\\n"
        f"            -H 'Content-Type: application/json' \\\n"
        f"            -d '{{\"model\": \"{model}\", \"messages\": [{{\"role\": \"user\", \"content\": \"Hello\"}}], \"stream\": true}}'\n"
        f"  python: from openai import OpenAI\n"
        f"          client = OpenAI(base_url=\"{scheme}://{ingress}/v1\", api_key=\"{key}\")\n"
        f"          print(client.completions.create(model=\"{model}\", prompt=\"Once upon a time\", max_tokens=32).choices[0].text)\n"
    )


def cmd_up(args) -> int:
    """Start the mesh, print where to send requests, keep it running (restarting what exits) until a signal."""
    from gaas.settings.deployspec import SpecError
    from gaas.launcher.errors import MeshError
    from gaas.launcher.mesh import Mesh
    from gaas.launcher.rundir import lock_run_dir
    from gaas.ops.topology import TopologyError, with_worker_options

    run_dir = Path(args.run_dir)
    try:
        # Held until this process ends: a second `gaas up` here is refused, naming this one.
        lock_run_dir(run_dir)
    except MeshError as exc:
        return fail(str(exc))
    try:
        from gaas.host.devices import visible_gpus

        # One worker per GPU on a GPU host (topology replicas "auto", the default), else one.
        topo = mesh_topology(args, auto_workers=len(visible_gpus()) or 1)
        worker_options = {}
        if args.kv_cache_blocks is not None:
            if args.kv_cache_blocks < 1:
                return fail("--kv-cache-blocks must be at least 1", 2)
            worker_options["kv_cache_blocks"] = args.kv_cache_blocks
        if worker_options:
            topo = with_worker_options(topo, **worker_options)
        ingress_tls = None
        if bool(args.tls_cert) != bool(args.tls_key):
            return fail("--tls-cert and --tls-key go together: the certificate (PEM, with its chain) and its key", 2)
        if args.tls_cert:
            ingress_tls = (Path(args.tls_cert).resolve(), Path(args.tls_key).resolve())
            missing = [str(p) for p in ingress_tls if not p.is_file()]
            if missing:
                return fail(f"no such file: {', '.join(missing)}", 2)
        extra_env = {}
        if args.router_policy:
            policies = router_policies()
            if args.router_policy not in policies:
                return fail(f"--router-policy must be one of {', '.join(policies)}, got {args.router_policy!r}", 2)
            extra_env["GAAS_ROUTER_POLICY"] = args.router_policy
        from gaas.ops.traces import TraceError, TraceTarget

        trace, trace_sink = None, False
        try:
            if args.trace == "local":
                trace, trace_sink = TraceTarget(topo.host, topo.trace_port, args.trace_sample), True
            elif args.trace:
                trace = TraceTarget.parse(args.trace, args.trace_sample)
        except TraceError as exc:
            return fail(str(exc), 2)
        mesh = Mesh(
            topo,
            trace=trace,
            trace_sink=trace_sink,
            run_dir=run_dir,
            deploy_file=Path(args.deploy),
            redis_url=args.redis_url,
            progress=say,
            extra_env=extra_env,
            topology_file=Path(args.topology),
            ingress_tls=ingress_tls,
            serve_model=args.model,
        )
    except (TopologyError, SpecError, MeshError) as exc:
        return fail(str(exc), 2)

    stop = threading.Event()

    def on_signal(signum, frame) -> None:
        if not stop.is_set():
            say(f"{signal.Signals(signum).name} received: stopping the mesh")
        stop.set()
        mesh.interrupt()  # a start under way gives up (wait_ready returns None)

    # Explicitly, both: a shell that started us in the background may have SIGINT ignored.
    signal.signal(signal.SIGINT, on_signal)
    signal.signal(signal.SIGTERM, on_signal)

    started = time.monotonic()
    services = len(mesh.topo.instances)
    envoys = services + len(mesh.topo.ingresses)
    say(f"starting {services} service instances and {envoys} Envoys, then the deployment's workers "
        f"(logs in {run_dir / 'logs'})")
    try:
        mesh.start()
        # In this thread: what it starts is the main thread's child (a child started by a thread
        # gets the parent-death signal when that thread ends: gaas.launcher.children.child_launch).
        health = mesh.wait_ready(args.timeout)
    except MeshError as exc:
        fail(str(exc))
        mesh.stop()
        return 1
    except BaseException:
        mesh.stop()
        raise
    if health is None:  # interrupted while starting
        mesh.stop()
        return 130

    from gaas.sdk.admin import DEMO_KEY_FILE, DEMO_TENANT, Admin
    from gaas.sdk.client import GaasError

    try:
        with Admin(topo.of("control")[0].inbound) as admin:
            demo_key, created = admin.ensure_demo_key(run_dir)
    except GaasError as exc:
        fail(f"cannot set up the demo tenant: {exc}")
        mesh.stop()
        return 1
    elapsed = time.monotonic() - started
    ingress = topo.ingress
    model = (mesh.served_models or [mesh.spec.default_model.name])[0]
    services = len(mesh.topo.instances)
    envoys = services + len(mesh.topo.ingresses)
    if args.json:
        print(json.dumps({"ready": True, "ingress": ingress, "seconds": round(elapsed, 1), "demo_key_file":
                          str(run_dir / DEMO_KEY_FILE), "models": mesh.served_models, "traces_file": str(mesh.traces_file) if trace_sink else None,
                          **health.to_dict()}), flush=True)
    else:
        workers = ", ".join(f"{w['worker_id']} ({w['device']})" for w in health.workers)
        print(
            f"\nGaaS is up in {elapsed:.1f} s: {services} services, {envoys} Envoys, workers: {workers}\n"
            f"  ingress (gRPC and HTTP, OpenAI-compatible under /v1): {ingress}\n"
            f"  API key of tenant '{DEMO_TENANT}' ({'new' if created else 'kept'}, saved in {run_dir / DEMO_KEY_FILE}):\n"
            f"          {demo_key}\n"
            f"  try:    gaas generate \"Once upon a time\"   (gaas commands use that key unless given --api-key)\n"
            f"{_examples(ingress, demo_key, model, 'https' if ingress_tls else 'http')}"
            f"  status: gaas status      logs: {run_dir / 'logs'}      live view: gaas top\n"
            + (f"  traces: gaas trace --list (collected in {mesh.traces_file})\n" if trace_sink else
               f"  traces: sent to {trace.endpoint}\n" if trace else "") +
            "  Ctrl-C (or SIGTERM) stops everything.\n",
            flush=True,
        )
    while not stop.wait(1.0):
        mesh.supervise(say)
    say("stopping (services drain first, then the Envoys)")
    mesh.stop()
    say("stopped; nothing left running")
    return 0


def register(sub) -> None:
    """`gaas up`."""
    up = sub.add_parser("up", help="start the whole mesh and keep it running until Ctrl-C or SIGTERM",
                        description="Start Redis (unless one answers), every service, one Envoy sidecar per "
                        "instance and the ingress Envoy; print where to send requests; stop it all on Ctrl-C/SIGTERM.")
    add_mesh_args(up)
    up.add_argument("--deploy", default=str(DEFAULT_DEPLOY), help="deployment file applied to control (default: deploy/gaas.yaml)")
    up.add_argument("--redis-url", default=os.environ.get("GAAS_REDIS_URL", DEFAULT_REDIS),
                    help="Redis to use; started locally when nothing answers (env GAAS_REDIS_URL)")
    up.add_argument("--model", default=os.environ.get("GAAS_MODEL") or None,
                    help="serve this model of the deployment file (its replicas, or auto) and no other (env "
                    "GAAS_MODEL; default: the models the file gives replicas)")
    up.add_argument("--router-policy", default=os.environ.get("GAAS_ROUTER_POLICY") or None,
                    help="how routers pick a worker: kv_aware (where the prompt's prefix is cached, unless load "
                    "says otherwise; the default), least_load, round_robin (env GAAS_ROUTER_POLICY)")
    up.add_argument("--kv-cache-blocks", type=int,
                    default=int(os.environ["GAAS_KV_CACHE_BLOCKS"]) if os.environ.get("GAAS_KV_CACHE_BLOCKS") else None,
                    help="each engine's KV cache in blocks (vLLM's num_gpu_blocks_override; env GAAS_KV_CACHE_BLOCKS; "
                    "default: sized by memory)")
    up.add_argument("--tls-cert", default=os.environ.get("GAAS_TLS_CERT") or None,
                    help="serve the ingress over TLS with this certificate (PEM, with its chain; env GAAS_TLS_CERT)")
    up.add_argument("--tls-key", default=os.environ.get("GAAS_TLS_KEY") or None,
                    help="the private key of --tls-cert (PEM; env GAAS_TLS_KEY)")
    up.add_argument("--trace", nargs="?", const="local", default=os.environ.get("OTEL_EXPORTER_OTLP_ENDPOINT") or None,
                    metavar="OTLP_ENDPOINT",
                    help="trace every request across the Envoys and services (OpenTelemetry, W3C traceparent). "
                    "Alone: a local collector writes <run dir>/traces.jsonl, which `gaas trace` shows; with "
                    "http://host:port: spans go to that OTLP/gRPC receiver (Jaeger, an OpenTelemetry Collector). "
                    "Default: OTEL_EXPORTER_OTLP_ENDPOINT when set, else off")
    up.add_argument("--trace-sample", type=float, default=100.0, metavar="PERCENT",
                    help="share of requests the ingress starts a trace for, in percent (100)")
    up.add_argument("--timeout", type=float, default=300.0, help="seconds to wait for everything to be ready (300)")
    up.add_argument("--json", action="store_true", help="print one JSON line when ready instead of the banner")
    up.set_defaults(func=cmd_up)
