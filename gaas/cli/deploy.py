"""`gaas apply`, `gaas diff` and `gaas rollout ...`: the deployment file applied to a running mesh
without restarting it (new pools start, removed ones drain, a new version is rolled out), what
applying it would change, and each model's roll-outs: their weights, the SLO guard's figures and
decisions, and the operator's commands (pause, resume, promote, undo) and the revision history."""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from gaas.cli.common import DEFAULT_RUN_DIR, add_mesh_args, admin_call, fail


def _read(args) -> tuple[str, Path] | int:
    """The file's text, checked here first (errors name the file, line and field); or an exit code."""
    from gaas.model.build import check_sources
    from gaas.settings.deployspec import SpecError, parse_text, root_of

    path = Path(args.file)
    try:
        text = path.read_text()
    except OSError as exc:
        return fail(f"cannot read {args.file}: {exc.strerror}", 2)
    try:
        parse_text(text, root_of(path), args.file, check=check_sources)
    except SpecError as exc:
        return fail(str(exc), 2)
    return text, path.resolve()


def _changes(result: dict) -> str:
    width = max((len(c["subject"]) for c in result["changes"]), default=0)
    return "\n".join(f"  {c['subject']:<{width}}  {c['kind']:<8} {c['detail']}" for c in result["changes"])


def cmd_apply(args) -> int:
    read = _read(args)
    if isinstance(read, int):
        return read
    text, path = read
    result, code = admin_call(args, lambda a: a.apply_deployment(text, str(path), f"gaas apply -f {args.file}",
                                                                 dry_run=args.dry_run))
    if code is not None:
        return code
    if args.json:
        print(json.dumps(result, indent=2))
        return 0
    if not result["changes"]:
        print(f"{args.file}: nothing to change; the mesh runs it already")
        return 0
    if args.dry_run:
        print(f"{args.file} would change (nothing applied: --dry-run):\n{_changes(result)}")
        return 0
    print(f"applied {args.file} as revision {result['revision']}:\n{_changes(result)}")
    rolling = [c["subject"] for c in result["changes"] if c["kind"] == "rollout"]
    for model in rolling:
        print(f"  follow it: gaas rollout status {model} --watch")
    return 0


def cmd_diff(args) -> int:
    """Like `kubectl diff`: exit 0 when nothing would change, 1 when something would, 2 on errors."""
    read = _read(args)
    if isinstance(read, int):
        return read
    text, path = read
    result, code = admin_call(args, lambda a: a.apply_deployment(text, str(path), "gaas diff", dry_run=True))
    if code is not None:
        return 2
    if args.json:
        print(json.dumps(result["changes"], indent=2))
    elif result["changes"]:
        print(_changes(result))
    else:
        print(f"{args.file}: no difference from what the mesh runs")
    return 1 if result["changes"] else 0


def _ms(at: float) -> str:
    return time.strftime("%H:%M:%S", time.localtime(at))


def rollout_text(s: dict) -> str:
    """A roll-out's status as `gaas rollout status` prints it."""
    state, weight = s["state"], s["weight"]
    what = {"progressing": f"at {weight}% (step {s['step'] + 1} of {len(s['steps'])})", "switched": "switched: 100%",
            "shadowing": f"shadowing: {s.get('shadow', 0)}% of requests copied to it", "starting": "starting its workers",
            "paused": f"paused at {weight}%"}.get(state, state)
    lines = [f"{s['model']}: {s['strategy']} of {s['version']} over {s['stable']}: {what}"]
    figures = s.get("figures") or {}
    old, new = figures.get(s["stable"]) or {}, figures.get(s["version"]) or {}
    since = f"since {_ms(s['since'])}"
    if not (old.get("requests") or new.get("requests")):
        # Nothing in the window now (an ended roll-out): the figures of its last decision that had some.
        decided = next((d for d in reversed(s["decisions"]) if (d.get("figures") or {}).get("new")), None)
        if decided is not None:
            old, new = decided["figures"].get("stable") or {}, decided["figures"]["new"]
            since = f"at {_ms(decided['at'])}"
    if old.get("requests") or new.get("requests"):
        lines.append(f"  the guard's window, {since}: {'':<12}{s['stable'] + ' (stable)':<22}"
                     f"{s['version'] + ' (new)'}")

        def row(name: str, f) -> None:
            lines.append(f"    {name:<38}{f(old):<22}{f(new)}")

        row("requests", lambda d: str(d.get("requests", 0)))
        row("errors", lambda d: f"{d.get('errors', 0)} ({d.get('error_rate', 0):.1%})")
        tiers = sorted(set(old.get("ttft_p95_ms", {})) | set(new.get("ttft_p95_ms", {})))
        for tier in tiers:
            row(f"TTFT p95 {tier}", lambda d, t=tier: (f"{d['ttft_p95_ms'][t]['p95']:.0f} ms (n={d['ttft_p95_ms'][t]['n']})"
                                                       if t in d.get("ttft_p95_ms", {}) else "-"))
        row("decoding, tokens/s", lambda d: f"{d.get('tokens_per_s', 0):.0f}")
    lines.append("  decisions:")
    for d in s["decisions"]:
        lines.append(f"    {_ms(d['at'])}  {d['state']:<12} {d['weight']:>3}%  {d['reason']}")
    return "\n".join(lines)


def cmd_rollout_status(args) -> int:
    while True:
        status, code = admin_call(args, lambda a: a.rollout(args.model))
        if code is not None:
            return code
        if args.json:
            print(json.dumps(status, indent=2 if not args.watch else None), flush=True)
        else:
            if args.watch and sys.stdout.isatty():
                print("\033[2J\033[H", end="")
            print(rollout_text(status), flush=True)
        if not args.watch or status["state"] in ("promoted", "rolled-back", "halted"):
            return 0
        time.sleep(args.every)
        if not sys.stdout.isatty() and not args.json:
            print()


def cmd_rollout_history(args) -> int:
    revisions, code = admin_call(args, lambda a: a.revisions(args.model or ""))
    if code is not None:
        return code
    if args.json:
        print(json.dumps(revisions, indent=2))
        return 0
    if not revisions:
        print("no revision yet" + (f" changed {args.model}" if args.model else ""))
        return 0
    for r in revisions:
        print(f"revision {r['number']:<4} {time.strftime('%Y-%m-%d %H:%M:%S', time.localtime(r['applied_unix_ms'] / 1000))}"
              f"  {r['origin']}")
        for line in r["changes"] or ["(no change to the models)"]:
            print(f"    {line}")
    return 0


def cmd_rollout_change(args) -> int:
    status, code = admin_call(args, lambda a: a.change_rollout(args.model, args.action,
                                                               getattr(args, "to_revision", 0) or 0))
    if code is not None:
        return code
    if args.json:
        print(json.dumps(status, indent=2))
    else:
        print(rollout_text(status))
    return 0


def register(sub) -> None:
    """`gaas apply`, `gaas diff`, `gaas rollout`."""
    apply = sub.add_parser(
        "apply", help="apply a deployment file to the running mesh (models, versions, replicas, roll-outs)",
        description="Check FILE (errors name its line and field), then apply it to the running mesh: new models' "
        "workers start, removed ones drain, changed replicas scale, and a model whose version changed is rolled out "
        "from its stable version by its rollout policy (canary, blue-green or shadow), guarded by its SLOs. Each "
        "apply that changes something is a numbered revision (`gaas rollout history`).")
    apply.add_argument("-f", "--file", required=True, help="the deployment file (deploy/gaas.yaml's shape)")
    apply.add_argument("--dry-run", action="store_true", help="say what would change; change nothing (as gaas diff)")
    apply.add_argument("--json", action="store_true", help="machine-readable output")
    add_mesh_args(apply, workers=False)
    apply.add_argument("--control", default=None, help=argparse.SUPPRESS)
    apply.set_defaults(func=cmd_apply)

    diff = sub.add_parser("diff", help="what applying a deployment file would change (exit 1 when anything would)",
                          description="What `gaas apply -f FILE` would change on the running mesh, applying "
                          "nothing. Exits 0 when nothing would change, 1 when something would, 2 on an error.")
    diff.add_argument("-f", "--file", required=True, help="the deployment file")
    diff.add_argument("--json", action="store_true", help="machine-readable output")
    add_mesh_args(diff, workers=False)
    diff.add_argument("--control", default=None, help=argparse.SUPPRESS)
    diff.set_defaults(func=cmd_diff)

    rollout = sub.add_parser("rollout", help="a model's roll-outs: status, history, pause, resume, promote, undo",
                             description="Roll-outs start when `gaas apply` changes a served model's version.")
    rsub = rollout.add_subparsers(dest="rollout_command", required=True, metavar="COMMAND")

    def common(p) -> None:
        p.add_argument("--json", action="store_true", help="machine-readable output")
        p.add_argument("--run-dir", default=str(DEFAULT_RUN_DIR), help="the mesh's run directory (default: .gaas)")
        p.add_argument("--topology", default=str(Path(__file__).resolve().parents[2] / "deploy" / "topology.yaml"),
                       help=argparse.SUPPRESS)
        p.add_argument("--control", default=None, help="host:port of control's sidecar (default: the running mesh's)")

    status = rsub.add_parser("status", help="a model's roll-out: its weights, the guard's figures, its decisions")
    status.add_argument("model")
    status.add_argument("--watch", action="store_true", help="print it again every --every seconds until it ends")
    status.add_argument("--every", type=float, default=2.0, help=argparse.SUPPRESS)
    common(status)
    status.set_defaults(func=cmd_rollout_status)

    history = rsub.add_parser("history", help="the numbered revisions of the deployment (what each changed)")
    history.add_argument("model", nargs="?", help="only the revisions that changed this model")
    common(history)
    history.set_defaults(func=cmd_rollout_history)

    for action, text in (("pause", "hold a roll-out at its weight (the guard still rolls it back on a breach)"),
                         ("resume", "let a paused roll-out step up again"),
                         ("promote", "make the new version the stable one now (blue-green's finish; a shadow "
                                     "becomes a canary)"),
                         ("undo", "roll a live roll-out back; an ended one: the model's previous version "
                                  "(or --to-revision's) rolled out again")):
        p = rsub.add_parser(action, help=text)
        p.add_argument("model")
        if action == "undo":
            p.add_argument("--to-revision", type=int, default=0, help="the revision whose version of the model to go "
                           "back to (gaas rollout history)")
        common(p)
        p.set_defaults(func=cmd_rollout_change, action=action)
