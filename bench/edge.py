"""The edge under abuse, on a mesh of its own (one worker):

1. What a refused request costs the mesh, by where it is refused: CPU time of every mesh process
   (Envoys and services; the load generator excluded) per request, in microseconds, beside a
   request that is served (one token). Each kind is sent in sequence over keep-alive connections.
2. The largest non-streamed answer the limits admit: served (not a 504), and how much the router
   grew while it assembled it.
3. Slow clients: SLOW_HEADERS connections that send a request's headers a byte at a time and
   never finish them, and TRICKLE connections that send whole headers without a key and then
   trickle a body, each reconnecting as soon as it is dropped, from addresses of their own
   (127.0.1.x) for --attack seconds; meanwhile a real client (a valid key, 127.0.0.1) sends a
   streamed completion every 0.25 s. Reported: the real requests' time to first token and whole
   time before and during the attack, how many failed, the connections the ingress held, and the
   resident memory of the ingress and the router.

Goals (issue 26): a real request served within a second of its usual time during the attack; one
request never grows a process by more than 512 MB.

Prints tables and writes bench/results/edge.json.

    python -m bench.edge [--attack 30] [--slow-headers 1100] [--trickle 1100] [--requests 300]
"""

from __future__ import annotations

import argparse
import asyncio
import http.client
import json
import multiprocessing
import resource
import threading
import time

from bench import footprint
from bench.common.output import RESULTS, progress, write_json
from bench.common.stats import percentile

MODEL = "gaas-tiny"

say = progress("edge")


def _raise_open_files() -> None:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    want = 8192 if hard == resource.RLIM_INFINITY else min(8192, hard)
    if soft < want:
        resource.setrlimit(resource.RLIMIT_NOFILE, (want, hard))


# ------------------------------------------------------------------ refusal costs


def _completion(max_tokens: int = 1, **extra) -> bytes:
    return json.dumps({"model": MODEL, "prompt": "Once upon a time", "max_tokens": max_tokens, **extra}).encode()


def _send(conn: http.client.HTTPConnection, path: str, body: bytes, headers: dict) -> int:
    try:
        conn.request("POST", path, body=body, headers=headers)
        resp = conn.getresponse()
    except (http.client.HTTPException, OSError):
        conn.close()
        conn.request("POST", path, body=body, headers=headers)
        resp = conn.getresponse()
    resp.read()
    if resp.getheader("connection", "").lower() == "close":
        conn.close()
    return resp.status


def _cpu(pids: dict[str, int]) -> dict[str, float]:
    return {name: footprint.cpu_seconds(pid) for name, pid in pids.items()}


def refusal_costs(mesh, keys: dict[str, str], n: int) -> list[dict]:
    """CPU microseconds of the mesh per request for each kind (less what the mesh spends idle over
    the same time: health checks, leases, refreshes), where it was spent, and the status it got."""
    host, port = mesh.topo.ingress.split(":")
    pids = {c.name: c.proc.pid for c in mesh.children}
    idle_before, idle_started = _cpu(pids), time.perf_counter()
    time.sleep(5.0)
    idle_rate = {k: (v - idle_before[k]) / (time.perf_counter() - idle_started) for k, v in _cpu(pids).items()}
    big = b'{"model": "gaas-tiny", "prompt": "' + b"x" * (2 << 20) + b'"}'
    json_headers = {"content-type": "application/json"}
    kinds = [
        ("served (1 token)", "/v1/completions", lambda i: _completion(), {"authorization": f"Bearer {keys['served']}"}),
        ("no key", "/v1/completions", lambda i: _completion(), {}),
        ("unknown key (the same one)", "/v1/completions", lambda i: _completion(),
         {"authorization": "Bearer gaas_made_up_key"}),
        ("unknown keys (a new one each)", "/v1/completions", lambda i: _completion(),
         {"authorization": "Bearer gaas_made_up_key_{i}"}),
        ("over its concurrency quota", "/v1/completions", lambda i: _completion(),
         {"authorization": f"Bearer {keys['busy']}"}),
        ("over its rate quota", "/v1/completions", lambda i: _completion(), {"authorization": f"Bearer {keys['rpm']}"}),
        ("body over the limit (2 MiB)", "/v1/completions", lambda i: big,
         {"authorization": f"Bearer {keys['served']}"}),
        # The request: 64 prompts, 20 alternatives a token, 1,800 tokens each.
        ("answer over the limit", "/v1/completions", lambda i: _completion(max_tokens=1800, logprobs=20,
                                                                           prompt=["x"] * 64),
         {"authorization": f"Bearer {keys['served']}"}),
        ("malformed JSON", "/v1/completions", lambda i: b'{"model": ', {"authorization": f"Bearer {keys['served']}"}),
    ]
    rows = []
    for name, path, body, headers in kinds:
        holder = None
        if name == "over its concurrency quota":
            # The tenant's one request at once, held in flight while its others are refused.
            holder = http.client.HTTPConnection(host, int(port), timeout=600)
            holder.request("POST", "/v1/completions", body=_completion(max_tokens=1900, stream=True, ignore_eos=True),
                           headers={"authorization": f"Bearer {keys['busy']}", **json_headers})
            holder.getresponse().readline()
        conn = http.client.HTTPConnection(host, int(port), timeout=60)
        count = n if name != "body over the limit (2 MiB)" else max(10, n // 10)
        statuses: dict[int, int] = {}
        before = _cpu(pids)
        started = time.perf_counter()
        for i in range(count):
            h = {**json_headers, **{k: v.replace("{i}", str(i)) for k, v in headers.items()}}
            status = _send(conn, path, body(i), h)
            statuses[status] = statuses.get(status, 0) + 1
        wall = time.perf_counter() - started
        spent = {k: max(0.0, v - before[k] - idle_rate[k] * wall) for k, v in _cpu(pids).items()}
        cpu = sum(spent.values())
        conn.close()
        if holder is not None:
            holder.close()
        by_process = {k: round(v / count * 1e6) for k, v in sorted(spent.items(), key=lambda kv: -kv[1]) if v / count > 20e-6}
        rows.append({"kind": name, "requests": count, "statuses": statuses,
                     "mesh_cpu_us_per_request": round(cpu / count * 1e6), "wall_ms_per_request": round(wall / count * 1e3, 2),
                     "cpu_us_by_process": by_process})
        say(f"  {name}: {statuses}, {rows[-1]['mesh_cpu_us_per_request']} us of mesh CPU each")
    return rows


# ------------------------------------------------------------------ slow clients


# What each kind of slow client sends first, then a byte at a time (one a second) until the
# ingress answers or drops it: headers that never end, or whole headers without a key and a body.
SLOW_HEADERS = (b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n", b"X")
TRICKLE = (b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
           b"Content-Length: 1000000\r\n\r\n{", b" ")


async def _slow_client(host: str, port: int, source: str, stop: float, counts: dict, kind: tuple[bytes, bytes],
                       pause: float) -> None:
    """Connect from source, send kind's opening, then a byte a second; when the ingress answers
    (counted by status) or drops the connection, connect again after pause, until stop."""
    opening, byte = kind
    while time.monotonic() < stop:
        try:
            reader, writer = await asyncio.open_connection(host, port, local_addr=(source, 0))
        except OSError:
            counts["connect_failed"] += 1
            await asyncio.sleep(0.5)
            continue
        counts["opened"] += 1
        try:
            writer.write(opening)
            await writer.drain()
            while time.monotonic() < stop:
                try:
                    reply = await asyncio.wait_for(reader.read(200), 1.0)
                except asyncio.TimeoutError:
                    writer.write(byte)
                    await writer.drain()
                    continue
                status = reply.split(b" ", 2)[1].decode(errors="replace") if reply.count(b" ") >= 2 else "closed"
                counts[f"answered_{status}"] = counts.get(f"answered_{status}", 0) + 1
                break
        except OSError:
            pass
        finally:
            writer.close()
        await asyncio.sleep(pause)


def _attack(host: str, port: int, slow: int, trickle: int, seconds: float, out) -> None:
    _raise_open_files()

    async def main() -> dict:
        stop = time.monotonic() + seconds
        counts = {"opened": 0, "connect_failed": 0}
        sources = [f"127.0.1.{i % 250 + 1}" for i in range(slow + trickle)]
        tasks = [asyncio.create_task(_slow_client(host, port, sources[i], stop, counts, SLOW_HEADERS, 0.0))
                 for i in range(slow)]
        tasks += [asyncio.create_task(_slow_client(host, port, sources[slow + i], stop, counts, TRICKLE, 1.0))
                  for i in range(trickle)]
        await asyncio.gather(*tasks, return_exceptions=True)
        return counts

    out.put(asyncio.run(main()))


def _real_requests(host: str, port: int, key: str, seconds: float, every: float = 0.25) -> list[dict]:
    """Streamed completions, one every `every` seconds, each on a new connection (a new client)."""
    body = _completion(max_tokens=8, stream=True, ignore_eos=True)
    out = []
    stop = time.monotonic() + seconds
    while time.monotonic() < stop:
        started = time.monotonic()
        rec = {"at": started, "ttft_ms": None, "total_ms": None, "status": None}
        try:
            conn = http.client.HTTPConnection(host, port, timeout=30)
            conn.request("POST", "/v1/completions", body=body,
                         headers={"authorization": f"Bearer {key}", "content-type": "application/json"})
            resp = conn.getresponse()
            rec["status"] = resp.status
            while line := resp.readline():
                if line.startswith(b"data: ") and rec["ttft_ms"] is None:
                    rec["ttft_ms"] = (time.monotonic() - started) * 1000
            rec["total_ms"] = (time.monotonic() - started) * 1000
            conn.close()
        except (OSError, http.client.HTTPException) as exc:
            rec["status"] = type(exc).__name__
        out.append(rec)
        time.sleep(max(0.0, every - (time.monotonic() - started)))
    return out


def _summary(records: list[dict]) -> dict:
    ok = [r for r in records if r["status"] == 200 and r["ttft_ms"] is not None]
    return {
        "requests": len(records), "failed": len(records) - len(ok),
        "ttft_p50_ms": round(percentile([r["ttft_ms"] for r in ok], 0.5), 1),
        "ttft_p95_ms": round(percentile([r["ttft_ms"] for r in ok], 0.95), 1),
        "ttft_max_ms": round(max((r["ttft_ms"] for r in ok), default=float("nan")), 1),
        "total_p50_ms": round(percentile([r["total_ms"] for r in ok], 0.5), 1),
        "total_p95_ms": round(percentile([r["total_ms"] for r in ok], 0.95), 1),
    }


def _ingress_connections(mesh) -> int:
    from gaas.ops import probe
    from gaas.ops.topology import LocalSockets

    try:
        _, body = probe.envoy_admin(LocalSockets.of(mesh.sockets, "ingress-0").admin,
                                    "/stats?filter=^http.ingress.downstream_cx_active$")
        return int(body.decode().rsplit(":", 1)[-1].strip() or 0)
    except (OSError, ValueError):
        return -1


def slow_clients(mesh, key: str, slow: int, trickle: int, attack_s: float, baseline_s: float = 8.0) -> dict:
    host, port = mesh.topo.ingress.split(":")
    port = int(port)
    pid = {c.name: c.proc.pid for c in mesh.children}
    say(f"baseline: real requests for {baseline_s:.0f} s")
    before = _summary(_real_requests(host, port, key, baseline_s))
    say(f"attack: {slow} connections never finishing their headers and {trickle} trickling a body without a key, "
        f"for {attack_s:.0f} s")
    results = multiprocessing.Queue()
    attacker = multiprocessing.Process(target=_attack, args=(host, port, slow, trickle, attack_s, results), daemon=True)
    attacker.start()
    samples: list[dict] = []
    sampling = threading.Event()

    def sample() -> None:
        while not sampling.wait(1.0):
            samples.append({"connections": _ingress_connections(mesh),
                            "ingress_rss_mb": footprint.memory(pid["ingress-0"])["rss_mb"],
                            "router_rss_mb": footprint.memory(pid["router-0"])["rss_mb"]})

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    time.sleep(3.0)  # the attack under way
    during = _summary(_real_requests(host, port, key, attack_s - 5.0))
    attacker.join(timeout=attack_s + 30)
    sampling.set()
    sampler.join()
    counts = results.get(timeout=5) if not results.empty() else {}
    return {
        "slow_header_connections": slow, "trickle_connections": trickle, "attack_seconds": attack_s,
        "before": before, "during": during, "attacker": counts,
        "ingress_connections_max": max((s["connections"] for s in samples), default=-1),
        "ingress_rss_mb_max": max((s["ingress_rss_mb"] for s in samples), default=0),
        "router_rss_mb_max": max((s["router_rss_mb"] for s in samples), default=0),
        "ttft_p95_added_ms": round(during["ttft_p95_ms"] - before["ttft_p95_ms"], 1),
    }


# ------------------------------------------------------------------ the largest answer admitted


def largest_answer(mesh, key: str) -> dict:
    """The largest non-streamed answer the limits admit (64 prompts, each to the end of gaas-tiny's
    context, 3 alternatives a token: just under gaas.contracts.edge.MAX_ANSWER_TOKENS and _LOGPROBS): how
    long it took, what it answered, and how much the router grew meanwhile (sampled every 0.1 s)."""
    from gaas.contracts import edge

    host, port = mesh.topo.ingress.split(":")
    router = {c.name: c.proc.pid for c in mesh.children}["router-0"]
    prompts, per_prompt = 64, 2040
    top = edge.MAX_ANSWER_LOGPROBS // (prompts * per_prompt) - 1
    body = json.dumps({"model": MODEL, "prompt": ["x"] * prompts, "max_tokens": per_prompt, "logprobs": top,
                       "ignore_eos": True}).encode()
    before = footprint.memory(router)["rss_mb"]
    peak = [before]
    done = threading.Event()

    def sample() -> None:
        while not done.wait(0.1):
            peak.append(footprint.memory(router)["rss_mb"])

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    started = time.perf_counter()
    conn = http.client.HTTPConnection(host, int(port), timeout=900)
    conn.request("POST", "/v1/completions", body=body, headers={"authorization": f"Bearer {key}",
                                                                   "content-type": "application/json"})
    resp = conn.getresponse()
    raw = resp.read()
    seconds = time.perf_counter() - started
    done.set()
    sampler.join()
    answer = json.loads(raw) if resp.status == 200 else {}
    tokens = answer.get("usage", {}).get("completion_tokens", 0)
    say(f"  the largest answer admitted: HTTP {resp.status}, {tokens} tokens, {len(raw) / 1e6:.0f} MB of JSON in "
        f"{seconds:.1f} s; the router grew {max(peak) - before:.0f} MB")
    return {"status": resp.status, "completion_tokens": tokens, "logprobs_top": top, "answer_mb": round(len(raw) / 1e6, 1),
            "seconds": round(seconds, 1), "router_rss_before_mb": before, "router_rss_peak_mb": max(peak),
            "router_growth_mb": round(max(peak) - before, 1)}


# ------------------------------------------------------------------ main


def run(n: int, slow: int, trickle: int, attack_s: float, keep: bool = False) -> dict:
    from bench.common.mesh import admin, bench_mesh, running, tenant_key

    _raise_open_files()
    mesh = bench_mesh("edge", 24000, say, workers=1)
    say("starting a mesh with one worker")
    with running(mesh, 400, keep=keep):
        with admin(mesh) as a:
            keys = {name: tenant_key(a, f"edge-{name}", "gold", **limits)
                    for name, limits in (("served", {}), ("rpm", {"rpm": 1}), ("busy", {"concurrency": 1}))}
        costs = refusal_costs(mesh, keys, n)
        largest = largest_answer(mesh, keys["served"])
        attack = slow_clients(mesh, keys["served"], slow, trickle, attack_s)
    return {"refusals": costs, "largest_answer": largest, "slow_clients": attack}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--requests", type=int, default=300, help="requests of each kind for the refusal costs")
    p.add_argument("--slow-headers", type=int, default=1100, help="connections that never finish their headers")
    p.add_argument("--trickle", type=int, default=1100, help="connections trickling a body without a key")
    p.add_argument("--attack", type=float, default=30.0, help="seconds the slow clients keep at it")
    p.add_argument("--keep", action="store_true", help="keep the mesh's run directory (logs) afterwards")
    p.add_argument("--out", default=str(RESULTS / "edge.json"))
    args = p.parse_args()
    result = run(args.requests, args.slow_headers, args.trickle, args.attack, args.keep)
    print("\nwhat a request costs the mesh, by where it is refused (CPU of every mesh process; one at a time)")
    print(f"{'request':<32} {'answer':<16} {'mesh CPU per request':>21} {'wall per request':>17}  where (us)")
    for r in result["refusals"]:
        answer = ", ".join(f"{s} x{c}" for s, c in sorted(r["statuses"].items()))
        where = ", ".join(f"{k} {v}" for k, v in list(r["cpu_us_by_process"].items())[:4])
        print(f"{r['kind']:<32} {answer:<16} {r['mesh_cpu_us_per_request']:>18} us {r['wall_ms_per_request']:>14} ms  {where}")
    big = result["largest_answer"]
    print(f"\nthe largest non-streamed answer the limits admit (64 prompts x {2040} tokens, {big['logprobs_top']} "
          f"alternatives a token; goal: served, and no process grows 512 MB): HTTP {big['status']}, "
          f"{big['completion_tokens']:,} tokens, {big['answer_mb']} MB of JSON in {big['seconds']} s; the router grew "
          f"{big['router_growth_mb']} MB (to {big['router_rss_peak_mb']} MB)")
    a = result["slow_clients"]
    print(f"\nslow clients: {a['slow_header_connections']} never finishing their headers, {a['trickle_connections']} "
          f"trickling a body without a key, {a['attack_seconds']:.0f} s (goal: real requests within 1 s of usual)")
    print(f"{'real requests':<14} {'sent':>5} {'failed':>7} {'TTFT p50':>9} {'TTFT p95':>9} {'TTFT max':>9} {'whole p95':>10}")
    for when in ("before", "during"):
        s = a[when]
        print(f"{when:<14} {s['requests']:>5} {s['failed']:>7} {s['ttft_p50_ms']:>6.1f} ms {s['ttft_p95_ms']:>6.1f} ms "
              f"{s['ttft_max_ms']:>6.1f} ms {s['total_p95_ms']:>7.1f} ms")
    print(f"ingress: up to {a['ingress_connections_max']} connections, {a['ingress_rss_mb_max']} MB resident; router "
          f"{a['router_rss_mb_max']} MB; attacker: {a['attacker']}")
    write_json(args.out, result)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
