"""py-spy's view of running Python processes while a benchmark's run goes: each process sampled
without being stopped (--nonblocking: py-spy reads its memory as it runs, so the run's CPU figures
are unchanged), the samples kept as folded stacks, and its functions ranked by samples of their own.

Only the thread holding the GIL is sampled (--gil): the Python work, and the C it calls holding the
GIL. Without it, py-spy keeps every thread Linux calls running, which includes ready to run: on a
host whose cores are all busy, an event loop woken from epoll is sampled in epoll until it gets a
core, and on this host py-spy saw a worker's front end in epoll for nearly every sample of a run in
which that thread spent 17% of a core working. C that runs without the GIL (gRPC's core threads, its
poller, ZMQ's I/O threads) is not in these samples: proccpu.by_thread() shows what each thread spent.
py-spy can run on cores of its own (cpus), so that sampling does not take the sampled processes' core."""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

from bench.common.output import ROOT

# Frames listed per process.
TOP_FRAMES = 12
# Samples a second of each process.
RATE = 500
# The functions a thread waits in (a sample there is a woken thread waiting for a core, not work).
WAITS = frozenset({"EpollSelector.select", "PollSelector.select", "_PollLikeSelector.select", "SelectSelector.select",
                   "Condition.wait", "Event.wait", "_worker", "sleep"})
# What own samples of a frame mean where the work is in C, which py-spy cannot see without stopping
# the process (--native) and then cannot tell a waiting thread from a working one.
C_WORK = {
    "Thread.run": "C holding the GIL on a thread of its own (in a gRPC server: grpc.aio's poller, Cython)",
    "Handle._run": "C or Cython the event loop runs: grpc.aio's (its RPCs' coroutines, each message in and out), "
                   "asyncio's C tasks",
}


class Profiler:
    """py-spy record on some processes (name -> pid) from now until stop(), which gives each one's
    samples' file (out_dir/<name><suffix>.txt) and py-spy's count, or why there are none; py-spy on
    cpus if given. merged() ranks the functions of one or more such files."""

    def __init__(self, pids: dict[str, int], out_dir: Path, cpus: set[int] | None = None, suffix: str = "") -> None:
        self.procs: dict[str, tuple[subprocess.Popen, Path]] = {}
        self.errors: dict[str, str] = {}
        spy = shutil.which("py-spy") or str(Path(sys.executable).with_name("py-spy"))
        if not Path(spy).exists():
            self.errors = {n: "py-spy is not installed (.venv/bin/uv pip install py-spy)" for n in pids}
            return
        out_dir.mkdir(parents=True, exist_ok=True)
        for name, pid in pids.items():
            out = out_dir / f"{name.replace(' ', '-')}{suffix}.txt"
            cmd = [spy, "record", "--pid", str(pid), "--format", "raw", "--nonblocking", "--gil",
                   "--rate", str(RATE), "-o", str(out)]
            proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
            if cpus:
                os.sched_setaffinity(proc.pid, cpus)
            self.procs[name] = (proc, out)
        time.sleep(2.0)  # attached (or refused) before the first request
        for name, (proc, _) in list(self.procs.items()):
            if proc.poll() is not None:
                self.errors[name] = (f"py-spy could not attach to pid {pids[name]} (it needs ptrace: root, or "
                                     f"CAP_SYS_PTRACE, or kernel.yama.ptrace_scope 0): "
                                     f"{proc.communicate()[0].strip()[-300:]}")
                del self.procs[name]

    def stop(self) -> dict[str, dict]:
        profiles = {n: {"error": e} for n, e in self.errors.items()}
        for name, (proc, out) in self.procs.items():
            proc.send_signal(signal.SIGINT)  # py-spy writes what it has and exits
            try:
                log = proc.communicate(timeout=60)[0]
            except subprocess.TimeoutExpired:
                proc.kill()
                log = proc.communicate()[0]
            if not out.exists():
                profiles[name] = {"error": f"py-spy wrote nothing: {log.strip()[-300:]}"}
                continue
            # py-spy's own count: "Samples: N Errors: M" (a sample it could not read is an error).
            said = re.search(r"Samples: \d+ Errors: \d+", log)
            said = said.group(0) if said else ""
            profiles[name] = {"file": str(out), "py_spy": said}
        return profiles


def merged(parts: list[dict]) -> dict:
    """One profile of several stop() answers for the same process: their files' top frames, py-spy's
    counts, and the first error if every part had one."""
    ok = [p for p in parts if "file" in p]
    if not ok:
        return {"error": parts[0]["error"] if parts else "not sampled"}
    folded = "\n".join(Path(p["file"]).read_text() for p in ok)
    return {"files": [p["file"] for p in ok], "py_spy": "; ".join(p["py_spy"] for p in ok), **top_frames(folded)}


def top_frames(folded: str, n: int = TOP_FRAMES) -> dict:
    """py-spy's raw (folded) stacks -> the samples, those in WAITS, and the n functions with most
    samples of their own besides (the innermost frame of a stack: what it runs in C is its own),
    each with its share of those and its busiest line."""
    own: Counter[str] = Counter()
    lines: dict[str, Counter[str]] = {}
    waits = total = 0
    for entry in folded.splitlines():
        stack, _, count = entry.rpartition(" ")
        if not (stack and count.isdigit()):
            continue
        total += int(count)
        func, line = function_of(short_frame(stack.rsplit(";", 1)[-1]))
        if func.split(" (")[0] in WAITS:
            waits += int(count)
            continue
        own[func] += int(count)
        lines.setdefault(func, Counter())[line] += int(count)
    busy = max(1, total - waits)
    return {"samples": total, "waits": waits, "frames": [
        {"frame": f, "own": k, "pct": round(100 * k / busy, 1), "line": lines[f].most_common(1)[0][0],
         "note": C_WORK.get(f.split(" (")[0], "")}
        for f, k in own.most_common(n)]}


def function_of(frame: str) -> tuple[str, str]:
    """'fn (pkg/mod.py:12)' -> ('fn (pkg/mod.py)', '12')."""
    head, _, where = frame.rpartition(":")
    return (f"{head})", where.rstrip(")")) if head and where.rstrip(")").isdigit() else (frame, "")


def short_frame(frame: str) -> str:
    """'fn (/…/site-packages/pkg/mod.py:12)' -> 'fn (pkg/mod.py:12)'; the project's files relative."""
    head, _, where = frame.rpartition(" (")
    for marker in ("site-packages/", f"{ROOT}/", "/lib/python3."):
        if marker in where:
            where = where.split(marker, 1)[1]
            where = where.split("/", 1)[1] if marker == "/lib/python3." else where
            break
    return f"{head} ({where}" if head else frame
