"""`gaas k8s render|validate|rehearse`: the mesh on Kubernetes, from the same topology and
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
    from gaas.k8s import edge, manifests, render
    from gaas.ops.topology import TopologyError
    from gaas.settings.deployspec import SpecError

    out = Path(args.out)
    ingress = edge.Edge(tls_secret=args.tls_secret, issuer=args.cert_manager_issuer, hosts=tuple(args.ingress_host),
                        plaintext=args.plaintext_ingress, xff_trusted_hops=args.xff_trusted_hops,
                        proxy_protocol=args.proxy_protocol)
    if ingress.issuer:
        try:
            ingress.issuer_ref()
        except ValueError as exc:
            return fail(str(exc), 2)
    if args.xff_trusted_hops < 0:
        return fail("--xff-trusted-hops is a count of load balancers: 0 or more", 2)
    opts = manifests.Options(replicas=args.replicas, postgres=not args.postgres_url, prometheus=args.prometheus,
                             edge=ingress, files_size=args.files_size, files_storage_class=args.files_storage_class)
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
    k8s = sub.add_parser("k8s", help="the mesh on Kubernetes: render, validate and rehearse its manifests",
                         description="Render the mesh as Kustomize manifests from the topology and the deployment "
                                     "file, validate them, or rehearse them on this machine (docs/kubernetes.md).")
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
    tls = render.add_argument_group("the ingress (docs/kubernetes.md: TLS at the ingress, the client's address)")
    tls.add_argument("--tls-secret", default=manifests_default("edge").tls_secret,
                     help="the kubernetes.io/tls Secret the ingress serves HTTPS with on 443 (default %(default)s; "
                          "the secrets hold a trial certificate under this name: replace its files with yours)")
    tls.add_argument("--cert-manager-issuer", default="", metavar="KIND/NAME",
                     help="let cert-manager issue and renew that Secret: ClusterIssuer/NAME or Issuer/NAME "
                          "(the certificate names every --ingress-host)")
    tls.add_argument("--ingress-host", action="append", default=[], metavar="HOST",
                     help="a name clients reach the ingress by, for its certificate (repeatable)")
    tls.add_argument("--plaintext-ingress", action="store_true",
                     help="plain HTTP on port 80 instead of HTTPS: only behind something of yours that terminates TLS")
    tls.add_argument("--xff-trusted-hops", type=int, default=0, metavar="N",
                     help="load balancers in front of the ingress that append the client's address to "
                          "X-Forwarded-For, trusted to (a cloud's HTTP load balancer: 1); default 0")
    tls.add_argument("--proxy-protocol", action="store_true",
                     help="the load balancer sends the PROXY protocol (a network load balancer set to)")
    files = render.add_argument_group("batch files")
    files.add_argument("--files-size", default=manifests_default("files_size"),
                       help="the ReadWriteMany volume billing's replicas share for batch files (default %(default)s)")
    files.add_argument("--files-storage-class", default="",
                       help="its storage class, one that offers ReadWriteMany (default: the cluster's default class)")
    render.set_defaults(func=cmd_render)
    val = ksub.add_parser("validate", help="build each overlay and check it against Kubernetes' schemas and our rules")
    val.add_argument("--dir", default=str(DEFAULT_OUT), help="what `gaas k8s render --out` wrote")
    val.add_argument("--overlay", action="append", choices=("cpu", "gpu"), help="only this overlay (repeatable)")
    val.set_defaults(func=cmd_validate)
    reh = ksub.add_parser(
        "rehearse", help="run the cpu overlay's pods here, each in its own network namespace (root)",
        description="Render the cpu overlay (a managed PostgreSQL standing in on this machine) and run every pod of "
                    "it as processes in its own Linux network namespace, with the commands, environment and files the "
                    "manifests give its containers (gaas/k8s/rehearsal.py says what is and is not rehearsed). "
                    "--check streams through the ingress with the openai client and kills one pod of each "
                    "Deployment in turn. Needs root.")
    reh.add_argument("--topology", default=str(ROOT / "deploy" / "topology.yaml"), help="the topology file")
    reh.add_argument("-f", "--file", default=str(ROOT / "deploy" / "gaas.yaml"), help="the deployment file")
    reh.add_argument("--workers", type=int, default=2, help="workers of the default model's pool (kubectl scale)")
    reh.add_argument("--work", default="", help="where the manifests, pods' volumes and logs go (a new temporary "
                                                "directory by default)")
    reh.add_argument("--check", action="store_true",
                     help="stream through the ingress, kill one pod of each Deployment in turn, report, stop")
    reh.set_defaults(func=cmd_rehearse)


def cmd_rehearse(args) -> int:
    import signal
    import tempfile

    from gaas.k8s import drill, rehearsal

    def stop(signum, frame):  # a background shell's children start with SIGINT ignored: both, explicitly
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    work = Path(args.work) if args.work else Path(tempfile.mkdtemp(prefix="gaas-rehearsal-"))
    try:
        with drill.rehearse(work, ROOT, deploy_file=Path(args.file), topology_file=Path(args.topology),
                                workers=args.workers, progress=say) as r:
            trust = f" (its certificate's CA: {r.ingress_ca})" if r.ingress_ca else ""
            say(f"ready: the ingress at {r.ingress}{trust} (and every other ingress pod), control at {r.control}"
                f" (gaas --control {r.control} --run-dir {r.secrets} ...); pods' logs under {work}/pods")
            if not args.check:
                say("Ctrl-C stops it")
                signal.pause()
                return 0
            results = drill.survives_kills(r, progress=say)
    except KeyboardInterrupt:
        say("stopped")
        return 130
    except rehearsal.RehearsalError as exc:
        return fail(str(exc))
    print(f"{'killed pod of':<34} {'served while down':>18} {'ready again':>12}")
    for k in results:
        print(f"{k.workload:<34} {k.requests - k.failed:>12}/{k.requests:<5} {k.recovered_s:>10.1f} s")
        for e in k.errors:
            print(f"    {e}")
    return 1 if any(k.failed for k in results) else 0
