"""`gaas status` (gaas/cli/status.py): what it says of an instance beyond its health check."""

import os

from gaas.cli.status import started_process_runs
from gaas.launcher.children import start_ticks


def test_a_worker_is_starting_while_the_process_gaas_up_started_runs_not_a_later_one_of_its_pid():
    me = os.getpid()
    assert started_process_runs({"children": {"worker-0": me}, "started": {"worker-0": start_ticks(me)}}, "worker-0")
    # Its pid taken by another process since (another start time), or no such child: not starting.
    assert not started_process_runs({"children": {"worker-0": me}, "started": {"worker-0": start_ticks(me) - 1}}, "worker-0")
    assert not started_process_runs({"children": {}}, "worker-0") and not started_process_runs(None, "worker-0")
