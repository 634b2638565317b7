"""Running the whole mesh on one machine: Redis (when none answers), every service instance of
the topology, an Envoy sidecar per instance and the ingress Envoy. What `gaas up` does.

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
import time
from collections.abc import Callable
from pathlib import Path
from urllib.parse import urlparse

from gaas.envoy import config as envoyconf
from gaas.launcher.children import (
    RESTART_BACKOFF_MAX, RESTART_STABLE_SECONDS, Child, child_setup, signal_group, start_ticks, stop_leftovers,
)
from gaas.launcher.errors import MeshError
from gaas.launcher.rundir import STATE_FILE, port_in_use
from gaas.launcher.secrets import (
    BARE_ENV, REDIS_CLIENTS, REDIS_PASSWORD_FILE, SECRETS, private_secret, redis_answers, redis_server_command,
    with_password, without_secrets,
)
from gaas.ops import pki, probe, promconf, protogen, redisacl
from gaas.settings import deployspec
from gaas.settings import worker as worker_settings
from gaas.settings.env import env_of, value_from_env, variables
from gaas.settings.services import SETTINGS as SERVICE_SETTINGS
from gaas.model.build import build_model, is_built
from gaas.host import placement
from gaas.host.devices import visible_gpus
from gaas.ops.topology import Instance, LocalSockets, Topology, sockets_root
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
    ) -> None:
        self.topo = topo
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
        # The GPUs this host lets us use (gaas.host.devices): a worker on each, by UUID (workers
        # beyond their number share, splitting the memory); none: CPU workers, one per core.
        self.gpus = visible_gpus()
        self.gpu_slots: list[placement.GpuSlot] = []
        workers = self.topo.of("worker")
        if self.gpus and workers:
            budget = value_from_env(worker_settings.WorkerSettings, "gpu_memory_utilization")
            kv_bytes = max(int(w.options["kv_cache_gib"]) for w in workers) * 2**30
            try:
                self.gpu_slots = placement.worker_gpus(self.gpus, len(workers), budget=budget, kv_cache_bytes=kv_bytes)
            except placement.PlacementError as exc:
                raise MeshError(str(exc)) from None
            if any(slot.shared_by > 1 for slot in self.gpu_slots):
                progress(f"{len(workers)} workers on {len(self.gpus)} GPU(s): workers sharing a GPU split its memory")
        self._stopping = False

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
        self._ensure_models()
        self._ensure_redis()
        for name in ("ingress-0", *(i.name for i in self.topo.instances)):
            d = LocalSockets.of(self.sockets, name).dir
            d.mkdir(parents=True, exist_ok=True)
            os.chmod(d, 0o700)
        os.chmod(self.sockets, 0o700)
        authority = pki.Authority(self.run_dir)
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

    def _ensure_models(self) -> None:
        for name in sorted({str(w.options["model"]) for w in self.topo.of("worker")}):
            m = self.spec.model(name)
            if m.preset:
                if not is_built(Path(m.source)):
                    self.progress(f"building model {m.name} ({m.preset} preset) into {m.source}")
                    build_model(m.preset, Path(m.source), progress=lambda msg: self.progress(f"  {msg}"))
            elif m.source.startswith("/") and not Path(m.source).exists():
                raise MeshError(f"model {m.name}: {m.source} does not exist and no preset is given to build it")

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
        log = self.log_dir / f"{name}.log"
        with open(log, "ab") as out:
            out.write(f"\n=== {time.strftime('%Y-%m-%d %H:%M:%S')} {' '.join(cmd)}\n".encode())
            proc = subprocess.Popen(
                cmd,
                cwd=ROOT,
                env=env,
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=subprocess.STDOUT,
                start_new_session=True,  # its own process group: signalled as a whole at the end
                preexec_fn=child_setup(cpus),
            )
        child = Child(name, kind, proc, log, cmd=cmd, env=env, cpus=cpus)
        self.children.append(child)
        return child

    def _respawn(self, child: Child) -> None:
        """Start an exited child again in its place (same command, environment and log)."""
        signal_group(child.proc.pid, signal.SIGKILL)  # what the dead leader left behind (an engine's processes)
        with open(child.log, "ab") as out:
            out.write(f"\n=== {time.strftime('%Y-%m-%d %H:%M:%S')} restart {child.restarts + 1}: {' '.join(child.cmd)}\n".encode())
            child.proc = subprocess.Popen(
                child.cmd, cwd=ROOT, env=child.env, stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT,
                start_new_session=True, preexec_fn=child_setup(child.cpus),
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
        # Where it is in the mesh; each service gets those of these it has.
        placed = {
            "instance": inst.name,
            "host": inst.host,
            "port": inst.port,
            "metrics_port": inst.metrics_port,
            "advertise": inst.inbound,
            # Service and sidecar meet on Unix sockets only the mesh's owner can reach.
            "listen": f"unix:{sockets.service}",
            "outbound": f"unix:{sockets.outbound}",
            "spool_dir": str(self.run_dir / "spool"),
            "deploy_file": str(self.deploy_file),
        }
        values = {k: v for k, v in placed.items() if k in has}
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
            m = self.spec.model(str(inst.options["model"]))
            values.update(model=m.name, model_path=m.source, model_version=m.version, max_model_len=m.max_model_len,
                          **worker_settings.from_topology(inst.options))
            if self.gpu_slots:
                slot = self.gpu_slots[inst.index]
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

    def _spawn_service(self, inst: Instance) -> None:
        cmd = [sys.executable, "-m", SERVICE_MODULES[inst.service]]
        cpus = placement.worker_cpus(inst.index, len(self.topo.of("worker")))[1] if inst.service == "worker" and not self.gpus else None
        self._spawn(inst.name, inst.service, cmd, self.service_env(inst), cpus)

    def _spawn_envoy(self, name: str, config: Path) -> None:
        cmd = [
            envoyconf.envoy_binary(),
            "-c", str(config),
            "--concurrency", "1",
            "--disable-hot-restart",
            "--log-level", os.environ.get("GAAS_ENVOY_LOG_LEVEL", "warn"),
            "--service-node", name,
        ]
        env = {k: os.environ[k] for k in BARE_ENV if k in os.environ}
        self._spawn(name, "envoy", cmd, {**env, "GAAS_ENVOY_NAME": name})

    def _write_state(self) -> None:
        state = {
            "pid": os.getpid(),
            "host": self.topo.host,
            "port_base": self.topo.port_base,
            "ingress_port": self.topo.ingress_port,
            "ingress_path": self.topo.ingress_path,
            "workers": len(self.topo.of("worker")),
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

    def wait_ready(self, timeout: float = 240.0) -> probe.MeshHealth:
        """Until every instance is SERVING through its sidecar, every Envoy is ready and every
        worker is registered; raises MeshError naming what is missing (and its log)."""
        started = time.monotonic()
        deadline = started + timeout
        last_note = 0.0
        want_workers = len(self.topo.of("worker"))
        # This mesh's workers: a registration left by another topology's (a worker that was removed,
        # or moved to another port) is not one of them, whatever its lease says.
        ours = {(w.name, w.inbound) for w in self.topo.of("worker")}
        while True:
            self._check_children()
            health = probe.probe(self.topo, self.run_dir, timeout=1.0)
            registered = [w for w in health.workers
                          if w["state"] == "SERVING" and (w["worker_id"], w["address"]) in ours]
            if health.healthy and len(registered) >= want_workers:
                return health
            waiting = [i.name for i in health.instances if i.health != "SERVING" or not i.sidecar_ready]
            if not health.ingress_ready:
                waiting.append("ingress-0")
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
                            if self.gpu_slots else " (vLLM loads the model: ~20-40 s per worker on a CPU)")
                self.progress(f"waiting for {', '.join(waiting)}{hint} ... {now - started:.0f} s")
                last_note = now
            time.sleep(0.5)

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
        minute of running), saying so through report. Called every second by `gaas up`."""
        if self._stopping:
            return
        now = time.monotonic()
        changed = False
        for c in self.children:
            rc = c.proc.poll()
            if rc is None:
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
        if changed:
            self._write_state()

    # ----------------------------------------------------------------- stop

    def stop(self, timeout: float = 30.0) -> None:
        """Ingress first (no new requests), then the services (they drain, workers deregister),
        then the sidecars, then Redis; whatever is left after timeout is killed with its group."""
        self._stopping = True
        deadline = time.monotonic() + timeout
        self._drain_ingress(min(timeout / 2, INGRESS_DRAIN_SECONDS))
        order = [
            [c for c in self.children if c.name == "ingress-0"],
            [c for c in self.children if c.kind in SERVICE_MODULES],
            [c for c in self.children if c.kind == "envoy" and c.name != "ingress-0"],
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

    def _drain_ingress(self, seconds: float) -> None:
        """Close the ingress's listener (no new connections) and wait, up to seconds, for the
        requests in flight through it to finish."""
        ingress = next((c for c in self.children if c.name == "ingress-0" and c.proc.poll() is None), None)
        if ingress is None:
            return
        admin = LocalSockets.of(self.sockets, "ingress-0").admin
        try:
            probe.envoy_admin(admin, "/drain_listeners", method="POST")
        except OSError:
            return
        deadline = time.monotonic() + seconds
        said = False
        while time.monotonic() < deadline:
            try:
                _, body = probe.envoy_admin(admin, "/stats?filter=^http.ingress.downstream_rq_active$")
                active = int(body.decode().rsplit(":", 1)[-1].strip() or 0)
            except (OSError, ValueError):
                return
            if active == 0:
                return
            if not said:
                self.progress(f"the ingress takes no new connections; waiting up to {seconds:.0f} s for {active} "
                              "request(s) in flight to finish")
                said = True
            time.sleep(0.2)
        self.progress("requests still in flight through the ingress are cut")

    def pids(self) -> list[int]:
        return [c.proc.pid for c in self.children]

