"""The SITS2026 scorecard (seed 003's six dimensions) measured on a live mesh: the scorecard's own
(started from deploy/'s files serving 2 workers of gaas-tiny and 1 of gaas-long, stopped at the end)
or a running one (--target RUN_DIR: a `gaas up`'s run directory, reached as its operator). Each
dimension runs a workload built for it; the matrix is printed beside the seed's three columns
(FastAPI + Triton, vLLM + a custom router, a SITS2026-certified platform), every GaaS cell from
this run's figures, and a cell this host cannot measure says why and which host would. Writes
bench/results/sits.json, sits.png (a chart) and sits.html (a page with both).

    gaas bench sits [--target RUN_DIR] [--only 1,2,...] [--quick] [--json] [--out FILE]

  1 GPU-aware routing     signals, decision cost, TTFT vs round robin on a skewed load
  2 KV-cache sharing      hit rate at each level (request, session, tenant, public prefix; never
                          across tenants or models)
  3 dynamic batching      the latency loop on and off under a step load; the windows' trace
  4 fragmentation         internal, engine preemptions, directory, under churn
  5 long-context switch   4K -> 32K with and without the session's context cached
  6 heterogeneous         device profiles and the placement's decisions

Comparisons that restart the routers with other settings (round robin; the loop off) run on the
scorecard's own mesh only; on a target they are reported as not measured, with why.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import sys
import time
from pathlib import Path

from bench.common.output import RESULTS, progress
from bench.sits import batching, fragmentation, hetero, kvshare, routing, switching
from bench.sits.card import DIMENSIONS, Dimension
from bench.sits.report import document, text, write_all
from bench.sits.target import own_target, running_target

MODULES = {"gpu_aware_routing": routing, "kv_cache_sharing": kvshare, "dynamic_batching": batching,
           "memory_fragmentation": fragmentation, "long_context_switch": switching,
           "heterogeneous_orchestration": hetero}
# The order they run in: the cheap one first, the KV levels before the churn and the restarts.
RUN_ORDER = ("heterogeneous_orchestration", "kv_cache_sharing", "gpu_aware_routing", "dynamic_batching",
             "long_context_switch", "memory_fragmentation")

say = progress("sits")
FAILED = "the workload failed"


def chosen(only: str) -> list[str]:
    keys = [k for k, _, _ in DIMENSIONS]
    if not only:
        return keys
    out = []
    for item in only.split(","):
        item = item.strip()
        if item.isdigit() and 1 <= int(item) <= len(keys):
            out.append(keys[int(item) - 1])
        elif item in keys:
            out.append(item)
        else:
            raise SystemExit(f"sits: --only takes dimension numbers 1-{len(keys)} or names ({', '.join(keys)}), "
                             f"got {item!r}")
    return out


def host() -> str:
    from gaas.host.devices import cpu_model, visible_gpus

    gpus = visible_gpus()
    cores = len(os.sched_getaffinity(0))
    if gpus:
        return f"{len(gpus)} x {gpus[0].name}, {cores} cores"
    return f"{cores} cores ({cpu_model()}), no GPU"


def _measure(target, keys: list[str], quick: bool) -> tuple[dict[str, Dimension], str]:
    """Each dimension of keys measured on the target (a context manager of a Target), in RUN_ORDER;
    a dimension that fails says why and the others go on."""
    dims: dict[str, Dimension] = {}
    with target as t:
        for key in [k for k in RUN_ORDER if k in keys]:
            began = time.monotonic()
            try:
                d = MODULES[key].measure(t, say, quick)
            except Exception as exc:  # noqa: BLE001 - one dimension failing must not lose the others'
                say(f"{key} FAILED: {type(exc).__name__}: {exc}")
                d = Dimension(key, error=f"{FAILED}: {type(exc).__name__}: {exc}")
            d.seconds = time.monotonic() - began
            dims[key] = d
            say(f"{d.title}: {d.cell or d.error} ({d.seconds:.0f} s)")
        mesh = ("the scorecard's own mesh (2 workers of gaas-tiny, 1 of gaas-long)" if t.own
                else f"the mesh running from {t.run_dir}")
    return dims, mesh


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="gaas bench sits", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", metavar="RUN_DIR", default=None,
                    help="measure the mesh `gaas up` runs from RUN_DIR instead of starting one")
    ap.add_argument("--only", default="", help="dimensions to measure: numbers 1-6 or names, comma-separated")
    ap.add_argument("--quick", action="store_true", help="shorter workloads (fewer requests per figure)")
    ap.add_argument("--json", action="store_true", help="print the scorecard as JSON instead of the table")
    ap.add_argument("--out", default=str(RESULTS / "sits.json"),
                    help="where the JSON goes (the PNG and HTML beside it, same name; default bench/results/sits.json)")
    ap.add_argument("--keep-logs", action="store_true", help="keep the scorecard's own mesh's run directory")
    args = ap.parse_args(argv)
    from gaas.launcher.errors import MeshError

    keys = chosen(args.only)
    started = time.monotonic()
    target = (running_target(Path(args.target)) if args.target
              else own_target(say, keep_logs=args.keep_logs))
    try:
        measured = _measure(target, keys, args.quick)
    except MeshError as exc:
        say(f"the scorecard's mesh did not start: {exc} (rerun with --keep-logs to keep its logs)")
        return 1
    dims, mesh = measured
    setup = {"mesh": mesh, "host": host(), "when": datetime.datetime.now().isoformat(timespec="seconds"),
             "seconds": round(time.monotonic() - started, 1), "quick": args.quick, "target": args.target}
    doc = document([dims[k] for k, _, _ in DIMENSIONS if k in dims], setup)
    paths = write_all(doc, Path(args.out))
    if args.json:
        print(json.dumps(doc, indent=2))
    else:
        print("\n" + text(doc))
        print("written: " + ", ".join(str(p) for p in paths))
    # A dimension whose workload failed fails the run; one the target cannot serve (no second worker,
    # no 32K model) is a cell that says why.
    return 1 if any(d.error.startswith(FAILED) for d in dims.values()) else 0


if __name__ == "__main__":
    sys.exit(main())
