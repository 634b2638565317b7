"""The Kubernetes manifests (gaas/k8s): the checked-in example (deploy/k8s/) is what the code
renders from deploy/topology.yaml and deploy/gaas.yaml; both overlays build with Kustomize and
validate strictly against Kubernetes 1.30, 1.33 and 1.37 and the project's rules; each rule
catches the fault it names; the ingress serves HTTPS (plaintext only when asked) and keeps the
client's address; billing's replicas share one volume of batch files; every container is bounded
in ephemeral storage."""

from __future__ import annotations

import copy
import difflib
from pathlib import Path

import pytest
import yaml

from gaas.k8s import edge, manifests, pods, render, rules, validate
from gaas.ops import topology

ROOT = Path(__file__).resolve().parents[3]
EXAMPLE = ROOT / "deploy" / "k8s"
EDGE_ENV = ("GAAS_MAX_BODY_BYTES", "GAAS_MAX_STREAM_SECONDS", "GAAS_REDIS_MAXMEMORY")
REGENERATE = "regenerate with `.venv/bin/gaas k8s render --no-secrets` and review `git diff deploy/k8s/`"


@pytest.fixture
def clean_env(monkeypatch):
    for name in EDGE_ENV:
        monkeypatch.delenv(name, raising=False)


def _topo():
    return topology.load(ROOT / "deploy" / "topology.yaml", env={})


def _spec():
    from gaas.settings import deployspec

    return deployspec.load(ROOT / "deploy" / "gaas.yaml")


def test_the_checked_in_example_is_what_the_code_renders(clean_env):
    rendered = render.files(_topo(), ROOT / "deploy" / "gaas.yaml", manifests.Options())
    present = {str(p.relative_to(EXAMPLE)) for p in EXAMPLE.rglob("*")
               if p.is_file() and not p.relative_to(EXAMPLE).parts[0] == "secrets"}
    assert sorted(present) == sorted(rendered), f"deploy/k8s/ holds other files than the code renders: {REGENERATE}"
    for rel, text in rendered.items():
        have = (EXAMPLE / rel).read_text()
        if have != text:
            diff = "\n".join(list(difflib.unified_diff(have.splitlines(), text.splitlines(), rel, "rendered",
                                                       lineterm=""))[:60])
            pytest.fail(f"deploy/k8s/{rel} is not what the code renders:\n{diff}\n{REGENERATE}")


@pytest.fixture(scope="module")
def rendered_dir(tmp_path_factory):
    out = tmp_path_factory.mktemp("k8s")
    render.write(out, _topo(), ROOT / "deploy" / "gaas.yaml", manifests.Options())
    return out


@pytest.mark.parametrize("overlay", render.OVERLAYS)
def test_every_object_of_each_overlay_validates_against_the_schemas_and_the_rules(rendered_dir, overlay):
    objs = validate.validate(rendered_dir / "overlays" / overlay)
    kinds = {o["kind"] for o in objs}
    assert {"Deployment", "Service", "HorizontalPodAutoscaler", "PodDisruptionBudget", "NetworkPolicy",
            "StatefulSet", "Secret", "ConfigMap", "ScaledObject", "ServiceAccount"} <= kinds


@pytest.fixture(scope="module")
def cpu_objects(rendered_dir):
    return validate.build(rendered_dir / "overlays" / "cpu")


def _find(objs, kind, name):
    return next(o for o in objs if o["kind"] == kind and o["metadata"]["name"] == name)


def test_each_service_and_pool_is_a_deployment_with_an_envoy_native_sidecar_and_a_unix_socket(cpu_objects):
    deployments = {o["metadata"]["name"]: o for o in cpu_objects if o["kind"] == "Deployment"}
    assert {"gaas-control", "gaas-kvcache", "gaas-billing", "gaas-router", "gaas-ingress",
            "gaas-worker-gaas-tiny-1-0-0"} <= set(deployments)
    for name, dep in deployments.items():
        if name == pods.INGRESS:
            continue
        spec = dep["spec"]["template"]["spec"]
        (sidecar,) = spec["initContainers"]
        assert sidecar["name"] == "envoy" and sidecar["restartPolicy"] == "Always"
        (service,) = spec["containers"]
        env = {e["name"]: e.get("value") for e in service["env"]}
        assert env["GAAS_LISTEN"].startswith("unix:/run/gaas/sockets/")
        assert env["GAAS_HOST"] == "0.0.0.0"  # (its /metrics only)
        assert any(v.get("emptyDir") is not None and v["name"] == "sockets" for v in spec["volumes"])


def test_the_workers_service_is_headless_and_the_gpu_overlay_gives_each_worker_a_gpu(rendered_dir, cpu_objects):
    svc = _find(cpu_objects, "Service", "gaas-worker-gaas-tiny-1-0-0")
    assert svc["spec"]["clusterIP"] == "None"
    gpu = validate.build(rendered_dir / "overlays" / "gpu")
    worker = _find(gpu, "Deployment", "gaas-worker-gaas-tiny-1-0-0")["spec"]["template"]["spec"]
    (container,) = worker["containers"]
    assert container["resources"]["limits"]["nvidia.com/gpu"] == 1
    assert {"name": "GAAS_DEVICE", "value": "cuda"} in container["env"]
    assert not any(e == {"name": "GAAS_DEVICE", "value": "cpu"} for e in container["env"])
    assert container["image"].endswith(":cuda")


def test_a_pool_scales_on_its_queue_and_kv_use_and_drains_before_it_stops(cpu_objects):
    so = _find(cpu_objects, "ScaledObject", "gaas-worker-gaas-tiny-1-0-0")
    queries = " ".join(t["metadata"]["query"] for t in so["spec"]["triggers"])
    assert "vllm:num_requests_waiting" in queries and "vllm:kv_cache_usage_perc" in queries
    dep = _find(cpu_objects, "Deployment", "gaas-worker-gaas-tiny-1-0-0")
    assert dep["spec"]["template"]["spec"]["terminationGracePeriodSeconds"] == manifests.worker_grace_seconds()
    assert dep["spec"]["strategy"]["rollingUpdate"] == {"maxUnavailable": 0, "maxSurge": 1}


def test_a_pool_that_starts_at_zero_renders_no_pod_and_wakes_on_the_requests_routers_hold(cpu_objects):
    from gaas.contracts.autoscale import AWAITING_METRIC

    dep = _find(cpu_objects, "Deployment", "gaas-worker-gaas-embed-1-0-0")
    assert dep["spec"]["replicas"] == 0
    so = _find(cpu_objects, "ScaledObject", "gaas-worker-gaas-embed-1-0-0")
    assert (so["spec"]["minReplicaCount"], so["spec"]["maxReplicaCount"]) == (0, 1)
    (awaiting,) = [t["metadata"] for t in so["spec"]["triggers"] if AWAITING_METRIC in t["metadata"]["query"]]
    assert 'model="gaas-embed"' in awaiting["query"] and awaiting["activationThreshold"] == "0"


def test_a_gpu_requirement_becomes_node_affinity():
    from gaas.contracts.device import DeviceRequirement

    need = DeviceRequirement.parse({"kind": "gpu", "gpu_memory_gib": 40, "compute_capability": "8.0"})
    terms = manifests.gpu_affinity(need)["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"][
        "nodeSelectorTerms"][0]["matchExpressions"]
    assert {"key": "nvidia.com/gpu.memory", "operator": "Gt", "values": ["40959"]} in terms
    assert {"key": "nvidia.com/gpu.compute.major", "operator": "Gt", "values": ["7"]} in terms
    assert manifests.gpu_affinity(DeviceRequirement.parse("gpu")) is None


def test_every_secret_is_per_service(rendered_dir):
    env_files = sorted(p.name for p in (rendered_dir / "secrets").glob("*-env.env"))
    assert "gaas-router-env.env" in env_files and "gaas-billing-env.env" in env_files
    router = (rendered_dir / "secrets" / "gaas-router-env.env").read_text()
    billing = (rendered_dir / "secrets" / "gaas-billing-env.env").read_text()
    assert "GAAS_BILLING_DATABASE_URL" in billing and "GAAS_BILLING_DATABASE_URL" not in router
    assert "gaas-router:" in router and "gaas-billing:" in billing  # (each its own Redis user)


def test_a_second_render_keeps_the_secrets(rendered_dir):
    before = {p.name: p.read_bytes() for p in (rendered_dir / "secrets").rglob("*") if p.is_file()}
    render.write(rendered_dir, _topo(), ROOT / "deploy" / "gaas.yaml", manifests.Options())
    after = {p.name: p.read_bytes() for p in (rendered_dir / "secrets").rglob("*") if p.is_file()}
    assert before == after


# --- each rule catches its fault ------------------------------------------------------------------


def _broken(objs, kind, name, change):
    objs = copy.deepcopy(objs)
    change(_find(objs, kind, name))
    return rules.check(objs)


def test_the_rendered_objects_break_no_rule(cpu_objects):
    assert rules.check(cpu_objects) == []


def test_a_selector_not_matching_its_template_is_a_fault(cpu_objects):
    faults = _broken(cpu_objects, "Deployment", "gaas-router",
                     lambda d: d["spec"]["selector"]["matchLabels"].update({pods.NAME_LABEL: "other"}))
    assert any("Deployment/gaas-router: its selector does not match" in f for f in faults)


def test_an_autoscaler_of_nothing_is_a_fault(cpu_objects):
    faults = _broken(cpu_objects, "HorizontalPodAutoscaler", "gaas-billing",
                     lambda h: h["spec"]["scaleTargetRef"].update(name="gaas-nothing"))
    assert any("HorizontalPodAutoscaler/gaas-billing: targets Deployment/gaas-nothing" in f for f in faults)


def test_a_container_without_limits_or_probes_is_a_fault(cpu_objects):
    def strip(d):
        c = d["spec"]["template"]["spec"]["containers"][0]
        c["resources"].pop("limits")
        c.pop("readinessProbe")
    faults = _broken(cpu_objects, "Deployment", "gaas-control", strip)
    assert any("no cpu limit" in f for f in faults) and any("no readiness probe" in f for f in faults)


def test_a_container_without_ephemeral_storage_bounds_is_a_fault(cpu_objects):
    def strip(d):
        sidecar = d["spec"]["template"]["spec"]["initContainers"][0]
        sidecar["resources"]["requests"].pop("ephemeral-storage")
        sidecar["resources"]["limits"].pop("ephemeral-storage")
    faults = _broken(cpu_objects, "Deployment", "gaas-router", strip)
    assert "Deployment/gaas-router container envoy: no ephemeral-storage request" in faults
    assert "Deployment/gaas-router container envoy: no ephemeral-storage limit" in faults


def test_every_container_and_empty_dir_is_bounded_in_ephemeral_storage(cpu_objects):
    for w in (o for o in cpu_objects if o["kind"] in rules.WORKLOADS):
        spec = w["spec"]["template"]["spec"]
        for c in [*spec.get("initContainers", []), *spec["containers"]]:
            assert {"ephemeral-storage"} <= set(c["resources"]["requests"]) & set(c["resources"]["limits"]), c["name"]
        for v in spec.get("volumes", []):
            if "emptyDir" in v:
                assert v["emptyDir"].get("sizeLimit"), f"{w['metadata']['name']} volume {v['name']}"


# --- the ingress: TLS, and the client's address ----------------------------------------------------


def _ingress_listener(objs) -> dict:
    cm = _find(objs, "ConfigMap", "gaas-ingress-envoy")
    config = yaml.safe_load(cm["data"]["envoy.yaml"])
    return next(lst for lst in config["static_resources"]["listeners"] if lst["name"] == "ingress")


def test_the_ingress_serves_https_on_443_with_the_certificate_secret_and_alpn_h2(rendered_dir, cpu_objects):
    svc = _find(cpu_objects, "Service", pods.INGRESS)
    assert svc["spec"]["ports"] == [{"name": "https", "port": 443, "targetPort": pods.INGRESS_TLS_PORT}]
    dep = _find(cpu_objects, "Deployment", pods.INGRESS)["spec"]["template"]["spec"]
    volume = next(v for v in dep["volumes"] if v["name"] == "edge-tls")
    secret = _find(cpu_objects, "Secret", volume["secret"]["secretName"])
    assert secret["type"] == "kubernetes.io/tls" and {"tls.crt", "tls.key"} <= set(secret["data"])
    listener = _ingress_listener(cpu_objects)
    assert listener["address"]["socket_address"]["port_value"] == pods.INGRESS_TLS_PORT
    tls = listener["filter_chains"][0]["transport_socket"]["typed_config"]["common_tls_context"]
    assert tls["tls_certificates"][0]["certificate_chain"]["filename"] == f"{pods.EDGE_TLS_DIR}/tls.crt"
    assert tls["alpn_protocols"] == ["h2", "http/1.1"]
    # The trial certificate names the Service and is signed by the CA a client is told to trust.
    from cryptography import x509

    cert = x509.load_pem_x509_certificate((rendered_dir / "secrets" / edge.TRIAL_CERT).read_bytes())
    ca = x509.load_pem_x509_certificate((rendered_dir / "secrets" / edge.TRIAL_CA).read_bytes())
    assert cert.issuer == ca.subject
    names = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value.get_values_for_type(x509.DNSName)
    assert "gaas-ingress.gaas.svc.cluster.local" in names


def test_the_ingress_is_plaintext_only_when_asked_and_the_rules_catch_it_otherwise(cpu_objects):
    plain = manifests.objects(pods.pod_topology(_topo(), _spec()), manifests.Options(edge=edge.Edge(plaintext=True)))
    svc = _find(plain, "Service", pods.INGRESS)
    assert svc["spec"]["ports"] == [{"name": "http", "port": 80, "targetPort": pods.INGRESS_PORT}]
    assert "transport_socket" not in _ingress_listener(plain)["filter_chains"][0]
    assert not [f for f in rules.check(plain) if "not TLS" in f]

    def plaintext(cm):
        config = yaml.safe_load(cm["data"]["envoy.yaml"])
        next(lst for lst in config["static_resources"]["listeners"] if lst["name"] == "ingress")[
            "filter_chains"][0].pop("transport_socket")
        cm["data"]["envoy.yaml"] = yaml.safe_dump(config)
    faults = _broken(cpu_objects, "ConfigMap", "gaas-ingress-envoy", plaintext)
    assert any("Deployment/gaas-ingress: Envoy listener ingress" in f and "not TLS" in f for f in faults)


def test_cert_manager_issues_the_ingress_certificate_when_asked(tmp_path):
    opts = manifests.Options(edge=edge.Edge(issuer="ClusterIssuer/letsencrypt", hosts=("api.example.com",)))
    render.write(tmp_path, _topo(), ROOT / "deploy" / "gaas.yaml", opts)
    objs = validate.validate(tmp_path / "overlays" / "cpu")
    cert = _find(objs, "Certificate", pods.INGRESS)
    assert cert["spec"]["secretName"] == opts.edge.tls_secret
    assert cert["spec"]["issuerRef"] == {"group": "cert-manager.io", "kind": "ClusterIssuer", "name": "letsencrypt"}
    assert cert["spec"]["dnsNames"][0] == "api.example.com"
    assert not any(o["kind"] == "Secret" and o["metadata"]["name"] == opts.edge.tls_secret for o in objs)


def test_the_ingress_keeps_client_addresses_and_trusts_the_hops_it_is_told(cpu_objects):
    assert _find(cpu_objects, "Service", pods.INGRESS)["spec"]["externalTrafficPolicy"] == "Local"
    hcm = _ingress_listener(cpu_objects)["filter_chains"][0]["filters"][0]["typed_config"]
    assert hcm["xff_num_trusted_hops"] == 0
    behind = manifests.objects(pods.pod_topology(_topo(), _spec()),
                               manifests.Options(edge=edge.Edge(xff_trusted_hops=1, proxy_protocol=True)))
    listener = _ingress_listener(behind)
    assert listener["filter_chains"][0]["filters"][0]["typed_config"]["xff_num_trusted_hops"] == 1
    assert listener["listener_filters"][0]["name"] == "envoy.filters.listener.proxy_protocol"


# --- billing's batch files -------------------------------------------------------------------------


def test_every_billing_replica_mounts_one_shared_read_write_many_claim_for_batch_files(cpu_objects):
    dep = _find(cpu_objects, "Deployment", "gaas-billing")
    assert dep["spec"]["replicas"] >= 2
    spec = dep["spec"]["template"]["spec"]
    files = next(v for v in spec["volumes"] if v["name"] == "files")
    assert "emptyDir" not in files
    claim = _find(cpu_objects, "PersistentVolumeClaim", files["persistentVolumeClaim"]["claimName"])
    assert claim["spec"]["accessModes"] == ["ReadWriteMany"]
    assert claim["spec"]["resources"]["requests"]["storage"] == manifests.Options().files_size
    (billing,) = spec["containers"]
    assert {"name": "files", "mountPath": str(pods.FILES_DIR)} in billing["volumeMounts"]
    classed = manifests.objects(pods.pod_topology(_topo(), _spec()), manifests.Options(files_storage_class="efs"))
    assert _find(classed, "PersistentVolumeClaim", "gaas-billing-files")["spec"]["storageClassName"] == "efs"


def test_a_missing_claim_is_a_fault(cpu_objects):
    objs = [o for o in cpu_objects if o["kind"] != "PersistentVolumeClaim"]
    assert any("names PersistentVolumeClaim gaas-billing-files" in f for f in rules.check(objs))


def test_a_service_port_no_container_opens_is_a_fault(cpu_objects):
    faults = _broken(cpu_objects, "Service", "gaas-kvcache",
                     lambda s: s["spec"]["ports"].append({"name": "x", "port": 7000, "targetPort": 7000}))
    assert any("port x targets 7000" in f for f in faults)


def test_a_plaintext_port_on_the_pod_network_is_a_fault(cpu_objects):
    def expose(d):
        c = d["spec"]["template"]["spec"]["containers"][0]
        c["ports"].append({"name": "grpc", "containerPort": pods.PORT_BASE})
        for e in c["env"]:
            if e["name"] == "GAAS_LISTEN":
                e["value"] = "0.0.0.0:9000"
    faults = _broken(cpu_objects, "Deployment", "gaas-control", expose)
    assert any("opens port 9000" in f for f in faults) and any("not a Unix socket" in f for f in faults)

    def plaintext(cm):
        config = yaml.safe_load(cm["data"]["envoy.yaml"])
        inbound = next(lst for lst in config["static_resources"]["listeners"] if lst["name"] == "inbound")
        inbound["filter_chains"][0].pop("transport_socket")
        cm["data"]["envoy.yaml"] = yaml.safe_dump(config)
    faults = _broken(cpu_objects, "ConfigMap", "gaas-control-envoy", plaintext)
    assert any("listener inbound on port 9001 is not TLS" in f for f in faults)


def test_a_missing_secret_is_a_fault(cpu_objects):
    objs = [o for o in cpu_objects if not (o["kind"] == "Secret" and o["metadata"]["name"] == "gaas-router-tls")]
    assert any("names Secret gaas-router-tls" in f for f in rules.check(objs))


def test_a_project_model_directory_is_found_in_the_image():
    from gaas.settings import deployspec

    assert pods.image_path(str(deployspec.PROJECT_ROOT / "models" / "gaas-tiny")) == "/opt/gaas/models/gaas-tiny"
    assert pods.image_path("meta-llama/Llama-3.1-8B") == "meta-llama/Llama-3.1-8B"
