"""The rendered Kubernetes manifests run (gaas/k8s/rehearsal.py): every pod of the cpu overlay as
processes in its own network namespace, with the commands, environment and files the manifests
give its containers; the official openai client streams through a rehearsed ingress pod over
HTTPS, trusting the render's CA alone (mutual TLS between the pods), billing's replicas share one
volume of batch files, and one pod of each Deployment killed in turn (two replicas of each
stateless service, two workers) costs no request and comes back by its restart policy.

Needs root (network and mount namespaces), `ip` and `setpriv`; skipped otherwise."""

from __future__ import annotations

import os
import shutil
import socket
import ssl
from pathlib import Path

import pytest

from gaas.k8s import drill, pods
from tests.conftest import INGRESS_PATH, on_direct_path

ROOT = Path(__file__).resolve().parents[2]

pytestmark = [
    pytest.mark.skipif(os.geteuid() != 0 or not shutil.which("ip") or not shutil.which("setpriv"),
                       reason="the rehearsal needs root, iproute2's ip and util-linux's setpriv"),
    # Thirteen pods with two vLLM workers load this host as much as the shared mesh: run after its tests.
    pytest.mark.apart,
    on_direct_path("the manifests and the pods' lives are the same whichever path serves (the paths themselves are "
                   "tested on the shared mesh); once per suite, CI's budget"),
]


@pytest.fixture(scope="module")
def rehearsed(tmp_path_factory):
    work = tmp_path_factory.mktemp("rehearsal")
    with drill.rehearse(work, ROOT, deploy_file=ROOT / "deploy" / "gaas.yaml",
                            topology_file=ROOT / "deploy" / "topology.yaml", workers=2,
                            ingress_path=INGRESS_PATH) as r:
        yield r


def test_every_pod_runs_in_a_namespace_of_its_own_with_its_own_address(rehearsed):
    reh = rehearsed.rehearsal
    assert len({p.ip for p in reh.pods}) == len(reh.pods) >= 13
    for kind in ("control", "kvcache", "billing", "router"):
        assert len(reh.of(pods.deployment_name(kind))) == 2


def test_only_mutual_tls_and_metrics_are_on_the_pod_network(rehearsed):
    pod = rehearsed.rehearsal.of(pods.deployment_name("control"))[0]
    # The service itself is a Unix socket in the pod: nothing listens on its port.
    with pytest.raises(OSError):
        socket.create_connection((pod.ip, pods.PORT_BASE), timeout=2).close()
    # The inbound listener asks for a certificate of the mesh: TLS without one is refused.
    ctx = ssl.create_default_context()
    ctx.check_hostname = False
    ctx.verify_mode = ssl.CERT_NONE
    with pytest.raises((ssl.SSLError, ConnectionResetError, OSError)):
        with socket.create_connection((pod.ip, pods.INBOUND_PORT), timeout=5) as raw:
            with ctx.wrap_socket(raw) as tls:
                tls.sendall(b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n")
                if not tls.recv(1):
                    raise ConnectionResetError("closed")


def test_the_ingress_serves_https_only_with_a_certificate_for_its_service_name(rehearsed):
    assert rehearsed.ingress.startswith("https://") and rehearsed.ingress_ca is not None
    host, port = rehearsed.ingress.removeprefix("https://").removesuffix("/v1").split(":")
    ctx = ssl.create_default_context(cafile=str(rehearsed.ingress_ca))
    ctx.set_alpn_protocols(["h2", "http/1.1"])
    with socket.create_connection((host, int(port)), timeout=5) as raw:
        with ctx.wrap_socket(raw, server_hostname=pods.INGRESS) as tls:
            assert tls.selected_alpn_protocol() == "h2", "gRPC clients get HTTP/2"
    # Plain HTTP on the ingress's port is not served.
    with socket.create_connection((host, int(port)), timeout=5) as raw:
        raw.sendall(b"GET /v1/models HTTP/1.1\r\nHost: gaas\r\n\r\n")
        try:
            answer = raw.recv(64)
        except OSError:
            answer = b""
        assert not answer.startswith(b"HTTP/1.1")


def test_billing_replicas_share_one_directory_for_batch_files(rehearsed):
    reh = rehearsed.rehearsal
    billing = reh.of(pods.deployment_name("billing"))
    assert len(billing) == 2
    (claim,) = list(reh.claims.iterdir())
    assert claim.name == "gaas-billing-files"
    for pod in billing:
        assert "/.rehearsal-claims/gaas-billing-files /run/gaas/files" in (pod.dir / "billing.sh").read_text()


def test_the_openai_client_streams_through_the_ingress_and_each_pod_kill_costs_no_request(rehearsed):
    results = drill.survives_kills(rehearsed)
    killed = {k.workload for k in results}
    assert {pods.INGRESS, *(pods.deployment_name(k) for k in ("control", "kvcache", "billing", "router"))} <= killed
    assert any(w.startswith("gaas-worker-") for w in killed)
    for k in results:
        assert k.failed == 0, f"{k.workload}: {k.failed}/{k.requests} failed while {k.pod} was down: {k.errors}"
