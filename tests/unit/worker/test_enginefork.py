"""The engine core's process forked from the worker's preloaded server (services/worker/enginefork.py)
and the environment a CPU engine's processes start with."""

import json
import os
import subprocess
import sys

from gaas.settings.worker import WorkerSettings
from gaas.host import placement
from services.worker import enginefork
from tests.conftest import ROOT
from tests.unit.worker.support import write_environ_value, write_titled_cmdline


def test_an_engine_process_runs_in_its_starters_environment_at_start_not_the_servers(tmp_path, monkeypatch):
    # (One forkserver per process: this test starts it for the module's tests.)
    ctx = enginefork.start_server({"GAAS_TEST_SERVER_START": "server"}, set(), modules=())
    assert ctx is not None
    monkeypatch.setenv("GAAS_TEST_SERVER_START", "starter")
    monkeypatch.setenv("GAAS_TEST_SET_LATER", "later")
    for name in ("GAAS_TEST_SERVER_START", "GAAS_TEST_SET_LATER"):
        out = tmp_path / name
        p = ctx.Process(target=write_environ_value, args=(name, str(out)))
        p.start()
        p.join(60)
        assert p.exitcode == 0
        assert out.read_text() == os.environ[name]
    # Forked from the server, not spawned from this process.
    assert ctx.get_start_method() == "forkserver"


def test_a_forked_engine_process_shows_vllms_title_and_the_worker_keeps_its_environment(tmp_path):
    ctx = enginefork.start_server({"GAAS_TEST_SERVER_START": "server"}, set(), modules=())
    out = tmp_path / "cmdline"
    p = ctx.Process(target=write_titled_cmdline, args=("VLLM::EngineCore", str(out)))
    p.start()
    p.join(60)
    assert out.read_bytes().startswith(b"VLLM::EngineCore")
    # The title's set-up moves a process's environment out of what /proc shows: never in the worker.
    with open(f"/proc/{os.getpid()}/environ", "rb") as f:
        assert b"PATH=" in f.read()


def test_a_worker_started_with_the_engines_environment_forks_the_server_from_itself(tmp_path):
    # As `gaas up` starts a CPU worker: what the engine needs from its start is in its environment
    # already (here first in it, where a change would hide the command line from setproctitle).
    out = tmp_path / "report.json"
    env = {"GAAS_TEST_SERVER_START": "server", **{k: v for k, v in os.environ.items() if k != "GAAS_TEST_SERVER_START"}}
    subprocess.run([sys.executable, "-c", "from tests.unit.worker.support import fork_the_engine_server_and_report as f; "
                    f"f({str(out)!r})"], cwd=ROOT, env=env, check=True, timeout=120)
    report = json.loads(out.read_text())
    # No second interpreter importing vLLM: the server is the worker's own child.
    assert report["server_parent"] == report["pid"]
    # An engine process runs in its starter's environment and shows vLLM's title.
    assert report["engine_env"] == "starter"
    assert report["engine_cmdline"].startswith("VLLM::EngineCore")


def test_a_cpu_engine_preloads_torchs_openmp_unless_one_is_preloaded(monkeypatch):
    s = WorkerSettings.from_env({"GAAS_MODEL": "m", "GAAS_MODEL_PATH": "/m", "GAAS_KV_CACHE_GIB": "2"})
    monkeypatch.setenv("VLLM_CPU_OMP_THREADS_BIND", "0-1")
    monkeypatch.delenv("LD_PRELOAD", raising=False)
    env = placement.cpu_engine_environment(s.executor, s.kv_cache_gib)
    assert env["VLLM_CPU_KVCACHE_SPACE"] == "2"
    assert env["OMP_NUM_THREADS"] == "2"
    assert "libgomp" in env["LD_PRELOAD"] and os.path.exists(env["LD_PRELOAD"].split(":")[-1])
    monkeypatch.setenv("LD_PRELOAD", "/opt/libiomp5.so")
    assert env.get("LD_PRELOAD", "") != placement.cpu_engine_environment(s.executor, s.kv_cache_gib).get("LD_PRELOAD")
    assert "libgomp" not in placement.cpu_engine_environment(s.executor, s.kv_cache_gib)["LD_PRELOAD"]
