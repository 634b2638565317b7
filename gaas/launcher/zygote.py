"""The worker zygote: one process per `gaas up` that imports a service's module and what it names
to hold imported (vLLM, ~10 s of one core here) once, and forks each CPU worker from there instead
of starting a new interpreter that imports it all again.

    python -m gaas.launcher.zygote SOCKET MODULE

Zygote side (main): imports MODULE and the modules its ZYGOTE_PRELOAD names, then listens on the
Unix socket SOCKET (0600): each connection sends one request (a JSON line: the environment, the
cores, the log file, the working directory) and gets back the pid of a process forked for it. That
process is forked twice (the first fork exits at once), so that it is not the zygote's child but
`gaas up`'s: `gaas up` is a child subreaper (children.become_subreaper), so Linux hands it the
orphan. A worker thus outlives a zygote that dies, and `gaas up` waits for it and reads its exit
code as it does any child's. The process starts as `gaas up` starts its other children: a session
(process group) of its own, SIGTERM when `gaas up` dies (Linux's parent-death signal, set once it is
`gaas up`'s), its cores, its log as stdout and stderr, exactly the given environment; then it runs
MODULE as __main__, as `python -m` would, and exits as an interpreter would (threads joined, exit
handlers run).

Launcher side: Zygote.spawn, and ZygoteChild, the part of subprocess.Popen the launcher uses. A
child forked so shows the zygote's command line (its short name, in `ps -o comm` and top, is its
log's: worker-0) and the environment the zygote started with in /proc (its own is in its memory): `gaas up` gives the zygote a worker's environment but what is
each worker's own (workerenv.zygote_env), and only a worker whose environment matches it
elsewhere is forked (fits): what a library reads when it is imported or an interpreter starts
(LD_PRELOAD, OpenMP's threads, Hugging Face's offline switches) is the zygote's.
"""

from __future__ import annotations

import atexit
import ctypes
import importlib
import json
import os
import runpy
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Mapping
from pathlib import Path

# A child's own, read when it runs (not when a module is imported): its settings, its cores, its
# engine's cache size, where it sends traces.
OWN_PREFIXES = ("GAAS_", "OTEL_")
OWN_VARIABLES = frozenset({"VLLM_CPU_OMP_THREADS_BIND", "VLLM_CPU_KVCACHE_SPACE"})
# How long a spawn waits for the zygote's imports (its first requests wait for them).
READY_TIMEOUT = 180.0


def own(name: str) -> bool:
    """Whether environment variable name may differ between the zygote and a child of it."""
    return name.startswith(OWN_PREFIXES) or name in OWN_VARIABLES


def fits(zygote_env: Mapping[str, str], env: Mapping[str, str]) -> bool:
    """Whether a process with environment env may be forked from a zygote started with zygote_env:
    they agree on everything but what is each child's own."""
    return all(zygote_env.get(k) == env.get(k) for k in {*zygote_env, *env} if not own(k))


class ZygoteChild:
    """A child the zygote forked for `gaas up`, which became `gaas up`'s own child: what of
    subprocess.Popen `gaas up` uses (pid, poll, wait, send_signal, returncode)."""

    def __init__(self, pid: int) -> None:
        self.pid = pid
        self.returncode: int | None = None

    def poll(self) -> int | None:
        if self.returncode is None:
            try:
                pid, status = os.waitpid(self.pid, os.WNOHANG)
            except ChildProcessError:
                # Not this process's child yet (the zygote's first fork is exiting), or gone unseen.
                if not os.path.exists(f"/proc/{self.pid}"):
                    self.returncode = -signal.SIGKILL
                return self.returncode
            if pid:
                self.returncode = os.waitstatus_to_exitcode(status)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.poll() is None:
            if deadline is not None and time.monotonic() >= deadline:
                raise subprocess.TimeoutExpired(str(self.pid), timeout)
            time.sleep(0.02)
        return self.returncode

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:
            os.kill(self.pid, sig)


class Zygote:
    """The launcher's side: asks the zygote listening at path for children."""

    def __init__(self, path: Path, env: Mapping[str, str], module: str) -> None:
        self.path, self.env, self.module = path, dict(env), module

    def fits(self, cmd: list[str], env: Mapping[str, str]) -> bool:
        return cmd == [sys.executable, "-m", self.module] and fits(self.env, env)

    def spawn(self, env: Mapping[str, str], cpus: set[int] | None, log: Path, cwd: Path,
              alive: Callable[[], bool], timeout: float = READY_TIMEOUT) -> ZygoteChild | None:
        """Fork a child: None when the zygote does not answer within timeout (while alive() says
        it runs: its first requests wait for its imports), or at all."""
        request = json.dumps({"env": dict(env), "cpus": sorted(cpus or ()), "log": str(log), "cwd": str(cwd)})
        deadline = time.monotonic() + timeout
        conn = socket.socket(socket.AF_UNIX)
        while True:
            try:
                conn.connect(str(self.path))
                break
            except (FileNotFoundError, ConnectionRefusedError):
                if time.monotonic() > deadline or not alive():
                    conn.close()
                    return None
                time.sleep(0.1)
        try:
            conn.settimeout(max(1.0, deadline - time.monotonic()))
            conn.sendall(request.encode() + b"\n")
            return ZygoteChild(int(_read_line(conn, "the zygote closed the connection before its answer")))
        except (OSError, ValueError):
            return None  # (a child forked after this is killed by the zygote: nobody asked for it any more)
        finally:
            conn.close()


def _read_line(conn: socket.socket, closed: str) -> bytes:
    """One line from conn, the protocol's one message each way (OSError(closed) at an early end)."""
    line = b""
    while not line.endswith(b"\n"):
        data = conn.recv(65536)
        if not data:
            raise OSError(closed)
        line += data
    return line


# ----------------------------------------------------------------------------- the zygote itself

_LIBC = ctypes.CDLL(None, use_errno=True)


def main(argv: list[str]) -> None:
    path, module = argv
    target = importlib.import_module(module)
    for name in getattr(target, "ZYGOTE_PRELOAD", ()):
        importlib.import_module(name)
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass
    listener = socket.socket(socket.AF_UNIX)
    listener.bind(path)
    os.chmod(path, 0o600)
    listener.listen(64)
    print(f"zygote: {module} and what it preloads imported; forking its processes from {path}", flush=True)
    launcher = os.getppid()
    while True:
        conn, _ = listener.accept()
        with conn:
            _serve(conn, module, launcher, listener)


def _serve(conn: socket.socket, module: str, launcher: int, listener: socket.socket) -> None:
    """Read conn's request, fork its process (twice: launcher, a child subreaper, adopts it) and
    answer its pid."""
    try:
        conn.settimeout(10)
        request = json.loads(_read_line(conn, "closed before its request"))
    except (OSError, ValueError) as exc:
        print(f"zygote: a bad request ({exc}); ignored", flush=True)
        return
    first = os.fork()
    if first == 0:
        try:
            listener.close()
            middle = os.getpid()
            child = os.fork()
            if child == 0:
                conn.close()
                _run_child(module, request, middle, launcher)
            try:
                conn.sendall(f"{child}\n".encode())
            except OSError:
                os.kill(child, signal.SIGKILL)  # nobody waits for it any more
        finally:
            os._exit(0)
    os.waitpid(first, 0)


def _run_child(module: str, request: dict, middle: int, launcher: int) -> None:
    """In the forked child: become `gaas up`'s (once the fork between has exited), then the process
    it asked for; run module, exit."""
    code = 1
    try:
        os.setsid()
        while os.getppid() == middle:
            time.sleep(0.001)
        _LIBC.prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG: gaas up's death
        # Named in ps's and top's short form (its command line is the zygote's): its log's name.
        _LIBC.prctl(15, ctypes.c_char_p(Path(request["log"]).stem.encode()[:15]), 0, 0, 0)  # PR_SET_NAME
        if os.getppid() != launcher:
            raise SystemExit(f"gaas up (pid {launcher}) is gone, or did not adopt this process; not starting")
        if request["cpus"]:
            os.sched_setaffinity(0, set(request["cpus"]))
        fd = os.open(request["log"], os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
        os.dup2(fd, 1)
        os.dup2(fd, 2)
        os.close(fd)
        null = os.open(os.devnull, os.O_RDONLY)
        os.dup2(null, 0)
        os.close(null)
        os.chdir(request["cwd"])
        os.environ.clear()
        os.environ.update(request["env"])
        sys.argv = [sys.executable]
        runpy.run_module(module, run_name="__main__", alter_sys=True)
        code = 0
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
        if not isinstance(exc.code, int) and exc.code is not None:
            print(exc.code, file=sys.stderr)
    except BaseException:  # noqa: BLE001 - as an interpreter would: the traceback, then exit 1
        import traceback

        traceback.print_exc()
    finally:
        # As an interpreter exits: its threads joined, its exit handlers run, its output flushed.
        try:
            threading._shutdown()
            atexit._run_exitfuncs()
            sys.stdout.flush()
            sys.stderr.flush()
        finally:
            os._exit(code)


if __name__ == "__main__":
    main(sys.argv[1:])
