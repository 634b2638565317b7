"""`gaas session list|show|delete`: a tenant's multi-turn sessions, with its API key through the ingress,
or (--tenant) as the mesh's operator through router-0's sidecar."""

from __future__ import annotations

import json
import time
from pathlib import Path

from gaas.cli.common import (add_mesh_args, api_key, fail, ingress_address, ingress_tls, mesh_state,
                             mesh_topology)


def _session_dict(s) -> dict:
    from google.protobuf.json_format import MessageToDict

    return MessageToDict(s, preserving_proto_field_name=True, always_print_fields_with_no_presence=True)


def _session_call(args, method: str, *params):
    """A session call: as the API key's tenant through the ingress, or with --tenant as the mesh's
    operator through router-0's sidecar; (result, None) or (None, exit code)."""
    if getattr(args, "tenant", None):
        from gaas.sdk.admin import RouterAdmin
        from gaas.contracts.errors import GaasError

        address = mesh_topology(args, mesh_state(Path(args.run_dir))).of("router")[0].inbound
        try:
            with RouterAdmin(address) as router:
                return getattr(router, method)(args.tenant, *params), None
        except GaasError as exc:
            return None, fail(f"{exc.code}: {exc.message}", 1)
    return _client_call(args, lambda c: getattr(c, method)(*params))


def _client_call(args, fn):
    """fn(client) against the ingress with the tenant's API key; (result, None) or (None, exit code)."""
    from gaas.sdk.client import GaasClient, GaasError

    target = ingress_address(args)
    try:
        with GaasClient(target, api_key=api_key(args), **ingress_tls(args)) as client:
            return fn(client), None
    except GaasError as exc:
        if exc.code == "UNAVAILABLE" and "connect" in exc.message.lower():
            return None, fail(f"nothing answers at {target}: is the mesh up? (`make run` / `gaas up`)")
        return None, fail(f"{exc.code}: {exc.message}")


def _when(ms: int) -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(ms / 1000)) if ms else "-"


def cmd_session_list(args) -> int:
    rows, err = _session_call(args, "list_sessions", args.limit)
    if err is not None:
        return err
    if args.json:
        print(json.dumps([_session_dict(s) for s in rows], indent=2))
        return 0
    if not rows:
        print("no sessions (a request naming a session_id starts one)")
        return 0
    print(f"{'session':<36} {'model':<14} {'kind':<5} {'ver':>5} {'turns':>6} {'tokens':>8} {'worker':<10} "
          f"{'last turn':<19} {'expires':<19}")
    for s in rows:
        busy = " *" if s.turn_in_progress else ""
        print(f"{s.session_id:<36} {s.model:<14} {s.kind:<5} {s.version:>5} {s.turns:>6} {s.context_tokens:>8} "
              f"{s.worker_id:<10} {_when(s.updated_unix_ms):<19} {_when(s.expires_unix_ms):<19}{busy}")
    if any(s.turn_in_progress for s in rows):
        print("* a turn is in progress")
    return 0


def cmd_session_show(args) -> int:
    s, err = _session_call(args, "get_session", args.session_id)
    if err is not None:
        return err
    if args.json:
        print(json.dumps(_session_dict(s), indent=2))
        return 0
    print(f"session {s.session_id}: {s.kind} with {s.model}, version {s.version}")
    print(f"  turns {s.turns} in context ({s.committed_turns} committed, {s.dropped_turns} dropped to fit), "
          f"{s.context_tokens} tokens; last served by {s.worker_id or '-'}")
    print(f"  started {_when(s.created_unix_ms)}, last turn {_when(s.updated_unix_ms)}, expires "
          f"{_when(s.expires_unix_ms)}{'; a turn is in progress' if s.turn_in_progress else ''}")
    for m in s.messages:
        text = m.content if len(m.content) <= 400 else m.content[:400] + f"... ({len(m.content)} characters)"
        print(f"\n[{m.role}]\n{text}")
    return 0


def cmd_session_delete(args) -> int:
    _, err = _session_call(args, "delete_session", args.session_id)
    if err is not None:
        return err
    print(f"deleted session {args.session_id}")
    return 0


def _ingress_args(sp) -> None:
    """The options of a session command: the ingress and API key, or --tenant as the operator."""
    sp.add_argument("--tenant", default=None,
                    help="as the mesh's operator: this tenant's sessions (through the router's sidecar; no API key)")
    sp.add_argument("--ingress", default=None, help="host:port of the ingress (env GAAS_INGRESS; default: the running mesh's)")
    sp.add_argument("--api-key", default=None, help="API key (env GAAS_API_KEY; default: the demo key `gaas up` saved)")
    add_mesh_args(sp, workers=False)
    sp.add_argument("--json", action="store_true", help="machine-readable output")


def register(sub) -> None:
    """`gaas session` and its actions."""
    session = sub.add_parser(
        "session", help="your multi-turn sessions (the API key's tenant)",
        description="Sessions are conversations GaaS keeps in Redis for a tenant: a request naming a session_id "
        "(gRPC field, the x-gaas-session header or the body's session_id) is a turn of it, and only its new part needs "
        "sending. These commands act with the API key's tenant (GET/DELETE /v1/gaas/sessions at the ingress); another "
        "tenant's session id is not found. The mesh's operator names any tenant with --tenant instead.")
    ssub = session.add_subparsers(dest="session_command", required=True, metavar="ACTION")

    slist = ssub.add_parser("list", help="your sessions, most recent first")
    slist.add_argument("--limit", type=int, default=100, help="most sessions to list (100; at most 1000)")
    _ingress_args(slist)
    slist.set_defaults(func=cmd_session_list)
    sshow = ssub.add_parser("show", help="one session with its conversation")
    sshow.add_argument("session_id")
    _ingress_args(sshow)
    sshow.set_defaults(func=cmd_session_show)
    sdel = ssub.add_parser("delete", help="forget a session")
    sdel.add_argument("session_id")
    _ingress_args(sdel)
    sdel.set_defaults(func=cmd_session_delete)
