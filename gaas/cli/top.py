"""`gaas top`: a live terminal view of a running mesh. Each frame reads what `gaas status` reads
(the workers' load from the control plane's registry, each router's flow control and tenant
activity) and draws workers, queues and tenants, and the Redis memory each tenant holds through
stored responses and sessions against its cap (gaas.ops.tenantstorage); frame() is pure, so tests
and --once print it. cmd_top is the command: it reads (gaas.ops.probe, status.router_flows,
stored_by_tenant) and run() draws."""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from pathlib import Path

from gaas.cli.common import add_mesh_args, fail, mesh_state, mesh_topology
from gaas.cli.status import autoscaled_pools, router_flows

CLEAR = "\033[H\033[2J"


def _bar(share: float, width: int = 10) -> str:
    share = min(max(share, 0.0), 1.0)
    full = round(share * width)
    return "█" * full + "·" * (width - full)


def frame(health: dict, flows: Sequence[dict], *, now: float | None = None, tenants_shown: int = 10) -> str:
    """One screen: health is probe.MeshHealth.to_dict() (with "autoscaled": the autoscaled pools, as
    gaas status reads them, and "stored": tenantstorage.held_by_tenant(), None when Redis could not
    be read), flows admin.router_flow() of each router."""
    when = time.strftime("%H:%M:%S", time.localtime(now if now is not None else time.time()))
    instances = health.get("instances", [])
    serving = sum(1 for i in instances if i["health"] == "SERVING" and i["sidecar_ready"])
    lines = [f"gaas top  {when}  ingress {health.get('ingress', '?')} "
             f"{'READY' if health.get('ingress_ready') else 'DOWN'}  services {serving}/{len(instances)} serving"]
    down = [i["name"] for i in instances if not (i["health"] == "SERVING" and i["sidecar_ready"])]
    if down:
        lines.append(f"  not serving: {', '.join(down)}")

    windows: dict[str, list[dict]] = {}
    for f in flows:
        for w in f.get("workers", []):
            windows.setdefault(w["worker_id"], []).append(w)
    lines += ["", f"{'WORKER':<11}{'DEVICE':<20}{'RUN':>4}{'WAIT':>5}  {'KV CACHE':<17}{'WINDOW':>9}  {'BREAKER':<10}"
              f"{'MEMORY':>14}  BUSY"]
    for w in health.get("workers", []):
        load = w["load"]
        mine = windows.get(w["worker_id"], [])
        window = sum(x["window"] for x in mine)
        in_flight = sum(x["in_flight"] for x in mine)
        states = {x["breaker"] for x in mine} - {"closed"}
        breaker = ",".join(sorted(states)).upper() if states else "closed"
        mem = (f"{load['device_memory_used'] / 2**30:.1f}/{load['device_memory_total'] / 2**30:.0f} GiB"
               if load.get("device_memory_total") else "-")
        lines.append(
            f"{w['worker_id']:<11}{w['device'][:19]:<20}{load['running']:>4}{load['waiting']:>5}  "
            f"{_bar(load['kv_cache_usage'])} {load['kv_cache_usage']:>4.0%} {in_flight:>4}/{window:<4g}  "
            f"{breaker:<10}{mem:>14}  {load.get('device_utilization', 0):.0%}"
            + ("" if w["state"] == "SERVING" else f"  {w['state']}"))
        if load.get("adapter_slots"):
            lines.append(f"{'':<11}LoRA {len(load.get('adapters', []))}/{load['adapter_slots']} loaded"
                         + (f": {', '.join(load['adapters'])}" if load.get("adapters") else ""))
    if not health.get("workers"):
        lines.append("(no worker registered)")
    for p in health.get("autoscaled", []):
        a = p["autoscale"]
        lines.append(f"autoscaled {p['model']} {p['version']}: {p['replicas']} of {a['min']}-{a['max']} workers"
                     + (f"; last: {a['reason']}" if a.get("reason") else ""))

    lines += ["", f"{'QUEUE':<8}{'WAITING':>8}{'ADMITTED':>10}{'SHED':>7}{'TIMED OUT':>11}{'WAIT P95':>11}"]
    bands: dict[str, dict] = {}
    for f in flows:
        for b in f.get("bands", []):
            agg = bands.setdefault(b["band"], {"waiting": 0, "admitted": 0, "shed": 0, "timed_out": 0, "p95": 0.0})
            for k in ("waiting", "admitted", "shed", "timed_out"):
                agg[k] += b[k]
            agg["p95"] = max(agg["p95"], b["wait_p95_ms"])
    for name, b in bands.items():
        lines.append(f"{name:<8}{b['waiting']:>8}{b['admitted']:>10}{b['shed']:>7}{b['timed_out']:>11}{b['p95']:>8.0f} ms")
    if not flows:
        lines.append("(no router answered)")

    tenants: dict[str, dict] = {}
    for f in flows:
        for t in f.get("tenants", []):
            agg = tenants.setdefault(t["tenant"], {"tier": t["tier"], "in_flight": 0, "requests_1m": 0, "tokens_1m": 0})
            for k in ("in_flight", "requests_1m", "tokens_1m"):
                agg[k] += t[k]
    total_tokens = sum(t["tokens_1m"] for t in tenants.values())
    lines += ["", f"{'TENANT':<24}{'TIER':<8}{'ACTIVE':>7}{'REQ/MIN':>9}{'TOKENS/S':>10}   "
              f"(mesh: {total_tokens / 60:,.1f} tokens/s over the last minute)"]
    ranked = sorted(tenants.items(), key=lambda kv: (-kv[1]["tokens_1m"], -kv[1]["in_flight"], kv[0]))
    for name, t in ranked[:tenants_shown]:
        lines.append(f"{name[:23]:<24}{t['tier']:<8}{t['in_flight']:>7}{t['requests_1m']:>9}{t['tokens_1m'] / 60:>10.1f}")
    if len(ranked) > tenants_shown:
        lines.append(f"... and {len(ranked) - tenants_shown} more")
    if not ranked:
        lines.append("(no tenant active in the last minute)")
    if "stored" in health:
        lines += _stored(health["stored"], tenants_shown)
    return "\n".join(lines)


def _stored(stored: list[dict] | None, shown: int) -> list[str]:
    """The tenants holding the most Redis memory in stored responses and sessions, against their cap."""
    lines = ["", f"{'REDIS HELD BY':<24}{'':<12}{'HELD':>10}{'CAP':>10}   (stored responses and sessions)"]
    if stored is None:
        return lines + ["(Redis could not be read)"]
    for s in stored[:shown]:
        share = s["bytes"] / s["cap"] if s["cap"] else 0.0
        cap = _mib(s["cap"]) if s["cap"] else "-"
        lines.append(f"{s['tenant'][:23]:<24}{_bar(share)} {share:>4.0%}{_mib(s['bytes']):>10}{cap:>10}")
    if len(stored) > shown:
        lines.append(f"... and {len(stored) - shown} more")
    if not stored:
        lines.append("(no tenant holds stored responses or sessions)")
    return lines


def _mib(n: int) -> str:
    return f"{n / 2**20:.1f} MiB"


def stored_by_tenant(topo, state: dict | None) -> list[dict] | None:
    """What each tenant holds in Redis (the tenants control lists), None when it cannot be read."""
    import redis

    from gaas.contracts.errors import GaasError
    from gaas.ops.tenantstorage import held_by_tenant
    from gaas.sdk.admin import Admin

    if not state or not state.get("redis_url"):
        return None
    try:
        with Admin(topo.of("control")[0].inbound) as admin:
            tenants = [t["name"] for t in admin.list_tenants()]
        client = redis.Redis.from_url(state["redis_url"], socket_timeout=1.0, socket_connect_timeout=1.0,
                                      decode_responses=True)
        try:
            return held_by_tenant(client, tenants, int(time.time() * 1000))
        finally:
            client.close()
    except (GaasError, OSError, redis.RedisError):
        return None


def run(read: Callable[[], tuple[dict, list[dict]]], interval: float, once: bool, out=None) -> None:
    """Draw frames every interval seconds until Ctrl-C (or one, with once)."""
    import sys

    out = out or sys.stdout
    while True:
        health, flows = read()
        text = frame(health, flows)
        out.write(text + "\n" if once else CLEAR + text + "\n\n(refreshing every "
                  f"{interval:g} s; Ctrl-C quits)\n")
        out.flush()
        if once:
            return
        time.sleep(interval)


def cmd_top(args) -> int:
    from gaas.ops import probe

    state = mesh_state(Path(args.run_dir))
    topo = mesh_topology(args, state)
    if args.interval <= 0:
        return fail("--interval must be more than 0 seconds", 2)

    def read() -> tuple[dict, list[dict]]:
        health = probe.probe(topo, Path(args.run_dir).resolve(), timeout=args.timeout).to_dict()
        health["autoscaled"] = autoscaled_pools(topo)
        health["stored"] = stored_by_tenant(topo, state)
        return health, router_flows(topo)

    try:
        run(read, args.interval, args.once)
    except KeyboardInterrupt:
        pass
    return 0


def register(sub) -> None:
    """`gaas top`."""
    tp = sub.add_parser("top", help="a live view of workers, queues, KV cache use and tenants",
                        description="Redraw, every few seconds, each worker's load (running, waiting, KV cache use, "
                        "its batching window and breaker, memory), the routers' queues by priority band, the "
                        "busiest tenants of the last minute, and the Redis memory each tenant holds in stored "
                        "responses and sessions against its cap. Ctrl-C quits.")
    add_mesh_args(tp)
    tp.add_argument("--interval", type=float, default=2.0, help="seconds between frames (2)")
    tp.add_argument("--once", action="store_true", help="print one frame and exit")
    tp.add_argument("--timeout", type=float, default=1.0, help="seconds per probe (1)")
    tp.set_defaults(func=cmd_top)
