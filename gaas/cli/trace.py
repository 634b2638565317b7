"""`gaas trace`: show the spans `gaas up --trace` collected (<run dir>/traces.jsonl) as one request's
waterfall, a list of the latest traces, JSON or Chrome trace events (gaas.ops.traces reads and draws them)."""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from gaas.cli.common import DEFAULT_RUN_DIR, fail, mesh_state, say


def cmd_trace(args) -> int:
    from gaas.ops import traces

    path = Path(args.file) if args.file else Path(args.run_dir) / traces.TRACES_FILE
    if not path.is_file():
        state = mesh_state(Path(args.run_dir)) or {}
        if state.get("trace_endpoint") and not state.get("traces_file"):
            return fail(f"this mesh sends its spans to {state['trace_endpoint']}: look for them there")
        return fail(f"no traces collected at {path}: start the mesh with `gaas up --trace` (or give --file)")
    collected = traces.load(path)
    if not collected:
        return fail(f"{path} holds no spans yet: send a request first (spans arrive within a few seconds)")
    if args.list:
        shown = list(collected.values())[-args.limit:]
        if args.json:
            print(json.dumps([{"trace_id": t.trace_id, "start_ns": t.start_ns, "duration_ms": round(t.duration_ms, 3),
                               "spans": len(t.spans), "services": t.services(), "request_ids": sorted(t.request_ids())}
                              for t in shown]))
            return 0
        print(f"{'trace id':<32}  {'spans':>5} {'ms':>9}  {'started':<12}  request")
        for t in shown:
            started = time.strftime("%H:%M:%S", time.localtime(t.start_ns / 1e9))
            print(f"{t.trace_id:<32}  {len(t.spans):>5} {t.duration_ms:>9.2f}  {started:<12}  "
                  f"{', '.join(sorted(t.request_ids())) or '-'}")
        return 0
    try:
        trace = traces.find(collected, args.key) if args.key else list(collected.values())[-1]
    except traces.TraceError as exc:
        return fail(str(exc))
    if args.chrome:
        Path(args.chrome).write_text(json.dumps(traces.chrome_events(trace)))
        say(f"wrote {args.chrome}: open it in https://ui.perfetto.dev or chrome://tracing")
        return 0
    if args.json:
        print(json.dumps({"trace_id": trace.trace_id, "spans": [
            {"span_id": s.span_id, "parent_span_id": s.parent_id, "service": s.service, "name": s.name,
             "start_ns": s.start_ns, "end_ns": s.end_ns, "attributes": s.attributes} for s in trace.spans]}))
        return 0
    print(traces.waterfall(trace))
    return 0


def register(sub) -> None:
    """`gaas trace`."""
    tr = sub.add_parser("trace", help="show a request's trace across the Envoys and services (gaas up --trace)",
                        description="Read the spans `gaas up --trace` collected (<run dir>/traces.jsonl) and show one "
                        "request's trace as a waterfall: every Envoy and service it crossed, parented, with the "
                        "routing decision's attributes. Without KEY: the latest trace.")
    tr.add_argument("key", nargs="?", help="a trace id (or its first 6+ characters) or a request id (gaas generate "
                    "--explain prints the trace id)")
    tr.add_argument("--list", action="store_true", help="list the latest traces instead")
    tr.add_argument("--limit", type=int, default=20, help="how many --list shows (20)")
    tr.add_argument("--chrome", metavar="FILE", help="write the trace as Chrome trace events (for ui.perfetto.dev)")
    tr.add_argument("--json", action="store_true", help="print JSON instead")
    tr.add_argument("--file", help="a traces file other than the running mesh's")
    tr.add_argument("--run-dir", default=str(DEFAULT_RUN_DIR), help=argparse.SUPPRESS)
    tr.set_defaults(func=cmd_trace)
