from pathlib import Path

import pytest

from gaas.ops import topology
from gaas.ops.topology import TopologyError

ROOT = Path(__file__).resolve().parents[3]
DOC = {
    "host": "127.0.0.1",
    "port_base": 20000,
    "ingress": {"port": 8080},
    "services": {
        "control": {"replicas": 1},
        "kvcache": {"replicas": 1},
        "billing": {"replicas": 1},
        "router": {"replicas": 2},
        "worker": {"replicas": 2},
    },
}


def test_ports_are_derived_in_blocks_of_ten():
    t = topology.build(DOC)
    names = [i.name for i in t.instances]
    assert names == ["control-0", "kvcache-0", "billing-0", "worker-0", "worker-1", "router-0", "router-1"]
    c = t.instance("control-0")
    assert (c.port, c.inbound_port, c.outbound_port, c.admin_port, c.metrics_port) == (20010, 20011, 20012, 20013, 20014)
    # The workers' blocks come after every other instance's: a worker started later takes the next.
    assert t.instance("router-1").base == 20050 and t.instance("worker-1").base == 20070
    assert t.worker(2).base == 20080 and t.worker(2).name == "worker-2"
    assert t.ingress_admin_port == 20003
    assert len(set(t.all_ports())) == len(t.all_ports())
    # Under gaas up only the ingress, the sidecars' inbound listeners, /metrics and the Envoys'
    # statistics use TCP (the ingress's two Envoys', 20005 and 20007).
    assert sorted(t.tcp_ports()) == [t.ingress_port, 20005, 20007, 20011, 20014, 20015, 20021, 20024, 20025, 20031, 20034, 20035,
                             20041, 20044, 20045, 20051, 20054, 20055, 20061, 20064, 20065, 20071, 20074, 20075]
    assert t.trace_port == 20006 and t.trace_port in t.all_ports()


def test_overrides_win():
    t = topology.build(DOC, port_base=40000, ingress_port=9999, workers=3)
    assert t.ingress == "127.0.0.1:9999"
    assert t.instance("control-0").port == 40010
    assert [w.name for w in t.of("worker")] == ["worker-0", "worker-1", "worker-2"]
    assert t.of("worker")[0].options["kv_cache_gib"] == 1  # defaults filled in


def test_env_overrides(tmp_path):
    t = topology.load(ROOT / "deploy" / "topology.yaml", env={"GAAS_PORT_BASE": "41000", "GAAS_WORKERS": "2"})
    assert t.port_base == 41000 and len(t.of("worker")) == 2


@pytest.mark.parametrize(
    "change, message",
    [
        ({"services": {**DOC["services"], "cache": {}}}, "unknown service"),
        ({"services": {k: v for k, v in DOC["services"].items() if k != "router"}}, "missing: router"),
        ({"services": {**DOC["services"], "worker": {"model": "gaas-tiny"}}}, "the deployment's now"),
        ({"services": {**DOC["services"], "worker": {"gpus": 2}}}, "unknown engine setting 'gpus'"),
        ({"services": {**DOC["services"], "router": {"replicas": 0}}}, "at least 1"),
        ({"services": {**DOC["services"], "worker": {"stream_interval": 0}}}, "stream_interval"),
        ({"services": {**DOC["services"], "worker": {"executor": "ray"}}}, "executor must be one of uni, mp"),
        ({"port_base": "lots"}, "port_base must be an integer"),
        ({"ingress": {"port": 20011}}, "collides"),
        ({"ingress": {"port": 20071}}, "holds the ingress port 20071"),
        ({"port_base": 65500}, "too few ports"),
    ],
)
def test_bad_topologies_say_what_is_wrong(change, message):
    with pytest.raises(TopologyError, match=message):
        topology.build({**DOC, **change})


def test_the_shipped_topology_loads():
    t = topology.load(ROOT / "deploy" / "topology.yaml", env={})
    assert {i.service for i in t.instances} == set(topology.SERVICES)


@pytest.mark.parametrize("cores, workers, expected", [
    # One worker on two cores: its engine on core 0, everything else on core 1.
    ([0, 1], 1, {0: (0, {1})}),
    # An engine on every core: no front end is pinned onto another worker's engine core.
    ([0, 1], 2, {0: (0, None), 1: (1, None)}),
    ([0, 1, 2, 3], 2, {0: (0, {2, 3}), 1: (1, {2, 3})}),
    ([4, 5, 6], 3, {0: (4, None), 1: (5, None), 2: (6, None)}),
])
def test_front_ends_keep_off_every_engine_core(monkeypatch, cores, workers, expected):
    from gaas.host import placement

    monkeypatch.setattr(placement.os, "sched_getaffinity", lambda pid: set(cores))
    assert {i: placement.worker_cpus(i, workers) for i in range(workers)} == expected


@pytest.mark.parametrize("spec, cpus", [
    ("0", {0}), ("0-3", {0, 1, 2, 3}), ("0,2,4-5", {0, 2, 4, 5}), ("auto", set()), ("nobind", set()), ("1-x", set()),
])
def test_cpu_lists_read_as_vllm_writes_them(spec, cpus):
    from gaas.host.placement import parse_cpu_list

    assert parse_cpu_list(spec) == cpus


@pytest.mark.parametrize("command", [["status"], ["kv", "stats"], ["session", "list", "--tenant", "demo"]])
def test_every_command_that_reads_a_malformed_topology_says_what_is_wrong_and_exits_2(tmp_path, capsys, monkeypatch,
                                                                                      command):
    from gaas.cli.main import main

    monkeypatch.setenv("GAAS_HOME", str(tmp_path))  # (main sets it: restored after the test)
    bad = tmp_path / "topology.yaml"
    bad.write_text("services: 3\n")
    assert main([*command, "--topology", str(bad), "--run-dir", str(tmp_path / "run")]) == 2
    assert "'services' must map service names" in capsys.readouterr().err


def test_the_ingress_path_is_direct_unless_the_topology_or_the_environment_says_router(tmp_path):
    assert topology.build(DOC).ingress_path == "direct"
    assert topology.build({**DOC, "ingress": {"port": 8080, "path": "router"}}).ingress_path == "router"
    assert topology.build({**DOC, "ingress": {"port": 8080, "path": "direct"}}).ingress_path == "direct"
    assert topology.build({**DOC, "ingress": {"port": 8080, "path": "direct"}}, ingress_path="router").ingress_path == "router"
    with pytest.raises(TopologyError, match="ingress.path must be one of router, direct, got 'sideways'"):
        topology.build({**DOC, "ingress": {"port": 8080, "path": "sideways"}})
    assert topology.load(ROOT / "deploy" / "topology.yaml", env={"GAAS_INGRESS_PATH": "direct"}).ingress_path == "direct"
    assert topology.load(ROOT / "deploy" / "topology.yaml", env={}).ingress_path == "direct"
    assert topology.load(ROOT / "deploy" / "topology.yaml", env={"GAAS_INGRESS_PATH": "router"}).ingress_path == "router"


def test_a_fleet_gives_each_worker_its_pool_over_the_topologys_defaults():
    pools = [{"model": "a", "version": "1", "engine": {"max_num_seqs": 8}}, {"model": "b", "version": "2"}]
    t = topology.build({**DOC, "services": {**DOC["services"], "worker": {"max_num_seqs": 32}}}, fleet=pools)
    w0, w1 = t.of("worker")
    assert (w0.options["model"], w0.options["max_num_seqs"], w0.options["kv_cache_gib"]) == ("a", 8, 1)
    assert (w1.options["model"], w1.options["version"], w1.options["max_num_seqs"]) == ("b", "2", 32)
    assert t.auto_workers == 1 and t.worker_defaults["max_num_seqs"] == 32
    grown = topology.with_workers(t, [*t.of("worker"), t.worker(5, pools[1])])
    assert [w.name for w in grown.of("worker")] == ["worker-0", "worker-1", "worker-5"]
    assert len(set(grown.all_ports())) == len(grown.all_ports())
