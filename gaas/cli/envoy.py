"""`gaas envoy render`: write the ingress and sidecar Envoy configs the topology produces (gaas.envoy.config)."""

from __future__ import annotations

from pathlib import Path

from gaas.cli.common import ROOT, add_mesh_args, mesh_topology


def cmd_envoy_render(args) -> int:
    from gaas.envoy import config as envoyconf
    from gaas.ops import pki, protogen
    from gaas.ops.topology import sockets_root

    topo = mesh_topology(args)
    protogen.generate()
    out = Path(args.out)
    run_dir = Path(args.run_dir).resolve()
    files = envoyconf.render(topo, out, protogen.DESCRIPTOR_SET, run_dir / "logs", pki.Authority(run_dir),
                             sockets=sockets_root(run_dir))
    for name, path in files.items():
        print(f"{name:<20} {path}")
    return 0


def register(sub) -> None:
    """`gaas envoy render`."""
    envoy = sub.add_parser("envoy", help="Envoy configs")
    esub = envoy.add_subparsers(dest="envoy_command", required=True, metavar="ACTION")
    render = esub.add_parser("render", help="write the ingress and sidecar configs the topology produces")
    add_mesh_args(render)
    render.add_argument("--out", default=str(ROOT / "envoy" / "generated"), help="output directory (envoy/generated)")
    render.set_defaults(func=cmd_envoy_render)
