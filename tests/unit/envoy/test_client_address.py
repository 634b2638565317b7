"""The client's address at the ingress (gaas/envoy/ingress.py): the connection's by default, the one
a configured number of trusted load balancers say in X-Forwarded-For, or the PROXY protocol's; the
ingress stamps it (edge.CLIENT_ADDRESS_HEADER) over whatever a client sent, for the key check's
limiter. Checked on the rendered config and on a real Envoy built from the ingress's own pieces."""

from __future__ import annotations

import http.client
import socket
import subprocess
from pathlib import Path

import pytest
import yaml

from gaas.contracts import edge
from gaas.envoy import config as envoyconf
from gaas.envoy.ingress import edge_hcm_options, ingress_stamps, proxy_protocol
from gaas.envoy.listeners import hcm, listener
from gaas.ops import pki, protogen, topology
from tests.waiting import eventually

ROOT = Path(__file__).resolve().parents[3]


def _ingress(tmp_path, **edge_options) -> dict:
    topo = topology.load(ROOT / "deploy" / "topology.yaml", env={})
    return envoyconf.ingress_config(topo, protogen.DESCRIPTOR_SET, tmp_path, pki.Authority(tmp_path), **edge_options)


def _hcm(cfg: dict) -> dict:
    return cfg["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0]["typed_config"]


def test_by_default_no_forwarding_hop_is_trusted_and_no_proxy_protocol_is_expected(tmp_path):
    cfg = _ingress(tmp_path)
    assert _hcm(cfg)["xff_num_trusted_hops"] == 0 and _hcm(cfg)["use_remote_address"] is True
    assert "listener_filters" not in cfg["static_resources"]["listeners"][0]


def test_the_trusted_hops_and_the_proxy_protocol_are_rendered_when_asked_for(tmp_path):
    cfg = _ingress(tmp_path, xff_trusted_hops=2, proxied=True)
    assert _hcm(cfg)["xff_num_trusted_hops"] == 2
    (flt,) = cfg["static_resources"]["listeners"][0]["listener_filters"]
    assert flt["name"] == "envoy.filters.listener.proxy_protocol"


def test_the_key_check_is_sent_the_client_address_the_ingress_stamped(tmp_path):
    filters = {f["name"]: f["typed_config"] for f in _hcm(_ingress(tmp_path))["http_filters"]}
    allowed = filters["envoy.filters.http.ext_authz"]["allowed_headers"]["patterns"]
    assert {"exact": edge.CLIENT_ADDRESS_HEADER} in allowed
    names = [f["name"] for f in _hcm(_ingress(tmp_path))["http_filters"]]
    assert names.index("envoy.filters.http.header_mutation") < names.index("envoy.filters.http.ext_authz")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def echo_envoy(tmp_path):
    """A real Envoy whose listener is the ingress's (its edge options, its header stamping) and whose
    one route answers with the client address the ingress stamped; start(hops, proxied) -> port."""
    procs = []

    def start(hops: int = 0, proxied: bool = False) -> int:
        port = _free_port()
        seen = {"key": "seen", "value": f"%REQ({edge.CLIENT_ADDRESS_HEADER})%"}
        route = {"match": {"prefix": "/"}, "direct_response": {"status": 200},
                 "response_headers_to_add": [{"header": seen}]}
        manager = hcm("edge", [route], [ingress_stamps()], tmp_path / "access.log", **edge_hcm_options(hops))
        lst = listener("ingress", "127.0.0.1", port, manager)
        if proxied:
            lst["listener_filters"] = [proxy_protocol()]
        config = tmp_path / f"envoy-{port}.yaml"
        config.write_text(yaml.safe_dump({"static_resources": {"listeners": [lst]}}))
        procs.append(subprocess.Popen([envoyconf.envoy_binary(), "-c", str(config), "--disable-hot-restart",
                                       "--concurrency", "1", "-l", "error"]))
        def listening() -> bool:
            if procs[-1].poll() is not None:
                raise RuntimeError(f"envoy exited with {procs[-1].returncode}")
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            return True

        eventually(listening, 20, every=0.1, ignoring=(OSError,), what=f"envoy listening on {port}")
        return port

    yield start
    for p in procs:
        p.terminate()
        p.wait(timeout=10)


def _seen(port: int, preface: bytes = b"") -> str:
    request = (b"GET / HTTP/1.1\r\nHost: gaas\r\nX-Forwarded-For: 203.0.113.7, 198.51.100.9\r\n"
               + edge.CLIENT_ADDRESS_HEADER.encode() + b": 192.0.2.66\r\nConnection: close\r\n\r\n")
    with socket.create_connection(("127.0.0.1", port), timeout=5) as s:
        s.sendall(preface + request)
        response = http.client.HTTPResponse(s)
        response.begin()
        return response.getheader("seen")


def test_a_real_envoy_stamps_the_address_its_forwarding_decision_yields(echo_envoy):
    # No trusted hop: the connection's peer; a client's own header and X-Forwarded-For are not believed.
    assert _seen(echo_envoy(hops=0)) == "127.0.0.1"
    # One trusted load balancer: the address it appended (the rightmost).
    assert _seen(echo_envoy(hops=1)) == "198.51.100.9"
    # A network load balancer's PROXY protocol header names the client.
    assert _seen(echo_envoy(proxied=True), b"PROXY TCP4 192.0.2.44 127.0.0.1 5555 80\r\n") == "192.0.2.44"
