"""Each service's settings (gaas/settings): every variable declared once with its default and help,
read with errors that name it, written back by to_env, described in --help and docs/configuration.md."""

from __future__ import annotations

import pytest

from gaas.settings import docs
from gaas.settings.env import ConfigError, env_of, to_env, variables
from gaas.settings.router import RouterSettings
from gaas.settings.services import SETTINGS
from gaas.settings.worker import WorkerSettings, from_topology, topology_defaults
from tests.conftest import ROOT

# What each service needs set (its required settings).
REQUIRED = {
    "control": {},
    "kvcache": {"GAAS_OUTBOUND": "unix:/o"},
    "billing": {},
    "worker": {"GAAS_MODEL": "m", "GAAS_MODEL_PATH": "/m"},
    "router": {"GAAS_OUTBOUND": "unix:/o"},
}

BASE = {"GAAS_HOST": "127.0.0.1", "GAAS_LISTEN": "", "GAAS_METRICS_PORT": "-1", "GAAS_GRACE_SECONDS": "10.0"}
# Every variable each service reads, with its default (what the services read before gaas/settings
# declared them: a changed default is a changed service).
DEFAULTS = {
    "control": {**BASE, "GAAS_INSTANCE": "control-0", "GAAS_PORT": "50051",
                "GAAS_REDIS_URL": "redis://127.0.0.1:6379/0", "GAAS_DATABASE_URL": "sqlite:///.gaas/control.db",
                "GAAS_DEPLOY_FILE": "", "GAAS_LEASE_TTL": "10"},
    "kvcache": {**BASE, "GAAS_INSTANCE": "kvcache-0", "GAAS_PORT": "50081", "GAAS_OUTBOUND": "unix:/o",
                "GAAS_KV_POLL_SECONDS": "1.0", "GAAS_KV_PROVISION_TTL": "30.0"},
    "billing": {**BASE, "GAAS_INSTANCE": "billing-0", "GAAS_PORT": "50091",
                "GAAS_BILLING_DATABASE_URL": "sqlite:///.gaas/billing.db", "GAAS_REDIS_URL": "redis://127.0.0.1:6379/0",
                "GAAS_OUTBOUND": "", "GAAS_DEPLOY_FILE": "", "GAAS_FILES_DIR": ".gaas/files", "GAAS_STRIPE_API_KEY": "",
                "GAAS_STRIPE_API_BASE": "https://api.stripe.com", "GAAS_STRIPE_WINDOW_SECONDS": "3600.0",
                "GAAS_STRIPE_GRACE_SECONDS": "120.0", "GAAS_STRIPE_RATE": "100"},
    "worker": {**BASE, "GAAS_INSTANCE": "worker-0", "GAAS_PORT": "50061", "GAAS_ADVERTISE": "127.0.0.1:50061",
               "GAAS_HTTP_LISTEN": "127.0.0.1:50067", "GAAS_OUTBOUND": "", "GAAS_MODEL": "m", "GAAS_MODEL_PATH": "/m", "GAAS_MODEL_VERSION": "0",
               "GAAS_MAX_MODEL_LEN": "2048", "GAAS_BLOCK_SIZE": "32", "GAAS_KV_CACHE_GIB": "1",
               "GAAS_GPU_MEMORY_UTILIZATION": "0.85", "GAAS_ENFORCE_EAGER": "auto", "GAAS_DEVICE": "",
               "GAAS_MAX_NUM_SEQS": "64", "GAAS_MAX_NUM_BATCHED_TOKENS": "0", "GAAS_MAX_WAITING": "128", "GAAS_HANDOVER_SECONDS": "2.0", "GAAS_RETIRE_GRACE_SECONDS": "600.0",
               "GAAS_STREAM_INTERVAL": "1", "GAAS_EXECUTOR": "uni", "GAAS_KV_CACHE_BLOCKS": "0",
               "GAAS_MAX_LORAS": "0", "GAAS_MAX_LORA_RANK": "16", "GAAS_MAX_CPU_LORAS": "0",
               "GAAS_TOOL_PARSER": "", "GAAS_TASK": "generate", "GAAS_KV_EVENTS": "true", "GAAS_WARMUP_REQUESTS": "2", "GAAS_LEASE_RENEW_SECONDS": "0.5", "GAAS_REDIS_URL": "",
               "GAAS_SPOOL_DIR": ".gaas/spool"},
    "router": {**BASE, "GAAS_INSTANCE": "router-0", "GAAS_PORT": "50071", "GAAS_HTTP_LISTEN": "127.0.0.1:50077",
               "GAAS_OUTBOUND": "unix:/o",
               "GAAS_ROUTER_POLICY": "kv_aware", "GAAS_ROUTER_WEIGHTS": "", "GAAS_REGISTRY_REFRESH_SECONDS": "0.5",
               "GAAS_ROUTER_RETRIES": "2", "GAAS_ROUTER_STREAM_MOVES": "2", "GAAS_QOS": "on",
               "GAAS_QUEUE_MAX": "256", "GAAS_WINDOW_INITIAL": "8", "GAAS_WINDOW_MIN": "4", "GAAS_WINDOW_MAX": "64",
               "GAAS_BREAKER_COOLDOWN_SECONDS": "5.0", "GAAS_DEPLOY_FILE": "", "GAAS_MAX_STREAM_SECONDS": "600.0",
               "GAAS_AUTH_CACHE_SECONDS": "2.0", "GAAS_MAX_STALE_SECONDS": "60.0", "GAAS_MAX_BODY_BYTES": "1048576",
               "GAAS_BATCH_CONCURRENCY": "8", "GAAS_COALESCE_PER_STEP": "2", "GAAS_COALESCE_MAX": "8", "GAAS_REDIS_URL": "redis://127.0.0.1:6379/0",
               "GAAS_SPOOL_DIR": ".gaas/spool"},
}


@pytest.mark.parametrize("service", SETTINGS)
def test_every_variable_and_its_default(service):
    cls = SETTINGS[service]
    names = [v.name for v in variables(cls)]
    assert len(names) == len(set(names)) and all(n.startswith("GAAS_") for n in names)
    assert all(v.var.help for v in variables(cls))
    assert to_env(cls.from_env(REQUIRED[service])) == DEFAULTS[service]


@pytest.mark.parametrize("service", SETTINGS)
def test_what_to_env_writes_from_env_reads_back(service):
    cls = SETTINGS[service]
    s = cls.from_env(REQUIRED[service])
    assert cls.from_env(to_env(s)) == s
    # and a variable set to something else than its default comes back as set
    changed = {"GAAS_PORT": "41000", "GAAS_GRACE_SECONDS": "2.5", "GAAS_LISTEN": "unix:/tmp/x.sock"}
    s = cls.from_env({**REQUIRED[service], **changed})
    assert {k: to_env(s)[k] for k in changed} == changed


def test_unset_or_empty_takes_the_default_and_required_ones_are_named():
    assert RouterSettings.from_env({"GAAS_OUTBOUND": "o", "GAAS_QUEUE_MAX": ""}).max_waiting == 256
    assert WorkerSettings.from_env({**REQUIRED["worker"], "GAAS_HOST": "h", "GAAS_PORT": "7"}).advertise == "h:7"
    # A worker's or a router's HTTP front: beside its gRPC socket, or six ports above its gRPC port.
    for service in ("worker", "router"):
        cls = SETTINGS[service]
        assert cls.from_env({**REQUIRED[service], "GAAS_HOST": "h", "GAAS_PORT": "7"}).http_listen == "h:13"
        assert cls.from_env({**REQUIRED[service], "GAAS_LISTEN": "unix:/run/w/service.sock"}).http_listen \
            == "unix:/run/w/http.sock"
    for service, env in REQUIRED.items():
        for name in env:
            with pytest.raises(ConfigError, match=f"^{name} is required$"):
                SETTINGS[service].from_env({k: v for k, v in env.items() if k != name})


@pytest.mark.parametrize("service, name, text, message", [
    ("router", "GAAS_PORT", "x", "GAAS_PORT must be an integer, got 'x'"),
    ("router", "GAAS_GRACE_SECONDS", "soon", "GAAS_GRACE_SECONDS must be a number, got 'soon'"),
    ("router", "GAAS_LISTEN", "/tmp/s", "GAAS_LISTEN must be unix:/path/to/socket, got '/tmp/s'"),
    ("router", "GAAS_ROUTER_POLICY", "fastest",
     "GAAS_ROUTER_POLICY must be one of round_robin, least_load, kv_aware, got 'fastest'"),
    ("router", "GAAS_ROUTER_WEIGHTS", "=1", "GAAS_ROUTER_WEIGHTS: a weight is written name=number, got '=1'"),
    ("router", "GAAS_ROUTER_WEIGHTS", "queue=lots", "GAAS_ROUTER_WEIGHTS: the weight of queue must be a number, got 'lots'"),
    ("router", "GAAS_QOS", "maybe", "GAAS_QOS must be on or off, got 'maybe'"),
    ("worker", "GAAS_KV_EVENTS", "maybe", "GAAS_KV_EVENTS must be true or false, got 'maybe'"),
    ("worker", "GAAS_ENFORCE_EAGER", "sometimes", "GAAS_ENFORCE_EAGER must be true or false, got 'sometimes'"),
    ("worker", "GAAS_BLOCK_SIZE", "24", "GAAS_BLOCK_SIZE must be a multiple of 16 (32 on the CPU), got 24"),
    ("worker", "GAAS_KV_CACHE_GIB", "0", "GAAS_KV_CACHE_GIB must be at least 1"),
    ("worker", "GAAS_STREAM_INTERVAL", "0", "GAAS_STREAM_INTERVAL must be at least 1 (tokens per message), got 0"),
    ("worker", "GAAS_EXECUTOR", "ray", "GAAS_EXECUTOR must be one of uni, mp, got 'ray'"),
    ("worker", "GAAS_DEVICE", "tpu", "GAAS_DEVICE must be cpu or cuda, got 'tpu'"),
    ("worker", "GAAS_GPU_MEMORY_UTILIZATION", "1.5", "GAAS_GPU_MEMORY_UTILIZATION must be in (0, 1], got 1.5"),
])
def test_errors_name_the_variable(service, name, text, message):
    with pytest.raises(ConfigError) as exc:
        SETTINGS[service].from_env({**REQUIRED[service], name: text})
    assert str(exc.value) == message


def test_typed_values():
    r = RouterSettings.from_env({"GAAS_OUTBOUND": "o", "GAAS_ROUTER_WEIGHTS": "prefix=3, queue=2", "GAAS_QOS": "OFF"})
    assert r.weights == {"prefix": 3.0, "queue": 2.0} and r.qos is False
    assert RouterSettings.from_env(to_env(r)) == r
    w = WorkerSettings.from_env({**REQUIRED["worker"], "GAAS_ENFORCE_EAGER": "false", "GAAS_KV_EVENTS": "no"})
    assert w.enforce_eager is False and w.kv_events is False
    assert WorkerSettings.from_env(REQUIRED["worker"]).enforce_eager is None  # auto: by the device


def test_env_of_writes_the_settings_named_and_refuses_others():
    assert env_of(WorkerSettings, port=41000, enforce_eager=None, kv_events=False) == {
        "GAAS_PORT": "41000", "GAAS_ENFORCE_EAGER": "auto", "GAAS_KV_EVENTS": "false"}
    with pytest.raises(TypeError, match="no setting advertise"):
        env_of(RouterSettings, advertise="x")


def test_the_topology_options_are_worker_settings_of_the_same_defaults():
    from gaas.ops import topology

    assert topology.WORKER_DEFAULTS == topology_defaults()
    assert from_topology(topology.WORKER_DEFAULTS)["enforce_eager"] is None
    env = env_of(WorkerSettings, **from_topology({**topology.WORKER_DEFAULTS, "enforce_eager": True}))
    assert WorkerSettings.from_env({**REQUIRED["worker"], **env}).enforce_eager is True


def test_the_names_services_and_settings_share_are_one_list():
    from gaas.host import placement
    from gaas.settings import worker

    assert placement.EXECUTORS == worker.EXECUTORS


@pytest.mark.parametrize("service", SETTINGS)
def test_help_names_every_variable(service):
    text = docs.help_epilog(service)
    assert all(v.name in text for v in variables(SETTINGS[service]))


def test_docs_configuration_holds_the_generated_table():
    path = ROOT / "docs" / "configuration.md"
    if not path.exists():
        pytest.skip("docs/configuration.md is not written yet: once it is, its <!-- settings:begin --> ... "
                    "<!-- settings:end --> block must hold `python -m gaas.settings.docs`'s table")
    block = docs.block(path.read_text())
    assert block is not None, (f"docs/configuration.md has no {docs.BEGIN} ... {docs.END} block for the settings "
                               "table: add the two markers, then `python -m gaas.settings.docs --write "
                               "docs/configuration.md` fills it")
    assert block.strip() == docs.markdown().strip(), (
        "docs/configuration.md's settings table differs from the settings the services read: "
        "`python -m gaas.settings.docs --write docs/configuration.md` rewrites it")


def test_one_setting_read_alone_as_its_service_reads_it():
    from gaas.settings.env import value_from_env

    assert value_from_env(WorkerSettings, "gpu_memory_utilization", {}) == 0.85
    assert value_from_env(RouterSettings, "max_body_bytes", {"GAAS_MAX_BODY_BYTES": "2048"}) == 2048
    with pytest.raises(ConfigError, match="GAAS_GPU_MEMORY_UTILIZATION must be in"):
        value_from_env(WorkerSettings, "gpu_memory_utilization", {"GAAS_GPU_MEMORY_UTILIZATION": "2"})
    with pytest.raises(TypeError, match="no setting speed"):
        value_from_env(RouterSettings, "speed", {})
