"""The project's own rules for rendered objects, beyond the Kubernetes schemas: what makes a set of
objects that parse into one that works. Each rule returns what breaks it, one line per fault,
naming the object. Pure: the built objects in, faults out."""

from __future__ import annotations

from collections.abc import Callable, Iterable

import yaml

from gaas.k8s import pods

WORKLOADS = ("Deployment", "StatefulSet")
# The ports a mesh pod may open on the pod network: the sidecar's mutual-TLS inbound listener,
# the service's /metrics, the sidecar's statistics (and readiness); the ingress's own port.
POD_NETWORK_PORTS = {pods.INBOUND_PORT, pods.METRICS_PORT, pods.ENVOY_STATS_PORT, pods.INGRESS_PORT,
                     pods.INGRESS_TLS_PORT}
# What every container asks for and is limited to.
RESOURCES = ("cpu", "memory", "ephemeral-storage")
# Says on the ingress Deployment that its plaintext listener was asked for (gaas.k8s.edge).
PLAINTEXT_ANNOTATION = f"{pods.PREFIX}.dev/plaintext-ingress"


def _name(obj: dict) -> str:
    return f"{obj['kind']}/{obj['metadata']['name']}"


def _workloads(objs: list[dict]) -> list[dict]:
    return [o for o in objs if o["kind"] in WORKLOADS]


def _template_labels(w: dict) -> dict:
    return w["spec"]["template"]["metadata"].get("labels") or {}


def _matches(selector: dict, lbls: dict) -> bool:
    return bool(selector) and all(lbls.get(k) == v for k, v in selector.items())


def _containers(w: dict) -> list[dict]:
    spec = w["spec"]["template"]["spec"]
    return [*spec.get("initContainers", []), *spec.get("containers", [])]


def selectors_match_templates(objs: list[dict]) -> Iterable[str]:
    for w in _workloads(objs):
        if not _matches(w["spec"]["selector"].get("matchLabels") or {}, _template_labels(w)):
            yield f"{_name(w)}: its selector does not match its pod template's labels"


def targets_exist(objs: list[dict]) -> Iterable[str]:
    by_name = {(o["kind"], o["metadata"]["name"]) for o in objs}
    for o in objs:
        if o["kind"] in ("HorizontalPodAutoscaler", "ScaledObject"):
            ref = o["spec"]["scaleTargetRef"]
            if (ref.get("kind", "Deployment"), ref["name"]) not in by_name:
                yield f"{_name(o)}: targets {ref.get('kind', 'Deployment')}/{ref['name']}, which is not rendered"
        if o["kind"] == "PodDisruptionBudget":
            sel = o["spec"]["selector"].get("matchLabels") or {}
            if not any(_matches(sel, _template_labels(w)) for w in _workloads(objs)):
                yield f"{_name(o)}: selects no workload's pods"


def containers_have_probes_and_limits(objs: list[dict]) -> Iterable[str]:
    """Every container asks for CPU, memory and ephemeral storage and is limited in them (else one
    can starve its node, or fill its disk until the kubelet evicts every pod there), and has its
    probes (an init container that runs to completion needs none)."""
    for w in _workloads(objs):
        for c in _containers(w):
            where = f"{_name(w)} container {c['name']}"
            resources = c.get("resources") or {}
            for bound in ("requests", "limits"):
                for r in RESOURCES:
                    if r not in (resources.get(bound) or {}):
                        yield f"{where}: no {r} {bound.removesuffix('s')}"
            if c.get("restartPolicy") != "Always" and c in w["spec"]["template"]["spec"].get("initContainers", []):
                continue
            if "livenessProbe" not in c:
                yield f"{where}: no liveness probe"
            if "readinessProbe" not in c and c.get("restartPolicy") != "Always":
                yield f"{where}: no readiness probe"


def service_ports_are_opened(objs: list[dict]) -> Iterable[str]:
    for s in (o for o in objs if o["kind"] == "Service"):
        sel = s["spec"].get("selector") or {}
        selected = [w for w in _workloads(objs) if _matches(sel, _template_labels(w))]
        if not selected:
            yield f"{_name(s)}: selects no workload's pods"
            continue
        for port in s["spec"]["ports"]:
            target = port.get("targetPort", port["port"])
            for w in selected:
                opened = {(p.get("name"), p["containerPort"]) for c in _containers(w) for p in c.get("ports", [])}
                if not any(target in (n, p) for n, p in opened):
                    yield f"{_name(s)}: port {port['name']} targets {target}, which no container of {_name(w)} opens"


def no_plaintext_service_port(objs: list[dict]) -> Iterable[str]:
    """A mesh pod opens only POD_NETWORK_PORTS; its service listens on a Unix socket; every
    listener of its Envoy on the network is TLS, but the statistics one (and the ingress's edge
    where its Deployment says plaintext was asked for: PLAINTEXT_ANNOTATION)."""
    configs = {o["metadata"]["name"]: o["data"] for o in objs if o["kind"] == "ConfigMap"}
    for w in _workloads(objs):
        if _template_labels(w).get(pods.MESH_LABEL) != "true":
            continue
        for c in _containers(w):
            for p in c.get("ports", []):
                if p["containerPort"] not in POD_NETWORK_PORTS:
                    yield f"{_name(w)} container {c['name']}: opens port {p['containerPort']} on the pod network"
            for e in c.get("env", []):
                if e["name"] == "GAAS_LISTEN" and not str(e.get("value", "")).startswith("unix:"):
                    yield f"{_name(w)} container {c['name']}: the service listens on {e.get('value')!r}, not a Unix socket"
        volumes = w["spec"]["template"]["spec"].get("volumes", [])
        cm = next((v["configMap"]["name"] for v in volumes if v["name"] == "envoy" and "configMap" in v), None)
        if cm is None or cm not in configs:
            yield f"{_name(w)}: its Envoy config (ConfigMap {cm}) is not rendered"
            continue
        config = yaml.safe_load(configs[cm][pods.ENVOY_FILE.name])
        for lst in config["static_resources"]["listeners"]:
            addr = lst["address"].get("socket_address")
            plaintext_asked = (w["metadata"].get("annotations") or {}).get(PLAINTEXT_ANNOTATION) == "true"
            if addr is None or lst["name"] == "stats" or (lst["name"] == "ingress" and plaintext_asked):
                continue
            if not all("transport_socket" in chain for chain in lst["filter_chains"]):
                yield f"{_name(w)}: Envoy listener {lst['name']} on port {addr['port_value']} is not TLS"


def references_exist(objs: list[dict]) -> Iterable[str]:
    have = {(o["kind"], o["metadata"]["name"]) for o in objs}
    # (A Secret cert-manager writes from a Certificate.)
    have |= {("Secret", o["spec"]["secretName"]) for o in objs if o["kind"] == "Certificate"}
    for w in _workloads(objs):
        spec = w["spec"]["template"]["spec"]
        for v in spec.get("volumes", []):
            if "configMap" in v and ("ConfigMap", v["configMap"]["name"]) not in have:
                yield f"{_name(w)}: volume {v['name']} names ConfigMap {v['configMap']['name']}, not rendered"
            if "secret" in v and ("Secret", v["secret"]["secretName"]) not in have:
                yield f"{_name(w)}: volume {v['name']} names Secret {v['secret']['secretName']}, not rendered"
            claim = (v.get("persistentVolumeClaim") or {}).get("claimName")
            if claim and ("PersistentVolumeClaim", claim) not in have:
                yield f"{_name(w)}: volume {v['name']} names PersistentVolumeClaim {claim}, not rendered"
        for c in _containers(w):
            for ref in c.get("envFrom", []):
                if "secretRef" in ref and ("Secret", ref["secretRef"]["name"]) not in have:
                    yield f"{_name(w)} container {c['name']}: envFrom names Secret {ref['secretRef']['name']}, not rendered"
        sa = spec.get("serviceAccountName")
        if sa and ("ServiceAccount", sa) not in have:
            yield f"{_name(w)}: runs as ServiceAccount {sa}, not rendered"


RULES: tuple[Callable[[list[dict]], Iterable[str]], ...] = (
    selectors_match_templates, targets_exist, containers_have_probes_and_limits, service_ports_are_opened,
    no_plaintext_service_port, references_exist,
)


def check(objs: list[dict]) -> list[str]:
    return [fault for rule in RULES for fault in rule(objs)]
