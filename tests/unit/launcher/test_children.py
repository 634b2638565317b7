"""How `gaas up` starts a child (gaas.launcher.children.child_launch): on its CPUs, with SIGTERM when
the thread that started it ends, and with no Python run in the forked child when util-linux can do
both (a preexec_fn can deadlock on a lock another of gaas up's threads held at the fork)."""

from __future__ import annotations

import shutil
import subprocess
import threading
from pathlib import Path

import pytest

from gaas.launcher.children import child_launch
from tests.waiting import eventually

needs_util_linux = pytest.mark.skipif(not (shutil.which("setpriv") and shutil.which("taskset")),
                                      reason="util-linux's setpriv and taskset are not installed")


def _status(pid: int, field: str) -> str:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return line.split(":", 1)[1].strip()
    raise KeyError(field)


def _wait_exec(pid: int, command: bytes) -> None:
    eventually(lambda: Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")[0] == command, 5, every=0.01,
               what="the child become the command itself")


@needs_util_linux
def test_a_child_runs_no_python_before_exec_and_keeps_to_its_cpus():
    argv, setup = child_launch(["sleep", "30"], {0})
    assert setup is None, "util-linux sets the signal and the CPUs: no preexec_fn"
    proc = subprocess.Popen(argv, start_new_session=True)
    try:
        _wait_exec(proc.pid, b"sleep")
        assert _status(proc.pid, "Cpus_allowed_list") == "0"
    finally:
        proc.kill()
        proc.wait()


@pytest.mark.parametrize("util_linux", [True, False], ids=["setpriv", "preexec_fn"])
def test_a_child_gets_sigterm_when_the_thread_that_started_it_ends(util_linux, monkeypatch):
    if util_linux and not shutil.which("setpriv"):
        pytest.skip("util-linux's setpriv is not installed")
    if not util_linux:
        monkeypatch.setattr("gaas.launcher.children._SETPRIV", None)
    procs = []

    def start() -> None:
        argv, setup = child_launch(["sleep", "30"], None)
        procs.append(subprocess.Popen(argv, preexec_fn=setup, start_new_session=True))
        _wait_exec(procs[0].pid, b"sleep")  # (setpriv arms the signal before it execs the command)

    t = threading.Thread(target=start)
    t.start()
    t.join()
    try:
        assert procs[0].wait(timeout=10) == -15, "SIGTERM once its starting thread ended"
    finally:
        if procs[0].poll() is None:
            procs[0].kill()
