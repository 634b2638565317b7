"""The secrets of a rendered mesh, as files in DIR/secrets (never checked in): the mesh's CA and a
certificate per Deployment (each pod mounts only its own), Redis's config with a password and a
user per service, each service's environment Secret (its Redis URL, its database URL, Stripe's
key for billing) and, for a trial PostgreSQL, its password and the script that makes each
service's database, and the ingress's certificate (a trial one with a CA of its own, ingress-ca.crt,
for clients to trust: replace ingress-tls.crt and ingress-tls.key with yours, or let cert-manager
issue it). A kustomization there turns them into Secrets.

Made once and kept: rendering again reuses what is there (the CA and its certificates, the
passwords), so a cluster's running pods keep trusting each other. Edit a service's .env file to
point it at a managed Redis or PostgreSQL; a new render keeps the edit."""

from __future__ import annotations

import os
import secrets as pysecrets
from pathlib import Path

import yaml

from gaas.k8s import edge as edgemod
from gaas.k8s import manifests, pods
from gaas.launcher.secrets import REDIS_CLIENTS, SECRETS
from gaas.ops import pki, redisacl
from gaas.ops.topology import Topology

SECRETS_DIR = "secrets"
# Service kind -> the variable of its database's URL (the secrets it is given: gaas.launcher.secrets).
DATABASES = {kind: var for var, kinds in SECRETS.items() if var.endswith("DATABASE_URL") for kind in kinds}


def _write(path: Path, text: str) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(text)


def _kept(path: Path, make) -> str:
    """The secret kept in path, made (by make()) at first use."""
    if path.exists():
        return path.read_text().strip()
    value = make()
    _write(path, value + "\n")
    return value


def _env_file(path: Path, values: dict[str, str]) -> None:
    """A service's .env: values written where the file lacks them (an operator's edits stay)."""
    have: dict[str, str] = {}
    if path.exists():
        for line in path.read_text().splitlines():
            if "=" in line and not line.lstrip().startswith("#"):
                k, v = line.split("=", 1)
                have[k.strip()] = v
    merged = {**values, **have}
    _write(path, "".join(f"{k}={v}\n" for k, v in merged.items()))


def write(out: Path, topo: Topology, *, postgres: bool | str = True, edge: edgemod.Edge | None = None) -> Path:
    """Make (or keep) every secret file of topo's Deployments under out/secrets and its
    kustomization; returns that directory. postgres: True for the trial StatefulSet, else the
    URL of a managed server (postgresql://user:password@host:port) whose databases control and
    billing are given (their names "control" and "billing"). edge: how the ingress serves (its
    certificate's Secret is made here unless it serves plaintext or cert-manager issues it)."""
    edge = edge or edgemod.Edge()
    d = out / SECRETS_DIR
    d.mkdir(parents=True, exist_ok=True)
    os.chmod(d, 0o700)
    authority = pki.Authority(d)
    authority.ensure()
    generators: list[dict] = []
    # The operator's (the gaas CLI's, `--run-dir DIR/secrets`): in no Secret.
    operator = authority.credentials(*pki.OPERATOR)
    if not operator.cert.exists():
        authority.issue(*pki.OPERATOR)
    identities = [(pods.INGRESS, pki.INGRESS)] + [(i.name, pods.identity(i)) for i in topo.instances]
    for name, (kind, ident) in identities:
        creds = authority.credentials(kind, ident)
        if not (creds.cert.exists() and creds.key.exists()):
            authority.issue(kind, ident)
        generators.append({"name": f"{name}-tls", "files": [
            f"ca.crt={pki.PKI_DIR}/ca.crt", f"{creds.cert.name}={pki.PKI_DIR}/{creds.cert.name}",
            f"{creds.key.name}={pki.PKI_DIR}/{creds.key.name}"]})

    if not edge.plaintext and not edge.issuer:
        edgemod.trial_certificate(d, edge.dns_names(pods.NAMESPACE))
        generators.append({"name": edge.tls_secret, "type": "kubernetes.io/tls",
                           "files": [f"tls.crt={edgemod.TRIAL_CERT}", f"tls.key={edgemod.TRIAL_KEY}"]})

    # Redis: the default user's password is the operator's; each service kind has a user.
    password = _kept(d / "redis-password", lambda: pysecrets.token_urlsafe(24))
    users = {}
    for kind in redisacl.PERMISSIONS:
        users[kind] = redisacl.ServiceUser(f"gaas-{kind}", _kept(d / f"redis-{kind}.password",
                                                                 lambda: pysecrets.token_urlsafe(24)))
    conf = [f"requirepass {password}", *redisacl.config_lines(users), "bind 0.0.0.0", f"port {pods.REDIS_PORT}",
            "dir /data", "appendonly yes", "appendfsync everysec", 'save ""']
    _write(d / "redis.conf", "\n".join(conf) + "\n")
    generators.append({"name": f"{pods.REDIS}-config", "files": ["redis.conf"]})
    redis_url = f"redis://{pods.REDIS}:{pods.REDIS_PORT}/0"

    if postgres is True:
        pg_password = _kept(d / "postgres-password", lambda: pysecrets.token_urlsafe(24))
        _env_file(d / f"{pods.POSTGRES}.env", {"POSTGRES_PASSWORD": pg_password})
        generators.append({"name": f"{pods.POSTGRES}-env", "envs": [f"{pods.POSTGRES}.env"]})
        db_passwords = {k: _kept(d / f"postgres-{k}.password", lambda: pysecrets.token_urlsafe(24)) for k in DATABASES}
        init = "".join(f"CREATE USER gaas_{k} PASSWORD '{p}';\nCREATE DATABASE {k} OWNER gaas_{k};\n"
                       for k, p in db_passwords.items())
        _write(d / "init.sql", init)
        generators.append({"name": f"{pods.POSTGRES}-init", "files": ["init.sql"]})
        db_urls = {k: f"postgresql://gaas_{k}:{p}@{pods.POSTGRES}:{pods.POSTGRES_PORT}/{k}"
                   for k, p in db_passwords.items()}
    else:
        base = str(postgres).rstrip("/")
        db_urls = {k: f"{base}/{k}" for k in DATABASES}

    for inst in topo.instances:
        keys = manifests.secret_keys(inst.service)
        if not keys:
            continue
        values = {}
        if inst.service in REDIS_CLIENTS:
            values["GAAS_REDIS_URL"] = redisacl.url_for(redis_url, users[inst.service])
        if inst.service in DATABASES:
            values[DATABASES[inst.service]] = db_urls[inst.service]
        if "GAAS_STRIPE_API_KEY" in keys:
            values["GAAS_STRIPE_API_KEY"] = ""
        env_name = manifests.secret_env_name(inst.name)
        _env_file(d / f"{env_name}.env", values)
        generators.append({"name": env_name, "envs": [f"{env_name}.env"]})

    kustomization = {
        "apiVersion": "kustomize.config.k8s.io/v1beta1", "kind": "Kustomization",
        "generatorOptions": {"disableNameSuffixHash": True, "labels": dict(pods.PART_OF)},
        "secretGenerator": generators,
    }
    _write(d / "kustomization.yaml", "# Generated by `gaas k8s render`; secrets: never commit this directory.\n"
           + yaml.safe_dump(kustomization, sort_keys=False))
    return d
