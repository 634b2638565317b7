"""`gaas placement`: where each pool's workers may run on this host, and why. Each pool's device
requirement (deploy/gaas.yaml's `device:`) against this host's devices (each GPU as NVML describes
it, or the CPU): the devices that fit, and for each other the reason it does not
(gaas.contracts.device). The pools are the running mesh's (control's ListPools), or a file's (-f)."""

from __future__ import annotations

import json
from pathlib import Path

from gaas.cli.common import add_mesh_args, fail, mesh_state, mesh_topology


def _pools_of_file(path: Path) -> list[dict]:
    from gaas.settings import deployspec

    spec = deployspec.load(path)
    return [{"model": m.name, "version": m.version, "role": "declared", "device": m.device,
             "device_needs": dict(m.device_needs)} for m in spec.served]


def _pools_of_mesh(args) -> list[dict]:
    from gaas.sdk.admin import Admin

    topo = mesh_topology(args, mesh_state(Path(args.run_dir)))
    with Admin(topo.of("control")[0].inbound, Path(args.run_dir)) as a:
        return a.pools()


def explain(pools: list[dict], profiles) -> list[dict]:
    """Each pool with its requirement, the devices that fit and why each other does not."""
    from gaas.contracts.device import DeviceRequirement, choose

    out = []
    for p in pools:
        need = DeviceRequirement.parse(p.get("device_needs") or p.get("device") or "any")
        c = choose(need, profiles)
        out.append({"model": p["model"], "version": p["version"], "role": p.get("role", ""),
                    "needs": need.describe(), "requirement": need.as_dict(),
                    "fits": [d.label for d in c.fits], "refused": dict(c.refused), "placeable": c.placeable})
    return out


def cmd_placement(args) -> int:
    from gaas.contracts.errors import GaasError
    from gaas.host.profiles import host_profiles
    from gaas.settings.deployspec import SpecError

    try:
        pools = _pools_of_file(Path(args.file)) if args.file else _pools_of_mesh(args)
    except SpecError as exc:
        return fail(str(exc))
    except (GaasError, OSError) as exc:
        return fail(f"cannot ask the mesh's control plane for its pools ({exc}); is the mesh running (`gaas status`)? "
                    "`gaas placement -f deploy/gaas.yaml` explains a file's pools without one")
    profiles = host_profiles()
    rows = explain(pools, profiles)
    if args.json:
        print(json.dumps({"devices": [d.label for d in profiles], "pools": rows}, indent=2))
        return 0 if all(r["placeable"] for r in rows) else 1
    print("this host's devices:")
    for d in profiles:
        print(f"  {d.label}")
    for r in rows:
        role = f" ({r['role']})" if r["role"] else ""
        print(f"\n{r['model']} {r['version']}{role}: needs {r['needs']}")
        for label in r["fits"]:
            print(f"  fits     {label}")
        for label, why in r["refused"].items():
            print(f"  refused  {label}: {why}")
        if not r["placeable"]:
            print("  -> no worker of it can start here: give it another device requirement (`device:` in the file), "
                  "or run it on a host that has such a device")
    return 0 if all(r["placeable"] for r in rows) else 1


def register(sub) -> None:
    """`gaas placement`."""
    p = sub.add_parser("placement", help="where each pool's workers may run on this host, and why",
                       description=__doc__)
    add_mesh_args(p)
    p.add_argument("-f", "--file", default=None, help="explain this deployment file's pools (no mesh needed)")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.set_defaults(func=cmd_placement)
