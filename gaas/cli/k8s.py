"""`gaas k8s render|validate`: the mesh on Kubernetes, from the same topology and
deployment file as `gaas up` (gaas/k8s)."""

from __future__ import annotations

from pathlib import Path

from gaas.cli.common import ROOT, fail, say

DEFAULT_OUT = ROOT / "deploy" / "k8s"


def _topology(args):
    from gaas.ops import topology

    # The file alone: GAAS_* overrides of this shell describe a local mesh, not the cluster's.
    return topology.load(Path(args.topology), env={})


def cmd_render(args) -> int:
    from gaas.k8s import manifests, render
    from gaas.ops.topology import TopologyError
    from gaas.settings.deployspec import SpecError

    out = Path(args.out)
    opts = manifests.Options(replicas=args.replicas, postgres=not args.postgres_url, prometheus=args.prometheus)
    try:
        written = render.write(out, _topology(args), Path(args.file), opts, with_secrets=not args.no_secrets,
                               postgres_url=args.postgres_url)
    except (TopologyError, SpecError) as exc:
        return fail(str(exc))
    say(f"wrote {len(written)} files under {out}/ (base, overlays/cpu, overlays/gpu)"
        + ("" if args.no_secrets else f"; secrets in {out / 'secrets'}/ (keep them out of version control)"))
    say(f"next: gaas k8s validate --dir {out}; then kubectl apply -k {out}/overlays/cpu (or gpu)")
    return 0


def cmd_validate(args) -> int:
    from gaas.k8s import validate

    d = Path(args.dir)
    if not (d / "secrets" / "kustomization.yaml").exists():
        return fail(f"{d}/secrets is missing: `gaas k8s render --out {d}` makes it (the overlays include it)")
    failed = False
    for overlay in args.overlay or ("cpu", "gpu"):
        try:
            objs = validate.validate(d / "overlays" / overlay)
        except validate.ValidationFailed as exc:
            failed = True
            print(f"overlays/{overlay}: INVALID\n{exc}")
            continue
        print(f"overlays/{overlay}: {len(objs)} objects valid for Kubernetes {', '.join(validate.VERSIONS)}"
              " and the project's rules")
    return 1 if failed else 0


def manifests_default(field: str):
    from gaas.k8s.manifests import Options

    return getattr(Options(), field)


def register(sub) -> None:
    k8s = sub.add_parser("k8s", help="the mesh on Kubernetes: render and validate its manifests",
                         description="Render the mesh as Kustomize manifests from the topology and the deployment "
                                     "file, validate them, (docs/kubernetes.md).")
    ksub = k8s.add_subparsers(dest="k8s_command", required=True, metavar="ACTION")
    render = ksub.add_parser("render", help="write the Kustomize base, the cpu and gpu overlays and the secrets")
    render.add_argument("--out", default=str(DEFAULT_OUT), help=f"output directory ({DEFAULT_OUT.relative_to(ROOT)})")
    render.add_argument("--topology", default=str(ROOT / "deploy" / "topology.yaml"), help="the topology file")
    render.add_argument("-f", "--file", default=str(ROOT / "deploy" / "gaas.yaml"), help="the deployment file")
    render.add_argument("--replicas", type=int, default=2,
                        help="replicas of each stateless service (their autoscalers' least), default 2")
    render.add_argument("--postgres-url", default="",
                        help="a managed PostgreSQL (postgresql://USER:PASSWORD@HOST:PORT): control and billing use "
                             "its databases 'control' and 'billing'; without it a trial PostgreSQL runs in the cluster")
    render.add_argument("--prometheus", default=manifests_default("prometheus"),
                        help="where KEDA reads the workers' queue and KV-cache use (default: the Prometheus "
                             "Operator's address, %(default)s)")
    render.add_argument("--no-secrets", action="store_true",
                        help="write no secrets (what the checked-in example is)")
    render.set_defaults(func=cmd_render)
    val = ksub.add_parser("validate", help="build each overlay and check it against Kubernetes' schemas and our rules")
    val.add_argument("--dir", default=str(DEFAULT_OUT), help="what `gaas k8s render --out` wrote")
    val.add_argument("--overlay", action="append", choices=("cpu", "gpu"), help="only this overlay (repeatable)")
    val.set_defaults(func=cmd_validate)
