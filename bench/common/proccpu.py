"""The CPU time a process spends between two readings, to the nanosecond where Linux allows.

/proc/<pid>/stat's utime + stime (bench.footprint) counts every thread the process ever had but in
clock ticks (10 ms), too coarse for a service that spends a few hundred microseconds a request
over a run of tens of requests. Each live thread's /proc/<pid>/task/<tid>/schedstat holds its run
time in nanoseconds, but a thread that ended takes its time with it. So a reading keeps both, and
spent() takes the precise sum unless the ticks show more (a thread ended between the readings),
then the ticks.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from gaas.host.placement import descendants

_TICK = os.sysconf("SC_CLK_TCK")
# How far the ticks may run ahead of the threads' sum before an ended thread is assumed: the two
# conversions to ticks (utime, stime) each drop up to one.
_SLACK_S = 3 / _TICK


@dataclass(slots=True, frozen=True)
class Reading:
    """One process's (or a sum of processes') CPU time so far, in seconds."""

    ticks: float  # utime + stime from stat: every thread, ended ones included, in clock ticks
    threads: float  # the live threads' run time from schedstat, to the nanosecond

    def __add__(self, other: Reading) -> Reading:
        return Reading(self.ticks + other.ticks, self.threads + other.threads)


NOTHING = Reading(0.0, 0.0)


def read(pid: int) -> Reading:
    """pid's CPU time so far (NOTHING if it is gone)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        ticks = (int(fields[11]) + int(fields[12])) / _TICK
        tids = os.listdir(f"/proc/{pid}/task")
    except (OSError, ValueError, IndexError):
        return NOTHING
    ns = 0
    for tid in tids:
        try:
            with open(f"/proc/{pid}/task/{tid}/schedstat") as f:
                ns += int(f.read().split()[0])
        except (OSError, ValueError, IndexError):
            continue
    return Reading(ticks, ns / 1e9)


def read_parts(pid: int) -> tuple[Reading, Reading]:
    """(pid's own reading, the sum of its descendants'): a server's front end apart from its engine."""
    kids = NOTHING
    for p in descendants(pid):
        kids = kids + read(p)
    return read(pid), kids


def spent(before: Reading, after: Reading) -> float:
    """CPU seconds between two readings: the threads' precise sum, or the ticks where they show
    that a thread ended meanwhile (its time gone from the sum)."""
    precise = after.threads - before.threads
    ticks = after.ticks - before.ticks
    return max(0.0, ticks if ticks > precise + _SLACK_S else precise)


def thread_times(pid: int) -> dict[int, tuple[str, int]]:
    """Each live thread of pid: tid -> (its name, its run time so far in ns)."""
    out = {}
    try:
        tids = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return out
    for tid in tids:
        try:
            with open(f"/proc/{pid}/task/{tid}/comm") as f:
                name = f.read().strip()
            with open(f"/proc/{pid}/task/{tid}/schedstat") as f:
                out[int(tid)] = (name, int(f.read().split()[0]))
        except (OSError, ValueError, IndexError):
            continue
    return out


def by_thread(pid: int, before: dict[int, tuple[str, int]], after: dict[int, tuple[str, int]]) -> dict[str, float]:
    """CPU seconds between two thread_times() of pid, summed by thread name, the first thread's as
    "main" (a Python service's event loop); threads that ended meanwhile are not counted."""
    out: dict[str, float] = {}
    for tid, (name, ns) in after.items():
        label = "main" if tid == pid else name
        out[label] = out.get(label, 0.0) + (ns - before.get(tid, (name, 0))[1]) / 1e9
    return dict(sorted(out.items(), key=lambda kv: -kv[1]))
