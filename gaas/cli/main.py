"""gaas: run and use the GaaS inference mesh.

  gaas up                      start everything (Redis if needed, services, Envoys); Ctrl-C stops it
  gaas generate "Once upon"    stream a generation through the ingress
  gaas status                  health of every service instance, Envoy and worker
  gaas models                  models the mesh serves
  gaas kv stats                the KV-cache directory: blocks per worker and tenant, hit ratio
  gaas tenant create acme      tenants (tiers gold / silver / bronze) and their API keys:
  gaas key create acme           the key is printed once; `gaas key revoke KEY_ID` ends it
  gaas usage acme --by model   a tenant's metered usage and cost, from the ledger
  gaas budget set acme 50      a monthly budget, USD; past it the tenant's requests get HTTP 429
  gaas invoice preview acme    this month's bill so far, line by line
  gaas model build             build the local test/benchmark model
  gaas envoy render            write the Envoy configs the topology produces
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
DEFAULT_TOPOLOGY = ROOT / "deploy" / "topology.yaml"
DEFAULT_DEPLOY = ROOT / "deploy" / "gaas.yaml"
DEFAULT_RUN_DIR = Path(os.environ.get("GAAS_HOME", ROOT / ".gaas"))
DEFAULT_REDIS = "redis://127.0.0.1:6379/0"
# An option not given on the command line (where None means something).
_UNSET = object()


def _say(msg: str) -> None:
    print(f"gaas: {msg}", file=sys.stderr, flush=True)


def _fail(msg: str, code: int = 1) -> int:
    print(f"gaas: error: {msg}", file=sys.stderr, flush=True)
    return code


def _state(run_dir: Path) -> dict | None:
    """What a running `gaas up` wrote about itself, if it is still alive."""
    path = run_dir / "mesh.json"
    try:
        state = json.loads(path.read_text())
        os.kill(state["pid"], 0)
        return state
    except (OSError, ValueError, KeyError):
        return None


def _topology(args, state: dict | None = None, *, auto_workers: int = 1):
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
            "workers": state["workers"],
        }
    for key in ("port_base", "ingress_port", "ingress_path", "workers"):
        if getattr(args, key, None) is not None:
            overrides[key] = getattr(args, key)
    path = Path(args.topology)
    # The running mesh's own topology (its replicas), unless another file is named.
    if state and state.get("topology") and path == DEFAULT_TOPOLOGY and Path(state["topology"]).exists():
        path = Path(state["topology"])
    return topology.load(path, **overrides)


def _ingress(args) -> str:
    if args.ingress:
        return args.ingress
    if env := os.environ.get("GAAS_INGRESS"):
        return env
    state = _state(Path(args.run_dir))
    if state:
        return f"{state['host']}:{state['ingress_port']}"
    return f"127.0.0.1:{os.environ.get('GAAS_INGRESS_PORT', '8080')}"


def _ingress_tls(args) -> dict:
    """How to reach the ingress: TLS when the running mesh serves it (`gaas up --tls-cert`) or
    GAAS_CA_CERT names the certificates to trust; a self-signed ingress certificate is trusted as
    its own root."""
    if ca := os.environ.get("GAAS_CA_CERT"):
        return {"tls": True, "tls_roots": Path(ca).read_bytes()}
    cert = (_state(Path(args.run_dir)) or {}).get("ingress_tls_cert")
    if not cert:
        return {}
    from cryptography import x509

    pem = Path(cert).read_bytes()
    leaf = x509.load_pem_x509_certificate(pem)
    return {"tls": True, "tls_roots": pem if leaf.issuer == leaf.subject else None}


def _api_key(args) -> str | None:
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


def _control(args) -> str:
    """Where the control plane is reached: --control, else control-0's sidecar of the running mesh."""
    if getattr(args, "control", None):
        return args.control
    topo = _topology(args, _state(Path(args.run_dir)))
    return topo.of("control")[0].inbound


def _billing(args) -> str:
    """Where billing is reached: --billing, else billing-0's sidecar of the running mesh."""
    if getattr(args, "billing", None):
        return args.billing
    topo = _topology(args, _state(Path(args.run_dir)))
    return topo.of("billing")[0].inbound


def _examples(ingress: str, key: str, model: str, scheme: str = "http") -> str:
    return (
        f"  curl:   curl -N {scheme}://{ingress}/v1/chat/completions -H 'Authorization: Bearer {key}' \\\n"
        f"            -H 'Content-Type: application/json' \\\n"
        f"            -d '{{\"model\": \"{model}\", \"messages\": [{{\"role\": \"user\", \"content\": \"Hello\"}}], \"stream\": true}}'\n"
        f"  python: from openai import OpenAI\n"
        f"          client = OpenAI(base_url=\"{scheme}://{ingress}/v1\", api_key=\"{key}\")\n"
        f"          print(client.completions.create(model=\"{model}\", prompt=\"Once upon a time\", max_tokens=32).choices[0].text)\n"
    )


# ------------------------------------------------------------------------- up


def cmd_up(args) -> int:
    from gaas.settings.deployspec import SpecError
    from gaas.launcher.mesh import Mesh, MeshError, lock_run_dir
    from gaas.ops.topology import TopologyError, with_worker_options

    run_dir = Path(args.run_dir)
    try:
        # Held until this process ends: a second `gaas up` here is refused, naming this one.
        lock_run_dir(run_dir)
    except MeshError as exc:
        return _fail(str(exc))
    try:
        from gaas.host.devices import visible_gpus

        # One worker per GPU on a GPU host (topology replicas "auto", the default), else one.
        topo = _topology(args, auto_workers=len(visible_gpus()) or 1)
        worker_options = {}
        if args.model:
            worker_options["model"] = args.model
        if args.kv_cache_blocks is not None:
            if args.kv_cache_blocks < 1:
                return _fail("--kv-cache-blocks must be at least 1", 2)
            worker_options["kv_cache_blocks"] = args.kv_cache_blocks
        if worker_options:
            topo = with_worker_options(topo, **worker_options)
        ingress_tls = None
        if bool(args.tls_cert) != bool(args.tls_key):
            return _fail("--tls-cert and --tls-key go together: the certificate (PEM, with its chain) and its key", 2)
        if args.tls_cert:
            ingress_tls = (Path(args.tls_cert).resolve(), Path(args.tls_key).resolve())
            missing = [str(p) for p in ingress_tls if not p.is_file()]
            if missing:
                return _fail(f"no such file: {', '.join(missing)}", 2)
        extra_env = {}
        if args.router_policy:
            from services.router.scheduling.profiles import PROFILES

            if args.router_policy not in PROFILES:
                return _fail(f"--router-policy must be one of {', '.join(PROFILES)}, got {args.router_policy!r}", 2)
            extra_env["GAAS_ROUTER_POLICY"] = args.router_policy
        from gaas.ops.traces import TraceError, TraceTarget

        trace, trace_sink = None, False
        try:
            if args.trace == "local":
                trace, trace_sink = TraceTarget(topo.host, topo.trace_port, args.trace_sample), True
            elif args.trace:
                trace = TraceTarget.parse(args.trace, args.trace_sample)
        except TraceError as exc:
            return _fail(str(exc), 2)
        mesh = Mesh(
            topo,
            trace=trace,
            trace_sink=trace_sink,
            run_dir=run_dir,
            deploy_file=Path(args.deploy),
            redis_url=args.redis_url,
            progress=_say,
            extra_env=extra_env,
            topology_file=Path(args.topology),
            ingress_tls=ingress_tls,
        )
        for name in {str(w.options["model"]) for w in topo.of("worker")}:
            mesh.spec.model(name)  # an unknown model is refused here, with the deployment's names
    except (TopologyError, SpecError, MeshError) as exc:
        return _fail(str(exc), 2)

    stop = threading.Event()

    def on_signal(signum, frame) -> None:
        if not stop.is_set():
            _say(f"{signal.Signals(signum).name} received: stopping the mesh")
        stop.set()

    # Explicitly, both: a shell that started us in the background may have SIGINT ignored.
    signal.signal(signal.SIGINT, on_signal)
    signal.signal(signal.SIGTERM, on_signal)

    started = time.monotonic()
    services = len(topo.instances)
    _say(f"starting {services} service instances and {services + 1} Envoys (logs in {run_dir / 'logs'})")
    try:
        mesh.start()
        health = _wait_ready(mesh, stop, args.timeout)
    except MeshError as exc:
        _fail(str(exc))
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
        _fail(f"cannot set up the demo tenant: {exc}")
        mesh.stop()
        return 1
    elapsed = time.monotonic() - started
    ingress = topo.ingress
    model = mesh.served_models[0]
    if args.json:
        print(json.dumps({"ready": True, "ingress": ingress, "seconds": round(elapsed, 1), "demo_key_file":
                          str(run_dir / DEMO_KEY_FILE), "models": mesh.served_models, "traces_file": str(mesh.traces_file) if trace_sink else None,
                          **health.to_dict()}), flush=True)
    else:
        workers = ", ".join(f"{w['worker_id']} ({w['device']})" for w in health.workers)
        print(
            f"\nGaaS is up in {elapsed:.1f} s: {services} services, {services + 1} Envoys, workers: {workers}\n"
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
        mesh.supervise(_say)
    _say("stopping (services drain first, then the Envoys)")
    mesh.stop()
    _say("stopped; nothing left running")
    return 0


def _wait_ready(mesh, stop: threading.Event, timeout: float):
    """mesh.wait_ready, but giving up early when a signal arrives."""
    from gaas.launcher.mesh import MeshError

    result: dict = {}

    def waiter() -> None:
        try:
            result["health"] = mesh.wait_ready(timeout)
        except MeshError as exc:
            result["error"] = exc
        finally:
            stop_waiting.set()

    stop_waiting = threading.Event()
    threading.Thread(target=waiter, daemon=True).start()
    while not stop_waiting.wait(0.2):
        if stop.is_set():
            mesh.interrupt()
            return None
    if "error" in result:
        raise result["error"]
    return result["health"]


# ------------------------------------------------------------------- generate


def cmd_generate(args) -> int:
    from gaas.sdk.client import GaasClient, GaasError

    target = _ingress(args)
    prompt = args.prompt
    if prompt == "-":
        prompt = sys.stdin.read()
    started = time.perf_counter()
    first = None
    tokens = 0
    text: list[str] = []
    final = None
    with GaasClient(target, api_key=_api_key(args), **_ingress_tls(args)) as client:
        try:
            stream = client.generate(
                prompt,
                # The mesh's own model unless one is named (the router would take the deployment's default).
                model=args.model or ((_state(Path(args.run_dir)) or {}).get("models") or [""])[0],
                max_tokens=args.max_tokens,
                temperature=args.temperature,
                top_p=args.top_p,
                seed=args.seed,
                stop=args.stop or (),
                priority=args.priority,
                timeout=args.timeout,
                session_id=args.session or "",
                messages=[("user", prompt)] if args.chat else None,
            )
            try:
                for chunk in stream:
                    if chunk.token_ids and first is None:
                        first = time.perf_counter()
                    tokens += len(chunk.token_ids)
                    text.append(chunk.text)
                    if not args.json:
                        sys.stdout.write(chunk.text)
                        sys.stdout.flush()
                    if chunk.finish_reason:
                        final = chunk
            except KeyboardInterrupt:
                stream.cancel()
                print(file=sys.stderr)
                return _fail("cancelled", 130)
        except GaasError as exc:
            if exc.code == "UNAVAILABLE" and "connect" in exc.message.lower():
                return _fail(f"nothing answers at {target}: is the mesh up? (`make run` / `gaas up`)")
            return _fail(f"{exc.code}: {exc.message}")
    elapsed = time.perf_counter() - started
    ttft_ms = (first - started) * 1000 if first else None
    decode_s = elapsed - (first - started) if first else 0
    rate = (tokens - 1) / decode_s if tokens > 1 and decode_s > 0 else None
    summary = {
        "text": "".join(text),
        "ttft_ms": round(ttft_ms, 2) if ttft_ms is not None else None,
        "tokens": tokens,
        "tokens_per_s": round(rate, 1) if rate else None,
        "seconds": round(elapsed, 4),
    }
    if final is not None:
        from gaas.v1 import common_pb2

        summary.update(
            request_id=final.request_id,
            finish_reason=common_pb2.FinishReason.Name(final.finish_reason).removeprefix("FINISH_REASON_").lower(),
            model=final.model,
            model_version=final.model_version,
            worker=final.worker_id,
            usage={
                "prompt_tokens": final.usage.prompt_tokens,
                "cached_tokens": final.usage.cached_tokens,
                "completion_tokens": final.usage.completion_tokens,
            },
        )
        if final.timings.total_ms:
            from gaas.contracts import latency

            summary["latency_ms"] = latency.as_dict(final.timings)
        if final.timings.trace_id:
            summary["trace_id"] = final.timings.trace_id
        if final.HasField("session"):
            summary["session"] = _session_turn(final.session)
    if args.json:
        print(json.dumps(summary))
    else:
        parts = [
            f"TTFT {summary['ttft_ms']} ms" if ttft_ms is not None else "no tokens",
            f"{tokens} tokens",
        ]
        if rate:
            parts.append(f"{rate:.1f} tokens/s")
        if final is not None:
            parts += [f"{summary['finish_reason']}", f"{final.model} {final.model_version} on {final.worker_id}"]
        print(f"\n-- {' | '.join(parts)}", file=sys.stderr)
        if final is not None and final.HasField("session"):
            s = final.session
            dropped = (f"; {s.dropped_turns} oldest turn(s), about {s.dropped_tokens} tokens, dropped to fit the model's "
                       "context" if s.dropped_turns else "")
            print(f"-- session {s.session_id}{' (new)' if s.created else ''}: version {s.version}, {s.turns} turn(s), "
                  f"{s.context_tokens} tokens of context{dropped}", file=sys.stderr)
        if args.explain:
            _explain(final, elapsed)
    return 0


def _session_turn(s) -> dict:
    return {"id": s.session_id, "version": s.version, "turns": s.turns, "context_tokens": s.context_tokens,
            "created": s.created, "dropped_turns": s.dropped_turns, "dropped_tokens": s.dropped_tokens}


def _session_dict(s) -> dict:
    from google.protobuf.json_format import MessageToDict

    return MessageToDict(s, preserving_proto_field_name=True, always_print_fields_with_no_presence=True)


def _session_call(args, method: str, *params):
    """A session call: as the API key's tenant through the ingress, or with --tenant as the mesh's
    operator through router-0's sidecar; (result, None) or (None, exit code)."""
    if getattr(args, "tenant", None):
        from gaas.sdk.admin import RouterAdmin
        from gaas.contracts.errors import GaasError

        address = _topology(args, _state(Path(args.run_dir))).of("router")[0].inbound
        try:
            with RouterAdmin(address) as router:
                return getattr(router, method)(args.tenant, *params), None
        except GaasError as exc:
            return None, _fail(f"{exc.code}: {exc.message}", 1)
    return _client_call(args, lambda c: getattr(c, method)(*params))


def _client_call(args, fn):
    """fn(client) against the ingress with the tenant's API key; (result, None) or (None, exit code)."""
    from gaas.sdk.client import GaasClient, GaasError

    target = _ingress(args)
    try:
        with GaasClient(target, api_key=_api_key(args), **_ingress_tls(args)) as client:
            return fn(client), None
    except GaasError as exc:
        if exc.code == "UNAVAILABLE" and "connect" in exc.message.lower():
            return None, _fail(f"nothing answers at {target}: is the mesh up? (`make run` / `gaas up`)")
        return None, _fail(f"{exc.code}: {exc.message}")


def _when(ms: int) -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(ms / 1000)) if ms else "-"


def cmd_session_list(args) -> int:
    rows, err = _session_call(args, "list_sessions", args.limit)
    if err is not None:
        return err
    if args.json:
        print(json.dumps([_session_dict(s) for s in rows], indent=2))
        return 0
    if not rows:
        print("no sessions (a request naming a session_id starts one)")
        return 0
    print(f"{'session':<36} {'model':<14} {'kind':<5} {'ver':>5} {'turns':>6} {'tokens':>8} {'worker':<10} "
          f"{'last turn':<19} {'expires':<19}")
    for s in rows:
        busy = " *" if s.turn_in_progress else ""
        print(f"{s.session_id:<36} {s.model:<14} {s.kind:<5} {s.version:>5} {s.turns:>6} {s.context_tokens:>8} "
              f"{s.worker_id:<10} {_when(s.updated_unix_ms):<19} {_when(s.expires_unix_ms):<19}{busy}")
    if any(s.turn_in_progress for s in rows):
        print("* a turn is in progress")
    return 0


def cmd_session_show(args) -> int:
    s, err = _session_call(args, "get_session", args.session_id)
    if err is not None:
        return err
    if args.json:
        print(json.dumps(_session_dict(s), indent=2))
        return 0
    print(f"session {s.session_id}: {s.kind} with {s.model}, version {s.version}")
    print(f"  turns {s.turns} in context ({s.committed_turns} committed, {s.dropped_turns} dropped to fit), "
          f"{s.context_tokens} tokens; last served by {s.worker_id or '-'}")
    print(f"  started {_when(s.created_unix_ms)}, last turn {_when(s.updated_unix_ms)}, expires "
          f"{_when(s.expires_unix_ms)}{'; a turn is in progress' if s.turn_in_progress else ''}")
    for m in s.messages:
        text = m.content if len(m.content) <= 400 else m.content[:400] + f"... ({len(m.content)} characters)"
        print(f"\n[{m.role}]\n{text}")
    return 0


def cmd_session_delete(args) -> int:
    _, err = _session_call(args, "delete_session", args.session_id)
    if err is not None:
        return err
    print(f"deleted session {args.session_id}")
    return 0


def _explain(final, elapsed: float) -> None:
    """Where the request's time went, as the mesh measured it (gaas.contracts.latency)."""
    from gaas.contracts import latency

    if final is None or not final.timings.total_ms:
        print("-- no latency decomposition came back (the request did not finish)", file=sys.stderr)
        return
    t = final.timings
    print(f"-- where the time went: {elapsed * 1000:.2f} ms here (connecting included), {t.total_ms:.2f} ms of it "
          f"measured in the mesh (ingress arrival to last token)", file=sys.stderr)
    for part in latency.PARTS:
        ms = latency.part_ms(t, part)
        extra = {"queue": f" (router queue {t.router_queue_ms:.2f})",
                 "net": f" (ingress to router {t.ingress_ms:.2f})"}.get(part, "")
        print(f"   {part:<8}{ms:>10.2f} ms {ms / t.total_ms:>6.1%}  {latency.MEANING[part]}{extra}", file=sys.stderr)
    if t.trace_id:
        print(f"-- its trace, hop by hop: gaas trace {t.trace_id}", file=sys.stderr)


# --------------------------------------------------------------------- status


def cmd_trace(args) -> int:
    from gaas.ops import traces

    path = Path(args.file) if args.file else Path(args.run_dir) / traces.TRACES_FILE
    if not path.is_file():
        state = _state(Path(args.run_dir)) or {}
        if state.get("trace_endpoint") and not state.get("traces_file"):
            return _fail(f"this mesh sends its spans to {state['trace_endpoint']}: look for them there")
        return _fail(f"no traces collected at {path}: start the mesh with `gaas up --trace` (or give --file)")
    collected = traces.load(path)
    if not collected:
        return _fail(f"{path} holds no spans yet: send a request first (spans arrive within a few seconds)")
    if args.list:
        shown = list(collected.values())[-args.limit:]
        if args.json:
            print(json.dumps([{"trace_id": t.trace_id, "start_ns": t.start_ns, "duration_ms": round(t.duration_ms, 3),
                               "spans": len(t.spans), "services": t.services(), "request_ids": sorted(t.request_ids())}
                              for t in shown]))
            return 0
        print(f"{'trace id':<32}  {'spans':>5} {'ms':>9}  {'started':<12}  request")
        for t in shown:
            started = time.strftime("%H:%M:%S", time.localtime(t.start_ns / 1e9))
            print(f"{t.trace_id:<32}  {len(t.spans):>5} {t.duration_ms:>9.2f}  {started:<12}  "
                  f"{', '.join(sorted(t.request_ids())) or '-'}")
        return 0
    try:
        trace = traces.find(collected, args.key) if args.key else list(collected.values())[-1]
    except traces.TraceError as exc:
        return _fail(str(exc))
    if args.chrome:
        Path(args.chrome).write_text(json.dumps(traces.chrome_events(trace)))
        _say(f"wrote {args.chrome}: open it in https://ui.perfetto.dev or chrome://tracing")
        return 0
    if args.json:
        print(json.dumps({"trace_id": trace.trace_id, "spans": [
            {"span_id": s.span_id, "parent_span_id": s.parent_id, "service": s.service, "name": s.name,
             "start_ns": s.start_ns, "end_ns": s.end_ns, "attributes": s.attributes} for s in trace.spans]}))
        return 0
    print(traces.waterfall(trace))
    return 0


def cmd_status(args) -> int:
    from gaas.ops import probe

    state = _state(Path(args.run_dir))
    topo = _topology(args, state)
    health = probe.probe(topo, Path(args.run_dir).resolve(), timeout=args.timeout)
    if args.json:
        print(json.dumps({**health.to_dict(), "ingress_path": topo.ingress_path, "billing": _billing_status(topo),
                          "flow": [_router_flow(r.inbound) for r in topo.of("router")],
                          "running_from": str(args.run_dir) if state else None}, indent=2))
        return 0 if health.healthy else 1
    path = ("generations stream from the worker the router picks at the ingress" if topo.ingress_path == "direct"
            else "generations stream through the router")
    print(f"ingress  {health.ingress:<22} {'READY' if health.ingress_ready else 'DOWN':<12} {path}")
    for i in health.instances:
        sidecar = "sidecar ready" if i.sidecar_ready else "sidecar DOWN"
        line = f"{i.name:<10} {i.address:<22} {i.health:<12} {sidecar}"
        if i.detail and i.health != "SERVING":
            line += f"  ({i.detail})"
        print(line)
    if health.workers:
        print("\nregistered workers:")
        for w in health.workers:
            print(f"  {w['worker_id']:<10} {w['address']:<22} {w['model']} {w['model_version']}  {w['backend']} on {w['device']}  {w['state']}")
            load = w["load"]
            mem = (f", memory {load['device_memory_used'] / 2**30:.1f}/{load['device_memory_total'] / 2**30:.1f} GiB"
                   if load["device_memory_total"] else "")
            print(f"  {'':<10} {load['running']} running, {load['waiting']} waiting, KV cache "
                  f"{load['kv_cache_usage']:.0%} of {load['kv_cache_blocks']} blocks used, {w['cached_blocks']} "
                  f"blocks indexed{mem}, device {load['device_utilization']:.0%} busy")
    flows = _router_flows(topo)
    for f in flows:
        print(f"\n{f['router']}: flow control {'on' if f['qos_enabled'] else 'OFF (GAAS_QOS=off)'}")
        print("  queue  " + " | ".join(
            f"{b['band']} {b['waiting']} waiting (shed {b['shed']}, timed out {b['timed_out']}, "
            f"waited p95 {b['wait_p95_ms']:.0f} ms)" for b in f["bands"]))
        for w in f["workers"]:
            breaker = w["breaker"] if w["breaker"] == "closed" else w["breaker"].upper()
            print(f"  {w['worker_id']:<10} window {w['window']:g} ({w['in_flight']} in flight, {w['window_shrinks']} "
                  f"shrinks, {w['window_grows']} grows)  breaker {breaker} ({w['breaker_trips']} trips, first token "
                  f"within {w['ttft_threshold_ms']:,} ms)")
    billing = _billing_status(topo)
    if billing is not None:
        if billing["stripe_enabled"]:
            o = billing["outbox"]
            stripe = (f"Stripe sync on: {o['sent']} meter events sent, {o['pending']} waiting, {o['failed']} refused, "
                      f"{o['reconcile']} to reconcile, {o['expired']} expired")
            if billing["last_stripe_error"]:
                stripe += f" (last error: {billing['last_stripe_error']})"
        else:
            stripe = f"Stripe sync off: {billing['stripe_disabled_reason']}"
        print(f"\nbilling: {billing['ledger_rows']:,} requests in the ledger, {billing['stream_backlog']:,} usage events "
              f"waiting, {billing['dead_letters']} dead letters\n  {stripe}")
    if not state and not any(i.health == "SERVING" for i in health.instances):
        print("\nno mesh seems to be running here: start one with `make run` (or `gaas up`)")
    return 0 if health.healthy else 1


def cmd_top(args) -> int:
    from gaas.cli import top
    from gaas.ops import probe

    state = _state(Path(args.run_dir))
    topo = _topology(args, state)
    if args.interval <= 0:
        return _fail("--interval must be more than 0 seconds", 2)

    def read() -> tuple[dict, list[dict]]:
        health = probe.probe(topo, Path(args.run_dir).resolve(), timeout=args.timeout).to_dict()
        return health, _router_flows(topo)

    try:
        top.run(read, args.interval, args.once)
    except KeyboardInterrupt:
        pass
    return 0


def _router_flows(topo) -> list[dict]:
    """The flow control of every router that answers."""
    return [f for f in (_router_flow(r.inbound) for r in topo.of("router")) if f is not None]


def _router_flow(address: str) -> dict | None:
    from gaas.sdk.admin import router_flow

    return router_flow(address)


def _billing_status(topo) -> dict | None:
    """Billing's figures (usage stream, ledger, Stripe sync), None when it does not answer."""
    from gaas.sdk.admin import BillingAdmin
    from gaas.contracts.errors import GaasError

    instances = topo.of("billing")
    if not instances:
        return None
    try:
        with BillingAdmin(instances[0].inbound) as billing:
            return billing.status()
    except GaasError:
        return None


def cmd_kv_stats(args) -> int:
    from gaas.ops import probe

    topo = _topology(args, _state(Path(args.run_dir)))
    kvs = topo.of("kvcache")
    stats = probe.kv_stats(kvs[0].inbound, timeout=args.timeout) if kvs else None
    if stats is None:
        return _fail(f"the KV directory at {kvs[0].inbound if kvs else '?'} does not answer: is the mesh up? (`gaas status`)")
    if args.json:
        print(json.dumps(stats, indent=2))
        return 0
    s = stats
    print(f"KV directory: {s['blocks']} blocks indexed on {s['workers']} worker(s), {s['events']} event batches applied")
    for w in s["per_worker"]:
        print(f"  {w['worker_id']:<12} {w['blocks']:>8} blocks  {w['unreachable_blocks']:>6} unreachable  "
              f"{w['provisional_blocks']:>5} provisional  (epoch {w['epoch']}, last batch {w['last_seq']})")
    for t in s["per_tenant"]:
        print(f"  tenant {t['tenant'] or '(unknown)':<20} {t['blocks']:>8} blocks")
    print(f"lookups {s['lookups']}: {s['hit_blocks']} of {s['lookup_blocks']} blocks held by the best worker "
          f"(hit ratio {s['hit_ratio']:.1%}); fragmentation {s['fragmentation']:.1%} (blocks no lookup can reach)")
    provisioned = int(s["provisioned"])
    print(f"provisions {provisioned}: {s['provision_confirmed']} confirmed by the engines, {s['provision_expired']} "
          f"expired unconfirmed; {s['unchained_blocks']} blocks unchained, {s['wrong_size_blocks']} of the wrong size, "
          f"{s['resyncs']} resyncs, {s['sequence_gaps']} sequence gaps")
    if provisioned >= 20 and int(s["provision_expired"]) > provisioned // 2:
        print("warning: most provisions were never confirmed: the routers' block hashes and the engines' blocks "
              "disagree (tokenization, cache salt or block size)", file=sys.stderr)
    if int(s["wrong_size_blocks"]):
        print("warning: engines store blocks of another size than they registered with", file=sys.stderr)
    return 0


def cmd_kv_public_add(args) -> int:
    if (args.text is None) == (args.file is None):
        return _fail("give the prefix with exactly one of --text and --file", 2)
    text = args.text if args.text is not None else Path(args.file).read_text()
    prefix, err = _admin_call(args, lambda a: a.add_public_prefix(args.model, text))
    if err is not None:
        return err
    if args.json:
        print(json.dumps(prefix))
    else:
        print(f"{prefix['prefix_id']}: prompts of {prefix['model']} that begin with these {len(text)} characters are "
              "cached for every tenant alike (routers pick it up within a second)")
    return 0


def cmd_kv_public_list(args) -> int:
    prefixes, err = _admin_call(args, lambda a: a.list_public_prefixes(args.model or ""))
    if err is not None:
        return err
    if args.json:
        print(json.dumps(prefixes, indent=2))
    else:
        for p in prefixes:
            preview = p["text"][:60].replace("\n", " ")
            print(f"{p['prefix_id']:<22} {p['model']:<16} {len(p['text']):>6} chars  {preview!r}")
    return 0


def cmd_kv_public_remove(args) -> int:
    _, err = _admin_call(args, lambda a: a.remove_public_prefix(args.prefix_id))
    if err is not None:
        return err
    print(f"removed {args.prefix_id}: its prompts are cached per tenant again")
    return 0


def cmd_models(args) -> int:
    from gaas.sdk.client import GaasClient, GaasError

    with GaasClient(_ingress(args), api_key=_api_key(args), **_ingress_tls(args)) as client:
        try:
            models = client.list_models()
        except GaasError as exc:
            return _fail(f"{exc.code}: {exc.message}")
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


# ------------------------------------------------------------- tenants, keys


def _admin_call(args, fn):
    from gaas.sdk.admin import Admin
    from gaas.sdk.client import GaasError

    try:
        with Admin(_control(args)) as admin:
            return fn(admin), None
    except GaasError as exc:
        return None, _fail(f"{exc.code}: {exc.message}", 1)


def cmd_tenant_create(args) -> int:
    tenant, err = _admin_call(args, lambda a: a.create_tenant(args.name, args.tier))
    if err is not None:
        return err
    print(json.dumps(tenant) if args.json else f"created tenant {tenant['name']} ({tenant['tier']}); "
          f"give it a key with: gaas key create {tenant['name']}")
    return 0


def cmd_tenant_list(args) -> int:
    tenants, err = _admin_call(args, lambda a: a.list_tenants())
    if err is not None:
        return err
    if args.json:
        print(json.dumps(tenants, indent=2))
    else:
        for t in tenants:
            print(f"{t['name']:<24} {t['tier']:<7} {_limits_text(t)}")
    return 0


def _limit(text: str) -> int | None:
    """A quota from the command line: a whole number (0: unlimited), or 'default' (the tier's)."""
    if text == "default":
        return None
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"a whole number (0: unlimited) or 'default', not {text!r}") from None
    if value < 0:
        raise argparse.ArgumentTypeError("must be 0 (unlimited) or more")
    return value


def _limits_text(t: dict) -> str:
    own = set(t.get("own_limits") or ())
    parts = []
    for key, label in (("rpm", "requests/min"), ("tpm", "tokens/min"), ("concurrency", "at once")):
        value = t["limits"][key]
        parts.append(f"{value:,} {label}" if value else f"unlimited {label}")
        if key not in own:
            parts[-1] += " (tier)"
    return ", ".join(parts)


def cmd_tenant_set(args) -> int:
    limits = {k: getattr(args, k) for k in ("rpm", "tpm", "concurrency") if getattr(args, k) is not _UNSET}
    if args.tier is None and args.stripe_customer is None and not limits:
        return _fail("nothing to change: give --tier, --stripe-customer, --rpm, --tpm and/or --concurrency", 2)
    tenant, err = _admin_call(args, lambda a: a.update_tenant(args.name, args.tier, args.stripe_customer, limits))
    if err is not None:
        return err
    if args.json:
        print(json.dumps(tenant))
    else:
        customer = tenant["stripe_customer"] or "no Stripe customer (its usage is not reported to Stripe)"
        print(f"tenant {tenant['name']}: {tenant['tier']}, {customer}\n  quotas: {_limits_text(tenant)}")
    return 0


def cmd_key_create(args) -> int:
    result, err = _admin_call(args, lambda a: a.create_key(args.tenant))
    if err is not None:
        return err
    key, secret = result
    if args.json:
        print(json.dumps({**key, "api_key": secret}))
    else:
        print(secret)
        _say(f"API key {key['key_id']} for tenant {key['tenant']}: shown this once, only its hash is kept")
    return 0


def cmd_key_list(args) -> int:
    keys, err = _admin_call(args, lambda a: a.list_keys(args.tenant or ""))
    if err is not None:
        return err
    if args.json:
        print(json.dumps(keys, indent=2))
    else:
        for k in keys:
            state = "revoked" if k["revoked"] else "active"
            print(f"{k['key_id']:<18} {k['tenant']:<20} {k['prefix']}...  {state}")
    return 0


def cmd_key_revoke(args) -> int:
    key, err = _admin_call(args, lambda a: a.revoke_key(args.key_id))
    if err is not None:
        return err
    print(json.dumps(key) if args.json else f"revoked {key['key_id']} of tenant {key['tenant']}; "
          "routers refuse it within seconds")
    return 0


# -------------------------------------------------------------------- billing


def _billing_call(args, fn):
    from gaas.sdk.admin import BillingAdmin
    from gaas.sdk.client import GaasError

    try:
        with BillingAdmin(_billing(args)) as billing:
            return fn(billing), None
    except GaasError as exc:
        return None, _fail(f"{exc.code}: {exc.message}", 1)


def _tokens(n: int) -> str:
    return f"{n:,}"


def _usd(amount: float) -> str:
    from gaas.contracts import pricing

    return pricing.format_usd(pricing.micros(amount))


def cmd_usage(args) -> int:
    from gaas.contracts import usage as metering
    from gaas.contracts.errors import GaasError

    try:
        now = metering.now_ms()
        start = metering.parse_time(args.since or "", "--since", now)
        end = metering.parse_time(args.until or "", "--until", now)
    except GaasError as exc:
        return _fail(exc.message, 2)
    if end and end <= start:
        return _fail("--until must be after --since", 2)
    report, err = _billing_call(args, lambda b: b.usage(args.tenant, start, end, args.by or ""))
    if err is not None:
        return err
    if args.json:
        print(json.dumps(report, indent=2))
        return 0
    header = f"{args.by or '':<26} {'requests':>10} {'prompt':>14} {'cached':>14} {'completion':>14} {'cost USD':>12}"
    print(header)

    def line(r: dict, label: str) -> None:
        print(f"{label:<26} {r['requests']:>10,} {_tokens(r['prompt_tokens']):>14} {_tokens(r['cached_tokens']):>14} "
              f"{_tokens(r['completion_tokens']):>14} {r['cost_usd']:>12.6f}")

    for r in report["rows"]:
        line(r, r["group"] or "(none)")
    line(report["total"], "total")
    return 0


def cmd_budget_set(args) -> int:
    budget, err = _billing_call(args, lambda b: b.set_budget(args.tenant, args.amount))
    if err is not None:
        return err
    if args.json:
        print(json.dumps(budget))
    elif budget["amount_usd"]:
        print(f"tenant {budget['tenant']}: monthly budget {_usd(budget['amount_usd'])}, {_usd(budget['spent_usd'])} "
              f"spent in {budget['month']}; routers enforce it within seconds")
    else:
        print(f"tenant {budget['tenant']}: no budget (requests are not limited by spend)")
    return 0


def cmd_budget_show(args) -> int:
    budget, err = _billing_call(args, lambda b: b.get_budget(args.tenant))
    if err is not None:
        return err
    if args.json:
        print(json.dumps(budget))
    else:
        amount = _usd(budget["amount_usd"]) if budget["amount_usd"] else "none"
        print(f"tenant {budget['tenant']}: monthly budget {amount}, {_usd(budget['spent_usd'])} spent in {budget['month']}")
    return 0


def cmd_invoice_preview(args) -> int:
    inv, err = _billing_call(args, lambda b: b.invoice_preview(args.tenant, args.month or ""))
    if err is not None:
        return err
    if args.json:
        print(json.dumps(inv, indent=2))
        return 0
    print(f"invoice preview: tenant {inv['tenant']}, {inv['month'][:4]}-{inv['month'][4:]}, {inv['requests']:,} requests")
    for x in inv["lines"]:
        print(f"  {x['model']:<20} {x['kind']:<13} {x['tokens']:>14,} tokens  ${x['amount_usd']:>12.6f}")
    print(f"  {'total':<20} {'':<13} {'':>14}         ${inv['total_usd']:>12.6f}")
    b = inv["budget"]
    print(f"budget: {_usd(b['amount_usd']) + ' a month' if b['amount_usd'] else 'none'}")
    if inv["stripe_customer"]:
        print(f"Stripe customer {inv['stripe_customer']}: {inv['meter_events_sent']} meter events sent, "
              f"{inv['meter_events_pending']} waiting")
    else:
        print(f"no Stripe customer: set one with `gaas tenant set {inv['tenant']} --stripe-customer cus_...`")
    return 0


# ---------------------------------------------------------------------- model


def cmd_model_build(args) -> int:
    from gaas.model.build import PRESETS, build_model, is_built

    out = Path(args.out or ROOT / "models" / f"gaas-{args.preset}")
    if args.preset not in PRESETS:
        return _fail(f"unknown preset {args.preset!r}; choose one of {', '.join(PRESETS)}", 2)
    if is_built(out) and not args.force:
        _say(f"{out} already holds a built model (use --force to rebuild)")
        return 0
    build_model(args.preset, out, seed=args.seed, progress=_say)
    print(out)
    return 0


def cmd_envoy_render(args) -> int:
    from gaas.envoy import config as envoyconf
    from gaas.ops import protogen

    topo = _topology(args)
    protogen.generate()
    out = Path(args.out)
    from gaas.ops import pki

    from gaas.ops.topology import sockets_root

    run_dir = Path(args.run_dir).resolve()
    files = envoyconf.render(topo, out, protogen.DESCRIPTOR_SET, run_dir / "logs", pki.Authority(run_dir),
                             sockets=sockets_root(run_dir))
    for name, path in files.items():
        print(f"{name:<20} {path}")
    return 0


RESTARTABLE = ("control", "kvcache", "billing", "worker", "router")


def cmd_restart(args) -> int:
    """Restart instances one at a time: SIGTERM (the instance drains: NOT_SERVING, deregistered,
    calls in flight finish), `gaas up` starts it again, and the next waits until it serves."""
    from gaas.ops.probe import grpc_health, list_workers
    from services.router.config import REGISTRY_REFRESH_SECONDS

    run_dir = Path(args.run_dir)
    state = _state(run_dir)
    if state is None:
        return _fail(f"no mesh is running from {run_dir} (start one with `gaas up`, or give --run-dir)", 2)
    topo = _topology(args, state)
    kinds = RESTARTABLE if args.target == "all" else (args.target,)
    instances = [i for k in kinds if k in RESTARTABLE for i in topo.of(k)] if args.target in (*RESTARTABLE, "all") \
        else [i for i in topo.instances if i.name == args.target]
    if not instances:
        names = ", ".join(i.name for i in topo.instances)
        return _fail(f"nothing called {args.target!r} to restart: give a service ({', '.join(RESTARTABLE)}), "
                     f"'all', or an instance ({names})", 2)
    for kind in sorted({i.service for i in instances}):
        if len(topo.of(kind)) == 1:
            print(f"note: {kind} has one replica: requests that need it fail while it restarts; run two "
                  f"(topology replicas, or --workers 2) for a restart nobody notices", file=sys.stderr)
    for inst in instances:
        pid = _state(run_dir)["children"].get(inst.name)
        if not pid:
            return _fail(f"{inst.name} is not among the processes gaas up runs", 1)
        print(f"restarting {inst.name} (pid {pid}): draining", flush=True)
        started = time.monotonic()
        try:
            os.kill(pid, signal.SIGTERM)
        except ProcessLookupError:
            pass
        deadline = started + args.timeout
        while True:
            current = (_state(run_dir) or {}).get("children", {}).get(inst.name)
            if current and current != pid and grpc_health(inst.inbound, timeout=1.0)[0] == "SERVING":
                if inst.service != "worker":
                    break
                # A worker is back once it is registered and routers have had time to see it
                # (two of their refreshes), before the next one leaves.
                if any(w["worker_id"] == inst.name and w["state"] == "SERVING"
                       for w in list_workers(topo.of("control")[0].inbound, 1.0)):
                    time.sleep(REGISTRY_REFRESH_SECONDS * 2)
                    break
            if time.monotonic() > deadline:
                return _fail(f"{inst.name} is not serving {args.timeout:.0f} s after its restart; see "
                             f"{run_dir / 'logs' / (inst.name + '.log')}", 1)
            time.sleep(0.5)
        print(f"{inst.name} serves again (pid {current}) after {time.monotonic() - started:.0f} s", flush=True)
    return 0


# ---------------------------------------------------------------------- main


def _workers_arg(value: str) -> int | str:
    if value == "auto":
        return value
    try:
        n = int(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"a number of workers or auto, got {value!r}") from None
    if n < 1:
        raise argparse.ArgumentTypeError("at least 1 worker")
    return n


def build_parser() -> argparse.ArgumentParser:
    from gaas.model.build import PRESETS

    p = argparse.ArgumentParser(prog="gaas", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")

    def mesh_args(sp, *, workers: bool = True) -> None:
        sp.add_argument("--topology", default=str(DEFAULT_TOPOLOGY), help="topology file (default: deploy/topology.yaml)")
        sp.add_argument("--run-dir", default=str(DEFAULT_RUN_DIR), help="state, logs and generated configs (default: .gaas, or $GAAS_HOME)")
        sp.add_argument("--port-base", type=int, default=None, help="first port of the instances' port blocks (env GAAS_PORT_BASE; default from the topology)")
        sp.add_argument("--ingress-port", type=int, default=None, help="ingress port (env GAAS_INGRESS_PORT; default 8080)")
        sp.add_argument("--ingress-path", choices=("router", "direct"), default=None,
                        help="how OpenAI generations reach their worker: router, through the router, or direct, from "
                        "the ingress straight to the worker the router picked there (the tokens never pass through "
                        "the router) (env GAAS_INGRESS_PATH; default from the topology: router)")
        if workers:
            sp.add_argument("--workers", type=_workers_arg, default=None,
                            help="worker replicas, or auto: one per GPU on a GPU host, else one (env GAAS_WORKERS; "
                            "default from the topology: auto)")

    up = sub.add_parser("up", help="start the whole mesh and keep it running until Ctrl-C or SIGTERM",
                        description="Start Redis (unless one answers), every service, one Envoy sidecar per "
                        "instance and the ingress Envoy; print where to send requests; stop it all on Ctrl-C/SIGTERM.")
    mesh_args(up)
    up.add_argument("--deploy", default=str(DEFAULT_DEPLOY), help="deployment file applied to control (default: deploy/gaas.yaml)")
    up.add_argument("--redis-url", default=os.environ.get("GAAS_REDIS_URL", DEFAULT_REDIS),
                    help="Redis to use; started locally when nothing answers (env GAAS_REDIS_URL)")
    up.add_argument("--model", default=os.environ.get("GAAS_MODEL") or None,
                    help="the model the workers serve, by name from the deployment file (env GAAS_MODEL; "
                    "default from the topology)")
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

    tr = sub.add_parser("trace", help="show a request's trace across the Envoys and services (gaas up --trace)",
                        description="Read the spans `gaas up --trace` collected (<run dir>/traces.jsonl) and show one "
                        "request's trace as a waterfall: every Envoy and service it crossed, parented, with the "
                        "routing decision's attributes. Without KEY: the latest trace.")
    tr.add_argument("key", nargs="?", help="a trace id (or its first 6+ characters) or a request id (gaas generate "
                    "--explain prints the trace id)")
    tr.add_argument("--list", action="store_true", help="list the latest traces instead")
    tr.add_argument("--limit", type=int, default=20, help="how many --list shows (20)")
    tr.add_argument("--chrome", metavar="FILE", help="write the trace as Chrome trace events (for ui.perfetto.dev)")
    tr.add_argument("--json", action="store_true", help="print JSON instead")
    tr.add_argument("--file", help="a traces file other than the running mesh's")
    tr.add_argument("--run-dir", default=str(DEFAULT_RUN_DIR), help=argparse.SUPPRESS)
    tr.set_defaults(func=cmd_trace)

    gen = sub.add_parser("generate", help="stream a generation through the ingress",
                         description="Stream a generation: the text as it arrives, then TTFT, tokens and tokens/s.")
    gen.add_argument("prompt", help="prompt text ('-' reads standard input)")
    gen.add_argument("--model", default="", help="model name (default: what the running mesh serves)")
    gen.add_argument("--max-tokens", type=int, default=64, help="most tokens to generate (64)")
    gen.add_argument("--temperature", type=float, default=None, help="sampling temperature (engine default 1.0; 0 = greedy)")
    gen.add_argument("--top-p", type=float, default=None, help="nucleus sampling mass")
    gen.add_argument("--seed", type=int, default=None, help="fix the sampling seed")
    gen.add_argument("--stop", action="append", help="stop string (repeatable)")
    gen.add_argument("--priority", choices=["low", "normal", "high"], default="normal")
    gen.add_argument("--timeout", type=float, default=120.0, help="give up after this many seconds (120)")
    gen.add_argument("--ingress", default=None, help="host:port of the ingress (env GAAS_INGRESS; default: the running mesh's)")
    gen.add_argument("--api-key", default=None, help="API key (env GAAS_API_KEY; default: the demo key `gaas up` saved)")
    gen.add_argument("--run-dir", default=str(DEFAULT_RUN_DIR), help=argparse.SUPPRESS)
    gen.add_argument("--json", action="store_true", help="print one JSON object (text, timings, usage, latency_ms) instead")
    gen.add_argument("--session", default=None, metavar="ID",
                     help="make this a turn of session ID (started by its first turn): GaaS keeps the conversation, "
                     "send only what is new")
    gen.add_argument("--chat", action="store_true",
                     help="send the prompt as a user message (the model's chat template), not as raw text")
    gen.add_argument("--explain", action="store_true",
                     help="after the text, print where the request's time went: tenant (auth, quota), router, queue, "
                     "prefill, decode, net")
    gen.set_defaults(func=cmd_generate)

    session = sub.add_parser(
        "session", help="your multi-turn sessions (the API key's tenant)",
        description="Sessions are conversations GaaS keeps in Redis for a tenant: a request naming a session_id "
        "(gRPC field, the x-gaas-session header or the body's session_id) is a turn of it, and only its new part needs "
        "sending. These commands act with the API key's tenant (GET/DELETE /v1/gaas/sessions at the ingress); another "
        "tenant's session id is not found. The mesh's operator names any tenant with --tenant instead.")
    ssub = session.add_subparsers(dest="session_command", required=True, metavar="ACTION")

    def ingress_args(sp) -> None:
        sp.add_argument("--tenant", default=None,
                        help="as the mesh's operator: this tenant's sessions (through the router's sidecar; no API key)")
        sp.add_argument("--ingress", default=None, help="host:port of the ingress (env GAAS_INGRESS; default: the running mesh's)")
        sp.add_argument("--api-key", default=None, help="API key (env GAAS_API_KEY; default: the demo key `gaas up` saved)")
        mesh_args(sp, workers=False)
        sp.add_argument("--json", action="store_true", help="machine-readable output")

    slist = ssub.add_parser("list", help="your sessions, most recent first")
    slist.add_argument("--limit", type=int, default=100, help="most sessions to list (100; at most 1000)")
    ingress_args(slist)
    slist.set_defaults(func=cmd_session_list)
    sshow = ssub.add_parser("show", help="one session with its conversation")
    sshow.add_argument("session_id")
    ingress_args(sshow)
    sshow.set_defaults(func=cmd_session_show)
    sdel = ssub.add_parser("delete", help="forget a session")
    sdel.add_argument("session_id")
    ingress_args(sdel)
    sdel.set_defaults(func=cmd_session_delete)

    st = sub.add_parser("status", help="health of each service instance, Envoy and worker",
                        description="Ask every instance's health service through its sidecar, every Envoy's admin "
                        "/ready, and control's list of registered workers. Exit code 0 when all are healthy.")
    mesh_args(st)
    st.add_argument("--timeout", type=float, default=1.0, help="seconds per probe (1)")
    st.add_argument("--json", action="store_true", help="machine-readable output")
    st.set_defaults(func=cmd_status)

    tp = sub.add_parser("top", help="a live view of workers, queues, KV cache use and tenants",
                        description="Redraw, every few seconds, each worker's load (running, waiting, KV cache use, "
                        "its batching window and breaker, memory), the routers' queues by priority band, and the "
                        "busiest tenants of the last minute. Ctrl-C quits.")
    mesh_args(tp)
    tp.add_argument("--interval", type=float, default=2.0, help="seconds between frames (2)")
    tp.add_argument("--once", action="store_true", help="print one frame and exit")
    tp.add_argument("--timeout", type=float, default=1.0, help="seconds per probe (1)")
    tp.set_defaults(func=cmd_top)

    rs = sub.add_parser("restart", help="restart instances one at a time, each drained first",
                        description="A rolling restart of a running mesh: each instance gets SIGTERM (it stops "
                        "taking requests, finishes those in flight, and a worker deregisters), `gaas up` starts it "
                        "again, and the next one waits until it serves. With two or more replicas of a service "
                        "no request fails.")
    rs.add_argument("target", help="a service (control, kvcache, billing, worker, router), 'all', or one "
                    "instance (e.g. worker-1)")
    rs.add_argument("--timeout", type=float, default=300.0,
                    help="seconds each instance may take to serve again (300: a worker loads its model)")
    mesh_args(rs, workers=False)
    rs.set_defaults(func=cmd_restart)

    models = sub.add_parser("models", help="models the mesh serves, with their ready workers")
    models.add_argument("--ingress", default=None, help="host:port of the ingress")
    models.add_argument("--api-key", default=None, help="API key (env GAAS_API_KEY; default: the demo key)")
    models.add_argument("--run-dir", default=str(DEFAULT_RUN_DIR), help=argparse.SUPPRESS)
    models.add_argument("--json", action="store_true", help="machine-readable output")
    models.set_defaults(func=cmd_models)

    def admin_args(sp) -> None:
        mesh_args(sp, workers=False)
        sp.add_argument("--control", default=None, help="host:port of control (default: control-0's sidecar of the running mesh)")
        sp.add_argument("--json", action="store_true", help="machine-readable output")

    tenant = sub.add_parser("tenant", help="tenants")
    tsub = tenant.add_subparsers(dest="tenant_command", required=True, metavar="ACTION")
    tcreate = tsub.add_parser("create", help="create a tenant")
    tcreate.add_argument("name", help="lower-case letters, digits, '-' and '_'")
    tcreate.add_argument("--tier", choices=["gold", "silver", "bronze"], default="bronze", help="service tier (bronze)")
    admin_args(tcreate)
    tcreate.set_defaults(func=cmd_tenant_create)
    tset = tsub.add_parser("set", help="change a tenant's tier, quotas or Stripe customer",
                           description="Change a tenant's tier (its priority band and default quotas, deploy/gaas.yaml "
                           "qos), its own quotas (enforced across every router within a second; over them requests get "
                           "HTTP 429 rate_limit_exceeded with Retry-After), or the Stripe customer its usage is reported "
                           "to (meter events are sent once each usage window closes; an empty --stripe-customer stops it).")
    tset.add_argument("name")
    tset.add_argument("--tier", choices=["gold", "silver", "bronze"], default=None, help="new service tier")
    tset.add_argument("--stripe-customer", default=None, metavar="CUS_ID", help="Stripe customer id (cus_...); '' removes it")
    for flag, what in (("rpm", "requests per minute"), ("tpm", "tokens per minute (prompt + completion)"),
                       ("concurrency", "requests at once")):
        tset.add_argument(f"--{flag}", type=_limit, default=_UNSET, metavar="N",
                          help=f"its own quota of {what}: N (0: unlimited), or 'default' for its tier's")
    admin_args(tset)
    tset.set_defaults(func=cmd_tenant_set)
    tlist = tsub.add_parser("list", help="list tenants")
    admin_args(tlist)
    tlist.set_defaults(func=cmd_tenant_list)

    key = sub.add_parser("key", help="API keys")
    ksub = key.add_subparsers(dest="key_command", required=True, metavar="ACTION")
    kcreate = ksub.add_parser("create", help="create an API key for a tenant (printed once; only its hash is kept)")
    kcreate.add_argument("tenant")
    admin_args(kcreate)
    kcreate.set_defaults(func=cmd_key_create)
    klist = ksub.add_parser("list", help="list API keys (ids and prefixes, never the keys)")
    klist.add_argument("tenant", nargs="?", default="", help="only this tenant's keys")
    admin_args(klist)
    klist.set_defaults(func=cmd_key_list)
    krevoke = ksub.add_parser("revoke", help="revoke an API key by its id (see `gaas key list`)")
    krevoke.add_argument("key_id")
    admin_args(krevoke)
    krevoke.set_defaults(func=cmd_key_revoke)

    def billing_args(sp) -> None:
        mesh_args(sp, workers=False)
        sp.add_argument("--billing", default=None, help="host:port of billing (default: billing-0's sidecar of the running mesh)")
        sp.add_argument("--json", action="store_true", help="machine-readable output")

    usage = sub.add_parser(
        "usage", help="a tenant's metered usage and cost, from the ledger",
        description="Requests, prompt / cached / completion tokens and cost of a tenant's requests, from the billing "
        "ledger (a request is there about a second after it ends). Times: an ISO 8601 date or time (UTC unless it "
        "names an offset), Unix seconds, or a duration back from now (30m, 24h, 7d). A tenant reads its own with its "
        "API key: GET /v1/gaas/usage?since=7d&by=model at the ingress.")
    usage.add_argument("tenant")
    usage.add_argument("--since", default=None, help="from (inclusive); default: the beginning")
    usage.add_argument("--until", default=None, help="to (exclusive); default: now")
    usage.add_argument("--by", choices=["model", "day", "key"], default=None, help="also break the total down")
    billing_args(usage)
    usage.set_defaults(func=cmd_usage)

    budget = sub.add_parser("budget", help="tenants' monthly budgets (USD)")
    bsub = budget.add_subparsers(dest="budget_command", required=True, metavar="ACTION")
    bset = bsub.add_parser("set", help="set a tenant's monthly budget; 0 removes it",
                           description="Past its budget a tenant's requests are refused (HTTP 429 / RESOURCE_EXHAUSTED, "
                           "naming the budget) within seconds, until the budget is raised or the month (UTC) turns. "
                           "A request is admitted only if its most possible cost still fits.")
    bset.add_argument("tenant")
    bset.add_argument("amount", type=float, help="USD per month (0: no budget)")
    billing_args(bset)
    bset.set_defaults(func=cmd_budget_set)
    bshow = bsub.add_parser("show", help="a tenant's budget and this month's spend")
    bshow.add_argument("tenant")
    billing_args(bshow)
    bshow.set_defaults(func=cmd_budget_show)

    invoice = sub.add_parser("invoice", help="invoices")
    isub = invoice.add_subparsers(dest="invoice_command", required=True, metavar="ACTION")
    ipreview = isub.add_parser("preview", help="a tenant's month so far, as it would be invoiced",
                               description="Lines per model and token kind (input, cached input, output) at the "
                               "prices of deploy/gaas.yaml, the budget, and how much was reported to Stripe.")
    ipreview.add_argument("tenant")
    ipreview.add_argument("--month", default=None, help="YYYYMM (default: this month, UTC)")
    billing_args(ipreview)
    ipreview.set_defaults(func=cmd_invoice_preview)

    kv = sub.add_parser("kv", help="the KV-cache directory")
    kvsub = kv.add_subparsers(dest="kv_command", required=True, metavar="ACTION")
    kvstats = kvsub.add_parser("stats", help="blocks per worker and tenant, lookups, hit ratio, fragmentation",
                               description="The KV directory's figures: blocks indexed per worker and tenant, "
                               "unreachable blocks (fragmentation), lookups and their hit ratio, and whether the "
                               "routers' provisions are confirmed by the engines (if not, their hashes disagree).")
    mesh_args(kvstats, workers=False)
    kvstats.add_argument("--timeout", type=float, default=2.0, help="seconds to wait (2)")
    kvstats.add_argument("--json", action="store_true", help="machine-readable output")
    kvstats.set_defaults(func=cmd_kv_stats)
    public = kvsub.add_parser(
        "public", help="prompt beginnings every tenant shares in the prefix cache (e.g. a common system prompt)",
        description="Sharing is per tenant by default: no tenant hits another's cached blocks. A public prefix (a "
        "chat's system prompt, or the text a completion prompt begins with) is cached for every tenant alike. Its "
        "whole chain of blocks is shared, so tenants sending the same continuation after it share those blocks too.")
    psub = public.add_subparsers(dest="public_command", required=True, metavar="ACTION")
    padd = psub.add_parser("add", help="mark a prompt beginning public")
    padd.add_argument("model", help="the model it applies to")
    padd.add_argument("--text", default=None, help="the system prompt or prompt beginning")
    padd.add_argument("--file", default=None, help="read it from a file instead")
    admin_args(padd)
    padd.set_defaults(func=cmd_kv_public_add)
    plist = psub.add_parser("list", help="list public prefixes")
    plist.add_argument("model", nargs="?", default="", help="only this model's")
    admin_args(plist)
    plist.set_defaults(func=cmd_kv_public_list)
    premove = psub.add_parser("remove", help="make a public prefix per tenant again")
    premove.add_argument("prefix_id")
    admin_args(premove)
    premove.set_defaults(func=cmd_kv_public_remove)

    model = sub.add_parser("model", help="local models")
    msub = model.add_subparsers(dest="model_command", required=True, metavar="ACTION")
    build = msub.add_parser("build", help="build a random-weight Llama model with a trained BPE tokenizer",
                            description="Presets: " + "; ".join(f"{k}: {v.purpose}" for k, v in PRESETS.items()))
    build.add_argument("--preset", default="tiny", help=f"one of {', '.join(PRESETS)} (tiny)")
    build.add_argument("--out", default=None, help="output directory (default: models/gaas-<preset>)")
    build.add_argument("--seed", type=int, default=0, help="weight initialisation seed (0)")
    build.add_argument("--force", action="store_true", help="rebuild even if the directory holds a model")
    build.set_defaults(func=cmd_model_build)

    envoy = sub.add_parser("envoy", help="Envoy configs")
    esub = envoy.add_subparsers(dest="envoy_command", required=True, metavar="ACTION")
    render = esub.add_parser("render", help="write the ingress and sidecar configs the topology produces")
    mesh_args(render)
    render.add_argument("--out", default=str(ROOT / "envoy" / "generated"), help="output directory (envoy/generated)")
    render.set_defaults(func=cmd_envoy_render)
    return p


def main(argv: list[str] | None = None) -> int:
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
            return _fail(str(exc), 2)
        raise


if __name__ == "__main__":
    sys.exit(main())
