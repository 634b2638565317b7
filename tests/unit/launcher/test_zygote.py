"""The worker zygote (gaas.launcher.zygote): children forked from one process that imported their
module's preloads once, started as `gaas up` starts its others (session, cores, log, environment,
SIGTERM when their parent dies) and watched like subprocess.Popen."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from gaas.launcher.zygote import Zygote, fits
from tests.conftest import ROOT
from tests.waiting import eventually

MODULE = "tests.unit.launcher.zygote_child"


@pytest.fixture
def zygote(tmp_path):
    path = tmp_path / "z.sock"
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    proc = subprocess.Popen([sys.executable, "-m", "gaas.launcher.zygote", str(path), MODULE], cwd=ROOT, env=env,
                            stdout=open(tmp_path / "zygote.log", "ab"), stderr=subprocess.STDOUT, start_new_session=True)
    yield Zygote(path, env, MODULE), proc
    proc.kill()
    proc.wait(10)


def _spawn(zygote, tmp_path, **env):
    z, proc = zygote
    child_env = {**z.env, "GAAS_TEST_REPORT": str(tmp_path / "report.json"), **env}
    child = z.spawn(child_env, {0}, tmp_path / "child.log", ROOT, alive=lambda: proc.poll() is None, timeout=60)
    assert child is not None
    return child


def test_a_forked_child_is_the_process_gaas_up_would_start_and_its_exit_code_comes_back(zygote, tmp_path):
    child = _spawn(zygote, tmp_path, GAAS_TEST_EXIT="3", GAAS_TEST_OWN="mine")
    assert child.wait(30) == 3 and child.poll() == 3 and child.returncode == 3
    report = json.loads((tmp_path / "report.json").read_text())
    assert report["pid"] == child.pid
    # Its own session and process group (signalled as a whole), its cores, the working directory.
    assert report["sid"] == report["pgid"] == child.pid
    assert report["cpus"] == [0] and report["cwd"] == str(ROOT)
    # Exactly its environment; the module's preloads already imported; run as `python -m` would.
    assert report["env"]["GAAS_TEST_OWN"] == "mine" and report["env"] == {**zygote[0].env, **{
        "GAAS_TEST_REPORT": str(tmp_path / "report.json"), "GAAS_TEST_EXIT": "3", "GAAS_TEST_OWN": "mine"}}
    assert report["preloaded"] and report["argv"][0].endswith("zygote_child.py")
    # Its output in its log.
    assert "hello from the child" in (tmp_path / "child.log").read_text()


def test_a_signalled_child_reports_the_signal_as_popen_does_and_waits_time_out_meanwhile(zygote, tmp_path):
    child = _spawn(zygote, tmp_path, GAAS_TEST_WAIT="1")
    eventually(lambda: (tmp_path / "report.json").exists(), 30, what="the child running")
    with pytest.raises(subprocess.TimeoutExpired):
        child.wait(0.2)
    assert child.poll() is None
    child.send_signal(signal.SIGTERM)
    assert child.wait(30) == -signal.SIGTERM


def test_children_get_sigterm_when_the_zygote_dies_and_are_seen_gone(zygote, tmp_path):
    child = _spawn(zygote, tmp_path, GAAS_TEST_WAIT="1")
    eventually(lambda: (tmp_path / "report.json").exists(), 30, what="the child running")
    zygote[1].kill()
    assert child.wait(30) == -signal.SIGTERM


def test_no_zygote_answering_means_no_child_rather_than_a_wait(tmp_path):
    z = Zygote(tmp_path / "none.sock", {}, MODULE)
    assert z.spawn({}, None, tmp_path / "log", ROOT, alive=lambda: False) is None


def test_only_a_process_whose_environment_agrees_but_for_its_own_settings_is_forked():
    base = {"PATH": "/usr/bin", "LD_PRELOAD": "/lib/libgomp.so", "OMP_NUM_THREADS": "1", "GAAS_REDIS_URL": "r"}
    # Its settings, cores, cache size and tracing are each worker's own.
    assert fits(base, {**base, "GAAS_INSTANCE": "worker-3", "VLLM_CPU_OMP_THREADS_BIND": "1",
                       "VLLM_CPU_KVCACHE_SPACE": "4", "OTEL_EXPORTER_OTLP_ENDPOINT": "x"})
    # What an interpreter's start or an import reads is the zygote's: a difference there, not forked.
    assert not fits(base, {**base, "OMP_NUM_THREADS": "2"})
    assert not fits(base, {k: v for k, v in base.items() if k != "LD_PRELOAD"})
    assert not fits(base, {**base, "HF_HUB_OFFLINE": "1"})
    z = Zygote(Path("/nowhere"), base, MODULE)
    assert z.fits([sys.executable, "-m", MODULE], base) and not z.fits([sys.executable, "-m", "other"], base)
