"""`gaas k8s rehearse`: the rendered cpu overlay's pods run on this machine, each in its own Linux
network namespace, to prove that the manifests run, not only that they parse.

What is taken from the manifests, as a kubelet would: each workload's pods (a Deployment's
replicas, a StatefulSet's one), each pod's containers with exactly their command, arguments,
working directory and environment (values, the downward API's pod name and address, Secrets'
keys, `$(VAR)` references expanded), its volumes (ConfigMaps and Secrets as files, emptyDirs and
a StatefulSet's claims as directories of the pod's own, a PersistentVolumeClaim a pod names as one
directory every pod that names it shares, as a ReadWriteMany volume is) mounted where the
containers mount them, native sidecars started first
and waited for (their startup probe), the probes, and the restart policy: a container that exits,
or is killed, starts again in its pod with a backoff. Each pod has its own address on a bridge of
its own, a hosts file that resolves every headless Service to its pods (as cluster DNS does), and
its own mount namespace where the project stands at the image's path (/opt/gaas) and the root
filesystem is read-only where the container asks for it.

What it does not rehearse: the scheduler and the nodes (every pod runs here), resource requests
and limits, the users containers run as (the processes run as root without capabilities: the
interpreter of this machine lives in root's home), the kubelet's liveness restarts, the HPA's and
KEDA's reading of metrics, NetworkPolicies, the LoadBalancer and its externalTrafficPolicy
(clients use an ingress pod's address), cert-manager (the render's trial certificate is served),
a storage provisioner (a claim is a directory here), and images (the project and its virtual
environment are this checkout's). gaas/k8s/drill.py drives a rehearsal: renders, runs, streams,
kills.

Needs root (network and mount namespaces); the traffic stays on the bridge (no route out).
"""

from __future__ import annotations

import base64
import http.client
import os
import re
import secrets as pysecrets
import shlex
import signal
import socket
import subprocess
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from gaas.k8s import pods

# Kubernetes' container restart backoff, from the first restart (it doubles, to the cap).
RESTART_BACKOFF = 10.0
RESTART_BACKOFF_MAX = 300.0
DEFAULT_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
WORKLOADS = ("Deployment", "StatefulSet")
# Each running rehearsal's driver pid, by id: what a rehearsal killed before it cleaned up left is
# found there and removed by the next one.
RUNNING_DIR = Path("/run/gaas-rehearsals")
# Where a container's mount namespace sees its pod's volumes, and the claims pods share, before
# mounting them in place.
STAGING = "/run/.rehearsal-volumes"
CLAIMS_STAGING = "/run/.rehearsal-claims"


class RehearsalError(RuntimeError):
    """What went wrong, saying what to do."""


def _run(*cmd: str) -> None:
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode != 0:
        raise RehearsalError(f"{' '.join(cmd)} failed: {done.stderr.strip()}")


@dataclass(slots=True)
class Container:
    spec: dict
    # A native sidecar (an init container that keeps running).
    sidecar: bool = False
    proc: subprocess.Popen | None = None
    restarts: int = 0
    restart_at: float = 0.0
    started: float = 0.0

    @property
    def name(self) -> str:
        return self.spec["name"]


@dataclass(slots=True)
class Pod:
    name: str
    workload: dict
    ip: str
    netns: str
    dir: Path
    containers: list[Container] = field(default_factory=list)

    @property
    def spec(self) -> dict:
        return self.workload["spec"]["template"]["spec"]

    @property
    def labels(self) -> dict:
        return self.workload["spec"]["template"]["metadata"].get("labels") or {}


def expand(value: str, env: dict[str, str]) -> str:
    """Kubernetes' $(VAR) expansion: a variable defined before, else left as written; $$ escapes."""
    return re.sub(r"\$\$|\$\(([A-Za-z_][A-Za-z0-9_]*)\)",
                  lambda m: "$" if m.group(0) == "$$" else env.get(m.group(1), m.group(0)), value)


class Rehearsal:
    """The pods of a built overlay as processes in network namespaces under work: network() makes
    the bridge (where a managed database may then listen, at host_address), start(objects) the pods."""

    def __init__(self, work: Path, repo: Path, progress: Callable[[str], None] = lambda msg: None) -> None:
        if os.geteuid() != 0:
            raise RehearsalError("the rehearsal needs root (network and mount namespaces): run it with sudo")
        self.objects: list[dict] = []
        self.work = work
        self.repo = repo.resolve()
        self.scale: dict[str, int] = {}
        self.progress = progress
        # A /24 of its own (subnet_of), none this machine routes already; the bridge at .1 (where
        # a managed database may listen).
        routes = subprocess.run(["ip", "-4", "route", "show"], capture_output=True, text=True).stdout
        self.id = pysecrets.token_hex(2)
        while f"{subnet_of(self.id)}." in routes:
            self.id = pysecrets.token_hex(2)
        self.subnet = subnet_of(self.id)
        self.bridge = f"gb{self.id}"
        self.pods: list[Pod] = []
        self._secrets: dict[str, dict] = {}
        self._configmaps: dict[str, dict] = {}
        self._lock = threading.Lock()
        self._stopping = threading.Event()
        self._supervisor: threading.Thread | None = None
        self._netns: list[str] = []

    @property
    def host_address(self) -> str:
        """This machine's address on the pods' bridge."""
        return f"{self.subnet}.1"

    # ------------------------------------------------------------------ network

    @property
    def claims(self) -> Path:
        """Where the PersistentVolumeClaims pods name are, one directory each."""
        return self.work / "claims"

    @property
    def network_cidr(self) -> str:
        return f"{self.subnet}.0/24"

    def network(self) -> None:
        """The pods' bridge, this machine at host_address on it; no route leads anywhere else."""
        remove_leftovers(self.progress)
        RUNNING_DIR.mkdir(parents=True, exist_ok=True)
        (RUNNING_DIR / self.id).write_text(f"{os.getpid()}\n")
        _run("ip", "link", "add", self.bridge, "type", "bridge")
        _run("ip", "addr", "add", f"{self.host_address}/24", "dev", self.bridge)
        _run("ip", "link", "set", self.bridge, "up")

    def _pod_network(self, pod: Pod, n: int) -> None:
        host_end, pod_end = f"gv{self.id}{n}", f"gp{self.id}{n}"
        _run("ip", "netns", "add", pod.netns)
        self._netns.append(pod.netns)
        _run("ip", "link", "add", host_end, "type", "veth", "peer", "name", pod_end)
        _run("ip", "link", "set", host_end, "master", self.bridge)
        _run("ip", "link", "set", host_end, "up")
        _run("ip", "link", "set", pod_end, "netns", pod.netns)
        _run("ip", "-n", pod.netns, "addr", "add", f"{pod.ip}/24", "dev", pod_end)
        _run("ip", "-n", pod.netns, "link", "set", pod_end, "up")
        _run("ip", "-n", pod.netns, "link", "set", "lo", "up")

    def _hosts(self) -> None:
        """Each pod's /etc/hosts (ip netns exec mounts /etc/netns/NS/hosts there): its own name, and
        every headless Service's name for the pods it selects, as the cluster's DNS answers."""
        lines = ["127.0.0.1 localhost"]
        for svc in (o for o in self.objects if o["kind"] == "Service" and o["spec"].get("clusterIP") == "None"):
            sel = svc["spec"].get("selector") or {}
            for pod in self.pods:
                if sel and all(pod.labels.get(k) == v for k, v in sel.items()):
                    ns = svc["metadata"].get("namespace", "default")
                    lines.append(f"{pod.ip} {svc['metadata']['name']} {svc['metadata']['name']}.{ns}.svc.cluster.local")
        for pod in self.pods:
            d = Path("/etc/netns") / pod.netns
            d.mkdir(parents=True, exist_ok=True)
            (d / "hosts").write_text("\n".join([*lines, f"{pod.ip} {pod.name}"]) + "\n")

    # ------------------------------------------------------------------ pods

    def _plan(self) -> None:
        n = 0
        for w in (o for o in self.objects if o["kind"] in WORKLOADS):
            name = w["metadata"]["name"]
            replicas = self.scale.get(name, w["spec"].get("replicas", 1))
            template_hash = pysecrets.token_hex(5)
            for r in range(replicas):
                n += 1
                pod_name = (f"{name}-{r}" if w["kind"] == "StatefulSet"
                            else f"{name}-{template_hash}-{pysecrets.token_hex(3)[:5]}")
                pod = Pod(pod_name, w, f"{self.subnet}.{9 + n}", f"gaas-{self.id}-{pod_name}"[:60],
                          self.work / "pods" / pod_name)
                spec = pod.spec
                pod.containers = [Container(c, sidecar=c.get("restartPolicy") == "Always")
                                  for c in spec.get("initContainers", [])]
                pod.containers += [Container(c) for c in spec.get("containers", [])]
                self.pods.append(pod)
        if n > 240:
            raise RehearsalError(f"{n} pods do not fit the rehearsal's /24")

    def _volumes(self, pod: Pod) -> dict[str, Path]:
        """Each volume of pod as a directory: a ConfigMap's or a Secret's keys as files (a
        Secret's mode as its defaultMode), an emptyDir or a claim empty; a PersistentVolumeClaim the
        pod names is the claim's one directory (under self.claims), whichever pods name it."""
        out = {}
        claims = [t["metadata"]["name"] for t in pod.workload["spec"].get("volumeClaimTemplates", [])]
        for v in [*pod.spec.get("volumes", []), *({"name": c, "claim": True} for c in claims)]:
            d = pod.dir / "volumes" / v["name"]
            if "persistentVolumeClaim" in v:
                d = self.claims / v["persistentVolumeClaim"]["claimName"]
            d.mkdir(parents=True, exist_ok=True)
            if "configMap" in v:
                cm = self._configmaps.get(v["configMap"]["name"])
                if cm is None:
                    raise RehearsalError(f"pod {pod.name}: ConfigMap {v['configMap']['name']} is not in the manifests")
                for key, text in (cm.get("data") or {}).items():
                    (d / key).write_text(text)
            elif "secret" in v:
                secret = self._secrets.get(v["secret"]["secretName"])
                if secret is None:
                    raise RehearsalError(f"pod {pod.name}: Secret {v['secret']['secretName']} is not in the manifests")
                for key, data in (secret.get("data") or {}).items():
                    (d / key).write_bytes(base64.b64decode(data))
                    os.chmod(d / key, v["secret"].get("defaultMode", 0o644))
            else:
                os.chmod(d, 0o777)
            out[v["name"]] = d
        return out

    def _env(self, pod: Pod, c: dict) -> dict[str, str]:
        env: dict[str, str] = {}
        for ref in c.get("envFrom", []):
            if "secretRef" in ref:
                secret = self._secrets[ref["secretRef"]["name"]]
                env.update({k: base64.b64decode(v).decode() for k, v in (secret.get("data") or {}).items()})
        fields = {"metadata.name": pod.name, "status.podIP": pod.ip}
        for e in c.get("env", []):
            if "value" in e:
                env[e["name"]] = expand(str(e["value"]), env)
            elif "fieldRef" in e.get("valueFrom", {}):
                env[e["name"]] = fields[e["valueFrom"]["fieldRef"]["fieldPath"]]
            elif "secretKeyRef" in e.get("valueFrom", {}):
                ref = e["valueFrom"]["secretKeyRef"]
                env[e["name"]] = base64.b64decode(self._secrets[ref["name"]]["data"][ref["key"]]).decode()
        env.setdefault("PATH", DEFAULT_PATH)
        env.setdefault("HOSTNAME", pod.name)
        return env

    def _script(self, pod: Pod, c: dict, volumes: dict[str, Path]) -> Path:
        """What a container's process runs in its pod's network namespace (ip netns exec gives it a
        mount namespace of its own): the image's paths and the volumes mounted, then its command."""
        env = self._env(pod, c)
        argv = [expand(a, env) for a in [*c.get("command", []), *c.get("args", [])]]
        if not argv:
            raise RehearsalError(f"pod {pod.name} container {c['name']}: no command (an image's entrypoint "
                                 "cannot be rehearsed)")
        lines = ["set -e", "mount --make-rprivate /",
                 "mount -t tmpfs -o mode=0755 tmpfs /run", "mount -t tmpfs -o mode=0755 tmpfs /opt",
                 f"mkdir -p {pods.APP_DIR}", f"mount --bind {shlex.quote(str(self.repo))} {pods.APP_DIR}",
                 # (The volumes' directories reached from here: a volume mounted on /tmp hides them.)
                 f"mkdir -p {STAGING}", f"mount --bind {shlex.quote(str(pod.dir / 'volumes'))} {STAGING}",
                 f"mkdir -p {CLAIMS_STAGING} {shlex.quote(str(self.claims))}",
                 f"mount --bind {shlex.quote(str(self.claims))} {CLAIMS_STAGING}"]
        for m in sorted(c.get("volumeMounts", []), key=lambda m: len(m["mountPath"])):
            target = shlex.quote(m["mountPath"])
            staged = CLAIMS_STAGING if volumes[m["name"]].parent == self.claims else STAGING
            source = shlex.quote(f"{staged}/{volumes[m['name']].name}")
            lines += [f"mkdir -p {target}", f"mount --bind {source} {target}"]
            if m.get("readOnly"):
                lines.append(f"mount -o remount,bind,ro {target}")
        # The checkout at its own path too, should a volume hide it (its scripts name it).
        repo = shlex.quote(str(self.repo))
        lines.append(f"[ -e {repo}/pyproject.toml ] || {{ mkdir -p {repo} && mount --bind {pods.APP_DIR} {repo}; }}")
        if (c.get("securityContext") or {}).get("readOnlyRootFilesystem"):
            lines.append("mount -o remount,bind,ro /")
        lines.append(f"cd {shlex.quote(c.get('workingDir', '/'))}")
        env_args = " ".join(shlex.quote(f"{k}={v}") for k, v in env.items())
        lines.append("exec setpriv --pdeathsig SIGTERM --inh-caps=-all --bounding-set=-all "
                     f"env -i {env_args} {' '.join(shlex.quote(a) for a in argv)}")
        path = pod.dir / f"{c['name']}.sh"
        path.write_text("\n".join(lines) + "\n")
        return path

    def _start(self, pod: Pod, container: Container) -> None:
        script = pod.dir / f"{container.name}.sh"
        log = open(pod.dir / f"{container.name}.log", "ab")
        log.write(f"\n=== {time.strftime('%H:%M:%S')} start (restart {container.restarts})\n".encode())
        log.flush()
        container.proc = subprocess.Popen(
            ["ip", "netns", "exec", pod.netns, "sh", str(script)], stdin=subprocess.DEVNULL, stdout=log,
            stderr=subprocess.STDOUT, start_new_session=True)
        log.close()
        container.started = time.monotonic()

    # ------------------------------------------------------------------ probes

    def probe(self, pod: Pod, probe: dict | None) -> bool:
        """One try of a probe, from this machine to the pod's address, as the kubelet does."""
        if not probe:
            return True
        timeout = probe.get("timeoutSeconds", 1)
        try:
            if "httpGet" in probe:
                conn = http.client.HTTPConnection(pod.ip, probe["httpGet"]["port"], timeout=timeout)
                try:
                    conn.request("GET", probe["httpGet"].get("path", "/"))
                    return 200 <= conn.getresponse().status < 400
                finally:
                    conn.close()
            if "tcpSocket" in probe:
                with socket.create_connection((pod.ip, probe["tcpSocket"]["port"]), timeout=timeout):
                    return True
        except OSError:
            return False
        raise RehearsalError(f"pod {pod.name}: a probe of kind {sorted(probe)} cannot be rehearsed")

    def ready(self, pod: Pod) -> bool:
        return all(c.proc is not None and c.proc.poll() is None
                   and self.probe(pod, c.spec.get("readinessProbe") if not c.sidecar else c.spec.get("startupProbe"))
                   for c in pod.containers)

    def _wait_started(self, pod: Pod, c: Container) -> None:
        """A native sidecar is waited for (its startup probe) before the pod's next container starts."""
        probe = c.spec.get("startupProbe")
        if not probe:
            return
        deadline = time.monotonic() + probe.get("periodSeconds", 10) * probe.get("failureThreshold", 3)
        while not self.probe(pod, probe):
            if c.proc.poll() is not None or time.monotonic() > deadline:
                raise RehearsalError(f"pod {pod.name}: sidecar {c.name} did not start; see {pod.dir / c.name}.log:\n"
                                     + self.tail(pod, c.name))
            time.sleep(0.2)

    def tail(self, pod: Pod, container: str, lines: int = 20) -> str:
        try:
            return "\n".join((pod.dir / f"{container}.log").read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return ""

    # ------------------------------------------------------------------ life

    def start(self, objects: list[dict], scale: dict[str, int] | None = None) -> None:
        """Run objects' pods (scale: replicas of a workload, as `kubectl scale` sets them)."""
        self.objects = objects
        self.scale = dict(scale or {})
        self._secrets = {o["metadata"]["name"]: o for o in objects if o["kind"] == "Secret"}
        self._configmaps = {o["metadata"]["name"]: o for o in objects if o["kind"] == "ConfigMap"}
        self.work.mkdir(parents=True, exist_ok=True)
        self._plan()
        self.progress(f"{len(self.pods)} pods on {self.network_cidr} (bridge {self.bridge}), work in {self.work}")
        for n, pod in enumerate(self.pods):
            pod.dir.mkdir(parents=True, exist_ok=True)
            self._pod_network(pod, n)
            volumes = self._volumes(pod)
            for c in pod.containers:
                self._script(pod, c.spec, volumes)
        self._hosts()
        for pod in self.pods:
            for c in pod.containers:
                self._start(pod, c)
                if c.sidecar:
                    self._wait_started(pod, c)
        self._supervisor = threading.Thread(target=self._supervise, name="rehearsal-kubelet", daemon=True)
        self._supervisor.start()

    def _supervise(self) -> None:
        """The restart policy: a container that exited starts again after its backoff."""
        while not self._stopping.wait(0.2):
            with self._lock:
                for pod in self.pods:
                    for c in pod.containers:
                        if c.proc is None or c.proc.poll() is None:
                            continue
                        now = time.monotonic()
                        if not c.restart_at:
                            c.restart_at = now + min(RESTART_BACKOFF * 2 ** min(c.restarts, 10), RESTART_BACKOFF_MAX)
                        elif now >= c.restart_at:
                            _kill_group(c.proc.pid, signal.SIGKILL)
                            c.restarts += 1
                            c.restart_at = 0.0
                            self._start(pod, c)

    def kill_pod(self, pod: Pod) -> None:
        """Every process of pod killed (SIGKILL), its containers then restarted by their policy."""
        with self._lock:
            for c in pod.containers:
                if c.proc is not None:
                    _kill_group(c.proc.pid, signal.SIGKILL)
            for c in pod.containers:
                if c.proc is not None:
                    c.proc.wait()

    def wait_ready(self, timeout: float, pods_: list[Pod] | None = None) -> None:
        deadline = time.monotonic() + timeout
        waiting = list(pods_ or self.pods)
        while waiting:
            waiting = [p for p in waiting if not self.ready(p)]
            if not waiting:
                return
            if time.monotonic() > deadline:
                p = waiting[0]
                raise RehearsalError(f"not ready after {timeout:.0f} s: {', '.join(x.name for x in waiting)}; "
                                     f"{p.name}'s last lines:\n" + "\n".join(
                                         f"[{c.name}] {self.tail(p, c.name, 8)}" for c in p.containers))
            time.sleep(0.5)

    def of(self, workload: str) -> list[Pod]:
        return [p for p in self.pods if p.workload["metadata"]["name"] == workload]

    def stop(self) -> None:
        self._stopping.set()
        if self._supervisor is not None:
            self._supervisor.join(timeout=5)
        for pod in self.pods:
            for c in pod.containers:
                if c.proc is not None:
                    _kill_group(c.proc.pid, signal.SIGTERM)
        deadline = time.monotonic() + 10
        for pod in self.pods:
            for c in pod.containers:
                if c.proc is None:
                    continue
                try:
                    c.proc.wait(timeout=max(0.1, deadline - time.monotonic()))
                except subprocess.TimeoutExpired:
                    pass
                _kill_group(c.proc.pid, signal.SIGKILL)
        _remove(self.id, self._netns)


def _remove(rid: str, netns: list[str]) -> None:
    """Rehearsal rid's namespaces (what still runs in them killed), hosts files, bridge and record."""
    for ns in netns:
        done = subprocess.run(["ip", "netns", "pids", ns], capture_output=True, text=True)
        for pid in done.stdout.split():
            try:
                os.kill(int(pid), signal.SIGKILL)
            except (ProcessLookupError, ValueError):
                pass
    time.sleep(0.2)
    for ns in netns:
        subprocess.run(["ip", "netns", "del", ns], capture_output=True)
        subprocess.run(["rm", "-rf", str(Path("/etc/netns") / ns)], capture_output=True)
    subprocess.run(["ip", "link", "del", f"gb{rid}"], capture_output=True)
    # (A managed database the rehearsal ran on its bridge, should its driver have been killed.)
    subprocess.run(["pkill", "-INT", "-f", f"listen_addresses={subnet_of(rid)}.1 "], capture_output=True)
    (RUNNING_DIR / rid).unlink(missing_ok=True)


def remove_leftovers(progress: Callable[[str], None] = lambda msg: None) -> None:
    """What rehearsals whose driver is gone (killed before it cleaned up) left behind."""
    if not RUNNING_DIR.is_dir():
        return
    listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout.split()
    for record in RUNNING_DIR.iterdir():
        try:
            os.kill(int(record.read_text().strip()), 0)
            continue  # (still running)
        except (ProcessLookupError, ValueError):
            pass
        except PermissionError:
            continue
        netns = [n for n in listed if n.startswith(f"gaas-{record.name}-")]
        progress(f"removing what an earlier rehearsal ({record.name}) left: {len(netns)} pods' namespaces")
        _remove(record.name, netns)


def subnet_of(rid: str) -> str:
    """The /24 of rehearsal rid (10.2xx.N): its bridge is at .1, its pods from .10."""
    return f"10.{200 + int(rid[:2], 16) % 50}.{int(rid[2:], 16)}"


def _kill_group(pid: int, sig: int) -> None:
    try:
        os.killpg(pid, sig)
    except (ProcessLookupError, PermissionError):
        pass
