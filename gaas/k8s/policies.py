"""The mesh's NetworkPolicies: nothing reaches a GaaS pod but what the mesh needs (gaas/k8s/manifests.py
renders them with the rest of the base)."""

from __future__ import annotations

from gaas.k8s import manifests as m
from gaas.k8s import pods


def network_policies(opts: m.Options) -> list[dict]:
    """Nothing reaches a pod unless allowed: the mesh's pods reach each other's inbound listeners
    (mutual TLS there decides who may call what), Prometheus in any namespace the metrics ports,
    anyone the ingress, Redis's clients Redis, the databases' clients PostgreSQL."""
    mesh = {"podSelector": {"matchLabels": {pods.MESH_LABEL: "true"}}}
    metrics = [{"port": pods.METRICS_PORT, "protocol": "TCP"}, {"port": pods.ENVOY_STATS_PORT, "protocol": "TCP"}]

    def policy(name: str, pod_selector: dict, ingress: list[dict]) -> dict:
        return {"apiVersion": "networking.k8s.io/v1", "kind": "NetworkPolicy", "metadata": m.meta(name, "policy"),
                "spec": {"podSelector": pod_selector, "policyTypes": ["Ingress"], "ingress": ingress}}

    out = [
        policy(f"{pods.PREFIX}-default-deny", {}, []),
        policy(f"{pods.PREFIX}-mesh", {"matchLabels": {pods.MESH_LABEL: "true"}}, [
            {"from": [mesh], "ports": [{"port": pods.INBOUND_PORT, "protocol": "TCP"}]},
            {"from": [{"namespaceSelector": {}}], "ports": metrics},
        ]),
        policy(pods.INGRESS, {"matchLabels": m.selector(pods.INGRESS)}, [
            {"ports": [{"port": opts.edge.port, "protocol": "TCP"}]},
        ]),
        policy(pods.REDIS, {"matchLabels": m.selector(pods.REDIS)}, [
            {"from": [{"podSelector": {"matchLabels": {f"{pods.PREFIX}.dev/redis-client": "true"}}}],
             "ports": [{"port": pods.REDIS_PORT, "protocol": "TCP"}]},
        ]),
    ]
    if opts.postgres:
        out.append(policy(pods.POSTGRES, {"matchLabels": m.selector(pods.POSTGRES)}, [
            {"from": [{"podSelector": {"matchLabels": {f"{pods.PREFIX}.dev/postgres-client": "true"}}}],
             "ports": [{"port": pods.POSTGRES_PORT, "protocol": "TCP"}]},
        ]))
    return out
