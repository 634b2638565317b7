"""LoRA adapters loaded at run time, on a live mesh (gaas-tiny on two workers whose engines serve
adapters: one at a time in a step, two kept loaded), through the ingress with the official client:

  cold     an adapter just added (`gaas lora add`): its first request, which its worker loads it for
  warm     the same adapter's next requests (loaded): beside the base model's requests
  evicted  three adapters taking turns on engines that keep two: what loading one again costs

Each figure is the time to the first streamed token (p50 over ROUNDS adapters or requests).

    python -m bench.lora [--rounds 8] [--out bench/results/lora.json]

Prints a table and writes JSON. The tiny model's prefill is a few ms on this host, so the load's cost
shows plainly; on a GPU the adapter's weights move to the device too.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

from bench.common.mesh import admin, bench_mesh, running, tenant_key, tiny_deployment
from bench.common.output import RESULTS, progress, write_json

say = progress("lora")
MODEL = "gaas-tiny"
ENGINE = "{max_loras: 1, max_cpu_loras: 2, max_lora_rank: 16}"
PROMPT = "Adapters change what a model says about"


def deployment() -> str:
    """gaas-tiny with LoRA on its workers' engines (ENGINE)."""
    return tiny_deployment("replicas: auto", f"engine: {ENGINE}")


def build(base: Path, out: Path, seed: int, rank: int = 8) -> Path:
    from gaas.model.lora import build_adapter

    return build_adapter(base, out, rank=rank, seed=seed)


def ttft_ms(client, model: str, prompt: str = PROMPT, max_tokens: int = 8) -> float:
    started = time.perf_counter()
    stream = client.completions.create(model=model, prompt=prompt, max_tokens=max_tokens, temperature=0, stream=True)
    first = None
    for _ in stream:
        if first is None:
            first = (time.perf_counter() - started) * 1000
    return first if first is not None else float("nan")


def p50(xs: list[float]) -> float:
    return round(statistics.median(xs), 1) if xs else float("nan")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=8, help="adapters added, and requests per figure (8)")
    ap.add_argument("--out", default=str(RESULTS / "lora.json"))
    args = ap.parse_args(argv)
    work = Path(tempfile.mkdtemp(prefix="gaas-lora-bench-"))
    deploy = work / "gaas.yaml"
    deploy.write_text(deployment())
    mesh = bench_mesh("lora", 24000, say, workers=2, deploy_file=deploy, ingress_path="direct")
    results: dict = {}
    with running(mesh, 300):
        import openai

        base = Path(__file__).resolve().parent.parent / "models" / MODEL
        with admin(mesh) as a:
            key = tenant_key(a, "lora", "gold")
            c = openai.OpenAI(base_url=f"http://{mesh.topo.ingress}/v1", api_key=key, max_retries=0, timeout=120)
            for _ in range(3):
                ttft_ms(c, MODEL)
            cold, warm, base_ms = [], [], []
            say(f"cold and warm: {args.rounds} adapters added, each asked for three times")
            for i in range(args.rounds):
                name = f"bench-{i}"
                a.add_adapter(name, MODEL, str(build(base, work / name, seed=100 + i)), owner="lora")
                time.sleep(1.5)  # the routers' view of the catalogue (refreshed twice a second)
                cold.append(ttft_ms(c, name))
                warm += [ttft_ms(c, name), ttft_ms(c, name)]
                base_ms.append(ttft_ms(c, MODEL))
                a.remove_adapter(name)
            results["cold_ttft_ms_p50"], results["warm_ttft_ms_p50"] = p50(cold), p50(warm)
            results["base_ttft_ms_p50"] = p50(base_ms)
            say(f"cold p50 {results['cold_ttft_ms_p50']} ms, warm {results['warm_ttft_ms_p50']} ms, base "
                f"{results['base_ttft_ms_p50']} ms")
            say("evicted: three adapters in turn on engines keeping two")
            for i in range(3):
                a.add_adapter(f"turn-{i}", MODEL, str(build(base, work / f"turn-{i}", seed=200 + i)), owner="lora")
            time.sleep(1.5)
            turns = [ttft_ms(c, f"turn-{i % 3}") for i in range(3 * args.rounds)]
            results["turns_ttft_ms_p50"], results["turns_ttft_ms_max"] = p50(turns), round(max(turns), 1)
            results.update(rounds=args.rounds, engine=ENGINE, workers=2)
    write_json(args.out, results)
    r = results
    print(f"\nLoRA adapters (gaas-tiny, 2 workers, engine {ENGINE}; TTFT p50 through the ingress; {args.out})")
    print(f"  base model                {r['base_ttft_ms_p50']} ms")
    print(f"  adapter, first request    {r['cold_ttft_ms_p50']} ms (loaded on the worker for it)")
    print(f"  adapter, next requests    {r['warm_ttft_ms_p50']} ms")
    print(f"  3 adapters in turn, 2 kept loaded: {r['turns_ttft_ms_p50']} ms (max {r['turns_ttft_ms_max']} ms)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
