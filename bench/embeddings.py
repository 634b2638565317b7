"""Embeddings, score and rerank through the mesh beside vLLM's own server on the same model, placed
alike (gaas-embed: gaas-tiny's weights served by vLLM's pooling runner, one worker; vLLM's server
with --runner pooling --convert embed, its model runner on the core GaaS gives its worker's engine).

  answers      each text's vector from both (min cosine, float and base64), /score and /rerank
               of a query against documents (max score difference, the same order)
  load         POST /v1/embeddings of one text (about --input-words words) per request: after
               --requests requests at --concurrency to warm each, --requests requests one at a
               time, then --requests x 4 at --concurrency at once, alternating targets by rounds:
               requests/s and latency p50/p99 of each

Prints a table and writes bench/results/embeddings.json (the goal: the mesh >= 0.85x the server's
throughput; its vectors equal to the server's, cosine >= 0.9999, scores within 1e-4).

    python -m bench.embeddings [--requests 200] [--concurrency 32] [--rounds 2]
"""

from __future__ import annotations

import argparse
import base64
import http.client
import json
import os
import random
import subprocess
import tempfile
import threading
import time
from pathlib import Path

import numpy as np

from bench.common.mesh import admin, bench_mesh, running, tenant_key
from bench.common.output import RESULTS, ROOT, progress, write_json
from bench.common.stats import percentile

say = progress("embeddings")
MODEL = "gaas-embed"
DEPLOYMENT = f"""\
models:
  - name: {MODEL}
    version: "1.0.0"
    source: models/gaas-tiny
    preset: tiny
    max_model_len: 2048
    default: true
    replicas: 1
    engine: {{task: embed}}
"""
TEXTS = ["hello world", "the river runs down to the sea", "x", "a list of inputs is one engine batch",
         "tokens " * 200, "where does the river go", "embeddings for retrieval", "0 1 2 3 4 5 6 7 8 9"]
QUERY = "where does the river go"
WORDS = "the of and to in is was for on that with as by at from his an were are which this be".split()


class Target:
    """An HTTP server answering vLLM's routes (the mesh's ingress, or vLLM's server), a connection
    per thread."""

    def __init__(self, name: str, host_port: str, key: str | None) -> None:
        self.name, self.host_port = name, host_port
        self.headers = {"content-type": "application/json", **({"authorization": f"Bearer {key}"} if key else {})}
        self._local = threading.local()

    def post(self, path: str, body: dict) -> dict:
        conn = getattr(self._local, "conn", None)
        if conn is None:
            host, port = self.host_port.rsplit(":", 1)
            conn = self._local.conn = http.client.HTTPConnection(host, int(port), timeout=120)
        try:
            conn.request("POST", path, json.dumps(body), self.headers)
            resp = conn.getresponse()
            data = resp.read()
        except (OSError, http.client.HTTPException):
            self._local.conn = None
            conn.close()
            raise
        if resp.status != 200:
            raise RuntimeError(f"{self.name} {path}: {resp.status} {data[:300]!r}")
        return json.loads(data)


def cosine(a, b) -> float:
    a, b = np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64)
    return float(a @ b / (np.linalg.norm(a) * np.linalg.norm(b)))


def vectors(t: Target, encoding: str) -> list[np.ndarray]:
    data = t.post("/v1/embeddings", {"model": MODEL, "input": TEXTS, "encoding_format": encoding})["data"]
    if encoding == "base64":
        return [np.frombuffer(base64.b64decode(d["embedding"]), dtype="<f4") for d in data]
    return [np.asarray(d["embedding"], dtype=np.float32) for d in data]


def answers(mesh: Target, server: Target) -> dict:
    """How far the mesh's answers are from the server's."""
    cos = [cosine(a, b) for enc in ("float", "base64") for a, b in zip(vectors(mesh, enc), vectors(server, enc))]
    docs = [t for t in TEXTS if t != QUERY]
    scored = [[d["score"] for d in t.post("/score", {"model": MODEL, "queries": QUERY, "documents": docs})["data"]]
              for t in (mesh, server)]
    ranked = [t.post("/rerank", {"model": MODEL, "query": QUERY, "documents": docs})["results"] for t in (mesh, server)]
    return {
        "vector_cosine_min": round(min(cos), 7),
        "score_diff_max": float(max(abs(a - b) for a, b in zip(*scored))),
        "rerank_diff_max": float(max(abs(a["relevance_score"] - b["relevance_score"]) for a, b in zip(*ranked))),
        "rerank_same_order": [r["index"] for r in ranked[0]] == [r["index"] for r in ranked[1]],
    }


def text(rng: random.Random, words: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(words))


def load(t: Target, n: int, concurrency: int, words: int, seed: int) -> dict:
    """n embeddings requests of one text each, concurrency at a time: requests/s and latency."""
    rng = random.Random(seed)
    bodies = [{"model": MODEL, "input": text(rng, words)} for _ in range(n)]
    lock, latencies, failed = threading.Lock(), [], []
    it = iter(bodies)

    def run() -> None:
        while True:
            with lock:
                body = next(it, None)
            if body is None:
                return
            started = time.perf_counter()
            try:
                t.post("/v1/embeddings", body)
            except Exception as exc:  # noqa: BLE001 - counted and reported
                with lock:
                    failed.append(str(exc)[:200])
                continue
            with lock:
                latencies.append((time.perf_counter() - started) * 1000)

    started = time.perf_counter()
    threads = [threading.Thread(target=run) for _ in range(concurrency)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    took = time.perf_counter() - started
    return {"requests": n, "seconds": took, "latencies": latencies, "failed": failed}


def merged(runs: list[dict]) -> dict:
    lat = [x for r in runs for x in r["latencies"]]
    done = sum(r["requests"] - len(r["failed"]) for r in runs)
    return {"requests": sum(r["requests"] for r in runs), "failed": sum(len(r["failed"]) for r in runs),
            "requests_per_s": round(done / sum(r["seconds"] for r in runs), 1),
            "p50_ms": round(percentile(lat, 0.5), 2), "p99_ms": round(percentile(lat, 0.99), 2),
            "failures": [f for r in runs for f in r["failed"]][:5]}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--requests", type=int, default=200, help="one-at-a-time requests per target (200; x4 at "
                    "--concurrency)")
    ap.add_argument("--concurrency", type=int, default=32, help="clients at once in the second run (32)")
    ap.add_argument("--rounds", type=int, default=2, help="rounds each run is split into, alternating targets (2)")
    ap.add_argument("--input-words", type=int, default=48, help="words per text (48: about 50 tokens)")
    ap.add_argument("--out", default=str(RESULTS / "embeddings.json"))
    args = ap.parse_args(argv)

    from bench.common.vllm import free_port, start_vllm_server, stop_group, wait_http
    from bench.run import settle
    from gaas.host.placement import pin_descendants, worker_cpus

    deploy = Path(os.environ.get("TMPDIR", "/tmp")) / f"gaas-embeddings-bench-{os.getpid()}.yaml"
    deploy.write_text(DEPLOYMENT)
    mesh = bench_mesh("embeddings", 25600, say, workers=1, deploy_file=deploy)
    core, others = worker_cpus(0, 1)
    proc: subprocess.Popen | None = None
    doc: dict = {"model": MODEL, "input_words": args.input_words, "concurrency": args.concurrency}
    try:
        with running(mesh, 300):
            with admin(mesh) as a:
                key = tenant_key(a, "embeddings-bench", "gold")
            port = free_port()
            # (outside the mesh's run directory, which goes when the mesh stops: kept to read a failure)
            log = Path(tempfile.mkdtemp(prefix="gaas-embeddings-vllm-")) / "vllm-openai-server-embed.log"
            say(f"starting vLLM's OpenAI server (pooling runner) on 127.0.0.1:{port}, its runner on core {core} "
                f"(log {log})")
            proc = start_vllm_server(ROOT / "models" / "gaas-tiny", MODEL, port, core, log,
                                     ["--runner", "pooling", "--convert", "embed"])
            wait_http(f"http://127.0.0.1:{port}/health", proc, 300, log)
            pin_descendants(proc.pid, {core})
            if others:
                os.sched_setaffinity(proc.pid, others)
            targets = {"gaas": Target("gaas", mesh.topo.ingress, key),
                       "vllm": Target("vllm", f"127.0.0.1:{port}", None)}
            say("answers: vectors, scores and rankings of both")
            doc["answers"] = answers(targets["gaas"], targets["vllm"])
            for t in targets.values():
                # Warm, at the load's concurrency: the mesh's first few hundred requests at 32 clients
                # have a tail of its own (p99 ~600 ms against ~180 ms after).
                say(f"{t.name}: warming up, {args.requests} requests, {args.concurrency} at once")
                load(t, args.requests, args.concurrency, args.input_words, 0)
            runs: dict = {}
            for label, n, conc in (("c1", args.requests, 1), (f"c{args.concurrency}", args.requests * 4,
                                                                args.concurrency)):
                per = {name: [] for name in targets}
                for r in range(args.rounds):
                    for name, t in targets.items():
                        say(f"{name}: {n // args.rounds} requests, {conc} at once (round {r + 1})")
                        settle()
                        per[name].append(load(t, n // args.rounds, conc, args.input_words, 1 + r))
                runs[label] = {name: merged(v) for name, v in per.items()}
                runs[label]["throughput_vs_vllm"] = round(runs[label]["gaas"]["requests_per_s"]
                                                          / runs[label]["vllm"]["requests_per_s"], 3)
            doc["load"] = runs
    finally:
        stop_group(proc)
        deploy.unlink(missing_ok=True)
    out = write_json(args.out, doc)
    a = doc["answers"]
    print(f"\nEmbeddings ({MODEL}: gaas-tiny pooled, 1 worker; vLLM's server placed alike; {out})")
    print(f"  answers: vector cosine min {a['vector_cosine_min']}, score diff max {a['score_diff_max']:.2e}, "
          f"rerank diff max {a['rerank_diff_max']:.2e}, same order {a['rerank_same_order']}")
    print(f"  {'run':<5} {'target':<6} {'req/s':>8} {'p50 ms':>8} {'p99 ms':>8} {'failed':>6}")
    failed = 0
    for label, r in doc["load"].items():
        for name in ("gaas", "vllm"):
            x = r[name]
            failed += x["failed"]
            print(f"  {label:<5} {name:<6} {x['requests_per_s']:>8} {x['p50_ms']:>8} {x['p99_ms']:>8} {x['failed']:>6}")
        print(f"  {label:<5} gaas/vllm throughput {r['throughput_vs_vllm']}")
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
