"""The processes `gaas up` runs: each child in its own process group, with SIGTERM when `gaas up`
dies (Linux's parent-death signal), restarted with backoff; and what a `gaas up` killed with -9
left behind, found by its process groups and start times and stopped before a new start."""

from __future__ import annotations

import ctypes
import json
import os
import shutil
import signal
import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from gaas.launcher.rundir import STATE_FILE

# How long a start waits for what a `gaas up` that died (kill -9) left stopping, before killing it.
LEFTOVER_GRACE_SECONDS = 20.0


# util-linux's setpriv and taskset: set the parent-death signal and the CPUs, then exec the child.
_SETPRIV, _TASKSET = shutil.which("setpriv"), shutil.which("taskset")
# libc, loaded here in the parent: a dlopen in a forked child can deadlock on a lock another thread held.
try:
    _LIBC = ctypes.CDLL(None, use_errno=True)
except OSError:
    _LIBC = None


def child_launch(cmd: list[str], cpus: set[int] | None) -> tuple[list[str], Callable[[], None] | None]:
    """(the command to exec, what the child runs before exec) for a child that gets SIGTERM when
    the parent dies (Linux's parent-death signal) and keeps to the given CPUs. The signal comes when
    the *thread* that started the child ends, not only the process: start children from the thread
    that lives as long as the mesh.

    With util-linux's setpriv (and taskset) the child execs through them and runs no Python before
    exec: `gaas up` has threads (gRPC's, a model build), and Python code run in a forked child (a
    preexec_fn) can deadlock on a lock one of them held at the fork, leaving gaas up waiting in
    Popen for an exec that never comes. Without them, a preexec_fn that makes two system calls."""
    if _SETPRIV and (_TASKSET or not cpus):
        prefix = [_SETPRIV, "--pdeathsig", "TERM", "--"]
        if cpus:
            prefix += [_TASKSET, "--cpu-list", ",".join(map(str, sorted(cpus)))]
        return [*prefix, *cmd], None

    def setup() -> None:
        if _LIBC is not None:
            _LIBC.prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
        if cpus:
            os.sched_setaffinity(0, cpus)

    return list(cmd), setup


# Restart backoff of a child that exits on its own: 1, 2, 4 ... 30 s; reset once it has run this long.
RESTART_BACKOFF_MAX = 30.0


RESTART_STABLE_SECONDS = 60.0


@dataclass(slots=True)
class Child:
    name: str
    # "redis", "envoy" or a service kind.
    kind: str
    proc: subprocess.Popen
    log: Path
    started: float = field(default_factory=time.monotonic)
    # How to start it again.
    cmd: list[str] = field(default_factory=list)
    env: dict[str, str] = field(default_factory=dict)
    cpus: set[int] | None = None
    # Times it was restarted after exiting on its own; when the next restart is due.
    restarts: int = 0
    backoff: float = 0.0
    restart_at: float = 0.0

    def tail(self, lines: int = 15) -> str:
        try:
            return "\n".join(self.log.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return ""


def _stat(pid: int | str) -> list[str] | None:
    """The fields of /proc/PID/stat after the command's name (the state first), or None when there
    is no such process."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None


def start_ticks(pid: int) -> int | None:
    """When process pid started (clock ticks since boot, /proc/PID/stat), or None when there is
    none: with its pid, what tells a process from a later one that got the same pid."""
    fields = _stat(pid)
    try:
        return int(fields[19]) if fields else None
    except (IndexError, ValueError):
        return None


def _group_members(pgid: int, not_before: int | None) -> list[int]:
    """The processes of process group pgid (each child of `gaas up` leads its own) that started no
    earlier than not_before (None: any)."""
    out = []
    for entry in os.listdir("/proc"):
        fields = _stat(entry) if entry.isdigit() else None
        if fields is None:
            continue
        if int(fields[2]) == pgid and fields[0] != "Z" and (not_before is None or int(fields[19]) >= not_before):
            out.append(int(entry))
    return out


def leftovers(state: dict) -> dict[str, list[int]]:
    """What a `gaas up` that is gone left running, from its state file: child name -> the live
    processes of its group (a service, its vLLM engine processes, an Envoy, the Redis it started)."""
    started = state.get("started") or {}
    out = {}
    for name, pid in (state.get("children") or {}).items():
        members = _group_members(int(pid), started.get(name))
        if members:
            out[name] = members
    return out


def stop_leftovers(run_dir: Path, progress: Callable[[str], None], grace: float = LEFTOVER_GRACE_SECONDS) -> None:
    """Before a start: a `gaas up` that died without stopping the mesh (kill -9) left a state file;
    its children got SIGTERM when it died and may still be draining, holding ports and sockets.
    Wait for them (SIGTERM again), then kill what is left after grace seconds."""
    path = run_dir / STATE_FILE
    try:
        state = json.loads(path.read_text())
    except (OSError, ValueError):
        return
    left = leftovers(state)
    if left:
        names = ", ".join(sorted(left))
        progress(f"the previous gaas up (pid {state.get('pid', '?')}) ended without stopping the mesh; waiting up to "
                 f"{grace:.0f} s for what it left running to stop ({names})")
        for name in left:
            signal_group(int(state["children"][name]), signal.SIGTERM)
        deadline = time.monotonic() + grace
        while left and time.monotonic() < deadline:
            time.sleep(0.2)
            left = leftovers(state)
        if left:
            progress(f"killing what did not stop in time: {', '.join(sorted(left))}")
            for name, members in left.items():
                signal_group(int(state["children"][name]), signal.SIGKILL)
                for pid in members:
                    signal_pid(pid, signal.SIGKILL)
    path.unlink(missing_ok=True)


def signal_group(pgid: int, sig: int) -> None:
    try:
        os.killpg(pgid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def signal_pid(pid: int, sig: int) -> None:
    try:
        os.kill(pid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def become_subreaper() -> bool:
    """Make this process Linux's child subreaper: an orphan below it (a worker the zygote forked, an
    engine process whose worker died) becomes its child, not init's. False where Linux refuses."""
    return _LIBC is not None and _LIBC.prctl(36, 1, 0, 0, 0) == 0  # PR_SET_CHILD_SUBREAPER


def reap_strays(known: set[int]) -> int:
    """Wait for this process's exited children that none of its own handles waits for (orphans it
    adopted as a subreaper), so that none stays a zombie; returns how many."""
    me, reaped = str(os.getpid()), 0
    for entry in os.listdir("/proc"):
        fields = _stat(entry) if entry.isdigit() and int(entry) not in known else None
        if fields is not None and fields[0] == "Z" and fields[1] == me:
            try:
                os.waitpid(int(entry), os.WNOHANG)
                reaped += 1
            except ChildProcessError:
                pass
    return reaped
