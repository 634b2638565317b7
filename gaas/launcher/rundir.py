"""A mesh's run directory and ports on this host: the state file `gaas up` writes, the lock one
`gaas up` per run directory holds, and a free block of ports below Linux's ephemeral range."""

from __future__ import annotations

import fcntl
import os
import socket
from pathlib import Path

from gaas.launcher.errors import MeshError


STATE_FILE = "mesh.json"


# Held (flock) by the `gaas up` that runs from a run directory, for its whole life; the kernel
# releases it however that process ends, kill -9 included.
LOCK_FILE = "up.lock"


def port_in_use(host: str, port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.settimeout(0.2)
        return s.connect_ex((host, port)) == 0


def ephemeral_ports() -> tuple[int, int]:
    """Linux's range of ports for outgoing connections (where a listener may find its port taken)."""
    try:
        low, high = Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()
        return int(low), int(high)
    except (OSError, ValueError):
        return 32768, 60999


def free_port_base(host: str = "127.0.0.1", span: int = 200, start: int = 30000) -> int:
    """A port base with `span` free ports above it (for tests and side-by-side meshes), from start
    up to the ephemeral range, then below start: never in the ephemeral range, where an outgoing
    connection may take a port the mesh is about to listen on."""
    low = ephemeral_ports()[0]
    floor = 10000
    bases = [*range(start, low - span + 1, span), *range(start - span, floor - 1, -span)]
    for base in bases:
        if not any(port_in_use(host, p) for p in range(base, base + span, 1)):
            return base
    raise MeshError(f"no free block of {span} ports found between {floor} and {low} (the ephemeral range begins "
                    "there); stop what holds them (ss -ltnp shows which process)")


def lock_run_dir(run_dir: Path) -> int:
    """Take run_dir for this process (the returned descriptor holds it until the process ends);
    MeshError naming the `gaas up` that holds it already. Two starts racing in one run directory
    cannot both pass, as they could by reading the state file (written only once a start is done)."""
    run_dir.mkdir(parents=True, exist_ok=True)
    fd = os.open(run_dir / LOCK_FILE, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        holder = os.pread(fd, 32, 0).decode(errors="replace").strip() or "?"
        os.close(fd)
        raise MeshError(f"a mesh is already running from {run_dir} (gaas up, pid {holder}): `gaas status` shows it, "
                        f"`kill {holder}` stops it; or start another with --run-dir DIR and other ports "
                        "(--port-base, --ingress-port)") from None
    os.ftruncate(fd, 0)
    os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
    return fd
