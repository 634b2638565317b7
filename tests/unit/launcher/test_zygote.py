"""The worker zygote (gaas.launcher.zygote): children forked from one process that imported their
module's preloads once, adopted by `gaas up` (a child subreaper) so that they outlive the zygote,
started as `gaas up` starts its others (session, cores, log, environment, SIGTERM when `gaas up`
dies) and watched like subprocess.Popen. Each scenario runs in a process of its own
(zygote_launcher), as `gaas up` would."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
from pathlib import Path

from gaas.launcher.zygote import Zygote, fits
from tests.conftest import ROOT, process_alive
from tests.waiting import eventually

MODULE = "tests.unit.launcher.zygote_child"


def _run(tmp_path: Path, scenario: str) -> tuple[dict, dict]:
    out = tmp_path / "seen.json"
    subprocess.run([sys.executable, "-c", "from tests.unit.launcher.zygote_launcher import run; "
                    f"run({scenario!r}, {str(out)!r})"], cwd=ROOT, check=True, timeout=120)
    return json.loads(out.read_text()), json.loads((tmp_path / "child.json").read_text())


def test_a_forked_child_is_the_process_gaas_up_would_start_and_gaas_up_reads_its_exit_code(tmp_path):
    seen, child = _run(tmp_path, "exit")
    assert seen["returncode"] == 3
    assert child["pid"] == seen["child"]
    # Its own session and process group (signalled as a whole), its cores, the working directory.
    assert child["sid"] == child["pgid"] == child["pid"]
    assert child["cpus"] == [0] and child["cwd"] == str(ROOT)
    # Exactly its environment; the module's preloads already imported; run as `python -m` would.
    assert child["env"]["GAAS_TEST_OWN"] == "mine" and child["env"]["GAAS_TEST_EXIT"] == "3"
    assert child["preloaded"] and child["argv"][0].endswith("zygote_child.py")
    # Named after its log in ps's short form (its command line is the zygote's).
    assert child["comm"] == "child"
    # Its output in its log.
    assert "hello from the child" in (tmp_path / "child.log").read_text()


def test_a_child_is_gaas_ups_own_and_a_signal_ends_it_as_popen_tells(tmp_path):
    seen, _ = _run(tmp_path, "signal")
    assert seen["child_parent"] == seen["me"]
    assert seen["timed_out"] and seen["returncode"] == -signal.SIGTERM


def test_a_child_outlives_a_zygote_killed_with_kill_9(tmp_path):
    seen, _ = _run(tmp_path, "zygote-dies")
    assert seen["after_zygote"] is None and seen["returncode"] == -signal.SIGTERM


def test_a_child_gets_sigterm_when_gaas_up_dies(tmp_path):
    seen, _ = _run(tmp_path, "launcher-dies")
    eventually(lambda: not process_alive(seen["child"]), 30, what="the child gone with the process that adopted it")


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
