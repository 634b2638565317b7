"""make gpu-check: prove GaaS's GPU path on a host with NVIDIA GPUs, unattended, in a few minutes.

  1. Finds the GPUs (gaas.host.devices: the same answer `gaas up` and the workers get).
  2. Starts the whole mesh (`gaas up`'s machinery: Redis, services, Envoys) with one worker per GPU,
     and checks that every GPU got its own worker (by UUID) and that each worker computes on CUDA.
  3. Streams completions through the ingress with the official `openai` client (completions and
     chat, streamed and not) and with GaaS's native gRPC client.
  4. Runs vLLM's own load tester, `vllm bench serve`, against the ingress: one request at a time,
     then 8 and 64 streams at once; stops the mesh.
  5. Starts vLLM's own OpenAI server on the same GPU with the same engine settings (KV cache size,
     block size, context, batch, prefix caching, CUDA graphs) and runs the same load; stops it.
  6. Prints TTFT / ITL / tokens/s side by side with the goals (GaaS TTFT p50 within 3 ms of the
     server's; tokens/s at 8 and 64 streams >= 0.95x), writes bench/results/gpu-check.json.

Exit status: 0 when everything worked (goals missed are reported, not failures), 1 when anything
failed (a request, a check, a process), 2 when there is no GPU to check.
scripts/gpu-check.sh installs first (scripts/install.sh), then runs this.
"""

from __future__ import annotations

import argparse
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench.common.output import RESULTS, ROOT, progress, write_json
from bench.common.vllm import free_port, merge_detailed, stop_group, wait_http

GOAL_TTFT_MS = 3.0
GOAL_THROUGHPUT = 0.95


say = progress("gpu-check")


class Check:
    """Named pass/fail results, printed as they come."""

    def __init__(self) -> None:
        self.results: list[dict] = []

    def record(self, name: str, ok: bool, detail: str = "") -> bool:
        self.results.append({"check": name, "ok": ok, "detail": detail})
        say(f"{'ok  ' if ok else 'FAIL'} {name}{': ' + detail if detail else ''}")
        return ok

    def run(self, name: str, fn) -> object:
        try:
            out = fn()
        except Exception as exc:  # noqa: BLE001 - every failure is reported and counted
            self.record(name, False, f"{type(exc).__name__}: {str(exc)[:400]}")
            return None
        self.record(name, True, out if isinstance(out, str) else "")
        return out

    @property
    def failed(self) -> list[dict]:
        return [r for r in self.results if not r["ok"]]


# Both engines start together on the first GPU (they load and compile at once, halving the
# check's time) and each asks vLLM for this share of it; their KV caches are sized in bytes anyway.
SHARED_GPU_FRACTION = 0.4


def vllm_server_cmd(model_dir: str, model_name: str, port: int, options: dict, max_model_len: int) -> list[str]:
    """vLLM's OpenAI server with the engine settings a GaaS worker gets on a GPU."""
    cmd = [
        sys.executable, "-m", "vllm.entrypoints.openai.api_server",
        "--model", model_dir, "--served-model-name", model_name,
        "--host", "127.0.0.1", "--port", str(port),
        "--max-model-len", str(max_model_len), "--block-size", str(options["block_size"]),
        "--enable-prefix-caching", "--max-num-seqs", str(options["max_num_seqs"]),
        "--kv-cache-memory-bytes", str(int(options["kv_cache_gib"]) * 2**30),
        "--disable-uvicorn-access-log", "--gpu-memory-utilization", str(SHARED_GPU_FRACTION),
    ]
    if options["enforce_eager"] is True:
        cmd.append("--enforce-eager")
    return cmd


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--requests", type=int, default=40, help="one-at-a-time requests per target (40)")
    ap.add_argument("--input-len", type=int, default=128, help="prompt tokens (random dataset, 128)")
    ap.add_argument("--output-len", type=int, default=128, help="tokens generated per request (128)")
    ap.add_argument("--concurrency", default="8,64", help="streams at once in the throughput runs (8,64)")
    ap.add_argument("--per-stream", type=int, default=4, help="requests per stream in those runs (4)")
    ap.add_argument("--skip-vllm", action="store_true", help="check and measure GaaS only")
    ap.add_argument("--ready-timeout", type=float, default=600, help="seconds for the mesh / server to start (600)")
    ap.add_argument("--out", default=str(RESULTS / "gpu-check.json"))
    ap.add_argument("--cpu-rehearsal", action="store_true",
                    help="on a host without GPUs, run every step on the CPU (the GPU checks fail): a rehearsal of "
                    "this script before GPU time is spent on it")
    args = ap.parse_args(argv)
    levels = [int(c) for c in args.concurrency.split(",") if c.strip()]
    started = time.monotonic()

    from gaas.ops import topology
    from gaas.host.devices import visible_gpus

    gpus = visible_gpus()
    if not gpus and args.cpu_rehearsal:
        from gaas.host.devices import GpuInfo

        say("rehearsal on the CPU: the GPU checks will fail")
        gpus = [GpuInfo(0, "cpu", "cpu", 0)]
    elif not gpus:
        say("no NVIDIA GPU visible here (NVML / nvidia-smi list none, or CUDA_VISIBLE_DEVICES hides them): "
            "this check proves the GPU path and needs one; `make bench` measures the CPU path")
        return 2
    for g in gpus:
        say(f"GPU {g.index}: {g.describe()}")

    from bench.vllm_bench import run as vllm_bench
    from gaas.sdk.admin import Admin
    from gaas.launcher.errors import MeshError
    from gaas.launcher.mesh import Mesh
    from gaas.launcher.rundir import free_port_base
    from gaas.model.build import build_model, is_built

    check = Check()
    run_dir = Path(tempfile.mkdtemp(prefix="gaas-gpu-check-"))
    os.environ["GAAS_HOME"] = str(run_dir)  # in-process admin calls go as this mesh's operator
    base = free_port_base(span=300, start=26000)
    topo = topology.load(ROOT / "deploy" / "topology.yaml", env={}, port_base=base, ingress_port=base + 290,
                         auto_workers=len(gpus))
    if not args.skip_vllm:
        # vLLM's server shares the first GPU with the mesh's worker there: each takes the same share.
        os.environ["GAAS_GPU_MEMORY_UTILIZATION"] = str(SHARED_GPU_FRACTION)
    mesh = Mesh(topo, run_dir=run_dir, deploy_file=ROOT / "deploy" / "gaas.yaml",
                redis_url=f"redis://127.0.0.1:{base + 291}/0", progress=say)
    options = topo.worker_defaults
    model = mesh.spec.served[0]
    if model.preset and not is_built(Path(model.source)):
        say(f"building model {model.name} ({model.preset} preset)")
        build_model(model.preset, Path(model.source), progress=lambda m: say(f"  {m}"))
    results: dict = {"serving": {}, "checks": check.results}
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)

    def save() -> None:
        """Written after every step: a run stopped half-way still leaves its figures."""
        results["goals"] = goals(results["serving"], levels)
        results["setup"] = {
            "gpus": [{"uuid": g.uuid, "name": g.name, "memory_gib": round(g.memory_total / 2**30, 1)} for g in gpus],
            "model": model.name, "input_len": args.input_len, "output_len": args.output_len,
            "kv_cache_gib": options["kv_cache_gib"], "block_size": options["block_size"],
            "max_num_seqs": options["max_num_seqs"], "python": platform.python_version(),
            "engine": engine_version(), "date": time.strftime("%Y-%m-%d %H:%M:%S"),
            "seconds": round(time.monotonic() - started, 1),
        }
        write_json(out, results)

    def bench(url: str, key: str | None, n: int, concurrency: int) -> dict:
        r = vllm_bench(url, model.name, model.source, backend="openai", api_key=key, num_prompts=n,
                       input_len=args.input_len, output_len=args.output_len, max_concurrency=concurrency,
                       extra=["--save-detailed"], timeout=300)
        return merge_detailed([r])

    def measure(target: str, url: str, key: str | None, conc: int, n: int) -> None:
        s = check.run(f"{target}: vllm bench serve, {n} requests, {conc} at a time", lambda: bench(url, key, n, conc))
        if s is not None:
            results["serving"][f"{target} | {conc}"] = s
            say(f"  TTFT p50 {s['ttft_p50_ms']} ms, p99 {s['ttft_p99_ms']} ms; ITL p50 {s['itl_p50_ms']} ms; "
                f"{s['output_tokens_per_s']} tokens/s")
            if s["failed"]:
                check.record(f"{target}: no request failed at {conc} at a time", False, f"{s['failed']} failed")
        save()

    # vLLM's own server starts first, on the first GPU, and loads while the mesh does (the same
    # engine settings; each takes SHARED_GPU_FRACTION of the GPU, their caches sized in bytes).
    proc = None
    port = free_port()
    server_log = run_dir / "vllm-openai-server.log"
    targets: dict[str, tuple[str, str | None]] = {}
    if not args.skip_vllm:
        cmd = vllm_server_cmd(model.source, model.name, port, options, model.max_model_len)
        env = {**os.environ, "CUDA_VISIBLE_DEVICES": gpus[0].uuid, "CUDA_DEVICE_ORDER": "PCI_BUS_ID",
               "VLLM_WORKER_MULTIPROC_METHOD": "spawn"}
        if args.cpu_rehearsal:
            cmd = [c for c in cmd if c != "--kv-cache-memory-bytes" and c != str(int(options["kv_cache_gib"]) * 2**30)]
            cmd.append("--enforce-eager")
            env.update(VLLM_CPU_KVCACHE_SPACE=str(options["kv_cache_gib"]))
            env.pop("CUDA_VISIBLE_DEVICES")
        say(f"starting vLLM's OpenAI server on {gpus[0].uuid}, beside the mesh (log {server_log})")
        with open(server_log, "wb") as log_file:
            proc = subprocess.Popen(cmd, env=env, stdout=log_file, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        say(f"starting the mesh with {len(topo.of('worker'))} worker(s), one per GPU (logs in {run_dir / 'logs'})")
        t0 = time.monotonic()
        try:
            mesh.start()
            health = mesh.wait_ready(args.ready_timeout)
        except MeshError as exc:
            check.record("the mesh starts", False, str(exc)[:2000])
            return finish(check, results, save, model.name, args, out)
        results["mesh_start_s"] = round(time.monotonic() - t0, 1)
        say(f"mesh ready in {results['mesh_start_s']} s")
        devices = [w["device"] for w in health.workers]
        results["workers"] = [{"worker": w["worker_id"], "device": w["device"], "backend": w["backend"]}
                              for w in health.workers]
        check.record("one worker per GPU, each on its own GPU",
                     sorted(g.uuid for g in gpus) == sorted(d.rsplit(" ", 1)[-1] for d in devices), "; ".join(devices))
        check.record("every worker computes on CUDA", all(w["backend"] == "vllm-cuda" for w in health.workers),
                     ", ".join(sorted({w["backend"] for w in health.workers})))
        with Admin(topo.of("control")[0].inbound) as admin:
            key, _ = admin.ensure_demo_key(run_dir)
        clients(check, topo.ingress, key, model.name)
        save()
        targets["gaas ingress"] = (f"http://{topo.ingress}", key)
        if proc is not None:
            try:
                wait_http(f"http://127.0.0.1:{port}/health", proc, args.ready_timeout, server_log)
                results["vllm_server_ready_s"] = round(time.monotonic() - t0, 1)
                targets["vllm server"] = (f"http://127.0.0.1:{port}", None)
            except RuntimeError as exc:
                check.record("vLLM's server starts", False, f"{exc}\n{server_log.read_text(errors='replace')[-1500:]}")
        for target, (url, key) in targets.items():
            check.run(f"{target}: warm-up", lambda: bench(url, key, 8, 4) and None)
        # Level by level, the targets in turn: drift over the run hits both alike.
        for conc, n in [(1, args.requests), *((c, c * args.per_stream) for c in levels)]:
            for target, (url, key) in targets.items():
                measure(target, url, key, conc, n)
    finally:
        say("stopping the mesh and vLLM's server")
        stop_group(proc)
        mesh.stop()
    return finish(check, results, save, model.name, args, out)


def finish(check: Check, results: dict, save, model: str, args, out: Path) -> int:
    save()
    print_report(results, model, args)
    print(f"\nwritten: {out}; {len(check.failed)} check(s) failed; {results['setup']['seconds']} s in all")
    return 1 if check.failed else 0


def clients(check: Check, ingress: str, key: str, model: str) -> None:
    """The tools people point at vLLM servers, and GaaS's own client, through the ingress."""
    import openai

    from gaas.sdk.client import GaasClient

    oai = openai.OpenAI(base_url=f"http://{ingress}/v1", api_key=key, max_retries=0, timeout=60)

    def stream_completion() -> str:
        parts = [c.choices[0].text for c in oai.completions.create(
            model=model, prompt="The GPU said", max_tokens=16, stream=True, temperature=0) if c.choices]
        assert "".join(parts), "no text streamed"
        return f"{len(parts)} chunks"

    def stream_chat() -> str:
        parts = [c.choices[0].delta.content or "" for c in oai.chat.completions.create(
            model=model, messages=[{"role": "user", "content": "Say hi"}], max_tokens=16, stream=True,
            stream_options={"include_usage": True}) if c.choices]
        assert "".join(parts), "no text streamed"
        return f"{len(parts)} chunks"

    def whole() -> str:
        r = oai.completions.create(model=model, prompt="Once", max_tokens=8, temperature=0)
        assert r.usage and r.usage.completion_tokens == 8, f"usage {r.usage}"
        return f"usage {r.usage.prompt_tokens} + {r.usage.completion_tokens} tokens"

    def native() -> str:
        with GaasClient(ingress, api_key=key) as c:
            tokens = sum(len(ch.token_ids) for ch in c.generate("Hello from gRPC", model=model, max_tokens=16,
                                                                 temperature=0))
        assert tokens == 16, f"{tokens} tokens streamed"
        return f"{tokens} tokens"

    check.run("openai client: streamed completion through the ingress", stream_completion)
    check.run("openai client: streamed chat completion through the ingress", stream_chat)
    check.run("openai client: completion with usage", whole)
    check.run("native gRPC client: streamed generation through the ingress", native)


def goals(serving: dict, levels: list[int]) -> dict:
    g: dict = {}
    gaas, server = serving.get("gaas ingress | 1"), serving.get("vllm server | 1")
    if gaas and server:
        diff = gaas["ttft_p50_ms"] - server["ttft_p50_ms"]
        g["ttft_p50_added_ms"] = {"value": round(diff, 2), "goal": f"<= {GOAL_TTFT_MS}", "met": diff <= GOAL_TTFT_MS}
    for c in levels:
        a, b = serving.get(f"gaas ingress | {c}"), serving.get(f"vllm server | {c}")
        if a and b and b["output_tokens_per_s"]:
            ratio = a["output_tokens_per_s"] / b["output_tokens_per_s"]
            g[f"tokens_per_s_ratio_{c}"] = {"value": round(ratio, 3), "goal": f">= {GOAL_THROUGHPUT}",
                                            "met": ratio >= GOAL_THROUGHPUT}
    return g


def engine_version() -> str:
    try:
        import torch
        import vllm

        return f"vllm {vllm.__version__}, torch {torch.__version__}"
    except Exception:  # noqa: BLE001
        return "unknown"


def print_report(results: dict, model: str, args) -> None:
    setup = results["setup"]
    gpu = setup["gpus"][0]
    print(f"\nvllm bench serve, random dataset, {model}, {args.input_len} prompt + {args.output_len} output tokens, "
          f"greedy, on {gpu['name']} ({gpu['memory_gib']} GiB); {setup['engine']}\n")
    print(f"{'target':<14} {'conc':>4} {'ok':>5} {'fail':>4} {'TTFT p50':>9} {'TTFT p99':>9} {'ITL p50':>8} "
          f"{'ITL p99':>8} {'TPOT p50':>9} {'tok/s':>9}   (ms)")
    for name, s in results["serving"].items():
        target, conc = name.split(" | ")
        print(f"{target:<14} {conc:>4} {s['completed']:>5} {s['failed']:>4} {s['ttft_p50_ms']:>9} {s['ttft_p99_ms']:>9} "
              f"{s['itl_p50_ms']:>8} {s['itl_p99_ms']:>8} {s['tpot_p50_ms']:>9} {s['output_tokens_per_s']:>9}")
    if results["goals"]:
        print("\ngoals:")
        for name, g in results["goals"].items():
            print(f"  {name:<26} {g['value']:>8}  goal {g['goal']:<7} {'met' if g['met'] else 'NOT met'}")


if __name__ == "__main__":
    sys.exit(main())
