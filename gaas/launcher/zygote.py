"""The worker zygote: one process per `gaas up` that imports a service's module and what it names
to hold imported (vLLM, ~10 s of one core here) once, and forks each CPU worker from there instead
of starting a new interpreter that imports it all again.

    python -m gaas.launcher.zygote SOCKET MODULE

Zygote side (main): imports MODULE and the modules its ZYGOTE_PRELOAD names, then listens on the
Unix socket SOCKET (0600): each connection sends one request (a JSON line: the environment, the
cores, the log file, the working directory) and gets back the pid of a child forked for it, then,
when that child exits, its exit code (as subprocess.Popen's returncode). The child starts as `gaas
up` starts its other children: a session (process group) of its own, SIGTERM when the zygote dies
(Linux's parent-death signal; the zygote has the same from `gaas up`), its cores, its log as
stdout and stderr, and exactly the given environment; then runs MODULE as __main__, as `python -m`
would, and exits as an interpreter would (threads joined, exit handlers run).

Launcher side: Zygote.spawn, and ZygoteChild, the part of subprocess.Popen the launcher uses. A
child forked so shows the zygote's command line and the environment the zygote started with in
/proc (its own is in its memory): `gaas up` gives the zygote a worker's environment but what is
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
import select
import selectors
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
    """A child the zygote forked: what of subprocess.Popen `gaas up` uses (pid, poll, wait,
    send_signal, returncode), its exit code read from the zygote's answer."""

    def __init__(self, pid: int, conn: socket.socket) -> None:
        self.pid = pid
        self.returncode: int | None = None
        self._conn = conn
        # What the zygote said so far; None once it closed without an answer.
        self._answer: bytes | None = b""

    def poll(self) -> int | None:
        if self.returncode is None and (self._answer is None or select.select([self._conn], [], [], 0)[0]):
            self._read()
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.poll() is None:
            left = 1.0 if deadline is None else deadline - time.monotonic()
            if left <= 0:
                raise subprocess.TimeoutExpired(str(self.pid), timeout)
            if self._answer is None:  # (the zygote went: nothing more to read)
                time.sleep(min(left, 0.1))
            else:
                select.select([self._conn], [], [], min(left, 1.0))
        return self.returncode

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:
            os.kill(self.pid, sig)

    def _read(self) -> None:
        data = b""
        if self._answer is not None:
            try:
                data = self._conn.recv(64)
            except OSError:
                pass
            self._answer += data
        if self._answer and self._answer.endswith(b"\n"):
            self.returncode = int(self._answer)
        elif not data:
            # The zygote went without a word: its children get SIGTERM as it dies.
            self._answer = None
            if not _alive(self.pid):
                self.returncode = -signal.SIGTERM
        if self.returncode is not None:
            self._conn.close()


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass
    return True


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
            answer = b""
            while not answer.endswith(b"\n"):
                data = conn.recv(64)
                if not data:
                    raise OSError("the zygote closed the connection")
                answer += data
            conn.settimeout(None)
            return ZygoteChild(int(answer), conn)
        except (OSError, ValueError):
            conn.close()  # (a child forked after this is killed by the zygote: nobody asked for it any more)
            return None


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
    sig_r, sig_w = os.pipe()
    os.set_blocking(sig_r, False)
    os.set_blocking(sig_w, False)
    signal.set_wakeup_fd(sig_w)
    signal.signal(signal.SIGCHLD, lambda *_: None)
    children: dict[int, socket.socket] = {}
    selector = selectors.DefaultSelector()
    selector.register(listener, selectors.EVENT_READ)
    selector.register(sig_r, selectors.EVENT_READ)
    while True:
        for key, _ in selector.select():
            if key.fileobj == sig_r:
                os.read(sig_r, 4096)
                _reap(children)
            else:
                conn, _ = listener.accept()
                _serve(conn, module, children, lambda: (selector.close(), listener.close(), os.close(sig_r),
                                                        os.close(sig_w)))


def _reap(children: dict[int, socket.socket]) -> None:
    while True:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        conn = children.pop(pid, None)
        if conn is not None:
            try:
                conn.sendall(f"{os.waitstatus_to_exitcode(status)}\n".encode())
            except OSError:
                pass
            conn.close()


def _serve(conn: socket.socket, module: str, children: dict[int, socket.socket], close: Callable[[], object]) -> None:
    """Read conn's request, fork its child and answer its pid (its exit code follows: _reap)."""
    try:
        conn.settimeout(10)
        line = b""
        while not line.endswith(b"\n"):
            data = conn.recv(65536)
            if not data:
                raise OSError("closed before its request")
            line += data
        request = json.loads(line)
    except (OSError, ValueError) as exc:
        print(f"zygote: a bad request ({exc}); ignored", flush=True)
        conn.close()
        return
    pid = os.fork()
    if pid == 0:
        for other in children.values():
            other.close()
        close()
        conn.close()
        _run_child(module, request)
    try:
        conn.sendall(f"{pid}\n".encode())
        children[pid] = conn
    except OSError:
        os.kill(pid, signal.SIGKILL)  # nobody waits for it any more
        conn.close()


def _run_child(module: str, request: dict) -> None:
    """In the forked child: become the process `gaas up` asked for, run module, exit."""
    code = 1
    try:
        signal.set_wakeup_fd(-1)
        for sig in (signal.SIGCHLD, signal.SIGINT, signal.SIGTERM, signal.SIGUSR1):
            signal.signal(sig, signal.SIG_DFL)
        os.setsid()
        _LIBC.prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
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
