"""`gaas restart`: a rolling restart of the running mesh's instances, one at a time, each drained
first. The command finds the mesh and the instances meant; gaas.launcher.supervisor restarts them."""

from __future__ import annotations

import sys
from pathlib import Path

from gaas.cli.common import add_mesh_args, fail, mesh_state, mesh_topology
from gaas.cli.router_settings import registry_refresh_seconds


def cmd_restart(args) -> int:
    """Restart instances one at a time: SIGTERM (the instance drains: NOT_SERVING, deregistered,
    calls in flight finish), `gaas up` starts it again, and the next waits until it serves."""
    from gaas.launcher.supervisor import RESTARTABLE, RestartError, instances_named, rolling_restart

    run_dir = Path(args.run_dir)
    state = mesh_state(run_dir)
    if state is None:
        return fail(f"no mesh is running from {run_dir} (start one with `gaas up`, or give --run-dir)", 2)
    topo = mesh_topology(args, state)
    instances = instances_named(topo, args.target)
    if not instances:
        names = ", ".join(i.name for i in topo.instances)
        return fail(f"nothing called {args.target!r} to restart: give a service ({', '.join(RESTARTABLE)}), "
                    f"'all', or an instance ({names})", 2)
    for kind in sorted({i.service for i in instances}):
        if len(topo.of(kind)) == 1:
            print(f"note: {kind} has one replica: requests that need it fail while it restarts; run two "
                  f"(topology replicas, or --workers 2) for a restart nobody notices", file=sys.stderr)
    try:
        rolling_restart(topo, instances, state=lambda: mesh_state(run_dir), run_dir=run_dir, timeout=args.timeout,
                        router_refresh_seconds=registry_refresh_seconds(),
                        progress=lambda line: print(line, flush=True))
    except RestartError as exc:
        return fail(str(exc), 1)
    return 0


def register(sub) -> None:
    """`gaas restart`."""
    rs = sub.add_parser("restart", help="restart instances one at a time, each drained first",
                        description="A rolling restart of a running mesh: each instance gets SIGTERM (it stops "
                        "taking requests, finishes those in flight, and a worker deregisters), `gaas up` starts it "
                        "again, and the next one waits until it serves. With two or more replicas of a service "
                        "no request fails.")
    rs.add_argument("target", help="a service (control, kvcache, billing, worker, router), 'all', or one "
                    "instance (e.g. worker-1)")
    rs.add_argument("--timeout", type=float, default=300.0,
                    help="seconds each instance may take to serve again (300: a worker loads its model)")
    add_mesh_args(rs, workers=False)
    rs.set_defaults(func=cmd_restart)
