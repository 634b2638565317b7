"""Routing comparison on a real fleet: the multi-tenant chat workload (bench/workload.py: shared
system prompts per tenant, multi-turn conversations) through the OpenAI API, two workers (one
core each) serving gaas-small with KV caches sized so the workload's working set fits the fleet
only when it is not duplicated. For each GaaS policy, for one GaaS worker alone with the same
per-worker cache, and for the vLLM project's Rust router (`vllm-router --policy cache_aware`) in
front of two vLLM OpenAI servers given the same cores and cache: the prefix-cache hit rate (from
usage.prompt_tokens_details.cached_tokens), TTFT p50/p90 and throughput. The ceiling is the hit
rate of one worker whose cache never evicts, computed from the workload's own block hashes.
Prints a table and writes bench/results/routing.json (whose calibration bench/kvbench.py uses).

    python -m bench.routing [--only kv_aware,round_robin] [--skip-vllm-router]
"""

from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from bench.common.output import RESULTS, ROOT, progress, write_json
from bench.common.stats import percentile
from bench.common.vllm import free_port, start_vllm_server, stop_group, wait_http
from bench.workload import multi_tenant_chat
from gaas.host.placement import worker_cpus

MODEL = "gaas-small"
VLLM_ROUTER = "vllm-router==0.1.17"


say = progress("routing")


def run_workload(base_url: str, api_key: str, rounds, concurrency: int, model: str = MODEL) -> dict:
    """Every request of every round (a round's requests concurrently), streamed; per request its
    prompt and cached tokens, TTFT and inter-token gaps."""
    import openai

    client = openai.OpenAI(base_url=base_url, api_key=api_key, max_retries=0, timeout=300)

    def one(r) -> dict:
        start = time.perf_counter()
        stamps, usage = [], None
        stream = client.chat.completions.create(
            model=model, messages=[{"role": role, "content": text} for role, text in r.messages],
            max_tokens=r.max_tokens, temperature=0, stream=True, stream_options={"include_usage": True},
            extra_body={"ignore_eos": True},
        )
        for chunk in stream:
            if chunk.choices:
                stamps.append(time.perf_counter())
            if chunk.usage:
                usage = chunk.usage
        details = usage.prompt_tokens_details
        return {
            "tenant": r.tenant, "turn": r.turn, "prompt_tokens": usage.prompt_tokens,
            "cached_tokens": (details.cached_tokens or 0) if details else 0,
            "completion_tokens": usage.completion_tokens, "ttft": stamps[0] - start,
            "itl": [b - a for a, b in zip(stamps, stamps[1:])],
        }

    started = time.perf_counter()
    results = []
    with ThreadPoolExecutor(concurrency) as pool:
        for batch in rounds:
            results += list(pool.map(one, batch))
    elapsed = time.perf_counter() - started
    prompt = sum(r["prompt_tokens"] for r in results)
    cached = sum(r["cached_tokens"] for r in results)
    ttfts = [r["ttft"] for r in results]
    return {
        "requests": len(results), "hit_rate": round(cached / prompt, 4),
        "ttft_p50_ms": round(percentile(ttfts, 0.5) * 1000, 1), "ttft_p90_ms": round(percentile(ttfts, 0.9) * 1000, 1),
        "seconds": round(elapsed, 2),
        "output_tokens_per_s": round(sum(r["completion_tokens"] for r in results) / elapsed, 1),
        "per_request": results,
    }


def ceiling(rounds, block_size: int) -> float:
    """Hit rate of one worker whose cache never evicts, serving the requests in order (vLLM
    recomputes at least the last token of a prompt)."""
    from gaas.contracts import kvhash
    from gaas.launcher.mesh import ROOT as MESH_ROOT
    from gaas.model.tokenizer import ChatMessage, Tokenizer

    tok = Tokenizer.load(MESH_ROOT / "models" / MODEL)
    seen: set[int] = set()
    prompt = cached = 0
    for batch in rounds:
        for r in batch:
            ids = tok.encode_chat([ChatMessage(role, text) for role, text in r.messages])
            hashes = kvhash.prefix_hashes(ids, block_size, "")
            held = 0
            while held < len(hashes) and hashes[held] in seen:
                held += 1
            prompt += len(ids)
            cached += min(held, (len(ids) - 1) // block_size) * block_size
            seen.update(hashes)
    return cached / prompt


def working_set_blocks(rounds, block_size: int) -> int:
    from gaas.contracts import kvhash
    from gaas.launcher.mesh import ROOT as MESH_ROOT
    from gaas.model.tokenizer import ChatMessage, Tokenizer

    tok = Tokenizer.load(MESH_ROOT / "models" / MODEL)
    return len({
        h for batch in rounds for r in batch
        for h in kvhash.prefix_hashes(tok.encode_chat([ChatMessage(role, t) for role, t in r.messages]), block_size, "")
    })


def gaas_run(policy: str, workers: int, blocks: int, rounds, concurrency: int) -> dict:
    from bench.common.mesh import bench_mesh, demo_key, running

    mesh = bench_mesh("routing", 23000, say, workers=workers,
                      worker_options={"kv_cache_blocks": blocks}, serve_model=MODEL,
                      extra_env={"GAAS_ROUTER_POLICY": policy})
    with running(mesh, 400):
        return run_workload(f"http://{mesh.topo.ingress}/v1", demo_key(mesh), rounds, concurrency)


def ensure_vllm_router() -> str:
    found = shutil.which("vllm-router", path=str(Path(sys.executable).parent))
    if found:
        return found
    say(f"installing {VLLM_ROUTER} (the vLLM project's router) into the venv")
    # (The install makes the venv without pip: uv installs there.)
    if subprocess.run([sys.executable, "-m", "pip", "--version"], capture_output=True).returncode != 0:
        subprocess.run([sys.executable, "-m", "ensurepip", "--upgrade"], check=True, capture_output=True)
    subprocess.run([sys.executable, "-m", "pip", "install", "--quiet", VLLM_ROUTER], check=True)
    return shutil.which("vllm-router", path=str(Path(sys.executable).parent))


def vllm_router_run(blocks: int, rounds, concurrency: int, log_dir: Path) -> dict:
    from gaas.ops import topology
    from gaas.settings.deployspec import load as load_spec

    model = load_spec(ROOT / "deploy" / "gaas.yaml").model(MODEL)
    executor = str(topology.load(ROOT / "deploy" / "topology.yaml", env={}).of("worker")[0].options["executor"])
    router_bin = ensure_vllm_router()
    procs = []
    try:
        ports = []
        for i in range(2):
            core = worker_cpus(i, 2)[0]  # where gaas would place worker-i's engine
            port = free_port()
            log = log_dir / f"vllm-server-{i}.log"
            say(f"starting vLLM's OpenAI server {i} on core {core} ({blocks} KV blocks; log {log})")
            # The engine a GaaS worker runs (its executor), so the comparison is of the routing.
            proc = start_vllm_server(Path(model.source), MODEL, port, core, log,
                                     extra=["--num-gpu-blocks-override", str(blocks), "--max-model-len",
                                            str(model.max_model_len), "--enable-prompt-tokens-details"],
                                     executor=executor)
            procs.append(proc)
            ports.append(port)
        for port, proc in zip(ports, procs):
            wait_http(f"http://127.0.0.1:{port}/health", proc, 400, log_dir / "vllm-server.log")
        rport = free_port()
        log = open(log_dir / "vllm-router.log", "wb")
        router = subprocess.Popen(
            [router_bin, "--host", "127.0.0.1", "--port", str(rport), "--policy", "cache_aware", "--worker-urls",
             *[f"http://127.0.0.1:{p}" for p in ports]],
            stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
        )
        procs.append(router)
        wait_http(f"http://127.0.0.1:{rport}/health", router, 60, log_dir / "vllm-router.log")
        return run_workload(f"http://127.0.0.1:{rport}/v1", "none", rounds, concurrency)
    finally:
        for p in procs:
            stop_group(p)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--only", default="round_robin,least_load,kv_aware,single,vllm-router",
                    help="targets to run (round_robin,least_load,kv_aware,single,vllm-router)")
    ap.add_argument("--tenants", type=int, default=4)
    ap.add_argument("--conversations", type=int, default=8, help="conversations per tenant (8)")
    ap.add_argument("--turns", type=int, default=4)
    ap.add_argument("--concurrency", type=int, default=4, help="requests in flight at once (4)")
    ap.add_argument("--cache-share", type=float, default=0.6,
                    help="each worker's KV cache as a share of the workload's working set (0.6)")
    ap.add_argument("--out", default=str(RESULTS / "routing.json"))
    args = ap.parse_args(argv)
    only = set(args.only.split(","))

    from gaas.settings.deployspec import load as load_spec
    from gaas.model.build import build_model, is_built

    model = load_spec(ROOT / "deploy" / "gaas.yaml").model(MODEL)
    if not is_built(Path(model.source)):
        say(f"building {MODEL} into {model.source}")
        build_model(model.preset, Path(model.source), progress=say)
    block_size = 32
    rounds = multi_tenant_chat(tenants=args.tenants, conversations=args.conversations, turns=args.turns)
    ws = working_set_blocks(rounds, block_size)
    min_blocks = -(-model.max_model_len // block_size) + 1
    blocks = max(min_blocks, int(args.cache_share * ws))
    top = ceiling(rounds, block_size)
    say(f"workload: {sum(len(b) for b in rounds)} requests, working set {ws} blocks; {blocks} blocks per worker; "
        f"ceiling hit rate {top:.3f}")
    results: dict = {"setup": {"model": MODEL, "working_set_blocks": ws, "blocks_per_worker": blocks,
                               "ceiling_hit_rate": round(top, 4), "concurrency": args.concurrency,
                               "requests": sum(len(b) for b in rounds)}, "runs": {}}
    log_dir = Path(tempfile.mkdtemp(prefix="gaas-routing-logs-"))
    plan = [(f"gaas {p}", lambda p=p: gaas_run(p, 2, blocks, rounds, args.concurrency))
            for p in ("round_robin", "least_load", "kv_aware") if p in only]
    if "single" in only:
        plan.append(("gaas 1 worker", lambda: gaas_run("kv_aware", 1, blocks, rounds, args.concurrency)))
    if "vllm-router" in only:
        plan.append(("vllm-router cache_aware", lambda: vllm_router_run(blocks, rounds, args.concurrency, log_dir)))
    failed = []
    for name, run in plan:
        say(f"{name} ...")
        try:
            results["runs"][name] = run()
        except Exception as exc:  # noqa: BLE001 - one target failing must not lose the others' figures
            say(f"{name} FAILED: {type(exc).__name__}: {exc}")
            failed.append(name)

    kv = results["runs"].get("gaas kv_aware")
    if kv:
        # Calibration for the fleet simulation: prefill per uncached token, decode per token.
        misses = [r for r in kv["per_request"] if r["prompt_tokens"] - r["cached_tokens"] > 256]
        per_token = [r["ttft"] / (r["prompt_tokens"] - r["cached_tokens"]) for r in misses]
        gaps = [g for r in kv["per_request"] for g in r["itl"]]
        results["calibration"] = {
            "prefill_ms_per_token": round(percentile(per_token, 0.5) * 1000, 4) if per_token else None,
            "decode_ms_per_token": round(percentile(gaps, 0.5) * 1000, 3) if gaps else None,
        }
    for run in results["runs"].values():
        run["share_of_ceiling"] = round(run["hit_rate"] / top, 3) if top else None
    out = write_json(args.out, results)

    print(f"\nRouting comparison: {MODEL}, {results['setup']['requests']} chat requests (4 tenants' system prompts, "
          f"multi-turn), {blocks} KV blocks per worker (working set {ws}), {args.concurrency} in flight; "
          f"ceiling hit rate {top:.3f}\n")
    print(f"{'target':<26} {'hit rate':>8} {'of ceiling':>10} {'TTFT p50':>9} {'TTFT p90':>9} {'tok/s':>7}")
    for name, r in results["runs"].items():
        print(f"{name:<26} {r['hit_rate']:>8.3f} {r['share_of_ceiling']:>10.1%} {r['ttft_p50_ms']:>9} "
              f"{r['ttft_p90_ms']:>9} {r['output_tokens_per_s']:>7}")
    if failed:
        print(f"FAILED: {', '.join(failed)} (see the messages above; logs in {log_dir})")
    print(f"\nwritten: {out}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
