"""The ingress's Envoys as `gaas up` runs them: the open files their connections need, raised
before they start; stopping them gently, their listeners closed (no new connections), then the
requests in flight through them given time to finish (what `gaas up` does first when it stops)."""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path

from gaas.ops import probe

ACTIVE = "/stats?filter=^http.ingress.downstream_rq_active$"


def drain(admins: list[Path], seconds: float, progress: Callable[[str], None]) -> None:
    """Close the listeners of the Envoys whose admin sockets are admins, and wait, up to seconds,
    for the requests in flight through them to finish (an Envoy that does not answer is done)."""
    live = []
    for admin in admins:
        try:
            probe.envoy_admin(admin, "/drain_listeners", method="POST")
            live.append(admin)
        except OSError:
            pass
    deadline = time.monotonic() + seconds
    said = False
    while live and time.monotonic() < deadline:
        active = 0
        for admin in live:
            try:
                _, body = probe.envoy_admin(admin, ACTIVE)
                active += int(body.decode().rsplit(":", 1)[-1].strip() or 0)
            except (OSError, ValueError):
                pass
        if active == 0:
            return
        if not said:
            progress(f"the ingress takes no new connections; waiting up to {seconds:.0f} s for {active} "
                     "request(s) in flight to finish")
            said = True
        time.sleep(0.2)
    if live:
        progress("requests still in flight through the ingress are cut")


def raise_open_files(progress: Callable[[str], None]) -> None:
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
        progress(f"open files are limited to {target} (ulimit -Hn): the ingress holds at most about "
                      f"{target // 2} client connections (raise the hard limit for {edge.MAX_CONNECTIONS})")
