"""Running the whole mesh on one machine: Redis (when none answers), every service instance of
the topology, an Envoy sidecar per instance and the ingress's Envoys. What `gaas up` does.

Beside it in gaas/launcher: the processes it runs and what a killed one left (children.py), the
run directory and ports (rundir.py), Redis and each process's secrets (secrets.py), the rolling
restart (supervisor.py).
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from urllib.parse import urlparse

from gaas.envoy import config as envoyconf
from gaas.envoy.binary import ENVOY_ARGS
from gaas.launcher import fleet, ingress
from gaas.launcher.children import (
    RESTART_BACKOFF_MAX, RESTART_STABLE_SECONDS, Child, child_launch, signal_group, start_ticks, stop_leftovers,
)
from gaas.launcher.errors import MeshError
from gaas.launcher.rundir import STATE_FILE, port_in_use
from gaas.launcher.secrets import (
    BARE_ENV, REDIS_CLIENTS, REDIS_PASSWORD_FILE, SECRETS, private_secret, redis_answers, redis_server_command,
    with_password, without_secrets,
)
from gaas.ops import pki, probe, promconf, protogen, redisacl
from gaas.ops.serviceenv import Placement, placed_values
from gaas.settings import deployspec
from gaas.settings import worker as worker_settings
from gaas.settings.env import env_of, value_from_env, variables
from gaas.settings.services import SETTINGS as SERVICE_SETTINGS
from gaas.model.build import build_model, check_source, is_built, refresh_chat_template
from gaas.host import placement
from gaas.host.devices import visible_gpus
from gaas.ops.topology import Instance, LocalSockets, Topology, TopologyError, sockets_root, with_workers
from gaas.ops.traces import TRACES_FILE, TraceTarget

ROOT = Path(__file__).resolve().parents[2]

# Start order of the services (control first: the others register with or read it).
SERVICE_MODULES = {
    "control": "services.control.server",
    "kvcache": "services.kvcache.server",
    "billing": "services.billing.server",
    "worker": "services.worker.server",
    "router": "services.router.server",
}


# How long stopping the mesh waits for requests in flight through the ingress.
INGRESS_DRAIN_SECONDS = 20.0
# How often the workers are matched with the deployment's pools.
RECONCILE_SECONDS = 1.0


class Mesh:
    def __init__(
        self,
        topo: Topology,
        *,
        run_dir: Path,
        deploy_file: Path,
        redis_url: str,
        progress: Callable[[str], None] = lambda msg: None,
        extra_env: dict[str, str] | None = None,
        topology_file: Path | None = None,
        ingress_tls: tuple[Path, Path] | None = None,
        trace: TraceTarget | None = None,
        trace_sink: bool = False,
        serve_model: str | None = None,
    ) -> None:
        # The workers are the deployment's (control's pools, reconciled once control answers).
        self.topo = with_workers(topo, [])
        # Where every service and Envoy sends its spans (None: no tracing); trace_sink: run the
        # local collector (gaas.ops.tracesink) there, writing traces_file.
        self.trace = trace
        self.trace_sink = trace_sink
        # The certificate and key the ingress serves TLS with (None: plaintext).
        self.ingress_tls = ingress_tls
        self.run_dir = Path(run_dir).resolve()
        self.deploy_file = Path(deploy_file).resolve()
        self.redis_url = redis_url
        self.progress = progress
        self.extra_env = dict(extra_env or {})
        # The file the topology came from (recorded, so `gaas status` describes this mesh).
        self.topology_file = topology_file
        self.children: list[Child] = []
        # The ACL user of each service kind in the Redis gaas starts (none: a Redis run by the
        # operator, used as given).
        self.redis_users: dict[str, redisacl.ServiceUser] = {}
        self.log_dir = self.run_dir / "logs"
        self.sockets = sockets_root(self.run_dir)
        self.spec = deployspec.load(self.deploy_file)
        # `gaas up --model NAME`: that model served (auto workers) instead of the file's (the
        # effective file, written to the run directory, is what control applies).
        self.serve_model = serve_model
        if serve_model:
            self.spec.model(serve_model)  # an unknown model is refused here, with the deployment's names
        # The GPUs this host lets us use (gaas.host.devices): a worker on each, by UUID (workers
        # beyond their number share, splitting the memory); none: CPU workers, one per core.
        self.gpus = visible_gpus()
        # This host's devices as placement sees them (read on first use).
        self._profiles = None
        self._stopping = False
        # The workers told to drain (their pool shrank or went), by name; the pools' last answer;
        # models being built for a pool, and the pools this host cannot run (said to control once).
        self._retiring: set[str] = set()
        self._pools_version = ""
        self._builds: dict[str, threading.Thread] = {}
        self._build_errors: dict[str, str] = {}
        self._refused: set[tuple[str, str]] = set()
        self._control = None
        self._authority: pki.Authority | None = None
        self._last_reconcile = 0.0

    # ----------------------------------------------------------------- start

    def start(self) -> None:
        # Everything the mesh writes (databases, keys, the Redis password, logs) is its owner's alone.
        os.umask(0o077)
        self.log_dir.mkdir(parents=True, exist_ok=True)
        stop_leftovers(self.run_dir, self.progress)
        self._raise_open_files()
        ports = self.topo.tcp_ports() + ([self.topo.trace_port] if self.trace_sink else [])
        busy = [p for p in ports if port_in_use(self.topo.host, p)]
        if busy:
            raise MeshError(
                f"port(s) {', '.join(map(str, busy[:5]))} on {self.topo.host} are in use: is another mesh running"
                " (`gaas status`)? Stop it, or pick other ports with --port-base / --ingress-port"
            )
        protogen.generate()
        if self.serve_model:
            self.deploy_file = self._serving_only(self.serve_model)
        self._ensure_redis()
        for name in (*self.topo.ingresses, *(i.name for i in self.topo.instances)):
            d = LocalSockets.of(self.sockets, name).dir
            d.mkdir(parents=True, exist_ok=True)
            os.chmod(d, 0o700)
        os.chmod(self.sockets, 0o700)
        authority = self._authority = pki.Authority(self.run_dir)
        pki.issue_certificates(self.topo, authority)
        configs = envoyconf.render(self.topo, self.run_dir / "envoy", protogen.DESCRIPTOR_SET, self.log_dir,
                                   authority, self.ingress_tls, self.sockets, self.trace)
        promconf.write(self.topo, self.run_dir / "prometheus.yml")
        if self.trace_sink and self.trace is not None:
            self._spawn("tracesink", "tracesink", [
                sys.executable, "-m", "gaas.ops.tracesink", "--listen", f"{self.trace.host}:{self.trace.port}",
                "--out", str(self.traces_file),
            ], {**without_secrets(dict(os.environ)), "PYTHONUNBUFFERED": "1"})
        for inst in self.topo.instances:
            self._spawn_service(inst)
        for name, path in configs.items():
            self._spawn_envoy(name, path)
        self._write_state()

    def _raise_open_files(self) -> None:
        """Every connection the ingress holds is a file descriptor, and a shell's soft limit is often
        1,024: raised, for what gaas starts, to what the ingress may hold (gaas.contracts.edge.MAX_CONNECTIONS,
        its upstream connections too) where the hard limit allows; said when it does not."""
        import resource

        from gaas.contracts import edge

        want = 2 * edge.MAX_CONNECTIONS + 1024
        soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        if soft >= want:
            return
        target = want if hard == resource.RLIM_INFINITY else min(want, hard)
        if target > soft:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
        if target < 8 * 1024:  # (a few thousand connections are enough not to mention it)
            self.progress(f"open files are limited to {target} (ulimit -Hn): the ingress holds at most about "
                          f"{target // 2} client connections (raise the hard limit for {edge.MAX_CONNECTIONS})")

    @property
    def served_models(self) -> list[str]:
        """The models the workers serve, the deployment's default first when it is among them."""
        names = sorted({str(w.options["model"]) for w in self.topo.of("worker")})
        default = self.spec.default_model.name
        return sorted(names, key=lambda n: n != default)

    @property
    def traces_file(self) -> Path:
        return self.run_dir / TRACES_FILE

    def _serving_only(self, name: str) -> Path:
        """The deployment file with model name served (its replicas auto, unless it has some) and
        every other model catalogued only; written to the run directory, sources made absolute."""
        import yaml

        doc = yaml.safe_load(self.deploy_file.read_text())
        for entry in doc["models"]:
            m = self.spec.model(entry["name"])
            entry["source"] = m.source
            if entry["name"] == name:
                if m.autoscale is None:  # (an autoscaled one keeps its bounds)
                    entry["replicas"] = m.replicas if m.serves else deployspec.AUTO
            else:
                entry.pop("autoscale", None)
                entry["replicas"] = 0
        path = self.run_dir / "deploy" / f"serving-{name}.yaml"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(f"# {self.deploy_file} as `gaas up --model {name}` applies it: {name} served, every other "
                        f"model catalogued only.\n" + yaml.safe_dump(doc, sort_keys=False))
        self.spec = deployspec.load(path)
        return path

    def _ensure_redis(self) -> None:
        if redis_answers(self.redis_url):
            self.progress(f"using Redis at {self.redis_url}")
            return
        u = urlparse(self.redis_url)
        host, port = u.hostname or "127.0.0.1", u.port or 6379
        if host not in ("127.0.0.1", "localhost", "::1"):
            raise MeshError(f"Redis at {self.redis_url} does not answer, and it is not local, so gaas cannot start it")
        self.progress(f"starting Redis on {host}:{port} (nothing answered at {self.redis_url})")
        # The Redis gaas starts asks for a password (made at first start, kept in the run directory).
        data = self.run_dir / "redis"
        data.mkdir(parents=True, exist_ok=True, mode=0o700)
        password = private_secret(self.run_dir / REDIS_PASSWORD_FILE)
        # The default user (that password) is the operator's; each service gets a user of its own.
        self.redis_users = redisacl.users()
        conf = data / "redis.conf"
        conf.unlink(missing_ok=True)
        fd = os.open(conf, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write("\n".join([f"requirepass {password}", *redisacl.config_lines(self.redis_users)]) + "\n")
        cmd = redis_server_command(host, port, data, durable=True, config=conf)
        self.redis_url = with_password(self.redis_url, password)
        self._spawn("redis", "redis", cmd, {k: os.environ[k] for k in BARE_ENV if k in os.environ})
        deadline = time.monotonic() + 10
        while not redis_answers(self.redis_url):
            if time.monotonic() > deadline or self.children[-1].proc.poll() is not None:
                raise MeshError(f"Redis did not start; see {self.children[-1].log}:\n{self.children[-1].tail()}")
            time.sleep(0.1)

    def _spawn(self, name: str, kind: str, cmd: list[str], env: dict[str, str], cpus: set[int] | None = None) -> Child:
        self._close_control()  # (no gRPC channel open across a fork)
        log = self.log_dir / f"{name}.log"
        with open(log, "ab") as out:
            out.write(f"\n=== {time.strftime('%Y-%m-%d %H:%M:%S')} {' '.join(cmd)}\n".encode())
            argv, setup = child_launch(cmd, cpus)
            proc = subprocess.Popen(
                argv,
                cwd=ROOT,
                env=env,
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=subprocess.STDOUT,
                start_new_session=True,  # its own process group: signalled as a whole at the end
                preexec_fn=setup,
            )
        child = Child(name, kind, proc, log, cmd=cmd, env=env, cpus=cpus)
        self.children.append(child)
        return child

    def _respawn(self, child: Child) -> None:
        """Start an exited child again in its place (same command, environment and log)."""
        signal_group(child.proc.pid, signal.SIGKILL)  # what the dead leader left behind (an engine's processes)
        self._close_control()  # (no gRPC channel open across a fork)
        with open(child.log, "ab") as out:
            out.write(f"\n=== {time.strftime('%Y-%m-%d %H:%M:%S')} restart {child.restarts + 1}: {' '.join(child.cmd)}\n".encode())
            argv, setup = child_launch(child.cmd, child.cpus)
            child.proc = subprocess.Popen(
                argv, cwd=ROOT, env=child.env, stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT,
                start_new_session=True, preexec_fn=setup,
            )
        child.started = time.monotonic()
        child.restarts += 1
        child.restart_at = 0.0

    def service_env(self, inst: Instance) -> dict[str, str]:
        """What a service process gets: this environment without the secrets (each secret only
        where its service needs it: SECRETS), its own Redis user, and the settings the mesh decides
        for it, written as its settings class (gaas.settings) reads them."""
        env = {**without_secrets(dict(os.environ)), "PYTHONUNBUFFERED": "1"}
        for name, services in SECRETS.items():
            if inst.service in services and name in os.environ:
                env[name] = os.environ[name]
        settings = SERVICE_SETTINGS[inst.service]
        has = {v.field: v.name for v in variables(settings)}
        sockets = LocalSockets.of(self.sockets, inst.name)
        # Where it is in the mesh (gaas.ops.serviceenv, as the Kubernetes manifests place it too):
        # service and sidecar meet on Unix sockets only the mesh's owner can reach.
        values = placed_values(inst, Placement(
            instance=inst.name, host=inst.host, advertise=inst.inbound, listen=f"unix:{sockets.service}",
            outbound=f"unix:{sockets.outbound}", spool_dir=str(self.run_dir / "spool"),
            deploy_file=str(self.deploy_file), files_dir=str(self.run_dir / "files")))
        if inst.service in REDIS_CLIENTS:
            user = self.redis_users.get(inst.service)
            values["redis_url"] = redisacl.url_for(self.redis_url, user) if user else self.redis_url
        if "database_url" in has and has["database_url"] not in os.environ:
            # Its database in the run directory, unless the operator named one (a secret, passed above).
            values["database_url"] = f"sqlite:///{self.run_dir / f'{inst.service}.db'}"
        if self.trace is not None:
            # gaas.runtime.telemetry exports there; the W3C context comes from the sidecars.
            env["OTEL_EXPORTER_OTLP_ENDPOINT"] = self.trace.endpoint
            env["OTEL_EXPORTER_OTLP_INSECURE"] = "true"
            # Follow the caller's decision; never start a trace of their own (background calls).
            env["OTEL_TRACES_SAMPLER"] = "parentbased_always_off"
        if inst.service == "worker":
            if self.gpus:
                slot = self._gpu_slot(inst)
                values.update(device="cuda", gpu_memory_utilization=slot.memory_fraction)
                # By UUID: the same GPU whatever order CUDA numbers them in; and CUDA's order is
                # NVML's for anything else that counts them.
                env.update(CUDA_VISIBLE_DEVICES=slot.uuid, CUDA_DEVICE_ORDER="PCI_BUS_ID")
            else:
                values["device"] = "cpu"
                # One worker per core: its engine computes there (see placement.worker_cpus).
                env["VLLM_CPU_OMP_THREADS_BIND"] = str(placement.worker_cpus(inst.index, len(self.topo.of("worker")))[0])
        env.update(env_of(settings, **values))
        env.update(self.extra_env)
        return env

    def _gpu_slot(self, inst: Instance) -> placement.GpuSlot:
        """The GPU a worker computes on, and its share of the GPU's memory: the workers share the
        GPUs their pools fit in turn (gaas.host.placement.worker_gpus: each on the fitting GPU
        with the fewest workers), those on one GPU splitting its memory budget as the workers
        there now are counted (a worker started later on a GPU other workers hold takes a smaller
        share; give the GPU room, or fewer workers, for a roll-out)."""
        workers = self.topo.of("worker")
        budget = value_from_env(worker_settings.WorkerSettings, "gpu_memory_utilization")
        kv_bytes = max(int(w.options["kv_cache_gib"]) for w in workers) * 2**30
        count = max(len(workers), inst.index + 1)
        by_index = {w.index: w for w in workers}
        fits = [self._fitting_gpus(by_index[i]) if i in by_index else None for i in range(count)]
        try:
            slots = placement.worker_gpus(self.gpus, count, budget=budget, kv_cache_bytes=kv_bytes, fits=fits)
        except placement.PlacementError as exc:
            raise MeshError(str(exc)) from None
        return slots[inst.index]

    def _fitting_gpus(self, inst: Instance) -> set[str] | None:
        """The UUIDs of the GPUs a worker's pool fits (its device requirement; None: any GPU)."""
        from gaas.contracts.device import DeviceRequirement, choose
        from gaas.host.profiles import host_profiles

        o = inst.options
        try:
            need = DeviceRequirement.parse(dict(o.get("device_needs") or {}) or o.get("device", "any"))
        except ValueError:
            return None  # (a pool's requirement was checked when applied)
        if need.simple:
            return None
        if self._profiles is None:
            self._profiles = host_profiles(self.gpus)
        return {d.uuid for d in choose(need, self._profiles).fits if d.uuid}

    def _spawn_service(self, inst: Instance) -> None:
        cmd = [sys.executable, "-m", SERVICE_MODULES[inst.service]]
        cpus = placement.worker_cpus(inst.index, len(self.topo.of("worker")))[1] if inst.service == "worker" and not self.gpus else None
        self._spawn(inst.name, inst.service, cmd, self.service_env(inst), cpus)

    def _spawn_envoy(self, name: str, config: Path) -> None:
        cmd = [
            envoyconf.envoy_binary(),
            "-c", str(config),
            *ENVOY_ARGS,
            "--log-level", os.environ.get("GAAS_ENVOY_LOG_LEVEL", "warn"),
            "--service-node", name,
        ]
        env = {k: os.environ[k] for k in BARE_ENV if k in os.environ}
        self._spawn(name, "envoy", cmd, {**env, "GAAS_ENVOY_NAME": name})

    def _write_state(self) -> None:
        # Prometheus scrapes the instances there are now (workers come and go with the deployment).
        promconf.write(self.topo, self.run_dir / "prometheus.yml")
        state = {
            "pid": os.getpid(),
            "host": self.topo.host,
            "port_base": self.topo.port_base,
            "ingress_port": self.topo.ingress_port,
            "ingress_path": self.topo.ingress_path,
            # What a pool's replicas: auto is here; each worker's number and options (its pool and
            # engine settings): gaas.ops.topology.with_state_workers.
            "auto_workers": self.topo.auto_workers,
            "workers": [{"index": w.index, "options": dict(w.options)} for w in self.topo.of("worker")],
            "retiring": sorted(self._retiring),
            "topology": str(Path(self.topology_file).resolve()) if self.topology_file else None,
            "redis_url": self.redis_url,
            "ingress_tls_cert": str(self.ingress_tls[0]) if self.ingress_tls else None,
            "trace_endpoint": self.trace.endpoint if self.trace else None,
            "traces_file": str(self.traces_file) if self.trace_sink else None,
            # The models the workers serve (what `gaas generate` asks for by default).
            "models": self.served_models,
            "children": {c.name: c.proc.pid for c in self.children},
            # When each started (with its pid, what tells it from a later process of that pid).
            "started": {c.name: start_ticks(c.proc.pid) for c in self.children},
            "restarts": {c.name: c.restarts for c in self.children if c.restarts},
        }
        # Readers (`gaas status`, `gaas restart`) must never see half a file: write, then rename.
        tmp = self.run_dir / f".{STATE_FILE}.tmp"
        tmp.write_text(json.dumps(state, indent=2) + "\n")
        os.replace(tmp, self.run_dir / STATE_FILE)

    # ----------------------------------------------------------------- ready

    def wait_ready(self, timeout: float = 240.0) -> probe.MeshHealth | None:
        """Until control answers (then the deployment's workers are started), every instance is
        SERVING through its sidecar, every Envoy is ready and every worker is registered; raises
        MeshError naming what is missing (and its log). None: interrupted (interrupt()). Call it
        from the thread that keeps running the mesh: the workers are its children."""
        started = time.monotonic()
        deadline = started + timeout
        last_note = 0.0
        pools = None
        while True:
            if self._stopping:
                return None
            self._check_children()
            if pools is None:
                try:
                    pools = self._fetch_pools(timeout=1.0)
                except MeshError:
                    pools = None
                if pools is not None:
                    # The deployment's workers, their models built first (a preset's, when missing).
                    self._reconcile(pools, initial=True)
                    self._write_state()
                    if not self.topo.of("worker"):
                        self.progress("the deployment serves no model (every model's replicas is 0): no workers "
                                      "started; `gaas apply` a file that serves one")
            want_workers = len(self.topo.of("worker"))
            # This mesh's workers: a registration left by another topology's (a worker that was removed,
            # or moved to another port) is not one of them, whatever its lease says.
            ours = {(w.name, w.inbound) for w in self.topo.of("worker")}
            health = probe.probe(self.topo, self.run_dir, timeout=1.0)
            registered = [w for w in health.workers
                          if w["state"] == "SERVING" and (w["worker_id"], w["address"]) in ours]
            lagging = []
            if pools is not None and health.healthy and len(registered) >= want_workers:
                # ... and every router's sidecar told of each worker (control's xDS), or a router-path
                # request sent at once would find its worker unknown there (503 no_healthy_upstream).
                lagging = probe.routers_lagging(self.topo, self.run_dir, [w["address"] for w in registered])
                if not lagging:
                    return health
            waiting = [i.name for i in health.instances if i.health != "SERVING" or not i.sidecar_ready]
            waiting += [f"{name}'s view of the workers" for name in lagging]
            if not health.ingress_ready:
                waiting.append(" and ".join(self.topo.ingresses))
            if pools is None and "control-0" not in waiting:
                waiting.append("the deployment's pools from control")
            if not waiting and len(registered) < want_workers:
                waiting.append(f"worker registration ({len(registered)}/{want_workers})")
            now = time.monotonic()
            if now > deadline:
                names = [i.name for i in self.topo.instances if i.name in waiting] or [w.name for w in self.topo.of("worker")]
                logs = ", ".join(str(self.log_dir / f"{n}.log") for n in names[:3])
                raise MeshError(f"not ready after {timeout:.0f} s: waiting for {', '.join(waiting)}; see {logs}")
            if now - last_note >= 5:
                hint = ""
                if any("worker" in w for w in waiting):
                    hint = (" (vLLM loads the model, compiles it and captures CUDA graphs: a minute or two on a GPU)"
                            if self.gpus else " (vLLM loads the model: ~20-40 s per worker on a CPU)")
                self.progress(f"waiting for {', '.join(waiting)}{hint} ... {now - started:.0f} s")
                last_note = now
            time.sleep(0.5)

    def restart(self, name: str, env: Mapping[str, str | None] | None = None, timeout: float = 90.0) -> None:
        """Stop one service instance (SIGTERM: it drains its requests) and start it again with env's
        changes to its environment (None removes a variable): a setting a service reads when it
        starts, as a benchmark comparing a router's policies on one mesh changes it. Then wait until
        it serves through its sidecar again (and, a router, knows every worker); MeshError when it
        does not within timeout. Call it from the thread that started the mesh (its children get
        SIGTERM when that thread ends)."""
        child = next((c for c in self.children if c.name == name and c.kind in SERVICE_MODULES), None)
        if child is None:
            services = ", ".join(c.name for c in self.children if c.kind in SERVICE_MODULES)
            raise MeshError(f"this mesh has no service instance named {name!r} (it has {services})")
        child.env = {k: v for k, v in {**child.env, **(env or {})}.items() if v is not None}
        deadline = time.monotonic() + timeout
        if child.proc.poll() is None:
            child.proc.send_signal(signal.SIGTERM)
            try:
                child.proc.wait(timeout=max(1.0, timeout / 2))
            except subprocess.TimeoutExpired:
                self.progress(f"{name} did not stop in {timeout / 2:.0f} s; killing it")
        self._respawn(child)
        while True:
            health = probe.probe(self.topo, self.run_dir, timeout=1.0)
            mine = next((i for i in health.instances if i.name == name), None)
            if mine is not None and mine.health == "SERVING" and mine.sidecar_ready:
                serving = [w["address"] for w in health.workers if w["state"] == "SERVING"]
                if child.kind != "router" or name not in probe.routers_lagging(self.topo, self.run_dir, serving):
                    return
            if child.proc.poll() is not None:
                raise MeshError(f"{name} exited with code {child.proc.returncode} after its restart; its log "
                                f"{child.log} ends:\n{child.tail()}")
            if time.monotonic() > deadline:
                raise MeshError(f"{name} did not serve again within {timeout:.0f} s of its restart; see {child.log}")
            time.sleep(0.25)

    def interrupt(self) -> None:
        """Give up starting: children exiting from now on are expected (stop() follows)."""
        self._stopping = True

    def _check_children(self) -> None:
        for c in self.children:
            rc = c.proc.poll()
            if rc is not None and not self._stopping:
                raise MeshError(f"{c.name} exited with code {rc} while starting; its log {c.log} ends:\n{c.tail()}")

    def supervise(self, report: Callable[[str], None]) -> None:
        """Restart children that exited on their own, with backoff (1, 2, 4 ... 30 s; reset after a
        minute of running), saying so through report; retire the workers told to drain once they
        have; and keep the workers matching the deployment's pools. Called every second by `gaas up`."""
        if self._stopping:
            return
        now = time.monotonic()
        changed = self._retire_finished(report)
        for c in self.children:
            rc = c.proc.poll()
            if rc is None or self._retired(c.name):
                continue
            if not c.restart_at:
                ran = now - c.started
                c.backoff = 1.0 if ran >= RESTART_STABLE_SECONDS else min(RESTART_BACKOFF_MAX, max(1.0, c.backoff * 2))
                c.restart_at = now + c.backoff
                report(f"{c.name} exited with code {rc} after {ran:.0f} s; restarting it in {c.backoff:.0f} s "
                       f"(restart {c.restarts + 1}); its log {c.log} ends:\n{c.tail(8)}")
            elif now >= c.restart_at:
                self._respawn(c)
                changed = True
                report(f"{c.name} restarted (pid {c.proc.pid}, restart {c.restarts})")
        if now - self._last_reconcile >= RECONCILE_SECONDS:
            self._last_reconcile = now
            try:
                pools = self._fetch_pools(timeout=1.0)
            except MeshError:
                pools = None  # control away: the workers stay as they are
            if pools is not None:
                changed = self._reconcile(pools, report=report) or changed
        if changed:
            self._write_state()

    # ----------------------------------------------------------------- the deployment's workers

    def _control_stub(self):
        from gaas.v1 import control_pb2_grpc

        if self._control is None:
            channel = pki.operator_channel(self.topo.of("control")[0].inbound, self.run_dir)
            self._control = (channel, control_pb2_grpc.ControlStub(channel))
        return self._control[1]

    def _close_control(self) -> None:
        """Close the channel to control. A child forked while a gRPC channel is open can abort
        before it execs (gRPC's fork handlers): every start of a child closes it first."""
        if self._control is not None:
            self._control[0].close()
            self._control = None

    def _fetch_pools(self, timeout: float) -> list[fleet.PoolSpec]:
        """The pools control says the mesh runs (MeshError when it does not answer)."""
        import grpc

        from gaas.v1 import control_pb2

        try:
            resp = self._control_stub().ListPools(control_pb2.ListPoolsRequest(), timeout=timeout)
        except grpc.RpcError as exc:
            raise MeshError(f"control did not say which workers to run: {exc.code().name}") from None
        return [fleet.PoolSpec.from_pb(p) for p in resp.pools]

    def _report_failure(self, pool: fleet.PoolSpec, reason: str) -> None:
        """Tell control why a pool's workers cannot run here (a roll-out of it halts)."""
        from gaas.v1 import control_pb2

        self.progress(f"{pool.model} {pool.version}: {reason}")
        try:
            self._control_stub().ReportPoolFailure(control_pb2.ReportPoolFailureRequest(
                model=pool.model, version=pool.version, reason=reason), timeout=2.0)
        except Exception as exc:  # noqa: BLE001 - said above; control hears of it at its next report
            self.progress(f"could not tell control: {exc}")

    def _placeable(self, pool: fleet.PoolSpec) -> bool:
        """Whether this host can run the pool's workers (said to control once when not)."""
        wrong = (self._placement(pool).reason() or self._build_errors.get(pool.source)
                 or check_source(pool.model, pool.version, pool.source, pool.preset))
        if wrong and pool.key not in self._refused:
            self._refused.add(pool.key)
            self._report_failure(pool, wrong)
        return not wrong

    def _placement(self, pool: fleet.PoolSpec):
        """Which of this host's devices the pool's workers may run on (gaas.contracts.device)."""
        from gaas.contracts.device import choose
        from gaas.host.profiles import host_profiles

        if self._profiles is None:
            self._profiles = host_profiles(self.gpus)
        return choose(pool.requirement, self._profiles)

    def _model_ready(self, pool: fleet.PoolSpec, wait: bool) -> bool:
        """Whether the pool's weights are there: a preset's are built when missing (wait: here and
        now; else in the background, the pool's workers started at a later look)."""
        if not pool.preset or not pool.source.startswith("/"):
            return True
        if is_built(Path(pool.source)):
            if refresh_chat_template(Path(pool.source)):
                self.progress(f"model {pool.model} {pool.version}: its chat template now renders tools")
            return True
        building = self._builds.get(pool.source)
        if building is not None and building.is_alive():
            return False

        def build() -> None:
            self.progress(f"building model {pool.model} {pool.version} ({pool.preset} preset, seed {pool.seed}) "
                          f"into {pool.source}")
            try:
                build_model(pool.preset, Path(pool.source), seed=pool.seed, progress=lambda m: self.progress(f"  {m}"))
            except Exception as exc:  # noqa: BLE001 - said to control: its roll-out halts with it
                self._build_errors[pool.source] = f"building {pool.source} failed: {type(exc).__name__}: {exc}"

        if wait:
            build()
            return pool.source not in self._build_errors
        self._builds[pool.source] = threading.Thread(target=build, name=f"build {pool.model}", daemon=True)
        self._builds[pool.source].start()
        return False

    def _reconcile(self, pools: list[fleet.PoolSpec], initial: bool = False,
                   report: Callable[[str], None] | None = None) -> bool:
        """Start and stop workers so they match pools; True when the mesh changed."""
        report = report or self.progress
        running = [fleet.Running(w.index, fleet.key_of(w.options), w.name in self._retiring)
                   for w in self.topo.of("worker")]
        actions = fleet.reconcile(pools, running, self.topo.auto_workers, self._placeable)
        for index in actions.stop:
            self._retire(f"worker-{index}", report)
        for index, pool in actions.start:
            if not self._model_ready(pool, wait=initial) or not self._placeable(pool):
                continue
            self._spawn_worker(index, pool, report, quiet=initial)
        return bool(actions)

    def _spawn_worker(self, index: int, pool: fleet.PoolSpec, report: Callable[[str], None], quiet: bool) -> None:
        try:
            inst = self.topo.worker(index, pool.options())
        except TopologyError as exc:
            if pool.key not in self._refused:
                self._refused.add(pool.key)
                self._report_failure(pool, str(exc))
            return
        busy = [p for p in (inst.inbound_port, inst.metrics_port, inst.envoy_stats_port) if port_in_use(inst.host, p)]
        if busy:
            report(f"cannot start {inst.name} for {pool.model} {pool.version}: port(s) {', '.join(map(str, busy))} "
                   f"on {inst.host} are in use; trying again shortly")
            return
        sockets = LocalSockets.of(self.sockets, inst.name).dir
        sockets.mkdir(parents=True, exist_ok=True)
        os.chmod(sockets, 0o700)
        self._authority.issue("worker", inst.name, sidecar=inst.inbound)
        self.topo = with_workers(self.topo, [*self.topo.of("worker"), inst])
        config = envoyconf.sidecar_config(self.topo, inst, self.log_dir, self._authority, self.sockets, self.trace)
        path = self.run_dir / "envoy" / f"sidecar-{inst.name}.yaml"
        path.write_text(envoyconf.config_text(config))
        self._spawn_service(inst)
        self._spawn_envoy(f"sidecar-{inst.name}", path)
        if not quiet:
            report(f"started {inst.name} for {pool.model} {pool.version} ({pool.role})")

    def _retire(self, name: str, report: Callable[[str], None]) -> None:
        """Drain a worker whose pool shrank or went: SIGUSR1 (it deregisters, takes no new request
        and lets its streams finish: no other worker of its version may be left to carry them on);
        its sidecar stops once it has left (_retire_finished)."""
        self._retiring.add(name)
        child = next((c for c in self.children if c.name == name), None)
        if child is not None and child.proc.poll() is None:
            try:
                child.proc.send_signal(signal.SIGUSR1)
            except ProcessLookupError:
                pass
        report(f"{name} drains: its pool ({fleet.key_of(self.topo.instance(name).options)[0]} "
               f"{fleet.key_of(self.topo.instance(name).options)[1]}) needs it no more")

    def _retired(self, name: str) -> bool:
        """A retiring worker, or its sidecar (never restarted)."""
        return name in self._retiring or name.removeprefix("sidecar-") in self._retiring

    def _retire_finished(self, report: Callable[[str], None]) -> bool:
        """The retiring workers that have left: their sidecars stopped, then both forgotten."""
        changed = False
        for name in sorted(self._retiring):
            worker = next((c for c in self.children if c.name == name), None)
            sidecar = next((c for c in self.children if c.name == f"sidecar-{name}"), None)
            if worker is not None and worker.proc.poll() is None:
                continue
            if sidecar is not None and sidecar.proc.poll() is None:
                sidecar.proc.send_signal(signal.SIGTERM)
                continue
            for c in (worker, sidecar):
                if c is not None:
                    signal_group(c.proc.pid, signal.SIGKILL)  # what its engine left
                    self.children.remove(c)
            self._retiring.discard(name)
            self.topo = with_workers(self.topo, [w for w in self.topo.of("worker") if w.name != name])
            shutil.rmtree(LocalSockets.of(self.sockets, name).dir, ignore_errors=True)
            report(f"{name} has left")
            changed = True
        return changed

    # ----------------------------------------------------------------- stop

    def stop(self, timeout: float = 30.0) -> None:
        """Ingress first (no new requests), then the services (they drain, workers deregister),
        then the sidecars, then Redis; whatever is left after timeout is killed with its group."""
        self._stopping = True
        deadline = time.monotonic() + timeout
        self._close_control()
        running = {c.name for c in self.children if c.proc.poll() is None}
        ingress.drain([LocalSockets.of(self.sockets, name).admin for name in self.topo.ingresses if name in running],
                      min(timeout / 2, INGRESS_DRAIN_SECONDS), self.progress)
        ingresses = set(self.topo.ingresses)
        order = [
            [c for c in self.children if c.name in ingresses],
            [c for c in self.children if c.kind in SERVICE_MODULES],
            [c for c in self.children if c.kind == "envoy" and c.name not in ingresses],
            [c for c in self.children if c.kind in ("redis", "tracesink")],
        ]
        for group in order:
            for c in group:
                if c.proc.poll() is None:
                    try:
                        c.proc.send_signal(signal.SIGTERM)
                    except ProcessLookupError:
                        pass
            for c in group:
                try:
                    c.proc.wait(timeout=max(0.1, deadline - time.monotonic()))
                except subprocess.TimeoutExpired:
                    self.progress(f"{c.name} did not stop in time; killing it")
        for c in self.children:
            # The leader may be gone while its own children (vLLM's engine processes) linger.
            signal_group(c.proc.pid, signal.SIGKILL)
            try:
                c.proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                pass
        state = self.run_dir / STATE_FILE
        if state.exists():
            state.unlink()
        shutil.rmtree(self.sockets, ignore_errors=True)

    def pids(self) -> list[int]:
        return [c.proc.pid for c in self.children]

