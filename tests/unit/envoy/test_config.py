import json
import subprocess
from pathlib import Path

import grpc
import pytest
import yaml

from gaas.contracts.services import GRPC_SERVICE
from gaas.contracts import edge
from gaas.envoy import config as envoyconf
from gaas.envoy.clusters import static_cluster
from gaas.ops import pki, protogen, topology

ROOT = Path(__file__).resolve().parents[3]
# What the router decides on the direct path, the ingress then sending it to a worker straight.
DECIDED = {f"/gaas.v1.OpenAI/{m}" for m in ("Completions", "ChatCompletions", "Embeddings")} | {"/gaas.v1.Inference/Generate"}


def _render(out, ingress_path: str):
    topo = topology.load(ROOT / "deploy" / "topology.yaml", env={"GAAS_INGRESS_PATH": ingress_path}, workers=2)
    authority = pki.Authority(out)
    pki.issue_certificates(topo, authority)
    files = envoyconf.render(topo, out, protogen.DESCRIPTOR_SET, out / "logs", authority, sockets=out / "sockets")
    return topo, {name: yaml.safe_load(path.read_text()) for name, path in files.items()}, files


@pytest.fixture(scope="module")
def rendered(tmp_path_factory):
    """The configs of the path through the router (the direct path's: rendered_direct)."""
    return _render(tmp_path_factory.mktemp("envoy"), "router")


def test_one_sidecar_per_instance_plus_the_ingresss_envoys(rendered):
    topo, configs, _ = rendered
    assert topo.ingresses == ["ingress-0", "ingress-1"]
    assert set(configs) == {"ingress-0", "ingress-1"} | {f"sidecar-{i.name}" for i in topo.instances}


def test_the_ingresss_envoys_share_its_port_each_with_its_own_admin_and_statistics(rendered):
    topo, configs, _ = rendered
    edges = [configs[name] for name in topo.ingresses]
    listeners = [{x["name"]: x for x in cfg["static_resources"]["listeners"]} for cfg in edges]
    assert [ls["ingress"]["address"] for ls in listeners] == [listeners[0]["ingress"]["address"]] * len(edges)
    assert all(ls["ingress"]["enable_reuse_port"] for ls in listeners)
    assert len({str(cfg["admin"]["address"]) for cfg in edges}) == len(edges)
    stats = [next(x["address"]["socket_address"]["port_value"] for x in ls.values() if x["name"] != "ingress")
             for ls in listeners]
    assert stats == [topo.ingress_stats_port_of(i) for i in range(len(edges))] and len(set(stats)) == len(edges)


def test_configs_are_valid_envoy(rendered):
    _, _, files = rendered
    for name, path in files.items():
        r = subprocess.run(
            [envoyconf.envoy_binary(), "--mode", "validate", "-c", str(path), "--disable-hot-restart"],
            capture_output=True, text=True, timeout=60,
        )
        assert r.returncode == 0, f"{name}: {r.stdout[-2000:]}{r.stderr[-2000:]}"


def _clusters(cfg):
    return {c["name"]: c for c in cfg["static_resources"]["clusters"]}


def _routes(listener):
    hcm = listener["filter_chains"][0]["filters"][0]["typed_config"]
    return hcm["route_config"]["virtual_hosts"][0]


def _takes_workers_from_control(cfg, topo):
    """The Envoy's workers cluster has no endpoints of its own: they come from control (xDS), as
    workers register and leave; each request goes to the worker x-gaas-worker names."""
    clusters = _clusters(cfg)
    workers = clusters["workers"]
    assert workers["type"] == "EDS" and "load_assignment" not in workers
    assert workers["eds_cluster_config"] == {"service_name": "workers", "eds_config": {
        "ads": {}, "resource_api_version": "V3", "initial_fetch_timeout": "5s"}}
    policy = workers["load_balancing_policy"]["policies"][0]["typed_extension_config"]
    assert policy["name"] == "envoy.load_balancing_policies.override_host"
    assert policy["typed_config"]["override_host_sources"] == [{"header": "x-gaas-worker"}]
    assert not any(c.get("type") == "ORIGINAL_DST" for c in clusters.values())
    # The stream to control's replicas, at their sidecars' inbound listeners (mTLS, as a control).
    assert cfg["dynamic_resources"]["ads_config"]["grpc_services"] == [{"envoy_grpc": {"cluster_name": "xds"}}]
    xds = clusters["xds"]
    ports = [e["endpoint"]["address"]["socket_address"]["port_value"]
             for e in xds["load_assignment"]["endpoints"][0]["lb_endpoints"]]
    assert ports == [c.inbound_port for c in topo.of("control")]
    sans = xds["transport_socket"]["typed_config"]["common_tls_context"]["validation_context"]
    assert sans["match_typed_subject_alt_names"][0]["matcher"] == {"prefix": "spiffe://gaas.local/control/"}


def test_router_sidecar_routes_workers_by_header(rendered):
    topo, configs, _ = rendered
    cfg = configs["sidecar-router-0"]
    clusters = _clusters(cfg)
    _takes_workers_from_control(cfg, topo)
    outbound = next(x for x in cfg["static_resources"]["listeners"] if x["name"] == "outbound")
    worker_route = next(r for r in _routes(outbound)["routes"] if r["match"]["prefix"] == "/gaas.v1.Worker/")
    assert worker_route["route"]["cluster"] == "workers"
    assert worker_route["match"]["headers"][0]["name"] == "x-gaas-worker"
    # Peers are reached at their sidecars' inbound listeners, health-checked over gRPC.
    control = clusters["control"]
    ports = [e["endpoint"]["address"]["socket_address"]["port_value"]
             for e in control["load_assignment"]["endpoints"][0]["lb_endpoints"]]
    assert ports == [topo.instance("control-0").inbound_port]
    assert "grpc_health_check" in control["health_checks"][0]


def test_inbound_forwards_to_the_local_service(rendered):
    topo, configs, _ = rendered
    cfg = configs["sidecar-worker-1"]
    inbound = next(x for x in cfg["static_resources"]["listeners"] if x["name"] == "inbound")
    assert inbound["address"]["socket_address"]["port_value"] == topo.instance("worker-1").inbound_port
    # The service is a Unix socket in the instance's own directory; so are the outbound listener
    # and the admin interface: nothing but the inbound (mutual TLS) and the statistics for
    # Prometheus listen on TCP.
    local = _clusters(cfg)["local_service"]
    addr = local["load_assignment"]["endpoints"][0]["lb_endpoints"][0]["endpoint"]["address"]
    root = Path(cfg["admin"]["address"]["pipe"]["path"]).parent
    assert addr == {"pipe": {"path": str(root / "service.sock")}} and root.name == "worker-1"
    outbound = next(x for x in cfg["static_resources"]["listeners"] if x["name"] == "outbound")
    assert outbound["address"]["pipe"] == {"path": str(root / "outbound.sock"), "mode": 0o600}
    for name, c in configs.items():
        tcp = [x["name"] for x in c["static_resources"]["listeners"] if "socket_address" in x["address"]]
        assert tcp == (["ingress", "stats"] if name.startswith("ingress-") else ["inbound", "stats"]), name
        assert "pipe" in c["admin"]["address"], name


def test_control_has_no_outbound_and_worker_reaches_only_its_peers(rendered):
    topo, configs, _ = rendered
    assert [x["name"] for x in configs["sidecar-control-0"]["static_resources"]["listeners"]] == ["inbound", "stats"]
    assert set(_clusters(configs["sidecar-worker-0"])) == {"local_service", "control", "envoy_admin"}
    assert "dynamic_resources" not in configs["sidecar-worker-0"]
    # The KV directory watches the workers (each named in x-gaas-worker).
    assert set(_clusters(configs["sidecar-kvcache-0"])) == {"local_service", "control", "envoy_admin", "workers", "xds"}
    _takes_workers_from_control(configs["sidecar-kvcache-0"], topo)


def test_ingress_strips_trusted_headers_and_transcodes(rendered):
    _, configs, _ = rendered
    listener = configs["ingress-0"]["static_resources"]["listeners"][0]
    vhost = _routes(listener)
    hcm = listener["filter_chains"][0]["filters"][0]["typed_config"]
    # A client's say on the trusted headers is dropped before any filter sees it or a route is chosen.
    (early,) = hcm["early_header_mutation_extensions"]
    assert {m["remove"] for m in early["typed_config"]["mutations"]} == {"x-gaas-tenant", "x-gaas-worker",
                                                                          "x-gaas-request-id"}
    first = hcm["http_filters"][0]
    assert first["name"] == "envoy.filters.http.header_mutation"
    mutations = first["typed_config"]["mutations"]["request_mutations"]
    # The arrival stamp, set over a client's before any filter (the direct path's decision) reads it.
    # (So is the client's address as the ingress decided it: tests/unit/envoy/test_client_address.py.)
    stamps = {m["append"]["header"]["key"]: m["append"] for m in mutations if "append" in m}
    assert set(stamps) == {"x-gaas-ingress-start", edge.CLIENT_ADDRESS_HEADER}
    assert all(s["append_action"] == "OVERWRITE_IF_EXISTS_OR_ADD" for s in stamps.values())
    assert hcm["codec_type"] == "AUTO"
    # The client's x-request-id survives and comes back in the response.
    assert hcm["preserve_external_request_id"] and hcm["always_set_request_id_in_response"]
    # Only the router's public services (and health, reflection) are routed; nothing internal.
    prefixes = {r["match"]["prefix"] for r in vhost["routes"] if "route" in r and "prefix" in r["match"]}
    # ... and uploads (POST /v1/files), whose body may be larger: their own transcoder limit.
    (upload,) = [r for r in vhost["routes"] if r["match"].get("path") == "/v1/files"]
    limit = upload["typed_per_filter_config"]["envoy.filters.http.grpc_json_transcoder"]["max_request_body_size"]
    assert limit > 4 * 1024 * 1024 - 64 * 1024
    assert prefixes == {"/gaas.v1.Inference/", "/gaas.v1.OpenAI/", "/grpc.health.v1.Health/",
                        "/grpc.reflection.v1alpha.ServerReflection/", "/grpc.reflection.v1.ServerReflection/"}
    filters = {f["name"]: f["typed_config"] for f in hcm["http_filters"]}
    transcoder = filters["envoy.filters.http.grpc_json_transcoder"]
    assert transcoder["services"] == ["gaas.v1.Inference", "gaas.v1.OpenAI"]
    assert Path(transcoder["proto_descriptor"]).is_file()
    # The Lua filter comes first, so on the way back it sees the transcoder's answers.
    names = [f["name"] for f in hcm["http_filters"]]
    assert names.index("envoy.filters.http.lua") < names.index("envoy.filters.http.grpc_json_transcoder")
    lua = filters["envoy.filters.http.lua"]["default_source_code"]["inline_string"]
    # Its tables come from gaas/contracts/errors.py: a status shows the same in a stream's error event and at the edge.
    assert '[3] = "invalid_request_error"' in lua and '[8] = "rate_limit_exceeded"' in lua
    assert "function envoy_on_response" in lua


def test_peer_clusters_eject_failing_replicas(rendered):
    _, configs, _ = rendered
    clusters = {c["name"]: c for c in configs["sidecar-router-0"]["static_resources"]["clusters"]}
    assert clusters["control"]["outlier_detection"]["consecutive_5xx"] == 5
    ingress = {c["name"]: c for c in configs["ingress-0"]["static_resources"]["clusters"]}
    assert ingress["router"]["outlier_detection"]["max_ejection_percent"] == 50
    # Every stream of a replica that died may be retried at once, not just Envoy's default 3.
    budget = ingress["router"]["circuit_breakers"]["thresholds"][0]["retry_budget"]
    assert budget["min_retry_concurrency"] >= 32
    # With several replicas, one that cannot be reached at all is ejected at its first such failure;
    # a lone replica is left to its health checks.
    assert "consecutive_local_origin_failure" not in ingress["router"]["outlier_detection"]
    two = static_cluster("router", [("127.0.0.1", 1), ("127.0.0.1", 2)], health_check=True)
    assert two["outlier_detection"]["consecutive_local_origin_failure"] == 1
    assert two["outlier_detection"]["enforcing_consecutive_5xx"] == 100, "of two, one answering errors is ejected"


def test_no_replica_is_ejected_for_its_answers_where_that_would_leave_none_or_undo_load_shedding(rendered):
    """A lone replica answering 5xx was ejected, and every request then got "no healthy upstream"
    (one malformed header did it to the router); a router's 503 sheds load on purpose."""
    _, configs, _ = rendered
    lone = {c["name"]: c for c in configs["sidecar-router-0"]["static_resources"]["clusters"]}["control"]
    assert lone["outlier_detection"]["enforcing_consecutive_5xx"] == 0
    assert lone["outlier_detection"]["enforcing_consecutive_gateway_failure"] == 0
    routers = [("127.0.0.1", 1), ("127.0.0.1", 2)]
    at_ingress = static_cluster("router", routers, health_check=True, eject_on_answers=False)
    assert at_ingress["outlier_detection"]["enforcing_consecutive_5xx"] == 0
    assert at_ingress["outlier_detection"]["enforcing_consecutive_local_origin_failure"] == 100, "unreachable: ejected"


def routes_of(config: dict, listener: str) -> list[dict]:
    lis = next(x for x in config["static_resources"]["listeners"] if x["name"] == listener)
    return lis["filter_chains"][0]["filters"][0]["typed_config"]["route_config"]["virtual_hosts"][0]["routes"]


def test_requests_that_never_reached_a_replica_are_retried_on_another_and_no_others(rendered):
    """Between sidecars only a request that never reached an instance is retried; at the ingress
    also one whose router died before answering anything (no token streamed, nothing billed)."""
    _, configs, _ = rendered
    for config, listener, retry_on in (
        (configs["ingress-0"], "ingress", "connect-failure,refused-stream,reset,retriable-headers"),
        (configs["sidecar-router-0"], "outbound", "connect-failure,refused-stream,reset-before-request"),
    ):
        for r in routes_of(config, listener):
            if "route" not in r:
                continue
            policy = r["route"].get("retry_policy")
            if r["route"].get("cluster") == "workers" and listener == "outbound":
                # The router picked that worker and retries elsewhere itself, before the first token.
                assert policy is None
                continue
            assert policy["retry_on"] == retry_on, r
            assert policy["retry_host_predicate"][0]["name"] == "envoy.retry_host_predicates.previous_hosts"
    # ... which includes the router's sidecar answering for a router that died (its own reply, marked).
    hcm = _inbound_chain(configs["sidecar-router-0"])["filters"][0]["typed_config"]
    mapper = hcm["local_reply_config"]["mappers"][0]
    assert set(mapper["filter"]["response_flag_filter"]["flags"]) == {"UF", "UC", "UH"}
    assert mapper["headers_to_add"][0]["header"]["key"] == "x-gaas-unreached"
    ingress_route = routes_of(configs["ingress-0"], "ingress")[0]["route"]["retry_policy"]
    assert ingress_route["retriable_headers"] == [{"name": "x-gaas-unreached", "present_match": True}]


def _inbound_chain(cfg):
    return next(x for x in cfg["static_resources"]["listeners"] if x["name"] == "inbound")["filter_chains"][0]


def _policies(cfg):
    hcm = _inbound_chain(cfg)["filters"][0]["typed_config"]
    rbac = next(f for f in hcm["http_filters"] if f["name"] == "envoy.filters.http.rbac")["typed_config"]
    assert rbac["rules"]["action"] == "ALLOW"
    return rbac["rules"]["policies"]


def _allowed(policies, path: str) -> set[str]:
    """The identity prefixes Envoy's RBAC lets call path."""
    out = set()
    for p in policies.values():
        for perm in p["permissions"]:
            m = perm["url_path"]["path"]
            if m.get("exact") == path or ("prefix" in m and path.startswith(m["prefix"])):
                out |= {pr["authenticated"]["principal_name"]["prefix"] for pr in p["principals"]}
    return out


def test_every_inbound_listener_wants_a_mesh_certificate_and_says_who_called(rendered):
    _, configs, _ = rendered
    for name, cfg in configs.items():
        if name.startswith("ingress-"):
            continue
        tls = _inbound_chain(cfg)["transport_socket"]["typed_config"]
        assert tls["require_client_certificate"] is True, name
        assert tls["common_tls_context"]["validation_context"]["trusted_ca"]["filename"].endswith("ca.crt")
        hcm = _inbound_chain(cfg)["filters"][0]["typed_config"]
        # What a caller claims is replaced by what the sidecar verified.
        assert hcm["forward_client_cert_details"] == "SANITIZE_SET" and hcm["set_current_client_cert_details"]["uri"]


def test_each_method_is_open_only_to_the_callers_it_needs(rendered):
    _, configs, _ = rendered
    S = "spiffe://gaas.local/"
    control = _policies(configs["sidecar-control-0"])
    assert _allowed(control, "/gaas.v1.Control/RegisterWorker") == {S + "worker/"}
    assert _allowed(control, "/gaas.v1.Control/CreateApiKey") == {S + "operator/"}
    assert _allowed(control, "/gaas.v1.Control/Authenticate") == {S + "router/", S + "operator/"}
    # The workers' endpoints go to every Envoy that reaches workers, and to no other caller.
    assert _allowed(control, "/envoy.service.discovery.v3.AggregatedDiscoveryService/StreamAggregatedResources") == {
        S + k + "/" for k in ("ingress", "router", "kvcache", "worker")}
    assert _allowed(control, "/gaas.v1.Control/ListWorkers") == {S + "router/", S + "kvcache/", S + "operator/"}
    assert _allowed(control, "/gaas.v1.Control/NoSuchMethod") == set()
    assert _allowed(control, "/grpc.health.v1.Health/Check") == {S}
    worker = _policies(configs["sidecar-worker-0"])
    assert _allowed(worker, "/gaas.v1.Worker/Generate") == {S + "router/"}
    assert _allowed(worker, "/gaas.v1.Worker/WatchKVEvents") == {S + "kvcache/"}
    kv = _policies(configs["sidecar-kvcache-0"])
    assert _allowed(kv, "/gaas.v1.KVCache/Lookup") == {S + "router/"}
    router = _policies(configs["sidecar-router-0"])
    assert _allowed(router, "/gaas.v1.OpenAI/Completions") == {S + "ingress/"}
    assert _allowed(router, "/gaas.v1.Router/GetFlowStatus") == {S + "operator/"}
    billing = _policies(configs["sidecar-billing-0"])
    assert _allowed(billing, "/gaas.v1.Billing/GetUsage") == {S + "router/", S + "operator/"}
    assert _allowed(billing, "/gaas.v1.Billing/SetBudget") == {S + "operator/"}


def test_every_hop_between_envoys_checks_the_peer_kind(rendered):
    topo, configs, _ = rendered
    clusters = _clusters(configs["sidecar-router-0"])
    for name, kind in [("control", "control"), ("kvcache", "kvcache"), ("billing", "billing"),
                       ("workers", "worker"), ("xds", "control")]:
        tls = clusters[name]["transport_socket"]["typed_config"]
        sans = tls["common_tls_context"]["validation_context"]["match_typed_subject_alt_names"]
        assert sans == [{"san_type": "URI", "matcher": {"prefix": f"spiffe://gaas.local/{kind}/"}}], name
        assert tls["common_tls_context"]["tls_certificates"][0]["certificate_chain"]["filename"].endswith("router.router-0.crt")
    assert "transport_socket" not in clusters["local_service"]
    ingress = _clusters(configs["ingress-0"])["router"]["transport_socket"]["typed_config"]
    assert ingress["common_tls_context"]["tls_certificates"][0]["certificate_chain"]["filename"].endswith("ingress.ingress-0.crt")


def test_the_ingress_serves_tls_with_the_given_certificate(tmp_path):
    topo = topology.load(ROOT / "deploy" / "topology.yaml", env={})
    authority = pki.Authority(tmp_path)
    cfg = envoyconf.ingress_config(topo, protogen.DESCRIPTOR_SET, tmp_path, authority,
                                   tls=(tmp_path / "edge.crt", tmp_path / "edge.key"))
    tls = cfg["static_resources"]["listeners"][0]["filter_chains"][0]["transport_socket"]["typed_config"]
    ctx = tls["common_tls_context"]
    assert ctx["tls_certificates"][0]["certificate_chain"]["filename"] == str(tmp_path / "edge.crt")
    assert ctx["alpn_protocols"] == ["h2", "http/1.1"] and "require_client_certificate" not in tls
    plain = envoyconf.ingress_config(topo, protogen.DESCRIPTOR_SET, tmp_path, authority)
    assert "transport_socket" not in plain["static_resources"]["listeners"][0]["filter_chains"][0]


@pytest.fixture(scope="module")
def rendered_direct(tmp_path_factory):
    return _render(tmp_path_factory.mktemp("envoy-direct"), "direct")


def test_direct_path_configs_are_valid_envoy(rendered_direct):
    test_configs_are_valid_envoy(rendered_direct)


def test_direct_ingress_asks_the_router_and_routes_generations_to_the_named_worker(rendered_direct):
    topo, configs, _ = rendered_direct
    assert topo.ingress_path == "direct"
    listener = configs["ingress-0"]["static_resources"]["listeners"][0]
    hcm = listener["filter_chains"][0]["filters"][0]["typed_config"]
    names = [f["name"] for f in hcm["http_filters"]]
    # The router reads an OpenAI route's HTTP request before the transcoder (its JSON, the key
    # checked on its headers before anything reads the body) and the rest transcoded (gRPC).
    transcoder = names.index("envoy.filters.http.grpc_json_transcoder")
    assert names.index("gaas.decision.openai") < transcoder < names.index("envoy.filters.http.ext_proc")
    filters = {f["name"]: f["typed_config"] for f in hcm["http_filters"]}
    assert {**filters["gaas.decision.openai"], "failure_mode_allow": True} == filters["envoy.filters.http.ext_proc"]
    ext_proc = filters["envoy.filters.http.ext_proc"]
    assert ext_proc["grpc_service"]["envoy_grpc"]["cluster_name"] == "router"
    mode = ext_proc["processing_mode"]
    # Nothing of the response passes through the router: not the tokens, nor the trailers.
    assert mode["response_body_mode"] == "NONE" and mode["response_trailer_mode"] == "SKIP"
    assert mode["request_body_mode"] == "FULL_DUPLEX_STREAMED"
    # A failed decision call lets the request take the routers' own route (retried on another
    # router there), never a worker's: only the router's answer names one.
    assert ext_proc["failure_mode_allow"] is True
    # With no router up that route's 503 gets a body the error filter turns into OpenAI's shape with a
    # Retry-After: UNAVAILABLE with a reason and a retry delay, as a router's own refusal reads.
    [mapper] = [m for m in hcm["local_reply_config"]["mappers"]
                if "xds.cluster_name == 'router'" in m["filter"]["extension_filter"]["typed_config"]["expression"]]
    body = json.loads(mapper["body"]["inline_string"])
    assert body["code"] == grpc.StatusCode.UNAVAILABLE.value[0] and body["message"]
    assert {d["@type"].rsplit(".", 1)[-1] for d in body["details"]} == {"ErrorInfo", "RetryInfo"}
    routes = _routes(listener)["routes"]
    to_workers = [r for r in routes if r.get("route", {}).get("cluster") == "workers"]
    assert {r["match"]["path"] for r in to_workers} == DECIDED
    assert all(r["match"]["headers"] == [{"name": "x-gaas-worker", "present_match": True}] for r in to_workers)
    # A request no worker answered, or one refused as not taken (x-gaas-unreached), goes to the router's
    # second choice, once; never after an answer began, nor on a failure's status alone (a
    # non-streamed answer's work may be done).
    retry = to_workers[0]["route"]["retry_policy"]
    assert retry["num_retries"] == 1 and "reset" in retry["retry_on"] and "unavailable" not in retry["retry_on"]
    assert retry["retriable_headers"] == [{"name": "x-gaas-unreached", "present_match": True}]
    # The router is asked about those only, and checks their keys then: no key check of the
    # ingress's own on them (one call to a router per request), as on every other route.
    def off(route, name):
        return route.get("typed_per_filter_config", {}).get(name, {}).get("disabled", False)

    asked = [r for r in routes if not off(r, "envoy.filters.http.ext_proc")]
    assert {r["match"].get("path") or r["match"]["prefix"] for r in asked} == DECIDED
    assert all("x-gaas-worker" not in str(r["match"]) for r in asked)  # (once sent to a worker: not again)
    asked_http = [r for r in routes if not off(r, "gaas.decision.openai")]
    assert {r["match"]["path"] for r in asked_http} == {"/v1/completions", "/v1/chat/completions", "/v1/embeddings"}
    # Untranscoded, such a request reaches nothing: only its transcoded form is routed.
    assert all(r["direct_response"]["status"] == 404 and "route" not in r for r in asked_http)
    assert [r for r in routes if off(r, "envoy.filters.http.ext_authz")] == [r for r in routes if r in asked + asked_http + to_workers]
    # The ingress can reach exactly the mesh's workers' sidecars, as the ingress identity, in the
    # order the router names them.
    # (The workers are those control says have registered.)
    _takes_workers_from_control(configs["ingress-0"], topo)
    tls = _clusters(configs["ingress-0"])["workers"]["transport_socket"]["typed_config"]
    assert tls["common_tls_context"]["tls_certificates"][0]["certificate_chain"]["filename"].endswith("ingress.ingress-0.crt")


def test_direct_path_lets_the_ingress_call_only_what_it_needs(rendered, rendered_direct):
    def ingress_paths(configs, instance):
        listener = configs[f"sidecar-{instance}"]["static_resources"]["listeners"][0]
        hcm = listener["filter_chains"][0]["filters"][0]["typed_config"]
        rbac = {f["name"]: f["typed_config"] for f in hcm["http_filters"]}["envoy.filters.http.rbac"]
        policy = rbac["rules"]["policies"].get("ingress-calls", {"permissions": []})
        return {next(iter(p["url_path"]["path"].values())) for p in policy["permissions"]}

    _, direct, _ = rendered_direct
    _, routed, _ = rendered
    assert ingress_paths(direct, "worker-0") == DECIDED
    assert ingress_paths(routed, "worker-0") == set()
    assert "/envoy.service.ext_proc.v3.ExternalProcessor/Process" in ingress_paths(direct, "router-0")
    assert "/envoy.service.ext_proc.v3.ExternalProcessor/Process" not in ingress_paths(routed, "router-0")


def _ingress_hcm(configs):
    listener = configs["ingress-0"]["static_resources"]["listeners"][0]
    return listener, listener["filter_chains"][0]["filters"][0]["typed_config"]


@pytest.mark.parametrize("path", ["router", "direct"])
def test_the_ingress_checks_the_key_on_the_headers_before_it_reads_a_body(rendered, rendered_direct, path):
    topo, configs, _ = rendered if path == "router" else rendered_direct
    _, hcm = _ingress_hcm(configs)
    names = [f["name"] for f in hcm["http_filters"]]
    # Before the transcoder, which reads the whole body (and before the direct path's decision).
    assert names.index("envoy.filters.http.ext_authz") < names.index("envoy.filters.http.grpc_json_transcoder")
    authz = {f["name"]: f["typed_config"] for f in hcm["http_filters"]}["envoy.filters.http.ext_authz"]
    assert "with_request_body" not in authz and authz["failure_mode_allow"] is False
    assert authz["status_on_error"] == {"code": "ServiceUnavailable"}, "no router answering is a 503, never a pass"
    assert {p["exact"] for p in authz["allowed_headers"]["patterns"]} == {"authorization", "content-type",
                                                                          edge.CLIENT_ADDRESS_HEADER}
    # The checks have a budget of their own, apart from the authenticated streams to the routers.
    clusters = _clusters(configs["ingress-0"])
    checks = clusters[authz["grpc_service"]["envoy_grpc"]["cluster_name"]]
    streams = clusters["router"]
    assert checks["name"] != "router"
    assert checks["load_assignment"]["endpoints"] == streams["load_assignment"]["endpoints"], "the same routers"
    assert checks["circuit_breakers"]["thresholds"][0]["max_requests"] == edge.AUTHZ_CHECKS
    assert streams["circuit_breakers"]["thresholds"][0]["max_requests"] == edge.ROUTER_STREAMS
    # No router answering the check is a 503 with a body the error filter gives OpenAI's shape.
    assert any("ext_authz_error" in m["filter"]["extension_filter"]["typed_config"]["expression"]
               for m in hcm["local_reply_config"]["mappers"])
    # The router's sidecar lets only the ingress ask.
    router = _policies(configs["sidecar-router-0"])
    assert _allowed(router, "/envoy.service.auth.v3.Authorization/Check") == {"spiffe://gaas.local/ingress/"}


def test_the_ingress_is_configured_as_an_edge_proxy(rendered):
    _, configs, _ = rendered
    listener, hcm = _ingress_hcm(configs)
    assert hcm["use_remote_address"] is True, "a client's x-forwarded-for and x-envoy-* headers are not believed"
    assert hcm["normalize_path"] and hcm["merge_slashes"]
    assert hcm["request_headers_timeout"] == f"{edge.REQUEST_HEADERS_TIMEOUT_S}s"
    assert hcm["request_timeout"] == f"{edge.REQUEST_TIMEOUT_S}s"
    assert hcm["common_http_protocol_options"]["headers_with_underscores_action"] == "REJECT_REQUEST"
    assert hcm["http2_protocol_options"]["max_concurrent_streams"] == edge.MAX_STREAMS_PER_CONNECTION
    assert listener["per_connection_buffer_limit_bytes"] == edge.CONNECTION_BUFFER_BYTES
    transcoder = {f["name"]: f["typed_config"] for f in hcm["http_filters"]}["envoy.filters.http.grpc_json_transcoder"]
    assert edge.MAX_BODY_BYTES < transcoder["max_request_body_size"] <= edge.MAX_BODY_BYTES + 64 * edge.KIB
    overload = configs["ingress-0"]["overload_manager"]
    monitors = {m["name"]: m["typed_config"] for m in overload["resource_monitors"]}
    assert monitors["envoy.resource_monitors.global_downstream_max_connections"][
        "max_active_downstream_connections"] == edge.MAX_CONNECTIONS
    assert {a["name"] for a in overload["actions"]} >= {"envoy.overload_actions.stop_accepting_requests"}


def test_every_envoy_lets_a_stream_be_silent_longer_than_a_generation_may_run(rendered):
    _, configs, _ = rendered
    for name, cfg in configs.items():
        for listener in cfg["static_resources"]["listeners"]:
            hcm = listener["filter_chains"][0]["filters"][0]["typed_config"]
            if hcm.get("stat_prefix") == "envoy_stats":
                continue
            assert int(hcm["stream_idle_timeout"].rstrip("s")) > edge.MAX_STREAM_SECONDS, (name, listener["name"])


def test_the_access_table_names_only_methods_its_services_have():
    from google.protobuf import descriptor_pool

    from gaas.ops import access

    access.method_paths("worker")  # fills the descriptor pool
    for kind, methods in access.ALLOWED_CALLERS.items():
        if kind == "router":
            assert set(methods) == {"*"}, "the router's public APIs are open whole, to the ingress"
            continue
        service = descriptor_pool.Default().FindServiceByName(GRPC_SERVICE[kind])
        assert set(methods) <= {m.name for m in service.methods}, kind


def test_every_stream_a_dying_worker_refuses_untaken_may_be_retried_at_its_second_choice_at_once(rendered_direct):
    """A worker whose engine dies refuses every stream it holds that had no token yet (untaken): each
    goes to its second choice at once. Envoy's default circuit breaker (3 retries in flight per
    cluster, 1,024 requests) answered the 4th 503 UO; the workers' cluster has a retry budget of
    every request and no cap below the routers' admission."""
    _, configs, _ = rendered_direct
    [workers] = [c for c in configs["ingress-0"]["static_resources"]["clusters"] if c["name"] == "workers"]
    [t] = workers["circuit_breakers"]["thresholds"]
    assert t["retry_budget"]["budget_percent"]["value"] == 100.0 and t["retry_budget"]["min_retry_concurrency"] >= 64
    assert min(t["max_requests"], t["max_pending_requests"], t["max_connections"]) >= 1 << 16
