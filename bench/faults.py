"""Faults under load: kill -9 of each kind of process while clients stream completions through the
ingress, with one replica of every service and with two (two workers either way, one per core).

For each kill: the requests that failed, split into those that had not yet streamed a token (with
two replicas of the killed kind the goal is none: the ingress and the sidecars retry what never
reached an instance, routers retry a worker before its first token) and those cut mid-stream (goal
for a worker's engine, and on the router path for a worker's whole process: none, another worker
carries its streams on from the tokens sent; for what is itself in the stream and died, a router on
its path or a worker's front end on the direct path: unavoidable, no Envoy resumes a response);
how long until a request sent after the kill
got its first token (goal for a worker: at once, from the other worker); how long until `gaas up`
had the killed instance serving again; and whether any process it owned outlived it.

Prints a table and writes bench/results/faults.json.

    python -m bench.faults [--replicas 1 2] [--streams 4]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import threading
import time
from pathlib import Path

import httpx

from bench.common.chaos import engine_core
from bench.common.output import RESULTS, progress, write_json
from gaas.host import placement

MODEL = "gaas-tiny"
# What is killed: an instance of each service kind, and the Envoy sidecar in front of router-0.
# "worker-1:engine": the worker's engine (vLLM's EngineCore, the model and the KV cache) under its
# front end, which on the direct path carries its streams on.
TARGETS = ("kvcache-0", "billing-0", "control-0", "sidecar-router-0", "router-0", "worker-1:engine", "worker-1")
ENGINE = ":engine"


say = progress("faults")


class Load:
    """Streams completions from a few concurrent clients in a background thread, recording every
    request: when it started, when its first token came, how it ended."""

    def __init__(self, base_url: str, key: str, streams: int) -> None:
        self.records: list[dict] = []
        self._base, self._key, self._streams = base_url, key, streams
        self._stop = threading.Event()
        self._thread = threading.Thread(target=lambda: asyncio.run(self._run()), daemon=True)

    async def _one(self, client: httpx.AsyncClient, n: int) -> dict:
        body = {"model": MODEL, "prompt": f"fault drill {n}: tell me about the sea", "max_tokens": 24,
                "stream": True, "ignore_eos": True}
        rec = {"start": time.monotonic(), "first": None, "end": None, "ok": False, "error": ""}
        try:
            async with client.stream("POST", "/v1/completions", json=body,
                                     headers={"Authorization": f"Bearer {self._key}"}) as r:
                if r.status_code != 200:
                    rec["error"] = f"HTTP {r.status_code}: {(await r.aread())[:120]!r}"
                else:
                    done = False
                    async for line in r.aiter_lines():
                        if not line.startswith("data:"):
                            continue
                        data = line[5:].strip()
                        if data == "[DONE]":
                            done = True
                            continue
                        event = json.loads(data)
                        if "error" in event:  # OpenAI's error event, mid-stream
                            rec["error"] = event["error"].get("message", "")[:160]
                        elif rec["first"] is None:
                            rec["first"] = time.monotonic()
                    rec["ok"] = done and not rec["error"]
                    if not done and not rec["error"]:
                        rec["error"] = "the stream ended without [DONE]"
        except httpx.HTTPError as exc:
            rec["error"] = f"{type(exc).__name__}: {exc}"[:160]
        rec["end"] = time.monotonic()
        return rec

    async def _loop(self, client: httpx.AsyncClient, i: int) -> None:
        n = 0
        while not self._stop.is_set():
            n += 1
            rec = await self._one(client, i * 100000 + n)
            self.records.append(rec)
            if not rec["ok"]:
                await asyncio.sleep(0.1)  # as a client would before trying again

    async def _run(self) -> None:
        async with httpx.AsyncClient(base_url=self._base, timeout=60) as client:
            await asyncio.gather(*(self._loop(client, i) for i in range(self._streams)))

    def __enter__(self) -> "Load":
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join(timeout=120)


def _children(run_dir: Path) -> dict[str, int]:
    return json.loads((run_dir / "mesh.json").read_text())["children"]


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def _serving(mesh, name: str) -> bool:
    from gaas.ops import probe
    from gaas.ops.topology import LocalSockets

    if name.startswith("sidecar-"):
        return probe.envoy_ready(LocalSockets.of(mesh.sockets, name.removeprefix("sidecar-")).admin)
    inst = mesh.topo.instance(name)
    if probe.grpc_health(inst.inbound, 1.0, mesh.run_dir)[0] != "SERVING":
        return False
    if inst.service == "worker":
        return any(w["worker_id"] == name and w["state"] == "SERVING"
                   for w in probe.list_workers(mesh.topo.of("control")[0].inbound, 1.0, mesh.run_dir))
    return True


def kill_under_load(mesh, load: Load, target: str, settle: float) -> dict:
    name = target.removesuffix(ENGINE)
    pid = _children(mesh.run_dir)[name]
    owned = placement.descendants(pid)
    time.sleep(settle)
    t0 = time.monotonic()
    victim = engine_core(pid) if target.endswith(ENGINE) else pid
    os.kill(victim, signal.SIGKILL)
    say(f"killed {target} (pid {victim}) under load")
    back = None
    deadline = t0 + 300
    while time.monotonic() < deadline:
        now_pid = _children(mesh.run_dir).get(name)
        if now_pid and now_pid != pid and _alive(now_pid) and _serving(mesh, name):
            back = time.monotonic() - t0
            break
        time.sleep(0.2)
    time.sleep(settle)  # and the load goes on a while after
    t1 = time.monotonic()
    orphans = [p for p in owned if _alive(p)]
    window = [r for r in load.records if r["end"] >= t0 and r["start"] <= t1]
    failed = [r for r in window if not r["ok"]]
    after = [r["first"] - t0 for r in load.records if r["start"] >= t0 and r["first"] is not None and r["ok"]]
    return {
        "target": target,
        "requests": len(window),
        "failed_before_first_token": sum(1 for r in failed if r["first"] is None),
        "failed_mid_stream": sum(1 for r in failed if r["first"] is not None),
        "errors": sorted({r["error"] for r in failed})[:5],
        "next_first_token_s": round(min(after), 3) if after else None,
        "back_serving_s": round(back, 1) if back is not None else None,
        "orphan_processes": len(orphans),
    }


def run(replicas: int, streams: int, settle: float, targets: tuple[str, ...] = TARGETS, keep: bool = False) -> list[dict]:
    from bench.common.mesh import admin, bench_mesh, running, tenant_key

    mesh = bench_mesh("faults", 25000, say, workers=2,
                      replicas={kind: replicas for kind in ("control", "kvcache", "billing", "router")})
    results = []
    supervising = threading.Event()

    def supervise() -> None:  # what `gaas up` does between signals
        while not supervising.is_set():
            mesh.supervise(say)
            time.sleep(0.5)

    say(f"starting a mesh with {replicas} replica(s) of each service and 2 workers")
    with running(mesh, 400, keep=keep):
        with admin(mesh) as a:
            key = tenant_key(a, "drill", "gold")
        supervisor = threading.Thread(target=supervise, daemon=True)
        supervisor.start()
        try:
            with Load(f"http://{mesh.topo.ingress}", key, streams) as load:
                time.sleep(3)
                for target in targets:
                    r = kill_under_load(mesh, load, target, settle)
                    r["replicas"] = replicas
                    say(f"  {target}: {r['failed_before_first_token']} failed before their first token, "
                        f"{r['failed_mid_stream']} cut mid-stream of {r['requests']}; back in {r['back_serving_s']} s")
                    results.append(r)
        finally:
            supervising.set()
            supervisor.join()
    return results


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--replicas", type=int, nargs="+", default=[1, 2], help="replicas of each service (workers: 2)")
    p.add_argument("--streams", type=int, default=4, help="concurrent streaming clients")
    p.add_argument("--settle", type=float, default=3.0, help="seconds of load before each kill and after recovery")
    p.add_argument("--targets", nargs="+", default=list(TARGETS), help=f"what to kill, in order ({' '.join(TARGETS)})")
    p.add_argument("--keep", action="store_true", help="keep each mesh's run directory (logs) afterwards")
    p.add_argument("--out", default=str(RESULTS / "faults.json"))
    args = p.parse_args()
    rows = [r for n in args.replicas for r in run(n, args.streams, args.settle, tuple(args.targets), args.keep)]
    print(f"\nkill -9 under load ({args.streams} streaming clients through the ingress; two workers)")
    print(f"{'replicas':>8} {'killed':<17} {'requests':>8} {'failed before 1st token':>24} {'cut mid-stream':>15} "
          f"{'next 1st token':>15} {'back serving':>13} {'orphans':>8}")
    for r in rows:
        nxt = f"{r['next_first_token_s']:.2f} s" if r["next_first_token_s"] is not None else "-"
        back = f"{r['back_serving_s']:.1f} s" if r["back_serving_s"] is not None else "never"
        print(f"{r['replicas']:>8} {r['target']:<17} {r['requests']:>8} {r['failed_before_first_token']:>24} "
              f"{r['failed_mid_stream']:>15} {nxt:>15} {back:>13} {r['orphan_processes']:>8}")
    write_json(args.out, {"streams": args.streams, "kills": rows})
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
