"""The rehearsal's reading of the manifests (gaas/k8s/rehearsal.py, gaas/k8s/drill.py): Kubernetes' $(VAR)
expansion, and the scheme and port of the ingress's pods."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from gaas.k8s.rehearsal import expand


def test_a_variable_defined_before_is_expanded_and_an_unknown_one_left_as_written():
    env = {"POD_IP": "10.0.0.7", "POD_NAME": "w-1"}
    assert expand("$(POD_IP):9001", env) == "10.0.0.7:9001"
    assert expand("$(NOPE)/x", env) == "$(NOPE)/x"
    assert expand("$$(POD_IP)", env) == "$(POD_IP)"


@given(st.text(alphabet=st.characters(blacklist_characters="$"), max_size=40))
def test_text_without_a_reference_is_left_alone(text):
    assert expand(text, {"A": "b"}) == text


def _objects(**options):
    from pathlib import Path

    from gaas.k8s import edge, manifests, pods
    from gaas.ops import topology
    from gaas.settings import deployspec

    root = Path(__file__).resolve().parents[3]
    topo = pods.pod_topology(topology.load(root / "deploy" / "topology.yaml", env={}),
                             deployspec.load(root / "deploy" / "gaas.yaml"))
    return manifests.objects(topo, manifests.Options(edge=edge.Edge(**options)))


def test_the_drill_reaches_the_ingress_on_the_port_and_scheme_its_deployment_opens():
    from gaas.k8s import drill, pods

    assert drill.ingress_port(_objects()) == ("https", pods.INGRESS_TLS_PORT)
    assert drill.ingress_port(_objects(plaintext=True)) == ("http", pods.INGRESS_PORT)
