"""What operators point at the mesh: the Prometheus scrape config `gaas up` writes from the
topology, and the Grafana dashboard in deploy/ (every metric it charts is one the mesh exports)."""

from __future__ import annotations

import json
import re
import urllib.request

import yaml

from gaas import promconf, topology
from tests.conftest import ROOT
from tests.meshutil import generate

DASHBOARD = ROOT / "deploy" / "grafana" / "gaas.json"


def test_the_scrape_config_names_every_instance_once_by_service():
    topo = topology.load(ROOT / "deploy" / "topology.yaml", env={}, port_base=41000, workers=3)
    cfg = promconf.config(topo)
    targets = {c["labels"]["instance"]: (job["job_name"], c["targets"])
               for job in cfg["scrape_configs"] for c in job["static_configs"]}
    assert set(targets) == {i.name for i in topo.instances}
    for inst in topo.instances:
        assert targets[inst.name] == (f"gaas-{inst.service}", [f"{inst.host}:{inst.metrics_port}"])


def _queried_metrics() -> set[str]:
    dash = json.loads(DASHBOARD.read_text())
    exprs = [t["expr"] for p in dash["panels"] for t in p["targets"]]
    names = set()
    for e in exprs:
        e = re.sub(r'"[^"]*"', '""', e)  # label values and name regexes are not names
        names.update(re.findall(r"\b(gaas_[a-z0-9_]+|process_[a-z_]+)\b", e))
    return names


def test_the_dashboard_is_grafana_json_over_one_datasource():
    dash = json.loads(DASHBOARD.read_text())
    assert dash["uid"] == "gaas-mesh" and dash["panels"]
    ids = [p["id"] for p in dash["panels"]]
    assert len(ids) == len(set(ids))
    assert all(t["datasource"]["uid"] == "${DS_PROMETHEUS}" for p in dash["panels"] for t in p["targets"])
    assert "gaas_router_request_latency_seconds_bucket" in _queried_metrics()


def test_every_metric_the_dashboard_charts_is_scraped_from_the_running_mesh(mesh):
    for _ in range(3):
        generate(mesh, prompt="dashboard", max_tokens=4)
    cfg = yaml.safe_load((mesh.run_dir / "prometheus.yml").read_text())
    exposed = ""
    for job in cfg["scrape_configs"]:
        for c in job["static_configs"]:
            for target in c["targets"]:
                exposed += urllib.request.urlopen(f"http://{target}/metrics", timeout=5).read().decode()
    missing = sorted(name for name in _queried_metrics() if not re.search(rf"^{name}[{{ ]", exposed, re.M))
    assert not missing, f"the dashboard charts metrics nothing exports: {missing}"
