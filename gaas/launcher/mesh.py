"""Running the whole mesh on one machine: Redis (when none answers), every service instance of
the topology, an Envoy sidecar per instance and the ingress's Envoys. What `gaas up` does.

Beside it in gaas/launcher: what each process it starts is given (workerenv.py), the deployment's
workers matched with control's pools (pools.py, which fleet.py decides), the processes it runs and
what a killed one left (children.py), the run directory and ports (rundir.py), Redis and each
process's secrets (secrets.py), the ingress's Envoys (ingress.py), the rolling restart
(supervisor.py).
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
from gaas.host import placement
from gaas.host.devices import visible_gpus
from gaas.launcher import ingress
from gaas.launcher.children import (
    RESTART_BACKOFF_MAX, RESTART_STABLE_SECONDS, Child, child_launch, reap_strays, signal_group, start_ticks,
    stop_leftovers,
)
from gaas.launcher.errors import MeshError
from gaas.launcher.pools import PoolWorkers
from gaas.launcher.zygote import READY_TIMEOUT
from gaas.launcher.rundir import STATE_FILE, port_in_use
from gaas.launcher.secrets import (
    BARE_ENV, REDIS_PASSWORD_FILE, private_secret, redis_answers, redis_server_command, with_password, without_secrets,
)
from gaas.launcher.workerenv import WorkerEnvironment
from gaas.ops import pki, probe, promconf, protogen, redisacl
from gaas.ops.topology import Instance, LocalSockets, Topology, sockets_root, with_workers
from gaas.ops.traces import TRACES_FILE, TraceTarget
from gaas.settings import deployspec

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


class Mesh(WorkerEnvironment, PoolWorkers):
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
        # What CPU workers are forked from (gaas.launcher.zygote; None: each starts afresh).
        self._zygote = None
        self._authority: pki.Authority | None = None
        self._last_reconcile = 0.0

    # ----------------------------------------------------------------- start

    def start(self) -> None:
        # Everything the mesh writes (databases, keys, the Redis password, logs) is its owner's alone.
        os.umask(0o077)
        self.log_dir.mkdir(parents=True, exist_ok=True)
        stop_leftovers(self.run_dir, self.progress)
        ingress.raise_open_files(self.progress)
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
        if not self.gpus:
            self._start_zygote(sys.executable, SERVICE_MODULES["worker"])
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
        log = self.log_dir / f"{name}.log"
        with open(log, "ab") as out:
            out.write(f"\n=== {time.strftime('%Y-%m-%d %H:%M:%S')} {' '.join(cmd)}\n".encode())
        child = Child(name, kind, self._start_process(cmd, env, cpus, log), log, cmd=cmd, env=env, cpus=cpus)
        self.children.append(child)
        return child

    def _respawn(self, child: Child) -> None:
        """Start an exited child again in its place (same command, environment and log)."""
        signal_group(child.proc.pid, signal.SIGKILL)  # what the dead leader left behind (an engine's processes)
        with open(child.log, "ab") as out:
            out.write(f"\n=== {time.strftime('%Y-%m-%d %H:%M:%S')} restart {child.restarts + 1}: {' '.join(child.cmd)}\n".encode())
        child.proc = self._start_process(child.cmd, child.env, child.cpus, child.log)
        child.started = time.monotonic()
        child.restarts += 1
        child.restart_at = 0.0

    def _start_process(self, cmd: list[str], env: dict[str, str], cpus: set[int] | None, log: Path):
        """A child's process, in its own process group, its output appended to log: forked from the
        worker zygote where it fits (gaas.launcher.zygote), else a new interpreter."""
        zygote = next((c for c in self.children if c.kind == "zygote"), None)
        if zygote is not None and self._zygote is not None and self._zygote.fits(cmd, env):
            # Its first start's import is waited for; a restarted one's is not (a worker starts afresh meanwhile).
            proc = self._zygote.spawn(env, cpus, log, ROOT, alive=lambda: zygote.proc.poll() is None,
                                      timeout=READY_TIMEOUT if not zygote.restarts else 0.0)
            if proc is not None:
                return proc
            self.progress(f"the worker zygote does not answer (its log: {zygote.log}); starting a worker afresh")
        self._close_control()  # (no gRPC channel open across a fork)
        with open(log, "ab") as out:
            argv, setup = child_launch(cmd, cpus)
            return subprocess.Popen(argv, cwd=ROOT, env=env, stdin=subprocess.DEVNULL, stdout=out,
                                    stderr=subprocess.STDOUT,
                                    start_new_session=True,  # its own process group: signalled as a whole at the end
                                    preexec_fn=setup)

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
                            if self.gpus else " (vLLM imports, then loads the model: ~10-15 s on a CPU)")
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
        reap_strays({c.proc.pid for c in self.children})  # (orphans adopted as a subreaper: no zombies)
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

