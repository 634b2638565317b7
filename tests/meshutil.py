"""Helpers for tests that talk to the shared mesh (see the mesh fixture in conftest.py)."""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import time
import urllib.error
import urllib.request

import grpc

from gaas.v1 import inference_pb2, inference_pb2_grpc
from tests.conftest import ROOT
from tests.waiting import eventually


def gaas(mesh, *args, timeout=60):
    return subprocess.run(
        [sys.executable, "-m", "gaas.cli.main", *args], cwd=ROOT, capture_output=True, text=True, timeout=timeout,
        env={**os.environ, "GAAS_HOME": str(mesh.run_dir)},
    )


def generate(mesh, metadata=None, **req):
    with grpc.insecure_channel(mesh.ingress) as ch:
        stub = inference_pb2_grpc.InferenceStub(ch)
        md = mesh.auth if metadata is None else metadata
        return list(stub.Generate(inference_pb2.GenerateRequest(**req), timeout=60, metadata=md))


def http(mesh, path, body: bytes | None = None, method="POST", key: str | None = None, headers=()):
    req = urllib.request.Request(f"http://{mesh.ingress}{path}", data=body, method=method)
    req.add_header("content-type", "application/json")
    if key != "":
        req.add_header("authorization", f"Bearer {key or mesh.api_key}")
    for name, value in headers:
        req.add_header(name, value)
    try:
        with urllib.request.urlopen(req, timeout=60) as resp:
            return resp.status, resp.read().decode()
    except urllib.error.HTTPError as err:
        return err.code, err.read().decode()


def wait_workers_idle(mesh, timeout: float = 30.0) -> None:
    """Until every worker reports nothing running or waiting (what earlier tests left streaming has
    ended), so that a test of where requests go starts from equal workers."""
    from gaas.ops import probe

    control = next(i["address"] for i in mesh.ready["instances"] if i["name"] == "control-0")
    workers: list = []

    def idle() -> bool:
        workers[:] = probe.list_workers(control, run_dir=mesh.run_dir)
        return bool(workers) and all(w["load"]["running"] + w["load"]["waiting"] == 0 for w in workers)

    eventually(idle, timeout, every=0.3, what=lambda: f"every worker idle (they report {workers})")
    # The routers read the workers' reports every 0.5 s: a duration, not a fact a test can see.
    time.sleep(1.2)


def worker_addresses(mesh) -> dict[str, str]:
    return {w["worker_id"]: w["address"] for w in mesh.ready["workers"]}


def wait_for_lines(path, *needles, timeout=10.0) -> str:
    """The file's text once it holds a line containing all needles (Envoy flushes logs every second)."""
    def text() -> str:
        return path.read_text() if path.exists() else ""

    def holding() -> str:
        t = text()
        return t if any(all(n in line for n in needles) for line in t.splitlines()) else ""

    return eventually(holding, timeout, what=lambda: f"a line with {needles} in {path}; it holds:\n{text()[-2000:]}")


def start_mesh(run_dir, base: int, *args: str, timeout: float = 420, env: dict | None = None):
    """`gaas up` from run_dir at port base `base` (its ingress at base + 190, its own Redis at
    base + 191), as a user runs it; the RunningMesh once it says it is ready, else pytest.fail
    with the end of its output. args: more of gaas up's options; env: more of its environment."""
    import pytest

    from tests.conftest import RunningMesh

    output = run_dir / "gaas-up.out"
    cmd = [sys.executable, "-m", "gaas.cli.main", "up", "--run-dir", str(run_dir), "--port-base", str(base),
           "--ingress-port", str(base + 190), "--redis-url", f"redis://127.0.0.1:{base + 191}/0",
           "--timeout", str(timeout), "--json", *args]
    with open(output, "a") as out:
        proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=out, text=True, start_new_session=True,
                                env={**{k: v for k, v in os.environ.items() if k != "GAAS_HOME"}, **(env or {})})
    line = proc.stdout.readline()
    if not line:
        proc.wait(timeout=60)
        pytest.fail(f"gaas up {' '.join(args)} failed (exit {proc.returncode}):\n{output.read_text()[-4000:]}")
    ready = json.loads(line)
    children = json.loads((run_dir / "mesh.json").read_text())["children"]
    key = open(ready["demo_key_file"]).read().strip()
    return RunningMesh(proc, run_dir, f"127.0.0.1:{base + 190}", base, ready, children, output, key)


@contextlib.contextmanager
def own_mesh(run_dir, *, port_start: int, workers: int, ingress_path: str, args: tuple[str, ...] = ()):
    """A mesh of a test module's own beside the session's, started by `gaas up` as a user would
    (its own ports, Redis and run directory; GAAS_HOME left to the session's mesh). port_start:
    below the kernel's ephemeral ports (32768 and up here), or a client's connection may take a
    port the mesh is about to listen on. args: more of gaas up's options."""
    from gaas.launcher.rundir import free_port_base

    m = start_mesh(run_dir, free_port_base(span=200, start=port_start), "--workers", str(workers),
                   "--ingress-path", ingress_path, *args)
    try:
        yield m
    finally:
        if m.proc.poll() is None:
            m.stop()


def refused_on_headers(mesh, path: str, key: str = "", body_bytes: int = 512 << 10, timeout: float = 5.0):
    """Send a request's headers announcing a body of body_bytes, and no byte of the body: the
    (status line, body) the ingress answers with before the body arrives (a timeout here means it
    waited for the body)."""
    import socket

    host, port = mesh.ingress.split(":")
    with socket.create_connection((host, int(port)), timeout=timeout) as s:
        head = f"POST {path} HTTP/1.1\r\nHost: {mesh.ingress}\r\nContent-Type: application/json\r\n" \
               f"Content-Length: {body_bytes}\r\n"
        if key:
            head += f"Authorization: Bearer {key}\r\n"
        s.sendall((head + "\r\n").encode())
        reply = b""
        while b"\r\n\r\n" not in reply or len(reply.split(b"\r\n\r\n", 1)[1]) < 10:
            chunk = s.recv(65536)
            if not chunk:
                break
            reply += chunk
    head, _, rest = reply.decode("latin-1").partition("\r\n\r\n")
    return head.split("\r\n", 1)[0], rest


def engine_prompt_tokens(mesh, workers: int) -> tuple[float, float]:
    """The prompt tokens the mesh's engines took, and of them the cached, by vLLM's own counters
    (vllm:prompt_tokens_total, vllm:prompt_tokens_cached_total), summed over every worker."""
    from gaas.ops import topology

    topo = topology.load(ROOT / "deploy" / "topology.yaml", env={}, port_base=mesh.port_base,
                         ingress_port=int(mesh.ingress.rsplit(":", 1)[1]), workers=workers)
    prompt = cached = 0.0
    for w in topo.of("worker"):
        body = urllib.request.urlopen(f"http://{w.host}:{w.metrics_port}/metrics", timeout=5).read().decode()
        for line in body.splitlines():
            if line.startswith("vllm:prompt_tokens_total{"):
                prompt += float(line.rsplit(" ", 1)[1])
            elif line.startswith("vllm:prompt_tokens_cached_total{"):
                cached += float(line.rsplit(" ", 1)[1])
    return prompt, cached


def hang_ups_are_billed_for_what_engines_computed(mesh, workers: int, tenant: str, key: str, clients: int = 8):
    """Clients that send a long prompt and hang up 5 to 200 ms later, at once, then the same
    prompts again: for every prompt an engine computed the ledger has the request, so the ledger's
    prompt (and cached) tokens are the engines' own counts of what they took."""
    import socket
    import threading

    wait_workers_idle(mesh)
    before = engine_prompt_tokens(mesh, workers)
    host, port = mesh.ingress.split(":")
    prompt = " ".join(f"word{i} and {i * 7} more" for i in range(220))  # ~1,600 tokens of gaas-tiny
    delays = [0.005 + i * 0.195 / max(1, clients - 1) for i in range(clients)]

    def hang_up(i: int, delay: float) -> None:
        body = json.dumps({"model": "gaas-tiny", "prompt": f"client {i}: {prompt}", "max_tokens": 8,
                           "stream": True}).encode()
        with socket.create_connection((host, int(port)), timeout=10) as s:
            s.sendall(f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {key}\r\n"
                      f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n".encode() + body)
            time.sleep(delay)

    threads = [threading.Thread(target=hang_up, args=(i, d)) for i, d in enumerate(delays)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    c = openai_client(mesh, key)
    for i in range(clients):  # resent: served from the cache whatever the first had become
        c.completions.create(model="gaas-tiny", prompt=f"client {i}: {prompt}", max_tokens=1)
    seen: dict = {}

    def billed_as_computed() -> bool:
        wait_workers_idle(mesh, timeout=60)
        seen["computed"] = tuple(a - b for a, b in zip(engine_prompt_tokens(mesh, workers), before))
        seen["total"] = total = cli_usage(mesh, tenant, 0, timeout=0)
        seen["billed"] = (total.get("prompt_tokens", 0), total.get("cached_tokens", 0))
        return seen["billed"] == seen["computed"]

    eventually(billed_as_computed, 60, every=1, what=lambda: "the ledger to bill what the engines took (engines took "
               f"{seen['computed'][0]:.0f} prompt tokens ({seen['computed'][1]:.0f} cached); the ledger bills "
               f"{seen['billed']})")
    total = seen["total"]
    assert total["requests"] >= clients, "every resent prompt is billed, and the first sends an engine computed"
    return total


def openai_client(mesh, key=None, *, timeout: float = 60, retries: int = 0):
    """The official openai client, pointed at the mesh's ingress, as a user would (key: the mesh's
    demo key unless given)."""
    import openai

    return openai.OpenAI(base_url=f"http://{mesh.ingress}/v1", api_key=key or mesh.api_key, max_retries=retries,
                         timeout=timeout)


def cli_tenant(mesh, name: str, *args: str) -> str:
    """A gold tenant made with the gaas CLI (`gaas tenant set` args after it), and its new key."""
    assert gaas(mesh, "tenant", "create", name, "--tier", "gold").returncode == 0
    if args:
        assert gaas(mesh, "tenant", "set", name, *args).returncode == 0
    r = gaas(mesh, "key", "create", name)
    assert r.returncode == 0, r.stderr
    return next(w for w in r.stdout.split() if w.startswith("gaas_"))


def cli_usage(mesh, tenant: str, want_requests: int, timeout: float = 30.0) -> dict:
    """The tenant's ledger totals (`gaas usage --json`) once it holds want_requests requests (timeout
    0: as they are now)."""
    def read() -> dict:
        r = gaas(mesh, "usage", tenant, "--json")
        return json.loads(r.stdout)["total"] if r.returncode == 0 else {}

    if timeout <= 0:
        return read()
    seen: dict = {}

    def enough() -> dict | None:
        seen.update(read())
        return dict(seen) if seen.get("requests", 0) >= want_requests else None

    return eventually(enough, timeout, every=0.3,
                      what=lambda: f"{want_requests} requests of {tenant} in the ledger (it holds {seen})")


def served_again(c, timeout: float = 15.0, model: str = "gaas-tiny", refused=None) -> None:
    """Wait until the openai client's tenant is served again (refused meanwhile with 429: its
    quota or concurrency; the routers cache a key's tenant for a couple of seconds; or with what
    refused names)."""
    import openai

    eventually(lambda: c.completions.create(model=model, prompt="again", max_tokens=2), timeout, every=0.5,
               ignoring=(refused or openai.RateLimitError,), what="the tenant served again after its quota was lifted")
