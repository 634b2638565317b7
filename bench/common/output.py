"""A benchmark's output: progress lines on stderr, named after the benchmark, and its results as a JSON
file (bench/results/ by default); its tables are its own."""

from __future__ import annotations

import json
import sys
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent.parent
# Where each benchmark writes its JSON unless told otherwise (--out).
RESULTS = ROOT / "bench" / "results"


def progress(name: str) -> Callable[[str], None]:
    """say(msg): a progress line "<name>: msg" on stderr, at once."""

    def say(msg: str) -> None:
        print(f"{name}: {msg}", file=sys.stderr, flush=True)

    return say


def write_json(path: str | Path, doc: object) -> Path:
    """doc as indented JSON with a final newline at path, its folder made if need be; the path."""
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(doc, indent=2) + "\n")
    return out


def failed_requests(runs) -> int:
    """The requests that failed across runs (each a dict with "failed")."""
    return sum(r["failed"] for r in runs)


def closing(out: Path, runs) -> int:
    """A serving benchmark's last lines: each failed request's reason (a run's "failures"), where
    its JSON went, how many requests failed; its exit status (1: some failed)."""
    for r in runs:
        for why in r.get("failures", ()):
            print(f"  failed: {why}")
    failed = failed_requests(runs)
    print(f"\nwritten: {out}" + (f"\n{failed} requests FAILED" if failed else "; no request failed"))
    return 1 if failed else 0


def finish(path: str | Path, results: dict, runs, report) -> int:
    """A serving benchmark's end: how many of its runs' requests failed, recorded in results, the
    JSON written, report(results) printed, then closing()'s lines; its exit status."""
    runs = list(runs)
    results["failed"] = failed_requests(runs)
    out = write_json(path, results)
    report(results)
    return closing(out, runs)
