"""What a process tree costs, from Linux's /proc: resident memory (RSS, and PSS, which splits the
pages processes share among them, so a tree's PSS adds up honestly) and CPU time. The serving
benchmark reads each mesh process with these: memory after the load, CPU across a run."""

from __future__ import annotations

import os

from gaas.host.placement import descendants

_TICK = os.sysconf("SC_CLK_TCK")


def tree(pid: int) -> list[int]:
    return [pid, *descendants(pid)]


def memory(pid: int) -> dict:
    """RSS and PSS of pid and its descendants, in MB (10^6 bytes), and how many processes."""
    rss = pss = 0
    pids = tree(pid)
    for p in pids:
        try:
            with open(f"/proc/{p}/smaps_rollup") as f:
                for line in f:
                    key, _, rest = line.partition(":")
                    if key == "Rss":
                        rss += int(rest.split()[0]) * 1024
                    elif key == "Pss":
                        pss += int(rest.split()[0]) * 1024
        except (OSError, ValueError):
            continue
    return {"rss_mb": round(rss / 1e6, 1), "pss_mb": round(pss / 1e6, 1), "processes": len(pids)}


def cpu_seconds(pid: int) -> float:
    """User + system CPU time of pid and its descendants so far."""
    total = 0
    for p in tree(pid):
        try:
            with open(f"/proc/{p}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
            total += int(fields[11]) + int(fields[12])  # utime, stime (fields 14, 15 of stat)
        except (OSError, ValueError, IndexError):
            continue
    return total / _TICK


def host_times() -> dict[str, list[int]]:
    """Each core's CPU time so far, from /proc/stat (user, nice, system, idle, iowait, irq, softirq,
    steal, in clock ticks); host_load() compares two of these."""
    cores = {}
    with open("/proc/stat") as f:
        for line in f:
            name, *ticks = line.split()
            if name.startswith("cpu") and name[3:].isdigit():
                cores[name] = [int(t) for t in ticks[:8]] + [0] * (8 - len(ticks[:8]))
    return cores


def host_load(before: dict[str, list[int]], after: dict[str, list[int]]) -> dict:
    """Between two host_times(): each core's share busy (user, nice, system, irq, softirq) and the share
    the hypervisor took (steal), percent. A virtual machine's steal is time its cores wanted and did not
    get: figures measured under much of it are slower than the same code on the same cores alone."""
    busy, steal = {}, {}
    stolen = ticks = 0
    for core, t1 in after.items():
        d = [b - a for a, b in zip(before.get(core, [0] * 8), t1)]
        total = max(1, sum(d))
        busy[core] = round(100 * (d[0] + d[1] + d[2] + d[5] + d[6]) / total, 1)
        steal[core] = round(100 * d[7] / total, 1)
        stolen, ticks = stolen + d[7], ticks + sum(d)
    return {"busy_pct": busy, "steal_pct": steal, "mean_steal_pct": round(100 * stolen / max(1, ticks), 1)}


def describe_host_load(load: dict) -> str:
    """One line: 'cpu0 93% busy, cpu1 88% busy; the hypervisor took 18% (steal)'."""
    cores = ", ".join(f"{core} {pct:g}% busy" for core, pct in sorted(load["busy_pct"].items()))
    return f"{cores}; the hypervisor took {load['mean_steal_pct']:g}% (steal)"
