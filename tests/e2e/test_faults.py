"""Faults inside the mesh, through the real `gaas up`: a worker's engine never outlives it (kill -9
of the worker's own process, not its group), a worker whose engine dies leaves the registry and
is restarted, streams survive their worker (killed, or stopping: another worker carries them on,
their text what an undisturbed run gives, each billed once), and with control paused known keys
are still served.
Each ends with worker-1 serving again, for the destructive tests after it."""

from __future__ import annotations

import itertools
import os
import signal
import threading
import time
import urllib.request
from pathlib import Path
from collections.abc import Callable
from types import SimpleNamespace

import pytest

from gaas.metering import admission
from gaas.ops import pki
from gaas.host.placement import descendants
from gaas.v1 import control_pb2, control_pb2_grpc
from tests.conftest import INGRESS_PATH, on_direct_path, process_alive
from tests.meshutil import ROOT, gaas, generate
from tests.waiting import eventually
from tests.e2e.support import (MODEL, Load, Received, children, client, instance, ledger_totals, needs_own_mesh,
                               new_tenant, wait_for_ledger, wait_restarted, wait_serving)

pytestmark = [pytest.mark.mesh, pytest.mark.destructive]
WORKER = "worker-1"
# A worker loads its engine in ~10-20 s on a CPU; more while the other worker is busy.
START_SECONDS = 180


def process_name(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")[0].decode(errors="replace")
    except OSError:
        return ""


def engine_counts(mesh, worker: str) -> tuple[int, float]:
    """(requests WORKER's engine runs now, tokens it has generated), by vLLM's own gauge and counter
    on the worker's metrics port, updated each engine step (a load report to control can be half a
    second old: longer than a stream here)."""
    from gaas.ops import topology
    from tests.conftest import MESH_WORKERS

    topo = topology.load(ROOT / "deploy" / "topology.yaml", env={}, port_base=mesh.port_base,
                         ingress_port=int(mesh.ingress.rsplit(":", 1)[1]), workers=MESH_WORKERS)
    w = topo.instance(worker)
    body = urllib.request.urlopen(f"http://{w.host}:{w.metrics_port}/metrics", timeout=5).read().decode()

    def total(name: str) -> float:
        return sum(float(line.rsplit(" ", 1)[1]) for line in body.splitlines() if line.startswith(name + "{"))

    return int(total("vllm:num_requests_running")), total("vllm:generation_tokens_total")


def cut_mid_stream(mesh, c, prompts: list[str], kill: Callable[[], None], received: Received,
                   tries: int = 5) -> "Streams":
    """The streams started, and kill() done while WORKER runs streams of them that have all sent
    their first tokens (so each is cut mid-way: one cut before its first token is another case,
    the retry before any answer). A greedy stream of the tiny model lasts about a second, and one
    may wait in the router's queue while others run, so the moment is read from vLLM's own gauge
    and counter on the worker's metrics port (updated each engine step; a load report to control
    can be half a second old); when WORKER's streams were over before every stream had its first
    token, the streams run again (their usage counted in received), up to tries times."""
    for _ in range(tries):
        generated = engine_counts(mesh, WORKER)[1]
        streams = Streams(c, prompts)
        streams.wait_started(chunks=1)
        running, now = engine_counts(mesh, WORKER)
        if running >= 1 and now - generated >= 8:
            kill()
            return streams
        streams.join()
        assert streams.errors == [], streams.errors[:3]
        for u in streams.usage:
            received.add(u)
    pytest.fail(f"in {tries} runs no stream was still running on {WORKER} once every stream had its first token; "
                f"the router placed them: {placed(mesh)}")


def placed(mesh) -> dict[str, int]:
    """How many requests the router logs as served by each worker (moved ones apart)."""
    counts: dict[str, int] = {}
    log = mesh.run_dir / "logs" / "router-0.log"
    for line in (log.read_text().splitlines() if log.exists() else []):
        if '"served for ' in line:
            by = line.split(" by ", 1)[1].split(":", 1)[0]
            counts[by] = counts.get(by, 0) + 1
    return counts


def registered(mesh) -> list[str]:
    with pki.operator_channel(instance(mesh, "control-0")) as ch:
        workers = control_pb2_grpc.ControlStub(ch).ListWorkers(control_pb2.ListWorkersRequest(), timeout=2).workers
    return [w.worker_id for w in workers]


def wait_worker_back(mesh, old_pid: int) -> None:
    """WORKER restarted by gaas up, serving (the new process, not a lease the old one left),
    registered, and chosen by the router again."""
    wait_restarted(mesh, WORKER, old_pid, timeout=30)
    wait_serving(mesh, WORKER, timeout=START_SECONDS)
    eventually(lambda: WORKER in registered(mesh), 30, every=0.5, what=f"{WORKER}, serving, registered")
    prompt_on_worker(mesh)


def prompt_on_worker(mesh, label: str = "Faults test", key: str | None = None, received: Received | None = None) -> str:
    """A prompt the router sends to WORKER (prefixes are routed where they are cached, each
    tenant's apart: key, the tenant's whose requests follow; the demo tenant's if None). received:
    where the tries' usage is counted (each is billed to that tenant)."""
    md = None if key is None else (("authorization", f"Bearer {key}"),)
    tries = itertools.count()

    def landed() -> str | None:
        prompt = f"{label} {next(tries)} {time.monotonic_ns()}: " + "tell me about rivers and the sea. " * 10
        last = generate(mesh, md, prompt=prompt, max_tokens=1)[-1]
        if received is not None:
            u = last.usage
            received.add(SimpleNamespace(prompt_tokens=u.prompt_tokens, completion_tokens=u.completion_tokens,
                                         prompt_tokens_details=SimpleNamespace(cached_tokens=u.cached_tokens)))
        return prompt if last.worker_id == WORKER else None

    return eventually(landed, 60, every=0, what=f"a prompt landing on {WORKER}")


def ready_worker(mesh) -> int:
    needs_own_mesh(mesh)
    pid = children(mesh)[WORKER]
    if not process_alive(pid) or WORKER not in registered(mesh):
        wait_worker_back(mesh, -1)
        pid = children(mesh)[WORKER]
    prompt_on_worker(mesh)  # the router places on it again, not only its process is up
    return pid


# Greedy streams long enough to be running when their worker goes.
STREAM_TOKENS = 256
# The front end's kill waits for the streams' progress to be written first (0.6 s): longer streams.
FRONT_END_TOKENS = 1536
GREEDY = dict(model=MODEL, max_tokens=STREAM_TOKENS, temperature=0, stream=True,
              stream_options={"include_usage": True}, extra_body={"ignore_eos": True})


class Streams:
    """Greedy completion streams run at once, each in its thread: the text and usage each client
    got, and the errors any got; started tells when every stream has had its first tokens."""

    def __init__(self, c, prompts: list[str], max_tokens: int = STREAM_TOKENS) -> None:
        self.max_tokens = max_tokens
        self.texts: list[str] = [""] * len(prompts)
        self.usage: list = [None] * len(prompts)
        self.errors: list[str] = []
        self.chunks = [0] * len(prompts)
        self._threads = [threading.Thread(target=self._run, args=(c, i, p), daemon=True) for i, p in enumerate(prompts)]
        for t in self._threads:
            t.start()

    def _run(self, c, i: int, prompt: str) -> None:
        try:
            for chunk in c.completions.create(prompt=prompt, **{**GREEDY, "max_tokens": self.max_tokens}):
                if chunk.choices:
                    self.texts[i] += chunk.choices[0].text
                    self.chunks[i] += 1
                if chunk.usage is not None:
                    self.usage[i] = chunk.usage
        except Exception as exc:  # noqa: BLE001 - what the client got, for the assertion
            self.errors.append(f"stream {i}: {type(exc).__name__}: {exc}")

    def wait_started(self, chunks: int = 4, timeout: float = 60.0) -> None:
        eventually(lambda: min(self.chunks) >= chunks or self.errors, timeout, every=0.02,
                   what=lambda: f"the streams started (chunks so far: {self.chunks})")

    def join(self, timeout: float = 300.0) -> "Streams":
        for t in self._threads:
            t.join(timeout)
        return self


def undisturbed(c, prompts: list[str], received: Received) -> list[str]:
    streams = Streams(c, prompts).join()
    assert streams.errors == [], streams.errors
    for u in streams.usage:
        received.add(u)
    return streams.texts


# What each process in a stream logs when it carries the stream on at another worker: the router
# on its own path, the worker's front end on the direct path.
MOVED = {"router-0": "another worker carries it on", WORKER: "carries the stream on"}


def moves_logged(mesh) -> int:
    logs = mesh.run_dir / "logs"
    return sum((logs / f"{name}.log").read_text().count(line) for name, line in MOVED.items()
               if (logs / f"{name}.log").exists())


def engine_core(pid: int) -> int:
    core = [p for p in descendants(pid) if "EngineCore" in process_name(p)]
    assert core, [process_name(p) for p in descendants(pid)]
    return core[0]


# Killed mid-stream: through the router, the worker's whole process (the router, outside it, carries
# its streams on); on the direct path, the worker's engine (its front end, which the ingress streams
# from, carries them on; its own death is test_kill_9_of_a_worker_front_end_cuts_its_streams_and_bills_them).
KILLED = "the worker's process" if INGRESS_PATH == "router" else "the worker's engine"


def test_kill_9_of_a_worker_serving_streams_leaves_every_stream_whole(mesh):
    """16 greedy streams on two workers, one worker killed (SIGKILL: on the router path its
    process, on the direct path its engine) while they run: the other carries its streams on from
    the tokens sent. No client sees an error; each text equals an undisturbed run's; each is billed
    once, for its prompt and the tokens it received."""
    pid = ready_worker(mesh)
    tenant, key = new_tenant(mesh)
    c = client(mesh, key)
    received = Received()
    # Half of them where the router sends WORKER's prefixes (so some are surely on it), half anywhere.
    prompts = ([prompt_on_worker(mesh, f"Move test {i}", key, received) for i in range(8)]
               + [f"Move test {i} {time.monotonic_ns()}: the river runs down to the sea and " * 3 for i in range(8, 16)])
    expected = undisturbed(c, prompts, received)
    moves = moves_logged(mesh)
    victim = pid if INGRESS_PATH == "router" else engine_core(pid)
    streams = cut_mid_stream(mesh, c, prompts, lambda: os.kill(victim, signal.SIGKILL), received)
    streams.join()
    assert streams.errors == [], streams.errors[:3]
    assert moves_logged(mesh) > moves, f"no stream was on the killed worker ({KILLED}); placed: {placed(mesh)}"
    for i, (got, want) in enumerate(zip(streams.texts, expected)):
        assert got == want, f"stream {i}: its text differs from an undisturbed run's"
    for u in streams.usage:
        assert u.completion_tokens == STREAM_TOKENS
        received.add(u)
    wait_for_ledger(mesh, tenant, received.as_tuple())
    wait_worker_back(mesh, pid)


@on_direct_path("only there is the worker's front end the one process in the stream besides the Envoys")
def test_kill_9_of_a_worker_front_end_cuts_its_streams_and_bills_what_each_got(mesh):
    """What the direct path cannot carry on: the worker's own process (the front end the ingress
    streams from) killed. Its streams end with an error the client sees (never a silent short
    answer); each is billed once all the same, by the router that admitted it, for what the
    worker's last progress says it was sent (gaas.metering.admission); the other worker's streams
    finish whole."""
    pid = ready_worker(mesh)
    tenant, key = new_tenant(mesh)
    c = client(mesh, key)
    # Half of them on WORKER, and long enough to be running when it goes: the tiny model streams a
    # few hundred tokens in under a second.
    tries = Received()  # the requests that found prompts for WORKER, billed to the tenant too
    prompts = ([prompt_on_worker(mesh, f"Front end test {i}", key, tries) for i in range(4)]
               + [f"Front end test {i} {time.monotonic_ns()}: the river runs down to the sea and " * 3
                  for i in range(4, 8)])
    for _ in range(5):
        streams = Streams(c, prompts, max_tokens=FRONT_END_TOKENS)
        streams.wait_started()
        # What the worker's progress says each was sent (written every PROGRESS_SECONDS; a stream's last
        # tokens before its worker's death go unbilled within that): its first tokens at least.
        time.sleep(2 * admission.PROGRESS_SECONDS + 0.1)
        if engine_counts(mesh, WORKER)[0] >= 1:  # streams run there (else: the router put none there, again)
            break
        streams.join()
        assert streams.errors == [], streams.errors[:3]
        for u in streams.usage:
            tries.add(u)
    else:
        pytest.fail(f"in 5 runs no stream ran on {WORKER}; the router placed them: {placed(mesh)}")
    os.kill(pid, signal.SIGKILL)
    streams.join()
    cut = len(streams.errors)
    assert cut >= 1, "no stream was on the killed worker"
    whole = [u for u in streams.usage if u is not None]
    assert len(whole) + cut == len(prompts) and all(u.completion_tokens == FRONT_END_TOKENS for u in whole)
    seen: list = []

    def all_billed() -> bool:
        requests, _, _, completion = ledger_totals(mesh, tenant)
        seen[:] = [requests - tries.requests, completion - tries.completion]
        return seen[0] == len(prompts)

    eventually(all_billed, 60, every=0.25, what=lambda: f"{len(prompts)} requests in the ledger (it has {seen[0]})")
    completion = seen[1]
    # The cut streams' share: something each, less than whole (their progress, written every 0.25 s).
    assert FRONT_END_TOKENS * len(whole) + cut <= completion < FRONT_END_TOKENS * len(prompts)
    wait_worker_back(mesh, pid)


def test_sigterm_on_a_worker_hands_its_streams_over_and_they_finish_whole(mesh):
    """A stopping worker (a rolling restart's drain) hands its streams over after
    GAAS_HANDOVER_SECONDS, and each finishes at the other worker (carried on by the router on its
    path, by the stopping worker's front end on the direct path), equal to an undisturbed run, and
    the engine stops with its worker."""
    pid = ready_worker(mesh)
    tenant, key = new_tenant(mesh)
    c = client(mesh, key)
    received = Received()
    prompts = [prompt_on_worker(mesh, key=key, received=received) for _ in range(2)]
    expected = undisturbed(c, prompts, received)
    streams = Streams(c, prompts)
    streams.wait_started()
    engine = descendants(pid)
    os.kill(pid, signal.SIGTERM)
    streams.join()
    assert streams.errors == [], streams.errors
    assert streams.texts == expected
    assert all(u.completion_tokens == STREAM_TOKENS for u in streams.usage)
    for u in streams.usage:
        received.add(u)
    eventually(lambda: not any(process_alive(p) for p in engine), 60, every=0.5,
               what="the engine gone with its worker's shutdown")
    wait_for_ledger(mesh, tenant, received.as_tuple())
    wait_worker_back(mesh, pid)


@on_direct_path("a worker's process tree is the launcher's and vLLM's, whichever path serves")
def test_kill_9_of_a_worker_takes_its_engine_processes_with_it(mesh):
    pid = ready_worker(mesh)
    engine = descendants(pid)
    assert any("VLLM" in process_name(p) or "python" in process_name(p) for p in engine), engine
    os.kill(pid, signal.SIGKILL)  # the worker's process alone, not its group
    eventually(lambda: not any(process_alive(p) for p in engine), 15, every=0.25,
               what=lambda: f"the engine's processes gone with their worker ({[p for p in engine if process_alive(p)]} "
                            "are alive)")
    # Meanwhile the other worker serves.
    assert generate(mesh, prompt="anyone there?", max_tokens=2)[-1].worker_id == "worker-0"
    wait_worker_back(mesh, pid)


@on_direct_path("the registry and the restart are control's and the launcher's, whichever path serves")
def test_a_worker_whose_engine_dies_leaves_the_registry_and_is_restarted(mesh):
    pid = ready_worker(mesh)
    os.kill(engine_core(pid), signal.SIGKILL)
    eventually(lambda: not process_alive(pid), 20, every=0.25, what="the worker gone with its engine")
    log = (mesh.run_dir / "logs" / f"{WORKER}.log").read_text()
    assert "the engine died" in log
    wait_worker_back(mesh, pid)
    assert f"{WORKER} exited with code 3" in mesh.output.read_text()


def test_a_rolling_restart_of_the_workers_under_load_fails_nothing(mesh):
    """`gaas restart worker`: each worker drains (its streams finish) while the other serves, and
    is back, registered and seen by the router, before the next leaves."""
    ready_worker(mesh)
    _, key = new_tenant(mesh)
    before = children(mesh)
    with Load(mesh, key) as load:
        r = gaas(mesh, "restart", "worker", timeout=2 * START_SECONDS + 60)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "worker-0 serves again" in r.stdout and "worker-1 serves again" in r.stdout
    after = children(mesh)
    assert after["worker-0"] != before["worker-0"] and after["worker-1"] != before["worker-1"]
    assert load.errors == [], load.errors[:5]
    assert load.received.requests > 10


def test_with_control_stopped_past_the_workers_leases_known_keys_are_served_and_unknown_ones_refused(mesh):
    needs_own_mesh(mesh)
    _, key = new_tenant(mesh)
    _, unused_key = new_tenant(mesh)
    client(mesh, key).completions.create(model=MODEL, prompt="verify me", max_tokens=2)
    control = children(mesh)["control-0"]
    with Load(mesh, key) as load:
        os.kill(control, signal.SIGSTOP)  # alive but answering nothing
        try:
            time.sleep(20)  # twice a worker's lease (10 s; renewed every 0.5 s)
            with pytest.raises(Exception) as refused:
                client(mesh, unused_key).completions.create(model=MODEL, prompt="who am I", max_tokens=2)
        finally:
            os.kill(control, signal.SIGCONT)
        time.sleep(3)  # and on, as control catches up
    assert load.errors == [] and load.received.requests > 5
    assert getattr(refused.value, "status_code", None) == 503, refused.value
    log = (mesh.run_dir / "logs" / "router-0.log").read_text()
    assert "accepting keys verified in the last 60 s" in log
    # The leases ran out while control was stopped; they were extended when it answered again, and
    # every worker renewed its own.
    assert sorted(registered(mesh)) == ["worker-0", "worker-1"]
    assert "extended 2 worker lease(s)" in (mesh.run_dir / "logs" / "control-0.log").read_text()
    # Left as found: the router sends requests to both workers again (each sidecar health-checks
    # control back in, each worker's load report is fresh) before the next test starts.
    prompt_on_worker(mesh)
