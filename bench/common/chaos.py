"""kill -9 of a running mesh's processes, one kind after another, under streaming load, and what
each kill cost: found from the mesh itself (the state file `gaas up` keeps in its run directory),
so whatever processes it runs are the targets (each ingress Envoy it has, however many).

Targets are one process of each kind: each service (control, router, kvcache, billing, a worker's
front end), a worker's engine (vLLM's EngineCore under its front end), each Envoy sidecar kind,
every ingress Envoy, the Redis `gaas up` started, and any other child it runs. A kill is back when
`gaas up` has a new process in its place that serves (a service through its sidecar, SERVING, a
worker registered too; an Envoy ready, the ingress with a healthy router; Redis answering).
Orphans: processes the killed one had started still alive once it is back."""

from __future__ import annotations

import json
import os
import signal
import sqlite3
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable
from contextlib import closing
from dataclasses import dataclass, field
from pathlib import Path

from bench.common.loadgen import Call, Load, tally
from bench.common.output import ROOT

ENGINE = ":engine"
# The order kinds are killed in: the engine first (its worker takes longest to serve again), then
# those whose death clients could notice, so a short run reaches them; the worker's other processes
# last (not while another worker is down); kinds not named here before those.
ORDER = ("engine", "ingress", "redis", "router", "control", "billing", "kvcache", "sidecar-router",
         "sidecar-control", "sidecar-billing", "sidecar-kvcache")
LAST = ("sidecar-worker", "worker")
# How long a kill may take to be back before it counts as never.
BACK_LIMIT_S = 300.0


def eventually(what: str, check: Callable[[], object], timeout: float, every: float = 0.25):
    """check()'s first truthy value, trying every `every` seconds; TimeoutError naming what after timeout."""
    deadline = time.monotonic() + timeout
    while not (value := check()):
        if time.monotonic() > deadline:
            raise TimeoutError(f"{what}: not within {timeout:.0f} s")
        time.sleep(every)
    return value


def alive(proc: tuple[int, int | None]) -> bool:
    """Whether process (pid, start ticks) still runs: that pid, started then, and not a zombie."""
    from gaas.launcher.children import start_ticks

    pid, ticks = proc
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state != "Z" and start_ticks(pid) == ticks


def identify(pids: Iterable[int]) -> set[tuple[int, int | None]]:
    from gaas.launcher.children import start_ticks

    return {(p, start_ticks(p)) for p in pids}


class MeshView:
    """A running mesh as its run directory tells it (`gaas up`'s state file), for any starter of it."""

    def __init__(self, run_dir: Path) -> None:
        from gaas.ops import topology

        self.run_dir = Path(run_dir)
        state = self.state()
        topo = topology.load(Path(state.get("topology") or ROOT / "deploy" / "topology.yaml"), env={},
                             port_base=state["port_base"], ingress_port=state["ingress_port"],
                             workers=state["auto_workers"], ingress_path=state["ingress_path"])
        self.topo = topology.with_state_workers(topo, state["workers"])
        self.ingress = f"{state['host']}:{state['ingress_port']}"
        self.sockets = topology.sockets_root(self.run_dir)

    def state(self) -> dict:
        return json.loads((self.run_dir / "mesh.json").read_text())

    def children(self) -> dict[str, int]:
        """Each child of `gaas up` by name, its pid now."""
        return self.state()["children"]

    def ingresses(self) -> list[str]:
        return sorted(n for n in self.children() if n.startswith("ingress-"))

    def processes(self) -> set[tuple[int, int | None]]:
        """Every process of the mesh now (its children and theirs), as (pid, start ticks)."""
        from gaas.host.placement import descendants

        pids = [p for pid in self.children().values() for p in (pid, *descendants(pid))]
        return identify(pids)

    def serving(self, name: str) -> bool:
        """Whether the child called name serves: see the module's docstring."""
        from gaas.launcher.secrets import redis_answers
        from gaas.ops import probe
        from gaas.ops.topology import LocalSockets

        if name == "redis":
            return redis_answers(self.state()["redis_url"])
        if name.startswith("ingress-"):
            return probe.ingress_ready(LocalSockets.of(self.sockets, name).admin)
        if name.startswith("sidecar-"):
            return probe.envoy_ready(LocalSockets.of(self.sockets, name.removeprefix("sidecar-")).admin)
        inst = next((i for i in self.topo.instances if i.name == name), None)
        if inst is None:
            return True  # a child that serves nothing (the trace collector): running is all
        if probe.grpc_health(inst.inbound, 1.0, self.run_dir)[0] != "SERVING":
            return False
        if inst.service != "worker":
            return True
        control = self.topo.of("control")[0].inbound
        return any(w["worker_id"] == name and w["state"] == "SERVING"
                   for w in probe.list_workers(control, 1.0, self.run_dir))


@dataclass(frozen=True, slots=True)
class Target:
    """One process to kill."""

    # A child's name in the state file, or "<worker>:engine" for that worker's engine.
    name: str
    # Its kind: "router", "sidecar-router", "ingress", "redis", "engine", "worker", ...
    kind: str

    @property
    def child(self) -> str:
        """The child of `gaas up` that is back when this kill is: the worker, for its engine."""
        return self.name.removesuffix(ENGINE)

    @property
    def group(self) -> str:
        """Targets of one group are never down at once: a worker's processes (the other worker
        carries the load meanwhile), an instance and its sidecar, the ingress Envoys."""
        base = self.kind.removeprefix("sidecar-")
        return "worker" if base == "engine" else base

    @property
    def needs(self) -> tuple[str, ...]:
        """The groups this target needs to come back: a fresh router serves only once control has
        answered it (its first view of the mesh), so control is not killed while a router's kill is
        not back (a worker's bound allows for control's restart)."""
        return ("control",) if self.group == "router" else ()


def kind_of(name: str) -> str:
    if name.endswith(ENGINE):
        return "engine"
    if name.startswith("ingress-"):
        return "ingress"
    head, _, index = name.rpartition("-")
    return head if index.isdigit() else name


def targets(children: Iterable[str]) -> list[Target]:
    """One process of each kind among children (names), every ingress, and an engine: the engine of
    the last worker, the front end of the first; in ORDER, LAST at the end."""
    names = sorted(children)
    workers = [n for n in names if kind_of(n) == "worker"]
    picked: dict[str, Target] = {}
    for name in names:
        kind = kind_of(name)
        if kind == "ingress":
            picked[name] = Target(name, kind)
        elif kind not in picked:
            picked[kind] = Target(name, kind)
    if workers:
        picked["engine"] = Target(workers[-1] + ENGINE, "engine")

    def rank(t: Target) -> int:
        if t.kind in LAST:
            return len(ORDER) + 1 + LAST.index(t.kind)
        return ORDER.index(t.kind) if t.kind in ORDER else len(ORDER)

    return sorted(picked.values(), key=rank)


@dataclass(slots=True)
class Kill:
    """One kill -9 and how the mesh took it."""

    target: Target
    pid: int
    # When (time.monotonic()); when a new process ran in its place, and when that one served
    # (None: not yet, or never within BACK_LIMIT_S).
    at: float
    restarted: float | None = None
    back: float | None = None
    # Processes the killed one had started that outlived it (counted once it is back).
    orphans: int = 0
    _done: threading.Event = field(default_factory=threading.Event)

    def pending(self) -> bool:
        return not self._done.is_set()

    def wait(self, timeout: float) -> None:
        self._done.wait(timeout)


def engine_core(pid: int) -> int:
    """The pid of vLLM's engine core under a worker's process."""
    from gaas.host.placement import descendants

    for p in descendants(pid):
        try:
            if b"EngineCore" in Path(f"/proc/{p}/cmdline").read_bytes():
                return p
        except OSError:
            pass
    raise RuntimeError(f"no engine core under pid {pid}")


def kill(view: MeshView, target: Target) -> Kill:
    """kill -9 of target, then a thread that watches for it to be back (Kill.pending until then)."""
    from gaas.host.placement import descendants

    old = view.children()[target.child]
    victim = engine_core(old) if target.kind == "engine" else old
    # What must be gone once it is back: what the killed process started; of an engine, its worker
    # too (it exits when its engine dies) and all the worker had started.
    owned = identify([*descendants(old), old]) - identify([victim])
    os.kill(victim, signal.SIGKILL)
    k = Kill(target, victim, time.monotonic())

    def watch() -> None:
        deadline = k.at + BACK_LIMIT_S
        while time.monotonic() < deadline:
            pid = view.children().get(target.child)
            if pid and pid != old and alive(identify([pid]).pop()):
                k.restarted = k.restarted or time.monotonic()
                try:
                    up = view.serving(target.child)
                except Exception:  # noqa: BLE001 - an instance still starting answers oddly
                    up = False
                if up:
                    k.back = time.monotonic()
                    break
            time.sleep(0.2)
        k.orphans = sum(1 for p in owned if alive(p))
        k._done.set()

    threading.Thread(target=watch, name=f"watch-{target.name}", daemon=True).start()
    return k


def soak(view: MeshView, plan: list[Target], every: float, settle: float, until: float | None,
         say: Callable[[str], None]) -> list[Kill]:
    """Kill plan's targets in turn, one every `every` seconds and settle seconds after the last
    kill came back (if it has): once each when until is None, else round and round until
    time.monotonic() passes until. A target waits while a kill of its group, or of a group that
    needs it (Target.needs), is not back (or its process is not serving); the others go first. Returns once every kill is back (or never will be)."""
    kills: list[Kill] = []
    queue = deque(plan)
    next_at = time.monotonic()
    while queue and (until is None or time.monotonic() < until):
        if time.monotonic() > (kills[-1].at if kills else next_at) + BACK_LIMIT_S:
            say(f"gave up: none of {', '.join(t.name for t in queue)} was ready to kill for {BACK_LIMIT_S:.0f} s")
            break
        last = kills[-1] if kills else None
        if last is not None and last.back is not None:
            next_at = max(next_at, last.back + settle)
        if time.monotonic() < next_at:
            time.sleep(min(0.2, next_at - time.monotonic()))
            continue
        busy = {g for k in kills if k.pending() for g in (k.target.group, *k.target.needs)}
        ready = next((t for t in queue if t.group not in busy and _serving(view, t.child)), None)
        if ready is None:
            time.sleep(0.5)
            continue
        queue.remove(ready)
        if until is not None:
            queue.append(ready)
        k = kill(view, ready)
        say(f"killed {ready.name} (pid {k.pid})")
        kills.append(k)
        next_at = k.at + every
    for k in kills:
        k.wait(max(0.0, k.at + BACK_LIMIT_S + 5 - time.monotonic()))
    return kills


def _serving(view: MeshView, name: str) -> bool:
    try:
        return view.serving(name)
    except Exception:  # noqa: BLE001 - not serving, whatever it said
        return False


def ledger(run_dir: Path, tenant: str) -> dict[str, tuple[int, int, int, int]]:
    """The usage ledger's rows of tenant by the id its client gave (x-request-id): (rows, prompt,
    cached, completion tokens) each, read from billing's SQLite database in the run directory."""
    db = Path(run_dir) / "billing.db"
    with closing(sqlite3.connect(f"file:{db}?mode=ro", uri=True, timeout=10)) as con:
        rows = con.execute("SELECT client_request_id, COUNT(*), SUM(prompt_tokens), SUM(cached_tokens), "
                           "SUM(completion_tokens) FROM usage_ledger WHERE tenant = ? GROUP BY client_request_id",
                           (tenant,)).fetchall()
    return {r[0]: (int(r[1]), int(r[2]), int(r[3]), int(r[4])) for r in rows}


def lost(call: Call, billed: tuple[int, int, int, int] | None) -> int:
    """Tokens the client was given that the ledger does not bill: of a whole stream its prompt and
    completion tokens (by its usage chunk), of a cut one the completion tokens it received."""
    _, prompt, _, completion = billed or (0, 0, 0, 0)
    if call.usage is not None:
        return max(0, call.usage[0] - prompt) + max(0, call.usage[2] - completion)
    return max(0, call.tokens - completion)


def settled_ledger(run_dir: Path, tenant: str, calls: list[Call], timeout: float) -> dict:
    """The ledger once every call that received tokens is in it (or after timeout: what is there)."""
    want = [c for c in calls if c.tokens or c.usage]

    def complete() -> dict | None:
        rows = ledger(run_dir, tenant)
        return rows if all(lost(c, rows.get(c.id)) == 0 for c in want) else None

    try:
        return eventually("every call billed", complete, timeout, every=1.0)
    except TimeoutError:
        return ledger(run_dir, tenant)


def report(kills: list[Kill], load: Load, rows: dict) -> tuple[list[dict], dict]:
    """Per kill (the calls that ended between it and the next kill) and in total: the calls' tally,
    usage lost (tokens) and unbilled calls, the seconds until the killed process was back, orphans."""
    calls = sorted(load.calls, key=lambda c: c.end)
    bounds = [k.at for k in kills[1:]] + [float("inf")]
    out = []
    for k, end in zip(kills, bounds):
        window = [c for c in calls if k.at <= c.end < end]
        out.append({
            "target": k.target.name, "kind": k.target.kind, **_cost(window, rows),
            "restarted_s": round(k.restarted - k.at, 1) if k.restarted else None,
            "back_s": round(k.back - k.at, 1) if k.back else None,
            "orphans": k.orphans,
        })
    return out, _cost(calls, rows)


def _cost(calls: list[Call], rows: dict) -> dict:
    return {**tally(calls), "usage_lost_tokens": sum(lost(c, rows.get(c.id)) for c in calls),
            "unbilled": sum(1 for c in calls if (c.tokens or c.usage) and c.id not in rows)}


def stop_story(run_dir: Path, child: str, lines: int = 12) -> str:
    """The last lines of child's log that tell how it stopped and started again (its shutdown's
    steps and what each took, `gaas up`'s restart): what a kill that came back late is read by."""
    log = Path(run_dir) / "logs" / f"{child}.log"
    try:
        text = log.read_text(errors="replace").splitlines()
    except OSError as exc:
        return f"(no log of {child}: {exc})"
    marks = ("shutting down", "stopped in", " took ", "restart ", "engine up in", "health: SERVING")
    return "\n".join([line[:300] for line in text if any(m in line for m in marks)][-lines:])
