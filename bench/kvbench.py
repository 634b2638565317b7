"""KV routing figures that need no engine: the routing decision's cost, the directory's ingest
rate and memory, and a fleet simulation that replays the multi-tenant chat workload through the
real scheduler and directory code against N simulated workers (LRU block caches, a cost per
uncached prefill token and per decoded token, one request at a time each), to plan past this
machine; its ceiling is the hit rate of one worker whose cache never evicts. Prints tables and writes bench/results/kv.json.

    python -m bench.kvbench [--fleet 2,8,32,64] [--prefill-ms-per-token X --decode-ms-per-token Y]
"""

from __future__ import annotations

import argparse
import heapq
import json
import random
import statistics
import sys
import time
import tracemalloc
from collections import OrderedDict

from bench.common.output import RESULTS, ROOT, progress, write_json
from bench.common.stats import percentile
from bench.workload import multi_tenant_chat
from gaas.contracts import kvhash
from gaas.contracts.ids import WorkerId
from services.kvcache.directory import BlockDirectory, Stored
from services.router.scheduling import Candidate, Load, RequestContext, make_scheduler

BS = 32

say = progress("kvbench")


def word_ids(text: str) -> list[int]:
    """A stand-in tokenizer for the simulation: one token per word (stable ids)."""
    return [1 + (sum(ord(c) * 31**i for i, c in enumerate(w)) % 8000) for w in text.split()]


def chat_ids(messages) -> list[int]:
    out = [0]
    for role, content in messages:
        out += [8001 + len(role)] + word_ids(content) + [8100]
    return out + [8001]


# ------------------------------------------------------------------ decision cost and ingest


def decision_cost(workers: int = 8, prompt_tokens: int = 4096, iterations: int = 2000) -> dict:
    rng = random.Random(0)
    d = BlockDirectory(BS)
    # Each worker holds many chains (~20k blocks); three hold the first half of the benchmark prompt.
    prompt = [rng.randrange(1, 8000) for _ in range(prompt_tokens)]
    for w in range(workers):
        wid = WorkerId(f"worker-{w}")
        next_hash = w << 40
        for _ in range(600):
            toks = [rng.randrange(1, 8000) for _ in range(BS * 32)]
            d.stored(wid, Stored(list(range(next_hash, next_hash + 32)), None, toks, BS, "salt"))
            next_hash += 32
        if w < 3:
            half = prompt[: prompt_tokens // 2]
            n = len(half) // BS
            d.stored(wid, Stored(list(range(next_hash, next_hash + n)), None, half[: n * BS], BS, "salt"))
    candidates = [Candidate(WorkerId(f"worker-{w}"), f"a{w}", "m", "1", 8192, block_size=BS,
                            load=Load(running=w % 3, waiting=w % 2, kv_usage=0.5)) for w in range(workers)]
    scheduler = make_scheduler("kv_aware")
    hash_s, lookup_s, score_s, total = [], [], [], []
    for _ in range(iterations):
        t0 = time.perf_counter()
        hashes = kvhash.prefix_hashes(prompt, BS, "salt")
        t1 = time.perf_counter()
        matches = d.lookup(hashes)
        t2 = time.perf_counter()
        ctx = RequestContext(model="m", prompt_tokens=prompt_tokens, max_tokens=16, block_hashes=hashes,
                             prefix={m.worker_id: m.matched_blocks for m in matches})
        scheduler.schedule(ctx, candidates)
        t3 = time.perf_counter()
        hash_s.append(t1 - t0)
        lookup_s.append(t2 - t1)
        score_s.append(t3 - t2)
        total.append(t3 - t0)
    tokenize_ms = None
    tok_dir = ROOT / "models" / "gaas-tiny"
    if (tok_dir / "tokenizer.json").exists():
        from gaas.model.tokenizer import Tokenizer

        tok = Tokenizer.load(tok_dir)
        text = " ".join(random.Random(1).choice(["river", "stone", "cloud", "harbor", "signal"]) for _ in range(3000))
        runs = []
        for _ in range(50):
            t = time.perf_counter()
            tok.encode(text)
            runs.append(time.perf_counter() - t)
        tokenize_ms = {"tokens": len(tok.encode(text)), "p50_ms": round(percentile(runs, 0.5) * 1000, 3)}
    ms = lambda v, q: round(percentile(v, q) * 1000, 4)  # noqa: E731
    return {
        "workers": workers, "prompt_tokens": prompt_tokens, "directory_blocks": d.stats().blocks,
        "hash_p50_ms": ms(hash_s, 0.5), "lookup_p50_ms": ms(lookup_s, 0.5), "score_p50_ms": ms(score_s, 0.5),
        "total_p50_ms": ms(total, 0.5), "total_p99_ms": ms(total, 0.99), "tokenize": tokenize_ms,
    }


def directory_ingest(blocks: int = 200_000) -> dict:
    rng = random.Random(2)
    events = []
    h = 0
    while h < blocks:
        chain = 32
        toks = [rng.randrange(1, 8000) for _ in range(chain * BS)]
        parent = None
        for i in range(chain):
            events.append(Stored([h], parent, toks[i * BS:(i + 1) * BS], BS, "salt" if parent is None else ""))
            parent = h
            h += 1
    d = BlockDirectory(BS)
    wid = WorkerId("worker-0")
    t = time.perf_counter()
    for e in events:
        d.stored(wid, e)
    elapsed = time.perf_counter() - t
    tracemalloc.start()
    d2 = BlockDirectory(BS)
    for e in events[:50_000]:
        d2.stored(wid, e)
    used, _ = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    return {"block_events": len(events), "events_per_s": round(len(events) / elapsed),
            "bytes_per_block": round(used / 50_000)}


# ------------------------------------------------------------------ fleet simulation


class SimWorker:
    def __init__(self, wid: str, capacity: int, prefill_s: float, decode_s: float, directory: BlockDirectory) -> None:
        self.wid = WorkerId(wid)
        self.capacity = capacity
        self.lru: OrderedDict[int, None] = OrderedDict()
        self.prefill_s, self.decode_s = prefill_s, decode_s
        self.ends: list[float] = []  # end times of admitted requests
        self.busy_until = 0.0
        self.dir = directory

    def queue(self, now: float) -> int:
        self.ends = [e for e in self.ends if e > now]
        return len(self.ends)

    def held_prefix(self, hashes) -> int:
        n = 0
        for h in hashes:
            if h not in self.lru:
                break
            n += 1
        return n

    def serve(self, now: float, ids: list[int], hashes, output: int) -> tuple[float, int]:
        """(TTFT, cached tokens) of a request arriving at now."""
        hit = min(self.held_prefix(hashes), (len(ids) - 1) // BS)
        start = max(now, self.busy_until)
        prefill = (len(ids) - hit * BS) * self.prefill_s
        end = start + prefill + output * self.decode_s
        self.busy_until = end
        self.ends.append(end)
        # The engine stores the prompt's blocks (its events reach the directory).
        parent = None
        new_from = None
        for i, h in enumerate(hashes):
            if h in self.lru:
                self.lru.move_to_end(h)
                parent = h
            else:
                new_from = i
                break
        if new_from is not None:
            new = hashes[new_from:]
            for h in new:
                self.lru[h] = None
            self.dir.stored(self.wid, Stored(list(new), parent, ids[new_from * BS:(new_from + len(new)) * BS], BS,
                                             "salt" if parent is None else ""))
        evicted = []
        while len(self.lru) > self.capacity:
            h, _ = self.lru.popitem(last=False)
            evicted.append(h)
        if evicted:
            self.dir.removed(self.wid, evicted)
        return (start - now) + prefill, hit * BS


def simulate(n: int, policy: str, prefill_s: float, decode_s: float, seed: int = 0) -> dict:
    """One policy on n simulated workers. policy "ceiling": every request on one worker whose
    cache never evicts (the hit rate no routing can beat), timed as if the fleet shared it."""
    rounds = multi_tenant_chat(tenants=2 * n, conversations=8, turns=4, seed=seed)
    convs: dict[str, list] = {}
    for batch in rounds:
        for r in batch:
            convs.setdefault(r.conversation, []).append(r)
    requests = {c: [(chat_ids(r.messages), r.max_tokens) for r in rs] for c, rs in convs.items()}
    working_set = len({h for rs in requests.values() for ids, _ in rs for h in kvhash.prefix_hashes(ids, BS, "salt")})
    capacity = max(64, int(0.6 * working_set / n))
    d = BlockDirectory(BS)
    workers = [SimWorker(f"worker-{i}", capacity, prefill_s, decode_s, d) for i in range(n)]
    by_id = {w.wid: w for w in workers}
    ceiling = SimWorker("ceiling", 1 << 62, prefill_s / n, decode_s / n, BlockDirectory(BS))
    scheduler = None if policy == "ceiling" else make_scheduler(policy)
    rng = random.Random(seed)
    mean_service = statistics.fmean(len(ids) * prefill_s * 0.5 + out * decode_s for rs in requests.values() for ids, out in rs)
    # Conversations start spread out so the fleet runs at roughly 70% utilisation.
    window = len(requests) * 4 * mean_service / (0.7 * n) / 4
    events = [(rng.uniform(0, window), c, 0) for c in sorted(requests)]
    heapq.heapify(events)
    ttfts, prompt_total, cached_total = [], 0, 0
    while events:
        now, conv, turn = heapq.heappop(events)
        ids, out = requests[conv][turn]
        hashes = kvhash.prefix_hashes(ids, BS, "salt")
        if scheduler is None:
            chosen = ceiling
        else:
            cands = [Candidate(w.wid, w.wid, "m", "1", 1 << 20, block_size=BS,
                               load=Load(running=min(1, w.queue(now)), waiting=max(0, w.queue(now) - 1),
                                         kv_usage=len(w.lru) / w.capacity)) for w in workers]
            prefix = {m.worker_id: m.matched_blocks for m in d.lookup(hashes)} if scheduler.needs_prefix else {}
            ctx = RequestContext(model="m", prompt_tokens=len(ids), max_tokens=out, block_hashes=hashes, prefix=prefix)
            chosen = by_id[scheduler.schedule(ctx, cands).worker.worker_id]
        ttft, cached = chosen.serve(now, ids, hashes, out)
        ttfts.append(ttft)
        prompt_total += len(ids)
        cached_total += cached
        if turn + 1 < len(requests[conv]):
            done = now + ttft + out * decode_s
            heapq.heappush(events, (done + rng.expovariate(1.0), conv, turn + 1))
    return {"workers": n, "policy": policy, "requests": len(ttfts), "cache_blocks_per_worker": capacity,
            "hit_rate": round(cached_total / prompt_total, 4), "ttft_p50_ms": round(percentile(ttfts, 0.5) * 1000, 1),
            "ttft_p90_ms": round(percentile(ttfts, 0.9) * 1000, 1)}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--fleet", default="2,8,32,64", help="simulated fleet sizes (2,8,32,64)")
    ap.add_argument("--prefill-ms-per-token", type=float, default=None,
                    help="simulated cost of an uncached prompt token (default: from bench/results/routing.json, else 0.25)")
    ap.add_argument("--decode-ms-per-token", type=float, default=None,
                    help="simulated cost of a decoded token (default: from bench/results/routing.json, else 10)")
    ap.add_argument("--out", default=str(RESULTS / "kv.json"))
    args = ap.parse_args(argv)
    calibration = {}
    routing = RESULTS / "routing.json"
    if routing.exists():
        calibration = json.loads(routing.read_text()).get("calibration", {})
    prefill_ms = args.prefill_ms_per_token or calibration.get("prefill_ms_per_token", 0.25)
    decode_ms = args.decode_ms_per_token or calibration.get("decode_ms_per_token", 10.0)

    say("decision cost: hash + lookup + score of a 4K-token prompt over 8 workers")
    decision = decision_cost()
    say("directory ingest")
    ingest = directory_ingest()
    fleet = []
    for n in (int(x) for x in args.fleet.split(",")):
        for policy in ("round_robin", "least_load", "kv_aware", "ceiling"):
            say(f"fleet simulation: {n} workers, {policy}")
            fleet.append(simulate(n, policy, prefill_ms / 1000, decode_ms / 1000))
    results = {"decision": decision, "ingest": ingest, "fleet": fleet,
               "calibration": {"prefill_ms_per_token": prefill_ms, "decode_ms_per_token": decode_ms}}
    out = write_json(args.out, results)

    dc = decision
    print(f"\nRouting decision, 4K-token prompt over {dc['workers']} workers ({dc['directory_blocks']} blocks indexed): "
          f"hash {dc['hash_p50_ms']} + lookup {dc['lookup_p50_ms']} + score {dc['score_p50_ms']} ms at p50; "
          f"total p50 {dc['total_p50_ms']} ms, p99 {dc['total_p99_ms']} ms"
          + (f"; tokenizing {dc['tokenize']['tokens']} tokens apart: {dc['tokenize']['p50_ms']} ms" if dc["tokenize"] else ""))
    print(f"Directory ingest: {ingest['events_per_s']:,} block events/s; {ingest['bytes_per_block']} bytes per indexed block")
    print(f"\nFleet simulation (prefill {prefill_ms} ms per uncached token, decode {decode_ms} ms per token)")
    print(f"{'workers':>7} {'policy':<12} {'requests':>8} {'hit rate':>8} {'of ceiling':>10} {'TTFT p50':>9} {'TTFT p90':>9}")
    best = {r["workers"]: r["hit_rate"] for r in fleet if r["policy"] == "ceiling"}
    for r in fleet:
        share = r["hit_rate"] / best[r["workers"]] if best.get(r["workers"]) else float("nan")
        r["share_of_ceiling"] = round(share, 3)
        print(f"{r['workers']:>7} {r['policy']:<12} {r['requests']:>8} {r['hit_rate']:>8.3f} {share:>10.1%} "
              f"{r['ttft_p50_ms']:>9} {r['ttft_p90_ms']:>9}")
    write_json(out, results)
    print(f"\nwritten: {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
