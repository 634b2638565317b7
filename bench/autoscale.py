"""Autoscaling on a live mesh (gaas-tiny autoscaled between 0 and 2 workers, one to start), as `gaas up`
supervises it:

  step         six clients start streaming at once: from the step to the autoscaler's decision, to
               the new worker serving (its engine loaded and warmed up), and the requests that failed
  scale-in     the load ends: from its end to the decision to remove the worker, and to the worker
               gone (drained, deregistered)
  zero         left idle, the pool goes to zero workers; then one request: how long it waited for a
               worker to start and served (its tier's queue timeout raised for a CPU host's start)

    python -m bench.autoscale [--out bench/results/autoscale.json]

Prints a table and writes JSON. On this two-core host a worker's start (its engine built, about
20-40 s) shares the cores with the load and the mesh.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

from bench.common.mesh import admin, bench_mesh, running, tenant_key, tiny_deployment
from bench.common.output import RESULTS, progress, write_json
from bench.rollout import Load

say = progress("autoscale")
MODEL = "gaas-tiny"
POLICY = ("{min: 0, max: 2, target_requests: 2, up_after_seconds: 2, down_after_seconds: 15, cooldown_seconds: 5, "
          "zero_after_seconds: 20}")


def deployment(queue_timeout_s: float = 300) -> str:
    """gaas-tiny autoscaled by POLICY; gold's queue timeout raised (a request for a pool at zero
    waits for a worker to start: on a CPU, longer than the default 30 s)."""
    return tiny_deployment(f"autoscale: {POLICY}", after=f"qos:\n  gold: {{queue_timeout_s: {queue_timeout_s:g}}}\n")


def pool(a) -> dict:
    return next(p for p in a.pools() if p["model"] == MODEL)


def serving(mesh) -> list[str]:
    from gaas.ops import probe

    return sorted(w["worker_id"] for w in probe.probe(mesh.topo, mesh.run_dir, timeout=2.0).workers
                  if w["state"] == "SERVING")


def until(what: str, check, timeout: float = 300.0, every: float = 0.25) -> float:
    """The monotonic time check() first held."""
    deadline = time.monotonic() + timeout
    while not check():
        if time.monotonic() > deadline:
            raise RuntimeError(f"{what}: not within {timeout:.0f} s")
        time.sleep(every)
    return time.monotonic()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=str(RESULTS / "autoscale.json"))
    args = ap.parse_args(argv)
    deploy = Path(__import__("tempfile").mkdtemp(prefix="gaas-autoscale-deploy-")) / "gaas.yaml"
    deploy.write_text(deployment())
    mesh = bench_mesh("autoscale", 23000, say, deploy_file=deploy, ingress_path="direct")
    results: dict = {}
    with running(mesh, 300, keep=True, supervise=True):
        import openai

        with admin(mesh) as a:
            key = tenant_key(a, "load", "gold")
            say("step: six clients streaming at once")
            with Load(mesh.topo.ingress, key, clients=6) as load:
                step = time.monotonic()
                decided = until("a worker more asked for", lambda: int(pool(a)["replicas"]) == 2)
                ready = until("the new worker serving", lambda: "worker-1" in serving(mesh), every=0.5)
                time.sleep(10)  # the load spread over both
            ended = time.monotonic()
            results["step"] = {"step_to_decision_s": round(decided - step, 1),
                               "decision_to_serving_s": round(ready - decided, 1),
                               "step_to_serving_s": round(ready - step, 1),
                               "requests": load.requests, "failed": len(load.errors), "errors": load.errors[:3],
                               "reason": pool(a)["autoscale"]["reason"]}
            say(f"step: a worker more {decided - step:.1f} s after the step, serving {ready - decided:.1f} s later; "
                f"{len(load.errors)} of {load.requests} requests failed")
            down = until("back to one worker", lambda: int(pool(a)["replicas"]) == 1)
            gone = until("the removed worker gone", lambda: "worker-1" not in serving(mesh), every=0.5)
            results["scale_in"] = {"load_end_to_decision_s": round(down - ended, 1),
                                   "decision_to_gone_s": round(gone - down, 1), "goal_down_after_s": 15,
                                   "reason": pool(a)["autoscale"]["reason"]}
            say(f"scale-in: decided {down - ended:.1f} s after the load ended, the worker gone {gone - down:.1f} s later")
            zero = until("the idle pool at zero", lambda: int(pool(a)["replicas"]) == 0)
            until("its last worker gone", lambda: serving(mesh) == [], every=0.5)
            c = openai.OpenAI(base_url=f"http://{mesh.topo.ingress}/v1", api_key=key, max_retries=0, timeout=400)
            started = time.perf_counter()
            r = c.completions.create(model=MODEL, prompt="the first request after zero", max_tokens=4)
            first_s = time.perf_counter() - started
            started = time.perf_counter()
            c.completions.create(model=MODEL, prompt="the second request after zero", max_tokens=4)
            second_ms = (time.perf_counter() - started) * 1000
            results["zero"] = {"idle_to_zero_s": round(zero - gone, 1), "goal_zero_after_s": 20,
                               "first_request_s": round(first_s, 1), "second_request_ms": round(second_ms, 1),
                               "served_tokens": r.usage.completion_tokens}
            say(f"zero: the first request after zero served in {first_s:.1f} s, the next in {second_ms:.0f} ms")
    write_json(args.out, results)
    r = results
    print(f"\nAutoscaling (gaas-tiny, autoscale {POLICY}; {args.out})")
    s = r["step"]
    print(f"  step (6 clients)    decision {s['step_to_decision_s']} s after the step, the new worker serving "
          f"{s['decision_to_serving_s']} s later (start + warm-up); {s['failed']} of {s['requests']} requests failed")
    si = r["scale_in"]
    print(f"  scale-in            decision {si['load_end_to_decision_s']} s after the load ended "
          f"(down_after 15 s), the worker drained and gone {si['decision_to_gone_s']} s later")
    z = r["zero"]
    print(f"  scale from zero     idle -> zero in {z['idle_to_zero_s']} s (zero_after 20 s); the first request then "
          f"served in {z['first_request_s']} s (a worker's start), the next in {z['second_request_ms']} ms")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
