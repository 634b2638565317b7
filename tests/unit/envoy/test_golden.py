"""The Envoy configs of the default topology (deploy/topology.yaml), checked in under envoy/golden/
(one directory per ingress path), so that a change to what gaas/envoy renders is reviewed as a YAML
diff. They are rendered with fixed placeholder paths (RUN_DIR for the run directory, REPO for the
checkout), so they are the same on every machine and every run.

When a change is meant, regenerate them and review the diff:

    GAAS_UPDATE_GOLDEN=1 .venv/bin/python -m pytest tests/unit/envoy/test_golden.py -q -p no:cacheprovider
    git diff envoy/golden/
"""

from __future__ import annotations

import difflib
import os
from pathlib import Path

import pytest

from gaas.envoy import config as envoyconf
from gaas.ops import pki, protogen, topology

ROOT = Path(__file__).resolve().parents[3]
GOLDEN = ROOT / "envoy" / "golden"
RUN_DIR = Path("/RUN_DIR")
REPO = Path("/REPO")
REGENERATE = ("regenerate with `GAAS_UPDATE_GOLDEN=1 .venv/bin/python -m pytest tests/unit/envoy/test_golden.py -q "
              "-p no:cacheprovider` and review `git diff envoy/golden/`")
# The environment the limits in the configs are read from (gaas.contracts.edge): its defaults here.
EDGE_ENV = ("GAAS_MAX_BODY_BYTES", "GAAS_MAX_STREAM_SECONDS")


def _rendered(ingress_path: str) -> dict[str, str]:
    """File name -> text, as `gaas up` would write them for a mesh run from RUN_DIR."""
    topo = topology.load(ROOT / "deploy" / "topology.yaml", env={}, ingress_path=ingress_path)
    configs = envoyconf.render_configs(
        topo, REPO / protogen.DESCRIPTOR_SET.relative_to(protogen.ROOT), RUN_DIR / "logs", pki.Authority(RUN_DIR),
        sockets=topology.sockets_root(RUN_DIR))
    return {f"{name}.yaml": envoyconf.config_text(cfg) for name, cfg in configs.items()}


@pytest.mark.parametrize("ingress_path", topology.INGRESS_PATHS)
def test_the_default_topology_renders_the_golden_configs(ingress_path, monkeypatch):
    for name in EDGE_ENV:
        monkeypatch.delenv(name, raising=False)
    rendered = _rendered(ingress_path)
    golden_dir = GOLDEN / ingress_path
    if os.environ.get("GAAS_UPDATE_GOLDEN") == "1":
        golden_dir.mkdir(parents=True, exist_ok=True)
        for stale in golden_dir.glob("*.yaml"):
            if stale.name not in rendered:
                stale.unlink()
        for name, text in rendered.items():
            (golden_dir / name).write_text(text)
        return
    golden = {p.name: p.read_text() for p in sorted(golden_dir.glob("*.yaml"))}
    assert sorted(rendered) == sorted(golden), (
        f"envoy/golden/{ingress_path}/ holds {sorted(golden)}, the code renders {sorted(rendered)}: {REGENERATE}")
    for name, text in rendered.items():
        if text != golden[name]:
            diff = difflib.unified_diff(golden[name].splitlines(), text.splitlines(),
                                        f"envoy/golden/{ingress_path}/{name}", "rendered", lineterm="")
            shown = "\n".join(list(diff)[:80])
            pytest.fail(f"envoy/golden/{ingress_path}/{name} is not what the code renders:\n{shown}\n\n"
                        f"If the change is meant, {REGENERATE}.")
