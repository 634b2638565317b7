"""Metering figures against a real Redis (a private one started here) and the ledger's databases:

  ingest   usage events from the Redis Stream into the ledger through the billing consumer, events/s
           (goal >= 20k/s on SQLite and on PostgreSQL)
  lag      from a request's end (its event's finished_ms) to its ledger row, while events arrive at
           the goal rate (goal p99 <= 1 s)
  router   what metering adds to a request on the router: the budget check before it starts and
           the usage event appended before its last chunk (goal for the event < 0.2 ms p50)

Prints a table and writes bench/results/metering.json.

    python -m bench.meteringbench [--events 100000] [--postgres URL]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import subprocess
import tempfile
import time
from pathlib import Path

from bench.common.output import RESULTS, progress, write_json
from bench.common.stats import percentile
from gaas.contracts import pricing, usage as metering
from gaas.metering import admission
from gaas.launcher.secrets import redis_answers, redis_server_command
from gaas.contracts.usage import GROUP, STREAM, UsageEvent
from gaas.runtime import redisconn
from gaas.runtime.sql import Database
from gaas.v1 import common_pb2
from services.billing.consumer import UsageConsumer
from services.billing.ledger import Ledger
from gaas.contracts.principal import Principal
from gaas.metering.meter import Meter

DEFAULT_POSTGRES = os.environ.get("GAAS_BENCH_POSTGRES_URL", "postgresql://postgres@127.0.0.1:5432/test")
GOAL_RATE = 20_000


say = progress("meteringbench")


def event(i: int, run: str, finished_ms: int) -> UsageEvent:
    return UsageEvent(
        request_id=f"{run}-{i}", tenant=f"tenant-{i % 50}", key_id=f"key_{i % 200}", tier="gold", model="gaas-tiny",
        model_version="1.0.0", prompt_tokens=300 + i % 700, cached_tokens=(i % 5) * 32, completion_tokens=50 + i % 200,
        cost_input_micros=180, cost_cached_micros=4, cost_output_micros=240, outcome="finished",
        worker=f"worker-{i % 8}", finished_ms=finished_ms, queue_ms=1.5, ttft_ms=25.0, e2e_ms=480.0,
        client_request_id=f"client-{i}",
    )


def start_redis(tmp: Path) -> tuple[subprocess.Popen, str]:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    url = f"redis://127.0.0.1:{port}/0"
    # As `gaas up` runs it: append-only, fsynced every second.
    proc = subprocess.Popen(redis_server_command("127.0.0.1", port, tmp / "redis", durable=True),
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 10
    while not redis_answers(url):
        if time.monotonic() > deadline:
            proc.kill()
            raise SystemExit("meteringbench: redis-server did not start")
        time.sleep(0.05)
    return proc, url


async def fresh_ledger(url: str) -> Ledger:
    db = Database(url)
    for table in ("usage_ledger", "budgets", "dead_letters", "stripe_outbox"):
        db.execute_sync(f"DROP TABLE IF EXISTS {table}")
    if _has_migrations(db):
        db.execute_sync("DELETE FROM schema_migrations WHERE component = 'billing'")
    ledger = Ledger(db)
    await ledger.init_schema()
    return ledger


def _has_migrations(db: Database) -> bool:
    try:
        db.execute_sync("SELECT 1 FROM schema_migrations")
        return True
    except Exception:  # noqa: BLE001 - no such table yet
        return False


async def fill(redis, events: list[UsageEvent]) -> None:
    for start in range(0, len(events), 1000):
        async with redis.pipeline(transaction=False) as pipe:
            for e in events[start:start + 1000]:
                pipe.xadd(STREAM, e.to_fields())
            await pipe.execute()


async def ingest(redis, ledger: Ledger, n: int) -> dict:
    """Drain a stream of n events into the ledger: events/s."""
    await redis.delete(STREAM)
    consumer = UsageConsumer(redis, ledger, "bench-0")
    await consumer.ensure_group()
    await fill(redis, [event(i, "ingest", metering.now_ms()) for i in range(n)])
    started = time.perf_counter()
    while await consumer.step(block_ms=10):
        pass
    seconds = time.perf_counter() - started
    assert consumer.recorded == n, f"recorded {consumer.recorded} of {n}"
    assert await redis.xlen(STREAM) == 0 and (await redis.xpending(STREAM, GROUP))["pending"] == 0
    return {"events": n, "seconds": round(seconds, 3), "events_per_s": round(n / seconds)}


def produce(url: str, rate: int, seconds: float, run: str, sent_out) -> None:
    """The routers' side, in a process of its own: append events at `rate` per second."""

    async def go() -> int:
        producer = redisconn.connect(url, timeout=10.0)
        sent, started = 0, time.perf_counter()
        while (elapsed := time.perf_counter() - started) < seconds:
            due = int(elapsed * rate)
            if due > sent:
                async with producer.pipeline(transaction=False) as pipe:
                    for i in range(sent, due):
                        pipe.xadd(STREAM, event(i, run, metering.now_ms()).to_fields())
                    await pipe.execute()
                sent = due
            await asyncio.sleep(0.005)
        await producer.aclose()
        return sent

    sent_out.value = asyncio.run(go())


async def lag(redis, ledger: Ledger, rate: int, seconds: float) -> dict:
    """Events appended at `rate` per second (by another process, as routers do) while the
    consumer runs with the billing service's settings: request end to ledger row."""
    import multiprocessing

    await redis.delete(STREAM)
    consumer = UsageConsumer(redis, ledger, "bench-lag")
    await consumer.ensure_group()
    task = asyncio.create_task(consumer.run())
    ctx = multiprocessing.get_context("spawn")
    sent = ctx.Value("q", 0)
    proc = ctx.Process(target=produce, args=(redis_url_of(redis), rate, seconds, "lag", sent))
    proc.start()
    try:
        await asyncio.to_thread(proc.join)
        deadline = time.monotonic() + 30
        while consumer.recorded < sent.value and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
    rows = await ledger.db.execute("SELECT recorded_ms - finished_ms FROM usage_ledger WHERE request_id LIKE ?", ("lag-%",))
    lags = [float(r[0]) for r in rows]
    return {"rate_goal": rate, "rate_achieved": round(sent.value / seconds), "events": sent.value, "recorded": len(lags),
            "p50_ms": round(percentile(lags, 0.5), 1), "p99_ms": round(percentile(lags, 0.99), 1),
            "max_ms": round(max(lags), 1)}


def redis_url_of(redis) -> str:
    kw = redis.connection_pool.connection_kwargs
    return f"redis://{kw['host']}:{kw['port']}/{kw.get('db', 0)}"


async def router_cost(redis_url: str, n: int, spool: Path) -> dict:
    """Per request on the router: the budget check (admit) and the usage event (commit)."""
    redis = redisconn.connect(redis_url, timeout=1.0)
    meter = Meter(redis, spool)
    price = pricing.Price(0.6, 0.06, 2.4)
    principal = Principal("bench-tenant", "gold", "key_1", "salt")
    budgeted = Principal("bench-budgeted", "gold", "key_2", "salt")
    await redis.set(admission.budget_key("bench-budgeted"), 10**12)
    final = common_pb2.GenerateChunk(token_ids=[1, 2], worker_id="worker-0")
    final.usage.prompt_tokens, final.usage.cached_tokens, final.usage.completion_tokens = 300, 64, 120
    out = {}
    for label, who in (("no_budget", principal), ("with_budget", budgeted)):
        admit_s, commit_s = [], []
        for i in range(n):
            t0 = time.perf_counter()
            m = await meter.admit(who, f"{label}-{i}", "gaas-tiny", "1.0.0", price, 300, 120, 1, "", t0)
            t1 = time.perf_counter()
            m.add(final)
            await meter.commit(m, "finished")
            t2 = time.perf_counter()
            admit_s.append((t1 - t0) * 1000)
            commit_s.append((t2 - t1) * 1000)
        out[label] = {"budget_check_p50_ms": round(percentile(admit_s, 0.5), 4),
                      "budget_check_p99_ms": round(percentile(admit_s, 0.99), 4),
                      "usage_event_p50_ms": round(percentile(commit_s, 0.5), 4),
                      "usage_event_p99_ms": round(percentile(commit_s, 0.99), 4)}
    await redis.aclose()
    assert meter.spooled == 0
    return out


def postgres_answers(url: str) -> bool:
    try:
        import psycopg

        with psycopg.connect(url, connect_timeout=2):
            return True
    except Exception:  # noqa: BLE001
        return False


async def main_async(args) -> dict:
    tmp = Path(tempfile.mkdtemp(prefix="meteringbench-"))
    proc, url = start_redis(tmp)
    redis = redisconn.connect(url, timeout=10.0)
    results: dict = {"events": args.events, "goal_events_per_s": GOAL_RATE, "databases": {}}
    try:
        say("router: budget check and usage event per request")
        results["router"] = await router_cost(url, args.router_requests, tmp / "spool")
        dbs = [("sqlite", f"sqlite:///{tmp / 'ledger.db'}")]
        if postgres_answers(args.postgres):
            dbs.append(("postgresql", args.postgres))
        else:
            say(f"no PostgreSQL at {args.postgres}: its figures are skipped (--postgres URL)")
        for name, db_url in dbs:
            say(f"{name}: ingesting {args.events} events")
            ledger = await fresh_ledger(db_url)
            figures = {"ingest": await ingest(redis, ledger, args.events)}
            say(f"{name}: lag at {args.rate} events/s for {args.lag_seconds:.0f} s")
            figures["lag"] = await lag(redis, ledger, args.rate, args.lag_seconds)
            results["databases"][name] = figures
            ledger.db.close()
    finally:
        await redis.aclose()
        proc.terminate()
        proc.wait(timeout=10)
    return results


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--events", type=int, default=100_000, help="events for the ingest figure (100000)")
    p.add_argument("--rate", type=int, default=GOAL_RATE, help="arrival rate for the lag figure, events/s (20000)")
    p.add_argument("--lag-seconds", type=float, default=10.0, help="how long events arrive for the lag figure (10)")
    p.add_argument("--router-requests", type=int, default=5000, help="requests for the router's figures (5000)")
    p.add_argument("--postgres", default=DEFAULT_POSTGRES, help="PostgreSQL for its figures (env GAAS_BENCH_POSTGRES_URL)")
    p.add_argument("--out", default=str(RESULTS / "metering.json"))
    args = p.parse_args()
    results = asyncio.run(main_async(args))
    print(f"\n{'ledger':<12} {'ingest ev/s':>12} {'lag rate':>10} {'lag p50 ms':>11} {'lag p99 ms':>11}")
    for name, f in results["databases"].items():
        print(f"{name:<12} {f['ingest']['events_per_s']:>12,} {f['lag']['rate_achieved']:>10,} "
              f"{f['lag']['p50_ms']:>11} {f['lag']['p99_ms']:>11}")
    print(f"\n{'router, per request':<22} {'budget check p50/p99 ms':>24} {'usage event p50/p99 ms':>24}")
    for label, r in results["router"].items():
        print(f"{label:<22} {r['budget_check_p50_ms']:>11} / {r['budget_check_p99_ms']:<10} "
              f"{r['usage_event_p50_ms']:>11} / {r['usage_event_p99_ms']:<10}")
    write_json(args.out, results)
    say(f"wrote {args.out}")


if __name__ == "__main__":
    main()
