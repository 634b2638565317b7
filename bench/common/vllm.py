"""vLLM beside the mesh, for comparison: its OpenAI server on a free port, its model computing on the
core GaaS would give a worker's engine, waited for and stopped with its process group; and the summary
of `vllm bench serve`'s detailed results (bench.vllm_bench), by the same percentile as every figure."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

from bench.common.stats import percentile


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_vllm_server(
    model_dir: Path, model_name: str, port: int, core: int, log: Path, extra: list[str] = (), executor: str = "mp"
) -> subprocess.Popen:
    """vLLM's OpenAI server, its model computing on core; executor as a GaaS worker's
    (gaas.host.placement.EXECUTORS; "mp" is vLLM's own choice on the CPU)."""
    from gaas.host.placement import engine_executor

    backend, engine_env = engine_executor(executor, on_gpu=False, bind=str(core))
    env = {
        **os.environ,
        "VLLM_CPU_KVCACHE_SPACE": "1",
        "VLLM_CPU_OMP_THREADS_BIND": str(core),
        **engine_env,
    }
    if backend != "mp":
        extra = [*extra, "--distributed-executor-backend", backend]
    cmd = [
        sys.executable, "-m", "vllm.entrypoints.openai.api_server",
        "--model", str(model_dir), "--served-model-name", model_name,
        "--host", "127.0.0.1", "--port", str(port),
        "--max-model-len", "2048", "--block-size", "32", "--enforce-eager", "--enable-prefix-caching",
        "--max-num-seqs", "64", "--disable-uvicorn-access-log", *extra,
    ]
    out = open(log, "wb")
    return subprocess.Popen(cmd, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)


def wait_http(url: str, proc: subprocess.Popen, timeout: float, log: Path) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"vLLM's server exited with {proc.returncode}; see {log}")
        try:
            with urllib.request.urlopen(url, timeout=1) as r:
                if r.status == 200:
                    return
        except OSError:
            pass
        time.sleep(0.5)
    raise RuntimeError(f"vLLM's server not ready after {timeout:.0f} s; see {log}")


def stop_group(proc: subprocess.Popen | None) -> None:
    if proc is None or proc.poll() is not None:
        return
    try:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(timeout=30)
    except (ProcessLookupError, subprocess.TimeoutExpired):
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def merge_detailed(runs: list[dict]) -> dict:
    """One summary of several `vllm bench serve --save-detailed` runs (their requests pooled)."""
    reqs = [
        (ttft, gaps, n)
        for r in runs
        for ttft, gaps, n, err in zip(r["ttfts"], r["itls"], r["output_lens"], r["errors"])
        if not err
    ]
    ttfts = [t for t, _, _ in reqs]
    itls = [g for _, gaps, _ in reqs for g in gaps]
    tpots = [sum(gaps) / (n - 1) for _, gaps, n in reqs if n > 1]
    duration = sum(r["duration"] for r in runs)
    ms = lambda v: round(v * 1000, 2)  # noqa: E731
    return {
        "completed": sum(r["completed"] for r in runs),
        "failed": sum(r.get("failed", 0) for r in runs),
        "ttft_p50_ms": ms(percentile(ttfts, 0.5)), "ttft_p99_ms": ms(percentile(ttfts, 0.99)),
        "tpot_p50_ms": ms(percentile(tpots, 0.5)), "tpot_p99_ms": ms(percentile(tpots, 0.99)),
        "itl_p50_ms": ms(percentile(itls, 0.5)), "itl_p99_ms": ms(percentile(itls, 0.99)),
        "output_tokens_per_s": round(sum(n for _, _, n in reqs) / duration, 1) if duration else None,
    }
