"""`gaas k8s rehearse` driven: the cpu overlay rendered and its pods run (gaas/k8s/rehearsal.py runs
them), the operator's commands against a control pod, the official openai client streaming through
an ingress pod over HTTPS (trusting the render's trial CA alone, the certificate checked for the
ingress Service's name), and one pod of each Deployment killed in turn while requests stream."""

from __future__ import annotations

import ssl
import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import httpx

from gaas.k8s import edge, pods
from gaas.k8s.rehearsal import Rehearsal, RehearsalError


@dataclass(slots=True)
class Rehearsed:
    """A running rehearsal: its pods, where the operator's certificate is, the served model."""

    rehearsal: Rehearsal
    manifests: Path
    model: str

    @property
    def secrets(self) -> Path:
        return self.manifests / "secrets"

    def address(self, workload: str, port: int, index: int = 0) -> str:
        return f"{self.rehearsal.of(workload)[index].ip}:{port}"

    @property
    def ingress_ca(self) -> Path | None:
        """The CA the ingress's certificate is signed by (the render's trial one); None when the
        ingress serves plain HTTP."""
        return None if ingress_port(self.rehearsal.objects)[0] == "http" else self.secrets / edge.TRIAL_CA

    def ingress_url(self, index: int = 0) -> str:
        """The OpenAI API's base URL at ingress pod index (https://, unless it serves plaintext)."""
        scheme, port = ingress_port(self.rehearsal.objects)
        return f"{scheme}://{self.rehearsal.of(pods.INGRESS)[index].ip}:{port}/v1"

    @property
    def ingress(self) -> str:
        return self.ingress_url()

    @property
    def control(self) -> str:
        return self.address(pods.deployment_name("control"), pods.INBOUND_PORT)


def rehearse(work: Path, repo: Path, *, deploy_file: Path, topology_file: Path, workers: int = 2,
             ingress_path: str | None = None, progress: Callable[[str], None] = lambda msg: None,
             ready_timeout: float = 420.0):
    """A context manager: the cpu overlay rendered (a managed PostgreSQL standing in on this
    machine, two replicas of every stateless service, workers replicas of the default model's pool;
    ingress_path: the topology's, unless given) and run; yields a Rehearsed; everything stopped and
    removed at the end."""
    from contextlib import ExitStack, contextmanager

    from gaas.k8s import manifests, render, validate
    from gaas.model.build import build_model, is_built
    from gaas.ops import pgserver, topology
    from gaas.settings import deployspec

    @contextmanager
    def run():
        with ExitStack() as stack:
            r = Rehearsal(work, repo, progress)
            stack.callback(r.stop)
            r.network()
            bindir = pgserver.find_binaries()
            if bindir is None:
                raise RehearsalError(pgserver.HOW_TO_INSTALL)
            progress(f"a managed PostgreSQL at {r.host_address} (this machine, on the pods' bridge)")
            url = stack.enter_context(pgserver.ThrowAwayPostgres(
                bindir, host=r.host_address, allow=r.network_cidr, databases=tuple(deployspec_databases())))
            out = work / "manifests"
            render.write(out, topology.load(topology_file, env={}, ingress_path=ingress_path), deploy_file,
                         manifests.Options(replicas=2, postgres=False), postgres_url=url.rsplit("/", 1)[0])
            objects = validate.validate(out / "overlays" / "cpu")
            spec = deployspec.load(deploy_file)
            model = spec.default_model
            # What the image holds built (Containerfile): the served model, built here when missing.
            if model.preset and model.source.startswith("/") and not is_built(Path(model.source)):
                progress(f"building the local model {model.name} ({model.preset}) into {model.source}")
                build_model(model.preset, Path(model.source), seed=model.seed, progress=progress)
            pool = next(p for p in pods.pools(spec) if p["model"] == model.name and p["version"] == model.version)
            # (Billing's replicas share its ReadWriteMany claim: one directory, as a provisioner's volume.)
            r.start(objects, scale={pods.pool_name(pool): workers})
            progress("waiting for every pod to be ready (the workers load their model)")
            r.wait_ready(ready_timeout)
            yield Rehearsed(r, out, model.name)

    return run()


def deployspec_databases() -> list[str]:
    """The databases of a managed PostgreSQL the services use (gaas/k8s/secrets.py names them)."""
    from gaas.k8s.secrets import DATABASES

    return sorted(DATABASES)


def operator(r: Rehearsed, *args: str) -> str:
    """A `gaas` command as the operator (its certificate in the rendered secrets), against a control pod."""
    import sys

    done = subprocess.run([sys.executable, "-m", "gaas.cli.main", *args, "--control", r.control,
                           "--run-dir", str(r.secrets)], capture_output=True, text=True, timeout=60)
    if done.returncode != 0:
        raise RehearsalError(f"gaas {' '.join(args)}: {done.stderr.strip()}")
    return done.stdout + done.stderr


def ingress_port(objects: list[dict]) -> tuple[str, int]:
    """(scheme, port) the ingress's pods serve clients on, as its Deployment opens it."""
    dep = next(o for o in objects if o["kind"] == "Deployment" and o["metadata"]["name"] == pods.INGRESS)
    for c in dep["spec"]["template"]["spec"]["containers"]:
        for p in c.get("ports", []):
            if p.get("name") in ("https", "http"):
                return p["name"], p["containerPort"]
    raise RehearsalError(f"Deployment {pods.INGRESS} opens no http or https port")


class _ServerName(httpx.HTTPTransport):
    """Connects to a pod's address and checks the certificate for the Service's name (as a client
    of the LoadBalancer would, by its name)."""

    def __init__(self, name: str, ca: Path) -> None:
        super().__init__(verify=ssl.create_default_context(cafile=str(ca)), http2=False)
        self._name = name

    def handle_request(self, request: httpx.Request) -> httpx.Response:
        request.extensions = {**request.extensions, "sni_hostname": self._name}
        return super().handle_request(request)


def stream(base_url: str, key: str, model: str, prompt: str = "Once upon a time", ca: Path | None = None) -> str:
    """One streamed chat completion with the official openai client (no retries of its own) at
    base_url; over HTTPS it trusts ca alone, and checks the ingress's certificate names its Service."""
    import openai

    http_client = httpx.Client(transport=_ServerName(pods.INGRESS, ca), timeout=60) if ca else None
    client = openai.OpenAI(base_url=base_url, api_key=key, max_retries=0, timeout=60, http_client=http_client)
    chunks = client.chat.completions.create(model=model, messages=[{"role": "user", "content": prompt}],
                                            max_tokens=12, stream=True)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    if not text:
        raise RehearsalError("the stream carried no text")
    return text


@dataclass(frozen=True, slots=True)
class KillResult:
    workload: str
    pod: str
    # Requests streamed while the pod was down, and how many failed.
    requests: int
    failed: int
    # From the kill to the pod ready again (its containers restarted by their policy).
    recovered_s: float
    errors: tuple[str, ...] = ()


def survives_kills(r: Rehearsed, *, requests: int = 6, progress: Callable[[str], None] = lambda msg: None,
                   ready_timeout: float = 300.0) -> list[KillResult]:
    """A tenant and its key made through a control pod, then for each workload of the mesh in turn
    one of its pods killed (every process, SIGKILL): requests stream through an ingress pod still
    up while it is down, and it must come back ready (its restart policy)."""
    reh = r.rehearsal
    operator(r, "tenant", "create", "rehearsal", "--tier", "gold")
    key = next(w for w in operator(r, "key", "create", "rehearsal").split() if w.startswith("gaas_"))
    stream(r.ingress, key, r.model, ca=r.ingress_ca)
    results = []
    workloads = [w["metadata"]["name"] for w in reh.objects
                 if w["kind"] == "Deployment" and reh.of(w["metadata"]["name"])]
    for workload in workloads:
        pod = reh.of(workload)[0]
        ingress = next(i for i, p in enumerate(reh.of(pods.INGRESS)) if p is not pod)
        progress(f"killing pod {pod.name}")
        t0 = time.monotonic()
        reh.kill_pod(pod)
        errors = []
        for i in range(requests):
            try:
                stream(r.ingress_url(ingress), key, r.model, f"request {i} without {workload}", ca=r.ingress_ca)
            except Exception as exc:  # noqa: BLE001 - what the client saw, reported
                errors.append(f"{type(exc).__name__}: {str(exc)[:160]}")
            time.sleep(0.2)
        reh.wait_ready(ready_timeout, [pod])
        results.append(KillResult(workload, pod.name, requests, len(errors), time.monotonic() - t0, tuple(errors)))
        progress(f"{workload}: {requests - len(errors)}/{requests} served while {pod.name} was down; "
                 f"ready again after {time.monotonic() - t0:.1f} s")
    return results
