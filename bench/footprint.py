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


def _own_cpu(pid: int) -> float:
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / _TICK  # utime, stime (fields 14, 15 of stat)
    except (OSError, ValueError, IndexError):
        return 0.0


def cpu_seconds(pid: int) -> float:
    """User + system CPU time of pid and its descendants so far."""
    return sum(_own_cpu(p) for p in tree(pid))


def cpu_parts(pid: int) -> tuple[float, float]:
    """(CPU seconds of pid itself, of its descendants) so far: a worker's or vLLM's API server's
    front end (the process that serves the API: protocol, tokens to text, formatting) apart from
    its engine (the engine core and model runner processes it started)."""
    own = _own_cpu(pid)
    return own, sum(_own_cpu(p) for p in descendants(pid))


IDLE_SECONDS = 5.0


def idle_rates(pids: dict[str, int], seconds: float = IDLE_SECONDS) -> dict[str, tuple[float, float]]:
    """Each process's CPU seconds per second with no request running (cpu_parts' two halves):
    what its background work (leases, registry refreshes, health checks, metrics) costs, which
    front_cost() takes out of a run's figures."""
    import time

    before, start = {n: cpu_parts(pid) for n, pid in pids.items()}, time.perf_counter()
    time.sleep(seconds)
    wall = time.perf_counter() - start
    return {n: ((own - before[n][0]) / wall, (kids - before[n][1]) / wall)
            for n, (own, kids) in ((n, cpu_parts(pid)) for n, pid in pids.items())}


def front_cost(before: dict[str, tuple[float, float]], after: dict[str, tuple[float, float]],
               engines: set[str], output_tokens: int, requests: int,
               idle: dict[str, tuple[float, float]] | None = None, wall_s: float = 0.0) -> dict:
    """What a server's processes spent on a run, the engine apart: before/after, name ->
    cpu_parts(); engines: the names whose descendants are an engine (a worker, vLLM's server).
    idle (idle_rates()) times wall_s is taken out of each process's figure: what it would have
    spent with no request. The front end's CPU per output token and per request, each process's
    seconds, the engine's, and the background's share of a core."""
    idle = idle or {}
    front: dict[str, float] = {}
    engine = 0.0
    for name, (own, kids) in after.items():
        own0, kids0 = before.get(name, (0.0, 0.0))
        idle_own, idle_kids = idle.get(name, (0.0, 0.0))
        spent_own = max(0.0, own - own0 - idle_own * wall_s)
        spent_kids = max(0.0, kids - kids0 - idle_kids * wall_s)
        if name in engines:
            front[name] = spent_own
            engine += spent_kids
        else:
            front[name] = spent_own + spent_kids
    total = sum(front.values())
    background = sum(i[0] + (0.0 if n in engines else i[1]) for n, i in idle.items())
    return {
        "output_tokens": output_tokens, "requests": requests, "wall_s": round(wall_s, 3),
        "front_cpu_s": round(total, 3), "engine_cpu_s": round(engine, 3),
        "us_per_token": round(total / output_tokens * 1e6, 1) if output_tokens else None,
        "us_per_request": round(total / requests * 1e6) if requests else None,
        "idle_core_pct": round(background * 100, 1),
        "seconds": {k: round(v, 3) for k, v in sorted(front.items(), key=lambda kv: -kv[1])},
    }


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
