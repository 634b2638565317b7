"""`gaas status`: the health of every service instance (through its sidecar), Envoy and registered
worker, the routers' flow control and billing's figures; exit code 0 when all are healthy. Also what
`gaas top` reads of the routers and billing (router_flows)."""

from __future__ import annotations

import json
from pathlib import Path

from gaas.cli.common import add_mesh_args, mesh_state, mesh_topology


def cmd_status(args) -> int:
    from gaas.ops import probe

    state = mesh_state(Path(args.run_dir))
    topo = mesh_topology(args, state)
    health = probe.probe(topo, Path(args.run_dir).resolve(), timeout=args.timeout)
    rollouts, scaled = _rollouts(topo), autoscaled_pools(topo)
    if args.json:
        print(json.dumps({**health.to_dict(), "ingress_path": topo.ingress_path, "billing": _billing_status(topo),
                          "flow": [_router_flow(r.inbound) for r in topo.of("router")], "rollouts": rollouts,
                          "autoscaled": scaled,
                          "running_from": str(args.run_dir) if state else None}, indent=2))
        return 0 if health.healthy else 1
    path = ("generations stream from the worker the router picks at the ingress" if topo.ingress_path == "direct"
            else "generations stream through the router")
    print(f"ingress  {health.ingress:<22} {'READY' if health.ingress_ready else 'DOWN':<12} {path}")
    for i in health.instances:
        sidecar = "sidecar ready" if i.sidecar_ready else "sidecar DOWN"
        shown, detail = i.health, i.detail
        if i.service == "worker" and i.health == "UNREACHABLE" and started_process_runs(state, i.name):
            shown, detail = "STARTING", "its process runs and imports vLLM; it listens once that is done"
        line = f"{i.name:<10} {i.address:<22} {shown:<12} {sidecar}"
        if detail and i.health != "SERVING":
            line += f"  ({detail})"
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
            if load["adapter_slots"]:
                print(f"  {'':<10} LoRA: {len(load['adapters'])} of {load['adapter_slots']} adapters loaded"
                      + (f" ({', '.join(load['adapters'])})" if load["adapters"] else ""))
    for r in rollouts:
        share = (f"{r['weight']}%" if r["state"] != "shadowing" else f"{r['shadow']}% copied (shadow)")
        print(f"\nroll-out: {r['model']} {r['strategy']} of {r['version']} over {r['stable']}: {r['state']}, {share} "
              f"(gaas rollout status {r['model']})")
    for p in scaled:
        a = p["autoscale"]
        print(f"\nautoscaled: {p['model']} {p['version']}: {p['replicas']} worker(s) of {a['min']}-{a['max']}"
              + (f"; last decision: {a['reason']}" if a["reason"] else ""))
    flows = router_flows(topo)
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


def started_process_runs(state: dict | None, name: str) -> bool:
    """Whether the process `gaas up` started as name runs (the same process: its start time too)."""
    from gaas.launcher.children import start_ticks

    pid = ((state or {}).get("children") or {}).get(name)
    return pid is not None and start_ticks(int(pid)) == ((state or {}).get("started") or {}).get(name)


def router_flows(topo) -> list[dict]:
    """The flow control of every router that answers."""
    return [f for f in (_router_flow(r.inbound) for r in topo.of("router")) if f is not None]


def _router_flow(address: str) -> dict | None:
    from gaas.sdk.admin import router_flow

    return router_flow(address)


def _rollouts(topo) -> list[dict]:
    """The models' live roll-outs (their status without the figures and decisions)."""
    from gaas.contracts.errors import GaasError
    from gaas.sdk.admin import Admin

    try:
        with Admin(topo.of("control")[0].inbound) as admin:
            out = []
            for m in admin.models():
                if m["split"]["canary"]:
                    s = admin.rollout(m["name"])
                    out.append({k: s[k] for k in ("model", "stable", "version", "strategy", "state", "weight", "shadow")})
            return out
    except (GaasError, OSError):
        return []


def autoscaled_pools(topo) -> list[dict]:
    """The autoscaled pools: their workers now, bounds and the last decision's reason."""
    from gaas.contracts.errors import GaasError
    from gaas.sdk.admin import Admin

    try:
        with Admin(topo.of("control")[0].inbound) as admin:
            return [p for p in admin.pools() if "autoscale" in p]
    except (GaasError, OSError):
        return []


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


def register(sub) -> None:
    """`gaas status`."""
    st = sub.add_parser("status", help="health of each service instance, Envoy and worker",
                        description="Ask every instance's health service through its sidecar, every Envoy's admin "
                        "/ready, and control's list of registered workers. Exit code 0 when all are healthy.")
    add_mesh_args(st)
    st.add_argument("--timeout", type=float, default=1.0, help="seconds per probe (1)")
    st.add_argument("--json", action="store_true", help="machine-readable output")
    st.set_defaults(func=cmd_status)
