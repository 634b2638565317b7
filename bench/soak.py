"""Soak: kill -9 of every kind of process the mesh runs, in turn, under streaming load, for minutes.

A mesh of two routers and two workers (one replica of control, kvcache and billing; the ingress
Envoys and Redis `gaas up` starts) serves `--streams` clients of the official openai client
(its default retries), each streaming 24-token completions one after another as a tenant with
quotas well above the load. Every `--every` seconds one process is killed with SIGKILL, the kinds
in turn (bench.common.chaos: each service, a worker's engine, each Envoy sidecar kind, each ingress
Envoy, Redis), a kind waiting while another of its group is not back.

Per kill (the calls that ended between it and the next) and in total: the calls; those that failed
before their first token (the openai client's retries spent; goal 0, but a lone ingress Envoy's
death refuses connections until it is back); those cut mid-stream (expected of a process in the
stream: an ingress, a worker's front end or sidecar on the direct path, a router on the router
path); calls retried by the client and then served; 429 answers (goal 0: the tenant is within its
quotas, also while Redis is away); usage lost, the tokens clients received that the ledger does not
bill (goal 0); seconds until `gaas up` had a new process serving in its place (goal 10); orphans.
At the end, processes of the mesh still alive once it stopped (goal 0).

Prints a table and writes bench/results/soak.json.

    python -m bench.soak [--minutes 10] [--every 30] [--streams 8]
"""

from __future__ import annotations

import argparse
import time

from bench.common.chaos import Kill, MeshView, alive, eventually, report, settled_ledger, soak, targets
from bench.common.loadgen import Load
from bench.common.output import RESULTS, progress, write_json

say = progress("soak")
TENANT = "soak"
# The tenant's quotas: several times what the load asks (about 25 requests a second at most here).
QUOTAS = {"rpm": 6000, "tpm": 2_000_000, "concurrency": 64}


def drive(view: MeshView, key: str, streams: int, every: float, settle: float, minutes: float | None,
          say, pause: float = 0.0) -> tuple[list[Kill], Load, set]:
    """The load on view's mesh as key's tenant (Load's streams and pause), and kills under it (soak:
    once each kind when minutes is None), until every killed process is back and the load has gone
    on a while after; the kills, the load, and every process of the mesh seen (before and after:
    none may outlive the mesh)."""
    seen = view.processes()
    plan = targets(view.children())
    say(f"{len(view.ingresses())} ingress process(es); killing in turn: {', '.join(t.name for t in plan)}")
    with Load(f"http://{view.ingress}", key, streams, pause) as load:
        eventually("the load streaming", lambda: sum(c.outcome == "ok" for c in load.calls) >= streams, 60)
        until = None if minutes is None else time.monotonic() + minutes * 60
        kills = soak(view, plan, every, settle, until, say)
        after = max((k.back or k.at) for k in kills) + settle
        eventually("load after the last kill", lambda: len(load.since(after)) >= streams, 60)
    return kills, load, seen | view.processes()


def run(minutes: float, every: float, streams: int, settle: float, keep: bool = False) -> dict:
    from bench.common.mesh import admin, bench_mesh, running, tenant_key
    from gaas.sdk.admin import BillingAdmin

    mesh = bench_mesh("soak", 24000, say, workers=2, replicas={"router": 2})
    say("starting a mesh with 2 routers and 2 workers")
    with running(mesh, 400, keep=keep, supervise=True):
        view = MeshView(mesh.run_dir)
        with admin(mesh) as a:
            key = tenant_key(a, TENANT, "gold", **QUOTAS)
        kills, load, seen = drive(view, key, streams, every, settle, minutes, say)
        rows = settled_ledger(mesh.run_dir, TENANT, load.calls, 60)
        with BillingAdmin(mesh.topo.of("billing")[0].inbound, mesh.run_dir) as billing:
            total = billing.usage(TENANT)["total"]
        ingresses = len(view.ingresses())
    per_kill, overall = report(kills, load, rows)
    overall["orphans_at_end"] = sum(1 for p in seen if alive(p))
    return {"minutes": minutes, "every_s": every, "streams": streams, "ingress_processes": ingresses,
            "kills": per_kill, "total": overall, "ledger_total": total}


def print_table(doc: dict) -> None:
    print(f"\nsoak: kill -9 every {doc['every_s']:.0f} s for {doc['minutes']:g} min, {doc['streams']} streams "
          f"(openai client, default retries); 2 routers, 2 workers, {doc['ingress_processes']} ingress process(es)")
    print(f"{'killed':<20} {'requests':>8} {'failed <1st tok':>15} {'cut mid-stream':>14} {'retried':>8} "
          f"{'429s':>5} {'usage lost':>10} {'restarted':>9} {'serving':>8} {'orphans':>7}")

    def secs(v):
        return f"{v:.1f} s" if v is not None else "never"

    for r in doc["kills"]:
        print(f"{r['target']:<20} {r['requests']:>8} {r['failed_before_first_token']:>15} {r['cut_mid_stream']:>14} "
              f"{r['retried']:>8} {r['answered_429']:>5} {r['usage_lost_tokens']:>10} {secs(r['restarted_s']):>9} "
              f"{secs(r['back_s']):>8} {r['orphans']:>7}")
    t = doc["total"]
    print(f"{'total':<20} {t['requests']:>8} {t['failed_before_first_token']:>15} {t['cut_mid_stream']:>14} "
          f"{t['retried']:>8} {t['answered_429']:>5} {t['usage_lost_tokens']:>10} {'':>9} {'':>8} "
          f"{sum(r['orphans'] for r in doc['kills']):>7}")
    print(f"unbilled calls: {t['unbilled']}; processes alive after the mesh stopped: {t['orphans_at_end']}; "
          f"kills back serving within 10 s: {sum(1 for r in doc['kills'] if (r['back_s'] or 1e9) <= 10)}"
          f"/{len(doc['kills'])}")
    if t["errors"]:
        print("errors seen: " + "; ".join(t["errors"]))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--minutes", type=float, default=10.0, help="how long to go on killing")
    p.add_argument("--every", type=float, default=30.0, help="seconds between kills")
    p.add_argument("--streams", type=int, default=8, help="concurrent streaming clients")
    p.add_argument("--settle", type=float, default=3.0, help="least seconds between a process back and the next kill")
    p.add_argument("--keep", action="store_true", help="keep the mesh's run directory (logs) afterwards")
    p.add_argument("--out", default=str(RESULTS / "soak.json"))
    args = p.parse_args()
    doc = run(args.minutes, args.every, args.streams, args.settle, args.keep)
    print_table(doc)
    write_json(args.out, doc)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
