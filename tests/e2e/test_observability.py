"""What operators point at the mesh: the Prometheus scrape config `gaas up` writes from the
topology, and the Grafana dashboard in deploy/ (every metric it charts is one the mesh exports)."""

from __future__ import annotations

import json
import re
import urllib.error
import urllib.request

import pytest
import yaml

from gaas.ops import promconf, topology
from tests.conftest import ROOT
from tests.meshutil import generate
from tests.waiting import eventually

DASHBOARD = ROOT / "deploy" / "grafana" / "gaas.json"


def test_the_scrape_config_names_every_instance_and_every_envoy_once():
    topo = topology.load(ROOT / "deploy" / "topology.yaml", env={}, port_base=41000, workers=3)
    cfg = promconf.config(topo)
    services = [j for j in cfg["scrape_configs"] if j["job_name"] != "gaas-envoy"]
    targets = {c["labels"]["instance"]: (job["job_name"], c["targets"]) for job in services for c in job["static_configs"]}
    assert set(targets) == {i.name for i in topo.instances}
    for inst in topo.instances:
        assert targets[inst.name] == (f"gaas-{inst.service}", [f"{inst.host}:{inst.metrics_port}"])
    (envoys,) = [j for j in cfg["scrape_configs"] if j["job_name"] == "gaas-envoy"]
    assert envoys["metrics_path"] == "/stats/prometheus"
    named = {c["labels"]["envoy"]: c["targets"] for c in envoys["static_configs"]}
    assert named == {**{f"ingress-{n}": [f"127.0.0.1:{topo.ingress_stats_port_of(n)}"] for n in range(2)},
                     **{f"sidecar-{i.name}": [f"{i.host}:{i.envoy_stats_port}"] for i in topo.instances}}


def _queried_metrics() -> set[str]:
    dash = json.loads(DASHBOARD.read_text())
    exprs = [t["expr"] for p in dash["panels"] for t in p["targets"]]
    names = set()
    for e in exprs:
        e = re.sub(r'"[^"]*"', '""', e)  # label values and name regexes are not names
        e = re.sub(r"\{[^}]*\}", "", e)  # nor are label matchers
        e = re.sub(r"\b(by|without)\s*\([^)]*\)", "", e)  # nor the labels aggregated by
        names.update(re.findall(r"\b(gaas_[a-z0-9_]+|process_[a-z_]+|envoy_[a-z0-9_]+)\b", e))
    return names


def test_the_dashboard_is_grafana_json_over_one_datasource():
    dash = json.loads(DASHBOARD.read_text())
    assert dash["uid"] == "gaas-mesh" and dash["panels"]
    ids = [p["id"] for p in dash["panels"]]
    assert len(ids) == len(set(ids))
    assert all(t["datasource"]["uid"] == "${DS_PROMETHEUS}" for p in dash["panels"] for t in p["targets"])
    assert "gaas_router_request_latency_seconds_bucket" in _queried_metrics()


def _scrape(cfg: dict) -> str:
    exposed = ""
    for job in cfg["scrape_configs"]:
        for c in job["static_configs"]:
            for target in c["targets"]:
                url = f"http://{target}{job.get('metrics_path', '/metrics')}"
                exposed += urllib.request.urlopen(url, timeout=5).read().decode()
    return exposed


def test_every_metric_the_dashboard_charts_is_scraped_from_the_running_mesh(mesh):
    for _ in range(3):
        generate(mesh, prompt="dashboard", max_tokens=4)
    cfg = yaml.safe_load((mesh.run_dir / "prometheus.yml").read_text())
    # Envoy publishes its histograms at its next statistics flush (every 5 s).
    missing: list = []

    def all_exported() -> bool:
        exposed = _scrape(cfg)
        missing[:] = sorted(name for name in _queried_metrics() if not re.search(rf"^{name}[{{ ]", exposed, re.M))
        return not missing

    eventually(all_exported, 15, every=1, what=lambda: f"every metric the dashboard charts exported (missing: {missing})")


def test_an_envoys_statistics_port_serves_its_statistics_and_nothing_else_of_its_admin(mesh):
    topo = topology.load(ROOT / "deploy" / "topology.yaml", env={}, port_base=mesh.port_base,
                         workers=len(mesh.ready["workers"]))
    for name, target in topo.envoy_stats().items():
        body = urllib.request.urlopen(f"http://{target}/stats/prometheus", timeout=5).read().decode()
        assert re.search(r"^envoy_server_live(\{.*\})? 1$", body, re.M), name
    ingress = topo.envoy_stats()["ingress-0"]
    for path, method in (("/quitquitquit", "POST"), ("/drain_listeners", "POST"), ("/config_dump", "GET"),
                         ("/clusters", "GET")):
        with pytest.raises(urllib.error.HTTPError) as e:
            urllib.request.urlopen(urllib.request.Request(f"http://{ingress}{path}", method=method, data=b"" if method == "POST" else None), timeout=5)
        assert e.value.code == 404, path
    assert urllib.request.urlopen(f"http://{ingress}/stats/prometheus", timeout=5).status == 200  # still up
