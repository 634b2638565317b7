"""Stopping the ingress's Envoys gently: their listeners closed (no new connections), then the
requests in flight through them given time to finish. What `gaas up` does first when it stops."""

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
