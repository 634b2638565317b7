"""What the zygote's tests run in a process of their own (tests/unit/launcher/test_zygote.py): a
`gaas up` in small, a child subreaper that starts the zygote (gaas.launcher.zygote), asks it for a
child running tests/unit/launcher/zygote_child.py, and writes what it saw as JSON."""

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

from gaas.launcher.children import become_subreaper
from gaas.launcher.zygote import Zygote
from tests.waiting import eventually

MODULE = "tests.unit.launcher.zygote_child"
ROOT = Path(__file__).resolve().parents[3]


def run(scenario: str, out: str) -> None:
    """scenario: exit (the child exits 3), signal (SIGTERM while it waits), zygote-dies (kill -9 of
    the zygote while its child waits), launcher-dies (this process exits while its child waits)."""
    tmp = Path(out).parent
    assert become_subreaper()
    sock = tmp / "z.sock"
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    zygote = subprocess.Popen([sys.executable, "-m", "gaas.launcher.zygote", str(sock), MODULE], cwd=ROOT, env=env,
                              stdout=open(tmp / "zygote.log", "ab"), stderr=subprocess.STDOUT, start_new_session=True)
    z = Zygote(sock, env, MODULE)
    extra = {"exit": {"GAAS_TEST_EXIT": "3"}}.get(scenario, {"GAAS_TEST_WAIT": "1"})
    report_file = tmp / "child.json"
    child = z.spawn({**env, "GAAS_TEST_REPORT": str(report_file), "GAAS_TEST_OWN": "mine", **extra}, {0},
                    tmp / "child.log", ROOT, alive=lambda: zygote.poll() is None, timeout=60)
    seen: dict = {"me": os.getpid(), "child": child.pid}
    eventually(report_file.exists, 60, every=0.02, what="the child running")
    seen["child_parent"] = int(Path(f"/proc/{child.pid}/stat").read_text().rsplit(")", 1)[1].split()[1]) \
        if child.poll() is None else None
    if scenario == "exit":
        seen["returncode"] = child.wait(30)
    elif scenario == "signal":
        try:
            child.wait(0.2)
            seen["timed_out"] = False
        except subprocess.TimeoutExpired:
            seen["timed_out"] = True
        child.send_signal(signal.SIGTERM)
        seen["returncode"] = child.wait(30)
    elif scenario == "zygote-dies":
        zygote.kill()
        zygote.wait(10)
        try:  # (a child that died with the zygote would be gone within half a second)
            seen["after_zygote"] = child.wait(0.5)
        except subprocess.TimeoutExpired:
            seen["after_zygote"] = None
        child.send_signal(signal.SIGTERM)
        seen["returncode"] = child.wait(30)
    zygote.kill()  # (its child does not need it: launcher-dies then leaves only the child behind)
    with open(out, "w") as f:
        json.dump(seen, f)
