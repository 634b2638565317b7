"""Roll-outs on a live mesh (one worker of gaas-tiny to start), under a steady load of three clients
streaming completions, each scenario applied as an operator would (the deployment file, through
control's ApplyDeployment):

  apply        what applying costs: ApplyDeployment's latency (dry runs and real applies), and from
               an apply to the new version's worker serving its first share
  split        a canary held at 20%: each of 1,000 requests' version, from the ledger
  breach       a slower version (gaas-small's weights) under a strict guard: from its first share to
               the guard's roll-back (the goal: within 30 s), and the requests that failed
  promotion    a healthy canary stepped up 5 -> 50 -> 100 and promoted: the requests that failed
  switch       blue-green: switched, then finished (the old version drained): the requests that failed
  shadow       50% of a tenant's requests copied to a shadowing version: the tenant's TTFT beside
               the same run with 1% copied, and what it was billed against what it sent

    python -m bench.rollout [--out bench/results/rollout.json]

Prints a table and writes JSON. On this two-core host the second worker a roll-out starts shares a
core with the mesh's other processes (and the load): it decodes slower than the first whatever its
version, so the healthy scenarios give the guard a throughput tolerance that lets the same weights
through; the breach scenario's slower model is slower by its own weight.
"""

from __future__ import annotations

import argparse
import threading
import time
from pathlib import Path

from bench.common.mesh import admin, bench_mesh, running, tenant_key
from bench.common.output import RESULTS, progress, write_json
from bench.common.stats import percentile

say = progress("rollout")
MODEL = "gaas-tiny"


def deployment(version: str, rollout: str, source: str = "models/gaas-tiny", preset: str = "tiny",
               replicas: str = "1") -> str:
    return f"""\
models:
  - name: {MODEL}
    version: "{version}"
    source: {source}
    preset: {preset}
    max_model_len: 2048
    default: true
    replicas: {replicas}
    rollout: {rollout}
  - name: gaas-small
    version: "1.0.0"
    source: models/gaas-small
    preset: small
    max_model_len: 4096
    replicas: 0
"""


class Load:
    """Clients streaming completions until stopped: what failed, and each request's TTFT."""

    def __init__(self, ingress: str, key: str, clients: int = 3, max_tokens: int = 16) -> None:
        import openai

        self.client = openai.OpenAI(base_url=f"http://{ingress}/v1", api_key=key, max_retries=0, timeout=120)
        self.errors: list[str] = []
        self.ttft_ms: list[float] = []
        self.requests = 0
        self._max_tokens = max_tokens
        self._stop = threading.Event()
        self._threads = [threading.Thread(target=self._run, args=(i,), daemon=True) for i in range(clients)]

    def _run(self, i: int) -> None:
        n = 0
        while not self._stop.is_set():
            n += 1
            started = time.perf_counter()
            first = None
            try:
                for chunk in self.client.completions.create(model=MODEL, prompt=f"load {i} {n}: the river and the sea",
                                                            max_tokens=self._max_tokens, stream=True):
                    if first is None and chunk.choices and chunk.choices[0].text:
                        first = time.perf_counter()
                self.requests += 1
                if first is not None:
                    self.ttft_ms.append((first - started) * 1000)
            except Exception as exc:  # noqa: BLE001 - counted: what the benchmark reports
                self.errors.append(repr(exc))

    def __enter__(self) -> "Load":
        for t in self._threads:
            t.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        for t in self._threads:
            t.join(timeout=120)


def apply(a, text: str, path: Path, dry_run: bool = False) -> tuple[dict, float]:
    path.write_text(text)
    started = time.perf_counter()
    result = a.apply_deployment(text, str(path), f"bench.rollout {path.name}", dry_run=dry_run)
    return result, (time.perf_counter() - started) * 1000


def wait(a, *states: str, timeout: float = 300) -> dict:
    deadline = time.monotonic() + timeout
    while True:
        s = a.rollout(MODEL)
        if s["state"] in states:
            return s
        if time.monotonic() > deadline:
            raise RuntimeError(f"the roll-out is {s['state']}, not {'/'.join(states)}: {s['decisions'][-3:]}")
        time.sleep(0.25)


def first_share(s: dict) -> float:
    return next(d["at"] for d in s["decisions"] if d["state"] in ("progressing", "switched", "shadowing"))


def by_version(mesh, tenant: str, want: int, timeout: float = 30.0) -> dict[str, int]:
    from gaas.sdk.admin import BillingAdmin

    deadline = time.monotonic() + timeout
    while True:
        with BillingAdmin(mesh.topo.of("billing")[0].inbound) as b:
            u = b.usage(tenant, group_by="version")
        if u["total"]["requests"] >= want or time.monotonic() > deadline:
            return {r["group"].split(" ", 1)[1]: r["requests"] for r in u["rows"]}
        time.sleep(0.25)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--split-requests", type=int, default=1000)
    ap.add_argument("--out", default=str(RESULTS / "rollout.json"))
    args = ap.parse_args(argv)
    healthy_guard = "guard: {min_samples: 5, min_requests: 5, throughput_tolerance: 0.9}"
    mesh = bench_mesh("rollout", 25000, say)
    files = mesh.run_dir / "files"
    files.mkdir(parents=True, exist_ok=True)
    results: dict = {}
    with running(mesh, 300, keep=True, supervise=True):
        ingress = mesh.topo.ingress
        with admin(mesh) as a:
            load_key = tenant_key(a, "load", "gold")

            # -- apply: its cost
            dry = [apply(a, deployment("1.1.0", "{}"), files / "dry.yaml", dry_run=True)[1] for _ in range(20)]
            say("apply: a canary at 20%, held (the split), while three clients stream")
            with Load(ingress, load_key) as load:
                started = time.monotonic()
                _, apply_ms = apply(a, deployment("1.1.0", "{strategy: canary, steps: [20, 100], hold_seconds: 3600, "
                                                  + healthy_guard + "}"), files / "canary.yaml")
                s = wait(a, "progressing")
                ready_s = time.monotonic() - started
                # -- split: 1,000 requests of one tenant
                split_key = tenant_key(a, "split", "gold")
                import openai

                c = openai.OpenAI(base_url=f"http://{ingress}/v1", api_key=split_key, max_retries=0)
                for i in range(args.split_requests):
                    c.completions.create(model=MODEL, prompt=f"split {i}", max_tokens=1)
                shares = by_version(mesh, "split", args.split_requests)
                say("the held canary undone; promotion: a canary stepped 5 -> 50 -> 100 (8 s holds)")
                a.change_rollout(MODEL, "undo")
            promotion_errors_before = len(load.errors)
            results["apply"] = {"dry_run_ms_p50": percentile(dry, 0.5), "dry_run_ms_p95": percentile(dry, 0.95),
                                "apply_ms": apply_ms, "apply_to_first_share_s": round(ready_s, 1)}
            canary_share = shares.get("1.1.0", 0) / max(1, sum(shares.values()))
            results["split"] = {"weight": 0.20, "requests": sum(shares.values()), "canary_share": canary_share,
                                "error_points": round(abs(canary_share - 0.20) * 100, 2)}
            with Load(ingress, load_key) as load:
                apply(a, deployment("1.2.0", "{strategy: canary, steps: [5, 50, 100], hold_seconds: 8, "
                                    + healthy_guard + "}"), files / "promote.yaml")
                s = wait(a, "promoted", "rolled-back", "halted")
                time.sleep(5)  # the old version's workers drain under the load
            results["promotion"] = {"state": s["state"], "requests": load.requests, "failed": len(load.errors),
                                    "seconds": round(s["decisions"][-1]["at"] - s["decisions"][0]["at"], 1),
                                    "errors": load.errors[:3]}
            say(f"promotion: {s['state']}, {len(load.errors)} of {load.requests} requests failed "
                f"(and {promotion_errors_before} while the split was measured)")

            # -- breach: a slower version under a strict guard
            strict = ("{strategy: canary, steps: [50, 100], hold_seconds: 60, guard: {min_samples: 5, min_requests: 5, "
                      "ttft_p95_ms: {gold: 1, silver: 1, bronze: 1}}}")
            with Load(ingress, load_key) as load:
                apply(a, deployment("9.0.0-slow", strict, "models/gaas-small", "small"), files / "slow.yaml")
                s = wait(a, "rolled-back", "promoted", "halted")
            back_s = s["decisions"][-1]["at"] - first_share(s)
            results["breach"] = {"state": s["state"], "reason": s["decisions"][-1]["reason"],
                                 "first_share_to_rollback_s": round(back_s, 1), "goal_s": 30,
                                 "requests": load.requests, "failed": len(load.errors)}
            say(f"breach: {s['state']} {back_s:.1f} s after its first share: {s['decisions'][-1]['reason']}")

            # -- switch: blue-green
            with Load(ingress, load_key) as load:
                apply(a, deployment("2.0.0", "{strategy: blue-green}"), files / "bg.yaml")
                s = wait(a, "switched")
                time.sleep(5)
                a.change_rollout(MODEL, "promote")
                time.sleep(8)
            results["switch"] = {"requests": load.requests, "failed": len(load.errors), "errors": load.errors[:3]}
            say(f"switch: {len(load.errors)} of {load.requests} requests failed")

            # -- shadow: the tenant's latency with 1% of its requests copied (the new version's worker
            # up: on this host it shares the cores either way), then 50%
            shadow_key = tenant_key(a, "shadowed", "gold")
            never = "guard: {min_samples: 100000, min_requests: 100000}"
            apply(a, deployment("3.0.0-shadow", "{strategy: shadow, shadow_percent: 1, " + never + "}"),
                  files / "shadow.yaml")
            wait(a, "shadowing")
            time.sleep(2)
            with Load(ingress, shadow_key, clients=2) as alone:
                time.sleep(20)
            apply(a, deployment("3.0.0-shadow", "{strategy: shadow, shadow_percent: 50, " + never + "}"),
                  files / "shadow.yaml")
            time.sleep(2)
            with Load(ingress, shadow_key, clients=2) as shadowed:
                time.sleep(20)
            copies = a.rollout(MODEL)["figures"].get("3.0.0-shadow", {}).get("requests", 0)
            a.change_rollout(MODEL, "undo")
            billed = by_version(mesh, "shadowed", alone.requests + shadowed.requests)
            results["shadow"] = {
                "alone": {"requests": alone.requests, "ttft_p50_ms": percentile(alone.ttft_ms, 0.5),
                          "ttft_p95_ms": percentile(alone.ttft_ms, 0.95)},
                "shadowed": {"requests": shadowed.requests, "ttft_p50_ms": percentile(shadowed.ttft_ms, 0.5),
                             "ttft_p95_ms": percentile(shadowed.ttft_ms, 0.95), "copies_judged": copies},
                "sent": alone.requests + shadowed.requests, "billed": billed,
            }
    write_json(args.out, results)
    r = results
    print(f"\nRoll-outs (gaas-tiny, one worker, a roll-out's worker beside it; three clients streaming; {args.out})")
    print(f"  apply               ApplyDeployment dry run p50 {r['apply']['dry_run_ms_p50']:.1f} ms, p95 "
          f"{r['apply']['dry_run_ms_p95']:.1f} ms; an apply {r['apply']['apply_ms']:.1f} ms; to the new version's "
          f"first share {r['apply']['apply_to_first_share_s']} s (its worker starting)")
    print(f"  split               {r['split']['canary_share']:.1%} of {r['split']['requests']} requests at a 20% step "
          f"({r['split']['error_points']} points off; goal: within 2)")
    print(f"  breach              rolled back {r['breach']['first_share_to_rollback_s']} s after its first share "
          f"(goal: within 30 s); {r['breach']['failed']} of {r['breach']['requests']} requests failed")
    print(f"  promotion           {r['promotion']['state']} in {r['promotion']['seconds']} s; "
          f"{r['promotion']['failed']} of {r['promotion']['requests']} requests failed")
    print(f"  blue-green switch   {r['switch']['failed']} of {r['switch']['requests']} requests failed (switch and "
          "finish)")
    sh = r["shadow"]
    print(f"  shadow 1% -> 50%    the tenant's TTFT p50 {sh['alone']['ttft_p50_ms']:.1f} -> {sh['shadowed']['ttft_p50_ms']:.1f} "
          f"ms, p95 {sh['alone']['ttft_p95_ms']:.1f} -> {sh['shadowed']['ttft_p95_ms']:.1f} ms; "
          f"{sh['shadowed']['copies_judged']} copies judged; billed {sum(sh['billed'].values())} of {sh['sent']} sent, "
          f"all on {', '.join(sh['billed'])}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
