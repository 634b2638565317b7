"""The shared state's servers for a trial, as StatefulSets of their own images: Redis (its config,
with a password and a user per service, in a Secret) and PostgreSQL (its init script makes each
service's database and user). In production point the services at managed ones instead
(`gaas k8s render --postgres-url`, GAAS_REDIS_URL in the services' Secrets)."""

from __future__ import annotations

from gaas.k8s import manifests as m
from gaas.k8s import pods


def stateful_set(name: str, container: dict, volumes: list[dict], storage: str) -> dict:
    """One replica of a third party's server (its image's user, 999) with a volume of its own
    (data), for a trial: Redis, PostgreSQL."""
    return {
        "apiVersion": "apps/v1", "kind": "StatefulSet", "metadata": m.meta(name, container["name"]),
        "spec": {
            "serviceName": name, "replicas": 1, "selector": {"matchLabels": m.selector(name)},
            "template": {"metadata": {"labels": m.labels(name, container["name"])}, "spec": {
                "automountServiceAccountToken": False,
                "enableServiceLinks": False,
                "securityContext": {"fsGroup": 999, "seccompProfile": {"type": "RuntimeDefault"}},
                "containers": [container],
                "volumes": volumes,
            }},
            "volumeClaimTemplates": [{"metadata": {"name": "data"}, "spec": {
                "accessModes": ["ReadWriteOnce"], "resources": {"requests": {"storage": storage}}}}],
        },
    }


def redis_objects() -> list[dict]:
    """Redis for the mesh (a trial's; point GAAS_REDIS_URL in the services' Secrets at a managed
    one instead): its config, with a password and a user per service, in a Secret."""
    name = pods.REDIS
    requests, limits = m.RESOURCES["redis"]
    sts = stateful_set(name, {
        "name": "redis", "image": m.REDIS_IMAGE,
        "command": ["redis-server", "/run/gaas/redis/redis.conf"],
        "ports": [{"name": "redis", "containerPort": pods.REDIS_PORT}],
        "readinessProbe": {"tcpSocket": {"port": pods.REDIS_PORT}, "periodSeconds": 2},
        "livenessProbe": {"tcpSocket": {"port": pods.REDIS_PORT}, "periodSeconds": 10},
        "startupProbe": {"tcpSocket": {"port": pods.REDIS_PORT}, "periodSeconds": 1, "failureThreshold": 30},
        "resources": {"requests": requests, "limits": limits},
        "securityContext": {"runAsNonRoot": True, "runAsUser": 999, "runAsGroup": 999,
                            "allowPrivilegeEscalation": False, "readOnlyRootFilesystem": True,
                            "capabilities": {"drop": ["ALL"]}},
        "volumeMounts": [m.mount("config", "/run/gaas/redis", True), m.mount("data", "/data")],
    }, [{"name": "config", "secret": {"secretName": f"{name}-config", "defaultMode": 0o440}}], "2Gi")
    return [sts, m.headless_service(name, "redis", [("redis", pods.REDIS_PORT)])]


def postgres_objects() -> list[dict]:
    """PostgreSQL for a trial (the official image; its first start runs the init script that makes
    each service's database and user, from a Secret)."""
    name = pods.POSTGRES
    requests, limits = m.RESOURCES["postgres"]
    sts = stateful_set(name, {
        "name": "postgres", "image": m.POSTGRES_IMAGE,
        "envFrom": [{"secretRef": {"name": f"{name}-env"}}],
        "env": [{"name": "PGDATA", "value": "/var/lib/postgresql/data/pgdata"}],
        "ports": [{"name": "postgres", "containerPort": pods.POSTGRES_PORT}],
        "readinessProbe": {"exec": {"command": ["pg_isready", "-U", "postgres"]}, "periodSeconds": 5},
        "livenessProbe": {"tcpSocket": {"port": pods.POSTGRES_PORT}, "periodSeconds": 10},
        "startupProbe": {"tcpSocket": {"port": pods.POSTGRES_PORT}, "periodSeconds": 2, "failureThreshold": 60},
        "resources": {"requests": requests, "limits": limits},
        "securityContext": {"runAsNonRoot": True, "runAsUser": 999, "runAsGroup": 999,
                            "allowPrivilegeEscalation": False, "capabilities": {"drop": ["ALL"]}},
        "volumeMounts": [m.mount("data", "/var/lib/postgresql/data"),
                         m.mount("init", "/docker-entrypoint-initdb.d", True)],
    }, [{"name": "init", "secret": {"secretName": f"{name}-init", "defaultMode": 0o444}}], "10Gi")
    return [sts, m.headless_service(name, "postgres", [("postgres", pods.POSTGRES_PORT)])]


