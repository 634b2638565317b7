"""How long a newcomer waits: a fresh clone of this repository installed (`scripts/install.sh`, with
the package caches as they are, and with uv's cache empty when asked), its gRPC modules generated,
its mesh started (`gaas up`: the model built, its first start writing the bytecode of what it runs)
up to the first token through the ingress; then a second start, and a worker killed with kill -9
until it serves again (and the CPU seconds that restart cost, beside the worker zygote's), each
worker start split into the steps its log tells (imports, vLLM's engine, the warm-up).

    python -m bench.startup [--cold] [--out bench/results/startup.json]

Goals (issue 46): clone to first token <= 60 s, a second clone's install <= 15 s, a worker ready
<= 15 s after its start.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import signal
import subprocess
import tempfile
import time
import urllib.request
from datetime import datetime
from pathlib import Path

from bench.common.output import RESULTS, ROOT, progress, write_json

say = progress("startup")
READY_S = 120.0


def timed(cmd: list[str], cwd: Path, env: dict | None = None) -> float:
    """Seconds cmd took (it must succeed)."""
    start = time.monotonic()
    subprocess.run(cmd, cwd=cwd, env={**os.environ, **(env or {})}, check=True, stdout=subprocess.DEVNULL)
    return round(time.monotonic() - start, 1)


# Why the last completion asked for failed (said when a wait gives up).
last_failure = ""


def complete(ingress: str, key: str) -> bool:
    """Whether a completion through the ingress is answered."""
    global last_failure
    body = json.dumps({"model": "gaas-tiny", "prompt": "Hello", "max_tokens": 4}).encode()
    req = urllib.request.Request(f"http://{ingress}/v1/completions", body, {
        "Authorization": f"Bearer {key}", "Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=10) as r:
            return json.loads(r.read()).get("object") == "text_completion"
    except OSError as exc:
        last_failure = f"{exc}: {exc.read()[:200]!r}" if hasattr(exc, "read") else str(exc)
        return False


class Up:
    """`gaas up` of the clone, in its own run directory and ports."""

    def __init__(self, clone: Path, port_base: int) -> None:
        self.clone, self.run_dir = clone, clone / ".gaas-bench"
        self.ingress = f"127.0.0.1:{port_base + 190}"
        self.log = clone / "up.log"
        self.proc: subprocess.Popen | None = None

    def start(self, port_base: int) -> float:
        """Seconds from the command to the first token through the ingress."""
        started = time.monotonic()
        self.proc = subprocess.Popen(
            [str(self.clone / ".venv/bin/gaas"), "up", "--run-dir", str(self.run_dir), "--port-base", str(port_base),
             "--ingress-port", str(port_base + 190)], cwd=self.clone, stdout=self.log.open("a"), stderr=subprocess.STDOUT)
        key_file = self.run_dir / "demo-key"
        banners = len(re.findall(r"GaaS is up in", self.log.read_text()))
        first_token = None
        # The first token, and `gaas up` done starting (a worker killed before that ends its start).
        while first_token is None or len(re.findall(r"GaaS is up in", self.log.read_text())) == banners:
            if self.proc.poll() is not None or time.monotonic() - started > READY_S:
                raise RuntimeError(f"the mesh did not serve within {READY_S:g} s ({last_failure}): see {self.log}")
            if first_token is None and key_file.exists() and complete(self.ingress, key_file.read_text().strip()):
                first_token = round(time.monotonic() - started, 1)
            time.sleep(0.25)
        return first_token

    def banner_s(self) -> float | None:
        """What the last start's banner said ("GaaS is up in N s")."""
        found = re.findall(r"GaaS is up in ([0-9.]+) s", self.log.read_text())
        return float(found[-1]) if found else None

    def worker_pid(self) -> int:
        return json.loads((self.run_dir / "mesh.json").read_text())["children"]["worker-0"]

    def cpu_s(self, name: str) -> float | None:
        """CPU seconds (user and system) of the mesh's child name and every process below it, from /proc."""
        from gaas.host.placement import descendants

        pid = json.loads((self.run_dir / "mesh.json").read_text())["children"].get(name)
        if pid is None:
            return None
        total = 0
        for p in (pid, *descendants(pid)):
            try:
                with open(f"/proc/{p}/stat") as f:
                    fields = f.read().rsplit(")", 1)[1].split()
                total += int(fields[11]) + int(fields[12])
            except (OSError, IndexError, ValueError):
                pass
        return round(total / os.sysconf("SC_CLK_TCK"), 1)

    def kill_worker(self) -> float:
        """kill -9 of worker-0; seconds until a completion through the ingress succeeds again."""
        old = self.worker_pid()
        killed = time.monotonic()
        os.kill(old, signal.SIGKILL)
        key = (self.run_dir / "demo-key").read_text().strip()
        while True:
            if time.monotonic() - killed > READY_S:
                raise RuntimeError(f"worker-0 did not serve again within {READY_S:g} s ({last_failure})")
            try:
                if self.worker_pid() != old and complete(self.ingress, key):
                    return round(time.monotonic() - killed, 1)
            except (OSError, KeyError, ValueError):
                pass
            time.sleep(0.25)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            self.proc.wait(timeout=120)


def worker_starts(log: Path) -> list[dict]:
    """Each start of a worker in its log: seconds from the process's start to listening, to its
    engine up (imports and vLLM's engine) and to SERVING (after the warm-up)."""
    starts, cur = [], None
    for line in log.read_text(errors="replace").splitlines():
        if line.startswith("=== "):
            cur = {"start": datetime.strptime(line[4:23], "%Y-%m-%d %H:%M:%S").timestamp()}
            starts.append(cur)
            continue
        if cur is None or not line.startswith("{"):
            continue
        try:
            rec = json.loads(line)
        except ValueError:
            continue
        at = datetime.fromisoformat(rec["ts"].replace("Z", "+00:00")).timestamp()
        msg = rec.get("msg", "")
        for mark, name in ((" listening on ", "listening_s"), ("engine up in", "engine_up_s"),
                           ("health: SERVING", "serving_s")):
            if mark in msg:
                cur.setdefault(name, round(at - cur["start"], 1))
    return [{k: v for k, v in s.items() if k != "start"} for s in starts]


def run(cold: bool, port_base: int) -> dict:
    work = Path(tempfile.mkdtemp(prefix="gaas-startup-"))
    clone = work / "clone"
    results: dict = {"when": datetime.now().isoformat(timespec="seconds")}
    up = None
    try:
        say(f"cloning {ROOT} into {clone}")
        subprocess.run(["git", "clone", "-q", str(ROOT), str(clone)], check=True)
        if cold:
            say("install with uv's cache empty")
            results["install_cold_s"] = timed(["bash", "scripts/install.sh"], clone,
                                              {"UV_CACHE_DIR": str(work / "uv-cache"), "PIP_NO_CACHE_DIR": "1"})
            shutil.rmtree(clone / ".venv")
            shutil.rmtree(work / "uv-cache", ignore_errors=True)
        say("install (package caches as they are)")
        results["install_s"] = timed(["bash", "scripts/install.sh"], clone)
        say("make proto")
        results["proto_s"] = timed([str(clone / ".venv/bin/python"), "-m", "gaas.ops.protogen"], clone)
        up = Up(clone, port_base)
        say("gaas up, to the first token (its first start: the model built, bytecode written)")
        results["first_up_to_token_s"] = up.start(port_base)
        results["first_up_banner_s"] = up.banner_s()
        results["clone_to_first_token_s"] = round(
            results["install_s"] + results["proto_s"] + results["first_up_to_token_s"], 1)
        up.stop()
        say("gaas up again")
        results["second_up_to_token_s"] = up.start(port_base)
        results["second_up_banner_s"] = up.banner_s()
        say("kill -9 of worker-0, until it serves again")
        results["worker_killed_to_token_s"] = up.kill_worker()
        results["worker_restart_cpu_s"] = up.cpu_s("worker-0")
        results["zygote_cpu_s"] = up.cpu_s("zygote")
        up.stop()
        results["worker_starts"] = worker_starts(up.run_dir / "logs" / "worker-0.log")
    except BaseException:
        say(f"failed: the clone and its logs are kept in {work}")
        raise
    else:
        shutil.rmtree(work, ignore_errors=True)
    finally:
        if up is not None:
            up.stop()
    return results


def report(r: dict) -> None:
    rows = [
        ("a second clone's install (caches warm)", r.get("install_s"), "<= 15 s"),
        ("install with uv's cache empty", r.get("install_cold_s"), ""),
        ("make proto", r.get("proto_s"), ""),
        ("first gaas up to the first token (model built, bytecode written)", r.get("first_up_to_token_s"), ""),
        ("clone to first token (install + proto + first up)", r.get("clone_to_first_token_s"), "<= 60 s"),
        ("second gaas up to the first token", r.get("second_up_to_token_s"), ""),
        ("worker kill -9 to the first token again", r.get("worker_killed_to_token_s"), ""),
    ]
    cpu = [
        ("the restarted worker and its processes, to that first token", r.get("worker_restart_cpu_s")),
        ("the worker zygote (vLLM imported once per gaas up; none: no zygote)", r.get("zygote_cpu_s")),
    ]
    print(f"\n{'step':<66} {'seconds':>8}  goal")
    for name, value, goal in rows:
        print(f"{name:<66} {'-' if value is None else value:>8}  {goal}")
    print(f"\n{'CPU seconds':<66}")
    for name, value in cpu:
        print(f"{name:<66} {'-' if value is None else value:>8}")
    print("\nworker starts (s from the process's start): listening / engine up / SERVING (goal: SERVING <= 15 s)")
    for i, s in enumerate(r.get("worker_starts", ())):
        print(f"  start {i + 1}: {s.get('listening_s', '-')} / {s.get('engine_up_s', '-')} / {s.get('serving_s', '-')}")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cold", action="store_true", help="also install once with uv's cache empty (3.5 GB of disk)")
    ap.add_argument("--port-base", type=int, default=27000, help="the clone's mesh's ports (27000-27199)")
    ap.add_argument("--out", default=str(RESULTS / "startup.json"), help="where the JSON goes")
    args = ap.parse_args(argv)
    results = run(args.cold, args.port_base)
    out = write_json(args.out, results)
    report(results)
    print(f"\nwritten: {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
