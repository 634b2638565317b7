"""Helpers for tests that talk to the shared mesh (see the mesh fixture in conftest.py)."""

from __future__ import annotations

import os
import subprocess
import sys
import time
import urllib.error
import urllib.request

import grpc

from gaas.v1 import inference_pb2, inference_pb2_grpc
from tests.conftest import ROOT


def gaas(mesh, *args, timeout=60):
    return subprocess.run(
        [sys.executable, "-m", "gaas.cli", *args], cwd=ROOT, capture_output=True, text=True, timeout=timeout,
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
    from gaas import probe

    control = next(i["address"] for i in mesh.ready["instances"] if i["name"] == "control-0")
    deadline = time.monotonic() + timeout
    while True:
        workers = probe.list_workers(control, run_dir=mesh.run_dir)
        if workers and all(w["load"]["running"] + w["load"]["waiting"] == 0 for w in workers):
            time.sleep(1.2)  # and the routers have read that report (they refresh every 0.5 s)
            return
        assert time.monotonic() < deadline, f"workers still busy after {timeout} s: {workers}"
        time.sleep(0.3)


def worker_addresses(mesh) -> dict[str, str]:
    return {w["worker_id"]: w["address"] for w in mesh.ready["workers"]}


def wait_for_lines(path, *needles, timeout=10.0) -> str:
    """The file's text once it holds a line containing all needles (Envoy flushes logs every second)."""
    deadline = time.monotonic() + timeout
    while True:
        text = path.read_text() if path.exists() else ""
        if any(all(n in line for n in needles) for line in text.splitlines()):
            return text
        assert time.monotonic() < deadline, f"no line with {needles} in {path}:\n{text[-2000:]}"
        time.sleep(0.2)
