"""Rolling restarts of a running mesh (what `gaas restart` does): the instances of a service, or one
instance, restarted one at a time. Each gets SIGTERM (it drains: NOT_SERVING, a worker deregisters,
calls in flight finish), the `gaas up` that runs it (gaas.launcher.mesh, Mesh.supervise) starts it
again, and the next one leaves only once the new process serves; a worker also once it is registered
and the routers have had time to see it. With two or more replicas of a service no request fails.

This module signals and watches processes; it neither prints nor reads the command line.
"""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Callable
from pathlib import Path

from gaas.ops.topology import Instance, Topology

# The services a rolling restart may name (every kind `gaas up` runs but the Envoys).
RESTARTABLE = ("control", "kvcache", "billing", "worker", "router")
# How often a restarted instance's process and health are looked at.
POLL_SECONDS = 0.5


class RestartError(RuntimeError):
    """An instance that could not be restarted: not a process of the running mesh, or not serving in time."""


def instances_named(topo: Topology, target: str) -> list[Instance]:
    """The instances target names: a restartable service's (all its replicas), 'all' (every restartable
    service's, in RESTARTABLE's order), or one instance by name (e.g. worker-1); [] when none."""
    if target not in (*RESTARTABLE, "all"):
        return [i for i in topo.instances if i.name == target]
    kinds = RESTARTABLE if target == "all" else (target,)
    return [i for k in kinds for i in topo.of(k)]


def rolling_restart(
    topo: Topology,
    instances: list[Instance],
    *,
    state: Callable[[], dict | None],
    run_dir: Path,
    timeout: float,
    router_refresh_seconds: float,
    progress: Callable[[str], None],
) -> None:
    """Restart instances one at a time, each waited for before the next; raises RestartError.

    state reads the running `gaas up`'s state afresh (its children's pids: a new pid is the restarted
    process); timeout is how long each instance may take to serve again (a worker loads its model);
    router_refresh_seconds how often routers re-read control's registry of workers."""
    from gaas.ops.probe import grpc_health, list_workers

    for inst in instances:
        pid = state()["children"].get(inst.name)
        if not pid:
            raise RestartError(f"{inst.name} is not among the processes gaas up runs")
        progress(f"restarting {inst.name} (pid {pid}): draining")
        started = time.monotonic()
        try:
            os.kill(pid, signal.SIGTERM)
        except ProcessLookupError:
            pass
        deadline = started + timeout
        while True:
            current = (state() or {}).get("children", {}).get(inst.name)
            if current and current != pid and grpc_health(inst.inbound, timeout=1.0)[0] == "SERVING":
                if inst.service != "worker":
                    break
                # A worker is back once it is registered and routers have had time to see it
                # (two of their refreshes), before the next one leaves.
                if any(w["worker_id"] == inst.name and w["state"] == "SERVING"
                       for w in list_workers(topo.of("control")[0].inbound, 1.0)):
                    time.sleep(router_refresh_seconds * 2)
                    break
            if time.monotonic() > deadline:
                raise RestartError(f"{inst.name} is not serving {timeout:.0f} s after its restart; see "
                                   f"{run_dir / 'logs' / (inst.name + '.log')}")
            time.sleep(POLL_SECONDS)
        progress(f"{inst.name} serves again (pid {current}) after {time.monotonic() - started:.0f} s")
