"""Redis for a mesh (found answering, or started with a password and per-service ACL users), and
the secrets each process is given: only those its job needs, in a bare environment."""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from urllib.parse import urlparse

from gaas.launcher.errors import MeshError


def redis_answers(url: str, timeout: float = 1.0) -> bool:
    import redis

    try:
        client = redis.Redis.from_url(url, socket_timeout=timeout, socket_connect_timeout=timeout)
        try:
            return bool(client.ping())
        finally:
            client.close()
    except (redis.RedisError, OSError):
        return False


def redis_server_command(
    host: str, port: int, data_dir: Path, durable: bool = False, config: Path | None = None,
) -> list[str]:
    """The command line of a local Redis; MeshError when none is installed. durable: an append-only
    file fsynced every second in data_dir (usage events waiting for billing survive a restart);
    otherwise nothing is saved. config: a file read first (where a password stays off the command
    line)."""
    binary = shutil.which("redis-server") or next(
        (p for p in ("/usr/bin/redis-server", "/usr/sbin/redis-server") if os.path.exists(p)), None
    )
    if binary is None:
        raise MeshError(
            "redis-server is not installed: `apt-get install redis-server` (make install does), "
            "or set GAAS_REDIS_URL to a running Redis"
        )
    data_dir.mkdir(parents=True, exist_ok=True, mode=0o700)
    persistence = ["--appendonly", "yes", "--appendfsync", "everysec"] if durable else ["--appendonly", "no"]
    first = [str(config)] if config else []
    return [binary, *first, "--port", str(port), "--bind", host, "--save", "", *persistence, "--dir", str(data_dir)]


def private_secret(path: Path) -> str:
    """The secret kept in path (readable by its owner only), made at first use."""
    import secrets

    if path.exists():
        return path.read_text().strip()
    secret = secrets.token_urlsafe(24)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(secret + "\n")
    return secret


def with_password(url: str, password: str) -> str:
    u = urlparse(url)
    return u._replace(netloc=f":{password}@{u.hostname}:{u.port or 6379}").geturl()


# Variables holding secrets (or where they live): each goes to the services that need it and to
# no other process (an Envoy, Redis, the trace collector get none of them).
SECRETS = {
    "GAAS_STRIPE_API_KEY": ("billing",),
    "GAAS_DATABASE_URL": ("control",),
    "GAAS_BILLING_DATABASE_URL": ("billing",),
    # (each service that uses Redis gets a URL of its own: its ACL user, gaas.ops.redisacl)
    "GAAS_REDIS_URL": (),
    # (the gaas CLI's, never a service's)
    "GAAS_API_KEY": (),
}


# Services that use Redis.
REDIS_CLIENTS = ("control", "router", "worker", "billing")


# What the environment of an Envoy or Redis holds (they read their config files; an Envoy its name
# for the access log too).
BARE_ENV = ("PATH", "HOME", "LANG", "LC_ALL", "TZ")


def without_secrets(env: dict[str, str]) -> dict[str, str]:
    return {k: v for k, v in env.items() if k not in SECRETS}


# The password of the Redis `gaas up` starts, in the run directory.
REDIS_PASSWORD_FILE = "redis-password"
